"""RNN, GRU and LSTM, unrolled over the sequence (static length)."""

from __future__ import annotations


import numpy as np

from edgeq.tvm_env import relax

from edgeq.onnx_ops.context import dtype_of, relax_const, shape_of, slice_along


# ----------------------------------------------------------------------------------------------- recurrent


_ACTIVATIONS = {  # name -> (fn(x, alpha, beta, dtype), default alpha, default beta); None: takes no alpha/beta
    "Sigmoid": (lambda x, a, b, dt: relax.op.sigmoid(x), None, None),
    "Tanh": (lambda x, a, b, dt: relax.op.tanh(x), None, None),
    "Relu": (lambda x, a, b, dt: relax.op.nn.relu(x), None, None),
    "Softsign": (lambda x, a, b, dt: relax.op.divide(x, relax.op.add(relax_const(1, dt), relax.op.abs(x))), None, None),
    "Softplus": (lambda x, a, b, dt: relax.op.log(relax.op.add(relax_const(1, dt), relax.op.exp(x))), None, None),
    "LeakyRelu": (lambda x, a, b, dt: relax.op.where(relax.op.less(x, relax_const(0, dt)), relax.op.multiply(x, relax_const(a, dt)), x),
                  0.01, None),
    "ThresholdedRelu": (lambda x, a, b, dt: relax.op.where(relax.op.greater(x, relax_const(a, dt)), x, relax_const(0, dt)), 1.0, None),
    "Elu": (lambda x, a, b, dt: relax.op.where(relax.op.less(x, relax_const(0, dt)),
                                               relax.op.multiply(relax_const(a, dt), relax.op.subtract(relax.op.exp(x), relax_const(1, dt))), x),
            1.0, None),
    "HardSigmoid": (lambda x, a, b, dt: relax.op.clip(relax.op.add(relax.op.multiply(x, relax_const(a, dt)), relax_const(b, dt)), 0, 1),
                    0.2, 0.5),
    "Affine": (lambda x, a, b, dt: relax.op.add(relax.op.multiply(x, relax_const(a, dt)), relax_const(b, dt)), 1.0, 0.0),
    "ScaledTanh": (lambda x, a, b, dt: relax.op.multiply(relax_const(a, dt), relax.op.tanh(relax.op.multiply(x, relax_const(b, dt)))),
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
    dt = dtype_of(x)
    layout = int(attr.get("layout", 0))
    if layout:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
    steps, batch, _ = shape_of(x)
    hidden = int(attr.get("hidden_size", shape_of(r)[-1]))
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
        return bb.emit(relax.op.squeeze(slice_along(t, 0, d, d + 1), [0]))

    def chunk(t, i, axis):  # gate i of a tensor holding all gates along axis
        return bb.emit(slice_along(t, axis, i * hidden, (i + 1) * hidden))

    ys, hs, cs = [], [], []
    for d in range(directions):
        f, g, hfn = (acts[d] + [None, None])[:3]
        wd, rd = pick(w, d), pick(r, d)  # (G*H, I), (G*H, H)
        xw = bb.emit(relax.op.matmul(x, relax.op.permute_dims(wd, [1, 0])))  # (S, B, G*H)
        if b is not None:
            bd = pick(b, d)
            wb = bb.emit(slice_along(bd, 0, 0, gates * hidden))
            rb = bb.emit(slice_along(bd, 0, gates * hidden, 2 * gates * hidden))
            if op == "GRU":  # the h gate's recurrent bias sits inside the reset product
                xw = bb.emit(relax.op.add(xw, relax.op.add(wb, relax.op.concat(
                    [slice_along(rb, 0, 0, 2 * hidden), relax_const(np.zeros(hidden), dt)], axis=0))))
                rbh = chunk(rb, 2, 0)
            else:
                xw = bb.emit(relax.op.add(xw, relax.op.add(wb, rb)))
        rbh = rbh if b is not None and op == "GRU" else relax_const(np.zeros(hidden), dt)
        rt = bb.emit(relax.op.permute_dims(rd, [1, 0]))  # (H, G*H)
        h = pick(h0, d) if h0 is not None else relax_const(np.zeros((batch, hidden)), dt)
        c = pick(c0, d) if c0 is not None else relax_const(np.zeros((batch, hidden)), dt)
        if peep is not None:
            pd = pick(peep, d)
            pi, po, pf = chunk(pd, 0, 0), chunk(pd, 1, 0), chunk(pd, 2, 0)
        order = range(steps - 1, -1, -1) if (direction == "reverse" or d == 1) else range(steps)
        outs = {}

        def pre(t):
            return relax.op.clip(t, -float(clip), float(clip)) if clip is not None else t

        for t in order:
            xt = bb.emit(relax.op.squeeze(slice_along(xw, 0, t, t + 1), [0]))  # (B, G*H)
            if op == "RNN":
                h = bb.emit(f(pre(relax.op.add(xt, relax.op.matmul(h, rt)))))
            elif op == "GRU":
                hr = bb.emit(relax.op.matmul(h, slice_along(rt, 1, 0, 2 * hidden)))
                z = bb.emit(f(pre(relax.op.add(chunk(xt, 0, 1), chunk(hr, 0, 1)))))
                reset = bb.emit(f(pre(relax.op.add(chunk(xt, 1, 1), chunk(hr, 1, 1)))))
                rh = slice_along(rt, 1, 2 * hidden, 3 * hidden)
                if linear_before_reset:
                    rec = relax.op.multiply(reset, relax.op.add(relax.op.matmul(h, rh), rbh))
                else:
                    rec = relax.op.add(relax.op.matmul(relax.op.multiply(reset, h), rh), rbh)
                cand = bb.emit(g(pre(relax.op.add(chunk(xt, 2, 1), rec))))
                h = bb.emit(relax.op.add(relax.op.multiply(relax.op.subtract(relax_const(1, dt), z), cand), relax.op.multiply(z, h)))
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
