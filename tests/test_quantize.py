"""INT8 post-training quantization end to end: accuracy through the bundle's loader, integer compute in
the IR, weight size, mixed precision, and every bad calibration input."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import predict_with_loader, run_cli
from edgeq.graph import call_op
from edgeq.load import load_model
from edgeq.quantize import QuantizeArgs, quantize
from edgeq.relax_import import to_relax
from edgeq.reference import onnxruntime_session


def package_json(*argv):
    res = run_cli("package", *argv, "--json", "-q")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def manifest(result) -> dict:
    return json.loads(Path(result["bundle_dir"], "manifest.json").read_text())


@pytest.fixture(scope="module")
def random_data(tmp_path_factory):
    """Calibration and held-out data from the same distribution as the ResNet-style example's inputs."""
    root = tmp_path_factory.mktemp("random-data")
    paths = {}
    for name, seed, n in (("calib", 1, 64), ("eval", 2, 32)):
        paths[name] = root / f"{name}.npz"
        np.savez(paths[name], input=np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32))
    return paths


def test_digits_int8_accuracy_within_half_a_point_through_the_loader(digits, tmp_path):
    fp32 = package_json(digits["model"], "--device", "host", "-o", tmp_path / "fp32")
    int8 = package_json(digits["model"], "--device", "host", "-o", tmp_path / "int8", "--precision", "int8",
                        "--calibrate", digits["calib"], "--eval", digits["test"])
    labels = np.load(digits["test"])["labels"]
    acc = {}
    for name, result in (("fp32", fp32), ("int8", int8)):
        logits = predict_with_loader(Path(result["bundle_dir"]), digits["test"], tmp_path / f"{name}.npy")
        acc[name] = float(np.mean(logits.argmax(axis=1) == labels) * 100)
    assert acc["fp32"] > 90
    assert acc["int8"] >= acc["fp32"] - 0.5, acc
    report = manifest(int8)["quantization"]
    assert report["evaluation"]["top1_quantized"] == pytest.approx(acc["int8"], rel=1e-5)  # 6 significant digits
    assert report["precision_counts"] == {"int8": 3, "fp16": 0, "fp32": 0}
    assert all(row["sqnr_db"] > 20 for row in report["layers"])


def test_resnet_int8_cosine_and_weight_size(models, random_data, tmp_path):
    fp32 = package_json(models["resnet_cnn"], "--device", "host", "-o", tmp_path / "fp32")
    int8 = package_json(models["resnet_cnn"], "--device", "host", "-o", tmp_path / "int8", "--precision", "int8",
                        "--calibrate", random_data["calib"])
    f = predict_with_loader(Path(fp32["bundle_dir"]), random_data["eval"], tmp_path / "f.npy").ravel()
    q = predict_with_loader(Path(int8["bundle_dir"]), random_data["eval"], tmp_path / "q.npy").ravel()
    cosine = float(f @ q / np.linalg.norm(f) / np.linalg.norm(q))
    assert cosine >= 0.99, cosine
    size = {r["bundle_dir"]: Path(r["bundle_dir"], "weights.bin").stat().st_size for r in (fp32, int8)}
    assert size[int8["bundle_dir"]] <= 0.3 * size[fp32["bundle_dir"]], size
    m = manifest(int8)
    assert m["precision"] == "int8" and "quant_params.npz" in m["files"]
    scales = np.load(Path(int8["bundle_dir"], "quant_params.npz"))
    assert {f"{row['name']}/weight_scale" for row in m["quantization"]["layers"]} <= set(scales.files)


def _quantized_graph(model_path, calib, **kw):
    loaded = load_model(model_path)
    graph, _ = to_relax(loaded)
    return quantize(graph, loaded, QuantizeArgs(calibrate=calib, **kw))


@pytest.mark.parametrize("family", ["resnet_cnn", "mobilenet_cnn"])
def test_ir_computes_conv_and_matmul_in_integers(models, random_data, family):
    result = _quantized_graph(models[family], random_data["calib"])
    weighted = [b.value for b in result.graph.bindings() if call_op(b.value) in ("relax.nn.conv2d", "relax.matmul")]
    assert len(weighted) == len(result.layers) >= 4
    for call in weighted:
        assert [a.ty.dtype for a in call.args] == ["int8", "int8"], call
        assert call.ty.dtype == "int32"
    # No dequantize feeds a quantize (directly or through a ReLU): consecutive int8 layers requantize.
    values = {b.var: b.value for b in result.graph.bindings()}
    for b in result.graph.bindings():
        if call_op(b.value) == "relax.quantize":
            src = values.get(b.value.args[0])
            if call_op(src) == "relax.nn.relu":
                src = values.get(src.args[0])
            assert call_op(src) != "relax.dequantize"
    # A block's output goes on quantized only, once: the residual add reads that int8 copy (dequantized), not
    # the float tensor (which would be written in float for it alone).
    readers: dict = {}
    for b in result.graph.bindings():
        for var in b.value.args if hasattr(b.value, "args") else []:
            readers.setdefault(var, []).append(call_op(b.value))
    quantized = [b.value.args[0] for b in result.graph.bindings()
                 if call_op(b.value) == "relax.quantize" and b.value.args[0] in values]
    assert quantized and all(readers[v] == ["relax.quantize"] for v in quantized), [readers[v] for v in quantized]
    if family == "resnet_cnn":  # its residual adds read an int8 tensor
        adds = [b.value for b in result.graph.bindings() if call_op(b.value) == "relax.add" and b.value.ty.dtype == "float32"]
        assert any(call_op(values.get(a)) == "relax.dequantize" and values[a].args[0].ty.dtype == "int8"
                   for add in adds for a in add.args)
    assert {str(w.dtype) for w in result.graph.weights.values()} >= {"int8", "int32"}


def test_quantizing_builds_the_float_graph_once(models, random_data, monkeypatch):
    """Calibration, bias correction, the evaluation's float reference and the per-layer SQNR's float side run on
    one host build of the float graph (``calibrate.Taps``): three builds in all, with the int8 graph judged and the
    SQNR's int8 side (each layer's output tapped). Each build of a model costs seconds (googlenet at 64x64: ~10 s),
    and there were six."""
    import edgeq.compile as compile_module

    built = []
    real = compile_module.build

    def counted(mod, target, *args, **kwargs):
        built.append("int8" in str(mod["main"]))
        return real(mod, target, *args, **kwargs)

    monkeypatch.setattr(compile_module, "build", counted)
    result = _quantized_graph(models["resnet_cnn"], random_data["calib"])
    assert result.corrections and all(l.precision == "int8" for l in result.layers)  # bias correction ran
    assert sorted(built) == [False, True, True], built


def test_transformer_block_int8(models, tmp_path):
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(3).standard_normal((32, 16, 32)).astype(np.float32))
    result = _quantized_graph(models["transformer_block"], calib)
    assert [l.op_type for l in result.layers].count("MatMul") == 6  # q, k, v, out, mlp x2; attention stays float
    assert result.report.evaluation["cosine"] > 0.99


def test_skip_keeps_layers_in_fp32(models, random_data):
    result = _quantized_graph(models["resnet_cnn"], random_data["calib"], skip=("Gemm", "conv_3"))
    by_name = {l.name: l for l in result.layers}
    assert by_name["conv_3"].precision == "fp32" and by_name["fc_30"].precision == "fp32"
    assert by_name["conv_3"].reason == "--skip conv_3"
    float_calls = [b.value for b in result.graph.bindings()
                   if call_op(b.value) in ("relax.nn.conv2d", "relax.matmul") and b.value.args[0].ty.dtype == "float32"]
    assert len(float_calls) == 2


def test_accuracy_budget_returns_sensitive_layers_to_float(models, random_data, tmp_path):
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--precision", "mixed",
                  "--calibrate", random_data["calib"], "--eval", random_data["eval"], "--accuracy-budget", "0.005",
                  "--fp16", "--json", "-q")
    assert res.code == 0, res.stderr
    report = manifest(json.loads(res.stdout))["quantization"]
    ev = report["evaluation"]
    assert ev["budget_metric"] == "worst relative output error" and ev["budget_met"] and ev["rel_error"] <= 0.005
    assert report["fallbacks"] and report["precision_counts"]["fp16"] == len(report["fallbacks"])
    assert report["precision_counts"]["int8"] >= 1
    first = report["fallbacks"][0]
    assert first["alone"] == max(f["alone"] for f in report["fallbacks"])
    assert all(r["reason"].startswith("accuracy budget") for r in report["layers"] if r["precision"] == "fp16")


def test_images_with_preprocess(digits, tmp_path):
    from PIL import Image

    data = np.load(digits["calib"])["input"]
    folder = tmp_path / "images"
    for i, img in enumerate(data[:40]):
        (folder / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray((img[0] * 255).astype(np.uint8), mode="L").save(folder / f"class{i % 3}" / f"{i}.png")
    res = package_json(digits["model"], "--device", "host", "-o", tmp_path / "out", "--precision", "int8",
                       "--calibrate", folder, "--preprocess", "scale=255")
    report = manifest(res)["quantization"]
    assert report["calibration"]["samples"] == 40 and report["evaluation"]["cosine"] > 0.99


# ---- bad calibration input: one line, non-zero exit, no bundle --------------------------------------------


def refused(model, data, out, *extra):
    res = run_cli("package", model, "--device", "host", "-o", out, "-q", "--precision", "int8", "--calibrate", data, *extra)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and lines[0].startswith("edgeq: error: "), res.stderr
    assert not out.exists() or not any(out.iterdir())
    return lines[0]


@pytest.mark.parametrize("arrays,expected", [
    ({"input": np.zeros((20, 3, 16, 16), np.float32)}, "has shape 20x3x16x16; input 'input' (1x3x32x32) needs Nx3x32x32"),
    ({"input": np.zeros((20, 3, 32, 32), np.int64)}, "is int64 but input 'input' is float32"),
    ({"image": np.zeros((20, 3, 32, 32), np.float32)}, "has array(s) image but the model's inputs are: input"),
])
def test_bad_calibration_arrays(models, tmp_path, arrays, expected):
    data = tmp_path / "calib.npz"
    np.savez(data, **arrays)
    assert expected in refused(models["resnet_cnn"], data, tmp_path / "out")


def test_nan_in_calibration_data(models, tmp_path):
    x = np.zeros((20, 3, 32, 32), np.float32)
    x[7, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", input=x)
    assert "NaN or Inf (first in sample 7)" in refused(models["resnet_cnn"], tmp_path / "nan.npz", tmp_path / "out")


def test_empty_and_unreadable_image_folders(digits, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "has no .npy, .npz or image files" in refused(digits["model"], tmp_path / "empty", tmp_path / "o1", "--preprocess")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"not a png")
    assert "cannot read image" in refused(digits["model"], bad, tmp_path / "o2", "--preprocess")
    assert "holds images: say how to prepare them with --preprocess" in refused(digits["model"], bad, tmp_path / "o3")


def test_quantization_options_need_int8(models, tmp_path, random_data):
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--precision", "int8")
    assert res.code == 2 and "needs calibration data: add --calibrate DATA" in res.stderr
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--calibrate", random_data["calib"])
    assert res.code == 2 and "need --precision int8 or mixed" in res.stderr
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--precision", "int8",
                  "--calibrate", random_data["calib"], "--skip", "nosuchlayer")
    assert res.code == 2 and "--skip 'nosuchlayer' matches no quantizable layer" in res.stderr


def test_jetson_int8_bundle(models, random_data, tmp_path):
    res = package_json(models["mobilenet_cnn"], "--device", "jetson-orin-nano", "-o", tmp_path, "--precision", "int8",
                       "--calibrate", random_data["calib"])
    m = manifest(res)
    assert m["library"]["cuda_device_code"] == ["sm_87"] and m["quantization"]["precision_counts"]["int8"] == 8
    # the golden outputs come from a host build: the device may round one value to the next int8 step
    assert (m["golden"]["rtol"], m["golden"]["atol"]) == (0.02, 0.05)


def _assert_close_to_onnxruntime(path: Path, graph, data: Path, cosine: float = 0.995) -> None:
    """``graph`` (a quantized import of ``path``) against ONNX Runtime on ``path``, over 8 samples of ``data``:
    each output's cosine at least ``cosine``."""

    from edgeq.compile import HostRunner

    session = onnxruntime_session(str(path))
    runner = HostRunner(graph)
    for sample in np.load(data)["input"][:8]:
        want = session.run(None, {"input": sample[None]})[0].ravel()
        got = runner([sample[None]])[0].ravel()
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= cosine


def _inception_model(path: Path) -> Path:
    """A GoogLeNet-style stem and inception block (torchvision's layout, small): conv, ReLU, max-pool; four
    branches (1x1; 1x1 -> 3x3; 1x1 -> 3x3; 3x3 max-pool -> 1x1) concatenated, then a 1x1 conv."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    shapes = dict(stem=(16, 3, 3, 3), b1=(8, 16, 1, 1), b2r=(8, 16, 1, 1), b2=(12, 8, 3, 3), b3r=(4, 16, 1, 1),
                  b3=(8, 4, 3, 3), b4=(4, 16, 1, 1), head=(10, 32, 1, 1))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * (2 / np.prod(s[1:])) ** 0.5).astype(np.float32), k)
             for k, s in shapes.items()]
    inits += [numpy_helper.from_array(rng.uniform(-0.1, 0.2, s[0]).astype(np.float32), f"{k}_b")
              for k, s in shapes.items()]

    def conv(x, w, y, pad=0):
        return [helper.make_node("Conv", [x, w, f"{w}_b"], [f"{y}_c"], pads=[pad] * 4),
                helper.make_node("Relu", [f"{y}_c"], [y])]

    nodes = [*conv("input", "stem", "s", 1),
             helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
             *conv("p", "b1", "y1"), *conv("p", "b2r", "r2"), *conv("r2", "b2", "y2", 1),
             *conv("p", "b3r", "r3"), *conv("r3", "b3", "y3", 1),
             helper.make_node("MaxPool", ["p"], ["p4"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1),
             *conv("p4", "b4", "y4"),
             helper.make_node("Concat", ["y1", "y2", "y3", "y4"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "head", "head_b"], ["y"])]
    graph = helper.make_graph(nodes, "inception", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path


def test_inception_block_concatenates_and_pools_int8(random_data, tmp_path):
    """Every reader of the concatenation and of the pooled stem quantizes to one scale (calibration measures a
    layer after a max-pool on the pool's input), so the concatenation and both max-pools run on int8 and each
    branch's convolution requantizes straight into it; the result still matches the float model."""
    path = _inception_model(tmp_path / "inception.onnx")
    result = _quantized_graph(path, random_data["calib"])
    ops = {call_op(b.value): b.value for b in result.graph.bindings()}
    floats = [call_op(b.value) for b in result.graph.bindings()
              if call_op(b.value) in ("relax.concat", "relax.nn.max_pool2d") and b.value.ty.dtype != "int8"]
    assert "relax.concat" in ops and "relax.nn.max_pool2d" in ops and not floats, floats
    assert [call_op(b.value) for b in result.graph.bindings()].count("relax.quantize") == 1  # the model input
    _assert_close_to_onnxruntime(path, result.graph, random_data["eval"])


def _c2f_model(path: Path, concat_is_an_output: bool = False) -> Path:
    """YOLOv8's C2f block (small, as Ultralytics exports it: conv-SiLU as Conv, Sigmoid, Mul): a 1x1 conv, its output
    split in two halves, a bottleneck (two 3x3 conv-SiLU) on the second half with its residual add, the halves and
    the bottleneck's output concatenated and a 1x1 conv over them. The second half is read by the bottleneck, the
    residual add and the concatenation; the bottleneck's output by the concatenation only."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    shapes = dict(stem=(8, 3, 3, 3), cv1=(8, 8, 1, 1), m1=(4, 4, 3, 3), m2=(4, 4, 3, 3), cv2=(8, 12, 1, 1))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * (2 / np.prod(s[1:])) ** 0.5).astype(np.float32), k)
             for k, s in shapes.items()]
    inits += [numpy_helper.from_array(rng.uniform(-0.5, 0.5, s[0]).astype(np.float32), f"{k}_b")
              for k, s in shapes.items()]
    inits[3] = numpy_helper.from_array(numpy_helper.to_array(inits[3]) * 3, "m2")  # the sum outgrows the halves
    inits.append(numpy_helper.from_array(np.array([4, 4], np.int64), "halves"))

    def conv(x, w, y, pad=0):
        return [helper.make_node("Conv", [x, w, f"{w}_b"], [f"{y}_c"], pads=[pad] * 4),
                helper.make_node("Sigmoid", [f"{y}_c"], [f"{y}_s"]), helper.make_node("Mul", [f"{y}_c", f"{y}_s"], [y])]

    nodes = [*conv("input", "stem", "x", 1), *conv("x", "cv1", "y"),
             helper.make_node("Split", ["y", "halves"], ["y0", "y1"], axis=1),
             *conv("y1", "m1", "b1", 1), *conv("b1", "m2", "b2", 1), helper.make_node("Add", ["y1", "b2"], ["p2"]),
             helper.make_node("Concat", ["y0", "y1", "p2"], ["cat"], axis=1), *conv("cat", "cv2", "out")]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 32, 32])]
    if concat_is_an_output:
        outputs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, [1, 12, 32, 32]))
    graph = helper.make_graph(nodes, "c2f", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 32, 32])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path


def test_a_c2f_blocks_concatenation_and_its_parts_share_one_scale(random_data, tmp_path):
    """The layers reading a C2f block's concatenation and those reading its parts (the bottleneck's first conv reads
    the second half of the split) read at one scale, the larger of their calibrated ones (TensorRT's concatenation
    rule: quantize.shared_scales); then every part is quantized once where it is made (hoist_quantize through the
    split and the concatenation), the split and the concatenation run on int8, and the residual add reads the int8
    half. Where the concatenation is also read in float (a graph output), nothing is shared."""
    path = _c2f_model(tmp_path / "c2f.onnx")
    result = _quantized_graph(path, random_data["calib"], method="minmax")
    rows = {r.weight: r for r in result.report.layers}
    assert rows["m1"].shared_scale_with == [rows["cv2"].name] and rows["cv2"].shared_scale_with == [rows["m1"].name]
    assert all(rows[w].shared_scale_with is None for w in ("stem", "cv1", "m2"))
    scales = {w: result.scales[f"{rows[w].name}/activation_scale"] for w in ("m1", "cv2")}
    top = max(rows["m1"].activation_threshold, rows["cv2"].activation_threshold)
    assert scales["m1"] == scales["cv2"] and scales["m1"] == pytest.approx(top / 127, rel=1e-5)
    assert rows["m1"].activation_threshold != rows["cv2"].activation_threshold  # (else the test shows nothing)
    from edgeq.cli.package import _act_scale  # the package command's quantization table says so

    assert _act_scale(rows["m1"]).endswith("(shared with 1)") and "shared" not in _act_scale(rows["m2"])
    ops = [call_op(b.value) for b in result.graph.bindings()]
    moved = [b.value for b in result.graph.bindings() if call_op(b.value) in ("relax.concat", "relax.split")]
    assert len(moved) == 2 and all("int8" in str(v.ty) for v in moved), moved
    assert "relax.concat" not in result.report.float_ops, result.report.float_ops
    # quantized once each, where made: the model's input and the four SiLU outputs read by a layer (the stem's, the
    # cv1's that is split on int8, the bottleneck's inner one) or summed (p2); the SiLU ones are in the graph's float
    # form here, the GPU backend's epilogues or the CPU's fused kernels compute them
    quantized = [b.value.args[0] for b in result.graph.bindings() if call_op(b.value) == "relax.quantize"]
    assert len(quantized) == 5 and len(set(quantized)) == 5, ops
    _assert_close_to_onnxruntime(path, result.graph, random_data["eval"])

    apart = _quantized_graph(_c2f_model(tmp_path / "c2f-out.onnx", True), random_data["calib"], method="minmax")
    assert all(r.shared_scale_with is None for r in apart.report.layers)
    concat = next(b.value for b in apart.graph.bindings() if call_op(b.value) == "relax.concat")
    assert "float32" in str(concat.ty) and apart.report.float_ops["relax.concat"] == 1
    # a part read by a layer left in float (--skip): the group cannot be int8 throughout, nothing is shared
    skipped = _quantized_graph(path, random_data["calib"], method="minmax", skip=(rows["m1"].name,))
    assert all(r.shared_scale_with is None for r in skipped.report.layers)


def test_a_switchable_graph_runs_any_mix_of_int8_and_float_layers(models, random_data):
    """The accuracy budget's search compiles one graph whose layers are int8 or float by a parameter
    (quantize_ops(..., switches=...)): all on computes what the plain int8 rewrite computes, all off the float
    model, one on that layer alone in int8; no recompiling between them."""
    from edgeq.compile import HostRunner
    from edgeq.quantize import _plans
    from edgeq.quantize.quantize_ops import SWITCHES, quantize_ops

    loaded = load_model(models["resnet_cnn"])
    graph, _ = to_relax(loaded)
    result = quantize(graph, loaded, QuantizeArgs(calibrate=random_data["calib"]))
    scales = {l.weight: float(result.scales[f"{l.name}/activation_scale"]) for l in result.layers}
    plans = _plans(result.layers, scales)
    names = [l.weight for l in result.layers]
    runner = HostRunner(quantize_ops(graph, plans, switches=names))
    x = [np.load(random_data["calib"])["input"][:1]]
    float_out = HostRunner(graph)(x)[0]
    runner.set_param(SWITCHES, np.ones(len(names), bool))
    np.testing.assert_array_equal(runner(x)[0], HostRunner(quantize_ops(graph, plans))(x)[0])
    runner.set_param(SWITCHES, np.zeros(len(names), bool))
    np.testing.assert_allclose(runner(x)[0], float_out, rtol=1e-5, atol=1e-6)
    one = {names[1]: plans[names[1]]}
    runner.set_param(SWITCHES, np.array([n == names[1] for n in names]))
    # the float layers around it may fuse otherwise (float rounding), the int8 layer computes the same
    np.testing.assert_allclose(runner(x)[0], HostRunner(quantize_ops(graph, one))(x)[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(runner(x)[0], float_out, rtol=0, atol=0)
