"""The reference check's judgement (edgeq.reference.compare), on references whose behaviour is known exactly:
an integer build may differ where its reference moves by itself (an unstable int8 graph such as PP-OCRv4's
detector), never more; a planted fault is refused; a YOLO head's boxes and scores are judged each on its scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeq.templates.contract import TensorSpec
from edgeq.reference import MAX_OUTLIERS, Reference, ReferenceMismatch, compare, yolo_parts

N = 20000


def _steep(fraction: float):
    """A reference that rounds like an int8 graph and amplifies one step: about ``fraction`` of its outputs sit
    on a rounding boundary and jump by 0.9 under noise, which its probe (the same graph, noise added) shows."""
    edge = np.zeros(N, bool)
    edge[np.random.default_rng(3).choice(N, int(fraction * N), replace=False)] = True
    clean = np.full(N, 0.05, np.float32)
    moved = np.where(edge, 0.95, 0.05).astype(np.float32)
    return Reference("steep", "a steep graph", lambda inputs: [clean]), Reference("probe", "noisy", lambda inputs: [moved])


def _check(reference, probe, got, parts=None):
    return compare(reference, {}, [got], [TensorSpec("y", [N], "float32")], 0.02, 0.05, "the build",
                   probes=(lambda: [probe]) if probe else None, parts=parts)


def test_an_integer_build_may_move_where_its_reference_moves_by_itself():
    reference, probe = _steep(0.004)
    got = reference.run({})[0].copy()
    got[:40] = 0.95  # 0.2% of the values flipped by 0.9: within twice what the reference moves (0.4%)
    row = _check(reference, probe, got).outputs[0]
    assert row["ok"] and row["outside"] == pytest.approx(0.002) and row["reference_moves"] == pytest.approx(0.004)
    assert row["outliers"] == pytest.approx(0.008)
    # a float build (no probes) is still judged element by element: the same difference is refused
    with pytest.raises(ReferenceMismatch, match="output 'y'"):
        _check(reference, None, got)


def test_more_than_the_reference_moves_and_a_planted_fault_are_refused():
    reference, probe = _steep(0.004)
    want = reference.run({})[0]
    got = want.copy()
    got[:200] = 0.95  # 1% flipped: more than twice the reference's 0.4%
    with pytest.raises(ReferenceMismatch, match="This is an edgeq fault"):
        _check(reference, probe, got)
    with pytest.raises(ReferenceMismatch, match="disagrees"):
        _check(reference, probe, want + 0.5)  # a planted fault: every value off
    stable, probe = _steep(0.0)  # a graph that does not move: no allowance at all
    got = want.copy()
    got[0] = 0.95
    with pytest.raises(ReferenceMismatch, match="disagrees"):
        _check(stable, probe, got)


def test_a_graph_more_unstable_than_any_self_test_accepts_is_refused_as_such():
    reference, probe = _steep(MAX_OUTLIERS)
    got = reference.run({})[0].copy()
    got[: int(1.75 * MAX_OUTLIERS * N)] = 0.95  # within twice what the reference moves, beyond what a self-test takes
    with pytest.raises(ReferenceMismatch, match="the quantized graph is unstable.*--precision mixed"):
        _check(reference, probe, got)


def test_a_yolo_head_is_judged_part_by_part():
    """Box rows in pixels and score rows in 0..1: a score 0.3 off is refused although the boxes reach 600."""
    head = np.zeros((1, 6, 100), np.float32)
    head[0, :4] = np.linspace(0, 600, 400).reshape(4, 100)
    head[0, 4:] = 0.1
    bad = head.copy()
    bad[0, 5, 7] += 0.3
    reference = Reference("head", "a head", lambda inputs: [head])
    spec = [TensorSpec("out", [1, 6, 100], "float32")]
    whole = compare(reference, {}, [bad], spec, 0.02, 0.05, "the build")  # scaled by 600: 0.3 passes
    assert whole.outputs[0]["ok"]
    with pytest.raises(ReferenceMismatch, match="output 'out'"):
        compare(reference, {}, [bad], spec, 0.02, 0.05, "the build", parts=yolo_parts("out"))
    moved = head.copy()
    moved[0, 0, 3] += 20.0  # 20 px on 600 px boxes: within the boxes' own scale
    assert compare(reference, {}, [moved], spec, 0.02, 0.05, "the build", parts=yolo_parts("out")).outputs[0]["ok"]


def steep_model(path, seed: int = 0, size: int = 64, gain: float = 10.0):
    """A small int8-unstable network, shaped like a DB text detector's tail: 3x3 and depthwise 5x5 convolutions,
    each followed by a per-channel scale and shift and hard-swish, into a steep 1-channel sigmoid map (a one-step
    change of an int8 value inside moves some probabilities by most of their range)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def w(name, array):
        inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    x, c = "x", 3
    for i in range(4):
        dw = i % 2 == 1
        k, co = (5, c) if dw else (3, 16)
        shape = (co, 1, k, k) if dw else (co, c, k, k)
        fan_in = k * k * (1 if dw else c)
        nodes += [helper.make_node("Conv", [x, w(f"w{i}", rng.standard_normal(shape) * 1.5 / np.sqrt(fan_in)),
                                            w(f"b{i}", rng.standard_normal(co) * 0.1)], [f"c{i}"], pads=[k // 2] * 4,
                                   group=co if dw else 1),
                  helper.make_node("Mul", [f"c{i}", w(f"s{i}", rng.uniform(0.5, 1.5, (1, co, 1, 1)))], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", w(f"t{i}", rng.standard_normal((1, co, 1, 1)) * 0.1)], [f"a{i}"]),
                  helper.make_node("HardSwish", [f"a{i}"], [f"h{i}"])]
        x, c = f"h{i}", co
    nodes += [helper.make_node("Conv", [x, w("wl", rng.standard_normal((1, c, 1, 1)) * gain / np.sqrt(c)),
                                        w("bl", np.array([-1.0]))], ["logit"]),
              helper.make_node("Sigmoid", ["logit"], ["y"])]
    graph = helper.make_graph(nodes, "steep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, size, size])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


EPSILON = 2.0 ** -21  # half the probes' noise (edgeq.reference.NUDGE)


def test_an_unstable_int8_model_packages_and_a_planted_fault_in_it_does_not(tmp_path, monkeypatch):
    """PP-OCRv4's detector in small: its int8 build differs from its quantized graph only where float noise
    crosses a rounding boundary (emulated here: every quantize's input moved by 2^-21 before lowering, a fused
    epilogue rounding otherwise), and packages (an element-wise check refused it), the allowance recorded for the
    self-test, which both loaders apply; two weights swapped in the same build are refused."""
    import json

    import edgeq.package
    from conftest import lowering_with_two_weights_swapped, run_cli

    model = steep_model(tmp_path / "steep.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(5).standard_normal((16, 3, 64, 64)).astype(np.float32))
    lower = edgeq.package.lower_graph

    def rounded_otherwise(graph, target, *backend):  # float noise of the size a fused epilogue makes, before every rounding
        from edgeq.graph import call_op, rewrite
        from edgeq.tvm_env import relax

        def visit(rw, var, value):
            if call_op(value) != "relax.quantize":
                return None
            moved = rw.emit(relax.op.multiply(rw.new(value.args[0]), relax.const(1 + EPSILON, "float32")))
            return relax.op.quantize(moved, rw.new(value.args[1]), rw.new(value.args[2]), axis=int(value.attrs.axis),
                                     out_dtype=str(value.attrs.out_dtype))

        return lower(rewrite(graph, visit), target, *backend)

    monkeypatch.setattr(edgeq.package, "lower_graph", rounded_otherwise)
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "out", "--precision", "int8",
                  "--calibrate", tmp_path / "calib.npz", "--json", "-q")
    assert res.code == 0, res.stderr
    bundle = json.loads(res.stdout)["bundle_dir"]
    manifest = json.loads((tmp_path / "out" / "steep-host" / "manifest.json").read_text())
    row = manifest["reference_check"]["outputs"][0]
    assert row["ok"] and 0 < row["outside"] <= row["outliers"] and row["reference_moves"] > 0, row
    assert manifest["golden"]["outliers"] == row["outliers"]
    _self_test_allows_the_outliers(Path(bundle), manifest, tmp_path)

    monkeypatch.setattr(edgeq.package, "lower_graph", lowering_with_two_weights_swapped(lower))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "bad", "--precision", "int8",
                  "--calibrate", tmp_path / "calib.npz")
    assert res.code == 1 and "disagrees with the reference" in res.stderr and "edgeq fault" in res.stderr, res.stderr
    assert not (tmp_path / "bad").exists()


def _self_test_allows_the_outliers(bundle: Path, manifest: dict, tmp_path: Path) -> None:
    """golden.outliers in both loaders: the golden output with as many values moved as it allows passes the
    self-test, one more fails it."""
    import json
    import shutil
    import subprocess

    from conftest import rehash, run_py

    entry = next(t for t in manifest["golden"]["tensors"] if t["name"].startswith("output:"))
    count = entry["bytes"] // 4
    allowed = int(np.floor(manifest["golden"]["outliers"] * count))
    assert allowed >= 1
    for moved, passes in ((allowed, True), (allowed + 1, False)):
        copy = tmp_path / f"moved{moved}"
        shutil.copytree(bundle, copy)
        data = bytearray((copy / "golden.bin").read_bytes())
        values = np.frombuffer(data, np.float32, count, entry["offset"]).copy()
        values[:moved] += 0.5
        data[entry["offset"]:entry["offset"] + entry["bytes"]] = values.tobytes()
        (copy / "golden.bin").write_bytes(bytes(data))
        rehash(copy, json.loads((copy / "manifest.json").read_text()), ["golden.bin"])
        py = run_py(copy, "--self-test", "--json")
        native = subprocess.run([str(copy / "runtime" / "edgeq-run"), "--self-test", "--json"], cwd=copy,
                                capture_output=True, text=True, timeout=120)
        for proc in (py, native):
            assert (proc.returncode == 0) == passes, (moved, allowed, proc.stdout, proc.stderr)
            row = json.loads(proc.stdout)["outputs"][0]
            assert (row["outside"], row["allowed"]) == (moved, allowed), row
