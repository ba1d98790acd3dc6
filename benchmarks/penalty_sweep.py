"""A penalty sweep at fixed kernel and centers, with and without ``FactorCache``.

``auto_fit``'s noise searches refit one kernel and one set of centers at several penalties. With
``FalkonOptions(preconditioner=FactorCache())`` the preconditioner's penalty-free factor (``T`` and
``T T^T / M``) is computed once per sweep. For each M: ``n`` rows of a synthetic problem
(d = 8, ``sin`` of a sum of 4 coordinates plus noise, float32 data, RBF kernel, lengthscale 1.5), the
M first rows as centers, FalkonGP fits (CG, default tolerance) at the penalties ``--penalties`` (times
1/n), first without the cache (a fresh preconditioner each fit), then with one. Seconds = wall time
of the whole sweep (construction + fit() of each model); 'same alpha' checks the two sweeps' solutions
are bit for bit equal.

    .venv/bin/python benchmarks/penalty_sweep.py --out benchmarks/results/penalty-sweep.md
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FactorCache, FalkonGP, FalkonOptions

from _common import environment_lines, log, markdown_table, write_result


def sweep(x, y, kernel, centers, penalties, cache: FactorCache | None) -> tuple[float, list[torch.Tensor], list[int]]:
    n = x.shape[0]
    opts = FalkonOptions(solve_method="cg", preconditioner=cache)
    alphas, iters = [], []
    gc.collect()
    t0 = time.perf_counter()
    for p in penalties:
        model = FalkonGP(x, y, kernel=kernel, centers=centers, penalty=p / n, options=opts).fit()
        alphas.append(model.alpha.detach().clone())
        iters.append(model.fit_info.iterations)
        del model
    return time.perf_counter() - t0, alphas, iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--m", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    ap.add_argument("--penalties", type=float, nargs="+", default=[1e-1, 5e-2, 2.5e-2, 1.25e-2])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/penalty-sweep.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, 8, generator=g)
    y = torch.sin(x[:, :4].sum(-1)) + 0.1 * torch.randn(args.n, generator=g)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=8))
    kernel.base_kernel.lengthscale = 1.5
    rows = []
    for m in args.m:
        centers = x[:m].clone()
        t_off, a_off, it = sweep(x, y, kernel, centers, args.penalties, None)
        cache = FactorCache()
        t_on, a_on, _ = sweep(x, y, kernel, centers, args.penalties, cache)
        same = all(torch.equal(a, b) for a, b in zip(a_off, a_on, strict=True))
        rows.append([m, len(args.penalties), "/".join(map(str, it)), t_off, t_on, t_off / t_on,
                     f"{cache.hits}/{cache.misses}", same])
        log(f"M={m}: without {t_off:.2f} s, with FactorCache {t_on:.2f} s ({t_off / t_on:.2f}x), same alpha {same}")
    body = (
        f"n = {args.n:,}, penalties x n = {args.penalties}; one sweep each way, one after the other.\n\n"
        + markdown_table(["M", "fits", "CG iterations", "sweep s (fresh)", "sweep s (FactorCache)", "speed-up",
                          "hits/misses", "same alpha"], rows)
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Penalty sweep: FactorCache against fresh preconditioners", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
