"""``edgeq package``: ONNX model -> runtime bundle for one device. The library entry point.

The job is declared once, in the order it runs: ``STAGES``, a list of ``edgeq.pipeline.Stage``, each a
function that takes the records it reads (by its parameters' types) and returns the record it makes
(``edgeq.stage_records``: PackageArgs -> Setup -> Loaded -> Imported -> Quantized -> Lowered -> Compiled ->
Golden -> ReferenceCheck -> Runtime -> Written), with a predicate saying when it applies.
``edgeq.pipeline.run_stages`` walks it, timed and reported by ``StageProgress`` (whose total follows from the
predicates), and with ``dump_ir`` writes the Relax module after each stage that changes it. Nothing lands in
the output folder until every stage has succeeded: the bundle is built in a hidden staging folder beside it
and renamed into place at the end (``edgeq.bundle.write``).

The golden input and outputs are ``edgeq.golden``'s; the manifest and the bundle's files are ``edgeq.bundle``'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from edgeq import backends, bundle
from edgeq.templates import contract, safebundle
from edgeq.answers import check_args as check_answers
from edgeq.answers import classify_record, preprocess_record, with_yolo_nms
from edgeq.backends import GOLDEN_FP16_ATOL, GOLDEN_FP16_RTOL, GOLDEN_INT8_ATOL, GOLDEN_INT8_RTOL
from edgeq.choices import PRECISIONS, QUANTIZED, RUNTIME_CHOICES
from edgeq.compile import build, elf_machine, export, lower_graph, toolchain_for
from edgeq.templates.contract import ReferenceCheck
from edgeq.errors import EdgeqError, ModelError, OutputError, ToolchainError, UsageError
from edgeq.golden import GOLDEN_DISTRIBUTIONS, GOLDEN_SEED, make_golden
from edgeq.graph import call_op
from edgeq.load import load_model
from edgeq.mender import MenderResult
from edgeq.pipeline import IRDump, Records, Stage, run_stages
from edgeq.progress import StageProgress
from edgeq.reference import check_choice as check_reference
from edgeq.reference import choose as choose_reference
from edgeq.reference import compare as compare_reference
from edgeq.reference import probes as reference_probes
from edgeq.reference import yolo_parts
from edgeq.relax_import import to_relax
from edgeq.runtime.assemble import Runtime, assemble
from edgeq.stage_records import (Compiled, ExportedQdq, FrontEndArgs, Golden, Imported, Loaded, Lowered, Output,
                                 PackageArgs, Quantized, Setup, Written)
from edgeq.targets import Profile, resolve
from edgeq.toolchain import Toolchain

# The self-test's tolerances are the backend's (edgeq.backends: GOLDEN_*, Backend.golden_tolerance).
# The reference check of an fp32 build (edgeq.reference): ONNX Runtime computes some functions its own way (a
# PP-OCRv4 recognizer's softmax output: 5.4e-5 from ONNX Runtime, 4e-6 from TVM's plain build); the faults it
# is there for (a wrong weight, layout or padding) miss by the size of the output itself.
REFERENCE_FP32_RTOL, REFERENCE_FP32_ATOL = 1e-3, 1e-3


@dataclasses.dataclass
class PackageResult:
    bundle_dir: Path
    archive: Path
    device: str
    device_note: str | None
    precision: str
    stages: dict[str, float]
    total_seconds: float
    manifest: contract.Manifest
    replaced: bool = False  # a bundle of this name was in the output folder and is replaced
    mender: MenderResult | None = None  # with --mender
    records_applied: int | None = None  # with --records: functions a tuning record scheduled

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        toolkit = m.toolchain.cuda_toolkit
        return {
            "bundle_dir": str(self.bundle_dir),
            "archive": str(self.archive),
            "bundle_id": m.bundle_id,
            "device": self.device,
            "device_note": self.device_note,
            "precision": self.precision,
            "cuda_toolkit": toolkit.to_json() if toolkit else None,
            "signed": m.signed,
            "release": m.release,
            "quantization": _quantization_summary(m.quantization),
            "stages": self.stages,
            "total_seconds": self.total_seconds,
            "replaced": self.replaced,
            "mender": self.mender.to_dict() if self.mender else None,
            "records_applied": self.records_applied,
        }


def _quantization_summary(report: contract.QuantizationReport | None) -> dict[str, Any] | None:
    """What --json shows of the quantization report (the manifest has all of it)."""
    if report is None:
        return None
    return {"kind": report.kind, "source": report.source, "method": report.method,
            "precision_counts": report.precision_counts, "evaluation": report.evaluation,
            "weight_bytes": report.weight_bytes.to_json(), "fallbacks": report.fallbacks, "float_ops": report.float_ops}


# ---- the stages: each takes the records its parameters name and returns its own -------------------------


def _setup(args: PackageArgs, progress: StageProgress) -> Setup:
    """The arguments, the profile and its backend, the compilers: everything before the output folder."""
    if args.precision not in PRECISIONS:
        raise UsageError(f"unknown precision '{args.precision}'; choose one of: {', '.join(PRECISIONS)}")
    if args.precision == "int4":
        raise UsageError("--precision int4 is weight-only quantization for language models (a decoder ONNX with "
                         "past_key_values inputs); quantize this model with --precision int8 --calibrate DATA")
    if args.precision in QUANTIZED and args.quantize is None:
        raise UsageError(f"--precision {args.precision} needs calibration data: add --calibrate DATA")
    if args.precision not in QUANTIZED and args.quantize is not None:
        raise UsageError("--calibrate and the other quantization options need --precision int8 or mixed")
    if args.precision == "mixed" and args.quantize.accuracy_budget is None:
        raise UsageError("--precision mixed needs --accuracy-budget X (top-1 points, or relative output error)")
    if args.quantize is not None:
        from edgeq.quantize import check_args

        check_args(args.quantize)
    name = args.name or Path(args.model).stem
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"bundle name '{name}' may use letters, digits, '.', '_' and '-' only; set it with --name")
    if args.release is not None and args.release < 0:
        raise UsageError("--release must be a non-negative integer")
    labels = check_answers(args.postprocess, args.labels, args.top_k, args.conf, args.iou, args.max_det)
    if args.max_detections is not None and not 1 <= args.max_detections <= 1 << 24:
        raise UsageError("--max-detections must be an integer from 1 to 16777216")
    check_reference(args.reference, args.precision in QUANTIZED)
    if args.export_qdq is not None:
        _check_export_qdq(args)
    if args.runtime not in RUNTIME_CHOICES:
        raise UsageError(f"unknown --runtime '{args.runtime}'; choose one of: {', '.join(RUNTIME_CHOICES)}")
    if args.records is not None and not Path(args.records).is_file():
        raise UsageError(f"records file not found: {args.records} (make one with 'edgeq tune')")
    signing_key = None
    if args.sign_key is not None:
        from edgeq.signing import load_private_key

        signing_key = load_private_key(args.sign_key)
    profile, device_note = resolve(args.device)
    if device_note:
        progress.note(device_note)
    backend = backends.for_profile(profile)
    choose = getattr(backend, "with_gpu_kernels", None)
    if choose is not None:  # a GPU profile: auto (the default), dlight or cutlass
        backend = choose(args.gpu_kernels, profile, args.precision)
    elif args.gpu_kernels not in ("auto", "dlight"):
        raise UsageError(f"--gpu-kernels is for profiles with a GPU (jetson-*); {profile.name} has none "
                         f"(--gpu-kernels {args.gpu_kernels})")
    if args.precision not in backend.precisions:
        raise UsageError(f"--precision {args.precision} is for CUDA profiles (jetson-*); {profile.name} is a "
                         f"{backend.name.upper()} profile: use {', '.join(backend.precisions[:-1])} or {backend.precisions[-1]}")
    longest = len(f"{name}-{profile.name}-") + 12  # bundle_id = NAME-DEVICE-<12 hex digits>, at most 128 characters
    if longest > 128:
        raise UsageError(f"bundle name '{name}' is {len(name)} characters; with the device and a hash the bundle id "
                         f"would be {longest}, over 128: choose a shorter --name")
    return Setup(name=name, profile=profile, backend=backend, device_note=device_note, toolchain=toolchain_for(profile),
                 signing_key=signing_key, labels=tuple(labels), looks_prequantized=_mentions(args.model, b"DequantizeLinear"))


def _check(args: PackageArgs, progress: StageProgress, dump: IRDump | None) -> Setup:
    """check: ``_setup``, then the output folder (and the IR dump's): made, writable, outside any bundle; the
    hidden staging folder."""
    setup = _setup(args, progress)
    if dump is not None:
        dump.prepare()
    out_dir = Path(args.output)
    inside = next((p for p in (out_dir.resolve(), *out_dir.resolve().parents)
                   if (p / contract.MANIFEST).is_file() and (p / contract.SUMS).is_file()), None)
    if inside is not None:  # a bundle holds only the files its manifest lists
        raise UsageError(f"-o {out_dir} is {'a bundle folder' if inside == out_dir.resolve() else 'inside the bundle ' + str(inside)}; "
                         "choose an output folder outside any bundle")
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        staging = Path(tempfile.mkdtemp(prefix=f".{setup.bundle_name}.", dir=out_dir))
    except OSError as err:
        raise OutputError(f"cannot write to output directory {out_dir}: {err.strerror}; choose another with -o") from None
    return dataclasses.replace(setup, output=Output(out_dir=out_dir, created_out_dir=created, staging=staging))


def _check_export_qdq(args: PackageArgs) -> None:
    path = Path(args.export_qdq)
    if args.precision not in QUANTIZED:
        raise UsageError("--export-qdq writes edgeq's calibration as ONNX QDQ: it needs --precision int8 or mixed")
    if path.suffix != ".onnx":
        raise UsageError(f"--export-qdq {path}: give a file name ending in .onnx")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK) or path.is_dir():
        raise OutputError(f"cannot write --export-qdq {path}: its folder is missing or not writable")
    if any((p / contract.MANIFEST).is_file() for p in (folder.resolve(), *folder.resolve().parents)):
        raise UsageError(f"--export-qdq {path} is inside a bundle folder; choose a file outside any bundle")
    if path.resolve() == Path(args.model).resolve():
        raise UsageError(f"--export-qdq {path} is the model being packaged; give the QDQ model another file name")


def _load(args: PackageArgs, setup: Setup, progress: StageProgress) -> Loaded:
    from edgeq.load import read_const

    consts = {name: read_const(name, Path(path)) for name, path in args.consts.items()}
    model = load_model(args.model, args.input_shapes, consts)
    for text in model.warnings:
        progress.warn(text)
    postprocess = None
    if args.postprocess == "yolo":  # NonMaxSuppression in the graph: on the device's GPU where it has one
        onnx_model, postprocess = with_yolo_nms(model.onnx_model, list(setup.labels), args.conf, args.iou, args.max_det)
        model = dataclasses.replace(model, onnx_model=onnx_model)
    golden_given = None
    if args.golden_input is not None:  # read and checked against the inputs before anything is compiled
        from edgeq.quantize.data import load_golden

        first = load_golden(args.golden_input, model.inputs, args.preprocess)
        golden_given = ({spec.name: a for spec, a in zip(model.inputs, first)},
                        f"--golden-input {Path(args.golden_input).name}")
    return Loaded(model=model, golden_given=golden_given, preprocess=preprocess_record(args.preprocess, model.inputs),
                  postprocess=postprocess)


def _import(args: PackageArgs, setup: Setup, loaded: Loaded) -> Imported:
    from edgeq.quantize import is_qdq

    graph, outputs = to_relax(loaded.model, max_detections=args.max_detections)
    postprocess = loaded.postprocess
    if args.postprocess == "classify":  # (yolo's record is made with its NMS, at load)
        postprocess = classify_record(list(setup.labels), args.top_k, outputs, loaded.model.onnx_model)
    for kind, spec in [*(("input", s) for s in loaded.model.inputs), *(("output", s) for s in outputs)]:
        if spec.dtype not in safebundle.TABLE_DTYPES:  # what golden.bin, run.py and edgeq-run can hold
            raise ModelError(f"{kind} '{spec.name}' is {spec.dtype}, which a bundle cannot carry (it holds "
                             f"{', '.join(safebundle.TABLE_DTYPES)}); add a Cast to float32 at the model's {kind}")
    prequantized = is_qdq(graph)
    if prequantized and (args.quantize is not None or args.precision == "fp16"):
        raise UsageError(f"{Path(args.model).name} is already quantized (QuantizeLinear/DequantizeLinear); "
                         "package it without --precision/--calibrate")
    # ONNX defines QuantizeLinear and DynamicQuantizeLinear as round(x / scale): built with a real division, a
    # tie lands where ONNX Runtime's does (Profile.host_target_dict)
    exact_division = any(call_op(binding.value) == "relax.quantize" for binding in graph.bindings())
    return Imported(graph=graph, outputs=tuple(outputs), prequantized=prequantized, exact_division=exact_division,
                    postprocess=postprocess)


def _lower_qdq(loaded: Loaded, imported: Imported, progress: StageProgress) -> Quantized:
    from edgeq.quantize import lower_prequantized

    result = lower_prequantized(imported.graph, loaded.model)
    counts = result.report.precision_counts
    progress.note(f"pre-quantized model: {counts['int8']} layers lowered to integer kernels, {counts['fp32']} left in float")
    return Quantized(result=result, reference_graph=imported.graph)


def _quantize(args: PackageArgs, setup: Setup, loaded: Loaded, imported: Imported, progress: StageProgress) -> Quantized:
    from edgeq.quantize import quantize

    result = quantize(imported.graph, loaded.model, args.quantize, note=progress.note, tick=progress.tick,
                      warn=progress.warn, target_precisions=setup.backend.layer_precisions)
    return Quantized(result=result, reference_graph=result.graph)  # checked against its own quantized graph


def _lower(setup: Setup, imported: Imported, quantized: Quantized | None) -> Lowered:
    target = setup.profile.tvm_target(reciprocal=not imported.exact_division)
    graph, calls = lower_graph(quantized.result.graph if quantized is not None else imported.graph, target, setup.backend)
    return Lowered(target=target, graph=graph, mod=graph.mod, kernel_calls=calls)


def _fp16(setup: Setup, lowered: Lowered) -> Lowered:
    graph = setup.backend.to_fp16(lowered.graph)  # the golden outputs are computed on this graph too
    return dataclasses.replace(lowered, graph=graph, mod=graph.mod)


def _tuning_records(args: PackageArgs, setup: Setup, imported: Imported, lowered: Lowered,
                    progress: StageProgress) -> Lowered:
    from edgeq.records import apply_records

    precision = _precision(args, imported)
    mod, applied = apply_records(lowered.mod, lowered.target, Path(args.records), setup.profile, warn=progress.warn,
                                 precision=precision, note=progress.note)
    progress.note(f"tuning records scheduled {applied} function(s) ({precision}, {setup.profile.name})")
    return dataclasses.replace(lowered, mod=mod, records_applied=applied)


def _compile(setup: Setup, lowered: Lowered) -> Compiled:
    schedules: dict[str, object] = {}
    executable = build(lowered.mod, lowered.target, setup.toolchain, schedules, setup.backend)
    library = setup.output.staging / contract.LIBRARY
    export(executable, library, setup.toolchain)
    machine = elf_machine(library)
    if machine != setup.profile.cpu.arch:
        raise ToolchainError(f"the exported library is {machine}, not {setup.profile.cpu.arch}; check the cross "
                             f"compiler {setup.toolchain.cxx}")
    setup.backend.check_library(library, setup.profile, setup.toolchain)
    return Compiled(executable=executable, schedules=schedules, library=library)


def _golden(setup: Setup, loaded: Loaded, imported: Imported, quantized: Quantized | None, lowered: Lowered,
            compiled: Compiled) -> Golden:
    return make_golden(setup, loaded, imported, quantized, lowered, compiled)


def _reference_check(args: PackageArgs, setup: Setup, loaded: Loaded, imported: Imported,
                     quantized: Quantized | None, golden: Golden, progress: StageProgress) -> ReferenceCheck:
    reference_graph = quantized.reference_graph if quantized is not None else imported.graph
    reference = choose_reference(args.reference, loaded.model.onnx_model, reference_graph,
                                 quantized_by_edgeq=args.precision in QUANTIZED)
    if reference.note:
        progress.note(f"reference: {reference.name} ({reference.note})")
    rtol, atol = _reference_tolerance(args, quantized)
    post = imported.postprocess
    parts = yolo_parts(post.output) if post is not None and post.kind == "yolo" else None
    # an edgeq-quantized build: how much its quantized graph moves by itself under float noise (edgeq.reference),
    # always measured where the device's kernels are not the build host's (its self-test takes the allowance)
    noisy = (lambda: reference_probes(reference_graph, reference.graph)) if args.precision in QUANTIZED else None
    check = compare_reference(reference, golden.inputs, golden.outputs, list(imported.outputs), rtol, atol,
                              checked=golden.computed_with, parts=parts, probes=noisy,
                              probe_always=setup.profile.name != "host")
    if check.result == "passed":
        progress.note(f"reference check passed: {check.reference}, largest |diff| {check.max_abs_diff:.3g}")
    elif golden.float_inputs in GOLDEN_DISTRIBUTIONS and check.result.startswith("not conclusive: the reference failed"):
        # a generated input the model is not defined on: its golden outputs would be no better than the check
        raise ModelError(f"the reference ({check.reference}) cannot run the generated golden input "
                         f"({check.result.split(': ', 2)[-1]}), so the build cannot be checked; nothing was written. "
                         "Give an input the model is meant for with --golden-input FILE.npz")
    else:  # nothing could be compared: said even with --quiet, recorded in the manifest
        progress.warn(f"reference check {check.result} ({check.reference}); the bundle is written unchecked: "
                      "give an input the model is meant for with --golden-input")
    return check


def _runtime(setup: Setup, progress: StageProgress) -> Runtime:
    return assemble(setup.profile, setup.backend, setup.toolchain.cxx, setup.output.staging, note=progress.note)


def _bundle(args: PackageArgs, setup: Setup, loaded: Loaded, imported: Imported, quantized: Quantized | None,
            lowered: Lowered, compiled: Compiled, golden: Golden, reference: ReferenceCheck, runtime: Runtime | None,
            progress: StageProgress) -> Written:
    tolerance = setup.backend.golden_tolerance(args.precision, quantized is not None, setup.profile.name == "host")
    return bundle.write(args, setup, loaded, imported, quantized, lowered, compiled, golden, reference, runtime,
                        progress, precision=_precision(args, imported), golden_tolerance=tolerance,
                        golden_seed=GOLDEN_SEED)


def _mender(setup: Setup, written: Written) -> MenderResult:
    from edgeq.mender import MenderArgs, write_artifact

    return write_artifact(MenderArgs(bundle=written.archive, output=setup.output.out_dir / f"{setup.bundle_name}.mender"))


def _export_qdq(args: PackageArgs, loaded: Loaded, quantized: Quantized, progress: StageProgress) -> ExportedQdq:
    from edgeq.quantize.export_qdq import qdq_model, write

    result = quantized.result
    layers = result.layers
    scales = {layer.name: float(result.scales[f"{layer.name}/activation_scale"])
              for layer in layers if layer.precision == "int8" and layer.activation != "per-token"}
    write(qdq_model(loaded.model.onnx_model, layers, scales, result.smoothing, result.corrections), Path(args.export_qdq))
    per_token = sum(1 for l in layers if l.precision == "int8" and l.activation == "per-token")
    progress.note(f"QDQ model: {len(scales)} layers quantized with edgeq's scales, {len(layers) - len(scales)} left "
                  f"in float" + (f" ({per_token} of them per-token int8 in the bundle: ONNX has no per-token "
                                 "quantize)" if per_token else ""))
    return ExportedQdq(path=Path(args.export_qdq), quantized=len(scales), left_float=len(layers) - len(scales))


# ---- helpers -------------------------------------------------------------------------------------------


def _mentions(path, needle: bytes) -> bool:
    """A cheap look into a model file (regular files only, read in blocks: the path may be /dev/zero)."""
    try:
        if not Path(path).is_file():
            return False
        with open(path, "rb") as f:
            tail = b""
            for block in iter(lambda: f.read(1 << 20), b""):
                if needle in tail + block:
                    return True
                tail = block[-len(needle):]
    except OSError:
        pass
    return False


def _inside(path: Path | None, folder: Path) -> bool:
    if path is None:
        return False
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents


def _precision(args: PackageArgs, imported: Imported | None) -> str:
    return "int8" if imported is not None and imported.prequantized else args.precision


def _reference_tolerance(args: PackageArgs, quantized: Quantized | None) -> tuple[float, float]:
    """(rtol, atol) of the reference check: fp16 rounds after each layer, and an integer build differs from
    its reference by a quantization step wherever float noise before a quantize crosses a rounding boundary."""
    if args.precision == "fp16":
        return GOLDEN_FP16_RTOL, GOLDEN_FP16_ATOL
    if quantized is not None:
        return GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL
    return REFERENCE_FP32_RTOL, REFERENCE_FP32_ATOL


def _is_prequantized(r: Records) -> bool:
    """Decided by import; before it, a cheap look at the model file's bytes (the progress total may be
    corrected once import has looked at the graph)."""
    imported, setup = r.get(Imported), r.get(Setup)
    if imported is not None:
        return imported.prequantized
    return setup.looks_prequantized if setup is not None else _mentions(r[PackageArgs].model, b"DequantizeLinear")


def _device_label(device: str) -> str:
    """The profile a device name resolves to (an alias names its default profile); the name itself when it
    does not resolve (check says why)."""
    try:
        return resolve(device)[0].name
    except EdgeqError:
        return device


def _out(r: Records) -> Path:
    setup = r[Setup]
    return setup.output.out_dir / setup.bundle_name


# The whole job, in the order it runs. `ir`: the module a stage leaves, for --dump-ir.
STAGES: tuple[Stage[Records], ...] = (
    Stage("check", lambda r: f"device {_device_label(r[PackageArgs].device)}, compilers, output folder", _check),
    Stage("load", lambda r: f"read and check {r[PackageArgs].model}", _load),
    Stage("import", lambda r: "ONNX -> Relax IRModule", _import, ir=lambda r: r[Imported].graph.mod),
    Stage("quantize", lambda r: f"calibrate ({r[PackageArgs].quantize.method}) and quantize to {r[PackageArgs].precision}",
          _quantize, applies=lambda r: r[PackageArgs].precision in QUANTIZED, ir=lambda r: r[Quantized].result.graph.mod),
    Stage("lower-qdq", lambda r: "QDQ pattern -> integer conv/matmul kernels", _lower_qdq,
          applies=_is_prequantized, ir=lambda r: r[Quantized].result.graph.mod),
    Stage("lower", lambda r: r[Setup].backend.describe_prepare(r[Setup].profile), _lower, ir=lambda r: r[Lowered].mod),
    Stage("fp16", lambda r: "fp16 weights and activations, fp32 accumulation (TVM's ToMixedPrecision)", _fp16,
          applies=lambda r: r[PackageArgs].precision == "fp16", ir=lambda r: r[Lowered].mod),
    Stage("tuning-records", lambda r: f"best schedules from {r[PackageArgs].records} (legalized and fused first)",
          _tuning_records, applies=lambda r: r[PackageArgs].records is not None, ir=lambda r: r[Lowered].mod),
    Stage("compile", lambda r: r[Setup].backend.describe_build(r[Setup].profile, r[Setup].toolchain),
          _compile),  # build, export, check the library's machine and device code
    Stage("golden", lambda r: "golden input and outputs on the build host", _golden),
    Stage("reference", lambda r: "the golden outputs checked against an independent reference", _reference_check),
    Stage("runtime", lambda r: f"runtime/ for {r[Setup].profile.cpu.arch}: "
          f"{', '.join(('TVM runtime', *r[Setup].backend.runtime_parts, 'edgeq-run'))}", _runtime,
          applies=lambda r: r[PackageArgs].runtime != "none"),
    Stage("bundle", lambda r: f"write {_out(r)} and .tar.gz", _bundle),
    Stage("mender", lambda r: f"Mender Artifact {_out(r)}.mender (payload type edgeq)", _mender,
          applies=lambda r: r[PackageArgs].mender),
    Stage("export-qdq", lambda r: f"edgeq's calibration as ONNX QDQ: {r[PackageArgs].export_qdq}", _export_qdq,
          applies=lambda r: r[PackageArgs].export_qdq is not None),
)


# What `package` builds up to and including the module it compiles; `edgeq tune` tunes exactly that module.
FRONT_END = ("load", "import", "quantize", "lower-qdq", "lower", "fp16")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """The module ``package`` compiles, and what it is for (``front_end``)."""

    profile: Profile
    toolchain: Toolchain
    backend: backends.Backend
    precision: str  # as the manifest says it: int8 for a pre-quantized model
    lowered: Lowered


def front_end(args: FrontEndArgs, progress: StageProgress | None = None) -> FrontEnd:
    """Run ``package``'s stages up to the module it compiles (load with ``--const`` and shape folding, import,
    quantization with calibration or a pre-quantized model's lowering, the backend's preparation, fp16),
    checking the arguments as ``package`` does and writing nothing: one front end for ``package`` and
    ``edgeq tune``."""
    progress = progress or StageProgress(quiet=True)
    package_args = args if isinstance(args, PackageArgs) else PackageArgs(**args.front_end_fields())
    records = Records(package_args, progress, _setup(package_args, progress))
    run_stages([stage for stage in STAGES if stage.name in FRONT_END], records, progress)
    setup = records[Setup]
    return FrontEnd(profile=setup.profile, toolchain=setup.toolchain, backend=setup.backend,
                    precision=_precision(package_args, records[Imported]), lowered=records[Lowered])


def package(args: PackageArgs, progress: StageProgress | None = None) -> PackageResult:
    """Package ``args.model`` for ``args.device``. Raises EdgeqError subclasses with one-line messages."""
    progress = progress or StageProgress(quiet=True)
    from edgeq.llm.decoder import is_decoder_file

    if _mentions(args.model, b"past_key_values") and is_decoder_file(args.model):  # a language model: its own stages (edgeq.llm.package), this job's check
        from edgeq.llm.package import package_decoder

        setup, written = package_decoder(args, progress, lambda checked: _check(checked, progress, None))
        return PackageResult(bundle_dir=written.bundle_dir, archive=written.archive, device=setup.profile.name,
                             device_note=setup.device_note, precision=args.precision, stages=dict(progress.seconds),
                             total_seconds=progress.total_seconds, manifest=written.manifest,
                             replaced=written.replaced)
    dump = IRDump(args.dump_ir) if args.dump_ir is not None else None
    records = Records(args, progress, dump)
    try:
        run_stages(STAGES, records, progress, dump)
    except BaseException:
        output = records[Setup].output if Setup in records else None
        if output is not None and output.created_out_dir and not _inside(args.dump_ir, output.out_dir):
            shutil.rmtree(output.out_dir, ignore_errors=True)  # (not when it holds the IR dump, which must stay)
        raise
    finally:
        if Setup in records and records[Setup].output is not None:
            shutil.rmtree(records[Setup].output.staging, ignore_errors=True)
    setup, written, lowered = records[Setup], records[Written], records[Lowered]
    return PackageResult(
        bundle_dir=written.bundle_dir,
        archive=written.archive,
        device=setup.profile.name,
        device_note=setup.device_note,
        precision=_precision(args, records[Imported]),
        stages=dict(progress.seconds),
        total_seconds=progress.total_seconds,
        manifest=written.manifest,
        replaced=written.replaced,
        mender=records.get(MenderResult),
        records_applied=lowered.records_applied,
    )


__all__ = ["FrontEndArgs", "PackageArgs", "PackageResult", "package", "PRECISIONS", "EdgeqError"]
