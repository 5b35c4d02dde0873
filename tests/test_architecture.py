"""The shape of the code, held by tests: no import cycles, TVM started in one place, the device side on the
standard library, and no target branches in the build's driver (edgeq.backends decides)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the folders that make the edgeq package (pyproject's package-dir)
PACKAGE_DIRS = {"packager": "edgeq", "rpc": "edgeq.rpc", "targets": "edgeq.targets", "templates": "edgeq.templates"}
# what a bundle carries and runs on a device, outside edgeq
DEVICE_SIDE = ("templates/run.py", "templates/contract.py", "templates/safebundle.py", "templates/imaging.py",
               "templates/video.py")
# what the device side may use where the device has it, imported inside functions with a fallback
DEVICE_OPTIONAL = {"numpy", "tvm", "cryptography", "PIL", "cv2"}  # PIL, cv2: run.py --input IMAGE, where installed


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def _imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The edgeq modules a module imports, anywhere in it (a function's import is a dependency too), and, in a
    module that calls ``importlib.import_module``, every module a string constant names ("edgeq.x.y" or
    "edgeq.x.y:Name", as edgeq.backends.BACKENDS does): an import by name is an edge like any other."""
    found = set()
    by_name = any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))
    for node in ast.walk(tree):
        if by_name and isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value.split(":")[0])
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("edgeq"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
    return {m for m in found if m in modules}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}
    assert import_cycles(graph) == []


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def test_imports_by_name_are_edges():
    """edgeq.backends loads its backends with importlib.import_module from the strings of BACKENDS: the
    cycle test sees those edges (a backend importing edgeq.compile was a cycle it did not see)."""
    graph = _graph()
    assert {"edgeq.backends.cpu.backend", "edgeq.backends.cuda.backend"} <= graph["edgeq.backends"]
    planted = {**graph, "edgeq.backends.cuda.backend": graph["edgeq.backends.cuda.backend"] | {"edgeq.compile"}}
    assert any("edgeq.compile" in c and "edgeq.backends" in c for c in import_cycles(planted))


def test_backends_import_nothing_above_them():
    """A backend is below the driver: it imports no module that imports edgeq.backends (package, compile, the
    CLI, rpc, records ...), not even inside a function."""
    graph = _graph()
    inside = {name for name in graph if name == "edgeq.backends" or name.startswith("edgeq.backends.")}
    above = {name for name, deps in graph.items() if name not in inside and deps & inside}
    offenders = {name: sorted(graph[name] & above) for name in inside if graph[name] & above}
    assert offenders == {}


def private_imports(tree: ast.AST) -> list[str]:
    """The private names (one leading underscore) a module takes from another edgeq module: ``from edgeq.x import
    _name``, or ``m._name`` of a module ``m`` it imported from edgeq."""
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("edgeq"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            modules.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("edgeq")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_takes_a_private_name_from_another():
    """A helper two modules share is public in one place (the CUDA path's Relax helpers: cutlass/match.py; the ONNX
    converters': onnx_ops/context.py), not a private name reached into (#65). TVM's own modules, which edgeq takes
    through edgeq.tvm_env, are TVM's API (its ONNX frontend's ``_get_convert_map``: pinned with the TVM version)."""
    found = {name: [f for f in private_imports(ast.parse(path.read_text())) if not f.startswith("edgeq.tvm_env.")]
             for name, path in _modules().items()}
    assert {name: names for name, names in found.items() if names} == {}
    planted = "from edgeq.backends.cuda.cutlass import match\nfrom edgeq.graph import _x\nmatch._ty(v)\n"
    assert private_imports(ast.parse(planted)) == ["edgeq.graph._x", "edgeq.backends.cuda.cutlass.match._ty"]


def test_the_cutlass_package_is_one_job_a_module():
    """cutlass.py (3,459 lines, 15 jobs) is a package: no module of it over 800 lines, the hand-written C++ in
    headers that NVRTC finds with -I (package data), and code only tests run (the numpy replays, the cubin
    reports) under tests/ (#65)."""
    from edgeq.backends.cuda.cutlass.nvrtc import EDGEQ_INCLUDE

    folder = REPO / "packager" / "backends" / "cuda" / "cutlass"
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert not (REPO / "packager" / "backends" / "cuda" / "cutlass.py").exists()
    assert max(sizes.values()) <= 800, sizes
    headers = sorted(p.name for p in (EDGEQ_INCLUDE / "edgeq_cutlass").glob("*.h"))
    assert headers == ["epilogues.h", "store_iterators.h"]
    assert '"edgeq.backends.cuda.cutlass" = ["include/edgeq_cutlass/*.h"]' in (REPO / "pyproject.toml").read_text()
    source = "".join(p.read_text() for p in folder.glob("*.py"))
    assert "class Requantize" not in source and "def replay" not in source and "def read_kernels" not in source


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def _module_level_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue  # for type checkers only: never runs
        elif isinstance(node, ast.Try | ast.If):  # guarded imports at module level count too
            names += _module_level_imports(ast.Module(body=[*node.body, *getattr(node, "orelse", [])], type_ignores=[]))
    return names


def test_tvm_is_imported_in_one_place():
    """Only edgeq.tvm_env imports TVM at module level: everything else takes it from there, so no import
    order can load TVM before the CUDA driver (or edgeq's stub) is loaded."""
    offenders = []
    for name, path in _modules().items():
        if name == "edgeq.tvm_env":
            continue
        roots = {m.split(".")[0] for m in _module_level_imports(ast.parse(path.read_text()))}
        if roots & {"tvm", "tvm_ffi"}:
            offenders.append(name)
    assert offenders == []


def test_no_e402_under_the_package():
    """No import after code in edgeq's own modules (run.py's guard of sys.path is the device side's one)."""
    hits = [str(p.relative_to(REPO)) for folder in ("packager", "rpc", "targets") for p in (REPO / folder).rglob("*.py")
            if "noqa: E402" in p.read_text()]
    assert hits == []


@pytest.mark.parametrize("relative", DEVICE_SIDE)
def test_device_side_uses_the_standard_library(relative):
    """What runs on a device needs nothing installed: module-level imports are the standard library (or the
    bundle's own files); numpy, TVM and cryptography only inside functions, where the device has them."""
    tree = ast.parse((REPO / relative).read_text())
    stdlib = set(sys.stdlib_module_names) | {"__future__", "contract", "safebundle"}
    top = {m.split(".")[0] for m in _module_level_imports(tree)}
    assert top - stdlib - {"edgeq"} == set(), relative
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            inner |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            inner.add((node.module or "").split(".")[0])
    assert inner - stdlib - DEVICE_OPTIONAL - {"edgeq"} == set(), relative


def test_edgeq_imports_on_the_device_side_are_only_each_other():
    """contract.py and safebundle.py travel in a bundle beside run.py: their imports of edgeq are of each
    other only (with a fallback to the file beside them)."""
    for relative in DEVICE_SIDE:
        tree = ast.parse((REPO / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgeq"):
                assert {a.name for a in node.names} <= {"contract", "safebundle"}, (relative, ast.dump(node))


# a target branch: a test of whether the profile or target is CUDA or a CPU (a profile's CUDA table, the
# target's kind, a device picked by name); "edgeq.backends.cuda" as a module path is not one
TARGET_BRANCH = re.compile(r"\bis_cpu\b|(?<!backends)\.cuda\b(?!_)|profile\.kind\b|kind\.name\b|[=!]= *[\"'](cuda|cpu)[\"']")
# every module of the build outside the backends and the profile table (which say what a target is), and
# outside the device side (templates/: the loaders open the device the bundle was built for)
DRIVER = sorted(str(p.relative_to(REPO)) for folder in ("packager", "rpc") for p in (REPO / folder).rglob("*.py")
                if "backends" not in p.relative_to(REPO).parts)


def target_branches(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if TARGET_BRANCH.search(ln)]


@pytest.mark.parametrize("relative", DRIVER)
def test_no_target_branches_in_the_driver(relative):
    """Only a backend knows its target (edgeq.backends): the rest of the build asks it."""
    assert target_branches((REPO / relative).read_text()) == []


def test_the_target_branch_finder_finds_planted_branches():
    assert target_branches('if profile.kind == "cuda":\n    pass') != []
    assert target_branches("dev = sess.cuda(0) if cuda else sess.cpu(0)") != []
    assert target_branches('device = "cuda" if tgt.kind.name == "cuda" else "cpu"') != []
    assert target_branches("members = [*LIBRARIES, *([CUDA_LIBRARY] if profile.cuda else [])]") != []
    assert target_branches("from edgeq.backends.cuda.cubin import cuda_images") == []
    assert target_branches("toolkit = m.toolchain.cuda_toolkit") == []


def test_every_profile_has_a_backend():
    from edgeq import backends
    from edgeq.targets import profiles

    for profile in profiles().values():
        assert profile.kind in backends.BACKENDS, profile.name
        backend = backends.for_profile(profile)
        assert backend.name == profile.kind
        assert "fp32" in backend.precisions


def test_the_device_side_lives_under_templates():
    """Everything a bundle carries or a device runs is under templates/: the loaders, the contract, the
    verifier, the native loader's sources and the CUDA bridge. Each module has one name: edgeq.templates.X
    (the aliases edgeq.contract, edgeq.safebundle and edgeq.imaging are gone)."""
    import importlib.util

    from edgeq import bundle

    for alias in ("contract", "safebundle", "imaging"):
        assert importlib.util.find_spec(f"edgeq.{alias}") is None, alias
        assert importlib.util.find_spec(f"edgeq.templates.{alias}") is not None, alias
    for name, path in bundle.SHIPPED.items():
        assert Path(path).resolve().parent == REPO / "templates", name
    native = REPO / "templates" / "native"
    assert {p.name for p in native.iterdir()} >= {"edgeq_run.cc", "cudart_bridge.c", "sha256.h", "json.h", "npy.h", "zip.h"}


def test_loader_headers_stand_alone(tmp_path):
    """Each of edgeq-run's headers compiles on its own (it includes what it uses); contract.h is the one
    generated from contract.py."""
    import shutil
    import subprocess

    from edgeq.runtime.assemble import generated_headers

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    for header in (REPO / "templates" / "native").glob("*.h"):
        shutil.copy(header, tmp_path / header.name)
    for name, text in generated_headers().items():
        (tmp_path / name).write_bytes(text)
    for header in sorted(tmp_path.glob("*.h")):
        unit = tmp_path / "unit.cc"
        unit.write_text(f'#include "{header.name}"\n')
        proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-Wno-unused-function", str(unit)],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, (header.name, proc.stderr[:2000])


def test_the_loader_contract_is_generated_from_contract_py():
    from edgeq.templates import contract, safebundle
    from edgeq.runtime.assemble import contract_header

    text = contract_header().decode()
    assert f"constexpr int kSchemaVersion = {contract.SCHEMA_VERSION};" in text
    for status in contract.LoaderExit:
        assert f" = {int(status)}," in text
    assert f"kMaxManifestBytes = {safebundle.MAX_MANIFEST_BYTES};" in text
    assert ", ".join(f'"{k}"' for k in contract.latency_statistics([2.0, 1.0])) in text
    source = (REPO / "templates" / "native" / "edgeq_run.cc").read_text()
    assert "EDGEQ_SCHEMA_VERSION" not in source and "kBundle = 7" not in source  # written once, in contract.py


# ---- the native loader reads the manifest by contract.py's fields ------------------------------------------

NATIVE_SOURCES = REPO / "templates" / "native"
# Fields of contract.Manifest's records that edgeq-run does not read, and why. A field added to contract.py is
# either read by edgeq_run.cc (or its headers) or listed here: test_native_loader_reads_the_contracts_fields.
NATIVE_IGNORES = {
    # what the bundle is and how it was made: for people and edgeq inspect, not for running it
    "Manifest.release", "Manifest.signed", "Manifest.created", "Manifest.edgeq_version", "Manifest.tvm_version",
    "Manifest.precision", "Manifest.model", "Manifest.reference_check", "Manifest.quantization", "Manifest.build",
    "Manifest.compatibility", "ModelRecord.*", "ReferenceCheck.*", "QuantizationReport.*", "LayerRow.*",
    "WeightBytes.*", "ToolchainRecord.cxx", "CudaToolkitRecord.output_format", "RuntimeRecord.sources",
    "GoldenRecord.seed", "GoldenRecord.float_inputs", "GoldenRecord.computed_with",
    # the self-test's atol scaling is the loaders' code (run.py and edgeq-run alike); the field documents it
    "GoldenRecord.atol_scaled_by",
    # the device as profiled: edgeq bench and fleet read these on the host (power rails), the loader checks
    # the device itself (arch, profile, cuda_arch and the toolkit's major)
    "DeviceRecord.description", "DeviceRecord.family", "DeviceRecord.host_triple", "DeviceRecord.mcpu",
    "DeviceRecord.cores", "DeviceRecord.cuda_version", "DeviceRecord.jetpack", "DeviceRecord.l4t",
    "DeviceRecord.power", "PowerRecord.*",
    # checked from the files themselves (ELF machine, sizes, the schema's kinds), not from these fields
    "LibraryRecord.machine", "LibraryRecord.cuda_device_code", "LibraryRecord.cpu_kernels",
    "LibraryRecord.gpu_kernels", "WeightsRecord.dtypes", "WeightsRecord.file_bytes",
    # a language model's shape and its weights' scheme: for edgeq inspect and the host checks; the loaders run the
    # steps as compiled
    "GenerateRecord.layers", "GenerateRecord.kv_heads", "GenerateRecord.head_dim", "GenerateRecord.cache_dtype",
    "GenerateRecord.weight_bits", "GenerateRecord.weight_group", "GenerateRecord.weight_scheme",
    "GenerateRecord.activation_bits",
}
# tokenizer.h reads a language model's tokenizer.json (Hugging Face's format), not the manifest
MANIFEST_READERS = [p for p in sorted(NATIVE_SOURCES.glob("*.[ch]*")) if p.name != "tokenizer.h"]


def native_keys(source: str) -> set[str]:
    """The JSON keys the native loader reads: ``At("k"``, ``Find("k")``, ``optional("k")`` and the keys of
    ``for (const char* key : {"a", "b"})`` loops."""
    keys = set(re.findall(r'(?:\bAt|\bFind|\boptional)\("([a-z_0-9]+)"', source))
    for group in re.findall(r"const char\* *\w+ *: *\{([^}]*)\}", source):
        keys |= set(re.findall(r'"([a-z_0-9]+)"', group))
    return keys


def contract_fields() -> dict[str, list[str]]:
    """Record name -> its fields, for every record a manifest holds (contract.Manifest and what it nests)."""
    import dataclasses

    from edgeq.templates import contract

    found: dict[str, list[str]] = {}

    def walk(cls) -> None:
        if cls.__name__ in found:
            return
        found[cls.__name__] = [f.name for f in dataclasses.fields(cls)]
        for f in dataclasses.fields(cls):
            kind = f.metadata["kind"]
            while isinstance(kind, contract.OptionalKind | contract.ListKind | contract.DictKind):
                kind = kind.kind
            if isinstance(kind, contract.RecordKind):
                walk(kind.cls)

    walk(contract.Manifest)
    return found


def native_gaps(fields: dict[str, list[str]], keys: set[str], ignores: set[str]) -> list[str]:
    """Contract fields neither read by the native loader nor ignored with a reason."""
    return [f"{record}.{name}" for record, names in fields.items() for name in names
            if name not in keys and f"{record}.{name}" not in ignores and f"{record}.*" not in ignores]


def test_native_loader_reads_the_contracts_fields():
    """Every field of the manifest's records is read by edgeq-run or listed in NATIVE_IGNORES with why, and
    every key edgeq-run reads is a field of the contract (or of manifest.sig): a field added to contract.py
    and forgotten in the C++ fails here."""
    source = "".join(p.read_text() for p in MANIFEST_READERS)
    keys, fields = native_keys(source), contract_fields()
    assert native_gaps(fields, keys, NATIVE_IGNORES) == []
    signature_file = {"algorithm", "key_id", "signature"}  # manifest.sig's JSON (safebundle.signature_for)
    assert keys - {name for names in fields.values() for name in names} - signature_file == set()
    for entry in NATIVE_IGNORES:  # no stale entry
        record, _, name = entry.partition(".")
        assert record in fields and (name == "*" or name in fields[record]), entry


def test_a_field_added_to_the_contract_and_not_to_the_loader_is_a_gap():
    fields = {**contract_fields()}
    fields["PostprocessRecord"] = [*fields["PostprocessRecord"], "stride"]  # planted: a new field
    source = "".join(p.read_text() for p in MANIFEST_READERS)
    assert native_gaps(fields, native_keys(source), NATIVE_IGNORES) == ["PostprocessRecord.stride"]
    assert native_keys('if (const Json* v = optional("stride")) x = v->Int("postprocess.stride");') == {"stride"}


def test_tvmscript_decorators_see_the_callers_frames_through_edgeqs_cheap_stack():
    """``edgeq.tvm_env`` gives TVMScript's decorators an ``inspect.stack()`` that reads source lines of the three
    innermost frames only (the full one made importing TVM's tensor intrinsics take 21 s): the frames are the
    same objects, the three innermost carry their line, and a prim_func that names a local of its caller in an
    annotation (what TVM walks the frames for) still parses."""
    import inspect

    import numpy as np

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    import tvm.tirx.script.parser.entry as entry

    def frames():
        return entry.inspect.stack(), inspect.stack()

    cheap, full = frames()
    assert [f.frame for f in cheap] == [f.frame for f in full]
    assert [f.code_context for f in cheap[:3]] == [f.code_context for f in full[:3]]
    assert all(f.code_context is None for f in cheap[3:]) and entry.inspect.getmodule is inspect.getmodule
    from tvm.script import tirx as T

    n = 8

    @T.prim_func
    def double(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n):
            b[i] = a[i] * T.float32(2)

    lib = tvm.tirx.build(double, target="llvm")
    a = tvm.runtime.tensor(np.arange(n, dtype=np.float32))
    b = tvm.runtime.tensor(np.zeros(n, np.float32))
    lib(a, b)
    np.testing.assert_array_equal(b.numpy(), np.arange(n) * 2)
