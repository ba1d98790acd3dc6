"""Benchmark of the kernel-product engine: one ``K_nM^T (K_nM U)`` product.

For each kernel / d / dtype / k (number of right-hand sides) it times
``KernelEngine.kmn_k(U)``

* on the fly (``store=False``): blocks of ``block_rows x M`` recomputed per product;
* stored (``store=True``): ``K_nM`` built once (its construction time is reported
  separately in the "setup s" column) and read once from memory per product (each
  ~512 KiB sub-block twice, the second time from the reading core's cache; on CPU the fused
  single-read kernel of ``gpfalkon.backend.fused`` where it builds);
* partial (``--modes partial``, ``store=None`` under a memory budget that holds a fraction
  ``--partial-fractions`` of ``K_nM``'s rows): the stored rows read, the others recomputed per product;
* naive: the falkon-reference-style loop, a fresh ``n_b x M`` block per block from
  ``kernel(x_b, C).to_dense()`` through GPyTorch, then ``K_b^T (K_b U)``. (GPyTorch
  1.15's ``RBFKernel``/``MaternKernel`` compute squared distances with one matmul
  on an augmented ``[x, ||x||^2, 1]`` matrix, not with ``torch.cdist``.)
* cdist: the same loop with ``torch.cdist`` on pre-scaled inputs and the kernel
  profile applied out of place (fresh tensors per block).

Seconds are the median of ``--repeats`` (default 3) calls after one warm-up call.
GFLOP/s counts ``2 n M d`` (distances; on the fly and naive only) plus ``4 n M k``
(the two thin products); exp/sqrt are not counted. "x matmul" is that throughput
divided by the ``torch.matmul`` throughput (4096 x 4096, same dtype, median of 3)
measured in the same run. GB/s (stored only) is ``n M itemsize / seconds`` (the stored
matrix's bytes over the product's time) and "x bandwidth" that rate over the memory read
rate measured in the same run (``torch.sum`` over a 1 GiB tensor). "rel. diff" is
``max|out - out_naive| / max|out_naive|`` (a sanity check, not a timing).

On a machine shared with other work, pass ``--threads 1``: with torch's default of
one thread per core, OpenMP threads waiting for a descheduled sibling made small
operations (an M x M triangular solve, a product with a 2,000 x 1,000 block)
10-100x slower in our runs. The result file records the thread count and the load
average at the start.

Usage (from the repository root):

    .venv/bin/python benchmarks/engine.py                  # n=200,000, M=2,000, full grid
    .venv/bin/python benchmarks/engine.py --quick          # n=20,000, smaller grid
    .venv/bin/python benchmarks/engine.py --n 100000 --m 1000 --d 20 --k 1 --dtype float32
    .venv/bin/python benchmarks/engine.py --out benchmarks/results/engine-mine.md
    .venv/bin/python benchmarks/engine.py --d 20 --k 1 10 --modes fly stored --block-rows 512 2048 8192 \
        --stored-block-rows 64 131 1024 8192   # block-size sweep

The table is printed and written, with the command line, date, torch version,
thread count, CPU model and RAM, to ``--out`` (default
``benchmarks/results/engine.md``; ``engine-quick.md`` with ``--quick``).
"""
from __future__ import annotations

import argparse
import gc
import math
import pathlib
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
from gpfalkon import KernelEngine
from gpfalkon.backend.fused import fused_available

from _common import (
    REPO,
    environment_lines,
    log,
    markdown_table,
    matmul_gflops,
    median_time,
    read_bandwidth,
    tensor_read_rate,
    write_result,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def make_kernel(kind: str, d: int, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    if kind == "rbf":
        kern = gpytorch.kernels.RBFKernel()
    elif kind == "matern52":
        kern = gpytorch.kernels.MaternKernel(nu=2.5)
    else:
        raise ValueError(kind)
    kern = kern.to(dtype)
    kern.lengthscale = math.sqrt(d)
    return kern


def naive_kmn_k(kernel, x, c, u, block_rows: int) -> torch.Tensor:
    """falkon-reference-style product: fresh GPyTorch block per row block, usual form."""
    m, k = u.shape
    ud = u.to(x.dtype)
    acc = torch.zeros(m, k, dtype=x.dtype)
    with torch.no_grad():
        for start in range(0, x.shape[0], block_rows):
            kb = kernel(x[start : start + block_rows], c).to_dense()  # new n_b x M tensor
            acc += kb.t() @ (kb @ ud)
    return acc.to(torch.float64)


def cdist_kmn_k(kind: str, xs, cs, u, block_rows: int) -> torch.Tensor:
    """Like :func:`naive_kmn_k` but with ``torch.cdist`` on pre-scaled inputs (fresh blocks)."""
    m, k = u.shape
    ud = u.to(xs.dtype)
    acc = torch.zeros(m, k, dtype=xs.dtype)
    with torch.no_grad():
        for start in range(0, xs.shape[0], block_rows):
            dist = torch.cdist(xs[start : start + block_rows], cs)
            if kind == "rbf":
                kb = torch.exp(-0.5 * dist.square())
            else:
                z = math.sqrt(5.0) * dist
                kb = (1.0 + z + z.square() / 3.0) * torch.exp(-z)
            acc += kb.t() @ (kb @ ud)
    return acc.to(torch.float64)


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="rows of X (default 200,000; 20,000 with --quick)")
    ap.add_argument("--m", type=int, default=2000, help="number of centers M (default 2,000)")
    ap.add_argument("--d", type=int, nargs="+", default=None,
                    help="input dimensions (default 8 20 32 90; --quick: 8 20)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10], help="right-hand sides (default 1 10)")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="default both")
    ap.add_argument("--matern-d", type=int, nargs="*", default=[20],
                    help="d values that also get a Matern 5/2 row (default 20; empty for none)")
    ap.add_argument("--modes", nargs="+", choices=["naive", "cdist", "fly", "stored", "partial"],
                    default=["naive", "cdist", "fly", "stored"],
                    help="which implementations to time (default all but partial)")
    ap.add_argument("--partial-fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                    help="partial mode: the engine's memory budget is set so that this fraction of K_nM's rows "
                    "is stored (beside its two on-the-fly buffers), the rest recomputed at each product "
                    "(default 0.25 0.5 0.75)")
    ap.add_argument("--block-rows", type=int, nargs="+", default=None,
                    help="engine block_rows for on-the-fly rows; several values give one row each "
                    "(default gpfalkon.settings.block_rows)")
    ap.add_argument("--stored-block-rows", type=int, nargs="+", default=None,
                    help="rows per block when reading the stored K_nM (overrides the engine's "
                    "stored_block_rows attribute after construction; several values give one row each; "
                    "default: the engine's own choice, stored_batch sub-blocks of about 512 KiB)")
    ap.add_argument("--naive-block-rows", type=int, default=None,
                    help="rows per block of the naive and cdist baselines (default: the first --block-rows value)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (median reported)")
    ap.add_argument("--memory-budget-gib", type=float, default=None,
                    help="gpfalkon.settings.memory_budget in GiB (default: the library default, 4 GiB); "
                    "stored rows whose K_nM exceeds the budget are skipped")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="n=20,000, d in {8, 20}: a fast end-to-end check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="result file (default benchmarks/results/engine.md, engine-quick.md with --quick)")
    args = ap.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.n if args.n is not None else (20_000 if args.quick else 200_000)
    m = args.m
    ds = args.d if args.d is not None else ([8, 20] if args.quick else [8, 20, 32, 90])
    out_path = args.out or REPO / "benchmarks" / "results" / ("engine-quick.md" if args.quick else "engine.md")
    env = environment_lines()
    budget = (
        int(args.memory_budget_gib * 2**30) if args.memory_budget_gib is not None
        else gpfalkon.backend.memory_budget_for(None)
    )
    block_rows_list = args.block_rows or [gpfalkon.settings.block_rows.value()]  # None: the engine's ~16 MiB blocks
    block_rows = block_rows_list[0]
    stored_rows_list = args.stored_block_rows or [None]
    naive_rows = args.naive_block_rows if args.naive_block_rows is not None else (block_rows or 2048)
    for line in env:
        log(line)
    log(f"n={n:,} M={m:,} d={ds} k={args.k} dtypes={args.dtype} memory budget {budget / 2**30:.2f} GiB, "
        f"block_rows={block_rows_list}, stored block rows={stored_rows_list}, naive block rows={naive_rows}")

    torch.manual_seed(args.seed)
    peak = {}
    for name in args.dtype:
        peak[name] = matmul_gflops(DTYPES[name])
        log(f"torch.matmul 4096^2 {name}: {peak[name]:.1f} GFLOP/s")
    bandwidth = read_bandwidth()
    log(f"memory read rate (torch.sum over 1 GiB): {bandwidth:.1f} GB/s")

    headers = ["kernel", "d", "dtype", "k", "mode", "block rows", "seconds", "GFLOP/s", "x matmul", "GB/s",
               "x bandwidth", "own read GB/s", "x own read", "speed-up vs naive", "setup s", "rel. diff"]
    rows = []
    notes = []
    configs = [(kind, d) for d in ds for kind in (["rbf"] + (["matern52"] if d in args.matern_d else []))]
    t_start = time.perf_counter()
    with gpfalkon.settings.memory_budget(budget):
        for kind, d in configs:
            for name in args.dtype:
                dtype = DTYPES[name]
                g = torch.Generator().manual_seed(args.seed)
                x = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
                c = x[torch.randperm(n, generator=g)[:m]].clone()
                kern = make_kernel(kind, d, dtype)
                us = {k: torch.randn(m, k, generator=g, dtype=torch.float64) for k in args.k}
                itemsize = torch.finfo(dtype).bits // 8
                kbytes = n * m * itemsize
                res = []  # dicts in the order measured
                ref_out = {}

                def record(mode, brows, k, secs, flops, out, setup=None, gbs=None, own=None, *,
                           res=res, kind=kind, d=d, name=name):
                    res.append(dict(mode=mode, rows=brows, k=k, secs=secs, gflops=flops / secs / 1e9, out=out,
                                    setup=setup, gbs=gbs, own=own))
                    log(f"  {kind} d={d} {name} k={k} {mode:6s} rows={brows}: {secs:.4f} s  "
                        f"{flops / secs / 1e9:6.1f} GFLOP/s"
                        + (f"  {gbs:.1f} GB/s" if gbs else "") + (f"  (setup {setup:.3f} s)" if setup else ""))

                fly_flops = lambda k, d=d: 2.0 * n * m * d + 4.0 * n * m * k
                if "naive" in args.modes:
                    for k in args.k:
                        u = us[k]
                        secs, _ = median_time(
                            lambda kern=kern, x=x, c=c, u=u: naive_kmn_k(kern, x, c, u, naive_rows), args.repeats
                        )
                        out = naive_kmn_k(kern, x, c, u, naive_rows)
                        ref_out[k] = out
                        record("naive", naive_rows, k, secs, fly_flops(k), out)
                if "cdist" in args.modes:
                    ls = math.sqrt(d)
                    xs, cs = x / ls, c / ls
                    for k in args.k:
                        u = us[k]
                        secs, _ = median_time(
                            lambda kind=kind, xs=xs, cs=cs, u=u: cdist_kmn_k(kind, xs, cs, u, naive_rows), args.repeats
                        )
                        record("cdist", naive_rows, k, secs, fly_flops(k), cdist_kmn_k(kind, xs, cs, u, naive_rows))
                    del xs, cs
                for brows in block_rows_list if "fly" in args.modes else []:
                    eng = KernelEngine(kern, x, c, store=False, block_rows=brows)
                    for k in args.k:
                        u = us[k]
                        secs, _ = median_time(lambda eng=eng, u=u: eng.kmn_k(u), args.repeats)
                        record("fly", eng.block_rows, k, secs, fly_flops(k), eng.kmn_k(u))
                    eng.release()
                    del eng
                if "stored" in args.modes:
                    if kbytes > budget:
                        notes.append(f"{kind} d={d} {name}: stored rows skipped, K_nM needs "
                                     f"{kbytes / 2**30:.2f} GiB > memory budget {budget / 2**30:.2f} GiB "
                                     "(raise --memory-budget-gib)")
                        log("  " + notes[-1])
                    else:
                        eng = KernelEngine(kern, x, c, store=True, block_rows=block_rows)
                        t0 = time.perf_counter()
                        eng.kmn_k(us[args.k[0]])  # the first product builds the stored K_nM
                        setup = time.perf_counter() - t0
                        default_rows = eng.stored_block_rows
                        for srows in stored_rows_list:
                            eng.stored_block_rows = default_rows if srows is None else int(srows)
                            for k in args.k:
                                u = us[k]
                                secs, _ = median_time(lambda eng=eng, u=u: eng.kmn_k(u), args.repeats)
                                own = tensor_read_rate(eng._k)  # the stored K_nM's own memory, right after
                                record("stored", eng.stored_block_rows, k, secs, 4.0 * n * m * k, eng.kmn_k(u),
                                       setup=setup, gbs=kbytes / secs / 1e9, own=own)
                        eng.release()
                        del eng
                        gc.collect()
                for frac in args.partial_fractions if "partial" in args.modes else []:
                    if not 0.0 < frac < 1.0:
                        raise SystemExit(f"--partial-fractions must be in (0, 1), got {frac}")
                    probe = KernelEngine(kern, x, c, store=False, block_rows=block_rows)
                    part_budget = int(frac * n) * m * itemsize + 2 * probe.block_rows * m * itemsize
                    del probe
                    eng = KernelEngine(kern, x, c, memory_budget=part_budget, block_rows=block_rows)
                    t0 = time.perf_counter()
                    eng.kmn_k(us[args.k[0]])  # the first product fills the stored rows
                    setup = time.perf_counter() - t0
                    share = eng.stored_rows / n
                    for k in args.k:
                        u = us[k]
                        secs, _ = median_time(lambda eng=eng, u=u: eng.kmn_k(u), args.repeats)
                        flops = 4.0 * n * m * k + 2.0 * (n - eng.stored_rows) * m * d
                        record(f"partial {share:.0%}", eng.block_rows, k, secs, flops, eng.kmn_k(u), setup=setup)
                    eng.release()
                    del eng
                    gc.collect()
                naive_secs = {r["k"]: r["secs"] for r in res if r["mode"] == "naive"}
                order = {"naive": 0, "cdist": 1, "fly": 2, "stored": 4}
                for r in sorted(res, key=lambda r: (r["k"], order.get(r["mode"], 3))):  # stable: keeps block-size order
                    k, mode = r["k"], r["mode"]
                    speed = naive_secs[k] / r["secs"] if (mode != "naive" and k in naive_secs) else None
                    diff = rel_diff(r["out"], ref_out[k]) if (mode != "naive" and k in ref_out) else None
                    rows.append([
                        "RBF" if kind == "rbf" else "Matern 5/2", d, name, k, mode, r["rows"], r["secs"],
                        r["gflops"], r["gflops"] / peak[name], r["gbs"],
                        None if r["gbs"] is None else r["gbs"] / bandwidth, r["own"],
                        None if r["own"] is None else r["gbs"] / r["own"], speed, r["setup"], diff,
                    ])
                del x, c, res, ref_out, record  # record's default argument holds res
                gc.collect()
    elapsed = time.perf_counter() - t_start

    table = markdown_table(headers, rows, align="lrlrl" + "r" * 11)
    fused_ok, fused_why = fused_available()
    fused_line = "on (stored rows use it for k <= 16)" if fused_ok else f"off: {fused_why}"
    peak_line = ", ".join(f"{k}: {v:.1f} GFLOP/s" for k, v in peak.items())
    body = "\n".join([
        f"n = {n:,}, M = {m:,}, X ~ N(0, I_d), centers = {m:,} random rows of X, lengthscale sqrt(d). "
        f"Engine block_rows = {', '.join('auto (~16 MiB blocks)' if b is None else str(b) for b in block_rows_list)}; "
        "'block rows' is the rows per block actually "
        "used (stored mode: the engine's `stored_block_rows`, i.e. how the stored K_nM is read); naive baseline: "
        f"{naive_rows}-row blocks from `kernel(x_b, C).to_dense()` (GPyTorch {gpytorch.__version__}: squared distances "
        "by one matmul on [x, ||x||^2, 1], not torch.cdist), product `K_b^T (K_b U)`; cdist: same loop with "
        "`torch.cdist` + out-of-place kernel profile. "
        f"Memory budget {budget / 2**30:.2f} GiB. U float64 (cast to the data dtype by the engine). "
        f"Fused single-read stored-K CPU kernel (gpfalkon.backend.fused): {fused_line}.",
        "",
        f"torch.matmul (4096 x 4096, median of 3) in this run: {peak_line}. Memory read rate (torch.sum over a "
        f"1 GiB float32 tensor, median of 3) in this run: {bandwidth:.1f} GB/s.",
        "",
        f"Seconds: median of {args.repeats} after one warm-up. GFLOP/s counts 2nMd (on the fly and naive) + 4nMk; "
        "'x matmul' = GFLOP/s / matmul GFLOP/s; GB/s (stored) = n M itemsize / seconds (K_nM read once from "
        "memory); 'x bandwidth' = GB/s / the measured read rate; 'own read GB/s' = the read rate of the stored "
        "K_nM's own memory (torch.sum over its bytes, measured right after the product: the rate depends on "
        "the pages behind a tensor, stored-read-diagnosis.md) and 'x own read' = GB/s over it; "
        "'setup s' = one-off construction of the stored K_nM (not in 'seconds'; partial: the first product, "
        "which fills the stored rows); 'partial P%': store=None under a memory budget holding P% of K_nM's rows "
        "beside the two on-the-fly buffers, the rest recomputed per product (GFLOP/s counts 2 d M per "
        "recomputed row); "
        "'rel. diff' = max|out - out_naive| / max|out_naive|.",
        "",
        table,
        "",
        *([f"- {t}" for t in notes] + [""] if notes else []),
        f"Total benchmark time {elapsed:.0f} s.",
    ])
    print()
    print(table)
    path = write_result(out_path, "Kernel engine: one K_nM^T (K_nM U) product", env, body)
    log(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
