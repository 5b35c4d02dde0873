"""Shape arithmetic folded before import (edgeq.fold) and graph inputs bound with --const.

The models are the patterns exporters write (torch.onnx's Shape -> Gather -> Div -> Concat -> Reshape of
Swin's window partition, ShuffleNet's channel split through Shape -> Slice); each bundle is checked against
ONNX Runtime on the original model."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_golden, run_cli, run_py
from edgeq.load import load_model
from test_bad_input import assert_refused
from edgeq.reference import onnxruntime_session


def i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def window_model() -> onnx.ModelProto:
    """x (1, 8, 8, 4) -> windows of 4x4 via shape arithmetic (Swin's window_partition as torch exports it),
    a 0-d Constant in the arithmetic, then Relu."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["h"], axis=0),           # 0-d index -> 0-d value
        helper.make_node("Constant", [], ["four"], value=numpy_helper.from_array(np.array(4, np.int64))),
        helper.make_node("Div", ["h", "four"], ["hw"]),
        helper.make_node("Unsqueeze", ["hw", "zero"], ["hw1"]),
        helper.make_node("Concat", ["minus1", "hw1", "four1", "hw1", "four1", "c"], ["shape6"], axis=0),
        helper.make_node("Reshape", ["x", "shape6"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 1, 3, 2, 4, 5]),
        helper.make_node("Reshape", ["t", "flat"], ["w"]),
        helper.make_node("Relu", ["w"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(1, np.int64), "one"), i64("zero", [0]), i64("minus1", [-1]),
             i64("four1", [4]), i64("c", [4]), i64("flat", [-1, 16, 4])]
    graph = helper.make_graph(nodes, "window", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1", "d2"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def split_model() -> onnx.ModelProto:
    """ShuffleNet's channel split: half = Shape(x)[1] / 2 through Slice, then Split with computed sizes."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "one", "two"], ["ch"]),
        helper.make_node("Div", ["ch", "two"], ["half"]),
        helper.make_node("Concat", ["half", "half"], ["sizes"], axis=0),
        helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1),
        helper.make_node("Sigmoid", ["b"], ["sb"]),
        helper.make_node("Concat", ["sb", "a"], ["y"], axis=1),
    ]
    inits = [i64("one", [1]), i64("two", [2])]
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 5, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reshape_input_model() -> onnx.ModelProto:
    """Reshape's shape is a graph input (as ONNX's node tests feed it)."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
                                                 helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def ort_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime_session(model.SerializeToString())
    return session.run(None, feeds)


@pytest.mark.parametrize("make", [window_model, split_model], ids=["window", "split"])
def test_shape_arithmetic_folds_and_matches_ort(tmp_path, make):
    model = make()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    loaded = load_model(path)
    ops = [n.op_type for n in loaded.onnx_model.graph.node]
    assert not {"Shape", "Gather", "Div", "Constant"} & set(ops), ops  # folded to initializers
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--runtime", "none")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "m-host"
    golden = read_golden(bundle)
    expected = ort_outputs(model, {"x": golden["input:x"]})[0]
    np.testing.assert_allclose(golden["output:y"], expected, rtol=1e-6, atol=1e-6)
    assert run_py(bundle, "--self-test").returncode == 0


def test_const_binds_a_shape_input(tmp_path):
    model = reshape_input_model()
    path = tmp_path / "reshape.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "shape.npy", np.array([4, 6], np.int32))  # int32 values that fit int64 are accepted
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--runtime", "none",
                  "--const", f"shape={tmp_path / 'shape.npy'}")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "reshape-host"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [i["name"] for i in manifest["inputs"]] == ["x"]
    assert manifest["build"]["args"]["consts"] == {"shape": str(tmp_path / "shape.npy")}
    golden = read_golden(bundle)
    expected = ort_outputs(model, {"x": golden["input:x"], "shape": np.array([4, 6], np.int64)})[0]
    np.testing.assert_array_equal(golden["output:y"], expected)


def test_const_scalar_input_stays_0d(tmp_path):
    """A 0-d graph input bound to a 0-d value (Clip's max): the model computes with a scalar."""
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5]),
                                              helper.make_tensor_value_info("lo", TensorProto.FLOAT, []),
                                              helper.make_tensor_value_info("hi", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "clip.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "lo.npy", np.array(-0.5, np.float32))
    np.save(tmp_path / "hi.npy", np.array(0.25, np.float32))
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--runtime", "none",
                  "--const", f"lo={tmp_path / 'lo.npy'}", "--const", f"hi={tmp_path / 'hi.npy'}")
    assert res.code == 0, res.stderr
    golden = read_golden(tmp_path / "out" / "clip-host")
    np.testing.assert_array_equal(golden["output:y"], np.clip(golden["input:x"], -0.5, 0.25))


@pytest.mark.parametrize("value, fragments", [
    (np.array([4.5, 6.0]), ("--const shape", "float64", "int64")),
    (np.array([4, 6, 1], np.int64), ("--const shape", "shape 3", "does not fit")),
    (None, ("--const shape=", "file not found")),
    ("pickle", ("--const shape=", "not a readable .npy")),
])
def test_const_refusals(tmp_path, value, fragments):
    path = tmp_path / "reshape.onnx"
    onnx.save(reshape_input_model(), path)
    npy = tmp_path / "shape.npy"
    if isinstance(value, np.ndarray):
        np.save(npy, value)
    elif value == "pickle":
        np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    out = tmp_path / "out"
    assert_refused(run_cli("package", path, "--device", "host", "-o", out, "-q", "--const", f"shape={npy}"), 2, *fragments)
    assert not out.exists()


def test_const_unknown_name_and_syntax(tmp_path):
    path = tmp_path / "reshape.onnx"
    onnx.save(reshape_input_model(), path)
    np.save(tmp_path / "v.npy", np.array([4, 6]))
    assert_refused(run_cli("package", path, "--device", "host", "-o", tmp_path / "o", "-q", "--const",
                           f"nope={tmp_path / 'v.npy'}"), 2, "--const names 'nope'", "x, shape")
    assert_refused(run_cli("package", path, "--device", "host", "-o", tmp_path / "o", "-q", "--const", "shape"),
                   2, "not NAME=FILE.npy")


def test_fold_never_evaluates_a_bomb(tmp_path):
    """ConstantOfShape of a constant 1e12-element shape stays in the graph (never evaluated by the folder);
    the model is then refused by the activation-size limit, not by running out of memory."""
    nodes = [helper.make_node("ConstantOfShape", ["big"], ["z"]), helper.make_node("Add", ["x", "z"], ["y"])]
    graph = helper.make_graph(nodes, "bomb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1"])], [i64("big", [1_000_000, 1_000_000])])
    path = tmp_path / "bomb.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    loaded = load_model(path)
    assert "ConstantOfShape" in [n.op_type for n in loaded.onnx_model.graph.node]
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q")
    assert_refused(res, 3, "more than the limit")


def test_initializer_names_that_are_not_identifiers_build_for_cuda(tmp_path):
    """torch.onnx names folded constants '/block/Constant_output_0', TensorFlow 'conv1/weights:0'; as kernel
    parameter names they stopped NVRTC ('expected a )') in ConvNeXt's and MaxViT's Orin builds."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "conv1/weights:0"),
             numpy_helper.from_array(np.array(0.5, np.float32), "/block/Constant_output_0"),
             numpy_helper.from_array(np.zeros(4, np.float32), "input_conv1.bias")]
    nodes = [helper.make_node("Conv", ["x", "conv1/weights:0", "input_conv1.bias"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "/block/Constant_output_0"], ["m"]),
             helper.make_node("Erf", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "names", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "names.onnx"
    onnx.save(model, path)
    loaded = load_model(path)
    names = [t.name for t in loaded.onnx_model.graph.initializer]
    assert all(n.replace(".", "_").isidentifier() for n in names), names
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "host", "-q", "--runtime", "none")
    assert res.code == 0, res.stderr
    golden = read_golden(tmp_path / "host" / "names-host")
    np.testing.assert_allclose(golden["output:y"], ort_outputs(model, {"x": golden["input:x"]})[0], rtol=1e-5, atol=1e-6)
    res = run_cli("package", path, "--device", "jetson-orin-nano", "-o", tmp_path / "orin", "-q", "--runtime", "none")
    assert res.code == 0, res.stderr


def test_fold_keeps_inputs_in_place_around_an_absent_optional_one():
    """Clip(c, '', hi) on constants: the max must reach Clip's third input, not its absent second."""
    import tempfile
    from pathlib import Path

    nodes = [helper.make_node("Clip", ["c", "", "hi"], ["clipped"]), helper.make_node("Add", ["x", "clipped"], ["y"])]
    inits = [numpy_helper.from_array(np.array([-3.0, 0.5, 3.0], np.float32), "c"),
             numpy_helper.from_array(np.array(1.0, np.float32), "hi")]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.onnx"
        onnx.save(model, path)
        folded = load_model(path).onnx_model
    assert [n.op_type for n in folded.graph.node] == ["Add"]
    values = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}
    np.testing.assert_array_equal(values["clipped"], [-3.0, 0.5, 1.0])
