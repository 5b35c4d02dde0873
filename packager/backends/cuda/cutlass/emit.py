"""The CUDA C++ of a module's kernels: the hand-written epilogues and iterators (``include/edgeq_cutlass/*.h``,
found with ``-I``) and, per kernel, the ``extern "C" __device__`` wrapper that builds CUTLASS's Params in shared
memory and runs the kernel (``device_source``).
"""

from __future__ import annotations

from collections.abc import Sequence

from edgeq.backends.cuda.cutlass.kernels import (C_TYPES, ConvKernel, DepthwiseKernel, GemmKernel, GroupConvKernel,
    TokenLinearKernel, c_float, kernel_operands, token_linear_types)
from edgeq.backends.cuda.device_math import EXP_RN_CPP


# CUTLASS's headers, edgeq's exp (device_math.py: one definition for the device, the TIR twins and numpy), then the
# epilogues and iterators written in C++ (include/edgeq_cutlass/, found with -I: nvrtc.nvrtc_options)
PREAMBLE = r"""
#include <cuda/std/type_traits>
namespace std { using cuda::std::void_t; }  // NVRTC: CUTLASS's bias-elementwise epilogue names std::void_t
#include <cutlass/cutlass.h>
#include <cutlass/conv/kernel/default_conv2d_fprop_with_broadcast.h>
#include <cutlass/conv/kernel/default_conv2d_group_fprop.h>
#include <cutlass/epilogue/thread/linear_combination_generic.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/epilogue/thread/linear_combination_bias_elementwise.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/kernel/default_gemm.h>
#include <cutlass/gemm/kernel/gemm_batched.h>
namespace edgeq_cutlass {
""" + EXP_RN_CPP + r"""}  // namespace edgeq_cutlass
#include <edgeq_cutlass/epilogues.h>
#include <edgeq_cutlass/store_iterators.h>
"""


def device_source(kernels: Sequence[ConvKernel]) -> str:
    """The CUDA source of the kernels' device wrappers: ``edgeq_cutlass_<name>(operands..., smem)`` (the operands of
    ``kernel_operands``) and, per kernel, ``edgeq_smem_<name>``, an array as large as the kernel's shared storage
    and Params, compiled only where ``EDGEQ_SIZING`` is defined (``smem_sizes`` reads it from that cubin's symbol
    table; the module does not carry it). Serial split-K kernels get their own semaphores, one an output tile, at
    ``split_k_offsets`` in one zero-initialized array."""
    out = [PREAMBLE]
    token_linear = [k for k in kernels if isinstance(k, TokenLinearKernel)]
    if token_linear:  # cute's headers only where a kernel needs them; each visitor tree once
        trees = dict(token_linear_types(k) for k in token_linear)
        out.append(EVT_INCLUDES + "namespace edgeq_cutlass {" + "".join(trees.values()) + "}  // namespace edgeq_cutlass\n")
    offsets, locks = split_k_offsets(kernels)
    if locks:  # serial split-K's semaphores, one an output tile: zero when the module loads, and each kernel's last
        # slice sets its tile's back to zero; each kernel has its own (a launch that never finished leaves only its
        # own tiles' set, and no two kernels share a semaphore)
        out.append(f"namespace edgeq_cutlass {{ __device__ int split_k_locks[{locks}]; }}\n")
    for kern in kernels:
        if isinstance(kern, DepthwiseKernel):  # TIR: TVM writes its CUDA
            continue
        p = kern.problem
        t = f"Kernel_{kern.name}"
        if isinstance(kern, GemmKernel):
            out.append(_gemm_source(kern))
            continue
        signature = ", ".join(f"{C_TYPES[dtype]}* {name}" for name, _, dtype in kernel_operands(kern))
        if isinstance(kern, TokenLinearKernel):
            out.append(_token_linear_source(kern, signature))
            continue
        if isinstance(kern, GroupConvKernel):
            out.append(_group_source(kern, signature))
            continue
        ct = kern.x_channels  # a channel slice of a wider tensor: its first channel, the tensor's strides
        x_offset = f" + {kern.x_view[0]}" if kern.x_view else ""
        x_layout = (_nhwc_layout(p.n, p.h, p.w, ct) if kern.x_view
                    else f"layout::TensorNHWC::packed({{{p.n}, {p.h}, {p.w}, {p.c}}})")
        out_layout = _nhwc_layout(p.n, p.p, p.q, kern.out_channels)  # y: a slice of a concatenation's channels
        y_offset = f" + {kern.out_view[0]}" if kern.out_view else ""
        d_ref, tensor = f"{{reinterpret_cast<OUT*>(y){y_offset}, out_layout}}", "nullptr, 0, 0"
        c_ref = d_ref  # no residual: the source is y (unread)
        if kern.residual:  # the residual: maybe a slice of a wider tensor's channels
            first, channels = kern.residual_view or (0, p.k)
            c_ref = (f"{{reinterpret_cast<OUT*>(residual){f' + {first}' if first else ''}, "
                     f"{_nhwc_layout(p.n, p.p, p.q, channels)}}}")
        if kern.up_view:  # T: the output upsampled (Upsample2xIterator), from the tensor's first channel
            tensor = f"y_up + {kern.up_view[0]}, 0, {kern.up_view[1]}"
        if kern.head_out:  # T: the detector's output, from the kernel's first channel and anchor (Z is not stored)
            first, anchor, _, anchors, _ = kern.head_out
            tensor = f"y + {first * anchors + anchor}, 0, 0"
        if kern.precision == "int8" and kern.residual_type != kern.output_dtype:  # out through T (row stride K)
            res = C_TYPES[kern.residual_type]
            c_ref = d_ref = f"{{reinterpret_cast<{res}*>(residual), out_layout}}"
            tensor = f"y, 0, {p.k}"
        if kern.precision == "int8":
            element, out_element = "int8_t", ("float" if kern.float_out else "int8_t")
            output_op = (f"edgeq_cutlass::RequantParams{{bias, scale, shift, {c_float(kern.residual_scale)}, "
                         f"{c_float(kern.act_lo)}, {c_float(kern.act_hi)}, {c_float(kern.out_div)}, "
                         f"{c_float(kern.lo)}, {c_float(kern.hi)}, {int(kern.residual)}, {int(kern.silu)}, "
                         f"{'post' if kern.post else 'nullptr'}}}")
            vector = "channel"
        elif kern.residual_after:
            element, out_element, output_op = "half_t", "half_t", "{}"
            vector = "reinterpret_cast<half_t*>(bias)"
        else:
            element, out_element = "half_t", ("float" if kern.float_out else "half_t")
            output_op = f"{{1.0f, {'1.0f' if kern.residual else '0.0f'}}}"
            vector = f"reinterpret_cast<{'float' if kern.float_bias else 'half_t'}*>(bias)"
        out.append(_wrapper(kern.name, f"using {t} = {kern.kernel_type};", signature, f"""
    conv::Conv2dProblemSize problem({p.n}, {p.h}, {p.w}, {p.c}, {p.k}, {p.r}, {p.s}, {p.p}, {p.q}, {p.pad[0]}, {p.pad[1]},
                                    {p.stride[0]}, {p.stride[1]}, {p.dilation[0]}, {p.dilation[1]},
                                    conv::Mode::kCrossCorrelation, {kern.tile.split_k});
    layout::TensorNHWC out_layout = {out_layout};
    typename K::Arguments args(
        problem, {{reinterpret_cast<{element}*>(x){x_offset}, {x_layout}}},
        {{reinterpret_cast<{element}*>(w), layout::TensorNHWC::packed({{{p.k}, {p.r}, {p.s}, {p.c}}})}},
        {c_ref.replace("OUT", out_element)}, {d_ref.replace("OUT", out_element)},
        {output_op}, conv::SplitKMode::kSerial, {vector}, {tensor});
    new (params) typename K::Params(args{f", edgeq_cutlass::split_k_locks + {offsets[kern.name]}"
                                         if kern.tile.split_k > 1 else ""});"""))
    return "".join(out)


def split_k_offsets(kernels: Sequence[ConvKernel]) -> tuple[dict[str, int], int]:
    """({split kernel: its first semaphore in ``split_k_locks``}, the array's length): one semaphore an output tile
    (grid x and y) of each serial split-K kernel, in the order of their names (whatever order they come in)."""
    offsets, total = {}, 0
    for k in sorted(kernels, key=lambda k: k.name):
        if getattr(k, "tile", None) and k.tile.split_k > 1:
            offsets[k.name] = total
            total += k.grid[0] * k.grid[1]
    return offsets, total


def _nhwc_layout(n: int, h: int, w: int, channels: int) -> str:
    """CUTLASS's NHWC layout of an [n, h, w, channels] tensor, as its strides (a slice of its channels keeps them)."""
    return f"layout::TensorNHWC({channels}, {w * channels}, {h * w * channels})"


def _wrapper(name: str, types: str, signature: str, build: str) -> str:
    """The device wrapper of one CUTLASS kernel: ``types`` (C++ in namespace edgeq_cutlass that defines
    ``Kernel_<name>``), an array as large as the kernel's shared storage and its Params (``smem_sizes`` reads its size
    from the cubin), and ``edgeq_cutlass_<name>(signature..., smem)``, in which thread 0 runs ``build`` (C++ that
    constructs the kernel's Params at ``params``, in shared memory after its storage: no thread keeps them on its
    stack) and the block then runs the kernel."""
    t = f"Kernel_{name}"
    return f"""
namespace edgeq_cutlass {{ {types} }}
// the kernel's shared storage, then its Params (built once per block, by thread 0)
constexpr size_t edgeq_params_at_{name} = (sizeof(edgeq_cutlass::{t}::SharedStorage) + 15) / 16 * 16;
#ifdef EDGEQ_SIZING  // only in smem_sizes' compile: the shipped module holds no such array
__device__ char edgeq_smem_{name}[edgeq_params_at_{name} + sizeof(typename edgeq_cutlass::{t}::Params)];
#endif
extern "C" __device__ void edgeq_cutlass_{name}({signature}, unsigned char* smem) {{
  using namespace cutlass;
  using K = edgeq_cutlass::{t};
  auto* params = reinterpret_cast<typename K::Params*>(smem + edgeq_params_at_{name});
  if (threadIdx.x == 0) {{{build}
  }}
  __syncthreads();
  K op;
  op(*params, *reinterpret_cast<typename K::SharedStorage*>(smem));
}}
"""


def _group_source(kern: GroupConvKernel, signature: str) -> str:
    """A grouped convolution's device wrapper (as ``device_source``'s convolutions': Params built in shared memory);
    the bias is the epilogue's source C with every stride 0."""
    p = kern.problem
    return _wrapper(kern.name, f"using Kernel_{kern.name} = {kern.kernel_type};", signature, f"""
    conv::Conv2dProblemSize problem({p.n}, {p.h}, {p.w}, {p.c}, {p.k}, {p.r}, {p.s}, {p.p}, {p.q}, {p.pad[0]}, {p.pad[1]},
                                    {p.stride[0]}, {p.stride[1]}, {p.dilation[0]}, {p.dilation[1]},
                                    conv::Mode::kCrossCorrelation, 1, {p.groups});
    typename K::Arguments args(
        problem, {{reinterpret_cast<half_t*>(x), layout::TensorNHWC::packed({{{p.n}, {p.h}, {p.w}, {p.c}}})}},
        {{reinterpret_cast<half_t*>(w), layout::TensorNHWC::packed({{{p.k}, {p.r}, {p.s}, {kern.channels_per_group}}})}},
        {{reinterpret_cast<half_t*>(bias), layout::TensorNHWC(0, 0, 0)}},
        {{reinterpret_cast<half_t*>(y), layout::TensorNHWC::packed({{{p.n}, {p.p}, {p.q}, {p.k}}})}},
        {{1.0f, 1.0f}});
    new (params) typename K::Params(args);""")


EVT_INCLUDES = r"""
#include <cutlass/gemm/kernel/default_gemm_universal_with_visitor.h>
#include <cutlass/epilogue/threadblock/fusion/visitors.hpp>
"""


def _token_linear_source(kern: TokenLinearKernel, signature: str) -> str:
    """A per-token int8 linear layer's device wrapper (as ``device_source``'s convolutions': Params built in shared
    memory) over its visitor tree (``token_linear_types``, defined once in front of the wrappers)."""
    p, kn = kern.problem, kern.name
    m, n, c = kern.rows, p.k, p.c
    out = "cutlass::half_t" if kern.out_dtype == "float16" else "float"
    evt = token_linear_types(kern)[0]
    per_row, per_column = f"{{cute::_1{{}}, cute::_0{{}}, int32_t({m})}}", f"{{cute::_0{{}}, cute::_1{{}}, int32_t({n})}}"
    dense = f"{{int64_t({n}), cute::_1{{}}, int64_t({m * n})}}"
    residual_arg = f"{{residual, 0.f, {dense}}}, " if kern.residual else ""
    return _wrapper(kn, f"using Kernel_{kn} = {kern.kernel_type};", signature, f"""
    typename edgeq_cutlass::Evt_{evt}::Arguments evt{{
        {{{{}}, {{scale, 0.f, {per_column}}}, {{token, 0.f, {per_row}}}, {{bias, 0.f, {per_column}}}, {residual_arg}{{}}}},
        {{reinterpret_cast<{out}*>(y), {dense}}}}};
    typename K::Arguments args(gemm::GemmUniversalMode::kGemm, gemm::GemmCoord({m}, {n}, {c}), 1, evt,
                               x, w, nullptr, nullptr, {m * c}LL, {n * c}LL, 0LL, 0LL, {c}, {c}, 0, 0);
    new (params) typename K::Params(args, {kern.grid[0] * kern.grid[1]}, 1);""")


def _gemm_source(kern: GemmKernel) -> str:
    """A batched GEMM's device wrapper (as ``device_source``'s convolutions': Params built in shared memory)."""
    p, kn = kern.problem, kern.name
    gm, gn, batch = kern.grid
    (lda, bsa), (ldb, bsb), (ldc, bsc) = (kern.strides[name] for name in ("a", "w", "y"))
    out, element = {"int8": ("int8_t", "int8_t"), "float32": ("float", "float"),
                    "float16": ("half", "half_t")}[kern.out_dtype]
    output_op = (f"edgeq_cutlass::HalfQuantizeParams{{{c_float(kern.alpha)}, {c_float(kern.quantize[0])}, "
                 f"{c_float(kern.quantize[1])}, {c_float(kern.quantize[2])}}}" if kern.quantize
                 else f"typename K::OutputOp::Params({c_float(kern.alpha)}, 0.0f)")
    types = (f"using Default_{kn} = {kern.kernel_type};\nusing Kernel_{kn} = cutlass::gemm::kernel::GemmBatched<"
             f"Default_{kn}::Mma, Default_{kn}::Epilogue, cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle>;")
    return _wrapper(kn, types, f"half* a, half* w, {out}* y", f"""
    new (params) typename K::Params(
        gemm::GemmCoord({p.m}, {p.n}, {p.k}), gemm::GemmCoord({gm}, {gn}, {batch}),
        {{reinterpret_cast<half_t*>(a) + {kern.a_offset}, layout::RowMajor({lda})}}, {bsa}LL,
        {{reinterpret_cast<half_t*>(w) + {kern.b_offset}, layout::{kern.b_layout}({ldb})}}, {bsb}LL,
        {{reinterpret_cast<{element}*>(y), layout::RowMajor({ldc})}}, {bsc}LL,
        {{reinterpret_cast<{element}*>(y), layout::RowMajor({ldc})}}, {bsc}LL,
        {output_op}, {batch});""")
