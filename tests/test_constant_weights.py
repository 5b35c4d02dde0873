"""Weights stored as ONNX ``Constant`` nodes, and the reference check every package passes before it is written.

A ``Constant`` node is as constant as an initializer (Paddle2ONNX writes weights that way, and torch's exporter
writes any tensor a module holds that is not a parameter or buffer). Two same-shape layers whose weights were
large ``Constant`` nodes once shared the first layer's weights, and the bundle's self-test passed because its
golden outputs came from the same wrong build. Here: such models match ONNX Runtime on host builds, package for
the Orin at fp32 and int8, quantize their Constant-node weights, and a fault planted after lowering is refused by
the reference check in one line with nothing written.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import lowering_with_two_weights_swapped, run_cli, torch_export
from edgeq.reference import onnxruntime_session


def _constant(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"{name}_const", value=numpy_helper.from_array(array, name))


def collide_model(path: Path, channels: int = 384, size: int = 4) -> Path:
    """Two same-shape 1x1 convolutions whose weights are large Constant nodes (147,456 elements each)."""
    rng = np.random.default_rng(1)
    nodes = [_constant(f"w{i}", (rng.standard_normal((channels, channels, 1, 1)) * 0.05).astype(np.float32))
             for i in range(2)]
    nodes += [helper.make_node("Conv", ["x", "w0"], ["y0"]), helper.make_node("Relu", ["y0"], ["r0"]),
              helper.make_node("Conv", ["r0", "w1"], ["y"])]
    graph = helper.make_graph(nodes, "collide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, size, size])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def paddle_style_model(path: Path) -> Path:
    """What Paddle2ONNX writes: every weight a Constant node named like Paddle's parameters (conv2d_0.w_0),
    Conv + BatchNormalization + Relu blocks (two of the same shape), a pooled head with MatMul + Add."""
    rng = np.random.default_rng(2)
    nodes, c = [], 3

    def const(name, shape, scale=0.2, offset=0.0):
        nodes.append(_constant(name, (rng.standard_normal(shape) * scale + offset).astype(np.float32)))
        return name

    x = "image"
    for i, oc in enumerate([96, 96, 96]):  # the last two: 96x96x3x3, 82,944 elements each, the same shape
        w = const(f"conv2d_{i}.w_0", (oc, c, 3, 3), scale=1.0 / np.sqrt(c * 9))
        nodes.append(helper.make_node("Conv", [x, w], [f"conv2d_{i}.tmp_0"], pads=[1, 1, 1, 1]))
        bn = [const(f"batch_norm_{i}.w_0", (oc,), 0.1, 1.0), const(f"batch_norm_{i}.b_0", (oc,), 0.1),
              const(f"batch_norm_{i}.w_1", (oc,), 0.1), f"batch_norm_{i}.w_2"]
        nodes.append(_constant(bn[3], (np.abs(rng.standard_normal(oc)) * 0.5 + 0.5).astype(np.float32)))
        nodes.append(helper.make_node("BatchNormalization", [f"conv2d_{i}.tmp_0", *bn], [f"batch_norm_{i}.tmp_2"]))
        nodes.append(helper.make_node("Relu", [f"batch_norm_{i}.tmp_2"], [f"relu_{i}.tmp_0"]))
        x, c = f"relu_{i}.tmp_0", oc
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool2d_0.tmp_0"]))
    nodes.append(helper.make_node("Flatten", ["pool2d_0.tmp_0"], ["flatten_0.tmp_0"], axis=1))
    fc_w, fc_b = const("linear_0.w_0", (c, 10), 0.3), const("linear_0.b_0", (10,), 0.1)
    nodes.append(helper.make_node("MatMul", ["flatten_0.tmp_0", fc_w], ["linear_0.tmp_0"]))
    nodes.append(helper.make_node("Add", ["linear_0.tmp_0", fc_b], ["logits"]))
    graph = helper.make_graph(nodes, "paddle_style", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], producer_name="PaddlePaddle")
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


TORCH_EXPORT = """
import sys, torch
torch.manual_seed(0)
class TensorAttributes(torch.nn.Module):
    # tensors held as plain attributes (not parameters or buffers): torch's exporter writes them as Constant nodes,
    # with constant folding on or off
    def __init__(self):
        super().__init__()
        self.w1 = torch.randn(64, 3, 3, 3) * 0.2
        self.w2 = torch.randn(64, 64, 1, 1) * 0.1
        self.w3 = torch.randn(64, 64, 1, 1) * 0.1
        self.fc = torch.randn(10, 64) * 0.2
    def forward(self, x):
        y = torch.relu(torch.nn.functional.conv2d(x, self.w1, padding=1))
        y = torch.relu(torch.nn.functional.conv2d(y, self.w2))
        y = torch.nn.functional.conv2d(y, self.w3)
        return torch.nn.functional.linear(y.mean((2, 3)), self.fc)
torch.onnx.export(TensorAttributes().eval(), torch.randn(1, 3, 16, 16), sys.argv[1], opset_version=17, dynamo=False,
                  do_constant_folding=False, input_names=["x"], output_names=["y"])
"""


@pytest.fixture(scope="module")
def styles(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("constant-weights")
    torch_path = torch_export(TORCH_EXPORT, out / "torch_constants.onnx")
    return {"torch": torch_path, "paddle": paddle_style_model(out / "paddle_style.onnx")}


def _constant_weights(path: Path) -> int:
    """How many Constant nodes of the model hold a tensor of more than one element (weights, not shapes)."""
    return sum(1 for n in onnx.load(path).graph.node if n.op_type == "Constant"
               and np.prod(n.attribute[0].t.dims) > 1)


def _ort(path: Path, x: np.ndarray) -> np.ndarray:
    session = onnxruntime_session(str(path))
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b))


def _bundle_output(bundle: Path, name: str, x: np.ndarray, tmp_path: Path) -> np.ndarray:
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([sys.executable, str(bundle / "run.py"), "--input", f"{name}={tmp_path / 'x.npy'}",
                           "--output", str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as out:
        return out[out.files[0]]


def _package(model: Path, out: Path, *extra) -> dict:
    res = run_cli("package", model, "-o", out, "--json", "-q", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def _manifest(result: dict) -> dict:
    return json.loads(Path(result["bundle_dir"], "manifest.json").read_text())


def test_two_same_shape_constant_weights_match_onnxruntime(tmp_path):
    model = collide_model(tmp_path / "collide.onnx")
    result = _package(model, tmp_path / "out", "--device", "host")
    manifest = _manifest(result)
    names = [t["name"] for t in manifest["weights"]["tensors"]]
    assert len(names) == 2 == len(set(names)), names  # one parameter per layer
    x = np.random.default_rng(5).standard_normal((1, 384, 4, 4)).astype(np.float32)
    want, got = _ort(model, x), _bundle_output(Path(result["bundle_dir"]), "x", x, tmp_path)
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max()), np.abs(got - want).max()
    check = manifest["reference_check"]
    assert check["result"] == "passed" and check["reference"].startswith("onnxruntime "), check
    assert check["checked"] == "the bundle's own library, on the build host"
    assert check["rtol"] == 1e-3 and check["atol"] == 1e-3 and check["max_abs_diff"] < 1e-4, check
    assert [row["output"] for row in check["outputs"]] == ["y"] and check["outputs"][0]["ok"]


def test_constant_node_weights_are_quantized(tmp_path):
    """int8: the Constant-node weights are weights to the quantizer (it once said the model had none)."""
    model = collide_model(tmp_path / "collide.onnx", channels=96, size=4)
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 96, 4, 4)).astype(np.float32))
    result = _package(model, tmp_path / "out", "--device", "host", "--precision", "int8", "--calibrate", tmp_path / "calib.npz")
    manifest = _manifest(result)
    assert manifest["quantization"]["precision_counts"]["int8"] == 2, manifest["quantization"]["precision_counts"]
    check = manifest["reference_check"]
    assert check["reference"].startswith("tvm ") and check["graph"] == "the quantized graph before lowering", check
    assert check["rtol"] == 2e-2 and check["atol"] == 5e-2, check
    x = rng.standard_normal((1, 96, 4, 4)).astype(np.float32)
    want, got = _ort(model, x), _bundle_output(Path(result["bundle_dir"]), "x", x, tmp_path)
    cosine = _cosine(want, got)
    assert cosine > 0.99, cosine


@pytest.mark.slow
@pytest.mark.parametrize("style", ["torch", "paddle"])
def test_exporter_styles_host_fp32_and_int8(styles, style, tmp_path):
    model = styles[style]
    assert _constant_weights(model) >= 4, "the export no longer stores its weights as Constant nodes"
    name = onnx.load(model).graph.input[0].name
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    fp32 = _package(model, tmp_path / "fp32", "--device", "host")
    want = _ort(model, x)
    got = _bundle_output(Path(fp32["bundle_dir"]), name, x, tmp_path)
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max()), np.abs(got - want).max()
    assert _manifest(fp32)["reference_check"]["result"] == "passed"

    np.savez(tmp_path / "calib.npz", **{name: rng.standard_normal((16, 3, 16, 16)).astype(np.float32)})
    int8 = _package(model, tmp_path / "int8", "--device", "host", "--precision", "int8", "--calibrate", tmp_path / "calib.npz")
    counts = _manifest(int8)["quantization"]["precision_counts"]
    assert counts["int8"] == 4, counts  # three convolutions and the classifier
    got8 = _bundle_output(Path(int8["bundle_dir"]), name, x, tmp_path)
    cosine = _cosine(want, got8)
    assert cosine > 0.98, cosine


@pytest.mark.slow
@pytest.mark.parametrize("style", ["torch", "paddle"])
def test_exporter_styles_orin_fp32_and_int8(styles, style, tmp_path):
    """The same models cross-compile for the Orin (aarch64 + sm_87), their golden outputs checked by the reference."""
    model = styles[style]
    name = onnx.load(model).graph.input[0].name
    np.savez(tmp_path / "calib.npz", **{name: np.random.default_rng(6).standard_normal((8, 3, 16, 16)).astype(np.float32)})
    for precision, extra in (("fp32", ()), ("int8", ("--calibrate", tmp_path / "calib.npz"))):
        result = _package(model, tmp_path / precision, "--device", "jetson-orin-nano", "--runtime", "none",
                          "--precision", precision, *extra)
        manifest = _manifest(result)
        assert manifest["library"]["machine"] == "aarch64" and "sm_87" in manifest["library"]["cuda_device_code"]
        check = manifest["reference_check"]
        assert check["result"] == "passed" and check["checked"].startswith("a TVM LLVM build for the build host"), check
        weights = [t["name"] for t in manifest["weights"]["tensors"]]
        assert len(weights) == len(set(weights)), weights
        if precision == "int8":
            assert manifest["quantization"]["precision_counts"]["int8"] == 4


@pytest.mark.parametrize("reference", ["auto", "tvm"])
def test_reference_check_refuses_a_planted_lowering_fault(tmp_path, monkeypatch, reference):
    """Two weights swapped after lowering: the golden outputs agree with the wrong build (the self-test would pass),
    the reference does not. One line, exit status 1, nothing written."""
    import edgeq.package

    monkeypatch.setattr(edgeq.package, "lower_graph", lowering_with_two_weights_swapped(edgeq.package.lower_graph))
    model = collide_model(tmp_path / "collide.onnx", channels=96, size=4)
    out = tmp_path / "out"
    res = run_cli("package", model, "--device", "host", "-o", out, "--reference", reference)
    assert res.code == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("edgeq: error:")]
    assert len(errors) == 1 and "disagrees with the reference" in errors[0] and "output 'y'" in errors[0], res.stderr
    assert ("onnxruntime" if reference == "auto" else "plain pipeline") in errors[0]
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_reference_onnxruntime_refused_for_int8(tmp_path):
    model = collide_model(tmp_path / "collide.onnx", channels=8, size=2)
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 8, 2, 2), np.float32))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--precision", "int8",
                  "--calibrate", tmp_path / "calib.npz", "--reference", "onnxruntime")
    assert res.code == 2 and "own quantized graph" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_param_never_shares_different_arrays():
    """Rewriter.param: one parameter per array, whatever names the passes derive."""
    from edgeq.graph import Graph, Rewriter
    from edgeq.tvm_env import import_tvm

    import_tvm()
    from tvm import relax

    x = relax.Var("x", relax.TensorType([2], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    rw = Rewriter(Graph(bb.get(), {}), relax.BlockBuilder())
    a, b = np.ones((4, 4), np.float32), np.zeros((4, 4), np.float32)
    first, again, other = rw.param("w", a), rw.param("w", a.copy()), rw.param("w", b)
    assert first.same_as(again) and not first.same_as(other)
    assert (first.name, other.name) == ("w", "w_2")
    assert rw.param("w", a.astype(np.float16)).name == "w_3"  # same values, another dtype
    assert np.array_equal(rw.weights["w"], a) and np.array_equal(rw.weights["w_2"], b)


def test_a_golden_input_the_reference_refuses_is_not_conclusive_and_said(tmp_path):
    """A golden input with an index out of range: ONNX Runtime refuses to compute it, so nothing can be compared;
    the bundle is written, a warning says so (even with -q), and the manifest records why."""
    graph = helper.make_graph([helper.make_node("Gather", ["data", "idx"], ["y"])], "gather",
                              [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 3]),
                               helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    np.savez(tmp_path / "golden.npz", data=np.ones((4, 3), np.float32), idx=np.array([0, 9], np.int64))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "-q", "--json",
                  "--golden-input", tmp_path / "golden.npz")
    assert res.code == 0, res.stderr
    assert "reference check not conclusive" in res.stderr and "--golden-input" in res.stderr, res.stderr
    check = _manifest(json.loads(res.stdout))["reference_check"]
    assert check["result"].startswith("not conclusive: the reference failed on the golden input"), check
    # the generated golden input keeps its indices in range, and the check passes
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out2", "--runtime", "none", "-q", "--json")
    assert res.code == 0 and _manifest(json.loads(res.stdout))["reference_check"]["result"] == "passed", res.stderr
