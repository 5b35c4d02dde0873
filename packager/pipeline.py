"""How a declared list of stages runs: each ``Stage`` says when it applies (a predicate on the records made
so far) and, when it changes the Relax module, which module it leaves (``ir``). ``run_stages`` walks the
list in order, runs what applies, keeps the progress total equal to the stages that have run plus those
that still apply, and hands each stage's module to an ``IRDump`` (``edgeq package --dump-ir DIR``).

A stage's function says what it reads by its parameters' types and what it makes by its return type: the
records it names are handed to it from the ``Records`` made so far, and what it returns is added there (a
record of a type already there replaces it: a stage remakes, never edits, a record). Records are frozen
dataclasses (``edgeq.stage_records``); a test checks every stage's signature.

What ``edgeq package`` runs is declared in ``edgeq.package.STAGES``; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from edgeq.errors import OutputError
from edgeq.progress import StageProgress

S = TypeVar("S")
R = TypeVar("R")


class Records:
    """The records a job has made so far, by type (its arguments and services are the first). Stages read
    it through their parameters; only ``run_stages`` adds to it."""

    def __init__(self, *seeds: object):
        self._by_type: dict[type, object] = {}
        for seed in seeds:
            if seed is not None:  # (an absent service, such as no IR dump: a stage's ``X | None`` gets None)
                self._add(seed)

    def __getitem__(self, kind: type[R]) -> R:
        try:
            return self._by_type[kind]  # type: ignore[return-value]
        except KeyError:
            raise LookupError(f"no {kind.__name__} record yet: a stage reads it before the stage that makes it") from None

    def get(self, kind: type[R]) -> R | None:
        return self._by_type.get(kind)  # type: ignore[return-value]

    def __contains__(self, kind: type) -> bool:
        return kind in self._by_type

    def _add(self, record: object, kind: type | None = None) -> None:
        self._by_type[kind or type(record)] = record


@functools.lru_cache(maxsize=None)
def signature(run: Callable) -> tuple[tuple[tuple[str, type, bool], ...], type | None]:
    """((parameter, record type, optional), ...), return type) of a stage function, from its annotations
    (``X | None``: the stage runs without that record too)."""
    hints = typing.get_type_hints(run)
    params = []
    for name in inspect.signature(run).parameters:
        if name not in hints:
            raise TypeError(f"stage function {run.__qualname__}: parameter '{name}' names no record type")
        kind, optional = hints[name], False
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(kind) if a is not type(None)]
            kind, optional = members[0], len(members) < len(typing.get_args(kind))
        params.append((name, kind, optional))
    made = hints.get("return")
    return tuple(params), (None if made is type(None) else made)


def call(run: Callable, records: Records) -> object:
    """``run`` with the records its parameters name."""
    params, _ = signature(run)
    return run(**{name: (records.get(kind) if optional else records[kind]) for name, kind, optional in params})


def always(_state: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Stage(Generic[S]):
    """One step of a job: ``run`` it when ``applies``; ``describe`` is its progress line; ``ir``, for a
    stage that changes the module, returns the module it leaves (written by ``--dump-ir``).

    ``applies`` is asked before every stage that runs (the progress total follows from it), so it must be
    cheap and must hold for a state in which the earlier stages have not run yet."""

    name: str
    describe: Callable[[S], str]
    run: Callable[..., Any]  # takes the records its parameters' types name, returns the record it makes
    applies: Callable[[S], bool] = always
    ir: Callable[[S], Any] | None = None


# The files an IRDump writes: NN-<stage>.py
DUMP_FILE = re.compile(r"\d{2,}-[a-z0-9-]+\.py")
# TVM 0.27 prints a non-finite scalar constant as R.const("-inf", "float32"), which its own parser refuses
# ("value has to be scalar or Tensor"); R.const(float("-inf"), "float32") is the same constant and parses.
NON_FINITE_CONST = re.compile(r'R\.const\("(-?inf|nan)", ')


class IRDump:
    """Writes a Relax module as TVMScript to ``folder/NN-<stage>.py`` (NN: the stage's number in the
    progress output), each file atomically, so the files of the stages before a failure stay."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.written: list[Path] = []

    def prepare(self) -> None:
        """Make the folder and remove the files an earlier dump left there (only NN-<stage>.py files),
        so that what it holds after a failure is this run's."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for path in self.folder.iterdir():
                if DUMP_FILE.fullmatch(path.name) and path.is_file():
                    path.unlink()
            if not os.access(self.folder, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as err:
            raise OutputError(f"cannot write the IR dump folder {self.folder}: {err.strerror or err}; "
                              "choose another with --dump-ir") from None

    def write(self, number: int, stage: str, mod: Any) -> Path:
        path = self.folder / f"{number:02d}-{stage}.py"
        # show_meta: constants folded into the module (metadata[...]) are printed too, so the file parses back
        text = NON_FINITE_CONST.sub(r'R.const(float("\1"), ', mod.script(show_meta=True))
        tmp = self.folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"# edgeq package --dump-ir: the Relax module after stage '{stage}'\n")
                f.write(text if text.endswith("\n") else text + "\n")
            os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
        self.written.append(path)
        return path


def planned(stages: Sequence[Stage[S]], state: S) -> list[str]:
    """The names of the stages that apply to ``state`` now, in order."""
    return [stage.name for stage in stages if stage.applies(state)]


def run_stages(stages: Sequence[Stage[Records]], records: Records, progress: StageProgress,
               dump: IRDump | None = None) -> None:
    """Run the stages that apply, in order, each with the records it names; what it returns joins
    ``records``. Before each, the progress total is set to the stages run so far plus those that apply now (a
    stage whose predicate a later stage decides is counted as the records say at that moment; this is the
    one place the total is corrected)."""
    for position, stage in enumerate(stages):
        if not stage.applies(records):
            continue
        progress.total = len(progress.seconds) + len(planned(stages[position:], records))
        with progress.stage(stage.name, stage.describe(records)):
            made = call(stage.run, records)
            _, kind = signature(stage.run)
            if kind is not None:
                if not isinstance(made, kind):
                    raise TypeError(f"stage {stage.name} returned {type(made).__name__}, not {kind.__name__}")
                records._add(made, kind)
        if dump is not None and stage.ir is not None:
            dump.write(len(progress.seconds), stage.name, stage.ir(records))
