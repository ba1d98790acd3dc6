"""How :func:`~gpfalkon.auto_fit` draws the nested centers of its selection and final fits (``center_sampling``).

Uniform rows, or ridge-leverage-score draws estimated from a dictionary of at most ``LEVERAGE_DICTIONARY`` rows
(:func:`~gpfalkon.centers.dictionary_leverage_scores`, ``O(n M_J^2)``); ``"auto"`` skips the leverage try where the
scores are nearly uniform, ``_score_uniformity(s) = (sum s)^2 / (k sum s^2) >= LEVERAGE_UNIFORM`` (O(k)).
"""
from __future__ import annotations

from torch import Tensor

#: largest dictionary :func:`auto_fit` estimates leverage scores from (``O(n M_J^2)`` per pass)
LEVERAGE_DICTIONARY = 2048

#: ``center_sampling="auto"`` stops its leverage-score try where the first quarter's scores are this close to uniform
#: (:func:`_score_uniformity` at least this: the draw probabilities' coefficient of variation at most 0.5); a draw
#: from nearly uniform scores is nearly a uniform draw, so its selection fit would compare two like pools
LEVERAGE_UNIFORM = 0.8

#: ``report.chosen["centers"]`` where the leverage check's centers replaced the level's
_LEVERAGE_CHECK = "leverage (check)"
#: how :func:`auto_fit` draws the nested centers of stages 2-3 (``center_sampling=``)
CENTER_SAMPLING: tuple[str, ...] = ("auto", "uniform", "leverage")


def _score_uniformity(scores: Tensor) -> float:
    """``(sum s)^2 / (k sum s^2)`` over ``k`` scores ``s >= 0``: 1 where they are all equal, ``1 / k`` where one
    carries all the mass (the effective sample size of draws with probabilities ``s / sum s``, over ``k``; the
    probabilities' coefficient of variation is ``sqrt(1 / u - 1)``). 0 for an empty or zero vector."""
    total = float(scores.sum())
    sq = float(scores.square().sum())
    return total * total / (scores.numel() * sq) if sq > 0 else 0.0
