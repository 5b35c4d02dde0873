"""Find the quantizable layers of a float graph: Conv (incl. depthwise and grouped) and Gemm/MatMul with a
weight parameter, named after the ONNX node they came from."""

from __future__ import annotations

import dataclasses

import onnx

from edgeq.graph import Graph, call_op, const_value, weight_operand
from edgeq.graph_passes import shape_of

PRECISIONS = ("int8", "fp16", "fp32")
# a MatMul/Gemm whose input has this rank or more reads a sequence (batch, tokens, features): its int8 input is
# scaled per row at run time (quantize_ops: per-token), not by one calibrated scale; but for attention's context
# (the output projection's input: a product of two activations, its heads merged), which keeps one calibrated scale
SEQUENCE_RANK = 3


@dataclasses.dataclass
class Layer:
    name: str  # the ONNX node name (or "<OpType>_<weight>" when the node has none)
    op_type: str  # the ONNX op: Conv, Gemm, MatMul
    kind: str  # "conv2d" or "matmul"
    weight: str  # name of the weight parameter in the graph (the ONNX initializer)
    channel_axis: int  # output-channel axis of the weight as the Relax op sees it
    precision: str = "int8"
    reason: str = ""  # why a layer is not int8
    # int8 input scale: "per-tensor" (calibrated), "per-channel" (depthwise, quantize.smooth) or "per-token" (run time)
    activation: str = "per-tensor"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

def attention_context(expr, values: dict, is_weight) -> bool:
    """Whether ``expr`` is attention's context: through reshapes and transposes (the heads merged), a matrix product
    of two activations (softmax(Q K^T) V)."""
    while call_op(values.get(expr)) in ("relax.reshape", "relax.permute_dims"):
        expr = values[expr].args[0]
    value = values.get(expr)
    return call_op(value) == "relax.matmul" and not any(is_weight(a) for a in value.args)


# element-wise operators a layer's epilogue can compute after it (a transformer FFN's bias and GELU, in either form)
EPILOGUE_OPS = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.erf", "relax.tanh",
                          "relax.sigmoid", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.nn.relu",
                          "relax.clip", "relax.maximum", "relax.minimum"})


def made_by_a_layer(expr, values: dict, is_weight) -> bool:
    """Whether ``expr`` is one layer's output (a conv2d or matmul by a weight) or computed from it by element-wise
    operators whose other operands are weights or constants (a transformer FFN's first layer, its bias and GELU):
    a value that layer's epilogue can write in whatever form the next layer reads."""
    sources, stack, seen = set(), [expr], set()
    while stack:
        e = stack.pop()
        if e in seen:
            continue
        seen.add(e)
        value = values.get(e)
        if weight_operand(value, values.get, is_weight)[0] is not None:
            sources.add(e)
            continue
        if call_op(value) not in EPILOGUE_OPS:
            return False
        stack.extend(a for a in value.args if not is_weight(a) and const_value(a) is None)
    return len(sources) == 1


def epilogue_inputs(graph: Graph, layers: list[Layer]) -> list[Layer]:
    """The per-token int8 layers of ``layers`` whose input another layer's epilogue makes (``made_by_a_layer``: a
    transformer FFN's second layer, after GELU), in their order."""
    values = {b.var: b.value for b in graph.bindings()}
    params = set(graph.weight_params)

    def is_weight(expr):
        return expr in params

    inputs = {}
    for b in graph.bindings():
        rhs, _ = weight_operand(b.value, values.get, is_weight)
        if rhs is not None:
            inputs.setdefault(rhs.name, b.value.args[0])
    return [l for l in layers if l.precision == "int8" and l.activation == "per-token" and l.weight in inputs
            and made_by_a_layer(inputs[l.weight], values, is_weight)]


def find_layers(graph: Graph, model: onnx.ModelProto | None = None) -> list[Layer]:
    """Quantizable layers in binding order. A MatMul of two activations (attention) is not one: it has no
    weight to quantize per channel and stays in float. A MatMul/Gemm reading a sequence (``SEQUENCE_RANK``)
    gets per-token activation scales, but for one reading attention's context (measured on all-MiniLM-L6-v2: the
    context per tensor costs nothing, cosine with fp32 0.9976 -> 0.9975 in the mean, 0.9952 -> 0.9957 at worst,
    where the GELU output per tensor drops to 0.9848; benchmarks/RESULTS.md): it keeps one calibrated scale, which
    a GPU's attention kernel can apply as it writes the context."""
    nodes = {}
    if model is not None:
        for node in model.graph.node:
            if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1:
                nodes.setdefault(node.input[1], node)
    values = {b.var: b.value for b in graph.bindings()}
    params = set(graph.weight_params)
    layers = []
    for binding in graph.bindings():
        op = call_op(binding.value)
        rhs, transposed = weight_operand(binding.value, values.get, lambda expr: expr in params)
        if rhs is None:  # an activation (Gemm's matmul(x, permute_dims(W)) is seen through)
            continue
        weight = graph.weights[rhs.name]
        if op == "relax.nn.conv2d":
            if weight.ndim != 4:
                continue
            kind, axis = "conv2d", 0
        else:
            if weight.ndim != 2:
                continue
            kind, axis = "matmul", (0 if transposed else 1)
        node = nodes.get(rhs.name)
        op_type = node.op_type if node is not None else ("Conv" if kind == "conv2d" else "MatMul")
        name = (node.name if node is not None and node.name else f"{op_type}_{rhs.name}")
        rank = len(shape_of(binding.value.args[0]) or ())
        sequence = kind == "matmul" and rank >= SEQUENCE_RANK
        context = sequence and attention_context(binding.value.args[0], values, lambda expr: expr in params)
        activation = "per-token" if sequence and not context else "per-tensor"
        layers.append(Layer(name=name, op_type=op_type, kind=kind, weight=rhs.name, channel_axis=axis,
                            activation=activation))
    return layers
