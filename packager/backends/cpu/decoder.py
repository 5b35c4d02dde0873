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

Weight-only int4 (``--precision int4``) multiplies in integers, as llama.cpp's Q4_1 x Q8_1 does: each row of
``x`` is quantized to int8 per group of 32 (``step = max |x| / 127``), each group's 32 code x activation
products are summed exactly in int32 by the CPU's dot-product instruction (AVX-512 VNNI ``vpdpbusd``: 64
per instruction; Arm ``sdot``: 16), and the float work is once per group and column: ``out += isum * (scale *
step) + minimum * step * sum(xq)``. The float form (a convert and two fused multiply-adds per weight) was
compute-bound at a third of the memory bandwidth's tokens/s (``benchmarks/llm.py``). The arithmetic is the same on every
CPU: one without the instruction (a build host checking a Jetson's bundle) runs the same integer sums in
vector lanes, so its tokens are the device's.
"""

from __future__ import annotations

import numpy as np

from edgeq.backends.cpu.common import DOT, TILE, Isa, epilogue, is_spatial, largest_divisor, repeated_bytes
from edgeq.graph import call_op
from edgeq.tvm_env import Schedule, relax, te, tvm

PACKED = "edgeq_packed_product"
DOT_SUMS = PACKED + "_dot"  # an int4 product's per-group integer sums
OFFSETS = PACKED + "_offsets"  # ... and the minimums' part, sum_g m[g, n] step[g] sum(xq_g)
MAX_VECTORS = 8  # a panel's width in vectors: decode's one row of accumulators


def panel_width(n: int, isa: Isa) -> int | None:
    """Columns per panel for a weight ``n`` wide: the most whole vectors, a power of 2 up to ``MAX_VECTORS``, that
    divide ``n``. (6 vectors, which SmolLM2's 576 and 192 columns allowed, compiled to products 3-4x slower per
    multiply-add than 4 or 8: LLVM splits vectors of 96 lanes badly.)"""
    if n % isa.lanes:
        return None
    vectors = n // isa.lanes
    return next(c for c in (8, 4, 2, 1) if c <= min(MAX_VECTORS, isa.accumulators) and vectors % c == 0) * isa.lanes


def packed_product(x, panels):
    """``out[.., n] = sum_k x[.., k] * panels[n // nb, k, n % nb]`` (TE)."""
    count, k_size, nb = (int(d) for d in panels.shape)
    k = te.reduce_axis((0, k_size), "k")
    return te.compute((*x.shape[:-1], count * nb),
                      lambda *i: te.sum(x[(*i[:-1], k)] * panels[i[-1] // nb, k, i[-1] % nb], axis=[k]), name=PACKED)


GROUP = 32  # weight-only quantization: one scale (and minimum) per 32 weights along the reduction
SCHEMES = {8: "symmetric", 4: "scale and minimum"}  # the manifest's generate.weight_scheme
ACTIVATION_BITS = {4: 8}  # ... and generate.activation_bits: int4 products quantize their activations (int4_product)


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


def dot_codes(codes: np.ndarray, nb: int) -> np.ndarray:
    """4-bit codes ``q[k, n]`` (0..15) as the dot product reads them: ``p[n // nb, k // 8, n % nb, b]`` (uint8),
    byte ``b`` holding code ``k = 8 (k // 8) + b`` in its low nibble and ``k + 4`` in its high one. One vector
    load is then ``lanes`` columns by 8 codes; a mask gives the 4 consecutive codes of each column that one
    dot-product lane sums, a shift and a mask the next 4."""
    k, n = codes.shape
    octets = codes.reshape(k // 8, 2, 4, n)
    pairs = (octets[:, 0] | (octets[:, 1] << 4)).astype(np.uint8)  # [k / 8, 4, n]
    return np.ascontiguousarray(pairs.reshape(k // 8, 4, n // nb, nb).transpose(2, 0, 3, 1))


def _panels(array: np.ndarray, nb: int) -> np.ndarray:
    """``a[k, n] -> p[n // nb, k, n % nb]``."""
    k, n = array.shape
    return np.ascontiguousarray(array.reshape(k, n // nb, nb).transpose(1, 0, 2))


def packed_weights(name: str, w: np.ndarray, nb: int, bits: int | None,
                   given: tuple | None = None) -> list[tuple[str, np.ndarray]]:
    """What replaces weight ``name`` in the bundle: its float panels; or, with ``bits``, its code panels (int8; for
    4 bits two codes a byte, as ``dot_codes`` lays them out) and its scale panels (float16), and for 4 bits its
    minimum panels (float16). ``given``: 4-bit (codes, scales, minimums) the model came with (MatMulNBits), used
    as they are (their scales may be float32)."""
    if bits is None:
        return [(f"{name}_panels{nb}", _panels(w, nb))]
    codes, scales, lowest = given if given is not None and bits == 4 else quantize_groups(w, bits)
    codes = dot_codes(codes, nb) if bits == 4 else _panels(codes, nb)
    packed = [(f"{name}_q{bits}panels{nb}", codes), (f"{name}_scales{nb}", _panels(scales, nb))]
    return packed + ([(f"{name}_minimums{nb}", _panels(lowest, nb))] if lowest is not None else [])


def quantized_product(x, codes, scales, lowest=None):
    """``out[.., n] = sum_k x[.., k] * w[k, n]`` with ``w`` from its code, scale (and minimum) panels (TE): int8
    codes dequantized to float32 as they are read; 4-bit codes by ``int4_product``."""
    if lowest is not None:
        return int4_product(x, codes, scales, lowest)
    count, rows, nb = (int(d) for d in codes.shape)
    k = te.reduce_axis((0, rows), "k")
    return te.compute((*x.shape[:-1], count * nb), lambda *i: te.sum(
        x[(*i[:-1], k)] * (codes[i[-1] // nb, k, i[-1] % nb].astype("float32")
                           * scales[i[-1] // nb, k // GROUP, i[-1] % nb].astype("float32")), axis=[k]), name=PACKED)


def int4_product(x, codes, scales, lowest):
    """``out[.., n] = sum_k x[.., k] * (q[k, n] s[k / 32, n] + m[k / 32, n])`` with ``x`` quantized to int8 per
    group of 32, as llama.cpp's Q4_1 x Q8_1 (TE, stages named ``PACKED_*``):

    - ``step[g] = max |x_g| * float32(1 / 127)``, ``xq = round(x * (1 / step))``, half to even (0 where the group
      is 0);
    - per group ``isum[g, n] = sum_k q[k, n] xq[k]`` and ``qsum[g] = sum_k xq[k]``, int32 and exact;
    - ``out[n] = sum_g m[g, n] (qsum[g] step[g]) + sum_g isum[g, n] (s[g, n] step[g])`` in float32: the product
      of the dequantized activations and weights. (The minimum times the float ``sum(x_g)`` instead is not: its
      rounding errors, multiplied by codes 0..15 that do not centre on 0, added up to 1.8% of the largest output
      on random data, against 0.7% for this form.)

    ``codes`` as ``dot_codes`` lays them out."""
    count, octets, nb, _ = (int(d) for d in codes.shape)
    size, groups, lead = octets * 8, octets * 8 // GROUP, list(x.shape[:-1])

    def along(name):
        return te.reduce_axis((0, GROUP), name)

    j = along("j")
    top = te.compute((*lead, groups), lambda *i: te.max(te.abs(x[(*i[:-1], i[-1] * GROUP + j)]), axis=[j]),
                     name=PACKED + "_max")
    # multiplications only, so that every CPU and compiler flag computes the same quantized activations: LLVM's
    # ``arcp`` (on in edgeq's CPU targets) may make x / step into x * (1 / step) on one CPU and not another
    step = te.compute((*lead, groups), lambda *i: top(*i) * tvm.tirx.const(float(np.float32(1) / np.float32(127)),
                                                                          "float32"), name=PACKED + "_step")
    zero, one = tvm.tirx.const(0, "float32"), tvm.tirx.const(1, "float32")
    inverse = te.compute((*lead, groups), lambda *i: tvm.tirx.Select(step(*i) == zero, zero, one / step(*i)),
                         name=PACKED + "_inverse")

    def quantized(*i):
        v = tvm.tirx.nearbyint(x(*i) * inverse[(*i[:-1], i[-1] // GROUP)])
        return te.max(te.min(v, tvm.tirx.const(127, "float32")), tvm.tirx.const(-127, "float32")).astype("int8")

    xq = te.compute((*lead, size), quantized, name=PACKED + "_xq")
    js = along("js")
    total = te.compute((*lead, groups), lambda *i: te.sum(xq[(*i[:-1], i[-1] * GROUP + js)].astype("int32"), axis=[js]),
                       name=PACKED + "_sum")
    jd = along("jd")

    def code(n, k):
        byte = codes[n // nb, k // 8, n % nb, k % 4]
        return ((byte >> ((k % 8) // 4 * 4).astype("uint8")) & tvm.tirx.const(15, "uint8")).astype("int32")

    isum = te.compute((*lead, groups, count * nb), lambda *i: te.sum(
        code(i[-1], i[-2] * GROUP + jd) * xq[(*i[:-2], i[-2] * GROUP + jd)].astype("int32"), axis=[jd]),
        name=DOT_SUMS)

    def panel(p, n, g):
        return p[n // nb, g, n % nb].astype("float32")

    # two sums of one product a term: each step is one fused multiply-add on every CPU (a term of two products
    # leaves LLVM to choose which to fuse, and x86 and Arm chose differently). The schedule starts the scaled sums
    # from the minimums' part (``_start_from_offsets``).
    g, gm = te.reduce_axis((0, groups), "g"), te.reduce_axis((0, groups), "gm")
    offsets = te.compute((*lead, count * nb), lambda *i: te.sum(
        panel(lowest, i[-1], gm) * (total[(*i[:-1], gm)].astype("float32") * step[(*i[:-1], gm)]), axis=[gm]),
        name=OFFSETS)
    scaled = te.compute((*lead, count * nb), lambda *i: te.sum(
        isum[(*i[:-1], g, i[-1])].astype("float32") * (panel(scales, i[-1], g) * step[(*i[:-1], g)]), axis=[g]),
        name=PACKED)
    # offsets first: the function's blocks come in the order the expression is walked, and ``_start_from_offsets``
    # makes the scaled sums read it
    return te.compute(scaled.shape, lambda *i: offsets(*i) + scaled(*i), name=PACKED + "_out")


def pack(mod, weights: dict, isa: Isa, bits: int | None = None, codes: dict | None = None):
    """Every ``matmul(x, w)`` by a 2-D float32 weight ``w`` (its only use) in ``mod``'s functions made a product
    by ``w``'s panels (``packed_weights``), quantized to ``bits`` (8 or 4, weight-only) where given and ``w``'s
    reduction is whole groups; ``codes``: name -> the 4-bit (codes, scales, minimums) a weight came with. Returns
    (module, weights): the new arrays replace the weights they came from, in place in the parameter order every
    function shares."""
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
            packs[name] = packed_weights(name, array, nb, bits if whole else None, (codes or {}).get(name))
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


def _tiles(sch: Schedule, main, nb: int, rows_held: int) -> tuple:
    """``main``'s loops (its rows, its columns, then one reduction) as tiles: up to ``rows_held`` rows (a divisor of
    them, unrolled) by a panel of ``nb`` columns, panel by panel. Returns (the tiles' loop, the reduction, the
    columns' loop)."""
    *spatial, reduce = sch.get_loops(main)
    rows = 1
    for loop in spatial[:-1]:
        rows *= int(sch.get(loop).extent)
    no, ni = sch.split(spatial[-1], [None, nb])
    if len(spatial) == 1:
        sch.reorder(no, reduce, ni)
        return no, reduce, ni
    mo, mi = sch.split(sch.fuse(*spatial[:-1]), [None, largest_divisor(rows, max(1, rows_held))])
    sch.reorder(no, mo, reduce, mi, ni)  # a panel's row tiles one after another: its weights stay in the cache
    sch.unroll(mi)
    return sch.fuse(no, mo), reduce, ni


def _panel_width_read(stmt) -> int | None:
    """``nb`` of the ``panels[n // nb, k, n % nb]`` read of a packed product's block."""
    found = {int(r.region[0].min.b) for r in stmt.reads if len(r.region) == 3
             and isinstance(r.region[0].min, tvm.tirx.FloorDiv) and isinstance(r.region[0].min.b, tvm.tirx.IntImm)}
    return found.pop() if len(found) == 1 else None


def schedule_weight_product(func, isa: Isa):
    """``func`` scheduled as the module's text says, or None where it is no product by a weight (an int4 one:
    ``_schedule_int4``)."""
    sch = Schedule(tvm.IRModule({"main": func}))
    if any(sch.get(b).name_hint == DOT_SUMS for b in sch.get_child_blocks(sch.get_sblock("root"))):
        return _schedule_int4(Schedule(tvm.IRModule({"main": _start_from_offsets(func)})), isa)
    main = _weight_product(sch)
    if main is None:
        return None
    nb = _panel_width_read(sch.get(main))
    if nb is None:
        return None
    wb = epilogue(sch, main)
    outer, reduce, ni = _tiles(sch, main, nb, isa.accumulators // (nb // isa.lanes))
    if int(sch.get(reduce).extent) % GROUP == 0:
        # a group's codes unrolled (int8): its scale is read and widened once, not once a code
        reduce, inner = sch.split(reduce, [None, GROUP])
        sch.unroll(inner)
    sch.reverse_compute_at(wb, outer)
    sch.vectorize(ni)
    sch.parallel(outer)
    sch.decompose_reduction(main, reduce)
    sch.vectorize(sch.get_loops(wb)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


INT4_INTRINSICS = {"vnni": "edgeq_int4_dot_16x8_vnni", "sdot": "edgeq_int4_dot_4x8_sdot"}
# int4_product's stages before the sums: the activations' quantization
_OWN = (PACKED + "_max", PACKED + "_step", PACKED + "_inverse", PACKED + "_xq", PACKED + "_sum")


def _register_int4(dot: str, llvm_name: str) -> None:
    """``c[i] += sum_k code(b, i, k) * a[k]`` for D lanes ``i`` and 8 codes ``k`` (two dot-product
    instructions): ``b[i, k % 4]`` holds code ``k`` in its low nibble for ``k < 4``, its high one after; the
    codes (0..15) are the instruction's unsigned operand on VNNI, and valid int8 for ``sdot``; the 8 int8
    activations ``a`` are broadcast 4 at a time."""
    from tvm.script import tirx as T

    d = DOT[dot][0]
    width = 4 * d

    # the operands as expressions, not TVMScript bindings (``common.repeated_bytes``)
    def nibbles(b, shift: int):
        """The codes in the low (``shift`` 0) or high (4) nibbles of the ``d x 4`` bytes, as int8."""
        v = b.vload([0, 0], dtype=f"uint8x{width}")
        if shift:
            v = T.shift_right(v, T.broadcast(T.uint8(shift), width))
        return T.reinterpret(T.bitwise_and(v, T.broadcast(T.uint8(15), width)), dtype=f"int8x{width}")

    @T.prim_func(s_tir=True)
    def desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        a = T.match_buffer(a_handle, (8,), "int8", offset_factor=1)
        b = T.match_buffer(b_handle, (d, 4), "uint8", offset_factor=1)
        c = T.match_buffer(c_handle, (d,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(c[0:d], b[0:d, 0:4], a[0:8])
            T.writes(c[0:d])
            for i in T.serial(0, d):
                for k in T.serial(0, 8):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(T.bitwise_and(T.shift_right(b[vi, vk % 4], T.Cast("uint8", vk // 4 * 4)),
                                                             T.uint8(15)), "int32") * T.cast(a[vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        a = T.match_buffer(a_handle, (8,), "int8", offset_factor=1)
        b = T.match_buffer(b_handle, (d, 4), "uint8", offset_factor=1)
        c = T.match_buffer(c_handle, (d,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(c[0:d], b[0:d, 0:4], a[0:8])
            T.writes(c[0:d])
            c[T.ramp(T.int32(0), 1, d)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm_name),
                T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(llvm_name), c.vload([0], dtype=f"int32x{d}"),
                                        nibbles(b, 0), repeated_bytes(a, 0, "int8", d), dtype=f"int32x{d}"),
                nibbles(b, 4), repeated_bytes(a, 4, "int8", d), dtype=f"int32x{d}")

    tvm.s_tir.TensorIntrin.register(INT4_INTRINSICS[dot], desc, impl, override=True)


_register_int4("vnni", "llvm.x86.avx512.vpdpbusd.512")
_register_int4("sdot", "llvm.aarch64.neon.sdot.v4i32.v16i8")


def _start_from_offsets(func):
    """``int4_product``'s ``scaled + offsets`` with the scaled sums' reduction starting from ``offsets`` instead of
    0, and the add a copy: the float accumulator's first value is the minimums' part, then one fused
    multiply-add a group. (``te.sum(init=...)`` would say this, but ``te.create_prim_func`` drops the init in
    TVM 0.27: ``common.accumulate_from`` does the same for a parameter.)"""
    import tvm_ffi
    from tvm.s_tir import SBlock

    written = {}

    def find(b):
        if b.name_hint in (OFFSETS, PACKED):
            written[b.name_hint] = b.writes[0].source
        return b

    tvm_ffi.structural_map(func, [(SBlock, find)])
    offsets, scaled = written[OFFSETS], written[PACKED]

    def region(indices):
        return tvm.tirx.BufferRegion(offsets, [tvm.ir.Range.from_min_extent(i, 1) for i in indices])

    def rewrite(b):
        if b.name_hint == PACKED and b.init is not None:
            idx = b.init.indices
            init = tvm.tirx.BufferStore(scaled, tvm.tirx.BufferLoad(offsets, idx), idx)
            return SBlock(b.iter_vars, [*b.reads, region(idx)], b.writes, b.name_hint, b.body, init, b.alloc_buffers,
                          b.match_buffers, b.annotations)
        if b.name_hint == PACKED + "_out":
            store = b.body
            (load,) = [r for r in (store.value.a, store.value.b) if r.source.same_as(scaled)]
            reads = [r for r in b.reads if not r.source.same_as(offsets)]
            copy = tvm.tirx.BufferStore(store.buffer, load, store.indices)
            return SBlock(b.iter_vars, reads, b.writes, b.name_hint, copy, None, b.alloc_buffers, b.match_buffers,
                          b.annotations)
        return b

    return tvm_ffi.structural_map(func, [(SBlock, rewrite)])


def _schedule_int4(sch: Schedule, isa: Isa):
    """``int4_product``'s function (and its fused epilogue) scheduled: as the float product, a tile of ``rows x
    nb`` float accumulators per panel, walking the groups; in each group the integer sums of the tile (as many
    int32 registers) by the dot-product instruction, 8 codes of ``lanes`` columns a step. A CPU without the
    instruction sums the same integers in vector lanes. The activations' quantization runs first, on one core, as
    plain loops that LLVM vectorizes (about 1 us for k = 576; scheduled in TIR vectors, with the maxima and sums
    as partial results, it took twice that)."""
    main, sums = sch.get_sblock(PACKED), sch.get_sblock(DOT_SUMS)
    others = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))
              if not is_spatial(sch, b) and sch.get(b).name_hint not in (PACKED, DOT_SUMS, OFFSETS, *_OWN)]
    if others:  # another reduction fused in (a norm before the product): not this kernel's function
        return None
    dot = isa.dot if isa.dot in INT4_INTRINSICS else ""
    d = DOT[dot][0] if dot else isa.lanes
    nb = _panel_width_read(sch.get(main))
    if nb is None or nb % d:
        return None
    wb = epilogue(sch, main, keep=_OWN)
    outer, g, ni = _tiles(sch, main, nb, isa.accumulators // (2 * nb // d))  # float and int32 tiles in registers
    sch.reverse_compute_at(wb, outer)
    offsets = sch.get_sblock(OFFSETS)
    sch.compute_at(offsets, outer)
    sch.set_scope(offsets, 0, TILE)
    *tile, gm = sch.get_loops(offsets)[_depth(sch, outer) + 1:]
    sch.reorder(gm, *tile)
    sch.vectorize(tile[-1])
    for loop in tile[:-1]:
        sch.unroll(loop)
    sch.compute_at(sums, g)
    sch.set_scope(sums, 0, TILE)
    loops = sch.get_loops(sums)
    *row_loops, n_loop, k_loop = loops[_depth(sch, g) + 1:]
    vectors, lane = sch.split(n_loop, [None, d])
    step, octet = sch.split(k_loop, [None, 8])
    sch.vectorize(ni)
    sch.parallel(outer)
    if dot:
        sch.reorder(step, *row_loops, vectors, lane, octet)
    else:  # the same sums in vector lanes: a build host checking another CPU's bundle
        sch.reorder(step, *row_loops, vectors, octet, lane)
        sch.unroll(octet)
        sch.vectorize(lane)
    init = sch.decompose_reduction(sums, step)
    sch.vectorize(sch.get_loops(init)[-1])
    if dot:
        sch.tensorize(lane, INT4_INTRINSICS[dot])
    for loop in (*row_loops, vectors, step):
        sch.unroll(loop)
    sch.decompose_reduction(main, g)
    sch.vectorize(sch.get_loops(sch.decompose_reduction(offsets, gm))[-1])
    sch.vectorize(sch.get_loops(wb)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _depth(sch: Schedule, loop) -> int:
    """How many loops enclose ``loop`` (its index in ``get_loops`` of a block under it)."""
    depth, parent = 0, sch.get_sref(loop).parent
    while parent is not None and isinstance(parent.stmt, tvm.tirx.For):
        depth, parent = depth + 1, parent.parent
    return depth


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


def build(mod, weights: dict, target, stats: dict | None = None, bits: int | None = None, codes: dict | None = None):
    """``relax.build`` of the steps for a CPU ``target``, their weights packed first (and quantized to ``bits``,
    weight-only, where given; ``codes``: 4-bit weights the model came with, ``pack``). Returns (executable, weights
    as the executable takes them)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from edgeq.backends.cpu import schedule

    from edgeq.backends.cpu.attention import attention_pass, cache_write_pass

    isa = Isa.of(target)
    mod, weights = pack(mod, weights, isa, bits, codes)
    mod = attention_pass(isa, stats)(mod)
    mod = cache_write_pass(stats)(mod)
    passes = schedule.scheduling_passes(target, isa, stats)
    passes = passes[:-1] + [weight_product_pass(isa, stats)] + passes[-1:]

    @tvm.transform.module_pass(opt_level=0, name="edgeq.DecoderCPUPipeline")
    def _pipeline(module, _ctx):
        with target:
            return tvm.transform.Sequential(passes + cpu.dataflow_lower_passes(target)
                                            + cpu.finalize_passes(target))(module)

    return relax.build(mod, target=target, relax_pipeline=_pipeline), weights
