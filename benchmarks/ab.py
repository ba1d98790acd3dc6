"""A/B timing of two source trees of gpfalkon in the same run (a refactor must not slow it down).

Runs ``benchmarks/engine.py`` and ``benchmarks/fit.py --only reference`` (or any of them)
from each tree, alternating the trees (A B B A ... so slow drifts of a shared machine hit
both), parses the tables they write, and reports per row the median seconds of each tree
and the ratio B / A, with the geometric mean over rows.

Usage (from the repository root; the "before" tree is a worktree of an older commit):

    git worktree add /tmp/gpfalkon-before <commit>
    .venv/bin/python benchmarks/ab.py --before /tmp/gpfalkon-before --after . --rounds 2 \\
        --out benchmarks/results/refactor-ab.md

Each tree's own benchmark scripts run with ``PYTHONPATH=<tree>``, so each imports its own
gpfalkon (the editable install is shadowed).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, markdown_table

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (script arguments, key columns, time column)
BENCHES = {
    "engine": (["benchmarks/engine.py", "--quick", "--threads", "1", "--modes", "fly", "stored"],
               ["kernel", "d", "dtype", "k", "mode"], "seconds"),
    "fit-reference": (["benchmarks/fit.py", "--only", "reference"], ["n", "dtype"], "fit wall s"),
    # full-size engine products with torch's default threads (an explicit budget: trees from before
    # the automatic memory budget read the setting as a number)
    "engine-200k": (["benchmarks/engine.py", "--n", "200000", "--d", "20", "90", "--modes", "fly", "stored",
                     "--memory-budget-gib", "8"], ["kernel", "d", "dtype", "k", "mode"], "seconds"),
    "fit-reference-8g": (["benchmarks/fit.py", "--only", "reference", "--memory-budget-gib", "8"], ["n", "dtype"],
                         "fit wall s"),
}


def _parse_tables(md: str) -> list[dict[str, str]]:
    """Rows of every markdown table in ``md`` as dicts (header -> cell)."""
    rows: list[dict[str, str]] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            head = [h.strip() for h in lines[i].strip("|").split("|")]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(head, cells, strict=False)))
                i += 1
        else:
            i += 1
    return rows


def _run(tree: pathlib.Path, bench: str, python: str) -> dict[tuple[str, ...], float]:
    args, keys, col = BENCHES[bench]
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out.md"
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([python, str(tree / args[0]), *args[1:], "--out", str(out)], cwd=tree, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        rows = _parse_tables(out.read_text())
    res = {}
    for r in rows:
        if col in r and all(k in r for k in keys):
            try:
                res[tuple(r[k] for k in keys)] = float(r[col].replace(",", ""))
            except ValueError:
                continue
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=pathlib.Path, required=True, help="tree A (older)")
    ap.add_argument("--after", type=pathlib.Path, required=True, help="tree B (newer)")
    ap.add_argument("--benches", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    ap.add_argument("--rounds", type=int, default=2, help="each round runs A then B, or B then A (alternating)")
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "refactor-ab.md")
    args = ap.parse_args()
    env_lines = environment_lines()
    t0 = time.time()
    trees = {"A": args.before.resolve(), "B": args.after.resolve()}
    sections = []
    for bench in args.benches:
        times: dict[str, dict[tuple[str, ...], list[float]]] = {"A": {}, "B": {}}
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for side in order:
                print(f"{bench}: round {r + 1}, tree {side}", flush=True)
                for key, sec in _run(trees[side], bench, sys.executable).items():
                    times[side].setdefault(key, []).append(sec)
        keys_cols = BENCHES[bench][1]
        table, ratios = [], []
        for key in times["A"]:
            if key not in times["B"]:
                continue
            a, b = statistics.median(times["A"][key]), statistics.median(times["B"][key])
            ratios.append(b / a)
            table.append([*key, a, b, b / a])
        geo = math.exp(statistics.mean(math.log(x) for x in ratios)) if ratios else float("nan")
        sections += [
            f"## {bench}: `{' '.join(BENCHES[bench][0])}`",
            "",
            markdown_table([*keys_cols, "A s (median)", "B s (median)", "B / A"], table),
            "",
            f"Geometric mean of B / A over {len(ratios)} rows: **{geo:.3f}**; "
            f"max {max(ratios):.3f}, min {min(ratios):.3f}." if ratios else "no common rows",
            "",
        ]
    text = "\n".join([
        "# A/B timing of two gpfalkon trees in one run",
        "",
        f"- A (before): `{trees['A']}`; B (after): `{trees['B']}`",
        *env_lines,
        f"- {args.rounds} rounds per benchmark, trees alternating (A B, B A, ...); seconds are medians over rounds",
        f"- total time {time.time() - t0:.0f} s",
        "",
        *sections,
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
