"""Attention's scores and their softmax as one kernel (#42).

A transformer's attention on the fp16 path was three kernels a layer for its middle: the Q K^T batched GEMM
(CUTLASS, float32 scores), the softmax with its fp16 cast (TVM's), then the P V GEMM (CUTLASS). The scores of one
query are one row of the softmax, so a kernel that computes a row's scores can take its softmax right away: here a
block computes ``ROWS`` rows (a warp a row), their scores into shared memory (each lane a column in turn, the
head's dot product in float32 from the fp16 Q and K read in place from the projection), then each row's max and sum
as warp-shuffle reductions, and writes the fp16 probabilities P V reads. The products run on CUDA cores: for
MiniLM's shape (128 tokens, 12 heads of 32) Q K^T is 2.7% of a layer's FLOPs, against a kernel and the float32
scores' round trip through memory (64 KB a head) saved.

The computation is the graph's own: the bindings from the heads' views through the matrix product, its scale and
casts, the softmax and its cast are outlined into a Relax function marked ``Primitive``
(``squeeze_excite.outline``), which LegalizeOps and FuseTIR make one PrimFunc, so the host (the reference check,
the tests) runs what the graph ran. ``schedule`` gives it its GPU schedule (``pipeline.ScheduleKernels``, functions
named ``attn_*``).
"""

from __future__ import annotations

import dataclasses
import math

PREFIX = "attn_"
SCALE = ("relax.astype", "relax.multiply", "relax.divide")  # between the product and the softmax
ROWS = 8  # rows of scores a block (a warp each)
MIN_LANES = 8  # keys a power of two of at least this divides (else the rows' lanes would idle)
WARP = 32


@dataclasses.dataclass(frozen=True)
class AttentionScores:
    """One attention's Q K^T and softmax: its name, the scores' shape [batch, heads, queries, keys], the outlined
    bindings (in order), the function's inputs, its output (the fp16 probabilities)."""

    name: str
    shape: tuple[int, ...]
    bindings: tuple
    inputs: tuple
    output: object
    head_dim: int
    gemm: object = None  # the Q K^T claim (``cutlass.Claimed``) this kernel replaces

    @property
    def function(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def rows(self) -> int:
        """Rows of scores: batch x heads x queries."""
        return math.prod(self.shape[:-1])

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.shape[-1] * self.head_dim

    def record(self) -> dict:
        return {"function": self.function, "template": "edgeq attention scores + softmax (TIR: a warp a query row, "
                "the scores in shared memory, fp32 accumulation on CUDA cores)", "scores": list(self.shape),
                "replaces": self.gemm.kernel.function if self.gemm is not None else None,
                "head_dim": self.head_dim, "threads": ROWS * lanes_for(self.shape[-1]), "grid": [-(-self.rows // ROWS), 1],
                "flops": self.flops}


def find_attention_scores(main, claimed) -> list[AttentionScores]:
    """Among ``claimed`` (``cutlass.find_convs``), the fp16 Q K^T batched GEMMs whose scores (after casts and a
    scale) only a softmax over the last axis reads, and only an fp16 cast reads that: the GEMM's chain, its output,
    the casts and scale, the softmax and the cast, as one ``AttentionScores``."""
    from edgeq.backends.cuda import cutlass
    from edgeq.backends.cuda.cutlass.match import is_constant, main_index, only_reader_of
    from edgeq.backends.cuda.squeeze_excite import outline_inputs
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    bindings, value_of, readers, _ = main_index(main)
    position = {b.var: i for i, b in enumerate(bindings)}

    only_reader = only_reader_of(readers)

    found = []
    for c in claimed:
        if not isinstance(c.kernel, cutlass.GemmKernel):
            continue
        scale, soft = [], only_reader(c.output)  # (int8 graphs: fp16 scores, cast and scaled before the softmax)
        while soft is not None and call_op(value_of[soft]) in SCALE and shape_of(soft) == shape_of(c.output):
            scale.append(soft)
            soft = only_reader(soft)
        shape = shape_of(c.output)
        if soft is None or call_op(value_of[soft]) != "relax.nn.softmax" or shape is None \
                or int(value_of[soft].attrs.axis) % len(shape) != len(shape) - 1:
            continue
        cast = only_reader(soft)
        if cast is None or call_op(value_of[cast]) != "relax.astype" or dtype_of(cast) != "float16":
            continue
        if math.prod(int(d) for d in shape[:-1]) % ROWS or lanes_for(int(shape[-1])) < MIN_LANES:
            continue  # (ViT's 197 tokens: the GEMM and the softmax as they were)
        group = set(c.chain) | {c.output, *scale, soft, cast}
        if any(r is None or r not in group for v in group - {cast} for r in readers.get(v, [])):
            continue
        ordered, inputs = outline_inputs(group, value_of, position)
        if any(not (isinstance(a, relax.Var) or is_constant(a)) for a in inputs):
            continue
        found.append(AttentionScores(f"a{len(found)}", tuple(int(d) for d in shape),
                                     tuple(bindings[position[v]] for v in ordered), tuple(inputs), cast,
                                     c.kernel.problem.k, c))
    return found


def lanes_for(keys: int) -> int:
    """Threads across a row's keys: a warp, or for fewer keys the largest power of two that divides them (no
    predicate: TVM cannot put a reduction's barrier inside one)."""
    lanes = WARP
    while keys % lanes:
        lanes //= 2
    return lanes


def schedule(func):
    """The GPU schedule of an outlined attention's PrimFunc (after FuseTIR): its output (the fp16 probabilities) a
    warp a row, ``ROWS`` rows a block, the lanes across the keys; in each block before it the rows' scores (the
    matrix product, lanes across the keys, the head's dimension serial in a thread) in shared memory, then each
    row's max and its sum of exponentials (lanes across the keys: warp-shuffle reductions), in shared memory; every
    other operator (the heads' views, the scale and casts, the exponential, the division) inlined where it is
    read."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": func}))
    sch.work_on("main")
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    out = blocks[-1]

    def reduction(block) -> bool:
        return any(int(iv.iter_type) == 2 for iv in sch.get(block).iter_vars)

    reductions = [b for b in blocks if reduction(b)]
    if len(reductions) != 3:
        raise ValueError(f"{len(reductions)} reductions: not a matrix product and a softmax")
    product, row_max, row_sum = reductions
    for block in reversed(blocks):
        if block not in reductions and block != out:
            sch.compute_inline(block)
    *rows, keys = sch.get_loops(out)
    lanes = lanes_for(int(sch.get(keys).extent))
    if math.prod(int(sch.get(r).extent) for r in rows) % ROWS:
        raise ValueError(f"rows not a multiple of {ROWS}")
    bx, ty = sch.split(sch.fuse(*rows), [None, ROWS])
    _, tx = sch.split(keys, [None, lanes])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    for red in (row_sum, row_max):  # a row's max and sum: the lanes across the keys
        sch.compute_at(red, bx, preserve_unit_loops=True)
        sch.set_scope(red, 0, "shared")
        loops = sch.get_loops(red)[1:]
        spatial = len(loops) - 1
        _, ry = sch.split(sch.fuse(*loops[:spatial]), [None, ROWS])
        _, rx = sch.split(loops[spatial], [None, lanes])
        sch.bind(ry, "threadIdx.y")
        sch.bind(rx, "threadIdx.x")
    sch.compute_at(product, bx, preserve_unit_loops=True)
    sch.set_scope(product, 0, "shared")
    loops = sch.get_loops(product)[1:]
    *spatial, key, dim = loops
    _, py = sch.split(sch.fuse(*spatial), [None, ROWS])
    _, px = sch.split(key, [None, lanes])
    sch.bind(py, "threadIdx.y")
    sch.bind(px, "threadIdx.x")
    return sch.mod["main"].with_attrs({"tirx.is_scheduled": True})
