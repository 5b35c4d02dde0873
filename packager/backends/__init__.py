"""Backends: what a kind of target does to a build, behind one small interface.

A device profile picks its backend once (``for_profile``; a profile with a ``[cuda]`` table is a CUDA
device, every other one a CPU). ``edgeq.package`` and ``edgeq.compile`` ask the backend and never branch on
the target themselves. A backend says:

- ``find_tools``: the compilers a build for the profile needs, found before any work starts;
- ``prepare``: what the target does to the graph before TVM schedules it (CPU: convolutions and matrix
  products onto edgeq's kernels; CUDA: BatchNorm folded, weight reshapes precomputed). The golden outputs
  are computed on the prepared graph, so they check what the device runs;
- ``build``: ``relax.build`` with the backend's pipeline, counting what its kernels did into ``stats``;
- ``device_code``: the device-code architectures an exported library carries;
- ``check_library``: what the exported library must carry (CUDA: device code for the profile's SM);
- ``kernel_record``: how the manifest describes its kernels (``library.cpu_kernels`` / ``gpu_kernels``);
- ``golden_tolerance``: what the device's results may differ by from the build host's;
- ``layer_precisions``: the int8 layers the target runs in another precision (CUDA on CUTLASS: fp16 where
  per-token int8 would take a kernel of its own);
- ``to_fp16``: the graph in fp16 (backends whose ``precisions`` have it);
- ``runtime_libraries``, ``runtime_shim``: what its runtime needs on the device beyond TVM's runtime and the
  loader (``runtime_parts`` names them);
- ``device_type``: the TVM runtime's name for its device (bench and tune open it by this name).

Adding a target kind is one folder here with a ``backend.py`` and one entry in ``BACKENDS``.
This module stays light (no TVM import): the CLI's quick verbs read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

# The self-test's tolerances live in their own module, which the backends import (not this package's
# __init__, which imports them by name): one direction only.
from edgeq.backends.tolerances import (GOLDEN_ATOL, GOLDEN_FP16_ATOL, GOLDEN_FP16_RTOL, GOLDEN_INT8_ATOL,
                                       GOLDEN_INT8_RTOL, GOLDEN_RTOL)

class Backend(Protocol):
    """What every backend provides (``edgeq.backends.cpu.backend.CpuBackend``,
    ``edgeq.backends.cuda.backend.CudaBackend``)."""

    name: str
    precisions: tuple[str, ...]  # the --precision values its builds take
    device_type: str  # the TVM runtime's device name for its code ("cpu", "cuda": tvm.device, RPC sessions)
    runtime_parts: tuple[str, ...]  # names of what runtime_libraries / runtime_shim add (the progress line)

    def find_tools(self, profile) -> Any:
        """The ``edgeq.compile.Toolchain`` for ``profile``; a missing tool raises ToolchainError."""

    def prepare(self, graph, target) -> tuple[Any, int]:
        """(the graph the device runs, conv/matmul calls on edgeq's own kernels)."""

    def build(self, mod, target, toolchain=None, stats: dict | None = None) -> Any:
        """The Relax executable of ``mod`` for ``target`` (a ``tvm.target.Target``)."""

    def runtime_libraries(self, profile) -> tuple[tuple[str, str], ...]:
        """(project, file in the wheel) of the TVM libraries its code needs beyond TVM's runtime, in load order."""

    def runtime_shim(self, profile, cxx: str, last_library: Path, folder: Path) -> tuple[str, Path, dict] | None:
        """A library built (in ``folder``) for the device and loaded before the last of ``runtime_libraries``:
        (bundle-relative name, built file, manifest record), or None."""

    def device_code(self, library: Path) -> list[str]:
        """The device-code architectures an exported library carries (the manifest's ``cuda_device_code``)."""

    def check_library(self, library: Path, profile, toolchain) -> None:
        """Raise ToolchainError when the exported library lacks what the device needs."""

    def kernel_record(self, stats: Mapping[str, Any], kernel_calls: int) -> dict[str, Any]:
        """The manifest's kernel fields (``cpu_kernels``, ``gpu_kernels``) for ``contract.LibraryRecord``."""

    def golden_tolerance(self, precision: str, quantized: bool, on_build_host: bool) -> tuple[float, float]:
        """(rtol, atol) of the self-test."""

    def layer_precisions(self, graph, layers) -> dict[str, tuple[str, str]]:
        """The quantizer's int8 layers (``quantize.layers.Layer``) this target runs in another precision: weight
        name -> (precision, why); asked before calibration."""

    def to_fp16(self, graph) -> Any:
        """fp16 weights and activations, fp32 accumulation (where "fp16" is in ``precisions``)."""

    def own_schedule(self, workload, target) -> Any:
        """A tuning workload (an IRModule of one unscheduled TIR function) scheduled as ``build`` schedules it
        without records, to measure beside the tuned candidates; None where the backend cannot say."""

    def describe_prepare(self, profile) -> str:
        """The progress line of the lower stage."""

    def describe_build(self, profile, toolchain) -> str:
        """The progress line of the compile stage."""


# backend name -> "module:class", imported on first use (the modules import TVM)
BACKENDS: dict[str, str] = {
    "cpu": "edgeq.backends.cpu.backend:CpuBackend",
    "cuda": "edgeq.backends.cuda.backend:CudaBackend",
}
_loaded: dict[str, Backend] = {}


def get(name: str) -> Backend:
    if name not in _loaded:
        module, cls = BACKENDS[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def for_profile(profile) -> Backend:
    """The backend of a device profile (``Profile.kind``: "cuda" with a [cuda] table, else "cpu")."""
    return get(profile.kind)


def for_target(target) -> Backend:
    """The backend that builds for a ``tvm.target.Target``: CUDA for a ``cuda`` target, else the CPU's."""
    return get("cuda" if target.kind.name == "cuda" else "cpu")


__all__ = ["Backend", "BACKENDS", "for_profile", "for_target", "get", "GOLDEN_RTOL", "GOLDEN_ATOL",
           "GOLDEN_FP16_RTOL", "GOLDEN_FP16_ATOL", "GOLDEN_INT8_RTOL", "GOLDEN_INT8_ATOL"]
