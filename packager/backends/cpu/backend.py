"""The CPU backend: convolutions and matrix products on edgeq's own kernels (``lower``), TVM's pipeline with
edgeq's schedules after fusion (``schedule.cpu_pipeline``), host code by LLVM for the profile's CPU."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeq.backends.tolerances import GOLDEN_ATOL, GOLDEN_INT8_ATOL, GOLDEN_INT8_RTOL, GOLDEN_RTOL


class CpuBackend:
    name = "cpu"
    device_type = "cpu"
    precisions = ("fp32", "int8", "mixed")
    runtime_parts: tuple[str, ...] = ()

    def find_tools(self, profile):
        from edgeq.toolchain import Toolchain
        from edgeq.toolchain import cxx_for

        return Toolchain(cxx=cxx_for(profile), cuda_toolkit=None)

    def prepare(self, graph, target):
        """The graph on edgeq's CPU kernels, NHWC between them; inference BatchNorms folded first (a
        BatchNorm the exporter left, DenseNet's after each concatenation, becomes a per-channel multiply and
        add, which follows the NHWC layout; as batch_norm it was computed between two transposes to NCHW)."""
        from edgeq.backends.cpu.common import Isa
        from edgeq.backends.cpu.lower import lower_for_cpu
        from edgeq.graph_passes import fold_batch_norm

        return lower_for_cpu(fold_batch_norm(graph), Isa.of(target))

    def build(self, mod, target, toolchain=None, stats: dict | None = None):
        """TVM's pipeline with edgeq's schedules after fusion; ``stats`` counts the functions by schedule."""
        from tvm import relax

        from edgeq.backends.cpu.common import Isa
        from edgeq.backends.cpu.schedule import cpu_pipeline

        return relax.build(mod, target=target, relax_pipeline=cpu_pipeline(target, Isa.of(target), stats))

    def build_decoder(self, mod, weights: dict, target, bits: int | None = None, codes: dict | None = None):
        """A language model's steps (``edgeq.llm.build``) built for ``target``: weights packed into panels (and
        quantized to ``bits``, weight-only), products on register tiles (``edgeq.backends.cpu.decoder``). Returns
        (executable, weights as it takes them)."""
        from edgeq.backends.cpu.decoder import build

        return build(mod, weights, target, bits=bits, codes=codes)

    def own_schedule(self, workload, target):
        """The function as the CPU pipeline schedules it (edgeq's kernel or schedule rule, then the requantizing
        rewrites): what a tuning record must beat to be used."""
        from tvm import IRModule

        from edgeq.backends.cpu.common import Isa
        from edgeq.backends.cpu.schedule import schedule_pass

        # a module of its own: the pass sets its functions in place, and the workload is the tuning database's key
        return schedule_pass(Isa.of(target))(IRModule(dict(workload.functions.items())))

    def runtime_libraries(self, profile) -> tuple[tuple[str, str], ...]:
        return ()

    def runtime_shim(self, profile, cxx: str, last_library: Path, folder: Path):
        return None

    def device_code(self, library: Path) -> list[str]:
        return []  # a CPU library carries no device code

    def check_library(self, library: Path, profile, toolchain) -> None:
        return None  # the library's machine is checked for every backend (edgeq.package)

    def kernel_record(self, stats: Mapping[str, Any], kernel_calls: int) -> dict[str, Any]:
        return {"cpu_kernels": {"conv_matmul_calls": kernel_calls, "schedules": dict(sorted(stats.items()))} if stats else None,
                "gpu_kernels": None}

    def golden_tolerance(self, precision: str, quantized: bool, on_build_host: bool) -> tuple[float, float]:
        # on the build host the golden outputs come from the bundle's own library; another CPU's int8 build
        # may cross a rounding boundary (see GOLDEN_INT8_*)
        if quantized and not on_build_host:
            return GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL
        return GOLDEN_RTOL, GOLDEN_ATOL

    def layer_precisions(self, graph, layers) -> dict[str, tuple[str, str]]:
        return {}  # every int8 layer is faster in int8 on a CPU (VNNI, dot-product), per-token ones included

    def to_fp16(self, graph):
        from edgeq.errors import UsageError

        raise UsageError("--precision fp16 is for CUDA profiles (jetson-*); use fp32, int8 or mixed on a CPU")

    def describe_prepare(self, profile) -> str:
        return f"{profile.name}: conv/matmul -> edgeq CPU kernels for {profile.cpu.mcpu}"

    def describe_build(self, profile, toolchain) -> str:
        return f"{profile.name}: LLVM {profile.cpu.triple} ({profile.cpu.mcpu})"
