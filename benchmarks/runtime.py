"""The bundled runtime: its size per device profile, and start-up + first inference of the native loader
(runtime/edgeq-run) against the Python loader (python3 run.py) on this machine, measured side by side.

    python benchmarks/runtime.py [--runs 10] [--json]

Start-up is the whole command `--self-test`: read and check the manifest, hash every file, load the runtime
and the model, run the golden input once, compare. Rounds alternate the two loaders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

import common  # noqa: F401  (puts examples/ on sys.path)
import make_models

PROFILES = ("host", "arm64-cpu", "jetson-orin-nano")


def package(model: Path, device: str, out: Path) -> Path:
    proc = subprocess.run(["edgeq", "package", str(model), "--device", device, "-o", str(out), "-q", "--json"],
                          capture_output=True, text=True, check=True)
    return Path(json.loads(proc.stdout)["bundle_dir"])


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "resnet_cnn.onnx")
        onnx.save(make_models.resnet_cnn(), model)
        sizes = []
        for device in PROFILES:
            bundle = package(model, device, Path(tmp, "out"))
            runtime = json.loads((bundle / "manifest.json").read_text())["runtime"]
            files = {name: (bundle / name).stat().st_size for name in [runtime["loader"], *runtime["libraries"]]}
            sizes.append({"device": device, "runtime_mb": sum(files.values()) / 1e6,
                          "files": {k.removeprefix("runtime/"): round(v / 1e6, 2) for k, v in files.items()},
                          "bridge": runtime["cuda_bridge"] is not None})
        host = Path(tmp, "out", "resnet_cnn-host")
        native_cmd = [str(host / "runtime" / "edgeq-run"), "--self-test"]
        python_cmd = [sys.executable, str(host / "run.py"), "--self-test"]
        native, python = [], []
        for _ in range(args.runs):
            native.append(timed(native_cmd))
            python.append(timed(python_cmd))
    startup = {"edgeq_run_ms": statistics.median(native), "run_py_ms": statistics.median(python)}
    startup["ratio"] = startup["run_py_ms"] / startup["edgeq_run_ms"]
    if args.json:
        print(json.dumps({"runtime_size": sizes, "startup_self_test": startup}, indent=2))
        return
    print("| profile | runtime/ | files (MB) | CUDA 12 bridge |")
    print("|---|---|---|---|")
    for row in sizes:
        files = ", ".join(f"{k} {v}" for k, v in row["files"].items())
        print(f"| {row['device']} | {row['runtime_mb']:.1f} MB | {files} | {'yes' if row['bridge'] else '-'} |")
    print()
    print(f"start-up + first inference (`--self-test`, resnet_cnn host bundle, median of {args.runs}):")
    print(f"| loader | ms |\n|---|---|\n| runtime/edgeq-run | {startup['edgeq_run_ms']:.0f} |\n"
          f"| python3 run.py | {startup['run_py_ms']:.0f} |\n| ratio | {startup['ratio']:.1f}x |")


if __name__ == "__main__":
    main()
