"""A decoder LLM's ONNX graph: what it is (``read_layout``) and its two static steps (``specialize``).

The input is the form Optimum's ``text-generation-with-past`` export and ``torch.onnx`` give: ``input_ids``,
``attention_mask``, ``position_ids`` and ``past_key_values.N.key|value`` in, ``logits`` and
``present.N.key|value`` out, the lengths symbolic. Its shape arithmetic (the causal mask, the cache position)
is computed from those lengths, which TVM's importer cannot compile while they are symbolic. So each step is
specialized to fixed lengths and folded (``edgeq.fold``), and the cache is made a fixed-size buffer:

- **prefill** (prompt bucket ``S``): no past. Each ``Concat(past, new)`` becomes ``new``, and each ``present``
  output becomes ``cache.N.key|value``: the new keys padded to the cache's ``context`` slots. The hidden
  state of one row (input ``last``) goes to the LM head, so the logits are ``1 x 1 x vocab``, not ``S`` rows.
- **decode** (one token): the past is the whole cache (``context`` slots) and the new token sits after it, at
  index ``context`` of the concatenation, which is where the exported causal mask lets a single query see
  every key. The attention mask marks the slots in use (``0 .. position-1``) and the last index; attention
  does not depend on the order of the keys, whose positions RoPE has already written into them. The output
  cache is the input cache with the new key written into slot ``position`` (a ``Where`` on the slot index,
  which the CPU build makes a store into the input cache: ``backends/cpu/attention.cache_write_pass``).

Both steps have static shapes and the same cache shape, so the loader passes each step's cache to the next.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeq.errors import ModelError

PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
PRESENT = re.compile(r"present\.(\d+)\.(key|value)")
# ONNX Runtime GenAI's model builder writes these; TVM has no converter for them
CONTRIB = {
    "GroupQueryAttention": "attention",
    "MultiHeadAttention": "attention",
    "RotaryEmbedding": "rotary embedding",
    "SimplifiedLayerNormalization": "RMS norm",
    "SkipSimplifiedLayerNormalization": "RMS norm",
    "SkipLayerNormalization": "layer norm",
}
STANDARD_EXPORT = ("export with standard ops instead: optimum-cli export onnx --task text-generation-with-past, "
                   "or torch.onnx.export of the Hugging Face model")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the loader and the build need to know of a decoder."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    cache_dtype: str
    ids_dtype: str  # input_ids and position_ids
    mask_dtype: str | None  # attention_mask's, None where the model has none

    def cache_names(self) -> list[str]:
        return [f"cache.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value.type.tensor_type.shape.dim]


def _dtype(value: onnx.ValueInfoProto) -> str:
    return str(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def is_decoder(model: onnx.ModelProto) -> bool:
    """A graph with ``past_key_values.*`` inputs: a decoder with a KV cache."""
    return any(PAST.fullmatch(i.name) for i in model.graph.input)


def is_decoder_file(path) -> bool:
    """``is_decoder`` of an ONNX file, reading its graph's inputs only (False where it cannot be read: the normal
    load says why)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable: the image path's load reports it in its words
        return False
    return is_decoder(model)


def read_layout(model: onnx.ModelProto, name: str = "model") -> Layout:
    """The decoder's layout, or a one-line ModelError naming what does not fit."""
    graph = model.graph
    for node in graph.node:
        if node.domain == "com.microsoft" and node.op_type in CONTRIB:
            raise ModelError(f"{name} uses ONNX Runtime's {node.op_type} ({CONTRIB[node.op_type]}), which edgeq "
                             f"cannot import; {STANDARD_EXPORT}")
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    if "input_ids" not in inputs:
        raise ModelError(f"{name} has past_key_values inputs but no input_ids; edgeq takes a decoder that reads "
                         f"token ids ({STANDARD_EXPORT})")
    if "position_ids" not in inputs:
        raise ModelError(f"{name} has no position_ids input; edgeq places tokens in its KV cache by position: "
                         f"{STANDARD_EXPORT} (it writes position_ids for Llama, Qwen2, SmolLM and Phi-3)")
    if "logits" not in outputs:
        raise ModelError(f"{name} has no 'logits' output; {STANDARD_EXPORT}")
    past = {PAST.fullmatch(n).groups(): v for n, v in inputs.items() if PAST.fullmatch(n)}
    present = {PRESENT.fullmatch(n).groups(): v for n, v in outputs.items() if PRESENT.fullmatch(n)}
    layers = len({layer for layer, _ in past})
    expected = {(str(i), kv) for i in range(layers) for kv in ("key", "value")}
    if set(past) != expected or set(present) != expected:
        raise ModelError(f"{name}: the past_key_values.N.key|value inputs and present.N.key|value outputs do not "
                         f"pair up for layers 0..{layers - 1}; {STANDARD_EXPORT}")
    shapes = {tuple(_dims(v)) for v in past.values()}
    dtypes = {_dtype(v) for v in past.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ModelError(f"{name}: the past_key_values inputs differ in shape or type ({sorted(map(str, shapes))}); "
                         "edgeq takes one cache shape for every layer")
    shape = next(iter(shapes))
    if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int) or isinstance(shape[2], int):
        raise ModelError(f"{name}: past_key_values has shape {list(shape)}; edgeq takes "
                         "[batch, kv_heads, past_sequence_length, head_dim] with a symbolic past length")
    vocab = _dims(outputs["logits"])[-1] if _dims(outputs["logits"]) else None
    if not isinstance(vocab, int):
        vocab = _lm_head_width(model)
    if not isinstance(vocab, int):
        raise ModelError(f"{name}: the vocabulary size is not known from the logits output's shape; "
                         "export with a static last dimension on logits")
    mask = inputs.get("attention_mask")
    return Layout(layers=layers, kv_heads=shape[1], head_dim=shape[3], vocab=vocab, cache_dtype=next(iter(dtypes)),
                  ids_dtype=_dtype(inputs["input_ids"]), mask_dtype=_dtype(mask) if mask is not None else None)


GROUP = 32  # the int4 products' group along the reduction (edgeq.backends.cpu.decoder.GROUP)


def expand_matmul_nbits(model: onnx.ModelProto, name: str = "model") -> dict:
    """Each of ONNX Runtime's ``com.microsoft.MatMulNBits`` in ``model`` (4 bits, constant codes, scales and zero
    points) made, in place, a ``MatMul`` by its dequantized float32 weight ``w[k, n] = (q - zp) * scale`` (ORT's
    definition). Returns the weights' own codes: {weight name: (codes ``q[K, N]`` uint8, scales ``[K / 32, N]``,
    minimums ``[K / 32, N]`` = ``-zp * scale``)}, for the int4 build to use as they are (blocks of 32 or a multiple
    of 32; scales and minimums float16 where float16 holds them exactly, else float32). A MatMulNBits edgeq cannot
    take gets one line."""
    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    codes, used, nodes, made = {}, set(), [], set()
    for node in graph.node:
        if not (node.op_type == "MatMulNBits" and node.domain == "com.microsoft"):
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs.get("K"), attrs.get("N"), attrs.get("bits", 4), attrs.get("block_size")
        inputs = list(node.input) + [""] * (6 - len(node.input))
        a, b, scales_name, zp_name, g_idx, bias = inputs[:6]
        missing = [x for x in (b, scales_name, zp_name, bias) if x and x not in consts]
        if bits != 4 or not block or k is None or n is None or missing or g_idx:
            why = (f"bits={bits}" if bits != 4 else "weights computed in the graph" if missing
                   else "g_idx" if g_idx else "no K, N or block_size")
            raise ModelError(f"{name}: MatMulNBits {node.name or node.output[0]} ({why}) cannot be imported; edgeq "
                             f"reads 4-bit MatMulNBits with constant weights, as ONNX Runtime GenAI's builder "
                             f"and matmul_4bits_quantizer write them")
        blocks = -(-k // block)
        packed = numpy_helper.to_array(consts[b]).reshape(n, blocks, block // 2)
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks * block)[:, :k]  # low nibble first
        scale = numpy_helper.to_array(consts[scales_name]).reshape(n, blocks)
        if not zp_name:
            zp = np.full((n, blocks), 8, np.float32)
        elif consts[zp_name].data_type == TensorProto.UINT8:
            zpp = numpy_helper.to_array(consts[zp_name]).reshape(n, -1)
            zp = np.stack([zpp & 15, zpp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
        else:
            zp = numpy_helper.to_array(consts[zp_name]).reshape(n, blocks).astype(np.float32)
        per = np.repeat(np.arange(blocks), block)[:k]
        w = ((q.astype(np.float32) - zp[:, per]) * scale.astype(np.float32)[:, per]).T  # [K, N]
        weight = re.sub(r"\W", "_", b) + "_dequantized"  # a C identifier: the name the build's weight keeps
        while weight in consts or weight in made:
            weight += "_"
        made.add(weight)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w, dtype=np.float32), weight))
        used |= {x for x in (b, scales_name, zp_name) if x}
        if block % GROUP == 0 and k % GROUP == 0 and np.array_equal(zp, np.round(zp)):
            group = np.repeat(np.arange(blocks), block // GROUP)[: k // GROUP]
            s32, zp32 = scale.astype(np.float32)[:, group].T, zp[:, group].T
            lowest = -zp32 * s32
            exact = all(np.array_equal(v.astype(np.float16).astype(np.float32), v) for v in (s32, lowest))
            dtype = np.float16 if exact else np.float32
            codes[weight] = (np.ascontiguousarray(q.T.astype(np.uint8)), s32.astype(dtype), lowest.astype(dtype))
        out = node.output[0]
        product = out if not bias else f"{out}_before_bias"
        nodes.append(helper.make_node("MatMul", [a, weight], [product], name=(node.name or out) + "_matmul"))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [out], name=(node.name or out) + "_bias"))
    if not made:
        return codes
    del graph.node[:]
    graph.node.extend(nodes)
    still = {x for node in graph.node for x in node.input}
    kept = [t for t in graph.initializer if t.name not in used or t.name in still]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return codes


def _lm_head_width(model: onnx.ModelProto) -> int | None:
    producer = _producer(model.graph, "logits")
    weights = {t.name: t for t in model.graph.initializer}
    if producer is not None and producer.op_type == "MatMul" and producer.input[1] in weights:
        return int(weights[producer.input[1]].dims[-1])
    return None


def _producer(graph: onnx.GraphProto, name: str) -> onnx.NodeProto | None:
    """The node that makes ``name``, looking through Identity nodes."""
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(name)
    while node is not None and node.op_type == "Identity":
        node = producers.get(node.input[0])
    return node


def specialize(model: onnx.ModelProto, layout: Layout, step: str, context: int, prompt: int = 1,
               name: str = "model", detach: bool = False) -> onnx.ModelProto:
    """The ``step`` ("prefill" or "decode") of the decoder with every length fixed and the shape arithmetic
    folded: see the module's text. ``context``: cache slots; ``prompt``: prefill's bucket of prompt tokens.
    ``detach``: the weights too large to fold (``fold.MAX_FOLD_ELEMENTS``) are left out, as graph inputs after
    the step's own (an importer given their values by name; serializing them for each step is what took time)."""
    from edgeq import fold

    if step not in ("prefill", "decode"):
        raise ValueError(step)
    if step == "prefill" and not 1 <= prompt <= context:
        raise ValueError(f"prompt bucket {prompt} outside 1..{context}")
    # the weights too large to fold wait outside the graph, as typed inputs: shape inference serializes the
    # model each round (SmolLM2's 650 MB took 70 s of a 97 s import with them inside); the copy leaves them out
    large = [t for t in model.graph.initializer if int(np.prod(t.dims)) > fold.MAX_FOLD_ELEMENTS]
    large_names = {t.name for t in large}
    model = _copy_without(model, large_names)
    graph = model.graph
    seq, past = (prompt, 0) if step == "prefill" else (1, context)
    lengths = {"input_ids": [1, seq], "position_ids": [1, seq], "attention_mask": [1, past + seq]}
    for value in graph.input:
        if PAST.fullmatch(value.name):
            want = [1, layout.kv_heads, past, layout.head_dim]
        elif value.name in lengths:
            want = lengths[value.name]
        else:
            raise ModelError(f"{name} has an input '{value.name}' that edgeq does not know how to feed; a decoder "
                             "takes input_ids, attention_mask, position_ids and past_key_values.N.key|value")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(want):
            raise ModelError(f"{name}: input '{value.name}' has rank {len(dims)}, expected {len(want)}")
        for dim, size in zip(dims, want):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise ModelError(f"{name}: input '{value.name}' has a fixed size {dim.dim_value} where edgeq needs "
                                 f"{size}; export with symbolic batch and sequence lengths (dynamic axes)")
            dim.Clear()
            dim.dim_value = size
    for value in graph.output:
        value.type.tensor_type.ClearField("shape")
    del graph.value_info[:]

    def infer(m):
        return onnx.shape_inference.infer_shapes(m, data_prop=True)

    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in large)
    model, _ = fold.fold(infer(model), infer)
    graph = model.graph
    _drop_empty_concat_inputs(graph)
    _rewrite_cache(graph, layout, step, context, prompt, name)
    if step == "prefill":
        _last_row_logits(graph, layout, large_names)
    for value in graph.output:
        value.type.tensor_type.ClearField("shape")
    del graph.value_info[:]
    model = infer(model)
    model, _ = fold.fold(model, infer)
    _check_static(model, name, step)
    graph = model.graph
    used = {i for node in graph.node for i in node.input}
    inputs = [i for i in graph.input if i.name not in large_names]
    del graph.input[:]
    graph.input.extend(inputs)
    if detach:  # after the step's own inputs, in the original order
        graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in large
                           if t.name in used)
    else:
        graph.initializer.extend(t for t in large if t.name in used)
    return model


def _copy_without(model: onnx.ModelProto, initializers: set[str]) -> onnx.ModelProto:
    """A copy of ``model`` without the named initializers (which are never copied)."""
    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip="graph")
    _copy_fields(model.graph, copy.graph, skip="initializer")
    copy.graph.initializer.extend(t for t in model.graph.initializer if t.name not in initializers)
    return copy


def _copy_fields(source, target, skip: str) -> None:
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _drop_empty_concat_inputs(graph: onnx.GraphProto) -> None:
    """Concat inputs that are empty constants dropped, a Concat left with one input made an Identity: a cache
    built inside the exported function starts from an empty tensor (``transformers``' DynamicCache)."""
    empty = {t.name for t in graph.initializer if 0 in t.dims}
    for node in graph.node:
        if node.op_type == "Concat" and set(node.input) & empty:
            kept = [i for i in node.input if i not in empty]
            if kept:
                del node.input[:]
                node.input.extend(kept)
                if len(kept) == 1:
                    node.op_type = "Identity"
                    del node.attribute[:]


def _source(graph: onnx.GraphProto, name: str) -> str:
    """``name`` with Identity nodes (and one-input Concats) looked through."""
    producers = {out: node for node in graph.node for out in node.output}
    while name in producers and (producers[name].op_type == "Identity"
                                 or producers[name].op_type == "Concat" and len(producers[name].input) == 1):
        name = producers[name].input[0]
    return name


def _rewrite_cache(graph: onnx.GraphProto, layout: Layout, step: str, context: int, prompt: int, name: str) -> None:
    producers = {out: node for node in graph.node for out in node.output}
    new_nodes: list[onnx.NodeProto] = []
    if step == "decode":
        slots = numpy_helper.from_array(np.arange(context, dtype=np.int64).reshape(1, 1, context, 1), "edgeq_cache_slots")
        four = numpy_helper.from_array(np.array([1, 1, 1, 1], np.int64), "edgeq_shape_1111")
        graph.initializer.extend([slots, four])
        position = "position_ids"
        if layout.ids_dtype != "int64":
            new_nodes.append(helper.make_node("Cast", ["position_ids"], ["edgeq_position64"], to=TensorProto.INT64))
            position = "edgeq_position64"
        new_nodes += [helper.make_node("Reshape", [position, four.name], ["edgeq_position_1111"]),
                      helper.make_node("Equal", [slots.name, "edgeq_position_1111"], ["edgeq_slot_is_position"])]
    else:
        pads = numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, context - prompt, 0], np.int64), "edgeq_cache_pads")
        graph.initializer.append(pads)
    renames = {}
    for layer in range(layout.layers):
        for kv in ("key", "value"):
            past, present, cache = f"past_key_values.{layer}.{kv}", f"present.{layer}.{kv}", f"cache.{layer}.{kv}"
            concat = producers.get(present)
            while concat is not None and concat.op_type == "Identity":
                concat = producers.get(concat.input[0])
            if concat is None or concat.op_type != "Concat" or len(concat.input) != 2 \
                    or _source(graph, concat.input[0]) != past:
                raise ModelError(f"{name}: '{present}' is not Concat({past}, new entries); edgeq reads the KV cache "
                                 f"in that form ({STANDARD_EXPORT})")
            axis = next((a.i for a in concat.attribute if a.name == "axis"), None)
            if axis not in (2, -2):
                raise ModelError(f"{name}: '{present}' concatenates on axis {axis}; edgeq takes the cache as "
                                 "[batch, kv_heads, length, head_dim]")
            new = concat.input[1]
            if step == "decode":
                new_nodes.append(helper.make_node("Where", ["edgeq_slot_is_position", new, past], [cache]))
            else:
                # no past: the concatenation is the new entries, and the cache they start is padded to its slots
                concat.op_type = "Identity"
                del concat.input[:]
                concat.input.append(new)
                del concat.attribute[:]
                new_nodes.append(helper.make_node("Pad", [new, "edgeq_cache_pads"], [cache]))
            renames[present] = cache
    graph.node.extend(new_nodes)
    kept = [o for o in graph.output if o.name not in renames]
    del graph.output[:]
    graph.output.extend(kept)
    for cache in renames.values():
        graph.output.append(helper.make_tensor_value_info(cache, TensorProto.UNDEFINED, None))
    if step == "prefill":
        _drop_dead_nodes(graph)
        past_names = {i.name for i in graph.input if PAST.fullmatch(i.name)}
        users = [n.name or n.op_type for n in graph.node if set(n.input) & past_names]
        if users:
            raise ModelError(f"{name}: the past cache is read outside its concatenation (by {users[0]}); "
                             f"{STANDARD_EXPORT}")
        kept_inputs = [i for i in graph.input if i.name not in past_names]
        del graph.input[:]
        graph.input.extend(kept_inputs)
    _topological(graph)


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    while True:
        used = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
        live = [node for node in graph.node if any(o in used for o in node.output)]
        if len(live) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(live)


def _last_row_logits(graph: onnx.GraphProto, layout: Layout, detached: set[str]) -> None:
    """Prefill: the LM head reads one row of the hidden state (input ``last``), not every prompt position."""
    producer = _producer(graph, "logits")
    weights = {t.name for t in graph.initializer} | detached
    if producer is None or producer.op_type != "MatMul" or producer.input[1] not in weights:
        return
    hidden = producer.input[0]
    graph.input.append(helper.make_tensor_value_info("last", TensorProto.INT64, [1]))
    graph.node.append(helper.make_node("Gather", [hidden, "last"], ["edgeq_last_hidden"], axis=1))
    producer.input[0] = "edgeq_last_hidden"
    _topological(graph)


def _topological(graph: onnx.GraphProto) -> None:
    """Order the nodes so that each comes after the producers of its inputs (the rewrites append nodes)."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(i in known for i in node.input):
                ordered.append(node)
                known.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ModelError(f"the decoder graph has a cycle or an input nothing makes ({rest[0].input})")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def _check_static(model: onnx.ModelProto, name: str, step: str) -> None:
    for value in model.graph.output:
        shape = value.type.tensor_type.shape
        if not value.type.tensor_type.HasField("shape") or not all(d.HasField("dim_value") for d in shape.dim):
            raise ModelError(f"{name}: output '{value.name}' of the {step} step has no static shape after its "
                             "lengths are fixed; edgeq cannot compile this decoder's shape arithmetic")
