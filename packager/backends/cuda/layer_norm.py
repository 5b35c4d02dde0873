"""A transformer's layer norm with both of the outputs an fp16 graph reads, in one kernel (#42).

On the fp16 CUDA path ToMixedPrecision keeps a layer norm in float32: its output is the residual stream (float32,
which the next output projection or FFN adds in its CUTLASS epilogue) and, cast to fp16, the input of the next
linear layers. TVM runs that as two kernels, the layer norm and the cast: FuseOps does not fuse an element-wise
operator after a reduction whose output has another reader, and dlight's reduction rule schedules one output. Here
the two are one kernel (TensorRT's LayerNorm plugins write what the next layer reads the same way): a warp
normalizes one row (the sum and the sum of squared deviations as warp shuffles, TVM's cross-thread reduction),
and each thread writes its elements in float32 and in fp16. The arithmetic is TVM's own legalization of
``R.nn.layer_norm`` (mean, then the variance of the deviations, ``rsqrt(var / C + eps)``), so the float32 output
is the graph's; the fp16 one is its cast.

``find_layer_norms`` finds them, ``claim_layer_norms`` puts the kernels' calls in their place, ``twin_prim_func``
is the function before its schedule (the host runs it: ``with_twins``), ``prim_func`` the scheduled one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

WARP = 32
MAX_WARPS = 8  # threads a row: a warp per 256 elements, up to 8 warps


@dataclasses.dataclass(frozen=True)
class LayerNormKernel:
    """``y = (x - mean) * rsqrt(var + eps) * gamma + beta`` over the last axis of x (float32), written as float32 and
    as fp16 (``y16``, in the shape the graph's cast has: a view of the same elements)."""

    name: str
    shape: tuple[int, ...]  # x's and y's
    epsilon: float
    y16_shape: tuple[int, ...]

    @property
    def function(self) -> str:
        return f"layernorm_{self.name}"

    @property
    def rows(self) -> int:
        out = 1
        for d in self.shape[:-1]:
            out *= d
        return out

    @property
    def threads(self) -> int:
        return WARP * max(1, min(MAX_WARPS, self.shape[-1] // 256))

    @property
    def grid(self) -> tuple[int, int]:
        return self.rows, 1


@dataclasses.dataclass(frozen=True)
class ClaimedLayerNorm:
    """A layer norm the kernel took: the Relax variables of its operands, its float32 output (the layer norm's own
    variable), the graph's fp16 cast of it, and the reshape between them (or None)."""

    kernel: LayerNormKernel
    x: object
    gamma: object
    beta: object
    output: object
    cast: object
    between: object | None


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
    y = te.compute(kernel.shape, lambda *i: (x[i] - mean[i[:-1]]) * tirx.rsqrt(
        var[i[:-1]] / width + tirx.const(kernel.epsilon, "float32")) * gamma[i[-1]] + beta[i[-1]], "y")
    y16 = te.compute(kernel.shape, lambda *i: y[i].astype("float16"), "y16")
    return te.create_prim_func([x, gamma, beta, y, y16])


def prim_func(kernel: LayerNormKernel):
    """``twin_prim_func`` scheduled for the GPU: a block of ``threads`` per row, the two reductions across its
    threads (warp shuffles), each thread writing its elements of both outputs."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": twin_prim_func(kernel)}))
    y, y16 = sch.get_sblock("y"), sch.get_sblock("y16")
    loops = sch.get_loops(y)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    _, tx = sch.split(loops[-1], [None, kernel.threads])
    sch.bind(row, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.reverse_compute_at(y16, tx)
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
    return {"function": kernel.function, "template": "edgeq layer norm (TIR: a row a block, warp-shuffle "
            "reductions, float32 and fp16 outputs)", "threads": kernel.threads, "grid": list(kernel.grid),
            "shape": list(kernel.shape), "epsilon": kernel.epsilon, "outputs": ["float32", "float16"]}


def find_layer_norms(main) -> list[ClaimedLayerNorm]:
    """The float32 ``layer_norm`` calls of ``main`` over the last axis (with scale and shift weights) whose output
    is also read as fp16: ``astype(y, float16)``, maybe through a reshape."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings = [b for block in main.body.blocks for b in block.bindings]
    value_of = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for v in set(_free_vars(b.value)):
            readers.setdefault(v, []).append(b.var)
    params = set(main.params[int(main.attrs["num_input"]):])
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
        cast = between = None
        for r in readers.get(b.var, []):
            rv = value_of[r]
            if call_op(rv) == "relax.astype" and dtype_of(r) == "float16":
                cast = r
            elif call_op(rv) == "relax.reshape" and len(readers.get(r, [])) == 1:
                after = readers[r][0]
                if call_op(value_of[after]) == "relax.astype" and dtype_of(after) == "float16":
                    cast, between = after, r
            if cast is not None:
                break
        if cast is None:
            continue
        kernel = LayerNormKernel(f"n{len(found)}", tuple(shape), float(attrs.epsilon), tuple(shape_of(cast)))
        found.append(ClaimedLayerNorm(kernel, x, gamma, beta, b.var, cast, between))
    return found


def _free_vars(expr):
    from edgeq.tvm_env import relax

    return relax.analysis.free_vars(expr)


def claim_layer_norms(mod, claimed: Sequence[ClaimedLayerNorm], twins: bool = False):
    """``mod`` with each claimed layer norm one call of its kernel (``twins``: of its host twin) returning both
    outputs: the layer norm's variable is the first, the cast's the second (reshaped to the cast's shape: a view),
    the reshape between them goes."""
    from edgeq.tvm_env import relax, tvm

    main = mod["main"]
    bb = relax.BlockBuilder(mod)
    gvars = {}
    for c in claimed:
        func = (twin_prim_func(c.kernel).with_attrs({"global_symbol": c.kernel.function, "op_pattern": 8})
                if twins else prim_func(c.kernel))
        gvars[c.kernel.name] = bb.add_func(func, c.kernel.function)
    functions = dict(bb.get().functions)
    by_output = {c.output: c for c in claimed}
    by_cast = {c.cast: c for c in claimed}
    dropped = {c.between for c in claimed if c.between is not None}
    pairs = {}
    blocks = []
    for block in main.body.blocks:
        new = []
        for b in block.bindings:
            if b.var in dropped:
                continue
            c = by_output.get(b.var)
            if c is not None:
                k = c.kernel
                out = [relax.TensorType(list(k.shape), "float32"), relax.TensorType(list(k.shape), "float16")]
                pair = relax.Var(f"{b.var.name}_pair", relax.TupleType(out))
                call = relax.call_tir(gvars[k.name], relax.Tuple([c.x, c.gamma, c.beta]), out)
                new.append(relax.VarBinding(pair, call))
                pairs[c.kernel.name] = pair
                b = relax.VarBinding(b.var, relax.TupleGetItem(pair, 0))
            c = by_cast.get(b.var)
            if c is not None:
                half = relax.TupleGetItem(pairs[c.kernel.name], 1)
                value = half if c.kernel.y16_shape == c.kernel.shape else relax.op.reshape(half, list(c.kernel.y16_shape))
                b = relax.VarBinding(b.var, value)
            new.append(b)
        blocks.append(type(block)(new))
    body = relax.SeqExpr(blocks, main.body.body)
    out = tvm.IRModule(functions)
    out["main"] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    return out
