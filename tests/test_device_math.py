"""edgeq's device math (#63, ``backends/cuda/device_math.py``): one rounding rule (half to even, the graph's) in the
host twins, the numpy replays and the device source; the device code compiled without TVM's ``--use_fast_math``
(IEEE division and square root, no flushing, no contraction), read from its PTX; and the int8 SiLU's exponential
(``exp_rn``) the same bits in numpy, in TIR on this CPU and in the CUDA C++ the epilogues use."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import textwrap

import numpy as np
import pytest

import cutlass_replay  # tests/

from edgeq.backends.cuda import cutlass, device_math
from edgeq.tvm_env import import_tvm

tvm = import_tvm()


def _exp_inputs() -> np.ndarray:
    """Every 509th float32 from 0 to 100 (denormals included) and their negatives (the clamp's both sides), and
    the edges exactly."""
    bits = np.arange(0, np.float32(100).view(np.int32), 509, dtype=np.int32)
    positive = bits.view(np.float32)
    edges = np.array([0, -0.0, 1, -1, 87, -87, 88, -88, 88.5, -87.5, 0.5 * np.log(2), 103, -104], np.float32)
    return np.concatenate([positive, -positive, edges]).astype(np.float32)


def test_exp_rn_is_the_same_bits_in_numpy_tir_and_cuda_cxx(tmp_path):
    """``exp_rn`` in numpy, in TIR built for this CPU (as a host twin is) and in the C++ the CUTLASS epilogues
    compile (``EXP_RN_CPP``, here by g++ with CUDA's _rn intrinsics as the IEEE operators they are): the same
    bits on 4.4 million inputs, within 3 ulp of exp in float64."""
    x = _exp_inputs()
    want = device_math.exp_rn_numpy(x)
    inside = (x >= device_math.LO) & (x <= device_math.HI)
    exact = np.exp(x[inside].astype(np.float64))
    ulp = np.abs(want[inside].astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))
    assert ulp.max() <= 3.0, ulp.max()

    te = tvm.te
    xs = te.placeholder((len(x),), "float32", "x")
    ys = te.compute((len(x),), lambda i: device_math.exp_rn_tir(xs[i]), "y")
    lib = tvm.tirx.build(te.create_prim_func([xs, ys]), target="llvm")
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib(tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy().view(np.int32), want.view(np.int32))

    source = tmp_path / "exp_rn.cc"
    source.write_text(textwrap.dedent("""\
        #include <cmath>
        #include <cstring>
        #include <cstdio>
        #define CUTLASS_DEVICE static
        static float __fmul_rn(float a, float b) { return a * b; }
        static float __fadd_rn(float a, float b) { return a + b; }
        static float __fsub_rn(float a, float b) { return a - b; }
        static float __fdiv_rn(float a, float b) { return a / b; }
        static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
        """) + device_math.EXP_RN_CPP + textwrap.dedent("""\
        int main() {
          float x;
          while (std::fread(&x, 4, 1, stdin) == 1) { float y = exp_rn(x); std::fwrite(&y, 4, 1, stdout); }
        }
        """))
    binary = tmp_path / "exp_rn"
    subprocess.run(["g++", "-O2", "-ffp-contract=off", "-o", str(binary), str(source)], check=True)
    run = subprocess.run([str(binary)], input=x.tobytes(), capture_output=True, check=True)
    np.testing.assert_array_equal(np.frombuffer(run.stdout, np.int32), want.view(np.int32))


def _tie_kernel(**extra) -> cutlass.ConvKernel:
    problem = cutlass.Conv2dProblem(1, 4, 4, 16, 16, 1, 1, (0, 0), (1, 1), (1, 1))
    return cutlass.ConvKernel("ties", problem, None, "identity", False, "int8", out_div=0.5, **extra)


def _ties(kernel):
    """x, w, bias, scale, shift whose epilogue lands every output exactly on k + 1/2 (k from -6 to 5) before the
    rounding: an odd accumulator 2k + 1 (one input channel, a weight of 1), times scale 1/4, divided by out_div 1/2."""
    p = kernel.problem
    x = np.zeros((p.n, p.h, p.w, p.c), np.int8)
    x[..., 0] = (np.arange(p.h * p.w).reshape(p.h, p.w) % 12 - 6) * 2 + 1  # odd accumulators -11 ... 11
    w = np.zeros((p.k, 1, 1, p.c), np.int8)
    w[:, 0, 0, 0] = 1
    bias = np.zeros(p.k, np.int32)
    scale = np.full(p.k, 0.25, np.float32)  # (2k + 1) / 4 / (1/2) = k + 1/2
    shift = np.zeros(p.k, np.float32)
    return x, w, bias, scale, shift


def _half_to_even(v: np.ndarray) -> np.ndarray:
    """Round half to even, written out (not numpy's rint): floor, and up where the rest is over 1/2 or exactly 1/2
    with an odd floor."""
    f = np.floor(v)
    rest = v - f
    return (f + ((rest > 0.5) | ((rest == 0.5) & (f % 2 == 1)))).astype(np.float64)


def test_a_requantize_on_a_tie_rounds_half_to_even_in_the_twin_and_the_replay():
    """An int8 epilogue whose value is exactly k + 1/2 for k = -6 ... 5: the numpy replay and the host twin (TIR
    for this CPU, as the reference check runs it) both give the even neighbour, as the graph's ``relax.round``
    (``topi.round``: nearbyint) does; half away from zero would give the odd one on every element."""
    kernel = _tie_kernel()
    x, w, bias, scale, shift = _ties(kernel)
    exact = (x[..., :1].astype(np.float64) * 0.25 / 0.5).repeat(kernel.problem.k, -1)
    assert np.all(exact % 1 == 0.5)
    want = _half_to_even(exact).astype(np.int8)
    assert set(np.unique(want)) == {-6, -4, -2, 0, 2, 4, 6}  # what the ties -5.5 ... 5.5 round to
    replay = cutlass_replay.replay_int8(kernel, x, w, bias, scale, shift)
    np.testing.assert_array_equal(replay, want)

    lib = tvm.tirx.build(cutlass.twin_prim_func(kernel), target="llvm")
    args = []
    for name, shape, dtype in cutlass.kernel_operands(kernel):
        value = {"x": x, "w": w, "bias": bias, "scale": scale, "shift": shift,
                 "channel": np.arange(kernel.problem.k, dtype=np.float32)}.get(name)
        args.append(tvm.runtime.tensor(np.zeros(shape, dtype) if value is None else value.reshape(shape).astype(dtype)))
    lib(*args)
    np.testing.assert_array_equal(args[-1].numpy().reshape(want.shape), want)


def test_a_depthwise_kernels_cuda_source_rounds_ties_half_to_even(tmp_path):
    """edgeq's int8 depthwise kernel, its CUDA source for sm_87 (TVM's ``nearbyintf``) compiled by g++ for this CPU
    and run over its grid: a value exactly on k + 1/2 rounds to the even neighbour, as the replay and the graph."""
    from cuda_on_host import HostKernels

    from edgeq.toolchain import cuda_toolkits

    toolkit = next((tk for tk in cuda_toolkits() if tk.kind == "nvrtc"), None)
    if toolkit is None:
        pytest.skip("needs the NVRTC 12.6 wheels (pip install -e '.[test]')")
    problem = cutlass.Conv2dProblem(1, 4, 4, 16, 16, 3, 3, (1, 1), (1, 1), (1, 1), groups=16)
    kernel = cutlass.DepthwiseKernel("ties", problem, None, "identity", False, "int8", out_div=0.5)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    cutlass.build_module([kernel], target, toolkit, tmp_path)
    host = HostKernels((tmp_path / "cutlass_sm_87.cu").read_text(), [f"{kernel.function}_kernel"], tmp_path)
    arrays = {}
    for name, shape, dtype in cutlass.kernel_operands(kernel):
        arrays[name] = np.zeros(shape, dtype)
    arrays["x"][...] = (np.arange(arrays["x"].size).reshape(arrays["x"].shape) % 12 - 6) * 2 + 1
    arrays["w"][...] = 0
    arrays["w"].reshape(3, 3, 16)[1, 1, :] = 1  # the centre tap: acc = x
    arrays["scale"][...] = 0.25
    if "post" in arrays:
        arrays["post"][...] = 1
    host.run(f"{kernel.function}_kernel", kernel.grid[0], kernel.threads, arrays)
    x = arrays["x"].reshape(1, 4, 4, 16).astype(np.float64)
    want = _half_to_even(x * 0.25 / 0.5).astype(np.int8)
    np.testing.assert_array_equal(arrays["y"].reshape(want.shape), want)


def test_a_pooled_mean_on_a_tie_rounds_half_to_even():
    """A global average pool of 49 values whose mean is exactly k + 1/2, quantized with divisor 1 (the pool
    classifier's first step, its host twin): the even neighbour."""
    from edgeq.backends.cuda import pool_classifier

    c = 16
    fc = cutlass.ConvKernel("fc", cutlass.Conv2dProblem(1, 1, 1, c, 16, 1, 1), None, precision="int8", float_out=True)
    kernel = pool_classifier.PoolClassifierKernel("ties", (1, 7, 7, c), "float32", fc, {"y": (1, 16)},
                                                  (1.0, -128.0, 127.0), 1)
    halves = (np.arange(c) - 8 + 0.5).astype(np.float32)  # -7.5 ... 7.5: sums of 49 of them are exact
    x = np.broadcast_to(halves, (1, 7, 7, c)).astype(np.float32)
    lib = tvm.tirx.build(pool_classifier.twin_prim_func(kernel), target="llvm")
    args = [tvm.runtime.tensor(x)]
    for name, shape, dtype in cutlass.kernel_operands(fc, {}):  # the classifier's operands after the pooled x
        if name == "x":
            continue
        value = np.zeros(shape, dtype)
        if name == "w":  # the identity on the pooled features: logit k = pooled k
            value.reshape(16, c)[np.arange(16), np.arange(16)] = 1
        elif name == "scale":
            value[...] = 1
        elif name == "channel":
            value.reshape(-1)[:] = np.arange(value.size)
        elif name == "y":
            value = np.zeros((1, 16), dtype)
        args.append(tvm.runtime.tensor(value))
    lib(*args)
    want = _half_to_even(halves.astype(np.float64))
    np.testing.assert_array_equal(args[-1].numpy().reshape(-1), want.astype(np.float32))
    assert set(np.abs(want)) <= {0, 2, 4, 6, 8}


def _ptx(source: str, toolkit, math) -> str:
    from tvm.support import nvcc

    with toolkit.active(math), cutlass.nvrtc_include():
        return bytes(nvcc.compile_cuda(source, target_format="ptx", arch="sm_87")).decode()


APPROX = re.compile(r"\b(?:div|sqrt|rsqrt|ex2|lg2|sin|cos|rcp)\.approx|\.ftz\b|\bdiv\.full\b")


def test_edgeqs_device_code_compiles_without_fast_math(tmp_path):
    """A module of edgeq's int8 kernels (a CUTLASS convolution with SiLU and a residual, the depthwise kernel with
    SiLU, the layer norm with its per-token quantize): in its PTX no approximate division, square root or
    exponential, no flush to zero and no contracted FMA, so the device computes each float32 operator as the twin
    and the replay do. The same source under TVM's own options (``device_math.FAST``) has them, which is what
    this check would see if edgeq's options were lost."""
    from edgeq.backends.cuda import layer_norm
    from edgeq.toolchain import cuda_toolkits

    toolkit = next((tk for tk in cuda_toolkits() if tk.kind == "nvrtc"), None)
    if toolkit is None:
        pytest.skip("needs the NVRTC 12.6 wheels (pip install -e '.[test]')")
    problem = cutlass.Conv2dProblem(1, 8, 8, 32, 32, 1, 1, (0, 0), (1, 1), (1, 1))
    tile = cutlass.choose_tile(problem, 8, 166912, "int8")
    conv = cutlass.ConvKernel("conv", problem, tile, "identity", True, "int8", residual_scale=0.5, out_div=0.25,
                              silu=True)
    dw = cutlass.DepthwiseKernel("dw", cutlass.Conv2dProblem(1, 8, 8, 32, 32, 3, 3, (1, 1), (1, 1), (1, 1), groups=32),
                                 None, "identity", True, "int8", residual_scale=0.04, out_div=0.05, silu=True)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_87", "host": "llvm"})
    cutlass.build_module([conv, dw], target, toolkit, tmp_path)
    ln = layer_norm.LayerNormKernel("ln", (1, 7, 64), 1e-5, (1, 7, 64), 127.0)
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    with toolkit.active(), target:
        built = tvm.tirx.build(tvm.IRModule({ln.function: layer_norm.prim_func(ln)}), target=target)
    source = (tmp_path / "cutlass_sm_87.cu").read_text()
    assert "#include <edgeq_cutlass/epilogues.h>" in source  # the epilogues: a header NVRTC reads with -I
    headers = "".join(p.read_text() for p in sorted((cutlass.nvrtc.EDGEQ_INCLUDE / "edgeq_cutlass").glob("*.h")))
    code = re.sub(r"//[^\n]*", "", source + headers)
    assert "silu_rn(x)" in code and not re.search(r"\bexpf\(", code)  # no exponential but edgeq's
    for name, code in (("cutlass+depthwise", source), ("layer norm", built.imports[0].inspect_source())):
        exact = _ptx(code, toolkit, device_math.EXACT)
        assert not APPROX.findall(exact), (name, sorted(set(APPROX.findall(exact))))
        assert not re.search(r"\bfma\.rn\.f32\b", exact), name  # nothing contracted
        assert re.search(r"\bdiv\.rn\.f32\b", exact), name  # the quantize's division, IEEE
        fast = _ptx(code, toolkit, device_math.FAST)
        assert APPROX.findall(fast) and re.search(r"\bdiv\.approx\.ftz\.f32\b", fast), name

    # what a build compiles with: no contraction where the graph rounds floats to int8, FMAs kept where it does not
    # (fp32 and fp16: the more accurate, and a CUDA-core convolution's inner loop); nvcc mode cannot turn --fmad off
    from edgeq.toolchain import DeviceMath

    for precision, fmad in (("int8", False), ("mixed", False), ("fp16", True), ("fp32", True)):
        math = DeviceMath.for_build("nvrtc", precision)
        assert (math.fmad, math.ftz, math.prec_div, math.prec_sqrt, math.fast_math) == (fmad, False, True, True, False)
        assert math.nvrtc_options().endswith("-U__USE_FAST_MATH__") and f"--fmad={str(fmad).lower()}" in math.nvrtc_options()
    assert DeviceMath.for_build("nvcc", "int8").fmad is True
    assert device_math.EXACT.to_dict()["int8_exp"].startswith("exp_rn")
