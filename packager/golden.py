"""The self-test's golden input and outputs: the input the user gave, an int8 build's first calibration sample,
or one generated here (deterministic: ``GOLDEN_SEED``), and its outputs computed on the build host.

What the golden stage makes is ``edgeq.stage_records.Golden``; golden.bin is written here, the manifest's
golden section by ``edgeq.bundle``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeq import backends, bundle
from edgeq.compile import HostRunner, build
from edgeq.errors import ModelError
from edgeq.stage_records import Compiled, Golden, Imported, Loaded, Lowered, Quantized, Setup
from edgeq.targets import profiles
from edgeq.templates import contract
from edgeq.templates.contract import TensorSpec
from edgeq.tvm_env import import_tvm

GOLDEN_SEED = 0
# The golden input's floats, tried in order until the outputs are finite: models defined only on part of the
# line (Log, Sqrt: positive; Acos, Asin, Atanh: (-1, 1); Acosh: [1, inf)) get an input inside their domain.
_UNIFORM = {"uniform(0.5, 1.5)": (0.5, 1.5), "uniform(0.1, 0.9)": (0.1, 0.9), "uniform(1.1, 2.0)": (1.1, 2.0)}
GOLDEN_DISTRIBUTIONS = ("standard normal", *_UNIFORM)


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


def _check_memory(inputs: list[TensorSpec], outputs: tuple[TensorSpec, ...]) -> None:
    """Refuse in one line, before anything is drawn, a golden computation this machine cannot hold: the
    inputs, the outputs, and the reference's outputs beside them."""
    import psutil

    def nbytes(specs) -> int:
        return sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in specs)

    need = nbytes(inputs) + 2 * nbytes(outputs)
    free = psutil.virtual_memory().available
    if need > free:
        def size(n: int) -> str:
            return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

        raise ModelError(f"the golden input and outputs take {size(need)} and this machine has {size(free)} free; "
                         "fix smaller input shapes with --input-shape, or package on a machine with more memory")


def _finite(outputs) -> bool:
    return all(np.asarray(o).dtype.kind != "f" or np.isfinite(o).all() for o in outputs)


def make_golden(setup: Setup, loaded: Loaded, imported: Imported, quantized: Quantized | None, lowered: Lowered,
                compiled: Compiled) -> Golden:
    """The golden stage: the input (given, calibration, or generated within the model's domain), its outputs on
    the build host, golden.bin in the staging folder."""
    model = loaded.model
    _check_memory(model.inputs, imported.outputs)
    if setup.profile.name == "host":
        # the exported library itself, loaded (the executable in memory would be compiled again by LLVM's JIT)
        executable = import_tvm().runtime.load_module(str(compiled.library))
        computed_with = "the bundle's own library, on the build host"
    else:
        host = profiles()["host"]
        executable = build(lowered.graph.mod, host.tvm_target(reciprocal=not imported.exact_division),
                           backend=backends.for_profile(host))
        computed_with = f"a TVM LLVM build for the build host ({host.cpu.mcpu})"
    runner = HostRunner(lowered.graph, executable)
    # the user's golden input; else an int8 build's first calibration sample (the data the user chose); else generated
    given = loaded.golden_given
    result = quantized.result if quantized is not None else None
    if given is None and result is not None and result.first_sample is not None:
        given = ({spec.name: a for spec, a in zip(model.inputs, result.first_sample)},
                 f"the first calibration sample ({Path(result.first_sample_source).name})")
    if given is not None:
        inputs, floats = given
        outputs = runner(list(inputs.values()))
        tried = f"the golden input ({floats})"
    else:
        has_floats = any(np.dtype(spec.dtype).kind == "f" for spec in model.inputs)
        distributions = GOLDEN_DISTRIBUTIONS if has_floats else GOLDEN_DISTRIBUTIONS[:1]
        bounds = gather_bounds(model.onnx_model)
        for floats in distributions:
            inputs = golden_inputs(model.inputs, floats=floats, bounds=bounds)
            outputs = runner(list(inputs.values()))
            if _finite(outputs):
                break
        tried = f"the golden input (each generated one: {', '.join(distributions)})"
    for spec, out in zip(imported.outputs, outputs):
        if np.asarray(out).dtype.kind == "f" and not np.isfinite(out).all():
            from onnx import numpy_helper

            arrays = ((t.name, numpy_helper.to_array(t)) for t in model.onnx_model.graph.initializer)
            bad = [name for name, w in arrays if w.dtype.kind == "f" and not np.isfinite(w).all()]
            cause = (f"weight(s) {', '.join(bad[:3])} hold NaN or Inf" if bad else
                     "give an input the model is defined on with --golden-input FILE.npz, or an image and --preprocess"
                     if given is None else "check the model on that input, or give another --golden-input")
            raise ModelError(f"output '{spec.name}' is NaN or Inf on {tried}: {cause}; "
                             "a bundle whose self-test cannot pass is not written")
    arrays = [(f"input:{k}", v) for k, v in inputs.items()]
    arrays += [(f"output:{spec.name}", out) for spec, out in zip(imported.outputs, outputs)]
    table = bundle.write_tensors(setup.output.staging / contract.GOLDEN, arrays)
    return Golden(inputs=inputs, outputs=outputs, table=table, float_inputs=floats, computed_with=computed_with)
