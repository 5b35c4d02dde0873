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
    """The shape-inferred model, checked in a child process. Raises ModelError with a one-line reason."""
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
            raise ModelError(f"{name}: {(proc.stdout.strip().splitlines() or ['invalid model'])[0]}")
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            raise ModelError(f"{name}: the ONNX checker crashed ({sig}) on this model; it is malformed or hostile")
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            if any(sign in proc.stderr for sign in ("MemoryError", "bad_alloc", "failed to map segment", "Cannot allocate memory")):
                raise ModelError(f"{name}: checking the model needed more than {MEMORY_BYTES >> 20} MB; it is malformed "
                                 "or too large (raise EDGEQ_MODEL_CHECK_MEMORY_MB)")
            raise ModelError(f"{name}: the model check failed: {last}")
        return onnx.load(dst)


def infer(model):
    import onnx

    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def main(argv: list[str]) -> int:
    import onnx

    from edgeq.fold import fold

    src, dst = argv
    try:
        model = onnx.load(src)
        onnx.checker.check_model(model)
        inferred = infer(model)
        inferred, _ = fold(inferred, infer)
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
