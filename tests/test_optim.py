"""gpfalkon._optim.Adam against torch.optim.Adam (the reference), its argument checks, and that auto_fit's
learning stage does not import ``torch._dynamo`` (the reason the class exists)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpfalkon._optim import Adam

from conftest import DEVICES


def _problem(device: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(20, 5, generator=g, dtype=dtype).to(device)
    b = torch.randn(20, generator=g, dtype=dtype).to(device)
    params = [torch.randn(5, generator=g, dtype=dtype).to(device).requires_grad_(),
              torch.randn((), generator=g, dtype=dtype).to(device).requires_grad_(),
              torch.randn(3, generator=g, dtype=dtype).to(device).requires_grad_()]  # never gets a gradient
    return params, a, b


def _loss(params: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w, c, _ = params
    r = a @ w + c - b
    return (r.square().mean() + torch.sin(w).sum() * c).square()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lr,betas,eps", [(0.1, (0.9, 0.999), 1e-8), (0.03, (0.5, 0.9), 1e-4), (1.0, (0.0, 0.0), 0.0)])
def test_adam_matches_torch(device, dtype, lr, betas, eps) -> None:
    ours, a, b = _problem(device, dtype)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = Adam(ours, lr=lr, betas=betas, eps=eps)
    opt_ref = torch.optim.Adam(ref, lr=lr, betas=betas, eps=eps, foreach=False)
    for _ in range(40):
        for o, ps in ((opt, ours), (opt_ref, ref)):
            o.zero_grad()
            _loss(ps, a, b).backward()
            o.step()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol)
    assert ours[2].grad is None and torch.equal(ours[2].detach(), ref[2].detach())  # no gradient: untouched
    assert opt.steps == [40, 40, 0]
    opt.zero_grad()
    assert all(p.grad is None for p in ours)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=0.0), "lr"), (dict(lr=float("nan")), "lr"), (dict(lr=True), "lr"),
    (dict(betas=(0.9, 1.0)), "betas"), (dict(betas=(0.9,)), "betas"), (dict(eps=-1.0), "eps"),
])
def test_adam_rejects_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Adam([torch.zeros(2, requires_grad=True)], **kwargs)
    with pytest.raises(TypeError, match="params"):
        Adam([[0.0, 1.0]])  # type: ignore[list-item]


def test_adam_rejects_sparse_gradients() -> None:
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True)
    with pytest.raises(RuntimeError, match="sparse"):
        Adam([p], lr=0.1).step()


def test_auto_fit_does_not_import_dynamo() -> None:
    """auto_fit's learning stage takes its Adam steps without importing torch._dynamo (about 1 s in a fresh
    process: torch.optim's first use), in a fresh interpreter."""
    code = (
        "import sys, torch, gpfalkon\n"
        "assert 'torch._dynamo' not in sys.modules, 'imported by gpfalkon itself'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.rand(600, 3, generator=g); y = torch.sin(6 * x[:, 0]) + 0.1 * torch.randn(600, generator=g)\n"
        "m = gpfalkon.auto_fit(x, y, budget=3, hyper_rows=200, hyper_centers=40, min_centers=60, seed=0)\n"
        "assert sum(r['steps'] for r in m.auto_report.learn) > 0, m.auto_report.learn\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo"
