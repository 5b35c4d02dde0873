"""Independent host implementations of what edgeq's CUTLASS kernels are asked to compute (numpy, no CUTLASS or
TVM), the operand layouts they take, and what a built module's cubin says of each kernel (cuobjdump). Only tests
use these; the package has the kernels' TIR twins (edgeq.backends.cuda.cutlass.twins), which the reference
check runs."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgeq.backends.cuda.cutlass.kernels import ConvKernel, GemmKernel, TokenLinearKernel
from edgeq.backends.cuda.cutlass.problems import ALIGNMENT, Conv2dProblem, alignment
from edgeq.backends.cuda.device_math import silu_rn_numpy


def _x_slice(kernel, x: np.ndarray) -> np.ndarray:
    """The channels of x a kernel reads (``ConvKernel.x_view``: a slice of a wider tensor)."""
    if getattr(kernel, "x_view", None) is None:
        return x
    c0 = kernel.x_view[0]
    return x[..., c0:c0 + kernel.problem.c]


def _accumulate(p: Conv2dProblem, x: np.ndarray, w: np.ndarray, dtype) -> np.ndarray:
    """The convolution's sums [N, P, Q, K] in ``dtype`` (float32, or int64: exact for int8): x NHWC, w OHWI (a
    depthwise problem's HWOI [R, S, K, 1]), zero padding; bottom/right padding is what the output size reaches
    (CUTLASS's implicit-GEMM iterators)."""
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    xp = np.zeros((p.n, p.h + 2 * ph + p.r * dh, p.w + 2 * pw + p.s * dw, p.c), dtype)
    xp[:, ph:ph + p.h, pw:pw + p.w, :] = x
    acc = np.zeros((p.n, p.p, p.q, p.k), dtype)
    wd = w.astype(dtype)
    for i in range(p.r):
        for j in range(p.s):
            patch = xp[:, i * dh:i * dh + sh * (p.p - 1) + 1:sh, j * dw:j * dw + sw * (p.q - 1) + 1:sw, :]
            if p.depthwise:  # one filter per channel
                acc += patch * wd[i, j, :, 0]
            elif p.groups > 1:  # group g: output channels [g kg, (g + 1) kg) from input channels [g cg, (g + 1) cg)
                kg, cg = p.k // p.groups, p.c // p.groups
                for g in range(p.groups):
                    acc[..., g * kg:(g + 1) * kg] += np.einsum("npqc,kc->npqk", patch[..., g * cg:(g + 1) * cg],
                                                               wd[g * kg:(g + 1) * kg, i, j, :], optimize=True)
            else:
                acc += np.einsum("npqc,kc->npqk", patch, wd[:, i, j, :], optimize=True)
    return acc


def replay(kernel: ConvKernel, x: np.ndarray, w: np.ndarray, bias: np.ndarray,
           residual: np.ndarray | None = None) -> np.ndarray:
    """What the kernel is asked to compute, on the host in float32 (independent of CUTLASS and TVM): x NHWC
    [N, H, W, C], w OHWI [K, R, S, C] (channels padded), bias [K]; the result rounded to fp16 as the epilogue's
    conversion does (float32 unrounded for a ``float_out`` kernel); the residual added before the bias, or after the
    activation (``residual_after``); with split-K (``Tile.split_k``) the slices' partial sums in CUTLASS's order,
    each rounded to the output's type. Bottom/right padding is what the output size reaches (CUTLASS's implicit-GEMM
    iterators)."""
    x = _x_slice(kernel, x)
    slices = kernel.tile.split_k if kernel.tile is not None else 1
    out = np.float32 if kernel.float_out else np.float16
    if slices > 1:  # serial split-K: slice j sums the channel tiles t with t % slices == j (every filter tap); each
        # slice adds the partial sum the one before left in the output, in the output's type
        tile_of = np.arange(kernel.problem.c) // kernel.tile.block[2] % slices
        parts = [_accumulate(kernel.problem, np.where(tile_of == j, x, 0), w, np.float32) for j in range(slices)]
        acc = parts[0] + (residual.reshape(parts[0].shape).astype(np.float32) if residual is not None else 0)
        for part in parts[1:]:
            acc = part + acc.astype(out).astype(np.float32)
    else:
        acc = _accumulate(kernel.problem, x, w, np.float32)
        if residual is not None and not kernel.residual_after:
            acc = acc + residual.reshape(acc.shape).astype(np.float32)
    z = acc + bias.astype(np.float32)
    z = {"identity": lambda v: v, "relu": lambda v: np.maximum(v, 0), "relu6": lambda v: np.clip(v, 0, 6),
         "silu": lambda v: v / (1 + np.exp(-v)), "hardswish": lambda v: v * np.clip(v + 3, 0, 6) / 6,
         "gelu": lambda v: 0.5 * v * (1 + _erf(v / np.sqrt(2.0)))}[kernel.activation](z)
    if residual is not None and kernel.residual_after:  # ``BiasActResidual``: after the activation
        z = z + residual.reshape(z.shape).astype(np.float32)
    return z.astype(out)


def replay_int8(kernel: ConvKernel, x: np.ndarray, w: np.ndarray, bias: np.ndarray, scale: np.ndarray,
                shift: np.ndarray | None = None, residual: np.ndarray | None = None,
                post: np.ndarray | None = None) -> np.ndarray:
    """What an int8 kernel is asked to compute, on the host (numpy, independent of CUTLASS and TVM): x int8 NHWC,
    w int8 OHWI, bias int32 [K], scale float32 [K]; exact integer accumulation, then the ``Requantize`` epilogue's
    float32 steps, rounding half to even."""
    acc = _accumulate(kernel.problem, _x_slice(kernel, x), w, np.int64)
    f32 = np.float32
    v = (acc + bias.reshape(-1).astype(np.int64)).astype(np.int32).astype(f32) * scale.reshape(-1).astype(f32)
    v = v + (f32(0) if shift is None else shift.reshape(-1).astype(f32))
    if kernel.silu:  # through edgeq's exp, as the device's epilogue (device_math.py)
        v = silu_rn_numpy(v)
    if residual is not None:
        v = v + residual.astype(f32) * f32(kernel.residual_scale)
    v = np.clip(v, f32(kernel.act_lo), f32(kernel.act_hi))
    if post is not None:
        v = v * post.reshape(-1).astype(f32)
    if kernel.float_out:
        return v.astype(f32)
    v = np.rint(v / f32(kernel.out_div))
    return np.clip(v, kernel.lo, kernel.hi).astype(np.int8)


def replay_gemm(kernel: GemmKernel, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What a batched GEMM kernel is asked to compute, on the host (numpy): a [batch, M, K] and w [batch, K, N]
    fp16, products summed in float32, the result rounded to fp16 (float32 unrounded for ``float_out``).
    Operands read through a head view (``GemmKernel.strides``) are read as the kernel reads them, and the result
    is written into an array of y's size as the kernel writes it (returned flat in that case)."""
    p, st = kernel.problem, kernel.strides

    def view(array, shape, name, column_major=False, offset=0):
        ld, batch = st[name]
        flat = np.ascontiguousarray(array).reshape(-1)[offset:]
        strides = (batch, 1, ld) if column_major else (batch, ld, 1)
        return np.lib.stride_tricks.as_strided(flat, shape, [s * flat.itemsize for s in strides])

    product = np.matmul(view(a, (p.batch, p.m, p.k), "a", offset=kernel.a_offset).astype(np.float32),
                        view(w, (p.batch, p.k, p.n), "w", kernel.b_column_major, kernel.b_offset).astype(np.float32))
    y = (product * np.float32(kernel.alpha)).astype(np.float32 if kernel.float_out else np.float16)
    if kernel.quantize:  # the fp16 value / divisor, rounded half to even, clamped, int8
        divisor, lo, hi = (np.float32(v) for v in kernel.quantize)
        y = np.clip(np.rint(y.astype(np.float32) / divisor), lo, hi).astype(np.int8)
    if kernel.y_view is None:
        return y
    out = np.zeros(p.batch * p.m * p.n, y.dtype)
    view(out, (p.batch, p.m, p.n), "y")[...] = y
    return out


def replay_token_linear(kernel: TokenLinearKernel, x: np.ndarray, w: np.ndarray, scale: np.ndarray, token: np.ndarray,
                        bias: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """What a ``TokenLinearKernel`` computes, in numpy (float32, each operator rounded on its own, as the kernel's
    ``__fmul_rn``/``__fadd_rn``; erf in float64, rounded): [M, N] from x [M, C] int8, w [N, C] int8, scale and bias
    [N], token [M] and residual [M, N] (any shapes of those sizes)."""
    p = kernel.problem
    acc = (x.reshape(-1, p.c).astype(np.int64) @ w.reshape(p.k, p.c).astype(np.int64).T).astype(np.float32)
    v = acc * scale.reshape(-1).astype(np.float32)
    v = v * token.reshape(-1, 1).astype(np.float32)
    v = v + bias.reshape(-1).astype(np.float32)
    if kernel.gelu is not None:
        constant, divide, half, one, half_first = (np.float32(c) if isinstance(c, float) else c for c in kernel.gelu)
        t = _erf(v / constant if divide else v * constant) + one
        v = (v * half) * t if half_first else (v * t) * half
    if residual is not None:
        v = v + residual.reshape(v.shape).astype(np.float32)
    return v.astype(kernel.out_dtype)

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


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What the cubin says of one kernel: tensor-core instructions, registers, stack, spills, shared memory."""

    name: str
    arch: str
    mma: int  # tensor-core instructions in its SASS (HMMA for fp16, IMMA for int8)
    registers: int
    stack_bytes: int
    local_bytes: int  # local memory beyond the stack: spills
    shared_bytes: int  # dynamic shared memory it is launched with
    threads: int
    grid: tuple[int, int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
            symbol = next((f for f in functions if f.startswith(f"{kern.function}_kernel")), None)
            if symbol is None:
                continue
            fields = dict(re.findall(r"(\w+):(\d+)", functions[symbol]))
            mma = "IMMA" if kern.precision == "int8" else "HMMA"
            reports.append(KernelReport(kern.name, image.arch, len(re.findall(rf"\b{mma}\.", bodies.get(symbol, ""))),
                                        int(fields.get("REG", 0)), int(fields.get("STACK", 0)),
                                        int(fields.get("LOCAL", 0)), sizes[kern.name], kern.threads, kern.grid))
    return reports

def problem_from_conv(x_shape: Sequence[int], w_shape: Sequence[int], pads: Sequence[int], strides: Sequence[int],
                      dilations: Sequence[int], dtype: str = "float16") -> Conv2dProblem | None:
    """The NHWC problem of an NCHW convolution (ONNX Conv / Relax conv2d attributes: pads top, left, bottom, right);
    None where CUTLASS's kernel cannot take it: groups, asymmetric padding, or fewer than 3 input channels."""
    n, c, h, w = x_shape
    k, c_w, r, s = w_shape
    if c_w != c or len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3] or c < 3:
        return None
    align = alignment(dtype)
    padded = c if dtype == "int8" and c % ALIGNMENT == 0 else -(-c // align) * align  # int8: 64-bit loads there
    return Conv2dProblem(n, h, w, padded, k, r, s, (pads[0], pads[1]), tuple(strides), tuple(dilations), c_real=c)
