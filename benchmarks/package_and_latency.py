"""Package each example model for the host and a Jetson, and measure host latency side by side with
ONNX Runtime (same input, same machine, one run). Prints a table, or JSON with --json.

    python benchmarks/package_and_latency.py [--repeat 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import make_models  # noqa: E402

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.toolchain import import_tvm  # noqa: E402


def median_ms(fn, repeat: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def edgeq_runner(bundle_dir: Path, inputs: dict):
    sys.path.insert(0, str(bundle_dir))
    try:
        import run  # the bundle's own loader

        model = run.Model()
    finally:
        sys.path.remove(str(bundle_dir))
        sys.modules.pop("run", None)
    args = model.arguments(inputs)
    return lambda: model.vm["main"](*args)


def ort_runner(path: Path, inputs: dict, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, inputs)


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
            spec = host.manifest["inputs"][0]
            inputs = {spec["name"]: np.random.default_rng(0).standard_normal(spec["shape"]).astype(spec["dtype"])}
            edgeq_ms = median_ms(edgeq_runner(host.bundle_dir, inputs), args.repeat)
            ort_ms = median_ms(ort_runner(path, inputs, args.threads), args.repeat)
            rows.append({
                "model": path.stem,
                "package_host_s": host.total_seconds,
                f"package_{args.jetson}_s": jetson.total_seconds,
                "edgeq_host_fp32_ms": round(edgeq_ms, 3),
                "onnxruntime_fp32_ms": round(ort_ms, 3),
                "edgeq_speed_vs_ort": round(ort_ms / edgeq_ms, 3),
            })
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"package time and host fp32 latency (median of {args.repeat}); ORT {args.threads} threads")
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
