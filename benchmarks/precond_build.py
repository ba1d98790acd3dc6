"""Building FALKON's preconditioner: three ways of forming ``T T^T``.

For each M, an RBF ``K_MM`` of M random points (d = 10, lengthscale sqrt(d), float64) is factored
by ``FalkonPreconditioner.from_kernel_matrix`` (two jittered Cholesky factorisations and ``T T^T``)
with ``T T^T`` formed by

- ``matmul``: ``T @ T.mT`` (``2 M^3`` flops);
- ``lauum``: LAPACK's ``dlauum`` through SciPy on one BLAS thread (``M^3 / 3`` flops; what
  ``gpfalkon.linalg.upper_gram`` was before: SciPy's OpenBLAS threads spin after a call and slow torch);
- ``blocked``: the library's ``gpfalkon.linalg.upper_gram`` (block products that skip the zero
  triangle, ``M^3 / 3`` flops, on torch's threads).

The three are timed in turn within each repetition, each followed by a fixed torch workload (20
distance matmuls of a 1,048 x 22 block against 2,000 centers and 10 Cholesky factorisations of a
1,000 x 1,000 matrix), timed too: a BLAS that leaves threads spinning slows it. Seconds = median.
'max diff of A' compares each build's factor ``A`` with the matmul build's (relative to its largest entry).

    .venv/bin/python benchmarks/precond_build.py --out benchmarks/results/precond-build.md
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.operators.preconditioner as precond_module
from gpfalkon import FalkonPreconditioner
from gpfalkon.linalg import upper_gram

from _common import environment_lines, log, markdown_table, write_result


def lauum_gram(u: torch.Tensor) -> torch.Tensor:
    """``U U^T`` by SciPy's ``?lauum`` on one BLAS thread (the reference this benchmark compares with)."""
    from scipy.linalg import lapack
    from threadpoolctl import threadpool_limits

    work = u.contiguous().clone()
    fortran = work.numpy().T  # row-major U is column-major L = U^T; lauum(lower) gives L^T L = U U^T
    fn = lapack.dlauum if u.dtype == torch.float64 else lapack.slauum
    with threadpool_limits(limits=1, user_api="blas"):
        out, info = fn(fortran, lower=1, overwrite_c=1)
    if info != 0:
        raise RuntimeError(f"lauum failed: info={info}")
    res = torch.from_numpy(out.T.copy()).triu_()
    return res + res.triu(1).mT


METHODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "matmul": lambda u: u @ u.mT,
    "lauum": lauum_gram,
    "blocked": upper_gram,
}


def build(kmm: torch.Tensor, method: str) -> FalkonPreconditioner:
    """The preconditioner of ``kmm`` (penalty 1e-6, n = 100 M) with ``T T^T`` formed by ``method``."""
    precond_module.upper_gram = METHODS[method]  # type: ignore[assignment]
    try:
        return FalkonPreconditioner.from_kernel_matrix(kmm, 1e-6, 100 * kmm.shape[0])
    finally:
        precond_module.upper_gram = upper_gram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[500, 1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/precond-build.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
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
        ref = build(kmm, "matmul").chol_a
        diffs = {name: float((build(kmm, name).chol_a - ref).abs().max() / ref.abs().max()) for name in METHODS}
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        after: dict[str, list[float]] = {name: [] for name in METHODS}
        repeats = args.repeats if m < 8000 else max(1, min(args.repeats, 3))
        for _ in range(repeats):
            for name in METHODS:
                t0 = time.perf_counter()
                build(kmm, name)
                times[name].append(time.perf_counter() - t0)
                after[name].append(workload())
        med = {name: statistics.median(v) for name, v in times.items()}
        wmed = {name: statistics.median(v) for name, v in after.items()}
        rows.append([m, med["matmul"], med["lauum"], med["blocked"], med["lauum"] / med["blocked"],
                     med["matmul"] / med["blocked"], wmed["matmul"], wmed["lauum"], wmed["blocked"],
                     max(diffs["lauum"], diffs["blocked"])])
        log(f"M={m}: matmul {med['matmul']:.3f} s, lauum {med['lauum']:.3f} s, blocked {med['blocked']:.3f} s")
    body = (
        f"{args.repeats} repetitions (3 at M >= 8,000), the three builds timed in turn, each followed by the "
        "workload; seconds = median. 'blocked' is the library's `upper_gram` in this run.\n\n"
        + markdown_table(["M", "matmul build s", "lauum build s", "blocked build s", "blocked vs lauum",
                          "blocked vs matmul", "workload after matmul s", "workload after lauum s",
                          "workload after blocked s", "max diff of A"], rows)
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Preconditioner build: T T^T by matmul, lauum or blocked products", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
