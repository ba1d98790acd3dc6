"""Leverage-score centers in :func:`~gpfalkon.auto_fit`: the pool drawn at the first size, and the last-step check.

The ridge leverage score of a row ``x_i`` at penalty ``lambda`` is ``l_i = [K (K + n lambda I)^{-1}]_ii``;
estimated from a dictionary of ``J`` uniform centers ``Z`` it is
``l_i ~ (k(x_i, x_i) - k_iZ (K_ZZ + n lambda I)^{-1} k_Zi) / (n lambda)`` (Rudi et al. 2018, ``O(n J^2 + J^3)``;
:func:`~gpfalkon.centers.dictionary_leverage_scores`; docs/math.md §3.5). Two uses (§8 "Center pool" and "Leverage
check"):

* :class:`_LeveragePool` (``center_sampling`` ``"auto"`` or ``"leverage"``): at the first size, after its
  searches, a nested stream of leverage-score draws over the selection rows (with their weights ``D``) is scored
  against the uniform pool at the level's kernel and noise; the lower validation error decides which pool every
  larger size and the final fit draw from. Skipped where the scores of the first quarter of the rows are nearly
  uniform (``LEVERAGE_UNIFORM``: their draw would be a uniform one) or where the time before the final fit's
  reserve does not pay for them. Cost: one pass of the scores and one selection fit.
* :class:`_LeverageCheck` (``leverage_check=True``): after stage 2, BLESS's leverage-score centers at the chosen
  level's size, kernel and noise (:func:`~gpfalkon.centers.leverage_centers`), fitted on the level's selection
  rows; they replace the level's centers in the final fit where they validate lower. Cost: BLESS,
  ``O(n J^2)`` per level with ``J <= 2048``, and one FALKON fit.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..centers import (
    dictionary_leverage_scores,
    leverage_centers,
    merge_repeated_scores,
    nested_leverage_centers,
)
from ..errors import CGNotConvergedWarning
from ..models import FalkonGP
from .kernels import _scale_lengthscales
from .report import AutoFitReport, _Clock
from .sampling import _LEVERAGE_CHECK, LEVERAGE_DICTIONARY, LEVERAGE_UNIFORM, _score_uniformity
from .scoring import _fit_quiet, _val_mse
from .selection import _Selection, score_key


@dataclass(eq=False)
class _LeveragePool:
    """The first size's choice between the uniform pool of ``fits`` and leverage-score draws over its ``n_s``
    selection rows ``xs`` (``n_sd`` of them distinct; ``s_all`` the permutation whose first rows are the
    dictionary), with ``base_kernel`` (standardised units) and ``center_sampling`` (``"auto"`` or ``"leverage"``).
    ``gen`` draws the nested stream."""

    fits: _Selection
    report: AutoFitReport
    clock: _Clock
    base_kernel: Kernel
    xs: Tensor
    s_all: Tensor
    n_s: int
    n_sd: int
    max_centers: int
    center_sampling: str
    learn_centers: bool
    gen: torch.Generator

    def try_at(self, m: int, level: dict[str, Any], deadline: float) -> None:
        """At the first size ``m``: draw a nested pool of leverage-score centers over the selection rows, the
        scores estimated from the level's own (uniform) centers as dictionary at the level's kernel and
        penalty (one pass); score ``m`` of them. With ``center_sampling="auto"`` the pool with the lower
        validation error is the one every larger size (and the final fit) draws from (``fits.pool`` and
        ``level`` updated); with ``"leverage"``, the leverage pool. Reasons for not trying go to the report's
        notes; the choice to ``report.sampling``."""
        fits, report, n_s, n_sd = self.fits, self.report, self.n_s, self.n_sd
        why = None
        if self.learn_centers:
            why = "learn_centers=True (the learned centers lead the uniform pool)"
        elif m >= n_sd:
            why = "the centers are all (distinct) selection rows"
        elif time.perf_counter() + 1.5 * fits.last_fit_seconds(m) > deadline:
            why = f"{max(deadline - time.perf_counter(), 0.0):.1f} s left before the final fit's reserve"
        if why is not None:
            report.notes.append(f"leverage-score centers not tried: {why}")
            return
        t_lev = time.perf_counter()
        try:
            k_lev = copy.deepcopy(self.base_kernel)
            _scale_lengthscales(k_lev, level["multiplier"])
            m_j = min(m, LEVERAGE_DICTIONARY)

            def lev_scores(rows: Tensor) -> Tensor:
                return dictionary_leverage_scores(self.xs, k_lev, level["noise"] / n_s, self.s_all[:m_j], m_j / n_s,
                                                  rows=rows)

            # the first quarter of the rows is scored and timed; the rest (linear in the rows) is scored only
            # where it and a fit at m fit before the deadline (else the pass would be spent for nothing)
            head = max(1, n_s // 4)
            dev = self.xs.device
            scores = lev_scores(torch.arange(head, device=dev))
            uniformity = _score_uniformity(scores)
            if self.center_sampling == "auto" and uniformity >= LEVERAGE_UNIFORM:
                report.notes.append(
                    f"leverage-score centers not tried: the scores of {head:,} of the {n_s:,} selection rows "
                    f"are nearly uniform (uniformity {uniformity:.3f} >= {LEVERAGE_UNIFORM:g}, mean "
                    f"{float(scores.mean()):.3g}): their draw would be a uniform one")
                report.sampling = dict(M=m, uniformity=uniformity, d_eff=float(scores.mean()) * n_s,
                                       seconds=time.perf_counter() - t_lev, chosen="uniform")
                return
            if head < n_s:
                spent = time.perf_counter() - t_lev
                rest = spent * (n_s - head) / head
                if time.perf_counter() + rest + fits.last_fit_seconds(m) > deadline:
                    report.notes.append(
                        f"leverage-score centers not tried: the scores of {head:,} of the {n_s:,} selection rows "
                        f"took {spent:.2f} s; the rest ({rest:.1f} s predicted) and a fit at M={m} would not "
                        f"end before the final fit's reserve")
                    return
                scores = torch.cat([scores, lev_scores(torch.arange(head, n_s, device=dev))])
            # a repeated selection row's score goes to its first copy: the draws never take one value twice
            nested = nested_leverage_centers(merge_repeated_scores(self.xs, scores),
                                             min(n_sd, self.max_centers), generator=self.gen)
        except Exception as exc:
            report.notes.append(f"leverage-score centers failed: {type(exc).__name__}: {exc}")
            return
        if nested.size < m:
            report.notes.append(f"leverage-score centers not tried: the draws gave {nested.size} distinct rows, "
                                f"fewer than M={m}")
            return
        if time.perf_counter() + fits.last_fit_seconds(m) > deadline:
            report.notes.append(f"leverage-score centers not tried: the scores took "
                                f"{time.perf_counter() - t_lev:.1f} s, no time left for their fit")
            return
        fits.pool["nested"] = nested
        uniform_error = level["error"]
        err = fits.score(m, level["noise"], level["multiplier"], kind="leverage")
        room = nested.size >= min(2 * m, n_sd, self.max_centers)
        if self.center_sampling == "auto" and err < uniform_error and not room:
            report.notes.append(f"leverage-score centers not kept: their {nested.size} distinct draws leave no "
                                f"room to double M={m}")
        if not math.isfinite(err):  # a failed leverage fit is never adopted, not even under "leverage"
            report.notes.append(f"leverage-score centers not kept: their fit at M={m} failed (non-finite "
                                f"validation error); the uniform pool stays")
        elif self.center_sampling == "leverage" or (err < uniform_error and room):
            fits.pool["kind"] = "leverage"
            level.update(error=err, centers="leverage")
        report.sampling = dict(M=m, uniformity=uniformity, uniform_error=uniform_error, leverage_error=err,
                               d_eff=float(scores.sum()),
                               distinct=nested.size, seconds=time.perf_counter() - t_lev, chosen=fits.pool["kind"])
        self.clock.tick(f"leverage M={m}", val_rmse=f"{math.sqrt(err):.4f}" if math.isfinite(err) else "inf")


@dataclass
class _Swap:
    """The centers the leverage check puts in the final fit in place of the level's (weights ``D``, and the
    check fit's coefficients, where CG starts)."""

    centers: Tensor
    weights: Tensor | None
    alpha: Tensor


@dataclass(eq=False)
class _LeverageCheck:
    """``leverage_check``: BLESS's leverage-score centers for the chosen level of ``fits``, scored on the validation
    rows ``xv_z, yv_z`` (standardised); with ``keep_cal`` their residuals on the calibration rows ``xv_cal, yv_cal``
    are kept as a level's are. ``n_sd``: the distinct selection rows."""

    fits: _Selection
    report: AutoFitReport
    clock: _Clock
    base_kernel: Kernel
    n_sd: int
    max_iter: int
    tol: float
    xv_z: Tensor
    yv_z: Tensor
    keep_cal: bool
    xv_cal: Tensor
    yv_cal: Tensor
    gen: torch.Generator

    def run(self, best_level: dict[str, Any], centers_kind: str) -> _Swap | None:
        """The check at ``best_level`` (whose centers are of ``centers_kind``): the swap where the leverage-score
        centers validate lower than the level, else ``None`` (skipped for time, for leverage-score or all-row
        centers, failed, or not lower; the report's ``leverage`` and notes say which)."""
        fits, report, clock = self.fits, self.report, self.clock
        m_b = int(best_level["M"])
        reserve = 1.2 * fits.final_cost(m_b) + 3 * fits.last_fit_seconds(m_b)  # the final fit; scores and a fit
        if centers_kind == "leverage":
            report.notes.append("leverage check skipped: the level's centers are leverage-score centers")
            return None
        if m_b >= self.n_sd:
            report.notes.append("leverage check skipped: the centers are all (distinct) selection rows")
            return None
        if clock.left() < reserve:
            report.notes.append(f"leverage check skipped: {clock.left():.0f} s left, the final fit and the "
                                f"check need about {reserve:.0f} s")
            return None
        t_lev = time.perf_counter()
        try:
            k_lev = copy.deepcopy(self.base_kernel)
            _scale_lengthscales(k_lev, best_level["multiplier"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # BLESS's dictionary capped at the number of centers drawn (and BLESS's default
                # 2048): its cost is O(rows J^2) per level; the fit is skipped if it left no time
                x_b, y_b = fits.rows_of(m_b)
                sel = leverage_centers(x_b, m_b, k_lev, best_level["noise"] / x_b.shape[0], generator=self.gen,
                                       max_dictionary_size=min(max(m_b, 128), 2048))
                if clock.left() < 1.2 * fits.final_cost(m_b) + 1.5 * fits.last_fit_seconds(m_b):
                    raise TimeoutError(f"the scores took {time.perf_counter() - t_lev:.1f} s; "
                                       "no time is left for the fit with their centers")
                mod, _ = _fit_quiet(FalkonGP(x_b, y_b, kernel=k_lev, centers=sel.centers,
                                             center_weights=sel.weights,
                                             penalty=best_level["noise"] / x_b.shape[0],
                                             max_iter=self.max_iter, tol=self.tol))
                err_lev = _val_mse(mod, self.xv_z, self.yv_z)
                alpha_lev = mod.alpha.detach().reshape(-1).clone()
                if self.keep_cal and math.isfinite(err_lev):
                    # the calibration's residuals where these centers are taken (as a level's are kept)
                    fits.cal_residuals[score_key(m_b, best_level["noise"], best_level["multiplier"],
                                                 _LEVERAGE_CHECK)] = (
                        self.yv_cal - mod.posterior_mean(self.xv_cal).to(torch.float64))
                del mod
            if any(not issubclass(w.category, CGNotConvergedWarning) for w in caught):
                report.notes.append("leverage check: " + "; ".join(
                    str(w.message)[:160] for w in caught if not issubclass(w.category, CGNotConvergedWarning)))
        except Exception as exc:
            err_lev = math.inf
            report.notes.append(f"leverage check {'skipped' if isinstance(exc, TimeoutError) else 'failed'}: "
                                f"{type(exc).__name__}: {exc}")
            sel = None
        lev_s = time.perf_counter() - t_lev
        report.leverage = dict(M=m_b, distinct=None if sel is None else int(sel.centers.shape[0]),
                               error=err_lev, uniform_error=best_level["error"], seconds=lev_s)
        clock.tick("leverage check", val_rmse=f"{math.sqrt(err_lev):.4f}" if math.isfinite(err_lev) else "inf")
        if sel is not None and math.isfinite(err_lev) and err_lev < best_level["error"]:
            return _Swap(sel.centers, sel.weights, alpha_lev)
        return None
