"""``edgeq package --dump-ir DIR``: the Relax module after each stage that changes it, as TVMScript in
DIR/NN-<stage>.py; and the declared pipeline: the stages that run follow from their predicates, and the
progress total is the number of stages that ran."""

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import ort_quantize, run_cli

FAMILIES = ["resnet_cnn", "mobilenet_cnn", "transformer_block"]
PROGRESS_LINE = re.compile(r"^\[(\d+)/(\d+)\] ([a-z-]+): ", re.M)


def progress(stderr: str) -> list[tuple[int, int, str]]:
    return [(int(n), int(total), name) for n, total, name in PROGRESS_LINE.findall(stderr)]


def package(model, out: Path, ir: Path | None, *extra):
    res = run_cli("package", model, "--device", "host", "-o", out, "--json",
                  *(("--dump-ir", ir) if ir is not None else ()), *extra)
    return res


def dumped(ir: Path) -> list[str]:
    return sorted(p.name for p in ir.iterdir())


def assert_tvmscript(path: Path) -> None:
    import tvm

    text = path.read_text()
    assert "@I.ir_module" in text and "def main(" in text, path
    mod = tvm.script.from_source(text)
    assert "main" in [gv.name_hint for gv in mod.functions], path


def assert_progress_counts_what_ran(res, stages: list[str]) -> None:
    lines = progress(res.stderr)
    assert [name for _, _, name in lines] == stages == list(json.loads(res.stdout)["stages"])
    assert [n for n, _, _ in lines] == list(range(1, len(stages) + 1))
    assert lines[-1][1] == len(stages)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_dumps_import_and_lower(family, models, tmp_path):
    ir = tmp_path / "ir"
    res = package(models[family], tmp_path / "out", ir)
    assert res.code == 0, res.stderr
    stages = ["check", "load", "import", "lower", "compile", "golden", "reference", "runtime", "bundle"]
    assert_progress_counts_what_ran(res, stages)
    assert all(total == len(stages) for _, total, _ in progress(res.stderr))  # right from the start
    assert dumped(ir) == ["03-import.py", "04-lower.py"]  # numbered as in the progress output
    for path in ir.iterdir():
        assert_tvmscript(path)
        assert path.read_text().startswith(f"# edgeq package --dump-ir: the Relax module after stage '{path.stem[3:]}'")
    # the lowered module is on edgeq's CPU kernels, the imported one is not
    assert "edgeq_" not in (ir / "03-import.py").read_text() and "edgeq_" in (ir / "04-lower.py").read_text()
    # nothing of it enters the bundle
    bundle_dir = Path(json.loads(res.stdout)["bundle_dir"])
    manifest_text = (bundle_dir / "manifest.json").read_text()
    assert "dump_ir" not in manifest_text and str(ir) not in manifest_text
    shipped = {"run.py", "contract.py", "safebundle.py", "imaging.py", "video.py"}  # the loader and its modules: edgeq.bundle.SHIPPED
    assert not any("ir" == p.name or p.suffix == ".py" and p.name not in shipped for p in bundle_dir.rglob("*"))


def test_int8_adds_the_quantize_stage(models, tmp_path):
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).standard_normal((16, 3, 32, 32)).astype(np.float32))
    ir = tmp_path / "ir"
    res = package(models["resnet_cnn"], tmp_path / "out", ir, "--precision", "int8", "--calibrate", calib)
    assert res.code == 0, res.stderr
    assert_progress_counts_what_ran(
        res, ["check", "load", "import", "quantize", "lower", "compile", "golden", "reference", "runtime", "bundle"])
    assert dumped(ir) == ["03-import.py", "04-quantize.py", "05-lower.py"]
    for path in ir.iterdir():
        assert_tvmscript(path)
    assert "int8" not in (ir / "03-import.py").read_text() and "int8" in (ir / "04-quantize.py").read_text()


def test_prequantized_model_dumps_lower_qdq(models, tmp_path):
    qdq = ort_quantize(models["mobilenet_cnn"], tmp_path / "qdq.onnx")
    ir = tmp_path / "ir"
    res = package(qdq, tmp_path / "out", ir, "--runtime", "none")
    assert res.code == 0, res.stderr
    assert_progress_counts_what_ran(res, ["check", "load", "import", "lower-qdq", "lower", "compile", "golden", "reference", "bundle"])
    assert dumped(ir) == ["03-import.py", "04-lower-qdq.py", "05-lower.py"]
    for path in ir.iterdir():
        assert_tvmscript(path)


def test_progress_total_corrected_once_the_import_decides(models, tmp_path):
    """A float model whose bytes mention DequantizeLinear: the cheap look before import counts lower-qdq,
    the import says it does not apply, and the total follows; the last line counts what ran."""
    model = onnx.load(models["mobilenet_cnn"])
    model.doc_string = "not a DequantizeLinear in sight"
    path = tmp_path / "mentions.onnx"
    onnx.save(model, path)
    res = package(path, tmp_path / "out", None)
    assert res.code == 0, res.stderr
    assert_progress_counts_what_ran(res, ["check", "load", "import", "lower", "compile", "golden", "reference", "runtime", "bundle"])
    assert [total for _, total, _ in progress(res.stderr)] == [10, 10, 10, 9, 9, 9, 9, 9, 9]


def test_tuning_records_stage_runs_with_records(models, tmp_path):
    records = tmp_path / "records.json"
    records.write_text("")  # no records for this workload: the module is prepared (legalized, fused) all the same
    ir = tmp_path / "ir"
    res = package(models["transformer_block"], tmp_path / "out", ir, "--records", records, "--runtime", "none")
    assert res.code == 0, res.stderr
    assert_progress_counts_what_ran(res, ["check", "load", "import", "lower", "tuning-records", "compile", "golden", "reference", "bundle"])
    assert dumped(ir) == ["03-import.py", "04-lower.py", "05-tuning-records.py"]
    for path in ir.iterdir():
        assert_tvmscript(path)
    assert "T.prim_func" in (ir / "05-tuning-records.py").read_text()  # legalized


def test_failing_stage_leaves_the_earlier_files(models, tmp_path):
    records = tmp_path / "records.json"
    records.write_text("not a record\n")
    out = tmp_path / "out"
    ir = tmp_path / "ir"
    (ir).mkdir()
    (ir / "06-compile.py").write_text("stale\n")  # from an earlier run: removed
    (ir / "notes.txt").write_text("mine\n")  # not a dump file: kept
    res = package(models["resnet_cnn"], out, ir, "--records", records)
    assert res.code == 2 and "is not an edgeq tuning record" in res.stderr
    assert progress(res.stderr)[-1][2] == "lower"  # the last stage that finished
    assert dumped(ir) == ["03-import.py", "04-lower.py", "notes.txt"]
    for path in ir.glob("*.py"):
        assert_tvmscript(path)
    assert not out.exists()  # made by this run, nothing in it: removed as before


def test_failing_build_keeps_a_dump_inside_the_output_folder(models, tmp_path, monkeypatch):
    import edgeq.package
    from edgeq.errors import ToolchainError

    def broken(*args, **kwargs):
        raise ToolchainError("the build broke")

    monkeypatch.setattr(edgeq.package, "build", broken)
    out = tmp_path / "out"
    res = package(models["transformer_block"], out, out / "ir")
    assert res.code == 5 and "the build broke" in res.stderr
    assert dumped(out / "ir") == ["03-import.py", "04-lower.py"]
    assert sorted(p.name for p in out.iterdir()) == ["ir"]  # no staging folder, no bundle


def test_dump_folder_that_cannot_be_written_is_one_line(models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = package(models["resnet_cnn"], tmp_path / "out", blocker / "ir")
    assert res.code == 6, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("edgeq: error: cannot write the IR dump folder") and "--dump-ir" in lines[-1]
    assert "Traceback" not in res.stderr


def test_dump_ir_changes_nothing_in_the_bundle(models, tmp_path):
    manifests = []
    for ir in (None, tmp_path / "ir"):
        res = package(models["resnet_cnn"], tmp_path / "out", ir, "--release", "7")
        assert res.code == 0, res.stderr
        manifests.append(json.loads(Path(json.loads(res.stdout)["bundle_dir"], "manifest.json").read_text()))
    plain, dumping = manifests
    assert plain["files"] == dumping["files"] and plain["bundle_id"] == dumping["bundle_id"]
    assert plain["build"]["args"] == dumping["build"]["args"]


def test_package_args_leave_dump_ir_out_of_the_record():
    from edgeq.package import PackageArgs

    args = PackageArgs(model=Path("m.onnx"), device="host", dump_ir=Path("/tmp/ir"))
    assert "dump_ir" not in args.to_dict() and "/tmp/ir" not in args.display()
    assert args.to_dict() == PackageArgs(model=Path("m.onnx"), device="host").to_dict()
