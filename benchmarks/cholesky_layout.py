"""In-place Cholesky of a row-major float64 matrix: through the row-major ``out`` (what
``gpfalkon.linalg.jittered_cholesky`` did before) against through its transposed, column-major view
(what it does now: LAPACK's layout, so torch needs no layout copy), a fresh output for scale, and a
right-looking blocked factorisation written in torch operations (``--block`` columns per panel: the panel's
Cholesky by LAPACK, the column block below it by one triangular solve, the trailing lower triangle by one
matmul per block row), to see whether LAPACK's own blocking leaves speed on this host (it did for
``torch.linalg.cholesky`` with its layout copies; the question is the view's).

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
    ap.add_argument("--block", type=int, default=256, help="panel width of the blocked variant")
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

        def blocked(work=work, a=a, info=info, nb=args.block, m=m) -> None:
            work.copy_(a)  # lower factor in place (row-major), then transposed for the upper one
            for k0 in range(0, m, nb):
                k1 = min(m, k0 + nb)
                torch.linalg.cholesky_ex(work[k0:k1, k0:k1].mT, upper=True, out=(work[k0:k1, k0:k1].mT, info))
                if k1 < m:
                    panel = work[k1:, k0:k1]
                    torch.linalg.solve_triangular(work[k0:k1, k0:k1].tril().mT, panel, upper=True, left=False,
                                                  out=panel)
                    for i0 in range(k1, m, nb):
                        i1 = min(m, i0 + nb)
                        work[i0:i1, k1:i1].addmm_(panel[i0 - k1:i1 - k1], panel[:i1 - k1].mT, alpha=-1.0)
            work.copy_(work.tril().mT)

        variants = {"row-major out": row_major, "column-major view": column_view, "fresh output": fresh,
                    "blocked (torch ops)": blocked}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for rep in range(args.repeats + 1):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        blocked()
        diff_blocked = float((work.triu() - ref).abs().max() / ref.abs().max())
        column_view()
        diff = float((work.triu() - ref).abs().max() / ref.abs().max())
        med = {k: statistics.median(v) for k, v in times.items()}
        gflops = m**3 / 3 / med["column-major view"] / 1e9
        rows.append([m, 1e3 * med["row-major out"], 1e3 * med["column-major view"], 1e3 * med["fresh output"],
                     1e3 * med["blocked (torch ops)"], med["row-major out"] / med["column-major view"],
                     med["blocked (torch ops)"] / med["column-major view"], gflops, f"{diff:.1e}",
                     f"{diff_blocked:.1e}"])
        log(f"M={m}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items()))
    body = (f"float64, {args.repeats} repetitions after a warm-up, variants in turn; ms = median (copy of `a` "
            "into the work matrix included).\n\n"
            + markdown_table(["M", "row-major out ms", "column-major view ms", "fresh output ms",
                              f"blocked (b = {args.block}) ms", "view speed-up", "blocked / view",
                              "view GFLOP/s (M^3/3)", "max diff view (relative)", "max diff blocked"], rows)
            + "\n\nmax diff: against `torch.linalg.cholesky(a, upper=True)`, relative to its largest entry.")
    path = write_result(args.out, "In-place Cholesky: row-major out vs column-major view", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
