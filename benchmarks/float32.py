"""float32 accuracy: FalkonGP vs GPyTorch's SGPR, both against their float64 runs.

GPyTorch's SGPR forms a Woodbury capacitance with entries ~ n / sigma^2, which
float32 cannot hold accurately; gpfalkon computes kernel blocks in float32 but CG
vectors, Cholesky factors and predictions in float64. On a real dataset (protein,
split 0, standardised), same kernel, centers and noise n * lambda, this script
reports the relative error of each model's float32 predictive mean and variance
against the same model in float64, and the float32 / float64 test RMSE.

    .venv/bin/python benchmarks/float32.py [--centers 500] [--penalty 1e-6 1e-5 1e-4]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP, median_lengthscale

from _baselines import SGPR
from _common import REPO, environment_lines, log, markdown_table, protein_split0, write_result


def make_kernel(ls: float, dtype):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(dtype)
    k.base_kernel.lengthscale = ls
    k.outputscale = 1.0
    return k


def predict_falkon(x, y, xt, centers, ls, lam, dtype):
    m = FalkonGP(x.to(dtype), y.to(dtype), kernel=make_kernel(ls, dtype), centers=centers.to(dtype), penalty=lam,
                 tol=1e-10, max_iter=1000)
    m.fit().eval()
    with torch.no_grad():
        p = m(xt.to(dtype))
        return p.mean.double(), p.variance.double()


def predict_sgpr(x, y, xt, centers, ls, lam, dtype):
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.Positive()).to(dtype)
    lik.noise = x.shape[0] * lam
    m = SGPR(x.to(dtype), y.to(dtype), make_kernel(ls, dtype), centers.to(dtype).clone(), lik).to(dtype)
    m.eval()
    with torch.no_grad(), gpytorch.settings.sgpr_diagonal_correction(False), \
            gpytorch.settings.max_cholesky_size(10**9), gpytorch.settings.fast_pred_var(False):
        p = m(xt.to(dtype))
        return p.mean.double(), p.variance.double()


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--centers", type=int, default=500)
    ap.add_argument("--penalty", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5, 1e-4])
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "float32.md")
    args = ap.parse_args()
    env = environment_lines()
    x, y, xt, yt = protein_split0()
    g = torch.Generator().manual_seed(0)
    centers = x[torch.randperm(len(x), generator=g)[: args.centers]]
    ls = float(median_lengthscale(x)) / 2
    rows = []
    for lam in args.penalty:
        log(f"lambda={lam:g} (noise {len(x) * lam:.3g})")
        for name, fn in (("gpfalkon FalkonGP", predict_falkon), ("GPyTorch SGPR", predict_sgpr)):
            m64, v64 = fn(x, y, xt, centers, ls, lam, torch.float64)
            m32, v32 = fn(x, y, xt, centers, ls, lam, torch.float32)
            r64 = float((m64 - yt).square().mean().sqrt())
            r32 = float((m32 - yt).square().mean().sqrt())
            rows.append([name, lam, len(x) * lam, rel(m32, m64), rel(v32, v64), r64, r32, r32 / r64 - 1])
            log(f"  {name}: mean rel. err {rows[-1][3]:.2e}, variance rel. err {rows[-1][4]:.2e}, "
                f"RMSE f64 {r64:.4f} f32 {r32:.4f}")
    table = markdown_table(
        ["model", "lambda", "noise n*lambda", "float32 mean rel. err", "float32 variance rel. err",
         "test RMSE float64", "test RMSE float32", "RMSE change"], rows, align="lrrrrrrr")
    body = (f"protein split 0 (n_train = {len(x):,}, n_test = {len(xt):,}, d = {x.shape[1]}), standardised; "
            f"Matern 5/2 (lengthscale = median heuristic / 2 = {ls:.3f}, outputscale 1), M = {args.centers} "
            "shared random centers; FalkonGP solved to relative residual 1e-10; SGPR without GPyTorch's "
            "diagonal correction (the Titsias/DTC posterior) and with Cholesky solves. Relative errors are "
            "||float32 - float64|| / ||float64|| over the test points, each model against itself in float64.\n\n"
            + table + "\n")
    write_result(args.out, "float32 accuracy: FalkonGP vs GPyTorch SGPR", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
