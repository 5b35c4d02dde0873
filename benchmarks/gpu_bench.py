"""edgeq's GPU path on a lent GPU, against PyTorch in the same run (#42, item 6). Two halves, because the GPU
machine has no network and no edgeq:

    bash benchmarks/gpu_bench.sh build [DIR]   # here: bundles for cuda-sm90 (an H100/H200 driven through CUDA 12
                                               # and edgeq's bridge, as an Orin is), xz-packed into DIR (gpu_bench/)
    bash benchmarks/gpu_bench.sh run [DIR]     # there (device tool: carry DIR): every bundle's --self-test and
                                               # --benchmark; each probe's strict comparison (int8 equal to the host
                                               # build, fp16 within FP16_ULPS); compute-sanitizer memcheck and
                                               # racecheck on one bundle of each kernel kind; two self-tests of a
                                               # split-K bundle at once; PyTorch fp16 (channels_last,
                                               # cudnn.benchmark) replayed from a captured CUDA graph and
                                               # torch.compile(mode="reduce-overhead"); JSON to $OUT/gpu_bench.json
                                               # (or DIR), the kernel kinds that passed to $OUT/gpu_verified.json
                                               # (the ledger's format), and a table of p50s and ratios
    bash benchmarks/gpu_bench.sh ledger FILE   # here: that gpu_verified.json into edgeq's ledger (--gpu-kernels auto)

``build`` prints (and writes to DIR/coverage.json) which of edgeq's kernel kinds (edgeq/backends/cuda/ledger.py)
the bundles run, so that one run verifies every kind. ``build --set verify`` (the default) makes the probes and the
bundles that run every kind (VERIFY; 20 of 20 kinds), ``--set compare`` the rest of the comparisons with PyTorch:
all 29 bundles are over the 64 MiB one device call carries, so they are two calls.

The models are benchmarks/gpu_kernels.py's onnx-helper builders (ResNet-18, ResNet-50, MobileNetV2 at 224x224,
BatchNorm after every conv) with their weights put on a grid of 15 values per tensor, so that the bundles
compress under the device tool's 64 MiB (latency does not depend on the values; each bundle's golden outputs are
computed on this host from the same weights, so --self-test still checks the answers). The probes are single
convolutions, one CUTLASS feature each (the stem's channel padding, stride, residual, dilation, odd widths,
batch), so that a wrong answer names what is wrong. PyTorch runs torchvision's models of the same layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# bundles: (name, model, batch, precision, gpu kernels); what one device call carries (64 MiB, xz)
MODELS = [
    ("resnet18-b1-fp16-dlight", "resnet18", 1, "fp16", "dlight"),
    ("resnet18-b1-fp16-cutlass", "resnet18", 1, "fp16", "cutlass"),
    ("resnet18-b1-int8-dlight", "resnet18", 1, "int8", "dlight"),
    ("resnet18-b1-int8-cutlass", "resnet18", 1, "int8", "cutlass"),
    ("resnet18-b8-fp16-cutlass", "resnet18", 8, "fp16", "cutlass"),
    ("resnet18-b8-int8-cutlass", "resnet18", 8, "int8", "cutlass"),
    ("mobilenet_v2-b1-fp16-cutlass", "mobilenet_v2", 1, "fp16", "cutlass"),
    ("mobilenet_v2-b1-int8-cutlass", "mobilenet_v2", 1, "int8", "cutlass"),
    ("resnet50-b1-int8-cutlass", "resnet50", 1, "int8", "cutlass"),
    ("resnet50-b8-fp16-cutlass", "resnet50", 8, "fp16", "cutlass"),
    ("resnet50-b8-int8-cutlass", "resnet50", 8, "int8", "cutlass"),
    # gpu_kernels.bert_encoder (all-MiniLM-L6-v2's shape, 128 tokens): linear layers and attention's batched GEMMs
    ("bert_encoder-b1-fp16-cutlass", "bert_encoder", 1, "fp16", "cutlass"),
    ("bert_encoder-b1-int8-cutlass", "bert_encoder", 1, "int8", "cutlass"),
    # depthwise on edgeq's kernel (MBConv, squeeze-and-excitation, SiLU); the YOLOv8n-style detector at 640x640 (no
    # PyTorch peer here: the image has no ultralytics)
    ("efficientnet_b0-b1-fp16-cutlass", "efficientnet_b0", 1, "fp16", "cutlass"),
    ("efficientnet_b0-b1-int8-cutlass", "efficientnet_b0", 1, "int8", "cutlass"),
    ("yolov8n-b1-fp16-cutlass", "yolov8n", 1, "fp16", "cutlass"),
    ("yolov8n-b1-int8-cutlass", "yolov8n", 1, "int8", "cutlass"),
]
# probes: (name, batch, in channels, size, out channels, kernel, stride, pad, dilation, residual, activation[, groups])
PROBES = [
    ("probe-stem", 1, 3, 64, 64, 7, 2, 3, 1, False, "Relu"),
    ("probe-residual", 2, 64, 28, 64, 3, 1, 1, 1, True, "Relu"),
    ("probe-shortcut", 1, 64, 28, 128, 1, 2, 0, 1, False, None),
    ("probe-dilated-odd", 1, 40, 20, 24, 3, 1, 2, 2, False, "Clip"),
    ("probe-small-map", 3, 120, 7, 120, 3, 1, 1, 1, True, "Clip"),
    ("probe-grouped", 1, 64, 14, 64, 3, 1, 1, 1, False, "Relu", 4),  # CUTLASS's grouped kernel: fp16 only
]
PROBE_PRECISIONS = {"probe-grouped": ("fp16",)}
# strict comparison of a probe's self-test (on top of its 5%-of-range tolerance): int8 equal to the host build
# (integer accumulation, edgeq's device math: every float operator as the host's); fp16 within this many units in
# the last place of an fp16 at the golden output's largest magnitude (the tensor cores sum in another order)
FP16_ULPS = 4
# ``build --set verify`` (the default): the probes and the bundles that between them run every kernel kind of edgeq's
# (ledger.KINDS; ``build`` prints the coverage), so that one device call verifies them all under the 64 MiB the device
# tool carries; ``--set compare``: the other bundles, for the comparisons with PyTorch (a second call); ``all``: both
# (over 64 MiB: the 29 bundles passed 75 MB of xz, still growing, even with their shared runtime stored once)
VERIFY = ("resnet18-b1-fp16-dlight", "resnet18-b1-fp16-cutlass", "resnet18-b1-int8-cutlass",
          "bert_encoder-b1-fp16-cutlass", "bert_encoder-b1-int8-cutlass", "efficientnet_b0-b1-fp16-cutlass",
          "efficientnet_b0-b1-int8-cutlass", "yolov8n-b1-fp16-cutlass", "yolov8n-b1-int8-cutlass")
CARRY_MIB = 64
DEVICE = "cuda-sm90"
SANITIZED = ("resnet18-b1-fp16-cutlass", "resnet18-b1-int8-cutlass")
PROFILED = ("resnet18-b1-fp16-cutlass", "resnet18-b1-int8-cutlass", "resnet18-b1-fp16-dlight")  # ncu: each kernel's time
COMPILED = ("resnet18-b1", "resnet50-b8")  # torch.compile: these only (10-15 s each on the H200)


# ------------------------------------------------------------------ build (here)


def on_grid(path: Path) -> None:
    """Every initializer of 256 elements or more put on 15 values (per tensor: multiples of max|w| / 7), and
    each BatchNormalization's scale 1 over its variance's root (so folding it keeps the grid)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            gamma, var = inits[node.input[1]], inits[node.input[4]]
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            g = numpy_helper.to_array(gamma)
            gamma.CopyFrom(numpy_helper.from_array(np.ones_like(g), gamma.name))
            var.CopyFrom(numpy_helper.from_array(np.full_like(g, 1 - eps), var.name))
    for init in model.graph.initializer:
        w = numpy_helper.to_array(init)
        if w.size >= 256 and w.dtype == np.float32:
            step = float(np.abs(w).max()) / 7 or 1.0
            init.CopyFrom(numpy_helper.from_array((np.round(w / step) * step).astype(np.float32), init.name))
    onnx.save(model, path)


def probe(path: Path, batch, cin, size, cout, k, stride, pad, dilation, residual, activation, groups=1) -> Path:
    """One convolution with bias, [+ a residual], [ReLU | Clip(0, 6)], written with the onnx helper."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(cin * 1000 + cout)

    def weights(name, co, ci, kk):
        return [numpy_helper.from_array((rng.standard_normal((co, ci, kk, kk)) / np.sqrt(ci * kk * kk)).astype(np.float32), f"w{name}"),
                numpy_helper.from_array((rng.standard_normal(co) * 0.1).astype(np.float32), f"b{name}")]

    inits, nodes, x = [], [], "input"
    if residual:  # the residual an intermediate NHWC tensor, as in a network: a 1x1 conv + ReLU first
        inits += weights("0", cin, cin, 1)
        nodes += [helper.make_node("Conv", ["input", "w0", "b0"], ["conv0"], kernel_shape=[1, 1]),
                  helper.make_node("Relu", ["conv0"], ["x"])]
        x = "x"
    inits += weights("", cout, cin // groups, k)
    nodes.append(helper.make_node("Conv", [x, "w", "b"], ["conv"], kernel_shape=[k, k], strides=[stride] * 2,
                                  pads=[pad] * 4, dilations=[dilation] * 2, group=groups))
    last = "conv"
    if residual:
        nodes.append(helper.make_node("Add", ["conv", x], ["sum"]))
        last = "sum"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", [last], ["act"]))
        last = "act"
    elif activation == "Clip":
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"), numpy_helper.from_array(np.array(6, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["act"]))
        last = "act"
    nodes.append(helper.make_node("Identity", [last], ["output"]))
    out = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    graph = helper.make_graph(nodes, path.stem, [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, cin, size, size])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, cout, out, out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx.helper")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def build(out: Path, only: list[str] | None, which: str = "verify") -> None:
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_kernels
    from edgeq.package import PackageArgs, package
    from edgeq.quantize import QuantizeArgs

    shutil.rmtree(out, ignore_errors=True)
    work, bundles = out / "work", out / "bundles"
    work.mkdir(parents=True)
    bundles.mkdir()
    jobs = [(f"{spec[0]}-{precision}", dict(probe=spec[1:], precision=precision, gpu_kernels="cutlass"))
            for spec in PROBES for precision in PROBE_PRECISIONS.get(spec[0], ("fp16", "int8"))] if which != "compare" else []
    jobs += [(name, dict(model=m, batch=b, precision=p, gpu_kernels=g)) for name, m, b, p, g in MODELS
             if which == "all" or (name in VERIFY) == (which == "verify")]
    for name, job in jobs:
        if only and name not in only:
            continue
        started = time.time()
        model = work / f"{name}.onnx"
        if "probe" in job:
            probe(model, *job["probe"])
        else:
            gpu_kernels.MODELS[job["model"]](model, batch=job["batch"])
            on_grid(model)
        quantize = None
        if job["precision"] == "int8":
            import onnx

            dims = [d.dim_value for d in onnx.load(model, load_external_data=False).graph.input[0].type.tensor_type.shape.dim]
            samples = 2 * dims[0]  # random inputs: enough to run int8 kernels, not to judge accuracy
            calib = work / f"{name}-calib.npz"
            np.savez(calib, input=np.random.default_rng(0).standard_normal((samples, *dims[1:])).astype(np.float32))
            quantize = QuantizeArgs(calibrate=calib, method="minmax", samples=samples)
        result = package(PackageArgs(model=model, device=DEVICE, output=work / name, name=name,
                                     precision=job["precision"], quantize=quantize, gpu_kernels=job["gpu_kernels"]))
        shutil.move(str(result.bundle_dir), bundles / name)
        print(f"gpu_bench: {name} packaged in {time.time() - started:.0f} s", flush=True)
    shutil.rmtree(work)
    coverage = kinds_covered(bundles)
    (out / "coverage.json").write_text(json.dumps(coverage, indent=1) + "\n")
    print(f"gpu_bench: kernel kinds the bundles run: {len(coverage['covered'])} of {len(coverage['kinds'])}"
          + (f"; no bundle runs {', '.join(coverage['missing'])}" if coverage["missing"] else ""), flush=True)
    import nvidia.cuda_runtime

    shutil.copy(Path(list(nvidia.cuda_runtime.__path__)[0], "lib", "libcudart.so.12"), out / "libcudart.so.12")
    shared = hardlink_duplicates(bundles)
    print(f"gpu_bench: {shared / 2**20:.0f} MiB of files the bundles share (their runtime/) stored once", flush=True)
    with tarfile.open(out / "bundles.tar.xz", "w:xz", preset=9) as tar:
        tar.add(bundles, arcname="bundles")  # (tarfile stores a hard link as a link, not its bytes again)
    shutil.rmtree(bundles)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"gpu_bench: {out} holds {size / 2**20:.1f} MiB (the device tool carries {CARRY_MIB} MiB)")
    if size > CARRY_MIB * 2**20:
        print(f"gpu_bench: over the {CARRY_MIB} MiB the device tool carries: build --set verify and --set compare apart",
              file=sys.stderr)


def hardlink_duplicates(folder: Path) -> int:
    """Every file under ``folder`` whose bytes another one already has made a hard link to that one (each bundle
    carries the same TVM runtime, 6.5 MB, which xz's 64 MiB window cannot see across 600 MB of bundles); the bytes
    saved."""
    import hashlib

    first: dict[str, Path] = {}
    saved = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in first:
            mode = path.stat().st_mode
            path.unlink()
            os.link(first[digest], path)
            os.chmod(path, mode)
            saved += path.stat().st_size
        else:
            first[digest] = path
    return saved


def kinds_covered(bundles: Path) -> dict:
    """Which of edgeq's kernel kinds (ledger.KINDS) the bundles under ``bundles`` run, and in which bundles."""
    from edgeq.backends.cuda.ledger import KINDS

    where: dict[str, list[str]] = {}
    for manifest in sorted(bundles.glob("*/manifest.json")):
        gpu = json.loads(manifest.read_text())["library"].get("gpu_kernels") or {}
        for kind in (gpu.get("cutlass") or {}).get("kinds", {}):
            where.setdefault(kind, []).append(manifest.parent.name)
    return {"kinds": list(KINDS), "covered": {k: where[k] for k in KINDS if k in where},
            "missing": [k for k in KINDS if k not in where]}


# ------------------------------------------------------------------ run (on the GPU machine)


def _run(cmd: list[str], timeout: float, env=None, keep: int = 4000) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return done.returncode, (done.stdout + done.stderr)[-keep:]
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout:.0f} s: {(e.stdout or b'')[-2000:]!r}"
    except OSError as e:
        return 127, f"{cmd[0]}: {e}"


def _loaders(root: Path, names) -> tuple[dict, list[tuple[str, str]]]:
    """The environment the bundles run in (the carried libcudart.so.12 for the bridge), and (name, edgeq-run) of
    each of ``names`` unpacked under ``root/bundles``."""
    env = dict(os.environ, EDGEQ_CUDART=str(root / "libcudart.so.12"))
    exes = [(name, root / "bundles" / name / "runtime" / "edgeq-run") for name in names]
    return env, [(name, str(exe)) for name, exe in exes if exe.exists()]


def run_bundles(root: Path, results: dict, runs: int) -> None:
    names = [f"{p[0]}-{precision}" for p in PROBES for precision in ("fp16", "int8")] + [m[0] for m in MODELS]
    env, loaders = _loaders(root, names)
    for name, exe in loaders:
        row = results["edgeq"].setdefault(name, {})
        rc, text = _run([exe, "--self-test"], 300, env)
        row["self_test"] = {"rc": rc, "tail": text[-1500:]}
        print(f"== {name}: self-test rc {rc}\n{text.strip()[-600:]}", flush=True)
        if name.startswith("probe"):
            continue
        rc, text = _run([exe, "--benchmark", str(runs), "--warmup", "50", "--json"], 300, env)
        try:
            stats = json.loads(text.strip().splitlines()[-1])
            stats.pop("samples_ms", None)
            row["latency"] = stats
            print(f"   p50 {stats['p50_ms']} ms  p99 {stats['p99_ms']} ms", flush=True)
        except (ValueError, IndexError):
            row["latency_error"] = text[-1500:]
            print(f"   benchmark failed rc {rc}: {text[-600:]}", flush=True)


def _kinds(root: Path, name: str) -> dict:
    manifest = root / "bundles" / name / "manifest.json"
    if not manifest.is_file():
        return {}
    gpu = json.loads(manifest.read_text()).get("library", {}).get("gpu_kernels") or {}
    return (gpu.get("cutlass") or {}).get("kinds", {})


def _smallest_per_kind(root: Path) -> list[str]:
    """One bundle for each kernel kind the bundles run: the smallest that runs it (probes before models)."""
    names = sorted((p.name for p in (root / "bundles").iterdir() if (p / "manifest.json").is_file()),
                   key=lambda n: sum(f.stat().st_size for f in (root / "bundles" / n).rglob("*") if f.is_file()))
    chosen: list[str] = []
    for kind in sorted({k for n in names for k in _kinds(root, n)}):
        pick = next(n for n in names if kind in _kinds(root, n))
        if pick not in chosen:
            chosen.append(pick)
    return chosen


def strict(root: Path, results: dict) -> None:
    """Each probe's self-test differences held to the strict bound: int8 exactly the host build's, fp16 within
    FP16_ULPS units in the last place at the golden output's largest magnitude (the golden file, read with numpy)."""
    import re

    import numpy as np

    for name, row in results["edgeq"].items():
        if not name.startswith("probe"):
            continue
        diffs = [float(d) for d in re.findall(r"max \|diff\| ([0-9.eE+-]+|inf|nan)", row["self_test"]["tail"])]
        manifest = json.loads((root / "bundles" / name / "manifest.json").read_text())
        golden = manifest["golden"]
        raw = (root / "bundles" / name / golden["file"]).read_bytes()
        outputs = [np.frombuffer(raw[t["offset"]:t["offset"] + t["bytes"]], t["dtype"]).astype(np.float64)
                   for t in golden["tensors"] if t["name"].startswith("output:")]
        largest = max((float(np.abs(o).max()) for o in outputs), default=0.0)
        bound = 0.0 if name.endswith("-int8") else FP16_ULPS * float(np.spacing(np.float16(largest)))
        passed = bool(diffs) and row["self_test"]["rc"] == 0 and max(diffs) <= bound
        results["strict"][name] = {"passed": passed, "max_diff": max(diffs, default=None), "bound": bound}
        print(f"== strict {name}: {'ok' if passed else 'FAIL'} (max |diff| {max(diffs, default=None)}, bound {bound:g})",
              flush=True)


def sanitize(root: Path, results: dict, deadline: float) -> None:
    """compute-sanitizer's memcheck, then racecheck, on one bundle of each kernel kind (the smallest that runs it);
    what the deadline leaves out is listed as skipped (a kind no memcheck passed on is not verified)."""
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    env, loaders = _loaders(root, list(SANITIZED) + [n for n in _smallest_per_kind(root) if n not in SANITIZED])
    for check in ("memcheck", "racecheck"):
        for name, exe in loaders:
            if time.time() > deadline:
                results.setdefault("skipped", []).append(f"{check} {name}")
                continue
            rc, text = _run([tool, "--tool", check, "--error-exitcode", "99", "--print-limit", "3", exe,
                             "--self-test"], 240, env, keep=1 << 20)
            results.setdefault(check, {})[name] = {"rc": rc, "head": text[:3000], "tail": text[-1500:]}
            print(f"== {check} {name}: rc {rc}\n{text.strip()[-300:]}", flush=True)


def concurrent(root: Path, results: dict) -> None:
    """Two self-tests of one serial split-K bundle at once (two processes, one GPU): each module has its own
    semaphores, so both pass. (Two inferences of one module at once are serialized by design: one VM a module.)"""
    names = [n for n in sorted(p.name for p in (root / "bundles").iterdir()) if "split-k" in _kinds(root, n)]
    if not names:
        return
    env, [(name, exe)] = _loaders(root, names[:1])
    procs = [subprocess.Popen([exe, "--self-test"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0][-1000:] for p in procs]
    results["concurrent"] = {"bundle": name, "rc": [p.returncode for p in procs], "tails": outs}
    print(f"== two self-tests of {name} at once: rc {[p.returncode for p in procs]}", flush=True)


def profile(root: Path, results: dict, names=PROFILED, launches: int = 60) -> None:
    """Each kernel's duration (ncu, clocks left alone) in one --self-test of the bundles ``names`` (each distinct
    kernel's fastest launch)."""
    import csv
    import io

    tool = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    env, loaders = _loaders(root, names)
    for name, exe in loaders:
        rc, text = _run([tool, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
                         "--launch-count", str(launches), exe, "--self-test"], 150, env, keep=1 << 24)
        rows = [r for r in csv.DictReader(io.StringIO(text[text.find('"ID"'):])) if r.get("Metric Value")]
        kernels: dict[str, list[float]] = {}
        for r in rows:
            kernels.setdefault(r["Kernel Name"][:80], []).append(float(r["Metric Value"].replace(",", "")))
        results["ncu"][name] = {"rc": rc, "kernels_ns": {k: min(v) for k, v in kernels.items()},
                                "tail": "" if rows else text[-1500:]}
        print(f"== ncu {name}: rc {rc}, {len(kernels)} kernels, sum of each one's fastest launch "
              f"{sum(min(v) for v in kernels.values()) / 1e3:.1f} us", flush=True)


def profile_all(root: Path, out: Path, archive: str) -> None:
    """``profile``: each kernel's duration (ncu) in one --self-test of every bundle in ``root/archive`` (bundle
    folders at its top), the kernels grouped as CUTLASS's and the rest; JSON to ``out/gpu_profile.json``."""
    with tarfile.open(root / archive) as tar:
        tar.extractall(root / "bundles", filter="fully_trusted")
    names = sorted(p.name for p in (root / "bundles").iterdir() if p.is_dir())
    results: dict = {"date": time.strftime("%Y-%m-%d"), "ncu": {}}
    profile(root, results, names, launches=2000)
    for name, row in results["ncu"].items():
        ks = row["kernels_ns"]
        cut = sum(v for k, v in ks.items() if k.startswith("cutlass_"))
        row["cutlass_us"], row["other_us"] = round(cut / 1e3, 1), round((sum(ks.values()) - cut) / 1e3, 1)
        print(f"== {name}: CUTLASS kernels {row['cutlass_us']} us, the others {row['other_us']} us")
        for k, v in sorted(ks.items(), key=lambda kv: -kv[1])[:15]:
            print(f"   {v / 1e3:8.1f} us  {k}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_profile.json").write_text(json.dumps(results, indent=1) + "\n")


def run_torch(root: Path, results: dict, runs: int, deadline: float, compile_models=()) -> None:
    import statistics

    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    def bert_encoder():  # gpu_kernels.bert_encoder's shape: 6 post-norm layers, hidden 384, 12 heads, GELU FFN 1536
        layer = torch.nn.TransformerEncoderLayer(384, 12, 1536, dropout=0.0, activation="gelu", batch_first=True)
        return torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)

    builders = {"resnet18": torchvision.models.resnet18, "resnet50": torchvision.models.resnet50,
                "mobilenet_v2": torchvision.models.mobilenet_v2, "efficientnet_b0": torchvision.models.efficientnet_b0,
                "bert_encoder": bert_encoder}
    wanted = sorted({(m, b) for name, m, b, _, _ in MODELS if (root / "bundles" / name).is_dir() and m in builders})

    def example(model_name: str, batch: int):
        if model_name == "bert_encoder":
            return torch.randn(batch, 128, 384, device="cuda", dtype=torch.half)
        return torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)

    def timed(fn) -> dict:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return {"p50_ms": round(statistics.median(times), 4), "p99_ms": round(times[int(0.99 * (len(times) - 1))], 4),
                "runs": runs}

    for model_name, batch in [] if compile_models else wanted:  # PyTorch fp16 replayed from a captured CUDA graph
        model = builders[model_name]().eval().half().cuda().to(memory_format=torch.channels_last)
        x = example(model_name, batch)
        key = f"{model_name}-b{batch}"
        row = results["torch"].setdefault(key, {})
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(20):
                    model(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(x)
            for _ in range(50):
                graph.replay()
            row["fp16_cuda_graph"] = timed(graph.replay)
        print(f"== torch {key} fp16 CUDA graph: {row['fp16_cuda_graph']}", flush=True)
        del graph
    for model_name, batch in wanted:  # torch.compile(mode="reduce-overhead"): CUDA graphs of its own
        key = f"{model_name}-b{batch}"
        if key not in compile_models:
            continue
        if time.time() > deadline:
            results["torch"].setdefault(key, {})["compile_skipped"] = "out of the run's time"
            continue
        try:
            torch._dynamo.reset()
            model = builders[model_name]().eval().half().cuda().to(memory_format=torch.channels_last)
            x = example(model_name, batch)
            compiled = torch.compile(model, mode="reduce-overhead")
            started = time.time()
            with torch.no_grad():
                for _ in range(5):
                    compiled(x)
                torch.cuda.synchronize()
                compile_s = time.time() - started
                for _ in range(30):
                    compiled(x)
                row = timed(lambda: compiled(x))
            row["compile_s"] = round(compile_s, 1)
            results["torch"].setdefault(key, {})["compile_reduce_overhead"] = row
            print(f"== torch {key} torch.compile(reduce-overhead): {row}", flush=True)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            results["torch"].setdefault(key, {})["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"== torch {key} torch.compile failed: {e!r:.300}", flush=True)


def ledger(root: Path, results: dict) -> dict:
    """The ledger of GPU-verified kernel kinds this run earns (edgeq/backends/cuda/ledger.py's format): a kind
    whose source key (each CUTLASS bundle's manifest: library.gpu_kernels.cutlass.kinds) ran in at least one bundle
    that passed its self-test and memcheck, and in none that failed the self-test, memcheck, racecheck or (a probe)
    the strict comparison.
    Plain Python: the GPU machine has no edgeq."""
    ran: dict[tuple[str, str], list[str]] = {}
    failed: set[tuple[str, str]] = set()
    sanitized: set[tuple[str, str]] = set()  # a kind ran in a bundle memcheck passed
    for name, row in results["edgeq"].items():
        kinds = _kinds(root, name)
        ok = (row.get("self_test", {}).get("rc") == 0
              and all(results.get(check, {}).get(name, {}).get("rc", 0) == 0 for check in ("memcheck", "racecheck"))
              and results.get("strict", {}).get(name, {}).get("passed", True))
        for kind, key in kinds.items():
            if ok:
                ran.setdefault((kind, key), []).append(name)
                if results.get("memcheck", {}).get(name, {}).get("rc") == 0:
                    sanitized.add((kind, key))
            else:
                failed.add((kind, key))
    gpu, _, rest = results["gpu"].partition(",")
    driver = rest.split(",")[0].strip()
    kinds = {kind: {"source_sha256": key, "gpu": gpu.strip(), "driver": driver, "date": results["date"],
                    "evidence": sorted(names)} for (kind, key), names in sorted(ran.items())
             if (kind, key) not in failed and (kind, key) in sanitized}
    return {"about": "written by benchmarks/gpu_bench.py run; merge into edgeq/backends/cuda/gpu_verified.json "
                     "with: python benchmarks/gpu_bench.py ledger OUT/gpu_verified.json", "format": 1, "kinds": kinds}


def merge_ledger(earned: Path, ledger_path: Path) -> dict:
    """The package's ledger with the kinds of ``earned`` (a run's gpu_verified.json) put in (newer replaces)."""
    have = json.loads(ledger_path.read_text()) if ledger_path.is_file() else {"format": 1, "kinds": {}}
    have.setdefault("kinds", {}).update(json.loads(earned.read_text()).get("kinds", {}))
    ledger_path.write_text(json.dumps(have, indent=1, sort_keys=True) + "\n")
    return have


def summary(results: dict) -> str:
    lines = [f"{'bundle':30} {'self-test':>9} {'p50 ms':>8} {'torch graph':>11} {'ratio':>6} {'compile':>8}"]
    for name, row in results["edgeq"].items():
        if name.startswith("probe"):
            lines.append(f"{name:30} {'ok' if row['self_test']['rc'] == 0 else 'FAIL':>9}")
            continue
        model, batch = name.split("-")[0], name.split("-")[1]
        peer = results["torch"].get(f"{model}-{batch}", {})
        graph = peer.get("fp16_cuda_graph", {}).get("p50_ms")
        comp = peer.get("compile_reduce_overhead", {}).get("p50_ms")
        p50 = row.get("latency", {}).get("p50_ms")
        ratio = f"{p50 / graph:.2f}" if p50 and graph else "-"
        lines.append(f"{name:30} {'ok' if row['self_test']['rc'] == 0 else 'FAIL':>9} {p50 or '-':>8} "
                     f"{graph or '-':>11} {ratio:>6} {comp or '-':>8}")
    return "\n".join(lines)


def run(root: Path, out: Path, runs: int, budget_s: float) -> None:
    started = time.time()
    with tarfile.open(root / "bundles.tar.xz") as tar:
        tar.extractall(root, filter="fully_trusted")
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"], 30)[1].strip()
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": smi, "device_profile": DEVICE, "runs": runs,
               "edgeq": {}, "torch": {}, "memcheck": {}, "racecheck": {}, "strict": {}, "ncu": {}}
    print(f"gpu_bench: {smi}", flush=True)

    def save():
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=1) + "\n")

    for step in (lambda: run_bundles(root, results, runs),  # verification first, then the comparisons
                 lambda: strict(root, results),
                 lambda: sanitize(root, results, started + budget_s),
                 lambda: concurrent(root, results),
                 lambda: run_torch(root, results, runs, 0),
                 lambda: profile(root, results),
                 lambda: run_torch(root, results, runs, started + budget_s, COMPILED)):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - keep what the other steps measured
            results.setdefault("errors", []).append(f"{type(e).__name__}: {str(e)[:500]}")
            print(f"gpu_bench: step failed: {e!r:.500}", flush=True)
        save()
    results["seconds"] = round(time.time() - started, 1)
    save()
    earned = ledger(root, results)
    (out / "gpu_verified.json").write_text(json.dumps(earned, indent=1) + "\n")
    print(f"gpu_bench: {len(earned['kinds'])} kernel kind(s) verified: {', '.join(earned['kinds']) or 'none'}")
    print(summary(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("half", choices=["build", "run", "profile", "ledger"])
    parser.add_argument("dir", nargs="?", type=Path, default=Path("gpu_bench"),
                        help="the bundles' folder; ledger: a run's gpu_verified.json, merged into edgeq's ledger")
    parser.add_argument("--only", nargs="+", help="build: only these bundles")
    parser.add_argument("--set", dest="which", choices=["verify", "compare", "all"], default="verify",
                        help="build: verify (default: the probes and the bundles that run every kernel kind, for the "
                             "ledger), compare (the others, against PyTorch), all (over the 64 MiB carried)")
    parser.add_argument("--runs", type=int, default=200, help="run: timed runs per bundle and peer")
    parser.add_argument("--archive", default="bundles.tar.xz", help="profile: the archive of bundle folders in DIR")
    parser.add_argument("--budget", type=float, default=330,
                        help="run: seconds after which the sanitizers and torch.compile are skipped")
    args = parser.parse_args()
    if args.half == "build":
        build(args.dir, args.only, args.which)
    elif args.half == "ledger":  # here, after a run: its verified kinds into the package's ledger
        target = Path(__file__).resolve().parent.parent / "packager" / "backends" / "cuda" / "gpu_verified.json"
        merged = merge_ledger(args.dir, target)
        print(f"{target}: {len(merged['kinds'])} kernel kind(s): {', '.join(sorted(merged['kinds'])) or 'none'}")
    elif args.half == "profile":
        profile_all(args.dir, Path(os.environ.get("OUT") or args.dir), args.archive)
    else:
        run(args.dir, Path(os.environ.get("OUT") or args.dir), args.runs, args.budget)


if __name__ == "__main__":
    main()
