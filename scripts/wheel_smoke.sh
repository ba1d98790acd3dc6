#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment outside the checkout, and run a
# short fit + predict + BoTorch posterior from the installed package (not from the source tree).
# Usage: bash scripts/wheel_smoke.sh   (after scripts/setup.sh; about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpfalkon-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# the wheel, built with the project's own setuptools (no network needed for the build)
.venv/bin/python -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$repo"
wheel="$(ls "$work"/dist/gpfalkon-*.whl)"
.venv/bin/python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "gpfalkon/py.typed" in names, "the wheel lacks the py.typed marker"
assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/"))], "the wheel ships non-package files"
print(f"wheel: {sys.argv[1].rsplit('/', 1)[-1]}, {sum(n.endswith('.py') for n in names)} modules, py.typed present")
PY
# a fresh environment: the pinned CPU torch first (never a CUDA build), then the wheel and its dependencies
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "torch==2.13.0"
"$work/venv/bin/pip" install --quiet "$wheel"
cd "$work"  # outside the checkout: the import must come from the installed wheel
"$work/venv/bin/python" - "$repo" <<'PY'
import pathlib, sys

import torch

import gpfalkon
from gpfalkon import FalkonGP
from gpfalkon.botorch import FalkonModel

repo = pathlib.Path(sys.argv[1]).resolve()
where = pathlib.Path(gpfalkon.__file__).resolve()
assert repo not in where.parents, f"gpfalkon was imported from the checkout ({where})"
assert (where.parent / "py.typed").exists()
g = torch.Generator().manual_seed(0)
x = torch.rand(500, 3, generator=g, dtype=torch.float64)
y = torch.sin(4 * x[:, 0]) + x[:, 1] + 0.05 * torch.randn(500, generator=g, dtype=torch.float64)
model = FalkonGP(x, y, num_centers=50, penalty=1e-4).fit().eval()
with torch.no_grad():
    pred = model(x[:20])
err = float((pred.mean - y[:20]).abs().max())
assert err < 0.5 and bool((pred.variance > 0).all()), (err, pred.variance)
post = FalkonModel(x, y.unsqueeze(-1), num_centers=50).posterior(torch.rand(4, 2, 3, dtype=torch.float64))
assert post.mean.shape == (4, 2, 1)
print(f"installed gpfalkon {gpfalkon.__version__} from {where.parent}: fit + predict + BoTorch posterior ok")
PY
