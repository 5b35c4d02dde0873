"""The Relax helpers every pass that matches chains in ``main`` shares (``main_index``, ``only_reader_of``, constants,
views, activations), and ``Claimed``: a chain a kernel took with the variables of its operands.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from edgeq.backends.cuda.cutlass.kernels import ConvKernel, DepthwiseKernel, GemmKernel, TokenLinearKernel


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A convolution chain the CUTLASS kernel took: its kernel, and the Relax variables of its operands."""

    kernel: ConvKernel
    output: object  # the chain's last variable: its binding becomes the call
    x: object
    w: object
    bias: object
    residual: object | None
    chain: tuple  # the chain's other variables, from the conv2d on: their bindings go
    shapes: dict  # the per-channel operands' shapes as the graph holds them: {"bias": (1, 1, 1, K), ...}
    scale: object = None  # int8: the per-channel float32 scale and shift (a constant or a weight; shift may be None)
    shift: object = None
    post: object = None  # int8: the per-channel multiplier after the clamps (``ConvKernel.post``)
    y_in: object = None  # ``ConvKernel.out_in_place``: the tensor the kernel writes its channels of, as it comes in
    up_in: object = None  # ``ConvKernel.up_view``: the tensor its upsampled copy goes into, as it comes in
    token: object = None  # ``TokenLinearKernel``: the per-token scales ([..., M, 1], computed at run time)

    def operands(self) -> list:
        """The Relax arguments of the kernel's call, in ``kernel_operands`` order (without y)."""
        from edgeq.tvm_env import relax

        residual = [self.residual] if self.residual is not None else []
        if isinstance(self.kernel, GemmKernel):
            return [self.x, self.w]
        k = self.kernel.problem.k
        if isinstance(self.kernel, TokenLinearKernel):
            bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.float32), "float32")
            return [self.x, self.w, self.scale, self.token, bias] + residual
        if self.kernel.precision != "int8":
            bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.float16), "float16")
            return [self.x, self.w, bias] + residual
        bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.int32), "int32")
        shift = self.shift if self.shift is not None else relax.const(np.zeros(k, np.float32), "float32")
        post = [self.post] if self.kernel.post else []
        if isinstance(self.kernel, DepthwiseKernel):
            return [self.x, self.w, bias, self.scale, shift] + post + residual
        channel = relax.const(np.arange(k, dtype=np.float32), "float32")
        return [self.x, self.w, bias, self.scale, shift] + post + [channel] + residual


def const_scalar(expr, value_of=None) -> float | None:
    """A one-element constant's value, also behind a variable bound to an astype of one (how ToMixedPrecision
    leaves a clip's bounds)."""
    from edgeq.graph import call_op, const_value

    if value_of is not None and expr in value_of and call_op(value_of[expr]) == "relax.astype":
        expr = value_of[expr].args[0]
    value = const_value(expr)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def is_constant(expr) -> bool:
    """Is ``expr`` a constant tensor of at least one axis (an operand an outlined kernel takes as it is)?"""
    from edgeq.graph import const_value

    value = const_value(expr)
    return value is not None and value.ndim > 0


def main_index(main) -> tuple[list, dict, dict, set]:
    """What a pass matching chains in ``main`` looks up: its bindings in order, {var: bound value}, {var: the vars
    of the bindings that read it, None for main's output}, and its weight parameters."""
    bindings = [b for block in main.body.blocks for b in block.bindings]
    value_of = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for v in set(_free_vars(b.value)):
            readers.setdefault(v, []).append(b.var)
    for v in _free_vars(main.body.body):
        readers.setdefault(v, []).append(None)
    return bindings, value_of, readers, set(main.params[int(main.attrs["num_input"]):])


def only_reader_of(readers: dict):
    """``only_reader(var)`` over ``readers`` ({var: the vars of the bindings that read it, None for the function's
    output}: ``main_index``'s or ``Graph.readers``): the one binding that reads ``var``, None where several do or
    the output does."""
    def only_reader(var):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None else None
    return only_reader


def is_depthwise(attrs, xs, ws) -> bool:
    """Whether a conv2d is one ``DepthwiseKernel`` takes: NHWC, HWOI weights [R, S, K, 1] (``_depthwise_hwoi``),
    groups = input channels = output channels."""
    groups = int(attrs.groups)
    return (attrs.data_layout == "NHWC" and attrs.kernel_layout == "HWOI" and groups > 1 and xs is not None
            and ws is not None and ws[3] == 1 and ws[2] == groups == xs[3])


def silu_of(var, readers, value_of, only_reader) -> list | None:
    """[sigmoid, multiply] where ``var``'s two readers are ``s = sigmoid(var)`` and ``var * s`` (SiLU as exporters
    write it, x * sigmoid(x)), else None."""
    from edgeq.graph import call_op

    rs = readers.get(var, [])
    if len(rs) != 2 or None in rs:
        return None
    sig = next((r for r in rs if call_op(value_of[r]) == "relax.sigmoid"), None)
    mul = next((r for r in rs if call_op(value_of[r]) == "relax.multiply"), None)
    if sig is None or mul is None or not same(only_reader(sig), mul):
        return None
    args = value_of[mul].args
    if not ((args[0].same_as(var) and args[1].same_as(sig)) or (args[0].same_as(sig) and args[1].same_as(var))):
        return None
    return [sig, mul]


def gelu_of(var, readers, value_of, only_reader) -> list | None:
    """The bindings of GELU's erf form on ``var`` (x * 0.5 * (1 + erf(x / sqrt(2))) as exporters write it: PyTorch's
    ``nn.GELU``, BERT's FFN), else None: ``var``'s two readers are the erf branch, ``x * (1/sqrt(2))`` or ``x /
    sqrt(2)`` -> erf -> + 1, and the half, ``x * 0.5`` times that branch or ``x`` times it then times 0.5."""
    from edgeq.graph import call_op

    def scalar(expr, want):
        got = const_scalar(expr, value_of)
        return got is not None and abs(got - want) <= 1e-3 * abs(want)

    def other(call, this):
        args = [a for a in value_of[call].args if not a.same_as(this)]
        return args[0] if len(args) == 1 else None

    def reader(v, op):
        r = only_reader(v)
        return r if r is not None and call_op(value_of[r]) == op else None

    rs = readers.get(var, [])
    if len(rs) != 2 or None in rs:
        return None
    for scaled, half in (rs, rs[::-1]):
        op = call_op(value_of[scaled])
        if not (op == "relax.multiply" and scalar(other(scaled, var), 1 / math.sqrt(2))
                or op == "relax.divide" and value_of[scaled].args[0].same_as(var)
                and scalar(value_of[scaled].args[1], math.sqrt(2))):
            continue
        erf = reader(scaled, "relax.erf")
        one_plus = reader(erf, "relax.add") if erf is not None else None
        if one_plus is None or not scalar(other(one_plus, erf), 1.0) or call_op(value_of[half]) != "relax.multiply":
            continue
        if scalar(other(half, var), 0.5):  # (x * 0.5) * (1 + erf)
            final = reader(half, "relax.multiply")
            if final is not None and same(only_reader(one_plus), final) and other(final, half).same_as(one_plus):
                return [scaled, erf, one_plus, half, final]
        elif other(half, var) is not None and other(half, var).same_as(one_plus):  # (x * (1 + erf)) * 0.5
            final = reader(half, "relax.multiply")
            if final is not None and scalar(other(final, half), 0.5):
                return [scaled, erf, one_plus, half, final]
    return None


def quantize_tail(divide, value_of, readers):
    """((rounded, low, high), the int8 cast, (lo, hi)) where ``divide`` is read only by ``round``, then
    ``maximum(., lo)``, ``minimum(., hi)`` and ``astype(int8)``, each by the next only, lo and hi constants in
    [-128, 127]; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of

    def only_reader(var, op):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None and call_op(value_of[r[0]]) == op else None

    rounded = only_reader(divide, "relax.round")
    low = only_reader(rounded, "relax.maximum") if rounded is not None else None
    high = only_reader(low, "relax.minimum") if low is not None else None
    cast = only_reader(high, "relax.astype") if high is not None else None
    if cast is None or dtype_of(cast) != "int8":
        return None
    lo, hi = const_scalar(value_of[low].args[1]), const_scalar(value_of[high].args[1])
    if lo is None or hi is None or not -128 <= lo <= hi <= 127:
        return None
    return (rounded, low, high), cast, (lo, hi)


def last_axis_slice(var, value_of) -> tuple | None:
    """(T, begin, end) where ``var`` is ``strided_slice(T, [last axis], [begin], [end])`` with step 1 and
    0 <= begin < end <= T's last extent; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.strided_slice":
        return None

    def ints(expr):  # strided_slice's axes, begin, end and strides: tuples of PrimValues
        fields = getattr(expr, "fields", expr)
        return [int(getattr(f, "value", f)) for f in fields]

    t, axes, begin, end = value.args[0], ints(value.args[1]), ints(value.args[2]), ints(value.args[3])
    shape = shape_of(t)
    if shape is None or len(axes) != 1 or axes[0] % len(shape) != len(shape) - 1 or (
            len(value.args) > 4 and any(v != 1 for v in ints(value.args[4]))):
        return None
    first, last = (v + shape[-1] if v < 0 else v for v in (begin[0], end[0]))
    last = min(last, shape[-1])
    return (t, first, last) if 0 <= first < last else None


def output_shape(out, problem) -> dict:
    """``{"y": shape}`` where the chain's output has another shape than the problem's NPQK (a reshape the chain went
    through: the same elements in the same order), else {}."""
    from edgeq.graph_passes import shape_of

    shape = tuple(int(d) for d in shape_of(out))
    return {} if shape == (problem.n, problem.p, problem.q, problem.k) else {"y": shape}


def same(a, b) -> bool:
    return a is not None and b is not None and a.same_as(b)


def channels_padded(x, value_of) -> int:
    """The zero channels ``prepare_nhwc`` added to a convolution's input (a pad on the last axis, maybe behind
    ToMixedPrecision's cast), so that FLOPs count the model's channels only."""
    from edgeq.graph import call_op

    value = value_of.get(x)
    if call_op(value) == "relax.astype":
        value = value_of.get(value.args[0])
    if call_op(value) != "relax.nn.pad":
        return 0
    widths = [int(v) for v in value.attrs.pad_width]
    return widths[-1] if not any(widths[:-1]) else 0


def tensor_type(var):
    return getattr(var, "struct_info", None) or var.ty


def _free_vars(expr):
    from edgeq.tvm_env import relax

    return relax.analysis.free_vars(expr)
