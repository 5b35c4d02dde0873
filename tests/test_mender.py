"""Mender Artifacts of edgeq bundles, checked by Mender's own tools (Debian's mender-artifact and mender-client).

The real `mender` client installs artifacts in standalone mode on a loopback "device": its data folder, its
/etc/mender and its update modules folder (/usr/share/mender/modules/v3, holding edgeq's module) are folders of
the test, bind-mounted in a private mount namespace (unshare), so nothing of the machine's own is touched.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import rehash, run_cli
from edgeq.mender import write_module_files

MENDER_ARTIFACT = shutil.which("mender-artifact")
MENDER = shutil.which("mender")
needs_artifact_tool = pytest.mark.skipif(MENDER_ARTIFACT is None, reason="mender-artifact not installed (scripts/setup.sh installs it)")


def _can_unshare() -> bool:
    if MENDER is None or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


needs_client = pytest.mark.skipif(not _can_unshare(), reason="needs the mender client, root and mount namespaces (unshare)")


@pytest.fixture(scope="module")
def bundles(models, tmp_path_factory):
    """Two releases of a model for the host (the loopback device runs them), and one whose self-test fails."""
    out = tmp_path_factory.mktemp("bundles")
    made = {}
    # two models under one name: a bundle id is the content's (a rebuild of the same model is the same bundle)
    for label, model, release in (("v1", "mobilenet_cnn", 1), ("v2", "resnet_cnn", 2)):
        res = run_cli("package", models[model], "--device", "host", "-o", out / label, "--name", "mnet",
                      "--release", release, "--json", "-q")
        assert res.code == 0, res.stderr
        made[label] = Path(json.loads(res.stdout)["archive"])
    made["failing"] = _failing_copy(made["v2"].parent / "mnet-host", out / "failing", release=3)
    return made


def _failing_copy(bundle_dir: Path, out: Path, release: int) -> Path:
    """The bundle with wrong golden outputs (so its self-test fails), a new id and release, every hash
    updated (unsigned): a bundle that verifies and installs, and fails on the device."""
    from edgeq.bundle import make_archive

    dst = out / bundle_dir.name
    shutil.copytree(bundle_dir, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    output = next(t for t in manifest["golden"]["tensors"] if t["name"].startswith("output:"))
    data = bytearray((dst / "golden.bin").read_bytes())
    data[output["offset"]: output["offset"] + output["bytes"]] = b"\x00\x00\x40\x46" * (output["bytes"] // 4)
    (dst / "golden.bin").write_bytes(bytes(data))
    manifest["release"] = release
    manifest["bundle_id"] = manifest["bundle_id"][:-12] + "00000000fa11"
    rehash(dst, manifest, ["golden.bin"])
    archive = out / f"{bundle_dir.name}.tar.gz"
    make_archive(dst, archive, mtime=0)
    return archive


def _mender_file(archive: Path, *extra) -> Path:
    out = archive.with_name(archive.name.replace(".tar.gz", ".mender"))
    res = run_cli("mender", archive, "-o", out, "--device-type", "edgeq-test", "--json", *extra)
    assert res.code == 0, res.stderr
    return out


def _tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([MENDER_ARTIFACT, *map(str, args)], capture_output=True, text=True, timeout=120)


@needs_artifact_tool
def test_mender_artifact_validates_and_reads_it(bundles):
    artifact = _mender_file(bundles["v1"])
    assert _tool("validate", artifact).returncode == 0
    shown = _tool("read", artifact)
    assert shown.returncode == 0, shown.stderr
    from edgeq.bundle import read_manifest

    manifest = read_manifest(bundles["v1"])
    text = shown.stdout
    assert f"Name: {manifest.bundle_id}" in text and "Version: 3" in text and "Compatible devices: '[edgeq-test]'" in text
    assert "Type:   edgeq" in text and f"edgeq.mnet.release: {manifest.release}" in text, text
    assert f"edgeq.mnet.bundle_id: {manifest.bundle_id}" in text and 'Clears Provides: ["edgeq.mnet.*"]' in text
    payload = hashlib.sha256(bundles["v1"].read_bytes()).hexdigest()
    assert f"name:     {bundles['v1'].name}" in text and f"checksum: {payload}" in text


def test_device_types_come_from_the_profile(models, tmp_path):
    res = run_cli("package", models["mobilenet_cnn"], "--device", "jetson-orin-nano", "-o", tmp_path, "--runtime", "none",
                  "--mender", "--json", "-q")
    assert res.code == 0, res.stderr
    mender = json.loads(res.stdout)["mender"]
    assert mender["device_types"] == ["jetson-orin-nano-devkit", "jetson-orin-nano-devkit-nvme", "jetson-orin-nano"]
    assert Path(mender["artifact"]).is_file() and mender["payload_type"] == "edgeq"
    with tarfile.open(mender["artifact"]) as outer:
        assert outer.getnames() == ["version", "manifest", "header.tar.gz", "data/0000.tar.gz"]
        with tarfile.open(fileobj=io.BytesIO(outer.extractfile("header.tar.gz").read())) as header:
            info = json.loads(header.extractfile("header-info").read())
    assert info["artifact_depends"]["device_type"] == mender["device_types"]
    assert info["payloads"] == [{"type": "edgeq"}]


def _ecdsa_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A P-256 key pair as PEM files folder/NAME.key and folder/NAME.pub: a key type Mender verifies."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@needs_artifact_tool
def test_signed_for_mender_with_an_ecdsa_key(bundles, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key, pub = _ecdsa_key(tmp_path, "mender")
    other = _ecdsa_key(tmp_path, "other")[1]
    artifact = _mender_file(bundles["v1"], "-k", key)
    assert _tool("validate", "-k", pub, artifact).returncode == 0
    assert _tool("validate", "-k", other, artifact).returncode != 0
    # an ed25519 key (edgeq keygen's) is not one Mender verifies: one line says which kinds are
    (tmp_path / "ed.key").write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    res = run_cli("mender", bundles["v1"], "-o", tmp_path / "x.mender", "-k", tmp_path / "ed.key")
    assert res.code == 2 and "ECDSA P-256 and RSA" in res.stderr and not (tmp_path / "x.mender").exists()


def _tampered(artifact: Path, out: Path) -> Path:
    """The artifact with one byte of the bundle inside its payload changed, the manifest left as it was."""
    with tarfile.open(artifact) as outer:
        members = [(m, outer.extractfile(m).read()) for m in outer.getmembers()]
    patched = []
    for member, data in members:
        if member.name == "data/0000.tar.gz":
            import gzip

            inner = bytearray(gzip.decompress(data))
            inner[len(inner) // 2] ^= 0xFF
            data = gzip.compress(bytes(inner), mtime=0)
            member.size = len(data)
        patched.append((member, data))
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in patched:
            tar.addfile(member, io.BytesIO(data))
    return out


@needs_artifact_tool
def test_a_tampered_artifact_is_refused_by_mender_artifact(bundles, tmp_path):
    bad = _tampered(_mender_file(bundles["v1"]), tmp_path / "bad.mender")
    res = _tool("validate", bad)
    assert res.returncode != 0 and "checksum" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


def test_bad_bundles_are_refused_in_one_line(tmp_path, bundles):
    (tmp_path / "x.tar.gz").write_bytes(b"not a bundle")
    for argv in (("mender", tmp_path / "x.tar.gz"), ("mender", tmp_path / "missing.tar.gz"),
                 ("mender", bundles["v1"], "--device-type", "has space")):
        res = run_cli(*argv)
        assert res.code in (2, 7) and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert not list(tmp_path.glob("*.mender"))
    # the artifact written over its own bundle archive, or into a bundle folder (which then fails verify): refused
    archive = tmp_path / "copy.tar.gz"
    shutil.copy(bundles["v1"], archive)
    before = archive.read_bytes()
    folder = bundles["v1"].parent / "mnet-host"
    for output, fragment in ((archive, "is the bundle archive itself"), (folder / "x.mender", "inside a bundle folder")):
        res = run_cli("mender", archive, "-o", output)
        assert res.code == 2 and fragment in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert archive.read_bytes() == before and not (folder / "x.mender").exists()
    assert run_cli("verify", folder).code == 0


class Device:
    """A loopback device for the real mender client: data folder, /etc/mender and update modules of its own."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.root = folder / "edgeq"  # the install root edgeq's module installs into (EDGEQ_ROOT)
        for name in ("etc", "data"):
            (folder / name).mkdir(parents=True)
        # what a device installs once (edgeq mender --module-files): the module and, beside it, its verifier
        write_module_files(folder / "overlay")
        self.modules = folder / "overlay" / "usr" / "share" / "mender" / "modules" / "v3"
        self.verifier = folder / "overlay" / "usr" / "share" / "edgeq" / "verifier"
        (folder / "etc" / "artifact_info").write_text("artifact_name=factory\n")
        (folder / "data" / "device_type").write_text("device_type=edgeq-test\n")
        (folder / "mender.conf").write_text("{}\n")
        (folder / "fallback.conf").write_text("{}\n")

    def verify_with(self, public_key: Path) -> None:
        """Mender's own signature check: the client refuses artifacts not signed by this key."""
        (self.folder / "mender.conf").write_text(json.dumps({"ArtifactVerifyKey": str(public_key)}) + "\n")

    def mender(self, *args) -> subprocess.CompletedProcess:
        script = ('mount --bind "$1" /usr/share/mender/modules/v3 && mount --bind "$0/etc" /etc/mender && '
                  'shift && exec mender -c "$0/mender.conf" -b "$0/fallback.conf" -d "$0/data" --no-syslog "$@"')
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(self.folder),
                               str(self.modules), *map(str, args)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "EDGEQ_ROOT": str(self.root), "EDGEQ_VERIFIER": str(self.verifier)})

    def current(self) -> str | None:
        link = self.root / "current"
        return Path(os.readlink(link)).name if link.is_symlink() else None

    def provides(self) -> str:
        return self.mender("show-provides").stdout


@needs_client
def test_the_mender_client_installs_commits_and_rolls_back_a_failing_self_test(bundles, tmp_path):
    from edgeq.bundle import read_manifest

    device = Device(tmp_path / "device")
    v1, v2, failing = (read_manifest(bundles[k]) for k in ("v1", "v2", "failing"))

    res = device.mender("install", _mender_file(bundles["v1"]))
    assert res.returncode == 0, res.stderr
    assert (device.root / "releases" / v1.bundle_id).is_dir() and device.current() is None  # installed, not yet current
    res = device.mender("commit")
    assert res.returncode == 0, res.stderr
    assert device.current() == v1.bundle_id
    assert f"edgeq.mnet.release={v1.release}" in device.provides()

    assert device.mender("install", _mender_file(bundles["v2"])).returncode == 0
    assert device.mender("commit").returncode == 0
    assert device.current() == v2.bundle_id
    provides = device.provides()
    assert f"artifact_name={v2.bundle_id}" in provides and f"edgeq.mnet.release={v2.release}" in provides
    assert f"edgeq.mnet.release={v1.release}" not in provides  # cleared by the new artifact

    # a release whose self-test fails: the commit fails, Mender rolls back, current is unchanged
    assert device.mender("install", _mender_file(bundles["failing"])).returncode == 0
    res = device.mender("commit")
    assert "Rolling back" in res.stdout + res.stderr, res.stdout + res.stderr
    assert device.current() == v2.bundle_id
    assert f"artifact_name={v2.bundle_id}" in device.provides()
    state = json.loads((device.root / "state.json").read_text())
    assert state["current"] == v2.bundle_id and state["models"]["mnet"]["release"] == v2.release, state
    check = subprocess.run([str(device.root / "current" / "runtime" / "edgeq-run"), "--self-test"],
                           cwd=device.root / "current", capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert failing.release == 3

    # anti-rollback: an older release of the model is refused at ArtifactInstall, current unchanged
    res = device.mender("install", _mender_file(bundles["v1"]))
    assert res.returncode != 0 and device.current() == v2.bundle_id


@needs_client
def test_the_mender_client_refuses_a_tampered_artifact(bundles, tmp_path):
    device = Device(tmp_path / "device")
    bad = _tampered(_mender_file(bundles["v1"]), tmp_path / "bad.mender")
    res = device.mender("install", bad)
    assert res.returncode != 0 and "checksum" in res.stderr.lower(), res.stderr
    assert device.current() is None and not (device.root / "releases").exists()


@needs_client
def test_the_first_release_failing_leaves_no_current(bundles, tmp_path):
    device = Device(tmp_path / "device")
    assert device.mender("install", _mender_file(bundles["failing"])).returncode == 0
    res = device.mender("commit")
    assert "Rolling back" in res.stdout + res.stderr, res.stdout + res.stderr
    assert device.current() is None and not list((device.root / "releases").iterdir())
    assert json.loads((device.root / "state.json").read_text())["models"] == {}


@needs_client
def test_the_mender_client_checks_the_artifact_signature(bundles, tmp_path):
    key, pub = _ecdsa_key(tmp_path, "mender")
    device = Device(tmp_path / "device")
    device.verify_with(pub)
    unsigned = _mender_file(bundles["v1"])
    res = device.mender("install", unsigned)
    assert res.returncode != 0 and not (device.root / "releases").exists(), res.stderr
    signed = _mender_file(bundles["v1"], "-k", key)
    res = device.mender("install", signed)
    assert res.returncode == 0, res.stderr
    assert device.mender("commit").returncode == 0 and device.current() is not None


def _hostile_verifier_copy(bundle_dir: Path, out: Path, marker: Path) -> Path:
    """The bundle with its safebundle.py replaced by code that leaves ``marker`` and claims success, every
    hash updated (unsigned): what a forged payload carries to run its own code as root."""
    from edgeq.bundle import make_archive

    dst = out / bundle_dir.name
    shutil.copytree(bundle_dir, dst)
    (dst / "safebundle.py").write_text(
        f"import json, pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "print(json.dumps({'bundle_id': 'forged', 'release': 99}))\n")
    rehash(dst, json.loads((dst / "manifest.json").read_text()), ["safebundle.py"])
    archive = out / f"{bundle_dir.name}.tar.gz"
    make_archive(dst, archive, mtime=0)
    return archive


@needs_client
def test_a_payload_verifier_never_runs_on_the_first_install(bundles, tmp_path):
    """The module verifies with the verifier installed with it: a payload carrying its own safebundle.py
    (as root, on a device with no release yet) does not get it run, before or after it is installed."""
    marker = tmp_path / "payload-code-ran"
    forged = _hostile_verifier_copy(bundles["v1"].parent / "mnet-host", tmp_path / "forged", marker)
    device = Device(tmp_path / "device")
    res = device.mender("install", _mender_file(forged))
    assert not marker.exists(), res.stderr
    if res.returncode == 0:  # unsigned and consistent: installed by edgeq's verifier, as the bundle it is
        assert device.mender("commit").returncode == 0
    assert not marker.exists()
    assert "forged" not in (device.current() or "")


@needs_client
def test_without_its_verifier_the_module_refuses_in_one_line(bundles, tmp_path):
    device = Device(tmp_path / "device")
    shutil.rmtree(device.verifier)
    res = device.mender("install", _mender_file(bundles["v1"]))
    assert res.returncode != 0
    assert "verifier is not installed" in res.stdout + res.stderr, res.stdout + res.stderr
    assert device.current() is None and not (device.root / "releases").exists()


def test_module_files_are_the_module_and_its_verifier(tmp_path):
    res = run_cli("mender", "--module-files", tmp_path / "overlay", "--json")
    assert res.code == 0, res.stderr
    files = sorted(Path(f).relative_to(tmp_path / "overlay").as_posix() for f in json.loads(res.stdout)["module_files"])
    assert files == ["usr/share/edgeq/verifier/contract.py", "usr/share/edgeq/verifier/safebundle.py",
                     "usr/share/mender/modules/v3/edgeq"]
    assert os.access(tmp_path / "overlay" / files[2], os.X_OK)
    # the module reads no verifier from a payload or a release folder
    text = (tmp_path / "overlay" / files[2]).read_text()
    assert "tar.extractfile" not in text and "current/safebundle.py" not in text
    res = run_cli("mender", "--module-files", tmp_path / "overlay", tmp_path / "x.tar.gz")
    assert res.code == 2 and "without a bundle" in res.stderr
