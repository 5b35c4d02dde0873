"""Put a graph's convolutions and matrix products on edgeq's CPU kernels.

One pass over the bindings (``edgeq.graph.rewrite``):

- every supported ``conv2d`` (float32, or int8/uint8 x int8 -> int32; any groups) and every
  ``matmul`` by a weight (a 1x1 convolution) is described as a ``ConvSpec``, a ``matmul`` of two float32
  activations (attention) as a ``BmmSpec``; the first kernel of ``edgeq.backends.cpu.rules.KERNELS`` that takes
  it replaces it with a ``call_tir`` of its TIR function, with the weight packed for that kernel now, at
  build time (the bundle ships the packed arrays); a bias the convolution's only reader adds is folded
  into the kernel's start values where the kernel has them (``Kernel.starts``), and that add disappears;
- activations stay NHWC from one convolution to the next: element-wise operations, (de)quantize, pooling,
  padding, concatenation and spatial means run on NHWC directly (their per-channel operands are transposed at build
  time), and a value is transposed back to NCHW only where something else reads it, and for the outputs;
  a transpose to channels-last of an NHWC value (ConvNeXt's ``permute(0, 2, 3, 1)``) is the value itself;
- a matrix product's result stays in the kernel's ``[1, 1, rows, columns]`` form (its "flat twin", rows
  padded where ``_rows`` pads them) through the element-wise operations, (de)quantize and LayerNorm that
  follow it, into the next product: the bias, dequantize, GELU and quantize after a transformer's or
  ConvNeXt's linear layer fuse into its kernel (a reshape between them stopped the fusion: each epilogue
  was a kernel of its own reading the int32 result back), and the next product reads the rows unpadded.
  The reshape to the model's shape is emitted beside it and read only where something else needs it.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, rewrite, scalar_minmax_call
from edgeq.graph_passes import dtype_of, shape_of
from edgeq.backends.cpu.common import BmmSpec, ConvSpec, Isa, Kernel
from edgeq.backends.cpu.matmul import masked_softmax_func
from edgeq.backends.cpu.resize import MODES, ResizeSpec
from edgeq.backends.cpu.rules import KERNELS
from edgeq.tvm_env import relax


TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
UNARY = {"relax.nn.relu", "relax.clip", "relax.round", "relax.astype", "relax.sigmoid", "relax.tanh",
         "relax.nn.gelu", "relax.nn.silu", "relax.exp", "relax.negative", "relax.abs", "relax.sqrt",
         "relax.floor", "relax.ceil", "relax.nn.leakyrelu", "relax.erf", "relax.nn.gelu_tanh"}
BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum"}
POOL = {"relax.nn.max_pool2d", "relax.nn.avg_pool2d"}
REDUCE = {"relax.mean", "relax.sum", "relax.max"}


def _kernel_dtypes(data: str, weight: str, out: str) -> bool:
    """float32 all through, or int8/uint8 data x int8 weights -> int32: what the conv kernels compute."""
    return (data, weight, out) == ("float32", "float32", "float32") or (data in ("int8", "uint8") and weight == "int8" and out == "int32")


def _rows(m: int, multiple: int = 8) -> int:
    """``m`` rows (or columns) of a matrix product, rounded up to a multiple of ``multiple`` where ``m`` has
    no divisor from 4 to 16 to tile by: ViT's 197 tokens (a prime) left 1 x 1 tiles, scalar code (Q @ K^T at
    2.4 GFLOP/s). The operand is zero-padded and the padding sliced off the result."""
    if m <= 16 or any(m % d == 0 for d in range(4, 17)):
        return m
    return -(-m // multiple) * multiple


def choose(problem, isa: Isa) -> tuple[Kernel, Any] | None:
    """(the first kernel of ``KERNELS`` that takes ``problem`` on ``isa``, the spec it planned), or None."""
    for kernel in KERNELS:
        if isinstance(problem, kernel.spec):
            spec = kernel.plan(problem, isa)
            if spec is not None:
                return kernel, spec
    return None


class _Lowering:
    def __init__(self, graph: Graph, isa: Isa):
        self.graph, self.isa = graph, isa
        self.outputs = set(relax.analysis.free_vars(graph.main.body.body))
        self.nhwc: set = set()  # output-graph vars that hold NHWC data of an NCHW tensor of the input graph
        self.nchw: dict = {}  # NHWC var -> its NCHW transpose, emitted once
        self.nhwc_of: dict = {}  # NCHW var -> its NHWC transpose, emitted once
        self.twin: dict = {}  # output-graph var -> (its flat twin [1, 1, rows, C], the rows that are data)
        # output-graph var -> (its padded form [batch, rows, cols], rows and cols that are data, whether the
        # other columns are zeros): attention scores and their softmax
        self.scores: dict = {}
        self.kernels = 0
        self.readers = graph.readers()  # input-graph var -> the vars of the bindings that read it
        self.folded: dict = {}  # input-graph var of a bias add folded into a kernel -> the kernel's result

    # ------------------------------------------------------------ helpers

    def to_nchw(self, rw: Rewriter, new):
        if new not in self.nhwc:
            return new
        if new not in self.nchw:
            self.nchw[new] = rw.emit(relax.op.permute_dims(new, TO_NCHW))
        return self.nchw[new]

    def to_nhwc(self, rw: Rewriter, new):
        if new in self.nhwc:
            return new
        if new not in self.nhwc_of:  # once: a residual's other operand is often a convolution's input too
            self.nhwc_of[new] = rw.emit(relax.op.permute_dims(new, TO_NHWC))
        return self.nhwc_of[new]

    def plain(self, rw: Rewriter, expr):
        """``rw.new(expr)`` with every NHWC value it reads transposed back to NCHW."""
        return rw.new(expr, lambda var: self.to_nchw(rw, var))

    def result(self, rw: Rewriter, var, new_expr, nhwc: bool):
        flat = self.flatten(rw, new_expr)
        new = rw.emit(flat[0] if flat else new_expr, var.name)
        if flat:
            self.twin[new] = flat[1]
        if nhwc:
            self.nhwc.add(new)
            if var in self.outputs:
                return self.to_nchw(rw, new)
        return new

    def channel_operand(self, rw: Rewriter, expr, ndim: int):
        """An operand broadcast against an NCHW tensor, made to broadcast against its NHWC form."""
        new = rw.new(expr)
        if new in self.nhwc:
            return new
        shape = shape_of(expr)
        if shape is None:
            return None
        if len(shape) <= 1 and (not shape or shape[0] == 1):
            return new  # a scalar
        value = rw.static_value(expr)
        if value is not None:
            full = value.reshape([1] * (ndim - value.ndim) + list(value.shape))
            return rw.const(np.ascontiguousarray(full.transpose(TO_NHWC)), str(value.dtype))
        if len(shape) == ndim == 4:
            return self.to_nhwc(rw, new)
        return None

    # ------------------------------------------------------------ flat twins

    def flat_operand(self, rw: Rewriter, arg, twin: tuple, shape: list[int]):
        """``arg`` (output graph) as an operand of the flat form of an element-wise call whose result has
        ``shape`` (flat twin ``twin``), or None where it cannot be one."""
        flat, rows = twin
        if arg in self.twin and shape_of(self.twin[arg][0]) == shape_of(flat) and self.twin[arg][1] == rows:
            return self.twin[arg][0]
        s = shape_of(arg)
        if s is None or len(s) > 4:
            return None
        if int(np.prod(s[:-1])) == 1 and (not s or s[-1] in (1, shape[-1])):
            return arg  # a scalar or one value per column: broadcasts against the flat form as it is
        if s != shape:
            return None
        out = rw.emit(relax.op.reshape(arg, [1, 1, rows, shape[-1]]))
        padded = shape_of(flat)[2]
        if padded != rows:
            out = rw.emit(relax.op.nn.pad(out, [0, 0, 0, 0, 0, padded - rows, 0, 0]))
        return out

    def flatten(self, rw: Rewriter, expr) -> tuple[Any, tuple] | None:
        """For an element-wise call (``UNARY``, ``BINARY``, (de)quantize along the last axis or by one
        scale, LayerNorm over the last axis, a reshape that keeps the last axis) of output-graph values of
        which one has a flat twin: (the model's-shape expression to bind, the result's flat twin), with the
        call itself emitted on the flat forms; None for anything else."""
        op = call_op(expr)
        if op is None or op == "relax.call_tir":
            return None
        args = list(expr.args)
        owner = next((a for a in args if isinstance(a, relax.Var) and a in self.twin), None)
        if owner is None:
            return None
        flat, rows = self.twin[owner]
        columns = shape_of(flat)[3]
        if op == "relax.reshape":
            shape = [int(d) for d in expr.args[1].values]
            if args[0].same_as(owner) and shape and shape[-1] == columns and int(np.prod(shape[:-1])) == rows:
                return relax.op.reshape(owner, shape), (flat, rows)
            return None
        shape = shape_of(owner)
        if shape is None or shape[-1] != columns:
            return None
        last = len(shape) - 1
        attrs = expr.attrs
        if op in UNARY:
            new = relax.Call(expr.op, [flat, *args[1:]], attrs, expr.ty_args)
        elif op in BINARY:
            ops = [self.flat_operand(rw, a, (flat, rows), shape) for a in args]
            if any(o is None for o in ops):
                return None
            new = relax.Call(expr.op, ops, attrs, expr.ty_args)
        elif op in ("relax.quantize", "relax.dequantize") and args[0].same_as(owner):
            per_column = int(attrs.axis) % len(shape) == last
            if not per_column and any(int(np.prod(shape_of(a) or [0])) != 1 for a in args[1:]):
                return None
            fn = relax.op.quantize if op == "relax.quantize" else relax.op.dequantize
            new = fn(flat, args[1], args[2], axis=3, out_dtype=str(attrs.out_dtype))
        elif op == "relax.nn.layer_norm" and args[0].same_as(owner):
            if [int(a) % len(shape) for a in attrs.axes] != [last]:
                return None
            new = relax.op.nn.layer_norm(flat, args[1], args[2], axes=[3], epsilon=float(attrs.epsilon),
                                         center=bool(attrs.center), scale=bool(attrs.scale))
        else:
            return None
        out = rw.emit(new)
        return self.unpad(rw, out, rows, columns, shape), (out, rows)

    # ------------------------------------------------------------ kernels

    def conv(self, rw: Rewriter, var, value):
        a = value.attrs
        if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
            return None
        x, w = value.args
        wv = rw.array(w)
        xs, ys = shape_of(x), shape_of(var)
        if wv is None or xs is None or ys is None or len(xs) != 4:
            return None
        xd = dtype_of(x)
        if not _kernel_dtypes(xd, str(wv.dtype), dtype_of(var)):
            return None
        n, c, h, width = xs
        oc, icg, kh, kw = wv.shape
        groups = int(a.groups)
        depthwise = groups == c == oc and icg == 1 and groups > 1
        if c % groups or oc % groups or icg != c // groups:
            return None
        spec = ConvSpec(n, h, width, c, oc, kh, kw, tuple(int(s) for s in a.strides), tuple(int(p) for p in a.padding),
                        tuple(int(d) for d in a.dilation), xd, depthwise, groups=1 if depthwise else groups)
        ocp = self.padded_channels(spec)
        chosen = choose(dataclasses.replace(spec, oc=ocp), self.isa)
        if chosen is None:
            return None
        name = w.name if isinstance(w, relax.Var) else f"{var.name}_w"  # a constant weight: named after its layer
        limit = chosen[0].starts(chosen[1]) if chosen[0].starts else 0.0
        bias = self.bias_after(rw, var, oc, 1, limit) if limit else None
        start = None if bias is None else np.pad(bias[0], (0, ocp - oc))
        weight = wv
        if ocp != oc:
            weight = np.zeros((ocp, *wv.shape[1:]), wv.dtype)
            weight[:oc] = wv
        x_nhwc = self.to_nhwc(rw, rw.new(x))
        regions = _tap_regions(chosen[1]) if chosen[0].name == "conv" else None
        if regions is not None:
            y = self.regions(rw, chosen, regions, x_nhwc, weight, name, start)
        else:
            y = self.kernel(rw, None, chosen, x_nhwc, weight, name, start, emit=False)
        if ocp != oc:
            y = relax.op.strided_slice(rw.emit(y), [3], [0], [oc])
        out = self.result(rw, var, y, nhwc=True)
        if bias is not None:
            self.folded[bias[1]] = out
        return out

    def regions(self, rw: Rewriter, chosen: tuple[Kernel, ConvSpec], regions: tuple[list, list], x_nhwc,
                weight: np.ndarray, name: str, start: np.ndarray | None):
        """A convolution computed region by region (``_tap_regions``): each region of the output reads the
        input rectangle its taps reach, without padding, through one packed weight that every region
        shares; the regions are concatenated along the width, then the height."""
        kernel, spec = chosen
        (kh, kw), (sh, sw), (dh, dw) = (spec.kh, spec.kw), spec.stride, spec.dilation
        pt, pl = spec.padding[0], spec.padding[1]
        one = len(regions[0]) * len(regions[1]) == 1
        bands = []
        for y0, y1, r0, r1 in regions[0]:
            row = []
            for x0, x1, c0, c1 in regions[1]:
                top, left = y0 * sh + r0 * dh - pt, x0 * sw + c0 * dw - pl
                bottom, right = (y1 - 1) * sh + r1 * dh - pt + 1, (x1 - 1) * sw + c1 * dw - pl + 1
                part = x_nhwc
                if (top, left, bottom, right) != (0, 0, spec.h, spec.w):
                    part = rw.emit(relax.op.strided_slice(x_nhwc, [1, 2], [top, left], [bottom, right]))
                region = dataclasses.replace(spec, h=bottom - top, w=right - left, kh=r1 - r0 + 1, kw=c1 - c0 + 1,
                                             padding=(0, 0, 0, 0), taps=(kh, kw, r0, c0))
                row.append(self.kernel(rw, None, (kernel, region), part, weight, name, start, emit=not one))
            bands.append(row)
        if one:
            return bands[0][0]
        rows = [row[0] if len(row) == 1 else relax.op.concat(row, axis=2) for row in bands]
        if len(rows) == 1:
            return rows[0]
        return relax.op.concat([r if isinstance(r, relax.Var) else rw.emit(r) for r in rows], axis=1)

    def bias_after(self, rw: Rewriter, var, channels: int, axis: int, limit: float):
        """(the constant, one per channel along ``axis`` and at most ``limit`` in magnitude, that the only
        reader of ``var`` adds to it, that reader's var), or None: the kernel starts its accumulators from
        it (``Kernel.starts``)."""
        readers = self.readers.get(var, [])
        shape = shape_of(var)
        if var in self.outputs or len(readers) != 1 or shape is None:
            return None
        add = readers[0]
        value = rw.value(add)
        dtype = dtype_of(var)
        if call_op(value) != "relax.add" or dtype not in ("int32", "float32") or dtype_of(add) != dtype \
                or shape_of(add) != shape:
            return None
        others = [a for a in value.args if not a.same_as(var)]
        bias = rw.static_value(others[0]) if len(others) == 1 else None
        if bias is None or str(bias.dtype) != dtype or bias.ndim > len(shape) or not np.isfinite(bias).all() \
                or (bias.size and float(np.abs(bias).max()) > limit):
            return None
        bias = bias.reshape([1] * (len(shape) - bias.ndim) + list(bias.shape))
        axis %= len(shape)
        if any(d != 1 for i, d in enumerate(bias.shape) if i != axis) or bias.shape[axis] not in (1, channels):
            return None
        return np.broadcast_to(bias.reshape(-1), (channels,)), add

    def padded_channels(self, spec: ConvSpec) -> int:
        """Output channels to compute: a dense convolution whose channels do not fill whole vectors, over
        enough pixels to matter, computes them rounded up to whole vectors (zero weights) and the result is
        sliced (SqueezeNet's 1000-class 1x1 convolution on 13x13: blocks of 8 lanes, 43% of the model)."""
        lanes = self.isa.lanes
        if spec.depthwise or spec.groups != 1 or spec.oc % lanes == 0 or spec.oh * spec.ow < 16:
            return spec.oc
        if spec.oc < 16 * lanes:
            # narrower layers in blocks of at least half a vector (MobileNet's 72, 120) stay: the slice would
            # cost what it saves; a segmentation head's 21 classes went in blocks of 7 lanes (LR-ASPP's
            # 1x1 128 -> 21 on 28x28: 53 us, 35 us as 32 channels and a slice)
            if self.isa.vector_block(spec.oc) >= lanes // 2:
                return spec.oc
            return -(-spec.oc // lanes) * lanes
        for block in (2 * lanes, lanes):  # two vectors per tile where that adds at most 1/16 of the work
            padded = -(-spec.oc // block) * block
            if padded - spec.oc <= spec.oc // 16:
                return padded
        return -(-spec.oc // lanes) * lanes

    def matmul(self, rw: Rewriter, var, value):
        x = value.args[0]
        w_var, transposed = rw.weight_operand(value)
        xs, ys = shape_of(x), shape_of(var)
        if w_var is None:
            return self.batched_matmul(rw, var, value)
        if xs is None or ys is None or len(xs) < 2:
            return None
        wv = rw.weight(w_var)
        w = wv.T if transposed else wv  # [K, N]
        if w.ndim != 2:
            return None
        xd = dtype_of(x)
        if not _kernel_dtypes(xd, str(w.dtype), dtype_of(var)):
            return None
        k, cols = w.shape
        m = int(np.prod(xs[:-1]))
        mp = _rows(m)
        chosen = choose(ConvSpec(1, 1, mp, k, cols, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), xd), self.isa)
        if chosen is None:
            return None
        xn = rw.new(x)
        twin = self.twin.get(xn) if xn not in self.nhwc else None
        if twin is not None and twin[1] == m and shape_of(twin[0]) == [1, 1, mp, k]:
            x4 = twin[0]  # the previous product's rows, as its kernel left them (padding rows and all)
        else:
            x4 = rw.emit(relax.op.reshape(self.plain(rw, x), [1, 1, m, k]))
            if mp != m:
                x4 = rw.emit(relax.op.nn.pad(x4, [0, 0, 0, 0, 0, mp - m, 0, 0]))
        y4 = self.kernel(rw, None, chosen, x4, np.ascontiguousarray(w.T).reshape(cols, k, 1, 1), w_var.name + "_t")
        new = rw.emit(self.unpad(rw, y4, m, cols, ys), var.name)
        self.twin[new] = (y4, m)
        return new

    def batched_matmul(self, rw: Rewriter, var, value):
        """``a @ b`` of two activations (same batch dims, float32) on the kernel that takes a ``BmmSpec``.
        Its result is also kept in the kernel's padded shape (``self.scores``) for a softmax that follows
        (``masked_softmax``), and a softmax so kept is read as it is, padded, by the next product."""
        a, b = value.args
        sa, sb, ys = shape_of(a), shape_of(b), shape_of(var)
        if sa is None or sb is None or ys is None or len(sa) < 2 or len(sa) != len(sb) or sa[:-2] != sb[:-2]:
            return None
        if {dtype_of(a), dtype_of(b), dtype_of(var)} != {"float32"}:
            return None
        batch = int(np.prod(sa[:-2])) if len(sa) > 2 else 1
        m, k, n = sa[-2], sa[-1], sb[-1]
        mp, np_ = _rows(m), _rows(n, 16)
        kept = self.scores.get(rw.new(a))
        if kept is not None and not (kept[3] and kept[1:3] == (m, k) and shape_of(kept[0])[:2] == [batch, mp]):
            kept = None
        kp = shape_of(kept[0])[2] if kept is not None else k
        chosen = choose(BmmSpec(batch, mp, kp, np_), self.isa)
        if chosen is None:
            return None
        kernel, spec = chosen
        func, _ = kernel.build(spec)
        gv = rw.bb.add_func(func.without_attr("global_symbol"), kernel.symbol)
        if kept is not None:
            a3 = kept[0]  # the softmax's padded columns are zeros: they meet the zero rows padded onto b
        else:
            a3 = rw.emit(relax.op.reshape(self.plain(rw, a), [batch, m, k]))
            if mp != m:
                a3 = rw.emit(relax.op.nn.pad(a3, [0, 0, 0, mp - m, 0, 0]))
        b3 = rw.emit(relax.op.reshape(self.plain(rw, b), [batch, k, n]))
        if (kp, np_) != (k, n):
            b3 = rw.emit(relax.op.nn.pad(b3, [0, 0, 0, kp - k, 0, np_ - n]))
        y3 = rw.emit(relax.call_tir(gv, relax.Tuple([a3, b3]), relax.TensorType([batch, mp, np_], "float32")))
        self.kernels += 1
        new = rw.emit(self.unpad(rw, y3, m, n, ys), var.name)
        self.scores[new] = (y3, m, n, False)
        return new

    def unpad(self, rw: Rewriter, padded, m: int, n: int, shape: list[int]):
        """``padded[..., :m, :n]`` (a kernel's result in its padded tile: a flat twin, attention scores)
        reshaped to ``shape``, the model's; only the axes that are padded are sliced."""
        size = shape_of(padded)
        axes = [ax for ax, end in ((len(size) - 2, m), (len(size) - 1, n)) if size[ax] != end]
        if axes:
            ends = [m if ax == len(size) - 2 else n for ax in axes]
            padded = rw.emit(relax.op.strided_slice(padded, axes, [0] * len(axes), ends))
        return relax.op.reshape(padded, shape)

    def softmax(self, rw: Rewriter, var, value):
        """A softmax along the last axis of attention scores kept padded (``batched_matmul``): computed on the
        padded tile over the columns that are data, zeros in the others (``matmul.masked_softmax_func``)."""
        x = rw.new(value.args[0])
        shape = shape_of(var)
        kept = self.scores.get(x)
        if kept is None or shape is None or int(value.attrs.axis) % len(shape) != len(shape) - 1:
            return None
        padded, m, n, _ = kept
        batch, rows, cols = shape_of(padded)
        gv = rw.bb.add_func(masked_softmax_func(batch, rows, cols, n).without_attr("global_symbol"), "edgeq_softmax")
        out = rw.emit(relax.call_tir(gv, relax.Tuple([padded]), relax.TensorType([batch, rows, cols], "float32")))
        new = rw.emit(self.unpad(rw, out, m, n, shape), var.name)
        self.scores[new] = (out, m, n, True)
        return new

    def resize(self, rw: Rewriter, var, value):
        """A bilinear resize of a float32 NCHW tensor (``resize.py``): read NHWC where the input is held so,
        written NHWC where it is not a model output."""
        a = value.attrs
        x = rw.new(value.args[0])
        xs, ys = shape_of(value.args[0]), shape_of(var)
        if str(a.method) != "linear" or str(a.layout) != "NCHW" or str(a.coordinate_transformation_mode) not in MODES \
                or xs is None or ys is None or len(xs) != 4 or dtype_of(value.args[0]) != "float32" \
                or dtype_of(var) != "float32" or xs[:2] != ys[:2]:
            return None  # (tf_crop_and_resize may extrapolate: TVM's)
        nhwc = x in self.nhwc
        if xs[2:] == [1, 1]:  # from one value per channel (DeepLabV3's image pooling): a broadcast
            n, c, oh, ow = ys
            return self.result(rw, var, relax.op.broadcast_to(x, [n, oh, ow, c] if nhwc else ys), nhwc)
        out = var in self.outputs or any(r in self.outputs for r in self.readers.get(var, []))
        spec = ResizeSpec(xs[0], xs[1], xs[2], xs[3], ys[2], ys[3], str(a.coordinate_transformation_mode), nhwc,
                          nhwc and not out)
        chosen = choose(spec, self.isa)
        if chosen is None:
            return None
        func, _ = chosen[0].build(chosen[1])
        gv = rw.bb.add_func(func.without_attr("global_symbol"), chosen[0].symbol)
        shape = [ys[0], ys[2], ys[3], ys[1]] if spec.nhwc_out else ys
        return self.result(rw, var, relax.call_tir(gv, relax.Tuple([x]), relax.TensorType(shape, "float32")),
                           spec.nhwc_out)

    def kernel(self, rw: Rewriter, var, chosen: tuple[Kernel, ConvSpec], x_nhwc, weight: np.ndarray, name: str,
               start: np.ndarray | None = None, emit: bool = True):
        """The call of a convolution kernel (``choose``) on NHWC data, its weight packed and named after
        the layout (``Kernel.tag``); ``start``: a bias per output channel, added to the kernel's start
        values (``Kernel.starts``). Emitted (as ``var``'s result where given), or the call itself."""
        kernel, spec = chosen
        func, pack = kernel.build(spec)
        arrays = pack(weight)
        names = [f"{name}_{kernel.tag(spec)}_{i}" for i in range(len(arrays))]
        if start is not None:
            wide = np.int64 if np.issubdtype(arrays[-1].dtype, np.integer) else np.float64
            arrays[-1] = (arrays[-1].astype(wide) + start.astype(wide)).astype(arrays[-1].dtype)
            names[-1] = f"{name}_{kernel.tag(spec)}_b{zlib.crc32(start.tobytes()):08x}_{len(arrays) - 1}"  # per bias
        params = [rw.param(n, arr) for n, arr in zip(names, arrays)]
        gv = rw.bb.add_func(func.without_attr("global_symbol"), kernel.symbol)
        out = relax.TensorType([spec.n, spec.oh, spec.ow, spec.oc], spec.out_dtype)
        call = relax.call_tir(gv, relax.Tuple([x_nhwc, *params]), out)
        self.kernels += 1
        if not emit:
            return call
        if var is None:
            return rw.emit(call)
        return self.result(rw, var, call, nhwc=True)

    # ------------------------------------------------------------ layout-following operations

    def follow(self, rw: Rewriter, var, value):
        op = call_op(value)
        args = value.args
        if op == "relax.call_tir":
            found = scalar_minmax_call(self.graph.mod, value)
            if found is None or (rw.new(found[1]) not in self.nhwc and rw.new(found[1]) not in self.twin):
                return None
            kind, x, bound = found
            fn = relax.op.maximum if kind == "maximum" else relax.op.minimum
            value = rw.static_value(bound)
            operand = rw.const(value.reshape(()), str(value.dtype)) if value is not None else rw.new(bound)
            return self.result(rw, var, fn(rw.new(x), operand), rw.new(x) in self.nhwc)
        if op == "relax.concat":
            return self.concat(rw, var, value)
        if op == "relax.permute_dims":
            return self.permute(rw, var, value)
        if not args or not any(rw.new(a) in self.nhwc for a in args if isinstance(a, relax.Var)):
            return None
        if op in UNARY:
            return self.result(rw, var, relax.Call(value.op, [rw.new(args[0]), *args[1:]], value.attrs, value.ty_args), True)
        if op in BINARY:
            ndim = len(shape_of(var) or [])
            ops = [self.channel_operand(rw, a, ndim) for a in args]
            if ndim != 4 or any(o is None for o in ops):
                return None
            return self.result(rw, var, relax.Call(value.op, ops, value.attrs, value.ty_args), True)
        if op in ("relax.quantize", "relax.dequantize") and rw.new(args[0]) in self.nhwc:
            if any(rw.new(a) in self.nhwc for a in args[1:]):
                return None
            axis = int(value.attrs.axis) % 4
            axis = {0: 0, 1: 3, 2: 1, 3: 2}[axis]
            fn = relax.op.quantize if op == "relax.quantize" else relax.op.dequantize
            return self.result(rw, var, fn(rw.new(args[0]), rw.new(args[1]), rw.new(args[2]), axis=axis,
                                           out_dtype=str(value.attrs.out_dtype)), True)
        if op in POOL and value.attrs.layout == "NCHW" and (value.attrs.out_layout in (None, "NCHW")):
            a = value.attrs
            fn = relax.op.nn.max_pool2d if op == "relax.nn.max_pool2d" else relax.op.nn.avg_pool2d
            return self.result(rw, var, fn(rw.new(args[0]), [int(p) for p in a.pool_size], [int(s) for s in a.strides],
                                           [int(p) for p in a.padding], [int(d) for d in a.dilation], bool(a.ceil_mode),
                                           bool(a.count_include_pad), layout="NHWC", out_layout="NHWC"), True)
        if op in REDUCE and value.attrs.axis is not None:
            axes = sorted(int(ax) % 4 for ax in value.attrs.axis)
            if axes != [2, 3]:
                return None
            keep = bool(value.attrs.keepdims)
            fn = {"relax.mean": relax.op.mean, "relax.sum": relax.op.sum, "relax.max": relax.op.max}[op]
            return self.result(rw, var, fn(rw.new(args[0]), axis=[1, 2], keepdims=keep), keep)
        if op == "relax.nn.pad" and str(value.attrs.pad_mode) == "constant":
            width = [int(p) for p in value.attrs.pad_width]
            if len(width) != 8:
                return None
            nhwc = width[0:2] + width[4:6] + width[6:8] + width[2:4]
            return self.result(rw, var, relax.op.nn.pad(rw.new(args[0]), nhwc, pad_value=float(value.attrs.pad_value)), True)
        return None

    def concat(self, rw: Rewriter, var, value):
        """A concat of 4-d tensors of which one at least is NHWC (SqueezeNet's fire modules, DenseNet's
        feature stacks, Inception's branches) concatenates NHWC; the others are transposed to it."""
        tup = value.args[0]
        if isinstance(tup, relax.Var):
            tup = rw.value(tup)
        if not isinstance(tup, relax.Tuple) or len(shape_of(var) or []) != 4:
            return None
        if any(len(shape_of(f) or []) != 4 for f in tup.fields):
            return None
        fields = [rw.new(f) for f in tup.fields]
        if not any(f in self.nhwc for f in fields):
            return None
        axis = {0: 0, 1: 3, 2: 1, 3: 2}[int(value.attrs.axis) % 4]
        fields = [self.to_nhwc(rw, f) for f in fields]
        return self.result(rw, var, relax.op.concat(fields, axis=axis), True)

    def permute(self, rw: Rewriter, var, value):
        """A transpose to channels-last of an NHWC value is that value (ConvNeXt's ``permute(0, 2, 3, 1)``
        around its LayerNorm and MLP), and one back to channels-first makes an NHWC value again: both are
        the data as it is (a same-shape reshape binds it to a variable of its own), not a transpose."""
        x = rw.new(value.args[0])
        axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else None
        shape = shape_of(x)
        if shape is None or len(shape) != 4:
            return None
        if x in self.nhwc and axes == TO_NHWC:
            return self.result(rw, var, relax.op.reshape(x, shape), nhwc=False)
        if x not in self.nhwc and axes == TO_NCHW:
            return self.result(rw, var, relax.op.reshape(x, shape), nhwc=True)
        return None

    def sigmoid(self, rw: Rewriter, var, value):
        """float32 ``sigmoid(x)`` (and ``silu(x) = x sigmoid(x)``) as ``0.5 tanh(x / 2) + 0.5``: TVM's CPU code
        calls libm's ``expf`` once per lane for sigmoid, while tanh becomes ``fast_tanh``, a vectorised
        rational function, in the CPU pipeline (``relax.transform.FastMathTransform``). EfficientNet's
        SiLU epilogues took longer than their convolutions."""
        x = value.args[0]
        if dtype_of(x) != "float32" or dtype_of(var) != "float32":
            return None
        new = rw.new(x)
        half = rw.const(0.5)
        t = rw.emit(relax.op.tanh(rw.emit(relax.op.multiply(new, half))))
        s = relax.op.add(rw.emit(relax.op.multiply(t, half)), half)
        if call_op(value) == "relax.nn.silu":
            s = relax.op.multiply(new, rw.emit(s))
        return self.result(rw, var, s, new in self.nhwc)

    def visit(self, rw: Rewriter, var, value):
        if var in self.folded:  # a bias add its kernel starts from
            out = self.folded.pop(var)
            return self.to_nchw(rw, out) if var in self.outputs else out
        op = call_op(value)
        replacement = None
        if op in ("relax.sigmoid", "relax.nn.silu"):
            replacement = self.sigmoid(rw, var, value)
        if op == "relax.nn.softmax":
            replacement = self.softmax(rw, var, value)
        if op == "relax.image.resize2d":
            replacement = self.resize(rw, var, value)
        if op == "relax.nn.conv2d":
            replacement = self.conv(rw, var, value)
        elif op == "relax.matmul":
            replacement = self.matmul(rw, var, value)
        if replacement is None and op is not None:
            replacement = self.follow(rw, var, value)
        if replacement is None:
            replacement = self.plain(rw, value)
            flat = self.flatten(rw, replacement) if isinstance(replacement, relax.Call) else None
            if flat is not None:
                replacement = rw.emit(flat[0], var.name)
                self.twin[replacement] = flat[1]
        return replacement


def _bands(size: int, out: int, k: int, stride: int, dilation: int, before: int) -> list[tuple[int, int, int, int]]:
    """Along one axis of a convolution: the runs of outputs ``[y0, y1)`` whose taps ``r0 .. r1`` read the
    input (the others read padding only), in order."""
    bands: list[tuple[int, int, int, int]] = []
    for y in range(out):
        first = max(0, -((y * stride - before) // dilation))  # ceil((before - y * stride) / dilation)
        last = min(k - 1, (size - 1 + before - y * stride) // dilation)
        if bands and bands[-1][2:] == (first, last):
            bands[-1] = (bands[-1][0], y + 1, first, last)
        else:
            bands.append((y, y + 1, first, last))
    return bands


# a convolution is cut into regions where that saves at least half its multiply-adds and 2^20 of them, in at
# most this many regions (each a kernel call)
MAX_REGIONS = 9


def _tap_regions(spec: ConvSpec) -> tuple[list, list] | None:
    """The bands of rows and columns (``_bands``) of a convolution worth computing region by region: one whose
    taps mostly read padding. DeepLabV3's ASPP convolves a 14 x 14 map with 3 x 3 taps 12, 24 and 36 pixels
    apart, padded as far: at rates 24 and 36 only the centre tap ever reads the map (a 1 x 1 convolution),
    at 12 the others do only for the two rows or columns at each border. Computed whole, the three took 61%
    of the model's time (23 ms against ONNX Runtime's 9 ms for all of it, which skips the padding's taps).
    None where the convolution is computed whole."""
    if spec.depthwise or spec.taps:
        return None
    rows = _bands(spec.h, spec.oh, spec.kh, spec.stride[0], spec.dilation[0], spec.padding[0])
    cols = _bands(spec.w, spec.ow, spec.kw, spec.stride[1], spec.dilation[1], spec.padding[1])
    if any(first > last for *_, first, last in rows + cols) or len(rows) * len(cols) > MAX_REGIONS:
        return None
    taps = sum((y1 - y0) * (r1 - r0 + 1) for y0, y1, r0, r1 in rows) * \
        sum((x1 - x0) * (c1 - c0 + 1) for x0, x1, c0, c1 in cols)
    whole = spec.oh * spec.kh * spec.ow * spec.kw
    saved = (whole - taps) * spec.n * spec.oc * spec.cg
    if 2 * taps > whole or saved < (1 << 20):
        return None
    return rows, cols


def lower_for_cpu(graph: Graph, isa: Isa) -> tuple[Graph, int]:
    """(graph on edgeq's CPU kernels, number of kernel calls)."""
    lowering = _Lowering(graph, isa)
    out = rewrite(graph, lowering.visit)
    return out, lowering.kernels


def describe(graph: Graph) -> dict[str, Any]:
    """Which kernels a lowered graph calls, by name, for reports."""
    counts: dict[str, int] = {}
    for b in graph.bindings():
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir":
            name = b.value.args[0].name_hint
            counts[name] = counts.get(name, 0) + 1
    return counts
