"""Predictive variances through FALKON's approximation of ``K_Mn K_nM``
(``gpfalkon.settings.variance_factors("approximate")``; ``NystromPosteriorFactors.approximate_from``, docs/math.md
§4.2) against dense closed forms and the exact factors."""
from __future__ import annotations

import gpytorch
import pytest
import torch

from gpfalkon import FalkonGP, KernelEngine, settings
from gpfalkon.models import NystromPosteriorFactors

from conftest import dense_kernel, make_data, make_kernel


def _dense_variances(kernel, x, centers, xt, noise, gram):
    """The latent SGPR variances ``k(x*, x*) - K_*M K_MM^{-1} K_M* + s2 K_*M (gram + s2 K_MM)^{-1} K_M*`` with
    ``gram`` standing for ``K_Mn K_nM`` (docs/math.md §4), by dense solves."""
    kmm = dense_kernel(kernel, centers, centers)
    ksm = dense_kernel(kernel, xt, centers)
    prior = torch.diagonal(dense_kernel(kernel, xt, xt))
    nystrom = (ksm * torch.linalg.solve(kmm, ksm.T).T).sum(-1)
    coef = (ksm * torch.linalg.solve(gram + noise * kmm, ksm.T).T).sum(-1)
    return prior - nystrom + noise * coef, prior - nystrom, prior


def test_the_approximation_is_exact_when_the_centers_are_the_training_rows():
    """With every training row a center (M = n, D = I), ``(n/M) K_MM^2`` is ``K_Mn K_nM`` itself: the
    approximate variances equal the exact ones and the dense SGPR variances."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 2, generator=g, dtype=torch.float64) * 8  # far apart in lengthscales: K_MM well conditioned
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)
    kern = make_kernel("scale_rbf", 2)
    model = FalkonGP(x, y, kernel=kern, centers=x.clone(), penalty=1e-3, tol=1e-12, max_iter=500).fit()
    model.eval()
    xt = torch.rand(30, 2, generator=g, dtype=torch.float64) * 8
    with torch.no_grad():
        exact = model(xt)
        with settings.variance_factors("approximate"):
            fast = model(xt)
    noise = float(model.noise.detach())
    knm = dense_kernel(kern, x, x)
    want, _, _ = _dense_variances(kern, x, x, xt, noise, knm.T @ knm)
    torch.testing.assert_close(fast.mean, exact.mean, rtol=0, atol=0)
    torch.testing.assert_close(exact.variance, want, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(fast.variance, want, rtol=1e-8, atol=1e-12)
    assert model.posterior_factors(approximate=True).approximate
    assert not model.posterior_factors(approximate=False).approximate


@pytest.mark.parametrize("weighted", [False, True])
def test_the_approximate_factors_follow_the_formula(weighted):
    """``L_B L_B^T = I + (n/M) L^{-1} K_MM D^2 K_MM L^{-T} / (n lambda)`` with ``L L^T = K_MM`` (dense, with the
    centers' weights ``D`` where given), and the latent variances are the dense SGPR ones with ``K_Mn K_nM``
    replaced by ``(n/M) K_MM D^2 K_MM``."""
    x, y = make_data(600, 3)
    kern = make_kernel("scale_matern52", 3)
    centers = x[torch.randperm(600, generator=torch.Generator().manual_seed(1))[:25]].clone()
    weights = None
    if weighted:
        weights = torch.rand(25, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    model = FalkonGP(x, y, kernel=kern, centers=centers, center_weights=weights, penalty=1e-3).fit()
    model.eval()
    f = model.posterior_factors(approximate=True)
    n, m, v = 600, 25, 600 * 1e-3
    kmm = dense_kernel(kern, centers, centers)
    d = torch.ones(m, dtype=torch.float64) if weights is None else weights
    approx_gram = (n / m) * kmm @ torch.diag(d**2) @ kmm
    L = torch.linalg.cholesky(kmm)
    w = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, approx_gram, upper=False).T, upper=False)
    torch.testing.assert_close(f.L @ f.L.T, kmm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.LB @ f.LB.T, torch.eye(m, dtype=torch.float64) + w / v, rtol=1e-8, atol=1e-10)
    xt = make_data(20, 3, seed=3)[0]
    want, _, _ = _dense_variances(kern, x, centers, xt, v, approx_gram)
    with torch.no_grad(), settings.variance_factors("approximate"):
        got = model(xt).variance
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)


def test_fast_variances_are_bounded_and_close_to_the_exact_ones_inside_the_data():
    """Uniform centers, n / M = 40: the approximate latent variances lie between the Nyström residual
    ``k(x, x) - K_xM K_MM^{-1} K_Mx`` and the prior (as the exact ones) everywhere, also past the data; the mean
    is the exact mean; inside the data the predictive variances (noise included) are within a few percent of
    the exact ones (near and past the data's edge the coefficient term can be off by a factor of about 2:
    docs/math.md §4.2)."""
    x, y = make_data(8000, 3)  # uniform on [-1, 1]^3
    kern = make_kernel("scale_rbf", 3)
    model = FalkonGP(x, y, kernel=kern, num_centers=200, penalty=1e-2 / 8000, seed=0).fit()
    model.eval()
    noise = float(model.noise.detach())
    for spread in (1.3, 0.8):
        xt = make_data(300, 3, seed=4)[0] * spread
        with torch.no_grad():
            exact = model.likelihood(model(xt))
            with settings.variance_factors("approximate"):
                fast_latent = model(xt)
                fast = model.likelihood(fast_latent)
            eye = torch.eye(200, dtype=torch.float64)  # (the gram's value does not enter the two bounds)
            _, residual, prior = _dense_variances(kern, x, model.centers, xt, noise, eye)
        tol = 1e-9 * float(prior.max())
        assert bool((fast_latent.variance >= residual - tol).all())
        assert bool((fast_latent.variance <= prior + tol).all())
        torch.testing.assert_close(fast.mean, exact.mean, rtol=0, atol=0)
        if spread < 1:
            rel = (fast.variance - exact.variance).abs() / exact.variance
            assert float(rel.median()) < 0.01 and float(rel.max()) < 0.15, (float(rel.median()), float(rel.max()))


def test_both_kinds_of_factors_are_kept_apart_and_follow_the_fit(monkeypatch):
    """The setting forms the approximate factors without a data pass and leaves the exact ones alone (and
    the reverse); each is formed once; fit() drops both; scale_prior scales both as a refit would."""
    x, y = make_data(500, 3)
    model = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=30, penalty=1e-3, seed=0).fit()
    model.eval()
    xt = make_data(15, 3, seed=6)[0]
    calls = {"compute": 0, "approximate": 0}
    real_compute = NystromPosteriorFactors.compute.__func__
    real_approx = NystromPosteriorFactors.approximate_from.__func__

    def compute(cls, op):
        calls["compute"] += 1
        return real_compute(cls, op)

    def approximate(cls, *args, **kwargs):
        calls["approximate"] += 1
        return real_approx(cls, *args, **kwargs)

    monkeypatch.setattr(NystromPosteriorFactors, "compute", classmethod(compute))
    monkeypatch.setattr(NystromPosteriorFactors, "approximate_from", classmethod(approximate))

    real_blocks, real_gram = KernelEngine.iter_blocks, KernelEngine.whitened_gram

    def no_pass(real):
        def spy(self, *args, **kwargs):
            if self.n == 500:  # an engine over the training rows (the predictions' engines hold the 15 test points)
                raise AssertionError("the approximate factors read the data")
            return real(self, *args, **kwargs)
        return spy

    with monkeypatch.context() as mp:
        mp.setattr(KernelEngine, "whitened_gram", no_pass(real_gram))
        mp.setattr(KernelEngine, "iter_blocks", no_pass(real_blocks))
        with torch.no_grad(), settings.variance_factors("approximate"):
            v_fast = model(xt).variance
            again = model(xt).variance
    torch.testing.assert_close(again, v_fast, rtol=0, atol=0)
    assert calls == {"compute": 0, "approximate": 1}
    with torch.no_grad():
        v_exact = model(xt).variance
        torch.testing.assert_close(model(xt).variance, v_exact, rtol=0, atol=0)
        with settings.variance_factors("approximate"):
            torch.testing.assert_close(model(xt).variance, v_fast, rtol=0, atol=0)
    assert calls == {"compute": 1, "approximate": 1}
    assert not torch.equal(v_fast, v_exact)
    model.scale_prior(2.5)
    with torch.no_grad(), settings.variance_factors("approximate"):
        v_scaled = model(xt).variance
    assert calls == {"compute": 1, "approximate": 1}  # scaled, not formed again
    torch.testing.assert_close(v_scaled, 2.5 * v_fast, rtol=1e-9, atol=0)
    model._forget_factors()
    with torch.no_grad(), settings.variance_factors("approximate"):
        torch.testing.assert_close(model(xt).variance, v_scaled, rtol=1e-9, atol=0)  # as formed afresh
    model.fit()
    with torch.no_grad(), settings.variance_factors("approximate"):
        assert bool((model(xt).variance > 0).all())
    assert calls == {"compute": 1, "approximate": 3}


def test_fantasies_under_the_setting_condition_the_approximate_posterior():
    """A fantasy model built under the setting starts from the approximate factors: its posterior is the dense
    DTC posterior of the base rows and the fantasy rows with ``K_Mn K_nM`` of the base rows replaced by
    ``G~ = (n/M) K_MM^2``, and the base rows' right-hand side by ``H~ alpha`` (``H~ = G~ + s2 K_MM``; the fitted
    ``alpha``), as docs/math.md §4.1-4.2 derive."""
    from botorch.utils.testing import get_random_data

    from gpfalkon.botorch import FalkonModel
    from gpfalkon.integrations.fantasy import FalkonFantasyModel

    X, Y = get_random_data(torch.Size(), m=1, d=2, n=300, dtype=torch.float64)
    X[:, 1] = torch.rand(300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # off the diagonal
    model = FalkonModel(X, Y, num_centers=25, penalty=1e-3, tol=1e-12, max_iter=2000, outcome_transform=None)
    g = torch.Generator().manual_seed(3)
    xf = torch.rand(1, 4, 2, generator=g, dtype=torch.float64)  # a batch of one set: the closed-form fantasy
    yf = torch.randn(1, 4, 1, generator=g, dtype=torch.float64)
    with settings.variance_factors("approximate"):
        fm = model.condition_on_observations(xf, yf)
    assert isinstance(fm, FalkonFantasyModel)
    xt = torch.rand(6, 2, generator=g, dtype=torch.float64)
    post = fm.posterior(xt)  # (the setting off: the factors were taken when the fantasy was built)
    xf, yf = xf[0], yf[0]
    k, c = model.kernel, model.centers.detach()
    n, m, s2 = 300, 25, float(model.noise.detach())
    mu = float(model.mean_constant.reshape(-1)[0])
    with torch.no_grad():
        kmm, kfm, kxm, kxx = (k(c).to_dense(), k(xf, c).to_dense(), k(xt, c).to_dense(), k(xt).to_dense())
    h_approx = (n / m) * kmm @ kmm + s2 * kmm
    prec = (h_approx + kfm.mT @ kfm) / s2
    rhs = (h_approx @ model.alpha.reshape(-1).to(torch.float64) + kfm.mT @ (yf[:, 0] - mu)) / s2
    mean = mu + kxm @ torch.linalg.solve(prec, rhs)
    cov = kxx - kxm @ torch.linalg.solve(kmm, kxm.mT) + kxm @ torch.linalg.solve(prec, kxm.mT)
    torch.testing.assert_close(post.mean[0, :, 0], mean, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(post.distribution.covariance_matrix[0], cov, rtol=1e-6, atol=1e-9)


def test_the_setting_is_checked_and_gpytorchs_fast_pred_var_keeps_the_exact_factors():
    """BoTorch's posterior() turns GPyTorch's fast_pred_var on for every model: the variances stay exact under it
    (only gpfalkon.settings.variance_factors asks for the approximation); a bad value names the setting."""
    x, y = make_data(400, 3)
    model = FalkonGP(x, y, kernel=make_kernel("scale_rbf", 3), num_centers=20, penalty=1e-3, seed=0).fit()
    model.eval()
    xt = make_data(10, 3, seed=7)[0]
    with torch.no_grad():
        exact = model(xt).variance
        with gpytorch.settings.fast_pred_var():
            torch.testing.assert_close(model(xt).variance, exact, rtol=0, atol=0)
        with settings.variance_factors("approximate"):
            assert not torch.equal(model(xt).variance, exact)
    assert model._fast_factors is not None and not model._factors.approximate
    with pytest.raises(ValueError, match="variance_factors"):
        settings.variance_factors("fast")
