#!/usr/bin/env bash
# Every check CI runs, in order: lint (ruff), types (mypy), the fused CPU kernels' build, the test suite, the
# documentation site, the wheel smoke test.
# Usage: bash scripts/check.sh   (after scripts/setup.sh test; about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff check"
.venv/bin/ruff check gpfalkon tests benchmarks examples docs
echo "== mypy"
.venv/bin/mypy
echo "== fused CPU kernels build (where a C++ compiler and ninja are present; else their tests skip)"
.venv/bin/python - <<'PY'
import os, shutil, sys
from torch.utils.cpp_extension import is_ninja_available
from gpfalkon.backend.fused import fused_available
if os.environ.get("GPFALKON_FUSED_CPU", "1") == "0" or not (shutil.which(os.environ.get("CXX", "c++")) and is_ninja_available()):
    print("no compiler or ninja here (or turned off): the kernels' tests will skip")
else:
    ok, why = fused_available()
    print("built" if ok else f"FAILED: {why}")
    sys.exit(0 if ok else 1)
PY
echo "== pytest"
.venv/bin/python -m pytest -q
echo "== documentation site (strict: warnings and broken links fail)"
NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true .venv/bin/mkdocs build --strict --quiet
echo "== wheel smoke test"
bash scripts/wheel_smoke.sh
