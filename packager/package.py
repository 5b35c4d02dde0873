"""``edgeq package``: ONNX model -> runtime bundle for one device. The library entry point.

The job is declared once, in the order it runs: ``STAGES``, a list of ``edgeq.pipeline.Stage``, each a
plain function of the build state with a predicate saying when it applies. ``edgeq.pipeline.run_stages``
walks it, timed and reported by ``StageProgress`` (whose total follows from the predicates), and with
``dump_ir`` writes the Relax module after each stage that changes it. Nothing lands in the output folder
until every stage has succeeded: the bundle is built in a hidden staging folder beside it and renamed into
place at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import edgeq
from edgeq import backends, bundle, contract, safebundle
from edgeq.backends import GOLDEN_FP16_ATOL, GOLDEN_FP16_RTOL, GOLDEN_INT8_ATOL, GOLDEN_INT8_RTOL
from edgeq.answers import check_args as check_answers
from edgeq.answers import classify_record, preprocess_record, with_yolo_nms
from edgeq.choices import DEFAULT_OUTPUT, PRECISIONS, QUANTIZED, RUNTIME_CHOICES
from edgeq.compile import HostRunner, build, cuda_device_code, elf_machine, export, lower_graph, toolchain_for
from edgeq.errors import EdgeqError, ModelError, OutputError, ToolchainError, UsageError
from edgeq.graph import Graph, call_op
from edgeq.contract import TensorSpec
from edgeq.load import LoadedModel, load_model
from edgeq.pipeline import IRDump, Stage, run_stages
from edgeq.progress import StageProgress
from edgeq.reference import check_choice as check_reference
from edgeq.reference import choose as choose_reference
from edgeq.reference import compare as compare_reference
from edgeq.reference import probes as reference_probes
from edgeq.reference import yolo_parts
from edgeq.relax_import import to_relax
from edgeq.runtime.assemble import assemble, check_elves
from edgeq.targets import Profile, profiles, resolve
from edgeq.toolchain import Toolchain
from edgeq.tvm_env import import_tvm

if TYPE_CHECKING:  # the types of what the stages make; importing them costs TVM, so only for type checkers
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from tvm import IRModule
    from tvm.relax import VMExecutable
    from tvm.target import Target

    from edgeq.mender import MenderResult
    from edgeq.quantize import QuantizeArgs, QuantizeResult
    from edgeq.quantize.data import Preprocess
    from edgeq.runtime.assemble import Runtime

GOLDEN_SEED = 0
# The self-test's tolerances are the backend's (edgeq.backends: GOLDEN_*, Backend.golden_tolerance).
# The reference check of an fp32 build (edgeq.reference): ONNX Runtime computes some functions its own way (a
# PP-OCRv4 recognizer's softmax output: 5.4e-5 from ONNX Runtime, 4e-6 from TVM's plain build); the faults it
# is there for (a wrong weight, layout or padding) miss by the size of the output itself.
REFERENCE_FP32_RTOL, REFERENCE_FP32_ATOL = 1e-3, 1e-3
# The golden input's floats, tried in order until the outputs are finite: models defined only on part of the
# line (Log, Sqrt: positive; Acos, Asin, Atanh: (-1, 1); Acosh: [1, inf)) get an input inside their domain.
_UNIFORM = {"uniform(0.5, 1.5)": (0.5, 1.5), "uniform(0.1, 0.9)": (0.1, 0.9), "uniform(1.1, 2.0)": (1.1, 2.0)}
GOLDEN_DISTRIBUTIONS = ("standard normal", *_UNIFORM)


@dataclasses.dataclass
class PackageArgs:
    """What ``edgeq package`` was asked to do; the manifest records it."""

    model: Path
    device: str
    output: Path = Path(DEFAULT_OUTPUT)
    input_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    name: str | None = None
    precision: str = "fp32"
    quantize: QuantizeArgs | None = None  # int8 / mixed
    sign_key: Path | None = None  # ed25519 private key (edgeq keygen): writes manifest.sig
    release: int | None = None  # monotonically increasing per model name; default: build time YYYYMMDDHHMMSS
    records: Path | None = None  # tuning records (edgeq tune) to compile with
    runtime: str = "bundled"  # "bundled": runtime/ with TVM's runtime, the CUDA bridge and edgeq-run; "none"
    consts: dict[str, Path] = dataclasses.field(default_factory=dict)  # graph input -> .npy bound before import
    dump_ir: Path | None = None  # write the Relax module after each stage that changes it here (NN-<stage>.py)
    reference: str = "auto"  # the independent reference the build is checked against: auto, onnxruntime, tvm
    golden_input: Path | None = None  # the self-test's input: .npz/.npy (one array per input) or an image
    preprocess: Preprocess | None = None  # how images (calibration, golden input) become tensors
    mender: bool = False  # also write OUTDIR/<name>-<device>.mender, a Mender Artifact of the archive (edgeq.mender)
    export_qdq: Path | None = None  # int8/mixed: also write the calibrated model as ONNX QDQ (edgeq.quantize.export_qdq)
    max_detections: int | None = None  # NonMaxSuppression: its selected rows padded to at most this (edgeq.nms)
    postprocess: str | None = None  # "classify" / "yolo": the loaders print classes / boxes (edgeq.answers)
    labels: Path | None = None  # one class label per line
    top_k: int = 5  # classify
    conf: float = 0.25  # yolo: score threshold
    iou: float = 0.45  # yolo: IoU above which a box is suppressed
    max_det: int = 300  # yolo: detections at most

    def to_dict(self) -> dict[str, Any]:
        """What the manifest records (``build.args``). ``dump_ir`` is left out: a debugging aid that
        changes nothing in the bundle, so the same input still gives the same manifest."""
        return {
            "quantize": self.quantize.to_dict() if self.quantize else None,
            "model": str(self.model),
            "device": self.device,
            "output": str(self.output),
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "name": self.name,
            "precision": self.precision,
            "signed": self.sign_key is not None,
            "release": self.release,
            "records": str(self.records) if self.records else None,
            "runtime": self.runtime,
            "consts": {k: str(v) for k, v in self.consts.items()},
            "reference": self.reference,
            "golden_input": str(self.golden_input) if self.golden_input else None,
            "preprocess": self.preprocess.to_dict() if self.preprocess else None,
            "mender": self.mender,
            "export_qdq": str(self.export_qdq) if self.export_qdq else None,
            "max_detections": self.max_detections,
            "postprocess": self.postprocess,
            "labels": str(self.labels) if self.labels else None,
            "top_k": self.top_k,
            "conf": self.conf,
            "iou": self.iou,
            "max_det": self.max_det,
        }

    def display(self) -> str:
        return "\n".join(f"  {key:<13} {value}" for key, value in self.to_dict().items())


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


@dataclasses.dataclass(frozen=True)
class Lowered:
    """What lower makes (and fp16 and tuning-records remake): the module the build compiles."""

    target: Target  # the profile's TVM target
    mod: IRModule  # the graph's module, prepared by the backend, with records applied
    kernel_calls: int  # conv/matmul calls on edgeq's CPU kernels


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What compile makes: the executable (exported to staging/model.so) and what the backend's kernels did."""

    executable: VMExecutable
    schedules: dict[str, object]  # CPU: TIR functions by schedule; CUDA: the GpuKernels record


@dataclasses.dataclass(frozen=True)
class Golden:
    """What golden makes: the self-test's input and its outputs on the build host (in staging/golden.bin)."""

    inputs: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    table: list[dict[str, object]]  # golden.bin's tensor table
    float_inputs: str  # what the input's floats are (GOLDEN_DISTRIBUTIONS, or the given input)
    computed_with: str


@dataclasses.dataclass
class _Build:
    """State handed from stage to stage: the arguments, then what each stage made (None until it has run)."""

    args: PackageArgs
    progress: StageProgress
    ir_dump: IRDump | None = None
    looks_prequantized: bool = dataclasses.field(init=False)  # before import: the model file mentions DequantizeLinear
    # check
    name: str = ""
    profile: Profile | None = None
    backend: backends.Backend | None = None  # the profile's (edgeq.backends.for_profile)
    device_note: str | None = None
    toolchain: Toolchain | None = None
    out_dir: Path | None = None
    created_out_dir: bool = False
    staging: Path | None = None
    signing_key: Ed25519PrivateKey | None = None
    # load
    model: LoadedModel | None = None
    golden_given: tuple[dict[str, np.ndarray], str] | None = None  # --golden-input: (arrays, what they are)
    labels: list[str] = dataclasses.field(default_factory=list)  # --labels
    preprocess: contract.PreprocessRecord | None = None  # what --input IMAGE applies on the device
    postprocess: contract.PostprocessRecord | None = None  # what the loaders make of the output
    # import, quantize, lower-qdq: the graph as it goes
    graph: Graph | None = None
    outputs: list[TensorSpec] = dataclasses.field(default_factory=list)
    prequantized: bool | None = None  # decided by import (QuantizeLinear/DequantizeLinear in the graph)
    exact_division: bool = False  # the model quantizes itself (QuantizeLinear, DynamicQuantizeLinear): ONNX divides
    reference_graph: Graph | None = None  # what TVM's plain pipeline builds for the reference check (edgeq.reference)
    quantization: QuantizeResult | None = None
    # lower, fp16, tuning-records; compile; golden; reference; runtime; bundle; mender
    lowered: Lowered | None = None
    records_applied: int | None = None  # functions a tuning record scheduled (with --records)
    compiled: Compiled | None = None
    golden: Golden | None = None
    reference_check: contract.ReferenceCheck | None = None
    runtime: Runtime | None = None
    manifest: contract.Manifest | None = None
    replaced: bool = False  # the output folder held a bundle of this name, now replaced
    mender: MenderResult | None = None

    def __post_init__(self) -> None:
        self.looks_prequantized = _mentions(self.args.model, b"DequantizeLinear")  # until import decides (_is_prequantized)

    @property
    def bundle_name(self) -> str:
        return f"{self.name}-{self.profile.name}"


def _check(b: _Build) -> None:
    _check_args(b)
    _check_output(b)


def _check_args(b: _Build) -> None:
    """The arguments, the profile and its backend, the compilers: everything before the output folder."""
    args = b.args
    if args.precision not in PRECISIONS:
        raise UsageError(f"unknown precision '{args.precision}'; choose one of: {', '.join(PRECISIONS)}")
    if args.precision in QUANTIZED and args.quantize is None:
        raise UsageError(f"--precision {args.precision} needs calibration data: add --calibrate DATA")
    if args.precision not in QUANTIZED and args.quantize is not None:
        raise UsageError("--calibrate and the other quantization options need --precision int8 or mixed")
    if args.precision == "mixed" and args.quantize.accuracy_budget is None:
        raise UsageError("--precision mixed needs --accuracy-budget X (top-1 points, or relative output error)")
    if args.quantize is not None:
        from edgeq.quantize import check_args

        check_args(args.quantize)
    b.name = args.name or Path(args.model).stem
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", b.name):
        raise UsageError(f"bundle name '{b.name}' may use letters, digits, '.', '_' and '-' only; set it with --name")
    if args.release is not None and args.release < 0:
        raise UsageError("--release must be a non-negative integer")
    b.labels = check_answers(args.postprocess, args.labels, args.top_k, args.conf, args.iou, args.max_det)
    if args.max_detections is not None and not 1 <= args.max_detections <= 1 << 24:
        raise UsageError("--max-detections must be an integer from 1 to 16777216")
    check_reference(args.reference, args.precision in QUANTIZED)
    if args.export_qdq is not None:
        _check_export_qdq(args)
    if args.runtime not in RUNTIME_CHOICES:
        raise UsageError(f"unknown --runtime '{args.runtime}'; choose one of: {', '.join(RUNTIME_CHOICES)}")
    if args.records is not None and not Path(args.records).is_file():
        raise UsageError(f"records file not found: {args.records} (make one with 'edgeq tune')")
    if args.sign_key is not None:
        from edgeq.signing import load_private_key

        b.signing_key = load_private_key(args.sign_key)
    b.profile, b.device_note = resolve(args.device)
    if b.device_note:
        b.progress.note(b.device_note)
    b.backend = backends.for_profile(b.profile)
    if args.precision not in b.backend.precisions:
        raise UsageError(f"--precision {args.precision} is for CUDA profiles (jetson-*); {b.profile.name} is a "
                         f"{b.backend.name.upper()} profile: use {', '.join(b.backend.precisions[:-1])} or {b.backend.precisions[-1]}")
    longest = len(f"{b.bundle_name}-") + 12  # bundle_id = NAME-DEVICE-<12 hex digits>, at most 128 characters
    if longest > 128:
        raise UsageError(f"bundle name '{b.name}' is {len(b.name)} characters; with the device and a hash the bundle id "
                         f"would be {longest}, over 128: choose a shorter --name")
    b.toolchain = toolchain_for(b.profile)


def _check_output(b: _Build) -> None:
    """The output folder (and the IR dump's): made, writable, outside any bundle; the hidden staging folder."""
    args = b.args
    if b.ir_dump is not None:
        b.ir_dump.prepare()
    b.out_dir = Path(args.output)
    inside = next((p for p in (b.out_dir.resolve(), *b.out_dir.resolve().parents)
                   if (p / contract.MANIFEST).is_file() and (p / contract.SUMS).is_file()), None)
    if inside is not None:  # a bundle holds only the files its manifest lists
        raise UsageError(f"-o {b.out_dir} is {'a bundle folder' if inside == b.out_dir.resolve() else 'inside the bundle ' + str(inside)}; "
                         "choose an output folder outside any bundle")
    try:
        b.created_out_dir = not b.out_dir.exists()
        b.out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(b.out_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        b.staging = Path(tempfile.mkdtemp(prefix=f".{b.bundle_name}.", dir=b.out_dir))
    except OSError as err:
        b.created_out_dir = False
        raise OutputError(f"cannot write to output directory {b.out_dir}: {err.strerror}; choose another with -o") from None


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


def _export_qdq(b: _Build) -> None:
    from edgeq.quantize.export_qdq import qdq_model, write

    layers = b.quantization.layers
    scales = {layer.name: float(b.quantization.scales[f"{layer.name}/activation_scale"])
              for layer in layers if layer.precision == "int8" and layer.activation != "per-token"}
    write(qdq_model(b.model.onnx_model, layers, scales, b.quantization.smoothing, b.quantization.corrections),
          Path(b.args.export_qdq))
    per_token = sum(1 for l in layers if l.precision == "int8" and l.activation == "per-token")
    b.progress.note(f"QDQ model: {len(scales)} layers quantized with edgeq's scales, {len(layers) - len(scales)} left "
                    f"in float" + (f" ({per_token} of them per-token int8 in the bundle: ONNX has no per-token "
                                   "quantize)" if per_token else ""))


def _load(b: _Build) -> None:
    from edgeq.load import read_const

    consts = {name: read_const(name, Path(path)) for name, path in b.args.consts.items()}
    b.model = load_model(b.args.model, b.args.input_shapes, consts)
    for text in b.model.warnings:
        b.progress.warn(text)
    b.preprocess = preprocess_record(b.args.preprocess, b.model.inputs)
    if b.args.postprocess == "yolo":  # NonMaxSuppression in the graph: on the device's GPU where it has one
        model, b.postprocess = with_yolo_nms(b.model.onnx_model, b.labels, b.args.conf, b.args.iou, b.args.max_det)
        b.model = dataclasses.replace(b.model, onnx_model=model)
    if b.args.golden_input is not None:  # read and checked against the inputs before anything is compiled
        from edgeq.quantize.data import load_golden

        first = load_golden(b.args.golden_input, b.model.inputs, b.args.preprocess)
        b.golden_given = ({spec.name: a for spec, a in zip(b.model.inputs, first)},
                          f"--golden-input {Path(b.args.golden_input).name}")


def _import(b: _Build) -> None:
    from edgeq.quantize import is_qdq

    b.graph, b.outputs = to_relax(b.model, max_detections=b.args.max_detections)
    if b.args.postprocess == "classify":  # (yolo's record is made with its NMS, at load)
        b.postprocess = classify_record(b.labels, b.args.top_k, b.outputs, b.model.onnx_model)
    for kind, spec in [*(("input", s) for s in b.model.inputs), *(("output", s) for s in b.outputs)]:
        if spec.dtype not in safebundle.TABLE_DTYPES:  # what golden.bin, run.py and edgeq-run can hold
            raise ModelError(f"{kind} '{spec.name}' is {spec.dtype}, which a bundle cannot carry (it holds "
                             f"{', '.join(safebundle.TABLE_DTYPES)}); add a Cast to float32 at the model's {kind}")
    # ONNX defines QuantizeLinear and DynamicQuantizeLinear as round(x / scale): built with a real division, a
    # tie lands where ONNX Runtime's does (Profile.host_target_dict)
    b.exact_division = any(call_op(binding.value) == "relax.quantize" for binding in b.graph.bindings())
    b.reference_graph = b.graph
    b.prequantized = is_qdq(b.graph)
    if b.prequantized and (b.args.quantize is not None or b.args.precision == "fp16"):
        raise UsageError(f"{Path(b.args.model).name} is already quantized (QuantizeLinear/DequantizeLinear); "
                         "package it without --precision/--calibrate")


def _lower_qdq(b: _Build) -> None:
    from edgeq.quantize import lower_prequantized

    b.quantization = lower_prequantized(b.graph, b.model)
    b.graph = b.quantization.graph
    counts = b.quantization.report.precision_counts
    b.progress.note(f"pre-quantized model: {counts['int8']} layers lowered to integer kernels, {counts['fp32']} left in float")


def _quantize(b: _Build) -> None:
    from edgeq.quantize import quantize

    b.quantization = quantize(b.graph, b.model, b.args.quantize, note=b.progress.note, tick=b.progress.tick,
                              warn=b.progress.warn)
    b.graph = b.quantization.graph
    b.reference_graph = b.graph  # an int8/mixed build is checked against its own quantized graph


def _lower(b: _Build) -> None:
    target = b.profile.tvm_target(reciprocal=not b.exact_division)
    b.graph, calls = lower_graph(b.graph, target)
    b.lowered = Lowered(target=target, mod=b.graph.mod, kernel_calls=calls)


def _fp16(b: _Build) -> None:
    b.graph = b.backend.to_fp16(b.graph)  # the golden outputs are computed on this graph too
    b.lowered = dataclasses.replace(b.lowered, mod=b.graph.mod)


def _tuning_records(b: _Build) -> None:
    from edgeq.records import apply_records

    mod, b.records_applied = apply_records(b.lowered.mod, b.lowered.target, Path(b.args.records), b.profile,
                                           warn=b.progress.warn, precision=_precision(b), note=b.progress.note)
    b.lowered = dataclasses.replace(b.lowered, mod=mod)
    b.progress.note(f"tuning records scheduled {b.records_applied} function(s) ({_precision(b)}, {b.profile.name})")


def _compile(b: _Build) -> None:
    schedules: dict[str, object] = {}
    executable = build(b.lowered.mod, b.lowered.target, b.toolchain, schedules)
    library = b.staging / contract.LIBRARY
    export(executable, library, b.toolchain)
    b.compiled = Compiled(executable=executable, schedules=schedules)
    machine = elf_machine(library)
    if machine != b.profile.cpu.arch:
        raise ToolchainError(f"the exported library is {machine}, not {b.profile.cpu.arch}; check the cross compiler {b.toolchain.cxx}")
    b.backend.check_library(library, b.profile, b.toolchain)


def gather_bounds(onnx_model) -> dict[str, int]:
    """{integer graph input: the rows of the smallest table a Gather indexes with it}: the indices a generated
    input may hold (a BERT's token_type_ids index a 2-row table). Followed through Cast, Reshape, (Un)Squeeze,
    Flatten and Identity; tables are initializers or Constant nodes."""
    from onnx import numpy_helper

    graph = onnx_model.graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = list(numpy_helper.to_array(node.attribute[0].t).shape)
    producer = {out: node for node in graph.node for out in node.output}
    inputs = {i.name for i in graph.input}
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.input[0] not in shapes:
            continue
        table = shapes[node.input[0]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if not table or not -len(table) <= axis < len(table):
            continue
        source = node.input[1]
        while source not in inputs and source in producer and producer[source].op_type in \
                ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"):
            source = producer[source].input[0]
        if source in inputs:
            bounds[source] = min(bounds.get(source, table[axis]), table[axis])
    return bounds


def golden_inputs(specs: list[TensorSpec], seed: int = GOLDEN_SEED, floats: str = GOLDEN_DISTRIBUTIONS[0],
                  bounds: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """A deterministic golden input: floats drawn from ``floats`` (standard normal, or one of the uniform
    ranges of ``GOLDEN_DISTRIBUTIONS`` for models defined on part of the line), small non-negative integers
    (below 8, below every dimension of the float inputs, and below ``bounds``: the rows of the tables they index,
    ``gather_bounds``)."""
    rng = np.random.default_rng(seed)
    # integer inputs are mostly indices into the float ones (Gather, ScatterND, RoiAlign's batch indices): drawn
    # below the smallest dimension of a float input, so that every index is in range for every reader
    float_dims = [d for spec in specs if np.dtype(spec.dtype).kind == "f" for d in spec.shape if d > 0]
    int_bound = max(1, min([8, *float_dims]))  # (a model of integer inputs alone: 0 to 7)
    out = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f" and floats in _UNIFORM:
            out[spec.name] = _drawn(lambda n: rng.uniform(*_UNIFORM[floats], n), spec.shape, dtype)
        elif dtype.kind == "f":
            out[spec.name] = _drawn(rng.standard_normal, spec.shape, dtype)
        elif dtype.kind == "b":
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(dtype)
        else:
            bound = max(1, min(int_bound, (bounds or {}).get(spec.name, int_bound)))
            out[spec.name] = rng.integers(0, bound, spec.shape).astype(dtype)
    return out


_DRAW_CHUNK = 1 << 22  # float64 draws at a time: a 4 GB float32 input never needs 8 GB of float64 at once


def _drawn(draw, shape, dtype: np.dtype) -> np.ndarray:
    """``draw(n)`` (float64) into an array of ``dtype``, in chunks; the same values as one draw of the whole."""
    out = np.empty(int(np.prod(shape, dtype=np.int64)), dtype)
    for start in range(0, out.size, _DRAW_CHUNK):
        stop = min(start + _DRAW_CHUNK, out.size)
        out[start:stop] = draw(stop - start)
    return out.reshape(shape)


def _check_memory(b: _Build) -> None:
    """Refuse in one line, before anything is drawn, a golden computation this machine cannot hold: the
    inputs, the outputs, and the reference's outputs beside them."""
    import psutil

    def nbytes(specs) -> int:
        return sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in specs)

    need = nbytes(b.model.inputs) + 2 * nbytes(b.outputs)
    free = psutil.virtual_memory().available
    if need > free:
        def size(n: int) -> str:
            return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

        raise ModelError(f"the golden input and outputs take {size(need)} and this machine has {size(free)} free; "
                         "fix smaller input shapes with --input-shape, or package on a machine with more memory")


def _finite(outputs) -> bool:
    return all(np.asarray(o).dtype.kind != "f" or np.isfinite(o).all() for o in outputs)


def _golden(b: _Build) -> None:
    _check_memory(b)
    if b.profile.name == "host":
        executable, computed_with = b.compiled.executable, "the bundle's own library, on the build host"
    else:
        host = profiles()["host"]
        executable = build(b.graph.mod, host.tvm_target(reciprocal=not b.exact_division))
        computed_with = f"a TVM LLVM build for the build host ({host.cpu.mcpu})"
    runner = HostRunner(b.graph, executable)
    # the user's golden input; else an int8 build's first calibration sample (the data the user chose); else generated
    given = b.golden_given
    if given is None and b.quantization is not None and b.quantization.first_sample is not None:
        given = ({spec.name: a for spec, a in zip(b.model.inputs, b.quantization.first_sample)},
                 f"the first calibration sample ({Path(b.quantization.first_sample_source).name})")
    if given is not None:
        inputs, floats = given
        outputs = runner(list(inputs.values()))
        tried = f"the golden input ({floats})"
    else:
        has_floats = any(np.dtype(spec.dtype).kind == "f" for spec in b.model.inputs)
        distributions = GOLDEN_DISTRIBUTIONS if has_floats else GOLDEN_DISTRIBUTIONS[:1]
        bounds = gather_bounds(b.model.onnx_model)
        for floats in distributions:
            inputs = golden_inputs(b.model.inputs, floats=floats, bounds=bounds)
            outputs = runner(list(inputs.values()))
            if _finite(outputs):
                break
        tried = f"the golden input (each generated one: {', '.join(distributions)})"
    for spec, out in zip(b.outputs, outputs):
        if np.asarray(out).dtype.kind == "f" and not np.isfinite(out).all():
            from onnx import numpy_helper

            arrays = ((t.name, numpy_helper.to_array(t)) for t in b.model.onnx_model.graph.initializer)
            bad = [name for name, w in arrays if w.dtype.kind == "f" and not np.isfinite(w).all()]
            cause = (f"weight(s) {', '.join(bad[:3])} hold NaN or Inf" if bad else
                     "give an input the model is defined on with --golden-input FILE.npz, or an image and --preprocess"
                     if given is None else "check the model on that input, or give another --golden-input")
            raise ModelError(f"output '{spec.name}' is NaN or Inf on {tried}: {cause}; "
                             "a bundle whose self-test cannot pass is not written")
    arrays = [(f"input:{k}", v) for k, v in inputs.items()]
    arrays += [(f"output:{spec.name}", out) for spec, out in zip(b.outputs, outputs)]
    table = bundle.write_tensors(b.staging / contract.GOLDEN, arrays)
    b.golden = Golden(inputs=inputs, outputs=outputs, table=table, float_inputs=floats, computed_with=computed_with)


def _reference_check(b: _Build) -> None:
    reference = choose_reference(b.args.reference, b.model.onnx_model, b.reference_graph,
                                 quantized_by_edgeq=b.args.precision in QUANTIZED)
    if reference.note:
        b.progress.note(f"reference: {reference.name} ({reference.note})")
    rtol, atol = _reference_tolerance(b)
    parts = yolo_parts(b.postprocess.output) if b.postprocess is not None and b.postprocess.kind == "yolo" else None
    # an edgeq-quantized build: how much its quantized graph moves by itself under float noise (edgeq.reference),
    # always measured where the device's kernels are not the build host's (its self-test takes the allowance)
    noisy = (lambda: reference_probes(b.reference_graph, reference.graph)) if b.args.precision in QUANTIZED else None
    b.reference_check = compare_reference(reference, b.golden.inputs, b.golden.outputs, b.outputs, rtol, atol,
                                          checked=b.golden.computed_with, parts=parts, probes=noisy,
                                          probe_always=b.profile.name != "host")
    check = b.reference_check
    if check.result == "passed":
        b.progress.note(f"reference check passed: {check.reference}, largest |diff| {check.max_abs_diff:.3g}")
    elif b.golden.float_inputs in GOLDEN_DISTRIBUTIONS and check.result.startswith("not conclusive: the reference failed"):
        # a generated input the model is not defined on: its golden outputs would be no better than the check
        raise ModelError(f"the reference ({check.reference}) cannot run the generated golden input "
                         f"({check.result.split(': ', 2)[-1]}), so the build cannot be checked; nothing was written. "
                         "Give an input the model is meant for with --golden-input FILE.npz")
    else:  # nothing could be compared: said even with --quiet, recorded in the manifest
        b.progress.warn(f"reference check {check.result} ({check.reference}); the bundle is written unchecked: "
                        "give an input the model is meant for with --golden-input")


def _runtime(b: _Build) -> None:
    b.runtime = assemble(b.profile, b.toolchain.cxx, b.staging, note=b.progress.note)


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


def _precision(b: _Build) -> str:
    return "int8" if b.prequantized else b.args.precision


def _golden_tolerance(b: _Build) -> tuple[float, float]:
    """(rtol, atol) of the self-test: what the device's kernels may differ by from the build host's."""
    return b.backend.golden_tolerance(b.args.precision, b.quantization is not None, b.profile.name == "host")


def _reference_tolerance(b: _Build) -> tuple[float, float]:
    """(rtol, atol) of the reference check: fp16 rounds after each layer, and an integer build differs from
    its reference by a quantization step wherever float noise before a quantize crosses a rounding boundary."""
    if b.args.precision == "fp16":
        return GOLDEN_FP16_RTOL, GOLDEN_FP16_ATOL
    if b.quantization is not None:
        return GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL
    return REFERENCE_FP32_RTOL, REFERENCE_FP32_ATOL


def _bundle(b: _Build) -> None:
    tvm = import_tvm()
    library = b.staging / contract.LIBRARY
    weight_arrays = b.graph.weight_list()
    weight_table = bundle.write_tensors(b.staging / contract.WEIGHTS,
                                        [(p.name, w) for p, w in zip(b.graph.weight_params, weight_arrays)])
    extra_files = list(b.runtime.files) if b.runtime else []
    if b.quantization is not None:
        np.savez(b.staging / contract.QUANT_PARAMS, **b.quantization.scales)
        extra_files.append(contract.QUANT_PARAMS)
    content_hash = hashlib.sha256()
    for name in (contract.LIBRARY, contract.WEIGHTS, *extra_files):
        content_hash.update(bundle.sha256_file(b.staging / name).encode())
    created = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    weights = b.staging / contract.WEIGHTS
    rtol, atol = _golden_tolerance(b)
    manifest = contract.Manifest(
        schema_version=contract.SCHEMA_VERSION,
        bundle_id=f"{b.bundle_name}-{content_hash.hexdigest()[:12]}",
        name=b.name,
        release=b.args.release if b.args.release is not None else int(created.strftime("%Y%m%d%H%M%S")),
        signed=b.signing_key is not None,
        created=created.isoformat(),
        edgeq_version=edgeq.__version__,
        tvm_version=tvm.__version__,
        precision=_precision(b),
        model=contract.ModelRecord(
            file=Path(b.args.model).name, sha256=b.model.sha256, opset=b.model.opset,
            producer=f"{b.model.onnx_model.producer_name} {b.model.onnx_model.producer_version}".strip()),
        inputs=list(b.model.inputs),
        outputs=list(b.outputs),
        device=b.profile.device_record(),
        toolchain=contract.ToolchainRecord.from_json(b.toolchain.to_dict(), "toolchain"),
        library=contract.LibraryRecord(
            file=contract.LIBRARY, machine=elf_machine(library), cuda_device_code=cuda_device_code(library),
            bytes=library.stat().st_size,
            **b.backend.kernel_record(b.compiled.schedules, b.lowered.kernel_calls)),
        weights=contract.WeightsRecord(
            file=contract.WEIGHTS, format=contract.TENSOR_FORMAT, count=len(weight_arrays),
            dtypes=sorted({str(w.dtype) for w in weight_arrays}), bytes=int(sum(w.nbytes for w in weight_arrays)),
            file_bytes=weights.stat().st_size, tensors=weight_table),
        golden=contract.GoldenRecord(
            file=contract.GOLDEN, format=contract.TENSOR_FORMAT, tensors=b.golden.table, seed=GOLDEN_SEED,
            float_inputs=b.golden.float_inputs, computed_with=b.golden.computed_with,
            rtol=rtol, atol=atol,
            atol_scaled_by="max(1, max |expected output|)",
            outliers=max((r.get("outliers", 0.0) for r in b.reference_check.outputs), default=0.0) or None),
        reference_check=b.reference_check,
        quantization=b.quantization.report if b.quantization else None,
        runtime=contract.RuntimeRecord.from_json(b.runtime.record, "runtime") if b.runtime else None,
        build={"args": b.args.to_dict(), "stage_seconds": dict(b.progress.seconds),
               **({"records_applied": b.records_applied} if b.records_applied is not None else {})},
        compatibility=check_elves(b.staging, [contract.LIBRARY, *b.runtime.files], b.profile) if b.runtime else None,
        preprocess=b.preprocess,
        postprocess=b.postprocess,
        files={}, sizes={},
    )
    b.manifest = bundle.write_bundle(b.staging, manifest, extra_files, b.signing_key)
    # The archive is made from the staging folder under the final name, then both are renamed into place.
    final_dir = b.out_dir / b.bundle_name
    named = b.staging / b.bundle_name
    named.mkdir()
    for path in list(b.staging.iterdir()):
        if path != named:
            path.rename(named / path.name)
    archive_tmp = b.staging / f"{b.bundle_name}.tar.gz"
    bundle.make_archive(named, archive_tmp, mtime=int(created.timestamp()))
    if final_dir.exists():  # said even with --quiet, and in --json as "replaced"
        b.progress.warn(f"replacing the bundle already in {final_dir}")
        b.replaced = True
        final_dir.rename(b.staging / "previous")
    named.rename(final_dir)
    archive_tmp.replace(b.out_dir / f"{b.bundle_name}.tar.gz")


def _mender(b: _Build) -> None:
    from edgeq.mender import MenderArgs, write_artifact

    b.mender = write_artifact(MenderArgs(bundle=b.out_dir / f"{b.bundle_name}.tar.gz",
                                         output=b.out_dir / f"{b.bundle_name}.mender"))


def _is_prequantized(b: _Build) -> bool:
    """Decided by import; before it, a cheap look at the model file's bytes (the progress total may be
    corrected once import has looked at the graph)."""
    return b.looks_prequantized if b.prequantized is None else b.prequantized


def _lower_description(b: _Build) -> str:
    return b.backend.describe_prepare(b.profile)


def _compile_description(b: _Build) -> str:
    return b.backend.describe_build(b.profile, b.toolchain)


def _device_label(device: str) -> str:
    """The profile a device name resolves to (an alias names its default profile); the name itself when it
    does not resolve (check says why)."""
    try:
        return resolve(device)[0].name
    except EdgeqError:
        return device


def _graph_mod(b: _Build):
    return b.graph.mod


# The whole job, in the order it runs. `ir`: the module a stage leaves, for --dump-ir.
STAGES: tuple[Stage[_Build], ...] = (
    Stage("check", lambda b: f"device {_device_label(b.args.device)}, compilers, output folder", _check),
    Stage("load", lambda b: f"read and check {b.args.model}", _load),
    Stage("import", lambda b: "ONNX -> Relax IRModule", _import, ir=_graph_mod),
    Stage("quantize", lambda b: f"calibrate ({b.args.quantize.method}) and quantize to {b.args.precision}", _quantize,
          applies=lambda b: b.args.precision in QUANTIZED, ir=_graph_mod),
    Stage("lower-qdq", lambda b: "QDQ pattern -> integer conv/matmul kernels", _lower_qdq,
          applies=_is_prequantized, ir=_graph_mod),
    Stage("lower", _lower_description, _lower, ir=lambda b: b.lowered.mod),
    Stage("fp16", lambda b: "fp16 weights and activations, fp32 accumulation (TVM's ToMixedPrecision)", _fp16,
          applies=lambda b: b.args.precision == "fp16", ir=lambda b: b.lowered.mod),
    Stage("tuning-records", lambda b: f"best schedules from {b.args.records} (legalized and fused first)",
          _tuning_records, applies=lambda b: b.args.records is not None, ir=lambda b: b.lowered.mod),
    Stage("compile", _compile_description, _compile),  # build, export, check the library's machine and device code
    Stage("golden", lambda b: "golden input and outputs on the build host", _golden),
    Stage("reference", lambda b: "the golden outputs checked against an independent reference", _reference_check),
    Stage("runtime", lambda b: f"runtime/ for {b.profile.cpu.arch}: "
          f"{', '.join(('TVM runtime', *b.backend.runtime_parts, 'edgeq-run'))}", _runtime, applies=lambda b: b.args.runtime != "none"),
    Stage("bundle", lambda b: f"write {b.out_dir / b.bundle_name} and .tar.gz", _bundle),
    Stage("mender", lambda b: f"Mender Artifact {b.out_dir / b.bundle_name}.mender (payload type edgeq)", _mender,
          applies=lambda b: b.args.mender),
    Stage("export-qdq", lambda b: f"edgeq's calibration as ONNX QDQ: {b.args.export_qdq}", _export_qdq,
          applies=lambda b: b.args.export_qdq is not None),
)


# What `package` builds up to and including the module it compiles; `edgeq tune` tunes exactly that module.
FRONT_END = ("load", "import", "quantize", "lower-qdq", "lower", "fp16")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """The module ``package`` compiles, and what it is for (``front_end``)."""

    profile: Profile
    toolchain: Toolchain
    precision: str  # as the manifest says it: int8 for a pre-quantized model
    lowered: Lowered


def front_end(args: PackageArgs, progress: StageProgress | None = None) -> FrontEnd:
    """Run ``package``'s stages up to the module it compiles (load with ``--const`` and shape folding, import,
    quantization with calibration or a pre-quantized model's lowering, the backend's preparation, fp16),
    checking the arguments as ``package`` does and writing nothing: one front end for ``package`` and
    ``edgeq tune``."""
    progress = progress or StageProgress(quiet=True)
    b = _Build(args=args, progress=progress)
    _check_args(b)
    run_stages([stage for stage in STAGES if stage.name in FRONT_END], b, progress)
    return FrontEnd(profile=b.profile, toolchain=b.toolchain, precision=_precision(b), lowered=b.lowered)


def package(args: PackageArgs, progress: StageProgress | None = None) -> PackageResult:
    """Package ``args.model`` for ``args.device``. Raises EdgeqError subclasses with one-line messages."""
    progress = progress or StageProgress(quiet=True)
    b = _Build(args=args, progress=progress, ir_dump=IRDump(args.dump_ir) if args.dump_ir is not None else None)
    try:
        run_stages(STAGES, b, progress, b.ir_dump)
    except BaseException:
        if b.created_out_dir and b.out_dir is not None and not _inside(args.dump_ir, b.out_dir):
            shutil.rmtree(b.out_dir, ignore_errors=True)  # (not when it holds the IR dump, which must stay)
        raise
    finally:
        if b.staging is not None:
            shutil.rmtree(b.staging, ignore_errors=True)
    return PackageResult(
        bundle_dir=b.out_dir / b.bundle_name,
        archive=b.out_dir / f"{b.bundle_name}.tar.gz",
        device=b.profile.name,
        device_note=b.device_note,
        precision=_precision(b),
        stages=dict(progress.seconds),
        total_seconds=progress.total_seconds,
        manifest=b.manifest,
        replaced=b.replaced,
        mender=b.mender,
        records_applied=b.records_applied,
    )


__all__ = ["PackageArgs", "PackageResult", "package", "PRECISIONS", "EdgeqError"]
