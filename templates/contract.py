"""The bundle contract: what an edgeq bundle holds and what its manifest says, in one place.

Standard library only and Python 3.8 compatible, because three kinds of code share this one file: edgeq
itself (``edgeq.templates.contract``: the writer in ``edgeq.package``, the readers ``edgeq inspect``, ``bench``,
``fleet``), ``safebundle.py`` (the verifier, which also runs on devices without edgeq) and the bundle's own
loader ``run.py``; a bundle and ``edgeq flash`` carry this file beside them as ``contract.py``. The native
loader (``runtime/edgeq-run``, C++) reads the same manifest; its schema version comes from here at build
time and tests hold its statistics to ``latency_statistics``.

Readers get a ``Manifest`` from ``Manifest.from_json`` (which refuses a manifest whose fields have the wrong
types, naming the field) and use attributes; the writer builds a ``Manifest`` and writes ``to_json()``.
Field order is JSON key order. A new field: add it to the record (with ``_field``), and to the writer.
"""

from __future__ import annotations

import dataclasses
import enum
import math

SCHEMA_VERSION = 3  # 3: one quantization report shape (``kind``), latency statistics with p50 and mean throughput

# The files of a bundle. RUNTIME is the one sub-folder a bundle may have.
MANIFEST, SIGNATURE, SUMS = "manifest.json", "manifest.sig", "SHA256SUMS"
LIBRARY, WEIGHTS, GOLDEN, QUANT_PARAMS = "model.so", "weights.bin", "golden.bin", "quant_params.npz"
LOADER, CONTRACT, VERIFIER, README = "run.py", "contract.py", "safebundle.py", "README.md"
IMAGING = "imaging.py"
VIDEO = "video.py"
GENERATE, TOKENIZER_PY, TOKENIZER = "generate.py", "tokenizer.py", "tokenizer.json"
RUNTIME = "runtime"
NATIVE_LOADER = RUNTIME + "/edgeq-run"
TENSOR_FORMAT = "edgeq-raw-1"  # little-endian C-order arrays, each at a 64-byte aligned offset; the manifest has the table

FILE_ROLES = {
    LIBRARY: "compiled model (TVM Relax executable, shared library)",
    WEIGHTS: "weights, in the order the library takes them",
    GOLDEN: "golden input and the outputs computed on the build host",
    MANIFEST: "what the bundle is and needs: model, device, toolchain, inputs/outputs, file hashes",
    LOADER: "Python loader: checks, runs, self-tests and benchmarks the model",
    CONTRACT: "the manifest's schema and the latency statistics (run.py and safebundle.py use it)",
    VERIFIER: "verifies the signature and every file; installs with anti-rollback (python3 safebundle.py --help)",
    IMAGING: "images in, answers out: run.py --input IMAGE and --postprocess (edgeq-run repeats it in C++)",
    VIDEO: "video in: run.py --input VIDEO|/dev/videoN|csi://N|rtsp://...|gst:PIPELINE through the system's GStreamer",
    GENERATE: "token generation over the model's prefill and decode steps: run.py --prompt (language models)",
    TOKENIZER_PY: "the byte-level BPE tokenizer run.py --prompt uses (standard library only)",
    TOKENIZER: "the model's tokenizer, as Hugging Face's tokenizers library writes it",
    README: "this file",
    SUMS: "SHA-256 of every other file (sha256sum -c SHA256SUMS)",
    QUANT_PARAMS: "int8 scales: activation scale and per-channel weight scales of each int8 layer",
    SIGNATURE: "ed25519 signature over manifest.json (edgeq verify BUNDLE --pub KEY)",
    NATIVE_LOADER: "native loader: checks, runs, self-tests and benchmarks the model without Python",
    RUNTIME + "/libtvm_ffi.so": "TVM FFI library (apache-tvm-ffi), the version the model was compiled with",
    RUNTIME + "/libtvm_runtime.so": "TVM runtime (apache-tvm), the version the model was compiled with",
    RUNTIME + "/libtvm_runtime_cuda.so": "TVM's CUDA backend (links CUDA 13's libcudart.so.13)",
    RUNTIME + "/libcudart.so.13": "edgeq's CUDA 12 bridge: gives TVM's CUDA backend the device's libcudart.so.12",
}


class LoaderExit(enum.IntEnum):
    """Exit statuses of the bundle's loaders (run.py, edgeq-run); the same numbers as edgeq's own."""

    OK = 0
    SELF_TEST_FAILED = 1
    USAGE = 2
    DEVICE = 4  # this machine cannot run the bundle (architecture, driver, GPU, TVM version)
    BUNDLE = 7  # the bundle is damaged, changed, unsigned where a key is trusted, or unreadable
    SOURCE = 9  # a video source failed, stopped midway or delivered no frame for --timeout seconds (edgeq: 8 is REMOTE)


class HostState(str, enum.Enum):
    """What a rollout did on one host (``edgeq flash`` / ``fleet`` results)."""

    UPDATED = "updated"
    ALREADY = "already"  # the bundle was already current there
    ROLLED_BACK = "rolled-back"  # the new release failed its health check; the previous one is current again
    FAILED = "failed"
    SKIPPED = "skipped"  # not tried: dry run, or the rollout stopped

    def __str__(self) -> str:
        return self.value


class ContractError(ValueError):
    """A manifest (or report) that does not follow the contract; ``str()`` names the field."""


# ---------------------------------------------------------------------------------------------------
# field kinds: each checks a JSON value and returns it (records: as their dataclass)
# ---------------------------------------------------------------------------------------------------


class Kind:
    def __init__(self, name, check):
        self.name, self.check = name, check

    def load(self, value, where):
        if not self.check(value):
            raise ContractError("manifest field '%s' is not %s" % (where, self.name))
        return value


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


STR = Kind("text", lambda v: isinstance(v, str))
INT = Kind("an integer", _is_int)
COUNT = Kind("a count (an integer >= 0)", lambda v: _is_int(v) and v >= 0)
NUM = Kind("a number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v))
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
JSON = Kind("JSON", lambda v: True)  # free-form: shown, never interpreted
OBJECT = Kind("an object", lambda v: isinstance(v, dict))


class OptionalKind(Kind):
    def __init__(self, kind):
        super().__init__(kind.name + " or null", None)
        self.kind = kind

    def load(self, value, where):
        if value is not None and type(self.kind) is Kind and not self.kind.check(value):
            raise ContractError("manifest field '%s' is not %s" % (where, self.name))
        return None if value is None else self.kind.load(value, where)


class ListKind(Kind):
    def __init__(self, kind):
        super().__init__("a list", None)
        self.kind = kind

    def load(self, value, where):
        if not isinstance(value, list):
            raise ContractError("manifest field '%s' is not a list" % where)
        return [self.kind.load(v, "%s[%d]" % (where, i)) for i, v in enumerate(value)]


class DictKind(Kind):
    def __init__(self, kind):
        super().__init__("an object", None)
        self.kind = kind

    def load(self, value, where):
        if not isinstance(value, dict):
            raise ContractError("manifest field '%s' is not an object" % where)
        return {k: self.kind.load(v, "%s.%s" % (where, k)) for k, v in value.items()}


class RecordKind(Kind):
    def __init__(self, cls):
        super().__init__("an object", None)
        self.cls = cls

    def load(self, value, where):
        return self.cls.from_json(value, where)


def _field(kind, omit_if_none=False):
    """A record field of ``kind``; required unless the kind is optional (``OptionalKind``). ``omit_if_none``: left
    out of the JSON when None (fields that only some bundles have)."""
    return dataclasses.field(default=None, metadata={"kind": kind, "omit": omit_if_none})


def _dump(value):
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


class Record:
    """A dataclass whose fields carry their JSON kind; ``from_json`` validates, ``to_json`` writes."""

    @classmethod
    def from_json(cls, data, where=""):
        if not isinstance(data, dict):
            raise ContractError("manifest field '%s' is not an object" % (where or "(top level)"))
        values = {}
        for f in dataclasses.fields(cls):
            kind, name = f.metadata["kind"], (where + "." if where else "") + f.name
            if f.name not in data and not isinstance(kind, OptionalKind):
                raise ContractError("manifest field '%s' is missing" % name)
            values[f.name] = kind.load(data.get(f.name), name)
        return cls(**values)

    def to_json(self):
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata["omit"]:
                continue
            out[f.name] = _dump(value)
        return out


def _rec(cls):
    return dataclasses.dataclass(frozen=True)(cls)


# ---------------------------------------------------------------------------------------------------
# the manifest
# ---------------------------------------------------------------------------------------------------


@_rec
class RowsRecord(Record):
    """An output padded along ``axis`` to ``bound`` rows (NonMaxSuppression's selected boxes and what is
    gathered by them): the output named ``count`` (int64, one value) says how many rows are real; the rest
    are padding (-1 in the selected indices)."""

    axis: int = _field(COUNT)
    bound: int = _field(COUNT)
    count: str = _field(STR)
    source: str = _field(STR)  # the node that selected them


@_rec
class TensorSpec(Record):
    """A model input or output."""

    name: str = _field(STR)
    shape: list = _field(ListKind(COUNT))
    dtype: str = _field(STR)
    rows: RowsRecord | None = _field(OptionalKind(RecordKind(RowsRecord)), omit_if_none=True)

    def real_rows(self, outputs: dict) -> int | None:
        """How many rows of this output are real, read from its count output in ``outputs`` (name -> array),
        or None for an output that is not padded."""
        if self.rows is None or self.rows.count not in outputs:
            return None
        counted = outputs[self.rows.count].reshape(-1)
        return max(0, min(int(counted[0]), self.rows.bound)) if counted.size else 0


@_rec
class StoredTensor(Record):
    """One array of an ``edgeq-raw-1`` file: where it is and what it is."""

    name: str = _field(STR)
    dtype: str = _field(STR)
    shape: list = _field(ListKind(COUNT))
    offset: int = _field(COUNT)
    bytes: int = _field(COUNT)


@_rec
class ModelRecord(Record):
    file: str = _field(STR)
    sha256: str = _field(STR)
    opset: int = _field(COUNT)
    producer: str = _field(STR)


@_rec
class PowerRecord(Record):
    """The device's power rails, as ``edgeq bench`` samples them on the device (``edgeq.rpc.power``)."""

    tegrastats_rails: list = _field(ListKind(STR))  # rail names in tegrastats' output
    hwmon_glob: str = _field(STR)  # the INA3221 hwmon folder(s) in sysfs
    hwmon_rails: dict = _field(DictKind(COUNT))  # rail name -> hwmon channel
    # the device's nvpmodel modes, [{id, name}] (edgeq bench --power-mode NAME); absent in older bundles
    nvpmodel_modes: list | None = _field(OptionalKind(ListKind(OBJECT)), omit_if_none=True)


@_rec
class DeviceRecord(Record):
    profile: str = _field(STR)
    description: str = _field(STR)
    family: str = _field(STR)
    kind: str = _field(STR)
    arch: str = _field(STR)
    host_triple: str = _field(STR)
    mcpu: str = _field(STR)
    cores: int = _field(COUNT)
    cuda_arch: str | None = _field(OptionalKind(STR))
    cuda_version: str | None = _field(OptionalKind(STR))
    jetpack: str | None = _field(OptionalKind(STR))
    l4t: str | None = _field(OptionalKind(STR))
    power: PowerRecord | None = _field(OptionalKind(RecordKind(PowerRecord)), omit_if_none=True)  # devices with power rails


@_rec
class CudaToolkitRecord(Record):
    kind: str = _field(STR)
    version: str = _field(STR)
    source: str = _field(STR)
    output_format: str = _field(STR)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@_rec
class ToolchainRecord(Record):
    cxx: str = _field(STR)
    cuda_toolkit: CudaToolkitRecord | None = _field(OptionalKind(RecordKind(CudaToolkitRecord)))


@_rec
class LibraryRecord(Record):
    file: str = _field(STR)
    machine: str = _field(STR)
    cuda_device_code: list = _field(ListKind(STR))
    bytes: int = _field(COUNT)
    cpu_kernels: dict | None = _field(OptionalKind(OBJECT), omit_if_none=True)  # CPU builds: {conv_matmul_calls, schedules}
    gpu_kernels: dict | None = _field(OptionalKind(OBJECT), omit_if_none=True)  # CUDA builds: schedule rule per kernel


@_rec
class WeightsRecord(Record):
    file: str = _field(STR)
    format: str = _field(STR)
    count: int = _field(COUNT)
    dtypes: list = _field(ListKind(STR))
    bytes: int = _field(COUNT)
    file_bytes: int = _field(COUNT)
    tensors: list = _field(ListKind(RecordKind(StoredTensor)))  # in the order the library takes them


@_rec
class GoldenRecord(Record):
    file: str = _field(STR)
    format: str = _field(STR)
    tensors: list = _field(ListKind(RecordKind(StoredTensor)))  # "input:NAME" and "output:NAME"
    seed: int = _field(INT)
    float_inputs: str = _field(STR)
    computed_with: str = _field(STR)
    rtol: float = _field(NUM)
    atol: float = _field(NUM)
    atol_scaled_by: str = _field(STR)
    # the share of each output's values that may lie outside the tolerance: an integer build whose quantized graph
    # moves that much by itself under float noise (edgeq.reference; absent: none)
    outliers: float | None = _field(OptionalKind(NUM), omit_if_none=True)

    def tolerance(self, expected_max_abs: float) -> float:
        """The absolute tolerance for an output whose largest magnitude is ``expected_max_abs``."""
        return self.atol * max(1.0, expected_max_abs)

    def allowed_outside(self, count: int) -> int:
        """How many of an output's ``count`` values may lie outside the tolerance (edgeq-run: the same)."""
        return int(math.floor((self.outliers or 0.0) * count))


@_rec
class ReferenceCheck(Record):
    """The build's outputs on the golden input compared, before the bundle was written, with an independent
    reference (``edgeq.reference``)."""

    reference: str = _field(STR)  # "onnxruntime 1.23.2" or "tvm 0.27.0 (plain pipeline)"
    graph: str = _field(STR)  # what the reference ran
    checked: str = _field(STR)  # what was compared with it (the build that computed the golden outputs)
    rtol: float = _field(NUM)
    atol: float = _field(NUM)
    atol_scaled_by: str = _field(STR)
    max_abs_diff: float = _field(NUM)
    outputs: list = _field(ListKind(OBJECT))  # {output, max_abs_diff, atol, ok}
    result: str = _field(STR)  # "passed", or "not conclusive: <why>" (no reference could compute the golden input)
    note: str | None = _field(OptionalKind(STR), omit_if_none=True)  # why the first choice of reference was not used


@_rec
class RuntimeRecord(Record):
    loader: str = _field(STR)
    libraries: list = _field(ListKind(STR))  # in load order
    cuda_bridge: dict | None = _field(OptionalKind(OBJECT))
    sources: list = _field(ListKind(JSON))
    bytes: int = _field(COUNT)


@_rec
class LayerRow(Record):
    """One conv/matmul layer of a quantized model."""

    name: str = _field(STR)  # the ONNX node's name
    op_type: str = _field(STR)  # Conv, Gemm, MatMul
    kind: str = _field(STR)  # conv2d or matmul
    weight: str = _field(STR)
    channel_axis: int = _field(COUNT)
    precision: str = _field(STR)  # int8, fp16 or fp32
    reason: str = _field(STR)  # why it is not int8 ("" when it is)
    # int8 layers: "per-tensor" (one calibrated scale), "per-channel" (depthwise: each input channel's range moved
    # into the weights, edgeq.quantize.smooth) or "per-token" (each row's own scale, at run time)
    activation: str | None = _field(OptionalKind(STR), omit_if_none=True)
    sqnr_db: float | None = _field(OptionalKind(NUM))  # calibrated int8 layers: SQNR of the layer's output, dB
    # calibrated int8 layers
    calibration: dict | None = _field(OptionalKind(OBJECT), omit_if_none=True)  # the activation statistics
    activation_scale: float | None = _field(OptionalKind(NUM), omit_if_none=True)
    activation_threshold: float | None = _field(OptionalKind(NUM), omit_if_none=True)  # the layer's own, calibrated
    # the layers whose input scale this one's is (a concatenation and its parts: edgeq.quantize.shared_scales)
    shared_scale_with: list | None = _field(OptionalKind(ListKind(STR)), omit_if_none=True)
    weight_scale_min: float | None = _field(OptionalKind(NUM), omit_if_none=True)
    weight_scale_max: float | None = _field(OptionalKind(NUM), omit_if_none=True)
    # pre-quantized layers
    activation_dtype: str | None = _field(OptionalKind(STR), omit_if_none=True)
    activation_zero_point: int | None = _field(OptionalKind(INT), omit_if_none=True)


@_rec
class WeightBytes(Record):
    float: int = _field(COUNT)  # the model's weights as given
    bundle: int = _field(COUNT)  # as the bundle stores them
    ratio: float = _field(NUM)


QUANT_KINDS = ("calibrated", "pre-quantized")


@_rec
class QuantizationReport(Record):
    """What ran in which precision. One shape for both kinds: ``calibrated`` (edgeq's post-training
    quantization: calibration, evaluation and fallbacks are set) and ``pre-quantized`` (an ONNX QDQ model
    lowered with its own scales: they are null)."""

    kind: str = _field(STR)
    source: str = _field(STR)
    precision_counts: dict = _field(DictKind(COUNT))
    layers: list = _field(ListKind(RecordKind(LayerRow)))
    weight_bytes: WeightBytes = _field(RecordKind(WeightBytes))
    float_ops: dict = _field(DictKind(COUNT))  # ops left computing in float, by op
    float_biases: list = _field(ListKind(STR))  # biases too large for int32 at their scale, added in float
    method: str | None = _field(OptionalKind(STR))
    calibration: dict | None = _field(OptionalKind(OBJECT))  # {source, samples}
    evaluation: dict | None = _field(OptionalKind(OBJECT))  # {source, cosine, top1..., sqnr...}
    fallbacks: list = _field(ListKind(OBJECT))
    scheme: dict = _field(DictKind(STR))  # activations / weights / accumulation, in words
    scales_file: str | None = _field(OptionalKind(STR))
    args: dict | None = _field(OptionalKind(OBJECT))

    @classmethod
    def from_json(cls, data, where="quantization"):
        report = super().from_json(data, where)
        if report.kind not in QUANT_KINDS:
            raise ContractError("manifest field '%s.kind' is not one of %s" % (where, ", ".join(QUANT_KINDS)))
        return report

    def summary(self) -> str:
        """One line: the layers per precision, the source, the weight size."""
        counts = ", ".join("%d %s" % (n, p) for p, n in self.precision_counts.items() if n)
        how = "%s calibration" % self.method if self.kind == "calibrated" else self.source
        return "%s layers; %s; weights %.2fx of float" % (counts, how, self.weight_bytes.ratio)


@_rec
class PreprocessRecord(Record):
    """How an image becomes the tensor of input ``input`` (``--preprocess`` at package time; run.py and edgeq-run
    ``--input IMAGE`` apply it, ``image_tensor`` below says how, exactly)."""

    input: str = _field(STR)
    height: int = _field(COUNT)
    width: int = _field(COUNT)
    resize: str = _field(STR)  # "stretch" (to height x width) or "letterbox" (aspect kept, padded with 114)
    order: str = _field(STR)  # RGB, BGR or GRAY
    layout: str = _field(STR)  # NCHW or NHWC
    scale: float = _field(NUM)
    mean: list = _field(ListKind(NUM))  # one value, or one per channel
    std: list = _field(ListKind(NUM))


@_rec
class PostprocessRecord(Record):
    """What the loaders make of an output (``--postprocess`` at package time): ``classify``, the top-k classes
    of ``output``; ``yolo``, the boxes of an ultralytics v8/11 head ``output`` ([1, 4 + classes (+ masks),
    anchors]: xywh in input pixels, class scores) that the graph's NonMaxSuppression kept (``selected``,
    padded rows), best first, at most ``max_det``, in the pixels of the image given."""

    kind: str = _field(STR)
    output: str = _field(STR)
    top_k: int = _field(COUNT)  # classify
    softmax: bool = _field(BOOL)  # classify: the output is logits (the model does not end in Softmax)
    labels: list = _field(ListKind(STR))  # empty: indices only
    selected: str | None = _field(OptionalKind(STR), omit_if_none=True)  # yolo: NonMaxSuppression's rows
    classes: int | None = _field(OptionalKind(COUNT), omit_if_none=True)  # yolo: class scores after the 4 box rows
    max_det: int | None = _field(OptionalKind(COUNT), omit_if_none=True)
    conf: float | None = _field(OptionalKind(NUM), omit_if_none=True)
    iou: float | None = _field(OptionalKind(NUM), omit_if_none=True)


@_rec
class StepRecord(Record):
    """One compiled step of a language model: ``function`` in the library, taking ``inputs`` (names, in call order;
    ``past_key_values.N.key|value`` take the previous step's cache) and then every weight (but grow)."""

    function: str = _field(STR)
    kind: str = _field(STR)  # "prefill", "decode" or "grow" (the cache into the next capacity; no weights)
    prompt: int = _field(COUNT)  # prefill's prompt bucket (1 for decode; grow: the capacity it grows from)
    capacity: int = _field(COUNT)  # cache slots of the cache the step returns
    inputs: list = _field(ListKind(STR))


@_rec
class GenerateRecord(Record):
    """A language model (``edgeq package`` of a decoder with a KV cache): how the loaders generate tokens with it
    (``generate.py``). The golden file holds ``prompt`` and the greedy ``tokens`` after it, which ``--self-test``
    checks exactly."""

    context: int = _field(COUNT)  # cache slots: prompt and answer together
    steps: list = _field(ListKind(RecordKind(StepRecord)))
    layers: int = _field(COUNT)
    kv_heads: int = _field(COUNT)
    head_dim: int = _field(COUNT)
    vocab: int = _field(COUNT)
    ids_dtype: str = _field(STR)
    mask_dtype: str = _field(STR)
    cache_dtype: str = _field(STR)
    tokenizer: str | None = _field(OptionalKind(STR))  # the tokenizer's file in the bundle, None: token ids only
    chat_prefix: str | None = _field(OptionalKind(STR))  # --chat: the chat template's text before the user's message
    chat_suffix: str | None = _field(OptionalKind(STR))  # ... and after it (the assistant's turn begins)
    stop: list = _field(ListKind(COUNT))  # token ids that end an answer
    self_test_tokens: int = _field(COUNT)
    # weight-only quantization of the products' weights (--precision int8/int4): bits per code, codes per float16
    # scale along the reduction, and the scheme ("symmetric": w = q s; "scale and minimum": w = q s + m); None: float32
    weight_bits: int | None = _field(OptionalKind(COUNT), omit_if_none=True)
    weight_group: int | None = _field(OptionalKind(COUNT), omit_if_none=True)
    weight_scheme: str | None = _field(OptionalKind(STR), omit_if_none=True)
    # int4: the products' activations are quantized too, to this many bits per element with one float scale per
    # weight_group (llama.cpp's Q8_1), and multiplied by the codes in integers; None: float32 activations
    activation_bits: int | None = _field(OptionalKind(COUNT), omit_if_none=True)


@_rec
class Manifest(Record):
    schema_version: int = _field(INT)
    bundle_id: str = _field(STR)
    name: str = _field(STR)
    release: int = _field(COUNT)
    signed: bool = _field(BOOL)
    created: str = _field(STR)
    edgeq_version: str = _field(STR)
    tvm_version: str = _field(STR)
    precision: str = _field(STR)
    model: ModelRecord = _field(RecordKind(ModelRecord))
    inputs: list = _field(ListKind(RecordKind(TensorSpec)))
    outputs: list = _field(ListKind(RecordKind(TensorSpec)))
    device: DeviceRecord = _field(RecordKind(DeviceRecord))
    toolchain: ToolchainRecord = _field(RecordKind(ToolchainRecord))
    library: LibraryRecord = _field(RecordKind(LibraryRecord))
    weights: WeightsRecord = _field(RecordKind(WeightsRecord))
    golden: GoldenRecord = _field(RecordKind(GoldenRecord))
    reference_check: ReferenceCheck | None = _field(OptionalKind(RecordKind(ReferenceCheck)), omit_if_none=True)
    quantization: QuantizationReport | None = _field(OptionalKind(RecordKind(QuantizationReport)))
    runtime: RuntimeRecord | None = _field(OptionalKind(RecordKind(RuntimeRecord)))
    build: dict = _field(OBJECT)  # {args, stage_seconds}: how it was made, for people
    compatibility: dict | None = _field(OptionalKind(OBJECT), omit_if_none=True)  # ELF needs of the library and runtime
    preprocess: PreprocessRecord | None = _field(OptionalKind(RecordKind(PreprocessRecord)), omit_if_none=True)
    postprocess: PostprocessRecord | None = _field(OptionalKind(RecordKind(PostprocessRecord)), omit_if_none=True)
    generate: GenerateRecord | None = _field(OptionalKind(RecordKind(GenerateRecord)), omit_if_none=True)
    files: dict = _field(DictKind(STR))  # every other file -> SHA-256
    sizes: dict = _field(DictKind(COUNT))  # every other file -> bytes

    @classmethod
    def from_json(cls, data, where=""):
        if isinstance(data, dict) and data.get("schema_version") != SCHEMA_VERSION:
            raise ContractError("manifest schema_version %r is not %d: made by another edgeq version; use the "
                                "loader inside the bundle or an edgeq of that version" % (data.get("schema_version"), SCHEMA_VERSION))
        manifest = super().from_json(data, where)
        problem = rows_problem(manifest.outputs) or process_problem(manifest)
        if problem:
            raise ContractError(problem)
        return manifest

    @property
    def cuda_major(self) -> int | None:
        toolkit = self.toolchain.cuda_toolkit
        return toolkit.major if toolkit else None

    @property
    def batch(self) -> int:
        """The leading dimension of the first input (1 for models without inputs or scalar inputs)."""
        shape = self.inputs[0].shape if self.inputs else []
        return shape[0] if shape else 1

    def replace(self, **changes) -> "Manifest":
        return dataclasses.replace(self, **changes)


def rows_problem(outputs) -> str | None:
    """What is wrong with the outputs' padded rows (``rows``), or None: the axis must be one of the output's,
    the bound its length there, and the count another output, int64 with one value. (edgeq-run checks the
    same, in the same order.)"""
    by_name = {o.name: o for o in outputs}
    for k, spec in enumerate(outputs):
        rows = spec.rows
        if rows is None:
            continue
        where = "manifest field 'outputs[%d].rows" % k
        if rows.axis >= len(spec.shape) or spec.shape[rows.axis] != rows.bound:
            return "%s' does not fit the output's shape" % where
        count = by_name.get(rows.count)
        if count is None or count is spec or count.dtype != "int64" or count.shape != [1]:
            return "%s.count' does not name an int64 output of shape [1]" % where
    return None


MAX_LABELS = 100_000  # --postprocess labels
MAX_IMAGE_SIDE = 16384  # --preprocess: an input image's side (what a loader allocates for it is bounded by this)
# the largest share of an output's values a self-test may find outside its tolerance (GoldenRecord.outliers)
MAX_GOLDEN_OUTLIERS = 0.02


def process_problem(manifest) -> str | None:
    """What is wrong with the manifest's ``preprocess``/``postprocess`` records, or None (edgeq-run checks the
    same, in the same order)."""
    pre, post = manifest.preprocess, manifest.postprocess
    if pre is not None:
        spec = next((i for i in manifest.inputs if i.name == pre.input), None)
        channels = 1 if pre.order == "GRAY" else 3
        want = [1, channels, pre.height, pre.width] if pre.layout == "NCHW" else [1, pre.height, pre.width, channels]
        if spec is None or spec.shape != want or spec.dtype != "float32":
            return "manifest field 'preprocess' does not fit input '%s'" % pre.input
        if pre.resize not in ("stretch", "letterbox") or pre.order not in ("RGB", "BGR", "GRAY") \
                or pre.layout not in ("NCHW", "NHWC") or pre.scale == 0 or len(pre.mean) not in (1, channels) \
                or len(pre.std) not in (1, channels) or 0 in pre.std \
                or not (1 <= pre.height <= MAX_IMAGE_SIDE and 1 <= pre.width <= MAX_IMAGE_SIDE):
            return "manifest field 'preprocess' has a value out of range"
    if post is not None:
        spec = next((o for o in manifest.outputs if o.name == post.output), None)
        if post.kind not in ("classify", "yolo") or spec is None or not spec.shape or spec.shape[0] != 1 \
                or not 1 <= post.top_k <= 1000 or len(post.labels) > MAX_LABELS:
            return "manifest field 'postprocess' does not fit output '%s'" % post.output
        if post.kind == "yolo":
            rows = next((o for o in manifest.outputs if o.name == post.selected), None)
            if rows is None or rows.rows is None or rows.dtype != "int64" or len(rows.shape) != 2 or rows.shape[1] != 3 \
                    or len(spec.shape) != 3 or post.classes is None or not 1 <= post.classes <= spec.shape[1] - 4 \
                    or post.max_det is None or not 1 <= post.max_det <= 100000 or len(post.labels) > post.classes:
                return "manifest field 'postprocess' does not fit output '%s'" % post.output
    return None


def argument_count_problem(takes: int, manifest: Manifest) -> str | None:
    """Why a library whose ``main`` takes ``takes`` arguments cannot run with the manifest's inputs and weights
    (passed in that order), or None. run.py and edgeq bench say this before any weight is read; edgeq-run
    (C++) says the same."""
    inputs, weights = len(manifest.inputs), len(manifest.weights.tensors)
    if takes == inputs + weights:
        return None
    return ("the library's main takes %d arguments but the manifest lists %d inputs and %d weights; the bundle is "
            "damaged or put together from two builds" % (takes, inputs, weights))


def output_problem(spec, dtype: str, shape) -> str | None:
    """Why an output the library returned (``dtype``, ``shape``) cannot be read as the manifest's ``spec``
    declares it, or None: both loaders check each output before reading it (edgeq-run says the same in C++)."""
    shape = [int(d) for d in shape]
    if dtype == spec.dtype and shape == list(spec.shape):
        return None
    return ("the library returns output '%s' as %s %s, the manifest declares %s %s; the bundle is damaged or put "
            "together from two builds" % (spec.name, dtype, "x".join(map(str, shape)), spec.dtype,
                                         "x".join(map(str, spec.shape))))


# ---------------------------------------------------------------------------------------------------
# latency statistics: run.py, edgeq bench and (in C++, held to this by a test) edgeq-run
# ---------------------------------------------------------------------------------------------------


def percentile(sorted_values, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, and edgeq-run's)."""
    pos = q / 100.0 * (len(sorted_values) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits: what a timer or a power sensor means, and JSON without
    ``0.05498290000000001``."""
    return float("%.*g" % (digits, value))


def latency_statistics(times_ms, batch: int = 1) -> dict:
    """Latency percentiles of timed runs (ms, any order; 4 significant digits) and the throughput they
    sustain: ``batch`` inferences per mean latency (N runs took N x mean, so that is the rate they ran at),
    computed from the rounded mean so the two printed numbers agree."""
    ms = sorted(float(t) for t in times_ms)
    if not ms:
        raise ValueError("no timed runs")
    mean = significant(math.fsum(ms) / len(ms))
    return {
        "runs": len(ms), "batch": batch, "min_ms": significant(ms[0]), "mean_ms": mean,
        "p50_ms": significant(percentile(ms, 50)), "p90_ms": significant(percentile(ms, 90)),
        "p99_ms": significant(percentile(ms, 99)), "max_ms": significant(ms[-1]),
        "throughput_per_s": significant(batch * 1e3 / mean) if mean > 0 else None,
    }


def describe_latency(stats: dict) -> str:
    """One line for people, from ``latency_statistics``."""
    return "%d runs: min %.3f ms  p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  mean %.3f ms  (%.1f inferences/s)" % (
        stats["runs"], stats["min_ms"], stats["p50_ms"], stats["p90_ms"], stats["p99_ms"], stats["mean_ms"],
        stats["throughput_per_s"] or 0.0)


# ---------------------------------------------------------------------------------------------------
# an --input .npy, read as edgeq-run's ReadNpy (npy.h) reads it, step by step: one reader in two languages
# ---------------------------------------------------------------------------------------------------

NPY_DTYPES = {"'<f2'": "float16", "'<f4'": "float32", "'<f8'": "float64", "'|i1'": "int8", "'<i2'": "int16",
              "'<i4'": "int32", "'<i8'": "int64", "'|u1'": "uint8", "'<u2'": "uint16", "'<u4'": "uint32",
              "'<u8'": "uint64", "'|b1'": "bool"}
DTYPE_BYTES = {"float16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
               "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1}  # also what a weights/golden table holds
MAX_INPUT_BYTES = 4 << 30  # one --input .npy; raise with EDGEQ_MAX_INPUT_BYTES


def printable(text: str) -> str:
    """``text`` from a file, fit for a one-line message: every character outside printable ASCII as '?'."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def read_npy(f, limit: int) -> tuple[str, list, bytes, bool]:
    """(dtype, shape, data in C order, was Fortran order) of the .npy file ``f`` (binary, at its start); raises
    ContractError with the reason. The header is read as edgeq-run reads it, not as numpy does, so that both
    loaders take and refuse the same files."""
    head = f.read(10)
    if len(head) != 10 or head[:6] != b"\x93NUMPY":
        raise ContractError("not a .npy file")
    if head[6] == 1:
        hlen = head[8] | head[9] << 8
    elif head[6] in (2, 3):
        more = f.read(2)
        if len(more) != 2:
            raise ContractError("truncated")
        hlen = head[8] | head[9] << 8 | more[0] << 16 | more[1] << 24
    else:
        raise ContractError("unknown .npy version")
    if hlen > 65536:
        raise ContractError(".npy header larger than 64 KiB")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise ContractError("truncated")
    header = raw.decode("latin-1")  # byte for byte, as npy.h's std::string

    def value_of(key):
        k = header.find("'" + key + "'")
        if k < 0:
            raise ContractError(".npy header has no '%s'" % key)
        colon = header.find(":", k)
        if colon < 0:
            raise ContractError("malformed .npy header")
        start = next((i for i in range(colon + 1, len(header)) if header[i] != " "), -1)
        if start < 0:
            raise ContractError("malformed .npy header")
        close = header.find(")", start) if header[start] == "(" else header.find("'", start + 1) if header[start] == "'" else -1
        if close >= 0:
            end = close + 1
        else:
            end = min((i for i in (header.find(",", start), header.find("}", start)) if i >= 0), default=-1)
        if header[start] in "('" and close < 0:
            raise ContractError("malformed .npy header")
        if end < 0 or end <= start:
            raise ContractError("malformed .npy header")
        return header[start:end]

    descr, fortran, shape_text = value_of("descr"), value_of("fortran_order"), value_of("shape")
    if fortran not in ("False", "True"):
        raise ContractError("malformed .npy header")
    dtype = NPY_DTYPES.get(descr)
    if dtype is None:
        raise ContractError("dtype %s is not one the loaders read (little-endian numbers only)" % printable(descr))
    if len(shape_text) < 2 or shape_text[0] != "(" or shape_text[-1] != ")":
        raise ContractError("malformed .npy shape")
    dims, shape, count, p = shape_text[1:-1], [], 1, 0
    while p < len(dims):
        q = dims.find(",", p)
        part = (dims[p:] if q < 0 else dims[p:q]).strip(" ")
        if part:
            if len(part) > 12 or any(c not in "0123456789" for c in part):
                raise ContractError("malformed .npy shape")
            if count * int(part) > MAX_INPUT_BYTES:
                raise ContractError("it declares more than %d elements, the most an input may have "
                                        "(EDGEQ_MAX_INPUT_BYTES bounds its bytes)" % MAX_INPUT_BYTES)
            shape.append(int(part))
            count *= int(part)
        if q < 0:
            break
        p = q + 1
    item = DTYPE_BYTES[dtype]
    if count * item > limit:
        raise ContractError("it declares more than %d bytes; raise EDGEQ_MAX_INPUT_BYTES to read it" % limit)
    data = f.read(count * item)
    if len(data) != count * item:
        raise ContractError("less data than its header declares")
    return dtype, shape, data, fortran == "True"
