"""Video in, answers out (#44): ``run.py`` and ``edgeq-run`` reading a video file, a GStreamer pipeline of the
user's own (``gst:``) and a live source through Debian's GStreamer, every frame through the image path's
preprocessing and the bundle's post-processing, pipelined with drops counted on a live source, and every bad
source refused in one line. The videos are made here with gst-launch-1.0; the frames the loaders decode are
compared with the same frames decoded by gst-launch-1.0 into PNG files and run as images."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from conftest import run_cli, run_py

GST_LAUNCH = shutil.which("gst-launch-1.0")
pytestmark = pytest.mark.skipif(GST_LAUNCH is None, reason="GStreamer's gst-launch-1.0 is missing: scripts/setup.sh "
                                "--tests installs gstreamer1.0-tools and the plugins")
FRAMES = 10
FPS = 30


def _has(element: str) -> bool:
    return subprocess.run(["gst-inspect-1.0", element], capture_output=True).returncode == 0


def _gst(*pipeline: str) -> None:
    proc = subprocess.run([GST_LAUNCH, "-q", *pipeline], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _native(bundle: Path, *args, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(bundle / "runtime" / "edgeq-run"), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=bundle, env={**os.environ, **(env or {})}, **kwargs)


def _package(model: Path, out: Path, *options: str) -> Path:
    result = run_cli("package", model, "--device", "host", "-o", out, "-q", "--json", "--runtime", "bundled", *options)
    assert result.code == 0, result.stderr
    return Path(json.loads(result.stdout)["bundle_dir"])


def _lines(stdout: str) -> tuple[list[dict], dict]:
    """(the per-frame JSON lines, the summary)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert rows and "summary" in rows[-1], stdout[-500:]
    return rows[:-1], rows[-1]["summary"]


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> dict:
    """The README's YOLO-style detector packaged with --preprocess letterbox and --postprocess yolo, and a video
    of its street image sliding sideways (10 frames, 30 fps, 320x240): MJPEG in AVI and H.264 in MP4."""
    import make_models

    out = tmp_path_factory.mktemp("video")
    model, labels, street = make_models.write_detector(out / "models")
    bundle = _package(model, out / "bundle", "--preprocess", "fit=letterbox", "--postprocess", "yolo", "--labels",
                      labels, "--conf", "0.22", "--golden-input", street)
    image = np.asarray(Image.open(street).convert("RGB"))
    frames = out / "frames"
    frames.mkdir()
    for i in range(FRAMES):
        Image.fromarray(np.roll(image, 12 * i, axis=1)).save(frames / f"f_{i:03d}.png")
    src = ["multifilesrc", f"location={frames}/f_%03d.png", "index=0", f"stop-index={FRAMES - 1}",
           f"caps=image/png,framerate={FPS}/1", "!", "pngdec", "!", "videoconvert", "!"]
    videos = {}
    _gst(*src, "jpegenc", "!", "avimux", "!", "filesink", f"location={out}/street.avi")
    videos["avi"] = out / "street.avi"
    if _has("x264enc"):
        _gst(*src, "x264enc", "!", "mp4mux", "!", "filesink", f"location={out}/street.mp4")
        videos["mp4"] = out / "street.mp4"
    return {"bundle": bundle, "videos": videos, "out": out}


def _decoded_frames(video: Path, folder: Path) -> list[Path]:
    """The video's frames as gst-launch-1.0 decodes them, written as PNG files."""
    folder.mkdir()
    _gst("filesrc", f"location={video}", "!", "decodebin", "!", "videoconvert", "!", "video/x-raw,format=RGB", "!",
         "pngenc", "!", "multifilesink", f"location={folder}/frame_%03d.png")
    return sorted(folder.iterdir())


@pytest.mark.parametrize("kind", ["avi", "mp4"])
def test_each_frame_answers_as_the_same_frame_given_as_an_image(detector, kind, tmp_path):
    if kind not in detector["videos"]:
        pytest.skip("GStreamer here has no x264enc (gstreamer1.0-plugins-ugly) to make an H.264 video")
    bundle, video = detector["bundle"], detector["videos"][kind]
    py = run_py(bundle, "--input", video, "--json")
    native = _native(bundle, "--input", video, "--json")
    assert py.returncode == native.returncode == 0, (py.stderr, native.stderr)
    py_rows, py_summary = _lines(py.stdout)
    native_rows, native_summary = _lines(native.stdout)
    assert py_rows == native_rows  # both loaders: the same frames, the same answers
    assert [r["frame"] for r in py_rows] == list(range(FRAMES))
    times = [r["time"] for r in py_rows]  # the buffers' timestamps (an MP4's may start after 0: its edit list)
    assert np.diff(times) == pytest.approx([1 / FPS] * (FRAMES - 1), abs=1e-3)
    assert sum(len(r["detections"]) for r in py_rows) > 0  # the frames select something
    for summary in (py_summary, native_summary):
        assert summary["frames"] == FRAMES and summary["dropped"] == 0 and summary["live"] is False
        assert summary["pipelined"] is True and summary["fps"] > 0
        assert set(summary["stages"]) == {"decode", "preprocess", "infer", "postprocess"}
    # the same frames, decoded by gst-launch into PNG files and given as images: the same answers
    pngs = _decoded_frames(video, tmp_path / "png")
    assert len(pngs) == FRAMES
    for i, png in enumerate(pngs):
        image = _native(bundle, "--input", png, "--json")
        assert image.returncode == 0, image.stderr
        assert json.loads(image.stdout)["detections"] == py_rows[i]["detections"], i
    for i in (0, FRAMES - 1):  # run.py too, on two of them (a fresh interpreter each: slow)
        assert json.loads(run_py(bundle, "--input", pngs[i], "--json").stdout)["detections"] == py_rows[i]["detections"]
    # one frame after the other: the same answers
    sequential = _native(bundle, "--input", video, "--json", "--no-pipeline")
    rows, summary = _lines(sequential.stdout)
    assert rows == py_rows and summary["pipelined"] is False


def test_text_output_and_frames_written_with_boxes(detector, tmp_path):
    bundle, video = detector["bundle"], detector["videos"]["avi"]
    py = run_py(bundle, "--input", video, "--output", tmp_path / "py")
    native = _native(bundle, "--input", video, "--output", tmp_path / "native")
    assert py.returncode == native.returncode == 0, (py.stderr, native.stderr)
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith(("  decode", "  preprocess", "  infer",
                                                                              "  postprocess")) and " frames/s" not in ln]
    assert strip(py.stdout) == strip(native.stdout)
    assert py.stdout.startswith("frame 0 at 0.000 s\n")
    rows, _ = _lines(run_py(bundle, "--input", video, "--json").stdout)
    from edgeq.templates import imaging

    pngs = _decoded_frames(video, tmp_path / "png")
    for i, row in enumerate(rows):
        name = f"frame_{i:06d}.png"
        py_frame = np.asarray(Image.open(tmp_path / "py" / name))
        native_frame = np.asarray(Image.open(tmp_path / "native" / name))
        assert py_frame.tobytes() == native_frame.tobytes(), name
        plain = np.asarray(Image.open(pngs[i]).convert("RGB"))
        assert py_frame.tobytes() == imaging.draw_detections(np, plain, row["detections"]).tobytes()
        if row["detections"]:  # a box's colour is on its outline
            box = imaging.box_pixels(row["detections"][0]["box"], *plain.shape[:2])
            assert (py_frame[box[1], box[0]] != plain[box[1], box[0]]).any() or \
                tuple(plain[box[1], box[0]]) == imaging.BOX_COLOURS[row["detections"][0]["class"] % 20]
    assert run_py(bundle, "--input", video, "--output", tmp_path / "x.npz").returncode == 2


@pytest.mark.parametrize("suffix", [".avi", ".mp4"])
def test_a_video_written_with_the_answers_drawn(detector, suffix, tmp_path):
    """--output FILE.avi|.mp4: the frames with boxes and labels, encoded by GStreamer; both loaders write the same."""
    bundle, video = detector["bundle"], detector["videos"]["avi"]
    if suffix == ".mp4" and not (_has("x264enc") or _has("avenc_mpeg4")):
        pytest.skip("GStreamer here has no H.264 or MPEG-4 encoder")
    written = {}
    for loader, run in (("py", run_py), ("native", _native)):
        proc = run(bundle, "--input", video, "--output", tmp_path / f"{loader}{suffix}")
        assert proc.returncode == 0, proc.stderr
        written[loader] = _decoded_frames(tmp_path / f"{loader}{suffix}", tmp_path / f"{loader}-frames")
        assert len(written[loader]) == FRAMES
        assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # the temporary file was renamed into place
    from edgeq.templates import imaging

    rows, _ = _lines(run_py(bundle, "--input", video, "--json").stdout)
    plain = _decoded_frames(video, tmp_path / "plain")
    for i in range(FRAMES):
        a, b = (np.asarray(Image.open(written[k][i]).convert("RGB")).astype(int) for k in ("py", "native"))
        if suffix == ".avi":  # the same pixels into the same (deterministic) JPEG encoder
            assert np.array_equal(a, b), i
        source = np.asarray(Image.open(plain[i]).convert("RGB"))
        drawn = imaging.draw_detections(np, source, rows[i]["detections"]).astype(int)
        # lossy codecs (x264's output also varies a little from run to run): each loader's frame is near the
        # drawn one, and the boxes are there
        for frame in (a, b):
            assert np.abs(frame - drawn).mean() < 8, i
            if rows[i]["detections"]:
                assert np.abs(frame - drawn).mean() < np.abs(frame - source.astype(int)).mean(), i
    bad = run_py(bundle, "--input", video, "--output", tmp_path / "x.webm")  # no muxer for it: a folder named x.webm
    assert bad.returncode == 0 and (tmp_path / "x.webm" / "frame_000000.png").exists()


def test_a_gst_pipeline_of_the_users_own(detector):
    bundle = detector["bundle"]
    source = "gst:videotestsrc num-buffers=7 pattern=ball ! video/x-raw,width=160,height=120 ! videoconvert ! appsink"
    py = run_py(bundle, "--input", source, "--json")
    native = _native(bundle, "--input", source, "--json")
    assert py.returncode == native.returncode == 0, (py.stderr, native.stderr)
    assert _lines(py.stdout)[0] == _lines(native.stdout)[0]
    assert [r["frame"] for r in _lines(py.stdout)[0]] == list(range(7))
    named = run_py(bundle, "--input", "images=" + source, "--json")  # NAME=SOURCE: the preprocessed input's name
    assert named.returncode == 0 and _lines(named.stdout)[0] == _lines(py.stdout)[0]


def _slow_model(path: Path) -> Path:
    """A model that takes tens of milliseconds a frame on this machine: 64x64 RGB in, three 2048-wide matmuls."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) / 50, name)
               for name, shape in (("w1", [64, 2048]), ("w2", [2048, 2048]), ("w3", [2048, 2048]), ("w4", [2048, 10]))]
    shape = numpy_helper.from_array(np.array([192, 64], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w1"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["b"]), helper.make_node("MatMul", ["b", "w3"], ["c"]),
             helper.make_node("MatMul", ["c", "w4"], ["d"]), helper.make_node("ReduceMean", ["d"], ["y"], axes=[0])]
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], [*weights, shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slow")
    return _package(_slow_model(out / "slow.onnx"), out / "bundle", "--preprocess", "scale=255", "--postprocess",
                    "classify")


LIVE = ("gst:videotestsrc is-live=true num-buffers={n} ! video/x-raw,width=96,height=72,framerate=240/1 ! "
        "videoconvert ! appsink")


@pytest.mark.parametrize("loader", ["run.py", "edgeq-run"])
def test_a_live_source_that_outruns_the_model_drops_frames(slow, loader):
    n = 240  # one second at 240 frames/s; the model takes far longer than 1/240 s a frame
    run = run_py if loader == "run.py" else _native
    proc = run(slow, "--input", LIVE.format(n=n), "--json")
    assert proc.returncode == 0, proc.stderr
    rows, summary = _lines(proc.stdout)
    assert summary["live"] is True and summary["dropped"] > 0
    assert summary["frames"] == len(rows) < n
    assert summary["frames"] + summary["dropped"] == n  # every frame answered or counted dropped: none queued unboundedly
    frames = [r["frame"] for r in rows]
    assert frames == sorted(frames) and frames[-1] == n - 1  # the newest frames are kept, the oldest dropped


def test_a_file_never_drops_a_frame(slow, tmp_path):
    video = tmp_path / "fast.avi"
    _gst("videotestsrc", "num-buffers=24", "!", "video/x-raw,width=96,height=72,framerate=240/1", "!", "jpegenc", "!",
         "avimux", "!", "filesink", f"location={video}")
    proc = _native(slow, "--input", video, "--json")
    rows, summary = _lines(proc.stdout)
    assert summary["live"] is False and summary["dropped"] == 0 and [r["frame"] for r in rows] == list(range(24))


@pytest.mark.parametrize("loader", ["run.py", "edgeq-run"])
def test_ctrl_c_prints_the_summary(slow, loader):
    cmd = ([sys.executable, str(slow / "run.py")] if loader == "run.py" else [str(slow / "runtime" / "edgeq-run")])
    proc = subprocess.Popen([*cmd, "--input", LIVE.format(n=-1), "--json"], cwd=slow, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    first = proc.stdout.readline()  # one frame answered: the stream runs
    assert json.loads(first)["frame"] >= 0 and time.monotonic() < deadline
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["stopped"] == "interrupted" and summary["frames"] >= 1 and "Traceback" not in err


BAD = [  # (source, status, what the one line says)
    ("{tmp}/missing.mp4", 2, "no such file"),
    ("{tmp}/junk.mkv", 9, "cannot read junk.mkv"),
    ("/dev/video97", 2, "there is no such camera"),
    ("csi://0", 2, "needs NVIDIA's nvarguscamerasrc"),
    ("csi://x", 2, "a CSI camera is csi://N"),
    ("rtsp://user:secret@127.0.0.1:9/stream", 9, "cannot read rtsp://127.0.0.1:9/stream:"),
    ("gst:videotestsrc ! fakesink", 2, "must end in appsink"),
    ("gst:videotestsrc ! appsink name=mine", 2, "leave the appsink unnamed"),
    ("gst:nosuchelement ! appsink", 2, "no element"),
    ("gst:videotestsrc is-live=true ! valve drop=true ! videoconvert ! appsink", 9, "delivered no frame for 1 s"),
    ("gst:videotestsrc num-buffers=30 ! identity error-after=4 ! videoconvert ! appsink", 9, "stopped after 3 frames"),
    ("gst:videotestsrc num-buffers=3 ! appsink caps=video/x-raw,format=GRAY8", 9, "gives GRAY8 frames"),
]


@pytest.mark.parametrize("source,status,says", BAD, ids=[b[2] for b in BAD])
def test_bad_sources_one_line_each(detector, source, status, says, tmp_path):
    (tmp_path / "junk.mkv").write_bytes(np.random.default_rng(0).bytes(5000))
    source = source.format(tmp=tmp_path)
    bundle = detector["bundle"]
    for proc in (run_py(bundle, "--input", source, "--timeout", "1", "--output", tmp_path / "frames"),
                 _native(bundle, "--input", source, "--timeout", "1", "--output", tmp_path / "frames")):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == status and len(lines) == 1 and says in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr and "secret" not in proc.stderr + proc.stdout
    if "stopped after" in says:  # the frames answered before it stopped are kept
        assert sorted(p.name for p in (tmp_path / "frames").iterdir())[:3] == [f"frame_{i:06d}.png" for i in range(3)]


def test_without_gstreamer_one_line(detector, tmp_path):
    """A machine without GStreamer: its library hidden in a private mount namespace."""
    library = Path("/usr/lib/x86_64-linux-gnu/libgstreamer-1.0.so.0")
    if not library.exists() or not shutil.which("unshare"):
        pytest.skip("needs Debian's x86_64 libgstreamer and unshare")
    bundle, video = detector["bundle"], detector["videos"]["avi"]
    for cmd in ([sys.executable, "run.py"], ["./runtime/edgeq-run"]):
        script = f"mount --bind /dev/null {library.resolve()} && exec {' '.join(cmd)} --input {video}"
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=bundle,
                              timeout=120)
        if "Operation not permitted" in proc.stderr or "unshare failed" in proc.stderr:
            pytest.skip("user namespaces are not allowed here")
        assert proc.returncode == 2 and "reading video needs GStreamer" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_a_video_needs_preprocess_and_goes_alone(models, detector, tmp_path):
    bundle = _package(models["resnet_cnn"], tmp_path / "plain")
    video = detector["videos"]["avi"]
    for proc in (run_py(bundle, "--input", video), _native(bundle, "--input", video)):
        assert proc.returncode == 2 and "packaged without --preprocess" in proc.stderr, proc.stderr
    for proc in (run_py(detector["bundle"], "--input", video, "--self-test"),
                 _native(detector["bundle"], "--input", video, "--self-test")):
        assert proc.returncode == 2 and "give it alone" in proc.stderr, proc.stderr


ARM64_GST = Path(__file__).resolve().parent.parent / "build" / "arm64-gstreamer"  # scripts/setup.sh --tests
QEMU = shutil.which("qemu-aarch64")


def test_aarch64_loader_under_qemu_answers_as_the_host(detector, tmp_path):
    """edgeq-run for aarch64 (an arm64-cpu bundle) under qemu with Debian's arm64 GStreamer: the same frames and
    answers as the x86 loaders."""
    if QEMU is None or not (ARM64_GST / "plugins" / "libgstavi.so").exists():
        pytest.skip("needs qemu-aarch64 and Debian's arm64 GStreamer in build/arm64-gstreamer (scripts/setup.sh --tests)")
    import make_models

    model, labels, street = make_models.write_detector(tmp_path / "models")
    bundle = Path(json.loads(run_cli("package", model, "--device", "arm64-cpu", "-o", tmp_path / "arm", "-q", "--json",
                                     "--preprocess", "fit=letterbox", "--postprocess", "yolo", "--labels", labels,
                                     "--conf", "0.22", "--golden-input", street).stdout)["bundle_dir"])
    env = {"LD_LIBRARY_PATH": str(ARM64_GST / "lib"), "GST_PLUGIN_SYSTEM_PATH_1_0": str(ARM64_GST / "plugins"),
           "GST_PLUGIN_PATH_1_0": "", "GST_REGISTRY_FORK": "no", "GST_REGISTRY_1_0": str(tmp_path / "registry.bin"),
           "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    video = detector["videos"]["avi"]
    proc = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(bundle / "runtime" / "edgeq-run"), "--input", video,
                           "--json"], capture_output=True, text=True, timeout=600, cwd=bundle, env=env)
    assert proc.returncode == 0, proc.stderr
    rows, summary = _lines(proc.stdout)
    host, _ = _lines(_native(detector["bundle"], "--input", video, "--json").stdout)
    assert [r["frame"] for r in rows] == list(range(FRAMES)) and summary["frames"] == FRAMES
    for got, want in zip(rows, host):  # another CPU's float arithmetic: the same boxes, to rounding
        assert [d["class"] for d in got["detections"]] == [d["class"] for d in want["detections"]]
        for g, w in zip(got["detections"], want["detections"]):
            assert max(abs(a - b) for a, b in zip(g["box"], w["box"])) <= 0.05 and abs(g["score"] - w["score"]) <= 1e-3
