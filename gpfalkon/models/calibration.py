"""Predictive variances through FALKON's preconditioner, and the scale that calibrates them (docs/math.md §8,
"Variance calibration")."""
from __future__ import annotations

import math

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..backend.engine import kernel_block
from ..operators import FalkonPreconditioner

__all__ = ["preconditioned_variances", "variance_scale"]


def preconditioned_variances(kernel: Kernel, x: Tensor, centers: Tensor, precond: FalkonPreconditioner,
                             noise: float) -> Tensor:
    r"""Predictive variances ``v(x)`` of the SGPR/DTC posterior (docs/math.md §4; derived in §8, "Variance
    calibration") with ``K_MM^{-1}`` and ``H^{-1}`` taken from FALKON's preconditioner instead of the
    ``O(n M^2)`` posterior factors.

    The exact predictive variance is ``sigma^2 + k(x, x) - k_xM K_MM^{-1} k_Mx + sigma^2 k_xM H^{-1} k_Mx``.
    With the preconditioner's ``T^T T = D K_MM D + j I`` and ``B = n^{-1/2} D T^{-1} A^{-1}``, whose
    ``B B^T`` is FALKON's approximation of ``H^{-1}`` (uniform subsampling's ``(n/M) K_MM D^2 K_MM`` for
    ``K_Mn K_nM``), and ``z = T^{-T} D k_Mx``:

        v(x) ~ sigma^2 + max(k(x, x) - ||z||^2, 0) + sigma^2 ||A^{-T} z||^2 / n.

    The first two terms are exact up to the jitter ``j``; the third (the posterior variance of the
    Nystrom coefficients, at most a few ``sigma^2 M / n`` where ``n >> M``) is approximated. It is meant
    for what needs the variances' scale at a few hundred points after a fit, when the fit's
    preconditioner is at hand: :func:`variance_scale`. Cost: two triangular solves with ``q`` columns
    (``2 q M^2`` flops) and ``k_Mx`` (``q M d``); memory ``O(q M)``. Float64 ``(q,)``.
    """
    if x.dim() != 2 or x.shape[-1] != centers.shape[-1]:
        raise ValueError(f"x must have shape (q, {centers.shape[-1]}), got {tuple(x.shape)}")
    if not (math.isfinite(float(noise)) and float(noise) > 0):
        raise ValueError(f"noise must be a finite number > 0, got {noise!r}")
    t, a = precond.chol_t, precond.chol_a
    with torch.no_grad():
        # kernel values in float64 (as the posterior's own variances): a float32 k_Mx's rounding would be
        # amplified by (D K_MM D + j I)^{-1} in ||z||^2, which k(x, x) - ||z||^2 subtracts
        x64 = x.to(torch.float64)
        kmx = kernel_block(kernel, centers.to(torch.float64), x64).to(t.dtype)  # (M, q)
        z = torch.linalg.solve_triangular(t.mT, precond.weights.to(t.dtype).unsqueeze(-1) * kmx, upper=False)
        h = torch.linalg.solve_triangular(a.mT, z, upper=False)
        kxx = kernel_block(kernel, x64, x64, diag=True).to(torch.float64)
        q = z.to(torch.float64).square().sum(0)
        coef = h.to(torch.float64).square().sum(0) / precond.n
        return float(noise) + (kxx - q).clamp_min(0.0) + float(noise) * coef


def variance_scale(residuals: Tensor, variances: Tensor) -> float:
    r"""The factor ``c`` that makes Gaussian predictive variances ``c v`` best explain held-out residuals:
    ``c = mean(r^2 / v)``, the maximiser of ``sum log N(r_i; 0, c v_i)`` over ``c`` (setting
    ``d/dc [log c + r^2 / (c v)] = 0``). Raises ``ValueError`` on mismatched shapes, an empty input, a
    non-finite residual or a variance that is not finite and > 0."""
    r = residuals.detach().to(torch.float64).reshape(-1)
    v = variances.detach().to(device=r.device, dtype=torch.float64).reshape(-1)
    if r.shape != v.shape or r.numel() == 0:
        raise ValueError(f"residuals and variances must have the same non-zero size, got {tuple(r.shape)} and "
                         f"{tuple(v.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("residuals contain NaN or Inf")
    if not bool((torch.isfinite(v) & (v > 0)).all()):
        raise ValueError("variances must be finite and > 0")
    return float((r.square() / v).mean())
