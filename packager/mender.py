"""``edgeq mender``: an edgeq bundle as a Mender Artifact, for fleets that update through Mender.

The artifact is format version 3, a module image (what ``mender-artifact write module-image`` writes), written
with the standard library:

    artifact.mender (tar)
      version              {"format": "mender", "version": 3}
      manifest             sha256sum lines of version, header.tar.gz and data/0000/<bundle archive>
      manifest.sig         with a Mender signing key: base64 of its signature over manifest (ECDSA P-256 / RSA)
      header.tar.gz        header-info (payload type "edgeq", artifact_name, device types), headers/0000/type-info
      data/0000.tar.gz     the bundle archive, as it is

The payload type is ``edgeq``: the device runs edgeq's update module (``templates/mender-update-module``,
installed as ``/usr/share/mender/modules/v3/edgeq``), which verifies and installs the bundle with the bundle
tools edgeq flash uses, switches ``current`` on commit after the bundle's self-test, and switches back on
rollback. ``artifact_name`` is the bundle id; the artifact provides ``edgeq.<model>.release`` and
``edgeq.<model>.bundle_id`` (and clears the model's earlier ones), so Mender's inventory shows what each
device runs.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

from edgeq import templates
from edgeq.bundle import read_manifest
from edgeq.errors import BundleError, OutputError, UsageError

PAYLOAD_TYPE = "edgeq"
MODULE = Path(templates.__file__).with_name("mender-update-module")  # what a device installs as MODULE_PATH_ON_DEVICE
MODULE_PATH_ON_DEVICE = "/usr/share/mender/modules/v3/edgeq"
# the module's own verifier, installed with it: the module never runs a payload's code to verify the payload
VERIFIER_PATH_ON_DEVICE = "/usr/share/edgeq/verifier"
VERIFIER_FILES = ("safebundle.py", "contract.py")
# Mender's artifact names and device types: what mender-artifact accepts (no whitespace, no quotes)
TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}")


@dataclasses.dataclass
class MenderArgs:
    bundle: Path  # a bundle archive (.tar.gz)
    output: Path
    device_types: tuple[str, ...] = ()  # default: the profile's (targets/*.toml [mender] device_types)
    artifact_name: str | None = None  # default: the bundle id
    key: Path | None = None  # PEM private key Mender can verify (ECDSA P-256 or RSA): writes manifest.sig
    bundle_key: Path | None = None  # ed25519 public key the bundle must be signed with (checked before wrapping)


@dataclasses.dataclass(frozen=True)
class MenderResult:
    artifact: Path
    artifact_name: str
    device_types: list[str]
    provides: dict[str, str]
    payload: str
    signed: bool
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "artifact": str(self.artifact), "payload_type": PAYLOAD_TYPE,
                "update_module": MODULE_PATH_ON_DEVICE}


def device_types_for(profile_name: str) -> list[str]:
    """The Mender device types of a profile: its ``[mender] device_types`` (the board names Mender images of
    that device report, meta-tegra's MACHINE names), then the profile's own name."""
    from edgeq.targets import profiles

    profile = profiles().get(profile_name)
    types = list(profile.mender_device_types) if profile is not None else []
    return types + [profile_name] if profile_name not in types else types


def write_module_files(root: Path) -> list[Path]:
    """The update module and its verifier under ``root``, laid out as on the device (a root file system
    overlay for mender-convert or a Yocto layer): ``root/usr/share/mender/modules/v3/edgeq`` (mode 755) and
    ``root/usr/share/edgeq/verifier/{safebundle.py,contract.py}`` (mode 644). Returns the files written."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"--module-files {root} is a file; give a folder to write the overlay into")
    files = [(MODULE, MODULE_PATH_ON_DEVICE, 0o755)]
    files += [(MODULE.with_name(name), f"{VERIFIER_PATH_ON_DEVICE}/{name}", 0o644) for name in VERIFIER_FILES]
    written = []
    try:
        for source, on_device, mode in files:
            path = root / on_device.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(source.read_bytes())
            tmp.chmod(mode)
            os.replace(tmp, path)
            written.append(path)
    except OSError as err:
        raise OutputError(f"cannot write the update module under {root}: {err.strerror or err}") from None
    return written


def _verified(bundle: Path, public_key_path: Path | None):
    """The bundle's manifest once every file is checked against it (and its signature, with a key): what
    the artifact carries is what the update module will accept."""
    import tempfile

    from edgeq.templates.safebundle import BundleRefused, open_bundle
    from edgeq.signing import load_public_key

    read_manifest(bundle)  # a readable bundle archive at all (one line otherwise)
    key = load_public_key(public_key_path) if public_key_path is not None else None
    with tempfile.TemporaryDirectory(prefix="edgeq-mender-") as tmp:
        try:
            return open_bundle(bundle, tmp, key)[1]
        except BundleRefused as err:
            raise BundleError(f"{bundle}: refused: {err}") from None


def _load_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as err:
        raise UsageError(f"cannot read the Mender signing key {path}: {err.strerror}") from None
    except (ValueError, TypeError) as err:
        raise UsageError(f"{path} is not an unencrypted PEM private key ({str(err).splitlines()[0]})") from None
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1":
        return key
    if isinstance(key, rsa.RSAPrivateKey):
        return key
    raise UsageError(f"{path}: Mender verifies ECDSA P-256 and RSA signatures only (this key is "
                     f"{type(key).__name__.removeprefix('_')}); make one with: openssl ecparam -genkey -name prime256v1 "
                     "-noout | openssl pkcs8 -topk8 -nocrypt -out mender.key")


def _sign(manifest: bytes, key) -> bytes:
    """What mender-artifact writes as manifest.sig: base64 of RSA PKCS#1 v1.5 / SHA-256, or of ECDSA P-256 over
    SHA-256 as r || s (32 bytes each)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    if isinstance(key, ec.EllipticCurvePrivateKey):
        r, s = decode_dss_signature(key.sign(manifest, ec.ECDSA(hashes.SHA256())))
        raw = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    else:
        raw = key.sign(manifest, padding.PKCS1v15(), hashes.SHA256())
    return base64.b64encode(raw)


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, mtime
    tar.addfile(info, io.BytesIO(data))


def _gzip_tar(members: list[tuple[str, bytes]]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name, data in members:
                _tar_member(tar, name, data)
    return raw.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_artifact(args: MenderArgs) -> MenderResult:
    """Write ``args.output``, a Mender Artifact carrying ``args.bundle``. Raises EdgeqError subclasses."""
    bundle = Path(args.bundle)
    if not bundle.is_file() or not bundle.name.endswith(".tar.gz"):
        raise UsageError(f"{bundle} is not a bundle archive; give the .tar.gz that edgeq package wrote")
    manifest = _verified(bundle, args.bundle_key)  # a damaged, changed or foreign archive is refused here
    name = args.artifact_name or manifest.bundle_id
    types = list(args.device_types) or device_types_for(manifest.device.profile)
    for value, what in [(name, "artifact name"), *((t, "device type") for t in types)]:
        if not TOKEN.fullmatch(value):
            raise UsageError(f"Mender {what} '{value}' may use letters, digits and . _ : + @ - only (at most 128)")
    key = _load_key(args.key) if args.key is not None else None
    output = Path(args.output)
    if output.is_dir():
        raise UsageError(f"-o {output} is a folder; give the artifact's file name (for example {manifest.name}.mender)")
    if output.resolve() == bundle.resolve():
        raise UsageError(f"-o {output} is the bundle archive itself; give the artifact another name (for example "
                         f"{manifest.name}.mender)")
    where = output.resolve().parent
    if any((p / "manifest.json").is_file() for p in (where, *where.parents)):
        raise UsageError(f"-o {output} is inside a bundle folder (it would change the bundle, which then fails "
                         "verify); write the artifact outside any bundle")

    payload_name = bundle.name
    payload = bundle.read_bytes()
    provides = {f"edgeq.{manifest.name}.release": str(manifest.release),
                f"edgeq.{manifest.name}.bundle_id": manifest.bundle_id}
    header_info = {"payloads": [{"type": PAYLOAD_TYPE}], "artifact_provides": {"artifact_name": name},
                   "artifact_depends": {"device_type": types}}
    type_info = {"type": PAYLOAD_TYPE, "artifact_provides": provides,
                 "clears_artifact_provides": [f"edgeq.{manifest.name}.*"]}
    meta_data = {"bundle_id": manifest.bundle_id, "model": manifest.name, "release": manifest.release,
                 "device_profile": manifest.device.profile, "signed_bundle": manifest.signed,
                 "update_module": MODULE_PATH_ON_DEVICE}
    version = json.dumps({"format": "mender", "version": 3}, separators=(",", ":")).encode()
    header = _gzip_tar([("header-info", json.dumps(header_info, separators=(",", ":")).encode()),
                        ("headers/0000/type-info", json.dumps(type_info, separators=(",", ":")).encode()),
                        ("headers/0000/meta-data", json.dumps(meta_data, separators=(",", ":")).encode())])
    data = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=data, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo(payload_name)
            info.size, info.mode, info.mtime = len(payload), 0o644, 0  # the same bundle gives the same artifact
            tar.addfile(info, io.BytesIO(payload))
    sums = sorted([(f"data/0000/{payload_name}", _sha256(payload)), ("header.tar.gz", _sha256(header)),
                   ("version", _sha256(version))])
    manifest_text = "".join(f"{digest}  {path}\n" for path, digest in sums).encode()

    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
            _tar_member(tar, "version", version)
            _tar_member(tar, "manifest", manifest_text)
            if key is not None:
                _tar_member(tar, "manifest.sig", _sign(manifest_text, key))
            _tar_member(tar, "header.tar.gz", header)
            _tar_member(tar, "data/0000.tar.gz", data.getvalue())
        os.replace(tmp, output)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {output}: {err.strerror or err}") from None
    return MenderResult(artifact=output, artifact_name=name, device_types=types, provides=provides,
                        payload=payload_name, signed=key is not None, bytes=output.stat().st_size)


__all__ = ["MenderArgs", "MenderResult", "write_artifact", "write_module_files", "device_types_for", "PAYLOAD_TYPE",
           "MODULE"]
