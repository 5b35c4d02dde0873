"""The dense convolution kernel for CPUs: NHWC data, weights packed at build time, register-tiled schedules.

A dense convolution is an implicit GEMM: every output pixel is a row, every output channel a column,
``(kh, kw, c)`` the reduction. The schedule keeps a tile of ``pixels x channels`` accumulators in vector
registers (for AVX-512: 14 pixels x 32 channels = 28 zmm registers), streams the packed weights of one
channel block (``[OC/ocb, KH, KW, C, ocb]``, contiguous in the reduction order) and broadcasts one input
value per pixel and reduction step. Output tiles are spread over the CPU's cores.

INT8 kernels take int8 (or uint8) data and int8 weights and accumulate in int32. Where the CPU has an
int8 dot-product instruction the innermost ``D channels x 4 input channels`` step is one instruction, with
the four products of each channel summed in it: AVX-512 VNNI's ``vpdpbusd`` (D = 16, u8 x s8) or Arm's
``sdot`` (D = 4, s8 x s8; Armv8.2 dotprod, as on Jetson Orin's Cortex-A78AE). Data of the other signedness
is moved by 128 when it is padded, and ``offset * sum(weights)`` per channel, computed at build time, is
subtracted again: the int32 accumulators start from ``start`` (one value per output channel, a parameter:
minus that compensation, plus the layer's int32 bias, which lowering folds in), so neither costs an
operation per output in the epilogue.

Whatever follows a convolution in the same fused function (bias, ReLU, residual add, requantize to int8)
is computed on the accumulator tile while it is in registers. Matrix products by a weight run here as 1x1
convolutions, and grouped convolutions (each block of output channels inside one group, reading its
group's inputs); depthwise convolutions have their own kernel (``dwconv``), large float 3x3 ones a Winograd
kernel (``winograd``), tried before this one.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from edgeq.backends.cpu.common import (DOT, DOT_KINDS, PAD, STREAMED, ConvSpec, Isa, Kernel, accumulate_from, dividing_lanes, epilogue,
                                       exact_in_float, largest_divisor, pad_input, parallel, repeated_bytes,
                                       vectorize_by)
from edgeq.tvm_env import Schedule, te, tvm


CONV = "edgeq_conv"  # the block the scheduler looks for after fusion
INTRINSICS = {"vnni": "edgeq_dot_16x4_vnni_local", "vnni8": "edgeq_dot_8x4_vnni_local",
              "sdot": "edgeq_dot_4x4_sdot_local"}


def plan(problem: ConvSpec, isa: Isa) -> ConvSpec | None:
    """Every dense convolution (depthwise ones are not this kernel's): the CPU's int8 dot product where it
    has one and the int8 output channels fill its blocks (16 for VNNI, 4 for sdot); the output channel block
    the weights are packed in (four, two or one dot blocks; else whole vector registers where the channel
    count allows)."""
    if problem.depthwise:
        return None
    dots = [k for k in DOT_KINDS.get(isa.dot, ()) if problem.oc % DOT[k][0] == 0]
    if dots and problem.integer and problem.groups == 1:
        dot = dots[0]
        lanes = DOT[dot][0]
        # the tile (pixels x dot blocks, fitting the registers) with the most instructions per load: each step
        # loads one weight vector per block and broadcasts one value per pixel (1x1 24 -> 144 on 56x56: 8 x 3
        # blocks 0.055 ms, 28 x 1 block 0.062)
        blocks = [b for b in (4, 3, 2, 1) if problem.oc % (b * lanes) == 0]
        best = max(blocks, key=lambda b: _per_load(_dot_pixels(problem.ow, b, isa), b))
        return dataclasses.replace(problem, dot=dot, ocb=best * lanes)
    # grouped: a block of output channels stays inside one group (it reads one run of inputs)
    ocb = isa.vector_block(problem.oc // problem.groups)
    if problem.n * problem.oh * problem.ow == 1 and problem.groups == 1:
        # a matrix-vector product (a classifier, squeeze-and-excitation's FCs): with one pixel each vector of
        # the tile is one chain of dependent multiply-adds along the whole reduction, so the tile takes up to
        # 8 vectors (2 FMA units x 4 cycles latency): MNASNet's 1280 -> 1000 classifier in blocks of 8 lanes
        # (one chain each) took 0.156 ms, ONNX Runtime 0.089. At least 16 tiles stay to share among the
        # cores: 576 -> 1024 in tiles of 128 was slower than in tiles of 64.
        width = _register_width(isa, ocb)
        tiles = [m * width for m in range(1, 9) if problem.oc % (m * width) == 0 and problem.oc // (m * width) >= 16]
        ocb = max([ocb, *tiles])
    return dataclasses.replace(problem, ocb=ocb)


def _register_width(isa: Isa, ocb: int) -> int:
    """The lanes of one vector register in a tile of ``ocb`` output channels (a matrix-vector tile spans
    several)."""
    return min(isa.vector_block(ocb), isa.lanes)


def conv_func(spec: ConvSpec):
    """(PrimFunc, weight packer): the TE definition of the kernel and how to pack the OIHW weight for it.

    ``spec`` is planned (``plan``). The PrimFunc takes ``(data NHWC, packed weight[, start]) -> output NHWC``
    (``start``: int8 kernels, the accumulators' first values); the packer maps the model's OIHW weight to the list of weight arrays that follow the data argument."""
    x = te.placeholder((spec.n, spec.h, spec.w, spec.c), spec.dtype, name="data")
    rh, rw = te.reduce_axis((0, spec.kh), "rh"), te.reduce_axis((0, spec.kw), "rw")
    return _dot_func(spec, x, rh, rw) if spec.dot else _direct_func(spec, x, rh, rw)


def _dot_func(spec: ConvSpec, x, rh, rw):
    """Data moved to the instruction's type (VNNI: uint8, sdot: int8) by adding or subtracting 128, channels
    padded to a multiple of 4, weights in ``[OC/D, KH, KW, C/4, D, 4]`` (one instruction operand per D x 4
    block)."""
    sh, sw = spec.stride
    dh, dw = spec.dilation
    d, dtype = DOT[spec.dot]
    cp = -(-spec.c // 4) * 4
    offset = 0 if spec.dtype == dtype else 128 if dtype == "uint8" else -128
    convert = (dtype, lambda v: (v.astype("int32") + offset).astype(dtype))
    xp = pad_input(x, spec, cp, convert=convert, value=offset)
    wkh, wkw, r0, c0 = spec.weight_taps
    wt = te.placeholder((spec.oc // d, wkh, wkw, cp // 4, d, 4), "int8", name="weight")
    rc = te.reduce_axis((0, cp), "rc")
    acc = te.compute(
        (spec.n, spec.oh, spec.ow, spec.oc),
        lambda n, y, z, o: te.sum(
            xp[n, y * sh + rh * dh, z * sw + rw * dw, rc].astype("int32")
            * wt[o // d, rh + r0, rw + c0, rc // 4, o % d, rc % 4].astype("int32"),
            axis=[rh, rw, rc]),
        name=CONV, attrs={spec.annotation: spec.to_json()},
    )

    def pack(w: np.ndarray) -> list[np.ndarray]:
        oc, c, kh, kw = w.shape
        wp = np.zeros((oc, cp, kh, kw), np.int8)
        wp[:, :c] = w
        packed = wp.reshape(oc // d, d, cp // 4, 4, kh, kw).transpose(0, 4, 5, 2, 1, 3)
        read = w[:, :, r0:r0 + spec.kh, c0:c0 + spec.kw]  # the taps this kernel reads: their padding's offset
        start = -offset * read.astype(np.int64).sum(axis=(1, 2, 3))
        return [np.ascontiguousarray(packed), start.astype(np.int32)]

    start = te.placeholder((spec.oc,), "int32", name="start")
    return accumulate_from(te.create_prim_func([x, wt, start, acc], index_dtype_override="int64"), CONV, 2), pack


def _direct_func(spec: ConvSpec, x, rh, rw):
    """float32, or int8/uint8 x int8 without a dot-product instruction: weights in ``[OC/ocb, KH, KW,
    C/groups, ocb]``; output channel ``o`` of a grouped convolution reads the inputs of its group,
    ``(o // (OC/groups)) * C/groups + rc``. An int8 one with fewer than 514 products per output sums them
    exactly in float32 lanes (``exact_in_float``): RegNetY's int8 grouped 3x3 convolutions (8 channels a
    group) ran at 34 G MAC/s in int32 lanes."""
    sh, sw = spec.stride
    dh, dw = spec.dilation
    ocb, cg, ocg = spec.ocb, spec.cg, spec.oc // spec.groups
    wdtype = "int8" if spec.integer else "float32"
    exact = spec.integer and exact_in_float(spec.kh * spec.kw * cg)
    if exact:  # the data in float32 once, in the padding stage: the loop is the float kernel's
        xp = pad_input(x, spec, spec.c, convert=("float32", lambda v: v.astype("float32")))
    else:
        xp = pad_input(x, spec, spec.c)
    wkh, wkw, r0, c0 = spec.weight_taps
    wt = te.placeholder((spec.oc // ocb, wkh, wkw, cg, ocb), wdtype, name="weight")
    rc = te.reduce_axis((0, cg), "rc")
    accd = "float32" if exact else spec.out_dtype

    def channel(o, rc):  # the block o // ocb lies in one group: (o // ocb) // (ocg // ocb) is its group
        return rc if spec.groups == 1 else (o // ocb) // (ocg // ocb) * cg + rc

    out = te.compute(
        (spec.n, spec.oh, spec.ow, spec.oc),
        lambda n, y, z, o: te.sum(
            xp[n, y * sh + rh * dh, z * sw + rw * dw, channel(o, rc)].astype(accd)
            * wt[o // ocb, rh + r0, rw + c0, rc, o % ocb].astype(accd),
            axis=[rh, rw, rc]),
        name=CONV, attrs={spec.annotation: spec.to_json()},
    )

    if exact:
        out = te.compute(out.shape, lambda *i: out(*i).astype("int32"), name=CONV + "_int32")

    def pack(w: np.ndarray) -> list[np.ndarray]:
        oc, c, kh, kw = w.shape
        return [np.ascontiguousarray(w.reshape(oc // ocb, ocb, c, kh, kw).transpose(0, 3, 4, 2, 1))]

    return te.create_prim_func([x, wt, out], index_dtype_override="int64"), pack


# ---------------------------------------------------------------- schedules (on a fused function)


def _register(dot: str, llvm_name: str) -> None:
    """TVM's ``dot_16x4_vnni`` / ``dot_4x4_i8i8s32_sdot`` on an accumulator in the kernel's tile
    (``common.TILE``), without bindings (``common.repeated_bytes``): ``c[i] += sum_k a[k] * b[i, k]`` for D
    lanes ``i`` and 4 bytes ``k``, the 4 data bytes broadcast to every lane. (Buffers by ``match_buffer``: the
    same function as ``T.Buffer`` annotations, which pyflakes misreads.)"""
    from tvm.script import tirx as T

    d, dtype = DOT[dot]

    @T.prim_func(s_tir=True)
    def desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        a = T.match_buffer(a_handle, (4,), dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (d, 4), "int8", offset_factor=1)
        c = T.match_buffer(c_handle, (d,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(c[0:d], a[0:4], b[0:d, 0:4])
            T.writes(c[0:d])
            for i in T.serial(0, d):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        a = T.match_buffer(a_handle, (4,), dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (d, 4), "int8", offset_factor=1)
        c = T.match_buffer(c_handle, (d,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(c[0:d], a[0:4], b[0:d, 0:4])
            T.writes(c[0:d])
            c[T.ramp(T.int32(0), 1, d)] = T.call_llvm_pure_intrin(  # LLVM >= 20: vpdpbusd takes <64 x i8>
                T.llvm_lookup_intrinsic_id(llvm_name), c.vload([0], dtype=f"int32x{d}"),
                repeated_bytes(a, 0, dtype, d), b.vload([0, 0], dtype=f"int8x{4 * d}"), dtype=f"int32x{d}")

    tvm.s_tir.TensorIntrin.register(INTRINSICS[dot], desc, impl, override=True)


_register("vnni", "llvm.x86.avx512.vpdpbusd.512")
_register("vnni8", "llvm.x86.avx512.vpdpbusd.256")
_register("sdot", "llvm.aarch64.neon.sdot.v4i32.v16i8")


def _schedule_pad(sch: Schedule, spec: ConvSpec) -> None:
    try:
        pad = sch.get_sblock(PAD)
    except tvm.s_tir.ScheduleError:
        return
    loops = sch.get_loops(pad)
    parallel(sch, loops[:2], spec.macs)
    channels = int(sch.get(loops[3]).extent)
    width = 64 if channels % 64 == 0 else 16 if channels % 16 == 0 else channels if channels <= 64 else 0
    if width == channels:
        sch.vectorize(loops[3])
    elif width:
        sch.vectorize(sch.split(loops[3], [None, width])[1])


def _outer(spec: ConvSpec, n, y, oo) -> tuple:
    """The order of the parallel loops: where the weights outweigh the input, each core keeps one block of
    output channels (its weights stay in its cache) for all rows; otherwise it keeps rows of input."""
    weights = spec.kh * spec.kw * spec.cg * spec.oc
    data = spec.n * spec.h * spec.w * spec.c
    return (oo, n, y) if weights > data else (n, y, oo)


def _dot_pixels(ow: int, vectors: int, isa: Isa) -> int:
    """Output pixels per tile of a dot-product kernel with ``vectors`` dot blocks: the dot instructions take
    the broadcast data from a register (``vpdpbusd`` broadcasts only its weight operand from memory), so the
    accumulators, the block's weight vectors and two broadcast registers must fit in the registers. A tile of
    7 pixels x 4 blocks (28 + 4 + 1 registers) spilled and ran 512 -> 512 3x3 on 7x7 at 211 G MAC/s;
    7 x 2 blocks ran it at 429 (measured peak of ``vpdpbusd`` here: about 444 on 2 cores)."""
    return largest_divisor(ow, max(1, (isa.registers - vectors - 2) // vectors))


def _per_load(pixels: int, blocks: int) -> float:
    return pixels * blocks / (pixels + blocks)


def _work(spec: ConvSpec) -> int:
    """The work ``parallel`` weighs: the multiply-adds, each a weight streamed from memory in a matrix-vector
    product (squeeze-and-excitation's 960 -> 240 took 65 us on one core of a 2-core x86 in MobileNetV3,
    its 0.9 MB of weights not in cache; ONNX Runtime's, on both cores, 35)."""
    return spec.macs * (STREAMED if spec.n * spec.oh * spec.ow == 1 else 1)


def _pixel_block(spec: ConvSpec, isa: Isa) -> int:
    """Output pixels (along the row) per tile: the largest divisor of the row that fits the registers."""
    if spec.dot:
        return _dot_pixels(spec.ow, spec.ocb // DOT[spec.dot][0], isa)
    vectors = max(1, math.ceil(spec.ocb / isa.lanes))
    return largest_divisor(spec.ow, max(1, isa.accumulators // vectors))


def schedule_conv(sch: Schedule, spec: ConvSpec, isa: Isa) -> None:
    main = sch.get_sblock(CONV)
    wb = epilogue(sch, main)
    n, y, z, o, rh, rw, rc = sch.get_loops(main)
    zb = _pixel_block(spec, isa)
    zo, zi = sch.split(z, [None, zb])
    if spec.dot:
        d = DOT[spec.dot][0]
        oo, om, oi = sch.split(o, [None, spec.ocb // d, d])
        rco, rci = sch.split(rc, [None, 4])
        if isa.runs(spec.dot):
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rco, zi, om, oi, rci)
        else:  # a dot layout on a CPU without that instruction (a build host checking another CPU's bundle)
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rco, rci, zi, om, oi)
            sch.vectorize(oi)
        sch.reverse_compute_at(wb, zo)
        sch.unroll(zi)
        sch.unroll(om)
        parallel(sch, list(_outer(spec, n, y, oo)), _work(spec))
        init = sch.decompose_reduction(main, rh)
        sch.vectorize(sch.get_loops(init)[-1])
        if isa.runs(spec.dot):
            sch.tensorize(oi, INTRINSICS[spec.dot])
    else:
        oo, oi = sch.split(o, [None, spec.ocb])
        width = _register_width(isa, spec.ocb)
        if spec.ocb % width == 0 and spec.ocb // width > 2:
            # a matrix-vector tile (``plan``) of more than two vectors: one register each, unrolled
            ov, oi = sch.split(oi, [None, width])
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rc, zi, ov, oi)
            sch.unroll(ov)
        else:
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rc, zi, oi)
        sch.reverse_compute_at(wb, zo)
        sch.vectorize(oi)
        sch.unroll(zi)
        parallel(sch, list(_outer(spec, n, y, oo)), _work(spec))
        sch.decompose_reduction(main, rh)
    _vectorize_channels(sch, sch.get_loops(wb)[-1], isa)
    _schedule_pad(sch, spec)


def _vectorize_channels(sch: Schedule, loop, isa: Isa) -> None:
    """The epilogue's channel loop in whole vector registers: a tile of 3 dot blocks (48 or 24 channels)
    vectorised as one 48-lane vector converted its int8 results lane by lane (1x1 16 -> 96 + ReLU6 on
    112x112: 0.44 ms, 0.29 in blocks of 32). A tile no full or half vector divides is one vector."""
    width = int(sch.get(loop).extent)
    vectorize_by(sch, loop, dividing_lanes(width, isa.lanes, isa.lanes // 2) or width)


def _tag(spec: ConvSpec) -> str:
    return spec.dot or f"oc{spec.ocb}"


def _label(spec: ConvSpec, isa: Isa) -> str:
    """"conv-vnni" / "conv-sdot" where the instruction is used; a dot layout scheduled for a CPU without it
    (a build host checking another CPU's bundle) is plain "conv"."""
    return f"conv-{spec.dot}" if spec.dot and isa.runs(spec.dot) else "conv"


KERNEL = Kernel(name="conv", spec=ConvSpec, plan=plan, build=conv_func, symbol="edgeq_conv2d", block=CONV,
                schedule=schedule_conv, tag=_tag, label=_label, starts=lambda spec: float((1 << 31) - 1) if spec.dot else 0.0)
