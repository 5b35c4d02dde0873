"""INT8 post-training quantization on Relax.

    graph  = smooth.smooth(graph, smooth.factors(...))                  # depthwise inputs per channel: one pass
    taps   = calibrate.Taps(float graph, layers)                          # the float graph's one host build
    stats  = calibrate.collect(taps, layers, calibration data)            # two passes
    scales = CALIBRATORS[method].threshold(stats) / 127                   # per-tensor activation scales
    graph  = quantize_ops(graph, plans), then each of PASSES in order     # fold_bias, hoist_quantize, requantize

Layers named by ``--skip`` stay in float; with an accuracy budget the layers whose int8 version costs the
most accuracy on their own go back to the fallback precision (fp32, or fp16 with ``--fp16``) one at a time
until the budget holds. The report (manifest section ``quantization``) says what ran in which precision and
why, with per-layer SQNR and the output error on the evaluation data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.choices import DEFAULT_ANSWER_LOSS_LIMIT, DEFAULT_CALIB_SAMPLES, DEFAULT_METHOD, DEFAULT_PERCENTILE
from edgeq.templates.contract import QUANT_PARAMS, LayerRow, WeightBytes, significant
from edgeq.templates.contract import QuantizationReport as Report
from edgeq.errors import ModelError, UsageError
from edgeq.graph import Graph
from edgeq.load import LoadedModel
from edgeq.compile import HostRunner
from edgeq.quantize.calibrate import Taps, collect
from edgeq.quantize.calibrators import CALIBRATORS
from edgeq.quantize.data import Dataset, Preprocess, load_data, warn_line
from edgeq.quantize.fold_bias import fold_bias
from edgeq.quantize import bias_correction, judge, shared_scales, smooth
from edgeq.quantize.hoist_quantize import hoist_quantize
from edgeq.quantize.notes import PassNotes
from edgeq.quantize.commute_qdq import commute_qdq
from edgeq.quantize.layers import Layer, find_layers
from edgeq.quantize.lower_qdq import is_qdq, lower_qdq  # noqa: F401 - is_qdq is part of this API
from edgeq.quantize.quantize_ops import QMAX, SWITCHES, LayerPlan, layer_plans, quantize_ops, quantize_weight
from edgeq.quantize.requantize import requantize

MIN_CALIBRATION_SAMPLES = 10
MAX_EVAL_SAMPLES = 1000
# Below this cosine against the float model (or with NaN/Inf), the quantized model has collapsed: no bundle.
COLLAPSE_COSINE = 0.9

# The passes after quantize_ops, in order. Each is ``pass(graph, notes) -> graph``; what one leaves for the
# report it writes into ``notes`` (PassNotes).
PASSES: list[tuple[str, Callable[[Graph, PassNotes], Graph]]] = [
    ("fold_bias", fold_bias), ("hoist_quantize", hoist_quantize), ("requantize", requantize)]
QDQ_PASSES: list[tuple[str, Callable[[Graph, PassNotes], Graph]]] = [*PASSES, ("commute_qdq", commute_qdq)]


@dataclasses.dataclass
class QuantizeArgs:
    calibrate: Path
    method: str = DEFAULT_METHOD
    percentile: float = DEFAULT_PERCENTILE
    samples: int = DEFAULT_CALIB_SAMPLES
    skip: tuple[str, ...] = ()
    fallback: str = "fp32"  # precision of layers that leave int8 by the budget: fp32 or fp16
    accuracy_budget: float | None = None  # Evaluator.budget_metric's units: points, % of boxes, or relative error
    eval: Path | None = None
    preprocess: Preprocess | None = None
    task: judge.Task | None = None  # what the answer is (--postprocess): what the accuracy budget judges
    activation_scales: str = "auto"  # "auto": per-channel depthwise inputs, per-token sequence MatMuls; "per-tensor"
    bias_correction: bool = True  # take each int8 layer's mean output shift out in its bias (bias_correction)
    answer_loss_limit: float = DEFAULT_ANSWER_LOSS_LIMIT  # a warning past it (Evaluator.answer's units: %, points)
    strict_accuracy: bool = False  # an error instead of that warning

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(calibrate=str(self.calibrate), eval=str(self.eval) if self.eval else None, skip=list(self.skip),
                   preprocess=self.preprocess.to_dict() if self.preprocess else None,
                   task=self.task.to_dict() if self.task else None)
        return out


@dataclasses.dataclass(frozen=True)
class QuantizeResult:
    graph: Graph
    layers: list[Layer]
    report: Report  # the manifest's ``quantization``
    scales: dict[str, np.ndarray]  # what quant_params.npz holds
    first_sample: list[np.ndarray] | None = None  # the first model run of the calibration data (the golden input)
    first_sample_source: str = ""
    smoothing: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # weight name -> s (smooth.py)
    corrections: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # weight name -> c (bias_correction.py)


def check_args(args: QuantizeArgs) -> None:
    if args.method not in CALIBRATORS:
        raise UsageError(f"unknown calibration '{args.method}'; choose one of: {', '.join(CALIBRATORS)}")
    if not 0 < args.percentile <= 100:
        raise UsageError(f"--percentile {args.percentile} must be in (0, 100]")
    if args.samples < 1:
        raise UsageError("--calib-samples must be at least 1")
    if args.fallback not in ("fp32", "fp16"):
        raise UsageError(f"fallback precision must be fp32 or fp16, not {args.fallback}")
    if args.activation_scales not in ("auto", "per-tensor"):
        raise UsageError(f"--activation-scales must be auto or per-tensor, not {args.activation_scales}")
    if args.accuracy_budget is not None and not 0 <= args.accuracy_budget < float("inf"):
        raise UsageError(f"--accuracy-budget must be a number >= 0, not {args.accuracy_budget}")
    if not 0 <= args.answer_loss_limit <= 100:
        raise UsageError(f"--max-answer-loss must be from 0 to 100 (%), not {args.answer_loss_limit}")


def _apply_skip(layers: list[Layer], skip: tuple[str, ...]) -> None:
    for item in skip:
        hits = [l for l in layers if item in (l.name, l.op_type, l.weight)]
        if not hits:
            names = ", ".join(l.name for l in layers)
            raise UsageError(f"--skip '{item}' matches no quantizable layer or op type; layers: {names}")
        for layer in hits:
            layer.precision, layer.reason = "fp32", f"--skip {item}"


def _plans(layers: list[Layer], act_scales: dict[str, float],
           corrections: dict[str, np.ndarray] | None = None) -> dict[str, LayerPlan]:
    return layer_plans(layers, act_scales, corrections)


def build_graph(graph: Graph, layers: list[Layer], act_scales: dict[str, float], notes: PassNotes | None = None,
                corrections: dict[str, np.ndarray] | None = None) -> Graph:
    """The quantized graph; ``notes`` receives what the passes report (biases left as float adds)."""
    out = quantize_ops(graph, _plans(layers, act_scales, corrections))
    notes = notes if notes is not None else PassNotes()
    for _, run in PASSES:
        out = run(out, notes)
    return out


def _check_collapse(metrics: dict[str, Any], model_name: str, source: str) -> None:
    """Refuse a quantized model whose own evaluation shows it no longer computes what the float one does."""
    cosine = metrics["cosine"]
    if np.isfinite(cosine) and np.isfinite(metrics["rel_error"]) and cosine >= COLLAPSE_COSINE:
        return
    shown = f"cosine {cosine:.3f}" if np.isfinite(cosine) else "NaN/Inf outputs"
    raise ModelError(
        f"{model_name}: the int8 model collapses ({shown} against fp32 on {metrics['samples']} sample(s) of {source}); "
        "calibrate with data that looks like real inputs, or keep layers in float with --skip or "
        "--precision mixed --accuracy-budget")


def _agreement(q: np.ndarray, f: np.ndarray) -> dict[str, float]:
    """Relative error and cosine of ``q`` against ``f``, scale-free: outputs of 1e-10 (random-weight models
    whose activations vanish) compare as well as outputs of 1 (no absolute floor on the norms)."""
    q, f = q.astype(np.float64), f.astype(np.float64)
    if not (np.isfinite(q).all() and np.isfinite(f).all()):
        return {"rel_error": float("nan"), "cosine": float("nan")}
    top = max(float(np.abs(f).max(initial=0)), float(np.abs(q).max(initial=0)))
    if top == 0 or not np.isfinite(top):
        same = top == 0
        return {"rel_error": 0.0 if same else float("nan"), "cosine": 1.0 if same else float("nan")}
    q, f = q / top, f / top
    nf, nq = float(np.linalg.norm(f)), float(np.linalg.norm(q))
    rel = float(np.linalg.norm(q - f) / nf) if nf > 0 else float("inf")
    cosine = float(np.sum(q * f) / (nq * nf)) if nq > 0 and nf > 0 else 0.0
    return {"rel_error": rel, "cosine": cosine}


class Evaluator:
    """Runs the float graph once over the evaluation data and compares any candidate graph against it. ``task``
    (``judge.Task``, from ``--postprocess``) says what the answer is, and so what the accuracy budget judges."""

    def __init__(self, graph: Graph, data: Dataset, specs, task: judge.Task | None = None,
                 taps: Taps | None = None):
        """``taps``: ``judged(graph)`` already built with taps (``Taps``), to run the float reference on."""
        self.data, self.specs, self.task = data, specs, task
        self.detector = judged(graph) is not graph
        if taps is None:
            self.reference_runs = self._runs(graph)
        else:
            self.reference_runs = [taps(batch).outputs for batch in data.batches(specs)]
        self.reference = self._judged(self.reference_runs)

    def runner(self, graph: Graph) -> HostRunner:
        """``graph`` compiled for this evaluation: ``judged(graph)``."""
        return HostRunner(judged(graph) if self.detector else graph)

    def _runs(self, graph: Graph | HostRunner) -> list[list[np.ndarray]]:
        """Every output, per batch."""
        runner = graph if isinstance(graph, HostRunner) else self.runner(graph)
        return [list(runner(batch)) for batch in self.data.batches(self.specs)]

    def _judged(self, runs: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The tensor cosine and relative error are reported on, per batch: the first output; a detector's
        boxes and scores side by side."""
        if not self.detector:
            return [run[0] for run in runs]
        rows = len(self.specs[0].shape) and self.specs[0].shape[0] or 1
        return [np.concatenate([o.reshape(rows, -1) for o in run], axis=1)[:, None, :] for run in runs]

    def metrics(self, candidate: Graph | HostRunner) -> dict[str, Any]:
        """The candidate's agreement with the float graph; ``candidate`` a graph, or one already compiled
        (``runner``: a switchable graph measured with one set of switches)."""
        runs = self._runs(candidate)
        got = self._judged(runs)

        def flat(arrays):
            return np.concatenate([r.reshape(len(r), -1) if r.ndim > 1 else r[None] for r in arrays])

        f, q = flat(self.reference), flat(got)
        out = {"samples": int(len(f)), **_agreement(q, f)}
        # every output on its own scale: the worst one's relative error
        per_output = [_agreement(flat([run[k] for run in runs]), flat([run[k] for run in self.reference_runs]))["rel_error"]
                      for k in range(len(runs[0]))]
        out["worst_rel_error"] = max(per_output, key=lambda v: (np.isnan(v), v))
        if self.reference[0].ndim == 2 and self.reference[0].shape[-1] > 1:  # logits: classification metrics
            top_f, top_q = f.argmax(axis=1), q.argmax(axis=1)
            out["top1_agreement"] = float(np.mean(top_f == top_q) * 100)
            if self.data.labels is not None:
                labels = self.data.labels[: len(top_f)]
                out["top1_fp32"] = float(np.mean(top_f == labels) * 100)
                out["top1_quantized"] = float(np.mean(top_q == labels) * 100)
        if self.task is not None and self.task.kind == "yolo" and self.detector:
            out.update(judge.boxes_kept(self.reference_runs, runs, self.task))
        return out

    def answer(self, metrics: dict[str, Any]) -> tuple[str, float] | None:
        """(what of the answer is lost, how much), where the answer is known: top-1 against the labels of the
        evaluation data, the boxes of ``--postprocess yolo``, the top-1 class of ``--postprocess classify``."""
        if "top1_fp32" in metrics:
            return "top-1 drop (points)", metrics["top1_fp32"] - metrics["top1_quantized"]
        if "boxes_kept_pct" in metrics:
            return "fp32 boxes lost (%)", 100.0 - metrics["boxes_kept_pct"]
        if self.task is not None and self.task.kind == "classify" and "top1_agreement" in metrics:
            return "top-1 changed (% of samples)", 100.0 - metrics["top1_agreement"]
        return None

    def budget_metric(self, metrics: dict[str, Any]) -> tuple[str, float]:
        """(what the accuracy budget is spent on, its value): the answer where it is known, else the worst
        relative output error."""
        return self.answer(metrics) or ("worst relative output error", metrics["worst_rel_error"])


def judged(graph: Graph) -> Graph:
    """What the evaluation compares of ``graph``: the graph itself; for a detector ending in NonMaxSuppression,
    the graph up to the boxes and scores it selects from (``edgeq.nms.selection_inputs``: the selected rows of
    two builds differ in which, not by how much)."""
    from edgeq.nms import selection_inputs

    return selection_inputs(graph) or graph


def _sqnr_per_layer(graph: Graph, taps: Taps, layers: list[Layer], act_scales: dict[str, float], data: Dataset,
                    specs, corrections: dict[str, np.ndarray]) -> dict[str, float]:
    """SQNR (dB) of each quantized layer's output against the float model's (``taps``' layer outputs), all
    layers quantized."""
    names = [l.weight for l in layers]
    graph = judged(graph)  # as ``taps`` was built: the quantized side computes the same outputs
    quant = HostRunner(quantize_ops(graph, _plans(layers, act_scales, corrections), taps=names))
    signal, noise = np.zeros(len(names)), np.zeros(len(names))
    n_out = graph.num_outputs
    for batch in data.batches(specs):
        for i, (f, q) in enumerate(zip(taps(batch).layer_outputs, quant(batch)[n_out:])):
            signal[i] += float(np.sum(f.astype(np.float64) ** 2))
            noise[i] += float(np.sum((f.astype(np.float64) - q) ** 2))
    return {n: float(10 * np.log10(s / nz)) if nz > 0 else float("inf") for n, s, nz in zip(names, signal, noise)}


def quantize(graph: Graph, model: LoadedModel, args: QuantizeArgs, note: Callable[[str], None] = lambda _: None,
             tick: Callable[[str, int, int], None] | None = None,
             warn: Callable[[str], None] | None = None,
             target_precisions: Callable[[Graph, list[Layer]], dict[str, tuple[str, str]]] | None = None
             ) -> QuantizeResult:
    """Quantize ``graph`` (the float import of ``model``). ``note`` receives progress lines, ``warn`` warnings
    (default: a line on stderr). ``target_precisions``: the target's say on its int8 layers (the backend's
    ``layer_precisions``: weight name -> (precision, why)), asked once the activation scales are chosen."""
    check_args(args)
    specs = model.inputs
    calibrator = CALIBRATORS[args.method]
    calib = load_data(args.calibrate, specs, "calibration", args.preprocess, args.samples, MIN_CALIBRATION_SAMPLES,
                      warn=warn)
    evaluation = (load_data(args.eval, specs, "evaluation", args.preprocess, MAX_EVAL_SAMPLES) if args.eval
                  else calib)
    layers = find_layers(graph, model.onnx_model)
    if not layers:
        raise UsageError(f"{model.path.name} has no Conv, Gemm or MatMul with weights to quantize; package it as fp32")
    _apply_skip(layers, args.skip)
    runs = calib.count // (specs[0].shape[0] if specs[0].shape else 1)
    if args.activation_scales == "per-tensor":
        for layer in layers:
            layer.activation = "per-tensor"
    chosen = target_precisions(graph, layers) if target_precisions is not None else {}
    for layer in layers:
        if layer.weight in chosen and layer.precision == "int8":
            layer.precision, layer.reason = chosen[layer.weight]
    for precision, why in sorted(set(chosen.values())):
        count = sum(1 for choice in chosen.values() if choice == (precision, why))
        note(f"{count} layer(s) in {precision} for the target ({why})")
    smoothing = smooth.factors(graph, layers, lambda: calib.batches(specs)) if args.activation_scales == "auto" else {}
    if smoothing:
        graph = smooth.smooth(graph, layers, smoothing)
        for layer in layers:
            if layer.weight in smoothing:
                layer.activation = "per-channel"
        note(f"{len(smoothing)} depthwise layer(s) read their input per channel (its ranges moved into the weights)")
    note(f"calibrating {len(layers)} layers on {calib.count} samples from {calib.source} ({args.method})")
    taps = Taps(judged(graph), layers)  # the float graph's one build: calibration, bias correction, evaluation
    stats = collect(taps, layers, lambda: calib.batches(specs), calibrator.needs_histogram,
                    (lambda phase, i: tick(phase, i, runs)) if tick else None)
    thresholds = {l.weight: calibrator.threshold(st, percentile=args.percentile) for l, st in zip(layers, stats)}
    shared = shared_scales.groups(graph, layers)  # a concatenation and its parts: one scale (TensorRT's rule)
    act_scales = {w: (t if t > 0 else 1.0) / QMAX for w, t in shared_scales.share(shared, thresholds).items()}
    if shared:
        note(f"{sum(map(len, shared))} layers in {len(shared)} group(s) read a concatenation or its parts at one "
             "scale (each part written int8 into it)")

    bad = [w for w, t in thresholds.items() if not np.isfinite(t) or t < 0]
    if bad:
        raise ModelError(f"{model.path.name}: calibration found NaN/Inf activations at {len(bad)} layer(s) "
                         f"(first: {bad[0]}); check the calibration data and the model on it")
    corrections = {}
    if args.bias_correction:
        corrections = bias_correction.corrections(graph, taps, layers, act_scales, lambda: calib.batches(specs),
                                                  (lambda i: tick("bias", i, runs)) if tick else None)
        note(f"bias correction: the mean output shift of int8 rounding taken out of {len(corrections)} layer(s)")
    evaluator = Evaluator(graph, evaluation, specs, args.task, taps)
    notes = PassNotes()
    quantized = build_graph(graph, layers, act_scales, notes, corrections)
    metrics = evaluator.metrics(quantized)
    decisions = []
    if args.accuracy_budget is not None:
        label, value = evaluator.budget_metric(metrics)
        if value > args.accuracy_budget:
            quantized, notes, metrics, value, decisions = _fit_budget(graph, layers, act_scales, corrections,
                                                                     evaluator, args, label, value, note)
        metrics.update(budget=args.accuracy_budget, budget_metric=label, budget_value=value,
                       budget_met=bool(value <= args.accuracy_budget))
    source = evaluation.source if args.eval else "the calibration data"
    _check_collapse(metrics, model.path.name, source)
    answer = evaluator.answer(metrics)
    if answer is not None:
        metrics.update(answer_metric=answer[0], answer_loss=answer[1])
        if args.accuracy_budget is None and answer[1] > args.answer_loss_limit:
            _answer_lost(model.path.name, answer, metrics, args, source, warn)
    if notes.float_biases:
        kept = notes.float_biases
        note(f"{len(kept)} bias(es) too large for int32 at their layer's scale stay float adds: "
             f"{', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''}")

    sqnr = _sqnr_per_layer(graph, taps, layers, act_scales, evaluation, specs, corrections)
    scales, layer_rows = {}, []
    for layer, st in zip(layers, stats):
        row = layer.to_dict()
        row.update(calibration=st.to_dict(), sqnr_db=round(sqnr[layer.weight], 2) if layer.precision == "int8" else None)
        if layer.precision != "int8":
            row["activation"] = None
        else:
            w_scale = quantize_weight(graph.weights[layer.weight], layer.channel_axis)[1]
            scales[f"{layer.name}/weight_scale"] = w_scale
            # shown to 6 significant digits; quant_params.npz holds the exact scales
            row.update(weight_scale_min=significant(w_scale.min(), 6), weight_scale_max=significant(w_scale.max(), 6))
            if layer.weight in smoothing:
                scales[f"{layer.name}/input_channel_scale"] = smoothing[layer.weight]
            if layer.weight in corrections:  # added to the layer's output (its bias), per output channel
                scales[f"{layer.name}/bias_correction"] = corrections[layer.weight]
            if layer.activation != "per-token":  # a per-token layer's scales are computed at run time, per row
                scales[f"{layer.name}/activation_scale"] = np.float32(act_scales[layer.weight])
                row.update(activation_scale=significant(act_scales[layer.weight], 6),
                           activation_threshold=significant(thresholds[layer.weight], 6))
            group = next((g for g in shared if layer in g), None)
            if group is not None:
                row["shared_scale_with"] = [l.name for l in group if l is not layer]
        layer_rows.append(row)
    report = Report(
        kind="calibrated",
        source=f"edgeq post-training quantization, {args.method} calibration on {calib.source}",
        precision_counts=_precision_counts(layers),
        layers=[LayerRow.from_json(row, "quantization.layers") for row in layer_rows],
        weight_bytes=_weight_bytes(graph, quantized),
        float_ops=_float_ops(quantized),
        float_biases=list(notes.float_biases),  # round(bias / scale) beyond 2^30: added in float after the dequantize
        method=args.method,
        calibration={"source": calib.source, "samples": calib.count,
                     "percentile": args.percentile if args.method == "percentile" else None},
        evaluation={"source": evaluation.source if args.eval else f"{calib.source} (calibration data; no --eval)",
                    **{k: significant(v, 6) if isinstance(v, float) and np.isfinite(v) else v for k, v in metrics.items()}},
        fallbacks=decisions,
        scheme={"activations": "int8, symmetric (zero point 0): per-tensor, calibrated; per-channel for depthwise "
                               "convolutions (ranges moved into the weights); per-token at run time for MatMul/Gemm "
                               "reading a sequence (layers[].activation)",
                "shared_scales": ("the layers reading a concatenation and those reading its parts (or a split, "
                                  "slice, max-pool or nearest resize of them) read at one scale, the largest of "
                                  "their calibrated ones, so that each part is made in int8 and written into the "
                                  "concatenation (layers[].shared_scale_with)"),
                "weights": "int8, per-output-channel, symmetric",
                "accumulation": "int32, bias added in int32, requantized or dequantized in the epilogue",
                "bias_correction": ("each int8 layer with a calibrated input scale adds the mean output shift of its "
                                    "rounding, measured on the calibration data, back into its bias "
                                    "(quant_params LAYER/bias_correction)") if args.bias_correction else "off"},
        scales_file=QUANT_PARAMS,
        args=args.to_dict(),
    )
    return QuantizeResult(quantized, layers, report, scales, next(calib.batches(specs)), calib.source, smoothing,
                          corrections)


def _answer_lost(model_name: str, answer: tuple[str, float], metrics: dict[str, Any], args: QuantizeArgs, source: str,
                 warn: Callable[[str], None] | None) -> None:
    """One line where int8 loses more of the answer than ``--max-answer-loss``: a warning (the bundle is written,
    the report says so), or with ``--strict-accuracy`` an error (no bundle)."""
    label, value = answer
    said = {"fp32 boxes lost (%)": f"loses {value:.3g}% of fp32's boxes",
            "top-1 changed (% of samples)": f"changes the top-1 class of {value:.3g}% of the samples",
            "top-1 drop (points)": f"drops top-1 by {value:.3g} points"}.get(label, f"{label} {value:.3g}")
    line = (f"{model_name}: int8 {said} ({metrics['samples']} sample(s) of {source}), past --max-answer-loss "
            f"{args.answer_loss_limit:g} (cosine "
            f"{metrics['cosine']:.5f}); --precision mixed --accuracy-budget {args.answer_loss_limit:g} keeps the "
            "layers that cost it in float")
    if args.strict_accuracy:
        raise ModelError(line + " (--strict-accuracy: no bundle written)")
    (warn or warn_line)(line)


def _fit_budget(graph: Graph, layers: list[Layer], act_scales: dict[str, float], corrections: dict[str, np.ndarray],
                evaluator: Evaluator, args: QuantizeArgs, label: str, value: float, note: Callable[[str], None]):
    """Layers back to ``args.fallback`` until the budget holds: those whose int8 version alone costs the most
    first, one at a time. Measured on one compiled switchable graph (``quantize_ops`` ``switches``: each layer
    int8 or float by a parameter, no recompiling per try), then confirmed on the real build (whose int32
    requantizing rounds a little otherwise); where that misses the budget the next layers go too, one build each.
    Returns (the real build, its passes' notes, its metrics, its budget value, the decisions); the layers'
    precisions are set."""
    candidates = [l for l in layers if l.precision == "int8"]
    names = [l.weight for l in candidates]
    note(f"{label} {value:.4g} exceeds the budget {args.accuracy_budget}: measuring each of {len(candidates)} int8 "
         "layers alone (one switchable build)")
    plans = _plans(layers, act_scales, corrections)
    runner = evaluator.runner(quantize_ops(graph, plans, switches=names))

    def measure(on: set[str]) -> float:
        runner.set_param(SWITCHES, np.array([n in on for n in names], bool))
        return evaluator.budget_metric(evaluator.metrics(runner))[1]

    alone = {n: measure({n}) for n in names}
    decisions: list[dict] = []

    def fall_back(layer: Layer, value: float, how: str = "") -> None:
        layer.precision = args.fallback
        layer.reason = f"accuracy budget: alone in int8 it costs {alone[layer.weight]:.4g} ({label})"
        decisions.append({"layer": layer.name, "to": args.fallback, "alone": significant(alone[layer.weight], 6),
                          "after": significant(value, 6)})
        note(f"  {layer.name} -> {args.fallback}: {label} now {value:.4g}{how}")

    on = set(names)
    order = sorted(candidates, key=lambda l: -alone[l.weight])
    for layer in order:
        if value <= args.accuracy_budget:
            break
        on.discard(layer.weight)
        value = measure(on)
        fall_back(layer, value)

    def built() -> tuple[Graph, PassNotes, dict[str, Any], float]:
        notes = PassNotes()
        quantized = build_graph(graph, layers, act_scales, notes, corrections)
        metrics = evaluator.metrics(quantized)
        return quantized, notes, metrics, evaluator.budget_metric(metrics)[1]

    quantized, notes, metrics, value = built()
    for layer in order:  # the real build: where its rounding misses the budget, one more layer at a time
        if value <= args.accuracy_budget or layer.precision != "int8":
            continue
        layer.precision = args.fallback
        quantized, notes, metrics, value = built()
        fall_back(layer, value, " (as built)")
    return quantized, notes, metrics, value, decisions


def _precision_counts(layers: list[Layer]) -> dict[str, int]:
    return {p: sum(l.precision == p for l in layers) for p in ("int8", "fp16", "fp32")}


def _weight_bytes(before: Graph, after: Graph) -> WeightBytes:
    floats = int(sum(w.nbytes for w in before.weights.values()))
    stored = int(sum(w.nbytes for w in after.weights.values()))
    return WeightBytes(float=floats, bundle=stored, ratio=round(stored / max(floats, 1), 4))


FLOAT_OPS = ("relax.nn.conv2d", "relax.matmul", "relax.mean", "relax.nn.avg_pool2d", "relax.nn.softmax",
             "relax.nn.layer_norm", "relax.concat")


def _float_ops(graph: Graph) -> dict[str, int]:
    """Ops that still compute in float after quantization, by op: float convolutions and matrix products,
    and the reductions and concatenations that have no integer form here."""
    from edgeq.graph import call_op

    counts: dict[str, int] = {}
    for b in graph.bindings():
        op = call_op(b.value)
        if op not in FLOAT_OPS or not str((b.value.args[0] if op in FLOAT_OPS[:2] else b.value).ty.dtype).startswith(
                "float"):  # (a concatenation of int8 parts, hoist_quantize's, moves int8)
            continue
        counts[op] = counts.get(op, 0) + 1
    return counts


def _onnx_consumers(model) -> dict[str, Any]:
    """initializer name -> the Conv/Gemm/MatMul node that uses it, directly or through a DequantizeLinear."""
    produced_by_dq = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1:
            out.setdefault(produced_by_dq.get(node.input[1], node.input[1]), node)
    return out


def lower_prequantized(graph: Graph, model: LoadedModel) -> QuantizeResult:
    """Lower a pre-quantized (QDQ) model to integer kernels with the scales it carries."""
    lowered, qdq_layers = lower_qdq(graph)
    notes = PassNotes()
    for _, run in QDQ_PASSES:
        lowered = run(lowered, notes)
    consumers = _onnx_consumers(model.onnx_model)
    layers, rows = [], []
    for ql in qdq_layers:
        node = consumers.get(ql.weight)
        op_type = node.op_type if node is not None else ("Conv" if ql.kind == "conv2d" else "MatMul")
        layer = Layer(name=(node.name if node is not None and node.name else f"{op_type}_{ql.weight}"), op_type=op_type,
                      kind=ql.kind, weight=ql.weight, channel_axis=0, precision="int8" if ql.integer else "fp32",
                      reason=ql.reason)
        layers.append(layer)
        rows.append({**layer.to_dict(), "activation_dtype": ql.activation_dtype,
                     "activation_zero_point": int(ql.activation_zero_point)})
    report = Report(
        kind="pre-quantized",
        source="pre-quantized ONNX (QDQ): scales and zero points from the model",
        precision_counts=_precision_counts(layers),
        layers=[LayerRow.from_json(row, "quantization.layers") for row in rows],
        weight_bytes=_weight_bytes(graph, lowered),
        float_ops=_float_ops(lowered),
        float_biases=list(notes.float_biases),
        method=None, calibration=None, evaluation=None, fallbacks=[],
        scheme={"activations": "the model's QDQ scales and zero points (int8 or uint8)",
                "weights": "the model's QDQ scales (per-tensor or per-channel)",
                "accumulation": "int32; elementwise ops between integer layers (Add, Relu, requantize) run fused "
                                "into the integer kernels' epilogues; ops in float_ops compute in float on "
                                "dequantized values"},
        scales_file=None, args=None,
    )
    return QuantizeResult(lowered, layers, report, {})
