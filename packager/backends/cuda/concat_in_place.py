"""Concatenations along the channels with no kernel: each part's convolution writes its channels in place (#42).

A YOLOv8 C2f block concatenates its first convolution's output (split in two) with each bottleneck's output, its
SPPF and its neck concatenate convolution outputs too: on the CUDA path each was a kernel copying every part into a
new tensor (8 of them and 4 residual adds in the n-scale detector). NHWC puts a pixel's channels side by side, so a
channel slice of the concatenation is a tensor with a wider row: the CUTLASS kernel of each part writes its output
there (its epilogue's output layout has the concatenation's channels as row stride, ``ConvKernel.out_view``), as
TensorRT eliminates a concatenation. The first part's kernel allocates the tensor (``call_tir``); each later part's
kernel takes it in and writes its channels (``call_tir_inplace``, which TVM's memory planner keeps as one buffer).
A reader of one part reads its channels in place: a CUTLASS convolution through its input's or residual's row
stride (``x_view``, ``residual_view``), any other operator through a ``strided_slice`` of the tensor, which fuses
into it.

Taken: a concatenation on the last axis of an NHWC tensor all of whose parts are outputs of CUTLASS convolutions
(``cutlass.ConvKernel``: fp16 or int8 out, no reshape after) or slices of one that together cover it in order (a
split's parts), each part in one concatenation only, its first channel and the tensor's channels a multiple of the
epilogue's 16-byte store (8 elements). SPPF's parts after its convolution's, chained max pools of it, are written
by one kernel of edgeq's after the convolutions (``Pools``, ``pool_prim_func``). A part that is a nearest 2x upsampling
of a placeable convolution's output (YOLO's neck: ``Resize`` of SPPF's and a C2f block's output, concatenated with
a backbone level) is written by that convolution too: its epilogue stores each output vector a second time, at the
four pixels it becomes (``ConvKernel.up_view``, ``Upsample2xIterator``), into the concatenation that comes in (so a
part made before it allocated it). Any other part (a graph input, another resize) keeps the concatenation a kernel.

A detector's output as Ultralytics' exporter writes it, per level ``reshape(transpose(concat([box, cls], C), NCHW),
[N, C, H W])`` concatenated along the anchors ([N, 4 x 16 + classes, anchors], fp16: then cast to float32), is
written by the head's last convolutions themselves (``HeadOutput``, ``find_head_outputs``): each its channels at its
level's anchors (``ConvKernel.head_out``, ``ChannelMajorIterator``), the first allocating the output, the others in
place; the transposes, reshapes, concatenations and the cast go (they were one kernel after the head).

``find_placements`` finds them; ``place`` rewrites the claims (their kernels' views and in-place operands);
``cutlass.claim_convs`` writes the calls.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from edgeq.backends.cuda import cutlass
from edgeq.backends.cuda.cutlass.match import last_axis_slice, main_index, only_reader_of, tensor_type

STORE = cutlass.ALIGNMENT  # elements of the epilogue's 16-byte store (fp16; int8 stores 8 bytes of 8)


@dataclasses.dataclass
class Pools:
    """SPPF's parts after its convolution's: max pools (stride 1, "same" padding) of one part, each pooling the one
    before it, written by one kernel into consecutive slices of the concatenation (from channel ``first``, each
    ``channels`` wide): part i is the max over a square of radius ``radii[i]`` of the source's channels (from
    ``source``), clipped at the map's edges, which is what i + 1 chained pools of radius r compute (radius (i + 1) r)."""

    first: int
    channels: int
    source: int
    radii: tuple[int, ...]
    pooled: tuple  # the pools' variables (their bindings go)

    @property
    def function(self) -> str:
        return f"{PREFIX}{self.first}_{self.channels}"


PREFIX = "concat_pools_"


@dataclasses.dataclass
class Placement:
    """One concatenation written in place: its variable, its channels and its parts in the order their kernels
    run, each (the claimed output variable, its first channel), with the variable each kernel's call binds (the
    tensor after that part is written); ``pools``: parts a pool kernel writes last (SPPF)."""

    concat: object
    channels: int
    parts: list[tuple[object, int]]
    versions: list[object]
    pools: Pools | None = None
    ups: dict = dataclasses.field(default_factory=dict)  # an upsampled part's variable -> the convolution output
    # whose kernel writes it (its place in ``parts`` is that kernel's)

    def pool_prim_func(self):
        """``pool_prim_func`` of this placement (``cutlass.claim_convs`` adds it to the module)."""
        return pool_prim_func(self)

    def record(self) -> dict:
        parts = [{"first": first, "channels": _channels(var),
                  **({"nearest_2x_of": self.ups[var].name} if var in self.ups else {})}
                 for var, first in sorted(self.parts, key=lambda p: p[1])]
        if self.pools is not None:
            parts += [{"first": self.pools.first + i * self.pools.channels, "channels": self.pools.channels,
                       "max_pool_of_channels": self.pools.source, "window": 2 * r + 1}
                      for i, r in enumerate(self.pools.radii)]
        return {"concat": self.concat.name, "channels": self.channels, "parts": parts}


@dataclasses.dataclass
class HeadOutput:
    """A detector's output [N, channels, anchors] written by the convolutions it is made of: ``parts`` (the claimed
    output variable, its first channel, its level's first anchor) in the order their kernels run, each binding the
    version of the tensor after its write (``versions``; the first allocates it); ``dropped``: the transposes,
    reshapes, concatenations and cast between them and the output (their bindings go); ``out``: the output's
    variable (bound to the last version)."""

    out: object
    shape: tuple[int, int, int]
    dtype: str
    parts: list[tuple[object, int, int]]
    versions: list[object]
    dropped: tuple

    def record(self) -> dict:
        return {"output": self.out.name, "shape": list(self.shape), "dtype": self.dtype,
                "parts": [{"channels": [c, c + _channels(var)], "anchors": [a, a + _pixels(var)]}
                          for var, c, a in sorted(self.parts, key=lambda part: (part[2], part[1]))]}


def _pixels(var) -> int:
    from edgeq.graph_passes import shape_of

    shape = shape_of(var)
    return int(shape[1]) * int(shape[2])


def find_head_outputs(main, claimed: Sequence) -> list[HeadOutput]:
    """The outputs of ``main`` that are [N, C, A] concatenations (last axis) of per-level ``reshape([N, C, H W])`` of
    ``permute_dims(X, [0, 3, 1, 2])`` (or of X itself where H W is 1), X a CUTLASS convolution's NHWC output or a
    concatenation of such along its channels, fp16 or float32 (an fp16 output may be cast to float32 after), each
    value between read by the next only."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    bindings, value_of, readers, _ = main_index(main)
    only = only_reader_of(readers)
    order = {b.var: i for i, b in enumerate(bindings)}
    by_output = {c.output: c for c in claimed}
    found = []
    for out in (b.var for b in bindings if None in readers.get(b.var, [])):  # the function's outputs, in order
        dropped, var = [], out
        if call_op(value_of[var]) == "relax.astype" and dtype_of(var) == "float32":
            var = value_of[var].args[0]
            if not isinstance(var, relax.Var) or only(var) != out:
                continue
        value, shape = value_of.get(var), shape_of(var)
        if call_op(value) != "relax.concat" or shape is None or len(shape) != 3 \
                or int(value.attrs.axis) % 3 != 2 or not isinstance(value.args[0], relax.Tuple):
            continue
        if var is not out:
            dropped.append(var)
        n, channels, anchors = (int(d) for d in shape)
        parts, anchor = [], 0
        for level in value.args[0].fields:
            got = _level(level, var, value_of, only, by_output, (n, channels))
            if got is None:
                parts = None
                break
            level_parts, level_dropped, pixels = got
            parts += [(c, first, anchor) for c, first in level_parts]
            dropped += level_dropped
            anchor += pixels
        if not parts or anchor != anchors:
            continue
        dtype = dtype_of(out)
        parts.sort(key=lambda part: order[part[0]])
        ty = tensor_type(out)
        versions = [relax.DataflowVar(f"{out.name}_head{i}", ty) for i in range(len(parts))]
        found.append(HeadOutput(out, (n, channels, anchors), dtype, parts, versions, tuple(dropped)))
    return found


def _level(level, reader, value_of, only, by_output, nc) -> tuple | None:
    """(([claimed output, first channel], ...), the variables between them and ``reader``, H W) of one level of a
    detector's output, else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    n, channels = nc
    shape = shape_of(level)
    if call_op(value_of.get(level)) != "relax.reshape" or only(level) != reader or shape is None \
            or tuple(int(d) for d in shape[:2]) != (n, channels):
        return None
    dropped, x = [level], value_of[level].args[0]
    if call_op(value_of.get(x)) == "relax.permute_dims":
        axes = value_of[x].attrs.axes
        if axes is None or [int(a) for a in axes] != [0, 3, 1, 2] or only(x) != level:
            return None
        dropped.append(x)
        x = value_of[x].args[0]
        reader = dropped[-1]
    else:
        reader = level
    xs = shape_of(x)
    if not isinstance(x, relax.Var) or xs is None or len(xs) != 4 or only(x) != reader \
            or tuple(int(d) for d in (xs[0], xs[3])) != (n, channels) or int(xs[1]) * int(xs[2]) != int(shape[2]):
        return None
    if dropped[-1] is level and int(xs[1]) * int(xs[2]) != 1:  # a reshape of NHWC is NCHW's only at one pixel
        return None
    pieces = [x]
    if call_op(value_of.get(x)) == "relax.concat":
        if int(value_of[x].attrs.axis) % 4 != 3 or not isinstance(value_of[x].args[0], relax.Tuple):
            return None
        dropped.append(x)
        pieces = list(value_of[x].args[0].fields)
    parts, first = [], 0
    for piece in pieces:
        c = by_output.get(piece)
        if c is None or only(piece) != (x if len(pieces) > 1 or piece is not x else reader) \
                or not _head_placeable(c) or dtype_of(piece) not in ("float16", "float32"):
            return None
        parts.append((piece, first))
        first += _channels(piece)
    return parts, dropped, int(xs[1]) * int(xs[2])


def _head_placeable(c) -> bool:
    """A claim whose kernel can write its output channel-major into a detector's output."""
    from edgeq.graph_passes import shape_of

    k, p = c.kernel, c.kernel.problem
    return (type(k) is cutlass.ConvKernel and k.residual_type == k.output_dtype and "y" not in c.shapes
            and tuple(shape_of(c.output) or ()) == (p.n, p.p, p.q, p.k))


def _channels(var) -> int:
    from edgeq.graph_passes import shape_of

    return int(shape_of(var)[3])


def channel_slice(var, value_of) -> tuple[object, int, int] | None:
    """(tensor, first, end) where ``var`` is a ``strided_slice`` of the channels (last axis, step 1) of a 4-D
    tensor, else None."""
    from edgeq.graph_passes import shape_of

    found = last_axis_slice(var, value_of)
    return found if found is not None and len(shape_of(found[0])) == 4 else None


def _placeable(c) -> bool:
    """A claim whose kernel can write a channel slice of a wider tensor."""
    from edgeq.graph_passes import shape_of

    k = c.kernel
    p = k.problem
    return (type(k) is cutlass.ConvKernel and not k.float_out and k.residual_type == k.output_dtype
            and "y" not in c.shapes and tuple(shape_of(c.output) or ()) == (p.n, p.p, p.q, p.k) and p.k % STORE == 0)


def find_placements(main, claimed: Sequence) -> list[Placement]:
    """The concatenations of ``main`` whose parts the ``claimed`` convolutions can write in place."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of
    from edgeq.tvm_env import relax

    bindings, value_of, readers, _ = main_index(main)
    order = {b.var: i for i, b in enumerate(bindings)}
    by_output = {c.output: c for c in claimed}
    placements, used, upsampled = [], set(), set()
    for b in bindings:
        value = b.value
        shape = shape_of(b.var)
        if call_op(value) != "relax.concat" or not isinstance(value.args[0], relax.Tuple) or shape is None \
                or len(shape) != 4 or int(value.attrs.axis) % 4 != 3 or shape[3] % STORE:
            continue
        groups = []  # [tensor, first channel in it, end] of consecutive parts
        for part in value.args[0].fields:
            whole = (part, 0, _channels(part)) if shape_of(part) is not None else None
            src = channel_slice(part, value_of) or whole
            if src is None:
                groups = None
                break
            if groups and groups[-1][0].same_as(src[0]) and groups[-1][2] == src[1]:
                groups[-1][2] = src[2]
            else:
                groups.append(list(src))
        if not groups:
            continue
        parts, first, pools, ups = [], 0, [], {}
        for t, begin, end in groups:
            pooled = _pool_chain(t, value_of, readers)
            if pooled is not None and begin == 0 and end == _channels(t) and first % STORE == 0:
                pools.append((first, *pooled))
                first += end
                continue
            source = _upsampled(t, value_of, readers, by_output)
            if source is not None and begin == 0 and end == _channels(t) and first % STORE == 0 \
                    and source not in upsampled and source not in ups.values() and not pools:
                ups[t] = source
                parts.append((t, first))
                first += end
                continue
            c = by_output.get(t)
            if c is None or begin != 0 or end != _channels(t) or not _placeable(c) or t in used or first % STORE \
                    or any(t.same_as(q) for q, _ in parts) or pools:
                parts = None
                break
            parts.append((t, first))
            first += end
        if not parts:
            continue
        pool = _pools(pools, parts, b.var, readers) if pools else None
        if pools and pool is None:
            continue
        parts.sort(key=lambda part: order[ups.get(part[0], part[0])])  # an upsampled part: when its conv runs
        if parts[0][0] in ups:  # it comes in to the kernel that writes it: a part before it allocates it
            continue
        ty = tensor_type(b.var)
        versions = [relax.DataflowVar(f"{b.var.name}_in_place{i}", ty) for i in range(len(parts))]
        used.update(t for t, _ in parts)
        upsampled.update(ups.values())
        placements.append(Placement(b.var, shape[3], parts, versions, pool, ups))
    return placements


# Resize's (coordinate transformation, rounding) that map output pixel o of a 2x nearest upsampling to input o // 2
_NEAREST_2X = {("half_pixel", "round_prefer_floor"), ("half_pixel", "round_prefer_ceil"), ("half_pixel", "round"),
               ("pytorch_half_pixel", "round_prefer_floor"), ("pytorch_half_pixel", "round_prefer_ceil"),
               ("asymmetric", "floor")}


def _upsampled(var, value_of, readers, by_output):
    """The convolution output that ``var`` is the nearest 2x upsampling of (NHWC, each output pixel (y, x) the input's
    (y // 2, x // 2)), read by one concatenation only, where that convolution can write it (``_placeable``); else
    None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.image.resize2d":
        return None
    a, src = value.attrs, value.args[0]
    c = by_output.get(src)
    shape, out = shape_of(src), shape_of(var)
    if (c is None or a.layout != "NHWC" or a.method != "nearest_neighbor"
            or (str(a.coordinate_transformation_mode), str(a.rounding_method)) not in _NEAREST_2X
            or shape is None or out is None or len(shape) != 4
            or tuple(out) != (shape[0], 2 * shape[1], 2 * shape[2], shape[3])
            or len(readers.get(var, [])) != 1 or readers[var][0] is None or not _placeable(c)):
        return None
    return src


def _pool_chain(var, value_of, readers) -> tuple | None:
    """(source, radius, pools) where ``var`` is a chain of max pools (stride 1, no dilation, a square window of
    odd size padded by its radius, NHWC) of ``source``, radius the chain's, pools its variables, each read by the
    next only (and by the concatenation), else None."""
    from edgeq.graph import call_op

    chain, radius = [], 0
    while call_op(value_of.get(var)) == "relax.nn.max_pool2d":
        a = value_of[var].attrs
        size = [int(v) for v in a.pool_size]
        if (a.layout != "NHWC" or [int(v) for v in a.strides] != [1, 1] or [int(v) for v in a.dilation] != [1, 1]
                or bool(a.ceil_mode) or size[0] != size[1] or size[0] % 2 == 0
                or [int(v) for v in a.padding] != [size[0] // 2] * 4):
            return None
        chain.append(var)
        radius += size[0] // 2
        var = value_of[var].args[0]
    return (var, radius, tuple(chain)) if chain else None


def _pools(pools: list, parts: list, concat, readers) -> Pools | None:
    """The parts of ``pools`` [(first channel, source, radius, pool variables)] as one ``Pools`` where they follow
    each other, are as wide, pool one placed part (each its predecessor's pools and a pool more), and their pools
    have no reader but each other and the concatenation."""
    from edgeq.graph_passes import shape_of

    def same(a, b) -> bool:
        return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b))

    first, source = pools[0][0], pools[0][1]
    width = _channels(source)
    src_first = next((f for var, f in parts if var.same_as(source)), None)
    if src_first is None:
        return None
    for i, (f, src, _, chain) in enumerate(pools):
        if f != first + i * width or not src.same_as(source) or len(chain) != i + 1 \
                or tuple(shape_of(chain[0])) != tuple(shape_of(source)) or (i and not same(chain[1:], pools[i - 1][3])):
            return None
    pooled = pools[-1][3]
    for var in pooled:
        if any(r is None or not (r.same_as(concat) or any(r.same_as(q) for q in pooled)) for r in readers.get(var, [])):
            return None
    return Pools(first, width, src_first, tuple(r for _, _, r, _ in pools), pooled)


def place_heads(claimed: Sequence, heads: Sequence[HeadOutput]) -> list:
    """``claimed`` with each head output's convolutions writing their part of it (``head_out``; after the first,
    in place: ``out_in_place`` with ``Claimed.y_in``)."""
    part_of = {var: (h, i) for h in heads for i, (var, _, _) in enumerate(h.parts)}
    out = []
    for c in claimed:
        if c.output not in part_of:
            out.append(c)
            continue
        h, i = part_of[c.output]
        _, first, anchor = h.parts[i]
        kern = dataclasses.replace(c.kernel, head_out=(first, anchor, h.shape[1], h.shape[2], h.dtype),
                                   out_in_place=i > 0, tile=dataclasses.replace(c.kernel.tile, split_k=1))  # (only
        # T holds the output: no partial sums through it)
        out.append(dataclasses.replace(c, kernel=kern, y_in=h.versions[i - 1] if i else None))
    return out


def place(main, claimed: Sequence, placements: Sequence[Placement]) -> list:
    """``claimed`` with each placed part's kernel writing its channels of the concatenation (``out_view``; after
    the first part in place, ``out_in_place`` with ``Claimed.y_in``), and each kernel reading a placed part, or a
    slice of one, as input or residual reading those channels of the concatenation (``x_view``, ``residual_view``)
    where its loads stay aligned."""
    _, value_of, _, _ = main_index(main)
    where = {}  # placed var -> (the tensor after its write, its first channel, the tensor's channels)
    comes_into = {}  # placed var -> the tensor its kernel writes into (the one before it), None for the first
    for pl in placements:
        for i, (var, first) in enumerate(pl.parts):
            where[var] = (pl.versions[i], first, pl.channels)
            comes_into[var] = pl.versions[i - 1] if i else None

    def view(var):
        """(tensor, first channel, its channels) that ``var``'s channels are in place in, or None."""
        sliced = channel_slice(var, value_of)
        src, first = (sliced[0], sliced[1]) if sliced else (var, 0)
        if src in where:
            tensor, at, channels = where[src]
            return tensor, at + first, channels
        if sliced:
            return src, first, _channels(src)
        return None

    up_of = {src: (var, pl) for pl in placements for var, src in pl.ups.items()}  # conv output -> its upsampled part
    out = []
    for c in claimed:
        kern = c.kernel
        if type(kern) is not cutlass.ConvKernel:
            out.append(c)
            continue
        changes, claim = {}, {}
        if c.output in up_of:  # also written upsampled into its part of that concatenation, which comes in
            var, pl = up_of[c.output]
            _, first, channels = where[var]
            changes["up_view"], claim["up_in"] = (first, channels), comes_into[var]
        if c.output in where:
            y_in = comes_into[c.output]
            _, first, channels = where[c.output]
            changes.update(out_view=(first, channels), out_in_place=y_in is not None)
            claim["y_in"] = y_in
        x = c.x
        if kern.x_view:  # already read in place from x (a split's input): its channels in what x became
            src = (x, kern.x_view[0], kern.x_view[1])
            src = (where[x][0], where[x][1] + src[1], where[x][2]) if x in where else None
        else:
            src = view(x)
        if src is not None:
            trial = dataclasses.replace(kern, x_view=(src[1], src[2]))
            if src[1] % trial.input_alignment == 0 and src[2] % trial.input_alignment == 0:
                changes["x_view"], claim["x"] = (src[1], src[2]), src[0]
        if c.residual is not None:
            src = view(c.residual)
            if src is not None and src[1] % STORE == 0 and src[2] % STORE == 0:
                changes["residual_view"], claim["residual"] = (src[1], src[2]), src[0]
        if changes:
            c = dataclasses.replace(c, kernel=dataclasses.replace(kern, **changes), **claim)
        out.append(c)
    return out


def pool_prim_func(pl: Placement):
    """The TIR of a placement's pool parts, in place (the concatenation its only operand, as it comes in): each
    output channel's max over its part's square, clipped at the map's edges (the max pool pads with the lowest value
    of the type, which never wins), in one loop nest over the largest square. Unscheduled: the host runs it as it is,
    ``schedule`` makes it the GPU's (the same arithmetic; its parameters ride along as the attribute
    ``edgeq.pools``)."""
    from edgeq.graph_passes import dtype_of, shape_of

    pools = pl.pools
    spec = {"shape": [int(d) for d in shape_of(pl.concat)], "dtype": dtype_of(pl.concat), "channels": pools.channels,
            "source": pools.source, "first": pools.first, "radii": list(pools.radii)}
    func = _pool_func(spec, scheduled=False)
    return func.with_attrs({"global_symbol": pools.function, "op_pattern": 8, "edgeq.pools": json.dumps(spec)})


THREADS = 128


def schedule(func):
    """``pool_prim_func``'s function for the GPU: a thread an output element (the concatenation's channels
    innermost: neighbouring threads read neighbouring channels), its max in a register. Written out (TVM's
    schedule primitives refuse a block that reads the buffer another block writes)."""
    spec = json.loads(str(func.attrs["edgeq.pools"]))
    return _pool_func(spec, scheduled=True).with_attrs({
        "global_symbol": func.attrs["global_symbol"], "op_pattern": 8, "edgeq.pools": func.attrs["edgeq.pools"]})


def _pool_func(spec: dict, scheduled: bool):
    from edgeq.tvm_env import import_tvm
    from tvm.script import tirx as T

    tvm = import_tvm()
    (n, h, w, ct), dtype = spec["shape"], spec["dtype"]
    c, s0, f0, radii = spec["channels"], spec["source"], spec["first"], spec["radii"]
    parts, big = len(radii), max(radii)
    width = parts * c
    radius = str(radii[-1])
    for i in range(parts - 2, -1, -1):  # the radius of output channel vc's part
        radius = f"T.if_then_else(vc < {(i + 1) * c}, {radii[i]}, {radius})"
    low = f'T.min_value("{dtype}")'
    dy, dx = f"(vy - {big})", f"(vx - {big})"
    inside = (f"T.abs({dy}) <= {radius} and T.abs({dx}) <= {radius} and 0 <= vh + {dy} and vh + {dy} < {h} "
              f"and 0 <= vw + {dx} and vw + {dx} < {w}")
    tap = f"B[vn, vh + {dy}, vw + {dx}, {s0} + vc % {c}]"
    head = ["@T.prim_func(s_tir=True)", "def func(b: T.handle):", '    T.func_attr({"tirx.noalias": False})',
            f'    B = T.match_buffer(b, ({n}, {h}, {w}, {ct}), "{dtype}")']
    if scheduled:
        total = n * h * w * width
        lines = head + [
            '    with T.sblock("root"):',
            f'        for bx in T.thread_binding({-(-total // THREADS)}, thread="blockIdx.x"):',
            f'            for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):',
            '                with T.sblock("pool"):',
            f"                    T.reads(B[0:{n}, 0:{h}, 0:{w}, {s0}:{s0 + c}])",
            f"                    T.writes(B[0:{n}, 0:{h}, 0:{w}, {f0}:{f0 + width}])",
            f'                    m = T.alloc_buffer((1,), "{dtype}", scope="local")',
            f"                    if bx * {THREADS} + tx < {total}:",
            f"                        vc = (bx * {THREADS} + tx) % {width}",
            f"                        vw = (bx * {THREADS} + tx) // {width} % {w}",
            f"                        vh = (bx * {THREADS} + tx) // {width * w} % {h}",
            f"                        vn = (bx * {THREADS} + tx) // {width * w * h}",
            f"                        m[0] = {low}",
            f"                        for vy, vx in T.grid({2 * big + 1}, {2 * big + 1}):",
            f"                            if {inside}:",
            f"                                m[0] = T.max(m[0], {tap})",
            f"                        B[vn, vh, vw, {f0} + vc] = m[0]",
        ]
    else:
        lines = head + [
            f'    acc = T.alloc_buffer(({n}, {h}, {w}, {width}), "{dtype}")',
            f"    for n, h, w, c, dy, dx in T.grid({n}, {h}, {w}, {width}, {2 * big + 1}, {2 * big + 1}):",
            '        with T.sblock("acc"):',
            '            vn, vh, vw, vc, vy, vx = T.axis.remap("SSSSRR", [n, h, w, c, dy, dx])',
            f"            T.reads(B[vn, 0:{h}, 0:{w}, {s0}:{s0 + c}])",
            "            T.writes(acc[vn, vh, vw, vc])",
            "            with T.init():",
            f"                acc[vn, vh, vw, vc] = {low}",
            f"            acc[vn, vh, vw, vc] = T.max(acc[vn, vh, vw, vc], T.if_then_else({inside}, {tap}, {low}))",
            f"    for n, h, w, c in T.grid({n}, {h}, {w}, {width}):",
            '        with T.sblock("out"):',
            '            vn, vh, vw, vc = T.axis.remap("SSSS", [n, h, w, c])',
            "            T.reads(acc[vn, vh, vw, vc])",
            f"            T.writes(B[vn, vh, vw, {f0} + vc])",
            f"            B[vn, vh, vw, {f0} + vc] = acc[vn, vh, vw, vc]",
        ]
    func = tvm.script.from_source("\n".join(lines), extra_vars={"T": T})
    return func.with_attr("tirx.is_scheduled", True) if scheduled else func
