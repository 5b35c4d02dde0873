"""What every converter gets (``Context``), the two ways an import fails (``Refused``, ``ConversionError``),
and the helpers the converters share."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from edgeq.tvm_env import onnx_frontend, relax, tvm


class Refused(Exception):
    """An op edgeq cannot compile, said in one line with what to do about it."""


class ConversionError(Exception):
    """A converter failed; names the ONNX node and op."""

    def __init__(self, op: str, node: str, cause: BaseException, runtime_operands: bool):
        text = str(cause).strip()
        self.op, self.node, self.runtime_operands = op, node, runtime_operands
        self.reason = text.splitlines()[0] if text else type(cause).__name__
        super().__init__(f"{op} node '{node}': {self.reason}")


@dataclasses.dataclass
class Context:
    bb: Any
    opset: int
    op: str
    node: str
    num_outputs: int
    params: Any  # TVM's [graph nodes, params] pair
    tvm_converter: Any  # TVM's converter class for this op, or None
    max_detections: int | None = None  # --max-detections (edgeq.nms)

    def const(self, expr) -> np.ndarray | None:
        """The value of an operand known at import time (a constant or an initializer), else None."""
        if expr is None:
            return None
        if isinstance(expr, tvm.ir.expr.Constant):
            return expr.value.numpy()
        if isinstance(expr, relax.Var) and expr.name in self.params[1]:
            return np.asarray(self.params[1][expr.name][1].numpy())
        return None

    def need_const(self, expr, what: str) -> np.ndarray:
        value = self.const(expr)
        if value is None:
            raise Refused(f"{self.op} node '{self.node}': its {what} is computed at run time; edgeq needs it "
                          "constant: make it an initializer, or bind the graph input with --const NAME=FILE.npy")
        return value

    def optional_const(self, inputs, index: int, what: str) -> np.ndarray | None:
        """The value of an optional operand: None where it is absent; where it is given, it must be constant
        (an operand that changes the result is never silently replaced by its default)."""
        if len(inputs) <= index or inputs[index] is None:
            return None
        return self.need_const(inputs[index], what)

    def tvm(self, inputs, attr):
        if self.tvm_converter is None:
            raise Refused(f"{self.op} node '{self.node}': not supported in this form")
        return self.tvm_converter.get_converter(self.opset)(self.bb, inputs, attr, self.params)

    def refuse(self, why: str, todo: str):
        raise Refused(f"{self.op} node '{self.node}': {why}; {todo}")


# ----------------------------------------------------------------------------------------------- helpers


def shape_of(expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def dtype_of(expr) -> str:
    return str(expr.ty.dtype)


def relax_const(value, dtype: str | None = None):
    """A Relax constant of ``value`` in ``dtype`` (default: the array's own; relax.const alone makes
    float64 arrays float32)."""
    value = np.asarray(value, dtype=dtype)
    return relax.const(value, str(value.dtype))


def normal_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def slice_along(x, axis: int, begin: int, end: int, step: int = 1):
    return relax.op.strided_slice(x, [axis], [begin], [end], [step])


def reference_values(ctx: Context, attr: dict, values: list[np.ndarray | None]) -> list[np.ndarray]:
    """The op evaluated by ONNX's reference implementation on constant inputs (ops whose every input is
    known at import time, such as the window functions)."""
    import onnx

    from edgeq.fold import evaluate_node

    attrs = {k: v for k, v in attr.items() if k != "tvm_custom"}
    node = onnx.helper.make_node(ctx.op, [""] * len(values), [f"out{i}" for i in range(ctx.num_outputs)], **attrs)
    return evaluate_node(node, values, [onnx.helper.make_opsetid("", ctx.opset)])


def check_bounded(ctx: Context, elements: int) -> None:
    from edgeq.errors import ModelError
    from edgeq.limits import check

    check("activation_bytes", f"{ctx.op} node '{ctx.node}' output", elements * 8, ModelError)


# TVM's converter table, as TVM's frontend has it (edgeq.onnx_ops.installed replaces the frontend's function
# for the duration of an import; this is the original)
TVM_CONVERT_MAP = onnx_frontend._get_convert_map


def runtime_operands(inputs, params, op: str = "") -> bool:
    """Whether a shape-like operand (``edgeq.load.SHAPE_OPERANDS``' positions for ``op``, else every operand
    after the first) is a small tensor computed at run time."""
    from edgeq.load import SHAPE_OPERANDS

    positions = SHAPE_OPERANDS.get(op)
    operands = [inputs[i] for i in positions if i < len(inputs)] if positions else list(inputs)[1:]
    for expr in operands:
        if isinstance(expr, relax.Expr) and not isinstance(expr, tvm.ir.expr.Constant) \
                and not (isinstance(expr, relax.Var) and expr.name in params[1]) \
                and isinstance(expr.ty, relax.TensorType) and 0 <= expr.ty.ndim <= 1:
            return True
    return False
