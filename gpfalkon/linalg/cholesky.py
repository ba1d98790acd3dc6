"""Cholesky factorisation with jitter escalation (always in float64)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._validation import all_finite
from .._warn import warn_caller
from ..errors import JitterWarning, NotPSDError

__all__ = ["jittered_cholesky"]


def jittered_cholesky(
    a: Tensor,
    *,
    upper: bool = False,
    name: str = "K_MM",
    jitter: float | None = None,
    max_relative_jitter: float = 1e-2,
    shift: float = 0.0,
    refill: Callable[[Tensor], object] | None = None,
) -> tuple[Tensor, float]:
    """Factor ``a + (shift + j) I`` (float64) for the smallest ``j`` in an escalating schedule
    (``shift``: a known diagonal term, e.g. a penalty, added in the work matrix instead of in a copy of ``a``).

    The first try uses ``j = eps_64 * M * mean(diag(a))`` (FALKON's ``eps M``
    jitter, relative to the kernel's scale) unless ``jitter`` is given. On
    failure ``j`` grows tenfold from ``1e-10 * mean(diag(a))`` up to
    ``max_relative_jitter * mean(diag(a))``, with a :class:`JitterWarning`; past
    that, :class:`NotPSDError` names the matrix. Cost ``O(M^3 / 3)``.

    Returns ``(factor, j)`` with ``factor^T factor = a + (shift + j) I`` (upper) or
    ``factor factor^T = a + (shift + j) I`` (lower); the jitter's scale is the mean diagonal of
    ``a + shift I``.

    Memory: ``a`` and one ``M x M`` work matrix. With ``refill`` (``a`` then a contiguous float64
    matrix), ``a`` itself is factored and returned, no work matrix (peak ``M^2`` doubles instead of
    ``2 M^2``: at M = 50,000 that is 18.6 GiB less, the difference between fitting an 80 GB GPU or not):
    a failed try destroys ``a``, so before each retry ``refill(a)`` must write ``a``'s entries back
    (e.g. recompute them from what ``a`` was built from); after :class:`NotPSDError` ``a`` is left
    overwritten.
    """
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(a.shape)}")
    a64 = a.to(torch.float64)
    if refill is not None and (a64 is not a or not a.is_contiguous()):
        raise ValueError(f"{name}: refill= factors in place, which needs a contiguous float64 matrix, got "
                         f"{a.dtype} (contiguous: {a.is_contiguous()})")
    if not all_finite(a64):
        raise ValueError(f"{name} contains NaN or Inf: check the kernel hyperparameters and inputs")
    m = a64.shape[0]
    scale = float((a64.diagonal() + shift).abs().mean())
    if scale == 0.0 or not torch.isfinite(torch.tensor(scale)):
        scale = 1.0
    first = float(torch.finfo(torch.float64).eps) * m * scale if jitter is None else float(jitter)
    schedule = [first]
    j = max(first, 1e-10 * scale)
    while j <= max_relative_jitter * scale * (1 + 1e-9):
        if j > first:
            schedule.append(j)
        j *= 10.0
    # a + (shift + j) I in one row-major work matrix, factored in place: peak 2 M^2 doubles counting ``a``.
    # LAPACK works column-major; the transposed view of the (symmetric) work matrix is column-major and its
    # lower factor is the row-major matrix's upper one (and vice versa): factored through that view, torch
    # needs no layout copy of the output (1.1-1.36x at M = 1000-4000 on the CPU:
    # benchmarks/results/cholesky-layout.md)
    work = a64 if refill is not None else torch.empty(a64.shape, dtype=torch.float64, device=a64.device)
    info = torch.empty((), dtype=torch.int32, device=a64.device)
    for k, jit in enumerate(schedule):
        if refill is None:
            work.copy_(a64)
        elif k > 0:
            refill(work)
        work.diagonal().add_(shift + jit)
        torch.linalg.cholesky_ex(work.mT, upper=not upper, out=(work.mT, info))
        factor = work.triu_() if upper else work.tril_()
        if int(info) == 0 and all_finite(factor):
            if k > 0:
                warn_caller(
                    f"{name} is numerically singular (e.g. duplicate centers); its Cholesky factor "
                    f"needed jitter {jit:.3g} ({jit / scale:.1e} x mean diagonal)",
                    JitterWarning,
                )
            return factor, jit
    raise NotPSDError(
        f"{name} is not positive semi-definite: Cholesky failed even with jitter "
        f"{schedule[-1]:.3g} ({max_relative_jitter:g} x mean diagonal). Is the kernel positive definite?"
    )
