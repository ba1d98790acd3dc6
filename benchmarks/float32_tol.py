"""Which CG tolerance can float32 data reach? The floor behind ``FLOAT32_TOL``.

On protein (split 0, standardised; the data embedded in ``data/protein.npz``), for a grid of
penalties and kernel smoothness (Matern 5/2, lengthscale = median heuristic x factor; a long
lengthscale is a smooth kernel, a badly conditioned K_MM), FALKON runs ``max_iter`` CG
iterations with ``tol=0`` on float32 and on float64 data, and the table gives, per case, the
smallest relative residual float32 reached (the floor), the iterations float32 and float64 need
to reach 1e-4 / 1e-5 / 1e-6 ("-": never), and the test RMSE of each dtype's best iterate.

    .venv/bin/python benchmarks/float32_tol.py [--rows 20000] [--centers 1000] [--max-iter 150]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP, median_lengthscale

from _common import REPO, environment_lines, log, markdown_table, protein_split0, write_result


def first_below(res: torch.Tensor, level: float) -> str:
    hit = (res <= level).nonzero()
    return str(int(hit[0])) if len(hit) else "-"


def run(x, y, xt, yt, centers, ls, lam, dtype, max_iter):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(dtype)
    k.base_kernel.lengthscale = ls
    k.outputscale = 1.0
    m = FalkonGP(x.to(dtype), y.to(dtype), kernel=k, centers=centers.to(dtype), penalty=lam, tol=0.0,
                 max_iter=max_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.fit()
    m.eval()
    rmse = float((m.posterior_mean(xt.to(dtype)).double() - yt).square().mean().sqrt())
    return m.fit_info.residuals.max(-1).values.double(), rmse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--centers", type=int, default=1000)
    ap.add_argument("--max-iter", type=int, default=150)
    ap.add_argument("--penalty", type=float, nargs="+", default=[1e-4, 1e-6, 1e-8])
    ap.add_argument("--factor", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "float32-tol.md")
    args = ap.parse_args()
    env = environment_lines()
    x, y, xt, yt = protein_split0(args.rows)
    g = torch.Generator().manual_seed(0)
    centers = x[torch.randperm(len(x), generator=g)[: args.centers]]
    ls0 = float(median_lengthscale(x))
    rows = []
    for factor in args.factor:
        for lam in args.penalty:
            r32, e32 = run(x, y, xt, yt, centers, ls0 * factor, lam, torch.float32, args.max_iter)
            r64, e64 = run(x, y, xt, yt, centers, ls0 * factor, lam, torch.float64, args.max_iter)
            rows.append([factor, lam, float(r32.min()), float(r64.min()),
                         *(f"{first_below(r32, v)} / {first_below(r64, v)}" for v in (1e-4, 1e-5, 1e-6)),
                         e32, e64])
            log(f"factor {factor:g} lambda {lam:g}: float32 floor {float(r32.min()):.2e}, float64 "
                f"{float(r64.min()):.2e}; RMSE {e32:.4f} / {e64:.4f}")
    table = markdown_table(
        ["lengthscale factor", "lambda", "float32 best residual", "float64 best residual",
         "iters to 1e-4 (f32 / f64)", "iters to 1e-5", "iters to 1e-6", "test RMSE f32", "test RMSE f64"],
        rows, align="rrrrrrrrr")
    body = (f"protein split 0, first {len(x):,} training rows, {len(xt):,} test rows, d = {x.shape[1]}, "
            f"standardised; Matern 5/2, lengthscale = median heuristic ({ls0:.3f}) x factor, outputscale 1; "
            f"M = {args.centers} random centers (the same in both dtypes); {args.max_iter} CG iterations with "
            "tol = 0. 'best residual' is the smallest relative residual ||r|| / ||b|| over the iterations; "
            "'iters to' the first iteration at or below that level ('-': never).\n\n" + table + "\n")
    write_result(args.out, "float32: the CG residual floor", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
