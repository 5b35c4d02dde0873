"""The self-test's input: the user's own (``--golden-input`` .npz or image), an int8 build's first calibration
sample, or a generated one tried within the domains of the model's ops before a model is refused as NaN."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from conftest import read_golden, run_cli, run_py
from edgeq.reference import onnxruntime_session


def _unary(path: Path, op: str) -> Path:
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], op,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.mark.parametrize("op, floats", [("Acos", "uniform(0.1, 0.9)"), ("Atanh", "uniform(0.1, 0.9)"),
                                        ("Acosh", "uniform(1.1, 2.0)")])
def test_ops_with_a_limited_domain_package_without_a_golden_input(tmp_path, op, floats):
    model = _unary(tmp_path / f"{op}.onnx", op)
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / f"{op}-host"
    assert _manifest(bundle)["golden"]["float_inputs"] == floats
    golden = read_golden(bundle)
    want = onnxruntime_session(str(model)).run(None, {"x": golden["input:x"]})[0]
    assert np.isfinite(golden["output:y"]).all() and np.allclose(golden["output:y"], want, rtol=1e-5, atol=1e-6)
    check = run_py(bundle, "--self-test")
    assert check.returncode == 0, check.stderr


def test_a_model_that_is_nan_everywhere_is_refused_naming_the_option(tmp_path):
    """sqrt(-|x| - 1) is NaN for every input: refused in one line that says to give --golden-input."""
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["n"]),
             helper.make_node("Sub", ["n", "one"], ["m"]), helper.make_node("Sqrt", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.ones((), np.float32), "one")])
    model = tmp_path / "nan.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out")
    assert res.code == 3
    lines = [line for line in res.stderr.splitlines() if line.startswith("edgeq: error:")]
    assert len(lines) == 1 and "NaN or Inf on the golden input" in lines[0] and "--golden-input" in lines[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_golden_input_from_an_npz(models, tmp_path):
    x = np.random.default_rng(7).uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "golden.npz", input=x)
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q",
                  "--golden-input", tmp_path / "golden.npz")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "resnet_cnn-host"
    golden = read_golden(bundle)
    assert np.array_equal(golden["input:input"], x)
    want = onnxruntime_session(str(models["resnet_cnn"])).run(None, {"input": x})[0]
    assert np.allclose(golden["output:logits"], want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    manifest = _manifest(bundle)
    assert manifest["golden"]["float_inputs"] == "--golden-input golden.npz"
    assert manifest["reference_check"]["result"] == "passed"
    assert run_py(bundle, "--self-test").returncode == 0


def test_golden_input_from_an_image_is_preprocessed_as_calibration_images_are(models, tmp_path):
    from edgeq.templates.contract import TensorSpec
    from edgeq.quantize.data import Preprocess, load_data

    pixels = np.random.default_rng(8).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(pixels).save(folder / "cat.png")
    spec = "mean=0.485/0.456/0.406,std=0.229/0.224/0.225"
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q",
                  "--golden-input", folder / "cat.png", "--preprocess", spec)
    assert res.code == 0, res.stderr
    golden = read_golden(tmp_path / "out" / "resnet_cnn-host")
    calibration = load_data(folder, [TensorSpec("input", [1, 3, 32, 32], "float32")], "calibration", Preprocess.parse(spec))
    assert np.array_equal(golden["input:input"], calibration.arrays["input"][:1])


def test_an_image_needs_preprocess_and_a_wrong_shape_is_refused(models, tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--golden-input", tmp_path / "a.png")
    assert res.code == 2 and "--preprocess" in res.stderr, res.stderr
    np.savez(tmp_path / "bad.npz", input=np.zeros((1, 3, 16, 16), np.float32))
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--golden-input", tmp_path / "bad.npz")
    assert res.code == 2 and "golden input array 'input' has shape 1x3x16x16" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_int8_golden_input_is_the_first_calibration_sample(models, tmp_path):
    calib = np.random.default_rng(9).standard_normal((12, 3, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", input=calib)
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q",
                  "--precision", "int8", "--calibrate", tmp_path / "calib.npz")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "resnet_cnn-host"
    assert np.array_equal(read_golden(bundle)["input:input"], calib[:1])
    assert _manifest(bundle)["golden"]["float_inputs"] == "the first calibration sample (calib.npz)"
    assert run_py(bundle, "--self-test").returncode == 0


def test_generated_inputs_are_drawn_in_chunks_with_the_values_of_one_draw(monkeypatch):
    """A 4 GB float32 input must not need 8 GB of float64 at once: drawn in chunks, with the same values (the
    golden input of every bundle stays what it was)."""
    import edgeq.golden as package
    from edgeq.templates.contract import TensorSpec

    monkeypatch.setattr(package, "_DRAW_CHUNK", 1000)
    specs = [TensorSpec("a", [3, 1001], "float32"), TensorSpec("b", [2, 7], "float16"), TensorSpec("i", [5], "int64")]
    for floats in package.GOLDEN_DISTRIBUTIONS:
        got = package.golden_inputs(specs, floats=floats)
        rng = np.random.default_rng(package.GOLDEN_SEED)
        draw = rng.standard_normal if floats == "standard normal" else (lambda shape: rng.uniform(*package._UNIFORM[floats], shape))
        np.testing.assert_array_equal(got["a"], draw((3, 1001)).astype(np.float32))
        np.testing.assert_array_equal(got["b"], draw((2, 7)).astype(np.float16))
        assert got["i"].dtype == np.int64 and got["i"].min() >= 0 and got["i"].max() < 7


def test_a_golden_computation_this_machine_cannot_hold_is_refused_in_one_line(models, tmp_path, monkeypatch):
    import psutil

    class Tiny:
        available = 1000  # bytes: less than resnet_cnn's input and outputs

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    out = tmp_path / "out"
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", out)
    assert res.code == 3, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("edgeq: error: the golden input and outputs take") and " free; " in last and "--input-shape" in last
    assert "Traceback" not in res.stderr and not out.exists()


def _embedding_model(path: Path, through: str = "Cast") -> Path:
    """A BERT's embeddings in small: word ids into a 30-row table, token types into a 2-row one (through ``through``)."""
    rng = np.random.default_rng(0)
    tables = [helper.make_tensor("words", TensorProto.FLOAT, [30, 4], rng.standard_normal(120).astype(np.float32)),
              helper.make_tensor("types", TensorProto.FLOAT, [2, 4], rng.standard_normal(8).astype(np.float32)),
              helper.make_tensor("zero", TensorProto.INT64, [], [0])]
    step = (helper.make_node("Cast", ["token_type_ids"], ["t"], to=TensorProto.INT64) if through == "Cast"
            else helper.make_node("Add", ["token_type_ids", "zero"], ["t"]))
    nodes = [step, helper.make_node("Gather", ["words", "input_ids"], ["w"]),
             helper.make_node("Gather", ["types", "t"], ["e"]), helper.make_node("Add", ["w", "e"], ["y"])]
    graph = helper.make_graph(nodes, "embeddings",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 8]),
                               helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4])], tables)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_generated_indices_stay_inside_the_tables_they_index(tmp_path):
    """A 2-row token-type table: the generated golden input holds 0 and 1 there (it held up to 7, the reference
    refused it, and the bundle was written unchecked with golden outputs from an out-of-bounds gather)."""
    from edgeq import golden as package

    model = _embedding_model(tmp_path / "emb.onnx")
    assert package.gather_bounds(onnx.load(model)) == {"input_ids": 30, "token_type_ids": 2}
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q", "--json")
    assert res.code == 0, res.stderr
    bundle = Path(json.loads(res.stdout)["bundle_dir"])
    assert json.loads((bundle / "manifest.json").read_text())["reference_check"]["result"] == "passed"
    assert read_golden(bundle)["input:token_type_ids"].max() <= 1


def test_a_generated_input_the_reference_cannot_run_is_refused(tmp_path):
    """Indices that reach their table through arithmetic are not bounded: the reference refuses the generated
    input, and with nothing to check the build against, nothing is written (one line, exit 3)."""
    model = _embedding_model(tmp_path / "emb.onnx", through="Add")
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--runtime", "none")
    errors = [line for line in res.stderr.splitlines() if line.startswith("edgeq: error:")]
    assert res.code == 3 and len(errors) == 1 and "--golden-input" in errors[0], res.stderr
    assert not (tmp_path / "out").exists()
