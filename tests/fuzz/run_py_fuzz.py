"""Fuzz targets for run.py's readers of what a user or a bundle hands it (#66 item 7), the Python twin of
edgeq_run_fuzz.cc: the same targets, fed the same bytes the same way, so that each corpus seeds the other.

    manifest  manifest.json through safebundle.parse_manifest (every field) and the contract's checks on it
    npy       an --input .npy through contract.read_npy
    png, jpeg an --input image through imaging.decode_image (PNG chunks, libpng/Pillow, libturbojpeg), then
              imaging.image_tensor (letterbox RGB NCHW and stretch BGR NHWC)
    yolo      a detector's outputs (head and selected rows, their shapes from the first bytes, as in
              edgeq_run_fuzz.cc) through imaging.yolo, and a classifier's through imaging.classify
    video     an --input string through video.stream_input and video.describe: the pipeline description must
              quote a file or URL so that gst_parse_launch reads back exactly what was given

A refusal (the reader's own error: ContractError, BundleRefused, ImageError, VideoError) is the right answer to
bad input; any other exception is a finding.

    pip install atheris
    python tests/fuzz/run_py_fuzz.py TARGET [libFuzzer options] [CORPUS...]   fuzz (benchmarks/fuzz.sh --python)
    run_one(TARGET, data)                                                      one input (tests/test_fuzz_corpus.py)
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import tempfile

import numpy as np

TARGETS = ("manifest", "npy", "png", "jpeg", "yolo", "video")


def _modules():
    from edgeq.templates import contract, imaging, safebundle, video

    return contract, imaging, safebundle, video


def _scratch() -> str:
    folder = getattr(_scratch, "folder", None)
    if folder is None:
        folder = _scratch.folder = tempfile.mkdtemp(prefix="edgeq-pyfuzz-")
    return folder


def _letterboxed(contract, side: int):
    return contract.PreprocessRecord(input="x", height=side, width=side, resize="letterbox", order="RGB",
                                     layout="NCHW", scale=255.0, mean=[0.0], std=[1.0])


def _image(data: bytes, name: str) -> None:
    contract, imaging, _, _ = _modules()
    path = os.path.join(_scratch(), name)
    with open(path, "wb") as f:
        f.write(data)
    try:
        pixels = imaging.decode_image(np, path)
    except (imaging.ImageError, OSError):
        return
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] in (1, 3), pixels.shape
    imaging.image_tensor(np, pixels, _letterboxed(contract, 16))
    stretch = dataclasses.replace(_letterboxed(contract, 12), resize="stretch", order="BGR", layout="NHWC",
                                  mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2])
    tensor = imaging.image_tensor(np, pixels, stretch)
    assert tensor.shape == (1, 12, 12, 3), tensor.shape


def _answers(data: bytes) -> None:
    """edgeq_run_fuzz.cc's ``Answers``: the first 8 bytes choose the shapes (head [1, 4 + classes, anchors], rows
    [bound, 3]) and how many rows are real; the rest fills the two tensors, cycled. The image's size is given only
    where both its sides are non-zero (a decoded image has at least one pixel; run.py passes None for a tensor)."""
    contract, imaging, _, _ = _modules()
    if len(data) < 8:
        return
    classes, anchors, bound = 1 + data[0] % 6, 1 + data[1] % 40, 1 + data[2] % 8
    real = data[3] % (bound + 2) - 1
    dtype = np.float32 if data[4] % 2 else np.float16
    head_bytes = (4 + classes) * anchors * np.dtype(dtype).itemsize
    rest = data[8:] or b"\0"
    stream = (rest * (-(-(head_bytes + bound * 24) // len(rest))))[: head_bytes + bound * 24]
    head = np.frombuffer(stream[:head_bytes], dtype).reshape(1, 4 + classes, anchors)
    rows = np.frombuffer(stream[head_bytes:], "<i8").reshape(bound, 3)
    labels = ["person", '"quoted"\n']
    post = contract.PostprocessRecord(kind="yolo", output="head", top_k=0, softmax=False, labels=labels,
                                      selected="rows", classes=classes, max_det=1 + data[5] % 10, conf=0.25, iou=0.45)
    image_hw = (data[6] * 7, data[7] * 5) if data[6] and data[7] else None
    clipped = max(0, min(real, bound))
    with np.errstate(all="ignore"):  # any float the head holds: infinities and NaNs are answers, not errors
        try:
            found = imaging.yolo(np, {"head": head, "rows": rows}, post, clipped, _letterboxed(contract, 32), image_hw)
            assert len(found) <= post.max_det
            imaging.describe_detections(found)
        except imaging.ImageError:
            pass
        top = contract.PostprocessRecord(kind="classify", output="head", top_k=1 + data[5] % 5, softmax=bool(data[6] % 2),
                                         labels=labels)
        best = imaging.classify(np, head, top)
        assert len(best) == min(top.top_k, head.size)
        imaging.describe_top(best)


def _unquote(text: str, start: int) -> tuple[str, int]:
    """The value of a double-quoted gst_parse_launch string at ``text[start]`` (backslash escapes), and where it ends."""
    assert text[start] == '"', text
    out, k = [], start + 1
    while text[k] != '"':
        if text[k] == "\\":
            k += 1
        out.append(text[k])
        k += 1
    return "".join(out), k + 1


def _video(data: bytes) -> None:
    _, _, _, video = _modules()
    spec = data.decode("utf-8", "surrogateescape")
    found = video.stream_input(spec)
    if found is None:
        return
    _, source = found
    for have in (lambda element: True, lambda element: False):
        try:
            description, shown = video.describe(source, have)
        except video.VideoError:
            continue
        sink = description.rsplit("!", 1)[-1]
        assert sink.strip().startswith("appsink name=%s " % video.SINK_NAME) and "caps=%s" % video.RGB_CAPS in sink, description
        if source.startswith(("rtsp://", "rtsps://")):
            assert _unquote(description, description.index('uri="') + 4)[0] == source, description
        elif not source.startswith(("gst:", "csi://", "/dev/video")):
            assert _unquote(description, description.index('location="') + 9)[0] == source, description


def run_one(target: str, data: bytes) -> None:
    """One input through ``target``; returns where the reader took it or refused it, raises otherwise."""
    contract, _, safebundle, _ = _modules()
    if target == "manifest":
        try:
            manifest = safebundle.parse_manifest(data)
        except safebundle.BundleRefused:
            return
        contract.process_problem(manifest)
        if manifest.outputs:
            contract.rows_problem(manifest.outputs)
    elif target == "npy":
        try:
            dtype, shape, raw, _ = contract.read_npy(io.BytesIO(data), 1 << 20)
        except contract.ContractError:
            return
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        assert len(raw) == count * np.dtype(dtype).itemsize, (dtype, shape, len(raw))
    elif target in ("png", "jpeg"):
        _image(data, "input.png" if target == "png" else "input.jpg")
    elif target == "yolo":
        _answers(data)
    elif target == "video":
        _video(data)
    else:
        raise ValueError(f"unknown target {target!r} ({', '.join(TARGETS)})")


def main() -> None:
    import atheris

    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: run_py_fuzz.py TARGET [libFuzzer options] [CORPUS...]; TARGET one of {', '.join(TARGETS)}")
    target = sys.argv.pop(1)
    # libFuzzer runs argv[0] again for -merge and -fork: an executable that is this interpreter, script and target
    wrapper = os.path.join(_scratch(), "run_py_fuzz-" + target)
    with open(wrapper, "w") as f:
        f.write('#!/bin/sh\nexec "%s" "%s" %s "$@"\n' % (sys.executable, os.path.abspath(__file__), target))
    os.chmod(wrapper, 0o755)
    sys.argv[0] = wrapper
    os.environ["EDGEQ_TRUSTED_KEY"] = "/nonexistent/edgeq-fuzz.pub"
    _modules()
    atheris.instrument_all()  # (instrument_imports misses modules found through an editable install's finder)

    def one(data: bytes) -> None:
        run_one(target, data)

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
