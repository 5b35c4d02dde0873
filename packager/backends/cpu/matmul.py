"""Batched matrix products of two activations (attention: ``Q @ K^T``, ``softmax @ V``) on CPUs.

Products by a weight go through the convolution kernels (a 1x1 convolution with packed weights); here
both operands are computed at run time, so nothing can be packed ahead: the right operand is read in
rows of ``N`` (contiguous), the schedule keeps ``rows x vectors`` accumulators in registers, broadcasts
one element of the left operand per row and reduction step, and spreads the tiles over the cores.
"""

from __future__ import annotations

from edgeq.backends.cpu.common import BmmSpec, Isa, Kernel, epilogue, largest_divisor
from edgeq.tvm_env import Schedule, te, tvm


BMM = "edgeq_bmm"


def plan(problem: BmmSpec, isa: Isa) -> BmmSpec:
    """Every product of two activations (lowering offers float32 ones only)."""
    return problem


def bmm_func(spec: BmmSpec):
    """(PrimFunc ``out[b, m, n] = sum_k a[b, m, k] * b[b, k, n]`` in float32, None: no weight to pack)."""
    a = te.placeholder((spec.batch, spec.m, spec.k), "float32", name="a")
    b = te.placeholder((spec.batch, spec.k, spec.n), "float32", name="b")
    k = te.reduce_axis((0, spec.k), "k")
    out = te.compute((spec.batch, spec.m, spec.n), lambda i, r, c: te.sum(a[i, r, k] * b[i, k, c], axis=[k]),
                     name=BMM, attrs={spec.annotation: spec.to_json()})
    return te.create_prim_func([a, b, out], index_dtype_override="int64"), None


def schedule_bmm(sch: Schedule, spec: BmmSpec, isa: Isa) -> None:
    main = sch.get_sblock(BMM)
    wb = epilogue(sch, main)
    b, m, n, k = sch.get_loops(main)
    nb = isa.vector_block(spec.n)
    vectors = max(1, -(-nb // isa.lanes))
    mb = largest_divisor(spec.m, max(1, isa.accumulators // vectors))
    mo, mi = sch.split(m, [None, mb])
    no, ni = sch.split(n, [None, nb])
    sch.reorder(b, mo, no, k, mi, ni)
    sch.reverse_compute_at(wb, no)
    sch.vectorize(ni)
    sch.unroll(mi)
    sch.parallel(sch.fuse(b, mo, no))
    sch.decompose_reduction(main, k)
    sch.vectorize(sch.get_loops(wb)[-1])


KERNEL = Kernel(name="bmm", spec=BmmSpec, plan=plan, build=bmm_func, symbol="edgeq_bmm", block=BMM,
                schedule=schedule_bmm)


def masked_softmax_func(batch: int, rows: int, cols: int, valid: int):
    """PrimFunc ``softmax`` along the last axis of ``x[batch, rows, cols]`` over its first ``valid`` columns,
    zeros in the others: the softmax of attention scores left in ``Q @ K^T``'s padded tile shape (ViT's 197
    tokens computed as 200 x 208), whose result goes on, padded, into ``softmax @ V`` (its padded
    columns multiply zero rows of ``V``). Rows whole vectors wide are reduced in vectors (the rows schedule),
    and neither the product's result nor the softmax's is sliced or padded on the way."""
    from tvm import topi

    x = te.placeholder((batch, rows, cols), "float32", name="x")
    k = te.reduce_axis((0, cols), "k")
    low = tvm.tirx.const(-3.4e38, "float32")
    zero = tvm.tirx.const(0.0, "float32")
    top = te.compute((batch, rows), lambda b, r: te.max(tvm.tirx.Select(k < valid, x[b, r, k], low), axis=[k]), name="top")
    shifted = te.compute(x.shape, lambda b, r, c: x[b, r, c] - top[b, r], name="shifted")
    exp = topi.fast_exp(shifted)
    e = te.compute(x.shape, lambda b, r, c: tvm.tirx.Select(c < valid, exp[b, r, c], zero), name="e")
    k2 = te.reduce_axis((0, cols), "k2")
    total = te.compute((batch, rows), lambda b, r: te.sum(e[b, r, k2], axis=[k2]), name="total")
    inv = te.compute((batch, rows), lambda b, r: tvm.tirx.const(1.0, "float32") / total[b, r], name="inv")
    out = te.compute(x.shape, lambda b, r, c: e[b, r, c] * inv[b, r], name="softmax")
    return te.create_prim_func([x, out], index_dtype_override="int64")
