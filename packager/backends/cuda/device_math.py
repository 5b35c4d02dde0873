"""How edgeq's CUDA code does float arithmetic on the device: decided here, not inherited from TVM (#63).

TVM's NVRTC path always passes ``--use_fast_math`` (``tvm/support/nvcc.py``), which means four things: ``x / y``
becomes ``div.approx.ftz.f32`` (2 ulp), ``sqrtf`` becomes ``sqrt.approx``, denormals flush to zero, and ``a * b + c``
may contract into one FMA; its front end also maps ``expf`` to ``__expf``. An int8 value whose float is near a
rounding boundary then lands on the other side on the device and never on the host, where every float32 operator
rounds on its own, as the graph's operators and the numpy replays do. edgeq's builds append their own options
(``edgeq.toolchain.DeviceMath.for_build``, applied by ``CudaToolkit.active``; ``EXACT`` for the builds that round
floats to int8, ``FLOAT``, which keeps FMA contraction, for fp32 and fp16) after
TVM's (``TVM_CUDA_NVRTC_EXTRA_OPTS``, read after the built-in ones): IEEE division and square root, denormals kept, no
contraction, ``__USE_FAST_MATH__`` undefined. The front end's ``expf`` -> ``__expf`` mapping cannot be undone by an
option, so a kernel whose int8 output goes through an exponential uses ``exp_rn`` below, which is written in
correctly rounded float32 operators (and exact ones: ``rint``, a power of two from its bits) and so gives the same
bits in CUDA C++ (``EXP_RN_CPP``), in TIR on the host and on the device (``exp_rn_tir``) and in numpy
(``exp_rn_numpy``). Measured cost in SASS: ``benchmarks/RESULTS.md`` (device math).

nvcc mode (a system CUDA toolkit) honours ``TVM_CUDA_NVCC_NO_FAST_MATH``, which drops ``--use_fast_math``
(nvcc's defaults are then IEEE division and square root and no flushing), but TVM's nvcc path takes no extra
options, so ``--fmad`` stays nvcc's default (on): the manifest says so (``DeviceMath.for_toolkit``).
"""

from __future__ import annotations

import numpy as np

from edgeq.toolchain import EXACT, FAST, FLOAT, DeviceMath  # noqa: F401 - the options, decided with the toolkit


# exp(x) = 2^n * p(r): n = rint(x log2 e), r = x - n ln2 (ln2 in two parts; n * LN2_HI is exact for |n| <= 128),
# p a degree-6 Taylor polynomial in Horner form; x clamped to [LO, HI] so that 2^n is a normal float (n in
# [-126, 127]). About 2 ulp from exp; what matters is that every step is one IEEE operation, so every
# implementation below computes the same bits. Constants are float32 values written as their exact decimal.
LO, HI = -87.0, 88.0
LOG2E = 1.44269502162933349609375  # float32(log2(e))
LN2_HI = 0.693145751953125  # 0x3f317200
LN2_LO = 1.428606765330187045037746429443359375e-06  # 0x35bfbe8e
POLY = (1.0, 1.0, 0.5, 0.16666667163372039794921875, 0.041666667908430099487304688, 0.0083333337679505348205566406,
        0.0013888889225199818611145020)  # float32(1 / k!), k = 0..6

EXP_RN_CPP = f"""
// edgeq's exp for int8 epilogues (device_math.py): every step one IEEE float32 operation, no contraction, so the
// host twin (TIR), the numpy replay and this give the same bits; expf() would be __expf under TVM's --use_fast_math
CUTLASS_DEVICE float exp_rn(float x) {{
  x = fminf(fmaxf(x, {LO:.1f}f), {HI:.1f}f);
  float n = rintf(__fmul_rn(x, {LOG2E!r}f));
  float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, {LN2_HI!r}f)), __fmul_rn(n, {LN2_LO!r}f));
  float p = {POLY[6]!r}f;
""" + "".join(f"  p = __fadd_rn(__fmul_rn(p, r), {c!r}f);\n" for c in reversed(POLY[:6])) + """\
  return __fmul_rn(p, __int_as_float((int(n) + 127) << 23));
}
// SiLU as the int8 epilogues compute it: x * (1 / (1 + exp_rn(-x)))
CUTLASS_DEVICE float silu_rn(float x) { return __fmul_rn(x, __fdiv_rn(1.f, __fadd_rn(1.f, exp_rn(-x)))); }
"""


def exp_rn_tir(x):
    """``exp_rn`` of a float32 TIR expression (TE): the same operators, in the same order, as ``EXP_RN_CPP``."""
    from edgeq.tvm_env import tvm

    tirx = tvm.tirx

    def f32(v):
        return tirx.const(v, "float32")

    x = tirx.min(tirx.max(x, f32(LO)), f32(HI))
    n = tirx.nearbyint(x * f32(LOG2E))
    r = (x - n * f32(LN2_HI)) - n * f32(LN2_LO)
    p = f32(POLY[6])
    for c in reversed(POLY[:6]):
        p = p * r + f32(c)
    two_n = tirx.reinterpret("float32", tirx.shift_left(n.astype("int32") + 127, 23))
    return p * two_n


def silu_rn_tir(x):
    """``x * (1 / (1 + exp_rn(-x)))`` in TIR, as ``silu_rn``."""
    from edgeq.tvm_env import tvm

    one = tvm.tirx.const(1.0, "float32")
    return x * (one / (one + exp_rn_tir(tvm.tirx.const(0.0, "float32") - x)))


def exp_rn_numpy(x: np.ndarray) -> np.ndarray:
    """``exp_rn`` in numpy: float32 throughout, each operator rounded on its own."""
    f32 = np.float32
    x = np.minimum(np.maximum(np.asarray(x, f32), f32(LO)), f32(HI))
    n = np.rint(x * f32(LOG2E))
    r = (x - n * f32(LN2_HI)) - n * f32(LN2_LO)
    p = np.full_like(x, f32(POLY[6]))
    for c in reversed(POLY[:6]):
        p = p * r + f32(c)
    two_n = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(f32)
    return (p * two_n).astype(f32)


def silu_rn_numpy(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    x = np.asarray(x, f32)
    return (x * (f32(1) / (f32(1) + exp_rn_numpy(-x)))).astype(f32)
