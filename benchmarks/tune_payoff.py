"""What ``edgeq tune`` pays: for each model, a tune of N trials on this host's CPU over TVM RPC on loopback (a
real tracker and server, as a device would be reached), with meta_schedule's XGBoost cost model and with
random guesses (same trials, same tasks: the sum over tasks of the best latency found), then the bundle
packaged without records and with the XGBoost tune's records, their latencies measured side by side
(interleaved rounds, median of medians, the bundles' own loader).

    python benchmarks/tune_payoff.py [resnet18:int8 mobilenet_v2:fp32 ...] [--trials 64] [--size 96] [--json]

The host CPU stands in for the device: what the table shows is the search, not a Jetson's numbers.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import bundle_model, median_ms, report

import zoo  # noqa: E402 - benchmarks/ is on sys.path when run as a script

from edgeq.package import FrontEndArgs, PackageArgs, package  # noqa: E402
from edgeq.quantize import QuantizeArgs  # noqa: E402
from edgeq.rpc.tune import TuneArgs, pool_size, tune  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgeq", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def loopback_device(key: str) -> tuple[str, list[subprocess.Popen]]:
    port = _port()
    procs = [_start("rpc", "tracker", "--port", port, "--port-end", port + 1)]
    time.sleep(2)
    procs.append(_start("rpc", "serve", "--tracker", f"127.0.0.1:{port}", "--key", key, "--port", _port(),
                        "--port-end", "65000"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if pool_size("127.0.0.1", port, key, 5) >= 1:
                break
        except Exception:  # noqa: BLE001 - the tracker is still starting
            pass
        time.sleep(0.5)
    return f"127.0.0.1:{port}", procs


def best_total_ms(result: dict) -> float:
    return float(sum(t["best_ms"] or 0.0 for t in result["tasks"]))


def payoff(name: str, precision: str, path: Path, work: Path, rpc: str, key: str, trials: int, size: int,
           repeat: int) -> dict:
    calib = work / f"{name}-calib.npz"
    np.savez(calib, input=np.random.default_rng(0).standard_normal((16, 3, size, size)).astype(np.float32))
    quantize = QuantizeArgs(calibrate=calib, samples=16) if precision == "int8" else None
    found = {}
    for cost_model in ("xgb", "random"):
        records = work / f"{name}-{precision}-{cost_model}.json"
        start = time.perf_counter()
        front = FrontEndArgs(model=path, device="host", precision=precision, quantize=quantize)
        result = tune(TuneArgs(front=front, rpc=rpc, key=key, trials=trials, records=records, cost_model=cost_model))
        found[cost_model] = (best_total_ms(result), time.perf_counter() - start, len(result["tasks"]), records)
    bundles = {}
    for label, records in (("untuned", None), ("tuned", found["xgb"][3])):
        built = package(PackageArgs(model=path, device="host", output=work / f"dist-{label}", precision=precision,
                                    quantize=quantize, runtime="none", records=records, name=f"{name}-{label}"))
        bundles[label] = (bundle_model(built.bundle_dir), built.records_applied)
    x = {"input": np.random.default_rng(1).standard_normal((1, 3, size, size)).astype(np.float32)}
    times = {label: [] for label in bundles}
    for _ in range(5):  # interleaved: the host's noise lands on both
        for label, (model, _) in bundles.items():
            times[label].append(median_ms(lambda m=model: m.run(x), repeat, 3))
    untuned, tuned = (float(np.median(times[k])) for k in ("untuned", "tuned"))
    return {"model": name, "precision": precision, "trials": trials, "tasks": found["xgb"][2],
            "records applied": bundles["tuned"][1], "untuned ms": round(untuned, 3), "tuned ms": round(tuned, 3),
            "speed-up": round(untuned / tuned, 3),
            "best found, xgb ms": round(found["xgb"][0], 4), "best found, random ms": round(found["random"][0], 4),
            "xgb / random": round(found["xgb"][0] / found["random"][0], 3) if found["random"][0] else None,
            "tune s (xgb, random)": f"{found['xgb'][1]:.0f}, {found['random'][1]:.0f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet18:int8", "mobilenet_v2:fp32"])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pairs = [m.partition(":")[::2] for m in args.models]
    rpc, procs = loopback_device("payoff")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            paths = zoo.export(sorted({n for n, _ in pairs}), Path(tmp), args.size)
            for name, precision in pairs:
                rows.append(payoff(name, precision or "fp32", paths[name], Path(tmp), rpc, "payoff", args.trials,
                                   args.size, args.repeat))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.kill()
    report(f"edgeq tune on this host over RPC on loopback, {args.trials} trials: untuned vs tuned, XGBoost vs random", rows,
           args.json)


if __name__ == "__main__":
    main()
