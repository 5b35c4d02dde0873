"""Seed inputs for edgeq-run's fuzz targets (benchmarks/fuzz.sh): real manifests of packaged bundles, .npy files
numpy writes, PNG and JPEG files Pillow writes, and detector outputs. Written once into tests/fuzz/corpus/<target>/;
the fuzzer grows the corpus from there and fuzz.sh merges what it finds back in.

    python benchmarks/fuzz_seeds.py [--corpus tests/fuzz/corpus]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _put(folder: Path, data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)


def _package(model: Path, out: Path, *options: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "-o", str(out),
                           "-q", "--json", *options], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    bundle = Path(json.loads(proc.stdout)["bundle_dir"])
    return json.loads((bundle / "manifest.json").read_text())


def manifests(work: Path) -> list[bytes]:
    """A classifier with preprocess and labels, and the README's YOLO detector with its NMS rows."""
    import make_models

    models = make_models.write_all(work / "models")
    detector = make_models.write_detector(work / "detector")
    classifier = next(p for p in models if p.name == "resnet_cnn.onnx")
    found = [_package(classifier, work / "classify", "--preprocess", "mean=0.485/0.456/0.406,std=0.229/0.224/0.225",
                      "--postprocess", "classify"),
             _package(detector[0], work / "yolo", "--preprocess", "fit=letterbox", "--postprocess", "yolo",
                      "--labels", str(detector[1]))]
    return [json.dumps(m, indent=1).encode() for m in found]


def npys() -> list[bytes]:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 3, 4, 4)).astype(np.float32), np.arange(6, dtype=np.int64).reshape(2, 3),
              rng.integers(0, 255, (2, 2), dtype=np.uint8), np.float16([1.5, -2]), np.array(3.0), np.zeros((0, 4)),
              np.asfortranarray(np.ones((2, 3), np.float32)), np.array([True, False])]
    out = []
    for a in arrays:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, a, version=(1, 0))
        out.append(buf.getvalue())
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arrays[0], version=(2, 0))
    return out + [buf.getvalue()]


def images(kind: str) -> list[bytes]:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 255, (5, 7, 3), dtype=np.uint8)
    pictures = [Image.fromarray(rgb), Image.fromarray(rgb[:, :, 0]), Image.fromarray(rgb).convert("RGBA"),
                Image.fromarray(rgb[:, :1])]
    out = []
    for picture in pictures:
        buf = io.BytesIO()
        if kind == "png":
            picture.save(buf, "PNG")
        elif picture.mode != "RGBA":
            picture.save(buf, "JPEG", quality=80)
        out.append(buf.getvalue())
    if kind == "png":
        for extra in (Image.fromarray(rgb).convert("P"), Image.fromarray(rgb[:, :, 0] > 127), Image.fromarray(rgb[:, :, 0]).convert("LA")):
            buf = io.BytesIO()
            extra.save(buf, "PNG")
            out.append(buf.getvalue())
    else:
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG", progressive=True)
        out.append(buf.getvalue())
    return [b for b in out if b]


def answers() -> list[bytes]:
    rng = np.random.default_rng(2)
    return [bytes([1, 9, 3, 2, 1, 4, 20, 30]) + rng.integers(0, 256, 256, dtype=np.uint8).tobytes(),
            bytes([4, 30, 7, 8, 0, 9, 0, 0]) + np.float16(rng.standard_normal(400)).tobytes()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests" / "fuzz" / "corpus")
    corpus = parser.parse_args().corpus
    with tempfile.TemporaryDirectory() as tmp:
        found = manifests(Path(tmp))
    for m in found:
        _put(corpus / "json", m)
        _put(corpus / "manifest", m)
    for data in npys():
        _put(corpus / "npy", data)
    for kind in ("png", "jpeg"):
        for data in images(kind):
            _put(corpus / kind, data)
    for data in answers():
        _put(corpus / "yolo", data)
    print(f"seeds written under {corpus}")


if __name__ == "__main__":
    main()
