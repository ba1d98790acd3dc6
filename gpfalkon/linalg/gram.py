"""``U U^T`` for an upper-triangular ``U``: LAPACK's ``lauum`` where it helps."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["LAUUM_MIN_SIZE", "upper_gram"]

#: the smallest M for which ``lauum`` is used: below it SciPy's call overhead outweighs the saved flops
#: (``benchmarks/results/precond-build.md``, run with every size on lauum: the build 0.80x as fast at
#: M = 128, 0.89x at 256, 1.05x at 500, 1.24x at 1000, 1.27x at 2000, 1.42x at 4000)
LAUUM_MIN_SIZE = 1024

_controller: list[Any] = []  # a cached threadpoolctl.ThreadpoolController (scanning the libraries is slow)


def _blas_controller() -> Any:
    """A cached ``threadpoolctl.ThreadpoolController`` (its ``limit`` sets SciPy's BLAS threads), or
    ``None`` without threadpoolctl."""
    if not _controller:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn (a GPyTorch dependency)
            _controller.append(None)
        else:
            _controller.append(ThreadpoolController())
    return _controller[0]


def upper_gram(u: Tensor) -> Tensor:
    """``U U^T`` (symmetric, ``M x M``) for an upper-triangular ``U`` (its strictly lower part must be zero).

    On the CPU in float32 / float64 this is LAPACK's ``?lauum`` through SciPy (a GPyTorch
    dependency): ``M^3 / 3`` flops in blocked triangular products, against the ``2 M^3`` of a general
    matmul, which torch has no triangular form of. It runs on one BLAS thread: SciPy's OpenBLAS
    threads keep spinning after a call: two of them slowed torch's next ~0.5 s of work by 7-13 % on a
    2-core host, more than their share of the product saves (``benchmarks/results/precond-build.md``
    times the build and a fixed torch workload after it). Elsewhere (CUDA, other dtypes, no SciPy or threadpoolctl,
    ``M < LAUUM_MIN_SIZE``) it is ``U @ U.mT``. Cost ``O(M^3 / 3)``, one ``M x M`` result (``U`` untouched).
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
    controller = _blas_controller()
    if controller is None:  # pragma: no cover
        return u @ u.mT
    work = u.contiguous().clone()
    # row-major U is column-major L = U^T; ?lauum(lower) overwrites L's lower triangle with L^T L = U U^T,
    # i.e. the upper triangle of the row-major work matrix
    fortran = work.numpy().T
    fn = lapack.dlauum if u.dtype == torch.float64 else lapack.slauum
    with controller.limit(limits=1, user_api="blas"):
        out, info = fn(fortran, lower=1, overwrite_c=1)
    if info != 0:  # pragma: no cover - lauum fails only on invalid arguments
        return u @ u.mT
    if not np.shares_memory(out, fortran):  # SciPy copied instead of overwriting
        work.copy_(torch.from_numpy(out.T))
    res = work.triu_()
    return res + res.triu(1).mT
