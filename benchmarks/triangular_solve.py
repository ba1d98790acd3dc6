"""The preconditioner's triangular solves: LAPACK's against the library's kernel on torch's threads.

Each CG iteration of FALKON applies ``B = n^{-1/2} T^{-1} A^{-1}`` and ``B^T``: four triangular solves with
the two ``M x M`` factors (``FalkonPreconditioner.apply_bbt``), between which the data pass streams
``K_nM`` through the caches. For each M, an RBF ``K_MM`` of M random points (d = 10, lengthscale sqrt(d),
float64) is factored by ``FalkonPreconditioner.from_kernel_matrix`` (penalty 1e-6, n = 200,000), factors
stored in ``--dtypes``; then ``apply_bbt(v)`` of one vector is timed after a read of a 256 MiB buffer
(what the data pass leaves in the caches), and again straight after a previous call (the factors in cache:
a small problem's CG, whose data pass fits the caches too), with

- ``lapack``: ``torch.linalg.solve_triangular`` (MKL's solve on the CPU), the library's path before and
  its fallback (``gpfalkon.operators.preconditioner.upper_solve`` patched to decline);
- ``kernel``: ``gpfalkon.backend.fused.upper_solve`` (the library's CPU path).

'floor' is the time of one ``sum()`` over each whole factor after the same buffer read (``2 M^2`` values:
each factor's triangle twice, what the four solves must read), i.e. their memory-bound limit. Seconds = median
of ``--repeats``, the variants alternating; 'max rel diff' compares the two results.

    .venv/bin/python benchmarks/triangular_solve.py --out benchmarks/results/triangular-solve.md
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.operators.preconditioner as precond_module
from gpfalkon import FalkonPreconditioner
from gpfalkon.backend import fused

from _common import REPO, environment_lines, log, markdown_table, write_result


def kernel_matrix(m: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 10, generator=g, dtype=torch.float64)
    k = gpytorch.kernels.RBFKernel().to(torch.float64)
    k.lengthscale = math.sqrt(10.0)
    with torch.no_grad():
        return k(x).to_dense()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[300, 600, 1000, 1500, 2000, 4000, 8000])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "triangular-solve.md")
    args = ap.parse_args()
    ok, why = fused.fused_available()
    if not ok:
        raise SystemExit(f"the C++ kernels are not available here: {why}")
    env = environment_lines()
    start = time.perf_counter()
    flush_buf = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB
    fast = precond_module.upper_solve
    min_m = dict(fused.SOLVE_MIN_M)
    rows = []
    for m in args.m:
        kmm = kernel_matrix(m, m)
        for name in args.dtypes:
            dtype = getattr(torch, name)
            pre = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-6, 200_000, dtype=dtype)
            v = torch.randn(m, 1, dtype=dtype, generator=torch.Generator().manual_seed(1))
            times: dict[str, list[float]] = {"lapack": [], "kernel": [], "floor": [], "lapack warm": [],
                                             "kernel warm": []}
            fused.SOLVE_MIN_M = {torch.float64: 1, torch.float32: 1}  # every size through the kernel (restored below)
            results = {}
            try:
                for _ in range(args.repeats):
                    for variant in ("lapack", "kernel"):
                        precond_module.upper_solve = fast if variant == "kernel" else (lambda *a, **k: None)
                        flush_buf.sum()
                        t0 = time.perf_counter()
                        results[variant] = pre.apply_bbt(v)
                        times[variant].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        pre.apply_bbt(v)
                        times[variant + " warm"].append(time.perf_counter() - t0)
                    flush_buf.sum()
                    t0 = time.perf_counter()
                    pre.chol_t.sum()
                    pre.chol_a.sum()
                    times["floor"].append(time.perf_counter() - t0)
            finally:
                precond_module.upper_solve = fast
                fused.SOLVE_MIN_M = min_m
            med = {k: statistics.median(t) for k, t in times.items()}
            diff = float((results["kernel"] - results["lapack"]).abs().max() / results["lapack"].abs().max())
            rows.append([m, name, med["lapack"], med["kernel"], med["lapack"] / med["kernel"], med["floor"],
                         med["floor"] / med["kernel"], med["lapack warm"], med["kernel warm"],
                         med["lapack warm"] / med["kernel warm"], diff])
            log(f"M={m} {name}: lapack {med['lapack'] * 1e3:.2f} ms, kernel {med['kernel'] * 1e3:.2f} ms, "
                f"floor {med['floor'] * 1e3:.2f} ms, diff {diff:.1e}")
    table = markdown_table(["M", "factors", "lapack s", "kernel s", "lapack / kernel", "floor s", "floor / kernel",
                            "lapack warm s", "kernel warm s", "warm lapack / kernel", "max rel diff"], rows,
                           align="rlrrrrrrrrr")
    body = (f"One `apply_bbt` (four triangular solves, one right-hand side) after a 256 MiB read, median of "
            f"{args.repeats}; 'warm': the same call again at once (factors in cache); 'floor' = one `sum()` over "
            "each whole factor (= reading each triangle twice: the memory-bound limit).\n\n"
            + table + f"\n\nTotal benchmark time {time.perf_counter() - start:.0f} s.\n")
    write_result(args.out, "Triangular solves of the preconditioner: LAPACK vs the library's kernel", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
