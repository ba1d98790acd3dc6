"""Every device-sensitive path on every test device (conftest.DEVICES: CPU, plus CUDA when
present or ``GPFALKON_TEST_DEVICE`` names one), against float64 dense references on the CPU.

Covers: the backend (products, stored and on the fly, fast and generic kernels), the
preconditioner (built in place, and its retry), the operator (matmul, FALKON solve and its
gradients), FalkonGP (fit, posterior mean and variance), the objectives (exact and stochastic,
with gradients), center selection (uniform and leverage), the BoTorch posterior, its fantasies and pathwise
samples, and a float32 model's variance factors (float64 kernel values from float32 rows).
"""
from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

import gpfalkon
from gpfalkon import FalkonGP, NystromKRROperator
from gpfalkon.backend import KernelEngine

from conftest import DEVICES, dense_kernel, float32_exact_data, make_data, make_kernel


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.fixture(params=DEVICES)
def device(request):
    dev = torch.device(request.param)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPFALKON_TEST_DEVICE names CUDA but none is available")
    return dev


@pytest.mark.parametrize("kname", ["scale_matern52", "rbf", "periodic"])
@pytest.mark.parametrize("store", [True, False])
def test_backend_products(device, kname, store):
    x, _ = make_data(300)
    k = make_kernel(kname, x.shape[1])
    c = x[:25].clone()
    u = torch.randn(25, 3, dtype=torch.float64)
    v = torch.randn(300, 3, dtype=torch.float64)
    knm = dense_kernel(k, x, c).detach()
    ref = knm.T @ (knm @ u + v)
    xd, cd, ud, vd = _on(device, x, c, u, v)
    e = KernelEngine(k.to(device), xd, cd, store=store, block_rows=64)
    out = e.kmn_k(ud, vd)
    assert out.device == xd.device
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(e.k_matmul(ud).cpu(), knm @ u, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(e.column_sq_norms().cpu(), knm.square().sum(0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("wide", [True, False])
def test_float32_store_products_wide_and_flushed(device, wide):
    """A stored float32 ``K_nM`` (20,000 rows): on the CPU with ``settings.wide_products`` (the default) the CG
    products ``K^T (K u + v)`` are those of the stored values in float64 (the fused kernel); elsewhere (a GPU, or
    the setting off) float32 products whose sums over rows are flushed to float64 every ``FLUSH_ROWS`` rows (on a
    GPU the store is one block: before session 52 its 20,000-row sums ran in float32 whole). Reference: the
    engine's own stored values, multiplied in float64."""
    wide_here = wide and device.type == "cpu"
    if wide_here:
        from conftest import require_fused_cpu

        require_fused_cpu("the CPU's wide products")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20_000, 3, generator=g)
    c = x[:64].clone()
    u = torch.randn(64, 2, generator=g, dtype=torch.float64) * 1e3  # large, cancelling entries
    v = torch.randn(20_000, 2, generator=g, dtype=torch.float64)
    k = gpytorch.kernels.RBFKernel()
    k.lengthscale = 0.7
    xd, cd, ud, vd = _on(device, x, c, u, v)
    with gpfalkon.settings.wide_products(wide):
        e = KernelEngine(k.to(device), xd, cd, store=True)
    assert e.wide == wide_here
    e.kmn_k(ud, vd)  # the first pass fills the store
    knm = e._k.double()
    ref = knm.T @ (knm @ ud + vd)
    err = float((e.kmn_k(ud, vd) - ref).abs().max() / ref.abs().max())
    if wide_here:
        assert err < 1e-12, err
    else:
        # float32 products: u rounded to float32 and the dot products over M in float32 (2^-24 relative each)
        assert 1e-12 < err < 1e-5, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fixed_point_store_products(device, dtype):
    """An int16 store (gpfalkon.settings.store_format) on the device: the first and later products are those of
    the rounded matrix, which is within half a unit of each row's scale of the dense kernel."""
    x, _ = make_data(300)
    k = make_kernel("scale_matern52", x.shape[1])
    c = x[:25].clone()
    u = torch.randn(25, 2, dtype=torch.float64)
    knm = dense_kernel(k, x, c).detach()
    xd, cd, ud = _on(device, x.to(dtype), c.to(dtype), u.to(dtype))
    with gpfalkon.settings.store_format("int16"):
        e = KernelEngine(k.to(device=device, dtype=dtype), xd, cd, store=True)
    outs = [e.kmn_k(ud).cpu() for _ in range(2)]
    assert e._k.dtype == torch.int16 and e._k.device == xd.device
    held = e.materialize().double().cpu()
    bound = knm.abs().amax(1, keepdim=True) / 32767 * 0.5
    eps = 1e-12 if dtype == torch.float64 else 1e-6
    assert bool(((held - knm).abs() <= bound * (1 + 1e-3) + eps).all())
    want = held.T @ (held @ u)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for out in outs:
        torch.testing.assert_close(out, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_operator_solve_and_gradients(device):
    x, y = make_data(200)
    k = make_kernel("scale_matern52", x.shape[1])
    c = x[:20].clone()
    lam = torch.tensor(1e-3, dtype=torch.float64)
    knm = dense_kernel(k, x, c).detach()
    kmm = dense_kernel(k, c, c).detach()
    h = knm.T @ knm + 200 * lam * kmm
    b = knm.T @ y.unsqueeze(-1)
    kd = k.to(device)
    xd, cd, _yd = _on(device, x, c, y)
    lamd = lam.to(device).requires_grad_(True)
    op = NystromKRROperator(xd, cd, lamd, kernel=kd, tol=1e-12, max_iter=500)
    torch.testing.assert_close((op @ b.to(device)).cpu(), h @ b, rtol=1e-9, atol=1e-9)
    sol = op.solve(b.to(device))
    torch.testing.assert_close(sol.detach().cpu(), torch.linalg.solve(h, b), rtol=1e-7, atol=1e-9)
    # d/dlambda of b^T H^{-1} b = -n b^T H^{-1} K_MM H^{-1} b
    (b.to(device) * sol).sum().backward()
    w = torch.linalg.solve(h, b)
    ref = -200 * (w * (kmm @ w)).sum()
    torch.testing.assert_close(lamd.grad.cpu(), ref, rtol=1e-6, atol=1e-9)


def _dense_posterior(k, x, y, c, lam, xt):
    """Dense SGPR/DTC posterior (docs/math.md §4) with sigma^2 = n lambda, float64 CPU."""
    n = x.shape[0]
    knm, kmm, ktm = dense_kernel(k, x, c), dense_kernel(k, c, c), dense_kernel(k, xt, c)
    h = knm.T @ knm + n * lam * kmm
    mean = ktm @ torch.linalg.solve(h, knm.T @ y)
    ktt = torch.diagonal(dense_kernel(k, xt, xt))
    var = (
        ktt
        - (ktm * torch.linalg.solve(kmm, ktm.T).T).sum(-1)
        + n * lam * (ktm * torch.linalg.solve(h, ktm.T).T).sum(-1)
    )
    return mean.detach(), var.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_falkon_gp_fit_and_posterior(device, dtype):
    x, y = make_data(250)
    xt, _ = make_data(40, seed=3)
    k = make_kernel("scale_rbf", x.shape[1])
    c = x[::8][:30].clone()
    ref_mean, ref_var = _dense_posterior(k, x, y, c, 1e-3, xt)
    xd, yd = x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    kd = make_kernel("scale_rbf", x.shape[1]).to(device=device, dtype=dtype)
    m = FalkonGP(xd, yd, kernel=kd, centers=c.to(device=device, dtype=dtype), penalty=1e-3,
                 tol=1e-12 if dtype == torch.float64 else 1e-6, max_iter=500).fit()
    m.eval()
    with torch.no_grad():
        pred = m(xt.to(device=device, dtype=dtype))
    assert pred.mean.device == xd.device
    tol = 1e-6 if dtype == torch.float64 else 5e-3
    torch.testing.assert_close(pred.mean.double().cpu(), ref_mean, rtol=tol, atol=tol)
    torch.testing.assert_close(pred.variance.double().cpu(), ref_var, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_approximate_variance_factors(device, dtype):
    """gpfalkon.settings.variance_factors("approximate") on the device: the latent variances are the dense SGPR
    ones with ``K_Mn K_nM`` replaced by ``(n/M) K_MM D^2 K_MM`` (centers with weights D; docs/math.md §4.2)."""
    x, y = make_data(250)
    xt, _ = make_data(30, seed=3)
    k = make_kernel("scale_rbf", x.shape[1])
    c = x[::8][:30].clone()
    d = torch.linspace(0.7, 1.4, 30, dtype=torch.float64)
    n, m, v = 250, 30, 250 * 1e-3
    kmm, ksm = dense_kernel(k, c, c).detach(), dense_kernel(k, xt, c).detach()
    h = (n / m) * kmm @ torch.diag(d**2) @ kmm + v * kmm
    want = (torch.diagonal(dense_kernel(k, xt, xt)).detach() - (ksm * torch.linalg.solve(kmm, ksm.T).T).sum(-1)
            + v * (ksm * torch.linalg.solve(h, ksm.T).T).sum(-1))
    xd, yd = x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    kd = make_kernel("scale_rbf", x.shape[1]).to(device=device, dtype=dtype)
    model = FalkonGP(xd, yd, kernel=kd, centers=c.to(device=device, dtype=dtype), center_weights=d.to(device),
                     penalty=1e-3).fit()
    model.eval()
    with torch.no_grad(), gpfalkon.settings.variance_factors("approximate"):
        got = model(xt.to(device=device, dtype=dtype)).variance
    assert got.device == xd.device and model._fast_factors is not None and model._factors is None
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * float(want.max()))


def _dense_objective(name, k, x, y, c, lam):
    """The objectives of docs/math.md §5.2 from dense n x n matrices (test reference only)."""
    n = x.shape[0]
    knm, kmm = dense_kernel(k, x, c), dense_kernel(k, c, c)
    kt = knm @ torch.linalg.solve(kmm, knm.T)
    tr_knn = torch.diagonal(dense_kernel(k, x, x)).sum()
    v = ((n - 1) if name == "GCV" else n) * lam
    eye = torch.eye(n, dtype=x.dtype)
    s = kt @ torch.linalg.inv(kt + v * eye)
    fit = y @ (eye - s) @ y
    if name == "NystromCompReg":
        return torch.trace(s) + fit + (tr_knn - torch.trace(kt)) / v * fit / n
    if name == "GCV":
        r = (eye - s) @ y
        return (r @ r / n) / (1 - torch.trace(s) / n) ** 2
    logdet = torch.linalg.slogdet(kt + v * eye)[1]
    quad = y @ torch.linalg.solve(kt + v * eye, y)
    return 0.5 * (logdet + quad + (tr_knn - torch.trace(kt)) / v) + 0.5 * n * torch.log(torch.tensor(2 * torch.pi))


@pytest.mark.parametrize("name", ["NystromCompReg", "SGPRBound", "GCV"])
def test_exact_objectives(device, name):
    x, y = make_data(150)
    c = x[::10].clone()
    k_ref = make_kernel("scale_matern52", x.shape[1])
    ref = _dense_objective(name, k_ref, x, y, c, 1e-3)
    ref.backward()
    g_ref = [p.grad.clone() for p in k_ref.parameters()]
    kd = make_kernel("scale_matern52", x.shape[1]).to(device)
    m = FalkonGP(*_on(device, x, y), kernel=kd, centers=c.to(device), penalty=1e-3)
    v = getattr(gpfalkon.objectives, name)(m)()
    v.backward()
    assert v.device == x.to(device).device
    torch.testing.assert_close(v.detach().cpu(), ref.detach(), rtol=1e-6, atol=1e-6)
    for p, g in zip(m.kernel.parameters(), g_ref, strict=False):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-6)


def test_stochastic_objective_with_identity_trace_vectors(device):
    """With Z = sqrt(n) I the stochastic objective is exact: equal to NystromCompReg."""
    x, y = make_data(60)
    k = make_kernel("scale_rbf", x.shape[1])
    m = FalkonGP(*_on(device, x, y), kernel=k.to(device), num_centers=10, penalty=1e-3)
    z = (60**0.5) * torch.eye(60, dtype=torch.float64, device=device)
    sto = gpfalkon.objectives.StochasticNystromCompReg(
        m, trace_vectors=z, ktilde_trace="subsample", subsample_size=60, cg_tol=1e-12, cg_iterations=500
    )
    exact = gpfalkon.objectives.NystromCompReg(m)
    torch.testing.assert_close(sto().detach().cpu(), exact().detach().cpu(), rtol=1e-6, atol=1e-8)


def test_center_selection(device):
    x, y = make_data(400)
    k = make_kernel("scale_rbf", x.shape[1])
    xd = x.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    sel = gpfalkon.uniform_centers(xd, 30, generator=g)
    assert sel.centers.device == xd.device and torch.equal(sel.centers.cpu(), x[sel.indices.cpu()])
    kd = make_kernel("scale_rbf", x.shape[1]).to(device)  # (Module.to moves in place: k stays on the CPU)
    scores = gpfalkon.approximate_leverage_scores(
        xd, kd, 1e-3, generator=torch.Generator(device=device).manual_seed(0)
    )
    assert scores.device == xd.device
    # exact ridge leverage scores on the CPU: most estimates within a factor 3
    knn = dense_kernel(k, x, x).detach()
    exact = torch.diagonal(knn @ torch.linalg.inv(knn + 400 * 1e-3 * torch.eye(400, dtype=torch.float64)))
    ratio = scores.cpu() / exact
    assert float(((ratio > 1 / 3) & (ratio < 3)).double().mean()) > 0.9
    m = FalkonGP(xd, y.to(device), kernel=kd, num_centers=30, penalty=1e-3, center_selection="leverage")
    assert m.centers.device == xd.device and m.center_weights.device == xd.device


def test_botorch_posterior(device):
    from gpfalkon.botorch import FalkonModel

    x, y = make_data(120)
    xt, _ = make_data(7, seed=5)
    k = make_kernel("scale_rbf", x.shape[1])
    c = x[::6].clone()
    ref_mean, ref_var = _dense_posterior(k, x, y, c, 1e-3, xt)
    kd = make_kernel("scale_rbf", x.shape[1]).to(device)
    model = FalkonModel(*_on(device, x, y.unsqueeze(-1)), kernel=kd, centers=c.to(device), penalty=1e-3,
                        tol=1e-12, max_iter=500, outcome_transform=None)
    post = model.posterior(xt.to(device))
    assert post.mean.device == x.to(device).device
    torch.testing.assert_close(post.mean.detach().squeeze(-1).cpu(), ref_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(post.variance.detach().squeeze(-1).cpu(), ref_var, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ host rows on the device
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_source_blocks_yield_every_block_on_the_device(device, depth):
    from gpfalkon.backend import TensorRows, row_blocks, source_blocks
    from gpfalkon.backend.prefetch import overlapped

    x = torch.randn(203, 5, dtype=torch.float64)
    src = TensorRows(x, device=device)
    assert overlapped(src) == (device.type == "cuda")
    ranges = list(row_blocks(203, 17))
    seen = []
    for s, e, xb in source_blocks(src, ranges, depth=depth):
        assert xb.device == src.device and xb.device.type == device.type and xb.shape == (e - s, 5)
        # used on the consumer's stream right away, then dropped: the next blocks must not overwrite it
        seen.append((s, e, (xb * 2).cpu()))
    assert [(s, e) for s, e, _ in seen] == ranges
    for s, e, got in seen:
        torch.testing.assert_close(got, 2 * x[s:e], rtol=0, atol=0)
    # a consumer that stops early leaves nothing behind: the next pass sees every block again
    for i, _ in enumerate(source_blocks(src, ranges, depth=depth)):
        if i == 2:
            break
    assert sum(e - s for s, e, _ in source_blocks(src, ranges, depth=depth)) == 203
    with pytest.raises(ValueError, match="depth"):
        next(source_blocks(src, ranges, depth=0))


@pytest.mark.parametrize("store", [True, False])
def test_falkon_gp_on_host_rows_streamed_to_the_device_equals_on_device(tmp_path, device, store):
    """Host rows (an in-memory tensor and a .npy file) streamed to the device block by block give
    the fit, the posterior and the objective gradients of the same rows held on the device."""
    import numpy as np

    from gpfalkon.backend import NpyRows, TensorRows
    from gpfalkon.objectives import SGPRBound

    x, y = make_data(300)
    xt, _ = make_data(20, seed=4)
    np.save(tmp_path / "x.npy", x.numpy())
    yd = y.to(device)
    fits = []
    for train_x in (x.to(device), TensorRows(x, device=device), NpyRows(tmp_path / "x.npy", device=device)):
        m = FalkonGP(train_x, yd, kernel=make_kernel("scale_matern52", 3).to(device), num_centers=30,
                     penalty=1e-4, seed=1, tol=1e-12, max_iter=500, store_kernel=store, block_rows=64).fit()
        fits.append(m)
    ref = fits[0]
    for m in fits[1:]:
        assert torch.equal(m.centers.cpu(), ref.centers.cpu())
        torch.testing.assert_close(m.alpha.cpu(), ref.alpha.cpu(), rtol=1e-10, atol=1e-10)
        m.eval(), ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(m(xt.to(device)).mean.cpu(), ref(xt.to(device)).mean.cpu(),
                                       rtol=1e-10, atol=1e-10)
    grads = []
    for m in (ref, fits[1]):
        m.train()
        m.zero_grad()
        SGPRBound(m, block_rows=50)().backward()
        grads.append({k: p.grad.cpu().clone() for k, p in m.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-9, atol=1e-10)


def test_float32_kernel_blocks_ignore_torchs_tf32_flag(device):
    """The engine's float32 products are IEEE float32 whatever torch's global TF32 flag says, and
    the flag is restored; ``gpfalkon.settings.tf32(True)`` lets a CUDA GPU use TF32 (a visibly
    larger error on Ampere or later)."""
    x, _ = make_data(512, d=8)
    x = x + 3.0  # far from the origin: the distance expansion cancels
    c = x[::16].clone()
    k = make_kernel("rbf", 8)
    ref = dense_kernel(k, x, c).detach()
    xd, cd = x.to(device, torch.float32), c.to(device, torch.float32)
    kd = make_kernel("rbf", 8, torch.float32).to(device)
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    try:
        flags.allow_tf32 = True
        got = KernelEngine(kd, xd, cd, store=True).materialize().double().cpu()
        assert flags.allow_tf32 is True
        err = float((got - ref).abs().max())
        assert err < 1e-5, err
        with gpfalkon.settings.tf32(True):
            got32 = KernelEngine(kd, xd, cd, store=True).materialize().double().cpu()
        err32 = float((got32 - ref).abs().max())
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
            assert err32 > 10 * err, (err32, err)
        else:
            assert err32 < 1e-5
    finally:
        flags.allow_tf32 = before
    with pytest.raises(ValueError, match="tf32"):
        gpfalkon.settings.tf32(1)


def test_preconditioner_in_place_and_its_retry_on_the_device(device, monkeypatch):
    """``from_kernel_matrix`` (``A`` factored in the memory of ``T T^T / M``) gives the preconditioner of a kept
    factor on the device, equal to the CPU float64 one; a forced failure of ``A``'s first try recomputes
    ``T T^T / M`` from ``T`` there (``upper_gram(out=)`` on the device) and equals the copying path."""
    import gpfalkon.linalg.cholesky as cm
    from gpfalkon import FalkonPreconditioner, JitterWarning

    x, _ = make_data(300, d=3)
    c = x[::5].clone()
    kmm = dense_kernel(make_kernel("rbf", 3), c, c).detach()
    ref = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-4, 300)
    got = FalkonPreconditioner.from_kernel_matrix(kmm.to(device), 1e-4, 300)
    assert got.chol_a.device.type == device.type
    torch.testing.assert_close(got.chol_a.cpu(), ref.chol_a, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.chol_t.cpu(), ref.chol_t, rtol=1e-9, atol=1e-12)
    real = torch.linalg.cholesky_ex
    armed = {"left": 0}

    def flaky(a, *args, **kw):  # the armed call fails as a non-PD matrix would, after overwriting its input
        out = real(a, *args, **kw)
        if armed["left"] > 0:
            armed["left"] -= 1
            out[1].fill_(1)
        return out

    monkeypatch.setattr(cm.torch.linalg, "cholesky_ex", flaky)
    results = []
    for overwrite in (False, True):
        factor = FalkonPreconditioner.factor_kernel_matrix(kmm.to(device))
        armed["left"] = 1
        with pytest.warns(JitterWarning):
            results.append(FalkonPreconditioner.from_factor(factor, 1e-4, 300, overwrite_factor=overwrite))
    exact = device.type == "cpu"  # (a GPU's matmul need not be bitwise reproducible)
    torch.testing.assert_close(results[1].chol_a, results[0].chol_a, rtol=0 if exact else 1e-12,
                               atol=0 if exact else 1e-14)


def test_available_memory_counts_the_caching_allocators_free_blocks(device):
    """On CUDA the memory available to a new engine is the driver's free memory plus what torch's caching
    allocator holds unused (a previous fit's freed tensors); on the host ``MemAvailable``."""
    from gpfalkon.backend import blocks

    if device.type != "cuda":
        assert blocks.available_memory(device) == blocks.available_memory()
        return
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB, then freed into the cache
    del x
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cached >= 256 * 2**20
    # other processes on the GPU (pytest-xdist's workers) move the driver's free memory between two reads (by 2 MiB
    # once on an H200): the two reads agree in one of a few tries
    seen = []
    for _ in range(5):
        got = blocks.available_memory(device)
        free = torch.cuda.mem_get_info(device)[0]
        seen.append((got, free + cached))
        if got == free + cached:
            break
    assert seen[-1][0] == seen[-1][1], seen


def test_a_fitted_float32_state_loads_fitted_across_devices_and_tf32(device):
    """The kernel probe recorded by ``fit()`` is computed on float64 points (no float32 or TF32 rounding), so a
    float32 state saved on the CPU loads fitted into a model on the device while torch's global TF32 flag is on,
    predicts what the CPU model predicts, and ``.to()`` between devices keeps the fit."""
    import warnings

    x, y = make_data(300, d=8)
    x = x + 3.0  # far from the origin: a TF32 distance expansion would move the kernel's values by ~1e-3
    x32, y32 = x.float(), y.float()
    cpu = FalkonGP(x32, y32, kernel=make_kernel("scale_rbf", 8, torch.float32), num_centers=30, penalty=1e-3,
                   seed=0).fit().eval()
    p = torch.cat([cpu.centers[:3], cpu.centers[:1] + 1.0]).double()
    torch.testing.assert_close(cpu.kernel_probe, cpu.kernel(p, p).to_dense().reshape(-1), rtol=1e-12, atol=1e-14)
    xt = x32[:5] + 0.01
    ref = cpu(xt).mean.detach().double()
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    try:
        flags.allow_tf32 = True
        there = FalkonGP(x32.to(device), y32.to(device), kernel=make_kernel("scale_rbf", 8, torch.float32).to(device),
                         num_centers=30, penalty=1e-3, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            there.load_state_dict(cpu.state_dict())
            moved = FalkonGP(x32, y32, kernel=make_kernel("scale_rbf", 8, torch.float32), num_centers=30,
                             penalty=1e-3, seed=0).fit().to(device)
        assert bool(there.fitted) and bool(moved.fitted)
        torch.testing.assert_close(there.eval()(xt.to(device)).mean.detach().double().cpu(), ref, rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(moved.eval()(xt.to(device)).mean.detach().double().cpu(), ref, rtol=1e-4,
                                   atol=1e-4)
    finally:
        flags.allow_tf32 = before


def test_botorch_output_indices_noise_and_model_list_conditioning(device):
    """FalkonModel's ``posterior(output_indices=, observation_noise=<tensor>)`` and ``ModelListGP``'s
    conditioning (``get_fantasy_model``) on the device equal the same calls on the CPU."""
    from botorch.models import ModelListGP

    from gpfalkon.botorch import FalkonModel

    g = torch.Generator().manual_seed(0)
    X = torch.rand(120, 2, generator=g, dtype=torch.float64)
    Y = torch.stack([torch.sin(4 * X).sum(-1), 3 * X[:, 0] + 2], -1)
    Xs = torch.rand(3, 4, 2, generator=g, dtype=torch.float64)
    Xn = torch.rand(3, 2, generator=g, dtype=torch.float64)
    Yn = torch.stack([torch.sin(4 * Xn).sum(-1), 3 * Xn[:, 0] + 2], -1)
    noise = torch.tensor([0.1, 0.3], dtype=torch.float64).expand(3, 4, 2)
    res = []
    centers = X[torch.randperm(120, generator=g)[:20]]  # given: a seed draws different centers on each device
    for dev in (torch.device("cpu"), device):
        kw = dict(centers=centers.to(dev), tol=1e-12, max_iter=500)
        m = FalkonModel(X.to(dev), Y.to(dev), **kw)
        post = m.posterior(Xs.to(dev), output_indices=[1], observation_noise=noise.to(dev))
        ma = FalkonModel(X.to(dev), Y[:, :1].to(dev), **kw)
        mb = FalkonModel(X.to(dev), Y[:, 1:].to(dev), **kw)
        cond = ModelListGP(ma, mb).condition_on_observations([Xn.to(dev), Xn.to(dev)], Yn.to(dev))
        assert post.mean.device.type == dev.type
        res.append((post.mean.detach().cpu(), post.variance.detach().cpu(),
                    cond.posterior(Xs[0].to(dev)).mean.detach().cpu()))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10)


def test_float32_variances_where_k_mm_is_numerically_singular_on_the_device(device):
    """The variance factors' float64 kernel values from float32 rows (``NystromKRROperator.float64_engine``) on the
    device: a float32 model with a long lengthscale (``K_MM`` singular in float32) has the float64 CPU model's
    variances to ~1e-7."""
    x, y, xt, centers = float32_exact_data(1500, 50, 150)
    out = []
    for dev, dtype in ((torch.device("cpu"), torch.float64), (device, torch.float32)):
        k = gpytorch.kernels.RBFKernel().to(device=dev, dtype=dtype)
        k.lengthscale = torch.tensor(10.0, dtype=dtype, device=dev)
        m = FalkonGP(x.to(dev, dtype), y.to(dev, dtype), kernel=k, centers=centers.to(dev, dtype), penalty=1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CG's float32 advice at this penalty
            m.fit()
        m.eval()
        with torch.no_grad():
            v = m(xt.to(dev, dtype)).variance
        assert v.device.type == dev.type
        out.append(v.double().cpu())
    rel = float(((out[1] - out[0]).abs() / out[0]).max())
    assert rel < 1e-5, rel


@pytest.mark.parametrize("m", [1, 2])
def test_matheron_paths_and_fantasies_on_the_device(device, m):
    """BoTorch's pathwise samples (``gpfalkon.integrations.pathwise``) of a FalkonModel on the device have its
    posterior mean and variance (4,000 paths), and its fantasy model's posterior equals the same fantasies on the
    CPU."""
    from botorch.sampling.pathwise import draw_matheron_paths

    from gpfalkon.botorch import FalkonModel

    g = torch.Generator().manual_seed(0)
    X = torch.rand(150, 2, generator=g, dtype=torch.float64)
    Y = torch.stack([torch.sin(4 * X).sum(-1), 3 * X[:, 0] + 2], -1)[:, :m]
    Xt = torch.rand(4, 2, generator=g, dtype=torch.float64)
    Xf = torch.rand(3, 2, generator=g, dtype=torch.float64)
    Yf = torch.randn(5, 3, m, generator=g, dtype=torch.float64)
    fant = []
    centers = X[torch.randperm(150, generator=g)[:40]]  # given: a seed draws different centers on each device
    for dev in (torch.device("cpu"), device):
        model = FalkonModel(X.to(dev), Y.to(dev), centers=centers.to(dev), tol=1e-12, max_iter=500)
        fant.append(model.condition_on_observations(Xf.to(dev), Yf.to(dev)).posterior(Xt.to(dev)).mean.cpu())
    torch.manual_seed(0)
    paths = draw_matheron_paths(model, sample_shape=torch.Size([4000]))
    with torch.no_grad():
        v = paths(Xt.to(device))
        post = model.posterior(Xt.to(device))
        mean, var = post.mean.cpu(), post.variance.cpu()
    assert v.device.type == device.type and v.shape == ((4000, 4) if m == 1 else (4000, m, 4))
    v = v.cpu().reshape(4000, m, 4)
    for j in range(m):
        sd = var[:, j].sqrt()
        torch.testing.assert_close(v[:, j].mean(0), mean[:, j], rtol=0, atol=float(0.1 * sd.max()))
        ratio = v[:, j].var(0) / var[:, j]
        assert bool(((ratio > 0.8) & (ratio < 1.2)).all()), ratio
    torch.testing.assert_close(fant[1], fant[0], rtol=1e-8, atol=1e-10)
