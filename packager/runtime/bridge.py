"""The CUDA 12 bridge: a ``libcudart.so.13`` that lets the TVM wheel's CUDA runtime run on CUDA 12 devices.

The TVM wheel's ``libtvm_runtime_cuda.so`` needs ``libcudart.so.13``; Jetson Orin devices (JetPack 6)
have CUDA 12.6, whose runtime is ``libcudart.so.12``. edgeq builds ``templates/native/cudart_bridge.c`` for the
device into a library with SONAME ``libcudart.so.13`` that forwards each function the TVM library imports
to ``libcudart.so.12`` (see that file for how it finds it). The build:

* reads the TVM library's imports (undefined dynamic symbols versioned ``libcudart.so.*``) and stops with
  one line if the bridge does not forward one of them;
* writes a version script exporting exactly those, with version node ``libcudart.so.13``;
* writes a header with CUDA 12's ``struct cudaDeviceProp`` (renamed) and the fields it shares with CUDA 13,
  taken from the two versions' ``driver_types.h`` (the only struct whose layout changed for these
  functions). NVIDIA's headers come from their PyPI wheels: CUDA 12 from ``nvidia-cuda-runtime-cu12``
  (installed by ``edgeq[jetson]``, else fetched), CUDA 13 from ``nvidia-cuda-runtime`` and
  ``nvidia-cuda-crt`` (fetched, cached);
* compiles it with the device's C compiler against the CUDA 13 headers.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from edgeq.errors import ToolchainError
from edgeq.runtime.wheels import fetch, installed_cuda_runtime
from edgeq.cache import cache_dir

SONAME = "libcudart.so.13"
EXTRA_EXPORTS = ("edgeq_cudart_bridge_error", "edgeq_cudart_bridge_target")
HEADER = "edgeq_cudart_bridge.h"
# Where the headers come from when not installed. The wheels of every platform carry the same headers;
# edgeq takes them from the x86_64 one so that one download serves every host.
CUDA12_RUNTIME = ("nvidia-cuda-runtime-cu12", "12.6.77")
CUDA12_CRT = ("nvidia-cuda-nvcc-cu12", "12.6.85")  # crt/host_defines.h, which cuda_runtime_api.h includes
# the CUDA the TVM wheel was built with: runtime headers, and crt/ (a wheel of its own since CUDA 13)
CUDA13_HEADERS = (("nvidia-cuda-runtime", "13.0.96"), ("nvidia-cuda-crt", "13.0.88"))
HEADER_WHEEL_MACHINE = "x86_64"


# ---------------------------------------------------------------------------------------------------
# What the TVM library imports, and what the bridge forwards
# ---------------------------------------------------------------------------------------------------


def cudart_imports(library: Path) -> list[str]:
    """The functions an ELF shared library (any architecture) imports from ``libcudart.so.*``, sorted."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise ToolchainError("readelf not found on PATH (it reads the CUDA runtime's imports); install binutils")
    proc = subprocess.run([readelf, "--dyn-syms", "-W", str(library)], capture_output=True, text=True)
    if proc.returncode != 0 or "Symbol table" not in proc.stdout:
        reason = (proc.stderr.strip().splitlines() or ["no dynamic symbol table"])[-1][:200]
        raise ToolchainError(f"cannot read the dynamic symbols of {library}: {reason}")
    names = set()
    for line in proc.stdout.splitlines():
        fields = line.split()
        # "  12: 0000000000000000  0 FUNC  GLOBAL DEFAULT  UND cudaFree@libcudart.so.13 (3)"
        if "UND" in fields[:-1]:
            name, _, version = fields[fields.index("UND") + 1].partition("@")
            if version.lstrip("@").startswith("libcudart.so."):
                names.add(name)
    return sorted(names)


def _source() -> bytes:
    return resources.files("edgeq.templates").joinpath("native/cudart_bridge.c").read_bytes()


def forwarded_functions() -> list[str]:
    """The cudart functions ``cudart_bridge.c`` can forward (the rows of its tables)."""
    return sorted(set(re.findall(r"^\s*X\(\s*\w+\s*,\s*(cuda\w+)\s*,", _source().decode(), re.M)))


# ---------------------------------------------------------------------------------------------------
# NVIDIA's headers
# ---------------------------------------------------------------------------------------------------


def _cudart_major(include: Path) -> int | None:
    try:
        text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(match[1]) // 1000 if match else None


def wheel_headers(*wheels: tuple[str, str], note=None) -> Path:
    """The ``include`` folders of NVIDIA wheels (``(project, version)`` pairs) merged into one folder,
    extracted once into the cache, keyed by the wheels' sha256."""
    fetched = [fetch(project, version, HEADER_WHEEL_MACHINE, note) for project, version in wheels]
    key = hashlib.sha256(" ".join(w.sha256 for w in fetched).encode()).hexdigest()[:16]
    target = cache_dir() / f"cuda-headers-{key}" / "include"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for wheel in fetched:
            # nvidia/cu13/include/crt/host_defines.h -> crt/host_defines.h
            headers = [(m, m.partition("/include/")[2]) for m in wheel.members() if "/include/" in m]
            headers = [(m, rel) for m, rel in headers if rel.endswith((".h", ".hpp"))]
            if not headers:
                raise ToolchainError(f"{wheel.name} has no include folder; is it the {wheel.project} wheel?")
            for member, rel in headers:
                if rel.startswith("/") or ".." in rel.split("/"):
                    raise ToolchainError(f"{wheel.name} has a header outside its include folder: {member}")
                dest = Path(tmp, "include", rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(wheel.read(member))
        try:
            os.replace(Path(tmp, "include"), target)
        except OSError:  # another build extracted them meanwhile
            if not target.is_dir():
                raise
    return target


def cuda12_headers(note=None) -> Path:
    """CUDA 12 runtime headers (enough to read ``struct cudaDeviceProp``): the installed
    ``nvidia-cuda-runtime-cu12`` wheel's, else a fetched one's. Compiling against them also needs
    ``crt/`` (``wheel_headers(CUDA12_CRT)``)."""
    try:
        import nvidia.cuda_runtime

        for folder in nvidia.cuda_runtime.__path__:
            if _cudart_major(Path(folder, "include")) == 12:
                return Path(folder, "include")
    except ImportError:
        pass
    return wheel_headers(CUDA12_RUNTIME, note=note)


def cuda13_headers(note=None) -> Path:
    """CUDA 13 runtime headers, complete for compiling, of the CUDA the TVM wheel was built with."""
    return wheel_headers(*CUDA13_HEADERS, note=note)


_PROP = re.compile(r"\bstruct\s+(?:__device_builtin__\s+)?cudaDeviceProp\s*\{([^{}]*)\}")
_FIELD = re.compile(r"(?P<type>[A-Za-z_][\w ]*?) ?\b(?P<name>[A-Za-z_]\w*) ?(?P<dims>(?:\[ ?\w+ ?\] ?)*)")


def device_prop_fields(include: Path) -> dict[str, str]:
    """The fields of ``struct cudaDeviceProp`` in ``include/driver_types.h``, in order: name -> declaration
    (``"maxGridSize": "int maxGridSize[3]"``)."""
    path = include / "driver_types.h"
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ToolchainError(f"cannot read {path}: {err.strerror}") from None
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    match = _PROP.search(text)
    if match is None or "#" in match[1]:
        raise ToolchainError(f"{path} has no plain struct cudaDeviceProp definition edgeq can read")
    fields = {}
    for decl in match[1].split(";")[:-1]:
        decl = " ".join(decl.split())
        field = _FIELD.fullmatch(decl)
        if field is None:
            raise ToolchainError(f"{path}: cannot read the cudaDeviceProp field '{decl}'")
        fields[field["name"]] = f"{field['type']} {field['name']}{field['dims'].replace(' ', '')}"
    return fields


# ---------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------


def _x_list(macro: str, names: list[str]) -> str:
    return f"#define {macro}(X)" + "".join(f" \\\n    X({name})" for name in names) + "\n"


def _header(imports: list[str], cuda12_include: Path, cuda13_include: Path) -> str:
    fields12, fields13 = device_prop_fields(cuda12_include), device_prop_fields(cuda13_include)
    common = [n for n, decl in fields13.items() if fields12.get(n) == decl and not n.startswith("reserved")]
    only12 = [n for n in fields12 if n not in fields13]
    only13 = [n for n in fields13 if n not in fields12]
    struct = "".join(f"    {decl};\n" for decl in fields12.values())
    return (
        f"/* Generated by edgeq.runtime.bridge for cudart_bridge.c; do not edit.\n"
        f" * struct cudaDeviceProp of {cuda12_include}/driver_types.h, renamed; compared with\n"
        f" * {cuda13_include}/driver_types.h.\n"
        f" * Only in CUDA 12 (dropped): {', '.join(only12) or '-'}.\n"
        f" * Only in CUDA 13 (left zero): {', '.join(only13) or '-'}. */\n"
        f"#ifndef EDGEQ_CUDART_BRIDGE_H\n#define EDGEQ_CUDART_BRIDGE_H\n#include <stddef.h>\n\n"
        f"struct edgeq_cudaDeviceProp12 {{\n{struct}}};\n\n"
        f"/* every field of the CUDA 12 struct, in order */\n{_x_list('EDGEQ_PROP12_FIELDS', list(fields12))}\n"
        f"/* the fields both versions have, with the same type */\n{_x_list('EDGEQ_PROP_COMMON_FIELDS', common)}\n"
        f"/* what the TVM CUDA runtime imports: libcudart.so.12 must have them */\n"
        f"{_x_list('EDGEQ_BRIDGE_IMPORTS', imports)}\n#endif\n"
    )


def _version_script(imports: list[str]) -> str:
    exports = "".join(f"    {name};\n" for name in [*imports, *EXTRA_EXPORTS])
    return (
        "/* Generated by edgeq.runtime.bridge: the imports of the TVM CUDA runtime. */\n"
        f"{SONAME} {{\n  global:\n{exports}  local:\n    *;\n}};\n"
    )


def _compiler_missing(cc: str) -> ToolchainError:
    package = f"gcc-{cc[: -len('-gcc')].replace('_', '-')}" if cc.endswith("-gcc") else "gcc"
    return ToolchainError(f"C compiler '{cc}' for edgeq's CUDA 12 bridge not found on PATH; install it: "
                          f"sudo apt-get install {package}")


def build_bridge(imports: list[str], cc: str, out_dir: Path, cuda12_include: Path, cuda13_include: Path) -> Path:
    """Build ``out_dir/libcudart.so.13`` forwarding ``imports`` to libcudart.so.12, with compiler ``cc``
    (``gcc``, ``aarch64-linux-gnu-gcc``); kept when the same inputs built it before."""
    imports = sorted(set(imports))
    known = set(forwarded_functions())
    unknown = [name for name in imports if name not in known]
    if unknown:
        raise ToolchainError(
            f"the TVM CUDA runtime imports {', '.join(unknown)}, which edgeq's CUDA 12 bridge does not forward; "
            f"add {'it' if len(unknown) == 1 else 'them'} to EDGEQ_CUDART_FORWARD in templates/native/cudart_bridge.c"
        )
    compiler = shutil.which(cc)
    if compiler is None:
        raise _compiler_missing(cc)
    for include, major in ((cuda12_include, 12), (cuda13_include, 13)):
        if _cudart_major(Path(include)) != major:
            raise ToolchainError(f"{include} does not hold the CUDA {major} runtime headers (cuda_runtime_api.h)")
    source = _source()
    header = _header(imports, Path(cuda12_include), Path(cuda13_include))
    script = _version_script(imports)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"cudart_bridge.c": source, HEADER: header.encode(), "libcudart.so.13.map": script.encode()}
    target, stamp = out_dir / SONAME, out_dir / f"{SONAME}.inputs"
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-I", str(out_dir), "-I", str(cuda13_include),
           f"-Wl,-soname,{SONAME}", f"-Wl,--version-script={out_dir / 'libcudart.so.13.map'}",
           "-Wl,--no-undefined-version", "-Wl,-z,defs", "-o", str(target) + ".tmp", str(out_dir / "cudart_bridge.c"),
           "-ldl", "-lpthread"]
    digest = hashlib.sha256(repr((cmd, sorted(paths.items()))).encode()).hexdigest()
    if target.is_file() and stamp.is_file() and stamp.read_text() == digest:
        return target
    for name, data in paths.items():
        (out_dir / name).write_bytes(data)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ToolchainError(f"cannot run {cc} to build edgeq's CUDA 12 bridge: {err}") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no message"]
        first = next((line for line in lines if "error" in line), lines[-1])
        raise ToolchainError(f"building edgeq's CUDA 12 bridge with {cc} failed: {first.strip()[:300]}")
    os.replace(str(target) + ".tmp", target)
    stamp.write_text(digest)
    return target


# ---------------------------------------------------------------------------------------------------
# On the device: a pip-installed TVM (CUDA 13 runtime) on a CUDA 12 machine, through the bridge
# ---------------------------------------------------------------------------------------------------


def build_native_bridge(note=None) -> Path:
    """The bridge for this machine (its C compiler, the TVM wheel installed here), built once and cached."""
    import platform


    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ToolchainError("no C compiler (cc) to build the CUDA bridge; install gcc, or pass --cuda-bridge "
                             "runtime/libcudart.so.13 from a bundle packaged for this device")
    out = cache_dir() / f"cudart-bridge-{platform.machine()}"
    return build_bridge(cudart_imports(installed_cuda_runtime()), cc, out, cuda12_headers(note), cuda13_headers(note))


def check_bridge_file(bridge: Path) -> Path:
    """A bridge the user named: it must exist (checked before any waiting or loading)."""
    if not Path(bridge).is_file():
        raise ToolchainError(f"CUDA bridge not found: {bridge} (a bundle's runtime/libcudart.so.13)")
    return Path(bridge)


def enable_tvm_cuda(bridge: Path | None = None, note=None) -> str | None:
    """Make the installed TVM's CUDA backend usable here: load ``bridge`` as ``libcudart.so.13``, then TVM's
    ``libtvm_runtime_cuda.so`` (which registers the CUDA device). Works before or after ``import tvm``.
    Without ``bridge``: nothing to do where a CUDA 13 runtime loads or no CUDA runtime is there at all (None);
    where only CUDA 12's is, a bridge built here. Returns what it did, in words; raises ToolchainError with
    one line when the bridge cannot help."""
    import ctypes

    from edgeq.tvm_env import import_tvm

    if bridge is None:
        for soname in (SONAME, "libcudart.so.12"):
            try:
                ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        else:
            return None  # no CUDA runtime here: a CPU device
        if soname == SONAME:
            return None  # TVM's own CUDA runtime works here
        bridge = build_native_bridge(note)
    check_bridge_file(bridge)
    try:
        lib = ctypes.CDLL(str(bridge), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise ToolchainError(f"cannot load the CUDA bridge {bridge}: {err}") from None
    lib.edgeq_cudart_bridge_error.restype = ctypes.c_char_p
    problem = lib.edgeq_cudart_bridge_error()
    if problem:
        raise ToolchainError(problem.decode("utf-8", "replace"))
    tvm = import_tvm()
    if not tvm.runtime.enabled("cuda"):
        try:
            ctypes.CDLL(str(installed_cuda_runtime()), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise ToolchainError(f"TVM's CUDA runtime does not load through the bridge: {err}") from None
    lib.edgeq_cudart_bridge_target.restype = ctypes.c_char_p
    target = (lib.edgeq_cudart_bridge_target() or b"?").decode("utf-8", "replace")
    return f"TVM's CUDA runtime reaches {target} through the bridge {bridge}"
