"""edgeq package: parse the arguments and call ``edgeq.package.package``."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from edgeq.choices import (CALIBRATION_METHODS, DEFAULT_ANSWER_LOSS_LIMIT, DEFAULT_CALIB_SAMPLES, DEFAULT_METHOD,
                           DEFAULT_OUTPUT, DEFAULT_PERCENTILE, PRECISIONS, REFERENCE_CHOICES, RUNTIME_CHOICES)
from edgeq.templates.contract import QuantizationReport


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "package",
        help="compile an ONNX model into a runtime bundle for a device",
        description="Compile an ONNX model for a device and write OUTDIR/<name>-<device>/ and its .tar.gz.",
    )
    parser.add_argument("model", type=Path, help="the ONNX model")
    parser.add_argument("--device", required=True, help="device profile or alias (see 'edgeq devices')")
    parser.add_argument("-o", "--output", type=Path, default=Path(DEFAULT_OUTPUT),
                        help=f"output folder (default: {DEFAULT_OUTPUT})")
    add_graph_options(parser)
    parser.add_argument("--name", help="bundle name (default: the model file's name)")
    q = parser.add_argument_group("export")
    q.add_argument("--export-qdq", type=Path, metavar="FILE.onnx",
                   help="also write the model with edgeq's calibration as ONNX QDQ (int8 per-tensor activations, "
                        "per-channel weights; float layers stay float), for TensorRT (trtexec --int8) or ONNX Runtime")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--report", type=Path, metavar="FILE",
                        help="also draw the quantization report: FILE.html (one self-contained page) or FILE.png; "
                             "SQNR and precision per layer, weight bytes before and after (an fp32 bundle gets a "
                             "short page saying it has no quantization)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    parser.add_argument("--records", type=Path, metavar="FILE", help="tuning records from 'edgeq tune' to compile with")
    parser.add_argument("--sign-key", type=Path, metavar="KEY", help="ed25519 private key (edgeq keygen): sign the manifest")
    parser.add_argument("--runtime", choices=RUNTIME_CHOICES, default=RUNTIME_CHOICES[0],
                        help="bundled (default): runtime/ with the TVM runtime, the CUDA 12 bridge where the device needs "
                             "it and the native loader edgeq-run; none: bring your own apache-tvm on the device")
    parser.add_argument("--mender", action="store_true",
                        help="also write OUTDIR/<name>-<device>.mender: the archive as a Mender Artifact (payload type "
                             "'edgeq', device types from the profile; see 'edgeq mender' for the options)")
    parser.add_argument("--release", type=int, metavar="N",
                        help="release number, increasing per model name (default: build time as YYYYMMDDHHMMSS)")
    parser.add_argument("--golden-input", type=Path, metavar="FILE",
                        help="the input the bundle's self-test runs: .npz (one array per input) or .npy, or an image "
                             "with --preprocess (default: the first calibration sample for int8/mixed, else a generated "
                             "input, tried within the domains of Log/Acos/Acosh-like ops before refusing)")
    parser.add_argument("--postprocess", choices=["classify", "yolo"],
                        help="classify: the loaders print the top classes of the first output, softmax applied unless "
                             "the model ends in Softmax; yolo: the first output is an ultralytics v8/11 head (exported "
                             "without nms): NonMaxSuppression is added to the graph and the loaders print the boxes, in "
                             "the input image's pixels")
    parser.add_argument("--labels", type=Path, metavar="FILE", help="class labels, one per line (--postprocess)")
    parser.add_argument("--top-k", type=int, default=5, metavar="K", help="classify: classes to print (default 5)")
    parser.add_argument("--conf", type=float, default=0.25, help="yolo: score threshold (default 0.25)")
    parser.add_argument("--iou", type=float, default=0.45, help="yolo: IoU above which a box is suppressed (default 0.45)")
    parser.add_argument("--max-det", type=int, default=300, metavar="N", help="yolo: detections at most (default 300)")
    parser.add_argument("--reference", choices=REFERENCE_CHOICES, default=REFERENCE_CHOICES[0],
                        help="what the build is checked against on the golden input before anything is written: "
                             "auto (default): ONNX Runtime where installed, else TVM's plain pipeline on the imported "
                             "graph; int8/mixed builds: their own quantized graph before lowering, TVM's plain pipeline")
    parser.add_argument("--gpu-kernels", choices=("auto", "dlight", "cutlass"), default="auto",
                        help="CUDA profiles, fp16 and int8: auto (default: a layer goes on edgeq's kernels, NVIDIA's "
                             "CUTLASS tensor-core kernels and edgeq's own, where every kind of kernel it needs has run "
                             "on a GPU as written today, and on TVM's dlight rules otherwise), cutlass (every layer "
                             "edgeq's kernels take) or dlight (none); the manifest and 'edgeq inspect' say which layer "
                             "ran where and why")
    parser.add_argument("--max-context", type=int, metavar="N",
                        help="language models (a decoder ONNX with past_key_values): tokens of context, prompt and "
                             "answer together (default 512)")
    parser.add_argument("--tokenizer", type=Path, metavar="FILE",
                        help="language models: the tokenizer.json to bundle (default: the one beside the model, if any; "
                             "without one the bundle takes token ids)")
    parser.add_argument("--dump-ir", type=Path, metavar="DIR",
                        help="write the Relax module after each stage that changes it to DIR/NN-<stage>.py (TVMScript; "
                             "NN as in the progress output), replacing such files from an earlier run; the files of the "
                             "stages before a failure stay. Nothing of it enters the bundle")


def add_graph_options(parser) -> None:
    """The options that decide the module a build compiles: shared by ``package`` and ``tune`` (``tune`` tunes
    exactly what ``package`` builds)."""
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224",
                        help="fix the shape of an input with dynamic dims; repeat per input")
    parser.add_argument("--const", action="append", default=[], metavar="NAME=FILE.npy",
                        help="bind a graph input to this value before import (a shape operand such as Reshape's "
                             "shape or Slice's starts), so its shape arithmetic folds to constants; repeatable")
    parser.add_argument("--max-detections", type=int, metavar="N",
                        help="NonMaxSuppression: pad its selected rows to at most N (default: batches x classes x "
                             "max_output_boxes_per_class); an output <name>_count says how many are real")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32; int8 (post-training quantization, needs --calibrate); mixed (int8, with the most "
                             "sensitive layers returned to float until --accuracy-budget holds); fp16 (CUDA profiles: fp16 "
                             "weights and activations, fp32 accumulation, tensor cores where shapes allow). Language "
                             "models: int8 and int4 are weight-only (groups of 32, a float16 scale each; no calibration)")
    q = parser.add_argument_group("quantization (--precision int8 / mixed)")
    q.add_argument("--calibrate", type=Path, metavar="DATA",
                   help=".npz (one array per input, samples first), a folder of .npy/.npz, or a folder of images")
    q.add_argument("--calibration", choices=list(CALIBRATION_METHODS), default=DEFAULT_METHOD,
                   help=f"activation range method (default: {DEFAULT_METHOD})")
    q.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE,
                   help=f"for --calibration percentile (default {DEFAULT_PERCENTILE})")
    q.add_argument("--calib-samples", type=int, default=DEFAULT_CALIB_SAMPLES, metavar="N",
                   help=f"calibration samples to use at most (default {DEFAULT_CALIB_SAMPLES}), counted one per input row: a batch of B "
                        "counts B; used in whole batches, at least one; fewer than 10 only warn")
    q.add_argument("--preprocess", nargs="?", const="", metavar="SPEC",
                   help="how to turn images (calibration data, --golden-input) into inputs: "
                        "resize=HxW,mean=a/b/c,std=a/b/c,scale=255,layout=NCHW,order=RGB")
    q.add_argument("--skip", action="append", default=[], metavar="NODE_OR_OP",
                   help="keep this ONNX node (by name) or op type (Conv, Gemm, MatMul) in fp32; repeatable")
    q.add_argument("--activation-scales", choices=("auto", "per-tensor"), default="auto",
                   help="int8 input scales: auto (default: depthwise convolutions per channel, MatMul/Gemm over a "
                        "sequence per token at run time, the rest per tensor) or per-tensor (one calibrated scale "
                        "each, as TensorRT and ONNX QDQ take them; see docs/usage.md)")
    q.add_argument("--bias-correction", choices=("on", "off"), default="on",
                   help="on (default): each int8 layer's mean output shift from rounding, measured on the calibration "
                        "data, is taken back out in its bias; off: not (see docs/usage.md)")
    q.add_argument("--fp16", action="store_true", help="layers leaving int8 for the accuracy budget run fp16, not fp32")
    q.add_argument("--accuracy-budget", type=float, metavar="X",
                   help="allowed loss, judged on the answer: top-1 points lost when --eval has labels; else with --postprocess "
                        "classify, %% of samples whose top-1 changes; with --postprocess yolo, %% of fp32's boxes lost "
                        "(IoU 0.5, same class); else the worst output's relative error (e.g. 0.02)")
    q.add_argument("--eval", type=Path, metavar="DATA", help="held-out data (same formats; 'labels' for top-1)")
    q.add_argument("--max-answer-loss", type=float, default=DEFAULT_ANSWER_LOSS_LIMIT, metavar="PCT",
                   help="int8 without --accuracy-budget: warn when more of the answer is lost than this, judged as "
                        "--accuracy-budget judges it, on --eval or else the calibration data (default "
                        f"{DEFAULT_ANSWER_LOSS_LIMIT:g}; needs --postprocess or labels)")
    q.add_argument("--strict-accuracy", action="store_true",
                   help="past --max-answer-loss, stop with an error and write no bundle instead of warning")


def _act_scale(row) -> str:
    """A layer's int8 input scale as the table shows it: the calibrated one, or the scheme that replaces it."""
    if row.activation == "per-token":
        return "per token"
    scale = f"{row.activation_scale:.4g}" if row.activation_scale else "-"
    if row.shared_scale_with:  # a concatenation's readers and its parts' (quantize.shared_scales)
        scale += f" (shared with {len(row.shared_scale_with)})"
    return f"{scale} per channel" if row.activation == "per-channel" else scale


def _task(args):
    """What the answer is (``--postprocess``), for the accuracy budget (edgeq.quantize.judge)."""
    from edgeq.quantize.judge import Task

    kind = getattr(args, "postprocess", None)
    if kind == "yolo":
        return Task("yolo", conf=args.conf, iou=args.iou, max_det=args.max_det)
    return Task("classify") if kind == "classify" else None


def front_end_args(args):
    """The model, the device and ``add_graph_options``'s values: the ``FrontEndArgs`` that ``package`` and
    ``tune`` share (``edgeq.stage_records``)."""
    from edgeq.load import parse_const, parse_shape
    from edgeq.quantize import QuantizeArgs
    from edgeq.quantize.data import Preprocess

    preprocess = Preprocess.parse(args.preprocess) if args.preprocess is not None else None
    quantize_args = None
    if args.calibrate is not None:
        quantize_args = QuantizeArgs(
            calibrate=args.calibrate,
            method=args.calibration,
            percentile=args.percentile,
            samples=args.calib_samples,
            skip=tuple(args.skip),
            fallback="fp16" if args.fp16 else "fp32",
            accuracy_budget=args.accuracy_budget,
            eval=args.eval,
            preprocess=preprocess,
            task=_task(args),
            activation_scales=args.activation_scales,
            bias_correction=args.bias_correction == "on",
            answer_loss_limit=args.max_answer_loss,
            strict_accuracy=args.strict_accuracy,
        )
    from edgeq.stage_records import FrontEndArgs

    return FrontEndArgs(model=args.model, device=args.device,
                        input_shapes=dict(parse_shape(text) for text in args.input_shape),
                        consts=dict(parse_const(text) for text in args.const), precision=args.precision,
                        quantize=quantize_args, preprocess=preprocess, max_detections=args.max_detections)


def run(args, env) -> int:
    from edgeq.package import PackageArgs, package
    from edgeq.progress import StageProgress

    if args.report:
        from edgeq.report import check_output

        check_output(args.report)  # a wrong suffix or folder is known before the build
    package_args = PackageArgs(
        **front_end_args(args).front_end_fields(),
        output=args.output,
        name=args.name,
        sign_key=args.sign_key,
        release=args.release,
        records=args.records,
        runtime=args.runtime,
        dump_ir=args.dump_ir,
        reference=args.reference,
        golden_input=args.golden_input,
        mender=args.mender,
        export_qdq=args.export_qdq,
        postprocess=args.postprocess,
        labels=args.labels,
        top_k=args.top_k,
        conf=args.conf,
        iou=args.iou,
        max_det=args.max_det,
        gpu_kernels=args.gpu_kernels,
        max_context=args.max_context,
        tokenizer=args.tokenizer,
    )
    progress = StageProgress(console=env.err(), quiet=args.quiet)
    result = package(package_args, progress)
    progress.note(f"done: {result.bundle_dir} and {result.archive.name} in {result.total_seconds:.1f} s")
    if args.report:
        from edgeq.report import quantization_report, write

        progress.note(f"report: {write(quantization_report(result.manifest), args.report)}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2), file=env.stdout)
        return 0
    m = result.manifest
    view = Table(title=Text(f"bundle {m.bundle_id}"), show_header=False)
    toolkit = m.toolchain.cuda_toolkit
    rows = [
        ("bundle", str(result.bundle_dir)),
        ("archive", str(result.archive)),
        ("device", result.device),
        ("precision", result.precision),
        ("CUDA", f"{m.device.cuda_arch}, CUDA {toolkit.version} {toolkit.kind}" if toolkit else "-"),
        *((f"time: {name}", f"{seconds:.2f} s") for name, seconds in result.stages.items()),
        ("time: total", f"{result.total_seconds:.2f} s"),
        *((("mender", f"{result.mender.artifact} for {', '.join(result.mender.device_types)}"),) if result.mender else ()),
    ]
    for key, value in rows:
        view.add_row(key, Text(value))  # paths and names are data, never rich markup
    out = env.out()
    out.print(view)
    if m.quantization:
        out.print(quantization_table(m.quantization))
    return 0


def quantization_table(report: QuantizationReport) -> Table:
    float_ops = ", ".join(f"{k} x{v}" for k, v in report.float_ops.items()) or "none"
    w = report.weight_bytes
    weights = f"weights {w.float / 1e3:.1f} kB -> {w.bundle / 1e3:.1f} kB ({w.ratio:.2f}x)"
    if report.kind == "pre-quantized":
        table = Table(title=f"quantization: {report.source}; float ops: {float_ops}; {weights}")
        for column in ("layer", "op", "precision", "activation", "zero point", "why not integer"):
            table.add_column(column)
        for row in report.layers:
            table.add_row(Text(row.name), row.op_type, row.precision, row.activation_dtype or "-",
                          str(row.activation_zero_point), row.reason or "-")
        return table
    ev = report.evaluation
    summary = f"rel. output error {ev['rel_error']:.4f}, cosine {ev['cosine']:.5f}"
    if "top1_agreement" in ev:
        summary += f", top-1 agreement {ev['top1_agreement']:.1f}%"
    if "top1_fp32" in ev:
        summary += f", top-1 fp32 {ev['top1_fp32']:.1f}% -> quantized {ev['top1_quantized']:.1f}%"
    if "boxes_kept_pct" in ev:
        summary += f", fp32 boxes kept {ev['boxes_kept_pct']:.1f}% of {ev['boxes_fp32']}"
    table = Table(title=f"quantization ({report.method}): {summary}; {weights}")
    for column in ("layer", "op", "precision", "act scale", "SQNR dB", "why not int8"):
        table.add_column(column)
    for row in report.layers:
        table.add_row(Text(row.name), row.op_type, row.precision,
                      _act_scale(row), f"{row.sqnr_db:.1f}" if row.sqnr_db is not None else "-", row.reason or "-")
    return table
