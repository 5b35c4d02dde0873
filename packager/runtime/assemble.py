"""The bundle's own runtime: ``runtime/`` with the TVM runtime libraries the model was compiled with (for
the device's architecture), the CUDA 12 bridge where the device's JetPack has CUDA 12, and the native
loader ``edgeq-run``. With it a device needs nothing installed: no Python, numpy, pip or TVM.

* TVM libraries: ``libtvm_ffi.so``, ``libtvm_runtime.so`` and, for CUDA profiles, ``libtvm_runtime_cuda.so``
  of exactly the installed apache-tvm / apache-tvm-ffi versions: from the installed wheels when the device
  has the build host's architecture, else from the same wheels for the device's (``edgeq.runtime.wheels``).
* The bridge (``libcudart.so.13``, ``edgeq.runtime.bridge``): TVM's CUDA backend links CUDA 13's runtime;
  JetPack 6 has CUDA 12. Built for the device from source, forwarding what TVM imports to ``libcudart.so.12``.
* ``edgeq-run`` (``native/edgeq_run.cc``): built with the profile's C++ compiler against tvm-ffi's C API.

Every ELF is checked against the profile's OS (highest glibc / libstdc++ symbol versions it needs).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import tempfile
from importlib import resources, util
from pathlib import Path

from edgeq import safebundle
from edgeq.errors import ToolchainError
from edgeq.runtime import elf
from edgeq.runtime.wheels import Wheel, fetch, installed_version
from edgeq.targets import Profile
from edgeq.toolchain import cached_build

RUNTIME_DIR = safebundle.RUNTIME  # the one sub-folder a bundle may have
LOADER = f"{RUNTIME_DIR}/edgeq-run"
TVM_PROJECT, FFI_PROJECT = "apache-tvm", "apache-tvm-ffi"
# (project, file inside the wheel) in load order; the CUDA library only for CUDA profiles
LIBRARIES = (
    (FFI_PROJECT, "tvm_ffi/lib/libtvm_ffi.so"),
    (TVM_PROJECT, "tvm/lib/libtvm_runtime.so"),
)
CUDA_LIBRARY = (TVM_PROJECT, "tvm/lib/libtvm_runtime_cuda.so")
BRIDGE = f"{RUNTIME_DIR}/libcudart.so.13"
TVM_CUDART_MAJOR = 13  # libtvm_runtime_cuda.so NEEDs libcudart.so.13


@dataclasses.dataclass
class Runtime:
    """What ``assemble`` put under ``runtime/`` and the manifest's ``runtime`` section."""

    files: list[str]  # bundle-relative names
    record: dict


def _package_dir(module: str) -> Path:
    spec = util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(f"the Python package {module} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def installed_cuda_runtime() -> Path:
    """The installed TVM wheel's ``libtvm_runtime_cuda.so`` (this machine's architecture)."""
    return _package_dir("tvm") / CUDA_LIBRARY[1].split("/", 1)[1]


def _library_bytes(machine: str, project: str, member: str, wheels: dict[str, Wheel], note) -> bytes:
    """A runtime library for ``machine``: the installed file on a same-architecture host, else from the wheel."""
    if machine == platform.machine():
        top, _, rest = member.partition("/")
        return (_package_dir(top) / rest).read_bytes()
    if project not in wheels:
        wheels[project] = fetch(project, installed_version(project), machine, note)
    return wheels[project].read(member)


def _c_compiler(cxx: str) -> str:
    """The C compiler beside a C++ one (``aarch64-linux-gnu-g++`` -> ``aarch64-linux-gnu-gcc``)."""
    name = os.path.basename(cxx)
    cc = name[:-3] + "gcc" if name.endswith("g++") else "cc"
    path = shutil.which(os.path.join(os.path.dirname(cxx), cc)) or shutil.which(cc)
    if path is None:
        raise ToolchainError(f"C compiler '{cc}' not found beside {cxx}; install it with the C++ compiler's package")
    return path


def build_loader(cxx: str, schema_version: int) -> Path:
    """``edgeq-run`` for the compiler's target, built once per (source, compiler, schema) and cached."""
    source = resources.files("edgeq").joinpath("native/edgeq_run.cc").read_bytes()
    include = _package_dir("tvm_ffi") / "include"
    flags = ["-std=c++17", "-O2", "-Wall", f"-DEDGEQ_SCHEMA_VERSION={schema_version}", f"-I{include}"]
    return cached_build("edgeq-run", "edgeq-run", "edgeq_run.cc", source, cxx, flags, ("-ldl",),
                        key=installed_version(FFI_PROJECT))


def _bridge(profile: Profile, cxx: str, cuda_runtime: Path, folder: Path) -> tuple[Path, dict]:
    from edgeq.runtime import bridge

    if profile.cuda.major != 12:
        raise ToolchainError(
            f"{profile.name} runs CUDA {profile.cuda.version}, and TVM's CUDA runtime needs CUDA {TVM_CUDART_MAJOR}; "
            f"edgeq bridges only CUDA 12 to {TVM_CUDART_MAJOR}; package with --runtime none and bring a TVM runtime built for it"
        )
    imports = bridge.cudart_imports(cuda_runtime)
    library = bridge.build_bridge(imports, _c_compiler(cxx), folder, bridge.cuda12_headers(), bridge.cuda13_headers())
    return library, {"file": BRIDGE, "provides": f"libcudart.so.{TVM_CUDART_MAJOR}", "forwards_to": "libcudart.so.12",
                     "functions": imports}


def os_limits(profile: Profile) -> dict[str, str | None]:
    """The highest glibc / GLIBCXX versions the profile's OS provides (this machine's for ``host``)."""
    if profile.name == "host":
        libc, version = platform.libc_ver()
        return {"os": "this machine", "glibc": version if libc == "glibc" else None, "glibcxx": None}
    return {key: profile.software.get(key) for key in ("os", "glibc", "glibcxx")}


def check_elves(directory: Path, names: list[str], profile: Profile) -> dict:
    """Machine and OS needs of every ELF in the bundle; a need newer than the profile's OS stops the build."""
    limits = os_limits(profile)
    files, top = {}, {"glibc": None, "glibcxx": None}
    for name in names:
        path = directory / name
        if elf.machine(path) == elf.NOT_ELF:
            continue
        info = elf.needs(path)
        if info["machine"] != profile.cpu.arch:
            raise ToolchainError(f"{name} is built for {info['machine']}, not {profile.cpu.arch} ({profile.name})")
        for lib in ("glibc", "glibcxx"):
            have, limit = info[lib], limits.get(lib)
            if have and (top[lib] is None or elf.version_key(have) > elf.version_key(top[lib])):
                top[lib] = have
            if have and limit and elf.version_key(have) > elf.version_key(limit):
                symbol = "GLIBC" if lib == "glibc" else "GLIBCXX"
                raise ToolchainError(
                    f"{name} needs {symbol}_{have} but {profile.name} runs {limits['os']} with {symbol}_{limit}; "
                    "build with an older toolchain (or sysroot) for that OS"
                )
        files[name] = info
    return {"files": files, "needs": top, "os": limits}


def assemble(profile: Profile, cxx: str, staging: Path, schema_version: int, note=None) -> Runtime:
    """Write ``staging/runtime/`` for ``profile``; returns its files and manifest record."""
    folder = staging / RUNTIME_DIR
    folder.mkdir()
    machine = profile.cpu.arch
    wheels: dict[str, Wheel] = {}
    members = [*LIBRARIES, *([CUDA_LIBRARY] if profile.cuda else [])]
    load_order, sources = [], []
    for project, member in members:
        name = f"{RUNTIME_DIR}/{member.rsplit('/', 1)[1]}"
        (staging / name).write_bytes(_library_bytes(machine, project, member, wheels, note))
        (staging / name).chmod(0o755)
        load_order.append(name)
    bridge = None
    if profile.cuda and profile.cuda.major < TVM_CUDART_MAJOR:
        with tempfile.TemporaryDirectory() as tmp:
            library, bridge = _bridge(profile, cxx, staging / load_order[-1], Path(tmp))
            shutil.copyfile(library, staging / BRIDGE)
        (staging / BRIDGE).chmod(0o755)
        load_order.insert(len(load_order) - 1, BRIDGE)  # before libtvm_runtime_cuda.so, which needs it
    shutil.copyfile(build_loader(cxx, schema_version), staging / LOADER)
    (staging / LOADER).chmod(0o755)
    for project in (TVM_PROJECT, FFI_PROJECT):
        wheel = wheels.get(project)
        sources.append(wheel.to_dict() if wheel else
                       {"project": project, "version": installed_version(project), "wheel": None, "sha256": None,
                        "from": f"the installed package ({machine})"})
    files = [LOADER, *load_order]
    record = {
        "loader": LOADER,
        "libraries": load_order,
        "cuda_bridge": bridge,
        "sources": sources,
        "bytes": sum((staging / name).stat().st_size for name in files),
    }
    return Runtime(files=files, record=record)
