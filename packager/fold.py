"""Fold an ONNX model's shape arithmetic to constants before TVM imports it.

Exporters write shapes as computations: ``Shape -> Gather -> Div -> Concat -> Reshape`` (Swin's window
partition), ``Shape -> Slice -> Split`` (ShuffleNet's channel split). With the input shapes fixed these are
constants, but TVM's importer sees tensors of unknown value and either refuses (``Reshape expects the input
tensor to have known shape``) or builds a graph of unknown shapes that fails later. This pass evaluates,
with ONNX's reference evaluator, every node whose inputs are all constants (initializers, or ``Shape`` /
``Size`` of a tensor whose shape inference found static), and replaces it with an initializer, round after
round with shape inference in between, until nothing changes.

Every ``Constant`` node becomes an initializer, whatever its size (its value is in the file already): a
weight stored as a ``Constant`` node (Paddle2ONNX, torch exports with constant folding off) is then a weight
like any other to the importer, the quantizer and the kernels, never an unnamed constant. What it never folds:

- nodes producing a graph output (a model with no inputs keeps its nodes);
- QuantizeLinear / DequantizeLinear (a pre-quantized model's QDQ pattern is what edgeq lowers to integer
  kernels) and random-number ops;
- nodes other than ``Constant`` whose output would be large (more than ``MAX_FOLD_ELEMENTS``): weight transforms stay in the graph,
  where TVM folds them itself, and a ConstantOfShape/Range/Expand/Tile bomb is never evaluated. A boolean
  output may have up to ``MAX_FOLD_MASK_ELEMENTS``: a language model's causal mask, 1 byte an element (a prefill of
  511 rows: 261,121), which the CPU build reads to compute only the keys each row sees
  (``backends/cpu/attention``).

It runs inside ``edgeq.model_guard``'s memory-limited child process.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

MAX_FOLD_ELEMENTS = 1 << 16
MAX_FOLD_MASK_ELEMENTS = 1 << 20  # boolean outputs: a causal mask of up to 1024 x 1024
MAX_ROUNDS = 16
NEVER = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "RandomNormal", "RandomUniform",
         "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "If", "Loop", "Scan"}


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
    for tensor in model.graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
    return shapes


def _shape_of(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(math.prod(shape), np.int64)
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.array(shape[slice(start, end)], np.int64)


def _output_elements(node: onnx.NodeProto, values: list[np.ndarray | None]) -> int | None:
    """The output size of the ops whose size is set by their input values, before evaluating them."""
    try:
        if node.op_type == "ConstantOfShape":
            return math.prod(int(v) for v in values[0].ravel())
        if node.op_type == "Range":
            start, limit, delta = (float(v) for v in values[:3])
            return max(math.ceil((limit - start) / delta), 0) if delta else None
        if node.op_type == "Expand":
            return math.prod(np.broadcast_shapes(values[0].shape, tuple(int(v) for v in values[1].ravel())))
        if node.op_type == "Tile":
            return values[0].size * math.prod(int(v) for v in values[1].ravel())
    except (ValueError, TypeError, AttributeError, OverflowError, ZeroDivisionError):
        return None
    return 0


def evaluate_node(node: onnx.NodeProto, values: list[np.ndarray | None], opset: list) -> list[np.ndarray]:
    """``node`` run by ONNX's reference evaluator on ``values`` (one per input position, None where the input
    is absent). Raises whatever the evaluator raises. Also used by edgeq.onnx_ops for ops whose every input
    is known at import time."""
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if v is not None else "" for i, v in enumerate(values)]
    inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for n, v in zip(names, values) if n]
    outputs = [onnx.helper.make_tensor_value_info(f"out{i}", onnx.TensorProto.UNDEFINED, None)
               for i in range(len(node.output))]
    single = onnx.helper.make_node(node.op_type, names, [o.name for o in outputs], domain=node.domain)
    single.attribute.extend(node.attribute)
    graph = onnx.helper.make_graph([single], "fold", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=opset)
    results = ReferenceEvaluator(model).run(None, {n: v for n, v in zip(names, values) if n})
    return [np.asarray(r) for r in results]


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor of a ``Constant`` node that stores one (its ``value`` attribute), else None."""
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR and len(node.output) == 1:
            return attr.t
    return None


def fold_once(model: onnx.ModelProto) -> int:
    """One round over the graph; returns the number of nodes folded (the model is changed in place)."""
    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    small: dict[str, np.ndarray] = {}

    def value(name: str) -> np.ndarray | None:
        if name not in small:
            tensor = consts.get(name)
            if tensor is None or math.prod(tensor.dims) > MAX_FOLD_ELEMENTS:
                return None
            small[name] = numpy_helper.to_array(tensor)
        return small[name]

    shapes = _static_shapes(model)
    outputs = {o.name for o in graph.output}
    used_before = {name for node in graph.node for name in node.input}
    keep, folded, created = [], 0, set()
    for node in graph.node:
        if node.op_type in NEVER or node.domain not in ("", "ai.onnx") or set(node.output) & outputs:
            keep.append(node)
            continue
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes and node.input[0] not in consts:
            results = [_shape_of(node, shapes[node.input[0]])]
        elif node.op_type == "Constant" and _constant_tensor(node) is not None:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(_constant_tensor(node))  # as stored: dtype and bytes unchanged, nothing evaluated
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
            consts[tensor.name] = tensor
            created.add(tensor.name)
            folded += 1
            continue
        else:
            values = [value(name) if name else None for name in node.input]
            if (not node.input and node.op_type != "Constant") or any(v is None for n, v in zip(node.input, values) if n):
                keep.append(node)
                continue
            size = _output_elements(node, values)
            if size is None or size > MAX_FOLD_ELEMENTS:
                keep.append(node)
                continue
            try:
                results = evaluate_node(node, values, list(model.opset_import))
            except Exception:  # noqa: BLE001 - an op the reference evaluator cannot run stays in the graph for TVM
                results = None
            if results is None or len(results) < len([o for o in node.output if o]) \
                    or any(np.asarray(r).size > (MAX_FOLD_MASK_ELEMENTS if np.asarray(r).dtype == np.bool_
                                                 else MAX_FOLD_ELEMENTS) for r in results):
                keep.append(node)
                continue
        for name, result in zip(node.output, results):
            if name:
                tensor = numpy_helper.from_array(np.array(result, order="C"), name)  # 0-d stays 0-d
                graph.initializer.append(tensor)
                consts[name], small[name] = tensor, result
                created.add(name)
        folded += 1
    if folded:
        del graph.node[:]
        graph.node.extend(keep)
        used = {name for node in graph.node for name in node.input} | outputs
        droppable = used_before | created
        kept = [t for t in graph.initializer if t.name in used or t.name not in droppable]
        if len(kept) != len(graph.initializer):  # (rebuilt, not removed one by one: that is quadratic)
            del graph.initializer[:]
            graph.initializer.extend(kept)
        names = {t.name for t in graph.initializer}
        infos = [v for v in graph.value_info if v.name not in names]
        if len(infos) != len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(infos)
    return folded


def fold(model: onnx.ModelProto, infer) -> tuple[onnx.ModelProto, int]:
    """Fold until nothing changes, re-running ``infer(model) -> model`` (shape inference) between rounds.
    Returns the model and the number of nodes folded."""
    total = 0
    for _ in range(MAX_ROUNDS):
        count = fold_once(model)
        if not count:
            break
        total += count
        model = infer(model)
    return model, total
