"""A decoder's attention read from the cache as it lies.

An exported decoder (Hugging Face's, through ``torch.onnx``) computes grouped-query attention as

    keys = concat(past, new)                                 [1, kv_heads, T, D]
    keys = reshape(broadcast_to(expand_dims(keys, 2)))       [1, heads, T, D]    (each kv head repeated G times)
    scores = matmul(q * c, permute_dims(keys, [0, 1, 3, 2]) * c)                 [1, heads, S, T]
    ...softmax...
    out = matmul(p, reshape(broadcast_to(expand_dims(concat(past_v, new_v), 2))))

TVM fuses the concatenation, the repeat, the transpose and the scaling into one function that writes the whole
cache out again, G times over and transposed, for every layer and token, before the product reads it:
SmolLM2-135M's decode spent 27% of its time there (``perf``, edgeq-run, 2-core x86). ``attention_pass``
rewrites both products to functions of this module that read ``past`` and ``new`` where they are, each kv
head's rows of the cache once for its G query heads, with the scale applied as the product reads a key
(``keys * c`` as exported: the same products). Shapes other than these are left to TVM as they were.

A prefill's rows attend under the exported causal mask (``where(C & padding, 0, min)`` added to the scores, ``C``
a constant): where ``C`` hides every key after a row's own, the scores of those keys cannot move the softmax
(``min`` plus any real score is ``min``, whose weight is 0; under the CPU pipeline's ``fast_exp``, which
clamps its argument at -88.4, under 4e-39 of the row's sum), so ``causal_scores_func`` computes each row's
products with its own and the earlier keys only, a tile of keys at a time from the keys transposed once (0
after that tile, which the mask still hides), ``causal_softmax_func`` takes the masked softmax over those keys
(TVM's ``fast_exp``, as the CPU pipeline computes a softmax), and ``causal_weighted_func`` sums those keys
alone: half the work of a prompt's attention, rows written in order, and no score summed across a vector's
lanes. A mask that shows a
later key (bidirectional) keeps the full kernels. One row differs: a row whose keys up to its own are all
hidden (by the padding) gets the softmax of hidden scores alone, uniform over all keys in the graph and over
the keys up to its own here; only a prompt bucket's padding rows can be such a row under a sliding window, and
nothing reads their results (the cache slots they fill are past ``position``, and the logits are row ``last``'s).

The new entries go into the cache where it lies too. ``edgeq.llm.decoder`` writes a decode step's output cache as
``where(slots == position, new, past)``, which is a copy of every layer's whole cache each token (SmolLM2-135M at
512 slots: 24 MB read and 24 MB written a token, 17% of its decode at 440 tokens of context, ``perf``, one
thread). ``cache_write_pass`` makes each one a ``call_tir_inplace`` that stores the new row into slot
``position`` of the past and returns that tensor: the loaders pass a step's cache to the next, so the past is
not read again. A step reads the slot it writes only through attention, where the mask gives it no weight
(``generate.decode_feeds``: slots ``0 .. position-1`` and the new token after the cache), so whether the
store comes before or after that read, the step computes the same.
"""

from __future__ import annotations

import numpy as np

from edgeq.backends.cpu.common import STREAMED, TILE, Isa, largest_divisor, worth_threads
from edgeq.tvm_env import Schedule, relax, te, tvm

SCORES = "edgeq_attention_scores"
WEIGHTED = "edgeq_attention_weighted"
SOFTMAX = "edgeq_attention_softmax"
WRITE = "edgeq_cache_write"
HIDDEN = -1e30  # a mask's value for a hidden key at most this: exp(hidden + score - max) is 0 for any real score


def _parts(keys: relax.Expr) -> list[relax.Expr]:
    """The tensors ``keys`` concatenates along its length (axis 2), or ``[keys]``."""
    if isinstance(keys, relax.Call) and keys.op.name == "relax.concat":
        axis = keys.attrs.axis
        fields = keys.args[0]
        if isinstance(fields, relax.Tuple) and axis is not None and int(axis) in (2, -2):
            return list(fields.fields)
    return [keys]


def _static(expr) -> tuple[int, ...] | None:
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d) for d in shape.values)


def _concatenated(parts, lengths: list[int]):
    """``x[b, g, t, d]`` of the parts' concatenation along ``t``, read from the parts themselves (TE)."""
    if len(parts) == 1:
        return lambda b, g, t, d: parts[0][b, g, t, d]
    first = lengths[0]
    return lambda b, g, t, d: tvm.tirx.if_then_else(t < first, parts[0][b, g, t, d], parts[1][b, g, t - first, d])


def _opaque(func):
    """A scheduled kernel that fusion leaves alone (TVM's kOpaque): fused with its consumers, it would lose its
    schedule, and FuseTIR cannot merge its buffers with theirs."""
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


class _Kernels:
    """The TIR functions a pass adds to ``bb``: ``kernel(key, make)`` adds ``make()`` once per ``key`` (its first
    item the name's stem) and returns its GlobalVar."""

    def __init__(self, bb):
        self.bb, self.added = bb, {}

    def __call__(self, key: tuple, make):
        if key not in self.added:
            name = f"{key[0]}_{len(self.added)}"
            self.added[key] = self.bb.add_func(make().with_attr("global_symbol", name), name)
        return self.added[key]


def _rewritten(bb, mod, rewrite):
    """``mod`` (through ``bb``, which holds the kernels added) with ``rewrite`` applied to each Relax function,
    and what the rewrites left unused dropped."""
    updated = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            new = rewrite(func)
            if not new.same_as(func):
                updated[gv] = new
    for gv, func in updated.items():
        bb.update_func(gv, func)
    out = bb.get()
    return relax.transform.DeadCodeElimination()(out) if updated else out


def scores_func(heads: int, kv_heads: int, rows: int, dim: int, lengths: list[int], scale: float | None, dtype: str,
                isa: Isa):
    """``out[0, h, s, t] = sum_d q[0, h, s, d] * (k[0, h // G, t, d] * scale)``, ``k`` the concatenation of the
    parts (``lengths`` long) along ``t``: each part's scores on their own, then side by side. Scheduled: the kv
    heads' key rows over the cores; each row's products with its G query heads' rows summed in vectors along
    ``d`` (the row read once for the G), then across the lanes."""
    group, total = heads // kv_heads, sum(lengths)
    q = te.placeholder((1, heads, rows, dim), dtype, "q")
    parts = [te.placeholder((1, kv_heads, n, dim), dtype, f"k{i}") for i, n in enumerate(lengths)]
    c = tvm.tirx.const(scale, dtype) if scale is not None else None

    def product(k):
        d = te.reduce_axis((0, dim), "d")
        if c is None:
            return lambda b, h, s, t: te.sum(q[b, h, s, d] * k[b, h // group, t, d], axis=d)
        return lambda b, h, s, t: te.sum(q[b, h, s, d] * (k[b, h // group, t, d] * c), axis=d)

    names = [f"{SCORES}_{i}" for i in range(len(parts))] if len(parts) > 1 else [SCORES]
    partial = [te.compute((1, heads, rows, n), product(k), name=name) for k, n, name in zip(parts, lengths, names)]
    if len(partial) == 1:
        out = partial[0]
    else:
        first = lengths[0]
        out = te.compute((1, heads, rows, total),
                         lambda b, h, s, t: tvm.tirx.if_then_else(t < first, partial[0][b, h, s, t],
                                                                  partial[1][b, h, s, t - first]), name=SCORES)
    sch = Schedule(tvm.IRModule({"main": te.create_prim_func([q, *parts, out])}))
    lanes = largest_divisor(dim, isa.lanes)
    for name in names:
        block = sch.get_sblock(name)
        b, h, s, t, d = sch.get_loops(block)
        g, r = sch.split(h, [kv_heads, group])
        do, di = sch.split(d, [None, lanes])
        sch.reorder(b, g, t, r, s, do, di)
        partial_sums = sch.rfactor(di, factor_axis=4)
        b, g, t, r, s, di = sch.get_loops(block)
        sch.compute_at(partial_sums, s)
        sch.set_scope(partial_sums, 0, TILE)
        inner = sch.get_loops(partial_sums)[5:]  # compute_at gives the lanes first (a loop of one dropped)
        if len(inner) == 2:
            sch.reorder(inner[1], inner[0])
            inner = inner[::-1]
        sch.vectorize(inner[-1])  # vectorize and parallel before the init is split off (which keeps the loops' kinds)
        sch.unroll(di)
        outer = sch.fuse(b, g, t)
        if worth_threads(heads * rows * total * dim * STREAMED):
            sch.parallel(outer)
        sch.decompose_reduction(partial_sums, inner[0])
    return _opaque(sch.mod["main"])


def weighted_func(heads: int, kv_heads: int, rows: int, dim: int, lengths: list[int], dtype: str, isa: Isa):
    """``out[0, h, s, d] = sum_t p[0, h, s, t] * v[0, h // G, t, d]``, ``v`` the concatenation of the parts
    (``lengths`` long) along ``t``. Scheduled: the query heads' rows over the cores, each a row of ``d``
    accumulated in vectors over ``t``."""
    group, total = heads // kv_heads, sum(lengths)
    p = te.placeholder((1, heads, rows, total), dtype, "p")
    parts = [te.placeholder((1, kv_heads, n, dim), dtype, f"v{i}") for i, n in enumerate(lengths)]
    value = _concatenated(parts, lengths)
    t = te.reduce_axis((0, total), "t")
    out = te.compute((1, heads, rows, dim), lambda b, h, s, d: te.sum(p[b, h, s, t] * value(b, h // group, t, d), axis=t),
                     name=WEIGHTED)
    sch = Schedule(tvm.IRModule({"main": te.create_prim_func([p, *parts, out])}))
    block = sch.get_sblock(WEIGHTED)
    b, h, s, d, t = sch.get_loops(block)
    sch.reorder(b, h, s, t, d)
    sch.vectorize(d)
    outer = sch.fuse(b, h, s)
    if worth_threads(heads * rows * total * dim * STREAMED):
        sch.parallel(outer)
    sch.decompose_reduction(block, t)
    return _opaque(sch.mod["main"])


def _pairs(rows: int):
    """The rows of a causal kernel in pairs, ``s`` with ``rows - 1 - s``, which together have ``rows + 1`` keys
    up to their own: (pairs, ``row(side, item)``: the row of side 0 or 1 of pair ``item``). An odd count's
    middle row is side 0 of the last pair alone (``sides(item)``)."""
    half = (rows + 1) // 2

    def row(side, item):
        return side * (rows - 1 - 2 * (item % half)) + item % half

    def sides(item):
        return 2 - (rows % 2) * (item % half == half - 1)

    return half, row, sides


CAUSAL_TILE_VECTORS = 4  # keys a causal scores tile computes, in vectors: 4 independent chains of multiply-adds


def causal_tile(isa: Isa) -> int:
    """Keys a tile of ``causal_scores_func`` computes: the rows of its transposed keys are padded to a multiple."""
    return CAUSAL_TILE_VECTORS * isa.lanes


def causal_scores_func(heads: int, kv_heads: int, rows: int, dim: int, dtype: str, isa: Isa):
    """A prefill's scores (its ``rows`` new keys alone) under a causal mask: row ``s``'s products with keys
    ``0 .. s``, from the keys transposed and scaled as the graph scales them (``keys[0, g, d, t]``, rows padded
    to a whole ``causal_tile``), and 0 after the tile that holds key ``s``, which the mask hides
    (``attention_pass``). A tile of keys at a time: its scores accumulated in vectors, one multiply-add a ``d``
    for each, so no score is summed across the lanes of a vector (``scores_func`` sums each score that way:
    16 dependent adds for one score, and a column of the output written at a time). The query rows go over the
    cores in pairs, ``s`` with ``rows - 1 - s``: a pair has about ``rows`` keys to score for its heads, an even
    share each (a core's contiguous run of rows would not be)."""
    from tvm.script import tirx as T

    group, tile = heads // kv_heads, causal_tile(isa)
    half, row, sides = _pairs(rows)
    padded, items = -(-rows // tile) * tile, heads * half
    threads = worth_threads(heads * rows * rows * dim * STREAMED // 2)

    @T.prim_func(private=True, s_tir=True)
    def func(q: T.Buffer((1, heads, rows, dim), dtype), keys: T.Buffer((1, kv_heads, dim, padded), dtype),
             out: T.Buffer((1, heads, rows, rows), dtype)):
        T.func_attr({"tir.noalias": True})
        for i in T.parallel(items) if threads else T.serial(items):
            with T.sblock(SCORES):
                vi = T.axis.spatial(items, i)
                T.reads(q[0, vi // half, 0:rows, 0:dim], keys[0, vi // half // group, 0:dim, 0:padded])
                T.writes(out[0, vi // half, 0:rows, 0:rows])
                acc = T.alloc_buffer((tile,), dtype, scope=TILE)
                for side in range(sides(vi)):
                    for block in range(row(side, vi) // tile + 1):
                        for j in T.vectorized(tile):
                            acc[j] = T.cast(0, dtype)
                        for d in range(dim):
                            for j in T.vectorized(tile):
                                acc[j] = acc[j] + q[0, vi // half, row(side, vi), d] \
                                    * keys[0, vi // half // group, d, block * tile + j]
                        if block * tile + tile <= rows:
                            for j in T.vectorized(tile):
                                out[0, vi // half, row(side, vi), block * tile + j] = acc[j]
                        else:
                            for j in range(rows - block * tile):
                                out[0, vi // half, row(side, vi), block * tile + j] = acc[j]
                    for t in range(T.max(rows - (row(side, vi) // tile + 1) * tile, 0)):
                        out[0, vi // half, row(side, vi),
                            (row(side, vi) // tile + 1) * tile + t] = T.cast(0, dtype)

    return _opaque(func)


def fast_exp(x):
    """TVM's ``fast_exp`` for float32 (topi's; what the CPU pipeline's ``FastMathTransform`` makes of a softmax's
    exp) as an expression of ``x``, term for term: ``2^n`` times a polynomial of the remainder, ``x`` clamped
    to +-88.38."""
    def f32(v):
        return tvm.tirx.const(v, "float32")

    clamped = tvm.tirx.max(tvm.tirx.min(x, f32(88.3762626647950)), f32(-88.3762626647949))
    n = tvm.tirx.floor(clamped * f32(1.44269504088896341) + f32(0.5))
    f = clamped - n * f32(0.6931471805599453)
    y = f32(1.9875691500E-4)
    for coefficient in (1.3981999507E-3, 8.3334519073E-3, 4.1665795894E-2, 1.6666665459E-1, 5.0000001201E-1):
        y = y * f + f32(coefficient)
    y = y * f * f + f + f32(1.0)
    power = tvm.tirx.reinterpret("float32", tvm.tirx.shift_left(tvm.tirx.Cast("int32", n + f32(127.0)),
                                                                tvm.tirx.const(23, "int32")))
    return tvm.tirx.max(power * y, x)


def causal_softmax_func(heads: int, rows: int, mask_heads: int, nan_to_zero: bool, dtype: str, isa: Isa):
    """``softmax(scores + mask)`` along the keys (``fast_exp``, as the CPU pipeline computes a softmax), for a
    prefill under a causal mask: row ``s`` over keys ``0 .. s`` (the maximum, the exponentials and their sum),
    its weights after them 0 (the mask hides those keys: their exponentials are 0, or under 4e-39 of the sum
    in ``fast_exp``); with ``nan_to_zero``, a NaN weight made 0, as exported. ``mask`` is ``[1, mask_heads,
    rows, rows]`` (1: the same for every head). Vectors along the keys, rows over the cores in pairs (as
    ``causal_scores_func``'s)."""
    from tvm.script import tirx as T

    lanes = isa.lanes
    half, row, sides = _pairs(rows)
    items = heads * half
    threads = worth_threads(heads * rows * rows * 8)
    lowest = tvm.tirx.min_value(dtype)

    def full(side, item):  # where the keys up to the row's own end in whole vectors
        return (row(side, item) + 1) // lanes * lanes

    def shown(x, mask, side, item, t):  # the score of key t in the row, masked
        return x[0, item // half, row(side, item), t] + mask[0, item // half % mask_heads, row(side, item), t]

    def weight(value):
        return T.if_then_else(T.isnan(value), T.cast(0, dtype), value) if nan_to_zero else value

    @T.prim_func(private=True, s_tir=True)
    def func(x: T.Buffer((1, heads, rows, rows), dtype), mask: T.Buffer((1, mask_heads, rows, rows), dtype),
             p: T.Buffer((1, heads, rows, rows), dtype)):
        T.func_attr({"tir.noalias": True})
        for i in T.parallel(items) if threads else T.serial(items):
            with T.sblock(SOFTMAX):
                vi = T.axis.spatial(items, i)
                T.reads(x[0, vi // half, 0:rows, 0:rows], mask[0, 0:mask_heads, 0:rows, 0:rows])
                T.writes(p[0, vi // half, 0:rows, 0:rows])
                vector = T.alloc_buffer((lanes,), dtype, scope=TILE)
                top = T.alloc_buffer((1,), dtype, scope=TILE)
                total = T.alloc_buffer((1,), dtype, scope=TILE)
                for side in range(sides(vi)):
                    for j in T.vectorized(lanes):
                        vector[j] = lowest
                    for b in range(full(side, vi) // lanes):
                        for j in T.vectorized(lanes):
                            vector[j] = T.max(vector[j], shown(x, mask, side, vi, b * lanes + j))
                    top[0] = lowest
                    for j in range(lanes):
                        top[0] = T.max(top[0], vector[j])
                    for j in range(row(side, vi) + 1 - full(side, vi)):
                        top[0] = T.max(top[0], shown(x, mask, side, vi, full(side, vi) + j))
                    for j in T.vectorized(lanes):
                        vector[j] = T.cast(0, dtype)
                    for b in range(full(side, vi) // lanes):
                        for j in T.vectorized(lanes):
                            p[0, vi // half, row(side, vi), b * lanes + j] = fast_exp(
                                shown(x, mask, side, vi, b * lanes + j) - top[0])
                            vector[j] = vector[j] + p[0, vi // half, row(side, vi), b * lanes + j]
                    total[0] = T.cast(0, dtype)
                    for j in range(lanes):
                        total[0] = total[0] + vector[j]
                    for j in range(row(side, vi) + 1 - full(side, vi)):
                        p[0, vi // half, row(side, vi), full(side, vi) + j] = fast_exp(
                            shown(x, mask, side, vi, full(side, vi) + j) - top[0])
                        total[0] = total[0] + p[0, vi // half, row(side, vi), full(side, vi) + j]
                    for b in range(full(side, vi) // lanes):
                        for j in T.vectorized(lanes):
                            p[0, vi // half, row(side, vi), b * lanes + j] = weight(
                                p[0, vi // half, row(side, vi), b * lanes + j] / total[0])
                    for j in range(row(side, vi) + 1 - full(side, vi)):
                        p[0, vi // half, row(side, vi), full(side, vi) + j] = weight(
                            p[0, vi // half, row(side, vi), full(side, vi) + j] / total[0])
                    for t in range(rows - 1 - row(side, vi)):
                        p[0, vi // half, row(side, vi), row(side, vi) + 1 + t] = T.cast(0, dtype)

    return _opaque(func)


def causal_weighted_func(heads: int, kv_heads: int, rows: int, dim: int, dtype: str, isa: Isa):
    """``weighted_func`` for a prefill under a causal mask: row ``s`` sums keys ``0 .. s`` (the weights after
    it are the softmax's of a hidden score: 0) in ``weighted_func``'s order, into a row of accumulators. Rows
    over the cores in pairs, ``s`` with ``rows - 1 - s``, as ``causal_scores_func``'s."""
    from tvm.script import tirx as T

    group = heads // kv_heads
    half, row, sides = _pairs(rows)
    items = heads * half
    threads = worth_threads(heads * rows * rows * dim * STREAMED // 2)

    @T.prim_func(private=True, s_tir=True)
    def func(p: T.Buffer((1, heads, rows, rows), dtype), v: T.Buffer((1, kv_heads, rows, dim), dtype),
             out: T.Buffer((1, heads, rows, dim), dtype)):
        T.func_attr({"tir.noalias": True})
        for i in T.parallel(items) if threads else T.serial(items):
            with T.sblock(WEIGHTED):
                vi = T.axis.spatial(items, i)
                T.reads(p[0, vi // half, 0:rows, 0:rows], v[0, vi // half // group, 0:rows, 0:dim])
                T.writes(out[0, vi // half, 0:rows, 0:dim])
                acc = T.alloc_buffer((dim,), dtype, scope=TILE)
                for side in range(sides(vi)):
                    for d in T.vectorized(dim):
                        acc[d] = T.cast(0, dtype)
                    for t in range(row(side, vi) + 1):
                        for d in T.vectorized(dim):
                            acc[d] = acc[d] + p[0, vi // half, row(side, vi), t] \
                                * v[0, vi // half // group, t, d]
                    for d in T.vectorized(dim):
                        out[0, vi // half, row(side, vi), d] = acc[d]

    return _opaque(func)


def attention_pass(isa: Isa, stats: dict | None = None):
    """The Relax pass: see the module's text."""
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    keys = wildcard()
    expanded = is_op("relax.expand_dims")(keys)
    broadcast = is_op("relax.broadcast_to")(expanded, wildcard())
    repeated = is_op("relax.reshape")(broadcast, wildcard())
    transposed = is_op("relax.permute_dims")(repeated)
    scale = is_const()
    q = wildcard()
    scores = is_op("relax.matmul")(q, is_op("relax.multiply")(transposed, scale)) | is_op("relax.matmul")(q, transposed)
    p = wildcard()
    weighted = is_op("relax.matmul")(p, repeated)
    # the exported causal mask: where(C & padding, visible, hidden) added to the scores, C a constant
    visible, hidden, causal = is_const(), is_const(), is_const()
    both = is_op("relax.logical_and")(causal, wildcard())
    mask = is_op("relax.where")(is_op("relax.broadcast_to")(both, wildcard()) | both, visible, hidden)
    masked_scores = is_op("relax.add")(scores, mask)
    scored, nan_value = wildcard(), is_const()
    softmax = is_op("relax.nn.softmax")(is_op("relax.add")(scored, mask))
    nan_zeroed = is_op("relax.where")(is_op("relax.isnan")(softmax), nan_value, softmax)
    masked_weighted = is_op("relax.matmul")(nan_zeroed | softmax, repeated)

    def hides_the_future(matched, rows: int, total: int) -> bool:
        """Whether the matched mask hides every key after a row's own (``t > s``, the keys being the rows'),
        with a value that no score can move: then those scores' softmax weights are 0 whatever they were."""
        if rows != total:
            return False
        keep = matched[causal].value.numpy()
        away = matched[hidden].value.numpy()
        if keep.dtype != np.bool_ or keep.ndim > 4 or away.size != 1 or not float(away.reshape(())) <= HIDDEN:
            return False
        try:
            keep = np.broadcast_to(keep, (1, 1, rows, total))
        except ValueError:
            return False
        return not keep[..., np.triu_indices(rows, 1)[0], np.triu_indices(rows, 1)[1]].any()

    @tvm.transform.module_pass(opt_level=0, name="edgeq.DecoderAttention")
    def _pass(mod, _ctx):
        bb = relax.BlockBuilder(mod)
        kernel = _Kernels(bb)

        def repeat_ok(matched, heads: int) -> tuple | None:
            """(kv heads, parts, their lengths, D) of the matched repeat of ``keys``, where it is the GQA repeat."""
            k = matched[keys]
            shape = _static(k)
            if shape is None or len(shape) != 4 or shape[0] != 1:
                return None
            kv, length, dim = shape[1], shape[2], shape[3]
            if heads % kv:
                return None
            parts = _parts(k)
            shapes = [_static(x) for x in parts]
            if any(s is None or s[:2] != (1, kv) or s[3] != dim for s in shapes) or len(parts) > 2:
                return None
            lengths = [s[2] for s in shapes]
            if sum(lengths) != length:
                return None
            # each kv head repeated in place (expand_dims at 2: query head h reads kv head h // G); at axis 1 it
            # would be h % kv_heads, which these kernels do not compute
            axes = matched[expanded].attrs.axis
            if axes is None or [int(a) for a in axes] != [2]:
                return None
            if _static(matched[broadcast]) != (1, kv, heads // kv, length, dim):
                return None
            return kv, parts, lengths, dim

        def rewrite_masked_scores(call, matched):
            """A prefill's scores under the causal mask: ``causal_scores_func``, then the mask as it was."""
            product = rewrite_scores(matched[scores], matched, causal_rows=True)
            return call if product is None else relax.op.add(product, matched[mask])

        def rewrite_scores(call, matched, causal_rows: bool = False):
            """``call`` on the kernels, or as it was (with ``causal_rows``: the causal kernel, or None)."""
            unchanged = None if causal_rows else call
            qs, out = _static(matched[q]), _static(call)
            if qs is None or out is None or len(qs) != 4 or qs[0] != 1:
                return unchanged
            perm = matched[transposed].attrs.axes
            if perm is None or [int(a) for a in perm] != [0, 1, 3, 2]:
                return unchanged
            heads, rows, dim = qs[1], qs[2], qs[3]
            found = repeat_ok(matched, heads)
            if found is None or found[3] != dim or _static(matched[repeated]) != (1, heads, sum(found[2]), dim):
                return unchanged
            kv, parts, lengths, _ = found
            c = None
            if scale in matched:
                value = matched[scale].value.numpy()
                if value.size != 1:
                    return unchanged
                c = float(value.reshape(()))
            dtype = call.ty.dtype
            if dtype != "float32":
                return unchanged
            if causal_rows:
                if len(parts) != 1 or not hides_the_future(matched, rows, lengths[0]):
                    return None
                gv = kernel((SCORES + "_causal", heads, kv, rows, dim),
                            lambda: causal_scores_func(heads, kv, rows, dim, dtype, isa))
                count("attention-causal")
                count("attention")
                # the keys transposed and scaled once (as the graph scales them), rows padded to whole tiles
                keys = relax.op.permute_dims(parts[0], [0, 1, 3, 2])
                if c is not None:
                    keys = relax.op.multiply(keys, relax.const(c, dtype))
                padding = -(-rows // causal_tile(isa)) * causal_tile(isa) - rows
                keys = relax.op.nn.pad(keys, [0, 0, 0, 0, 0, 0, 0, padding])
                return relax.call_tir(gv, [matched[q], keys], relax.TensorType(out, dtype))
            gv = kernel((SCORES, heads, kv, rows, dim, tuple(lengths), c),
                        lambda: scores_func(heads, kv, rows, dim, lengths, c, dtype, isa))
            count("attention")
            return relax.call_tir(gv, [matched[q], *parts], relax.TensorType(out, dtype))

        def count(what: str) -> None:
            if stats is not None:
                stats[what] = stats.get(what, 0) + 1

        def rewrite_weighted(call, matched, causal_rows: bool = False):
            weights = call.args[0]  # ``p``, or the masked softmax's weights
            ps, out = _static(weights), _static(call)
            if ps is None or out is None or len(ps) != 4 or ps[0] != 1:
                return call
            heads, rows = ps[1], ps[2]
            found = repeat_ok(matched, heads)
            if found is None:
                return call
            kv, parts, lengths, dim = found
            dtype = call.ty.dtype
            if dtype != "float32" or sum(lengths) != ps[3] or out != (1, heads, rows, dim):
                return call
            if causal_rows:
                if len(parts) != 1 or not hides_the_future(matched, rows, lengths[0]) \
                        or int(matched[softmax].attrs.axis) not in (-1, 3):
                    return call
                gv = kernel((WEIGHTED + "_causal", heads, kv, rows, dim),
                            lambda: causal_weighted_func(heads, kv, rows, dim, dtype, isa))
                count("attention-causal")
                softmaxed = causal_softmax(matched, heads, rows, dtype)
                weights = weights if softmaxed is None else softmaxed
            else:
                gv = kernel((WEIGHTED, heads, kv, rows, dim, tuple(lengths)),
                            lambda: weighted_func(heads, kv, rows, dim, lengths, dtype, isa))
            count("attention")
            return relax.call_tir(gv, [weights, *parts], relax.TensorType(out, dtype))

        def causal_softmax(matched, heads: int, rows: int, dtype: str):
            """The masked softmax's weights by ``causal_softmax_func`` (from the scores and the mask it adds), or
            None where the mask's shape or the NaNs' value is not what it computes."""
            masks = _static(matched[mask])
            if masks is None or masks[0] != 1 or masks[1] not in (1, heads) or masks[2:] != (rows, rows) \
                    or _static(matched[scored]) != (1, heads, rows, rows) or str(matched[mask].ty.dtype) != dtype:
                return None
            nan = nan_value in matched
            if nan and float(matched[nan_value].value.numpy().reshape(-1)[0]) != 0.0:
                return None
            gv = kernel((SOFTMAX, heads, rows, masks[1], nan),
                        lambda: causal_softmax_func(heads, rows, masks[1], nan, dtype, isa))
            count("attention-causal")
            return relax.call_tir(gv, [matched[scored], matched[mask]], relax.TensorType((1, heads, rows, rows), dtype))

        def rewrite(func):
            func = rewrite_call(masked_scores, rewrite_masked_scores, func)
            func = rewrite_call(scores, rewrite_scores, func)
            # the product by a softmax of masked scores (or by it with its NaNs made 0, as exported)
            func = rewrite_call(masked_weighted, lambda call, matched: rewrite_weighted(call, matched, True), func)
            return rewrite_call(weighted, rewrite_weighted, func)

        return _rewritten(bb, mod, rewrite)

    return _pass


def write_func(kv_heads: int, slots: int, dim: int, dtype: str, index_dtype: str):
    """``cache[0, h, position, d] = new[0, h, 0, d]``, in place (``call_tir_inplace``: ``cache`` is also the
    result); a position outside the slots writes nothing, as the ``where`` it replaces."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def func(cache: T.Buffer((1, kv_heads, slots, dim), dtype), new: T.Buffer((1, kv_heads, 1, dim), dtype),
             position: T.Buffer((1, 1, 1, 1), index_dtype)):
        T.func_attr({"tir.noalias": True})
        for h, d in T.grid(kv_heads, dim):
            with T.sblock(WRITE):
                vh, vd = T.axis.remap("SS", [h, d])
                T.reads(new[0, vh, 0, vd], position[0, 0, 0, 0])
                T.writes(cache[0, vh, 0:slots, vd])
                if 0 <= position[0, 0, 0, 0] and position[0, 0, 0, 0] < slots:
                    cache[0, vh, position[0, 0, 0, 0], vd] = new[0, vh, 0, vd]

    return _opaque(func)


def cache_write_pass(stats: dict | None = None):
    """The Relax pass: see the module's text. Matches ``where(equal(arange(slots), position), new, past)`` with
    ``past`` a parameter of its function, as ``edgeq.llm.decoder`` writes it, and nothing else."""
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    slots_const, position, new, past = is_const(), wildcard(), wildcard(), wildcard()
    pattern = is_op("relax.where")(is_op("relax.equal")(slots_const, position), new, past)

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CacheWriteInPlace")
    def _pass(mod, _ctx):
        bb = relax.BlockBuilder(mod)
        kernel = _Kernels(bb)

        def rewrite(func):
            params = set(func.params)

            def write(call, matched):
                cache, row, pos = matched[past], matched[new], matched[position]
                shape, row_shape, pos_shape = _static(cache), _static(row), _static(pos)
                if cache not in params or shape is None or len(shape) != 4 or shape[0] != 1:
                    return call
                kv, slots, dim = shape[1], shape[2], shape[3]
                index_dtype = str(pos.ty.dtype)
                values = matched[slots_const].value.numpy()
                if row_shape != (1, kv, 1, dim) or pos_shape != (1, 1, 1, 1) or "int" not in index_dtype \
                        or values.shape != (1, 1, slots, 1) or not np.array_equal(values.reshape(-1), np.arange(slots)):
                    return call
                dtype = str(call.ty.dtype)
                if str(row.ty.dtype) != dtype or str(cache.ty.dtype) != dtype:
                    return call
                gv = kernel((WRITE, kv, slots, dim, dtype, index_dtype),
                            lambda: write_func(kv, slots, dim, dtype, index_dtype))
                if stats is not None:
                    stats["cache-write"] = stats.get("cache-write", 0) + 1
                return relax.call_tir_inplace(gv, [cache, row, pos], [0], relax.TensorType(shape, dtype))

            return rewrite_call(pattern, write, func)

        return _rewritten(bb, mod, rewrite)

    return _pass
