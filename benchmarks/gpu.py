"""FALKON on a CUDA GPU: the device's ceilings, the engine's rates, TF32's error, float32 against
float64, fits at n = 1e7 (in GPU memory and streamed from host memory) and GPyTorch SGPR / SVGP on
the same GPU.

Usage (on a machine with a GPU; ``--smoke`` runs every part at toy sizes on any device)::

    python benchmarks/gpu.py --out benchmarks/results/gpu      # writes gpu.md and gpu.json there
    python benchmarks/gpu.py --smoke --device cpu --out /tmp/gpu-smoke

Parts (each timed with CUDA events or after ``torch.cuda.synchronize``; medians of repeats):

1. ``peaks`` - the ceilings measured in this run: float32 matmul (8192^3) in IEEE float32 and in
   TF32, float64 matmul, a device-to-device copy (bytes read + written over time) and a
   pinned host-to-device copy.
2. ``engine`` - one on-the-fly pass ``K^T (K u)`` (``KernelEngine.kmn_k``, float32, RBF) at
   n = 1e6, M = 20,000, d = 24 and d = 128: flops (distance matmul ``2 n M (d + 2)`` and thin
   products ``4 n M``) over time against the IEEE float32 matmul peak; and the bytes an unfused pass
   moves (write the distance block, read + write it for the exponential, read it twice for the two
   products: 20 bytes per kernel value) over time against the copy rate. One pass over a stored
   ``K_nM`` (n = 4e5, M = 10,000: 16 GB) against the copy rate, counting its one read. IEEE float32
   and TF32 (``gpfalkon.settings.tf32``).
3. ``tf32`` - the kernel-block error of float32 and TF32 against float64 (max abs, relative
   Frobenius) on standardised synthetic inputs.
4. ``reference`` - the reference problem of issue 17 (``benchmarks/fit.py``'s synthetic data,
   n = 200,000, d = 20, M = 2,000, lambda = 1e-6, exactly 20 CG iterations): float64, float32 and
   float32 with TF32, test RMSE and fit time. Must hold: float32 within 2 % of float64.
5. ``flights`` - the same on flights (``benchmarks/fit.py`` part 3's split: shuffled with seed 0,
   2/3 train; M = 5,000, RBF with median lengthscale, lambda = 1e-6, 20 iterations).
6. ``scale`` - synthetic n = 1e7 (+ 1e5 test), d = 24, y = f(x) + 0.1 eps with ``fit.py``'s f:
   FALKON float32, 20 iterations, each ``--scale-m`` (default 10,000 and 50,000), ``x`` in GPU
   memory, through the fused Triton pass; the first size also through torch's blockwise pass; at the
   first size also ``x`` in host memory streamed to the GPU (``TensorRows(x_host, device="cuda")``)
   with the prefetcher (pinned buffers, side stream) and without it (each block read and copied when
   asked for), unless ``--no-scale-host``. Fit time and its split, test RMSE, the CG iterations'
   flops over time against the float32 peak.
7. ``baselines`` - GPyTorch SGPR and SVGP (``benchmarks/compare.py``'s runners, same settings as on
   the CPU) on ``--baseline-n`` rows (default 1e7) of the scale problem for ``--baseline-budget``
   seconds each, against the FALKON fit of the same rows.
8. ``fused`` - one on-the-fly pass ``K^T (K u)`` as in part 2 (n = 1e6, M = 20,000, d = 24 and 128)
   through torch's blockwise path and the fused Triton kernels (:mod:`gpfalkon.backend.triton_fly`,
   forced at every d) with IEEE float32 and TF32 distances: time, the useful flops (one distance product and the
   two thin products; the kernels compute the distances twice) over time against the float32 and TF32
   matmul peaks, and the relative error of the product on the first 1e5 rows against float64.
9. ``sums`` - ``K^T (K u + v)`` over n = 1e7 rows (d = 24, the largest ``--scale-m`` centers, ``v`` of
   mixed sign, so the column sums cancel), with and without ``u``: torch's float32 pass and the fused
   Triton pass against torch's float64 pass (relative error of the whole product, one timed call each).

Every part runs in its own ``try``: a failure is recorded and the next part runs. Results go to
``<out>.json`` after each part and ``<out>.md`` at the end (``--report-only`` rebuilds the
markdown from the json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
from gpfalkon import FalkonGP, FalkonOptions
from gpfalkon.backend import KernelEngine, TensorRows, matmul_precision

from _common import REPO, environment_lines, log, markdown_table

DATA = pathlib.Path(os.environ.get("GPFALKON_DATA", REPO.parent / "shared" / "data"))


# ----------------------------------------------------------------------------- timing
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(fn: Callable[[], object], dev: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` (synchronised before and after each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def timed_once(fn: Callable[[], object], dev: torch.device) -> tuple[float, object]:
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


# ----------------------------------------------------------------------------- data
def synthetic(n: int, n_test: int, d: int, dev: torch.device, dtype=torch.float32, seed: int = 0):
    """``benchmarks/fit.py``'s synthetic problem drawn on ``dev``: x ~ N(0, I_d), y = f(x) + 0.1 eps
    with f(x) = sin(z1) + 0.5 cos(z2) z3, z = W^T x (W fixed per d)."""
    gw = torch.Generator().manual_seed(1234 + d)
    w = (torch.randn(d, 3, generator=gw, dtype=torch.float64) / math.sqrt(d)).to(dev, dtype)
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n + n_test, d, generator=g, device=dev, dtype=dtype)
    z = x @ w
    f = torch.sin(z[:, 0]) + 0.5 * torch.cos(z[:, 1]) * z[:, 2]
    y = f + 0.1 * torch.randn(n + n_test, generator=g, device=dev, dtype=dtype)
    return x[:n], y[:n], x[n:], y[n:]


def rbf(lengthscale: float, dtype: torch.dtype, dev: torch.device):
    import gpytorch

    k = gpytorch.kernels.RBFKernel().to(device=dev, dtype=dtype)
    k.lengthscale = lengthscale
    return k


def predictions(model: FalkonGP, x: torch.Tensor, chunk: int = 100_000) -> torch.Tensor:
    """The posterior mean at ``x`` (float64)."""
    import gpytorch

    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        return torch.cat([model(x[s : s + chunk]).mean.double() for s in range(0, len(x), chunk)])


def rmse(model: FalkonGP, x: torch.Tensor, y: torch.Tensor, chunk: int = 100_000) -> float:
    import gpytorch

    model.eval()
    se = 0.0
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        for s in range(0, len(x), chunk):
            se += float((model(x[s : s + chunk]).mean.double() - y[s : s + chunk].double()).square().sum())
    return math.sqrt(se / len(x))


def fit(x, y, kernel, m: int, lam: float, iters: int, dev: torch.device, seed: int = 0, **opts):
    """FalkonGP construction (uniform centers) + fit with exactly ``iters`` CG iterations; (seconds, model)."""
    options = FalkonOptions(solve_method="cg", max_iter=iters, tol=0.0, **opts)
    return timed_once(lambda: FalkonGP(x, y, kernel=kernel, num_centers=m, penalty=lam, seed=seed,
                                       options=options).fit(), dev)


def fit_row(label: str, seconds: float, model: FalkonGP, err: float, n: int, m: int, d: int, iters: int,
            peak: float | None) -> dict:
    ex = model.fit_info.extra if model.fit_info is not None else {}
    cg_s = ex.get("cg_seconds")
    flops = iters * (2.0 * n * m * (d + 2) + 4.0 * n * m)
    row = dict(label=label, n=n, M=m, d=d, iterations=iters, fit_s=seconds, rmse=err,
               precond_s=ex.get("preconditioner_seconds"), cg_s=cg_s, cg_iterations=model.fit_info.iterations
               if model.fit_info is not None else None)
    if cg_s:
        row["cg_tflops"] = flops / cg_s / 1e12
        if peak:
            row["cg_peak_fraction"] = flops / cg_s / peak
    return row


# ----------------------------------------------------------------------------- parts
def part_peaks(dev: torch.device, smoke: bool) -> dict:
    s = 512 if smoke else 8192
    out: dict = {}
    for name, dtype, tf in (("fp32_ieee", torch.float32, False), ("fp32_tf32", torch.float32, True),
                            ("fp64", torch.float64, False)):
        g = torch.Generator(device=dev).manual_seed(1)
        a = torch.randn(s, s, device=dev, dtype=dtype, generator=g)
        b = torch.randn(s, s, device=dev, dtype=dtype, generator=g)
        with gpfalkon.settings.tf32(tf), matmul_precision(dev):  # the engine's own switch
            t = median_seconds(lambda a=a, b=b: a @ b, dev, repeats=5, warmup=2)
        out[name + "_tflops"] = 2.0 * s**3 / t / 1e12
        del a, b
    nbytes = (2**22 if smoke else 2**32)
    a = torch.empty(nbytes // 4, device=dev).uniform_()
    b = torch.empty_like(a)
    t = median_seconds(lambda a=a, b=b: b.copy_(a), dev, repeats=5, warmup=2)
    out["copy_gbs"] = 2.0 * nbytes / t / 1e9  # bytes read + bytes written
    del a, b
    if dev.type == "cuda":
        h = torch.empty(2**28, pin_memory=True).uniform_()
        dst = torch.empty(h.shape, device=dev)
        t = median_seconds(lambda: dst.copy_(h, non_blocking=True), dev, repeats=5, warmup=1)
        out["h2d_pinned_gbs"] = h.numel() * 4 / t / 1e9
        hp = torch.empty(2**28).uniform_()
        t = median_seconds(lambda: dst.copy_(hp), dev, repeats=3, warmup=1)
        out["h2d_pageable_gbs"] = hp.numel() * 4 / t / 1e9
        del h, dst, hp
    return out


def part_engine(dev: torch.device, smoke: bool, peaks: dict) -> dict:
    n, m = (20_000, 500) if smoke else (1_000_000, 20_000)
    rows = []
    for d in (24, 128):
        x = torch.randn(n, d, device=dev)
        c = x[torch.randperm(n, device=dev)[:m]].clone()
        k = rbf(math.sqrt(d), torch.float32, dev)
        u = torch.randn(m, 1, device=dev)
        for tf in (False, True):
            with gpfalkon.settings.tf32(tf):
                eng = KernelEngine(k, x, c, store=False)
                t = median_seconds(lambda eng=eng, u=u: eng.kmn_k(u), dev, repeats=3, warmup=1)
            flops = 2.0 * n * m * (d + 2) + 4.0 * n * m
            rows.append(dict(kind="on the fly", d=d, n=n, M=m, tf32=tf, block_rows=eng.block_rows, seconds=t,
                             tflops=flops / t / 1e12, peak_fraction=flops / t / 1e12 / peaks["fp32_ieee_tflops"],
                             unfused_gbs=20.0 * n * m / t / 1e9,
                             copy_fraction=20.0 * n * m / t / 1e9 / peaks["copy_gbs"]))
            del eng
        del x, c
    ns, ms = (20_000, 500) if smoke else (400_000, 10_000)
    x = torch.randn(ns, 24, device=dev)
    c = x[:ms].clone()
    eng = KernelEngine(rbf(math.sqrt(24), torch.float32, dev), x, c, store=True,
                       memory_budget=ns * ms * 4 + 2**20)
    u = torch.randn(ms, 1, device=dev)
    eng.kmn_k(u)  # fills the store
    t = median_seconds(lambda eng=eng, u=u: eng.kmn_k(u), dev, repeats=5, warmup=1)
    rows.append(dict(kind="stored", d=24, n=ns, M=ms, tf32=False, block_rows=eng.stored_block_rows, seconds=t,
                     read_gbs=4.0 * ns * ms / t / 1e9, copy_fraction=4.0 * ns * ms / t / 1e9 / peaks["copy_gbs"]))
    del eng, x, c
    return dict(rows=rows)


def _fused_mode(dev: torch.device) -> str:
    """``gpfalkon.settings.triton_fly`` for part 8's fused rows: compiled on CUDA at every width (``"on"``,
    not ``"auto"``'s choice); on a CPU (``--smoke``) Triton's interpreter, where ``TRITON_INTERPRET=1`` was
    set (else the part reports why it cannot run)."""
    return "on" if dev.type == "cuda" else "interpret"


def part_fused(dev: torch.device, smoke: bool, peaks: dict) -> dict:
    """The fused Triton pass against torch's blockwise pass (``gpfalkon.settings.triton_fly``), and its
    distance precisions (``gpfalkon.settings.tf32``: IEEE float32, TF32), on the engine's ``K^T (K u)``."""
    from gpfalkon.backend.triton_fly import triton_fly_available

    fused = _fused_mode(dev)
    with gpfalkon.settings.triton_fly(fused):
        ok, why = triton_fly_available(dev)
    if not ok:
        return dict(skipped=f"the fused Triton pass does not run here: {why}")
    n, m = (2_000, 200) if smoke else (1_000_000, 20_000)  # (the interpreter is slow)
    n_err = 1_000 if smoke else 100_000
    rows = []
    for d in (24, 64, 128):
        x = torch.randn(n, d, device=dev)
        c = x[torch.randperm(n, device=dev)[:m]].clone() * 1.001
        u = torch.randn(m, 1, device=dev)
        ref = KernelEngine(rbf(math.sqrt(d), torch.float64, dev), x[:n_err].double(), c.double(),
                           store=False).kmn_k(u.double())
        for label, mode, tf in (("torch blockwise", "off", False), ("fused, IEEE float32", fused, False),
                                ("fused, TF32", fused, True)):
            with gpfalkon.settings.triton_fly(mode), gpfalkon.settings.tf32(tf):
                eng = KernelEngine(rbf(math.sqrt(d), torch.float32, dev), x, c, store=False)
                t = median_seconds(lambda eng=eng, u=u: eng.kmn_k(u), dev, repeats=3, warmup=1)
                small = KernelEngine(rbf(math.sqrt(d), torch.float32, dev), x[:n_err], c, store=False).kmn_k(u)
            useful = 2.0 * n * m * (d + 2) + 4.0 * n * m  # one distance product and the two thin ones
            rows.append(dict(d=d, n=n, M=m, path=label, seconds=t, useful_tflops=useful / t / 1e12,
                             fp32_peak_fraction=useful / t / 1e12 / peaks["fp32_ieee_tflops"],
                             tf32_peak_fraction=useful / t / 1e12 / peaks["fp32_tf32_tflops"],
                             rel_error_vs_float64=float((small - ref).norm() / ref.norm())))
            log(f"[fused] {rows[-1]}")
            del eng
        for r in rows[-3:]:
            r["speedup_vs_torch"] = rows[-3]["seconds"] / r["seconds"]
        del x, c, ref
    return dict(rows=rows)


def part_tf32(dev: torch.device, smoke: bool) -> dict:
    rows = []
    for d in (8, 24, 128):
        g = torch.Generator().manual_seed(d)
        x = torch.randn(4096, d, generator=g, dtype=torch.float64)
        c = torch.randn(2048, d, generator=g, dtype=torch.float64) * 1.05 + 0.1
        ls = math.sqrt(d) * 0.5
        ref = KernelEngine(rbf(ls, torch.float64, torch.device("cpu")), x, c, store=True).materialize()
        for tf in (False, True):
            with gpfalkon.settings.tf32(tf):
                got = KernelEngine(rbf(ls, torch.float32, dev), x.float().to(dev), c.float().to(dev),
                                   store=True).materialize().double().cpu()
            rows.append(dict(d=d, tf32=tf, max_abs=float((got - ref).abs().max()),
                             rel_fro=float((got - ref).norm() / ref.norm())))
    return dict(rows=rows)


def precision_rows(xtr, ytr, xte, yte, m: int, dev: torch.device, peaks: dict, y_scale: float = 1.0,
                   warmup: bool = False) -> list[dict]:
    """FALKON (RBF, median lengthscale, lambda 1e-6, 20 iterations) in float64, float32 and float32 with
    TF32: fit rows with the test RMSE (times ``y_scale``) and its ratio to float64's."""
    n, d = xtr.shape
    ls = float(gpfalkon.median_lengthscale(xtr))
    rows = []
    for label, dtype, tf in (("float64", torch.float64, False), ("float32", torch.float32, False),
                             ("float32 + TF32", torch.float32, True)):
        xd, yd = xtr.to(dev, dtype), ytr.to(dev, dtype)
        with gpfalkon.settings.tf32(tf):
            if warmup:  # kernels, cuBLAS / cuSOLVER handles
                fit(xd, yd, rbf(ls, dtype, dev), m, 1e-6, 2, dev)
            secs, model = fit(xd, yd, rbf(ls, dtype, dev), m, 1e-6, 20, dev)
            err = rmse(model, xte.to(dev, dtype), yte.to(dev, dtype)) * y_scale
        rows.append(fit_row(label, secs, model, err, n, m, d, 20, peaks.get("fp32_ieee_tflops", 0) * 1e12))
        del xd, yd, model
    for r in rows:
        r["rmse_vs_float64"] = r["rmse"] / rows[0]["rmse"] - 1.0
    return rows


def part_reference(dev: torch.device, smoke: bool, peaks: dict) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from fit import synthetic as fit_synthetic

    n, d, m = (20_000, 20, 300) if smoke else (200_000, 20, 2000)
    xtr, ytr, xte, yte, _ = fit_synthetic(n, 10_000, d, seed=0)
    return dict(rows=precision_rows(xtr, ytr, xte, yte, m, dev, peaks, warmup=True))


def part_flights(dev: torch.device, smoke: bool, peaks: dict) -> dict:
    path = DATA / "flights.npz"
    if not path.exists():
        return dict(skipped=f"{path} not found")
    with np.load(path) as z:
        x_all, y_all = z["X"], z["y"]
    perm = np.random.default_rng(0).permutation(x_all.shape[0])
    if smoke:
        perm = perm[:30_000]
    ntr = (2 * len(perm)) // 3
    tr, te = perm[:ntr], perm[ntr:]
    xtr, xte = x_all[tr].astype(np.float64), x_all[te].astype(np.float64)
    ytr, yte = y_all[tr].astype(np.float64).reshape(-1), y_all[te].astype(np.float64).reshape(-1)
    mu, sd = xtr.mean(0), xtr.std(0)
    sd[sd == 0] = 1.0
    ym, ys = ytr.mean(), ytr.std()
    xtr, xte = torch.from_numpy((xtr - mu) / sd), torch.from_numpy((xte - mu) / sd)
    ytr, yte = torch.from_numpy((ytr - ym) / ys), torch.from_numpy((yte - ym) / ys)
    m = 500 if smoke else 5000
    rows = precision_rows(xtr, ytr, xte, yte, m, dev, peaks, y_scale=float(ys))
    return dict(rows=rows, n_train=len(xtr), n_test=len(xte))


def part_scale(dev: torch.device, smoke: bool, peaks: dict, iters: int, sizes: list[int], host: bool,
               torch_pass: bool = True) -> dict:
    n, d = (100_000, 24) if smoke else (10_000_000, 24)
    nt = 100_000 if not smoke else 10_000
    xtr, ytr, xte, yte = synthetic(n, nt, d, dev)
    ls = float(gpfalkon.median_lengthscale(xtr[:100_000]))
    peak = peaks.get("fp32_ieee_tflops", 0) * 1e12
    rows = []
    sizes = [max(100, m // 20) for m in sizes] if smoke else sizes
    warmed: set[str] = set()
    for m in sizes:
        # the first size also through torch's blockwise pass (the fused Triton pass off), same data and centers
        for label, mode in (("x in GPU memory, fused pass", "auto"), ("x in GPU memory, torch pass", "off")):
            if (mode == "off" and (m != sizes[0] or not torch_pass)) or (mode == "auto" and dev.type != "cuda"):
                continue
            first_s = None
            with gpfalkon.settings.triton_fly(mode):
                if mode not in warmed:  # a one-iteration fit first: Triton's compilation and autotuning of
                    # every kernel key the fit launches (a process's first fit pays it; the timed one not)
                    first_s, _ = fit(xtr, ytr, rbf(ls, torch.float32, dev), m, 1e-6, 1, dev)
                    warmed.add(mode)
                    del _
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                secs, model = fit(xtr, ytr, rbf(ls, torch.float32, dev), m, 1e-6, iters, dev)
                rows.append(fit_row(label, secs, model, rmse(model, xte, yte), n, m, d, iters, peak))
                rows[-1]["warmup_fit_1_iteration_s"] = first_s
            if dev.type == "cuda":  # the fit's peak of allocated GPU memory (the data included)
                rows[-1]["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            log(f"[scale] {rows[-1]}")
            if m == sizes[0] and dev.type == "cuda":  # the two paths' fits: coefficients and test predictions
                pred = predictions(model, xte)
                if mode == "auto":
                    alpha_ref, pred_ref = model.alpha.detach().clone(), pred
                else:
                    rows[-1]["alpha_rel_diff_vs_fused"] = float((model.alpha - alpha_ref).norm() / alpha_ref.norm())
                    rows[-1]["pred_rel_diff_vs_fused"] = float((pred - pred_ref).norm() / pred_ref.norm())
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if not host:
        return dict(rows=rows, lengthscale=ls)
    m = sizes[0]
    x_host = xtr.cpu()
    from gpfalkon.backend import prefetch

    for label, overlap in (("x in host memory, prefetched", True), ("x in host memory, read when needed", False)):
        real = prefetch.overlapped
        if not overlap:
            prefetch.overlapped = lambda source: False  # the plain path: each block read and copied in turn
        try:
            src = TensorRows(x_host, device=dev)
            secs, model = fit(src, ytr, rbf(ls, torch.float32, dev), m, 1e-6, iters, dev)
        finally:
            prefetch.overlapped = real
        row = fit_row(label, secs, model, rmse(model, xte, yte), n, m, d, iters, peak)
        if dev.type == "cuda":
            row["alpha_rel_diff_vs_gpu_memory"] = float((model.alpha - alpha_ref).norm() / alpha_ref.norm())
        rows.append(row)
        log(f"[scale] {row}")
        del model
    return dict(rows=rows, lengthscale=ls)


def part_sums(dev: torch.device, smoke: bool, m: int) -> dict:
    """The column sums of ``K^T w`` over n = 1e7 rows (``w = K u + v``, mixed sign, so the sums cancel):
    the fused Triton pass and torch's float32 pass against torch's float64 pass, at ``m`` centers."""
    from gpfalkon.backend.triton_fly import triton_fly_available

    fused = _fused_mode(dev)
    with gpfalkon.settings.triton_fly(fused):
        ok, why = triton_fly_available(dev)
    if not ok:
        return dict(skipped=f"the fused Triton pass does not run here: {why}")
    n, d = (4_000, 24) if smoke else (10_000_000, 24)
    m = 200 if smoke else m
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(n, d, generator=g, device=dev)
    c = x[torch.randperm(n, device=dev, generator=g)[:m]].clone() * 1.001
    rows = []
    for case, with_u in (("u and v", True), ("v alone", False)):
        u = torch.randn(m, 1, generator=g, device=dev) / math.sqrt(m) if with_u else None
        v = torch.randn(n, 1, generator=g, device=dev)
        with gpfalkon.settings.triton_fly("off"):
            eng = KernelEngine(rbf(math.sqrt(d), torch.float64, dev), x.double(), c.double(), store=False)
            t_ref, ref = timed_once(lambda eng=eng, u=u, v=v: eng.kmn_k(None if u is None else u.double(), v.double()),
                                    dev)
            del eng
        for label, mode in (("torch blockwise, float32", "off"), ("fused, IEEE float32", fused)):
            with gpfalkon.settings.triton_fly(mode):
                eng = KernelEngine(rbf(math.sqrt(d), torch.float32, dev), x, c, store=False)
                eng.kmn_k(u, v)  # warm-up (compiles, autotunes)
                t, out = timed_once(lambda eng=eng, u=u, v=v: eng.kmn_k(u, v), dev)
                del eng
            rows.append(dict(case=case, n=n, M=m, d=d, path=label, seconds=t, float64_seconds=t_ref,
                             rel_error_vs_float64=float((out.double() - ref).norm() / ref.norm())))
            log(f"[sums] {rows[-1]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return dict(rows=rows)


def part_baselines(dev: torch.device, smoke: bool, budget: float, m_falkon: int, n_rows: int) -> dict:
    """GPyTorch SGPR / SVGP on ``n_rows`` rows of the scale problem (compare.py's runners) and FALKON."""
    import compare

    n, d = (20_000, 24) if smoke else (n_rows, 24)
    xtr, ytr, xte, yte = synthetic(n, 100_000 if not smoke else 5_000, d, dev, seed=1)
    ys = float(yte.std())
    data = dict(name="synthetic", task="regression", split="synthetic", xtr=xtr, ytr=ytr, xte=xte, yte=yte,
                y_mean=0.0, y_scale=1.0, y_test_std=ys)
    rows = []
    for runner in (compare.run_sgpr, compare.run_svgp):
        t0 = time.perf_counter()
        r = runner(data, budget)[0]
        met = compare.metrics(data, r.pop("scores"))
        rows.append(dict(method=r["method"], M=r["M"], n_used=r["n_used"], fit_s=r["fit_s"], rmse=met["rmse"],
                         best_error=r.get("best_error"), best_s=r.get("best_s"), stop=r.get("stop"),
                         wall_s=time.perf_counter() - t0))
    ls = float(gpfalkon.median_lengthscale(xtr[:100_000]))
    m = max(100, m_falkon // 20) if smoke else m_falkon
    secs, model = fit(xtr, ytr, rbf(ls, torch.float32, dev), m, 1e-6, 20, dev)
    rows.append(dict(method=f"gpfalkon FALKON (M {m}, 20 iterations, median lengthscale)", M=m, n_used=n,
                     fit_s=secs, rmse=rmse(model, xte, yte)))
    return dict(rows=rows, budget=budget, y_test_std=ys, n_train=n)


# ----------------------------------------------------------------------------- report
def report(res: dict) -> str:
    out = ["# FALKON on a GPU (`benchmarks/gpu.py`)", "", *res.get("env", []), ""]
    if "env_second_call" in res:  # results merged from two runs (the --parts of each)
        out += ["Parts 6 and 7 ran in a second invocation (on a fresh machine of the same kind), with its own "
                "ceilings (the second column below; its fractions of the peak use them):", "",
                *res["env_second_call"], ""]
    p = res.get("peaks", {})
    if "error" not in p and p:
        p2 = res.get("peaks_second_call", {})
        heads = ["what", "rate"] + (["second run"] if p2 else [])
        table = [[k, v, *([p2.get(k)] if p2 else [])] for k, v in p.items() if k != "seconds"]
        out += ["## 1. Ceilings measured in this run (TFLOP/s, GB/s)", "",
                markdown_table(heads, table, align="l" + "r" * (len(heads) - 1)), ""]
    titles = {"engine": "2. Engine passes (float32, RBF)",
              "tf32": "3. Kernel-block error, float32 and TF32 vs float64",
              "reference": "4. Reference problem (n 200k, d 20, M 2000, 20 iterations)",
              "flights": "5. flights (M 5000, 20 iterations)",
              "scale": "6. n = 1e7, d = 24",
              "baselines": "7. GPyTorch SGPR / SVGP on the same GPU (rows of the scale problem)",
              "fused": "8. The fused Triton pass against torch's blockwise pass (float32, RBF, K^T (K u))",
              "sums": "9. Column sums over n = 1e7 rows: K^T (K u + v) in float32 against float64"}
    for key, title in titles.items():
        part = res.get(key)
        if part is None:
            continue
        out += [f"## {title}", ""]
        if "error" in part:
            out += ["failed: `" + part["error"].strip().splitlines()[-1] + "`", ""]
            continue
        if "skipped" in part:
            out += [part["skipped"], ""]
            continue
        rows = part["rows"]
        keys = list(dict.fromkeys(k for r in rows for k in r))
        out += [markdown_table(keys, [[r.get(k) for k in keys] for r in rows], align="l" * 1 + "r" * (len(keys) - 1)),
                ""]
        extra = {k: v for k, v in part.items() if k not in ("rows", "seconds")}
        if extra:
            out += ["; ".join(f"{k} {v}" for k, v in extra.items()), ""]
        if "seconds" in part:
            out += [f"(part took {part['seconds']:.0f} s)", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="path stem: writes <out>.json and <out>.md")
    ap.add_argument("--smoke", action="store_true", help="toy sizes (checks that every part runs)")
    ap.add_argument("--parts", nargs="+", default=["peaks", "engine", "fused", "tf32", "reference", "flights",
                                                   "scale", "sums", "baselines"])
    ap.add_argument("--iters", type=int, default=20, help="CG iterations of the n = 1e7 fits")
    ap.add_argument("--scale-m", type=int, nargs="+", default=[10_000, 50_000])
    ap.add_argument("--no-scale-host", action="store_true", help="skip part 6's fits from host memory")
    ap.add_argument("--no-scale-torch", action="store_true",
                    help="skip part 6's fit through torch's blockwise pass (the fused Triton pass only)")
    ap.add_argument("--baseline-budget", type=float, default=30.0)
    ap.add_argument("--baseline-n", type=int, default=10_000_000, help="training rows of part 7")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    js, md = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        md.write_text(report(json.loads(js.read_text())))
        return
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    res: dict = dict(env=environment_lines())
    peaks: dict = {}
    for part in args.parts:
        t0 = time.perf_counter()
        log(f"[{part}] start")
        try:
            if part == "peaks":
                peaks = part_peaks(dev, args.smoke)
                res[part] = dict(peaks)
            elif part == "engine":
                res[part] = part_engine(dev, args.smoke, peaks or part_peaks(dev, True))
            elif part == "fused":
                res[part] = part_fused(dev, args.smoke, peaks or part_peaks(dev, True))
            elif part == "tf32":
                res[part] = part_tf32(dev, args.smoke)
            elif part == "reference":
                res[part] = part_reference(dev, args.smoke, peaks)
            elif part == "flights":
                res[part] = part_flights(dev, args.smoke, peaks)
            elif part == "scale":
                res[part] = part_scale(dev, args.smoke, peaks, args.iters, args.scale_m, not args.no_scale_host,
                                       not args.no_scale_torch)
            elif part == "sums":
                res[part] = part_sums(dev, args.smoke, max(args.scale_m))
            elif part == "baselines":
                res[part] = part_baselines(dev, args.smoke, args.baseline_budget, args.scale_m[0], args.baseline_n)
            else:
                ap.error(f"--parts: unknown part {part!r}")
        except Exception:  # recorded; the next part runs
            res[part] = dict(error=traceback.format_exc())
            log(res[part]["error"])
        if isinstance(res.get(part), dict):
            res[part]["seconds"] = time.perf_counter() - t0
        log(f"[{part}] {time.perf_counter() - t0:.1f} s: {json.dumps(res.get(part), default=str)[:2000]}")
        js.write_text(json.dumps(res, indent=1, default=str))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    md.write_text(report(res))
    log(f"written {md}")


if __name__ == "__main__":
    main()
