"""Where a model's test error comes from: auto_fit and GPyTorch SGPR, row by row, on one dataset and split.

For each ``dataset`` (a built-in set of ``compare.py``, its ``--split``): one ``auto_fit(train_x, train_y, budget)``
run and one GPyTorch SGPR run as ``compare.py`` trains it (500 learned inducing points, Adam to convergence or the
budget, float64 predictions). Per model: test NRMSE, the share of the squared test error carried by its 1, 5 and 10
worst rows, the NRMSE without its worst row, and that row's distance to the nearest training row in standardised
input units beside the median such distance over the test rows, with its largest standardised feature value beside
the training rows' largest in that feature. A few far-out test rows can carry most of a small set's squared error
(``benchmarks/results/auto-notes.md``, "Session 54": gas); the table says whether a difference between two models is
theirs.

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/error_concentration.py --datasets gas wine --split 0 --budget 30 \\
        --out benchmarks/results/error-concentration.md
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    dataset_run_arguments,
    environment_lines,
    log,
    markdown_table,
    split_datasets,
    write_result,
)


def concentration(residuals, x_test, x_train) -> dict:  # type: ignore[no-untyped-def]
    """The row-by-row figures of one model's test residuals (float64 tensors; inputs standardised)."""
    import torch

    sq = residuals.double().square()
    order = torch.argsort(sq, descending=True)
    total = float(sq.sum())
    worst = int(order[0])
    # nearest training row of every test row, in blocks of test rows (never a test x train matrix at once)
    nearest = torch.cat([torch.cdist(xb.double(), x_train.double()).min(1).values for xb in x_test.split(2048)])
    feat = int(x_test[worst].abs().argmax())
    rest = torch.ones_like(sq, dtype=torch.bool)
    rest[worst] = False
    return dict(share1=float(sq[order[:1]].sum()) / total, share5=float(sq[order[:5]].sum()) / total,
                share10=float(sq[order[:10]].sum()) / total, worst_dist=float(nearest[worst]),
                median_dist=float(nearest.median()), worst_z=float(x_test[worst, feat]), feature=feat,
                train_max=float(x_train[:, feat].abs().max()), rest_rmse=float(sq[rest].mean().sqrt()))


def main() -> None:
    args = dataset_run_arguments((__doc__ or "").split("\n")[0], budget=30.0).parse_args()
    env = environment_lines()
    import torch

    import gpfalkon

    import compare

    rows: list[list[object]] = []
    for name, data in split_datasets(args.datasets, args.split, task="regression"):
        yte, sd = data["yte"].double(), float(data["yte"].double().std())
        model = gpfalkon.auto_fit(data["xtr"], data["ytr"].double(), budget=args.budget, seed=args.seed)
        model.eval()
        with torch.no_grad():
            auto_pred = model.posterior_mean(data["xte"]).double().reshape(-1)
        sgpr = compare.run_sgpr(data, args.budget)[0]
        sgpr_pred = torch.as_tensor(sgpr["scores"]).detach().to(torch.float64).reshape(-1)
        for label, pred in (("auto_fit", auto_pred), ("GPyTorch SGPR", sgpr_pred)):
            r = pred - yte
            c = concentration(r, data["xte"], data["xtr"])
            rows.append([name, label, f"{float(r.square().mean().sqrt()) / sd:.4f}", f"{c['share1']:.2f}",
                         f"{c['share5']:.2f}", f"{c['share10']:.2f}", f"{c['rest_rmse'] / sd:.4f}",
                         f"{c['worst_dist']:.3g} ({c['median_dist']:.3g})",
                         f"{c['worst_z']:.3g} in feature {c['feature']} ({c['train_max']:.3g})"])
            log(" | ".join(str(v) for v in rows[-1]))
    body = (f"`auto_fit(budget={args.budget:g}, seed={args.seed})` and GPyTorch SGPR as `compare.py` trains it (budget "
            f"{args.budget:g} s), split {args.split}; inputs and targets standardised on the training rows as "
            "`compare.py` does. 'share of squared error': carried by the model's k worst test rows; 'NRMSE without "
            "its worst row': the same normaliser (the test targets' standard deviation); 'worst row's nearest "
            "training row': its distance to the nearest training row (the median of that distance over the test "
            "rows); 'worst row's largest |z|': its largest standardised feature (the training rows' largest "
            "|z| in that feature).\n\n"
            + markdown_table(["dataset", "model", "test NRMSE", "share of squared error, worst 1", "worst 5",
                              "worst 10", "NRMSE without its worst row", "worst row's nearest training row",
                              "worst row's largest z"], rows, align="llrrrrrrl"))
    write_result(pathlib.Path(args.out), "Where the test error comes from", env, body)


if __name__ == "__main__":
    main()
