"""Compile a Relax IRModule for a device profile and export it as a shared library.

For Jetson profiles: CUDA kernels built by the toolkit that matches the device's CUDA, host code for
aarch64 linked by the Debian cross compiler. For CPU profiles: LLVM for the profile's CPU.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

from edgeq.errors import ToolchainError
from edgeq.runtime.elf import machine as elf_machine  # noqa: F401 - part of this module's API
from edgeq.targets import Profile
from edgeq.toolchain import CudaToolkit, cuda_driver, cuda_toolkit_for, cxx_for, import_tvm

EM_CUDA = 190


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """Everything outside Python that a build for one profile uses; recorded in the manifest."""

    cxx: str
    cuda: CudaToolkit | None

    def to_dict(self) -> dict:
        return {"cxx": self.cxx, "cuda_toolkit": self.cuda.to_dict() if self.cuda else None}


def toolchain_for(profile: Profile) -> Toolchain:
    """Find the compilers for ``profile`` before any work starts, so a missing one fails fast."""
    cxx = cxx_for(profile)
    toolkit = cuda_toolkit_for(profile) if profile.cuda else None
    if toolkit is not None:
        tvm = import_tvm()
        if not tvm.runtime.enabled("cuda"):
            raise ToolchainError(
                f"TVM's CUDA backend did not load (CUDA driver library: {cuda_driver()}); "
                "install gcc so edgeq can build its driver stub, or run on a machine with the NVIDIA driver"
            )
    return Toolchain(cxx=cxx, cuda=toolkit)


def is_cpu(target) -> bool:
    tvm = import_tvm()
    tgt = tvm.target.Target(target)
    return tgt.kind.name == "llvm" and (tgt.host is None or tgt.host.kind.name == "llvm")


def lower_graph(graph, target):
    """The graph on edgeq's CPU kernels (convolutions and matrix products, NHWC between them; inference
    BatchNorms folded, ``edgeq.graph_passes.fold_batch_norm``) when ``target`` is a CPU; for GPU targets the CUDA
    path's graph clean-up (``edgeq.gpu.prepare_graph``: BatchNorm folded, weight reshapes precomputed).
    Returns (graph, conv/matmul calls on CPU kernels)."""
    if not is_cpu(target):
        from edgeq.gpu import prepare_graph

        return prepare_graph(graph), 0
    tvm = import_tvm()
    from edgeq.graph_passes import fold_batch_norm
    from edgeq.kernels.conv import Isa
    from edgeq.kernels.lower import lower_for_cpu

    # a BatchNorm the exporter left (DenseNet's after each concatenation) as a per-channel multiply and add,
    # which follows the NHWC layout; as batch_norm it was computed between two transposes to NCHW
    return lower_for_cpu(fold_batch_norm(graph), Isa.of(tvm.target.Target(target)))


def build(mod, target, toolchain: Toolchain | None = None, stats: dict | None = None):
    """``relax.build`` for ``target``: for CPUs TVM's pipeline with edgeq's schedules after fusion
    (``edgeq.kernels.schedule``; ``stats`` counts the functions by schedule), for GPUs TVM's CUDA pipeline
    with edgeq's schedule step and CUDA graph capture (``edgeq.gpu``; ``stats`` gets its ``GpuKernels``
    record: rule per kernel, fallbacks, kernels per inference) with CUDA kernels compiled by ``toolchain.cuda``."""
    tvm = import_tvm()
    from tvm import relax

    with tvm.target.Target(target) as tgt:
        if toolchain is not None and toolchain.cuda is not None:
            from edgeq import gpu

            report = gpu.GpuKernels()
            with toolchain.cuda.active():
                executable = gpu.build(mod, tgt, report)
            if stats is not None:
                stats.update(report.to_dict())
            return executable
        if is_cpu(tgt):
            from edgeq.kernels.conv import Isa
            from edgeq.kernels.schedule import cpu_pipeline

            return relax.build(mod, target=tgt, relax_pipeline=cpu_pipeline(tgt, Isa.of(tgt), stats))
        return relax.build(mod, target=tgt)


def export(executable, path: Path, toolchain: Toolchain) -> None:
    from tvm.support import cc

    import_tvm()
    executable.export_library(str(path), fcompile=cc.cross_compiler(toolchain.cxx))


@dataclasses.dataclass(frozen=True)
class CudaImage:
    """One CUDA device-code ELF (cubin) embedded in a library, whole: cuobjdump can read ``data``."""

    arch: str
    offset: int
    data: bytes


def cuda_images(library: Path) -> list[CudaImage]:
    """The CUDA cubins embedded in a library (TVM keeps them, bare or inside a fatbin, in its module blob).

    A library built where TVM's CUDA backend did not run carries CUDA *source*, and this returns [].
    """
    data = library.read_bytes()
    images = []
    start = data.find(b"\x7fELF", 1)
    while start != -1:
        header = data[start : start + 64]
        if len(header) == 64 and header[4] == 2 and struct.unpack_from("<H", header, 18)[0] == EM_CUDA:
            flags = struct.unpack_from("<I", header, 48)[0]
            # CUDA ELF ABI version 8+ (CUDA 12.8 and later) moved the SM number to bits 8..15.
            sm = (flags >> 8) & 0xFF if header[8] >= 8 else flags & 0xFF
            phoff, shoff = struct.unpack_from("<QQ", header, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 54)
            size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            images.append(CudaImage(f"sm_{sm}", start, data[start : start + size]))
        start = data.find(b"\x7fELF", start + 1)
    return images


def cuda_device_code(library: Path) -> list[str]:
    """The SM architectures of the CUDA device code embedded in a library."""
    return sorted({image.arch for image in cuda_images(library)})


class HostRunner:
    """A graph run on this machine's CPU, callable on numpy inputs; returns the flat list of outputs.
    Built here for the host (on edgeq's CPU kernels) unless an already built host ``executable`` of the
    graph is given."""

    def __init__(self, graph, executable=None):
        tvm = import_tvm()
        from tvm import relax

        from edgeq.targets import profiles

        self.tvm = tvm
        self.dev = tvm.cpu(0)
        if executable is None:
            target = profiles()["host"].tvm_target()
            graph, _ = lower_graph(graph, target)
            executable = build(graph.mod, target)
        self.vm = relax.VirtualMachine(executable, self.dev)
        self.params = [tvm.runtime.tensor(w, self.dev) for w in graph.weight_list()]

    def __call__(self, inputs: list) -> list:
        result = self.vm["main"](*[self.tvm.runtime.tensor(x, self.dev) for x in inputs], *self.params)
        return self._flatten(result)

    def _flatten(self, result) -> list:
        if isinstance(result, self.tvm.runtime.Tensor):
            return [result.numpy()]
        return [array for item in result for array in self._flatten(item)]
