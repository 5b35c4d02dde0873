"""The build's stages pass frozen records: each stage's signature names the records it reads and the record it
makes, no stage can write a field of a record it was handed, and only the declared stages remake a record."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from edgeq import package, stage_records
from edgeq.pipeline import IRDump, Records, Stage, call, run_stages, signature
from edgeq.progress import StageProgress

SERVICES = {StageProgress, IRDump}  # what stages use besides records: reporting, the IR dump
# the stages that make each record; more than one: remade from the one before (fp16, tuning-records) or two
# ways to the same record (quantize, lower-qdq)
MAKERS = {"Setup": {"check"}, "Loaded": {"load"}, "Imported": {"import"}, "Quantized": {"quantize", "lower-qdq"},
          "Lowered": {"lower", "fp16", "tuning-records"}, "Compiled": {"compile"}, "Golden": {"golden"},
          "ReferenceCheck": {"reference"}, "Runtime": {"runtime"}, "Written": {"bundle"},
          "MenderResult": {"mender"}, "ExportedQdq": {"export-qdq"}}


def _frozen(kind: type) -> bool:
    return dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen


def test_every_stage_reads_and_makes_frozen_records_named_in_its_signature():
    made_by: dict[str, set[str]] = {}
    for stage in package.STAGES:
        params, made = signature(stage.run)
        assert made is not None and _frozen(made), (stage.name, made)
        made_by.setdefault(made.__name__, set()).add(stage.name)
        for name, kind, _ in params:
            assert kind in SERVICES or _frozen(kind), (stage.name, name, kind)
    assert made_by == MAKERS


def test_a_stage_reads_only_records_made_before_it():
    """Walking STAGES in order, every record a stage reads without ``| None`` is made by an earlier stage (or is
    the job's arguments)."""
    available = {"PackageArgs"}
    for stage in package.STAGES:
        params, made = signature(stage.run)
        for name, kind, optional in params:
            assert optional or kind in SERVICES or kind.__name__ in available, (stage.name, name)
        available.add(made.__name__)


def test_every_record_of_the_chain_is_frozen():
    for name in ("FrontEndArgs", "PackageArgs", "Output", "Setup", "Loaded", "Imported", "Quantized", "Lowered",
                 "Compiled", "Golden", "Written", "ExportedQdq"):
        assert _frozen(getattr(stage_records, name)), name
    from edgeq.load import LoadedModel
    from edgeq.quantize import QuantizeResult
    from edgeq.runtime.assemble import Runtime

    for kind in (LoadedModel, QuantizeResult, Runtime):  # what the records hold of other modules
        assert _frozen(kind), kind


@dataclasses.dataclass(frozen=True)
class _A:
    value: int


@dataclasses.dataclass(frozen=True)
class _B:
    total: int


def _make_a(progress: StageProgress) -> _A:
    return _A(2)


def _sneaky(a: _A) -> _B:
    a.value = 5  # a stage writing a field of a record another stage made
    return _B(a.value)


def test_a_stage_that_writes_another_stages_record_fails():
    stages = (Stage("a", lambda r: "a", _make_a), Stage("b", lambda r: "b", _sneaky))
    records = Records(StageProgress(quiet=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run_stages(stages, records, StageProgress(quiet=True))
    assert records[_A].value == 2


def test_the_pipeline_hands_over_what_the_signature_names():
    def add(a: _A, b: _B | None) -> _B:
        return _B(a.value + (b.total if b else 0))

    records = Records(StageProgress(quiet=True))
    run_stages((Stage("a", lambda r: "a", _make_a), Stage("b", lambda r: "b", add), Stage("c", lambda r: "c", add)),
               records, StageProgress(quiet=True))
    assert records[_B].total == 4  # c read b's record (2 + 2), not an edited one
    with pytest.raises(LookupError, match="no _A record yet"):
        call(add, Records())
    with pytest.raises(TypeError, match="names no record type"):
        signature(lambda x: x)


def test_tune_and_package_share_the_front_ends_arguments():
    """A graph option is declared once: FrontEndArgs, which PackageArgs extends and TuneArgs holds."""
    from edgeq.rpc.tune import TuneArgs

    assert issubclass(stage_records.PackageArgs, stage_records.FrontEndArgs)
    hints = typing.get_type_hints(TuneArgs, vars(stage_records))
    assert hints["front"] is stage_records.FrontEndArgs
    front = {f.name for f in dataclasses.fields(stage_records.FrontEndArgs)}
    assert not front & {f.name for f in dataclasses.fields(TuneArgs)}  # nothing restated
