"""A differentiable kernel block for the stationary kernels, with a hand-written backward.

For ``k(x, c) = s phi(r)``, ``r = ||(x - c) / ell||`` (GPyTorch's ``RBFKernel`` and ``MaternKernel`` with
``nu`` 1.5 or 2.5, scalar or ARD lengthscales ``ell``, optionally in a ``ScaleKernel`` of outputscale ``s``),
the block ``K = k(X, C)`` and, given the gradient ``G`` of a loss w.r.t. ``K`` (``rows x M``), the loss's
gradients w.r.t. every input (docs/math.md §5.1b):

    H = G o g,   g_ic = s phi'(r_ic) / r_ic          (finite at r = 0 for these profiles)
    z = (X - mu) / ell,   w = (C - mu) / ell        (mu: engine.expansion_origin(X), a constant)
    dL/dz = z o (H 1) - H w,    dL/dw = w o (H^T 1) - H^T z
    dL/dX = dL/dz / ell,   dL/dC = dL/dw / ell
    dL/d ell = -(sum_i dL/dz_i o z_i + sum_c dL/dw_c o w_c) / ell      (summed over dims for a scalar ell)
    dL/ds = <G, K> / s

with ``phi'(r) / r`` equal to ``-phi(r)`` (RBF, ``phi = exp(-r^2 / 2)``), ``-3 exp(-sqrt3 r)`` (Matern 3/2) and
``-(5/3)(1 + sqrt5 r) exp(-sqrt5 r)`` (Matern 5/2). The chain rule from ``ell`` and ``s`` to GPyTorch's raw
(constrained) parameters stays with autograd. Cost: forward one ``rows x M x d`` matmul and about five
elementwise passes over the block; backward two ``rows x M x d`` matmuls and two passes; memory: the block
and ``g`` (two ``rows x M`` tensors) are saved for the backward.

Why by hand: autograd through GPyTorch's ARD kernels records about twenty elementwise ``rows x M`` operations
forward and backward (the centring, the padded norm expansion, the clamp, the square root and its masked
gradient, the profile's polynomial): the hyperparameter objectives' blocks spent most of their kernel time there
(``benchmarks/results/kernel-grad.md`` measures both). GPyTorch has such a function for a scalar lengthscale
only (``RBFCovariance``, ``MaternCovariance``), not for ARD lengthscales or gradients w.r.t. the points.
Matern 1/2 (``phi'(r) / r`` unbounded at ``r = 0``), other kernels, batched inputs and kernels whose
parameters' dtype or device differ from the points' go through GPyTorch (:func:`~gpfalkon.backend.kernel_block`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from .. import settings
from .engine import expansion_origin, kernel_block, stationary_parts

__all__ = ["StationaryBlock", "grad_kernel_block", "grad_kernel_form"]

_SQRT3 = math.sqrt(3.0)
_SQRT5 = math.sqrt(5.0)
_KINDS = ("rbf", "matern32", "matern52")


def grad_kernel_form(kernel: Kernel) -> tuple[str, Tensor, Tensor | None] | None:
    """``(kind, lengthscale, outputscale)`` of a kernel :class:`StationaryBlock` computes (the parameters as
    differentiable tensors: :func:`~gpfalkon.backend.engine.stationary_parts`), or ``None`` where the block must go
    through GPyTorch: another kernel, Matern 1/2, ``active_dims``, a batch shape, or
    :class:`gpfalkon.settings.fast_kernel_grad` off."""
    if not settings.fast_kernel_grad.value():
        return None
    parts = stationary_parts(kernel)
    return None if parts is None or parts[0] not in _KINDS else parts


class StationaryBlock(torch.autograd.Function):
    """``K = s phi(||(X - C) / ell||)`` with the backward of the module docstring (``s = None``: no scale)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, c: Tensor, ls: Tensor, os: Tensor | None, kind: str, same: bool) -> Tensor:
        mu = expansion_origin(x)
        z = (x - mu) / ls
        w = (c - mu) / ls
        zn = z.square().sum(-1, keepdim=True)
        wn = w.square().sum(-1)
        r2 = torch.addmm(wn.expand(x.shape[0], -1), z, w.mT, alpha=-2.0).add_(zn).clamp_min_(0.0)
        if same:  # k(C, C): a point's distance to itself is 0, not the expansion's rounding
            r2.diagonal().zero_()
        if kind == "rbf":
            k = r2.mul_(-0.5).exp_()
            g = None  # phi'(r) / r = -phi(r): the backward uses the block itself
        else:
            r = r2.sqrt()
            a = _SQRT5 if kind == "matern52" else _SQRT3
            e = r.mul(-a).exp_()
            if kind == "matern52":
                g = r.mul(_SQRT5).add_(1.0)  # 1 + sqrt5 r
                k = r2.mul_(5.0 / 3.0).add_(g).mul_(e)
                g.mul_(e).mul_(-5.0 / 3.0)
            else:
                k = r.mul_(_SQRT3).add_(1.0).mul_(e)
                g = e.mul_(-3.0)
        if os is not None:
            k = k.mul_(os)
            if g is not None:
                g = g.mul_(os)
        ctx.kind = kind
        ctx.has_scale = os is not None
        ctx.save_for_backward(z, w, ls, k, g, os)
        return k

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        z, w, ls, k, g, os = ctx.saved_tensors
        need_x, need_c, need_ls, need_os = ctx.needs_input_grad[:4]
        dx = dc = dls = dos = None
        gk_sum = None  # <G, K>, where the backward forms it anyway (RBF: h = -G o K)
        if need_x or need_c or need_ls:
            h = grad * k if g is None else grad * g
            if g is None:
                h.neg_()  # RBF: g = -K (the scale included)
            h_rows = h.sum(1, keepdim=True)
            if g is None:
                gk_sum = -h_rows.sum()
            dz = z * h_rows - h @ w
            dw = w * h.sum(0).unsqueeze(-1) - h.mT @ z
            if need_x:
                dx = dz / ls
            if need_c:
                dc = dw / ls
            if need_ls:
                dls = (dz * z).sum(0, keepdim=True).add_((dw * w).sum(0, keepdim=True)).div_(ls).neg_()
                if ls.shape[-1] == 1:
                    dls = dls.sum(-1, keepdim=True)
        if need_os and ctx.has_scale:
            dos = (gk_sum if gk_sum is not None else (grad * k).sum()) / os
        return dx, dc, dls, dos, None, None


def grad_kernel_block(kernel: Kernel, x1: Tensor, x2: Tensor) -> Tensor:
    """Dense ``k(x1, x2)`` in ``x1``'s dtype, differentiable w.r.t. the points and the kernel's parameters: by
    :class:`StationaryBlock` where :func:`grad_kernel_form` recognises the kernel and the points are 2-D and share
    the parameters' dtype and device, else through GPyTorch (:func:`~gpfalkon.backend.kernel_block`). The two
    agree to rounding (``tests/test_stationary_grad.py``)."""
    form = grad_kernel_form(kernel) if x1.dim() == 2 and x2.dim() == 2 else None
    if form is not None:
        kind, ls, os = form
        d = x1.shape[-1]
        if (x1.dtype == x2.dtype == ls.dtype and x1.device == x2.device == ls.device and x2.shape[-1] == d
                and ls.shape[-1] in (1, d) and x1.shape[0] > 0):
            same = x1 is x2 or (x1.shape == x2.shape and torch.equal(x1, x2))
            return StationaryBlock.apply(x1, x2, ls, os, kind, same)
    return kernel_block(kernel, x1, x2)
