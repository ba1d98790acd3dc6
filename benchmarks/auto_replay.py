"""Does a change to ``auto_fit`` change what it does? Two source trees replayed under a counting clock.

``auto_fit``'s choices depend on the wall clock (every stage stops at a deadline), so two runs of one tree differ
and an A/B of timings cannot show that a refactor changed nothing. Here each tree runs in its own subprocess with
``PYTHONPATH=<tree>``, ``torch.set_num_threads(1)`` and ``time.perf_counter`` replaced by a counter that advances
``--step`` seconds per read: every budget decision then depends on how many times the code read the clock, not on
the host or its load. For each configuration (built-in subsets of parkinsons, pol and kin40k from ``GPFALKON_DATA``,
test mask column 0; budgets 6-12 counted seconds; the default pipeline, an RBF race with learned centers, leverage
sampling, an SGPR + GCV race with the leverage check, two small sets that reach the leave-one-out stage) the replay
records the posterior mean and variance at 2,000 test rows and every field of ``auto_report`` (its stage seconds are
counted ones); the comparison passes where both trees' records are equal bit for bit. A change that reads the clock
once more or once less anywhere, or moves any number, fails it. Each configuration takes 15-210 s of one core.

Usage (from the repository root; the "before" tree is an export of an older commit):

    mkdir /tmp/before && git archive <commit> | tar xf - -C /tmp/before
    GPFALKON_DATA=../shared/data .venv/bin/python benchmarks/auto_replay.py --before /tmp/before --after .

``--only 0 3`` replays some configurations; ``--out F.md`` writes the comparison table with the command and the
machine; ``--keep DIR`` keeps each arm's records (``DIR/before.pkl``, ``DIR/after.pkl``), and ``--before`` may name
such a file instead of a tree (the same configurations and ``--step``), which halves the time of a later check
against the same commit; the exit status is 0 where every one is identical.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent

#: (dataset, training rows, auto_fit keyword arguments); seed 1 throughout
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    ("parkinsons", 5875, dict(budget=10)),
    ("pol", 6000, dict(budget=10)),
    ("kin40k", 8000, dict(budget=12)),
    ("parkinsons", 5875, dict(budget=6, kernel="rbf", learn_centers=True)),
    ("kin40k", 8000, dict(budget=6, center_sampling="leverage")),
    ("pol", 6000, dict(budget=8, objectives=["sgpr", "gcv"], leverage_check=True)),
    ("parkinsons", 3000, dict(budget=8)),
    ("pol", 2500, dict(budget=6, kernel="matern32", center_sampling="uniform")),
]
REPORT_FIELDS = ("budget", "n_train", "n_val", "val_source", "kernel", "learn", "search", "chosen", "stages", "notes",
                 "leverage", "sampling", "growth", "loo")


def _plain(v: Any) -> Any:
    """``v`` with tensors as nested lists and NaN as a string (so that ``==`` compares records exactly)."""
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, dict):
        return {k: _plain(w) for k, w in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(w) for w in v]
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v


def _worker(out: str, only: list[int], step: float) -> None:
    """Replay the configurations in this process (its ``PYTHONPATH`` names the tree) and pickle the records."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    reads = [1000.0]

    def counted() -> float:
        reads[0] += step
        return reads[0]

    time.perf_counter = counted  # before gpfalkon is imported: every module reads it through ``time``
    import gpfalkon

    data_dir = pathlib.Path(os.environ.get("GPFALKON_DATA", HERE.parent.parent / "shared" / "data"))
    records = {}
    for i, (name, rows, kw) in enumerate(CONFIGS):
        if only and i not in only:
            continue
        d = np.load(data_dir / f"{name}.npz")
        test = d["test_mask"][:, 0].astype(bool)
        x = torch.tensor(d["X"][~test][:rows], dtype=torch.float32)
        y = torch.tensor(d["y"][~test][:rows], dtype=torch.float32)
        xt = torch.tensor(d["X"][test][:2000], dtype=torch.float32)
        cpu = time.process_time()
        model = gpfalkon.auto_fit(x, y, seed=1, **kw)
        model.eval()
        with torch.no_grad():
            pred = model(xt)
            mean, var = pred.mean.clone(), pred.variance.clone()
        report = model.auto_report
        records[i] = dict(mean=mean, var=var, report={k: _plain(getattr(report, k)) for k in REPORT_FIELDS})
        print(f"  {i} {name} {kw}: M {report.chosen.get('num_centers')}, stages {sorted(report.stages)}, "
              f"{time.process_time() - cpu:.0f} CPU-s", flush=True)
    with open(out, "wb") as f:
        pickle.dump(records, f)


def _replay(tree: str, out: str, only: list[int], step: float) -> dict:
    if tree.endswith(".pkl"):  # records of an earlier replay (--keep)
        with open(tree, "rb") as f:
            records = pickle.load(f)
        missing = sorted(set(only or range(len(CONFIGS))) - set(records))
        if missing:
            raise SystemExit(f"{tree} has no records of configurations {missing}")
        return {i: r for i, r in records.items() if not only or i in only}
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(tree).resolve()))
    cmd = [sys.executable, __file__, "--worker", out, "--step", str(step), "--only", *map(str, only)]
    subprocess.run(cmd, env=env, check=True)
    with open(out, "rb") as f:
        return pickle.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--before", help="source tree (a folder holding gpfalkon/), or the before.pkl of a --keep")
    p.add_argument("--after", help="source tree (a folder holding gpfalkon/)")
    p.add_argument("--only", type=int, nargs="*", default=[], help="configuration indices (default: all)")
    p.add_argument("--step", type=float, default=0.002, help="counted seconds per clock read")
    p.add_argument("--out", help="markdown file for the comparison (default: print only)")
    p.add_argument("--keep", help="folder to keep each arm's records in (before.pkl, after.pkl)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.only, args.step)
        return
    if not (args.before and args.after):
        p.error("--before and --after are both required")
    bad = [i for i in args.only if not 0 <= i < len(CONFIGS)]
    if bad:
        p.error(f"--only: no configuration {bad} (0 to {len(CONFIGS) - 1})")
    sys.path.insert(0, str(HERE))
    from _common import environment_lines, markdown_table, write_result

    env = environment_lines()
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.keep or tmp
        os.makedirs(keep, exist_ok=True)
        runs = {}
        for arm in ("before", "after"):
            print(f"{arm}: {getattr(args, arm)}", flush=True)
            runs[arm] = _replay(getattr(args, arm), os.path.join(keep, f"{arm}.pkl"), args.only, args.step)
    import torch

    same_all = True
    rows = []
    for i in runs["before"]:
        a, b = runs["before"][i], runs["after"][i]
        preds = torch.equal(a["mean"], b["mean"]) and torch.equal(a["var"], b["var"])
        fields = [k for k in REPORT_FIELDS if a["report"][k] != b["report"][k]]
        same_all &= preds and not fields
        name, n, kw = CONFIGS[i]
        stages = ", ".join(f"{k} {v:.3f}" for k, v in b["report"]["stages"].items())
        rows.append([i, name, n, ", ".join(f"{k}={v}" for k, v in kw.items()), b["report"]["chosen"].get("num_centers"),
                     stages, "identical" if preds else "DIFFER", "identical" if not fields else ", ".join(fields)])
        print(" | ".join(str(v) for v in rows[-1]), flush=True)
    verdict = "identical" if same_all else "NOT identical"
    print(verdict)
    if args.out:
        body = (f"Trees: before `{args.before}`, after `{args.after}`; clock step {args.step:g} s per read, "
                "one thread, seed 1. Stage seconds are counted (clock reads x step), the same in both where the "
                "report is.\n\n"
                + markdown_table(["#", "dataset", "rows", "auto_fit arguments", "M (after)", "stages (after)",
                                  "mean, variance", "report fields"], rows)
                + f"\n\nVerdict: **{verdict}**.")
        print("written", write_result(pathlib.Path(args.out), "auto_fit replayed under a counting clock", env, body))
    sys.exit(0 if same_all else 1)


if __name__ == "__main__":
    main()
