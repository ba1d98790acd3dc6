"""Outer-loop search benchmark: BoTorchSearch vs RandomSearch vs GridSearch, same budget.

Space: num_centers Integer(50, 2000, log), kernel in {rbf, matern12, matern32, matern52},
penalty LogFloat(1e-9, 1e-2), lengthscale_factor LogFloat(0.1, 10) (x the median
heuristic). Objective: validation RMSE of a FalkonGP fitted with 20 CG iterations.
Data: the source's split 0; its training part is split 80/20 (seeded) into train and
validation; X and y standardised with training statistics. For each dataset and
seed: best validation RMSE after 5, 10 and all evaluations, the test RMSE of the
configuration chosen (refitted on train, evaluated on the source's test split) and
the wall time of the whole search.

    .venv/bin/python benchmarks/tuning.py [--budget 25] [--seeds 0 1 2] [--datasets pol bike kin40k protein]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.tuning import (
    BoTorchSearch,
    Categorical,
    GridSearch,
    Integer,
    LogFloat,
    RandomSearch,
    falkon_validation_error,
)

from _common import REPO, environment_lines, log, markdown_table, write_result

DATA = REPO.parent / "shared" / "data"
SPACE = {
    "num_centers": Integer(50, 2000, log=True),
    "kernel": Categorical(["rbf", "matern12", "matern32", "matern52"]),
    "penalty": LogFloat(1e-9, 1e-2),
    "lengthscale_factor": LogFloat(0.1, 10.0),
}


def load(name: str, seed: int):
    with np.load(DATA / f"{name}.npz") as z:
        X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
        te = z["test_mask"][:, 0]
    tr_idx = np.flatnonzero(~te)
    rng = np.random.default_rng(seed)
    rng.shuffle(tr_idx)
    n_val = len(tr_idx) // 5
    va, tr = tr_idx[:n_val], tr_idx[n_val:]
    x, yy = torch.as_tensor(X), torch.as_tensor(y)
    mu, sd = x[tr].mean(0), x[tr].std(0).clamp_min(1e-12)
    ym, ys = yy[tr].mean(), yy[tr].std()
    x, yy = (x - mu) / sd, (yy - ym) / ys
    te_idx = np.flatnonzero(te)
    return x[tr], yy[tr], x[va], yy[va], x[te_idx], yy[te_idx]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["pol", "bike", "kin40k", "protein"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--budget", type=int, default=25)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "tuning.md")
    args = ap.parse_args()
    env = environment_lines()
    warnings.simplefilter("ignore")
    objective = falkon_validation_error(max_iter=20)
    rows, agg = [], {}
    t_all = time.perf_counter()
    for ds in args.datasets:
        for seed in args.seeds:
            xtr, ytr, xva, yva, xte, yte = load(ds, seed)
            for name, cls in (("BoTorch", BoTorchSearch), ("random", RandomSearch), ("grid", GridSearch)):
                t0 = time.perf_counter()
                res = cls(SPACE, objective, args.budget, seed=seed).run(xtr, ytr, xva, yva)
                wall = time.perf_counter() - t0
                bsf = res.best_so_far()
                test = objective(res.best_config, xtr, ytr, xte, yte)
                at = [bsf[min(k, len(bsf)) - 1] for k in (5, 10, args.budget)]
                rows.append([ds, seed, name, *at, test, wall, str(res.best_config)])
                agg.setdefault(name, []).append((at[-1], test, wall))
                log(f"{ds} seed {seed} {name:8s}: best val {at[-1]:.4f}, test {test:.4f}, {wall:.0f} s, "
                    f"{res.best_config}")
    table = markdown_table(
        ["dataset", "seed", "search", "best val @5", "best val @10", f"best val @{args.budget}", "test RMSE",
         "wall s", "best configuration"], rows, align="lrlrrrrrl")
    summary = markdown_table(
        ["search", "mean best val RMSE", "mean test RMSE", "mean wall s"],
        [[k, float(np.mean([a for a, _, _ in v])), float(np.mean([b for _, b, _ in v])),
          float(np.mean([c for _, _, c in v]))] for k, v in agg.items()], align="lrrr")
    body = (f"Budget {args.budget} evaluations per search; RMSE in standardised units.\n\n"
            f"Means over {len(args.datasets)} datasets x {len(args.seeds)} seeds:\n\n{summary}\n\n"
            f"All runs:\n\n{table}\n\n"
            f"Total {time.perf_counter() - t_all:.0f} s.\n")
    write_result(args.out, "Outer-loop search: BoTorch vs random vs grid", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
