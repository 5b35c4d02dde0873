"""The CUDA graph made ready for CUTLASS: NHWC with OHWI weights, channels padded, linear layers as 1x1
convolutions, a transformer's projections as one, and int8 quantize/dequantize as the element-wise operators
they compute (``prepare_nhwc``). Plain Relax: it builds for any target.
"""

from __future__ import annotations

import numpy as np

from edgeq.backends.cuda.cutlass.kernels import DEPTHWISE_LANES
from edgeq.backends.cuda.cutlass.match import last_axis_slice, only_reader_of
from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, alignment


def prepare_nhwc(graph):
    """The CUDA graph for CUTLASS: every convolution NHWC with OHWI weights (Relax's ConvertLayout, which carries
    NHWC through the element-wise operators between them: one transpose at each end), the weights' transposes
    done now, and input channels that are not a multiple of the kernel's alignment (``alignment``) padded (zero
    weights, and the activation padded with zeros by a pad before the convolution; int8 channels that are a
    multiple of 8 are not: their kernel loads 8 at a time). int8: quantize/dequantize
    with zero points of 0 written as the element-wise operators they compute (ConvertLayout carries NHWC through
    those, not through their axis), and a convolution's two int32 bias adds (the bias and its correction) made
    one. Plain Relax: it builds for any target, so the golden outputs check this layout and padding on the build
    host."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of, fresh_name, precompute_weight_ops
    from edgeq.tvm_env import relax

    # clips as maximum/minimum of a scalar constant first: ConvertLayout carries NHWC through those, not through
    # relax.clip or the TIR calls ONNX Clip with weight bounds imports as
    graph = rewrite(graph, _clip_as_max_min)
    graph = rewrite(graph, _qdq_as_elementwise)
    mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(graph.mod)
    mod = relax.transform.FoldConstant()(mod)  # the transposes of per-channel scales
    graph = precompute_weight_ops(type(graph)(mod, graph.weights))
    graph = rewrite(graph, _one_int32_bias)
    graph = rewrite(graph, _one_scale)
    int8 = any(dtype_of(b.var) == "int8" for b in graph.bindings())
    graph = _int8_projections_as_one(graph) if int8 else _projections_as_one(graph)
    graph = rewrite(graph, _matmul_as_conv)
    graph = rewrite(graph, _depthwise_hwoi)
    if int8:
        graph = rewrite(graph, _float_attention_in_fp16)
        graph = _fp16_before_head_split(graph)
        graph = _float32_after_head_merge(graph)

    def visit(rw, var, value):
        if call_op(value) != "relax.nn.conv2d" or value.attrs.data_layout != "NHWC" or int(value.attrs.groups) != 1:
            return None
        w = rw.weight(value.args[1])
        align = alignment(dtype_of(value.args[0]) or "float16")
        # int8 channels that are a multiple of 8 take 64-bit loads instead (ConvKernel.input_alignment): no pad
        if w is None or w.ndim != 4 or w.shape[3] % align == 0 or w.shape[3] % ALIGNMENT == 0 or w.shape[3] < 3:
            return None
        extra = -w.shape[3] % align
        padded_w = rw.param(fresh_name(rw, f"{value.args[1].name}_c{w.shape[3] + extra}"),
                            np.pad(w, ((0, 0), (0, 0), (0, 0), (0, extra))))
        x = rw.emit(relax.op.nn.pad(rw.new(value.args[0]), [0, 0, 0, 0, 0, 0, 0, extra]))
        return relax.Call(value.op, [x, padded_w], value.attrs)

    return rewrite(graph, visit)


def _depthwise_hwoi(rw, var, value):
    """A depthwise convolution (NHWC, groups = input channels = output channels, a multiple of DEPTHWISE_LANES) with
    its OHWI weights [K, R, S, 1] as HWOI [R, S, K, 1], done now: the channels a depthwise kernel's thread reads for
    one tap are then consecutive. Relax legalizes either layout, so the graph still builds for any target."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.nn.conv2d":
        return None
    attrs = value.attrs
    groups = int(attrs.groups)
    w = rw.weight(value.args[1])
    xs = shape_of(value.args[0])
    if attrs.data_layout != "NHWC" or attrs.kernel_layout != "OHWI" or groups == 1 or w is None or xs is None:
        return None
    if w.ndim != 4 or w.shape[3] != 1 or w.shape[0] != groups or xs[3] != groups or groups % DEPTHWISE_LANES:
        return None
    hwoi = rw.param(fresh_name(rw, f"{value.args[1].name}_hwoi"), np.ascontiguousarray(np.transpose(w, (1, 2, 0, 3))))
    return relax.op.nn.conv2d(rw.new(value.args[0]), hwoi, strides=attrs.strides, padding=attrs.padding,
                              dilation=attrs.dilation, groups=groups, data_layout="NHWC", kernel_layout="HWOI",
                              out_layout=attrs.out_layout, out_dtype=attrs.out_dtype)


def _matmul_as_conv(rw, var, value):
    """A matrix product by a weight, ``matmul(x [..., K], W [K, N])`` (Gemm's ``transB`` seen through), as the 1x1
    convolution it is: ``reshape(conv2d(reshape(x, [1, 1, M, K]), W^T as OHWI [N, 1, 1, K]), [..., N])`` with M the
    product of x's other axes. Both reshapes are views; ``find_convs`` sees through the second, so a linear layer
    and its epilogue go to the CUTLASS convolution kernel (an implicit GEMM of M x N x K). Left as it is where N
    is not a multiple of 8 (the kernel's output alignment) or x's shape is not static."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, fresh_name, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.matmul":
        return None
    w_var, transposed = rw.weight_operand(value)
    w = rw.weight(w_var) if w_var is not None else None
    x = value.args[0]
    xs, out_dtype = shape_of(x), dtype_of(var)
    if w is None or w.ndim != 2 or xs is None or len(xs) < 2 or out_dtype is None:
        return None
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if xs[-1] != k or n % ALIGNMENT or dtype_of(x) not in ("float32", "float16", "int8"):
        return None
    ohwi = np.ascontiguousarray(w if transposed else w.T).reshape(n, 1, 1, k)
    m = int(np.prod(xs[:-1]))
    flat = rw.emit(relax.op.reshape(rw.new(x), [1, 1, m, k]))
    conv = rw.emit(relax.op.nn.conv2d(flat, rw.param(fresh_name(rw, f"{w_var.name}_ohwi"), ohwi),
                                      data_layout="NHWC", kernel_layout="OHWI", out_dtype=out_dtype))
    return relax.op.reshape(conv, [*xs[:-1], n])


def _into_attention(out, value_of, only_reader, is_weight) -> bool:
    """Is ``out`` read only through a head split into attention's products: reshape to [1, S, H, D], transpose,
    matrix product of two activations (its second operand not what ``is_weight`` says is a weight)?"""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    split = only_reader(out)
    turn = only_reader(split) if split is not None else None
    product = only_reader(turn) if turn is not None else None
    shape = shape_of(split) if split is not None else None
    return (call_op(value_of.get(split)) == "relax.reshape" and shape is not None and len(shape) == 4
            and call_op(value_of.get(turn)) == "relax.permute_dims"
            and call_op(value_of.get(product)) == "relax.matmul" and not is_weight(value_of[product].args[1]))


def _as_one(graph, groups: dict, emit_wide):
    """``graph`` with each group of projections computed as one: ``groups`` maps a key (what the projections
    share) to its members, ``(the projection's last var, its width, ...)`` in binding order; at the first member,
    ``emit_wide(rw, key, members)`` emits the wide tensor, and each member becomes a slice of its last axis."""
    from edgeq.graph import rewrite
    from edgeq.graph_passes import shape_of
    from edgeq.tvm_env import relax

    groups = {key: members for key, members in groups.items() if len(members) > 1}
    if not groups:
        return graph
    part_of = {m[0]: (key, i) for key, members in groups.items() for i, m in enumerate(members)}
    merged: dict = {}

    def visit(rw, var, value):
        if var not in part_of:
            return None
        key, i = part_of[var]
        members = groups[key]
        if key not in merged:
            merged[key] = emit_wide(rw, key, members)
        first = sum(m[1] for m in members[:i])
        axis = len(shape_of(var)) - 1
        return relax.op.strided_slice(merged[key], [axis], [first], [first + members[i][1]])

    return rewrite(graph, visit)


def _projections_as_one(graph):
    """The projections of one tensor that feed attention's products, ``matmul(x, W_i) + b_i`` each read through a
    head split (reshape to [1, S, H, D], transpose, matrix product: Q, K and V of a transformer's layer), as one
    ``matmul(x, [W_1 .. W_n]) + [b_1 .. b_n]`` and a slice of its last axis per projection (TensorRT's fused QKV):
    one GEMM of n x the width instead of n launches, each product's output element the same dot product. The
    batched GEMMs read their heads from the wide tensor in place (``_head_view``), so the slices cost nothing.
    Float graphs (an int8 graph's per-token projections: ``_int8_projections_as_one``)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, fresh_name, shape_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    weights = {p: graph.weights[p.name] for p in graph.weight_params}

    def weight_of(expr):  # (W as [K, N], its parameter) of a matmul's second operand, or None
        if expr in weights:
            return weights[expr], expr
        inner = value_of.get(expr)
        if call_op(inner) == "relax.permute_dims" and inner.args[0] in weights and weights[inner.args[0]].ndim == 2:
            return weights[inner.args[0]].T, inner.args[0]
        return None

    groups: dict = {}
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.matmul" or dtype_of(b.var) != "float32":
            continue
        x, found = value.args[0], weight_of(value.args[1])
        add = only_reader(b.var)
        if found is None or found[0].ndim != 2 or found[0].dtype != np.float32 or found[0].shape[1] % ALIGNMENT \
                or call_op(value_of.get(add)) != "relax.add" or shape_of(x) is None:
            continue
        bias = [a for a in value_of[add].args if not a.same_as(b.var)]
        if len(bias) != 1 or bias[0] not in weights or weights[bias[0]].shape != (found[0].shape[1],) \
                or not _into_attention(add, value_of, only_reader, lambda e: weight_of(e) is not None):
            continue
        groups.setdefault(x, []).append((add, found[0].shape[1], found[0], weights[bias[0]], found[1].name))

    def emit_wide(rw, x, members):
        name = "_".join(m[4] for m in members)
        w = rw.param(fresh_name(rw, f"{name}_as_one"), np.concatenate([m[2] for m in members], axis=1))
        bias = rw.param(fresh_name(rw, f"{name}_bias_as_one"), np.concatenate([m[3] for m in members]))
        return rw.emit(relax.op.add(rw.emit(relax.op.matmul(rw.new(x), w)), bias))

    return _as_one(graph, groups, emit_wide)


def _int8_projections_as_one(graph):
    """``_projections_as_one`` for an int8 graph's per-token projections (``quantize_ops``): ``matmul(xq, W_i int8,
    int32) -> float32 -> * s_i (the weight's per-channel scale) -> * rows (the tokens' scales) -> + b_i``, each read
    through a head split into attention's products, with xq and rows shared (Q, K and V of a layer read one
    quantized input): one ``matmul(xq, [W_1 .. W_n])`` with ``[s_1 .. s_n]`` and ``[b_1 .. b_n]``, and a slice of its
    last axis per projection. Every output element goes through the same operations: bit for bit."""
    from edgeq.graph import call_op, const_value
    from edgeq.graph_passes import dtype_of, fresh_name
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    weights = {p: graph.weights[p.name] for p in graph.weight_params}

    def op_of(var):
        return call_op(value_of.get(var)) if var is not None else None

    def other(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    groups: dict = {}
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.matmul" or dtype_of(b.var) != "int32" or value.args[1] not in weights:
            continue
        w = weights[value.args[1]]
        cast = only_reader(b.var)
        if w.ndim != 2 or w.dtype != np.int8 or w.shape[1] % ALIGNMENT or op_of(cast) != "relax.astype" \
                or dtype_of(cast) != "float32":
            continue
        scaled = only_reader(cast)
        s = const_value(other(scaled, cast)) if op_of(scaled) == "relax.multiply" else None
        if s is None or s.dtype != np.float32 or s.size != w.shape[1] or (s.ndim and s.shape[-1] != w.shape[1]):
            continue
        by_rows = only_reader(scaled)
        rows = other(by_rows, scaled) if op_of(by_rows) == "relax.multiply" else None
        add = only_reader(by_rows) if rows is not None else None
        bias = other(add, by_rows) if op_of(add) == "relax.add" else None
        if not isinstance(rows, relax.Var) or rows in weights or bias not in weights \
                or weights[bias].shape != (w.shape[1],) or not _into_attention(add, value_of, only_reader, weights.__contains__):
            continue
        groups.setdefault((value.args[0], rows), []).append(
            (add, w.shape[1], w, s.reshape(-1), weights[bias], value.args[1].name))

    def emit_wide(rw, key, members):
        x, rows = key
        name = "_".join(m[5] for m in members)
        w = rw.param(fresh_name(rw, f"{name}_as_one"), np.concatenate([m[2] for m in members], axis=1))
        acc = rw.emit(relax.op.matmul(rw.new(x), w, out_dtype="int32"))
        scaled = rw.emit(relax.op.multiply(rw.emit(relax.op.astype(acc, "float32")),
                                           rw.const(np.concatenate([m[3] for m in members]))))
        bias = rw.param(fresh_name(rw, f"{name}_bias_as_one"), np.concatenate([m[4] for m in members]))
        return rw.emit(relax.op.add(rw.emit(relax.op.multiply(scaled, rw.new(rows))), bias))

    return _as_one(graph, groups, emit_wide)


def _fp16_before_head_split(graph):
    """In an int8 graph, attention's fp16 operands cast after the head split, ``astype(permute_dims(reshape(
    strided_slice(T))), fp16)`` (``_float_attention_in_fp16``; T the float32 output of the projections computed as one,
    ``_int8_projections_as_one``), cast before it: ``permute_dims(reshape(strided_slice(astype(T, fp16))))``, one cast
    of T for all its slices. The cast then fuses into the kernel that makes T, which writes fp16, and the batched
    GEMMs read their heads from it in place (``_head_view``), as in an fp16 graph. Exact (a cast commutes with moving
    values). Only where every reader of T is such a chain."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    readers = graph.readers()
    only_reader = only_reader_of(readers)

    def chain(var):
        """[slice, reshape, permute, cast] from a reader of T, or None."""
        out = [var]
        for op in ("relax.reshape", "relax.permute_dims", "relax.astype"):
            nxt = only_reader(out[-1])
            if call_op(value_of.get(nxt)) != op:
                return None
            out.append(nxt)
        return out if dtype_of(out[-1]) == "float16" else None

    cast_of: dict = {}  # T -> its chains
    for b in bindings:
        if dtype_of(b.var) != "float32" or shape_of(b.var) is None or len(shape_of(b.var)) != 3:
            continue
        found = []
        for r in readers.get(b.var, []):
            c = chain(r) if r is not None and last_axis_slice(r, value_of) is not None else None
            if c is None:
                found = []
                break
            found.append(c)
        if len(found) > 1:
            cast_of[b.var] = found
    if not cast_of:
        return graph
    moved = {c[i]: (t, i) for t, chains in cast_of.items() for c in chains for i in range(4)}
    halves: dict = {}

    def visit(rw, var, value):
        if var in cast_of:
            out = rw.emit(rw.new(value))
            halves[var] = rw.emit(relax.op.astype(out, "float16"))
            return out
        if var not in moved:
            return None
        t, i = moved[var]
        if i == 0:  # the slice, of the fp16 T
            return relax.Call(value.op, [halves[t], *value.args[1:]], value.attrs)
        if i == 3:  # the cast: its input is fp16 already
            return rw.new(value.args[0])
        return None

    return rewrite(graph, visit)


def _float32_after_head_merge(graph):
    """In an int8 graph, attention's context cast to float32 before its heads are merged, ``reshape(permute_dims(
    astype(c, float32), [0, 2, 1, 3]))`` with c the fp16 product P V (``_float_attention_in_fp16``), cast after:
    ``astype(reshape(permute_dims(c)), float32)``. The batched GEMM then writes the heads merged in place
    (``_head_view``, as in an fp16 graph), and the cast fuses into the per-token quantize that reads it (the token
    scales read the fp16 context themselves: ``pipeline.row_scales_in_one_kernel``). Exact."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    found: dict = {}  # the cast -> the reshape after its permute
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.astype" or dtype_of(b.var) != "float32" or dtype_of(value.args[0]) != "float16":
            continue
        turn = only_reader(b.var)
        merge = only_reader(turn) if turn is not None else None
        if call_op(value_of.get(turn)) != "relax.permute_dims" or call_op(value_of.get(merge)) != "relax.reshape" \
                or value_of[turn].attrs.axes is None \
                or tuple(int(a) for a in value_of[turn].attrs.axes) != (0, 2, 1, 3):
            continue
        found[b.var] = merge
    if not found:
        return graph
    merges = set(found.values())

    def visit(rw, var, value):
        if var in found:  # the cast: the fp16 product, until the merge (the permute reads it as it is)
            return rw.new(value.args[0])
        if var in merges:
            return relax.op.astype(rw.emit(rw.new(value)), "float32")
        return None

    return rewrite(graph, visit)


def _float_attention_in_fp16(rw, var, value):
    """In an int8 graph, a float32 product of two activations (attention's Q K^T and P V, which the quantizer keeps
    in float) in fp16 with fp32 accumulation, as TensorRT runs the layers an int8 engine leaves in float: ``float32(
    fp16(matmul(fp16(a), fp16(b), fp32 out)))``, the batched GEMM ``find_convs`` claims (of any alignment: a
    window's 49 tokens load one element at a time). Where the batch axes differ, the product stays as it is."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.matmul" or rw.weight_operand(value)[0] is not None:
        return None
    a, b = value.args
    sa, sb = shape_of(a), shape_of(b)
    if dtype_of(var) != "float32" or dtype_of(a) != "float32" or dtype_of(b) != "float32" or sa is None or sb is None:
        return None
    if len(sa) != len(sb) or len(sa) < 2 or tuple(sa[:-2]) != tuple(sb[:-2]):
        return None
    a16 = rw.emit(relax.op.astype(rw.new(a), "float16"))
    b16 = rw.emit(relax.op.astype(rw.new(b), "float16"))
    product = rw.emit(relax.op.matmul(a16, b16, out_dtype="float32"))
    return relax.op.astype(rw.emit(relax.op.astype(product, "float16")), "float32")


def _qdq_as_elementwise(rw, var, value):
    """int8 quantize/dequantize with a constant scale and zero points of 0 as what TVM legalizes them to:
    ``int8(clamp(round(x / s), -128, 127))`` and ``float32(q) * s`` (a per-channel scale along its axis)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of
    from edgeq.tvm_env import relax

    op = call_op(value)
    if op not in ("relax.quantize", "relax.dequantize"):
        return None
    x, scale, zp = value.args
    s, z = rw.static_value(scale), rw.static_value(zp)
    shape = shape_of(x)
    if s is None or z is None or np.any(z != 0) or shape is None:
        return None
    if s.size > 1:
        bshape = [1] * len(shape)
        bshape[int(value.attrs.axis) % len(shape)] = s.size
        s = s.reshape(bshape)
    else:
        s = s.reshape(())
    s_const = relax.const(np.asarray(s, np.float32), "float32")
    if op == "relax.dequantize":
        if str(value.attrs.out_dtype) != "float32":
            return None
        return relax.op.multiply(rw.emit(relax.op.astype(rw.new(x), "float32")), s_const)
    if str(value.attrs.out_dtype) != "int8" or s.size != 1:
        return None
    v = rw.emit(relax.op.round(rw.emit(relax.op.divide(rw.new(x), s_const))))
    v = rw.emit(relax.op.minimum(rw.emit(relax.op.maximum(v, relax.const(-128.0, "float32"))),
                                 relax.const(127.0, "float32")))
    return relax.op.astype(v, "int8")


def _one_scale(rw, var, value):
    """``(x * a) * b`` with float32 per-channel constants or weights ``a`` and ``b`` (a dequantize's scale and a
    BatchNorm's, which edgeq folds after quantization) as ``x * (a * b)``, for an int8 convolution's epilogue."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.multiply" or not isinstance(value.args[0], relax.Var):
        return None
    inner = rw.value(value.args[0])
    b = rw.static_value(value.args[1])
    if call_op(inner) != "relax.multiply" or b is None or b.dtype != np.float32 or rw.uses(value.args[0]) != 1:
        return None
    a = rw.static_value(inner.args[1])
    if a is None or a.dtype != np.float32 or call_op(rw.value(inner.args[0])) != "relax.astype":
        return None
    try:
        merged = np.multiply(a, b, dtype=np.float32)
    except ValueError:
        return None
    if merged.ndim > 4 or merged.size != max(a.size, b.size):
        return None
    return relax.op.multiply(rw.new(inner.args[0]), rw.param(fresh_name(rw, "requant_scale"), merged))


def _one_int32_bias(rw, var, value):
    """``(x + a) + b`` with int32 weights ``a`` and ``b`` of one shape (a convolution's bias correction and its
    bias) as ``x + (a + b)``."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.add" or not isinstance(value.args[0], relax.Var):
        return None
    inner = rw.value(value.args[0])
    b = rw.weight(value.args[1])
    if call_op(inner) != "relax.add" or b is None or b.dtype != np.int32 or rw.uses(value.args[0]) != 1:
        return None
    a = rw.weight(inner.args[1])
    if a is None or a.dtype != np.int32 or a.shape != b.shape:
        return None
    merged = rw.param(fresh_name(rw, f"{value.args[1].name}_merged"), (a.astype(np.int64) + b).astype(np.int32))
    return relax.op.add(rw.new(inner.args[0]), merged)


def _clip_as_max_min(rw, var, value):
    """relax.clip with immediate bounds, and TIR maximum/minimum calls with a one-element static bound, as
    ``relax.maximum``/``relax.minimum`` of a 0-d constant (the same values)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of
    from edgeq.tvm_env import relax, tvm

    op = call_op(value)
    if op == "relax.clip" and all(isinstance(a, (tvm.tirx.IntImm, tvm.tirx.FloatImm)) for a in value.args[1:]):
        dtype = dtype_of(value.args[0]) or "float32"
        low, high = (relax.const(float(a.value), dtype) for a in value.args[1:])
        return relax.op.minimum(rw.emit(relax.op.maximum(rw.new(value.args[0]), low)), high)
    if op != "relax.call_tir" or not isinstance(value.args[1], relax.Tuple) or len(value.args[1].fields) != 2:
        return None
    name = value.args[0].name_hint
    tir_op = relax.op.maximum if name.startswith("maximum") else relax.op.minimum if name.startswith("minimum") else None
    bound = rw.static_value(value.args[1].fields[1])
    if tir_op is None or bound is None or bound.size != 1:
        return None
    dtype = dtype_of(value.args[1].fields[0]) or "float32"
    return tir_op(rw.new(value.args[1].fields[0]), relax.const(np.asarray(bound, dtype).reshape(()), dtype))
