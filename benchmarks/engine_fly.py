"""The fused on-the-fly CPU kernel (``gpfalkon.backend.fused.fused_fly_kmn_k``) against the engine's torch
path, and its tile size.

One ``KernelEngine(store=False).kmn_k(U)`` per timing (n = 200,000, M = 2,000, X ~ N(0, I_d), lengthscale
sqrt(d), RBF in a ScaleKernel; Matern 5/2 at d = 20), U (M, k) float64. Arms, timed in turn within each
repetition after one warm-up each (so that a slow spell of the host hits every arm alike): the torch path
(``fused.set_enabled(False)``: the stored-K kernel is off too, which this pass does not use) and the fused
kernel with tiles of 1, 2 (the default) and 4 MiB. GFLOP/s counts ``2 n M d + 4 n M k`` as
``benchmarks/engine.py`` does; 'x matmul' divides by ``torch.matmul``'s rate (4096^3) measured in the same
run.

    .venv/bin/python benchmarks/engine_fly.py --out benchmarks/results/engine-fused-fly.md
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
from gpfalkon.backend import KernelEngine, fused

from _common import environment_lines, log, markdown_table, matmul_gflops, write_result

TILES_MIB = (1, 2, 4)


def kernel(kind: str, d: int) -> gpytorch.kernels.Kernel:
    base = gpytorch.kernels.RBFKernel() if kind == "rbf" else gpytorch.kernels.MaternKernel(nu=2.5)
    base.lengthscale = math.sqrt(d)
    return gpytorch.kernels.ScaleKernel(base)


def run(eng: KernelEngine, u: torch.Tensor, arm: str, times: list[float] | None, outs: dict) -> None:
    """One ``kmn_k`` in ``arm`` ("torch" or "<t> MiB" tiles); its time appended to ``times`` (if given)."""
    fused.set_enabled(arm != "torch")
    if arm != "torch":
        fused.FLY_TILE_BYTES = int(arm.split()[0]) * 2**20
    try:
        t0 = time.perf_counter()
        out = eng.kmn_k(u)
        if times is not None:
            times.append(time.perf_counter() - t0)
        outs[arm] = out
    finally:
        fused.set_enabled(None)
        fused.FLY_TILE_BYTES = 2 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--m", type=int, default=2000)
    ap.add_argument("--d", type=int, nargs="+", default=[8, 20, 32, 64, 90])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--dtype", nargs="+", default=["float32", "float64"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    ok, why = fused.fused_available()
    if not ok:
        raise SystemExit(f"the fused kernel is unavailable: {why}")
    env = environment_lines()
    mm = {dt: matmul_gflops(getattr(torch, dt)) for dt in args.dtype}
    cases = [("rbf", d) for d in args.d] + [("matern52", 20)]
    rows = []
    for dt in args.dtype:
        dtype = getattr(torch, dt)
        for kind, d in cases:
            g = torch.Generator().manual_seed(d)
            x = torch.randn(args.n, d, generator=g).to(dtype)
            c = x[torch.randperm(args.n, generator=g)[: args.m]].clone()
            eng = KernelEngine(kernel(kind, d).to(dtype), x, c, store=False)
            for k in args.k:
                u = torch.randn(args.m, k, dtype=torch.float64, generator=g)
                arms: dict[str, list[float]] = {"torch": [], **{f"{t} MiB": [] for t in TILES_MIB}}
                outs = {}

                for arm in arms:
                    run(eng, u, arm, None, outs)
                for _ in range(args.repeats):
                    for arm in arms:
                        run(eng, u, arm, arms[arm], outs)
                flops = 2.0 * args.n * args.m * d + 4.0 * args.n * args.m * k
                ref = outs["torch"]
                base = statistics.median(arms["torch"])
                for arm, ts in arms.items():
                    s = statistics.median(ts)
                    diff = float((outs[arm] - ref).abs().max() / ref.abs().max())
                    rows.append([kind, d, dt, k, arm, s, flops / s / 1e9, flops / s / 1e9 / mm[dt], base / s, diff])
                    log(f"{kind} d={d} {dt} k={k} {arm}: {s:.3f} s, x matmul {flops / s / 1e9 / mm[dt]:.3f}, "
                        f"speed-up {base / s:.2f}")
    body = (f"n = {args.n:,}, M = {args.m:,}; torch.matmul (4096^3) in this run: "
            + ", ".join(f"{dt} {v:.1f} GFLOP/s" for dt, v in mm.items())
            + f". Seconds: median of {args.repeats}, arms alternated within each repetition. 'vs torch' = the "
            "torch path's time / the arm's; 'rel. diff' = max |out - out_torch| / max |out_torch|.\n\n"
            + markdown_table(["kernel", "d", "dtype", "k", "arm", "seconds", "GFLOP/s", "x matmul", "vs torch",
                              "rel. diff"], rows, align="lrlrl" + "r" * 5))
    if args.out is not None:
        write_result(args.out, "Fused on-the-fly CPU kernel vs the torch path, and its tile size", env, body)
        log(f"written {args.out}")
    else:
        print(body)


if __name__ == "__main__":
    main()
