"""TVM's own log kept off the user's terminal unless ``--debug``.

TVM's C++ code writes its warnings (``LOG(WARNING)``) straight to file descriptor 2, past Python and past
``-q``: packaging a BERT encoder printed "Fast mode segfaults when there are out-of-bounds indices" several
times, about indices edgeq clamps, a message that suggests a crash that cannot happen. TVM 0.27 has no hook
for that log, so while a command runs descriptor 2 points at a temporary file and Python's ``sys.stderr``
(edgeq's own messages, its progress) at the terminal. What TVM wrote is dropped, except that an internal
error ends with its last line; ``--debug`` leaves descriptor 2 alone. A crash in native code still reports
through ``faulthandler`` on the real stderr.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
from collections.abc import Iterator


class NativeLog:
    """What native code wrote to descriptor 2 while it was captured (read until the capture ends, then kept)."""

    def __init__(self, file) -> None:
        self._file = file
        self._kept: list[str] | None = None

    def lines(self) -> list[str]:
        if self._kept is not None:
            return self._kept
        self._file.flush()
        self._file.seek(0)
        return self._file.read().decode("utf-8", "replace").splitlines()

    def keep(self) -> None:
        self._kept = self.lines()


@contextlib.contextmanager
def captured(enabled: bool = True) -> Iterator[NativeLog | None]:
    """Descriptor 2 into a temporary file for the duration (``enabled``), ``sys.stderr`` kept on the
    terminal where it wrote to descriptor 2. Yields the log, or None when nothing is captured."""
    try:
        os.fstat(2)
    except OSError:
        enabled = False
    if not enabled:
        yield None
        return
    previous = sys.stderr
    on_fd2 = _writes_to_fd2(previous)
    if on_fd2:
        previous.flush()
    saved = os.dup(2)
    log = tempfile.TemporaryFile()
    real = None
    native: NativeLog | None = None
    handler_was_on = faulthandler.is_enabled()
    try:
        if on_fd2:
            real = os.fdopen(os.dup(saved), "w", buffering=1, encoding=getattr(previous, "encoding", None) or "utf-8",
                             errors="backslashreplace")
            sys.stderr = real
            faulthandler.enable(real)
        os.dup2(log.fileno(), 2)
        native = NativeLog(log)
        yield native
    finally:
        if native is not None:
            native.keep()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr = previous
        if real is not None:
            faulthandler.disable()
            if handler_was_on:
                faulthandler.enable()
            real.close()
        log.close()


def _writes_to_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # pytest's capture, a StringIO
        return False
