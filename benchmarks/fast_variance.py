"""Predictive variances through FALKON's approximation (``gpfalkon.settings.variance_factors("approximate")``)
against the exact posterior factors, on the comparison datasets.

For each ``--datasets`` set (``compare.py``'s data and split), ``gpfalkon.auto_fit`` with ``--budget`` seconds
chooses the hyperparameters and centers; then, for that one model, the exact variance factors
(``FalkonGP.posterior_factors(approximate=False)``: one data pass, ``2 n M^2`` float64 flops) and the
approximate ones (``approximate=True``: ``K_Mn K_nM`` replaced by ``(n/M) K_MM D^2 K_MM``, ``O(M^3)``, docs/math.md
§4.2) are timed, and the predictive variances (noise included) on the test rows compared: the relative difference
``|v_fast - v_exact| / v_exact`` (median, 99th percentile, largest) and the test NLPD of each (``compare.nlpd``,
raw units; the first ``--nlpd-rows`` test rows at most). The exact factors are skipped where they would cost
more than ``--max-flops``.

    GPFALKON_DATA=/work/shared/data .venv/bin/python benchmarks/fast_variance.py \
        --out benchmarks/results/fast-variance.md
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP, auto_fit, settings

import compare
from _common import environment_lines, log, markdown_table, write_result


def variances(model: FalkonGP, data: dict, xte: torch.Tensor, fast: bool) -> tuple[torch.Tensor, float]:
    """The standardised predictive variances at ``xte`` with exact or approximate factors, and the seconds
    forming those factors took."""
    t0 = time.perf_counter()
    model.posterior_factors(approximate=fast)
    factors_s = time.perf_counter() - t0
    with torch.no_grad(), settings.variance_factors("approximate" if fast else "exact"):
        v = compare.predict_chunks(lambda x: model.likelihood(model(x)).variance, xte)
    return v / data["y_scale"] ** 2, factors_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["protein", "bike", "kin40k", "pol", "cadata", "keggdirected"])
    ap.add_argument("--budget", type=float, default=15.0, help="auto_fit's budget per set (s)")
    ap.add_argument("--nlpd-rows", type=int, default=20_000)
    ap.add_argument("--max-flops", type=float, default=2e13, help="skip the exact factors above this")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    env = environment_lines()
    for line in env:
        log(line)
    rows = []
    t_all = time.perf_counter()
    for name in args.datasets:
        data = compare.load_dataset(name)
        ytr = data["ytr"].double() * data["y_scale"] + data["y_mean"]
        t = time.perf_counter()
        model = auto_fit(data["xtr"], ytr, budget=args.budget, seed=0)
        fit_s = time.perf_counter() - t
        model.eval()
        n, m = data["xtr"].shape[0], int(model.centers.shape[0])
        xte = data["xte"][: args.nlpd_rows]
        sub = dict(data, yte=data["yte"][: xte.shape[0]])
        with torch.no_grad():
            mean = (model.posterior_mean(xte).double() - data["y_mean"]) / data["y_scale"]
        v_fast, fast_s = variances(model, data, xte, True)
        nlpd_fast = compare.nlpd(sub, mean, v_fast)
        flops = 2.0 * n * m * m
        if flops > args.max_flops:
            rows.append([name, f"{n:,}", f"{m:,}", fit_s, f"skipped ({flops:.1e} flops)", fast_s, "-", "-", "-", "-",
                         "-", nlpd_fast])
            log(f"{name}: n={n} M={m}: fast {fast_s:.3f} s, NLPD {nlpd_fast:.4f}; exact skipped")
            continue
        v_exact, exact_s = variances(model, data, xte, False)
        nlpd_exact = compare.nlpd(sub, mean, v_exact)
        rel = ((v_fast - v_exact).abs() / v_exact).double()
        rows.append([name, f"{n:,}", f"{m:,}", fit_s, exact_s, fast_s, exact_s / fast_s, float(rel.median()),
                     float(torch.quantile(rel, 0.99)), float(rel.max()), nlpd_exact, nlpd_fast])
        log(f"{name}: n={n} M={m}: exact {exact_s:.2f} s, fast {fast_s:.3f} s; rel diff median "
            f"{float(rel.median()):.2e} max {float(rel.max()):.2e}; NLPD {nlpd_exact:.4f} vs {nlpd_fast:.4f}")
        del model
    body = ("## Exact and approximate predictive variances of one auto_fit model per set\n\n"
            f"auto_fit budget {args.budget:g} s; 'factors s': forming the variance factors (exact: one data pass, "
            "float64; fast: no data pass); 'rel diff': |v_fast - v_exact| / v_exact of the predictive variances "
            "(noise included) on the test rows; NLPD in raw units on at most "
            f"{args.nlpd_rows:,} test rows.\n\n"
            + markdown_table(["set", "n", "M", "auto_fit s", "exact factors s", "fast factors s", "speed-up",
                              "rel diff median", "rel diff p99", "rel diff max", "NLPD exact", "NLPD fast"], rows,
                             align="lrr" + "r" * 9)
            + f"\n\nTotal benchmark time {time.perf_counter() - t_all:.0f} s.")
    print(body)
    if args.out is not None:
        title = "Approximate predictive variances (settings.variance_factors)"
        log(f"written to {write_result(args.out, title, env, body)}")


if __name__ == "__main__":
    main()
