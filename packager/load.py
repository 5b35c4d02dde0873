"""Load and check an ONNX model, fix its input shapes, and import it into a Relax IRModule."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from edgeq.errors import ModelError, UsageError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclasses.dataclass
class LoadedModel:
    path: Path
    sha256: str
    onnx_model: onnx.ModelProto  # with the input shapes fixed
    inputs: list[TensorSpec]
    opset: int


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


def _read(path: Path) -> tuple[onnx.ModelProto, str]:
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
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
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as err:
            raise ModelError(f"{path}: cannot load external weight data: {err}") from None
    return model, hashlib.sha256(data).hexdigest()


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
        specs.append(TensorSpec(value.name, tuple(shape), _onnx_dtype(ttype.elem_type)))
    return specs


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)


def load_model(path: str | Path, input_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedModel:
    """Read, check and shape-fix an ONNX model. Raises ModelError/UsageError with a one-line reason."""
    path = Path(path)
    model, sha = _read(path)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0]
        raise ModelError(f"{path} fails the ONNX checker: {first}") from None
    inputs = _fix_inputs(model, input_shapes or {})
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0]
        raise ModelError(f"{path}: ONNX shape inference failed: {first}") from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return LoadedModel(path=path, sha256=sha, onnx_model=model, inputs=inputs, opset=opset)
