"""0-d tensors (scalars) everywhere: as weights (ReLU6 as Clip with 0-d min/max initializers, the 0-d
constants of an exported transformer block), as quantization parameters (QDQ with 0-d scales and zero
points) and as graph inputs. Each model is packaged for host and its bundle, run the way a device runs
it, matches ONNX Runtime."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from conftest import run_cli, run_py
from edgeq.bundle import read_tensor, write_tensors
from edgeq.reference import onnxruntime_session

F = T.FLOAT


def _scalar(name: str, value, dtype=np.float32):
    return nh.from_array(np.array(value, dtype), name)


def _save(path: Path, nodes, inits, inputs, outputs, opset=17) -> Path:
    graph = h.make_graph(nodes, path.stem, inputs, outputs, initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def mobilenet_relu6(path: Path) -> Path:
    """Conv -> BatchNormalization (not folded) -> Clip(0-d 0, 0-d 6), a depthwise block, pooling, Gemm."""
    rng = np.random.default_rng(0)

    def arr(name, *shape, scale=0.3):
        return nh.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)

    def bn(prefix, c):
        return [arr(f"{prefix}_s", c), arr(f"{prefix}_b", c),
                arr(f"{prefix}_m", c), nh.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"{prefix}_v")]

    inits = [arr("w1", 8, 3, 3, 3), *bn("bn1", 8), arr("w2", 8, 1, 3, 3), *bn("bn2", 8), arr("fc", 10, 8),
             arr("fc_b", 10), _scalar("zero", 0.0), _scalar("six", 6.0)]
    n = h.make_node
    nodes = [
        n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        n("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["b1"]),
        n("Clip", ["b1", "zero", "six"], ["r1"]),
        n("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=8),
        n("BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["b2"]),
        n("Clip", ["b2", "zero", "six"], ["r2"]),
        n("GlobalAveragePool", ["r2"], ["p"]),
        n("Flatten", ["p"], ["f"]),
        n("Gemm", ["f", "fc", "fc_b"], ["logits"], transB=1),
    ]
    return _save(path, nodes, inits, [h.make_tensor_value_info("x", F, [1, 3, 16, 16])],
                 [h.make_tensor_value_info("logits", F, [1, 10])])


def transformer_0d(path: Path) -> Path:
    """Attention and an MLP as exporters write them, every scalar a 0-d initializer: LayerNorm spelled out
    (Pow by 2, Add eps, Sqrt, Div), scores divided by sqrt(d), GELU with 0.5 / 1 / sqrt(2)."""
    rng = np.random.default_rng(1)
    d, seq = 16, 8

    def arr(name, *shape):
        return nh.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    inits = [arr("wq", d, d), arr("wk", d, d), arr("wv", d, d), arr("w1", d, 2 * d), arr("w2", 2 * d, d),
             _scalar("two", 2.0), _scalar("eps", 1e-5), _scalar("sqrt_d", np.sqrt(d)), _scalar("half", 0.5),
             _scalar("one", 1.0), _scalar("sqrt2", np.sqrt(2.0)), _scalar("gamma", 1.3), _scalar("beta", -0.2)]
    n = h.make_node
    nodes = [
        n("ReduceMean", ["x"], ["mu"], axes=[-1]),
        n("Sub", ["x", "mu"], ["xc"]),
        n("Pow", ["xc", "two"], ["sq"]),
        n("ReduceMean", ["sq"], ["var"], axes=[-1]),
        n("Add", ["var", "eps"], ["var_eps"]),
        n("Sqrt", ["var_eps"], ["std"]),
        n("Div", ["xc", "std"], ["xn"]),
        n("Mul", ["xn", "gamma"], ["xg"]),
        n("Add", ["xg", "beta"], ["ln"]),
        n("MatMul", ["ln", "wq"], ["q"]),
        n("MatMul", ["ln", "wk"], ["k"]),
        n("MatMul", ["ln", "wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s"]),
        n("Div", ["s", "sqrt_d"], ["s_scaled"]),
        n("Softmax", ["s_scaled"], ["a"], axis=-1),
        n("MatMul", ["a", "v"], ["att"]),
        n("Add", ["x", "att"], ["res"]),
        n("MatMul", ["res", "w1"], ["h1"]),
        n("Div", ["h1", "sqrt2"], ["h1s"]),
        n("Erf", ["h1s"], ["erf"]),
        n("Add", ["erf", "one"], ["erf1"]),
        n("Mul", ["h1", "erf1"], ["g0"]),
        n("Mul", ["g0", "half"], ["gelu"]),
        n("MatMul", ["gelu", "w2"], ["h2"]),
        n("Add", ["res", "h2"], ["y"]),
    ]
    return _save(path, nodes, inits, [h.make_tensor_value_info("x", F, [1, seq, d])],
                 [h.make_tensor_value_info("y", F, [1, seq, d])])


def qdq_0d(path: Path) -> Path:
    """A pre-quantized conv in QDQ form whose scales and zero points are all 0-d."""
    rng = np.random.default_rng(2)
    inits = [_scalar("s", 0.05), _scalar("zp", 3, np.uint8), _scalar("ws", 0.02), _scalar("wzp", 0, np.int8),
             nh.from_array(rng.integers(-50, 50, (8, 3, 3, 3)).astype(np.int8), "wq"),
             _scalar("ys", 0.1), _scalar("yzp", 0, np.uint8)]
    n = h.make_node
    nodes = [
        n("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
        n("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
        n("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"]),
        n("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1]),
        n("Relu", ["c"], ["r"]),
        n("QuantizeLinear", ["r", "ys", "yzp"], ["rq"]),
        n("DequantizeLinear", ["rq", "ys", "yzp"], ["y"]),
    ]
    return _save(path, nodes, inits, [h.make_tensor_value_info("x", F, [1, 3, 8, 8])],
                 [h.make_tensor_value_info("y", F, [1, 8, 8, 8])])


def scalar_input(path: Path) -> Path:
    """A 0-d graph input (a temperature) and 0-d Clip bounds given as inputs."""
    n = h.make_node
    nodes = [n("Div", ["x", "t"], ["xt"]), n("Softmax", ["xt"], ["p"], axis=-1), n("Clip", ["p", "lo", "hi"], ["y"])]
    inputs = [h.make_tensor_value_info("x", F, [2, 5]), h.make_tensor_value_info("t", F, []),
              h.make_tensor_value_info("lo", F, []), h.make_tensor_value_info("hi", F, [])]
    return _save(path, nodes, [], inputs, [h.make_tensor_value_info("y", F, [2, 5])])


MODELS = {"mobilenet_relu6": mobilenet_relu6, "transformer_0d": transformer_0d, "qdq_0d": qdq_0d,
          "scalar_input": scalar_input}


def _inputs(model_path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    model = onnx.load(model_path)
    out = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out[value.name] = rng.standard_normal(shape).astype(np.float32)
    if "t" in out:
        out.update(t=np.array(0.7, np.float32), lo=np.array(0.05, np.float32), hi=np.array(0.6, np.float32))
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-d")
    out = {}
    for name, make in MODELS.items():
        path = make(tmp / f"{name}.onnx")
        runtime = "bundled" if name == "scalar_input" else "none"
        res = run_cli("package", path, "--device", "host", "-o", tmp / "out", "--runtime", runtime, "--json")
        assert res.code == 0, f"{name}: {res.stderr}"
        out[name] = (path, Path(json.loads(res.stdout)["bundle_dir"]))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_bundle_matches_onnxruntime(bundles, name, tmp_path):
    model_path, bundle = bundles[name]
    inputs = _inputs(model_path)
    args = []
    for key, value in inputs.items():
        np.save(tmp_path / f"{key}.npy", value)
        args += ["--input", f"{key}={tmp_path / key}.npy"]
    proc = run_py(bundle, *args, "--output", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out.npz")
    session = onnxruntime_session(str(model_path))
    names = [o.name for o in session.get_outputs()]
    for out_name, want in zip(names, session.run(names, inputs)):
        scale = max(1.0, float(np.abs(want).max()))
        atol = 0.1 + 1e-6 if name == "qdq_0d" else 1e-5 * scale  # one quantization step of the output (0.1)
        np.testing.assert_allclose(got[out_name], want, rtol=1e-4, atol=atol)
    assert run_py(bundle, "--self-test").returncode == 0


def test_scalar_input_keeps_rank_0(bundles, tmp_path):
    """The manifest records the 0-d inputs as shape [], and the native loader takes and self-tests them."""
    _, bundle = bundles["scalar_input"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {s["name"]: s["shape"] for s in manifest["inputs"]} == {"x": [2, 5], "t": [], "lo": [], "hi": []}
    loader = bundle / "runtime" / "edgeq-run"
    assert subprocess.run([str(loader), "--self-test"], cwd=bundle, capture_output=True, text=True,
                          timeout=120).returncode == 0
    inputs = {"x": np.ones((2, 5), np.float32), "t": np.array(0.5, np.float32), "lo": np.array(0.0, np.float32),
              "hi": np.array(1.0, np.float32)}
    args = []
    for key, value in inputs.items():
        np.save(tmp_path / f"{key}.npy", value)
        args += ["--input", f"{key}={tmp_path / key}.npy"]
    proc = subprocess.run([str(loader), *args, "--output", str(tmp_path / "native.npz")], cwd=bundle,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "native.npz")["y"], np.full((2, 5), 0.2, np.float32), rtol=1e-5)


def test_tensor_files_keep_rank_0(tmp_path):
    arrays = [("a", np.array(3.5, np.float32)), ("b", np.array(7, np.int64)), ("c", np.zeros((2, 1), np.uint8))]
    table = write_tensors(tmp_path / "t.bin", arrays)
    assert [entry.shape for entry in table] == [[], [], [2, 1]]
    for (_, want), entry in zip(arrays, table):
        got = read_tensor(tmp_path / "t.bin", entry)
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


def test_int8_quantization_of_0d_weights(tmp_path):
    """edgeq's own int8 quantization of the ReLU6 model (0-d Clip bounds) builds and passes its self-test."""
    model = mobilenet_relu6(tmp_path / "m.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(1).standard_normal((16, 1, 3, 16, 16)).astype(np.float32))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--runtime", "none", "--precision",
                  "int8", "--calibrate", calib, "--json")
    assert res.code == 0, res.stderr
    bundle = Path(json.loads(res.stdout)["bundle_dir"])
    assert json.loads((bundle / "manifest.json").read_text())["precision"] == "int8"
    assert run_py(bundle, "--self-test").returncode == 0
