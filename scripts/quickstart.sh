#!/usr/bin/env bash
# Set up .venv if needed and run the quickstart: FalkonGP on the embedded protein dataset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
