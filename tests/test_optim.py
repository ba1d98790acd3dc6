"""gpfalkon._optim.Adam against torch.optim.Adam (the reference), its argument checks, and that auto_fit's
learning stage does not import ``torch._dynamo`` (the reason the class exists)."""
from __future__ import annotations

import math
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adam_shared_floors_second_moments_at_their_mean(dtype) -> None:
    """``shared``: each entry's second moment is floored at its tensor's mean. Reference: the update written
    out entry by entry in float64 (Python floats); the tensor not shared stays torch's Adam."""
    ours, a, b = _problem("cpu", dtype)
    ref = [p.detach().clone().requires_grad_() for p in ours]
    lr, (b1, b2), eps = 0.05, (0.9, 0.99), 1e-8
    opt = Adam(ours, lr=lr, betas=(b1, b2), eps=eps, shared=[ours[0]])
    opt_ref = torch.optim.Adam(ref[1:], lr=lr, betas=(b1, b2), eps=eps, foreach=False)  # the scalar c
    w = [float(v) for v in ref[0].detach()]
    m, v = [0.0] * len(w), [0.0] * len(w)
    for t in range(1, 31):
        opt.zero_grad()
        _loss(ours, a, b).backward()
        opt.step()
        opt_ref.zero_grad()
        ref[0].grad = None
        _loss(ref, a, b).backward()
        opt_ref.step()
        g = [float(x) for x in ref[0].grad]
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g, strict=True)]
        floor = sum(v) / len(v)
        w = [wi - lr / (1 - b1**t) * mi / (math.sqrt(max(vi, floor) / (1 - b2**t)) + eps)
             for wi, mi, vi in zip(w, m, v, strict=True)]
        with torch.no_grad():
            ref[0].copy_(torch.tensor(w, dtype=dtype))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours[0].detach(), ref[0].detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ours[1].detach(), ref[1].detach(), rtol=tol, atol=tol)


def test_adam_shared_moves_in_proportion_to_constant_gradients() -> None:
    """Closed form: under a constant gradient ``g`` (bias-corrected moments ``g`` and ``g^2`` exactly, eps 0)
    a shared tensor moves by ``lr g / max(|g|, rms(g))`` per step, Adam's own update by ``lr sign(g)``."""
    g = torch.tensor([4.0, -1.0, 0.01, 0.0], dtype=torch.float64)
    p, q = torch.zeros(4, dtype=torch.float64, requires_grad=True), torch.zeros(4, dtype=torch.float64,
                                                                                requires_grad=True)
    opt, plain = Adam([p], lr=0.1, eps=0.0, shared=[p]), Adam([q], lr=0.1, eps=1e-300)
    for _ in range(7):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
    rms = g.square().mean().sqrt()  # 2.06: the entries 4 and -1 step by lr and lr / 2.06, 0.01 by lr / 206
    torch.testing.assert_close(p.detach(), -7 * 0.1 * g / torch.maximum(g.abs(), rms), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(q.detach(), -7 * 0.1 * torch.sign(g), rtol=1e-12, atol=1e-15)


def test_adam_rejects_shared_tensors_outside_params() -> None:
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="shared"):
        Adam([p], lr=0.1, shared=[torch.zeros(2, requires_grad=True)])


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
    process: torch.optim's first use), in a fresh interpreter. The budget is ample (the call ends in under 2 s
    here, its learning stopped by patience): with 3 s, a loaded 16-core host spent the learning share before the
    first step."""
    code = (
        "import sys, torch, gpfalkon\n"
        "assert 'torch._dynamo' not in sys.modules, 'imported by gpfalkon itself'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.rand(600, 3, generator=g); y = torch.sin(6 * x[:, 0]) + 0.1 * torch.randn(600, generator=g)\n"
        "m = gpfalkon.auto_fit(x, y, budget=30, hyper_rows=200, hyper_centers=40, min_centers=60, seed=0)\n"
        "assert sum(r['steps'] for r in m.auto_report.learn) > 0, m.auto_report.learn\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo"
