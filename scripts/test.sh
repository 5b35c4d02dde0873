#!/usr/bin/env bash
# Set up with what only the tests use (idempotent), then run the whole test suite with .venv's Python (PYTHON=python3.X picks the
# interpreter .venv is made from; see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests --zoo
exec .venv/bin/python -m pytest -q "$@"
