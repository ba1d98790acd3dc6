"""Conjugate gradient with one step size per right-hand side.

A textbook CG (Hestenes-Stiefel) on a symmetric positive-definite operator
``W`` given as a function, run on all ``k`` columns at once (one call of ``W``
per iteration, which is one pass over the data for FALKON) with independent
step sizes per column. Columns that reach the tolerance are frozen. Unlike
``linear_operator.utils.linear_cg`` it has no absolute thresholds: the stopping
rule is the relative residual ``||r_i|| / ||b_i||`` alone, so it reaches 1e-10
on a well-preconditioned system whatever the scale of ``b``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._warn import warn_caller
from ..errors import CGNotConvergedWarning, FalkonConvergenceError

__all__ = ["MAX_REPLACEMENTS", "CGInfo", "conjugate_gradient"]

#: the most times :func:`conjugate_gradient` restarts from the true residual ``b - W x`` after the recursive one
#: claimed the tolerance and the check disagreed (each costs one operator call more than the iterations)
MAX_REPLACEMENTS = 2


@dataclass
class CGInfo:
    """Convergence record of one CG run.

    Attributes:
        iterations: iterations run (calls of the operator, not counting the
            initial residual of a warm start nor the checks of a claimed convergence,
            ``extra["residual_checks"]``).
        converged: every column reached ``tol``.
        residuals: ``(iterations + 1, k)`` relative residuals ``||r_i|| / ||b_i||``
            (row 0 is the initial residual).
        tol, max_iter: the stopping rule used.
    """

    iterations: int
    converged: bool
    residuals: Tensor
    tol: float
    max_iter: int
    extra: dict = field(default_factory=dict)

    @property
    def final_residual(self) -> Tensor:
        return self.residuals[-1]


Callback = Callable[[int, Tensor, Tensor], None]


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    x0: Tensor | None = None,
    *,
    tol: float = 1e-7,
    max_iter: int = 100,
    callback: Callback | None = None,
    verbose: bool = False,
    stagnation_window: int | None = 50,
    desc: str = "FALKON CG",
    data_dtype: torch.dtype | None = None,
    quiet_below: float = 0.0,
    time_limit: float | None = None,
    verify: bool | None = None,
) -> tuple[Tensor, CGInfo]:
    """Solve ``W x = b`` column by column, ``b`` of shape ``(M, k)``.

    Args:
        matvec: ``u -> W u`` for ``u`` of shape ``(M, k)``.
        b: right-hand sides ``(M, k)``; the iteration runs in ``b``'s dtype.
        x0: warm start (default zero, which saves one operator call); columns whose
            initial residual is not below ``||b||`` restart from zero.
        tol: stop when every column has ``||r|| / ||b|| <= tol``.
        max_iter: iteration cap.
        callback: ``callback(iteration, x, relative_residuals)`` after each iteration.
        verbose: show a tqdm progress bar.
        stagnation_window: stop when the best relative residual has not dropped by 0.1% over
            this many iterations (``None`` disables) and return the best iterate with a
            :class:`CGNotConvergedWarning`; raise :class:`FalkonConvergenceError` only when that
            iterate is useless (relative residual >= 0.5).
        data_dtype: the dtype of the data behind ``matvec`` (default ``b``'s), for advice only:
            warnings suggest float64 only when the operator's products are computed in less.
        quiet_below: a stagnation whose best relative residual is at most this ends without a
            warning (``info.extra["stagnated"]`` records it): the floor of a low-precision operator
            when no tolerance was asked for.
        time_limit: wall-clock seconds (``None``: no limit): no iteration starts once this much time
            has passed since the call began (at least one runs); ``info.extra["time_limit"]`` records
            that the clock stopped it. The current iterate is returned: CG's error in the ``W``-norm
            falls at every iteration, so it is the best of the iterates in that norm.
        verify: check a convergence claimed by the recursive residual with one more product, ``b - W x``
            (``None``: where ``data_dtype`` is narrower than ``b``'s, or ``tol`` is within ``1e4 eps`` of
            ``b``'s dtype: there the two can drift apart). A failed check reports the true residual
            (``converged`` False; a :class:`CGNotConvergedWarning` above ``quiet_below``) and, with products as
            precise as the iteration, restarts CG from it (at most :data:`MAX_REPLACEMENTS` times, while each
            restart halves the residual). ``info.extra``: ``"residual_checks"``, ``"residual_replacements"``.

    Raises:
        FalkonConvergenceError: non-finite values, ``p^T W p <= 0`` (the operator is
            not positive definite: a non-PSD kernel), or stagnation without a usable iterate.
    """
    if b.dim() != 2:
        raise ValueError(f"b must have shape (M, k), got {tuple(b.shape)}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")
    if not (tol >= 0):
        raise ValueError(f"tol must be >= 0, got {tol}")
    if time_limit is not None and not (time_limit > 0):  # also rejects NaN
        raise ValueError(f"time_limit must be > 0 seconds or None, got {time_limit}")
    t_start = time.perf_counter()
    if not bool(torch.isfinite(b).all()):
        raise FalkonConvergenceError("the right-hand side of the CG system contains NaN or Inf")
    # each column scaled by a power of two near its largest entry (exact: no other bit of the iteration changes),
    # so that the squared norms neither underflow nor overflow (float64: right-hand sides below ~1e-150 were taken
    # for zero, or lost their digits); the solution and the callback's iterates are scaled back
    amax = b.abs().amax(0) if b.numel() else b.new_ones(b.shape[1])
    # (floor: the scale stays at or below amax, so it is finite whatever b's range)
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))), 1.0)
    b = b / scale
    if x0 is not None and x0.shape == b.shape:
        x0 = x0.to(b.dtype) / scale
    if callback is not None:
        user_callback = callback

        def callback(it: int, x: Tensor, rel: Tensor) -> None:
            user_callback(it, x * scale, rel)

    kind = data_dtype or b.dtype
    low_precision = kind.is_floating_point and kind.itemsize < 8
    advice = (f"the {kind} kernel products cannot resolve this penalty: use float64 data or a larger penalty"
              if low_precision else
              "the system is too ill-conditioned at this penalty even in float64: increase the penalty "
              "(or loosen tol)")
    b_norm = b.norm(dim=0)
    safe_norm = torch.where(b_norm > 0, b_norm, torch.ones_like(b_norm))
    if x0 is None:
        x = torch.zeros_like(b)
        r = b.clone()
    else:
        if x0.shape != b.shape:
            raise ValueError(f"x0 must have the shape of b {tuple(b.shape)}, got {tuple(x0.shape)}")
        x = x0.to(b.dtype).clone()
        x[:, b_norm == 0] = 0.0  # the solution of W x = 0 is 0, whatever the warm start
        r = b - matvec(x)
        # a warm start worse than zero (after a large change of the system) is dropped,
        # column by column: CG from it would need more iterations than from scratch
        worse = r.norm(dim=0) >= b_norm
        if bool(worse.any()):
            x[:, worse] = 0.0
            r[:, worse] = b[:, worse]
    p = r.clone()
    rs = (r * r).sum(0)
    rel = rs.sqrt() / safe_norm
    rel = torch.where(b_norm > 0, rel, torch.zeros_like(rel))
    history = [rel.clone()]
    active = rel > tol
    best = rel.clone()
    since_best = 0
    # the iterate with the smallest residual per column: an inaccurate operator (float32
    # kernel products at a tiny penalty) can make the CG residual grow again
    x_best = x.clone()
    rel_best = rel.clone()
    bar = None
    if verbose:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_iter, desc=desc, leave=False)
    it = 0
    breakdowns = 0
    checks = replacements = 0  # true-residual checks at claimed convergence, and restarts from them
    drifted = False  # the last check disagreed and no restart was left
    frozen = torch.zeros_like(active)  # columns stopped at a rounding-level breakdown (never restarted)
    # the iterate of the check with the smallest true residual (the one returned where the last check drifted)
    x_checked: Tensor | None = None
    rel_checked: Tensor | None = None
    if verify is None:
        verify = low_precision or tol < 1e4 * float(torch.finfo(b.dtype).eps)
    # restarts from the true residual help where the products are as precise as the iteration (a tight tol in
    # float64); with float32 products the true residual is at their noise floor already and a restart only adds
    # iterations (measured: 36 -> 50 iterations, the same floor)
    restarts = 0 if low_precision else MAX_REPLACEMENTS
    stagnated = False
    timed_out = False
    breakdown_rtol = 1e3 * float(torch.finfo(b.dtype).eps) ** 0.5
    curvature_rtol = float(torch.finfo(b.dtype).eps) ** 0.5
    rq_max = torch.zeros_like(b_norm)
    try:
        while it < max_iter and bool(active.any()):
            wp = matvec(p)
            pwp = (p * wp).sum(0)
            if not bool(torch.isfinite(wp).all()) or not bool(torch.isfinite(pwp).all()):
                raise FalkonConvergenceError(
                    f"CG produced non-finite values at iteration {it + 1}: check the kernel "
                    "hyperparameters and the penalty"
                )
            # Non-positive curvature on a column that has already converged as far as
            # rounding allows (a singular but consistent system, e.g. a low-rank
            # kernel): freeze that column. Anywhere else it is a real breakdown.
            # Rounding-level curvature: |p^T W p| below sqrt(eps) times the largest Rayleigh
            # quotient seen (an estimate of ||W||) is noise, not indefiniteness.
            pp = (p * p).sum(0)
            rounding = (pwp <= 0) & (pwp.abs() <= curvature_rtol * rq_max * pp)
            done = active & (pwp <= 0) & ((rel <= breakdown_rtol) | rounding)
            if bool(done.any()):
                active = active & ~done
                frozen = frozen | done
                breakdowns += int(done.sum())
            bad = active & (pwp <= 0)
            if bool(bad.any()):
                raise FalkonConvergenceError(
                    f"CG lost positive definiteness at iteration {it + 1} (p^T W p = "
                    f"{float(pwp[bad].min()):.3g}): the kernel matrix is not positive semi-definite, or "
                    + advice
                )
            rq_max = torch.maximum(
                rq_max, torch.where(pp > 0, pwp / torch.where(pp > 0, pp, torch.ones_like(pp)), rq_max)
            )
            step = torch.where(active, rs / torch.where(active, pwp, torch.ones_like(pwp)), torch.zeros_like(rs))
            x.add_(p * step)
            r.sub_(wp * step)
            rs_new = (r * r).sum(0)
            beta = torch.where(active, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), torch.zeros_like(rs))
            p.mul_(beta).add_(r)
            rs = torch.where(active, rs_new, rs)
            rel = torch.where(b_norm > 0, rs.sqrt() / safe_norm, torch.zeros_like(rs))
            history.append(rel.clone())
            it += 1
            active = active & (rel > tol)
            claimed = ~frozen & (rel <= tol)
            if verify and tol > 0 and not bool(active.any()) and bool(claimed.any()):
                # every live column claims the tolerance by the recursive residual, which drifts from b - W x where
                # W's products carry rounding the iteration does not (float32 kernel products at a small penalty:
                # 1e-4 claimed, 4e-3 true). One more product checks the claim; where it fails, the true residual is
                # reported, and CG restarts from it where that can help (``restarts``) and the last restart gained
                # at least half of the residual
                r_true = b - matvec(x)
                rel_true = torch.where(b_norm > 0, r_true.norm(dim=0) / safe_norm, torch.zeros_like(b_norm))
                checks += 1
                failed = claimed & (rel_true > tol)
                rel = torch.where(claimed, torch.maximum(rel, rel_true) if not bool(failed.any()) else rel_true, rel)
                history[-1] = rel.clone()
                if bool(failed.any()):
                    progress = rel_checked is None or float(rel.max()) < 0.5 * float(rel_checked.max())
                    if rel_checked is None or float(rel.max()) < float(rel_checked.max()):
                        x_checked, rel_checked = x.clone(), rel.clone()
                    # the recursive residuals' best iterate and progress meant nothing: both restart here
                    best, x_best, rel_best, since_best = rel.clone(), x.clone(), rel.clone(), 0
                    if replacements >= restarts or it >= max_iter or not progress:
                        drifted = True
                        if (x_checked is not None and rel_checked is not None
                                and float(rel_checked.max()) < float(rel.max())):
                            x.copy_(x_checked)
                            rel = rel_checked.clone()
                            history[-1] = rel.clone()
                            best, x_best, rel_best = rel.clone(), x.clone(), rel.clone()
                    else:
                        replacements += 1
                        r = r_true
                        rs = (r * r).sum(0)
                        p = r.clone()
                        active = failed
            improved = rel < best * 0.999
            if bool((improved & (rel > tol)).any()) or not bool(active.any()):
                since_best = 0
            else:
                since_best += 1
            best = torch.minimum(best, rel)
            better = rel < rel_best
            if bool(better.any()):
                x_best[:, better] = x[:, better]
                rel_best = torch.where(better, rel, rel_best)
            if callback is not None:
                callback(it, x, rel)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(residual=f"{float(rel.max()):.2e}")
            if drifted:
                break
            if stagnation_window is not None and since_best >= stagnation_window:
                stagnated = True
                break
            if (time_limit is not None and it < max_iter and bool(active.any())
                    and time.perf_counter() - t_start >= time_limit):
                timed_out = True
                break
    finally:
        if bar is not None:
            bar.close()
    # divergence: the residual ended above twice the best one seen. In exact arithmetic CG's
    # residual is not monotone, but a rise this large at the end is round-off taking over
    # (float32 kernel products with a penalty below what they resolve): the best iterate is
    # then the better answer (powerplant, M=400, lambda 1e-6, 20 iterations, float32: test
    # NRMSE 0.340 from the last iterate, 0.246 from the best; float64 gives 0.243).
    if stagnated:
        if bool((rel_best >= 0.5).any()):
            raise FalkonConvergenceError(
                f"CG stagnated: the best relative residual {float(rel_best.max()):.3g} has not dropped by 0.1% "
                f"in {stagnation_window} iterations (tolerance {tol:g}); " + advice
            )
        if float(rel_best.max()) > quiet_below:
            warn_caller(
                f"CG stagnated after {it} iterations (best relative residual {float(rel_best.max()):.3g}, "
                f"tolerance {tol:g}, no 0.1% progress in {stagnation_window} iterations); returning the best "
                "iterate: " + advice,
                CGNotConvergedWarning,
            )
    diverged = (rel > 2 * rel_best) & (rel > tol) if not stagnated else (rel > rel_best) & (rel > tol)
    if bool(diverged.any()):
        x[:, diverged] = x_best[:, diverged]
        # a tenfold rise is reported; a smaller one (seen in float32 on problems that still
        # match float64 to 3 %) only in ``info.extra["returned_best"]``
        if not stagnated and bool((rel > 10 * rel_best)[diverged].any()):
            warn_caller(
                f"CG diverged on {int(diverged.sum())} column(s) (relative residual {float(rel.max()):.3g} after "
                f"{it} iterations, best {float(rel_best[diverged].max()):.3g}); returning the best iterate: "
                + advice,
                CGNotConvergedWarning,
            )
        rel = torch.where(diverged, rel_best, rel)
        history.append(rel.clone())
    if drifted and float(rel.max()) > quiet_below:
        warn_caller(
            f"CG's recursive residual reached the tolerance {tol:g}, but the true relative residual b - W x is "
            f"{float(rel.max()):.3g} after {it} iterations and {replacements} restart(s) from it: the operator's "
            "products are less accurate than the tolerance asks; " + advice,
            CGNotConvergedWarning,
        )
    if it >= 10 and bool((rel >= 0.5).any()):
        warn_caller(
            f"CG made almost no progress: relative residual {float(rel.max()):.3g} after {it} iterations. "
            "The solution is unreliable: " + advice,
            CGNotConvergedWarning,
        )
    info = CGInfo(
        iterations=it,
        converged=bool((rel <= tol).all()),
        residuals=torch.stack(history),
        tol=float(tol),
        max_iter=int(max_iter),
        # columns stopped at non-positive curvature once already below 1e3 sqrt(eps)
        # (a singular, consistent system): they count as converged only if <= tol
        extra={"frozen_at_breakdown": breakdowns, "returned_best": int(diverged.sum()), "stagnated": stagnated,
               "time_limit": timed_out, "residual_checks": checks, "residual_replacements": replacements,
               "drifted": drifted},
    )
    return x * scale, info
