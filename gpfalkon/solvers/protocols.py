"""The two parts a Nyström system's solve is assembled from: a preconditioner and a solver.

Both are structural protocols (:class:`typing.Protocol`), so an implementation needs no
import from this package: :class:`~gpfalkon.FalkonPreconditioner` (in ``operators/``)
satisfies :class:`Preconditioner` by its methods, and any function with the signature of
:func:`~gpfalkon.solvers.falkon_solve` is a :class:`Solver`.
:class:`~gpfalkon.NystromKRROperator` takes both as arguments (``solver=``,
``preconditioner=``), so a new preconditioner or solver plugs in without touching the
operator.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .cg import CGInfo

__all__ = ["Preconditioner", "PreconditionerBuilder", "Solver"]


@runtime_checkable
class Preconditioner(Protocol):
    """A right preconditioner ``B`` of an ``M x M`` SPD system ``H``: CG runs on ``B^T H B``.

    Every method maps float64 ``(M, k)`` blocks to ``(M, k)`` blocks; ``B B^T`` should
    approximate ``H^{-1}`` (docs/math.md §3.1).
    """

    def apply_b(self, rhs: Tensor) -> Tensor:
        """``B rhs``."""
        ...

    def apply_bt(self, rhs: Tensor) -> Tensor:
        """``B^T rhs``."""
        ...

    def apply_b_inv(self, rhs: Tensor) -> Tensor:
        """``B^{-1} rhs`` (maps a warm start ``alpha`` to CG coordinates)."""
        ...


class PreconditionerBuilder(Protocol):
    """Builds a :class:`Preconditioner` from ``K_MM`` at the current hyperparameters.

    Called by :class:`~gpfalkon.NystromKRROperator` whenever the centers, the penalty
    or a kernel parameter changed, and again with a larger ``jitter`` after a CG
    breakdown. :meth:`~gpfalkon.FalkonPreconditioner.from_kernel_matrix` is one.
    """

    def __call__(
        self,
        kmm: Tensor,
        penalty: Tensor | float,
        n: int,
        weights: Tensor | None = None,
        dtype: torch.dtype | None = torch.float64,
        jitter: float | None = None,
    ) -> Preconditioner:
        ...


class Solver(Protocol):
    """Solves ``H alpha = rhs`` given ``h_matmul(u) = H u`` and a preconditioner.

    Returns ``(alpha, info)`` with ``alpha`` float64 ``(M, k)``; raises
    :class:`~gpfalkon.FalkonConvergenceError` on a breakdown (the operator then
    rebuilds the preconditioner with more jitter and calls it again).
    """

    def __call__(
        self,
        h_matmul: Callable[[Tensor], Tensor],
        precond: Preconditioner,
        rhs: Tensor,
        x0: Tensor | None = None,
        *,
        tol: float,
        max_iter: int,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        verbose: bool = False,
        warn: bool = True,
    ) -> tuple[Tensor, CGInfo]:
        ...
