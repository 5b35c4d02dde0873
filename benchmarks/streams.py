"""Video through a bundle, side by side in one run: the README's YOLO-style detector (at 320x320 input by default)
on a 300-frame 640x480 video,
with both loaders (run.py, edgeq-run), pipelined (the next frames decoded and prepared while the model runs) and
one frame after the other (--no-pipeline). Reports frames per second, the pipelined/sequential ratio and the
per-stage p50 (decode, preprocess, infer, post-process), as each loader measures them. The runs are interleaved in
rounds, so a noisy machine slows all of them alike; the median frames/s per run is reported.

    python benchmarks/streams.py [--frames 300] [--rounds 3] [--codec mjpeg|h264] [--size 320] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from common import report

import make_models  # noqa: E402  (common puts examples/ on the path)

WIDTH, HEIGHT, FPS = 640, 480, 30


def make_video(out: Path, frames: int, codec: str) -> Path:
    """The detector example's street scene at 640x480, panning sideways, encoded by gst-launch-1.0."""
    street = make_models.street_image(out / "street.png")
    image = np.asarray(Image.open(street).convert("RGB").resize((WIDTH, HEIGHT), Image.BILINEAR))
    folder = out / "frames"
    folder.mkdir()
    for i in range(frames):
        Image.fromarray(np.roll(image, 4 * i, axis=1)).save(folder / f"f_{i:04d}.png", compress_level=1)
    encode = ["jpegenc", "!", "avimux"] if codec == "mjpeg" else ["x264enc", "!", "mp4mux"]
    video = out / ("street.avi" if codec == "mjpeg" else "street.mp4")
    subprocess.run(["gst-launch-1.0", "-q", "multifilesrc", f"location={folder}/f_%04d.png", "index=0",
                    f"stop-index={frames - 1}", f"caps=image/png,framerate={FPS}/1", "!", "pngdec", "!", "videoconvert",
                    "!", *encode, "!", "filesink", f"location={video}"], check=True)
    return video


def run(bundle: Path, loader: str, video: Path, pipelined: bool) -> dict:
    cmd = [sys.executable, "run.py"] if loader == "run.py" else ["./runtime/edgeq-run"]
    cmd += ["--input", str(video), "--json"] + ([] if pipelined else ["--no-pipeline"])
    proc = subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", choices=["mjpeg", "h264"], default="mjpeg")
    parser.add_argument("--size", type=int, default=320, help="the detector's input side (the example's is 128)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("gst-launch-1.0") is None:
        sys.exit("streams.py needs GStreamer's gst-launch-1.0 (scripts/setup.sh --tests installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        import onnx

        model, labels = out / "yolo.onnx", out / "labels.txt"
        onnx.save_model(make_models.yolo_cnn(size=args.size), model)
        labels.write_text("".join(f"{label}\n" for label in make_models.YOLO_LABELS))
        video = make_video(out, args.frames, args.codec)
        street = out / "street.png"
        built = subprocess.run([sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "-o",
                                str(out / "bundle"), "--preprocess", "fit=letterbox", "--postprocess", "yolo", "--labels",
                                str(labels), "--golden-input", str(street), "-q", "--json"],
                               capture_output=True, text=True, check=True)
        bundle = Path(json.loads(built.stdout)["bundle_dir"])
        cases = [(loader, pipelined) for loader in ("run.py", "edgeq-run") for pipelined in (True, False)]
        results: dict = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case in cases:
                results[case].append(run(bundle, case[0], video, case[1]))
    rows = []
    for loader in ("run.py", "edgeq-run"):
        fps = {p: statistics.median(s["fps"] for s in results[(loader, p)]) for p in (True, False)}
        for pipelined in (True, False):
            last = results[(loader, pipelined)][-1]
            stages = last["stages"]
            rows.append({
                "loader": loader, "pipelined": pipelined, "frames": last["frames"], "dropped": last["dropped"],
                "frames/s": round(fps[pipelined], 1),
                "vs sequential": round(fps[pipelined] / fps[False], 2),
                **{f"{stage} p50 ms": stages[stage]["p50_ms"] for stage in ("decode", "preprocess", "infer", "postprocess")},
            })
    report(f"{args.frames} frames {WIDTH}x{HEIGHT} ({args.codec}), YOLO-style detector {args.size}x{args.size}, host CPU, median of "
           f"{args.rounds} rounds", rows, args.json)


if __name__ == "__main__":
    main()
