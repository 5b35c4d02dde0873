"""``--report FILE``: pictures people would rather look at than read. ``bench_report`` draws a benchmark
(``edgeq bench``: the latency histogram with p50/p90/p99, the latency of every run in order with the warm-up
marked, power per rail over the window); ``quantization_report`` draws a manifest's ``quantization`` section
(``edgeq package``: SQNR and precision per layer, weight bytes before and after). ``write`` renders either as
one self-contained HTML file (the figures as inline SVG, a table of the numbers, no script, nothing fetched)
or as one PNG; the suffix picks which. The same input gives the same bytes: no dates, fixed SVG ids.

Every bar and marker carries its numbers as an SVG ``<title>`` (a tooltip in a browser), so the figures can
be read back: tests do.
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeq import __version__
from edgeq.templates.contract import Manifest, QuantizationReport
from edgeq.errors import OutputError, UsageError

FORMATS = (".html", ".png")
PRECISION_COLOURS = {"int8": "#2b7bb9", "fp16": "#e6862a", "fp32": "#8d8d8d"}
WARMUP_COLOUR, TIMED_COLOUR = "#b0b0b0", "#2b7bb9"
PERCENTILES = (("p50", "#1b9e3e", "-"), ("p90", "#e6862a", "--"), ("p99", "#c0392b", ":"))
WIDTH_IN = 8.0
DPI = 110  # PNG: an 8-inch figure is 880 pixels wide
MAX_LAYER_ROWS_IN = 40.0  # the per-layer figure grows with the layers up to this height (inches)
DENSE_RUNS = 2000  # more runs than this: the run-order figure shows min..max and median per group of runs
# Rendering settings: text stays text (searchable, small), ids come from a fixed salt, paths are not simplified
# (every run is a point of its own).
RC = {"svg.hashsalt": "edgeq-report", "svg.fonttype": "none", "path.simplify": False, "font.size": 9,
      "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 10, "legend.fontsize": 8,
      "font.family": "DejaVu Sans"}


@dataclasses.dataclass
class Figure:
    """One picture: ``draw(ax)`` draws into a matplotlib Axes and returns tooltips, by artist gid."""

    name: str  # the figure's HTML id, and the prefix of every id inside its SVG
    height_in: float
    draw: Callable[[Any], dict[str, str]]


@dataclasses.dataclass
class Report:
    title: str
    lines: list[str]  # a few sentences under the title
    rows: list[tuple[str, str]]  # the numbers, as a two-column table
    figures: list[Figure]


# ---- the output file -------------------------------------------------------------------------------------


def check_output(path: Path) -> str:
    """The format ``path`` asks for ("html" or "png"), checked before any work: a wrong suffix is a usage
    error, a folder that does not exist an output error."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(f"--report {path}: give a file ending in .html or .png (the suffix picks the format)")
    if path.is_dir():
        raise OutputError(f"--report {path}: is a folder; give a file name")
    if not path.resolve().parent.is_dir():
        raise OutputError(f"--report {path}: the folder {path.parent} does not exist")
    return suffix[1:]


def write(report: Report, path: Path) -> Path:
    """Render ``report`` in the format the suffix picks and write it whole: a temporary file beside ``path``,
    renamed over it, so a failure leaves nothing half-written."""
    path = Path(path)
    data = render_png(report) if check_output(path) == "png" else render_html(report).encode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write the report {path}: {err.strerror or err}") from None
    return path


# ---- rendering -------------------------------------------------------------------------------------------


def _mpl_figure(height_in: float):
    from matplotlib.figure import Figure as MplFigure  # no pyplot: no global figure state, no GUI backend

    return MplFigure(figsize=(WIDTH_IN, height_in), layout="constrained")


def figure_svg(figure: Figure) -> str:
    """One figure as an ``<svg>`` element for inlining: no XML prologue or metadata, ids prefixed with the
    figure's name (unique in the page), tooltips as ``<title>``."""
    import matplotlib

    with matplotlib.rc_context(RC):
        fig = _mpl_figure(figure.height_in)
        tips = figure.draw(fig.add_subplot()) or {}
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue().decode()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)
    for gid, tip in tips.items():
        svg = svg.replace(f'<g id="{gid}">', f'<g id="{gid}">\n   <title>{html.escape(tip)}</title>', 1)
    prefix = figure.name + "-"
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'xlink:href="#([^"]+)"', lambda m: f'xlink:href="#{prefix}{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)
    return svg.strip()


STYLE = """body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 62em; padding: 0 1em; color: #222; }
h1 { font-size: 1.3em; } p { max-width: 48em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
td { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; } td:first-child { color: #555; }
td.n { font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; } figure svg { max-width: 100%; height: auto; }
footer { color: #888; font-size: 0.8em; margin-top: 2em; }"""


def render_html(report: Report) -> str:
    rows = "\n".join(f'<tr><td>{html.escape(k)}</td><td class="n">{html.escape(v)}</td></tr>' for k, v in report.rows)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(report.title)}</title>", f"<style>\n{STYLE}\n</style>", "</head>", "<body>",
        f"<h1>{html.escape(report.title)}</h1>",
        *(f"<p>{html.escape(line)}</p>" for line in report.lines),
        f'<table class="numbers">\n{rows}\n</table>' if report.rows else "",
        *(f'<figure id="{f.name}">\n{figure_svg(f)}\n</figure>' for f in report.figures),
        f"<footer>edgeq {__version__}</footer>", "</body>", "</html>", "",
    ]
    return "\n".join(p for p in parts if p != "") + "\n"


def render_png(report: Report) -> bytes:
    """All figures stacked under the title and the table of numbers, in one PNG."""
    import matplotlib

    table_in = 0.17 * len(report.rows) + 0.15 if report.rows else 0.0
    head_in = 0.45 + 0.2 * len(report.lines)
    heights = [table_in] * bool(report.rows) + [f.height_in for f in report.figures]
    with matplotlib.rc_context(RC):
        fig = _mpl_figure(head_in + sum(heights) if heights else head_in + 0.3)
        fig.suptitle("\n".join([report.title, *report.lines]), fontsize=10, wrap=True)
        axes = list(fig.subplots(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]) if heights else []
        if report.rows:
            ax = axes.pop(0)
            ax.axis("off")
            width = max(len(k) for k, _ in report.rows)
            ax.text(0, 1, "\n".join(f"{k:<{width}}  {v}" for k, v in report.rows), family="DejaVu Sans Mono",
                    fontsize=8, va="top", ha="left", transform=ax.transAxes)
        for ax, figure in zip(axes, report.figures):
            figure.draw(ax)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


# ---- edgeq bench -----------------------------------------------------------------------------------------


def _g(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _log_scale(values: list[float]) -> bool:
    """Latencies spread over more than a decade (a few slow runs among fast ones): draw them on a log axis."""
    lo, hi = min(values), max(values)
    return lo > 0 and hi / lo > 10


def _log_axis(axis) -> None:
    """A log axis labelled 0.1, 0.2, 0.5, 1, 2, 5 ... (not 2x10^-1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _bin_edges(samples: list[float]):
    import numpy as np

    values = np.asarray(samples, np.float64)
    log = _log_scale(samples)
    auto = np.histogram_bin_edges(np.log10(values) if log else values, bins="auto")
    n = int(min(40, max(5, len(auto) - 1)))
    lo, hi = float(values.min()), float(values.max())
    if hi == lo:
        return np.array([lo * 0.99, lo * 1.01]) if lo else np.array([-0.5, 0.5]), False
    return (np.geomspace(lo, hi, n + 1) if log else np.linspace(lo, hi, n + 1)), log


def _draw_histogram(result: dict) -> Callable:
    def draw(ax) -> dict[str, str]:
        samples = result["samples_ms"]
        edges, log = _bin_edges(samples)
        counts, edges, patches = ax.hist(samples, bins=edges, color=TIMED_COLOUR, alpha=0.85)
        tips = {}
        for i, (patch, count) in enumerate(zip(patches, counts)):
            patch.set_gid(f"bin-{i}")
            tips[f"bin-{i}"] = f"{int(count)} runs from {edges[i]:.6g} to {edges[i + 1]:.6g} ms"
        for name, colour, style in PERCENTILES:
            value = result[f"{name}_ms"]
            line = ax.axvline(value, color=colour, linestyle=style, linewidth=1.5, label=f"{name} {_g(value)} ms")
            line.set_gid(name)
            tips[name] = f"{name} {value:.6g} ms"
        if log:
            ax.set_xscale("log")
            _log_axis(ax.xaxis)
        ax.set_xlabel("latency (ms)" + (", log scale" if log else ""))
        ax.set_ylabel("runs")
        ax.set_title(f"latency of {len(samples)} timed runs (batch {result['batch']}): "
                     f"mean {_g(result['mean_ms'])} ms, {_g(result['throughput_per_s'])} inferences/s")
        ax.legend(loc="upper right")
        return tips

    return draw


def _draw_runs(result: dict) -> Callable:
    def draw(ax) -> dict[str, str]:
        import numpy as np

        warm, timed = result.get("warmup_ms") or [], result["samples_ms"]
        everything = warm + timed
        runs = np.arange(1, len(everything) + 1)
        tips = {}
        if warm:
            span = ax.axvspan(0.5, len(warm) + 0.5, color="#f1f1f1", zorder=0)
            span.set_gid("warmup-span")
            tips["warmup-span"] = f"warm-up: runs 1 to {len(warm)}"
        for name, values, xs, colour in (("warmup", warm, runs[:len(warm)], WARMUP_COLOUR),
                                         ("timed", timed, runs[len(warm):], TIMED_COLOUR)):
            if not values:
                continue
            label = f"{'warm-up' if name == 'warmup' else 'timed'} ({len(values)} runs)"
            if len(everything) <= DENSE_RUNS:
                (line,) = ax.plot(xs, values, color=colour, marker="o", markersize=2.5, linewidth=0.8, label=label)
            else:  # too many points to draw one by one: median, and min..max, of consecutive groups
                groups = np.array_split(np.arange(len(values)), min(len(values), DENSE_RUNS // 2))
                v = np.asarray(values)
                mid = [xs[g].mean() for g in groups]
                ax.fill_between(mid, [v[g].min() for g in groups], [v[g].max() for g in groups], color=colour, alpha=0.3,
                                linewidth=0)
                (line,) = ax.plot(mid, [np.median(v[g]) for g in groups], color=colour, linewidth=0.8,
                                  label=label + ", median and min..max of groups")
            line.set_gid(name)
            tips[name] = f"{label}: {_g(min(values))} to {_g(max(values))} ms"
        p50 = ax.axhline(result["p50_ms"], color=PERCENTILES[0][1], linestyle="--", linewidth=1,
                         label=f"p50 of the timed runs {_g(result['p50_ms'])} ms")
        p50.set_gid("p50")
        tips["p50"] = f"p50 {result['p50_ms']:.6g} ms"
        if _log_scale(everything):
            ax.set_yscale("log")
            _log_axis(ax.yaxis)
        ax.set_xlim(0.5, len(everything) + 0.5)
        ax.set_xlabel("run, in the order they ran")
        ax.set_ylabel("latency (ms)")
        ax.set_title("every run in order: warm-up (shaded), then the timed runs")
        ax.legend(loc="upper right")
        return tips

    return draw


def _rail_id(rail: str) -> str:
    return "rail-" + re.sub(r"[^A-Za-z0-9_.-]", "_", rail)


def _draw_power(result: dict) -> Callable:
    def draw(ax) -> dict[str, str]:
        power = result["power"]
        trace = power["trace"]
        tips = {}
        timed_s = sum(result["samples_ms"]) / 1e3
        span = ax.axvspan(0, timed_s, color="#f1f1f1", zorder=0, label=f"the timed runs' latencies, end to end ({timed_s:.3g} s)")
        span.set_gid("timed-span")
        for rail, watts in trace["w"].items():
            values = [math.nan if w is None else w for w in watts]
            average = power["average_w"].get(rail)
            (line,) = ax.plot(trace["t_s"], values, linewidth=1, marker="." if len(values) <= 200 else None,
                              markersize=3, label=f"{rail}: average {_g(average)} W")
            line.set_gid(_rail_id(rail))
            tips[_rail_id(rail)] = f"{rail}: average {_g(average)} W over {len(values)} points"
        top = max((w for ws in trace["w"].values() for w in ws if w is not None), default=1.0)
        ax.set_ylim(0, top * 1.45 or 1.0)  # room for the legend above the lines
        ax.set_xlabel("time since the timed runs started (s)")
        ax.set_ylabel("power (W)")
        ax.set_title(f"power per rail ({power['source']}, {power['samples']} samples): {_g(power.get('total_w'))} W, "
                     f"{_g(power.get('energy_per_inference_mj'))} mJ per inference")
        ax.legend(loc="upper right", ncol=2)
        return tips

    return draw


def bench_report(result: dict) -> Report:
    """The report of one ``edgeq bench`` result (``edgeq.rpc.bench.bench``'s dict)."""
    power = result["power"]
    rows = [("bundle", result["bundle_id"]), ("measured on", result["where"]),
            ("runs", f"{result['runs']} timed after {result['warmup']} warm-up (batch {result['batch']})")]
    rows += [(key.replace("_ms", ""), f"{_g(result[key])} ms") for key in
             ("min_ms", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms")]
    rows.append(("throughput", f"{_g(result['throughput_per_s'], 6)} inferences/s"))
    if power.get("average_w"):
        rows += [(f"power {rail}", f"{_g(w)} W") for rail, w in power["average_w"].items()]
        rows += [("power, total", f"{_g(power['total_w'])} W ({power['source']}, {power['samples']} samples "
                                  f"in {_g(power['window_s'])} s)"),
                 ("energy", f"{_g(power['energy_per_inference_mj'])} mJ per inference")]
    else:
        rows.append(("power", f"not measured (--power {power.get('requested', '?')}: {power.get('used', 'none')})"))
    figures = [Figure("latency-histogram", 3.2, _draw_histogram(result)), Figure("latency-runs", 3.2, _draw_runs(result))]
    if power.get("trace"):
        figures.append(Figure("power", 3.2, _draw_power(result)))
    return Report(title=f"edgeq bench: {result['bundle_id']} on {result['where']}",
                  lines=[f"{result['device']} bundle {result['bundle']}"], rows=rows, figures=figures)


# ---- edgeq package: the manifest's quantization report ---------------------------------------------------


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e3:.4g} kB"


def _short(text: str, n: int = 36) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _draw_layers(report: QuantizationReport) -> Callable:
    def draw(ax) -> dict[str, str]:
        from matplotlib.patches import Patch

        layers = report.layers
        sqnr = any(layer.sqnr_db is not None for layer in layers)
        y = list(range(len(layers)))[::-1]  # the first layer on top
        widths = [(layer.sqnr_db or 0.0) if sqnr else 1.0 for layer in layers]
        bars = ax.barh(y, widths, color=[PRECISION_COLOURS.get(l.precision, "#444") for l in layers], height=0.7)
        tips = {}
        right = max(widths) if widths else 1.0
        for i, (bar, layer) in enumerate(zip(bars, layers)):
            bar.set_gid(f"layer-{i}")
            what = f"{layer.name} ({layer.op_type}): {layer.precision}"
            if layer.sqnr_db is not None:
                what += f", SQNR {layer.sqnr_db:.4g} dB"
            if layer.activation_dtype:
                what += f", activations {layer.activation_dtype} (zero point {layer.activation_zero_point})"
            if layer.activation and layer.activation != "per-tensor":
                what += f", input scales {layer.activation}"
            if layer.reason:
                what += f"; {layer.reason}"
            tips[f"layer-{i}"] = what
            if sqnr and layer.sqnr_db is None:  # no quantization noise to measure: say why instead
                ax.text(right * 0.01, y[i], _short(f"{layer.precision}, no SQNR: {layer.reason or 'not quantized'}", 70),
                        va="center", fontsize=7, color=PRECISION_COLOURS.get(layer.precision, "#444"))
            elif not sqnr:
                ax.text(0.02, y[i], _short(what.split(": ", 1)[1], 70), va="center", fontsize=7, color="white")
        ax.set_yticks(y, [_short(l.name) for l in layers], fontsize=7)
        for label, layer in zip(ax.get_yticklabels(), layers):  # the precision shows on every row, bar or not
            label.set_color(PRECISION_COLOURS.get(layer.precision, "#444"))
        ax.set_ylim(-0.6, len(layers) - 0.4)
        if sqnr:
            ax.set_xlabel("SQNR of the layer's output (dB, higher is better)")
            ax.set_title("SQNR per layer, coloured by the precision it runs in")
        else:
            ax.set_xticks([])
            ax.set_title("precision per layer")
        present = [p for p in PRECISION_COLOURS if any(l.precision == p for l in layers)]
        ax.legend(handles=[Patch(color=PRECISION_COLOURS[p], label=p) for p in present], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), title="precision")
        return tips

    return draw


def _draw_weights(report: QuantizationReport, precision: str) -> Callable:
    def draw(ax) -> dict[str, str]:
        before, after = report.weight_bytes.float, report.weight_bytes.bundle
        calibrated = report.kind == "calibrated"  # a QDQ model's weights are quantized already
        labels = ["float (the model)" if calibrated else "the model (QDQ)", f"{precision} (the bundle)"]
        bars = ax.barh([1, 0], [before / 1e3, after / 1e3], color=[PRECISION_COLOURS["fp32"], PRECISION_COLOURS["int8"]],
                       height=0.6)
        tips = {}
        for bar, gid, label, n in zip(bars, ("weights-float", "weights-bundle"), labels, (before, after)):
            bar.set_gid(gid)
            tips[gid] = f"{label}: {n} bytes"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {_kb(n)}", va="center", fontsize=8)
        ax.set_yticks([1, 0], labels)
        ax.set_xlim(0, max(before, after, 1) / 1e3 * 1.2)
        ax.set_xlabel("weights (kB)")
        ratio = f"{after / before:.2f}x" if before else "-"
        ax.set_title(f"weights: {_kb(before)} -> {_kb(after)} ({ratio} of the model's)")
        return tips

    return draw


def quantization_report(manifest: Manifest) -> Report:
    """The report of a bundle's quantization (``manifest.quantization``). A bundle without one gets a short
    report that says so, not an error: whether there is one is known only after the build (a QDQ model is
    quantized at the default --precision fp32), and a build that succeeded should not end in a failure."""
    m, report = manifest, manifest.quantization
    title = f"edgeq package: {m.bundle_id}"
    rows = [("bundle", m.bundle_id), ("device", m.device.profile), ("precision", m.precision)]
    if report is None:
        return Report(title=f"{title}: no quantization",
                      lines=[f"This is a {m.precision} bundle: every layer runs in float as the model "
                             "gives it, so there is no per-layer SQNR, precision or weight saving to draw. "
                             "Package with --precision int8 --calibrate DATA (or a QDQ model) for one."],
                      rows=[*rows, ("weights", _kb(m.weights.bytes))], figures=[])
    rows.append(("layers", ", ".join(f"{n} {p}" for p, n in report.precision_counts.items() if n) or str(len(report.layers))))
    if report.kind == "calibrated":
        calibration = report.calibration or {}
        rows.append(("calibration", f"{report.method} on {calibration.get('source', '?')} "
                                    f"({calibration.get('samples', '?')} samples)"))
    else:
        rows.append(("source", report.source))
    evaluation = report.evaluation or {}
    for key, label, fmt in (("rel_error", "relative output error", "{:.4g}"), ("cosine", "cosine vs float", "{:.6g}"),
                            ("top1_agreement", "top-1 agreement", "{:.1f}%"), ("top1_fp32", "top-1 float", "{:.1f}%"),
                            ("top1_quantized", "top-1 quantized", "{:.1f}%")):
        if evaluation.get(key) is not None:
            rows.append((label, fmt.format(evaluation[key])))
    if evaluation.get("boxes_kept_pct") is not None:
        rows.append(("fp32 boxes kept", f"{evaluation['boxes_kept_pct']:.1f}% of {evaluation.get('boxes_fp32', '?')}"))
    if evaluation.get("answer_loss") is not None:
        rows.append(("answer lost", f"{evaluation['answer_loss']:.3g} ({evaluation.get('answer_metric', '?')})"))
    if evaluation.get("source"):
        rows.append(("evaluated on", f"{evaluation['source']}"))
    rows.append(("weights", f"{_kb(report.weight_bytes.float)} -> {_kb(report.weight_bytes.bundle)}"))
    sqnr = sorted(l.sqnr_db for l in report.layers if l.sqnr_db is not None)
    if sqnr:
        rows.append(("SQNR", f"{sqnr[0]:.4g} to {sqnr[-1]:.4g} dB (median {sqnr[len(sqnr) // 2]:.4g})"))
    if report.fallbacks:
        rows.append(("back to float", ", ".join(f"{d['layer']} -> {d['to']}" for d in report.fallbacks)))
    if report.float_ops:
        rows.append(("float ops", ", ".join(f"{op} x{n}" for op, n in report.float_ops.items())))
    if report.float_biases:
        rows.append(("float biases", ", ".join(report.float_biases)))
    layers_in = min(MAX_LAYER_ROWS_IN, 1.0 + 0.24 * max(len(report.layers), 1))
    figures = [Figure("layers", layers_in, _draw_layers(report)), Figure("weights", 1.6, _draw_weights(report, m.precision))]
    return Report(title=f"{title}: quantization", lines=[report.source], rows=rows, figures=figures)
