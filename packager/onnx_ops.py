"""ONNX operators edgeq converts itself, in one table (``CONVERTERS``: op type -> converter).

Two kinds: ops TVM 0.27's Relax frontend has no converter for (Swish, Celu, LpNormalization, CumProd,
the window functions, Det, Col2Im, ...), and ops whose TVM converter gives wrong results or crashes
(``OVERRIDES`` says why, op by op). A converter is ``fn(ctx, inputs, attr)`` returning a Relax expression
(a ``relax.Tuple`` for several outputs); ``ctx`` has the block builder, the opset, the node's name and
number of outputs, ``ctx.const(expr)`` (the value of an initializer or constant operand, else None) and
``ctx.tvm(...)`` (TVM's own converter, where an override handles only some cases).

Hooking in: TVM's frontend has no public way to add converters; ``from_onnx`` looks every op up in the
module function ``onnx_frontend._get_convert_map()``. ``installed()`` replaces that function, for the
duration of one import (a ``with`` block, restored on exit), by one returning TVM's table with edgeq's
converters added and every converter wrapped so that a failure names the ONNX node and op
(``ConversionError``), an op that cannot be compiled with static shapes is refused in one line
(``Refused``), and a converter that makes a tensor of data-dependent shape from static inputs is refused
there, naming the op, instead of failing later in the build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from edgeq.tvm_env import onnx_frontend, relax, te, topi, tvm


class Refused(Exception):
    """An op edgeq cannot compile, said in one line with what to do about it."""


class ConversionError(Exception):
    """A converter failed; names the ONNX node and op."""

    def __init__(self, op: str, node: str, cause: BaseException, runtime_operands: bool):
        text = str(cause).strip()
        self.op, self.node, self.runtime_operands = op, node, runtime_operands
        self.reason = text.splitlines()[0] if text else type(cause).__name__
        super().__init__(f"{op} node '{node}': {self.reason}")


@dataclasses.dataclass
class Context:
    bb: Any
    opset: int
    op: str
    node: str
    num_outputs: int
    params: Any  # TVM's [graph nodes, params] pair
    tvm_converter: Any  # TVM's converter class for this op, or None
    max_detections: int | None = None  # --max-detections (edgeq.nms)

    def const(self, expr) -> np.ndarray | None:
        """The value of an operand known at import time (a constant or an initializer), else None."""
        if expr is None:
            return None
        if isinstance(expr, tvm.ir.expr.Constant):
            return expr.value.numpy()
        if isinstance(expr, relax.Var) and expr.name in self.params[1]:
            return np.asarray(self.params[1][expr.name][1].numpy())
        return None

    def need_const(self, expr, what: str) -> np.ndarray:
        value = self.const(expr)
        if value is None:
            raise Refused(f"{self.op} node '{self.node}': its {what} is computed at run time; edgeq needs it "
                          "constant: make it an initializer, or bind the graph input with --const NAME=FILE.npy")
        return value

    def optional_const(self, inputs, index: int, what: str) -> np.ndarray | None:
        """The value of an optional operand: None where it is absent; where it is given, it must be constant
        (an operand that changes the result is never silently replaced by its default)."""
        if len(inputs) <= index or inputs[index] is None:
            return None
        return self.need_const(inputs[index], what)

    def tvm(self, inputs, attr):
        if self.tvm_converter is None:
            raise Refused(f"{self.op} node '{self.node}': not supported in this form")
        return self.tvm_converter.get_converter(self.opset)(self.bb, inputs, attr, self.params)

    def refuse(self, why: str, todo: str):
        raise Refused(f"{self.op} node '{self.node}': {why}; {todo}")


# ----------------------------------------------------------------------------------------------- helpers


def _shape(expr) -> list[int]:
    return [int(d) for d in expr.ty.shape.values]


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _c(value, dtype: str | None = None):
    """A Relax constant of ``value`` in ``dtype`` (default: the array's own; relax.const alone makes
    float64 arrays float32)."""
    value = np.asarray(value, dtype=dtype)
    return relax.const(value, str(value.dtype))


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _slice(x, axis: int, begin: int, end: int, step: int = 1):
    return relax.op.strided_slice(x, [axis], [begin], [end], [step])


def _reference(ctx: Context, attr: dict, values: list[np.ndarray | None]) -> list[np.ndarray]:
    """The op evaluated by ONNX's reference implementation on constant inputs (ops whose every input is
    known at import time, such as the window functions)."""
    import onnx

    from edgeq.fold import evaluate_node

    attrs = {k: v for k, v in attr.items() if k != "tvm_custom"}
    node = onnx.helper.make_node(ctx.op, [""] * len(values), [f"out{i}" for i in range(ctx.num_outputs)], **attrs)
    return evaluate_node(node, values, [onnx.helper.make_opsetid("", ctx.opset)])


def _bounded(ctx: Context, elements: int) -> None:
    from edgeq.errors import ModelError
    from edgeq.limits import check

    check("activation_bytes", f"{ctx.op} node '{ctx.node}' output", elements * 8, ModelError)


# ----------------------------------------------------------------------------------------------- activations


def swish(ctx, inputs, attr):
    x = inputs[0]
    alpha = float(attr.get("alpha", 1.0))
    return relax.op.multiply(x, relax.op.sigmoid(relax.op.multiply(x, _c(alpha, _dtype(x)))))


def celu(ctx, inputs, attr):
    x = inputs[0]
    dt = _dtype(x)
    alpha = float(attr.get("alpha", 1.0))
    zero = _c(0, dt)
    neg = relax.op.multiply(_c(alpha, dt), relax.op.subtract(relax.op.exp(relax.op.divide(x, _c(alpha, dt))), _c(1, dt)))
    return relax.op.add(relax.op.maximum(x, zero), relax.op.minimum(neg, zero))


def mish(ctx, inputs, attr):
    """x * tanh(softplus(x)) as x * n / (n + 2) with n = e^x (e^x + 2): exact for large negative x, where
    TVM's log(1 + e^x) loses the small values (off by more than 1e-7)."""
    x = inputs[0]
    dt = _dtype(x)
    e = relax.op.exp(x)
    n = relax.op.multiply(e, relax.op.add(e, _c(2, dt)))
    y = relax.op.divide(relax.op.multiply(x, n), relax.op.add(n, _c(2, dt)))
    return relax.op.where(relax.op.greater(x, _c(20, dt)), x, y)


def swiglu(ctx, inputs, attr):
    a, b = inputs[0], inputs[1]
    return relax.op.multiply(swish(ctx, [a], attr), b)


# ----------------------------------------------------------------------------------------------- normalization


def lp_normalization(ctx, inputs, attr):
    x = inputs[0]
    dt = _dtype(x)
    axis = _axis(int(attr.get("axis", -1)), len(_shape(x)))
    p = int(attr.get("p", 2))
    if p == 1:
        norm = relax.op.sum(relax.op.abs(x), axis=[axis], keepdims=True)
    elif p == 2:
        norm = relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), axis=[axis], keepdims=True))
    else:
        ctx.refuse(f"p={p} (ONNX allows 1 and 2)", "fix the model")
    is_zero = relax.op.equal(norm, _c(0, dt))
    safe = relax.op.where(is_zero, _c(1, dt), norm)
    return relax.op.where(is_zero, _c(0, dt), relax.op.divide(x, safe))


def layer_normalization(ctx, inputs, attr):
    """All three outputs (Y, Mean, InvStdDev): TVM's converter returns 0-d placeholders for the last two."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    shape = _shape(x)
    axis = _axis(int(attr.get("axis", -1)), len(shape))
    eps = float(attr.get("epsilon", 1e-5))
    axes = list(range(axis, len(shape)))
    dt = _dtype(x)
    normalized = shape[axis:]
    if (ctx.num_outputs == 1 and dt == "float32" and _shape(scale) == normalized
            and (bias is None or _shape(bias) == normalized)):
        beta = bias if bias is not None else _c(np.zeros(normalized), dt)
        return relax.op.nn.layer_norm(x, scale, beta, axes, eps)
    stash = "float32" if int(attr.get("stash_type", 1)) == 1 else dt
    xs = relax.op.astype(x, stash) if stash != dt else x
    mean = ctx.bb.emit(relax.op.mean(xs, axis=axes, keepdims=True))
    d = ctx.bb.emit(relax.op.subtract(xs, mean))
    var = relax.op.mean(relax.op.multiply(d, d), axis=axes, keepdims=True)
    inv = ctx.bb.emit(relax.op.rsqrt(relax.op.add(var, _c(eps, stash))))
    y = relax.op.multiply(d, inv)
    y = relax.op.astype(y, dt) if stash != dt else y
    y = relax.op.multiply(y, scale)
    if bias is not None:
        y = relax.op.add(y, bias)
    return relax.Tuple([y, mean, inv])


def rms_normalization(ctx, inputs, attr):
    """Written out: TVM's rms_norm crashes when the scale has the rank of the input (axis 0)."""
    x, scale = inputs[0], inputs[1]
    shape = _shape(x)
    axis = _axis(int(attr.get("axis", -1)), len(shape))
    eps = float(attr.get("epsilon", 1e-5))
    dt = _dtype(x)
    stash = "float32" if int(attr.get("stash_type", 1)) == 1 else dt
    xs = relax.op.astype(x, stash) if stash != dt else x
    ms = relax.op.mean(relax.op.multiply(xs, xs), axis=list(range(axis, len(shape))), keepdims=True)
    y = relax.op.multiply(xs, relax.op.rsqrt(relax.op.add(ms, _c(eps, stash))))
    y = relax.op.astype(y, dt) if stash != dt else y
    return relax.op.multiply(y, scale)


# ----------------------------------------------------------------------------------------------- tensors


def cum_prod(ctx, inputs, attr):
    x = inputs[0]
    axis = _axis(int(ctx.need_const(inputs[1], "axis").reshape(-1)[0]), len(_shape(x)))
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
        _bounded(ctx, int(values[0]) * (int(values[1]) // 2 + 1))
    else:
        _bounded(ctx, int(values[0]))
    return _c(_reference(ctx, attr, values)[0])


def center_crop_pad(ctx, inputs, attr):
    x = inputs[0]
    shape = _shape(x)
    target = [int(v) for v in ctx.need_const(inputs[1], "shape").reshape(-1)]
    axes = [_axis(int(a), len(shape)) for a in attr.get("axes", range(len(shape)))]
    before, after = [0] * len(shape), [0] * len(shape)
    for axis, want in zip(axes, target):
        have = shape[axis]
        if want < have:
            start = (have - want) // 2
            x = ctx.bb.emit(_slice(x, axis, start, start + want))
        elif want > have:
            before[axis] = (want - have) // 2
            after[axis] = want - have - before[axis]
    if any(before) or any(after):
        x = ctx.bb.emit_te(topi.nn.pad, x, before, after, 0.0)
    return x


def reverse_sequence(ctx, inputs, attr):
    x, lens = inputs[0], inputs[1]
    shape = _shape(x)
    time_axis, batch_axis = int(attr.get("time_axis", 0)), int(attr.get("batch_axis", 1))
    steps, batch = shape[time_axis], shape[batch_axis]
    index_shape = [1] * len(shape)
    index_shape[time_axis] = steps
    t = relax.op.reshape(relax.op.arange(0, steps, 1, "int64"), index_shape)
    index_shape = [1] * len(shape)
    index_shape[batch_axis] = batch
    n = relax.op.reshape(relax.op.clip(relax.op.astype(lens, "int64"), 0, steps), index_shape)  # never read past the end
    index = relax.op.where(relax.op.less(t, n), relax.op.subtract(relax.op.subtract(n, _c(1, "int64")), t), t)
    return relax.op.gather_elements(x, relax.op.broadcast_to(index, shape), axis=time_axis)


def tensor_scatter(ctx, inputs, attr):
    """The KV-cache update: ``update`` written into ``past_cache`` along ``axis`` from each batch's index."""
    past, update = inputs[0], inputs[1]
    indices = inputs[2] if len(inputs) > 2 else None
    shape, ushape = _shape(past), _shape(update)
    axis = _axis(int(attr.get("axis", -2)), len(shape))
    mode = attr.get("mode", b"linear").decode()
    steps = [1] * len(shape)
    steps[axis] = ushape[axis]
    index = relax.op.reshape(relax.op.arange(0, ushape[axis], 1, "int64"), steps)
    if indices is not None:
        index = relax.op.add(index, relax.op.reshape(relax.op.astype(indices, "int64"), [shape[0]] + [1] * (len(shape) - 1)))
    if mode == "circular":
        index = relax.op.floor_mod(index, _c(shape[axis], "int64"))
    else:  # an index past the cache would write out of bounds: clamp it
        index = relax.op.clip(index, 0, shape[axis] - 1)
    return relax.op.scatter_elements(past, relax.op.broadcast_to(index, ushape), update, axis=axis)


def bit_cast(ctx, inputs, attr):
    from onnx.helper import tensor_dtype_to_np_dtype

    x = inputs[0]
    to = str(np.dtype(tensor_dtype_to_np_dtype(int(attr["to"]))))
    if np.dtype(to).itemsize != np.dtype(_dtype(x)).itemsize:
        ctx.refuse(f"casts {_dtype(x)} to {to}, of another width", "edgeq supports BitCast between types of one width")
    return ctx.bb.emit_te(lambda t: te.compute(t.shape, lambda *i: tvm.tirx.reinterpret(to, t(*i)), name="bitcast"), x)


def det(ctx, inputs, attr):
    """Determinants of ``[..., n, n]`` matrices by Gaussian elimination with partial pivoting, unrolled
    over the n steps (n is static)."""
    x = inputs[0]
    shape = _shape(x)
    n = shape[-1]
    if n > 32:
        ctx.refuse(f"{n}x{n} matrices", "edgeq computes determinants of matrices up to 32x32")
    dt = _dtype(x)
    batch = math.prod(shape[:-2])
    bb = ctx.bb
    a = bb.emit(relax.op.reshape(x, [batch, n, n]))
    result = _c(np.ones([batch]), dt)
    rows = relax.op.reshape(relax.op.arange(0, n, 1, "int64"), [1, n])
    for k in range(n):
        column = relax.op.abs(relax.op.reshape(_slice(_slice(a, 2, k, k + 1), 1, k, n), [batch, n - k]))
        pivot_row = bb.emit(relax.op.add(relax.op.argmax(column, axis=1, keepdims=True), _c(k, "int64")))  # (B, 1)
        k_ = _c(k, "int64")
        order = relax.op.where(relax.op.equal(rows, k_), pivot_row,
                               relax.op.where(relax.op.equal(rows, pivot_row), k_, rows))  # rows k, p swapped
        a = bb.emit(relax.op.gather_elements(a, relax.op.broadcast_to(relax.op.reshape(order, [batch, n, 1]),
                                                                       [batch, n, n]), axis=1))
        sign = relax.op.where(relax.op.equal(pivot_row, k_), _c(1, dt), _c(-1, dt))
        pivot = bb.emit(relax.op.reshape(_slice(_slice(a, 1, k, k + 1), 2, k, k + 1), [batch, 1]))
        result = bb.emit(relax.op.multiply(result, relax.op.reshape(relax.op.multiply(pivot, sign), [batch])))
        if k == n - 1:
            break
        safe = relax.op.where(relax.op.equal(pivot, _c(0, dt)), _c(1, dt), pivot)
        below = _c((np.arange(n) > k).astype(dt).reshape(1, n, 1), dt)
        factor = relax.op.multiply(relax.op.divide(_slice(a, 2, k, k + 1), relax.op.reshape(safe, [batch, 1, 1])), below)
        a = bb.emit(relax.op.subtract(a, relax.op.multiply(factor, _slice(a, 1, k, k + 1))))
    return relax.op.reshape(result, shape[:-2])


def col2im(ctx, inputs, attr):
    """Column blocks summed back into an image: a grouped transposed convolution whose kernel puts each
    column entry at its block position (one-hot weights), so TVM's conv2d_transpose does the summing."""
    x = inputs[0]
    image = [int(v) for v in ctx.need_const(inputs[1], "image_shape").reshape(-1)]
    block = [int(v) for v in ctx.need_const(inputs[2], "block_shape").reshape(-1)]
    if len(image) != 2:
        ctx.refuse(f"{len(image)} spatial dimensions", "edgeq supports Col2Im on 2-D images")
    n, ck, length = _shape(x)
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
    weight = np.zeros((ck, 1, kh, kw), _dtype(x))
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                weight[ch * k + i * kw + j, 0, i, j] = 1
    full = [(blocks[i] - 1) * stride[i] - pads[i] - pads[i + 2] + dil[i] * (block[i] - 1) + 1 for i in range(2)]
    data = relax.op.reshape(x, [n, ck, blocks[0], blocks[1]])
    return relax.op.nn.conv2d_transpose(data, _c(weight), strides=stride, padding=pads,
                                        output_padding=[image[0] - full[0], image[1] - full[1]],
                                        dilation=dil, groups=c)


def rotary_embedding(ctx, inputs, attr):
    x, cos, sin = inputs[0], inputs[1], inputs[2]
    positions = inputs[3] if len(inputs) > 3 else None
    shape = _shape(x)
    bb = ctx.bb
    if len(shape) == 4:  # (B, H, S, D) -> (B, S, H, D)
        xs = relax.op.permute_dims(x, [0, 2, 1, 3])
        b, h, s, d = shape
    else:
        heads = int(attr.get("num_heads", 0))
        if not heads:
            ctx.refuse("3-D input without num_heads", "set the num_heads attribute")
        b, s, hidden = shape
        h, d = heads, hidden // heads
        xs = relax.op.reshape(x, [b, s, h, d])
    xs = bb.emit(xs)
    rot = int(attr.get("rotary_embedding_dim", 0)) or d
    half = rot // 2
    if positions is not None:
        cos, sin = relax.op.take(cos, positions, axis=0), relax.op.take(sin, positions, axis=0)
    cos = bb.emit(relax.op.expand_dims(cos, 2))  # (B, S, 1, rot/2)
    sin = bb.emit(relax.op.expand_dims(sin, 2))
    interleaved = bool(attr.get("interleaved", 0))
    if interleaved:
        x1, x2 = _slice(xs, 3, 0, rot, 2), _slice(xs, 3, 1, rot, 2)
    else:
        x1, x2 = _slice(xs, 3, 0, half), _slice(xs, 3, half, rot)
    x1, x2 = bb.emit(x1), bb.emit(x2)
    real = relax.op.subtract(relax.op.multiply(cos, x1), relax.op.multiply(sin, x2))
    imag = relax.op.add(relax.op.multiply(sin, x1), relax.op.multiply(cos, x2))
    if interleaved:
        rotated = relax.op.reshape(relax.op.stack([real, imag], axis=4), [b, s, h, rot])
    else:
        rotated = relax.op.concat([real, imag], axis=3)
    out = relax.op.concat([rotated, _slice(xs, 3, rot, d)], axis=3) if rot < d else rotated
    return relax.op.permute_dims(out, [0, 2, 1, 3]) if len(shape) == 4 else relax.op.reshape(out, shape)


def attention(ctx, inputs, attr):
    """ONNX Attention (opset 23+): scaled dot-product attention with an optional mask, causal masking, a
    past key/value cache, grouped-query heads and softcap. TVM's "Attention" is com.microsoft's (an
    input projection with ``num_heads``); that form still goes to TVM's converter."""
    if "num_heads" in attr:
        return ctx.tvm(inputs, attr)
    q, k, v = inputs[0], inputs[1], inputs[2]
    extra = list(inputs[3:]) + [None] * 4
    mask, past_k, past_v, nonpad = extra[0], extra[1], extra[2], extra[3]
    if nonpad is not None:
        ctx.refuse("nonpad_kv_seqlen is given", "edgeq supports Attention without it")
    if int(attr.get("left_window_size", -1)) >= 0 or int(attr.get("right_window_size", -1)) >= 0:
        ctx.refuse("a sliding window is set", "edgeq supports Attention without sliding windows")
    bb = ctx.bb
    out_dt = _dtype(q)
    if out_dt in ("float16", "bfloat16"):  # accumulate in float32, as ONNX Runtime does
        q, k, v = (relax.op.astype(t, "float32") for t in (q, k, v))
        past_k, past_v = (None if t is None else bb.emit(relax.op.astype(t, "float32")) for t in (past_k, past_v))
        if mask is not None and _dtype(mask) != "bool":
            mask = bb.emit(relax.op.astype(mask, "float32"))
        q, k, v = bb.emit(q), bb.emit(k), bb.emit(v)
    dt = _dtype(q)
    rank = len(_shape(q))
    if rank == 3:
        qh, kvh = int(attr.get("q_num_heads", 0)), int(attr.get("kv_num_heads", 0))
        if not qh or not kvh:
            ctx.refuse("3-D inputs without q_num_heads/kv_num_heads", "set both attributes")

        def heads(x, n):
            b, s, hidden = _shape(x)
            return bb.emit(relax.op.permute_dims(relax.op.reshape(x, [b, s, n, hidden // n]), [0, 2, 1, 3]))

        q, k, v = heads(q, qh), heads(k, kvh), heads(v, kvh)
    batch, qh, sq, d = _shape(q)
    if past_k is not None:
        k = bb.emit(relax.op.concat([past_k, k], axis=2))
        v = bb.emit(relax.op.concat([past_v, v], axis=2))
    present_k, present_v = k, v
    kvh, skv = _shape(k)[1], _shape(k)[2]
    past = _shape(past_k)[2] if past_k is not None else 0
    if qh != kvh:  # grouped-query: each KV head serves qh / kvh query heads, interleaved [h0, h0, h1, h1, ...]
        rep = qh // kvh

        def repeat(x):
            shape = _shape(x)
            x = relax.op.broadcast_to(relax.op.expand_dims(x, 2), [shape[0], shape[1], rep, *shape[2:]])
            return bb.emit(relax.op.reshape(x, [shape[0], shape[1] * rep, *shape[2:]]))

        k, v = repeat(k), repeat(v)
    scale = attr.get("scale")
    scale = float(np.sqrt(1.0 / np.sqrt(d) if scale is None else float(scale)))
    scores = relax.op.matmul(relax.op.multiply(q, _c(scale, dt)),
                             relax.op.permute_dims(relax.op.multiply(k, _c(scale, dt)), [0, 1, 3, 2]))
    scores = bb.emit(scores)
    softcap = float(attr.get("softcap", 0.0))
    if softcap > 0:
        scores = bb.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, _c(softcap, dt))), _c(softcap, dt)))
    capped = scores
    bias = None
    if mask is not None:
        mshape = _shape(mask)
        if mshape[-1] < skv:
            fill = False if _dtype(mask) == "bool" else -np.inf
            pad = _c(np.full(mshape[:-1] + [skv - mshape[-1]], fill, _dtype(mask)))
            mask = relax.op.concat([mask, pad], axis=len(mshape) - 1)
        bias = relax.op.where(mask, _c(0, dt), _c(-np.inf, dt)) if _dtype(mask) == "bool" else mask
    if int(attr.get("is_causal", 0)):
        allowed = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + past
        causal = _c(np.where(allowed, 0, -np.inf).astype(dt))
        bias = causal if bias is None else relax.op.add(bias, causal)
    if bias is not None:
        bias = bb.emit(bias)
        scores = bb.emit(relax.op.add(scores, bias))
    mode = int(attr.get("qk_matmul_output_mode", 0))
    # 0: the QK product, 1: after softcap (ONNX's reference returns that for 0 as well), 2: with the bias
    qk_out = {0: capped, 1: capped, 2: scores}.get(mode)
    precision = attr.get("softmax_precision")
    if precision is not None:
        from onnx.helper import tensor_dtype_to_np_dtype

        scores = relax.op.astype(scores, str(np.dtype(tensor_dtype_to_np_dtype(int(precision)))))
    probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
    if bias is not None:  # a row that may attend nothing gives zeros, not NaN
        masked = relax.op.equal(relax.op.max(bias, axis=[-1], keepdims=True), _c(-np.inf, dt))
        probs = bb.emit(relax.op.where(masked, _c(0, _dtype(probs)), probs))
    if precision is not None:
        probs = bb.emit(relax.op.astype(probs, dt))
    if mode == 3:
        qk_out = probs
    y = relax.op.matmul(probs, v)
    if rank == 3:
        y = relax.op.reshape(relax.op.permute_dims(y, [0, 2, 1, 3]), [batch, sq, qh * _shape(v)[3]])
    outputs = [y, present_k, present_v, qk_out]
    if out_dt != dt:
        outputs = [None if o is None else relax.op.astype(o, out_dt) for o in outputs]
    if ctx.num_outputs == 1:
        return outputs[0]
    if ctx.num_outputs > 3 and qk_out is None:
        ctx.refuse(f"qk_matmul_output_mode={mode}", "edgeq supports modes 0 to 3")
    return relax.Tuple([bb.normalize(o) for o in outputs[: ctx.num_outputs]])


def expand(ctx, inputs, attr):
    """A constant target shape gives a static broadcast (TVM's converter leaves it symbolic when the shape
    is an initializer rather than a shape expression)."""
    shape = ctx.const(inputs[1])
    if shape is None:
        return ctx.tvm(inputs, attr)
    out = np.broadcast_shapes(tuple(_shape(inputs[0])), tuple(int(d) for d in shape.reshape(-1)))
    return relax.op.broadcast_to(inputs[0], list(out))


def reduce_bool(ctx, inputs, attr):
    """ReduceMax / ReduceMin of bool (opset 20: any / all): reduced as uint8 and cast back, since TVM has no
    min or max value for bool; other types are TVM's."""
    if _dtype(inputs[0]) != "bool":
        return ctx.tvm(inputs, attr)
    reduced = ctx.tvm([ctx.bb.emit(relax.op.astype(inputs[0], "uint8")), *inputs[1:]], attr)
    return relax.op.astype(ctx.bb.normalize(reduced), "bool")


def one_hot(ctx, inputs, attr):
    """OneHot with the on/off values computed at run time as well (TVM needs them constant)."""
    indices, depth, values = inputs[0], inputs[1], inputs[2]
    depth = int(ctx.need_const(depth, "depth").reshape(-1)[0])
    rank = len(_shape(indices)) + 1
    axis = _axis(int(attr.get("axis", -1)), rank)
    idx = relax.op.astype(indices, "int64") if _dtype(indices) != "int64" else indices
    idx = relax.op.where(relax.op.less(idx, _c(0, "int64")), relax.op.add(idx, _c(depth, "int64")), idx)
    positions = [1] * rank
    positions[axis] = depth
    hot = relax.op.equal(relax.op.expand_dims(idx, axis), _c(np.arange(depth).reshape(positions), "int64"))
    off = relax.op.reshape(_slice(values, 0, 0, 1), [])
    on = relax.op.reshape(_slice(values, 0, 1, 2), [])
    return relax.op.where(hot, on, off)


def pad(ctx, inputs, attr):
    """Pad whose constant value is computed at run time: pad with zeros, then put the value where the
    (build-time) mask of the padding says."""
    value = inputs[2] if len(inputs) > 2 else None
    if ctx.opset < 11 or value is None or ctx.const(value) is not None or attr.get("mode", b"constant") != b"constant":
        return ctx.tvm(inputs, attr)
    x = inputs[0]
    shape = _shape(x)
    pads = [int(p) for p in ctx.need_const(inputs[1], "pads").reshape(-1)]
    axes = ctx.optional_const(inputs, 3, "axes")
    axes = list(range(len(shape))) if axes is None else [_axis(int(a), len(shape)) for a in axes.reshape(-1)]
    before, after = [0] * len(shape), [0] * len(shape)
    for i, axis in enumerate(axes):
        before[axis], after[axis] = pads[i], pads[i + len(axes)]
    if min(before + after) < 0:
        ctx.refuse("negative pads with a run-time pad value", "make the pad value a constant")
    padded = ctx.bb.emit_te(topi.nn.pad, x, before, after, 0.0)
    mask = np.pad(np.ones(shape, bool), list(zip(before, after)))
    return relax.op.where(_c(mask), padded, relax.op.reshape(value, []))


def upsample(ctx, inputs, attr):
    x = inputs[0]
    shape = _shape(x)
    scales = attr.get("scales") if ctx.opset < 9 else ctx.need_const(inputs[1], "scales")
    scales = [float(v) for v in np.asarray(scales).reshape(-1)]
    mode = attr.get("mode", b"nearest").decode()
    out = [int(math.floor(d * s)) for d, s in zip(shape, scales)]
    if mode == "nearest":
        for axis, (d, s, o) in enumerate(zip(shape, scales, out)):
            if o != d:
                index = np.minimum(np.floor(np.arange(o) / s), d - 1).astype("int64")
                x = ctx.bb.emit(relax.op.take(x, _c(index), axis=axis))
        return x
    if len(shape) == 4 and scales[:2] == [1.0, 1.0]:
        return relax.op.image.resize2d(x, out[2:], method="linear", coordinate_transformation_mode="asymmetric")
    ctx.refuse(f"mode '{mode}' with scales {scales}", "use Resize, or nearest mode")


def dft(ctx, inputs, attr):
    """DFT as products with cosine and sine matrices along the transformed axis (any length, not only
    powers of two); the inverse of a one-sided spectrum (irfft) is refused."""
    x = inputs[0]
    shape = _shape(x)
    rank = len(shape)
    if ctx.opset >= 20:
        axis_value = ctx.optional_const(inputs, 2, "axis")
        axis = -2 if axis_value is None else int(axis_value.reshape(-1)[0])
    else:
        axis = int(attr.get("axis", 1))
    axis = _axis(axis, rank)
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
    parts = [bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.squeeze(_slice(x, rank - 1, c, c + 1), [rank - 1]),
                                                           order), dt))
             for c in range(shape[-1])]
    if length < n:
        parts = [bb.emit(_slice(p, rank - 2, 0, length)) for p in parts]
    elif length > n:
        widths = [0] * (rank - 2)
        parts = [bb.emit_te(topi.nn.pad, p, widths + [0], widths + [length - n], 0.0) for p in parts]
    out_len = length // 2 + 1 if onesided else length
    k = np.arange(length)[:, None] * np.arange(out_len)[None, :]
    cos = _c(np.cos(2 * np.pi * k / length), dt)
    sin = _c(np.sin(2 * np.pi * k / length), dt)
    sign = 1.0 if inverse else -1.0  # e^{sign i 2 pi n k / L}
    real = parts[0]
    imag = parts[1] if len(parts) > 1 else None
    yr = relax.op.matmul(real, cos)
    yi = relax.op.multiply(relax.op.matmul(real, sin), _c(sign, dt))
    if imag is not None:
        yr = relax.op.subtract(yr, relax.op.multiply(relax.op.matmul(imag, sin), _c(sign, dt)))
        yi = relax.op.add(yi, relax.op.matmul(imag, cos))
    if inverse:
        yr, yi = relax.op.divide(yr, _c(length, dt)), relax.op.divide(yi, _c(length, dt))
    y = relax.op.stack([bb.normalize(yr), bb.normalize(yi)], axis=rank - 1)  # (..., out_len, 2)
    back = list(np.argsort(order)) + [rank - 1]
    return relax.op.astype(relax.op.permute_dims(y, [int(a) for a in back]), _dtype(x))


def causal_conv_with_state(ctx, inputs, attr):
    """Depthwise causal 1-D convolution over [past state, input]; the state carried on is the last k - 1
    positions (Mamba, Gated DeltaNet)."""
    args = list(inputs) + [None] * 2
    x, w, bias, past = args[:4]
    b, c, _ = _shape(x)
    k = _shape(w)[2]
    bb = ctx.bb
    dt = _dtype(x)
    if k > 1:
        past = past if past is not None else _c(np.zeros((b, c, k - 1)), dt)
        padded = bb.emit(relax.op.concat([past, x], axis=2))
    else:
        padded = x
    f32 = (lambda t: relax.op.astype(t, "float32")) if dt != "float32" else (lambda t: t)  # accumulate in float32
    y = relax.op.nn.conv1d(f32(padded), f32(w), groups=c)
    if bias is not None:
        y = relax.op.add(y, relax.op.reshape(f32(bias), [1, c, 1]))
    y = bb.emit(relax.op.astype(y, dt) if dt != "float32" else y)
    activation = attr.get("activation", b"none").decode()
    if activation in ("silu", "swish"):  # in float32, as ONNX's reference
        y32 = bb.emit(relax.op.astype(y, "float32")) if dt != "float32" else y
        y = bb.emit(relax.op.astype(relax.op.multiply(y32, relax.op.sigmoid(y32)), dt))
    if ctx.num_outputs == 1:
        return y
    if k == 1:
        ctx.refuse("kernel size 1 carries an empty state (a tensor of length 0)", "leave the present_state output out")
    total = _shape(padded)[2]
    return relax.Tuple([y, bb.normalize(_slice(padded, 2, total - (k - 1), total))])


def linear_attention(ctx, inputs, attr):
    """Linear attention as a recurrence over the (static) sequence, unrolled: a state of d_k x d_v per
    head, decayed (gated rules), corrected by what it already holds (delta rules), read by the queries."""
    args = list(inputs) + [None] * 3
    q, k, v, past, decay, beta = args[:6]
    rule = attr.get("update_rule", b"gated_delta").decode()
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    qh, kvh = int(attr.get("q_num_heads", 0)), int(attr.get("kv_num_heads", 0))
    if not qh or not kvh or qh % kvh:
        ctx.refuse("q_num_heads/kv_num_heads missing or not a multiple", "set both attributes")
    if gating != (decay is not None) or delta != (beta is not None):
        ctx.refuse(f"update_rule '{rule}' with the decay/beta inputs it does not take", "fix the model")
    bb = ctx.bb
    out_dt = _dtype(q)
    b, t, _ = _shape(q)
    dk, dv = _shape(q)[2] // qh, _shape(v)[2] // kvh
    f32 = "float32"

    def heads(x, n):  # (B, T, n*d) -> (B, n, T, d) in float32
        d = _shape(x)[2] // n
        return bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.reshape(x, [b, t, n, d]), [0, 2, 1, 3]), f32))

    q4, k4, v4 = heads(q, qh), heads(k, kvh), heads(v, kvh)
    if decay is not None:
        last = _shape(decay)[-1]
        decay4 = heads(decay, kvh) if last != kvh else bb.emit(relax.op.astype(relax.op.permute_dims(
            relax.op.reshape(decay, [b, t, kvh, 1]), [0, 2, 1, 3]), f32))  # (B, Hkv, T, 1 or dk)
    if beta is not None:
        last = _shape(beta)[-1]
        beta4 = bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.reshape(beta, [b, t, last, 1]), [0, 2, 1, 3]), f32))
    state = bb.emit(relax.op.astype(past, f32)) if past is not None else _c(np.zeros((b, kvh, dk, dv)), f32)
    scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(dk)
    group = qh // kvh

    def step(x, i):  # time step i of a (B, H, T, d) tensor -> (B, H, d)
        return bb.emit(relax.op.squeeze(_slice(x, 2, i, i + 1), [2]))

    outs = []
    for i in range(t):
        q_t, k_t, v_t = step(q4, i), step(k4, i), step(v4, i)
        if gating:
            state = bb.emit(relax.op.multiply(state, relax.op.expand_dims(relax.op.exp(step(decay4, i)), 3)))
        if delta:
            retrieved = relax.op.sum(relax.op.multiply(state, relax.op.expand_dims(k_t, 3)), axis=[2])
            v_t = bb.emit(relax.op.multiply(step(beta4, i), relax.op.subtract(v_t, retrieved)))
        state = bb.emit(relax.op.add(state, relax.op.multiply(relax.op.expand_dims(k_t, 3), relax.op.expand_dims(v_t, 2))))
        read = state
        if group > 1:
            read = bb.emit(relax.op.reshape(relax.op.broadcast_to(relax.op.expand_dims(state, 2), [b, kvh, group, dk, dv]),
                                            [b, qh, dk, dv]))
        o_t = relax.op.sum(relax.op.multiply(relax.op.expand_dims(q_t, 3), read), axis=[2])
        outs.append(bb.emit(relax.op.multiply(o_t, _c(scale, f32))))
    y = relax.op.reshape(relax.op.permute_dims(relax.op.stack(outs, axis=2), [0, 2, 1, 3]), [b, t, qh * dv])
    y = relax.op.astype(y, out_dt)
    state_dt = _dtype(past) if past is not None else out_dt
    return relax.Tuple([bb.normalize(y), bb.normalize(relax.op.astype(state, state_dt))])


# ----------------------------------------------------------------------------------------------- QOperator


def _int32(ctx, x, zero_point, axis: int | None = None):
    """``x - zero_point`` in int32; a per-channel zero point is broadcast along ``axis``."""
    x = ctx.bb.emit(relax.op.astype(x, "int32"))
    if zero_point is None:
        return x
    zp = relax.op.astype(zero_point, "int32")
    size = math.prod(_shape(zero_point))
    if size > 1 and axis is not None:
        shape = [1] * len(_shape(x))
        shape[axis] = size
        zp = relax.op.reshape(zp, shape)
    elif len(_shape(zero_point)):
        zp = relax.op.reshape(zp, [])
    return ctx.bb.emit(relax.op.subtract(x, zp))


def _conv_int32(ctx, x, w, attr):
    """TVM's Conv converter (auto_pad, 1-D to 3-D) on int32 operands: exact int32 accumulation."""
    conv = _TVM_CONVERT_MAP()["Conv"].get_converter(ctx.opset)
    return ctx.bb.normalize(conv(ctx.bb, [x, w, None], attr, ctx.params))


def _requantize(ctx, acc, scale, zero_point, out_dtype: str, axis: int | None):
    """``acc * scale`` rounded half to even, plus the zero point, saturated to ``out_dtype``."""
    scale = ctx.bb.emit(relax.op.astype(scale, "float32"))
    if math.prod(_shape(scale)) > 1 and axis is not None:
        shape = [1] * len(_shape(acc))
        shape[axis] = -1
        scale = relax.op.reshape(scale, shape)
    elif _shape(scale):
        scale = relax.op.reshape(scale, [])
    y = relax.op.round(relax.op.multiply(relax.op.astype(acc, "float32"), scale))
    if zero_point is not None:
        y = relax.op.add(y, relax.op.reshape(relax.op.astype(zero_point, "float32"), []))
    info = np.iinfo(out_dtype)
    return relax.op.astype(relax.op.clip(y, int(info.min), int(info.max)), out_dtype)


def conv_integer(ctx, inputs, attr):
    args = list(inputs) + [None] * 2
    x = _int32(ctx, args[0], args[2])
    w = _int32(ctx, args[1], args[3], axis=0)
    return _conv_int32(ctx, x, w, attr)


def qlinear_conv(ctx, inputs, attr):
    """QLinearConv as ONNX Runtime computes it: int32 accumulation of the zero-point-shifted operands,
    plus the int32 bias, times x_scale * w_scale / y_scale, rounded, shifted, saturated."""
    args = list(inputs) + [None]
    x, xs, xzp, w, ws, wzp, ys, yzp, bias = args[:9]
    acc = _conv_int32(ctx, _int32(ctx, x, xzp), _int32(ctx, w, wzp, axis=0), attr)
    rank = len(_shape(acc))
    if bias is not None:
        channels = _shape(bias)[0]
        acc = relax.op.add(acc, relax.op.reshape(relax.op.astype(bias, "int32"), [1, channels] + [1] * (rank - 2)))
    scale = relax.op.divide(relax.op.multiply(relax.op.astype(xs, "float32"), relax.op.astype(ws, "float32")),
                            relax.op.astype(ys, "float32"))
    return _requantize(ctx, ctx.bb.emit(acc), ctx.bb.emit(scale), yzp, _dtype(x if yzp is None else yzp), axis=1)


def qlinear_matmul(ctx, inputs, attr):
    a, a_s, azp, b, b_s, bzp, ys, yzp = inputs[:8]
    a_rank, b_rank = len(_shape(a)), len(_shape(b))
    acc = relax.op.matmul(_int32(ctx, a, azp, axis=a_rank - 2), _int32(ctx, b, bzp, axis=b_rank - 1), out_dtype="int32")
    acc = ctx.bb.emit(acc)
    scale = relax.op.divide(relax.op.multiply(relax.op.astype(a_s, "float32"), relax.op.astype(b_s, "float32")),
                            relax.op.astype(ys, "float32"))
    return _requantize(ctx, acc, ctx.bb.emit(scale), yzp, _dtype(yzp), axis=len(_shape(acc)) - 1)


def qgemm(ctx, inputs, attr):
    """com.microsoft QGemm (what ONNX Runtime's QOperator quantizer makes of Gemm): the int32 product of the
    zero-point-shifted operands plus the int32 bias ``C`` (scale ``alpha * a_scale * b_scale``), times
    ``alpha * a_scale * b_scale``, requantized to ``y_scale``/``y_zero_point`` where given, else float."""
    args = list(inputs) + [None] * 9
    a, a_s, azp, b, b_s, bzp, c, ys, yzp = args[:9]
    alpha = float(attr.get("alpha", 1.0))
    trans_a, trans_b = int(attr.get("transA", 0)), int(attr.get("transB", 0))
    a32 = _int32(ctx, a, azp)
    b32 = _int32(ctx, b, bzp, axis=0 if trans_b else 1)  # a zero point per output column
    if trans_a:
        a32 = ctx.bb.emit(relax.op.permute_dims(a32, [1, 0]))
    if trans_b:
        b32 = ctx.bb.emit(relax.op.permute_dims(b32, [1, 0]))
    acc = relax.op.matmul(a32, b32, out_dtype="int32")
    if c is not None:
        acc = relax.op.add(acc, relax.op.astype(c, "int32"))
    acc = ctx.bb.emit(acc)
    # (alpha * a_scale) * b_scale, in ONNX Runtime's order (a float output differed in its last bit otherwise)
    scale = relax.op.multiply(relax.op.multiply(_c(alpha, "float32"), relax.op.astype(a_s, "float32")),
                              relax.op.astype(b_s, "float32"))
    if ys is None:
        columns = math.prod(_shape(b_s))
        scale = relax.op.reshape(scale, [1, columns] if columns > 1 else [])
        return relax.op.multiply(relax.op.astype(acc, "float32"), scale)
    scale = ctx.bb.emit(relax.op.divide(scale, relax.op.astype(ys, "float32")))
    return _requantize(ctx, acc, scale, yzp, _dtype(yzp) if yzp is not None else "uint8", axis=1)


# ----------------------------------------------------------------------------------------------- losses


def _nll(ctx, log_prob, target, weight, attr):
    """Negative log-likelihood of ``target`` classes (axis 1) with optional class weights and ignore_index."""
    reduction = attr.get("reduction", b"mean").decode()
    ignore = attr.get("ignore_index")
    target = relax.op.astype(target, "int64") if _dtype(target) != "int64" else target
    mask = None
    if ignore is not None:
        mask = ctx.bb.emit(relax.op.not_equal(target, _c(int(ignore), "int64")))
        target = ctx.bb.emit(relax.op.where(mask, target, _c(0, "int64")))
    dt = _dtype(log_prob)
    target = ctx.bb.emit(relax.op.clip(target, 0, _shape(log_prob)[1] - 1))  # never read outside the classes
    picked = relax.op.squeeze(relax.op.gather_elements(log_prob, relax.op.expand_dims(target, 1), axis=1), [1])
    w = relax.op.take(weight, target, axis=0) if weight is not None else None
    if mask is not None:
        keep = relax.op.astype(mask, dt)
        w = keep if w is None else relax.op.multiply(w, keep)
    loss = relax.op.negative(picked)
    if w is not None:
        w = ctx.bb.emit(w)
        loss = relax.op.multiply(loss, w)
    loss = ctx.bb.emit(loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return relax.op.sum(loss)
    if w is None:
        return relax.op.mean(loss)
    return relax.op.divide(relax.op.sum(loss), relax.op.sum(w))


def negative_log_likelihood_loss(ctx, inputs, attr):
    return _nll(ctx, inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None, attr)


def softmax_cross_entropy_loss(ctx, inputs, attr):
    log_prob = ctx.bb.emit(relax.op.nn.log_softmax(inputs[0], axis=1))
    loss = _nll(ctx, log_prob, inputs[1], inputs[2] if len(inputs) > 2 else None, attr)
    return relax.Tuple([ctx.bb.normalize(loss), log_prob]) if ctx.num_outputs > 1 else loss


def indices_in_range(ctx, inputs, attr):
    """Gather, GatherElements, ScatterElements, Scatter with run-time indices clamped into the axis before
    TVM's converter sees them. ONNX calls an index out of range an error; TVM's kernels do not check, so
    one would read or write outside the tensor (seen: the golden run reading garbage). In range, nothing
    changes."""
    data, indices = inputs[0], inputs[1]
    if (ctx.const(indices) is not None or not isinstance(data.ty, relax.TensorType)
            or not isinstance(indices.ty, relax.TensorType)):
        return ctx.tvm(inputs, attr)
    shape = _shape(data)
    axis = _axis(int(attr.get("axis", 0)), len(shape))
    dim, dt = shape[axis], _dtype(indices)
    index = indices
    if not dt.startswith("uint"):
        index = relax.op.where(relax.op.less(index, _c(0, dt)), relax.op.add(index, _c(dim, dt)), index)
    index = ctx.bb.emit(relax.op.clip(index, 0, max(dim - 1, 0)))
    return ctx.tvm(onnx_frontend.onnx_input([data, index, *inputs[2:]]), attr)


# ----------------------------------------------------------------------------------------------- recurrent


_ACTIVATIONS = {  # name -> (fn(x, alpha, beta, dtype), default alpha, default beta); None: takes no alpha/beta
    "Sigmoid": (lambda x, a, b, dt: relax.op.sigmoid(x), None, None),
    "Tanh": (lambda x, a, b, dt: relax.op.tanh(x), None, None),
    "Relu": (lambda x, a, b, dt: relax.op.nn.relu(x), None, None),
    "Softsign": (lambda x, a, b, dt: relax.op.divide(x, relax.op.add(_c(1, dt), relax.op.abs(x))), None, None),
    "Softplus": (lambda x, a, b, dt: relax.op.log(relax.op.add(_c(1, dt), relax.op.exp(x))), None, None),
    "LeakyRelu": (lambda x, a, b, dt: relax.op.where(relax.op.less(x, _c(0, dt)), relax.op.multiply(x, _c(a, dt)), x),
                  0.01, None),
    "ThresholdedRelu": (lambda x, a, b, dt: relax.op.where(relax.op.greater(x, _c(a, dt)), x, _c(0, dt)), 1.0, None),
    "Elu": (lambda x, a, b, dt: relax.op.where(relax.op.less(x, _c(0, dt)),
                                               relax.op.multiply(_c(a, dt), relax.op.subtract(relax.op.exp(x), _c(1, dt))), x),
            1.0, None),
    "HardSigmoid": (lambda x, a, b, dt: relax.op.clip(relax.op.add(relax.op.multiply(x, _c(a, dt)), _c(b, dt)), 0, 1),
                    0.2, 0.5),
    "Affine": (lambda x, a, b, dt: relax.op.add(relax.op.multiply(x, _c(a, dt)), _c(b, dt)), 1.0, 0.0),
    "ScaledTanh": (lambda x, a, b, dt: relax.op.multiply(_c(a, dt), relax.op.tanh(relax.op.multiply(x, _c(b, dt)))),
                   1.0, 1.0),
}


def _activations(ctx, attr, defaults: list[str], directions: int, dt: str):
    names = [n.decode() if isinstance(n, bytes) else n for n in attr.get("activations", ())]
    names = names or defaults
    if len(names) == len(defaults):
        names = names * directions
    alphas, betas = list(attr.get("activation_alpha", ())), list(attr.get("activation_beta", ()))
    out = []
    for name in names:
        found = next((v for k, v in _ACTIVATIONS.items() if k.lower() == name.lower()), None)
        if found is None:
            ctx.refuse(f"activation '{name}'", f"edgeq supports {', '.join(_ACTIVATIONS)}")
        fn, a, b = found
        a = alphas.pop(0) if a is not None and alphas else a
        b = betas.pop(0) if b is not None and betas else b
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b, dt))
    return [out[i * len(defaults):(i + 1) * len(defaults)] for i in range(directions)]


def recurrent(ctx, inputs, attr):
    """RNN, GRU and LSTM, unrolled over the (static) sequence: the input projection for every step in one
    matrix product, then per step the recurrent product and the gates (ONNX's equations and gate orders:
    RNN i; GRU z, r, h; LSTM i, o, f, c)."""
    op = ctx.op
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    defaults = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}[op]
    args = list(inputs) + [None] * 8
    x, w, r, b, lens, h0 = args[:6]
    c0, peep = (args[6], args[7]) if op == "LSTM" else (None, None)
    bb = ctx.bb
    dt = _dtype(x)
    layout = int(attr.get("layout", 0))
    if layout:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
    steps, batch, _ = _shape(x)
    hidden = int(attr.get("hidden_size", _shape(r)[-1]))
    direction = attr.get("direction", b"forward").decode()
    directions = 2 if direction == "bidirectional" else 1
    acts = _activations(ctx, attr, defaults, directions, dt)
    clip = attr.get("clip")
    if lens is not None:
        value = ctx.const(lens)
        if value is None or not np.all(value == steps):
            ctx.refuse("sequence_lens shorter than the sequence", "pad the batch to one length and leave sequence_lens out")
    if int(attr.get("input_forget", 0)):
        ctx.refuse("input_forget=1", "edgeq supports LSTM without coupled input and forget gates")
    linear_before_reset = int(attr.get("linear_before_reset", 0))

    def pick(t, d):  # direction d of a (directions, ...) tensor
        return bb.emit(relax.op.squeeze(_slice(t, 0, d, d + 1), [0]))

    def chunk(t, i, axis):  # gate i of a tensor holding all gates along axis
        return bb.emit(_slice(t, axis, i * hidden, (i + 1) * hidden))

    ys, hs, cs = [], [], []
    for d in range(directions):
        f, g, hfn = (acts[d] + [None, None])[:3]
        wd, rd = pick(w, d), pick(r, d)  # (G*H, I), (G*H, H)
        xw = bb.emit(relax.op.matmul(x, relax.op.permute_dims(wd, [1, 0])))  # (S, B, G*H)
        if b is not None:
            bd = pick(b, d)
            wb = bb.emit(_slice(bd, 0, 0, gates * hidden))
            rb = bb.emit(_slice(bd, 0, gates * hidden, 2 * gates * hidden))
            if op == "GRU":  # the h gate's recurrent bias sits inside the reset product
                xw = bb.emit(relax.op.add(xw, relax.op.add(wb, relax.op.concat(
                    [_slice(rb, 0, 0, 2 * hidden), _c(np.zeros(hidden), dt)], axis=0))))
                rbh = chunk(rb, 2, 0)
            else:
                xw = bb.emit(relax.op.add(xw, relax.op.add(wb, rb)))
        rbh = rbh if b is not None and op == "GRU" else _c(np.zeros(hidden), dt)
        rt = bb.emit(relax.op.permute_dims(rd, [1, 0]))  # (H, G*H)
        h = pick(h0, d) if h0 is not None else _c(np.zeros((batch, hidden)), dt)
        c = pick(c0, d) if c0 is not None else _c(np.zeros((batch, hidden)), dt)
        if peep is not None:
            pd = pick(peep, d)
            pi, po, pf = chunk(pd, 0, 0), chunk(pd, 1, 0), chunk(pd, 2, 0)
        order = range(steps - 1, -1, -1) if (direction == "reverse" or d == 1) else range(steps)
        outs = {}

        def pre(t):
            return relax.op.clip(t, -float(clip), float(clip)) if clip is not None else t

        for t in order:
            xt = bb.emit(relax.op.squeeze(_slice(xw, 0, t, t + 1), [0]))  # (B, G*H)
            if op == "RNN":
                h = bb.emit(f(pre(relax.op.add(xt, relax.op.matmul(h, rt)))))
            elif op == "GRU":
                hr = bb.emit(relax.op.matmul(h, _slice(rt, 1, 0, 2 * hidden)))
                z = bb.emit(f(pre(relax.op.add(chunk(xt, 0, 1), chunk(hr, 0, 1)))))
                reset = bb.emit(f(pre(relax.op.add(chunk(xt, 1, 1), chunk(hr, 1, 1)))))
                rh = _slice(rt, 1, 2 * hidden, 3 * hidden)
                if linear_before_reset:
                    rec = relax.op.multiply(reset, relax.op.add(relax.op.matmul(h, rh), rbh))
                else:
                    rec = relax.op.add(relax.op.matmul(relax.op.multiply(reset, h), rh), rbh)
                cand = bb.emit(g(pre(relax.op.add(chunk(xt, 2, 1), rec))))
                h = bb.emit(relax.op.add(relax.op.multiply(relax.op.subtract(_c(1, dt), z), cand), relax.op.multiply(z, h)))
            else:
                pre_gates = bb.emit(relax.op.add(xt, relax.op.matmul(h, rt)))
                gi, go, gf, gc = (chunk(pre_gates, i, 1) for i in range(4))
                if peep is not None:
                    gi = relax.op.add(gi, relax.op.multiply(pi, c))
                    gf = relax.op.add(gf, relax.op.multiply(pf, c))
                i_ = bb.emit(f(pre(gi)))
                f_ = bb.emit(f(pre(gf)))
                c = bb.emit(relax.op.add(relax.op.multiply(f_, c), relax.op.multiply(i_, g(pre(gc)))))
                if peep is not None:
                    go = relax.op.add(go, relax.op.multiply(po, c))
                o_ = bb.emit(f(pre(go)))
                h = bb.emit(relax.op.multiply(o_, hfn(c)))
            outs[t] = h
        ys.append(bb.emit(relax.op.stack([outs[t] for t in range(steps)], axis=0)))  # (S, B, H)
        hs.append(h)
        cs.append(c)
    y = bb.emit(relax.op.stack(ys, axis=1))  # (S, D, B, H)
    yh = bb.emit(relax.op.stack(hs, axis=0))  # (D, B, H)
    yc = bb.emit(relax.op.stack(cs, axis=0))
    if layout:
        y = relax.op.permute_dims(y, [2, 0, 1, 3])  # (B, S, D, H)
        yh = relax.op.permute_dims(yh, [1, 0, 2])
        yc = relax.op.permute_dims(yc, [1, 0, 2])
    outputs = [y, yh, yc][: 3 if op == "LSTM" else 2]
    return relax.Tuple([bb.normalize(o) for o in outputs])


# ----------------------------------------------------------------------------------------------- refusals


def data_dependent(ctx, inputs, attr):
    """Ops whose output size depends on the input values: a bundle has static output shapes."""
    if ctx.op == "Compress" and ctx.const(inputs[1]) is not None:
        condition = ctx.const(inputs[1]).astype(bool).reshape(-1)
        axis = attr.get("axis")
        x = inputs[0] if axis is not None else relax.op.reshape(inputs[0], [-1])
        axis = 0 if axis is None else _axis(int(axis), len(_shape(inputs[0])))
        kept = np.nonzero(condition[: _shape(x)[axis]])[0].astype("int64")
        return relax.op.take(x, _c(kept), axis=axis)
    if ctx.op == "Compress" and _runtime_operands(inputs, ctx.params):
        ctx.refuse("its condition is computed at run time, and the size of its output depends on it (an edgeq bundle "
                   "has static output shapes)", "bind the graph input with --const NAME=FILE.npy (or make it an initializer)")
    ctx.refuse("the size of its output depends on the input values, and an edgeq bundle has static output shapes",
               f"end the model before {ctx.op} and run that step in the application")


def non_max_suppression(ctx, inputs, attr):
    """NonMaxSuppression padded to a static bound, with the count of real rows as a second output where
    the importer asked for one (``edgeq.nms``)."""
    from edgeq import nms

    boxes, scores = inputs[0], inputs[1]
    if _dtype(boxes) != "float32" or _dtype(scores) != "float32":
        ctx.refuse(f"boxes and scores are {_dtype(boxes)} and {_dtype(scores)}", "give it float32 boxes and scores")
    (batches, boxes_n, four), (batches2, classes, boxes_n2) = _shape(boxes), _shape(scores)
    if four != 4 or batches != batches2 or boxes_n != boxes_n2:
        ctx.refuse(f"boxes {_shape(boxes)} and scores {_shape(scores)} do not fit (ONNX: [B, N, 4] and [B, C, N])",
                   "fix the model")
    center = int(attr.get("center_point_box", 0))
    if center not in (0, 1):
        ctx.refuse(f"center_point_box is {center}", "ONNX allows 0 or 1")
    present = [i < len(inputs) and inputs[i] is not None for i in range(5)]
    limit_value = ctx.const(inputs[2]) if present[2] else np.zeros(1, "int64")
    per_class, rows = nms.bound(batches, classes, boxes_n,
                                None if limit_value is None else int(np.asarray(limit_value).reshape(-1)[0]),
                                ctx.max_detections)
    if rows == 0:
        ctx.refuse("max_output_boxes_per_class is 0 or absent, so it selects nothing (a bundle output cannot be empty)",
                   "give the model a positive max_output_boxes_per_class")
    iou_value = ctx.const(inputs[3]) if present[3] else np.zeros(1, "float32")
    if iou_value is not None:
        nms.check_iou_threshold(float(np.asarray(iou_value).reshape(-1)[0]), ctx.node)

    def scalar(index: int, dtype: str, default):
        if not present[index]:
            return _c(np.full(1, default, dtype))
        return relax.op.astype(relax.op.reshape(inputs[index], [1]), dtype)

    select = nms.select_func(batches, classes, boxes_n, per_class, center, present[4])
    collect = nms.collect_func(batches, classes, per_class, rows)
    bb, pairs = ctx.bb, batches * classes
    chosen = bb.emit(relax.call_tir(
        bb.add_func(select, "edgeq_nms_select"),
        relax.Tuple([boxes, scores, scalar(2, "int64", 0), scalar(3, "float32", 0.0), scalar(4, "float32", 0.0)]),
        [relax.TensorType([pairs, max(per_class, 1)], "int32"), relax.TensorType([pairs], "int32"),
         relax.TensorType([2, pairs, boxes_n], "int32")]))
    out = bb.emit(relax.call_tir(
        bb.add_func(collect, "edgeq_nms_collect"),
        relax.Tuple([bb.emit(relax.TupleGetItem(chosen, 0)), bb.emit(relax.TupleGetItem(chosen, 1))]),
        [relax.TensorType([rows, 3], "int64"), relax.TensorType([1], "int64")]))
    selected, count = relax.TupleGetItem(out, 0), relax.TupleGetItem(out, 1)
    return relax.Tuple([bb.normalize(selected), bb.normalize(count)]) if ctx.num_outputs == 2 else selected


def sequence_output(ctx, inputs, attr):
    ctx.refuse("it makes a sequence of tensors, and an edgeq bundle takes and returns tensors",
               "use Split, which returns the parts as separate tensors")


CONVERTERS: dict[str, Callable] = {
    "Swish": swish,
    "Celu": celu,
    "SwiGLU": swiglu,
    "LpNormalization": lp_normalization,
    "CumProd": cum_prod,
    "HannWindow": constant_window,
    "HammingWindow": constant_window,
    "BlackmanWindow": constant_window,
    "MelWeightMatrix": constant_window,
    "CenterCropPad": center_crop_pad,
    "ReverseSequence": reverse_sequence,
    "TensorScatter": tensor_scatter,
    "BitCast": bit_cast,
    "Det": det,
    "Col2Im": col2im,
    "RotaryEmbedding": rotary_embedding,
    "Attention": attention,
    "DFT": dft,
    "CausalConvWithState": causal_conv_with_state,
    "LinearAttention": linear_attention,
    "QLinearConv": qlinear_conv,
    "QLinearMatMul": qlinear_matmul,
    "QGemm": qgemm,
    "ConvInteger": conv_integer,
    "NegativeLogLikelihoodLoss": negative_log_likelihood_loss,
    "SoftmaxCrossEntropyLoss": softmax_cross_entropy_loss,
    "RNN": recurrent,
    "GRU": recurrent,
    "LSTM": recurrent,
    # overrides of TVM's converters
    "Mish": mish,
    "LayerNormalization": layer_normalization,
    "RMSNormalization": rms_normalization,
    "NonMaxSuppression": non_max_suppression,
    "NonZero": data_dependent,
    "Unique": data_dependent,
    "Compress": data_dependent,
    "SplitToSequence": sequence_output,
    "Gather": indices_in_range,
    "GatherElements": indices_in_range,
    "ScatterElements": indices_in_range,
    "Scatter": indices_in_range,
    "Expand": expand,
    "OneHot": one_hot,
    "ReduceMax": reduce_bool,
    "ReduceMin": reduce_bool,
    "Pad": pad,
    "Upsample": upsample,
}

OVERRIDES = {
    "Attention": "TVM's converter is com.microsoft's Attention; ONNX's own (opset 23) is converted here",
    "Mish": "TVM's log(1 + e^x) loses small values for negative x (off by ~1e-6)",
    "LayerNormalization": "TVM returns 0-d placeholders for the optional Mean and InvStdDev outputs",
    "RMSNormalization": "TVM's rms_norm fails to build when the scale has the input's rank (axis 0)",
    "NonMaxSuppression": "TVM's result is trimmed at run time; edgeq's is padded to a static bound with a count (edgeq.nms)",
    "NonZero": "data-dependent output size: refused in one line instead of failing in the build",
    "Unique": "data-dependent output size: refused in one line instead of failing in the build",
    "Compress": "a constant condition becomes a take of fixed indices; a computed one is refused",
    "SplitToSequence": "a sequence cannot be a bundle's output: refused in one line",
    "Gather": "run-time indices clamped into the axis: TVM's take reads out of bounds on a bad index",
    "GatherElements": "run-time indices clamped into the axis (as Gather)",
    "ScatterElements": "run-time indices clamped into the axis: TVM would write out of bounds",
    "Scatter": "run-time indices clamped into the axis (as ScatterElements)",
    "Expand": "TVM leaves the shape symbolic when the target shape is an initializer",
    "OneHot": "TVM needs the on/off values constant",
    "ReduceMax": "bool inputs (any): TVM has no min value for bool",
    "ReduceMin": "bool inputs (all): TVM has no max value for bool",
    "Pad": "TVM needs the pad value constant",
    "Upsample": "TVM's converter fails when the scales are an input (opset 9)",
}


# ----------------------------------------------------------------------------------------------- hook


def known_ops() -> set[str]:
    """Every ONNX op type an import can convert (TVM's and edgeq's)."""
    return set(_TVM_CONVERT_MAP()) | set(CONVERTERS) | {"Constant", "If"}


_TVM_CONVERT_MAP = onnx_frontend._get_convert_map
_FAILED_BUILDERS: list = []


class _Converter:
    """What TVM's importer expects of a converter class: ``get_converter(opset)`` -> fn(bb, inputs, attr, params)."""

    def __init__(self, op: str, fn: Callable | None, tvm_class, max_detections: int | None = None):
        self.op, self.fn, self.tvm_class, self.max_detections = op, fn, tvm_class, max_detections

    def get_converter(self, opset: int):
        def convert(bb, inputs, attr, params):
            custom = attr.get("tvm_custom", {})
            node = str(custom.get("name") or self.op)
            try:
                if self.fn is not None:
                    ctx = Context(bb, opset, self.op, node, int(custom.get("num_outputs", 1)), params, self.tvm_class,
                                  self.max_detections)
                    result = self.fn(ctx, inputs, attr)
                else:
                    result = self.tvm_class.get_converter(opset)(bb, inputs, attr, params)
                if isinstance(result, relax.Expr):
                    result = bb.normalize(result)
            except (Refused, ConversionError):
                _FAILED_BUILDERS.append(bb)
                raise
            except Exception as err:  # noqa: BLE001 - TVM's converters raise anything
                _FAILED_BUILDERS.append(bb)
                raise ConversionError(self.op, node, err, _runtime_operands(inputs, params, self.op)) from err
            _check_static(self.op, node, inputs, result, params)
            return result

        return convert


def _runtime_operands(inputs, params, op: str = "") -> bool:
    """Whether a shape-like operand (``edgeq.load.SHAPE_OPERANDS``' positions for ``op``, else every operand
    after the first) is a small tensor computed at run time."""
    from edgeq.load import SHAPE_OPERANDS

    positions = SHAPE_OPERANDS.get(op)
    operands = [inputs[i] for i in positions if i < len(inputs)] if positions else list(inputs)[1:]
    for expr in operands:
        if isinstance(expr, relax.Expr) and not isinstance(expr, tvm.ir.expr.Constant) \
                and not (isinstance(expr, relax.Var) and expr.name in params[1]) \
                and isinstance(expr.ty, relax.TensorType) and 0 <= expr.ty.ndim <= 1:
            return True
    return False


def _static(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_static(f) for f in ty.fields)
    if isinstance(ty, relax.TensorType):
        return isinstance(ty.shape, relax.ShapeExpr) and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values)
    if isinstance(ty, relax.ShapeType):
        return True
    return True  # objects, prim values: not this check's business


def _check_static(op: str, node: str, inputs, result, params) -> None:
    """Refuse, naming the op, a tensor of unknown shape made from operands of known shapes."""
    exprs = [e for e in inputs if isinstance(e, relax.Expr)]
    if not isinstance(result, relax.Expr) or not all(_static(e.ty) for e in exprs) or _static(result.ty):
        return
    if _runtime_operands(inputs, params, op):
        todo = ("its shape operand is computed at run time: make it an initializer, or bind the graph input "
                "with --const NAME=FILE.npy")
    else:
        todo = f"the size depends on the input values; end the model before {op} and run that step in the application"
    raise Refused(f"{op} node '{node}' makes a tensor of unknown shape, and an edgeq bundle has static shapes; {todo}")


@contextlib.contextmanager
def installed(max_detections: int | None = None):
    """TVM's ONNX importer with edgeq's converters added (for the duration of the ``with`` block)."""
    table = _TVM_CONVERT_MAP()
    merged = {op: _Converter(op, None, cls) for op, cls in table.items()}
    merged.update({op: _Converter(op, fn, table.get(op), max_detections) for op, fn in CONVERTERS.items()})
    previous = onnx_frontend._get_convert_map
    onnx_frontend._get_convert_map = lambda: merged
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = previous
        while _FAILED_BUILDERS:  # an import that failed leaves its builder a block open: close it, quietly
            with contextlib.suppress(Exception):
                _FAILED_BUILDERS.pop()._end_block()
