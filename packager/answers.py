"""From an image to an answer: what a bundle records of its pre- and post-processing (``--preprocess``,
``--postprocess``), for its loaders to apply (``contract.image_tensor``, ``contract.classify``)."""

from __future__ import annotations

from pathlib import Path

from edgeq import contract
from edgeq.errors import ModelError, UsageError
from edgeq.load import TensorSpec

POSTPROCESS_CHOICES = ("classify",)
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


def check_args(postprocess: str | None, labels: Path | None, top_k: int) -> list[str]:
    """The post-processing options, checked before any work; returns the labels."""
    if postprocess is not None and postprocess not in POSTPROCESS_CHOICES:
        raise UsageError(f"unknown --postprocess '{postprocess}'; choose one of: {', '.join(POSTPROCESS_CHOICES)}")
    if postprocess is None and labels is not None:
        raise UsageError("--labels needs --postprocess classify")
    if not 1 <= top_k <= 1000:
        raise UsageError("--top-k must be from 1 to 1000")
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


def postprocess_record(kind: str | None, labels: list[str], top_k: int, outputs: list[TensorSpec],
                       onnx_model) -> contract.PostprocessRecord | None:
    """``classify``: the top-k classes of the first output, [1, classes] (or [1, classes, 1, 1]); softmax
    applied unless the model ends in Softmax."""
    if kind is None:
        return None
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
    return contract.PostprocessRecord(kind=kind, output=spec.name, top_k=min(top_k, classes), softmax=softmax,
                                      labels=list(labels))
