"""Pass: add the bias in int32, before the dequantize.

    add(dequantize(acc, s), reshape(b))  ->  dequantize(add(acc, reshape(round(b / s))), s)
    add(dequantize(acc, s), b)           ->  dequantize(add(acc, round(b / s)), s)

``b`` may also be a dequantize of an int32 weight (how QDQ models store biases, with scale s): then
round(b / s) gives back the stored integers.

where ``acc`` is an int32 accumulator, ``s`` its per-channel scale and ``b`` a bias weight with one value per
channel. The int32 bias is a new weight parameter.

A bias that does not fit is left as the float add after the dequantize (the convolution or matmul stays
integer): with vanishing activations (random weights, a dead branch) the scale ``s`` can be 1e-17, and
round(b / s) would wrap around int32 and flip the sign of the layer's output. Its name goes to ``notes.float_biases``.
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, const_value, relax, rewrite
from edgeq.quantize.notes import PassNotes


def _bias(rw: Rewriter, expr):
    """(name, bias array, reshape target or None) when ``expr`` is a bias weight (float, or a dequantize of
    an int32 weight as in pre-quantized models), possibly reshaped."""
    inner = rw.value(expr)
    if call_op(inner) == "relax.reshape" and rw.static_value(inner.args[0]) is not None:
        return _name(rw, inner.args[0]), rw.static_value(inner.args[0]), inner.args[1]
    array = rw.static_value(expr)
    if array is not None:
        return _name(rw, expr), array, None
    return None, None, None


def _name(rw: Rewriter, expr) -> str:
    if rw.weight(expr) is not None:
        return expr.name
    inner = rw.value(expr)
    return inner.args[0].name if inner is not None and isinstance(inner.args[0], relax.Var) else "bias"


# |round(b / s)| must leave the accumulated products room in int32 (a 3x3x512 conv sums up to 2^23 of them)
INT32_BIAS_LIMIT = 1 << 30


def fold_bias(graph: Graph, notes: PassNotes | None = None) -> Graph:
    """Integer bias adds: ``dequantize(acc) + b`` becomes ``dequantize(acc + round(b / scale))``. A bias that
    does not fit int32 at its scale stays a float add after the dequantize; ``notes.float_biases`` names it.
    Repeated until nothing more folds: a layer with a bias correction (``quantize_ops``) adds it and then its
    own bias, and the second add reads a dequantize only once the first is folded."""
    too_large: list[str] = []
    while True:
        folded = [0]
        graph = rewrite(graph, _visitor(folded, too_large))
        if not folded[0]:
            break
    if notes is not None:
        notes.float_biases.extend(dict.fromkeys(too_large))
    return graph


def _visitor(folded: list[int], too_large: list[str]):

    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.add":
            return None
        for deq_var, other in ((value.args[0], value.args[1]), (value.args[1], value.args[0])):
            deq = rw.value(deq_var)
            if call_op(deq) != "relax.dequantize" or deq.args[0].ty.dtype != "int32" or rw.uses(deq_var) != 1:
                continue
            bias_name, bias, shape = _bias(rw, other)
            scale, s = deq.args[1], const_value(deq.args[1])
            if bias is None or s is None:
                continue
            if bias.ndim != 1 or bias.shape[0] != s.size:
                continue
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                rounded = np.round(bias.astype(np.float64) / s.astype(np.float64))
            if not np.isfinite(rounded).all() or np.abs(rounded).max(initial=0) > INT32_BIAS_LIMIT:
                too_large.append(bias_name)
                continue
            bias_q = rw.param(f"{bias_name.removesuffix('_quantized')}_int32", rounded.astype(np.int32))
            if shape is not None:
                bias_q = rw.emit(relax.op.reshape(bias_q, shape))
            acc = rw.emit(relax.op.add(rw.new(deq.args[0]), bias_q))
            folded[0] += 1
            return relax.op.dequantize(acc, scale, deq.args[2], axis=int(deq.attrs.axis), out_dtype="float32")
        return None

    return visit
