"""Exact leave-one-out choice among :func:`~gpfalkon.auto_fit`'s learned candidates on a row subsample.

On ``n <= loo_rows`` rows, kernel ridge regression with every row a center has the closed-form leave-one-out
residuals ``r_i = [(K + v I)^{-1} y]_i / [(K + v I)^{-1}]_ii`` (one Cholesky, ``O(n^3)``); ``_loo_choice`` scores
the candidates by ``mean(r_i^2)``, steps the best one's noise by factors of 2, then refines every lengthscale
and the noise within a box by SciPy's L-BFGS-B on that criterion (``_loo_descent``, its gradient through the kernel
matrix). Written here because GPyTorch's
``LeaveOneOutPseudoLikelihood`` scores the predictive density of an exact GP, not the KRR residuals.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from .costs import _wait
from .kernels import _scale_lengthscales

#: the leave-one-out stage (``loo_rows``) scores points for at most this fraction of the budget (its first score
#: aside): at 3,000-3,700 rows a score takes 1-2 s here, and the points after the first few changed the test error of
#: those sets by under 1 % while doubling the run's time (``benchmarks/results/loo-choice-ab-s56.md``)
LOO_SHARE = 0.25
#: the leave-one-out stage's refit with every row a center runs its data passes in this dtype whatever ``dtype`` is:
#: at ``M = n`` and the small noises of near-noiseless sets FALKON's system ``K^2 + v K`` squares ``K``'s condition, and
#: float32 kernel values left a refit 1 % above the exact solve's error (yacht: 0.1395 against 0.1384,
#: ``benchmarks/results/loo-descent-s58.md``); at ``n <= loo_rows`` the passes are cheap in float64
LOO_REFIT_DTYPE: torch.dtype | None = torch.float64
#: the least noise (standardised units) :func:`_loo_descent` moves to: the exact system ``K + v I`` stays
#: factorisable in float64 at every kernel scale
LOO_NOISE_FLOOR = 1e-6
#: the factors :func:`_loo_descent` may move each lengthscale and the noise by, either way, from its start
LOO_DESCENT_BOX = (4.0, 16.0)
#: the leave-one-out descent starts only where its share of the stage (half of it) pays for this many evaluations
#: (each about three scores' time)
LOO_DESCENT_EVALS = 8
#: the descent's point is kept only where its predictions at :data:`LOO_PROBES` midpoints of random pairs of rows
#: leave the targets' range by at most this much more (standardised units) than the start's
#: (:func:`_midpoint_overshoot`): within its box the descent still found, on one small set, a point 2 standard
#: deviations outside the range there whose test error was twice the start's, from one test row a little outside the
#: training rows (``benchmarks/results/auto-notes.md``, "Session 58")
LOO_OVERSHOOT_MARGIN = 0.5
LOO_PROBES = 2_000
#: what the descent minimises (:func:`_loo_value_and_gram_grad`)
LOO_DESCENT_CRITERION = "mse"


def _loo_score(kernel: Kernel, multiplier: float, noise: float, x: Tensor, y: Tensor) -> tuple[float, Tensor, Tensor]:
    """``(mean squared leave-one-out residual, residuals r, S_ii)`` of kernel ridge regression with every row of
    ``x`` a center, at ``kernel`` (its lengthscales times ``multiplier``) and noise ``v`` (``x``, ``y`` float64,
    standardised): with ``A = K + v I``, ``r = A^{-1} y / diag(A^{-1})`` and ``S_ii = 1 - v [A^{-1}]_ii``.
    :meth:`LOOCV.residuals <gpfalkon.objectives.LOOCV.residuals>` at ``M = n`` gives the same through the Nystrom
    route's blockwise passes, several times slower where ``M = n``; this is one dense Cholesky factorisation
    and its inverse (``n^3`` flops, three ``n x n`` float64 matrices)."""
    return _loo_from_gram(_loo_gram(kernel, multiplier, x), noise, y)


def _loo_score_seconds(n: int, device: torch.device, probe: int = 1024) -> float:
    """Predicted seconds of one :func:`_loo_score` at ``n`` rows on ``device``: its two ``O(n^3)`` parts, a float64
    Cholesky factorisation and the inverse from it (``n^3 / 3 + 2 n^3 / 3`` flops), timed at order
    ``s = min(n, probe)`` (the faster of two) and scaled by ``(n / s)^3``. The kernel matrix (``n^2 d``) is left
    out. Cost: two factorisations and inverses of order ``s`` (about 0.1 s at 1,024 here)."""
    s = max(1, min(int(n), probe))
    a = torch.full((s, s), 0.5, dtype=torch.float64, device=device)
    a.diagonal().add_(float(s))
    best = math.inf
    for _ in range(2):
        _wait(device)
        t = time.perf_counter()
        chol, _ = torch.linalg.cholesky_ex(a)
        torch.cholesky_inverse(chol)
        _wait(device)
        best = min(best, time.perf_counter() - t)
    return best * (n / s) ** 3


def _krr_coefficients(kernel: Kernel, multiplier: float, noise: float, x: Tensor, y: Tensor) -> Tensor:
    """``alpha = (K + v I)^{-1} y`` of exact kernel ridge regression with every row of ``x`` a center, at ``kernel``
    (its lengthscales times ``multiplier``) and noise ``v`` (``x``, ``y`` float64): FALKON's solution at ``M = n``
    (``K (K + v I) alpha = K y``), from one dense Cholesky factorisation (``n^3 / 3`` flops). The leave-one-out
    stage's refit starts its CG there: at the noises its descent reaches, FALKON's system ``K^2 + v K`` has the
    square of ``K + v I``'s condition number, past what CG resolves in float64."""
    chol = _shifted_factor(_loo_gram(kernel, multiplier, x), noise)
    with torch.no_grad():
        return torch.cholesky_solve(y.reshape(-1, 1).to(chol.dtype), chol).reshape(-1)


def _midpoint_overshoot(kernel: Kernel, multiplier: float, noise: float, x: Tensor, y: Tensor,
                        pairs: Tensor) -> float:
    """How far exact kernel ridge regression (every row of ``x`` a center, ``kernel`` with its lengthscales times
    ``multiplier``, noise ``v``; ``x``, ``y`` float64) predicts outside the range of ``y`` at the midpoints
    ``(x_i + x_j) / 2`` of the row pairs ``pairs`` (``(p, 2)`` indices): ``max(0, max f - max y, min y - min f)``
    in ``y``'s units. The leave-one-out rows are training rows; midpoints of two are points a little away from the
    rows that the leave-one-out error never sees. Cost: :func:`_krr_coefficients` and a ``p x n`` kernel block."""
    alpha = _krr_coefficients(kernel, multiplier, noise, x, y)
    k = copy.deepcopy(kernel).to(dtype=x.dtype, device=x.device)
    _scale_lengthscales(k, multiplier)
    with torch.no_grad():
        f = k(0.5 * (x[pairs[:, 0]] + x[pairs[:, 1]]), x).to_dense() @ alpha
    y = y.reshape(-1)
    return max(0.0, float(f.max() - y.max()), float(y.min() - f.min()))


def _loo_gram(kernel: Kernel, multiplier: float, x: Tensor) -> Tensor:
    """``K`` (dense, ``x``'s dtype) of a copy of ``kernel`` with its lengthscales times ``multiplier``."""
    k = copy.deepcopy(kernel).to(dtype=x.dtype, device=x.device)
    _scale_lengthscales(k, multiplier)
    with torch.no_grad():
        return k(x).to_dense()


def _shifted_factor(gram: Tensor, noise: float) -> Tensor:
    """The Cholesky factor of ``K + v I`` (``gram`` not changed); ``RuntimeError`` where it is not positive
    definite (a singular system the leave-one-out stage skips)."""
    with torch.no_grad():
        a = gram.clone()
        a.diagonal().add_(noise)
        chol, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0:
        raise RuntimeError(f"K + {noise:.3g} I is not positive definite (order {int(info)})")
    return chol


def _loo_from_gram(gram: Tensor, noise: float, y: Tensor) -> tuple[float, Tensor, Tensor]:
    """:func:`_loo_score` from the kernel matrix ``gram`` (not changed)."""
    with torch.no_grad():
        inv = torch.cholesky_inverse(_shifted_factor(gram, noise))
        diag = inv.diagonal().clone()
        r = (inv @ y.reshape(-1)) / diag
    return float(r.square().mean()), r, 1 - noise * diag


def _loo_value_and_gram_grad(gram: Tensor, noise: float, y: Tensor,
                             criterion: str = "mse") -> tuple[float, Tensor, Tensor, Tensor]:
    """``(E, G, r, S_ii)``: a leave-one-out criterion ``E`` of exact kernel ridge regression at ``A = K + v I`` and its
    gradient ``G = dE / dA`` (symmetric; ``dE / dv = tr G``), with the residuals ``r`` and ``S_ii`` of
    :func:`_loo_from_gram`. With ``C = A^{-1}``, ``alpha = C y``, ``c = diag C`` and ``r = alpha / c``:

    * ``"mse"``: ``E = mean(r^2)``, the squared error ``auto_fit``'s choices minimise;
    * ``"pseudo-likelihood"``: ``E = log q - mean(log c)``, ``q = mean(r^2 c)``: the mean leave-one-out negative log
      predictive density of the GP ``(s K, s v)`` at its best scale ``s = q`` (the variance calibration's ``c``),
      less constants: Sundararajan and Keerthi's criterion with the scale profiled out.

    Both are ``E(alpha, c)``; with ``a = dE/d alpha`` and ``b = -dE/dc`` (``a = 2 r / (n c)``, ``b = a r`` for
    ``"mse"``; ``a = 2 r / (n q)``, ``b = a r / 2 + 1 / (n c)`` for the other) and ``dC = -C dA C``,
    ``dE = a^T d alpha - b^T dc = tr((-C a alpha^T + C diag(b) C) dA)``, so ``G = sym(-C a alpha^T + C diag(b) C)``
    (docs/math.md §8 "Leave-one-out descent"). Cost: one Cholesky factorisation, its inverse and one ``n x n``
    product (about ``3 n^3`` flops); autograd through the factorisation and the inverse took several times as long
    here. Hand-written for that reason: GPyTorch's ``LeaveOneOutPseudoLikelihood`` is the second criterion through
    an ``ExactGP`` and autograd, and has no squared-error form."""
    if criterion not in ("mse", "pseudo-likelihood"):
        raise ValueError(f"criterion: {criterion!r} is not 'mse' or 'pseudo-likelihood'")
    with torch.no_grad():
        inv = torch.cholesky_inverse(_shifted_factor(gram, noise))
        y = y.reshape(-1)
        n = y.numel()
        c = inv.diagonal().clone()
        alpha = inv @ y
        r = alpha / c
        if criterion == "mse":
            value = float(r.square().mean())
            a = 2 * r / (n * c)
            b = a * r
        else:
            q = float((r.square() * c).mean())
            value = math.log(q) - float(c.log().mean())
            a = 2 * r / (n * q)
            b = 0.5 * a * r + 1 / (n * c)
        grad = inv @ (b.unsqueeze(-1) * inv)
        grad -= torch.outer(inv @ a, alpha)
        grad = 0.5 * (grad + grad.transpose(-1, -2))
    return value, grad, r, 1 - noise * c


def _loo_descent(kernel: Kernel, multiplier: float, noise: float, x: Tensor, y: Tensor,
                 left: Callable[[], float], eval_seconds: float, max_iterations: int = 50,
                 criterion: str = "mse") -> tuple[Kernel, float, float, Tensor, Tensor, dict[str, Any]]:
    """Minimise a leave-one-out criterion (``criterion``, :func:`_loo_value_and_gram_grad`) of exact kernel ridge
    regression (every row of ``x`` a center; ``x``, ``y`` float64, standardised) over the lengthscale of every input
    dimension and the noise, by SciPy's L-BFGS-B, from ``kernel`` (its lengthscales times ``multiplier``) at noise
    ``v0 = noise``, within a box around that start: ``l_j = l0_j e^{u_j}`` and ``v = LOO_NOISE_FLOOR + v0' e^w``
    (``v0' = v0 - LOO_NOISE_FLOOR``) with ``|u_j| <= log B_l``, ``|w| <= log B_v``, ``(B_l, B_v)`` =
    :data:`LOO_DESCENT_BOX`. The outputscale, which the mean sees only through the noise's ratio to it, stays.
    ``kernel`` is a function of ``x / l`` (a :data:`KERNEL_FAMILIES` kernel: ARD lengthscales, one per column of
    ``x``): the lengthscales move by scaling ``x``. Each evaluation is :func:`_loo_value_and_gram_grad` and one kernel
    backward pass (``G`` contracted with ``K``). Evaluations go on while ``left()`` exceeds one of ``eval_seconds``
    (the longest measured so far), for at most ``max_iterations`` iterations, and until an iteration changes the
    criterion by less than ``1e-6`` of its start. Returns ``(kernel at the lowest criterion, multiplier folded in;
    noise; mean squared leave-one-out residual there; residuals r; S_ii; record)``, the start where nothing lowered
    it; the record's ``before`` and ``after`` are the criterion's values.

    Why the box: unbounded, the squared error's minimum on several small sets lay at noises a thousand times below the
    start with lengthscales tens of times longer, a near-interpolating fit whose leave-one-out error was lower and
    whose test error was twice the start's, at rows a little outside the training rows (the leave-one-out rows are
    inside them; ``benchmarks/results/auto-notes.md``, "Session 58"). SciPy's optimiser and not ``torch.optim``'s:
    the latter imports ``torch._dynamo`` on first use (about 1 s in a fresh process, out of a timed budget; see
    :mod:`gpfalkon._optim`), SciPy (a dependency of BoTorch) is imported here only when a descent runs."""
    import numpy as np
    from scipy.optimize import minimize

    kern = copy.deepcopy(kernel).to(dtype=x.dtype, device=x.device)
    _scale_lengthscales(kern, multiplier)
    grads = [p.requires_grad for p in kern.parameters()]
    for p in kern.parameters():
        p.requires_grad_(False)
    b_l, b_v = (math.log(b) for b in LOO_DESCENT_BOX)
    d = x.shape[-1]
    floor = LOO_NOISE_FLOOR
    v0 = max(noise - floor, floor)
    best: dict[str, Any] = dict(error=math.inf)
    evals, per = 0, eval_seconds

    class _OutOfTime(Exception):
        """Raised by ``fun`` when ``left()`` no longer pays for an evaluation: SciPy's loop has no clock."""

    def fun(z: Any) -> tuple[float, Any]:
        """The criterion and its gradient at ``z = (u, w)``."""
        nonlocal evals, per
        if evals > 0 and left() < per:
            raise _OutOfTime
        t = time.perf_counter()
        u = torch.tensor(z[:d], dtype=x.dtype, device=x.device, requires_grad=True)
        v_var = v0 * math.exp(float(z[d]))
        v = floor + v_var
        gram = kern(x * torch.exp(-u)).to_dense()
        try:
            err, grad, r, s = _loo_value_and_gram_grad(gram.detach(), v, y, criterion)
        except RuntimeError:  # not factorisable there: a value the line search backs off from
            evals += 1
            return 1e300, np.zeros(d + 1)
        (grad * gram).sum().backward()
        assert u.grad is not None
        out = np.empty(d + 1)
        out[:d] = u.grad.detach().cpu().numpy()
        out[d] = float(grad.diagonal().sum()) * v_var
        evals += 1
        per = max(per, time.perf_counter() - t)
        if err < best["error"]:
            best.update(error=err, u=u.detach().clone(), noise=v, r=r, s=s)
        return err, out

    z0 = np.zeros(d + 1)
    first = fun(z0)[0]
    iterations, stop = 0, "start not factorisable"
    if first < 1e300:
        bounds = [(-b_l, b_l)] * d + [(-b_v, b_v)]
        try:
            res = minimize(fun, z0, jac=True, method="L-BFGS-B", bounds=bounds,
                           options=dict(maxiter=max_iterations, maxfun=3 * max_iterations,
                                        ftol=1e-6 * min(abs(first), 1.0), gtol=1e-12))
            iterations, stop = int(res.nit), "converged" if res.success else str(res.message)
        except _OutOfTime:
            stop = "time"
    for p, flag in zip(kern.parameters(), grads, strict=True):
        p.requires_grad_(flag)
    record = dict(criterion=criterion, evaluations=evals, iterations=iterations, stop=stop, before=first,
                  after=best["error"],
                  noise_factor=best.get("noise", noise) / noise)
    if not math.isfinite(best["error"]):
        return kern, noise, math.inf, torch.empty(0), torch.empty(0), record
    _scale_lengthscales(kern, torch.exp(best["u"]))
    return kern, best["noise"], float(best["r"].square().mean()), best["r"], best["s"], record


@dataclass
class _LooChoice:
    """What :func:`_loo_choice` found: the ``winner`` candidate (``None`` where no score was finite), its ``noise``
    after the refinement and leave-one-out ``error``, the variance scale of its residuals, the longest score's
    seconds, and the ``record`` for ``report.loo``."""

    chosen: dict[str, Any]
    winner: dict[str, Any] | None
    noise: float
    error: float
    variance_scale: float
    score_seconds: float
    record: dict[str, Any]


def _loo_choice(chosen: dict[str, Any], points: Sequence[dict[str, Any]], x: Tensor, y: Tensor,
                left: Callable[[], float], max_noise_steps: int = 4, descent: bool = True) -> _LooChoice:
    """``auto_fit``'s ``loo_rows`` stage: score ``chosen`` (the validation rows' choice), then ``points`` in the
    order of their validation errors, by :func:`_loo_score` on every row of ``x`` (float64), while ``left()`` (the
    stage's seconds left) leaves two scores' time (one more and the refit); then double or halve the best one's
    noise while that lowers the error (at most ``max_noise_steps`` scores); then, with ``descent``, descend from
    there (:func:`_loo_descent`). Where half of the stage's time at its start pays for :data:`LOO_DESCENT_EVALS`
    evaluations (three scores each, by the first score's time), the scoring and the noise steps stop at that half
    and the descent takes the rest but a refit's time; otherwise there is no descent. Its point replaces the start
    where it lowers the criterion and does not overshoot the targets' range between rows
    (:data:`LOO_OVERSHOOT_MARGIN`). The variance scale
    ``c = mean(r_i^2 (1 - S_ii) / v)`` is the closed-form maximiser of the leave-one-out likelihood over a factor on
    the GP's covariance (its leave-one-out predictive variance of ``y_i`` is ``v / (1 - S_ii)``)."""
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    t0 = time.perf_counter()
    per = 0.0
    scored: list[tuple[float, dict[str, Any], float, Tensor, Tensor]] = []
    failed: list[str] = []
    order = [chosen, *sorted(points, key=lambda p: p["error"] if math.isfinite(p["error"]) else math.inf)]
    left0 = left()
    reserve = 0.0  # the descent's time, decided after the first score

    def score(c: dict[str, Any], noise: float, gram: Tensor | None = None) -> tuple[float, Tensor, Tensor] | None:
        nonlocal per
        t = time.perf_counter()
        try:
            out = (_loo_score(c["kernel"], c["multiplier"], noise, x, y) if gram is None
                   else _loo_from_gram(gram, noise, y))
        except (RuntimeError, ValueError) as exc:  # a singular system, a non-finite kernel
            failed.append(f"{c['racer']} step {c['step']}: {type(exc).__name__}: {exc}")
            return None
        finally:
            per = max(per, time.perf_counter() - t)
        return out if math.isfinite(out[0]) else None

    for i, c in enumerate(order):
        if i > 0 and left() < 2 * per + reserve:
            break
        got = score(c, c["noise"])
        if got is not None:
            scored.append((got[0], c, c["noise"], got[1], got[2]))
        if i == 0 and descent and c.get("family") is not None and 0.5 * left0 >= LOO_DESCENT_EVALS * 3 * per:
            reserve = 0.5 * left0
    record: dict[str, Any] = dict(points=len(order), failed=failed,
                                  scored=[(c["racer"], c["step"], nz, e) for e, c, nz, _, _ in scored],
                                  chosen_error=next((e for e, c, *_ in scored if c is chosen), math.nan))
    if not scored:
        record["seconds"] = time.perf_counter() - t0
        return _LooChoice(chosen, None, math.nan, math.nan, 1.0, per, record)
    best = min(scored, key=lambda t: t[0])
    err, win, noise, r, s = best
    gram = _loo_gram(win["kernel"], win["multiplier"], x) if left() >= 2 * per + reserve else None  # the steps' K
    for factor in (2.0, 0.5):  # the noise: one direction, while it lowers the error
        moved = False
        for _ in range(max_noise_steps):
            if left() < 2 * per + reserve:
                break
            got = score(win, noise * factor, gram)
            if got is None or not got[0] < err:
                break
            err, r, s = got
            noise *= factor
            moved = True
        if moved:
            break
    del gram
    if reserve > 0 and win.get("family") is not None:
        kern, noise_d, err_d, r_d, s_d, record["descent"] = _loo_descent(
            win["kernel"], win["multiplier"], noise, x, y, lambda: left() - per, 3 * per,
            criterion=LOO_DESCENT_CRITERION)
        if record["descent"]["after"] < record["descent"]["before"]:
            g = torch.Generator(device=x.device).manual_seed(0)
            pairs = torch.randint(x.shape[0], (LOO_PROBES, 2), generator=g, device=x.device)
            over_start = _midpoint_overshoot(win["kernel"], win["multiplier"], noise, x, y, pairs)
            over = _midpoint_overshoot(kern, 1.0, noise_d, x, y, pairs)
            record["descent"].update(overshoot_start=over_start, overshoot=over,
                                     kept=over <= over_start + LOO_OVERSHOOT_MARGIN)
            if record["descent"]["kept"]:
                dtype = next(win["kernel"].parameters()).dtype
                win = dict(win, kernel=kern.to(dtype=dtype), multiplier=1.0)
                err, noise, r, s = err_d, noise_d, r_d, s_d
    c_var = float((r.square() * (1 - s) / noise).mean())
    record.update(winner=(win["racer"], win["step"]), noise=noise, noise_factor=noise / win["noise"], error=err,
                  variance_scale=c_var, refit=False, seconds=time.perf_counter() - t0)
    return _LooChoice(chosen, win, noise, err, c_var if math.isfinite(c_var) and c_var > 0 else 1.0, per, record)
