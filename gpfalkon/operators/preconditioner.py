"""FALKON's Nyström preconditioner as a linear operator."""
from __future__ import annotations

import math

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .._validation import check_penalty
from ..linalg import jittered_cholesky, upper_gram

__all__ = ["FalkonPreconditioner"]


class FalkonPreconditioner(LinearOperator):
    r"""``B = n^{-1/2} D T^{-1} A^{-1}`` (FALKON, Rudi et al. 2017, Alg. 1 / appendix A).

    With ``T^T T = D K_MM D + eps M I`` and ``A^T A = T T^T / M + lambda I``
    (both upper triangular, computed in float64):

        B B^T = ( (n/M) K_MM D^2 K_MM + n lambda K_MM )^{-1}        (eps -> 0),

    the Nyström approximation of ``H^{-1}``, ``H = K_Mn K_nM + n lambda K_MM``,
    that replaces ``K_Mn K_nM`` by ``(n/M) K_MM D^2 K_MM``. With uniform centers
    ``D = I``; leverage-score centers use ``D_jj = sqrt(M count_j / (n R p_j))`` by default
    (:func:`~gpfalkon.centers.leverage_centers`; ``1 / sqrt(n p_j count_j)`` with ``weighting="paper"``).

    Applying ``B``, ``B^T``, ``B B^T`` or ``B^{-1}`` costs two triangular solves
    (``O(M^2)`` per column); building it costs two Cholesky factorisations
    (``O(M^3 / 3)`` each). The operator's tensors are ``T``, ``A`` and ``D``; it
    is square ``M x M`` and not symmetric (``.mT`` is ``B^T``).

    Build it with :meth:`from_kernel_matrix`.
    """

    def __init__(self, T: Tensor, A: Tensor, weights: Tensor, *, n: int, transposed: bool = False) -> None:
        if T.dim() < 2 or T.shape[-1] != T.shape[-2] or A.shape != T.shape:
            raise ValueError(f"T and A must be square of equal size, got {tuple(T.shape)} and {tuple(A.shape)}")
        if weights.shape != T.shape[:-1]:
            raise ValueError(f"weights must have shape {tuple(T.shape[:-1])}, got {tuple(weights.shape)}")
        if int(n) < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        super().__init__(T, A, weights, n=int(n), transposed=bool(transposed))
        self.chol_t = T
        self.chol_a = A
        self.weights = weights
        self.n = int(n)
        self.transposed = bool(transposed)

    # ----------------------------------------------------------------- factory
    @classmethod
    def from_kernel_matrix(
        cls,
        kmm: Tensor,
        penalty: Tensor | float,
        n: int,
        weights: Tensor | None = None,
        dtype: torch.dtype | None = torch.float64,
        jitter: float | None = None,
    ) -> FalkonPreconditioner:
        """Factor ``K_MM`` (float64) into the FALKON preconditioner.

        ``weights`` is the diagonal of ``D`` (default all ones). ``dtype`` is the
        storage dtype of ``T`` and ``A`` (float64 by default; the data dtype saves
        memory at large ``M``). ``jitter`` overrides the first ``eps M`` jitter.
        """
        check_penalty(penalty)
        m = kmm.shape[-1]
        k64 = kmm.detach().to(torch.float64)
        if weights is None:
            d = torch.ones(m, dtype=torch.float64, device=kmm.device)
        else:
            d = weights.detach().to(torch.float64)
            if d.shape != (m,):
                raise ValueError(f"weights must have shape ({m},), got {tuple(weights.shape)}")
            if not bool(torch.isfinite(d).all()) or bool((d <= 0).any()):
                raise ValueError("weights must be finite and > 0")
        lam = float(torch.as_tensor(penalty).detach())
        dkd = k64 if weights is None else d.unsqueeze(1) * k64 * d.unsqueeze(0)
        T, _ = jittered_cholesky(dkd, upper=True, name="K_MM", jitter=jitter)
        del dkd
        inner = upper_gram(T)  # T T^T
        inner.div_(m)
        inner.diagonal().add_(lam)
        A, _ = jittered_cholesky(inner, upper=True, name="T T^T / M + lambda I")
        del inner
        out_dtype = torch.float64 if dtype is None else dtype
        return cls(T.to(out_dtype), A.to(out_dtype), d.to(out_dtype), n=n)

    # ------------------------------------------------------------- application
    def _solve_upper(self, M: Tensor, rhs: Tensor, transpose: bool) -> Tensor:
        if transpose:
            return torch.linalg.solve_triangular(M.mT, rhs, upper=False)
        return torch.linalg.solve_triangular(M, rhs, upper=True)

    def apply_b(self, rhs: Tensor) -> Tensor:
        """``B rhs = n^{-1/2} D T^{-1} A^{-1} rhs``."""
        z = self._solve_upper(self.chol_a, rhs.to(self.chol_a.dtype), False)
        z = self._solve_upper(self.chol_t, z, False)
        return z * (self.weights.unsqueeze(-1) / math.sqrt(self.n))

    def apply_bt(self, rhs: Tensor) -> Tensor:
        """``B^T rhs = n^{-1/2} A^{-T} T^{-T} D rhs``."""
        z = rhs.to(self.chol_a.dtype) * (self.weights.unsqueeze(-1) / math.sqrt(self.n))
        z = self._solve_upper(self.chol_t, z, True)
        return self._solve_upper(self.chol_a, z, True)

    def apply_bbt(self, rhs: Tensor) -> Tensor:
        """``B B^T rhs``, the preconditioner's approximation of ``H^{-1} rhs``."""
        return self.apply_b(self.apply_bt(rhs))

    def apply_b_inv(self, rhs: Tensor) -> Tensor:
        """``B^{-1} rhs = n^{1/2} A T D^{-1} rhs`` (maps a solution to CG coordinates)."""
        z = rhs.to(self.chol_a.dtype) / self.weights.unsqueeze(-1) * math.sqrt(self.n)
        return self.chol_a @ (self.chol_t @ z)

    # ------------------------------------------------------- LinearOperator API
    def _matmul(self, rhs: Tensor) -> Tensor:
        vec = rhs.dim() == 1
        r = rhs.unsqueeze(-1) if vec else rhs
        out = self.apply_bt(r) if self.transposed else self.apply_b(r)
        out = out.to(rhs.dtype)
        return out.squeeze(-1) if vec else out

    def _size(self) -> torch.Size:
        return torch.Size(self.chol_t.shape)

    def _transpose_nonbatch(self) -> FalkonPreconditioner:
        return self.__class__(self.chol_t, self.chol_a, self.weights, n=self.n, transposed=not self.transposed)

    def _diagonal(self) -> Tensor:
        # T^{-1} A^{-1} is upper triangular with diagonal 1 / (T_ii A_ii), and D is diagonal
        return self.weights / (self.chol_t.diagonal() * self.chol_a.diagonal() * math.sqrt(self.n))

    def solve(self, right_tensor: Tensor, left_tensor: Tensor | None = None) -> Tensor:
        r"""``B^{-1} R`` (or ``L B^{-1} R``) exactly: ``B^{-1} = n^{1/2} A T D^{-1}``.

        ``B`` is not symmetric, so linear_operator's generic solve (Cholesky of the
        dense matrix or CG, both assuming a symmetric positive-definite operator)
        would silently return a wrong answer. Two triangular matrix products,
        ``O(M^2)`` per column, differentiable w.r.t. ``T``, ``A``, ``D`` and ``R``
        (like :meth:`_matmul`, only the upper triangles of ``T`` and ``A`` are read).
        """
        vec = right_tensor.dim() == 1
        rhs = right_tensor.unsqueeze(-1) if vec else right_tensor
        t = self.chol_t.triu()
        a = self.chol_a.triu()
        w = self.weights.unsqueeze(-1)
        root_n = math.sqrt(self.n)
        z = rhs.to(a.dtype)
        if self.transposed:  # B^{-T} = n^{1/2} D^{-1} T^T A^T
            out = (t.mT @ (a.mT @ z)) * (root_n / w)
        else:  # B^{-1} = n^{1/2} A T D^{-1}
            out = a @ (t @ (z * (root_n / w)))
        out = out.to(right_tensor.dtype)
        if vec:
            out = out.squeeze(-1)
        if left_tensor is not None:
            return left_tensor @ out
        return out
