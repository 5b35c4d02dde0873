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
