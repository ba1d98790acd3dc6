"""``auto_fit``'s variance calibration: test NLPD with and without it, against the best single scale.

For each ``dataset:budget``: ``auto_fit`` with its defaults (raw targets, seed 0) returns a calibrated model
(``auto_report.chosen["variance_scale"]`` = ``c``); its exact predictive variances ``v`` on the test set give
the calibrated NLPD, ``v / c`` the uncalibrated one (the scale is exact: docs/math.md §4 "Scaling the prior"),
and ``c* v / c`` with ``c* = mean(r^2 c / v)`` the oracle (the best single scale, chosen on the test set
itself). Reference: GPyTorch SGPR as ``compare.py`` trains it (float32, ``M_SMALL`` inducing points, Adam
0.1 to convergence or the same budget), NLPD from float64 predictions of its ``likelihood(model(x))``.
NLPD per test point in standardised target units (the targets' training std); lower is better.

Usage (from the repository root):

    .venv/bin/python benchmarks/auto_calibration.py --runs protein:20 kin40k:15 \\
        --out benchmarks/results/auto-calibration.md

Data from ``GPFALKON_DATA`` (default ``../shared/data``), as ``compare.py``.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import environment_lines, log, markdown_table, write_result  # noqa: E402
from compare import FULL_BATCH_MAX_N, M_SMALL, _converged, _gp_kernel, load_dataset, median_ls, subsample  # noqa: E402


def nlpd(r2: torch.Tensor, v: torch.Tensor) -> float:
    return float((0.5 * torch.log(2 * math.pi * v) + 0.5 * r2 / v).mean())


def auto_row(data: dict, budget: float) -> dict:
    import gpfalkon

    ys = data["y_scale"]
    y_raw = data["ytr"].double() * ys + data["y_mean"]
    t = time.perf_counter()
    model = gpfalkon.auto_fit(data["xtr"], y_raw, budget=budget, seed=0)
    wall = time.perf_counter() - t
    model.eval()
    with torch.no_grad():  # the variances are lazy: read them here too
        p = model.likelihood(model(data["xte"]))
        mu = (p.mean.double() - data["y_mean"]) / ys
        v = p.variance.double() / ys**2
    r2 = (data["yte"].double() - mu) ** 2
    ch = model.auto_report.chosen
    c = ch["variance_scale"]
    c_star = float((r2 / v).mean()) * c
    return dict(wall=wall, M=ch["num_centers"], c=c, c_star=c_star, rmse=float(r2.mean().sqrt()),
                calibrated=nlpd(r2, v), uncalibrated=nlpd(r2, v / c), oracle=nlpd(r2, v * c_star / c),
                seconds=model.auto_report.stages.get("calibration", float("nan")))


def sgpr_row(data: dict, budget: float) -> dict:
    import gpytorch

    xtr, ytr = subsample(data, FULL_BATCH_MAX_N)
    n, d = xtr.shape
    torch.manual_seed(0)
    ind = xtr[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:M_SMALL]].clone()

    class _SGPR(gpytorch.models.ExactGP):
        def __init__(self, x, y, lik):
            super().__init__(x, y, lik)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.InducingPointKernel(_gp_kernel(d, median_ls(xtr)),
                                                                    inducing_points=ind, likelihood=lik)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = _SGPR(xtr, ytr, lik)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    losses: list[float] = []
    t = time.perf_counter()
    while time.perf_counter() - t < budget and len(losses) < 10_000:
        opt.zero_grad()
        loss = -mll(model(xtr), ytr)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if _converged(losses, 50, 1e-5):
            break
    wall = time.perf_counter() - t
    model = model.double()
    model.eval()
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**9):
        p = model.likelihood(model(data["xte"].double()))
        mu, v = p.mean, p.variance
    r2 = (data["yte"].double() - mu) ** 2
    return dict(wall=wall, steps=len(losses), rmse=float(r2.mean().sqrt()), nlpd=nlpd(r2, v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, metavar="DATASET:BUDGET")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "auto-calibration.md")
    args = ap.parse_args()
    env = environment_lines()
    rows = []
    for spec in args.runs:
        name, budget = spec.rsplit(":", 1)
        data = load_dataset(name)
        a = auto_row(data, float(budget))
        log(f"{name}: auto {a}")
        s = sgpr_row(data, float(budget))
        log(f"{name}: sgpr {s}")
        rows.append([name, float(budget), a["M"], a["c"], a["c_star"], a["rmse"], a["uncalibrated"], a["calibrated"],
                     a["oracle"], a["seconds"], s["rmse"], s["nlpd"], s["wall"]])
    table = markdown_table(
        ["dataset", "budget s", "M", "c", "c* (test)", "RMSE", "NLPD uncalibrated", "NLPD calibrated",
         "NLPD at c*", "calibration s", "SGPR RMSE", "SGPR NLPD", "SGPR s"], rows)
    body = (table + "\n\nRMSE and NLPD on the test set in standardised target units. 'c': auto_fit's variance "
            "scale; 'c* (test)': the single scale that is best on the test set (an oracle); 'calibration s': "
            "the seconds auto_fit spent computing c (after its final fit). SGPR: GPyTorch's, float32, "
            f"{M_SMALL} inducing points, trained for at most the same budget.\n")
    print(write_result(args.out, "auto_fit variance calibration: test NLPD", env, body))


if __name__ == "__main__":
    main()
