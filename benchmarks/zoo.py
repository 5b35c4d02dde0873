"""The torchvision zoo (classification and segmentation) through edgeq, against ONNX Runtime, in one run.

Each model is exported by ``examples/export_torchvision.py`` (opset 17, random weights, eval, batch 1) in
the export environment (``.venv-export``, made by ``scripts/setup.sh``), then, in a child process of its
own (a crash or a hang costs one row, not the run):

- fp32 ``host`` bundle: packaged and run by its own loader on a fixed standard-normal input, compared to
  ONNX Runtime on the same input (pass: |edgeq - ort| <= 1e-3 |ort| + 1e-4 max|ort|);
- int8 ``host`` bundle (``--int8``): 32 calibration samples, cosine of its output against fp32 ONNX
  Runtime on 8 held-out inputs (goal >= 0.99);
- ``jetson-orin-nano`` fp32 bundle (``--jetson``): packaged (cross-compiled, sm_87), not run;
- where the time goes (``--profile N``): the N costliest kernels of each bundle (VM calls timed by an
  instrument, median of 10 runs), with their share of the total;
- latency (``--speed``): median ms of the fp32 / int8 bundles and of ONNX Runtime fp32 / its QDQ int8
  (``quant_pre_process`` then ``quantize_static``, same calibration data), all measured in that child,
  threads = cores, in interleaved rounds (each round times every one of them in turn, so they share the
  machine's load, after a pause that lets the other runtime's threads stop spinning: see ``interleaved``).

    python benchmarks/zoo.py --families --int8 [--jetson] [--speed] [--size 224] [--json]
    python benchmarks/zoo.py --segmentation --int8 --speed      # DeepLabV3 and LR-ASPP (MobileNetV3-Large)
    python benchmarks/zoo.py resnet18 shufflenet_v2_x0_5 --int8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import bundle_model, kernel_breakdown, median_ms, ort_session, show

ROOT = Path(__file__).resolve().parent.parent
EXPORT_PYTHON = ROOT / ".venv-export" / "bin" / "python"
CALIB_SAMPLES, EVAL_SAMPLES = 32, 8
RTOL, ATOL_SCALE = 1e-3, 1e-4


def export(names: list[str], out_dir: Path, size: int) -> dict[str, Path]:
    if not EXPORT_PYTHON.exists():
        sys.exit(f"zoo: {EXPORT_PYTHON} not found; run scripts/setup.sh (it makes the torch export environment)")
    done = subprocess.run([str(EXPORT_PYTHON), str(ROOT / "examples" / "export_torchvision.py"), "-o", str(out_dir),
                           "--size", str(size), *names], capture_output=True, text=True)
    paths = {}
    for line in done.stdout.splitlines():
        if not line.startswith("{"):  # torch.onnx prints the graph it failed on to stdout
            continue
        row = json.loads(line)
        paths[row["name"]] = Path(row["path"])
    if done.returncode != 0:
        print(f"zoo: export stopped: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}",
              file=sys.stderr)
    return paths


def matches(out: np.ndarray, ref: np.ndarray) -> tuple[bool, float]:
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = np.abs(out.astype(np.float64) - ref)
    ok = bool(np.all(err <= RTOL * np.abs(ref) + ATOL_SCALE * scale))
    return ok, float(err.max() / scale)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    from edgeq.quantize import _agreement  # scale-free, as edgeq's own quantization report

    return _agreement(a, b)["cosine"]


def one(path: Path, work: Path, int8: bool, jetson: bool, speed: bool, repeat: int, profile: int = 0,
        cutlass: bool = False) -> dict:
    """Everything for one model (runs in a child process)."""
    from edgeq.errors import EdgeqError
    from edgeq.package import PackageArgs, package
    from edgeq.quantize import QuantizeArgs

    row: dict = {}
    threads = len(os.sched_getaffinity(0))
    ort = ort_session(path, threads)
    spec = ort.get_inputs()[0]
    out_name = ort.get_outputs()[0].name
    shape = [int(d) for d in spec.shape]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    ref = ort.run(None, {spec.name: x})[0]
    calib = rng.standard_normal((CALIB_SAMPLES, *shape[1:])).astype(np.float32)
    held = rng.standard_normal((EVAL_SAMPLES, *shape[1:])).astype(np.float32)
    np.savez(work / "calib.npz", **{spec.name: calib})
    np.savez(work / "eval.npz", **{spec.name: held})

    def attempt(key: str, fn):
        start = time.perf_counter()
        try:
            result = fn()
        except EdgeqError as err:
            row[key] = f"refused: {err}"
            return None
        except Exception as err:  # noqa: BLE001 - a row, not a crash of the run
            row[key] = f"crash: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            return None
        row[f"{key}_s"] = round(time.perf_counter() - start, 1)
        return result

    timed: dict = {}  # --speed: what to time, all in interleaved rounds at the end
    fp32 = attempt("fp32", lambda: package(PackageArgs(model=path, device="host", output=work / "fp32", runtime="none")))
    fp32_model = None
    if fp32 is not None:
        fp32_model = bundle_model(fp32.bundle_dir)
        ok, err = matches(fp32_model.run({spec.name: x})[out_name], ref)
        row["fp32"] = "match" if ok else "WRONG"
        row["fp32_err"] = float(f"{err:.2g}")
    if int8:
        q = attempt("int8", lambda: package(PackageArgs(
            model=path, device="host", output=work / "int8", precision="int8", runtime="none",
            quantize=QuantizeArgs(calibrate=work / "calib.npz", eval=work / "eval.npz"))))
        if q is not None:
            model = bundle_model(q.bundle_dir)
            refs = [ort.run(None, {spec.name: held[i:i + 1]})[0] for i in range(EVAL_SAMPLES)]
            outs = [model.run({spec.name: held[i:i + 1]})[out_name] for i in range(EVAL_SAMPLES)]
            row["int8_cosine"] = round(min(cosine(o, r) for o, r in zip(outs, refs)), 4)
            row["int8"] = "ok" if row["int8_cosine"] >= 0.99 else "LOW"
            row["int8_float_layers"] = q.manifest.quantization.precision_counts.get("fp32")
            if speed:
                timed["int8_ms"] = lambda: model.run({spec.name: x})
    if jetson:
        attempt("jetson", lambda: package(PackageArgs(model=path, device="jetson-orin-nano", output=work / "jetson",
                                                       runtime="none")))
        row.setdefault("jetson", "built")
    if cutlass:  # fp16 and int8 for jetson-orin-nano with --gpu-kernels cutlass: built, checked against ONNX Runtime
        for precision in ("fp16", "int8"):
            quantize = QuantizeArgs(calibrate=work / "calib.npz") if precision == "int8" else None
            built = attempt(f"cutlass_{precision}", lambda: package(PackageArgs(
                model=path, device="jetson-orin-nano", output=work / f"cutlass-{precision}", precision=precision,
                quantize=quantize, runtime="none", gpu_kernels="cutlass")))
            if built is not None:
                record = built.manifest.library.gpu_kernels.get("cutlass") or {}
                taken, left = len(record.get("kernels", [])), len(record.get("left", []))
                depthwise = len(record.get("depthwise", []))
                pools = len(record.get("pool_classifiers", []))  # a classifier with its pool on edgeq's kernel
                gates = 2 * len(record.get("squeeze_excitations", []))  # each squeeze-and-excitation's two 1x1s
                scores = len(record.get("attention_scores", []))  # attention's Q K^T with its softmax
                row[f"cutlass_{precision}"] = (
                    f"built: {taken} of {taken + depthwise + pools + gates + scores + left} convolutions and matrix "
                    f"products on CUTLASS, {depthwise} depthwise, {pools} classifier, {gates} squeeze-and-excitation "
                    f"1x1s and {scores} attention score products on edgeq's kernels")
    if profile:
        if fp32_model is not None:
            row["fp32_kernels"] = kernel_breakdown(fp32_model, {spec.name: x}, top=profile)
        if int8 and q is not None:
            row["int8_kernels"] = kernel_breakdown(model, {spec.name: x}, top=profile)
    if speed:
        timed["ort_ms"] = lambda: ort.run(None, {spec.name: x})
        if fp32_model is not None:
            timed["fp32_ms"] = lambda: fp32_model.run({spec.name: x})
        if int8:
            sys.path.insert(0, str(ROOT / "examples"))
            from quantize_with_ort import ort_quantize

            qdq = ort_quantize(path, work / "qdq.onnx", samples=CALIB_SAMPLES, preprocess=True)
            ort8 = ort_session(qdq, threads)
            timed["ort_int8_ms"] = lambda: ort8.run(None, {spec.name: x})
        row.update(interleaved(timed, repeat))
        if "fp32_ms" in row:
            row["fp32_vs_ort"] = round(row["ort_ms"] / row["fp32_ms"], 2)
        if int8:
            if "int8_ms" in row:
                row["int8_vs_ort_int8"] = round(row["ort_int8_ms"] / row["int8_ms"], 2)
                if "fp32_ms" in row:
                    row["int8_vs_fp32"] = round(row["fp32_ms"] / row["int8_ms"], 2)
    return row


def interleaved(timed: dict, repeat: int) -> dict:
    """Median ms of each callable over ``repeat`` rounds, each round timing every one of them in turn, so
    that on a machine whose cores are shared edgeq and ONNX Runtime see the same load. Before each one's
    10 timed calls: a 0.2 s pause and 3 untimed calls, so that the thread pool of the runtime that ran
    before has stopped spinning. (TVM's workers spin, yielding, for tens of ms after a parallel region:
    ONNX Runtime timed 50 ms after an edgeq run took 7.0 ms for MNASNet 0.5, 1.5 ms alone or after 0.2 s;
    timed with no pause at all, MNASNet's int8 bundle took 4.9 ms after ONNX Runtime, 2.7 ms alone.)"""
    for fn in timed.values():
        for _ in range(3):
            fn()
    samples: dict = {key: [] for key in timed}
    for _ in range(repeat):
        for key, fn in timed.items():
            time.sleep(0.2)
            samples[key].append(median_ms(fn, 10, 3))
    return {key: round(float(np.median(v)), 3) for key, v in samples.items()}


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return round(math.exp(sum(map(math.log, values)) / len(values)), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="torchvision builder names")
    parser.add_argument("--families", action="store_true", help="one builder per architecture family")
    parser.add_argument("--segmentation", action="store_true",
                        help="also the segmentation heads (DeepLabV3 and LR-ASPP on MobileNetV3-Large)")
    parser.add_argument("--all", action="store_true", help="every classification builder (hours on 2 cores)")
    parser.add_argument("--size", type=int, default=224, help="input height/width (ViT and MaxViT stay 224)")
    parser.add_argument("--int8", action="store_true", help="also int8 with 32 calibration samples")
    parser.add_argument("--jetson", action="store_true", help="also package fp32 for jetson-orin-nano")
    parser.add_argument("--speed", action="store_true", help="also latency against ONNX Runtime")
    parser.add_argument("--cutlass", action="store_true",
                        help="also package fp16 and int8 for jetson-orin-nano with --gpu-kernels cutlass")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also the N costliest kernels of each bundle (per-kernel ms and share)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per model")
    parser.add_argument("--models-dir", type=Path, default=None, help="keep the exported models here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.one, Path(tmp), args.int8, args.jetson, args.speed, args.repeat, args.profile,
                                 args.cutlass)))
        return 0

    sys.path.insert(0, str(ROOT / "examples"))
    from export_torchvision import FAMILIES, SEGMENTATION

    names = list(args.models) + (FAMILIES if args.families else []) + (SEGMENTATION if args.segmentation else [])
    if args.all:
        names.append("--list")
    if not names:
        parser.error("name models, or give --families / --segmentation / --all")
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = args.models_dir or Path(tmp) / "models"
        paths = export(names, models_dir, args.size)
        rows = []
        for name, path in paths.items():
            flags = [f for f, on in (("--int8", args.int8), ("--jetson", args.jetson), ("--speed", args.speed),
                                     ("--cutlass", args.cutlass)) if on]
            cmd = [sys.executable, __file__, "--one", str(path), "--repeat", str(args.repeat), "--profile",
                   str(args.profile), *flags]
            row = {"model": name, "size": path.stem.rsplit("-", 1)[-1]}
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = done.stdout.strip().splitlines()
                if done.returncode == 0 and lines:
                    row.update(json.loads(lines[-1]))
                else:
                    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    row["fp32"] = f"crash (exit {done.returncode}): {tail}"
            except subprocess.TimeoutExpired:
                row["fp32"] = f"timeout after {args.timeout:.0f} s"
            rows.append(row)
            if not args.json:
                print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {
        "fp32_match": sum(r.get("fp32") == "match" for r in rows),
        "int8_ok": sum(r.get("int8") == "ok" for r in rows),
        "models": len(rows),
        "geomean_fp32_vs_ort": geomean([r.get("fp32_vs_ort") for r in rows]),
        "geomean_int8_vs_ort_int8": geomean([r.get("int8_vs_ort_int8") for r in rows]),
        "geomean_int8_vs_fp32": geomean([r.get("int8_vs_fp32") for r in rows]),
    }
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        keys = ["model", "size", "fp32", "fp32_err", "int8", "int8_cosine", "int8_float_layers", "jetson",
                "fp32_ms", "ort_ms", "fp32_vs_ort", "int8_ms", "ort_int8_ms", "int8_vs_ort_int8", "int8_vs_fp32"]
        keys = [k for k in keys if any(k in r for r in rows)]
        show("torchvision zoo: edgeq vs ONNX Runtime", [{k: str(r.get(k, "-"))[:60] for k in keys} for r in rows])
        for r in rows:
            for precision in ("fp32", "int8"):
                if r.get(f"{precision}_kernels"):
                    show(f"{r['model']} {precision}: costliest kernels",
                         [{"kernel": k["kernel"][:70], "args": k["args"][:60], "calls": k["calls"], "ms": k["ms"],
                           "share": f"{k['share']:.1%}"} for k in r[f"{precision}_kernels"]])
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
