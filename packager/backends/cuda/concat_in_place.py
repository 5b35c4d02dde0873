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
epilogue's 16-byte store (8 elements). Any other part (an upsampled map, a pool, a graph input) keeps the
concatenation a kernel.

``find_placements`` finds them; ``place`` rewrites the claims (their kernels' views and in-place operands);
``cutlass.claim_convs`` writes the calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from edgeq.backends.cuda import cutlass

STORE = cutlass.ALIGNMENT  # elements of the epilogue's 16-byte store (fp16; int8 stores 8 bytes of 8)


@dataclasses.dataclass
class Placement:
    """One concatenation written in place: its variable, its channels and its parts in the order their kernels
    run, each (the claimed output variable, its first channel), with the variable each kernel's call binds (the
    tensor after that part is written)."""

    concat: object
    channels: int
    parts: list[tuple[object, int]]
    versions: list[object]

    def record(self) -> dict:
        return {"concat": self.concat.name, "channels": self.channels,
                "parts": [{"first": first, "channels": _channels(var)} for var, first in
                          sorted(self.parts, key=lambda part: part[1])]}


def _channels(var) -> int:
    from edgeq.graph_passes import shape_of

    return int(shape_of(var)[3])


def _ints(expr) -> list[int]:  # strided_slice's axes, begin, end and strides: tuples of PrimValues
    fields = getattr(expr, "fields", expr)
    return [int(getattr(f, "value", f)) for f in fields]


def channel_slice(var, value_of) -> tuple[object, int, int] | None:
    """(tensor, first, end) where ``var`` is a ``strided_slice`` of the channels (last axis, step 1) of a 4-D
    tensor, else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.strided_slice":
        return None
    t = value.args[0]
    shape = shape_of(t)
    axes, begin, end = (_ints(a) for a in value.args[1:4])
    if shape is None or len(shape) != 4 or [a % 4 for a in axes] != [3] or (
            len(value.args) > 4 and any(v != 1 for v in _ints(value.args[4]))):
        return None
    first = begin[0] + shape[3] if begin[0] < 0 else begin[0]
    return t, first, first + _channels(var)


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

    bindings, value_of, _, _ = cutlass.main_index(main)
    order = {b.var: i for i, b in enumerate(bindings)}
    by_output = {c.output: c for c in claimed}
    placements, used = [], set()
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
        parts, first = [], 0
        for t, begin, end in groups:
            c = by_output.get(t)
            if c is None or begin != 0 or end != _channels(t) or not _placeable(c) or t in used or first % STORE \
                    or any(t.same_as(q) for q, _ in parts):
                parts = None
                break
            parts.append((t, first))
            first += end
        if not parts:
            continue
        parts.sort(key=lambda part: order[part[0]])
        ty = cutlass._ty(b.var)
        versions = [relax.DataflowVar(f"{b.var.name}_in_place{i}", ty) for i in range(len(parts))]
        used.update(t for t, _ in parts)
        placements.append(Placement(b.var, shape[3], parts, versions))
    return placements


def place(main, claimed: Sequence, placements: Sequence[Placement]) -> list:
    """``claimed`` with each placed part's kernel writing its channels of the concatenation (``out_view``; after
    the first part in place, ``out_in_place`` with ``Claimed.y_in``), and each kernel reading a placed part, or a
    slice of one, as input or residual reading those channels of the concatenation (``x_view``, ``residual_view``)
    where its loads stay aligned."""
    _, value_of, _, _ = cutlass.main_index(main)
    where = {}  # placed var -> (the tensor after its write, its first channel, the tensor's channels)
    written = {}  # placed var -> (the tensor it comes into or None, the tensor it becomes)
    for pl in placements:
        firsts = dict((id(var), first) for var, first in pl.parts)
        for i, (var, _) in enumerate(pl.parts):
            where[var] = (pl.versions[i], firsts[id(var)], pl.channels)
            written[var] = (pl.versions[i - 1] if i else None, pl.versions[i])

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

    out = []
    for c in claimed:
        kern = c.kernel
        if type(kern) is not cutlass.ConvKernel:
            out.append(c)
            continue
        changes, claim = {}, {}
        if c.output in where:
            y_in, _ = written[c.output]
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
