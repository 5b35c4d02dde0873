"""Which of edgeq's GPU kernel kinds a GPU has run, and so which ``--gpu-kernels auto`` (the default) uses (#63).

A kind is one way edgeq writes device code: a CUTLASS convolution of a precision, a feature of one (serial split-K,
an output written in place or upsampled or as a detector's output, a residual after the activation, a float32 bias),
a batched GEMM, edgeq's own TIR kernels (depthwise, layer norm, per-token quantize, pool + classifier,
squeeze-and-excitation, attention scores). Its key is the SHA-256 of the device source edgeq generates for it today
(``source_sha256``): a canonical probe's CUDA C++ (``cutlass.device_source``, the epilogues and iterators included)
or scheduled TIR (TVMScript), or, for the kernels scheduled from the graph's own TIR, the module that schedules them;
each with the device math options (``device_math``). Changing how a kind is written changes its key.

The ledger (``gpu_verified.json`` beside this file, package data; ``benchmarks/gpu_bench.py run`` writes it on a
GPU) lists the kinds that passed there: kind -> {source_sha256, gpu, driver, date, evidence}. A kind is verified
when its entry's key is today's. ``auto`` puts a layer on edgeq's kernels when every kind its kernel needs is
verified, and leaves it on dlight otherwise, saying so in the manifest ("not yet run on a GPU");
``--gpu-kernels cutlass`` takes every layer it can, ``dlight`` none.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from pathlib import Path

LEDGER = Path(__file__).with_name("gpu_verified.json")
NOT_RUN = "not yet run on a GPU"


def kinds_of(kernel) -> tuple[str, ...]:
    """The kinds a claimed kernel (``cutlass.ConvKernel`` and its subclasses) needs verified."""
    from edgeq.backends.cuda import cutlass

    if isinstance(kernel, cutlass.GemmKernel):
        return ("gemm-int8-out",) if kernel.quantize else ("gemm-fp16",)
    if isinstance(kernel, cutlass.TokenLinearKernel):
        return ("token-linear",)
    if isinstance(kernel, cutlass.GroupConvKernel):
        return ("group-conv-fp16",)
    if isinstance(kernel, cutlass.DepthwiseKernel):
        return (f"depthwise-{kernel.precision}",)
    kinds = [f"conv-{kernel.precision}"]
    features = (("split-k", kernel.tile is not None and kernel.tile.split_k > 1), ("residual-after", kernel.residual_after),
                ("float-bias", kernel.float_bias), ("in-place", kernel.out_view is not None),
                ("upsampled-output", kernel.up_view is not None), ("detector-output", kernel.head_out is not None))
    return tuple(kinds + [name for name, has in features if has])


def _probes() -> dict[str, object]:
    """kind -> a function giving its device source today."""
    from edgeq.backends.cuda import attention, concat_in_place, cutlass, layer_norm, pool_classifier, squeeze_excite

    P = cutlass.Conv2dProblem  # noqa: N806
    conv3 = P(2, 14, 14, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1))
    tile = cutlass.choose_tile(conv3, 8, 166912)
    tile8 = cutlass.choose_tile(conv3, 8, 166912, "int8")

    def cuda(*kernels):
        return lambda: cutlass.device_source(list(kernels))

    def tir(make):
        return lambda: make().script()

    def module(mod):
        return lambda: inspect.getsource(mod)

    conv16 = cutlass.ConvKernel("probe", conv3, tile, "relu", True)
    conv8 = cutlass.ConvKernel("probe", conv3, tile8, "relu", True, "int8", residual_scale=0.5, act_lo=0.0,
                               out_div=0.25, silu=True)
    last = P(1, 7, 7, 512, 512, 3, 3, (1, 1), (1, 1), (1, 1))
    split = cutlass.ConvKernel("probe", last, cutlass.split_k(last, cutlass.choose_tile(last, 8, 166912), 8), "relu", True)
    gemm = cutlass.GemmProblem(12, 128, 128, 64)
    dw = P(1, 28, 28, 144, 144, 3, 3, (1, 1), (1, 1), (1, 1), groups=144)
    group = P(1, 14, 14, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1), groups=4)
    tokens = P(1, 1, 128, 384, 384, 1, 1, (0, 0), (1, 1), (1, 1))
    fc = cutlass.ConvKernel("fc", P(1, 1, 1, 512, 1000, 1, 1), None, precision="int8", float_out=True)
    return {
        "conv-fp16": cuda(conv16),
        "conv-int8": cuda(conv8),
        "split-k": cuda(split),
        "residual-after": cuda(dataclasses.replace(conv16, activation="silu", residual_after=True)),
        "float-bias": cuda(dataclasses.replace(conv16, activation="identity", float_out=True, float_bias=True)),
        "in-place": cuda(dataclasses.replace(conv8, out_view=(32, 128), out_in_place=True)),
        "upsampled-output": cuda(dataclasses.replace(conv8, residual=False, out_view=(32, 128), up_view=(16, 96))),
        "detector-output": cuda(dataclasses.replace(conv8, residual=False, float_out=True,
                                                    head_out=(40, 200, 80, 500, "float32"))),
        "gemm-fp16": cuda(cutlass.GemmKernel("probe", gemm, cutlass.choose_tile(gemm, 8, 166912), alpha=0.125)),
        "gemm-int8-out": cuda(cutlass.GemmKernel("probe", gemm, cutlass.choose_tile(gemm, 8, 166912),
                                                 quantize=(0.05, -127.0, 127.0))),
        "group-conv-fp16": cuda(cutlass.GroupConvKernel("probe", group, cutlass.group_tile(group, 8, 166912), "relu")),
        "token-linear": cuda(cutlass.TokenLinearKernel("probe", tokens, cutlass.choose_tile(tokens, 8, 166912, "int8"),
                                                       precision="int8", residual=True)),
        "depthwise-fp16": tir(lambda: cutlass.depthwise_prim_func(cutlass.DepthwiseKernel("probe", dw, None, "relu6"))),
        "depthwise-int8": tir(lambda: cutlass.depthwise_prim_func(cutlass.DepthwiseKernel(
            "probe", dw, None, "identity", True, "int8", residual_scale=0.04, out_div=0.05, silu=True, post=True))),
        "layer-norm": tir(lambda: layer_norm.prim_func(
            layer_norm.LayerNormKernel("probe", (1, 128, 384), 1e-12, (1, 128, 384), 127.0))),
        "row-quantize": tir(lambda: layer_norm.row_quantize_prim_func(
            layer_norm.RowQuantizeKernel("probe", (1, 128, 1536), "float16", 127.0))),
        "pool-classifier": tir(lambda: pool_classifier.prim_func(pool_classifier.PoolClassifierKernel(
            "probe", (1, 7, 7, 512), "float32", fc, {"y": (1, 1000)}, (0.05, -128.0, 127.0), 8))),
        # scheduled from the graph's own TIR: the schedule is what edgeq writes
        "squeeze-excite": module(squeeze_excite),
        "attention-scores": module(attention),
        "concat-in-place": module(concat_in_place),
    }


KINDS = ("conv-fp16", "conv-int8", "split-k", "residual-after", "float-bias", "in-place", "upsampled-output",
         "detector-output", "gemm-fp16", "gemm-int8-out", "group-conv-fp16", "token-linear", "depthwise-fp16",
         "depthwise-int8", "layer-norm", "row-quantize", "pool-classifier", "squeeze-excite", "attention-scores",
         "concat-in-place")


@functools.cache
def source_sha256(kind: str) -> str:
    """The key of ``kind`` today: its device source and the device math it compiles with (both option sets: a
    kind can be in an int8 build and in an fp16 one)."""
    from edgeq.toolchain import EXACT, FLOAT

    source = _probes()[kind]()
    return hashlib.sha256(f"{EXACT.nvrtc_options()}\n{FLOAT.nvrtc_options()}\n{source}".encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The kinds a GPU ran (``gpu_verified.json``): kind -> {source_sha256, gpu, driver, date, evidence}."""

    entries: dict

    @classmethod
    def load(cls, path: Path | None = None) -> Ledger:
        path = path or LEDGER
        data = json.loads(path.read_text()) if path.is_file() else {}
        return cls(dict(data.get("kinds", {})))

    def why_not(self, kind: str) -> str | None:
        """None where ``kind`` is verified for today's source, else why not."""
        entry = self.entries.get(kind)
        if entry is None:
            return f"{NOT_RUN} ({kind})"
        if entry.get("source_sha256") != source_sha256(kind):
            return f"{NOT_RUN} as written today ({kind} changed since it ran on {entry.get('gpu', 'a GPU')}, {entry.get('date', '?')})"
        return None

    def verified(self) -> list[str]:
        return [k for k in KINDS if self.why_not(k) is None]

    def gate(self, kinds) -> str | None:
        """None where every one of ``kinds`` is verified, else the first reason."""
        return next((why for why in map(self.why_not, kinds) if why), None)

    def to_dict(self) -> dict:
        """What the manifest records of the ledger a build used."""
        return {"verified": self.verified(), "kinds": len(KINDS)}


def entry(kind: str, gpu: str, driver: str, date: str, evidence: list[str]) -> dict:
    """A ledger entry for ``kind`` as written today (``benchmarks/gpu_bench.py run``)."""
    return {"source_sha256": source_sha256(kind), "gpu": gpu, "driver": driver, "date": date, "evidence": evidence}
