"""The final check of :func:`~gpfalkon.auto_fit`: the returned model against the selection fit it was chosen by.

The final fit solves a larger system than the selection fit that scored its level (more rows, often more centers):
a final CG that did not solve it shows as a final model worse than that fit on the calibration rows, even where
those rows are in its fit. With ``e_f`` and ``e_s`` the two fits' mean squared errors there (standardised units,
both on at least the selection fit's rows), the check fires where ``e_f > FINAL_CHECK_RATIO e_s`` and the paired
statistic of their squared errors, ``mean(d) / (std(d) / sqrt(k))`` with ``d_i = r_{f,i}^2 - r_{s,i}^2``
(:func:`~gpfalkon.auto.scoring._paired_z`), exceeds :data:`FINAL_CHECK_Z`. It then refits the chosen level on the
rows it was selected on (and the held-out rows put back), returns that fit where it scores lower there, and warns
(docs/math.md §8 "Final check"). Cost: one prediction on the calibration rows, ``O(k M d)``; the refit,
``O(n_s M t + M^3)``, only where the check fires.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._warn import warn_caller
from ..models import FalkonGP
from .final import _FinalModels, _Returned
from .report import AutoFitReport
from .scoring import _KeptPreconditioner, _paired_z
from .selection import ScoreKey, _Selection

#: the final model's error on the calibration rows (a fraction of the targets' variance) over its level's selection
#: fit's there above which (and :data:`FINAL_CHECK_Z`) :func:`~gpfalkon.auto_fit` refits the chosen level on its
#: selection rows (and the held-out rows), returns that fit where it scores lower there, and warns: the final fit was
#: worse than the one it validated (a final CG that did not solve its system: on an H200 one stopped at a relative
#: residual of 0.6, its model tested 1.27 NRMSE against 0.98 validated; ``benchmarks/results/gpu-notes.md``,
#: session 52)
FINAL_CHECK_RATIO = 1.5
#: the final check fires only where the final model's error is also above the selection fit's by more than this many
#: standard errors of the paired difference of the two fits' squared errors there
#: (:func:`~gpfalkon.auto.scoring._paired_z`): a few calibration rows (small given validation data) do not trigger it
#: by chance (the ratio's margin absorbs the selection fit's optimism on the rows its level was chosen on)
FINAL_CHECK_Z = 2.0


@dataclass(eq=False)
class _FinalCheck:
    """The final check of one :func:`~gpfalkon.auto_fit` call on the calibration rows ``cal_idx`` of ``xv``
    (raw inputs; their standardised targets ``yv_cal``, the targets' location and scale ``y_mu``, ``y_sd``, the
    model's ``dtype``), against the residuals ``fits`` kept; the refit by ``final_models`` on at most ``n_final``
    rows, ``n_back`` of them the held-out rows put back."""

    fits: _Selection
    final_models: _FinalModels
    report: AutoFitReport
    cal_idx: Tensor
    xv: Tensor
    yv_cal: Tensor
    y_mu: Tensor
    y_sd: Tensor
    dtype: torch.dtype
    n_final: int
    n_back: int

    def run(self, returned: _Returned, best_level: dict[str, Any], key: ScoreKey,
            keeper: _KeptPreconditioner | None, centers: Tensor | None = None, weights: Tensor | None = None,
            start: Tensor | None = None) -> tuple[float, float] | None:
        """Check ``returned`` against the selection fit of ``key`` (the chosen level ``best_level``, whose final
        fit takes ``centers``, ``weights`` and CG's ``start`` where the leverage check swapped them); where it
        fires, ``returned`` becomes the refit if that scores lower (``keeper`` then holds the refit's factors), and
        the report's notes and a ``RuntimeWarning`` say so. Returns ``(e_f, e_s)`` of the returned model, or
        ``None`` where the selection fit's residuals were not kept."""
        fits, report = self.fits, self.report
        if key not in fits.cal_residuals:
            return None
        n_chk = int(fits.cal_residuals[key].shape[0])
        x_chk = self.xv[self.cal_idx[:n_chk]].to(self.dtype)

        def check_residuals(model: FalkonGP) -> Tensor:
            """``model``'s standardised residuals on the check rows (a raw-unit model: ``f = y_mu + y_sd f_z``)."""
            with torch.no_grad():
                return self.yv_cal[:n_chk] - (model.posterior_mean(x_chk).to(torch.float64) - self.y_mu) / self.y_sd

        res_fin = check_residuals(returned.model)
        mse_fin = float(res_fin.square().mean())
        mse_sel = float(fits.cal_residuals[key].square().mean())
        final_check = (mse_fin, mse_sel)
        if not (math.isfinite(mse_sel) and mse_sel > 0 and not mse_fin <= FINAL_CHECK_RATIO * mse_sel
                and _paired_z(res_fin, fits.cal_residuals[key]) > FINAL_CHECK_Z):
            return final_check
        info = returned.model.fit_info
        cg = ("" if info is None else f" (its CG: relative residual {float(info.final_residual.max()):.3g} "
              f"after {info.iterations} iterations)")
        msg = (f"the final fit's error on {n_chk:,} calibration rows is {mse_fin:.3g} of the targets' "
               f"variance, {mse_fin / mse_sel:.3g} times that of the selection fit it was chosen by "
               f"({mse_sel:.3g}), on at least that fit's rows{cg}")
        # the fallback: the chosen level refitted on the rows it was selected on (and the held-out rows put
        # back), the size of fit that validated; kept where it scores lower on the calibration rows
        m_b = int(best_level["M"])
        rows_fb = min(self.n_final, fits.rows_at(m_b) + self.n_back)
        refit = None
        if rows_fb < returned.rows or returned.level is not best_level:
            t_fb = time.perf_counter()
            kept_factors = None
            if keeper is not None:  # the refit's own factors, or none (a direct solve builds none)
                kept_factors, keeper.last = keeper.last, None
            fb, conv_fb = self.final_models.fit(best_level, centers=centers, weights=weights, rows=rows_fb,
                                                keeper=keeper, start=start)
            mse_fb = float(check_residuals(fb).square().mean())
            if mse_fb < mse_fin or math.isnan(mse_fin):
                returned.model, returned.converged, returned.rows, returned.level = fb, conv_fb, rows_fb, best_level
                final_check, refit = (mse_fb, mse_sel), mse_fb
                returned.predicted = fits.final_cost(m_b, rows=rows_fb)
            elif keeper is not None:
                keeper.last = kept_factors  # the returned fit's factors calibrate it
            del fb
            report.stages["final check refit"] = time.perf_counter() - t_fb
        if refit is not None:
            back = " and the held-out ones" if self.n_back > 0 else ""
            msg += (f": the returned model is the chosen level (M={m_b}) refitted on {rows_fb:,} rows, its "
                    f"selection rows{back} (error {refit:.3g} there)")
        else:
            msg += (": the returned model is worse than the one validated; dtype=torch.float64, a larger "
                    "max_iter or a larger budget may solve it")
        report.notes.append(msg)
        warn_caller(f"auto_fit: {msg}", RuntimeWarning)
        return final_check
