"""``auto_fit`` with and without ``check_growth`` on one split, the learning stage optionally pinned to one racer.

Round 41 (``results/auto-r41.md``, keggdirected, split 1) had two runs whose learning ended at a small noise
(7.5e-4, the gcv racer at lr 0.1) and whose unchecked final growth (1,000 to 2,629 / 3,478 centers) raised the
test NRMSE from the level's 0.092 to 0.133 / 0.155. ``--objectives gcv:0.1`` pins the learning stage to that
racer, so the path can be reproduced on purpose; each ``dataset:budget`` then runs ``auto_fit`` twice, one
after the other (check on, then off), and the table gives the test NRMSE, the centers, the growth and the
check's verdict. Test error is what it reports, for diagnosis only: nothing in the library is chosen from it.

Usage (from the repository root):

    GPFALKON_DATA=/work/shared/data .venv/bin/python benchmarks/auto_growth_overfit.py --split 1 \\
        --objectives gcv:0.1 --runs keggdirected:12 keggdirected:15 --out benchmarks/results/auto-growth-overfit.md
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import environment_lines, fmt, log, markdown_table, write_result  # noqa: E402


def _objectives(specs: list[str] | None) -> list[tuple[str, float]] | None:
    """``name:lr`` specs as ``auto_fit``'s ``objectives`` (``None``: its default race)."""
    if not specs:
        return None
    out = []
    for s in specs:
        name, _, lr = s.partition(":")
        out.append((name, float(lr)) if lr else (name, 0.1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="dataset:budget specs, e.g. keggdirected:12")
    p.add_argument("--split", type=int, default=0, help="compare.py's split (test rows) of each dataset")
    p.add_argument("--objectives", nargs="*", help="name:lr racers of the learning stage (default: auto_fit's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "auto-growth-overfit.md"))
    args = p.parse_args()
    env = environment_lines()

    from gpfalkon import auto_fit

    import compare

    compare.SPLIT["k"] = args.split
    objectives = _objectives(args.objectives)
    rows, records = [], []
    for spec in args.runs:
        name, _, budget = spec.partition(":")
        data = compare.load_dataset(name)
        y_raw = data["ytr"].double() * data["y_scale"] + data["y_mean"]
        for check in (True, False):
            kw = {} if objectives is None else dict(objectives=objectives)
            t0 = time.perf_counter()
            model = auto_fit(data["xtr"], y_raw, budget=float(budget), seed=args.seed, check_growth=check, **kw)
            seconds = time.perf_counter() - t0
            model.eval()
            raw = compare.predict_chunks(lambda x, m=model: m.posterior_mean(x), data["xte"])
            err = compare.metrics(data, (raw - data["y_mean"]) / data["y_scale"])["error"]
            rep = model.auto_report
            c, g = rep.chosen, rep.growth
            verdict = "-" if not g else (f"kept ({g['error']:.4g} < {g['level_error']:.4g})" if g["kept"]
                                         else f"rejected at M={g['M']} ({g['error']:.4g} >= {g['level_error']:.4g})")
            rows.append([spec, "on" if check else "off", fmt(err, 4), c["num_centers"], c["grown_from"] or "-",
                         f"{c['noise']:.3g}", f"{c['multiplier']:.3g}", verdict, f"{seconds:.1f}"])
            records.append(dict(spec=spec, split=args.split, check_growth=check, error=err, seconds=seconds,
                                chosen={k: v for k, v in c.items() if k != "levels"}, growth=g, notes=rep.notes))
            log(" | ".join(str(v) for v in rows[-1]))
    out = pathlib.Path(args.out)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    body = (f"Split {args.split}; learning racers {args.objectives or 'auto_fit default'}; seed {args.seed}; each "
            "spec with `check_growth` on, then off. Rows in the `.jsonl` beside this file.\n\n"
            + markdown_table(["dataset:budget", "check_growth", "test NRMSE", "M", "grown from", "noise",
                              "multiplier", "growth check", "s"], rows))
    write_result(out, "auto_fit's growth check against an unchecked grown final fit", env, body)


if __name__ == "__main__":
    main()
