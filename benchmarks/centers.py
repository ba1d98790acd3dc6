"""Uniform vs leverage-score (BLESS) Nyström centers: test error vs M, and what the scores cost.

    .venv/bin/python benchmarks/centers.py [--datasets uneven powerplant cadata kin40k protein]
        [--centers 50 100 200 400 800 1600] [--seeds 3]

For every dataset: RBF kernel at the median-heuristic lengthscale (the synthetic set
uses its own scale), lambda = noise / n with the noise chosen by hold-out on uniform
FALKON (``benchmarks/compare.py``'s ``select_noise``), then for each M and seed a
FALKON fit (20 CG iterations, float64 by default: ``--dtype float32`` runs the kernel
products in float32, which cannot resolve the small penalties the hold-out picks on some
of these sets, e.g. powerplant at lambda ~ 1e-6, and so blurs the comparison) with

* uniform centers: M rows without replacement (FALKON Alg. 1);
* leverage centers: M draws with replacement with probabilities proportional to BLESS
  approximate ridge leverage scores at the same lambda, duplicates merged, weighted
  preconditioner D (``FalkonGP(center_selection="leverage")`` does exactly this; here
  the scores are computed once per seed and reused for every M, as a user would).

Test NRMSE = RMSE / std(y_test), mean over seeds. "scores s" is the time of
``approximate_leverage_scores`` (once per seed), compared with a FALKON fit at the
largest M. d_eff is the sum of the approximate scores.

The synthetic "uneven" set: 40,000 training points in 2-d, 90% in a tight Gaussian
blob (sd 0.1) around the origin where the target is nearly linear, 10% uniform on
[-5, 5]^2 where the target is sin(2 x1) cos(2 x2) (lengthscale 0.4 needed); y has
noise sd 0.05; the test set (10,000) is drawn from the same mixture. Uniform centers put
90% of M in the blob; leverage scores put them where the kernel needs them.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

import gpytorch
import matplotlib
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import CGNotConvergedWarning, FalkonGP, approximate_leverage_scores, leverage_centers

from _common import REPO, environment_lines, log, markdown_table, write_result
from compare import load_dataset, median_ls, select_noise

matplotlib.use("Agg")


def uneven(seed: int = 0) -> dict:
    g = np.random.default_rng(seed)

    def draw(n):
        dense = g.random(n) < 0.9
        x = np.where(dense[:, None], 0.1 * g.standard_normal((n, 2)), g.uniform(-5, 5, (n, 2)))
        f = np.where(dense, 0.5 * x[:, 0], np.sin(2 * x[:, 0]) * np.cos(2 * x[:, 1]))
        return x, f + 0.05 * g.standard_normal(n)

    xtr, ytr = draw(40_000)
    xte, yte = draw(10_000)
    f32 = lambda a: torch.as_tensor(a, dtype=torch.float32)
    return dict(name="uneven", task="regression", xtr=f32(xtr), ytr=f32(ytr), xte=f32(xte), yte=f32(yte),
                y_scale=1.0, y_test_std=float(yte.std()), lengthscale=0.4)


def nrmse(model, data) -> float:
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = torch.cat([model(data["xte"][s : s + 20_000]).mean.double() for s in range(0, len(data["xte"]), 20_000)])
    return float((pred - data["yte"].double()).square().mean().sqrt()) * data["y_scale"] / data["y_test_std"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["uneven", "powerplant", "cadata", "kin40k", "protein"])
    ap.add_argument("--centers", nargs="+", type=int, default=[50, 100, 200, 400, 800, 1600])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "centers.md")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--max-dictionary-size", type=int, default=2048, help="BLESS dictionary cap")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment_lines()
    t_all = time.perf_counter()
    tables, curves, cost_rows, match_rows = [], {}, [], []
    warnings.simplefilter("ignore", CGNotConvergedWarning)
    for name in args.datasets:
        data = uneven() if name == "uneven" else load_dataset(name)
        for key in ("xtr", "ytr", "xte", "yte"):
            data[key] = data[key].to(dtype)
        xtr, ytr = data["xtr"], data["ytr"]
        n, d = xtr.shape
        ls = data.get("lengthscale") or median_ls(xtr)

        def kern(ls=ls):
            k = gpytorch.kernels.RBFKernel()
            k.lengthscale = ls
            return k

        noise = select_noise(data, kern, max(args.centers))
        lam = noise / n
        log(f"{name}: n={n:,} d={d} lengthscale {ls:.3g} noise {noise:g} (lambda {lam:.3g})")
        res = {("uniform", m): [] for m in args.centers}
        res.update({("leverage", m): [] for m in args.centers})
        distinct = {m: [] for m in args.centers}
        t_scores, d_effs = [], []
        capped = 0  # seeds whose BLESS dictionary hit max_dictionary_size
        t_fit_max = []
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scores = approximate_leverage_scores(xtr, kern(), lam, generator=torch.Generator().manual_seed(seed),
                                                     max_dictionary_size=args.max_dictionary_size)
            t_scores.append(time.perf_counter() - t0)
            capped += any("capped" in str(w.message) for w in caught)
            d_effs.append(float(scores.sum()))
            for m in args.centers:
                t1 = time.perf_counter()
                uni = FalkonGP(xtr, ytr, kernel=kern(), num_centers=m, penalty=lam, max_iter=20, tol=0, seed=seed).fit()
                if m == max(args.centers):
                    t_fit_max.append(time.perf_counter() - t1)
                res[("uniform", m)].append(nrmse(uni, data))
                sel = leverage_centers(xtr, m, kern(), lam, generator=torch.Generator().manual_seed(100 + seed),
                                       scores=scores)
                lev = FalkonGP(xtr, ytr, kernel=kern(), centers=sel.centers, center_weights=sel.weights, penalty=lam,
                               max_iter=20, tol=0).fit()
                res[("leverage", m)].append(nrmse(lev, data))
                distinct[m].append(sel.centers.shape[0])
            log(f"  seed {seed}: scores {t_scores[-1]:.1f} s, d_eff {d_effs[-1]:.0f}; " + ", ".join(
                f"M={m}: {res[('uniform', m)][-1]:.4f}/{res[('leverage', m)][-1]:.4f}" for m in args.centers))
        mean = {k: statistics.mean(v) for k, v in res.items()}
        curves[name] = mean
        rows = []
        for m in args.centers:
            rows.append([m, statistics.mean(distinct[m]), mean[("uniform", m)], mean[("leverage", m)],
                         mean[("leverage", m)] / mean[("uniform", m)]])
        tables.append(f"### {name} (n_train {n:,}, d {d}, lengthscale {ls:.3g}, noise n*lambda {noise:g}, "
                      f"d_eff ~ {statistics.mean(d_effs):.0f})\n\n" + markdown_table(
                          ["M (draws)", "distinct leverage centers", "uniform NRMSE", "leverage NRMSE",
                           "leverage / uniform"], rows))
        # fewest leverage centers reaching uniform's error at the largest M (interpolated on the grid)
        target = mean[("uniform", max(args.centers))]
        reach = next((m for m in args.centers if mean[("leverage", m)] <= target), None)
        match_rows.append([name, max(args.centers), target, reach if reach is not None else "not reached",
                           (max(args.centers) / reach) if reach else None])
        cost_rows.append([name, n, statistics.mean(t_scores), statistics.mean(t_fit_max),
                          statistics.mean(t_scores) / statistics.mean(t_fit_max), statistics.mean(d_effs),
                          f"{capped} of {args.seeds} seeds" if capped else "no"])
    # plot
    import matplotlib.pyplot as plt

    cols = min(3, len(curves))
    nrow = (len(curves) + cols - 1) // cols
    fig, axes = plt.subplots(nrow, cols, figsize=(4.3 * cols, 3.5 * nrow), squeeze=False)
    for ax, (name, mean) in zip(axes.flat, curves.items(), strict=False):
        for method, mk in (("uniform", "o-"), ("leverage", "s-")):
            ax.plot(args.centers, [mean[(method, m)] for m in args.centers], mk, label=method)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("M (centers drawn)")
        ax.set_ylabel("test NRMSE")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    fig.tight_layout()
    png = args.out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    body = "\n".join([
        f"FALKON, RBF kernel, 20 CG iterations, {args.dtype}; mean of {args.seeds} seeds "
        "(center draws and BLESS). See the module docstring for the setup.",
        "",
        "## Fewest centers reaching uniform sampling's error at the largest M",
        "",
        markdown_table(["dataset", "uniform M", "uniform NRMSE", "leverage M reaching it", "center saving"],
                       match_rows, align="lrrrr"),
        "",
        "Leverage M counts draws with replacement; the distinct leverage centers (the size of the system "
        "FALKON solves) are fewer, see the tables below, while uniform M are distinct centers: the saving "
        "counted in draws is conservative.",
        "",
        "## What the scores cost",
        "",
        markdown_table(["dataset", "n", "scores s (BLESS)", f"FALKON fit s at M={max(args.centers)}",
                        "scores / fit", "d_eff (approx.)", "dictionary capped"], cost_rows, align="lrrrrrl"),
        "",
        f"'dictionary capped': BLESS's dictionary reached `max_dictionary_size` = {args.max_dictionary_size} "
        "(oversampling x d_eff exceeds it at the smallest lambdas), so those scores are less accurate than "
        "the method's guarantee (`approximate_leverage_scores` warns); a larger cap costs O(n cap^2) more.",
        "",
        "## Error vs M",
        "",
        "\n\n".join(tables),
        "",
        f"Plot: `{png.name}`. Total {time.perf_counter() - t_all:.0f} s.",
    ])
    write_result(args.out, "Uniform vs leverage-score Nyström centers", env, body)
    log(f"written {args.out} and {png}")


if __name__ == "__main__":
    main()
