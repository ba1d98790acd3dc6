"""A/B of ``auto_fit``'s choices: two source trees of gpfalkon, the same datasets and budgets, one run.

For each ``dataset:budget`` the two trees run ``auto_fit`` one after the other (the order alternates from
one spec to the next, so slow drifts of a shared machine hit both), each in its own subprocess with
``PYTHONPATH=<tree>`` (so each imports its own gpfalkon; the datasets come from this tree's
``benchmarks/compare.py``, the same split for both). Every run records its test NRMSE, its stages, the
chosen level and the whole ``auto_report`` (learning curves, every selection fit) to a ``.jsonl`` next to
``--out``; the table reports per run both trees' error, number of centers and selection scores (a fit each,
or a noise of a penalty path), the ratio after / before, and whether stage 1 ended at the same point in both
(the learning stage stops at a wall-clock deadline, so two runs of one tree can differ there; where it did not,
the rest of the run compares
the two trees' selection and final fit alone). Summary: the geometric mean of the ratios, over all runs and
over those whose learning ended at the same point.

Usage (from the repository root; the "before" tree is an export of an older commit):

    mkdir /tmp/before && git archive <commit> | tar xf - -C /tmp/before
    .venv/bin/python benchmarks/auto_ab.py --before /tmp/before --after . \\
        --runs cpusmall:15 protein:15 kin40k:30 --out benchmarks/results/auto-ab.md

Data from ``GPFALKON_DATA`` (default ``../shared/data``), as ``compare.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def _worker(spec: str, out: str, seed: int) -> None:
    """One ``auto_fit`` run (in a subprocess whose ``PYTHONPATH`` names the tree under test)."""
    sys.path.insert(1, str(HERE))
    import torch

    import gpfalkon

    from compare import load_dataset

    torch.set_num_threads(int(os.environ.get("AB_THREADS", torch.get_num_threads())))
    name, budget = spec.rsplit(":", 1)
    data = load_dataset(name)
    t = time.perf_counter()
    model = gpfalkon.auto_fit(data["xtr"], data["ytr"].double(), budget=float(budget), seed=seed)
    wall = time.perf_counter() - t
    model.eval()
    with torch.no_grad():
        pred = model.posterior_mean(data["xte"]).double()
    yte = data["yte"].double()
    r = model.auto_report
    rec = dict(spec=spec, dataset=name, budget=float(budget), seed=seed, wall=wall,
               nrmse=float((pred - yte).square().mean().sqrt() / yte.std()), stages=r.stages, chosen=r.chosen,
               search=r.search, learn=r.learn, notes=r.notes, gpfalkon=str(pathlib.Path(gpfalkon.__file__).parent))
    with open(out, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def _learn_end(rec: dict) -> tuple:
    c = rec["chosen"]
    return (c.get("objective"), c.get("lr"), c.get("learn_rows"), c.get("step"),
            round(float(c.get("learn_error", math.nan)), 8))


def _table(rows: list[dict]) -> str:
    sys.path.insert(0, str(HERE))
    from _common import markdown_table

    # a spec given more than once is paired by occurrence: its k-th "before" run with its k-th "after" run
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["arm"], r["spec"]), []).append(r)
    pairs = []
    for spec in dict.fromkeys(r["spec"] for r in rows):
        pairs += list(zip(by.get(("before", spec), []), by.get(("after", spec), []), strict=False))
    body, ratios, same_ratios = [], [], []
    for a, b in pairs:
        spec = a["spec"]
        ratio = b["nrmse"] / a["nrmse"]
        same = _learn_end(a) == _learn_end(b)
        ratios.append(ratio)
        if same:
            same_ratios.append(ratio)
        body.append([spec, f"{a['nrmse']:.4f}", a["chosen"].get("num_centers"), len(a["search"]), f"{a['wall']:.1f}",
                     f"{b['nrmse']:.4f}", b["chosen"].get("num_centers"), len(b["search"]), f"{b['wall']:.1f}",
                     f"{ratio:.3f}", "same" if same else "differs"])

    def geo(v: list[float]) -> str:
        return f"{math.exp(sum(map(math.log, v)) / len(v)):.3f} over {len(v)}" if v else "-"

    table = markdown_table(["dataset:budget", "before NRMSE", "M", "scores", "s", "after NRMSE", "M", "scores", "s",
                            "after / before", "stage 1 ended"], body)
    lower, higher = sum(r < 1 for r in ratios), sum(r > 1 for r in ratios)
    return (table + f"\n\nGeometric mean after / before: {geo(ratios)} runs ({lower} lower, {higher} higher); "
            f"where stage 1 ended at the same point in both: {geo(same_ratios)}.\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="source tree A (its gpfalkon is imported through PYTHONPATH)")
    p.add_argument("--after", default=str(REPO), help="source tree B (default: this tree)")
    p.add_argument("--runs", nargs="+", help="dataset:budget specs, e.g. protein:15")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "auto-ab.md"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.jsonl, args.seed)
        return
    if not args.before or not args.runs:
        p.error("--before and --runs are required")
    for spec in args.runs:
        name, _, budget = spec.rpartition(":")
        if not name or not budget.replace(".", "", 1).isdigit() or float(budget) <= 0:
            p.error(f"--runs: {spec!r} is not dataset:budget with a positive budget in seconds")
    trees = {"before": pathlib.Path(args.before).resolve(), "after": pathlib.Path(args.after).resolve()}
    for arm, tree in trees.items():
        if not (tree / "gpfalkon" / "__init__.py").is_file():
            p.error(f"--{arm}: {tree} holds no gpfalkon package")
    out = pathlib.Path(args.out)
    jsonl = out.with_suffix(".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    if jsonl.exists():
        jsonl.unlink()
    sys.path.insert(0, str(HERE))
    from _common import environment_lines, write_result

    env = environment_lines()
    t0 = time.perf_counter()
    for i, spec in enumerate(args.runs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for arm in order:
            tmp = jsonl.with_suffix(f".{arm}.tmp")
            environ = dict(os.environ, PYTHONPATH=str(trees[arm]))
            environ.setdefault("GPFALKON_DATA", str(REPO.parent / "shared" / "data"))
            subprocess.run([sys.executable, str(HERE / "auto_ab.py"), "--worker", spec, "--jsonl", str(tmp),
                            "--seed", str(args.seed)], env=environ, check=True)
            with open(tmp) as f:
                rec = json.loads(f.read().strip().splitlines()[-1])
            tmp.unlink()
            rec["arm"] = arm
            with open(jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{spec:20s} {arm:6s} NRMSE {rec['nrmse']:.4f} M {rec['chosen'].get('num_centers')} "
                  f"{rec['wall']:.1f} s", flush=True)
    rows = [json.loads(line) for line in open(jsonl)]
    body = (f"- before: `{trees['before']}`; after: `{trees['after']}`; seed {args.seed}\n"
            f"- every run: `auto_fit(train_x, train_y, budget=..., seed={args.seed})` on `compare.py`'s split, "
            f"test NRMSE of the posterior mean; rows in `{jsonl.name}`\n\n" + _table(rows)
            + f"\nTotal {time.perf_counter() - t0:.0f} s.\n")
    print(write_result(out, "auto_fit A/B: two source trees, same datasets and budgets", env, body))


if __name__ == "__main__":
    main()
