"""Pass: remove the dequantize -> quantize pair between consecutive int8 layers.

    quantize(dequantize(acc, s1), s2)        ->  requantize(acc, s1 / s2, -128, 127)
    quantize(relu(dequantize(acc, s1)), s2)  ->  requantize(acc, s1 / s2, 0, 127)

with ``requantize(acc, m, lo, hi) = int8(clip(round(float(acc) * m), lo, hi))``; for a uint8 (or any
zero point z) output, ``clip(round(float(acc) * m) + z, lo, hi)`` with the uint8 range.: the int32 accumulator of
one layer becomes the int8 input of the next without a float tensor in between (the multiply by the
per-channel ratio m runs in the fused epilogue of the producing layer).
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, relax, rewrite
from edgeq.quantize.notes import PassNotes


RANGES = {"int8": (-128, 127), "uint8": (0, 255)}


def requantize_expr(rw: Rewriter, acc, ratio, axis: int, ndim: int, zero_point: int, lo: int, hi: int, dtype: str):
    ratio = ratio.reshape([-1 if i == axis % ndim else 1 for i in range(ndim)]) if ratio.size > 1 else ratio
    scaled = relax.op.round(rw.emit(relax.op.multiply(relax.op.astype(acc, "float32"), rw.const(ratio))))
    if zero_point:
        scaled = relax.op.add(scaled, rw.const(float(zero_point)))
    # through int32: LLVM converts float vectors to 8-bit ones lane by lane (16 vpextrb per vector store on
    # AVX-512), but float -> int32 -> int8 is one vcvttps2dq and one vpmovdb (the value is in range: clipped)
    return relax.op.astype(relax.op.astype(relax.op.clip(scaled, lo, hi), "int32"), dtype)


def requantize(graph: Graph, notes: PassNotes | None = None) -> Graph:
    def visit(rw: Rewriter, var, value):
        dtype = value.attrs.out_dtype if call_op(value) == "relax.quantize" else None
        if dtype not in RANGES:
            return None
        source, relu = rw.value(value.args[0]), False
        if call_op(source) == "relax.nn.relu":
            source, relu = rw.value(source.args[0]), True
        if call_op(source) != "relax.dequantize" or source.args[0].ty.dtype != "int32":
            return None
        s1, z1 = rw.array(source.args[1]), rw.array(source.args[2])
        s2, z2 = rw.array(value.args[1]), rw.array(value.args[2])
        if s1 is None or s2 is None or z1 is None or z2 is None or z1.any() or s2.size != 1 or z2.size != 1:
            return None
        zero_point = int(z2.reshape(()))
        lo, hi = RANGES[dtype]
        ratio = (s1 / s2.reshape(())).astype(np.float32)
        acc = rw.new(source.args[0])
        return requantize_expr(rw, acc, ratio, int(source.attrs.axis), len(acc.ty.shape), zero_point,
                               max(lo, zero_point) if relu else lo, hi, dtype)

    return rewrite(graph, visit)
