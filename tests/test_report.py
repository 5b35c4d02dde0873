"""--report: the pictures of a real benchmark (a small int8 host bundle measured here, power read from a
fake INA3221 sysfs tree) and of a real quantization report, read back from the HTML's SVG (every bar and
marker carries its numbers as a <title>, and its geometry must agree with them), the PNG, and the refusals."""

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from edgeq import report
from edgeq.templates.contract import Manifest
from edgeq.report import PRECISION_COLOURS

SVG = "{http://www.w3.org/2000/svg}"
RAILS = {"VDD_IN": (5000, 1000), "VDD_SOC": (5000, 200)}  # mV, mA: 5 W and 1 W


def package_has_report() -> bool:
    from edgeq.cli.main import build_parser
    from edgeq.errors import UsageError

    try:
        build_parser().parse_args(["package", "m.onnx", "--device", "host", "--report", "r.html"])
    except UsageError:
        return False
    return True


@pytest.fixture(scope="module")
def int8_bundle(models, tmp_path_factory):
    """The ResNet-style example in int8, its classifier (Gemm) kept in fp32 so that two precisions show; with
    ``edgeq package --report``: (bundle folder, manifest, the report it drew)."""
    root = tmp_path_factory.mktemp("int8")
    calib = root / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).standard_normal((16, 3, 32, 32)).astype(np.float32))
    page = root / "package.html" if package_has_report() else None
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", root, "-q", "--json",
                  "--precision", "int8", "--calibrate", calib, "--skip", "Gemm", *(["--report", page] if page else []))
    assert res.code == 0, res.stderr
    bundle_dir = Path(json.loads(res.stdout)["bundle_dir"])
    return bundle_dir, json.loads((bundle_dir / "manifest.json").read_text()), page


@pytest.fixture
def fake_power(tmp_path, monkeypatch):
    """Power read from an INA3221 hwmon tree laid out as on a Jetson (the host profile has no rails)."""
    folder = tmp_path / "sys/class/hwmon/hwmon3"
    folder.mkdir(parents=True)
    for n, (label, (mv, ma)) in enumerate(RAILS.items(), 1):
        (folder / f"in{n}_label").write_text(label)
        (folder / f"in{n}_input").write_text(str(mv))
        (folder / f"curr{n}_input").write_text(str(ma))
    import edgeq.rpc.bench

    monkeypatch.setattr(edgeq.rpc.bench, "power_config", lambda manifest: {"hwmon_glob": str(folder)})


# ---- reading the HTML back --------------------------------------------------------------------------


class Page(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.tags, self.cells, self.figures = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "figure":
            self.figures.append(dict(attrs)["id"])

    def handle_data(self, data):
        if self.tags and self.tags[-1][0] == "td":
            self.cells.append(data)


def svgs(text: str) -> dict[str, ET.Element]:
    """Each <figure id=NAME>'s <svg>, parsed."""
    return {m.group(1): ET.fromstring(m.group(2))
            for m in re.finditer(r'<figure id="([^"]+)">\s*(<svg.*?</svg>)\s*</figure>', text, re.S)}


def groups(svg: ET.Element, prefix: str) -> dict[str, ET.Element]:
    return {g.get("id"): g for g in svg.iter(f"{SVG}g") if (g.get("id") or "").startswith(prefix)}


def title(g: ET.Element) -> str:
    return g.find(f"{SVG}title").text


def points(g: ET.Element) -> np.ndarray:
    """The vertices of the first path in a group (M/L commands), as (x, y) pixels."""
    d = g.find(f".//{SVG}path").get("d")
    return np.array([float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", d)]).reshape(-1, 2)


def markers(g: ET.Element) -> np.ndarray:
    return np.array([(float(u.get("x")), float(u.get("y"))) for u in g.iter(f"{SVG}use")])


def check_self_contained(text: str) -> None:
    page = Page(text)
    tags = {t for t, _ in page.tags}
    assert "script" not in tags and "link" not in tags and "img" not in tags and "iframe" not in tags
    urls = set(re.findall(r"https?://[^\s\"')]+", text))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "ids repeat across the inlined figures"


def check_png(path: Path, min_height: int) -> None:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width == 880 and min_height <= image.height <= 6000, image.size
        grey = np.asarray(image.convert("L"))
        assert (grey < 128).mean() > 0.005  # text and bars, not a blank canvas


# ---- edgeq bench --report -----------------------------------------------------------------------------


def test_bench_html_report_from_a_real_run(int8_bundle, fake_power, tmp_path):
    bundle_dir = int8_bundle[0]
    page = tmp_path / "bench.html"
    res = run_cli("bench", bundle_dir, "--repeat", "400", "--warmup", "7", "--power", "sysfs", "--json",
                  "--report", page)
    assert res.code == 0, res.stderr
    out = json.loads(res.stdout)
    assert f"report: {page}" in res.stderr

    # the JSON: the keys it had, the runs in order, numbers rounded to what they mean
    assert {"runs", "min_ms", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "batch", "throughput_per_s",
            "warmup", "power", "where", "bundle_id"} <= set(out)
    assert len(out["samples_ms"]) == out["runs"] == 400 and len(out["warmup_ms"]) == 7
    assert min(out["samples_ms"]) == out["min_ms"] and max(out["samples_ms"]) == out["max_ms"]
    for value in out["samples_ms"] + out["warmup_ms"] + [out[k] for k in ("min_ms", "mean_ms", "p50_ms", "p99_ms")]:
        assert float(f"{value:.4g}") == value
    power = out["power"]
    assert power["average_w"] == {"VDD_IN": 5.0, "VDD_SOC": 1.0} and power["samples"] >= 1
    assert len(power["trace"]["t_s"]) == power["samples"] and power["trace"]["w"]["VDD_IN"] == [5.0] * power["samples"]

    text = page.read_text()
    check_self_contained(text)
    html = Page(text)
    assert html.figures == ["latency-histogram", "latency-runs", "power"]
    assert f"{out['p99_ms']:.4g} ms" in html.cells and "5 W" in html.cells
    figures = svgs(text)

    # histogram: one bar per bin, the counts add up to the runs, bar heights proportional to the counts
    bins = groups(figures["latency-histogram"], "latency-histogram-bin-")
    counts = [int(title(g).split()[0]) for g in bins.values()]
    assert sum(counts) == out["runs"]
    edges = [tuple(map(float, re.search(r"from (\S+) to (\S+) ms", title(g)).groups())) for g in bins.values()]
    bars = [points(g) for g in bins.values()]
    heights = np.array([np.ptp(b[:, 1]) for b in bars])
    assert heights.argmax() == np.argmax(counts)
    assert heights == pytest.approx(np.array(counts) * heights.max() / max(counts), abs=0.01)

    # p50/p90/p99 markers: the JSON's numbers, drawn inside the bar of the bin that holds them
    marks = groups(figures["latency-histogram"], "latency-histogram-p")
    for name in ("p50", "p90", "p99"):
        g = marks[f"latency-histogram-{name}"]
        assert float(title(g).split()[1]) == out[f"{name}_ms"]
        x = points(g)[0, 0]
        holding = [i for i, (lo, hi) in enumerate(edges) if lo * (1 - 1e-5) <= out[f"{name}_ms"] <= hi * (1 + 1e-5)]
        assert any(bars[i][:, 0].min() - 0.5 <= x <= bars[i][:, 0].max() + 0.5 for i in holding), (name, x, holding)

    # every run in order: 7 warm-up points (shaded), then 400 timed points; higher latency is higher up
    runs = figures["latency-runs"]
    warm, timed = (markers(groups(runs, f"latency-runs-{n}")[f"latency-runs-{n}"]) for n in ("warmup", "timed"))
    assert len(warm) == 7 and len(timed) == 400 and "latency-runs-warmup-span" in groups(runs, "latency-runs-warmup")
    xy = np.vstack([warm, timed])
    assert (np.diff(xy[:, 0]) > 0).all()  # in the order they ran
    values = np.array(out["warmup_ms"] + out["samples_ms"])
    order = np.argsort(values, kind="stable")
    assert (np.diff(xy[order, 1]) <= 1e-3).all()  # the y pixel falls as the latency rises

    # power: one line per rail with every trace point; the title has the energy per inference
    rails = groups(figures["power"], "power-rail-")
    assert set(rails) == {"power-rail-VDD_IN", "power-rail-VDD_SOC"}
    assert len(points(rails["power-rail-VDD_IN"])) == len(power["trace"]["t_s"])
    assert f"{power['energy_per_inference_mj']:.4g} mJ per inference" in "".join(figures["power"].itertext())

    # the same result draws the same bytes
    assert report.render_html(report.bench_report(out)) == text


def test_bench_png_report(int8_bundle, tmp_path):
    bundle_dir = int8_bundle[0]
    res = run_cli("bench", bundle_dir, "--repeat", "20", "--warmup", "2", "--power", "none", "--report", tmp_path / "b.PNG")
    assert res.code == 0, res.stderr
    check_png(tmp_path / "b.PNG", 700)
    assert [p.name for p in tmp_path.iterdir()] == ["b.PNG"]  # no temporary file left beside it


@pytest.mark.parametrize("name, code, message", [
    ("bench.pdf", 2, "give a file ending in .html or .png"),
    ("no-such-folder/bench.html", 6, "does not exist"),
])
def test_bench_report_refused_before_measuring(int8_bundle, tmp_path, name, code, message):
    res = run_cli("bench", int8_bundle[0], "--repeat", "5", "--report", tmp_path / name)
    assert res.code == code and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "warming up" not in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_nothing(int8_bundle, tmp_path, monkeypatch):
    from edgeq.errors import OutputError

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", full)
    with pytest.raises(OutputError, match="cannot write the report .*: No space left on device"):
        report.write(report.quantization_report(Manifest.from_json(int8_bundle[1])), tmp_path / "q.html")
    assert list(tmp_path.iterdir()) == []


# ---- the quantization report --------------------------------------------------------------------------


def test_quantization_report(int8_bundle, tmp_path):
    manifest = int8_bundle[1]
    layers = manifest["quantization"]["layers"]
    assert {l["precision"] for l in layers} == {"int8", "fp32"}  # the classifier kept in fp32
    page = report.write(report.quantization_report(Manifest.from_json(manifest)), tmp_path / "q.html")
    text = page.read_text()
    check_self_contained(text)
    html = Page(text)
    assert html.figures == ["layers", "weights"]
    figures = svgs(text)

    # one bar per layer, in order, coloured by its precision; SQNR bars as long as their dB
    bars = groups(figures["layers"], "layers-layer-")
    assert list(bars) == [f"layers-layer-{i}" for i in range(len(layers))]
    widths = []
    for (gid, g), layer in zip(bars.items(), layers):
        assert title(g).startswith(f"{layer['name']} ({layer['op_type']}): {layer['precision']}")
        fill = re.search(r"fill:\s*(#[0-9a-f]{6})", g.find(f".//{SVG}path").get("style")).group(1)
        assert fill == PRECISION_COLOURS[layer["precision"]]
        widths.append(np.ptp(points(g)[:, 0]))
    sqnr = np.array([l["sqnr_db"] or 0.0 for l in layers])
    assert sqnr.max() > 10 and np.array(widths) == pytest.approx(sqnr * max(widths) / sqnr.max(), abs=0.01)

    # weight bytes before and after, as the manifest has them
    w = manifest["quantization"]["weight_bytes"]
    before, after = w["float"], w["bundle"]
    weights = groups(figures["weights"], "weights-weights-")
    assert title(weights["weights-weights-float"]).endswith(f": {before} bytes")
    assert title(weights["weights-weights-bundle"]).endswith(f": {after} bytes")
    assert after < before

    check_png(report.write(report.quantization_report(Manifest.from_json(manifest)), tmp_path / "q.png"), 500)
    assert report.render_html(report.quantization_report(Manifest.from_json(manifest))) == text


def test_package_cli_report(int8_bundle, models, tmp_path):
    if not package_has_report():
        pytest.skip("edgeq package has no --report option yet (packager/cli/package.py)")
    _, manifest, page = int8_bundle
    assert page.read_text() == report.render_html(report.quantization_report(Manifest.from_json(manifest)))
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path / "out", "--report", tmp_path / "q.svg")
    assert res.code == 2 and "give a file ending in .html or .png" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []  # refused before the build


def test_fp32_bundle_report_says_there_is_no_quantization(int8_bundle, tmp_path):
    manifest = {k: v for k, v in int8_bundle[1].items() if k != "quantization"} | {"precision": "fp32"}
    text = report.write(report.quantization_report(Manifest.from_json(manifest)), tmp_path / "n.html").read_text()
    check_self_contained(text)
    assert "no quantization" in text and "<svg" not in text
    check_png(report.write(report.quantization_report(Manifest.from_json(manifest)), tmp_path / "n.png"), 100)


# ---- in a browser -------------------------------------------------------------------------------------


def test_html_renders_in_headless_chromium(int8_bundle, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium here (Debian package 'chromium'): the HTML is checked by parsing only")
    page = report.write(report.quantization_report(Manifest.from_json(int8_bundle[1])), tmp_path / "q.html")
    flags = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 2 and 'id="layers-layer-0"' in dom.stdout
    shot = tmp_path / "shot.png"
    run = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    bar = np.array([int(PRECISION_COLOURS["int8"][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(pixels.astype(int) - bar).sum(axis=1) < 30).mean() > 0.005  # the int8 bars are on screen
