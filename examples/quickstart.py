"""Quickstart: FalkonGP on the protein dataset (45,730 rows, 9 features, embedded in data/).

Fits a Nyström GP / kernel ridge regression with M centers by FALKON, predicts
mean and exact variance on the held-out split, and prints test RMSE, the
Gaussian negative log predictive density and timings.

    bash scripts/quickstart.sh                 # defaults: M=2000, float64
    bash scripts/quickstart.sh --centers 4000 --dtype float32
    bash scripts/quickstart.sh --auto 60        # gpfalkon.auto_fit chooses everything in 60 s
"""
from __future__ import annotations

import argparse
import math
import pathlib
import time

import gpytorch
import numpy as np
import torch

from gpfalkon import FalkonGP, auto_fit, median_lengthscale

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "protein.npz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--centers", type=int, default=2000, help="number of Nyström centers M")
    ap.add_argument("--penalty", type=float, default=5e-6, help="lambda (noise = n * lambda)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    ap.add_argument("--iterations", type=int, default=100, help="maximum CG iterations")
    ap.add_argument("--split", type=int, default=0, help="which of the 10 fixed train/test splits")
    ap.add_argument("--auto", type=float, default=None, metavar="SECONDS",
                    help="let auto_fit choose kernel hyperparameters, penalty and M within this budget")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    with np.load(DATA) as z:
        X, y, mask = z["X"], z["y"], z["test_mask"][:, args.split]
    xtr, ytr, xte, yte = (torch.as_tensor(a, dtype=dtype) for a in (X[~mask], y[~mask], X[mask], y[mask]))
    mu, sd = xtr.mean(0), xtr.std(0).clamp_min(1e-12)
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    ym, ys = ytr.mean(), ytr.std()
    ytr_s = (ytr - ym) / ys
    print(f"protein: n_train={len(xtr)}, n_test={len(xte)}, d={xtr.shape[1]}, dtype={args.dtype}")

    if args.auto is not None:  # raw targets: auto_fit standardises and maps back by itself
        t0 = time.perf_counter()
        model = auto_fit(xtr, ytr, budget=args.auto, dtype=dtype, verbose=True)
        print(f"auto_fit: {time.perf_counter() - t0:.1f} s")
        print(model.auto_report.summary())
        model.eval()
        with torch.no_grad():  # the lazy mean and variance are computed here too, without a graph
            pred = model.likelihood(model(xte))
            rmse = float(((pred.mean - yte) ** 2).mean().sqrt())
            nlpd = float((0.5 * torch.log(2 * math.pi * pred.variance)
                          + 0.5 * (yte - pred.mean) ** 2 / pred.variance).mean())
        base = float(((ym - yte) ** 2).mean().sqrt())
        print(f"test RMSE {rmse:.4f} (predicting the training mean: {base:.4f}), NLPD {nlpd:.4f}")
        return

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(dtype)
    kernel.base_kernel.lengthscale = median_lengthscale(xtr) / 2
    kernel.outputscale = 1.0
    model = FalkonGP(xtr, ytr_s, kernel=kernel, num_centers=args.centers, penalty=args.penalty,
                     max_iter=args.iterations, tol=1e-6, seed=0)

    t0 = time.perf_counter()
    model.fit()
    t_fit = time.perf_counter() - t0
    info = model.fit_info
    print(f"fit: M={args.centers}, {info.iterations} CG iterations, relative residual "
          f"{float(info.final_residual.max()):.2e}, {t_fit:.2f} s")

    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        pred = model.likelihood(model(xte))
        mean = pred.mean * ys + ym
        var = pred.variance * ys**2
    t_pred = time.perf_counter() - t0
    rmse = float(((mean - yte) ** 2).mean().sqrt())
    nlpd = float((0.5 * torch.log(2 * math.pi * var) + 0.5 * (yte - mean) ** 2 / var).mean())
    base = float(((ym - yte) ** 2).mean().sqrt())
    print(f"predict (mean + exact variance, {len(xte)} points): {t_pred:.2f} s")
    print(f"test RMSE {rmse:.4f} (predicting the training mean: {base:.4f}), NLPD {nlpd:.4f}")


if __name__ == "__main__":
    main()
