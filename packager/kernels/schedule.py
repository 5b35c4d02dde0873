"""The CPU compilation pipeline: TVM's default Relax pipeline with edgeq's schedules applied to every
TIR function after operator fusion.

- Functions that contain an edgeq convolution (a block annotated with its ``ConvSpec``) get the kernel's
  register-tiled schedule, with the fused epilogue computed on the accumulator tile.
- Every other function (pooling, element-wise chains, layout transposes, reductions) gets a generic
  schedule: producers inlined, the loop nest fused, vectorised along the innermost axis and split over
  the cores when it is large enough to pay for the threads.
A schedule that does not apply leaves the function as TVM made it: slower, never wrong.
"""

from __future__ import annotations

import math
import os
import sys

from edgeq.kernels.conv import CONV, DWCONV, SPEC, ConvSpec, Isa, is_spatial, schedule_conv, schedule_dwconv
from edgeq.kernels.matmul import BMM, BmmSpec, schedule_bmm
from edgeq.kernels.matmul import SPEC as BMM_SPEC
from edgeq.kernels.winograd import WINO, schedule_winograd
from edgeq.toolchain import import_tvm

tvm = import_tvm()
from tvm.s_tir import Schedule, ScheduleError  # noqa: E402

PARALLEL_MIN = 1 << 14  # elements below which a loop nest runs on one core


def _blocks(sch: Schedule) -> list:
    root = sch.get_sblock("root")
    return list(sch.get_child_blocks(root))


# the blocks edgeq's kernels are recognised by after fusion: name -> (annotation, spec class)
KERNELS = {CONV: (SPEC, ConvSpec), DWCONV: (SPEC, ConvSpec), WINO: (SPEC, ConvSpec), BMM: (BMM_SPEC, BmmSpec)}


def _kernel(sch: Schedule):
    """(block name, spec) of the edgeq kernel in the function; (None, None) for any other function."""
    for block in _blocks(sch):
        stmt = sch.get(block)
        key, spec_class = KERNELS.get(stmt.name_hint, (None, None))
        if key is not None and key in stmt.annotations:
            return stmt.name_hint, spec_class.from_json(str(stmt.annotations[key]))
    return None, None


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
        if isinstance(node, divisions):
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
    for block in _blocks(sch)[:-1]:
        # inline only into a single consumer: inlining into two (softmax's exp) computes it twice
        if is_spatial(sch, block) and len(sch.get_consumers(block)) == 1:
            try:
                sch.compute_inline(block)
            except ScheduleError:
                pass
    for block in _blocks(sch):
        loops = sch.get_loops(block)
        if not loops:
            continue
        if is_spatial(sch, block):
            extents = [_extent(sch, lp) for lp in loops]
            if any(e is None for e in extents):
                continue
            total = math.prod(extents)
            fused = sch.fuse(*loops)
            inner = extents[-1]
            lanes = _vector_lanes(sch, block, isa.lanes)
            lanes = lanes if inner % lanes == 0 else 1
            if total >= PARALLEL_MIN:
                outer, vec = sch.split(fused, [None, lanes]) if lanes > 1 else (fused, None)
                sch.parallel(outer)
            elif lanes > 1:
                _, vec = sch.split(fused, [None, lanes])
            else:
                vec = None
            if vec is not None:
                sch.vectorize(vec)
        else:
            _schedule_reduction(sch, block, isa)


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
    if contiguous and extents[-1] % isa.lanes == 0 and reduce:
        outer, inner = sch.split(spatial[-1], [None, isa.lanes])
        sch.reorder(*spatial[:-1], outer, *reduce, inner)
        sch.vectorize(inner)
        sch.parallel(sch.fuse(*spatial[:-1], outer))
        sch.decompose_reduction(block, reduce[0])
    elif total * extents[-1] >= 2 * isa.lanes:
        lead = []
        for lp, k in zip(loops, kinds):
            if k != 0:
                break
            lead.append(lp)
        if lead:
            sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])


def schedule_function(func, isa: Isa) -> tuple[object, str]:
    """(scheduled function, which schedule): "conv", "conv-vnni", "dwconv", "winograd", "bmm", "generic", or "none" when no
    schedule applied and the function is left as TVM made it."""
    sch = Schedule(tvm.IRModule({"main": func}))
    try:
        name, spec = _kernel(sch)
        if name == BMM:
            schedule_bmm(sch, spec, isa)
            kind = "bmm"
        elif name == WINO:
            schedule_winograd(sch, spec, isa)
            kind = "winograd"
        elif name == DWCONV:
            schedule_dwconv(sch, spec, isa)
            kind = "dwconv"
        elif name == CONV:
            schedule_conv(sch, spec, isa)
            kind = "conv-vnni" if spec.vnni and isa.vnni else "conv"
        else:
            schedule_generic(sch, isa)
            kind = "generic"
    except Exception as err:  # noqa: BLE001 - a schedule that does not apply must not fail the build
        if os.environ.get("EDGEQ_SCHEDULE_DEBUG"):
            print(f"edgeq: schedule failed ({type(err).__name__}): {str(err).splitlines()[-1][:300]}", file=sys.stderr)
            print(func, file=sys.stderr)
        return func, "none"
    return sch.mod["main"], kind


def schedule_pass(isa: Isa, stats: dict[str, int] | None = None):
    """A module pass scheduling every TIR function not scheduled yet; counts by schedule into ``stats``."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.ScheduleCPU")
    def _pass(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc) and not int(func.attrs.get("tirx.is_scheduled", 0)):
                updates[gv], kind = schedule_function(func, isa)
                if stats is not None:
                    stats[kind] = stats.get(kind, 0) + 1
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def cpu_pipeline(target, isa: Isa, stats: dict[str, int] | None = None):
    """TVM's CPU pipeline (``relax.backend.cpu_generic``) with edgeq's schedules after fusion."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CPUPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [schedule_pass(isa, stats)]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline

