"""The mean shift int8 adds to each layer's output, taken back out in its bias (bias correction, as OpenVINO's
default post-training quantization and Nagel et al. 2019, "Data-Free Quantization", do; here from statistics of
the calibration data).

Rounding to nearest is unbiased for one value, not for a layer. Its output in int8 is

    y_q - y = conv(q(x) - x, W_q) + conv(x, W_q - W)

where ``q(x)`` is the input quantized and dequantized at the layer's scale (clipped beyond the calibrated
threshold: mse calibration clips the largest values, which are not symmetric after HardSwish or ReLU) and
``W_q`` the dequantized int8 weight. Over the calibration data, with the per-channel means of the input
``m_i = E[x_i]`` and of its error ``e_i = E[q(x_i) - x_i]``, the expected shift of output channel ``o`` is

    c_o = sum_i sum_k ( W_q[o, i, k] * e_i + (W_q - W)[o, i, k] * m_i )

(``k`` the kernel positions; a depthwise or grouped convolution sums over its group's channels only). The
layer adds ``-c`` after its dequantize, which ``fold_bias`` folds into the int32 bias: nothing more runs.

The estimate uses the float model's activations, so it removes the shift each layer adds itself, not what
reaches it from the layers before (AIMET's empirical correction goes layer by layer on the quantized graph,
one pass per layer); near a border a convolution reads padding, not the mean. Refining all layers at once on
the quantized graph instead (subtracting every layer's measured mean difference each round) was tried and
diverges: PP-OCRv5's text detector collapsed to cosine 0.65 after two rounds.

Measured against ONNX Runtime fp32 (benchmarks/trained.py, RESULTS.md): PP-OCRv5's recognizer, lines read as
fp32 reads them 79.7% -> 92.2%; its text detector, text-map IoU 0.928 -> 0.948; PP-OCRv4's detector, worst
image 0.974 -> 0.946 (mean 0.980 kept); nudenet's YOLOv8n, fp32 boxes kept 82.5% -> 75.0% in int8 (its cosine
0.99965 -> 0.99979), 95.0% -> 97.5% mixed. ``--bias-correction off`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from edgeq.graph import Graph
from edgeq.quantize.calibrate import Taps
from edgeq.quantize.layers import Layer
from edgeq.quantize.quantize_ops import QMAX, quantize_weight


def corrected(layer: Layer) -> bool:
    """Whether ``layer`` gets a correction: int8 with a calibrated input scale (a per-token layer's scales
    come at run time, per row: its rounding has no fixed shift to take out)."""
    return layer.precision == "int8" and layer.activation in ("per-tensor", "per-channel")


def corrections(graph: Graph, taps: Taps, layers: list[Layer], act_scales: dict[str, float],
                samples: Callable[[], Iterable[list[np.ndarray]]],
                progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """weight name -> the float32 correction (one value per output channel) to add to that layer's output, for
    every ``corrected`` layer, from one pass of ``taps`` (``graph``, the float model smoothed as it is
    quantized, built with ``layers``' taps) over ``samples()``."""
    chosen = [(k, l) for k, l in enumerate(layers) if corrected(l)]
    if not chosen:
        return {}
    means: list = [0.0] * len(chosen)
    errors: list = [0.0] * len(chosen)
    batches = 0
    for i, sample in enumerate(samples()):
        inputs = taps(sample).inputs
        for k, (index, layer) in enumerate(chosen):
            x = inputs[index]
            axis = 1 if layer.kind == "conv2d" else x.ndim - 1
            others = tuple(a for a in range(x.ndim) if a != axis)
            scale = np.float32(act_scales[layer.weight])
            error = np.clip(np.round(x / scale), -QMAX, QMAX) * scale - x
            means[k] = means[k] + x.astype(np.float64).mean(axis=others)
            errors[k] = errors[k] + error.astype(np.float64).mean(axis=others)
        batches += 1
        if progress:
            progress(i + 1)
    if batches == 0:
        return {}
    return {layer.weight: (-_shift(graph.weights[layer.weight], layer, m / batches, e / batches)).astype(np.float32)
            for (_, layer), m, e in zip(chosen, means, errors)}


def _shift(w: np.ndarray, layer: Layer, m: np.ndarray, e: np.ndarray) -> np.ndarray:
    """c (above) for weight ``w`` as the graph holds it (conv2d OIHW; matmul [K, N], or [N, K] when
    ``layer.channel_axis`` is 0: Gemm's transB)."""
    q, scale = quantize_weight(w, layer.channel_axis)
    shape = [1] * w.ndim
    shape[layer.channel_axis] = -1
    w_q = q.astype(np.float64) * scale.reshape(shape)
    delta = w_q - w.astype(np.float64)
    if layer.kind == "conv2d":
        out_channels, group_in = w.shape[:2]
        groups = len(m) // group_in
        # the input channels output channel o reads: its group's, [O, I/groups]
        reads = (np.arange(out_channels)[:, None] // (out_channels // groups)) * group_in + np.arange(group_in)
        w_sum = w_q.reshape(out_channels, group_in, -1).sum(axis=-1)
        delta_sum = delta.reshape(out_channels, group_in, -1).sum(axis=-1)
        return (w_sum * e[reads]).sum(axis=1) + (delta_sum * m[reads]).sum(axis=1)
    if layer.channel_axis == 0:  # stored [N, K]
        w_q, delta = w_q.T, delta.T
    return e @ w_q + m @ delta
