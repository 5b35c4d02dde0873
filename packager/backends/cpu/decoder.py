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


GROUP = 32  # weight-only quantization: one scale (and minimum) per 32 weights along the reduction
SCHEMES = {8: "symmetric", 4: "scale and minimum"}  # the manifest's generate.weight_scheme


def quantize_groups(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Weight-only quantization of ``w[k, n]`` in groups of ``GROUP`` along ``k``: (codes ``q[k, n]``, scales
    ``s[k / GROUP, n]`` float16, minimums ``m`` float16 or None).

    - 8 bits, symmetric: ``w ~ q * s``, ``q`` int8 in -127..127 (``s = max |w| / 127``).
    - 4 bits, a scale and a minimum (llama.cpp's Q4_1, MLC's zero-point form): ``w ~ q * s + m``, ``q`` in 0..15,
      ``m`` the group's smallest weight, ``s = (max - min) / 15``. Symmetric 4 bits (Q4_0's form) multiplied
      SmolLM2-135M's perplexity by 1.67 (``benchmarks/llm.py``); this form by 1.0x, since that checkpoint's
      weights already lie on a Q4_1 grid, which the minimum and scale of each group recover.

    The codes are rounded against the float16 scale and minimum they will be computed with."""
    k, n = w.shape
    groups = w.reshape(k // GROUP, GROUP, n).astype(np.float32)
    if bits == 8:
        scales = (np.abs(groups).max(axis=1) / 127).astype(np.float16)
        divisor = np.where(scales == 0, np.float16(1), scales).astype(np.float32)[:, None, :]
        codes = np.clip(np.rint(groups / divisor), -127, 127).astype(np.int8).reshape(k, n)
        return codes, scales, None
    lowest = groups.min(axis=1).astype(np.float16)
    scales = ((groups.max(axis=1) - lowest.astype(np.float32)) / 15).astype(np.float16)
    divisor = np.where(scales == 0, np.float16(1), scales).astype(np.float32)[:, None, :]
    codes = np.clip(np.rint((groups - lowest.astype(np.float32)[:, None, :]) / divisor), 0, 15).astype(np.uint8)
    return codes.reshape(k, n), scales, lowest


def _panels(array: np.ndarray, nb: int) -> np.ndarray:
    """``a[k, n] -> p[n // nb, k, n % nb]``."""
    k, n = array.shape
    return np.ascontiguousarray(array.reshape(k, n // nb, nb).transpose(1, 0, 2))


def packed_weights(name: str, w: np.ndarray, nb: int, bits: int | None) -> list[tuple[str, np.ndarray]]:
    """What replaces weight ``name`` in the bundle: its float panels; or, with ``bits``, its code panels (int8; for
    4 bits two codes a byte, ``k`` even in the low nibble) and its scale panels (float16), and for 4 bits its
    minimum panels (float16)."""
    if bits is None:
        return [(f"{name}_panels{nb}", _panels(w, nb))]
    codes, scales, lowest = quantize_groups(w, bits)
    if bits == 4:
        codes = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    packed = [(f"{name}_q{bits}panels{nb}", _panels(codes, nb)), (f"{name}_scales{nb}", _panels(scales, nb))]
    return packed + ([(f"{name}_minimums{nb}", _panels(lowest, nb))] if lowest is not None else [])


def quantized_product(x, codes, scales, lowest=None):
    """``out[.., n] = sum_k x[.., k] * w[k, n]`` with ``w`` dequantized from its code, scale (and minimum) panels (TE)."""
    count, rows, nb = (int(d) for d in codes.shape)

    def group(panels, n, k):
        return panels[n // nb, k // GROUP, n % nb].astype("float32")

    if codes.dtype == "int8":
        k = te.reduce_axis((0, rows), "k")
        return te.compute((*x.shape[:-1], count * nb), lambda *i: te.sum(
            x[(*i[:-1], k)] * (codes[i[-1] // nb, k, i[-1] % nb].astype("float32") * group(scales, i[-1], k)), axis=[k]),
            name=PACKED)
    pair, half = te.reduce_axis((0, rows), "k"), te.reduce_axis((0, 2), "half")

    def value(*i):
        n, kk = i[-1], pair * 2 + half
        nibble = (codes[n // nb, pair, n % nb].astype("int32") >> (half.astype("int32") * 4)) & 15
        return x[(*i[:-1], kk)] * (nibble.astype("float32") * group(scales, n, kk) + group(lowest, n, kk))

    return te.compute((*x.shape[:-1], count * nb), lambda *i: te.sum(value(*i), axis=[pair, half]), name=PACKED)


def pack(mod, weights: dict, isa: Isa, bits: int | None = None):
    """Every ``matmul(x, w)`` by a 2-D float32 weight ``w`` (its only use) in ``mod``'s functions made a product
    by ``w``'s panels (``packed_weights``), quantized to ``bits`` (8 or 4, weight-only) where given and ``w``'s
    reduction is whole groups. Returns (module, weights): the new arrays replace the weights they came from, in
    place in the parameter order every function shares."""
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
            whole = bits is not None and array.shape[0] % GROUP == 0
            packs[name] = packed_weights(name, array, nb, bits if whole else None)
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
                operands = self.replaced[call.args[1]]
                compute = packed_product if len(operands) == 1 else quantized_product
                return self.builder_.emit_te(compute, x, *operands, primfunc_name_hint=PACKED)
            return super().visit_call_(call)

    packer = Packer(mod, {})
    for gv, func in functions.items():
        count = int(func.attrs["num_input"])
        params, replaced = list(func.params[:count]), {}
        for param in func.params[count:]:
            if param.name in packs:
                new = [relax.Var(n, relax.TensorType(a.shape, str(a.dtype))) for n, a in packs[param.name]]
                replaced[param] = new
                params += new
            else:
                params.append(param)
        packer.replaced = replaced
        body = packer.visit_expr(func).body
        packer.builder_.update_func(gv, relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs, func.span))
    new_weights = {}
    for name, array in weights.items():
        new_weights.update(packs[name] if name in packs else [(name, array)])
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
        first = kinds.index(tvm.tirx.IterVar.CommReduce)
        if found is not None or any(kind != tvm.tirx.IterVar.CommReduce for kind in kinds[first:]):
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
    """``func`` scheduled as the module's text says, or None where it is no product by a weight. A 4-bit product
    reduces over byte and nibble (two loops); the nibble loop is unrolled, so each shift is a constant."""
    sch = Schedule(tvm.IRModule({"main": func}))
    main = _weight_product(sch)
    if main is None:
        return None
    stmt = sch.get(main)
    reductions = sum(iv.iter_type == tvm.tirx.IterVar.CommReduce for iv in stmt.iter_vars)
    loops = sch.get_loops(main)
    spatial, reduce = loops[:-reductions], loops[-reductions:]
    extents = [int(sch.get(loop).extent) for loop in spatial]
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
        sch.reorder(mo, no, *reduce, mi, ni)
        sch.unroll(mi)
        outer = sch.fuse(mo, no)
    else:
        sch.reorder(no, *reduce, ni)
        outer = no
    for loop in reduce[1:]:
        sch.unroll(loop)
    per_group = GROUP // 2 if reductions == 2 else GROUP  # codes a scale covers, along the first reduction loop
    if int(sch.get(reduce[0]).extent) % per_group == 0:
        # a group's codes unrolled: its scale and minimum are read and widened once, not once a code
        first, inner = sch.split(reduce[0], [None, per_group])
        sch.unroll(inner)
        reduce = [first, *reduce[1:]]
    sch.reverse_compute_at(wb, outer)
    sch.vectorize(ni)
    sch.parallel(outer)
    sch.decompose_reduction(main, reduce[0])
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


def build(mod, weights: dict, target, stats: dict | None = None, bits: int | None = None):
    """``relax.build`` of the steps for a CPU ``target``, their weights packed first (and quantized to ``bits``,
    weight-only, where given). Returns (executable, weights as the executable takes them)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from edgeq.backends.cpu import schedule

    from edgeq.backends.cpu.attention import attention_pass

    isa = Isa.of(target)
    mod, weights = pack(mod, weights, isa, bits)
    mod = attention_pass(isa, stats)(mod)
    passes = schedule.scheduling_passes(target, isa, stats)
    passes = passes[:-1] + [weight_product_pass(isa, stats)] + passes[-1:]

    @tvm.transform.module_pass(opt_level=0, name="edgeq.DecoderCPUPipeline")
    def _pipeline(module, _ctx):
        with target:
            return tvm.transform.Sequential(passes + cpu.dataflow_lower_passes(target)
                                            + cpu.finalize_passes(target))(module)

    return relax.build(mod, target=target, relax_pipeline=_pipeline), weights
