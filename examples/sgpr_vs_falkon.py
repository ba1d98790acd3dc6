"""The same data through GPyTorch SGPR, GPyTorch SVGP and gpfalkon - point it at your own file.

    .venv/bin/python examples/sgpr_vs_falkon.py                          # the embedded protein data
    .venv/bin/python examples/sgpr_vs_falkon.py my.csv --budget 60       # last column = target
    .venv/bin/python examples/sgpr_vs_falkon.py my.npz                   # arrays X (n, d) and y (n,)

The rows are split 80/20 at random (``--seed``); X is standardised with the training statistics and
y too (errors are reported in y's units). SGPR: 500 inducing points from the training rows, ARD
Matern-5/2, Adam (lr 0.1) on its exact MLL for ``--steps`` steps, predicted in float64 (GPyTorch's
float32 SGPR prediction is inaccurate: its issues #534 / #623). SVGP: 500 learned inducing points,
minibatches of 1024, Adam (lr 0.01) for ``--epochs`` epochs. gpfalkon: ``auto_fit`` within ``--budget``
seconds. Printed: test RMSE, RMSE / std(y_test) and the training seconds of each.
"""
from __future__ import annotations

import argparse
import pathlib
import time

import gpytorch
import numpy as np
import torch

from gpfalkon import auto_fit

DEFAULT = pathlib.Path(__file__).resolve().parents[1] / "data" / "protein.npz"


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def load_csv(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """Features and target (the last column) of a numeric CSV: ``,`` or ``;`` separated, with or without one
    header line (a first line in which no field is a number). A missing or non-numeric value, a ragged row or
    fewer than two columns stops with the file's line and column named (nothing is dropped or imputed)."""
    lines = path.read_text().splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    sep = ";" if ";" in first and "," not in first else ","
    header = not any(_is_number(f) for f in first.split(sep))  # names only; "1,,3" is data with a hole
    width = len(first.split(sep))
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or (header and line is first):
            continue
        fields = line.split(sep)
        if len(fields) != width:
            raise SystemExit(f"{path}, line {number}: {len(fields)} fields, the first line has {width}")
        for col, f in enumerate(fields, start=1):
            if not _is_number(f) or not np.isfinite(float(f)):
                raise SystemExit(f"{path}, line {number}, column {col}: {f.strip()!r} is missing or not a finite "
                                 "number (fill or drop the row first)")
        rows.append([float(f) for f in fields])
    if width < 2 or len(rows) < 2:
        raise SystemExit(f"{path}: need at least one feature column and the target (the last column) in at least "
                         f"two rows, got {width} column(s) and {len(rows)} row(s)")
    a = np.asarray(rows, dtype=np.float64)
    return a[:, :-1], a[:, -1]


def load(path: pathlib.Path):
    if path.suffix == ".csv":
        return load_csv(path)
    with np.load(path) as z:
        return z["X"], z["y"].reshape(-1)


def rmse(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred.double() - y.double()).square().mean().sqrt())


def run_sgpr(x, y, xt, steps: int) -> tuple:
    class SGPR(gpytorch.models.ExactGP):
        def __init__(self, lik):
            super().__init__(x, y, lik)
            kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=x.shape[1]))
            ind = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:500]].clone()
            self.covar_module = gpytorch.kernels.InducingPointKernel(kernel, inducing_points=ind, likelihood=lik)

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(torch.zeros_like(z[:, 0]), self.covar_module(z))

    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = SGPR(lik)
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    seconds = time.perf_counter() - t
    model = model.double()
    model.set_train_data(x.double(), y.double(), strict=False)
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        return model(xt.double()).mean, seconds


def run_svgp(x, y, xt, epochs: int) -> tuple:
    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, ind):
            dist = gpytorch.variational.CholeskyVariationalDistribution(ind.shape[0])
            super().__init__(gpytorch.variational.VariationalStrategy(self, ind, dist, learn_inducing_locations=True))
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=x.shape[1])
            )

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(torch.zeros_like(z[:, 0]), self.covar_module(z))

    model = SVGP(x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))[:500]].clone())
    lik = gpytorch.likelihoods.GaussianLikelihood()
    model.train(), lik.train()
    opt = torch.optim.Adam([*model.parameters(), *lik.parameters()], lr=0.01)
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=x.shape[0])
    g = torch.Generator().manual_seed(2)
    t = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(x.shape[0], generator=g).split(1024):
            opt.zero_grad()
            (-mll(model(x[idx]), y[idx])).backward()
            opt.step()
    seconds = time.perf_counter() - t
    model.eval()
    with torch.no_grad():
        return torch.cat([model(b).mean for b in xt.split(4096)]), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?", default=str(DEFAULT), help=".csv (last column = target) or .npz (X, y)")
    ap.add_argument("--budget", type=float, default=60.0, help="auto_fit's wall-clock budget (s)")
    ap.add_argument("--steps", type=int, default=100, help="SGPR Adam steps")
    ap.add_argument("--epochs", type=int, default=10, help="SVGP epochs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    X, Y = load(pathlib.Path(args.data))
    perm = np.random.default_rng(args.seed).permutation(len(Y))
    ntr = int(0.8 * len(Y))
    tr, te = perm[:ntr], perm[ntr:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    ym, ys = Y[tr].mean(), Y[tr].std()
    x, xt = (torch.tensor((X[i] - mu) / sd, dtype=torch.float32) for i in (tr, te))
    y = torch.tensor((Y[tr] - ym) / ys, dtype=torch.float32)
    yt = torch.tensor(Y[te], dtype=torch.float64)
    print(f"{args.data}: n_train {len(tr):,}, n_test {len(te):,}, d {X.shape[1]}")
    rows = []
    pred, s = run_sgpr(x, y, xt, args.steps)
    m = min(500, len(tr))
    rows.append((f"GPyTorch SGPR (M={m})", pred * ys + ym, s))
    pred, s = run_svgp(x, y, xt, args.epochs)
    rows.append((f"GPyTorch SVGP (M={m})", pred * ys + ym, s))
    t = time.perf_counter()
    model = auto_fit(x, y, budget=args.budget)
    s = time.perf_counter() - t
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt).mean
    rows.append((f"gpfalkon auto_fit (M={model.auto_report.chosen['num_centers']})", pred * ys + ym, s))
    std = float(yt.std())
    print(f"{'method':<28} {'test RMSE':>10} {'NRMSE':>7} {'train s':>8}")
    for name, p, sec in rows:
        print(f"{name:<28} {rmse(p, yt):>10.4g} {rmse(p, yt) / std:>7.4f} {sec:>8.1f}")


if __name__ == "__main__":
    main()
