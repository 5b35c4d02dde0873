"""INT8 that would silently compute garbage: vanishing activations (int32 bias overflow) and collapse.

Seen on torchvision's GoogLeNet with its own random init: activations shrink ~10x per layer, the last
layer's activation scale is ~1e-13, and round(bias / scale) wrapped around int32 (output cosine -0.07
against fp32, bundle written without an error)."""

import json

import numpy as np
import onnx
from onnx import helper

from conftest import read_golden, run_cli
from make_models import GraphBuilder, _io
from test_bad_input import assert_refused
from edgeq.reference import onnxruntime_session


def vanishing_model() -> onnx.ModelProto:
    """Convs with 1e-3-scaled weights (activations shrink ~100x per layer), then an FC with an O(1) bias."""
    g = GraphBuilder(seed=5)
    x = "input"
    for cin, cout in ((3, 8), (8, 8), (8, 8), (8, 8)):
        w = g.const("w", (g.rng.standard_normal((cout, cin, 3, 3)) * 1e-3).astype(np.float32))
        b = g.const("b", np.zeros(cout, np.float32))
        x = g.op("Relu", [g.op("Conv", [x, w, b], "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "gap")], "flatten", axis=1)
    w = g.const("fc_w", (g.rng.standard_normal((10, 8)) * 0.3).astype(np.float32))
    b = g.const("fc_b", g.rng.uniform(-0.5, 0.5, 10).astype(np.float32))
    g.nodes.append(helper.make_node("Gemm", [x, w, b], ["logits"], name="fc", transB=1))
    return g.model("vanishing", [_io("input", (1, 3, 16, 16))], [_io("logits", (1, 10))])


def difference_model() -> onnx.ModelProto:
    """y = conv(x, W) - conv(x, W + 1e-4 D): the output is tiny next to what each conv computes, so the
    int8 error of the two convs swamps it (a model int8 cannot represent)."""
    g = GraphBuilder(seed=6)
    w = (g.rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    d = g.rng.standard_normal(w.shape).astype(np.float32)
    a = g.op("Conv", ["input", g.const("wa", w)], "conv", kernel_shape=[3, 3])
    b = g.op("Conv", ["input", g.const("wb", w + 1e-4 * d)], "conv", kernel_shape=[3, 3])
    g.nodes.append(helper.make_node("Sub", [a, b], ["y"], name="sub"))
    return g.model("difference", [_io("input", (1, 3, 10, 10))], [_io("y", (1, 8, 8, 8))])


def calib(tmp_path, shape, n=16):
    path = tmp_path / "calib.npz"
    np.savez(path, input=np.random.default_rng(3).standard_normal((n, *shape)).astype(np.float32))
    return path


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_vanishing_activations_keep_the_bias_in_float(tmp_path):
    model = vanishing_model()
    path = tmp_path / "vanishing.onnx"
    onnx.save(model, path)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "--runtime", "none",
                  "--precision", "int8", "--calibrate", calib(tmp_path, (3, 16, 16)), "--calibration", "minmax")
    assert res.code == 0, res.stderr
    assert "too large for int32" in res.stderr
    bundle = tmp_path / "out" / "vanishing-host"
    report = json.loads((bundle / "manifest.json").read_text())["quantization"]
    assert report["float_biases"], report["float_biases"]
    assert report["precision_counts"]["int8"] == 5  # every layer stays integer; only a bias add is float
    scales = [row["activation_scale"] for row in report["layers"]]
    assert all(np.isfinite(s) and s > 0 for s in scales) and min(scales) < 1e-9, scales
    golden = read_golden(bundle)
    session = onnxruntime_session(model.SerializeToString())
    expected = session.run(None, {"input": golden["input:input"]})[0]
    assert cosine(golden["output:logits"], expected) > 0.999


def test_collapsed_int8_model_is_refused(tmp_path):
    path = tmp_path / "difference.onnx"
    onnx.save(difference_model(), path)
    out = tmp_path / "out"
    res = run_cli("package", path, "--device", "host", "-o", out, "-q", "--runtime", "none",
                  "--precision", "int8", "--calibrate", calib(tmp_path, (3, 10, 10)))
    assert_refused(res, 3, "int8 model collapses", "cosine", "--skip")
    assert not out.exists()
