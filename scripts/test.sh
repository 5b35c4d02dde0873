#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --zoo
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m pytest -q "$@"
