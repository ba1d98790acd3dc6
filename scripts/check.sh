#!/usr/bin/env bash
# Every check CI runs, in order: lint (ruff), types (mypy), the test suite, the documentation site,
# the wheel smoke test.
# Usage: bash scripts/check.sh   (after scripts/setup.sh test; about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff check"
.venv/bin/ruff check gpfalkon tests benchmarks examples docs
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest -q
echo "== documentation site (strict: warnings and broken links fail)"
NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true .venv/bin/mkdocs build --strict --quiet
echo "== wheel smoke test"
bash scripts/wheel_smoke.sh
