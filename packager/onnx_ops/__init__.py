"""ONNX operators edgeq converts itself, in one table (``CONVERTERS``: op type -> converter).

Two kinds: ops TVM 0.27's Relax frontend has no converter for (Swish, Celu, LpNormalization, CumProd,
the window functions, Det, Col2Im, ...), and ops whose TVM converter gives wrong results or crashes
(``OVERRIDES`` says why, op by op). A converter is ``fn(ctx, inputs, attr)`` returning a Relax expression
(a ``relax.Tuple`` for several outputs); ``ctx`` has the block builder, the opset, the node's name and
number of outputs, ``ctx.const(expr)`` (the value of an initializer or constant operand, else None) and
``ctx.tvm(...)`` (TVM's own converter, where an override handles only some cases).

Hooking in: TVM's frontend has no public way to add converters; ``from_onnx`` looks every op up in the
module function ``onnx_frontend._get_convert_map()``. ``installed()`` replaces that function, for the
duration of one import (a ``with`` block, restored on exit), by one returning TVM's table with edgeq's
converters added and every converter wrapped so that a failure names the ONNX node and op
(``ConversionError``), an op that cannot be compiled with static shapes is refused in one line
(``Refused``), and a converter that makes a tensor of data-dependent shape from static inputs is refused
there, naming the op, instead of failing later in the build.

The converters live by op family: ``nn`` (activations, normalization, attention, losses), ``tensor``, ``qdq``
(QOperator), ``recurrent`` (RNN, GRU, LSTM) and ``refused`` (data-dependent sizes, sequences); the helpers
and ``Context`` in ``context``. This module holds the table and the hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from edgeq.tvm_env import onnx_frontend, relax, tvm

from edgeq.onnx_ops.nn import attention, causal_conv_with_state, celu, layer_normalization, linear_attention, lp_normalization, mish, negative_log_likelihood_loss, rms_normalization, rotary_embedding, softmax_cross_entropy_loss, swiglu, swish
from edgeq.onnx_ops.qdq import conv_integer, qgemm, qlinear_conv, qlinear_matmul
from edgeq.onnx_ops.recurrent import recurrent
from edgeq.onnx_ops.refused import data_dependent, non_max_suppression, sequence_output
from edgeq.onnx_ops.tensor import bit_cast, center_crop_pad, col2im, constant_window, cum_prod, det, dft, einsum, expand, indices_in_range, one_hot, pad, reduce_bool, reverse_sequence, tensor_scatter, upsample
from edgeq.onnx_ops.context import Context, ConversionError, Refused, TVM_CONVERT_MAP, runtime_operands


CONVERTERS: dict[str, Callable] = {
    "Swish": swish,
    "Celu": celu,
    "SwiGLU": swiglu,
    "LpNormalization": lp_normalization,
    "CumProd": cum_prod,
    "HannWindow": constant_window,
    "HammingWindow": constant_window,
    "BlackmanWindow": constant_window,
    "MelWeightMatrix": constant_window,
    "CenterCropPad": center_crop_pad,
    "ReverseSequence": reverse_sequence,
    "TensorScatter": tensor_scatter,
    "BitCast": bit_cast,
    "Det": det,
    "Col2Im": col2im,
    "RotaryEmbedding": rotary_embedding,
    "Attention": attention,
    "DFT": dft,
    "CausalConvWithState": causal_conv_with_state,
    "LinearAttention": linear_attention,
    "QLinearConv": qlinear_conv,
    "QLinearMatMul": qlinear_matmul,
    "QGemm": qgemm,
    "ConvInteger": conv_integer,
    "NegativeLogLikelihoodLoss": negative_log_likelihood_loss,
    "SoftmaxCrossEntropyLoss": softmax_cross_entropy_loss,
    "RNN": recurrent,
    "GRU": recurrent,
    "LSTM": recurrent,
    # overrides of TVM's converters
    "Mish": mish,
    "Einsum": einsum,
    "LayerNormalization": layer_normalization,
    "RMSNormalization": rms_normalization,
    "NonMaxSuppression": non_max_suppression,
    "NonZero": data_dependent,
    "Unique": data_dependent,
    "Compress": data_dependent,
    "SplitToSequence": sequence_output,
    "Gather": indices_in_range,
    "GatherElements": indices_in_range,
    "ScatterElements": indices_in_range,
    "Scatter": indices_in_range,
    "Expand": expand,
    "OneHot": one_hot,
    "ReduceMax": reduce_bool,
    "ReduceMin": reduce_bool,
    "Pad": pad,
    "Upsample": upsample,
}

OVERRIDES = {
    "Attention": "TVM's converter is com.microsoft's Attention; ONNX's own (opset 23) is converted here",
    "Mish": "TVM's log(1 + e^x) loses small values for negative x (off by ~1e-6)",
    "LayerNormalization": "TVM returns 0-d placeholders for the optional Mean and InvStdDev outputs",
    "RMSNormalization": "TVM's rms_norm fails to build when the scale has the input's rank (axis 0)",
    "NonMaxSuppression": "TVM's result is trimmed at run time; edgeq's is padded to a static bound with a count (edgeq.nms)",
    "NonZero": "data-dependent output size: refused in one line instead of failing in the build",
    "Unique": "data-dependent output size: refused in one line instead of failing in the build",
    "Compress": "a constant condition becomes a take of fixed indices; a computed one is refused",
    "SplitToSequence": "a sequence cannot be a bundle's output: refused in one line",
    "Gather": "run-time indices clamped into the axis: TVM's take reads out of bounds on a bad index",
    "GatherElements": "run-time indices clamped into the axis (as Gather)",
    "ScatterElements": "run-time indices clamped into the axis: TVM would write out of bounds",
    "Scatter": "run-time indices clamped into the axis (as ScatterElements)",
    "Expand": "TVM leaves the shape symbolic when the target shape is an initializer",
    "OneHot": "TVM needs the on/off values constant",
    "ReduceMax": "bool inputs (any): TVM has no min value for bool",
    "ReduceMin": "bool inputs (all): TVM has no max value for bool",
    "Pad": "TVM needs the pad value constant, and its TE function stops ToMixedPrecision (fp16)",
    "Einsum": "TVM's TE function stops ToMixedPrecision (fp16) and no GPU kernel claims it: a matrix product becomes matmul",
    "Upsample": "TVM's converter fails when the scales are an input (opset 9)",
}


# ----------------------------------------------------------------------------------------------- hook


def known_ops() -> set[str]:
    """Every ONNX op type an import can convert (TVM's and edgeq's)."""
    return set(TVM_CONVERT_MAP()) | set(CONVERTERS) | {"Constant", "If"}


_FAILED_BUILDERS: list = []


class _Converter:
    """What TVM's importer expects of a converter class: ``get_converter(opset)`` -> fn(bb, inputs, attr, params)."""

    def __init__(self, op: str, fn: Callable | None, tvm_class, max_detections: int | None = None):
        self.op, self.fn, self.tvm_class, self.max_detections = op, fn, tvm_class, max_detections

    def get_converter(self, opset: int):
        def convert(bb, inputs, attr, params):
            custom = attr.get("tvm_custom", {})
            node = str(custom.get("name") or self.op)
            try:
                if self.fn is not None:
                    ctx = Context(bb, opset, self.op, node, int(custom.get("num_outputs", 1)), params, self.tvm_class,
                                  self.max_detections)
                    result = self.fn(ctx, inputs, attr)
                else:
                    result = self.tvm_class.get_converter(opset)(bb, inputs, attr, params)
                if isinstance(result, relax.Expr):
                    result = bb.normalize(result)
            except (Refused, ConversionError):
                _FAILED_BUILDERS.append(bb)
                raise
            except Exception as err:  # noqa: BLE001 - TVM's converters raise anything
                _FAILED_BUILDERS.append(bb)
                raise ConversionError(self.op, node, err, runtime_operands(inputs, params, self.op)) from err
            _check_static(self.op, node, inputs, result, params)
            return result

        return convert


def _static(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_static(f) for f in ty.fields)
    if isinstance(ty, relax.TensorType):
        return isinstance(ty.shape, relax.ShapeExpr) and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values)
    if isinstance(ty, relax.ShapeType):
        return True
    return True  # objects, prim values: not this check's business


def _check_static(op: str, node: str, inputs, result, params) -> None:
    """Refuse, naming the op, a tensor of unknown shape made from operands of known shapes."""
    exprs = [e for e in inputs if isinstance(e, relax.Expr)]
    if not isinstance(result, relax.Expr) or not all(_static(e.ty) for e in exprs) or _static(result.ty):
        return
    if runtime_operands(inputs, params, op):
        todo = ("its shape operand is computed at run time: make it an initializer, or bind the graph input "
                "with --const NAME=FILE.npy")
    else:
        todo = f"the size depends on the input values; end the model before {op} and run that step in the application"
    raise Refused(f"{op} node '{node}' makes a tensor of unknown shape, and an edgeq bundle has static shapes; {todo}")


@contextlib.contextmanager
def installed(max_detections: int | None = None):
    """TVM's ONNX importer with edgeq's converters added (for the duration of the ``with`` block)."""
    table = TVM_CONVERT_MAP()
    merged = {op: _Converter(op, None, cls) for op, cls in table.items()}
    merged.update({op: _Converter(op, fn, table.get(op), max_detections) for op, fn in CONVERTERS.items()})
    previous = onnx_frontend._get_convert_map
    onnx_frontend._get_convert_map = lambda: merged
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = previous
        while _FAILED_BUILDERS:  # an import that failed leaves its builder a block open: close it, quietly
            with contextlib.suppress(Exception):
                _FAILED_BUILDERS.pop()._end_block()
