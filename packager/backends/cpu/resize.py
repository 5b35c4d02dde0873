"""The bilinear resize kernel for CPUs: a row pass, then a column pass.

ONNX ``Resize`` (linear) imports as TVM's ``resize2d``, which computes every output on its own: two
coordinates, their floors and clamps, and four reads from the input, gathered across the vector. A
segmentation model ends in one, from its 1/8 or 1/16 map to the image's size: DeepLabV3's 14 x 14 x 21 to
224 x 224 took 9% of the model's time (2.3 ms), reading its NHWC input through a transpose.

Here the interpolation is separable, as it is written: first along the width (``rows[.., ih, ox]``, the
input's rows at the output's width: small), then along the height, where each output row is a blend of two
of those rows with one weight per row: a contiguous vector loop. The coordinates are TVM's (``topi.image``),
the blend ``a * (1 - t) + b * t`` along the width, then along the height. The input may be NHWC (what
lowering keeps between convolutions); the output is NHWC where something reads it on (LR-ASPP's upsampled
features go into a convolution) and NCHW for a model's output.

The row pass of an NCHW output runs along the width, where each output reads its own two inputs: as a
vector, a gather per operand (LR-ASPP's 28 x 28 x 21 to 224 x 224: 190 us, three times what writing its
4.2 MB takes). It is written instead as a band of weights: a vector of ``band`` outputs reads the few
inputs ``window`` from its block's first (``base``), each broadcast and multiplied by that block's weights
for it (``1 - t`` where it is an output's left input, ``t`` where its right, 0 elsewhere), which a small
table computed once per call holds. Its values are the blend's up to rounding (a sum with zeros and a
fused multiply-add).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from edgeq.backends.cpu.common import Isa, Kernel, Spec, blocks, dividing_lanes, is_spatial, parallel, vectorize_by
from edgeq.tvm_env import Schedule, ScheduleError, te, tvm


RESIZE = "edgeq_resize"  # the block of the column pass (the kernel's result)
ROWS = "edgeq_resize_rows"
WEIGHTS = "edgeq_resize_weights"  # the row pass's band of weights (an NCHW output)
MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")


@dataclasses.dataclass(frozen=True)
class ResizeSpec(Spec):
    """A bilinear resize of ``[n, c, h, w]`` (``nhwc_in``: held as ``[n, h, w, c]``) to ``oh x ow``."""

    annotation: ClassVar[str] = "edgeq.resize_spec"

    n: int
    c: int
    h: int
    w: int
    oh: int
    ow: int
    mode: str  # ONNX's coordinate_transformation_mode, one of MODES
    nhwc_in: bool
    nhwc_out: bool
    band: int = 0  # outputs per block of the row pass's band of weights (``plan``; 0: each output its taps)


# outputs below which TVM's resize stays: a small one costs nothing, and one from a 1 x 1 map (DeepLabV3's image
# pooling branch) is a broadcast that fuses into the concatenation after it
MIN_OUTPUTS = 1 << 15
MAX_WINDOW = 8  # inputs a block of the band may read (``plan``)


def plan(problem: ResizeSpec, isa: Isa) -> ResizeSpec | None:
    large = problem.n * problem.c * problem.oh * problem.ow >= MIN_OUTPUTS and problem.h * problem.w > 1
    if problem.mode not in MODES or not large:
        return None
    # NHWC out: the row pass runs along the channels, each output's inputs a contiguous vector. A band
    # as wide as a vector reads a few inputs where the resize enlarges (5 for 28 -> 224); one that shrinks
    # the row reads more than its two gathers cost
    if problem.nhwc_out or window(problem.w, problem.ow, problem.mode, isa.lanes) > MAX_WINDOW:
        return problem
    return dataclasses.replace(problem, band=isa.lanes)


def window(size: int, out: int, mode: str, band: int) -> int:
    """How many inputs a block of ``band`` outputs reads along an axis (``size`` inputs to ``out`` outputs):
    from its first output's left input to its last output's right, with one more for a coordinate that
    TVM's float arithmetic rounds the other way than numpy's; at most ``size``."""
    o = np.arange(out, dtype=np.float32)
    src = np.broadcast_to(_source(o, size, out, mode, np.float32), o.shape)
    left = np.clip(np.floor(src).astype(np.int64), 0, size - 1)
    right = np.clip(np.floor(src).astype(np.int64) + 1, 0, size - 1)
    spread = max(int(right[min(b + band, out) - 1] - left[b]) + 1 for b in range(0, out, band))
    return min(size, spread + 1)


def _source(of, size: int, out: int, mode: str, const):
    """The input coordinate of output coordinate ``of`` (float32), as ``topi.image.resize.get_inx`` computes
    it: ``of`` a TIR expression with ``const`` making TIR float32 constants, or a numpy float32 array with
    ``const`` ``np.float32`` (``window``)."""
    scale = const(np.float32(size) / np.float32(out))
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and out > 1):
        return (of + const(0.5)) * scale - const(0.5)
    if mode == "pytorch_half_pixel":
        return const(0.0)
    if mode == "align_corners":
        return const(np.float32(size - 1) / np.float32(out - 1) if out > 1 else 0.0) * of
    return scale * of  # asymmetric


def _taps(o, size: int, out: int, mode: str):
    """(first index, second index, weight of the second) along one axis, indices clamped to the input."""
    src = _source(o.astype("float32"), size, out, mode, lambda v: tvm.tirx.const(v, "float32"))
    base = te.floor(src).astype("int32")
    t = src - base.astype("float32")

    def clamp(i):
        return tvm.te.max(tvm.te.min(i, size - 1), 0)

    return clamp(base), clamp(base + 1), t


def _lerp(a, b, t):
    return a * (tvm.tirx.const(1.0, "float32") - t) + b * t


def resize_func(spec: ResizeSpec):
    """(PrimFunc ``(data) -> resized``, no weight)."""
    n, c, h, w, oh, ow = spec.n, spec.c, spec.h, spec.w, spec.oh, spec.ow
    x = te.placeholder((n, h, w, c) if spec.nhwc_in else (n, c, h, w), "float32", name="data")

    def read(b, ch, y, z):
        return x[b, y, z, ch] if spec.nhwc_in else x[b, ch, y, z]

    def along_width(b, ch, y, oz):
        left, right, t = _taps(oz, w, ow, spec.mode)
        return _lerp(read(b, ch, y, left), read(b, ch, y, right), t)

    def along_height(b, ch, oy, oz, rows):
        top, bottom, t = _taps(oy, h, oh, spec.mode)
        return _lerp(rows(b, ch, top, oz), rows(b, ch, bottom, oz), t)

    attrs = {spec.annotation: spec.to_json()}
    if spec.band:
        rows = _band_rows(spec, read)
        out = te.compute((n, c, oh, ow), lambda b, ch, oy, oz: along_height(
            b, ch, oy, oz, lambda b_, ch_, y_, oz_: rows[b_, ch_, y_, oz_]), name=RESIZE, attrs=attrs)
    elif spec.nhwc_out:
        rows = te.compute((n, h, ow, c), lambda b, y, oz, ch: along_width(b, ch, y, oz), name=ROWS)
        out = te.compute((n, oh, ow, c), lambda b, oy, oz, ch: along_height(
            b, ch, oy, oz, lambda b_, ch_, y_, oz_: rows[b_, y_, oz_, ch_]), name=RESIZE, attrs=attrs)
    else:
        rows = te.compute((n, c, h, ow), along_width, name=ROWS)
        out = te.compute((n, c, oh, ow), lambda b, ch, oy, oz: along_height(
            b, ch, oy, oz, lambda b_, ch_, y_, oz_: rows[b_, ch_, y_, oz_]), name=RESIZE, attrs=attrs)
    return te.create_prim_func([x, out], index_dtype_override="int64"), None


def _band_rows(spec: ResizeSpec, read):
    """The row pass of an NCHW output as a band of weights (the module's docstring): ``[n, c, h, ow]``
    rounded up to whole blocks of ``spec.band``."""
    w, ow, v = spec.w, spec.ow, spec.band
    blocks_, span = -(-ow // v), window(w, ow, spec.mode, v)

    def base(ob):  # the block's first input: its first output's left one, the window kept inside the row
        first, _, _ = _taps(ob * v, w, ow, spec.mode)
        return tvm.te.min(first, w - span)

    def weight(ob, j, lane):
        oz = tvm.te.min(ob * v + lane, ow - 1)  # (the outputs past the row repeat its last)
        left, right, t = _taps(oz, w, ow, spec.mode)
        at = base(ob) + j
        zero = tvm.tirx.const(0.0, "float32")
        return (tvm.tirx.Select(at == left, tvm.tirx.const(1.0, "float32") - t, zero)
                + tvm.tirx.Select(at == right, t, zero))

    weights = te.compute((blocks_, span, v), weight, name=WEIGHTS)

    def row(b, ch, y, oz):
        ob, lane = oz // v, oz % v
        terms = [read(b, ch, y, base(ob) + j) * weights[ob, j, lane] for j in range(span)]
        return sum(terms[1:], terms[0])

    return te.compute((spec.n, spec.c, spec.h, blocks_ * v), row, name=ROWS)


def _inner_vector(sch: Schedule, loops: list, isa: Isa) -> None:
    """The innermost loops fused into one contiguous run, vectorised in whole registers where they divide it."""
    run = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    lanes = dividing_lanes(int(sch.get(run).extent), isa.lanes, 4)
    if lanes:
        vectorize_by(sch, run, lanes)


def _inline_around(sch: Schedule) -> None:
    """What fusion put before the kernel (a transpose) inlined into the row pass, what it put after (an
    element-wise epilogue) into the column pass."""
    while True:
        names = [sch.get(b).name_hint for b in blocks(sch)]
        first, last = names.index(ROWS), names.index(RESIZE)
        others = [(i, b) for i, b in enumerate(blocks(sch)) if (i < first or i > last) and names[i] != WEIGHTS]
        for i, block in others:
            try:
                if i < first and is_spatial(sch, block):
                    sch.compute_inline(block)
                else:
                    sch.reverse_compute_inline(block)
                break
            except ScheduleError:
                continue
        else:
            return


def schedule_resize(sch: Schedule, spec: ResizeSpec, isa: Isa) -> None:
    _inline_around(sch)
    out = sch.get_sblock(RESIZE)
    rows = sch.get_sblock(ROWS)
    n, a, b, d = sch.get_loops(out)
    if spec.nhwc_out:  # [n, oh, ow, c]: each output row one run of ow * c values
        parallel(sch, [n, a], spec.n * spec.oh * spec.ow * spec.c)
        _inner_vector(sch, [b, d], isa)
    else:  # [n, c, oh, ow]
        parallel(sch, [n, a, b], spec.n * spec.c * spec.oh * spec.ow)
        _inner_vector(sch, [d], isa)
    if spec.band:  # each block of outputs a vector, its window's inputs broadcast
        b_, ch, y, oz = sch.get_loops(rows)
        ob, lane = sch.split(oz, [None, spec.band])
        sch.vectorize(lane)
        parallel(sch, [b_, ch, y], spec.n * spec.c * spec.h * spec.ow)
        weights = sch.get_sblock(WEIGHTS)
        sch.vectorize(sch.get_loops(weights)[-1])
        return
    parallel(sch, sch.get_loops(rows)[:2], spec.n * spec.c * spec.h * spec.ow)


KERNEL = Kernel(name="resize", spec=ResizeSpec, plan=plan, build=resize_func, symbol="edgeq_resize2d", block=RESIZE,
                schedule=schedule_resize)
