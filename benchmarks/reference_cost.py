"""What the reference check costs: ``edgeq package`` of torchvision models for the host, fp32 and int8, with each
reference, in one run. The check is one stage (``reference``) after ``golden``; the build without it is every
other stage, timed in the same run (nothing else in the job changed with it).

    python benchmarks/reference_cost.py [resnet18 mobilenet_v2 ...] [--size 224] [--json]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import report

import zoo  # noqa: E402 - benchmarks/ is on sys.path when run as a script

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.quantize import QuantizeArgs  # noqa: E402


def one(model: Path, out: Path, precision: str, reference: str, calib: Path) -> dict:
    quantize = QuantizeArgs(calibrate=calib, samples=32) if precision == "int8" else None
    result = package(PackageArgs(model=model, device="host", output=out, precision=precision, quantize=quantize,
                                 runtime="none", reference=reference))
    check = result.manifest.reference_check
    seconds = result.stages["reference"]
    return {"model": model.stem, "precision": precision, "reference": check.reference,
            "package s": round(result.total_seconds, 2), "reference s": round(seconds, 2),
            "without the check s": round(result.total_seconds - seconds, 2),
            "cost": f"+{100 * seconds / (result.total_seconds - seconds):.0f}%",
            "largest |diff|": check.max_abs_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = zoo.export(args.models, Path(tmp), args.size)
        for name in args.models:
            model = paths[name]
            calib = Path(tmp, f"{name}-calib.npz")
            np.savez(calib, input=np.random.default_rng(0).standard_normal((32, 3, args.size, args.size)).astype(np.float32))
            for precision, references in (("fp32", ("auto", "tvm")), ("int8", ("auto",))):
                for reference in references:
                    rows.append(one(model, Path(tmp, "dist"), precision, reference, calib))
    report("edgeq package --device host: the reference check's cost", rows, args.json)


if __name__ == "__main__":
    main()
