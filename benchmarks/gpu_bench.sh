#!/usr/bin/env bash
# edgeq's GPU path on a lent GPU against PyTorch, in one device call (#42): see benchmarks/gpu_bench.py.
#   bash benchmarks/gpu_bench.sh build [DIR] [--set verify|compare]   # here, in the .venv: bundles for cuda-sm90, xz (gpu_bench/)
#   bash benchmarks/gpu_bench.sh run [DIR]     # on the GPU machine: run(command="bash benchmarks/gpu_bench.sh run",
#                                              #   carry=["gpu_bench"], timeout_s=570); JSON under $OUT, with
#                                              #   gpu_verified.json: the kernel kinds that passed
#   bash benchmarks/gpu_bench.sh ledger FILE   # here: a run's gpu_verified.json into edgeq's ledger (--gpu-kernels auto)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    build) exec "${PYTHON:-python3}" benchmarks/gpu_bench.py build "${2:-gpu_bench}" "${@:3}" ;;
    run|profile) PYTHONUNBUFFERED=1 exec python3 benchmarks/gpu_bench.py "$1" "${2:-gpu_bench}" "${@:3}" ;;
    ledger) exec "${PYTHON:-python3}" benchmarks/gpu_bench.py ledger "${2:?give the gpu_verified.json of a run}" ;;
    *) echo "usage: $0 build|run|profile [DIR] | ledger FILE" >&2; exit 2 ;;
esac
