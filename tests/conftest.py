"""Shared fixtures: the example models (made by examples/make_models.py) and an in-process CLI runner."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import make_models  # examples/ (pyproject: pythonpath)
from quantize_with_ort import ort_quantize  # noqa: F401

from edgeq.cli.main import Environment, main
from edgeq.tvm_env import import_tvm

REPO = Path(__file__).resolve().parent.parent
import_tvm()  # before a test module imports TVM itself: the CUDA driver (or stub) must load first


@dataclasses.dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> CliResult:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], Environment(stdout=out, stderr=err))
    return CliResult(code, out.getvalue(), err.getvalue())


EXPORT_PYTHON = REPO / ".venv-export" / "bin" / "python"


def torch_export(script: str, path: Path) -> Path:
    """Run ``script`` (torch code writing an ONNX model to ``sys.argv[1]``) in the torch export environment."""
    if not EXPORT_PYTHON.exists():
        pytest.fail(f"{EXPORT_PYTHON} is missing: run 'bash scripts/setup.sh --zoo' (makes the torch export environment)")
    proc = subprocess.run([str(EXPORT_PYTHON), "-c", script, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """The three example model families, written once per test session."""
    return {p.stem: p for p in make_models.write_all(tmp_path_factory.mktemp("models"))}


@pytest.fixture
def cli():
    return run_cli


def read_golden(bundle_dir) -> dict[str, np.ndarray]:
    """A bundle's golden vectors ("input:NAME", "output:NAME"), read with edgeq's own tensor-file reader."""
    from edgeq.bundle import read_manifest, read_tensors

    return read_tensors(Path(bundle_dir), read_manifest(bundle_dir).golden)


def rehash(bundle_dir: Path, manifest: dict, changed: list[str]) -> None:
    """Write ``manifest`` into the bundle with the sizes and SHA-256 of the ``changed`` files, and SHA256SUMS to
    match (unsigned): a bundle changed as a forger or a damaged build would leave it, consistent."""
    import hashlib

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in changed:
        manifest["files"][name] = sha(bundle_dir / name)
        manifest["sizes"][name] = (bundle_dir / name).stat().st_size
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sums = {**manifest["files"], "manifest.json": sha(bundle_dir / "manifest.json")}
    (bundle_dir / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sorted(sums.items())))


def lowering_with_two_weights_swapped(lower):
    """``lower`` (edgeq.package.lower_graph) with two weights of the same shape swapped after lowering: a planted
    fault the golden outputs agree with (the self-test would pass) and the reference check does not."""
    def swapped(graph, target, *backend):
        lowered, calls = lower(graph, target, *backend)
        by_shape = {}
        for name, w in lowered.weights.items():
            by_shape.setdefault((w.shape, str(w.dtype)), []).append(name)
        first, second = next(names for names in by_shape.values() if len(names) >= 2)[:2]
        lowered.weights[first], lowered.weights[second] = lowered.weights[second], lowered.weights[first]
        return lowered, calls

    return swapped


def run_py(bundle_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a bundle's loader the way a device does: a fresh interpreter in the bundle folder."""
    return subprocess.run(
        [sys.executable, str(bundle_dir / "run.py"), *map(str, args)],
        cwd=bundle_dir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> dict[str, Path]:
    """The digits CNN trained by examples/train_digits.py, with its calibration and test data."""
    import train_digits

    return train_digits.write(tmp_path_factory.mktemp("digits"))


LOADER_PREDICT = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import run
model = run.Model()
name = model.manifest.inputs[0].name
x = np.load(sys.argv[2])["input"]
out = [model.run({name: x[i:i + 1]})[model.manifest.outputs[0].name][0] for i in range(len(x))]
np.save(sys.argv[3], np.stack(out))
"""


def predict_with_loader(bundle_dir: Path, data: Path, out: Path) -> np.ndarray:
    """Outputs of a bundle for every sample of ``data`` (npz 'input'), computed by the bundle's own loader
    (run.py's Model) in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", LOADER_PREDICT, str(bundle_dir), str(data), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return np.load(out)

