"""The depthwise convolution kernel for CPUs (groups = input channels = output channels).

Each output channel reads one input channel, so channels are the vector axis: a tile is a run of output
pixels x one vector of channels, the ``KH x KW`` weights per channel packed as ``[KH, KW, C]``. float32,
or int8/uint8 data x int8 weights; the fused epilogue is computed on the tile.

The int8 kernel computes the integer sum of products exactly, in float32 lanes: every product is an integer
of at most 255 x 128 in magnitude, and a sum of fewer than 2^24 / 32640 = 514 of them (a 22x22 kernel) is
an integer below 2^24, which float32 holds exactly, so the int32 result is the one integer arithmetic
gives, bit for bit. It is the fast way on CPUs: per 16 products one convert and one fused multiply-add,
where int32 lanes need two sign extensions, a ``vpmulld`` (the slow integer multiply) and an add
(MNASNet 0.5's int8 56x56x48 3x3: 0.16 ms a call in int32 lanes, 3.6x the float kernel). Larger kernels
accumulate in int32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.backends.cpu.common import (PAD, ConvSpec, Isa, Kernel, accumulate_from, epilogue, exact_in_float, largest_divisor,
                                       pad_input, parallel)
from edgeq.tvm_env import Schedule, te, tvm


DWCONV = "edgeq_dwconv"  # the block the scheduler looks for after fusion


def plan(problem: ConvSpec, isa: Isa) -> ConvSpec | None:
    """Every depthwise convolution."""
    if not problem.depthwise:
        return None
    return dataclasses.replace(problem, ocb=isa.vector_block(problem.oc))


def dwconv_func(spec: ConvSpec):
    """(PrimFunc ``(data NHWC, weight [KH, KW, C], start [C]) -> output NHWC``, packer of the OIHW weight):
    the accumulators start from ``start`` (zeros, or the layer's bias, which lowering folds in)."""
    sh, sw = spec.stride
    dh, dw = spec.dilation
    x = te.placeholder((spec.n, spec.h, spec.w, spec.c), spec.dtype, name="data")
    wt = te.placeholder((spec.kh, spec.kw, spec.c), "int8" if spec.integer else "float32", name="weight")
    xp = pad_input(x, spec, spec.c)
    rh, rw = te.reduce_axis((0, spec.kh), "rh"), te.reduce_axis((0, spec.kw), "rw")
    exact = spec.integer and exact_in_float(spec.kh * spec.kw)
    acc = "float32" if exact else spec.out_dtype
    out = te.compute(
        (spec.n, spec.oh, spec.ow, spec.c),
        lambda n, y, z, c: te.sum(
            xp[n, y * sh + rh * dh, z * sw + rw * dw, c].astype(acc) * wt[rh, rw, c].astype(acc), axis=[rh, rw]),
        name=DWCONV, attrs={spec.annotation: spec.to_json()},
    )
    if exact:  # the integer sum, in float lanes (see the module's docstring)
        out = te.compute(out.shape, lambda *i: out(*i).astype("int32"), name=DWCONV + "_int32")
    start = te.placeholder((spec.c,), acc, name="start")
    func = te.create_prim_func([x, wt, start, out], index_dtype_override="int64")

    def pack(w: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(w[:, 0].transpose(1, 2, 0)), np.zeros(spec.c, acc)]

    return accumulate_from(func, DWCONV, 2), pack


def start_limit(spec: ConvSpec) -> float:
    """The largest bias the accumulators may start from: float lanes hold the integer sum exactly while it
    stays below 2^24 (``exact_in_float``), whatever the bias."""
    if spec.integer and exact_in_float(spec.kh * spec.kw):
        return float((1 << 24) - spec.kh * spec.kw * 255 * 128)
    return float(np.finfo(np.float32).max) if not spec.integer else float((1 << 31) - 1)


def finish(func):
    """An int8 kernel summing in float lanes holds integers: ``float(int32(sum))`` in its epilogue (the
    int32 result dequantized or requantized) is the sum itself, two conversions per vector saved."""
    import tvm_ffi
    from tvm import tirx
    from tvm.s_tir import SBlock

    found: list = []

    def visit(b):
        if b.name_hint.startswith(DWCONV) and ConvSpec.annotation in b.annotations and b.writes:
            spec = ConvSpec.from_json(str(b.annotations[ConvSpec.annotation]))
            if spec.integer and exact_in_float(spec.kh * spec.kw) and str(b.writes[0].source.ty.dtype) == "float32":
                found.append(b.writes[0].source)
        return b

    tvm_ffi.structural_map(func, [(SBlock, visit)])
    if not found:
        return func

    def exact(cast):
        inner = cast.value
        if str(cast.ty) == "float32" and isinstance(inner, tirx.Cast) and str(inner.ty) == "int32":
            load = inner.value
            if isinstance(load, tvm.ir.expr.TensorLoad) and any(load.source.same_as(b) for b in found):
                return load
        return cast

    return tvm_ffi.structural_map(func, [(tirx.Cast, exact)])


def schedule_dwconv(sch: Schedule, spec: ConvSpec, isa: Isa) -> None:
    """Each input value is used by KH x KW outputs only, so the padding is computed where it is read (a
    copy of the padded input would cost as much as the convolution)."""
    try:
        sch.compute_inline(sch.get_sblock(PAD))
    except tvm.s_tir.ScheduleError:
        pass  # no padding
    main = sch.get_sblock(DWCONV)
    wb = epilogue(sch, main)
    n, y, z, c, rh, rw = sch.get_loops(main)
    co, ci = sch.split(c, [None, isa.vector_block(spec.c)])
    zo, zi = sch.split(z, [None, largest_divisor(spec.ow, 8)])
    sch.reorder(n, y, co, zo, rh, rw, zi, ci)
    sch.reverse_compute_at(wb, zo)
    sch.vectorize(ci)
    sch.unroll(zi)
    sch.unroll(rw)
    sch.unroll(rh)
    parallel(sch, [n, y, co], spec.macs)
    sch.decompose_reduction(main, rh)
    sch.vectorize(sch.get_loops(wb)[-1])


KERNEL = Kernel(name="dwconv", spec=ConvSpec, plan=plan, build=dwconv_func, symbol="edgeq_dwconv2d", block=DWCONV,
                schedule=schedule_dwconv, tag=lambda spec: "dw", starts=start_limit, finish=finish)
