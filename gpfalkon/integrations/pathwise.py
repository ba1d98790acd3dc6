"""Pathwise posterior samples of a :class:`~gpfalkon.integrations.botorch_model.FalkonModel` for BoTorch's
``draw_matheron_paths`` (``PathwiseThompsonSampling``, ``optimize_posterior_samples``, ``get_optimal_samples`` and
the entropy searches built on it).

Matheron's rule with the inducing points of the SGPR/DTC posterior (Wilson et al. 2020, §4): with
``g ~ GP(0, k)`` drawn by random features (BoTorch's :func:`draw_kernel_feature_paths`), ``c`` the constant mean,
``Z`` the centers and ``u`` a draw of ``f(Z)`` from the posterior,

    f(x) = c + g(x) + k(x, Z) K_ZZ^{-1} (u - c - g(Z)),
    u - c ~ N(K_ZZ alpha, L B^{-1} L^T)      (L L^T = K_ZZ, L_B L_B^T = B: docs/math.md §4),

so the path's weight on ``k(x, Z)`` is ``w = alpha + L^{-T} (L_B^{-T} e - L^{-1} g(Z))`` with ``e ~ N(0, I)``. Its
mean is the model's ``c + k(x, Z) alpha`` and its covariance ``k_** - a^T a + c^T c``, the model's own (up to the
random features' approximation of the prior): the DTC posterior needs no ``n x n`` solve, only the ``M x M``
posterior factors the model keeps. Cost per draw ``O(M^2)``, once; a path evaluates at ``q`` points in
``O(q (M + F) d)`` (``F`` random features).

With ``m`` outputs (one kernel, one penalty: the outputs' posteriors are independent and share ``L`` and ``L_B``)
each draw is ``m`` independent paths, ``c_j + g_j(x) + k(x, Z) w_j`` with ``w_j = alpha_j + L^{-T} (L_B^{-T} e_j -
L^{-1} g_j(Z))``, and the outputs are the paths' last batch dimension, as BoTorch lays out a multi-output
``SingleTaskGP``'s (``sample_shape x batch x m x q``; ``MatheronPathModel`` evaluates them at ``X.unsqueeze(-3)``).

Written here because BoTorch's pathwise samplers dispatch on the model class and cover ``ExactGP`` (an ``n x n``
Cholesky factorisation) and variational models, not a model whose posterior is given by its centers and factors.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from botorch.sampling.pathwise.features.maps import KernelEvaluationMap
from botorch.sampling.pathwise.paths import GeneralizedLinearPath
from botorch.sampling.pathwise.posterior_samplers import DrawMatheronPaths, MatheronPath
from botorch.sampling.pathwise.prior_samplers import DrawKernelFeaturePaths, _draw_kernel_feature_paths_fallback
from botorch.sampling.pathwise.update_strategies import GaussianUpdate
from botorch.sampling.pathwise.utils import get_input_transform, get_output_transform
from botorch.utils.context_managers import delattr_ctx
from gpytorch.likelihoods import Likelihood
from torch import Size, Tensor

from .botorch_model import FalkonModel

__all__ = ["ConstantOffset", "ThenCast"]


class ConstantOffset(torch.nn.Module):
    """``x -> c`` for every point of ``x``: the model's constant mean as the prior paths' bias. One output (``c`` a
    scalar): ``(..., q, d) -> (..., q)``; ``m`` outputs (``c`` of shape ``(m,)``): ``(..., q, d) -> (..., m, q)``
    broadcast against ``x``'s batch dimensions (``x`` of shape ``(..., 1, q, d)`` gives ``(..., m, q)``)."""

    constant: Tensor

    def __init__(self, constant: Tensor) -> None:
        super().__init__()
        self.register_buffer("constant", constant.detach().reshape(-1).clone())

    def forward(self, x: Tensor) -> Tensor:
        c = self.constant.to(x)
        if c.numel() == 1:
            return c.reshape(()).expand(x.shape[:-1])
        return c.unsqueeze(-1) * x.new_ones(x.shape[:-1])


class ThenCast(torch.nn.Module):
    """``t -> transform(t)`` (or ``t`` where ``transform`` is ``None``) in ``dtype``: the float64 evaluation of a
    float32 model's paths (:func:`_wide`): its inputs after the model's input transform, its values after the outcome
    untransform, back in the model's dtype."""

    def __init__(self, transform: torch.nn.Module | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.transform = transform
        self.dtype = dtype

    def forward(self, t: Tensor) -> Tensor:
        return (t if self.transform is None else self.transform(t)).to(self.dtype)


def _wide(model: FalkonModel) -> tuple[Any, Tensor, Any]:
    """``(kernel, centers, input transform)`` for the paths, in float64 whatever the model's dtype: the update's
    weights ``K_ZZ^{-1} (u - g(Z))`` are large where ``K_ZZ`` is ill-conditioned, and ``k(x, Z) w`` must cancel
    the prior ``g(x)`` to the posterior's scale; float32 kernel values and random features there added 4-16 % to
    the paths' variance (the factors' pass has the same amplification: docs/math.md §4). For a float32 model the
    kernel is a float64 copy (the paths are a draw at the current hyperparameters) and the inputs are converted
    after the model's input transform."""
    tf = get_input_transform(model)
    centers = model.centers.detach()
    if centers.dtype == torch.float64:
        return model.kernel, centers, tf
    return copy.deepcopy(model.kernel).to(torch.float64), centers.to(torch.float64), ThenCast(tf, torch.float64)


def _output_shape(model: FalkonModel) -> Size:
    """The batch dimension of the outputs: ``()`` for one output, ``(m,)`` for ``m``."""
    return Size() if model.num_outputs == 1 else Size([model.num_outputs])


@DrawKernelFeaturePaths.register(FalkonModel)
def _draw_kernel_feature_paths_falkon(model: FalkonModel, **kwargs: Any) -> GeneralizedLinearPath:
    """Random-feature draws of the prior ``c + g``, ``g ~ GP(0, kernel)`` (BoTorch's fallback for a kernel and a
    mean), on the model's transformed inputs; with ``m`` outputs, ``m`` independent draws each (``sample_shape x m``
    weights)."""
    model.eval()  # the input transform in eval mode, as in posterior()
    kernel, _, tf = _wide(model)
    out = get_output_transform(model)
    dtype = model.centers.dtype
    return _draw_kernel_feature_paths_fallback(
        num_inputs=model.train_inputs[0].shape[-1],
        mean_module=ConstantOffset(model.mean_constant.to(torch.float64)),
        covar_module=kernel,
        input_transform=tf,
        output_transform=out if dtype == torch.float64 else ThenCast(out, dtype),
        **{**kwargs, "sample_shape": Size(kwargs.get("sample_shape", Size())) + _output_shape(model)},
    )


@GaussianUpdate.register(FalkonModel, Likelihood)
def _gaussian_update_falkon(model: FalkonModel, likelihood: Likelihood, *, sample_values: Tensor,
                            **ignore: Any) -> GeneralizedLinearPath:
    """The update path ``k(x, Z) w`` for prior values ``sample_values`` at the centers (``sample_shape x M``, or
    ``sample_shape x m x M`` with ``m`` outputs): ``w = alpha + L^{-T} (L_B^{-T} e - L^{-1} (sample_values - c))``
    per output (module docstring), in float64."""
    factors = model.posterior_factors()
    L, LB = factors.L, factors.LB
    M, shape = L.shape[-1], _output_shape(model)
    if sample_values.shape[-1 - len(shape):] != (*shape, M):
        raise ValueError(f"sample_values must have shape sample_shape x {(*shape, M)} (the prior at the {M} centers"
                         f"{'' if not shape else f' for each of the {shape[0]} outputs'}), got "
                         f"{tuple(sample_values.shape)}")
    alpha = model.alpha.to(L).reshape(M, -1).mT.reshape(*shape, M)  # (m, M), or (M,) for one output
    c = model.mean_constant.to(L).reshape(*shape, 1)
    g = (sample_values.to(L) - c).reshape(-1, M).mT  # M x (S m)
    e = torch.randn(g.shape, dtype=L.dtype, device=L.device)
    inner = torch.linalg.solve_triangular(LB.mT, e, upper=True) - torch.linalg.solve_triangular(L, g, upper=False)
    w = torch.linalg.solve_triangular(L.mT, inner, upper=True).mT.reshape(sample_values.shape) + alpha
    kernel, centers, tf = _wide(model)
    weight = w.to(centers.dtype)
    feature_map = KernelEvaluationMap(kernel=kernel, points=centers, input_transform=tf)
    return GeneralizedLinearPath(feature_map=feature_map, weight=weight)


@DrawMatheronPaths.register(FalkonModel)
def _draw_matheron_paths_falkon(model: FalkonModel, *, sample_shape: Size, prior_sampler: Any,
                                update_strategy: Any) -> MatheronPath:
    """BoTorch's ``draw_matheron_paths`` for a fitted FalkonModel: prior draws by ``prior_sampler``, evaluated at the
    centers, updated by ``update_strategy`` (``gaussian_update``: the inducing-point update of the module docstring);
    the outcome transform undone on the sum, as for ``ExactGP``. With ``m`` outputs the paths' values are
    ``sample_shape x batch x m x q`` (the module docstring)."""
    model.eval()  # as posterior(): a transform in train mode (Normalize) would re-learn its bounds from the paths' X
    model._check_fitted()
    centers = model.centers.detach().to(torch.float64)  # the paths' dtype (_wide)
    with delattr_ctx(model, "outcome_transform"):
        prior_paths = prior_sampler(model=model, sample_shape=sample_shape)
        sample_values = prior_paths.forward(centers)  # forward: the centers are transformed inputs (no transform)
        update_paths = update_strategy(model=model, sample_values=sample_values)
    out = get_output_transform(model)
    dtype = model.centers.dtype
    return MatheronPath(prior_paths=prior_paths, update_paths=update_paths,
                        output_transform=out if dtype == torch.float64 else ThenCast(out, dtype))
