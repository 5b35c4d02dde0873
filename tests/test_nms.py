"""NonMaxSuppression with a static bound (edgeq.nms): the selection is ONNX Runtime's on the real rows, for
ONNX's node tests, a detector exported by torch's exporter and one built with the onnx helper API, on host
and jetson-orin-nano builds; the count is reported by both loaders; ops that would mix padded rows with real
ones are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import node_tests  # benchmarks/ (pyproject: pythonpath)
from conftest import run_cli, run_py, torch_export
from edgeq.reference import onnxruntime_session

# a YOLO-style detector ending in NonMaxSuppression, exported by torch's (TorchScript) exporter the way
# torchvision.ops.nms and ultralytics' nms=True exports write it: NMS over [1, N, 4] xywh boxes and [1, C, N]
# scores, then the kept boxes gathered by the selected index
TORCH_DETECTOR = """
import sys, torch
torch.manual_seed(0)

class Nms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, boxes, scores, max_out, iou, threshold):
        return torch.zeros((0, 3), dtype=torch.int64)  # traced for its type only: the exporter writes the op

    @staticmethod
    def symbolic(g, boxes, scores, max_out, iou, threshold):
        return g.op("NonMaxSuppression", boxes, scores, max_out, iou, threshold, center_point_box_i=1)

class Detector(torch.nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.SiLU(),
                                            torch.nn.Conv2d(16, 32, 3, 2, 1), torch.nn.SiLU())
        self.box = torch.nn.Conv2d(32, 4, 1)
        self.cls = torch.nn.Conv2d(32, classes, 1)

    def forward(self, x):
        f = self.backbone(x)
        xywh = self.box(f).flatten(2).transpose(1, 2) * torch.tensor([16.0, 16.0, 3.0, 3.0]) + torch.tensor([16.0, 16.0, 6.0, 6.0])
        scores = self.cls(f).flatten(2).sigmoid()
        selected = Nms.apply(xywh, scores, torch.tensor([10]), torch.tensor([0.5]), torch.tensor([0.45]))
        boxes = torch.index_select(xywh[0], 0, selected[:, 2])
        return selected, boxes

torch.onnx.export(Detector().eval(), torch.randn(1, 3, 32, 32), sys.argv[1], opset_version=17, dynamo=False,
                  input_names=["image"], output_names=["selected", "boxes"])
"""


def helper_detector(path: Path, max_out: int = 20) -> Path:
    """A conv head -> corner boxes [1, N, 4] and scores [1, 3, N] -> NonMaxSuppression -> the kept boxes."""
    rng = np.random.default_rng(1)
    classes, cells = 3, 64
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4 + classes, 3, 3, 3)).astype("float32"), "w"),
             numpy_helper.from_array(np.array([1, 4 + classes, cells], "int64"), "flat_shape"),
             numpy_helper.from_array(np.array([0], "int64"), "s0"), numpy_helper.from_array(np.array([4], "int64"), "s4"),
             numpy_helper.from_array(np.array([4 + classes], "int64"), "s7"),
             numpy_helper.from_array(np.array([1], "int64"), "ax1"),
             numpy_helper.from_array(np.array([20, 20, 24, 24], "float32"), "scale"),
             numpy_helper.from_array(np.array([max_out], "int64"), "max_out"),
             numpy_helper.from_array(np.array([0.3], "float32"), "iou"),
             numpy_helper.from_array(np.array([0.5], "float32"), "threshold"),
             numpy_helper.from_array(np.array(2, "int64"), "two"), numpy_helper.from_array(np.array([0], "int64"), "zero")]
    nodes = [
        helper.make_node("Conv", ["image", "w"], ["head"], pads=[1, 1, 1, 1], strides=[4, 4]),
        helper.make_node("Reshape", ["head", "flat_shape"], ["flat"]),
        helper.make_node("Slice", ["flat", "s0", "s4", "ax1"], ["raw"]),
        helper.make_node("Transpose", ["raw"], ["corners"], perm=[0, 2, 1]),
        helper.make_node("Mul", ["corners", "scale"], ["boxes"]),
        helper.make_node("Slice", ["flat", "s4", "s7", "ax1"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["scores"]),
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "threshold"], ["selected"]),
        helper.make_node("Squeeze", ["boxes", "zero"], ["boxes_2d"]),
        helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
        helper.make_node("Gather", ["boxes_2d", "box_index"], ["kept"], axis=0),
    ]
    graph = helper.make_graph(nodes, "detector", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("selected", TensorProto.INT64, ["n", 3]),
                               helper.make_tensor_value_info("kept", TensorProto.FLOAT, ["n", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def detectors(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("nms")
    torch_path = torch_export(TORCH_DETECTOR, out / "torch_detector.onnx")
    assert [n.op_type for n in onnx.load(torch_path).graph.node].count("NonMaxSuppression") == 1
    return {"torch": torch_path, "helper": helper_detector(out / "helper_detector.onnx")}


def _ort(path: Path, image: np.ndarray) -> list[np.ndarray]:
    session = onnxruntime_session(str(path))
    return session.run(None, {"image": image})


def _images(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(0, 1.5, (1, 3, 32, 32)).astype("float32") for _ in range(count)]


def _package(model: Path, out: Path, *extra: str) -> Path:
    result = run_cli("package", model, "--device", extra[0] if extra else "host", "-o", out, "-q", "--json", *extra[1:])
    assert result.code == 0, result.stderr
    return Path(json.loads(result.stdout)["bundle_dir"])


def _run(bundle: Path, image: np.ndarray, tmp_path: Path) -> tuple[dict[str, np.ndarray], dict]:
    np.save(tmp_path / "image.npy", image)
    proc = run_py(bundle, "--input", f"image={tmp_path / 'image.npy'}", "--output", str(tmp_path / "out.npz"))
    assert proc.returncode == 0, proc.stderr
    summary = run_py(bundle, "--input", f"image={tmp_path / 'image.npy'}", "--json")
    assert summary.returncode == 0, summary.stderr
    with np.load(tmp_path / "out.npz") as out:
        return {k: out[k] for k in out.files}, json.loads(summary.stdout)


@pytest.mark.parametrize("style", ["torch", "helper"])
def test_detector_matches_onnxruntime_on_the_real_rows(detectors, style, tmp_path):
    bundle = _package(detectors[style], tmp_path / "out")
    manifest = json.loads((bundle / "manifest.json").read_text())
    outputs = {o["name"]: o for o in manifest["outputs"]}
    assert manifest["reference_check"]["result"] == "passed"
    selected_name, boxes_name = ("selected", "boxes") if style == "torch" else ("selected", "kept")
    rows = outputs[selected_name]["rows"]
    assert rows["count"] == "selected_count" and rows["axis"] == 0
    assert outputs[boxes_name]["rows"]["count"] == "selected_count"
    assert outputs["selected_count"]["shape"] == [1] and outputs["selected_count"]["dtype"] == "int64"
    counts = []
    for image in _images(4):
        got, summary = _run(bundle, image, tmp_path)
        want_selected, want_boxes = _ort(detectors[style], image)
        real = int(got["selected_count"][0])
        counts.append(real)
        assert real == len(want_selected)
        assert summary[selected_name]["rows"] == real and summary[boxes_name]["rows"] == real
        np.testing.assert_array_equal(got[selected_name][:real], want_selected)
        assert (got[selected_name][real:] == -1).all()
        np.testing.assert_allclose(got[boxes_name][:real], want_boxes, rtol=1e-5, atol=1e-4)
    assert max(counts) > 0 and len(set(counts)) > 1  # the inputs select something, and not always the same amount


def test_node_tests_every_nms_case():
    tests = node_tests.node_tests({"NonMaxSuppression"}, every_case=True)
    assert len(tests) >= 10
    found = node_tests.run_all(tests, ["edgeq"], jobs=2, timeout=300)
    failed = {name: r["edgeq"].message for name, r in found.items() if r["edgeq"].cls != "pass"}
    assert not failed


def test_max_detections_keeps_the_first_rows(detectors, tmp_path):
    bundle = _package(detectors["helper"], tmp_path / "out", "host", "--max-detections", "4")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {o["name"]: o["shape"] for o in manifest["outputs"]}["selected"] == [4, 3]
    assert manifest["build"]["args"]["max_detections"] == 4
    for image in _images(3):
        got, _ = _run(bundle, image, tmp_path)
        want = _ort(detectors["helper"], image)[0]
        real = int(got["selected_count"][0])
        assert real == min(4, len(want))
        np.testing.assert_array_equal(got["selected"][:real], want[:real])


def test_native_loader_reports_the_real_rows(detectors, tmp_path):
    bundle = _package(detectors["helper"], tmp_path / "out", "host", "--runtime", "bundled")
    image = _images(1)[0]
    np.save(tmp_path / "image.npy", image)
    native = subprocess.run([str(bundle / "runtime" / "edgeq-run"), "--input", f"image={tmp_path / 'image.npy'}", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=bundle)
    assert native.returncode == 0, native.stderr
    python = run_py(bundle, "--input", f"image={tmp_path / 'image.npy'}", "--json")
    assert json.loads(native.stdout) == json.loads(python.stdout)
    assert json.loads(native.stdout)["selected"]["rows"] == len(_ort(detectors["helper"], image)[0])
    text = subprocess.run([str(bundle / "runtime" / "edgeq-run"), "--input", f"image={tmp_path / 'image.npy'}"],
                          capture_output=True, text=True, timeout=300, cwd=bundle)
    assert "real rows)" in text.stdout
    # a manifest whose count names no output is refused by both loaders alike, before anything runs
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["outputs"][0]["rows"]["count"] = "nothing"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    native = subprocess.run([str(bundle / "runtime" / "edgeq-run"), "--self-test"], capture_output=True, text=True,
                            timeout=300, cwd=bundle)
    python = run_py(bundle, "--self-test")
    assert native.returncode == python.returncode == 7, (native.stderr, python.stderr)
    for err in (native.stderr, python.stderr):
        assert "outputs[0].rows.count" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_orin_builds(detectors, tmp_path):
    """The selection is plain TIR: the CUDA backend schedules it like any other function (built here for sm_87;
    what the GPU computes is checked where one is lent)."""
    for style in ("torch", "helper"):
        bundle = _package(detectors[style], tmp_path / f"orin-{style}", "jetson-orin-nano")
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert manifest["device"]["cuda_arch"] == "sm_87"
        assert manifest["reference_check"]["result"] == "passed"
        assert any(o.get("rows") for o in manifest["outputs"])
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, image=np.concatenate(_images(16)))
    bundle = _package(detectors["torch"], tmp_path / "orin-int8", "jetson-orin-nano", "--precision", "int8",
                      "--calibrate", str(calibration))
    assert json.loads((bundle / "manifest.json").read_text())["precision"] == "int8"


def test_int8_is_judged_on_what_nms_selects_from(detectors, tmp_path):
    """An int8 detector's quantization is measured on the boxes and scores NonMaxSuppression selects from (the
    selected rows of a float and an int8 build differ in which boxes, not by how much), and its build is
    checked against its own quantized graph on the real rows."""
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, image=np.concatenate(_images(16)))
    bundle = _package(detectors["torch"], tmp_path / "out", "host", "--precision", "int8", "--calibrate", str(calibration))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["quantization"]["evaluation"]["cosine"] > 0.999
    assert manifest["reference_check"]["result"] == "passed" and "quantized graph" in manifest["reference_check"]["graph"]
    assert run_py(bundle, "--self-test").returncode == 0


def _mixing_model(path: Path, op: str) -> Path:
    """NonMaxSuppression whose selected rows go into ``op`` (TopK or ReduceSum), which would mix padded rows
    with real ones."""
    rng = np.random.default_rng(0)
    boxes = numpy_helper.from_array(rng.uniform(0, 10, (1, 8, 4)).astype("float32"), "boxes")
    inits = [boxes, numpy_helper.from_array(np.array([3], "int64"), "max_out"),
             numpy_helper.from_array(np.array([1], "int64"), "k")]
    column = helper.make_node("Cast", ["selected"], ["as_float"], to=TensorProto.FLOAT)
    last = helper.make_node("TopK", ["as_float", "k"], ["top", "where"], axis=0) if op == "TopK" else \
        helper.make_node("ReduceSum", ["as_float"], ["top"], keepdims=0)
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out"], ["selected"], name="nms"), column, last]
    graph = helper.make_graph(nodes, "mix", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 8])],
                              [helper.make_tensor_value_info("top", TensorProto.FLOAT, ["n", 3] if op == "TopK" else [])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


@pytest.mark.parametrize("op", ["TopK", "ReduceSum"])
def test_an_op_that_mixes_the_rows_is_refused_in_one_line(op, tmp_path):
    result = run_cli("package", _mixing_model(tmp_path / "mix.onnx", op), "--device", "host", "-o", tmp_path / "out", "-q")
    assert result.code != 0
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and op in line and "NonMaxSuppression 'nms'" in line and "count" in line
    assert not (tmp_path / "out").exists()


def test_a_zero_bound_is_refused(tmp_path):
    model = helper_detector(tmp_path / "zero.onnx", max_out=0)
    result = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "-q")
    assert result.code != 0 and "selects nothing" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_nms_inside_a_branch_is_refused_in_one_line(tmp_path):
    """NonMaxSuppression in an If's branch cannot be padded (its count is an output of the main graph): one
    line naming the node, nothing written. ONNX Runtime runs the model (it is valid ONNX)."""
    boxes = numpy_helper.from_array(np.random.default_rng(1).uniform(0, 10, (1, 8, 4)).astype("float32"), "boxes")
    branch = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out"], ["picked"], name="branch_nms")],
        "then", [], [helper.make_tensor_value_info("picked", TensorProto.INT64, ["n", 3])])
    other = helper.make_graph(
        [helper.make_node("Constant", [], ["none"], value=numpy_helper.from_array(np.zeros((0, 3), "int64")))],
        "else", [], [helper.make_tensor_value_info("none", TensorProto.INT64, ["n", 3])])
    nodes = [helper.make_node("ReduceMax", ["scores"], ["top"], keepdims=0),
             helper.make_node("Greater", ["top", "half"], ["any"]),
             helper.make_node("If", ["any"], ["selected"], then_branch=branch, else_branch=other, name="when")]
    inits = [boxes, numpy_helper.from_array(np.array([3], "int64"), "max_out"),
             numpy_helper.from_array(np.array(0.5, "float32"), "half")]
    graph = helper.make_graph(nodes, "branch", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, 8])],
                              [helper.make_tensor_value_info("selected", TensorProto.INT64, ["n", 3])], inits)
    path = tmp_path / "branch.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    scores = np.linspace(0.1, 0.9, 8, dtype=np.float32).reshape(1, 1, 8)
    assert onnxruntime_session(str(path)).run(None, {"scores": scores})[0].shape[1] == 3
    result = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q")
    line = result.stderr.strip()
    assert result.code != 0 and len(line.splitlines()) == 1, result.stderr
    assert "NonMaxSuppression node 'branch_nms'" in line and "If/Loop branch" in line
    assert not (tmp_path / "out").exists()


def test_selection_matches_onnxruntime_on_random_boxes():
    """The TIR selection alone against ONNX Runtime: both box formats, flipped corners, ties, with and without
    a score threshold, limits below and above the number of boxes."""
    from edgeq import nms
    from edgeq.tvm_env import tvm

    rng = np.random.default_rng(0)
    cpu = tvm.cpu()
    for trial in range(24):
        batches, classes, count = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 40))
        center = trial % 2
        xy, wh = rng.uniform(0, 10, (batches, count, 2)), rng.uniform(0.5, 4, (batches, count, 2))
        boxes = np.concatenate([xy, xy + wh if center == 0 else wh], -1).astype("float32")
        if center == 0 and trial % 4 == 0:
            boxes = boxes[..., [2, 3, 0, 1]]
        scores = rng.uniform(0, 1, (batches, classes, count)).astype("float32")
        if trial % 3 == 0:
            scores = np.round(scores * 4) / 4
        limit, iou = int(rng.integers(1, 50)), float(rng.uniform(0.1, 0.9))
        threshold = None if trial % 4 == 1 else float(rng.uniform(0, 0.7))
        names = ["boxes", "scores", "limit", "iou"] + (["threshold"] if threshold is not None else [])
        inits = [numpy_helper.from_array(np.array([limit], "int64"), "limit"),
                 numpy_helper.from_array(np.array([iou], "float32"), "iou")]
        if threshold is not None:
            inits.append(numpy_helper.from_array(np.array([threshold], "float32"), "threshold"))
        graph = helper.make_graph(
            [helper.make_node("NonMaxSuppression", names, ["selected"], center_point_box=center)], "nms",
            [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, boxes.shape),
             helper.make_tensor_value_info("scores", TensorProto.FLOAT, scores.shape)],
            [helper.make_tensor_value_info("selected", TensorProto.INT64, None)], inits)
        session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        want = session.run(None, {"boxes": boxes, "scores": scores})[0]

        per_class, rows = nms.bound(batches, classes, count, limit, None)
        module = tvm.IRModule({
            "select": nms.select_func(batches, classes, count, per_class, center, threshold is not None)
            .with_attr("global_symbol", "select"),
            "collect": nms.collect_func(batches, classes, per_class, rows).with_attr("global_symbol", "collect")})
        lib = tvm.compile(module, target="llvm")
        pairs = batches * classes

        def t(value):
            return tvm.runtime.tensor(np.ascontiguousarray(value), cpu)

        keep, kept = t(np.zeros((pairs, per_class), "int32")), t(np.zeros(pairs, "int32"))
        lib["select"](t(boxes), t(scores), t(np.array([limit], "int64")), t(np.array([iou], "float32")),
                      t(np.array([threshold or 0.0], "float32")), keep, kept, t(np.zeros((2, pairs, count), "int32")))
        selected, real = t(np.zeros((rows, 3), "int64")), t(np.zeros(1, "int64"))
        lib["collect"](keep, kept, selected, real)
        real = int(real.numpy()[0])
        assert real == len(want), trial
        np.testing.assert_array_equal(selected.numpy()[:real], want, err_msg=f"trial {trial}")
        assert (selected.numpy()[real:] == -1).all()


def test_bound():
    from edgeq import nms

    assert nms.bound(1, 80, 8400, 100, None) == (100, 8000)
    assert nms.bound(1, 80, 8400, 100, 300) == (100, 300)
    assert nms.bound(2, 1, 50, 2**63 - 1, None) == (50, 100)  # torchvision's "no limit" is bounded by the boxes
    assert nms.bound(1, 3, 50, None, None) == (50, 150)  # a limit computed at run time: the boxes
    assert nms.bound(1, 3, 50, -4, None) == (0, 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
