"""A representative handful of the torchvision zoo, exported by torch.onnx (opset 17, random weights, eval,
batch 1) at 64x64 for CI time, through the same code as ``benchmarks/zoo.py``:

- ShuffleNetV2 (channel split through Shape/Slice arithmetic, channel shuffle via Reshape/Transpose);
- Swin-T (window partition through Shape -> Gather -> Div -> Reshape, 0-d constants, LayerNorm, GELU);
- MobileNetV3-Small (depthwise, squeeze-excitation, hard-swish / hard-sigmoid);
- GoogLeNet with torchvision's own init (activations shrink ~10x per layer: the int32 bias overflow case);
- DeepLabV3-MobileNetV3-Large (dilated backbone, atrous convolutions whose taps mostly read padding,
  computed region by region; the bilinear upsampling to the input's size on edgeq's resize kernel).

fp32 host bundles must match ONNX Runtime (|d| <= 1e-3 |ort| + 1e-4 max|ort|); int8 with 32 calibration
samples must keep output cosine >= 0.99 against fp32 ONNX Runtime.
"""

import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import zoo  # noqa: E402

SIZE = 64
FP32 = ["shufflenet_v2_x0_5", "swin_t", "mobilenet_v3_small", "googlenet", "deeplabv3_mobilenet_v3_large"]
INT8 = ["shufflenet_v2_x0_5", "mobilenet_v3_small", "googlenet", "deeplabv3_mobilenet_v3_large"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not zoo.EXPORT_PYTHON.exists():
        pytest.fail(f"{zoo.EXPORT_PYTHON} is missing: run 'bash scripts/setup.sh --zoo' (makes the torch export environment)")
    out = tmp_path_factory.mktemp("zoo")
    proc = subprocess.run([str(zoo.EXPORT_PYTHON), str(REPO / "examples" / "export_torchvision.py"), "-o", str(out),
                           "--size", str(SIZE), *FP32], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {name: out / f"{name}-{SIZE}.onnx" for name in FP32}


@pytest.mark.slow
@pytest.mark.parametrize("name", FP32)
def test_fp32_matches_onnxruntime(exported, tmp_path, name):
    row = zoo.one(exported[name], tmp_path, int8=name in INT8, jetson=False, speed=False, repeat=1)
    assert row["fp32"] == "match", row
    if name in INT8:
        assert row.get("int8") == "ok", row
        assert row["int8_cosine"] >= 0.99, row


@pytest.mark.slow
def test_jetson_orin_nano_build(exported, tmp_path):
    """The same export cross-compiles for the Orin (aarch64 host code, sm_87 device code)."""
    from edgeq.package import PackageArgs, package

    result = package(PackageArgs(model=exported["shufflenet_v2_x0_5"], device="jetson-orin-nano", output=tmp_path,
                                 runtime="none"))
    library = result.manifest.library
    assert library.machine == "aarch64" and "sm_87" in library.cuda_device_code, library
