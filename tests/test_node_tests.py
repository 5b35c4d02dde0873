"""A fixed subset of ONNX's backend node tests through benchmarks/node_tests.py (the same code as the full
run): each is packaged for host, run by its bundle's run.py and compared with ONNX's expected outputs.
The subset covers edgeq's own converters, the fixed importer crashes (If, RMSNormalization, LayerNormalization's
optional outputs), 0-d inputs (Clip, QuantizeLinear, DequantizeLinear) and operands bound with --const."""

from __future__ import annotations


import pytest

import node_tests  # benchmarks/ (pyproject: pythonpath)

PASS = ["If", "Constant", "Clip", "QuantizeLinear", "DequantizeLinear", "LayerNormalization", "RMSNormalization",
        "Swish", "Celu", "LpNormalization", "CumProd", "HannWindow", "Det", "Col2Im", "Shape", "Reshape", "TopK",
        "Upsample", "SwiGLU", "Attention", "LSTM", "RotaryEmbedding", "QLinearConv", "Mish", "NonMaxSuppression"]
# refused in one line (an edgeq error), never an internal error
REFUSED = ["Loop"]


@pytest.fixture(scope="module")
def results():
    tests = node_tests.node_tests(set(PASS + REFUSED))
    assert {t.op for t in tests} == set(PASS + REFUSED)
    found = node_tests.run_all(tests, ["edgeq"], jobs=2, timeout=300)  # generous: a loaded machine
    return {t.op: found[t.name]["edgeq"] for t in tests}


@pytest.mark.parametrize("op", PASS)
def test_passes(results, op):
    assert results[op].cls == "pass", results[op].message


@pytest.mark.parametrize("op", REFUSED)
def test_refused_in_one_line(results, op):
    result = results[op]
    assert result.cls == "refused", result.message
    assert op in result.message and "\n" not in result.message


def test_shape_operands_are_bound():
    """Reshape's shape and TopK's k are bound as constants; Clip's 0-d bounds and Gather's indices stay inputs."""
    tests = {t.op: t for t in node_tests.node_tests({"Reshape", "TopK", "Clip", "Gather"})}
    assert set(node_tests.bound_inputs(tests["Reshape"])) == {"shape"}
    assert set(node_tests.bound_inputs(tests["TopK"])) == {"k"}
    assert node_tests.bound_inputs(tests["Clip"]) == {}
    assert node_tests.bound_inputs(tests["Gather"]) == {}


def test_compare_is_onnx_backend_compare():
    import numpy as np

    want = [np.array([1.0, np.nan], np.float32)]
    assert node_tests.compare(want, [np.array([1.0005, np.nan], np.float32)], 1e-3, 1e-7) is None
    assert "differs" in node_tests.compare(want, [np.array([1.01, np.nan], np.float32)], 1e-3, 1e-7)
    assert "float64" in node_tests.compare(want, [np.array([1.0, np.nan])], 1e-3, 1e-7)
    assert "shape" in node_tests.compare(want, [np.array([1.0], np.float32)], 1e-3, 1e-7)
