"""Shared fixtures: small synthetic problems and dense reference formulas."""
from __future__ import annotations

import os

import gpytorch
import pytest
import torch

# Without a CUDA device, Triton (where installed) runs gpfalkon's fused GPU kernels through its CPU
# interpreter (tests/test_triton_fly.py); it reads this when it is first imported, which is after here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def test_devices() -> list[str]:
    """Devices the device-sensitive tests run on: CPU always, plus ``GPFALKON_TEST_DEVICE``
    (e.g. ``cuda``, ``cuda:1``) or, when that is unset, ``cuda`` if one is present.
    ``GPFALKON_TEST_DEVICE=cpu`` restricts them to the CPU."""
    want = os.environ.get("GPFALKON_TEST_DEVICE")
    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
    devices = ["cpu"]
    if want != "cpu":
        devices.append(want)
    return devices


DEVICES = test_devices()
test_devices.__test__ = False  # a helper, not a test


def require_fused_cpu(what: str) -> None:
    """Skip the calling test where the fused CPU kernel does not run (``GPFALKON_FUSED_CPU=0``, no compiler):
    ``what`` names the premise of the test that only that kernel meets (its kernel values and float64 sums)."""
    from gpfalkon.backend import fused

    ok, why = fused.fused_available()
    if not ok:
        pytest.skip(f"{what}: the fused CPU kernel is unavailable ({why})")


def make_data(n: int = 300, d: int = 3, t: int | None = None, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64) * 2 - 1
    f = torch.sin(3 * x.sum(-1)) + 0.5 * torch.cos(2 * x[:, 0])
    y = f + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    if t is not None:
        y = torch.stack([y * (i + 1) + i for i in range(t)], -1)
    return x.to(dtype), y.to(dtype)


def make_kernel(name: str, d: int, dtype=torch.float64):
    """Kernels with non-trivial hyperparameters (ARD lengthscales, outputscale)."""
    ls = torch.linspace(0.6, 1.2, d).unsqueeze(0)
    if name == "rbf":
        k = gpytorch.kernels.RBFKernel(ard_num_dims=d)
        k.lengthscale = ls
    elif name.startswith("matern"):
        nu = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[name]
        k = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=d)
        k.lengthscale = ls
    elif name == "scale_rbf":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        k.base_kernel.lengthscale = 0.8
        k.outputscale = 1.7
    elif name == "scale_matern52":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d))
        k.base_kernel.lengthscale = ls
        k.outputscale = 0.6
    elif name == "periodic":  # generic path (no fast path)
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel())
        k.base_kernel.lengthscale = 1.0
        k.base_kernel.period_length = 1.5
    elif name == "rbf+linear":  # generic path, additive
        k = gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel()
    else:
        raise ValueError(name)
    return k.to(dtype)


def dense_kernel(kernel, a, b):
    """Dense k(a, b). RBF / Matern (optionally scaled) by the closed form on explicit
    differences (exact at zero distance, unlike any norm expansion); others by GPyTorch."""
    scale = 1.0
    base = kernel
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        scale = kernel.outputscale
        base = kernel.base_kernel
    if type(base) in (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel):
        ls = base.lengthscale
        diff = (a.unsqueeze(-2) - b.unsqueeze(-3)) / ls
        d2 = diff.square().sum(-1)
        if type(base) is gpytorch.kernels.RBFKernel:
            k = torch.exp(-0.5 * d2)
        else:
            # sqrt has an infinite derivative at 0: keep the graph finite there
            r = torch.where(d2 > 0, d2, torch.ones_like(d2)).sqrt() * (d2 > 0)
            nu = base.nu
            if nu == 0.5:
                k = torch.exp(-r)
            elif nu == 1.5:
                z = 3**0.5 * r
                k = (1 + z) * torch.exp(-z)
            else:
                z = 5**0.5 * r
                k = (1 + z + z**2 / 3) * torch.exp(-z)
        return scale * k
    return kernel(a, b).to_dense()


def float32_exact_data(n: int, q: int, m: int):
    """``(x, y, xt, centers)`` in float64 with float32-representable values (3 columns in [-2, 2], test points a
    little beyond): a float32 and a float64 model of them see the same data. ``m`` centers drawn from the rows."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, 3, generator=g, dtype=torch.float64) * 4 - 2).float().double()
    y = (torch.sin(x).sum(1) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).float().double()
    xt = (torch.rand(q, 3, generator=g, dtype=torch.float64) * 4.4 - 2.2).float().double()
    return x, y, xt, x[torch.randperm(n, generator=g)[:m]]


def matern12_near_pairs_case(n: int = 3000, dup: int = 100, near: int = 50):
    """float32 rows, ``dup`` of them duplicated as centers (zero distances) and ``near`` centers 1e-3 from rows, with
    ARD lengthscales four decades apart (large scaled norms: the norm expansion's rounding is large against near
    pairs' distances): ``(kernel, x, centers, exact)``, ``exact`` the float64 Matern-1/2 values by direct
    differences."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    c = torch.cat([x[:dup], x[dup : dup + near] + 1e-3 * torch.randn(near, 3, generator=g)])
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=0.5, ard_num_dims=3))
    k.base_kernel.lengthscale = torch.tensor([[0.01, 1.0, 100.0]])
    k.outputscale = 3.0
    diff = (x.double()[:, None, :] - c.double()[None, :, :]) / k.base_kernel.lengthscale.detach().double()
    return k, x, c, 3.0 * torch.exp(-diff.square().sum(-1).sqrt())


def dense_nystrom(kernel, x, centers, penalty):
    """H, K_nM, K_MM formed densely (test reference only)."""
    knm = dense_kernel(kernel, x, centers)
    kmm = dense_kernel(kernel, centers, centers)
    n = x.shape[0]
    return knm.T @ knm + n * penalty * kmm, knm, kmm


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
