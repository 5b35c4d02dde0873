"""The problems a kernel computes: a 2-D convolution (NHWC, OHWI, CUTLASS's ``Conv2dProblemSize``) and a batch of
matrix products, and the channel alignment a convolution's input is padded to.
"""

from __future__ import annotations

import dataclasses


ALIGNMENT = 8  # fp16 elements per 128-bit access: channels are padded to a multiple of it
ALIGNMENT_INT8 = 16  # int8 elements per 128-bit access


def alignment(dtype: str) -> int:
    """Input channels a convolution of ``dtype`` activations is padded to a multiple of."""
    return ALIGNMENT_INT8 if dtype == "int8" else ALIGNMENT


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
    groups: int = 1  # c (= k): a depthwise convolution (``DepthwiseKernel``), weights HWOI [R, S, K, 1]; between 1
    # and c: a grouped convolution (``GroupConvKernel``), weights OHWI [K, R, S, C / groups]

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c

    @property
    def p(self) -> int:
        return (self.h + 2 * self.pad[0] - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def q(self) -> int:
        return (self.w + 2 * self.pad[1] - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    @property
    def gemm(self) -> tuple[int, int, int]:
        """Implicit GEMM (M, N, K): output pixels, output channels, the reduction (per group)."""
        return self.n * self.p * self.q, self.k, self.r * self.s * self.c // self.groups

    @property
    def flops(self) -> int:
        m, n, _ = self.gemm
        return 2 * m * n * self.r * self.s * (self.c_real or self.c) // self.groups


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """A batch of row-major matrix products ``y[b] = a[b] @ w[b]``: a [M, K], w [K, N], y [M, N] per batch, each
    operand contiguous (attention's Q K^T and P V, whose second operand is an activation)."""

    batch: int
    m: int
    n: int
    k: int

    @property
    def gemm(self) -> tuple[int, int, int]:
        return self.m, self.n, self.k

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k
