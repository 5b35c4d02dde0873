"""Convolution kernels for CPUs: NHWC data, weights packed at build time, register-tiled schedules.

A dense convolution is an implicit GEMM: every output pixel is a row, every output channel a column,
``(kh, kw, c)`` the reduction. The schedule keeps a tile of ``pixels x channels`` accumulators in vector
registers (for AVX-512: 14 pixels x 32 channels = 28 zmm registers), streams the packed weights of one
channel block (``[OC/ocb, KH, KW, C, ocb]``, contiguous in the reduction order) and broadcasts one input
value per pixel and reduction step. Output tiles are spread over the CPU's cores.

INT8 kernels take int8 (or uint8) data and int8 weights and accumulate in int32. Where the CPU has
AVX-512 VNNI, the innermost ``16 channels x 4 input channels`` step is one ``vpdpbusd`` (u8 x s8 -> s32
with the four products summed in the instruction); signed data is moved to unsigned by adding 128 when it
is padded, and ``128 * sum(weights)`` per channel, computed at build time, is subtracted again.

Whatever follows a convolution in the same fused function (bias, ReLU, residual add, requantize to int8)
is computed on the accumulator tile while it is in registers.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from edgeq.toolchain import import_tvm

tvm = import_tvm()
from tvm import te  # noqa: E402
from tvm.s_tir import Schedule  # noqa: E402

CONV = "edgeq_conv"  # block names the scheduler looks for after fusion
DWCONV = "edgeq_dwconv"
PAD = "edgeq_pad"
ZP = "edgeq_conv_zp"
SPEC = "edgeq.conv_spec"  # block annotation: the ConvSpec, as JSON
VNNI_INTRIN = "edgeq_dot_16x4_vnni_local"


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def is_spatial(sch: Schedule, block) -> bool:
    """Whether a block has no reduction axes (element-wise, layout moves, padding)."""
    return all(int(iv.iter_type) == 0 for iv in sch.get(block).iter_vars)


@dataclasses.dataclass(frozen=True)
class Isa:
    """What the kernels need to know about the target CPU."""

    lanes: int  # float32 lanes of a vector register
    vnni: bool  # AVX-512 VNNI (vpdpbusd)
    registers: int  # vector registers

    @classmethod
    def of(cls, target) -> Isa:
        from tvm.target.codegen import target_has_features

        def has(feature: str) -> bool:
            try:
                return bool(target_has_features(feature, target))
            except Exception:  # noqa: BLE001 - a feature LLVM does not know for this triple
                return False

        if has("avx512f"):
            return cls(lanes=16, vnni=has("avx512vnni"), registers=32)
        if has("avx2") or has("avx"):
            return cls(lanes=8, vnni=False, registers=16)
        if has("neon") or "aarch64" in str(target.attrs.get("mtriple", "")):
            return cls(lanes=4, vnni=False, registers=32)
        return cls(lanes=4, vnni=False, registers=16)

    @property
    def accumulators(self) -> int:
        """Vector registers a tile may keep accumulators in (the rest hold weights and the broadcast)."""
        return self.registers - 4

    def vector_block(self, n: int) -> int:
        """How much of an axis of size ``n`` one tile covers: two or one whole vectors where ``n`` allows,
        else the largest divisor of ``n`` up to two vectors."""
        for vectors in (2, 1):
            if n % (self.lanes * vectors) == 0:
                return self.lanes * vectors
        return _largest_divisor(n, 2 * self.lanes)


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """One 2-D convolution in NHWC terms (``groups`` is 1 or, for depthwise, ``c``)."""

    n: int
    h: int
    w: int
    c: int
    oc: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, left, bottom, right
    dilation: tuple[int, int]
    dtype: str  # data dtype: float32, int8 or uint8 (weights: float32 or int8)
    depthwise: bool = False
    vnni: bool = False  # set by plan(): int8 with AVX-512 VNNI
    ocb: int = 0  # set by plan(): output channels per packed weight block / tile
    wino: int = 0  # set by plan(): Winograd output tile size m (0: direct convolution)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ConvSpec:
        d = json.loads(text)
        for key in ("stride", "padding", "dilation"):
            d[key] = tuple(d[key])
        return cls(**d)

    @property
    def oh(self) -> int:
        return (self.h + self.padding[0] + self.padding[2] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + self.padding[1] + self.padding[3] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def integer(self) -> bool:
        return self.dtype in ("int8", "uint8")

    @property
    def out_dtype(self) -> str:
        return "int32" if self.integer else "float32"

    def plan(self, isa: Isa) -> ConvSpec:
        """This convolution with its kernel chosen for ``isa``: VNNI or not, and the output channel block
        the weights are packed in (whole vector registers where the channel count allows)."""
        vnni = isa.vnni and self.integer and not self.depthwise and self.oc % 16 == 0
        if vnni:
            ocb = next(b for b in (64, 32, 16) if self.oc % b == 0 and b // 16 * 4 <= isa.accumulators)
        else:
            ocb = isa.vector_block(self.oc)
        return dataclasses.replace(self, vnni=vnni, ocb=ocb, wino=self._winograd_tile())

    def _winograd_tile(self) -> int:
        """F(m x m, 3 x 3) for float32 3x3 stride-1 convolutions big enough to pay for the transforms."""
        if self.integer or self.depthwise or (self.kh, self.kw) != (3, 3) or self.stride != (1, 1) or self.dilation != (1, 1):
            return 0
        if self.c < 64 or self.oc < 64 or min(self.oh, self.ow) < 8:  # measured: below, the transforms cost more
            return 0
        if self.oh % 4 == 0 and self.ow % 4 == 0:
            return 4
        if self.oh % 2 == 0 and self.ow % 2 == 0:
            return 2
        return 0

    def pixel_block(self, isa: Isa) -> int:
        """Output pixels (along the row) per tile: the largest divisor of the row that fits the registers."""
        vectors = max(1, math.ceil(self.ocb / (16 if self.vnni else isa.lanes)))
        if self.depthwise:
            vectors = 1
        return _largest_divisor(self.ow, max(1, isa.accumulators // vectors))

    @property
    def padded_c(self) -> int:
        return -(-self.c // 4) * 4


def _pad(x, spec: ConvSpec, channels: int, convert=None, value=0):
    """The input with its spatial padding (and for VNNI its channels rounded up to 4), in one stage."""
    pt, pl, pb, pr = spec.padding
    if not any(spec.padding) and channels == spec.c and convert is None:
        return x
    shape = (spec.n, spec.h + pt + pb, spec.w + pl + pr, channels)
    dtype = convert[0] if convert else x.dtype

    def body(n, h, w, c):
        inside = tvm.tirx.all(h >= pt, h < spec.h + pt, w >= pl, w < spec.w + pl, c < spec.c)
        v = x[n, h - pt, w - pl, tvm.tirx.min(c, spec.c - 1)]
        if convert:
            v = convert[1](v)
        return te.if_then_else(inside, v, tvm.tirx.const(value, dtype))

    return te.compute(shape, body, name=PAD)


def conv_func(spec: ConvSpec):
    """(PrimFunc, weight packer): the TE definition of the kernel and how to pack the OIHW weight for it.

    ``spec`` is planned (``ConvSpec.plan``). The PrimFunc takes ``(data NHWC, packed weight[, compensation]) -> output NHWC``; the packer maps the
    model's OIHW weight to the list of weight arrays that follow the data argument."""
    if spec.wino:
        from edgeq.kernels.winograd import winograd_func

        return winograd_func(spec)
    sh, sw = spec.stride
    dh, dw = spec.dilation
    x = te.placeholder((spec.n, spec.h, spec.w, spec.c), spec.dtype, name="data")
    if spec.depthwise:
        wt = te.placeholder((spec.kh, spec.kw, spec.c), "int8" if spec.integer else "float32", name="weight")
        xp = _pad(x, spec, spec.c)
        rh, rw = te.reduce_axis((0, spec.kh), "rh"), te.reduce_axis((0, spec.kw), "rw")
        acc = spec.out_dtype
        out = te.compute(
            (spec.n, spec.oh, spec.ow, spec.c),
            lambda n, y, z, c: te.sum(
                xp[n, y * sh + rh * dh, z * sw + rw * dw, c].astype(acc) * wt[rh, rw, c].astype(acc), axis=[rh, rw]),
            name=DWCONV, attrs={SPEC: spec.to_json()},
        )

        def pack(w: np.ndarray) -> list[np.ndarray]:
            return [np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))]

        return te.create_prim_func([x, wt, out], index_dtype_override="int64"), pack

    rh, rw = te.reduce_axis((0, spec.kh), "rh"), te.reduce_axis((0, spec.kw), "rw")
    if spec.vnni:
        cp = spec.padded_c
        offset = 128 if spec.dtype == "int8" else 0
        convert = ("uint8", lambda v: (v.astype("int32") + offset).astype("uint8"))
        xp = _pad(x, spec, cp, convert=convert, value=offset)
        wt = te.placeholder((spec.oc // 16, spec.kh, spec.kw, cp // 4, 16, 4), "int8", name="weight")
        rc = te.reduce_axis((0, cp), "rc")
        acc = te.compute(
            (spec.n, spec.oh, spec.ow, spec.oc),
            lambda n, y, z, o: te.sum(
                xp[n, y * sh + rh * dh, z * sw + rw * dw, rc].astype("int32")
                * wt[o // 16, rh, rw, rc // 4, o % 16, rc % 4].astype("int32"),
                axis=[rh, rw, rc]),
            name=CONV, attrs={SPEC: spec.to_json()},
        )

        def pack(w: np.ndarray) -> list[np.ndarray]:
            oc, c, kh, kw = w.shape
            wp = np.zeros((oc, cp, kh, kw), np.int8)
            wp[:, :c] = w
            packed = wp.reshape(oc // 16, 16, cp // 4, 4, kh, kw).transpose(0, 4, 5, 2, 1, 3)
            arrays = [np.ascontiguousarray(packed)]
            if offset:
                arrays.append((offset * w.astype(np.int64).sum(axis=(1, 2, 3))).astype(np.int32))
            return arrays

        if not offset:
            return te.create_prim_func([x, wt, acc], index_dtype_override="int64"), pack
        comp = te.placeholder((spec.oc,), "int32", name="compensation")
        out = te.compute(acc.shape, lambda n, y, z, o: acc[n, y, z, o] - comp[o], name=ZP)
        return te.create_prim_func([x, wt, comp, out], index_dtype_override="int64"), pack

    ocb = spec.ocb
    wdtype = "int8" if spec.integer else "float32"
    xp = _pad(x, spec, spec.c)
    wt = te.placeholder((spec.oc // ocb, spec.kh, spec.kw, spec.c, ocb), wdtype, name="weight")
    rc = te.reduce_axis((0, spec.c), "rc")
    accd = spec.out_dtype
    out = te.compute(
        (spec.n, spec.oh, spec.ow, spec.oc),
        lambda n, y, z, o: te.sum(
            xp[n, y * sh + rh * dh, z * sw + rw * dw, rc].astype(accd) * wt[o // ocb, rh, rw, rc, o % ocb].astype(accd),
            axis=[rh, rw, rc]),
        name=CONV, attrs={SPEC: spec.to_json()},
    )

    def pack(w: np.ndarray) -> list[np.ndarray]:
        oc, c, kh, kw = w.shape
        return [np.ascontiguousarray(w.reshape(oc // ocb, ocb, c, kh, kw).transpose(0, 3, 4, 2, 1))]

    return te.create_prim_func([x, wt, out], index_dtype_override="int64"), pack


# ---------------------------------------------------------------- schedules (on a fused function)


def _register_vnni() -> None:
    """TVM's ``dot_16x4_vnni`` with the accumulator in registers ("local") instead of memory."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
             c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
             c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            a_i32 = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(  # LLVM >= 20 takes the bytes as <64 x i8>
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                c.vload([0], dtype="int32x16"), T.reinterpret(T.broadcast(a_i32, 16), dtype="int8x64"),
                b.vload([0, 0], dtype="int8x64"), dtype="int32x16")

    tvm.s_tir.TensorIntrin.register(VNNI_INTRIN, desc, impl, override=True)


_register_vnni()


def _epilogue(sch: Schedule, main) -> object:
    """Accumulate ``main`` in registers and fold everything after it into the write-back block. Element-wise
    side inputs of the epilogue (a residual dequantized from int8) are first inlined where they are read."""
    root = sch.get_sblock("root")
    downstream, frontier = set(), [main]
    while frontier:
        for consumer in sch.get_consumers(frontier.pop()):
            name = sch.get(consumer).name_hint
            if name not in downstream:
                downstream.add(name)
                frontier.append(consumer)
    main_name = sch.get(main).name_hint
    for block in sch.get_child_blocks(root):
        stmt = sch.get(block)
        if stmt.name_hint in downstream or stmt.name_hint in (PAD, main_name):
            continue
        if is_spatial(sch, block):
            try:
                sch.compute_inline(block)
            except tvm.s_tir.ScheduleError:
                pass
    wb = sch.cache_write(main, 0, "local")
    while True:
        consumers = sch.get_consumers(wb)
        if len(consumers) != 1:
            break
        try:
            sch.reverse_compute_inline(consumers[0])
        except tvm.s_tir.ScheduleError:
            break
    return wb


def _schedule_pad(sch: Schedule) -> None:
    try:
        pad = sch.get_sblock(PAD)
    except tvm.s_tir.ScheduleError:
        return
    loops = sch.get_loops(pad)
    sch.parallel(sch.fuse(*loops[:2]))
    channels = int(sch.get(loops[3]).extent)
    width = 64 if channels % 64 == 0 else 16 if channels % 16 == 0 else channels if channels <= 64 else 0
    if width == channels:
        sch.vectorize(loops[3])
    elif width:
        sch.vectorize(sch.split(loops[3], [None, width])[1])


def _outer(spec: ConvSpec, n, y, oo) -> tuple:
    """The order of the parallel loops: where the weights outweigh the input, each core keeps one block of
    output channels (its weights stay in its cache) for all rows; otherwise it keeps rows of input."""
    weights = spec.kh * spec.kw * spec.c * spec.oc
    data = spec.n * spec.h * spec.w * spec.c
    return (oo, n, y) if weights > data else (n, y, oo)


def schedule_conv(sch: Schedule, spec: ConvSpec, isa: Isa) -> None:
    main = sch.get_sblock(CONV)
    wb = _epilogue(sch, main)
    n, y, z, o, rh, rw, rc = sch.get_loops(main)
    zb = spec.pixel_block(isa)
    zo, zi = sch.split(z, [None, zb])
    if spec.vnni:
        oo, om, oi = sch.split(o, [None, spec.ocb // 16, 16])
        rco, rci = sch.split(rc, [None, 4])
        if isa.vnni:
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rco, zi, om, oi, rci)
        else:  # the VNNI weight layout on a CPU without VNNI (a build host checking another CPU's bundle)
            sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rco, rci, zi, om, oi)
            sch.vectorize(oi)
        sch.reverse_compute_at(wb, zo)
        sch.unroll(zi)
        sch.unroll(om)
        sch.parallel(sch.fuse(*_outer(spec, n, y, oo)))
        init = sch.decompose_reduction(main, rh)
        sch.vectorize(sch.get_loops(init)[-1])
        if isa.vnni:
            sch.tensorize(oi, VNNI_INTRIN)
    else:
        oo, oi = sch.split(o, [None, spec.ocb])
        sch.reorder(*_outer(spec, n, y, oo), zo, rh, rw, rc, zi, oi)
        sch.reverse_compute_at(wb, zo)
        sch.vectorize(oi)
        sch.unroll(zi)
        sch.parallel(sch.fuse(*_outer(spec, n, y, oo)))
        sch.decompose_reduction(main, rh)
    sch.vectorize(sch.get_loops(wb)[-1])
    _schedule_pad(sch)


def schedule_dwconv(sch: Schedule, spec: ConvSpec, isa: Isa) -> None:
    """Depthwise: each input value is used by KH x KW outputs only, so the padding is computed where it is
    read (a copy of the padded input would cost as much as the convolution)."""
    try:
        sch.compute_inline(sch.get_sblock(PAD))
    except tvm.s_tir.ScheduleError:
        pass  # no padding
    main = sch.get_sblock(DWCONV)
    wb = _epilogue(sch, main)
    n, y, z, c, rh, rw = sch.get_loops(main)
    co, ci = sch.split(c, [None, isa.vector_block(spec.c)])
    zo, zi = sch.split(z, [None, _largest_divisor(spec.ow, 8)])
    sch.reorder(n, y, co, zo, rh, rw, zi, ci)
    sch.reverse_compute_at(wb, zo)
    sch.vectorize(ci)
    sch.unroll(zi)
    sch.parallel(sch.fuse(n, y, co))
    sch.decompose_reduction(main, rh)
    sch.vectorize(sch.get_loops(wb)[-1])
