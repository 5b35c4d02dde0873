"""SHA-256 of what the test models' bundles ship, for a refactor that must not change them (#65, item 6).

    .venv/bin/python scripts/bundle_digests.py OUT.json [--work DIR] [--only NAME ...]

Packages a small ResNet (host fp32 and int8; jetson-orin-nano fp16 and int8, on dlight and on CUTLASS), the
BERT-style encoder, the small MobileNetV2 and EfficientNet-B0 (CUTLASS, fp16 and int8) with the models and
calibration data the tests use, and writes each bundle's digests of model.so, weights.bin, golden.bin and the
loaders (run.py and its modules, runtime/edgeq-run). Run it before and after a change and compare the two files:
``cmp before.json after.json``. The manifest is left out: it records the build's time and host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "examples")]

SHIPPED = ("model.so", "weights.bin", "golden.bin", "run.py", "contract.py", "imaging.py", "video.py",
           "safebundle.py", "runtime/edgeq-run")
MOBILENET = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 1, 2))  # tests/test_cutlass.py's
EFFICIENTNET = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 1))


def models(work: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (ONNX file, input shape) as the tests build them."""
    from gpu_kernels import bert_encoder, efficientnet_b0, mobilenet_v2
    from test_gpu_path import resnet

    return {
        "resnet": (resnet(work / "resnet.onnx", size=32, widths=(16, 32), blocks=1, stem=3,
                          activations=("Relu", "Relu6")), (3, 32, 32)),
        "bert": (bert_encoder(work / "bert.onnx", seq=16, hidden=64, heads=2, layers=1), (1, 16, 64)),
        "mobilenet": (mobilenet_v2(work / "m.onnx", size=32, classes=16, settings=MOBILENET, last=64), (3, 32, 32)),
        "efficientnet": (efficientnet_b0(work / "e.onnx", size=32, classes=16, settings=EFFICIENTNET), (3, 32, 32)),
    }


CONFIGS = [  # (model, device, precision, gpu kernels or None)
    ("resnet", "host", "fp32", None), ("resnet", "host", "int8", None),
    ("resnet", "jetson-orin-nano", "fp16", None), ("resnet", "jetson-orin-nano", "int8", None),
    ("resnet", "jetson-orin-nano", "fp16", "cutlass"), ("resnet", "jetson-orin-nano", "int8", "cutlass"),
    ("bert", "jetson-orin-nano", "fp16", "cutlass"), ("bert", "jetson-orin-nano", "int8", "cutlass"),
    ("mobilenet", "jetson-orin-nano", "fp16", "cutlass"), ("mobilenet", "jetson-orin-nano", "int8", "cutlass"),
    ("efficientnet", "jetson-orin-nano", "fp16", "cutlass"), ("efficientnet", "jetson-orin-nano", "int8", "cutlass"),
]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bundle-digests"))
    parser.add_argument("--only", nargs="*", default=None, help="configurations whose name starts with one of these")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    found = models(args.work)
    result = {}
    for name, device, precision, kernels in CONFIGS:
        key = f"{name}-{device}-{precision}" + (f"-{kernels}" if kernels else "")
        if args.only and not any(key.startswith(o) for o in args.only):
            continue
        model, shape = found[name]
        out = args.work / key
        cmd = [sys.executable, "-m", "edgeq", "package", str(model), "--device", device, "--precision", precision,
               "-o", str(out), "-q", "--json"]
        if kernels:
            cmd += ["--gpu-kernels", kernels]
        if precision == "int8":
            calib = args.work / f"calib-{name}.npz"
            np.savez(calib, input=np.random.default_rng(0).standard_normal((10, *shape)).astype(np.float32))
            cmd += ["--calibrate", str(calib)]
        print(key, flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return 1
        bundle = Path(json.loads(res.stdout)["bundle_dir"])
        result[key] = {f: digest(bundle / f) for f in SHIPPED}
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
