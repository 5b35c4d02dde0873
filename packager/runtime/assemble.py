"""The bundle's own runtime: ``runtime/`` with the TVM runtime libraries the model was compiled with (for
the device's architecture), the CUDA 12 bridge where the device's JetPack has CUDA 12, and the native
loader ``edgeq-run``. With it a device needs nothing installed: no Python, numpy, pip or TVM.

* TVM libraries: ``libtvm_ffi.so``, ``libtvm_runtime.so`` and the backend's own (``Backend.runtime_libraries``:
  CUDA's ``libtvm_runtime_cuda.so``) of exactly the installed apache-tvm / apache-tvm-ffi versions: from the
  installed wheels when the device has the build host's architecture, else from the same wheels for the
  device's (``edgeq.runtime.wheels``).
* What the backend adds before its last library (``Backend.runtime_shim``: CUDA's bridge ``libcudart.so.13``,
  ``edgeq.runtime.bridge``, where the device's JetPack has CUDA 12 and TVM's CUDA runtime links CUDA 13).
* ``edgeq-run`` (``templates/native/edgeq_run.cc``): built with the profile's C++ compiler against tvm-ffi's C API.

Every ELF is checked against the profile's OS (highest glibc / libstdc++ symbol versions it needs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from edgeq.templates import contract, imaging, safebundle
from edgeq.errors import ToolchainError
from edgeq.runtime import elf
from edgeq.runtime.wheels import Wheel, fetch, installed_version, package_dir
from edgeq.targets import Profile
from edgeq.cache import cached_build

RUNTIME_DIR = safebundle.RUNTIME  # the one sub-folder a bundle may have
LOADER = f"{RUNTIME_DIR}/edgeq-run"
TVM_PROJECT, FFI_PROJECT = "apache-tvm", "apache-tvm-ffi"
# (project, file inside the wheel) in load order; a backend's own libraries follow (Backend.runtime_libraries)
LIBRARIES = (
    (FFI_PROJECT, "tvm_ffi/lib/libtvm_ffi.so"),
    (TVM_PROJECT, "tvm/lib/libtvm_runtime.so"),
)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What ``assemble`` put under ``runtime/`` and the manifest's ``runtime`` section."""

    files: list[str]  # bundle-relative names
    record: dict


def _library_bytes(machine: str, project: str, member: str, wheels: dict[str, Wheel], note) -> bytes:
    """A runtime library for ``machine``: the installed file on a same-architecture host, else from the wheel."""
    if machine == platform.machine():
        top, _, rest = member.partition("/")
        return (package_dir(top) / rest).read_bytes()
    if project not in wheels:
        wheels[project] = fetch(project, installed_version(project), machine, note)
    return wheels[project].read(member)


def c_compiler(cxx: str) -> str:
    """The C compiler beside a C++ one (``aarch64-linux-gnu-g++`` -> ``aarch64-linux-gnu-gcc``)."""
    name = os.path.basename(cxx)
    cc = name[:-3] + "gcc" if name.endswith("g++") else "cc"
    path = shutil.which(os.path.join(os.path.dirname(cxx), cc)) or shutil.which(cc)
    if path is None:
        raise ToolchainError(f"C compiler '{cc}' not found beside {cxx}; install it with the C++ compiler's package")
    return path


def _schema_tables() -> str:
    """contract.Manifest's records as tables for edgeq-run's schema check (schema.h), which walks a manifest as
    ``Record.from_json`` does: the same fields, kinds and order, so both loaders refuse the same manifests."""
    tags = {id(contract.STR): "s", id(contract.INT): "i", id(contract.COUNT): "c", id(contract.NUM): "n",
            id(contract.BOOL): "b", id(contract.JSON): "j", id(contract.OBJECT): "o"}
    kinds, fields, records, record_ids = [], [], [], {}

    def kind(k) -> int:
        if id(k) in tags:
            entry = (tags[id(k)], -1)
        elif isinstance(k, contract.OptionalKind):
            entry = ("?", kind(k.kind))
        elif isinstance(k, contract.ListKind):
            entry = ("l", kind(k.kind))
        elif isinstance(k, contract.DictKind):
            entry = ("d", kind(k.kind))
        elif isinstance(k, contract.RecordKind):
            entry = ("r", record(k.cls))
        else:
            raise TypeError(f"contract kind {k!r} has no schema.h form")
        kinds.append(entry)
        return len(kinds) - 1

    def record(cls) -> int:
        if cls in record_ids:
            return record_ids[cls]
        record_ids[cls] = len(records)
        records.append(None)
        own = [(f.name, kind(f.metadata["kind"])) for f in dataclasses.fields(cls)]
        records[record_ids[cls]] = (len(fields), len(own), cls.__name__)
        fields.extend(own)
        return record_ids[cls]

    record(contract.Manifest)
    kind_rows = ",\n".join(f"    {{'{t}', {a}}}" for t, a in kinds)
    field_rows = ",\n".join(f'    {{"{n}", {k}}}' for n, k in fields)
    record_rows = "\n".join(f"    {{{first}, {count}}},  // {name}" for first, count, name in records)
    quant_kinds = ", ".join(f'"{k}"' for k in contract.QUANT_KINDS)
    return f"""// contract.Manifest as tables (edgeq.runtime.assemble._schema_tables): kinds 's' text, 'i' integer, 'c' count,
// 'n' number, 'b' true/false, 'j' any JSON, 'o' object; '?' optional, 'l' list, 'd' object of, 'r' record (arg)
struct SchemaKind {{ char tag; int arg; }};
struct SchemaField {{ const char* name; int kind; }};
struct SchemaRecord {{ int first, count; }};  // fields [first, first + count); record 0 is the manifest
constexpr SchemaKind kSchemaKinds[] = {{
{kind_rows}}};
constexpr SchemaField kSchemaFields[] = {{
{field_rows}}};
constexpr SchemaRecord kSchemaRecords[] = {{
{record_rows}
}};
constexpr int kQuantizationRecord = {record_ids[contract.QuantizationReport]};  // its 'kind' is one of kQuantKinds
constexpr const char* kQuantKinds[] = {{{quant_kinds}}};
"""


def contract_header() -> bytes:
    """``contract.h`` of edgeq-run: the loader contract's schema version, exit statuses, bounds and JSON keys,
    generated from ``contract.py`` and ``safebundle.py`` when the loader is built, so they are written once."""
    exits = "\n".join(f"  k{''.join(w.capitalize() for w in e.name.split('_'))} = {int(e)},"
                      for e in contract.LoaderExit)
    keys = list(contract.latency_statistics([1.0]))
    return f"""// contract.h: generated from templates/contract.py and templates/safebundle.py when edgeq-run is built
// (edgeq.runtime.assemble.contract_header); do not edit.
#pragma once

#include <cstddef>

namespace {{

constexpr int kSchemaVersion = {contract.SCHEMA_VERSION};  // contract.SCHEMA_VERSION
enum Exit {{  // contract.LoaderExit
{exits}
}};
constexpr size_t kMaxManifestBytes = {safebundle.MAX_MANIFEST_BYTES};  // safebundle.MAX_MANIFEST_BYTES
constexpr int kMaxJsonDepth = {safebundle.MAX_JSON_DEPTH};  // safebundle.MAX_JSON_DEPTH
constexpr unsigned long long kMaxImagePixels = {imaging.MAX_IMAGE_PIXELS};  // imaging.MAX_IMAGE_PIXELS
constexpr size_t kMaxImageFileBytes = {imaging.MAX_IMAGE_FILE_BYTES};  // imaging.MAX_IMAGE_FILE_BYTES
constexpr int kPadValue = {imaging.PAD_VALUE};  // imaging.PAD_VALUE
// imaging.BOX_COLOURS, BOX_LINE, FONT_W, FONT_H, FONT, TEXT_COLOUR: the boxes and labels drawn on video frames
constexpr unsigned char kBoxColours[][3] = {{{", ".join("{%d, %d, %d}" % c for c in imaging.BOX_COLOURS)}}};
constexpr int kBoxColourCount = {len(imaging.BOX_COLOURS)};
constexpr int kBoxLine = {imaging.BOX_LINE};
constexpr int kFontW = {imaging.FONT_W}, kFontH = {imaging.FONT_H};
constexpr unsigned char kFont[] = {{{", ".join(str(b) for b in imaging.FONT)}}};
constexpr unsigned char kTextColour[3] = {{{", ".join(str(c) for c in imaging.TEXT_COLOUR)}}};
constexpr long kMaxLabels = {contract.MAX_LABELS};  // contract.MAX_LABELS
constexpr long kMaxImageSide = {contract.MAX_IMAGE_SIDE};  // contract.MAX_IMAGE_SIDE
constexpr unsigned long long kMaxInputBytes = {contract.MAX_INPUT_BYTES}ull;  // contract.MAX_INPUT_BYTES: one --input .npy
constexpr double kMaxGoldenOutliers = {contract.MAX_GOLDEN_OUTLIERS!r};  // contract.MAX_GOLDEN_OUTLIERS
// the keys of contract.latency_statistics, in its order (edgeq-run --benchmark --json)
constexpr const char* kLatencyKeys[] = {{{", ".join(f'"{k}"' for k in keys)}}};
constexpr size_t kLatencyKeyCount = {len(keys)};
{_schema_tables()}
}}  // namespace
""".encode()


@functools.cache
def unicode_header() -> bytes:
    """``unicode_categories.h`` of edgeq-run: every code point's general category as runs of (first, last, category),
    from this Python's ``unicodedata``, which tokenizer.py's ``\\p{..}`` classes are built from too (a device's
    Python may know a later Unicode: characters assigned since are letters there and unassigned here)."""
    import sys
    import unicodedata

    names: dict[str, int] = {}
    runs = []
    for code in range(sys.maxunicode + 1):
        category = unicodedata.category(chr(code))
        if category == "Cn":
            continue
        index = names.setdefault(category, len(names))
        if runs and runs[-1][2] == index and runs[-1][1] == code - 1:
            runs[-1][1] = code
        else:
            runs.append([code, code, index])
    rows = ",\n".join(", ".join("{%d, %d, %d}" % tuple(r) for r in runs[i:i + 6]) for i in range(0, len(runs), 6))
    return f"""// unicode_categories.h: generated from Python's unicodedata (Unicode {unicodedata.unidata_version}) when edgeq-run
// is built (edgeq.runtime.assemble.unicode_header); do not edit. Unassigned code points (Cn) are in no run.
#pragma once

#include <cstdint>

namespace {{

constexpr const char* kUnicodeCategories[] = {{{", ".join(f'"{n}"' for n in names)}}};
constexpr uint32_t kUnicodeRuns[][3] = {{
{rows}}};

}}  // namespace
""".encode()


def generated_headers() -> dict[str, bytes]:
    """The headers edgeq-run's sources include that are generated when it is built (the tests and fuzz.sh write
    them beside the sources the same way)."""
    return {"contract.h": contract_header(), "unicode_categories.h": unicode_header()}


def build_loader(cxx: str) -> Path:
    """``edgeq-run`` for the compiler's target (``templates/native/``: ``edgeq_run.cc``, its headers and the
    generated ``contract.h`` and ``unicode_categories.h``), built once per (sources, compiler, tvm-ffi version) and cached."""
    native = resources.files("edgeq.templates").joinpath("native")
    source = native.joinpath("edgeq_run.cc").read_bytes()
    headers = {item.name: item.read_bytes() for item in native.iterdir() if item.name.endswith(".h")}
    headers.update(generated_headers())
    include = package_dir("tvm_ffi") / "include"
    flags = ["-std=c++17", "-O2", "-Wall", "-pthread", "-ffp-contract=off", f"-I{include}"]  # float32 as numpy rounds it
    return cached_build("edgeq-run", "edgeq-run", "edgeq_run.cc", source, cxx, flags, ("-ldl", "-pthread"),
                        key=installed_version(FFI_PROJECT), headers=headers)


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


def assemble(profile: Profile, backend, cxx: str, staging: Path, note=None) -> Runtime:
    """Write ``staging/runtime/`` for ``profile``: TVM's runtime libraries, the backend's (``edgeq.backends``:
    ``runtime_libraries``, ``runtime_shim``) and the loader; returns its files and manifest record."""
    folder = staging / RUNTIME_DIR
    folder.mkdir()
    machine = profile.cpu.arch
    wheels: dict[str, Wheel] = {}
    members = [*LIBRARIES, *backend.runtime_libraries(profile)]
    load_order, sources = [], []
    for project, member in members:
        name = f"{RUNTIME_DIR}/{member.rsplit('/', 1)[1]}"
        (staging / name).write_bytes(_library_bytes(machine, project, member, wheels, note))
        (staging / name).chmod(0o755)
        load_order.append(name)
    shim_record = None
    with tempfile.TemporaryDirectory() as tmp:
        shim = backend.runtime_shim(profile, cxx, staging / load_order[-1], Path(tmp))
        if shim is not None:  # loaded before the backend's last library, which needs it
            name, library, shim_record = shim
            shutil.copyfile(library, staging / name)
            (staging / name).chmod(0o755)
            load_order.insert(len(load_order) - 1, name)
    shutil.copyfile(build_loader(cxx), staging / LOADER)
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
        "cuda_bridge": shim_record,
        "sources": sources,
        "bytes": sum((staging / name).stat().st_size for name in files),
    }
    return Runtime(files=files, record=record)


def prefetch(machines=("aarch64",), note=print) -> list[Wheel]:
    """Fetch, once, every wheel a bundle for ``machines`` needs (the TVM runtime for each machine, and the
    CUDA headers the bridge is compiled against), so that later builds and the tests work offline."""
    from edgeq.runtime import bridge

    wanted = [(p, installed_version(p), m) for m in machines for p in ("apache-tvm", "apache-tvm-ffi")]
    wanted += [(p, v, bridge.HEADER_WHEEL_MACHINE) for p, v in (*bridge.CUDA13_HEADERS, bridge.CUDA12_RUNTIME,
                                                                 bridge.CUDA12_CRT)]
    # the aarch64 CUDA 12 runtime stands in for JetPack's in the tests (under qemu)
    wanted += [(bridge.CUDA12_RUNTIME[0], bridge.CUDA12_RUNTIME[1], m) for m in machines]
    return [fetch(project, version, machine, note) for project, version, machine in wanted]


if __name__ == "__main__":
    prefetch()
