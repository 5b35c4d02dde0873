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


class Taps:
    """``graph`` built once for the host with, after its own outputs, what quantizing it reads of every layer
    (in ``layers`` order): the layer's input as calibration sees it (through max-pools, ``pooled_source``), its
    input as the layer reads it (bias correction) and its output (the float side of the per-layer SQNR).
    Calibration, bias correction, the evaluation's float reference and the SQNR all run on this one build, so
    quantizing compiles the float graph once. Calling it on a sample returns a ``Tapped``."""

    def __init__(self, graph: Graph, layers: list[Layer]):
        wanted = {layer.weight: i for i, layer in enumerate(layers)}
        pooled: dict[int, object] = {}
        read: dict[int, object] = {}
        made: dict[int, object] = {}

        def visit(rw: Rewriter, var, value):
            weight_var, _ = rw.weight_operand(value)
            if weight_var is not None and weight_var.name in wanted:
                i = wanted[weight_var.name]
                pooled.setdefault(i, pooled_source(rw, value.args[0]))
                read.setdefault(i, value.args[0])
                made[i] = var  # as quantize_ops taps a layer's output: its last use of the weight
            return None

        def extra(rw: Rewriter) -> list:
            return [rw.new(taps[i]) for taps in (pooled, read, made) for i in range(len(layers))]

        self.outputs = graph.num_outputs
        self.layers = len(layers)
        self.runner = HostRunner(rewrite(graph, visit, extra_outputs=extra))

    def __call__(self, sample: list[np.ndarray]) -> Tapped:
        values = self.runner(sample)
        n, k = self.outputs, self.layers
        return Tapped(values[:n], values[n:n + k], values[n + k:n + 2 * k], values[n + 2 * k:])


@dataclasses.dataclass
class Tapped:
    """One run of ``Taps``: the graph's outputs, and per layer its calibrated input, its input and its output."""
    outputs: list[np.ndarray]
    pooled_inputs: list[np.ndarray]
    inputs: list[np.ndarray]
    layer_outputs: list[np.ndarray]


def collect(
    taps: Taps,
    layers: list[Layer],
    samples: Callable[[], Iterable[list[np.ndarray]]],
    histograms: bool,
    progress: Callable[[str, int], None] | None = None,
) -> list[TensorStats]:
    """Statistics of each layer's input activation (``taps``' calibrated inputs) over ``samples()`` (called
    once per pass)."""
    stats = [TensorStats() for _ in layers]
    for i, sample in enumerate(samples()):
        for st, t in zip(stats, taps(sample).pooled_inputs):
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
            for st, want, t in zip(stats, wanted, taps(sample).pooled_inputs):
                if want:
                    st.hist += np.histogram(np.abs(t), bins=BINS, range=(0.0, st.absmax))[0]
            if progress:
                progress("histogram", i + 1)
    return stats
