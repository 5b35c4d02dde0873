"""Pass: remove the dequantize -> quantize pair between consecutive int8 layers.

    quantize(dequantize(acc, s1), s2)        ->  requantize(acc, s1 / s2, -128, 127)
    quantize(relu(dequantize(acc, s1)), s2)  ->  requantize(acc, s1 / s2, 0, 127)
    quantize(clip(dequantize(acc, s1), a, b), s2)  ->  requantize(acc, s1 / s2, q(a), q(b))   (ReLU6: a, b = 0, 6)

with ``requantize(acc, m, lo, hi) = int8(clip(round(float(acc) * m), lo, hi))``; for a uint8 (or any
zero point z) output, ``clip(round(float(acc) * m) + z, lo, hi)`` with the uint8 range.: the int32 accumulator of
one layer becomes the int8 input of the next without a float tensor in between (the multiply by the
per-channel ratio m runs in the fused epilogue of the producing layer).

A clip between them (ReLU, ReLU6; ``relax.clip``, or the maximum/minimum with a constant that ONNX Clip
imports as) moves to the integer side exactly: ``q(x) = round(x / s2) + z`` does not decrease as ``x`` grows, so
``q(clip(x, a, b)) = clip(q(x), q(a), q(b))``. Without this the float clip kept a dequantize, a division per
value and a quantize in every MobileNet block's epilogue.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgeq.graph import INT_RANGES, Graph, Rewriter, call_op, relax, rewrite, scalar_minmax_call
from edgeq.quantize.notes import PassNotes


RANGES = INT_RANGES


def requantize_expr(rw: Rewriter, acc, ratio, axis: int, ndim: int, zero_point: int, lo: int, hi: int, dtype: str):
    ratio = ratio.reshape([-1 if i == axis % ndim else 1 for i in range(ndim)]) if ratio.size > 1 else ratio
    scaled = relax.op.round(rw.emit(relax.op.multiply(relax.op.astype(acc, "float32"), rw.const(ratio))))
    if zero_point:
        scaled = relax.op.add(scaled, rw.const(float(zero_point)))
    # through int32: LLVM converts float vectors to 8-bit ones lane by lane (16 vpextrb per vector store on
    # AVX-512), but float -> int32 -> int8 is one vcvttps2dq and one vpmovdb (the value is in range: clipped)
    return relax.op.astype(relax.op.astype(relax.op.clip(scaled, lo, hi), "int32"), dtype)


def _quantized(bound: float, scale: np.float32, zero_point: int) -> int:
    """A float clip bound as the quantize of its values computes it (float32 division, round half to even)."""
    return int(np.round(np.float32(bound) / scale)) + zero_point


def clip_bounds(graph: Graph, rw: Rewriter, value) -> tuple[float | None, float | None, Any] | None:
    """(lower, upper, the clipped operand) of a clip by constants (None: that side open); None for anything
    else."""
    op = call_op(value)
    if op == "relax.nn.relu":
        return 0.0, None, value.args[0]
    if op == "relax.clip":
        return float(value.args[1].value), float(value.args[2].value), value.args[0]
    if op in ("relax.maximum", "relax.minimum"):
        kind, (x, bound) = op.removeprefix("relax."), value.args
    else:
        found = scalar_minmax_call(graph.mod, value)
        if found is None:
            return None
        kind, x, bound = found
    v = rw.static_value(bound)
    if v is None or v.size != 1 or not np.isfinite(v).all():
        return None
    v = float(v.reshape(()))
    return (v, None, x) if kind == "maximum" else (None, v, x)


def requantize(graph: Graph, notes: PassNotes | None = None) -> Graph:
    def visit(rw: Rewriter, var, value):
        dtype = value.attrs.out_dtype if call_op(value) == "relax.quantize" else None
        if dtype not in RANGES:
            return None
        s2, z2 = rw.array(value.args[1]), rw.array(value.args[2])
        if s2 is None or z2 is None or s2.size != 1 or z2.size != 1 or not s2.reshape(()) > 0:
            return None
        s2, zero_point = np.float32(s2.reshape(())), int(z2.reshape(()))
        lo, hi = RANGES[dtype]
        source = rw.value(value.args[0])
        while source is not None and call_op(source) != "relax.dequantize":
            bounds = clip_bounds(graph, rw, source)
            if bounds is None:
                return None
            a, b, x = bounds  # float bounds, each through the same q as the values
            lo = max(lo, _quantized(a, s2, zero_point)) if a is not None else lo
            hi = min(hi, _quantized(b, s2, zero_point)) if b is not None else hi
            source = rw.value(x)
        if source is None or source.args[0].ty.dtype != "int32":
            return None
        s1, z1 = rw.array(source.args[1]), rw.array(source.args[2])
        if s1 is None or z1 is None or z1.any():
            return None
        ratio = (s1 / s2).astype(np.float32)
        acc = rw.new(source.args[0])
        return requantize_expr(rw, acc, ratio, int(source.attrs.axis), len(acc.ty.shape), zero_point,
                               lo, max(lo, hi), dtype)

    return rewrite(graph, visit)
