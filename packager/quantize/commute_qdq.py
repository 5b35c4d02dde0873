"""Pass: keep quantized tensors quantized through ops that only move or select values.

    quantize(op(dequantize(x_q, s, z)), s, z)  ->  op(x_q)     for op in reshape, permute_dims, max_pool2d
    quantize(dequantize(x_q, s, z), s, z)      ->  x_q

Valid because dequantize is monotonic and elementwise: moving, selecting or taking the maximum of values
commutes with it when the scale and zero point on both sides are the same (as QDQ exporters write them
around these ops).
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, relax, rewrite
from edgeq.quantize.notes import PassNotes

MOVERS = ("relax.reshape", "relax.permute_dims", "relax.nn.max_pool2d")


def _same(rw: Rewriter, a, b) -> bool:
    va, vb = rw.array(a), rw.array(b)
    return va is not None and vb is not None and va.shape == vb.shape and np.array_equal(va, vb)


def commute_qdq(graph: Graph, notes: PassNotes | None = None) -> Graph:
    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.quantize":
            return None
        inner = rw.value(value.args[0])
        mover = None
        if call_op(inner) in MOVERS:
            mover, inner = inner, rw.value(inner.args[0])
        if call_op(inner) != "relax.dequantize":
            return None
        x_q = inner.args[0]
        if x_q.ty.dtype != value.attrs.out_dtype or not (
            _same(rw, inner.args[1], value.args[1]) and _same(rw, inner.args[2], value.args[2])
        ):
            return None
        if mover is None:
            return rw.new(x_q)
        return relax.Call(mover.op, [rw.new(x_q), *[rw.new(a) for a in mover.args[1:]]], mover.attrs, mover.ty_args)

    return rewrite(graph, visit)
