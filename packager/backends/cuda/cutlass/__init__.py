"""NVIDIA's CUTLASS on the Jetson GPU path: convolutions and matrix products on the tensor cores (#42, #65).

CUTLASS 4.1.0 ships inside the ``apache-tvm`` wheel (``tvm/3rdparty/cutlass/include``); nothing is downloaded.
A convolution becomes one CUTLASS Sm80 kernel (``DefaultConv2dFpropWithBroadcast``: NHWC activations, OHWI
weights, ``mma.sync`` through ``ldmatrix`` and ``cp.async``) with its epilogue fused. fp16: f16 x f16 with fp32
accumulation, ``act(conv + residual + bias)``. int8: s8 x s8 -> s32 and edgeq's ``Requantize`` epilogue (int32
bias, per-channel scale and shift, a dequantized residual, the activation, rounding half to even and saturation to
int8; or a float32 output where no quantize follows). Serial split-K where a layer's output tiles are too few for
the GPU. Sm80 templates use only Ampere instructions, so the same source runs on the Orin (sm_87) and on Hopper
(sm_90). docs/architecture.md says how a layer reaches a kernel and where this stands.

The modules, one job each, in the order a build uses them:
- ``prepare``: the graph NHWC, channels padded, linear layers as 1x1 convolutions, projections as one;
- ``match``: the Relax helpers the passes share, and ``Claimed``; ``find`` (fp16 and GEMM chains) and
  ``find_int8`` (int8 chains): what each kernel takes;
- ``problems``, ``tiles``, ``kernels``: the problem, the tile table and split-K, the frozen kernel descriptions
  and the CUTLASS template each instantiates;
- ``claim``: the kernels' calls in place of their chains; ``twins``: the host twins the reference check runs;
- ``tir``: the TIR functions TVM launches; ``emit``: the CUDA C++ wrappers, with ``include/edgeq_cutlass/*.h``
  (the hand-written epilogues and iterators); ``nvrtc``: compiling them; ``record``: the manifest's entries.

The names below are the package's interface; the rest is imported from the module that defines it.
"""

from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, ALIGNMENT_INT8, Conv2dProblem, GemmProblem, alignment
from edgeq.backends.cuda.cutlass.tiles import (GROUP_TILES, MAX_GROUP_WORK, MAX_SPLIT_K, MIN_K_ITERATIONS, TILES,
    TILES_INT8, Tile, choose_tile, gemm_tile, group_tile, split_k)
from edgeq.backends.cuda.cutlass.kernels import (ACTIVATIONS, ACTIVATION_TEMPLATES, ConvKernel, DEPTHWISE_LANES,
    DEPTHWISE_THREADS, DepthwiseKernel, GemmKernel, GroupConvKernel, TokenLinearKernel, kernel_operands)
from edgeq.backends.cuda.cutlass.emit import device_source, split_k_offsets
from edgeq.backends.cuda.cutlass.nvrtc import (build_module, cutlass_include, cutlass_version, nvrtc_include,
    nvrtc_options, smem_sizes, wrappers_in_module)
from edgeq.backends.cuda.cutlass.tir import depthwise_prim_func, prim_func
from edgeq.backends.cuda.cutlass.twins import twin_prim_func, twin_tensors, with_twins
from edgeq.backends.cuda.cutlass.record import kernel_record
from edgeq.backends.cuda.cutlass.prepare import prepare_nhwc
from edgeq.backends.cuda.cutlass.match import Claimed
from edgeq.backends.cuda.cutlass.find import find_convs
from edgeq.backends.cuda.cutlass.claim import claim_calls, claim_convs, rebuild_main

__all__ = [
    "ALIGNMENT",
    "ALIGNMENT_INT8",
    "Conv2dProblem",
    "GemmProblem",
    "alignment",
    "GROUP_TILES",
    "MAX_GROUP_WORK",
    "MAX_SPLIT_K",
    "MIN_K_ITERATIONS",
    "TILES",
    "TILES_INT8",
    "Tile",
    "choose_tile",
    "gemm_tile",
    "group_tile",
    "split_k",
    "ACTIVATIONS",
    "ACTIVATION_TEMPLATES",
    "ConvKernel",
    "DEPTHWISE_LANES",
    "DEPTHWISE_THREADS",
    "DepthwiseKernel",
    "GemmKernel",
    "GroupConvKernel",
    "TokenLinearKernel",
    "kernel_operands",
    "device_source",
    "split_k_offsets",
    "build_module",
    "cutlass_include",
    "cutlass_version",
    "nvrtc_include",
    "nvrtc_options",
    "smem_sizes",
    "wrappers_in_module",
    "depthwise_prim_func",
    "prim_func",
    "twin_prim_func",
    "twin_tensors",
    "with_twins",
    "kernel_record",
    "prepare_nhwc",
    "Claimed",
    "find_convs",
    "claim_calls",
    "claim_convs",
    "rebuild_main",
]
