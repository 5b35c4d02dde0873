#!/usr/bin/env bash
# Set up with what only the tests use (idempotent), then run the whole test suite with .venv's Python (PYTHON=python3.X picks the
# interpreter .venv is made from; see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests --zoo
# Two workers (pytest-xdist; EDGEQ_TEST_WORKERS=N for another count, 0 for none): most tests wait on a
# compiler, a subprocess or a loopback server part of the time, so two share the 2 cores of a small machine
# well (the suite from a fresh clone on 2 cores: about 45 min in two workers, 2026-12-07).
exec .venv/bin/python -m pytest -q -n "${EDGEQ_TEST_WORKERS:-2}" --dist worksteal "$@"
