"""Pre-quantized ONNX models (QDQ, made by ONNX Runtime's quantize_static) compile to integer kernels and
agree with ONNX Runtime running the same model."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from common import bundle_model
from conftest import ort_quantize, predict_with_loader, run_cli
from edgeq.graph import Graph, call_op
from edgeq.load import load_model
from edgeq.quantize import lower_prequantized
from edgeq.quantize.commute_qdq import commute_qdq
from edgeq.quantize.lower_qdq import lower_qdq
from edgeq.relax_import import to_relax
from edgeq.tvm_env import import_tvm

tvm = import_tvm()
from tvm.script import ir as I  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from edgeq.reference import onnxruntime_session

CASES = [(family, act) for family in ("resnet_cnn", "mobilenet_cnn") for act in ("u8", "s8")]


@pytest.fixture(scope="module")
def qdq_models(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("qdq")
    return {(f, a): ort_quantize(models[f], root / f"{f}_{a}.onnx", activations=a) for f, a in CASES}


def output_step(model_path: Path) -> float:
    """The quantization step of the model output: the scale of the DequantizeLinear that produces it."""
    model = onnx.load(model_path)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = model.graph.output[0].name
    node = next(n for n in model.graph.node if out in n.output)
    assert node.op_type == "DequantizeLinear"
    return float(inits[node.input[1]])


@pytest.mark.parametrize("family,act", CASES)
def test_qdq_bundle_agrees_with_onnxruntime_within_one_step(family, act, qdq_models, tmp_path):
    model = qdq_models[(family, act)]
    res = run_cli("package", model, "--device", "host", "-o", tmp_path, "--json", "-q")
    assert res.code == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["precision"] == "int8"
    data = tmp_path / "x.npz"
    x = np.random.default_rng(11).standard_normal((24, 3, 32, 32)).astype(np.float32)
    np.savez(data, input=x)
    got = predict_with_loader(Path(result["bundle_dir"]), data, tmp_path / "got.npy")
    session = onnxruntime_session(str(model))
    want = np.concatenate([session.run(None, {"input": x[i : i + 1]})[0] for i in range(len(x))])
    step = output_step(model)
    within = np.abs(got - want) <= step * 1.001
    assert within.mean() >= 0.99, (within.mean(), np.abs(got - want).max(), step)
    m = json.loads(Path(result["bundle_dir"], "manifest.json").read_text())
    report = m["quantization"]
    assert report["source"].startswith("pre-quantized") and report["precision_counts"]["fp32"] == 0
    assert {row["activation_dtype"] for row in report["layers"]} == {"uint8" if act == "u8" else "int8"}


@pytest.mark.parametrize("family,act", CASES)
def test_qdq_ir_has_integer_conv_and_matmul(family, act, qdq_models):
    loaded = load_model(qdq_models[(family, act)])
    graph, _ = to_relax(loaded)
    result = lower_prequantized(graph, loaded)
    weighted = [b.value for b in result.graph.bindings() if call_op(b.value) in ("relax.nn.conv2d", "relax.matmul")]
    assert len(weighted) == len(result.layers) >= 7
    for call in weighted:
        assert str(call.args[0].ty.dtype) == ("uint8" if act == "u8" else "int8")
        assert str(call.args[1].ty.dtype) == "int8" and str(call.ty.dtype) == "int32"
    assert not any(call_op(b.value) == "relax.dequantize" and str(b.value.args[0].ty.dtype) == "int8"
                   and b.value.args[0] in result.graph.weight_params for b in result.graph.bindings())


def test_qoperator_models_are_refused_naming_the_op(models, tmp_path):
    model = ort_quantize(models["resnet_cnn"], tmp_path / "qop.onnx", fmt="QOperator")
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out")
    assert res.code == 3
    assert "QOperator format (" in res.stderr and "QLinearConv" in res.stderr and "quant_format=QuantFormat.QDQ" in res.stderr
    assert not (tmp_path / "out").exists()


def test_qdq_model_rejects_calibration_options(models, tmp_path):
    model = ort_quantize(models["mobilenet_cnn"], tmp_path / "m.onnx")
    calib = tmp_path / "c.npz"
    np.savez(calib, input=np.zeros((16, 3, 32, 32), np.float32))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--precision", "int8", "--calibrate", calib)
    assert res.code == 2 and "already quantized" in res.stderr


def test_lower_qdq_conv_with_uint8_zero_point():
    w = np.array([[1, -2], [3, 4]], np.int8).reshape(2, 2, 1, 1)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "uint8"), w_q: R.Tensor((2, 2, 1, 1), "int8"),
                 s_x: R.Tensor((), "float32"), z_x: R.Tensor((), "uint8"),
                 s_w: R.Tensor((2,), "float32"), z_w: R.Tensor((2,), "int8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                xd = R.dequantize(x, s_x, z_x, axis=1, out_dtype="float32")
                wd = R.dequantize(w_q, s_w, z_w, axis=0, out_dtype="float32")
                y = R.nn.conv2d(xd, wd)
                R.output(y)
            return y

    correction = np.array([-10 * (1 - 2), -10 * (3 + 4)], np.int32).reshape(1, 2, 1, 1)
    scale = np.array([0.5 * 0.25, 0.5 * 0.125], np.float32)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "uint8"), w_q: R.Tensor((2, 2, 1, 1), "int8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                acc = R.nn.conv2d(x, w_q, out_dtype="int32")
                acc2 = R.add(acc, R.const(correction, "int32"))
                y = R.dequantize(acc2, R.const(scale, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                R.output(y)
            return y

    weights = {"w_q": w, "s_x": np.array(0.5, np.float32), "z_x": np.array(10, np.uint8),
               "s_w": np.array([0.25, 0.125], np.float32), "z_w": np.zeros(2, np.int8)}
    out, layers = lower_qdq(Graph(Before, weights))
    tvm.ir.assert_structural_equal(out.mod, Expected)
    assert layers[0].integer and layers[0].activation_zero_point == 10


def test_commute_qdq_keeps_maxpool_and_reshape_quantized():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "uint8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                d = R.dequantize(x, R.const(0.5, "float32"), R.const(3, "uint8"), axis=1, out_dtype="float32")
                p = R.nn.max_pool2d(d, pool_size=[2, 2], strides=[2, 2])
                q = R.quantize(p, R.const(0.5, "float32"), R.const(3, "uint8"), axis=1, out_dtype="uint8")
                R.output(q)
            return q

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "uint8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                q = R.nn.max_pool2d(x, pool_size=[2, 2], strides=[2, 2])
                R.output(q)
            return q

    tvm.ir.assert_structural_equal(commute_qdq(Graph(Before, {})).mod, Expected)


@pytest.mark.parametrize("family", ["resnet_cnn", "mobilenet_cnn"])
def test_qoperator_models_package_and_match_onnxruntime(models, family, tmp_path):
    """ONNX Runtime's QOperator quantization of the convolutions and the classifier (QLinearConv, QGemm, with
    QuantizeLinear/DequantizeLinear between them) packages without options and gives ONNX Runtime's outputs
    bit for bit: the integer operators are computed exactly, in int32, as ONNX Runtime computes them."""
    model = ort_quantize(models[family], tmp_path / "qop.onnx", fmt="QOperator", op_types=["Conv", "Gemm"])
    ops = {n.op_type for n in onnx.load(model).graph.node}
    assert {"QLinearConv", "QGemm"} <= ops, ops
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "-q")
    assert res.code == 0, res.stderr
    session = onnxruntime_session(str(model))
    spec = session.get_inputs()[0]
    x = np.random.default_rng(3).standard_normal([4, *spec.shape[1:]]).astype(np.float32)
    np.savez(tmp_path / "x.npz", input=x)
    ours = predict_with_loader(tmp_path / "out" / "qop-host", tmp_path / "x.npz", tmp_path / "ours.npy")
    theirs = np.concatenate([session.run(None, {spec.name: x[i:i + 1]})[0] for i in range(len(x))])
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("quantized_output", [True, False])
def test_qgemm_is_onnxruntimes(quantized_output, tmp_path):
    """com.microsoft QGemm with transposed operands, a per-column weight scale and zero point, an int32 bias,
    alpha, and a float or a requantized output: ONNX Runtime's values exactly."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(4)
    b = rng.integers(-128, 128, (6, 20)).astype(np.int8)  # transB: [N, K]
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "as"), numpy_helper.from_array(np.array(3, np.uint8), "az"),
             numpy_helper.from_array(b, "b"), numpy_helper.from_array((rng.random(6) * 0.01 + 0.005).astype(np.float32), "bs"),
             numpy_helper.from_array(rng.integers(-3, 4, 6).astype(np.int8), "bz"),
             numpy_helper.from_array(rng.integers(-500, 500, 6).astype(np.int32), "c"),
             numpy_helper.from_array(np.array(0.05, np.float32), "ys"), numpy_helper.from_array(np.array(128, np.uint8), "yz")]
    tail = ["ys", "yz"] if quantized_output else []
    nodes = [helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
             helper.make_node("QGemm", ["xq", "as", "az", "b", "bs", "bz", "c", *tail], ["y"], domain="com.microsoft",
                              alpha=0.75, transA=1, transB=1)]
    out_type = TensorProto.UINT8 if quantized_output else TensorProto.FLOAT
    graph = helper.make_graph(nodes, "qgemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [20, 3])],
                              [helper.make_tensor_value_info("y", out_type, [3, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, tmp_path / "qgemm.onnx")
    res = run_cli("package", tmp_path / "qgemm.onnx", "--device", "host", "-o", tmp_path / "out", "-q")
    assert res.code == 0, res.stderr
    session = onnxruntime_session(str(tmp_path / "qgemm.onnx"))
    model = bundle_model(tmp_path / "out" / "qgemm-host")
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((20, 3)).astype(np.float32) * 3
        np.testing.assert_array_equal(model.run({"x": x})["y"], session.run(None, {"x": x})[0])
