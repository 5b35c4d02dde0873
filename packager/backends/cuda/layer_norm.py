"""A transformer's layer norm with the outputs the next layers read (float32, and fp16 or per-token int8), in one
kernel (#42).

On the fp16 CUDA path ToMixedPrecision keeps a layer norm in float32: its output is the residual stream (float32,
which the next output projection or FFN adds in its CUTLASS epilogue) and, cast to fp16, the input of the next
linear layers. TVM runs that as two kernels, the layer norm and the cast: FuseOps does not fuse an element-wise
operator after a reduction whose output has another reader, and dlight's reduction rule schedules one output. Here
the two are one kernel (TensorRT's LayerNorm plugins write what the next layer reads the same way): a warp
normalizes one row (the sum and the sum of squared deviations as warp shuffles, TVM's cross-thread reduction),
and each thread writes its elements in float32 and in fp16. The arithmetic is TVM's own legalization of
``R.nn.layer_norm`` (mean, then the variance of the deviations, ``rsqrt(var / C + eps)``), so the float32 output
is the graph's; the fp16 one is its cast.

In an int8 graph the next linear layer reads the layer norm's output quantized per token: a row-scale kernel
(``max|y|``) and a quantize kernel followed the layer norm. The same kernel takes both in: after y, the threads
reduce ``max|y|`` (each over the elements it wrote), and write the row's scale and the int8 row, as the graph's
functions compute them. Three kernels become one.

``find_layer_norms`` finds them, ``claim_layer_norms`` puts the kernels' calls in their place, ``twin_prim_func``
is the function before its schedule (the host runs it: ``with_twins``), ``prim_func`` the scheduled one.

The per-token quantizes no layer norm makes (a transformer's context, its GELU's output, its input) get the same
treatment without the normalization: ``RowQuantizeKernel`` writes the row's scale and the int8 row in one kernel
(``find_row_quantizes``, ``claim_row_quantizes``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

ROW_SCALE_ATTR = "edgeq.row_scale_q"  # on pipeline.row_scales_in_one_kernel's PrimFunc: its q
WARP = 32
MAX_WARPS = 8  # threads a row: a warp per 256 elements, up to 8 warps


class _RowKernel:
    """A kernel that takes a row (the last axis of ``shape``) a block: its rows, threads and grid."""

    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def threads(self) -> int:
        return WARP * max(1, min(MAX_WARPS, self.shape[-1] // 256))

    @property
    def grid(self) -> tuple[int, int]:
        return self.rows, 1


@dataclasses.dataclass(frozen=True)
class LayerNormKernel(_RowKernel):
    """``y = (x - mean) * rsqrt(var + eps) * gamma + beta`` over the last axis of x (float32), written as float32 and
    as what the next layer reads: fp16 (its cast), or, with ``quantize`` (an int8 graph's per-token input), the
    row's scale ``where(max|y| > 0, max|y| / q, 1)`` ([..., 1]) and ``int8(clamp(round(y / scale), lo, hi))``. The
    second output in the shape the graph has it (``second_shape``: a view of the same elements)."""

    name: str
    shape: tuple[int, ...]  # x's and y's
    epsilon: float
    second_shape: tuple[int, ...]
    quantize: float | None = None  # q of the per-token scale (int8), None: an fp16 cast
    clamp: tuple[float, float] = (-127.0, 127.0)

    @property
    def function(self) -> str:
        return f"layernorm_{self.name}"


@dataclasses.dataclass(frozen=True)
class ClaimedLayerNorm:
    """A layer norm the kernel took: the Relax variables of its operands, its float32 output (the layer norm's own
    variable), the graph's fp16 cast of it or its int8 quantize (``cast``), the per-token scale (int8), and the
    bindings between them that go (a reshape; the division, rounding and clamps)."""

    kernel: LayerNormKernel
    x: object
    gamma: object
    beta: object
    output: object
    cast: object
    between: tuple = ()
    scale: object = None


def twin_prim_func(kernel: LayerNormKernel):
    """The kernel's computation as plain TIR (TE, TVM's legalization of ``R.nn.layer_norm`` plus the cast)."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    te, tirx = tvm.te, tvm.tirx
    *lead, c = kernel.shape
    x = te.placeholder(kernel.shape, "float32", "x")
    gamma, beta = te.placeholder((c,), "float32", "gamma"), te.placeholder((c,), "float32", "beta")
    width = tirx.const(float(c), "float32")
    k = te.reduce_axis((0, c), "k")
    total = te.compute(lead, lambda *i: te.sum(x[(*i, k)], axis=k), "x_sum")
    mean = te.compute(lead, lambda *i: total[i] / width, "x_mean")
    k2 = te.reduce_axis((0, c), "k2")
    var = te.compute(lead, lambda *i: te.sum((x[(*i, k2)] - mean[i]) * (x[(*i, k2)] - mean[i]), axis=k2),
                     "x_var_sum")
    # 1 / sqrt, as the host computes rsqrt: IEEE on both (CUDA's rsqrtf is an approximation, device_math.py)
    y = te.compute(kernel.shape, lambda *i: (x[i] - mean[i[:-1]]) * (tirx.const(1.0, "float32") / tirx.sqrt(
        var[i[:-1]] / width + tirx.const(kernel.epsilon, "float32"))) * gamma[i[-1]] + beta[i[-1]], "y")
    if kernel.quantize is None:
        y16 = te.compute(kernel.shape, lambda *i: y[i].astype("float16"), "y16")
        return te.create_prim_func([x, gamma, beta, y, y16])
    # the per-token scale as pipeline._row_scale computes it, and the quantize as the graph writes it
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    k3 = te.reduce_axis((0, c), "k3")
    amax = te.compute((*lead, 1), lambda *i: te.max(te.abs(y[(*i[:-1], k3)]), axis=k3), "amax")
    scale = te.compute((*lead, 1), lambda *i: tirx.Select(amax[i] > f32(0.0), amax[i] / f32(kernel.quantize),
                                                          f32(1.0)), "scale")
    lo, hi = kernel.clamp
    q8 = te.compute(kernel.shape, lambda *i: te.min(te.max(tirx.round(y[i] / scale[(*i[:-1], 0)]), f32(lo)),
                                                    f32(hi)).astype("int8"), "q8")
    return te.create_prim_func([x, gamma, beta, y, scale, q8])


def prim_func(kernel: LayerNormKernel):
    """``twin_prim_func`` scheduled for the GPU: a block of ``threads`` per row, the two reductions across its
    threads (warp shuffles), each thread writing its elements of both outputs."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": twin_prim_func(kernel)}))
    y = sch.get_sblock("y")
    loops = sch.get_loops(y)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    _, tx = sch.split(loops[-1], [None, kernel.threads])
    sch.bind(row, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if kernel.quantize is None:
        sch.reverse_compute_at(sch.get_sblock("y16"), tx)
    else:  # after y: max|y| across the threads (each reads the elements it wrote), the scale, the quantize
        for name in ("amax", "scale", "q8"):
            block = sch.get_sblock(name)
            sch.reverse_compute_at(block, row)
            if name == "amax":
                sch.set_scope(block, 0, "shared")
            if name != "scale":
                _, t = sch.split(sch.get_loops(block)[-1], [None, kernel.threads])
                sch.bind(t, "threadIdx.x")
    for name in ("x_var_sum", "x_mean", "x_sum"):
        block = sch.get_sblock(name)
        sch.compute_at(block, row)
        sch.set_scope(block, 0, "shared")
        if name != "x_mean":
            _, t = sch.split(sch.get_loops(block)[-1], [None, kernel.threads])
            sch.bind(t, "threadIdx.x")
    return sch.mod["main"].with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def kernel_record(kernel: LayerNormKernel) -> dict:
    """What the manifest says of one layer-norm kernel."""
    outputs = ["float32", "float16"] if kernel.quantize is None else ["float32", "float32 per-token scale", "int8"]
    return {"function": kernel.function, "template": "edgeq layer norm (TIR: a row a block, warp-shuffle "
            f"reductions, {', '.join(outputs)} outputs)", "threads": kernel.threads, "grid": list(kernel.grid),
            "shape": list(kernel.shape), "epsilon": kernel.epsilon, "outputs": outputs}


def find_layer_norms(mod) -> list[ClaimedLayerNorm]:
    """The float32 ``layer_norm`` calls of ``mod``'s main over the last axis (with scale and shift weights) whose
    output the next layer also reads as fp16, ``astype(y, float16)`` (maybe through a reshape), or as int8 with a
    per-token scale: ``s = row_scale(y)`` (``pipeline.row_scales_in_one_kernel``'s function) and ``astype(minimum(
    maximum(round(y / s), lo), hi), int8)``."""
    from edgeq.backends.cuda.cutlass.match import main_index, quantize_tail
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, params = main_index(mod["main"])

    def only_reader(var, op):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None and call_op(value_of[r[0]]) == op else None

    def row_scale_q(var) -> float | None:
        value = value_of.get(var)
        if call_op(value) != "relax.call_tir" or len(value.args[1].fields) != 1:
            return None
        func = mod.functions.get(value.args[0])
        q = (func.attrs or {}).get(ROW_SCALE_ATTR) if func is not None else None
        return float(q) if q is not None else None

    def quantized(var):  # (scale, [the bindings between], int8 var, (lo, hi), q) or None
        scale = next((r for r in readers.get(var, []) if r is not None and row_scale_q(r) is not None), None)
        divide = next((r for r in readers.get(var, []) if r is not None and call_op(value_of[r]) == "relax.divide"
                       and value_of[r].args[0].same_as(var) and value_of[r].args[1].same_as(scale)), None)
        tail = quantize_tail(divide, value_of, readers) if scale is not None and divide is not None else None
        if tail is None:
            return None
        between, cast, clamp = tail
        return scale, (divide, *between), cast, clamp, row_scale_q(scale)

    found = []
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.nn.layer_norm" or dtype_of(b.var) != "float32":
            continue
        x, gamma, beta = value.args
        shape = shape_of(b.var)
        attrs = value.attrs
        axes = [int(a) for a in attrs.axes]
        if shape is None or axes not in ([-1], [len(shape) - 1]) or not (attrs.center and attrs.scale) \
                or gamma not in params or beta not in params or shape_of(gamma) != [shape[-1]] \
                or shape_of(beta) != [shape[-1]] or dtype_of(x) != "float32":
            continue
        name = f"n{len(found)}"
        int8 = quantized(b.var)
        if int8 is not None:
            scale, between, cast, clamp, q = int8
            kernel = LayerNormKernel(name, tuple(shape), float(attrs.epsilon), tuple(shape_of(cast)), q, clamp)
            found.append(ClaimedLayerNorm(kernel, x, gamma, beta, b.var, cast, between, scale))
            continue
        cast, between = None, ()
        for r in readers.get(b.var, []):
            rv = value_of.get(r)
            if call_op(rv) == "relax.astype" and dtype_of(r) == "float16":
                cast = r
            elif call_op(rv) == "relax.reshape":
                after = only_reader(r, "relax.astype")
                if after is not None and dtype_of(after) == "float16":
                    cast, between = after, (r,)
            if cast is not None:
                break
        if cast is not None:
            kernel = LayerNormKernel(name, tuple(shape), float(attrs.epsilon), tuple(shape_of(cast)))
            found.append(ClaimedLayerNorm(kernel, x, gamma, beta, b.var, cast, between))
    return found


def claim_layer_norms(mod, claimed: Sequence[ClaimedLayerNorm], twins: bool = False):
    """``mod`` with each claimed layer norm one call of its kernel (``twins``: of its host twin) returning both
    outputs: the layer norm's variable is the first, the cast's the second (reshaped to the cast's shape: a view),
    the reshape between them goes."""
    from edgeq.backends.cuda.cutlass import rebuild_main
    from edgeq.tvm_env import relax

    by_output = {c.output: c for c in claimed}
    by_cast = {c.cast: c for c in claimed}
    by_scale = {c.scale: c for c in claimed if c.scale is not None}
    dropped = {var for c in claimed for var in c.between}
    outputs = {}

    def rebind(b, gvars):
        if b.var in dropped:
            return []
        new = []
        c = by_output.get(b.var)
        if c is not None:
            k = c.kernel
            second = [relax.TensorType(list(k.shape), "float16")] if k.quantize is None else [
                relax.TensorType([*k.shape[:-1], 1], "float32"), relax.TensorType(list(k.shape), "int8")]
            out = [relax.TensorType(list(k.shape), "float32"), *second]
            tup = relax.Var(f"{b.var.name}_outputs", relax.TupleType(out))
            new.append(relax.VarBinding(tup, relax.call_tir(gvars[k.function], relax.Tuple([c.x, c.gamma, c.beta]),
                                                            out)))
            outputs[k.name] = tup
            b = relax.VarBinding(b.var, relax.TupleGetItem(tup, 0))
        c = by_scale.get(b.var)
        if c is not None:
            b = relax.VarBinding(b.var, relax.TupleGetItem(outputs[c.kernel.name], 1))
        c = by_cast.get(b.var)
        if c is not None:
            k = c.kernel
            last = relax.TupleGetItem(outputs[k.name], 1 if k.quantize is None else 2)
            value = last if k.second_shape == k.shape else relax.op.reshape(last, list(k.second_shape))
            b = relax.VarBinding(b.var, value)
        return [*new, b]

    functions = {c.kernel.function: (twin_prim_func(c.kernel).with_attrs({"global_symbol": c.kernel.function,
                                                                          "op_pattern": 8})
                                     if twins else prim_func(c.kernel)) for c in claimed}
    return rebuild_main(mod, functions, rebind)


# ------------------------------------------------------------------ a per-token quantize without a layer norm

@dataclasses.dataclass(frozen=True)
class RowQuantizeKernel(_RowKernel):
    """An int8 graph's per-token quantize of a tensor no layer norm makes (a transformer's context, its GELU's
    output, its input): the row's scale ``where(max|x| > 0, max|x| / q, 1)`` ([..., 1]) and ``int8(clamp(round(x /
    scale), lo, hi))``, x float32 or fp16 (read as float32), in one kernel (a block a row, as ``LayerNormKernel``'s
    int8 output) instead of two (``pipeline.row_scales_in_one_kernel``'s and the quantize's: FuseOps fuses nothing
    after a reduction whose output has another reader)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # x's: float32 or float16
    quantize: float  # q
    clamp: tuple[float, float] = (-127.0, 127.0)

    @property
    def function(self) -> str:
        return f"rowquant_{self.name}"


@dataclasses.dataclass(frozen=True)
class ClaimedRowQuantize:
    """A per-token quantize the kernel took: x, the scale's variable (``row_scale``'s call), the int8 variable (the
    quantize's cast), and the bindings between them that go (the division, rounding and clamps; x's float32 cast
    where only the division reads it)."""

    kernel: RowQuantizeKernel
    x: object
    scale: object
    cast: object
    between: tuple = ()


def row_quantize_twin(kernel: RowQuantizeKernel):
    """The kernel's computation as plain TIR: ``pipeline._row_scale``'s, then the quantize as the graph writes it."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    te, tirx = tvm.te, tvm.tirx
    *lead, c = kernel.shape
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = te.placeholder(kernel.shape, kernel.dtype, "x")
    k = te.reduce_axis((0, c), "k")
    amax = te.compute((*lead, 1), lambda *i: te.max(te.abs(x[(*i[:-1], k)].astype("float32")), axis=k), "amax")
    scale = te.compute((*lead, 1), lambda *i: tirx.Select(amax[i] > f32(0.0), amax[i] / f32(kernel.quantize),
                                                          f32(1.0)), "scale")
    lo, hi = kernel.clamp
    q8 = te.compute(kernel.shape, lambda *i: te.min(te.max(tirx.round(x[i].astype("float32") / scale[(*i[:-1], 0)]),
                                                           f32(lo)), f32(hi)).astype("int8"), "q8")
    return te.create_prim_func([x, scale, q8])


def row_quantize_prim_func(kernel: RowQuantizeKernel):
    """``row_quantize_twin`` scheduled for the GPU: a block of ``threads`` per row, max|x| across its threads (warp
    shuffles), then each thread quantizes its elements."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": row_quantize_twin(kernel)}))
    amax = sch.get_sblock("amax")
    *rows, k = sch.get_loops(amax)
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    _, tx = sch.split(k, [None, kernel.threads])
    sch.bind(row, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(amax, 0, "shared")
    sch.reverse_compute_at(sch.get_sblock("scale"), row)
    q8 = sch.get_sblock("q8")
    sch.reverse_compute_at(q8, row)
    _, t = sch.split(sch.get_loops(q8)[-1], [None, kernel.threads])
    sch.bind(t, "threadIdx.x")
    return sch.mod["main"].with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def row_quantize_record(kernel: RowQuantizeKernel) -> dict:
    """What the manifest says of one per-token quantize kernel."""
    return {"function": kernel.function, "template": "edgeq per-token quantize (TIR: a row a block, a warp-shuffle "
            "max, float32 per-token scale and int8 outputs)", "threads": kernel.threads, "grid": list(kernel.grid),
            "shape": list(kernel.shape), "input": kernel.dtype, "q": kernel.quantize, "clamp": list(kernel.clamp)}


def find_row_quantizes(mod) -> list[ClaimedRowQuantize]:
    """The per-token quantizes left in ``mod``'s main after ``claim_layer_norms``: ``s = row_scale(x)``
    (``pipeline.row_scales_in_one_kernel``'s function; x float32, or fp16 with the division reading its float32
    cast) and ``astype(minimum(maximum(round(x / s), lo), hi), int8)``, x's rows over its last axis."""
    from edgeq.backends.cuda.cutlass.match import main_index, quantize_tail
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, _ = main_index(mod["main"])
    found = []
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.call_tir" or len(value.args[1].fields) != 1:
            continue
        func = mod.functions.get(value.args[0])
        q = (func.attrs or {}).get(ROW_SCALE_ATTR) if func is not None else None
        (x,) = value.args[1].fields
        shape = shape_of(x)
        if q is None or shape is None or dtype_of(x) not in ("float32", "float16"):
            continue
        divide = next((r for r in readers.get(b.var, []) if r is not None and call_op(value_of[r]) == "relax.divide"
                       and value_of[r].args[1].same_as(b.var)), None)
        if divide is None:
            continue
        xf, between = value_of[divide].args[0], []
        if not xf.same_as(x):  # an fp16 x: the division reads its float32 cast
            cast_f32 = value_of.get(xf)
            if call_op(cast_f32) != "relax.astype" or not cast_f32.args[0].same_as(x) or dtype_of(xf) != "float32":
                continue
            if len(readers.get(xf, [])) == 1:
                between.append(xf)
        elif dtype_of(x) != "float32":
            continue
        tail = quantize_tail(divide, value_of, readers)
        if tail is None or shape_of(tail[1]) != shape:
            continue
        rest, cast, clamp = tail
        kernel = RowQuantizeKernel(f"q{len(found)}", tuple(shape), dtype_of(x), float(q), clamp)
        found.append(ClaimedRowQuantize(kernel, x, b.var, cast, (*between, divide, *rest)))
    return found


def claim_row_quantizes(mod, claimed: Sequence[ClaimedRowQuantize], twins: bool = False):
    """``mod`` with each claimed quantize one call of its kernel (``twins``: of its host twin) returning the scale
    (bound to the ``row_scale`` call's variable) and the int8 tensor (to the cast's); the bindings between go."""
    from edgeq.backends.cuda.cutlass import rebuild_main
    from edgeq.tvm_env import relax

    by_scale = {c.scale: c for c in claimed}
    by_cast = {c.cast: c for c in claimed}
    dropped = {var for c in claimed for var in c.between}
    outputs = {}

    def rebind(b, gvars):
        if b.var in dropped:
            return []
        c = by_scale.get(b.var)
        if c is not None:
            k = c.kernel
            out = [relax.TensorType([*k.shape[:-1], 1], "float32"), relax.TensorType(list(k.shape), "int8")]
            tup = relax.Var(f"{b.var.name}_outputs", relax.TupleType(out))
            outputs[k.name] = tup
            return [relax.VarBinding(tup, relax.call_tir(gvars[k.function], relax.Tuple([c.x]), out)),
                    relax.VarBinding(b.var, relax.TupleGetItem(tup, 0))]
        c = by_cast.get(b.var)
        if c is not None:
            return [relax.VarBinding(b.var, relax.TupleGetItem(outputs[c.kernel.name], 1))]
        return [b]

    functions = {c.kernel.function: (row_quantize_twin(c.kernel).with_attrs({"global_symbol": c.kernel.function,
                                                                             "op_pattern": 8})
                                     if twins else row_quantize_prim_func(c.kernel)) for c in claimed}
    return rebuild_main(mod, functions, rebind)
