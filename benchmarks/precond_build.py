"""Building FALKON's preconditioner: ``T T^T`` by LAPACK's ``lauum`` against a general matmul.

For each M, an RBF ``K_MM`` of M random points (d = 10, lengthscale sqrt(d), float64) is factored
by ``FalkonPreconditioner.from_kernel_matrix`` (two jittered Cholesky factorisations and ``T T^T``)
with ``gpfalkon.linalg.upper_gram`` (lauum) and with ``T @ T.mT`` in its place, the two timed in
turn within each repetition, each followed by a fixed torch workload (20 distance matmuls of a
1,048 x 22 block against 2,000 centers and 10 Cholesky factorisations of a 1,000 x 1,000 matrix), timed
too: a BLAS that leaves threads spinning slows it. Seconds = median. 'max diff' compares the two
preconditioners' factor ``A`` (relative to its largest entry). ``--lauum-min`` sets
``gpfalkon.linalg.gram.LAUUM_MIN_SIZE`` for the run (default: the library's).

    .venv/bin/python benchmarks/precond_build.py --out benchmarks/results/precond-build.md
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
import gpfalkon.linalg.gram as gram_module
import gpfalkon.operators.preconditioner as precond_module
from gpfalkon import FalkonPreconditioner
from gpfalkon.linalg import upper_gram

from _common import environment_lines, log, markdown_table, write_result


def build(kmm: torch.Tensor, lauum: bool) -> FalkonPreconditioner:
    """The preconditioner of ``kmm`` (penalty 1e-6, n = 100 M), ``T T^T`` by lauum or by matmul."""
    precond_module.upper_gram = upper_gram if lauum else (lambda u: u @ u.mT)  # type: ignore[assignment]
    try:
        return FalkonPreconditioner.from_kernel_matrix(kmm, 1e-6, 100 * kmm.shape[0])
    finally:
        precond_module.upper_gram = upper_gram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[500, 1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lauum-min", type=int, default=None)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/precond-build.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    if args.lauum_min is not None:
        gram_module.LAUUM_MIN_SIZE = args.lauum_min
    g = torch.Generator().manual_seed(0)
    xa = torch.randn(1048, 22, generator=g)
    ca = torch.randn(22, 2000, generator=g)
    spd = torch.randn(1000, 1000, generator=g, dtype=torch.float64)
    spd = spd @ spd.T / 1000 + torch.eye(1000, dtype=torch.float64)

    def workload() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            torch.mm(xa, ca)
        for _ in range(10):
            torch.linalg.cholesky(spd)
        return time.perf_counter() - t0

    rows = []
    for m in args.m:
        x = torch.randn(m, 10, generator=g, dtype=torch.float64)
        kernel = gpytorch.kernels.RBFKernel().double()
        kernel.lengthscale = math.sqrt(10)
        with torch.no_grad():
            kmm = kernel(x, x).to_dense()

        pa, pb = build(kmm, False), build(kmm, True)
        diff = float((pa.chol_a - pb.chol_a).abs().max() / pa.chol_a.abs().max())
        times: dict[bool, list[float]] = {False: [], True: []}
        after: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for lauum in (False, True):
                t0 = time.perf_counter()
                build(kmm, lauum)
                times[lauum].append(time.perf_counter() - t0)
                after[lauum].append(workload())
        a, b = statistics.median(times[False]), statistics.median(times[True])
        wa, wb = statistics.median(after[False]), statistics.median(after[True])
        rows.append([m, a, b, a / b, wa, wb, wb / wa, diff])
        log(f"M={m}: matmul {a:.3f} s, lauum {b:.3f} s")
    body = (
        f"{args.repeats} repetitions, the two builds timed in turn, each followed by the workload; "
        "seconds = median.\n\n"
        + markdown_table(["M", "T @ T^T build s", "lauum build s", "speed-up", "workload after matmul s",
                          "workload after lauum s", "after ratio", "max diff of A"], rows)
        + f"\n\nLAUUM_MIN_SIZE = {gram_module.LAUUM_MIN_SIZE} in this run (below it both builds use the matmul)."
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Preconditioner build: lauum vs matmul for T T^T", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
