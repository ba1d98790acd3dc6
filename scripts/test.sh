#!/usr/bin/env bash
# Set up .venv if needed and run the test suite (about 2 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
