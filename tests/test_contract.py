"""The bundle contract (edgeq.templates.contract): typed manifest, one latency-statistics function, the rules the library
enforces itself, and what a bundle ships as it is."""

import json
from pathlib import Path

import numpy as np
import pytest

from edgeq.templates import contract
from edgeq.templates.contract import ContractError, HostState, Manifest, latency_statistics
from edgeq.errors import UsageError

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parent.parent


def _raw(case="orin") -> dict:
    return json.loads((GOLDEN / case / "manifest.json").read_text())


def test_readers_get_attributes():
    m = Manifest.from_json(_raw("orin"))
    assert m.device.cuda_arch == "sm_87" and m.cuda_major == 12 and m.toolchain.cuda_toolkit.kind == "nvrtc"
    assert m.inputs[0].name == "input" and m.batch == 1
    assert m.golden.tensors[0].name.startswith("input:") and m.golden.tolerance(10.0) == pytest.approx(10 * m.golden.atol)
    assert m.runtime.cuda_bridge["provides"] == "libcudart.so.13"
    host = Manifest.from_json(_raw("host"))
    assert host.toolchain.cuda_toolkit is None and host.cuda_major is None and host.library.cpu_kernels is not None


@pytest.mark.parametrize("change,field", [
    (lambda m: m.pop("golden"), "'golden' is missing"),
    (lambda m: m["weights"]["tensors"][0].__setitem__("offset", -1), "'weights.tensors[0].offset' is not a count"),
    (lambda m: m["inputs"][0].__setitem__("shape", [1, "3"]), "'inputs[0].shape[1]' is not a count"),
    (lambda m: m["device"].__setitem__("cuda_arch", 87), "'device.cuda_arch' is not text or null"),
    (lambda m: m.__setitem__("signed", "yes"), "'signed' is not true or false"),
    (lambda m: m["golden"].__setitem__("rtol", float("nan")), "'golden.rtol' is not a number"),
    (lambda m: m.__setitem__("schema_version", 2), "schema_version 2 is not 3"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(change, field):
    raw = _raw()
    change(raw)
    with pytest.raises(ContractError, match=None) as err:
        Manifest.from_json(raw)
    assert field in str(err.value)


def test_one_quantization_report_shape():
    raw = _raw("host")
    report = {
        "kind": "pre-quantized", "source": "QDQ", "precision_counts": {"int8": 1, "fp16": 0, "fp32": 0},
        "layers": [{"name": "conv", "op_type": "Conv", "kind": "conv2d", "weight": "w", "channel_axis": 0,
                    "precision": "int8", "reason": "", "sqnr_db": None, "activation_dtype": "uint8",
                    "activation_zero_point": 128}],
        "weight_bytes": {"float": 400, "bundle": 100, "ratio": 0.25}, "float_ops": {}, "float_biases": [],
        "method": None, "calibration": None, "evaluation": None, "fallbacks": [], "scheme": {},
        "scales_file": None, "args": None,
    }
    m = Manifest.from_json({**raw, "quantization": report})
    assert m.quantization.layers[0].activation_zero_point == 128
    assert m.quantization.summary() == "1 int8 layers; QDQ; weights 0.25x of float"
    assert json.dumps(m.to_json()["quantization"]) == json.dumps(report)
    with pytest.raises(ContractError, match="quantization.kind"):
        Manifest.from_json({**raw, "quantization": {**report, "kind": "guessed"}})


def test_latency_statistics_match_numpy_and_define_throughput_by_the_mean():
    rng = np.random.default_rng(0)
    times = list(rng.gamma(4.0, 0.5, size=97))
    stats = latency_statistics(times, batch=4)
    for q in (50, 90, 99):  # 4 significant digits
        assert stats[f"p{q}_ms"] == pytest.approx(np.percentile(times, q), rel=5e-4)
    assert stats["mean_ms"] == pytest.approx(np.mean(times), rel=5e-4)
    assert stats["throughput_per_s"] == pytest.approx(4 * 1e3 / np.mean(times), rel=1e-3)
    assert stats["min_ms"] == pytest.approx(min(times), rel=5e-4) and stats["runs"] == 97
    assert len(repr(stats["mean_ms"]).replace(".", "").lstrip("0")) <= 4
    assert contract.describe_latency(stats).startswith("97 runs: min ")


def test_host_states_are_the_words_fleet_reports():
    assert [s.value for s in HostState] == ["updated", "already", "rolled-back", "failed", "skipped"]
    assert json.dumps({"state": HostState.ROLLED_BACK}) == '{"state": "rolled-back"}'


def test_mixed_precision_without_a_budget_is_refused_by_the_library(tmp_path):
    """The rule lives in edgeq.package, so a library caller gets the same refusal as the command line."""
    from edgeq.package import PackageArgs, package
    from edgeq.quantize import QuantizeArgs

    args = PackageArgs(model=tmp_path / "m.onnx", device="host", output=tmp_path / "out", precision="mixed",
                       quantize=QuantizeArgs(calibrate=tmp_path / "c.npz"))
    with pytest.raises(UsageError, match="--precision mixed needs --accuracy-budget"):
        package(args)
    assert not (tmp_path / "out").exists()


def test_defaults_are_written_once():
    """The parser's defaults are the library's (both read edgeq.choices)."""
    from edgeq.choices import DEFAULT_CALIB_SAMPLES, DEFAULT_OUTPUT, DEFAULT_PERCENTILE
    from edgeq.package import PackageArgs
    from edgeq.quantize import QuantizeArgs

    q = QuantizeArgs(calibrate=Path("x"))
    assert (q.percentile, q.samples) == (DEFAULT_PERCENTILE, DEFAULT_CALIB_SAMPLES)
    assert PackageArgs(model=Path("m"), device="host").output == Path(DEFAULT_OUTPUT)


def test_the_contract_module_is_standard_library_only():
    """safebundle.py and run.py carry it to devices that have no edgeq (and maybe only Python 3.8)."""
    import ast

    tree = ast.parse((REPO / "templates" / "contract.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum", "math"}, imported
