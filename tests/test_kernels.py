"""edgeq's CPU kernels and schedules, every path against ONNX Runtime on small ONNX models.

Each case builds a one- or few-operator model with the onnx helper API, lowers it the way ``edgeq package``
does for a CPU (``lower_graph``: NHWC between convolutions, packed weights), compiles it with edgeq's CPU
pipeline, checks which schedule every TIR function got (no silent fallback to TVM's unscheduled loops),
and compares the outputs with ONNX Runtime's.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_golden
from edgeq.compile import HostRunner, build, lower_graph
from edgeq.graph import call_op
from edgeq.graph_passes import shape_of
from edgeq.backends.cpu import resize
from edgeq.backends.cpu.common import Isa
from edgeq.backends.cpu.lower import describe
from edgeq.load import load_model
from edgeq.quantize import lower_prequantized
from edgeq.relax_import import to_relax
from edgeq.targets import profiles
from edgeq.tvm_env import import_tvm
from edgeq.reference import onnxruntime_session

tvm = import_tvm()


@dataclasses.dataclass(frozen=True)
class Conv:
    c: int
    oc: int
    hw: tuple[int, int]
    k: int = 3
    stride: int = 1
    pad: int = 1
    group: int = 1
    dilation: int = 1
    batch: int = 1

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.group == self.c == self.oc

    def __str__(self) -> str:
        kind = "dw" if self.depthwise else f"g{self.group}conv" if self.group > 1 else "conv"
        return (f"{kind}{self.k}x{self.k}-s{self.stride}-d{self.dilation}-{self.c}to{self.oc}-"
                f"{self.hw[0]}x{self.hw[1]}-b{self.batch}")


CONVS = [
    Conv(16, 32, (12, 12)),  # whole vectors
    Conv(3, 10, (9, 11)),  # channels not a multiple of the vector width, odd sizes
    Conv(24, 48, (15, 15), stride=2),  # stride 2, 48 = 3 x 16 output channels
    Conv(32, 64, (8, 8), k=1, pad=0),  # 1x1
    Conv(32, 64, (14, 14), k=1, pad=0, stride=2),  # 1x1 stride 2
    Conv(24, 24, (10, 10), group=24),  # depthwise
    Conv(30, 30, (13, 13), group=30, stride=2),  # depthwise, odd channels, stride 2
    Conv(8, 16, (10, 10), dilation=2, pad=2),  # dilated
    Conv(16, 32, (7, 7), batch=3),  # batch > 1
    Conv(3, 16, (20, 20), k=7, stride=2, pad=3),  # a ResNet stem
    Conv(64, 64, (16, 16)),  # float: Winograd F(4x4, 3x3)
    Conv(64, 80, (10, 10), batch=2),  # float: Winograd F(2x2, 3x3), 80 = 5 x 16 channels, batch 2
    Conv(64, 64, (9, 9)),  # odd output size: direct
    Conv(48, 24, (11, 11), k=1, pad=0),  # 24 channels: int8 on 256-bit VNNI (3 blocks of 8)
    Conv(32, 32, (10, 10), group=4, stride=2),  # grouped (RegNet, ResNeXt): int8 summed exactly in float lanes
    Conv(40, 21, (12, 12), k=1, pad=0),  # a segmentation head's 21 classes: computed as whole vectors, sliced
]


def float_kernel(cv: Conv) -> str:
    if cv.depthwise:
        return "dwconv"
    winograd = (cv.k, cv.stride, cv.dilation) == (3, 1, 1) and cv.c >= 64 and cv.oc >= 64 and cv.hw[0] % 2 == 0
    return "winograd" if winograd else "conv"


def _out(name: str, rank: int):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}_{i}" for i in range(rank)])


def _save(graph_def, path, opset=17):
    model = helper.make_model(graph_def, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def conv_model(cv: Conv, path, rng) -> object:
    """Conv + bias + ReLU, then a residual-style Add of its own output (an epilogue chain to fuse)."""
    w = rng.standard_normal((cv.oc, cv.c // cv.group, cv.k, cv.k)).astype(np.float32) * 0.2
    b = rng.standard_normal(cv.oc).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[cv.k, cv.k], strides=[cv.stride] * 2,
                         pads=[cv.pad] * 4, group=cv.group, dilations=[cv.dilation] * 2),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Add", ["r", "c"], ["y"]),
    ]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [cv.batch, cv.c, *cv.hw])],
                          [_out("y", 4)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return _save(g, path)


def qdq_conv_model(cv: Conv, path, rng, act: str) -> object:
    """x -> Q/DQ (int8 or uint8 activations) -> Conv with a per-channel int8 weight -> float output."""
    w = rng.integers(-127, 128, (cv.oc, cv.c // cv.group, cv.k, cv.k)).astype(np.int8)
    w_scale = (rng.random(cv.oc).astype(np.float32) + 0.5) * 0.01
    zp = np.array(0 if act == "int8" else 128, np.int8 if act == "int8" else np.uint8)
    inits = [numpy_helper.from_array(w, "wq"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(cv.oc, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.05, np.float32), "xs"), numpy_helper.from_array(zp, "xz")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["y"], kernel_shape=[cv.k, cv.k], strides=[cv.stride] * 2,
                         pads=[cv.pad] * 4, group=cv.group, dilations=[cv.dilation] * 2),
    ]
    g = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [cv.batch, cv.c, *cv.hw])],
                          [_out("y", 4)], inits)
    return _save(g, path, opset=13)


def host_isa() -> Isa:
    """What edgeq's CPU kernels plan for on this machine: vector lanes, the int8 dot-product instruction."""
    return Isa.of(tvm.target.Target(profiles()["host"].tvm_target()))


def edgeq_vs_ort(path, target=None, isa_target=None, prequantized=False):
    """(edgeq outputs, ORT outputs, schedule counts, kernel calls) for the model at ``path``."""
    loaded = load_model(path, None)
    graph, _ = to_relax(loaded)
    if prequantized:
        graph = lower_prequantized(graph, loaded).graph
    target = target or profiles()["host"].tvm_target()
    lowered, calls = lower_graph(graph, isa_target or target)
    stats: dict[str, int] = {}
    executable = build(lowered.mod, target, stats=stats)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(spec.shape).astype(np.float32) for spec in loaded.inputs]
    ours = HostRunner(lowered, executable)(inputs)
    session = onnxruntime_session(str(path))
    theirs = session.run(None, {spec.name: x for spec, x in zip(loaded.inputs, inputs)})
    return ours, theirs, stats, calls, lowered


def assert_close(ours, theirs, rtol=1e-4):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        scale = float(np.abs(b).max()) or 1.0
        assert float(np.abs(a - b).max()) <= rtol * scale, float(np.abs(a - b).max()) / scale


@pytest.mark.parametrize("cv", CONVS, ids=str)
def test_fp32_conv_kernels_match_onnxruntime(cv, tmp_path):
    ours, theirs, stats, calls, _ = edgeq_vs_ort(conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(0)))
    assert calls == 1
    assert stats.get("none", 0) == 0, stats
    assert stats.get(float_kernel(cv)) == 1, stats
    assert_close(ours, theirs)


@pytest.mark.parametrize("act", ["int8", "uint8"])
@pytest.mark.parametrize("cv", CONVS, ids=str)
def test_int8_conv_kernels_match_onnxruntime(cv, act, tmp_path):
    path = qdq_conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(1), act)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(path, prequantized=True)
    assert calls == 1
    assert stats.get("none", 0) == 0, stats
    vnni = Isa.of(tvm.target.Target(profiles()["host"].tvm_target())).dot == "vnni"
    # a dense layer whose channels fill no half vector (21 classes) is computed as whole vectors, then sliced
    oc = -(-cv.oc // 16) * 16 if cv.group == 1 and cv.oc % 8 and cv.oc > 16 else cv.oc
    dot = "vnni" if oc % 16 == 0 else "vnni8" if oc % 8 == 0 else ""
    expected = "dwconv" if cv.depthwise else f"conv-{dot}" if vnni and dot and cv.group == 1 else "conv"
    assert stats.get(expected) == 1, stats
    assert any(str(w.dtype) == "int8" for w in lowered.weights.values())  # integer weights, packed
    assert_close(ours, theirs, rtol=1e-5)


def qdq_conv_bias_model(path, rng, oc=32, c=16, group=1, bias=3000):
    """x -> Q/DQ -> Conv (int8 weight, int32 bias) -> ReLU -> Q/DQ: an int8 layer with an int8 output."""
    w = rng.integers(-127, 128, (oc, c // group, 3, 3)).astype(np.int8)
    ws = (rng.random(oc).astype(np.float32) + 0.5) * 0.01
    xs = np.float32(0.05)
    b = rng.integers(-bias, bias, oc).astype(np.int32)
    inits = [numpy_helper.from_array(w, "wq"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.zeros(oc, np.int8), "wz"),
             numpy_helper.from_array(np.array(xs, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.int8), "xz"),
             numpy_helper.from_array(b, "bq"), numpy_helper.from_array((xs * ws).astype(np.float32), "bs"),
             numpy_helper.from_array(np.zeros(oc, np.int32), "bz"),
             numpy_helper.from_array(np.array(0.1, np.float32), "ys"), numpy_helper.from_array(np.array(0, np.int8), "yz")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["bd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], kernel_shape=[3, 3], pads=[1] * 4, group=group),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]),
    ]
    g = helper.make_graph(nodes, "qdq_conv_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 12, 12])],
                          [_out("y", 4)], inits)
    return _save(g, path, opset=13)


@pytest.mark.parametrize("kind,group,bias,start", [("dense", 1, 3000, np.int32), ("depthwise", 16, 3000, np.float32),
                                                   ("depthwise, bias past float's exact range", 16, 1 << 24, None)])
def test_int8_bias_is_where_the_accumulators_start(kind, group, bias, start, tmp_path):
    """The int32 bias of an int8 convolution is folded into the kernel's start values (no add left in the
    graph, one bias-specific start array: int32 for the dot-product kernel, float for the depthwise one,
    whose float lanes hold the integer sum exactly, unless the bias would take it past 2^24) and the
    requantized output is ONNX Runtime's, value for value. A CPU without a dot-product instruction (AVX2 without
    VNNI) has no int8 dense kernel to fold it into."""
    path = qdq_conv_bias_model(tmp_path / "m.onnx", np.random.default_rng(5), oc=16 if group > 1 else 32,
                               group=group, bias=bias)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(path, prequantized=True)
    assert calls == 1 and stats.get("none", 0) == 0, stats
    ops = [b.value.op.name for b in lowered.bindings()]
    starts = [n for n in lowered.weights if re.search(r"_b[0-9a-f]{8}_[0-9]+$", n)]
    if kind == "dense" and not host_isa().dot:  # no dot-product kernel here (AVX2): the add stays after the product
        assert "relax.add" in ops, ops
    elif start is None:
        assert "relax.add" in ops and not starts, (ops, list(lowered.weights))
    else:
        assert "relax.add" not in ops and ops.count("relax.call_tir") == 1, ops
        assert len(starts) == 1 and lowered.weights[starts[0]].dtype == start, list(lowered.weights)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_requantizing_epilogue_is_lrint_and_a_saturating_narrowing(tmp_path):
    """The compile pipeline rewrites the int8 epilogue (``edgeq.backends.cpu.rounding``): on an AVX-512 host the
    library rounds with ``vcvtps2dq`` and narrows with ``vpmovsdb``, not ``vrndscaleps`` and a clip."""
    target = profiles()["host"].tvm_target()
    if Isa.of(tvm.target.Target(target)).lanes != 16:
        pytest.skip("the instruction names checked are AVX-512's")
    loaded = load_model(qdq_conv_bias_model(tmp_path / "m.onnx", np.random.default_rng(5)), None)
    lowered, _ = lower_graph(lower_prequantized(to_relax(loaded)[0], loaded).graph, target)
    asm = "".join(m.inspect_source("asm") for m in build(lowered.mod, target).mod.imports)
    assert "vcvtps2dq" in asm and "vpmovsdb" in asm and "vrndscaleps" not in asm


def test_a_folded_bias_add_that_is_an_output_is_given_back_in_nchw(tmp_path):
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((8, 1, 3, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1] * 4, group=8)],
                          "dw_out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 12])], [_out("y", 4)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    ours, theirs, stats, _, lowered = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert stats.get("dwconv") == 1 and any(re.search(r"_b[0-9a-f]{8}_1$", n) for n in lowered.weights), stats
    assert_close(ours, theirs)


def test_float_bias_is_where_the_accumulators_start(tmp_path):
    """fp32: a depthwise convolution's bias is its accumulators' first value too (the dense float kernels
    keep it in the epilogue), within float rounding of ONNX Runtime."""
    cv = Conv(24, 24, (10, 10), group=24)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(6)))
    assert stats.get("dwconv") == 1, stats
    starts = [n for n in lowered.weights if re.search(r"_b[0-9a-f]{8}_[0-9]+$", n)]
    assert len(starts) == 1 and lowered.weights[starts[0]].dtype == np.float32, list(lowered.weights)
    assert_close(ours, theirs)


def test_vnni_layout_runs_on_a_cpu_without_vnni(tmp_path):
    """A bundle planned for a VNNI CPU, checked on a build host without VNNI: same answers, no vpdpbusd."""
    host = profiles()["host"].host_target_dict()
    if Isa.of(tvm.target.Target(host)).dot != "vnni":
        pytest.skip("this machine has no AVX-512 VNNI to plan for")
    path = qdq_conv_model(Conv(16, 32, (9, 9)), tmp_path / "m.onnx", np.random.default_rng(2), "int8")
    skylake = {**host, "mcpu": "skylake-avx512"}
    ours, theirs, stats, _, lowered = edgeq_vs_ort(path, target=skylake, isa_target=host, prequantized=True)
    assert any(name.endswith("_vnni_0") for name in lowered.weights)
    assert stats.get("conv") == 1 and "conv-vnni" not in stats, stats
    assert_close(ours, theirs, rtol=1e-5)


def test_avx2_cpu_gets_eight_lane_kernels(tmp_path):
    haswell = {**profiles()["host"].host_target_dict(), "mcpu": "haswell"}
    assert Isa.of(tvm.target.Target(haswell)) == Isa(lanes=8, dot="", registers=16)
    path = conv_model(Conv(16, 24, (11, 11)), tmp_path / "m.onnx", np.random.default_rng(3))
    ours, theirs, stats, _, lowered = edgeq_vs_ort(path, target=haswell)
    assert any("_oc8_" in name for name in lowered.weights)  # 24 channels = 3 AVX2 vectors: blocks of 8
    assert stats.get("conv") == 1 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


def mlp_model(path, rng, m=6, k=40, n=24):
    w1 = rng.standard_normal((k, n)).astype(np.float32) * 0.2
    w2 = rng.standard_normal((n, 10)).astype(np.float32) * 0.2
    b2 = rng.standard_normal(10).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [_out("y", 2)],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")])
    return _save(g, path)


def test_matmul_and_gemm_run_on_conv_kernels(tmp_path):
    ours, theirs, stats, calls, _ = edgeq_vs_ort(mlp_model(tmp_path / "m.onnx", np.random.default_rng(4)))
    assert calls == 2
    assert stats.get("conv") == 2 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


def cnn_model(path, rng, batch=2):
    """conv -> maxpool -> conv -> avgpool -> conv -> global average pool -> flatten -> gemm: the NHWC layout
    must flow through the pools and come back to NCHW for the classifier."""
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    inits = {"w1": w(16, 3, 3, 3), "w2": w(32, 16, 3, 3), "w3": w(32, 32, 1, 1), "fc": w(32, 5), "fcb": w(5)}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["c2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p2", "w3"], ["c3"]),
        helper.make_node("Sigmoid", ["c3"], ["s3"]),
        helper.make_node("GlobalAveragePool", ["s3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"]),
    ]
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
                          [_out("y", 2), _out("c2", 4)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return _save(g, path)


def test_layout_flows_through_pools_and_back_for_outputs(tmp_path):
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(cnn_model(tmp_path / "m.onnx", np.random.default_rng(5)))
    assert calls == 4 and describe(lowered)
    assert stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)  # includes c2, an NHWC value inside, returned as NCHW


def test_gpu_targets_are_not_lowered_onto_cpu_kernels(tmp_path):
    """A GPU target gets the CUDA path's graph clean-up (``edgeq.backends.cuda.pipeline``), never a call of a CPU kernel."""
    graph, _ = to_relax(load_model(conv_model(Conv(16, 32, (12, 12)), tmp_path / "m.onnx", np.random.default_rng(9)), None))
    lowered, calls = lower_graph(graph, profiles()["jetson-orin-nano"].tvm_target())
    assert calls == 0 and not any(name.startswith("edgeq_") for name in describe(lowered)), describe(lowered)


def attention_model(path, rng, batch=2, heads=3, seq=10, dim=12):
    """softmax(q @ k^T) @ v with q, k, v computed from the input: products of two activations."""
    wq, wk = (rng.standard_normal((dim, dim)).astype(np.float32) * 0.3 for _ in range(2))
    shape = np.array([batch, seq, heads, dim // heads], np.int64)
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q0"]), helper.make_node("MatMul", ["x", "wk"], ["k0"]),
        helper.make_node("Reshape", ["q0", "shape"], ["q1"]), helper.make_node("Reshape", ["k0", "shape"], ["k1"]),
        helper.make_node("Reshape", ["x", "shape"], ["v1"]),
        helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    g = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, dim])],
                          [_out("y", 4)], [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(wk, "wk"),
                                           numpy_helper.from_array(shape, "shape")])
    return _save(g, path)


def test_attention_products_run_on_the_batched_kernel(tmp_path):
    ours, theirs, stats, calls, _ = edgeq_vs_ort(attention_model(tmp_path / "m.onnx", np.random.default_rng(6)))
    assert calls == 4  # two weight products (conv kernels), two activation products (bmm)
    assert stats.get("bmm") == 2 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


def rows_model(path, rng, seq=9, dim=48, classes=13):
    """LayerNorm over 48 features (3 vectors), a product to 13 classes and the softmax over them (a row that
    no vector divides), and a softmax over the 48 features."""
    scale, bias = (rng.standard_normal(dim).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((dim, classes)).astype(np.float32)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Softmax", ["n"], ["q"], axis=-1),
    ]
    g = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, seq, dim])],
                          [_out("p", 3), _out("q", 3)],
                          [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias"),
                           numpy_helper.from_array(w, "w")])
    return _save(g, path)


def test_layernorm_and_softmax_are_computed_row_by_row(tmp_path):
    """Row-wise functions over rows of whole vectors (LayerNorm and softmax over 48) get the rows schedule (a
    row's steps together, reductions in vectors); the softmax over 13 (no vector to sum in) the generic one.
    All match ONNX Runtime."""
    ours, theirs, stats, _, lowered = edgeq_vs_ort(rows_model(tmp_path / "m.onnx", np.random.default_rng(8)))
    assert stats.get("rows", 0) == 2 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_arm64_bundle_is_built_on_neon_kernels(precision, models, tmp_path, cli):
    """The same lowering for an aarch64 CPU (4-lane NEON vectors), cross-compiled; the bundle's golden
    outputs come from a host build of the same graph, checked against the float model here."""
    extra = []
    if precision == "int8":
        data = tmp_path / "calib.npz"
        np.savez(data, input=np.random.default_rng(0).standard_normal((16, 3, 32, 32)).astype(np.float32))
        extra = ["--precision", "int8", "--calibrate", data]
    res = cli("package", models["resnet_cnn"], "--device", "arm64-cpu", "-o", tmp_path / "out", "-q", "--json", *extra)
    assert res.code == 0, res.stderr
    bundle_dir = tmp_path / "out" / "resnet_cnn-arm64-cpu"
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    assert manifest["library"]["machine"] == "aarch64"
    kernels = manifest["library"]["cpu_kernels"]
    assert kernels["conv_matmul_calls"] == 7 and kernels["schedules"].get("none", 0) == 0, kernels
    assert any("_oc8_" in t["name"] for t in manifest["weights"]["tensors"])  # 2 NEON vectors per channel block
    golden = read_golden(bundle_dir)
    x = golden["input:input"]
    want = onnxruntime_session(str(models["resnet_cnn"])).run(None, {"input": x})[0]
    got = golden[[k for k in golden if k.startswith("output:")][0]]
    tolerance = 1e-4 if precision == "fp32" else 0.1
    assert float(np.abs(got - want).max()) <= tolerance * float(np.abs(want).max())


def test_grouped_multiplier_and_asymmetric_convolutions_get_the_kernel(tmp_path):
    """Grouped (not depthwise) and channel-multiplier convolutions run on the conv kernel as grouped
    convolutions (a multiplier of 2 is groups of 1 input and 2 outputs); asymmetric padding too."""
    rng = np.random.default_rng(8)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.3

    inits = {"w1": w(16, 3, 3, 3), "wg": w(16, 8, 3, 3), "wm": w(32, 1, 3, 3), "wa": w(8, 32, 2, 2)}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "wg"], ["b"], pads=[1, 1, 1, 1], group=2),  # grouped
        helper.make_node("Conv", ["b", "wm"], ["c"], pads=[1, 1, 1, 1], group=16),  # multiplier 2
        helper.make_node("Conv", ["c", "wa"], ["y"], pads=[0, 0, 1, 1]),  # asymmetric padding: kernel
    ]
    g = helper.make_graph(nodes, "fallback", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 11, 11])],
                          [_out("y", 4)], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    ours, theirs, stats, calls, _ = edgeq_vs_ort(_save(g, tmp_path / "m.onnx"))
    assert calls == 4, calls
    assert stats.get("conv") == 4 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)


# DeepLabV3's atrous convolutions on a 14 x 14 map (rates 12 and 24), a strided one with uneven padding
# whose first and last tap rows and columns never reach the map, and an ordinary dilated one (kept whole)
ATROUS = [(Conv(32, 48, (14, 14), dilation=12, pad=12), 9),
          (Conv(32, 48, (14, 14), dilation=24, pad=24), 1),
          (Conv(64, 96, (9, 13), k=3, stride=2, dilation=9, pad=9), 3),
          (Conv(8, 16, (10, 10), dilation=2, pad=2), 1)]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("cv,regions", ATROUS, ids=[str(a[0]) for a in ATROUS])
def test_atrous_convolutions_compute_only_the_taps_that_reach_the_map(cv, regions, precision, tmp_path):
    """A convolution whose taps mostly read padding is computed region by region, each region with the taps
    that reach the input there (``lower._tap_regions``), all through one packed weight, and gives ONNX Runtime's
    result: at rate 24 on 14 x 14 only the centre tap ever reads the map (one 1 x 1 region); an ordinary
    dilated convolution, whose padding costs little, stays whole."""
    rng = np.random.default_rng(11)
    path = conv_model(cv, tmp_path / "m.onnx", rng) if precision == "fp32" else \
        qdq_conv_model(cv, tmp_path / "m.onnx", rng, "int8")
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(path, prequantized=precision == "int8")
    assert calls == regions and stats.get("none", 0) == 0, (calls, stats)
    packed = [n for n, w in lowered.weights.items() if w.ndim >= 5]
    assert len(packed) == 1 and lowered.weights[packed[0]].shape[1:3] == (cv.k, cv.k), list(lowered.weights)
    if precision == "fp32":
        assert_close(ours, theirs)
    else:
        assert_close(ours, theirs, rtol=1e-5)


def resize_model(path, rng, sizes: list[tuple[str, int, int]], c=5, hw=(6, 7), conv_after=True):
    """Conv -> Resize (linear) for each (coordinate mode, height, width), outputs but the first, which goes on
    into a 1x1 convolution (an upsampled feature map read on, as in LR-ASPP); one Resize reads the graph input."""
    w = rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((4, c, 1, 1)).astype(np.float32) * 0.3
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 4)]
    outs = []
    for i, (mode, oh, ow) in enumerate(sizes):
        inits.append(numpy_helper.from_array(np.array([1, c, oh, ow], np.int64), f"s{i}"))
        nodes.append(helper.make_node("Resize", ["c", "", "", f"s{i}"], [f"r{i}"], mode="linear",
                                      coordinate_transformation_mode=mode))
        if i or not conv_after:
            outs.append(_out(f"r{i}", 4))
    if conv_after:
        nodes.append(helper.make_node("Conv", ["r0", "w2"], ["after"]))
        outs.append(_out("after", 4))
    inits.append(numpy_helper.from_array(np.array([1, 3, 120, 128], np.int64), "sx"))
    nodes.append(helper.make_node("Resize", ["x", "", "", "sx"], ["rx"], mode="linear"))
    outs.append(_out("rx", 4))
    g = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, *hw])], outs, inits)
    return _save(g, path)


def test_bilinear_resizes_run_on_the_separable_kernel(tmp_path):
    """Large bilinear resizes (every coordinate mode ONNX's linear Resize has but tf_crop_and_resize) run on
    edgeq's row-then-column kernel, reading the NHWC map a convolution left and writing NHWC where a
    convolution reads on, NCHW for outputs; the values are ONNX Runtime's."""
    sizes = [("half_pixel", 192, 200), ("pytorch_half_pixel", 150, 131), ("align_corners", 160, 170),
             ("asymmetric", 129, 140), ("half_pixel", 12, 14)]
    path = resize_model(tmp_path / "m.onnx", np.random.default_rng(12), sizes)
    ours, theirs, stats, calls, lowered = edgeq_vs_ort(path)
    assert stats.get("resize") == 5 and stats.get("none", 0) == 0, stats  # (12 x 14 is left to TVM: small)
    assert_close(ours, theirs)
    layouts = [tuple(shape_of(b.var)) for b in lowered.bindings() if call_op(b.value) == "relax.call_tir"
               and b.value.args[0].name_hint.startswith("edgeq_resize2d")]
    assert (1, 192, 200, 5) in layouts and (1, 5, 150, 131) in layouts, layouts  # NHWC read on, NCHW out
    # an NCHW output's row pass is the band of weights (broadcast inputs, no gathers); an NHWC one's runs
    # along the channels
    texts = [f.script() for name, f in scheduled_functions(path).items() if name.startswith("edgeq_resize")]
    assert sum(resize.WEIGHTS in t for t in texts) == 4 and len(texts) == 5, [t[:200] for t in texts]


def test_the_band_of_weights_is_planned_only_where_a_resize_enlarges():
    """The row pass of an NCHW output is a band of weights where each vector of outputs reads a few inputs
    (28 -> 224: the 5 its window spans); a resize that shrinks the row (200 -> 129: 27 inputs a vector) and
    an NHWC output (channels are the vector there) keep each output's own taps."""
    isa = Isa(lanes=16, dot="vnni", registers=32)
    up = resize.ResizeSpec(1, 21, 28, 28, 224, 224, "half_pixel", True, False)
    assert resize.window(28, 224, "half_pixel", 16) == 5 and resize.plan(up, isa).band == 16
    assert resize.plan(dataclasses.replace(up, nhwc_out=True), isa).band == 0
    down = resize.ResizeSpec(1, 3, 200, 200, 129, 129, "half_pixel", False, False)
    assert resize.window(200, 129, "half_pixel", 16) > resize.MAX_WINDOW and resize.plan(down, isa).band == 0
    # the window never runs past the row, however few inputs it has
    assert resize.window(3, 200, "align_corners", 16) == 3


def test_a_large_map_goes_back_to_nchw_in_tiles(tmp_path):
    """The NHWC result of a convolution over a large map, a model output, is transposed to NCHW in tiles of
    vectors (``generic._schedule_transpose``): the transpose is scheduled (vectorised, split over the cores)
    and the values are ONNX Runtime's."""
    cv = Conv(8, 48, (40, 36), k=1, pad=0)
    path = conv_model(cv, tmp_path / "m.onnx", np.random.default_rng(13))
    loaded = load_model(path, None)
    lowered, _ = lower_graph(to_relax(loaded)[0], profiles()["host"].tvm_target())
    asm = "".join(m.inspect_source("ll") for m in build(lowered.mod, profiles()["host"].tvm_target()).mod.imports)
    ours, theirs, stats, _, _ = edgeq_vs_ort(path)
    assert stats.get("none", 0) == 0 and stats.get("generic", 0) >= 1, stats
    assert_close(ours, theirs)
    assert "transpose" in asm


def scheduled_functions(path, prequantized: bool = False) -> dict:
    """The TIR functions of a model as the CPU pipeline leaves them after edgeq's schedules, by name."""
    from edgeq.backends.cpu.schedule import scheduling_passes

    target = tvm.target.Target(profiles()["host"].tvm_target())
    loaded = load_model(path, None)
    graph = to_relax(loaded)[0]
    lowered, _ = lower_graph(lower_prequantized(graph, loaded).graph if prequantized else graph, target)
    with target:
        mod = tvm.transform.Sequential(scheduling_passes(target, Isa.of(target)))(lowered.mod)
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_branching_epilogues_join_the_accumulator_tile(tmp_path):
    """Hard-swish ``x * clip(x + 3, 0, 6) / 6`` after a 1x1 convolution, SiLU ``x * sigmoid(x)`` after a
    depthwise one and ``relu(x) + x`` after a 3x3 one read the kernel's result twice: each is computed on the
    accumulators where they are written, with no intermediate map in memory (they were a second pass over
    the output), and the values are ONNX Runtime's."""
    rng = np.random.default_rng(14)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h"]),
             helper.make_node("Conv", ["h", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1] * 4, group=32),
             helper.make_node("Sigmoid", ["c2"], ["s"]), helper.make_node("Mul", ["c2", "s"], ["m"]),
             helper.make_node("Conv", ["m", "w3", "b3"], ["c3"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c3"], ["r"]), helper.make_node("Add", ["r", "c3"], ["y"])]
    inits = [weight("w1", 32, 16, 1, 1), weight("b1", 32), weight("w2", 32, 1, 3, 3), weight("b2", 32),
             weight("w3", 16, 32, 3, 3), weight("b3", 16)]
    g = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 14, 14])],
                          [_out("y", 4)], inits)
    path = _save(g, tmp_path / "m.onnx")
    ours, theirs, stats, calls, _ = edgeq_vs_ort(path)
    assert calls == 3 and stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)
    kernels = {name: f for name, f in scheduled_functions(path).items() if name.startswith("fused_edgeq_")}
    assert len(kernels) == 3, list(kernels)
    for name, func in kernels.items():
        text = func.script()
        maps = re.findall(r"(\w+) = T\.sblock_alloc_buffer\(\((.*?)\)(.*)", text)
        # the accumulator tile (cache_write's "<name>_global", common.TILE) and a padded copy of the input: no map
        # of the result in memory
        assert all(buffer.endswith("_global") or buffer == "edgeq_pad" for buffer, _, rest in maps), (name, maps)


def test_means_accumulate_in_registers_on_every_core(tmp_path):
    """A global average pool of NHWC data (squeeze-and-excitation) sums whole vectors of channels in
    registers, several chains at once, split over the cores; the values are ONNX Runtime's."""
    rng = np.random.default_rng(15)
    w = numpy_helper.from_array((rng.standard_normal((384, 32, 1, 1)) * 0.3).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["y"])]
    g = helper.make_graph(nodes, "mean", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 14, 14])],
                          [_out("y", 4)], [w])
    path = _save(g, tmp_path / "m.onnx")
    ours, theirs, stats, _, _ = edgeq_vs_ort(path)
    assert stats.get("none", 0) == 0, stats
    assert_close(ours, theirs)
    mean = next(f for name, f in scheduled_functions(path).items() if name.startswith("mean")).script()
    # the tile (cache_write's "<name>_global", common.TILE), on every core
    assert re.search(r"\w+_global = T\.sblock_alloc_buffer", mean) and "T.parallel" in mean, mean
    assert re.search(r"T\.vectorized\(T\.int64\((4|8|16)\)\)", mean), mean


def test_an_image_goes_to_nhwc_in_vectors_along_its_rows(tmp_path):
    """An image's 1x3xHxW to NHWC (three channels: no vector along the output's last axis) is computed in
    vectors along the source's rows, channel by channel (an int8 model's input is quantized there too: 0.15 ->
    0.02 ms for 224x224); the values are ONNX Runtime's."""
    plain = conv_model(Conv(3, 16, (64, 64)), tmp_path / "f.onnx", np.random.default_rng(16))
    ours, theirs, stats, _, _ = edgeq_vs_ort(plain)
    assert_close(ours, theirs)
    image = "T.Buffer((T.int64(1), T.int64(3), T.int64(64), T.int64(64))"
    text = [f.script() for f in scheduled_functions(plain).values() if image in f.script()]
    assert len(text) == 1 and "T_transpose" in text[0], text
    assert re.search(r"T\.vectorized\(T\.int64\(16\)\)", text[0]) or Isa.of(
        tvm.target.Target(profiles()["host"].tvm_target())).lanes != 16, text[0]
