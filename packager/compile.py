"""Compile a Relax IRModule for a device profile and export it as a shared library.

What a build does for a kind of target is its backend's (``edgeq.backends``): this module finds the tools,
hands the graph and the module to the backend the profile or target picks, and exports libraries. Reading a
library's device code is the backend's (``Backend.device_code``).
"""

from __future__ import annotations

from pathlib import Path

from edgeq import backends
from edgeq.runtime.elf import machine as elf_machine  # noqa: F401 - part of this module's API
from edgeq.targets import Profile
from edgeq.toolchain import Toolchain
from edgeq.tvm_env import import_tvm


def toolchain_for(profile: Profile) -> Toolchain:
    """Find the compilers for ``profile`` before any work starts, so a missing one fails fast."""
    return backends.for_profile(profile).find_tools(profile)


def _target(target):
    return import_tvm().target.Target(target)


def lower_graph(graph, target, backend: backends.Backend | None = None):
    """The graph as the build's ``backend`` (by default ``target``'s) prepares it (``Backend.prepare``: CPU: convolutions and matrix
    products on edgeq's kernels, NHWC between them; CUDA: BatchNorm folded, weight reshapes precomputed).
    Returns (graph, conv/matmul calls on CPU kernels)."""
    tgt = _target(target)
    return (backend or backends.for_target(tgt)).prepare(graph, tgt)


def build(mod, target, toolchain: Toolchain | None = None, stats: dict | None = None,
          backend: backends.Backend | None = None):
    """``relax.build`` for ``target`` by its backend (``Backend.build``: CPU: TVM's pipeline with edgeq's
    schedules after fusion, ``stats`` counting the functions by schedule; CUDA: TVM's CUDA pipeline with
    edgeq's schedule step and CUDA graph capture, device code by the toolchain's CUDA toolkit, ``stats`` getting its
    ``GpuKernels`` record). A build passes its own ``backend``; without one, ``target``'s."""
    with _target(target) as tgt:
        return (backend or backends.for_target(tgt)).build(mod, tgt, toolchain, stats)


def export(executable, path: Path, toolchain: Toolchain) -> None:
    from tvm.support import cc

    import_tvm()
    executable.export_library(str(path), fcompile=cc.cross_compiler(toolchain.cxx))


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
        self.param_names = [p.name for p in graph.weight_params]

    def set_param(self, name: str, array) -> None:
        """Replace one weight parameter's value for the next calls (the compiled code stays)."""
        self.params[self.param_names.index(name)] = self.tvm.runtime.tensor(array, self.dev)

    def __call__(self, inputs: list) -> list:
        result = self.vm["main"](*[self.tvm.runtime.tensor(x, self.dev) for x in inputs], *self.params)
        return self._flatten(result)

    def _flatten(self, result) -> list:
        if isinstance(result, self.tvm.runtime.Tensor):
            return [result.numpy()]
        return [array for item in result for array in self._flatten(item)]
