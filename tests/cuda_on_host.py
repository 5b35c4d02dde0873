"""CUDA kernels that TVM wrote (plain CUDA C: no shared memory, no barriers, no intrinsics beyond a few
conversions) compiled by the host's g++ and run over their whole grid, one thread after another, to check the
source a GPU would run without a GPU: its index arithmetic, predicates, vector loads and stores. What it cannot
check is NVRTC's and the hardware's part (and ``--use_fast_math``'s approximate expf)."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np

# what the kernels use from CUDA, for the host: thread indices as globals the launcher sets, half as _Float16
# (round to nearest even, as __float2half_rn), the vector types by their layout
SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
struct edgeq_dim3 { int x, y, z; };
static edgeq_dim3 blockIdx, threadIdx;
#define __global__
#define __device__
#define __launch_bounds__(n)
typedef _Float16 half;
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline int2 make_int2(int a, int b) { return {a, b}; }
static inline half __float2half_rn(float f) { return (half)f; }
static inline float __half2float(half h) { return (float)h; }
static inline unsigned __pack_half2(half x, half y) {
  unsigned short a, b; std::memcpy(&a, &x, 2); std::memcpy(&b, &y, 2); return (unsigned(b) << 16) | a; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
"""


def kernels_in(source: str) -> dict[str, tuple[str, str]]:
    """{kernel: (its parameter list, its whole definition)} of the ``extern "C" __global__`` kernels defined in a
    CUDA source TVM wrote."""
    out = {}
    for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', source):
        depth, i = 0, m.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = (m.group(2), source[m.start():i + 1])
    return out


class HostKernels:
    """Kernels of a CUDA source, built for this CPU: ``run(kernel, grid, block, arrays)`` runs one over its grid
    with the numpy arrays named by its parameters (``x_ptr`` -> ``arrays["x"]``)."""

    def __init__(self, source: str, names: list[str], folder: Path):
        found = kernels_in(source)
        parts = [SHIM]
        self.params = {}
        for name in names:
            params, body = found[name]
            self.params[name] = [p.split()[-1] for p in params.split(",")]
            parts += [body, f'extern "C" void launch_{name}(int grid, int block, {params}) {{\n'
                            "  for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {\n"
                            f"    blockIdx = {{b, 0, 0}}; threadIdx = {{t, 0, 0}}; {name}({', '.join(self.params[name])});\n"
                            "  }\n}\n"]
        (folder / "kernels.cc").write_text("\n".join(parts))
        subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-w",
                        "-o", str(folder / "kernels.so"), str(folder / "kernels.cc")], check=True)
        self.lib = ctypes.CDLL(str(folder / "kernels.so"))

    def run(self, name: str, grid: int, block: int, arrays: dict[str, np.ndarray]) -> None:
        args = []
        for param in self.params[name]:
            array = arrays[param.removesuffix("_ptr")]
            assert array.flags.c_contiguous
            args.append(ctypes.c_void_p(array.ctypes.data))
        getattr(self.lib, f"launch_{name}")(ctypes.c_int(grid), ctypes.c_int(block), *args)
