"""The int8 chains ``find_convs`` hands a kernel: a convolution and its requantization (bias, scale and shift,
SiLU, a residual, clamps, the division and rounding), or a linear layer with per-token scales and its epilogue.
"""

from __future__ import annotations

import math

import numpy as np

from edgeq.backends.cuda.cutlass.kernels import ConvKernel, DepthwiseKernel, TokenLinearKernel
from edgeq.backends.cuda.cutlass.match import (Claimed, channels_padded, const_scalar, gelu_of, is_depthwise,
    output_shape, same, silu_of)
from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, Conv2dProblem
from edgeq.backends.cuda.cutlass.tiles import choose_tile


def int8_chain(b, value_of, only_reader, follow, readers, params, sm_count: int, smem_per_block: int,
                name: str, taken=frozenset()) -> Claimed | str:
    """The int8 chain from the conv2d bound by ``b`` as one Claimed kernel, or why it is left to dlight. The chain
    (what ``prepare_nhwc`` leaves of edgeq's requantization and of quantize/dequantize):
    ``conv2d(int8 NHWC, int8 OHWI) -> int32 -> + bias (int32 [K]) -> astype float32 -> * scale (per channel or
    scalar) -> [+ shift] -> [x * sigmoid(x) (SiLU)] -> [+ float32(residual int8) * s] -> [relu] -> [/ s] -> round ->
    [max lo] [min hi] -> [astype int32] -> astype int8``."""
    from edgeq.graph import call_op, const_value
    from edgeq.graph_passes import dtype_of, shape_of

    value = b.value
    attrs = value.attrs
    x, w = value.args
    xs, ws = shape_of(x), shape_of(w)
    depthwise = is_depthwise(attrs, xs, ws)
    if attrs.data_layout != "NHWC" or (attrs.kernel_layout != "OHWI" or int(attrs.groups) != 1) and not depthwise:
        return f"{attrs.data_layout}/{attrs.kernel_layout}, groups {int(attrs.groups)}"
    if dtype_of(b.var) != "int32" or dtype_of(w) != "int8":
        return "not int8 x int8 -> int32"
    if w not in params:
        return "weights computed at run time"
    pads = [int(v) for v in attrs.padding]
    if pads[0] != pads[2] or pads[1] != pads[3]:
        return "asymmetric padding"
    k, kr, ks = (ws[2], ws[0], ws[1]) if depthwise else (ws[0], ws[1], ws[2]) if ws is not None else (0, 0, 0)
    if xs is None or ws is None or xs[3] % ALIGNMENT or k % ALIGNMENT:  # 64-bit loads where not a multiple of 16
        return "input or output channels not a multiple of 8"

    def op_of(var):
        return call_op(value_of.get(var)) if var is not None else None

    def other(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    def per_channel(expr) -> tuple | None:
        """The shape of a float32 constant or weight of K elements along the last axis (or of one element)."""
        if expr is None or (expr not in params and const_value(expr) is None) or dtype_of(expr) != "float32":
            return None
        shape = tuple(shape_of(expr) or ())
        size = int(np.prod(shape)) if shape else 1
        return shape if size == 1 or (size == k and shape[-1] == k) else None

    chain = [b.var]
    nxt = follow(chain, k)
    bias = None
    if op_of(nxt) == "relax.add":  # a linear layer's bias comes after its scales, in float (no int32 bias here)
        bias = other(nxt, chain[-1])
        if bias is None or bias not in params or dtype_of(bias) != "int32" or shape_of(bias)[-1] != k \
                or int(np.prod(shape_of(bias))) != k:
            return "no int32 per-channel bias after it"
        chain.append(nxt)
        nxt = follow(chain, k)
    if op_of(nxt) != "relax.astype" or str(value_of[nxt].attrs.dtype) != "float32":
        return "no float32 cast after its bias"
    chain.append(nxt)
    mul = follow(chain, k)
    scale = other(mul, chain[-1]) if op_of(mul) == "relax.multiply" else None
    scale_shape = per_channel(scale)
    if scale_shape is None or int(np.prod(scale_shape or (1,))) != k:
        return "no per-channel scale after it"
    chain.append(mul)
    shapes = {"bias": tuple(shape_of(bias)) if bias is not None else (k,), "scale": scale_shape}
    shift = None
    nxt = follow(chain, k)
    if op_of(nxt) == "relax.add":  # + shift (a folded BatchNorm's), a float32 per-channel constant or weight
        candidate = other(nxt, chain[-1])
        shift_shape = per_channel(candidate)
        if shift_shape is not None and int(np.prod(shift_shape or (1,))) == k:
            shift, shapes["shift"] = candidate, shift_shape
            chain.append(nxt)
            nxt = only_reader(nxt)
    problem = Conv2dProblem(xs[0], xs[1], xs[2], xs[3], k, kr, ks, (pads[0], pads[1]),
                            tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation),
                            c_real=xs[3] - channels_padded(x, value_of), groups=k if depthwise else 1)
    kind = DepthwiseKernel if depthwise else ConvKernel
    tile = None if depthwise else choose_tile(problem, sm_count, smem_per_block, "int8")
    # what follows the scale (and shift) up to the int8 cast; where it is not that, the kernel ends at the scale
    # (or shift) with a float32 output and the operators after it stay as they are
    silu = silu_of(chain[-1], readers, value_of, only_reader) if nxt is None else None
    if silu is not None:  # SiLU (x * sigmoid(x)) in float, before the rest
        chain = chain + silu
        nxt = only_reader(chain[-1])
    float_chain = list(chain)
    rest = ("its output is another kernel's residual" if nxt is not None and nxt in taken else
            _requantize_tail(chain, nxt, value_of, only_reader, op_of, other, per_channel, taken, not depthwise))
    if depthwise and output_shape((rest[0] if not isinstance(rest, str) else float_chain)[-1], problem):
        return "a depthwise output seen through a reshape"
    one_by_one = (kr, ks, problem.stride, problem.pad) == (1, 1, (1, 1), (0, 0))
    token = (_token_epilogue(float_chain[-1], k, value_of, only_reader, readers, params, taken, op_of, other,
                             per_channel)
             if isinstance(rest, str) and one_by_one and not depthwise and bias is None and shift is None
             and silu is None else None)
    if token is not None:  # a per-token linear layer: the token scale, bias and what follows in the epilogue
        token, bias, tail, out_dtype, gelu, residual = token
        kernel = TokenLinearKernel(name, problem, tile, "gelu" if gelu else "identity", residual is not None, "int8",
                                   float_out=out_dtype == "float32", out_dtype=out_dtype, gelu=gelu)
        shapes = {"scale": scale_shape, "bias": tuple(shape_of(bias)) if bias is not None else (k,),
                  "token": tuple(shape_of(token)), **output_shape(tail[-1], problem)}
        return Claimed(kernel, tail[-1], x, w, bias, residual, tuple(float_chain + tail[:-1]), shapes, scale,
                       token=token)
    if isinstance(rest, str):  # float32 out, with the residual and the activation clamps that follow (a ReLU6 or
        # a last residual block before a global pool)
        act_lo, act_hi = -math.inf, math.inf
        nxt = only_reader(float_chain[-1])
        found = None if depthwise else _residual_of(float_chain, nxt, value_of, only_reader, op_of, other, taken, True)
        residual, residual_scale = None, 0.0
        if found is not None and not isinstance(found, str):
            residual, residual_scale, joined = found
            float_chain += joined
            nxt = only_reader(nxt)
        while op_of(nxt) in ("relax.nn.relu", "relax.maximum", "relax.minimum"):
            c = 0.0 if op_of(nxt) == "relax.nn.relu" else const_scalar(value_of[nxt].args[1])
            if c is None or not value_of[nxt].args[0].same_as(float_chain[-1]):
                break
            act_lo, act_hi = (max(act_lo, c), act_hi) if op_of(nxt) != "relax.minimum" else (act_lo, min(act_hi, c))
            float_chain.append(nxt)
            nxt = only_reader(nxt)
        activation = {(-math.inf, math.inf): "identity", (0.0, math.inf): "relu", (0.0, 6.0): "relu6"}.get(
            (act_lo, act_hi), "clip")
        res_dtype = dtype_of(residual) if residual is not None and dtype_of(residual) != "float32" else ""
        kernel = kind(name, problem, tile, activation, residual is not None, "int8", residual_scale, act_lo=act_lo,
                      act_hi=act_hi, float_out=True, silu=silu is not None, residual_dtype=res_dtype)
        return Claimed(kernel, float_chain[-1], x, w, bias, residual, tuple(float_chain[:-1]),
                       {**shapes, **output_shape(float_chain[-1], problem)}, scale, shift)
    chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post = rest
    activation = {(-math.inf, math.inf): "identity", (0.0, math.inf): "relu", (0.0, 6.0): "relu6"}.get(
        (act_lo, act_hi), "clip")
    res_dtype = "float32" if residual is not None and dtype_of(residual) == "float32" else ""
    kernel = kind(name, problem, tile, activation, residual is not None, "int8", residual_scale, act_lo, act_hi,
                  out_div, lo, hi, silu=silu is not None, post=post is not None, residual_dtype=res_dtype)
    if post is not None:
        shapes["post"] = per_channel(post)
    return Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                   {**shapes, **output_shape(chain[-1], problem)}, scale, shift, post)


def _token_epilogue(out, k, value_of, only_reader, readers, params, taken, op_of, other, per_channel):
    """What follows an int8 linear layer's weight scale ``out`` where its input is quantized per token: ``* token
    (a float32 tensor [..., M, 1] computed at run time: each row's scale) -> [+ bias (float32, K)] -> [astype float16
    | GELU (erf form) [astype float16] | + residual (float32, the output's shape)]``, as (token, bias, the vars after ``out``, the
    output's dtype, ``TokenLinearKernel.gelu``, residual); None where ``out`` is not read so."""
    from edgeq.graph import const_value
    from edgeq.graph_passes import dtype_of, shape_of

    mul = only_reader(out)
    token = other(mul, out) if op_of(mul) == "relax.multiply" and mul not in taken else None
    ys, ts = shape_of(out), shape_of(token) if token is not None else None
    if token is None or token in params or const_value(token) is not None or dtype_of(token) != "float32" \
            or ys is None or ts is None or tuple(ts) != (*tuple(ys)[:-1], 1):
        return None
    chain, bias = [mul], None
    nxt = only_reader(mul)
    if op_of(nxt) == "relax.add" and nxt not in taken:
        candidate = other(nxt, mul)
        shape = per_channel(candidate)
        if shape is not None and int(np.prod(shape or (1,))) == k:
            bias = candidate
            chain.append(nxt)
            nxt = only_reader(nxt)
    last = chain[-1]
    if op_of(nxt) == "relax.astype" and dtype_of(nxt) == "float16" and nxt not in taken:
        return token, bias, chain + [nxt], "float16", None, None
    gelu = gelu_of(last, readers, value_of, only_reader)
    if gelu is not None and not any(v in taken for v in gelu):
        scaled, erf, one_plus, half, final = gelu
        divide = op_of(scaled) == "relax.divide"
        constant = const_scalar(value_of[scaled].args[1] if divide else other(scaled, last), value_of)
        one = const_scalar(other(one_plus, erf), value_of)
        half_first = const_scalar(other(half, last), value_of) is not None  # (x * 0.5) * (1 + erf)
        halved = const_scalar(other(half, last) if half_first else other(final, half), value_of)
        cast = only_reader(final)  # the next layer's fp16 input (an fp16 layer of the int8 graph: FFN's second)
        tail, out_dtype = ((chain + gelu + [cast], "float16") if op_of(cast) == "relax.astype"
                           and dtype_of(cast) == "float16" and cast not in taken else (chain + gelu, "float32"))
        return token, bias, tail, out_dtype, (constant, divide, halved, one, half_first), None
    if op_of(nxt) == "relax.add" and nxt not in taken:
        r = other(nxt, last)
        if r is not None and dtype_of(r) == "float32" and shape_of(r) == ys and r not in taken \
                and not any(same(r, v) for v in chain):
            return token, bias, chain + [nxt], "float32", None, r
    return token, bias, chain, "float32", None, None

def _residual_of(chain, nxt, value_of, only_reader, op_of, other, taken, allow_float: bool):
    """Where ``nxt`` is ``add(chain[-1], r)`` (and no other kernel's): (the residual operand, its scale, the vars
    that join the chain). r is a dequantized int8 tensor of the output's shape, ``float32(res) * s`` (res, s), or,
    with ``allow_float``, a float32 tensor of that shape (r, 1.0: another int8 layer's float output, a ResNet's
    downsampling shortcut, which the epilogue adds as it is). None where ``nxt`` is no such add's; a str: why not."""
    from edgeq.graph_passes import dtype_of, shape_of

    if op_of(nxt) != "relax.add" or nxt in taken:
        return None
    r = other(nxt, chain[-1])
    if r is None:
        return "an add of its output with itself"
    r_cast = value_of[r].args[0] if op_of(r) == "relax.multiply" else None
    r_scale = const_scalar(value_of[r].args[1]) if r_cast is not None else None
    if r_scale is not None and op_of(r_cast) == "relax.astype" and same(only_reader(r), nxt) \
            and same(only_reader(r_cast), r):
        res = value_of[r_cast].args[0]
        if dtype_of(res) == "int8" and shape_of(res) == shape_of(chain[-1]):
            return res, r_scale, [r_cast, r, nxt]
    if allow_float and dtype_of(r) == "float32" and shape_of(r) == shape_of(chain[-1]) and r not in taken \
            and not any(same(r, v) for v in chain):
        return r, 1.0, [nxt]
    return "an add after it of no dequantized int8 residual (one scale) nor float32 tensor of its shape"


def _requantize_tail(chain, nxt, value_of, only_reader, op_of, other, per_channel, taken=frozenset(),
                     allow_float=False):
    """After an int8 convolution's scale: ``[+ float32(residual int8) * s] -> [activation clamps] -> [* post (per
    channel: a depthwise layer's input channel scale)] -> [/ s] -> round -> [max lo] [min hi] -> [astype int32] ->
    astype int8``, as (chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post); or why not."""

    chain = list(chain)
    residual, residual_scale, act_lo, act_hi, out_div = None, 0.0, -math.inf, math.inf, 1.0
    found = _residual_of(chain, nxt, value_of, only_reader, op_of, other, taken, allow_float)
    if isinstance(found, str):
        return found
    if found is not None:
        residual, residual_scale, joined = found
        chain += joined
        nxt = only_reader(nxt)
    while op_of(nxt) in ("relax.nn.relu", "relax.maximum", "relax.minimum"):  # the activation, in float
        c = 0.0 if op_of(nxt) == "relax.nn.relu" else const_scalar(value_of[nxt].args[1])
        if c is None:
            return "a clamp by no constant"
        act_lo, act_hi = (max(act_lo, c), act_hi) if op_of(nxt) != "relax.minimum" else (act_lo, min(act_hi, c))
        chain.append(nxt)
        nxt = only_reader(nxt)
    post = None
    if op_of(nxt) == "relax.multiply":  # x a per-channel constant of K elements (one element: a scalar is no post)
        candidate = other(nxt, chain[-1])
        shape = per_channel(candidate)
        if shape is None or int(np.prod(shape or (1,))) == 1:
            return "a multiply after its activation by no per-channel constant"
        post = candidate
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) == "relax.divide":
        d = const_scalar(value_of[nxt].args[1])
        if d is None or d == 0:
            return "a division after it by no constant"
        out_div = d
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) != "relax.round":
        return "no rounding to int8 after it (its output is float)"
    chain.append(nxt)
    nxt = only_reader(nxt)
    lo, hi = -128.0, 127.0
    while op_of(nxt) in ("relax.maximum", "relax.minimum"):
        c = const_scalar(value_of[nxt].args[1])
        if c is None:
            return "a clamp by no constant"
        lo, hi = (max(lo, c), hi) if op_of(nxt) == "relax.maximum" else (lo, min(hi, c))
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) == "relax.astype" and str(value_of[nxt].attrs.dtype) == "int32":
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) != "relax.astype" or str(value_of[nxt].attrs.dtype) != "int8":
        return "no int8 cast at the end"
    chain.append(nxt)
    return chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post
