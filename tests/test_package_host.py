"""Host bundles of the example model families: package through the CLI, run through run.py in a fresh
interpreter, compare with ONNX Runtime."""

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import make_models
import numpy as np
import onnx
import pytest

from conftest import read_golden, run_cli, run_py
from edgeq.reference import onnxruntime_session

FAMILIES = ["resnet_cnn", "mobilenet_cnn", "transformer_block"]


@pytest.fixture(scope="session")
def host_bundles(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("host-bundles")
    results = {}
    for family in FAMILIES:
        res = run_cli("package", models[family], "--device", "host", "-o", out, "--json")
        assert res.code == 0, res.stderr
        results[family] = json.loads(res.stdout)
    return results


def ort_outputs(model_path, inputs):
    session = onnxruntime_session(str(model_path))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


@pytest.mark.parametrize("family", FAMILIES)
def test_host_bundle_matches_onnxruntime(family, host_bundles, models, tmp_path):
    bundle_dir = Path(host_bundles[family]["bundle_dir"])
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    rng = np.random.default_rng(123)
    inputs = {}
    args = []
    for spec in manifest["inputs"]:
        inputs[spec["name"]] = rng.standard_normal(spec["shape"]).astype(spec["dtype"])
        np.save(tmp_path / f"{spec['name']}.npy", inputs[spec["name"]])
        args += ["--input", f"{spec['name']}={tmp_path / spec['name']}.npy"]
    proc = run_py(bundle_dir, *args, "--output", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out.npz")
    want = ort_outputs(models[family], inputs)
    assert set(got.files) == set(want)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_vectors_match_onnxruntime(family, host_bundles, models):
    """The golden outputs recorded at package time are right, not just self-consistent."""
    golden = read_golden(host_bundles[family]["bundle_dir"])
    inputs = {k.split(":", 1)[1]: v for k, v in golden.items() if k.startswith("input:")}
    for name, expected in ort_outputs(models[family], inputs).items():
        np.testing.assert_allclose(golden[f"output:{name}"], expected, rtol=1e-4, atol=1e-5)


def test_self_test_benchmark_and_check(host_bundles):
    bundle_dir = Path(host_bundles["resnet_cnn"]["bundle_dir"])
    proc = run_py(bundle_dir, "--self-test", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["outputs"][0]["output"] == "logits"
    bench = run_py(bundle_dir, "--benchmark", "5", "--warmup", "1", "--json")
    assert bench.returncode == 0, bench.stderr
    stats = json.loads(bench.stdout)
    assert stats["runs"] == 5
    assert 0 < stats["min_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert run_py(bundle_dir, "--check").returncode == 0


def test_loader_and_its_modules_ship_as_they_are(host_bundles):
    """run.py, contract.py, safebundle.py, imaging.py and video.py are the same files in every bundle: edgeq's own."""
    repo = Path(__file__).resolve().parent.parent
    bundle_dir = Path(host_bundles["resnet_cnn"]["bundle_dir"])
    for name, source in (("run.py", "templates/run.py"), ("contract.py", "templates/contract.py"),
                         ("safebundle.py", "templates/safebundle.py"), ("imaging.py", "templates/imaging.py"),
                         ("video.py", "templates/video.py")):
        assert (bundle_dir / name).read_bytes() == (repo / source).read_bytes(), name
    assert not (bundle_dir / "__pycache__").exists()  # running run.py above wrote nothing into the bundle


@pytest.mark.parametrize("version", ["3.8", "3.10"])
def test_shipped_verifier_runs_on_device_pythons(host_bundles, version):
    """safebundle.py and contract.py as shipped run on the Pythons devices have (JetPack 5: 3.8, JetPack 6:
    3.10) without edgeq: they verify the bundle, and run.py (no TVM there) hands over to edgeq-run."""
    import subprocess

    from test_install import find_python

    python, how = find_python(version)
    if python is None:
        pytest.skip(how)
    bundle_dir = Path(host_bundles["resnet_cnn"]["bundle_dir"])
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}  # nothing of edgeq's environment
    verify = subprocess.run([python, str(bundle_dir / "safebundle.py"), "verify", str(bundle_dir.with_suffix(".tar.gz"))],
                            capture_output=True, text=True, env=env, cwd="/")
    assert verify.returncode == 0 and json.loads(verify.stdout)["bundle_id"] == host_bundles["resnet_cnn"]["bundle_id"], verify.stderr
    check = subprocess.run([python, str(bundle_dir / "run.py"), "--check"], capture_output=True, text=True, env=env, cwd="/")
    assert check.returncode == 0 and "can run" in check.stdout, check.stderr
    assert not (bundle_dir / "__pycache__").exists()  # verifying a bundle leaves it as it was


def test_self_test_fails_when_outputs_are_wrong(host_bundles, tmp_path):
    """Corrupt the golden outputs (and their hash, so the file check passes): the self-test must fail."""
    bundle_dir = tmp_path / "b"
    shutil.copytree(host_bundles["mobilenet_cnn"]["bundle_dir"], bundle_dir)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    entry = next(t for t in manifest["golden"]["tensors"] if t["name"] == "output:logits")
    with open(bundle_dir / "golden.bin", "r+b") as f:  # every expected logit + 1.0
        f.seek(entry["offset"])
        f.write((np.fromfile(bundle_dir / "golden.bin", np.float32, entry["bytes"] // 4, offset=entry["offset"]) + 1).tobytes())
    manifest["files"]["golden.bin"] = hashlib.sha256((bundle_dir / "golden.bin").read_bytes()).hexdigest()
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    proc = run_py(bundle_dir, "--self-test")
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "self-test FAILED" in proc.stdout


def test_loader_refuses_a_tampered_file(host_bundles, tmp_path):
    bundle_dir = tmp_path / "b"
    shutil.copytree(host_bundles["resnet_cnn"]["bundle_dir"], bundle_dir)
    with open(bundle_dir / "weights.bin", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"tampered")
    proc = run_py(bundle_dir, "--self-test")
    assert proc.returncode == 7  # contract.LoaderExit.BUNDLE
    assert proc.stderr.strip().splitlines() == [
        "run.py: error: bundle file weights.bin does not match the manifest (changed or from another bundle)"
    ]


def test_loader_rejects_wrong_input_shape(host_bundles, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 8, 8), np.float32))
    proc = run_py(Path(host_bundles["resnet_cnn"]["bundle_dir"]), "--input", f"input={tmp_path / 'x.npy'}")
    assert proc.returncode == 2
    assert "input 'input' must be float32 1x3x32x32, got float32 1x3x8x8" in proc.stderr


def test_manifest_records_what_the_device_needs(host_bundles, models):
    res = host_bundles["transformer_block"]
    bundle_dir = Path(res["bundle_dir"])
    m = json.loads((bundle_dir / "manifest.json").read_text())
    assert m["schema_version"] == 3
    assert m["model"]["sha256"] == hashlib.sha256(models["transformer_block"].read_bytes()).hexdigest()
    assert m["inputs"] == [{"name": "input", "shape": [1, 16, 32], "dtype": "float32"}]
    assert m["outputs"] == [{"name": "output", "shape": [1, 16, 32], "dtype": "float32"}]
    assert m["precision"] == "fp32" and m["device"]["profile"] == "host"
    assert m["tvm_version"].startswith("0.27") and m["edgeq_version"]
    assert set(m["build"]["stage_seconds"]) >= {"load", "import", "compile", "golden"}
    for name, digest in m["files"].items():
        assert hashlib.sha256((bundle_dir / name).read_bytes()).hexdigest() == digest
    sums = dict(line.split("  ")[::-1] for line in (bundle_dir / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == set(m["files"]) | {"manifest.json"}
    assert set(res) >= {"bundle_dir", "archive", "device", "precision", "stages"}


def test_archive_holds_the_bundle_and_inspect_reads_both(host_bundles, cli):
    res = host_bundles["resnet_cnn"]
    bundle_dir, archive = Path(res["bundle_dir"]), Path(res["archive"])
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    top = bundle_dir.name
    assert names == sorted([top] + [f"{top}/{p.relative_to(bundle_dir).as_posix()}" for p in bundle_dir.rglob("*")])
    assert f"{top}/runtime/edgeq-run" in names
    for target in (bundle_dir, archive):
        res_json = cli("inspect", target, "--json")
        assert res_json.code == 0
        assert json.loads(res_json.stdout)["bundle_id"] == res["bundle_id"]
    table = cli("inspect", archive)
    assert table.code == 0 and res["bundle_id"] in table.stdout and "input float32 1x3x32x32" in table.stdout
    assert "7 conv/matmul calls on edgeq kernels" in table.stdout  # resnet_cnn: 6 convs + the classifier


def test_dynamic_batch_fixed_by_input_shape(models, tmp_path, cli):
    dynamic = tmp_path / "dyn.onnx"
    onnx.save(make_models.mobilenet_cnn(batch="N"), dynamic)
    res = cli("package", dynamic, "--device", "host", "-o", tmp_path / "out", "--input-shape", "input=2x3x32x32",
              "--name", "mnet2", "--json")
    assert res.code == 0, res.stderr
    bundle_dir = tmp_path / "out" / "mnet2-host"
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = run_py(bundle_dir, "--input", f"input={tmp_path / 'x.npy'}", "--output", tmp_path / "o.npz")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["logits"], ort_outputs(dynamic, {"input": x})["logits"],
                               rtol=1e-4, atol=1e-5)


def test_golden_input_for_a_model_defined_on_positive_values(tmp_path):
    """Log(x) is NaN on half of a standard-normal input: the golden input is drawn from uniform(0.5, 1.5)
    instead (recorded in the manifest) and the bundle's self-test passes."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Log", ["x"], ["y"])], "log",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    path = tmp_path / "log.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--runtime", "none")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "log-host"
    assert json.loads((bundle / "manifest.json").read_text())["golden"]["float_inputs"] == "uniform(0.5, 1.5)"
    golden = read_golden(bundle)
    assert golden["input:x"].min() >= 0.5
    np.testing.assert_allclose(golden["output:y"], np.log(golden["input:x"]), rtol=1e-5)
    assert run_py(bundle, "--self-test").returncode == 0
