"""float32 kernel products on an ill-conditioned real problem (protein rows, small noise):
FALKON's eps_32 * M jitter keeps CG stable, and CG never hands back a diverged iterate."""
import pathlib
import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpfalkon import (
    CGNotConvergedWarning,
    FalkonConvergenceError,
    FalkonGP,
    FalkonOptions,
    conjugate_gradient,
    median_lengthscale,
)
from gpfalkon import settings as gp_settings
from gpfalkon.operators.nystrom import NystromKRROperator

from conftest import make_data, make_kernel, require_fused_cpu

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "protein.npz"


def _protein(n_train=3000, n_test=1000):
    with np.load(DATA) as z:
        X, y = z["X"][: n_train + n_test], z["y"][: n_train + n_test]
    X = (X - X[:n_train].mean(0)) / X[:n_train].std(0)
    y = (y - y[:n_train].mean()) / y[:n_train].std()
    x, y = torch.as_tensor(X), torch.as_tensor(y)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _fit_rmse(dtype, noise, m, lengthscale_factor=1.0, return_info=False):
    xtr, ytr, xte, yte = _protein()
    k = gpytorch.kernels.RBFKernel().to(dtype)
    k.lengthscale = float(median_lengthscale(xtr)) * lengthscale_factor
    model = FalkonGP(xtr.to(dtype), ytr.to(dtype), kernel=k, num_centers=m, penalty=noise / len(xtr),
                     max_iter=20, tol=0, seed=0).fit()
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        rmse = float((model(xte.to(dtype)).mean.double() - yte).square().mean().sqrt())
    return (rmse, model.fit_info) if return_info else rmse


@pytest.mark.parametrize("noise,m", [(1e-2, 2000), (1e-3, 1000)])
def test_float32_ill_conditioned_matches_float64(noise, m):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CGNotConvergedWarning)
        r32 = _fit_rmse(torch.float32, noise, m)
    r64 = _fit_rmse(torch.float64, noise, m)
    assert abs(r32 - r64) <= 0.03 * r64, (r32, r64)


def test_float32_residual_rise_returns_best_iterate():
    """A smoother kernel (4 x median lengthscale) in float32: the CG residual bottoms out near
    0.05 and then climbs ~5x as round-off takes over. The last iterate's test RMSE is ~5 %
    above float64's (0.839 vs 0.800 when measured); the best iterate, which CG now returns
    for any rise above 2x, matches float64 to 1 %."""
    with gp_settings.wide_products(False):  # float32 products: the round-off this test is about
        r32, info = _fit_rmse(torch.float32, 1e-3, 1000, lengthscale_factor=4.0, return_info=True)
    r64 = _fit_rmse(torch.float64, 1e-3, 1000, lengthscale_factor=4.0)
    assert info.extra["returned_best"] == 1
    assert abs(r32 - r64) <= 0.01 * r64, (r32, r64)


@pytest.mark.parametrize("noise,m,factor", [(1e-2, 2000, 1.0), (1e-2, 2000, 4.0), (1e-3, 1000, 4.0)])
def test_wide_products_take_float32_fits_to_float64_s_residual(noise, m, factor):
    """``settings.wide_products`` (the default): the stored float32 ``K_nM``'s products in float64. The same 20
    iterations reach a CG residual at least 2x lower than with float32 products (whose floor, the first case,
    is about 1.5e-2 against float64's 1e-5), and the test RMSE is float64's to 0.1 %. (Whether the last iterations'
    residual rises 2x above its best, so that CG hands back its best iterate, is host-dependent at the ~5e-3 level
    the data dtype's preconditioner jitter leaves it: it did on an Intel host's MKL, and not on AMD's; the
    preconditioned residual's 2-norm is not monotone. The returned iterate's residual is what is checked.)"""
    require_fused_cpu("the CPU's wide products")
    with gp_settings.wide_products(False):
        _, narrow = _fit_rmse(torch.float32, noise, m, lengthscale_factor=factor, return_info=True)
    r32, wide = _fit_rmse(torch.float32, noise, m, lengthscale_factor=factor, return_info=True)
    r64 = _fit_rmse(torch.float64, noise, m, lengthscale_factor=factor)
    assert float(wide.final_residual.max()) <= 0.5 * float(narrow.final_residual.max())
    assert abs(r32 - r64) <= 1e-3 * r64, (r32, r64)


def test_float32_without_data_dtype_jitter_breaks_down(monkeypatch):
    """The reference behaviour the jitter fixes (so the test above can fail): without it CG either loses
    positive definiteness or its residual diverges (which of the two comes first within the 20 iterations
    depends on the rounding of the triangular solves: LAPACK's or the CPU kernel's)."""
    monkeypatch.setattr(NystromKRROperator, "_precond_jitter", lambda self: None)
    with pytest.raises((FalkonConvergenceError, CGNotConvergedWarning),
                       match=r"lost positive definiteness|no progress|diverged"), warnings.catch_warnings(), \
            gp_settings.wide_products(False):  # float32 products: the rounding the jitter is for
        warnings.simplefilter("error", CGNotConvergedWarning)
        _fit_rmse(torch.float32, 1e-2, 2000)


@pytest.mark.parametrize("skew,diverges,rise", [(1e-4, False, None), (3e-4, True, 2.0), (1e-3, True, 10.0)])
def test_cg_returns_best_iterate_when_the_operator_is_inaccurate(skew, diverges, rise):
    """A symmetric PD matrix plus a skew part (an inconsistent operator, as float32 products
    of an ill-conditioned kernel are): p^T W p stays > 0 but the residual can blow up.
    A final residual above twice the best is replaced by the best iterate (3e-4: a ~4x rise,
    which a tenfold rule would have handed back)."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))
    b = torch.randn(60, 1, generator=g, dtype=torch.float64)
    r = torch.randn(60, 60, generator=g, dtype=torch.float64)
    a = q @ torch.diag(torch.logspace(0, -3, 60, dtype=torch.float64)) @ q.T + skew * (r - r.T)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, info = conjugate_gradient(lambda u: a @ u, b, tol=0, max_iter=60, stagnation_window=None)
    messages = [str(w.message) for w in caught if issubclass(w.category, CGNotConvergedWarning)]
    hist = info.residuals[:, 0]
    true_rel = float((b - a @ x).norm() / b.norm())
    if diverges:
        assert any("diverged" in m for m in messages) == (rise >= 10)
        assert info.extra["returned_best"] == 1
        assert float(hist[-2]) > rise * float(hist[:-1].min())  # the last iterate was worse
        assert float(hist[-1]) == pytest.approx(float(hist[:-1].min()))
        assert true_rel <= float(hist[:-1].min()) + 1e-12  # what is returned is the best iterate
    else:
        assert messages == []
        assert info.extra["returned_best"] == 0
        assert true_rel == pytest.approx(float(hist[-1]), rel=1e-6)


def test_breakdown_rebuilds_preconditioner_with_more_jitter(monkeypatch):
    """A CG breakdown (``p^T W p <= 0``, detected by the real CG) makes the operator raise the preconditioner's
    jitter 100x, warn, rebuild and restart; the restarted solve is the dense direct solve of ``H alpha = rhs``.
    The breakdown is forced, so that the test does not depend on rounding: the first attempt's data products are
    negated (``H`` then indefinite), the ones after the rebuild are not."""
    from gpfalkon import JitterWarning

    x, y = make_data(400, 2)
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = 0.1 * float(median_lengthscale(x))  # H's condition number about 5e3: a direct solve is exact
    op = NystromKRROperator(x, x[:60].clone(), 1e-3, kernel=k)
    rhs = op.kmn_y(y.unsqueeze(-1))
    engine, kmn_k, boost = op.engine, op.engine.kmn_k, op._boost_jitter
    broken = {"on": True, "rebuilds": 0}
    monkeypatch.setattr(engine, "kmn_k", lambda *a, **kw: -kmn_k(*a, **kw) if broken["on"] else kmn_k(*a, **kw))

    def boost_once(reason: str) -> bool:
        broken["on"] = False
        broken["rebuilds"] += 1
        return boost(reason)

    monkeypatch.setattr(op, "_boost_jitter", boost_once)
    with pytest.warns(JitterWarning, match="broke down .CG lost positive definiteness"):
        alpha, _info = op.falkon_solve(rhs, tol=1e-12, max_iter=200)
    assert broken["rebuilds"] == 1 and op._jitter_boost == 100.0
    knm = k(x, op.centers).to_dense().detach()
    h = knm.T @ knm + 400 * 1e-3 * k(op.centers, op.centers).to_dense().detach()
    want = torch.linalg.solve(h, rhs)
    torch.testing.assert_close(alpha, want, rtol=1e-7, atol=1e-7 * float(want.abs().max()))


def test_near_singular_kmm_still_solves():
    """M = n with a tiny penalty (``K_MM`` numerically singular, float64). Whether CG breaks down here depends
    on rounding (it did on one host, not on another); either way the operator returns a solution of
    ``H alpha = K_Mn y``: after a breakdown with a raised jitter and a warning, else without one."""
    from gpfalkon import JitterWarning, NystromKRROperator

    x, y = make_data(400, 2)
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = float(median_lengthscale(x))
    op = NystromKRROperator(x, x.clone(), 1e-6, kernel=k)
    rhs = op.kmn_y(y.unsqueeze(-1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alpha, _info = op.falkon_solve(rhs, tol=0, max_iter=20)
    jitter_warned = [w for w in caught if issubclass(w.category, JitterWarning) and "broke down" in str(w.message)]
    assert (op._jitter_boost > 1) == bool(jitter_warned)
    h_alpha = op.h_matmul_nograd(alpha)
    assert float((h_alpha - rhs).norm() / rhs.norm()) < 1e-4
    # the fit itself is good: K_nM alpha reproduces the smooth targets
    knm = k(x, x).to_dense()
    assert float((knm @ alpha.squeeze(-1) - y).square().mean().sqrt()) < 0.15


def test_float32_default_tolerance_is_the_float32_floor():
    from gpfalkon import settings
    from gpfalkon.operators.nystrom import FLOAT32_TOL

    def fit(dtype, **kw):
        x, y = make_data(200, 3, dtype=dtype)
        return FalkonGP(x, y, kernel=make_kernel("rbf", 3, dtype=dtype), num_centers=40, penalty=1e-4,
                        options=FalkonOptions(solve_method="cg"), **kw).fit()

    assert fit(torch.float32).fit_info.tol == FLOAT32_TOL
    assert fit(torch.float64).fit_info.tol == settings.cg_tolerance.value() < FLOAT32_TOL
    # a tolerance given explicitly (argument or setting) is used as is
    assert fit(torch.float32, tol=1e-7).fit_info.tol == 1e-7
    with settings.cg_tolerance(1e-8):
        assert fit(torch.float32).fit_info.tol == 1e-8


def test_cap_warning_only_when_the_cap_stopped_cg():
    from gpfalkon.solvers import falkon_solve

    class Identity:
        def apply_b(self, r):
            return r

        apply_bt = apply_b_inv = apply_b

    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, 16, 40, dtype=torch.float64)) @ q.T
    b = a @ torch.ones(40, 1, dtype=torch.float64)  # CG gets to ~1e-10, then round-off stalls it
    with pytest.warns(CGNotConvergedWarning, match="reached max_iter=3"):
        falkon_solve(lambda u: a @ u, Identity(), b, tol=1e-14, max_iter=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, info = falkon_solve(lambda u: a @ u, Identity(), b, tol=1e-14, max_iter=5000)
    msgs = [str(w.message) for w in caught]
    assert info.extra["stagnated"] and info.iterations < 5000
    assert msgs and all("max_iter" not in m for m in msgs) and any("stagnated" in m for m in msgs), msgs


def test_float32_default_tolerance_stops_quietly_at_the_float32_floor():
    """Matern 5/2 at 2 x the median lengthscale and penalty 1e-6 stalls float32 CG near 7e-3
    (benchmarks/results/float32-tol.md; 1.2e-2 where the 25-iteration stagnation window stops it): with no
    tolerance given the fit ends there without a warning
    and predicts as float64 does; an explicit tolerance still warns, and so does an RBF kernel whose
    float32 floor is above FLOAT32_QUIET, with advice naming float64 (penalty 1e-7: 6e-2 with the fused
    CPU kernels' float32 products, 0.13 without; at 1e-6 the fused kernels' floor, 2.4e-2, is below it); with the
    products in float64 (``settings.wide_products``) that fit ends quietly and predicts as float64 does."""
    require_fused_cpu("the fused kernel's float32 floor (without it, 9.7e-2: above FLOAT32_QUIET)")
    xtr, ytr, xte, yte = _protein()
    ls = float(median_lengthscale(xtr)) * 2.0

    def fit(dtype, kernel="matern", penalty=1e-6, **kw):
        k = (gpytorch.kernels.MaternKernel(nu=2.5) if kernel == "matern" else gpytorch.kernels.RBFKernel()).to(dtype)
        k.lengthscale = ls
        m = FalkonGP(xtr.to(dtype), ytr.to(dtype), kernel=k, num_centers=1000, penalty=penalty, seed=0, **kw).fit()
        return m, float((m.posterior_mean(xte.to(dtype)).double() - yte).square().mean().sqrt())

    with warnings.catch_warnings():
        warnings.simplefilter("error", CGNotConvergedWarning)
        _, r32 = fit(torch.float32)
    _, r64 = fit(torch.float64, tol=1e-10, max_iter=500)
    assert abs(r32 - r64) <= 0.01 * r64, (r32, r64)
    with pytest.warns(CGNotConvergedWarning):
        fit(torch.float32, tol=1e-9, max_iter=120)
    with pytest.warns(CGNotConvergedWarning, match="use float64 data"), gp_settings.wide_products(False):
        fit(torch.float32, kernel="rbf", penalty=1e-7)
    # with the stored K_nM's products in float64 (settings.wide_products, the default) that fit ends below the
    # quiet floor, and predicts as float64 does
    with warnings.catch_warnings():
        warnings.simplefilter("error", CGNotConvergedWarning)
        _, w32 = fit(torch.float32, kernel="rbf", penalty=1e-7)
    _, w64 = fit(torch.float64, kernel="rbf", penalty=1e-7, tol=1e-10, max_iter=500)
    assert abs(w32 - w64) <= 0.01 * w64, (w32, w64)
