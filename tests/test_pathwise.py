"""FalkonModel with BoTorch's pathwise samplers (gpfalkon.integrations.pathwise): Matheron paths whose moments are
the model's posterior, and the acquisition functions and optimisers built on them."""
from __future__ import annotations

import warnings

import pytest
import torch
from botorch.models.transforms.input import Normalize
from botorch.sampling.pathwise import draw_matheron_paths

from gpfalkon import NotFittedError
from gpfalkon.botorch import FalkonModel


def _data(n=200, seed=0, m=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 - 1  # outside the unit cube: Normalize matters
    Y = torch.sin(2 * X[:, :1]) + torch.cos(1.5 * X[:, 1:]) + 0.05 * torch.randn(n, 1, generator=g,
                                                                                   dtype=torch.float64)
    return X, (Y if m == 1 else torch.cat([Y, -2 * Y + 1], -1))


XT = torch.rand(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 4 - 1


def _paths_and_posterior(model, n=20_000):
    """``n`` paths at XT (seed 0) and the model's posterior there."""
    torch.manual_seed(0)
    paths = draw_matheron_paths(model, sample_shape=torch.Size([n]))
    with torch.no_grad():
        return paths(XT), model.posterior(XT)


def _assert_moments(v, mean, var):
    """Paths ``v`` (``S x q``) have mean ``mean`` to 0.05 of the largest posterior sd (Monte-Carlo error
    ``sd / sqrt(S)`` ~ 0.007 sd; the random features add a few percent of the prior) and variances ``var`` to 15 %."""
    torch.testing.assert_close(v.mean(0), mean, rtol=0, atol=float(0.05 * var.sqrt().max()))
    ratio = v.var(0) / var
    assert bool(((ratio > 0.85) & (ratio < 1.15)).all()), ratio


@pytest.mark.parametrize("transforms", [False, True])
def test_matheron_paths_have_the_models_posterior_moments(transforms):
    """The Monte-Carlo mean and covariance of 20,000 paths at 5 points equal the model's posterior mean and
    covariance (DTC, M = 60 centers of 200 rows; the prior drawn by 1,024 random features), in the raw outcome
    units with Standardize and Normalize; a fixed seed makes the draws reproducible."""
    X, Y = _data()
    kw = dict(input_transform=Normalize(d=2)) if transforms else dict(outcome_transform=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BoTorch's input-scaling notice without Normalize
        model = FalkonModel(X, Y, num_centers=60, tol=1e-12, max_iter=500, **kw)
    v, post = _paths_and_posterior(model)
    assert v.shape == (20_000, 5)
    mean, cov = post.mean.squeeze(-1).detach(), post.distribution.covariance_matrix.detach()
    sd = cov.diagonal().sqrt()
    _assert_moments(v, mean, cov.diagonal())
    mc_cov = torch.cov(v.T)
    corr = cov / sd.outer(sd)
    mc_corr = mc_cov / mc_cov.diagonal().sqrt().outer(mc_cov.diagonal().sqrt())
    # the random features' prior is off by a few hundredths of its variance in the cross-covariances; BoTorch's own
    # paths of a SingleTaskGP on these data and points are off by up to 0.13 in correlation (0.79-1.05 in variance)
    torch.testing.assert_close(mc_corr, corr, rtol=0, atol=0.15)
    torch.manual_seed(1)
    a = draw_matheron_paths(model, sample_shape=torch.Size([3]))(XT)
    torch.manual_seed(1)
    b = draw_matheron_paths(model, sample_shape=torch.Size([3]))(XT)
    torch.testing.assert_close(a, b)


def test_a_float32_models_paths_are_its_float64_twins_paths():
    """The paths are computed in float64 whatever the model's dtype (the update's large weights would amplify float32
    kernel values: +4-16 % path variance): a float32 model's paths, same seed, centred by its posterior mean, equal
    the float64 model's to 1 % of the paths' spread, come back in float32, and have gradients with respect to X."""
    X, Y = _data(n=300)
    Y = Y + 5.0
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = FalkonModel(X.to(dtype), Y.to(dtype), num_centers=60, tol=1e-10, max_iter=500,
                            input_transform=Normalize(d=2))
        torch.manual_seed(0)
        paths = draw_matheron_paths(model, sample_shape=torch.Size([64]))
        x = XT.to(dtype).detach().clone().requires_grad_(True)
        values = paths(x)
        values.sum().backward()
        assert values.dtype == dtype and x.grad is not None and bool(torch.isfinite(x.grad).all())
        # centred by the model's own posterior mean: the two fits' means differ by float32 CG's error
        out[dtype] = (values - model.posterior(x).mean.squeeze(-1)).detach().double()
    scale = float(out[torch.float64].std(0).max())
    err = float((out[torch.float32] - out[torch.float64]).abs().max())
    assert err < 0.01 * scale, (err, scale)


def test_pathwise_thompson_sampling_and_posterior_sample_optima_run():
    """PathwiseThompsonSampling through optimize_acqf, and optimize_posterior_samples, on a FalkonModel: finite
    candidates in the bounds; a path's optimum is at least as good as any of the raw points it was started from."""
    from botorch.acquisition.thompson_sampling import PathwiseThompsonSampling
    from botorch.optim import optimize_acqf
    from botorch.utils.sampling import optimize_posterior_samples

    X, Y = _data()
    X = (X + 1) / 4  # the unit cube
    model = FalkonModel(X, Y, num_centers=50)
    bounds = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    torch.manual_seed(0)
    acqf = PathwiseThompsonSampling(model)
    cand, value = optimize_acqf(acqf, bounds=bounds, q=1, num_restarts=2, raw_samples=64)
    assert cand.shape == (1, 2) and bool(((cand >= 0) & (cand <= 1)).all()) and bool(torch.isfinite(value).all())
    paths = draw_matheron_paths(model, sample_shape=torch.Size([4]))
    x_opt, f_opt = optimize_posterior_samples(paths=paths, bounds=bounds, raw_samples=128, num_restarts=2)
    assert x_opt.shape[0] == 4 and bool(torch.isfinite(f_opt).all())
    grid = torch.rand(256, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert bool((f_opt.reshape(4) >= paths(grid).max(-1).values - 1e-6).all())


def test_multi_output_paths_have_each_outputs_posterior_moments():
    """A two-output model (Standardize, Normalize; outputs of different scales and means): 20,000 paths, laid out
    ``sample x m x q`` as BoTorch's multi-output GPs', have each output's posterior mean and variance, and the outputs
    are independent draws (their Monte-Carlo correlation is Monte-Carlo noise). ``MatheronPathModel`` gives
    ``sample x q x m`` values whose mean is the posterior mean."""
    from botorch.models.deterministic import MatheronPathModel

    X, Y = _data(m=2)
    Y = Y * torch.tensor([1.0, 30.0], dtype=torch.float64) + torch.tensor([0.0, 100.0], dtype=torch.float64)
    model = FalkonModel(X, Y, num_centers=60, tol=1e-12, max_iter=500, input_transform=Normalize(d=2))
    v, post = _paths_and_posterior(model)
    with torch.no_grad():
        mean, var = post.mean, post.variance  # q x m
    assert v.shape == (20_000, 2, 5)
    for j in range(2):
        _assert_moments(v[:, j], mean[:, j], var[:, j])
    cross = torch.stack([torch.corrcoef(torch.stack([v[:, 0, i], v[:, 1, i]]))[0, 1] for i in range(5)])
    assert float(cross.abs().max()) < 0.05, cross  # 4 / sqrt(20,000) = 0.028 is the Monte-Carlo scale
    with torch.no_grad():
        draws = MatheronPathModel(model, sample_shape=torch.Size([2_000]), seed=1)(XT)
    assert draws.shape == (2_000, 5, 2)
    torch.testing.assert_close(draws.mean(0), mean, rtol=0, atol=float(0.1 * var.sqrt().max()))  # 4.5 std. errors


def test_pathwise_refusals():
    X, Y = _data(m=2)
    model = FalkonModel(X, Y, num_centers=30)
    from botorch.sampling.pathwise.update_strategies import gaussian_update
    with pytest.raises(ValueError, match="the prior at the 30 centers for each of the 2 outputs"):
        gaussian_update(model=model, likelihood=model.likelihood, sample_values=torch.zeros(3, 30))
    unfitted = FalkonModel(X, Y[:, :1], num_centers=30, fit=False)
    with pytest.raises(NotFittedError):
        draw_matheron_paths(unfitted, sample_shape=torch.Size([2]))
