"""The leave-one-out stage of :func:`~gpfalkon.auto_fit` on small data (``loo_rows``): the exact leave-one-out choice
among the learned candidates on every final row, and the refit of the winner with every distinct row a center.

With ``n <= loo_rows`` final rows, the candidates stage 1 scored (and the validation choice) are ranked by the exact
leave-one-out error of kernel ridge regression on all ``n`` rows, ``e = (1/n) sum_i (r_i / (1 - H_ii))^2`` with
``H = K (K + sigma^2 I)^{-1}`` (:func:`~gpfalkon.auto.loo._loo_choice`; docs/math.md §8 "Leave-one-out choice on
small data"). Where the winner differs from the returned model (another point, another noise, or fewer centers than
distinct rows), the model is refitted with every distinct final row a center (the exact solution: equal rows share
one center, their coefficients summed), CG started from the exact coefficients. The stage runs within
``LOO_SHARE`` of the budget, and only where three scores fit it (the validation choice, another point, the refit).
Cost: ``O(n^3)`` per score, ``n <= loo_rows``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..centers import distinct_groups
from .final import _FinalModels, _Returned
from .loo import LOO_REFIT_DTYPE, LOO_SHARE, _krr_coefficients, _loo_choice, _loo_score_seconds
from .report import AutoFitReport, _Clock
from .scoring import _KeptPreconditioner


@dataclass
class _LooOutcome:
    """What the stage leaves: the variance scale from the leave-one-out residuals where it refitted (``None``
    otherwise), and the chosen level and learned state, the winner's where it refitted."""

    variance_scale: float | None
    best_level: dict[str, Any]
    best_state: dict[str, Any]


@dataclass(eq=False)
class _LooStage:
    """The leave-one-out stage of one :func:`~gpfalkon.auto_fit` call over the candidates ``points`` on the final
    rows ``x_fin, y_fin`` (raw units; ``x_mu, x_sd, y_mu, y_sd`` their standardisation, ``dtype`` the model's), within
    ``budget`` seconds of ``clock``; refits by ``final_models``. ``calibrate_variance``: the refit's variance scale is
    the leave-one-out residuals'."""

    final_models: _FinalModels
    report: AutoFitReport
    clock: _Clock
    budget: float
    points: Sequence[dict[str, Any]] | None
    x_fin: Tensor
    y_fin: Tensor
    x_mu: Tensor
    x_sd: Tensor
    y_mu: Tensor
    y_sd: Tensor
    dtype: torch.dtype
    calibrate_variance: bool

    def run(self, returned: _Returned, best_level: dict[str, Any], best_state: dict[str, Any], chosen_error: float,
            keeper: _KeptPreconditioner | None) -> _LooOutcome:
        """Score the validation choice (``returned``, its level ``best_level``, learned state ``best_state``, its
        validation error ``chosen_error``) against the candidates by leave-one-out error; where another one wins and
        its refit fits the stage's time, ``returned`` becomes the refit (``keeper``'s factors are then dropped: the
        refit's variance scale is the leave-one-out residuals')."""
        report, clock, points = self.report, self.clock, self.points
        n_final = int(self.x_fin.shape[0])
        loo_c: float | None = None
        t_loo = time.perf_counter()
        loo_end = min(clock.t0 + self.budget, t_loo + LOO_SHARE * self.budget)
        loo_per = (_loo_score_seconds(n_final, self.x_fin.device) if points is not None and clock.left() > 0
                   else math.inf)
        if points is None or not math.isfinite(loo_per):
            return _LooOutcome(loo_c, best_level, best_state)
        left_loo = max(0.0, loo_end - time.perf_counter())
        if left_loo < 3 * loo_per:
            # three scores' time (the validation choice, another point, the refit): fewer cannot change the model
            report.loo = dict(points=len(points) + 1, skipped=True, predicted_score_seconds=loo_per,
                              seconds_left=left_loo)
            report.notes.append(
                f"leave-one-out stage skipped: a score on {n_final:,} rows is predicted to take {loo_per:.2g} s "
                f"and {left_loo:.2g} s are left of its share (it needs three: the validation choice, another point "
                "and the refit)")
        else:
            x_fin_z = (self.x_fin - self.x_mu) / self.x_sd
            final_level = returned.level
            loo = _loo_choice(
                dict(kernel=self.final_models.base_kernel, multiplier=best_level["multiplier"],
                     noise=final_level["noise"], objective=best_state["objective"], racer=best_state["racer"],
                     lr=best_state["lr"], step=best_state["step"], error=chosen_error, rows=best_state["rows"],
                     family=best_state.get("family")),
                points, x_fin_z, (self.y_fin - self.y_mu) / self.y_sd, lambda: loo_end - time.perf_counter())
            report.loo = loo.record
            win = loo.winner
            # the refit's centers: every distinct final row (equal rows, one center: the exact solution's
            # coefficients of equal rows summed into it give the same function)
            fin_keep, fin_to = distinct_groups(x_fin_z.to(self.dtype))
            n_distinct = int(fin_keep.sum())
            if win is not None and (win is not loo.chosen or loo.noise != win["noise"]
                                    or int(returned.model.centers.shape[0]) < n_distinct):
                if loo_end - time.perf_counter() >= loo.score_seconds:
                    level_w = dict(final_level, M=n_distinct, noise=loo.noise, multiplier=win["multiplier"])
                    y_fin_z = ((self.y_fin - self.y_mu) / self.y_sd).to(torch.float64)
                    alpha_z = _krr_coefficients(win["kernel"], win["multiplier"], loo.noise,
                                                x_fin_z.to(torch.float64), y_fin_z)
                    alpha_z = torch.zeros(n_distinct, *alpha_z.shape[1:], dtype=alpha_z.dtype,
                                          device=alpha_z.device).index_add_(0, fin_to, alpha_z)
                    refit, conv_w = self.final_models.fit(level_w, centers=x_fin_z.to(self.dtype)[fin_keep],
                                                          start=alpha_z, kernel_z=win["kernel"],
                                                          data_dtype=LOO_REFIT_DTYPE)
                    returned.model, returned.converged, returned.rows, returned.level = refit, conv_w, n_final, level_w
                    best_level = dict(best_level, multiplier=win["multiplier"])
                    win_state = {k: win[k] for k in ("objective", "racer", "lr", "step", "rows")}
                    best_state = dict(best_state, **win_state, error=win["error"], kernel=win["kernel"],
                                      family=win.get("family"))
                    if win.get("family") is not None:
                        report.kernel = win["family"]
                    loo.record["refit"] = True
                    if self.calibrate_variance:
                        loo_c = loo.variance_scale
                    if keeper is not None:
                        keeper.last = None
                    report.notes.append(
                        f"leave-one-out choice on all {n_final:,} rows: {win['racer']} (step {win['step']}, "
                        f"noise {loo.noise:.3g}) of {len(loo.record['scored'])} points, error {loo.error:.4g} "
                        f"against the validation choice's {loo.record['chosen_error']:.4g}; refit with every "
                        f"distinct row a center ({n_distinct:,})")
                else:
                    report.notes.append("leave-one-out choice: no time left for its refit; the validation choice "
                                        "is returned")
        report.stages["loo"] = time.perf_counter() - t_loo
        return _LooOutcome(loo_c, best_level, best_state)
