"""Plots of a fit: CG convergence, a hyperparameter-learning trajectory, predictions with bands.

Learns an ARD Matern-5/2 kernel and the penalty by GCV (Adam, 40 steps) on 2,000 synthetic rows,
fits FALKON with 200 centers, and draws with ``gpfalkon.plot``: the CG residual history of the fit,
the objective and hyperparameters per step (``TrajectoryRecorder``), and predicted against observed
test targets with +-2 sd bars of the predictive (noise included). About 5 s on 2 cores.

    .venv/bin/python examples/plotting.py --out /tmp/plots     # writes three PNGs there
"""
from __future__ import annotations

import argparse
import pathlib

import gpytorch
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from gpfalkon import FalkonGP
from gpfalkon.objectives import GCV
from gpfalkon.plot import TrajectoryRecorder, plot_cg_convergence, plot_predictions, plot_trajectories


def make_figures(out: pathlib.Path, n: int = 2000, steps: int = 40) -> dict[str, float]:
    """Writes ``cg.png``, ``trajectory.png`` and ``predictions.png`` under ``out``; returns the test RMSE
    and the +-2 sd coverage."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n + 500, 3, generator=g, dtype=torch.float64) * 4 - 2
    f = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.3 * x[:, 2]
    y = f + 0.1 * torch.randn(n + 500, generator=g, dtype=torch.float64)
    xtr, ytr, xte, yte = x[:n], y[:n], x[n:], y[n:]

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
    model = FalkonGP(xtr, ytr, kernel=kernel, num_centers=200, penalty=1e-3, seed=0)
    objective = GCV(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    rec = TrajectoryRecorder(model)
    for _ in range(steps):
        opt.zero_grad()
        loss = objective()
        loss.backward()
        opt.step()
        rec.record(loss)

    model.fit(callback=lambda *_: None)  # a per-iteration callback keeps CG (its history is drawn below)
    model.eval()
    with torch.no_grad():
        pred = model.likelihood(model(xte))
    mean, var = pred.mean, pred.variance

    for name, draw in (("cg", lambda ax: plot_cg_convergence(model, ax=ax)),
                       ("trajectory", lambda ax: plot_trajectories(rec.values, ax=ax)),
                       ("predictions", lambda ax: plot_predictions(yte, mean, var, ax=ax))):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
    rmse = float((mean - yte).square().mean().sqrt())
    coverage = float(((yte - mean).abs() <= 2 * var.sqrt()).double().mean())
    return {"rmse": rmse, "coverage": coverage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("plots"))
    args = ap.parse_args()
    res = make_figures(args.out)
    print(f"test RMSE {res['rmse']:.4f}, +-2 sd coverage {res['coverage']:.1%}; figures in {args.out}")


if __name__ == "__main__":
    main()
