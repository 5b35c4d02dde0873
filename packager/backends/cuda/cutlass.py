"""NVIDIA's CUTLASS on the Jetson GPU path: convolutions as implicit GEMM on the tensor cores (#42, first part).

CUTLASS 4.1.0 ships inside the ``apache-tvm`` wheel (``tvm/3rdparty/cutlass/include``); nothing is downloaded.
A convolution becomes one CUTLASS Sm80 kernel (``DefaultConv2dFpropWithBroadcast``: NHWC activations, OHWI
weights, fp16 x fp16 with fp32 accumulation, ``mma.sync`` through ``ldmatrix`` and ``cp.async``), with its
epilogue fused: ``act(conv + residual + bias)``, the bias broadcast per output channel. Sm80 templates use only
Ampere instructions, so the same source runs on the Orin (sm_87) and on Hopper (sm_90).

How it reaches a TVM module (checked here without a GPU: it compiles, and its SASS is read):
- each layer is a scheduled TIR PrimFunc (``prim_func``) whose one statement calls an ``extern "C" __device__``
  wrapper (``device_source``) with the raw pointers and a dynamic shared-memory buffer of the kernel's
  ``SharedStorage`` size; TVM launches it with the kernel's grid and block (TVM's CUDA runtime opts in to
  more than 48 KiB of dynamic shared memory itself);
- the wrapper builds CUTLASS's ``Params`` on the device from the problem's constants (shapes are static in a
  bundle) and runs the kernel's ``operator()``;
- ``tvm_callback_cuda_postproc`` (``wrappers_in_module``) puts the wrappers in front of the module's CUDA
  source, and NVRTC (the edgeq toolkit, ``TVM_CUDA_NVRTC_EXTRA_OPTS``) gets CUTLASS's include folder.

``replay`` is the independent host implementation (numpy, float32) of what a kernel is asked to compute;
``problem_from_conv`` maps an ONNX/Relax NCHW convolution to the NHWC problem, input channels padded with zero
weights to the kernel's alignment. Not here yet: int8 (CUTLASS 2.x's conv epilogues take one per-channel vector,
and a requantizing epilogue needs two: scale and bias), the graph rewrite that puts these kernels in a
bundle (``--gpu-kernels cutlass``), GEMM, depthwise. docs/architecture.md says where this stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

ACTIVATIONS = {  # name -> CUTLASS elementwise functor on float (edgeq's own where CUTLASS has none)
    "identity": "cutlass::epilogue::thread::Identity<float>",
    "relu": "cutlass::epilogue::thread::ReLu<float>",
    "relu6": "edgeq_cutlass::Relu6",
    "silu": "cutlass::epilogue::thread::SiLu<float>",
    "hardswish": "cutlass::epilogue::thread::HardSwish<float>",
    "gelu": "cutlass::epilogue::thread::GELU<float>",
}
ALIGNMENT = 8  # fp16 elements per 128-bit access: channels are padded to a multiple of it
PREAMBLE = r"""
#include <cuda/std/type_traits>
namespace std { using cuda::std::void_t; }  // NVRTC: CUTLASS's bias-elementwise epilogue names std::void_t
#include <cutlass/cutlass.h>
#include <cutlass/conv/kernel/default_conv2d_fprop_with_broadcast.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/epilogue/thread/linear_combination_bias_elementwise.h>
namespace edgeq_cutlass {
struct Relu6 {
  CUTLASS_HOST_DEVICE float operator()(float x) const { return x < 0.f ? 0.f : (x > 6.f ? 6.f : x); }
};
}  // namespace edgeq_cutlass
"""


def cutlass_include() -> Path:
    """CUTLASS's headers in the installed apache-tvm wheel."""
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    root = Path(spec.origin).parent / "3rdparty" / "cutlass" / "include"
    if not (root / "cutlass" / "version.h").is_file():
        from edgeq.errors import ToolchainError

        raise ToolchainError(f"the apache-tvm wheel here has no CUTLASS headers ({root}); reinstall apache-tvm")
    return root


def cutlass_version() -> str:
    """"4.1.0": CUTLASS_MAJOR.MINOR.PATCH of the wheel's headers (the manifest records it)."""
    text = (cutlass_include() / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


@dataclasses.dataclass(frozen=True)
class Conv2dProblem:
    """One 2-D convolution, NHWC in, OHWI weights, NHWC out (CUTLASS's ``Conv2dProblemSize``)."""

    n: int
    h: int
    w: int
    c: int  # input channels, padded to ALIGNMENT
    k: int  # output channels
    r: int
    s: int
    pad: tuple[int, int] = (0, 0)  # top/left (CUTLASS pads bottom/right to what the output size needs)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    c_real: int = 0  # the model's input channels before padding (0: c)

    @property
    def p(self) -> int:
        return (self.h + 2 * self.pad[0] - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def q(self) -> int:
        return (self.w + 2 * self.pad[1] - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    @property
    def gemm(self) -> tuple[int, int, int]:
        """Implicit GEMM (M, N, K): output pixels, output channels, the reduction."""
        return self.n * self.p * self.q, self.k, self.r * self.s * self.c

    @property
    def flops(self) -> int:
        m, n, _ = self.gemm
        return 2 * m * n * self.r * self.s * (self.c_real or self.c)


def problem_from_conv(x_shape: Sequence[int], w_shape: Sequence[int], pads: Sequence[int], strides: Sequence[int],
                      dilations: Sequence[int]) -> Conv2dProblem | None:
    """The NHWC problem of an NCHW convolution (ONNX Conv / Relax conv2d attributes: pads top, left, bottom, right);
    None where CUTLASS's kernel cannot take it: groups, asymmetric padding, or fewer than 3 input channels."""
    n, c, h, w = x_shape
    k, c_w, r, s = w_shape
    if c_w != c or len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3] or c < 3:
        return None
    padded = -(-c // ALIGNMENT) * ALIGNMENT
    return Conv2dProblem(n, h, w, padded, k, r, s, (pads[0], pads[1]), tuple(strides), tuple(dilations), c_real=c)


@dataclasses.dataclass(frozen=True)
class Tile:
    """A CUTLASS tile: threadblock and warp shapes (M, N, K) and the software pipeline's stages."""

    block: tuple[int, int, int]
    warp: tuple[int, int, int]
    stages: int

    @property
    def threads(self) -> int:
        return (self.block[0] // self.warp[0]) * (self.block[1] // self.warp[1]) * 32

    def mainloop_bytes(self, element_bytes: int = 2) -> int:
        """Shared memory of the multistage mainloop: ``stages`` tiles of A and B (the epilogue's shares it)."""
        return self.stages * (self.block[0] + self.block[1]) * self.block[2] * element_bytes


# (threadblock, warp) shapes for fp16 Sm80 tensor-op convolutions, largest first; CUTLASS's own profiler set
TILES = (((128, 128, 32), (64, 64, 32)), ((128, 64, 32), (64, 32, 32)), ((64, 64, 32), (32, 32, 32)))


def choose_tile(problem: Conv2dProblem, sm_count: int, smem_per_block: int) -> Tile:
    """The tile table: the largest threadblock tile whose CTAs still fill every SM once (a wave), else the
    smallest; then the most stages (up to 4) whose mainloop fits the profile's shared memory per block."""
    m, n, _ = problem.gemm
    fitting = [t for t in TILES if t[0][1] <= max(64, -(-n // 64) * 64)] or list(TILES)  # no tile wider than N
    chosen = fitting[-1]
    for block, warp in fitting:
        ctas = -(-m // block[0]) * -(-n // block[1])
        if ctas >= sm_count:
            chosen = (block, warp)
            break
    stages = 4
    while stages > 2 and Tile(chosen[0], chosen[1], stages).mainloop_bytes() > smem_per_block:
        stages -= 1
    return Tile(chosen[0], chosen[1], stages)


@dataclasses.dataclass(frozen=True)
class ConvKernel:
    """What edgeq asks one CUTLASS convolution to compute: ``act(conv(x, w) + residual + bias)`` in fp16."""

    name: str  # a C identifier, unique in its module (the TVM function is cutlass_<name>)
    problem: Conv2dProblem
    tile: Tile
    activation: str = "identity"
    residual: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        """(CTAs along M, CTAs along N): GemmIdentityThreadblockSwizzle<1>, no split-K."""
        m, n, _ = self.problem.gemm
        return -(-m // self.tile.block[0]), -(-n // self.tile.block[1])

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        return (
            "typename cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<"
            "cutlass::half_t, cutlass::layout::TensorNHWC, cutlass::half_t, cutlass::layout::TensorNHWC, "
            "cutlass::half_t, cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
            f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
            "cutlass::gemm::GemmShape<16, 8, 16>, "
            "cutlass::epilogue::thread::LinearCombinationBiasElementwise<cutlass::half_t, float, float, cutlass::half_t, "
            f"cutlass::half_t, {ALIGNMENT}, {ACTIVATIONS[self.activation]}, cutlass::plus<float>, false, cutlass::half_t>, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            "cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized, "
            "cutlass::conv::StrideSupport::kStrided>::Kernel"
        )


def device_source(kernels: Sequence[ConvKernel]) -> str:
    """The CUDA source of the kernels' device wrappers: ``edgeq_cutlass_<name>(x, w, bias, residual, y, smem)``
    and, per kernel, ``edgeq_smem_<name>``, an array as large as the kernel's shared storage (``smem_sizes``
    reads it from the cubin's symbol table)."""
    out = [PREAMBLE]
    for kern in kernels:
        p = kern.problem
        t = f"Kernel_{kern.name}"
        out.append(f"""
namespace edgeq_cutlass {{ using {t} = {kern.kernel_type}; }}
// the kernel's shared storage, then its Params (built once per block, by thread 0)
constexpr size_t edgeq_params_at_{kern.name} = (sizeof(edgeq_cutlass::{t}::SharedStorage) + 15) / 16 * 16;
__device__ char edgeq_smem_{kern.name}[edgeq_params_at_{kern.name} + sizeof(typename edgeq_cutlass::{t}::Params)];
extern "C" __device__ void edgeq_cutlass_{kern.name}(half* x, half* w, half* bias, half* residual, half* y,
                                                    unsigned char* smem) {{
  using namespace cutlass;
  using K = edgeq_cutlass::{t};
  conv::Conv2dProblemSize problem({p.n}, {p.h}, {p.w}, {p.c}, {p.k}, {p.r}, {p.s}, {p.p}, {p.q}, {p.pad[0]}, {p.pad[1]},
                                  {p.stride[0]}, {p.stride[1]}, {p.dilation[0]}, {p.dilation[1]},
                                  conv::Mode::kCrossCorrelation, 1);
  layout::TensorNHWC out_layout = layout::TensorNHWC::packed({{{p.n}, {p.p}, {p.q}, {p.k}}});
  typename K::Arguments args(
      problem, {{reinterpret_cast<half_t*>(x), layout::TensorNHWC::packed({{{p.n}, {p.h}, {p.w}, {p.c}}})}},
      {{reinterpret_cast<half_t*>(w), layout::TensorNHWC::packed({{{p.k}, {p.r}, {p.s}, {p.c}}})}},
      {{reinterpret_cast<half_t*>({"residual" if kern.residual else "y"}), out_layout}},
      {{reinterpret_cast<half_t*>(y), out_layout}},
      {{1.0f, {"1.0f" if kern.residual else "0.0f"}}}, conv::SplitKMode::kSerial, reinterpret_cast<half_t*>(bias),
      nullptr, 0, 0);
  auto* params = reinterpret_cast<typename K::Params*>(smem + edgeq_params_at_{kern.name});
  if (threadIdx.x == 0) new (params) typename K::Params(args);
  __syncthreads();
  K op;
  op(*params, *reinterpret_cast<typename K::SharedStorage*>(smem));
}}
""")
    return "".join(out)


def nvrtc_options() -> str:
    """NVRTC options CUTLASS needs beyond TVM's (``TVM_CUDA_NVRTC_EXTRA_OPTS``): C++17 and its include folder."""
    return f"-std=c++17 -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1 -I{cutlass_include()}"


@contextlib.contextmanager
def wrappers_in_module(kernels: Sequence[ConvKernel]) -> Iterator[None]:
    """For the duration of a build: the kernels' wrappers go in front of any CUDA source that calls one, and
    NVRTC finds CUTLASS's headers."""
    import tvm_ffi

    by_name = {k.name: k for k in kernels}
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def postproc(code, target=None):
        used = [by_name[n] for n in sorted(set(re.findall(r"edgeq_cutlass_(\w+)\(", code))) if n in by_name]
        return device_source(used) + "\n" + code if used else code

    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", postproc, override=True)
    try:
        with _nvrtc_include():
            yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", previous, override=True)
        else:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", lambda code, target=None: code, override=True)


def prim_func(kernel: ConvKernel, smem_bytes: int, bias_shape: Sequence[int] | None = None):
    """The scheduled TIR function TVM launches for ``kernel``: its grid and block, ``smem_bytes`` of dynamic shared
    memory, and one call of the device wrapper. Arguments: x [N, H, W, C], w [K, R, S, C], bias (``bias_shape``,
    K elements; default [K]), residual [N, P, Q, K] where ``kernel.residual``, y [N, P, Q, K], all fp16."""
    from tvm.script import tirx as T

    p, (gm, gn), threads = kernel.problem, kernel.grid, kernel.tile.threads
    smem_bytes = -(-smem_bytes // 16) * 16
    xs, ws, ys = (p.n, p.h, p.w, p.c), (p.k, p.r, p.s, p.c), (p.n, p.p, p.q, p.k)
    bs = tuple(bias_shape or (p.k,))
    wrapper = f"edgeq_cutlass_{kernel.name}"

    if kernel.residual:
        @T.prim_func(s_tir=True)
        def func(x: T.handle, w: T.handle, b: T.handle, res: T.handle, y: T.handle):
            T.func_attr({"tirx.noalias": True})
            X = T.match_buffer(x, xs, "float16")
            W = T.match_buffer(w, ws, "float16")
            B = T.match_buffer(b, bs, "float16")
            RES = T.match_buffer(res, ys, "float16")
            Y = T.match_buffer(y, ys, "float16")
            with T.sblock("root"):
                smem = T.alloc_buffer((smem_bytes,), "uint8", scope="shared.dyn")
                for bx in T.thread_binding(gm, thread="blockIdx.x"):
                    for by in T.thread_binding(gn, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            with T.sblock("cutlass"):
                                T.reads(X[0:xs[0], 0:xs[1], 0:xs[2], 0:xs[3]], W[0:ws[0], 0:ws[1], 0:ws[2], 0:ws[3]],
                                        B[0:bs[0], 0:bs[1], 0:bs[2], 0:bs[3]] if len(bs) == 4 else B[0:bs[0]],
                                        RES[0:ys[0], 0:ys[1], 0:ys[2], 0:ys[3]], smem[0:smem_bytes])
                                T.writes(Y[0:ys[0], 0:ys[1], 0:ys[2], 0:ys[3]])
                                T.evaluate(T.call_extern("void", wrapper, X.data, W.data, B.data, RES.data, Y.data,
                                                         smem.data))
    else:
        @T.prim_func(s_tir=True)
        def func(x: T.handle, w: T.handle, b: T.handle, y: T.handle):
            T.func_attr({"tirx.noalias": True})
            X = T.match_buffer(x, xs, "float16")
            W = T.match_buffer(w, ws, "float16")
            B = T.match_buffer(b, bs, "float16")
            Y = T.match_buffer(y, ys, "float16")
            with T.sblock("root"):
                smem = T.alloc_buffer((smem_bytes,), "uint8", scope="shared.dyn")
                for bx in T.thread_binding(gm, thread="blockIdx.x"):
                    for by in T.thread_binding(gn, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            with T.sblock("cutlass"):
                                T.reads(X[0:xs[0], 0:xs[1], 0:xs[2], 0:xs[3]], W[0:ws[0], 0:ws[1], 0:ws[2], 0:ws[3]],
                                        B[0:bs[0], 0:bs[1], 0:bs[2], 0:bs[3]] if len(bs) == 4 else B[0:bs[0]],
                                        smem[0:smem_bytes])
                                T.writes(Y[0:ys[0], 0:ys[1], 0:ys[2], 0:ys[3]])
                                T.evaluate(T.call_extern("void", wrapper, X.data, W.data, B.data, Y.data, Y.data,
                                                         smem.data))

    return func.with_attrs({"global_symbol": f"cutlass_{kernel.name}", "tirx.is_scheduled": True, "op_pattern": 8})  # opaque: never fused


def elf_symbol_sizes(cubin: bytes, prefix: str) -> dict[str, int]:
    """{symbol: st_size} of the ELF64 symbols whose names start with ``prefix`` (a cubin's ``.symtab``)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    out = {}
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, _info, _other, _shndx, _value, size = struct.unpack_from("<IBBHQQ", cubin, off)
            start = strtab[4] + name_off
            name = cubin[start:cubin.index(b"\0", start)].decode()
            if name.startswith(prefix):
                out[name[len(prefix):]] = size
    return out


def replay(kernel: ConvKernel, x: np.ndarray, w: np.ndarray, bias: np.ndarray,
           residual: np.ndarray | None = None) -> np.ndarray:
    """What the kernel is asked to compute, on the host in float32 (independent of CUTLASS and TVM): x NHWC
    [N, H, W, C], w OHWI [K, R, S, C] (channels padded), bias [K]; the result rounded to fp16 as the epilogue's
    conversion does. Bottom/right padding is what the output size reaches (CUTLASS's implicit-GEMM iterators)."""
    p = kernel.problem
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    xp = np.zeros((p.n, p.h + 2 * ph + p.r * dh, p.w + 2 * pw + p.s * dw, p.c), np.float32)
    xp[:, ph:ph + p.h, pw:pw + p.w, :] = x.astype(np.float32)
    acc = np.zeros((p.n, p.p, p.q, p.k), np.float32)
    wf = w.astype(np.float32)
    for i in range(p.r):
        for j in range(p.s):
            patch = xp[:, i * dh:i * dh + sh * (p.p - 1) + 1:sh, j * dw:j * dw + sw * (p.q - 1) + 1:sw, :]
            acc += np.einsum("npqc,kc->npqk", patch, wf[:, i, j, :], optimize=True)
    if residual is not None:
        acc = acc + residual.astype(np.float32)
    z = acc + bias.astype(np.float32)
    z = {"identity": lambda v: v, "relu": lambda v: np.maximum(v, 0), "relu6": lambda v: np.clip(v, 0, 6),
         "silu": lambda v: v / (1 + np.exp(-v)), "hardswish": lambda v: v * np.clip(v + 3, 0, 6) / 6,
         "gelu": lambda v: 0.5 * v * (1 + _erf(v / np.sqrt(2.0)))}[kernel.activation](z)
    return z.astype(np.float16)


def _erf(v: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf)(v.astype(np.float64)).astype(np.float32)


def pad_weights(w_oihw: np.ndarray, problem: Conv2dProblem) -> np.ndarray:
    """ONNX/Relax OIHW weights as the kernel takes them: OHWI, input channels padded with zeros."""
    ohwi = np.transpose(w_oihw, (0, 2, 3, 1))
    return np.pad(ohwi, ((0, 0), (0, 0), (0, 0), (0, problem.c - ohwi.shape[3])))


def pad_input(x_nchw: np.ndarray, problem: Conv2dProblem) -> np.ndarray:
    """An NCHW activation as the kernel takes it: NHWC, channels padded with zeros."""
    nhwc = np.transpose(x_nchw, (0, 2, 3, 1))
    return np.pad(nhwc, ((0, 0), (0, 0), (0, 0), (0, problem.c - nhwc.shape[3])))


def kernel_record(kernel: ConvKernel, smem_bytes: int) -> dict:
    """What the manifest says of one CUTLASS kernel: template, tile, the problem, the epilogue, FLOPs."""
    p = kernel.problem
    return {"function": f"cutlass_{kernel.name}", "template": "DefaultConv2dFpropWithBroadcast (Sm80, fp16, fp32 accumulation)",
            "tile": list(kernel.tile.block), "warp": list(kernel.tile.warp), "stages": kernel.tile.stages,
            "threads": kernel.tile.threads, "grid": list(kernel.grid), "shared_bytes": smem_bytes,
            "problem": {"nhwc": [p.n, p.h, p.w, p.c], "k": p.k, "rs": [p.r, p.s], "pad": list(p.pad),
                        "stride": list(p.stride), "dilation": list(p.dilation)},
            "activation": kernel.activation, "residual": kernel.residual, "precision": "fp16", "flops": p.flops}


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What the cubin says of one kernel: tensor-core instructions, registers, stack, spills, shared memory."""

    name: str
    arch: str
    mma: int  # HMMA instructions in its SASS
    registers: int
    stack_bytes: int
    local_bytes: int  # local memory beyond the stack: spills
    shared_bytes: int  # dynamic shared memory it is launched with
    threads: int
    grid: tuple[int, int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def smem_sizes(kernels: Sequence[ConvKernel], arch: str) -> dict[str, int]:
    """sizeof(SharedStorage) of each kernel, read from a cubin of its wrapper (NVRTC, no GPU)."""
    from tvm.support import nvcc

    with _nvrtc_include():
        cubin = bytes(nvcc.compile_cuda(device_source(kernels), target_format="cubin", arch=arch))
    return elf_symbol_sizes(cubin, "edgeq_smem_")


@contextlib.contextmanager
def _nvrtc_include() -> Iterator[None]:
    saved = os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS")
    os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = f"{saved or ''} {nvrtc_options()}".strip()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TVM_CUDA_NVRTC_EXTRA_OPTS", None)
        else:
            os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = saved


def build_module(kernels: Sequence[ConvKernel], target, toolkit, folder: Path) -> tuple[Path, dict[str, int]]:
    """The kernels as one TVM module for ``target`` (``tvm.target.Target`` of kind cuda), exported as a shared
    library into ``folder``: (the library, {kernel: shared bytes})."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    arch = target.attrs["arch"]
    with toolkit.active():
        sizes = smem_sizes(kernels, arch)
        mod = tvm.IRModule({f"cutlass_{k.name}": prim_func(k, sizes[k.name]) for k in kernels})
        with wrappers_in_module(kernels), target:
            lib = tvm.tirx.build(mod, target=target)
    library = folder / f"cutlass_{arch}.so"
    lib.export_library(str(library))
    return library, sizes


def read_kernels(library: Path, kernels: Sequence[ConvKernel], sizes: dict[str, int]) -> list[KernelReport]:
    """Each kernel's KernelReport, from the cubin in ``library`` (cuobjdump -sass and -res-usage)."""
    import subprocess
    import tempfile

    from edgeq.backends.cuda.cubin import cuda_images, cuda_tool

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    reports = []
    for image in cuda_images(library):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image.data)
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env).stdout
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, env=env).stdout
        functions = dict(re.findall(r"Function ([\w$]+):\s*\n\s*(REG:.*)", usage))
        bodies = dict(re.findall(r"Function : ([\w$]+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S))
        for kern in kernels:
            symbol = next((f for f in functions if f.startswith(f"cutlass_{kern.name}_kernel")), None)
            if symbol is None:
                continue
            fields = dict(re.findall(r"(\w+):(\d+)", functions[symbol]))
            reports.append(KernelReport(kern.name, image.arch, len(re.findall(r"\bHMMA\.", bodies.get(symbol, ""))),
                                        int(fields.get("REG", 0)), int(fields.get("STACK", 0)),
                                        int(fields.get("LOCAL", 0)), sizes[kern.name], kern.tile.threads, kern.grid))
    return reports


# ------------------------------------------------------------------ the graph: NHWC, then CUTLASS calls

def prepare_nhwc(graph):
    """The CUDA graph for CUTLASS: every convolution NHWC with OHWI weights (Relax's ConvertLayout, which carries
    NHWC through the element-wise operators between them: one transpose at each end), the weights' transposes
    done now, and input channels that are not a multiple of ALIGNMENT padded (zero weights, and the activation
    padded with zeros by a pad before the convolution). Plain Relax: it builds for any target, so the golden
    outputs check this layout and padding on the build host."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import fresh_name, precompute_weight_ops
    from edgeq.tvm_env import relax

    # clips as maximum/minimum of a scalar constant first: ConvertLayout carries NHWC through those, not through
    # relax.clip or the TIR calls ONNX Clip with weight bounds imports as
    graph = rewrite(graph, _clip_as_max_min)
    mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(graph.mod)
    graph = precompute_weight_ops(type(graph)(mod, graph.weights))

    def visit(rw, var, value):
        if call_op(value) != "relax.nn.conv2d" or value.attrs.data_layout != "NHWC" or int(value.attrs.groups) != 1:
            return None
        w = rw.weight(value.args[1])
        if w is None or w.ndim != 4 or w.shape[3] % ALIGNMENT == 0 or w.shape[3] < 3:
            return None
        extra = -w.shape[3] % ALIGNMENT
        padded_w = rw.param(fresh_name(rw, f"{value.args[1].name}_c{w.shape[3] + extra}"),
                            np.pad(w, ((0, 0), (0, 0), (0, 0), (0, extra))))
        x = rw.emit(relax.op.nn.pad(rw.new(value.args[0]), [0, 0, 0, 0, 0, 0, 0, extra]))
        return relax.Call(value.op, [x, padded_w], value.attrs)

    return rewrite(graph, visit)


def _clip_as_max_min(rw, var, value):
    """relax.clip with immediate bounds, and TIR maximum/minimum calls with a one-element static bound, as
    ``relax.maximum``/``relax.minimum`` of a 0-d constant (the same values)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of
    from edgeq.tvm_env import relax, tvm

    op = call_op(value)
    if op == "relax.clip" and all(isinstance(a, (tvm.tirx.IntImm, tvm.tirx.FloatImm)) for a in value.args[1:]):
        dtype = dtype_of(value.args[0]) or "float32"
        low, high = (relax.const(float(a.value), dtype) for a in value.args[1:])
        return relax.op.minimum(rw.emit(relax.op.maximum(rw.new(value.args[0]), low)), high)
    if op != "relax.call_tir" or not isinstance(value.args[1], relax.Tuple) or len(value.args[1].fields) != 2:
        return None
    name = value.args[0].name_hint
    tir_op = relax.op.maximum if name.startswith("maximum") else relax.op.minimum if name.startswith("minimum") else None
    bound = rw.static_value(value.args[1].fields[1])
    if tir_op is None or bound is None or bound.size != 1:
        return None
    dtype = dtype_of(value.args[1].fields[0]) or "float32"
    return tir_op(rw.new(value.args[1].fields[0]), relax.const(np.asarray(bound, dtype).reshape(()), dtype))


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
    bias_shape: tuple[int, ...]


def _const_scalar(expr, value_of=None) -> float | None:
    """A one-element constant's value, also behind a variable bound to an astype of one (how ToMixedPrecision
    leaves a clip's bounds)."""
    from edgeq.graph import call_op, const_value

    if value_of is not None and expr in value_of and call_op(value_of[expr]) == "relax.astype":
        expr = value_of[expr].args[0]
    value = const_value(expr)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def find_convs(main, sm_count: int, smem_per_block: int) -> tuple[list[Claimed], list[dict]]:
    """The fp16 chains ``conv2d(NHWC, OHWI, fp32 out) -> astype fp16 -> + bias -> [+ residual] -> [relu | relu6]``
    of ``main`` whose intermediate values have no other reader, as kernels; and the conv2d calls left out, each
    with why (for the manifest)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings = [b for block in main.body.blocks for b in block.bindings]
    value_of = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for v in set(_free_vars(b.value)):
            readers.setdefault(v, []).append(b.var)
    for v in _free_vars(main.body.body):
        readers.setdefault(v, []).append(None)
    params = set(main.params[int(main.attrs["num_input"]):])

    def only_reader(var):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None else None

    claimed, left, taken = [], [], set()
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.nn.conv2d":
            continue
        attrs = value.attrs
        why = None
        x, w = value.args
        if attrs.data_layout != "NHWC" or attrs.kernel_layout != "OHWI" or int(attrs.groups) != 1:
            why = f"{attrs.data_layout}/{attrs.kernel_layout}, groups {int(attrs.groups)}"
        elif dtype_of(b.var) != "float32" or dtype_of(x) != "float16":
            why = "not fp16 with fp32 accumulation"
        elif w not in params:
            why = "weights computed at run time"
        pads = [int(p) for p in attrs.padding]
        if why is None and (pads[0] != pads[2] or pads[1] != pads[3]):
            why = "asymmetric padding"
        xs, ws = shape_of(x), shape_of(w)
        if why is None and (xs is None or ws is None or xs[3] % ALIGNMENT or ws[0] % ALIGNMENT):
            why = "channels not a multiple of 8"
        cast = only_reader(b.var)
        if why is None and (cast is None or call_op(value_of[cast]) != "relax.astype"
                            or str(value_of[cast].attrs.dtype) != "float16"):
            why = "no fp16 cast after it"
        add = only_reader(cast) if why is None else None
        if why is None and (add is None or call_op(value_of[add]) != "relax.add"):
            why = "no bias after it"
        bias = None
        if why is None:
            other = [a for a in value_of[add].args if not a.same_as(cast)]
            bias = other[0] if other and other[0] in params else None
            if bias is None or shape_of(bias) is None or int(np.prod(shape_of(bias))) != ws[0] or shape_of(bias)[-1] != ws[0]:
                why = "no per-channel bias after it"
        if why is not None:
            left.append({"conv": b.var.name, "why": why})
            continue
        chain = [b.var, cast, add]
        residual, activation = None, "identity"
        nxt = only_reader(chain[-1])
        if nxt is not None and nxt in taken:  # another chain's residual add: this output is its residual
            nxt = None
        if nxt is not None and call_op(value_of[nxt]) == "relax.add":
            other = [a for a in value_of[nxt].args if not a.same_as(chain[-1])]
            if other and shape_of(other[0]) == shape_of(b.var) and dtype_of(other[0]) == "float16":
                residual = other[0]
                chain.append(nxt)
                nxt = only_reader(nxt)
        if nxt is not None and call_op(value_of[nxt]) == "relax.nn.relu":
            activation = "relu"
            chain.append(nxt)
        elif nxt is not None and call_op(value_of[nxt]) == "relax.maximum" and \
                _const_scalar(value_of[nxt].args[1], value_of) == 0.0:
            activation = "relu"
            chain.append(nxt)
            after = only_reader(nxt)
            if after is not None and call_op(value_of[after]) == "relax.minimum" and \
                    _const_scalar(value_of[after].args[1], value_of) == 6.0:
                activation = "relu6"
                chain.append(after)
        problem = Conv2dProblem(xs[0], xs[1], xs[2], xs[3], ws[0], ws[1], ws[2], (pads[0], pads[1]),
                                tuple(int(s) for s in attrs.strides), tuple(int(d) for d in attrs.dilation),
                                c_real=xs[3] - _channels_padded(x, value_of))
        kernel = ConvKernel(f"l{len(claimed)}", problem, choose_tile(problem, sm_count, smem_per_block), activation,
                            residual is not None)
        claimed.append(Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]), tuple(shape_of(bias))))
        taken.update(chain)
    return claimed, left


def _channels_padded(x, value_of) -> int:
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


def _ty(var):
    return getattr(var, "struct_info", None) or var.ty


def _free_vars(expr):
    from edgeq.tvm_env import relax

    return relax.analysis.free_vars(expr)


def claim_convs(mod, claimed: Sequence[Claimed], sizes: dict[str, int]):
    """``mod`` with each claimed chain replaced by one ``call_tir`` of its kernel's PrimFunc (added to the module):
    the chain's last binding becomes the call, its other bindings go."""
    from edgeq.tvm_env import relax, tvm

    main = mod["main"]
    by_output = {c.output: c for c in claimed}
    dropped = {var for c in claimed for var in c.chain}
    bb = relax.BlockBuilder(mod)
    gvars = {c.kernel.name: bb.add_func(prim_func(c.kernel, sizes[c.kernel.name], c.bias_shape), f"cutlass_{c.kernel.name}")
             for c in claimed}
    functions = dict(bb.get().functions)
    blocks = []
    for block in main.body.blocks:
        new = []
        for b in block.bindings:
            if b.var in dropped:
                continue
            c = by_output.get(b.var)
            if c is not None:
                args = [c.x, c.w, c.bias] + ([c.residual] if c.residual is not None else [])
                call = relax.call_tir(gvars[c.kernel.name], relax.Tuple(args), _ty(b.var))
                b = relax.VarBinding(b.var, call)
            new.append(b)
        blocks.append(type(block)(new))
    body = relax.SeqExpr(blocks, main.body.body)
    out = tvm.IRModule(functions)
    out["main"] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    return out


def twin_prim_func(kernel: ConvKernel, bias_shape: Sequence[int]):
    """A plain TIR function (TE, no CUTLASS) with the signature and the arithmetic of ``kernel``'s PrimFunc:
    the independent host implementation a rewritten graph is run with on the build host (``with_twins``)."""
    from edgeq.tvm_env import tvm

    te = tvm.te
    p = kernel.problem
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    x = te.placeholder((p.n, p.h, p.w, p.c), "float16", "x")
    w = te.placeholder((p.k, p.r, p.s, p.c), "float16", "w")
    b = te.placeholder(tuple(bias_shape), "float16", "b")
    res = te.placeholder((p.n, p.p, p.q, p.k), "float16", "res") if kernel.residual else None
    zero = tvm.tirx.const(0.0, "float16")
    xp = te.compute((p.n, p.h + 2 * ph, p.w + 2 * pw, p.c), lambda i, y, z, c: tvm.tirx.if_then_else(
        tvm.tirx.all(y >= ph, y < p.h + ph, z >= pw, z < p.w + pw), x[i, y - ph, z - pw, c], zero), "xp")
    rc, ry, rx = te.reduce_axis((0, p.c), "rc"), te.reduce_axis((0, p.r), "ry"), te.reduce_axis((0, p.s), "rx")
    acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
        xp[i, y * sh + ry * dh, z * sw + rx * dw, rc].astype("float32") * w[o, ry, rx, rc].astype("float32"),
        axis=[ry, rx, rc]), "acc")

    def epilogue(i, y, z, o):
        v = acc[i, y, z, o]
        if res is not None:
            v = v + res[i, y, z, o].astype("float32")
        v = v + (b[0, 0, 0, o] if len(bias_shape) == 4 else b[o]).astype("float32")
        if kernel.activation == "relu":
            v = tvm.te.max(v, tvm.tirx.const(0.0, "float32"))
        elif kernel.activation == "relu6":
            v = tvm.te.min(tvm.te.max(v, tvm.tirx.const(0.0, "float32")), tvm.tirx.const(6.0, "float32"))
        elif kernel.activation != "identity":
            raise ValueError(f"no host twin for activation {kernel.activation}")
        return v.astype("float16")

    y = te.compute((p.n, p.p, p.q, p.k), epilogue, "y")
    args = [x, w, b] + ([res] if res is not None else []) + [y]
    return te.create_prim_func(args)


def with_twins(mod, claimed: Sequence[Claimed]):
    """A rewritten module (``claim_convs``) with each CUTLASS PrimFunc swapped for its ``twin_prim_func``: it runs
    on the build host, so the rewrite (which operands went where, the fused epilogue) is checked there."""
    from edgeq.tvm_env import tvm

    functions = dict(mod.functions)
    for gv in list(functions):
        for c in claimed:
            if gv.name_hint == f"cutlass_{c.kernel.name}":
                # opaque to fusion, as the CUTLASS call it stands for
                functions[gv] = twin_prim_func(c.kernel, c.bias_shape).with_attrs({"global_symbol": gv.name_hint, "op_pattern": 8})
    return tvm.IRModule(functions)
