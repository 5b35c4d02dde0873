"""What edgeq's CPU kernels share: the CPU they are planned for (``Isa``), the problems lowering hands
them (``ConvSpec``, ``BmmSpec``), the ``Kernel`` record each kernel module declares, and the schedule
steps more than one kernel uses (padding the input, computing the fused epilogue on the accumulators).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, ClassVar

import numpy as np

from edgeq.tvm_env import Schedule, te, tvm


PAD = "edgeq_pad"  # the padded input's block: the epilogue leaves it where it is

# the storage scope of a kernel's tiles and accumulators on a CPU. TVM 0.27's LowerTVMBuiltin puts a "global"
# buffer under 1 KB on the stack (LLVM then keeps it in registers) and allocates every "local" one, and every
# larger one, from the workspace pool: a call to TVMBackendAllocWorkspace and one to TVMBackendFreeWorkspace per
# buffer and parallel task. With "local" tiles, SmolLM2-135M's decode made about 25,000 such calls a token
# (``perf``: 11% of its time at 440 tokens of context, one thread).
TILE = "global"

# a kernel's weight packer: the model's weight -> the arrays the kernel's TIR function takes after the data
Packer = Callable[[np.ndarray], list[np.ndarray]]


# multiply-adds below which a kernel runs on one core (256K: a few microseconds, about what waking the
# other cores costs). The mobile nets are made of small layers (MNASNet's 1x1 96 -> 576 on 7x7: 2.7M), so
# they gain most from every core: on an idle 2-core machine MNASNet 0.5 took 2.72 ms with the threshold at
# 32M, 2.18 ms at 256K (MobileNetV3-Small 1.96 -> 1.63, EfficientNet-B0 12.4 -> 8.2 with generic's
# PARALLEL_MIN 32K; ONNX Runtime, 2 threads: 1.72, 1.40, 7.8), measured side by side in one run.
# The price: TVM's thread pool splits a parallel loop statically and waits for every thread, so where the
# cores are shared with another busy process each parallel region waits for a descheduled thread (on this
# shared machine under load, MNASNet once took 100 ms with threads vs 7 ms on one): a device's cores are the
# model's, and the threshold is set for that.
PARALLEL_MACS = 1 << 18
# a reduction's or a matrix-vector product's element is a load from memory, worth about this many
# multiply-adds of a register-tiled kernel when deciding to use the cores (``worth_threads``): a 14x14x960
# mean took 20 us on one core of a 2-core x86, 9 us on both
STREAMED = 4


def worth_threads(work: int) -> bool:
    """Whether a kernel of ``work`` multiply-adds (or element operations) is split over the cores."""
    return work >= PARALLEL_MACS


def parallel(sch: Schedule, loops: list, work: int):
    """``loops`` fused, and run on all cores when ``work`` is worth it; returns the fused loop."""
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if worth_threads(work):
        sch.parallel(fused)
    return fused


def exact_in_float(products: int) -> bool:
    """Whether a sum of ``products`` int8 x int8 (or uint8 x int8) products is exact in float32: each is an
    integer of magnitude at most 255 x 128 = 32640, so fewer than 2^24 / 32640 = 514 of them (every partial
    sum too) stay below 2^24, where float32 holds every integer. Float lanes are the fast way on CPUs: one
    convert and one fused multiply-add per vector, where int32 lanes need sign extensions and ``vpmulld``."""
    return products * 255 * 128 < 1 << 24


def dividing_lanes(n: int, lanes: int, least: int = 1) -> int:
    """The widest of ``lanes``, ``lanes / 2``, ... down to ``least`` that divides ``n`` (whole vectors along
    an axis of ``n``: a vector that divides it leaves no tail); 0 where none does."""
    while lanes >= max(least, 1):
        if n % lanes == 0:
            return lanes
        lanes //= 2
    return 0


def vectorize_by(sch: Schedule, loop, lanes: int) -> None:
    """``loop`` vectorised ``lanes`` at a time (split first where it is longer)."""
    extent = sch.get(loop).extent
    whole = isinstance(extent, (int, tvm.tirx.IntImm)) and int(extent) == lanes
    sch.vectorize(loop if whole else sch.split(loop, [None, lanes])[1])


def largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def blocks(sch: Schedule) -> list:
    """The blocks of a function, in order (the root's children)."""
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def is_spatial(sch: Schedule, block) -> bool:
    """Whether a block has no reduction axes (element-wise, layout moves, padding)."""
    return all(int(iv.iter_type) == 0 for iv in sch.get(block).iter_vars)


# int8 dot-product instructions: output channels (int32 lanes) per instruction, and the data type it multiplies
# the int8 weights with. Each sums 4 products per lane: ``vpdpbusd`` (AVX-512 VNNI) u8 x s8, Arm ``sdot``
# (Armv8.2 dotprod: Cortex-A76/A78, Jetson Orin's A78AE, Neoverse) s8 x s8. "vnni8" is ``vpdpbusd`` on 256-bit
# vectors (AVX512-VL), for channel counts that are a multiple of 8 and not of 16 (MobileNetV2's 24, MNASNet's 40).
DOT = {"vnni": (16, "uint8"), "vnni8": (8, "uint8"), "sdot": (4, "int8")}
# the layouts a CPU's instruction runs (Isa.dot -> keys of DOT), widest first
DOT_KINDS = {"vnni": ("vnni", "vnni8"), "sdot": ("sdot",)}


def repeated_bytes(a, start: int, dtype: str, lanes: int):
    """A tensor intrinsic's operand: bytes ``start .. start+3`` of buffer ``a`` (of ``dtype``) repeated for each of
    ``lanes`` lanes, as ``int8 x 4*lanes`` (the dot instructions cannot broadcast it from memory). An expression to
    use in the intrinsic, not a TVMScript binding: FlattenBuffer makes a vector binding a "local" buffer (``TILE``)."""
    from tvm.script import tirx as T

    return T.reinterpret(T.broadcast(T.reinterpret(a.vload([start], f"{dtype}x4"), dtype="int32"), lanes),
                         dtype=f"int8x{4 * lanes}")


@dataclasses.dataclass(frozen=True)
class Isa:
    """What the kernels need to know about the target CPU."""

    lanes: int  # float32 lanes of a vector register
    dot: str  # int8 dot-product instruction (a key of DOT), "" for none
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
            return cls(lanes=16, dot="vnni" if has("avx512vnni") else "", registers=32)
        if has("avx2") or has("avx"):
            return cls(lanes=8, dot="", registers=16)
        if has("neon") or "aarch64" in str(target.attrs.get("mtriple", "")):
            return cls(lanes=4, dot="sdot" if has("dotprod") else "", registers=32)
        return cls(lanes=4, dot="", registers=16)

    def runs(self, dot: str) -> bool:
        """Whether this CPU has the instruction of the dot layout ``dot`` (a key of DOT)."""
        return dot in DOT_KINDS.get(self.dot, ())

    @property
    def accumulators(self) -> int:
        """Vector registers a tile may keep accumulators in (the rest hold weights and the broadcast)."""
        return self.registers - 4

    def vector_block(self, n: int) -> int:
        """How much of an axis of size ``n`` one tile covers: two or one whole vectors where ``n`` allows,
        else the largest divisor of ``n`` up to two vectors; on AVX-512 (16 lanes) 8 lanes (a 256-bit vector)
        where 8 divides ``n``, else the largest divisor up to one vector: blocks of 24, 25 or 30 lanes there
        (MobileNetV3's 72 and 24 channels, 1000 classes) compiled to code 10-60x slower than blocks of 8 or
        15 (measured, 1x1 16 -> 72 on 56x56: 4.4 ms with 24, 0.31 ms with 8; 3x3 32 -> 30: 10.3 ms with 30,
        0.23 ms with 15)."""
        for vectors in (2, 1):
            if n % (self.lanes * vectors) == 0:
                return self.lanes * vectors
        if self.lanes <= 8:
            return largest_divisor(n, 2 * self.lanes)
        return 8 if n % 8 == 0 else largest_divisor(n, self.lanes)


class Spec:
    """What lowering hands a kernel, kept as JSON in the annotation of the kernel's block (a frozen dataclass
    of ints, strings, booleans and tuples; a subclass names its ``annotation``)."""

    annotation: ClassVar[str]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str):
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()})


@dataclasses.dataclass(frozen=True)
class ConvSpec(Spec):
    """One 2-D convolution in NHWC terms (depthwise: ``depthwise`` set, ``groups`` left 1). Lowering makes it
    with the last three fields at their defaults; the kernel that takes it fills them in (``Kernel.plan``)."""

    annotation: ClassVar[str] = "edgeq.conv_spec"  # the kernel block's annotation holding the spec as JSON

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
    dot: str = ""  # planned: int8 on a dot-product instruction (a key of DOT), weights in its layout
    ocb: int = 0  # planned: output channels per packed weight block / tile
    wino: int = 0  # planned: Winograd output tile size m (0: direct convolution)
    groups: int = 1  # grouped convolution (ResNeXt, RegNet): each group of oc/groups outputs reads c/groups inputs
    # a region of a convolution that reads only some of its weight's taps (``lower._tap_regions``): the
    # weight's own (kh, kw) and the first row and column of the taps this one computes with; () for all of them
    taps: tuple[int, ...] = ()

    @property
    def weight_taps(self) -> tuple[int, int, int, int]:
        """(kh, kw of the weight, first tap row, first tap column): the weight is packed whole and a region
        (``taps``) reads its rows ``r0 .. r0 + kh - 1`` and columns ``c0 .. c0 + kw - 1``."""
        return self.taps or (self.kh, self.kw, 0, 0)  # type: ignore[return-value]

    @property
    def oh(self) -> int:
        return (self.h + self.padding[0] + self.padding[2] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + self.padding[1] + self.padding[3] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def cg(self) -> int:
        """Input channels each output reads (per group)."""
        return self.c // self.groups

    @property
    def macs(self) -> int:
        """Multiply-adds of the direct convolution."""
        per_output = self.kh * self.kw * (1 if self.depthwise else self.cg)
        return self.n * self.oh * self.ow * self.oc * per_output

    @property
    def integer(self) -> bool:
        return self.dtype in ("int8", "uint8")

    @property
    def out_dtype(self) -> str:
        return "int32" if self.integer else "float32"


@dataclasses.dataclass(frozen=True)
class BmmSpec(Spec):
    """``out[b] = a[b] @ b[b]`` of two float32 activations: ``[batch, m, k] x [batch, k, n]``."""

    annotation: ClassVar[str] = "edgeq.bmm_spec"

    batch: int
    m: int
    k: int
    n: int


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One CPU kernel, all that lowering and scheduling need of it (``edgeq.backends.cpu.rules`` lists them).

    Lowering offers each convolution or matrix product, as a ``spec`` instance, to the kernels in order;
    the first whose ``plan`` returns a spec gets it: ``build`` makes its TIR function (named ``symbol``,
    computing the result in a block named ``block`` annotated with the spec) and the packer of its weight.
    After fusion the scheduler finds that block and calls ``schedule`` on the whole fused function."""

    name: str  # the schedule's name, as the manifest's cpu_kernels counts it
    spec: type  # the problem it takes: ConvSpec or BmmSpec
    plan: Callable[[Any, Isa], Any]  # (problem, isa) -> the spec with this kernel's choices, or None: not mine
    build: Callable[[Any], tuple[Any, Packer | None]]  # spec -> (PrimFunc, weight packer; None: no weight)
    symbol: str  # the TIR function's name in the module
    block: str  # the block the kernel is recognised by after fusion
    schedule: Callable[[Schedule, Any, Isa], None]
    tag: Callable[[Any], str] | None = None  # spec -> the packed weights' name tag (their layout)
    label: Callable[[Any, Isa], str] | None = None  # (spec, isa) -> the name when it depends on them
    # spec -> the largest magnitude of a bias lowering may fold into the last packed array, the
    # accumulators' first value per output channel (``accumulate_from``); 0: the kernel has no such array
    starts: Callable[[Any], float] | None = None
    # scheduled PrimFunc -> the PrimFunc with the expression rewrites a schedule cannot make
    finish: Callable[[Any], Any] | None = None

    def apply(self, sch: Schedule, isa: Isa) -> str | None:
        """A schedule rule: schedule ``sch``'s kernel block when it holds this kernel's and return the
        schedule's name; None, with ``sch`` untouched, for any other function."""
        spec = self._find(sch)
        if spec is None:
            return None
        self.schedule(sch, spec, isa)  # (the blocks fused around the kernel's: schedule.schedule_function)
        return self.label(spec, isa) if self.label else self.name

    def _find(self, sch: Schedule):
        for block in blocks(sch):
            stmt = sch.get(block)
            if stmt.name_hint == self.block and self.spec.annotation in stmt.annotations:
                return self.spec.from_json(str(stmt.annotations[self.spec.annotation]))
        return None


def accumulate_from(func, block: str, start_param: int):
    """``func`` with the reduction of ``block`` starting from ``start[o]`` instead of 0, ``start`` being its
    parameter ``start_param``, one value per output channel (the last axis). A compensation or a bias is
    then in the accumulator's first value rather than one more operation per output in the epilogue: on
    MobileNetV2's int8 1x1 16 -> 96 (112x112), whose epilogue is most of the work, 0.134 -> 0.099 ms.
    (``te.sum(init=...)`` would say this, but ``te.create_prim_func`` drops the init in TVM 0.27.)"""
    import tvm_ffi
    from tvm.s_tir import SBlock

    start = func.params[start_param]

    def with_start(b):
        if b.name_hint != block or b.init is None:
            return b
        store = b.init
        init = tvm.tirx.BufferStore(store.buffer, tvm.tirx.BufferLoad(start, [store.indices[-1]]), store.indices)
        return SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, b.body, init, b.alloc_buffers, b.match_buffers,
                      b.annotations)

    return tvm_ffi.structural_map(func, [(SBlock, with_start)])


def pad_input(x, spec: ConvSpec, channels: int, convert=None, value=0):
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


def epilogue(sch: Schedule, main, keep: tuple[str, ...] = ()) -> object:
    """Accumulate ``main`` in registers and fold everything after it into the write-back block. Element-wise
    side inputs of the epilogue (a residual dequantized from int8) are first inlined where they are read; the
    blocks named in ``keep`` (stages the kernel schedules itself) are left where they are."""
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
        if stmt.name_hint in downstream or stmt.name_hint in (PAD, main_name, *keep):
            continue
        if is_spatial(sch, block):
            try:
                sch.compute_inline(block)
            except tvm.s_tir.ScheduleError:
                pass
    wb = sch.cache_write(main, 0, TILE)
    shape = _written_shape(sch, wb)
    while True:
        consumers = sch.get_consumers(wb)
        # only consumers of the tile's own shape: a broadcast (squeeze-and-excitation's channel scale times
        # a whole feature map) or a crop is left to ``schedule_rest``; inlining those failed or wrote past
        # the output
        if len(consumers) > 1 and _join_branches(sch, consumers, shape):
            continue
        if len(consumers) != 1 or _written_shape(sch, consumers[0]) != shape:
            break
        try:
            sch.reverse_compute_inline(consumers[0])
        except tvm.s_tir.ScheduleError:
            break
    return wb


def _join_branches(sch: Schedule, consumers: list, shape: list[int] | None) -> bool:
    """Where the tile is read by several element-wise blocks that meet again (hard-swish ``x * clip(x + 3,
    0, 6) / 6`` reads ``x`` in the multiply and in the ``+ 3`` leading to it; SiLU), each block of the tile's
    shape with one consumer of that shape is inlined into it, so that the tile has one reader, folded into
    the write-back. Left apart, MobileNetV3's hard-swish was a second pass over each expansion's output
    (1x1 160 -> 960 on 14x14: 0.25 ms against 0.18 without it). Whether anything was inlined."""
    joined, seen, frontier = False, set(), list(consumers)
    while frontier:
        block = frontier.pop()
        name = sch.get(block).name_hint
        if name in seen or _written_shape(sch, block) != shape or not is_spatial(sch, block):
            continue
        seen.add(name)
        after = sch.get_consumers(block)
        frontier.extend(after)
        if len(after) == 1 and _written_shape(sch, after[0]) == shape:
            try:
                sch.compute_inline(block)
                joined = True
            except tvm.s_tir.ScheduleError:
                pass
    return joined


def _written_shape(sch: Schedule, block) -> list[int] | None:
    writes = sch.get(block).writes
    if len(writes) != 1:
        return None
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else -1 for d in writes[0].source.shape]


def is_scheduled(sch: Schedule, block) -> bool:
    """Whether a block sits under a parallel or vectorised loop (a schedule has been given to it)."""
    kinds = (tvm.tirx.ForKind.PARALLEL, tvm.tirx.ForKind.VECTORIZED)
    return any(sch.get(lp).kind in kinds for lp in sch.get_loops(block))
