"""Winograd F(m x m, 3 x 3) for float32 3x3 stride-1 convolutions on CPUs.

The output is computed in m x m tiles: each (m+2) x (m+2) input tile is transformed (``B^T d B``), the
transformed input and weights are multiplied channel-wise as (m+2)^2 independent GEMMs (tiles x C times
C x OC), and each result is transformed back (``A^T M A``). For m = 4 that is 36 multiplies per 16 outputs
instead of 144: a quarter of the direct convolution's. The weights are transformed and packed at build
time (``[(m+2)^2, OC/ocb, C, ocb]``); the GEMM uses the same register tiling as the direct kernel.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.backends.cpu.common import PAD, TILE, ConvSpec, Isa, Kernel, epilogue, largest_divisor
from edgeq.tvm_env import Schedule, te, tvm


WINO = "edgeq_wino"
WINO_V = "edgeq_wino_v"
WINO_T = "edgeq_wino_t"
WINO_GEMM = "edgeq_wino_gemm"


def plan(problem: ConvSpec, isa: Isa) -> ConvSpec | None:
    """float32 3x3 stride-1 convolutions big enough to pay for the transforms, with output sizes that
    split into tiles: F(4x4, 3x3) where they allow, else F(2x2, 3x3)."""
    m = _tile(problem)
    return dataclasses.replace(problem, ocb=isa.vector_block(problem.oc), wino=m) if m else None


def _tile(spec: ConvSpec) -> int:
    if spec.integer or spec.depthwise or spec.groups != 1 or (spec.kh, spec.kw) != (3, 3) or spec.stride != (1, 1) or spec.dilation != (1, 1):
        return 0
    # measured: below these, the transforms cost more than the multiplies they save. 32 channels pay from
    # 28x28 on (DenseNet's 3x3 128 -> 32: 1.40 -> 0.80 ms at 56x56, 0.66 -> 0.34 at 28x28, 0.155 -> 0.164 at
    # 14x14; 32 -> 64 at 28x28: 0.28 -> 0.22)
    if min(spec.c, spec.oc) < 32 or min(spec.oh, spec.ow) < 8:
        return 0
    if min(spec.c, spec.oc) < 64 and spec.oh * spec.ow < 28 * 28:
        return 0
    if spec.oh % 4 == 0 and spec.ow % 4 == 0:
        return 4
    if spec.oh % 2 == 0 and spec.ow % 2 == 0:
        return 2
    return 0


def matrices(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, G) of F(m, 3): Cook-Toom with TVM's interpolation points."""
    from tvm.topi.nn.winograd_util import _cook_toom_convolution, _interpolation_points

    a, b, g = _cook_toom_convolution(_interpolation_points(m + 1), m, 3)
    return a.astype(np.float64), b.astype(np.float64), g.astype(np.float64)


def winograd_func(spec: ConvSpec):
    """(PrimFunc, weight packer) of the Winograd kernel for a planned ``spec`` (``spec.wino`` = m)."""
    from tvm.topi.utils import const_matrix

    m, ocb = spec.wino, spec.ocb
    alpha = m + 2
    a_np, b_np, g_np = matrices(m)
    a_c, b_c = const_matrix(a_np.astype(np.float32), "A"), const_matrix(b_np.astype(np.float32), "B")
    n, h, w, c, oc = spec.n, spec.h, spec.w, spec.c, spec.oc
    nh, nw = spec.oh // m, spec.ow // m
    tiles = n * nh * nw
    pt, pl, _, _ = spec.padding
    hp, wp = nh * m + 2, nw * m + 2
    x = te.placeholder((n, h, w, c), "float32", name="data")
    xp = te.compute(
        (n, hp, wp, c),
        lambda i, y, z, k: te.if_then_else(tvm.tirx.all(y >= pt, y < h + pt, z >= pl, z < w + pl),
                                           x[i, y - pt, z - pl, k], tvm.tirx.const(0.0, "float32")),
        name=PAD,
    )
    # B^T d B as two passes over the tile (rows, then columns): 2 (m+2)^3 terms instead of (m+2)^4
    ra, rb = te.reduce_axis((0, alpha), "ra"), te.reduce_axis((0, alpha), "rb")
    t = te.compute(
        (alpha, alpha, tiles, c),
        lambda e, j, p, k: te.sum(xp[p // (nh * nw), (p // nw) % nh * m + ra, p % nw * m + j, k] * b_c[ra, e], axis=[ra]),
        name=WINO_T,
    )
    v = te.compute((alpha, alpha, tiles, c), lambda e, u, p, k: te.sum(t[e, rb, p, k] * b_c[rb, u], axis=[rb]), name=WINO_V)
    wt = te.placeholder((alpha, alpha, oc // ocb, c, ocb), "float32", name="weight")
    rc = te.reduce_axis((0, c), "rc")
    gemm = te.compute(
        (alpha, alpha, tiles, oc),
        lambda e, u, p, o: te.sum(v[e, u, p, rc] * wt[e, u, o // ocb, rc, o % ocb], axis=[rc]),
        name=WINO_GEMM,
    )
    sa, sb = te.reduce_axis((0, alpha), "sa"), te.reduce_axis((0, alpha), "sb")
    out = te.compute(
        (n, spec.oh, spec.ow, oc),
        lambda i, y, z, o: te.sum(
            gemm[sa, sb, i * nh * nw + y // m * nw + z // m, o] * (a_c[sa, y % m] * a_c[sb, z % m]), axis=[sa, sb]),
        name=WINO, attrs={spec.annotation: spec.to_json()},
    )

    def pack(weight: np.ndarray) -> list[np.ndarray]:
        # U[e, u, o, c] = (G g G^T)[e, u] for every output/input channel pair
        u = np.einsum("ea,ocab,ub->euoc", g_np, weight.astype(np.float64), g_np).astype(np.float32)
        packed = u.reshape(alpha, alpha, oc // ocb, ocb, c).transpose(0, 1, 2, 4, 3)
        return [np.ascontiguousarray(packed)]

    return te.create_prim_func([x, wt, out], index_dtype_override="int64"), pack


def schedule_winograd(sch: Schedule, spec: ConvSpec, isa: Isa) -> None:
    m, ocb = spec.wino, spec.ocb
    lanes = isa.lanes
    # input padding: a parallel copy
    pad = sch.get_sblock(PAD)
    pl = sch.get_loops(pad)
    sch.parallel(sch.fuse(*pl[:2]))
    # input transform: per tile and channel vector, all (m+2)^4 terms unrolled with constant coefficients
    vb, tb = sch.get_sblock(WINO_V), sch.get_sblock(WINO_T)
    e, u, p, k, rb = sch.get_loops(vb)
    kb = lanes if spec.c % lanes == 0 else 1
    ko, ki = sch.split(k, [None, kb])
    sch.reorder(p, ko, e, u, rb, ki)
    sch.compute_at(tb, ko)
    sch.set_scope(tb, 0, TILE)
    te_, tj, tk, tra = sch.get_loops(tb)[-4:]
    sch.reorder(te_, tj, tra, tk)
    for lp in (e, u, rb, te_, tj, tra):
        sch.unroll(lp)
    if kb > 1:
        sch.vectorize(ki)
        sch.vectorize(tk)
    sch.parallel(sch.fuse(p, ko))
    sch.decompose_reduction(tb, tra)
    sch.decompose_reduction(vb, rb)
    # batched GEMM: register tiles of tiles x output channels, one (e, u, channel block) per task
    gb = sch.get_sblock(WINO_GEMM)
    gw = sch.cache_write(gb, 0, TILE)
    e, u, p, o, rc = sch.get_loops(gb)
    tiles = spec.n * (spec.oh // m) * (spec.ow // m)
    vectors = max(1, -(-ocb // lanes))
    pb = largest_divisor(tiles, max(1, isa.accumulators // vectors))
    po, pi = sch.split(p, [None, pb])
    oo, oi = sch.split(o, [None, ocb])
    sch.reorder(e, u, oo, po, rc, pi, oi)
    sch.reverse_compute_at(gw, po)
    sch.vectorize(oi)
    sch.unroll(pi)
    sch.parallel(sch.fuse(e, u, oo))
    sch.decompose_reduction(gb, rc)
    sch.vectorize(sch.get_loops(gw)[-1])
    # output transform + the fused epilogue, per m x m tile and channel vector
    main = sch.get_sblock(WINO)
    wb = epilogue(sch, main)
    n, y, z, o, sa, sb = sch.get_loops(main)
    yo, yi = sch.split(y, [None, m])
    zo, zi = sch.split(z, [None, m])
    ob = lanes if spec.oc % lanes == 0 else ocb
    oo, oi = sch.split(o, [None, ob])
    sch.reorder(n, yo, zo, oo, sa, sb, yi, zi, oi)
    sch.reverse_compute_at(wb, oo)
    sch.vectorize(oi)
    for lp in (sa, sb, yi, zi):
        sch.unroll(lp)
    sch.parallel(sch.fuse(n, yo))
    sch.decompose_reduction(main, sa)
    sch.vectorize(sch.get_loops(wb)[-1])


KERNEL = Kernel(name="winograd", spec=ConvSpec, plan=plan, build=winograd_func, symbol="edgeq_conv2d", block=WINO,
                schedule=schedule_winograd, tag=lambda spec: f"wino{spec.wino}_oc{spec.ocb}")
