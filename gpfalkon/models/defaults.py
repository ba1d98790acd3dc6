"""Builders of FalkonGP's defaults (in the manner of BoTorch's ``get_covar_module_*`` helpers).

* :func:`default_kernel`: ``ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))``: the ARD
  Matérn-5/2 that BoTorch and GPyTorch users start from, on the engine's fast path.
* :func:`default_likelihood`: one shared Gaussian noise ``sigma^2 = n lambda`` (FALKON's
  penalty), with an ``exp`` / ``log`` positivity transform so that ``lambda`` spanning
  many decades (1e-9 to 1) is learned on a log scale; a ``MultitaskGaussianLikelihood``
  with one global noise for ``t > 1`` outputs.
"""
from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.kernels import Kernel, MaternKernel, ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood, Likelihood, MultitaskGaussianLikelihood

__all__ = ["check_likelihood", "default_kernel", "default_likelihood", "log_positive"]


def default_kernel(
    ard_num_dims: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> Kernel:
    """``ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=ard_num_dims))`` in ``dtype`` on ``device``."""
    if isinstance(ard_num_dims, bool) or not isinstance(ard_num_dims, int) or ard_num_dims < 1:
        raise ValueError(f"ard_num_dims must be a positive integer, got {ard_num_dims!r}")
    return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=ard_num_dims)).to(dtype=dtype, device=device)


def log_positive() -> Positive:
    """GPyTorch's ``Positive`` constraint through ``exp``/``log``: an optimiser step ``h`` on the raw
    parameter scales the value by ``exp(h)`` at every scale (the default likelihood's noise; ``auto_fit``'s
    ``lengthscale_transform="log"``)."""
    return Positive(transform=torch.exp, inv_transform=torch.log)


def default_likelihood(
    num_outputs: int = 1, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> Likelihood:
    """A Gaussian likelihood with one shared noise (log-scale positivity), ``num_outputs`` tasks."""
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
        raise ValueError(f"num_outputs must be a positive integer, got {num_outputs!r}")
    constraint = log_positive()
    if num_outputs == 1:
        lik: Likelihood = GaussianLikelihood(noise_constraint=constraint)
    else:
        lik = MultitaskGaussianLikelihood(
            num_tasks=num_outputs, rank=0, has_task_noise=False, noise_constraint=constraint
        )
    return lik.to(dtype=dtype, device=device)


def check_likelihood(likelihood: Likelihood, num_outputs: int) -> None:
    """Raise unless ``likelihood`` has the one shared Gaussian noise FALKON's penalty needs."""
    if not isinstance(likelihood, (GaussianLikelihood, MultitaskGaussianLikelihood)):
        raise TypeError(
            f"likelihood must be a GaussianLikelihood or MultitaskGaussianLikelihood, got {type(likelihood).__name__}"
        )
    if num_outputs == 1 and not isinstance(likelihood, GaussianLikelihood):
        raise TypeError("likelihood: single-output targets need a GaussianLikelihood")
    if num_outputs > 1:
        if not isinstance(likelihood, MultitaskGaussianLikelihood):
            raise TypeError(f"likelihood: targets with {num_outputs} outputs need a MultitaskGaussianLikelihood")
        if likelihood.num_tasks != num_outputs:
            raise ValueError(f"likelihood has num_tasks={likelihood.num_tasks} but train_y has {num_outputs} outputs")
        if getattr(likelihood, "has_task_noise", False) or not getattr(likelihood, "has_global_noise", True):
            raise ValueError("likelihood: FALKON needs one shared noise (has_global_noise=True, has_task_noise=False)")
    if likelihood.noise.numel() != 1:
        raise ValueError(f"likelihood must have one (scalar) noise, got shape {tuple(likelihood.noise.shape)}")
