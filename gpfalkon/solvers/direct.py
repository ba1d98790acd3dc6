"""The direct Nyström solve, and the cost model that picks it over FALKON's CG.

Direct solve (docs/math.md §3.2a), in the coordinates whitened by ``L L^T = K_MM + j I``
(``j`` the Cholesky jitter):

    (B + n lambda I) beta = L^{-1} K_Mn y,    B = L^{-1} K_Mn K_nM L^{-T},    alpha = L^{-T} beta,

which is ``H alpha = K_Mn y`` with ``H = K_Mn K_nM + n lambda (K_MM + j I)``. The system
matrix is well conditioned (``cond <= 1 + ||B|| / (n lambda)``), unlike ``H`` itself whose
condition number is that of ``K_MM`` times ``||K_nM||^2 / (n lambda)``. Forming ``B`` is one
data pass of ``~2 n M^2`` float64 flops (:meth:`~gpfalkon.backend.KernelEngine.whitened_gram`:
a triangular solve and a rank update per block); the rest is ``O(M^3)``. No iteration, no
tolerance: the exact Nyström solution (to float64 rounding of the kernel values used).

FALKON's CG costs one data pass per iteration: ``n M`` kernel values read from memory when
``K_nM`` is stored, recomputed (``2 n M d`` flops and ``n M`` exponentials) when not.
:func:`choose_method` compares the two with :class:`SolveCosts`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..linalg.cholesky import jittered_cholesky
from .cg import CGInfo

__all__ = ["SolveCosts", "choose_method", "direct_solve_whitened", "whitened_factor"]


def whitened_factor(kmm: Tensor, jitter: float | None = None) -> tuple[Tensor, float]:
    """``(L, j)`` with ``L L^T = K_MM + j I`` (float64, lower; :func:`~gpfalkon.linalg.jittered_cholesky`),
    ``j`` from ``jitter`` where given (else float64's ``eps M mean(diag K_MM)``).

    Kernel values computed in a lower precision than float64 need ``j`` at that precision's ``eps M`` scale:
    ``L^{-1}`` multiplies their rounding by up to ``j^{-1/2}``, and with float64's ``j`` it swamps the
    directions of ``K_MM`` the data cannot resolve (a float32 fit's mean off by 18 % of its range where CG's is
    within 2 %; ``tests/test_direct.py``)."""
    return jittered_cholesky(kmm.to(torch.float64), name="K_MM", jitter=jitter)


def direct_solve_whitened(gram: Tensor, factor: Tensor, rhs: Tensor, n_lambda: float) -> tuple[Tensor, CGInfo]:
    """Solve ``(B + n lambda I) beta = L^{-1} rhs``; return ``(alpha = L^{-T} beta, info)``.

    Args:
        gram: ``B = L^{-1} K_Mn K_nM L^{-T}`` (float64 ``M x M``).
        factor: ``L`` (float64, lower triangular, ``L L^T = K_MM + j I``).
        rhs: ``K_Mn y`` (``(M, k)``).
        n_lambda: ``n lambda > 0``.

    Cost ``O(M^3 / 3 + M^2 k)``. ``info`` is a :class:`CGInfo` with ``iterations = 0``,
    ``converged = True``, ``residuals`` the relative residual of the whitened system
    (``(1, k)``, float64 rounding) and ``extra["method"] = "direct"``.
    """
    if n_lambda <= 0:
        raise ValueError(f"n_lambda must be > 0 for the direct solve, got {n_lambda}")
    m = gram.shape[0]
    rhs64 = rhs.to(torch.float64)
    b = torch.linalg.solve_triangular(factor, rhs64, upper=False)
    system = gram.to(torch.float64).clone()
    system.diagonal().add_(n_lambda)
    chol, _ = jittered_cholesky(system, name="B + n lambda I")
    beta = torch.cholesky_solve(b, chol)
    resid = (system @ beta - b).norm(dim=0) / b.norm(dim=0).clamp_min(torch.finfo(torch.float64).tiny)
    alpha = torch.linalg.solve_triangular(factor.t(), beta, upper=True)
    info = CGInfo(
        iterations=0,
        converged=True,
        residuals=resid.reshape(1, -1),
        tol=0.0,
        max_iter=0,
        extra={"method": "direct", "m": m},
    )
    return alpha, info


@dataclass(frozen=True)
class SolveCosts:
    """Relative machine rates for :func:`choose_method` (only their ratios matter).

    Defaults are the rates measured on the 2-core CPU of ``benchmarks/fit.py`` (float32
    matmul ~200-400 GFLOP/s, float64 half that, ``exp2`` ~10 G values/s, memory ~30-40 GB/s);
    they make the choice deterministic (no timing at run time) and are overridable.

    Attributes:
        matmul_flops: float32 matmul rate (flop/s); float64 runs at half of it.
        profile_values: kernel-profile values per second (float32; float64 half).
        bandwidth: memory read rate (bytes/s), for a stored ``K_nM``.
        iteration_guess: CG iterations assumed when a tolerance (not a fixed count) stops CG.
        margin: the direct solve must be this many times cheaper to be chosen.
    """

    matmul_flops: float = 2.5e11
    profile_values: float = 1.0e10
    bandwidth: float = 3.5e10
    iteration_guess: int = 30
    margin: float = 1.25

    def kernel_pass(self, n: int, m: int, d: int, itemsize: int, stored: bool, outputs: int = 1) -> float:
        """Seconds of one CG data pass with ``outputs`` right-hand sides (``K_b^T (K_b U)``, ``4 n M t``
        flops): a stored read (or those flops, where they take longer), or recomputing the kernel values
        and those flops."""
        values = float(n) * m
        slow = itemsize / 4.0  # float64 runs at half the float32 rates
        products = slow * 4.0 * values * outputs / self.matmul_flops
        if stored:
            return max(values * itemsize / self.bandwidth, products)
        # (the kernel's own ``2 n M (d + 2)`` term already holds one output's products)
        return slow * (2.0 * values * (d + 2) / self.matmul_flops + values / self.profile_values) \
            + 2.0 * values * itemsize / self.bandwidth + products * (outputs - 1) / outputs

    def cg(self, n: int, m: int, d: int, itemsize: int, stored: bool, iterations: int, outputs: int = 1) -> float:
        """FALKON: ``iterations + 1`` passes (the right-hand side is one; a check of a claimed convergence, one
        more, is left out: within the model's margin) + the preconditioner."""
        return ((iterations + 1) * self.kernel_pass(n, m, d, itemsize, stored, outputs)
                + 2.0 * m**3 / (self.matmul_flops / 2))

    def direct(self, n: int, m: int, d: int, itemsize: int, stored: bool, outputs: int = 1) -> float:
        """Direct: the right-hand side pass (``outputs`` columns), one pass forming ``B`` (``2 n M^2`` float64
        flops on top of the kernel values, whatever the number of outputs) and ``O(M^3)`` factorisations. Data below
        float64 (``itemsize < 8``) has both passes again from float64 kernel values, recomputed, after the caller's
        right-hand side pass in its dtype (:meth:`~gpfalkon.operators.NystromKRROperator.direct_solve`)."""
        f64 = self.matmul_flops / 2
        passes = self.kernel_pass(n, m, d, itemsize, stored, outputs)
        if itemsize < 8:
            passes += self.kernel_pass(n, m, d, 8, False, outputs) + self.kernel_pass(n, m, d, 8, False)
        else:
            passes += self.kernel_pass(n, m, d, itemsize, stored)
        return passes + 2.0 * n * m * m / f64 + 2.0 * m**3 / f64


def choose_method(
    n: int,
    m: int,
    d: int,
    *,
    itemsize: int,
    stored: bool,
    tol: float,
    max_iter: int,
    costs: SolveCosts | None = None,
    outputs: int = 1,
) -> str:
    """``"direct"`` when the modelled direct solve is ``costs.margin`` times cheaper than CG, else ``"cg"``.

    CG is assumed to run ``max_iter`` iterations when ``tol == 0`` (a fixed count was asked
    for), else ``min(max_iter, costs.iteration_guess)``. A stored ``K_nM`` makes a CG
    iteration a memory read, so the direct solve wins only at small ``M``; recomputed
    kernel values make every iteration cost a kernel evaluation, and the direct solve wins
    up to a few hundred centers (``benchmarks/fit.py`` measures both). ``outputs``: the right-hand sides ``t``
    (targets ``(n, t)``), whose products every CG pass makes and the direct solve only once.
    """
    c = SolveCosts() if costs is None else costs
    iters = max_iter if tol == 0 else min(max_iter, c.iteration_guess)
    cg = c.cg(n, m, d, itemsize, stored, iters, outputs)
    direct = c.direct(n, m, d, itemsize, stored, outputs)
    return "direct" if direct * c.margin < cg else "cg"
