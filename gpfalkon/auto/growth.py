"""The final fit's growth in :func:`~gpfalkon.auto_fit`: more nested centers than the last selection level had,
as many as the time left pays for, and the check that keeps them only where they validate better.

Where stage 2 stopped doubling the centers for time, the final fit takes ``m`` centers of the same nested pool with
``1.25 M <= m <= final_growth_factor M`` (steps of ``GROWTH_STEP``), the largest whose final fit, predicted from
the level's measured selection fits (:meth:`~gpfalkon.auto.selection._Selection.final_cost`) and 1.2 x, fits the
time left (docs/math.md §8 "Final growth"). The first size's searches keep time for such a fit
(:meth:`_Growth.reserve_size`). With ``check_growth`` the grown fit leaves the check rows out and is kept where its
squared errors there are below the level's selection fit's by more than ``-GROWTH_CHECK_Z`` standard errors of the
paired difference (§8 "Growth check"). Cost: predictions only, except the check (the grown final fit itself, at one
noise or a penalty path of a few).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..models import FalkonGP
from .costs import GROWTH_MARGIN, GROWTH_STEP, _growth_cap, _growth_noises, _growth_size
from .final import _FinalModels
from .report import AutoFitReport, _Clock
from .scoring import _KeptPreconditioner, _paired_z, _path_quiet, _std_residuals
from .selection import _Selection, score_key

#: ``check_growth`` keeps a grown final fit only where its squared errors on the check rows are below the level's
#: by more than ``-GROWTH_CHECK_Z`` standard errors of their paired mean difference (:func:`_paired_z`): 0, a lower
#: mean squared error. A tie goes to the level, whose own final fit also takes the check rows; 2 (growth unless
#: clearly worse) was 2-3 % worse on the development sets (``benchmarks/results/auto-ab-growth-check-z-s*.md``)
GROWTH_CHECK_Z = 0.0

#: ``final_growth``: the first size's searches keep time for a grown final fit whose predicted time, 1.2 x, takes at
#: most this share of the time left when they start (up to ``final_growth_factor`` times the first size; docs/math.md
#: §8 "Reserve at the first size"; 0.5 and twice the first size until session 63, `auto-ab-reserve-share-s*.md`)
RESERVE_SHARE = 0.65


@dataclass(eq=False)
class _Growth:
    """The growth of one :func:`~gpfalkon.auto_fit` call's final fit (its arguments of the same names), predicted
    from ``fits`` and fitted by ``final_models``, within ``budget`` seconds of ``clock``. The final rows are
    ``n_final`` (``final_rows`` of them take part in the cap); the check rows are the held-out rows ``cal_idx`` of
    ``xv, yv`` (raw units; ``y_sd`` the targets' scale), ``n_back`` the held-out rows the final fit puts back."""

    fits: _Selection
    final_models: _FinalModels
    report: AutoFitReport
    clock: _Clock
    budget: float
    n_final: int
    max_centers: int
    final_growth: bool
    final_growth_factor: float
    check_growth: bool
    growth_noises: bool
    n_back: int
    cal_idx: Tensor
    xv: Tensor
    yv: Tensor
    y_sd: Tensor

    def stored_need(self, m: int, m_new: int) -> float:
        """Seconds a growth from ``m`` to ``m_new`` needs with every ``K_nM`` stored: four selection fits
        and 1.2 x the final fit at ``m_new`` on its fewest rows (:meth:`_Selection.fewest_final_rows`), predicted
        from the fits at ``m`` (a closed form: no measurement, unlike :meth:`_Selection.fit_cost` past the memory
        budget)."""
        fits = self.fits
        return 4 * fits.predicted_fit_seconds(m, m_new) + 1.2 * fits.predicted_fit_seconds(
            m, m_new, max(1.0, fits.fewest_final_rows(m_new) / fits.rows_at(m)))

    def cap(self, m: int, factor: float = 2.0) -> int:
        """The most centers ``final_growth`` gives a level at ``m`` (:func:`_growth_cap`), within the pool,
        ``max_centers`` and the final rows."""
        return _growth_cap(m, factor, self.n_final, min(self.fits.pool_limit(), self.max_centers, self.n_final))

    def reserve_size(self, m: int) -> int:
        """The final fit's size the first size's searches (at ``m``) keep time for: with ``final_growth``,
        the largest size down from :meth:`cap` at ``final_growth_factor`` (steps of 1.15, at least
        ``1.25 m``) whose predicted final fit, 1.2 x, takes at most :data:`RESERVE_SHARE` of the time left, and
        whose final ``K_nM`` fits the memory budget (the stored-K prediction, no measured pass); else ``m``.
        Searches the clock cuts short then still leave the final fit room to grow: a budget that pays for
        little more than the first size buys more centers rather than a finer search at too few of them.
        (Later sizes are admitted by the growth step's own prediction of their fits and final fit, and keep
        time for their own final fit only: `benchmarks/results/auto-ab-reserve.md`.)"""
        if not self.final_growth:
            return m
        left = self.clock.left()
        m_g = self.cap(m, self.final_growth_factor)
        while m_g >= 1.25 * m:
            if (self.fits.stored(self.n_final, m_g)
                    and 1.2 * self.fits.final_cost(m_g, base=m) <= RESERVE_SHARE * left):
                return m_g
            m_g = int(m_g / GROWTH_STEP)
        return m

    def search_deadline(self, m: int, m_reserve: int) -> float:
        """The deadline of a line search at ``m``: the budget less 1.2 x the final fit at ``m_reserve``
        (:meth:`reserve_size`, ``>= m``) predicted from the fits at ``m`` (at ``m_reserve = m``, the final
        fit at ``m`` itself; every part of the prediction grows with the size, so a reserve never leaves
        less time than that)."""
        return self.clock.t0 + self.budget - 1.2 * self.fits.final_cost(m_reserve, base=m)

    def rows(self) -> int:
        """The rows of a grown final fit: the final rows, less the check rows with ``check_growth``
        (:meth:`check`)."""
        return self.n_final - min(self.n_back, int(self.cal_idx.shape[0])) if self.check_growth else self.n_final

    def noises(self, level: dict[str, Any]) -> list[float]:
        """The noises a grown fit of ``level`` solves at once: :func:`_growth_noises` with ``check_growth`` and
        ``growth_noises``, else the level's noise."""
        if self.check_growth and self.growth_noises:
            return _growth_noises(float(level["noise"]), float(level["error"]))
        return [float(level["noise"])]

    def reach(self, m_b: int, columns: int, spend: float = 0.0, base: int | None = None,
              stored_only: bool = False, refine: bool = True) -> int:
        """The centers :meth:`grown` gives a level at ``m_b`` with the time left less ``spend`` seconds:
        :func:`_growth_size` from :meth:`cap` (``final_growth_factor``) for the final fit on :meth:`rows` at
        ``columns`` noises, predicted from the selection fits at ``base`` (default ``m_b``); the time is read again
        after each prediction (one past the memory budget measures a pass), and the refinement within the last step
        takes stored sizes only (none without ``refine``: the ``growth_first`` comparison of two predictions stays
        on the steps of 1.15). ``stored_only``: sizes whose final ``K_nM`` would not be stored are passed over (no
        pass measured: a prediction only)."""
        rows = self.rows()
        on = m_b if base is None else base

        def stored(m: int) -> bool:
            return self.fits.stored(rows, m)

        def cost(m: int) -> float:
            return (self.fits.final_cost(m, base=on, rows=rows, columns=columns) if not stored_only or stored(m)
                    else math.inf)

        return _growth_size(cost, m_b, self.cap(m_b, self.final_growth_factor), lambda: self.clock.left() - spend,
                            stored if refine else lambda m: False)

    def grown(self, level: dict[str, Any], stopped_by_budget: bool, largest: bool,
              leverage_check: bool) -> dict[str, Any]:
        """``final_growth``: the level with more nested centers for the final fit, as many as the time
        left pays for (at most ``final_growth_factor M``, the pool and :func:`_growth_cap`'s bound, at least
        ``1.25 M``), or the level itself where growth does not apply (stage 2 did not stop for time, the level is
        not the ``largest``, or the ``leverage_check``'s centers replace its own). The final fit of a candidate
        ``m`` is predicted by :meth:`_Selection.final_cost` from the level's measured selection fits
        (:func:`_scaled_fit_seconds`: each part of a fit scaled by its own power of ``m / M``), on the rows it
        will take (with ``check_growth`` the final rows less the check rows: :meth:`check`), and must fit the time
        left with the 1.2 margin every other prediction of auto_fit keeps (docs/math.md §8 "Final growth")."""
        report, clock = self.report, self.clock
        m_b = int(level["M"])
        why = None
        if not stopped_by_budget:
            why = "stage 2 did not stop for time"
        elif not largest:
            why = f"the chosen level (M={m_b}) is not the largest"
        elif leverage_check:
            why = "the leverage check's centers are used"
        if why is not None:
            report.notes.append(f"final growth skipped: {why}")
            return level
        m_cap = self.cap(m_b, self.final_growth_factor)
        if m_cap < 1.25 * m_b:
            cap = ("max_centers" if m_cap == self.max_centers else "the final rows" if m_cap == self.n_final
                   else f"the pool's {self.fits.pool_limit()} centers")
            report.notes.append(f"final growth skipped: {cap} allow no M >= {math.ceil(1.25 * m_b)}")
            return level
        noises = self.noises(level)
        m_try = self.reach(m_b, len(noises))
        if m_try < 1.25 * m_b:
            report.notes.append(f"final growth skipped: {clock.left():.3g} s left pay for no final fit "
                                f"with M >= {math.ceil(1.25 * m_b)}")
            return level
        predicted = self.fits.final_cost(m_try, base=m_b, rows=self.rows(), columns=len(noises))
        at_noise = ("the level's noise" if len(noises) == 1 else
                    "noises " + ", ".join(f"{v:.3g}" for v in noises) + " (one CG; the check rows choose)")
        report.notes.append(f"final fit's centers grown from M={m_b} to M={m_try} at {at_noise} and the level's "
                            f"multiplier ({clock.left():.3g} s left)")
        return dict(level, M=m_try, grown_from=m_b, final_predicted=predicted, noises=noises)

    def check(self, level: dict[str, Any], keeper: _KeptPreconditioner | None) -> tuple[FalkonGP, bool] | None:
        """``check_growth``: the grown ``level``'s fit on the final rows less the check rows (the calibration's
        held-out rows; where no held-out rows are put back it is the final fit itself), compared there with the
        level's selection fit: ``(model, converged)`` where the paired difference of their squared errors is
        below :data:`GROWTH_CHECK_Z` standard errors (:func:`_paired_z`; 0: a lower mean squared error), else
        ``None`` (recorded in ``report.growth``). The level's noise was selected for its ``M`` centers, and more
        centers at that noise can over-fit (docs/math.md §8 "Growth check")."""
        report, clock, cal_idx = self.report, self.clock, self.cal_idx
        y_sd = float(self.y_sd)
        t_g = time.perf_counter()
        m_b = int(level["grown_from"])
        key = score_key(m_b, level["noise"], level["multiplier"], level["centers"])
        limit = max(clock.left(), GROWTH_MARGIN * level["final_predicted"], 1e-3)  # sized to the time left
        x_chk = self.xv[cal_idx].to(self.final_models.x_fin.dtype)
        y_chk = self.yv[cal_idx].to(torch.float64)
        noises = [float(v) for v in level.get("noises", [level["noise"]])]
        leave_out = cal_idx if self.n_back > 0 else None
        errors: list[float] = []
        if len(noises) == 1:
            model, converged = self.final_models.fit(level, keeper=keeper, leave_out=leave_out, time_limit=limit)
            res_g = _std_residuals(model, x_chk, y_chk, y_sd)
            chosen = 0
        else:
            # one CG for every noise (a penalty path), the check rows choose among them
            model, initial = self.final_models.model(level, leave_out=leave_out)
            rows_g = int(model.train_targets.shape[0])
            scale = y_sd ** 2 / rows_g
            path, converged = _path_quiet(model, [v * scale for v in noises], limit, initial)
            res_all = (y_chk.unsqueeze(0) - model.path_means(path, x_chk)) / y_sd
            errs = res_all.square().mean(1)
            errors = [float(e) if math.isfinite(float(e)) else math.inf for e in errs]
            chosen = min(range(len(noises)), key=lambda j: (errors[j], -noises[j]))
            model.select_penalty(path, chosen)
            if keeper is not None:  # (a direct solve built none: the calibration builds CG's)
                keeper.last = None if path.preconditioners is None else path.preconditioners.parts[chosen]
            res_g = res_all[chosen]
            del path
        err_g = float(res_g.square().mean())
        err_g = err_g if math.isfinite(err_g) else math.inf
        res_l = self.fits.cal_residuals.get(key)  # kept for every selection fit with a finite error
        err_l = float(res_l.square().mean()) if res_l is not None else math.inf
        z = _paired_z(res_g, res_l) if res_l is not None else (0.0 if math.isfinite(err_g) else math.inf)
        kept = z < GROWTH_CHECK_Z
        n_check = int(cal_idx.shape[0])
        report.growth = dict(M=int(level["M"]), grown_from=m_b, noise=noises[chosen],
                             level_noise=float(level["noise"]), noises=noises, errors=errors, error=err_g,
                             level_error=err_l, z=z,
                             check_rows=n_check, rows=int(model.train_targets.shape[0]),
                             iterations=None if model.fit_info is None else int(model.fit_info.iterations),
                             predicted=float(level["final_predicted"]),
                             seconds=time.perf_counter() - t_g, kept=kept)
        clock.tick(f"growth check M={level['M']}", val_rmse=f"{math.sqrt(err_g):.4f}" if math.isfinite(err_g)
                   else "inf")
        compared = (f"its error on the {n_check:,} check rows {err_g:.4g}, the level's {err_l:.4g} ({z:.2f} "
                    "standard errors of the paired difference)")
        if len(noises) > 1:
            compared = f"at noise {noises[chosen]:.3g} (the lowest error of {len(noises)} noises), " + compared
        if kept:
            report.notes.append(f"growth to M={level['M']} kept: {compared}; the final model is that fit (on "
                                f"{model.train_targets.shape[0]:,} rows, the check rows left out)")
            level["noise"] = noises[chosen]
            return model, converged
        report.notes.append(f"final growth from M={m_b} to M={level['M']} rejected: {compared}, not below "
                            f"{GROWTH_CHECK_Z:g}; the final fit keeps M={m_b} at the level's noise and multiplier")
        return None
