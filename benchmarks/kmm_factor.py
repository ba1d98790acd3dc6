"""CG with ``K_MM`` through the preconditioner's factor (``gpfalkon.settings.kmm_through_factor``, docs/math.md
§3.2) against the dense ``K_MM`` product in every iteration.

One FALKON fit per timing (``FalkonGP(...).fit()``, CG, exactly ``--iterations`` iterations, ``K_nM`` stored)
on the synthetic problem of ``benchmarks/fit.py`` (d = 20, RBF, median-heuristic lengthscale, penalty
1e-6) at the sizes where the ``O(M^2)`` part of an iteration matters (``n`` a few times ``M``: the selection
fits of ``auto_fit``) and at the 200k reference problem. Arms alternated within each repetition, after one
warm-up fit each. Reported: median CG seconds per iteration (``fit_info.extra["cg_seconds"]`` /
iterations), the part of them outside the data pass (triangular solves, and the ``K_MM`` product in the
dense arm), the whole fit, and the test RMSE of both arms (the system solved is the same).

    .venv/bin/python benchmarks/kmm_factor.py --out benchmarks/results/kmm-through-factor.md
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fit import fit_falkon, make_kernel, median_lengthscale, predict_model, rmse, synthetic, uniform_centers

from gpfalkon import settings

from _common import environment_lines, log, markdown_table, write_result

ARMS = {"through the factor": True, "dense K_MM": False}


def one(arm: str, keep: bool, case: tuple, rec: dict[str, dict[str, list[float]]]) -> None:
    """One fit in ``arm`` on ``case = (x, y, centers, kernel, x_test, y_test, iterations)``; recorded in ``rec``
    when ``keep``."""
    x, y, c, k, xte, yte, iterations = case
    gc.collect()
    with settings.kmm_through_factor(ARMS[arm]):
        model, wall, _, _ = fit_falkon(x, y, c, k, 1e-6, iterations, 0.0)
    e, it = model.fit_info.extra, model.fit_info.iterations
    if keep:
        r = rec[arm]
        r["cg"].append(e["cg_seconds"] / it)
        r["rest"].append(e["precond_apply_seconds"] / it)
        r["fit"].append(wall)
        r["rmse"].append(rmse(predict_model(model, xte, 20_000), yte))
    del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["15000:1000", "15000:2000", "40000:2000", "40000:3000",
                                                   "200000:2000"], help="n:M pairs")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    env = environment_lines()
    dtype = getattr(torch, args.dtype)
    rows = []
    for size in args.sizes:
        n, m = (int(v) for v in size.split(":"))
        xtr, ytr, xte, yte, _ = synthetic(n, 5000, 20, 0)
        ls = float(median_lengthscale(xtr))
        idx = uniform_centers(xtr, m, torch.Generator().manual_seed(0)).indices
        x, y, c = xtr.to(dtype), ytr.to(dtype), xtr[idx].clone().to(dtype)
        k = make_kernel("rbf", ls, dtype)
        rec: dict[str, dict[str, list[float]]] = {a: {"cg": [], "rest": [], "fit": [], "rmse": []} for a in ARMS}

        case = (x, y, c, k, xte.to(dtype), yte, args.iterations)
        for arm in ARMS:
            one(arm, False, case, rec)
        for rep in range(args.repeats):
            for arm in (list(ARMS) if rep % 2 == 0 else list(ARMS)[::-1]):
                one(arm, True, case, rec)
        base = statistics.median(rec["dense K_MM"]["cg"])
        for arm in ARMS:
            r = rec[arm]
            cg = statistics.median(r["cg"])
            rows.append([n, m, arm, 1e3 * cg, 1e3 * statistics.median(r["rest"]), statistics.median(r["fit"]),
                         base / cg, r["rmse"][-1]])
            log(f"n={n} M={m} {arm}: CG {1e3 * cg:.2f} ms / iteration, x dense {base / cg:.2f}")
    body = (f"{args.dtype}, d = 20, RBF, penalty 1e-6, exactly {args.iterations} CG iterations, K_nM stored; median "
            f"of {args.repeats} fits per arm, arms alternated. 'outside the pass' = "
            "`precond_apply_seconds` / iterations: in the dense arm the four triangular solves (the K_MM product "
            "is counted with the pass there), in the other the four solves and the K_MM term through T. "
            "'CG vs dense' = the dense arm's CG time per iteration / the arm's.\n\n"
            + markdown_table(["n", "M", "arm", "CG ms / iteration", "outside the pass ms", "fit s", "CG vs dense",
                              "test RMSE"], rows, align="rrl" + "r" * 5))
    if args.out is not None:
        write_result(args.out, "CG with K_MM through the preconditioner's factor vs the dense K_MM product", env, body)
        log(f"written {args.out}")
    else:
        print(body)


if __name__ == "__main__":
    main()
