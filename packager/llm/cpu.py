"""A decoder's steps built for a CPU: TVM's pipeline with edgeq's CPU schedules, and before them one rule of its
own for the products by a weight, which are nearly all of a decoder's work.

An exported decoder multiplies by its weights as ``x[1, m, k] @ w[k, n]``. Decode has ``m = 1``: a
matrix-vector product that reads every weight once per token, so its speed is the memory bandwidth's if the
weights stream through. Read as stored, a tile of columns takes a short run from each of ``k`` rows a whole
row apart (196 KB for SmolLM2's LM head): a new page each step, which the prefetchers do not cross (measured:
7.8 GB/s against numpy's 39 GB/s on that head). So each weight is packed at build time (``pack``) into column
panels, ``w[k, n] -> p[n // nb, k, n % nb]``: a panel is one contiguous stream. The schedule
(``schedule_weight_product``) keeps ``rows x nb`` accumulators in registers, walks ``k`` through one panel
(broadcasting one element of ``x`` per row) and spreads the panels over the cores; the fused epilogue (a
residual add, the SwiGLU product) is computed on the accumulators, as edgeq's other kernels do. Weights the
bundle ships are the packed arrays; every step reads the same ones.
"""

from __future__ import annotations

import numpy as np

from edgeq.backends.cpu.common import Isa, epilogue, largest_divisor
from edgeq.graph import call_op
from edgeq.tvm_env import Schedule, relax, te, tvm

PACKED = "edgeq_packed_product"
MAX_VECTORS = 8  # a panel's width in vectors: decode's one row of accumulators


def panel_width(n: int, isa: Isa) -> int | None:
    """Columns per panel for a weight ``n`` wide: the most whole vectors (up to ``MAX_VECTORS``) dividing ``n``."""
    if n % isa.lanes:
        return None
    return largest_divisor(n // isa.lanes, min(MAX_VECTORS, isa.accumulators)) * isa.lanes


def packed_product(x, panels):
    """``out[.., n] = sum_k x[.., k] * panels[n // nb, k, n % nb]`` (TE)."""
    count, k_size, nb = (int(d) for d in panels.shape)
    k = te.reduce_axis((0, k_size), "k")
    return te.compute((*x.shape[:-1], count * nb),
                      lambda *i: te.sum(x[(*i[:-1], k)] * panels[i[-1] // nb, k, i[-1] % nb], axis=[k]), name=PACKED)


def pack(mod, weights: dict, isa: Isa):
    """Every ``matmul(x, w)`` by a 2-D float32 weight ``w`` (its only use) in ``mod``'s functions made a product
    by ``w``'s panels. Returns (module, weights): the packed arrays replace the weights they came from, in place
    in the parameter order every function shares."""
    functions = {gv: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    uses: dict[str, list] = {}
    for func in functions.values():
        for var in relax.analysis.free_vars(func.body):
            uses.setdefault(var.name, [])
        _collect(func.body, uses)
    packs = {}
    for name, calls in uses.items():
        array = weights.get(name)
        if array is None or array.ndim != 2 or array.dtype != np.float32 or not calls or not all(calls):
            continue
        nb = panel_width(array.shape[1], isa)
        if nb is not None:
            k, n = array.shape
            packs[name] = (f"{name}_panels{nb}", np.ascontiguousarray(array.reshape(k, n // nb, nb).transpose(1, 0, 2)))
    if not packs:
        return mod, weights

    @relax.expr_functor.mutator
    class Packer(relax.PyExprMutator):
        def __init__(self, module, replaced):
            super().__init__(module)
            self.replaced = replaced

        def visit_call_(self, call):
            if call_op(call) == "relax.matmul" and call.args[1] in self.replaced:
                x = self.visit_expr(call.args[0])
                return self.builder_.emit_te(packed_product, x, self.replaced[call.args[1]],
                                             primfunc_name_hint=PACKED)
            return super().visit_call_(call)

    packer = Packer(mod, {})
    for gv, func in functions.items():
        count = int(func.attrs["num_input"])
        params, replaced = list(func.params), {}
        for i in range(count, len(params)):
            if params[i].name in packs:
                new_name, array = packs[params[i].name]
                replaced[params[i]] = relax.Var(new_name, relax.TensorType(array.shape, "float32"))
                params[i] = replaced[params[i]]
        packer.replaced = replaced
        body = packer.visit_expr(func).body
        packer.builder_.update_func(gv, relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs, func.span))
    new_weights = {packs[n][0] if n in packs else n: packs[n][1] if n in packs else a for n, a in weights.items()}
    return packer.builder_.get(), new_weights


def _collect(expr, uses: dict) -> None:
    """``uses[name]``: for each use of a variable, True where it is the weight operand of a matmul."""
    def visit(node):
        if isinstance(node, relax.Call):
            for i, arg in enumerate(node.args):
                if isinstance(arg, relax.Var):
                    uses.setdefault(arg.name, []).append(call_op(node) == "relax.matmul" and i == 1)
        elif isinstance(node, relax.Tuple):
            for field in node.fields:
                if isinstance(field, relax.Var):
                    uses.setdefault(field.name, []).append(False)

    relax.analysis.post_order_visit(expr, visit)


def _weight_product(sch: Schedule):
    """The block of ``packed_product``, where it is the function's one reduction, or None."""
    root = sch.get_sblock("root")
    found = None
    for block in sch.get_child_blocks(root):
        stmt = sch.get(block)
        kinds = [iv.iter_type for iv in stmt.iter_vars]
        if tvm.tirx.IterVar.CommReduce not in kinds:
            continue
        if found is not None or kinds.count(tvm.tirx.IterVar.CommReduce) != 1 or kinds[-1] != tvm.tirx.IterVar.CommReduce:
            return None
        if stmt.name_hint != PACKED:
            return None
        found = block
    return found


def _panel_width_read(stmt) -> int | None:
    """``nb`` of the ``panels[n // nb, k, n % nb]`` read of a packed product's block."""
    found = {int(r.region[0].min.b) for r in stmt.reads if len(r.region) == 3
             and isinstance(r.region[0].min, tvm.tirx.FloorDiv) and isinstance(r.region[0].min.b, tvm.tirx.IntImm)}
    return found.pop() if len(found) == 1 else None


def schedule_weight_product(func, isa: Isa):
    """``func`` scheduled as the module's text says, or None where it is no product by a weight."""
    sch = Schedule(tvm.IRModule({"main": func}))
    main = _weight_product(sch)
    if main is None:
        return None
    loops = sch.get_loops(main)
    spatial, k = loops[:-1], loops[-1]
    extents = [int(sch.get(loop).extent) for loop in spatial]
    stmt = sch.get(main)
    nb = _panel_width_read(stmt)
    if nb is None:
        return None
    rows = 1
    for extent in extents[:-1]:
        rows *= extent
    mb = largest_divisor(rows, max(1, isa.accumulators // (nb // isa.lanes)))
    wb = epilogue(sch, main)
    m = sch.fuse(*spatial[:-1]) if len(spatial) > 1 else None
    no, ni = sch.split(spatial[-1], [None, nb])
    if m is not None:
        mo, mi = sch.split(m, [None, mb])
        sch.reorder(mo, no, k, mi, ni)
        sch.unroll(mi)
        outer = sch.fuse(mo, no)
    else:
        sch.reorder(no, k, ni)
        outer = no
    sch.reverse_compute_at(wb, outer)
    sch.vectorize(ni)
    sch.parallel(outer)
    sch.decompose_reduction(main, k)
    sch.vectorize(sch.get_loops(wb)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def weight_product_pass(isa: Isa, stats: dict | None = None):
    @tvm.transform.module_pass(opt_level=0, name="edgeq.ScheduleWeightProducts")
    def _pass(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            if isinstance(func, tvm.tirx.PrimFunc) and not int(func.attrs.get("tirx.is_scheduled", 0)):
                try:
                    scheduled = schedule_weight_product(func, isa)
                except tvm.s_tir.ScheduleError:
                    scheduled = None
                if scheduled is not None:
                    mod[gv] = scheduled
                    if stats is not None:
                        stats["weight-product"] = stats.get("weight-product", 0) + 1
        return mod

    return _pass


def build(mod, weights: dict, target, stats: dict | None = None):
    """``relax.build`` of the steps for a CPU ``target``, their weights packed first. Returns (executable,
    weights as the executable takes them)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from edgeq.backends.cpu import schedule

    isa = Isa.of(target)
    mod, weights = pack(mod, weights, isa)
    passes = schedule.scheduling_passes(target, isa, stats)
    passes = passes[:-1] + [weight_product_pass(isa, stats)] + passes[-1:]

    @tvm.transform.module_pass(opt_level=0, name="edgeq.DecoderCPUPipeline")
    def _pipeline(module, _ctx):
        with target:
            return tvm.transform.Sequential(passes + cpu.dataflow_lower_passes(target)
                                            + cpu.finalize_passes(target))(module)

    return relax.build(mod, target=target, relax_pipeline=_pipeline), weights
