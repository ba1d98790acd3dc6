"""Issue 17's 10x across comparison rounds: one table per rule, a dataset per row, a round per column.

Reads the "Time to the best baseline's error" table that ``compare.py`` writes into each round's result file
(``benchmarks/results/auto-r<N>*.md``; a round split over several files, e.g. ``-partial`` and ``-rest``, is
merged by its number; where two of its files score one dataset, the row against the lower baseline error is kept)
and prints, for each dataset and round:

* the primary rule (the auto_fit run at budget / 12, fixed before the run): its speed-up over the best
  baseline's time to its own error, and ``Y`` where it is at least 10 at no worse error, ``t`` where the error
  is no worse but the speed-up short of 10, ``e`` where the error is higher (how much higher, in %);
* the monotone rule (the smallest-budget auto_fit run of the unbroken sequence, from the largest budget down,
  that all reach the baseline's error): its speed-up, ``Y`` at 10 or more, ``-`` where no run qualifies;
* the baseline-relative rule (rounds from 62 on, where ``falkon-auto-rel-12`` ran: auto_fit with the budget the
  best baseline's time to its error / 12): cells as the primary rule's.

Then, per dataset, how many rounds met each rule. Nothing is re-run: the numbers are the files'. Rounds differ in
their code, split and host (each file's header says which), so a column is one round, not a repeat of another.

    .venv/bin/python benchmarks/round_summary.py --out benchmarks/results/auto-rounds-summary.md
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, markdown_table, write_result

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SECTION = "## Time to the best baseline's error"
FILE_RE = re.compile(r"auto-r(\d+)(?:-[\w-]+)?\.md$")


def parse_round(text: str) -> dict[str, dict]:
    """The rows of one file's time-to-error table, by dataset: the primary's speed-up, error ratio and verdict,
    the monotone rule's run and speed-up, and the split named in the file's "Datasets:" line."""
    if SECTION not in text:
        return {}
    body = text.split(SECTION, 1)[1]
    listed = next((line for line in body.splitlines() if line.startswith("Datasets:")), "")
    splits = dict(re.findall(r"(\w+) \(([^,]+?), n_train", listed))
    rows: dict[str, dict] = {}
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith("| dataset"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 12:
            continue
        ds, _, base_err, _, _, prim_err, _, speed, verdict, monotone, _, mono_speed = cells[:12]
        # the verdict's "error x % higher" is computed from unrounded errors; the table's errors have 3 digits
        higher = re.search(r"error ([\d.]+) % higher", verdict)
        try:
            ratio = 1.0 + float(higher.group(1)) / 100.0 if higher else float(prim_err) / float(base_err)
            row = dict(speed=float(speed), ratio=ratio, verdict=verdict,
                       base_error=float(base_err),
                       monotone=monotone, mono_speed=float(mono_speed) if monotone != "none" else None,
                       split=splits.get(ds, "?"))
        except ValueError:  # a primary that did not run ("/12 not run", "-")
            continue
        if len(cells) >= 18 and cells[13] != "-":
            rel_err, rel_speed, rel_verdict = cells[14], cells[16], cells[17]
            higher = re.search(r"error ([\d.]+) % higher", rel_verdict)
            row["rel"] = dict(speed=float(rel_speed), verdict=rel_verdict, base_error=row["base_error"],
                              ratio=1.0 + float(higher.group(1)) / 100.0 if higher
                              else float(rel_err) / float(base_err))
        rows[ds] = row
    return rows


def collect(paths: Sequence[pathlib.Path]) -> dict[int, dict[str, dict]]:
    """Round number -> dataset -> row, the files of one round merged. Where two files of a round score one dataset
    (a baseline run again or added, e.g. SVGP where SGPR failed), the row against the lower baseline error is kept:
    the issue's target is the best of SGPR / SVGP, whichever file ran it; on a tie, the later file's."""
    rounds: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    for p in paths:
        m = FILE_RE.search(p.name)
        if m is None:
            raise SystemExit(f"{p}: not a round file (auto-r<N>[-part].md)")
        merged = rounds[int(m.group(1))]
        for ds, row in parse_round(p.read_text()).items():
            if ds not in merged or row["base_error"] <= merged[ds]["base_error"]:
                merged[ds] = row
    return {k: v for k, v in sorted(rounds.items()) if v}


def _mark(row: dict) -> str:
    """``!`` where the best baseline did no better than predicting the training mean (NRMSE above 1): a set
    without signal, or a baseline that failed."""
    return " !" if row["base_error"] > 1.0 else ""


def primary_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["verdict"] == "yes":
        return f"{row['speed']:.1f} Y" + _mark(row)
    if row["ratio"] <= 1.0:
        return f"{row['speed']:.1f} t" + _mark(row)
    return f"e +{100 * (row['ratio'] - 1):.1f}%" + _mark(row)


def monotone_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["mono_speed"] is None:
        return "-" + _mark(row)
    return f"{row['mono_speed']:.1f} {row['monotone']}" + (" Y" if row["mono_speed"] >= 10 else "") + _mark(row)


def _rel_rounds(rounds: dict[int, dict[str, dict]]) -> dict[int, dict[str, dict]]:
    """The rounds and rows with a baseline-relative run (``row["rel"]``), that run's row in place of the primary's."""
    out = {k: {ds: r["rel"] for ds, r in rr.items() if "rel" in r} for k, rr in rounds.items()}
    return {k: v for k, v in out.items() if v}


def summary(rounds: dict[int, dict[str, dict]]) -> str:
    out = []
    tables = [("Primary rule (budget / 12)", rounds, primary_cell, lambda r: r["verdict"] == "yes"),
              ("Monotone rule", rounds, monotone_cell,
               lambda r: r["mono_speed"] is not None and r["mono_speed"] >= 10)]
    rel = _rel_rounds(rounds)
    if rel:
        tables.append(("Baseline-relative rule (budget: the best baseline's time to its error / 12)", rel,
                       primary_cell, lambda r: r["verdict"] == "yes"))
    for title, sub, cell, met in tables:
        datasets = sorted({ds for r in sub.values() for ds in r})
        cols = [f"r{k}" for k in sub]
        table = [[ds, *(cell(sub[k].get(ds)) for k in sub),
                  f"{sum(met(r[ds]) for r in sub.values() if ds in r)} of {sum(ds in r for r in sub.values())}"]
                 for ds in datasets]
        met_per_round = ["rounds met", *(f"{sum(met(r) for r in sub[k].values())} of {len(sub[k])}"
                                         for k in sub), ""]
        out.append(f"## {title}\n\n" + markdown_table(["dataset", *cols, "met"], [*table, met_per_round],
                                                      align="l" + "r" * (len(cols) + 1)))
    splits = [[f"r{k}", "; ".join(sorted({row["split"] for row in r.values()})), ", ".join(sorted(r))]
              for k, r in rounds.items()]
    out.append("## Splits\n\n" + markdown_table(["round", "splits", "datasets"], splits, align="lll"))
    return "\n\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=pathlib.Path,
                    help="round result files (default: benchmarks/results/auto-r4[1-9]*.md and auto-r5[0-9]*.md)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    env = environment_lines()
    # every round from 41 on (the run at budget / 12 fixed before the run since then)
    files = args.files or sorted(p for p in RESULTS.glob("auto-r*.md")
                                 if (m := FILE_RE.search(p.name)) is not None and int(m.group(1)) >= 41)
    rounds = collect(files)
    if not rounds:
        raise SystemExit("no time-to-error table in the files given")
    legend = ("Primary cell: the speed-up of the budget / 12 run over the best baseline's time to its own error; "
              "`Y` at least 10 at no worse error, `t` no worse error but under 10, `e +x%`: its error x % above "
              "the baseline's. Monotone cell: the speed-up of the rule's run and its fraction (`Y` at 10 or "
              "more), `-` where no run reached the error. `!`: the best baseline's NRMSE above 1 (no better "
              "than predicting the training mean: no signal in the set, or a failed baseline). Baseline-relative "
              "cell (rounds where `falkon-auto-rel-12` ran): as the primary cell, for the run whose budget was the "
              "best baseline's time to its own error / 12. Each round: its "
              "own code, split and host (its file's header); the files of one round are merged (where two score one "
              "set, the row against the lower baseline error). Files: "
              + ", ".join(f"`{p.name}`" for p in files) + ".")
    body = legend + "\n\n" + summary(rounds)
    print(body)
    if args.out is not None:
        write_result(args.out, "Issue 17's 10x across the comparison rounds", env, body)


if __name__ == "__main__":
    main()
