"""The variance calibration of :func:`~gpfalkon.auto_fit`'s model (``calibrate_variance``): one scale ``c`` of the
prior on held-out rows.

On ``k`` held-out rows with residuals ``r_i = y_i - f(x_i)`` and predictive variances
``v_i ~ sigma^2 + max(k(x_i, x_i) - ||z_i||^2, 0) + sigma^2 ||A^{-T} z_i||^2 / n``, ``z_i = T^{-T} D k_M(x_i)``, from
the final fit's own preconditioner factors (:func:`~gpfalkon.models.calibration.preconditioned_variances`), the scale
``c = mean(r_i^2 / v_i)`` (:func:`~gpfalkon.models.calibration.variance_scale`) maximises the Gaussian likelihood of
the residuals under variances ``c v_i``; the prior ``k -> c k``, ``sigma^2 -> c sigma^2`` leaves the mean unchanged
(docs/math.md §8 "Variance calibration"). Where the final fit took the held-out rows back, ``r_i`` are the residuals
of the selection fit that scored the chosen level there (kept by :class:`~gpfalkon.auto.selection._Selection`), not
the final model's, which has seen them. Cost: two triangular solves with the ``M x M`` factors per row, ``O(k M^2)``,
with ``k`` at most :data:`CALIBRATION_ROWS`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models import FalkonGP
from ..models.calibration import preconditioned_variances, variance_scale
from ..operators import FalkonPreconditioner
from .selection import ScoreKey, _Selection

#: most held-out rows :func:`~gpfalkon.auto_fit`'s variance calibration uses; fewer at large ``M`` (see
#: :func:`_calibration_rows`)
CALIBRATION_ROWS = 1000


def _calibration_rows(m: int, available: int) -> int:
    """Held-out rows the variance calibration scores at ``m`` centers: :data:`CALIBRATION_ROWS`, fewer where
    its two triangular solves (``2 rows M^2`` flops) would pass ``2e9`` flops, never below 256 (the
    estimate ``mean(r^2 / v)``'s relative spread is about ``sqrt(2 / rows)``), at most ``available``."""
    return max(1, min(available, max(256, min(CALIBRATION_ROWS, int(1e9 / max(m, 1) ** 2)))))


@dataclass(eq=False)
class _Calibration:
    """The calibration of one :func:`~gpfalkon.auto_fit` call on the held-out rows ``cal_idx`` of ``xv, yv`` (raw
    units; ``y_sd`` the targets' scale, ``dtype`` the model's), with the selection fits' kept residuals in ``fits``."""

    fits: _Selection
    cal_idx: Tensor
    xv: Tensor
    yv: Tensor
    y_sd: Tensor
    dtype: torch.dtype

    def scale(self, final: FalkonGP, precond: FalkonPreconditioner | None, seen: ScoreKey | None) -> float:
        """``c = mean(r^2 / v)`` for ``final`` on the calibration rows (raw units). ``precond``: the final fit's
        factors (``None``: a direct solve built none; the operator builds the one CG would have used). ``seen``:
        where the final fit took the calibration rows back, the key of the selection fit whose residuals stand for
        the model's (``LookupError`` where they were not kept)."""
        rows = _calibration_rows(int(final.centers.shape[0]), int(self.cal_idx.shape[0]))
        idx = self.cal_idx[:rows]
        x_c = self.xv[idx].to(self.dtype)
        if seen is not None:  # the final fit took the calibration rows back: the residuals of the selection fit
            # that scored the chosen level (a grown final fit's are its level's)
            if seen not in self.fits.cal_residuals:
                raise LookupError("the chosen level's selection residuals were not kept")
            r = self.fits.cal_residuals[seen][:rows] * float(self.y_sd)
        else:
            with torch.no_grad():
                r = self.yv[idx] - final.posterior_mean(x_c).to(torch.float64)
        if precond is None:  # a direct solve builds no preconditioner (it is chosen at small M only): the
            # operator builds the one CG would have used (its jitter for the data's dtype)
            with torch.no_grad():
                op = final.nystrom_operator(store_kernel=False)
                built = op.preconditioner
                op.engine.release()
            if not isinstance(built, FalkonPreconditioner):
                raise TypeError(f"the preconditioner is a {type(built).__name__}, not FALKON's")
            precond = built
        v = preconditioned_variances(final.kernel, x_c, final.centers.detach(), precond, float(final.noise.detach()))
        return variance_scale(r, v)
