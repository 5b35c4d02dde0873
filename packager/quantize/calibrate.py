"""Calibration: run the float model on the host with TVM over the calibration samples and collect, for
the input activation of every quantizable layer, its range and a histogram of |x|.

Two passes over the data: the first finds max |x| per tensor, the second fills a fixed-range histogram
(2048 bins over [0, max|x|]) that the percentile, entropy and MSE calibrators read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from edgeq.compile import HostRunner
from edgeq.graph import Graph, Rewriter, call_op, rewrite
from edgeq.quantize.hoist_quantize import POOLS
from edgeq.quantize.layers import Layer

BINS = 2048


@dataclasses.dataclass
class TensorStats:
    min: float = np.inf
    max: float = -np.inf
    absmax: float = 0.0
    count: int = 0
    hist: np.ndarray | None = None  # counts of |x| over [0, absmax], BINS bins

    def to_dict(self) -> dict:
        return {"min": float(self.min), "max": float(self.max), "absmax": float(self.absmax), "count": self.count}


def pooled_source(rw: Rewriter, x):
    """``x``, or what the max-pools that make ``x`` read: a layer after a max-pool is calibrated on the
    pool's input, so that it and the pool's other readers agree on one scale and the pool can run on int8
    (``hoist_quantize``), as ONNX Runtime's quantizer gives a MaxPool's output its input's scale."""
    while call_op(rw.value(x)) in POOLS:
        x = rw.value(x).args[0]
    return x


def with_taps(graph: Graph, layers: list[Layer], through_pools: bool = True) -> Graph:
    """The graph with extra outputs: the input activation of each layer (seen through max-pools,
    ``pooled_source``, unless ``through_pools`` is False), in ``layers`` order."""
    wanted = {layer.weight: i for i, layer in enumerate(layers)}
    taps: dict[int, object] = {}

    def visit(rw: Rewriter, var, value):
        weight_var, _ = rw.weight_operand(value)
        if weight_var is not None and weight_var.name in wanted:
            taps.setdefault(wanted[weight_var.name], pooled_source(rw, value.args[0]) if through_pools else value.args[0])
        return None

    return rewrite(graph, visit, extra_outputs=lambda rw: [rw.new(taps[i]) for i in range(len(layers))])


def collect(
    graph: Graph,
    layers: list[Layer],
    samples: Callable[[], Iterable[list[np.ndarray]]],
    histograms: bool,
    progress: Callable[[str, int], None] | None = None,
) -> list[TensorStats]:
    """Statistics of each layer's input activation over ``samples()`` (called once per pass)."""
    n_out = graph.num_outputs
    runner = HostRunner(with_taps(graph, layers))
    stats = [TensorStats() for _ in layers]
    for i, sample in enumerate(samples()):
        taps = runner(sample)[n_out:]
        for st, t in zip(stats, taps):
            st.min, st.max = min(st.min, float(t.min())), max(st.max, float(t.max()))
            st.absmax = max(st.absmax, float(np.abs(t).max()))
            st.count += t.size
        if progress:
            progress("range", i + 1)
    # a per-token layer's scales are computed at run time: its calibrated threshold is never used, and its
    # ranges above are only reported; no histogram for it (all-MiniLM: every MatMul)
    wanted = [st.absmax > 0 and layer.activation != "per-token" for st, layer in zip(stats, layers)]
    if histograms and any(wanted):
        for st, want in zip(stats, wanted):
            st.hist = np.zeros(BINS, np.int64) if want else None
        for i, sample in enumerate(samples()):
            taps = runner(sample)[n_out:]
            for st, want, t in zip(stats, wanted, taps):
                if want:
                    st.hist += np.histogram(np.abs(t), bins=BINS, range=(0.0, st.absmax))[0]
            if progress:
                progress("histogram", i + 1)
    return stats
