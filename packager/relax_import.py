"""ONNX -> Relax IRModule with the weights detached as function parameters (fp32).

TVM's ONNX frontend does the import, with the converters of ``edgeq.onnx_ops`` added to its table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import warnings

from edgeq.errors import ModelError
from edgeq.graph import Graph
from edgeq.limits import check
from edgeq.templates.contract import RowsRecord, TensorSpec
from edgeq.load import LoadedModel, nested_node
from edgeq.tvm_env import import_tvm


QOPERATOR_OPS = {"QLinearConv", "QLinearMatMul", "ConvInteger", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool",
                  "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool", "QGemm"}


def unsupported_ops(model) -> list[str]:
    """ONNX op types in the model that neither TVM's Relax ONNX frontend nor edgeq has a converter for."""
    import_tvm()
    from edgeq import onnx_ops

    known = onnx_ops.known_ops()
    return sorted({node.op_type for node in model.graph.node if node.op_type not in known})


def _tensor_specs(ret_ty, onnx_model) -> list[TensorSpec]:
    from tvm import relax, tirx

    names = [o.name for o in onnx_model.graph.output]
    producers = {out: node for node in onnx_model.graph.node for out in node.output}
    fields = list(ret_ty.fields) if isinstance(ret_ty, relax.TupleType) else [ret_ty]
    specs = []
    for name, field in zip(names, fields):
        node = producers.get(name)
        made_by = f" (made by {node.op_type} '{node.name or node.op_type}')" if node is not None else ""
        if not isinstance(field, relax.TensorType):
            raise ModelError(f"output '{name}'{made_by} is not a tensor (a sequence or optional value); "
                             "an edgeq bundle returns tensors: end the model before it")
        if not isinstance(field.shape, relax.ShapeExpr) or not all(isinstance(d, tirx.IntImm) for d in field.shape.values):
            raise ModelError(f"output '{name}'{made_by} has no static shape after import; an edgeq bundle has "
                             "static shapes: fix the input shapes (--input-shape) and shape operands (--const)")
        specs.append(TensorSpec(name=name, shape=[int(d) for d in field.shape.values], dtype=str(field.dtype)))
    return specs


def _shape_outputs_as_tensors(mod):
    """Outputs that TVM imports as shape values (the output of ONNX Shape) returned as int64 tensors."""
    from tvm import relax

    func = mod["main"]
    ret_ty = func.ret_ty
    fields = list(ret_ty.fields) if isinstance(ret_ty, relax.TupleType) else [ret_ty]
    if not any(isinstance(f, relax.ShapeType) for f in fields):
        return mod
    out = func.body.body
    items = list(out.fields) if isinstance(out, relax.Tuple) else (
        [relax.TupleGetItem(out, i) for i in range(len(fields))] if isinstance(ret_ty, relax.TupleType) else [out])
    bindings, new_items, new_fields = [], [], []
    for i, (item, field) in enumerate(zip(items, fields)):
        if isinstance(field, relax.ShapeType):
            field = relax.TensorType([field.ndim], "int64")
            var = relax.Var(f"shape_output{i}", field)
            bindings.append(relax.VarBinding(var, relax.op.shape_to_tensor(item)))
            item = var
        new_items.append(item)
        new_fields.append(field)
    tuple_out = isinstance(ret_ty, relax.TupleType)
    body = relax.SeqExpr(list(func.body.blocks) + [relax.BindingBlock(bindings)],
                         relax.Tuple(new_items) if tuple_out else new_items[0])
    ret = relax.TupleType(new_fields) if tuple_out else new_fields[0]
    mod = mod.with_attr("edgeq", "shape outputs")  # a copy
    mod["main"] = relax.Function(func.params, body, ret, func.is_pure, func.attrs)
    return relax.transform.Normalize()(mod)


def to_relax(loaded: LoadedModel, max_detections: int | None = None) -> tuple[Graph, list[TensorSpec]]:
    """Import the model. Returns the graph (Relax module + named weights) and the output specs (with a
    ``<output>_count`` output per NonMaxSuppression, whose rows are padded to ``max_detections`` at most:
    ``edgeq.nms``)."""
    import_tvm()
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    missing = unsupported_ops(loaded.onnx_model)
    # edgeq converts QLinearConv, QLinearMatMul, QGemm and ConvInteger (exactly, in int32); a model that also needs
    # the other QOperator ops is refused as a whole, naming all of them
    qoperator = sorted({n.op_type for n in loaded.onnx_model.graph.node if n.op_type in QOPERATOR_OPS}) \
        if any(op in QOPERATOR_OPS for op in missing) else []
    if qoperator:
        raise ModelError(
            f"{loaded.path.name} is quantized in the QOperator format ({', '.join(qoperator)}), which TVM cannot import; "
            "quantize it in QDQ format instead (onnxruntime quantize_static(..., quant_format=QuantFormat.QDQ))"
        )
    if missing:
        raise ModelError(
            f"{loaded.path.name} uses ONNX op(s) TVM {_tvm_version()} cannot import: {', '.join(missing)}; "
            "re-export the model with ops TVM supports"
        )
    # (an If/Loop/Scan inside another one's subgraph: TVM's frontend loses the outer variables there)
    nested = nested_node(loaded.onnx_model.graph, ("If", "Loop", "Scan"))
    if nested:
        raise ModelError(
            f"{loaded.path.name}: node '{nested}' puts an If/Loop inside another one's branch, which TVM "
            f"{_tvm_version()}'s importer cannot compile; fold the condition (onnxsim, or export with fixed inputs)"
        )
    from edgeq import nms, onnx_ops

    name = loaded.path.name
    onnx_model, counts = nms.with_counts(loaded.onnx_model)
    padded = nms.padded_outputs(onnx_model, counts)  # refuses an op that would mix padded rows with real ones
    try:
        # TVM prints "Error converting operator ..." before re-raising; the one-line error says it instead
        with onnx_ops.installed(max_detections), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            # TVM's frontend runs ONNX's checker, which notes the count output edgeq added to NonMaxSuppression
            warnings.filterwarnings("ignore", message=r"Node.* with schema\(::NonMaxSuppression")
            mod = from_onnx(
                onnx_model,
                shape_dict={spec.name: list(spec.shape) for spec in loaded.inputs},
                keep_params_in_input=True,
            )
        mod = _shape_outputs_as_tensors(mod)
    except onnx_ops.Refused as err:
        raise ModelError(f"{name}: {_name_const_inputs(str(err), loaded.onnx_model)}") from None
    except onnx_ops.ConversionError as err:
        todo = ("if that operand is a graph input, bind it with --const NAME=FILE.npy (or make it an initializer)"
                if err.runtime_operands else f"re-export the model without this use of {err.op}")
        text = _name_const_inputs(f"TVM {_tvm_version()} could not import {name}: {err}; {todo}", loaded.onnx_model)
        raise ModelError(text) from None
    except Exception as err:  # the frontend raises anything from ValueError to TVMError
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelError(f"TVM could not import {name}: {first}") from None
    mod, params = relax.frontend.detach_params(mod)
    func = mod["main"]
    weights = list(params.get("main", []))
    names = [p.name for p in func.params[len(loaded.inputs) :]]
    outputs = [dataclasses.replace(spec, rows=RowsRecord(axis=padded[spec.name][0], bound=spec.shape[padded[spec.name][0]],
                                                         count=padded[spec.name][1], source=padded[spec.name][2]))
               if spec.name in padded else spec for spec in _tensor_specs(func.ret_ty, onnx_model)]
    if len(set(names)) != len(names):
        raise ModelError(f"{loaded.path.name}: weight names are not unique after import; rename the initializers")
    _check_activations(func, loaded.path.name)
    return _takes_clipped(Graph(mod, {n: w.numpy() for n, w in zip(names, weights)})), outputs


def _takes_clipped(graph: Graph) -> Graph:
    """``take`` (Gather) in TVM's "clip" mode instead of its importer's "fast": for indices in range the same
    result (edgeq's converter already clamps run-time indices, ``onnx_ops.indices_in_range``), and no index can
    read outside the tensor. Each "fast" take also made TVM print a warning that it "segfaults when there are
    out-of-bounds indices", which cannot happen here."""
    from tvm import relax

    from edgeq.graph import call_op, rewrite

    def visit(rw, var, value):
        if call_op(value) == "relax.take" and value.attrs.mode == "fast":
            return relax.op.take(rw.new(value.args[0]), rw.new(value.args[1]), axis=value.attrs.axis, mode="clip")
        return None

    if not any(call_op(b.value) == "relax.take" for b in graph.bindings()):
        return graph
    return rewrite(graph, visit)


_CONST_ADVICE = re.compile(r"(bind the graph input with|if that operand is a graph input, bind it with) --const NAME=FILE\.npy")


def _name_const_inputs(message: str, model) -> str:
    """A refusal that says to bind a graph input with ``--const NAME=FILE.npy``, with NAME filled in: the graph
    inputs the node's operands (after its data input) are computed from, with their dtype and shape."""
    found = _CONST_ADVICE.search(message)
    node_name = re.search(r"node '([^']*)'", message)
    if not found or not node_name:
        return message
    graph = model.graph
    node = next((n for n in graph.node if (n.name or n.op_type) == node_name.group(1)), None)
    if node is None:
        return message
    initializers = {t.name for t in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initializers}
    producers = {out: n for n in graph.node for out in n.output}
    reached, stack, seen = [], list(node.input[1:] or node.input[:1]), set()  # (windows, ConstantOfShape: input 0)
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inputs:
            reached.append(name)
        elif name in producers:
            stack.extend(producers[name].input)
    if not reached:
        return message
    import onnx

    def described(name: str) -> str:
        ttype = inputs[name].type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type).name if ttype.elem_type else "?"
        dims = "x".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in ttype.shape.dim)
        return f"--const {name}=FILE.npy ({dtype}, shape {dims or 'scalar'})"

    names = sorted(reached)
    advice = (f"bind the graph input{'s' if len(names) > 1 else ''} it is computed from: "
              + ", ".join(described(n) for n in names))
    return message[: found.start()] + advice + message[found.end():]


def _check_activations(func, model_name: str) -> None:
    """Refuse, before anything is compiled or run, a model that computes a tensor larger than the limit
    (400 KB of inputs can describe a 40 GB intermediate)."""
    biggest, where = 0, ""
    for block in func.body.blocks:
        for binding in block.bindings:
            size = _tensor_bytes(binding.var.ty)
            if size > biggest:
                biggest, where = size, binding.var.name
    check("activation_bytes", f"{model_name}: tensor '{where}'", biggest, ModelError)
    # the golden run holds the inputs and the largest tensor at once: within this process's address space
    held = biggest + sum(_tensor_bytes(p.ty) for p in func.params)
    room = address_space_left()
    if room is not None and held > room:
        raise ModelError(f"{model_name}: running it needs at least {held / 2**30:.2f} GiB (its inputs and its largest "
                         f"tensor '{where}'), and this process may use {room / 2**30:.2f} GiB more (ulimit -v); give "
                         "smaller --input-shape dims or raise the limit")


def _tensor_bytes(ty) -> int:
    """Bytes of a tensor of type ``ty`` with a static shape; 0 for anything else."""
    import math

    import tvm
    from tvm import relax, tirx

    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr) or not str(ty.dtype):
        return 0
    dims = list(ty.shape.values)
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return 0
    return math.prod(int(d) for d in dims) * max(tvm.DataType(str(ty.dtype)).bits, 8) // 8


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``), or None without one."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return soft
    return max(0, soft - used)


def _tvm_version() -> str:
    return import_tvm().__version__
