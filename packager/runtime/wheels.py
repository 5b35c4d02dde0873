"""Wheels from PyPI for another platform, fetched once with pip and cached.

A bundle carries the TVM runtime of exactly the version the model was compiled with, for the device's
architecture. For the build host's own architecture that is the installed wheel; for another one (the
aarch64 Jetson) edgeq asks pip for the same distribution and version for that platform
(``pip download --platform ...``), keeps the wheel under ``~/.cache/edgeq/wheels`` and takes the
libraries out of it. Offline, a cached wheel is enough; with nothing cached the build stops with one line.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata, util
from pathlib import Path

from edgeq.errors import ToolchainError
from edgeq.templates.safebundle import sha256_file
from edgeq.cache import cache_dir

# pip platform tags for each machine (``uname -m``); newest first, pip takes any of them
PLATFORMS = {
    "aarch64": ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux2014_aarch64"),
    "x86_64": ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux2014_x86_64"),
}
# Python of JetPack 6 (Ubuntu 22.04); only wheels with a CPython extension (tvm-ffi) care, and the
# libraries edgeq takes from them do not depend on Python.
PYTHON_VERSION = "3.10"
MAX_MEMBER_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Wheel:
    project: str
    version: str
    path: Path
    sha256: str

    @property
    def name(self) -> str:
        return self.path.name

    def to_dict(self) -> dict:
        return {"project": self.project, "version": self.version, "wheel": self.name, "sha256": self.sha256}

    def read(self, member: str) -> bytes:
        """One file of the wheel (``tvm/lib/libtvm_runtime.so``)."""
        try:
            with zipfile.ZipFile(self.path) as zf:
                info = zf.getinfo(member)
                if info.file_size > MAX_MEMBER_BYTES:
                    raise ToolchainError(f"{self.name}: {member} is larger than {MAX_MEMBER_BYTES} bytes")
                return zf.read(info)
        except KeyError:
            raise ToolchainError(f"{self.name} has no {member}; is it the {self.project} wheel?") from None
        except (OSError, zipfile.BadZipFile) as err:
            raise ToolchainError(f"cannot read {self.path}: {err}; delete it and build again to fetch it anew") from None

    def members(self) -> list[str]:
        with zipfile.ZipFile(self.path) as zf:
            return zf.namelist()


def installed_version(project: str) -> str:
    try:
        return metadata.version(project)
    except metadata.PackageNotFoundError:
        raise ToolchainError(f"{project} is not installed; pip install {project}") from None


def _normal(project: str) -> str:
    return project.lower().replace("-", "_").replace(".", "_")


def _cached(folder: Path, project: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    prefix = f"{_normal(project)}-{version}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[-1] if found else None


def wheel_dir(machine: str) -> Path:
    return cache_dir() / "wheels" / f"linux-{machine}"


def fetch(project: str, version: str, machine: str, note=None) -> Wheel:
    """The ``project==version`` wheel for Linux on ``machine``: from the cache, else from pip (once)."""
    if machine not in PLATFORMS:
        raise ToolchainError(f"no wheels for machine '{machine}'; edgeq knows: {', '.join(PLATFORMS)}")
    folder = wheel_dir(machine)
    path = _cached(folder, project, version)
    if path is None:
        if note:
            note(f"fetching {project}=={version} for linux {machine} (pip download, cached in {folder})")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
            platforms = [arg for tag in PLATFORMS[machine] for arg in ("--platform", tag)]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                   *platforms, "--python-version", PYTHON_VERSION, "-d", tmp, f"{project}=={version}"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as err:
                raise ToolchainError(f"cannot run pip to fetch {project}=={version} for linux {machine}: {err}") from None
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or len(wheels) != 1:
                reason = (proc.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
                raise ToolchainError(
                    f"cannot fetch the {project}=={version} wheel for linux {machine} ({reason}); connect to PyPI "
                    f"once (it is cached in {folder}), put the wheel there yourself, or package with --runtime none"
                )
            path = folder / wheels[0].name
            os.replace(wheels[0], path)
    return Wheel(project, version, path, sha256_file(path))


def package_dir(module: str) -> Path:
    spec = util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(f"the Python package {module} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def installed_cuda_runtime() -> Path:
    """The installed TVM wheel's ``libtvm_runtime_cuda.so`` (this machine's architecture)."""
    return package_dir("tvm") / "lib/libtvm_runtime_cuda.so"
