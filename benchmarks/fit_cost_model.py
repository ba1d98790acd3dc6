"""How well a FALKON fit's time at more centers is predicted from a fit measured at fewer.

``auto_fit`` decides how many centers the next selection size and the final fit can have from the
selection fits it has timed (``gpfalkon.auto.costs._scaled_fit_seconds``). This benchmark times selection-like
fits (``FalkonGP(...).fit()`` then a validation prediction, float32, Matern 5/2 ARD, ``max_iter=50``,
``tol=1e-4``, the penalty ``noise / n``) on a real dataset at a list of sizes ``M`` and, for every pair
``M < M'``, predicts the fit at ``M'`` from the one at ``M`` by

- the **structural** model (the library's): the preconditioner's factorisations x ``f^3``, its triangular
  solves in CG x ``f^2``, the rest (``K_nM``, data passes, validation predictions) x ``f``
  (``f = M' / M``; the parts from ``fit_info.extra``);
- the **one-exponent** model (``auto_fit`` up to commit f1050cd): the whole fit x ``f^p``, ``p`` measured
  over the previous step (from the size before ``M`` to ``M``), 2 where there is none, clipped to [1, 3].

Ratio = measured / predicted (1: exact; < 1: the prediction was too high, time left unused; > 1: too low,
a budget overrun). Each size is timed once, in increasing order, in one process.

    .venv/bin/python benchmarks/fit_cost_model.py --datasets protein kin40k \\
        --m 1000 1250 1600 2000 2500 3200 4000 8000 --out benchmarks/results/auto-cost-model.md

Data from ``GPFALKON_DATA`` (default ``../shared/data``), split as ``compare.py``: the first 80 % of the
training rows are fitted, the rest predicted.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
import warnings

import torch
from gpytorch.kernels import MaternKernel, ScaleKernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP
from gpfalkon.auto.costs import _scaled_fit_seconds

from _common import environment_lines, log, markdown_table, write_result
from compare import load_dataset


def time_fits(name: str, sizes: list[int], noise: float) -> dict[int, dict]:
    data = load_dataset(name)
    x, y = data["xtr"], data["ytr"]
    n_s = int(0.8 * x.shape[0])
    xs, ys, xv = x[:n_s], y[:n_s], x[n_s:]
    d = x.shape[1]
    kernel = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))
    with torch.no_grad():
        kernel.base_kernel.lengthscale = torch.full((d,), math.sqrt(2 * d))  # the median heuristic's scale
    perm = torch.randperm(n_s, generator=torch.Generator().manual_seed(0))
    out = {}
    for m in sizes:
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FalkonGP(xs, ys, kernel=kernel, centers=xs[perm[:m]], penalty=noise / n_s, max_iter=50,
                             tol=1e-4).fit()
        model.eval()
        with torch.no_grad():
            model.posterior_mean(xv)
        seconds = time.perf_counter() - t
        extra = model.fit_info.extra
        out[m] = dict(seconds=seconds, precond_seconds=float(extra.get("preconditioner_seconds", 0.0)),
                      apply_seconds=float(extra.get("precond_apply_seconds", 0.0)),
                      direct=extra.get("method") == "direct", iterations=model.fit_info.iterations, n=n_s)
        log(f"[{name}] M={m:,}: {seconds:.2f} s (factorisations {out[m]['precond_seconds']:.2f} s, triangular "
            f"solves {out[m]['apply_seconds']:.2f} s, {out[m]['iterations']} iterations)")
        del model
    return out


def one_exponent(fits: dict[int, dict], sizes: list[int], i: int, j: int) -> float:
    """The earlier rule: ``t(M) f^p``, ``p`` from the step before ``M`` (2 where there is none)."""
    m, m_new = sizes[i], sizes[j]
    p = 2.0
    if i > 0:
        prev = sizes[i - 1]
        p = min(3.0, max(1.0, math.log(fits[m]["seconds"] / fits[prev]["seconds"]) / math.log(m / prev)))
    return fits[m]["seconds"] * (m_new / m) ** p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["protein", "kin40k"])
    ap.add_argument("--m", type=int, nargs="+", default=[1000, 1250, 1600, 2000, 2500, 3200, 4000, 8000])
    ap.add_argument("--noise", type=float, default=1e-2, help="noise of the fits (standardised targets)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/auto-cost-model.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    sizes = sorted(set(args.m))
    sections = []
    summary_rows = []
    for name in args.datasets:
        fits = time_fits(name, sizes, args.noise)
        rows = []
        ratios: dict[str, list[float]] = {"structural": [], "one exponent": []}
        for i, m in enumerate(sizes):
            for j in range(i + 1, len(sizes)):
                m_new = sizes[j]
                if m_new > 2 * m:  # auto_fit grows by at most 2x per step (and 2x in the final growth)
                    continue
                actual = fits[m_new]["seconds"]
                s_pred = _scaled_fit_seconds([fits[m]], m_new / m)
                o_pred = one_exponent(fits, sizes, i, j)
                ratios["structural"].append(actual / s_pred)
                ratios["one exponent"].append(actual / o_pred)
                rows.append([f"{m:,} -> {m_new:,}", m_new / m, actual, s_pred, actual / s_pred, o_pred,
                             actual / o_pred])
        parts = [[f"{m:,}", f["seconds"], f["precond_seconds"], f["apply_seconds"],
                  f["seconds"] - f["precond_seconds"] - f["apply_seconds"], f["iterations"]]
                 for m, f in fits.items()]
        n_s = next(iter(fits.values()))["n"]
        sections.append(
            f"## {name} ({n_s:,} fitted rows)\n\n"
            + markdown_table(["M", "fit + validation s", "factorisations s", "triangular solves s", "rest s",
                              "iterations"], parts, align="rrrrrr")
            + "\n\n"
            + markdown_table(["M -> M'", "f", "measured s", "structural s", "ratio", "one exponent s", "ratio"],
                             rows, align="lrrrrrr")
        )
        for model_name, rs in ratios.items():
            logs = [math.log(r) for r in rs]
            summary_rows.append([name, model_name, len(rs), min(rs), statistics.median(rs), max(rs),
                                 math.exp(statistics.fmean(abs(v) for v in logs))])
    body = (
        f"Fits: float32, Matern 5/2 ARD (lengthscales sqrt(2 d)), noise {args.noise:g}, max_iter 50, tol 1e-4, "
        "uniform centers (a prefix of one permutation), then a prediction of the held-out 20 %; each size "
        "timed once, in increasing order. Ratio = measured / predicted; pairs up to a factor 2 (auto_fit's "
        "largest step).\n\n## Summary\n\n"
        + markdown_table(["dataset", "model", "pairs", "min ratio", "median ratio", "max ratio",
                          "geometric mean error factor"], summary_rows, align="llrrrrr")
        + "\n\n'geometric mean error factor' = exp(mean |log ratio|): 1 is exact.\n\n"
        + "\n\n".join(sections)
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "auto_fit's fit-time prediction: structural vs one exponent", env, body)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
