"""The ledger of GPU-verified kernel kinds and ``--gpu-kernels auto``, the default (#63): a layer goes on edgeq's
kernels only where every kind its kernel needs ran on a GPU as edgeq writes it today; the manifest and ``edgeq
inspect`` say which layer ran where and why; ``benchmarks/gpu_bench.py run`` earns the entries from the bundles that
passed on a GPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgeq.backends.cuda import ledger


def _write(path: Path, kinds: dict) -> Path:
    path.write_text(json.dumps({"format": 1, "kinds": kinds}))
    return path


def _entry(kind: str, key: str | None = None) -> dict:
    return {"source_sha256": key or ledger.source_sha256(kind), "gpu": "NVIDIA H200", "driver": "580.159.04",
            "date": "2026-12-06", "evidence": ["probe"]}


def test_the_shipped_ledger_reads_and_every_kind_has_a_key():
    """The package's ledger loads (empty today: the one GPU run's kinds have changed since, #63's device math); every
    kind's key is the SHA-256 of its device source, and two kinds' sources differ."""
    shipped = ledger.Ledger.load()
    assert set(shipped.entries) <= set(ledger.KINDS)
    keys = {kind: ledger.source_sha256(kind) for kind in ledger.KINDS}
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys.values()) and len(set(keys.values())) == len(keys)


def test_a_kind_is_verified_only_with_todays_key(tmp_path):
    """An entry whose key is today's verifies its kind; one whose source changed since, or no entry, does not, and
    the reason says which."""
    book = ledger.Ledger.load(_write(tmp_path / "l.json", {"conv-fp16": _entry("conv-fp16"),
                                                           "conv-int8": _entry("conv-int8", "0" * 64)}))
    assert book.verified() == ["conv-fp16"]
    assert book.gate(("conv-fp16",)) is None
    assert "changed since it ran on NVIDIA H200, 2026-12-06" in book.gate(("conv-int8",))
    assert book.gate(("conv-fp16", "split-k")) == f"{ledger.NOT_RUN} (split-k)"


def test_a_kernels_kinds_name_its_features():
    from edgeq.backends.cuda import cutlass

    p = cutlass.Conv2dProblem(1, 7, 7, 512, 512, 3, 3, (1, 1), (1, 1), (1, 1))
    tile = cutlass.split_k(p, cutlass.choose_tile(p, 8, 166912), 8)
    assert tile.split_k > 1
    assert ledger.kinds_of(cutlass.ConvKernel("a", p, tile, "relu", True)) == ("conv-fp16", "split-k")
    kern = cutlass.ConvKernel("b", p, cutlass.choose_tile(p, 8, 166912, "int8"), precision="int8", out_view=(0, 1024))
    assert ledger.kinds_of(kern) == ("conv-int8", "in-place")
    dw = cutlass.DepthwiseKernel("c", cutlass.Conv2dProblem(1, 8, 8, 32, 32, 3, 3, (1, 1), (1, 1), (1, 1), groups=32),
                                 None, precision="int8")
    assert ledger.kinds_of(dw) == ("depthwise-int8",)


@pytest.mark.parametrize("precision,says", [("fp16", "no kernel kind of edgeq's has run on a GPU"),
                                            ("fp32", "edgeq's GPU kernels take fp16 and int8 layers")])
def test_auto_with_nothing_verified_is_dlight_and_says_why(precision, says, tmp_path, monkeypatch):
    from edgeq.backends.cuda.backend import CudaBackend
    from edgeq.targets import profiles

    monkeypatch.setattr(ledger, "LEDGER", _write(tmp_path / "l.json", {"conv-fp16": _entry("conv-fp16", "1" * 64)}))
    chosen = CudaBackend().with_gpu_kernels("auto", profiles()["jetson-orin-nano"], precision)
    assert chosen.gpu_kernels == "auto" and not chosen.uses_cutlass
    choice = chosen.kernel_choice()
    assert says in choice["note"] and choice["ledger"] == {"verified": [], "kinds": len(ledger.KINDS)}


def test_package_auto_takes_the_verified_kinds_only(tmp_path, monkeypatch):
    """``edgeq package --device jetson-orin-nano --precision fp16`` with no ``--gpu-kernels`` (auto) and a ledger
    that verifies CUTLASS's fp16 convolution only: the layers whose kernel needs nothing else run on CUTLASS, any
    that needs another kind (split-K) stays on dlight, listed as held; the manifest records the choice, the kinds the
    module runs with their keys (what a GPU run of it would verify) and ``edgeq inspect`` shows it. The reference
    check passes."""
    from conftest import run_cli
    from test_gpu_path import resnet

    monkeypatch.setattr(ledger, "LEDGER", _write(tmp_path / "l.json", {"conv-fp16": _entry("conv-fp16")}))
    model = resnet(tmp_path / "r.onnx", size=32, widths=(16, 32), blocks=1, stem=3, activations=("Relu", "Relu6"))
    res = run_cli("package", model, "--device", "jetson-orin-nano", "--precision", "fp16", "-o", tmp_path / "out",
                  "-q", "--json")
    assert res.code == 0, res.stderr
    bundle = Path(json.loads(res.stdout)["bundle_dir"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["reference_check"]["result"] == "passed"
    assert manifest["build"]["args"]["gpu_kernels"] == "auto"
    gpu = manifest["library"]["gpu_kernels"]
    assert gpu["device_math"]["fmad"] is True and gpu["device_math"]["fast_math"] is False  # fp16: FMAs kept
    assert gpu["choice"] == {"gpu_kernels": "auto", "ledger": {"verified": ["conv-fp16"], "kinds": len(ledger.KINDS)}}
    record = gpu["cutlass"]
    assert record["kernels"] and all(k["function"] in gpu["functions"] for k in record["kernels"])
    assert record["kinds"] == {"conv-fp16": ledger.source_sha256("conv-fp16")}
    # the 32-channel 3x3 at 8x8 would cut its K in slices (serial split-K): a kind no GPU ran, so dlight's
    assert [(h["kinds"], h["why"]) for h in record["held"]] == [(["conv-fp16", "split-k"], f"{ledger.NOT_RUN} (split-k)")]
    assert all(k.get("split_k", 1) == 1 for k in record["kernels"])
    # the GPU memory it takes: the weights as stored, the static memory plan's storage, the module's globals (the
    # .nv.global of its cubin: libcu++'s constants, a few KB), against the Orin Nano's 7620 MB
    from edgeq.backends.cuda.cubin import cuda_images, section_sizes

    memory = gpu["memory"]
    assert memory["weights_bytes"] == manifest["weights"]["bytes"] and memory["workspace_bytes"] > 0
    [image] = cuda_images(bundle / "model.so")
    assert memory["globals_bytes"] == section_sizes(image.data).get(".nv.global", 0) < 2**16
    assert memory["device_bytes"] == 7620 * 2**20
    assert memory["total_bytes"] == memory["weights_bytes"] + memory["workspace_bytes"] + memory["globals_bytes"]
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())
    assert inspect.code == 0 and "--gpu-kernels auto (GPU-verified kernel kinds: 1 of" in flat, flat
    assert f"GPU memory {memory['total_bytes'] / 2**20:.1f} MB" in flat and "the device has 7620 MB" in flat, flat


def test_a_gpu_run_earns_the_kinds_of_the_bundles_that_passed(tmp_path):
    """``gpu_bench.ledger``: a kind is earned when a bundle that ran it passed its self-test and memcheck (and
    racecheck and, a probe, the strict comparison where they ran), and not when any bundle with the same key failed
    one; ``merge_ledger`` puts the earned kinds into a ledger."""
    import gpu_bench

    def bundle(name, kinds):
        folder = tmp_path / "bundles" / name
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"library": {"gpu_kernels": {"cutlass": {"kinds": kinds}}}}))

    bundle("a", {"conv-fp16": "k1", "split-k": "k2"})
    bundle("b", {"conv-int8": "k3"})
    bundle("c", {"conv-int8": "k3", "depthwise-int8": "k4"})
    bundle("d", {"layer-norm": "k5"})
    results = {"date": "2026-12-06", "gpu": "NVIDIA H200, 580.159.04, 1980 MHz",
               "edgeq": {"a": {"self_test": {"rc": 0}}, "b": {"self_test": {"rc": 0}}, "c": {"self_test": {"rc": 1}},
                         "d": {"self_test": {"rc": 0}}},
               "memcheck": {"a": {"rc": 0}, "b": {"rc": 0}}, "racecheck": {}, "strict": {}}
    earned = gpu_bench.ledger(tmp_path, results)
    # conv-int8 failed in c, depthwise-int8 ran only in c; layer-norm passed in d, which no memcheck ran on
    assert sorted(earned["kinds"]) == ["conv-fp16", "split-k"]
    assert earned["kinds"]["conv-fp16"] == {"source_sha256": "k1", "gpu": "NVIDIA H200", "driver": "580.159.04",
                                            "date": "2026-12-06", "evidence": ["a"]}
    (tmp_path / "run.json").write_text(json.dumps(earned))
    target = _write(tmp_path / "ledger.json", {"layer-norm": _entry("layer-norm")})
    merged = gpu_bench.merge_ledger(tmp_path / "run.json", target)
    assert sorted(merged["kinds"]) == ["conv-fp16", "layer-norm", "split-k"]
    assert ledger.Ledger.load(target).verified() == ["layer-norm"]  # k1, k2 are not today's keys
    results["strict"]["a"] = {"passed": False}  # a probe's strict comparison failed
    assert gpu_bench.ledger(tmp_path, results)["kinds"] == {}
    results["strict"]["a"] = {"passed": True}
    results["racecheck"]["a"] = {"rc": 99}
    assert gpu_bench.ledger(tmp_path, results)["kinds"] == {}


def test_a_probes_strict_comparison(tmp_path):
    """``gpu_bench.strict``: an int8 probe passes only with its outputs exactly the host build's, an fp16 probe
    within FP16_ULPS units in the last place of an fp16 at the golden output's largest magnitude (read from the
    bundle's golden file)."""
    import numpy as np

    import gpu_bench

    golden = np.array([[-10.0, 3.0, 0.5]], np.float32)
    for name in ("probe-x-int8", "probe-x-fp16"):
        folder = tmp_path / "bundles" / name
        folder.mkdir(parents=True)
        (folder / "golden.bin").write_bytes(golden.tobytes())
        (folder / "manifest.json").write_text(json.dumps({"golden": {"file": "golden.bin", "tensors": [
            {"name": "output:y", "dtype": "float32", "shape": [1, 3], "offset": 0, "bytes": golden.nbytes}]}}))

    def verdicts(diff_int8: str, diff_fp16: str) -> dict:
        results = {"edgeq": {n: {"self_test": {"rc": 0, "tail": f"ok   y: max |diff| {d} (rtol 0.02, atol 0.2)\n"}}
                             for n, d in (("probe-x-int8", diff_int8), ("probe-x-fp16", diff_fp16))}, "strict": {}}
        gpu_bench.strict(tmp_path, results)
        return {n: r["passed"] for n, r in results["strict"].items()}

    bound = gpu_bench.FP16_ULPS * float(np.spacing(np.float16(10.0)))  # 4 x 2^-7 at 10
    assert verdicts("0", "0.00391") == {"probe-x-int8": True, "probe-x-fp16": True}
    assert verdicts("0.00391", f"{bound * 1.5:g}") == {"probe-x-int8": False, "probe-x-fp16": False}


def test_a_bundle_too_large_for_the_devices_memory_is_refused_in_one_line():
    """The package step's device-memory check (``bundle.device_memory``): over the device's memory an error naming
    what it needs and what to do; over half of it a warning (an Orin's CPU shares it); CPU builds untouched."""
    import dataclasses

    from edgeq.bundle import device_memory
    from edgeq.errors import DeviceError
    from edgeq.targets import profiles

    class Progress:
        def __init__(self):
            self.warnings = []

        def warn(self, text):
            self.warnings.append(text)

    small = dataclasses.replace(profiles()["jetson-orin-nano"], memory_mb=8)
    kernels = {"cpu_kernels": None, "gpu_kernels": {"memory": {"workspace_bytes": 3 * 2**20}}}
    with pytest.raises(DeviceError, match=r"needs 9 MB of GPU memory \(weights 6 MB, activations 3 MB\), more than "
                                          r"jetson-orin-nano's 8 MB; use --precision int8 or fp16"):
        device_memory(kernels, 6 * 2**20, 64, small, Progress())
    progress = Progress()
    out = device_memory(kernels, 2 * 2**20, 64, small, progress)
    assert out["gpu_kernels"]["memory"]["total_bytes"] == 5 * 2**20 + 64 and "over half" in progress.warnings[0]
    assert device_memory({"cpu_kernels": {}, "gpu_kernels": None}, 10**12, 0, small, progress) == {
        "cpu_kernels": {}, "gpu_kernels": None}


def test_the_bundles_share_their_runtime_once_in_the_carried_archive(tmp_path):
    """``gpu_bench.hardlink_duplicates``: files with the same bytes (each bundle's runtime/) become hard links to
    one, which tarfile stores once: the device tool carries 64 MiB, and 29 bundles' runtimes are 190 MB."""
    import tarfile

    import gpu_bench

    runtime = bytes(range(256)) * 4096  # 1 MiB
    for name in ("a", "b", "c"):
        (tmp_path / "bundles" / name / "runtime").mkdir(parents=True)
        (tmp_path / "bundles" / name / "runtime" / "libtvm_runtime.so").write_bytes(runtime)
        (tmp_path / "bundles" / name / "weights.bin").write_bytes(name.encode() * 1000)
    assert gpu_bench.hardlink_duplicates(tmp_path / "bundles") == 2 * len(runtime)
    inodes = {(tmp_path / "bundles" / n / "runtime" / "libtvm_runtime.so").stat().st_ino for n in "abc"}
    assert len(inodes) == 1
    with tarfile.open(tmp_path / "b.tar", "w") as tar:
        tar.add(tmp_path / "bundles", arcname="bundles")
    assert (tmp_path / "b.tar").stat().st_size < 1.2 * len(runtime)
    with tarfile.open(tmp_path / "b.tar") as tar:
        tar.extractall(tmp_path / "out", filter="fully_trusted")
    assert (tmp_path / "out/bundles/c/runtime/libtvm_runtime.so").read_bytes() == runtime
