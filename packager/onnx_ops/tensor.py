"""Tensor ops: windows, crops, scatters, casts, determinants, Col2Im, DFT, the constant-operand forms of
Expand, OneHot, Pad and Upsample, bool reductions, and run-time indices clamped into their axis."""

from __future__ import annotations

import math

import numpy as np

from edgeq.tvm_env import onnx_frontend, relax, te, topi, tvm

from edgeq.onnx_ops.context import (check_bounded, dtype_of, normal_axis, reference_values, relax_const, shape_of,
                                    slice_along)


# ----------------------------------------------------------------------------------------------- tensors


def cum_prod(ctx, inputs, attr):
    x = inputs[0]
    axis = normal_axis(int(ctx.need_const(inputs[1], "axis").reshape(-1)[0]), len(shape_of(x)))
    reverse = bool(attr.get("reverse", 0))
    if reverse:
        x = relax.op.flip(x, axis)
    y = relax.op.cumprod(x, axis=axis, exclusive=bool(attr.get("exclusive", 0)))
    return relax.op.flip(y, axis) if reverse else y


def constant_window(ctx, inputs, attr):
    """HannWindow, HammingWindow, BlackmanWindow, MelWeightMatrix: their inputs fix everything, so the output
    is computed now, by ONNX's reference implementation."""
    values = [None if v is None else ctx.need_const(v, f"input {i}") for i, v in enumerate(inputs)]
    if ctx.op == "MelWeightMatrix":
        check_bounded(ctx, int(values[0]) * (int(values[1]) // 2 + 1))
    else:
        check_bounded(ctx, int(values[0]))
    return relax_const(reference_values(ctx, attr, values)[0])


def center_crop_pad(ctx, inputs, attr):
    x = inputs[0]
    shape = shape_of(x)
    target = [int(v) for v in ctx.need_const(inputs[1], "shape").reshape(-1)]
    axes = [normal_axis(int(a), len(shape)) for a in attr.get("axes", range(len(shape)))]
    before, after = [0] * len(shape), [0] * len(shape)
    for axis, want in zip(axes, target):
        have = shape[axis]
        if want < have:
            start = (have - want) // 2
            x = ctx.bb.emit(slice_along(x, axis, start, start + want))
        elif want > have:
            before[axis] = (want - have) // 2
            after[axis] = want - have - before[axis]
    if any(before) or any(after):
        x = ctx.bb.emit_te(topi.nn.pad, x, before, after, 0.0)
    return x


def reverse_sequence(ctx, inputs, attr):
    x, lens = inputs[0], inputs[1]
    shape = shape_of(x)
    time_axis, batch_axis = int(attr.get("time_axis", 0)), int(attr.get("batch_axis", 1))
    steps, batch = shape[time_axis], shape[batch_axis]
    index_shape = [1] * len(shape)
    index_shape[time_axis] = steps
    t = relax.op.reshape(relax.op.arange(0, steps, 1, "int64"), index_shape)
    index_shape = [1] * len(shape)
    index_shape[batch_axis] = batch
    n = relax.op.reshape(relax.op.clip(relax.op.astype(lens, "int64"), 0, steps), index_shape)  # never read past the end
    index = relax.op.where(relax.op.less(t, n), relax.op.subtract(relax.op.subtract(n, relax_const(1, "int64")), t), t)
    return relax.op.gather_elements(x, relax.op.broadcast_to(index, shape), axis=time_axis)


def tensor_scatter(ctx, inputs, attr):
    """The KV-cache update: ``update`` written into ``past_cache`` along ``axis`` from each batch's index."""
    past, update = inputs[0], inputs[1]
    indices = inputs[2] if len(inputs) > 2 else None
    shape, ushape = shape_of(past), shape_of(update)
    axis = normal_axis(int(attr.get("axis", -2)), len(shape))
    mode = attr.get("mode", b"linear").decode()
    steps = [1] * len(shape)
    steps[axis] = ushape[axis]
    index = relax.op.reshape(relax.op.arange(0, ushape[axis], 1, "int64"), steps)
    if indices is not None:
        index = relax.op.add(index, relax.op.reshape(relax.op.astype(indices, "int64"), [shape[0]] + [1] * (len(shape) - 1)))
    if mode == "circular":
        index = relax.op.floor_mod(index, relax_const(shape[axis], "int64"))
    else:  # an index past the cache would write out of bounds: clamp it
        index = relax.op.clip(index, 0, shape[axis] - 1)
    return relax.op.scatter_elements(past, relax.op.broadcast_to(index, ushape), update, axis=axis)


def bit_cast(ctx, inputs, attr):
    from onnx.helper import tensor_dtype_to_np_dtype

    x = inputs[0]
    to = str(np.dtype(tensor_dtype_to_np_dtype(int(attr["to"]))))
    if np.dtype(to).itemsize != np.dtype(dtype_of(x)).itemsize:
        ctx.refuse(f"casts {dtype_of(x)} to {to}, of another width", "edgeq supports BitCast between types of one width")
    return ctx.bb.emit_te(lambda t: te.compute(t.shape, lambda *i: tvm.tirx.reinterpret(to, t(*i)), name="bitcast"), x)


def det(ctx, inputs, attr):
    """Determinants of ``[..., n, n]`` matrices by Gaussian elimination with partial pivoting, unrolled
    over the n steps (n is static)."""
    x = inputs[0]
    shape = shape_of(x)
    n = shape[-1]
    if n > 32:
        ctx.refuse(f"{n}x{n} matrices", "edgeq computes determinants of matrices up to 32x32")
    dt = dtype_of(x)
    batch = math.prod(shape[:-2])
    bb = ctx.bb
    a = bb.emit(relax.op.reshape(x, [batch, n, n]))
    result = relax_const(np.ones([batch]), dt)
    rows = relax.op.reshape(relax.op.arange(0, n, 1, "int64"), [1, n])
    for k in range(n):
        column = relax.op.abs(relax.op.reshape(slice_along(slice_along(a, 2, k, k + 1), 1, k, n), [batch, n - k]))
        pivot_row = bb.emit(relax.op.add(relax.op.argmax(column, axis=1, keepdims=True), relax_const(k, "int64")))  # (B, 1)
        k_ = relax_const(k, "int64")
        order = relax.op.where(relax.op.equal(rows, k_), pivot_row,
                               relax.op.where(relax.op.equal(rows, pivot_row), k_, rows))  # rows k, p swapped
        a = bb.emit(relax.op.gather_elements(a, relax.op.broadcast_to(relax.op.reshape(order, [batch, n, 1]),
                                                                       [batch, n, n]), axis=1))
        sign = relax.op.where(relax.op.equal(pivot_row, k_), relax_const(1, dt), relax_const(-1, dt))
        pivot = bb.emit(relax.op.reshape(slice_along(slice_along(a, 1, k, k + 1), 2, k, k + 1), [batch, 1]))
        result = bb.emit(relax.op.multiply(result, relax.op.reshape(relax.op.multiply(pivot, sign), [batch])))
        if k == n - 1:
            break
        safe = relax.op.where(relax.op.equal(pivot, relax_const(0, dt)), relax_const(1, dt), pivot)
        below = relax_const((np.arange(n) > k).astype(dt).reshape(1, n, 1), dt)
        factor = relax.op.multiply(relax.op.divide(slice_along(a, 2, k, k + 1), relax.op.reshape(safe, [batch, 1, 1])), below)
        a = bb.emit(relax.op.subtract(a, relax.op.multiply(factor, slice_along(a, 1, k, k + 1))))
    return relax.op.reshape(result, shape[:-2])


def col2im(ctx, inputs, attr):
    """Column blocks summed back into an image: a grouped transposed convolution whose kernel puts each
    column entry at its block position (one-hot weights), so TVM's conv2d_transpose does the summing."""
    x = inputs[0]
    image = [int(v) for v in ctx.need_const(inputs[1], "image_shape").reshape(-1)]
    block = [int(v) for v in ctx.need_const(inputs[2], "block_shape").reshape(-1)]
    if len(image) != 2:
        ctx.refuse(f"{len(image)} spatial dimensions", "edgeq supports Col2Im on 2-D images")
    n, ck, length = shape_of(x)
    kh, kw = block
    k = kh * kw
    if ck % k:
        ctx.refuse("input channels that are not a multiple of the block size", "fix the model")
    c = ck // k
    dil = [int(v) for v in attr.get("dilations", (1, 1))]
    stride = [int(v) for v in attr.get("strides", (1, 1))]
    pads = [int(v) for v in attr.get("pads", (0, 0, 0, 0))]
    blocks = [(image[i] + pads[i] + pads[i + 2] - dil[i] * (block[i] - 1) - 1) // stride[i] + 1 for i in range(2)]
    if blocks[0] * blocks[1] != length:
        ctx.refuse(f"{length} blocks where the image holds {blocks[0]}x{blocks[1]}", "fix the model")
    weight = np.zeros((ck, 1, kh, kw), dtype_of(x))
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                weight[ch * k + i * kw + j, 0, i, j] = 1
    full = [(blocks[i] - 1) * stride[i] - pads[i] - pads[i + 2] + dil[i] * (block[i] - 1) + 1 for i in range(2)]
    data = relax.op.reshape(x, [n, ck, blocks[0], blocks[1]])
    return relax.op.nn.conv2d_transpose(data, relax_const(weight), strides=stride, padding=pads,
                                        output_padding=[image[0] - full[0], image[1] - full[1]],
                                        dilation=dil, groups=c)


def expand(ctx, inputs, attr):
    """A constant target shape gives a static broadcast (TVM's converter leaves it symbolic when the shape
    is an initializer rather than a shape expression)."""
    shape = ctx.const(inputs[1])
    if shape is None:
        return ctx.tvm(inputs, attr)
    out = np.broadcast_shapes(tuple(shape_of(inputs[0])), tuple(int(d) for d in shape.reshape(-1)))
    return relax.op.broadcast_to(inputs[0], list(out))


def reduce_bool(ctx, inputs, attr):
    """ReduceMax / ReduceMin of bool (opset 20: any / all): reduced as uint8 and cast back, since TVM has no
    min or max value for bool; other types are TVM's."""
    if dtype_of(inputs[0]) != "bool":
        return ctx.tvm(inputs, attr)
    reduced = ctx.tvm([ctx.bb.emit(relax.op.astype(inputs[0], "uint8")), *inputs[1:]], attr)
    return relax.op.astype(ctx.bb.normalize(reduced), "bool")


def one_hot(ctx, inputs, attr):
    """OneHot with the on/off values computed at run time as well (TVM needs them constant)."""
    indices, depth, values = inputs[0], inputs[1], inputs[2]
    depth = int(ctx.need_const(depth, "depth").reshape(-1)[0])
    rank = len(shape_of(indices)) + 1
    axis = normal_axis(int(attr.get("axis", -1)), rank)
    idx = relax.op.astype(indices, "int64") if dtype_of(indices) != "int64" else indices
    idx = relax.op.where(relax.op.less(idx, relax_const(0, "int64")), relax.op.add(idx, relax_const(depth, "int64")), idx)
    positions = [1] * rank
    positions[axis] = depth
    hot = relax.op.equal(relax.op.expand_dims(idx, axis), relax_const(np.arange(depth).reshape(positions), "int64"))
    off = relax.op.reshape(slice_along(values, 0, 0, 1), [])
    on = relax.op.reshape(slice_along(values, 0, 1, 2), [])
    return relax.op.where(hot, on, off)


def pad(ctx, inputs, attr):
    """Constant-mode Pad as Relax's own ``nn.pad`` (TVM's converter emits a TE function, a ``call_tir`` that
    later passes cannot see into: ToMixedPrecision stops on it, which refused Swin's window padding in fp16); a
    pad of nothing is its input. A pad value computed at run time: pad with zeros, then put the value where the
    (build-time) mask of the padding says. Other modes and negative pads: TVM's converter."""
    value = inputs[2] if len(inputs) > 2 else None
    if ctx.opset < 11 or attr.get("mode", b"constant") != b"constant" or ctx.const(inputs[1]) is None:
        return ctx.tvm(inputs, attr)
    x = inputs[0]
    shape = shape_of(x)
    pads = [int(p) for p in ctx.need_const(inputs[1], "pads").reshape(-1)]
    axes = ctx.optional_const(inputs, 3, "axes")
    axes = list(range(len(shape))) if axes is None else [normal_axis(int(a), len(shape)) for a in axes.reshape(-1)]
    before, after = [0] * len(shape), [0] * len(shape)
    for i, axis in enumerate(axes):
        before[axis], after[axis] = pads[i], pads[i + len(axes)]
    constant = ctx.const(value) if value is not None else np.zeros(())
    if constant is not None:
        if min(before + after) < 0:
            return ctx.tvm(inputs, attr)
        if max(before + after) == 0:
            return x
        widths = [w for pair in zip(before, after) for w in pair]
        return relax.op.nn.pad(x, widths, "constant", float(constant.reshape(-1)[0]) if constant.size else 0.0)
    if min(before + after) < 0:
        ctx.refuse("negative pads with a run-time pad value", "make the pad value a constant")
    padded = ctx.bb.emit_te(topi.nn.pad, x, before, after, 0.0)
    mask = np.pad(np.ones(shape, bool), list(zip(before, after)))
    return relax.op.where(relax_const(mask), padded, relax.op.reshape(value, []))


def upsample(ctx, inputs, attr):
    x = inputs[0]
    shape = shape_of(x)
    scales = attr.get("scales") if ctx.opset < 9 else ctx.need_const(inputs[1], "scales")
    scales = [float(v) for v in np.asarray(scales).reshape(-1)]
    mode = attr.get("mode", b"nearest").decode()
    out = [int(math.floor(d * s)) for d, s in zip(shape, scales)]
    if mode == "nearest":
        for axis, (d, s, o) in enumerate(zip(shape, scales, out)):
            if o != d:
                index = np.minimum(np.floor(np.arange(o) / s), d - 1).astype("int64")
                x = ctx.bb.emit(relax.op.take(x, relax_const(index), axis=axis))
        return x
    if len(shape) == 4 and scales[:2] == [1.0, 1.0]:
        return relax.op.image.resize2d(x, out[2:], method="linear", coordinate_transformation_mode="asymmetric")
    ctx.refuse(f"mode '{mode}' with scales {scales}", "use Resize, or nearest mode")


def dft(ctx, inputs, attr):
    """DFT as products with cosine and sine matrices along the transformed axis (any length, not only
    powers of two); the inverse of a one-sided spectrum (irfft) is refused."""
    x = inputs[0]
    shape = shape_of(x)
    rank = len(shape)
    if ctx.opset >= 20:
        axis_value = ctx.optional_const(inputs, 2, "axis")
        axis = -2 if axis_value is None else int(axis_value.reshape(-1)[0])
    else:
        axis = int(attr.get("axis", 1))
    axis = normal_axis(axis, rank)
    if axis == rank - 1:
        ctx.refuse("the axis is the complex dimension", "fix the model")
    inverse, onesided = bool(attr.get("inverse", 0)), bool(attr.get("onesided", 0))
    length = ctx.optional_const(inputs, 1, "dft_length")
    if inverse and onesided:
        ctx.refuse("the inverse of a one-sided spectrum", "edgeq supports DFT and full inverse DFT")
    n = shape[axis]
    length = n if length is None else int(length.reshape(-1)[0])
    dt = "float64"  # sums of up to `length` products: float32 would lose ~1e-6 (ONNX's reference uses numpy's FFT)
    bb = ctx.bb
    order = [d for d in range(rank - 1) if d != axis] + [axis]
    parts = [bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.squeeze(slice_along(x, rank - 1, c, c + 1), [rank - 1]),
                                                           order), dt))
             for c in range(shape[-1])]
    if length < n:
        parts = [bb.emit(slice_along(p, rank - 2, 0, length)) for p in parts]
    elif length > n:
        widths = [0] * (rank - 2)
        parts = [bb.emit_te(topi.nn.pad, p, widths + [0], widths + [length - n], 0.0) for p in parts]
    out_len = length // 2 + 1 if onesided else length
    k = np.arange(length)[:, None] * np.arange(out_len)[None, :]
    cos = relax_const(np.cos(2 * np.pi * k / length), dt)
    sin = relax_const(np.sin(2 * np.pi * k / length), dt)
    sign = 1.0 if inverse else -1.0  # e^{sign i 2 pi n k / L}
    real = parts[0]
    imag = parts[1] if len(parts) > 1 else None
    yr = relax.op.matmul(real, cos)
    yi = relax.op.multiply(relax.op.matmul(real, sin), relax_const(sign, dt))
    if imag is not None:
        yr = relax.op.subtract(yr, relax.op.multiply(relax.op.matmul(imag, sin), relax_const(sign, dt)))
        yi = relax.op.add(yi, relax.op.matmul(imag, cos))
    if inverse:
        yr, yi = relax.op.divide(yr, relax_const(length, dt)), relax.op.divide(yi, relax_const(length, dt))
    y = relax.op.stack([bb.normalize(yr), bb.normalize(yi)], axis=rank - 1)  # (..., out_len, 2)
    back = list(np.argsort(order)) + [rank - 1]
    return relax.op.astype(relax.op.permute_dims(y, [int(a) for a in back]), dtype_of(x))




def indices_in_range(ctx, inputs, attr):
    """Gather, GatherElements, ScatterElements, Scatter with run-time indices clamped into the axis before
    TVM's converter sees them. ONNX calls an index out of range an error; TVM's kernels do not check, so
    one would read or write outside the tensor (seen: the golden run reading garbage). In range, nothing
    changes."""
    data, indices = inputs[0], inputs[1]
    if (ctx.const(indices) is not None or not isinstance(data.ty, relax.TensorType)
            or not isinstance(indices.ty, relax.TensorType)):
        return ctx.tvm(inputs, attr)
    shape = shape_of(data)
    axis = normal_axis(int(attr.get("axis", 0)), len(shape))
    dim, dt = shape[axis], dtype_of(indices)
    index = indices
    if not dt.startswith("uint"):
        index = relax.op.where(relax.op.less(index, relax_const(0, dt)), relax.op.add(index, relax_const(dim, dt)), index)
    index = ctx.bb.emit(relax.op.clip(index, 0, max(dim - 1, 0)))
    return ctx.tvm(onnx_frontend.onnx_input([data, index, *inputs[2:]]), attr)


def einsum(ctx, inputs, attr):
    """Einsum of two operands that is a (batched) matrix product, as transposes, reshapes and one Relax
    ``matmul`` (TVM's converter emits a TE function, a ``call_tir`` on which ToMixedPrecision stops and
    which no GPU kernel claims: MaxViT's attention, ``bghid,bghjd->bghij``). Each letter is a batch axis
    (in both operands and the output), a row (first operand and output), a column (second operand and
    output) or contracted (both operands, not the output). Any other equation (one operand, three,
    ellipses, a letter repeated in an operand or summed in one operand alone): Relax's ``einsum``."""
    equation = attr["equation"].decode() if isinstance(attr["equation"], bytes) else attr["equation"]
    product = _as_matmul(equation.replace(" ", ""), [shape_of(x) for x in inputs])
    if product is None:
        return relax.op.einsum(inputs, equation)
    a_axes, b_axes, a_shape, b_shape, out_shape, out_axes = product
    a = _reshape(_permute(inputs[0], a_axes), [shape_of(inputs[0])[i] for i in a_axes], a_shape)
    b = _reshape(_permute(inputs[1], b_axes), [shape_of(inputs[1])[i] for i in b_axes], b_shape)
    return _permute(_reshape(relax.op.matmul(a, b), a_shape[:-1] + b_shape[-1:], out_shape), out_axes)


def _permute(x, axes):
    return x if list(axes) == list(range(len(axes))) else relax.op.permute_dims(x, list(axes))


def _reshape(x, shape, to):
    return x if list(shape) == list(to) else relax.op.reshape(x, to)


def _as_matmul(equation: str, shapes):
    """The plan of a two-operand Einsum as ``matmul``: (first operand's axes as batch+rows+contracted, the
    second's as batch+contracted+columns, the two shapes they are reshaped to, the product's shape unflattened
    as batch+rows+columns, and the permutation from that to the output), or None where it is no such product."""
    if "->" not in equation or "." in equation or len(shapes) != 2:
        return None
    operands, out = equation.split("->")
    terms = operands.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    a, b = terms
    if len(a) != len(shapes[0]) or len(b) != len(shapes[1]):
        return None
    size = {}
    for term, shape in zip(terms, shapes):
        for letter, extent in zip(term, shape):
            if size.setdefault(letter, extent) != extent:
                return None  # broadcasting of a size-1 axis: leave it to einsum
    if any(letter not in a and letter not in b for letter in out):
        return None
    if any(letter not in out and letter not in (b if term is a else a) for term in terms for letter in term):
        return None  # summed in one operand alone
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in a if c in out and c not in b]
    cols = [c for c in b if c in out and c not in a]
    inner = [c for c in a if c not in out]

    def prod(letters):
        return int(np.prod([size[c] for c in letters], dtype=np.int64))

    lead = [size[c] for c in batch]
    a_axes = [a.index(c) for c in batch + rows + inner]
    b_axes = [b.index(c) for c in batch + inner + cols]
    a_shape = lead + [prod(rows), prod(inner)]
    b_shape = lead + [prod(inner), prod(cols)]
    order = batch + rows + cols
    out_shape = [size[c] for c in order]
    return a_axes, b_axes, a_shape, b_shape, out_shape, [order.index(c) for c in out]
