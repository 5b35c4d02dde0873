"""--precision mixed judged by the answer (#41 item 2): with --postprocess yolo the accuracy budget is spent on the
boxes fp32 finds that int8 loses (matched at IoU 0.5, same class), after the same selection the bundle makes;
checked here against ONNX Runtime's NonMaxSuppression, and end to end through edgeq package."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper

import make_models
from conftest import run_cli

from edgeq.answers import YOLO_PREFIX, with_yolo_nms
from edgeq.quantize import judge
from edgeq.reference import onnxruntime_session


def _with_nms(conf: float = 0.05, iou: float = 0.45, max_det: int = 7) -> onnx.ModelProto:
    return with_yolo_nms(make_models.yolo_cnn(), ["a", "b", "c", "d"], conf, iou, max_det)[0]


def test_the_judges_selection_is_onnxruntimes_nms():
    """judge.detections on the boxes and scores NonMaxSuppression selects from keeps what ONNX Runtime's
    NonMaxSuppression keeps: the same classes and boxes, every one."""
    task = judge.Task("yolo", conf=0.05, iou=0.45, max_det=7)
    model = _with_nms(task.conf, task.iou, task.max_det)
    for name in (YOLO_PREFIX + "boxes", YOLO_PREFIX + "single"):
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = onnxruntime_session(model.SerializeToString())
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(3)
    total = 0
    for _ in range(6):
        image = rng.uniform(0, 1, (1, 3, 128, 128)).astype(np.float32)
        out = dict(zip(names, session.run(None, {"images": image})))
        boxes, scores = out[YOLO_PREFIX + "boxes"], out[YOLO_PREFIX + "single"]
        selected = out[YOLO_PREFIX + "selected"]
        xywh = boxes[0].astype(np.float64)
        want = sorted((int(c), tuple(np.round(np.concatenate([xywh[b, :2] - xywh[b, 2:] / 2, xywh[b, :2] + xywh[b, 2:] / 2]), 4)))
                      for _, c, b in selected)
        got = sorted((c, tuple(np.round(box, 4))) for c, _, box in judge.detections(boxes, scores, task))
        assert got == want
        total += len(want)
    assert total >= 12  # the comparison had boxes to compare


def test_boxes_matched_counts_what_the_candidate_keeps():
    box = np.array([0.0, 0.0, 10.0, 10.0])
    ref = [(0, 0.9, box), (1, 0.8, box), (0, 0.7, box + 50)]
    assert judge.boxes_matched(ref, ref) == 3
    assert judge.boxes_matched(ref, [(0, 0.5, box + 1)]) == 1  # IoU 81/119 >= 0.5, same class
    assert judge.boxes_matched(ref, [(1, 0.5, box + 4)]) == 0  # IoU 36/164 < 0.5
    assert judge.boxes_matched(ref, [(2, 0.9, box)]) == 0  # another class
    assert judge.boxes_matched(ref, [(0, 0.9, box)] * 1) == 1  # one candidate matches one reference box


def test_mixed_precision_spends_its_budget_on_boxes(tmp_path):
    """--postprocess yolo: the report says which share of fp32's boxes int8 keeps, and --accuracy-budget 0 returns
    layers to float until none is lost."""
    path = tmp_path / "yolo.onnx"
    onnx.save(make_models.yolo_cnn(), path)
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "calib.npz", images=rng.uniform(0, 1, (16, 3, 128, 128)).astype(np.float32))
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--json", "--postprocess", "yolo",
                  "--conf", "0.05", "--precision", "mixed", "--accuracy-budget", "0", "--calibrate", tmp_path / "calib.npz")
    assert res.code == 0, res.stderr
    manifest = json.loads((tmp_path / "out" / "yolo-host" / "manifest.json").read_text())
    evaluation = manifest["quantization"]["evaluation"]
    assert evaluation["budget_metric"] == "fp32 boxes lost (%)", evaluation
    assert evaluation["boxes_fp32"] >= 16 and evaluation["boxes_kept_pct"] == 100 and evaluation["budget_met"]
    assert evaluation["budget_value"] == 0


def _close_call_classifier(path):
    """Ten classes whose weights differ by far less than an int8 weight step (a close call on every input): int8
    rounding moves the top-1 class on many inputs while the logits' cosine against fp32 stays near 1."""
    rng = np.random.default_rng(11)
    base = rng.standard_normal((192, 1)).astype(np.float32)
    w = base + 2e-3 * rng.standard_normal((192, 10)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("MatMul", ["f", "w"], ["logits"])], "close_call",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 10])],
        [onnx.numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    np.savez(path.parent / "calib.npz", x=rng.uniform(0, 1, (32, 3, 8, 8)).astype(np.float32))
    return path


def test_int8_that_loses_the_answer_says_so(tmp_path):
    """Plain int8 with --postprocess: the answer lost is judged (top-1 changed here) and reported beside the cosine;
    past --max-answer-loss (default 5%) one warning line names it and the command that keeps it, and
    --strict-accuracy makes it an error with no bundle written (#66 item 1). Before, the cosine was all there was."""
    model = _close_call_classifier(tmp_path / "close_call.onnx")
    common = ["--device", "host", "--postprocess", "classify", "--precision", "int8", "--calibrate",
              tmp_path / "calib.npz", "-q", "--json"]
    res = run_cli("package", model, "-o", tmp_path / "warned", *common)
    assert res.code == 0, res.stderr
    evaluation = json.loads((tmp_path / "warned" / "close_call-host" / "manifest.json").read_text())["quantization"]["evaluation"]
    assert evaluation["answer_metric"] == "top-1 changed (% of samples)" and evaluation["answer_loss"] > 5, evaluation
    assert evaluation["cosine"] > 0.99, evaluation  # what the report said before: nothing looked wrong
    warnings = [line for line in res.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "changes the top-1 class of" in warnings[0] and "--max-answer-loss 5" in warnings[0], res.stderr
    assert "--precision mixed --accuracy-budget 5" in warnings[0]
    # --strict-accuracy: the same line as an error, exit non-zero, nothing written
    res = run_cli("package", model, "-o", tmp_path / "strict", "--strict-accuracy", *common)
    assert res.code == 3 and len(res.stderr.strip().splitlines()) == 1 and "top-1 class" in res.stderr, res.stderr
    assert not (tmp_path / "strict").exists() or not any((tmp_path / "strict").iterdir())
    # a limit it is within: no warning; the loss is still reported
    res = run_cli("package", model, "-o", tmp_path / "within", "--max-answer-loss", "100", "--strict-accuracy", *common)
    assert res.code == 0 and "warning" not in res.stderr, res.stderr
    # the mixed precision it points to holds the answer (the budget decides; no warning)
    res = run_cli("package", model, "-o", tmp_path / "mixed", *common[:4], "--precision", "mixed", "--accuracy-budget",
                  "5", *common[6:])
    assert res.code == 0 and "warning" not in res.stderr, res.stderr
    evaluation = json.loads((tmp_path / "mixed" / "close_call-host" / "manifest.json").read_text())["quantization"]["evaluation"]
    assert evaluation["answer_loss"] <= 5 and evaluation["budget_met"], evaluation
