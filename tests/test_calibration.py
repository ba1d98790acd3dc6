"""Variance calibration: FalkonGP.scale_prior, preconditioned_variances, variance_scale (docs/math.md §4, §8)."""
from __future__ import annotations

import copy
import math

import gpytorch
import pytest
import torch

from gpfalkon import FalkonGP, FalkonPreconditioner
from gpfalkon.models.calibration import preconditioned_variances, variance_scale

from conftest import dense_kernel, make_data, make_kernel


def _fitted(n: int = 400, m: int = 30, lam: float = 1e-4, name: str = "scale_matern52", **kw) -> FalkonGP:
    x, y = make_data(n, 3)
    model = FalkonGP(x, y, kernel=make_kernel(name, 3), num_centers=m, penalty=lam, tol=1e-12, max_iter=1000, **kw)
    model.fit()
    model.eval()
    return model


# ----------------------------------------------------------------------------- scale_prior
@pytest.mark.parametrize("factors_formed", [False, True])
def test_scale_prior_keeps_the_mean_scales_the_variance_and_equals_a_fresh_fit(factors_formed):
    model = _fitted()
    xt = make_data(20, 3, seed=5)[0]
    with torch.no_grad():
        before = model.likelihood(model(xt))
        mean0, var0 = before.mean.clone(), before.variance.clone()
    if not factors_formed:
        model._factors = None
    c = 3.7
    s0, noise0 = float(model.kernel.outputscale.detach()), float(model.noise.detach())
    assert model.scale_prior(c) is model
    assert math.isclose(float(model.kernel.outputscale.detach()), c * s0, rel_tol=1e-12)
    assert math.isclose(float(model.noise.detach()), c * noise0, rel_tol=1e-12)
    with torch.no_grad():
        after = model.likelihood(model(xt))  # still fitted: no NotFittedError, no refit
    torch.testing.assert_close(after.mean, mean0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(after.variance, c * var0, rtol=1e-9, atol=0.0)
    # the independent reference: a model built and fitted at the scaled values
    k = copy.deepcopy(model.kernel)
    ref = FalkonGP(model.train_inputs[0], model.train_targets, kernel=k, centers=model.centers.detach().clone(),
                   penalty=float(model.penalty.detach()), tol=1e-12, max_iter=1000).fit()
    ref.eval()
    with torch.no_grad():
        p_ref = ref.likelihood(ref(xt))
    torch.testing.assert_close(after.mean, p_ref.mean, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(after.variance, p_ref.variance, rtol=1e-7, atol=0.0)
    torch.testing.assert_close(model.alpha, ref.alpha, rtol=1e-7, atol=1e-10)


def test_scale_prior_on_a_stale_or_unfitted_model_changes_the_values_only():
    x, y = make_data(100, 3)
    model = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=10, penalty=1e-3)
    s0 = float(model.kernel.outputscale.detach())
    model.scale_prior(2.0)
    assert not bool(model.fitted)
    assert math.isclose(float(model.kernel.outputscale.detach()), 2 * s0, rel_tol=1e-12)
    assert math.isclose(float(model.penalty.detach()), 2e-3, rel_tol=1e-12)
    model = _fitted()
    model.kernel.base_kernel.lengthscale = 0.9  # stale
    alpha = model.alpha.clone()
    model.scale_prior(2.0)
    torch.testing.assert_close(model.alpha, alpha)  # not rescaled: it solves another system anyway
    with pytest.raises(Exception, match="fit"):
        model(x[:3])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_scale_prior_rejects_bad_factors(bad):
    model = _fitted()
    with pytest.raises(ValueError, match="factor"):
        model.scale_prior(bad)


def test_scale_prior_needs_a_scale_kernel_and_keeps_state_when_a_constraint_refuses():
    model = _fitted(name="matern52")
    with pytest.raises(ValueError, match="ScaleKernel"):
        model.scale_prior(2.0)
    model = _fitted()
    model.kernel.register_constraint("raw_outputscale", gpytorch.constraints.Interval(0.1, 2.0))
    model.kernel.outputscale = 0.6
    model.fit()
    s0, noise0, alpha0 = float(model.kernel.outputscale.detach()), float(model.noise.detach()), model.alpha.clone()
    with pytest.raises(ValueError, match="scale_prior"):
        model.scale_prior(10.0)  # 6.0 is outside (0.1, 2)
    assert math.isclose(float(model.kernel.outputscale.detach()), s0, rel_tol=1e-6)
    assert math.isclose(float(model.noise.detach()), noise0, rel_tol=1e-12)
    torch.testing.assert_close(model.alpha, alpha0)
    model(make_data(3, 3)[0])  # still fitted


def test_scale_prior_restores_the_raw_values_when_the_noise_constraint_refuses():
    x, y = make_data(200, 3)
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.Interval(1e-4, 0.5)).double()
    lik.noise = 0.02
    model = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=20, likelihood=lik, tol=1e-12,
                     max_iter=1000).fit()
    raw_s = model.kernel.raw_outputscale.detach().clone()
    raw_n = model.likelihood.raw_noise.detach().clone()
    xv = make_data(5, 3, seed=3)[0]
    model.eval()
    with torch.no_grad():
        mean0 = model(xv).mean
    with pytest.raises(ValueError, match="scale_prior"):
        model.scale_prior(1e4)  # noise 0.02 -> 200, outside (1e-4, 0.5); the outputscale would have taken it
    assert torch.equal(model.kernel.raw_outputscale.detach(), raw_s)
    assert torch.equal(model.likelihood.raw_noise.detach(), raw_n)
    with torch.no_grad():
        torch.testing.assert_close(model(xv).mean, mean0)  # still fitted, the same model


# ------------------------------------------------------------------------ preconditioned_variances
@pytest.mark.parametrize("weighted", [False, True])
def test_preconditioned_variances_equal_their_dense_formula(weighted):
    """``sigma^2 + k - k D (D K D + j I)^{-1} D k + sigma^2 k D ((n/M) K_j^2 + n lam K_j)^{-1} D k`` with
    ``K_j = D K_MM D + j I``: what ``T^T T = K_j`` and ``B B^T`` make of the exact variance (dense solves)."""
    torch.manual_seed(0)
    x, _ = make_data(60, 3, seed=2)
    centers = make_data(25, 3, seed=3)[0]
    k = make_kernel("scale_matern52", 3)
    kmm = dense_kernel(k, centers, centers)
    w = torch.rand(25, dtype=torch.float64) + 0.5 if weighted else None
    n, lam, noise = 1000, 1e-3, 0.3
    pre = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=w)
    got = preconditioned_variances(k, x, centers, pre, noise)
    d = torch.ones(25, dtype=torch.float64) if w is None else w
    kj = d[:, None] * kmm * d[None, :] + pre.jitter * torch.eye(25, dtype=torch.float64)
    kmx = d[:, None] * dense_kernel(k, centers, x)
    q = (kmx * torch.linalg.solve(kj, kmx)).sum(0)
    h = (kmx * torch.linalg.solve((n / 25) * kj @ kj + n * lam * kj, kmx)).sum(0)
    ref = noise + dense_kernel(k, x, x).diagonal() - q + noise * h
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-12)


def test_preconditioned_variances_approximate_the_exact_predictive_variance():
    """Uniform centers, n >> M: only ``H^{-1}``'s term is approximated, so the total is close to the exact
    predictive variance of the fitted model."""
    model = _fitted(n=2000, m=60, lam=1e-4)
    xt = make_data(50, 3, seed=9)[0]
    op = model.nystrom_operator()
    pre = FalkonPreconditioner.from_kernel_matrix(op.kmm, model.penalty.detach(), model.n)
    got = preconditioned_variances(model.kernel, xt, model.centers.detach(), pre, float(model.noise.detach()))
    with torch.no_grad():
        exact = model.likelihood(model(xt)).variance
    rel = ((got - exact) / exact).abs()
    assert float(rel.mean()) < 0.03 and float(rel.max()) < 0.15, (float(rel.mean()), float(rel.max()))
    # the first two terms alone are a lower bound of the exact variance (the third is >= 0)
    two = got - float(model.noise.detach()) * _h_term(model, xt, pre)
    assert bool((two <= exact * (1 + 1e-9)).all())


def _h_term(model: FalkonGP, x: torch.Tensor, pre: FalkonPreconditioner) -> torch.Tensor:
    """``||B^T k_Mx||^2`` by the preconditioner's own ``apply_bt`` (the third term's coefficient)."""
    with torch.no_grad():
        kmx = dense_kernel(model.kernel, model.centers.detach(), x)
    return pre.apply_bt(kmx).square().sum(0)


def test_preconditioned_variances_reject_bad_input():
    model = _fitted()
    pre = FalkonPreconditioner.from_kernel_matrix(model.nystrom_operator().kmm, 1e-3, 400)
    c = model.centers.detach()
    with pytest.raises(ValueError, match="x must"):
        preconditioned_variances(model.kernel, torch.zeros(4, 2, dtype=torch.float64), c, pre, 0.1)
    with pytest.raises(ValueError, match="noise"):
        preconditioned_variances(model.kernel, torch.zeros(4, 3, dtype=torch.float64), c, pre, 0.0)


# ----------------------------------------------------------------------------------- variance_scale
def test_variance_scale_is_the_gaussian_likelihood_maximiser():
    g = torch.Generator().manual_seed(0)
    v = torch.rand(500, generator=g, dtype=torch.float64) + 0.1
    r = torch.randn(500, generator=g, dtype=torch.float64) * (4.0 * v).sqrt()
    c = variance_scale(r, v)
    assert 3.0 < c < 5.0

    def loglik(s: float) -> float:
        return float(torch.distributions.Normal(0.0, (s * v).sqrt()).log_prob(r).sum())

    assert loglik(c) > loglik(c * 1.01) and loglik(c) > loglik(c / 1.01)
    # exactly r^2 = c0 v gives c0
    assert math.isclose(variance_scale((2.5 * v).sqrt(), v), 2.5, rel_tol=1e-12)


@pytest.mark.parametrize(
    "r, v, match",
    [
        (torch.ones(3), torch.ones(4), "same non-zero size"),
        (torch.ones(0), torch.ones(0), "same non-zero size"),
        (torch.tensor([1.0, float("nan")]), torch.ones(2), "residuals"),
        (torch.ones(2), torch.tensor([1.0, 0.0]), "variances"),
        (torch.ones(2), torch.tensor([1.0, float("inf")]), "variances"),
    ],
)
def test_variance_scale_rejects_bad_input(r, v, match):
    with pytest.raises(ValueError, match=match):
        variance_scale(r, v)


# ------------------------------------------------------------------------------ calibrate_variance
@pytest.mark.parametrize("t", [None, 2])
def test_calibrate_variance_returns_the_closed_form_scale_and_applies_it(t):
    """A penalty far from the data's noise (noise 1e-5 against residuals ~0.1): ``c`` is ``mean(r^2 / v)`` of the
    model's own predictive variances (recomputed here by the dense formulas of docs/math.md §4), the mean is
    unchanged, and after it the same rows give ``mean(r^2 / v) = 1``."""
    x, y = make_data(400, 3, t=t)
    xv, yv = make_data(150, 3, t=t, seed=11)
    k = make_kernel("scale_matern52", 3)
    model = FalkonGP(x, y, kernel=k, num_centers=40, penalty=1e-5 / 400, tol=1e-12, max_iter=1000).fit()
    model.eval()
    with torch.no_grad():
        mean0 = model(xv).mean.clone()
    # the dense reference: v = sigma^2 + K_** - Q_** + sigma^2 K_*M H^{-1} K_M*
    k.requires_grad_(False)
    c_, s2 = model.centers.detach(), float(model.noise.detach())
    kmm, kvm = dense_kernel(k, c_, c_), dense_kernel(k, xv, c_)
    knm = dense_kernel(k, x, c_)
    h = knm.T @ knm + s2 * kmm
    var = s2 + dense_kernel(k, xv, xv).diagonal() - (kvm * torch.linalg.solve(kmm, kvm.T).T).sum(1) \
        + s2 * (kvm * torch.linalg.solve(h, kvm.T).T).sum(1)
    var = var if t is None else var.unsqueeze(-1).expand(-1, t)
    c_ref = float(((yv - mean0) ** 2 / var).mean())
    c = model.calibrate_variance(xv, yv)
    assert c > 5  # the variances were far too small
    assert math.isclose(c, c_ref, rel_tol=1e-6)
    with torch.no_grad():
        p = model.likelihood(model(xv))
    torch.testing.assert_close(p.mean, mean0, rtol=1e-9, atol=1e-9)
    assert math.isclose(float(((yv - p.mean) ** 2 / p.variance).mean()), 1.0, rel_tol=1e-9)
    assert model.training is False


def test_calibrate_variance_rejects_bad_input():
    model = _fitted()
    x = model.train_inputs[0]
    xv, yv = make_data(20, 3, seed=4)
    with pytest.raises(ValueError, match="val_y must have shape"):
        model.calibrate_variance(xv, yv[:-1])
    with pytest.raises(ValueError, match="NaN"):
        model.calibrate_variance(xv, torch.full_like(yv, float("nan")))
    with pytest.raises(ValueError, match="held-out"):
        model.calibrate_variance(x, model.train_targets)
    with pytest.raises(TypeError, match="val_y"):
        model.calibrate_variance(xv, yv.tolist())
    model.train()
    model.calibrate_variance(xv, yv)
    assert model.training  # the mode is restored
