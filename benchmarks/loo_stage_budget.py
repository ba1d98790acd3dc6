"""``auto_fit``'s leave-one-out stage (``loo_rows``) against its budget: the predicted score time, and the stage
started only where three scores are predicted to fit (session 57) against always started (session 56).

Part 1, the predictor: for each ``--rows`` n, ``gpfalkon.auto.loo._loo_score_seconds(n)`` (a timed float64
factorisation and inverse of order ``min(n, 1024)``, scaled by the cube of the order) against the measured seconds
of one ``_loo_score`` at ``n`` rows (a Matern 5/2 ARD kernel on uniform inputs in 5 dimensions; the faster of two).

Part 2, the budget: ``auto_fit(x, y, budget, seed=0)`` on ``y = sin(3 x_0) + 0.1 e`` (``x`` uniform in 3 dimensions)
for each ``--rows`` n and ``--budgets`` budget, and on each ``--datasets`` set of ``compare.py`` (split 0) at each
budget, twice in this process in alternating order: "always" with the predictor replaced by 0 (the stage then runs
wherever it applies and its first score is taken unconditionally, as in session 56), and "predicted" (the committed
code). Per run: wall seconds over the budget, the stage's seconds, how many points it scored (or "skipped"), whether
it refit, and the test NRMSE on held-out rows (2,000 fresh synthetic rows; the set's test rows).

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/loo_stage_budget.py --rows 1000 2000 3000 4000 --budgets 3 5 10 30 \\
        --datasets abalone sml --out benchmarks/results/loo-stage-budget.md
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import warnings

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import empty_jsonl, environment_lines, log, markdown_table, split_datasets, write_result  # noqa: E402


def predictor_rows(rows: list[int]) -> list[list[str]]:
    """Part 1: predicted against measured seconds of one score."""
    import torch

    import gpfalkon.auto.loo as auto_mod
    from gpfalkon.models.defaults import default_kernel

    out = []
    for n in rows:
        g = torch.Generator().manual_seed(n)
        x = torch.rand(n, 5, generator=g, dtype=torch.float64)
        y = torch.randn(n, generator=g, dtype=torch.float64)
        k = default_kernel(5, dtype=torch.float64)
        measured = math.inf
        for _ in range(2):
            t = time.perf_counter()
            auto_mod._loo_score(k, 1.0, 0.01, x, y)
            measured = min(measured, time.perf_counter() - t)
        predicted = auto_mod._loo_score_seconds(n, torch.device("cpu"))
        out.append([f"{n:,}", f"{predicted:.3f}", f"{measured:.3f}", f"{predicted / measured:.2f}"])
        log(f"predictor n={n}: predicted {predicted:.3f} s, measured {measured:.3f} s")
    return out


def one_run(x, y, xt, yt, budget: float, arm: str) -> dict:
    """``auto_fit`` with the stage's predictor as committed (``predicted``) or replaced by 0 (``always``)."""
    import torch

    import gpfalkon
    import gpfalkon.auto.loo_stage as auto_mod  # the module that reads the predictor

    real = auto_mod._loo_score_seconds
    if arm == "always":
        auto_mod._loo_score_seconds = lambda n, device: 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            model = gpfalkon.auto_fit(x, y, budget=budget, seed=0)
            seconds = time.perf_counter() - t
    finally:
        auto_mod._loo_score_seconds = real
    model.eval()
    with torch.no_grad():
        mean = model(xt).mean.double()
    rep = model.auto_report
    loo = rep.loo
    return dict(seconds=seconds, over=seconds / budget, stage=rep.stages.get("loo", 0.0),
                scored="skipped" if loo.get("skipped") else ("-" if not loo else len(loo.get("scored", []))),
                refit=bool(loo.get("refit")),
                nrmse=float((mean - yt).square().mean().sqrt() / yt.std()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1000, 2000, 3000, 4000])
    p.add_argument("--budgets", nargs="+", type=float, default=[3.0, 5.0, 10.0, 30.0])
    p.add_argument("--datasets", nargs="*", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch

    env = environment_lines()
    out = pathlib.Path(args.out)
    jsonl = empty_jsonl(out)
    t_all = time.perf_counter()
    pred_rows = predictor_rows(args.rows)

    cases = []
    for n in args.rows:
        g = torch.Generator().manual_seed(7 + n)
        x, xt = torch.rand(n, 3, generator=g), torch.rand(2000, 3, generator=g)
        y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)
        yt = (torch.sin(3 * xt[:, 0]) + 0.1 * torch.randn(2000, generator=g)).double()
        cases.append((f"synthetic n={n:,}", x, y, xt, yt))
    for name, data in split_datasets(args.datasets, 0):
        cases.append((f"{name} (n={data['xtr'].shape[0]:,})", torch.as_tensor(data["xtr"]).float(),
                      torch.as_tensor(data["ytr"]).float(), torch.as_tensor(data["xte"]).float(),
                      torch.as_tensor(data["yte"]).double()))
    rows, k = [], 0
    for label, x, y, xt, yt in cases:
        for budget in args.budgets:
            arms = ("always", "predicted") if k % 2 == 0 else ("predicted", "always")
            k += 1
            got = {arm: one_run(x, y, xt, yt, budget, arm) for arm in arms}
            a, b = got["always"], got["predicted"]
            rows.append([label, f"{budget:g}", f"{a['over']:.2f}", f"{b['over']:.2f}", f"{a['stage']:.2f}",
                         f"{b['stage']:.2f}", f"{a['scored']}{' refit' if a['refit'] else ''}",
                         f"{b['scored']}{' refit' if b['refit'] else ''}", f"{a['nrmse']:.4f}", f"{b['nrmse']:.4f}"])
            with jsonl.open("a") as f:
                f.write(json.dumps(dict(case=label, budget=budget, order=arms, **got)) + "\n")
            log(f"{label} budget {budget:g}: always {a['over']:.2f}x ({a['scored']}), "
                f"predicted {b['over']:.2f}x ({b['scored']})")
    body = ("Part 1, one leave-one-out score at `n` rows: the predictor `_loo_score_seconds(n)` against the measured "
            "seconds (the faster of two).\n\n"
            + markdown_table(["n", "predicted s", "measured s", "predicted / measured"], pred_rows)
            + "\n\nPart 2, `auto_fit(x, y, budget, seed=0)`: wall seconds over the budget, the stage's seconds, points "
            "scored, test NRMSE; 'always': the stage starts wherever it applies (its first score unconditional, as "
            "in session 56); 'predicted': only where three scores are predicted to fit its share (the committed "
            "code). Both in this process, order alternating by row.\n\n"
            + markdown_table(["case", "budget s", "always: s / budget", "predicted: s / budget", "always: stage s",
                              "predicted: stage s", "always: scored", "predicted: scored", "always: NRMSE",
                              "predicted: NRMSE"], rows)
            + f"\n\nTotal {(time.perf_counter() - t_all) / 60:.1f} min.\n")
    write_result(out, "auto_fit's leave-one-out stage against its budget", env, body)


if __name__ == "__main__":
    main()
