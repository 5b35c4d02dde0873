"""Pass: per-channel input scales for depthwise convolutions, by moving each channel's range into its weights
before calibration (SmoothQuant's migration, Xiao et al. 2023, at its exact end).

A depthwise convolution after a 1x1 expansion and a HardSwish (PP-LCNet, MobileNetV3) reads channels whose
ranges differ a hundredfold. One per-tensor int8 scale sized for the widest leaves the narrow ones a handful of
levels, and the error compounds block after block. Dividing input channel j by s_j = max|x_j| (calibration
data) and multiplying the weights that read it by s_j computes the same in float:

    conv2d(x, W, groups=C)  ->  conv2d(x * (1 / s), W * s[:, None, None, None], groups=C)

A depthwise weight's input channel j is its output channel j, quantized per output channel on its own scale,
so the weights lose nothing: the int8 input is per channel in effect. The multiply is an element-wise op in
front of the quantize and fuses into it.

Left as they are:
- a depthwise layer whose input the int8 passes keep integer (straight from another layer through a bias and
  ReLU/ReLU6, as in MobileNetV2; after a max-pool): a float multiply there would undo that;
- a tensor that something else also reads (it would be written twice, scaled and not);
- 1x1 convolutions and MatMul/Gemm: for them s must balance the input's spread against the weights'
  (s_j = max|x_j|^a / max|W_j|^(1-a)), and choosing ``a`` per layer by the layer's own int8 error made whole
  models worse as often as better (measured: PP-OCRv5's recognizer 51 -> 56 of 64 lines, but nudenet's YOLOv8n
  82.5% -> 55% of fp32's boxes, all-MiniLM-L6 mean cosine 0.977 -> 0.937); a transformer's MatMul/Gemm gets
  per-token scales instead (``quantize_ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from edgeq.compile import HostRunner
from edgeq.graph import Graph, Rewriter, call_op, relax, rewrite
from edgeq.quantize.hoist_quantize import POOLS
from edgeq.quantize.layers import Layer
from edgeq.quantize.requantize import clip_bounds

MAX_FACTOR = 1e4  # s is clamped to [1 / MAX_FACTOR, MAX_FACTOR]: a dead channel must not blow a weight up


def _depthwise(graph: Graph, value, layer: Layer) -> bool:
    w = graph.weights[layer.weight]
    a = value.attrs
    return (layer.kind == "conv2d" and a.data_layout == "NCHW" and a.kernel_layout == "OIHW" and int(a.groups) > 1
            and w.shape[1] == 1 and int(a.groups) == w.shape[0])


def _kept_integer(graph: Graph, rw: Rewriter, x) -> bool:
    """Whether ``x`` is a max-pool's output, or another layer's (after a bias and ReLU/ReLU6 at most): there the
    int8 passes keep the value integer (``hoist_quantize`` quantizes before the pool, ``requantize`` goes
    from one layer's int32 sums to the next's int8 input), and a float multiply in between would undo that."""
    value = rw.value(x)
    while value is not None:
        op = call_op(value)
        if op in POOLS or (op in ("relax.nn.conv2d", "relax.matmul") and rw.weight_operand(value)[0] is not None):
            return True
        bounds = clip_bounds(graph, rw, value)
        if bounds is not None:
            value = rw.value(bounds[2])
        elif op == "relax.add" and any(rw.static_value(a) is not None for a in value.args):
            value = rw.value(next(a for a in value.args if rw.static_value(a) is None))
        else:
            return False
    return False


def _targets(graph: Graph, layers: list[Layer]) -> dict[str, object]:
    """weight name -> the activation it reads, for the int8 depthwise layers this pass scales."""
    wanted = {l.weight: l for l in layers if l.precision == "int8"}
    found: dict[str, object] = {}
    uses: dict = {}

    def visit(rw: Rewriter, var, value):
        weight_var, _ = rw.weight_operand(value)
        if weight_var is not None and weight_var.name in wanted and weight_var.name not in found:
            if _depthwise(graph, value, wanted[weight_var.name]) and not _kept_integer(graph, rw, value.args[0]):
                found[weight_var.name] = value.args[0]
                uses[value.args[0]] = rw.uses(value.args[0])
        return None

    rewrite(graph, visit)
    # only a tensor that these layers alone read: another reader would need it unscaled, and the tensor would
    # be written twice (the int8 passes quantize a layer's output once, for all its readers)
    readers: dict = {}
    for name, source in found.items():
        readers.setdefault(source, []).append(name)
    return {name: source for source, names in readers.items() if len(names) == uses[source] for name in names}


def factors(graph: Graph, layers: list[Layer], samples: Callable[[], Iterable[list[np.ndarray]]]) -> dict[str, np.ndarray]:
    """weight name -> s = max |x_j| over the samples, per input channel (float32; 1 for a channel always 0)."""
    targets = _targets(graph, layers)
    if not targets:
        return {}
    order = list(targets)
    tapped = rewrite(graph, lambda rw, var, value: None,
                     extra_outputs=lambda rw: [rw.new(targets[w]) for w in order])
    runner = HostRunner(tapped)
    n_out = graph.num_outputs
    absmax: dict[str, np.ndarray] = {}
    for sample in samples():
        for w, t in zip(order, runner(sample)[n_out:]):
            m = np.abs(np.asarray(t)).max(axis=(0, 2, 3)).astype(np.float32)
            absmax[w] = np.maximum(absmax[w], m) if w in absmax else m
    return {w: np.clip(np.where(a > 0, a, 1.0), 1 / MAX_FACTOR, MAX_FACTOR).astype(np.float32) for w, a in absmax.items()}


def smooth(graph: Graph, layers: list[Layer], s: dict[str, np.ndarray]) -> Graph:
    """``graph`` with each scaled layer's input divided by its ``s`` and its weight multiplied by it; the weights
    keep their names (the layers are found by them)."""
    by_weight = {l.weight: l for l in layers if l.weight in s}
    divided: dict[tuple, object] = {}

    def visit(rw: Rewriter, var, value):
        weight_var, _ = rw.weight_operand(value)
        if weight_var is None or weight_var.name not in by_weight:
            return None
        factor = s[weight_var.name]
        key = (value.args[0], factor.tobytes())
        if key not in divided:
            divided[key] = rw.emit(relax.op.multiply(rw.new(value.args[0]), rw.const((1.0 / factor).reshape(1, -1, 1, 1))))
        return relax.Call(value.op, [divided[key], rw.new(value.args[1])], value.attrs, value.ty_args)

    out = rewrite(graph, visit)
    weights = dict(out.weights)
    for name in by_weight:
        w = graph.weights[name]  # depthwise: input channel j is output channel j
        weights[name] = (w * s[name].reshape(-1, 1, 1, 1)).astype(w.dtype)
    return Graph(out.mod, weights)
