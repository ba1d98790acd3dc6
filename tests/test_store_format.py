"""The 16-bit fixed-point store of ``K_nM`` (``gpfalkon.settings.store_format("int16")``): the values kept, the
products of the fused CPU kernels and of the torch path, the memory rule, and a fit on it, against dense
float64 references and the closed-form rounding bound."""
from __future__ import annotations

import itertools

import pytest
import torch

import gpfalkon
from gpfalkon import FalkonGP, FalkonOptions, KernelEngine, settings
from gpfalkon.backend import fused, stored_rows_for
from gpfalkon.backend.engine import FIXED_MAX, _quantize_rows_, reuse_stores

from conftest import dense_kernel, dense_nystrom, make_data, make_kernel


def _need_kernel() -> None:
    ok, why = fused.fused_available()
    if not ok:
        pytest.skip(f"fused kernel unavailable: {why}")


def _fixed_engine(k, x, c, **kw) -> KernelEngine:
    with settings.store_format("int16"):
        return KernelEngine(k, x, c, **kw)


def test_the_setting_is_validated_and_read_when_an_engine_is_built():
    with pytest.raises(ValueError, match=r"store_format.*'int16'"):
        settings.store_format("float16")
    x, _ = make_data(50, 2)
    k = make_kernel("rbf", 2)
    assert KernelEngine(k, x, x[:5]).store_dtype == torch.float64
    e = _fixed_engine(k, x, x[:5])
    assert e.store_dtype == torch.int16 and e.fixed
    assert KernelEngine(k, x.float(), x[:5].float()).store_dtype == torch.float32  # the block has ended


def test_quantize_rows_closed_form_zero_and_non_finite_rows():
    """Each row as q_i s_i with s_i = max |row| / 32767 and q_i the nearest integers (ties to even); a zero
    row stays zero with s = 0; a row with NaN or inf gets s = NaN and q = 0 (its products NaN, as unrounded)."""
    blk = torch.tensor([[1.0, -0.5, 0.25, 1e-9], [0.0, 0.0, 0.0, 0.0], [1.0, float("nan"), 0.0, 2.0],
                        [3.0, float("inf"), 0.0, 1.0], [-2.0, 1.0, 0.0, 0.5]], dtype=torch.float64)
    orig = blk.clone()
    q = torch.empty(5, 4, dtype=torch.int16)
    s = torch.empty(5, dtype=torch.float64)
    out = _quantize_rows_(blk, q, s)
    assert out is blk
    assert q[0].tolist() == [32767, -16384, 8192, 0]  # -0.5 / (1 / 32767) = -16383.5: to even
    assert s[0] == 1.0 / FIXED_MAX and s[4] == 2.0 / FIXED_MAX
    assert q[4].tolist() == [-32767, 16384, 0, 8192]  # 16383.5 -> 16384 (even); 8191.75 -> 8192
    assert s[1] == 0.0 and q[1].abs().sum() == 0 and blk[1].abs().sum() == 0
    for r in (2, 3):
        assert torch.isnan(s[r]) and q[r].abs().sum() == 0 and torch.isnan(blk[r]).all()
    for r in (0, 4):
        torch.testing.assert_close(blk[r], q[r].double() * s[r], rtol=0, atol=0)
        assert float((blk[r] - orig[r]).abs().max()) <= 0.5 * float(s[r]) * (1 + 1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kname", ["rbf", "scale_matern52", "periodic"])
@pytest.mark.parametrize("use_fused", [True, False])
@pytest.mark.parametrize("partial", [False, True])
def test_fixed_store_products_are_the_rounded_matrix_products(dtype, kname, use_fused, partial):
    """Every pass (the first, which fills the store, and the later ones) computes the products of one matrix:
    the stored rows rounded to the fixed-point format (within half a unit of the row's scale of the dense
    kernel, the closed-form bound), the rows past the store exact; the fused kernels and the torch path keep
    the same values."""
    if use_fused:
        _need_kernel()
    fused.set_enabled(use_fused)
    try:
        n, m, d = 611, 37, 3
        x, _ = make_data(n, d)
        x = x.to(dtype)
        c = x[:m].clone() + 0.01
        k = make_kernel(kname, d, dtype)
        u = torch.randn(m, 3, dtype=torch.float64)
        v = torch.randn(n, 3, dtype=torch.float64)
        itemsize = torch.empty(0, dtype=dtype).element_size()  # the buffers, then 100 rows of values + scale
        kw = ({"memory_budget": 2 * 64 * (m + d) * itemsize + 100 * (m * 2 + itemsize), "block_rows": 64}
              if partial else {})
        e = _fixed_engine(k, x, c, **kw)
        head = e.stored_rows
        assert (0 < head < n) if partial else head == n
        outs = [e.kmn_k(u.to(dtype), v.to(dtype)) for _ in range(3)]
        assert e._k is not None and e._k.dtype == torch.int16 and e._k.shape == (head, m)
        with torch.no_grad():
            knm = dense_kernel(k, x, c).detach().double()
        # the rounding bound against the dense float64 kernel (plus the data dtype's own rounding)
        held = torch.cat([e._stored(0, head).double() * e.scale, knm[head:]])
        row_scale = knm[:head].abs().amax(1)
        eps = 1e-12 if dtype == torch.float64 else 2e-6
        err = (held[:head] - knm[:head]).abs()
        assert bool((err <= 0.5 * row_scale[:, None] / FIXED_MAX * (1 + 1e-3) + eps * row_scale[:, None]).all())
        tol = 1e-11 if dtype == torch.float64 else 2e-5
        if partial:  # the rows past the store: the dense kernel's values
            torch.testing.assert_close(e.materialize()[head:].double() if e.stored else held[head:], knm[head:],
                                       rtol=tol, atol=tol)
        want = held.T @ (held @ u + v)
        for out in outs:  # the first pass's products use the stored values too
            torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
        torch.testing.assert_close(e.column_sq_norms(), held.square().sum(0), rtol=tol, atol=tol)
        if not partial:
            torch.testing.assert_close(e.materialize().double(), held, rtol=tol, atol=tol)
    finally:
        fused.set_enabled(None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kname", ["rbf", "matern12", "scale_matern52"])
def test_the_fused_quantization_rounds_as_the_torch_one(dtype, kname):
    """The C++ quantization of the fused first pass and the torch one (:func:`_quantize_rows_`) give the same
    integers and scales, bit for bit, from the same kernel values (the fused pass into a store of the data's
    dtype gives those), and the first pass's products use the quantized values."""
    _need_kernel()
    x, _ = make_data(300, 4)
    x = x.to(dtype)
    c = x[:40].clone()
    k = make_kernel(kname, 4, dtype)
    u = torch.randn(40, 1, dtype=dtype)
    raw = KernelEngine(k, x, c)
    first_raw = raw.kmn_k(u)
    e = _fixed_engine(k, x, c)
    first = e.kmn_k(u)
    values = raw._k.clone()
    q = torch.empty(300, 40, dtype=torch.int16)
    s = torch.empty(300, dtype=dtype)
    _quantize_rows_(values, q, s)
    assert torch.equal(e._k, q) and torch.equal(e._scale, s)
    held = values.double() * e.scale
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(first, held.T @ (held @ u.double()), rtol=tol, atol=tol * float(first.abs().max()))
    assert not torch.equal(first, first_raw)


def test_fused_fixed_products_handle_every_row_count_and_non_finite_rows():
    """fused_kmn_k on an int16 store against its dequantized dense products, for row counts around the groups
    of eight and the flush boundary, float32 and float64, u and v alike; a NaN row's scale makes its
    products NaN."""
    _need_kernel()
    g = torch.Generator().manual_seed(0)
    for dtype, rows, k in itertools.product((torch.float32, torch.float64), (1, 7, 8, 13, 40, fused.FLUSH_ROWS + 5),
                                            (1, 2, 5)):
        m = 21 if rows != 40 else 3  # (fewer columns than one vector of eight)
        q = torch.randint(-FIXED_MAX, FIXED_MAX + 1, (rows, m), generator=g, dtype=torch.int16)
        s = torch.rand(rows, generator=g, dtype=torch.float64) / FIXED_MAX
        u = torch.randn(k, m, generator=g, dtype=torch.float64)
        v = torch.randn(k, rows + 3, generator=g, dtype=torch.float64)[:, 1: rows + 1]
        dense = q.double() * s[:, None]
        for uu, vv in ((u, v), (u, None), (None, v)):
            want = (0 if uu is None else (uu @ dense.T) @ dense) + (0 if vv is None else vv @ dense)
            acc = torch.zeros(k, m, dtype=torch.float64)
            assert fused.fused_kmn_k(acc, q, None if uu is None else uu.to(dtype),
                                     None if vv is None else vv.to(dtype), s.to(dtype))
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(acc, want, rtol=tol, atol=tol * float(want.abs().max()))
    m = q.shape[1]
    acc = torch.zeros(1, m, dtype=torch.float64)
    s_bad = s.clone()
    s_bad[3] = float("nan")
    assert fused.fused_kmn_k(acc, q, u[:1], None, s_bad)
    assert torch.isnan(acc).all()
    assert not fused.fused_kmn_k(acc, q, u[:1], None, None)  # an int16 store needs its scales
    with pytest.raises(RuntimeError, match="u must have scale's dtype"):
        fused.fused_kmn_k(acc, q, u[:1].float(), None, s)


def test_the_memory_rule_counts_two_bytes_a_value_and_the_row_scales():
    n, m = 100_000, 1000
    budget = 150 * 2**20
    full = stored_rows_for(n, m, 4, budget, block_rows=256)
    fixed = stored_rows_for(n, m, 4, budget, block_rows=256, store_dtype=torch.int16)
    assert full == (budget - 2 * 256 * m * 4) // (m * 4)
    assert fixed == (budget - 2 * 256 * m * 4) // (m * 2 + 4)
    assert stored_rows_for(n, m, 4, n * (m * 2 + 4), store_dtype=torch.int16) == n  # whole: values + scales
    assert stored_rows_for(n, m, 4, n * (m * 2 + 4) - 1, store_dtype=torch.int16) < n
    x, _ = make_data(400, 2)
    e = _fixed_engine(make_kernel("rbf", 2), x.float(), x[:30].float(), memory_budget=400 * (30 * 2 + 4))
    assert e.stored and e.stored_rows == 400
    with settings.store_format("int16"), pytest.raises(ValueError, match="memory_budget"):
        KernelEngine(make_kernel("rbf", 2), x.float(), x[:30].float(), memory_budget=400 * (30 * 2 + 4) - 1,
                     store=True)


def test_a_fit_on_the_fixed_store_solves_the_rounded_system_and_refits_follow_the_setting():
    """FalkonGP's CG on an int16 store reaches the dense Nystrom solution of the rounded K_nM (the system it
    solves), whose predictions are within 1 % of the exact system's; an operator rebuilds its engine when
    the setting in force changes; fits inside reuse_stores() on an int16 store repeat exactly."""
    x, y = make_data(1500, 3)
    k = make_kernel("rbf", 3)
    c = x[:80].clone()
    lam = 1e-3
    opts = FalkonOptions(solve_method="cg")
    exact = FalkonGP(x, y, kernel=k, centers=c, penalty=lam, tol=1e-12, max_iter=400, options=opts).fit()
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=lam, tol=1e-12, max_iter=400, options=opts)
    with settings.store_format("int16"):
        model.fit()
    held = _fixed_engine(k, x, c).materialize().double()  # the same values as the fit's store
    assert float((held - dense_kernel(k, x, c).detach()).abs().max()) > 0  # rounded indeed
    _, _, kmm = dense_nystrom(k, x, c, lam)
    ref = torch.linalg.solve(held.T @ held + 1500 * lam * kmm, held.T @ y)
    torch.testing.assert_close(model.alpha.reshape(-1), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    assert not torch.allclose(model.alpha, exact.alpha, rtol=1e-8, atol=1e-10)
    xt, yt = make_data(500, 3, seed=7)
    with torch.no_grad():
        p_fixed, p_exact = model.posterior_mean(xt), exact.posterior_mean(xt)
    rmse_fixed = float((p_fixed.reshape(-1) - yt).square().mean().sqrt())
    rmse_exact = float((p_exact.reshape(-1) - yt).square().mean().sqrt())
    assert abs(rmse_fixed / rmse_exact - 1) < 0.01
    model.fit()  # outside the block: the data's dtype again
    torch.testing.assert_close(model.alpha, exact.alpha, rtol=1e-8, atol=1e-10)
    op = model.nystrom_operator()
    with settings.store_format("int16"):
        assert op.engine.store_dtype == torch.int16
        assert op.engine is op.engine  # kept while the setting holds
    assert op.engine.store_dtype == torch.float64  # rebuilt under the setting in force
    alphas = []
    with settings.store_format("int16"), reuse_stores():
        for _ in range(2):
            fit = FalkonGP(x.float(), y.float(), kernel=make_kernel("rbf", 3, torch.float32), centers=c.float(),
                           penalty=lam, options=FalkonOptions(solve_method="cg", max_iter=5, tol=0.0)).fit()
            alphas.append(fit.alpha)
    torch.testing.assert_close(alphas[0], alphas[1], rtol=0, atol=0)
    assert gpfalkon.settings.store_format.value() is None


def test_cg_on_a_fixed_store_preconditions_at_its_resolution_whatever_the_data_dtype():
    """float64 data with an int16 store: the preconditioner's jitter takes the store's resolution (2^-15 of a row's
    largest value), not float64's, which left CG with a preconditioner resolving what the rounded K_nM does not:
    300 iterations and a model no better than predicting zero (protein, RBF at 3 x the median lengthscale,
    lambda 1e-7: test RMSE 1.005 against 0.808 without the store). The direct solve keeps the data dtype's jitter
    (it is part of its system)."""
    import gpytorch
    from test_float32_stability import _protein

    from gpfalkon.heuristics import median_lengthscale
    from gpfalkon.operators.nystrom import FIXED_POINT_EPS

    xtr, ytr, xte, yte = _protein(3000, 1000)
    rmse = []
    for fmt in (None, "int16"):
        k = gpytorch.kernels.RBFKernel().double()
        k.lengthscale = float(median_lengthscale(xtr)) * 3
        with settings.store_format(fmt):
            m = FalkonGP(xtr, ytr, kernel=k, num_centers=500, penalty=1e-7, seed=0, max_iter=300,
                         options=FalkonOptions(solve_method="cg")).fit()
            op = m.nystrom_operator()
            if fmt is not None:
                kmm_scale = float(op.kmm.diagonal().abs().mean())
                assert op._precond_jitter() == pytest.approx(FIXED_POINT_EPS * kmm_scale)
                assert op._precond_jitter(direct=True) is None
        rmse.append(float((m.posterior_mean(xte) - yte).square().mean().sqrt()))
    assert rmse[1] <= 1.05 * rmse[0], rmse
