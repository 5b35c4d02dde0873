"""Pass: remove the dequantize -> quantize pair between consecutive int8 layers.

    quantize(dequantize(acc, s1), s2)        ->  requantize(acc, s1 / s2, -128, 127)
    quantize(relu(dequantize(acc, s1)), s2)  ->  requantize(acc, s1 / s2, 0, 127)

with ``requantize(acc, m, lo, hi) = int8(clip(round(float(acc) * m), lo, hi))``: the int32 accumulator of
one layer becomes the int8 input of the next without a float tensor in between (the multiply by the
per-channel ratio m runs in the fused epilogue of the producing layer).
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, const_value, relax, rewrite


def requantize_expr(rw: Rewriter, acc, ratio, axis: int, ndim: int, lo: int, hi: int):
    ratio = ratio.reshape([-1 if i == axis % ndim else 1 for i in range(ndim)]) if ratio.size > 1 else ratio
    scaled = rw.emit(relax.op.multiply(relax.op.astype(acc, "float32"), rw.const(ratio)))
    return relax.op.astype(relax.op.clip(relax.op.round(scaled), lo, hi), "int8")


def requantize(graph: Graph) -> Graph:
    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.quantize" or value.attrs.out_dtype != "int8":
            return None
        source, lo = rw.value(value.args[0]), -128
        if call_op(source) == "relax.nn.relu":
            source, lo = rw.value(source.args[0]), 0
        if call_op(source) != "relax.dequantize" or source.args[0].ty.dtype != "int32":
            return None
        s1, s2, zp = (const_value(e) for e in (source.args[1], value.args[1], value.args[2]))
        if s1 is None or s2 is None or zp is None or zp.any():
            return None
        ratio = (s1 / s2).astype(np.float32)
        acc = rw.new(source.args[0])
        return requantize_expr(rw, acc, ratio, int(source.attrs.axis), len(acc.ty.shape), lo, 127)

    return rewrite(graph, visit)
