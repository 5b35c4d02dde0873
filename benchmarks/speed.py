"""Speed, side by side in one run: edgeq fp32 / int8 host bundles against ONNX Runtime fp32 / int8 QDQ.

Models (random weights): ResNet-18 224x224 at batch 1 and 8, a MobileNet-style CNN (depthwise-separable
blocks, ReLU6) at 224x224, and a transformer encoder block (seq 128, dim 256). Every case is built first;
then the runners are timed in interleaved rounds (per round and runner: a 0.2 s pause and 2 untimed
calls, so that the threads of the runtime that ran before have gone quiet, then 5 timed calls), so a
noisy machine slows all of them alike, and the median per runner is reported. Also reported: the
conv/matmul layers of the fp32 ResNet-18 bundle, timed inside the bundle's VM, as GFLOP/s and as a fraction
of the CPU's FP32 peak.

    python benchmarks/speed.py [--rounds 10] [--models resnet18 resnet18_b8 mobilenet transformer] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from common import bundle_model, ort_session, show

import make_models  # noqa: E402
from quantize_with_ort import ort_quantize  # noqa: E402

from edgeq.package import PackageArgs, package  # noqa: E402
from edgeq.quantize import QuantizeArgs  # noqa: E402
from edgeq.tvm_env import import_tvm  # noqa: E402

WARMUP, BLOCK = 2, 5  # per runner and round: untimed calls, then timed calls

MODELS = {
    "resnet18": lambda: make_models.resnet18(batch=1),
    "resnet18_b8": lambda: make_models.resnet18(batch=8),
    "mobilenet": lambda: make_models.mobilenet_cnn(size=224, width=32),
    "transformer": lambda: make_models.transformer_block(seq=128, dim=256, heads=4),
}


def cpu_peak_gflops(cores: int) -> dict:
    """FP32 peak of this CPU by the issue's definition (cores x 32 FLOP/cycle x clock: two AVX2 FMA units)
    and with AVX-512 (cores x 64), from the clock /proc/cpuinfo reports."""
    mhz = 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                mhz = max(mhz, float(line.split(":")[1]))
    except OSError:
        pass
    ghz = mhz / 1000
    return {"clock_ghz": round(ghz, 3), "cores": cores, "avx2_peak_gflops": round(cores * 32 * ghz, 1),
            "avx512_peak_gflops": round(cores * 64 * ghz, 1)}


def layer_flops(model_path: Path) -> float:
    """FLOPs of the model's Conv, MatMul and Gemm nodes (2 per multiply-add)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    total = 0.0
    for node in model.graph.node:
        if node.op_type == "Conv":
            w = inits[node.input[1]]
            out = shapes[node.output[0]]
            total += 2 * np.prod(out) * np.prod(w[1:])
        elif node.op_type in ("MatMul", "Gemm") and node.input[1] in inits:
            k = inits[node.input[1]][0]
            total += 2 * np.prod(shapes[node.output[0]]) * k
    return float(total)


def layer_time_ms(model, x: np.ndarray, calls: int = 10) -> float:
    """Time spent in edgeq's conv/matmul kernels (fused with their epilogues) per inference, measured by
    the bundle's VM instrument around every kernel call."""
    spent, start = [0.0], {}

    def instrument(func, name, before, ret, *args):
        if "edgeq_conv2d" in name or "edgeq_dwconv2d" in name:
            if before:
                start[name] = time.perf_counter()
            else:
                spent[0] += time.perf_counter() - start[name]
        return 0

    model.vm.set_instrument(instrument)
    try:
        for _ in range(calls):
            model.run({"input": x})
    finally:
        model.vm.set_instrument(lambda *a: 0)
    return spent[0] / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (edgeq uses every CPU)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import_tvm()
    cores = len(os.sched_getaffinity(0))
    rows, efficiency = [], None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = []
        for name in args.models:
            proto = MODELS[name]()
            path = tmp / f"{name}.onnx"
            onnx.save(proto, path)
            spec = proto.graph.input[0].type.tensor_type.shape
            shape = [d.dim_value for d in spec.dim]
            calib = tmp / f"{name}_calib.npz"
            np.savez(calib, input=np.random.default_rng(1).standard_normal([max(16, shape[0])] + shape[1:]).astype(np.float32))
            qdq = ort_quantize(path, tmp / f"{name}_qdq.onnx", samples=4)
            fp32 = package(PackageArgs(model=path, device="host", output=tmp / f"{name}_fp32"))
            int8 = package(PackageArgs(model=path, device="host", output=tmp / f"{name}_int8", precision="int8",
                                       quantize=QuantizeArgs(calibrate=calib, samples=max(16, shape[0]))))
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            m32, m8 = bundle_model(fp32.bundle_dir), bundle_model(int8.bundle_dir)
            s32, s8 = ort_session(path, args.threads), ort_session(qdq, args.threads)
            runners = {
                "edgeq_fp32": lambda m=m32, x=x: m.run({"input": x}),
                "edgeq_int8": lambda m=m8, x=x: m.run({"input": x}),
                "ort_fp32": lambda s=s32, x=x: s.run(None, {"input": x}),
                "ort_int8_qdq": lambda s=s8, x=x: s.run(None, {"input": x}),
            }
            cases.append((name, shape, runners))
            if name == "resnet18":
                flops = layer_flops(path)
                ms = layer_time_ms(m32, x)
                peak = cpu_peak_gflops(cores)
                gflops = flops / ms / 1e6
                efficiency = {"model": "resnet18 fp32, conv + gemm layers in the bundle", "gflop": round(flops / 1e9, 3),
                              "layer_ms": round(ms, 3), "gflops": round(gflops, 1), **peak,
                              "of_avx2_peak": round(gflops / peak["avx2_peak_gflops"], 3) if peak["clock_ghz"] else None,
                              "of_avx512_peak": round(gflops / peak["avx512_peak_gflops"], 3) if peak["clock_ghz"] else None}
        for name, shape, runners in cases:
            times = {k: [] for k in runners}
            for _ in range(args.rounds):
                for key, run in runners.items():
                    time.sleep(0.2)  # the other runtime's threads may still be spinning (see zoo.interleaved)
                    for _ in range(WARMUP):
                        run()
                    for _ in range(BLOCK):
                        start = time.perf_counter()
                        run()
                        times[key].append((time.perf_counter() - start) * 1e3)
            r = {"model": name, "batch": shape[0], **{f"{k}_ms": float(np.median(v)) for k, v in times.items()}}
            r.update(int8_vs_fp32=r["edgeq_fp32_ms"] / r["edgeq_int8_ms"],
                     fp32_vs_ort=r["ort_fp32_ms"] / r["edgeq_fp32_ms"],
                     int8_vs_ort_int8=r["ort_int8_qdq_ms"] / r["edgeq_int8_ms"])
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    if args.json:
        print(json.dumps({"rows": rows, "layer_efficiency": efficiency, "rounds": args.rounds,
                          "ort_threads": args.threads, "cpus": cores}, indent=2))
        return
    show(f"median ms over {args.rounds} interleaved rounds of {BLOCK} calls (ratios > 1: edgeq faster); ORT {args.threads} threads", rows)
    if efficiency:
        show("conv/gemm layers of the fp32 ResNet-18 bundle, timed in the bundle's VM", [efficiency])


if __name__ == "__main__":
    main()
