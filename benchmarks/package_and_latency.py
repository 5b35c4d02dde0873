"""Package each example model for the host and a Jetson, and measure host latency side by side with
ONNX Runtime (same input, same machine, one run). Prints a table, or JSON with --json.

    python benchmarks/package_and_latency.py [--repeat 50] [--json]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import bundle_model, median_ms, ort_session, report

import make_models  # noqa: E402

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.tvm_env import import_tvm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--jetson", default="jetson-orin-nano", help="Jetson profile to package for")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import_tvm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in make_models.write_all(Path(tmp, "models")):
            host = package(PackageArgs(model=path, device="host", output=Path(tmp, "dist")))
            jetson = package(PackageArgs(model=path, device=args.jetson, output=Path(tmp, "dist")))
            spec = host.manifest.inputs[0]
            inputs = {spec.name: np.random.default_rng(0).standard_normal(spec.shape).astype(spec.dtype)}
            model = bundle_model(host.bundle_dir)
            edgeq_args = model.arguments(inputs)
            session = ort_session(path, args.threads)
            edgeq_ms = median_ms(lambda: model.vm["main"](*edgeq_args), args.repeat, warmup=5)
            ort_ms = median_ms(lambda: session.run(None, inputs), args.repeat, warmup=5)
            rows.append({
                "model": path.stem,
                "package_host_s": host.total_seconds,
                f"package_{args.jetson}_s": jetson.total_seconds,
                "edgeq_host_fp32_ms": round(edgeq_ms, 3),
                "onnxruntime_fp32_ms": round(ort_ms, 3),
                "edgeq_speed_vs_ort": round(ort_ms / edgeq_ms, 3),
            })
    report(f"package time and host fp32 latency (median of {args.repeat}); ORT {args.threads} threads", rows, args.json)

if __name__ == "__main__":
    main()
