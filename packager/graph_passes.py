"""Graph passes both compile paths use, on the imported float graph.

- ``fold_batch_norm``: inference BatchNorm folded into the convolution before it (its weights scaled, its
  bias shifted); a BatchNorm with no convolution before it becomes a per-channel multiply and add (which
  follows NHWC on CPUs and fuses into the kernel before it everywhere). No batch-norm kernel is left.
- ``precompute_weight_ops``: reshapes, transposes and casts of weights (ONNX Conv's bias reshaped to
  [1, C, 1, 1], Gemm's transposed weight) done once, on the weights: they are kernels per inference
  otherwise (TVM cannot fold them, weights are parameters, not constants).

Helpers for passes that make weights: ``static_weight`` (a value known before run time), ``fresh_name``
(a weight name not taken yet), ``shape_of`` / ``dtype_of`` (of a Relax expression).
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import LAYOUT_OPS, Graph, Rewriter, apply_layout_op, call_op, const_value, rewrite
from edgeq.tvm_env import relax, tvm


def static_weight(rw: Rewriter, expr, dequantize: bool = True) -> np.ndarray | None:
    """The value of ``expr`` when it is known before run time: with ``dequantize``, ``Rewriter.static_value``;
    without, only a weight, a constant, or a reshape / transpose / cast / squeeze / expand_dims of one."""
    if dequantize:
        return rw.static_value(expr)
    value = rw.array(expr)
    if value is not None:
        return value
    inner = rw.value(expr) if isinstance(expr, relax.Var) else expr
    return apply_layout_op(inner, lambda e: static_weight(rw, e, False)) if isinstance(inner, relax.Call) else None


def fresh_name(rw: Rewriter, name: str) -> str:
    """A weight parameter name not taken yet, in the output graph nor in the input graph (``Rewriter.param``
    would give a taken name's parameter back for an equal array)."""
    taken = set(rw.weights) | set(rw.graph.weights)
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    return candidate




def weight_name(expr, default: str) -> str:
    return expr.name if isinstance(expr, relax.Var) else default


def fold_batch_norm(graph: Graph) -> Graph:
    """Inference BatchNorm (``relax.nn.batch_norm``, training off, statistics known) folded away: into the
    weights and bias of a convolution (NCHW/OIHW, weights known, its output used only by the BatchNorm) or
    a ``conv + bias`` before it, otherwise into a per-channel multiply and add."""

    def visit(rw: Rewriter, var, value):
        if not isinstance(value, relax.TupleGetItem) or value.index != 0:
            return None
        bn = rw.value(value.tuple_value)
        if call_op(bn) != "relax.nn.batch_norm" or bool(bn.attrs.training):
            return None
        x, gamma, beta, mean, variance = bn.args
        stats = [static_weight(rw, a) for a in (gamma, beta, mean, variance)]
        shape = shape_of(x)
        if any(s is None for s in stats) or shape is None or dtype_of(x) != "float32":
            return None
        axis = int(bn.attrs.axis) % len(shape)
        gamma_v, beta_v, mean_v, var_v = (s.astype(np.float64).reshape(-1) for s in stats)
        eps = float(bn.attrs.epsilon)
        scale = gamma_v / np.sqrt(var_v + eps) if bool(bn.attrs.scale) else 1.0 / np.sqrt(var_v + eps)
        shift = (beta_v if bool(bn.attrs.center) else 0.0) - mean_v * scale
        base = weight_name(value.tuple_value, "bn")
        folded = _fold_into_conv(rw, x, scale, shift, axis, base)
        if folded is not None:
            return folded
        bshape = [1] * len(shape)
        bshape[axis] = -1
        scale_param = rw.param(fresh_name(rw, f"{base}_scale"), scale.astype(np.float32).reshape(bshape))
        shift_param = rw.param(fresh_name(rw, f"{base}_shift"), shift.astype(np.float32).reshape(bshape))
        return relax.op.add(rw.emit(relax.op.multiply(rw.new(x), scale_param)), shift_param)

    return rewrite(graph, visit)


def _fold_into_conv(rw: Rewriter, x, scale, shift, axis: int, base: str):
    """conv2d(data, W * scale) + (bias * scale + shift), or None when ``x`` is not such a convolution."""
    if axis != 1 or not isinstance(x, relax.Var) or rw.uses(x) != 1:
        return None
    inner = rw.value(x)
    bias = None
    if call_op(inner) == "relax.add":
        a, b = inner.args
        for conv_var, bias_expr in ((a, b), (b, a)):
            if call_op(rw.value(conv_var)) == "relax.nn.conv2d" and static_weight(rw, bias_expr) is not None:
                bias = static_weight(rw, bias_expr)
                per_channel = bias.ndim >= 3 and bias.shape[-3] == scale.size and bias.size == scale.size
                if rw.uses(conv_var) != 1 or not (bias.size == 1 or per_channel):
                    return None
                inner = rw.value(conv_var)
                break
        else:
            return None
    if call_op(inner) != "relax.nn.conv2d":
        return None
    a = inner.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return None
    if str(a.out_dtype) not in ("", "None", "void", "float32"):  # None: the input's dtype
        return None
    data, w = inner.args
    wv = static_weight(rw, w)
    if wv is None or wv.dtype != np.float32 or wv.shape[0] != scale.size:
        return None
    weight = (wv.astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(np.float32)
    b = np.zeros(scale.size) if bias is None else np.broadcast_to(bias.reshape(-1).astype(np.float64), scale.shape)
    new_bias = (b * scale + shift).astype(np.float32).reshape(1, -1, 1, 1)
    folded = rw.param(fresh_name(rw, f"{weight_name(w, base)}_{base}_folded"), weight)
    conv = relax.op.nn.conv2d(rw.new(data), folded, a.strides, a.padding, a.dilation, int(a.groups), "NCHW", "OIHW", "NCHW")
    return relax.op.add(rw.emit(conv), rw.param(fresh_name(rw, f"{base}_folded_bias"), new_bias))


def precompute_weight_ops(graph: Graph) -> Graph:
    """Reshapes, transposes, casts, squeezes and expand_dims of weights computed now: their results become
    weight parameters, so no kernel computes them on every inference. (Of constants alone TVM's FoldConstant
    takes care; dequantized weights stay as they are: precomputed they would be float, four times larger.)"""

    def visit(rw: Rewriter, var, value):
        if call_op(value) not in LAYOUT_OPS or const_value(value.args[0]) is not None:
            return None
        result = static_weight(rw, value, dequantize=False)
        if result is None:
            return None
        return rw.param(fresh_name(rw, f"{weight_name(value.args[0], 'w')}_{var.name}"), result)

    return rewrite(graph, visit)


def shape_of(expr) -> list[int] | None:
    ty = getattr(expr, "struct_info", None) or getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    values = list(shape.values)
    return [int(v) for v in values] if all(isinstance(v, tvm.tirx.IntImm) for v in values) else None


def dtype_of(expr) -> str | None:
    ty = getattr(expr, "struct_info", None) or getattr(expr, "ty", None)
    return str(ty.dtype) if ty is not None and hasattr(ty, "dtype") else None
