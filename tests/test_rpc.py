"""Remote measurement and tuning over a real TVM RPC tracker and server on 127.0.0.1 (CPU target), the
deadline behaviour when things break, and the power-reading parsers."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli
from edgeq.rpc.power import Sampler, parse_tegrastats, read_hwmon
from edgeq.reference import onnxruntime_session

ORIN = ("11-30-2026 06:00:00 RAM 2450/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@729,1%@729,0%@729,"
        "0%@729,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[305] VIC_FREQ 729 APE 174 cpu@46.5C soc2@45.1C "
        "soc0@45.3C gpu@46.3C tj@46.5C soc1@45.5C VDD_IN 5002mW/5002mW VDD_CPU_GPU_CV 1234mW/1200mW VDD_SOC 1500mW/1490mW")
XAVIER = ("RAM 2786/31919MB (lfb 6662x4MB) SWAP 0/15960MB (cached 0MB) CPU [1%@1190,0%@1190,0%@1190,0%@1190,"
          "off,off,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@1377 APE 150 MTS fg 0% bg 0% AO@39C GPU@39.5C "
          "Tdiode@41.25C PMIC@50C AUX@39C CPU@40.5C thermal@39.85C Tboard@39C GPU 0mW/0mW CPU 460mW/460mW "
          "SOC 1380mW/1380mW CV 0mW/0mW VDDRQ 306mW/306mW SYS5V 2082mW/2082mW")
NANO = ("RAM 1234/3956MB (lfb 512x4MB) SWAP 0/1978MB (cached 0MB) IRAM 0/252kB(lfb 252kB) CPU [5%@1479,2%@1479,"
        "off,off] EMC_FREQ 0%@1600 GR3D_FREQ 0%@76 APE 25 PLL@23C CPU@26C PMIC@100C GPU@24.5C AO@32C "
        "thermal@25.25C POM_5V_IN 2047/2047 POM_5V_GPU 0/0 POM_5V_CPU 369/369")


def test_tegrastats_lines_of_orin_xavier_and_nano():
    from edgeq.targets import profiles

    orin_rails = profiles()["jetson-orin-nano"].power.tegrastats_rails
    assert parse_tegrastats(ORIN, orin_rails) == {"VDD_IN": 5002.0, "VDD_CPU_GPU_CV": 1234.0, "VDD_SOC": 1500.0}
    xavier_rails = profiles()["jetson-agx-xavier"].power.tegrastats_rails
    assert parse_tegrastats(XAVIER, xavier_rails) == {"GPU": 0.0, "CPU": 460.0, "SOC": 1380.0, "CV": 0.0,
                                                      "VDDRQ": 306.0, "SYS5V": 2082.0}
    assert parse_tegrastats(NANO) == {"POM_5V_IN": 2047.0, "POM_5V_GPU": 0.0, "POM_5V_CPU": 369.0}


def fake_ina3221(root: Path, channels: dict[str, tuple[int, int]]) -> Path:
    """An INA3221 hwmon folder laid out as on a Jetson Orin: in<N>_label, in<N>_input (mV), curr<N>_input (mA)."""
    folder = root / "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    folder.mkdir(parents=True)
    for n, (label, (mv, ma)) in enumerate(channels.items(), 1):
        (folder / f"in{n}_label").write_text(label + "\n")
        (folder / f"in{n}_input").write_text(f"{mv}\n")
        (folder / f"curr{n}_input").write_text(f"{ma}\n")
    (folder / "in7_input").write_text("1000\n")  # channels without a label are not rails
    return root


ORIN_RAILS = {"VDD_IN": (5000, 1000), "VDD_CPU_GPU_CV": (5000, 400), "VDD_SOC": (5000, 200)}


def test_hwmon_tree_and_sampler(tmp_path):
    root = fake_ina3221(tmp_path, ORIN_RAILS)
    pattern = str(root) + "/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon*"
    assert read_hwmon(pattern) == {"VDD_IN": 5000.0, "VDD_CPU_GPU_CV": 2000.0, "VDD_SOC": 1000.0}
    sampler = Sampler("auto", {"hwmon_glob": pattern}, interval_s=0.01).start()
    time.sleep(0.1)
    power = sampler.stop()
    assert power["source"] == "sysfs" and power["samples"] >= 3 and power["average_mw"]["VDD_IN"] == 5000.0


# ---- a real tracker and servers ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgeq", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and the session processes it forked
        proc.wait()


def wait_for_key(tracker: str, key: str, seconds: float = 60) -> None:
    from edgeq.tvm_env import import_tvm

    import_tvm()
    from tvm import rpc

    host, port = tracker.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if key in rpc.connect_tracker(host, int(port)).text_summary():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server '{key}' did not register")


def tracker_and_orin(key: str, sysfs: Path, env=None) -> tuple[str, list[subprocess.Popen]]:
    """A tracker and one ``edgeq rpc serve --device-profile jetson-orin-nano`` over the sysfs tree ``sysfs``,
    registered as ``key``: (the tracker's address, the processes to stop)."""
    port = free_port()
    proc = start("rpc", "tracker", "--port", port, "--port-end", port + 1)
    addr = f"127.0.0.1:{port}"
    server = start("rpc", "serve", "--tracker", addr, "--key", key, "--port", free_port(), "--port-end", "65000",
                   "--device-profile", "jetson-orin-nano", "--sysfs-root", sysfs, env=env)
    wait_for_key(addr, key)
    return addr, [server, proc]


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    addr, procs = tracker_and_orin("cpu-test", fake_ina3221(tmp_path_factory.mktemp("sysfs"), ORIN_RAILS))
    yield addr
    for proc in procs:
        stop(proc)


@pytest.fixture(scope="module")
def bundle(models, tmp_path_factory):
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path_factory.mktemp("b"), "-q", "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def bench(*args):
    res = run_cli("bench", *args, "--json")
    return res, (json.loads(res.stdout) if res.code == 0 else None)


def test_remote_bench_statistics_and_power(tracker, bundle):
    res, out = bench(bundle["archive"], "--rpc", tracker, "--key", "cpu-test", "--repeat", "30", "--warmup", "3",
                     "--power", "sysfs")
    assert res.code == 0, res.stderr
    assert out["runs"] == 30 and out["where"] == f"cpu-test via {tracker}"
    assert 0 < out["min_ms"] <= out["p50_ms"] <= out["p90_ms"] <= out["p99_ms"] <= out["max_ms"]
    assert out["min_ms"] <= out["mean_ms"] <= out["max_ms"]
    assert out["throughput_per_s"] == pytest.approx(1e3 / out["mean_ms"], rel=1e-3)  # 4 significant digits
    power = out["power"]
    assert power["source"] == "sysfs" and power["samples"] >= 1
    assert power["average_w"] == {"VDD_IN": 5.0, "VDD_CPU_GPU_CV": 2.0, "VDD_SOC": 1.0}
    assert power["energy_per_inference_mj"] == pytest.approx(8.0 * out["mean_ms"], rel=1e-3)


def test_local_bench(bundle):
    res, out = bench(bundle["bundle_dir"], "--repeat", "10", "--power", "none")
    assert res.code == 0, res.stderr
    assert out["where"] == "this machine" and out["runs"] == 10 and out["power"]["used"] == "none"


def test_tracker_unreachable(bundle):
    start_t = time.monotonic()
    res, _ = bench(bundle["archive"], "--rpc", f"127.0.0.1:{free_port()}", "--key", "x", "--timeout", "5")
    assert res.code == 8 and "connect to tracker" in res.stderr and time.monotonic() - start_t < 10


def test_no_device_for_the_key_hits_the_deadline(tracker, bundle):
    start_t = time.monotonic()
    res, _ = bench(bundle["archive"], "--rpc", tracker, "--key", "nobody-serves-this", "--timeout", "3")
    assert res.code == 8 and "request a 'nobody-serves-this' device" in res.stderr and "no answer within 3 s" in res.stderr
    assert time.monotonic() - start_t < 10


def _victim(tracker, key):
    server = start("rpc", "serve", "--tracker", tracker, "--key", key, "--port", free_port(), "--port-end", "65000")
    wait_for_key(tracker, key)
    return server


def test_server_killed_mid_benchmark(tracker, bundle):
    server = _victim(tracker, "victim")
    killer = threading.Timer(4.0, stop, args=(server,))
    killer.start()
    start_t = time.monotonic()
    try:
        res, _ = bench(bundle["archive"], "--rpc", tracker, "--key", "victim", "--repeat", "1000000", "--timeout", "20")
    finally:
        killer.cancel()
        stop(server)
    assert res.code == 8 and "edgeq: error:" in res.stderr, res.stderr
    assert time.monotonic() - start_t < 30


def test_session_timeout(tracker, bundle):
    server = _victim(tracker, "short")
    try:
        start_t = time.monotonic()
        res, _ = bench(bundle["archive"], "--rpc", tracker, "--key", "short", "--repeat", "1000000", "--timeout", "30",
                       "--session-timeout", "3")
    finally:
        stop(server)
    assert res.code == 8 and ("session timed out" in res.stderr or "timed runs" in res.stderr), res.stderr
    assert time.monotonic() - start_t < 35


# ---- tuning --------------------------------------------------------------------------------------------


def _conv_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_tune_leaves_functions_that_only_move_data(tmp_path):
    """A transpose or reshape has no schedule to search: tune spends its trials on the functions that compute
    (an int8 model's quantize computes; its reshape does not)."""
    from tvm.s_tir import meta_schedule as ms

    from edgeq.package import front_end
    from edgeq.quantize import QuantizeArgs
    from edgeq.records import prepare
    from edgeq.rpc.tune import moves_data_only
    from test_kernels import host_isa
    from edgeq.stage_records import FrontEndArgs

    model = _conv_model(tmp_path / "conv.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(0).standard_normal((12, 1, 4, 16, 16)).astype(np.float32))
    # int8: the bias starts the dot-product kernel's accumulators; without one (AVX2) it is an add of its own
    int8_conv = "fused_edgeq_conv2d_add_dequantize_relu" if host_isa().dot else "fused_edgeq_conv2d_add_add_dequantize_relu"
    for args, want in [(FrontEndArgs(model=model, device="host"), {"fused_edgeq_conv2d_add_relu"}),
                       (FrontEndArgs(model=model, device="host", precision="int8", quantize=QuantizeArgs(calibrate=calib)),
                        {int8_conv, "fused_quantize_transpose"})]:
        built = front_end(args)
        tasks = ms.relax_integration.extract_tasks(prepare(built.lowered.mod, built.lowered.target), built.lowered.target)
        assert {t.task_name for t in tasks if not moves_data_only(t.dispatched[0])} == want
        assert {t.task_name for t in tasks if moves_data_only(t.dispatched[0])} & {"transpose1"}


def with_baselines(records: Path, run_ms: float) -> None:
    """Set every measurement of edgeq's own schedule in a records file to ``run_ms``."""
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    records.write_text("".join(json.dumps({**e, "run_ms": run_ms} if e.get("kind") == "baseline" else e) + "\n"
                               for e in lines))


@pytest.mark.slow
def test_tune_writes_records_resumes_and_package_uses_them(tracker, tmp_path):
    model = _conv_model(tmp_path / "conv.onnx")
    records = tmp_path / "tuning.json"
    first = run_cli("tune", model, "--device", "host", "--rpc", tracker, "--key", "cpu-test", "--trials", "2",
                    "--records", records, "--json")
    assert first.code == 0, first.stderr
    tasks = json.loads(first.stdout)["tasks"]
    assert tasks and all(t["trials_recorded"] >= 1 and t["best_ms"] > 0 and t["own_ms"] > 0 for t in tasks)
    assert [t["task"] for t in tasks] == ["fused_edgeq_conv2d_add_relu"]  # the NHWC transposes are not tuned
    assert sorted(json.loads(first.stdout)["not_tuned"]) == ["transpose", "transpose1"]
    assert all(t["tuned_used"] == (t["best_ms"] < t["own_ms"]) for t in tasks), tasks
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert {(e["profile"], e["tvm_version"]) for e in lines} == {("host", lines[0]["tvm_version"])}
    assert sum(e.get("kind") == "baseline" for e in lines) == len(tasks)  # edgeq's own schedule, measured once each
    again = run_cli("tune", model, "--device", "host", "--rpc", tracker, "--key", "cpu-test", "--trials", "2",
                    "--records", records, "--json")
    assert again.code == 0 and "skipped (resume)" in again.stderr
    assert len(records.read_text().splitlines()) == len(lines)  # nothing measured twice
    plain = run_cli("package", model, "--device", "host", "-o", tmp_path / "plain", "-q", "--json")
    plain_so = Path(json.loads(plain.stdout)["bundle_dir"], "model.so").read_bytes()
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "measured", "--records", records, "--json")
    assert res.code == 0, res.stderr
    used = json.loads(res.stdout)["records_applied"]
    assert (used > 0) == any(t["tuned_used"] for t in tasks), (used, tasks)
    # the guard, whatever the search found: own schedules measured slower than every record, then faster
    with_baselines(records, 1e9)
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--records", records, "-q", "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["records_applied"] >= 1
    bundle_dir = Path(json.loads(res.stdout)["bundle_dir"])
    assert (bundle_dir / "model.so").read_bytes() != plain_so
    with_baselines(records, 1e-9)
    kept = run_cli("package", model, "--device", "host", "-o", tmp_path / "kept", "--records", records, "--json")
    assert kept.code == 0 and json.loads(kept.stdout)["records_applied"] == 0, kept.stderr
    assert "keep edgeq's own schedule" in kept.stderr
    assert Path(json.loads(kept.stdout)["bundle_dir"], "model.so").read_bytes() == plain_so
    sys.path.insert(0, str(bundle_dir))
    try:
        import run

        x = np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)
        got = run.Model().run({"x": x})["y"]
    finally:
        sys.path.remove(str(bundle_dir))
        sys.modules.pop("run", None)
    want = onnxruntime_session(str(model)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_tune_tunes_what_package_builds_at_its_precision(tracker, tmp_path):
    """tune and package share one front end: an int8 tune (with calibration) records int8 workloads under
    precision int8; package --records applies them to an int8 build and says how many functions they
    scheduled; an fp32 build ignores them with a warning, never an error."""
    model = _conv_model(tmp_path / "conv.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(0).standard_normal((4, 4, 16, 16)).astype(np.float32))
    records = tmp_path / "tuning.json"
    int8 = ("--precision", "int8", "--calibrate", calib)
    res = run_cli("tune", model, "--device", "host", "--rpc", tracker, "--key", "cpu-test", "--trials", "2",
                  "--records", records, "--json", *int8)
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["precision"] == "int8"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert lines and {e["precision"] for e in lines} == {"int8"}
    from tvm.s_tir import meta_schedule as ms

    scripts = [ms.database.Workload.from_json(e["workload"]).mod.script() for e in lines if "workload" in e]
    assert any('"int8"' in text for text in scripts)  # the quantized graph's functions, not fp32's
    with_baselines(records, 1e9)  # (records slower than edgeq's own schedules are not used: test_tune_writes_...)
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "q", "--records", records, "-q", "--json", *int8)
    assert res.code == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["records_applied"] >= 1
    manifest = json.loads((Path(result["bundle_dir"]) / "manifest.json").read_text())
    assert manifest["build"]["records_applied"] == result["records_applied"]
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "f", "--records", records, "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["records_applied"] == 0
    assert f"{len(lines)} record(s) in {records} are for another profile, TVM version or precision" in res.stderr


def _pool(count: int, key: str):
    """A tracker with ``count`` servers under ``key`` on loopback: (tracker address, tracker, servers)."""
    from edgeq.rpc.tune import pool_size

    port = free_port()
    tracker_proc = start("rpc", "tracker", "--port", port, "--port-end", port + 1)
    addr = f"127.0.0.1:{port}"
    servers = [start("rpc", "serve", "--tracker", addr, "--key", key, "--port", free_port(), "--port-end", "65000")
               for _ in range(count)]
    wait_for_key(addr, key)
    deadline = time.monotonic() + 60
    while pool_size("127.0.0.1", port, key, 10) < count and time.monotonic() < deadline:
        time.sleep(0.3)
    return addr, tracker_proc, servers


@pytest.mark.slow
def test_tune_measures_on_every_device_of_the_pool(tmp_path):
    addr, tracker_proc, servers = _pool(2, "pool-test")
    try:
        model = _conv_model(tmp_path / "conv.onnx")
        res = run_cli("tune", model, "--device", "host", "--rpc", addr, "--key", "pool-test", "--trials", "16",
                      "--jobs", "2", "--records", tmp_path / "tuning.json", "--json")
        assert res.code == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["cost_model"] == "xgb" and out["population"] == 64 and out["jobs"] == 2 and out["devices"]["registered"] == 2
        counts = out["devices"]["measurements"]
        assert len(counts) == 2 and all(n >= 1 for n in counts.values()), counts  # both devices measured
        assert sum(counts.values()) >= sum(t["trials_recorded"] for t in out["tasks"]) > 0
        text = run_cli("tune", model, "--device", "host", "--rpc", addr, "--key", "pool-test", "--trials", "16",
                       "--records", tmp_path / "tuning.json")
        assert text.code == 0 and "2 device(s) under 'pool-test'" in text.stderr
    finally:
        for proc in servers + [tracker_proc]:
            stop(proc)


@pytest.mark.slow
def test_tune_goes_on_when_a_device_of_the_pool_dies(tmp_path):
    addr, tracker_proc, servers = _pool(2, "pool-die")
    try:
        model = _conv_model(tmp_path / "conv.onnx")
        proc = subprocess.Popen([sys.executable, "-m", "edgeq", "tune", str(model), "--device", "host", "--rpc", addr,
                                 "--key", "pool-die", "--trials", "16", "--records", str(tmp_path / "tuning.json"),
                                 "--timeout", "20", "--cost-model", "random", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        while not any("tuning" in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2)
        stop(servers[0])  # mid-search
        out, _ = proc.communicate(timeout=900)
        reader.join(timeout=10)
        assert proc.returncode == 0, "".join(lines)[-3000:]
        result = json.loads(out)
        assert sum(t["trials_recorded"] for t in result["tasks"]) > 0
        assert sum(result["devices"]["measurements"].values()) > 0
    finally:
        for proc_ in servers + [tracker_proc]:
            stop(proc_)
