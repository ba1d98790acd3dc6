"""Is auto_fit limited by where its centers are, or by how many? A diagnosis, not a benchmark of record.

Usage (from the repository root): ``.venv/bin/python benchmarks/auto_centers_check.py [--budget S] [datasets...]``
(default: the development sets cpusmall powerplant, budget 60). Per dataset: ``auto_fit(budget=S)`` on
the training split, then the returned model's kernel and penalty refitted on the same rows with

* the same number ``M`` of uniform centers (a fresh draw: the spread of uniform draws),
* ``M`` centers by approximate ridge-leverage scores (BLESS, ``leverage_centers``, preconditioner weights ``D``),
* ``2 M`` uniform centers,

printing the test NRMSE and fit seconds of each. Where leverage centers beat a fresh uniform draw by more
than the draws differ, auto_fit's uniform centers are what limits it there. Results:
``benchmarks/results/auto-notes.md``.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP, auto_fit, leverage_centers

from compare import load_dataset, metrics, predict_chunks


def _nrmse(model: FalkonGP, data: dict) -> float:
    """Test NRMSE as compare.py scores every method (``metrics`` on standardised predictions)."""
    model.eval()
    x = data["xte"].to(model.train_inputs[0].dtype)
    return metrics(data, predict_chunks(model.posterior_mean, x).numpy())["error"]


def _refit(base: FalkonGP, centers: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[FalkonGP, float]:
    t0 = time.perf_counter()
    m = FalkonGP(base.train_inputs[0], base.train_targets, kernel=base.kernel, centers=centers, center_weights=weights,
                 penalty=base.penalty.detach(), mean_constant=base.mean_constant, max_iter=base.max_iter, tol=base.tol)
    m.fit()
    return m, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("datasets", nargs="*", default=["cpusmall", "powerplant"])
    ap.add_argument("--budget", type=float, default=60.0)
    args = ap.parse_args()
    for name in args.datasets:
        data = load_dataset(name)
        t0 = time.perf_counter()
        m = auto_fit(data["xtr"], data["ytr"], budget=args.budget, seed=0)
        t_auto = time.perf_counter() - t0
        x = m.train_inputs[0]
        n, big_m = x.shape[0], int(m.centers.shape[0])
        g = torch.Generator().manual_seed(1)
        rows = [f"auto_fit (M {big_m}, uniform, seed 0): {_nrmse(m, data):.5f} in {t_auto:.1f} s"]
        uni, s = _refit(m, x[torch.randperm(n, generator=g)[:big_m]])
        rows.append(f"uniform M {big_m}, another draw: {_nrmse(uni, data):.5f} ({s:.1f} s)")
        t1 = time.perf_counter()
        sel = leverage_centers(x, big_m, m.kernel, float(m.penalty.detach()), generator=g)
        t_sel = time.perf_counter() - t1
        lev, s = _refit(m, sel.centers, sel.weights)
        rows.append(f"leverage M {sel.centers.shape[0]} (of {big_m} draws): {_nrmse(lev, data):.5f} "
                    f"({t_sel:.1f} s scores + {s:.1f} s fit)")
        two = min(n, 2 * big_m)
        dbl, s = _refit(m, x[torch.randperm(n, generator=g)[:two]])
        rows.append(f"uniform M {two}: {_nrmse(dbl, data):.5f} ({s:.1f} s)")
        print(f"{name}: " + "; ".join(rows), flush=True)


if __name__ == "__main__":
    main()
