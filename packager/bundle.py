"""Write a bundle: the arrays (weights, golden vectors), the loader with its two modules, the README rendered
from its template, manifest.json, SHA256SUMS; then the .tar.gz, and both moved into place (``write``, the
bundle stage's one call). Also reads manifests back. What a bundle holds and what its manifest says is
``edgeq.templates.contract``."""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeq import templates
from edgeq.templates import contract, imaging, safebundle
from edgeq.templates.contract import (CONTRACT, FILE_ROLES, GOLDEN, IMAGING, LIBRARY, LOADER, MANIFEST, README, SIGNATURE, SUMS,
                            VERIFIER, VIDEO, WEIGHTS, Manifest)
from edgeq.errors import BundleError, DeviceError

if TYPE_CHECKING:
    import numpy as np

    from edgeq.progress import StageProgress
    from edgeq.runtime.assemble import Runtime
    from edgeq.stage_records import (Compiled, Golden, Imported, Loaded, Lowered, PackageArgs, Quantized, Setup,
                                     Written)

# Shipped as they are: the Python loader and the four modules it shares with edgeq (standard library at import).
SHIPPED = {LOADER: Path(templates.__file__).with_name("run.py"), CONTRACT: Path(contract.__file__),
           VERIFIER: Path(safebundle.__file__), IMAGING: Path(imaging.__file__),
           VIDEO: Path(imaging.__file__).with_name("video.py")}


def write_tensors(path: Path, tensors: list[tuple[str, np.ndarray]]) -> list[contract.StoredTensor]:
    """Write arrays in the ``edgeq-raw-1`` form (read by edgeq-run without numpy); returns the table the
    manifest keeps: name, dtype, shape, byte offset and size of each."""
    import numpy as np

    table, offset = [], 0
    with open(path, "wb") as f:
        for name, array in tensors:
            array = np.asarray(array)
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
            pad = -offset % 64
            f.write(b"\0" * pad)
            offset += pad
            f.write(data)
            table.append(contract.StoredTensor(name=name, dtype=str(array.dtype), shape=list(array.shape), offset=offset,
                                               bytes=len(data)))
            offset += len(data)
    return table


def read_tensor(path: Path, entry: contract.StoredTensor) -> np.ndarray:
    """One array of an ``edgeq-raw-1`` file, by its manifest entry (0-d arrays stay 0-d)."""
    import numpy as np

    dtype = np.dtype(entry.dtype).newbyteorder("<")
    count = int(np.prod(entry.shape, dtype=np.int64))
    flat = np.fromfile(path, dtype=dtype, count=count, offset=entry.offset)
    if flat.size != count:
        raise BundleError(f"{Path(path).name} is shorter than its manifest says")
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(entry.shape)


def read_tensors(directory: Path, section) -> dict[str, np.ndarray]:
    """All arrays of a manifest section (``manifest.weights``, ``manifest.golden``) by name, in file order."""
    return {t.name: read_tensor(Path(directory) / section.file, t) for t in section.tensors}

@functools.lru_cache(maxsize=None)
def _templates():
    import jinja2  # here, not at import: reading a manifest (edgeq inspect, verify) needs neither jinja2 nor numpy

    return jinja2.Environment(loader=jinja2.PackageLoader("edgeq.templates", ""), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def render(template: str, **context: Any) -> str:
    return _templates().get_template(template).render(**context)


sha256_file = safebundle.sha256_file


def template_context(manifest: Manifest) -> dict[str, Any]:
    """What the device README template sees: the manifest, and the roles of the files it lists."""
    listed = set(manifest.files) | {MANIFEST, SUMS} | ({SIGNATURE} if manifest.signed else set())
    return {
        "m": manifest,
        "toolkit": manifest.toolchain.cuda_toolkit,
        "first_input": manifest.inputs[0].name if manifest.inputs else "input",
        "files": sorted((name, what) for name, what in FILE_ROLES.items() if name in listed),
    }


def write_bundle(directory: Path, manifest: Manifest, extra_files: list[str] = (), signing_key=None) -> Manifest:
    """Copy the loader and its two modules into ``directory`` (which already holds the library, weights,
    golden file and ``extra_files``), render the README, hash everything, write manifest.json, its signature
    (with ``signing_key``) and SHA256SUMS. Returns the final manifest."""
    names = (LIBRARY, WEIGHTS, GOLDEN, *extra_files, *SHIPPED, README)
    for name, source in SHIPPED.items():
        shutil.copyfile(source, directory / name)
        (directory / name).chmod(0o755 if name == LOADER else 0o644)
    listed = manifest.replace(files=dict.fromkeys(names, ""))
    (directory / README).write_text(render("README.md.j2", **template_context(listed)), encoding="utf-8")
    manifest = manifest.replace(files={name: sha256_file(directory / name) for name in names},
                                sizes={name: (directory / name).stat().st_size for name in names})
    manifest_bytes = (json.dumps(manifest.to_json(), indent=2) + "\n").encode("utf-8")
    safebundle.check_manifest(json.loads(manifest_bytes))  # what devices will insist on
    (directory / MANIFEST).write_bytes(manifest_bytes)
    sums = {**manifest.files, MANIFEST: sha256_file(directory / MANIFEST)}
    if signing_key is not None:
        (directory / SIGNATURE).write_bytes(safebundle.signature_for(manifest_bytes, signing_key))
        sums[SIGNATURE] = sha256_file(directory / SIGNATURE)
    (directory / SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sorted(sums.items())), encoding="ascii")
    return manifest


def device_globals(library: Path) -> int:
    """Bytes of ``__device__`` variables in the library's CUDA images (their ``.nv.global``; the largest image's,
    one is loaded): serial split-K's semaphores, and what the CUDA headers' templates leave (libcu++'s constants)."""
    from edgeq.backends.cuda.cubin import cuda_images, section_sizes

    return max((section_sizes(image.data).get(".nv.global", 0) for image in cuda_images(library)), default=0)


def device_memory(kernels: dict, weight_bytes: int, globals_bytes: int, profile, progress) -> dict:
    """The manifest's kernel fields with a GPU build's device memory summed (``gpu_kernels.memory``: the weights, the
    static memory plan's workspace, the module's ``__device__`` globals) and checked against the device's memory,
    which an Orin shares with its CPU: over it, the bundle could not load (an error); over half of it, a warning."""
    gpu = kernels.get("gpu_kernels")
    if not gpu or "memory" not in gpu:
        return kernels
    memory = {**gpu["memory"], "weights_bytes": weight_bytes, "globals_bytes": globals_bytes}
    memory["total_bytes"] = weight_bytes + memory["workspace_bytes"] + memory["globals_bytes"]
    device = profile.memory_mb * 2**20
    if device:
        memory["device_bytes"] = device
        need = (f"{memory['total_bytes'] / 2**20:.0f} MB of GPU memory (weights {weight_bytes / 2**20:.0f} MB, "
                f"activations {memory['workspace_bytes'] / 2**20:.0f} MB)")
        if memory["total_bytes"] > device:
            raise DeviceError(f"the bundle needs {need}, more than {profile.name}'s {profile.memory_mb} MB; use "
                              "--precision int8 or fp16, a smaller --input-shape, or a device with more memory")
        if memory["total_bytes"] > device // 2:
            progress.warn(f"the bundle needs {need}, over half of {profile.name}'s {profile.memory_mb} MB, which its "
                          "CPU shares")
    return {**kernels, "gpu_kernels": {**gpu, "memory": memory}}


def write(args: PackageArgs, setup: Setup, loaded: Loaded, imported: Imported, quantized: Quantized | None,
          lowered: Lowered, compiled: Compiled, golden: Golden, reference: contract.ReferenceCheck,
          runtime: Runtime | None, progress: StageProgress, precision: str, golden_tolerance: tuple[float, float],
          golden_seed: int) -> Written:
    """The whole bundle from the records of a build: weights.bin and quant_params.npz beside what the staging
    folder holds (model.so, golden.bin, runtime/), the manifest, the files of ``write_bundle``, the archive,
    and both renamed into the output folder (a bundle of the same name there is replaced, said as a warning)."""
    import datetime

    import numpy as np

    from edgeq.runtime.assemble import check_elves
    from edgeq.runtime.elf import machine as elf_machine

    output = setup.output
    staging, bundle_name = output.staging, setup.bundle_name
    library = compiled.library
    graph = lowered.graph
    weight_arrays = graph.weight_list()
    weight_table = write_tensors(staging / WEIGHTS, [(p.name, w) for p, w in zip(graph.weight_params, weight_arrays)])
    extra_files = list(runtime.files) if runtime else []
    if quantized is not None:
        np.savez(staging / contract.QUANT_PARAMS, **quantized.result.scales)
        extra_files.append(contract.QUANT_PARAMS)
    identity = identity_fields(setup, args.release, precision, [LIBRARY, WEIGHTS, *extra_files])
    created = datetime.datetime.fromisoformat(identity["created"])
    weights = staging / WEIGHTS
    rtol, atol = golden_tolerance
    model = loaded.model
    kernels = device_memory(setup.backend.kernel_record(compiled.schedules, lowered.kernel_calls),
                            int(sum(w.nbytes for w in weight_arrays)), device_globals(library), setup.profile, progress)
    manifest = contract.Manifest(
        **identity,
        model=contract.ModelRecord(
            file=Path(args.model).name, sha256=model.sha256, opset=model.opset,
            producer=f"{model.onnx_model.producer_name} {model.onnx_model.producer_version}".strip()),
        inputs=list(model.inputs),
        outputs=list(imported.outputs),
        device=setup.profile.device_record(),
        toolchain=contract.ToolchainRecord.from_json(setup.toolchain.to_dict(), "toolchain"),
        library=contract.LibraryRecord(
            file=LIBRARY, machine=elf_machine(library), cuda_device_code=setup.backend.device_code(library),
            bytes=library.stat().st_size, **kernels),
        weights=contract.WeightsRecord(
            file=WEIGHTS, format=contract.TENSOR_FORMAT, count=len(weight_arrays),
            dtypes=sorted({str(w.dtype) for w in weight_arrays}), bytes=int(sum(w.nbytes for w in weight_arrays)),
            file_bytes=weights.stat().st_size, tensors=weight_table),
        golden=contract.GoldenRecord(
            file=GOLDEN, format=contract.TENSOR_FORMAT, tensors=golden.table, seed=golden_seed,
            float_inputs=golden.float_inputs, computed_with=golden.computed_with,
            rtol=rtol, atol=atol,
            atol_scaled_by="max(1, max |expected output|)",
            outliers=max((r.get("outliers", 0.0) for r in reference.outputs), default=0.0) or None),
        reference_check=reference,
        quantization=quantized.result.report if quantized else None,
        runtime=contract.RuntimeRecord.from_json(runtime.record, "runtime") if runtime else None,
        build={"args": args.to_dict(), "stage_seconds": dict(progress.seconds),
               **({"records_applied": lowered.records_applied} if lowered.records_applied is not None else {})},
        compatibility=check_elves(staging, [LIBRARY, *runtime.files], setup.profile) if runtime else None,
        preprocess=loaded.preprocess,
        postprocess=imported.postprocess,
        files={}, sizes={},
    )
    manifest = write_bundle(staging, manifest, extra_files, setup.signing_key)
    return place(manifest, output, bundle_name, int(created.timestamp()), progress)


def identity_fields(setup: Setup, release: int | None, precision: str, content: list[str]) -> dict[str, Any]:
    """The manifest's fields that say which bundle this is (schema version, id, name, release, signing, creation time,
    versions, precision): the id ends in a hash of the ``content`` files in the staging folder, the release defaults
    to the creation time."""
    import datetime
    import hashlib

    import edgeq
    from edgeq.tvm_env import import_tvm

    digest = hashlib.sha256()
    for name in content:
        digest.update(sha256_file(setup.output.staging / name).encode())
    created = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"schema_version": contract.SCHEMA_VERSION, "bundle_id": f"{setup.bundle_name}-{digest.hexdigest()[:12]}",
            "name": setup.name, "release": release if release is not None else int(created.strftime("%Y%m%d%H%M%S")),
            "signed": setup.signing_key is not None, "created": created.isoformat(),
            "edgeq_version": edgeq.__version__, "tvm_version": import_tvm().__version__, "precision": precision}


def place(manifest: Manifest, output, bundle_name: str, mtime: int, progress: StageProgress) -> Written:
    """The staging folder's bundle under its final name: the archive made from it, then both renamed into the
    output folder (a bundle of the same name there is replaced, said as a warning)."""
    from edgeq.stage_records import Written

    staging = output.staging
    final_dir = output.out_dir / bundle_name
    named = staging / bundle_name
    named.mkdir()
    for path in list(staging.iterdir()):
        if path != named:
            path.rename(named / path.name)
    archive_tmp = staging / f"{bundle_name}.tar.gz"
    make_archive(named, archive_tmp, mtime=mtime)
    replaced = final_dir.exists()
    if replaced:  # said even with --quiet, and in --json as "replaced"
        progress.warn(f"replacing the bundle already in {final_dir}")
        final_dir.rename(staging / "previous")
    named.rename(final_dir)
    archive = output.out_dir / f"{bundle_name}.tar.gz"
    archive_tmp.replace(archive)
    return Written(manifest=manifest, bundle_dir=final_dir, archive=archive, replaced=replaced)


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


def read_manifest(bundle: str | Path) -> Manifest:
    """The manifest of a bundle directory or .tar.gz archive."""
    bundle = Path(bundle)
    try:
        if bundle.is_dir():
            path = bundle / MANIFEST
            if (path.exists() or path.is_symlink()) and not path.is_file():  # a FIFO would block a read forever
                raise BundleError(f"{bundle}: {MANIFEST} is not a regular file")
            if path.is_file() and path.stat().st_size > safebundle.MAX_MANIFEST_BYTES:
                raise BundleError(f"{bundle}: manifest.json is too large ({path.stat().st_size} bytes)")
            data = path.read_bytes()
        elif bundle.is_file():
            data = _manifest_from_archive(bundle)
        else:
            raise BundleError(f"bundle not found: {bundle}")
        return safebundle.parse_manifest(data)
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
