"""A model's own QuantizeLinear and DynamicQuantizeLinear follow ONNX's definition bit for bit: round(x / scale),
half to even, as ONNX Runtime computes them, also where x / scale is exactly a tie (a multiply by the
reciprocal lands a last bit off there and rounds the other way)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import read_golden, run_cli
from edgeq.reference import onnxruntime_session

SCALE = np.float32(5) / np.float32(255)  # the scale of ONNX's DynamicQuantizeLinear node test (range 5)


def ties(scale: np.float32, count: int = 64) -> np.ndarray:
    """Floats x where x / scale is exactly k + 0.5 in float32 and x times the float32 reciprocal is not (the
    inputs that tell a division from a reciprocal multiply)."""
    found = []
    reciprocal = np.float32(1) / scale
    for k in range(-128, 127):  # inside uint8 with zero point 128: no tie is saturated away
        x = np.float32(np.float32(k + 0.5) * scale)
        if x / scale == np.float32(k + 0.5) and x * reciprocal != np.float32(k + 0.5):
            found.append(x)
    assert len(found) >= 8, "no ties that tell division from multiplication at this scale"
    return np.array(found[:count], np.float32)


def _package(tmp_path, model, x):
    path, golden = tmp_path / "m.onnx", tmp_path / "x.npz"
    onnx.save(model, path)
    np.savez(golden, x=x)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "--golden-input", golden, "-q")
    assert res.code == 0, res.stderr
    return read_golden(tmp_path / "out" / "m-host"), onnxruntime_session(str(path))


def test_quantizelinear_ties_as_onnxruntime(tmp_path):
    x = ties(SCALE)
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, list(x.shape))],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [float(SCALE)]), helper.make_tensor("z", TensorProto.UINT8, [], [128])])
    golden, session = _package(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), x)
    want = session.run(None, {"x": x})[0]
    np.testing.assert_array_equal(golden["output:y"], want)


@pytest.mark.parametrize("extra", [[], [2.0, -3.0, 1.34, 0.5]])
def test_dynamicquantizelinear_ties_as_onnxruntime(tmp_path, extra):
    """The node test's input (0, 2, -3, -2.5, 1.34, 0.5: its range makes the scale 5 / 255, and -2.5 is a
    tie), with more ties at that scale."""
    base = np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32)
    scale = np.float32((np.float32(2) - np.float32(-3)) / np.float32(255))
    x = np.concatenate([base, np.clip(ties(scale), -3, 2), np.array(extra, np.float32)]).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "y_scale", "y_zero_point"])], "dql",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, list(x.shape)),
         helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("y_zero_point", TensorProto.UINT8, [])])
    golden, session = _package(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), x)
    want = dict(zip(["y", "y_scale", "y_zero_point"], session.run(None, {"x": x})))
    for name, value in want.items():
        np.testing.assert_array_equal(golden[f"output:{name}"], value, err_msg=name)
