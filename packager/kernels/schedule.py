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

import os
import sys

from edgeq.kernels.conv import CONV, DWCONV, SPEC, ConvSpec, Isa, schedule_conv, schedule_dwconv
from edgeq.toolchain import import_tvm

tvm = import_tvm()
import tvm.s_tir.tensor_intrin  # noqa: E402,F401 - registers TVM's tensor intrinsics
from tvm.s_tir import Schedule, ScheduleError  # noqa: E402

PARALLEL_MIN = 1 << 14  # elements below which a loop nest runs on one core


def _blocks(sch: Schedule) -> list:
    root = sch.get_sblock("root")
    return list(sch.get_child_blocks(root))


def _spec(sch: Schedule, names: tuple[str, ...]):
    for block in _blocks(sch):
        stmt = sch.get(block)
        if stmt.name_hint in names and SPEC in stmt.annotations:
            return stmt.name_hint, ConvSpec.from_json(str(stmt.annotations[SPEC]))
    return None, None


def _extent(sch: Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tvm.tirx.IntImm) else None


def _is_spatial(sch: Schedule, block) -> bool:
    return all(int(iv.iter_type) == 0 for iv in sch.get(block).iter_vars)


def schedule_generic(sch: Schedule, isa: Isa) -> None:
    """Inline what can be inlined; then fuse, vectorise and parallelise each remaining loop nest."""
    for block in _blocks(sch)[:-1]:
        if _is_spatial(sch, block):
            try:
                sch.compute_inline(block)
            except ScheduleError:
                pass
    for block in _blocks(sch):
        loops = sch.get_loops(block)
        if not loops:
            continue
        if _is_spatial(sch, block):
            extents = [_extent(sch, lp) for lp in loops]
            if any(e is None for e in extents):
                continue
            total = 1
            for e in extents:
                total *= e
            fused = sch.fuse(*loops)
            inner = extents[-1]
            lanes = isa.lanes if inner % isa.lanes == 0 else 1
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
            stmt = sch.get(block)
            spatial = [lp for lp, iv in zip(loops, stmt.iter_vars) if int(iv.iter_type) == 0]
            # the leading loops that are spatial can run in parallel
            lead = []
            for lp in loops:
                if lp in spatial:
                    lead.append(lp)
                else:
                    break
            extents = [_extent(sch, lp) for lp in lead]
            if lead and all(e is not None for e in extents):
                total = 1
                for e in extents:
                    total *= e
                if total >= 2 * isa.lanes:
                    sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])


def schedule_function(func, isa: Isa):
    """The scheduled version of one TIR function (or the function itself if no schedule applies)."""
    sch = Schedule(tvm.IRModule({"main": func}))
    try:
        name, spec = _spec(sch, (CONV, DWCONV))
        if spec is not None:
            (schedule_dwconv if name == DWCONV else schedule_conv)(sch, spec, isa)
        else:
            schedule_generic(sch, isa)
    except Exception as err:  # noqa: BLE001 - a schedule that does not apply must not fail the build
        if os.environ.get("EDGEQ_SCHEDULE_DEBUG"):
            print(f"edgeq: schedule failed ({type(err).__name__}): {str(err).splitlines()[-1][:300]}", file=sys.stderr)
            print(func, file=sys.stderr)
        return func
    return sch.mod["main"]


def schedule_pass(isa: Isa):
    @tvm.transform.module_pass(opt_level=0, name="edgeq.ScheduleCPU")
    def _pass(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc) and not int(func.attrs.get("tirx.is_scheduled", 0)):
                updates[gv] = schedule_function(func, isa)
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def cpu_pipeline(target, isa: Isa):
    """TVM's CPU pipeline (``relax.backend.cpu_generic``) with edgeq's schedules after fusion."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CPUPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [schedule_pass(isa)]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline

