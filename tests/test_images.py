"""From an image to an answer (#31): ``--preprocess`` recorded in the bundle, ``run.py --input IMAGE`` and
``edgeq-run --input IMAGE`` (the system's libpng and libturbojpeg, dlopen'ed) making the very tensor the
packager made of the same image (bit for bit), ``--postprocess classify`` printed alike by both loaders, and
bad images refused in one line with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from PIL import Image

from conftest import read_golden, run_cli, run_py
from edgeq.reference import onnxruntime_session

QEMU = shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"
# Debian's arm64 decoders, unpacked (not installed) by scripts/setup.sh
ARM64_DECODERS = Path(__file__).resolve().parent.parent / "build" / "arm64-decoders"
ARM64_LIBS = [ARM64_DECODERS / "libpng16.so.16", ARM64_DECODERS / "libturbojpeg.so.0", ARM64_DECODERS / "libz.so.1"]


def echo_model(path: Path, shape: list[int]) -> Path:
    """y = -(-x): the output is the input tensor, bit for bit (what the loaders made of the image)."""
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Neg", ["n"], ["y"])], "echo",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """PNG and JPEG, RGB, gray, RGBA and palette, 45x60 (every model here needs a resize)."""
    out = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:45, 0:60]
    smooth = np.stack([xx * 4, yy * 5, (xx + yy) * 2], axis=-1) % 256
    rgb = np.clip(smooth + rng.integers(-20, 20, smooth.shape), 0, 255).astype(np.uint8)
    made = {"rgb.png": Image.fromarray(rgb), "gray.png": Image.fromarray(rgb[:, :, 1]),
            "rgba.png": Image.fromarray(np.dstack([rgb, rgb[:, :, :1]])), "palette.png": Image.fromarray(rgb).convert("P")}
    for name, image in made.items():
        image.save(out / name)
    Image.fromarray(rgb).save(out / "rgb.jpg", quality=90)
    Image.fromarray(rgb[:, :, 1]).save(out / "gray.jpg", quality=90)
    return {p.name: p for p in out.iterdir()}


def _native(bundle: Path, *args, qemu: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(bundle / "runtime" / "edgeq-run"), *map(str, args)]
    if qemu:
        cmd = [QEMU, "-L", SYSROOT, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=bundle,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})})


def _package(model: Path, out: Path, *options: str, device: str = "host") -> Path:
    result = run_cli("package", model, "--device", device, "-o", out, "-q", "--json", *options)
    assert result.code == 0, result.stderr
    return Path(json.loads(result.stdout)["bundle_dir"])


def _both_loaders(bundle: Path, image: Path, tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    py = run_py(bundle, "--input", image, "--output", tmp_path / "py.npz")
    assert py.returncode == 0, py.stderr
    native = _native(bundle, "--input", image, "--output", tmp_path / "native.npz")
    assert native.returncode == 0, native.stderr
    with np.load(tmp_path / "py.npz") as a, np.load(tmp_path / "native.npz") as b:
        return a["y"], b["y"]


SPECS = {  # (input shape, --preprocess, the image)
    "stretch-rgb-nchw": ([1, 3, 24, 20], "mean=0.485/0.456/0.406,std=0.229/0.224/0.225", "rgb.jpg"),
    "letterbox-rgb-nchw": ([1, 3, 32, 32], "fit=letterbox,scale=255", "rgb.png"),
    "bgr-nhwc": ([1, 24, 20, 3], "layout=NHWC,order=BGR,mean=0.5,std=0.25", "palette.png"),
    "gray-from-rgb": ([1, 1, 16, 40], "mean=0.5,std=0.5", "rgb.jpg"),
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_both_loaders_make_the_packagers_tensor(spec, images, tmp_path):
    shape, preprocess, image = SPECS[spec]
    model = echo_model(tmp_path / "echo.onnx", shape)
    # the packager's tensor of this image: the golden input it prepared with --preprocess
    bundle = _package(model, tmp_path / "out", "--preprocess", preprocess, "--golden-input", images[image],
                      "--runtime", "bundled")
    packager = read_golden(bundle)["input:x"]
    assert packager.shape == tuple(shape)
    py, native = _both_loaders(bundle, images[image], tmp_path)
    assert py.tobytes() == packager.tobytes(), "run.py"
    assert native.tobytes() == packager.tobytes(), "edgeq-run"
    assert json.loads((bundle / "manifest.json").read_text())["preprocess"]["input"] == "x"


def test_every_image_format(images, tmp_path):
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    bundle = _package(model, tmp_path / "out", "--preprocess", "mean=0.485/0.456/0.406,std=0.229/0.224/0.225")
    from edgeq.templates import contract, imaging

    pre = contract.PreprocessRecord.from_json(json.loads((bundle / "manifest.json").read_text())["preprocess"])
    for name, path in sorted(images.items()):
        py, native = _both_loaders(bundle, path, tmp_path)
        want = imaging.image_tensor(np, imaging.decode_image(np, str(path)), pre)
        assert py.tobytes() == want.tobytes() and native.tobytes() == want.tobytes(), name
    # the RGBA image is its RGB image (alpha dropped, nothing composited)
    rgba, _ = _both_loaders(bundle, images["rgba.png"], tmp_path)
    rgb, _ = _both_loaders(bundle, images["rgb.png"], tmp_path)
    assert rgba.tobytes() == rgb.tobytes()


def test_calibration_images_are_the_loaders_tensors(images, tmp_path):
    """Calibration from an image folder prepares the images as the loaders do."""
    from edgeq.templates import imaging
    from edgeq.templates.contract import TensorSpec
    from edgeq.quantize.data import Preprocess, load_data

    pre = Preprocess.parse("fit=letterbox,mean=0.5,std=0.25")
    folder = tmp_path / "calib"
    folder.mkdir()
    for name in ("rgb.png", "gray.jpg"):
        shutil.copy(images[name], folder / name)
    spec = TensorSpec("x", [1, 3, 32, 32], "float32")
    data = load_data(folder, [spec], "calibration", pre)
    record = pre.record(spec)
    for i, name in enumerate(sorted(["gray.jpg", "rgb.png"])):
        want = imaging.image_tensor(np, imaging.decode_image(np, str(folder / name)), record)[0]
        assert data.arrays["x"][i].tobytes() == want.tobytes()


def test_classify_both_loaders_print_the_same(models, images, tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"class {i}\n" for i in range(10)))
    bundle = _package(models["resnet_cnn"], tmp_path / "out", "--preprocess", "mean=0.485/0.456/0.406,std=0.229/0.224/0.225",
                      "--postprocess", "classify", "--labels", labels, "--top-k", "3", "--runtime", "bundled")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["postprocess"] == {"kind": "classify", "output": "logits", "top_k": 3, "softmax": True,
                                       "labels": [f"class {i}" for i in range(10)]}
    for name in ("rgb.png", "gray.jpg"):
        py = run_py(bundle, "--input", images[name], "--json")
        native = _native(bundle, "--input", images[name], "--json")
        assert py.returncode == native.returncode == 0, (py.stderr, native.stderr)
        a, b = json.loads(py.stdout), json.loads(native.stdout)
        assert a == b
        top = a["top"]
        assert len(top) == 3 and [r["label"] for r in top] == [f"class {r['index']}" for r in top]
        assert top[0]["score"] >= top[1]["score"] >= top[2]["score"] and 0 < sum(r["score"] for r in top) <= 1.0001
        # the scores are the softmax of the logits the bundle computes for that image
        run_py(bundle, "--input", images[name], "--output", tmp_path / "o.npz")
        with np.load(tmp_path / "o.npz") as out:
            logits = out["logits"].astype(np.float64).ravel()
        p = np.exp(logits - logits.max())
        p /= p.sum()
        assert [r["index"] for r in top] == list(np.argsort(-p, kind="stable")[:3])
        assert all(abs(r["score"] - p[r["index"]]) <= 5e-5 for r in top)
        text_py = run_py(bundle, "--input", images[name]).stdout
        assert text_py == _native(bundle, "--input", images[name]).stdout and "class" in text_py


def _bomb(path: Path) -> Path:
    Image.new("L", (8000, 8000)).save(path, optimize=True)  # 64 Mpixel, a few hundred KB
    return path


def test_bad_images_one_line_nothing_written(images, tmp_path):
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    bundle = _package(model, tmp_path / "out", "--preprocess", "", "--runtime", "bundled")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "text.png").write_text("not an image at all")
    (bad / "truncated.png").write_bytes(images["rgb.png"].read_bytes()[:200])
    (bad / "truncated.jpg").write_bytes(images["rgb.jpg"].read_bytes()[:300])
    _bomb(bad / "bomb.png")
    Image.fromarray(np.zeros((8, 8), np.uint16)).save(bad / "deep.png")  # 16-bit
    for path in sorted(bad.iterdir()):
        out = tmp_path / f"{path.stem}-out.npz"
        for proc in (run_py(bundle, "--input", path, "--output", out), _native(bundle, "--input", path, "--output", out)):
            assert proc.returncode == 2, (path.name, proc.stderr)
            line = proc.stderr.strip()
            assert len(line.splitlines()) == 1 and str(path) in line, (path.name, line)
            assert not out.exists()
    # an image for a bundle packaged without --preprocess
    plain = _package(model, tmp_path / "plain", "--runtime", "bundled")
    for proc in (run_py(plain, "--input", images["rgb.png"]), _native(plain, "--input", images["rgb.png"])):
        assert proc.returncode == 2 and "--preprocess" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_postprocess_classify_refuses_what_is_not_a_classifier(tmp_path):
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    result = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "-q", "--postprocess", "classify")
    assert result.code == 3 and "not one row of class scores" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\n")
    result = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "-q", "--labels", labels)
    assert result.code == 2 and "--postprocess classify" in result.stderr


def test_a_manifest_whose_preprocess_does_not_fit_is_refused_by_both(images, tmp_path):
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    bundle = _package(model, tmp_path / "out", "--preprocess", "", "--runtime", "bundled")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["preprocess"]["height"] = 25
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    py, native = run_py(bundle, "--self-test"), _native(bundle, "--self-test")
    assert py.returncode == native.returncode == 7
    for err in (py.stderr, native.stderr):
        assert "manifest field 'preprocess' does not fit input 'x'" in err and len(err.strip().splitlines()) == 1
    # a resize no loader can allocate for (100000 x 100000 floats: 120 GB), the input declared to match:
    # refused from the manifest before anything is allocated, not a MemoryError or bad_alloc
    manifest["preprocess"]["height"] = manifest["preprocess"]["width"] = 100000
    manifest["inputs"][0]["shape"] = [1, 3, 100000, 100000]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    for proc in (run_py(bundle, "--input", images["rgb.png"]), _native(bundle, "--input", images["rgb.png"])):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 7 and len(lines) == 1, proc.stderr
        assert "manifest field 'preprocess' has a value out of range" in lines[0], lines[0]


@pytest.mark.skipif(QEMU is None or not Path(SYSROOT).is_dir(), reason="qemu-user and the aarch64 cross toolchain are needed")
def test_aarch64_loader_under_qemu(images, tmp_path):
    missing = [str(p) for p in ARM64_LIBS if not p.exists()]
    if missing:
        pytest.skip(f"the aarch64 libpng/zlib/libturbojpeg are missing ({', '.join(missing)}): scripts/setup.sh "
                    "unpacks them from Debian's arm64 packages where apt can fetch them")
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    bundle = _package(model, tmp_path / "out", "--preprocess", "mean=0.485/0.456/0.406,std=0.229/0.224/0.225",
                      "--golden-input", images["rgb.jpg"], device="arm64-cpu")
    packager = read_golden(bundle)["input:x"]
    env = {"LD_LIBRARY_PATH": str(ARM64_DECODERS)}
    for name in ("rgb.jpg", "palette.png"):
        proc = _native(bundle, "--input", images[name], "--output", tmp_path / "a.npz", qemu=True, env=env)
        assert proc.returncode == 0, proc.stderr
        with np.load(tmp_path / "a.npz") as out:
            got = out["y"]
        if name == "rgb.jpg":
            assert got.tobytes() == packager.tobytes()
        else:
            from edgeq.templates import contract, imaging

            pre = contract.PreprocessRecord.from_json(json.loads((bundle / "manifest.json").read_text())["preprocess"])
            assert got.tobytes() == imaging.image_tensor(np, imaging.decode_image(np, str(images[name])), pre).tobytes()


# ---- --postprocess yolo ----------------------------------------------------------------------------------


def _reference_detections(head: np.ndarray, conf: float, iou: float, max_det: int, image_hw, size: int, labels):
    """Ultralytics' post-processing written out in numpy, from ONNX Runtime's raw head: each anchor's best
    class above ``conf``, xywh -> xyxy, class-aware greedy NMS (IoU above ``iou`` suppressed), best first, at
    most ``max_det``, boxes scaled back as ultralytics' scale_boxes does and clipped."""
    pred = head[0].astype(np.float64)  # [4 + classes, anchors]
    scores = pred[4:4 + len(labels)]
    best, cls = scores.max(0), scores.argmax(0)
    keep = np.flatnonzero(best > conf)
    keep = keep[np.argsort(-best[keep], kind="stable")]
    cx, cy, w, h = pred[:4, keep]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    chosen = []
    for i in range(len(keep)):
        ok = True
        for j in chosen:
            if cls[keep[i]] != cls[keep[j]]:
                continue
            lt, rb = np.maximum(boxes[i, :2], boxes[j, :2]), np.minimum(boxes[i, 2:], boxes[j, 2:])
            inter = np.prod(np.clip(rb - lt, 0, None))
            union = np.prod(boxes[i, 2:] - boxes[i, :2]) + np.prod(boxes[j, 2:] - boxes[j, :2]) - inter
            if union > 0 and inter / union > iou:
                ok = False
                break
        if ok:
            chosen.append(i)
    chosen = chosen[:max_det]
    h0, w0 = image_hw
    gain = min(size / h0, size / w0)
    pad_x, pad_y = round((size - w0 * gain) / 2 - 0.1), round((size - h0 * gain) / 2 - 0.1)
    out = []
    for i in chosen:
        x1, y1, x2, y2 = boxes[i]
        box = [(x1 - pad_x) / gain, (y1 - pad_y) / gain, (x2 - pad_x) / gain, (y2 - pad_y) / gain]
        box = [min(max(v, 0.0), w0 if k % 2 == 0 else h0) for k, v in enumerate(box)]
        out.append({"box": box, "score": best[keep[i]], "class": int(cls[keep[i]]), "label": labels[cls[keep[i]]]})
    return out


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> dict[str, Path]:
    import make_models

    out = tmp_path_factory.mktemp("detector")
    return {p.name: p for p in make_models.write_detector(out)}


def test_yolo_boxes_match_a_numpy_reference_and_both_loaders_agree(detector, images, tmp_path):

    from edgeq.templates import contract, imaging

    labels = detector["yolo_labels.txt"].read_text().split("\n")[:-1]
    conf, iou = 0.2, 0.45
    bundle = _package(detector["yolo_cnn.onnx"], tmp_path / "out", "--preprocess", "fit=letterbox", "--postprocess", "yolo",
                      "--labels", detector["yolo_labels.txt"], "--conf", str(conf), "--iou", str(iou),
                      "--golden-input", detector["street.png"], "--runtime", "bundled")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["postprocess"]["kind"] == "yolo" and manifest["postprocess"]["classes"] == len(labels)
    assert manifest["reference_check"]["result"] == "passed"
    pre = contract.PreprocessRecord.from_json(manifest["preprocess"])
    session = onnxruntime_session(str(detector["yolo_cnn.onnx"]))
    seen = 0
    for image in (detector["street.png"], images["rgb.jpg"], images["gray.png"]):
        py = run_py(bundle, "--input", image, "--json")
        native = _native(bundle, "--input", image, "--json")
        assert py.returncode == native.returncode == 0, (py.stderr, native.stderr)
        got = json.loads(py.stdout)
        assert got == json.loads(native.stdout)
        assert run_py(bundle, "--input", image).stdout == _native(bundle, "--input", image).stdout
        pixels = imaging.decode_image(np, str(image))
        head = session.run(None, {"images": imaging.image_tensor(np, pixels, pre)})[0]
        want = _reference_detections(head, conf, iou, 300, pixels.shape[:2], 128, labels)
        found = got["detections"]
        assert [d["class"] for d in found] == [d["class"] for d in want]
        for g, w in zip(found, want):
            assert max(abs(a - b) for a, b in zip(g["box"], w["box"])) <= 1.0, (g, w)
            assert abs(g["score"] - w["score"]) <= 1e-3 and g["label"] == w["label"]
        seen += len(found)
    assert seen > 0  # the images select something


def test_yolo_on_the_orin(detector, tmp_path):
    """NonMaxSuppression is in the graph: the CUDA build carries it (built here for sm_87)."""
    bundle = _package(detector["yolo_cnn.onnx"], tmp_path / "out", "--preprocess", "fit=letterbox", "--postprocess", "yolo",
                      device="jetson-orin-nano")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["device"]["cuda_arch"] == "sm_87" and manifest["postprocess"]["selected"] == "edgeq_yolo_selected"


def test_yolo_refuses_what_is_not_a_yolo_head(models, tmp_path):
    result = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "-q",
                     "--postprocess", "yolo")
    assert result.code == 3 and "is not a YOLO head" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _with_chunk(png: bytes, chunk: bytes) -> bytes:
    """``png`` with ``chunk`` after its IHDR (8 + 25 bytes)."""
    return png[:33] + chunk + png[33:]


def test_both_loaders_read_the_same_png_the_same_way(images, tmp_path):
    """What the two decoders did differently (libpng checks IDAT CRCs, converts by gAMA and inflates zTXt;
    Pillow did none of it and refused 1-bit gray) is settled before either decodes: every chunk's CRC is
    checked, only the pixel chunks are decoded (imaging.png_pixel_chunks, image.h's PngPixelChunks)."""
    import zlib

    model = echo_model(tmp_path / "echo.onnx", [1, 3, 32, 32])
    bundle = _package(model, tmp_path / "out", "--preprocess", "fit=letterbox", "--runtime", "bundled")
    from edgeq.templates import contract, imaging

    pre = contract.PreprocessRecord.from_json(json.loads((bundle / "manifest.json").read_text())["preprocess"])
    png = images["rgb.png"].read_bytes()
    cases = tmp_path / "cases"
    cases.mkdir()
    # accepted, the pixels of rgb.png: text inflating to 256 MiB, a gamma of 1.0 (libpng would convert by it)
    (cases / "ztxt-bomb.png").write_bytes(_with_chunk(png, _chunk(b"zTXt", b"Comment\0\0" + zlib.compress(bytes(256 << 20), 9))))
    (cases / "gamma.png").write_bytes(_with_chunk(png, _chunk(b"gAMA", (100000).to_bytes(4, "big"))))
    want = imaging.image_tensor(np, imaging.decode_image(np, str(images["rgb.png"])), pre)
    for name in ("ztxt-bomb.png", "gamma.png"):
        py, native = _both_loaders(bundle, cases / name, tmp_path)
        assert py.tobytes() == native.tobytes() == want.tobytes(), name
    # accepted alike: 1-bit gray (0 and 255), and a 20000x1 strip letterboxed into 32x32 (one row, centred by it)
    bits = (np.indices((9, 13)).sum(axis=0) % 2).astype(bool)
    Image.fromarray(bits).save(cases / "one-bit.png")
    strip = np.random.default_rng(1).integers(0, 255, (1, 20000, 3), dtype=np.uint8)
    Image.fromarray(strip).save(cases / "strip.png")
    for name in ("one-bit.png", "strip.png"):
        py, native = _both_loaders(bundle, cases / name, tmp_path)
        assert py.tobytes() == native.tobytes(), name
    one_bit = imaging.decode_image(np, str(cases / "one-bit.png"))
    assert set(np.unique(one_bit)) == {0, 255} and (one_bit[:, :, 0] == bits * 255).all()
    py, _ = _both_loaders(bundle, cases / "strip.png", tmp_path)
    rows = np.flatnonzero((py[0, 0] != py[0, 0, 0, 0]).any(axis=1))
    assert list(rows) == [15], rows  # (32 - 1) / 2 - 0.1 rounds to 15: the row the image really takes
    # refused alike, one line, exit 2, nothing written: a damaged IDAT CRC, a chunk running past the end
    data = bytearray(png)
    idat = png.index(b"IDAT")
    length = int.from_bytes(png[idat - 4:idat], "big")
    data[idat + 4 + length] ^= 0xFF
    (cases / "idat-crc.png").write_bytes(bytes(data))
    (cases / "long-chunk.png").write_bytes(png[:33] + (1 << 30).to_bytes(4, "big") + b"tEXt" + b"x" * 16)
    for name, fragment in (("idat-crc.png", "PNG chunk IDAT has a bad CRC"), ("long-chunk.png", "is damaged")):
        out = tmp_path / "refused.npz"
        for proc in (run_py(bundle, "--input", cases / name, "--output", out),
                     _native(bundle, "--input", cases / name, "--output", out)):
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], (name, proc.stderr)
            assert not out.exists()


def test_a_fifo_or_folder_input_is_refused_not_waited_on(images, tmp_path):
    model = echo_model(tmp_path / "echo.onnx", [1, 3, 24, 20])
    bundle = _package(model, tmp_path / "out", "--preprocess", "", "--runtime", "bundled")
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        for arg in (str(path), f"x={path}"):
            for proc in (run_py(bundle, "--input", arg), _native(bundle, "--input", arg)):  # (each would block on the FIFO)
                lines = proc.stderr.strip().splitlines()
                assert proc.returncode == 2 and len(lines) == 1 and "is not a regular file" in lines[0], (arg, proc.stderr)
