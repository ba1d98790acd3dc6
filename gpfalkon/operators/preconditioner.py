"""FALKON's Nyström preconditioner as a linear operator, and a cache of its penalty-free factor."""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .._validation import check_penalty
from ..backend.blocks import memory_budget_for
from ..backend.fused import upper_solve
from ..linalg import jittered_cholesky, upper_gram, upper_matmul

__all__ = ["PRECOND_PEAK_MATRICES", "FactorCache", "FalkonPreconditioner", "PreconditionerFactor",
           "engine_memory_budget", "preconditioner_bytes"]

#: float64 ``M x M`` matrices alive at the peak of building the default preconditioner: ``K_MM``, ``T`` and
#: ``T T^T / M``, in which ``A`` is factored (:meth:`FalkonPreconditioner.from_kernel_matrix`, float64
#: storage; a :class:`FactorCache` keeps a fourth, and ``dtype=float32`` storage adds two halves at the end)
PRECOND_PEAK_MATRICES = 3


def preconditioner_bytes(m: int) -> int:
    """Bytes at the peak of building the default preconditioner for ``m`` centers:
    ``PRECOND_PEAK_MATRICES`` float64 ``m x m`` matrices (the automatic memory budget of a
    :class:`~gpfalkon.NystromKRROperator`'s kernel engine leaves them free:
    :func:`gpfalkon.backend.default_memory_budget`'s ``reserve``)."""
    return PRECOND_PEAK_MATRICES * 8 * int(m) ** 2


def engine_memory_budget(m: int, device: torch.device | str | None, memory_budget: int | None = None, *,
                         store_kernel: bool | None = None, available: int | None = None) -> int:
    """The memory budget of a FALKON operator's kernel engine for ``m`` centers: ``memory_budget``, else the
    setting, else the automatic budget with :func:`preconditioner_bytes` reserved beside the kernel blocks
    (none with ``store_kernel=True``: the budget must then hold the whole ``K_nM``), from ``available`` bytes
    where given (:func:`gpfalkon.backend.blocks.memory_budget_for`)."""
    reserve = 0 if store_kernel is True else preconditioner_bytes(m)
    return memory_budget_for(memory_budget, device=device, reserve=reserve, available=available)


def _gram_refill(T: Tensor) -> Callable[[Tensor], object]:
    """Writes ``T T^T / M`` into a given ``M x M`` buffer (:func:`jittered_cholesky`'s ``refill``)."""
    m = T.shape[-1]
    return lambda buf: upper_gram(T, out=buf).div_(m)


@dataclass(frozen=True)
class PreconditionerFactor:
    """The penalty-free part of :class:`FalkonPreconditioner`: ``T`` with ``T^T T = D K_MM D + eps M I``
    (upper triangular), ``gram = T T^T / M`` and the weights ``D`` (float64). Only ``A``, the Cholesky
    factor of ``gram + lambda I``, depends on the penalty: a penalty sweep at fixed ``K_MM`` rebuilds
    that alone (:class:`FactorCache`). ``jitter`` is the ``eps M`` the factorisation added (``None``: not
    known). Memory ``2 M^2`` float64."""

    T: Tensor
    gram: Tensor
    weights: Tensor
    jitter: float | None = None


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

    Where ``T``'s jitter ``eps M`` is known (``jitter``; :meth:`from_kernel_matrix` records it),
    :meth:`w_matmul` applies the whole CG operator ``B^T H B`` with ``K_MM`` replaced by its exact
    expression through ``T`` (four triangular solves and one data pass, no ``M x M`` product).

    Build it with :meth:`from_kernel_matrix`.
    """

    def __init__(self, T: Tensor, A: Tensor, weights: Tensor, *, n: int, transposed: bool = False,
                 jitter: float | None = None) -> None:
        if T.dim() < 2 or T.shape[-1] != T.shape[-2] or A.shape != T.shape:
            raise ValueError(f"T and A must be square of equal size, got {tuple(T.shape)} and {tuple(A.shape)}")
        if weights.shape != T.shape[:-1]:
            raise ValueError(f"weights must have shape {tuple(T.shape[:-1])}, got {tuple(weights.shape)}")
        if int(n) < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if jitter is not None and not (math.isfinite(float(jitter)) and float(jitter) >= 0):
            raise ValueError(f"jitter must be a finite number >= 0 or None, got {jitter!r}")
        jitter = None if jitter is None else float(jitter)
        super().__init__(T, A, weights, n=int(n), transposed=bool(transposed), jitter=jitter)
        self.chol_t = T
        self.chol_a = A
        self.weights = weights
        self.n = int(n)
        self.transposed = bool(transposed)
        self.jitter = jitter

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
        factor = cls.factor_kernel_matrix(kmm, weights, jitter=jitter)
        return cls.from_factor(factor, penalty, n, dtype=dtype, overwrite_factor=True)

    @staticmethod
    def factor_kernel_matrix(kmm: Tensor, weights: Tensor | None = None, jitter: float | None = None
                             ) -> PreconditionerFactor:
        """The penalty-free factor: ``T`` (jittered Cholesky of ``D K_MM D``, float64) and ``T T^T / M``.
        Cost ``2 M^3 / 3`` flops (a Cholesky and :func:`~gpfalkon.linalg.upper_gram`)."""
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
        dkd = k64 if weights is None else d.unsqueeze(1) * k64 * d.unsqueeze(0)
        T, used = jittered_cholesky(dkd, upper=True, name="K_MM", jitter=jitter)
        del dkd
        gram = upper_gram(T)  # T T^T
        gram.div_(m)
        return PreconditionerFactor(T, gram, d, used)

    @classmethod
    def from_factor(
        cls,
        factor: PreconditionerFactor,
        penalty: Tensor | float,
        n: int,
        dtype: torch.dtype | None = torch.float64,
        overwrite_factor: bool = False,
    ) -> FalkonPreconditioner:
        """The preconditioner at ``penalty`` from its penalty-free ``factor``: ``A`` = Cholesky of
        ``T T^T / M + lambda I`` (``M^3 / 3`` flops). ``factor`` is not modified, unless
        ``overwrite_factor``: then ``A`` is factored in the memory of ``factor.gram`` (peak ``2 M^2``
        doubles instead of ``3 M^2``; a retry with more jitter recomputes ``T T^T / M`` there) and the
        factor must not be used again."""
        check_penalty(penalty)
        lam = float(torch.as_tensor(penalty).detach())
        in_place = overwrite_factor and factor.gram.is_contiguous() and factor.gram.dtype == torch.float64
        refill = _gram_refill(factor.T) if in_place else None
        A, _ = jittered_cholesky(factor.gram, upper=True, name="T T^T / M + lambda I", shift=lam, refill=refill)
        out_dtype = torch.float64 if dtype is None else dtype
        return cls(factor.T.to(out_dtype), A.to(out_dtype), factor.weights.to(out_dtype), n=n, jitter=factor.jitter)

    # ------------------------------------------------------------- application
    def _solve_upper(self, M: Tensor, rhs: Tensor, transpose: bool) -> Tensor:
        fast = upper_solve(M, rhs, transpose)  # the CPU kernel on torch's threads, where it applies
        if fast is not None:
            return fast
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

    # ------------------------------------------------- the CG operator B^T H B
    def w_matmul(self, u: Tensor, data_matmul: Callable[[Tensor], Tensor], kmm_weight: float) -> Tensor:
        r"""``W u = B^T (K_Mn K_nM + c K_MM) B u`` (``c = kmm_weight``, ``n lambda`` in FALKON's ``H``)
        without ``K_MM``: ``data_matmul(v) = K_Mn K_nM v``.

        With ``T^T T = D K_MM D + j I`` (``j`` = :attr:`jitter`), ``z = A^{-1} u`` and
        ``w = T^{-1} z``, so that ``B u = n^{-1/2} D w``:

            W u = A^{-T} [ T^{-T} ( n^{-1/2} D data_matmul(n^{-1/2} D w) - (c / n) j w ) + (c / n) z ]

        (``B^T K_MM B = n^{-1} A^{-T} T^{-T} (T^T T - j I) T^{-1} A^{-1}``). Four triangular solves
        (``O(M^2 k)``) and one data pass, against the same solves plus a dense ``K_MM`` product
        (``2 M^2 k`` flops, ``M^2`` float64 reads: as much memory traffic as two of the solves) when
        ``H`` is applied whole. It holds to the factorisation's rounding (``O(M eps ||K_MM||)``), so it
        is for a preconditioner built from the ``K_MM`` of ``H`` itself in float64:
        :meth:`reproduces` checks that; the operator uses this only where it does. Float64 ``(M, k)``
        in and out.
        """
        if self.jitter is None:
            raise ValueError("w_matmul needs the factorisation's jitter (jitter=None: not known)")
        if self.transposed:
            raise ValueError("w_matmul is defined for B, not for its transpose")
        root_n = math.sqrt(self.n)
        c = float(kmm_weight) / self.n
        d = self.weights.unsqueeze(-1)
        z = self._solve_upper(self.chol_a, u.to(self.chol_a.dtype), False)
        w = self._solve_upper(self.chol_t, z, False)
        data = data_matmul(w * (d / root_n))
        # (out of place on data_matmul's result, which the caller may keep)
        inner = self._solve_upper(self.chol_t, data.to(w.dtype) * (d / root_n) - (c * self.jitter) * w, True)
        return self._solve_upper(self.chol_a, inner + c * z, True)

    def reproduces(self, kmm: Tensor, rtol: float | None = None) -> bool:
        r"""Whether ``T^T T - j I`` equals ``D K_MM D`` for this ``kmm`` to the rounding of a float64
        factorisation, on one fixed random probe ``r``:
        ``||T^T T r - j r - D K_MM D r|| <= rtol trace(D K_MM D) ||r||`` (default
        ``rtol = 1000 M eps_64``; a Cholesky factor's backward error is ``O(M eps ||K_MM||)``).
        ``False`` where the factors are not float64, the jitter is not known, or the factor was built
        from another matrix. Cost ``2 M^2`` flops and two triangular products."""
        t = self.chol_t
        m = t.shape[-1]
        if self.jitter is None or t.dtype != torch.float64 or kmm.shape != t.shape or t.dim() != 2:
            return False
        k = kmm.detach().to(device=t.device, dtype=torch.float64)
        d = self.weights.to(torch.float64)
        r = torch.randn(m, 1, generator=torch.Generator().manual_seed(m), dtype=torch.float64).to(t.device)
        lhs = upper_matmul(t, upper_matmul(t, r), transpose=True) - self.jitter * r
        rhs = d.unsqueeze(-1) * (k @ (d.unsqueeze(-1) * r))
        tol = (1000.0 * m * torch.finfo(torch.float64).eps) if rtol is None else float(rtol)
        scale = float((d.square() * k.diagonal()).sum().abs()) * float(r.norm())
        err = float((lhs - rhs).norm())
        return math.isfinite(err) and err <= tol * scale

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
        return self.__class__(self.chol_t, self.chol_a, self.weights, n=self.n, transposed=not self.transposed,
                              jitter=self.jitter)

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


class FactorCache:
    """A :class:`~gpfalkon.solvers.PreconditionerBuilder` that keeps the last penalty-free factor.

    ``FalkonOptions(preconditioner=FactorCache())`` builds :class:`FalkonPreconditioner` as
    :meth:`~FalkonPreconditioner.from_kernel_matrix` does, but a call with the same ``K_MM``, weights
    and jitter as the previous one (a penalty sweep: the same kernel and centers, another ``lambda``)
    reuses that call's ``T`` and ``T T^T / M`` and computes only ``A``: ``M^3 / 3`` flops instead of
    ``M^3`` (:class:`PreconditionerFactor`). The preconditioner it returns is the one a fresh build gives,
    bit for bit.

    Sameness is checked on a fingerprint, not on ``K_MM`` itself (which would have to be kept):
    shape, dtype, device, the diagonal and ``K_MM r`` for a fixed random ``r``, all exact. Two
    matrices with equal fingerprints that differ elsewhere (e.g. in the last bits of one entry) would
    share a factor; that only changes how well CG is preconditioned, never the system it solves
    (``H`` uses ``K_MM`` itself). Memory: one factor (``2 M^2`` float64) and ``O(M)``, held until
    :meth:`clear` or the next miss. Thread-safe. ``hits`` / ``misses`` count the calls.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._factor: PreconditionerFactor | None = None
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _fingerprint(kmm: Tensor, weights: Tensor | None, jitter: float | None) -> tuple:
        k = kmm.detach()
        m = k.shape[-1]
        r = torch.randn(m, 1, generator=torch.Generator().manual_seed(m), dtype=torch.float64).to(k.device)
        w = None if weights is None else weights.detach().to(torch.float64).cpu()
        return (tuple(k.shape), k.dtype, k.device, None if jitter is None else float(jitter),
                k.diagonal().to(torch.float64).cpu(), (k.to(torch.float64) @ r).cpu(), w)

    @staticmethod
    def _same(a: tuple, b: tuple) -> bool:
        if a[:4] != b[:4]:
            return False
        for x, y in zip(a[4:], b[4:], strict=True):
            if (x is None) != (y is None):
                return False
            if x is not None and (x.shape != y.shape or not torch.equal(x, y)):
                return False
        return True

    def __call__(
        self,
        kmm: Tensor,
        penalty: Tensor | float,
        n: int,
        weights: Tensor | None = None,
        dtype: torch.dtype | None = torch.float64,
        jitter: float | None = None,
    ) -> FalkonPreconditioner:
        check_penalty(penalty)  # before any O(M^3) work, as from_kernel_matrix
        key = self._fingerprint(kmm, weights, jitter)
        with self._lock:
            factor = self._factor if self._key is not None and self._same(self._key, key) else None
            if factor is None:
                self._key = self._factor = None  # the old factor is freed before the new one is built
                factor = FalkonPreconditioner.factor_kernel_matrix(kmm, weights, jitter=jitter)
                self._key, self._factor = key, factor
                self.misses += 1
            else:
                self.hits += 1
        return FalkonPreconditioner.from_factor(factor, penalty, n, dtype=dtype)

    def clear(self) -> None:
        """Drop the kept factor (its memory)."""
        with self._lock:
            self._key = self._factor = None
