"""edgeq's cache folder (``$XDG_CACHE_HOME/edgeq``, else ``~/.cache/edgeq``) and the small native builds kept
in it (the CUDA driver stub, the loader, the CUDA bridge), each compiled once per source and compiler."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from edgeq.errors import ToolchainError


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeq"


def cached_build(what: str, output: str, source_name: str, source: bytes, compiler: str, flags: list[str],
                 libs: tuple[str, ...] = (), key: str = "", headers: dict[str, bytes] | None = None) -> Path:
    """Compile one source file (with ``headers``, written beside it) into
    ``~/.cache/edgeq/<output>-<hash>/<output>`` once per (source, headers, compiler, flags, ``key``); built in a
    temporary folder beside it and renamed into place (never half a file)."""
    headers = dict(sorted((headers or {}).items()))
    h = hashlib.sha256(source + "\0".join([compiler, *flags, *libs, key]).encode())
    for name, text in headers.items():
        h.update(b"\0" + name.encode() + b"\0" + text)
    digest = h.hexdigest()[:16]
    target = cache_dir() / f"{output}-{digest}" / output
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp, source_name), Path(tmp, output)
        src.write_bytes(source)
        for name, text in headers.items():
            Path(tmp, name).write_bytes(text)
        proc = subprocess.run([compiler, *flags, "-o", str(out), str(src), *libs], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolchainError(f"building {what} with {compiler} failed: {proc.stderr.strip()[:300]}")
        os.replace(out, target)
    return target
