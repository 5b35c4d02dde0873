"""The bundle runs with nothing installed: its own TVM runtime, the native loader edgeq-run, and (JetPack 6)
the CUDA 12 bridge. aarch64 bundles run under qemu-aarch64 in a bare environment: no Python involved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import read_golden, run_cli, run_py
from edgeq.templates.contract import latency_statistics
from edgeq.runtime.assemble import check_elves
from edgeq.runtime.wheels import fetch, installed_version
from edgeq.targets import profiles
from edgeq.reference import onnxruntime_session

QEMU = shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"
needs_qemu = pytest.mark.skipif(QEMU is None or not Path(SYSROOT).is_dir(),
                                reason="qemu-user and the aarch64 cross toolchain are needed (scripts/setup.sh)")
BENCH_KEYS = {"runs", "batch", "warmup", "min_ms", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "throughput_per_s",
              "samples_ms"}


def package(model, device, out, *extra) -> Path:
    res = run_cli("package", model, "--device", device, "-o", out, "-q", "--json", *extra)
    assert res.code == 0, res.stderr
    return Path(json.loads(res.stdout)["bundle_dir"])


def edgeq_run(bundle: Path, *args, env=None, qemu=False, loader: Path | None = None) -> subprocess.CompletedProcess:
    """runtime/edgeq-run of ``bundle`` in a bare environment (no PYTHONPATH, no LD_LIBRARY_PATH of ours)."""
    base = {"PATH": "/usr/bin:/bin", "HOME": str(bundle), **(env or {})}
    cmd = [str(loader or bundle / "runtime" / "edgeq-run"), *map(str, args)]
    if qemu:
        cmd = [QEMU, "-L", SYSROOT, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=base, timeout=600)


def ort_run(model: Path, inputs: dict) -> dict:
    session = onnxruntime_session(str(model))
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))


def one_line_refusal(proc, status, *fragments):
    """One line on stderr and the loaders' exit status (contract.LoaderExit): 2 usage, 4 device, 7 bundle."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status and len(lines) == 1 and lines[0].startswith("edgeq-run: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def host_bundle(models, tmp_path_factory) -> Path:
    return package(models["mobilenet_cnn"], "host", tmp_path_factory.mktemp("host"))


@pytest.fixture(scope="module")
def arm64_bundle(models, tmp_path_factory) -> Path:
    return package(models["resnet_cnn"], "arm64-cpu", tmp_path_factory.mktemp("arm64"))


# ---- host bundles ----------------------------------------------------------------------------------------


def test_host_runtime_is_the_build_and_needs_no_python(host_bundle):
    m = json.loads((host_bundle / "manifest.json").read_text())
    runtime = m["runtime"]
    assert runtime["libraries"] == ["runtime/libtvm_ffi.so", "runtime/libtvm_runtime.so"]
    assert runtime["cuda_bridge"] is None and runtime["loader"] == "runtime/edgeq-run"
    assert {s["project"]: s["version"] for s in runtime["sources"]} == {
        "apache-tvm": installed_version("apache-tvm"), "apache-tvm-ffi": installed_version("apache-tvm-ffi")}
    for name in [runtime["loader"], *runtime["libraries"]]:
        assert name in m["files"] and (host_bundle / name).is_file()
    needed = subprocess.run(["readelf", "-d", str(host_bundle / "runtime" / "edgeq-run")], capture_output=True,
                            text=True, check=True).stdout
    assert "libtvm" not in needed and "python" not in needed  # loads the runtime itself, after its checks
    assert m["compatibility"]["needs"]["glibc"]


def test_host_self_test_and_outputs_match_onnxruntime(host_bundle, models, tmp_path):
    proc = edgeq_run(host_bundle, "--self-test", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and [r["output"] for r in report["outputs"]] == ["logits"]
    x = np.random.default_rng(11).standard_normal((1, 3, 32, 32)).astype(np.float32)  # not the golden input
    np.save(tmp_path / "x.npy", x)
    proc = edgeq_run(host_bundle, "--input", f"input={tmp_path / 'x.npy'}", "--output", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out.npz")
    want = ort_run(models["mobilenet_cnn"], {"input": x})
    assert set(got.files) == set(want)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
    proc = edgeq_run(host_bundle, "--input", f"input={tmp_path / 'x.npy'}", "--output", tmp_path / "outdir")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "outdir" / "logits.npy"), got["logits"])


def test_benchmark_json_has_the_keys_run_py_prints(host_bundle):
    native = edgeq_run(host_bundle, "--benchmark", "5", "--warmup", "1", "--json")
    assert native.returncode == 0, native.stderr
    python = run_py(host_bundle, "--benchmark", "5", "--warmup", "1", "--json")
    assert python.returncode == 0, python.stderr
    stats = json.loads(native.stdout)
    assert set(stats) == set(json.loads(python.stdout)) == BENCH_KEYS
    assert stats["runs"] == 5 and stats["warmup"] == 1
    assert 0 < stats["min_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    # both loaders' statistics are contract.latency_statistics of the runs they report
    for loader in (native, python):
        reported = json.loads(loader.stdout)
        expected = latency_statistics(reported["samples_ms"], batch=1)
        assert len(reported["samples_ms"]) == 5
        for key, value in expected.items():
            assert reported[key] == pytest.approx(value, rel=1e-3, abs=2e-4), (key, reported, expected)
    check = edgeq_run(host_bundle, "--check", "--json")
    assert check.returncode == 0 and json.loads(check.stdout) == {"ok": True}


def test_run_py_hands_over_to_edgeq_run_without_tvm(host_bundle):
    """A Python with no numpy or TVM (-S: no site-packages) still runs the bundle, through edgeq-run."""
    proc = subprocess.run([sys.executable, "-S", "-E", str(host_bundle / "run.py"), "--self-test"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "self-test passed"


def test_signature_is_checked_before_loading(models, tmp_path):
    keys = tmp_path / "keys"
    assert run_cli("keygen", "--out", keys / "a").code == 0 and run_cli("keygen", "--out", keys / "b").code == 0
    signed = package(models["resnet_cnn"], "host", tmp_path / "s", "--sign-key", keys / "a" / "edgeq_signing.key")
    unsigned = package(models["resnet_cnn"], "host", tmp_path / "u")
    trust_a = {"EDGEQ_TRUSTED_KEY": str(keys / "a" / "edgeq_signing.pub")}
    assert edgeq_run(signed, "--self-test", env=trust_a).returncode == 0
    one_line_refusal(edgeq_run(unsigned, "--check", env=trust_a), 7, "not signed")
    one_line_refusal(edgeq_run(signed, "--check", env={"EDGEQ_TRUSTED_KEY": str(keys / "b" / "edgeq_signing.pub")}), 7,
                     "signed by another key")
    manifest = signed / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"release": ', '"release": 1'))
    one_line_refusal(edgeq_run(signed, "--check", env=trust_a), 7, "signature does not match")


def test_changed_runtime_file_wrong_arch_and_hostile_manifest(host_bundle, arm64_bundle, tmp_path):
    bundle = tmp_path / host_bundle.name
    shutil.copytree(host_bundle, bundle)
    with open(bundle / "runtime" / "libtvm_runtime.so", "r+b") as f:
        f.seek(4096)
        f.write(b"\x90\x90\x90\x90")
    one_line_refusal(edgeq_run(bundle, "--self-test"), 7, "runtime/libtvm_runtime.so does not match its SHA-256")
    # the host's loader pointed at the aarch64 bundle: refused before anything is loaded
    one_line_refusal(edgeq_run(arm64_bundle, "--check", "--bundle", arm64_bundle,
                               loader=host_bundle / "runtime" / "edgeq-run"), 4,
                     "this bundle is for aarch64 (arm64-cpu) but this machine is x86_64")
    proc = run_py(arm64_bundle, "--check")
    assert proc.returncode == 4 and "this bundle is for aarch64" in proc.stderr
    (bundle / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    one_line_refusal(edgeq_run(bundle, "--check"), 7, "nested deeper than")
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3, 100000, 100000), }".ljust(127) + b"\n"
    (tmp_path / "bomb.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)  # 120 GB claimed
    shutil.copyfile(host_bundle / "manifest.json", bundle / "manifest.json")
    shutil.copyfile(host_bundle / "runtime" / "libtvm_runtime.so", bundle / "runtime" / "libtvm_runtime.so")
    one_line_refusal(edgeq_run(bundle, "--input", f"input={tmp_path / 'bomb.npy'}"), 2, "EDGEQ_MAX_INPUT_BYTES")


def test_elf_needs_are_checked_against_the_profile_os(host_bundle):
    """A JetPack 6 profile accepts what the cross toolchain builds; an OS older than the needs stops the build."""
    import dataclasses

    from edgeq.errors import ToolchainError

    host = profiles()["host"]
    names = ["model.so", "runtime/edgeq-run", "runtime/libtvm_runtime.so"]
    assert check_elves(host_bundle, names, host)["needs"]["glibc"]
    old = dataclasses.replace(host, name="old-os", software={"os": "an old OS", "glibc": "2.17", "glibcxx": "3.4.19"})
    with pytest.raises(ToolchainError, match=r"needs GLIBC(XX)?_[0-9.]+ but old-os runs an old OS"):
        check_elves(host_bundle, names, old)


# ---- aarch64 under qemu ----------------------------------------------------------------------------------


@needs_qemu
def test_arm64_bundle_runs_under_qemu_with_no_python(arm64_bundle, models, tmp_path):
    m = json.loads((arm64_bundle / "manifest.json").read_text())
    assert m["runtime"]["sources"][0]["wheel"].endswith("aarch64.whl")
    assert all(info["machine"] == "aarch64" for info in m["compatibility"]["files"].values())
    proc = edgeq_run(arm64_bundle, "--self-test", qemu=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "self-test passed"
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = edgeq_run(arm64_bundle, "--input", f"input={tmp_path / 'x.npy'}", "--output", tmp_path / "o.npz", qemu=True)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["logits"], ort_run(models["resnet_cnn"], {"input": x})["logits"],
                               rtol=1e-4, atol=1e-5)
    golden = read_golden(arm64_bundle)
    assert set(golden) == {"input:input", "output:logits"}


@needs_qemu
def test_orin_cpu_int8_bundle_runs_on_sdot_under_qemu(models, tmp_path):
    """int8 for the Jetson Orin's CPU (Cortex-A78AE, Armv8.2 dotprod): the dense convolutions are on Arm's
    ``sdot``, in the machine code, and under qemu (whose CPU has dotprod) the bundle reproduces the golden
    outputs of the host's build of the same graph (plain int8 convolutions there) and ONNX Runtime's float
    answer within int8's error."""
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(0).standard_normal((16, 3, 32, 32)).astype(np.float32))
    bundle = package(models["resnet_cnn"], "jetson-orin-cpu", tmp_path, "--precision", "int8", "--calibrate", calib)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["library"]["cpu_kernels"]["schedules"].get("conv-sdot", 0) == 6, m["library"]["cpu_kernels"]
    assert any(t["name"].endswith("_sdot_0") and t["dtype"] == "int8" for t in m["weights"]["tensors"])
    disassembly = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(bundle / m["library"]["file"])],
                                 capture_output=True, text=True, check=True).stdout
    assert disassembly.count("\tsdot\t") >= 6
    proc = edgeq_run(bundle, "--self-test", qemu=True)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "self-test passed", proc.stdout + proc.stderr
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = edgeq_run(bundle, "--input", f"input={tmp_path / 'x.npy'}", "--output", tmp_path / "o.npz", qemu=True)
    assert proc.returncode == 0, proc.stderr
    want = ort_run(models["resnet_cnn"], {"input": x})["logits"]
    got = np.load(tmp_path / "o.npz")["logits"]
    assert float(np.abs(got - want).max()) <= 0.1 * float(np.abs(want).max())


@pytest.fixture(scope="module")
def aarch64_cuda_stand_ins(tmp_path_factory) -> dict[str, Path]:
    """JetPack 6 stand-ins for qemu: edgeq's CUDA driver stub built for aarch64 (no device), and the aarch64
    libcudart.so.12 from NVIDIA's CUDA 12.6 runtime wheel."""
    out = tmp_path_factory.mktemp("jetpack")
    stub = Path(__file__).parents[1] / "packager" / "native" / "cuda_driver_stub.c"
    (out / "driver").mkdir()
    subprocess.run(["aarch64-linux-gnu-gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(out / "driver" / "libcuda.so.1"), str(stub)], check=True)
    (out / "cudart").mkdir()
    wheel = fetch("nvidia-cuda-runtime-cu12", installed_version("nvidia-cuda-runtime-cu12"), "aarch64")
    (out / "cudart" / "libcudart.so.12").write_bytes(wheel.read("nvidia/cuda_runtime/lib/libcudart.so.12"))
    return {"driver": out / "driver", "cudart": out / "cudart"}


@pytest.fixture(scope="module")
def orin_bundle(models, tmp_path_factory) -> Path:
    return package(models["resnet_cnn"], "jetson-orin-nano", tmp_path_factory.mktemp("orin-runtime"))


def test_orin_runtime_has_the_bridge(orin_bundle):
    m = json.loads((orin_bundle / "manifest.json").read_text())
    runtime = m["runtime"]
    assert runtime["libraries"] == ["runtime/libtvm_ffi.so", "runtime/libtvm_runtime.so", "runtime/libcudart.so.13",
                                    "runtime/libtvm_runtime_cuda.so"]
    bridge = runtime["cuda_bridge"]
    assert bridge["forwards_to"] == "libcudart.so.12" and "cudaGetDeviceProperties" in bridge["functions"]
    needs, limits = m["compatibility"]["needs"], m["compatibility"]["os"]
    assert limits == {"os": "Ubuntu 22.04", "glibc": "2.35", "glibcxx": "3.4.30"}
    assert needs["glibc"] and tuple(map(int, needs["glibc"].split("."))) <= (2, 35)


@needs_qemu
def test_orin_bundle_loads_everything_under_qemu_and_refuses_cleanly(orin_bundle, aarch64_cuda_stand_ins):
    """Every library loads and every symbol binds through the bridge; with no GPU it ends in one line."""
    stand_ins = aarch64_cuda_stand_ins
    env = {"LD_LIBRARY_PATH": f"{stand_ins['driver']}:{stand_ins['cudart']}"}
    proc = edgeq_run(orin_bundle, "--check", env=env, qemu=True)
    one_line_refusal(proc, 4, "needs a CUDA GPU (sm_87) but none is visible")
    assert "undefined symbol" not in proc.stderr and "cannot load" not in proc.stderr
    # no libcudart.so.12 anywhere: the bridge says where it looked
    proc = edgeq_run(orin_bundle, "--check", env={"LD_LIBRARY_PATH": str(stand_ins["driver"])}, qemu=True)
    one_line_refusal(proc, 4, "libcudart.so.12")
    # no driver at all
    one_line_refusal(edgeq_run(orin_bundle, "--check", qemu=True), 4, "no CUDA driver")


# ---- a pip-installed TVM on a CUDA 12 machine (edgeq rpc serve on JetPack 6) -------------------------------


def test_pip_tvm_reaches_cuda_12_through_a_bridge_built_here(tmp_path):
    """What `edgeq rpc serve` does on a JetPack 6 device: build the bridge with this machine's compiler, load
    it, and TVM's CUDA backend runs on CUDA 12's runtime (here NVIDIA's cu12 wheel and edgeq's driver stub:
    no device, reported cleanly)."""
    import nvidia.cuda_runtime

    from edgeq.runtime.bridge import build_native_bridge

    bridge = build_native_bridge()
    script = (
        "import sys\n"
        "from edgeq.tvm_env import cuda_driver\n"
        "cuda_driver()\n"
        "from edgeq.runtime.bridge import enable_tvm_cuda\n"
        "print(enable_tvm_cuda(sys.argv[1]))\n"
        "import tvm\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(sys.argv[1] in maps, 'libcudart.so.12' in maps, tvm.runtime.enabled('cuda'), tvm.cuda(0).exist)\n"
    )
    cudart12 = Path(list(nvidia.cuda_runtime.__path__)[0], "lib")
    proc = subprocess.run([sys.executable, "-c", script, str(bridge)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LD_LIBRARY_PATH": str(cudart12)})
    assert proc.returncode == 0, proc.stderr
    said, state = proc.stdout.strip().splitlines()[-2:]
    assert "through the bridge" in said and "libcudart.so.12" in said
    assert state == "True True True False"  # bridge and CUDA 12 runtime loaded, CUDA enabled, no device


def test_rpc_serve_refuses_a_missing_bridge(tmp_path):
    res = run_cli("rpc", "serve", "--tracker", "127.0.0.1:9", "--key", "k", "--cuda-bridge", tmp_path / "nope.so")
    assert res.code == 5 and res.stderr.strip().splitlines() == [
        f"edgeq: error: CUDA bridge not found: {tmp_path / 'nope.so'} (a bundle's runtime/libcudart.so.13)"]


def test_native_self_test_fails_on_wrong_outputs(host_bundle, tmp_path):
    """Expected outputs changed (and re-hashed so the file check passes): edgeq-run's self-test fails, exit 1."""
    import hashlib

    bundle = tmp_path / host_bundle.name
    shutil.copytree(host_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry = next(t for t in manifest["golden"]["tensors"] if t["name"] == "output:logits")
    want = np.fromfile(bundle / "golden.bin", np.float32, entry["bytes"] // 4, offset=entry["offset"])
    with open(bundle / "golden.bin", "r+b") as f:
        f.seek(entry["offset"])
        f.write((want + 0.5).tobytes())
    manifest["files"]["golden.bin"] = hashlib.sha256((bundle / "golden.bin").read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    proc = edgeq_run(bundle, "--self-test", "--json")
    assert proc.returncode == 1, proc.stderr
    row = json.loads(proc.stdout)["outputs"][0]
    assert not row["ok"] and row["max_abs_diff"] == pytest.approx(0.5, abs=1e-3)


def test_runtime_none_and_no_wheel_offline(models, tmp_path, monkeypatch):
    plain = package(models["resnet_cnn"], "host", tmp_path / "plain", "--runtime", "none")
    m = json.loads((plain / "manifest.json").read_text())
    assert m["runtime"] is None and not (plain / "runtime").exists() and not any("runtime/" in f for f in m["files"])
    assert run_py(plain, "--self-test").returncode == 0
    # offline, nothing cached: the aarch64 runtime cannot be assembled -> one line, nothing written
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    res = run_cli("package", models["resnet_cnn"], "--device", "arm64-cpu", "-o", tmp_path / "offline", "-q")
    lines = res.stderr.strip().splitlines()
    assert res.code == 5 and len(lines) == 1, res.stderr
    assert "cannot fetch the apache-tvm" in lines[0] and "--runtime none" in lines[0]
    assert not (tmp_path / "offline").exists()


def _aliasing_model(path: Path) -> Path:
    """Outputs that share storage kept from call to call (the input, a view of it, a constant, a weight), a
    computed one and a view of it."""
    from onnx import TensorProto, helper, numpy_helper

    shapes = {"ident": [2, 3], "resh": [3, 2], "const": [2, 3], "w": [20, 30], "y": [2, 3], "y2": [6]}
    nodes = [helper.make_node("Identity", ["x"], ["ident"]), helper.make_node("Reshape", ["x", "shp"], ["resh"]),
             helper.make_node("Constant", [], ["const"],
                              value=numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))),
             helper.make_node("Identity", ["wval"], ["w"]), helper.make_node("Add", ["x", "x"], ["y"]),
             helper.make_node("Reshape", ["y", "flat"], ["y2"])]
    inits = [numpy_helper.from_array(np.array([3, 2], np.int64), "shp"),
             numpy_helper.from_array(np.array([6], np.int64), "flat"),
             numpy_helper.from_array(np.arange(600, dtype=np.float32).reshape(20, 30), "wval")]
    graph = helper.make_graph(nodes, "aliasing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
                              inits)
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_run_py_hands_over_fresh_results_and_copies_shared_ones(tmp_path):
    """Model.run gives the arrays the VM computed without copying them, and copies a result whose storage
    outlives the call: the user writing into every result never changes a later call's results."""
    from common import bundle_model  # benchmarks/

    model = bundle_model(package(_aliasing_model(tmp_path / "a.onnx"), "host", tmp_path / "b", "--runtime", "none"))
    assert model.straight
    kept = []
    for round_ in range(2):
        for i in range(3):
            x = np.full((2, 3), float(i + 1), np.float32)
            out = model.run({"x": x})
            assert np.array_equal(out["ident"], x) and np.array_equal(out["resh"], x.reshape(3, 2))
            assert np.array_equal(out["const"], np.arange(6).reshape(2, 3))
            assert np.array_equal(out["w"], np.arange(600).reshape(20, 30))
            assert np.array_equal(out["y"], 2 * x) and np.array_equal(out["y2"], 2 * x.ravel())
            if round_ == 0:
                for array in out.values():
                    array[...] = -7  # the user writes into every result
            else:
                kept.append((x, out))
    assert model.fresh == [False, False, False, False, True, True]
    x, out = kept[-1]
    assert not out["y"].flags.owndata and out["y2"].flags.owndata  # y handed over; y2, a view of y, copied
    for x, out in kept:  # results held across later calls keep their values
        assert np.array_equal(out["y"], 2 * x) and np.array_equal(out["y2"], 2 * x.ravel())


def test_run_py_copies_every_result_of_a_program_with_branches(tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    import onnx
    from common import bundle_model

    one = numpy_helper.from_array(np.ones((2, 3), np.float32))
    then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=one)], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "if.onnx")
    model = bundle_model(package(tmp_path / "if.onnx", "host", tmp_path / "b", "--runtime", "none"))
    assert not model.straight
    x = np.full((2, 3), 2.0, np.float32)
    for cond in (False, False, True, False, True):
        out = model.run({"x": x, "c": np.array(cond)})["o"]
        assert np.array_equal(out, np.ones((2, 3)) if cond else 2 * x)
        out[...] = -7
    assert model.fresh == [False]
