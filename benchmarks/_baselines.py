"""Baseline models shared by the benchmark scripts (not part of the library)."""
from __future__ import annotations

import gpytorch


class SGPR(gpytorch.models.ExactGP):
    """GPyTorch's SGPR: ``InducingPointKernel`` over ``kernel`` + ``ExactGP``, zero mean."""

    def __init__(self, x, y, kernel, inducing, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.InducingPointKernel(
            kernel, inducing_points=inducing, likelihood=likelihood
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
