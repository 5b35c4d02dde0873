"""The tile table: CUTLASS threadblock and warp shapes, pipeline stages, serial split-K slices, and the tiles a
grouped convolution or a GEMM of narrow alignment can take.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from edgeq.backends.cuda.cutlass.problems import Conv2dProblem, GemmProblem


@dataclasses.dataclass(frozen=True)
class Tile:
    """A CUTLASS tile: threadblock and warp shapes (M, N, K), the software pipeline's stages, and the K slices
    (``split_k``: serial split-K, CTAs along K taking turns on their output tile, ``split_k_slices``)."""

    block: tuple[int, int, int]
    warp: tuple[int, int, int]
    stages: int
    split_k: int = 1

    @property
    def threads(self) -> int:
        return (self.block[0] // self.warp[0]) * (self.block[1] // self.warp[1]) * 32

    def mainloop_bytes(self, element_bytes: int = 2) -> int:
        """Shared memory of the multistage mainloop: ``stages`` tiles of A and B (the epilogue's shares it)."""
        return self.stages * (self.block[0] + self.block[1]) * self.block[2] * element_bytes


# (threadblock, warp) shapes for Sm80 tensor-op convolutions, largest first; CUTLASS's own profiler set (int8:
# K of 64, as its IMMA.16832 takes 32 elements of K per instruction)
TILES = (((128, 128, 32), (64, 64, 32)), ((128, 64, 32), (64, 32, 32)), ((64, 64, 32), (32, 32, 32)))
TILES_INT8 = (((128, 128, 64), (64, 64, 64)), ((128, 64, 64), (64, 32, 64)), ((64, 64, 64), (32, 32, 64)))


def choose_tile(problem: Conv2dProblem | GemmProblem, sm_count: int, smem_per_block: int, precision: str = "fp16") -> Tile:
    """The tile table: the largest threadblock tile whose CTAs still fill every SM once (a wave), else the
    smallest; then the most stages (up to 4) whose mainloop fits the profile's shared memory per block."""
    m, n, _ = problem.gemm
    tiles = TILES_INT8 if precision == "int8" else TILES
    fitting = [t for t in tiles if t[0][1] <= max(64, -(-n // 64) * 64)] or list(tiles)  # no tile wider than N
    chosen = fitting[-1]
    for block, warp in fitting:
        ctas = -(-m // block[0]) * -(-n // block[1]) * getattr(problem, "batch", 1)
        if ctas >= sm_count:
            chosen = (block, warp)
            break
    stages = 4
    element = 1 if precision == "int8" else 2
    while stages > 2 and Tile(chosen[0], chosen[1], stages).mainloop_bytes(element) > smem_per_block:
        stages -= 1
    return Tile(chosen[0], chosen[1], stages)


MAX_SPLIT_K = 4
MIN_K_ITERATIONS = 8  # main-loop iterations a slice keeps (a few more than the deepest pipeline's stages)


def split_k(problem: Conv2dProblem, tile: Tile, sm_count: int) -> Tile:
    """``tile`` with its K split into slices (serial split-K: ``ImplicitGemmConvolutionWithFusedEpilogue``'s
    ``SplitKMode::kSerial``) where its output tiles are too few for the GPU: up to ``MAX_SPLIT_K`` slices while the
    CTAs stay within 4 a SM and each slice keeps ``MIN_K_ITERATIONS`` main-loop iterations. The late layers of a
    CNN at batch 1 (7x7 maps, K = 9 x 512) and a transformer's narrow, deep GEMMs (K = 1536 into 384 columns) have
    fewer output tiles than an Orin has SMs times the CTAs each holds. A slice's partial sum goes through the output
    (the next slice adds to it: fp16 outputs round it to fp16, float32 ones keep it), so only kernels whose output
    holds a partial sum take it (``ConvKernel.split_k_allowed``). Channels a multiple of the tile's K."""
    m, n, _ = problem.gemm
    ctas = -(-m // tile.block[0]) * -(-n // tile.block[1])
    bk = tile.block[2]
    if problem.c % bk or problem.groups != 1:
        return tile
    slices = 1
    for candidate in range(2, MAX_SPLIT_K + 1):
        channels = -(-problem.c // candidate)  # a slice's (CUTLASS's implicit_gemm_k_iterations)
        iterations = problem.r * problem.s * -(-channels // bk)
        if ctas * candidate > 4 * sm_count or iterations < MIN_K_ITERATIONS:
            break
        slices = candidate
    return dataclasses.replace(tile, split_k=slices) if slices > 1 else tile


def group_tile(problem: Conv2dProblem, sm_count: int, smem_per_block: int) -> Tile | None:
    """``choose_tile`` among the tiles a grouped convolution can take: N a multiple of K / groups (several groups a
    CTA) or K / groups a multiple of N (one); None where no tile fits. Several groups a CTA multiply the tensor
    core's work by the groups in a tile (the other groups' weights are zeros), so the narrowest such tile."""
    kg = problem.k // problem.groups
    fits = [t for t in TILES if kg % t[0][1] == 0] or [t for t in GROUP_TILES if t[0][1] % kg == 0][-1:]
    if not fits:
        return None
    tile = choose_tile(problem, sm_count, smem_per_block)
    if (tile.block, tile.warp) in fits:
        return tile
    stages = 4
    while stages > 2 and Tile(*fits[-1], stages).mainloop_bytes() > smem_per_block:
        stages -= 1
    return Tile(*fits[-1], stages)


def gemm_tile(tile: Tile, alignment: int) -> Tile:
    """``tile`` for a GEMM whose operands allow accesses of ``alignment`` fp16 elements: cp.async copies 4, 8 or 16
    bytes, so one element (2 bytes) takes CUTLASS's two-stage mainloop (``MmaPipelined``, plain loads)."""
    return dataclasses.replace(tile, stages=2) if alignment * 2 < 4 else tile


GROUP_TILES = TILES + (((64, 32, 32), (32, 32, 32)),)  # several groups a CTA: the narrowest tile wastes least
MAX_GROUP_WORK = 8  # tensor-core work over useful work a grouped kernel may do (beyond it, CUDA cores do better)
