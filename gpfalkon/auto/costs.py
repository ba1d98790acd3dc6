"""The measured cost model that decides what fits :func:`~gpfalkon.auto_fit`'s budget.

Selection fits are timed; a fit at ``c`` times the centers on ``rho`` times the rows is predicted from them
(``_scaled_fit_seconds``: the ``O(n M)`` part scales as ``c rho``, the preconditioner's triangular solves as ``c^2``,
its factorisations as ``_factor_scale``, whose growth ``t(2m) / t(m)`` in ``[4, 8]`` is measured by
``_factor_growth`` on the device up to ``FACTOR_PROBE_MAX``); where
``K_nM`` does not fit in memory one on-the-fly pass ``K_Mn (K_nM u)`` is timed (``_onthefly_pass_seconds``).
``_growth_cap`` / ``_growth_size`` size a grown final fit to the time left, ``_rows_within`` the rows a cost
allows. Cost: O(1) per prediction; the probes O(m^3) and O(n M d).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..backend import KernelEngine

#: ``growth_noises``: the factor below the level's noise of the smallest noise a grown fit tries; its square is the
#: ratio of the validation error to the level's noise above which it also tries a larger noise (:func:`_growth_noises`)
GROWTH_NOISE_STEP = 4.0

#: :func:`_factor_growth` measures the factorisations' growth from ``m`` to ``2 m`` up to this ``m`` (a Cholesky of
#: ``2 m = 2,048`` takes about 0.05 s on 2 CPU cores); past it they grow as their flop count
FACTOR_PROBE_MAX = 1024

#: ``final_growth``: a grown final fit's size is the largest whose predicted time, times this margin, fits the time
#: left (:func:`_growth_size`). The prediction scales the selection fits (``score_max_iter`` CG iterations) and the
#: final CG runs on to ``max_iter`` or the time left, so a margin above 1 buys CG iterations instead of centers; at
#: a fixed time more centers tested better than more iterations (docs/math.md §8 "Final growth")
GROWTH_MARGIN = 1.0

#: the ratio between the sizes a grown final fit tries (:func:`_growth_size`, the first size's reserve); the resolution
#: of ``growth_first``'s comparison where a grown fit is held at its cap
GROWTH_STEP = 1.15


def _wait(device: torch.device) -> None:
    """Waits for the kernels queued on ``device`` (CUDA; nothing elsewhere), so that a clock read after it covers
    them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _onthefly_pass_seconds(kernel: Kernel, x: Tensor, centers: Tensor) -> float:
    """Wall seconds of one ``K_Mn (K_nM u)`` pass over ``x`` with ``K_nM`` recomputed block by block
    (the cost of one CG iteration of a fit whose ``K_nM`` exceeds the memory budget); on CUDA the
    queued kernels are waited for, so the timing covers them, and the timed pass follows an untimed one: the
    first on-the-fly pass of a process compiles the fused Triton kernels (seconds, against milliseconds a pass), a
    cost no CG iteration pays; timed with it, a final fit past the memory budget was predicted 1,000 times too
    long (``benchmarks/results/gpu-notes.md``, session 52). On the CPU one pass, timed (nothing compiles there:
    the learning stage's fits have loaded the fused kernel before any probe but the first, which sees its load)."""
    eng = KernelEngine(kernel, x, centers, store=False)
    u = torch.ones(centers.shape[0], 1, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        if x.device.type == "cuda":
            eng.kmn_k(u)  # untimed: compilation
            _wait(x.device)
        t = time.perf_counter()
        eng.kmn_k(u)
        _wait(x.device)
        seconds = time.perf_counter() - t
    eng.release()
    return seconds


def _factor_scale(factor: float, growth: float = 8.0) -> float:
    """How much longer the preconditioner's factorisations take at ``factor`` times the centers:
    ``factor^log2(growth)``, ``growth`` their measured ``t(2 m) / t(m)`` (:func:`_factor_growth`; at the default 8,
    the flop count's ``factor^3``)."""
    return float(factor) ** math.log2(growth)


def _factor_growth(m: int, device: torch.device, repeats: int = 2) -> float:
    """``t(2 m) / t(m)`` of a float64 Cholesky factorisation on ``device``, within ``[4, 8]``: the fastest of
    ``repeats`` timings at each size (alternating, after one untimed factorisation of each), on diagonally dominant
    matrices; 8 (the flop count's ratio) where ``m`` exceeds :data:`FACTOR_PROBE_MAX` (there the rate no longer grows
    much with ``m``, and the probe would cost a large factorisation) or is below 64.

    A Cholesky factorisation of ``M x M`` is ``M^3 / 3`` flops, but on a CPU its rate still grows with ``M`` up to a
    few thousand, so ``M^3`` scaling overstates the factorisations of a grown fit: on 2 EPYC cores a preconditioner
    build took 0.028, 0.150, 0.49 and 1.07 s at ``M`` = 1,000 / 2,000 / 3,000 / 4,000 (about ``M^2.6``), and the
    Cholesky factorisations alone grew 6.4x from 1,000 to 2,000 (``M^2.7``; ``benchmarks/results/auto-notes.md``,
    sessions 46-47). Cost ``1 + repeats`` factorisations at each size (about 0.2 s at ``m = 1,000`` on 2 CPU
    cores)."""
    if m > FACTOR_PROBE_MAX or m < 64:
        return 8.0
    mats = []
    for size in (m, 2 * m):
        a = torch.rand(size, size, dtype=torch.float64, device=device)
        a = a + a.mT
        a.diagonal().add_(2.0 * size)
        torch.linalg.cholesky(a)  # untimed: workspace and threads warmed at this size
        mats.append(a)
    best = [math.inf, math.inf]
    for _ in range(repeats):
        for i, a in enumerate(mats):
            _wait(device)
            t = time.perf_counter()
            torch.linalg.cholesky(a)
            _wait(device)
            best[i] = min(best[i], time.perf_counter() - t)
    del mats
    if not 0 < best[0] < math.inf:
        return 8.0
    return min(max(best[1] / best[0], 4.0), 8.0)


def _scaled_fit_seconds(records: Sequence[dict[str, Any]], factor: float, rows_ratio: float = 1.0,
                        columns: int = 1, factor_growth: float = 8.0) -> float:
    """The seconds of a selection fit at ``factor`` times the centers, on ``rows_ratio`` times the rows,
    predicted from ``records`` (the single fits measured at one size: ``report.search`` entries without ``path``,
    a penalty path's seconds being several noises'); ``columns``: as a penalty
    path of that many penalties (:meth:`FalkonGP.fit_penalty_path <gpfalkon.FalkonGP.fit_penalty_path>`).

    A FALKON fit with ``M`` centers on ``n`` rows spends its time in three parts that grow at different
    rates: the preconditioner's factorisations, ``O(M^3)``; the triangular solves that apply it in every
    CG iteration, ``O(M^2)`` each and independent of ``n``; the rest (``K_nM``, the data passes, the
    validation predictions), ``O(n M)``. Each is scaled by its own power: the factorisations by
    :func:`_factor_scale` (``factor^log2(factor_growth)``, ``factor_growth`` their measured ``t(2 M) / t(M)``;
    ``factor^3`` at the default 8), the solves by ``factor^2``, the rest by ``factor rows_ratio``. The parts are
    those of the slowest record (the rest is its seconds less its own factorisations and solves), except the
    factorisations: the median of the fresh builds (the records whose factorisations took at least half the
    largest; fits that reused a cached penalty-free factor, the noise searches, paid about a third), whose single
    largest is often a slow outlier of a shared machine. A record of
    the direct solve (``O(n M^2 + M^3)``, chosen over CG only at small ``M``) is scaled whole by
    ``factor^2 rows_ratio``. One growth exponent for the whole fit (measured over the last growth step,
    the earlier rule) is too high at small ``M``, where the data passes dominate, and too low at large
    ``M``, where the factorisations do (``benchmarks/results/auto-cost-model.md``). No records: 0. A path of
    ``columns`` penalties factors ``K_MM`` once and ``T T^T / M + lambda I`` per penalty (the factorisations counted
    ``(1 + columns) / 2`` times) and applies a preconditioner per column (the solves ``columns`` times); its data
    passes read ``K_nM`` once for all columns (the rest as for one). The records' CG iterations are not scaled:
    a final fit (``max_iter``) is sized as if it ran the selection fits' ``score_max_iter``, and its CG stops at the
    budget where it runs longer (at a fixed time, more centers with fewer iterations tested better:
    ``benchmarks/results/auto-notes.md``, session 47).
    """
    if not records:
        return 0.0
    slow = max(records, key=lambda r: r["seconds"])
    if slow.get("direct"):
        return slow["seconds"] * factor**2 * rows_ratio
    pres = [float(r.get("precond_seconds", 0.0)) for r in records]
    fresh = sorted(v for v in pres if v >= 0.5 * max(pres))  # never empty: the largest is in it
    pre = fresh[len(fresh) // 2]
    apply = float(slow.get("apply_seconds", 0.0))
    rest = max(slow["seconds"] - float(slow.get("precond_seconds", 0.0)) - apply, 0.0)
    return (pre * _factor_scale(factor, factor_growth) * (1 + columns) / 2 + apply * factor**2 * columns
            + rest * factor * rows_ratio)


def _growth_noises(noise: float, error: float) -> list[float]:
    """``growth_noises``' candidates (standardised units) for a level at ``noise`` with validation error ``error``:
    ``noise / GROWTH_NOISE_STEP`` and ``noise``, and where ``error > GROWTH_NOISE_STEP^2 noise`` their geometric
    mean ``sqrt(noise error)``; within ``[1e-8, 1e2]`` (stage 2's search range), ascending, without repeats. Each
    candidate costs the path a triangular solve an iteration and half a factorisation, paid for in centers
    (:func:`_scaled_fit_seconds`); the error itself, a candidate until session 46, was never chosen
    (``benchmarks/results/auto-notes.md``)."""
    out = [noise / GROWTH_NOISE_STEP, noise]
    if math.isfinite(error) and error > GROWTH_NOISE_STEP**2 * noise:
        out.append(math.sqrt(noise * error))
    return sorted({min(max(v, 1e-8), 1e2) for v in out})


def _growth_cap(m: int, factor: float, n_final: int, limit: int) -> int:
    """The most centers ``final_growth`` gives a level of ``m``: ``factor m`` (at least ``ceil(1.25 m)``), past ``2 m``
    only up to ``n_final // 2`` (never below ``2 m`` for that bound), and at most ``limit`` (the pool, ``max_centers``,
    the final rows). Toward ``M = n`` the grown fit nears the full kernel estimator at a noise chosen for ``m``
    centers, whose projection also regularised (docs/math.md §8 "Final growth")."""
    top = max(int(factor * m), math.ceil(1.25 * m))
    if top > 2 * m:
        top = max(2 * m, min(top, n_final // 2))
    return min(top, limit)


def _rows_within(cost: Callable[[int], float], lo: int, hi: int, seconds: float) -> int:
    """The most rows ``r`` in ``[lo, hi]`` with ``cost(r) <= seconds`` for a ``cost`` that does not fall as the rows
    grow (a bisection, to 0.1 % of the rows); ``lo`` when even it costs more, ``hi`` when it fits."""
    if cost(hi) <= seconds or hi <= lo:
        return hi
    if cost(lo) > seconds:
        return lo
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds else (lo, mid)
    return lo


def _growth_size(cost: Callable[[int], float], m: int, cap: int, seconds: Callable[[], float],
                 refinable: Callable[[int], bool]) -> int:
    """The centers a final fit grown from a level of ``m`` takes: the first of ``cap``, ``int(cap / 1.15)``, ... (down
    to ``1.25 m``) with ``GROWTH_MARGIN * cost(size) <= seconds()`` (read after each ``cost``, which may take time),
    then, below ``cap``, ``int(1.10 size)`` or else ``int(1.05 size)`` where ``refinable`` and within the same test
    (the steps of 1.15 alone leave up to 15 % of the centers, 7 % on average, that the time pays for). Below
    ``1.25 m`` where no size of at least that fits; ``cost`` may be ``inf`` (a size passed over). At most
    ``log(cap / m) / log(1.15) + 2`` predictions."""
    size = cap
    while size >= 1.25 * m:
        if GROWTH_MARGIN * cost(size) <= seconds():
            break
        size = int(size / GROWTH_STEP)
    if 1.25 * m <= size < cap:
        top = min(int(size * GROWTH_STEP), cap)
        for finer in (int(size * 1.10), int(size * 1.05)):
            if size < finer < top and refinable(finer) and GROWTH_MARGIN * cost(finer) <= seconds():
                return finer
    return size
