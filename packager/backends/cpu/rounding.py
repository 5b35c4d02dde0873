"""Requantizing to int8 in three instructions per vector instead of six.

Every int8 layer ends in ``cast(int8, clip(round(x * scale), lo, hi))``. As TVM lowers it, that is per
vector of 16: ``vrndscaleps`` (round), ``vminps`` and ``vmaxps`` (clip), ``vcvttps2dq`` (to int32) and a
truncating ``vpmovdb``. ``llvm.lrint`` rounds to the nearest integer (ties to even, the current rounding
mode: what ``round`` computes) while it converts, one ``vcvtps2dq``; an int32 clamp to the int8 range
followed by the narrowing is one saturating ``vpmovsdb`` (``vpmovusdb`` for uint8; Arm: ``sqxtn``); a ReLU's
lower bound is then one byte-wise ``vpmaxsb`` on a quarter of the register. On MobileNetV2's int8 1x1
16 -> 96 convolution (112x112), whose epilogue is most of the work, 0.099 -> 0.080 ms.

The one difference: converting a float beyond the int32 range gives INT_MIN, which would saturate to -128
where the clip gave 127. So the rounded value is first bounded above by 2^30 (``vminps``; any value over 127
saturates the same; below too where a zero point is added after the conversion, which INT_MIN would
overflow), unless it is ``float(i) * m`` of an int32 ``i`` (|float(i)| <= 2^31) by a multiplier
known at build time to be below ``SAFE_MULTIPLIER`` in magnitude: a constant, or a parameter every call of
the function passes the same constant for (``constant_magnitudes``). Requantizing epilogues are such
products (the multiplier: input scale x weight scale / output scale, per channel).
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import INT_RANGES as RANGES
from edgeq.tvm_env import relax, tirx, tvm


# |m| below which float(i32) * m stays under 2^31 - 256 (so that adding a zero point cannot overflow either)
SAFE_MULTIPLIER = 0.99
BOUND = float(1 << 30)  # rounding's argument is bounded above by this where it is not such a product
ROUNDS = ("tirx.round", "tirx.nearbyint")


def _const(expr) -> float | None:
    return float(expr.value) if isinstance(expr, (tirx.FloatImm, tirx.IntImm)) else None


def _clip(expr):
    """(x, lo, hi) for ``max(min(x, hi), lo)`` or ``min(max(x, lo), hi)`` with constant bounds, else None."""
    outer = expr
    if isinstance(outer, tirx.Max) and isinstance(outer.a, tirx.Min):
        inner, lo, hi = outer.a, _const(outer.b), _const(outer.a.b)
    elif isinstance(outer, tirx.Min) and isinstance(outer.a, tirx.Max):
        inner, hi, lo = outer.a, _const(outer.b), _const(outer.a.b)
    else:
        return None
    if lo is None or hi is None:
        return None
    return inner.a, lo, hi


def _safe_product(e, magnitude) -> bool:
    """``float(i) * m`` (either order) with ``i`` of type int32 and |m| known to be below SAFE_MULTIPLIER."""
    if not isinstance(e, tirx.Mul):
        return False
    for side, other in ((e.a, e.b), (e.b, e.a)):
        if isinstance(side, tirx.Cast) and str(side.value.ty) == "int32":
            m = abs(_const(other)) if _const(other) is not None else magnitude(other)
            if m is not None and m < SAFE_MULTIPLIER:
                return True
    return False


def _is_bounded(e) -> bool:
    return isinstance(e, tirx.Min) and _const(e.b) is not None and _const(e.b) <= BOUND


def _requantize(cast, magnitude):
    """The lrint form of ``cast(int8|uint8, [cast(int32,)] clip(round(e) [+ zp], lo, hi))``, or None; ``zp``:
    an integer constant of at most 255 in magnitude or an int8/uint8 value (a zero-point tensor)."""
    dtype = str(cast.ty)
    if dtype not in RANGES:
        return None
    x = cast.value
    if isinstance(x, tirx.Cast) and str(x.ty) == "int32":
        x = x.value
    found = _clip(x)
    if found is None:
        return None
    x, lo, hi = found
    dmin, dmax = RANGES[dtype]
    if not (dmin <= lo <= hi <= dmax and lo == int(lo) and hi == int(hi)):
        return None
    zp = None  # the zero point added after rounding: an integer constant or an 8-bit integer value
    if isinstance(x, tirx.Add):
        if _const(x.b) is not None and _const(x.b) == int(_const(x.b)) and abs(_const(x.b)) <= 255:
            zp = tirx.IntImm("int32", int(_const(x.b)))
        elif isinstance(x.b, tirx.Cast) and str(x.b.value.ty) in RANGES:
            zp = tirx.Cast("int32", x.b.value)
        else:
            return None
        x = x.a
    if not (isinstance(x, tvm.ir.expr.Call) and x.op.name in ROUNDS) or str(x.ty) != "float32":
        return None
    e = x.args[0]
    if not (_safe_product(e, magnitude) or (_is_bounded(e) and zp is None)):
        e = tirx.Min(e, tirx.FloatImm("float32", BOUND))
        if zp is not None:  # INT_MIN plus a negative zero point would wrap around to the top
            e = tirx.Max(e, tirx.FloatImm("float32", -BOUND))
    r = tirx.call_llvm_pure_intrin("int32", "llvm.lrint", e)
    if zp is not None:
        r = tirx.Add(r, zp)
    out = tirx.Cast(dtype, tirx.Max(tirx.Min(r, tirx.IntImm("int32", dmax)), tirx.IntImm("int32", dmin)))
    if lo > dmin:
        out = tirx.Max(out, tirx.IntImm(dtype, int(lo)))
    if hi < dmax:
        out = tirx.Min(out, tirx.IntImm(dtype, int(hi)))
    return out


def fast_requantize(func, magnitudes: dict[int, float] | None = None):
    """``func`` (a TIR function for an LLVM CPU) with every requantizing round-clip-cast in lrint form;
    ``magnitudes``: the largest magnitude of the constant each parameter (by index) always receives."""
    import tvm_ffi

    known = {func.params[i]: m for i, m in (magnitudes or {}).items() if i < len(func.params)}

    def magnitude(expr) -> float | None:
        if isinstance(expr, tvm.ir.expr.TensorLoad):
            for buffer, m in known.items():
                if expr.source.same_as(buffer):
                    return m
        return None

    def visit(cast):
        fast = _requantize(cast, magnitude)
        return cast if fast is None else fast

    return tvm_ffi.structural_map(func, [(tirx.Cast, visit)])


def constant_magnitudes(mod) -> dict:
    """{TIR function's name: {parameter index: max |value|}} for the parameters that every
    ``call_tir`` of the function in ``mod``'s Relax functions passes a constant for."""
    found: dict = {}

    def visit(expr):
        if not (isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.call_tir"):
            return
        gv, args = expr.args[0], expr.args[1]
        fields = list(args.fields) if isinstance(args, relax.Tuple) else [args]
        sizes = {}
        for i, a in enumerate(fields):
            if isinstance(a, tvm.ir.expr.Constant):
                value = a.value.numpy()
                if value.size and np.issubdtype(value.dtype, np.floating) and np.isfinite(value).all():
                    sizes[i] = float(np.abs(value).max())
        key = gv.name_hint
        if key in found:
            found[key] = {i: max(m, sizes[i]) for i, m in found[key].items() if i in sizes}
        else:
            found[key] = sizes

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found
