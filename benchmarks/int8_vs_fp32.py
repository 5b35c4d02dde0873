"""INT8 vs fp32 host bundles side by side: latency (median, same machine, one run), weight size, accuracy,
for the example models and the digits CNN. Also compares the calibration methods (--methods).

    python benchmarks/int8_vs_fp32.py [--repeat 100] [--methods] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from common import bundle_model, show

import make_models  # noqa: E402
import train_digits  # noqa: E402
from quantize_with_ort import ort_quantize  # noqa: E402

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.quantize import QuantizeArgs  # noqa: E402
from edgeq.quantize.calibrators import CALIBRATORS  # noqa: E402
from edgeq.tvm_env import import_tvm  # noqa: E402


def median_ms(model, repeat: int) -> float:
    spec = model.manifest.inputs[0]
    x = np.random.default_rng(0).standard_normal(spec.shape).astype(spec.dtype)
    return model.benchmark({spec.name: x}, repeat=repeat, warmup=10)["p50_ms"]


def datasets(tmp: Path) -> dict[str, tuple[Path, Path, Path | None]]:
    """model -> (onnx, calibration npz, evaluation npz)."""
    out = {}
    models = {p.stem: p for p in make_models.write_all(tmp / "models")}
    for name, path in models.items():
        shape = {"resnet_cnn": (3, 32, 32), "mobilenet_cnn": (3, 32, 32), "transformer_block": (16, 32)}[name]
        calib, held_out = tmp / f"{name}_calib.npz", tmp / f"{name}_eval.npz"
        np.savez(calib, input=np.random.default_rng(1).standard_normal((64, *shape)).astype(np.float32))
        np.savez(held_out, input=np.random.default_rng(2).standard_normal((32, *shape)).astype(np.float32))
        out[name] = (path, calib, held_out)
    digits = train_digits.write(tmp / "digits")
    out["digits_cnn"] = (digits["model"], digits["calib"], digits["test"])
    return out


def latency_rows(cases, tmp: Path, repeat: int) -> list[dict]:
    rows = []
    for name, (model, calib, held_out) in cases.items():
        fp32 = package(PackageArgs(model=model, device="host", output=tmp / "fp32"))
        int8 = package(PackageArgs(model=model, device="host", output=tmp / "int8", precision="int8",
                                   quantize=QuantizeArgs(calibrate=calib, eval=held_out)))
        qdq_model = ort_quantize(model, tmp / f"{name}_qdq.onnx")
        qdq = package(PackageArgs(model=qdq_model, device="host", output=tmp / "qdq"))
        f_ms, q_ms = median_ms(bundle_model(fp32.bundle_dir), repeat), median_ms(bundle_model(int8.bundle_dir), repeat)
        qdq_ms = median_ms(bundle_model(qdq.bundle_dir), repeat)
        ev = int8.manifest.quantization.evaluation
        rows.append({
            "model": name,
            "fp32_ms": round(f_ms, 3),
            "int8_ms": round(q_ms, 3),
            "int8_speedup": round(f_ms / q_ms, 2),
            "ort_qdq_model_ms": round(qdq_ms, 3),
            "qdq_speedup": round(f_ms / qdq_ms, 2),
            "weights_ratio": int8.manifest.quantization.weight_bytes.ratio,
            "cosine": round(ev["cosine"], 5),
            "top1_fp32": round(ev["top1_fp32"], 2) if "top1_fp32" in ev else "-",
            "top1_int8": round(ev["top1_quantized"], 2) if "top1_quantized" in ev else "-",
        })
    return rows


def method_rows(cases, tmp: Path) -> list[dict]:
    from edgeq.load import load_model
    from edgeq.quantize import quantize
    from edgeq.relax_import import to_relax

    rows = []
    for name, (model, calib, held_out) in cases.items():
        loaded = load_model(model)
        graph, _ = to_relax(loaded)
        row = {"model": name}
        for method in CALIBRATORS:
            ev = quantize(graph, loaded, QuantizeArgs(calibrate=calib, eval=held_out, method=method)).report.evaluation
            row[method] = round(ev["rel_error"], 4)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--methods", action="store_true", help="also compare calibration methods (relative output error)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import_tvm()
    with tempfile.TemporaryDirectory() as tmp:
        cases = datasets(Path(tmp))
        result = {"latency": latency_rows(cases, Path(tmp), args.repeat)}
        if args.methods:
            result["calibration_methods"] = method_rows(cases, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    show(f"host bundles, int8 vs fp32 (median of {args.repeat}, this machine)", result["latency"])
    if args.methods:
        show("calibration methods: relative output error on held-out data (lower is better)", result["calibration_methods"])


if __name__ == "__main__":
    main()
