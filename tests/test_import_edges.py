"""Edges of the importer met by ONNX's node tests and real models: bool ReduceMax/ReduceMin (any/all), a
bfloat16 model edge refused in one line, and Gather built without TVM's warning about out-of-bounds indices."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import read_golden, run_cli
from edgeq.reference import onnxruntime_session


def _save(tmp_path, graph, opset):
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_bool_reduce_max_min_as_onnxruntime(tmp_path, op):
    x = np.array([[True, False, True], [False, False, False], [True, True, True], [False, True, False]])
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)], "r",
        [helper.make_tensor_value_info("x", TensorProto.BOOL, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, [4])],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")])
    path = _save(tmp_path, graph, 20)
    np.savez(tmp_path / "x.npz", x=x)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "--golden-input", tmp_path / "x.npz", "-q")
    assert res.code == 0, res.stderr
    want = onnxruntime_session(str(path)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(read_golden(tmp_path / "out" / "m-host")["output:y"], want)


def test_a_bfloat16_output_is_refused_in_one_line(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4])])
    res = run_cli("package", _save(tmp_path, graph, 19), "--device", "host", "-o", tmp_path / "out")
    assert res.code == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("edgeq: error: output 'y' is bfloat16") and "Cast to float32" in lines[-1]
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_a_bfloat16_const_from_a_npy_of_raw_bytes_is_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "s32"], ["y"])], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]), helper.make_tensor_value_info("s", TensorProto.BFLOAT16, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    path = _save(tmp_path, graph, 19)
    np.save(tmp_path / "raw.npy", np.zeros((), "V2"))
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "--const", f"s={tmp_path / 'raw.npy'}")
    assert res.code == 2 and "save it as float32" in res.stderr, res.stderr
    np.save(tmp_path / "s.npy", np.array(1.5, np.float32))  # exact in bfloat16: converted
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "--const", f"s={tmp_path / 's.npy'}", "-q")
    assert res.code == 0, res.stderr
    golden = read_golden(tmp_path / "out" / "m-host")
    np.testing.assert_array_equal(golden["output:y"], golden["input:x"] + np.float32(1.5))


@pytest.mark.parametrize("device", ["host", "jetson-orin-nano"])
def test_gather_builds_without_tvm_warnings(tmp_path, device, capfd):
    """An embedding lookup (BERT's first op): TVM printed "Fast mode segfaults when there are out-of-bounds
    indices" for each one, although edgeq clamps the indices; nothing of TVM's reaches a -q run."""
    emb = numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "emb")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["y"], axis=0)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])], [emb])
    path = _save(tmp_path, graph, 17)
    capfd.readouterr()
    res = run_cli("package", path, "--device", device, "-o", tmp_path / "out", "-q")
    native = capfd.readouterr()
    assert res.code == 0, res.stderr
    assert "Warning" not in native.err + res.stderr and "segfault" not in native.err + res.stderr, native.err
    ids = np.array([[0, 49, 3, 7, 7, 12]], np.int64)
    if device == "host":
        np.savez(tmp_path / "ids.npz", ids=ids)
        res = run_cli("package", path, "--device", device, "-o", tmp_path / "out2", "-q", "--golden-input", tmp_path / "ids.npz")
        assert res.code == 0, res.stderr
        np.testing.assert_array_equal(read_golden(tmp_path / "out2" / "m-host")["output:y"], numpy_helper.to_array(emb)[ids])


def test_a_declared_output_shape_the_graph_contradicts_warns_and_packages(tmp_path):
    """ddddocr 1.6.1's common.onnx declares [1, seqlen] for what its graph computes as [T, 1, 8210]; ONNX Runtime
    warns and runs. edgeq does too: one warning line, the graph's shape, checked against ONNX Runtime."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "stale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seqlen"])],  # the graph makes [w/2, 1, 2]
        [numpy_helper.from_array(np.array([-1, 1, 2], np.int64), "s")])
    path = _save(tmp_path, graph, 13)
    res = run_cli("package", path, "--device", "host", "--input-shape", "x=1x8", "-o", tmp_path / "out", "-q")
    assert res.code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("edgeq: warning:")]
    assert len(warnings) == 1 and "contradicts the graph" in warnings[0] and "output(s) y" in warnings[0], res.stderr
    golden = read_golden(tmp_path / "out" / "m-host")
    x = golden["input:x"]
    want = onnxruntime_session(str(path)).run(None, {"x": x})[0]
    assert golden["output:y"].shape == want.shape == (4, 1, 2)
    np.testing.assert_array_equal(golden["output:y"], want)


def test_an_opset_import_no_node_uses_is_dropped_one_a_node_uses_is_named(tmp_path):
    """ONNX Runtime's quantizer lists every domain it knows (ddddocr's common_old.onnx: com.microsoft.nchwc,
    com.microsoft.mlfeaturizers, ...) whether or not a node uses it: such a model packages. A node of an unknown
    domain is refused, naming the domain and its ops."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "r",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    imports = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft.nchwc", 1),
               helper.make_opsetid("com.microsoft.mlfeaturizers", 1)]
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=imports), path)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q")
    assert res.code == 0, res.stderr
    nchwc = helper.make_graph([helper.make_node("ReorderInput", ["x"], ["y"], domain="com.microsoft.nchwc")], "n",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 2, 2])])
    onnx.save(helper.make_model(nchwc, opset_imports=imports), path)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out2", "-q")
    lines = res.stderr.strip().splitlines()
    assert res.code != 0 and len(lines) == 1, res.stderr
    assert "'com.microsoft.nchwc' (ReorderInput)" in lines[0] and "ORT_ENABLE_EXTENDED" in lines[0]


def test_a_model_onnx_runtime_saved_in_its_nchwc_layout_is_refused_naming_it(models, tmp_path):
    """ONNX Runtime's optimizer (ORT_ENABLE_ALL, x86 with AVX2 or AVX-512) saves a CNN with its NCHWc ops: blocked
    weights whose block size (8 or 16) is the saving machine's and is written nowhere in the file (ONNX Runtime
    itself warns that such a file belongs to the machine that made it). edgeq refuses it in one line, naming the
    ops and how to save the model before that layout."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(models["mobilenet_cnn"]), options, providers=["CPUExecutionProvider"])
    saved = onnx.load(tmp_path / "optimized.onnx")
    if not any(n.domain == "com.microsoft.nchwc" for n in saved.graph.node):
        pytest.skip("this CPU has no NCHWc kernels in ONNX Runtime (no AVX2)")
    res = run_cli("package", tmp_path / "optimized.onnx", "--device", "host", "-o", tmp_path / "out", "-q")
    lines = res.stderr.strip().splitlines()
    assert res.code != 0 and len(lines) == 1, res.stderr
    assert "'com.microsoft.nchwc' (Conv," in lines[0] and "ORT_ENABLE_EXTENDED" in lines[0], lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
