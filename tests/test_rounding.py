"""Requantizing epilogues in lrint form (``edgeq.backends.cpu.rounding``): the rewritten TIR computes exactly what
``cast(clip(round(float(acc) * m) + zp, lo, hi))`` computes, checked against numpy (round half to even, the
float32 product) on ties, on both ends of the int32 range and on multipliers that push the product past it,
where the conversion alone would wrap to INT_MIN."""

from __future__ import annotations

import numpy as np
import pytest

from edgeq.backends.cpu.common import Isa
from edgeq.backends.cpu.rounding import BOUND, fast_requantize
from edgeq.targets import profiles
from edgeq.tvm_env import import_tvm

tvm = import_tvm()
from tvm import te, tirx  # noqa: E402
from tvm.s_tir import Schedule  # noqa: E402

import edgeq.backends.cpu.schedule  # noqa: E402,F401  (nearbyint vectorisable)

N = 256


def requantize_func(dtype: str, lo: int, hi: int, zp: int, vector: bool, zp_tensor: bool = False):
    """``cast(clip(round(float(acc) * m) + zp, lo, hi))``; ``zp_tensor``: the zero point read from a
    one-value tensor of ``dtype`` (as ONNX QuantizeLinear imports), not a constant."""
    acc = te.placeholder((N,), "int32", name="acc")
    m = te.placeholder((N,), "float32", name="m")
    z = te.placeholder((1,), dtype, name="z")

    def body(i):
        r = tirx.nearbyint(acc[i].astype("float32") * m[i])
        if zp_tensor:
            r = r + z[0].astype("float32")
        elif zp:
            r = r + tirx.const(float(zp), "float32")
        r = te.max(te.min(r, tirx.const(float(hi), "float32")), tirx.const(float(lo), "float32"))
        return r.astype("int32").astype(dtype)

    out = te.compute((N,), body, name="out")
    func = te.create_prim_func([acc, m, z, out] if zp_tensor else [acc, m, out])
    if vector:
        sch = Schedule(tvm.IRModule({"main": func}))
        _, inner = sch.split(sch.get_loops(sch.get_sblock("out"))[0], [None, 16])
        sch.vectorize(inner)
        func = sch.mod["main"]
    return func


def run(func, acc, m, dtype, *extra):
    target = tvm.target.Target(profiles()["host"].host_target_dict())
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out = tvm.runtime.tensor(np.zeros(N, dtype))
    lib["main"](tvm.runtime.tensor(acc), tvm.runtime.tensor(m), *(tvm.runtime.tensor(e) for e in extra), out)
    return out.numpy(), lib


def cases(rng, large: bool):
    """Accumulators: ties under m = 0.5, the int32 extremes, random values; multipliers below 0.99 or,
    with ``large``, up to 1e6 (products far past the int32 range)."""
    acc = np.concatenate([np.arange(-15, 17, dtype=np.int64),  # x 0.5: every tie, both signs
                          [2**31 - 1, -(2**31), 2**31 - 129, -(2**31) + 1, 0, 1, -1, 255, -256],
                          rng.integers(-(2**31), 2**31, N - 41)]).astype(np.int32)
    m = rng.uniform(0.001, 0.98, N).astype(np.float32)
    m[:32] = 0.5
    m[32:41] = [0.98, 0.98, 0.98, 0.98, 0.7, 0.5, 0.5, 0.01, 0.01]
    if large:
        m[41::3] = rng.uniform(1.0, 1e6, len(m[41::3])).astype(np.float32)
        m[32:36] = [3.0, 3.0, 1e6, 1e6]
    return acc, m


@pytest.mark.parametrize("dtype,lo,hi,zp", [("int8", -128, 127, 0), ("int8", 0, 127, 0), ("int8", 0, 96, 0),
                                            ("uint8", 0, 255, 128), ("uint8", 128, 255, 128)])
@pytest.mark.parametrize("known", ["safe", "large", "unknown"])
def test_lrint_form_matches_round_clip_cast(dtype, lo, hi, zp, known):
    acc, m = cases(np.random.default_rng(0), large=known != "safe")
    want = np.clip(np.round(acc.astype(np.float32) * m) + np.float32(zp), lo, hi).astype(dtype)
    magnitudes = {"safe": {1: float(np.abs(m).max())}, "large": {1: float(np.abs(m).max())}, "unknown": {}}[known]
    func = fast_requantize(requantize_func(dtype, lo, hi, zp, vector=True), magnitudes)
    text = func.script()
    assert "llvm.lrint" in text and "nearbyint" not in text
    # the product is bounded before the conversion unless its multiplier is known to be small
    assert (str(BOUND) in text) == (known != "safe"), text
    got, lib = run(func, acc, m, dtype)
    np.testing.assert_array_equal(got, want)
    host = tvm.target.Target(profiles()["host"].host_target_dict())
    if Isa.of(host).lanes == 16:  # AVX-512: one rounding conversion and one saturating narrowing per vector
        asm = lib.mod.inspect_source("asm")
        assert "vcvtps2dq" in asm and "vrndscaleps" not in asm
        assert "vpmovsdb" in asm or "vpmovusdb" in asm  # (uint8 with zero point 128: vpmovsdb, then xor 128)


@pytest.mark.parametrize("dtype,zp", [("int8", -5), ("uint8", 128)])
def test_a_zero_point_tensor_is_added_in_integers(dtype, zp):
    acc, m = cases(np.random.default_rng(2), large=True)
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    want = np.clip(np.round(acc.astype(np.float32) * m) + np.float32(zp), lo, hi).astype(dtype)
    func = fast_requantize(requantize_func(dtype, lo, hi, 0, vector=True, zp_tensor=True))
    assert "llvm.lrint" in func.script()
    got, _ = run(func, acc, m, dtype, np.array([zp], dtype))
    np.testing.assert_array_equal(got, want)


def test_the_original_form_is_what_the_reference_computes():
    """The rewrite's reference: TVM's own lowering of the same function, unrewritten, gives numpy's answer."""
    acc, m = cases(np.random.default_rng(1), large=True)
    got, _ = run(requantize_func("int8", -128, 127, 0, vector=True), acc, m, "int8")
    np.testing.assert_array_equal(got, np.clip(np.round(acc.astype(np.float32) * m), -128, 127).astype(np.int8))


def test_other_roundings_are_left_alone():
    """A round that is not clipped into int8 (a model's own Round, a float result) keeps TVM's form."""
    x = te.placeholder((N,), "float32", name="x")
    out = te.compute((N,), lambda i: tirx.nearbyint(x[i] * 0.5), name="out")
    wide = te.compute((N,), lambda i: te.max(te.min(tirx.nearbyint(x[i]), 1000.0), -1000.0).astype("int32"),
                      name="wide")
    for func in (te.create_prim_func([x, out]), te.create_prim_func([x, wide])):
        assert fast_requantize(func).script() == func.script()
