"""Pass: lower the QuantizeLinear/DequantizeLinear (QDQ) pattern of pre-quantized ONNX models to integer
compute.

    conv2d(dequantize(x_q, s_x, z_x), dequantize(W_q, s_w, 0))
        ->  dequantize(conv2d(pad(x_q, z_x), W_q, out_dtype=int32) - z_x * sum(W_q[c]), s_x * s_w[c])
    matmul(dequantize(x_q, s_x, z_x), dequantize(W_q, s_w, 0))   (also through Gemm's permute_dims)
        ->  dequantize(matmul(x_q, W_q, out_dtype=int32) - z_x * sum_k(W_q[:, n]), s_x * s_w[n])

x_q is uint8 or int8 with any per-tensor zero point z_x: padding with z_x (the quantized zero) and
subtracting z_x * sum(W) per output channel gives exactly the product of (x_q - z_x) and W_q, in u8 x s8
or s8 x s8 with int32 accumulation. Weights must be symmetric (zero point 0, per tensor or per channel)
as ONNX Runtime and TensorRT write them; anything else stays in float and is reported. ``fold_bias`` then
adds the int32 bias, ``requantize`` joins consecutive layers, and ``commute_qdq`` moves reshapes and
max-pooling onto the quantized tensors.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, relax, rewrite
from edgeq.quantize.quantize_ops import conv_attrs


@dataclasses.dataclass
class QdqLayer:
    weight: str  # name of the int8 weight parameter (the ONNX initializer)
    kind: str  # conv2d | matmul
    activation_dtype: str = ""
    activation_zero_point: int = 0
    integer: bool = False
    reason: str = ""


def is_qdq(graph: Graph) -> bool:
    """Whether the graph is a pre-quantized (QDQ) model: some conv2d/matmul takes a dequantized weight."""
    values = {b.var: b.value for b in graph.bindings()}
    for b in graph.bindings():
        if call_op(b.value) in ("relax.nn.conv2d", "relax.matmul"):
            rhs = values.get(b.value.args[1])
            if call_op(rhs) == "relax.permute_dims":
                rhs = values.get(rhs.args[0])
            if call_op(rhs) == "relax.dequantize":
                return True
    return False


def _dequantized_weight(rw: Rewriter, expr):
    """(int8 weight parameter, scale, zero point, transposed?) behind a (permuted) dequantize of a weight."""
    transposed = False
    inner = rw.value(expr)
    if call_op(inner) == "relax.permute_dims":
        transposed, inner = True, rw.value(inner.args[0])
    if call_op(inner) != "relax.dequantize" or rw.weight(inner.args[0]) is None:
        return None
    scale, zero_point = rw.array(inner.args[1]), rw.array(inner.args[2])
    if scale is None or zero_point is None:
        return None
    return inner.args[0], scale.astype(np.float32), zero_point, transposed


def lower_qdq(graph: Graph) -> tuple[Graph, list[QdqLayer]]:
    layers: list[QdqLayer] = []

    def visit(rw: Rewriter, var, value):
        op = call_op(value)
        if op not in ("relax.nn.conv2d", "relax.matmul"):
            return None
        weight = _dequantized_weight(rw, value.args[1])
        if weight is None:
            return None
        w_var, s_w, z_w, transposed = weight
        layer = QdqLayer(weight=w_var.name, kind="conv2d" if op == "relax.nn.conv2d" else "matmul")
        layers.append(layer)
        x_deq = rw.value(value.args[0])
        if call_op(x_deq) != "relax.dequantize":
            layer.reason = "activation is not quantized (no DequantizeLinear on the input)"
            return None
        x_q = x_deq.args[0]
        s_x, z_x = rw.array(x_deq.args[1]), rw.array(x_deq.args[2])
        w = rw.weight(w_var)
        if s_x is None or z_x is None or s_x.size != 1 or z_x.size != 1:
            layer.reason = "activation scale is not one constant per tensor"
            return None
        if z_w.any():
            layer.reason = "weight zero point is not 0 (asymmetric weights)"
            return None
        if w.dtype != np.int8 or str(x_q.ty.dtype) not in ("int8", "uint8"):
            layer.reason = f"unsupported types {x_q.ty.dtype} x {w.dtype}"
            return None
        s_x, z_x = float(s_x.reshape(())), int(z_x.reshape(()))
        layer.activation_dtype, layer.activation_zero_point = str(x_q.ty.dtype), z_x
        xq = rw.new(x_q)
        if op == "relax.nn.conv2d":
            attrs = conv_attrs(value)
            if z_x and any(attrs["padding"]):
                top, left, bottom, right = attrs["padding"]
                xq = rw.emit(relax.op.nn.pad(xq, [0, 0, 0, 0, top, bottom, left, right], pad_value=float(z_x)))
                attrs["padding"] = [0, 0, 0, 0]
            acc = rw.emit(relax.op.nn.conv2d(xq, rw.new(w_var), out_dtype="int32", **attrs))
            channels, axis = w.shape[0], 1
            w_sum = w.astype(np.int64).reshape(channels, -1).sum(axis=1)
            correction_shape = (1, channels, 1, 1)
        else:
            w_kn = w.T if transposed else w
            w_param = rw.param(f"{w_var.name}_t", np.ascontiguousarray(w_kn)) if transposed else rw.new(w_var)
            acc = rw.emit(relax.op.matmul(xq, w_param, out_dtype="int32"))
            channels, axis = w_kn.shape[1], -1
            w_sum = w_kn.astype(np.int64).sum(axis=0)
            correction_shape = (channels,)
        if z_x:
            correction = (-z_x * w_sum).astype(np.int32).reshape(correction_shape)
            acc = rw.emit(relax.op.add(acc, rw.const(correction, "int32")))
        scale = (np.float32(s_x) * np.broadcast_to(s_w, (channels,))).astype(np.float32)
        layer.integer = True
        return relax.op.dequantize(acc, rw.const(scale), rw.const(0, "int8"), axis=axis, out_dtype="float32")

    return rewrite(graph, visit), layers
