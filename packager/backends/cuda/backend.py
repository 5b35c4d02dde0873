"""The CUDA backend (Jetson GPUs): the graph clean-up before TVM (``pipeline.prepare_graph``), TVM's CUDA
pipeline with edgeq's schedule step and CUDA graph capture (``pipeline.build``), device code by the CUDA
toolkit that matches the device's CUDA, host code for the profile's CPU by its cross compiler."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeq.backends import (
    GOLDEN_ATOL,
    GOLDEN_FP16_ATOL,
    GOLDEN_FP16_RTOL,
    GOLDEN_INT8_ATOL,
    GOLDEN_INT8_RTOL,
    GOLDEN_RTOL,
)
from edgeq.errors import ToolchainError


class CudaBackend:
    name = "cuda"
    precisions = ("fp32", "int8", "mixed", "fp16")
    runtime_parts = ("CUDA bridge",)

    def find_tools(self, profile):
        from edgeq.toolchain import Toolchain
        from edgeq.toolchain import cuda_toolkit_for, cxx_for
        from edgeq.tvm_env import cuda_driver, import_tvm

        cxx = cxx_for(profile)
        toolkit = cuda_toolkit_for(profile)
        if not import_tvm().runtime.enabled("cuda"):
            raise ToolchainError(
                f"TVM's CUDA backend did not load (CUDA driver library: {cuda_driver()}); "
                "install gcc so edgeq can build its driver stub, or run on a machine with the NVIDIA driver"
            )
        return Toolchain(cxx=cxx, cuda=toolkit)

    def prepare(self, graph, target):
        """BatchNorm folded, weight reshapes precomputed; no scheduling, so the result builds for any target
        (which is how the golden outputs check it on the build host). No call is on a CPU kernel."""
        from edgeq.backends.cuda.pipeline import prepare_graph

        return prepare_graph(graph), 0

    def build(self, mod, target, toolchain=None, stats: dict | None = None):
        """TVM's CUDA pipeline with edgeq's schedule step; ``stats`` gets its ``GpuKernels`` record (rule per
        kernel, fallbacks, kernels per inference). Without a CUDA toolkit, TVM's own CUDA pipeline."""
        from tvm import relax

        from edgeq.backends.cuda import pipeline

        if toolchain is None or toolchain.cuda is None:
            return relax.build(mod, target=target)
        report = pipeline.GpuKernels()
        with toolchain.cuda.active():
            executable = pipeline.build(mod, target, report)
        if stats is not None:
            stats.update(report.to_dict())
        return executable

    def own_schedule(self, workload, target):
        return None  # its schedule step runs inside the CUDA pipeline; measuring it needs a GPU (not done yet)

    def check_library(self, library: Path, profile, toolchain) -> None:
        from edgeq.compile import cuda_device_code

        if profile.cuda.arch not in cuda_device_code(library):
            raise ToolchainError(
                f"the exported library carries no {profile.cuda.arch} device code (CUDA source only), so no device "
                f"could load it; check the CUDA toolkit ({toolchain.cuda.describe()})"
            )

    def kernel_record(self, stats: Mapping[str, Any], kernel_calls: int) -> dict[str, Any]:
        return {"cpu_kernels": None, "gpu_kernels": dict(stats) if stats else None}  # pipeline.GpuKernels

    def golden_tolerance(self, precision: str, quantized: bool, on_build_host: bool) -> tuple[float, float]:
        if precision == "fp16":
            return GOLDEN_FP16_RTOL, GOLDEN_FP16_ATOL
        if quantized:
            return GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL
        return GOLDEN_RTOL, GOLDEN_ATOL

    def to_fp16(self, graph):
        from edgeq.backends.cuda.pipeline import to_fp16

        return to_fp16(graph)

    def describe_prepare(self, profile) -> str:
        return f"{profile.name}: BatchNorm folded into convs, weight reshapes precomputed for CUDA ({profile.cuda.arch})"

    def describe_build(self, profile, toolchain) -> str:
        return f"{profile.name}: {profile.cuda.arch} with {toolchain.cuda.describe()}, host {profile.cpu.triple} ({profile.cpu.mcpu})"
