"""Both loaders on the same generated documents (#41): run.py and edgeq-run read the same manifests, images, .npy
files and weight tables through two parsers, one Python and one C++. Seeded cases, valid and damaged, go to
both; the exit status, the answer (stdout of --json) and the output bytes must agree.

Used by tests/test_differential.py (a few hundred cases in the suite) and benchmarks/differential.py (more).
run.py runs in this process (its module loaded from the bundle folder, main(argv) called): a fresh interpreter
per case would cost a second each for importing TVM. edgeq-run runs as a process, as on a device.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

SHAPE = [1, 3, 12, 10]  # the bundle's image input: NCHW, 12 high, 10 wide
CLASSES = 5


def model(path: Path) -> Path:
    """logits (first: --postprocess classify reads it) and y = -(-x) (the loaders' input tensor, bit for bit):
    logits = flatten(x) @ W (a weight table to damage)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((int(np.prod(SHAPE)), CLASSES)).astype(np.float32)
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Neg", ["n"], ["y"]),
             helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("MatMul", ["f", "w"], ["logits"])]
    graph = helper.make_graph(nodes, "differential", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, CLASSES]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
                              [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


PACKAGE_OPTIONS = ("--preprocess", "fit=letterbox,mean=0.5/0.4/0.3,std=0.25", "--postprocess", "classify",
                   "--top-k", "3", "--runtime", "bundled")


@dataclass
class Case:
    name: str
    args: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # bundle files replaced (manifest.json, weights.bin, ...)
    rehash: list[str] = field(default_factory=list)  # replaced files whose size and hash the manifest is made to match


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    outputs: dict[str, bytes] | None  # name -> dtype, shape and bytes of what --output wrote


# ---------------------------------------------------------------------------------------------- generation


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    import zlib

    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _image(rng: np.random.Generator) -> tuple[str, bytes]:
    h, w = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    if rng.random() < 0.1:  # long strips: the letterbox geometry's edge cases
        h, w = (1, int(rng.integers(40, 400))) if rng.random() < 0.5 else (int(rng.integers(40, 400)), 1)
    pixels = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    mode = str(rng.choice(["RGB", "L", "RGBA", "P", "1", "LA"]))
    picture = Image.fromarray(pixels[:, :, :3]) if mode != "L" else Image.fromarray(pixels[:, :, 0])
    picture = Image.fromarray(pixels) if mode == "RGBA" else picture.convert(mode)
    buf = io.BytesIO()
    if mode in ("RGB", "L") and rng.random() < 0.4:
        picture.save(buf, "JPEG", quality=int(rng.integers(30, 96)), progressive=bool(rng.random() < 0.3))
        return f"{mode} {w}x{h} jpeg", buf.getvalue()
    picture.save(buf, "PNG")
    data = buf.getvalue()
    if rng.random() < 0.2:  # an ancillary chunk after IHDR: text, gamma, an unknown private one
        chunk = _png_chunk(*[(b"tEXt", b"k\0v"), (b"gAMA", (100000).to_bytes(4, "big")), (b"prVt", bytes(5))][int(rng.integers(3))])
        data = data[:33] + chunk + data[33:]
    return f"{mode} {w}x{h} png", data


def _damage(rng: np.random.Generator, data: bytes) -> tuple[str, bytes]:
    data = bytearray(data)
    how = int(rng.integers(5))
    if how == 0:
        k = int(rng.integers(len(data)))
        data[k] ^= 1 << int(rng.integers(8))
        return f"bit flipped at {k}", bytes(data)
    if how == 1:
        k = int(rng.integers(len(data)))
        return f"truncated to {k}", bytes(data[:k])
    if how == 2:
        k = int(rng.integers(len(data)))
        return f"4 bytes inserted at {k}", bytes(data[:k] + rng.integers(0, 256, 4, dtype=np.uint8).tobytes() + data[k:])
    if how == 3:
        return "garbage appended", bytes(data) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    k = int(rng.integers(min(len(data), 64)))
    data[k] = int(rng.integers(256))
    return f"header byte {k} set", bytes(data)


def _npy(rng: np.random.Generator) -> tuple[str, bytes]:
    shape = list(SHAPE)
    dtype = np.float32
    what = "valid"
    pick = rng.random()
    if pick < 0.15:
        dtype = [np.float64, np.float16, np.int32, np.uint8, ">f4"][int(rng.integers(5))]
        what = f"dtype {np.dtype(dtype).str}"
    elif pick < 0.3:
        shape = [int(v) for v in rng.integers(1, 5, int(rng.integers(0, 5)))]
        what = f"shape {shape}"
    array = (rng.standard_normal(shape) * 3).astype(dtype)
    if rng.random() < 0.1:
        array = np.asfortranarray(array)
        what += ", Fortran order"
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=[(1, 0), (2, 0), (3, 0)][int(rng.integers(3))])
    return what, buf.getvalue()


def _leaves(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))


def _other_value(rng: np.random.Generator, old):
    choices = [None, True, False, 0, -1, 1, 2, 0.5, 1e300, -7, 1 << 40, "", "x", "float64", "int8", "RGB", "BGR",
               "NHWC", "letterbox", "stretch", "yolo", [], [1], [0.0], {}, {"a": 1}]
    if isinstance(old, bool):
        return not old
    if isinstance(old, (int, float)) and rng.random() < 0.6:
        return [old + 1, old - 1, -old, old * 2, 0, old / 3, old * 1000][int(rng.integers(7))]
    return choices[int(rng.integers(len(choices)))]


def _mutate_manifest(rng: np.random.Generator, manifest: dict) -> tuple[str, dict]:
    m = copy.deepcopy(manifest)
    # the sections both loaders read to run. Not 'files'/'sizes' (a change there is always the same refusal), and
    # not 'runtime': the TVM runtime edgeq-run loads, where run.py uses the Python's own TVM by design
    paths = [p for p in _leaves(m) if p and p[0] in ("inputs", "outputs", "preprocess", "postprocess", "weights",
                                                      "golden", "device", "schema_version", "library", "toolchain",
                                                      "bundle_id", "name", "quantization")]
    path = paths[int(rng.integers(len(paths)))]
    parent = m
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if rng.random() < 0.2:
        del parent[key]
        return f"{'.'.join(map(str, path))} removed", m
    parent[key] = _other_value(rng, parent[key])
    return f"{'.'.join(map(str, path))} = {json.dumps(parent[key])[:40]}", m


def cases(seed: int, count: int, bundle: Path, scratch: Path) -> list[Case]:
    """``count`` cases of every kind, from ``seed``: images, .npy inputs, manifests, weight and golden tables."""
    rng = np.random.default_rng(seed)
    manifest = json.loads((bundle / "manifest.json").read_text())
    scratch.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        kind = ["image", "image", "npy", "manifest", "manifest", "table"][i % 6]
        if kind in ("image", "npy"):  # an --input file, damaged half (images) or 40% (.npy) of the time
            what, data = _image(rng) if kind == "image" else _npy(rng)
            if rng.random() < (0.5 if kind == "image" else 0.4):
                how, data = _damage(rng, data)
                what += ", " + how
            path = scratch / f"{i}.{'npy' if kind == 'npy' else 'jpg' if 'jpeg' in what else 'png'}"
            path.write_bytes(data)
            given = str(path) if kind == "image" else f"x={path}"
            out.append(Case(f"{i} {kind} {what}", ["--input", given, "--json"]))
        elif kind == "manifest":
            what, changed = _mutate_manifest(rng, manifest)
            image = scratch / f"{i}.png"
            image.write_bytes(_image(rng)[1] if rng.random() < 0.5 else _image(np.random.default_rng(i))[1])
            args = ["--self-test", "--json"] if rng.random() < 0.5 else ["--input", str(image), "--json"]
            out.append(Case(f"{i} manifest {what}, {args[0]}", args,
                            {"manifest.json": json.dumps(changed, indent=1).encode()}))
        else:
            table = manifest["weights"]["file"] if rng.random() < 0.6 else manifest["golden"]["file"]
            data = bytearray((bundle / table).read_bytes())
            k = int(rng.integers(len(data)))
            data[k] ^= 1 << int(rng.integers(8))
            rehashed = rng.random() < 0.7
            out.append(Case(f"{i} {table} bit flipped at {k}{', rehashed' if rehashed else ''}", ["--self-test", "--json"],
                            {table: bytes(data)}, [table] if rehashed else []))
    return out


# ---------------------------------------------------------------------------------------------- running


def case_bundle(bundle: Path, case: Case, folder: Path) -> Path:
    """The bundle with the case's files replaced: every other file hard-linked, not copied."""
    if not case.files:
        return bundle
    for src in bundle.rglob("*"):
        dst = folder / src.relative_to(bundle)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif src.name not in case.files or src.parent != bundle:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    if case.rehash:
        manifest = json.loads((folder / "manifest.json").read_text())
        for name in case.rehash:
            manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
            manifest["sizes"][name] = (folder / name).stat().st_size
        (folder / "manifest.json").unlink()  # a hard link to the shared bundle's: never written through
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


_RUN_PY: dict[Path, object] = {}


def run_py(bundle: Path, args: list[str]) -> tuple[int, str, str]:
    """run.py's main(args) in this process, its module loaded from the bundle folder."""
    module = _RUN_PY.get(bundle)
    if module is None:
        spec = importlib.util.spec_from_file_location(f"edgeq_differential_run_{len(_RUN_PY)}", bundle / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _RUN_PY[bundle] = module
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = int(module.main(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # what a fresh interpreter would print as a traceback, exit 1
            import traceback

            code = 1
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue()


def run_native(bundle: Path, args: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run([str(bundle / "runtime" / "edgeq-run"), *args], capture_output=True, timeout=120,
                          cwd=bundle, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


def _read_outputs(path: Path) -> dict[str, bytes] | None:
    if not path.exists():
        return None
    with np.load(path) as z:
        return {k: f"{z[k].dtype} {z[k].shape} ".encode() + z[k].tobytes() for k in z.files}


def run_both(bundle: Path, case: Case, work: Path) -> tuple[Result, Result]:
    folder = case_bundle(bundle, case, work / "bundle")
    results = []
    for loader, run in (("py", run_py), ("native", run_native)):
        out = work / f"{loader}.npz"
        args = case.args + (["--output", str(out)] if "--input" in case.args else [])
        code, stdout, stderr = run(folder, args)
        results.append(Result(code, stdout, stderr, _read_outputs(out)))
    return results[0], results[1]


def disagreement(py: Result, native: Result) -> str | None:
    """Why the two results differ, or None when they agree: the exit status; refused in one line with nothing
    written; or the same answer and the same output bytes."""
    if py.code != native.code:
        return f"exit {py.code} vs {native.code}: {py.stderr.strip()[-300:]!r} / {native.stderr.strip()[-300:]!r}"
    if py.code not in (0, 1):
        for name, r in (("run.py", py), ("edgeq-run", native)):
            if len(r.stderr.strip().splitlines()) != 1:
                return f"{name} refused in {len(r.stderr.strip().splitlines())} lines: {r.stderr[-300:]!r}"
            if r.outputs is not None:
                return f"{name} refused and still wrote its outputs"
        return None
    try:
        a, b = json.loads(py.stdout), json.loads(native.stdout)
    except ValueError:
        return f"not JSON: {py.stdout[-200:]!r} / {native.stdout[-200:]!r}"
    if a != b:
        return f"answers differ: {json.dumps(a)[:300]} / {json.dumps(b)[:300]}"
    if py.outputs != native.outputs:
        return "output bytes differ"
    return None


def run_cases(bundle: Path, all_cases: list[Case], work: Path, progress=None) -> tuple[list[str], dict[int, int]]:
    """(disagreements as 'case: why', {exit status: cases})."""
    import shutil

    bad, codes = [], {}
    for k, case in enumerate(all_cases):
        case_work = work / str(k)
        case_work.mkdir(parents=True)
        py, native = run_both(bundle, case, case_work)
        why = disagreement(py, native)
        if why:
            bad.append(f"{case.name}: {why}")
        codes[py.code] = codes.get(py.code, 0) + 1
        shutil.rmtree(case_work)
        if progress:
            progress(k + 1, len(all_cases))
    return bad, codes


def package(out: Path) -> Path:
    """The bundle every case starts from."""
    onnx_path = model(out / "differential.onnx")
    proc = subprocess.run([sys.executable, "-m", "edgeq", "package", str(onnx_path), "--device", "host", "-o",
                           str(out / "dist"), "-q", "--json", *PACKAGE_OPTIONS], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return Path(json.loads(proc.stdout)["bundle_dir"])
