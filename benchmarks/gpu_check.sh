#!/usr/bin/env bash
# The GPU path on a real GPU, in two halves, because a lent GPU machine has no network and no edgeq:
#
#   bash benchmarks/gpu_check.sh build SET           # here: package bundles for cuda-sm90 (H100/H200, CUDA 12
#                                                    # runtime through edgeq's bridge) and for the host CPU
#   bash benchmarks/gpu_check.sh run                 # on the GPU machine (device tool, carry gpu_check):
#                                                    # edgeq-run --check / --self-test / --benchmark per bundle,
#                                                    # GPU vs CPU ratios; nothing installed there
#
# The bundles are self-contained (runtime/: TVM runtime, CUDA 12 bridge, edgeq-run); the machine only needs
# its NVIDIA driver. libcudart.so.12 (NVIDIA's cu12 runtime wheel) travels in gpu_check/cudart/, standing in
# for JetPack 6's. One SET per device call keeps the carried folder under the device tool's 64 MiB:
#   small          the small CNN, fp32 and int8, GPU and CPU bundles (about 26 MB)
#   resnet18-fp32  ResNet-18 fp32, GPU bundle only (52 MB; its CPU bundle would not fit beside it)
#   resnet18-int8  ResNet-18 int8, GPU and CPU bundles (about 40 MB)
# Device call: run(command="bash benchmarks/gpu_check.sh run", carry=["gpu_check"], timeout_s=300).
# ONNX Runtime's CUDA provider cannot be installed on a machine without network; the ratios are against the
# same model's CPU bundle on that machine's CPU, and fp32 vs int8 across the two sets.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_DIR:-gpu_check}

build() {
    local set=${1:-small}
    local jobs
    case "$set" in
        small) jobs="small_cnn:fp32:cuda-sm90 small_cnn:fp32:host small_cnn:int8:cuda-sm90 small_cnn:int8:host" ;;
        resnet18-fp32) jobs="resnet18:fp32:cuda-sm90" ;;
        resnet18-int8) jobs="resnet18:int8:cuda-sm90 resnet18:int8:host" ;;
        *) echo "gpu_check: unknown set '$set' (small, resnet18-fp32, resnet18-int8)" >&2; exit 2 ;;
    esac
    local python=${PYTHON:-python3}
    rm -rf "$OUT" && mkdir -p "$OUT/models" "$OUT/cudart"
    "$python" - "$OUT/models" <<'EOF'
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, "examples")
import make_models

out = Path(sys.argv[1])
onnx.save(make_models.resnet_cnn(), out / "small_cnn.onnx")
onnx.save(make_models.resnet18(), out / "resnet18.onnx")
rng = np.random.default_rng(0)
np.savez(out / "calib_small_cnn.npz", input=rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
np.savez(out / "calib_resnet18.npz", input=rng.standard_normal((8, 3, 224, 224)).astype(np.float32))
EOF
    for job in $jobs; do
        IFS=: read -r model precision device <<< "$job"
        local extra=()
        [ "$precision" = int8 ] && extra=(--precision int8 --calibrate "$OUT/models/calib_$model.npz")
        echo "gpu_check: packaging $model $precision for $device"
        edgeq package "$OUT/models/$model.onnx" --device "$device" --name "$model-$precision" -o "$OUT" -q "${extra[@]}" >/dev/null
    done
    "$python" - "$OUT/cudart" <<'EOF'
import shutil, sys
from pathlib import Path
import nvidia.cuda_runtime
shutil.copy(Path(list(nvidia.cuda_runtime.__path__)[0], "lib", "libcudart.so.12"), sys.argv[1])
EOF
    rm -rf "$OUT"/models "$OUT"/*.tar.gz
    du -sh "$OUT"
}

run() {
    export EDGEQ_CUDART="$PWD/$OUT/cudart/libcudart.so.12"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    local results="$OUT/results.jsonl"
    : > "$results"
    for bundle in "$OUT"/*/; do
        bundle=${bundle%/}
        [ -x "$bundle/runtime/edgeq-run" ] || continue
        echo "== $(basename "$bundle")"
        "$bundle/runtime/edgeq-run" --check || { echo "check failed"; continue; }
        "$bundle/runtime/edgeq-run" --self-test || echo "SELF-TEST FAILED: $(basename "$bundle")"
        local stats
        stats=$("$bundle/runtime/edgeq-run" --benchmark 200 --warmup 20 --json) || continue
        echo "{\"bundle\": \"$(basename "$bundle")\", \"stats\": $stats}" >> "$results"
    done
    python3 - "$results" <<'EOF'
import json, sys
rows = {r["bundle"]: r["stats"] for r in map(json.loads, open(sys.argv[1]))}
print(f"{'bundle':34} {'p50 ms':>10} {'p99 ms':>9}   GPU speed-up vs CPU bundle")
for name, s in sorted(rows.items()):
    cpu = rows.get(name.replace("-cuda-sm90", "-host")) if name.endswith("-cuda-sm90") else None
    ratio = f"{cpu['p50_ms'] / s['p50_ms']:.1f}x" if cpu else ""
    print(f"{name:34} {s['p50_ms']:10.3f} {s['p99_ms']:9.3f}   {ratio}")
EOF
}

case "${1:-}" in
    build) build "${2:-small}" ;;
    run) run ;;
    *) echo "usage: $0 build small|resnet18-fp32|resnet18-int8 | run" >&2; exit 2 ;;
esac
