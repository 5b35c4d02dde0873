"""What edgeq asks each kernel to compute (frozen descriptions: ``ConvKernel`` and its depthwise, grouped and
per-token linear kinds, ``GemmKernel``), the CUTLASS template each one instantiates, and its operands in the
order its TIR function and device wrapper take them (``kernel_operands``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np

from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, ALIGNMENT_INT8, Conv2dProblem, GemmProblem

if TYPE_CHECKING:
    from edgeq.backends.cuda.cutlass.tiles import Tile


ACTIVATIONS = {  # name -> CUTLASS elementwise functor on float (edgeq's own where CUTLASS has none)
    "identity": "cutlass::epilogue::thread::Identity<float>",
    "relu": "cutlass::epilogue::thread::ReLu<float>",
    "relu6": "edgeq_cutlass::Relu6",
    "silu": "cutlass::epilogue::thread::SiLu<float>",
    "hardswish": "cutlass::epilogue::thread::HardSwish<float>",
    "gelu": "cutlass::epilogue::thread::GELU<float>",
}


@dataclasses.dataclass(frozen=True)
class ConvKernel:
    """What edgeq asks one CUTLASS convolution to compute. fp16: ``act(conv(x, w) + residual + bias)``. int8 (s8 x s8
    -> s32, the ``Requantize`` epilogue): ``clamp(round((silu?(float(conv + bias) * scale + shift) [+ residual x
    residual_scale]) clamped to [act_lo, act_hi] [x post]) / out_div), lo, hi)`` to int8, ``bias`` int32 and ``scale`` float32
    per output channel."""

    name: str  # a C identifier, unique in its module (the TVM function is cutlass_<name>)
    problem: Conv2dProblem
    tile: Tile
    activation: str = "identity"  # int8: what [act_lo, act_hi] is (identity, relu, relu6 or clip), for people
    residual: bool = False
    precision: str = "fp16"
    residual_scale: float = 0.0  # int8: the epilogue's constants
    act_lo: float = -math.inf  # the activation as a clamp before the division
    act_hi: float = math.inf
    out_div: float = 1.0
    lo: float = -128.0  # the clamp after rounding
    hi: float = 127.0
    float_out: bool = False  # float32 output. int8: the value before the division (no quantize follows); fp16: the
    # epilogue's value unrounded (the graph casts the layer's output to float32: a classifier's logits)
    silu: bool = False  # int8: v * sigmoid(v) right after the scale and shift (before the residual and clamps)
    post: bool = False  # int8: v * post[k] (a per-channel float32 operand) after the clamps, before the division
    # x read in place from a wider tensor (a channel slice: one part of a split, ``pipeline.splits_as_slices``):
    # (first channel, channels of the tensor); the problem's C is the slice's
    x_view: tuple[int, int] | None = None
    # int8: the residual's dtype where it is not the output's ("float32": another int8 layer's float output, a
    # downsampling shortcut's; "int8" into a float output); "": the output's
    residual_dtype: str = ""
    # fp16: the residual added after the activation, ``act(conv + bias) + residual`` (YOLO's bottleneck,
    # ``x + SiLU(conv(x))``; edgeq's ``BiasActResidual`` epilogue), not before it
    residual_after: bool = False
    # fp16: the bias float32 (an fp16 layer of an int8 graph, ``quantize_ops``: its product float32 out, the graph's
    # float32 bias and residual stream after it), the epilogue's broadcast vector in float
    float_bias: bool = False
    # y written in place into a wider tensor (a channel slice of a concatenation, ``concat_in_place``): (first
    # channel, channels of the tensor); the problem's K is the slice's. ``out_in_place``: the tensor comes in as the
    # y operand, already holding other parts (``call_tir_inplace``); else the call allocates it
    out_view: tuple[int, int] | None = None
    out_in_place: bool = False
    residual_view: tuple[int, int] | None = None  # the residual read in place from a wider tensor, as x_view
    # y also written nearest-upsampled 2x into channels [first, first + K) of an [N, 2P, 2Q, channels] tensor that
    # comes in (``call_tir_inplace``: a concatenation's part, YOLO's neck; ``Upsample2xIterator``): (first,
    # channels)
    up_view: tuple[int, int] | None = None
    # y is a detector's output [N, channels, anchors] (the exporter's NCHW transpose, flattening and concatenations):
    # the kernel writes channels [first, first + K) at anchors [anchor, anchor + P Q) (``ChannelMajorIterator``), in
    # ``dtype``: (first, anchor, channels, anchors, dtype)
    head_out: tuple[int, int, int, int, str] | None = None

    @property
    def residual_type(self) -> str:
        """The residual operand's dtype."""
        return self.residual_dtype or self.output_dtype

    @property
    def output_dtype(self) -> str:
        if self.float_out:
            return "float32"
        return "int8" if self.precision == "int8" else "float16"

    @property
    def bias_dtype(self) -> str:
        """int8: int32; fp16: float16, or float32 where the graph adds it in float32 (``float_bias``)."""
        if self.precision == "int8":
            return "int32"
        return "float32" if self.float_bias else "float16"

    @property
    def x_channels(self) -> int:
        """Channels of the tensor x is read from."""
        return self.x_view[1] if self.x_view else self.problem.c

    @property
    def function(self) -> str:
        """The name of its TVM function (and, with ``_kernel``, of its CUDA kernel)."""
        return f"cutlass_{self.name}"

    @property
    def threads(self) -> int:
        return self.tile.threads

    def __post_init__(self):
        if self.tile is not None and self.tile.split_k > 1 and not self.split_k_allowed:
            raise ValueError(f"{self.name}: split-K needs an fp16 kernel whose output holds a partial sum")

    @property
    def split_k_allowed(self) -> bool:
        """Whether serial split-K computes this kernel: an fp16 CUTLASS convolution on CUTLASS's bias-elementwise
        epilogue (which adds a slice's partial sum from the output, and the bias and activation in the last slice
        only) writing every output it makes as Z (no detector output, which only T holds)."""
        return (type(self) is ConvKernel and self.precision != "int8" and not self.residual_after
                and not self.head_out)

    @property
    def grid(self) -> tuple[int, ...]:
        """(CTAs along M, CTAs along N[, K slices]): GemmIdentityThreadblockSwizzle<1>."""
        m, n, _ = self.problem.gemm
        tiles = -(-m // self.tile.block[0]), -(-n // self.tile.block[1])
        return (*tiles, self.tile.split_k) if self.tile.split_k > 1 else tiles

    @property
    def input_alignment(self) -> int:
        """Elements per global load of x and w: 16 (128 bits) for int8, 8 (64 bits) where the input channels are a
        multiple of 8 and not of 16 (24, 40, 56 ...: no pad kernel before the layer)."""
        if self.precision != "int8":
            return ALIGNMENT
        channels = (self.problem.c, *(self.x_view or ()))
        return ALIGNMENT_INT8 if all(c % ALIGNMENT_INT8 == 0 for c in channels) else ALIGNMENT

    @property
    def int8_lanes(self) -> int:
        """Output channels one access of the int8 epilogue (``Requantize<N>``) takes: 16, so that an int8 residual is
        read and an int8 output written 128 bits at a time (#63: the H200's int8 kernels with a residual, at 8, took
        3.5x the time of those without), where K and every channel offset and width of the tensors it reads or
        writes in place are multiples of 16 and the warp tile is 64 wide (CUTLASS's epilogue thread map has no row
        iteration for 16-element accesses on the 32-wide warps of the smaller tiles: a static assertion, measured);
        else 8; 4 (16 bytes of floats) where the output or the residual is float32."""
        if "float32" in (self.output_dtype, self.residual_type):
            return 4
        channels = (self.problem.k, *(self.out_view or ()), *(self.residual_view or ()), *(self.up_view or ()))
        wide = self.tile is not None and self.tile.warp[1] >= 64
        return 16 if wide and all(c % 16 == 0 for c in channels) else 8

    @property
    def out_channels(self) -> int:
        """Channels of the tensor y is written into."""
        return self.out_view[1] if self.out_view else self.problem.k

    @property
    def kernel_type(self) -> str:
        if self.up_view:
            iterator = f"edgeq_cutlass::Upsample2x<{self.problem.q}>::Iterator"
        elif self.head_out:
            iterator = (f"edgeq_cutlass::ChannelMajor<{self.problem.p * self.problem.q}, {self.head_out[2]}, "
                        f"{self.head_out[3]}>::Iterator")
        else:
            return f"typename {self._conv_type}::Kernel"
        return f"typename edgeq_cutlass::WithT<{self._conv_type}, {iterator}>::Kernel"

    @property
    def _conv_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp

        def op(functor: str) -> str:  # an upsampled copy: the functor's output also as T; a head's: only as T
            if self.head_out:
                return f"edgeq_cutlass::ZAsT<{functor}, {C_TYPES[self.head_out[4]]}, false>"
            return f"edgeq_cutlass::ZAsT<{functor}>" if self.up_view else functor

        if self.precision == "int8":
            out, res = C_TYPES[self.output_dtype], C_TYPES[self.residual_type]
            lanes = self.int8_lanes
            return (
                "cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<"
                "int8_t, cutlass::layout::TensorNHWC, int8_t, cutlass::layout::TensorNHWC, "
                f"{res}, cutlass::layout::TensorNHWC, int32_t, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
                f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
                f"cutlass::gemm::GemmShape<16, 8, 32>, {op(f'edgeq_cutlass::Requantize<{lanes}, {out}, {res}>')}, "
                f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
                "cutlass::arch::OpMultiplyAddSaturate, cutlass::conv::IteratorAlgorithm::kOptimized, "
                f"cutlass::conv::StrideSupport::kStrided, {self.input_alignment}, {self.input_alignment}>"
            )
        out, lanes = ("float", 4) if self.float_out else ("cutlass::half_t", ALIGNMENT)  # 16-byte stores
        bias = "float" if self.bias_dtype == "float32" else "cutlass::half_t"
        epilogue = (f"edgeq_cutlass::BiasActResidual<{lanes}, {ACTIVATIONS[self.activation]}>" if self.residual_after
                    else f"cutlass::epilogue::thread::LinearCombinationBiasElementwise<{out}, float, float, {out}, "
                    f"{out}, {lanes}, {ACTIVATIONS[self.activation]}, cutlass::plus<float>, false, {bias}>")
        return (
            "cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<"
            "cutlass::half_t, cutlass::layout::TensorNHWC, cutlass::half_t, cutlass::layout::TensorNHWC, "
            f"{out}, cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
            f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
            f"cutlass::gemm::GemmShape<16, 8, 16>, {op(epilogue)}, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            "cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized, "
            "cutlass::conv::StrideSupport::kStrided>"
        )


DEPTHWISE_LANES = 8  # channels per thread: one 16-byte load of fp16 (int8: two 4-byte loads)
DEPTHWISE_THREADS = 128


@dataclasses.dataclass(frozen=True)
class DepthwiseKernel(ConvKernel):
    """A depthwise convolution (groups = channels, one filter per channel; weights HWOI [R, S, K, 1]) with the same
    fused epilogue as ``ConvKernel`` (fp16: bias, activation, residual; int8: the requantization), on edgeq's own
    kernel, not CUTLASS's: ``twin_prim_func``'s TIR scheduled by ``depthwise_prim_func`` (one thread computes 8
    consecutive channels of one output pixel with fp32 / int32 accumulators, 16-byte loads of the input and the
    weights, the zero padding as a predicate). Why not CUTLASS: its depthwise kernels are SIMT as well (no tensor
    core takes a per-channel reduction of R x S), and its epilogue interface hands the output functor no channel
    index, which edgeq's int8 requantization needs for its three per-channel vectors; one kernel for both
    precisions keeps one epilogue. A depthwise layer moves its input and output once and computes little: it is
    memory-bound, and the loads are what the schedule is for."""

    tile: Tile | None = None

    @property
    def function(self) -> str:
        return f"depthwise_{self.name}"

    @property
    def threads(self) -> int:
        return DEPTHWISE_THREADS

    @property
    def grid(self) -> tuple[int, int]:
        p = self.problem
        return -(-(p.n * p.p * p.q * p.k // DEPTHWISE_LANES) // DEPTHWISE_THREADS), 1

    @property
    def kernel_type(self) -> str:
        raise TypeError("a depthwise kernel is TIR, not a CUTLASS template")


ACTIVATION_TEMPLATES = {  # name -> the activation as LinearCombinationGeneric takes it (a template on the type)
    "identity": "cutlass::epilogue::thread::Identity",
    "relu": "cutlass::epilogue::thread::ReLu",
    "relu6": "edgeq_cutlass::Relu6T",
    "silu": "cutlass::epilogue::thread::SiLu",
    "hardswish": "cutlass::epilogue::thread::HardSwish",
    "gelu": "cutlass::epilogue::thread::GELU",
}


@dataclasses.dataclass(frozen=True)
class GroupConvKernel(ConvKernel):
    """A grouped convolution (1 < groups < channels: RegNet's and ResNeXt's 3x3s), fp16: CUTLASS's
    ``DefaultConv2dGroupFprop`` (Sm80 tensor cores, analytic iterators; weights OHWI [K, R, S, C / groups]) with
    ``act(conv + bias)``. One CTA computes one group's tile of output channels (``kSingleGroup``: K / groups a
    multiple of the tile's N) or several whole groups (``kMultipleGroup``: the tile's N a multiple of K / groups;
    CUTLASS's filter iterator zeroes the weights of the other groups). Its epilogue is CUTLASS's standard one,
    which has no broadcast vector: the bias comes in as the source C read with a row stride of 0 (every output pixel
    reads the same K values), which leaves no room for a residual (none of those models adds one there) and none
    for edgeq's int8 requantization (int8 grouped convolutions stay on dlight)."""

    @property
    def channels_per_group(self) -> int:
        return self.problem.c // self.problem.groups

    @property
    def group_mode(self) -> str:
        kg = self.problem.k // self.problem.groups
        return "kSingleGroup" if kg % self.tile.block[1] == 0 else "kMultipleGroup"

    @property
    def work(self) -> float:
        """The tensor cores' work over the useful work: a tile's K of 32 over a group's channels, times the groups
        a CTA computes with the other groups' weights zero (``kMultipleGroup``)."""
        cg, kg, (_, bn, bk) = self.channels_per_group, self.problem.k // self.problem.groups, self.tile.block
        groups_per_cta = bn // kg if self.group_mode == "kMultipleGroup" else 1
        return groups_per_cta * (-(-cg // bk) * bk) / cg

    @property
    def input_alignment(self) -> int:
        """Elements per load of x and w: the largest of 8, 4, 2 dividing the channels of a group."""
        return next(a for a in (8, 4, 2) if self.channels_per_group % a == 0)

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        a = self.input_alignment
        return (
            "typename cutlass::conv::kernel::DefaultConv2dGroupFprop<"
            "cutlass::half_t, cutlass::layout::TensorNHWC, cutlass::half_t, cutlass::layout::TensorNHWC, "
            "cutlass::half_t, cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
            f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
            "cutlass::gemm::GemmShape<16, 8, 16>, "
            f"cutlass::epilogue::thread::LinearCombinationGeneric<{ACTIVATION_TEMPLATES[self.activation]}, "
            f"cutlass::half_t, {ALIGNMENT}, float, float>, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            f"cutlass::arch::OpMultiplyAdd, cutlass::conv::GroupMode::{self.group_mode}, "
            f"cutlass::conv::IteratorAlgorithm::kAnalytic, cutlass::conv::StrideSupport::kStrided, {a}, {a}>::Kernel"
        )


@dataclasses.dataclass(frozen=True)
class TokenLinearKernel(ConvKernel):
    """An int8 linear layer with per-token activation scales (a transformer's: the row scale of its input is
    computed at run time) as one CUTLASS GEMM: s8 x s8 -> s32 over x [M, C] (the tokens of the 1x1 convolution
    ``_matmul_as_conv`` made of the layer) and w [N, C] (OHWI), ``DefaultGemmWithVisitor``'s Sm80 mainloop, and an
    epilogue visitor tree (CUTLASS's ``Sm80EVT``: the output channel's weight scale and bias broadcast along the
    rows, the token's scale along the columns, one edgeq functor computing)
    ``y = float(acc) * scale[n] * token[m] + bias[n]``, then [the GELU of the graph's erf form, with its constants]
    or [+ residual, float32], out as float32 or fp16 (``out_dtype``). CUTLASS 2.x's convolution epilogues broadcast
    one vector along the rows only, which is why the conv kernels stop at the weight scale and leave the rest to a
    kernel of their own. Each step rounds as the graph's float32 operators do (``__fmul_rn``, ``__fadd_rn``: no
    contraction into FMA); erff is CUDA's (the host's erf may differ in the last place)."""

    out_dtype: str = "float32"
    # GELU as the graph writes it: (its scaling constant, True where x is divided by it (x / sqrt(2)) rather than
    # multiplied (x * 1/sqrt(2)), the half, the one, True where the half multiplies x first ((x * 0.5) * (1 + erf))
    gelu: tuple[float, bool, float, float, bool] | None = None

    @property
    def output_dtype(self) -> str:
        return self.out_dtype

    @property
    def residual_type(self) -> str:
        return "float32"

    @property
    def rows(self) -> int:
        p = self.problem
        return p.n * p.p * p.q

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        out = "cutlass::half_t" if self.out_dtype == "float16" else "float"
        return (
            "typename cutlass::gemm::kernel::DefaultGemmWithVisitor<"
            f"int8_t, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, {self.input_alignment}, "
            f"int8_t, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, {self.input_alignment}, "
            f"{out}, cutlass::layout::RowMajor, {self.out_lanes}, int32_t, float, cutlass::arch::OpClassTensorOp, "
            f"cutlass::arch::Sm80, cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, "
            f"cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, cutlass::gemm::GemmShape<16, 8, 32>, "
            f"Evt_{token_linear_types(self)[0]}, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            "cutlass::arch::OpMultiplyAddSaturate, 1>::GemmKernel"
        )

    @property
    def out_lanes(self) -> int:  # 16-byte stores
        return ALIGNMENT if self.out_dtype == "float16" else 4


@dataclasses.dataclass(frozen=True)
class GemmKernel:
    """What edgeq asks one CUTLASS batched GEMM to compute: ``fp16((a @ w) * alpha)`` with fp16 operands and fp32
    accumulation (``GemmBatched`` over ``DefaultGemm``'s Sm80 mainloop and epilogue, one batch per blockIdx.z)."""

    name: str
    problem: GemmProblem
    tile: Tile
    alpha: float = 1.0  # a scalar the product is multiplied by before rounding (attention's 1/sqrt(d))
    precision: str = "fp16"
    activation: str = "identity"
    residual: bool = False
    float_out: bool = False
    # Operands read or written in place of a head transpose (``_head_view``): (leading dimension, batch stride) in
    # elements, None where the operand is contiguous. Attention's heads, [1, S, H, D] seen as H matrices [S, D]:
    # (H * D, D). ``b_column_major``: w[b] is read as the transpose of a row-major [N, K] (K^T, from K's heads).
    a_view: tuple[int, int] | None = None
    b_view: tuple[int, int] | None = None
    y_view: tuple[int, int] | None = None
    b_column_major: bool = False
    # where a and w start in the tensors they are read from, in elements: a head view of one part of several
    # projections computed as one (``_projections_as_one``: Q, K and V side by side in one [S, 3 x H x D] tensor)
    a_offset: int = 0
    b_offset: int = 0
    # int8 out: (divisor, lo, hi), y = int8(clamp(round(float(fp16 y) / divisor), lo, hi)) (``HalfQuantize``:
    # attention's context quantized with its one calibrated scale for the output projection)
    quantize: tuple[float, float, float] | None = None

    @property
    def strides(self) -> dict[str, tuple[int, int]]:
        """Per operand, (leading dimension, batch stride) in elements: what CUTLASS's ``GemmBatched`` is given."""
        p = self.problem
        contiguous = {"a": (p.k, p.m * p.k), "w": ((p.k if self.b_column_major else p.n), p.k * p.n),
                      "y": (p.n, p.m * p.n)}
        views = {"a": self.a_view, "w": self.b_view, "y": self.y_view}
        return {name: tuple(views[name] or contiguous[name]) for name in contiguous}

    @property
    def function(self) -> str:
        return f"cutlass_{self.name}"

    @property
    def threads(self) -> int:
        return self.tile.threads

    @property
    def grid(self) -> tuple[int, int, int]:
        m, n, _ = self.problem.gemm
        return -(-m // self.tile.block[0]), -(-n // self.tile.block[1]), self.problem.batch

    @property
    def out_type(self) -> str:  # float32 out: the scores a softmax reads in float32 (no cast kernel between)
        return "int8_t" if self.quantize else "float" if self.float_out else "cutlass::half_t"

    @property
    def out_dtype(self) -> str:
        return "int8" if self.quantize else "float32" if self.float_out else "float16"

    @property
    def alignment(self) -> int:
        """Elements per global access of a, w and y: the largest of 8, 4, 2, 1 dividing every contiguous extent,
        leading dimension and batch stride (a window's 49 tokens: 1, which cp.async cannot load, so such a kernel has
        CUTLASS's two-stage mainloop with plain loads, ``gemm_tile``)."""
        p = self.problem
        extents = [p.k, p.k if self.b_column_major else p.n, p.n, self.a_offset, self.b_offset,
                   *(v for pair in self.strides.values() for v in pair)]
        return next(a for a in (8, 4, 2, 1) if all(e % a == 0 for e in extents))

    @property
    def out_lanes(self) -> int:  # 16-byte stores where the alignment allows
        return min(4 if self.float_out else ALIGNMENT, self.alignment)

    @property
    def b_layout(self) -> str:
        return "ColumnMajor" if self.b_column_major else "RowMajor"

    @property
    def epilogue(self) -> str:
        if self.quantize:
            return f"edgeq_cutlass::HalfQuantize<{self.out_lanes}>"
        return f"cutlass::epilogue::thread::LinearCombination<{self.out_type}, {self.out_lanes}, float, float>"

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        return (
            "typename cutlass::gemm::kernel::DefaultGemm<"
            f"cutlass::half_t, cutlass::layout::RowMajor, {self.alignment}, cutlass::half_t, "
            f"cutlass::layout::{self.b_layout}, {self.alignment}, {self.out_type}, cutlass::layout::RowMajor, float, "
            "cutlass::arch::OpClassTensorOp, "
            f"cutlass::arch::Sm80, cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, "
            f"cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, cutlass::gemm::GemmShape<16, 8, 16>, "
            f"{self.epilogue}, "
            f"cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, {self.tile.stages}, false, "
            "cutlass::arch::OpMultiplyAdd>::GemmKernel"
        )


C_TYPES = {"float16": "half", "int8": "int8_t", "int32": "int32_t", "float32": "float"}


def c_float(v: float) -> str:
    """A float32 literal of ``v`` (infinities as the largest float, which clamps nothing finite)."""
    if math.isinf(v):
        return "-3.402823466e+38f" if v < 0 else "3.402823466e+38f"
    return f"{float(np.float32(v))!r}f"


@functools.lru_cache(maxsize=None)  # its kernel type, the module's source and its wrapper each ask for it
def token_linear_types(kern: TokenLinearKernel) -> tuple[str, str]:
    """(its name, the C++ that defines it) of a per-token int8 linear layer's epilogue visitor tree ``Evt_<name>``:
    its functor (the graph's float32 operators, in their order, rounding as they do), the tree that hands it the
    accumulators, the weight scale and bias of its column, the token scale of its row [and the residual], and the
    store. Named by its content: layers with the same tile and epilogue (a transformer's layers) share one, so
    NVRTC instantiates CUTLASS's templates once for them."""
    out = "cutlass::half_t" if kern.out_dtype == "float16" else "float"
    (bm, bn, bk), (wm, wn, wk) = kern.tile.block, kern.tile.warp
    steps = ["float v = __fadd_rn(__fmul_rn(__fmul_rn(acc[i], scale[i]), token[i]), bias[i]);"]
    if kern.gelu is not None:
        constant, divide, half, one, half_first = kern.gelu
        scaled = f"__fdiv_rn(v, {c_float(constant)})" if divide else f"__fmul_rn(v, {c_float(constant)})"
        steps.append(f"float t = __fadd_rn(erff({scaled}), {c_float(one)});")
        steps.append(f"v = __fmul_rn(__fmul_rn(v, {c_float(half)}), t);" if half_first
                     else f"v = __fmul_rn(__fmul_rn(v, t), {c_float(half)});")
    if kern.residual:
        steps.append("v = __fadd_rn(v, residual[i]);")
    array = "cutlass::Array<float, N> const&"
    inputs = f"{array} acc, {array} scale, {array} token, {array} bias" + (f", {array} residual" if kern.residual else "")
    nodes = "cutlass::epilogue::threadblock"
    row, column = "cute::Stride<cute::_0, cute::_1, int32_t>", "cute::Stride<cute::_1, cute::_0, int32_t>"
    matrix = "cute::Stride<int64_t, cute::_1, int64_t>"
    residual_node = f", {nodes}::VisitorAuxLoad<Map_@, float, {matrix}>" if kern.residual else ""
    body = "\n".join("      " + step for step in steps)
    text = f"""
template <class T> struct Epilogue_@;
template <int N> struct Epilogue_@<cutlass::Array<float, N>> {{
  CUTLASS_DEVICE cutlass::Array<float, N> operator()({inputs}) const {{
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {{
{body}
      y[i] = v;
    }}
    return y;
  }}
}};
using Map_@ = {nodes}::OutputTileThreadLayout<cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>,
    cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, {out}, {kern.out_lanes}, 1>;
using Compute_@ = {nodes}::Sm80EVT<
    {nodes}::VisitorCompute<Epilogue_@, {out}, float, cutlass::FloatRoundStyle::round_to_nearest>,
    {nodes}::VisitorAccFetch, {nodes}::VisitorRowBroadcast<Map_@, float, {row}>,
    {nodes}::VisitorColBroadcast<Map_@, float, {column}>, {nodes}::VisitorRowBroadcast<Map_@, float, {row}>
    {residual_node}>;
using Evt_@ = {nodes}::Sm80EVT<
    {nodes}::VisitorAuxStore<Map_@, {out}, cutlass::FloatRoundStyle::round_to_nearest, {matrix}>, Compute_@>;
"""
    key = "t" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return key, text.replace("@", key)


def kernel_operands(kernel: ConvKernel, shapes: dict | None = None) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of the kernel's operands in the order its PrimFunc and device wrapper take them:
    fp16: x, w, bias, [residual], y; int8: x, w, bias (int32), scale, shift, [post], channel (float32: the output channel's
    index, the epilogue's broadcast vector; not for a depthwise kernel), [residual], y; a ``TokenLinearKernel``:
    x, w, scale, token, bias (float32), [residual], y. ``shapes``: the per-channel operands' shapes as the
    graph holds them (K elements; default [K])."""
    p = kernel.problem
    shapes = shapes or {}
    if isinstance(kernel, GemmKernel):  # a, w, y: [batch, M, K], [batch, K, N], [batch, M, N] or the graph's shapes
        return [("a", tuple(shapes.get("a", (p.batch, p.m, p.k))), "float16"),
                ("w", tuple(shapes.get("w", (p.batch, p.k, p.n))), "float16"),
                ("y", tuple(shapes.get("y", (p.batch, p.m, p.n))), kernel.out_dtype)]
    xs, ws, ys = (p.n, p.h, p.w, kernel.x_channels), (p.k, p.r, p.s, p.c), (p.n, p.p, p.q, p.k)
    if p.depthwise:  # HWOI
        ws = (p.r, p.s, p.k, 1)
    elif p.groups > 1:  # grouped: each output channel's filter sees its group's C / groups channels
        ws = (p.k, p.r, p.s, p.c // p.groups)

    def vec(name):
        return tuple(shapes.get(name, (p.k,)))

    ys = (p.n, p.p, p.q, kernel.out_channels) if kernel.out_view else tuple(shapes.get("y", ys))
    bs = vec("bias")
    if isinstance(kernel, TokenLinearKernel):  # x, w, scale, token ([..., M, 1]: a row's), bias, [residual], y
        residual = [("residual", ys, "float32")] if kernel.residual else []
        return [("x", xs, "int8"), ("w", ws, "int8"), ("scale", vec("scale"), "float32"),
                ("token", tuple(shapes.get("token", (kernel.rows, 1))), "float32"), ("bias", bs, "float32"), *residual,
                ("y", ys, kernel.out_dtype)]
    if kernel.precision == "int8":
        ops = [("x", xs, "int8"), ("w", ws, "int8"), ("bias", bs, "int32"), ("scale", vec("scale"), "float32"),
               ("shift", vec("shift"), "float32")]
        if kernel.post:
            ops.append(("post", vec("post"), "float32"))
        if not isinstance(kernel, DepthwiseKernel):  # CUTLASS's epilogue: the channel index as broadcast vector
            ops.append(("channel", (p.k,), "float32"))
        act = "float32" if kernel.float_out else "int8"
    else:
        ops = [("x", xs, "float16"), ("w", ws, "float16"), ("bias", bs, kernel.bias_dtype)]
        act = "float32" if kernel.float_out else "float16"
    if kernel.residual:
        rs = (p.n, p.p, p.q, kernel.residual_view[1]) if kernel.residual_view else (p.n, p.p, p.q, p.k) \
            if kernel.out_view else ys
        ops.append(("residual", rs, kernel.residual_type))
    if getattr(kernel, "up_view", None):  # the upsampled copy's tensor, written in place (before y: the call's new
        # output comes last)
        ops.append(("y_up", (p.n, 2 * p.p, 2 * p.q, kernel.up_view[1]), act))
    if getattr(kernel, "head_out", None):  # y: the detector's whole output
        ys, act = (p.n, kernel.head_out[2], kernel.head_out[3]), kernel.head_out[4]
    return ops + [("y", ys, act)]
