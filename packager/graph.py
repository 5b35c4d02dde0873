"""The small piece of Relax plumbing every quantization pass uses.

A ``Graph`` is a model's ``main`` function (one dataflow block of bindings, as the ONNX importer makes it)
together with the values of its weight parameters by name. A pass walks the bindings in order and re-emits
them through a ``relax.BlockBuilder``; wherever it recognises a pattern it emits a replacement instead.
Weights stay function parameters (the bundle ships them in weights.npz), so a pass that quantizes a weight
adds a new parameter for the int8 array and drops the float one once nothing uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from edgeq.tvm_env import relax, tvm


# the integer types quantized tensors have, and their ranges
INT_RANGES = {"int8": (-128, 127), "uint8": (0, 255)}


@dataclasses.dataclass
class Graph:
    mod: Any  # tvm.IRModule with a "main" function
    weights: dict[str, np.ndarray]  # values of main's weight parameters, by parameter name

    @property
    def main(self):
        return self.mod["main"]

    @property
    def num_inputs(self) -> int:
        return int(self.main.attrs["num_input"])

    @property
    def inputs(self) -> list:
        return list(self.main.params[: self.num_inputs])

    @property
    def weight_params(self) -> list:
        return list(self.main.params[self.num_inputs :])

    @property
    def num_outputs(self) -> int:
        ret = self.main.ret_ty
        return len(ret.fields) if isinstance(ret, relax.TupleType) else 1

    def bindings(self) -> list:
        body = self.main.body
        return [b for block in body.blocks for b in block.bindings]

    def readers(self) -> dict:
        """{var: the vars of the bindings that read it, in order} (the outputs are not bindings)."""
        readers: dict = {}
        for b in self.bindings():
            for var in set(relax.analysis.free_vars(b.value)):
                readers.setdefault(var, []).append(b.var)
        return readers

    def weight_list(self) -> list[np.ndarray]:
        """The weight arrays in the order main takes them."""
        return [self.weights[p.name] for p in self.weight_params]


def const_value(expr) -> np.ndarray | None:
    """The array of a Relax constant, None for anything else."""
    if isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "numpy"):  # (not a PrimValue's int)
        return expr.value.numpy()
    return None


def weight_operand(value, value_of: Callable, is_weight: Callable) -> tuple[Any, bool]:
    """(weight parameter, transposed?) behind the second argument of a conv2d/matmul call ``value``; (None, False)
    when it is an activation. Gemm imports as ``matmul(x, permute_dims(W))``: that is seen through. ``value_of(var)``:
    the value bound to var (or None); ``is_weight(expr)``: whether expr is a weight parameter."""
    if call_op(value) not in ("relax.nn.conv2d", "relax.matmul"):
        return None, False
    rhs = value.args[1]
    if is_weight(rhs):
        return rhs, False
    inner = value_of(rhs)
    if call_op(inner) == "relax.permute_dims" and is_weight(inner.args[0]):
        return inner.args[0], True
    return None, False


def call_op(expr) -> str | None:
    """``"relax.nn.conv2d"`` for a call of a Relax operator, else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


class Rewriter:
    """Context handed to a pass while it re-emits a graph.

    ``value(var)`` is what a variable of the *input* graph is bound to (for matching patterns upwards),
    ``new(expr)`` the expression with input-graph variables replaced by their re-emitted counterparts,
    ``weight(expr)`` the array of a weight parameter (None for anything else), ``param(name, array)`` a new
    weight parameter, ``uses(var)`` how many bindings (and the output) use a variable.
    """

    def __init__(self, graph: Graph, bb):
        self.graph = graph
        self.bb = bb
        self.weights: dict[str, np.ndarray] = {}
        self._params: dict[str, Any] = {}
        self._env: dict = {}
        self._values = {b.var: b.value for b in graph.bindings()}
        self._uses: dict = {var: len(readers) for var, readers in graph.readers().items()}
        for var in relax.analysis.free_vars(graph.main.body.body):
            self._uses[var] = self._uses.get(var, 0) + 1
        for p in graph.weight_params:
            self._env[p] = self.param(p.name, graph.weights[p.name])

    def value(self, var):
        return self._values.get(var)

    def uses(self, var) -> int:
        return self._uses.get(var, 0)

    def weight(self, expr) -> np.ndarray | None:
        if isinstance(expr, relax.Var) and expr in self.graph.weight_params:
            return self.graph.weights[expr.name]
        return None

    def array(self, expr) -> np.ndarray | None:
        """The value of a weight parameter or a constant; None for anything computed at run time."""
        value = self.weight(expr)
        return value if value is not None else const_value(expr)

    def static_value(self, expr) -> np.ndarray | None:
        """The value of ``expr`` when it is known at build time: a weight, a constant, or a dequantize (as
        pre-quantized models store biases), layout op (``LAYOUT_OPS``), ``isnan`` or ``where`` of them (how
        ONNX Clip's bounds import); None for anything computed from the inputs."""
        value = self.array(expr)
        if value is not None:
            return value
        inner = self.value(expr) if isinstance(expr, relax.Var) else expr
        op = call_op(inner)
        if op == "relax.dequantize":
            q, scale, zp = (self.array(a) for a in inner.args)
            if q is not None and scale is not None and zp is not None:
                shape = [1] * q.ndim
                if scale.size > 1:
                    shape[int(inner.attrs.axis) % q.ndim] = -1
                return ((q.astype(np.float32) - zp.reshape(shape)) * scale.reshape(shape)).astype(np.float32)
            return None
        if op == "relax.isnan":
            base = self.static_value(inner.args[0])
            return None if base is None else np.isnan(base)
        if op == "relax.where":
            parts = [self.static_value(a) for a in inner.args]
            return None if any(p is None for p in parts) else np.where(*parts).astype(str(inner.ty.dtype))
        return apply_layout_op(inner, self.static_value) if op in LAYOUT_OPS else None

    def weight_operand(self, value):
        """``weight_operand`` over this rewrite's bindings and weights."""
        return weight_operand(value, self.value, lambda expr: self.weight(expr) is not None)

    def param(self, name: str, array: np.ndarray):
        """A weight parameter of the output graph holding ``array``, named ``name`` or, where that name holds
        another array already, ``name_2``, ``name_3``, ...: the one parameter of a name is returned again only
        for an equal array (same dtype, shape and values), so two weights never share a parameter because
        their names agree (a name may come from anything: a layer, a kernel's layout tag, a fixed word)."""
        array = np.require(array, requirements="C")  # ascontiguousarray makes 0-d 1-d
        candidate, n = name, 1
        while candidate in self._params:
            held = self.weights[candidate]
            if held is array or (held.dtype == array.dtype and held.shape == array.shape
                                 and np.array_equal(held, array, equal_nan=held.dtype.kind in "fc")):
                return self._params[candidate]
            n += 1
            candidate = f"{name}_{n}"
        self._params[candidate] = relax.Var(candidate, relax.TensorType(list(array.shape), str(array.dtype)))
        self.weights[candidate] = array
        return self._params[candidate]

    def const(self, array, dtype: str = "float32"):
        return relax.const(np.asarray(array, dtype=dtype), dtype)

    def new(self, expr, on_var: Callable[[Any], Any] | None = None):
        """``expr`` with input-graph variables replaced by their re-emitted counterparts, each passed
        through ``on_var`` when given (a pass that must convert what it reads)."""
        if isinstance(expr, relax.Var):
            var = self._env.get(expr, expr)
            return var if on_var is None else on_var(var)
        if isinstance(expr, relax.Call):
            return relax.Call(expr.op, [self.new(a, on_var) for a in expr.args], expr.attrs, expr.ty_args)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.new(f, on_var) for f in expr.fields])
        if isinstance(expr, relax.TupleGetItem):
            return relax.TupleGetItem(self.new(expr.tuple_value, on_var), expr.index)
        if isinstance(expr, relax.If):  # ONNX If: both branches' values are computed before it, outside
            return relax.If(self.new(expr.cond, on_var), self.new(expr.true_branch, on_var),
                            self.new(expr.false_branch, on_var))
        if isinstance(expr, relax.SeqExpr):
            blocks = [type(block)([relax.VarBinding(b.var, self.new(b.value, on_var)) for b in block.bindings])
                      for block in expr.blocks]
            return relax.SeqExpr(blocks, self.new(expr.body, on_var))
        return expr

    def emit(self, expr, name: str = ""):
        return self.bb.emit(expr, name)


Visit = Callable[[Rewriter, Any, Any], Any]


def rewrite(graph: Graph, visit: Visit, extra_outputs: Callable[[Rewriter], list] | None = None) -> Graph:
    """Re-emit ``graph``'s bindings; ``visit(rw, var, value)`` returns a replacement expression (already
    emitted or not) or None to keep the binding as it is. ``extra_outputs`` may add outputs (calibration taps)."""
    bb = relax.BlockBuilder()
    main = graph.main
    inputs = [relax.Var(p.name, p.ty) for p in graph.inputs]
    # a graph with control flow (ONNX If) has no dataflow block: a relax.If may not stand in one
    dataflow = all(isinstance(block, relax.DataflowBlock) for block in main.body.blocks)
    with bb.function("main", attrs=dict(main.attrs)):
        rw = Rewriter(graph, bb)
        rw._env.update(zip(graph.inputs, inputs))
        with bb.dataflow() if dataflow else contextlib.nullcontext():
            for binding in graph.bindings():
                replacement = visit(rw, binding.var, binding.value)
                if replacement is None:
                    replacement = rw.new(binding.value)
                if not isinstance(replacement, relax.Var):
                    replacement = bb.emit(replacement, binding.var.name)
                rw._env[binding.var] = replacement
            output = rw.new(main.body.body)
            if extra_outputs is not None:
                output = relax.Tuple([output, *extra_outputs(rw)])
            output = bb.emit_output(output) if dataflow else bb.emit(output)
        params = inputs + list(rw._params.values())
        bb.emit_func_output(output, params=params)
    func = relax.analysis.remove_all_unused(bb.get()["main"])
    func = relax.transform.CanonicalizeBindings()(tvm.IRModule({"main": func}))["main"]  # drop `gv1 = gv` aliases
    used = set(relax.analysis.free_vars(func.body))
    kept = [p for p in func.params[len(inputs) :] if p in used]
    func = relax.Function(list(func.params[: len(inputs)]) + kept, func.body, func.ret_ty, func.is_pure, func.attrs)
    weights = {p.name: rw.weights[p.name] for p in kept}
    functions = dict(graph.mod.functions)  # keep the module's other (TIR) functions, add the pass's
    functions.update({gv: f for gv, f in bb.get().functions.items() if gv.name_hint != "main"})
    mod = tvm.IRModule(functions)
    mod["main"] = func
    return Graph(mod, weights)


def _stores(stmt) -> list:
    """The BufferStores of a TIR statement (SBlock/For/SeqStmt nests, as legalized operators are)."""
    if isinstance(stmt, tvm.tirx.BufferStore):
        return [stmt]
    if isinstance(stmt, tvm.tirx.SeqStmt):
        return [s for child in stmt.seq for s in _stores(child)]
    for attr in ("block", "body"):
        child = getattr(stmt, attr, None)
        if child is not None:
            return _stores(child)
    return []


def scalar_minmax(func) -> str | None:
    """"maximum"/"minimum" when a TIR function is an element-wise max/min of a tensor and a one-element
    or 0-d tensor (how TVM imports ONNX Clip with bounds given as inputs, e.g. ReLU6), else None."""
    if not isinstance(func, tvm.tirx.PrimFunc):
        return None
    stores = _stores(func.body)
    if len(stores) != 1 or not isinstance(stores[0].value, (tvm.tirx.Max, tvm.tirx.Min)):
        return None
    a, b = stores[0].value.a, stores[0].value.b
    if not (isinstance(a, tvm.ir.TensorLoad) and isinstance(b, tvm.ir.TensorLoad)):
        return None
    if [int(d) for d in b.source.shape] not in ([], [1]) or len(a.indices) != len(stores[0].indices):
        return None
    if any(not ia.same_as(ib) for ia, ib in zip(a.indices, stores[0].indices)):
        return None
    return "maximum" if isinstance(stores[0].value, tvm.tirx.Max) else "minimum"


def scalar_minmax_call(mod, value) -> tuple[str, Any, Any] | None:
    """("maximum" | "minimum", x, bound) when ``value`` is a ``call_tir`` of a ``scalar_minmax`` function of
    ``mod`` on ``(x, bound)``, else None."""
    if call_op(value) != "relax.call_tir" or len(value.args) < 2:
        return None
    fields = value.args[1]
    if not isinstance(fields, relax.Tuple) or len(fields.fields) != 2 or value.args[0] not in mod.get_global_vars():
        return None
    kind = scalar_minmax(mod[value.args[0]])
    return None if kind is None else (kind, *fields.fields)


# operators that only move, reshape or cast values: applied to known arrays at build time
LAYOUT_OPS = ("relax.reshape", "relax.permute_dims", "relax.astype", "relax.squeeze", "relax.expand_dims")


def apply_layout_op(call, value_of) -> np.ndarray | None:
    """A ``LAYOUT_OPS`` call applied to the array ``value_of(argument)`` (None when that is unknown)."""
    op = call_op(call)
    if op not in LAYOUT_OPS:
        return None
    arg = value_of(call.args[0])
    if arg is None:
        return None
    a = call.attrs
    if op == "relax.reshape":
        shape = call.args[1]
        if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
            return None
        return arg.reshape([int(d) for d in shape.values])
    if op == "relax.permute_dims":
        return np.transpose(arg, None if a.axes is None else [int(x) for x in a.axes])
    if op == "relax.astype":
        return arg.astype(str(a.dtype))
    if op == "relax.squeeze":
        return np.squeeze(arg, None if a.axis is None else tuple(int(x) for x in a.axis))
    out = arg  # expand_dims
    for axis in sorted(int(x) % (arg.ndim + len(a.axis)) for x in a.axis):
        out = np.expand_dims(out, axis)
    return out
