"""What edgeq's device math costs (#63): each kernel kind's SASS under TVM's ``--use_fast_math`` against edgeq's
options (IEEE division and square root, no flushing, no contraction, the int8 SiLU through ``exp_rn``).

    python benchmarks/device_math.py [--arch sm_87] [--json]

Builds one module of representative kernels twice with the NVRTC 12.6 wheels (no GPU needed): ResNet's int8 3x3
with its residual and ReLU and the same without the residual, YOLO's and EfficientNet's int8 1x1 with SiLU, the int8 depthwise 3x3 with SiLU and
MobileNetV2's plain one, the fp16 3x3 with its residual and the fp16 1x1 with SiLU, and the int8 layer norm with
its per-token quantize. For each kernel: SASS instructions in all, the float instructions among them (FMUL, FADD,
FFMA, MUFU, FCHK, ...: the epilogue's arithmetic; the mainloops are integer and tensor-core instructions, which the
options do not touch), the ratio edgeq / TVM. A kernel runs its epilogue once per output element
and its mainloop K / tile-K times, so the whole-SASS ratio bounds what the options can cost it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels import kernel_sass, sass_by_kernel  # noqa: E402

FLOAT_OPS = ("FMUL", "FADD", "FFMA", "MUFU", "FCHK", "FSETP", "FMNMX", "FRND")


def kernels(arch: str):
    from edgeq.backends.cuda import cutlass, layer_norm
    from edgeq.targets import profiles

    spec = next(p for p in profiles().values() if p.cuda and p.cuda.arch == arch).cuda
    sms, smem = spec.sm_count, spec.shared_memory_per_block_optin

    def conv(name, n, h, c, k, r, precision, **kw):
        problem = cutlass.Conv2dProblem(n, h, h, c, k, r, r, (r // 2, r // 2), (1, 1), (1, 1))
        tile = cutlass.choose_tile(problem, sms, smem, precision)
        return cutlass.ConvKernel(name, problem, tile, precision=precision, **kw)

    def depthwise(name, precision, **kw):
        problem = cutlass.Conv2dProblem(1, 28, 28, 144, 144, 3, 3, (1, 1), (1, 1), (1, 1), groups=144)
        return cutlass.DepthwiseKernel(name, problem, None, precision=precision, **kw)

    convs = [
        conv("int8_3x3_residual_relu", 8, 14, 256, 256, 3, "int8", activation="relu", residual=True,
             residual_scale=0.5, act_lo=0.0, out_div=0.25),
        conv("int8_3x3_relu", 8, 14, 256, 256, 3, "int8", activation="relu", act_lo=0.0, out_div=0.25),
        conv("int8_1x1_silu", 1, 40, 64, 64, 1, "int8", out_div=0.25, silu=True),
        conv("fp16_3x3_residual_relu", 8, 14, 256, 256, 3, "fp16", activation="relu", residual=True),
        conv("fp16_1x1_silu", 1, 40, 64, 64, 1, "fp16", activation="silu"),
        depthwise("int8_depthwise_silu", "int8", activation="identity", out_div=0.05, silu=True),
        depthwise("int8_depthwise_relu6", "int8", activation="relu6", act_lo=0.0, act_hi=6.0, out_div=0.05),
    ]
    norms = [layer_norm.LayerNormKernel("int8_layer_norm", (1, 128, 384), 1e-12, (1, 128, 384), 127.0)]
    return convs, norms


def measure(arch: str, math, work: Path) -> dict[str, dict]:
    from edgeq.backends.cuda import cutlass, layer_norm
    from edgeq.toolchain import cuda_toolkits
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    toolkit = next(tk for tk in cuda_toolkits() if tk.kind == "nvrtc")
    work.mkdir(parents=True, exist_ok=True)
    convs, norms = kernels(arch)
    target = tvm.target.Target({"kind": "cuda", "arch": arch, "host": "llvm"})
    library, _ = cutlass.build_module(convs, target, toolkit, work, math=math)
    sass = sass_by_kernel(library)
    with toolkit.active(math), target:
        built = tvm.tirx.build(tvm.IRModule({k.function: layer_norm.prim_func(k) for k in norms}), target=target)
    built.export_library(str(work / "norms.so"))
    sass.update(sass_by_kernel(work / "norms.so"))
    rows = {}
    for k in [*convs, *norms]:
        code = kernel_sass(k.function, sass)
        ops = [(op, mods) for op, mods in re.findall(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", code) if op != "NOP"]
        rows[k.name] = {"instructions": len(ops),
                        "float": sum(op in FLOAT_OPS for op, _ in ops),
                        "ftz": sum(".FTZ" in mods for _, mods in ops),
                        "mufu": sum(op == "MUFU" for op, _ in ops)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_87", choices=["sm_87", "sm_90"])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    from edgeq.backends.cuda import device_math

    with tempfile.TemporaryDirectory() as tmp:
        fast = measure(args.arch, device_math.FAST, Path(tmp, "fast"))
        exact = measure(args.arch, device_math.EXACT, Path(tmp, "exact"))
    rows = [{"kernel": name, "arch": args.arch, "tvm_fast_math": fast[name], "edgeq": exact[name],
             "instructions_ratio": round(exact[name]["instructions"] / fast[name]["instructions"], 3)} for name in fast]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"| kernel ({args.arch}) | SASS instructions, TVM fast math | edgeq | ratio | float ops | MUFU | .FTZ |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f, e = r["tvm_fast_math"], r["edgeq"]
        print(f"| {r['kernel']} | {f['instructions']} | {e['instructions']} | {r['instructions_ratio']:.2f} | "
              f"{f['float']} -> {e['float']} | {f['mufu']} -> {e['mufu']} | {f['ftz']} -> {e['ftz']} |")


if __name__ == "__main__":
    main()
