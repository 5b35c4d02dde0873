"""Write a bundle: library, weights, golden vectors, manifest, loader and README rendered from the
templates, SHA256SUMS; then the .tar.gz. Also reads manifests back for ``edgeq inspect``."""

from __future__ import annotations

import gzip
import json
import os
import tarfile
import zlib
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from edgeq import safebundle
from edgeq.errors import BundleError

SCHEMA_VERSION = safebundle.SCHEMA_VERSION
LIBRARY = "model.so"
WEIGHTS = "weights.bin"
GOLDEN = "golden.bin"
TENSOR_FORMAT = "edgeq-raw-1"  # little-endian C-order arrays, each at a 64-byte aligned offset; the manifest has the table
RUNTIME = safebundle.RUNTIME
QUANT_PARAMS = "quant_params.npz"
MANIFEST = "manifest.json"
LOADER = "run.py"
README = "README.md"
SUMS = "SHA256SUMS"
SIGNATURE = "manifest.sig"

FILE_ROLES = {
    LIBRARY: "compiled model (TVM Relax executable, shared library)",
    WEIGHTS: "weights, in the order the library takes them",
    GOLDEN: "golden input and the outputs computed on the build host",
    MANIFEST: "what the bundle is and needs: model, device, toolchain, inputs/outputs, file hashes",
    LOADER: "loader: checks, runs, self-tests and benchmarks the model",
    README: "this file",
    SUMS: "SHA-256 of every other file (sha256sum -c SHA256SUMS)",
    QUANT_PARAMS: "int8 scales: activation scale and per-channel weight scales of each int8 layer",
    SIGNATURE: "ed25519 signature over manifest.json (edgeq verify BUNDLE --pub KEY)",
    f"{RUNTIME}/edgeq-run": "native loader: checks, runs, self-tests and benchmarks the model without Python",
    f"{RUNTIME}/libtvm_ffi.so": "TVM FFI library (apache-tvm-ffi), the version the model was compiled with",
    f"{RUNTIME}/libtvm_runtime.so": "TVM runtime (apache-tvm), the version the model was compiled with",
    f"{RUNTIME}/libtvm_runtime_cuda.so": "TVM's CUDA backend (links CUDA 13's libcudart.so.13)",
    f"{RUNTIME}/libcudart.so.13": "edgeq's CUDA 12 bridge: gives TVM's CUDA backend the device's libcudart.so.12",
}


def write_tensors(path: Path, tensors: list[tuple[str, np.ndarray]]) -> list[dict[str, Any]]:
    """Write arrays in the ``edgeq-raw-1`` form (read by edgeq-run without numpy); returns the table the
    manifest keeps: name, dtype, shape, byte offset and size of each."""
    table, offset = [], 0
    with open(path, "wb") as f:
        for name, array in tensors:
            array = np.asarray(array)
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
            pad = -offset % 64
            f.write(b"\0" * pad)
            offset += pad
            f.write(data)
            table.append({"name": name, "dtype": str(array.dtype), "shape": list(array.shape), "offset": offset,
                          "bytes": len(data)})
            offset += len(data)
    return table


def read_tensor(path: Path, entry: dict[str, Any]) -> np.ndarray:
    """One array of an ``edgeq-raw-1`` file, by its manifest entry (0-d arrays stay 0-d)."""
    dtype = np.dtype(entry["dtype"]).newbyteorder("<")
    count = int(np.prod(entry["shape"], dtype=np.int64))
    flat = np.fromfile(path, dtype=dtype, count=count, offset=entry["offset"])
    if flat.size != count:
        raise BundleError(f"{Path(path).name} is shorter than its manifest says")
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(entry["shape"])


def read_tensors(directory: Path, section: dict[str, Any]) -> dict[str, np.ndarray]:
    """All arrays of a manifest section (``weights``, ``golden``) by name, in file order."""
    return {t["name"]: read_tensor(Path(directory) / section["file"], t) for t in section["tensors"]}

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("edgeq.templates", ""),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,
)


def render(template: str, **context: Any) -> str:
    return _ENV.get_template(template).render(**context)


sha256_file = safebundle.sha256_file


def template_context(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the loader and README templates see: a flat view of the manifest."""
    toolkit = manifest["toolchain"]["cuda_toolkit"]
    return {
        "bundle_id": manifest["bundle_id"],
        "model_name": manifest["name"],
        "device": manifest["device"],
        "precision": manifest["precision"],
        "edgeq_version": manifest["edgeq_version"],
        "tvm_version": manifest["tvm_version"],
        "schema_version": manifest["schema_version"],
        "model_sha256": manifest["model"]["sha256"],
        "inputs": manifest["inputs"],
        "outputs": manifest["outputs"],
        "first_input": manifest["inputs"][0]["name"] if manifest["inputs"] else "input",
        "cuda_arch": manifest["device"]["cuda_arch"],
        "cuda_major": toolkit["version"].split(".")[0] if toolkit else "",
        "toolkit": f"CUDA {toolkit['version']} {toolkit['kind']}" if toolkit else "",
        "quantization": _quantization_summary(manifest.get("quantization")),
        "runtime": manifest.get("runtime"),
        "files": sorted((name, what) for name, what in FILE_ROLES.items()
                        if name in manifest["files"] or name in (MANIFEST, SUMS) or (name == SIGNATURE and manifest.get("signed"))),
    }


def _quantization_summary(report: dict[str, Any] | None) -> str:
    if not report:
        return ""
    counts = ", ".join(f"{n} {p}" for p, n in report["precision_counts"].items() if n)
    if "source" in report:
        return f"{counts} layers; {report['source']}"
    ratio = report["weight_bytes"]["ratio"]
    return f"{counts} layers; {report['method']} calibration; weights {ratio:.2f}x of fp32"


def write_bundle(directory: Path, manifest: dict[str, Any], extra_files: list[str] = (), signing_key=None) -> dict[str, Any]:
    """Render the loader and README into ``directory`` (which already holds the library, weights and
    golden file), hash everything, write manifest.json, its signature (with ``signing_key``) and
    SHA256SUMS. Returns the final manifest."""
    manifest = dict(manifest)
    names = (LIBRARY, WEIGHTS, GOLDEN, *extra_files, LOADER, README)
    manifest["files"] = dict.fromkeys(names, "")
    context = template_context(manifest)
    (directory / LOADER).write_text(render("run.py.j2", **context), encoding="utf-8")
    (directory / LOADER).chmod(0o755)
    (directory / README).write_text(render("README.md.j2", **context), encoding="utf-8")
    manifest["files"] = {name: sha256_file(directory / name) for name in names}
    manifest["sizes"] = {name: (directory / name).stat().st_size for name in names}
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode("utf-8")
    safebundle.check_manifest(json.loads(manifest_bytes))  # what devices will insist on
    (directory / MANIFEST).write_bytes(manifest_bytes)
    sums = {**manifest["files"], MANIFEST: sha256_file(directory / MANIFEST)}
    if signing_key is not None:
        (directory / SIGNATURE).write_bytes(safebundle.signature_for(manifest_bytes, signing_key))
        sums[SIGNATURE] = sha256_file(directory / SIGNATURE)
    (directory / SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sorted(sums.items())), encoding="ascii")
    return manifest


def make_archive(directory: Path, archive: Path, mtime: int) -> None:
    """A reproducible .tar.gz of ``directory`` under its own name: sorted members, fixed owner and time."""
    with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            root = tarfile.TarInfo(directory.name)
            root.type, root.mode, root.mtime = tarfile.DIRTYPE, 0o755, mtime
            tar.addfile(root)
            # manifest.json first: devices check every later member against it before reading its data
            first = {MANIFEST: 0, SIGNATURE: 1}
            for path in sorted(directory.iterdir(), key=lambda p: (first.get(p.name, 2), p.is_dir(), p.name)):
                if path.is_dir():  # runtime/: the folder, then its files
                    folder = tarfile.TarInfo(f"{directory.name}/{path.name}")
                    folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, mtime
                    tar.addfile(folder)
                    for inner in sorted(path.iterdir()):
                        _add_file(tar, inner, f"{directory.name}/{path.name}/{inner.name}", mtime)
                else:
                    _add_file(tar, path, f"{directory.name}/{path.name}", mtime)


def _add_file(tar: tarfile.TarFile, path: Path, name: str, mtime: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = path.stat().st_size
    info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
    info.mtime = mtime
    with open(path, "rb") as f:
        tar.addfile(info, f)


def read_manifest(bundle: str | Path) -> dict[str, Any]:
    """The manifest of a bundle directory or .tar.gz archive."""
    bundle = Path(bundle)
    try:
        if bundle.is_dir():
            path = bundle / MANIFEST
            if path.is_file() and path.stat().st_size > safebundle.MAX_MANIFEST_BYTES:
                raise BundleError(f"{bundle}: manifest.json is too large ({path.stat().st_size} bytes)")
            data = path.read_bytes()
        elif bundle.is_file():
            data = _manifest_from_archive(bundle)
        else:
            raise BundleError(f"bundle not found: {bundle}")
        raw = safebundle.load_json(data, "manifest.json")
        if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
            raise BundleError(f"{bundle}: manifest schema_version is not {SCHEMA_VERSION}; not a bundle this edgeq reads")
        return safebundle.check_manifest(raw)
    except FileNotFoundError:
        raise BundleError(f"{bundle} has no {MANIFEST}; is it an edgeq bundle?") from None
    except OSError as err:
        raise BundleError(f"cannot read the manifest of {bundle}: {err.strerror}") from None
    except safebundle.BundleRefused as err:
        raise BundleError(f"{bundle}: {err}") from None


def _manifest_from_archive(archive: Path) -> bytes:
    try:
        with safebundle.open_tar(archive) as tar:
            for member in tar:
                parts = member.name.split("/")
                if member.isfile() and len(parts) == 2 and parts[1] == MANIFEST:
                    if member.size > safebundle.MAX_MANIFEST_BYTES:
                        raise BundleError(f"{archive}: manifest.json is too large ({member.size} bytes)")
                    return tar.extractfile(member).read(safebundle.MAX_MANIFEST_BYTES)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(":")
        raise BundleError(f"{archive} is not a readable .tar.gz bundle ({reason})") from None
    raise FileNotFoundError(MANIFEST)
