"""``U U^T`` for an upper-triangular ``U``: LAPACK's ``lauum`` where it helps."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["LAUUM_MIN_SIZE", "upper_gram"]

#: the smallest M for which ``lauum`` is used: below it SciPy's call overhead outweighs the saved flops
#: (``benchmarks/precond_build.py`` without this threshold: the build 0.65x as fast at M = 500, 1.04x at
#: 1000, 1.19x at 2000, 1.58x at 4000, 1.70x at 8000)
LAUUM_MIN_SIZE = 1024


def upper_gram(u: Tensor) -> Tensor:
    """``U U^T`` (symmetric, ``M x M``) for an upper-triangular ``U`` (its strictly lower part must be zero).

    On the CPU in float32 / float64 this is LAPACK's ``?lauum`` through SciPy (a GPyTorch
    dependency): ``M^3 / 3`` flops in blocked triangular products, against the ``2 M^3`` of a general
    matmul, which torch has no triangular form of (``benchmarks/results/precond-build.md``: the whole
    preconditioner build 1.05x faster at M = 2000, 1.58x at 4000). Elsewhere (CUDA, other dtypes, no
    SciPy, ``M < LAUUM_MIN_SIZE``) it is ``U @ U.mT``. Cost ``O(M^3 / 3)``, one ``M x M`` result (plus ``U`` untouched).
    """
    if u.dim() != 2 or u.shape[0] != u.shape[1]:
        raise ValueError(f"u must be a square matrix, got shape {tuple(u.shape)}")
    if (u.device.type != "cpu" or u.dtype not in (torch.float32, torch.float64) or u.requires_grad
            or u.shape[0] < LAUUM_MIN_SIZE):
        return u @ u.mT
    try:
        from scipy.linalg import lapack
    except ImportError:  # pragma: no cover - SciPy comes with GPyTorch
        return u @ u.mT
    work = u.contiguous().clone()
    # row-major U is column-major L = U^T; ?lauum(lower) overwrites L's lower triangle with L^T L = U U^T,
    # i.e. the upper triangle of the row-major work matrix
    fortran = work.numpy().T
    fn = lapack.dlauum if u.dtype == torch.float64 else lapack.slauum
    out, info = fn(fortran, lower=1, overwrite_c=1)
    if info != 0:  # pragma: no cover - lauum fails only on invalid arguments
        return u @ u.mT
    if not np.shares_memory(out, fortran):  # SciPy copied instead of overwriting
        work.copy_(torch.from_numpy(out.T))
    res = work.triu_()
    return res + res.triu(1).mT
