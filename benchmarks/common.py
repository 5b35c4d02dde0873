"""What the benchmark scripts share: the examples on sys.path, the bundle's own loader, timing, tables."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def bundle_model(bundle_dir: Path):
    """The bundle's model, loaded by the bundle's own run.py (as on a device)."""
    sys.path.insert(0, str(bundle_dir))
    try:
        import run

        return run.Model()
    finally:
        sys.path.remove(str(bundle_dir))
        sys.modules.pop("run", None)


def ort_session(path: Path, threads: int):
    """ONNX Runtime as a user gets it, for speed: its defaults (on a CPU without VNNI its u8 x s8 products may
    saturate; accuracy references use ``edgeq.reference.onnxruntime_session``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_ms(fn, repeat: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in ms after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def kernel_breakdown(model, inputs: dict, runs: int = 10, top: int = 15) -> list[dict]:
    """Where a bundle's time goes: every call the Relax VM makes (fused kernels, allocations), timed by a VM
    instrument around the call, median over ``runs`` runs of the model; the ``top`` costliest kernels with
    their share of the sum and the shapes of their tensor arguments at the first call. The instrument adds
    a few microseconds per call to what it measures. ``model`` is a bundle's loaded ``run.Model``."""
    import tvm

    args = model.arguments(inputs)
    start: list[float] = [0.0]
    durations: dict[str, list[float]] = {}
    shapes: dict[str, str] = {}  # a kernel's tensor arguments, first call: inputs ..., output last

    def instrument(func, symbol, before_run, ret_value, *call_args):
        now = time.perf_counter()
        if before_run:
            start[0] = now
            if symbol not in shapes:
                shapes[symbol] = " ".join("x".join(map(str, a.shape)) for a in call_args if hasattr(a, "shape"))
        else:
            durations.setdefault(symbol, []).append(now - start[0])
        return 0

    model.vm["main"](*args)
    per_run: dict[str, list[tuple[int, float]]] = {}
    model.vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        for _ in range(runs):
            durations.clear()
            model.vm["main"](*args)
            for symbol, times in durations.items():
                per_run.setdefault(symbol, []).append((len(times), sum(times)))
    finally:
        model.vm.set_instrument(None)
    rows = [{"kernel": symbol, "args": shapes.get(symbol, ""), "calls": samples[0][0],
             "ms": float(np.median([t for _, t in samples])) * 1e3} for symbol, samples in per_run.items()]
    total = sum(r["ms"] for r in rows)
    rows.sort(key=lambda r: -r["ms"])
    return [{**r, "ms": round(r["ms"], 3), "share": round(r["ms"] / total, 3)} for r in rows[:top]]


def show(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(row.get(k, "-")) for k in rows[0]))
    Console(width=200).print(table)


def report(title: str, rows: list[dict], as_json: bool) -> None:
    """A benchmark's rows as JSON (``--json``) or as a table titled ``title``."""
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        show(title, rows)
