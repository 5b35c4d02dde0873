"""Load and check an ONNX model, fix its input shapes, and import it into a Relax IRModule."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from edgeq.templates.contract import TensorSpec
from edgeq.errors import ModelError, UsageError
from edgeq.limits import check


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    path: Path
    sha256: str
    onnx_model: onnx.ModelProto  # with the input shapes fixed
    inputs: list[TensorSpec]
    opset: int
    warnings: tuple[str, ...] = ()  # what the check let through (a declared output shape the graph contradicts)


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME=1x3x224x224`` -> ("NAME", (1, 3, 224, 224))."""
    name, sep, dims = text.rpartition("=")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or min(shape) < 1:
        raise UsageError(f"--input-shape '{text}' is not NAME=DxDx...: for example input=1x3x224x224")
    return name, shape


def parse_const(text: str) -> tuple[str, Path]:
    """``NAME=FILE.npy`` -> ("NAME", Path("FILE.npy"))."""
    name, sep, file = text.partition("=")
    if not sep or not name or not file:
        raise UsageError(f"--const '{text}' is not NAME=FILE.npy: for example --const shape=shape.npy")
    return name, Path(file)


def npy_bytes(stream) -> int:
    """The data size a .npy header declares (read from the header alone)."""
    major, _ = np.lib.format.read_magic(stream)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(stream)
    if dtype.hasobject:
        raise ValueError("it holds Python objects (pickles); save plain numeric arrays")
    return math.prod(shape) * dtype.itemsize


def read_const(name: str, path: Path) -> np.ndarray:
    """The array of a ``--const`` file (.npy, no pickles), checked against the input size limit."""
    where = f"--const {name}={path}"
    if not path.is_file():
        raise UsageError(f"{where}: file not found; save the value with numpy.save")
    check("input_bytes", where, path.stat().st_size)
    try:
        with open(path, "rb") as f:  # what the header declares is checked before numpy allocates it
            if f.read(6) == b"\x93NUMPY":
                f.seek(0)
                check("input_bytes", f"{where} (as its header declares)", npy_bytes(f))
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise UsageError(f"{where}: not a readable .npy file ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                         "save the value with numpy.save") from None
    if not isinstance(array, np.ndarray):
        raise UsageError(f"{where}: an .npz holds several arrays; give one array saved with numpy.save (.npy)")
    return array


# The operands that set a shape (by position): bound to constants, they let TVM compile a static graph.
SHAPE_OPERANDS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 3), "Resize": (2, 3),
    "Upsample": (1,), "TopK": (1,), "OneHot": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,), "CenterCropPad": (1,), "CumSum": (1,), "GridSample": (),
}


def _bind_consts(model: onnx.ModelProto, consts: dict[str, np.ndarray]) -> None:
    """Turn the named graph inputs into initializers holding the given arrays."""
    from onnx import numpy_helper

    initializers = {t.name for t in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    for name, array in consts.items():
        value = graph_inputs.get(name)
        if value is None:
            raise UsageError(f"--const names '{name}', but the model's inputs are: {', '.join(graph_inputs) or '(none)'}")
        ttype = value.type.tensor_type
        want = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        if array.dtype != want:
            # bfloat16, float8: ml_dtypes types (kind "V"), which a .npy file cannot hold
            hint = "float32 (numpy's .npy cannot hold it; edgeq converts exact values)" if want.kind == "V" else str(want)
            try:
                cast = array.astype(want) if array.dtype.kind in "biuf" else None
                exact = cast is not None and np.array_equal(cast.astype(array.dtype), array)
            except (TypeError, ValueError):  # no cast between them (a .npy of raw bytes, |V2)
                exact = False
            if not exact:
                raise UsageError(f"--const {name}: the file holds {array.dtype}, the input is {want}; save it as {hint}")
            array = cast
        declared = [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]
        if ttype.HasField("shape") and (len(declared) != array.ndim
                                        or any(d not in (None, 0, n) for d, n in zip(declared, array.shape))):
            shown = "x".join(str(d or "?") for d in declared) or "a scalar"
            raise UsageError(f"--const {name}: the file's shape {_fmt(array.shape) or 'scalar'} does not fit the input's {shown}")
        model.graph.input.remove(value)
        model.graph.initializer.append(numpy_helper.from_array(np.array(array, order="C"), name))


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def identifier_names(model: onnx.ModelProto) -> None:
    """Rename initializers whose names are not C identifiers (``/features/Constant_1_output_0`` from torch's
    exporter, ``conv1/weights:0`` from TensorFlow's). They become function parameters whose names TVM's CUDA
    code generator writes into the kernel signatures as they are (TVM's importer only maps '.' to '_'), and
    NVRTC stops at the first '/'. Node names, graph inputs and outputs keep their names."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input} | outputs
    taken |= {name for node in graph.node for name in node.output}
    renames = {}
    for tensor in graph.initializer:
        if IDENTIFIER.fullmatch(tensor.name.replace(".", "_")) or tensor.name in outputs:
            continue
        base = re.sub(r"[^A-Za-z0-9_]+", "_", tensor.name).strip("_") or "w"
        base = base if IDENTIFIER.fullmatch(base) else f"w_{base}"
        new, n = base, 1
        while new in taken:
            n += 1
            new = f"{base}_{n}"
        taken.add(new)
        renames[tensor.name] = new
    if not renames:
        return

    for tensor in graph.initializer:
        tensor.name = renames.get(tensor.name, tensor.name)
    for value in list(graph.input) + list(graph.value_info):
        value.name = renames.get(value.name, value.name)
    for node, _ in _nodes(graph):  # subgraphs (If/Loop/Scan) may read outer initializers
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


def _read(path: Path) -> tuple[onnx.ModelProto, str]:
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model {path} is not a regular file; give the .onnx file")
    check("model_bytes", f"model {path}", path.stat().st_size, ModelError)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelError(f"cannot read model {path}: {err.strerror}") from None
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise ModelError(f"{path} is not a valid ONNX model: protobuf parse failed ({err}); is the file corrupt or truncated?") from None
    if not model.HasField("graph") or not model.ir_version or not model.graph.node:
        raise ModelError(f"{path} is not an ONNX model (no ir_version or graph); export the model to ONNX first")
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        for tensor in external:
            _check_external(path, tensor)
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as err:
            raise ModelError(f"{path}: cannot load external weight data: {err}") from None
    return model, hashlib.sha256(data).hexdigest()


def _check_external(path: Path, tensor: onnx.TensorProto) -> None:
    """External weight files must lie inside the model's folder, reached without symlinks, and hold the
    bytes the tensor claims (checked before anything is read)."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    base = path.parent.resolve()
    target = (base / location)
    where = f"{path.name}: initializer '{tensor.name}' refers to external data {location!r}"
    if not location or Path(location).is_absolute() or ".." in Path(location).parts:
        raise ModelError(f"{where} outside the model's folder; refusing to read it")
    current = base
    for part in Path(location).parts:
        current = current / part
        if current.is_symlink():
            raise ModelError(f"{where} through a symlink; refusing to read it")
    if target.resolve().parent != base and base not in target.resolve().parents:
        raise ModelError(f"{where} outside the model's folder; refusing to read it")
    if not target.is_file():
        raise ModelError(f"{where}, which does not exist")
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    except ValueError:
        raise ModelError(f"{where} with a non-numeric offset or length") from None
    if offset < 0 or offset + max(length, 0) > target.stat().st_size:
        raise ModelError(f"{where} beyond the end of that file")


MAX_DIM = 1 << 31
MAX_TENSOR_BYTES = 1 << 36  # 64 GiB


def _check_sizes(path: Path, model: onnx.ModelProto) -> None:
    """Refuse declared dimensions no device could hold, before anything allocates them."""
    def check(kind: str, name: str, dims, elem_type: int) -> None:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize if elem_type else 4
        count = 1
        for d in dims:
            if d > MAX_DIM:
                raise ModelError(f"{path.name}: {kind} '{name}' declares a dimension of {d}; refusing a hostile or broken model")
            count *= max(d, 1)
        if count * itemsize > MAX_TENSOR_BYTES:
            raise ModelError(f"{path.name}: {kind} '{name}' declares {count * itemsize / 2**30:.0f} GiB; refusing it")

    for tensor in model.graph.initializer:
        check("initializer", tensor.name, list(tensor.dims), tensor.data_type)
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if value.type.HasField("tensor_type"):
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")]
            check("tensor", value.name, dims, value.type.tensor_type.elem_type)


KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft"}


def _nodes(graph: onnx.GraphProto, depth: int = 0):
    """(node, depth) for every node of ``graph`` and, after each node, of its subgraphs (If, Loop, Scan bodies;
    depth 1 and below)."""
    for node in graph.node:
        yield node, depth
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _nodes(sub, depth + 1)


def _check_graph(path: Path, model: onnx.ModelProto) -> None:
    """Opsets edgeq knows, and a graph whose every edge has a producer and no cycles. An opset import that no
    node uses is dropped (ONNX Runtime's quantizer lists every domain it knows, com.microsoft.nchwc included)."""
    newest = onnx.defs.onnx_opset_version()
    used: dict[str, set[str]] = {}
    for node, _ in _nodes(model.graph):
        used.setdefault(node.domain or "", set()).add(node.op_type)
    for opset in list(model.opset_import):
        if opset.domain not in KNOWN_DOMAINS and opset.domain not in used:
            model.opset_import.remove(opset)
    for opset in model.opset_import:
        if opset.domain not in KNOWN_DOMAINS:
            ops = ", ".join(sorted(used[opset.domain]))
            hint = ("; ONNX Runtime's NCHWc layout ops are an optimisation it saved into the model: save it from the "
                    "original with SessionOptions.graph_optimization_level at ORT_ENABLE_EXTENDED or lower"
                    if opset.domain == "com.microsoft.nchwc" else "")
            raise ModelError(f"{path.name} uses the unknown opset domain {opset.domain!r} ({ops}){hint}")
        if opset.domain in ("", "ai.onnx") and not 1 <= opset.version <= newest:
            raise ModelError(f"{path.name} declares ONNX opset {opset.version}; this onnx knows opsets 1 to {newest}")
    graph = model.graph
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    producers = {out: i for i, node in enumerate(graph.node) for out in node.output}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name in defined:
                continue
            label = node.name or node.op_type
            if name not in producers:
                raise ModelError(f"{path.name}: input '{name}' of node '{label}' is produced by nothing (dangling edge)")
            if _reaches(graph, producers, producers[name], i):
                raise ModelError(f"{path.name}: the graph has a cycle through '{name}' (node '{label}')")
            raise ModelError(f"{path.name}: nodes are not in topological order ('{name}' is used before it is made)")
        defined.update(node.output)
    for out in graph.output:
        if out.name not in defined:
            raise ModelError(f"{path.name}: graph output '{out.name}' is produced by nothing (dangling edge)")


def _reaches(graph, producers: dict, start: int, goal: int) -> bool:
    """Whether node ``goal`` is an ancestor of node ``start`` (so ``start`` feeding ``goal`` closes a cycle)."""
    stack, seen = [start], set()
    while stack:
        i = stack.pop()
        if i == goal:
            return True
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producers[n] for n in graph.node[i].input if n in producers)
    return False


def nested_node(graph, ops: tuple[str, ...]) -> str | None:
    """The name (else the op) of the first node of one of ``ops`` inside a subgraph of ``graph`` (an If's
    branch, a Loop's or Scan's body, at any depth), or None."""
    return next((node.name or node.op_type for node, depth in _nodes(graph) if depth and node.op_type in ops), None)


def _onnx_dtype(elem_type: int) -> str:
    return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))


def _fix_inputs(model: onnx.ModelProto, overrides: dict[str, tuple[int, ...]]) -> list[TensorSpec]:
    initializers = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initializers]
    names = [i.name for i in graph_inputs]
    for name in overrides:
        if name not in names:
            raise UsageError(f"--input-shape names '{name}', but the model's inputs are: {', '.join(names)}")
    specs = []
    for value in graph_inputs:
        ttype = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise ModelError(f"input '{value.name}' is not a tensor; edgeq compiles tensor inputs only")
        dims = ttype.shape.dim
        declared = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?") for d in dims)
        if value.name in overrides:
            shape = overrides[value.name]
            if len(shape) != len(dims):
                raise UsageError(
                    f"--input-shape {value.name} has {len(shape)} dims but the model declares {len(dims)}: {_fmt(declared)}"
                )
            for dim, declared_dim, want in zip(dims, declared, shape):
                if isinstance(declared_dim, int) and declared_dim != want:
                    raise UsageError(
                        f"--input-shape {value.name}={_fmt(shape)} conflicts with the model's fixed shape {_fmt(declared)}"
                    )
                dim.Clear()
                dim.dim_value = want
        elif not all(isinstance(d, int) for d in declared):
            example = "x".join(str(d) if isinstance(d, int) else "1" for d in declared)
            raise ModelError(
                f"input '{value.name}' has dynamic dims {_fmt(declared)}; fix them with --input-shape {value.name}={example}"
            )
        else:
            shape = declared
        spec = TensorSpec(name=value.name, shape=list(shape), dtype=_onnx_dtype(ttype.elem_type))
        count = math.prod(spec.shape)
        check("input_bytes", f"input '{spec.name}' ({_fmt(spec.shape)} {spec.dtype})",
              count * np.dtype(spec.dtype).itemsize, UsageError if value.name in overrides else ModelError)
        specs.append(spec)
    return specs


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)


def load_model(path: str | Path, input_shapes: dict[str, tuple[int, ...]] | None = None,
               consts: dict[str, np.ndarray] | None = None) -> LoadedModel:
    """Read, check and shape-fix an ONNX model, bind ``consts`` (graph input name -> value) as constants and
    fold the shape arithmetic. Raises ModelError/UsageError with a one-line reason."""
    from edgeq.model_guard import checked

    path = Path(path)
    model, sha = _read(path)
    _check_sizes(path, model)
    _check_graph(path, model)
    _bind_consts(model, consts or {})
    inputs = _fix_inputs(model, input_shapes or {})
    # checker, strict shape inference and constant folding (edgeq.fold), in a limited child process
    model, warnings = checked(model, path.name)
    identifier_names(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return LoadedModel(path=path, sha256=sha, onnx_model=model, inputs=inputs, opset=opset, warnings=tuple(warnings))
