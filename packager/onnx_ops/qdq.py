"""QOperator ops (QLinearConv, QLinearMatMul, QGemm, ConvInteger): integer arithmetic, then requantized."""

from __future__ import annotations

import math

import numpy as np

from edgeq.tvm_env import relax

from edgeq.onnx_ops.context import TVM_CONVERT_MAP, dtype_of, relax_const, shape_of


# ----------------------------------------------------------------------------------------------- QOperator


def _int32(ctx, x, zero_point, axis: int | None = None):
    """``x - zero_point`` in int32; a per-channel zero point is broadcast along ``axis``."""
    x = ctx.bb.emit(relax.op.astype(x, "int32"))
    if zero_point is None:
        return x
    zp = relax.op.astype(zero_point, "int32")
    size = math.prod(shape_of(zero_point))
    if size > 1 and axis is not None:
        shape = [1] * len(shape_of(x))
        shape[axis] = size
        zp = relax.op.reshape(zp, shape)
    elif len(shape_of(zero_point)):
        zp = relax.op.reshape(zp, [])
    return ctx.bb.emit(relax.op.subtract(x, zp))


def _conv_int32(ctx, x, w, attr):
    """TVM's Conv converter (auto_pad, 1-D to 3-D) on int32 operands: exact int32 accumulation."""
    conv = TVM_CONVERT_MAP()["Conv"].get_converter(ctx.opset)
    return ctx.bb.normalize(conv(ctx.bb, [x, w, None], attr, ctx.params))


def _requantize(ctx, acc, scale, zero_point, out_dtype: str, axis: int | None):
    """``acc * scale`` rounded half to even, plus the zero point, saturated to ``out_dtype``."""
    scale = ctx.bb.emit(relax.op.astype(scale, "float32"))
    if math.prod(shape_of(scale)) > 1 and axis is not None:
        shape = [1] * len(shape_of(acc))
        shape[axis] = -1
        scale = relax.op.reshape(scale, shape)
    elif shape_of(scale):
        scale = relax.op.reshape(scale, [])
    y = relax.op.round(relax.op.multiply(relax.op.astype(acc, "float32"), scale))
    if zero_point is not None:
        y = relax.op.add(y, relax.op.reshape(relax.op.astype(zero_point, "float32"), []))
    info = np.iinfo(out_dtype)
    return relax.op.astype(relax.op.clip(y, int(info.min), int(info.max)), out_dtype)


def conv_integer(ctx, inputs, attr):
    args = list(inputs) + [None] * 2
    x = _int32(ctx, args[0], args[2])
    w = _int32(ctx, args[1], args[3], axis=0)
    return _conv_int32(ctx, x, w, attr)


def qlinear_conv(ctx, inputs, attr):
    """QLinearConv as ONNX Runtime computes it: int32 accumulation of the zero-point-shifted operands,
    plus the int32 bias, times x_scale * w_scale / y_scale, rounded, shifted, saturated."""
    args = list(inputs) + [None]
    x, xs, xzp, w, ws, wzp, ys, yzp, bias = args[:9]
    acc = _conv_int32(ctx, _int32(ctx, x, xzp), _int32(ctx, w, wzp, axis=0), attr)
    rank = len(shape_of(acc))
    if bias is not None:
        channels = shape_of(bias)[0]
        acc = relax.op.add(acc, relax.op.reshape(relax.op.astype(bias, "int32"), [1, channels] + [1] * (rank - 2)))
    scale = relax.op.divide(relax.op.multiply(relax.op.astype(xs, "float32"), relax.op.astype(ws, "float32")),
                            relax.op.astype(ys, "float32"))
    return _requantize(ctx, ctx.bb.emit(acc), ctx.bb.emit(scale), yzp, dtype_of(x if yzp is None else yzp), axis=1)


def qlinear_matmul(ctx, inputs, attr):
    a, a_s, azp, b, b_s, bzp, ys, yzp = inputs[:8]
    a_rank, b_rank = len(shape_of(a)), len(shape_of(b))
    acc = relax.op.matmul(_int32(ctx, a, azp, axis=a_rank - 2), _int32(ctx, b, bzp, axis=b_rank - 1), out_dtype="int32")
    acc = ctx.bb.emit(acc)
    scale = relax.op.divide(relax.op.multiply(relax.op.astype(a_s, "float32"), relax.op.astype(b_s, "float32")),
                            relax.op.astype(ys, "float32"))
    return _requantize(ctx, acc, ctx.bb.emit(scale), yzp, dtype_of(yzp), axis=len(shape_of(acc)) - 1)


def qgemm(ctx, inputs, attr):
    """com.microsoft QGemm (what ONNX Runtime's QOperator quantizer makes of Gemm): the int32 product of the
    zero-point-shifted operands plus the int32 bias ``C`` (scale ``alpha * a_scale * b_scale``), times
    ``alpha * a_scale * b_scale``, requantized to ``y_scale``/``y_zero_point`` where given, else float."""
    args = list(inputs) + [None] * 9
    a, a_s, azp, b, b_s, bzp, c, ys, yzp = args[:9]
    alpha = float(attr.get("alpha", 1.0))
    trans_a, trans_b = int(attr.get("transA", 0)), int(attr.get("transB", 0))
    a32 = _int32(ctx, a, azp)
    b32 = _int32(ctx, b, bzp, axis=0 if trans_b else 1)  # a zero point per output column
    if trans_a:
        a32 = ctx.bb.emit(relax.op.permute_dims(a32, [1, 0]))
    if trans_b:
        b32 = ctx.bb.emit(relax.op.permute_dims(b32, [1, 0]))
    acc = relax.op.matmul(a32, b32, out_dtype="int32")
    if c is not None:
        acc = relax.op.add(acc, relax.op.astype(c, "int32"))
    acc = ctx.bb.emit(acc)
    # (alpha * a_scale) * b_scale, in ONNX Runtime's order (a float output differed in its last bit otherwise)
    scale = relax.op.multiply(relax.op.multiply(relax_const(alpha, "float32"), relax.op.astype(a_s, "float32")),
                              relax.op.astype(b_s, "float32"))
    if ys is None:
        columns = math.prod(shape_of(b_s))
        scale = relax.op.reshape(scale, [1, columns] if columns > 1 else [])
        return relax.op.multiply(relax.op.astype(acc, "float32"), scale)
    scale = ctx.bb.emit(relax.op.divide(scale, relax.op.astype(ys, "float32")))
    return _requantize(ctx, acc, scale, yzp, dtype_of(yzp) if yzp is not None else "uint8", axis=1)
