"""Pass: run the chosen layers in int8 (or fp16).

    conv2d(x, W)            ->  dequantize(conv2d(quantize(x, s_x), W_q, out_dtype=int32), s_x * s_w[c])
    matmul(x, W)            ->  dequantize(matmul(quantize(x, s_x), W_q, out_dtype=int32), s_x * s_w[n])
    matmul(x, permute(W))   ->  the same, with W_q stored already transposed

Activations: per-tensor symmetric int8 (zero point 0) with the calibrated scale s_x. A MatMul/Gemm reading a
sequence (rank 3 or more: tokens of a transformer, columns of a text line) scales each row on its own at run
time instead (per-token dynamic, as LLM.int8 and ZeroQuant do; but for attention's context, ``layers.find_layers``):
a few tokens carry activations a hundred times the rest, and one calibrated scale sized for them leaves the others a
handful of levels:

    matmul(x, W)            ->  dequantize(matmul(q, W_q, out_dtype=int32), s_w[n]) * s_t,
                                s_t = max|x[t, :]| / 127,  q = round(x / s_t)  (int8, per row t)

Weights: per-output-channel symmetric int8, s_w[c] = max|W[c]| / 127. The products accumulate in int32; the float dequantize
at the end is the epilogue that ``fold_bias`` and ``requantize`` then improve. A layer with a calibrated input
scale adds its ``bias_correction`` (the mean shift its rounding adds, per output channel) after the dequantize,
as a bias: ``fold_bias`` folds it into the int32 accumulator. An fp16 layer casts its input to fp16 and computes
with fp16 weights, accumulating in float32, which it returns (``out_dtype`` float32: no rounding to fp16 between
the product and the float32 operators after it, as a tensor-core kernel's float32 epilogue computes it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, relax, rewrite

QMAX = 127


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    precision: str  # "int8" | "fp16" | "fp32"
    act_scale: float = 0.0  # s_x, for int8 per-tensor
    per_token: bool = False  # int8 matmul: each row of x scaled on its own at run time (s_t), not by s_x
    correction: np.ndarray | None = None  # int8: added to the output per channel (bias_correction), float32


def layer_plans(layers, act_scales: dict[str, float], corrections: dict[str, np.ndarray] | None = None
                ) -> dict[str, LayerPlan]:
    """weight name -> LayerPlan for ``layers`` (``edgeq.quantize.layers.Layer``): each one's precision, calibrated
    input scale, per-token scheme and bias correction."""
    corrections = corrections or {}
    return {l.weight: LayerPlan(l.precision, act_scales.get(l.weight, 0.0), l.activation == "per-token",
                                corrections.get(l.weight)) for l in layers}


def quantize_weight(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8: returns (int8 weight, float32 scale per channel along ``axis``)."""
    reduce = tuple(i for i in range(weight.ndim) if i != axis)
    amax = np.max(np.abs(weight), axis=reduce)
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    shape = [1] * weight.ndim
    shape[axis] = -1
    q = np.clip(np.round(weight / scale.reshape(shape)), -QMAX, QMAX).astype(np.int8)
    return q, scale


def conv_attrs(call) -> dict:
    a = call.attrs
    return dict(strides=list(a.strides), padding=list(a.padding), dilation=list(a.dilation), groups=int(a.groups),
                data_layout=a.data_layout, kernel_layout=a.kernel_layout, out_layout=a.out_layout)


def _quantize_input(rw: Rewriter, x, scale: float):
    return rw.emit(relax.op.quantize(rw.new(x), rw.const(scale), rw.const(0, "int8"), axis=-1, out_dtype="int8"))


def _quantize_rows(rw: Rewriter, x):
    """(int8 x, s_t): each row (last axis) of ``x`` by its own scale max|row| / 127; an all-zero row by 1."""
    xn = rw.new(x)
    amax = rw.emit(relax.op.max(relax.op.abs(xn), axis=[-1], keepdims=True))
    scale = rw.emit(relax.op.where(relax.op.greater(amax, rw.const(0.0)), relax.op.divide(amax, rw.const(float(QMAX))),
                                   rw.const(1.0)))
    q = relax.op.clip(relax.op.round(relax.op.divide(xn, scale)), -QMAX, QMAX)
    return rw.emit(relax.op.astype(q, "int8")), scale


SWITCHES = "edgeq_switches"  # the bool parameter of a switchable graph: which layers run as planned


def quantize_ops(graph: Graph, plans: dict[str, LayerPlan], taps: list[str] | None = None,
                 switches: list[str] | None = None) -> Graph:
    """Rewrite every conv2d/matmul whose weight parameter has a plan (keyed by weight name).

    ``taps`` (weight names) adds the output of those layers, after the rewrite, as extra outputs: the
    per-layer comparison of a float and a quantized graph uses it. ``switches`` (weight names) makes those
    layers switchable: each computes both its planned and its float result and keeps one, by its entry in the
    bool weight parameter ``SWITCHES`` (True: as planned), so that one compiled graph measures any mix of
    them (the accuracy budget's search; ``HostRunner.set_param``)."""
    layer_vars = {}
    index = {name: i for i, name in enumerate(switches or [])}
    row_quantized: dict = {}  # an input's (int8 rows, row scales), once for all the layers reading it (q, k, v)

    def visit(rw: Rewriter, var, value):
        new = planned(rw, var, value)
        weight_var, _ = rw.weight_operand(value)
        if new is None or weight_var is None or weight_var.name not in index:
            return new
        flags = rw.param(SWITCHES, np.ones(len(index), bool))
        i = index[weight_var.name]
        on = rw.emit(relax.op.strided_slice(flags, axes=[0], begin=[i], end=[i + 1]))  # [1]: broadcasts
        return relax.op.where(on, rw.emit(new), rw.emit(rw.new(value)))

    def planned(rw: Rewriter, var, value):
        op = call_op(value)
        if op not in ("relax.nn.conv2d", "relax.matmul"):
            return None
        weight_var, transposed = rw.weight_operand(value)
        if weight_var is not None:
            layer_vars[weight_var.name] = var
        plan = plans.get(weight_var.name) if weight_var is not None else None
        if plan is None or plan.precision == "fp32":
            return None
        w = rw.weight(weight_var)
        if plan.precision == "fp16":  # fp16 operands, float32 accumulation and output (what follows stays float32)
            x16 = rw.emit(relax.op.astype(rw.new(value.args[0]), "float16"))
            w16 = rw.param(f"{weight_var.name}_fp16", (w.T if transposed else w).astype(np.float16))
            if op == "relax.nn.conv2d":
                return relax.op.nn.conv2d(x16, w16, out_dtype="float32", **conv_attrs(value))
            return relax.op.matmul(x16, w16, out_dtype="float32")
        if plan.per_token and op == "relax.matmul":
            if value.args[0] not in row_quantized:
                row_quantized[value.args[0]] = _quantize_rows(rw, value.args[0])
            xq, rows = row_quantized[value.args[0]]
            wq, ws = quantize_weight(w, axis=0 if transposed else 1)
            wq = np.ascontiguousarray(wq.T) if transposed else wq
            acc = rw.emit(relax.op.matmul(xq, rw.param(f"{weight_var.name}_int8", wq), out_dtype="int32"))
            y = rw.emit(relax.op.dequantize(acc, rw.const(ws), rw.const(0, "int8"), axis=-1, out_dtype="float32"))
            return relax.op.multiply(y, rows)
        xq = _quantize_input(rw, value.args[0], plan.act_scale)
        if op == "relax.nn.conv2d":
            wq, ws = quantize_weight(w, axis=0)
            acc = rw.emit(relax.op.nn.conv2d(xq, rw.param(f"{weight_var.name}_int8", wq), out_dtype="int32",
                                             **conv_attrs(value)))
            axis = 1
        else:
            wq, ws = quantize_weight(w, axis=0 if transposed else 1)
            wq = np.ascontiguousarray(wq.T) if transposed else wq  # stored as (K, N): no transpose at run time
            acc = rw.emit(relax.op.matmul(xq, rw.param(f"{weight_var.name}_int8", wq), out_dtype="int32"))
            axis = -1
        y = relax.op.dequantize(acc, rw.const(plan.act_scale * ws), rw.const(0, "int8"), axis=axis, out_dtype="float32")
        if plan.correction is None:
            return y
        # as a bias reads (a reshaped weight): fold_bias adds it to the int32 accumulator
        correction = rw.param(f"{weight_var.name}_bias_correction", plan.correction.astype(np.float32))
        if op == "relax.nn.conv2d":
            correction = rw.emit(relax.op.reshape(correction, [1, -1, 1, 1]))
        return relax.op.add(rw.emit(y), correction)

    extra = (lambda rw: [rw.new(layer_vars[name]) for name in taps]) if taps else None
    return rewrite(graph, visit, extra)
