"""FalkonModel inside BoTorch: posterior, transforms, acquisition optimisation, gradients."""
from __future__ import annotations

import gpytorch
import pytest
import torch
from botorch.acquisition.logei import qLogNoisyExpectedImprovement
from botorch.models.transforms.input import Normalize
from botorch.models.transforms.outcome import Standardize
from botorch.optim import optimize_acqf
from botorch.posteriors import GPyTorchPosterior
from conftest import dense_kernel, make_kernel

from gpfalkon import FalkonGP
from gpfalkon.botorch import FalkonModel


def _data(n=300, d=2, m=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64)
    f = torch.sin(6 * X[:, :1]) + torch.cos(4 * X[:, 1:2])
    Y = torch.cat([f * (j + 1) + 0.05 * torch.randn(n, 1, generator=g, dtype=torch.float64) for j in range(m)], -1)
    return X, Y


def test_posterior_equals_falkongp_and_dense_sgpr_formulas():
    X, Y = _data()
    k = make_kernel("scale_matern52", 2)
    model = FalkonModel(X, Y, kernel=k, num_centers=30, penalty=1e-4, outcome_transform=None, tol=1e-12, max_iter=1000)
    ref = FalkonGP(X, Y.squeeze(-1), kernel=k, centers=model.centers, penalty=1e-4, tol=1e-12, max_iter=1000).fit().eval()
    Xt = torch.rand(4, 3, 2, dtype=torch.float64)  # batch of 4 joint q=3 posteriors
    post = model.posterior(Xt)
    assert isinstance(post, GPyTorchPosterior) and post.mean.shape == (4, 3, 1)
    with torch.no_grad():
        p = ref(Xt)
        torch.testing.assert_close(post.mean.squeeze(-1), p.mean)
        torch.testing.assert_close(post.distribution.covariance_matrix, p.covariance_matrix)
        # docs/math.md §4 with sigma^2 = n lambda, dense
        c, n, lam = model.centers, X.shape[0], 1e-4
        knm, kmm, ktm = dense_kernel(k, X, c), dense_kernel(k, c, c), dense_kernel(k, Xt[1], c)
        H = knm.T @ knm + n * lam * kmm
        cov = dense_kernel(k, Xt[1], Xt[1]) - ktm @ torch.linalg.solve(kmm, ktm.T) + n * lam * ktm @ torch.linalg.solve(H, ktm.T)
        torch.testing.assert_close(post.distribution.covariance_matrix[1], cov, rtol=1e-6, atol=1e-10)
        noisy = model.posterior(Xt, observation_noise=True)
        torch.testing.assert_close(noisy.variance, post.variance + n * lam)


def test_transforms_and_multi_output():
    X, Y = _data(m=2)
    X = X * 10 + 3  # inputs far from the unit cube: Normalize matters
    model = FalkonModel(X, Y, num_centers=40, penalty=1e-4, input_transform=Normalize(d=2),
                        outcome_transform=Standardize(m=2))
    assert model.num_outputs == 2
    Xt = X[:5]
    post = model.posterior(Xt)
    assert post.mean.shape == (5, 2)
    # the posterior mean fits the data in original units, for both outputs
    assert ((post.mean - Y[:5]).abs() < 0.3 * Y.std(0)).all()
    # equals a FalkonGP fitted by hand on the transformed data, untransformed
    xs = (X - X.min(0).values) / (X.max(0).values - X.min(0).values)
    ym, ys = Y.mean(0), Y.std(0)
    ref = FalkonGP(xs, (Y - ym) / ys, kernel=model.kernel, centers=model.centers, penalty=1e-4).fit().eval()
    with torch.no_grad():
        pr = ref(xs[:5])
    torch.testing.assert_close(post.mean, pr.mean * ys + ym, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(post.variance, pr.variance * ys**2, rtol=1e-6, atol=1e-8)


def test_qlognei_optimize_acqf_end_to_end():
    X, Y = _data(n=400)
    model = FalkonModel(X, Y, num_centers=50, penalty=1e-4)
    acqf = qLogNoisyExpectedImprovement(model, X_baseline=X, prune_baseline=True)
    bounds = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    cand, val = optimize_acqf(acqf, bounds=bounds, q=2, num_restarts=2, raw_samples=32)
    assert cand.shape == (2, 2) and torch.isfinite(val)
    assert ((cand >= 0) & (cand <= 1)).all()


def test_posterior_gradients_wrt_candidates():
    X, Y = _data(n=200)
    model = FalkonModel(X, Y, num_centers=25, penalty=1e-4)

    def f(z):
        p = model.posterior(z)
        return p.mean.sum() + p.variance.sum() + p.distribution.covariance_matrix.sum()

    z = torch.rand(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (z,))


def test_condition_on_observations_refits_with_fixed_noise():
    X, Y = _data(n=300)
    model = FalkonModel(X[:250], Y[:250], num_centers=30, penalty=1e-4, outcome_transform=None, tol=1e-12, max_iter=1000)
    noise = model.noise.detach().clone()
    new = model.condition_on_observations(X[250:], Y[250:])
    torch.testing.assert_close(new.noise, noise)
    assert new.train_inputs[0].shape[0] == 300
    ref = FalkonGP(X, Y.squeeze(-1), kernel=model.kernel, centers=model.centers, penalty=float(noise) / 300,
                   tol=1e-12, max_iter=1000).fit().eval()
    Xt = torch.rand(6, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(new.posterior(Xt).mean.squeeze(-1), ref(Xt).mean, rtol=1e-8, atol=1e-8)
    with pytest.raises(NotImplementedError, match="batched fantasies"):
        model.condition_on_observations(X[None, :3], Y[None, :3])


def test_bad_training_shapes():
    X, Y = _data(n=50)
    with pytest.raises(ValueError, match="train_Y"):
        FalkonModel(X, Y.squeeze(-1), num_centers=5)
    with pytest.raises(ValueError, match="train_X"):
        FalkonModel(X[0], Y, num_centers=5)


def test_posterior_transform_and_subset_of_outputs():
    from botorch.acquisition.objective import ScalarizedPosteriorTransform

    X, Y = _data(m=2)
    model = FalkonModel(X, Y, num_centers=30, penalty=1e-4)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    Xt = torch.rand(5, 2, dtype=torch.float64)
    full = model.posterior(Xt)
    scal = model.posterior(Xt, posterior_transform=ScalarizedPosteriorTransform(weights=w))
    torch.testing.assert_close(scal.mean.squeeze(-1), full.mean @ w)
    # outputs are independent given the data (covariance C kron I): Var(w^T f) = sum_j w_j^2 var_j
    torch.testing.assert_close(scal.variance.squeeze(-1), full.variance @ w**2)
