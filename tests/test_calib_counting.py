"""Calibration data is counted in one unit (samples: rows of the model's batch) and used in whole batches;
messages speak the unit the data came in ("1 batch of 497" for (N, B, ...) arrays, "3 samples" otherwise).
Too little for one model run is refused in one line; fewer than 10 samples only warn (ONNX Runtime and
TensorRT calibrate from that too)."""

import json

import numpy as np
import onnx
import pytest

import make_models
from conftest import run_cli
from edgeq.templates.contract import TensorSpec
from edgeq.quantize.data import DataError, load_data

SHAPE = (3, 8, 8)  # one sample of the small models below


def spec(batch: int) -> list[TensorSpec]:
    return [TensorSpec("input", [batch, *SHAPE], "float32")]


def save(path, array) -> str:
    np.savez(path, input=array.astype(np.float32))
    return str(path)


def data(n: int, batch: int | None = None) -> np.ndarray:
    """``n`` samples, or ``n`` batches of ``batch`` when given."""
    shape = (n, *SHAPE) if batch is None else (n, batch, *SHAPE)
    return np.random.default_rng(n).standard_normal(shape)


def load(path, batch, warnings, **kw):
    return load_data(path, spec(batch), "calibration", limit=kw.pop("limit", 256), minimum=10, warn=warnings.append, **kw)


# ---- counting (no compile) -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["batches", "samples"])
def test_one_batch_of_497_is_enough_whatever_the_layout(tmp_path, layout):
    """The report's case: a static batch of 497 and one such batch of data, with the default
    --calib-samples 256 (it used to take 256 images and refuse: 'at least 497 are needed')."""
    array = data(1, 497) if layout == "batches" else data(497)
    warnings = []
    got = load(save(tmp_path / "c.npz", array), 497, warnings)
    assert got.count == 497 and got.runs == 1 and warnings == []
    assert got.describe() == ("1 batch of 497" if layout == "batches" else "497 samples")
    np.testing.assert_array_equal(next(got.batches(spec(497)))[0], array.reshape(497, *SHAPE).astype(np.float32))


def test_limit_counts_samples_in_whole_batches(tmp_path):
    warnings = []
    path = save(tmp_path / "c.npz", data(5, 8))
    assert load(path, 8, warnings, limit=256).describe() == "5 batches of 8"
    assert load(path, 8, warnings, limit=24).describe() == "3 batches of 8"
    assert load(path, 8, warnings, limit=20).count == 16  # 20 samples: two whole batches
    assert warnings == []
    one = load(path, 8, warnings, limit=3)  # under one batch: one batch still
    assert one.count == 8 and one.describe() == "1 batch of 8"
    assert warnings == ["calibration data " + path + " has only 1 batch of 8; ranges from fewer than 10 samples may "
                        "not cover real inputs: give more for better scales"]


def test_fewer_than_10_samples_warn_in_the_unit_given(tmp_path):
    warnings = []
    got = load(save(tmp_path / "three.npz", data(3)), 1, warnings)
    assert got.count == 3 and len(warnings) == 1 and "has only 3 samples" in warnings[0]
    warnings.clear()
    got = load(save(tmp_path / "one.npz", data(1)), 1, warnings)
    assert got.count == 1 and "has only 1 sample;" in warnings[0]


def test_samples_that_do_not_fill_a_batch_are_named(tmp_path):
    warnings = []
    got = load(save(tmp_path / "c.npz", data(20)), 8, warnings)
    assert got.count == 16 and got.runs == 2
    assert warnings == [f"calibration data {tmp_path / 'c.npz'}: the last 4 of 20 samples do not fill a batch of 8 "
                        "and are not used"]


@pytest.mark.parametrize("array, batch, words", [
    (data(300), 497, ["has 300 samples; the model runs 497 at a time",
                      "give at least 1 batch of 497 (an array of Nx497x3x8x8) or 497 samples"]),
    (np.zeros((0, 497, *SHAPE)), 497, ["has 0 batches of 497"]),
    (np.zeros((0, *SHAPE)), 1, ["has 0 samples", "give at least 1 sample"]),
])
def test_less_than_one_run_is_refused_in_one_line(tmp_path, array, batch, words):
    with pytest.raises(DataError) as err:
        load(save(tmp_path / "c.npz", array), batch, [])
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value


def test_a_folder_of_batch_files_counts_batches(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    save(folder / "a.npz", data(2, 4))
    save(folder / "b.npz", data(1, 4))
    got = load(folder, 4, [])
    assert got.describe() == "3 batches of 4" and got.count == 12


# ---- through the CLI: a real int8 package ------------------------------------------------------------------


def small_cnn(path, batch: int):
    onnx.save(make_models.resnet_cnn(size=8, width=4, blocks=1, classes=4, batch=batch), path)
    return path


def package(model, calib, out):
    res = run_cli("package", model, "--device", "host", "-o", out, "-q", "--json", "--precision", "int8",
                  "--calibrate", calib)
    return res, (json.loads(res.stdout) if res.code == 0 else None)


def test_batch_497_model_packages_with_one_batch_of_calibration(tmp_path):
    model = small_cnn(tmp_path / "b497.onnx", 497)
    res, out = package(model, save(tmp_path / "calib.npz", data(1, 497)), tmp_path / "out")
    assert res.code == 0, res.stderr
    manifest = json.loads((tmp_path / "out" / out["bundle_dir"] / "manifest.json").read_text())
    assert manifest["quantization"]["calibration"]["samples"] == 497
    assert manifest["quantization"]["precision_counts"]["int8"] > 0


def test_three_samples_package_with_a_warning(tmp_path):
    model = small_cnn(tmp_path / "b1.onnx", 1)
    res, out = package(model, save(tmp_path / "calib.npz", data(3)), tmp_path / "out")
    assert res.code == 0, res.stderr
    said = res.stderr  # shown although -q silences progress
    assert "edgeq: warning: calibration data" in said and "has only 3 samples" in said, said
    manifest = json.loads((tmp_path / "out" / out["bundle_dir"] / "manifest.json").read_text())
    report = manifest["quantization"]
    assert report["calibration"]["samples"] == 3
    scales = [layer["activation_scale"] for layer in report["layers"] if layer["precision"] == "int8"]
    assert scales and all(np.isfinite(s) and s > 0 for s in scales)
