"""A/B of ``auto_fit``'s leave-one-out descent (session 58): the stage without it against with it.

For each ``dataset`` (a built-in set of ``compare.py``) and each ``--splits`` split: ``auto_fit(train_x, train_y,
budget, seed)`` twice in this process, with the descent off (``gpfalkon.auto.loo.LOO_DESCENT_EVALS`` set to infinity:
the stage as before, its refit in float64 from the exact coefficients) and on (the default), in an order that
alternates from one run to the next. ``--rows N`` takes a random ``N`` of the training rows (and at most 5,000 test
rows) of sets with more, so that larger sets reach the stage (``loo_rows``). Per run: test NRMSE and NLPD of both, the
ratio on / off, both wall times, and what the descent did (evaluations, noise factor, the midpoint overshoot check).
Summary: the geometric mean of the ratios, how many are lower and higher, the largest, the mean NLPD difference. Each
run is also written as a line of ``<out>.jsonl`` as it ends.

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/loo_descent_ab.py --datasets wine yacht --splits 0 1 2 --budget 30 \\
        --out benchmarks/results/loo-descent-ab.md
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    dataset_run_arguments,
    empty_jsonl,
    environment_lines,
    log,
    markdown_table,
    predictive_scores,
    ratio_summary,
    split_datasets,
    write_result,
)


def run(data: dict, budget: float, seed: int, descent: bool) -> dict:
    """One ``auto_fit`` run: its test NRMSE, NLPD, seconds and ``report.loo["descent"]``."""
    import torch

    import gpfalkon
    import gpfalkon.auto.loo as auto_mod

    evals = auto_mod.LOO_DESCENT_EVALS
    auto_mod.LOO_DESCENT_EVALS = evals if descent else math.inf
    try:
        xtr, ytr = torch.as_tensor(data["xtr"]).float(), torch.as_tensor(data["ytr"]).float()
        t = time.perf_counter()
        model = gpfalkon.auto_fit(xtr, ytr, budget=budget, seed=seed)
        seconds = time.perf_counter() - t
    finally:
        auto_mod.LOO_DESCENT_EVALS = evals
    xte, yte = torch.as_tensor(data["xte"]).float(), torch.as_tensor(data["yte"]).double()
    return dict(**predictive_scores(model, xte, yte), seconds=seconds, descent=model.auto_report.loo.get("descent"))


def subsample(data: dict, rows: int, seed: int) -> dict:
    """A random ``rows`` of the training rows and at most 5,000 random test rows (the same for both arms)."""
    import torch

    if not rows or data["xtr"].shape[0] <= rows:
        return data
    g = torch.Generator().manual_seed(seed)
    tr = torch.randperm(data["xtr"].shape[0], generator=g)[:rows]
    te = torch.randperm(data["xte"].shape[0], generator=g)[:5000]
    return dict(data, xtr=data["xtr"][tr], ytr=data["ytr"][tr], xte=data["xte"][te], yte=data["yte"][te])


def main() -> None:
    p = dataset_run_arguments((__doc__ or "").splitlines()[0], budget=30.0, many_splits=True)
    p.add_argument("--rows", type=int, default=0)
    args = p.parse_args()
    env = environment_lines()
    out = pathlib.Path(args.out)
    jsonl = empty_jsonl(out)
    rows, ratios, nlpd_diff, k = [], [], [], 0
    t_all = time.perf_counter()
    for split in args.splits:
        for name, data in split_datasets(args.datasets, split):
            data = subsample(data, args.rows, 100 + split)
            arms = ("off", "on") if k % 2 == 0 else ("on", "off")
            k += 1
            got = {arm: run(data, args.budget, args.seed, arm == "on") for arm in arms}
            off, on = got["off"], got["on"]
            ratio = on["nrmse"] / off["nrmse"]
            ratios.append(ratio)
            nlpd_diff.append(on["nlpd"] - off["nlpd"])
            d = on["descent"]
            did = ("not run" if not d else
                   f"{d['evaluations']} evaluations, noise x{d['noise_factor']:.2g}"
                   + (f", overshoot {d['overshoot_start']:.2f} -> {d['overshoot']:.2f}"
                      + ("" if d["kept"] else ", dropped") if "kept" in d else ", no gain"))
            rows.append([f"{name} (split {split})", f"{data['xtr'].shape[0]:,}", f"{off['nrmse']:.4f}",
                         f"{on['nrmse']:.4f}", f"{ratio:.3f}", f"{off['nlpd']:.3f}", f"{on['nlpd']:.3f}",
                         f"{off['seconds']:.1f}", f"{on['seconds']:.1f}", did])
            with jsonl.open("a") as f:
                f.write(json.dumps(dict(dataset=name, split=split, n_train=int(data["xtr"].shape[0]), off=off, on=on,
                                        ratio=ratio, order=arms), default=str) + "\n")
            log(f"{name} split {split}: off {off['nrmse']:.4f} on {on['nrmse']:.4f} ratio {ratio:.3f} ({did})")
    rows_note = f"; {args.rows:,} random training rows" if args.rows else ""
    body = (f"`auto_fit(train_x, train_y, budget={args.budget:g}, seed={args.seed})` with the leave-one-out "
            "descent off ('off': `LOO_DESCENT_EVALS` = inf) and on (the default), one after the other in one process "
            f"(order alternating by run){rows_note}; test "
            "NRMSE and NLPD (the predictive distribution with its noise).\n\n"
            + markdown_table(["dataset", "training rows", "off NRMSE", "on NRMSE", "on / off", "off NLPD", "on NLPD",
                              "off s", "on s", "descent"], rows)
            + f"\n\n{ratio_summary(ratios)}; NLPD on - off: mean {sum(nlpd_diff) / max(len(nlpd_diff), 1):+.3f}. "
            f"Total {(time.perf_counter() - t_all) / 60:.1f} min.\n")
    write_result(out, "auto_fit's leave-one-out descent: off against on", env, body)


if __name__ == "__main__":
    main()
