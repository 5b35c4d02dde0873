"""The host twins: each kernel's computation as plain TIR (``twin_prim_func``), which the rewritten graph runs with
on the build host for the reference check, and the module with every claimed kernel's twin (``with_twins``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgeq.backends.cuda.cutlass.kernels import ConvKernel, GemmKernel, TokenLinearKernel, kernel_operands
from edgeq.backends.cuda.cutlass.match import Claimed
from edgeq.backends.cuda.device_math import silu_rn_tir


def twin_prim_func(kernel: ConvKernel, shapes: dict | None = None):
    """A plain TIR function (TE, no CUTLASS) with the signature and the arithmetic of ``kernel``'s PrimFunc:
    the independent host implementation a rewritten graph is run with on the build host (``with_twins``)."""
    from edgeq.tvm_env import tvm

    te, tirx = tvm.te, tvm.tirx
    p = kernel.problem
    if isinstance(kernel, GemmKernel):  # the product over (batch, M, N), each operand read at its flat offset
        (_, a_shape, _), (_, w_shape, _), (_, y_shape, _) = kernel_operands(kernel, shapes)
        a, w = te.placeholder(a_shape, "float16", "a"), te.placeholder(w_shape, "float16", "w")
        st = kernel.strides

        def at(tensor, offset):  # element ``offset`` of a row-major tensor
            index = []
            for d in reversed(tensor.shape):
                index.append(offset % d)
                offset = offset // d
            return tensor[tuple(reversed(index))]

        rk = te.reduce_axis((0, p.k), "rk")
        (lda, bsa), (ldb, bsb) = st["a"], st["w"]
        acc = te.compute((p.batch, p.m, p.n), lambda z, i, j: te.sum(
            at(a, kernel.a_offset + z * bsa + i * lda + rk).astype("float32")
            * at(w, kernel.b_offset + z * bsb + (j * ldb + rk if kernel.b_column_major else rk * ldb + j)).astype("float32"),
            axis=rk), "acc")
        alpha = tirx.const(float(np.float32(kernel.alpha)), "float32")
        (ldc, bsc) = st["y"]

        def out(*index):  # the (batch, row, column) the kernel writes at this element of y
            flat = 0
            for i, d in zip(index, y_shape):
                flat = flat * d + i
            v = acc[(flat // bsc) % p.batch, (flat // ldc) % p.m, flat % p.n] * alpha
            if kernel.quantize:
                divisor, lo, hi = (tirx.const(float(np.float32(c)), "float32") for c in kernel.quantize)
                v = tirx.round(v.astype("float16").astype("float32") / divisor)
                return tirx.min(tirx.max(v, lo), hi).astype("int8")
            return v if kernel.float_out else v.astype("float16")

        return te.create_prim_func([a, w, te.compute(y_shape, out, "y")])
    args, y = twin_tensors(kernel, shapes)
    outs = list(y) if isinstance(y, tuple) else [y]  # (the upsampled copy's tensor, y)
    func = te.create_prim_func(args + outs)
    params = list(func.params)  # [..., y_up as it came in, y as it came in, y_up, y]: each written in place
    inplace = {}
    if getattr(kernel, "out_in_place", False):  # y is the tensor that came in (``call_tir_inplace``)
        inplace[params[-1]] = params[-1 - len(outs)]
    if len(outs) == 2:
        inplace[params[-2]] = params[-3 - int(bool(kernel.out_in_place))]
    return func.specialize(inplace) if inplace else func


def twin_tensors(kernel: ConvKernel, shapes: dict | None = None, x=None) -> tuple[list, object]:
    """The TE of a convolution's ``twin_prim_func``: (its operands but y, in ``kernel_operands`` order, y). ``x``: a
    TE tensor computed in front of the kernel (``pool_classifier``'s pooled features) in the operand's place, which
    then is not among the operands."""
    from edgeq.tvm_env import tvm

    te, tirx = tvm.te, tvm.tirx
    p = kernel.problem
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    int8 = kernel.precision == "int8"
    operands = {name: (shape, dtype) for name, shape, dtype in kernel_operands(kernel, shapes)}
    ph_ = {name: te.placeholder(shape, dtype, name) for name, (shape, dtype) in operands.items()
           if name != "y" and (name != "x" or x is None)}
    given = x is not None
    if given:
        ph_["x"] = x
    x, w, res = ph_["x"], ph_["w"], ph_.get("residual")
    acc_dtype = "int32" if int8 else "float32"
    zero = tirx.const(0, x.dtype)
    c0 = kernel.x_view[0] if kernel.x_view else 0  # the channel slice x is read from
    xp = te.compute((p.n, p.h + 2 * ph, p.w + 2 * pw, p.c), lambda i, y, z, c: tirx.if_then_else(
        tirx.all(y >= ph, y < p.h + ph, z >= pw, z < p.w + pw), x[i, y - ph, z - pw, c + c0], zero), "xp")
    ry, rx = te.reduce_axis((0, p.r), "ry"), te.reduce_axis((0, p.s), "rx")
    if p.depthwise:  # weights HWOI
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, o].astype(acc_dtype) * w[ry, rx, o, 0].astype(acc_dtype),
            axis=[ry, rx]), "acc")
    elif p.groups > 1:  # grouped: output channel o reads its group's channels
        kg, cg = p.k // p.groups, p.c // p.groups
        rc = te.reduce_axis((0, cg), "rc")
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, o // kg * cg + rc].astype(acc_dtype)
            * w[o, ry, rx, rc].astype(acc_dtype), axis=[ry, rx, rc]), "acc")
    else:
        rc = te.reduce_axis((0, p.c), "rc")
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, rc].astype(acc_dtype) * w[o, ry, rx, rc].astype(acc_dtype),
            axis=[ry, rx, rc]), "acc")
    slices = kernel.tile.split_k if kernel.tile is not None else 1

    def part(j):  # serial split-K: slice j sums the channel tiles t with t % slices == j
        ry_, rx_, rc_ = (te.reduce_axis((0, d), f"{a}{j}") for a, d in (("ry", p.r), ("rx", p.s), ("rc", p.c)))
        return te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(tirx.if_then_else(
            rc_ // kernel.tile.block[2] % slices == j,
            xp[i, y * sh + ry_ * dh, z * sw + rx_ * dw, rc_].astype(acc_dtype) * w[o, ry_, rx_, rc_].astype(acc_dtype),
            tirx.const(0, acc_dtype)), axis=[ry_, rx_, rc_]), f"acc{j}")

    parts = [part(j) for j in range(slices)] if slices > 1 else []

    def at(name, o):  # a per-channel operand, [K] or [1, 1, 1, K]
        t = ph_[name]
        return t[(0,) * (len(t.shape) - 1) + (o,)]

    npqk = (p.n, p.p, p.q, p.k)
    y_shape = tuple(operands["y"][0])

    def reindex(index, shape_from, shape_to):  # the same element of a tensor viewed in another shape
        if tuple(shape_from) == tuple(shape_to):
            return tuple(index)
        flat = 0
        for i, d in zip(index, shape_from):
            flat = flat * d + i
        out = []
        for d in reversed(shape_to):
            out.append(flat % d)
            flat = flat // d
        return tuple(reversed(out))

    def f32(v):
        return tirx.const(v, "float32")

    def residual(i, y, z, o):  # the residual's element of output (i, y, z, o)
        if kernel.residual_view:
            return res[i, y, z, o + kernel.residual_view[0]]
        return res[reindex((i, y, z, o), npqk, npqk if kernel.out_view else y_shape)]

    def epilogue_int8(i, y, z, o):
        v = (acc[i, y, z, o] + at("bias", o)).astype("float32") * at("scale", o) + at("shift", o)
        if kernel.silu:  # through edgeq's exp, as the device's epilogue (device_math.py)
            v = silu_rn_tir(v)
        if res is not None:
            v = v + residual(i, y, z, o).astype("float32") * f32(kernel.residual_scale)
        if not math.isinf(kernel.act_lo):
            v = te.max(v, f32(kernel.act_lo))
        if not math.isinf(kernel.act_hi):
            v = te.min(v, f32(kernel.act_hi))
        if kernel.post:
            v = v * at("post", o)
        if kernel.float_out:
            return v
        v = tirx.round(v / f32(kernel.out_div))
        return te.min(te.max(v, f32(kernel.lo)), f32(kernel.hi)).astype("int8")

    def epilogue_token(i, y, z, o):  # ``TokenLinearKernel``: the graph's operators, in its order
        token = ph_["token"]
        v = acc[i, y, z, o].astype("float32") * at("scale", o) * token[reindex((i, y, z), npqk[:3], operands["token"][0])] \
            + at("bias", o)
        if kernel.gelu is not None:
            constant, divide, half, one, half_first = kernel.gelu
            t = tirx.erf(v / f32(constant) if divide else v * f32(constant)) + f32(one)
            v = v * f32(half) * t if half_first else v * t * f32(half)
        if res is not None:
            v = v + residual(i, y, z, o)
        return v.astype(kernel.out_dtype)

    def epilogue_fp16(i, y, z, o):
        v = acc[i, y, z, o] if not parts else parts[0][i, y, z, o]
        if res is not None and not kernel.residual_after:
            v = v + residual(i, y, z, o).astype("float32")
        for part in parts[1:]:  # each slice adds the partial sum the one before left in the output, in its type
            v = part[i, y, z, o] + v.astype("float32" if kernel.float_out else "float16").astype("float32")
        v = v + at("bias", o).astype("float32")
        if kernel.activation == "relu":
            v = te.max(v, f32(0.0))
        elif kernel.activation == "relu6":
            v = te.min(te.max(v, f32(0.0)), f32(6.0))
        elif kernel.activation == "silu":
            v = v * te.sigmoid(v)
        elif kernel.activation == "gelu":
            v = f32(0.5) * v * (f32(1.0) + tirx.erf(v * f32(1 / math.sqrt(2))))
        elif kernel.activation == "hardswish":  # CUTLASS's HardSwish<float>: x * relu6(x + 3) / 6
            v = v * te.min(te.max(v + f32(3.0), f32(0.0)), f32(6.0)) / f32(6.0)
        elif kernel.activation != "identity":
            raise ValueError(f"no host twin for activation {kernel.activation}")
        if res is not None and kernel.residual_after:
            v = v + residual(i, y, z, o).astype("float32")
        return v if kernel.float_out else v.astype("float16")

    epilogue = epilogue_token if isinstance(kernel, TokenLinearKernel) else epilogue_int8 if int8 else epilogue_fp16
    y = te.compute(npqk, epilogue, "y")
    args = [ph_[name] for name in operands if name not in ("y", "y_up") and not (given and name == "x")]
    up = None
    if getattr(kernel, "up_view", None):  # the output nearest-upsampled 2x into channels [first, first + K) of the
        # tensor that came in; its other channels as they came
        first, y4 = kernel.up_view[0], y
        old_up = te.placeholder(tuple(operands["y_up"][0]), y4.dtype, "y_up_in")
        args.append(old_up)
        up = te.compute(old_up.shape, lambda i, a, b, c: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k), y4[i, a // 2, b // 2, tirx.max(c - first, 0)], old_up[i, a, b, c]),
            "y_up")
    head = getattr(kernel, "head_out", None)
    if head:  # the detector's output: channels [first, first + K) at anchors [anchor, anchor + P Q), in its dtype;
        # the rest as it came in (or zeros)
        first, anchor, _, _, dtype = head
        y4 = y
        old = te.placeholder(y_shape, dtype, "y_in") if kernel.out_in_place else None
        if old is not None:
            args.append(old)
        y = te.compute(y_shape, lambda i, c, a: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k, a >= anchor, a < anchor + p.p * p.q),
            y4[i, tirx.max(a - anchor, 0) // p.q, tirx.max(a - anchor, 0) % p.q, tirx.max(c - first, 0)].astype(dtype),
            old[i, c, a] if old is not None else tirx.const(0, dtype)), "y_head")
    elif kernel.out_view:  # channels [first, first + K) of the tensor; the others as they came in (or zeros)
        first, y4 = kernel.out_view[0], y
        old = te.placeholder(y_shape, y4.dtype, "y_in") if kernel.out_in_place else None
        if old is not None:
            args.append(old)
        y = te.compute(y_shape, lambda i, a, b, c: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k), y4[i, a, b, tirx.max(c - first, 0)],
            old[i, a, b, c] if old is not None else tirx.const(0, y4.dtype)), "y_placed")
    elif y_shape != npqk:  # the chain went through a reshape (a view): the output in the graph's shape
        y4 = y
        y = te.compute(y_shape, lambda *index: y4[reindex(index, y_shape, npqk)], "y_view")
    return args, (y if up is None else (up, y))


def with_twins(mod, claimed: Sequence[Claimed]):
    """A rewritten module (``claim_convs``) with each CUTLASS PrimFunc swapped for its ``twin_prim_func``: it runs
    on the build host, so the rewrite (which operands went where, the fused epilogue) is checked there."""
    from edgeq.tvm_env import tvm

    functions = dict(mod.functions)
    for gv in list(functions):
        for c in claimed:
            if gv.name_hint == c.kernel.function:
                # opaque to fusion, as the CUTLASS call it stands for
                functions[gv] = twin_prim_func(c.kernel, c.shapes).with_attrs(
                    {"global_symbol": gv.name_hint, "op_pattern": 8})
    return tvm.IRModule(functions)
