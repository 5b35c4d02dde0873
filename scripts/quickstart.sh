#!/usr/bin/env bash
# Set up, make the example models, package one for a Jetson Orin Nano and for this machine, and run the
# host bundle's self-test and a short benchmark. Everything runs from .venv (made by scripts/setup.sh), never
# another python or edgeq on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
edgeq=.venv/bin/edgeq
"$py" examples/make_models.py -o examples/models
"$edgeq" package examples/models/resnet_cnn.onnx --device jetson-orin-nano -o dist
"$edgeq" package examples/models/resnet_cnn.onnx --device host -o dist
dist/resnet_cnn-host/runtime/edgeq-run --self-test          # the native loader: no Python needed
"$py" dist/resnet_cnn-host/run.py --self-test
"$py" dist/resnet_cnn-host/run.py --benchmark 50
"$edgeq" inspect dist/resnet_cnn-jetson-orin-nano
