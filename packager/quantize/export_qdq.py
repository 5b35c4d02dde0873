"""edgeq's calibration as an ONNX QDQ model (``edgeq package ... --export-qdq FILE.onnx``), for TensorRT's
explicit quantization (``trtexec --onnx=FILE.onnx --int8``) and ONNX Runtime.

The model written is the one edgeq packaged (after load: ``--const`` bound, shapes folded, Constant nodes as
initializers), with, for every layer edgeq computes in int8:

- its activation input quantized and dequantized with edgeq's scale (int8, per tensor, symmetric: zero
  point 0), one QuantizeLinear/DequantizeLinear pair per (tensor, scale), shared by the layers reading it;
- its weight stored as int8 with edgeq's per-output-channel scales (the same integers the bundle holds,
  ``quantize_weight``) behind a per-channel DequantizeLinear (opset 13).

A depthwise layer that reads its input per channel (``edgeq.quantize.smooth``) reads it through a Mul by 1/s,
with its weight multiplied by s before it is quantized, as in the bundle. Layers edgeq kept in float (``--skip``, the accuracy
budget's fallbacks) stay float, and so do the layers the bundle quantizes per token at run time (ONNX's
quantize ops take one scale per tensor or per channel, not per row); biases stay float (ONNX Runtime and
TensorRT fuse them), with edgeq's bias correction added to them (``edgeq.quantize.bias_correction``: a Conv or
Gemm without a bias gets one; a MatMul an Add after it). Everything between the layers is the model as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgeq.errors import ModelError, OutputError
from edgeq.quantize.layers import Layer
from edgeq.quantize.quantize_ops import quantize_weight

MIN_OPSET = 13  # per-channel DequantizeLinear (axis)


def qdq_model(model: onnx.ModelProto, layers: list[Layer], activation_scales: dict[str, float],
              smoothing: dict[str, np.ndarray] | None = None,
              corrections: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """``model`` with Q/DQ pairs for the int8 ``layers`` (``activation_scales``: layer name -> scale; ``smoothing``:
    weight name -> s, for the layers ``edgeq.quantize.smooth`` smoothed; ``corrections``: weight name -> the bias
    correction of that layer, per output channel)."""
    smoothing, corrections = smoothing or {}, corrections or {}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise ModelError(f"--export-qdq needs ONNX opset {MIN_OPSET} or later (per-channel DequantizeLinear); "
                         f"the model is opset {opset}: re-export it at opset {MIN_OPSET} or later")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    by_weight = {node.input[1]: node for node in graph.node
                 if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1}
    initializers = {t.name: i for i, t in enumerate(graph.initializer)}
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {o for n in graph.node for o in n.output}

    def fresh(name: str) -> str:
        candidate, n = name, 1
        while candidate in taken:
            n += 1
            candidate = f"{name}_{n}"
        taken.add(candidate)
        return candidate

    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # node index -> nodes to put before it
    after_nodes: dict[int, list[onnx.NodeProto]] = {}  # node index -> nodes to put right after it
    index = {id(node): i for i, node in enumerate(graph.node)}
    activations: dict[tuple[str, float], str] = {}
    divided: dict[tuple[str, bytes], str] = {}
    for layer in layers:
        if layer.precision != "int8" or layer.activation == "per-token":
            continue
        node = by_weight.get(layer.weight)
        if node is None or layer.weight not in initializers:
            raise ModelError(f"--export-qdq: layer {layer.name} has no {layer.op_type} node reading the initializer "
                             f"{layer.weight} in the model; this model cannot be exported as QDQ")
        before = new_nodes.setdefault(index[id(node)], [])
        scale = float(np.float32(activation_scales[layer.name]))
        source = node.input[0]
        weight = numpy_helper.to_array(graph.initializer[initializers[layer.weight]])
        s = smoothing.get(layer.weight)
        if s is not None:  # a depthwise layer's input per channel: x / s in front, W * s (smooth.smooth)
            weight = (weight * s.reshape(-1, 1, 1, 1)).astype(weight.dtype)
            key = (source, s.tobytes())
            if key not in divided:
                stem = fresh(f"{source}_smoothed")
                inverse = fresh(f"{stem}_inverse")
                graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32).reshape(1, -1, 1, 1), inverse))
                before.append(helper.make_node("Mul", [source, inverse], [stem], name=fresh(f"{stem}_Mul")))
                divided[key] = stem
            source = divided[key]
        key = (source, scale)
        if key not in activations:
            stem = fresh(f"{source}_qdq")
            s_name, z_name, q_name, dq_name = fresh(f"{stem}_scale"), fresh(f"{stem}_zero_point"), fresh(f"{stem}_q"), stem
            graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), s_name),
                                      numpy_helper.from_array(np.array(0, np.int8), z_name)])
            before += [helper.make_node("QuantizeLinear", [source, s_name, z_name], [q_name], name=fresh(f"{stem}_QuantizeLinear")),
                       helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_name],
                                        name=fresh(f"{stem}_DequantizeLinear"))]
            activations[key] = dq_name
        node.input[0] = activations[key]
        # the weight: int8 with per-channel scales, as the bundle holds it
        q, w_scale = quantize_weight(weight, layer.channel_axis)
        w_q, w_s, w_z, w_dq = (fresh(f"{layer.weight}_{suffix}") for suffix in ("quantized", "scale", "zero_point", "dequantized"))
        graph.initializer[initializers[layer.weight]].CopyFrom(numpy_helper.from_array(q, w_q))
        graph.initializer.extend([numpy_helper.from_array(w_scale.astype(np.float32), w_s),
                                  numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), w_z)])
        before.append(helper.make_node("DequantizeLinear", [w_q, w_s, w_z], [w_dq], axis=layer.channel_axis,
                                       name=fresh(f"{layer.weight}_DequantizeLinear")))
        node.input[1] = w_dq
        c = corrections.get(layer.weight)
        if c is not None:
            _add_correction(graph, node, c.astype(np.float32), initializers, fresh,
                            after_nodes.setdefault(index[id(node)], []))
    nodes = []
    for i, node in enumerate(graph.node):
        nodes += new_nodes.get(i, [])
        nodes.append(node)
        nodes += after_nodes.get(i, [])
    del graph.node[:]
    graph.node.extend(nodes)
    # an initializer also listed as a graph input (old exporters) would shadow nothing now: drop stale entries
    kept = {t.name for t in graph.initializer}
    stale = [v for v in graph.input if v.name not in kept and v.name in {l.weight for l in layers}]
    for v in stale:
        graph.input.remove(v)
    out.producer_name, out.producer_version = "edgeq --export-qdq", out.producer_version or ""
    onnx.checker.check_model(out, full_check=False)
    return out


def _add_correction(graph, node, c: np.ndarray, initializers: dict[str, int], fresh, after: list) -> None:
    """Add ``c`` (per output channel) to ``node``'s output: into its bias (Conv, Gemm: a constant bias, or a new
    one), else as an Add after it (MatMul, a computed bias; ``after``: the nodes that go right after ``node``)."""
    name = fresh(f"{node.name or node.op_type}_bias_corrected")
    bias = node.input[2] if node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2] else None
    beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0) if node.op_type == "Gemm" else 1.0
    if node.op_type in ("Conv", "Gemm") and beta != 0 and (bias is None or bias in initializers):
        c = c / np.float32(beta)  # Gemm adds beta * C
        if bias is not None:  # its own shape ([N], or Gemm's [1, N])
            c = numpy_helper.to_array(graph.initializer[initializers[bias]]) + c
        graph.initializer.append(numpy_helper.from_array(c.astype(np.float32), name))
        if bias is not None:
            node.input[2] = name
        else:
            node.input.append(name)
        return
    output = fresh(f"{name}_output")
    graph.initializer.append(numpy_helper.from_array(c, name))
    after.append(helper.make_node("Add", [output, name], [node.output[0]], name=fresh(f"{name}_Add")))
    node.output[0] = output


def write(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path`` atomically (a temporary file beside it, renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        onnx.save(model, tmp)
        os.replace(tmp, path)
    except (OSError, ValueError) as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {getattr(err, 'strerror', None) or err}") from None
