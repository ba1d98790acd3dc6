"""The paper's small-scale study (Meanti et al. 2022, Table 1 setting): every objective
optimised by Adam from the same initialisation on real datasets, test NRMSE per
objective and dataset, plus GPyTorch's SGPR trained on the same data.

Setting: standardised X and y (training statistics), the source's split 0, a
Gaussian (RBF, ARD) kernel with every lengthscale initialised by the median
heuristic, lambda = 1e-4, M = 100 centers learned (initialised at random training
rows, the same for every method), Adam (lr 0.05) for --steps steps. After training,
FalkonGP.fit() solves with the learned hyperparameters and centers; NRMSE =
test RMSE / std(y_test). "none" is the initialisation, fitted without training.

    .venv/bin/python benchmarks/objectives.py [--steps 100] [--datasets ...] [--out ...]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import CGNotConvergedWarning, FalkonGP, median_lengthscale
from gpfalkon import objectives as O

from _baselines import SGPR
from _common import REPO, environment_lines, log, markdown_table, write_result

DATA = REPO.parent / "shared" / "data"
DEFAULT = ["yacht", "energy", "concrete", "airfoil", "wine", "skillcraft", "sml", "parkinsons", "pumadyn32nm", "kin40k"]
METHODS = ["none", "NystromCompReg", "StochasticNystromCompReg", "CompReg", "GCV", "LOOCV", "HoldOut", "SGPRBound",
           "GPyTorch SGPR"]


def load(name: str):
    with np.load(DATA / f"{name}.npz") as z:
        X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
        if "test_mask" in z.files:
            te = z["test_mask"][:, 0]
            tr = ~te
        elif "train_idx" in z.files:
            tr = np.zeros(len(y), bool)
            tr[z["train_idx"][0]] = True
            te = ~tr
        else:
            raise ValueError(f"{name} has no fixed split")
    xtr, xte, ytr, yte = (torch.as_tensor(a) for a in (X[tr], X[te], y[tr], y[te]))
    mu, sd = xtr.mean(0), xtr.std(0).clamp_min(1e-12)
    ym, ys = ytr.mean(), ytr.std()
    return (xtr - mu) / sd, (ytr - ym) / ys, (xte - mu) / sd, (yte - ym) / ys


def make_model(x, y, centers, ls0, lam0):
    k = gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[1]).double()
    k.lengthscale = ls0 * torch.ones(1, x.shape[1], dtype=torch.float64)
    return FalkonGP(x, y, kernel=k, centers=centers, penalty=lam0, learn_centers=True, tol=1e-6, max_iter=200)


def nrmse(model, xte, yte) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CGNotConvergedWarning)
        model.fit()
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xte).mean
    return float(((pred - yte) ** 2).mean().sqrt() / yte.std())


def train(model, name: str, steps: int, lr: float) -> None:
    cls = getattr(O, name)
    obj = cls(model, num_trace_vectors=20) if name == "StochasticNystromCompReg" else cls(model)
    obj.minimize(steps, lr=lr)


def sgpr_nrmse(x, y, xte, yte, centers, ls0, lam0, steps, lr) -> float:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = max(len(x) * lam0, 1.1e-4)
    base = gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[1]).double()
    base.lengthscale = ls0 * torch.ones(1, x.shape[1], dtype=torch.float64)
    m = SGPR(x, y, base, centers.clone(), lik).double()
    m.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, m)
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = -mll(m(x), y)
        loss.backward()
        opt.step()
    m.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = m(xte).mean
    return float(((pred - yte) ** 2).mean().sqrt() / yte.std())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--centers", type=int, default=100)
    ap.add_argument("--penalty", type=float, default=1e-4)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "objectives.md")
    args = ap.parse_args()
    env = environment_lines()
    torch.manual_seed(0)
    rows, secs = [], []
    t_all = time.perf_counter()
    for ds in args.datasets:
        x, y, xte, yte = load(ds)
        g = torch.Generator().manual_seed(0)
        centers = x[torch.randperm(len(x), generator=g)[: min(args.centers, len(x))]].clone()
        ls0 = float(median_lengthscale(x))
        row, trow = [ds, len(x), x.shape[1]], [ds]
        for meth in args.methods:
            t0 = time.perf_counter()
            if meth == "GPyTorch SGPR":
                e = sgpr_nrmse(x, y, xte, yte, centers, ls0, args.penalty, args.steps, args.lr)
            else:
                model = make_model(x, y, centers, ls0, args.penalty)
                if meth != "none":
                    train(model, meth, args.steps, args.lr)
                e = nrmse(model, xte, yte)
            dt = time.perf_counter() - t0
            row.append(e)
            trow.append(dt)
            log(f"{ds:12s} {meth:26s} NRMSE {e:.4f}  ({dt:.1f} s)")
        rows.append(row)
        secs.append(trow)
    mean_row = ["mean", "", ""] + [float(np.mean([r[3 + j] for r in rows])) for j in range(len(args.methods))]
    table = markdown_table(["dataset", "n_train", "d", *args.methods], [*rows, mean_row],
                           align="lrr" + "r" * len(args.methods))
    ttable = markdown_table(["dataset", *args.methods], secs, align="l" + "r" * len(args.methods))
    body = (
        f"Adam (lr {args.lr}) for {args.steps} steps from the same initialisation: RBF ARD kernel, lengthscales = "
        f"median heuristic, lambda = {args.penalty:g}, M = {args.centers} centers (learned; GPyTorch SGPR: learned "
        "inducing points, noise initialised at n lambda, its own ExactMarginalLogLikelihood loss, GPyTorch's default "
        "prediction). Test NRMSE = RMSE / std(y_test), split 0 of each source. "
        "'none' = initialisation, no training.\n\n"
        + table + "\n\nWall seconds per method (training + fit + prediction):\n\n" + ttable
        + f"\n\nTotal {time.perf_counter() - t_all:.0f} s.\n"
    )
    write_result(args.out, "Hyperparameter objectives: the paper's small-scale study", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
