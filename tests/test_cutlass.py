"""CUTLASS convolutions for the Jetson GPU (#42, first part), checked without a GPU: the kernels compile inside a
TVM CUDA module through NVRTC for sm_87 (the Orin) and sm_90 (the H200), their SASS runs on the tensor cores with
no spills and fits the profile's shared memory; and what each kernel is asked to compute (the NHWC problem made
from an NCHW convolution, its padding, strides, dilation, channel padding, bias, residual and activation),
replayed on the host in numpy, equals ONNX Runtime on the same convolution."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cutlass_replay  # tests/: the numpy replays of what each kernel computes

from edgeq.backends.cuda import concat_in_place, cutlass
from edgeq.backends.cuda.cutlass.match import main_index
from edgeq.backends.cuda.cubin import cuda_tool
from edgeq.targets import resolve
from edgeq.reference import onnxruntime_session


def _profile(name: str):
    return resolve(name)[0].cuda


def test_cutlass_comes_from_the_tvm_wheel():
    assert (cutlass.cutlass_include() / "cute").is_dir()
    assert cutlass.cutlass_version() == "4.1.0"


def test_problem_from_conv_and_what_is_refused():
    p = cutlass_replay.problem_from_conv((1, 3, 224, 224), (64, 3, 7, 7), (3, 3, 3, 3), (2, 2), (1, 1))
    assert (p.c, p.c_real, p.p, p.q, p.gemm) == (8, 3, 112, 112, (112 * 112, 64, 7 * 7 * 8))
    assert p.flops == 2 * 112 * 112 * 64 * 7 * 7 * 3  # the model's channels, not the padding
    assert cutlass_replay.problem_from_conv((1, 32, 8, 8), (32, 1, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1)) is None  # depthwise
    assert cutlass_replay.problem_from_conv((1, 8, 8, 8), (8, 8, 3, 3), (0, 0, 1, 1), (1, 1), (1, 1)) is None  # asymmetric
    assert cutlass_replay.problem_from_conv((1, 2, 8, 8), (8, 2, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1)) is None  # 2 channels


def test_the_tile_table_fills_the_sms_and_fits_shared_memory():
    orin, h200 = _profile("jetson-orin-nano"), _profile("cuda-sm90")
    assert orin.sm_count == 8 and h200.sm_count == 132
    big = cutlass_replay.problem_from_conv((1, 64, 56, 56), (256, 64, 1, 1), (0, 0, 0, 0), (1, 1), (1, 1))
    small = cutlass_replay.problem_from_conv((1, 512, 7, 7), (512, 512, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1))
    for problem in (big, small):
        for spec in (orin, h200):
            tile = cutlass.choose_tile(problem, spec.sm_count, spec.shared_memory_per_block_optin)
            assert tile.mainloop_bytes() <= spec.shared_memory_per_block_optin
            m, n, _ = problem.gemm
            assert tile.block[1] <= max(64, n)
    # the largest tile where it still makes a wave on the Orin; the smallest where nothing does
    assert cutlass.choose_tile(big, 8, orin.shared_memory_per_block_optin).block == (128, 128, 32)
    assert cutlass.choose_tile(small, 132, h200.shared_memory_per_block_optin).block == (64, 64, 32)
    # less shared memory: fewer stages
    assert cutlass.choose_tile(big, 8, 40 * 1024).stages < cutlass.choose_tile(big, 8, 160 * 1024).stages


CONVS = {  # name: (x shape, w shape, pads, strides, dilations, activation, residual)
    "stem7x7s2": ((1, 3, 37, 41), (16, 3, 7, 7), (3, 3, 3, 3), (2, 2), (1, 1), "relu", False),
    "3x3-residual": ((2, 16, 12, 10), (16, 16, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), "relu", True),
    "1x1s2": ((1, 24, 15, 15), (40, 24, 1, 1), (0, 0, 0, 0), (2, 2), (1, 1), "identity", False),
    "3x3-dilated": ((1, 8, 17, 17), (24, 8, 3, 3), (2, 2, 2, 2), (1, 1), (2, 2), "relu6", False),
    "5x5s2-hardswish": ((1, 12, 20, 18), (8, 12, 5, 5), (2, 2, 2, 2), (2, 2), (1, 1), "hardswish", False),
    "3x3-silu-residual": ((1, 72, 9, 9), (72, 72, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), "silu", True),
}
ONNX_ACT = {"relu": ("Relu", {}), "relu6": ("Clip", {}), "hardswish": ("HardSwish", {}), "silu": None,
            "identity": None}


def _onnx_conv(x_shape, w, b, pads, strides, dilations, activation, residual_shape, group=1):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=list(pads), strides=list(strides),
                              dilations=list(dilations), group=group)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    last = "c"
    if residual_shape is not None:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, list(residual_shape)))
        nodes.append(helper.make_node("Add", [last, "r"], ["a"]))
        last = "a"
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if activation == "relu6":
        inits += [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
    elif activation == "silu":
        nodes += [helper.make_node("Sigmoid", [last], ["s"]), helper.make_node("Mul", [last, "s"], ["y"])]
    elif activation in ("relu", "hardswish"):
        nodes.append(helper.make_node(ONNX_ACT[activation][0], [last], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("case", list(CONVS))
def test_the_replay_of_what_a_kernel_computes_equals_onnxruntime(case):
    """The glue that is edgeq's (problem size, padding, layout, channel padding, epilogue) replayed on the host
    against ONNX Runtime; fp16 inputs, so both see the same values."""

    x_shape, w_shape, pads, strides, dilations, activation, residual = CONVS[case]
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal(x_shape).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float16).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float16).astype(np.float32)
    problem = cutlass_replay.problem_from_conv(x_shape, w_shape, pads, strides, dilations)
    out_shape = (x_shape[0], w_shape[0], problem.p, problem.q)
    r = rng.standard_normal(out_shape).astype(np.float16).astype(np.float32) if residual else None
    model = _onnx_conv(x_shape, w, b, pads, strides, dilations, activation, out_shape if residual else None)
    feeds = {"x": x, **({"r": r} if residual else {})}
    want = onnxruntime_session(model.SerializeToString()).run(None, feeds)[0]
    assert want.shape == out_shape  # the output size CUTLASS's problem computes is ONNX's
    kernel = cutlass.ConvKernel("k", problem, cutlass.choose_tile(problem, 8, 166912), activation, residual)
    got = cutlass_replay.replay(kernel, cutlass_replay.pad_input(x, problem), cutlass_replay.pad_weights(w, problem), b,
                         None if r is None else np.transpose(r, (0, 2, 3, 1)))
    assert got.dtype == np.float16 and got.shape == (x_shape[0], problem.p, problem.q, w_shape[0])
    np.testing.assert_allclose(np.transpose(got, (0, 3, 1, 2)).astype(np.float32), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("float_out", [False, True])
def test_split_k_slices_sum_as_cutlass_orders_them(float_out):
    """Serial split-K (``cutlass.split_k``): a ResNet's last 3x3 at batch 1 (7x7x512, 8 output tiles of 128x64 on the
    Orin's 8 SMs) gets 4 slices; slice j sums the channel tiles t with t % 4 == j (CUTLASS's iterators step
    ``split_k_slices`` tiles), the first adds the residual, each next adds the partial sum the one before left in
    the output (fp16: rounded to fp16; float32: kept), and the last the bias and the ReLU. The numpy replay and the
    kernel's TIR twin compute that, and both stay with ONNX Runtime fp32 as the unsplit kernel does. Kernels whose
    output holds no partial sum (int8, the residual after the activation, a detector's output) take none."""

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    rng = np.random.default_rng(3)
    x_shape, w_shape = (1, 512, 7, 7), (512, 512, 3, 3)
    x = rng.standard_normal(x_shape).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(9 * 512)).astype(np.float16).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float16).astype(np.float32)
    r = rng.standard_normal((1, 512, 7, 7)).astype(np.float16).astype(np.float32)
    model = _onnx_conv(x_shape, w, b, (1, 1, 1, 1), (1, 1), (1, 1), "relu", r.shape)
    want = onnxruntime_session(model.SerializeToString()).run(
        None, {"x": x, "r": r})[0].transpose(0, 2, 3, 1)
    problem = cutlass_replay.problem_from_conv(x_shape, w_shape, (1, 1, 1, 1), (1, 1), (1, 1))
    tile = cutlass.choose_tile(problem, 8, 166912)
    split = cutlass.split_k(problem, tile, 8)
    assert (tile.block, tile.split_k, split.split_k) == ((128, 64, 32), 1, 4)
    kernel = cutlass.ConvKernel("k", problem, split, "relu", True, float_out=float_out)
    assert kernel.grid == (1, 8, 4)
    dtype = np.float32 if float_out else np.float16
    xs, ws, rs = x.transpose(0, 2, 3, 1).astype(np.float16), w.transpose(0, 2, 3, 1).astype(np.float16), \
        r.transpose(0, 2, 3, 1).astype(dtype)
    bias = b.astype(np.float16)
    got = cutlass_replay.replay(kernel, xs, ws, bias, rs)
    whole = cutlass_replay.replay(dataclasses.replace(kernel, tile=tile), xs, ws, bias, rs)
    step = 2e-3 if dtype == np.float16 else 1e-5  # fp16: an fp16 rounding of each of 3 partial sums, at most
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=step * 2, atol=step * 2)
    np.testing.assert_allclose(whole.astype(np.float32), want, rtol=step, atol=step)
    if float_out:
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
    twin = tvm.runtime.tensor(np.zeros(got.shape, dtype))
    tvm.tirx.build(cutlass.twin_prim_func(kernel), target="llvm")(
        *(tvm.runtime.tensor(a) for a in (xs, ws, bias, rs)), twin)
    # the twin's float32 sums in another order than numpy's: where one crosses an fp16 rounding boundary of a
    # partial sum, a step apart
    np.testing.assert_allclose(twin.numpy().astype(np.float32), got.astype(np.float32), rtol=step, atol=step)
    for other in (dict(precision="int8"), dict(residual_after=True), dict(head_out=(0, 0, 512, 49, "float32"))):
        with pytest.raises(ValueError, match="split-K"):
            cutlass.ConvKernel("k", problem, split, **other)


INT8_CONVS = {  # name: (x shape, w shape, pads, strides, dilations)
    "stem7x7s2": ((1, 3, 23, 21), (16, 3, 7, 7), (3, 3, 3, 3), (2, 2), (1, 1)),
    "3x3-batch2": ((2, 16, 12, 10), (32, 16, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1)),
    "1x1s2-odd": ((1, 24, 15, 15), (40, 24, 1, 1), (0, 0, 0, 0), (2, 2), (1, 1)),
    "3x3-dilated": ((1, 32, 17, 17), (24, 32, 3, 3), (2, 2, 2, 2), (1, 1), (2, 2)),
}


@pytest.mark.parametrize("case", list(INT8_CONVS))
def test_the_int8_replay_equals_onnxruntime_qlinearconv(case):
    """int8 (s8 x s8 -> s32, per-channel weight scales, int32 bias): what edgeq asks the kernel and its Requantize
    epilogue to compute, replayed on the host, against ONNX Runtime's QLinearConv on the same integers."""

    x_shape, w_shape, pads, strides, dilations = INT8_CONVS[case]
    rng = np.random.default_rng(len(case))
    x = rng.integers(-128, 128, x_shape, dtype=np.int8)
    w = rng.integers(-127, 128, w_shape, dtype=np.int8)
    k = w_shape[0]
    bias = rng.integers(-3000, 3000, k, dtype=np.int32)
    x_scale, y_scale = np.float32(0.02), np.float32(0.05)
    w_scale = rng.uniform(0.001, 0.004, k).astype(np.float32)
    zero8 = np.int8(0)
    inits = [numpy_helper.from_array(np.array(x_scale), "xs"), numpy_helper.from_array(np.array(zero8), "xz"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(k, np.int8), "wz"), numpy_helper.from_array(np.array(y_scale), "ys"),
             numpy_helper.from_array(np.array(zero8), "yz"), numpy_helper.from_array(bias, "b")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"], pads=list(pads),
                            strides=list(strides), dilations=list(dilations))
    graph = helper.make_graph([node], "qconv", [helper.make_tensor_value_info("x", TensorProto.INT8, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    want = onnxruntime_session(model.SerializeToString()).run(None, {"x": x})[0]
    problem = cutlass_replay.problem_from_conv(x_shape, w_shape, pads, strides, dilations, "int8")
    # 16 channels a load, or 8 (64-bit loads) where the channels are a multiple of 8 and not of 16: never a pad
    assert problem.c % 16 == 0 or (problem.c == x_shape[1] and problem.c % 8 == 0)
    assert problem.c_real == x_shape[1]
    kernel = cutlass.ConvKernel("k", problem, cutlass.choose_tile(problem, 8, 166912, "int8"), precision="int8")
    scale = (x_scale * w_scale / y_scale).astype(np.float32)  # the multiplier QLinearConv applies per channel
    got = cutlass_replay.replay_int8(kernel, cutlass_replay.pad_input(x, problem), cutlass_replay.pad_weights(w, problem), bias, scale)
    got = np.transpose(got, (0, 3, 1, 2))
    assert got.dtype == np.int8 and got.shape == want.shape
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, (diff.max(), (diff == 0).mean())


DEPTHWISE = {  # name: (x shape NCHW, kernel size, pad, stride, dilation, activation, residual)
    "3x3-relu6": ((1, 32, 13, 11), 3, 1, 1, 1, "relu6", False),
    "3x3s2-batch2": ((2, 96, 15, 14), 3, 1, 2, 1, "identity", False),
    "5x5-silu-residual": ((1, 40, 7, 7), 5, 2, 1, 1, "silu", True),
    "3x3-dilated": ((1, 16, 9, 9), 3, 2, 1, 2, "relu", False),
}


def _depthwise_case(case, precision):
    (n, c, h, w_), ks, pad, stride, dil, activation, residual = DEPTHWISE[case]
    problem = cutlass.Conv2dProblem(n, h, w_, c, c, ks, ks, (pad, pad), (stride, stride), (dil, dil), groups=c)
    if precision == "int8":
        kernel = cutlass.DepthwiseKernel("k", problem, None, activation, residual, "int8", residual_scale=0.04,
                                         act_lo=0.0 if activation in ("relu", "relu6") else -np.inf,
                                         act_hi=6.0 if activation == "relu6" else np.inf, out_div=0.05,
                                         silu=activation == "silu", post=True)
    else:
        kernel = cutlass.DepthwiseKernel("k", problem, None, activation, residual)
    return kernel, (n, c, h, w_), (c, 1, ks, ks)


def _run_twin(kernel, operands: dict) -> np.ndarray:
    """The kernel's TIR before its GPU schedule (``twin_prim_func``), built for this CPU and run on ``operands``."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    lib = tvm.tirx.build(cutlass.twin_prim_func(kernel), target="llvm")
    specs = cutlass.kernel_operands(kernel)
    args = [tvm.runtime.tensor(np.ascontiguousarray(operands[name]).reshape(shape).astype(dtype))
            for name, shape, dtype in specs[:-1]]
    y = tvm.runtime.tensor(np.zeros(specs[-1][1], specs[-1][2]))
    lib(*args, y)
    return y.numpy()


@pytest.mark.parametrize("case", list(DEPTHWISE))
def test_a_depthwise_kernel_computes_what_onnxruntime_does(case):
    """A depthwise convolution (groups = channels) with its fused epilogue, fp16: the numpy replay of what the
    kernel is asked (HWOI weights, NHWC, padding, stride, dilation, bias, residual, activation) against ONNX
    Runtime's grouped Conv, and the kernel's own TIR (before its GPU schedule, built for this CPU) against the
    replay."""

    kernel, x_shape, w_shape = _depthwise_case(case, "fp16")
    p = kernel.problem
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal(x_shape).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal(w_shape) / p.r).astype(np.float16).astype(np.float32)
    b = rng.standard_normal(p.k).astype(np.float16).astype(np.float32)
    out_shape = (p.n, p.k, p.p, p.q)
    r = rng.standard_normal(out_shape).astype(np.float16).astype(np.float32) if kernel.residual else None
    pads, strides, dils = (p.pad * 2), p.stride, p.dilation
    model = _onnx_conv(x_shape, w, b, pads, strides, dils, kernel.activation, out_shape if r is not None else None,
                       group=p.k)
    want = onnxruntime_session(model.SerializeToString()).run(
        None, {"x": x, **({"r": r} if r is not None else {})})[0]
    assert want.shape == out_shape
    nhwc, hwoi = np.transpose(x, (0, 2, 3, 1)), np.transpose(w, (2, 3, 0, 1))
    residual = None if r is None else np.transpose(r, (0, 2, 3, 1))
    got = cutlass_replay.replay(kernel, nhwc, hwoi, b, residual)
    np.testing.assert_allclose(np.transpose(got, (0, 3, 1, 2)).astype(np.float32), want, rtol=2e-3, atol=2e-3)
    twin = _run_twin(kernel, {"x": nhwc, "w": hwoi, "bias": b, "residual": residual})
    np.testing.assert_allclose(twin.astype(np.float32), got.astype(np.float32), rtol=1e-3, atol=1e-3)


GROUPED = {  # name: (x shape NCHW, output channels, groups, stride, activation)
    "regnet-16-a-group": ((1, 64, 9, 9), 64, 4, 1, "relu"),  # RegNetX's groups of 16: four a CTA
    "regnet-s2-batch2": ((2, 32, 11, 10), 32, 2, 2, "relu6"),
    "32-a-group": ((1, 64, 7, 7), 64, 2, 1, "identity"),  # ResNeXt's widest: one group a CTA
    "hardswish-8-a-group": ((1, 32, 6, 6), 32, 4, 1, "hardswish"),  # groups of 8 channels: 4-element loads
}


@pytest.mark.parametrize("case", list(GROUPED))
def test_a_grouped_kernel_computes_what_onnxruntime_does(case):
    """A grouped convolution (RegNet's, ResNeXt's) on CUTLASS's DefaultConv2dGroupFprop, fp16: the numpy replay of
    what the kernel is asked (OHWI weights of C / groups channels, each output channel reading its group) against
    ONNX Runtime's grouped Conv, the kernel's own TIR twin against the replay, and the group mode and the tensor
    cores' work that edgeq's tile choice gives."""

    (n, c, h, w_), k, groups, stride, activation = GROUPED[case]
    problem = cutlass.Conv2dProblem(n, h, w_, c, k, 3, 3, (1, 1), (stride, stride), (1, 1), groups=groups)
    tile = cutlass.group_tile(problem, 8, 166912)
    kernel = cutlass.GroupConvKernel("k", problem, tile, activation)
    cg, kg = c // groups, k // groups
    assert kernel.group_mode == ("kSingleGroup" if kg % tile.block[1] == 0 else "kMultipleGroup")
    assert kernel.input_alignment == (8 if cg % 8 == 0 else 4)
    assert kernel.work == (tile.block[1] // kg if kernel.group_mode == "kMultipleGroup" else 1) * max(1, 32 // cg)
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal((n, c, h, w_)).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal((k, cg, 3, 3)) / np.sqrt(9 * cg)).astype(np.float16).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float16).astype(np.float32)
    model = _onnx_conv((n, c, h, w_), w, b, (1, 1, 1, 1), (stride, stride), (1, 1), activation, None, group=groups)
    want = onnxruntime_session(model.SerializeToString()).run(None, {"x": x})[0]
    assert want.shape == (n, k, problem.p, problem.q)
    nhwc, ohwi = np.transpose(x, (0, 2, 3, 1)), np.transpose(w, (0, 2, 3, 1))
    assert tuple(cutlass.kernel_operands(kernel)[1][1]) == ohwi.shape
    got = cutlass_replay.replay(kernel, nhwc, ohwi, b)
    np.testing.assert_allclose(np.transpose(got, (0, 3, 1, 2)).astype(np.float32), want, rtol=2e-3, atol=2e-3)
    twin = _run_twin(kernel, {"x": nhwc, "w": ohwi, "bias": b})
    np.testing.assert_allclose(twin.astype(np.float32), got.astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["3x3-relu6", "3x3s2-batch2", "5x5-silu-residual"])
def test_an_int8_depthwise_kernel_computes_what_qlinearconv_does(case):
    """int8 depthwise (s8 x s8 -> s32 per channel, the requantizing epilogue): the numpy replay against ONNX
    Runtime's QLinearConv with group = channels (identity epilogue: at most one step apart, >= 99% exact), and the
    kernel's own TIR built for this CPU against the replay bit for bit (with its activation, SiLU and residual)."""

    kernel, x_shape, w_shape = _depthwise_case(case, "int8")
    p = kernel.problem
    rng = np.random.default_rng(len(case))
    x = rng.integers(-128, 128, x_shape, dtype=np.int8)
    w = rng.integers(-127, 128, w_shape, dtype=np.int8)
    bias = rng.integers(-3000, 3000, p.k, dtype=np.int32)
    x_scale, y_scale = np.float32(0.02), np.float32(0.05)
    w_scale = rng.uniform(0.001, 0.004, p.k).astype(np.float32)
    zero8 = np.int8(0)
    inits = [numpy_helper.from_array(np.array(x_scale), "xs"), numpy_helper.from_array(np.array(zero8), "xz"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(p.k, np.int8), "wz"), numpy_helper.from_array(np.array(y_scale), "ys"),
             numpy_helper.from_array(np.array(zero8), "yz"), numpy_helper.from_array(bias, "b")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            pads=list(p.pad * 2), strides=list(p.stride), dilations=list(p.dilation), group=p.k)
    graph = helper.make_graph([node], "qdw", [helper.make_tensor_value_info("x", TensorProto.INT8, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    want = onnxruntime_session(model.SerializeToString()).run(None, {"x": x})[0]
    nhwc, hwoi = np.transpose(x, (0, 2, 3, 1)), np.transpose(w, (2, 3, 0, 1))
    scale = (x_scale * w_scale / y_scale).astype(np.float32)  # QLinearConv's multiplier per channel
    plain = cutlass.DepthwiseKernel("k", p, None, precision="int8")
    got = np.transpose(cutlass_replay.replay_int8(plain, nhwc, hwoi, bias, scale), (0, 3, 1, 2))
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert got.shape == want.shape and diff.max() <= 1 and (diff == 0).mean() >= 0.99, (diff.max(), (diff == 0).mean())
    # the full epilogue: the shift, SiLU or the activation clamp, the residual, the per-channel multiplier (the next
    # depthwise layer's input channel scale), the division
    shift = rng.uniform(-1, 1, p.k).astype(np.float32)
    residual = rng.integers(-128, 128, (p.n, p.p, p.q, p.k), dtype=np.int8) if kernel.residual else None
    scale = (x_scale * w_scale).astype(np.float32)
    post = rng.uniform(0.5, 2.0, p.k).astype(np.float32)
    replayed = cutlass_replay.replay_int8(kernel, nhwc, hwoi, bias, scale, shift, residual, post)
    twin = _run_twin(kernel, {"x": nhwc, "w": hwoi, "bias": bias, "scale": scale, "shift": shift,
                              "residual": residual, "post": post})
    assert len(np.unique(replayed)) > 20  # not saturated
    np.testing.assert_array_equal(twin, replayed)


def test_the_depthwise_schedule_takes_every_mobilenet_v2_and_efficientnet_b0_layer():
    """The depthwise kernel's GPU schedule applies to each depthwise shape of MobileNetV2 and EfficientNet-B0 at 224
    (MobileNetV2's first, 112x112x32, once failed: TVM simplified its thread bindings into a form its
    decompose_reduction refuses); 8 channels per thread, one pixel's channel groups on neighbouring threads."""
    shapes = [(112, 32, 3, 1), (112, 96, 3, 2), (56, 144, 3, 1), (56, 144, 3, 2), (28, 192, 3, 1), (28, 192, 3, 2),
              (14, 384, 3, 1), (14, 576, 3, 1), (14, 576, 3, 2), (7, 960, 3, 1), (56, 144, 5, 2), (28, 240, 5, 1),
              (28, 240, 3, 2), (14, 480, 3, 1), (14, 480, 5, 1), (14, 672, 5, 1), (14, 672, 5, 2), (7, 1152, 5, 1),
              (7, 1152, 3, 1)]
    for (h, c, k, s), precision in itertools.product(shapes, ("fp16", "int8")):
        problem = cutlass.Conv2dProblem(1, h, h, c, c, k, k, (k // 2, k // 2), (s, s), groups=c)
        kernel = cutlass.DepthwiseKernel("k", problem, None, "relu6", precision=precision)
        func = cutlass.depthwise_prim_func(kernel)
        text = func.script()
        assert f'T.thread_binding({kernel.grid[0]}, thread="blockIdx.x")' in text
        assert 'T.thread_binding(128, thread="threadIdx.x")' in text and "T.vectorized(8)" in text


@pytest.fixture(scope="module")
def nvrtc():
    from edgeq.toolchain import cuda_toolkits

    found = [tk for tk in cuda_toolkits() if tk.kind == "nvrtc"]
    if not found or cuda_tool("cuobjdump") is None:
        pytest.skip("needs the NVRTC 12.6 wheels and cuobjdump (pip install -e '.[test]')")
    return found[0]


@pytest.mark.parametrize("profile,precision", [("jetson-orin-nano", "fp16"), ("cuda-sm90", "fp16"),
                                               ("jetson-orin-nano", "int8"), ("cuda-sm90", "int8")])
def test_kernels_compile_in_a_tvm_module_to_tensor_cores(profile, precision, nvrtc, tmp_path):
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    spec = _profile(profile)
    kernels = []
    dtype = "int8" if precision == "int8" else "float16"
    for name in ("stem7x7s2", "3x3-residual", "1x1s2"):
        x_shape, w_shape, pads, strides, dilations, activation, residual = CONVS[name]
        problem = cutlass_replay.problem_from_conv(x_shape, w_shape, pads, strides, dilations, dtype)
        tile = cutlass.choose_tile(problem, spec.sm_count, spec.shared_memory_per_block_optin, precision)
        if precision == "int8":  # the requantizing epilogue: ReLU as a clamp, a residual with its scale; the 1x1
            # shortcut with SiLU and a float32 output (a layer no quantize follows), on 24 input channels: 64-bit loads
            assert (problem.c, cutlass.ConvKernel("a", problem, tile, precision="int8").input_alignment) == (
                (24, 8) if name == "1x1s2" else (problem.c, 16))
            kernels.append(cutlass.ConvKernel(name.replace("-", "_"), problem, tile, activation, residual, "int8",
                                              residual_scale=0.5, act_lo=0.0 if activation == "relu" else -np.inf,
                                              out_div=0.25, lo=-128.0, hi=127.0, float_out=name == "1x1s2",
                                              silu=name == "1x1s2", post=name == "stem7x7s2",
                                              x_view=(16, 32) if name == "3x3-residual" else None))
            if name == "3x3-residual":  # a downsampling block's second conv, which adds the shortcut's float32
                # output (the epilogue's source float, the int8 output through its second output, T); the last block
                # before a global pool: an int8 residual, float32 out
                kernels.append(cutlass.ConvKernel("f32_residual", problem, tile, "relu", True, "int8", 1.0, 0.0,
                                                  out_div=0.25, residual_dtype="float32"))
                kernels.append(cutlass.ConvKernel("int8_residual_f32_out", problem, tile, "relu", True, "int8", 0.5,
                                                  0.0, float_out=True, residual_dtype="int8"))
                # written into channels 32-47 of a 64-channel concatenation in place, its residual from 16-31
                kernels.append(cutlass.ConvKernel("placed", problem, tile, "relu", True, "int8", 0.5, 0.0,
                                                  out_div=0.25, out_view=(32, 64), out_in_place=True,
                                                  residual_view=(16, 64)))
                # YOLO's neck: also written nearest-upsampled 2x into channels 16-31 of a 48-channel concatenation
                kernels.append(cutlass.ConvKernel("upsampled", problem, tile, "identity", False, "int8", silu=True,
                                                  out_div=0.25, out_view=(32, 64), up_view=(16, 48)))
                # a detector head's last conv (float32 out): channels 40-55 at anchors 200-319 of [2, 80, 500]
                kernels.append(cutlass.ConvKernel("head", problem, tile, precision="int8", float_out=True,
                                                  head_out=(40, 200, 80, 500, "float32")))
                # ResNet-50's 1x1 64 -> 256 of the 56x56 stage at batch 8 with its residual (the H200's slow int8
                # kernel): the 128 x 128 tile, whose epilogue takes 16 int8 channels an access
                wide = cutlass.Conv2dProblem(8, 56, 56, 64, 256, 1, 1, (0, 0), (1, 1), (1, 1))
                kernels.append(cutlass.ConvKernel(
                    "wide_residual", wide, cutlass.choose_tile(wide, spec.sm_count, spec.shared_memory_per_block_optin,
                                                               "int8"), "relu", True, "int8", 0.5, 0.0, out_div=0.25))
        else:  # the 1x1 shortcut writes float32 (a classifier whose logits the graph casts to float32), after a
            # GELU (a transformer FFN's: CUTLASS's GELU<float>, erff)
            kernels.append(cutlass.ConvKernel(name.replace("-", "_"), problem, tile,
                                              "gelu" if name == "1x1s2" else activation, residual,
                                              float_out=name == "1x1s2",
                                              x_view=(16, 32) if name == "3x3-residual" else None))
            if name == "1x1s2":  # and with a float32 residual (a transformer's residual stream), float32 out
                kernels.append(cutlass.ConvKernel("float_residual", problem, tile, "identity", True, float_out=True))
            if name == "3x3-residual":  # a YOLO bottleneck's second conv: SiLU, then the residual (edgeq's
                # BiasActResidual epilogue), read from channels 16-31 of a 64-channel concatenation and written into
                # channels 32-47 of it, in place
                kernels.append(cutlass.ConvKernel("placed", problem, tile, "silu", True, residual_after=True,
                                                  out_view=(32, 64), out_in_place=True, residual_view=(16, 64)))
                # YOLO's neck: also written nearest-upsampled 2x into channels 16-31 of a 48-channel concatenation
                kernels.append(cutlass.ConvKernel("upsampled", problem, tile, "silu", out_view=(32, 64), up_view=(16, 48)))
                # a detector head's last conv (fp16, then the model's float32): channels 40-55 at anchors 200-319 of
                # [2, 80, 500]
                kernels.append(cutlass.ConvKernel("head", problem, tile, head_out=(40, 200, 80, 500, "float32")))
    if precision == "fp16":  # serial split-K (``cutlass.split_k``): a ResNet's last 3x3 at batch 1 (7x7x512: 8 output
        # tiles, 4 slices) with its residual and ReLU; a transformer FFN's second layer in an int8 graph (fp16, K =
        # 1536 into 384 columns: 12 tiles, 2 slices) with its float32 bias and residual stream, float32 out
        problem = cutlass.Conv2dProblem(1, 7, 7, 512, 512, 3, 3, (1, 1), (1, 1), (1, 1))
        tile = cutlass.split_k(problem, cutlass.choose_tile(problem, spec.sm_count, spec.shared_memory_per_block_optin),
                               spec.sm_count)
        kernels.append(cutlass.ConvKernel("split", problem, tile, "relu", True))
        problem = cutlass.Conv2dProblem(1, 1, 128, 1536, 384, 1, 1, (0, 0), (1, 1), (1, 1))
        tile = cutlass.split_k(problem, cutlass.choose_tile(problem, spec.sm_count, spec.shared_memory_per_block_optin),
                               spec.sm_count)
        kernels.append(cutlass.ConvKernel("mixed", problem, tile, "identity", True, float_out=True, float_bias=True))
        assert [k.tile.split_k for k in kernels[-2:]] == ([4, 2] if spec.sm_count == 8 else [4, 4]), spec.sm_count
    if precision == "fp16":  # attention's batched GEMMs: 12 heads of [128, 64] x [64, 128], scaled, Q and K read
        # in place from one [1, 128, 3 x 768] projection (K^T as column-major, from column 768), the scores written
        # as float32; P V with the context written back in place
        gemm = cutlass.GemmProblem(12, 128, 128, 64)
        tile = cutlass.choose_tile(gemm, spec.sm_count, spec.shared_memory_per_block_optin)
        kernels.append(cutlass.GemmKernel("qk", gemm, tile, alpha=0.125, a_view=(2304, 64), b_view=(2304, 64),
                                          b_column_major=True, float_out=True, b_offset=768))
        gemm = cutlass.GemmProblem(12, 128, 64, 128)
        tile = cutlass.choose_tile(gemm, spec.sm_count, spec.shared_memory_per_block_optin)
        kernels.append(cutlass.GemmKernel("pv", gemm, tile, y_view=(768, 64)))
        # a window's attention (Swin, MaxViT: 49 tokens): one-element loads, CUTLASS's two-stage mainloop
        for name, gemm in (("win_qk", cutlass.GemmProblem(16, 49, 49, 32)), ("win_pv", cutlass.GemmProblem(16, 49, 32, 49))):
            kern = cutlass.GemmKernel(name, gemm, cutlass.choose_tile(gemm, spec.sm_count, spec.shared_memory_per_block_optin),
                                      float_out=name == "win_qk")
            kernels.append(dataclasses.replace(kern, tile=cutlass.gemm_tile(kern.tile, kern.alignment)))
            assert (kernels[-1].alignment, kernels[-1].tile.stages) == (1, 2)
        # grouped convolutions (CUTLASS's DefaultConv2dGroupFprop): RegNet's groups of 16, several a CTA, and groups
        # of 32, one a CTA, the bias read as a zero-stride source
        for name, groups in (("grouped_many", 4), ("grouped_one", 2)):
            problem = cutlass.Conv2dProblem(1, 14, 14, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1), groups=groups)
            tile = cutlass.group_tile(problem, spec.sm_count, spec.shared_memory_per_block_optin)
            kernels.append(cutlass.GroupConvKernel(name, problem, tile, "relu"))
    # edgeq's depthwise kernels (TIR through TVM's CUDA codegen, in the same module): MobileNetV2's largest, and a 5x5
    # with SiLU and a residual
    depthwise = [_depthwise_case(case, precision)[0] for case in ("3x3s2-batch2", "5x5-silu-residual")]
    depthwise = [dataclasses.replace(k, name=f"dw{i}") for i, k in enumerate(depthwise)]
    target = tvm.target.Target({"kind": "cuda", "arch": spec.arch, "host": "llvm"})
    library, sizes = cutlass.build_module(kernels + depthwise, target, nvrtc, tmp_path)
    source = (tmp_path / f"cutlass_{spec.arch}.cu").read_text()
    reports = {r.name: r for r in cutlass_replay.read_kernels(library, kernels + depthwise, sizes)}
    for kern in depthwise:  # CUDA cores, 16-byte loads (fp16) / 4-byte loads (int8) of the input, no spills
        r = reports.pop(kern.name)
        body = re.search(rf"void __launch_bounds__\(128\) {kern.function}_kernel\(([^)]*)\) {{(.*?)\n}}", source, re.S)
        assert body and ("*(uint4*)(x_ptr" if precision == "fp16" else "*(int*)(x_ptr") in body.group(2)
        assert r.mma == 0 and r.local_bytes == 0 and r.stack_bytes == 0 and r.shared_bytes == 0
        assert r.threads == 128 and r.grid == kern.grid and r.registers <= 255
    for kern in kernels:  # the block's own dynamic shared memory, not a buffer passed in (which ran as an illegal
        # instruction on the H200: CUTLASS's cp.async and ldmatrix took a global address for a shared one)
        body = re.search(rf"void __launch_bounds__\(\d+\) cutlass_{kern.name}_kernel\(([^)]*)\) {{(.*?)\n}}", source, re.S)
        assert body and "smem" not in body.group(1) and "extern __shared__" in body.group(2), body and body.group(0)
    assert set(reports) == {k.name for k in kernels}
    for kern in kernels:  # the 3x3 reads channels 16-31 of a 32-channel tensor in place (one part of a split)
        if getattr(kern, "x_view", None):
            assert f"reinterpret_cast<{'int8_t' if precision == 'int8' else 'half_t'}*>(x) + 16, " \
                   "layout::TensorNHWC(32, 320, 3840)" in source, kern.name
    if precision == "fp16":
        assert "GroupMode::kMultipleGroup" in source and "GroupMode::kSingleGroup" in source
        # the placed kernel: its output and residual rows 64 channels apart, from channel 32 and 16
        assert "BiasActResidual<8, cutlass::epilogue::thread::SiLu<float>>" in source
        placed = source[source.index("void edgeq_cutlass_placed("):]
        assert "reinterpret_cast<half_t*>(residual) + 16, layout::TensorNHWC(64, " in placed
        assert "reinterpret_cast<half_t*>(y) + 32, out_layout}" in placed and "layout::TensorNHWC(64, " in placed
        assert source.count("reinterpret_cast<half_t*>(bias), layout::TensorNHWC(0, 0, 0)") == 2
    if precision == "int8":  # the placed kernel: its output and residual rows 64 channels apart
        placed = source[source.index("void edgeq_cutlass_placed("):]
        assert "reinterpret_cast<int8_t*>(residual) + 16, layout::TensorNHWC(64, " in placed
        assert "reinterpret_cast<int8_t*>(y) + 32, out_layout}" in placed
    # the upsampled copy: T through edgeq's Upsample2xIterator (the output's width, 10, compiled in), from channel 16
    # of a tensor with 48 a pixel; each of its 16-byte (fp16) or 8-byte (int8) accesses stored five times, once as y
    # and at the four pixels it becomes, all global stores
    upsampled = source[source.index("void edgeq_cutlass_upsampled("):]
    assert "y_up + 16, 0, 48)" in upsampled and "WithT<cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<" \
        in source and "edgeq_cutlass::Upsample2x<10>::Iterator>::Kernel" in source
    from gpu_kernels import kernel_sass, sass_by_kernel

    sass = sass_by_kernel(library)
    if precision == "fp16":
        split = [k for k in kernels if k.tile.split_k > 1]
        for kern in split:  # the slices in the problem size, the semaphores (one array, as many as the most output
            # tiles) in Params, the grid's third dimension; the wait and release as acquire/release global accesses
            # (CUTLASS's semaphore code is in every such kernel, run where the grid has slices)
            wrapper = source[source.index(f"void edgeq_cutlass_{kern.name}("):]
            wrapper = wrapper[:wrapper.index("\n}\n")]
            assert f"conv::Mode::kCrossCorrelation, {kern.tile.split_k});" in wrapper
            offset = cutlass.split_k_offsets(kernels)[0][kern.name]  # its own semaphores
            assert f"typename K::Params(args, edgeq_cutlass::split_k_locks + {offset});" in wrapper
            assert len(kern.grid) == 3 and kern.grid[2] == kern.tile.split_k
            assert re.search(r"\bSTRONG\.GPU\b", kernel_sass(f"cutlass_{kern.name}", sass)), kern.name
        if split:  # one array, a semaphore for every output tile of every split kernel, none shared
            assert f"__device__ int split_k_locks[{sum(k.grid[0] * k.grid[1] for k in split)}];" in source
            first = min(split, key=lambda k: k.name)  # their semaphores in the order of their names
            assert sorted(cutlass.split_k_offsets(kernels)[0].values()) == [0, first.grid[0] * first.grid[1]]
        mixed = re.search(r"void edgeq_cutlass_mixed\(([^)]*)\)", source)
        if mixed:  # the float32 bias: the broadcast vector's element
            assert "float* bias" in mixed.group(1) and "false, float>" in source
    from edgeq.backends.cuda.cubin import cuda_images, elf_symbol_sizes, section_sizes

    # no sizing array in the shipped module (smem_sizes compiles them apart): once 994 KB of device memory in
    # ResNet-18 int8; its globals are the split-K semaphores (an int each) and libcu++'s constants (8,500 bytes)
    for image in cuda_images(library):
        assert not elf_symbol_sizes(image.data, "edgeq_smem_")
        assert 4 * cutlass.split_k_offsets(kernels)[1] <= section_sizes(image.data).get(".nv.global", 0) < 2**14
    by_name = {k.name: k for k in kernels}

    def store(name):  # 16 bytes an access: 8 halves, or 16 int8 channels (8 on the smaller tiles: int8_lanes)
        return "STG.E.64" if precision == "int8" and by_name[name].int8_lanes == 8 else "STG.E.128"

    stores = {name: len(re.findall(rf"\b{re.escape(store(name))}\b", kernel_sass(f"cutlass_{name}", sass)))
              for name in ("upsampled", "placed")}
    # (the count of a store instruction in the SASS: each of the upsampled kernel's is one of five; measured: int8
    # 40 against the placed kernel's 8 at 8 lanes, fp16 15 or 25 against 4, as NVRTC unrolls the epilogue's loop)
    assert stores["upsampled"] % 5 == 0 and stores["upsampled"] > stores["placed"] > 0, stores
    assert not re.search(r"\bST\.E", kernel_sass("cutlass_upsampled", sass))  # no generic stores
    # the head's: T through edgeq's ChannelMajorIterator (its 120 pixels a batch, 80 channels, 500 anchors compiled
    # in) from element 40 x 500 + 200 of the output, every element its own 4-byte global store; no Z (ZAsT, StoreZ false)
    head = source[source.index("void edgeq_cutlass_head("):]
    assert "y + 20200, 0, 0)" in head and "edgeq_cutlass::ChannelMajor<120, 80, 500>::Iterator>::Kernel" in source
    assert "float* y," in re.search(r"void edgeq_cutlass_head\(([^)]*)\)", source).group(1) + ","
    code = kernel_sass("cutlass_head", sass)
    assert re.search(r"\bSTG\.E\s", code) and not re.search(r"\bSTG\.E\.(64|128)\b|\bST\.E", code)
    if precision == "int8":  # a residual of another type than the output: the source has its type, y is T
        for name, res, out in (("f32_residual", "float", "int8_t"), ("int8_residual_f32_out", "int8_t", "float")):
            wrapper = re.search(rf"void edgeq_cutlass_{name}\(([^)]*)\)", source).group(1)
            assert f"{res}* residual" in wrapper and f"{out}* y" in wrapper, wrapper
            assert f"Requantize<4, {out}, {res}>" in source
        assert source.count("conv::SplitKMode::kSerial, channel, y, 0, 16)") == 2
        # on the 128 x 128 tile, an int8 residual read 128 bits at a time, as the fp16 kernels read theirs (#63: at 64
        # bits the H200's int8 kernels with a residual took 3.5x the time of those without), and the int8 output
        # stored so too; 64 bits on the smaller tiles
        wide = [n for n in ("3x3_residual", "placed", "wide_residual") if by_name[n].tile.warp[1] == 64]
        assert "wide_residual" in wide
        for name in ("3x3_residual", "placed", "wide_residual"):
            lanes = by_name[name].int8_lanes
            assert lanes == (16 if name in wide else 8) and f"Requantize<{lanes}, int8_t, int8_t>" in source
            code = kernel_sass(f"cutlass_{name}", sass)
            loads = [m for m in re.findall(r"\bLDG\.E((?:\.\w+)*)", code) if "CONSTANT" not in m and "STRONG" not in m]
            width = ".128" if lanes == 16 else ".64"
            assert loads and all(m.endswith(width) for m in loads), loads
    for kern in kernels:  # a float32 output is written as float32 by the epilogue (its ElementOutput)
        wrapper = re.search(rf"void edgeq_cutlass_{kern.name}\(([^)]*)\)", source)
        assert wrapper and ("float* y" if kern.float_out else "* y") in wrapper.group(1), kern.name
        r = reports[kern.name]
        assert r.arch == spec.arch
        assert r.mma > 0  # HMMA (fp16) / IMMA (int8): on the tensor cores
        assert r.local_bytes == 0 and r.stack_bytes == 0  # no spills; Params live in shared memory
        assert r.shared_bytes <= spec.shared_memory_per_block_optin
        assert r.shared_bytes >= kern.tile.mainloop_bytes(1 if precision == "int8" else 2)
        assert r.threads == kern.tile.threads and r.registers <= 255


TEN_CLASSES = "output features not a multiple of 8"  # the test ResNets' classifier (10 classes) stays on dlight


@pytest.mark.parametrize("classes", [10, 16])
def test_the_rewritten_graph_runs_on_the_host_as_the_graph(classes, tmp_path):
    """``--gpu-kernels cutlass``'s graph: every convolution of a ResNet (stem on 3 channels, residual adds, ReLU
    and ReLU6, a strided 1x1 shortcut) claimed by a CUTLASS kernel; the rewritten module, with each kernel's plain
    TIR twin in its place, run on this machine equals the graph before the rewrite (and ONNX Runtime). With 16
    classes the classifier is a CUTLASS kernel too, and writes the float32 logits itself."""

    from test_gpu_path import resnet

    from edgeq.backends import for_profile
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph
    from edgeq.graph_passes import dtype_of
    from edgeq.load import load_model
    from edgeq.relax_import import to_relax

    profile = resolve("jetson-orin-nano")[0]
    backend = for_profile(profile).with_gpu_kernels("cutlass", profile, "fp16")
    model = resnet(tmp_path / "r.onnx", size=32, widths=(8, 16), blocks=1, stem=3, activations=("Relu", "Relu6"),
                   classes=classes)
    graph, _ = to_relax(load_model(model, {}, {}))
    prepared, _ = backend.prepare(graph, profile.tvm_target())
    fp16 = backend.to_fp16(prepared)
    claimed, left = cutlass.find_convs(fp16.main, profile.cuda.sm_count, profile.cuda.shared_memory_per_block_optin)
    convs = sum(1 for n in onnx.load(model).graph.node if n.op_type == "Conv")
    if classes == 10:
        assert len(claimed) == convs and [x["why"] for x in left] == [TEN_CLASSES], left
        assert not any(c.kernel.float_out for c in claimed)
    else:  # the classifier: a 1x1 convolution on the pooled features, float32 out (the graph's output)
        assert len(claimed) == convs + 1 and left == [], left
        assert [c.kernel.float_out for c in claimed] == [False] * convs + [True]
        assert dtype_of(claimed[-1].output) == "float32"
    kinds = {(c.kernel.activation, c.kernel.residual) for c in claimed}
    assert ("relu", True) in kinds or ("relu6", True) in kinds  # a residual block's second conv took the add
    assert claimed[0].kernel.problem.c == 8 and claimed[0].kernel.problem.c_real == 3  # the stem, padded in the graph
    rewritten = cutlass.claim_convs(fp16.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    launches = [b.value for b in Graph(rewritten, fp16.weights).bindings() if call_op_name(b.value) == "relax.call_tir"]
    # the convolutions' kernels, and the global pool that reads fp16 (pipeline.pools_read_fp16)
    assert sorted(c.args[0].name_hint for c in launches) == sorted([c.kernel.function for c in claimed] + ["mean_fp16"])
    twin = Graph(cutlass.with_twins(rewritten, claimed), fp16.weights)
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = HostRunner(fp16)([x])[0]
    got = HostRunner(twin)([x])[0]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    reference = onnxruntime_session(str(model)).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, reference, rtol=5e-2, atol=5e-2)


def _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs, precision: str, placements=(), heads=()):
    """The rewritten module with the kernels' TIR twins equals the graph before the rewrite (int8: bit for bit, but
    where a per-token linear layer's GELU is in its kernel: 1e-4, the host's build of the graph contracting the GELU's
    multiplies and adds into FMAs, a float32 ulp that can cross an fp16 rounding boundary of the FFN's second layer's
    fp16 input; fp16 within 2e-2) on each of ``xs``, and ONNX Runtime within 10% (int8) / 1% (fp16)
    of its largest output. Returns the rewritten module's main."""

    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed}, placements, heads)
    twin = Graph(cutlass.with_twins(rewritten, claimed), prepared.weights)
    session = onnxruntime_session(str(model))
    run_graph, run_twin = HostRunner(prepared), HostRunner(twin)
    for x in xs:
        want, got = run_graph([x])[0], run_twin([x])[0]
        if precision == "int8" and any(getattr(c.kernel, "gelu", None) for c in claimed):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        elif precision == "int8":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        reference = session.run(None, {"input": x})[0]
        error = np.abs(got - reference).max() / np.abs(reference).max()
        assert error < (0.1 if precision == "int8" else 0.01), error
    return rewritten["main"]


def _gemm_replay_matches_twin(c) -> None:
    """A batched GEMM's numpy replay (independent of TVM) equals its TIR twin built for this CPU, on random fp16
    operands, written through the kernel's views: within 2e-3 (fp16), or in int8 steps equal but where the sums' order
    moves an fp16 rounding across a step (``GemmKernel.quantize``)."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    rng = np.random.default_rng(3)
    a = rng.standard_normal(c.shapes["a"]).astype(np.float16)
    w = rng.standard_normal(c.shapes["w"]).astype(np.float16)
    lib = tvm.tirx.build(cutlass.twin_prim_func(c.kernel, c.shapes), target="llvm")
    y = tvm.runtime.tensor(np.zeros(c.shapes["y"], c.kernel.out_dtype))
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(w), y)
    want = cutlass_replay.replay_gemm(c.kernel, a, w).reshape(c.shapes["y"])
    if c.kernel.quantize:
        got = y.numpy().astype(np.int32)
        assert np.abs(got - want).max() <= 1 and np.mean(got == want) > 0.95 and len(np.unique(got)) > 20
    else:
        np.testing.assert_allclose(y.numpy().astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def _densenet(path, size: int = 16):
    """A DenseNet in small (torchvision's ``densenet121`` order): a biased stem, one dense layer (BatchNorm -> ReLU
    -> 1x1 conv without bias -> BatchNorm -> ReLU -> 3x3 conv without bias, concatenated to its input), a
    transition (BatchNorm -> ReLU -> 1x1 conv without bias -> 2x2 average pool), the pooled 16-class classifier.
    The dense layer's 3x3 and the transition's 1x1 are followed by no BatchNorm: nothing gives them a bias."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def weight(name, shape, scale=0.2):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def bn(x, c, out):
        names = [weight(f"{out}_{p}", (c,)) for p in ("g", "b", "m")]
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"{out}_v"))
        nodes.append(helper.make_node("BatchNormalization", [x, *names, f"{out}_v"], [out]))
        return out

    def conv(x, cin, cout, k, out, bias=False):
        args = [x, weight(f"{out}_w", (cout, cin, k, k))] + ([weight(f"{out}_b", (cout,))] if bias else [])
        nodes.append(helper.make_node("Conv", args, [out], pads=[k // 2] * 4))
        return out

    def relu(x, out):
        nodes.append(helper.make_node("Relu", [x], [out]))
        return out

    stem = relu(conv("input", 3, 16, 3, "stem", bias=True), "stem_r")
    grow = conv(relu(bn(conv(relu(bn(stem, 16, "bn1"), "r1"), 16, 32, 1, "c1"), 32, "bn2"), "r2"), 32, 16, 3, "c2")
    nodes.append(helper.make_node("Concat", [stem, grow], ["cat"], axis=1))
    trans = conv(relu(bn("cat", 32, "bn3"), "r3"), 32, 16, 1, "c3")
    nodes += [helper.make_node("AveragePool", [trans], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("GlobalAveragePool", ["pool"], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["flat"]),
              helper.make_node("Gemm", ["flat", weight("fc_w", (16, 16)), weight("fc_b", (16,))], ["output"],
                               transB=1)]
    graph = helper.make_graph(nodes, "densenet", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                 [1, 3, size, size])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 16])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_convolutions_without_a_bias_run_on_cutlass(precision, tmp_path):
    """DenseNet's convolutions into its concatenations and transitions have no bias (no BatchNorm follows them):
    the fp16 kernel takes them with a zero bias, as the int8 one does; all four convolutions and the classifier
    claimed, and the rewritten module with the kernels' TIR twins equals the graph (int8: bit for bit) and is close
    to ONNX Runtime."""


    model = _densenet(tmp_path / "densenet.onnx")
    xs = [np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.concatenate(xs[2:]), tmp_path)
    assert len(claimed) == 5 and left == [], left
    if precision == "fp16":
        assert sum(c.bias is None for c in claimed) == 2  # c2 and c3 (c1 has its BatchNorm folded in)
    _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs[:2], precision)


def _regnet(path, size: int = 16):
    """A RegNetX in small (torchvision's ``regnet_x_*`` block), with gpu_kernels.py's ``Net``: a stem (3x3 s2,
    BatchNorm, ReLU), then two X blocks, each 1x1 -> BatchNorm -> ReLU -> grouped 3x3 -> BatchNorm -> ReLU -> 1x1 ->
    BatchNorm, added to its input and ReLU'd; the first block's groups have 16 channels (RegNetX's), the second's 4
    (too narrow for the tensor cores: ResNeXt's first stage); pooled, a 16-class classifier."""
    from gpu_kernels import Net

    net = Net(4)
    x = net.node("Relu", [net.conv_bn("input", 3, 32, 3, 2)])
    for groups in (2, 8):
        y = net.node("Relu", [net.conv_bn(net.node("Relu", [net.conv_bn(x, 32, 32, 1)]), 32, 32, 3, groups=groups)])
        x = net.node("Relu", [net.node("Add", [x, net.conv_bn(y, 32, 32, 1)])])
    net.classifier(x, 32, 16)
    return net.save(path, size, 16)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_grouped_convolutions_run_on_cutlass_where_the_tensor_cores_gain(precision, tmp_path):
    """RegNet's grouped 3x3s (groups of 16 channels) take CUTLASS's grouped kernel in fp16, with their bias and
    ReLU; groups of 4 channels would make the tensor cores multiply 32x more zeros than values and stay on dlight,
    saying so, as int8 grouped convolutions do (CUTLASS's grouped kernel has the standard epilogue only). The
    rewritten module with the kernels' TIR twins equals the graph and is close to ONNX Runtime."""
    model = _regnet(tmp_path / "regnet.onnx")
    xs = [np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.concatenate(xs[2:]), tmp_path)
    grouped = [c for c in claimed if isinstance(c.kernel, cutlass.GroupConvKernel)]
    whys = [x["why"] for x in left]
    if precision == "fp16":
        assert len(grouped) == 1 and len(claimed) == 7, [type(c.kernel).__name__ for c in claimed]
        kern = grouped[0].kernel
        # two groups of 16 output channels a 32-wide tile, 16 channels a tile's K of 32: 4x the useful work
        assert (kern.problem.groups, kern.channels_per_group, kern.activation, kern.group_mode, kern.tile.block[1],
                kern.work) == (2, 16, "relu", "kMultipleGroup", 32, 4.0)
        assert whys == ["groups of 4 channels: 64x the useful work on the tensor cores (over 8x: zeros of the other "
                        "groups)"], whys
    else:
        assert grouped == [] and len(claimed) == 6 and sorted(whys) == ["NHWC/OHWI, groups 2", "NHWC/OHWI, groups 8"]
    _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs[:2], precision)


def test_a_resnets_last_block_at_batch_1_splits_its_k(tmp_path):
    """A ResNet's last basic block at batch 1 (7x7x512, two 3x3s with BatchNorm, the residual and ReLU): each conv has
    8 output tiles of 128x64 for the Orin's 8 SMs, so the tile table splits its K (9 x 512) in 4 slices (serial
    split-K: 32 CTAs); the residual add and ReLU stay in the last slice's epilogue. The rewritten graph with the
    kernels' twins (which sum the slices in CUTLASS's order, each partial rounded to fp16) equals the graph and ONNX
    Runtime; the batch-1 classifier after it goes to the pool's kernel without its slices."""
    from gpu_kernels import Net

    from edgeq.backends.cuda import pool_classifier
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    net = Net(5)
    x = net.node("Relu", [net.conv_bn("input", 512, 512, 1)])  # (the block's input: the 1x1 before it)
    y = net.node("Relu", [net.conv_bn(x, 512, 512, 3)])
    net.classifier(net.node("Relu", [net.node("Add", [x, net.conv_bn(y, 512, 512, 3)])]), 512, 64)
    model = net.save(tmp_path / "block.onnx", 7, 64, input_shape=[1, 512, 7, 7])
    xs = [np.random.default_rng(seed).standard_normal((1, 512, 7, 7)).astype(np.float32) for seed in range(2)]
    prepared, claimed, left = _claimed_graph(model, "fp16", None, tmp_path)
    # (the 1x1: K = 512 in 2 slices, each keeping 8 main-loop iterations of 32 channels; the classifier, 512 -> 64 on
    # one pixel, too)
    assert left == [] and [(c.kernel.tile.block, c.kernel.tile.split_k, c.kernel.grid) for c in claimed] == [
        ((128, 64, 32), 2, (1, 8, 2))] + [((128, 64, 32), 4, (1, 8, 4))] * 2 + [((64, 64, 32), 2, (1, 1, 2))]
    assert [(c.kernel.activation, c.kernel.residual) for c in claimed] == [("relu", False)] * 2 + [
        ("relu", True), ("identity", False)]
    _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs, "fp16")
    # the batch-1 classifier runs with its global pool on CUDA cores (``pool_classifier``): whole sums, no slices
    pools = pool_classifier.find_pool_classifiers(prepared.main, claimed, 8)
    assert len(pools) == 1 and pools[0].kernel.fc.tile.split_k == 1
    rest = claimed[:-1]
    rewritten = cutlass.claim_convs(prepared.mod, rest, {c.kernel.name: 49152 for c in rest})
    twins = pool_classifier.claim_pool_classifiers(cutlass.with_twins(rewritten, rest), pools, twins=True)
    np.testing.assert_allclose(HostRunner(Graph(twins, prepared.weights))([xs[0]])[0], HostRunner(prepared)([xs[0]])[0],
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["Gelu", "erf"])
def test_an_fp16_kernel_takes_the_gelu_after_it(form, tmp_path):
    """GELU after a convolution in the fp16 epilogue (CUTLASS's GELU<float>): ONNX's Gelu (opset 20) and the erf
    form PyTorch's exporter writes before it (x / sqrt(2) -> Erf -> + 1 -> * x -> * 0.5). One kernel each, and the
    rewritten graph with the kernel's twin equals the graph and ONNX Runtime."""

    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["input", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    if form == "Gelu":
        nodes.append(helper.make_node("Gelu", ["c"], ["output"]))
    else:
        inits += [numpy_helper.from_array(np.float32(np.sqrt(2)), "sqrt2"), numpy_helper.from_array(np.float32(1), "one"),
                  numpy_helper.from_array(np.float32(0.5), "half")]
        nodes += [helper.make_node("Div", ["c", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["c", "a"], ["m"]),
                  helper.make_node("Mul", ["m", "half"], ["output"])]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 16, 8, 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 16, 8, 8])], inits)
    model = tmp_path / "gelu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), model)
    prepared, claimed, left = _claimed_graph(model, "fp16", None, tmp_path)
    assert left == [] and [c.kernel.activation for c in claimed] == ["gelu"]
    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    launches = [b for b in Graph(rewritten, prepared.weights).bindings() if call_op_name(b.value) == "relax.call_tir"]
    assert [b.value.args[0].name_hint for b in launches] == [claimed[0].kernel.function]  # nothing after it
    twin = Graph(cutlass.with_twins(rewritten, claimed), prepared.weights)
    x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    got = HostRunner(twin)([x])[0]
    np.testing.assert_allclose(got, HostRunner(prepared)([x])[0], rtol=1e-2, atol=1e-2)
    reference = onnxruntime_session(str(model)).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, reference, rtol=2e-2, atol=2e-2)


def test_the_rewritten_int8_graph_runs_on_the_host_as_the_graph(tmp_path):
    """``--gpu-kernels cutlass`` on an int8 ResNet (edgeq's calibration, BatchNorm folded after quantization as
    the CUDA path does): every convolution claimed by an int8 CUTLASS kernel, its requantizing chain (bias, scale,
    the BatchNorm's shift, a dequantized residual, ReLU and ReLU6 before the output's quantize) in the epilogue, or,
    where no quantize follows, a float32 output. The downsampling block's two branches, float32 and summed: the
    shortcut writes float32 and the second conv adds it in its epilogue and quantizes (no add kernel after them);
    the last block (before the global pool) adds its int8 residual and writes float32. The rewritten module with each
    kernel's plain TIR twin in its place, run on this machine, equals the graph before the rewrite bit for bit."""
    from test_gpu_path import resnet

    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    model = resnet(tmp_path / "r.onnx", size=32, widths=(16, 32), blocks=2, stem=3, activations=("Relu", "Relu6"))
    calib = np.random.default_rng(1).standard_normal((10, 3, 32, 32)).astype(np.float32)
    prepared, claimed, left = _claimed_graph(model, "int8", calib, tmp_path)
    convs = sum(1 for n in onnx.load(model).graph.node if n.op_type == "Conv")
    assert len(claimed) == convs and [x["why"] for x in left] == [TEN_CLASSES], left
    assert all(c.kernel.precision == "int8" for c in claimed)
    kinds = {(c.kernel.activation, c.kernel.residual, c.kernel.float_out) for c in claimed}
    assert ("relu6", True, False) in kinds and ("relu", False, False) in kinds, kinds
    # (residual's dtype, output's dtype) of the kernels with a residual: int8 blocks, the downsampling block's
    # second conv (the shortcut's float32 output: the shortcut's kernel writes float32, unrounded), the last block
    residuals = [(c.kernel.residual_type, c.kernel.output_dtype) for c in claimed if c.kernel.residual]
    assert residuals == [("int8", "int8")] * 2 + [("float32", "int8"), ("int8", "float32")], residuals
    shortcut = next(c for c in claimed if c.kernel.residual_type == "float32").residual
    assert [c.kernel.float_out for c in claimed if c.output.same_as(shortcut)] == [True]
    assert claimed[0].kernel.problem.c == 16 and claimed[0].kernel.problem.c_real == 3  # the stem, padded to 16
    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    launches = [b.value for b in Graph(rewritten, prepared.weights).bindings() if call_op_name(b.value) == "relax.call_tir"]
    assert len(launches) == len(claimed)
    ops = [call_op_name(b.value) for b in Graph(rewritten, prepared.weights).bindings()]
    # between the input's quantize and the global pool only kernels: every residual add and requantize is in one
    body = ops[ops.index("relax.call_tir"):ops.index("relax.mean")]
    assert body == ["relax.call_tir"] * len(claimed), ops
    twin = Graph(cutlass.with_twins(rewritten, claimed), prepared.weights)
    run_twin, run_graph = HostRunner(twin), HostRunner(prepared)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        np.testing.assert_array_equal(run_twin([x])[0], run_graph([x])[0])


def call_op_name(value) -> str | None:
    from edgeq.graph import call_op

    return call_op(value)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_package_with_cutlass_kernels(precision, nvrtc, tmp_path):
    """``edgeq package --gpu-kernels cutlass`` for the Orin: every convolution on a CUTLASS kernel (HMMA/IMMA in its
    SASS), the manifest saying which kernel each layer got, the reference check passed on the NHWC graph, and the
    roofline estimate of the Orin Nano."""
    import os
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from conftest import run_cli
    from test_gpu_path import resnet

    from edgeq.backends.cuda.cubin import cuda_images

    model = resnet(tmp_path / "r.onnx", size=32, widths=(16, 32), blocks=1, stem=3, activations=("Relu", "Relu6"))
    extra = []
    if precision == "int8":
        np.savez(tmp_path / "calib.npz", input=np.random.default_rng(0).standard_normal((10, 3, 32, 32)).astype(np.float32))
        extra = ["--calibrate", tmp_path / "calib.npz"]
    bundle, manifest = _package_for_orin(model, precision, tmp_path, *extra)
    assert manifest["build"]["args"]["gpu_kernels"] == "cutlass"
    gpu = manifest["library"]["gpu_kernels"]
    # the device math it compiled with (#63): IEEE division, no flush to zero; no FMA contraction for int8
    assert gpu["device_math"]["prec_div"] and not gpu["device_math"]["ftz"]
    assert gpu["device_math"]["fmad"] is (precision != "int8")
    record = gpu["cutlass"]
    convs = sum(1 for n in onnx.load(model).graph.node if n.op_type == "Conv")
    assert record["version"] == "4.1.0" and len(record["kernels"]) == convs
    assert [x["why"] for x in record["left"]] == [TEN_CLASSES], record["left"]
    assert {k["function"] for k in record["kernels"]} == {f for f, rule in gpu["functions"].items() if rule == "cutlass"}
    assert all(k["flops"] > 0 and k["precision"] == precision and k["tile"] for k in record["kernels"])
    from gpu_kernels import model_flops  # benchmarks/: the model's conv/matmul FLOPs from its ONNX shapes

    share = sum(k["flops"] for k in record["kernels"]) / model_flops(model)
    assert 0.95 <= share <= 1.0, share  # the stem's padded channels are not counted
    from gpu_kernels import LAUNCH_US, orin_estimate

    estimate = orin_estimate(manifest)  # the roofline on the Orin Nano: each kernel's time at least its FLOPs at peak
    peak = (4096 if precision == "int8" else 2048) * 8 * 1020e6  # operations per second (targets/jetson-orin-nano.toml)
    for k, e in zip(record["kernels"], estimate["kernels"]):
        assert e["function"] == k["function"] and e["us"] >= k["flops"] / peak * 1e6 and e["bytes"] > 0
        assert e["waves"] == -(-e["ctas"] // (8 * e["ctas_per_sm"])) and 0 < e["wave_efficiency"] <= 1
    assert estimate["ms"] * 1e3 == pytest.approx(estimate["cutlass_us"] + gpu["kernels_per_inference"] * LAUNCH_US, abs=0.2)
    assert gpu["cuda_graph"] is True
    cuobjdump = cuda_tool("cuobjdump")
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ['PATH']}"}
    [image] = [i for i in cuda_images(bundle / "model.so") if i.arch == "sm_87"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image.data)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env).stdout
    bodies = dict(re.findall(r"Function : ([\w$]+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S))
    mma = "IMMA" if precision == "int8" else "HMMA"
    for k in record["kernels"]:
        assert re.search(rf"\b{mma}\.", bodies[f"{k['function']}_kernel"]), k["function"]
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())  # the table's cells, unwrapped
    assert inspect.code == 0 and f"CUTLASS 4.1.0: {convs} of {convs + 1} convolutions and matrix products" in flat, flat
    assert TEN_CLASSES in flat, flat


@pytest.mark.parametrize("device,precision,says", [
    ("host", "fp32", "--gpu-kernels is for profiles with a GPU"),
    ("jetson-orin-nano", "fp32", "--gpu-kernels cutlass takes --precision fp16 or int8"),
])
def test_gpu_kernels_refused_where_it_cannot_apply(device, precision, says, tmp_path):
    from conftest import run_cli
    from test_gpu_path import resnet

    model = resnet(tmp_path / "r.onnx", size=16, widths=(8,), blocks=1)
    res = run_cli("package", model, "--device", device, "--precision", precision, "--gpu-kernels", "cutlass",
                  "-o", tmp_path / "out")
    assert res.code == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _package_for_orin(model, precision: str, tmp_path, *extra):
    """``edgeq package MODEL --device jetson-orin-nano --precision PRECISION --gpu-kernels cutlass EXTRA...`` into
    ``tmp_path / "out"``: it succeeds and its reference check passes. (bundle folder, manifest)."""
    import json
    from pathlib import Path

    from conftest import run_cli

    res = run_cli("package", model, "--device", "jetson-orin-nano", "--precision", precision, "--gpu-kernels", "cutlass",
                  *extra, "-o", tmp_path / "out", "-q", "--json")
    assert res.code == 0, res.stderr
    bundle = Path(json.loads(res.stdout)["bundle_dir"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["reference_check"]["result"] == "passed"
    return bundle, manifest


def _claimed_graph(model, precision: str, calib: np.ndarray, tmp_path):
    """``model`` as ``--gpu-kernels cutlass`` prepares it for the Orin (int8: minmax-calibrated on ``calib``; fp16:
    ToMixedPrecision), and what ``find_convs`` claims of it: (prepared graph, claimed, left)."""
    from edgeq.backends import for_profile
    from edgeq.load import load_model
    from edgeq.relax_import import to_relax

    profile = resolve("jetson-orin-nano")[0]
    backend = for_profile(profile).with_gpu_kernels("cutlass", profile, precision)
    loaded = load_model(model, {}, {})
    graph, _ = to_relax(loaded)
    if precision == "int8":
        from edgeq.quantize import QuantizeArgs, quantize

        np.savez(tmp_path / "calib.npz", input=calib)
        # (no bias correction: a pass over the calibration data that changes only the biases' values; the package
        # tests build with it)
        graph = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz", method="minmax", samples=10,
                                                     bias_correction=False),
                         warn=lambda _: None, target_precisions=backend.layer_precisions).graph
    prepared, _ = backend.prepare(graph, profile.tvm_target())
    if precision == "fp16":
        prepared = backend.to_fp16(prepared)
    claimed, left = cutlass.find_convs(prepared.main, profile.cuda.sm_count, profile.cuda.shared_memory_per_block_optin)
    return prepared, claimed, left


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_bert_style_encoders_linear_layers_run_on_cutlass(precision, tmp_path):
    """A BERT-style encoder (benchmarks/gpu_kernels.py's, at 16 tokens and hidden 64): its six linear layers (Q, K,
    V, the output projection, the FFN's two) become 1x1 convolutions on [1, 1, tokens, features] (views of the
    matrices) claimed by CUTLASS kernels with their bias (fp16) or their dequantizing scale (int8, per-token
    activation scales: the kernel's output is float32, the token scale and the bias follow it). The two attention
    products are fp16 batched GEMMs (one batch per head; fp16 Q K^T with its 1/sqrt(d) in the epilogue; int8 graphs
    keep them in float, and the CUDA path runs them in fp16 as TensorRT does). The rewritten module with the kernels' TIR twins equals the graph before
    the rewrite (int8: bit for bit) and ONNX Runtime, and a batched GEMM's numpy replay equals its twin."""
    from gpu_kernels import bert_encoder

    from edgeq.backends.cuda import layer_norm
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    model = bert_encoder(tmp_path / "bert.onnx", seq=16, hidden=64, heads=2, layers=1)
    xs = [np.random.default_rng(seed).standard_normal((1, 16, 64)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.stack(xs[2:]), tmp_path)
    gemms = [c for c in claimed if isinstance(c.kernel, cutlass.GemmKernel)]
    claimed = [c for c in claimed if c not in gemms]
    # Q K^T: 2 heads of [16, 32] x [32, 16], scaled by 1/sqrt(32) in fp16 (int8: by a weight, after); P V: [16, 16] x
    # [16, 32]
    scaled = pytest.approx(1 / np.sqrt(32), rel=1e-3) if precision == "fp16" else 1.0
    assert left == [] and [(g.kernel.problem, g.kernel.alpha) for g in gemms] == [
        (cutlass.GemmProblem(2, 16, 16, 32), scaled), (cutlass.GemmProblem(2, 16, 32, 16), 1.0)], gemms
    # Q, K and V are one projection of width 192 (``_projections_as_one``; int8: ``_int8_projections_as_one``, with
    # the fp16 cast attention's products read before the head split, ``_fp16_before_head_split``); the heads'
    # transposes are read in place from it: Q at column 0, K (as K^T, column-major) at 64, V at 128, each with a
    # leading dimension of 192 and a batch stride of 32
    assert gemms[0].shapes == {"a": (1, 16, 192), "w": (1, 16, 192), "y": (1, 2, 16, 16)}
    assert (gemms[0].kernel.a_view, gemms[0].kernel.b_view, gemms[0].kernel.y_view) == ((192, 32), (192, 32), None)
    assert (gemms[0].kernel.a_offset, gemms[0].kernel.b_offset) == (0, 64)
    assert gemms[0].kernel.b_column_major and not gemms[1].kernel.b_column_major
    assert (gemms[1].kernel.a_view, gemms[1].kernel.b_view) == (None, (192, 32)) and gemms[1].kernel.b_offset == 128
    assert gemms[0].x.same_as(gemms[0].w) and gemms[1].w.same_as(gemms[0].x)  # the one wide tensor
    # the context written back to [1, 16, 2, 32] (ld 64); int8: quantized with its one calibrated scale (the output
    # projection reads it per tensor, quantize.layers) as the epilogue writes it, [1, 16, 64] int8
    context = (1, 16, 2, 32) if precision == "fp16" else (1, 16, 64)
    assert gemms[1].shapes == {"a": (1, 2, 16, 16), "w": (1, 16, 192), "y": context}
    assert gemms[1].kernel.y_view == (64, 32) and not gemms[1].kernel.float_out
    assert gemms[1].kernel.out_dtype == ("float16" if precision == "fp16" else "int8")
    if precision == "int8":
        divisor, lo, hi = gemms[1].kernel.quantize
        assert divisor > 0 and (lo, hi) == (-128.0, 127.0) or (lo, hi) == (-127.0, 127.0), gemms[1].kernel.quantize
    if precision == "fp16":  # the scores are written as float32 for the softmax, which ToMixedPrecision keeps in
        # float32 (no cast kernel)
        assert gemms[0].kernel.float_out
    else:  # int8: the scores rounded to fp16 as the graph has them (its 1/sqrt(d) is a multiply after the cast to
        # float32)
        assert not gemms[0].kernel.float_out
    problems = sorted((c.kernel.problem.w, c.kernel.problem.c, c.kernel.problem.k) for c in claimed)
    projections = [(16, 64, 192)]
    assert problems == sorted([(16, 64, 64)] + projections + [(16, 64, 256), (16, 256, 64)]), problems
    assert all(c.kernel.problem.n == c.kernel.problem.h == c.kernel.problem.r == 1 for c in claimed)
    assert all(c.shapes["y"] == (1, 16, c.kernel.problem.k) for c in claimed)  # the output in the graph's shape
    if precision == "int8":  # one GEMM each with its epilogue visitor tree: the token scale (per row), the weight scale
        # and the bias (per column), then Q K V's fp16 cast, or the GELU and the fp16 cast of the FFN's second layer,
        # which CUTLASS runs in fp16 (its input made by the first's epilogue: ``CudaBackend.layer_precisions``), with
        # its float32 bias and the residual stream (CUTLASS's bias-elementwise epilogue, its vector float32); the
        # output projection reads the context per tensor: an int8 convolution whose epilogue
        # dequantizes, adds the bias and the residual stream and writes float32
        token = [c for c in claimed if isinstance(c.kernel, cutlass.TokenLinearKernel)]
        projection, = [c for c in claimed if c not in token and c.kernel.precision == "int8"]
        second, = [c for c in claimed if c.kernel.precision == "fp16"]
        assert all(c.bias is not None for c in token)
        epilogues = sorted((c.kernel.problem.k, c.kernel.out_dtype, c.kernel.gelu is not None, c.kernel.residual)
                           for c in token)
        assert epilogues == [(192, "float16", False, False), (256, "float16", True, False)], epilogues
        assert all(c.shapes["token"] == (1, 16, 1) for c in token)
        k = projection.kernel
        assert (type(k), k.precision, k.problem.c, k.problem.k, k.float_out, k.residual, k.residual_type) == (
            cutlass.ConvKernel, "int8", 64, 64, True, True, "float32")
        k = second.kernel
        assert (type(k), k.problem.c, k.problem.k, k.float_out, k.residual, k.residual_after, k.bias_dtype) == (
            cutlass.ConvKernel, 256, 64, True, True, False, "float32")
        assert "cutlass::plus<float>, false, float>" in k.kernel_type
        _, value_of, _, _ = main_index(prepared.main)  # it reads P V's int8 output (a view of it)
        assert value_of[projection.x].args[0].same_as(gemms[1].output)
        # the FFN's second layer reads the first's fp16 output (a view of it)
        assert value_of[second.x].args[0].same_as(next(c for c in token if c.kernel.gelu).output)
        gelu = next(c.kernel.gelu for c in token if c.kernel.gelu)  # the exporter's constants, as the graph has them
        assert gelu == (pytest.approx(1 / np.sqrt(2)), False, 0.5, 1.0, True) or gelu[1], gelu
    else:  # the FFN's first layer takes its GELU (the exporter's erf form) in the epilogue: CUTLASS's GELU<float>
        assert all(c.bias is not None for c in claimed)
        assert sorted(c.kernel.activation for c in claimed) == ["gelu"] + ["identity"] * 3
        assert next(c for c in claimed if c.kernel.activation == "gelu").kernel.problem.k == 256
        # the output projection and the FFN's second layer add the float32 residual stream (their input's) in the
        # epilogue and write float32 for the layer norm
        assert sorted((c.kernel.residual, c.kernel.float_out) for c in claimed) == [(False, False)] * 2 + [(True, True)] * 2
        assert all(c.residual is not None for c in claimed if c.kernel.residual)
    claimed += gemms
    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    # the first layer norm's output is also read in fp16 (int8: quantized per token) by the FFN: one kernel writes
    # both (its host twin here); the last one is the model's output
    norms = layer_norm.find_layer_norms(rewritten)
    assert [(n.kernel.shape, n.kernel.quantize) for n in norms] == [((1, 16, 64), None if precision == "fp16" else 127.0)]
    twins = cutlass.with_twins(rewritten, claimed)
    twins_normed = layer_norm.claim_layer_norms(twins, norms, twins=True)
    # int8: the other per-token quantizes (the input's and the GELU output's) are one kernel each with their row scale
    quantizes = layer_norm.find_row_quantizes(twins_normed)
    assert sorted((q.kernel.shape, q.kernel.dtype) for q in quantizes) == ([] if precision == "fp16" else
                                                                           [((1, 16, 64), "float32")]), quantizes
    twin = Graph(layer_norm.claim_row_quantizes(twins_normed, quantizes, twins=True), prepared.weights)
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    for q in quantizes:  # each quantize's twin against numpy (round half to even, as the graph's round)
        k = q.kernel
        x = (np.random.default_rng(6).standard_normal(k.shape) * 3).astype(k.dtype)
        x[0, 1] = 0  # an all-zero row: scale 1
        scale, q8 = (tvm.runtime.tensor(np.zeros(s, d)) for s, d in (((*k.shape[:-1], 1), "float32"), (k.shape, "int8")))
        tvm.tirx.build(layer_norm.row_quantize_twin(k), target="llvm")(tvm.runtime.tensor(x), scale, q8)
        amax = np.abs(x.astype(np.float32)).max(axis=-1, keepdims=True)
        want_scale = np.where(amax > 0, amax / np.float32(k.quantize), np.float32(1)).astype(np.float32)
        np.testing.assert_array_equal(scale.numpy(), want_scale)
        want = np.clip(np.round(x.astype(np.float32) / want_scale), *k.clamp).astype(np.int8)
        np.testing.assert_array_equal(q8.numpy(), want)
    session = onnxruntime_session(str(model))
    run_graph, run_twin = HostRunner(prepared), HostRunner(twin)
    run_convs = HostRunner(Graph(twins, prepared.weights)) if precision == "int8" else None
    for x in xs[:2]:
        want, got = run_graph([x])[0], run_twin([x])[0]
        if precision == "int8":  # the kernels' twins, with the layer norm's too: float32 values an ulp apart (the host
            # build of the graph fuses the residual add into its layer norm, and contracts its GELU's multiplies and
            # adds into FMAs, which the kernels, rounding each operator as the GPU does, do not); where such an ulp
            # crosses an fp16 rounding boundary of the GELU's output (the FFN's second layer reads it in fp16), that
            # input is an fp16 step (2^-11 relative) apart, and the layer's output by a weight times that
            np.testing.assert_allclose(run_convs([x])[0], want, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        reference = session.run(None, {"input": x})[0]
        assert np.abs(got - reference).max() < (0.25 if precision == "int8" else 0.05)
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    for c in claimed:  # int8: each linear layer's numpy replay (independent of TVM) against its twin (plain LLVM,
        # no FMA contraction): bit for bit but the GELU's erf (TVM's polynomial against libm's); the fp16 one's
        # (float32 sums in another order) to float32's rounding
        if precision == "int8" and isinstance(c.kernel, cutlass.ConvKernel) and c.kernel.precision == "fp16":
            rng = np.random.default_rng(4)
            operands = [rng.standard_normal(shape).astype(dtype)
                        for _, shape, dtype in cutlass.kernel_operands(c.kernel, c.shapes)]
            y = tvm.runtime.tensor(np.zeros_like(operands[-1]))
            tvm.tirx.build(cutlass.twin_prim_func(c.kernel, c.shapes), target="llvm")(
                *(tvm.runtime.tensor(a) for a in operands[:-1]), y)
            x4, w4 = operands[0].reshape(1, 1, 16, 256), operands[1]
            want = cutlass_replay.replay(c.kernel, x4, w4, operands[2], operands[3].reshape(1, 1, 16, 64))
            np.testing.assert_allclose(y.numpy().reshape(want.shape), want, rtol=1e-5, atol=1e-4)
            continue
        if not isinstance(c.kernel, cutlass.TokenLinearKernel):
            continue
        rng = np.random.default_rng(4)
        operands = [(rng.integers(-127, 128, shape) if dtype == "int8" else rng.standard_normal(shape) * 0.05)
                    .astype(dtype) for _, shape, dtype in cutlass.kernel_operands(c.kernel, c.shapes)[:-1]]
        y_shape = cutlass.kernel_operands(c.kernel, c.shapes)[-1][1]
        y = tvm.runtime.tensor(np.zeros(y_shape, c.kernel.out_dtype))
        tvm.tirx.build(cutlass.twin_prim_func(c.kernel, c.shapes), target="llvm")(
            *(tvm.runtime.tensor(a) for a in operands), y)
        want = cutlass_replay.replay_token_linear(c.kernel, *operands).reshape(y_shape)
        if c.kernel.gelu is None:
            np.testing.assert_array_equal(y.numpy(), want)
        else:
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
    for g in gemms:  # the numpy replay (independent of TVM) against the twin, built for this CPU
        _gemm_replay_matches_twin(g)
    if precision == "fp16":  # the views against numpy's own transposes of the graph's tensors
        rng = np.random.default_rng(5)
        qkv = rng.standard_normal((1, 16, 192)).astype(np.float16)
        q, k, v = (qkv[..., i * 64:(i + 1) * 64].reshape(1, 16, 2, 32) for i in range(3))
        scores = cutlass_replay.replay_gemm(gemms[0].kernel, qkv, qkv)
        want = np.matmul(q.transpose(0, 2, 1, 3).astype(np.float32), k.transpose(0, 2, 3, 1).astype(np.float32))
        np.testing.assert_allclose(scores.astype(np.float32).reshape(want.shape), want * gemms[0].kernel.alpha,
                                   rtol=2e-3, atol=2e-3)
        p_ = rng.standard_normal((1, 2, 16, 16)).astype(np.float16)
        context = cutlass_replay.replay_gemm(gemms[1].kernel, p_, qkv)
        want = np.matmul(p_.astype(np.float32), v.transpose(0, 2, 1, 3).astype(np.float32)).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(context.astype(np.float32).reshape(want.shape), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_attention_over_a_window_of_49_tokens_runs_on_cutlass(precision, tmp_path):
    """Swin's and MaxViT's attention is over 7x7 windows: 49 tokens, so Q K^T has N = 49 and P V has K = 49, and no
    access of 8 (or 4, or 2) fp16 elements stays inside a row. These products were left to dlight (in int8 graphs,
    in float32); now they are CUTLASS GEMMs (fp16, in int8 graphs too) that load one element at a time, which
    cp.async cannot (it copies 4, 8 or 16 bytes), so they have CUTLASS's two-stage mainloop with plain loads
    (``MmaPipelined``). The rewritten module with the kernels' TIR twins equals the graph (int8: bit for bit) and
    ONNX Runtime, and a kernel's numpy replay equals its twin."""
    from gpu_kernels import bert_encoder

    model = bert_encoder(tmp_path / "window.onnx", seq=49, hidden=64, heads=2, layers=1)
    xs = [np.random.default_rng(seed).standard_normal((1, 49, 64)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.stack(xs[2:]), tmp_path)
    xs = xs[:2]
    gemms = [c.kernel for c in claimed if isinstance(c.kernel, cutlass.GemmKernel)]
    assert left == [] and [g.problem for g in gemms] == [cutlass.GemmProblem(2, 49, 49, 32),
                                                          cutlass.GemmProblem(2, 49, 32, 49)], left
    assert [(g.alignment, g.tile.stages, g.out_lanes) for g in gemms] == [(1, 2, 1)] * 2
    _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs, precision)
    for c in (c for c in claimed if isinstance(c.kernel, cutlass.GemmKernel)):
        _gemm_replay_matches_twin(c)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_package_a_bert_style_encoder_with_cutlass(precision, nvrtc, tmp_path):
    """``edgeq package`` of the BERT-style encoder for the Orin with ``--gpu-kernels cutlass``: the reference check
    passes, every matmul FLOP but attention's Q K^T is in a CUTLASS kernel whose sm_87 SASS has IMMA (int8 linear
    layers) or HMMA (fp16, and attention's P V batched GEMM in both); Q K^T is in one kernel of edgeq's with its
    softmax (CUDA cores, warp shuffles)."""

    from conftest import run_cli
    from gpu_kernels import bert_encoder, kernel_sass, model_flops, sass_by_kernel

    model = bert_encoder(tmp_path / "bert.onnx", seq=16, hidden=64, heads=2, layers=1)
    extra = []
    if precision == "int8":
        np.savez(tmp_path / "calib.npz", input=np.random.default_rng(0).standard_normal((10, 1, 16, 64)).astype(np.float32))
        extra = ["--calibrate", tmp_path / "calib.npz"]
    bundle, manifest = _package_for_orin(model, precision, tmp_path, *extra)
    gpu = manifest["library"]["gpu_kernels"]
    # captured in CUDA graphs (several regions) but the kernels that read the graph's input (its cast, the first
    # residual add) or write its output (the last layer norm)
    assert gpu["cuda_graph"] and gpu["cuda_graph_kernels"] >= gpu["kernels_per_inference"] - 4, gpu
    record = gpu["cutlass"]
    # Q, K and V as one GEMM (``_projections_as_one``; int8: ``_int8_projections_as_one``)
    kernels = 5
    assert len(record["kernels"]) == kernels and record["left"] == []
    gemms = [k for k in record["kernels"] if "mnk" in k["problem"]]
    assert [k["problem"] for k in gemms] == [{"batch": 2, "mnk": [16, 32, 16]}]  # P V
    (scores,) = record["attention_scores"]
    assert scores["scores"] == [1, 2, 16, 16] and scores["head_dim"] == 32 and scores["flops"] == 2 * 2 * 16 * 16 * 32
    assert gpu["functions"][scores["function"]] == "edgeq attention scores + softmax"
    sass = sass_by_kernel(bundle / "model.so")
    # (int8: the FFN's second layer is fp16, its input the first's fp16 output: ``CudaBackend.layer_precisions``)
    assert all(re.search(rf"\b{'IMMA' if k['precision'] == 'int8' else 'HMMA'}\.", kernel_sass(k["function"], sass))
               for k in record["kernels"] if k not in gemms)
    assert sorted(k["precision"] for k in record["kernels"] if k not in gemms) == (
        ["fp16"] * 4 if precision == "fp16" else ["fp16"] + ["int8"] * 3)
    assert all(re.search(r"\bHMMA\.", kernel_sass(k["function"], sass)) for k in gemms)
    assert sum(k["flops"] for k in record["kernels"]) + scores["flops"] == model_flops(model)
    assert re.search(r"\bSHFL\.", kernel_sass(scores["function"], sass))
    assert not re.search(r"\b(LDL|STL)\b", kernel_sass(scores["function"], sass))
    # the first layer norm writes the float32 residual stream and the FFN's input (fp16; int8: quantized per token,
    # with the row's scale) in one kernel (warp shuffles); the last one is the model's output: TVM's
    norms = record["layer_norms"]
    second = ["float16"] if precision == "fp16" else ["float32 per-token scale", "int8"]
    assert [(n["shape"], n["outputs"]) for n in norms] == [([1, 16, 64], ["float32", *second])]
    assert gpu["functions"][norms[0]["function"]] == "edgeq layer norm"
    assert re.search(r"\bSHFL\.", kernel_sass(norms[0]["function"], sass))
    if precision == "fp16":  # per inference: 5 CUTLASS kernels, Q K^T with the softmax, the two layer norms, the
        # input's cast
        assert gpu["kernels_per_inference"] == 9, gpu["launches"]
    else:  # the input's per-token quantize with its row's scale in one kernel; the layer norm's is in its kernel,
        # the context's (one calibrated scale) in P V's epilogue; the GELU's output is the FFN's second layer's fp16
        # input, written by the first
        quantizes = record["row_quantizes"]
        assert [(q["shape"], q["input"]) for q in quantizes] == [([1, 16, 64], "float32")], quantizes
        assert all(gpu["launches"].get(q["function"]) == 1 for q in quantizes), gpu["launches"]
        assert all(gpu["functions"][q["function"]] == "edgeq per-token quantize" for q in quantizes)
        assert all(re.search(r"\bSHFL\.", kernel_sass(q["function"], sass))
                   and not re.search(r"\b(LDL|STL)\b", kernel_sass(q["function"], sass)) for q in quantizes)
        assert not any(f.startswith("row_scale") for f in gpu["launches"]), gpu["launches"]
        # per inference: 5 CUTLASS kernels (the per-token linear layers' with the token scale, bias and Q K V's fp16
        # cast, or the GELU and its fp16 cast, in their epilogue visitor trees; P V's quantizing the context as it
        # writes it, its heads merged, for the output projection, which reads it per tensor; the FFN's second layer
        # in fp16 with the residual stream's add), Q K^T with the softmax, the input's per-token quantize, the two
        # layer norms: 9 (10 with the FFN's second layer per-token int8 behind a quantize kernel; 11 with the context
        # quantized per token in a kernel of its own; 14 with a row-scale kernel before each quantize; 18 with a
        # kernel after each linear layer for its token scale and what follows it; 23 with three projections and the
        # context's transpose and cast a kernel)
        assert gpu["kernels_per_inference"] == 9, gpu["launches"]
        assert not any("multiply" in f and "add" in f for f in gpu["launches"]), gpu["launches"]
        linear = [k for k in record["kernels"] if "token_scale" in k]
        assert len(linear) == 2 and all(k["template"].startswith("DefaultGemmWithVisitor") for k in linear)
        assert sorted((k["output"], k["activation"], k["residual"]) for k in linear) == [
            ("float16", "gelu", False), ("float16", "identity", False)]
        (second,) = [k for k in record["kernels"] if k["precision"] == "fp16" and k not in gemms]
        assert (second["problem"]["nhwc"], second["output"], second["residual_dtype"], second["bias_dtype"],
                second["residual_after_activation"]) == ([1, 1, 16, 256], "float32", "float32", "float32", False)
        layers = {l["name"]: l for l in manifest["quantization"]["layers"]}
        assert [l["precision"] for l in layers.values()].count("fp16") == 1
        assert next(l for l in layers.values() if l["precision"] == "fp16")["reason"].startswith("CUTLASS")
        (pv,) = [k for k in gemms if k["problem"]["mnk"] == [16, 32, 16]]
        assert pv["output"] == "int8" and pv["quantize"]["divisor"] > 0, pv
        (projection,) = [k for k in record["kernels"] if "requantize" in k]
        assert (projection["precision"], projection["output"], projection["residual_dtype"]) == (
            "int8", "float32", "float32")
    assert not any(re.search(r"\b(LDL|STL)\b", kernel_sass(k["function"], sass)) for k in record["kernels"])  # no spills
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())
    assert f"CUTLASS 4.1.0: {kernels} of {kernels + 1} convolutions and matrix products" in flat, flat
    assert "1 attention score product(s) with their softmax in one kernel each" in flat, flat
    assert "1 layer norm(s) writing the next layer's fp16 or int8 input in the same kernel" in flat, flat
    if precision == "int8":
        assert "1 per-token quantize(s) with their row's scale in one kernel each" in flat, flat


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_yolov8n_style_detector_runs_every_convolution_on_cutlass(precision, tmp_path):
    """The YOLOv8n-style detector (benchmarks/gpu_kernels.py's, at 32x32): all 63 convolutions (C2f blocks, SPPF,
    the PAN neck's strided convs, both head branches with their biased 1x1s) claimed by CUTLASS kernels; each
    conv-BatchNorm-SiLU is one kernel (SiLU, x * sigmoid(x) as the exporter writes it, in the epilogue; int8: before
    the requantization). The
    rewritten module with the kernels' TIR twins equals the graph before the rewrite (int8: bit for bit) and is
    close to ONNX Runtime. (The kernels' compilation is test_kernels_compile_in_a_tvm_module_to_tensor_cores's: 63
    NVRTC builds would cost minutes here.)"""
    from gpu_kernels import yolov8n


    model = yolov8n(tmp_path / "yolo.onnx", size=32)
    xs = [np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.concatenate(xs[2:]), tmp_path)
    convs = sum(1 for n in onnx.load(model).graph.node if n.op_type == "Conv")
    assert convs == 63 and len(claimed) == convs and left == [], left
    if precision == "fp16":  # the head's two 1x1 convs of each level have no activation; the other 57 a SiLU
        assert sorted(c.kernel.activation for c in claimed) == ["identity"] * 6 + ["silu"] * 57
        # each C2f block's first bottleneck reads the second half of its split in place (the split is two slices;
        # the other half fuses into the concatenation): channels [C/2, C) of the C-channel output
        assert sorted(c.kernel.x_view for c in claimed if c.kernel.x_view) == sorted(
            [(16, 32), (32, 64), (64, 128), (128, 256), (64, 128), (32, 64), (64, 128), (128, 256)])
        # each bottleneck with a shortcut adds it after its SiLU, in the epilogue: 6 (1 + 2 + 2 + 1 in the backbone)
        assert sum(c.kernel.residual_after for c in claimed) == 6
    else:  # int8: SiLU in the epilogue, then the requantization; only the head's 6 last convolutions write float32
        # (every part of a concatenation is read at its scale: quantize.shared_scales)
        assert all(c.kernel.precision == "int8" for c in claimed)
        assert sum(c.kernel.silu for c in claimed) == 57 and sum(c.kernel.float_out for c in claimed) == 6
        assert sorted(c.kernel.x_view for c in claimed if c.kernel.x_view) == sorted(
            [(16, 32), (32, 64), (64, 128), (128, 256), (64, 128), (32, 64), (64, 128), (128, 256)])
    # the output [1, 144, 21] (each level's box and class channels at its anchors: 16, 4 and 1 at 32x32) written by
    # the head's six last convolutions, float32 (fp16: their fp16 values as float32, the graph's cast)
    (head,) = concat_in_place.find_head_outputs(prepared.main, claimed)
    assert (head.shape, head.dtype) == ((1, 144, 21), "float32")
    assert [(p["channels"], p["anchors"]) for p in head.record()["parts"]] == [
        (channels, anchors) for anchors in ([0, 16], [16, 20], [20, 21]) for channels in ([0, 64], [64, 144])]
    in_head = {var for var, _, _ in head.parts}
    placements = concat_in_place.find_placements(prepared.main, [c for c in claimed if c.output not in in_head])
    claimed = concat_in_place.place_heads(concat_in_place.place(prepared.main, claimed, placements), [head])
    heads = [c.kernel for c in claimed if c.kernel.head_out]
    assert len(heads) == 6 and [k.out_in_place for k in heads] == [False] + [True] * 5
    assert all(k.head_out[2:] == (144, 21, "float32") and k.activation == "identity" for k in heads)
    main = _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs[:2], precision, placements, [head])
    # written in place by their convolutions: the 8 C2f blocks' concatenations (the first convolution's output,
    # both halves of its split, then each bottleneck's), the neck's two of convolution outputs, SPPF's (its conv's,
    # then its three pools by one kernel), the neck's two of an upsampled map and a backbone level (the upsampled
    # part written by the convolution whose output it upsamples, SPPF's and the first neck C2f's last); the head's
    # are the output's: no concatenation, transpose or resize left
    assert len(placements) == 13 and main.script().count("R.concat(") == 0
    assert main.script().count("permute_dims") == 1  # the input's, to NHWC
    assert sum(pl.pools is not None for pl in placements) == 1 and "max_pool2d" not in main.script()
    assert sorted(len(pl.parts) for pl in placements) == [1] + [2] * 10 + [3] * 2  # 2 bottlenecks: 3
    ups = [(pl.channels, first, pl.ups[var]) for pl in placements for var, first in pl.parts if var in pl.ups]
    assert [u[:2] for u in ups] == [(384, 0), (192, 0)] and "resize2d" not in main.script()
    upsampling = [c for c in claimed if c.kernel.up_view]  # SPPF's last conv (256 channels at 1x1 here), then the
    # neck's first C2f's (128 at 2x2), each also writing its part of the neck's concatenation in place
    assert [(c.kernel.up_view, c.kernel.problem.k, c.kernel.problem.p) for c in upsampling] == [
        ((0, 384), 256, 1), ((0, 192), 128, 2)]
    assert [c.output for c in upsampling] == [u[2] for u in ups] and all(c.kernel.out_view for c in upsampling)
    placed = [c.kernel for c in claimed if c.kernel.out_view]
    assert len(placed) == sum(len(pl.parts) - len(pl.ups) for pl in placements)
    assert sum(k.out_in_place for k in placed) == len(placed) - len(placements)  # the first part allocates
    # + SPPF's pools, + the two upsampling kernels (their second output in place), + the head's five after its first
    assert main.script().count("call_tir_inplace") == len(placed) - len(placements) + 1 + len(ups) + 5
    # every bottleneck reads its input and residual in place, from its block's concatenation (int8: the int8 parts)
    assert sum(1 for c in claimed if c.kernel.residual_view) == 6
    assert all(c.kernel.residual_dtype == "" for c in claimed if c.kernel.residual)
    assert sum(1 for c in claimed if c.kernel.x_view and c.x.name.split("_in_place")[0] in
               {pl.concat.name for pl in placements}) >= 8


MOBILENET = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 1, 2))  # MobileNetV2's first blocks: t, c, n, s


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_mobilenet_v2_runs_its_depthwise_convolutions_on_edgeqs_kernel(precision, tmp_path):
    """A MobileNetV2 (benchmarks/gpu_kernels.py's, its first blocks at 32x32): every 1x1 and the stem on CUTLASS,
    every depthwise 3x3 (stride 1 and 2) on edgeq's depthwise kernel with its BatchNorm, ReLU6 (int8: and the
    requantization) fused, nothing left to dlight. The rewritten module with the kernels' TIR twins equals the graph
    before the rewrite (int8: bit for bit) and is close to ONNX Runtime."""
    from gpu_kernels import mobilenet_v2

    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    model = mobilenet_v2(tmp_path / "m.onnx", size=32, classes=16, settings=MOBILENET, last=64)
    xs = [np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.concatenate(xs[2:]), tmp_path)
    convs = [n for n in onnx.load(model).graph.node if n.op_type == "Conv"]
    groups = [next((a.i for a in n.attribute if a.name == "group"), 1) for n in convs]
    depthwise = [c for c in claimed if isinstance(c.kernel, cutlass.DepthwiseKernel)]
    assert left == [] and len(claimed) == len(convs) + 1  # the classifier: a matrix product as a 1x1
    assert sorted(c.kernel.problem.k for c in depthwise) == sorted(g for g in groups if g > 1)
    assert {c.kernel.problem.stride for c in depthwise} == {(1, 1), (2, 2)}
    if precision == "int8":
        assert all(c.kernel.activation == "relu6" and not c.kernel.float_out for c in depthwise)
        # each depthwise layer reads its input per channel: the conv before it (the stem, the expansions) ends with
        # that channel scale and the requantization, int8 out
        assert sum(c.kernel.post and not c.kernel.float_out for c in claimed) == len(depthwise)
    else:
        assert all(c.kernel.activation == "relu6" and c.shapes["bias"][-1] == c.kernel.problem.k for c in depthwise)
    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    twin = Graph(cutlass.with_twins(rewritten, claimed), prepared.weights)
    session = onnxruntime_session(str(model))
    run_graph, run_twin = HostRunner(prepared), HostRunner(twin)
    for x in xs[:2]:
        want, got = run_graph([x])[0], run_twin([x])[0]
        if precision == "int8":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        reference = session.run(None, {"input": x})[0]
        error = np.abs(got - reference).max() / np.abs(reference).max()
        assert error < (0.05 if precision == "int8" else 0.01), error


def test_package_an_int8_mobilenet_v2_with_depthwise_kernels(nvrtc, tmp_path):
    """``edgeq package --precision int8 --gpu-kernels cutlass`` of the small MobileNetV2 for the Orin: the
    reference check passes, the manifest lists the depthwise layers apart from CUTLASS's (edgeq's template, no
    shared memory, their FLOPs), their sm_87 code has no spills, the kernels are captured in the CUDA graph, and
    ``inspect`` says how the convolutions were taken."""

    from conftest import run_cli
    from gpu_kernels import mobilenet_v2, model_flops, sass_by_kernel

    model = mobilenet_v2(tmp_path / "m.onnx", size=32, classes=16, settings=MOBILENET, last=64)
    np.savez(tmp_path / "calib.npz", input=np.random.default_rng(0).standard_normal((10, 3, 32, 32)).astype(np.float32))
    bundle, manifest = _package_for_orin(model, "int8", tmp_path, "--calibrate", tmp_path / "calib.npz")
    gpu = manifest["library"]["gpu_kernels"]
    record = gpu["cutlass"]
    assert len(record["kernels"]) == 9 and len(record["depthwise"]) == 4 and record["left"] == []  # 9 convs
    [pool] = record["pool_classifiers"]  # the global pool and the classifier (16 classes), one kernel of edgeq's
    assert pool["classes"] == 16 and pool["pooled"] == [1, 4, 4, 64] and pool["input"] == "float32"
    assert gpu["functions"][pool["function"]] == "edgeq pool + classifier" and pool["function"] + "_kernel" in \
        sass_by_kernel(bundle / "model.so")
    assert all(k["template"].startswith("edgeq depthwise") and k["shared_bytes"] == 0 and k["precision"] == "int8"
               and k["requantize"]["activation_clamp"] == [0.0, 6.0] for k in record["depthwise"])
    assert sum(k["flops"] for k in record["kernels"] + record["depthwise"] + [pool]) == model_flops(model)
    assert all(gpu["functions"][k["function"]] == "edgeq depthwise" for k in record["depthwise"])
    sass = sass_by_kernel(bundle / "model.so")
    assert all(re.search(r"\bIMMA\.", sass[k["function"] + "_kernel"]) for k in record["kernels"])
    assert all(k["function"] + "_kernel" in sass for k in record["depthwise"])
    assert gpu["cuda_graph"] and gpu["cuda_graph_kernels"] >= gpu["kernels_per_inference"] - 2, gpu
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())
    assert ("CUTLASS 4.1.0: 9 of 14 convolutions and matrix products, 4 depthwise on edgeq's kernel, 1 batch-1 "
            "classifier(s) with the global pool before it in one kernel (edgeq's)") in flat, flat


EFFICIENTNET = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 1))  # EfficientNet-B0's first stages: t, k, s, c, n


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_an_efficientnet_b0_runs_its_depthwise_convolutions_with_silu_on_edgeqs_kernel(precision, tmp_path):
    """An EfficientNet-B0 (benchmarks/gpu_kernels.py's, its first three stages at 32x32): the 3x3 and 5x5 depthwise
    convolutions (stride 1 and 2) on edgeq's depthwise kernel with their BatchNorm and SiLU fused (int8: and the
    requantization); the 1x1s, the stem and the excitation 1x1s on CUTLASS but the squeeze 1x1s whose 4 and 6 output
    channels are no multiple of 8 (left to dlight, with why). The rewritten module with the kernels' TIR twins
    equals the graph before the rewrite (int8: bit for bit) and is close to ONNX Runtime."""
    from gpu_kernels import efficientnet_b0

    from edgeq.compile import HostRunner
    from edgeq.graph import Graph

    model = efficientnet_b0(tmp_path / "e.onnx", size=32, classes=16, settings=EFFICIENTNET, last=64)
    xs = [np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32) for seed in range(12)]
    prepared, claimed, left = _claimed_graph(model, precision, np.concatenate(xs[2:]), tmp_path)
    convs = [n for n in onnx.load(model).graph.node if n.op_type == "Conv"]
    depthwise = [c for c in claimed if isinstance(c.kernel, cutlass.DepthwiseKernel)]
    assert len(claimed) + len(left) == len(convs) + 1 and len(left) == 3  # + the classifier
    assert all("multiple" in x["why"] for x in left), left
    assert sorted((c.kernel.problem.k, c.kernel.problem.r, c.kernel.problem.stride[0]) for c in depthwise) == [
        (32, 3, 1), (96, 3, 2), (144, 3, 1), (144, 5, 2)]
    if precision == "int8":
        assert all(c.kernel.silu and c.kernel.precision == "int8" for c in depthwise)
    else:
        assert all(c.kernel.activation == "silu" for c in depthwise)
    rewritten = cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed})
    twin = Graph(cutlass.with_twins(rewritten, claimed), prepared.weights)
    session = onnxruntime_session(str(model))
    run_graph, run_twin = HostRunner(prepared), HostRunner(twin)
    for x in xs[:2]:
        want, got = run_graph([x])[0], run_twin([x])[0]
        if precision == "int8":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        reference = session.run(None, {"input": x})[0]
        error = np.abs(got - reference).max() / np.abs(reference).max()
        assert error < (0.05 if precision == "int8" else 0.01), error


def test_the_depthwise_kernels_cuda_source_runs_on_this_cpu_as_the_replay(nvrtc, tmp_path):
    """The CUDA source TVM writes for the depthwise kernels (the module built for sm_87), compiled by g++ for this
    CPU and run over each kernel's whole grid (cuda_on_host.py), equals the numpy replay: the index arithmetic, the
    padding predicates, the 16-byte (fp16) and 4-byte (int8) loads and stores, the tail of a grid that does not
    divide into blocks, and the epilogue. fp16 within a half's rounding; int8 bit for bit, SiLU included (edgeq's
    exp_rn: the same float32 operators in the TIR and in numpy)."""
    from cuda_on_host import HostKernels

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    kernels = [dataclasses.replace(_depthwise_case(case, precision)[0], name=f"{precision}_{i}")
               for i, case in enumerate(DEPTHWISE) for precision in ("fp16", "int8")]
    assert any(k.problem.n * k.problem.p * k.problem.q * k.problem.k // 8 % 128 for k in kernels)  # a partial block
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    _, sizes = cutlass.build_module(kernels, target, nvrtc, tmp_path)
    host = HostKernels((tmp_path / "cutlass_sm_87.cu").read_text(), [f"{k.function}_kernel" for k in kernels], tmp_path)
    rng = np.random.default_rng(7)
    for kern in kernels:
        arrays = {}
        for name, shape, dtype in cutlass.kernel_operands(kern):
            if dtype == "int8":
                arrays[name] = rng.integers(-128, 128, shape, dtype=np.int8)
            elif dtype == "int32":
                arrays[name] = rng.integers(-2000, 2000, shape, dtype=np.int32)
            elif dtype == "float16":
                arrays[name] = (rng.standard_normal(shape) * (0.3 if name == "w" else 1.0)).astype(np.float16)
            else:  # the int8 epilogue's per-channel scale, shift and multiplier
                low, high = {"scale": (0.001, 0.004), "post": (0.5, 2.0)}.get(name, (-1.0, 1.0))
                arrays[name] = rng.uniform(low, high, shape).astype(np.float32)
        arrays["y"] = np.zeros_like(arrays["y"])
        host.run(f"{kern.function}_kernel", kern.grid[0], kern.threads, arrays)
        got = arrays["y"]
        if kern.precision == "int8":
            want = cutlass_replay.replay_int8(kern, arrays["x"], arrays["w"], arrays["bias"], arrays["scale"], arrays["shift"],
                                       arrays.get("residual"), arrays["post"])
            diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
            assert len(np.unique(want)) > 20 and diff.max() == 0, (kern.name, diff.max())
        else:
            want = cutlass_replay.replay(kern, arrays["x"].astype(np.float32), arrays["w"].astype(np.float32),
                                  arrays["bias"], arrays.get("residual"))
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
            assert np.abs(want.astype(np.float32)).max() > 1


LAYER_NORMS = [((1, 16, 64), 1e-12), ((2, 5, 100), 1e-5), ((1, 7, 768), 1e-6), ((3, 1024), 1e-5)]


@pytest.mark.parametrize("shape,eps", LAYER_NORMS)
@pytest.mark.parametrize("second", ["fp16", "int8"])
def test_a_layer_norm_and_its_fp16_cast_are_one_kernel(shape, eps, second, nvrtc, tmp_path):
    """edgeq's layer-norm kernel (``layer_norm.LayerNormKernel``: a float32 layer norm and what the next layer reads
    in one): its host twin equals ONNX Runtime's LayerNormalization in float32 and writes that value's fp16 rounding
    (fp16) or its per-token int8 quantization and the row's scale (int8: numpy's ``where(max|y| > 0, max|y| / 127,
    1)``, ``clip(round(y / scale))``) as the other outputs; its GPU schedule (a row a block, the reductions across a
    warp or, for 768 and 1024 channels, several) builds for sm_87 to one kernel whose SASS reduces with warp
    shuffles, spills nothing and stores every output. Rows of 100 (not a multiple of the 32 threads) and rank 2
    included."""

    from edgeq.backends.cuda import layer_norm
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    c = shape[-1]
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=eps)
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(gamma, "g"), numpy_helper.from_array(beta, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = onnxruntime_session(model.SerializeToString()).run(None, {"x": x})[0]

    kernel = layer_norm.LayerNormKernel("t", shape, eps, shape, None if second == "fp16" else 127.0)
    lib = tvm.tirx.build(layer_norm.twin_prim_func(kernel), target="llvm")
    y = tvm.runtime.tensor(np.zeros(shape, np.float32))
    if second == "fp16":
        others = [tvm.runtime.tensor(np.zeros(shape, np.float16))]
    else:
        others = [tvm.runtime.tensor(np.zeros((*shape[:-1], 1), np.float32)), tvm.runtime.tensor(np.zeros(shape, np.int8))]
    lib(*(tvm.runtime.tensor(a) for a in (x, gamma, beta)), y, *others)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    y = y.numpy()
    if second == "fp16":
        np.testing.assert_array_equal(others[0].numpy(), y.astype(np.float16))
    else:
        amax = np.abs(y).max(axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        np.testing.assert_array_equal(others[0].numpy(), scale)
        q = np.clip(np.round(y / scale), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(others[1].numpy(), q)
        assert len(np.unique(q)) > 100

    assert kernel.threads == {768: 96, 1024: 128}.get(c, 32) and kernel.grid == (int(np.prod(shape[:-1])), 1)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    with nvrtc.active(), target:
        built = tvm.tirx.build(tvm.IRModule({kernel.function: layer_norm.prim_func(kernel)}), target=target)
    source = built.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert kernels == {f"{kernel.function}_kernel"} and "__shfl_down_sync" in source, kernels
    built.export_library(str(tmp_path / "ln.so"))
    from gpu_kernels import kernel_sass, sass_by_kernel

    sass = kernel_sass(kernel.function, sass_by_kernel(tmp_path / "ln.so"))
    assert re.search(r"\bSHFL\.", sass) and not re.search(r"\b(LDL|STL)\b", sass)
    stores = re.findall(r"\bSTG\.E((?:\.\w+)*)", sass)
    narrow = ".U16" if second == "fp16" else ".U8"  # (a signed byte is stored as U8)
    assert any(narrow in s for s in stores) and any(s == "" for s in stores), stores  # and the 32-bit floats


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_global_pool_and_the_batch_1_classifier_are_one_kernel(precision, nvrtc, tmp_path):
    """A ResNet's global average pool and its classifier (16 classes) as one kernel (``pool_classifier``): found
    after the int8 quantize or the fp16 cast of the pooled features; the rewritten module with its host twin (and
    the CUTLASS kernels' twins) equals the graph before the rewrite bit for bit, and nothing runs between the last
    convolution and the logits. Built for sm_87: one kernel of 8 warps on at most the SMs, reducing with warp
    shuffles, no local memory."""
    from test_gpu_path import resnet

    from edgeq.backends.cuda import pool_classifier
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    model = resnet(tmp_path / "r.onnx", size=32, widths=(16, 32), blocks=1, stem=3, classes=16)
    calib = np.random.default_rng(1).standard_normal((10, 3, 32, 32)).astype(np.float32)
    prepared, claimed, left = _claimed_graph(model, precision, calib, tmp_path)
    sms = resolve("jetson-orin-nano")[0].cuda.sm_count
    pools = pool_classifier.find_pool_classifiers(prepared.main, claimed, sms)
    assert left == [] and len(pools) == 1
    kernel = pools[0].kernel
    assert kernel.shape == (1, 16, 16, 32) and kernel.fc.problem.k == 16 and kernel.fc is claimed[-1].kernel
    assert kernel.dtype == ("float32" if precision == "int8" else "float16")
    assert (kernel.quantize is not None) == (precision == "int8") and kernel.blocks == 2  # 16 rows, 8 a block
    rest = claimed[:-1]
    rewritten = cutlass.claim_convs(prepared.mod, rest, {c.kernel.name: 49152 for c in rest})
    twins = pool_classifier.claim_pool_classifiers(cutlass.with_twins(rewritten, rest), pools, twins=True)
    ops = [call_op_name(b.value) for b in Graph(twins, prepared.weights).bindings()]
    assert ops[-len(claimed):] == ["relax.call_tir"] * len(claimed), ops  # the last conv, then the logits
    # against the graph with every layer on its CUTLASS kernel's twin (the classifier too, which writes the
    # unrounded float32 logits as the pool kernel does), and, int8, against the graph itself: bit for bit
    everything = cutlass.with_twins(cutlass.claim_convs(prepared.mod, claimed, {c.kernel.name: 49152 for c in claimed}),
                                    claimed)
    run_twin, run_cutlass = HostRunner(Graph(twins, prepared.weights)), HostRunner(Graph(everything, prepared.weights))
    run_graph = HostRunner(prepared)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        got = run_twin([x])[0]
        np.testing.assert_array_equal(got, run_cutlass([x])[0])
        if precision == "int8":
            np.testing.assert_array_equal(got, run_graph([x])[0])
        else:
            np.testing.assert_allclose(got, run_graph([x])[0], rtol=2e-3, atol=2e-3)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    # and ResNet's: 7x7x512 pooled, 1000 classes as the graph's [1, 1000], 8 blocks (the Orin Nano's SMs)
    fc = cutlass.ConvKernel("fc", cutlass.Conv2dProblem(1, 1, 1, 512, 1000, 1, 1), None, precision=precision,
                            float_out=True)
    big = pool_classifier.PoolClassifierKernel("big", (1, 7, 7, 512), kernel.dtype, fc, {"y": (1, 1000)},
                                               kernel.quantize, pool_classifier.blocks_for(1000, sms))
    assert big.blocks == sms == 8
    with nvrtc.active(), target:
        built = tvm.tirx.build(tvm.IRModule({k.function: pool_classifier.prim_func(k) for k in (kernel, big)}),
                               target=target)
    source = built.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\(", source))
    assert kernels == {("256", f"{k.function}_kernel") for k in (kernel, big)} and "__shfl_down_sync" in source
    assert "__shared__" in source and "__syncthreads()" in source  # the pooled features, shared by the warps
    built.export_library(str(tmp_path / "p.so"))
    from gpu_kernels import kernel_sass, sass_by_kernel

    for k in (kernel, big):  # no local memory (an epilogue indexed through the logits' view once made a
        # thread-local array of 1000)
        sass = kernel_sass(k.function, sass_by_kernel(tmp_path / "p.so"))
        assert re.search(r"\bSHFL\.", sass) and not re.search(r"\b(LDL|STL)\b", sass), k.name
    record = pool_classifier.kernel_record(kernel)
    assert record["grid"] == [2, 1] and record["flops"] == 2 * 16 * 32 and record["pool_adds"] == 16 * 16 * 32


@pytest.mark.parametrize("precision,gate", [("fp16", "Sigmoid"), ("int8", "Sigmoid"), ("fp16", "HardSigmoid")])
def test_a_squeeze_and_excitation_is_one_kernel_after_its_pool(precision, gate, nvrtc, tmp_path):
    """EfficientNet-B0's squeeze-and-excitation (its first three stages at 32x32; int8: with the product's quantize;
    with MobileNetV3's hard sigmoid, whose fp16 constants are scalar casts in the graph)
    as one kernel after its pool (``squeeze_excite``): every block found, outlined into a primitive function that
    TVM fuses into one PrimFunc; the module with them equals the graph bit for bit on the host (they are the
    graph's own operators). For sm_87: each schedules and builds to one kernel with no local memory, the squeezes
    over 144 channels reduce with warp shuffles."""
    from gpu_kernels import efficientnet_b0

    from edgeq.backends.cuda import squeeze_excite
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph
    from edgeq.tvm_env import import_tvm, relax

    tvm = import_tvm()
    model = efficientnet_b0(tmp_path / "e.onnx", size=32, classes=16, settings=EFFICIENTNET, gate=gate)
    calib = np.random.default_rng(1).standard_normal((10, 3, 32, 32)).astype(np.float32)
    prepared, _, _ = _claimed_graph(model, precision, calib, tmp_path)
    found = squeeze_excite.find_squeeze_excitations(prepared.main)
    blocks = sum(n for *_, n in EFFICIENTNET)  # one squeeze-and-excitation a block
    assert [se.shape for se in found] == [(1, 16, 16, 32), (1, 8, 8, 96), (1, 8, 8, 144), (1, 4, 4, 144)][:blocks]
    assert [se.gate_macs for se in found] == [2 * 32 * 8, 96 * 4 + 96 * 8, 144 * 6 + 144 * 8, 144 * 6 + 144 * 8] \
        if precision == "fp16" else all(se.gate_macs > 0 for se in found)
    outlined = squeeze_excite.outline(prepared.mod, found)
    calls = [b.value for b in Graph(outlined, prepared.weights).bindings()
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name_hint", "").startswith("se_")]
    assert len(calls) == len(found)
    from edgeq.graph_passes import shape_of

    one_pixel = [b.var for b in Graph(outlined, prepared.weights).bindings()
                 if call_op_name(b.value) == "relax.nn.conv2d" and shape_of(b.var)[1:3] == [1, 1]]
    assert len(one_pixel) == 1  # the classifier: the squeezes and excitations are inside the functions
    # fused as the CUDA pipeline fuses it (FuseTIR: each function one PrimFunc; TVM's FastMathTransform, in the
    # host pipeline, cannot read a call of a Relax function)
    fused = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                      relax.transform.FuseOps(), relax.transform.FuseTIR()])(outlined)
    assert all(isinstance(fused[se.function], tvm.tirx.PrimFunc) for se in found)
    run_outlined, run_graph = HostRunner(Graph(fused, prepared.weights)), HostRunner(prepared)
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        np.testing.assert_array_equal(run_outlined([x])[0], run_graph([x])[0])
    functions = {se.function: squeeze_excite.schedule(fused[se.function]).with_attr("global_symbol", se.function)
                 for se in found}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    with nvrtc.active(), target:
        built = tvm.tirx.build(tvm.IRModule(functions), target=target)
    source = built.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void __launch_bounds__\(256\) (\w+)\(", source))
    assert kernels == {f"{se.function}_kernel" for se in found}, kernels
    built.export_library(str(tmp_path / "se.so"))
    from gpu_kernels import kernel_sass, sass_by_kernel

    sass = sass_by_kernel(tmp_path / "se.so")
    for se in found:
        code = kernel_sass(se.function, sass)
        assert not re.search(r"\b(LDL|STL)\b", code), se.name
        assert bool(re.search(r"\bSHFL\.", code)) == (se.shape[3] >= squeeze_excite.WIDE), se.name


def test_package_an_efficientnet_b0_with_its_squeeze_excitations_and_classifier_as_edgeqs_kernels(nvrtc, tmp_path):
    """``edgeq package --gpu-kernels cutlass`` (fp16) of the small EfficientNet-B0: the reference check passes;
    each squeeze-and-excitation is one kernel of edgeq's after its pool, the classifier one with the last pool; the
    kernels per inference are within the goal (conv/matmul layers + 2), and ``inspect`` says so."""

    from conftest import run_cli
    from gpu_kernels import efficientnet_b0, sass_by_kernel

    model = efficientnet_b0(tmp_path / "e.onnx", size=32, classes=16, settings=EFFICIENTNET)
    bundle, manifest = _package_for_orin(model, "fp16", tmp_path)
    gpu = manifest["library"]["gpu_kernels"]
    record = gpu["cutlass"]
    layers = sum(1 for n in onnx.load(model).graph.node if n.op_type in ("Conv", "Gemm", "MatMul"))
    excitations = record["squeeze_excitations"]
    assert len(excitations) == 4 and len(record["pool_classifiers"]) == 1 and record["left"] == []
    assert len(record["kernels"]) + len(record["depthwise"]) + 2 * len(excitations) + 1 == layers
    assert all(gpu["functions"][e["function"]] == "edgeq squeeze-excite" for e in excitations)
    assert gpu["fallbacks"] == [] and gpu["kernels_per_inference"] <= layers + 2, gpu["launches"]
    sass = sass_by_kernel(bundle / "model.so")
    assert all(e["function"] + "_kernel" in sass for e in excitations)
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())
    assert f"CUTLASS 4.1.0: {len(record['kernels'])} of {layers} convolutions and matrix products" in flat, flat
    assert "4 squeeze-and-excitation gate(s) with their product in one kernel each (edgeq's; 8 one-pixel " \
           "convolutions)" in flat, flat


def test_sppf_pools_and_its_concatenation_are_one_kernel_written_in_place(nvrtc, tmp_path):
    """YOLOv8's SPPF on a 12x10 map (fp16): a 1x1 conv-SiLU, three chained 5x5 max pools of it, the four
    concatenated, a 1x1 conv. The first conv writes channels [0, 16) of the concatenation; one kernel of edgeq's
    writes the three pools into [16, 64) in place (a 5x5, 9x9 and 13x13 max over the conv's channels: what the
    chained pools compute); no concatenation and no pool is left in the graph. The rewritten module with the kernels'
    twins equals the graph and ONNX Runtime; the pool kernel's GPU schedule builds for sm_87 with no local memory."""
    from gpu_kernels import Net, kernel_sass, sass_by_kernel

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    net = Net(5)
    y = net.conv_bn("input", 8, 16, 1)
    pools = [net.node("Mul", [y, net.node("Sigmoid", [y])])]
    for _ in range(3):
        pools.append(net.node("MaxPool", [pools[-1]], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2]))
    out = net.conv_bn(net.node("Concat", pools, axis=1), 64, 16, 1)
    net.nodes.append(onnx.helper.make_node("Identity", [out], ["out"]))
    model = net.save(tmp_path / "sppf.onnx", 0, 0, input_shape=[1, 8, 12, 10], output=("out", [1, 16, 12, 10]))
    xs = [np.random.default_rng(seed).standard_normal((1, 8, 12, 10)).astype(np.float32) for seed in range(2)]
    prepared, claimed, left = _claimed_graph(model, "fp16", None, tmp_path)
    placements = concat_in_place.find_placements(prepared.main, claimed)
    assert len(claimed) == 2 and left == [] and len(placements) == 1
    pools = placements[0].pools
    assert (pools.first, pools.channels, pools.source, pools.radii) == (16, 16, 0, (2, 4, 6))
    claimed = concat_in_place.place(prepared.main, claimed, placements)
    assert claimed[0].kernel.out_view == (0, 64) and not claimed[0].kernel.out_in_place
    main = _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs, "fp16", placements)
    text = main.script()
    assert "R.concat(" not in text and "max_pool2d" not in text and text.count("call_tir_inplace") == 1
    func = concat_in_place.schedule(concat_in_place.pool_prim_func(placements[0]))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    with nvrtc.active(), target:
        built = tvm.tirx.build(tvm.IRModule({pools.function: func.with_attr("global_symbol", pools.function)}),
                               target=target)
    built.export_library(str(tmp_path / "pools.so"))
    code = kernel_sass(pools.function, sass_by_kernel(tmp_path / "pools.so"))
    assert re.search(r"\bLDG\.", code) and re.search(r"\bSTG\.", code)  # one kernel reading and writing global
    assert not re.search(r"\b(LDL|STL)\b", code)  # the max in a register


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_an_inception_blocks_concatenation_is_written_in_place(precision, tmp_path):
    """GoogLeNet's inception block (fp16 and int8: the concatenation's quantize is hoisted into its parts, so each
    branch's kernel writes int8 at the concatenation's scale): four branches (a 1x1; 1x1 -> 3x3; 1x1 -> 3x3; a 3x3 max pool -> 1x1), each
    ending in a conv-BatchNorm-ReLU, concatenated and read by the next conv; and SqueezeNet's fire module (a 1x1
    squeeze, then 1x1 and 3x3 expands concatenated). Every branch's last conv writes its channels of the
    concatenation (the first allocates it, the others in place); no concatenation kernel is left; the rewritten module
    with the kernels' twins equals the graph and ONNX Runtime."""
    from gpu_kernels import Net

    net = Net(6)

    def conv(x, cin, cout, k):
        return net.node("Relu", [net.conv_bn(x, cin, cout, k)])

    x = conv("input", 8, 16, 3)
    pool = net.node("MaxPool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    branches = [conv(x, 16, 16, 1), conv(conv(x, 16, 8, 1), 8, 16, 3), conv(conv(x, 16, 8, 1), 8, 8, 3),
                conv(pool, 16, 8, 1)]
    inception = net.node("Concat", branches, axis=1)  # 48 channels
    squeeze = conv(inception, 48, 8, 1)
    fire = net.node("Concat", [conv(squeeze, 8, 16, 1), conv(squeeze, 8, 16, 3)], axis=1)
    out = net.conv_bn(fire, 32, 16, 1)
    net.nodes.append(onnx.helper.make_node("Identity", [out], ["out"]))
    model = net.save(tmp_path / "inception.onnx", 0, 0, input_shape=[1, 8, 10, 12], output=("out", [1, 16, 10, 12]))
    xs = [np.random.default_rng(seed).standard_normal((1, 8, 10, 12)).astype(np.float32) for seed in range(2)]
    calib = np.concatenate([np.random.default_rng(seed).standard_normal((1, 8, 10, 12)).astype(np.float32)
                            for seed in range(2, 12)])
    prepared, claimed, left = _claimed_graph(model, precision, calib, tmp_path)
    assert len(claimed) == 11 and left == []
    placements = concat_in_place.find_placements(prepared.main, claimed)
    assert sorted((pl.channels, len(pl.parts)) for pl in placements) == [(32, 2), (48, 4)]
    claimed = concat_in_place.place(prepared.main, claimed, placements)
    placed = sorted(c.kernel.out_view for c in claimed if c.kernel.out_view)
    assert placed == [(0, 32), (0, 48), (16, 32), (16, 48), (32, 48), (40, 48)], placed
    main = _twin_matches_graph_and_onnxruntime(model, prepared, claimed, xs, precision, placements)
    assert "R.concat(" not in main.script() and main.script().count("call_tir_inplace") == 4


def test_attention_scores_and_their_softmax_are_one_kernel(nvrtc, tmp_path):
    """A BERT-style layer (fp16; 16 tokens, 2 heads of 32): Q K^T, its scale and casts, the softmax and its fp16 cast
    are one function of the graph's own operators (outlined; the P V product stays a CUTLASS GEMM), which on the host
    equals the graph bit for bit; its GPU schedule builds for sm_87 as one kernel with no local memory, the row max
    and sum as warp shuffles."""
    from gpu_kernels import bert_encoder, kernel_sass, sass_by_kernel

    from edgeq.backends.cuda import attention, squeeze_excite
    from edgeq.compile import HostRunner
    from edgeq.graph import Graph
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    relax = tvm.relax
    model = bert_encoder(tmp_path / "bert.onnx", seq=16, hidden=64, heads=2, layers=1)
    prepared, claimed, _ = _claimed_graph(model, "fp16", None, tmp_path)
    found = attention.find_attention_scores(prepared.main, claimed)
    assert len(found) == 1 and found[0].shape == (1, 2, 16, 16) and found[0].head_dim == 32
    gemms = [c for c in claimed if isinstance(c.kernel, cutlass.GemmKernel)]
    assert found[0].gemm is gemms[0] and len(gemms) == 2  # Q K^T replaced; P V stays
    outlined = squeeze_excite.outline(prepared.mod, found)
    fused = relax.transform.FuseTIR()(relax.transform.LegalizeOps()(outlined))
    run_graph, run_outlined = HostRunner(prepared), HostRunner(Graph(fused, prepared.weights))
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal((1, 16, 64)).astype(np.float32)
        np.testing.assert_array_equal(run_outlined([x])[0], run_graph([x])[0])
    name = found[0].function
    func = attention.schedule(fused[name]).with_attr("global_symbol", name)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    with nvrtc.active(), target:
        built = tvm.tirx.build(tvm.IRModule({name: func}), target=target)
    source = built.imports[0].inspect_source()
    # 8 rows a block, 16 lanes across the 16 keys
    assert set(re.findall(r"__global__ void __launch_bounds__\(128\) (\w+)\(", source)) == {f"{name}_kernel"}
    built.export_library(str(tmp_path / "attn.so"))
    code = kernel_sass(name, sass_by_kernel(tmp_path / "attn.so"))
    assert re.search(r"\bSHFL\.", code) and not re.search(r"\b(LDL|STL)\b", code)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_package_a_yolo_piece_with_its_concatenations_upsampling_and_output_in_place(precision, nvrtc, tmp_path):
    """``edgeq package --gpu-kernels cutlass`` of a small YOLOv8 backbone piece, neck and head: a strided conv, a C2f
    block (its first conv split in two, a bottleneck whose shortcut is added after its SiLU, the concatenation), a
    strided conv, SPPF (a conv, three chained 5x5 max pools, the concatenation, a conv), its output upsampled 2x
    (nearest) and concatenated with the C2f block's, a conv; per level (that conv's, SPPF's) a box and a class 1x1,
    concatenated, flattened and concatenated along the anchors as Ultralytics' exporter writes the output. The
    reference check passes (the CUDA module built, the same graph run on the host); the three concatenations are
    written in place, SPPF's pools by one kernel of edgeq's, the upsampled map by SPPF's last conv (a second output
    through its epilogue), the output by the head's 1x1s (channel-major, each its channels at its level's anchors);
    the kernels per inference are the 13 convolutions, the pools and the input's transpose (no concatenation, split,
    add, resize, transpose or quantize kernel); the placed kernels' SASS has HMMA (int8: IMMA) and no local memory;
    ``inspect`` says so. int8: the split halves, the bottleneck and the concatenations' readers share one scale per
    concatenation (quantize.shared_scales), so every part is written int8 into it."""

    from conftest import run_cli
    from gpu_kernels import Net, kernel_sass, sass_by_kernel

    net = Net(9)

    def conv(x, cin, cout, k=1, stride=1):
        y = net.conv_bn(x, cin, cout, k, stride)
        return net.node("Mul", [y, net.node("Sigmoid", [y])])

    x = conv("input", 8, 32, 3, 2)
    y = conv(x, 32, 32)  # C2f: split in two halves of 16, one bottleneck with its shortcut
    parts = [net.name("split"), net.name("split")]
    sizes = net.name("sizes")
    net.inits.append(numpy_helper.from_array(np.array([16, 16], np.int64), sizes))
    net.nodes.append(onnx.helper.make_node("Split", [y, sizes], parts, axis=1))
    parts.append(net.node("Add", [parts[1], conv(conv(parts[1], 16, 16, 3), 16, 16, 3)]))
    x = conv(net.node("Concat", parts, axis=1), 48, 32)
    pools = [conv(conv(x, 32, 32, 3, 2), 32, 16)]  # SPPF, at 6x5
    for _ in range(3):
        pools.append(net.node("MaxPool", [pools[-1]], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2]))
    out = conv(net.node("Concat", pools, axis=1), 64, 32)
    up = net.node("Resize", [out, "", net.const("scales", [1.0, 1.0, 2.0, 2.0])], mode="nearest")
    levels = [conv(net.node("Concat", [up, x], axis=1), 64, 32), out]  # the neck: back at 12x10; SPPF's at 6x5
    flat = net.name("flat")
    net.inits.append(numpy_helper.from_array(np.array([1, 24, -1], np.int64), flat))
    outs = []
    for level in levels:  # a detector head per level: box (16 channels) and class (8) 1x1s with biases, no activation
        box, cls = (net.node("Conv", [level, net.const("w", net.rng.standard_normal((k, 32, 1, 1)) / 6),
                                      net.const("b", net.rng.standard_normal(k) * 0.1)], kernel_shape=[1, 1])
                    for k in (16, 8))
        outs.append(net.node("Reshape", [net.node("Concat", [box, cls], axis=1), flat]))
    net.nodes.append(onnx.helper.make_node("Concat", outs, ["out"], axis=2))
    model = net.save(tmp_path / "c2f.onnx", 0, 0, input_shape=[1, 8, 24, 20], output=("out", [1, 24, 150]))
    extra = ()
    if precision == "int8":
        np.savez(tmp_path / "calib.npz", input=np.random.default_rng(3).standard_normal((4, 8, 24, 20)).astype(np.float32))
        extra = ("--calibrate", tmp_path / "calib.npz", "--calibration", "minmax")
    bundle, manifest = _package_for_orin(model, precision, tmp_path, *extra)
    gpu = manifest["library"]["gpu_kernels"]
    record = gpu["cutlass"]
    assert len(record["kernels"]) == 13 and record["left"] == [] and gpu["fallbacks"] == []
    if precision == "int8":  # every kernel writes int8 but the head's four (the model's float output)
        assert [k["output"] for k in record["kernels"]] == ["int8"] * 9 + ["float32"] * 4
        shared = {r["name"]: r.get("shared_scale_with") for r in manifest["quantization"]["layers"]}
        # C2f's: its bottleneck's first conv (reads the split's second half) and its last (reads the concatenation);
        # the neck's: its conv (reads the concatenation), the strided conv (reads its C2f part) and the second level's
        # head (reads SPPF's output, which the concatenation has upsampled); SPPF's concatenation has one reader, its
        # pools' input none of its own: nothing to share
        assert sorted(len(v) for v in shared.values() if v) == [1, 1, 3, 3, 3, 3], shared
    concats = record["concatenations_in_place"]
    assert [[(p["first"], p["channels"]) for p in c["parts"]] for c in concats] == [
        [(0, 32), (32, 16)], [(0, 16), (16, 16), (32, 16), (48, 16)], [(0, 32), (32, 32)]]
    assert [p.get("window") for p in concats[1]["parts"]] == [None, 5, 9, 13]
    pools = [f for f, rule in gpu["functions"].items() if rule == "edgeq concatenated pools"]
    assert len(pools) == 1 and gpu["launches"][pools[0]] == 1
    # the convolutions, the pools and the input's transpose: the output is the head's 1x1s' (no transpose, reshape or
    # concatenation kernel after them)
    assert gpu["kernels_per_inference"] == 13 + 1 + 1, gpu["launches"]
    assert not any("resize" in f or "concatenate" in f for f in gpu["launches"]), gpu["launches"]
    (output,) = record["detector_outputs"]
    assert (output["shape"], output["dtype"]) == ([1, 24, 150], "float32")
    assert [(p["channels"], p["anchors"]) for p in output["parts"]] == [
        ([0, 16], [0, 120]), ([16, 24], [0, 120]), ([0, 16], [120, 150]), ([16, 24], [120, 150])]
    heads = [k for k in record["kernels"] if "detector_output" in k["problem"]]
    assert [k["problem"]["detector_output"]["anchors"] for k in heads] == [[0, 120]] * 2 + [[120, 150]] * 2
    # the in-place calls are captured in the CUDA graph with the others (all but the input's kernel and those that
    # write the model's output, which leaves the graph: the head's)
    assert gpu["cuda_graph"] and gpu["cuda_graph_kernels"] >= gpu["kernels_per_inference"] - 1 - len(heads), gpu
    placed = [k for k in record["kernels"] if "output_channels" in k["problem"]]
    # the C2f block's first conv (allocates), its bottleneck (in place), its last conv (allocates the neck's, as the
    # second part), SPPF's first conv (allocates; its pools follow)
    assert len(placed) == 4 and sum(k["problem"]["output_channels"]["in_place"] for k in placed) == 1
    # SPPF's last conv: its output at 6x5 and, upsampled to 12x10, the first 32 channels of the neck's concatenation
    (upsampling,) = [k for k in record["kernels"] if "upsampled_2x_into_channels" in k["problem"]]
    assert upsampling["problem"]["upsampled_2x_into_channels"] == {"first": 0, "of": 64}
    assert upsampling["problem"]["output_pixels"] == 30 and upsampling["problem"]["k"] == 32
    assert concats[2]["parts"][0]["nearest_2x_of"] and "nearest_2x_of" not in concats[2]["parts"][1]
    placed += [upsampling, *heads]
    (bottleneck,) = [k for k in record["kernels"] if k["residual"]]  # (int8: the SiLU comes before it anyway)
    assert bottleneck["problem"]["residual_channels"] == {"first": 16, "of": 48}
    assert bottleneck.get("residual_after_activation", False) == (precision == "fp16")
    sass = sass_by_kernel(bundle / "model.so")
    mma = "HMMA" if precision == "fp16" else "IMMA"
    for k in placed:
        code = kernel_sass(k["function"], sass)
        assert re.search(rf"\b{mma}\.", code) and not re.search(r"\b(LDL|STL)\b", code), k["function"]
    inspect = run_cli("inspect", bundle)
    flat = " ".join(re.sub(r"[│┃]", " ", inspect.stdout).split())
    assert "3 concatenation(s) written in place by the kernels of their parts (no concatenation kernel; 1 with its " \
           "max pools in one kernel (edgeq's); 1 with an upsampled part its convolution writes); the detector's " \
           "output written by its head's 4 last convolutions (no transpose or concatenation kernel)" in flat, flat
