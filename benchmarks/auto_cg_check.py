"""Does the final CG iteration cap limit auto_fit? Refit its model to a tight tolerance and compare.

Usage (from the repository root): ``.venv/bin/python benchmarks/auto_cg_check.py [datasets...]``
(default: the development sets cpusmall powerplant). Prints, per dataset, the test NRMSE of
``auto_fit(budget=60, dtype=float64)`` and of the same model refitted with ``tol=1e-8,
max_iter=1000``, with the CG iterations of each. Results: ``benchmarks/results/auto-notes.md``.
"""
from __future__ import annotations

import pathlib
import sys
import time

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import auto_fit

from compare import load_dataset


def _nrmse(model, data) -> float:
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        p = model(data["xte"].double()).mean.numpy()
    yte = data["yte"].double().numpy()
    return float(np.sqrt(np.mean((p - yte) ** 2)) * data["y_scale"] / data["y_test_std"])


def main() -> None:
    for name in sys.argv[1:] or ["cpusmall", "powerplant"]:
        data = load_dataset(name)
        m = auto_fit(data["xtr"].double(), data["ytr"].double(), budget=60, dtype=torch.float64)
        e_cap, it_cap = _nrmse(m, data), m.fit_info.iterations
        t0 = time.perf_counter()
        m.train()
        m.fit(tol=1e-8, max_iter=1000)
        print(f"{name}: NRMSE {e_cap:.5f} ({it_cap} iterations, auto_fit's cap) -> {_nrmse(m, data):.5f} "
              f"({m.fit_info.iterations} iterations, tol 1e-8, {time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
