"""TVM's C++ log (``LOG(WARNING)``, written straight to descriptor 2) stays off the terminal unless --debug."""

from __future__ import annotations

import sys

from edgeq import native_log
from edgeq.cli.main import NATIVE_QUIET
from edgeq.tvm_env import import_tvm


def _build_fast_take() -> None:
    """A take in TVM's "fast" mode: TVM's topi logs "Fast mode segfaults when there are out-of-bounds
    indices" from C++ while it builds (the warning the BERT encoder's lookups printed)."""
    import_tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([10, 4], "float32"))
    i = relax.Var("i", relax.TensorType([3], "int64"))
    with bb.function("main", [x, i]):
        bb.emit_func_output(bb.emit(relax.op.take(x, i, axis=0, mode="fast")))
    relax.build(bb.get(), target="llvm")


def test_tvm_warnings_are_captured_and_edgeqs_own_lines_are_not(capfd):
    capfd.readouterr()
    with native_log.captured() as log:
        _build_fast_take()
        print("edgeq: its own line", file=sys.stderr)
    seen = capfd.readouterr()
    assert "segfaults" not in seen.err and "edgeq: its own line" in seen.err, seen.err
    assert any("Fast mode segfaults" in line for line in log.lines()), log.lines()
    with native_log.captured(enabled=False) as log:  # --debug: TVM's log as it is
        _build_fast_take()
    assert log is None and "Fast mode segfaults" in capfd.readouterr().err


def test_the_compiling_verbs_capture_it():
    assert {"package", "tune", "mender"} <= NATIVE_QUIET
