"""The posterior-variance factors' data pass: ``A A^T`` (``A = L^{-1} K_Mn``) by lower-triangle rank updates
(the library's ``KernelEngine.whitened_gram`` now) against one full ``addmm`` per row block (before).

A float64 ``FalkonGP`` (Matern-5/2, median-heuristic lengthscale, M uniform centers) on ``n`` synthetic rows
(d = 9, the quickstart's protein shape by default), fitted once; then ``NystromPosteriorFactors.compute``
(two Cholesky factorisations and the one data pass) timed both ways, alternating, median of ``--repeats``;
'max diff' compares the two factors ``L_B`` (relative).

    .venv/bin/python benchmarks/variance_factors.py --out benchmarks/results/variance-factors.md
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.backend.engine as engine
from gpfalkon import FalkonGP, median_lengthscale
from gpfalkon.models.posterior import NystromPosteriorFactors

from _common import environment_lines, log, markdown_table, write_result


def full_update(g: torch.Tensor, a: torch.Tensor) -> None:
    g.addmm_(a, a.mT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=41_157)
    ap.add_argument("--m", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/variance-factors.md"))
    args = ap.parse_args()
    env = environment_lines()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, 9, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(args.n, generator=g, dtype=torch.float64)
    rows = []
    real = engine._lower_rank_update_
    for m in args.m:
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
        kernel.base_kernel.lengthscale = median_lengthscale(x)
        model = FalkonGP(x, y, kernel=kernel, num_centers=m, penalty=1e-6, max_iter=20, seed=0).fit()
        op = model.nystrom_operator(store_kernel=False)
        times: dict[str, list[float]] = {"full addmm": [], "lower updates": []}
        factors = {}
        for rep in range(args.repeats + 1):
            for name, fn in (("full addmm", full_update), ("lower updates", real)):
                engine._lower_rank_update_ = fn
                try:
                    t0 = time.perf_counter()
                    factors[name] = NystromPosteriorFactors.compute(op)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
                finally:
                    engine._lower_rank_update_ = real
        a, b = statistics.median(times["full addmm"]), statistics.median(times["lower updates"])
        lb_a, lb_b = factors["full addmm"].LB, factors["lower updates"].LB
        diff = float((lb_a - lb_b).abs().max() / lb_a.abs().max())
        rows.append([f"{args.n:,}", f"{m:,}", a, b, a / b, f"{diff:.1e}"])
        log(f"M={m}: full {a:.2f} s, lower {b:.2f} s")
    body = (f"float64, d = 9; {args.repeats} repetitions after a warm-up, the two alternating; seconds = median of "
            "`NystromPosteriorFactors.compute` (the variance factors a first `model(x).variance` forms).\n\n"
            + markdown_table(["n", "M", "full addmm s", "lower updates s", "speed-up", "max diff of L_B"], rows))
    path = write_result(args.out, "Posterior-variance factors: lower-triangle rank updates vs full addmm", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
