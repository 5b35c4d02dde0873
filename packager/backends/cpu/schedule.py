"""The CPU compilation pipeline: TVM's default Relax pipeline with edgeq's schedules applied to every
TIR function after operator fusion, and exp/tanh as TVM's fast (vectorisable) approximations.

Each function gets the first schedule rule of ``edgeq.backends.cpu.rules.SCHEDULES`` that applies to it:

- a function that contains an edgeq kernel (its block, annotated with its spec) gets that kernel's
  register-tiled schedule, with the fused epilogue computed on the accumulator tile;
- a row-wise function (softmax, LayerNorm; ``edgeq.backends.cpu.rows``) is computed row by row;
- every other function (pooling, element-wise chains, layout transposes, reductions) gets the generic
  schedule (``edgeq.backends.cpu.generic``), the last rule.
A rule that fails hands the function to the next; one that no rule schedules stays as TVM made it:
slower, never wrong.
"""

from __future__ import annotations

import os
import sys

from edgeq.backends.cpu.common import Isa, Kernel
from edgeq.backends.cpu.generic import schedule_rest
from edgeq.backends.cpu.rounding import constant_magnitudes, fast_requantize
from edgeq.backends.cpu.rules import SCHEDULES
from edgeq.tvm_env import Schedule, relax, tvm


# ``round`` (relax.round, every requantize) lowers to ``tirx.nearbyint`` (round half to even), which TVM 0.27
# does not mark vectorisable: a loop holding it was left scalar, and LLVM re-vectorised the requantizing
# epilogue across pixels instead of channels, with gathers and a byte store per value (MNASNet's first
# depthwise layer: 128 ``vpextrb`` per tile). It is an LLVM intrinsic with vector forms, like ``round``.
if tvm.ir.Op.get("tirx.nearbyint").get_attr("TVectorizable") is None:
    tvm.ir.register_op_attr("tirx.nearbyint", "TVectorizable", True)


# the kernels' rewrites of their scheduled functions (``Kernel.finish``): each leaves other functions alone
FINISHES = [rule.finish for rule in SCHEDULES if getattr(rule, "finish", None)]


def schedule_function(func, isa: Isa) -> tuple[object, str]:
    """(scheduled function, the name of the rule that scheduled it: "conv", "conv-vnni", "dwconv",
    "winograd", "bmm", "rows", "generic"), or (``func``, "none") when no schedule applied and the function
    is left as TVM made it. A rule that fails part-way hands the function, as it was, to the next rule."""
    for rule in SCHEDULES:
        sch = Schedule(tvm.IRModule({"main": func}))
        try:
            kind = rule.apply(sch, isa)
            if kind is not None and isinstance(rule, Kernel):
                schedule_rest(sch, isa)  # the element-wise blocks fused around the kernel's
        except Exception as err:  # noqa: BLE001 - a schedule that does not apply must not fail the build
            if os.environ.get("EDGEQ_SCHEDULE_DEBUG"):
                print(f"edgeq: schedule {getattr(rule, 'name', rule)} failed ({type(err).__name__}): "
                      f"{str(err).splitlines()[-1][:300]}", file=sys.stderr)
                print(func, file=sys.stderr)
            continue
        if kind is not None:
            return sch.mod["main"], kind
    return func, "none"


def schedule_pass(isa: Isa, stats: dict[str, int] | None = None):
    """A module pass scheduling every TIR function not scheduled yet, then putting its requantizing
    epilogues in their fast form (``edgeq.backends.cpu.rounding``); counts by schedule into ``stats``."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.ScheduleCPU")
    def _pass(mod, _ctx):
        updates = {}
        magnitudes = constant_magnitudes(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc) and not int(func.attrs.get("tirx.is_scheduled", 0)):
                scheduled, kind = schedule_function(func, isa)
                # after scheduling: the epilogue is one expression once its blocks are inlined
                scheduled = fast_requantize(scheduled, magnitudes.get(gv.name_hint))
                for finish in FINISHES:  # then the kernels' own rewrites (which may hide an int32 product)
                    scheduled = finish(scheduled)
                updates[gv] = scheduled
                if stats is not None:
                    stats[kind] = stats.get(kind, 0) + 1
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def scheduling_passes(target, isa: Isa, stats: dict[str, int] | None = None) -> list:
    """The passes of ``cpu_pipeline`` up to and including edgeq's schedules (the TIR functions as they are
    scheduled: what the kernel tests read)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    # one tensor requantized for two consumers is two equal expressions (requantize rewrites each quantize):
    # as one, it fuses into the convolution that made it (RegNetY's stem: two standalone requantizes of
    # 112x112x32, 0.25 ms each)
    return ([relax.transform.EliminateCommonSubexpr()]
            + cpu.library_dispatch_passes(target)
            # exp and tanh as vectorised polynomials (fast_exp, fast_tanh): LLVM calls libm per lane
            + [erf_fp16_in_float32(), relax.transform.FastMathTransform()]
            + cpu.legalize_passes(target)
            + [schedule_pass(isa, stats)])


def erf_fp16_in_float32():
    """fp16 ``erf`` computed in float32: FastMathTransform makes erf TVM's ``fast_erf``, whose float16 form returns
    up to 1.041 for |x| >= 4 (measured: 4% off; its float32 form is within 2e-7). An fp16 graph run on the build host
    (the GPU path's golden outputs: a GELU in erf form on a large pre-activation) was wrong where the device is
    right."""

    @relax.expr_functor.mutator
    class Mutator(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.erf"
                    and str(getattr(call.ty, "dtype", "")) == "float16"):
                return call
            wide = self.builder_.emit(relax.op.astype(call.args[0], "float32"))
            return relax.op.astype(self.builder_.emit(relax.op.erf(wide)), "float16")

    @tvm.transform.module_pass(opt_level=0, name="edgeq.ErfFp16InFloat32")
    def _pass(mod, _ctx):
        mutator = Mutator(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        return mutator.builder_.get()

    return _pass


def cpu_pipeline(target, isa: Isa, stats: dict[str, int] | None = None):
    """TVM's CPU pipeline (``relax.backend.cpu_generic``) with edgeq's schedules after fusion."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CPUPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(scheduling_passes(target, isa, stats)
                                           + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))
            return seq(mod)

    return _pipeline

