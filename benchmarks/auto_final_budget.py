"""Where a grown final fit's time goes, and what its CG iterations buy against more centers.

For each dataset one ``auto_fit(train_x, train_y, budget, seed)`` run; at its learned kernel and penalty, on all
training rows, FALKON fits with uniform centers:

- ``--iterations``: at the run's number of centers ``M`` and at ``2 M``, fits stopped after each number of CG
  iterations in ``--iters`` (``tol=1e-12``): their test NRMSE and wall seconds. The question is whether a fixed
  time buys more as iterations at ``M`` or as centers at ``2 M`` with fewer iterations (docs/math.md §8 "Budget":
  a final fit is sized at the selection fits' iterations and its CG stops at the budget);
- ``--breakdown``: at ``M`` with 50 iterations, one penalty against penalty paths of two and three (the grown fit's
  ``growth_noises``): wall seconds and their parts from ``fit_info.extra`` (the preconditioner's build, the CG and
  the triangular solves in it; the rest of CG is the data passes).

Test NRMSE is for diagnosis only (no choice of the library reads it). Usage (from the repository root; data from
``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/auto_final_budget.py --datasets kin40k protein --budget 10 \\
        --out benchmarks/results/auto-final-budget.md
"""
from __future__ import annotations

import argparse
import copy
import functools
import pathlib
import sys
import warnings

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import dataset_run_arguments, environment_lines, log, markdown_table, timed, write_result  # noqa: E402


def _one(name: str, args: argparse.Namespace, it_rows: list[list[object]], br_rows: list[list[object]]) -> None:
    """The probes of one dataset, appended to ``it_rows`` (iterations) and ``br_rows`` (breakdown)."""
    import torch

    import gpfalkon

    import compare

    data = compare.load_dataset(name)
    x, y, xte, yte = data["xtr"], data["ytr"].double(), data["xte"], data["yte"].double()
    model = gpfalkon.auto_fit(x, y, budget=args.budget, seed=args.seed)
    m = int(model.centers.shape[0])
    # the run's penalty is per final row; the probe fits take all training rows
    noise = float(model.penalty.detach()) * int(model.train_targets.shape[0])
    y_t = y.to(x.dtype)
    n = x.shape[0]

    def nrmse(fit: gpfalkon.FalkonGP) -> float:
        fit.eval()
        with torch.no_grad():
            pred = fit.posterior_mean(xte).double()
        return float((pred - yte).square().mean().sqrt() / yte.std())

    def probe(centers: torch.Tensor, iters: int) -> gpfalkon.FalkonGP:
        return gpfalkon.FalkonGP(x, y_t, kernel=copy.deepcopy(model.kernel), centers=centers,
                                 penalty=noise / n, max_iter=iters, tol=1e-12)

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1))
    log(f"{name}: auto_fit M={m}, test NRMSE {nrmse(model):.4f}")
    if args.iterations:
        for size in (m, min(2 * m, n)):
            for iters in args.iters:
                fit = probe(x[perm[:size]], iters)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sec = timed(fit.fit)[0]
                it_rows.append([name, size, iters, f"{nrmse(fit):.4f}", f"{sec:.2f}"])
                log(" | ".join(str(v) for v in it_rows[-1]))
    if args.breakdown:
        for columns in (1, 2, 3):
            fit = probe(x[perm[:m]], 50)
            path = [noise / n * 4.0**j for j in range(columns)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sec, _, out = timed(fit.fit if columns == 1 else functools.partial(fit.fit_penalty_path, path))
            info = fit.fit_info if columns == 1 else out.info  # type: ignore[attr-defined]
            extra = info.extra if info is not None else {}
            pre, cg = extra.get("preconditioner_seconds", float("nan")), extra.get("cg_seconds", float("nan"))
            solves = extra.get("precond_apply_seconds", float("nan"))
            br_rows.append([name, m, columns, f"{sec:.2f}", f"{pre:.2f}", f"{cg:.2f}", f"{solves:.2f}",
                            f"{cg - solves:.2f}"])
            log(" | ".join(str(v) for v in br_rows[-1]))


def main() -> None:
    p = dataset_run_arguments((__doc__ or "").split("\n")[0], budget=10.0)
    p.add_argument("--iters", type=int, nargs="+", default=[5, 10, 20, 30, 50, 100])
    p.add_argument("--no-iterations", dest="iterations", action="store_false")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    args = p.parse_args()
    env = environment_lines()
    import compare

    compare.SPLIT["k"] = args.split
    it_rows: list[list[object]] = []
    br_rows: list[list[object]] = []
    for name in args.datasets:
        _one(name, args, it_rows, br_rows)
    body = (f"`auto_fit(budget={args.budget:g}, seed={args.seed})` per dataset on split {args.split}; then FALKON "
            "fits at its kernel and noise on all training rows, uniform centers (a fixed random draw), float32 "
            "data (the library's float64 products over the stored float32 `K_nM`).\n\n")
    if it_rows:
        body += ("## Test NRMSE against CG iterations, at the run's M and at 2 M\n\n"
                 + markdown_table(["dataset", "M", "iterations", "test NRMSE", "fit s"], it_rows) + "\n\n")
    if br_rows:
        body += ("## The fit at the run's M, 50 iterations: one penalty and paths of two and three\n\n"
                 "'precond s': the preconditioner's build (a path: `K_MM`'s factor once, one more per penalty); "
                 "'CG s': the iterations; 'solves s': the triangular solves in them; 'passes s' = CG - solves "
                 "(the data passes, each reading the stored `K_nM` once for every column).\n\n"
                 + markdown_table(["dataset", "M", "penalties", "fit s", "precond s", "CG s", "solves s",
                                   "passes s"], br_rows) + "\n")
    write_result(pathlib.Path(args.out), "auto_fit's final fit: iterations against centers, and its parts", env,
                 body)


if __name__ == "__main__":
    main()
