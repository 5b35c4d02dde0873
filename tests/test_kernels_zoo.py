"""The patterns of the torchvision zoo that had no fast path (issue #15), each against ONNX Runtime:
grouped convolutions (RegNet, ResNeXt) on the conv kernel, squeeze-and-excitation (a channel scale of a
whole feature map fused after a 1x1 convolution), concatenations that keep NHWC (SqueezeNet, DenseNet,
Inception), and 1000-channel classifiers in whole 8-lane vectors.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_kernels import Conv, _out, _save, assert_close, conv_model, edgeq_vs_ort, host_isa, qdq_conv_model

GROUPED = [
    Conv(32, 32, (10, 10), group=4),  # RegNet: 8 channels per group
    Conv(64, 64, (9, 9), stride=2, group=16),  # ResNeXt-like: 4 channels per group, stride 2
    Conv(16, 32, (8, 8), group=2),  # more outputs than inputs per group
]


@pytest.mark.parametrize("cv", GROUPED, ids=lambda cv: f"g{cv.group}-{cv.c}to{cv.oc}-s{cv.stride}")
def test_grouped_convolutions_run_on_the_conv_kernel(cv, tmp_path):
    ours, theirs, stats, calls, _ = edgeq_vs_ort(conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(0)))
    assert calls == 1 and stats.get("conv") == 1 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


@pytest.mark.parametrize("cv", GROUPED[:2], ids=lambda cv: f"g{cv.group}-{cv.c}to{cv.oc}")
def test_int8_grouped_convolutions_run_on_the_conv_kernel(cv, tmp_path):
    path = qdq_conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(1), "int8")
    ours, theirs, stats, calls, _ = edgeq_vs_ort(path, prequantized=True)
    assert calls == 1 and stats.get("conv") == 1 and stats.get("none", 0) == 0, stats  # no VNNI layout: grouped
    assert_close(ours, theirs, rtol=1e-5)


def _weights(rng, **shapes):
    return [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), k) for k, s in shapes.items()]


def test_squeeze_and_excitation_scale_is_scheduled_with_its_convolution(tmp_path):
    """conv -> GlobalAveragePool -> 1x1 conv -> ReLU -> 1x1 conv -> HardSigmoid -> times the feature map:
    the last 1x1 convolution's function also holds the broadcast multiply; all of it gets a schedule."""
    rng = np.random.default_rng(3)
    inits = _weights(rng, w=(48, 16, 3, 3), w1=(12, 48, 1, 1), b1=(12,), w2=(48, 12, 1, 1), b2=(48,))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["f"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["f"], ["g"]),
        helper.make_node("Conv", ["g", "w1", "b1"], ["s1"]),
        helper.make_node("Relu", ["s1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["s2"]),
        helper.make_node("HardSigmoid", ["s2"], ["h"], alpha=1 / 6),
        helper.make_node("Mul", ["f", "h"], ["y"]),
    ]
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 14, 14])],
                          [_out("y", 4)], inits)
    ours, theirs, stats, calls, _ = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 3 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


def _transposes(lowered) -> int:
    return sum(b.value.op.name == "relax.permute_dims" for b in lowered.bindings()
               if hasattr(b.value, "op") and hasattr(b.value.op, "name"))


def test_concatenation_keeps_nhwc(tmp_path):
    """A SqueezeNet fire module twice: squeeze 1x1, expand 1x1 and 3x3, concatenated on channels, then a
    max-pool with ceil_mode; the concatenations run on NHWC (one transpose in, one out)."""
    rng = np.random.default_rng(4)
    inits = _weights(rng, s1=(8, 16, 1, 1), e1=(16, 8, 1, 1), e3=(16, 8, 3, 3), s2=(8, 32, 1, 1), f1=(8, 8, 1, 1),
                     f3=(24, 8, 3, 3))
    nodes = [
        helper.make_node("Conv", ["x", "s1"], ["a"]), helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Conv", ["ar", "e1"], ["b1"]), helper.make_node("Conv", ["ar", "e3"], ["b3"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["b1", "b3"], ["c"], axis=1),
        helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("Conv", ["p", "s2"], ["d"]), helper.make_node("Relu", ["d"], ["dr"]),
        helper.make_node("Conv", ["dr", "f1"], ["g1"]), helper.make_node("Conv", ["dr", "f3"], ["g3"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["g1", "g3", "dr"], ["y"], axis=1),
    ]
    g = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 15, 15])],
                          [_out("y", 4)], inits)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 6 and stats.get("none", 0) == 0, stats
    assert _transposes(lowered) == 2
    assert_close(ours, theirs)


def test_thousand_class_classifier_runs_in_whole_vectors(tmp_path):
    """SqueezeNet's classifier: a 1x1 convolution to 1000 channels on 13x13 pixels is computed in whole vector
    registers: on AVX-512 for 1008 or 1024 channels with zero weights and sliced (1000 has no 16- or 32-channel
    divisor; blocks of 25 lanes were not vectorised, blocks of 8 use half a register), on AVX2 (8 lanes) for the
    1000 as they are; on one pixel (a Gemm) it stays 1000."""
    lanes = host_isa().lanes
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(
        conv_model(Conv(32, 1000, (13, 13), k=1, pad=0), tmp_path / "m.onnx", np.random.default_rng(2)))
    assert calls == 1 and stats.get("conv") == 1 and stats.get("none", 0) == 0, stats
    channels = [w.shape[-1] * w.shape[0] for w in lowered.weights.values() if w.ndim == 5][0]
    assert channels % lanes == 0 and 1000 <= channels < 1000 + 32, (channels, lanes)
    assert_close(ours, theirs)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(
        conv_model(Conv(8, 1000, (1, 1), k=1, pad=0), tmp_path / "m1.onnx", np.random.default_rng(2)))
    assert [w.shape[-1] * w.shape[0] for w in lowered.weights.values() if w.ndim == 5] == [1000]
    assert_close(ours, theirs)


def test_silu_epilogue_uses_the_fast_tanh(tmp_path):
    """EfficientNet's SiLU (Sigmoid then Mul) and a plain Sigmoid output: sigmoid is computed as
    0.5 tanh(x / 2) + 0.5 with TVM's vectorised fast_tanh, within ONNX Runtime's results."""
    rng = np.random.default_rng(5)
    inits = _weights(rng, w=(32, 8, 3, 3), w2=(16, 32, 1, 1))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["a"]),
        helper.make_node("Conv", ["a", "w2"], ["d"]), helper.make_node("Sigmoid", ["d"], ["y"]),
    ]
    g = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                          [_out("y", 4)], inits)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 2 and stats.get("none", 0) == 0, stats
    ops = {b.value.op.name for b in lowered.bindings() if hasattr(b.value, "op") and hasattr(b.value.op, "name")}
    assert "relax.sigmoid" not in ops and "relax.tanh" in ops, ops
    assert_close(ours, theirs, rtol=1e-5)


def test_prime_token_counts_are_padded_to_whole_tiles(tmp_path):
    """ViT's 197 tokens are a prime: the weight products' rows and both attention products' rows and columns
    are zero-padded to whole tiles (19 -> 24 rows, 32 columns). The scores stay padded through the softmax
    (over the 19 columns that are data, zeros in the others) into ``softmax @ V``: slices only where the
    weight products' results are reshaped into heads, and for the output."""
    from test_kernels import attention_model

    path = attention_model(tmp_path / "m.onnx", np.random.default_rng(6), batch=1, heads=2, seq=19, dim=16)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(path)
    assert calls == 4 and stats.get("bmm") == 2 and stats.get("none", 0) == 0, stats
    ops = [b.value.op.name for b in lowered.bindings() if hasattr(b.value, "op") and hasattr(b.value.op, "name")]
    assert ops.count("relax.strided_slice") == 3 and "relax.nn.softmax" not in ops, ops
    assert_close(ours, theirs)


def test_dense_block_concatenation_with_batchnorm_keeps_nhwc(tmp_path):
    """DenseNet's pattern: a concatenation of many inputs (channel bounds that are not multiples of a vector
    among them) followed by the BatchNorm and ReLU the exporter cannot fold into a convolution. The
    BatchNorm becomes a per-channel multiply and add that follows NHWC (it ran between two transposes), and
    the concatenation's channel loop is partitioned at its bounds."""
    rng = np.random.default_rng(7)
    inits = _weights(rng, s=(8, 8, 1, 1), a=(16, 8, 1, 1), b=(8, 8, 3, 3), c=(24, 8, 1, 1), d=(32, 8, 3, 3),
                     e=(16, 88, 1, 1))
    for name, n in (("gamma", 88), ("beta", 88), ("mean", 88)):
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), name))
    inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, 88).astype(np.float32), "var"))
    nodes = [
        helper.make_node("Conv", ["x", "s"], ["xs"]),
        helper.make_node("Conv", ["xs", "a"], ["ya"]), helper.make_node("Conv", ["xs", "b"], ["yb"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["xs", "c"], ["yc"]), helper.make_node("Conv", ["xs", "d"], ["yd"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["ya", "yb", "xs", "yc", "yd"], ["cat"], axis=1),  # 16 + 8 + 8 + 24 + 32
        helper.make_node("BatchNormalization", ["cat", "gamma", "beta", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]), helper.make_node("Conv", ["r", "e"], ["y"]),
    ]
    g = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                          [_out("y", 4)], inits)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 6 and stats.get("none", 0) == 0, stats
    assert _transposes(lowered) == 2  # the input in, the output out: none around the BatchNorm
    assert not any("batch_norm" in str(b.value) for b in lowered.bindings())
    assert_close(ours, theirs)


def _ops(lowered) -> list[str]:
    return [b.value.op.name for b in lowered.bindings() if hasattr(b.value, "op") and hasattr(b.value.op, "name")]


def _gelu(x: str, y: str) -> list:
    """GELU as torch.onnx exports it at opset 17: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    return [helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]), helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
            helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_a"]), helper.make_node("Mul", [x, f"{y}_a"], [f"{y}_m"]),
            helper.make_node("Mul", [f"{y}_m", "half"], [y])]


def _gelu_constants() -> list:
    return [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]


def test_transformer_mlp_stays_in_the_kernels_row_form(tmp_path):
    """A ViT block's MLP over 17 tokens (a prime: rows padded to 24): the bias, GELU, residual add and
    LayerNorm run on the products' padded [1, 1, rows, C] results and the next product reads them as they
    are: the model's input is padded once, nothing else is, and the output is sliced once."""
    rng = np.random.default_rng(9)
    inits = _weights(rng, w1=(32, 64), b1=(64,), w2=(64, 32), b2=(32,), g=(32,), be=(32,), w3=(32, 16)) + _gelu_constants()
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
        *_gelu("h1", "h2"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]), helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Add", ["h4", "x"], ["h5"]),
        helper.make_node("LayerNormalization", ["h5", "g", "be"], ["h6"], axis=-1),
        helper.make_node("MatMul", ["h6", "w3"], ["y"]),
    ]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 17, 32])],
                          [_out("y", 3)], inits)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 3 and stats.get("none", 0) == 0, stats
    ops = _ops(lowered)
    # one pad for the input of the first product, one for the residual's other operand; one slice: the output
    assert ops.count("relax.nn.pad") == 2 and ops.count("relax.strided_slice") == 1, ops
    assert_close(ours, theirs)


def test_convnext_block_keeps_nhwc_through_its_channels_last_mlp(tmp_path):
    """ConvNeXt's block: depthwise 7x7, permute to channels-last, LayerNorm, Linear, GELU, Linear, layer
    scale, permute back, residual add. Both permutes are the NHWC data as it is: one transpose in, one out."""
    rng = np.random.default_rng(10)
    inits = _weights(rng, dw=(16, 1, 7, 7), g=(16,), be=(16,), w1=(16, 64), b1=(64,), w2=(64, 16), b2=(16,),
                     ls=(16,)) + _gelu_constants()
    nodes = [
        helper.make_node("Conv", ["x", "dw"], ["d"], pads=[3, 3, 3, 3], group=16),
        helper.make_node("Transpose", ["d"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["t", "g", "be"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
        *_gelu("h1", "h2"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]), helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Mul", ["h4", "ls"], ["h5"]),
        helper.make_node("Transpose", ["h5"], ["h6"], perm=[0, 3, 1, 2]),
        helper.make_node("Add", ["h6", "x"], ["y"]),
    ]
    g = helper.make_graph(nodes, "convnext", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
                          [_out("y", 4)], inits)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 3 and stats.get("none", 0) == 0, stats
    assert _transposes(lowered) == 2, _ops(lowered)
    assert_close(ours, theirs)
