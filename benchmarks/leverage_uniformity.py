"""How uniform ``auto_fit``'s leverage scores are, and what the leverage pool gained at the first size.

For each dataset one ``auto_fit(train_x, train_y, budget, seed)`` run (``center_sampling="auto"``) with
``LEVERAGE_UNIFORM`` (``gpfalkon.auto.sampling``'s, as read by ``gpfalkon.auto.leverage``) set above 1 for the run, so
that the leverage try always scores every selection row and fits the leverage pool; the scores each pass returns are
recorded. Reported: the uniformity ``(sum l)^2 / (k sum l^2)`` of the first quarter's scores (what ``auto_fit``
decides on) and of all of them, their mean, the leverage pool's validation error over the uniform pool's at the first
size (``report.sampling``), the seconds of the try, and the run's test NRMSE. The table is the evidence for
``LEVERAGE_UNIFORM`` (docs/math.md §8 "Center pool").

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/leverage_uniformity.py --datasets kin40k protein bike --split 5 \\
        --out benchmarks/results/leverage-uniformity.md
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import dataset_run_arguments, environment_lines, log, markdown_table, write_result  # noqa: E402


def main() -> None:
    args = dataset_run_arguments((__doc__ or "").split("\n")[0], budget=10.0).parse_args()
    env = environment_lines()
    import torch

    import gpfalkon
    import gpfalkon.auto.leverage as auto_module  # the module that reads both names below
    from gpfalkon.auto.sampling import _score_uniformity

    import compare

    compare.SPLIT["k"] = args.split
    real = auto_module.dictionary_leverage_scores
    threshold = auto_module.LEVERAGE_UNIFORM
    calls: list[torch.Tensor] = []

    def recorded(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        calls.append(out.detach().double().clone())
        return out

    auto_module.dictionary_leverage_scores = recorded
    auto_module.LEVERAGE_UNIFORM = 2.0  # never reached: every try scores all rows and fits the leverage pool
    rows: list[list[object]] = []
    for name in args.datasets:
        calls.clear()
        data = compare.load_dataset(name)
        model = gpfalkon.auto_fit(data["xtr"], data["ytr"].double(), budget=args.budget, seed=args.seed)
        model.eval()
        with torch.no_grad():
            pred = model.posterior_mean(data["xte"]).double()
        yte = data["yte"].double()
        nrmse = float((pred - yte).square().mean().sqrt() / yte.std())
        smp = model.auto_report.sampling
        if not calls or "leverage_error" not in smp:
            why = next((n for n in model.auto_report.notes if n.startswith("leverage-score centers")), "no try")
            rows.append([name, "-", "-", "-", "-", "-", f"{nrmse:.4f}", why[:120]])
        else:
            head, full = calls[0], torch.cat(calls)
            uniformity = _score_uniformity
            rows.append([name, f"{uniformity(head):.3f}", f"{uniformity(full):.3f}", f"{float(full.mean()):.3f}",
                         f"{smp['leverage_error'] / smp['uniform_error']:.3f}", f"{smp['seconds']:.2f}",
                         f"{nrmse:.4f}", smp["chosen"]])
        log(" | ".join(str(v) for v in rows[-1]))
    body = (f"`auto_fit(budget={args.budget:g}, seed={args.seed})` per dataset, split {args.split}; the leverage try "
            "forced to score every selection row and fit the leverage pool (`LEVERAGE_UNIFORM` set above 1). "
            "Uniformity: `(sum l)^2 / (k sum l^2)` of the scores (1: all equal); `auto_fit` skips the try where the "
            f"first quarter's is at least `LEVERAGE_UNIFORM` = {threshold:g}. 'leverage / uniform': the two pools' "
            "validation errors at the first size; 'try s': the scores and the leverage fit.\n\n"
            + markdown_table(["dataset", "uniformity (first quarter)", "uniformity (all)", "mean score",
                              "leverage / uniform", "try s", "test NRMSE", "pool chosen"], rows))
    write_result(pathlib.Path(args.out), "Leverage scores' uniformity at auto_fit's first size", env, body)


if __name__ == "__main__":
    main()
