"""FALKON's preconditioner at several penalties at once, for one CG over a penalty path."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._validation import check_penalty
from .preconditioner import FalkonPreconditioner

__all__ = ["PenaltyPathPreconditioner"]


class PenaltyPathPreconditioner:
    r"""Column ``j`` of every block preconditioned at its own penalty ``lambda_j``:
    ``B_j = n^{-1/2} D T^{-1} A_j^{-1}``, ``A_j^T A_j = T T^T / M + lambda_j I``, with one ``T``
    (``T^T T = D K_MM D + eps M I``) shared by all (:class:`~gpfalkon.FalkonPreconditioner` at each penalty).

    CG solves its columns independently, so a block whose column ``j`` holds the system at ``lambda_j``,
    ``H_j = K_Mn K_nM + n lambda_j K_MM``, is solved for every penalty at once, and :meth:`w_matmul` applies all
    ``B_j^T H_j B_j`` with one data pass ``K_Mn K_nM (.)`` for the whole block: where that pass dominates (a
    stored ``K_nM`` is read once whatever the number of columns), ``p`` penalties cost about one fit.

    Cost: building ``M^3 / 3`` flops for ``T`` (once) and ``M^3 / 3`` per penalty (``A_j``); applying
    ``O(p M^2)`` (two triangular solves a column). Satisfies :class:`~gpfalkon.solvers.Preconditioner`. Written
    here because neither linear_operator nor falkon has a preconditioner per column of a block.
    """

    def __init__(self, parts: Sequence[FalkonPreconditioner]) -> None:
        if len(parts) < 1:
            raise ValueError("parts: a penalty path needs at least one preconditioner")
        first = parts[0]
        for j, p in enumerate(parts):
            if not isinstance(p, FalkonPreconditioner):
                raise TypeError(f"parts[{j}] must be a FalkonPreconditioner, got {type(p).__name__}")
            if p.transposed:
                raise ValueError(f"parts[{j}] is a transposed preconditioner (B^T); the path needs B")
            if p.n != first.n or p.jitter != first.jitter or p.chol_t.shape != first.chol_t.shape:
                raise ValueError(f"parts[{j}] was not built from the factor of parts[0] (n, jitter or size differ)")
            if p.chol_t is not first.chol_t and not torch.equal(p.chol_t, first.chol_t):
                raise ValueError(f"parts[{j}] does not share parts[0]'s factor T")
        self.parts = list(parts)
        self.chol_t = first.chol_t
        self.weights = first.weights
        self.n = first.n
        self.jitter = first.jitter

    @classmethod
    def from_kernel_matrix(
        cls,
        kmm: Tensor,
        penalties: Sequence[float] | Tensor,
        n: int,
        weights: Tensor | None = None,
        dtype: torch.dtype | None = torch.float64,
        jitter: float | None = None,
    ) -> PenaltyPathPreconditioner:
        """Factor ``K_MM`` once (:meth:`FalkonPreconditioner.factor_kernel_matrix`) and build ``A_j`` at each of
        ``penalties`` from that factor."""
        lams = [float(v) for v in torch.as_tensor(penalties, dtype=torch.float64).reshape(-1)]
        if not lams:
            raise ValueError("penalties must hold at least one penalty")
        for lam in lams:
            check_penalty(lam)
        factor = FalkonPreconditioner.factor_kernel_matrix(kmm, weights, jitter=jitter)
        return cls([FalkonPreconditioner.from_factor(factor, lam, n, dtype=dtype) for lam in lams])

    @property
    def size(self) -> int:
        """The number of penalties ``p`` (the block's columns)."""
        return len(self.parts)

    def _columns(self, rhs: Tensor) -> list[Tensor]:
        if rhs.dim() != 2 or rhs.shape[-1] != self.size:
            raise ValueError(f"a penalty path's block must have shape (M, {self.size}), got {tuple(rhs.shape)}")
        return [rhs[:, j:j + 1] for j in range(self.size)]

    def _each(self, method: Callable[[FalkonPreconditioner, Tensor], Tensor], rhs: Tensor) -> Tensor:
        return torch.cat([method(p, c) for p, c in zip(self.parts, self._columns(rhs), strict=True)], dim=1)

    def apply_b(self, rhs: Tensor) -> Tensor:
        """Column ``j``: ``B_j rhs_j``."""
        return self._each(FalkonPreconditioner.apply_b, rhs)

    def apply_bt(self, rhs: Tensor) -> Tensor:
        """Column ``j``: ``B_j^T rhs_j``."""
        return self._each(FalkonPreconditioner.apply_bt, rhs)

    def apply_b_inv(self, rhs: Tensor) -> Tensor:
        """Column ``j``: ``B_j^{-1} rhs_j``."""
        return self._each(FalkonPreconditioner.apply_b_inv, rhs)

    def reproduces(self, kmm: Tensor, rtol: float | None = None) -> bool:
        """:meth:`FalkonPreconditioner.reproduces` of the shared factor."""
        return self.parts[0].reproduces(kmm, rtol)

    def w_matmul(self, u: Tensor, data_matmul: Callable[[Tensor], Tensor], kmm_weight: Tensor | Sequence[float]
                 ) -> Tensor:
        r"""Column ``j``: ``B_j^T (K_Mn K_nM + c_j K_MM) B_j u_j`` (``c_j = kmm_weight[j]``, ``n lambda_j``), with
        one ``data_matmul`` (``v -> K_Mn K_nM v``) for the block: :meth:`FalkonPreconditioner.w_matmul`'s formula
        column by column around the shared pass. Float64 ``(M, p)`` in and out."""
        if self.jitter is None:
            raise ValueError("w_matmul needs the factorisation's jitter (jitter=None: not known)")
        cols = self._columns(u)
        c = torch.as_tensor(kmm_weight, dtype=torch.float64).reshape(-1).tolist()
        if len(c) != self.size:
            raise ValueError(f"kmm_weight must hold {self.size} values (one per penalty), got {len(c)}")
        root_n = math.sqrt(self.n)
        d = self.weights.unsqueeze(-1)
        solve = self.parts[0]._solve_upper
        z = [solve(p.chol_a, col.to(p.chol_a.dtype), False) for p, col in zip(self.parts, cols, strict=True)]
        w = solve(self.chol_t, torch.cat(z, dim=1), False)
        data = data_matmul(w * (d / root_n)).to(w.dtype) * (d / root_n)
        shift = w * w.new_tensor([cj / self.n * self.jitter for cj in c])
        inner = solve(self.chol_t, data - shift, True)
        return torch.cat([solve(p.chol_a, inner[:, j:j + 1] + (c[j] / self.n) * z[j], True)
                          for j, p in enumerate(self.parts)], dim=1)
