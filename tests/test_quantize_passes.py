"""Before/Expected golden tests for each quantization pass (TVMScript, tvm.ir.assert_structural_equal)."""

import numpy as np

from edgeq.graph import Graph, call_op
from edgeq.quantize.fold_bias import fold_bias
from edgeq.quantize.quantize_ops import LayerPlan, quantize_ops, quantize_weight
from edgeq.quantize.requantize import requantize
from edgeq.tvm_env import import_tvm

tvm = import_tvm()
from tvm.script import ir as I  # noqa: E402
from tvm.script import relax as R  # noqa: E402

W = np.array([[1, 0.5], [-0.25, 0.125]], np.float32).reshape(2, 2, 1, 1)
S_X = 0.1
S_CONV = (np.float32(S_X) * np.array([1 / 127, 0.25 / 127], np.float32)).astype(np.float32)
S2 = 0.05  # the scale requantize tests quantize to


@I.ir_module
class CONV_1X1:  # the float model the conv2d passes start from
    @R.function
    def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((2, 2, 1, 1), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.nn.conv2d(x, w)
            R.output(y)
        return y


def test_quantize_weight_is_symmetric_per_channel():
    q, scale = quantize_weight(W, axis=0)
    np.testing.assert_array_equal(q.reshape(2, 2), [[127, 64], [-127, 64]])
    np.testing.assert_allclose(scale, [1 / 127, 0.25 / 127], rtol=1e-6)
    zero_channel = quantize_weight(np.zeros((3, 2), np.float32), axis=1)
    assert (zero_channel[0] == 0).all() and (zero_channel[1] == 1.0).all()


def test_quantize_ops_conv2d():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), w_int8: R.Tensor((2, 2, 1, 1), "int8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                xq = R.quantize(x, R.const(S_X, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                acc = R.nn.conv2d(xq, w_int8, out_dtype="int32")
                y = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                R.output(y)
            return y

    out = quantize_ops(Graph(CONV_1X1, {"w": W}), {"w": LayerPlan("int8", S_X)})
    tvm.ir.assert_structural_equal(out.mod, Expected)
    assert list(out.weights) == ["w_int8"] and out.weights["w_int8"].dtype == np.int8


def test_quantize_ops_gemm_stores_the_weight_transposed():
    fc = np.array([[2.0, -1.0, 0.5], [0.25, 0.5, -0.5]], np.float32)  # (N=2, K=3), Gemm transB=1

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3), "float32"), fc_w: R.Tensor((2, 3), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                wt = R.permute_dims(fc_w, axes=[1, 0])
                y = R.matmul(x, wt)
                R.output(y)
            return y

    s = (np.float32(S_X) * np.array([2 / 127, 0.5 / 127], np.float32)).astype(np.float32)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3), "float32"), fc_w_int8: R.Tensor((3, 2), "int8")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                xq = R.quantize(x, R.const(S_X, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                acc = R.matmul(xq, fc_w_int8, out_dtype="int32")
                y = R.dequantize(acc, R.const(s, "float32"), R.const(0, "int8"), axis=-1, out_dtype="float32")
                R.output(y)
            return y

    out = quantize_ops(Graph(Before, {"fc_w": fc}), {"fc_w": LayerPlan("int8", S_X)})
    tvm.ir.assert_structural_equal(out.mod, Expected)
    np.testing.assert_array_equal(out.weights["fc_w_int8"], [[127, 64], [-64, 127], [32, -127]])


def test_quantize_ops_fp32_plan_and_unplanned_layers_are_untouched():
    for plans in ({}, {"w": LayerPlan("fp32")}):
        out = quantize_ops(Graph(CONV_1X1, {"w": W}), plans)
        tvm.ir.assert_structural_equal(out.mod, CONV_1X1)


def test_fold_bias_adds_the_bias_in_int32():
    bias = np.array([0.5, -0.25], np.float32)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "int8"), w_int8: R.Tensor((2, 2, 1, 1), "int8"), b: R.Tensor((2,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                acc = R.nn.conv2d(x, w_int8, out_dtype="int32")
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                rb = R.reshape(b, R.shape([1, 2, 1, 1]))
                y = R.add(d, rb)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "int8"), w_int8: R.Tensor((2, 2, 1, 1), "int8"), b_int32: R.Tensor((2,), "int32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                acc = R.nn.conv2d(x, w_int8, out_dtype="int32")
                rb = R.reshape(b_int32, R.shape([1, 2, 1, 1]))
                acc2 = R.add(acc, rb)
                y = R.dequantize(acc2, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                R.output(y)
            return y

    w_int8 = np.ones((2, 2, 1, 1), np.int8)
    out = fold_bias(Graph(Before, {"w_int8": w_int8, "b": bias}))
    tvm.ir.assert_structural_equal(out.mod, Expected)
    np.testing.assert_array_equal(out.weights["b_int32"], np.round(bias / S_CONV).astype(np.int32))


def _requantized(lo: int, hi: int):
    """The accumulator requantized at S2 within [lo, hi]: ratio S_CONV / S2, round, clip, via int32."""
    ratio = (S_CONV / np.float32(S2)).astype(np.float32).reshape(1, 2, 1, 1)

    @I.ir_module
    class Expected:
        @R.function
        def main(acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                scaled = R.multiply(R.astype(acc, "float32"), R.const(ratio, "float32"))
                q = R.astype(R.astype(R.clip(R.round(scaled), lo, hi), "int32"), "int8")  # via int32: one vpmovdb
                R.output(q)
            return q

    return Expected


def test_requantize_removes_the_dequantize_quantize_pair():

    @I.ir_module
    class Before:
        @R.function
        def main(acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                r = R.nn.relu(d)
                q = R.quantize(r, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                R.output(q)
            return q

    out = requantize(Graph(Before, {}))
    tvm.ir.assert_structural_equal(out.mod, _requantized(0, 127))
    assert "relax.dequantize" not in out.mod.script() and "R.dequantize" not in out.mod.script()


def test_requantize_moves_a_relu6_to_the_integer_side():
    """ReLU6 between the layers (as ONNX Clip imports: maximum / minimum with constants; or relax.clip) becomes
    the integer clip bounds q(0) = 0 and q(6) = round(6 / 0.05) = 120, and the float tensor is gone."""

    @I.ir_module
    class MinMax:
        @R.function
        def main(acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                m = R.maximum(d, R.const(0.0, "float32"))
                n = R.minimum(m, R.const(6.0, "float32"))
                q = R.quantize(n, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                R.output(q)
            return q

    @I.ir_module
    class Clip:
        @R.function
        def main(acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                n = R.clip(d, -1.0, 6.0)
                q = R.quantize(n, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                R.output(q)
            return q

    tvm.ir.assert_structural_equal(requantize(Graph(MinMax, {})).mod, _requantized(0, 120))
    tvm.ir.assert_structural_equal(requantize(Graph(Clip, {})).mod, _requantized(-20, 120))

    # the same integers as the float path computes them, for every accumulator that lands on a bound or inside
    from edgeq.compile import HostRunner

    accs = [np.random.default_rng(i).integers(-2000, 12000, (1, 2, 4, 4)).astype(np.int32) for i in range(16)]
    before, after = HostRunner(Graph(MinMax, {})), HostRunner(requantize(Graph(MinMax, {})))
    ref = np.concatenate([before([a])[0].ravel() for a in accs]).astype(int)
    out = np.concatenate([after([a])[0].ravel() for a in accs]).astype(int)
    assert np.abs(ref - out).max() <= 1 and (ref == out).mean() > 0.95  # float32 x / s vs x * (s1 / s)
    assert out.min() == 0 and out.max() == 120 and ((out == 0) & (ref == 0)).any() and ((out == 120) & (ref == 120)).any()


@I.ir_module
class INCEPTION_TAIL:
    """Two branches concatenated; three readers (two layers and a pool branch) quantize it to one scale."""

    @R.function
    def main(a: R.Tensor((1, 2, 4, 4), "float32"), b: R.Tensor((1, 3, 4, 4), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            x = R.concat((a, b), axis=1)
            q1 = R.quantize(x, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
            q2 = R.quantize(x, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
            p = R.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1])
            q3 = R.quantize(p, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
            out = (q1, q2, q3)
            R.output(out)
        return out


def test_hoist_quantize_concatenates_and_pools_int8():
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 2, 4, 4), "float32"), b: R.Tensor((1, 3, 4, 4), "float32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                qa = R.quantize(a, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                qb = R.quantize(b, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                xq = R.concat((qa, qb), axis=1)
                p = R.nn.max_pool2d(xq, pool_size=[3, 3], padding=[1, 1, 1, 1])
                out = (xq, xq, p)
                R.output(out)
            return out

    from edgeq.compile import HostRunner
    from edgeq.quantize.hoist_quantize import hoist_quantize

    out = hoist_quantize(Graph(INCEPTION_TAIL, {}))
    tvm.ir.assert_structural_equal(out.mod, Expected)
    # exact: quantize commutes with moving values and with their maximum (the pool's padding included)
    rng = np.random.default_rng(0)
    inputs = [rng.normal(0, 3, (1, 2, 4, 4)).astype(np.float32), rng.normal(0, 3, (1, 3, 4, 4)).astype(np.float32)]
    for got, want in zip(HostRunner(out)(inputs), HostRunner(Graph(INCEPTION_TAIL, {}))(inputs)):
        np.testing.assert_array_equal(got, want)


def test_hoist_quantize_leaves_a_tensor_still_read_in_float_or_at_two_scales():
    from edgeq.quantize.hoist_quantize import hoist_quantize

    @I.ir_module
    class TwoScales:
        @R.function
        def main(a: R.Tensor((1, 2, 4, 4), "float32"), b: R.Tensor((1, 3, 4, 4), "float32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                x = R.concat((a, b), axis=1)
                q1 = R.quantize(x, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                p = R.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1])
                q3 = R.quantize(p, R.const(S_X, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                out = (q1, q3)
                R.output(out)
            return out

    @I.ir_module
    class FloatReader:
        @R.function
        def main(a: R.Tensor((1, 2, 4, 4), "float32"), b: R.Tensor((1, 3, 4, 4), "float32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                x = R.concat((a, b), axis=1)
                q1 = R.quantize(x, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                m = R.mean(x, axis=[2, 3])
                out = (q1, m)
                R.output(out)
            return out

    for before in (TwoScales, FloatReader):
        tvm.ir.assert_structural_equal(hoist_quantize(Graph(before, {})).mod, before)


def test_hoist_quantize_residual_add_reads_the_int8_copy():
    """A block's output read by the next layer (quantized) and by the residual add: the add reads the
    quantized copy, dequantized, so the float tensor has one reader left (the quantize, which ``requantize``
    then moves into the producing layer's epilogue)."""
    from edgeq.quantize.hoist_quantize import hoist_quantize

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                y = R.nn.relu(x)
                q = R.quantize(y, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                r = R.add(d, y)
                out = (q, r)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), acc: R.Tensor((1, 2, 4, 4), "int32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                y = R.nn.relu(x)
                q = R.quantize(y, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="int8")
                d = R.dequantize(acc, R.const(S_CONV, "float32"), R.const(0, "int8"), axis=1, out_dtype="float32")
                r = R.add(d, R.dequantize(q, R.const(S2, "float32"), R.const(0, "int8"), axis=-1, out_dtype="float32"))
                out = (q, r)
                R.output(out)
            return out

    out = hoist_quantize(Graph(Before, {}))
    tvm.ir.assert_structural_equal(out.mod, Expected)
    from edgeq.compile import HostRunner

    rng = np.random.default_rng(1)
    x, acc = rng.normal(0, 0.05, (1, 2, 4, 4)).astype(np.float32), rng.integers(-3000, 3000, (1, 2, 4, 4)).astype(np.int32)
    (q0, r0), (q1, r1) = HostRunner(Graph(Before, {}))([x, acc]), HostRunner(out)([x, acc])
    np.testing.assert_array_equal(q0, q1)
    assert np.abs(r1 - r0).max() <= S2 / 2 * 1.0001  # the residual now carries its int8 rounding, no more


def test_hoist_quantize_sees_through_a_split_and_a_concatenations_part():
    """C2f's pattern: a tensor split in halves, the second half read by a layer (quantized), a residual add and,
    with the first half and the sum, a concatenation quantized at the same scale. Each is quantized once where it is
    made: the split runs on int8 and the concatenation takes the int8 halves and the int8 sum; the quantized values
    are the graph's bit for bit (quantize commutes with moving values), the sum carries the half's rounding."""
    from edgeq.compile import HostRunner
    from edgeq.quantize.hoist_quantize import hoist_quantize

    q = dict(axis=-1, out_dtype="int8")

    @I.ir_module
    class Before:
        @R.function
        def main(y: R.Tensor((1, 4, 4, 4), "float32"), b: R.Tensor((1, 2, 4, 4), "float32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                z = R.nn.relu(y)
                halves = R.split(z, indices_or_sections=2, axis=1)
                y0 = halves[0]
                y1 = halves[1]
                q1 = R.quantize(y1, R.const(S2, "float32"), R.const(0, "int8"), **q)
                r = R.nn.relu(b)  # (a computed tensor: the bottleneck's output)
                p = R.add(y1, r)
                cat = R.concat((y0, y1, p), axis=1)
                qc = R.quantize(cat, R.const(S2, "float32"), R.const(0, "int8"), **q)
                out = (q1, qc)
                R.output(out)
            return out

    out = hoist_quantize(Graph(Before, {}))
    bindings = out.main.body.blocks[0].bindings
    quantized = [b.value.args[0] for b in bindings if call_op(b.value) == "relax.quantize"]
    names = {b.var: b.value for b in bindings}
    # quantized: z (before the split) and the sum p, nothing else
    assert len(quantized) == 2 and [call_op(names[v]) for v in quantized] == ["relax.nn.relu", "relax.add"]
    split = next(b.value for b in bindings if call_op(b.value) == "relax.split")
    concat = next(b.value for b in bindings if call_op(b.value) == "relax.concat")
    assert "int8" in str(split.args[0].ty) and all("int8" in str(f.ty) for f in concat.args[0].fields)
    rng = np.random.default_rng(2)
    inputs = [rng.normal(0, 3, (1, 4, 4, 4)).astype(np.float32), rng.normal(0, 3, (1, 2, 4, 4)).astype(np.float32)]
    (q1a, qca), (q1b, qcb) = HostRunner(Graph(Before, {}))(inputs), HostRunner(out)(inputs)
    np.testing.assert_array_equal(q1a, q1b)
    np.testing.assert_array_equal(qca[:, :4], qcb[:, :4])  # the halves: exact
    assert np.abs(qca[:, 4:].astype(int) - qcb[:, 4:]).max() <= 1  # the sum: its half's rounding, one step at most

