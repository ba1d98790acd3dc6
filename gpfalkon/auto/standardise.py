"""Per-feature location and scale of :func:`~gpfalkon.auto_fit`'s standardisation ``z = (x - mu) / s``.

``mu, s`` are the mean and standard deviation, or the median and a robust scale (the inter-quartile range / 1.349
times at most ``OUTLIER_SCALE_RATIO``) where a few far rows inflate the standard deviation beyond that ratio;
``_warn_far_targets`` warns where a few target rows set their standard deviation the same way.
Cost: O(n d log n) (the quantiles sort each column).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._warn import warn_caller

#: the most a feature's standard deviation may exceed its robust scale (IQR / 1.349) in auto_fit's
#: standardisation; beyond it a few far rows set the scale, which is then capped (:func:`_input_location_scale`)
OUTLIER_SCALE_RATIO = 100.0
#: in float32, auto_fit warns where a training row lies more than this many scale units from a feature's centre
FLOAT32_FAR_ROWS = 1e3


def _quantile(x: Tensor, q: float) -> Tensor:
    """Per column of ``x`` (``n >= 1`` rows), the ``q`` quantile interpolated linearly between order statistics
    (numpy's default): ``x_(h) + (h - floor h)(x_(h + 1) - x_(h))``, ``h = (n - 1) q``, 0-based; two ``kthvalue``
    selections (``torch.quantile`` refuses inputs of more than 2^24 values). Equivariant under ``x -> a x + b``."""
    h = (x.shape[0] - 1) * q
    k = math.floor(h)
    low = torch.kthvalue(x, k + 1, dim=0).values
    if h == k:
        return low
    return low + (h - k) * (torch.kthvalue(x, k + 2, dim=0).values - low)


def _input_location_scale(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per feature of ``x`` (float64, ``n`` rows): the location ``m`` and scale ``s`` of :func:`auto_fit`'s
    standardisation ``z = (x - m) / s``: the mean and standard deviation, except where a few rows far out inflate
    the standard deviation past ``OUTLIER_SCALE_RATIO`` times the robust scale ``q = IQR / 1.349`` (the standard
    deviation of a normal feature): there ``m`` is the median and ``s = OUTLIER_SCALE_RATIO q``, so that the bulk
    of the rows keeps a spread of at least ``1 / OUTLIER_SCALE_RATIO`` in ``z`` (docs/math.md §8, "Inputs with far
    outliers"). A feature with ``s = 0`` (constant) gets ``s = 1``; one with ``q = 0`` (mostly one value) keeps
    its standard deviation. ``O(n d log n)`` (the quartiles)."""
    n, d = x.shape
    ones = torch.ones(d, dtype=torch.float64, device=x.device)
    if n < 2:
        return x.mean(0) if n else torch.zeros_like(ones), ones
    mu, sd = x.mean(0), x.std(0)
    lo, med, hi = (_quantile(x, q) for q in (0.25, 0.5, 0.75))
    cap = OUTLIER_SCALE_RATIO * (hi - lo) / 1.349
    far = (cap > 0) & (sd > cap)
    mu, sd = torch.where(far, med, mu), torch.where(far, cap, sd)
    return mu, torch.where(sd > 0, sd, ones)


def _warn_far_targets(y: Tensor) -> None:
    """Warn where a few rows of the targets ``y`` (float64, ``(n,)``) set their standard deviation: ``sd >
    OUTLIER_SCALE_RATIO q`` with the robust scale ``q = IQR / 1.349 > 0``, the rule :func:`_input_location_scale`
    applies to a feature. Unlike a feature's, the targets' scale is not capped: the fit and every selection step
    minimise squared error in the targets' units, so such rows (a code for a missing value, a unit slip) dominate
    them whatever the standardisation; only the user can drop or mend them. ``O(n log n)``."""
    if y.shape[0] < 4:
        return
    lo, med, hi = (float(_quantile(y[:, None], q)) for q in (0.25, 0.5, 0.75))
    q = (hi - lo) / 1.349
    sd = float(y.std())
    if q > 0 and sd > OUTLIER_SCALE_RATIO * q:
        far = int(((y - med).abs() > OUTLIER_SCALE_RATIO * q).sum())
        warn_caller(
            f"train_y: {far} row(s) lie more than {OUTLIER_SCALE_RATIO:g} robust scales (IQR / 1.349) from the "
            f"median and set the targets' standard deviation ({sd / q:.3g} robust scales; a code for a missing "
            "value?): the fit and its selection minimise squared error, so those rows dominate both. Drop or mend "
            "them",
            RuntimeWarning,
        )
