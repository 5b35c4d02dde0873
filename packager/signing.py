"""ed25519 keys for signing bundles (``edgeq keygen``, ``edgeq package --sign-key``)."""

from __future__ import annotations

import os
from pathlib import Path

from edgeq.templates import safebundle
from edgeq.errors import BundleError, UsageError

PRIVATE, PUBLIC = "edgeq_signing.key", "edgeq_signing.pub"


def _create(path: Path, data: bytes, mode: int) -> None:
    """Write a new file: never over an existing file, never through a symlink (even a dangling one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def keygen(out_dir: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write a new key pair into ``out_dir``: the private key 0600, PEM (PKCS#8); the public key PEM. Existing
    keys are never overwritten and nothing is written through a symlink; on failure nothing is left behind."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    out = Path(out_dir)
    private, public = out / PRIVATE, out / PUBLIC
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the key pair")
    for path in (private, public):
        if path.is_symlink():
            raise UsageError(f"{path} is a symbolic link; keys are never written through links: remove it or choose another --out")
        if path.exists():
            raise UsageError(f"{out} already holds a signing key; choose another --out (keys are never overwritten)")
    key = ed25519.Ed25519PrivateKey.generate()
    created: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        _create(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
        created.append(private)
        _create(public, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)
    except OSError as err:
        for path in created:
            path.unlink(missing_ok=True)
        raise UsageError(f"cannot write keys to {out}: {err.strerror} (nothing was written)") from None
    return private, public, safebundle.key_id(key.public_key())


def load_private_key(path: str | os.PathLike):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read signing key {path}: {err.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise UsageError(f"{path} is not an unencrypted PEM private key (make one with 'edgeq keygen')") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UsageError(f"{path} is not an ed25519 key (make one with 'edgeq keygen')")
    return key


def load_public_key(path: str | os.PathLike):
    try:
        return safebundle.load_public_key(path)
    except safebundle.BundleRefused as err:
        raise BundleError(str(err)) from None
