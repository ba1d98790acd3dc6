#!/usr/bin/env bash
# Set up .venv with the test extras if needed, then run every check (scripts/check.sh: ruff, mypy,
# the fused kernels' build, the test suite, the docs site, the wheel smoke test; about 10 minutes on 2 cores).
# With arguments, only the test suite runs, with those pytest arguments: bash scripts/test.sh -k fantasy
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec bash scripts/check.sh
