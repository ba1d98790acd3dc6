"""A/B of ``auto_fit``'s leave-one-out choice on small data (``loo_rows``): the stage off against on.

For each ``dataset`` (a built-in set of ``compare.py``) and each ``--splits`` split: ``auto_fit(train_x, train_y,
budget, seed)`` twice in this process, with ``loo_rows=0`` ("off": the validation rows' choice, as before session
56) and with the default ("on"), in an order that alternates from one run to the next (a shared machine's drifts hit
both). Per run: test NRMSE and NLPD (the predictive distribution, noise included) of both, the ratio on / off, both
wall times, and what the stage did (candidates scored of those kept, the winner, its noise factor, whether it refit).
Summary: the geometric mean of the ratios, how many are lower and higher, the largest. Each run is also written as a
line of ``<out>.jsonl`` as it ends.

Sets with more training rows than ``loo_rows``' default do not take the stage; both arms are then the same fit.

Usage (from the repository root; data from ``GPFALKON_DATA``, as ``compare.py``):

    .venv/bin/python benchmarks/loo_choice_ab.py --datasets wine yacht --splits 0 1 2 --budget 30 \\
        --out benchmarks/results/loo-choice-ab.md
"""
from __future__ import annotations

import json
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


def run(data: dict, budget: float, seed: int, loo: bool) -> dict:
    """One ``auto_fit`` run: its test NRMSE, NLPD, seconds and ``report.loo``."""
    import torch

    import gpfalkon

    xtr, ytr = torch.as_tensor(data["xtr"]).float(), torch.as_tensor(data["ytr"]).float()
    xte, yte = torch.as_tensor(data["xte"]).float(), torch.as_tensor(data["yte"]).double()
    t = time.perf_counter()
    model = gpfalkon.auto_fit(xtr, ytr, budget=budget, seed=seed, **({} if loo else {"loo_rows": 0}))
    seconds = time.perf_counter() - t
    rep = model.auto_report
    return dict(**predictive_scores(model, xte, yte), seconds=seconds,
                racer=rep.chosen["racer"], step=rep.chosen["step"], num_centers=rep.chosen["num_centers"],
                loo={k: v for k, v in rep.loo.items() if k != "scored"}, scored=len(rep.loo.get("scored", [])))


def main() -> None:
    args = dataset_run_arguments((__doc__ or "").splitlines()[0], budget=30.0, many_splits=True).parse_args()
    env = environment_lines()
    out = pathlib.Path(args.out)
    jsonl = empty_jsonl(out)
    rows, ratios, k = [], [], 0
    t_all = time.perf_counter()
    for split in args.splits:
        for name, data in split_datasets(args.datasets, split):
            arms = ("off", "on") if k % 2 == 0 else ("on", "off")
            k += 1
            got = {arm: run(data, args.budget, args.seed, arm == "on") for arm in arms}
            off, on = got["off"], got["on"]
            ratio = on["nrmse"] / off["nrmse"]
            ratios.append(ratio)
            loo = on["loo"]
            did = ("not run" if not loo else
                   f"{on['scored']} of {loo['points']}; {loo.get('winner', ('-', '-'))[0]} step "
                   f"{loo.get('winner', ('-', '-'))[1]}, noise x{loo.get('noise_factor', 1.0):g}"
                   + ("" if loo.get("refit") else ", no refit"))
            rows.append([f"{name} (split {split})", f"{data['xtr'].shape[0]:,}", f"{off['nrmse']:.4f}",
                         f"{on['nrmse']:.4f}", f"{ratio:.3f}", f"{off['nlpd']:.3f}", f"{on['nlpd']:.3f}",
                         f"{off['seconds']:.1f}", f"{on['seconds']:.1f}", did])
            with jsonl.open("a") as f:
                f.write(json.dumps(dict(dataset=name, split=split, n_train=int(data["xtr"].shape[0]), off=off, on=on,
                                        ratio=ratio, order=arms), default=str) + "\n")
            log(f"{name} split {split}: off {off['nrmse']:.4f} on {on['nrmse']:.4f} ratio {ratio:.3f} ({did})")
    body = (f"`auto_fit(train_x, train_y, budget={args.budget:g}, seed={args.seed})` with `loo_rows=0` ('off') and "
            "with the default ('on'), one after the other in one process (order alternating by run); test NRMSE and "
            "NLPD (the predictive distribution with its noise); 'stage': candidates scored of those kept, the winner, "
            "its noise factor.\n\n"
            + markdown_table(["dataset", "training rows", "off NRMSE", "on NRMSE", "on / off", "off NLPD", "on NLPD",
                              "off s", "on s", "stage"], rows)
            + f"\n\n{ratio_summary(ratios)}. Total {(time.perf_counter() - t_all) / 60:.1f} min.\n")
    write_result(out, "auto_fit's leave-one-out choice on small data: off against on", env, body)


if __name__ == "__main__":
    main()
