"""A plain install works: the checkout, installed with ``pip install <checkout>`` (not editable) into an empty
virtual environment, on every Python edgeq supports (3.10: JetPack 6 / Ubuntu 22.04; 3.11: Debian 12; 3.12:
Ubuntu 24.04; 3.13) and on the distribution's own /usr/bin/python3, runs ``edgeq --version``, packages an
example model for this machine whose bundle passes its self-test with both loaders and ``edgeq verify``, and
serves as an ``edgeq rpc serve`` device. With the interpreter running these tests, the same install packages
for a Jetson Orin Nano: the CUDA 12 NVRTC wheels are default dependencies, so the bundle carries sm_87 device
code with no extra.

Interpreters are found as ``python3.X`` on PATH, then through ``uv python find`` and pyenv's versions; one
that is not there is skipped with the reason. Each install downloads apache-tvm and the rest (about 200 MB;
pip's cache, where responses are cacheable, serves reruns) and takes 30-50 s on 2 cores; each interpreter
about a minute in all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

VERSIONS = ["3.10", "3.11", "3.12", "3.13", "system"]
THIS = f"{sys.version_info.major}.{sys.version_info.minor}"
SYSTEM = "/usr/bin/python3"  # the distribution's own (Debian 12: 3.11.2, older than pyenv's; Ubuntu 22.04: 3.10)


def _reports(python: str, version: str) -> str | None:
    """Why ``python`` cannot make a venv of ``version``, or None when it can."""
    probe = "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except OSError as err:
        return f"{python}: {err}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if "ensurepip" in proc.stderr or "venv" in proc.stderr:
            return f"{python} cannot make virtual environments ({last}; Debian/Ubuntu: apt-get install python{version}-venv)"
        return f"{python} does not run ({last})"
    if proc.stdout.strip() != version:
        return f"{python} is Python {proc.stdout.strip()}, not {version}"
    return None


def _base_prefix(python: str) -> str:
    """The installation an interpreter (or a venv's) belongs to."""
    out = subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    return os.path.realpath(out) if out else ""


def find_system_python() -> tuple[str | None, str]:
    """The distribution's python3, unless it is the one tried for its version already (Ubuntu 22.04's
    python3.10, or the interpreter running the tests)."""
    if not os.path.exists(SYSTEM):
        return None, f"no {SYSTEM}"
    version = subprocess.run([SYSTEM, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    same, _ = find_python(version) if version in VERSIONS else (None, "")
    if same and _base_prefix(same) == _base_prefix(SYSTEM):
        return None, f"{SYSTEM} is the Python {version} tried above"
    why = _reports(SYSTEM, version)
    return (None, why) if why else (SYSTEM, f"the system's Python {version}")


def find_python(version: str) -> tuple[str | None, str]:
    """(an interpreter of ``version`` that can make a venv, how it was found) or (None, why none was)."""
    if version == "system":
        return find_system_python()
    if version == THIS:
        return sys.executable, "the interpreter running the tests"
    tried = []
    candidates = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append((on_path, "PATH"))
    else:
        tried.append(f"no python{version} on PATH")
    uv = shutil.which("uv")
    if uv:
        proc = subprocess.run([uv, "python", "find", version], capture_output=True, text=True, timeout=60)
        if proc.returncode == 0 and proc.stdout.strip():
            candidates.append((proc.stdout.strip(), "uv"))
        else:
            tried.append(f"uv python find {version}: none")
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=60).stdout.strip()
        found = []
        for exe in Path(root or "/nonexistent", "versions").glob(f"{version}.*/bin/python{version}"):
            patch = exe.parent.parent.name[len(version) + 1:]
            if patch.isdigit():  # 3.10.13, not 3.10.13t or 3.10-dev
                found.append((int(patch), exe))
        if found:
            candidates.append((str(max(found)[1]), "pyenv"))
        else:
            tried.append(f"no {version}.* under pyenv's versions")
    for python, how in candidates:
        why = _reports(python, version)
        if why is None:
            return python, how
        tried.append(why)
    return None, "; ".join(tried) or f"no python{version} found"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh shell: nothing of this test process's interpreter or venv leaks in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


def checkout_copy(dest: Path) -> Path:
    """The files a fresh clone has (tracked and new, not ignored), so the install neither sees nor writes
    build/, *.egg-info, .venv or dist/ of the working tree."""
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True, timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.decode(errors='replace').strip()}")
    for name in proc.stdout.decode().split("\0"):
        src = REPO / name
        if name and src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def run(argv, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(), **kwargs)


def tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-lines:])


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> Path:
    return checkout_copy(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="module", params=VERSIONS)
def venv(request, source, tmp_path_factory):
    """A venv of one Python version with the checkout pip-installed into it (module-scoped: one install each)."""
    version = request.param
    python, how = find_python(version)
    if python is None:
        pytest.skip(f"Python {version} not available: {how}" if version != "system" else how)
    where = tmp_path_factory.mktemp(f"venv{version}")
    made = run([python, "-m", "venv", where], timeout=300)
    assert made.returncode == 0, tail(made)
    start = time.monotonic()
    # --no-compile: pip's byte-compiling of every installed module (TVM's thousands) took half the install (31 s
    # against 17 s for 3.11); pip does not fail on what it cannot compile, so nothing it checked is lost
    installed = run([where / "bin" / "python", "-m", "pip", "install", "--no-compile", source], timeout=1800)
    assert installed.returncode == 0, tail(installed)
    print(f"\nPython {version} ({how}: {python}): pip install took {time.monotonic() - start:.0f} s")
    yield where
    shutil.rmtree(where, ignore_errors=True)  # about 0.7 GB each; pytest keeps the last three runs' tmp dirs


@pytest.fixture(scope="module")
def host_bundle(venv, models, tmp_path_factory) -> dict:
    """``edgeq package`` of an example model for this machine, by the venv's edgeq (its --json result)."""
    out = tmp_path_factory.mktemp("bundle")
    proc = run([venv / "bin" / "edgeq", "package", models["resnet_cnn"], "--device", "host", "-o", out, "--json"],
               timeout=900)
    assert proc.returncode == 0, tail(proc)
    return json.loads(proc.stdout)


def test_version(venv):
    proc = run([venv / "bin" / "edgeq", "--version"], timeout=120)
    assert proc.returncode == 0, tail(proc)
    assert re.fullmatch(r"edgeq \S+.*", proc.stdout.strip()), proc.stdout


def test_the_install_carries_the_cutlass_headers(venv):
    """edgeq's CUTLASS epilogues and iterators are C++ headers that NVRTC reads with -I at build time: package data
    of the installed package, not only files of this checkout."""
    check = ("from edgeq.backends.cuda.cutlass.nvrtc import EDGEQ_INCLUDE, nvrtc_options; "
             "import edgeq; assert str(EDGEQ_INCLUDE).startswith(str(__import__('pathlib').Path(edgeq.__file__).parent)); "
             "names = sorted(p.name for p in (EDGEQ_INCLUDE / 'edgeq_cutlass').glob('*.h')); "
             "assert f'-I{EDGEQ_INCLUDE}' in nvrtc_options(); print(' '.join(names))")
    proc = run([venv / "bin" / "python", "-c", check], timeout=120)
    assert proc.returncode == 0, tail(proc)
    assert proc.stdout.split() == ["epilogues.h", "store_iterators.h"], proc.stdout


def test_package_host_and_self_test(venv, host_bundle):
    bundle = Path(host_bundle["bundle_dir"])
    assert (bundle / "manifest.json").is_file() and Path(host_bundle["archive"]).is_file()
    native = run([bundle / "runtime" / "edgeq-run", "--self-test"], timeout=300, cwd=bundle)
    assert native.returncode == 0, tail(native)
    python = run([venv / "bin" / "python", bundle / "run.py", "--self-test"], timeout=300, cwd=bundle)
    assert python.returncode == 0, tail(python)
    verified = run([venv / "bin" / "edgeq", "verify", host_bundle["archive"]], timeout=300)  # safe unpacking
    assert verified.returncode == 0, tail(verified)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_serve_answers_a_bench(venv, host_bundle, tmp_path):
    """``edgeq rpc serve`` (what a JetPack 6 device runs, under its Python 3.10) starts, registers with a
    tracker and runs a remote benchmark; tracker, server and client are all this venv's edgeq."""
    edgeq = venv / "bin" / "edgeq"
    port = free_port()
    tracker = f"127.0.0.1:{port}"
    procs = {}
    try:
        for name, argv in (("tracker", ["rpc", "tracker", "--port", port, "--port-end", port + 1]),
                           ("serve", ["rpc", "serve", "--tracker", tracker, "--key", "install-test", "--port",
                                      free_port(), "--port-end", "65000", "--device-profile", "jetson-orin-nano",
                                      "--cuda-bridge", "off"])):
            with open(tmp_path / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen([str(edgeq), *map(str, argv)], stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True, env=clean_env())
        bench = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the server registers with the tracker after it starts
            bench = run([edgeq, "bench", host_bundle["archive"], "--rpc", tracker, "--key", "install-test",
                         "--repeat", "5", "--power", "none", "--timeout", "10", "--json"], timeout=120)
            if bench.returncode == 0 or any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(1)
        logs = "\n".join(f"{name}: {(tmp_path / f'{name}.log').read_text()[-2000:]}" for name in procs)
        assert all(p.poll() is None for p in procs.values()), f"tracker or server exited:\n{logs}"
        assert bench is not None and bench.returncode == 0, f"{tail(bench)}\n{logs}"
        out = json.loads(bench.stdout)
        assert out["runs"] == 5 and out["where"] == f"install-test via {tracker}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the server and the session processes it forked
            proc.wait()


def test_plain_install_packages_for_orin(venv, models, tmp_path, request):
    """``pip install .`` is enough for the main job: a Jetson Orin Nano bundle with sm_87 device code from the
    CUDA 12 NVRTC wheels (default dependencies, no extra). Checked with the interpreter running the tests."""
    if request.node.callspec.params["venv"] != THIS:
        pytest.skip(f"checked once, with the Python running the tests ({THIS})")
    proc = run([venv / "bin" / "edgeq", "package", models["resnet_cnn"], "--device", "jetson-orin-nano",
                "-o", tmp_path, "--json"], timeout=1800)
    assert proc.returncode == 0, tail(proc)
    result = json.loads(proc.stdout)
    assert result["cuda_toolkit"]["version"].startswith("12."), result["cuda_toolkit"]  # JetPack 6 runs CUDA 12
    # the CUDA 12 compiler came with the plain install (a machine with its own CUDA 12 nvcc may prefer that)
    wheels = run([venv / "bin" / "python", "-c", "import cuda.bindings.nvrtc, nvidia.cuda_nvrtc, nvidia.cuda_nvcc"],
                 timeout=120)
    assert wheels.returncode == 0, tail(wheels)
    from edgeq.backends.cuda.cubin import cuda_images

    assert [image.arch for image in cuda_images(Path(result["bundle_dir"], "model.so"))] == ["sm_87"]
    manifest = json.loads(Path(result["bundle_dir"], "manifest.json").read_text())
    assert manifest["library"]["cuda_device_code"] == ["sm_87"]
