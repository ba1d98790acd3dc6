"""Test error of FALKON fits at ``(M, rows)`` pairs with the hyperparameters ``auto_fit`` learned: do more
centers on fewer rows beat fewer centers on all rows at a similar cost?

One ``auto_fit`` run (``--budget``, ``--seed``; ``grow_select_rows`` as the library's default) gives a kernel and
a noise; then FALKON fits of that kernel at that noise (``lambda = noise / rows``) on the first ``rows`` of one
random permutation of the training rows, with the first ``M`` of those rows as centers, for every ``M:rows`` of
``--pairs``; each fit's wall time, CG iterations and test NRMSE (posterior mean) go to a table. Diagnosis only:
nothing in the library is chosen from it (``docs/math.md`` §8, "Selection rows that grow with the centers").

Usage (from the repository root):

    GPFALKON_DATA=/work/shared/data .venv/bin/python benchmarks/auto_rows_check.py --dataset flights \\
        --budget 40 --pairs 1000:50000 2000:50000 4000:50000 1000:400000 2000:400000 4000:200000 \\
        2000:1000000 1000:2000000 --out benchmarks/results/auto-rows-check.md
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time
import warnings

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpfalkon  # noqa: E402

from _common import environment_lines, log, markdown_table, write_result  # noqa: E402
from compare import load_dataset  # noqa: E402


def _pair(text: str) -> tuple[int, int]:
    m, _, rows = text.partition(":")
    if not (m.isdigit() and rows.isdigit() and int(m) >= 1 and int(rows) >= int(m)):
        raise argparse.ArgumentTypeError(f"{text!r} is not M:rows with 1 <= M <= rows")
    return int(m), int(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="flights")
    p.add_argument("--budget", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", type=_pair, nargs="+", required=True, help="M:rows pairs")
    p.add_argument("--max-iter", type=int, default=50)
    p.add_argument("--test-rows", type=int, default=200_000, help="first test rows scored (default 200,000)")
    p.add_argument("--out", default=str(HERE / "results" / "auto-rows-check.md"))
    args = p.parse_args()
    env = environment_lines()
    data = load_dataset(args.dataset)
    xtr, ytr = data["xtr"], data["ytr"]
    xte, yte = data["xte"][: args.test_rows], data["yte"][: args.test_rows].double()
    too_many = [f"{m}:{r}" for m, r in args.pairs if r > xtr.shape[0]]
    if too_many:
        p.error(f"--pairs {too_many}: {args.dataset} has {xtr.shape[0]:,} training rows")
    t = time.perf_counter()
    auto = gpfalkon.auto_fit(xtr, ytr, budget=args.budget, seed=args.seed)
    auto_s = time.perf_counter() - t
    rep = auto.auto_report
    noise = float(rep.chosen["noise_raw"])
    kernel = copy.deepcopy(auto.kernel)
    mean = float(auto.mean_constant)

    def nrmse(model: gpfalkon.FalkonGP) -> float:
        model.eval()
        with torch.no_grad():
            pred = model.posterior_mean(xte).double()
        return float((pred - yte).square().mean().sqrt() / yte.std())

    auto_err = nrmse(auto)
    del auto
    perm = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(args.seed + 1))
    rows_out = []
    for m, r in args.pairs:
        x, y = xtr[perm[:r]], ytr[perm[:r]]
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = gpfalkon.FalkonGP(x, y, kernel=copy.deepcopy(kernel), centers=x[:m].clone(), penalty=noise / r,
                                      mean_constant=mean, max_iter=args.max_iter, tol=1e-4).fit()
        wall = time.perf_counter() - t
        err = nrmse(model)
        its = model.fit_info.iterations if model.fit_info is not None else None
        log(f"M {m:,} rows {r:,}: {wall:.1f} s, {its} iterations, NRMSE {err:.4f}")
        rows_out.append([f"{m:,}", f"{r:,}", f"{m * r / 1e9:.2f}", f"{wall:.1f}", its, f"{err:.4f}"])
        del model
    body = (
        f"`auto_fit({args.dataset}, budget={args.budget:g}, seed={args.seed})`: {auto_s:.1f} s, test NRMSE "
        f"{auto_err:.4f} (M {rep.chosen['num_centers']}, {rep.chosen['final_rows']:,} final rows); its kernel "
        f"and noise {noise:.4g} (raw units) in every fit below. Test NRMSE on the first {yte.shape[0]:,} test "
        f"rows; CG to tol 1e-4 or {args.max_iter} iterations.\n\n"
        + markdown_table(["M", "rows", "M x rows (1e9)", "fit s", "CG iterations", "test NRMSE"], rows_out)
    )
    write_result(pathlib.Path(args.out), f"FALKON at (M, rows) pairs with auto_fit's hyperparameters: {args.dataset}",
                 env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
