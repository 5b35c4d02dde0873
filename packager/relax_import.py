"""ONNX -> Relax IRModule with the weights detached as function parameters (fp32)."""

from __future__ import annotations

from edgeq.errors import ModelError
from edgeq.graph import Graph
from edgeq.limits import check
from edgeq.load import LoadedModel, TensorSpec
from edgeq.toolchain import import_tvm


QOPERATOR_OPS = {"QLinearConv", "QLinearMatMul", "ConvInteger", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool",
                  "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool", "QGemm"}


def unsupported_ops(model) -> list[str]:
    """ONNX op types in the model that TVM's Relax ONNX frontend has no converter for."""
    import_tvm()
    from tvm.relax.frontend.onnx import onnx_frontend

    known = set(onnx_frontend._get_convert_map()) | {"Constant", "If"}
    return sorted({node.op_type for node in model.graph.node if node.op_type not in known})


def _tensor_specs(ret_ty, names: list[str]) -> list[TensorSpec]:
    from tvm import relax

    fields = list(ret_ty.fields) if isinstance(ret_ty, relax.TupleType) else [ret_ty]
    specs = []
    for name, field in zip(names, fields):
        if not isinstance(field, relax.TensorType) or field.shape is None:
            raise ModelError(f"output '{name}' has no static tensor shape after import; fix the input shapes")
        specs.append(TensorSpec(name, tuple(int(d) for d in field.shape), str(field.dtype)))
    return specs


def to_relax(loaded: LoadedModel) -> tuple[Graph, list[TensorSpec]]:
    """Import the model. Returns the graph (Relax module + named weights) and the output specs."""
    import_tvm()
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    missing = unsupported_ops(loaded.onnx_model)
    qoperator = [op for op in missing if op in QOPERATOR_OPS]
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
    nested = _nested_control_flow(loaded.onnx_model.graph)
    if nested:
        raise ModelError(
            f"{loaded.path.name}: node '{nested}' puts an If/Loop inside another one's branch, which TVM "
            f"{_tvm_version()}'s importer cannot compile; fold the condition (onnxsim, or export with fixed inputs)"
        )
    try:
        mod = from_onnx(
            loaded.onnx_model,
            shape_dict={spec.name: list(spec.shape) for spec in loaded.inputs},
            keep_params_in_input=True,
        )
    except Exception as err:  # the frontend raises anything from ValueError to TVMError
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelError(f"TVM could not import {loaded.path.name}: {first}") from None
    mod, params = relax.frontend.detach_params(mod)
    func = mod["main"]
    weights = list(params.get("main", []))
    names = [p.name for p in func.params[len(loaded.inputs) :]]
    outputs = _tensor_specs(func.ret_ty, [o.name for o in loaded.onnx_model.graph.output])
    if len(set(names)) != len(names):
        raise ModelError(f"{loaded.path.name}: weight names are not unique after import; rename the initializers")
    _check_activations(func, loaded.path.name)
    return Graph(mod, {n: w.numpy() for n, w in zip(names, weights)}), outputs


def _nested_control_flow(graph, inside: bool = False) -> str | None:
    """The name of the first If/Loop/Scan nested in another one's subgraph (TVM's frontend loses the outer
    variables there and the build fails with an internal error), or None."""
    for node in graph.node:
        control = node.op_type in ("If", "Loop", "Scan")
        if control and inside:
            return node.name or node.op_type
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found = _nested_control_flow(sub, inside or control)
                if found:
                    return found
    return None


def _check_activations(func, model_name: str) -> None:
    """Refuse, before anything is compiled or run, a model that computes a tensor larger than the limit
    (400 KB of inputs can describe a 40 GB intermediate)."""
    import math

    import tvm
    from tvm import relax, tirx

    biggest, where = 0, ""
    for block in func.body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr) or not str(ty.dtype):
                continue
            dims = list(ty.shape.values)
            if not all(isinstance(d, tirx.IntImm) for d in dims):
                continue
            size = math.prod(int(d) for d in dims) * max(tvm.DataType(str(ty.dtype)).bits, 8) // 8
            if size > biggest:
                biggest, where = size, binding.var.name
    check("activation_bytes", f"{model_name}: tensor '{where}'", biggest, ModelError)


def _tvm_version() -> str:
    return import_tvm().__version__
