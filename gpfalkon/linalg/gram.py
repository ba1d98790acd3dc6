"""``U U^T`` and ``U x`` / ``U^T x`` for an upper-triangular ``U`` by blocked products that skip ``U``'s zero
triangle."""
from __future__ import annotations

import math

from torch import Tensor

__all__ = ["GRAM_MIN_BLOCK", "gram_block", "upper_gram", "upper_matmul"]

#: the smallest block of the blocked product: below it a matmul's fixed cost outweighs the saved flops
#: (``benchmarks/results/precond-build.md``: blocks of 256-512 rows at M = 1,000-8,000)
GRAM_MIN_BLOCK = 256


def gram_block(m: int) -> int:
    """The block height :func:`upper_gram` uses for an ``m x m`` factor: ``max(256, ceil(m / 16))``
    (at most 136 block products: the per-call cost stays small, on a GPU too)."""
    return max(GRAM_MIN_BLOCK, math.ceil(m / 16))


def upper_gram(u: Tensor, out: Tensor | None = None) -> Tensor:
    """``G = U U^T`` (symmetric, ``M x M``) for an upper-triangular ``U`` (its strictly lower part must be zero).

    With ``U`` split into blocks of ``b`` rows and columns (``b =`` :func:`gram_block`), the block
    ``G_IJ`` (``J >= I``) is ``U[I, J:] U[J, J:]^T``: ``U[J, K]`` is zero for ``K < J``, so the product
    runs only over the columns from block ``J`` on. That is ``M^3 / 3`` flops in
    ``N (N + 1) / 2`` matmuls (``N = ceil(M / b)``), against the ``2 M^3`` of ``U @ U.mT``, on torch's
    threads and on any device. ``G_JI`` is written as ``G_IJ^T`` and each diagonal block's lower triangle
    as its upper one's transpose, so ``G`` is exactly symmetric.

    Why by hand: torch has no triangular or symmetric rank-k product (BLAS ``trmm`` / ``syrk`` /
    LAPACK ``lauum``), and SciPy's ``lauum`` is CPU-only and, on one BLAS thread, slower than this
    product on torch's two: the whole preconditioner build is 1.11-1.31x faster with this product at
    M = 500-8,000 (``benchmarks/results/precond-build.md``). With ``U`` requiring grad
    it is ``U @ U.mT`` (differentiable). Cost ``O(M^3 / 3)``; memory: the result (``U`` untouched), written
    into ``out`` where given (an ``M x M`` tensor of ``U``'s dtype and device, not overlapping ``U``).
    """
    if u.dim() != 2 or u.shape[0] != u.shape[1]:
        raise ValueError(f"u must be a square matrix, got shape {tuple(u.shape)}")
    m = u.shape[0]
    b = gram_block(m)
    if u.requires_grad:
        if out is not None:
            raise ValueError("upper_gram: out= is not differentiable (u requires grad)")
        return u @ u.mT
    if out is not None and (out.shape != (m, m) or out.dtype != u.dtype or out.device != u.device):
        raise ValueError(f"out must be a {m} x {m} {u.dtype} tensor on {u.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if out is not None and out.untyped_storage().data_ptr() == u.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with u (the product reads u while it writes out)")
    g = u.new_empty(m, m) if out is None else out
    for i0 in range(0, m, b):
        i1 = min(m, i0 + b)
        for j0 in range(i0, m, b):
            j1 = min(m, j0 + b)
            blk = u[i0:i1, j0:] @ u[j0:j1, j0:].mT
            if j0 == i0:  # a diagonal block: its lower triangle from its upper one (exact symmetry)
                blk = blk.triu_().add_(blk.triu(1).mT)
                g[i0:i1, i0:i1] = blk
            else:
                g[i0:i1, j0:j1] = blk
                g[j0:j1, i0:i1] = blk.mT
    return g


def upper_matmul(u: Tensor, x: Tensor, transpose: bool = False) -> Tensor:
    """``triu(U) x`` (or ``triu(U)^T x``) for a square ``U`` and ``x`` ``(M, k)``, reading only ``U``'s upper
    triangle: block row ``I`` is ``U[I, I:] x[I:]`` with the diagonal block's lower part dropped (a
    ``b x b`` copy per block, ``b`` = :func:`gram_block`), so neither ``U.triu()`` (an ``M x M`` copy) nor
    the zero triangle's ``M^2 / 2`` reads are paid. Cost ``M^2 k`` flops, ``M^2 / 2`` values read."""
    if u.dim() != 2 or u.shape[0] != u.shape[1] or x.dim() != 2 or x.shape[0] != u.shape[0]:
        raise ValueError(f"u must be (M, M) and x (M, k), got {tuple(u.shape)} and {tuple(x.shape)}")
    m = u.shape[0]
    b = gram_block(m)
    out = x.new_empty(m, x.shape[1])
    for i0 in range(0, m, b):
        i1 = min(m, i0 + b)
        diag = u[i0:i1, i0:i1].triu()
        if transpose:  # (U^T x)[I] = U[:I, I]^T x[:I] + triu(U[I, I])^T x[I]
            out[i0:i1] = diag.mT @ x[i0:i1]
            if i0 > 0:
                out[i0:i1] += u[:i0, i0:i1].mT @ x[:i0]
        else:  # (U x)[I] = triu(U[I, I]) x[I] + U[I, I1:] x[I1:]
            out[i0:i1] = diag @ x[i0:i1]
            if i1 < m:
                out[i0:i1] += u[i0:i1, i1:] @ x[i1:]
    return out
