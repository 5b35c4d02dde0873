"""Progress of a multi-stage job, on stderr: one line when a stage starts (a spinner on a terminal) and
one when it ends, with its time. Stages report into a dict of seconds that results and manifests keep."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape


class StageProgress:
    def __init__(self, console: Console | None = None, quiet: bool = False, total: int = 0):
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.quiet = quiet
        self.total = total
        self.seconds: dict[str, float] = {}
        self._status = None
        self._status_text = ""
        self._started = time.perf_counter()

    def note(self, text: str) -> None:
        """A line of plain text (paths and messages are never read as rich markup)."""
        if not self.quiet:
            self.console.print(text, highlight=False, markup=False)

    def warn(self, text: str) -> None:
        """A warning: shown even with --quiet (which silences progress, not problems)."""
        self.console.print(f"edgeq: warning: {text}", highlight=False, markup=False)

    def tick(self, label: str, done: int, total: int) -> None:
        """Progress inside a stage: a live line on a terminal, every quarter elsewhere."""
        if self.quiet or total <= 0:
            return
        if self._status is not None:
            self._status.update(escape(f"{self._status_text} - {label} {done}/{total}"))
        elif done == total or done * 4 // total != (done - 1) * 4 // total:
            self.console.print(f"      {label}: {done}/{total}", highlight=False, markup=False)

    @contextlib.contextmanager
    def stage(self, name: str, description: str) -> Iterator[None]:
        index = len(self.seconds) + 1
        counter = f"[{index}/{self.total}]" if self.total else f"[{index}]"
        start = time.perf_counter()
        self._status_text = f"{counter} {name}: {description}"
        self._status = self.console.status(escape(self._status_text)) if self.console.is_terminal and not self.quiet else None
        try:
            with self._status or contextlib.nullcontext():
                yield
        finally:
            self._status = None
        self.seconds[name] = round(time.perf_counter() - start, 3)
        if not self.quiet:
            self.console.print(f"{escape(f'{counter} {name}: {description}')} [dim]({self.seconds[name]:.1f} s)[/dim]",
                               highlight=False)

    @property
    def total_seconds(self) -> float:
        return round(time.perf_counter() - self._started, 3)
