"""Bias correction (``--bias-correction on``, the default): the mean shift int8 rounding and clipping add to each
layer's output, measured on the calibration data, comes back out in its int32 bias.

Judged on held-out data against the float graph, and against ``--bias-correction off`` on the same model,
which must keep a clearly larger mean shift; the exported QDQ model carries the corrected biases, and ONNX
Runtime running it agrees with the bundle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import predict_with_loader, run_cli
from edgeq.compile import HostRunner
from edgeq.graph import call_op
from edgeq.load import load_model
from edgeq.quantize import QuantizeArgs, quantize
from edgeq.relax_import import to_relax
from edgeq.reference import onnxruntime_session


def _model(path: Path) -> Path:
    """A PP-LCNet-like front: 1x1 expansion, HardSwish (its output lopsided: -0.375 to large), a 1x1 projection
    with a bias, then a MatMul head over the pooled channels (a Gemm-less classifier, as some exporters write)."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((24, 8, 1, 1)).astype(np.float32), "expand"),
             numpy_helper.from_array((rng.standard_normal((16, 24, 1, 1)) / 5).astype(np.float32), "project"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "project_b"),
             numpy_helper.from_array((rng.standard_normal((16, 10)) / 4).astype(np.float32), "head")]
    nodes = [helper.make_node("Conv", ["input", "expand"], ["e"], name="expand"),
             helper.make_node("HardSwish", ["e"], ["a"]),
             helper.make_node("Conv", ["a", "project", "project_b"], ["p"], name="project", pads=[0, 0, 0, 0]),
             helper.make_node("Relu", ["p"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("MatMul", ["f", "head"], ["output"], name="head")]
    graph = helper.make_graph(nodes, "lopsided", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    path.write_bytes(model.SerializeToString())
    return path


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8, 12, 12)).astype(np.float32)


def _taps(model: Path, calib: Path, held: np.ndarray, correct: bool):
    """The float and int8 outputs of the projection (its output, before the ReLU) and of the model, on ``held``."""
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    result = quantize(graph, loaded, QuantizeArgs(calibrate=calib, bias_correction=correct))
    from edgeq.quantize import _plans
    from edgeq.quantize.quantize_ops import quantize_ops

    scales = {l.weight: float(result.scales[f"{l.name}/activation_scale"]) for l in result.layers}
    names = [l.weight for l in result.layers]
    ref = HostRunner(quantize_ops(graph, {}, taps=names))
    got = HostRunner(quantize_ops(graph, _plans(result.layers, scales, result.corrections), taps=names))
    f = [ref([x[None]]) for x in held]
    q = [got([x[None]]) for x in held]
    return f, q, result


def test_bias_correction_takes_the_mean_shift_out(tmp_path):
    model = _model(tmp_path / "lopsided.onnx")
    np.savez(tmp_path / "calib.npz", input=_data(32, 0))
    held = _data(16, 1)
    shifts = {}
    for correct in (True, False):
        f, q, result = _taps(model, tmp_path / "calib.npz", held, correct)
        # the projection's output (tap 2 of 3: expand, project, head), per output channel, over held-out data
        diff = np.stack([qi[2] - fi[2] for fi, qi in zip(f, q)])
        shifts[correct] = np.abs(diff.mean(axis=(0, 1, 3, 4))).mean() / np.abs(np.stack([fi[2] for fi in f])).mean()
        if correct:
            assert set(result.corrections) == {l.weight for l in result.layers}
            assert all(c.shape == (n,) for c, n in zip(result.corrections.values(), (24, 16, 10)))
        else:
            assert result.corrections == {} and result.report.scheme["bias_correction"] == "off"
    assert shifts[True] < shifts[False] / 2, shifts


def test_the_correction_is_folded_into_the_int32_bias(tmp_path):
    """No float add is left for it: each layer's correction, and the projection's own bias after it, land in
    int32 bias weights; the graph computes nothing else than without the correction."""
    model = _model(tmp_path / "lopsided.onnx")
    np.savez(tmp_path / "calib.npz", input=_data(32, 0))
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    result = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz"))
    ops = [call_op(b.value) for b in result.graph.bindings()]
    ints = {name for name, w in result.graph.weights.items() if w.dtype == np.int32}
    assert {"expand_bias_correction_int32", "project_bias_correction_int32", "head_bias_correction_int32",
            "project_b_int32"} <= ints, sorted(result.graph.weights)
    assert not [n for n, w in result.graph.weights.items() if "bias_correction" in n and w.dtype != np.int32]
    assert not result.report.float_biases
    plain = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz", bias_correction=False)).graph
    def other(ops):  # all but the int32 bias adds (and their reshapes)
        return [o for o in ops if o not in ("relax.add", "relax.reshape")]

    assert other(ops) == other([call_op(b.value) for b in plain.bindings()])


def test_qdq_export_carries_the_corrected_biases_and_runs_as_the_bundle(tmp_path):
    model = _model(tmp_path / "lopsided.onnx")
    np.savez(tmp_path / "calib.npz", input=_data(32, 0))
    qdq = tmp_path / "model.qdq.onnx"
    res = run_cli("package", model, "--device", "host", "--precision", "int8", "--calibrate", tmp_path / "calib.npz",
                  "-o", tmp_path / "out", "--export-qdq", qdq, "-q")
    assert res.code == 0, res.stderr
    bundle = next(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    params = np.load(bundle / "quant_params.npz")
    exported = onnx.load(qdq)
    onnx.checker.check_model(exported, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    nodes = {n.name: n for n in exported.graph.node}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    # a Conv with a bias: bias + correction; a Conv without one gets one; the MatMul an Add after it
    np.testing.assert_allclose(inits[nodes["project"].input[2]], original["project_b"] + params["project/bias_correction"],
                               rtol=1e-6)
    np.testing.assert_array_equal(inits[nodes["expand"].input[2]], params["expand/bias_correction"])
    add = next(n for n in exported.graph.node if n.op_type == "Add" and nodes["head"].output[0] in n.input)
    assert add.output[0] == "output" and np.array_equal(inits[add.input[1]], params["head/bias_correction"])
    held = _data(8, 7)
    np.savez(tmp_path / "held.npz", input=held)
    ours = predict_with_loader(bundle, tmp_path / "held.npz", tmp_path / "ours.npy")
    session = onnxruntime_session(str(qdq))
    theirs = np.stack([session.run(None, {"input": held[i:i + 1]})[0][0] for i in range(len(held))])
    plain = onnxruntime_session(str(model))
    fp32 = np.stack([plain.run(None, {"input": held[i:i + 1]})[0][0] for i in range(len(held))])
    scale = np.abs(fp32).max()
    # ORT rounds its requantizing differently; both are int8 of the same corrected model
    assert np.abs(ours - theirs).max() < 0.05 * scale, (np.abs(ours - theirs).max(), scale)
