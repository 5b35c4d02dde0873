"""Every bad input of `edgeq package` through the real CLI: one line on stderr, a non-zero exit status,
and nothing left in the output folder."""

import json

import onnx
import pytest
from onnx import TensorProto, helper

import make_models
from conftest import run_cli


def assert_refused(res, code: int, *fragments: str):
    lines = res.stderr.strip().splitlines()
    assert res.code == code, res.stderr
    assert len(lines) == 1 and lines[0].startswith("edgeq: error: "), res.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in res.stderr


def package(model, out, *extra):
    return run_cli("package", model, "-o", out, "-q", *extra)


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    yield path
    # Nothing half-written: the folder edgeq created is gone, or (when it existed) holds no bundle.
    assert not path.exists() or list(path.iterdir()) == []


def test_missing_file(tmp_path, out):
    assert_refused(package(tmp_path / "nope.onnx", out, "--device", "host"), 3, "model file not found", "nope.onnx")


def test_not_an_onnx_file(tmp_path, out):
    text = tmp_path / "notes.onnx"
    text.write_text("this is a text file, not a model\n")
    assert_refused(package(text, out, "--device", "host"), 3, "notes.onnx is not", "ONNX model")


def test_corrupt_protobuf(models, tmp_path, out):
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(models["resnet_cnn"].read_bytes()[:3000])
    assert_refused(package(truncated, out, "--device", "host"), 3, "truncated.onnx", "protobuf parse failed")


def test_op_tvm_cannot_import_is_named(tmp_path, out):
    # DeformConv: neither TVM 0.27 nor edgeq.onnx_ops converts it (Celu, the old example, edgeq now converts)
    node = helper.make_node("DeformConv", ["x", "w", "offset"], ["y"], kernel_shape=[1, 1])
    graph = helper.make_graph([node], "deform", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2]),
                                                helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 1, 1, 1]),
                                                helper.make_tensor_value_info("offset", TensorProto.FLOAT, [1, 2, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    path = tmp_path / "deform.onnx"
    onnx.save(model, path)
    assert_refused(package(path, out, "--device", "host"), 3, "uses ONNX op(s) TVM", "cannot import: DeformConv")


def test_unknown_device_lists_valid_ones(models, out):
    assert_refused(package(models["resnet_cnn"], out, "--device", "jetson-nano"), 4,
                   "unknown device 'jetson-nano'", "jetson-orin-nano", "host", "arm64-cpu")


def test_dynamic_dims_need_input_shape(tmp_path, out):
    path = tmp_path / "dyn.onnx"
    onnx.save(make_models.resnet_cnn(batch="N"), path)
    assert_refused(package(path, out, "--device", "host"), 3,
                   "input 'input' has dynamic dims Nx3x32x32", "--input-shape input=1x3x32x32")


def test_input_shape_naming_an_unknown_input(models, out):
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--input-shape", "image=1x3x32x32"), 2,
                   "--input-shape names 'image'", "inputs are: input")


def test_input_shape_with_wrong_rank_or_syntax(tmp_path, out):
    path = tmp_path / "dyn.onnx"
    onnx.save(make_models.resnet_cnn(batch="N"), path)
    assert_refused(package(path, out, "--device", "host", "--input-shape", "input=1x3"), 2, "has 2 dims")
    assert_refused(package(path, out, "--device", "host", "--input-shape", "input=1xthree"), 2, "is not NAME=DxDx")


def test_output_directory_not_writable(models, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_refused(package(models["resnet_cnn"], blocker / "out", "--device", "host"), 6,
                   "cannot write to output directory", "choose another with -o")
    assert blocker.read_text() == ""


def test_missing_cross_compiler(models, out, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert_refused(package(models["resnet_cnn"], out, "--device", "jetson-orin-nano"), 5,
                   "cross compiler 'aarch64-linux-gnu-g++'", "apt-get install g++-aarch64-linux-gnu")


def test_no_cuda_toolkit_fits_xavier(models, out):
    assert_refused(package(models["resnet_cnn"], out, "--device", "jetson-agx-xavier"), 5,
                   "needs a CUDA 11.x toolkit that builds sm_72", "EDGEQ_CUDA_HOME")


def test_existing_output_folder_keeps_its_files(models, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = package(models["resnet_cnn"], out, "--device", "jetson-nano")
    assert res.code == 4
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_inspect_bad_bundles(tmp_path):
    assert_refused(run_cli("inspect", tmp_path / "missing"), 7, "bundle not found")
    (tmp_path / "junk.tar.gz").write_bytes(b"not an archive")
    assert_refused(run_cli("inspect", tmp_path / "junk.tar.gz"), 7, "not a readable .tar.gz bundle")
    assert_refused(run_cli("inspect", tmp_path), 7, "has no manifest.json")


def test_usage_errors_are_one_line(models):
    assert_refused(run_cli("package", models["resnet_cnn"]), 2, "--device")
    assert_refused(run_cli(), 2, "give a command")


# ---- hostile or careless input: bounded before it is allocated -------------------------------------------


def test_model_path_that_is_a_device_or_folder(tmp_path, out):
    assert_refused(package("/dev/zero", out, "--device", "host"), 3, "/dev/zero is not a regular file")
    assert_refused(package(tmp_path, out, "--device", "host"), 3, "is not a regular file")


def test_model_file_over_the_limit(models, out, monkeypatch):
    monkeypatch.setenv("EDGEQ_MAX_MODEL_BYTES", "1000")
    assert_refused(package(models["resnet_cnn"], out, "--device", "host"), 3,
                   "more than the limit of 1,000", "EDGEQ_MAX_MODEL_BYTES")


def test_huge_input_shape_is_refused_before_allocation(tmp_path, out):
    path = tmp_path / "dyn.onnx"
    onnx.save(make_models.resnet_cnn(batch="N"), path)
    assert_refused(package(path, out, "--device", "host", "--input-shape", "input=1000000000x3x32x32"), 2,
                   "input 'input' (1000000000x3x32x32 float32) is 12,288,000,000,000 bytes", "EDGEQ_MAX_INPUT_BYTES")


def test_huge_intermediate_from_small_inputs(tmp_path, out):
    """400 bytes of input, one Tile to 40 GB: refused after import, before anything is compiled or run."""
    nodes = [helper.make_node("Tile", ["x", "reps"], ["y"])]
    reps = helper.make_tensor("reps", TensorProto.INT64, [2], [100000, 100000])
    graph = helper.make_graph(nodes, "bomb", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [100000, 100000])], [reps])
    path = tmp_path / "bomb.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert_refused(package(path, out, "--device", "host"), 3, "is 40,000,000,000 bytes", "EDGEQ_MAX_ACTIVATION_BYTES")


def test_nan_weight_is_not_packaged_silently(tmp_path, out):
    import numpy as np
    from onnx import numpy_helper

    w = numpy_helper.from_array(np.array([[1.0, np.nan], [0.5, 2.0]], np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "nan",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
    path = tmp_path / "nan.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert_refused(package(path, out, "--device", "host"), 3, "output 'y' is NaN or Inf on the golden input",
                   "weight(s) w hold NaN")


def test_calibration_data_bounds(models, tmp_path, out, monkeypatch):
    import numpy as np

    bomb = tmp_path / "bomb.npy"
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 3, 32, 32), }".ljust(127) + b"\n"
    bomb.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)  # 1.2 GB claimed, 0 held
    monkeypatch.setenv("EDGEQ_MAX_DATA_BYTES", str(1 << 20))
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--precision", "int8", "--calibrate", bomb),
                   2, "is 1,228,800,000 bytes", "EDGEQ_MAX_DATA_BYTES")
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--precision", "int8", "--calibrate", empty),
                   2, "cannot read", "empty.npy")
    pickled = tmp_path / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--precision", "int8", "--calibrate", pickled),
                   2, "cannot read", "pickles")


def test_image_bomb_is_refused_before_decoding(models, tmp_path, out, monkeypatch):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (3000, 3000)).save(images / "big.png")
    monkeypatch.setenv("EDGEQ_MAX_IMAGE_PIXELS", "1000000")
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--precision", "int8", "--calibrate", images,
                           "--preprocess", "scale=255"), 2, "is 9,000,000 pixels", "EDGEQ_MAX_IMAGE_PIXELS")


def test_non_finite_options_and_long_names(models, out):
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--precision", "mixed", "--calibrate", "x.npz",
                           "--accuracy-budget", "nan"), 2, "--accuracy-budget must be a number >= 0, not nan")
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--name", "n" * 120), 2,
                   "bundle name 'nnn", "over 128: choose a shorter --name")


def test_markup_in_paths_is_printed_as_text(models, tmp_path):
    """Progress lines show paths verbatim: a '[/x]' in -o is text, not rich markup (which crashed)."""
    out = tmp_path / "out[/x]"
    res = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", out, "--runtime", "none")
    assert res.code == 0, res.stderr
    assert "[/x]" in res.stderr and (out / "resnet_cnn-host" / "manifest.json").is_file()


def test_preprocess_values_that_do_not_fit(models, tmp_path, out):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (40, 40)).save(images / "a.png")
    base = ["--device", "host", "--precision", "int8", "--calibrate", images, "--preprocess"]
    assert_refused(package(models["resnet_cnn"], out, *base, "mean=0.5/0.5"), 2,
                   "--preprocess mean has 2 values; input 'input' has 3 channels: give 1 or 3")
    assert_refused(package(models["resnet_cnn"], out, *base, "scale=nan"), 2, "must be finite numbers")
    assert_refused(package(models["resnet_cnn"], out, *base, "resize=0x10"), 2, "must be 1 to 16384 pixels a side")


def test_package_under_a_low_address_space_limit(models, tmp_path):
    """`ulimit -v` below the model checker's own limit: the checker runs within it (it crashed before)."""
    import subprocess
    import sys

    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
              "from edgeq.cli.main import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, "package", str(models["resnet_cnn"]), "--device", "host",
                           "-o", str(tmp_path / "o"), "-q", "--runtime", "none"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_packaging_over_an_existing_bundle_says_so(models, tmp_path):
    first = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--runtime", "none")
    again = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--runtime", "none")
    assert first.code == again.code == 0, again.stderr
    assert "replacing" not in first.stderr and f"replacing the bundle already in {tmp_path / 'resnet_cnn-host'}" in again.stderr
    quiet = run_cli("package", models["resnet_cnn"], "--device", "host", "-o", tmp_path, "--runtime", "none", "-q", "--json")
    assert quiet.code == 0 and json.loads(quiet.stdout)["replaced"] is True  # said with --quiet and in --json too
    assert quiet.stderr.strip() == f"edgeq: warning: replacing the bundle already in {tmp_path / 'resnet_cnn-host'}"


def test_deeply_nested_records_line(models, tmp_path, out):
    records = tmp_path / "records.json"
    records.write_text("[" * 100000 + "]" * 100000 + "\n")
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--records", records), 2,
                   "line 1 is not an edgeq tuning record")


def test_model_without_graph_inputs_packages_and_runs(tmp_path):
    import json
    import subprocess
    import sys

    import numpy as np
    from onnx import numpy_helper

    value = numpy_helper.from_array(np.array([[1.0, -2.0]], np.float32))
    graph = helper.make_graph([helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Relu", ["c"], ["y"])],
                              "noinput", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    path = tmp_path / "noinput.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    res = run_cli("package", path, "--device", "host", "-o", tmp_path / "out", "-q", "--json")
    assert res.code == 0, res.stderr
    bundle = tmp_path / "out" / "noinput-host"
    for cmd in ([str(bundle / "runtime" / "edgeq-run")], [sys.executable, str(bundle / "run.py")]):
        proc = subprocess.run(cmd + ["--self-test"], capture_output=True, text=True)
        assert proc.returncode == 0 and "self-test passed" in proc.stdout, proc.stderr
        bench = subprocess.run(cmd + ["--benchmark", "3", "--json"], capture_output=True, text=True)
        assert bench.returncode == 0 and json.loads(bench.stdout)["runs"] == 3, bench.stderr


def test_nested_if_is_refused_in_one_line(tmp_path, out):
    import numpy as np
    from onnx import numpy_helper

    def branch(name, value):
        k = numpy_helper.from_array(np.array([value], np.float32), f"{name}_k")
        return helper.make_graph([helper.make_node("Add", ["x", f"{name}_k"], [f"{name}_o"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_o", TensorProto.FLOAT, [1])], [k])

    inner = helper.make_node("If", ["cond"], ["i_o"], name="inner", then_branch=branch("t", 1.0), else_branch=branch("e", 2.0))
    then = helper.make_graph([inner], "then", [], [helper.make_tensor_value_info("i_o", TensorProto.FLOAT, [1])])
    outer = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=branch("o", 3.0))
    graph = helper.make_graph([outer], "nested", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
                                                  helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "nested.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert_refused(package(path, out, "--device", "host"), 3, "node 'inner' puts an If/Loop inside another one's branch")


def test_const_whose_header_declares_a_huge_array(models, tmp_path, out):
    """128 bytes on disk, 4 TB declared: refused from the header, before numpy allocates anything."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000000), }".ljust(127) + b"\n"
    bomb = tmp_path / "bomb.npy"
    bomb.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    assert_refused(package(models["resnet_cnn"], out, "--device", "host", "--const", f"input={bomb}"), 2,
                   "as its header declares", "EDGEQ_MAX_INPUT_BYTES")


def test_output_folder_inside_a_bundle_is_refused(models, tmp_path):
    first = run_cli("package", models["mobilenet_cnn"], "--device", "host", "-o", tmp_path, "-q", "--runtime", "none")
    assert first.code == 0, first.stderr
    bundle = tmp_path / "mobilenet_cnn-host"
    before = sorted(p.name for p in bundle.iterdir())
    for target in (bundle, bundle / "more"):
        assert_refused(package(models["mobilenet_cnn"], target, "--device", "host"), 2, "bundle", "outside any bundle")
    assert sorted(p.name for p in bundle.iterdir()) == before
    assert run_cli("verify", bundle).code == 0


def test_inspect_refuses_a_manifest_that_is_not_a_regular_file(tmp_path):
    import os

    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / "manifest.json")  # reading a FIFO would wait forever
    res = run_cli("inspect", tmp_path / "b")
    assert_refused(res, 7, "not a regular file")


def test_records_whose_workload_does_not_parse_are_skipped_with_a_warning(models, tmp_path):
    """A records line for this profile and TVM version whose workload is garbage: skipped with a warning naming
    the line (not an internal error), and the bundle is built without it."""
    import tvm

    records = tmp_path / "records.json"
    good_shape = {"format": "edgeq-tuning-records-1", "profile": "host", "tvm_version": tvm.__version__,
                  "workload_hash": "123", "workload": ["not", "a", "workload"], "record": [[1], [2]]}
    records.write_text(json.dumps(good_shape) + "\n")
    res = run_cli("package", models["mobilenet_cnn"], "--device", "host", "-o", tmp_path / "out", "--records", records,
                  "--runtime", "none", "-q")
    assert res.code == 0, res.stderr
    assert "Traceback" not in res.stderr and f"records file {records} line 1 is skipped" in res.stderr, res.stderr


def test_a_runtime_operand_refusal_names_the_graph_input_to_bind(tmp_path, out):
    """CumSum's axis fed by a graph input: the refusal says which input to bind with --const, with its dtype and
    shape, and binding it as told packages the model."""
    import numpy as np

    nodes = [helper.make_node("CumSum", ["x", "axis"], ["y"], name="cumsum")]
    graph = helper.make_graph(nodes, "cumsum", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                                helper.make_tensor_value_info("axis", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = tmp_path / "cumsum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    assert_refused(package(model, out, "--device", "host"), 3, "--const axis=FILE.npy (int64, shape scalar)")
    np.save(tmp_path / "axis.npy", np.array(1, np.int64))
    res = package(model, tmp_path / "bound", "--device", "host", "--runtime", "none", "--const", f"axis={tmp_path / 'axis.npy'}")
    assert res.code == 0, res.stderr


def test_dft_with_its_axis_a_graph_input_is_refused_then_exact_once_bound(tmp_path, out):
    """DFT's axis given as a graph input once packaged silently along the default axis (max error 995 on the node
    test). An operand that changes the result is never replaced by its default: refused, naming 'axis'."""
    import numpy as np
    from onnx.reference import ReferenceEvaluator

    nodes = [helper.make_node("DFT", ["x", "", "axis"], ["y"], name="dft")]
    graph = helper.make_graph(nodes, "dft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 1]),
                                             helper.make_tensor_value_info("axis", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 2])])
    model = tmp_path / "dft.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), model)
    assert_refused(package(model, out, "--device", "host"), 3, "its axis is computed at run time", "--const axis=FILE.npy")
    np.save(tmp_path / "axis.npy", np.array(2, np.int64))
    res = run_cli("package", model, "--device", "host", "-o", tmp_path / "bound", "--runtime", "none", "-q", "--json",
                  "--const", f"axis={tmp_path / 'axis.npy'}")
    assert res.code == 0, res.stderr
    import sys

    bundle = json.loads(res.stdout)["bundle_dir"]
    sys.path.insert(0, bundle)
    try:
        import run

        x = np.random.default_rng(0).standard_normal((1, 4, 6, 1)).astype(np.float32)
        got = run.Model().run({"x": x})["y"]
    finally:
        sys.path.remove(bundle)
        sys.modules.pop("run", None)
    want = ReferenceEvaluator(onnx.load(model)).run(None, {"x": x, "axis": np.array(2, np.int64)})[0]
    assert np.allclose(got, want, atol=1e-4), np.abs(got - want).max()


def test_an_input_too_big_for_the_address_space_is_refused_before_compiling(tmp_path):
    """A 10^9-element input under a 4 GiB address-space limit (ulimit -v): refused from the sizes in one line
    before anything is compiled (it was a MemoryError after compiling)."""
    import resource
    import subprocess
    import sys

    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000, 1000, 1000])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000, 1000, 1000])])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "edgeq", "package", str(path), "--device", "host", "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600, preexec_fn=limit)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("edgeq: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "ulimit -v" in errors[0] and "GiB" in errors[0], errors
    assert "compile:" not in proc.stderr and not (tmp_path / "out").exists()
