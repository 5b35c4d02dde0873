"""Hostile and broken bundles against every verb that reads one: verify, install, inspect, run.py and
edgeq-run. Each case: one line, the documented exit code (7 for edgeq's bundle verbs, 2 for the loaders),
nothing written, no state changed."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli, run_py

DEEP = "[" * 100000 + "]" * 100000


def package(model, out, *extra) -> dict:
    res = run_cli("package", model, "--device", "host", "-o", out, "-q", "--json", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("keys")
    assert run_cli("keygen", "--out", out).code == 0
    return out / "edgeq_signing.key", out / "edgeq_signing.pub"


@pytest.fixture(scope="module")
def bundles(models, keys, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    return {"signed": package(models["resnet_cnn"], out / "s", "--sign-key", keys[0], "--release", "5"),
            "unsigned": package(models["resnet_cnn"], out / "u", "--release", "5"),
            "older": package(models["resnet_cnn"], out / "o", "--sign-key", keys[0], "--release", "4")}


def refused(res, code: int, *fragments: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.code == code and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def members(bundle_dir: Path) -> list[tuple[str, bytes]]:
    names = ["manifest.json", "manifest.sig"] if (bundle_dir / "manifest.sig").exists() else ["manifest.json"]
    names += sorted(p.relative_to(bundle_dir).as_posix() for p in bundle_dir.rglob("*")
                    if p.is_file() and p.name not in ("manifest.json", "manifest.sig"))
    return [(f"{bundle_dir.name}/{n}", (bundle_dir / n).read_bytes()) for n in names]


def write_tar(path: Path, entries, pax: dict | None = None) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for i, (name, data) in enumerate(entries):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if pax and i == 0:
                info.pax_headers = pax
            tar.addfile(info, io.BytesIO(data))
    return path


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---- verify / install: what an archive can make them do before the signature is checked ----------------


def test_unsigned_archive_declaring_a_huge_file_is_refused_before_any_data(bundles, keys, tmp_path):
    """The manifest declares a 256 MiB weights file; with a key given, the missing signature is found
    at the second member, before one byte of the big member is read or written."""
    entries = members(Path(bundles["unsigned"]["bundle_dir"]))
    manifest = json.loads(entries[0][1])
    manifest["sizes"]["weights.bin"] = 256 << 20
    entries[0] = (entries[0][0], json.dumps(manifest).encode())
    archive = write_tar(tmp_path / "big.tar.gz", entries)
    root = tmp_path / "root"
    start = time.monotonic()
    refused(run_cli("install", archive, "--root", root, "--pub", keys[1]), 7, "not signed")
    refused(run_cli("verify", archive, "--pub", keys[1]), 7, "not signed")
    assert time.monotonic() - start < 30 and not root.exists()  # a refused first install leaves no folders


def test_changed_manifest_is_refused_at_the_signature_before_other_members(bundles, keys, tmp_path):
    entries = members(Path(bundles["signed"]["bundle_dir"]))
    manifest = json.loads(entries[0][1])
    manifest["release"] = 99
    entries[0] = (entries[0][0], json.dumps(manifest).encode())
    refused(run_cli("verify", write_tar(tmp_path / "x.tar.gz", entries), "--pub", keys[1]), 7, "signature does not match")


def test_pax_header_bomb_is_refused_without_reading_it(bundles, tmp_path):
    """A 4 MB extended header (python's tarfile would read it whole, at any size) is refused from its size."""
    entries = members(Path(bundles["unsigned"]["bundle_dir"]))
    archive = write_tar(tmp_path / "pax.tar.gz", entries, pax={"comment": "x" * (4 << 20)})
    for verb in (["verify", archive], ["inspect", archive], ["install", archive, "--root", tmp_path / "r"]):
        refused(run_cli(*verb), 7, "extended header of", "more than 8192")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("where", ["manifest", "signature"])
def test_deeply_nested_json(bundles, keys, tmp_path, where):
    bundle = tmp_path / "b"
    shutil.copytree(bundles["signed"]["bundle_dir"], bundle)
    (bundle / ("manifest.json" if where == "manifest" else "manifest.sig")).write_text(DEEP)
    refused(run_cli("verify", bundle, "--pub", keys[1]), 7, "nests deeper than 64" if where == "manifest" else "malformed")
    if where == "manifest":
        refused(run_cli("inspect", bundle), 7, "nests deeper than 64")
    proc = run_py(bundle, "--check", env={"EDGEQ_TRUSTED_KEY": str(keys[1])})
    assert proc.returncode == 7 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("change,message", [
    (lambda m: m["library"].__setitem__("file", ["model.so"]), "'library.file' is not text"),
    (lambda m: m["golden"].__setitem__("file", {"x": 1}), "'golden.file' is not text"),
    (lambda m: m["weights"].__setitem__("tensors", [{"name": "w"}]), "'weights.tensors[0].dtype' is missing"),
    (lambda m: m["library"].__setitem__("file", "other.so"), "library.file is not one of the bundle's files"),
    (lambda m: m.__setitem__("runtime", {"loader": 5, "libraries": []}), "runtime.loader"),
    (lambda m: [m.pop(k) for k in list(m) if k != "schema_version"], "is missing"),
])
def test_type_confused_manifest(bundles, tmp_path, change, message):
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    change(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    refused(run_cli("verify", bundle), 7, message)
    refused(run_cli("inspect", bundle), 7)
    proc = run_py(bundle, "--check")
    assert proc.returncode == 7 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---- install: anti-rollback fails closed ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "deep", "models-list", "release-text", "directory"])
def test_damaged_state_refuses_a_downgrade_and_repair_restores_the_floor(bundles, keys, tmp_path, damage):
    root = tmp_path / "root"
    first = run_cli("install", bundles["signed"]["archive"], "--root", root, "--pub", keys[1])
    assert first.code == 0, first.stderr
    state = root / "state.json"
    good = json.loads(state.read_text())
    if damage == "directory":
        state.unlink()
        state.mkdir()
    else:
        state.write_text({"garbage": "{not json", "deep": DEEP, "models-list": json.dumps({"models": []}),
                          "release-text": json.dumps({"models": {"resnet_cnn": {"release": "9", "bundle_id": "x"}}})}[damage])
    before = tree(root)
    refused(run_cli("install", bundles["older"]["archive"], "--root", root, "--pub", keys[1]), 7,
            "state.json is damaged", "edgeq install --repair-state --root")
    assert tree(root) == before  # nothing unpacked, current unchanged
    if damage == "directory":
        state.rmdir()
    repaired = run_cli("install", "--repair-state", "--root", root, "--json")
    assert repaired.code == 0, repaired.stderr
    assert json.loads(repaired.stdout)["models"] == good["models"]
    refused(run_cli("install", bundles["older"]["archive"], "--root", root, "--pub", keys[1]), 7,
            "release 4 of resnet_cnn is older than the installed release 5")


def test_install_cli_needs_a_bundle_or_repair(tmp_path):
    refused(run_cli("install", "--root", tmp_path / "r"), 2, "give the bundle .tar.gz")


# ---- the loaders: careless input ------------------------------------------------------------------------


def test_run_py_and_edgeq_run_refuse_careless_input(bundles, tmp_path):
    bundle = Path(bundles["unsigned"]["bundle_dir"])
    loader = bundle / "runtime" / "edgeq-run"
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3, 200000, 200000), }".ljust(127) + b"\n"
    bomb = tmp_path / "bomb.npy"
    bomb.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)  # 480 GB claimed
    good = tmp_path / "x.npy"
    np.save(good, np.zeros((1, 3, 32, 32), np.float32))
    cases = [
        (["--input", f"input={empty}"], "cannot read --input"),
        (["--input", f"input={bomb}"], "EDGEQ_MAX_INPUT_BYTES"),
        (["--input", f"input={good}", "--output", str(tmp_path / "no" / "such" / "dir" / "o.npz")], "cannot write"),
        (["--benchmark", "1000000000000"], "1000000"),
        (["--benchmark", "5", "--warmup", "-1"], "--warmup"),
    ]
    for args, fragment in cases:
        for name, cmd in (("run.py", None), ("edgeq-run", [str(loader)])):
            proc = run_py(bundle, *args) if cmd is None else subprocess.run(cmd + args, capture_output=True, text=True)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, args, proc.stderr)
            assert fragment in lines[-1], (name, args, proc.stderr)
    assert not (tmp_path / "no").exists()


def test_markup_from_a_manifest_is_shown_as_text(bundles, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["model"]["file"] = "[/x][bold]model"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli("inspect", bundle)
    assert res.code == 0 and "[/x][bold]model" in res.stdout, res.stderr


@pytest.mark.parametrize("damage,fragment", [
    ("schema-twice", "duplicate key"),  # schema_version 3, then 2: read first-wins by one parser, last-wins by another
    ("device-twice", "duplicate key"),
    ("invalid-utf8", "UTF-8"),
    ("surrogate-utf8", "UTF-8"),  # an encoded surrogate (ED A0 80): strict UTF-8 has none
    ("overlong-utf8", "UTF-8"),  # '/' as two bytes (C0 AF)
])
def test_every_reader_refuses_a_manifest_that_could_be_read_two_ways(bundles, tmp_path, damage, fragment):
    """The manifest is what the signature covers, so every reader must see the same document: duplicate keys and
    bytes that are not strict UTF-8 are refused by edgeq verify, run.py and edgeq-run alike (exit 7, one line)."""
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    text = (bundle / "manifest.json").read_bytes()
    if damage == "schema-twice":
        text = text.replace(b'"schema_version": 3,', b'"schema_version": 3, "schema_version": 2,', 1)
    elif damage == "device-twice":
        device = json.dumps(json.loads(text)["device"]).encode()
        text = text.replace(b'"device": {', b'"device": ' + device + b', "device": {', 1)
    else:
        bad = {"invalid-utf8": b"\xff", "surrogate-utf8": b"\xed\xa0\x80", "overlong-utf8": b"\xc0\xaf"}[damage]
        text = text.replace(b'"name": "', b'"name": "' + bad, 1)
    assert text != (bundle / "manifest.json").read_bytes()
    (bundle / "manifest.json").write_bytes(text)
    refused(run_cli("verify", bundle), 7, fragment)
    for cmd in ([sys.executable, str(bundle / "run.py"), "--check"], [str(bundle / "runtime" / "edgeq-run"), "--check"]):
        proc = subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, errors="replace", timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 7 and len(lines) == 1 and fragment in lines[0], (cmd[-2], proc.stderr)


@pytest.mark.parametrize("damage,fragment", [
    ("huge", "beyond the end"),  # 2^39 elements: no reader may allocate 2 TiB before it looks at the file
    ("object", "dtype"),
    ("past-the-end", "beyond the end"),
])
def test_weight_tables_are_checked_before_anything_is_allocated(bundles, tmp_path, damage, fragment):
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry = manifest["weights"]["tensors"][0]
    if damage == "huge":
        entry.update(dtype="float32", shape=[1 << 39], bytes=4 << 39)
    elif damage == "object":
        entry["dtype"] = "object"
    else:
        entry["offset"] = manifest["sizes"]["weights.bin"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    refused(run_cli("verify", bundle), 7, fragment if damage != "object" else "dtype")
    for cmd in ([sys.executable, str(bundle / "run.py"), "--self-test"],
                [str(bundle / "runtime" / "edgeq-run"), "--self-test"]):
        proc = subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 7 and len(lines) == 1 and "Traceback" not in proc.stderr, (cmd[-2], proc.stderr)


def test_a_weight_table_of_another_length_is_refused_by_every_loader_and_bench(bundles, tmp_path):
    """999 weight entries (each a valid range of weights.bin, hashes consistent, unsigned) for a library whose main
    takes 9 arguments: refused with one line and exit 7 before a weight is read, not a TVM argument-count error."""
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    first = manifest["weights"]["tensors"][0]
    manifest["weights"]["tensors"] = [dict(first, name=f"w{i}") for i in range(999)]
    manifest["weights"]["count"] = 999
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    for cmd in ([sys.executable, str(bundle / "run.py"), "--self-test"],
                [str(bundle / "runtime" / "edgeq-run"), "--self-test"]):
        proc = subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 7 and len(lines) == 1 and "manifest lists" in lines[0], (cmd[-2], proc.stderr)
    refused(run_cli("bench", bundle, "--repeat", "2", "--warmup", "0"), 7, "manifest lists 1 inputs and 999 weights")


@pytest.mark.skipif(Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists(),
                    reason="aarch64 binaries run here through binfmt_misc (qemu)")
def test_hand_over_to_another_machines_native_loader_is_one_line(models, tmp_path):
    """run.py in a Python without numpy (-S) hands over to runtime/edgeq-run; for an aarch64 bundle on this x86_64
    machine that cannot execute: exit 4 with one line, as the README promises, not an OSError traceback."""
    import platform

    if platform.machine() == "aarch64":
        pytest.skip("this machine is aarch64 itself")
    res = run_cli("package", models["mobilenet_cnn"], "--device", "arm64-cpu", "-o", tmp_path, "-q", "--json")
    assert res.code == 0, res.stderr
    bundle = Path(json.loads(res.stdout)["bundle_dir"])
    proc = subprocess.run([sys.executable, "-S", str(bundle / "run.py"), "--check"], cwd=bundle, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "aarch64" in lines[0] and platform.machine() in lines[0], lines[0]


def test_outputs_are_never_written_through_a_symbolic_link(bundles, tmp_path):
    """--output FILE.npz that is a link: the link is replaced, its target untouched; --output DIR that is a link:
    refused in one line (the loader often runs as root); the folder the link points to, named, is written. Both
    loaders alike, and both write a folder as NAME.npy files."""
    bundle = Path(bundles["unsigned"]["bundle_dir"])
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32))
    loaders = {"run.py": [sys.executable, str(bundle / "run.py")], "edgeq-run": [str(bundle / "runtime" / "edgeq-run")]}
    for name, cmd in loaders.items():
        work = tmp_path / name
        work.mkdir()
        victim = work / "victim.txt"
        victim.write_text("keep me")
        (work / "out.npz").symlink_to(victim)
        proc = subprocess.run(cmd + ["--input", f"input={x}", "--output", str(work / "out.npz")], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, (name, proc.stderr)
        assert victim.read_text() == "keep me" and not (work / "out.npz").is_symlink(), name
        assert list(np.load(work / "out.npz").files) == ["logits"], name
        target = work / "real"
        target.mkdir()
        (work / "linked").symlink_to(target)
        proc = subprocess.run(cmd + ["--input", f"input={x}", "--output", str(work / "linked")], capture_output=True,
                              text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "symbolic link" in lines[0], (name, proc.stderr)
        assert list(target.iterdir()) == []
        proc = subprocess.run(cmd + ["--input", f"input={x}", "--output", str(target)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and [p.name for p in target.iterdir()] == ["logits.npy"], (name, proc.stderr)
    first, second = (np.load(tmp_path / n / "real" / "logits.npy") for n in loaders)
    assert np.array_equal(first, second)


def test_repair_state_counts_only_real_verified_releases(bundles, keys, tmp_path):
    """A forged release 999 (a copy of a real release with its manifest edited, in a folder named after the forged
    bundle id) and a release folder that is a link out of the root must not set the floor: afterwards the real
    signed release still installs, and the repair says what it skipped."""
    root = tmp_path / "root"
    assert run_cli("install", bundles["signed"]["archive"], "--root", root, "--pub", keys[1]).code == 0
    real = next((root / "releases").iterdir())
    manifest = json.loads((real / "manifest.json").read_text())
    forged_id = manifest["bundle_id"][:-12] + "0000000f0e9e"
    forged = root / "releases" / forged_id
    shutil.copytree(real, forged)
    manifest.update(release=999, bundle_id=forged_id)
    (forged / "manifest.json").write_text(json.dumps(manifest))  # the signature no longer covers it
    outside = tmp_path / "outside"
    shutil.copytree(real, outside)
    (root / "releases" / "linked").symlink_to(outside)
    (root / "state.json").unlink()
    repaired = run_cli("install", "--repair-state", "--root", root, "--pub", keys[1], "--json")
    assert repaired.code == 0, repaired.stderr
    state = json.loads(repaired.stdout)
    assert state["models"] == {"resnet_cnn": {"release": 5, "bundle_id": real.name}}, state
    assert sorted(s["release"] for s in state["skipped"]) == sorted([forged_id, "linked"]), state["skipped"]
    again = run_cli("install", bundles["signed"]["archive"], "--root", root, "--pub", keys[1], "--json")
    assert again.code == 0 and json.loads(again.stdout)["bundle_id"] == real.name, again.stderr
    text = run_cli("install", "--repair-state", "--root", root, "--pub", keys[1])
    assert text.code == 0 and f"skipped {forged_id}" in text.stdout and "skipped linked" in text.stdout


@pytest.mark.parametrize("change,declared", [
    (lambda out: out.update(dtype="float64"), "float64"),  # edgeq-run read 80 bytes of a 40-byte result
    (lambda out: out.update(shape=[out["shape"][0], out["shape"][-1] * 2]), "x"),
])
def test_an_output_the_library_returns_otherwise_is_refused_before_it_is_read(bundles, tmp_path, change, declared):
    """A manifest whose output dtype or shape is not what the library returns: both loaders refuse with one
    line, exit 7, before reading a byte of it by the manifest's size (no read past the result's buffer)."""
    bundle = tmp_path / "b"
    shutil.copytree(bundles["unsigned"]["bundle_dir"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    output = manifest["outputs"][0]
    change(output)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    spec = manifest["inputs"][0]
    np.save(tmp_path / "x.npy", np.zeros(spec["shape"], spec["dtype"]))
    arg = f"{spec['name']}={tmp_path / 'x.npy'}"
    for cmd in ([sys.executable, str(bundle / "run.py"), "--input", arg, "--output", str(tmp_path / "o.npz")],
                [str(bundle / "runtime" / "edgeq-run"), "--input", arg, "--output", str(tmp_path / "o.npz")]):
        proc = subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 7 and len(lines) == 1 and "Traceback" not in proc.stderr, (cmd[0], proc.stderr)
        assert f"the library returns output '{output['name']}' as float32" in lines[0], lines[0]
        assert not (tmp_path / "o.npz").exists()
