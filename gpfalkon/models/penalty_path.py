"""The coefficients of one Nystrom model at several penalties, from one CG (:meth:`FalkonGP.fit_penalty_path`)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..operators import PenaltyPathPreconditioner
from ..solvers import CGInfo

__all__ = ["PenaltyPath"]


@dataclass
class PenaltyPath:
    """``alphas[j]`` solves ``(K_Mn K_nM + n penalties[j] K_MM) alpha = K_Mn (y - c)`` (float64, shaped as the
    model's ``alpha``); ``info`` is the CG's (every penalty's column ran to the same iteration);
    ``preconditioners.parts[j]`` is FALKON's preconditioner at ``penalties[j]`` (``None`` after a direct solve).
    ``state`` (what the coefficients depend on besides the noise: kernel, centers, mean constant, and the training
    data's identity) ties the path to the model it was computed for: :meth:`FalkonGP.select_penalty` refuses a path
    whose model changed since."""

    penalties: Tensor
    alphas: Tensor
    info: CGInfo
    preconditioners: PenaltyPathPreconditioner | None
    state: tuple[list[Tensor], tuple, tuple]
