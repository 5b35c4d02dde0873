"""Check an untrusted ONNX model in a child process: the ONNX checker and strict shape inference run in
native code, so a crafted model could crash or exhaust this process. The child runs with a memory limit
and a timeout; a crash is reported as a one-line error, not fatal to edgeq.

    python -m edgeq.model_guard IN.onnx OUT.onnx   (exit 0: OUT holds the shape-inferred model;
                                                    exit 3: the first line of stdout says what is wrong)
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from edgeq.errors import ModelError

TIMEOUT_S = int(os.environ.get("EDGEQ_MODEL_CHECK_TIMEOUT", "300"))
MEMORY_BYTES = int(os.environ.get("EDGEQ_MODEL_CHECK_MEMORY_MB", "8192")) << 20
PROTOBUF_LIMIT = 2_000_000_000


def _limit_memory() -> None:  # runs in the child before exec
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # under `ulimit -v` the child may not go above it
    limit = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def checked(model, name: str):
    """(the shape-inferred model, warnings), checked in a child process. Raises ModelError with a one-line reason."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="edgeq-model-") as tmp:
        src, dst = Path(tmp, "in.onnx"), Path(tmp, "out.onnx")
        big = model.ByteSize() > PROTOBUF_LIMIT
        onnx.save_model(model, src, save_as_external_data=big, location="in.data" if big else None)
        try:
            proc = subprocess.run([sys.executable, "-m", "edgeq.model_guard", str(src), str(dst)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=_limit_memory)
        except subprocess.TimeoutExpired:
            raise ModelError(f"{name}: checking the model took longer than {TIMEOUT_S} s; it is malformed or too large") from None
        if proc.returncode == 3:
            raise ModelError(f"{name}: {(proc.stdout.strip().splitlines() or ['invalid model'])[-1]}")
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            raise ModelError(f"{name}: the ONNX checker crashed ({sig}) on this model; it is malformed or hostile")
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            if any(sign in proc.stderr for sign in ("MemoryError", "bad_alloc", "failed to map segment", "Cannot allocate memory")):
                raise ModelError(f"{name}: checking the model needed more than {MEMORY_BYTES >> 20} MB; it is malformed "
                                 "or too large (raise EDGEQ_MODEL_CHECK_MEMORY_MB)")
            raise ModelError(f"{name}: the model check failed: {last}")
        warnings = [f"{name}: {line[len('warning: '):]}" for line in proc.stdout.splitlines() if line.startswith("warning: ")]
        return onnx.load(dst), warnings


def infer(model):
    import onnx

    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def _tolerant(infer_fn, warnings: list[str]):
    """``infer_fn`` that, where the model's declared shapes contradict what its graph computes (an exporter's stale
    output shape: ddddocr's [1, seqlen] for a [T, 1, classes] result), drops the declared shapes of the outputs and
    of intermediate values (the inputs' stay: they are the contract) and infers again, noting a warning. ONNX
    Runtime does the same: it warns and runs with what the graph computes."""
    import re

    import onnx

    def run(model):
        try:
            return infer_fn(model)
        except onnx.shape_inference.InferenceError as err:
            if "existing shape differ" not in str(err):
                raise
            declared = [o.name for o in model.graph.output if o.type.tensor_type.HasField("shape")]
            for out in model.graph.output:
                out.type.tensor_type.ClearField("shape")
            del model.graph.value_info[:]
            inferred = infer_fn(model)
            text = " ".join(str(err).split())
            node = re.search(r"\(op_type:(\w+)(?:, node name: ([^)]*))?\)", text)
            where = f" at {node.group(1)} {node.group(2) or ''}".rstrip() if node else ""
            what = text[text.rfind("Inferred shape"):][:120] if "Inferred shape" in text else text[-120:]
            warnings.append(f"the declared shape of output(s) {', '.join(declared) or '(none)'} contradicts the graph "
                            f"({what}{where}); using the shapes the graph computes, as ONNX Runtime does")
            return inferred

    return run


def main(argv: list[str]) -> int:
    import onnx

    from edgeq.fold import fold

    src, dst = argv
    try:
        model = onnx.load(src)
        onnx.checker.check_model(model)
        warnings: list[str] = []
        inferred = _tolerant(infer, warnings)(model)
        inferred, _ = fold(inferred, _tolerant(infer, warnings))
        for text in dict.fromkeys(warnings):
            print(f"warning: {text}")
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        kind = "fails the ONNX checker" if isinstance(err, onnx.checker.ValidationError) else "ONNX shape inference failed"
        print(f"{kind}: {' '.join(lines[:2])[:300]}")
        return 3
    big = inferred.ByteSize() > PROTOBUF_LIMIT
    onnx.save_model(inferred, dst, save_as_external_data=big, location="out.data" if big else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
