"""From an image to an answer: what a bundle records of its pre- and post-processing (``--preprocess``,
``--postprocess``), for its loaders to apply (``imaging.image_tensor``, ``imaging.classify``)."""

from __future__ import annotations

from pathlib import Path

from edgeq.templates import contract
from edgeq.errors import ModelError, UsageError
from edgeq.templates.contract import TensorSpec

POSTPROCESS_CHOICES = ("classify", "yolo")
YOLO_PREFIX = "edgeq_yolo_"
MASK_COEFFICIENTS = 32  # ultralytics -seg heads: 32 mask coefficients after the class scores
MAX_LABELS_BYTES = 16 << 20


def read_labels(path: Path) -> list[str]:
    """One label per line (a trailing empty line ignored); refused in one line when it cannot be used."""
    path = Path(path)
    try:
        if not path.is_file():
            raise UsageError(f"--labels {path} is not a file")
        if path.stat().st_size > MAX_LABELS_BYTES:
            raise UsageError(f"--labels {path} is larger than {MAX_LABELS_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--labels {path} is not UTF-8 text (one label per line)") from None
    except OSError as err:
        raise UsageError(f"cannot read --labels {path}: {err.strerror or err}") from None
    labels = [line.strip() for line in text.splitlines()]
    while labels and not labels[-1]:
        labels.pop()
    if not labels or len(labels) > contract.MAX_LABELS:
        raise UsageError(f"--labels {path} has {len(labels)} labels; give 1 to {contract.MAX_LABELS}, one per line")
    return labels


def check_args(postprocess: str | None, labels: Path | None, top_k: int, conf: float = 0.25, iou: float = 0.45,
               max_det: int = 300) -> list[str]:
    """The post-processing options, checked before any work; returns the labels."""
    if postprocess is not None and postprocess not in POSTPROCESS_CHOICES:
        raise UsageError(f"unknown --postprocess '{postprocess}'; choose one of: {', '.join(POSTPROCESS_CHOICES)}")
    if postprocess is None and labels is not None:
        raise UsageError("--labels needs --postprocess classify or yolo")
    if not 1 <= top_k <= 1000:
        raise UsageError("--top-k must be from 1 to 1000")
    if not (0.0 <= conf < 1.0 and 0.0 <= iou <= 1.0):
        raise UsageError("--conf must be in [0, 1) and --iou in [0, 1]")
    if not 1 <= max_det <= 100000:
        raise UsageError("--max-det must be from 1 to 100000")
    return read_labels(labels) if labels is not None else []


def preprocess_record(preprocess, inputs: list[TensorSpec]) -> contract.PreprocessRecord | None:
    """What run.py/edgeq-run ``--input IMAGE`` apply to the first input: recorded for float32 image inputs of
    batch 1 (a batch of B takes B images: give tensors there)."""
    if preprocess is None or not inputs:
        return None
    spec = inputs[0]
    record = preprocess.record(spec)
    if spec.dtype != "float32" or spec.shape[0] != 1:
        return None
    return record


def _yolo_head(onnx_model, labels: list[str]) -> tuple[str, int]:
    """(output name, classes) of the model's YOLO head: its first output, [1, 4 + classes (+ 32 mask
    coefficients where a second output holds the mask prototypes), anchors]."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(onnx_model)
    outputs = list(inferred.graph.output)
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in outputs[0].type.tensor_type.shape.dim]
    name = outputs[0].name
    if len(dims) != 3 or dims[0] != 1 or dims[1] < 5 or dims[2] < 1 or \
            outputs[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise ModelError(f"--postprocess yolo: output '{name}' ({'x'.join(map(str, dims)) or 'a scalar'}) is not a YOLO "
                         "head, float32 [1, 4 + classes, anchors] (ultralytics v8/11, exported without nms); package it "
                         "without --postprocess yolo")
    masks = MASK_COEFFICIENTS if len(outputs) > 1 and len(outputs[1].type.tensor_type.shape.dim) == 4 else 0
    classes = len(labels) if labels else dims[1] - 4 - masks
    if not 1 <= classes <= dims[1] - 4:
        raise UsageError(f"--labels has {len(labels)} labels; output '{name}' has room for {dims[1] - 4} class scores")
    return name, classes


def with_yolo_nms(onnx_model, labels: list[str], conf: float, iou: float, max_det: int):
    """The model with NonMaxSuppression after its YOLO head (``edgeq.nms`` pads and counts its rows): boxes
    [1, anchors, 4] as ultralytics' xywh, each anchor's best class only (ultralytics' single-label NMS),
    class-aware, above ``conf``, IoU above ``iou`` suppressed, ``max_det`` per class. Returns (model, the
    manifest's ``postprocess`` record for it)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    name, classes = _yolo_head(onnx_model, labels)
    opset = next((o.version for o in onnx_model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 11:
        raise ModelError(f"--postprocess yolo needs opset 11 or later (the model has {opset}); re-export it")
    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    p = YOLO_PREFIX
    consts = {"zero": np.array([0], "int64"), "four": np.array([4], "int64"), "end": np.array([4 + classes], "int64"),
              "axis1": np.array([1], "int64"), "max_out": np.array([max_det], "int64"),
              "iou": np.array([iou], "float32"), "conf": np.array([conf], "float32"), "nothing": np.array(0.0, "float32")}
    model.graph.initializer.extend(numpy_helper.from_array(v, p + k) for k, v in consts.items())
    reduce = (helper.make_node("ReduceMax", [p + "scores", p + "axis1"], [p + "best"], keepdims=1) if opset >= 18 else
              helper.make_node("ReduceMax", [p + "scores"], [p + "best"], axes=[1], keepdims=1))
    model.graph.node.extend([
        helper.make_node("Slice", [name, p + "zero", p + "four", p + "axis1"], [p + "xywh"]),
        helper.make_node("Transpose", [p + "xywh"], [p + "boxes"], perm=[0, 2, 1]),
        helper.make_node("Slice", [name, p + "four", p + "end", p + "axis1"], [p + "scores"]),
        reduce,
        helper.make_node("Equal", [p + "scores", p + "best"], [p + "is_best"]),
        helper.make_node("Where", [p + "is_best", p + "scores", p + "nothing"], [p + "single"]),
        helper.make_node("NonMaxSuppression", [p + "boxes", p + "single", p + "max_out", p + "iou", p + "conf"],
                         [p + "selected"], center_point_box=1, name=p + "nms"),
    ])
    model.graph.output.append(helper.make_tensor_value_info(p + "selected", onnx.TensorProto.INT64, ["rows", 3]))
    record = contract.PostprocessRecord(kind="yolo", output=name, top_k=1, softmax=False, labels=list(labels),
                                        selected=p + "selected", classes=classes, max_det=max_det, conf=conf, iou=iou)
    return model, record


def classify_record(labels: list[str], top_k: int, outputs: list[TensorSpec], onnx_model) -> contract.PostprocessRecord:
    """``classify``: the top-k classes of the first output, [1, classes] (or [1, classes, 1, 1]); softmax
    applied unless the model ends in Softmax."""
    spec = outputs[0]
    classes = 1
    for d in spec.shape[1:]:
        classes *= d
    if not spec.shape or spec.shape[0] != 1 or classes < 2 or classes != max(spec.shape[1:], default=0) \
            or not spec.dtype.startswith("float"):
        raise ModelError(f"--postprocess classify: output '{spec.name}' ({'x'.join(map(str, spec.shape))} "
                         f"{spec.dtype}) is not one row of class scores; package it without --postprocess")
    if labels and len(labels) != classes:
        raise UsageError(f"--labels has {len(labels)} labels; output '{spec.name}' has {classes} classes")
    producer = next((n for n in onnx_model.graph.node if spec.name in n.output), None)
    softmax = producer is None or producer.op_type != "Softmax"
    return contract.PostprocessRecord(kind="classify", output=spec.name, top_k=min(top_k, classes), softmax=softmax,
                                      labels=list(labels))
