"""Outer-loop search benchmark: BoTorchSearch (plain and cost-aware) vs RandomSearch vs GridSearch,
at equal wall time and at equal numbers of evaluations.

Space: num_centers Integer(200, 5000, log), kernel in {rbf, matern12, matern32, matern52},
penalty LogFloat(1e-9, 1e-2), lengthscale_factor LogFloat(0.1, 10) (x the median heuristic).
Objective: validation RMSE of a FalkonGP fitted on the whole training part with 20 CG
iterations (float64): evaluations cost about 0.5-10 s, growing with num_centers, which is where
model-based and cost-aware search should pay off. Data: the source's split 0; its training part
is split 80/20 (seeded) into train and validation; X and y standardised with training statistics.

Every search runs until ``--evals`` evaluations or ``--seconds`` of wall time (suggestion time
included: BoTorch's surrogate fits and acquisition optimisation count against it), whichever comes
first. Reported per dataset and seed: the best validation RMSE reached by 1/3, 2/3 and all of the
wall time (equal wall time), after 5, 10 and 20 evaluations (equal evaluations; '-' when not
reached in the time), the number of evaluations, the test RMSE of the configuration chosen
(refitted on train, evaluated on the source's test split), and where BoTorch's time went
(surrogate fits, acquisition optimisation, evaluations).

    .venv/bin/python benchmarks/tuning.py [--seconds 45] [--evals 40] [--seeds 0 1 2] \
        [--datasets pol bike kin40k protein]
"""
from __future__ import annotations

import argparse
import os
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

DATA = pathlib.Path(os.environ.get("GPFALKON_DATA", REPO.parent / "shared" / "data"))
SPACE = {
    "num_centers": Integer(200, 5000, log=True),
    "kernel": Categorical(["rbf", "matern12", "matern32", "matern52"]),
    "penalty": LogFloat(1e-9, 1e-2),
    "lengthscale_factor": LogFloat(0.1, 10.0),
}
SEARCHES = {
    "BoTorch": lambda obj, evals, seed: BoTorchSearch(SPACE, obj, evals, seed=seed),
    "BoTorch cost-aware": lambda obj, evals, seed: BoTorchSearch(SPACE, obj, evals, seed=seed, cost_aware=True),
    "random": lambda obj, evals, seed: RandomSearch(SPACE, obj, evals, seed=seed),
    "grid": lambda obj, evals, seed: GridSearch(SPACE, obj, evals, seed=seed),
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


def best_by(points: list[tuple[float, float]], limit: float) -> float:
    """Best value among the points whose first coordinate is <= limit (inf if none)."""
    vals = [v for t, v in points if t <= limit]
    return min(vals) if vals else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["pol", "bike", "kin40k", "protein"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--seconds", type=float, default=45.0, help="wall-clock budget per search")
    ap.add_argument("--evals", type=int, default=40, help="evaluation budget per search")
    ap.add_argument("--searches", nargs="+", default=list(SEARCHES), choices=list(SEARCHES))
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "tuning.md")
    args = ap.parse_args()
    env = environment_lines()
    warnings.simplefilter("ignore")
    base = falkon_validation_error(max_iter=20)
    T = args.seconds
    marks = (T / 3, 2 * T / 3, T)
    rows, agg, over = [], {}, []
    t_all = time.perf_counter()
    for ds in args.datasets:
        for seed in args.seeds:
            xtr, ytr, xva, yva, xte, yte = load(ds, seed)
            for name in args.searches:
                ends: list[float] = []
                t0 = time.perf_counter()

                def objective(config, *data, _ends=ends, _t0=t0):
                    v = base(config, *data)
                    _ends.append(time.perf_counter() - _t0)  # elapsed at the end of this evaluation
                    return v

                search = SEARCHES[name](objective, args.evals, seed)
                res = search.run(xtr, ytr, xva, yva, time_budget=T)
                wall = time.perf_counter() - t0
                bsf = res.best_so_far()
                timed = list(zip(ends, bsf, strict=True))
                at_t = [best_by(timed, m) for m in marks]
                at_n = [bsf[k - 1] if len(bsf) >= k else float("nan") for k in (5, 10, 20)]
                test = float(base(res.best_config, xtr, ytr, xte, yte))
                rows.append([ds, seed, name, *at_t, *at_n, len(bsf), test, wall, str(res.best_config)])
                agg.setdefault(name, []).append((*at_t, *at_n, len(bsf), test))
                if isinstance(search, BoTorchSearch):
                    evals = sum(t.seconds for t in res.history)
                    over.append([ds, seed, name, wall, search.timings["fit_gp"], search.timings["optimize_acqf"],
                                 evals, len(bsf)])
                log(f"{ds} seed {seed} {name:18s}: best val {at_t[-1]:.4f} ({len(bsf)} evals), test {test:.4f}, "
                    f"{wall:.0f} s, {res.best_config}")
    labels = [f"best val by {m:.0f} s" for m in marks] + [f"best val @{k}" for k in (5, 10, 20)]
    table = markdown_table(["dataset", "seed", "search", *labels, "evals", "test RMSE", "wall s",
                            "best configuration"], rows, align="lrl" + "r" * 10 + "l")
    summary = []
    for k, v in agg.items():
        a = np.array(v, dtype=float)
        summary.append([k, *[float(np.mean(a[:, i])) for i in range(3)],
                        *[float(np.nanmean(a[:, i])) if np.isfinite(a[:, i]).any() else float("nan")
                          for i in range(3, 6)],
                        float(np.mean(a[:, 6])), float(np.mean(a[:, 7]))])
    summary_t = markdown_table(["search", *[f"mean {lab}" for lab in labels], "mean evals", "mean test RMSE"],
                               summary, align="l" + "r" * 8)
    over_t = markdown_table(["dataset", "seed", "search", "wall s", "surrogate fits s", "acquisition opt. s",
                             "evaluations s", "evals"], over, align="lrlrrrrr")
    body = (f"Each search: up to {args.evals} evaluations within {T:g} s of wall time (suggestion time "
            f"included). RMSE in standardised units; '@k' columns average over the runs that reached k "
            f"evaluations (NaN where none did).\n\n"
            f"Means over {len(args.datasets)} datasets x {len(args.seeds)} seeds:\n\n{summary_t}\n\n"
            f"Where BoTorchSearch's wall time went:\n\n{over_t}\n\n"
            f"All runs:\n\n{table}\n\n"
            f"Total {time.perf_counter() - t_all:.0f} s.\n")
    write_result(args.out, "Outer-loop search at equal wall time and equal evaluations", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
