"""The last schedule rule: whatever no kernel claims (pooling, element-wise chains, layout transposes,
reductions) gets producers inlined, each loop nest fused, vectorised along the innermost axis and split
over the cores when it is large enough to pay for the threads.
"""

from __future__ import annotations

import dataclasses
import math

from edgeq.backends.cpu.common import (STREAMED, TILE, Isa, blocks, dividing_lanes, is_scheduled, is_spatial,
                                       largest_divisor, parallel, vectorize_by)
from edgeq.tvm_env import Schedule, ScheduleError, tvm


PARALLEL_MIN = 1 << 15  # elements below which a loop nest runs on one core (see common.PARALLEL_MACS)


def _extent(sch: Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tvm.tirx.IntImm) else None


def _vector_lanes(sch: Schedule, block, lanes: int) -> int:
    """``lanes``, halved until every ``x // d`` and ``x % d`` in the block whose ``x`` involves the innermost
    axis has ``d`` a multiple of it: then a vector never straddles a change of the quotient. (Reshapes that
    split the last axis, (.., 32) -> (.., 4, 8), index with ``i % 8``; TVM 0.27 vectorises ``ramp(16) % 8``
    wrongly: seen as wrong values in every second head of a rotary embedding.)"""
    stmt = sch.get(block)
    if not stmt.iter_vars:
        return lanes
    inner = stmt.iter_vars[-1].var
    divisions = (tvm.tirx.FloorDiv, tvm.tirx.FloorMod, tvm.tirx.Div, tvm.tirx.Mod)
    divisors = []

    def walk(node, found_inner: list) -> None:  # TVM 0.27 has no Python TIR visitor
        if isinstance(node, (list, tuple, tvm.ir.Array)):
            for item in node:
                walk(item, found_inner)
            return
        if isinstance(node, tvm.tirx.Var):
            if node.same_as(inner):
                found_inner.append(True)
            return
        if isinstance(node, divisions) and "int" in str(node.ty):  # not x / 0.0015 (a quantize's scale)
            uses = []
            walk(node.a, uses)
            if uses:
                divisors.append(int(node.b.value) if isinstance(node.b, tvm.tirx.IntImm) else 1)
                # with the divisor a multiple of the lanes, a quotient is one value across a vector
                # (nothing above it sees the axis), a remainder a ramp (it still varies)
                if isinstance(node, (tvm.tirx.FloorMod, tvm.tirx.Mod)):
                    found_inner.append(True)
            walk(node.b, found_inner)
            return
        for field in _CHILDREN:
            child = getattr(node, field, None)
            if isinstance(child, (tvm.ir.Expr, tvm.tirx.Stmt, tvm.ir.Array)):
                walk(child, found_inner)

    walk(stmt.body, [])
    for d in divisors:
        while lanes > 1 and d % lanes:
            lanes //= 2
    return lanes


_CHILDREN = ("a", "b", "value", "indices", "args", "condition", "true_value", "false_value", "base", "stride",
             "body", "seq", "then_case", "else_case")


def schedule_generic(sch: Schedule, isa: Isa) -> None:
    """Inline what can be inlined; then fuse, vectorise and parallelise each remaining loop nest."""
    for block in blocks(sch)[:-1]:
        # inline only into a single consumer: inlining into two (softmax's exp) computes it twice
        if is_spatial(sch, block) and len(sch.get_consumers(block)) == 1:
            try:
                sch.compute_inline(block)
            except ScheduleError:
                pass
    for block in blocks(sch):
        if is_spatial(sch, block):
            _schedule_spatial(sch, block, isa)
        elif sch.get_loops(block):
            _schedule_reduction(sch, block, isa)


def schedule_rest(sch: Schedule, isa: Isa) -> None:
    """After a kernel's schedule: the element-wise blocks of its fused function that its epilogue did not
    take (a broadcast after the kernel, as squeeze-and-excitation's scale of a feature map) are first merged
    into one loop nest, then fused, vectorised and parallelised like any other."""
    rest = [b for b in blocks(sch) if is_spatial(sch, b) and _own_nest(sch, b) and not is_scheduled(sch, b)]
    for block in rest[:-1]:
        if len(sch.get_consumers(block)) == 1:
            try:
                sch.compute_inline(block)
                continue
            except ScheduleError:
                pass
        _schedule_spatial(sch, block, isa)
    if rest:
        _schedule_spatial(sch, rest[-1], isa)


def _own_nest(sch: Schedule, block) -> bool:
    """Whether a block has loops and is alone in its loop nest (not computed inside a kernel's loops)."""
    loops = sch.get_loops(block)
    return bool(loops) and len(sch.get_child_blocks(loops[0])) == 1


def _schedule_spatial(sch: Schedule, block, isa: Isa) -> None:
    """One element-wise loop nest: vectorised along the innermost axis, the rest fused, split over the
    cores when it is large enough to pay for the threads. The vector is split off the innermost axis before
    the fusion, so its indices stay ``outer * lanes + lane``: split off the fused loop, every index is a
    division and remainder of it, and a broadcast operand (squeeze-and-excitation's channel scale, read at
    ``i % C``) was loaded lane by lane (MobileNetV3's 7x7x576 scale: 50 us a call)."""
    loops = sch.get_loops(block)
    extents = [_extent(sch, lp) for lp in loops]
    if not loops or any(e is None for e in extents):
        return
    total = math.prod(extents)
    source_last = _transposed_axis(sch, block, len(loops))
    if source_last is not None:
        _schedule_transpose(sch, loops, extents, source_last, isa)
        return
    bounds = _select_bounds(sch, block, sch.get(block).iter_vars[-1].var, extents[-1]) if len(loops) > 1 else []
    vec = None
    widest = _vector_lanes(sch, block, isa.lanes)
    lanes = dividing_lanes(extents[-1], widest)
    if not bounds and 2 * lanes < widest == isa.lanes < extents[-1] and len(loops) > 1:
        # a row no wide vector divides (ViT's 197 tokens: left scalar): whole vectors and a tail part
        bounds = [extents[-1] - extents[-1] % widest]
    if bounds:  # a concatenation: the channel loop is partitioned after the others are fused
        channels, loops = loops[-1], loops[:-1]
    elif lanes > 1:
        # 24 or 40 channels: vectors of 8 (left scalar, LLVM vectorised the loop itself with gathers and
        # byte-by-byte scattered stores: MNASNet's int8 requantize)
        last, vec = sch.split(loops[-1], [None, lanes])
        loops = [*loops[:-1], last]
    outer = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if total >= PARALLEL_MIN:
        sch.parallel(outer)
    if vec is not None:
        sch.vectorize(vec)
    if bounds:
        vectorize_parts(sch, channels, [0, *bounds, extents[-1]], isa)


def _schedule_transpose(sch: Schedule, loops: list, extents: list[int], source_last: int, isa: Isa) -> None:
    """A transpose in tiles: blocks of the output's innermost axis (a vector) by blocks of the axis the
    source is contiguous along, so the source lines one tile reads are all read while in the cache. NHWC
    112x112x64 to NCHW in output order (each channel's rows in turn, gathering 64 channels apart through
    the whole 3.2 MB source for every channel) took 1.7 ms."""
    inner, across = extents[-1], extents[source_last]
    wb, cb = dividing_lanes(inner, isa.lanes), dividing_lanes(across, isa.lanes)
    co, ci = sch.split(loops[source_last], [None, cb])
    wo, wi = sch.split(loops[-1], [None, wb])
    rest = [lp for i, lp in enumerate(loops[:-1]) if i != source_last]
    if wb == 1 and cb > 1 and inner <= 4:
        # an image's 3 channels last: vectors along the source's rows, each channel in turn (the quantize
        # of an int8 model's input, computed element by element: 0.15 ms for 224x224x3)
        sch.reorder(*rest, co, wo, wi, ci)
        outer = sch.fuse(*rest, co)
        sch.unroll(wo)
        wb, wi = cb, ci
    else:
        sch.reorder(*rest, co, wo, ci, wi)
        outer = sch.fuse(*rest, co, wo)
    if math.prod(extents) >= PARALLEL_MIN:
        sch.parallel(outer)
    if wb > 1:
        sch.vectorize(wi)


def _transposed_axis(sch: Schedule, block, depth: int) -> int | None:
    """For a transpose (a read indexed by every axis of the block, in another order), the axis its source
    is contiguous along when that is not the innermost one; else None."""
    stmt = sch.get(block)
    axes = [iv.var for iv in stmt.iter_vars]
    if len(axes) != depth or depth < 2:
        return None
    for read in stmt.reads:
        starts = [r.min for r in read.region]
        if len(starts) != depth or not all(isinstance(v, tvm.tirx.Var) for v in starts) \
                or any(not (isinstance(r.extent, tvm.tirx.IntImm) and int(r.extent) == 1) for r in read.region):
            continue
        order = [next((i for i, a in enumerate(axes) if a.same_as(v)), None) for v in starts]
        if sorted(o for o in order if o is not None) == list(range(depth)) and order[-1] != depth - 1:
            return order[-1]
    return None


def vectorize_parts(sch: Schedule, loop, edges: list[int], isa: Isa) -> None:
    """``loop`` partitioned at ``edges`` (the inputs of a concatenation, see ``_select_bounds``; whole vectors
    and a tail), each part vectorised: one plain vector copy per input."""
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    parts = sch.loop_partition(loop, [*sizes[:-1], None])
    for i, (part, size) in enumerate(zip(parts, sizes)):
        if size <= 4 * isa.lanes:
            sch.vectorize(part)  # a part starting past 0 cannot be split (TVM 0.27); LLVM splits the vector
        elif i == 0:
            lanes = dividing_lanes(size, isa.lanes)
            if lanes > 1:
                vectorize_by(sch, part, lanes)


def _select_bounds(sch: Schedule, block, var, extent: int) -> list[int]:
    """The points where a concatenation along the innermost axis switches input (the constants ``k`` of
    its ``if k <= c`` chain), or [] when the block is not such a choice. A choice on another axis (a
    concatenation along the height or width, inside it) is one value across a vector, and stays a select. TVM's vectoriser turns a select
    on the vector's own index into scalar loads and stores, lane by lane (96 ``vmovss`` for a 64 + 64
    concatenation), and a chain of 13 (DenseNet) costs 13 comparisons per value; partitioned at these
    points, each part is a plain vector copy of one input."""
    value = getattr(sch.get(block).body, "value", None)
    bounds: set[int] = set()
    compares = (tvm.tirx.LE, tvm.tirx.LT, tvm.tirx.GE, tvm.tirx.GT)

    def bound(cond) -> int | None:  # the first channel of the upper part, for k <= c, c < k and the like
        if not isinstance(cond, compares):
            return None
        a, b = cond.a, cond.b
        if isinstance(a, tvm.tirx.IntImm) and isinstance(b, tvm.tirx.Var) and b.same_as(var):
            return int(a.value) + (1 if isinstance(cond, (tvm.tirx.LT, tvm.tirx.GE)) else 0)
        if isinstance(b, tvm.tirx.IntImm) and isinstance(a, tvm.tirx.Var) and a.same_as(var):
            return int(b.value) + (1 if isinstance(cond, (tvm.tirx.LE, tvm.tirx.GT)) else 0)
        return None

    ok = [True]

    def walk(node) -> None:  # every select in the value (a concatenation, maybe under BatchNorm and ReLU)
        if not ok[0] or node is None:
            return
        cond = None
        if isinstance(node, tvm.tirx.Select):
            cond = node.condition
        elif isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "").endswith("if_then_else"):
            cond = node.args[0]
        if cond is not None and _mentions(cond, var):
            k = bound(cond)
            if k is None or not 0 < k < extent:
                ok[0] = False
                return
            bounds.add(k)
        for field in ("a", "b", "value", "args", "true_value", "false_value", "condition"):
            child = getattr(node, field, None)
            if isinstance(child, tvm.ir.Array):
                for item in child:
                    walk(item)
            elif isinstance(child, tvm.ir.Expr):
                walk(child)

    walk(value)
    if not ok[0]:
        return []
    return sorted(bounds)


def _mentions(node, var) -> bool:
    """Whether the TIR expression ``node`` reads ``var``."""
    if isinstance(node, tvm.tirx.Var):
        return node.same_as(var)
    if isinstance(node, (list, tuple, tvm.ir.Array)):
        return any(_mentions(item, var) for item in node)
    return any(_mentions(getattr(node, field), var) for field in _CHILDREN
               if isinstance(getattr(node, field, None), (tvm.ir.Expr, tvm.ir.Array)))


REDUCTION_VECTORS = 4


def _schedule_reduction(sch: Schedule, block, isa: Isa) -> None:
    """Pooling, means, sums: when the innermost output axis is also the innermost axis of what the block
    reads (channels of NHWC data), vectorise it inside the reduction loops; parallelise the outer axes."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    kinds = [int(iv.iter_type) for iv in stmt.iter_vars]
    if len(loops) != len(kinds) or any(k not in (0, 2) for k in kinds):
        return
    spatial = [lp for lp, k in zip(loops, kinds) if k == 0]
    reduce = [lp for lp, k in zip(loops, kinds) if k == 2]
    extents = [_extent(sch, lp) for lp in spatial]
    if not spatial or any(e is None for e in extents):
        return
    last_var = [iv.var for iv, k in zip(stmt.iter_vars, kinds) if k == 0][-1]
    contiguous = all(r.region and r.region[-1].min.same_as(last_var) for r in stmt.reads)
    total = math.prod(extents[:-1])
    work = math.prod(e or 1 for e in [_extent(sch, lp) for lp in loops])
    lanes = dividing_lanes(extents[-1], isa.lanes)  # 1000 classes: vectors of 8 (they were left scalar)
    if contiguous and lanes > 1 and reduce:
        # up to four vectors of accumulators in registers, each its own chain of adds: accumulated in the
        # output buffer, each add waited for the store of the one before (a 14x14x960 mean took 39 us)
        vectors = largest_divisor(extents[-1] // lanes, REDUCTION_VECTORS)
        outer, mid, inner = sch.split(spatial[-1], [None, vectors, lanes])
        wb = sch.cache_write(block, 0, TILE)
        sch.reorder(*spatial[:-1], outer, *reduce, mid, inner)
        sch.reverse_compute_at(wb, outer)
        sch.vectorize(inner)
        sch.unroll(mid)
        parallel(sch, [*spatial[:-1], outer], work * STREAMED)
        init = sch.decompose_reduction(block, reduce[0])
        for part in (init, wb):  # the tile's first values and its write-back, in whole vectors
            loop = sch.get_loops(part)[-1]
            vectorize_by(sch, loop, lanes)
    elif total * extents[-1] >= 2 * lanes:
        lead = []
        for lp, k in zip(loops, kinds):
            if k != 0:
                break
            lead.append(lp)
        if lead:
            parallel(sch, lead, work)


@dataclasses.dataclass(frozen=True)
class Generic:
    """A schedule rule that applies to every function: put it last."""

    name: str = "generic"

    def apply(self, sch: Schedule, isa: Isa) -> str:
        schedule_generic(sch, isa)
        return self.name


GENERIC = Generic()
