"""What an ELF file needs from the OS it will run on: machine, and the highest GLIBC_ / GLIBCXX_ symbol
versions it imports (read with binutils' ``readelf``, which reads any architecture)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from edgeq.errors import ToolchainError

_NEED = re.compile(r"Name: (GLIBC|GLIBCXX)_([0-9][0-9.]*)\b")
# e_machine values, named as `uname -m` names the machine
MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm", 3: "i386"}
NOT_ELF = "not-elf"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def machine(path: Path) -> str:
    """The machine an ELF file is built for, from its header alone (``NOT_ELF`` for other files)."""
    with open(path, "rb") as f:
        header = f.read(20)
    if header[:4] != b"\x7fELF" or len(header) < 20:
        return NOT_ELF
    value = int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")
    return MACHINES.get(value, f"elf-machine-{value}")


def needs(path: Path) -> dict[str, str | None]:
    """``{"machine": "aarch64", "glibc": "2.34", "glibcxx": "3.4.30"}`` (None where nothing is needed)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise ToolchainError("readelf not found; install binutils (sudo apt-get install binutils)")
    proc = subprocess.run([readelf, "-V", "-W", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolchainError(f"readelf cannot read {path}: {proc.stderr.strip()[:200]}")
    found: dict[str, list[str]] = {"GLIBC": [], "GLIBCXX": []}
    for lib, version in _NEED.findall(proc.stdout):
        found[lib].append(version)
    top = {lib: max(versions, key=version_key) if versions else None for lib, versions in found.items()}
    return {"machine": machine(path), "glibc": top["GLIBC"], "glibcxx": top["GLIBCXX"]}
