"""In-place Cholesky of a row-major float64 matrix: through the row-major ``out`` (what
``gpfalkon.linalg.jittered_cholesky`` did before) against through its transposed, column-major view
(what it does now: LAPACK's layout, so torch needs no layout copy), and a fresh output for scale.

For each M, a random SPD matrix ``a``; each variant copies ``a`` into the same row-major work matrix and
factors it (upper factor), the variants timed in turn, median of ``--repeats``; 'max diff' compares the
view's factor with ``torch.linalg.cholesky(a, upper=True)``.

    .venv/bin/python benchmarks/cholesky_layout.py --out benchmarks/results/cholesky-layout.md
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, log, markdown_table, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/cholesky-layout.md"))
    args = ap.parse_args()
    env = environment_lines()
    rows = []
    for m in args.m:
        g = torch.Generator().manual_seed(m)
        b = torch.randn(m, m, generator=g, dtype=torch.float64)
        a = b @ b.mT + m * torch.eye(m, dtype=torch.float64)
        work = torch.empty(m, m, dtype=torch.float64)
        info = torch.empty((), dtype=torch.int32)
        ref = torch.linalg.cholesky(a, upper=True)

        def row_major(work=work, a=a, info=info) -> None:
            work.copy_(a)
            torch.linalg.cholesky_ex(work, upper=True, out=(work, info))

        def column_view(work=work, a=a, info=info) -> None:
            work.copy_(a)
            torch.linalg.cholesky_ex(work.mT, upper=False, out=(work.mT, info))

        def fresh(work=work, a=a) -> None:
            work.copy_(a)
            torch.linalg.cholesky_ex(work, upper=True)

        variants = {"row-major out": row_major, "column-major view": column_view, "fresh output": fresh}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for rep in range(args.repeats + 1):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        column_view()
        diff = float((work - ref).abs().max() / ref.abs().max())
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append([m, 1e3 * med["row-major out"], 1e3 * med["column-major view"], 1e3 * med["fresh output"],
                     med["row-major out"] / med["column-major view"], f"{diff:.1e}"])
        log(f"M={m}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items()))
    body = (f"float64, {args.repeats} repetitions after a warm-up, variants in turn; ms = median (copy of `a` "
            "into the work matrix included).\n\n"
            + markdown_table(["M", "row-major out ms", "column-major view ms", "fresh output ms",
                              "view speed-up", "max diff (relative)"], rows))
    path = write_result(args.out, "In-place Cholesky: row-major out vs column-major view", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
