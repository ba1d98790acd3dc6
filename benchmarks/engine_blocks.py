"""Block height of the on-the-fly engine: an interleaved A/B of ``KernelEngine.kmn_k`` at several
block sizes.

For each d / dtype / k, one engine per block size (``store=False``, RBF kernel, X ~ N(0, I_d),
lengthscale sqrt(d), centers = M random rows of X) is timed on one ``K_nM^T (K_nM U)`` product; the
sizes are timed in turn within each repetition (one warm-up call each first), so a slow spell of
a shared machine hits every size alike. Seconds are the median over the repetitions; 'x' is the
first size's median over each size's. Block heights: ``MiB * 2^20 / (M * itemsize)`` rows, rounded
down to a multiple of 8 except for the first size (the engine's old rule, which did not round).

A second table (``--batched-ab``, float64, several right-hand sides, the default block height) times
the engine's thin products in the 2-D form (``K_b^T (K_b U)`` by two matmuls, which the engine used for
float64 with k > 1 before) against its batched form (the block split over the threads, two ``bmm``),
interleaved the same way; 'diff' is the largest relative difference of the two results.

    .venv/bin/python benchmarks/engine_blocks.py --batched-ab --out benchmarks/results/engine-blocks.md
"""
from __future__ import annotations

import argparse
import inspect
import math
import pathlib
import statistics
import sys
import textwrap
import time
import types

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.backend.engine as engine_module
from gpfalkon import KernelEngine

from _common import environment_lines, log, markdown_table, matmul_gflops, write_result

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def rows_for(mib: float, m: int, itemsize: int, rounded: bool) -> int:
    rows = int(mib * 2**20) // (m * itemsize)
    if rounded:
        rows -= rows % 8
    return max(32, rows)


def two_d_form() -> types.FunctionType:
    """``KernelEngine._thin_block_`` with the batched form turned off for float64 with k > 1 (the
    engine's rule before ``engine-blocks.md``), rebuilt from the current source so nothing else
    differs. Fails loudly if the source no longer has the condition it replaces."""
    src = textwrap.dedent(inspect.getsource(KernelEngine._thin_block_))
    old = "if blk.is_contiguous():"
    if old not in src:
        raise RuntimeError("KernelEngine._thin_block_ changed: update two_d_form")
    src = src.replace(old, "if blk.is_contiguous() and not (blk.dtype == torch.float64 and acc.shape[0] > 1):")
    namespace = dict(vars(engine_module))
    exec(src, namespace)
    return namespace["_thin_block_"]


def batched_ab(args, g: torch.Generator) -> str:
    rows = []
    thin_2d = two_d_form()
    ratios = []
    for d in args.d:
        x = torch.randn(args.n, d, generator=g, dtype=torch.float64)
        c = x[torch.randperm(args.n, generator=g)[: args.m]].clone()
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        kernel.base_kernel.lengthscale = math.sqrt(d)
        for store in (False, True):
            for k in (2, 10):
                u = torch.randn(args.m, k, generator=g, dtype=torch.float64)
                a = KernelEngine(kernel, x, c, store=store)
                b = KernelEngine(kernel, x, c, store=store)
                a._thin_block_ = types.MethodType(thin_2d, a)  # type: ignore[method-assign]
                ra, rb = a.kmn_k(u), b.kmn_k(u)
                diff = float((ra - rb).abs().max() / ra.abs().max())
                ta: list[float] = []
                tb: list[float] = []
                for _ in range(args.repeats):
                    for e, ts in ((a, ta), (b, tb)):
                        t0 = time.perf_counter()
                        e.kmn_k(u)
                        ts.append(time.perf_counter() - t0)
                sa, sb = statistics.median(ta), statistics.median(tb)
                ratios.append(sa / sb)
                rows.append([d, "stored" if store else "on the fly", k, b.block_rows, sa, sb, sa / sb, diff])
                log(f"float64 d={d} {'stored' if store else 'fly'} k={k}: 2-D {sa:.3f} s, batched {sb:.3f} s")
                del a, b
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return (
        "## float64, several right-hand sides: 2-D products vs the batched form\n\n"
        + markdown_table(["d", "K_nM", "k", "block rows", "2-D s", "batched s", "speed-up", "diff"], rows,
                         align="rlrrrrrr")
        + f"\n\nGeometric mean speed-up of the batched form: {geo:.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}). "
        "Stored rows on CPU go through the fused kernel (gpfalkon.backend.fused) where it is built, so "
        "only the on-the-fly rows exercise the choice there."
    )


def sizes_table(args, g: torch.Generator, gflops: dict[str, float]) -> str:
    headers = ["d", "dtype", "k"]
    for i, mib in enumerate(args.mib):
        headers += [f"{mib:g} MiB rows", f"{mib:g} MiB s"] + ([] if i == 0 else [f"x {mib:g} MiB"])
    rows = []
    ratios: dict[float, list[float]] = {mib: [] for mib in args.mib[1:]}
    for d in args.d:
        x = torch.randn(args.n, d, generator=g, dtype=torch.float64)
        c = x[torch.randperm(args.n, generator=g)[: args.m]].clone()
        for name in args.dtype:
            dt = DTYPES[name]
            kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dt)
            kernel.base_kernel.lengthscale = math.sqrt(d)
            xd, cd = x.to(dt), c.to(dt)
            item = xd.element_size()
            for k in args.k:
                u = torch.randn(args.m, k, generator=g, dtype=torch.float64)
                engines = [KernelEngine(kernel, xd, cd, store=False,
                                        block_rows=rows_for(mib, args.m, item, rounded=i > 0))
                           for i, mib in enumerate(args.mib)]
                times: list[list[float]] = [[] for _ in engines]
                for e in engines:
                    e.kmn_k(u)
                for _ in range(args.repeats):
                    for e, ts in zip(engines, times, strict=True):
                        t0 = time.perf_counter()
                        e.kmn_k(u)
                        ts.append(time.perf_counter() - t0)
                med = [statistics.median(ts) for ts in times]
                row: list = [d, name, k]
                for i, (e, s) in enumerate(zip(engines, med, strict=True)):
                    row += [e.block_rows, s] + ([] if i == 0 else [med[0] / s])
                    if i:
                        ratios[args.mib[i]].append(med[0] / s)
                rows.append(row)
                log(f"d={d} {name} k={k}: "
                    + ", ".join(f"{mib:g} MiB {s:.3f} s" for mib, s in zip(args.mib, med, strict=True)))
                del engines
    geo = {mib: math.exp(sum(map(math.log, r)) / len(r)) for mib, r in ratios.items() if r}
    body = (
        f"n = {args.n:,}, M = {args.m:,}, RBF (ScaleKernel), X ~ N(0, I_d), lengthscale sqrt(d); one "
        f"`KernelEngine(store=False).kmn_k(U)` per timing, U (M, k) float64; block sizes timed in turn "
        f"within each of {args.repeats} repetitions after one warm-up each; seconds = median. torch.matmul "
        f"(4096 x 4096) in this run: "
        + ", ".join(f"{n_}: {v:.1f} GFLOP/s" for n_, v in gflops.items()) + ".\n\n"
        + markdown_table(headers, rows, align="rlr" + "r" * (len(headers) - 3)) + "\n\n"
        + "Geometric mean of the speed-up over the first size: "
        + ", ".join(f"{mib:g} MiB {v:.2f}x ({sum(r > 1 for r in ratios[mib])} of {len(ratios[mib])} faster)"
                    for mib, v in geo.items())
        + "."
    )
    return "## Block height\n\n" + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--m", type=int, default=2000)
    ap.add_argument("--d", type=int, nargs="+", default=[8, 20, 32, 90])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--mib", type=float, nargs="+", default=[2.0, 8.0, 16.0],
                    help="block sizes in MiB; the first is the baseline (default 2 8 16)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batched-ab", action="store_true", help="also the float64 2-D vs batched table")
    ap.add_argument("--skip-sizes", action="store_true", help="only the --batched-ab table")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/engine-blocks.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    gflops = {name: matmul_gflops(dt) for name, dt in DTYPES.items() if name in args.dtype}
    g = torch.Generator().manual_seed(args.seed)
    parts = []
    if not args.skip_sizes:
        parts.append(sizes_table(args, g, gflops))
    if args.batched_ab:
        parts.append(batched_ab(args, g))
    body = "\n\n".join(parts) + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    path = write_result(args.out, "On-the-fly engine: block height A/B", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
