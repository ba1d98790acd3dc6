"""Small sets: would the exact GP's hyperparameters, or every row as a center, beat auto_fit's final model?

For each ``dataset`` (a built-in set of ``compare.py``, its ``--split``; at most ``MAX_ROWS`` training rows): one
``auto_fit(train_x, train_y, budget)`` run, then five predictors of the test rows, each scored by test NRMSE:

* ``auto_fit``: the returned model (its own centers, float32 CG);
* ``its centers, solved``: the same kernel, penalty and centers, the Nyström system solved directly in float64
  (what the CG converges to: separates the solver's early stop from the centers);
* ``all rows as centers``: the same kernel and noise ``sigma^2 = n lambda``, every final row a center (exact kernel
  ridge regression, a dense Cholesky solve in float64);
* ``exact type-II ML``: GPyTorch's ``ExactGP`` (zero mean on the standardised targets, ``ScaleKernel`` of an ARD
  Matern 5/2, its lengthscales started at the median distance, noise at 0.1) fitted by BoTorch's
  ``fit_gpytorch_mll`` (L-BFGS-B on the exact marginal likelihood of every training row, at most ``--ml-iters``
  iterations), its posterior mean;
* ``type-II ML from auto_fit's``: the same fit started from auto_fit's kernel (its family, lengthscales and scale)
  and noise, on auto_fit's final rows;

and ``LOO choice`` (one for each type-II ML fit): of the two exact predictors with all rows as centers
(auto_fit's hyperparameters and the type-II ML ones), the one with the lower closed-form leave-one-out error on
the training rows (``r_i = [A^{-1} y]_i / [A^{-1}]_{ii}``, ``A = K + sigma^2 I``), a choice that uses every training
row and no test row. The evidence for what auto_fit leaves to its 20 % validation split on small data
(``benchmarks/results/auto-notes.md``, "Session 55").

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/small_exact_check.py --datasets wine diabetes --split 0 --budget 30 \\
        --out benchmarks/results/small-exact-check.md
"""
from __future__ import annotations

import copy
import pathlib
import sys
import time
import warnings

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    dataset_run_arguments,
    environment_lines,
    log,
    markdown_table,
    split_datasets,
    write_result,
)

MAX_ROWS = 4_000  # dense n x n solves in float64


def exact_solve(kernel, noise: float, x, y, at):  # type: ignore[no-untyped-def]
    """``(test predictions, leave-one-out mean squared error)`` of kernel ridge regression with every row of ``x``
    a center: ``A = K + noise I``, ``alpha = A^{-1} y``, LOO residuals ``alpha_i / [A^{-1}]_ii``."""
    import torch

    with torch.no_grad():
        a = kernel(x).to_dense().double() + noise * torch.eye(x.shape[0], dtype=torch.float64)
        chol = torch.linalg.cholesky(a)
        inv = torch.cholesky_inverse(chol)
        alpha = inv @ y
        loo = alpha / inv.diagonal()
        return kernel(at, x).to_dense().double() @ alpha, float(loo.square().mean())


def nystrom_solve(kernel, penalty: float, x, y, centers, at):  # type: ignore[no-untyped-def]
    """The Nyström KRR coefficients by a direct float64 solve of ``(K_Mn K_nM + n lambda K_MM) alpha = K_Mn y``."""
    import torch

    with torch.no_grad():
        knm = kernel(x, centers).to_dense().double()
        h = knm.mT @ knm + x.shape[0] * penalty * kernel(centers).to_dense().double()
        h.diagonal().add_(1e-12 * float(h.diagonal().mean()))
        return kernel(at, centers).to_dense().double() @ torch.linalg.solve(h, knm.mT @ y)


def type2_ml(x, y, max_iters: int, kernel=None, noise: float | None = None):  # type: ignore[no-untyped-def]
    """``(kernel, noise, seconds)`` of the exact GP fitted by BoTorch's ``fit_gpytorch_mll``; started from ``kernel``
    (a copy) and ``noise`` where given, else from the median heuristic."""
    import gpytorch
    import torch
    from botorch.fit import fit_gpytorch_mll

    class ExactModel(gpytorch.models.ExactGP):
        def __init__(self) -> None:
            super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = copy.deepcopy(kernel) if kernel is not None else gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=x.shape[1]))

        def transform_inputs(self, X, input_transform=None):  # type: ignore[no-untyped-def]
            return X  # BoTorch's fitting loop asks every model for this

        def forward(self, z):  # type: ignore[no-untyped-def]
            return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))

    model = ExactModel().double()
    if kernel is None:
        d = torch.cdist(x[:1000], x[:1000])
        model.covar_module.base_kernel.lengthscale = float(d[d > 0].median())
    model.likelihood.noise = 0.1 if noise is None else max(noise, 2e-4)  # inside the likelihood's 1e-4 bound
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), gpytorch.settings.max_cholesky_size(MAX_ROWS + 1):
        warnings.simplefilter("ignore")
        fit_gpytorch_mll(mll, optimizer_kwargs=dict(options=dict(maxiter=max_iters)))
    return model.covar_module, float(model.likelihood.noise.detach()), time.perf_counter() - t0


def main() -> None:
    p = dataset_run_arguments((__doc__ or "").split("\n")[0], budget=30.0)
    p.add_argument("--ml-iters", type=int, default=200)
    args = p.parse_args()
    env = environment_lines()
    import torch

    import gpfalkon

    import compare

    rows: list[list[object]] = []
    for name, data in split_datasets(args.datasets, args.split, max_rows=MAX_ROWS, task="regression"):
        x, y, xte = data["xtr"].double(), data["ytr"].double(), data["xte"].double()

        def err(pred, data: dict = data) -> float:  # type: ignore[no-untyped-def]
            return float(compare.metrics(data, pred)["error"])

        t0 = time.perf_counter()
        model = gpfalkon.auto_fit(data["xtr"], data["ytr"], budget=args.budget, seed=args.seed)
        t_auto = time.perf_counter() - t0
        model.eval()
        xf, yf = model.train_inputs[0].double(), model.train_targets.double().reshape(-1)
        kern = copy.deepcopy(model.kernel).double()  # the model keeps its float32 kernel
        penalty = float(model.penalty.detach())
        with torch.no_grad():
            e_auto = err(model.posterior_mean(data["xte"]).double())
        e_solved = err(nystrom_solve(kern, penalty, xf, yf, model.centers.double(), xte))
        pred_all, loo_auto = exact_solve(kern, penalty * xf.shape[0], xf, yf, xte)
        e_all = err(pred_all)
        try:
            k_ml, noise_ml, t_ml = type2_ml(x, y, args.ml_iters)
            pred_ml, loo_ml = exact_solve(k_ml, noise_ml, x, y, xte)
            e_ml = err(pred_ml)
            choice = f"{'ML' if loo_ml < loo_auto else 'auto_fit'} {min((loo_ml, e_ml), (loo_auto, e_all))[1]:.4f}"
            ml_cell = f"{e_ml:.4f} (noise {noise_ml:.2g}, {t_ml:.1f} s)"
        except Exception as exc:  # BoTorch's "All attempts to fit the model have failed" on some sets
            ml_cell, choice = f"failed: {type(exc).__name__}", "-"
        try:  # the same from auto_fit's point, on its final rows
            k_ma, noise_ma, t_ma = type2_ml(xf, yf, args.ml_iters, kern, penalty * xf.shape[0])
            pred_ma, loo_ma = exact_solve(k_ma, noise_ma, xf, yf, xte)
            e_ma = err(pred_ma)
            choice_a = f"{'ML' if loo_ma < loo_auto else 'auto_fit'} {min((loo_ma, e_ma), (loo_auto, e_all))[1]:.4f}"
            ma_cell = f"{e_ma:.4f} (noise {noise_ma:.2g}, {t_ma:.1f} s)"
        except Exception as exc:
            ma_cell, choice_a = f"failed: {type(exc).__name__}", "-"
        rows.append([f"{name} (split {args.split})", f"{model.centers.shape[0]:,} / {xf.shape[0]:,}",
                     f"{e_auto:.4f} ({t_auto:.1f} s)", f"{e_solved:.4f}", f"{e_all:.4f}", ml_cell, choice,
                     ma_cell, choice_a])
        log(" | ".join(str(v) for v in rows[-1]))
        report(args, env, rows)  # after every set: a long exact fit cut short leaves the sets before it


def report(args, env: list[str], rows: list[list[object]]) -> None:  # type: ignore[no-untyped-def]
    """Write the result file of the sets done so far."""
    body = (f"`auto_fit(budget={args.budget:g}, seed={args.seed})` on the training rows; test NRMSE of five predictors "
            "(the module docstring of `benchmarks/small_exact_check.py` defines them). 'LOO choice': the exact "
            "predictor (auto_fit's hyperparameters with all rows as centers, or the type-II ML ones) with the lower "
            "leave-one-out error on the training rows, and its test NRMSE; the last two columns: the same with the "
            "type-II ML fit started from auto_fit's kernel and noise, on its final rows.\n\n"
            + markdown_table(["dataset", "auto_fit M / final rows", "auto_fit", "its centers, solved",
                              "all rows as centers", "exact type-II ML", "LOO choice", "type-II ML from auto_fit's",
                              "LOO choice (from auto_fit's)"], rows, align="lrrrrllll"))
    write_result(pathlib.Path(args.out), "Small sets: auto_fit against exact solves and the exact GP's "
                 "hyperparameters", env, body)


if __name__ == "__main__":
    main()
