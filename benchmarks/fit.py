"""Benchmark of FALKON fits (FalkonGP.fit) against the dense direct Nyström solve.

Four parts, each a markdown table:

1. Synthetic sweep: n in {1e4, 1e5, 1e6} (d = 10; M = 1,000 for 1e4, 2,000 otherwise),
   x ~ N(0, I_d), y = f(x) + 0.1 eps with the smooth f(x) = sin(z1) + 0.5 cos(z2) z3,
   z = W^T x for a fixed random W (d x 3, entries N(0, 1/d)); 10,000 test points from the
   same distribution. RBF kernel, lengthscale by ``gpfalkon.median_lengthscale`` on the
   training inputs, lambda = 1e-6. FALKON (``FalkonGP(...).fit()``, float64 and float32;
   once to ``--tol`` (default 1e-6, at most ``--max-iter`` = 100 iterations) and once with
   exactly ``--fixed-iters`` = 20 iterations) against the direct solve:
   ``H = K_Mn K_nM + n lambda K_MM`` accumulated densely in
   float64 from the engine's blocks (``H += K_b^T K_b``), Cholesky (``gpfalkon.linalg.
   jittered_cholesky``), two triangular solves. Same centers for every method. The
   direct solve is skipped when its time, extrapolated linearly in n from the previous
   direct solve with the same M, exceeds ``--direct-max-seconds``.
2. Reference target: n = 200,000, d = 20, M = 2,000, lambda = 1e-6, exactly 20 CG
   iterations (tol = 0), float64 and float32: fit CPU seconds and test RMSE, against
   the falkon 0.9 reference library's ~70 CPU-seconds (float64) on its own synthetic
   problem (test RMSE 0.145 float64 / 0.30 float32 there). Targets: >= 5x faster
   (<= 14 CPU-s) and float32 test RMSE within 2% of float64. Each dtype is fitted
   ``--reference-repeats`` times (default 3) and the fit with the median wall time is
   reported (every fit's time is in the notes): one fit on a shared 2-core host varied by 25 %.
3. flights (``../shared/data/flights.npz``, 3M rows, 9 features): shuffled with a fixed
   seed, 2/3 train, 1/3 test, X and y standardised with training statistics; M = 5,000,
   lambda = 1e-6, RBF (or Matern 5/2) kernel with median-heuristic lengthscale, exactly
   20 CG iterations; float32 and float64. At this size K_nM (2M x 5,000) exceeds the
   memory budget, so it runs on the fly.

4. CG or direct (``--only choice``): n in {5e4, 2e5} (``--choice-sizes``), M in {100, 300,
   1000, 2000} (``--choice-m``), d = 10, float64 and float32, K_nM stored and on the fly: the
   library's FALKON CG (``solve_method="cg"``, to ``--tol``) against its direct solve
   (``solve_method="direct"``: the whitened ``M x M`` system from one pass, then Cholesky),
   and which of the two ``solve_method="auto"`` (the default) picks, with its time over the
   faster one's. Parts 1-3 pin ``solve_method="cg"``: they measure FALKON's CG.

Fit time = ``FalkonGP(...)`` construction (center selection) + ``.fit()``: wall clock
(``time.perf_counter``) and process CPU time (``time.process_time``, all threads).
Test predictions (mean only, ``gpytorch.settings.skip_posterior_variances``) are timed
separately. "RMSE vs f" is against the noise-free f (synthetic only); the noise floor of
the test RMSE is 0.1.

On a machine shared with other work, pass ``--threads 1``: with torch's default of
one thread per core, OpenMP threads waiting for a descheduled sibling made small
operations (an M x M triangular solve, a product with a 2,000 x 1,000 block)
10-100x slower in our runs. The result file records the thread count and the load
average at the start.

Usage (from the repository root):

    .venv/bin/python benchmarks/fit.py                    # everything (long: n = 1e6 and flights)
    .venv/bin/python benchmarks/fit.py --quick            # n <= 1e5, reference row at n = 1e5, no flights
    .venv/bin/python benchmarks/fit.py --skip-flights
    .venv/bin/python benchmarks/fit.py --only flights --flights-kernel matern52
    .venv/bin/python benchmarks/fit.py --memory-budget-gib 8 --out benchmarks/results/fit-8g.md

The tables are printed and written, with the command line, date, torch version,
thread count, CPU model and RAM, to ``--out`` (default ``benchmarks/results/fit.md``;
``fit-quick.md`` with ``--quick``).
"""
from __future__ import annotations

import argparse
import gc
import math
import pathlib
import statistics
import sys
import time
import warnings

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
from gpfalkon import FalkonGP, KernelEngine, median_lengthscale, uniform_centers
from gpfalkon.backend import stored_rows_for
from gpfalkon.backend.blocks import kept_stores, resolve_store_dtype
from gpfalkon.backend.engine import reuse_stores
from gpfalkon.errors import FalkonConvergenceError, NotPSDError
from gpfalkon.linalg import jittered_cholesky
from gpfalkon.operators.preconditioner import engine_memory_budget

from _common import (
    REPO,
    environment_lines,
    exp_rate,
    log,
    markdown_table,
    matmul_gflops,
    read_bandwidth,
    tensor_read_rate,
    timed,
    write_result,
)

FLIGHTS = REPO.parent / "shared" / "data" / "flights.npz"
DTYPES = {"float64": torch.float64, "float32": torch.float32}
REFERENCE_CPU_S = 70.0
REFERENCE_RMSE = {"float64": 0.145, "float32": 0.30}


# ----------------------------------------------------------------------------- data
def synthetic(n: int, n_test: int, d: int, seed: int):
    """Train/test data in float64: x ~ N(0, I), y = f(x) + 0.1 eps; f fixed per d."""
    gw = torch.Generator().manual_seed(1234 + d)
    w = torch.randn(d, 3, generator=gw, dtype=torch.float64) / math.sqrt(d)
    g = torch.Generator().manual_seed(seed * 1_000_003 + n)
    x = torch.randn(n + n_test, d, generator=g, dtype=torch.float64)
    z = x @ w
    f = torch.sin(z[:, 0]) + 0.5 * torch.cos(z[:, 1]) * z[:, 2]
    y = f + 0.1 * torch.randn(n + n_test, generator=g, dtype=torch.float64)
    return x[:n], y[:n], x[n:], y[n:], f[n:]


def make_kernel(kind: str, lengthscale: float, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    kern = gpytorch.kernels.RBFKernel() if kind == "rbf" else gpytorch.kernels.MaternKernel(nu=2.5)
    kern = kern.to(dtype)
    kern.lengthscale = lengthscale
    return kern


def kn_mode(n: int, m: int, dtype: torch.dtype) -> str:
    """What the engine will do with the default store=None (same rule as KernelEngine)."""
    itemsize = torch.finfo(dtype).bits // 8
    stored = n * m * itemsize <= gpfalkon.backend.memory_budget_for(None)
    return "stored" if stored else "on the fly"


def rmse(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float((pred.to(torch.float64) - target.to(torch.float64)).square().mean().sqrt())


# ----------------------------------------------------------------------------- methods
def fit_falkon(xtr, ytr, centers, kernel, lam, max_iter, tol, solve_method="cg", store=None):
    """Construct + fit a FalkonGP (FALKON's CG unless ``solve_method`` says otherwise); returns
    (model, wall, cpu, caught warnings)."""
    opts = gpfalkon.FalkonOptions(solve_method=solve_method, max_iter=max_iter, tol=tol, store_kernel=store)
    gpfalkon.backend.engine.await_frees()  # an earlier fit's K_nM freed before this one is timed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wall, cpu, model = timed(
            lambda: FalkonGP(xtr, ytr, kernel=kernel, centers=centers, penalty=lam, options=opts).fit()
        )
    return model, wall, cpu, [f"{w.category.__name__}: {w.message}" for w in caught]


def fit_falkon_store_rate(*args, **kwargs):
    """:func:`fit_falkon` in a ``reuse_stores()`` block of its own, then (outside the timing) the read rate of the
    fit's own stored ``K_nM`` (:func:`tensor_read_rate`, GB/s; ``None`` where nothing was stored), the store then
    freed. The first take of a block finds no kept store, so the fit allocates and fills fresh memory as
    without the block; its release keeps the store instead of freeing it in the background, which lets the
    memory that the fit's passes read be measured: on these VMs the read rate of a 1.6 GB allocation varies
    from one to the next (about 32 against 50 GB/s), and a limit at another buffer's rate moves with it.
    Returns (model, wall, cpu, caught warnings, rate)."""
    with reuse_stores():
        model, wall, cpu, warns = fit_falkon(*args, **kwargs)
        kept = kept_stores()
        rate = tensor_read_rate(kept[0]) if kept else None
    return model, wall, cpu, warns, rate


def predict_model(model: FalkonGP, x: torch.Tensor, chunk: int) -> torch.Tensor:
    model.eval()
    outs = []
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        for start in range(0, x.shape[0], chunk):
            outs.append(model(x[start : start + chunk]).mean.to(torch.float64))
    return torch.cat(outs)


def direct_solve(xtr64, ytr64, centers64, kernel64, lam):
    """Dense Nyström KRR in float64: H = sum_b K_b^T K_b + n lam K_MM, Cholesky, solve."""
    n, m = xtr64.shape[0], centers64.shape[0]
    eng = KernelEngine(kernel64, xtr64, centers64, store=False)
    h = torch.zeros(m, m, dtype=torch.float64)
    b = torch.zeros(m, dtype=torch.float64)
    with torch.no_grad():
        for start, stop, blk in eng.iter_blocks():
            h.addmm_(blk.t(), blk)
            b.addmv_(blk.t(), ytr64[start:stop])
        s = eng.scale
        if s != 1.0:
            h.mul_(s * s)
            b.mul_(s)
        h.add_(eng.kmm(torch.float64), alpha=n * lam)
        eng.release()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chol, jitter = jittered_cholesky(h, upper=False, name="H")
        alpha = torch.linalg.solve_triangular(chol, b.unsqueeze(-1), upper=False)
        alpha = torch.linalg.solve_triangular(chol.t(), alpha, upper=True).squeeze(-1)
    return alpha, jitter, [str(w.message) for w in caught]


def predict_direct(kernel64, centers64, alpha, x: torch.Tensor, chunk: int) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for start in range(0, x.shape[0], chunk):
            xb = x[start : start + chunk].to(torch.float64)
            outs.append(kernel64(xb, centers64).to_dense() @ alpha)
    return torch.cat(outs)


# ----------------------------------------------------------------------------- parts
def run_sweep(args, notes: list[str]) -> str | None:
    if args.sizes:
        sizes = [int(s) for s in args.sizes]
    else:
        sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    d = 10
    headers = ["n", "M", "method", "dtype", "K_nM", "fit wall s", "fit CPU s", "iterations", "final residual",
               "test RMSE", "RMSE vs f", "predict s", "direct wall / this"]
    rows = []
    last_direct = {}  # M -> (n, wall)
    for n in sizes:
        m = 1000 if n <= 10_000 else 2000
        log(f"[sweep] n={n:,} d={d} M={m:,}: generating data")
        xtr, ytr, xte, yte, fte = synthetic(n, args.n_test, d, args.seed)
        ls = float(median_lengthscale(xtr))
        idx = uniform_centers(xtr, m, torch.Generator().manual_seed(args.seed)).indices
        c64 = xtr[idx].clone()
        log(f"[sweep] n={n:,}: median lengthscale {ls:.3f}")
        group = []
        variants = [(f"FALKON tol={args.tol:g}", args.max_iter, args.tol)]
        if args.fixed_iters > 0:
            variants.append((f"FALKON {args.fixed_iters} it", args.fixed_iters, 0.0))
        for (label, max_iter, tol), name in ((v, nm) for v in variants for nm in args.dtypes):
            dtype = DTYPES[name]
            xd, yd, cd = xtr.to(dtype), ytr.to(dtype), c64.to(dtype)
            try:
                model, wall, cpu, warns = fit_falkon(xd, yd, cd, make_kernel("rbf", ls, dtype), args.lam,
                                                     max_iter, tol)
            except (FalkonConvergenceError, NotPSDError, RuntimeError) as exc:
                notes.append(f"sweep n={n:,} {label} {name} failed: {type(exc).__name__}: {exc}")
                log("  " + notes[-1])
                continue
            info = model.fit_info
            tp, _, pred = timed(
                lambda model=model, xte=xte, dtype=dtype: predict_model(model, xte.to(dtype), args.predict_chunk)
            )
            r, rf = rmse(pred, yte), rmse(pred, fte)
            for w in warns:
                notes.append(f"sweep n={n:,} {label} {name}: {w}")
            log(f"  {label} {name}: fit {wall:.2f} s wall / {cpu:.2f} s CPU, {info.iterations} it, "
                f"residual {float(info.final_residual.max()):.2e}, test RMSE {r:.4f} (vs f {rf:.4f}), "
                f"predict {tp:.2f} s")
            group.append([n, m, label, name, kn_mode(n, m, dtype), wall, cpu, info.iterations,
                          float(info.final_residual.max()), r, rf, tp, None])
            del model, xd, yd, cd
            gc.collect()
        # direct solve (always float64)
        direct_wall = None
        est = None
        if m in last_direct:
            n0, w0 = last_direct[m]
            est = w0 * n / n0
        if args.no_direct:
            notes.append(f"sweep n={n:,}: direct solve skipped (--no-direct)")
        elif est is not None and est > args.direct_max_seconds:
            notes.append(f"sweep n={n:,}: direct solve skipped, estimated {est:.0f} s (linear in n from "
                         f"n={last_direct[m][0]:,}) > --direct-max-seconds {args.direct_max_seconds:g}")
            log("  " + notes[-1])
        else:
            kern64 = make_kernel("rbf", ls, torch.float64)
            log(f"  direct solve (float64) n={n:,} M={m:,} ...")
            try:
                dwall, dcpu, (alpha, jitter, dwarns) = timed(
                    lambda xtr=xtr, ytr=ytr, c64=c64, kern64=kern64: direct_solve(xtr, ytr, c64, kern64, args.lam)
                )
            except NotPSDError as exc:
                notes.append(f"sweep n={n:,} direct solve failed: {exc}")
                log("  " + notes[-1])
            else:
                tp, _, pred = timed(
                    lambda kern64=kern64, c64=c64, alpha=alpha, xte=xte: predict_direct(
                        kern64, c64, alpha, xte, args.predict_chunk
                    )
                )
                r, rf = rmse(pred, yte), rmse(pred, fte)
                log(f"  direct: {dwall:.2f} s wall / {dcpu:.2f} s CPU, jitter {jitter:.2e}, "
                    f"test RMSE {r:.4f} (vs f {rf:.4f})")
                if dwarns or jitter > 0:
                    notes.append(f"sweep n={n:,} direct solve: Cholesky of H with jitter {jitter:.3g}"
                                 + (f" ({'; '.join(dwarns)})" if dwarns else ""))
                group.append([n, m, "direct (dense H, Cholesky)", "float64", "blockwise", dwall, dcpu, None, None,
                              r, rf, tp, 1.0])
                direct_wall = dwall
                last_direct[m] = (n, dwall)
        if direct_wall is not None:
            for row in group:
                if row[2].startswith("FALKON"):
                    row[-1] = direct_wall / row[5]
        rows.extend(group)
        del xtr, ytr, xte, yte, fte
        gc.collect()
    stop = f"tol={args.tol:g}, max_iter={args.max_iter}" + (
        f", and exactly {args.fixed_iters} iterations (tol=0)" if args.fixed_iters > 0 else "")
    return (
        f"## Synthetic sweep (d = 10, lambda = {args.lam:g}, RBF, median-heuristic lengthscale, CG {stop})\n\n"
        + markdown_table(headers, rows, align="rrlll" + "r" * (len(headers) - 5))
    )


def run_choice(args, notes: list[str]) -> str:
    """CG against the library's direct solve over a grid, and what ``solve_method="auto"`` picks."""
    d = 10
    sizes = [int(s) for s in (args.choice_sizes or ([20_000, 100_000] if args.quick else [50_000, 200_000]))]
    ms = [int(m) for m in args.choice_m]
    headers = ["n", "M", "dtype", "K_nM", "CG wall s", "CG iterations", "direct wall s", "direct / CG",
               "auto picks", "auto wall / best", "CG test RMSE", "direct test RMSE"]
    rows = []
    for n in sizes:
        xtr, ytr, xte, yte, _ = synthetic(n, args.n_test, d, args.seed)
        ls = float(median_lengthscale(xtr))
        for m in ms:
            idx = uniform_centers(xtr, m, torch.Generator().manual_seed(args.seed)).indices
            for name in args.dtypes:
                dtype = DTYPES[name]
                xd, yd, cd = xtr.to(dtype), ytr.to(dtype), xtr[idx].to(dtype)
                for store in (True, False):
                    res = {}
                    for method in ("cg", "direct", "auto"):
                        gc.collect()
                        model, wall, _, warns = fit_falkon(xd, yd, cd, make_kernel("rbf", ls, dtype), args.lam,
                                                           args.max_iter, args.tol, solve_method=method, store=store)
                        info = model.fit_info
                        picked = info.extra.get("method", "cg")
                        pred = predict_model(model, xte.to(dtype), args.predict_chunk)
                        res[method] = (wall, info.iterations, picked, rmse(pred, yte))
                        notes.extend(f"choice n={n:,} M={m} {name} {method}: {w}" for w in warns)
                        del model
                    (cw, ci, _, cr), (dw, _, _, dr), (aw, _, ap, _) = res["cg"], res["direct"], res["auto"]
                    rows.append([n, m, name, "stored" if store else "on the fly", cw, ci, dw, dw / cw, ap,
                                 aw / min(cw, dw), cr, dr])
                    log(f"[choice] n={n:,} M={m} {name} {'stored' if store else 'fly'}: CG {cw:.2f} s ({ci} it), "
                        f"direct {dw:.2f} s, auto -> {ap} {aw:.2f} s; RMSE {cr:.4f} / {dr:.4f}")
        del xtr, ytr, xte, yte
        gc.collect()
    return (
        f"## CG or direct: what solve_method='auto' picks (d = {d}, lambda = {args.lam:g}, RBF, median-heuristic "
        f"lengthscale, CG to tol={args.tol:g} / max_iter={args.max_iter})\n\n"
        "Each fit: FalkonGP construction (centers given) + fit() with solve_method 'cg', 'direct', 'auto', one "
        "run each (no repeats: read ratios near 1 as ties). 'auto wall / best' = the auto fit's wall time over the "
        "faster of the CG and direct fits (1 = it picked the faster, up to timing noise).\n\n"
        + markdown_table(headers, rows, align="rrll" + "r" * 4 + "l" + "r" * 3)
    )


def physical_limit(n: int, m: int, d: int, iterations: int, dtype: torch.dtype, store_itemsize: int | None = None
                   ) -> tuple[float, str, float, float, float]:
    """A lower bound on the wall time of a stored-K_nM FALKON fit on this machine, from rates measured
    now: K_nM computed once (2 n M d flops at torch's matmul rate in ``dtype``, n M exps at the
    cache-resident exp rate), then ``iterations`` reads of the stored K_nM (n M itemsize bytes each) at
    the measured read rate, plus the preconditioner's two M x M Cholesky factorisations and one
    triangular product (M^3 flops at the float64 matmul rate). Returns (seconds, how it splits, the
    seconds of obtaining K_nM's memory: a fresh ``n M`` tensor's first write and release, which a
    fit pays and the limit does not count, and the limit with the reads at the read rate of that fresh
    ``n M`` tensor itself: memory allocated as K_nM's is, whose rate can differ from the 1 GiB buffer's,
    ``benchmarks/results/stored-read-diagnosis.md``), and the limit less its reads. ``store_itemsize``: the
    bytes of a stored value where the store is not of ``dtype`` (the int16 store: 2; its reads and its fresh
    memory then count those)."""
    itemsize = torch.empty(0, dtype=dtype).element_size() if store_itemsize is None else store_itemsize
    gc.collect()
    gpfalkon.backend.engine.await_frees()  # the fit's K_nM, freed on a background thread: gone before any timing
    t0 = time.perf_counter()
    fresh = torch.empty(n * m * itemsize // 4, dtype=torch.float32)  # the store's bytes
    fresh.fill_(0.0)  # the first write of freshly mapped memory: page faults and zeroing
    t1 = time.perf_counter()
    own = tensor_read_rate(fresh) * 1e9
    t_del = time.perf_counter()
    del fresh  # and giving it back
    touch = t1 - t0 + time.perf_counter() - t_del
    mm = matmul_gflops(dtype) * 1e9
    mm64 = mm if dtype == torch.float64 else matmul_gflops(torch.float64) * 1e9
    ex = exp_rate(dtype)
    bw = read_bandwidth() * 1e9
    parts = {"matmul": 2.0 * n * m * d / mm, "exp": n * m / ex, "reads": iterations * n * m * itemsize / bw,
             "precond": float(m) ** 3 / mm64}
    how = (f"matmul {parts['matmul']:.2f} s ({mm / 1e9:.0f} GFLOP/s) + exp {parts['exp']:.2f} s "
           f"({ex / 1e9:.2f} G/s) + {iterations} reads {parts['reads']:.2f} s ({bw / 1e9:.1f} GB/s) + "
           f"preconditioner {parts['precond']:.2f} s; not counted: the first write and release of n M "
           f"itemsize fresh bytes {touch:.2f} s (write {t1 - t0:.2f} s); reads at the fresh n M tensor's own "
           f"rate ({own / 1e9:.1f} GB/s): {iterations * n * m * itemsize / own:.2f} s")
    own_limit = sum(parts.values()) - parts["reads"] + iterations * n * m * itemsize / own
    return sum(parts.values()), how, touch, own_limit, sum(parts.values()) - parts["reads"]


def run_reference(args, notes: list[str]) -> str:
    n = args.reference_n if args.reference_n else (100_000 if args.quick else 200_000)
    d, m = 20, 2000
    log(f"[reference] n={n:,} d={d} M={m:,} lambda={args.lam:g}, 20 iterations")
    xtr, ytr, xte, yte, fte = synthetic(n, args.n_test, d, args.seed)
    ls = float(median_lengthscale(xtr))
    idx = uniform_centers(xtr, m, torch.Generator().manual_seed(args.seed)).indices
    c64 = xtr[idx].clone()
    headers = ["n", "dtype", "K_nM", "store", "fit wall s", "fit CPU s", "iterations", "test RMSE", "RMSE vs f",
               "speed-up vs 70 CPU-s", ">= 5x", "RMSE / float64 RMSE", "physical limit s", "x limit", "<= 1.5x",
               "K_nM memory s", "x (limit + memory)", "limit at K_nM's read rate s", "x that limit",
               "refit s (reuse_stores)", "refit x limit", "x the dtype store's limit", "own K_nM read GB/s",
               "x the limit at its own K_nM's rate"]
    rows = []
    results = {}
    limits = []
    dtype_limit: dict[str, float] = {}
    for name, fmt in [(name, fmt) for name in args.dtypes for fmt in args.store_formats]:
        dtype = DTYPES[name]
        store_fmt = None if fmt == "dtype" else fmt
        label = name if store_fmt is None else f"{name}, {fmt} store"
        try:
            with gpfalkon.settings.store_format(store_fmt):
                fits, store_rates = [], []
                for _ in range(args.reference_repeats):  # the fit with the median wall time is reported
                    model, wall, cpu, warns, rate = fit_falkon_store_rate(
                        xtr.to(dtype), ytr.to(dtype), c64.to(dtype), make_kernel("rbf", ls, dtype), args.lam, 20, 0.0)
                    fits.append((wall, cpu))
                    store_rates.append((wall, rate, model.fit_info.iterations))
                    if len(fits) < args.reference_repeats:
                        del model
                        gc.collect()
                walls = sorted(fits)
                wall, cpu = walls[len(walls) // 2]
                if len(fits) > 1:
                    notes.append(f"reference {label}: fit wall s of the {len(fits)} fits: "
                                 + ", ".join(f"{w:.2f}" for w, _ in fits) + f" (median {wall:.2f} reported)")
                # refits of the same size in one reuse_stores() block: the second and later write K_nM into the
                # first one's store (no fresh pages), as auto_fit's selection fits of one size do
                refits = []
                if args.reference_repeats > 1:
                    del model
                    gc.collect()
                    with reuse_stores():
                        for i in range(args.reference_repeats + 1):
                            model, r_wall, _, _ = fit_falkon(xtr.to(dtype), ytr.to(dtype), c64.to(dtype),
                                                             make_kernel("rbf", ls, dtype), args.lam, 20, 0.0)
                            refits.append(r_wall)
                            if i < args.reference_repeats:  # the last one is kept for the test error below
                                del model
                                gc.collect()
                    notes.append(f"reference {label}: fit wall s in one reuse_stores() block: "
                                 + ", ".join(f"{w:.2f}" for w in refits)
                                 + " (the median of all but the first reported)")
                refit = statistics.median(refits[1:]) if len(refits) > 1 else None
        except (FalkonConvergenceError, NotPSDError, RuntimeError) as exc:
            notes.append(f"reference {label} failed: {type(exc).__name__}: {exc}")
            log("  " + notes[-1])
            continue
        pred = predict_model(model, xte.to(dtype), args.predict_chunk)
        r, rf = rmse(pred, yte), rmse(pred, fte)
        for w in warns:
            notes.append(f"reference {label}: {w}")
        log(f"  {label}: fit {wall:.2f} s wall / {cpu:.2f} s CPU, test RMSE {r:.4f} (vs f {rf:.4f})")
        if store_fmt is None:
            results[name] = r
        else:
            results[label] = r
        iterations = model.fit_info.iterations
        del model
        gc.collect()
        limit, how, touch, own_limit, no_reads = physical_limit(n, m, d, iterations, dtype,
                                                                store_itemsize=None if store_fmt is None else 2)
        store_bytes = n * m * (torch.empty(0, dtype=dtype).element_size() if store_fmt is None else 2)
        # (read rate, fit wall / the limit with the reads at that rate) of each fit that stored its K_nM
        own = [(r, w / (no_reads + its * store_bytes / (r * 1e9))) for w, r, its in store_rates if r]
        own_rate = statistics.median([r for r, _ in own]) if own else None
        own_ratio = statistics.median([x for _, x in own]) if own else None
        if own:
            notes.append(f"reference {label}: the read rate of each fit's own K_nM (GB/s) and its fit wall / the limit "
                         "with the reads at that rate: " + ", ".join(f"{r:.1f} ({x:.2f}x)" for r, x in own))
        if store_fmt is None:
            dtype_limit[name] = limit
        limits.append(f"{label}: {limit:.2f} s = {how}")
        log(f"  {label}: physical limit {limit:.2f} s ({how})")
        base = dtype_limit.get(name)
        rows.append([n, name, kn_mode(n, m, dtype), fmt, wall, cpu, iterations, r, rf,
                     REFERENCE_CPU_S / cpu, REFERENCE_CPU_S / cpu >= 5.0, None, limit, wall / limit,
                     wall / limit <= 1.5, touch, wall / (limit + touch), own_limit, wall / own_limit,
                     refit, None if refit is None else refit / limit, None if base is None else wall / base,
                     own_rate, own_ratio])
    if "float64" in results:
        for row in rows:
            row[11] = row[7] / results["float64"]
    text = (
        f"## Reference target (d = {d}, M = {m:,}, lambda = {args.lam:g}, RBF, median-heuristic lengthscale "
        f"{ls:.3f}, exactly 20 CG iterations)\n\n"
        + markdown_table(headers, rows, align="rlll" + "r" * 20)
        + "\n\nfalkon 0.9 reference: ~70 CPU-s (float64), test RMSE 0.145 (float64) / 0.30 (float32) on its own "
        "synthetic problem. Targets: CPU-s <= 14 (>= 5x) at equal error; float32 test RMSE within 2% of float64"
    )
    if "float64" in results:
        for key in [k for k in results if k != "float64"]:
            rel = results[key] / results["float64"] - 1.0
            text += f" (here {key}: {100 * rel:+.2f}%, {'met' if abs(rel) <= 0.02 else 'NOT met'})"
    text += "."
    if any(fmt != "dtype" for fmt in args.store_formats):
        text += ("\n\n'store': `dtype`, K_nM stored in the data's dtype; `int16`, under "
                 "`gpfalkon.settings.store_format(\"int16\")` (16-bit fixed point with a scale per row: 2 bytes a "
                 "value). An int16 row's physical limit, 'K_nM memory s' and read-rate limit count its 2-byte "
                 "values (its own floor); 'x the dtype store's limit' = its fit wall / the limit of the same "
                 "dtype's row with K_nM stored in that dtype (the floor issue 17 states for the fit).")
    if limits:
        text += ("\n\n'K_nM memory s': the first write and the release of a fresh n M tensor of the fit's dtype, "
                 "measured right after the fit (page faults, zeroing, unmapping: what obtaining the stored K_nM "
                 "costs the fit, not counted in the limit); 'x (limit + memory)' = fit wall / (limit + it). "
                 "'limit at K_nM's read rate': the same limit with the reads at the rate `sum()` reads that fresh "
                 "n M tensor (memory obtained as the fit's K_nM is; the 1 GiB buffer of the first limit can read "
                 "faster or slower than it). 'refit s (reuse_stores)': the median wall time of the same fit "
                 "repeated inside one `gpfalkon.backend.engine.reuse_stores()` block, all but the first (each "
                 "writes K_nM into the store the previous one released: no fresh pages, as a process that refits "
                 "at one size, e.g. auto_fit's selection fits, sees it); 'refit x limit' = it / the limit. "
                 "'own K_nM read GB/s': the median over the timed fits of the rate `sum()` reads each fit's own "
                 "stored K_nM, measured right after that fit (its store kept by a `reuse_stores()` block of its own, "
                 "then freed); 'x the limit at its own K_nM's rate': the median over those fits of fit wall / the "
                 "limit with the reads at that fit's own store's rate (the memory the fit's passes read: the read "
                 "rate of a 1.6 GB allocation varies from one to the next on these VMs, so the other limits move "
                 "with the allocation that measured them)."
                 "\n\nPhysical limit (issue 17: fit within 1.5x of it), measured right after each fit: "
                 + physical_limit.__doc__.split("now: ", 1)[1].split(" Returns")[0].replace("\n    ", " ")
                 + "\n\n" + "\n".join(f"- {line}" for line in limits))
    if n != 200_000:
        text += (f"\n\n**n = {n:,}, not 200,000: these rows are not comparable with the 70 CPU-s figure"
                 + (" (--quick).**" if args.quick else ".**"))
    return text


def run_flights(args, notes: list[str]) -> str | None:
    if not FLIGHTS.exists():
        notes.append(f"flights skipped: {FLIGHTS} not found")
        log(notes[-1])
        return None
    log(f"[flights] loading {FLIGHTS}")
    with np.load(FLIGHTS) as z:
        x_all, y_all = z["X"], z["y"]
    perm = np.random.default_rng(args.seed).permutation(x_all.shape[0])
    if args.flights_rows is not None and args.flights_rows < x_all.shape[0]:
        perm = perm[: args.flights_rows]
        notes.append(f"flights: only {args.flights_rows:,} of {x_all.shape[0]:,} rows used (--flights-rows)")
    n_train = (2 * len(perm)) // 3
    tr, te = perm[:n_train], perm[n_train:]
    xtr, xte = x_all[tr].astype(np.float64), x_all[te].astype(np.float64)
    ytr, yte = y_all[tr].astype(np.float64), y_all[te].astype(np.float64)
    del x_all, y_all
    mu, sd = xtr.mean(0), xtr.std(0)
    sd[sd == 0] = 1.0
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    ym, ys = ytr.mean(), ytr.std()
    ytr_s, yte_s = (ytr - ym) / ys, (yte - ym) / ys
    xtr_t, xte_t = torch.from_numpy(xtr), torch.from_numpy(xte)
    ytr_t, yte_t = torch.from_numpy(ytr_s), torch.from_numpy(yte_s)
    del xtr, xte, ytr, yte
    m = args.flights_m
    ls = float(median_lengthscale(xtr_t))
    if args.flights_ls_factor != 1.0:
        ls *= args.flights_ls_factor
    idx = uniform_centers(xtr_t, m, torch.Generator().manual_seed(args.seed)).indices
    c64 = xtr_t[idx].clone()
    mean_rmse = rmse(torch.zeros_like(yte_t), yte_t)  # predicting the training mean (0 after standardising)
    log(f"[flights] n_train={len(tr):,} n_test={len(te):,} d={xtr_t.shape[1]} M={m:,} lengthscale {ls:.3f}; "
        f"predicting the mean: RMSE {mean_rmse:.4f} (standardised), {mean_rmse * ys:.2f} min")
    headers = ["dtype", "store", "K_nM rows stored", "fit wall s", "fit CPU s", "iterations", "final residual",
               "test RMSE (std.)", "test RMSE (min)", "mean-prediction RMSE (std.)", "mean-prediction RMSE (min)",
               "predict s"]
    rows = []
    for name, fmt in [(name, fmt) for name in args.dtypes for fmt in args.flights_store_formats]:
        dtype = DTYPES[name]
        store_fmt = None if fmt == "dtype" else fmt
        label = name if store_fmt is None else f"{name}, {fmt} store"
        try:
            with gpfalkon.settings.store_format(store_fmt):
                model, wall, cpu, warns = fit_falkon(xtr_t.to(dtype), ytr_t.to(dtype), c64.to(dtype),
                                                     make_kernel(args.flights_kernel, ls, dtype), args.flights_lam,
                                                     20, 0.0)
                itemsize = torch.empty(0, dtype=dtype).element_size()
                head = stored_rows_for(len(tr), m, itemsize, engine_memory_budget(m, torch.device("cpu")),
                                       store_dtype=resolve_store_dtype(dtype))
        except (FalkonConvergenceError, NotPSDError, RuntimeError) as exc:
            notes.append(f"flights {label} failed: {type(exc).__name__}: {exc}")
            log("  " + notes[-1])
            continue
        for w in warns:
            notes.append(f"flights {label}: {w}")
        info = model.fit_info
        log(f"  {label}: fit {wall:.1f} s wall / {cpu:.1f} s CPU; predicting {len(te):,} test points ...")
        tp, _, pred = timed(lambda model=model, dtype=dtype: predict_model(model, xte_t.to(dtype), args.predict_chunk))
        r = rmse(pred, yte_t)
        log(f"  {label}: test RMSE {r:.4f} (standardised), {r * ys:.2f} min; predict {tp:.1f} s")
        rows.append([name, fmt, f"{head:,} of {len(tr):,}", wall, cpu, info.iterations,
                     float(info.final_residual.max()), r, r * ys, mean_rmse, mean_rmse * ys, tp])
        del model
        gc.collect()
    kname = "RBF" if args.flights_kernel == "rbf" else "Matern 5/2"
    return (
        f"## flights (n_train = {len(tr):,}, n_test = {len(te):,}, d = 9, M = {m:,}, lambda = {args.flights_lam:g}, "
        f"{kname} with lengthscale {ls:.3f} (median heuristic on standardised X"
        + (f" x {args.flights_ls_factor:g}" if args.flights_ls_factor != 1.0 else "")
        + f"), exactly 20 CG iterations, shuffle seed {args.seed})\n\n"
        + markdown_table(headers, rows, align="lll" + "r" * 9)
        + "\n\n'store': K_nM's stored rows in the data's dtype (`dtype`) or in 16-bit fixed point (`int16`, "
        "`gpfalkon.settings.store_format`); the rows that do not fit the memory budget are recomputed at every "
        "iteration ('K_nM rows stored', by the engine's rule)."
        + f"\n\ny standardised with training statistics (mean {ym:.3f} min, sd {ys:.3f} min); "
        "RMSE (min) = RMSE (std.) x sd. Mean prediction = the training mean."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n <= 1e5, reference row at n = 1e5, no flights")
    ap.add_argument("--skip-flights", action="store_true", help="do not run the flights part")
    ap.add_argument("--only", nargs="+", choices=["sweep", "reference", "flights", "choice"], default=None,
                    help="run only these parts (default: all)")
    ap.add_argument("--sizes", nargs="+", type=float, default=None, help="sweep n values (default 1e4 1e5 1e6)")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="default float64 float32")
    ap.add_argument("--lam", type=float, default=1e-6, help="lambda for the sweep and reference parts (1e-6)")
    ap.add_argument("--tol", type=float, default=1e-6, help="sweep CG tolerance (default 1e-6; 0 = exactly --max-iter)")
    ap.add_argument("--max-iter", type=int, default=100, help="sweep CG iteration cap (default 100)")
    ap.add_argument("--fixed-iters", type=int, default=20,
                    help="also fit the sweep with exactly this many CG iterations (tol=0); 0 disables (default 20)")
    ap.add_argument("--n-test", type=int, default=10_000, help="synthetic test points (default 10,000)")
    ap.add_argument("--direct-max-seconds", type=float, default=600.0,
                    help="skip a direct solve whose extrapolated time exceeds this (default 600)")
    ap.add_argument("--no-direct", action="store_true", help="skip all direct solves")
    ap.add_argument("--reference-repeats", type=int, default=3,
                    help="fits of each reference dtype; the median wall time is reported (default 3)")
    ap.add_argument("--store-formats", nargs="+", choices=["dtype", "int16"], default=["dtype", "int16"],
                    help="reference part: K_nM stored in the data's dtype and/or in 16-bit fixed point "
                         "(gpfalkon.settings.store_format; default both)")
    ap.add_argument("--flights-store-formats", nargs="+", choices=["dtype", "int16"], default=["dtype", "int16"],
                    help="flights part: K_nM stored in the data's dtype and/or in 16-bit fixed point (default both)")
    ap.add_argument("--reference-n", type=int, default=None,
                    help="n of the reference row (default 200,000; 1e5 with --quick)")
    ap.add_argument("--choice-sizes", nargs="+", type=float, default=None,
                    help="n values of the CG-vs-direct part (default 5e4 2e5; 2e4 1e5 with --quick)")
    ap.add_argument("--choice-m", nargs="+", type=int, default=[100, 300, 1000, 2000],
                    help="M values of the CG-vs-direct part (default 100 300 1000 2000)")
    ap.add_argument("--flights-m", type=int, default=5000, help="flights centers (default 5,000)")
    ap.add_argument("--flights-lam", type=float, default=1e-6, help="flights lambda (default 1e-6)")
    ap.add_argument("--flights-kernel", choices=["rbf", "matern52"], default="rbf")
    ap.add_argument("--flights-rows", type=int, default=None,
                    help="use only this many (shuffled) rows of flights before the 2/3 split (default: all 3M)")
    ap.add_argument("--flights-ls-factor", type=float, default=1.0, help="multiply the median-heuristic lengthscale")
    ap.add_argument("--predict-chunk", type=int, default=10_000, help="test rows per prediction chunk")
    ap.add_argument("--memory-budget-gib", type=float, default=None,
                    help="gpfalkon.settings.memory_budget in GiB (default: the library default, 4 GiB)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="result file (default benchmarks/results/fit.md, fit-quick.md with --quick)")
    args = ap.parse_args()
    if args.sizes and args.quick and max(args.sizes) > 1e5:
        ap.error("--quick limits the sweep to n <= 1e5")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    parts = args.only or ["sweep", "reference", "flights", "choice"]
    if (args.quick or args.skip_flights) and "flights" in parts:
        parts = [p for p in parts if p != "flights"]
    out_path = args.out or REPO / "benchmarks" / "results" / ("fit-quick.md" if args.quick else "fit.md")
    env = environment_lines()
    for line in env:
        log(line)
    budget = (
        int(args.memory_budget_gib * 2**30) if args.memory_budget_gib is not None
        else gpfalkon.backend.memory_budget_for(None)
    )
    log(f"parts: {parts}; memory budget {budget / 2**30:.2f} GiB; block_rows {gpfalkon.settings.block_rows.value()}")
    notes: list[str] = []
    sections = []
    t0 = time.perf_counter()
    with gpfalkon.settings.memory_budget(budget):
        if "sweep" in parts:
            sections.append(run_sweep(args, notes))
        if "reference" in parts:
            sections.append(run_reference(args, notes))
        if "flights" in parts:
            s = run_flights(args, notes)
            if s:
                sections.append(s)
        if "choice" in parts:
            sections.append(run_choice(args, notes))
    elapsed = time.perf_counter() - t0
    header = (
        f"Memory budget (gpfalkon.settings.memory_budget): {budget / 2**30:.2f} GiB"
        + (" (library default)" if args.memory_budget_gib is None else " (--memory-budget-gib)")
        + f"; engine block_rows {gpfalkon.settings.block_rows.value()}. 'K_nM' says whether the engine stores K_nM "
        "(fits the budget) or recomputes it on every CG iteration. Fit time = FalkonGP construction (centers given) + "
        "fit(); CPU s = time.process_time (all threads). FALKON: CG vectors, preconditioner and predictions in "
        "float64; kernel products in the data dtype. Direct solve: float64 throughout, time = accumulating "
        "H = K_Mn K_nM + n lambda K_MM and K_Mn y blockwise + Cholesky + solves (not prediction)."
    )
    body = "\n\n".join([header, *sections])
    if notes:
        body += "\n\n## Notes\n\n" + "\n".join(f"- {t}" for t in notes)
    body += f"\n\nTotal benchmark time {elapsed:.0f} s."
    print()
    print(body)
    path = write_result(out_path, "FALKON fit vs direct Nyström solve", env, body)
    log(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
