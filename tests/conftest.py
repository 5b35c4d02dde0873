"""Shared fixtures: the example models (made by examples/make_models.py) and an in-process CLI runner."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import make_models  # noqa: E402

from edgeq.cli.main import Environment, main  # noqa: E402
from edgeq.toolchain import import_tvm  # noqa: E402

import_tvm()  # before anything else imports TVM: the CUDA driver (or stub) must load first


@dataclasses.dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> CliResult:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], Environment(stdout=out, stderr=err))
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """The three example model families, written once per test session."""
    return {p.stem: p for p in make_models.write_all(tmp_path_factory.mktemp("models"))}


@pytest.fixture
def cli():
    return run_cli


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
