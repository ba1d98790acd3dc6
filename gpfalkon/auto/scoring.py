"""Validation scoring of FALKON fits for :func:`~gpfalkon.auto_fit`: single fits, penalty paths, paired comparisons.

``_val_mse`` is the mean squared error ``mean((y_v - f(x_v))^2)`` of a fit's posterior mean on held-out rows
(``O(n_v M)``); ``_path_val_mse`` scores every penalty of one :class:`~gpfalkon.models.penalty_path.PenaltyPath`
with one kernel pass; ``_paired_z`` is the paired statistic ``mean(d) / (std(d) / sqrt(k))`` of
``d = r_new^2 - r_old^2`` over ``k`` rows. The fits record CG's iteration-cap warning as "not converged" instead of
printing it; ``_KeptPreconditioner`` keeps the last preconditioner built so that a refit can reuse it.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..centers import first_distinct
from ..errors import CGNotConvergedWarning
from ..models import FalkonGP
from ..models.penalty_path import PenaltyPath
from ..operators import FalkonPreconditioner


class _KeptPreconditioner:
    """A :class:`~gpfalkon.solvers.PreconditionerBuilder` that builds FALKON's preconditioner as the default
    does (:meth:`FalkonPreconditioner.from_kernel_matrix`) and keeps the last one, so the variance calibration
    can read the final fit's factors after the fit (they live as long as the fit anyway: no extra peak
    memory, only a later release)."""

    def __init__(self) -> None:
        self.last: FalkonPreconditioner | None = None

    def __call__(self, kmm: Tensor, penalty: Tensor | float, n: int, weights: Tensor | None = None,
                 dtype: torch.dtype | None = torch.float64, jitter: float | None = None) -> FalkonPreconditioner:
        self.last = None  # a rebuild (more jitter) frees the old factors first
        self.last = FalkonPreconditioner.from_kernel_matrix(kmm, penalty, n, weights=weights, dtype=dtype,
                                                            jitter=jitter)
        return self.last


def _val_mse(model: FalkonGP, xv: Tensor, yv: Tensor) -> float:
    model.eval()
    pred = model.posterior_mean(xv).to(torch.float64)
    return float((pred - yv.to(torch.float64)).square().mean())


def _path_means(model: FalkonGP, path: PenaltyPath, x: Tensor) -> Tensor:
    """:meth:`FalkonGP.path_means` rounded to the data dtype, as :meth:`FalkonGP.posterior_mean` returns a single fit's
    predictions (``(p, q)``, float64 values)."""
    return model.path_means(path, x).to(model.train_inputs[0].dtype).to(torch.float64)


def _path_val_mse(model: FalkonGP, path: PenaltyPath, xv: Tensor, yv: Tensor) -> list[float]:
    """:func:`_val_mse` of every penalty of ``path`` (``model``'s, from :meth:`FalkonGP.fit_penalty_path`): one kernel
    pass over ``xv`` for all of them (:func:`_path_means`)."""
    pred = _path_means(model, path, xv)
    return [float(e) for e in (pred - yv.to(torch.float64).reshape(1, -1)).square().mean(1)]


class _PathFailed(Exception):
    """A selection path that raised: its noises are left unscored, for single fits to take over."""


def _std_residuals(model: FalkonGP, xv: Tensor, yv: Tensor, y_sd: float) -> Tensor:
    """``(yv - f(xv)) / y_sd`` (float64) of a model in raw units: its residuals in standardised units; the model's
    train/eval mode is kept."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        pred = model.posterior_mean(xv).to(torch.float64)
    model.train(was_training)
    return (yv.to(torch.float64) - pred) / y_sd


def _paired_z(res_new: Tensor, res_old: Tensor) -> float:
    """``mean(d) / (std(d) / sqrt(k))`` with ``d = res_new^2 - res_old^2`` over ``k`` rows: how many standard errors
    the new fit's mean squared error is above the old one's on the same rows (a paired comparison: the two fits'
    errors on one row are correlated, so their difference is far less noisy than either mean); 0 where the
    differences do not vary, ``inf`` where a residual is not finite."""
    d = res_new.square() - res_old.square()
    if not bool(torch.isfinite(d).all()):
        return math.inf
    if d.numel() < 2:
        return 0.0
    se = float(d.std()) / math.sqrt(d.numel())
    return float(d.mean()) / se if se > 0 else 0.0


def _quietly(call: Callable[[], Any]) -> tuple[Any, bool]:
    """``(call(), converged)``: CG's cap warning recorded (not printed) as ``converged = False``; other warnings
    (jitter escalation, ...) reach the caller as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    for w in caught:
        if not issubclass(w.category, CGNotConvergedWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out, not any(issubclass(w.category, CGNotConvergedWarning) for w in caught)


def _fit_quiet(model: FalkonGP, time_limit: float | None = None,
               initial_alpha: Tensor | None = None) -> tuple[FalkonGP, bool]:
    """Fit, recording (not printing) CG's cap warning; returns (model, converged)."""
    _, converged = _quietly(lambda: model.fit(time_limit=time_limit, initial_alpha=initial_alpha))
    return model, converged


def _path_quiet(model: FalkonGP, penalties: Sequence[float], time_limit: float | None,
                initial_alpha: Tensor | None) -> tuple[PenaltyPath, bool]:
    """:meth:`FalkonGP.fit_penalty_path` from ``initial_alpha`` (one start for every penalty), recording (not
    printing) CG's cap warning; returns (path, converged)."""
    start = None if initial_alpha is None else initial_alpha.reshape(1, -1).expand(len(penalties), -1)
    return _quietly(lambda: model.fit_penalty_path(penalties, time_limit=time_limit, initial_alpha=start))


def _scoring_fit(model: FalkonGP, extra: Tensor | None) -> FalkonGP:
    """FALKON fit on ``model``'s rows with its kernel and noise and the centers ``[model.centers; extra]``.

    The objectives of stage 1 see few centers (their cost per step is ``O(rows M^2)``); a validation
    score with the same few centers is dominated by the Nystrom error and cannot tell better
    hyperparameters apart. More centers cost one FALKON fit, ``O(rows M' t + M'^3)``, per score.
    ``extra = None`` (or empty) fits ``model`` itself.
    """
    if extra is None or extra.shape[0] == 0:
        return _fit_quiet(model)[0]
    with torch.no_grad():
        centers = torch.cat([model.centers.detach(), extra.to(model.centers.dtype)], 0)
        centers = centers[first_distinct(centers)]  # an extra center equal to one before it adds nothing
        scorer = FalkonGP(model.train_inputs[0], model.train_targets, kernel=model.kernel, centers=centers,
                          penalty=model.penalty.detach(), max_iter=model.max_iter, tol=model.tol)
    return _fit_quiet(scorer)[0]


def _path_steps(score: Callable[[list[int]], list[float]], start_error: float, width: int,
                allowed: Callable[[int], bool], fits: Callable[[int], bool],
                tol: float) -> tuple[int, dict[int, float]] | None:
    """A log-spaced search over integer steps ``j`` (step 0, the start, has ``start_error``) in batches, each batch
    scored at once by ``score`` (a penalty path: one CG for all its noises): first ``0 < |j| <= width`` (both
    sides); then, while the best step so far is the outermost of its side and lower than its inner neighbour by
    more than ``tol`` (relative), the next ``width`` steps on that side. Only ``allowed`` steps; a batch is scored
    only where ``fits(len(batch))``, its outermost steps dropped until it does (both sides' at once in the first).
    Returns ``(best step, {step: error})`` (ties: the step nearest 0), or ``None`` where not even the first
    batch's nearest steps fit (the caller falls back to single fits). Cost: the scores (no fit here)."""
    errors: dict[int, float] = {0: start_error}
    batch = [j for j in range(-width, width + 1) if j != 0 and allowed(j)]
    first = True
    while batch:
        while batch and not fits(len(batch)):
            if first:
                far = max(abs(j) for j in batch)
                batch = [j for j in batch if abs(j) < far]
            else:
                batch = batch[:-1]  # an extension's steps are nearest first
        if not batch:
            if first:
                return None
            break
        first = False
        for j, e in zip(batch, score(batch), strict=True):
            errors[j] = e
        best = min(errors, key=lambda j: (errors[j], abs(j)))
        batch = []
        if best > 0 and best == max(errors) and errors[best] < errors[best - 1] * (1.0 - tol):
            batch = [best + k for k in range(1, width + 1) if allowed(best + k)]
        elif best < 0 and best == min(errors) and errors[best] < errors[best + 1] * (1.0 - tol):
            batch = [best - k for k in range(1, width + 1) if allowed(best - k)]
    return min(errors, key=lambda j: (errors[j], abs(j))), errors
