"""--export-qdq: edgeq's calibration leaves edgeq as an ONNX QDQ model (TensorRT's explicit quantization, ONNX
Runtime): the ONNX checker passes, ONNX Runtime runs it, its outputs agree with edgeq's own int8 bundle, it
carries exactly the bundle's scales, and layers edgeq kept in float stay float."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import predict_with_loader, run_cli
from edgeq.reference import onnxruntime_session


def _data(model: Path, folder: Path, n: int, seed: int) -> Path:
    spec = onnx.load(model).graph.input[0]
    shape = [d.dim_value or 1 for d in spec.type.tensor_type.shape.dim][1:]
    path = folder / f"data{seed}.npz"
    np.savez(path, **{spec.name: np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)})
    return path


def _package(model: Path, tmp_path: Path, *extra: str) -> tuple[Path, Path, Path]:
    calib, qdq = _data(model, tmp_path, 16, 0), tmp_path / "model.qdq.onnx"
    res = run_cli("package", model, "--device", "host", "--precision", "int8", "--calibrate", calib,
                  "-o", tmp_path / "out", "--export-qdq", qdq, "-q", *extra)
    assert res.code == 0, res.stderr
    return qdq, next(p for p in (tmp_path / "out").iterdir() if p.is_dir()), calib


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("family", ["resnet_cnn", "mobilenet_cnn"])
def test_qdq_export_runs_in_onnxruntime_as_edgeqs_int8_bundle(models, tmp_path, family):
    qdq, bundle, _ = _package(models[family], tmp_path)
    onnx.checker.check_model(onnx.load(qdq), full_check=True)
    evaluation = _data(models[family], tmp_path, 8, 7)
    x = np.load(evaluation)
    name = onnx.load(qdq).graph.input[0].name
    np.savez(tmp_path / "eval_input.npz", input=x[name])
    ours = predict_with_loader(bundle, tmp_path / "eval_input.npz", tmp_path / "ours.npy")
    session = onnxruntime_session(str(qdq))
    theirs = np.stack([session.run(None, {name: x[name][i : i + 1]})[0][0] for i in range(len(x[name]))])
    for i in range(len(theirs)):
        assert _cosine(ours[i], theirs[i]) >= 0.999, (i, _cosine(ours[i], theirs[i]))
    # the same scales as the bundle's quant_params.npz
    scales = np.load(bundle / "quant_params.npz")
    model = onnx.load(qdq)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    layers = [k.rsplit("/", 1)[0] for k in scales.files if k.endswith("/weight_scale")]
    assert len(weight_dq) == len(layers) > 0
    exported = sorted(tuple(inits[n.input[1]].tolist()) for n in weight_dq)
    assert exported == sorted(tuple(scales[f"{layer}/weight_scale"].tolist()) for layer in layers)
    act = {float(inits[n.input[1]]) for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert act == {float(scales[f"{layer}/activation_scale"]) for layer in layers}


def test_layers_kept_in_float_stay_float(models, tmp_path):
    model = onnx.load(models["resnet_cnn"])
    first = next(n for n in model.graph.node if n.op_type == "Conv")
    qdq, _, _ = _package(models["resnet_cnn"], tmp_path, "--skip", first.name)
    exported = onnx.load(qdq)
    node = next(n for n in exported.graph.node if n.name == first.name)
    producers = {o: n for n in exported.graph.node for o in n.output}
    assert node.input[0] not in producers or producers[node.input[0]].op_type != "DequantizeLinear"
    weight = next(t for t in exported.graph.initializer if t.name == node.input[1])
    assert numpy_helper.to_array(weight).dtype == np.float32
    others = [n for n in exported.graph.node if n.op_type == "Conv" and n.name != first.name]
    assert all(producers[n.input[1]].op_type == "DequantizeLinear" for n in others)


def test_export_qdq_refusals(models, tmp_path):
    model = models["resnet_cnn"]
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "a", "--export-qdq", tmp_path / "q.onnx")
    assert res.code == 2 and "needs --precision int8 or mixed" in res.stderr
    calib = _data(model, tmp_path, 4, 0)
    res = run_cli("package", model, "--device", "host", "--precision", "int8", "--calibrate", calib, "-o", tmp_path / "b",
                  "--export-qdq", tmp_path / "q.txt")
    assert res.code == 2 and "ending in .onnx" in res.stderr
    res = run_cli("package", model, "--device", "host", "--precision", "int8", "--calibrate", calib, "-o", tmp_path / "c",
                  "--export-qdq", tmp_path / "missing" / "q.onnx")
    assert res.code == 6 and "not writable" in res.stderr
    copy = tmp_path / "model.onnx"  # the model being packaged, given as the QDQ file: refused, not overwritten
    shutil.copy(model, copy)
    before = copy.read_bytes()
    res = run_cli("package", copy, "--device", "host", "--precision", "int8", "--calibrate", calib, "-o", tmp_path / "d",
                  "--export-qdq", tmp_path / "." / "model.onnx")
    assert res.code == 2 and "is the model being packaged" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert copy.read_bytes() == before
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c", "d")) and not (tmp_path / "q.onnx").exists()
