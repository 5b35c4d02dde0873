"""Calibrators: from the statistics of an activation, the clipping threshold T on |x| (scale = T / 127).

Registry keys are the ``--calibration`` choices. All are symmetric (int8 activations with zero point 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgeq.choices import CALIBRATION_METHODS
from edgeq.quantize.calibrate import TensorStats

LEVELS = 128  # int8 symmetric: 0..127 on each side


@dataclasses.dataclass(frozen=True)
class MinMax:
    """T = max |x| seen: nothing clipped, coarse steps when the distribution has a long tail."""

    needs_histogram = False

    def threshold(self, stats: TensorStats, **_) -> float:
        return stats.absmax


def _histogram(stats: TensorStats) -> np.ndarray | None:
    """The |x| histogram as float64, or None when there is nothing to calibrate (all zeros)."""
    if stats.absmax <= 0 or stats.hist is None or stats.hist.sum() == 0:
        return None
    return stats.hist.astype(np.float64)


def _edges(stats: TensorStats) -> np.ndarray:
    return np.linspace(0.0, stats.absmax, len(stats.hist) + 1)


@dataclasses.dataclass(frozen=True)
class Percentile:
    """T = the given percentile of |x| (default 99.99): clips the rarest outliers."""

    needs_histogram = True

    def threshold(self, stats: TensorStats, percentile: float = 99.99, **_) -> float:
        hist = _histogram(stats)
        if hist is None:
            return stats.absmax
        cdf = np.cumsum(hist) / hist.sum()
        index = int(np.searchsorted(cdf, percentile / 100.0))
        return float(_edges(stats)[min(index + 1, len(hist))])


@dataclasses.dataclass(frozen=True)
class Entropy:
    """TensorRT's KL-divergence calibration: T minimising KL(P || Q) between the |x| histogram clipped at T
    and its 128-level quantized version."""

    needs_histogram = True

    def threshold(self, stats: TensorStats, **_) -> float:
        hist = _histogram(stats)
        if hist is None:
            return stats.absmax
        edges = _edges(stats)
        best, best_i = np.inf, len(hist)
        for i in range(LEVELS, len(hist) + 1, 8):
            sliced = hist[:i]
            p = sliced.copy()
            p[-1] += hist[i:].sum()  # P: the distribution clipped at T (outliers land in the last bin)
            nonzero = p > 0
            # Q: the unclipped bins merged into LEVELS groups, each group's mass spread over its non-empty bins.
            groups = np.array_split(np.arange(i), LEVELS)
            q = np.zeros(i)
            for g in groups:
                nz = nonzero[g]
                if nz.any():
                    q[g[nz]] = sliced[g].sum() / nz.sum()
            ps, qs = p / p.sum(), q / q.sum()
            mask = ps > 0
            kl = float(np.sum(ps[mask] * np.log(ps[mask] / np.maximum(qs[mask], 1e-12))))
            if kl < best:
                best, best_i = kl, i
        return float(edges[best_i])


@dataclasses.dataclass(frozen=True)
class MSE:
    """T minimising the expected squared error of quantizing |x| (rounding inside T, clipping beyond)."""

    needs_histogram = True

    def threshold(self, stats: TensorStats, **_) -> float:
        hist = _histogram(stats)
        if hist is None:
            return stats.absmax
        edges = _edges(stats)
        centers = (edges[:-1] + edges[1:]) / 2
        candidates = edges[np.arange(LEVELS // 4, len(hist) + 1, 4)]
        step = candidates[:, None] / (LEVELS - 1)
        quantized = np.minimum(np.round(centers[None, :] / step), LEVELS - 1) * step
        errors = ((centers[None, :] - quantized) ** 2 * hist[None, :]).sum(axis=1)
        return float(candidates[int(np.argmin(errors))])


CALIBRATORS = dict(zip(CALIBRATION_METHODS, (MinMax(), Percentile(), Entropy(), MSE()), strict=True))  # names: edgeq.choices
