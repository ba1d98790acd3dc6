#!/usr/bin/env bash
# Every check CI runs, in order: lint (ruff), types (mypy), the test suite, the wheel smoke test.
# Usage: bash scripts/check.sh   (after scripts/setup.sh test; about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff check"
.venv/bin/ruff check gpfalkon tests benchmarks examples
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest -q
echo "== wheel smoke test"
bash scripts/wheel_smoke.sh
