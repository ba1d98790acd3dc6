"""Small sets: would choosing noise and lengthscale multiplier again on all training rows beat auto_fit's choice?

For each ``dataset`` (a built-in set of ``compare.py``, its ``--split``): one ``auto_fit(train_x, train_y, budget)``
run; then, at its learned kernel, a grid of candidates (every lengthscale times ``m`` in ``--multipliers``, the
noise times ``f`` in ``--noise-factors``), each a FALKON fit with all of its fit rows as centers (exact kernel ridge
regression, so small sets only), scored two ways on the training rows: one random 20 % validation split (as
auto_fit holds out) and 5-fold cross-validation. Reported: the test NRMSE at auto_fit's own point (the grid's
``(1, 1)``, refitted the same way), at each rule's choice, and the best on the grid (an oracle by test error, shown
only as a bound), and the Spearman rank correlation of each score with the test error over the grid. The evidence for
a K-fold stage on small data (``benchmarks/results/auto-notes.md``, "Session 54").

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/kfold_reselect.py --datasets wine diabetes --split 0 --budget 30 \\
        --out benchmarks/results/kfold-reselect.md
"""
from __future__ import annotations

import copy
import itertools
import pathlib
import sys

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

MAX_ROWS = 5_000  # every candidate is an exact fit on all of its rows


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties broken by order: the grid's scores are continuous)."""
    import torch

    ra = torch.argsort(torch.argsort(torch.tensor(a))).double()
    rb = torch.argsort(torch.argsort(torch.tensor(b))).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def predict(kern, noise: float, x, y, at):  # type: ignore[no-untyped-def]
    """Kernel ridge regression on ``(x, y)`` (every row a center; ``noise = n lambda``) evaluated at ``at``."""
    import torch

    import gpfalkon

    fit = gpfalkon.FalkonGP(x, y, copy.deepcopy(kern), centers=x, penalty=noise / x.shape[0], max_iter=300, tol=1e-9)
    fit.fit()
    fit.eval()
    with torch.no_grad():
        return fit.posterior_mean(at).double().reshape(-1)


def main() -> None:
    p = dataset_run_arguments((__doc__ or "").split("\n")[0], budget=30.0)
    p.add_argument("--multipliers", type=float, nargs="+", default=[0.5, 0.7, 1.0, 1.4, 2.0])
    p.add_argument("--noise-factors", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0])
    p.add_argument("--folds", type=int, default=5)
    args = p.parse_args()
    env = environment_lines()
    import torch

    import gpfalkon
    from gpfalkon.auto.kernels import _scale_lengthscales

    rows: list[list[object]] = []
    for name, data in split_datasets(args.datasets, args.split, max_rows=MAX_ROWS):
        xtr, ytr = data["xtr"].double(), data["ytr"].double()
        xte, yte = data["xte"].double(), data["yte"].double()
        n = xtr.shape[0]
        model = gpfalkon.auto_fit(data["xtr"], ytr, budget=args.budget, seed=args.seed)
        kernel0 = copy.deepcopy(model.kernel).double()
        noise0 = float(model.penalty) * model.train_inputs[0].shape[0]

        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 7))
        val, keep = perm[: n // 5], perm[n // 5:]
        folds = perm.chunk(args.folds)
        grid = []
        for mult, factor in itertools.product(args.multipliers, args.noise_factors):
            kern = copy.deepcopy(kernel0)
            _scale_lengthscales(kern, mult)
            noise = noise0 * factor
            split_mse = float((predict(kern, noise, xtr[keep], ytr[keep], xtr[val]) - ytr[val]).square().mean())
            cv_mse = 0.0
            for i, fold in enumerate(folds):
                rest = torch.cat([f for j, f in enumerate(folds) if j != i])
                cv_mse += float((predict(kern, noise, xtr[rest], ytr[rest], xtr[fold]) - ytr[fold]).square().sum()) / n
            test = float((predict(kern, noise, xtr, ytr, xte) - yte).square().mean().sqrt() / yte.std())
            grid.append((mult, factor, split_mse, cv_mse, test))
        own = next(g for g in grid if g[0] == 1.0 and g[1] == 1.0)
        by_split, by_cv = min(grid, key=lambda g: g[2]), min(grid, key=lambda g: g[3])
        oracle = min(g[4] for g in grid)
        rows.append([f"{name} (split {args.split})", f"{own[4]:.4f}", f"{by_split[4]:.4f} (x{by_split[0]:g}, "
                     f"noise x{by_split[1]:g})", f"{by_cv[4]:.4f} (x{by_cv[0]:g}, noise x{by_cv[1]:g})",
                     f"{oracle:.4f}", f"{spearman([g[2] for g in grid], [g[4] for g in grid]):.2f}",
                     f"{spearman([g[3] for g in grid], [g[4] for g in grid]):.2f}"])
        log(" | ".join(str(v) for v in rows[-1]))
    body = (f"`auto_fit(budget={args.budget:g}, seed={args.seed})`, then its learned kernel with every lengthscale "
            f"times {args.multipliers} and its noise times {args.noise_factors}; each candidate a FALKON fit with all "
            "of its rows as centers, scored on one random 20 % validation split of the training rows and by "
            f"{args.folds}-fold cross-validation; test NRMSE of the refit on all training rows. 'auto_fit's point': "
            "the grid's (1, 1) refitted that way; 'best on the grid': by test error (a bound, chosen by nobody); "
            "Spearman: each score's rank correlation with the test error over the grid.\n\n"
            + markdown_table(["dataset", "auto_fit's point", "20 % split's choice", f"{args.folds}-fold choice",
                              "best on the grid", "Spearman (split, test)", "Spearman (CV, test)"], rows,
                             align="lrllrrr"))
    write_result(pathlib.Path(args.out), "Choosing noise and multiplier again on all training rows", env, body)


if __name__ == "__main__":
    main()
