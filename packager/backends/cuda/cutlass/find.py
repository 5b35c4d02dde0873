"""Finding what the kernels take (``find_convs``): fp16 convolution chains with their epilogues, read-in-place
inputs, attention's batched GEMMs through head views; int8 chains are ``find_int8``'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.backends.cuda.cutlass.find_int8 import int8_chain
from edgeq.backends.cuda.cutlass.kernels import ConvKernel, DepthwiseKernel, GemmKernel, GroupConvKernel
from edgeq.backends.cuda.cutlass.match import (Claimed, channels_padded, const_scalar, gelu_of, is_depthwise,
    last_axis_slice, main_index, only_reader_of, output_shape, quantize_tail, same, silu_of)
from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, Conv2dProblem, GemmProblem
from edgeq.backends.cuda.cutlass.tiles import MAX_GROUP_WORK, choose_tile, gemm_tile, group_tile, split_k


def find_convs(main, sm_count: int, smem_per_block: int) -> tuple[list[Claimed], list[dict]]:
    """What the kernels take in ``main``, as ``Claimed`` chains whose intermediate values have no other reader:
    fp16 convolutions ``conv2d(NHWC, OHWI, fp32 out) -> astype fp16 -> + bias -> [+ residual] -> [activation] ->
    [astype float32]`` (CUTLASS's; grouped ones where the tensor cores gain; depthwise ones on edgeq's kernel;
    split-K where the output tiles are too few), int8 convolutions and linear layers with their requantization
    (``find_int8.int8_chain``), and attention's batched GEMMs (``_batched_gemm``); and the convolutions and
    products left out, each with why (for the manifest)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, params = main_index(main)

    only_reader = only_reader_of(readers)

    def follow(chain, k):
        """The only reader of ``chain[-1]``, past reshapes that keep K channels last (views: ``_matmul_as_conv``'s
        back to the matrix product's shape), which join the chain."""
        nxt = only_reader(chain[-1])
        while call_op(value_of.get(nxt)) == "relax.reshape" and (shape_of(nxt) or [None])[-1] == k:
            chain.append(nxt)
            nxt = only_reader(nxt)
        return nxt

    claimed, left, taken = [], [], set()
    for b in bindings:
        value = b.value
        found = None
        if call_op(value) == "relax.matmul":  # what _matmul_as_conv left a matrix product: attention's, batched
            found = _batched_gemm(b, value_of, only_reader, readers, params, sm_count, smem_per_block,
                                  f"l{len(claimed)}")
        elif call_op(value) != "relax.nn.conv2d":
            continue
        elif dtype_of(value.args[0]) == "int8":
            found = int8_chain(b, value_of, only_reader, follow, readers, params, sm_count, smem_per_block,
                                f"l{len(claimed)}", taken)
        if found is not None:
            if isinstance(found, str):
                left.append({"conv": b.var.name, "why": found})
            else:
                claimed.append(found)
                taken.update(found.chain)
            continue
        attrs = value.attrs
        why = None
        x, w = value.args
        xs, ws = shape_of(x), shape_of(w)
        depthwise = is_depthwise(attrs, xs, ws)
        groups = int(attrs.groups)
        grouped = (not depthwise and attrs.data_layout == "NHWC" and attrs.kernel_layout == "OHWI" and groups > 1
                   and xs is not None and ws is not None and xs[3] == ws[3] * groups)
        if attrs.data_layout != "NHWC" or (attrs.kernel_layout != "OHWI" or groups != 1) and not (depthwise or grouped):
            why = f"{attrs.data_layout}/{attrs.kernel_layout}, groups {groups}"
        elif dtype_of(b.var) != "float32" or dtype_of(x) != "float16":
            why = "not fp16 with fp32 accumulation"
        elif w not in params:
            why = "weights computed at run time"
        pads = [int(p) for p in attrs.padding]
        if why is None and (pads[0] != pads[2] or pads[1] != pads[3]):
            why = "asymmetric padding"
        k, kr, ks = (ws[2], ws[0], ws[1]) if depthwise else (ws[0], ws[1], ws[2]) if ws is not None else (0, 0, 0)
        if why is None and (xs is None or ws is None or (ws[3] % 2 if grouped else xs[3] % ALIGNMENT) or k % ALIGNMENT):
            why = "channels per group odd, or output channels not a multiple of 8" if grouped else \
                "channels not a multiple of 8"
        chain = [b.var]
        cast = follow(chain, k) if why is None else None
        mixed = (_float32_epilogue(chain, cast, k, value_of, only_reader, params, taken)
                 if why is None and not (depthwise or grouped) else None)
        if why is None and mixed is None and (cast is None or call_op(value_of[cast]) != "relax.astype"
                                              or str(value_of[cast].attrs.dtype) != "float16"):
            why = "no fp16 cast after it"
        if why is not None:
            left.append({"conv": b.var.name, "why": why})
            continue
        problem = Conv2dProblem(xs[0], xs[1], xs[2], xs[3], k, kr, ks, (pads[0], pads[1]),
                                tuple(int(v) for v in attrs.strides), tuple(int(d) for d in attrs.dilation),
                                c_real=xs[3] - channels_padded(x, value_of),
                                groups=k if depthwise else groups if grouped else 1)
        if mixed is not None:  # an fp16 layer of an int8 graph: float32 bias and residual, float32 out (the
            # residual added before the bias, CUTLASS's order: a float32 rounding from the graph's)
            bias, residual, chain = mixed
            kernel = ConvKernel(f"l{len(claimed)}", problem, split_k(problem, choose_tile(
                problem, sm_count, smem_per_block), sm_count), residual=True, float_out=True, float_bias=True)
            claimed.append(Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                                   {"bias": tuple(shape_of(bias)), **output_shape(chain[-1], problem)}))
            taken.update(chain)
            continue
        chain.append(cast)
        # the bias: a per-channel weight added after the cast; a convolution without one (DenseNet's, into its
        # concatenations) gets zeros, and what follows it is matched as after a bias
        add = follow(chain, k)
        bias = None
        if add is not None and call_op(value_of[add]) == "relax.add":
            other = [a for a in value_of[add].args if not a.same_as(chain[-1])]
            shape = shape_of(other[0]) if other and other[0] in params else None
            if shape is not None and int(np.prod(shape)) == k and shape[-1] == k:
                bias = other[0]
                chain.append(add)
        residual, activation = None, "identity"
        nxt = only_reader(chain[-1])
        if nxt is not None and nxt in taken:  # another chain's residual add: this output is its residual
            nxt = None
        if nxt is not None and call_op(value_of[nxt]) == "relax.add" and not grouped:  # (its epilogue's source is
            # the bias)
            other = [a for a in value_of[nxt].args if not a.same_as(chain[-1])]
            if other and shape_of(other[0]) == shape_of(chain[-1]) and dtype_of(other[0]) == "float16":
                residual = other[0]
                chain.append(nxt)
                nxt = only_reader(nxt)
        if nxt is not None and call_op(value_of[nxt]) == "relax.nn.relu":
            activation = "relu"
            chain.append(nxt)
        elif nxt is not None and call_op(value_of[nxt]) == "relax.maximum" and \
                const_scalar(value_of[nxt].args[1], value_of) == 0.0:
            activation = "relu"
            chain.append(nxt)
            after = only_reader(nxt)
            if after is not None and call_op(value_of[after]) == "relax.minimum" and \
                    const_scalar(value_of[after].args[1], value_of) == 6.0:
                activation = "relu6"
                chain.append(after)
        elif nxt is not None and call_op(value_of[nxt]) == "relax.nn.gelu" and not depthwise:
            activation = "gelu"
            chain.append(nxt)
        elif nxt is None:
            silu = silu_of(chain[-1], readers, value_of, only_reader)
            gelu = gelu_of(chain[-1], readers, value_of, only_reader) if not depthwise else None
            if silu is not None:
                activation = "silu"
                chain += silu
            elif gelu is not None:
                activation = "gelu"
                chain += gelu
        # a residual added after the activation (YOLO's bottleneck, x + SiLU(conv(x))): edgeq's epilogue
        # (``ConvKernel.residual_after``)
        residual_after = False
        after = only_reader(chain[-1]) if residual is None and activation != "identity" and not depthwise \
            and not grouped else None
        if after is not None and after not in taken and call_op(value_of[after]) == "relax.add":
            other = [a for a in value_of[after].args if not a.same_as(chain[-1])]
            if other and shape_of(other[0]) == shape_of(chain[-1]) and dtype_of(other[0]) == "float16":
                residual, residual_after = other[0], True
                chain.append(after)
        # the graph's cast of the output to float32 (a classifier's logits): the kernel writes float32 unrounded
        to_float = only_reader(chain[-1])
        float_out = (residual is None and not depthwise and not grouped and to_float is not None and to_float not in taken
                     and call_op(value_of[to_float]) == "relax.astype" and dtype_of(to_float) == "float32")
        if float_out:
            chain.append(to_float)
            # a float32 residual added to it (a transformer's residual stream, which ToMixedPrecision keeps in
            # float32): in the epilogue, whose source has the output's type. Before the bias there, after it in the
            # graph: only without an activation between them
            after = only_reader(to_float)
            if activation == "identity" and after is not None and after not in taken \
                    and call_op(value_of[after]) == "relax.add":
                other = [a for a in value_of[after].args if not a.same_as(to_float)]
                if other and shape_of(other[0]) == shape_of(to_float) and dtype_of(other[0]) == "float32":
                    residual = other[0]
                    chain.append(after)
        if grouped:
            tile = group_tile(problem, sm_count, smem_per_block)
            kernel = GroupConvKernel(f"l{len(claimed)}", problem, tile, activation) if tile else None
            if kernel is None or kernel.work > MAX_GROUP_WORK:
                why = (f"no tile takes {k // groups} output channels a group" if kernel is None else
                       f"groups of {ws[3]} channels: {kernel.work:g}x the useful work on the tensor cores (over "
                       f"{MAX_GROUP_WORK}x: zeros of the other groups)")
                left.append({"conv": b.var.name, "why": why})
                continue
        elif depthwise:
            if output_shape(chain[-1], problem):
                left.append({"conv": b.var.name, "why": "a depthwise output seen through a reshape"})
                continue
            kernel = DepthwiseKernel(f"l{len(claimed)}", problem, None, activation, residual is not None)
        else:
            tile = choose_tile(problem, sm_count, smem_per_block)
            kernel = ConvKernel(f"l{len(claimed)}", problem, tile if residual_after else split_k(problem, tile, sm_count),
                                activation, residual is not None, float_out=float_out, residual_after=residual_after)
        claimed.append(Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                               {"bias": tuple(shape_of(bias)) if bias is not None else (k,),
                                **output_shape(chain[-1], problem)}))
        taken.update(chain)
    return [_read_in_place(c, value_of) for c in claimed], left


def _float32_epilogue(chain, add, k, value_of, only_reader, params, taken) -> tuple | None:
    """Where an fp16 product with float32 out (``chain``: the conv2d and its views; an fp16 layer of an int8 graph,
    ``quantize_ops``) is read by ``add`` of a float32 bias [K] (a weight) and that by an add of a float32 residual
    of its shape (a transformer's residual stream): (the bias, the residual, the chain through both adds); else
    None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    def operand(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    if dtype_of(chain[-1]) != "float32" or add is None or add in taken or call_op(value_of[add]) != "relax.add":
        return None
    bias = operand(add, chain[-1])
    shape = shape_of(bias) if bias is not None and bias in params and dtype_of(bias) == "float32" else None
    if shape is None or int(np.prod(shape)) != k or shape[-1] != k:
        return None
    nxt = only_reader(add)
    if nxt is None or nxt in taken or call_op(value_of[nxt]) != "relax.add":
        return None
    residual = operand(nxt, add)
    if residual is None or dtype_of(residual) != "float32" or shape_of(residual) != shape_of(add) \
            or any(residual.same_as(v) for v in chain):
        return None
    return bias, residual, [*chain, add, nxt]


def _read_in_place(c: Claimed, value_of) -> Claimed:
    """A CUTLASS convolution whose input is a channel slice (``strided_slice`` on the last axis of an NHWC tensor,
    step 1; ``pipeline.splits_as_slices``) reads those channels of the wider tensor in place (``x_view``) where the
    first channel and the tensor's channels keep its loads aligned; else ``c`` as it is."""
    from edgeq.graph_passes import shape_of

    kern = c.kernel
    found = last_axis_slice(c.x, value_of) if type(kern) is ConvKernel else None
    if found is None or len(shape_of(found[0])) != 4:
        return c
    t, first, _ = found
    channels = shape_of(t)[3]
    viewed = dataclasses.replace(kern, x_view=(first, channels))
    if first + kern.problem.c > channels or first % viewed.input_alignment or channels % viewed.input_alignment:
        return c
    return dataclasses.replace(c, kernel=viewed, x=t)


def _batched_gemm(b, value_of, only_reader, readers, params, sm_count: int, smem_per_block: int,
                  name: str) -> Claimed | str:
    """A matrix product ``_matmul_as_conv`` left (the second operand an activation: attention's Q K^T and P V) as
    one batched GEMM kernel, ``matmul(fp16 [..., M, K], fp16 [..., K, N], fp32 out) -> astype fp16``; or why it is
    left to dlight."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    value = b.value
    a, w = value.args
    wv = value_of[w].args[0] if call_op(value_of.get(w)) == "relax.permute_dims" else w
    a_shape, w_shape, out = shape_of(a), shape_of(w), shape_of(b.var)
    if wv in params:
        if w_shape is not None and len(w_shape) == 2 and out is not None and out[-1] % ALIGNMENT:
            return "output features not a multiple of 8"
        return "a matrix product with a weight of rank > 2 or a dynamic shape"
    if dtype_of(a) != "float16" or dtype_of(w) != "float16" or dtype_of(b.var) != "float32":
        return "a product of two activations not fp16 with fp32 accumulation (int8 graphs keep attention in float32)"
    if a_shape is None or w_shape is None or len(a_shape) != len(w_shape) or len(a_shape) < 2 \
            or tuple(a_shape[:-2]) != tuple(w_shape[:-2]):
        return "a product of two activations with broadcast or dynamic batch axes"
    (m, k), n = a_shape[-2:], w_shape[-1]
    cast = only_reader(b.var)
    if call_op(value_of.get(cast)) != "relax.astype" or str(value_of[cast].attrs.dtype) != "float16":
        return "no fp16 cast after it"
    chain, alpha = [b.var, cast], 1.0
    scale = only_reader(cast)  # x a scalar constant (attention's 1/sqrt(d)): in the epilogue, before the rounding
    if call_op(value_of.get(scale)) == "relax.multiply" and value_of[scale].args[0].same_as(cast):
        c = const_scalar(value_of[scale].args[1], value_of)
        if c is not None:
            chain, alpha = [*chain, scale], c
    problem = GemmProblem(int(np.prod(a_shape[:-2])) if len(a_shape) > 2 else 1, m, n, k)
    if problem.batch > 65535:  # one batch per blockIdx.z
        return "a batched matrix product of more than 65535 matrices"
    # the heads' transposes around attention's products, read and written in place (no kernel of their own)
    views, dropped = {}, []
    for operand, which, axes in ((a, "a", [(0, 2, 1, 3)]), (w, "w", [(0, 2, 1, 3), (0, 2, 3, 1)])):
        seen = _head_view(operand, value_of, only_reader, b.var)
        if seen is not None and seen[2] in axes:
            views[which] = seen
            dropped += [operand, *seen[4]]
    back = only_reader(chain[-1])  # the context's heads back to [1, S, H, D]: written there
    seen = _head_view(back, value_of, only_reader, None) if back is not None else None
    if seen is not None and seen[2] == (0, 2, 1, 3):
        s_, h_, d_ = shape_of(back)[1:]
        views["y"] = (back, (h_ * d_, d_), seen[2])
        chain.append(back)
    # the graph's cast of the product to float32 (attention's scores, before the softmax ToMixedPrecision keeps in
    # float32): written as float32, unrounded
    to_float = only_reader(chain[-1])
    float_out = to_float is not None and call_op(value_of[to_float]) == "relax.astype" \
        and dtype_of(to_float) == "float32" and call_op(value_of.get(only_reader(to_float))) == "relax.nn.softmax"
    if float_out:
        chain.append(to_float)
    quantize = None if float_out else _quantize_after(chain[-1], value_of, only_reader, readers)
    if quantize is not None:  # the context quantized with one scale (the output projection's per-tensor input)
        chain += quantize[0]
        quantize = quantize[1]
    kernel = GemmKernel(name, problem, choose_tile(problem, sm_count, smem_per_block), alpha, float_out=float_out,
                        a_view=views["a"][1] if "a" in views else None,
                        b_view=views["w"][1] if "w" in views else None,
                        y_view=views["y"][1] if "y" in views else None,
                        b_column_major="w" in views and views["w"][2] == (0, 2, 3, 1),
                        a_offset=views["a"][3] if "a" in views else 0, b_offset=views["w"][3] if "w" in views else 0,
                        quantize=quantize)
    kernel = dataclasses.replace(kernel, tile=gemm_tile(kernel.tile, kernel.alignment))
    a = views["a"][0] if "a" in views else a
    w = views["w"][0] if "w" in views else w
    shapes = {"a": tuple(shape_of(a)), "w": tuple(shape_of(w)), "y": tuple(shape_of(chain[-1]))}
    return Claimed(kernel, chain[-1], a, w, None, None, tuple(dropped) + tuple(chain[:-1]), shapes)


def _quantize_after(var, value_of, only_reader, readers) -> tuple | None:
    """([the variables], (divisor, lo, hi)) where fp16 ``var`` is read only by ``[reshape ->] astype(float32) ->
    divide(c)`` and then the int8 tail ``quantize_tail`` matches (round, maximum(lo), minimum(hi), astype
    int8), each by the next only (a per-tensor quantize with its calibrated scale), c a scalar constant; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of

    chain = []
    nxt = only_reader(var)
    if call_op(value_of.get(nxt)) == "relax.reshape":
        chain.append(nxt)
        nxt = only_reader(nxt)
    for op, dtype in (("relax.astype", "float32"), ("relax.divide", None)):
        value = value_of.get(nxt)
        if call_op(value) != op or (dtype is not None and dtype_of(nxt) != dtype) \
                or not value.args[0].same_as(chain[-1] if chain else var):
            return None
        chain.append(nxt)
        nxt = only_reader(nxt)
    divisor = const_scalar(value_of[chain[-1]].args[1], value_of)
    tail = quantize_tail(chain[-1], value_of, readers)
    if dtype_of(var) != "float16" or tail is None or not divisor:
        return None
    (rounded, low, high), cast, (lo, hi) = tail
    return [*chain, rounded, low, high, cast], (divisor, lo, hi)


def _head_view(var, value_of, only_reader, reader) -> tuple | None:
    """Where ``var`` is a head transpose of one batch, ``permute_dims(t, [0, 2, 1, 3])`` (or ``[0, 2, 3, 1]``, K's
    transposed heads) of t [1, S, H, D], read only by ``reader`` (None: the one it has): (t, (H * D, D), axes, 0, ()),
    the view a batched GEMM reads in its place (``GemmKernel.strides``); else None. Where t is the heads of a slice
    of a wider tensor, ``reshape(strided_slice(T [1, S, F], last axis, [b, b + H x D)))`` (one of the projections
    ``_projections_as_one`` computed as one), read only by the transpose: (T, (F, D), axes, b, (t, the slice)), the
    slice and the reshape read in place too. (For the output's transpose back, the caller takes H and D from the
    transpose's own shape.)"""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.permute_dims" or (reader is not None and not same(only_reader(var), reader)):
        return None
    axes = tuple(int(a) for a in value.attrs.axes) if value.attrs.axes is not None else None
    t = value.args[0]
    shape = shape_of(t)
    if axes not in ((0, 2, 1, 3), (0, 2, 3, 1)) or shape is None or len(shape) != 4 or shape[0] != 1 \
            or dtype_of(t) != "float16" or shape[3] % ALIGNMENT:
        return None
    sliced = value_of.get(t)
    if call_op(sliced) == "relax.reshape" and same(only_reader(t), var):
        part = sliced.args[0]
        cut = last_axis_slice(part, value_of)
        whole = shape_of(cut[0]) if cut is not None else None
        if cut is not None and same(only_reader(part), t) and whole is not None and len(whole) == 3 \
                and list(whole[:2]) == list(shape[:2]) and cut[2] - cut[1] == shape[2] * shape[3] \
                and cut[1] % ALIGNMENT == 0 and whole[2] % ALIGNMENT == 0:
            return cut[0], (whole[2], shape[3]), axes, cut[1], (t, part)
    return t, (shape[2] * shape[3], shape[3]), axes, 0, ()
