"""Where edgeq stands on speed (issue: INT8 >= 2.5x fp32, fp32 >= ONNX Runtime): ResNet-18 at 224x224,
random weights, batch 1 and 8, edgeq fp32 / int8 host bundles vs ONNX Runtime fp32 / int8 QDQ (2 threads),
all built and measured in this one run. Prints a table, or JSON with --json.

    python benchmarks/speed.py [--repeat 5] [--batches 1 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx

from common import bundle_model, median_ms, ort_session, show

import make_models  # noqa: E402
from quantize_with_ort import ort_quantize  # noqa: E402

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.quantize import QuantizeArgs  # noqa: E402
from edgeq.toolchain import import_tvm  # noqa: E402


def edgeq_ms(bundle_dir: Path, x: np.ndarray, repeat: int) -> float:
    return bundle_model(bundle_dir).benchmark({"input": x}, repeat=repeat, warmup=1)["median_ms"]


def ort_ms(path: Path, x: np.ndarray, repeat: int, threads: int) -> float:
    session = ort_session(path, threads)
    return median_ms(lambda: session.run(None, {"input": x}), repeat, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import_tvm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for batch in args.batches:
            model = tmp / f"resnet18_b{batch}.onnx"
            onnx.save(make_models.resnet18(batch=batch), model)
            calib = tmp / f"calib_b{batch}.npz"
            np.savez(calib, input=np.random.default_rng(1).standard_normal((max(16, batch), 3, 224, 224)).astype(np.float32))
            qdq = ort_quantize(model, tmp / f"resnet18_b{batch}_qdq.onnx", samples=4)
            fp32 = package(PackageArgs(model=model, device="host", output=tmp / "fp32"))
            int8 = package(PackageArgs(model=model, device="host", output=tmp / "int8", precision="int8",
                                       quantize=QuantizeArgs(calibrate=calib, samples=max(16, batch))))
            x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
            r = {"batch": batch,
                 "edgeq_fp32_ms": edgeq_ms(fp32.bundle_dir, x, args.repeat),
                 "edgeq_int8_ms": edgeq_ms(int8.bundle_dir, x, args.repeat),
                 "ort_fp32_ms": ort_ms(model, x, args.repeat, args.threads),
                 "ort_int8_qdq_ms": ort_ms(qdq, x, args.repeat, args.threads)}
            r.update(int8_vs_fp32=r["edgeq_fp32_ms"] / r["edgeq_int8_ms"],
                     fp32_vs_ort=r["ort_fp32_ms"] / r["edgeq_fp32_ms"],
                     int8_vs_ort_int8=r["ort_int8_qdq_ms"] / r["edgeq_int8_ms"])
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    show(f"ResNet-18 224x224, median ms (ratios > 1: edgeq faster); ORT {args.threads} threads", rows)

if __name__ == "__main__":
    main()
