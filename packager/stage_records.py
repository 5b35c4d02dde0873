"""What ``edgeq package`` starts from and what each of its stages makes: one frozen record per stage.

The chain (``edgeq.package.STAGES`` runs it; docs/architecture.md draws it as a table):

    PackageArgs -> Setup (check) -> Loaded (load) -> Imported (import) -> Quantized (quantize | lower-qdq)
      -> Lowered (lower; fp16 and tuning-records make a new one from it) -> Compiled (compile) -> Golden (golden)
      -> ReferenceCheck (reference) -> Runtime (runtime) -> Written (bundle) -> MenderResult (mender),
         ExportedQdq (export-qdq)

A stage is a function whose parameters name, by their types, the records it reads, and whose return type is
the record it makes (``edgeq.pipeline.run_stages`` hands them over). Every record is a frozen dataclass: no
stage writes a field another stage made; fp16 and tuning-records return a new ``Lowered`` made with
``dataclasses.replace``, the only record more than one stage makes, and quantize and lower-qdq are two ways to
the same ``Quantized``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeq.choices import DEFAULT_OUTPUT

if TYPE_CHECKING:  # the types of what the stages make; importing them costs TVM, so only for type checkers
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from tvm import IRModule
    from tvm.relax import VMExecutable
    from tvm.target import Target

    from edgeq.templates import contract
    from edgeq.backends import Backend
    from edgeq.graph import Graph
    from edgeq.load import LoadedModel
    from edgeq.quantize import QuantizeArgs, QuantizeResult
    from edgeq.quantize.data import Preprocess
    from edgeq.targets import Profile
    from edgeq.toolchain import Toolchain


@dataclasses.dataclass(frozen=True)
class FrontEndArgs:
    """What decides the module a build compiles: ``edgeq package`` and ``edgeq tune`` take these alike (the
    CLI declares them once, ``edgeq.cli.package.add_graph_options``), so tune tunes what package builds."""

    model: Path
    device: str
    input_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    consts: dict[str, Path] = dataclasses.field(default_factory=dict)  # graph input -> .npy bound before import
    precision: str = "fp32"
    quantize: QuantizeArgs | None = None  # int8 / mixed
    preprocess: Preprocess | None = None  # how images (calibration, golden input) become tensors
    max_detections: int | None = None  # NonMaxSuppression: its selected rows padded to at most this (edgeq.nms)

    def front_end_fields(self) -> dict[str, Any]:
        """This record's own fields (shallow), to make a ``PackageArgs`` of it: ``PackageArgs(**f, output=...)``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(FrontEndArgs)}


@dataclasses.dataclass(frozen=True)
class PackageArgs(FrontEndArgs):
    """What ``edgeq package`` was asked to do; the manifest records it."""

    output: Path = Path(DEFAULT_OUTPUT)
    name: str | None = None
    sign_key: Path | None = None  # ed25519 private key (edgeq keygen): writes manifest.sig
    release: int | None = None  # monotonically increasing per model name; default: build time YYYYMMDDHHMMSS
    records: Path | None = None  # tuning records (edgeq tune) to compile with
    runtime: str = "bundled"  # "bundled": runtime/ with TVM's runtime, the CUDA bridge and edgeq-run; "none"
    dump_ir: Path | None = None  # write the Relax module after each stage that changes it here (NN-<stage>.py)
    reference: str = "auto"  # the independent reference the build is checked against: auto, onnxruntime, tvm
    golden_input: Path | None = None  # the self-test's input: .npz/.npy (one array per input) or an image
    mender: bool = False  # also write OUTDIR/<name>-<device>.mender, a Mender Artifact of the archive (edgeq.mender)
    export_qdq: Path | None = None  # int8/mixed: also write the calibrated model as ONNX QDQ (edgeq.quantize.export_qdq)
    postprocess: str | None = None  # "classify" / "yolo": the loaders print classes / boxes (edgeq.answers)
    labels: Path | None = None  # one class label per line
    top_k: int = 5  # classify
    conf: float = 0.25  # yolo: score threshold
    iou: float = 0.45  # yolo: IoU above which a box is suppressed
    max_det: int = 300  # yolo: detections at most
    gpu_kernels: str = "auto"  # CUDA profiles: "auto" (edgeq's kernels a GPU verified), "dlight" or "cutlass"
    max_context: int | None = None  # language models: tokens of context (prompt and answer), default 512
    tokenizer: Path | None = None  # language models: tokenizer.json (default: the one beside the model)

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
            "gpu_kernels": self.gpu_kernels,
            "max_context": self.max_context,
            "tokenizer": str(self.tokenizer) if self.tokenizer else None,
        }

    def display(self) -> str:
        return "\n".join(f"  {key:<13} {value}" for key, value in self.to_dict().items())


@dataclasses.dataclass(frozen=True)
class Output:
    """Where the bundle goes (check): the output folder and the hidden staging folder beside the bundle."""

    out_dir: Path
    created_out_dir: bool  # made by this build: removed again if the build fails
    staging: Path


@dataclasses.dataclass(frozen=True)
class Setup:
    """What check makes: the bundle's name, the profile and its backend, the compilers, the signing key, the
    labels, and (``package``, not ``tune``) the output folder."""

    name: str
    profile: Profile
    backend: Backend  # the profile's (edgeq.backends.for_profile)
    device_note: str | None
    toolchain: Toolchain
    signing_key: Ed25519PrivateKey | None
    labels: tuple[str, ...]  # --labels
    looks_prequantized: bool  # the model file mentions DequantizeLinear (until import decides: Imported.prequantized)
    output: Output | None = None

    @property
    def bundle_name(self) -> str:
        return f"{self.name}-{self.profile.name}"


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What load makes: the checked model, and what the given options say of its inputs and outputs."""

    model: LoadedModel
    golden_given: tuple[dict[str, np.ndarray], str] | None  # --golden-input: (arrays, what they are)
    preprocess: contract.PreprocessRecord | None  # what --input IMAGE applies on the device
    postprocess: contract.PostprocessRecord | None  # yolo's (its NMS is added to the model here)


@dataclasses.dataclass(frozen=True)
class Imported:
    """What import makes: the graph as ONNX defines it."""

    graph: Graph
    outputs: tuple[contract.TensorSpec, ...]
    prequantized: bool  # QuantizeLinear/DequantizeLinear in the graph
    exact_division: bool  # the model quantizes itself (QuantizeLinear, DynamicQuantizeLinear): ONNX divides
    postprocess: contract.PostprocessRecord | None  # what the loaders make of the output (load's yolo, or classify)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """What quantize (edgeq's calibration) or lower-qdq (a pre-quantized model) makes."""

    result: QuantizeResult  # its graph is the one lower takes
    reference_graph: Graph  # what TVM's plain pipeline builds for the reference check (edgeq.reference)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """What lower makes (and fp16 and tuning-records remake): the module the build compiles."""

    target: Target  # the profile's TVM target
    graph: Graph  # the lowered graph (fp16: converted): its weights go to the bundle, golden computes on it
    mod: IRModule  # the graph's module, prepared by the backend, with records applied
    kernel_calls: int  # conv/matmul calls on edgeq's CPU kernels
    records_applied: int | None = None  # functions a tuning record scheduled (with --records)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What compile makes: the executable (exported to staging/model.so) and what the backend's kernels did."""

    executable: VMExecutable
    schedules: dict[str, object]  # CPU: TIR functions by schedule; CUDA: the GpuKernels record
    library: Path  # staging/model.so


@dataclasses.dataclass(frozen=True)
class Golden:
    """What golden makes: the self-test's input and its outputs on the build host (in staging/golden.bin)."""

    inputs: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    table: list[contract.StoredTensor]  # golden.bin's tensor table
    float_inputs: str  # what the input's floats are (GOLDEN_DISTRIBUTIONS, or the given input)
    computed_with: str


@dataclasses.dataclass(frozen=True)
class Written:
    """What bundle makes: the bundle folder and archive in place, and their manifest."""

    manifest: contract.Manifest
    bundle_dir: Path
    archive: Path
    replaced: bool  # the output folder held a bundle of this name, now replaced


@dataclasses.dataclass(frozen=True)
class ExportedQdq:
    """What export-qdq makes: the QDQ model file, and how many layers it quantizes."""

    path: Path
    quantized: int  # layers with edgeq's scales
    left_float: int
