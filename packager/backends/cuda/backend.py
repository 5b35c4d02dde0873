"""The CUDA backend (Jetson GPUs): the graph clean-up before TVM (``pipeline.prepare_graph``), TVM's CUDA
pipeline with edgeq's schedule step and CUDA graph capture (``pipeline.build``), device code by the CUDA
toolkit that matches the device's CUDA, host code for the profile's CPU by its cross compiler."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeq.backends.tolerances import (
    GOLDEN_ATOL,
    GOLDEN_FP16_ATOL,
    GOLDEN_FP16_RTOL,
    GOLDEN_INT8_ATOL,
    GOLDEN_INT8_RTOL,
    GOLDEN_RTOL,
)
from edgeq.errors import ToolchainError


# What a CUDA bundle's runtime/ holds beyond TVM's runtime: TVM's CUDA runtime (project, file in the wheel),
# which NEEDs libcudart.so.13, and where the device has CUDA 12 (JetPack 6) the bridge to it
TVM_CUDA_LIBRARY = ("apache-tvm", "tvm/lib/libtvm_runtime_cuda.so")
TVM_CUDART_MAJOR = 13
BRIDGE = "runtime/libcudart.so.13"


def toolkit_for(profile, found=None):
    """The toolkit for the profile's CUDA: same major version, closest minor not newer than the device's."""
    from edgeq.toolchain import cuda_toolkits

    want = profile.cuda
    want_minor = int(want.version.split(".")[1])
    found = cuda_toolkits() if found is None else found
    fits = [tk for tk in found if tk.version[0] == want.major and want.arch in tk.archs]
    if not fits:
        have = ", ".join(tk.describe() for tk in found) or "none"
        hint = (
            "pip install 'edgeq[jetson]' (NVRTC 12.6 wheels)"
            if want.major == 12
            else f"install a CUDA {want.major}.x toolkit with nvcc and set EDGEQ_CUDA_HOME to its root"
        )
        raise ToolchainError(
            f"{profile.name} runs CUDA {want.version} (JetPack {profile.software.get('jetpack', '?')}) and needs a "
            f"CUDA {want.major}.x toolkit that builds {want.arch}; found: {have}; {hint}"
        )
    # Older-or-equal minors first (closest first); a newer minor only when nothing older is there.
    return min(fits, key=lambda tk: (tk.version[1] > want_minor, abs(tk.version[1] - want_minor), tk.kind))



class CudaBackend:
    name = "cuda"
    device_type = "cuda"
    precisions = ("fp32", "int8", "mixed", "fp16")
    runtime_parts = ("TVM CUDA runtime", "CUDA bridge")
    gpu_kernels = "dlight"  # "cutlass": every layer edgeq's kernels take; "auto": those a GPU verified (ledger.py)
    uses_cutlass = False  # the build goes through edgeq's kernels (NHWC graph, claims)
    ledger = None  # "auto": the ledger of GPU-verified kernel kinds it decides by
    choice_note = None  # "auto": why every layer stays on dlight, where it does
    precision = "fp32"  # what it builds (with_gpu_kernels): decides the device math
    sm_count, smem_per_block = 0, 0  # the profile's, for CUTLASS's tile table

    def with_gpu_kernels(self, kind: str, profile, precision: str):
        """This backend with ``kind``'s kernels (``--gpu-kernels``): "auto" (the default: edgeq's kernels where
        every kind a layer's kernel needs has run on a GPU, ``ledger.py``; dlight elsewhere), "cutlass" (every
        layer edgeq's kernels take: NVIDIA's CUTLASS for fp16 and int8 convolutions and matrix products, NHWC, and
        edgeq's own; the rest on dlight) or "dlight" (TVM's rules for every layer)."""
        from edgeq.backends.cuda.ledger import Ledger
        from edgeq.errors import UsageError

        if kind not in ("auto", "dlight", "cutlass"):
            raise UsageError(f"unknown --gpu-kernels '{kind}'; choose auto, dlight or cutlass")
        if kind == "cutlass" and precision not in ("fp16", "int8"):
            raise UsageError(f"--gpu-kernels cutlass takes --precision fp16 or int8 (CUTLASS's tensor-core kernels), "
                             f"not {precision}; package {precision} with --gpu-kernels dlight")
        chosen = copy.copy(self)
        chosen.gpu_kernels = kind
        chosen.precision = precision
        chosen.uses_cutlass = kind == "cutlass"
        if kind == "auto":
            chosen.ledger = Ledger.load()
            if precision not in ("fp16", "int8"):
                chosen.choice_note = f"edgeq's GPU kernels take fp16 and int8 layers; {precision}: every layer on dlight"
            elif not chosen.ledger.verified():
                chosen.choice_note = ("no kernel kind of edgeq's has run on a GPU as it is written today "
                                      "(edgeq/backends/cuda/gpu_verified.json): every layer on dlight")
            else:
                chosen.uses_cutlass = True
        chosen.sm_count = profile.cuda.sm_count or 8
        chosen.smem_per_block = profile.cuda.shared_memory_per_block_optin or profile.cuda.max_shared_memory_per_block
        return chosen

    def kernel_choice(self) -> dict:
        """What the manifest records of how layers were put on kernels (``library.gpu_kernels.choice``)."""
        choice = {"gpu_kernels": self.gpu_kernels}
        if self.ledger is not None:
            choice["ledger"] = self.ledger.to_dict()
        if self.choice_note:
            choice["note"] = self.choice_note
        return choice

    def find_tools(self, profile):
        from edgeq.toolchain import Toolchain, cxx_for
        from edgeq.tvm_env import cuda_driver, import_tvm

        cxx = cxx_for(profile)
        toolkit = toolkit_for(profile)
        if not import_tvm().runtime.enabled("cuda"):
            raise ToolchainError(
                f"TVM's CUDA backend did not load (CUDA driver library: {cuda_driver()}); "
                "install gcc so edgeq can build its driver stub, or run on a machine with the NVIDIA driver"
            )
        return Toolchain(cxx=cxx, cuda_toolkit=toolkit)

    def prepare(self, graph, target):
        """BatchNorm folded, weight reshapes precomputed; no scheduling, so the result builds for any target
        (which is how the golden outputs check it on the build host). No call is on a CPU kernel."""
        from edgeq.backends.cuda.pipeline import (
            prepare_graph, row_scales_in_one_kernel, scalar_weights_as_constants, splits_as_slices, views_collapsed)

        if self.uses_cutlass:
            from edgeq.backends.cuda.cutlass import prepare_nhwc

            graph = splits_as_slices(views_collapsed(prepare_nhwc(prepare_graph(scalar_weights_as_constants(graph)))))
            return row_scales_in_one_kernel(graph), 0
        return row_scales_in_one_kernel(views_collapsed(prepare_graph(graph))), 0

    def build(self, mod, target, toolchain=None, stats: dict | None = None):
        """TVM's CUDA pipeline with edgeq's schedule step; ``stats`` gets its ``GpuKernels`` record (rule per
        kernel, fallbacks, kernels per inference). Without a CUDA toolkit, TVM's own CUDA pipeline."""
        from tvm import relax

        from edgeq.backends.cuda import pipeline

        if toolchain is None or toolchain.cuda_toolkit is None:
            return relax.build(mod, target=target)
        from edgeq.toolchain import DeviceMath

        math = DeviceMath.for_build(toolchain.cuda_toolkit.kind, self.precision)
        report = pipeline.GpuKernels(choice=self.kernel_choice(), device_math=math.to_dict())
        cutlass = (self.sm_count, self.smem_per_block) if self.uses_cutlass else None
        gate = self.ledger.gate if self.gpu_kernels == "auto" else None
        with toolchain.cuda_toolkit.active(math):
            executable = pipeline.build(mod, target, report, cutlass=cutlass, gate=gate)
        if stats is not None:
            stats.update(report.to_dict())
        return executable

    def own_schedule(self, workload, target):
        return None  # its schedule step runs inside the CUDA pipeline; measuring it needs a GPU (not done yet)

    def runtime_libraries(self, profile) -> tuple[tuple[str, str], ...]:
        return (TVM_CUDA_LIBRARY,)

    def runtime_shim(self, profile, cxx: str, last_library: Path, folder: Path):
        """The CUDA 12 -> 13 bridge, built from source for the device, forwarding what TVM's CUDA runtime
        (``last_library``) imports to JetPack's ``libcudart.so.12``; None where the device's CUDA is TVM's."""
        from edgeq.runtime import bridge
        from edgeq.runtime.assemble import c_compiler

        if profile.cuda.major >= TVM_CUDART_MAJOR:
            return None
        if profile.cuda.major != 12:
            raise ToolchainError(
                f"{profile.name} runs CUDA {profile.cuda.version}, and TVM's CUDA runtime needs CUDA {TVM_CUDART_MAJOR}; "
                f"edgeq bridges only CUDA 12 to {TVM_CUDART_MAJOR}; package with --runtime none and bring a TVM runtime built for it"
            )
        imports = bridge.cudart_imports(last_library)
        library = bridge.build_bridge(imports, c_compiler(cxx), folder, bridge.cuda12_headers(), bridge.cuda13_headers())
        return BRIDGE, library, {"file": BRIDGE, "provides": f"libcudart.so.{TVM_CUDART_MAJOR}",
                                 "forwards_to": "libcudart.so.12", "functions": imports}

    def device_code(self, library: Path) -> list[str]:
        from edgeq.backends.cuda.cubin import cuda_device_code

        return cuda_device_code(library)

    def check_library(self, library: Path, profile, toolchain) -> None:
        if profile.cuda.arch not in self.device_code(library):
            raise ToolchainError(
                f"the exported library carries no {profile.cuda.arch} device code (CUDA source only), so no device "
                f"could load it; check the CUDA toolkit ({toolchain.cuda_toolkit.describe()})"
            )

    def kernel_record(self, stats: Mapping[str, Any], kernel_calls: int) -> dict[str, Any]:
        return {"cpu_kernels": None, "gpu_kernels": dict(stats) if stats else None}  # pipeline.GpuKernels

    def golden_tolerance(self, precision: str, quantized: bool, on_build_host: bool) -> tuple[float, float]:
        if precision == "fp16":
            return GOLDEN_FP16_RTOL, GOLDEN_FP16_ATOL
        if quantized:
            return GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL
        return GOLDEN_RTOL, GOLDEN_ATOL

    def layer_precisions(self, graph, layers) -> dict[str, tuple[str, str]]:
        """On CUTLASS, a per-token int8 layer whose input another layer's epilogue makes (a transformer FFN's second
        layer, after GELU) runs in fp16: the layer before writes its input in fp16, where per-token int8 needs a
        kernel of its own to find each row's scale (a row is wider than any CTA's tile; no layer norm's kernel makes
        this input). One kernel less a layer, closer to float (all-MiniLM-L6-v2: benchmarks/RESULTS.md), and faster
        by the Orin roofline (at 128 tokens: the fp16 GEMM in 2 K slices, 23 us, against the int8 GEMM's 15 us, the
        quantize kernel's 9.6 us and launch, and the first layer's float32 output, 3.9 us more than its fp16 one);
        TensorRT picks a layer's precision by its speed the same way."""
        if not self.uses_cutlass or (self.gpu_kernels == "auto" and self.ledger.gate(("token-linear", "conv-fp16"))):
            return {}
        from edgeq.quantize.layers import epilogue_inputs

        why = ("fp16", "CUTLASS: its input comes in fp16 from the layer before, where per-token int8 takes a "
                       "row-quantize kernel")
        return {layer.weight: why for layer in epilogue_inputs(graph, layers)}

    def to_fp16(self, graph):
        from edgeq.backends.cuda.pipeline import to_fp16

        return to_fp16(graph)

    def describe_prepare(self, profile) -> str:
        return f"{profile.name}: BatchNorm folded into convs, weight reshapes precomputed for CUDA ({profile.cuda.arch})"

    def describe_build(self, profile, toolchain) -> str:
        return f"{profile.name}: {profile.cuda.arch} with {toolchain.cuda_toolkit.describe()}, host {profile.cpu.triple} ({profile.cpu.mcpu})"
