"""Trust: signatures, safe unpacking, anti-rollback, hostile archives and models, and a fuzz test.
Every hostile input is built here; each test checks the refusal and that nothing escaped the temp dir."""

import io
import json
import os
import random
import shutil
import stat
import subprocess
import tarfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import edgeq.model_guard
from conftest import run_cli, run_py
from edgeq.templates.safebundle import BundleRefused, safe_extract, verify_dir


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("keys")
    res = run_cli("keygen", "--out", out / "a", "--json")
    assert res.code == 0, res.stderr
    run_cli("keygen", "--out", out / "b")
    return {"a": (out / "a" / "edgeq_signing.key", out / "a" / "edgeq_signing.pub"),
            "b": (out / "b" / "edgeq_signing.key", out / "b" / "edgeq_signing.pub")}


def build(model, out, *extra):
    res = run_cli("package", model, "--device", "host", "-o", out, "-q", "--json", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def signed(models, keys, tmp_path_factory):
    """Two signed bundles of different models, and an unsigned one."""
    out = tmp_path_factory.mktemp("signed")
    return {
        "resnet": build(models["resnet_cnn"], out / "r", "--sign-key", keys["a"][0], "--release", "7"),
        "mobilenet": build(models["mobilenet_cnn"], out / "m", "--sign-key", keys["a"][0], "--release", "7"),
        "unsigned": build(models["resnet_cnn"], out / "u", "--release", "7"),
    }


def copy_bundle(result, tmp_path) -> Path:
    dst = tmp_path / Path(result["bundle_dir"]).name
    shutil.copytree(result["bundle_dir"], dst)
    return dst


def refused(res, *fragments):
    lines = res.stderr.strip().splitlines()
    assert res.code == 7 and len(lines) == 1 and "refused" in lines[0], res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- keys and signatures -------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_only_the_owner_reads(keys, tmp_path):
    private, public = keys["a"]
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and b"PUBLIC KEY" in public.read_bytes()
    again = run_cli("keygen", "--out", private.parent)
    assert again.code == 2 and "never overwritten" in again.stderr


def test_signed_bundle_verifies_as_directory_and_archive(signed, keys):
    for target in (signed["resnet"]["bundle_dir"], signed["resnet"]["archive"]):
        res = run_cli("verify", target, "--pub", keys["a"][1], "--json")
        assert res.code == 0, res.stderr
        assert json.loads(res.stdout)["signature"] == "verified"


def test_wrong_key_and_unsigned_are_refused(signed, keys):
    refused(run_cli("verify", signed["resnet"]["archive"], "--pub", keys["b"][1]), "not by the configured key")
    refused(run_cli("verify", signed["unsigned"]["archive"], "--pub", keys["a"][1]), "not signed")


def test_file_changed_after_signing(signed, keys, tmp_path):
    bundle = copy_bundle(signed["resnet"], tmp_path)
    with open(bundle / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    refused(run_cli("verify", bundle, "--pub", keys["a"][1]), "weights.bin does not match the manifest")
    # Updating the manifest's hash to match breaks the signature instead.
    manifest = json.loads((bundle / "manifest.json").read_text())
    import hashlib

    manifest["files"]["weights.bin"] = hashlib.sha256((bundle / "weights.bin").read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    refused(run_cli("verify", bundle, "--pub", keys["a"][1]), "signature does not match manifest.json")


def test_files_mixed_from_two_signed_bundles(signed, keys, tmp_path):
    bundle = copy_bundle(signed["resnet"], tmp_path)
    shutil.copy(Path(signed["mobilenet"]["bundle_dir"], "model.so"), bundle / "model.so")
    refused(run_cli("verify", bundle, "--pub", keys["a"][1]), "model.so does not match the manifest")


def test_signature_over_a_different_manifest(signed, keys, tmp_path):
    bundle = copy_bundle(signed["resnet"], tmp_path)
    shutil.copy(Path(signed["mobilenet"]["bundle_dir"], "manifest.sig"), bundle / "manifest.sig")
    refused(run_cli("verify", bundle, "--pub", keys["a"][1]), "signature does not match manifest.json")


def test_truncated_archive(signed, tmp_path):
    data = Path(signed["resnet"]["archive"]).read_bytes()
    truncated = tmp_path / "t.tar.gz"
    truncated.write_bytes(data[: len(data) // 2])
    refused(run_cli("verify", truncated), "damaged or truncated")


@pytest.mark.parametrize("change,message", [
    (lambda m: m.pop("release"), "field 'release' is missing"),
    (lambda m: m.update(release="7"), "field 'release' is not a count"),
    (lambda m: m.update(files=[]), "field 'files' is not an object"),
    (lambda m: m["inputs"][0].update(shape="1x3"), "field 'inputs[0].shape' is not a list"),
    (lambda m: m["files"].update({"../evil": "0" * 64}), "'files' and 'sizes' must name the same files"),
])
def test_manifest_with_wrong_types_or_missing_fields(signed, tmp_path, change, message):
    bundle = copy_bundle(signed["unsigned"], tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    change(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    refused(run_cli("verify", bundle), message)


# ---- hostile archives ----------------------------------------------------------------------------------


def _members(result) -> list[tuple[str, bytes]]:
    """(name, data) of a real bundle, manifest first, as edgeq writes them."""
    bundle = Path(result["bundle_dir"])
    names = ["manifest.json"] + sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                                       if p.is_file() and p.name != "manifest.json")
    return [(f"{bundle.name}/{n}", (bundle / n).read_bytes()) for n in names]


def _tar(path: Path, members, extra=()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, None


HOSTILE = {
    "dotdot": (lambda top: [(f"{top}/../../evil.txt", b"x")], "unsafe path"),
    "absolute": (lambda top: [("/tmp/edgeq-evil.txt", b"x")], "unsafe path"),
    "not_listed": (lambda top: [(f"{top}/extra.py", b"print('x')")], "does not list: extra.py"),
    "duplicate": (lambda top: [(f"{top}/run.py", b"print('owned')")], "has the member run.py twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_members(signed, tmp_path, case):
    members = _members(signed["unsigned"])
    top = members[0][0].split("/")[0]
    build_extra, message = HOSTILE[case]
    archive = _tar(tmp_path / f"{case}.tar.gz", members + build_extra(top))
    refused(run_cli("verify", archive), message)
    assert not (tmp_path.parent / "evil.txt").exists() and not Path("/tmp/edgeq-evil.txt").exists()


@pytest.mark.parametrize("kind,message", [(tarfile.SYMTYPE, "link or device"), (tarfile.LNKTYPE, "link or device"),
                                          (tarfile.CHRTYPE, "link or device"), (tarfile.FIFOTYPE, "link or device")])
def test_links_and_devices_are_refused(signed, tmp_path, kind, message):
    members = _members(signed["unsigned"])
    top = members[0][0].split("/")[0]
    archive = _tar(tmp_path / "special.tar.gz", members[:1], [_special(f"{top}/run.py", kind, "/etc/passwd")])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(BundleRefused, match=message):
        safe_extract(archive, dest)
    assert not any(p.is_symlink() for p in dest.rglob("*"))


def test_manifest_must_come_first_and_sizes_must_match(signed, tmp_path):
    members = _members(signed["unsigned"])
    refused(run_cli("verify", _tar(tmp_path / "order.tar.gz", members[1:] + members[:1])), "does not start with manifest.json")
    grown = [(n, d + b"more" if n.endswith("weights.bin") else d) for n, d in members]
    refused(run_cli("verify", _tar(tmp_path / "grown.tar.gz", grown)), "weights.bin has", "the manifest declares")


def test_gzip_bomb_is_refused_before_its_data_is_read(signed, tmp_path):
    members = _members(signed["unsigned"])
    top = members[0][0].split("/")[0]
    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tar:
        for name, data in members[:1]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"{top}/model.so")
        info.size = 64 << 20  # 64 MiB of zeros: compresses to ~64 KiB
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    assert bomb.stat().st_size < 1 << 20
    refused(run_cli("verify", bomb), "model.so has 67108864 bytes, the manifest declares")


def test_more_members_than_declared(signed, tmp_path):
    members = _members(signed["unsigned"])
    top = members[0][0].split("/")[0]
    many = members + [(f"{top}/f{i}", b"") for i in range(80)]
    refused(run_cli("verify", _tar(tmp_path / "many.tar.gz", many)), "does not list")


# ---- install: anti-rollback and the loader ------------------------------------------------------------


def test_anti_rollback(models, keys, tmp_path):
    new = build(models["mobilenet_cnn"], tmp_path / "new", "--sign-key", keys["a"][0], "--release", "10")
    old = build(models["mobilenet_cnn"], tmp_path / "old", "--sign-key", keys["a"][0], "--release", "9")
    root = tmp_path / "root"
    first = run_cli("install", new["archive"], "--root", root, "--pub", keys["a"][1], "--json")
    assert first.code == 0, first.stderr
    assert os.path.realpath(root / "current") == json.loads(first.stdout)["path"]
    # installed from the archive, the native loader stays executable and runs the bundle through `current`
    loader = subprocess.run([str(root / "current" / "runtime" / "edgeq-run"), "--self-test"], capture_output=True,
                            text=True, env={"PATH": "/usr/bin:/bin", "EDGEQ_TRUSTED_KEY": str(keys["a"][1])})
    assert loader.returncode == 0 and "self-test passed" in loader.stdout, loader.stderr
    again = run_cli("install", new["archive"], "--root", root, "--pub", keys["a"][1], "--json")
    assert json.loads(again.stdout)["already"] is True
    refused(run_cli("install", old["archive"], "--root", root, "--pub", keys["a"][1]),
            "release 9 of mobilenet_cnn is older than the installed release 10", "--allow-downgrade")
    assert os.path.realpath(root / "current") == json.loads(first.stdout)["path"]
    down = run_cli("install", old["archive"], "--root", root, "--pub", keys["a"][1], "--allow-downgrade", "--json")
    assert down.code == 0 and os.path.realpath(root / "current") == json.loads(down.stdout)["path"]
    assert not any(p.name.startswith(".staging") for p in root.iterdir())


def test_loader_with_a_trusted_key_refuses_unsigned_and_foreign_bundles(signed, keys):
    env = {"EDGEQ_TRUSTED_KEY": str(keys["a"][1])}
    ok = run_py(Path(signed["resnet"]["bundle_dir"]), "--check", env=env)
    assert ok.returncode == 0, ok.stderr
    unsigned = run_py(Path(signed["unsigned"]["bundle_dir"]), "--check", env=env)
    assert unsigned.returncode == 7 and "bundle is not signed" in unsigned.stderr
    foreign = run_py(Path(signed["resnet"]["bundle_dir"]), "--check", env={"EDGEQ_TRUSTED_KEY": str(keys["b"][1])})
    assert foreign.returncode == 7 and "not by the configured key" in foreign.stderr


# ---- hostile models ------------------------------------------------------------------------------------


def _model(nodes, inputs=None, inits=(), opset=17, outputs=None):
    graph = helper.make_graph(nodes, "g", inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _external(tmp_path, location) -> Path:
    w = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    w.external_data.add(key="length", value="16")
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    path = folder / "m.onnx"
    path.write_bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])], inits=[w]).SerializeToString())
    return path


def package_refused(path, tmp_path, *fragments):
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q")
    lines = res.stderr.strip().splitlines()
    assert res.code == 3 and len(lines) == 1, res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_external_data_outside_the_model_folder(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 16)
    package_refused(_external(tmp_path, "../secret.bin"), tmp_path, "outside the model's folder")
    package_refused(_external(tmp_path, str(tmp_path / "secret.bin")), tmp_path, "outside the model's folder")


def test_external_data_through_a_symlink(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 16)
    path = _external(tmp_path, "weights.bin")
    (path.parent / "weights.bin").symlink_to(tmp_path / "secret.bin")
    package_refused(path, tmp_path, "through a symlink")


def test_huge_declared_dimensions(tmp_path):
    big = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1 << 40])]
    path = tmp_path / "huge.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])], inputs=big,
                     outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1 << 40])]), path)
    package_refused(path, tmp_path, "declares a dimension of 1099511627776")


def test_cyclic_and_dangling_graphs(tmp_path):
    cyclic = _model([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
                     helper.make_node("Relu", ["a"], ["y"])])
    onnx.save(cyclic, tmp_path / "cyclic.onnx")
    package_refused(tmp_path / "cyclic.onnx", tmp_path, "cycle through 'b'")
    dangling = _model([helper.make_node("Add", ["x", "nothere"], ["y"])])
    onnx.save(dangling, tmp_path / "dangling.onnx")
    package_refused(tmp_path / "dangling.onnx", tmp_path, "input 'nothere'", "dangling edge")


def test_unknown_opset(tmp_path):
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])], opset=999), tmp_path / "opset.onnx")
    package_refused(tmp_path / "opset.onnx", tmp_path, "declares ONNX opset 999")


def test_model_check_runs_in_a_limited_child(models, tmp_path, monkeypatch):
    monkeypatch.setattr(edgeq.model_guard, "MEMORY_BYTES", 40 << 20)  # too little to even import onnx
    package_refused(models["resnet_cnn"], tmp_path, "resnet_cnn.onnx: checking the model needed more than 40 MB")
    monkeypatch.setattr(edgeq.model_guard, "MEMORY_BYTES", 8 << 30)
    monkeypatch.setattr(edgeq.model_guard, "TIMEOUT_S", 0.001)
    package_refused(models["resnet_cnn"], tmp_path, "took longer than")


def test_security_pins_are_installed():
    def v(name):
        return tuple(int(x) for x in version(name).split(".")[:2])

    assert v("paramiko") >= (3, 4) and v("onnx") >= (1, 21)


# ---- fuzz ----------------------------------------------------------------------------------------------


def test_fuzz_archive_and_manifest_bytes(signed, keys, tmp_path):
    """Random byte mutations of a signed archive and of a bundle's manifest: every result is a clean refusal
    or a bundle that verifies (all files as signed); nothing lands outside the scratch folders."""
    from edgeq.signing import load_public_key

    key = load_public_key(keys["a"][1])
    rng = random.Random(1234)
    data = bytearray(Path(signed["resnet"]["archive"]).read_bytes())
    outcomes = {"refused": 0, "verified": 0}
    for i in range(150):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        archive = tmp_path / f"f{i}.tar.gz"
        archive.write_bytes(bytes(mutated))
        dest = tmp_path / f"d{i}"
        dest.mkdir()
        try:
            verify_dir(safe_extract(archive, dest), key)
            outcomes["verified"] += 1
        except BundleRefused:
            outcomes["refused"] += 1
        shutil.rmtree(dest)
        archive.unlink()
    bundle = copy_bundle(signed["resnet"], tmp_path)
    text = (bundle / "manifest.json").read_bytes()
    for i in range(60):
        mutated = bytearray(text)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.choice(b'{}[]":,0123456789abcdefxyz \\n')
        (bundle / "manifest.json").write_bytes(bytes(mutated))
        try:
            verify_dir(bundle, key)
            outcomes["verified"] += 1
            assert bytes(mutated) == text
        except BundleRefused:
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 180, outcomes
    assert sorted(p.name for p in tmp_path.iterdir()) == [bundle.name]
