"""edgeq's own ONNX converters (``edgeq.onnx_ops``) against ONNX Runtime.

One model holds one node of every converter (each result a graph output), so a single host bundle is
built; each op's output is then compared with ONNX Runtime on its own. Refusals are checked at import.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from conftest import run_cli
from edgeq.errors import ModelError
from edgeq.load import load_model
from edgeq.relax_import import to_relax
from edgeq.reference import onnxruntime_session

OPSET = 27
F = T.FLOAT


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    values = {
        "x": rng.standard_normal((2, 3, 4, 5)),
        "m": rng.standard_normal((3, 4, 4)),
        "cols": rng.standard_normal((1, 8, 9)),
        "img": rng.standard_normal((5, 6, 3)),
        "seq": rng.standard_normal((4, 3)),
        "cache": rng.standard_normal((2, 1, 6, 4)),
        "upd": rng.standard_normal((2, 1, 2, 4)),
        "q": rng.standard_normal((2, 4, 3, 8)),
        "k": rng.standard_normal((2, 2, 5, 8)),
        "v": rng.standard_normal((2, 2, 5, 8)),
        "emb": rng.standard_normal((2, 3, 16)),
        "rnn_x": rng.standard_normal((5, 2, 3)),
        "pad_value": np.array(2.5),
        "hot_values": np.array([-1.0, 3.0]),
    }
    out = {k: v.astype(np.float32) for k, v in values.items()}
    for name, shape in (("sig", (2, 8, 1)), ("spec", (2, 6, 2)), ("cc_x", (2, 4, 8)), ("cc_state", (2, 4, 2)),
                        ("la_q", (2, 3, 16)), ("la_k", (2, 3, 8)), ("la_v", (2, 3, 8)), ("la_state", (2, 2, 4, 4)),
                        ("la_decay", (2, 3, 2)), ("la_beta", (2, 3, 2))):
        out[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    out["hot_idx"] = np.array([[0, 2, -1], [1, 4, 3]], np.int64)
    out["g_idx"] = np.array([[0, -1], [2, 1]], np.int64)
    out["ge_idx"] = np.array([[3, -1, 0], [1, 2, -4]], np.int64)
    out["se_idx"] = np.array([[1, 3, 0]], np.int64)
    out["se_upd"] = rng.standard_normal((1, 3)).astype(np.float32)
    out["qx"] = rng.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8)
    out["qa"] = rng.integers(-128, 128, (2, 5)).astype(np.int8)
    out["logits"] = rng.standard_normal((4, 8, 3)).astype(np.float32)  # 8 classes: the golden labels are 0..7
    out["labels"] = rng.integers(0, 8, (4, 3)).astype(np.int64)
    out["lens"] = np.array([3, 1, 4], np.int64)
    out["flags"] = np.array([[True, False, True], [False, False, False], [True, True, True], [False, True, False]])
    return out


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [
        nh.from_array(np.array(2, np.int64), "axis2"),
        nh.from_array(np.array(10, np.int64), "n10"),
        nh.from_array(np.array(7, np.int64), "n7"),
        nh.from_array(np.array([4, 4], np.int64), "image_shape"),
        nh.from_array(np.array([2, 2], np.int64), "block_shape"),
        nh.from_array(np.array([3, 8, 3], np.int64), "crop_shape"),
        nh.from_array(np.array([1, 0], np.int64), "write_idx"),
        nh.from_array(rng.standard_normal((4, 5)).astype(np.float32), "norm_scale"),
        nh.from_array(rng.standard_normal((4, 5)).astype(np.float32), "norm_bias"),
        nh.from_array(rng.standard_normal((5,)).astype(np.float32), "rms_scale"),
        nh.from_array(rng.standard_normal((10, 4)).astype(np.float32), "cos"),
        nh.from_array(rng.standard_normal((10, 4)).astype(np.float32), "sin"),
        nh.from_array(np.array([[0, 1, 2], [3, 4, 5]], np.int64), "pos"),
        nh.from_array(np.array([3, 1, 1, 1, 5], np.int64), "expand_shape"),
        nh.from_array(np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64), "pads"),
        nh.from_array(np.array(5, np.int64), "depth"),
        nh.from_array(np.array([1], np.int64), "flag_axes"),
        nh.from_array(rng.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8), "qw"),
        nh.from_array(np.array(0.02, np.float32), "qx_s"), nh.from_array(np.array(128, np.uint8), "qx_zp"),
        nh.from_array(rng.uniform(0.001, 0.01, 4).astype(np.float32), "qw_s"),
        nh.from_array(np.zeros(4, np.int8), "qw_zp"),
        nh.from_array(np.array(0.5, np.float32), "qy_s"), nh.from_array(np.array(100, np.uint8), "qy_zp"),
        nh.from_array(rng.integers(-500, 500, 4).astype(np.int32), "qb"),
        nh.from_array(rng.integers(-128, 128, (5, 3)).astype(np.int8), "qmb"),
        nh.from_array(np.array(0.03, np.float32), "qa_s"), nh.from_array(np.array(-3, np.int8), "qa_zp"),
        nh.from_array(np.array([0.01, 0.02, 0.04], np.float32), "qmb_s"), nh.from_array(np.zeros(3, np.int8), "qmb_zp"),
        nh.from_array(np.array(2.0, np.float32), "qm_s"), nh.from_array(np.array(5, np.int8), "qm_zp"),
        nh.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "class_w"),
        nh.from_array(np.array(8, np.int32), "mel_bins"), nh.from_array(np.array(16, np.int32), "dft_len"),
        nh.from_array(np.array(8000, np.int32), "rate"), nh.from_array(np.array(100.0, np.float32), "f_lo"),
        nh.from_array(np.array(3000.0, np.float32), "f_hi"),
        nh.from_array(np.array(1, np.int64), "dft_axis"),
        nh.from_array(rng.standard_normal((4, 1, 3)).astype(np.float32), "cc_w"),
        nh.from_array(rng.standard_normal(4).astype(np.float32), "cc_b"),
    ]
    for name, gates, hidden, dirs in (("rnn", 1, 4, 2), ("gru", 3, 4, 2), ("lstm", 4, 4, 2)):
        inits += [
            nh.from_array((0.5 * rng.standard_normal((dirs, gates * hidden, 3))).astype(np.float32), f"{name}_w"),
            nh.from_array((0.5 * rng.standard_normal((dirs, gates * hidden, hidden))).astype(np.float32), f"{name}_r"),
            nh.from_array((0.5 * rng.standard_normal((dirs, 2 * gates * hidden))).astype(np.float32), f"{name}_b"),
            nh.from_array((0.5 * rng.standard_normal((dirs, 2, hidden))).astype(np.float32), f"{name}_h0"),
        ]
    inits.append(nh.from_array((0.5 * rng.standard_normal((1, 12))).astype(np.float32), "lstm_p"))
    inits.append(nh.from_array((0.5 * rng.standard_normal((1, 2, 4))).astype(np.float32), "lstm_c0"))
    n = h.make_node
    nodes = [
        n("Swish", ["x"], ["swish"], alpha=0.7),
        n("Celu", ["x"], ["celu"], alpha=2.0),
        n("Mish", ["x"], ["mish"]),
        n("LpNormalization", ["x"], ["l2norm"], axis=1, p=2),
        n("LpNormalization", ["x"], ["l1norm"], axis=-1, p=1),
        n("CumProd", ["x", "axis2"], ["cumprod"], exclusive=1, reverse=1),
        n("HannWindow", ["n10"], ["hann"]),
        n("HammingWindow", ["n7"], ["hamming"], periodic=0),
        n("BlackmanWindow", ["n10"], ["blackman"], output_datatype=T.DOUBLE),
        n("Det", ["m"], ["det"]),
        n("Col2Im", ["cols", "image_shape", "block_shape"], ["col2im"], strides=[1, 1], pads=[0, 0, 0, 0]),
        n("LayerNormalization", ["x", "norm_scale", "norm_bias"], ["ln", "ln_mean", "ln_inv"], axis=2),
        n("RMSNormalization", ["x", "rms_scale"], ["rms"], axis=-1, epsilon=1e-3),
        n("CenterCropPad", ["img", "crop_shape"], ["crop"]),
        n("ReverseSequence", ["seq", "lens"], ["reversed"], batch_axis=1, time_axis=0),
        n("TensorScatter", ["cache", "upd", "write_idx"], ["scattered"], mode="circular"),
        n("RotaryEmbedding", ["emb", "cos", "sin", "pos"], ["rotary"], num_heads=2, interleaved=1),
        n("Attention", ["q", "k", "v"], ["attn"], is_causal=1),
        n("BitCast", ["x"], ["bits"], to=T.INT32),
        n("Expand", ["x", "expand_shape"], ["expanded"]),
        n("Gather", ["x", "g_idx"], ["gathered"], axis=1),
        n("GatherElements", ["seq", "ge_idx"], ["gathered_el"], axis=0),
        n("ScatterElements", ["seq", "se_idx", "se_upd"], ["scattered_el"], axis=0, reduction="add"),
        n("OneHot", ["hot_idx", "depth", "hot_values"], ["onehot"], axis=1),
        n("Pad", ["x", "pads", "pad_value"], ["padded"]),
        n("Einsum", ["k", "v"], ["einsum_product"], equation="bhid,bhjd->bhij"),  # a matmul (MaxViT's attention)
        n("Einsum", ["m"], ["einsum_diagonal"], equation="bii->bi"),  # not a product: Relax's einsum
        n("ReduceMax", ["flags", "flag_axes"], ["any_flag"], keepdims=0),  # bool: any
        n("ReduceMin", ["flags", "flag_axes"], ["all_flags"], keepdims=1),  # bool: all
        n("QLinearConv", ["qx", "qx_s", "qx_zp", "qw", "qw_s", "qw_zp", "qy_s", "qy_zp", "qb"], ["qconv"],
          pads=[1, 1, 1, 1], strides=[2, 2]),
        n("ConvInteger", ["qx", "qw", "qx_zp"], ["convint"], pads=[0, 1, 0, 1]),
        n("QLinearMatMul", ["qa", "qa_s", "qa_zp", "qmb", "qmb_s", "qmb_zp", "qm_s", "qm_zp"], ["qmatmul"]),
        n("NegativeLogLikelihoodLoss", ["logits", "labels", "class_w"], ["nll"], ignore_index=2),
        n("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["sce", "sce_log_prob"], reduction="sum"),
        n("MelWeightMatrix", ["mel_bins", "dft_len", "rate", "f_lo", "f_hi"], ["mel"]),
        n("DFT", ["sig", "", "dft_axis"], ["rfft"], onesided=1),
        n("DFT", ["spec", "", "dft_axis"], ["ifft"], inverse=1),
        n("CausalConvWithState", ["cc_x", "cc_w", "cc_b", "cc_state"], ["cc_y", "cc_next"], activation="silu"),
        n("LinearAttention", ["la_q", "la_k", "la_v", "la_state", "la_decay", "la_beta"], ["la_y", "la_next"],
          q_num_heads=4, kv_num_heads=2, update_rule="gated_delta"),
        n("RNN", ["rnn_x", "rnn_w", "rnn_r", "rnn_b", "", "rnn_h0"], ["rnn_y", "rnn_h"], hidden_size=4,
          direction="bidirectional"),
        n("GRU", ["rnn_x", "gru_w", "gru_r", "gru_b", "", "gru_h0"], ["gru_y", "gru_h"], hidden_size=4,
          direction="bidirectional", linear_before_reset=1),
        n("LSTM", ["rnn_x", "lstm_w", "lstm_r", "lstm_b"], ["lstm_y", "lstm_h", "lstm_c"], hidden_size=4,
          direction="bidirectional"),
    ]
    # a reverse LSTM with peepholes and an initial cell state, one direction
    arrays = {t.name: nh.to_array(t) for t in inits}
    inits += [nh.from_array(np.ascontiguousarray(arrays[f"lstm_{k}"][:1]), f"lstm1_{k}") for k in ("w", "r", "b")]
    nodes.append(n("LSTM", ["rnn_x", "lstm1_w", "lstm1_r", "lstm1_b", "", "", "lstm_c0", "lstm_p"], ["", "lstm1_h"],
                   hidden_size=4, direction="reverse"))
    inputs = _inputs()
    graph_inputs = [h.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for k, v in inputs.items()]
    outputs = [h.make_tensor_value_info(o, T.UNDEFINED, None) for node in nodes for o in node.output if o]
    graph = h.make_graph(nodes, "edgeq_ops", graph_inputs, outputs, initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # the outputs' types
    onnx.checker.check_model(model, full_check=True)
    return model


OUTPUTS = ["swish", "celu", "mish", "l2norm", "l1norm", "cumprod", "hann", "hamming", "blackman", "det", "col2im",
           "ln", "ln_mean", "ln_inv", "rms", "crop", "reversed", "scattered", "rotary", "attn", "bits", "expanded",
           "gathered", "gathered_el", "scattered_el",
           "onehot", "padded", "einsum_product", "einsum_diagonal", "qconv", "convint", "qmatmul", "nll", "sce", "sce_log_prob", "mel", "rfft", "ifft",
           "cc_y", "cc_next", "la_y", "la_next", "rnn_y", "rnn_h", "gru_y", "gru_h", "lstm_y", "lstm_h", "lstm_c", "lstm1_h"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{output: (edgeq's, ONNX Runtime's)}: the model packaged for host and run by the bundle's run.py."""
    import sys

    tmp = tmp_path_factory.mktemp("onnx-ops")
    model = _model()
    path = tmp / "ops.onnx"
    onnx.save(model, path)
    res = run_cli("package", path, "--device", "host", "-o", tmp / "out", "--runtime", "none", "--json")
    assert res.code == 0, res.stderr
    import json

    bundle = json.loads(res.stdout)["bundle_dir"]
    sys.path.insert(0, bundle)
    try:
        import run

        got = run.Model().run(_inputs())
    finally:
        sys.path.remove(bundle)
        sys.modules.pop("run", None)
    want = _onnxruntime(model, _inputs())
    return {name: (got[name], want[name]) for name in OUTPUTS}


def _onnxruntime(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every node run alone by ONNX Runtime, at the opset that introduced its version (ONNX Runtime
    implements some function ops, Swish among them, only by expanding the function of that opset)."""
    inits = {t.name: t for t in model.graph.initializer}
    values = {**inputs, **{k: nh.to_array(t) for k, t in inits.items()}}
    types = {v.name: v for v in model.graph.output}
    out = {}
    for node in model.graph.node:
        used = [name for name in node.input if name]
        graph = h.make_graph(
            [node], node.op_type,
            [h.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(values[k].dtype), values[k].shape) for k in used],
            [types[o] for o in node.output if o])
        opset = onnx.defs.get_schema(node.op_type, OPSET).since_version
        single = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
        session = onnxruntime_session(single.SerializeToString())
        names = [o.name for o in session.get_outputs()]
        out.update(zip(names, session.run(names, {k: values[k] for k in used})))
    return out


def test_every_op_is_in_the_model():
    from edgeq.onnx_ops import CONVERTERS

    ops = {node.op_type for node in _model().graph.node}
    left_out = {"SwiGLU", "Upsample", "NonMaxSuppression", "NonZero", "Unique", "Compress", "SplitToSequence",
                "Scatter", "QGemm"}
    # those: tests/test_node_tests.py, refusals below, or (QGemm, a com.microsoft op) tests/test_qdq.py
    assert set(CONVERTERS) - left_out <= ops


@pytest.mark.parametrize("output", OUTPUTS)
def test_matches_onnxruntime(results, output):
    got, want = results[output]
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def _one_node(tmp_path, node, inputs, outputs, opset=OPSET):
    graph = h.make_graph([node], "one", [h.make_tensor_value_info(k, F, s) for k, s in inputs],
                         [h.make_tensor_value_info(k, t, s) for k, t, s in outputs])
    path = tmp_path / f"{node.op_type}.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", opset)]), path)
    return path


def _refusal(path) -> str:
    with pytest.raises(ModelError) as info:
        to_relax(load_model(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_data_dependent_output_is_refused_naming_the_op(tmp_path):
    message = _refusal(_one_node(tmp_path, h.make_node("NonZero", ["x"], ["y"]), [("x", [3, 4])], [("y", T.INT64, [2, "n"])]))
    assert "NonZero" in message and "static" in message


def test_runtime_axis_is_refused_with_what_to_do(tmp_path):
    node = h.make_node("CumProd", ["x", "axis"], ["y"])
    graph = h.make_graph([node], "one", [h.make_tensor_value_info("x", F, [3, 4]), h.make_tensor_value_info("axis", T.INT64, [])],
                         [h.make_tensor_value_info("y", F, [3, 4])])
    path = tmp_path / "cumprod.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)]), path)
    message = _refusal(path)
    assert "CumProd" in message and "--const" in message


def test_tvm_failure_names_the_node(tmp_path):
    node = h.make_node("Attention", ["q", "k", "v"], ["y"], name="attn0", left_window_size=2)  # sliding window
    qkv = [("q", [1, 2, 3, 4]), ("k", [1, 2, 3, 4]), ("v", [1, 2, 3, 4])]
    message = _refusal(_one_node(tmp_path, node, qkv, [("y", F, [1, 2, 3, 4])]))
    assert "Attention node 'attn0'" in message


def test_out_of_range_indices_are_clamped(tmp_path):
    """ONNX calls them an error; the bundle must not read outside the tensor: they land on the last element."""
    from edgeq.compile import HostRunner

    node = h.make_node("GatherElements", ["x", "i"], ["y"], axis=1)
    graph = h.make_graph([node], "one", [h.make_tensor_value_info("x", F, [2, 3]), h.make_tensor_value_info("i", T.INT64, [2, 2])],
                         [h.make_tensor_value_info("y", F, [2, 2])])
    path = tmp_path / "gather.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)]), path)
    graph, _ = to_relax(load_model(path))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = HostRunner(graph)([x, np.array([[1, 1000], [-1, -1000]], np.int64)])
    np.testing.assert_array_equal(y, [[1, 2], [5, 3]])


def test_converters_are_installed_only_during_an_import(tmp_path):
    from tvm.relax.frontend.onnx import onnx_frontend

    before = onnx_frontend._get_convert_map
    to_relax(load_model(_one_node(tmp_path, h.make_node("Swish", ["x"], ["y"]), [("x", [2, 3])], [("y", F, [2, 3])])))
    assert onnx_frontend._get_convert_map is before
    assert "Swish" not in onnx_frontend._get_convert_map()
