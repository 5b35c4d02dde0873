"""Compiling with NVRTC: CUTLASS's and edgeq's include folders, the ``tvm_callback_cuda_postproc`` hook that puts the
wrappers in front of a module's CUDA source, the shared-memory sizes read from a sizing cubin, and a module of
kernels alone (``build_module``, for benchmarks/device_math.py).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from edgeq.backends.cuda.cubin import elf_symbol_sizes
from edgeq.backends.cuda.cutlass.emit import device_source
from edgeq.backends.cuda.cutlass.kernels import ConvKernel, DepthwiseKernel
from edgeq.backends.cuda.cutlass.tir import prim_func


def cutlass_include() -> Path:
    """CUTLASS's headers in the installed apache-tvm wheel."""
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    root = Path(spec.origin).parent / "3rdparty" / "cutlass" / "include"
    if not (root / "cutlass" / "version.h").is_file():
        from edgeq.errors import ToolchainError

        raise ToolchainError(f"the apache-tvm wheel here has no CUTLASS headers ({root}); reinstall apache-tvm")
    return root


EDGEQ_INCLUDE = Path(__file__).resolve().parent / "include"  # edgeq's C++ (edgeq_cutlass/*.h), package data


def cutlass_version() -> str:
    """"4.1.0": CUTLASS_MAJOR.MINOR.PATCH of the wheel's headers (the manifest records it)."""
    text = (cutlass_include() / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def nvrtc_options() -> str:
    """NVRTC options CUTLASS needs beyond TVM's (``TVM_CUDA_NVRTC_EXTRA_OPTS``): C++17, its include folder and
    edgeq's."""
    return f"-std=c++17 -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1 -I{cutlass_include()} -I{EDGEQ_INCLUDE}"


@contextlib.contextmanager
def wrappers_in_module(kernels: Sequence[ConvKernel]) -> Iterator[None]:
    """For the duration of a build: the kernels' wrappers go in front of any CUDA source that calls one, and
    NVRTC finds CUTLASS's headers."""
    import tvm_ffi

    by_name = {k.name: k for k in kernels}
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def postproc(code, target=None):
        used = [by_name[n] for n in sorted(set(re.findall(r"edgeq_cutlass_(\w+)\(", code))) if n in by_name]
        return device_source(used) + "\n" + code if used else code

    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", postproc, override=True)
    try:
        with nvrtc_include():
            yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", previous, override=True)
        else:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", lambda code, target=None: code, override=True)


def smem_sizes(kernels: Sequence[ConvKernel], arch: str) -> dict[str, int]:
    """sizeof(SharedStorage) of each kernel, read from a cubin of its wrappers' types (NVRTC, no GPU); 0 for
    depthwise kernels (TIR, no shared memory). Only the ``edgeq_smem_`` arrays are compiled, not the wrapper
    functions: a type's size needs its definition, not its kernel's code, which NVRTC would otherwise instantiate
    and optimize twice (here and in the module)."""
    from tvm.support import nvcc

    sizes = {k.name: 0 for k in kernels if isinstance(k, DepthwiseKernel)}
    if len(sizes) == len(kernels):
        return sizes
    source = "#define EDGEQ_SIZING\n" + re.sub(r'extern "C" __device__ void edgeq_cutlass_\w+\(.*?\n}\n', "",
                                                device_source(kernels), flags=re.S)
    with nvrtc_include():
        cubin = bytes(nvcc.compile_cuda(source, target_format="cubin", arch=arch))
    return {**elf_symbol_sizes(cubin, "edgeq_smem_"), **sizes}


@contextlib.contextmanager
def nvrtc_include() -> Iterator[None]:
    saved = os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS")
    os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = f"{saved or ''} {nvrtc_options()}".strip()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TVM_CUDA_NVRTC_EXTRA_OPTS", None)
        else:
            os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = saved


def build_module(kernels: Sequence[ConvKernel], target, toolkit, folder: Path,
                 math=None) -> tuple[Path, dict[str, int]]:
    """The kernels as one TVM module for ``target`` (``tvm.target.Target`` of kind cuda), exported as a shared
    library into ``folder`` with its CUDA source beside it (``cutlass_<arch>.cu``): (the library, {kernel: shared
    bytes}). ``math``: a ``device_math.DeviceMath`` other than the toolkit's (benchmarks/device_math.py)."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    arch = target.attrs["arch"]
    with toolkit.active(math):
        sizes = smem_sizes(kernels, arch)
        mod = tvm.IRModule({k.function: prim_func(k, sizes[k.name]) for k in kernels})
        with wrappers_in_module(kernels), target:
            lib = tvm.tirx.build(mod, target=target)
    library = folder / f"cutlass_{arch}.so"
    lib.export_library(str(library))
    (folder / f"cutlass_{arch}.cu").write_text(lib.imports[0].inspect_source())
    return library, sizes
