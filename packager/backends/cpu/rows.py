"""Row-wise functions: softmax, LayerNorm, RMSNorm and their fused epilogues (a quantize), where every
reduction runs along the innermost axis and what follows it reads the reduced value per row.

TVM legalizes them as separate loop nests (the row maxima, the exponentials, their sums, the normalised
values), each over the whole tensor, with the reductions scalar: ViT-B/16's LayerNorm over 197 x 768 took
0.30 ms, its softmax over 12 x 197 x 197 0.6 ms, about 10% of the int8 model. Here all blocks are computed
per row (``compute_at`` the last block's row loop, rows split over the cores), so a row's intermediates
stay in L1, each element-wise loop is vectorised, and each reduction whose length is a multiple of the
vector is summed in one vector of partial results (``rfactor``) and the vector summed at the end: the
LayerNorm above 0.02 ms. A reduction of another length stays scalar: TVM 0.27's ``compute_at`` drops the
predicate of a split that does not divide, so the partial sums would read past the row; a function with no
reduction of whole vectors is left to the generic rule.
"""

from __future__ import annotations

import dataclasses
import math

from edgeq.backends.cpu.common import Isa, blocks, is_spatial, parallel
from edgeq.backends.cpu.generic import vectorize_parts
from edgeq.tvm_env import Schedule, tvm


SPATIAL, REDUCE = 0, 2


def _kinds(sch: Schedule, block) -> list[int]:
    return [int(iv.iter_type) for iv in sch.get(block).iter_vars]


def _row_reduction(sch: Schedule, block, rows: int) -> bool:
    """Whether ``block`` reduces along one innermost axis, after the ``rows`` row axes, and reads that axis
    contiguously (a read that depends on the reduced variable has it as its last index, alone)."""
    kinds = _kinds(sch, block)
    if kinds != [SPATIAL] * rows + [REDUCE] or len(sch.get_loops(block)) != rows + 1:
        return False
    k = sch.get(block).iter_vars[-1].var

    def uses_k(expr) -> bool:
        return any(v.same_as(k) for v in tvm.tirx.analysis.undefined_vars(expr, []))

    for read in sch.get(block).reads:
        *outer, last = read.region
        if any(uses_k(r.min) for r in outer) or (uses_k(last.min) and not last.min.same_as(k)):
            return False
    return True


def applies(sch: Schedule, isa: Isa) -> bool:
    """A function of row-wise blocks: the last is element-wise over (rows..., columns); at least one block
    is a reduction along the columns (``_row_reduction``) of whole vectors (``_vector_reduction``); every
    other block element-wise over the rows, or over the rows and columns. With no reduction to put in
    vectors the generic schedule is as fast (softmax over 12 x 197 x 197: 0.31 ms there, 0.35 here)."""
    bl = blocks(sch)
    if len(bl) < 2 or not is_spatial(sch, bl[-1]):
        return False
    rows = len(sch.get_loops(bl[-1])) - 1
    if rows < 1:
        return False
    found = False
    for block in bl[:-1]:
        if is_spatial(sch, block):
            if len(sch.get_loops(block)) not in (rows, rows + 1):
                return False
        elif _row_reduction(sch, block, rows):
            found = found or _vector_reduction(sch, block, isa)
        else:
            return False
    return found


def _vector_reduction(sch: Schedule, block, isa: Isa) -> bool:
    """Whether a row reduction is long enough and whole vectors long, so that it is summed in a vector."""
    ext = int(sch.get(sch.get_loops(block)[-1]).extent)
    return ext % isa.lanes == 0 and ext >= 2 * isa.lanes


def _vectorize(sch: Schedule, loop, isa: Isa) -> None:
    """An element-wise loop along the columns in whole vectors; a tail that does not fill one (197 columns:
    12 x 16 + 5) is a loop of its own, vectorised whole."""
    ext = int(sch.get(loop).extent)
    if ext < 2:
        return
    if ext <= isa.lanes:
        sch.vectorize(loop)
        return
    if ext % isa.lanes:
        vectorize_parts(sch, loop, [0, ext - ext % isa.lanes, ext], isa)
    else:
        sch.vectorize(sch.split(loop, [None, isa.lanes])[1])


def schedule_rows(sch: Schedule, isa: Isa) -> None:
    for block in blocks(sch)[:-1]:  # as the generic rule: inline what has one consumer
        if is_spatial(sch, block) and len(sch.get_consumers(block)) == 1:
            try:
                sch.compute_inline(block)
            except tvm.s_tir.ScheduleError:
                pass
    bl = blocks(sch)
    rows = len(sch.get_loops(bl[-1])) - 1
    partial = []  # the rfactor blocks: one vector of partial results per row
    for block in bl[:-1]:
        if is_spatial(sch, block):
            continue
        if not _vector_reduction(sch, block, isa):
            continue
        _, lanes = sch.split(sch.get_loops(block)[-1], [None, isa.lanes])
        partial.append(sch.get(sch.rfactor(lanes, factor_axis=rows)).name_hint)
    bl = blocks(sch)
    loops = sch.get_loops(bl[-1])
    extents = [int(sch.get(lp).extent) for lp in loops]
    row = parallel(sch, loops[:-1], math.prod(extents))
    for block in reversed(bl[:-1]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    for block in sch.get_child_blocks(row):
        inner = sch.get_loops(block)[1:]
        if sch.get(block).name_hint in partial:
            lanes, steps = inner[0], inner[-1]  # (lanes, unit row loops, steps along the row)
            sch.reorder(steps, lanes)
            sch.vectorize(lanes)
            sch.decompose_reduction(block, steps)
        elif is_spatial(sch, block) and inner:
            _vectorize(sch, inner[-1], isa)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A schedule rule for row-wise functions (``applies``); put it before the generic rule."""

    name: str = "rows"

    def apply(self, sch: Schedule, isa: Isa) -> str | None:
        if not applies(sch, isa):
            return None
        schedule_rows(sch, isa)
        return self.name


ROWS = Rows()
