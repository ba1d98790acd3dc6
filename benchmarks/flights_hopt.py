"""Large scale hyperparameter learning on flights: StochasticNystromCompReg with M learned
centers (and ARD lengthscales, outputscale fixed at 1, lambda) vs FALKON with more random
centers and fixed heuristic hyperparameters (median-heuristic lengthscale, lambda 1e-6).

Data: ../shared/data/flights.npz (3M rows, 9 features), shuffled (seed 0), 2/3 train,
1/3 test, X and y standardised with training statistics; RMSE reported in standardised
units and in minutes.

    .venv/bin/python benchmarks/flights_hopt.py [--steps 30] [--centers 1000] [--falkon-centers 5000]
        [--rows N (subsample the 3M rows)] [--dtype float32]
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
from gpfalkon.objectives import StochasticNystromCompReg

from _common import REPO, environment_lines, log, markdown_table, write_result


def predict_rmse(model, xte, yte, chunk=100_000) -> float:
    model.eval()
    sq = 0.0
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        for s in range(0, len(xte), chunk):
            sq += float(((model(xte[s : s + chunk]).mean - yte[s : s + chunk]).double() ** 2).sum())
    return (sq / len(xte)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--centers", type=int, default=1000)
    ap.add_argument("--falkon-centers", type=int, default=5000)
    ap.add_argument("--trace-vectors", type=int, default=20)
    ap.add_argument("--cg-iterations", type=int, default=10)
    ap.add_argument("--fit-iterations", type=int, default=20)
    ap.add_argument("--rows", type=int, default=None, help="use only this many of the 3M rows")
    ap.add_argument("--hopt-rows", type=int, default=None,
                    help="learn the hyperparameters on this many training rows (default all); the final fit uses all")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "flights_hopt.md")
    args = ap.parse_args()
    env = environment_lines()
    dtype = getattr(torch, args.dtype)
    with np.load(REPO.parent / "shared" / "data" / "flights.npz") as z:
        X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
    perm = np.random.default_rng(0).permutation(len(y))
    if args.rows is not None:
        perm = perm[: args.rows]
    ntr = (2 * len(perm)) // 3
    tr, te = perm[:ntr], perm[ntr:]
    xtr, ytr, xte, yte = (torch.as_tensor(a) for a in (X[tr], y[tr], X[te], y[te]))
    mu, sd = xtr.mean(0), xtr.std(0)
    ym, ys = ytr.mean(), ytr.std()
    xtr, xte = ((xtr - mu) / sd).to(dtype), ((xte - mu) / sd).to(dtype)
    ytr, yte = ((ytr - ym) / ys).to(dtype), ((yte - ym) / ys).to(dtype)
    ls0 = float(median_lengthscale(xtr))
    log(f"flights: n_train={len(xtr):,} n_test={len(xte):,} d={xtr.shape[1]} {args.dtype}, "
        f"median lengthscale {ls0:.3f}")
    rows = []
    mean_rmse = float(yte.double().square().mean().sqrt())

    # FALKON, fixed heuristic hyperparameters, many random centers
    k = gpytorch.kernels.RBFKernel().to(dtype)
    k.lengthscale = ls0
    t0 = time.perf_counter()
    fal = FalkonGP(xtr, ytr, kernel=k, num_centers=args.falkon_centers, penalty=1e-6, max_iter=args.fit_iterations,
                   tol=0)
    fal.fit()
    t_fit = time.perf_counter() - t0
    r = predict_rmse(fal, xte, yte)
    rows.append([f"FALKON, M={args.falkon_centers} random, heuristic hyperparameters", "-", t_fit, r, r * float(ys)])
    log(f"FALKON M={args.falkon_centers}: fit {t_fit:.1f} s, test RMSE {r:.4f}")
    del fal

    # StochasticNystromCompReg: learn ARD lengthscales, lambda and M centers
    k2 = gpytorch.kernels.RBFKernel(ard_num_dims=xtr.shape[1]).to(dtype)
    k2.lengthscale = ls0 * torch.ones(1, xtr.shape[1])
    nh = len(xtr) if args.hopt_rows is None else min(args.hopt_rows, len(xtr))
    model = FalkonGP(xtr[:nh], ytr[:nh], kernel=k2, num_centers=args.centers, penalty=1e-4, learn_centers=True,
                     max_iter=args.fit_iterations, tol=0)
    obj = StochasticNystromCompReg(model, num_trace_vectors=args.trace_vectors, cg_iterations=args.cg_iterations)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = obj()
        loss.backward()
        opt.step()
        log(f"  step {step + 1}/{args.steps}: objective {float(loss):.5g}, lambda {float(model.penalty):.3g}, "
            f"{time.perf_counter() - t0:.0f} s")
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    if nh < len(xtr):  # final fit on all training rows with the learned kernel, centers and lambda
        lam = float(model.penalty)
        model = FalkonGP(xtr, ytr, kernel=model.kernel, centers=model.centers.detach(), penalty=lam,
                         max_iter=args.fit_iterations, tol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CGNotConvergedWarning)
        model.fit()
    t_fit2 = time.perf_counter() - t0
    r2 = predict_rmse(model, xte, yte)
    rows.append([f"StochasticNystromCompReg, M={args.centers} learned on {nh:,} rows, {args.steps} Adam steps", t_train,
                 t_fit2, r2,
                 r2 * float(ys)])
    log(f"learned: train {t_train:.0f} s, fit {t_fit2:.1f} s, test RMSE {r2:.4f}")
    table = markdown_table(["method", "training s", "fit s", "test RMSE (std.)", "test RMSE (min)"], rows,
                           align="lrrrr")
    body = (
        f"flights: n_train = {len(xtr):,}, n_test = {len(xte):,}, {args.dtype}; RBF kernel; FALKON fits use "
        f"{args.fit_iterations} CG iterations. Learned model: ARD lengthscales, lambda (init 1e-4) and centers "
        f"(init random rows) by Adam (lr {args.lr}), r = {args.trace_vectors} trace vectors, at most "
        f"{args.cg_iterations} warm-started CG iterations per step (stopping at relative residual 1e-4). "
        f"Predicting the training mean: RMSE {mean_rmse:.4f} "
        f"({mean_rmse * float(ys):.2f} min).\n\n" + table + "\n"
    )
    write_result(args.out, "Large-scale hyperparameter learning on flights", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
