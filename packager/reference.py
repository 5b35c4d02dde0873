"""The reference check: a bundle's golden outputs are never the only judge of the build that made them.

Before anything is written, the outputs of the compiled host build on the golden input (what the bundle's
self-test will later compare the device against) are compared with an independent reference on the same
input:

- **ONNX Runtime** on the ONNX model as loaded (input shapes fixed, ``--const`` inputs bound, shape
  arithmetic folded by ONNX's own reference evaluator), where onnxruntime is installed and runs the model:
  nothing of TVM's importer or edgeq's rewrites is in it;
- else **TVM's plain pipeline** (``relax.build`` with TVM's default passes, no edgeq lowering, kernels or
  schedules) on the graph as imported.

A build quantized by edgeq (int8, mixed) is compared with its own quantized graph before lowering, built
by TVM's plain pipeline, so that a lowering or kernel fault cannot hide behind quantization error (how far
the quantized model is from the float one is the quantization report's business). A pre-quantized (QDQ)
model is compared with ONNX Runtime running its QDQ graph, else with TVM's plain build of the graph as
imported (quantize/dequantize computed in float).

The comparison is the self-test's, with the precision's tolerance: ``|got - want| <= atol * max(1, max |want|)
+ rtol * |want|`` per output. The floor of 1 is there because float error follows the magnitudes inside the
model, not those of its outputs (a sigmoid map whose values are all near 0 is computed from values near 1);
so outputs far below 1 in magnitude are checked in absolute terms (a randomly initialised classifier whose
logits are 1e-12 can pass anything, a trained one cannot). A mismatch refuses the build in one line naming the first output
that differs; the result is recorded in the manifest (``reference_check``).

An output whose channels hold quantities of different sizes is judged part by part: the floor scales with the
largest value of each part (a YOLO head's box rows in pixels, its score rows in 0..1; ``yolo_parts``).

**An integer build is judged against how much its reference moves by itself.** A quantized graph rounds to
int8 after every layer, so a value that float noise moves across a rounding boundary moves by one step, and
some trained networks amplify a single step: PP-OCRv4's text detector (a DB head, pre-sigmoid values to 140)
changes by up to 0.9 in a few hundred of its 102400 probabilities. Its edgeq build is the same graph up to float
rounding (exported intermediate by intermediate it is bit-exact; fused, its epilogues round differently in the
last bits), and an element-wise check refused it. So for an edgeq-quantized build the reference graph is also
built with the value entering every quantize scaled by 1 + 2^-20 and by 1 - 2^-20 (``probes``: float noise of
a few units in the last place, a little more than a fused epilogue makes, at every rounding): the share of each
output either probe moves out of the tolerance is the graph's own instability, and the build may have up to
twice that share outside it (``outliers``), never more than ``MAX_OUTLIERS``. A stable graph (most) gets no
allowance at all. A graph that needs more is refused as unstable: quantize fewer of its layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from edgeq.choices import REFERENCE_CHOICES
from edgeq.templates import contract
from edgeq.templates.contract import ReferenceCheck
from edgeq.errors import EdgeqError, UsageError


class ReferenceMismatch(EdgeqError):
    """The compiled build disagrees with the independent reference: an edgeq bug, not the user's."""


# the integer builds' check (module docstring): the relative noise the probes put before every rounding to int8,
# and the largest share of an output that may lie outside the tolerance where the reference itself moves that much
NUDGE = 2.0 ** -20
MAX_OUTLIERS = contract.MAX_GOLDEN_OUTLIERS  # what the loaders' self-test accepts


@dataclasses.dataclass(frozen=True)
class Reference:
    """How reference outputs were obtained: ``run(inputs by name) -> outputs`` and what to record of it."""

    name: str  # "onnxruntime 1.32.0", "tvm 0.27.0 (plain pipeline)"
    graph: str  # what the reference ran
    run: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    note: str | None = None  # why the first choice was not used
    names: tuple[str, ...] | None = None  # its outputs' names, where they are not the build's (ONNX Runtime)


def onnxruntime_session(model, *, basic: bool = False, threads: int | None = None, quiet: bool = True):
    """An ONNX Runtime CPU session on ``model`` (a path, serialized bytes or a ModelProto) that computes integer
    products exactly on every x86 CPU, as a reference must.

    Without AVX-512 VNNI (an AMD Zen 3, a Haswell), ONNX Runtime's u8 x s8 kernels use ``vpmaddubsw``, which adds
    pairs of products in int16 with saturation: a MatMulInteger of 64 activations near 255 and weights near 120 came
    out 782217 off the exact int32 sums under ``qemu-x86_64 -cpu EPYC-Milan`` and exact natively on a VNNI Xeon (the
    suite's QDQ and qconv checks failed on such a machine for that reason alone). ``session.x64quantprecision``
    makes it take its u8 x u8 kernels there: exact, slower. Speed comparisons keep ONNX Runtime's defaults
    (``benchmarks/common.py``). ``basic``: semantics-preserving graph optimizations only. ``quiet``: ONNX Runtime's
    warnings (unused initializers and the like) are not ours to show."""
    import os

    import onnxruntime as ort

    def options(exact: bool):
        made = ort.SessionOptions()
        if exact:
            made.add_session_config_entry("session.x64quantprecision", "1")
        if quiet:
            made.log_severity_level = 3
        if basic:
            made.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if threads:
            made.intra_op_num_threads = threads
        return made

    if isinstance(model, (str, os.PathLike)):
        model = str(model)
    elif not isinstance(model, bytes):
        model = model.SerializeToString()
    try:
        return ort.InferenceSession(model, options(True), providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - ONNX Runtime's own
        # the precision mode rewrites an int8-activation QLinearConv into com.microsoft.QLinearConv, which has no
        # s8 x s8 kernel (onnxruntime 1.32: NOT_IMPLEMENTED at load, on a VNNI Xeon too); s8 x s8 never took the
        # saturating u8 x s8 path it avoids (those convolutions were exact on the EPYC without the option)
        if "NOT_IMPLEMENTED" not in str(err):
            raise
        return ort.InferenceSession(model, options(False), providers=["CPUExecutionProvider"])


def onnxruntime_reference(onnx_model, graph_label: str) -> Reference:
    """ONNX Runtime (CPU) on ``onnx_model``. Raises whatever onnxruntime raises when it cannot load it."""
    import onnxruntime as ort

    session = onnxruntime_session(onnx_model, basic=True)
    names = [o.name for o in session.get_outputs()]

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(o) for o in session.run(names, inputs)]

    return Reference(f"onnxruntime {ort.__version__}", graph_label, run, names=tuple(names))


def tvm_plain_reference(graph, graph_label: str, note: str | None = None) -> Reference:
    """``graph`` built by TVM's default Relax pipeline for the build host (LLVM), run by TVM's VM."""
    from edgeq.compile import HostRunner
    from edgeq.targets import profiles
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm import relax

    with tvm.target.Target(profiles()["host"].tvm_target()) as target:
        executable = relax.build(graph.mod, target=target)
    runner = HostRunner(graph, executable)

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return runner(list(inputs.values()))  # in the model's input order, as the golden input is

    return Reference(f"tvm {tvm.__version__} (plain pipeline)", graph_label, run, note)


def probes(graph, graph_label: str) -> list[Reference]:
    """``graph`` (a quantized graph) with the value entering every ``quantize`` scaled by 1 + NUDGE and by
    1 - NUDGE, each built by TVM's plain pipeline: how the graph's outputs move under float noise at its roundings."""
    from edgeq.graph import call_op, rewrite
    from edgeq.tvm_env import relax

    def nudged(factor: float):
        def visit(rw, var, value):
            if call_op(value) != "relax.quantize" or value.args[0].ty.dtype not in ("float32", "float16"):
                return None
            moved = rw.emit(relax.op.multiply(rw.new(value.args[0]), relax.const(factor, value.args[0].ty.dtype)))
            return relax.op.quantize(moved, rw.new(value.args[1]), rw.new(value.args[2]), axis=int(value.attrs.axis),
                                     out_dtype=str(value.attrs.out_dtype))
        return tvm_plain_reference(rewrite(graph, visit), f"{graph_label}, every quantize's input x {factor!r}")

    return [nudged(1 + NUDGE), nudged(1 - NUDGE)]


def check_choice(choice: str, quantized_by_edgeq: bool) -> None:
    """Refuse a ``--reference`` that cannot apply, before any work is done."""
    if choice not in REFERENCE_CHOICES:
        raise UsageError(f"unknown --reference '{choice}'; choose one of: {', '.join(REFERENCE_CHOICES)}")
    if quantized_by_edgeq and choice == "onnxruntime":
        raise UsageError("--reference onnxruntime: an int8/mixed build is checked against its own quantized graph "
                         "(TVM's plain pipeline); use --reference auto or tvm")


def choose(choice: str, onnx_model, graph, *, quantized_by_edgeq: bool) -> Reference:
    """The reference for a build (see the module docstring). ``choice``: auto, onnxruntime or tvm."""
    check_choice(choice, quantized_by_edgeq)
    if quantized_by_edgeq:
        return tvm_plain_reference(graph, "the quantized graph before lowering")
    label = "the loaded ONNX model"
    note = None
    imported = "the graph as imported, before edgeq's rewrites"
    if choice in ("auto", "onnxruntime"):
        try:
            return onnxruntime_reference(onnx_model, label)
        except ImportError:
            if choice == "onnxruntime":
                raise UsageError("--reference onnxruntime: onnxruntime is not installed (pip install onnxruntime)") from None
            note = "onnxruntime is not installed"
        except Exception as err:  # noqa: BLE001 - whatever onnxruntime refuses, TVM's plain build is the fallback
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            if choice == "onnxruntime":
                raise UsageError(f"--reference onnxruntime: onnxruntime cannot run this model ({first}); "
                                 "use --reference tvm") from None
            note = f"onnxruntime cannot run this model: {first}"
    return tvm_plain_reference(graph, imported, note)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _trimmed(spec, got: dict[str, np.ndarray], want: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, str | None]:
    """A padded output (``edgeq.nms``) and the reference's unpadded one, both cut to the real rows; with
    what is wrong with the count, if anything. A bound below the reference's rows (``--max-detections``)
    keeps the reference's first rows."""
    rows = spec.rows
    counted = got[rows.count].reshape(-1)
    real = int(counted[0]) if counted.size else -1
    axis = rows.axis
    expected = min(want.shape[axis], rows.bound) if want.ndim > axis else None
    if expected is None or real != expected:
        return g, want, f"{real} real rows (output '{rows.count}'), the reference {want.shape[axis] if want.ndim > axis else '?'}"
    cut = [slice(None)] * g.ndim
    cut[axis] = slice(0, real)
    return g[tuple(cut)], want[tuple(cut)], None


def yolo_parts(head_name: str) -> dict[str, list[tuple[str, tuple]]]:
    """A YOLO head ``[1, 4 + classes, boxes]`` as two parts judged on their own scales: box coordinates (pixels)
    and class scores (0..1)."""
    return {head_name: [("boxes", (slice(None), slice(0, 4))), ("scores", (slice(None), slice(4, None)))]}


def _atol(w64: np.ndarray, atol: float, parts: list[tuple[str, tuple]] | None):
    """The absolute tolerance of each element: ``atol * max(1, max |reference|)`` over the output, or over each
    of its ``parts`` (a scalar, or an array shaped like the output)."""
    def floor(values):
        finite = values[np.isfinite(values)]
        return atol * max(1.0, float(np.max(np.abs(finite))) if finite.size else 0.0)

    if not parts or w64.ndim < 2:
        return floor(w64)
    scaled = np.full(w64.shape, floor(w64))
    for _, index in parts:
        if w64[index].size:
            scaled[index] = floor(w64[index])
    return scaled


def _outside(g64: np.ndarray, w64: np.ndarray, scaled, rtol: float) -> np.ndarray:
    """Where ``g64`` is not within the tolerance of ``w64`` (NaN where both are NaN, equal infinities: within)."""
    with np.errstate(invalid="ignore"):
        same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
        return ~(same | (np.abs(g64 - w64) <= scaled + rtol * np.abs(w64)))


def compare(reference: Reference, inputs: dict[str, np.ndarray], got: Sequence[np.ndarray],
            output_specs: Sequence, rtol: float, atol: float, checked: str, *,
            parts: dict[str, list[tuple[str, tuple]]] | None = None,
            probes: Callable[[], Sequence[Reference]] | None = None, probe_always: bool = False) -> ReferenceCheck:
    """Run the reference on ``inputs`` and compare with ``got`` (the build's outputs); raises
    ReferenceMismatch naming the first output that differs, else returns the record for the manifest.

    Where the reference cannot compute the golden input (onnxruntime refuses an index the golden input puts out
    of range), or its outputs are NaN or Inf where the build's are finite, nothing can be compared: the
    record's ``result`` says it was not conclusive, and why (``edgeq package`` warns), and the build is not
    refused for it. ``--golden-input`` gives an input the model is meant for.

    ``probes`` (an integer build): makes the noisy references (``probes()``) that measure the graph's own
    instability, run where some output has values outside the tolerance, or always with ``probe_always`` (a
    build whose device rounds otherwise than the build host: its self-test needs the allowance)."""
    record = dict(checked=checked, rtol=rtol, atol=atol, atol_scaled_by="max(1, max |reference output|)")
    try:
        want = [np.asarray(w) for w in reference.run(inputs)]
    except EdgeqError:
        raise
    except Exception as err:  # noqa: BLE001 - onnxruntime and TVM raise anything on an input they refuse
        # the golden input is outside what the model accepts (an index out of range): no reference can judge it
        # (TVM's plain build would read out of bounds: not a reference either)
        return ReferenceCheck(reference=reference.name, graph=reference.graph, **record, max_abs_diff=0.0, outputs=[],
                              result=f"not conclusive: the reference failed on the golden input: {_first_line(err)}",
                              note=reference.note)
    output_names = [s.name for s in output_specs]
    by_name = {name: np.asarray(g) for name, g in zip(output_names, got)}
    counts = {s.rows.count for s in output_specs if s.rows}
    if reference.names is not None:  # ONNX Runtime ran the model as given: no count outputs, unpadded rows
        wanted = dict(zip(reference.names, want))
        if set(wanted) != set(output_names) - counts:
            raise ReferenceMismatch(f"the reference ({reference.name}) gives outputs {', '.join(wanted)}, the build "
                                    f"{', '.join(output_names)}; nothing was written")
    elif len(want) != len(got):
        raise ReferenceMismatch(f"the reference ({reference.name}) gives {len(want)} outputs, the build {len(got)}; "
                                "nothing was written")
    else:
        wanted = dict(zip(output_names, want))
    parts = parts or {}
    # an integer build: the share of each output its reference graph moves out of tolerance under noise (probes),
    # measured where it matters: a build with values outside, or one whose device rounds otherwise
    integer = probes is not None

    def any_outside(name: str) -> bool:
        g, w = by_name[name].astype(np.float64), np.asarray(wanted[name], np.float64)
        return g.shape == w.shape and bool(_outside(g, w, _atol(w, atol, parts.get(name)), rtol).any())

    probed = integer and (probe_always or any(any_outside(name) for name in wanted if name in by_name))
    unstable = {name: 0.0 for name in wanted}
    for probe in probes() if probed else ():
        moved = dict(zip(reference.names or output_names, (np.asarray(m) for m in probe.run(inputs))))
        for name, w in wanted.items():
            w64, m64 = np.asarray(w, np.float64), np.asarray(moved[name], np.float64)
            if w64.shape == m64.shape and w64.size:
                share = float(_outside(m64, w64, _atol(w64, atol, parts.get(name)), rtol).mean())
                unstable[name] = max(unstable[name], share)
    rows, first_bad, unusable, graph_unstable = [], None, [], False
    for spec in output_specs:
        name = spec.name
        if name not in wanted:  # a count output: judged through the rows it counts
            continue
        g, w = by_name[name], np.asarray(wanted[name])
        if spec.rows and reference.names is not None:
            g, w, wrong = _trimmed(spec, by_name, w, g)
            if wrong:
                rows.append({"output": name, "max_abs_diff": None, "atol": None, "ok": False})
                first_bad = first_bad or (name, wrong)
                continue
        if g.shape != w.shape:
            rows.append({"output": name, "max_abs_diff": None, "atol": None, "ok": False})
            first_bad = first_bad or (name, f"shape {list(g.shape)}, the reference's {list(w.shape)}")
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        if not np.isfinite(w64).all() and np.isfinite(g64).all():
            unusable.append(name)  # the golden outputs are finite by construction: this reference cannot judge them
            rows.append({"output": name, "max_abs_diff": None, "atol": None, "ok": None})
            continue
        scaled = _atol(w64, atol, parts.get(name))  # float error follows the magnitudes inside the model, ~1 at least
        bad = _outside(g64, w64, scaled, rtol)
        allowed = min(2 * unstable[name], MAX_OUTLIERS)
        outside = float(bad.mean()) if bad.size else 0.0
        ok = outside <= allowed
        with np.errstate(invalid="ignore"):
            diff = np.abs(g64 - w64)
        finite = diff[np.isfinite(diff) & ~((g64 == w64) | (np.isnan(g64) & np.isnan(w64)))]
        largest = float(finite.max()) if finite.size else 0.0
        row = {"output": name, "max_abs_diff": float("%.4g" % largest), "atol": float("%.4g" % np.max(scaled)), "ok": ok}
        if integer:  # (reference_moves: measured only where it was needed)
            row.update(outside=float("%.4g" % outside), outliers=float("%.4g" % allowed))
            if probed:
                row["reference_moves"] = float("%.4g" % unstable[name])
        rows.append(row)
        if not ok and first_bad is None:
            where = int(np.flatnonzero(bad.ravel())[0])
            at = float(np.broadcast_to(scaled, w64.shape).ravel()[where])
            first_bad = (name, f"max |diff| {largest:.4g} over the tolerance {at:.3g} + {rtol:g} x |reference| "
                               f"(at flat index {where}: {g64.ravel()[where]:.6g}, reference {w64.ravel()[where]:.6g})"
                               + (f"; {outside:.3%} of it outside, the reference itself moves {unstable[name]:.3%} "
                                  f"under noise of {NUDGE:.2g} at its roundings" if integer else ""))
            # within what the graph does by itself, beyond what any self-test takes: the graph is at fault
            graph_unstable = integer and MAX_OUTLIERS < outside <= 2 * unstable[name]
    if first_bad is not None:
        name, what = first_bad
        if graph_unstable:
            raise ReferenceMismatch(
                f"the quantized graph is unstable: output '{name}' of {reference.graph} ({reference.name}) moves "
                f"outside the tolerance in {unstable[name]:.2%} of its values under noise of {NUDGE:.2g} at its "
                f"roundings, so no build of it can be checked ({what}); nothing was written. Keep its most sensitive "
                "layers in float: --precision mixed --accuracy-budget X, or --skip NODE")
        raise ReferenceMismatch(
            f"the build disagrees with the reference ({reference.name} on {reference.graph}) on the golden input: "
            f"output '{name}': {what}; nothing was written. This is an edgeq fault: please report it with the model")
    result = "passed" if not unusable else \
        f"not conclusive: the reference gives NaN or Inf for output(s) {', '.join(unusable)} where the build is finite"
    checked_rows = [r["max_abs_diff"] for r in rows if r["max_abs_diff"] is not None]
    return ReferenceCheck(reference=reference.name, graph=reference.graph, **record,
                          max_abs_diff=max(checked_rows, default=0.0), outputs=rows, result=result, note=reference.note)
