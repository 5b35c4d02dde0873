"""What ``--precision mixed --accuracy-budget`` is judged by: the answer a user gets, where ``--postprocess`` says
what that is, not a whole-tensor cosine (a YOLO head at cosine 0.9994 kept half of fp32's boxes).

- ``yolo``: the boxes int8 keeps of fp32's, matched at IoU 0.5 with the same class, after the same selection the
  bundle makes (each anchor's best class, above ``conf``, class-aware NMS at ``iou``, ``max_det`` per class);
- ``classify``: top-1 changes against fp32 (top-1 drop against labels when ``--eval`` has them: the caller's);
- otherwise the worst relative error over the outputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BOX_MATCH_IOU = 0.5


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # "yolo" or "classify"
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 300

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with each of ``others`` [n, 4]."""
    x1 = np.maximum(box[0], others[:, 0])
    y1 = np.maximum(box[1], others[:, 1])
    x2 = np.minimum(box[2], others[:, 2])
    y2 = np.minimum(box[3], others[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def detections(boxes: np.ndarray, scores: np.ndarray, task: Task) -> list[tuple[int, float, np.ndarray]]:
    """(class, score, xyxy box) that the bundle's NonMaxSuppression keeps, from what it selects from: ``boxes``
    [1, anchors, 4] xywh (centre), ``scores`` [1, classes, anchors] (each anchor's best class, the others 0)."""
    xywh = boxes.reshape(-1, 4).astype(np.float64)
    xyxy = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], axis=1)
    s = scores.reshape(scores.shape[-2], -1).astype(np.float64)
    out = []
    for c in range(s.shape[0]):
        idx = np.flatnonzero(s[c] > task.conf)
        idx = idx[np.argsort(-s[c, idx], kind="stable")]
        kept: list[int] = []
        for i in idx:
            if len(kept) >= task.max_det:
                break
            if not kept or (_iou(xyxy[i], xyxy[kept]) <= task.iou).all():
                kept.append(int(i))
        out += [(c, float(s[c, i]), xyxy[i]) for i in kept]
    return out


def boxes_matched(reference: list, candidate: list) -> int:
    """How many of ``reference``'s detections ``candidate`` has: same class, IoU >= 0.5, each used once, the
    reference's best first."""
    used = np.zeros(len(candidate), bool)
    matched = 0
    for c, _, box in sorted(reference, key=lambda d: -d[1]):
        best, best_iou = -1, BOX_MATCH_IOU
        for j, (cj, _, other) in enumerate(candidate):
            if used[j] or cj != c:
                continue
            iou = float(_iou(box, other[None])[0])
            if iou >= best_iou:
                best, best_iou = j, iou
        if best >= 0:
            used[best] = True
            matched += 1
    return matched


def boxes_kept(reference_runs: list[list[np.ndarray]], candidate_runs: list[list[np.ndarray]], task: Task) -> dict:
    """{boxes_fp32, boxes_kept_pct}: over the evaluation runs, each a [boxes, scores] pair (``selection_inputs``)."""
    total = kept = 0
    for ref, cand in zip(reference_runs, candidate_runs):
        want = detections(ref[0], ref[1], task)
        total += len(want)
        kept += boxes_matched(want, detections(cand[0], cand[1], task))
    return {"boxes_fp32": total, "boxes_kept_pct": 100.0 * kept / total if total else 100.0}
