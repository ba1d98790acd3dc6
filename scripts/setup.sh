#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and gpfalkon installed in editable mode.
# Usage: bash scripts/setup.sh [extras]   e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: this machine serves the 2.13.0 CPU wheel from local disk;
# an unpinned torch could pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  .venv/bin/pip install --quiet "torch==2.13.0"
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
stamp=".venv/.gpfalkon-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet -e "$spec"
  touch "$stamp"
fi
# build (or load from torch's extension cache) the fused stored-K CPU kernel now rather than in the
# first fit; where it cannot be built, gpfalkon uses its torch path and this prints why
.venv/bin/python -c "from gpfalkon.backend.fused import fused_available; ok, why = fused_available(); print('gpfalkon fused CPU kernel:', 'ready' if ok else why)"
