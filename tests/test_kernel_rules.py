"""The kernel registry (``edgeq.backends.cpu.rules``) without compiling anything: which kernel lowering picks
for a convolution or matrix product and what it plans (pinned to the choices made before the registry
existed), which schedule rule takes a kernel's TIR function and the name the manifest records for it, and
the registry's own shape (every kernel module listed once, the generic rule last)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from edgeq.backends.cpu.common import BmmSpec, ConvSpec, Isa, Kernel
from edgeq.backends.cpu.generic import GENERIC
from edgeq.backends.cpu.lower import choose
from edgeq.backends.cpu.rules import KERNELS, SCHEDULES
from edgeq.backends.cpu.rows import ROWS
from edgeq.backends.cpu.schedule import schedule_function
from edgeq.tvm_env import import_tvm

tvm = import_tvm()

KERNEL_DIR = Path(__file__).resolve().parent.parent / "packager" / "backends" / "cpu"
ISAS = {"avx512-vnni": Isa(16, "vnni", 32), "avx512": Isa(16, "", 32), "avx2": Isa(8, "", 16), "neon": Isa(4, "", 32),
        "neon-dotprod": Isa(4, "sdot", 32)}


def conv(n, hw, c, oc, k, dtype="float32", stride=1, pad=1, depthwise=False) -> ConvSpec:
    return ConvSpec(n, hw[0], hw[1], c, oc, k, k, (stride, stride), (pad,) * 4, (1, 1), dtype, depthwise)


PROBLEMS = {
    "3x3 64->64 16x16": conv(1, (16, 16), 64, 64, 3),
    "3x3 64->80 10x10 b2": conv(2, (10, 10), 64, 80, 3),
    "3x3 64->64 9x9": conv(1, (9, 9), 64, 64, 3),
    "3x3 16->32 12x12": conv(1, (12, 12), 16, 32, 3),
    "3x3 3->10 9x11": conv(1, (9, 11), 3, 10, 3),
    "dw 24 10x10": conv(1, (10, 10), 24, 24, 3, depthwise=True),
    "dw 30 13x13 s2 int8": conv(1, (13, 13), 30, 30, 3, "int8", stride=2, depthwise=True),
    "3x3 64->64 16x16 int8": conv(1, (16, 16), 64, 64, 3, "int8"),
    "1x1 32->48 uint8": conv(1, (8, 8), 32, 48, 1, "uint8", pad=0),
    "3x3 3->10 int8": conv(1, (9, 11), 3, 10, 3, "int8"),
    "1x1 144->24 56x56 uint8": conv(1, (56, 56), 144, 24, 1, "uint8", pad=0),
    "3x3 512->512 7x7 int8": conv(1, (7, 7), 512, 512, 3, "int8"),
    "matmul 6x40 @ 40x24": conv(1, (1, 6), 40, 24, 1, pad=0),
}

# (problem, CPU) -> kernel, dot, ocb, wino: as ConvSpec.plan chose them before the registry, except that
# AVX-512 blocks no longer span a vector and a half (24 -> 8, 30 -> 15: issue #15, Isa.vector_block), and that
# dot-product tiles fit the registers and take the most instructions per load (conv._dot_pixels, _per_load)
PLANS = [
    ("3x3 64->64 16x16", "avx512-vnni", "winograd", "", 32, 4),
    ("3x3 64->64 16x16", "avx2", "winograd", "", 16, 4),
    ("3x3 64->64 16x16", "neon", "winograd", "", 8, 4),
    ("3x3 64->80 10x10 b2", "avx512-vnni", "winograd", "", 16, 2),
    ("3x3 64->80 10x10 b2", "neon", "winograd", "", 8, 2),
    ("3x3 64->64 9x9", "avx512-vnni", "conv", "", 32, 0),
    ("3x3 64->64 9x9", "avx2", "conv", "", 16, 0),
    ("3x3 16->32 12x12", "avx512-vnni", "conv", "", 32, 0),
    ("3x3 16->32 12x12", "neon", "conv", "", 8, 0),
    ("3x3 3->10 9x11", "avx512-vnni", "conv", "", 10, 0),
    ("3x3 3->10 9x11", "neon", "conv", "", 5, 0),
    ("dw 24 10x10", "avx512-vnni", "dwconv", "", 8, 0),
    ("dw 24 10x10", "avx2", "dwconv", "", 8, 0),
    ("dw 30 13x13 s2 int8", "avx512-vnni", "dwconv", "", 15, 0),
    ("dw 30 13x13 s2 int8", "avx2", "dwconv", "", 15, 0),
    ("dw 30 13x13 s2 int8", "neon", "dwconv", "", 6, 0),
    ("3x3 64->64 16x16 int8", "avx512-vnni", "conv", "vnni", 64, 0),
    ("3x3 64->64 16x16 int8", "avx512", "conv", "", 32, 0),
    ("3x3 64->64 16x16 int8", "neon", "conv", "", 8, 0),
    ("1x1 32->48 uint8", "avx512-vnni", "conv", "vnni", 48, 0),
    ("1x1 144->24 56x56 uint8", "avx512-vnni", "conv", "vnni8", 24, 0),  # vpdpbusd on 256-bit vectors
    ("1x1 144->24 56x56 uint8", "avx512", "conv", "", 8, 0),
    ("3x3 512->512 7x7 int8", "avx512-vnni", "conv", "vnni", 32, 0),  # 7 pixels x 2 blocks; 1 x 4 spilled
    ("1x1 32->48 uint8", "avx2", "conv", "", 16, 0),
    ("3x3 3->10 int8", "avx512-vnni", "conv", "", 10, 0),
    ("matmul 6x40 @ 40x24", "avx512-vnni", "conv", "", 8, 0),
    ("matmul 6x40 @ 40x24", "avx2", "conv", "", 8, 0),
    # Arm dotprod (sdot, 4 lanes): any int8 channel count divisible by 4, blocks of four, two or one sdot
    ("3x3 64->64 16x16 int8", "neon-dotprod", "conv", "sdot", 16, 0),
    ("1x1 32->48 uint8", "neon-dotprod", "conv", "sdot", 12, 0),
    ("1x1 144->24 56x56 uint8", "neon-dotprod", "conv", "sdot", 12, 0),
    ("3x3 3->10 int8", "neon-dotprod", "conv", "", 5, 0),
    ("dw 30 13x13 s2 int8", "neon-dotprod", "dwconv", "", 6, 0),
    ("3x3 64->64 16x16", "neon-dotprod", "winograd", "", 8, 4),
]


@pytest.mark.parametrize("problem, isa, kernel, dot, ocb, wino", PLANS, ids=lambda v: str(v))
def test_lowering_picks_the_same_kernel_and_plan(problem, isa, kernel, dot, ocb, wino):
    chosen, spec = choose(PROBLEMS[problem], ISAS[isa])
    assert (chosen.name, spec.dot, spec.ocb, spec.wino) == (kernel, dot, ocb, wino)


def test_products_of_two_activations_go_to_the_batched_kernel():
    problem = BmmSpec(6, 10, 4, 10)
    chosen, spec = choose(problem, ISAS["avx2"])
    assert chosen.name == "bmm" and spec == problem


@pytest.mark.parametrize("problem, isa, name, tag", [
    ("3x3 64->64 16x16", "avx512-vnni", "winograd", "wino4_oc32"),
    ("3x3 16->32 12x12", "avx512-vnni", "conv", "oc32"),
    ("3x3 64->64 16x16 int8", "avx512-vnni", "conv-vnni", "vnni"),
    ("3x3 64->64 16x16 int8", "avx512", "conv", "oc32"),
    ("3x3 64->64 16x16 int8", "neon-dotprod", "conv-sdot", "sdot"),
    ("1x1 32->48 uint8", "neon-dotprod", "conv-sdot", "sdot"),
    ("dw 24 10x10", "avx2", "dwconv", "dw"),
])
def test_each_kernel_is_scheduled_by_its_own_rule(problem, isa, name, tag):
    """The TIR function a kernel builds is claimed by that kernel's rule; the weight tag and the name the
    manifest counts are the strings they were before the registry."""
    kernel, spec = choose(PROBLEMS[problem], ISAS[isa])
    func, _ = kernel.build(spec)
    scheduled, kind = schedule_function(func, ISAS[isa])
    assert (kind, kernel.tag(spec)) == (name, tag)
    assert not scheduled.same_as(func)


@pytest.mark.parametrize("planned, host", [("avx512-vnni", "avx512"), ("neon-dotprod", "avx512-vnni"),
                                           ("avx512-vnni", "neon-dotprod")])
def test_a_dot_layout_on_a_cpu_without_that_instruction_is_scheduled_as_plain_conv(planned, host):
    kernel, spec = choose(PROBLEMS["1x1 32->48 uint8"], ISAS[planned])
    func, _ = kernel.build(spec)
    assert schedule_function(func, ISAS[host])[1] == "conv"


def test_the_bmm_kernel_and_anything_else_get_their_rules():
    kernel, spec = choose(BmmSpec(2, 8, 16, 32), ISAS["avx2"])
    func, pack = kernel.build(spec)
    assert pack is None and schedule_function(func, ISAS["avx2"])[1] == "bmm"
    from tvm import te

    x = te.placeholder((64, 32), "float32", name="x")
    relu = te.compute(x.shape, lambda i, j: tvm.te.max(x[i, j], tvm.tirx.const(0.0, "float32")), name="relu")
    assert schedule_function(te.create_prim_func([x, relu]), ISAS["avx2"])[1] == "generic"


def _vectorized_extents(func) -> list[int]:
    """The extents of a function's vectorised loops (TVM 0.27 has no Python TIR visitor: from its script)."""
    return [int(n) for n in re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", func.script())]


@pytest.mark.parametrize("channels, lanes", [(16, 16), (24, 8), (40, 8), (96, 16), (6, 2)])
def test_an_int8_quantize_is_vectorised_along_its_channels(channels, lanes):
    """quantize(x) = int8(clip(round(x / scale))): the float division by the scale does not stop the vector
    (it once left every such loop scalar), and 24 or 40 channels get 8-lane vectors (they were left to LLVM,
    which vectorised them with gathers and byte-by-byte stores)."""
    from tvm import te

    x = te.placeholder((1, 28, 28, channels), "float32", name="x")
    q = te.compute(x.shape, lambda *i: te.max(te.min(tvm.tirx.round(x(*i) / tvm.tirx.const(0.0015, "float32")),
                                                     127.0), -128.0).astype("int32").astype("int8"), name="q")
    scheduled, kind = schedule_function(te.create_prim_func([x, q]), ISAS["avx512-vnni"])
    assert kind == "generic" and _vectorized_extents(scheduled) == [lanes]


def test_every_kernel_module_is_listed_once_and_the_generic_rule_is_last():
    declared = []
    for path in sorted(KERNEL_DIR.glob("*.py")):
        module = importlib.import_module(f"edgeq.backends.cpu.{path.stem}")
        if isinstance(getattr(module, "KERNEL", None), Kernel):
            declared.append(module.KERNEL)
    assert sorted(k.name for k in declared) == sorted(k.name for k in KERNELS)
    assert len({k.name for k in KERNELS}) == len(KERNELS) and len({k.block for k in KERNELS}) == len(KERNELS)
    assert SCHEDULES == [*KERNELS, ROWS, GENERIC]


def test_no_kernel_module_imports_another_modules_private_names():
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgeq"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
