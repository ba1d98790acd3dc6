"""The hand-written kernel block of :mod:`gpfalkon.backend.stationary_grad` against GPyTorch's autograd (values and
gradients w.r.t. the points and every raw parameter), ``gradcheck``, the kernels it leaves to GPyTorch, and the
objectives with it on and off."""
from __future__ import annotations

import gpytorch
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gpfalkon import FalkonGP, settings
from gpfalkon.backend import kernel_block
from gpfalkon.backend.stationary_grad import StationaryBlock, grad_kernel_block, grad_kernel_form
from gpfalkon.objectives import GCV, LOOCV, SGPRBound, StochasticNystromCompReg

from conftest import DEVICES, dense_kernel, make_data

KINDS = {"rbf": None, "matern32": 1.5, "matern52": 2.5}


def _kernel(kind: str, d: int, *, ard: bool = True, scaled: bool = True, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nu = KINDS[kind]
    base = (gpytorch.kernels.RBFKernel(ard_num_dims=d if ard else None) if nu is None
            else gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=d if ard else None))
    base.lengthscale = (0.5 + torch.rand(1, d if ard else 1, generator=g, dtype=torch.float64))
    k = gpytorch.kernels.ScaleKernel(base) if scaled else base
    if scaled:
        k.outputscale = 1.7
    return k.to(dtype)


def _grads(kernel, x, c, upstream, fast: bool):
    """``(K, dK/dx, dK/dc, d/d raw params)`` of ``<K, upstream>``, the block by ours (``fast``) or GPyTorch's."""
    x = x.detach().clone().requires_grad_(True)
    c = c.detach().clone().requires_grad_(True)
    kernel.zero_grad()
    with settings.fast_kernel_grad(fast):
        k = grad_kernel_block(kernel, x, c)
    (k * upstream).sum().backward()
    return k.detach(), x.grad, c.grad, [p.grad.clone() for p in kernel.parameters()]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("ard,scaled", [(True, True), (False, True), (True, False)])
def test_values_and_gradients_are_gpytorchs(kind, ard, scaled):
    d = 4
    x, _ = make_data(37, d)
    c = x[5:16].clone() + 0.01  # near the data, not on it (GPyTorch's square root has no gradient at 0)
    k = _kernel(kind, d, ard=ard, scaled=scaled)
    upstream = torch.randn(37, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = _grads(k, x, c, upstream, True)
    theirs = _grads(k, x, c, upstream, False)
    torch.testing.assert_close(ours[0], dense_kernel(k, x, c).detach(), rtol=1e-12, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b], strict=True):
            torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gradcheck(kind):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ls = (0.5 + torch.rand(1, 3, generator=g, dtype=torch.float64)).requires_grad_(True)
    os = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: StationaryBlock.apply(*a, kind, False), (x, c, ls, os))
    ls1 = ls[:, :1].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: StationaryBlock.apply(*a, None, kind, False), (x, c, ls1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_centers_own_block_has_a_unit_diagonal_and_gpytorchs_gradients(kind):
    """``k(C, C)`` (the objectives' ``K_MM``, centers learned): the distance of a point to itself is exactly 0 (the
    norm expansion's rounding is not), and the gradient w.r.t. the centers is GPyTorch's."""
    x, _ = make_data(12, 3)
    k = _kernel(kind, 3)
    c = x.clone().requires_grad_(True)
    kmm = grad_kernel_block(k, c, c)
    assert kmm.grad_fn is not None and "StationaryBlock" in type(kmm.grad_fn).__name__
    torch.testing.assert_close(kmm.diagonal(), k.outputscale.detach().expand(12), rtol=0, atol=0)
    up = torch.randn(12, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    up = up + up.mT
    (kmm * up).sum().backward()
    ours = c.grad.clone()
    c2 = x.clone().requires_grad_(True)
    with settings.fast_kernel_grad(False):
        (grad_kernel_block(k, c2, c2) * up).sum().backward()
    torch.testing.assert_close(ours, c2.grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_on_each_device_the_gradients_are_cpu_float64_gpytorchs(device, dtype):
    """On every test device (CUDA where present) and dtype: the block and its gradients against GPyTorch's autograd
    in float64 on the CPU."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("GPFALKON_TEST_DEVICE names CUDA but none is available")
    x, _ = make_data(64, 5)
    c = x[:9].clone() + 0.01
    up = torch.randn(64, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for kind in KINDS:
        ref = _grads(_kernel(kind, 5), x, c, up, False)
        k = _kernel(kind, 5, dtype=dtype).to(device)
        ours = _grads(k, x.to(device, dtype), c.to(device, dtype), up.to(device, dtype), True)
        assert ours[0].device.type == torch.device(device).type
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
        for a, b in zip([*ours[:3], *ours[3]], [*ref[:3], *ref[3]], strict=True):
            torch.testing.assert_close(a.cpu().double(), b, **tol)


def test_float32_values_match_gpytorch_to_float32_rounding():
    x, _ = make_data(400, 6, dtype=torch.float32)
    x = x * 50 + 1000  # far from the origin: the centring keeps the norm expansion accurate
    for kind in KINDS:
        k = _kernel(kind, 6, dtype=torch.float32)
        k.base_kernel.lengthscale = k.base_kernel.lengthscale * 40
        ours = grad_kernel_block(k, x, x[:30] + 1.0)
        ref = dense_kernel(k.double(), x.double(), x[:30].double() + 1.0).detach()
        k.float()
        torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)


def test_other_kernels_and_inputs_go_through_gpytorch():
    x, _ = make_data(20, 3)
    c = x[:6]
    others = [
        gpytorch.kernels.MaternKernel(nu=0.5, ard_num_dims=3),
        gpytorch.kernels.PeriodicKernel(),
        gpytorch.kernels.RBFKernel(active_dims=[0, 1]),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])),
                                     batch_shape=torch.Size([2])),
        gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel(),
    ]
    for k in others:
        k = k.double()
        assert grad_kernel_form(k) is None
        out = grad_kernel_block(k, x, c)
        assert torch.equal(out, kernel_block(k, x, c))
    k = _kernel("rbf", 3)
    with settings.fast_kernel_grad(False):
        assert grad_kernel_form(k) is None
    assert grad_kernel_form(k) is not None
    # points of another dtype than the parameters': GPyTorch's promotion, as kernel_block
    out = grad_kernel_block(k, x.float(), c.float())
    assert out.dtype == torch.float32 and torch.equal(out, kernel_block(k, x.float(), c.float()))
    # batched points: GPyTorch
    xb = x.expand(2, 20, 3)
    assert torch.equal(grad_kernel_block(k, xb, c.expand(2, 6, 3)), kernel_block(k, xb, c.expand(2, 6, 3)))


def test_setting_is_validated():
    with pytest.raises(ValueError, match="fast_kernel_grad"):
        settings.fast_kernel_grad(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("objective", [GCV, LOOCV, SGPRBound])
def test_objectives_values_and_gradients_are_those_through_gpytorch(objective, dtype):
    """The exact objectives (float32: the Gram route; float64: the solve route) on and off: the same value and
    gradient w.r.t. every parameter and the centers. In float32 the absolute tolerance is relative to each gradient's
    largest entry: an entry of a centers' gradient that cancels to 0.13 (the gradient's scale 122) differed by
    1.3e-3 between the two routes on an Intel host, against float64's gradient by 0.014 in either."""
    x, y = make_data(300, 4, dtype=dtype)
    out = []
    for fast in (True, False):
        k = _kernel("matern52", 4, dtype=dtype)
        m = FalkonGP(x, y, kernel=k, centers=x[::10].clone(), penalty=1e-4, learn_centers=True)
        with settings.fast_kernel_grad(fast):
            value = objective(m)()
            value.backward()
        out.append([value.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert len(out[0]) == len(out[1]) >= 4  # value, centers, penalty, lengthscale, outputscale
    for a, b in zip(*out, strict=True):
        tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else \
            dict(rtol=2e-3, atol=max(1e-5, 2e-5 * float(b.abs().max())))
        torch.testing.assert_close(a, b, **tol)


def test_stochastic_objective_gradients_are_those_through_gpytorch():
    """The stochastic objective's gradients go through the blockwise gradient pass (and its subsample trace):
    on and off, with the same probes, the same gradients."""
    x, y = make_data(200, 3)
    out = []
    for fast in (True, False):
        k = _kernel("rbf", 3)
        m = FalkonGP(x, y, kernel=k, centers=x[::8].clone(), penalty=1e-4)
        obj = StochasticNystromCompReg(m, num_trace_vectors=4, generator=torch.Generator().manual_seed(5),
                                       ktilde_trace="subsample")
        with settings.fast_kernel_grad(fast):
            value = obj()
            value.backward()
        out.append([value.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@hsettings(max_examples=40, deadline=None, derandomize=True)
@given(kind=st.sampled_from(list(KINDS)), n=st.integers(1, 30), m=st.integers(1, 12), d=st.integers(1, 6),
       scale=st.floats(0.05, 20.0), ard=st.booleans(), seed=st.integers(0, 2**16))
def test_property_matches_gpytorch(kind, n, m, d, scale, ard, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 3
    c = torch.randn(m, d, generator=g, dtype=torch.float64) * 3
    k = _kernel(kind, d, ard=ard, seed=seed)
    k.base_kernel.lengthscale = k.base_kernel.lengthscale * scale
    up = torch.randn(n, m, generator=g, dtype=torch.float64)
    ours, theirs = _grads(k, x, c, up, True), _grads(k, x, c, up, False)
    assert all(bool(torch.isfinite(t).all()) for t in ours[:3])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-10, atol=1e-12)
    for a, b in zip([*ours[1:3], *ours[3]], [*theirs[1:3], *theirs[3]], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
