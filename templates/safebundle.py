"""Verify, unpack and install edgeq bundles without trusting them.

Standard library only (plus ``cryptography`` for signatures), so this one file also runs on devices:
``edgeq flash`` copies it there, and ``python3 safebundle.py install BUNDLE.tar.gz --root /opt/edgeq``
works without edgeq installed.

Trust model: ``manifest.json`` lists the SHA-256 and size of every other file; ``manifest.sig`` is an
ed25519 signature over the exact bytes of ``manifest.json``. With a public key configured, a bundle must be
signed by it, every file must match, and nothing else may be there. Archives are read header by header and
refused at the first member that is not a plain file the manifest declares with that size (the manifest
must come first), so path tricks, links, devices, duplicates and tar/gzip bombs stop before their data is
read; members are written with ``tarfile``'s data filter checks into a fresh temporary directory.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

if __package__ == "edgeq.templates":  # part of edgeq (edgeq.templates.safebundle)
    from edgeq.templates import contract
else:  # a file of its own (on a device after edgeq flash, or inside a bundle): contract.py lies beside it
    import importlib.util

    sys.dont_write_bytecode = True  # loading contract.py must not add __pycache__ to a bundle being verified

    _spec = importlib.util.spec_from_file_location("edgeq_bundle_contract", Path(__file__).with_name("contract.py"))
    contract = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = contract
    _spec.loader.exec_module(contract)

SCHEMA_VERSION = contract.SCHEMA_VERSION
MANIFEST, SIGNATURE, SUMS, RUNTIME = contract.MANIFEST, contract.SIGNATURE, contract.SUMS, contract.RUNTIME
# Bounds on what a bundle may make this code read or allocate (edgeq.limits documents all of them).
MAX_MANIFEST_BYTES = 4 << 20
MAX_SMALL_FILE_BYTES = 1 << 20  # manifest.sig, SHA256SUMS, state.json
MAX_MEMBERS = 64
MAX_JSON_DEPTH = 64  # nesting of any JSON document edgeq reads (a manifest needs 6)
MAX_TAR_HEADER_BYTES = 8 << 10  # a PAX / GNU long-name header; tarfile would read any size whole
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FILE_NAME = re.compile(r"^(runtime/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class BundleRefused(Exception):
    """The bundle is not accepted; ``str()`` is a one-line reason."""


# ---------------------------------------------------------------------------------------------------
# bounded JSON
# ---------------------------------------------------------------------------------------------------


def json_depth(text: str) -> int:
    """How deeply ``[`` / ``{`` nest in a JSON text, without recursion (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def load_json(data: bytes | str, what: str, max_bytes: int = MAX_MANIFEST_BYTES):
    """``json.loads`` with the size and nesting bounded first; BundleRefused with one line otherwise."""
    if len(data) > max_bytes:
        raise BundleRefused(f"{what} is larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise BundleRefused(f"{what} is not UTF-8 text") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise BundleRefused(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise BundleRefused(f"{what} is not valid JSON (duplicate key {err})") from None
    except (ValueError, RecursionError) as err:
        raise BundleRefused(f"{what} is not valid JSON: {_first_line(err)}") from None


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs) -> dict:
    """An object whose keys are all different: with a key twice, a first-wins and a last-wins reader (edgeq-run
    and Python's json) would see two different manifests under one signature, so it is refused by both."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(json.dumps(key))
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------------------
# manifest shape
# ---------------------------------------------------------------------------------------------------

def check_manifest(manifest) -> "contract.Manifest":
    """The manifest as the contract's typed ``Manifest``; refused when a field is missing or has the wrong
    type (``Manifest.from_json``), or names an unsafe file, a bad hash or size, or a file it does not list."""
    if not isinstance(manifest, dict):
        raise BundleRefused("manifest.json is not a JSON object")
    try:
        m = contract.Manifest.from_json(manifest)
    except contract.ContractError as err:
        raise BundleRefused(str(err)) from None
    if not NAME.fullmatch(m.bundle_id) or not NAME.fullmatch(m.name):
        raise BundleRefused("manifest bundle_id or name is not valid")
    if set(m.files) != set(m.sizes) or not m.files:
        raise BundleRefused("manifest 'files' and 'sizes' must name the same files")
    for name, digest in m.files.items():
        if not FILE_NAME.fullmatch(name) or name in (MANIFEST, SIGNATURE, SUMS):
            raise BundleRefused(f"manifest lists an unsafe file name {name!r}")
        if not HEX64.fullmatch(digest):
            raise BundleRefused(f"manifest hash of {name} is not a SHA-256")
    for section in ("library", "weights", "golden"):
        if getattr(m, section).file not in m.files:
            raise BundleRefused(f"manifest {section}.file is not one of the bundle's files")
    if m.weights.format != contract.TENSOR_FORMAT or m.golden.format != contract.TENSOR_FORMAT:
        raise BundleRefused(f"this bundle's tensors are not in the {contract.TENSOR_FORMAT} form the loaders read; "
                            "package it again")
    bridge = m.runtime.cuda_bridge if m.runtime is not None else None
    if bridge is not None and not (isinstance(bridge.get("file"), str) and bridge["file"] in m.files):
        raise BundleRefused("manifest runtime.cuda_bridge.file is not one of the bundle's files")
    if m.runtime is not None and not all(n in m.files for n in (m.runtime.loader, *m.runtime.libraries)):
        raise BundleRefused("manifest runtime.loader / runtime.libraries are not the bundle's files")
    for section in ("weights", "golden"):
        _check_table(section, getattr(m, section), m.sizes[getattr(m, section).file])
    if m.golden.outliers is not None and not 0 <= m.golden.outliers <= contract.MAX_GOLDEN_OUTLIERS:
        raise BundleRefused(f"manifest golden.outliers must be from 0 to {contract.MAX_GOLDEN_OUTLIERS}")
    return m


# What a tensor table may hold (edgeq-run reads the same set): numpy's name -> bytes per element
TABLE_DTYPES = contract.DTYPE_BYTES


def _check_table(section: str, record, file_size: int) -> None:
    """Every entry of a weights/golden table: a dtype a bundle can hold, its byte count what its shape says,
    and its range inside the file (as the manifest sizes it; the files are held to those sizes), so that no
    reader allocates for data that is not there."""
    for i, t in enumerate(record.tensors):
        where = f"manifest {section}.tensors[{i}] ({t.name})"
        if t.dtype not in TABLE_DTYPES:
            raise BundleRefused(f"{where} has dtype {t.dtype!r}, not one a bundle holds ({', '.join(TABLE_DTYPES)})")
        count = 1
        for d in t.shape:
            count *= d
        if t.bytes != count * TABLE_DTYPES[t.dtype]:
            raise BundleRefused(f"{where}: {t.bytes} bytes, but its shape and dtype make {count * TABLE_DTYPES[t.dtype]}")
        if t.offset + t.bytes > file_size:
            raise BundleRefused(f"{where} lies beyond the end of {record.file} ({file_size} bytes)")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_manifest(data: bytes) -> "contract.Manifest":
    return check_manifest(load_json(data, "manifest.json"))


# ---------------------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------------------


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BundleRefused("a public key is configured but the 'cryptography' package is missing: "
                            "pip install cryptography") from None
    return ed25519, serialization, InvalidSignature


def load_public_key(path: str | os.PathLike):
    ed25519, serialization, _ = _crypto()
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise BundleRefused(f"cannot read public key {path}: {err.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise BundleRefused(f"{path} is not a PEM public key") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise BundleRefused(f"{path} is not an ed25519 public key")
    return key


def key_id(public_key) -> str:
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def verify_signature(manifest_bytes: bytes, signature_bytes: bytes | None, public_key) -> None:
    _, _, invalid = _crypto()
    if signature_bytes is None:
        raise BundleRefused("bundle is not signed (no manifest.sig) and a public key is configured")
    try:
        sig = load_json(signature_bytes, "manifest.sig", MAX_SMALL_FILE_BYTES)
        raw = base64.b64decode(sig["signature"], validate=True)
        if sig.get("algorithm") != "ed25519" or not isinstance(sig.get("key_id"), str):
            raise ValueError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, BundleRefused):
        raise BundleRefused("manifest.sig is malformed") from None
    if sig["key_id"] != key_id(public_key):
        raise BundleRefused(f"bundle is signed by key {sig['key_id']}, not by the configured key {key_id(public_key)}")
    try:
        public_key.verify(raw, manifest_bytes)
    except invalid:
        raise BundleRefused("signature does not match manifest.json (changed after signing?)") from None


def signature_for(manifest_bytes: bytes, private_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    pub = private_key.public_key()
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    body = {"algorithm": "ed25519", "key_id": hashlib.sha256(raw).hexdigest()[:16],
            "signature": base64.b64encode(private_key.sign(manifest_bytes)).decode("ascii")}
    return (json.dumps(body, indent=2) + "\n").encode("ascii")


# ---------------------------------------------------------------------------------------------------
# directories and archives
# ---------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_dir(directory: str | os.PathLike, public_key=None, extra_files: bool = False) -> "contract.Manifest":
    """Check a bundle directory: shape, signature (when a key is given), sizes and hashes, and no files the
    manifest does not list (``extra_files``: ignore those, for a loader that never opens them)."""
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        raise BundleRefused(f"{directory} is not a bundle directory")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file() or manifest_path.is_symlink():
        raise BundleRefused("bundle has no manifest.json")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleRefused("manifest.json is too large")
    manifest_bytes = manifest_path.read_bytes()
    manifest = parse_manifest(manifest_bytes)
    allowed = set(manifest.files) | {MANIFEST, SIGNATURE, SUMS}
    entries = [] if extra_files else list(directory.iterdir())
    runtime = directory / RUNTIME
    if any(name.startswith(RUNTIME + "/") for name in manifest.files) and runtime in entries:
        if runtime.is_symlink() or not runtime.is_dir():
            raise BundleRefused(f"bundle member {RUNTIME} is not a folder")
        entries.remove(runtime)
        entries += list(runtime.iterdir())
    for entry in entries:
        name = entry.relative_to(directory).as_posix()
        if name not in allowed:
            raise BundleRefused(f"bundle holds a file the manifest does not list: {name}")
        if entry.is_symlink() or not entry.is_file():
            raise BundleRefused(f"bundle member {name} is not a regular file")
    if public_key is not None:
        sig_path = directory / SIGNATURE
        verify_signature(manifest_bytes, sig_path.read_bytes() if sig_path.is_file() else None, public_key)
    for name, digest in manifest.files.items():
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise BundleRefused(f"bundle file {name} is missing" if not path.exists() else f"bundle member {name} is not a regular file")
        if path.stat().st_size != manifest.sizes[name] or sha256_file(path) != digest:
            raise BundleRefused(f"bundle file {name} does not match the manifest (changed or from another bundle)")
    return manifest


def _member_name(member: tarfile.TarInfo, top: str | None) -> tuple[str, str]:
    """(bundle folder, path inside it: "" for the folder itself, "runtime" or "runtime/NAME" below it)."""
    name = member.name
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) or len(parts) > 3
            or (len(parts) == 3 and parts[1] != RUNTIME)):
        raise BundleRefused(f"archive member {name!r} has an unsafe path")
    if not NAME.fullmatch(parts[0]) or (top is not None and parts[0] != top):
        raise BundleRefused(f"archive member {name!r} is outside the bundle folder")
    return parts[0], "/".join(parts[1:])


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or GNU long-name header's data whole, whatever size it declares; refuse large ones
    before that read."""

    _EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK)

    def _proc_member(self, tarfile_):
        if self.type in self._EXTENDED and self.size > MAX_TAR_HEADER_BYTES:
            raise BundleRefused(f"archive has an extended header of {self.size} bytes (more than "
                                f"{MAX_TAR_HEADER_BYTES}); edgeq bundles have none that large")
        return super()._proc_member(tarfile_)


def open_tar(archive: str | os.PathLike) -> tarfile.TarFile:
    """A gzip tar reader whose headers are bounded (``BoundedTarInfo``)."""
    try:
        return tarfile.open(archive, "r:gz", tarinfo=BoundedTarInfo)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise BundleRefused(f"not a readable .tar.gz bundle ({_first_line(err)})") from None


def safe_extract(archive: str | os.PathLike, dest: str | os.PathLike, public_key=None) -> Path:
    """Unpack a bundle archive into ``dest`` (a fresh, empty directory) and return the bundle folder.

    Refuses, before reading any member's data: absolute or ``..`` paths, anything but plain files,
    duplicate names, a missing or misplaced manifest, files the manifest does not list, sizes other than
    declared, more members than files, oversized headers. With ``public_key``, the second member must be
    ``manifest.sig`` and verify against the manifest before any other member is read."""
    dest = Path(dest)
    if any(dest.iterdir()):
        raise BundleRefused(f"{dest} is not empty")
    tar = open_tar(archive)
    try:
        return _extract(tar, dest, public_key)
    except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as err:
        raise BundleRefused(f"archive is damaged or truncated ({_first_line(err)})") from None
    finally:
        tar.close()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _extract(tar: tarfile.TarFile, dest: Path, public_key=None) -> Path:
    top, manifest, seen, count = None, None, set(), 0
    manifest_bytes, signed = b"", public_key is None
    for member in tar:
        count += 1
        if count > MAX_MEMBERS or (manifest is not None and count > len(manifest.files) + 5):
            raise BundleRefused("archive has more members than the manifest declares")
        folder, name = _member_name(member, top)
        top = folder
        if not name:
            if not member.isdir() or folder in seen:
                raise BundleRefused(f"archive member {member.name!r} is not the bundle folder")
            seen.add(folder)
            (dest / folder).mkdir()
            continue
        if name == RUNTIME and manifest is not None and any(f.startswith(RUNTIME + "/") for f in manifest.files):
            if not member.isdir() or name in seen:
                raise BundleRefused(f"archive member {member.name!r} is not the runtime folder")
            seen.add(name)
            (dest / folder / RUNTIME).mkdir(parents=True)
            continue
        if not member.isreg():
            raise BundleRefused(f"archive member {member.name!r} is not a regular file (link or device)")
        if manifest is not None and not signed and name != SIGNATURE:
            verify_signature(manifest_bytes, None, public_key)  # refuses: not signed
        if name in seen:
            raise BundleRefused(f"archive has the member {name} twice")
        seen.add(name)
        if manifest is None:
            if name != MANIFEST:
                raise BundleRefused("archive does not start with manifest.json")
            limit = MAX_MANIFEST_BYTES
        elif name in manifest.files:
            limit = manifest.sizes[name]
            if member.size != limit:
                raise BundleRefused(f"archive member {name} has {member.size} bytes, the manifest declares {limit}")
        elif name in (SIGNATURE, SUMS):
            limit = MAX_SMALL_FILE_BYTES
        else:
            raise BundleRefused(f"archive holds a file the manifest does not list: {name}")
        if member.size > limit:
            raise BundleRefused(f"archive member {name} is larger than allowed")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: not Debian 12's 3.11.2
            tarfile.data_filter(member, str(dest))  # the standard library's own checks, on top of ours
        (dest / folder / name).parent.mkdir(parents=True, exist_ok=True)
        data = tar.extractfile(member)
        target = dest / folder / name
        with open(target, "xb") as out:
            copied = 0
            for block in iter(lambda: data.read(1 << 20), b""):
                copied += len(block)
                if copied > member.size:
                    raise BundleRefused(f"archive member {name} holds more data than its header says")
                out.write(block)
        if copied != member.size:
            raise BundleRefused(f"archive member {name} is truncated")
        os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)  # the loaders stay executable
        if manifest is None:
            manifest_bytes = target.read_bytes()
            manifest = parse_manifest(manifest_bytes)
        elif name == SIGNATURE and not signed:
            verify_signature(manifest_bytes, target.read_bytes(), public_key)  # before any other member's data
            signed = True
    if manifest is None or top is None:
        raise BundleRefused("archive holds no bundle (no manifest.json)")
    if not signed:
        verify_signature(manifest_bytes, None, public_key)
    return dest / top


def open_bundle(bundle: str | os.PathLike, workdir: str | os.PathLike, public_key=None) -> "tuple[Path, contract.Manifest]":
    """A verified bundle directory: the directory itself, or an archive unpacked into ``workdir``."""
    bundle = Path(bundle)
    if bundle.is_dir():
        return bundle, verify_dir(bundle, public_key)
    if not bundle.is_file():
        raise BundleRefused(f"bundle not found: {bundle}")
    directory = safe_extract(bundle, workdir, public_key)
    return directory, verify_dir(directory, public_key)


# ---------------------------------------------------------------------------------------------------
# install on a device: releases/<bundle_id>, an atomic `current` link, anti-rollback
# ---------------------------------------------------------------------------------------------------


def read_state(root: Path) -> dict:
    """``root/state.json`` (empty before the first install). Anti-rollback depends on it, so a damaged one
    fails closed: refused with the command that rebuilds it from the installed releases."""
    path = Path(root) / "state.json"
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        if path.is_symlink() or not path.is_file():
            raise BundleRefused("not a regular file")
        with open(path, "rb") as f:
            state = load_json(f.read(MAX_SMALL_FILE_BYTES + 1), "state.json", MAX_SMALL_FILE_BYTES)
        _check_state(state)
    except (OSError, BundleRefused) as err:
        reason = err.strerror if isinstance(err, OSError) else str(err)
        raise BundleRefused(f"{path} is damaged ({reason}), so the installed releases cannot be checked against "
                            f"it; rebuild it: edgeq install --repair-state --root {root}") from None
    return state


def _check_state(state) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("models", {}), dict):
        raise BundleRefused("not an object with a 'models' object")
    for key in ("current", "previous"):
        if not isinstance(state.get(key), (str, type(None))):
            raise BundleRefused(f"'{key}' is not a release id")
    for name, entry in state.get("models", {}).items():
        if not isinstance(entry, dict) or not _is_count(entry.get("release")) or not isinstance(entry.get("bundle_id"), str):
            raise BundleRefused(f"models.{name} is not {{release, bundle_id}}")


def repair_state(root, public_key=None) -> dict:
    """Rebuild ``state.json`` from the installed releases: each model's highest installed release becomes its
    anti-rollback floor; current is what ``current`` points at. Only releases that are real folders inside the
    root, named after their manifest's bundle id, whose every file verifies (and, with ``public_key``, whose
    signature does) count; the others are listed in ``skipped`` with the reason, so that a planted manifest
    cannot raise a floor and lock out the real releases."""
    root = Path(root)
    models: dict = {}
    skipped = []
    releases = root / "releases"
    if releases.is_symlink():
        raise BundleRefused(f"{releases} is a symbolic link; the install root must hold its releases itself")
    for path in sorted(releases.iterdir()) if releases.is_dir() else []:
        if path.name.startswith(".staging-"):
            continue
        try:
            if path.is_symlink() or not path.is_dir():
                raise BundleRefused("not a folder inside the root")
            manifest = verify_dir(path, public_key)
            if manifest.bundle_id != path.name:
                raise BundleRefused(f"its manifest names {manifest.bundle_id}")
        except (OSError, BundleRefused) as err:
            skipped.append({"release": path.name, "reason": err.strerror if isinstance(err, OSError) else str(err)})
            continue
        known = models.get(manifest.name)
        if known is None or manifest.release > known["release"]:
            models[manifest.name] = {"release": manifest.release, "bundle_id": manifest.bundle_id}
    current = current_id(root)
    if current is not None and current not in {m["bundle_id"] for m in models.values()} \
            and not (releases / current).is_dir():
        current = None
    state = {"current": current, "previous": None, "models": models}
    _write_json_atomic(root / "state.json", state)
    return {**state, "skipped": skipped}


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def switch_current(root: Path, release_dir: Path) -> None:
    """Point ``root/current`` at ``release_dir`` atomically: a new link under a temporary name, renamed over."""
    tmp = root / ".current.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(release_dir, root), tmp)
    os.replace(tmp, root / "current")


def current_id(root: Path) -> str | None:
    link = root / "current"
    return Path(os.readlink(link)).name if link.is_symlink() else None


def stage(archive, root, public_key=None, allow_downgrade: bool = False) -> dict:
    """Verify ``archive`` and unpack it into ``root/releases/<bundle_id>`` (``current`` is not touched)."""
    root = Path(root)
    created = [p for p in (root, root / "releases") if not p.exists()]
    (root / "releases").mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    done = False
    try:
        read_state(root)  # a damaged state refuses before anything is unpacked
        directory = safe_extract(archive, staging, public_key)
        manifest = verify_dir(directory, public_key)
        installed = read_state(root).get("models", {}).get(manifest.name, {})
        if manifest.release < installed.get("release", -1) and not allow_downgrade:
            raise BundleRefused(f"release {manifest.release} of {manifest.name} is older than the installed "
                                f"release {installed['release']}; use --allow-downgrade to install it anyway")
        target = root / "releases" / manifest.bundle_id
        if target.is_dir():
            verify_dir(target, public_key)  # an earlier copy is only reused if it is still intact
        else:
            os.rename(directory, target)
        done = True
        return {"bundle_id": manifest.bundle_id, "name": manifest.name, "release": manifest.release,
                "path": str(target), "already": current_id(root) == manifest.bundle_id}
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for path in reversed(created if not done else []):  # a refused first install leaves no folders behind
            with contextlib.suppress(OSError):
                path.rmdir()


def activate(root, bundle_id: str) -> dict:
    """Make ``releases/<bundle_id>`` current; the release it replaces becomes ``previous``."""
    root = Path(root)
    target = root / "releases" / bundle_id
    if not NAME.fullmatch(bundle_id) or not target.is_dir():
        raise BundleRefused(f"release {bundle_id} is not installed under {root}")
    manifest = parse_manifest((target / MANIFEST).read_bytes())
    state = read_state(root)
    before = current_id(root)
    switch_current(root, target)
    if before != bundle_id:
        state["previous"] = before
    state["current"] = bundle_id
    state.setdefault("models", {})[manifest.name] = {"release": manifest.release, "bundle_id": bundle_id}
    _write_json_atomic(root / "state.json", state)
    return {"current": bundle_id, "previous": state.get("previous")}


def rollback(root) -> dict:
    """Switch back to the previous release."""
    root = Path(root)
    previous = read_state(root).get("previous")
    if not previous or not (root / "releases" / previous).is_dir():
        raise BundleRefused(f"no previous release to return to under {root}")
    return activate(root, previous)


def prune(root, keep: int = 2) -> dict:
    """Delete releases other than current and previous (and up to ``keep`` in all)."""
    root = Path(root)
    state = read_state(root)
    keep_ids = {state.get("current"), state.get("previous"), current_id(root)} - {None}
    removed = []
    releases = sorted((root / "releases").iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in releases:
        if path.name in keep_ids:
            continue
        if len(keep_ids) < keep:
            keep_ids.add(path.name)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return {"removed": removed}


def status(root) -> dict:
    root = Path(root)
    state = read_state(root)
    current = current_id(root)
    releases = sorted(p.name for p in (root / "releases").iterdir()) if (root / "releases").is_dir() else []
    release = None
    if current:
        try:
            release = parse_manifest((root / "releases" / current / MANIFEST).read_bytes()).release
        except (OSError, BundleRefused):
            pass
    return {"current": current, "release": release, "previous": state.get("previous"), "releases": releases}


def install(archive, root, public_key=None, allow_downgrade: bool = False) -> dict:
    """Verify, unpack and make current (``stage`` + ``activate``)."""
    result = stage(archive, root, public_key, allow_downgrade)
    if not result["already"]:
        result.update(previous=activate(root, result["bundle_id"])["previous"])
    return result


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Verify, install and manage edgeq bundles (device side).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("verify", "install", "stage"):
        p = sub.add_parser(cmd)
        p.add_argument("bundle")
        p.add_argument("--pub", help="ed25519 public key (PEM): the bundle must be signed by it")
        if cmd != "verify":
            p.add_argument("--root", required=True)
            p.add_argument("--allow-downgrade", action="store_true")
    for cmd in ("activate", "rollback", "prune", "status", "repair-state"):
        p = sub.add_parser(cmd)
        p.add_argument("--root", required=True)
        if cmd == "repair-state":
            p.add_argument("--pub", help="ed25519 public key (PEM): only releases signed by it count")
        if cmd == "activate":
            p.add_argument("bundle_id")
    args = parser.parse_args(argv)
    try:
        key = load_public_key(args.pub) if getattr(args, "pub", None) else None
        if args.cmd == "verify":
            with tempfile.TemporaryDirectory() as tmp:
                manifest = open_bundle(args.bundle, tmp, key)[1]
            result = {"bundle_id": manifest.bundle_id, "release": manifest.release, "signed": key is not None}
        elif args.cmd in ("install", "stage"):
            result = (install if args.cmd == "install" else stage)(args.bundle, args.root, key, args.allow_downgrade)
        elif args.cmd == "activate":
            result = activate(args.root, args.bundle_id)
        else:
            result = repair_state(args.root, key) if args.cmd == "repair-state" else \
                {"rollback": rollback, "prune": prune, "status": status}[args.cmd](args.root)
    except BundleRefused as err:
        print(f"safebundle: refused: {err}", file=sys.stderr)
        return 3
    except OSError as err:
        print(f"safebundle: error: {err}", file=sys.stderr)
        return 4
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
