"""The CUDA path (edgeq.backends.cuda.pipeline): BatchNorm folded and epilogues fused into the conv kernels, CUDA graph capture,
a tensor-core schedule TVM cannot build falling back instead of ending the package, the per-kernel record,
fp16, and the transformed graph checked against ONNX Runtime on this machine's CPU. The slow ResNet-18 and
MobileNetV2 builds run through benchmarks/gpu_kernels.py (the same code as the README's table)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gpu_kernels  # benchmarks/ (pyproject: pythonpath)
from conftest import read_golden, run_cli
from edgeq.backends.cuda import pipeline as gpu
from edgeq.compile import HostRunner, build, lower_graph, toolchain_for
from edgeq.graph import Graph, call_op
from edgeq.graph_passes import dtype_of
from edgeq.load import load_model
from edgeq.relax_import import to_relax
from edgeq.targets import profiles
from edgeq.tvm_env import relax, tvm
from edgeq.reference import onnxruntime_session

ORIN = "jetson-orin-nano"


class _Net(gpu_kernels.Net):
    """gpu_kernels.Net with the activation of each layer taken in turn from ``activations``."""

    def __init__(self, activations: tuple[str, ...]):
        super().__init__(seed=0)
        self.activations = activations

    def act(self, x: str) -> str:
        kind = self.activations[self.count % len(self.activations)]
        if kind == "Relu6":
            return self.node("Clip", [x, self.const("lo", 0.0), self.const("hi", 6.0)])
        if kind == "SiLU":
            return self.node("Mul", [x, self.node("Sigmoid", [x])])
        if kind == "GELU":  # x/2 (1 + erf(x/sqrt 2)), as exporters write it before opset 20
            erf = self.node("Erf", [self.node("Div", [x, self.const("sqrt2", np.sqrt(2.0))])])
            return self.node("Mul", [self.node("Mul", [x, self.const("half", 0.5)]),
                                     self.node("Add", [erf, self.const("one", 1.0)])])
        return self.node(kind, [x])

    def block(self, x: str, cin: int, cout: int, stride: int) -> str:
        y = self.act(self.conv_bn(x, cin, cout, 3, stride))
        y = self.conv_bn(y, cout, cout, 3, 1)
        shortcut = x if stride == 1 and cin == cout else self.conv_bn(x, cin, cout, 1, stride)
        return self.act(self.node("Add", [y, shortcut]))


def resnet(path: Path, size: int = 32, widths=(8, 16), blocks: int = 1, stem: int = 3, classes: int = 10,
           activations: tuple[str, ...] = ("Relu",)) -> Path:
    """A ResNet with BatchNorm after every conv (as an exporter that does not fold it writes one):
    ``resnet(p, 224, (64, 128, 256, 512), 2, stem=7, classes=1000)`` has ResNet-18's 20 convolutions."""
    net = _Net(activations)
    x = net.act(net.conv_bn("input", 3, widths[0], stem, 2 if stem == 7 else 1, bias=stem != 7))
    if stem == 7:
        x = net.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = widths[0]
    for i, width in enumerate(widths):
        for j in range(blocks):
            x = net.block(x, cin, width, 2 if i > 0 and j == 0 else 1)
            cin = width
    flat = net.node("Flatten", [net.node("GlobalAveragePool", [x])], axis=1)
    fc = [net.const("fcw", net.rng.standard_normal((classes, cin)) * 0.1), net.const("fcb", net.rng.standard_normal(classes) * 0.1)]
    net.nodes.append(helper.make_node("Gemm", [flat, *fc], ["logits"], transB=1))
    return net.save(path, size, classes)


def conv1x1(path: Path, channels: int = 128, size: int = 16) -> Path:
    """One 1x1 convolution whose GEMM (spatial x out-channels x in-channels) is over 64 in every extent: int8
    quantized, TVM's dlight schedules it with int8 tensor cores (MatmulInt8Tensorization), which TVM 0.27 cannot
    build (InjectSoftwarePipeline: GetWmmaFragmentSize). The smallest model seen to hit ResNet-18's int8 crash."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((channels, channels, 1, 1)) / np.sqrt(channels)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["input", "w"], ["y"], kernel_shape=[1, 1]), helper.make_node("Relu", ["y"], ["out"])]
    graph = helper.make_graph(nodes, "conv1x1", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, channels, size, size])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, channels, size, size])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx.helper")
    model.ir_version = 8
    onnx.save(model, path)
    return path


def scheduled(graph) -> gpu.GpuKernels:
    """Run the CUDA pipeline (no device code: nothing here is tensorized, so nothing is built) on ``graph``."""
    profile = profiles()[ORIN]
    toolchain_for(profile)  # loads TVM's CUDA backend (driver stub) or says why not
    target = tvm.target.Target(profile.tvm_target())
    report = gpu.GpuKernels()
    with tvm.transform.PassContext(config={gpu.USE_CUDA_GRAPH: True}), target:
        gpu.pipeline(target, report)(graph.mod)
    return report


def ops(graph) -> set[str]:
    return {call_op(b.value) for b in graph.bindings()} - {None}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = resnet(tmp_path_factory.mktemp("gpu") / "resnet_bn.onnx", activations=("Relu", "Relu6", "SiLU", "HardSwish", "GELU"))
    graph, _ = to_relax(load_model(path, {}, {}))
    return path, graph


def test_prepare_graph_folds_batch_norm_into_the_convs(small):
    _, graph = small
    assert "relax.nn.batch_norm" in ops(graph)
    prepared = gpu.prepare_graph(graph)
    assert "relax.nn.batch_norm" not in ops(prepared)
    assert "relax.permute_dims" not in ops(prepared)  # Gemm's transposed weight and the biases' reshapes: precomputed
    convs = [b for b in prepared.bindings() if call_op(b.value) == "relax.nn.conv2d"]
    assert len(convs) == 6 and all(b.value.args[1] in prepared.weight_params for b in convs)


def test_prepared_graph_matches_onnxruntime_on_the_host(small):

    path, graph = small
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    expected = onnxruntime_session(str(path)).run(None, {"input": x})[0]
    prepared, _ = lower_graph(graph, profiles()[ORIN].tvm_target())  # what a Jetson build compiles
    got = HostRunner(prepared)([x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_one_kernel_per_conv_with_bias_activation_and_residual_fused(small):
    _, graph = small
    report = scheduled(gpu.prepare_graph(graph))
    functions = report.to_dict()["functions"]
    assert not [f for f in functions if "batch_norm" in f]
    convs = [f for f in functions if "conv2d" in f]
    # 6 convolutions, the global average pool, the classifier: nothing else runs per inference
    assert report.kernels_per_inference == 8 and len(functions) == 8, functions
    assert len(convs) == 6 and all("add" in f for f in convs)  # bias (folded BatchNorm) fused
    assert sum("add" in f.split("conv2d", 1)[1].split("_", 2)[-1] for f in convs) >= 2  # residual adds fused
    assert report.cuda_graph


def test_before_the_clean_up_batch_norm_ran_as_kernels_of_its_own(small):
    _, graph = small
    report = scheduled(graph)
    assert [f for f in report.functions if "batch_norm" in f] and report.kernels_per_inference > 8


@pytest.mark.slow
def test_resnet18_shape_fits_the_kernel_budget(tmp_path):
    """ResNet-18 at 224x224 with BatchNorm after each conv: <= 23 kernels per inference (20 convs, max pool,
    average pool, classifier), no BatchNorm kernel."""
    path = resnet(tmp_path / "resnet18.onnx", 224, (64, 128, 256, 512), 2, stem=7, classes=1000)
    graph, _ = to_relax(load_model(path, {}, {}))
    report = scheduled(gpu.prepare_graph(graph))
    assert report.kernels_per_inference <= 23, report.to_dict()
    assert not [f for f in report.functions if "batch_norm" in f] and report.cuda_graph


def int8_conv_module(channels: int = 128, size: int = 16):
    """int8 x int8 -> int32 1x1 convolution, cast and ReLU, as Relax: the kernel of ``conv1x1`` after
    quantization, without the quantizer."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, channels, size, size], "int8"))
    w = relax.Var("w", relax.TensorType([channels, channels, 1, 1], "int8"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, out_dtype="int32"))
            y = bb.emit(relax.op.nn.relu(relax.op.astype(y, "float32")))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.slow
def test_unbuildable_int8_tensor_core_schedule_falls_back_and_is_recorded():
    profile = profiles()[ORIN]
    stats: dict = {}
    build(int8_conv_module(), profile.tvm_target(), toolchain_for(profile), stats)
    assert json.loads(json.dumps(stats)) == stats  # what the manifest records: JSON as it is
    first = stats["fallbacks"][0]
    assert first["rule"] == "int8 tensorized matmul" and first["function"] == "fused_conv2d_cast_relu"
    assert "fragment_info_" in first["error"]  # TVM 0.27: InjectSoftwarePipeline, GetWmmaFragmentSize
    # then without the software pipeline (it builds where NVRTC has CUDA's crt/ headers), else without tensor cores
    rule = stats["functions"]["fused_conv2d_cast_relu"]
    assert rule in ("int8 tensorized matmul (no software pipeline)", "matmul") and stats["kernels_per_inference"] == 1
    assert len(stats["fallbacks"]) == (1 if rule != "matmul" else 2)
    assert isinstance(stats["cuda_graph"], bool)


@pytest.mark.slow
def test_int8_model_whose_tensor_core_schedule_fails_still_packages(tmp_path):
    """The ResNet-18 int8 crash, in one layer: the package is written, its manifest says what fell back."""
    model = conv1x1(tmp_path / "conv1x1.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(0).standard_normal((4, 128, 16, 16)).astype(np.float32))
    res = run_cli("package", model, "--device", ORIN, "--precision", "int8", "--calibrate", calib, "--calibration", "minmax",
                  "-o", tmp_path / "out", "--runtime", "none", "--json")
    assert res.code == 0, res.stderr
    manifest = json.loads(Path(json.loads(res.stdout)["bundle_dir"], "manifest.json").read_text())
    assert manifest["library"]["cuda_device_code"] == ["sm_87"]
    kernels = manifest["library"]["gpu_kernels"]
    assert "cpu_kernels" not in manifest["library"]
    assert kernels["fallbacks"][0]["rule"] == "int8 tensorized matmul"
    assert "int8 tensorized matmul" not in kernels["schedules"]


def _bn_graph(conv: bool):
    """x -> [conv2d(x, w) + b ->] batch_norm, with weights as parameters (as the ONNX import makes them)."""
    rng = np.random.default_rng(2)
    weights = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
               "g": rng.uniform(0.5, 1.5, 4).astype(np.float32), "be": rng.standard_normal(4).astype(np.float32),
               "m": rng.standard_normal(4).astype(np.float32), "v": rng.uniform(0.5, 1.5, 4).astype(np.float32)}
    channels = 4 if conv else 3
    if not conv:
        weights = {k: v[:3] for k, v in weights.items() if k != "w" and k != "b"}
    params = {k: relax.Var(k, relax.TensorType(list(v.shape), "float32")) for k, v in weights.items()}
    x = relax.Var("x", relax.TensorType([1, 3, 8, 8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params.values()], attrs={"num_input": 1}):
        with bb.dataflow():
            y = x
            if conv:
                y = bb.emit(relax.op.nn.conv2d(x, params["w"], padding=1))
                y = bb.emit(relax.op.add(y, bb.emit(relax.op.reshape(params["b"], [1, channels, 1, 1]))))
            bn = bb.emit(relax.op.nn.batch_norm(y, params["g"], params["be"], params["m"], params["v"], axis=1, epsilon=1e-3,
                                                    training=False))
            out = bb.emit_output(bb.emit(relax.TupleGetItem(bn, 0)))
        bb.emit_func_output(out)
    return Graph(bb.get(), weights)


def test_batch_norm_after_conv_plus_bias_becomes_its_weights_and_bias():
    graph = _bn_graph(conv=True)
    folded = gpu.prepare_graph(graph)
    assert ops(folded) == {"relax.nn.conv2d", "relax.add"}
    (weight,) = [w for w in folded.weight_list() if w.ndim == 4 and w.shape[0] == 4 and w.shape[2] == 3]
    (bias,) = [w for w in folded.weight_list() if w.shape == (1, 4, 1, 1)]
    wt = graph.weights
    scale = wt["g"] / np.sqrt(wt["v"] + 1e-3)
    np.testing.assert_allclose(weight, wt["w"] * scale[:, None, None, None], rtol=1e-6)
    np.testing.assert_allclose(bias.reshape(-1), (wt["b"] - wt["m"]) * scale + wt["be"], rtol=1e-5, atol=1e-6)


def test_batch_norm_without_a_conv_becomes_a_channel_multiply_add():
    folded = gpu.prepare_graph(_bn_graph(conv=False))
    assert ops(folded) == {"relax.multiply", "relax.add"}
    assert sorted(w.shape for w in folded.weight_list()) == [(1, 3, 1, 1), (1, 3, 1, 1)]


@pytest.mark.slow
def test_orin_manifest_records_the_gpu_kernels(small, tmp_path):
    path, _ = small
    res = run_cli("package", path, "--device", ORIN, "-o", tmp_path, "--runtime", "none", "--json")
    assert res.code == 0, res.stderr
    library = json.loads(Path(json.loads(res.stdout)["bundle_dir"], "manifest.json").read_text())["library"]
    kernels = library["gpu_kernels"]
    assert kernels["kernels_per_inference"] == 8 and kernels["cuda_graph"] is True and kernels["fallbacks"] == []
    assert sum(kernels["schedules"].values()) == len(kernels["functions"]) == 8
    assert not [f for f in kernels["functions"] if "batch_norm" in f]


@pytest.mark.slow
def test_a_schedule_no_check_caught_is_found_by_the_whole_module_retry(monkeypatch):
    """A rule whose schedule does not build (here: a wmma fragment no tensor-core intrinsic fills) and is not
    checked (not tensor cores) makes the first build fail; the retry builds every schedule alone first and
    takes the next rule."""
    from tvm.s_tir import dlight as dl

    class FragmentWithoutTensorCores(dl.gpu.Fallback):
        def apply(self, func, target, _):
            sch = dl.gpu.Fallback().apply(func, target, _)
            block = sch.get_child_blocks(sch.get_sblock("root"))[0]
            staged = sch.cache_read(block, 0, "wmma.matrix_a")  # a tensor-core fragment, not filled by tensor cores
            sch.compute_at(staged, sch.get_loops(block)[-1])
            return sch

    rules = (("fragment without tensor cores", FragmentWithoutTensorCores()), ("fallback", dl.gpu.Fallback()))
    monkeypatch.setattr(gpu, "RULES", rules)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 4096], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.relu(x)))
        bb.emit_func_output(out)
    profile = profiles()[ORIN]
    stats: dict = {}
    build(bb.get(), profile.tvm_target(), toolchain_for(profile), stats)
    assert stats["functions"] == {"relu": "fallback"}
    assert [f["rule"] for f in stats["fallbacks"]] == ["build", "fragment without tensor cores"]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_fp16_graph_keeps_fp16_weights_and_matches_onnxruntime_fp32(small):

    path, graph = small
    fp16 = gpu.to_fp16(gpu.prepare_graph(graph))
    convs = [b.value for b in fp16.bindings() if call_op(b.value) == "relax.nn.conv2d"]
    weights = {p.name: fp16.weights[p.name] for p in fp16.weight_params}
    assert all(weights[c.args[1].name].dtype == np.float16 for c in convs)  # converted once, here
    assert all(str(c.attrs.out_dtype) == "float32" for c in convs)  # fp32 accumulation
    # fp32 are only what the fp32 epilogues read: biases, the classifier's bias, activation constants
    assert all(w.dtype == np.float16 or w.ndim < 2 or w.shape[0] == 1 for w in weights.values())
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    expected = onnxruntime_session(str(path)).run(None, {"input": x})[0]
    got = HostRunner(fp16)([x])[0]
    assert got.dtype == np.float32 and cosine(got, expected) >= 0.999


def test_fp16_converts_a_swin_window_padding(tmp_path):
    """Swin pads its feature map to whole windows (``F.pad`` -> ONNX Pad with constant pads, and a pad of nothing
    where the map fits). TVM's Pad converter made that a TE function (``call_tir``), on which ToMixedPrecision
    stopped ("Expected TensorType, but got R.Callable"): Swin-T was refused in fp16. edgeq imports it as Relax's
    ``nn.pad`` (the pad of nothing as its input), which converts; fp16 equals ONNX Runtime's fp32."""

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 1, 1, 0], np.int64), "pads"),
             numpy_helper.from_array(np.zeros(8, np.int64), "none"),
             numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["input", "w"], ["first"]),  # the pad reads fp16, as Swin's (a norm's)
             helper.make_node("Pad", ["first", "none"], ["same"]),
             helper.make_node("Pad", ["same", "pads"], ["padded"]),
             helper.make_node("MatMul", ["padded", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["output"])]
    graph = helper.make_graph(nodes, "windows", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 6, 6, 16])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 7, 7, 16])], inits)
    path = tmp_path / "windows.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    imported, _ = to_relax(load_model(path, {}, {}))
    assert "relax.nn.pad" in ops(imported) and "relax.call_tir" not in ops(imported)
    assert sum(call_op(b.value) == "relax.nn.pad" for b in imported.bindings()) == 1
    fp16 = gpu.to_fp16(gpu.prepare_graph(imported))
    x = rng.standard_normal((1, 6, 6, 16)).astype(np.float32)
    expected = onnxruntime_session(str(path)).run(None, {"input": x})[0]
    got = HostRunner(fp16)([x])[0]
    assert got.shape == (1, 7, 7, 16) and cosine(got, expected) >= 0.999


@pytest.mark.parametrize("equation, shapes, products", [
    ("bghid,bghjd->bghij", [(1, 2, 2, 9, 8), (1, 2, 2, 9, 8)], 1),  # MaxViT's attention scores
    ("bghij,bghjd->bghid", [(1, 2, 2, 9, 9), (1, 2, 2, 9, 8)], 1),  # and its context
    ("bij,jk->bik", [(2, 4, 8), (8, 6)], 1),  # rows of two axes, flattened
    ("ikj,jlk->li", [(3, 5, 4), (4, 2, 5)], 1),  # two contracted axes, a transposed output
    ("bij,bkj->bik", [(2, 4, 8), (2, 6, 8)], 1),  # the second operand transposed
    ("ij,ij->i", [(4, 8), (4, 8)], 1),  # rows of dot products: a batch of 1x1 products
    ("ii->i", [(5, 5)], 0),  # a diagonal: Relax's einsum
    ("bij,bjk,bkl->bil", [(2, 4, 8), (2, 8, 3), (2, 3, 5)], 0),  # three operands: Relax's einsum
])
def test_einsum_is_a_matmul_where_it_is_a_matrix_product(tmp_path, equation, shapes, products):
    """MaxViT's attention is two Einsums. TVM's converter made each a TE function (``call_tir``), on which
    ToMixedPrecision stopped (MaxViT-T was refused in fp16) and which no GPU kernel could claim. edgeq imports an
    Einsum that is a (batched) matrix product as transposes, reshapes and one ``matmul``, and any other as Relax's
    ``einsum``; fp32 and fp16 both equal ONNX Runtime."""

    rng = np.random.default_rng(6)
    names = [f"x{i}" for i in range(len(shapes))]
    node = helper.make_node("Einsum", names, ["y"], equation=equation)
    graph = helper.make_graph([node], "einsum", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, np.einsum(equation, *map(np.zeros, shapes)).shape)])
    path = tmp_path / "einsum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    imported, _ = to_relax(load_model(path, {}, {}))
    assert "relax.call_tir" not in ops(imported)
    assert sum(call_op(b.value) == "relax.matmul" for b in imported.bindings()) == products
    assert ("relax.einsum" in ops(imported)) == (products == 0)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    expected = onnxruntime_session(str(path)).run(None, dict(zip(names, xs)))[0]
    assert np.allclose(HostRunner(imported)(xs)[0], expected, rtol=1e-5, atol=1e-5)
    got = HostRunner(gpu.to_fp16(gpu.prepare_graph(imported)))(xs)[0]
    assert got.shape == expected.shape and cosine(got, expected) >= 0.999


def test_fp16_erf_on_the_build_host_is_erf():
    """The golden outputs of an fp16 GPU bundle are computed on the build host (edgeq's CPU pipeline, which makes
    erf TVM's ``fast_erf``). Its float16 form returns 1.041 for x >= 4 (a GELU on a pre-activation over 5.7 was 4%
    off, and the device, right, would have failed its self-test): fp16 erf runs in float32 there."""
    from math import erf

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 256), "float16"))
    with bb.function("main", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            y = bb.emit_output(relax.op.erf(x))
        bb.emit_func_output(y)
    xs = np.linspace(-8, 8, 256, dtype=np.float16).reshape(1, 256)
    got = HostRunner(Graph(bb.get(), {}))([xs])[0].astype(np.float64)
    want = np.vectorize(erf)(xs.astype(np.float64))
    assert np.abs(got - want).max() < 2e-3  # float16's rounding of values near 1 (fast_erf's float16: 0.041)


def test_fp16_global_pool_reads_fp16_in_one_kernel_with_what_follows(small, monkeypatch):
    """ToMixedPrecision keeps the global average pool in fp32 behind a cast of its input, which FuseOps cannot fuse
    into the mean (it fuses it into the producer, where it can): the pool reads the fp16 tensor itself
    (``pools_read_fp16``), and its fp16 cast fuses after it."""
    _, graph = small
    prepared = gpu.prepare_graph(graph)
    fp16 = gpu.to_fp16(prepared)
    assert "relax.mean" not in ops(fp16)
    [pool] = [b.value for b in fp16.bindings() if call_op(b.value) == "relax.call_tir"]
    assert pool.args[0].name_hint == "mean_fp16" and dtype_of(pool.args[1].fields[0]) == "float16"
    report = scheduled(fp16)
    # 6 convolutions, the pool with its cast, the classifier, and the input's cast to fp16: nothing else
    assert report.kernels_per_inference == 9, report.launches
    assert [f for f in report.launches if "mean" in f] == ["fused_mean_fp16_cast3"], report.launches
    monkeypatch.setattr(gpu, "pools_read_fp16", lambda g: g)
    plain = gpu.to_fp16(prepared)
    # dlight fuses that cast into the last convolution, which then writes fp32 (twice the bytes); a CUTLASS kernel
    # takes no such cast, so there it was a kernel of its own (tests/test_cutlass.py)
    assert "relax.mean" in ops(plain) and scheduled(plain).kernels_per_inference == 9
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(HostRunner(fp16)([x])[0], HostRunner(plain)([x])[0], rtol=1e-6, atol=1e-6)


def test_reshapes_after_a_pool_sink_below_its_quantization_and_vanish():
    """``mean(keepdims) -> transpose -> reshape [1, C] -> quantize -> reshape [1, 1, 1, C]`` (a global pool before a
    classifier that runs as a 1x1 convolution) becomes ``mean -> quantize``: FuseOps fuses it into one kernel."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    from edgeq.graph import Graph

    @I.ir_module
    class Pool:
        @R.function
        def main(x: R.Tensor((1, 7, 7, 64), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                m = R.mean(x, axis=[1, 2], keepdims=True)
                t = R.permute_dims(m, axes=[0, 3, 1, 2])
                f = R.reshape(t, R.shape([1, 64]))
                q = R.round(R.divide(f, R.const(0.25, "float32")))
                c = R.astype(R.minimum(R.maximum(q, R.const(-128.0, "float32")), R.const(127.0, "float32")), "int8")
                out = R.reshape(c, R.shape([1, 1, 1, 64]))
                R.output(out)
            return out

    graph = Graph(Pool, {})
    sunk = gpu.views_collapsed(graph)
    assert ops(sunk) == {"relax.mean", "relax.divide", "relax.round", "relax.maximum", "relax.minimum", "relax.astype"}
    x = np.random.default_rng(3).standard_normal((1, 7, 7, 64)).astype(np.float32) * 8
    np.testing.assert_array_equal(HostRunner(sunk)([x])[0], HostRunner(graph)([x])[0])
    assert scheduled(sunk).kernels_per_inference == 1 and scheduled(graph).kernels_per_inference == 2

    @I.ir_module
    class Tokens:  # a transformer's per-token quantization: the reshape before abs fuses with it, and stays
        @R.function
        def main(x: R.Tensor((1, 128, 64), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                v = R.reshape(x, R.shape([1, 1, 128, 64]))
                m = R.max(R.abs(v), axis=[-1], keepdims=True)
                out = R.reshape(R.divide(m, R.const(127.0, "float32")), R.shape([128, 1]))
                R.output(out)
            return out

    tokens = Graph(Tokens, {})
    kept = gpu.views_collapsed(tokens)
    assert [call_op(b.value) for b in kept.bindings()][:3] == ["relax.reshape", "relax.abs", "relax.max"]
    before, after = scheduled(tokens).launches, scheduled(kept).launches
    assert after == before, (after, before)


def test_an_int8_transformers_token_scales_are_one_kernel_each():
    """A per-token scale (``where(amax > 0, amax / 127, 1)``, ``amax = max(abs(x))`` over a row: an int8
    transformer's linear layers quantize their input so) was two kernels, the max and the scale after it (FuseOps
    fuses nothing after a plain reduction): ``row_scales_in_one_kernel`` makes it one TIR function, bit for bit,
    an all-zero row included."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Rows:
        @R.function
        def main(x: R.Tensor((1, 16, 64), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                amax = R.max(R.abs(x), axis=[-1], keepdims=True)
                scale = R.where(R.greater(amax, R.const(0.0, "float32")), R.divide(amax, R.const(127.0, "float32")),
                                R.const(1.0, "float32"))
                q = R.astype(R.clip(R.round(R.divide(x, scale)), -127, 127), "int8")
                out = (q, scale)
                R.output(out)
            return out

    graph = Graph(Rows, {})
    fused = gpu.row_scales_in_one_kernel(graph)
    assert "relax.max" not in ops(fused) and "relax.call_tir" in ops(fused)
    x = np.random.default_rng(4).standard_normal((1, 16, 64)).astype(np.float32) * 3
    x[0, 5] = 0.0
    for got, want in zip(HostRunner(fused)([x]), HostRunner(graph)([x])):
        np.testing.assert_array_equal(got, want)
    assert scheduled(fused).kernels_per_inference == scheduled(graph).kernels_per_inference - 1


def test_a_channel_split_becomes_slices_that_fuse_into_their_readers():
    """A split along the channels (YOLO's C2f) as strided slices of its input, equal sections and explicit indices
    alike, bit for bit: the parts fuse into their element-wise readers and concatenations as the split did here (a
    split after a CUTLASS convolution whose parts a CUTLASS convolution also reads was a kernel of its own: the
    YOLOv8n-style test in test_cutlass.py holds those convolutions reading their part in place)."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Split:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 48), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                halves = R.split(x, 2, axis=3)
                parts = R.split(x, [8, 40], axis=-1)
                a = R.add(halves[1], R.const(1.0, "float32"))
                out = R.concat([halves[0], a, parts[0], parts[2]], axis=3)
                R.output(out)
            return out

    graph = Graph(Split, {})
    sliced = gpu.splits_as_slices(graph)
    assert "relax.split" not in ops(sliced) and "relax.strided_slice" in ops(sliced)
    x = np.random.default_rng(6).standard_normal((1, 4, 4, 48)).astype(np.float32)
    np.testing.assert_array_equal(HostRunner(sliced)([x])[0], HostRunner(graph)([x])[0])
    assert scheduled(sliced).kernels_per_inference == scheduled(graph).kernels_per_inference == 1


def test_fp16_is_refused_for_cpu_profiles(small, tmp_path):
    path, _ = small
    res = run_cli("package", path, "--device", "host", "--precision", "fp16", "-o", tmp_path)
    assert res.code == 2 and "--precision fp16 is for CUDA profiles" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def _check_builds(model: Path, tmp_path: Path, tensorized: dict[str, int],
                  precisions: tuple[str, ...] = ("fp16", "int8")) -> dict[str, dict]:
    """``precisions`` bundles of ``model`` for Orin: CUDA graph, no conv/matmul on dlight's fallback rule,
    at least ``tensorized[precision]`` conv/matmul launches with HMMA (fp16) / IMMA (int8) in their SASS, fp16
    weights at most half of the model's float32 ones (its BatchNorms' four vectors folded away besides), and the
    fp16 bundle's golden outputs (computed on the host from its fp16 graph) close to ONNX Runtime fp32."""
    import onnx

    calib = gpu_kernels.calibration(model, tmp_path)
    rows = {p: gpu_kernels.package_and_measure(model, p, tmp_path, calib) for p in precisions}
    for precision, row in rows.items():
        assert row["manifest_precision"] == precision and row["cuda_graph"], row
        assert row["cuda_graph_kernels"] >= row["kernels_per_inference"] - 2, row  # all but the first and last
        assert row["on_fallback_rule"] == [], row
        assert row["tensor_core_launches"] >= tensorized.get(precision, 0), row
        assert row["tensor_core_fallbacks"] == [], row  # with crt/ for NVRTC each builds (int8: without pipeline)
    float_bytes = sum(onnx.numpy_helper.to_array(t).nbytes for t in onnx.load(str(model)).graph.initializer
                      if t.data_type == onnx.TensorProto.FLOAT)
    assert rows["fp16"]["weight_bytes"] * 2 <= float_bytes * 1.01  # fp16 weights, converted once
    bundle = tmp_path / "fp16" / f"{model.stem}-{ORIN}"
    golden = read_golden(bundle)
    session = onnxruntime_session(str(model))
    expected = session.run(None, {"input": golden["input:input"]})[0]
    assert cosine(golden["output:logits"], expected) >= 0.999
    return rows


@pytest.mark.slow
def test_resnet18_fp16_int8_builds_for_orin(tmp_path):
    """ResNet-18, 224x224: 20 convolutions and the classifier. dlight tensorizes a GEMM whose M, N and K are
    all over 64: the 9 convolutions of the 128- and 256-channel stages but for the 1x1 64->128 shortcut; not
    the stem and 64-channel stage (N = 64), the 512-channel stage (M = 7x7 = 49), the classifier (M = 1). (The
    fp32 build of this path: the example models' Orin package tests.)"""
    rows = _check_builds(gpu_kernels.resnet18(tmp_path / "resnet18.onnx"), tmp_path, {"fp16": 9, "int8": 9},
                         ("fp16", "int8"))
    assert rows["fp16"]["kernels_per_inference"] <= 25  # (RESULTS.md: 25 with dlight)


@pytest.mark.slow
def test_mobilenet_v2_fp16_int8_builds_for_orin(tmp_path):
    """MobileNetV2 through its 96-channel stage (13 of its 17 blocks: the 160- and 320-channel stages at 7x7 add
    only more of the same kernels, and build time), 224x224: 26 1x1 convolutions, 13 depthwise ones (no GEMM: never
    tensor cores), the stem, the classifier. The 1x1 convolutions of the 96-channel stage (14x14, 96 <-> 576
    channels) are the ones whose M, N and K are all over 64. fp16 and int8."""
    model = gpu_kernels.mobilenet_v2(tmp_path / "mobilenet_v2.onnx", settings=gpu_kernels.MOBILENET_V2[:5])
    _check_builds(model, tmp_path, {"fp16": 6, "int8": 6}, ("fp16", "int8"))


def test_fp16_is_refused_for_a_model_already_quantized(models, tmp_path):
    from conftest import ort_quantize

    model = ort_quantize(models["mobilenet_cnn"], tmp_path / "qdq.onnx")
    res = run_cli("package", model, "--device", ORIN, "--precision", "fp16", "-o", tmp_path / "out")
    assert res.code == 2 and "already quantized" in res.stderr


@pytest.mark.parametrize("family", ["transformer_block", "mobilenet_cnn"])
def test_gpu_graph_of_the_example_models_matches_onnxruntime_on_the_host(models, family):
    """The graph a Jetson build compiles (fp32: rtol 1e-4), built for this machine's CPU, against ONNX Runtime:
    a transformer block (LayerNorm, attention, GELU MLP, and its fp16 form: cosine >= 0.999) and a
    MobileNet-style net (depthwise convs; its fp16 form is refused today: TVM's ToMixedPrecision fails on a
    call_tir in that graph, see the session note)."""

    path = models[family]
    graph, _ = to_relax(load_model(path, {}, {}))
    session = onnxruntime_session(str(path))
    spec = session.get_inputs()[0]
    x = np.random.default_rng(2).standard_normal(spec.shape).astype(np.float32)
    expected = session.run(None, {spec.name: x})[0]
    prepared, _ = lower_graph(graph, profiles()[ORIN].tvm_target())
    np.testing.assert_allclose(HostRunner(prepared)([x])[0], expected, rtol=1e-4, atol=1e-5)
    if family == "transformer_block":
        assert cosine(HostRunner(gpu.to_fp16(prepared))([x])[0], expected) >= 0.999
