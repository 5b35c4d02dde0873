"""Tuning records (``edgeq tune`` writes them, ``edgeq package --records`` applies them): a JSON-lines file,
each line ``{"format", "profile", "tvm_version", "precision", "workload_hash", "workload", "record"}``. One file
can hold many models, devices and precisions; a lookup matches profile, TVM version, precision and workload."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from edgeq.errors import OutputError, UsageError
from edgeq.templates.safebundle import json_depth
from edgeq.targets import Profile
from edgeq.tvm_env import import_tvm

FORMAT = 1
BASELINE = "baseline"  # a line's "kind": the function as edgeq schedules it, measured (no "record")
RECORD_DEPTH = 256  # nesting of one records line (TVM's traces nest far less)


def _shash(mod) -> int:
    import_tvm()
    import tvm_ffi

    return tvm_ffi.structural_hash(mod)


def prepare(mod, target):
    """The module as tuning and compiling with records see it: legalized and fused (TVM's zero pipeline)."""
    tvm = import_tvm()
    from tvm import relax

    with tvm.target.Target(target):
        return tvm.ir.transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            relax.get_pipeline("zero"),
        ])(mod)


class Records:
    """The records file: load the entries for one profile and TVM version into a meta_schedule database."""

    def __init__(self, path: Path, profile: Profile, warn=None, precision: str = "fp32"):
        tvm = import_tvm()
        from tvm.s_tir import meta_schedule as ms

        self.path, self.profile, self.tvm_version = Path(path), profile.name, tvm.__version__
        self.precision = precision
        self.other = 0  # records for another profile, TVM version or precision: kept in the file, not used
        self.database = ms.database.MemoryDatabase()
        self._lines: list[str] = []
        self._saved: set[tuple[str, str]] = set()
        self._mine: Counter[str] = Counter()  # workload hash -> records for this profile and TVM version
        # workload hash -> ms of the function as edgeq schedules it without records, measured by edgeq tune
        self.baselines: dict[str, float] = {}
        if self.path.exists():
            try:
                text = self.path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise UsageError(f"cannot read records file {self.path}: {getattr(err, 'strerror', None) or err}") from None
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    if json_depth(line) > RECORD_DEPTH:  # json.loads would recurse until RecursionError
                        raise ValueError
                    entry = json.loads(line)
                    baseline = entry.get("kind") == BASELINE
                    key = (entry["workload_hash"], "baseline" if baseline else json.dumps(entry["record"]))
                    run_ms = float(entry["run_ms"]) if baseline else None
                    if run_ms is not None and not (0 < run_ms < float("inf")):
                        raise ValueError
                except (ValueError, KeyError, TypeError, RecursionError, AttributeError):
                    raise UsageError(f"records file {self.path} line {n} is not an edgeq tuning record") from None
                self._lines.append(line)
                self._saved.add(key)
                mine = (entry.get("profile") == self.profile and entry.get("tvm_version") == self.tvm_version
                        and entry.get("precision", "fp32") == self.precision)
                self.other += not mine
                if mine and baseline:
                    self.baselines[str(entry["workload_hash"])] = run_ms
                elif mine:
                    try:  # TVM's parsers raise anything (FFI type errors) on a workload or record that is not one
                        workload = ms.database.Workload.from_json(entry["workload"])
                        record = ms.database.TuningRecord.from_json(entry["record"], workload)
                    except Exception as err:  # noqa: BLE001 - a damaged line is skipped, saying which
                        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
                        (warn or _stderr_warning)(f"records file {self.path} line {n} is skipped: its workload or "
                                                  f"record does not parse ({reason})")
                        continue
                    self._mine[entry["workload_hash"]] += 1
                    self.database.commit_workload(workload.mod)
                    self.database.commit_tuning_record(record)

    def count(self, mod) -> int:
        """Records kept for this workload on this profile and TVM version."""
        return self._mine[str(_shash(mod))]

    def baseline(self, mod) -> float | None:
        """ms of ``mod``'s function as edgeq schedules it without records, where tune measured it."""
        return self.baselines.get(str(_shash(mod)))

    def set_baseline(self, mod, run_ms: float) -> None:
        h = str(_shash(mod))
        self.baselines[h] = run_ms
        self._saved.add((h, "baseline"))
        self._lines.append(json.dumps({"format": FORMAT, "kind": BASELINE, "profile": self.profile,
                                       "tvm_version": self.tvm_version, "precision": self.precision,
                                       "workload_hash": h, "run_ms": run_ms}))

    def faster(self):
        """(a database of the records whose best schedule beats the function's own, as measured by tune, or
        that have no such measurement; the workloads whose records do not)."""
        import_tvm()
        from tvm.s_tir import meta_schedule as ms

        best: dict[str, tuple[float, object]] = {}
        for record in self.database.get_all_tuning_records():
            costs = [float(getattr(c, "value", c)) for c in (record.run_secs or [])]
            if not costs:
                continue
            h = str(_shash(record.workload.mod))
            ms_ = 1e3 * sum(costs) / len(costs)
            if h not in best or ms_ < best[h][0]:
                best[h] = (ms_, record)
        kept = ms.database.MemoryDatabase()
        slower = []
        for h, (ms_, record) in best.items():
            own = self.baselines.get(h)
            if own is not None and ms_ >= own:
                slower.append(h)
                continue
            workload = kept.commit_workload(record.workload.mod)
            kept.commit_tuning_record(ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target,
                                                               record.args_info))
        return kept, slower

    def save(self) -> int:
        """Append the database's new records; write to a temporary file and rename (never half a file)."""
        added = 0
        for record in self.database.get_all_tuning_records():
            h, record_json = str(_shash(record.workload.mod)), record.as_json()
            key = (h, json.dumps(record_json))
            if key in self._saved:
                continue
            self._saved.add(key)
            self._mine[h] += 1
            self._lines.append(json.dumps({
                "format": FORMAT, "profile": self.profile, "tvm_version": self.tvm_version,
                "precision": self.precision, "workload_hash": h, "workload": record.workload.as_json(), "record": record_json,
            }))
            added += 1
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in self._lines), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as err:
            raise OutputError(f"cannot write records file {self.path}: {err.strerror}") from None
        return added


def _stderr_warning(text: str) -> None:
    import sys

    print(f"edgeq: warning: {text}", file=sys.stderr, flush=True)


def apply_records(mod, target, records_path: Path, profile: Profile, warn=None, precision: str = "fp32", note=None):
    """(``mod`` prepared and with every function that has a record replaced by its best schedule, how many
    functions a record scheduled). Records of another profile, TVM version or precision are not used (said in
    one warning); a record that does not parse is skipped with a warning (``warn``) naming its line; a function
    whose best record measured no faster than edgeq's own schedule of it keeps its own (said in one line)."""
    tvm = import_tvm()
    import tvm_ffi
    from tvm import relax, tirx

    records = Records(records_path, profile, warn, precision)
    if records.other:
        (warn or _stderr_warning)(f"{records.other} record(s) in {records_path} are for another profile, TVM version "
                                  f"or precision than this {profile.name} {precision} build: not used")
    prepared = prepare(mod, target)
    database, slower = records.faster()
    if slower:
        (note or warn or _stderr_warning)(f"{len(slower)} function(s) keep edgeq's own schedule: their best tuned "
                                          "schedule measured no faster (edgeq tune measures both)")
    with tvm.target.Target(target), database:
        applied = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(prepared)
    scheduled = sum(1 for gv, func in applied.functions.items()
                    if isinstance(func, tirx.PrimFunc) and not tvm_ffi.structural_equal(func, prepared[gv.name_hint]))
    return applied, scheduled
