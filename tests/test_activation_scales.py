"""int8 input scales beyond one calibrated scale per tensor (``--activation-scales auto``, the default):

- a MatMul/Gemm over a sequence quantizes each row (token) on its own scale at run time: a few tokens carrying
  activations fifty times the rest (BERT's [CLS]/[SEP], the outlier tokens of trained transformers) no longer
  leave the others a handful of levels (all-MiniLM-L6-v2: mean cosine 0.977 -> 0.998, benchmarks/trained.py);
- a depthwise convolution reads its input per channel: each channel's range moves into its own weights
  (PP-OCRv5's recognizer: 31 -> 51 of 64 lines as fp32 reads them).

Each is judged against the float graph on data it was not calibrated on, and against ``--activation-scales
per-tensor`` (the scheme before), which must do clearly worse on the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import predict_with_loader, run_cli
from edgeq.compile import HostRunner
from edgeq.load import load_model
from edgeq.quantize import QuantizeArgs, quantize
from edgeq.quantize import smooth
from edgeq.quantize.export_qdq import qdq_model
from edgeq.quantize.layers import find_layers
from edgeq.relax_import import to_relax
from edgeq.reference import onnxruntime_session


def _save(path: Path, nodes, inputs, outputs, inits) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    path.write_bytes(model.SerializeToString())
    return path


def _sequence_model(path: Path, tokens: int = 12, dim: int = 32) -> Path:
    """input [1, T, D] -> MatMul -> Relu -> MatMul -> output: two linear layers over a token sequence."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((dim, 2 * dim)) / dim ** 0.5).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((2 * dim, dim)) / (2 * dim) ** 0.5).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["input", "w1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["output"], name="fc2")]
    return _save(path, nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, tokens, dim])],
                 [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, tokens, dim])], inits)


def _tokens(n: int, seed: int, tokens: int = 12, dim: int = 32) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, tokens, dim)).astype(np.float32)
    x[:, 0] *= 50  # the first token of every sequence carries outliers, as trained transformers' do
    return x


def _depthwise_model(path: Path, channels: int = 16) -> Path:
    """The front of a PP-LCNet / MobileNetV3 block: a 1x1 expansion whose channels differ 100x in range,
    HardSwish, a 3x3 depthwise convolution."""
    rng = np.random.default_rng(4)
    ranges = np.logspace(-2, 0, channels, dtype=np.float32)[:, None, None, None]
    inits = [numpy_helper.from_array(rng.standard_normal((channels, 8, 1, 1)).astype(np.float32) * ranges, "expand"),
             numpy_helper.from_array((rng.standard_normal((channels, 1, 3, 3)) / 3).astype(np.float32), "dw")]
    nodes = [helper.make_node("Conv", ["input", "expand"], ["e"], name="expand"),
             helper.make_node("HardSwish", ["e"], ["a"]),
             helper.make_node("Conv", ["a", "dw"], ["output"], name="depthwise", group=channels, pads=[1, 1, 1, 1])]
    return _save(path, nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 8, 16, 16])],
                 [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, channels, 16, 16])], inits)


def _outputs(model: Path, calib: Path, held: np.ndarray, scales: str) -> tuple[np.ndarray, np.ndarray, list]:
    """(the float graph's outputs on ``held``, the quantized graph's, its layers)."""
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    result = quantize(graph, loaded, QuantizeArgs(calibrate=calib, activation_scales=scales))
    ref, got = HostRunner(graph), HostRunner(result.graph)
    return (np.stack([ref([x[None]])[0][0] for x in held]), np.stack([got([x[None]])[0][0] for x in held]),
            result.layers)


def _rel(q: np.ndarray, f: np.ndarray) -> float:
    return float(np.linalg.norm(q - f) / np.linalg.norm(f))


def test_sequence_matmuls_quantize_each_token_on_its_own_scale(tmp_path):
    model = _sequence_model(tmp_path / "sequence.onnx")
    np.savez(tmp_path / "calib.npz", input=_tokens(16, 0))
    held = _tokens(8, 1)
    f, q, layers = _outputs(model, tmp_path / "calib.npz", held, "auto")
    _, p, plain_layers = _outputs(model, tmp_path / "calib.npz", held, "per-tensor")
    assert [l.activation for l in layers] == ["per-token", "per-token"]
    assert [l.activation for l in plain_layers] == ["per-tensor", "per-tensor"]
    # the ordinary tokens: one scale sized for the outlier token leaves them a few levels
    auto, plain = _rel(q[:, 1:], f[:, 1:]), _rel(p[:, 1:], f[:, 1:])
    assert auto < 0.02 and auto < plain / 4, (auto, plain)
    assert _rel(q[:, :1], f[:, :1]) < 0.02


def test_attention_context_keeps_one_calibrated_scale(tmp_path):
    """In a BERT-style layer the output projection reads attention's context (softmax(Q K^T) V, its heads merged): one
    calibrated scale (measured on all-MiniLM-L6-v2: no loss against per-token, RESULTS.md), while Q, K, V and the FFN's
    two layers read their sequences per token. The quantized graph then holds one quantize with a constant scale
    before the projection, and stays close to the float graph."""
    from gpu_kernels import bert_encoder

    from edgeq.graph import call_op

    model = bert_encoder(tmp_path / "bert.onnx", seq=16, hidden=64, heads=2, layers=1)
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    layers = find_layers(graph, loaded.onnx_model)
    assert [l.activation for l in layers] == ["per-token"] * 3 + ["per-tensor"] + ["per-token"] * 2
    x = np.random.default_rng(0).standard_normal((12, 1, 16, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", input=x[:8])
    result = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz"))
    assert [l.activation for l in result.layers] == [l.activation for l in layers]
    # one run-time row scale per per-token input read (Q K V share theirs): the input's, the FFN's two; none for the
    # context
    scales = [b for b in result.graph.bindings() if call_op(b.value) == "relax.max"]
    assert len(scales) == 3, [str(b.value)[:80] for b in scales]
    ref, got = HostRunner(graph), HostRunner(result.graph)
    for sample in x[8:]:
        assert _rel(got([sample])[0], ref([sample])[0]) < 0.05


def test_the_orins_cutlass_build_runs_the_ffns_second_layer_in_fp16(tmp_path):
    """The backend's say on the int8 layers (``layer_precisions``): on CUTLASS a per-token layer whose input another
    layer makes (``quantize.layers.epilogue_inputs``: the FFN's second layer, through its bias and the exporter's erf
    GELU) is fp16, with its reason; Q, K, V (a layer norm's output), the first layer (the model's input) and the
    output projection (attention's context) are not; dlight and the CPU keep every layer int8. The fp16 layer's
    product is fp16 x fp16 with a float32 result (no rounding to fp16 before its bias), and the graph stays as close
    to float as the all-int8 one."""
    from gpu_kernels import bert_encoder

    from edgeq.backends import for_profile
    from edgeq.graph import call_op
    from edgeq.quantize.layers import epilogue_inputs
    from edgeq.targets import resolve

    model = bert_encoder(tmp_path / "bert.onnx", seq=16, hidden=64, heads=2, layers=2)
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    layers = find_layers(graph, loaded.onnx_model)
    second = [layers[5].weight, layers[11].weight]  # per layer: Q, K, V, the projection, FFN 1, FFN 2
    assert [l.weight for l in epilogue_inputs(graph, layers)] == second
    orin = resolve("jetson-orin-nano")[0]
    cutlass = for_profile(orin).with_gpu_kernels("cutlass", orin, "int8")
    assert set(cutlass.layer_precisions(graph, layers)) == set(second)
    assert for_profile(orin).layer_precisions(graph, layers) == {}
    assert for_profile(resolve("host")[0]).layer_precisions(graph, layers) == {}
    x = np.random.default_rng(0).standard_normal((12, 1, 16, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", input=x[:8])
    result = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz"),
                      target_precisions=cutlass.layer_precisions)
    fp16 = [l for l in result.layers if l.precision == "fp16"]
    assert [l.weight for l in fp16] == second and all(l.reason.startswith("CUTLASS") for l in fp16)
    assert result.report.precision_counts == {"int8": 10, "fp16": 2, "fp32": 0}
    products = [b for b in result.graph.bindings() if call_op(b.value) == "relax.matmul"
                and b.value.args[0].ty.dtype == "float16"]
    assert len(products) == 2 and all(b.value.ty.dtype == "float32" for b in products)
    all_int8 = quantize(graph, loaded, QuantizeArgs(calibrate=tmp_path / "calib.npz"))
    ref, got, plain = HostRunner(graph), HostRunner(result.graph), HostRunner(all_int8.graph)
    for sample in x[8:]:
        want = ref([sample])[0]
        assert _rel(got([sample])[0], want) <= _rel(plain([sample])[0], want) * 1.1 + 1e-3


def test_per_token_layers_are_not_histogrammed(tmp_path):
    """A per-token layer's calibrated threshold is never used (its scales come at run time): calibration
    records its range for the report but spends no histogram pass on it; a per-tensor layer still gets one."""
    from edgeq.quantize.calibrate import Taps, collect

    loaded = load_model(_sequence_model(tmp_path / "sequence.onnx"))
    graph, _ = to_relax(loaded)
    layers = find_layers(graph, loaded.onnx_model)
    layers[1].activation = "per-tensor"
    x = _tokens(4, 0)
    stats = collect(Taps(graph, layers), layers, lambda: ([x[i:i + 1]] for i in range(len(x))), histograms=True)
    assert [l.activation for l in layers] == ["per-token", "per-tensor"]
    assert stats[0].hist is None and stats[0].absmax == float(np.abs(x).max())
    assert stats[1].hist is not None and stats[1].hist.sum() == stats[1].count


def test_per_token_layers_stay_float_in_a_qdq_export(tmp_path):
    model = _sequence_model(tmp_path / "sequence.onnx")
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    layers = find_layers(graph, loaded.onnx_model)
    assert {l.activation for l in layers} == {"per-token"}
    out = qdq_model(loaded.onnx_model, layers, {})
    assert not [n for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]


def test_depthwise_reads_its_input_per_channel(tmp_path):
    model = _depthwise_model(tmp_path / "block.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((16, 8, 16, 16)).astype(np.float32))
    held = np.random.default_rng(1).standard_normal((6, 8, 16, 16)).astype(np.float32)
    f, q, layers = _outputs(model, tmp_path / "calib.npz", held, "auto")
    _, p, _ = _outputs(model, tmp_path / "calib.npz", held, "per-tensor")
    # each output channel on its own scale (the next layer weighs the narrow channels as much as the wide ones)
    auto = max(_rel(q[:, c], f[:, c]) for c in range(f.shape[1]))
    plain = max(_rel(p[:, c], f[:, c]) for c in range(f.shape[1]))
    assert [l.activation for l in layers] == ["per-tensor", "per-channel"]
    assert auto < 0.05 and auto < plain / 4, (auto, plain)
    # the move itself changes nothing in float
    loaded = load_model(model)
    graph, _ = to_relax(loaded)
    layers = find_layers(graph, loaded.onnx_model)
    s = smooth.factors(graph, layers, lambda: iter([[x[None]] for x in held[:2]]))
    assert list(s) == ["dw"] and s["dw"].shape == (16,) and s["dw"].max() / s["dw"].min() > 20
    moved = smooth.smooth(graph, layers, s)
    for x in held[2:]:
        a, b = HostRunner(graph)([x[None]])[0], HostRunner(moved)([x[None]])[0]
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_depthwise_per_channel_exports_as_qdq_that_onnxruntime_runs_as_the_bundle(tmp_path):
    model = _depthwise_model(tmp_path / "block.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((16, 8, 16, 16)).astype(np.float32))
    qdq = tmp_path / "block.qdq.onnx"
    res = run_cli("package", model, "--device", "host", "--precision", "int8", "--calibrate", tmp_path / "calib.npz",
                  "-o", tmp_path / "out", "--export-qdq", qdq, "-q")
    assert res.code == 0, res.stderr
    bundle = next(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    exported = onnx.load(qdq)
    onnx.checker.check_model(exported, full_check=True)
    muls = [n for n in exported.graph.node if n.op_type == "Mul"]
    assert len(muls) == 1 and "channel" in "".join(np.load(bundle / "quant_params.npz").files)
    x = np.random.default_rng(2).standard_normal((1, 8, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "x.npz", input=x)
    ours = predict_with_loader(bundle, tmp_path / "x.npz", tmp_path / "ours.npy")
    theirs = onnxruntime_session(str(qdq)).run(None, {"input": x})[0]
    cosine = float(ours.ravel() @ theirs.ravel() / np.linalg.norm(ours) / np.linalg.norm(theirs))
    assert cosine > 0.999, cosine
