"""Progress of a multi-stage job, on stderr: one line when a stage starts (a spinner on a terminal) and
one when it ends, with its time. Stages report into a dict of seconds that results and manifests keep."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console


class StageProgress:
    def __init__(self, console: Console | None = None, quiet: bool = False, total: int = 0):
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.quiet = quiet
        self.total = total
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False)

    @contextlib.contextmanager
    def stage(self, name: str, description: str) -> Iterator[None]:
        index = len(self.seconds) + 1
        counter = f"[{index}/{self.total}]" if self.total else f"[{index}]"
        start = time.perf_counter()
        spinner = (
            self.console.status(f"{counter} {name}: {description}")
            if self.console.is_terminal and not self.quiet
            else contextlib.nullcontext()
        )
        with spinner:
            yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        self.note(f"{counter} {name}: {description} [dim]({self.seconds[name]:.1f} s)[/dim]")

    @property
    def total_seconds(self) -> float:
        return round(time.perf_counter() - self._started, 3)
