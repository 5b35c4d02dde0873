"""What the benchmark scripts share: the examples on sys.path, the bundle's own loader, timing, tables."""

from __future__ import annotations

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


def show(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(row.get(k, "-")) for k in rows[0]))
    Console(width=200).print(table)
