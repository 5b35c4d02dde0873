"""A global average pool and the classifier after it as one kernel (#42).

A classification network ends in ``mean over H, W`` of its last feature map, then (int8) the quantize of the pooled
features or (fp16) their cast, then the classifier, a matrix product of one row per image. On the CUDA path those
were two kernels: the pool (TVM's reduction rule) and the classifier (a CUTLASS 1x1 convolution of M = batch rows,
which fills a tenth of one tensor-core tile). Here one kernel does both, as TensorRT fuses a pool into the GEMV
after it: each block pools the whole feature map into its shared memory (every channel's sum in the graph's order,
one thread a channel; the division, and the quantize or the cast, as the graph writes them), then its warps take
the classifier's rows, a warp a row (the dot product across the lanes, a warp-shuffle reduction), with the
classifier's own epilogue (int8: the bias, the per-channel scale and shift, ``cutlass.twin_tensors``).

The blocks are at most the profile's SMs: each re-reads the feature map (from L2: the last convolution just wrote
it; ResNet-50's 7x7x2048 fp16 map is 200 KB), so fewer blocks mean less of that and more rows per warp.

``find_pool_classifiers`` finds them among ``cutlass.find_convs``' claims, ``claim_pool_classifiers`` puts the
kernels' calls in their place, ``twin_prim_func`` is the computation before its schedule (the host runs it:
``with_twins``), ``prim_func`` the scheduled one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

WARPS = 8
WARP = 32
VECTOR = 4


@dataclasses.dataclass(frozen=True)
class PoolClassifierKernel:
    """``fc(q(mean(x, H and W)))``: x [N, H, W, C] (float32 or float16, summed in float32), q the graph's quantize
    of the mean (``quantize``: (divisor, lo, hi), to int8) or its fp16 cast, ``fc`` the classifier's CUTLASS kernel
    (a 1x1 convolution on [N, 1, 1, C]) whose arithmetic (and epilogue) this kernel computes."""

    name: str
    shape: tuple[int, int, int, int]
    dtype: str
    fc: object  # cutlass.ConvKernel
    fc_shapes: dict
    quantize: tuple[float, float, float] | None
    blocks: int

    @property
    def function(self) -> str:
        return f"poolfc_{self.name}"

    @property
    def threads(self) -> int:
        return WARPS * WARP

    @property
    def rows(self) -> int:
        """The classifier's outputs, N x K: a warp each."""
        return self.shape[0] * self.fc.problem.k

    @property
    def flops(self) -> int:
        """The classifier's (a multiply-add counted as 2), as the other kernels' records count a layer's."""
        return self.fc.problem.flops

    @property
    def pool_adds(self) -> int:
        n, h, w, c = self.shape
        return n * h * w * c


@dataclasses.dataclass(frozen=True)
class ClaimedPoolClassifier:
    """A pool and classifier the kernel took: the pool's input, the classifier's claim (``cutlass.Claimed``) and
    the bindings from the pool to the classifier's input, which go."""

    kernel: PoolClassifierKernel
    x: object
    fc: object  # cutlass.Claimed
    between: tuple


def blocks_for(rows: int, sm_count: int) -> int:
    """At most one block an SM, and no block without a row for each of its warps."""
    return max(1, min(sm_count, -(-rows // WARPS)))


def twin_prim_func(kernel: PoolClassifierKernel):
    """The kernel's computation as plain TIR (TE): the sum over H and W in float32 (h, then w, as TVM's
    legalization of ``R.mean`` and ``pipeline._mean_of_fp16`` sum), divided by H x W, quantized (``round(v / d)``
    clamped to [lo, hi], int8) or cast to fp16, then the classifier's twin (``cutlass.twin_tensors``)."""
    from edgeq.backends.cuda import cutlass
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    te, tirx = tvm.te, tvm.tirx
    n, h, w, c = kernel.shape
    x = te.placeholder(kernel.shape, kernel.dtype, "x")
    rh, rw = te.reduce_axis((0, h), "rh"), te.reduce_axis((0, w), "rw")
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    total = te.compute((n, 1, 1, c), lambda i, _y, _z, k: te.sum(x[i, rh, rw, k].astype("float32"), axis=[rh, rw]),
                       "pool_sum")
    if kernel.quantize is None:
        pooled = te.compute((n, 1, 1, c), lambda *i: (total[i] / f32(float(h * w))).astype("float16"), "pooled")
    else:
        d, lo, hi = kernel.quantize
        pooled = te.compute((n, 1, 1, c), lambda *i: te.min(te.max(tirx.round(total[i] / f32(float(h * w)) / f32(d)),
                                                                   f32(lo)), f32(hi)).astype("int8"), "pooled")
    shapes = {name: shape for name, shape in kernel.fc_shapes.items() if name != "y"}
    args, y = cutlass.twin_tensors(kernel.fc, shapes, x=pooled)
    y_shape = tuple(kernel.fc_shapes.get("y", y.shape))
    if tuple(int(d) for d in y.shape) != y_shape:  # the logits as the graph has them, [1, K] (batch 1: the last axis)
        y4 = y
        y = te.compute(y_shape, lambda *i: y4[0, 0, 0, i[-1]], "y_view")
    return te.create_prim_func([x, *args, y])


def prim_func(kernel: PoolClassifierKernel):
    """``twin_prim_func`` scheduled for the GPU: ``blocks`` blocks of 8 warps; in each, the pooled features in shared
    memory (a thread a channel, its sum in a register), then a warp a classifier row, its lanes across the channels
    (runs of ``VECTOR`` channels a lane where C is a multiple of 128: the weights as one vector load), a warp-shuffle
    reduction, the epilogue by the warp."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": twin_prim_func(kernel)}))
    if _has(sch, "xp"):  # the classifier's zero padding (none for a 1x1): read in place
        sch.compute_inline(sch.get_sblock("xp"))
    acc = sch.get_sblock("acc")
    *spatial, ry, rx, rc = sch.get_loops(acc)
    row = sch.fuse(*spatial)
    per_warp = -(-kernel.rows // (kernel.blocks * WARPS))
    bx, serial, ty = sch.split(row, [kernel.blocks, per_warp, WARPS])
    # a lane's channels in runs of VECTOR (one 4-byte load of int8 weights, 8 bytes of fp16) where C allows
    vector = VECTOR if kernel.shape[3] % (WARP * VECTOR) == 0 else 1
    ro, tx, _ = sch.split(rc, [None, WARP, vector])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if vector > 1:  # the weights through a register, one vector load a run
        weights = sch.cache_read(acc, _read_index(sch, acc, "w"), "local")
        sch.compute_at(weights, tx)
        sch.vectorize(sch.get_loops(weights)[-1])
    out = "y"
    if _has(sch, "y_view"):  # the logits in the graph's shape [N, K]: the epilogue computed where it is written
        sch.compute_inline(sch.get_sblock("y"))
        out = "y_view"
    sch.reverse_compute_at(sch.get_sblock(out), ty)
    pooled = sch.get_sblock("pooled")
    sch.compute_at(pooled, bx)
    sch.set_scope(pooled, 0, "shared")
    loops = sch.get_loops(pooled)[1:]
    _, py, px = sch.split(sch.fuse(*loops), [None, WARPS, WARP])
    sch.bind(py, "threadIdx.y")
    sch.bind(px, "threadIdx.x")
    total = sch.get_sblock("pool_sum")
    sch.compute_at(total, px)
    sch.set_scope(total, 0, "local")
    sch.set_scope(acc, 0, "local")
    return sch.mod["main"].with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def _read_index(sch, block, name: str) -> int:
    """The position of buffer ``name`` among the block's reads."""
    reads = sch.get(block).reads
    return next(i for i, r in enumerate(reads) if getattr(getattr(r, "buffer", None) or r.source, "name", None) == name)


def _has(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - TVM's ScheduleError: no such block
        return False
    return True


def kernel_record(kernel: PoolClassifierKernel) -> dict:
    """What the manifest says of one pool-and-classifier kernel."""
    p = kernel.fc.problem
    return {"function": kernel.function, "template": "edgeq pool + classifier (TIR: the pooled features in shared "
            "memory, a warp a row, warp-shuffle reductions)", "threads": kernel.threads, "grid": [kernel.blocks, 1],
            "pooled": list(kernel.shape), "input": kernel.dtype, "classes": p.k, "precision": kernel.fc.precision,
            "quantize": list(kernel.quantize) if kernel.quantize else None, "flops": kernel.flops,
            "pool_adds": kernel.pool_adds,
            "replaces": kernel.fc.function}


def find_pool_classifiers(main, claimed: Sequence, sm_count: int) -> list[ClaimedPoolClassifier]:
    """Among ``claimed`` (``cutlass.find_convs``), the batch-1 classifiers (1x1 convolutions on [1, 1, 1, C])
    whose input is a global average pool of an NHWC tensor and nothing else: int8, ``astype(minimum(maximum(round(
    mean(x, [1, 2], keepdims) / d), lo), hi), int8)``; fp16, ``astype(mean_fp16(x), float16)`` (``pipeline.
    pools_read_fp16``'s function)."""
    from edgeq.backends.cuda import cutlass
    from edgeq.backends.cuda.cutlass.match import const_scalar, main_index, only_reader_of, same
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, params = main_index(main)

    only_reader = only_reader_of(readers)

    def pool_of(var):  # (x, [bindings from the pool to var]) or None
        value = value_of.get(var)
        if call_op(value) == "relax.astype" and dtype_of(var) == "float16":  # fp16: the cast of mean_fp16's
            mean = value.args[0]
            call = value_of.get(mean)
            x = pooled_input(call) if call_op(call) == "relax.call_tir" else None
            if x is None or not same(only_reader(mean), var):
                return None
            shape, out = shape_of(x), shape_of(mean)
            if shape is None or len(shape) != 4 or dtype_of(x) != "float16" or out != [shape[0], 1, 1, shape[3]]:
                return None
            return x, (mean, var), None
        chain = []
        if call_op(value) != "relax.astype" or dtype_of(var) != "int8":
            return None
        bounds = [-128.0, 127.0]
        nxt = value.args[0]
        while call_op(value_of.get(nxt)) in ("relax.minimum", "relax.maximum"):
            c = const_scalar(value_of[nxt].args[1])
            if c is None or not same(only_reader(nxt), chain[-1] if chain else var):
                return None
            i = 1 if call_op(value_of[nxt]) == "relax.minimum" else 0
            bounds[i] = min(bounds[i], c) if i else max(bounds[i], c)
            chain.append(nxt)
            nxt = value_of[nxt].args[0]
        if call_op(value_of.get(nxt)) != "relax.round" or not same(only_reader(nxt), chain[-1] if chain else var):
            return None
        chain.append(nxt)
        div = value_of[nxt].args[0]
        d = const_scalar(value_of[div].args[1]) if call_op(value_of.get(div)) == "relax.divide" else None
        if d is None or d == 0 or not same(only_reader(div), nxt):
            return None
        chain.append(div)
        mean = value_of[div].args[0]
        mv = value_of.get(mean)
        if call_op(mv) != "relax.mean" or not same(only_reader(mean), div) or not bool(mv.attrs.keepdims):
            return None
        x = mv.args[0]
        shape = shape_of(x)
        axes = sorted(int(a) % 4 for a in mv.attrs.axis) if mv.attrs.axis is not None and shape else None
        if shape is None or len(shape) != 4 or axes != [1, 2] or dtype_of(x) != "float32":
            return None
        chain.append(mean)
        return x, tuple(chain) + (var,), (float(d), *bounds)

    found = []
    for c in claimed:
        k = c.kernel
        if type(k) is not cutlass.ConvKernel or k.x_view or k.residual:
            continue
        p = k.problem
        if (p.n, p.h, p.w, p.r, p.s) != (1, 1, 1, 1, 1) or p.c != p.c_real and p.c_real:  # batch 1 (a batch
            # of images is a GEMM: the tensor cores)
            continue
        pool = pool_of(c.x)
        if pool is None or not same(only_reader(c.x), c.chain[0] if c.chain else c.output):
            continue
        x, between, quantize = pool
        shape = tuple(int(v) for v in shape_of(x))
        y_shape = c.shapes.get("y", (1, 1, 1, p.k))
        if shape[0] != p.n or shape[3] != p.c or (quantize is None) != (k.precision != "int8") \
                or y_shape[-1] != p.k or math.prod(y_shape) != p.k:
            continue
        rows = p.n * p.k
        fc = k if k.tile.split_k == 1 else dataclasses.replace(k, tile=dataclasses.replace(k.tile, split_k=1))
        # (on CUDA cores: whole sums, no slices)
        kernel = PoolClassifierKernel(f"p{len(found)}", shape, dtype_of(x), fc, dict(c.shapes), quantize,
                                      blocks_for(rows, sm_count))
        found.append(ClaimedPoolClassifier(kernel, x, c, between))
    return found


def pooled_input(value):
    """x where ``value`` is a global pool of x: ``R.mean`` or ``pipeline.pools_read_fp16``'s function (a call_tir of
    ``mean_fp16*``); else None."""
    from edgeq.graph import call_op

    op = call_op(value)
    if op == "relax.mean":
        return value.args[0]
    if op == "relax.call_tir" and value.args[0].name_hint.startswith("mean_fp16"):
        return value.args[1].fields[0]
    return None


def claim_pool_classifiers(mod, claimed: Sequence[ClaimedPoolClassifier], twins: bool = False):
    """``mod`` (its classifiers not claimed by ``cutlass.claim_convs``) with each pool and classifier one call of its
    kernel (``twins``: of its host twin) in the classifier's output's binding; the bindings from the pool to it go."""
    from edgeq.backends.cuda.cutlass import claim_calls

    functions = {c.kernel.function: (twin_prim_func(c.kernel).with_attrs({"global_symbol": c.kernel.function,
                                                                          "op_pattern": 8})
                                     if twins else prim_func(c.kernel)) for c in claimed}
    return claim_calls(mod, functions, {c.fc.output: (c.kernel.function, [c.x, *c.fc.operands()[1:]]) for c in claimed},
                       {var for c in claimed for var in (*c.between, *c.fc.chain)})
