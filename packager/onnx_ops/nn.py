"""Activations, normalizations, attention and the state-space layers, and the training losses."""

from __future__ import annotations

import math

import numpy as np

from edgeq.tvm_env import relax

from edgeq.onnx_ops.context import dtype_of, normal_axis, relax_const, shape_of, slice_along


# ----------------------------------------------------------------------------------------------- activations


def swish(ctx, inputs, attr):
    x = inputs[0]
    alpha = float(attr.get("alpha", 1.0))
    return relax.op.multiply(x, relax.op.sigmoid(relax.op.multiply(x, relax_const(alpha, dtype_of(x)))))


def celu(ctx, inputs, attr):
    x = inputs[0]
    dt = dtype_of(x)
    alpha = float(attr.get("alpha", 1.0))
    zero = relax_const(0, dt)
    neg = relax.op.multiply(relax_const(alpha, dt), relax.op.subtract(relax.op.exp(relax.op.divide(x, relax_const(alpha, dt))), relax_const(1, dt)))
    return relax.op.add(relax.op.maximum(x, zero), relax.op.minimum(neg, zero))


def mish(ctx, inputs, attr):
    """x * tanh(softplus(x)) as x * n / (n + 2) with n = e^x (e^x + 2): exact for large negative x, where
    TVM's log(1 + e^x) loses the small values (off by more than 1e-7)."""
    x = inputs[0]
    dt = dtype_of(x)
    e = relax.op.exp(x)
    n = relax.op.multiply(e, relax.op.add(e, relax_const(2, dt)))
    y = relax.op.divide(relax.op.multiply(x, n), relax.op.add(n, relax_const(2, dt)))
    return relax.op.where(relax.op.greater(x, relax_const(20, dt)), x, y)


def swiglu(ctx, inputs, attr):
    a, b = inputs[0], inputs[1]
    return relax.op.multiply(swish(ctx, [a], attr), b)


# ----------------------------------------------------------------------------------------------- normalization


def lp_normalization(ctx, inputs, attr):
    x = inputs[0]
    dt = dtype_of(x)
    axis = normal_axis(int(attr.get("axis", -1)), len(shape_of(x)))
    p = int(attr.get("p", 2))
    if p == 1:
        norm = relax.op.sum(relax.op.abs(x), axis=[axis], keepdims=True)
    elif p == 2:
        norm = relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), axis=[axis], keepdims=True))
    else:
        ctx.refuse(f"p={p} (ONNX allows 1 and 2)", "fix the model")
    is_zero = relax.op.equal(norm, relax_const(0, dt))
    safe = relax.op.where(is_zero, relax_const(1, dt), norm)
    return relax.op.where(is_zero, relax_const(0, dt), relax.op.divide(x, safe))


def layer_normalization(ctx, inputs, attr):
    """All three outputs (Y, Mean, InvStdDev): TVM's converter returns 0-d placeholders for the last two."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    shape = shape_of(x)
    axis = normal_axis(int(attr.get("axis", -1)), len(shape))
    eps = float(attr.get("epsilon", 1e-5))
    axes = list(range(axis, len(shape)))
    dt = dtype_of(x)
    normalized = shape[axis:]
    if (ctx.num_outputs == 1 and dt == "float32" and shape_of(scale) == normalized
            and (bias is None or shape_of(bias) == normalized)):
        beta = bias if bias is not None else relax_const(np.zeros(normalized), dt)
        return relax.op.nn.layer_norm(x, scale, beta, axes, eps)
    stash = "float32" if int(attr.get("stash_type", 1)) == 1 else dt
    xs = relax.op.astype(x, stash) if stash != dt else x
    mean = ctx.bb.emit(relax.op.mean(xs, axis=axes, keepdims=True))
    d = ctx.bb.emit(relax.op.subtract(xs, mean))
    var = relax.op.mean(relax.op.multiply(d, d), axis=axes, keepdims=True)
    inv = ctx.bb.emit(relax.op.rsqrt(relax.op.add(var, relax_const(eps, stash))))
    y = relax.op.multiply(d, inv)
    y = relax.op.astype(y, dt) if stash != dt else y
    y = relax.op.multiply(y, scale)
    if bias is not None:
        y = relax.op.add(y, bias)
    return relax.Tuple([y, mean, inv])


def rms_normalization(ctx, inputs, attr):
    """Written out: TVM's rms_norm crashes when the scale has the rank of the input (axis 0)."""
    x, scale = inputs[0], inputs[1]
    shape = shape_of(x)
    axis = normal_axis(int(attr.get("axis", -1)), len(shape))
    eps = float(attr.get("epsilon", 1e-5))
    dt = dtype_of(x)
    stash = "float32" if int(attr.get("stash_type", 1)) == 1 else dt
    xs = relax.op.astype(x, stash) if stash != dt else x
    ms = relax.op.mean(relax.op.multiply(xs, xs), axis=list(range(axis, len(shape))), keepdims=True)
    y = relax.op.multiply(xs, relax.op.rsqrt(relax.op.add(ms, relax_const(eps, stash))))
    y = relax.op.astype(y, dt) if stash != dt else y
    return relax.op.multiply(y, scale)



# ----------------------------------------------------------------------------------------------- attention


def rotary_embedding(ctx, inputs, attr):
    x, cos, sin = inputs[0], inputs[1], inputs[2]
    positions = inputs[3] if len(inputs) > 3 else None
    shape = shape_of(x)
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
        x1, x2 = slice_along(xs, 3, 0, rot, 2), slice_along(xs, 3, 1, rot, 2)
    else:
        x1, x2 = slice_along(xs, 3, 0, half), slice_along(xs, 3, half, rot)
    x1, x2 = bb.emit(x1), bb.emit(x2)
    real = relax.op.subtract(relax.op.multiply(cos, x1), relax.op.multiply(sin, x2))
    imag = relax.op.add(relax.op.multiply(sin, x1), relax.op.multiply(cos, x2))
    if interleaved:
        rotated = relax.op.reshape(relax.op.stack([real, imag], axis=4), [b, s, h, rot])
    else:
        rotated = relax.op.concat([real, imag], axis=3)
    out = relax.op.concat([rotated, slice_along(xs, 3, rot, d)], axis=3) if rot < d else rotated
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
    out_dt = dtype_of(q)
    if out_dt in ("float16", "bfloat16"):  # accumulate in float32, as ONNX Runtime does
        q, k, v = (relax.op.astype(t, "float32") for t in (q, k, v))
        past_k, past_v = (None if t is None else bb.emit(relax.op.astype(t, "float32")) for t in (past_k, past_v))
        if mask is not None and dtype_of(mask) != "bool":
            mask = bb.emit(relax.op.astype(mask, "float32"))
        q, k, v = bb.emit(q), bb.emit(k), bb.emit(v)
    dt = dtype_of(q)
    rank = len(shape_of(q))
    if rank == 3:
        qh, kvh = int(attr.get("q_num_heads", 0)), int(attr.get("kv_num_heads", 0))
        if not qh or not kvh:
            ctx.refuse("3-D inputs without q_num_heads/kv_num_heads", "set both attributes")

        def heads(x, n):
            b, s, hidden = shape_of(x)
            return bb.emit(relax.op.permute_dims(relax.op.reshape(x, [b, s, n, hidden // n]), [0, 2, 1, 3]))

        q, k, v = heads(q, qh), heads(k, kvh), heads(v, kvh)
    batch, qh, sq, d = shape_of(q)
    if past_k is not None:
        k = bb.emit(relax.op.concat([past_k, k], axis=2))
        v = bb.emit(relax.op.concat([past_v, v], axis=2))
    present_k, present_v = k, v
    kvh, skv = shape_of(k)[1], shape_of(k)[2]
    past = shape_of(past_k)[2] if past_k is not None else 0
    if qh != kvh:  # grouped-query: each KV head serves qh / kvh query heads, interleaved [h0, h0, h1, h1, ...]
        rep = qh // kvh

        def repeat(x):
            shape = shape_of(x)
            x = relax.op.broadcast_to(relax.op.expand_dims(x, 2), [shape[0], shape[1], rep, *shape[2:]])
            return bb.emit(relax.op.reshape(x, [shape[0], shape[1] * rep, *shape[2:]]))

        k, v = repeat(k), repeat(v)
    scale = attr.get("scale")
    scale = float(np.sqrt(1.0 / np.sqrt(d) if scale is None else float(scale)))
    scores = relax.op.matmul(relax.op.multiply(q, relax_const(scale, dt)),
                             relax.op.permute_dims(relax.op.multiply(k, relax_const(scale, dt)), [0, 1, 3, 2]))
    scores = bb.emit(scores)
    softcap = float(attr.get("softcap", 0.0))
    if softcap > 0:
        scores = bb.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, relax_const(softcap, dt))), relax_const(softcap, dt)))
    capped = scores
    bias = None
    if mask is not None:
        mshape = shape_of(mask)
        if mshape[-1] < skv:
            fill = False if dtype_of(mask) == "bool" else -np.inf
            pad = relax_const(np.full(mshape[:-1] + [skv - mshape[-1]], fill, dtype_of(mask)))
            mask = relax.op.concat([mask, pad], axis=len(mshape) - 1)
        bias = relax.op.where(mask, relax_const(0, dt), relax_const(-np.inf, dt)) if dtype_of(mask) == "bool" else mask
    if int(attr.get("is_causal", 0)):
        allowed = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + past
        causal = relax_const(np.where(allowed, 0, -np.inf).astype(dt))
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
        masked = relax.op.equal(relax.op.max(bias, axis=[-1], keepdims=True), relax_const(-np.inf, dt))
        probs = bb.emit(relax.op.where(masked, relax_const(0, dtype_of(probs)), probs))
    if precision is not None:
        probs = bb.emit(relax.op.astype(probs, dt))
    if mode == 3:
        qk_out = probs
    y = relax.op.matmul(probs, v)
    if rank == 3:
        y = relax.op.reshape(relax.op.permute_dims(y, [0, 2, 1, 3]), [batch, sq, qh * shape_of(v)[3]])
    outputs = [y, present_k, present_v, qk_out]
    if out_dt != dt:
        outputs = [None if o is None else relax.op.astype(o, out_dt) for o in outputs]
    if ctx.num_outputs == 1:
        return outputs[0]
    if ctx.num_outputs > 3 and qk_out is None:
        ctx.refuse(f"qk_matmul_output_mode={mode}", "edgeq supports modes 0 to 3")
    return relax.Tuple([bb.normalize(o) for o in outputs[: ctx.num_outputs]])

def causal_conv_with_state(ctx, inputs, attr):
    """Depthwise causal 1-D convolution over [past state, input]; the state carried on is the last k - 1
    positions (Mamba, Gated DeltaNet)."""
    args = list(inputs) + [None] * 2
    x, w, bias, past = args[:4]
    b, c, _ = shape_of(x)
    k = shape_of(w)[2]
    bb = ctx.bb
    dt = dtype_of(x)
    if k > 1:
        past = past if past is not None else relax_const(np.zeros((b, c, k - 1)), dt)
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
    total = shape_of(padded)[2]
    return relax.Tuple([y, bb.normalize(slice_along(padded, 2, total - (k - 1), total))])

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
    out_dt = dtype_of(q)
    b, t, _ = shape_of(q)
    dk, dv = shape_of(q)[2] // qh, shape_of(v)[2] // kvh
    f32 = "float32"

    def heads(x, n):  # (B, T, n*d) -> (B, n, T, d) in float32
        d = shape_of(x)[2] // n
        return bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.reshape(x, [b, t, n, d]), [0, 2, 1, 3]), f32))

    q4, k4, v4 = heads(q, qh), heads(k, kvh), heads(v, kvh)
    if decay is not None:
        last = shape_of(decay)[-1]
        decay4 = heads(decay, kvh) if last != kvh else bb.emit(relax.op.astype(relax.op.permute_dims(
            relax.op.reshape(decay, [b, t, kvh, 1]), [0, 2, 1, 3]), f32))  # (B, Hkv, T, 1 or dk)
    if beta is not None:
        last = shape_of(beta)[-1]
        beta4 = bb.emit(relax.op.astype(relax.op.permute_dims(relax.op.reshape(beta, [b, t, last, 1]), [0, 2, 1, 3]), f32))
    state = bb.emit(relax.op.astype(past, f32)) if past is not None else relax_const(np.zeros((b, kvh, dk, dv)), f32)
    scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(dk)
    group = qh // kvh

    def step(x, i):  # time step i of a (B, H, T, d) tensor -> (B, H, d)
        return bb.emit(relax.op.squeeze(slice_along(x, 2, i, i + 1), [2]))

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
        outs.append(bb.emit(relax.op.multiply(o_t, relax_const(scale, f32))))
    y = relax.op.reshape(relax.op.permute_dims(relax.op.stack(outs, axis=2), [0, 2, 1, 3]), [b, t, qh * dv])
    y = relax.op.astype(y, out_dt)
    state_dt = dtype_of(past) if past is not None else out_dt
    return relax.Tuple([bb.normalize(y), bb.normalize(relax.op.astype(state, state_dt))])

# ----------------------------------------------------------------------------------------------- losses


def _nll(ctx, log_prob, target, weight, attr):
    """Negative log-likelihood of ``target`` classes (axis 1) with optional class weights and ignore_index."""
    reduction = attr.get("reduction", b"mean").decode()
    ignore = attr.get("ignore_index")
    target = relax.op.astype(target, "int64") if dtype_of(target) != "int64" else target
    mask = None
    if ignore is not None:
        mask = ctx.bb.emit(relax.op.not_equal(target, relax_const(int(ignore), "int64")))
        target = ctx.bb.emit(relax.op.where(mask, target, relax_const(0, "int64")))
    dt = dtype_of(log_prob)
    target = ctx.bb.emit(relax.op.clip(target, 0, shape_of(log_prob)[1] - 1))  # never read outside the classes
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
