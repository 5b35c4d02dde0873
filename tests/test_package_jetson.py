"""Jetson bundles: aarch64 host code from the Debian cross compiler, real device code for the profile's
SM architecture from the CUDA toolkit that matches the device's JetPack."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli, run_py
from edgeq.backends.cuda.cubin import cuda_images, cuda_tool




@pytest.fixture(scope="module")
def orin_bundle(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("orin")
    res = run_cli("package", models["resnet_cnn"], "--device", "jetson-orin-nano", "-o", out, "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def test_orin_library_is_aarch64_elf(orin_bundle):
    library = Path(orin_bundle["bundle_dir"], "model.so")
    readelf = shutil.which("aarch64-linux-gnu-readelf") or shutil.which("readelf")
    header = subprocess.run([readelf, "-h", str(library)], capture_output=True, text=True, check=True).stdout
    assert "AArch64" in header and "DYN (Shared object file)" in header


def test_orin_library_carries_sm87_device_code(orin_bundle, tmp_path):
    library = Path(orin_bundle["bundle_dir"], "model.so")
    images = cuda_images(library)
    assert [image.arch for image in images] == ["sm_87"]
    cubin = tmp_path / "kernels.cubin"
    cubin.write_bytes(images[0].data)
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    listing = subprocess.run([cuobjdump, "-lelf", str(cubin)], capture_output=True, text=True)
    assert listing.returncode == 0 and "sm_87" in listing.stdout, listing.stderr
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ['PATH']}"}
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert sass.returncode == 0, sass.stderr
    # Real machine code: kernel functions with SASS instructions (global loads, fused multiply-adds of the convs).
    assert "Function : " in sass.stdout and "LDG" in sass.stdout and "FFMA" in sass.stdout


def test_orin_manifest_records_the_toolkit_and_target(orin_bundle):
    m = json.loads(Path(orin_bundle["bundle_dir"], "manifest.json").read_text())
    toolkit = m["toolchain"]["cuda_toolkit"]
    assert toolkit["version"].startswith("12.")  # JetPack 6 runs CUDA 12: a CUDA 13 cubin would not load
    assert m["device"]["cuda_arch"] == "sm_87" and m["device"]["mcpu"] == "cortex-a78ae"
    assert m["device"]["cuda_version"] == "12.6" and m["device"]["jetpack"] == "6.2"
    assert m["library"]["machine"] == "aarch64" and m["library"]["cuda_device_code"] == ["sm_87"]
    assert "aarch64-linux-gnu-g++" in m["toolchain"]["cxx"]
    assert orin_bundle["cuda_toolkit"] == toolkit


def test_orin_loader_refuses_this_x86_machine(orin_bundle):
    if os.uname().machine == "aarch64":
        pytest.skip("this machine is aarch64")
    proc = run_py(Path(orin_bundle["bundle_dir"]), "--self-test")
    assert proc.returncode == 4  # contract.LoaderExit.DEVICE
    assert proc.stderr.strip().splitlines() == [
        f"run.py: error: this bundle is for aarch64 (jetson-orin-nano) but this machine is {os.uname().machine}"
    ]


def test_family_alias_builds_the_default_profile(models, tmp_path):
    res = run_cli("package", models["transformer_block"], "--device", "jetson-orin", "-o", tmp_path, "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["device"] == "jetson-orin-nano"
    assert "'jetson-orin' is an alias" in res.stderr and "jetson-orin-nano" in res.stderr


@pytest.mark.slow
def test_thor_uses_cuda13_and_sm110(models, tmp_path):
    res = run_cli("package", models["mobilenet_cnn"], "--device", "jetson-agx-thor", "-o", tmp_path, "--json")
    if res.code == 5 and "CUDA 13" in res.stderr:
        pytest.skip("no CUDA 13 nvcc on this machine")
    assert res.code == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["cuda_toolkit"]["version"].startswith("13.")
    assert [i.arch for i in cuda_images(Path(result["bundle_dir"], "model.so"))] == ["sm_110"]


def test_arm64_cpu_bundle_is_aarch64_without_cuda(models, tmp_path):
    res = run_cli("package", models["mobilenet_cnn"], "--device", "arm64-cpu", "-o", tmp_path, "--json")
    assert res.code == 0, res.stderr
    m = json.loads(Path(json.loads(res.stdout)["bundle_dir"], "manifest.json").read_text())
    assert m["library"]["machine"] == "aarch64" and m["library"]["cuda_device_code"] == []
    assert m["toolchain"]["cuda_toolkit"] is None


def test_python_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "edgeq", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("edgeq ")
