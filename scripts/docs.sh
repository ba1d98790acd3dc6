#!/usr/bin/env bash
# The documentation site (mkdocs-material + mkdocstrings): set up .venv with the docs extras if
# needed, then build it in strict mode (warnings and broken links fail) into build/site, or serve it.
# Usage: bash scripts/docs.sh [build|serve]     (serve: http://127.0.0.1:8000, rebuilt on changes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh docs
export NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true  # theme / plugin banners, not build warnings
case "${1:-build}" in
  build) exec .venv/bin/mkdocs build --strict ;;
  serve) exec .venv/bin/mkdocs serve --strict ;;
  *) echo "usage: bash scripts/docs.sh [build|serve]" >&2; exit 2 ;;
esac
