"""FalkonGP against GPyTorch's SGPR, dense formulas, and its own contracts."""
from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch
from gpytorch.utils.warnings import GPInputWarning
from linear_operator.operators import ZeroLinearOperator

from gpfalkon import FalkonGP, FalkonOptions, NotFittedError
from gpfalkon.models.posterior import NystromPosteriorCovariance

from conftest import dense_kernel, dense_nystrom, float32_exact_data, make_data, make_kernel


class SGPR(gpytorch.models.ExactGP):
    """GPyTorch's own SGPR: InducingPointKernel + ExactGP (the reference)."""

    def __init__(self, x, y, kernel, inducing, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.InducingPointKernel(
            kernel, inducing_points=inducing, likelihood=likelihood
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _fitted(name="scale_matern52", n=400, d=3, m=30, lam=1e-4, t=None, dtype=torch.float64, **kw):
    x, y = make_data(n, d, t=t, dtype=dtype)
    k = make_kernel(name, d, dtype=dtype)
    model = FalkonGP(x, y, kernel=k, num_centers=m, penalty=lam, tol=1e-12, max_iter=1000, **kw)
    model.fit()
    model.eval()
    return model, x, y, k


@pytest.mark.parametrize("name", ["rbf", "scale_matern52", "matern12"])
def test_posterior_equals_gpytorch_sgpr(name):
    model, x, y, k = _fitted(name)
    xt = make_data(25, 3, seed=7)[0]
    n, lam = x.shape[0], 1e-4
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.Positive()).double()
    lik.noise = n * lam
    ref = SGPR(x, y, k, model.centers.clone(), lik).double()
    ref.eval()
    # GPyTorch's default "diagonal correction" turns SGPR into a FITC-like model at
    # prediction time; the Titsias/DTC posterior (docs/math.md §4) is the one without it.
    # GPyTorch's test covariance is then the low-rank Q_** part, so the DTC term
    # K_** - Q_** is added from the dense closed form.
    with torch.no_grad(), gpytorch.settings.sgpr_diagonal_correction(False), gpytorch.settings.max_cholesky_size(10**9):
        p_ref = ref(xt)
        ref_mean, ref_cov = p_ref.mean, p_ref.covariance_matrix
        kxm = dense_kernel(k, xt, model.centers)
        q = kxm @ torch.linalg.solve(dense_kernel(k, model.centers, model.centers), kxm.T)
        ref_cov = ref_cov + dense_kernel(k, xt, xt) - q
        p = model(xt)
    assert isinstance(p, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(p.mean, ref_mean, rtol=1e-6, atol=1e-6 * ref_mean.abs().max().item())
    torch.testing.assert_close(p.covariance_matrix, ref_cov, rtol=1e-6, atol=1e-6 * ref_cov.diagonal().max().item())
    torch.testing.assert_close(p.variance, ref_cov.diagonal(), rtol=1e-6, atol=1e-12)
    # likelihood(model(x)) adds sigma^2 = n lambda
    with torch.no_grad():
        torch.testing.assert_close(model.likelihood(p).variance, p.variance + n * lam)


def test_posterior_matches_dense_formulas():
    """docs/math.md §4: mean K_*M alpha; cov K_** - K_*M K_MM^-1 K_M* + n lam K_*M H^-1 K_M*."""
    model, x, y, k = _fitted("rbf", lam=1e-3)
    xt = make_data(10, 3, seed=9)[0]
    n, lam, c = x.shape[0], 1e-3, model.centers
    with torch.no_grad():
        knm, kmm, ktm = dense_kernel(k, x, c), dense_kernel(k, c, c), dense_kernel(k, xt, c)
        H = knm.T @ knm + n * lam * kmm
        mean = ktm @ torch.linalg.solve(H, knm.T @ y)
        cov = (
            dense_kernel(k, xt, xt)
            - ktm @ torch.linalg.solve(kmm, ktm.T)
            + n * lam * ktm @ torch.linalg.solve(H, ktm.T)
        )
        p = model(xt)
    torch.testing.assert_close(p.mean, mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(p.covariance_matrix, cov, rtol=1e-6, atol=1e-10)


def test_multi_output_is_joint_and_consistent():
    model, x, y, k = _fitted("rbf", t=3)
    xt = make_data(12, 3, seed=2)[0]
    with torch.no_grad():
        p = model(xt)
        assert isinstance(p, gpytorch.distributions.MultitaskMultivariateNormal)
        assert p.mean.shape == (12, 3) and p.variance.shape == (12, 3)
        assert model.alpha.shape == (30, 3)
        for j in range(3):
            single = FalkonGP(x, y[:, j], kernel=k, centers=model.centers, penalty=1e-4, tol=1e-12, max_iter=1000)
            single.fit().eval()
            ps = single(xt)
            torch.testing.assert_close(p.mean[:, j], ps.mean, rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(p.variance[:, j], ps.variance, rtol=1e-10, atol=1e-12)
        pl = model.likelihood(p)
        torch.testing.assert_close(pl.variance, p.variance + model.noise)


def test_float32_model_close_to_float64():
    m64, _x, _y, _ = _fitted("matern52", lam=1e-5)
    m32, _, _, _ = _fitted("matern52", lam=1e-5, dtype=torch.float32)
    torch.testing.assert_close(m32.centers.double(), m64.centers)
    xt = make_data(40, 3, seed=5)[0]
    with torch.no_grad():
        p64, p32 = m64(xt), m32(xt.float())
    assert p32.mean.dtype == torch.float32
    assert ((p32.mean.double() - p64.mean).norm() / p64.mean.norm()) < 1e-4
    torch.testing.assert_close(p32.variance.double(), p64.variance, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("lengthscale", [3.0, 30.0])
@pytest.mark.parametrize("store", [True, False])
def test_float32_variances_match_float64_where_k_mm_is_numerically_singular(lengthscale, store):
    """RBF with a long lengthscale, 200 centers on 3,000 rows: K_MM is singular in float32. The variance factors'
    pass computes float64 kernel values from the float32 rows, so the float32 model's variances are the float64
    model's to ~1e-7 (with float32 kernel values they were 7-83 % off; the factors of fit(compute_variance=True)
    likewise). The float32 store (store=True) is not what the factors read."""
    x, y, xt, centers = float32_exact_data(3000, 100, 200)
    out = []
    for dtype in (torch.float64, torch.float32):
        k = gpytorch.kernels.RBFKernel().to(dtype)
        k.lengthscale = torch.tensor(lengthscale, dtype=dtype)
        m = FalkonGP(x.to(dtype), y.to(dtype), kernel=k, centers=centers.to(dtype), penalty=1e-6,
                     store_kernel=store)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CG's float32 advice at this penalty
            m.fit(compute_variance=dtype == torch.float32)
        m.eval()
        with torch.no_grad():
            out.append(m(xt.to(dtype)).variance.double())
    rel = ((out[1] - out[0]).abs() / out[0]).max()
    assert float(rel) < 1e-5, float(rel)


def test_state_dict_round_trip_is_exact():
    model, x, y, _k = _fitted("scale_matern52", learn_centers=True)
    xt = make_data(15, 3, seed=3)[0]
    with torch.no_grad():
        p = model(xt)
    sd = model.state_dict()
    assert {"centers", "alpha", "fitted"} <= set(sd)
    fresh = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=30, seed=99, learn_centers=True)
    fresh.load_state_dict(sd)
    fresh.eval()
    with torch.no_grad():
        q = fresh(xt)
    assert torch.equal(p.mean, q.mean)
    assert torch.equal(p.covariance_matrix, q.covariance_matrix)
    assert torch.equal(fresh.penalty, model.penalty)


def test_penalty_and_likelihood_are_one_quantity():
    x, y = make_data(200, 2)
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=10, penalty=3e-5)
    torch.testing.assert_close(model.penalty, torch.tensor(3e-5, dtype=torch.float64))
    torch.testing.assert_close(model.likelihood.noise.squeeze(), torch.tensor(200 * 3e-5, dtype=torch.float64))
    model.likelihood.noise = 0.5
    torch.testing.assert_close(model.penalty, torch.tensor(0.5 / 200, dtype=torch.float64))
    # a user likelihood sets the penalty: lambda = noise / n
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = 0.02
    m2 = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=10, likelihood=lik)
    torch.testing.assert_close(m2.penalty, torch.tensor(0.02 / 200, dtype=torch.float64))
    # a penalty the likelihood's constraint cannot hold is an error naming the penalty
    with pytest.raises(ValueError, match="penalty"):
        FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=10, likelihood=lik, penalty=1e-9)
    # the penalty is a differentiable function of the (log-space) raw noise
    model.penalty.backward()
    assert model.likelihood.raw_noise.grad is not None
    names = {n for n, _ in model.named_parameters()}
    assert "likelihood.noise_covar.raw_noise" in names


def test_refit_required_after_hyperparameter_change():
    model, _x, _y, k = _fitted("rbf")
    xt = make_data(5, 3, seed=1)[0]
    with torch.no_grad():
        model(xt)
        k.lengthscale = k.lengthscale * 1.1
        with pytest.raises(NotFittedError, match="changed since"):
            model(xt)
        model.fit()
        model(xt)
        model.penalty = 1e-3
        with pytest.raises(NotFittedError, match="changed since"):
            model(xt)


def test_a_kept_posterior_refuses_to_mix_two_models():
    """The posterior's covariance is lazy (it reads the kernel when evaluated, beside the fit's factors): a posterior
    kept across a hyperparameter change, scale_prior or a refit raises NotFittedError when read, instead of mixing the
    new kernel with the old factors (the variances went negative or to zero); unchanged, it reads the same values
    again, and its variances equal the dense DTC formula."""
    model, x, _y, k = _fitted("scale_matern52")
    xt = make_data(6, 3, seed=2)[0]
    with torch.no_grad():
        kept = model(xt)
        v0 = kept.variance.clone()
        torch.testing.assert_close(kept.variance, v0, rtol=0, atol=0)
        kmm = dense_kernel(k, model.centers, model.centers)
        kxm, kmn = dense_kernel(k, xt, model.centers), dense_kernel(k, model.centers, x)
        h = kmn @ kmn.mT + model.noise * kmm
        want = (dense_kernel(k, xt, xt).diagonal() - (kxm @ torch.linalg.solve(kmm, kxm.mT)).diagonal()
                + model.noise * (kxm @ torch.linalg.solve(h, kxm.mT)).diagonal())
        torch.testing.assert_close(v0, want, rtol=1e-6, atol=1e-9)
        for change in ("outputscale", "scale_prior", "refit"):
            if change == "outputscale":
                k.outputscale = k.outputscale * 10
            elif change == "scale_prior":
                model.scale_prior(4.0)
            else:
                model.fit()
            for read in (lambda p: p.variance, lambda p: p.covariance_matrix, lambda p: p.lazy_covariance_matrix @ v0):
                with pytest.raises(NotFittedError, match="after this posterior was formed"):
                    read(kept)
            if change == "outputscale":
                model.fit()
            kept = model(xt)
            assert torch.isfinite(kept.variance).all()  # a fresh posterior reads
        torch.testing.assert_close(model(xt).variance, kept.variance, rtol=0, atol=0)


def test_a_posterior_formed_without_grad_builds_no_graph_when_read():
    """BoTorch forms posteriors under no_grad and draws samples outside it (qLogNEHVI's box decomposition): the lazy
    covariance evaluates in the grad mode it was formed in, so nothing read from it carries a graph back to the
    kernel's parameters (a second backward through such a graph raised); formed with grad on, it keeps the graph."""
    model, _x, _y, k = _fitted("scale_matern52")
    xt = make_data(5, 3, seed=3)[0]
    with torch.no_grad():
        quiet = model(xt)
    assert not quiet.variance.requires_grad and not quiet.covariance_matrix.requires_grad
    assert not quiet.rsample(torch.Size([2])).requires_grad
    live = model(xt)
    v = live.variance
    assert v.requires_grad
    (g,) = torch.autograd.grad(v.sum(), k.raw_outputscale)
    assert float(g.abs()) > 0
    torch.testing.assert_close(v.detach(), quiet.variance, rtol=1e-12, atol=0)


def test_prediction_needs_fit_and_valid_inputs():
    x, y = make_data(100, 2)
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=10)
    model.eval()
    with pytest.raises(NotFittedError, match="fit"):
        model(x[:3])
    model.fit()
    with pytest.raises(ValueError, match="x must have shape"):
        model(torch.zeros(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN"):
        model(torch.full((3, 2), float("nan"), dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        model(torch.zeros(3, 2, dtype=torch.int64))


def test_train_mode_returns_prior_and_skip_variances():
    model, x, _y, k = _fitted("rbf")
    xt = make_data(6, 3, seed=11)[0]
    model.train()
    with pytest.warns(GPInputWarning, match="call model.eval"):  # a fitted model queried in train mode
        prior = model(xt)
    torch.testing.assert_close(prior.covariance_matrix, dense_kernel(k, xt, xt))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPInputWarning)
        model(x)  # the training inputs (what an MLL evaluates): no warning
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        p = model(xt)
        assert isinstance(p.lazy_covariance_matrix, ZeroLinearOperator)
        model._factors = None
        p = model(xt)
        assert model._factors is None  # the O(n M^2) variance factors were not formed


def test_batched_test_inputs_and_gradient_wrt_inputs():
    model, _x, _y, _k = _fitted("scale_matern52")
    xt = make_data(8, 3, seed=4)[0].reshape(2, 4, 3)
    with torch.no_grad():
        pb = model(xt)
        assert pb.mean.shape == (2, 4) and pb.covariance_matrix.shape == (2, 4, 4)
        for i in range(2):
            pi = model(xt[i])
            torch.testing.assert_close(pb.mean[i], pi.mean)
            torch.testing.assert_close(pb.covariance_matrix[i], pi.covariance_matrix)

    def f(z):
        p = model(z)
        return p.mean.sum() + p.variance.sum()

    z = xt[0].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (z,))


def test_user_centers_and_reproducible_sampling():
    x, y = make_data(200, 2)
    c = x[:7] + 0.01
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 2), centers=c)
    assert torch.equal(model.centers, c) and model.centers is not c
    a = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=20, seed=3).centers
    b = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=20, generator=torch.Generator().manual_seed(3)).centers
    other = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=20, seed=4).centers
    assert torch.equal(a, b) and not torch.equal(a, other)
    assert len({tuple(r.tolist()) for r in a}) == 20  # without replacement
    learn = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=5, learn_centers=True)
    assert isinstance(learn.centers, torch.nn.Parameter)
    assert any(p is learn.centers for p in learn.parameters())


def test_fit_options_warm_start_variance_and_verbose(capsys):
    model, _x, _y, _k = _fitted("rbf", options=FalkonOptions(solve_method="cg"))  # CG's warm start
    iters = model.fit_info.iterations
    model.fit(warm_start=True, compute_variance=True)
    assert model.fit_info.iterations < iters / 2
    assert model._factors is not None
    model.fit(verbose=True, tol=1e-6)
    assert "FALKON CG" in capsys.readouterr().err


def test_fit_initial_alpha_starts_cg_from_given_coefficients():
    """``fit(initial_alpha=a)``: CG's initial residual is that of ``a`` (row 0 of the residual history, 1 for
    a cold start), the solution is the dense Nystrom solve's whatever the start, a start worse than zero is
    dropped, and bad starts are refused before any data pass, naming the argument."""
    from conftest import dense_nystrom

    x, y = make_data(400, 3)
    k = make_kernel("rbf", 3)
    model = FalkonGP(x, y, kernel=k, centers=x[:30].clone(), penalty=1e-4, tol=1e-10, max_iter=500,
                     options=FalkonOptions(solve_method="cg"))
    h, knm, _ = dense_nystrom(k, x, model.centers, 1e-4)
    ref = torch.linalg.solve(h, knm.T @ y)
    cold = model.fit().fit_info
    assert float(cold.residuals[0].max()) == pytest.approx(1.0, abs=1e-12)  # the rounding of |b| / |b|
    torch.testing.assert_close(model.alpha.reshape(-1), ref, rtol=1e-5, atol=1e-8)
    fitted = knm @ ref
    precond = model.nystrom_operator().preconditioner
    rhs = (knm.T @ y).unsqueeze(-1)
    for start in (ref, 0.9 * ref, 0.5 * ref + 0.01, -1e3 * ref):
        info = model.fit(initial_alpha=start.clone()).fit_info
        r0 = float(info.residuals[0].max())
        # CG on W beta = B^T rhs from beta0 = B^-1 a: its residual B^T (rhs - H a), relative to ||B^T rhs||
        expected = float(precond.apply_bt(rhs - h @ start.unsqueeze(-1)).norm() / precond.apply_bt(rhs).norm())
        if expected >= 1.0:
            assert r0 == pytest.approx(1.0, abs=1e-12)  # worse than zero: dropped
        else:
            assert r0 == pytest.approx(expected, rel=1e-5, abs=1e-9)
            if expected < 1e-3:  # a start at the solution: CG stops far sooner than from zero
                assert info.iterations < cold.iterations / 2
            # (starts at a residual of 0.1-0.3 reach tol within +-2 iterations of the cold start here, the count
            # moving with the products' summation order: 42-45 against 43-45 over the fused kernel's two loops
            # and the torch path, so it is not asserted)
        torch.testing.assert_close(knm @ model.alpha.reshape(-1), fitted, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="initial_alpha must have alpha's shape"):
        model.fit(initial_alpha=ref[:5])
    with pytest.raises(ValueError, match="initial_alpha must be floating point and finite"):
        model.fit(initial_alpha=torch.full_like(ref, float("nan")))
    with pytest.raises(ValueError, match="initial_alpha and warm_start"):
        model.fit(initial_alpha=ref, warm_start=True)
    with pytest.raises(TypeError, match="initial_alpha must be a tensor"):
        model.fit(initial_alpha=ref.tolist())


def _dense_mean(model, x, y, xt):
    """The posterior mean from the dense normal equations at the likelihood's noise (test reference)."""
    c = model.centers.detach()
    h, knm, _ = dense_nystrom(model.kernel, x, c, float(model.likelihood.noise.detach()) / x.shape[0])
    alpha = torch.linalg.solve(h, knm.T @ y)
    return dense_kernel(model.kernel, xt, c) @ alpha


def test_set_train_data_keeps_the_noise_and_requires_refit():
    """As ExactGP: the likelihood's noise sigma^2 stays, lambda = sigma^2 / n follows n; the refit matches the dense
    solve at that noise."""
    model, x, y, _k = _fitted("rbf")
    noise = model.likelihood.noise.detach().clone()
    model.set_train_data(x[:200], y[:200])
    torch.testing.assert_close(model.likelihood.noise.detach(), noise)
    torch.testing.assert_close(model.penalty.detach(), noise.reshape(()) / 200)
    with pytest.raises(NotFittedError):
        model(x[:2])
    model.fit()
    xt = x[:5] + 0.01
    torch.testing.assert_close(model(xt).mean, _dense_mean(model, x[:200], y[:200], xt), rtol=1e-7, atol=1e-8)


def test_set_train_data_refused_changes_nothing():
    """A refused call (here: a noise constraint that a lambda-keeping update would have violated, then a wrong dtype)
    leaves the data, n, the noise and the fit as they were."""
    x, y = make_data(200, 3)
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-4)).double()
    lik.noise = 1.5e-4
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 3), num_centers=20, likelihood=lik, tol=1e-10).fit()
    model.set_train_data(x[:100], y[:100])  # the noise stays 1.5e-4 (>= 1e-4): nothing to violate
    torch.testing.assert_close(model.likelihood.noise.detach().reshape(()), torch.tensor(1.5e-4, dtype=torch.float64))
    model.fit()
    with pytest.raises(TypeError, match="must have the model's dtype"):
        model.set_train_data(x.float(), y.float())
    assert model.n == 100 and model.train_inputs[0].shape[0] == 100 and bool(model.fitted)
    model.eval()
    model(x[:2])


def test_assigned_train_data_set_n_as_exactgp():
    """``train_inputs`` / ``train_targets`` assigned directly (as GPyTorch code does with ExactGP): n follows the rows,
    the fit is stale, and the refit matches the dense solve at the likelihood's noise."""
    model, _x, _y, _k = _fitted("rbf", n=100)
    x3, y3 = make_data(300, 3, seed=5)
    model.train_inputs = (x3,)
    model.train_targets = y3
    assert model.n == 300
    with pytest.raises(NotFittedError):
        model(x3[:2])
    model.fit()
    xt = x3[:5] + 0.01
    torch.testing.assert_close(model(xt).mean, _dense_mean(model, x3, y3, xt), rtol=1e-7, atol=1e-8)


def test_assigned_likelihood_is_checked():
    """A likelihood assigned after construction gets the constructor's checks: per-task noise and fixed per-row
    noise are refused, never read as their first element."""
    x, y = make_data(150, 3, t=2)
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 3), num_centers=20, penalty=1e-3).fit()
    model.likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
    with pytest.raises(ValueError, match="one shared noise"):
        model.fit()
    x1, y1 = make_data(150, 3)
    single = FalkonGP(x1, y1, kernel=make_kernel("rbf", 3), num_centers=20, penalty=1e-3).fit()
    single.likelihood = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.full((150,), 0.1)).double()
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        single.fit()


def test_prior_mode_gives_the_prior_in_eval_mode():
    """``gpytorch.settings.prior_mode``: the prior N(c, K(x, x)) in eval mode, as ExactGP (fitted or not)."""
    model, x, _y, k = _fitted("rbf")
    xt = x[:6] + 0.05
    with gpytorch.settings.prior_mode(True):
        p = model(xt)
    torch.testing.assert_close(p.mean, torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(p.covariance_matrix, dense_kernel(k, xt, xt))
    model.kernel.lengthscale = 0.7  # stale: the posterior would raise, the prior does not need a fit
    with gpytorch.settings.prior_mode(True):
        torch.testing.assert_close(model(xt).covariance_matrix, dense_kernel(k, xt, xt))


def test_chunked_prediction_equals_unchunked():
    model, x, y, k = _fitted("scale_matern52")
    xt = make_data(23, 3, seed=8)[0]
    with torch.no_grad():
        p = model(xt)
        model.predict_chunk_size = 5
        pc = model(xt)
        torch.testing.assert_close(pc.mean, p.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pc.variance, p.variance, rtol=1e-10, atol=1e-12)
        dense = p.covariance_matrix
        torch.testing.assert_close(pc.covariance_matrix, dense, rtol=1e-10, atol=1e-12)
        r = torch.randn(23, 4, dtype=torch.float64)
        torch.testing.assert_close(pc.lazy_covariance_matrix @ r, dense @ r, rtol=1e-10, atol=1e-10)
        # joint samples have the right covariance shape and are finite
        s = pc.rsample(torch.Size([3]))
        assert s.shape == (3, 23) and torch.isfinite(s).all()
    with pytest.raises(ValueError, match="predict_chunk_size"):
        FalkonGP(x, y, kernel=k, num_centers=5, predict_chunk_size=0)


def test_dtype_conversion_moves_data_and_keeps_the_fit():
    model, _x, _y, _k = _fitted("rbf")
    xt = make_data(9, 3, seed=6)[0]
    with torch.no_grad():
        p64 = model(xt)
    model.float()
    assert model.train_inputs[0].dtype == torch.float32 and model.train_targets.dtype == torch.float32
    with torch.no_grad():
        p32 = model(xt.float())
    torch.testing.assert_close(p32.mean.double(), p64.mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p32.variance.double(), p64.variance, rtol=1e-3, atol=1e-5)
    model.double()  # back, and a fresh fit works in float64 again
    model.fit()
    with torch.no_grad():
        # (the data, centers and hyperparameters went through float32 and back)
        torch.testing.assert_close(model(xt).mean, p64.mean, rtol=1e-4, atol=1e-5)
        assert model.alpha.dtype == torch.float64


def test_multi_output_batched_inputs_and_variance_cost():
    model, x, y, k = _fitted("rbf", t=2)
    single = FalkonGP(x, y[:, 0], kernel=k, centers=model.centers, penalty=1e-4, tol=1e-12, max_iter=1000)
    single.fit().eval()
    xt = make_data(2000, 3, seed=12)[0]
    with torch.no_grad():
        p, ps = model(xt), single(xt)
        # one shared covariance: the variances cost a single diagonal, not t * q^2
        torch.testing.assert_close(p.variance[:, 1], ps.variance)
        xb = xt[:20].reshape(4, 5, 3)
        pb = model(xb)
        assert pb.mean.shape == (4, 5, 2) and pb.variance.shape == (4, 5, 2)
        torch.testing.assert_close(pb.variance[2, :, 0], single(xb[2]).variance)
        assert pb.covariance_matrix.shape == (4, 10, 10)


def test_copies_keep_the_fit_and_foreign_state_is_rejected(tmp_path):
    import copy
    import warnings as _w

    model, x, y, _k = _fitted("rbf")
    xt = make_data(7, 3, seed=13)[0]
    with torch.no_grad():
        p = model(xt)
        q = copy.deepcopy(model)(xt)
        torch.save(model, tmp_path / "m.pt")
        r = torch.load(tmp_path / "m.pt", weights_only=False)(xt)
    torch.testing.assert_close(q.mean, p.mean)
    torch.testing.assert_close(r.variance, p.variance)
    # in-place modification of the training data invalidates the fit
    clone = copy.deepcopy(model)
    clone.train_targets.mul_(2.0)
    with pytest.raises(NotFittedError, match="changed since"):
        clone(xt)
    # a state_dict fitted on other data is loaded as unfitted, with a warning
    other = FalkonGP(x[:300], y[:300], kernel=make_kernel("rbf", 3), num_centers=30, penalty=1e-4)
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        other.load_state_dict(model.state_dict())
    assert any("differs in: train_x" in str(w.message) for w in rec), [str(w.message) for w in rec]
    assert not bool(other.fitted)


def test_float_keeps_alpha_in_float64():
    model, _x, _y, _k = _fitted("rbf")
    model.float()
    assert model.alpha.dtype == torch.float64 and model.data_fingerprint.dtype == torch.float64


def test_likelihood_must_match_outputs():
    x, y = make_data(60, 2, t=3)
    k = make_kernel("rbf", 2)
    with pytest.raises(TypeError, match="MultitaskGaussianLikelihood"):
        FalkonGP(x, y, kernel=k, num_centers=5, likelihood=gpytorch.likelihoods.GaussianLikelihood().double())
    wrong = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=5, rank=0, has_task_noise=False).double()
    with pytest.raises(ValueError, match="num_tasks=5"):
        FalkonGP(x, y, kernel=k, num_centers=5, likelihood=wrong)
    batched = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([3])).double()
    with pytest.raises(ValueError, match="one \\(scalar\\) noise"):
        FalkonGP(x, y[:, 0], kernel=k, num_centers=5, likelihood=batched)
    model = FalkonGP(x, y[:, 0], kernel=k, num_centers=5)
    with pytest.raises(TypeError, match="dtype"):
        model.set_train_data(x.float(), y[:, 0].float())


def test_num_centers_accepts_numpy_integers():
    import numpy as np

    x, y = make_data(60, 2)
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=np.int64(7))
    assert model.centers.shape == (7, 2)


def test_fit_time_limit_stops_cg_and_keeps_its_iterate():
    """fit(time_limit=...) stops CG once the clock passes the limit (a per-iteration callback that
    sleeps 0.2 s makes that 2-3 iterations against a 0.5 s limit), with a warning; alpha is the
    iterate of a fit capped at that many iterations. Bad limits and a custom solver are refused."""
    import time

    from gpfalkon import CGNotConvergedWarning

    x, y = make_data(2000, 3)
    k = make_kernel("scale_matern52", 3)
    model = FalkonGP(x, y, kernel=k, num_centers=100, penalty=1e-7, tol=1e-14, max_iter=200, seed=0)
    # the warning gives CG's own seconds, not the share of the limit the K_Mn y pass left to CG
    with pytest.warns(CGNotConvergedWarning,
                      match=r"stopped at its time limit after \d+ iterations \([0-9.]+ s of CG\)"):
        model.fit(time_limit=0.5, callback=lambda i, a, r: time.sleep(0.2))
    info = model.fit_info
    assert info.extra["time_limit"] and 1 <= info.iterations < 200 and not info.converged
    alpha = model.alpha.clone()
    ref = FalkonGP(x, y, kernel=k, centers=model.centers, penalty=1e-7, tol=0.0, max_iter=info.iterations)
    ref.fit(callback=lambda i, a, r: None)  # CG (the direct solve is not iterate-for-iterate the same)
    torch.testing.assert_close(alpha, ref.alpha, rtol=1e-10, atol=1e-12)
    # a limit the fit does not reach: the plain fit
    model.fit(time_limit=1e6)
    assert model.fit_info.converged and not model.fit_info.extra.get("time_limit")
    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ValueError, match="time_limit"):
            model.fit(time_limit=bad)

    def my_solver(h_matmul, precond, rhs, x0=None, **kw):
        from gpfalkon.solvers import falkon_solve
        return falkon_solve(h_matmul, precond, rhs, x0, **kw)

    custom = FalkonGP(x, y, kernel=k, centers=model.centers, penalty=1e-7, options=FalkonOptions(solver=my_solver))
    with pytest.raises(ValueError, match="time_limit needs the built-in"):
        custom.fit(time_limit=10.0)


def test_a_kernel_change_outside_its_parameters_makes_the_fit_stale():
    """The fit's record holds the kernel's values at a few points, so what its raw parameters do not show is caught
    when a state is loaded into a model whose kernel maps the same raw values differently (exp vs softplus) or is
    another Matern (the load warns, and the model is unfitted), while a load into an equal kernel stays fitted with
    the same predictions; a state saved before the record existed loads as before."""
    from gpytorch.constraints import Positive

    x, y = make_data(80, 2)
    xt = x[:5] + 0.05

    def kernel(nu=2.5, transform=None):
        base = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=2)
        if transform == "exp":
            base.register_constraint("raw_lengthscale", Positive(transform=torch.exp, inv_transform=torch.log))
        return gpytorch.kernels.ScaleKernel(base).double()

    m = FalkonGP(x, y, kernel(transform="exp"), num_centers=20, penalty=1e-3, seed=0).fit().eval()
    mean = m(xt).mean
    same = FalkonGP(x, y, kernel(transform="exp"), num_centers=20, penalty=1e-3, seed=0)
    same.load_state_dict(m.state_dict())
    assert bool(same.fitted)
    torch.testing.assert_close(same.eval()(xt).mean, mean)
    for other in (kernel(), kernel(nu=0.5, transform="exp")):
        model = FalkonGP(x, y, other, num_centers=20, penalty=1e-3, seed=0)
        with pytest.warns(RuntimeWarning, match="the kernel's values at the same parameters"):
            model.load_state_dict(m.state_dict())
        assert not bool(model.fitted)
    m.kernel.base_kernel.register_constraint("raw_lengthscale", Positive())  # in place: fit() again (documented)
    m.fit()
    old = {k: v for k, v in m.state_dict().items() if k != "kernel_probe"}  # saved before the probe existed
    back = FalkonGP(x, y, kernel(), num_centers=20, penalty=1e-3, seed=0)
    back.kernel.base_kernel.register_constraint("raw_lengthscale", Positive())
    back.load_state_dict(old)
    assert bool(back.fitted)


@pytest.mark.parametrize("t", [1, 2])
def test_variances_below_gpytorchs_absolute_floor_are_kept(t):
    """GPyTorch floors MultivariateNormal.variance at 1e-6 in float32; the Nystrom posterior's variances are its
    covariance's diagonal whatever their scale (targets of std 1e-3: latent variances ~1e-9), through the likelihood
    and BoTorch's outcome untransform (which rebuild the distribution with its class)."""
    from gpfalkon.botorch import FalkonModel

    x, y = make_data(400, 2, t=None if t == 1 else t, dtype=torch.float32)
    y = 1e-3 * y
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.outputscale = 1e-6  # the prior variance of targets of std 1e-3
    model = FalkonGP(x, y, kernel, num_centers=40, penalty=1e-8 / 400, seed=0).fit().eval()
    xt = x[:7] + 0.01
    pred = model(xt)
    diag = pred.lazy_covariance_matrix.diagonal()
    want = diag if t == 1 else diag.reshape(7, t)
    assert float(want.max()) < 1e-6  # below the floor
    torch.testing.assert_close(pred.variance, want, rtol=1e-5, atol=0.0)
    noisy = model.likelihood(pred)
    torch.testing.assert_close(noisy.variance, want + model.noise.detach().reshape(-1)[0], rtol=1e-5, atol=0.0)
    if t == 1:
        k64 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        k64.outputscale = 1e-12
        bm = FalkonModel(x.double(), y.double().unsqueeze(-1), k64, num_centers=40, penalty=1e-14 / 400, seed=0,
                         outcome_transform=None)
        post = bm.posterior(xt.double())
        latent = post.distribution.lazy_covariance_matrix.diagonal()
        assert float(latent.max()) < 1e-10  # below float64's floor
        torch.testing.assert_close(post.variance.squeeze(-1), latent, rtol=1e-10, atol=0.0)


def test_a_rescaled_fit_and_an_old_pickle_keep_their_fit_through_the_kernel_probe():
    """scale_prior (auto_fit's variance calibration) keeps the fit and re-records the kernel's values, so the state
    loads back fitted; a model pickled before the probe existed unpickles, fits and converts."""
    import copy as _copy

    x, y = make_data(120, 2)
    m = FalkonGP(x, y, make_kernel("scale_rbf", 2), num_centers=20, penalty=1e-4, seed=0).fit()
    m.scale_prior(2.0)
    back = _copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        back.load_state_dict(m.state_dict())
    assert bool(back.fitted)
    torch.testing.assert_close(back.eval()(x[:4]).variance, m.eval()(x[:4]).variance)
    old = dict(m.__dict__)
    old["_buffers"] = {k: v for k, v in m._buffers.items() if k != "kernel_probe"}
    restored = FalkonGP.__new__(FalkonGP)
    restored.__setstate__(old)
    assert restored.kernel_probe.numel() == 0
    restored.fit()
    restored.float()
    assert restored.kernel_probe.numel() > 0


def test_a_float32_kernel_that_refuses_float64_points_fits_and_predicts():
    """GPyTorch's PolynomialKernel (its offset added by addmm) fails on points of another dtype than its parameters;
    a float32 model evaluates it on float32 points where the library works in float64 (K_MM, the posterior, the
    kernel probe), and predicts what the float64 model predicts to float32 accuracy."""
    x, y = make_data(200, 3)
    y = x.sum(-1) + 0.1 * x[:, 0] ** 2
    xt = x[:30] + 0.05
    from gpfalkon.backend import engine

    engine._NARROW_KERNELS_WARNED.clear()  # (warned once per kernel class and dtype in a process)
    preds = {}
    for dtype in (torch.float32, torch.float64):
        k = gpytorch.kernels.PolynomialKernel(power=2).to(dtype)
        if dtype == torch.float32:  # the float64 passes get float32 values: said once, with the remedy
            with pytest.warns(RuntimeWarning, match=r"PolynomialKernel refuses torch.float64 points .*kernel.double"):
                m = FalkonGP(x.to(dtype), y.to(dtype), kernel=k, num_centers=20, penalty=1e-3, seed=0).fit().eval()
        else:
            m = FalkonGP(x.to(dtype), y.to(dtype), kernel=k, num_centers=20, penalty=1e-3, seed=0).fit().eval()
        assert m.kernel_probe.numel() == 16  # 4 points: recorded
        pred = m(xt.to(dtype))
        preds[dtype] = (pred.mean.double(), pred.variance.double(), pred.covariance_matrix.double())
    for got, want in zip(preds[torch.float32], preds[torch.float64], strict=True):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0.0, atol=1e-4 * max(scale, 1.0))


def test_prediction_with_a_graph_keeps_no_q_by_m_tensors_beyond_the_budget():
    """Predicting at many points with autograd on (the kernel's parameters require grad: the default) kept every
    chunk's kernel values and roots in the graph, several ``q x M`` tensors. Under a budget the graph cannot hold
    them, the chunks are capped by the budget and checkpointed: the tensors the graph keeps between the forward and
    the backward pass total less than one ``q x M`` float64 matrix, and the gradients of the mean and variance with
    respect to the kernel's parameters equal those of the unchunked computation."""
    from gpfalkon import settings

    x, y = make_data(600, 3)
    xt = make_data(3000, 3, seed=5)[0]
    model = FalkonGP(x, y, kernel=make_kernel("scale_rbf", 3), num_centers=100, penalty=1e-3).fit().eval()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    grads = {}
    for budget in (2**20, 2**34):  # 1 MiB: checkpointed chunks of 218 points; 16 GiB: one chunk, the whole graph
        model.zero_grad()
        saved.clear()
        with settings.memory_budget(budget), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pred = model(xt)
            loss = pred.mean.sum() + pred.variance.sum()
        held = sum(saved)
        loss.backward()
        grads[budget] = [p.grad.clone() for p in model.kernel.parameters()]
        if budget == 2**20:
            assert held < 3000 * 100 * 8, held
    for a, b in zip(grads[2**20], grads[2**34], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_threaded_variances_leave_gpytorch_settings_alone():
    """The unfloored variance is computed without GPyTorch's process-wide ``min_variance`` setting (entering and
    leaving it from several threads left it at 0 for every later distribution): four threads' variances equal the
    single-threaded ones, and the setting is never entered."""
    import threading

    x, y = make_data(300, 3)
    xt = make_data(50, 3, seed=5)[0]
    model = FalkonGP(x, y, kernel=make_kernel("scale_rbf", 3), num_centers=40, penalty=1e-3).fit().eval()
    with torch.no_grad():
        want = model(xt).variance
    entered = []
    real_enter = gpytorch.settings.min_variance.__enter__

    def spy(self):
        entered.append(1)
        return real_enter(self)

    out = [None] * 4

    def work(i):
        with torch.no_grad():
            for _ in range(5):
                out[i] = model(xt).variance

    try:
        gpytorch.settings.min_variance.__enter__ = spy
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        gpytorch.settings.min_variance.__enter__ = real_enter
    assert entered == []
    for v in out:
        torch.testing.assert_close(v, want, rtol=0, atol=0)
    assert gpytorch.settings.min_variance.value(torch.float64) == 1e-10


def test_factors_formed_across_a_refit_are_not_kept(monkeypatch):
    """A variance request forms the factors in a data pass; if the model is fitted again meanwhile (another
    thread), the factors of the old fit are used for that request only, never stored for the new fit."""
    from gpfalkon.models import posterior

    x, y = make_data(300, 3)
    model = FalkonGP(x, y, kernel=make_kernel("scale_rbf", 3), num_centers=40, penalty=1e-3).fit().eval()
    real = posterior.NystromPosteriorFactors.compute

    def slow_compute(op):
        out = real(op)
        model._forget_factors()  # what a fit() in another thread does while this pass runs
        return out

    monkeypatch.setattr(posterior.NystromPosteriorFactors, "compute", staticmethod(slow_compute))
    model.posterior_factors()
    assert model._factors is None
    monkeypatch.setattr(posterior.NystromPosteriorFactors, "compute", staticmethod(real))
    assert model.posterior_factors() is model._factors is not None


def test_a_failed_digest_pass_at_the_end_of_fit_leaves_the_model_cleanly_unfitted(monkeypatch):
    """The data's digests are the last pass of ``fit()`` (a row source's read can fail there): the model is then
    unfitted, with nothing of the failed fit recorded, and a later fit works."""
    from gpfalkon.models import fit_state

    x, y = make_data(300, 3)
    xt = make_data(5, 3, seed=5)[0]
    model = FalkonGP(x, y, kernel=make_kernel("scale_rbf", 3), num_centers=40, penalty=1e-3).fit()
    real = fit_state.data_fingerprint

    def failing(*args, **kwargs):
        raise OSError("disk error")

    with torch.no_grad():
        model.kernel.base_kernel.lengthscale = 0.7
    monkeypatch.setattr(fit_state, "data_fingerprint", failing)
    with pytest.raises(OSError, match="disk error"):
        model.fit()
    assert not bool(model.fitted) and model._fit_tracker.snapshot is None
    with pytest.raises(NotFittedError):
        model.eval()(xt)
    monkeypatch.setattr(fit_state, "data_fingerprint", real)
    model.fit()
    reference = FalkonGP(x, y, kernel=model.kernel, centers=model.centers.clone(), penalty=1e-3).fit().eval()
    torch.testing.assert_close(model.eval()(xt).mean, reference(xt).mean)


def test_the_mean_alone_never_forms_the_variance_factors():
    """``model(x).mean`` (GPyTorch's idiom) forms no O(n M^2) variance factors; the covariance forms them on first
    use, of the kind the settings asked for when the posterior was formed, equal to the eager ones; a refit in
    between makes that use raise rather than mix two fits."""
    from gpfalkon import settings

    model, x, _y, _k = _fitted("rbf")
    xt = x[:7] + 0.02
    with torch.no_grad():
        p = model(xt)
        mean = p.mean
    assert model._factors is None and model._fast_factors is None
    torch.testing.assert_close(mean, model.posterior_mean(xt))
    var = p.variance
    assert model._factors is not None and model._fast_factors is None
    c = model.centers.detach()
    with torch.no_grad():
        noise = float(model.likelihood.noise)
        h, _knm, kmm = dense_nystrom(model.kernel, x, c, noise / x.shape[0])
        ksm = dense_kernel(model.kernel, xt, c)
        dtc = (dense_kernel(model.kernel, xt, xt) - ksm @ torch.linalg.solve(kmm, ksm.T)
               + noise * ksm @ torch.linalg.solve(h, ksm.T)).diagonal()
        torch.testing.assert_close(var, dtc, rtol=1e-6, atol=1e-10)
        with settings.variance_factors("approximate"):
            pa = model(xt)
        va = pa.variance  # read outside the setting: the kind asked for at model(x)
        fast = model._fast_factors
        assert fast is not None
        torch.testing.assert_close(va, NystromPosteriorCovariance(xt, c, fast.L, fast.LB, kernel=model.kernel)
                                   .diagonal())
    import io

    buf = io.BytesIO()
    torch.save(model(xt), buf)  # pickled with its factors formed (the closure over the model is not pickled)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf, weights_only=False).variance, var)
    p2 = model(xt)
    model.fit()
    with pytest.raises(NotFittedError, match="form it again"):
        _ = p2.variance


def test_fit_warns_where_the_targets_offset_swamps_cgs_tolerance():
    """``y = 1e6 + sin`` with ``mean_constant`` 0: CG's tolerance is relative to ``K_Mn y``, which the offset
    dominates, so a fit "converged" far from the solution (2.1 off on a unit signal in float64): a warning names
    the offset and ``mean_constant``; with the targets' mean as ``mean_constant`` there is none and the mean is the
    dense solve's."""
    import warnings

    x, _ = make_data(400, 2)
    y = 1e6 + torch.sin(3 * x[:, 0])
    kw = dict(kernel=make_kernel("rbf", 2), centers=x[:40].clone(), penalty=1e-4,
              options=FalkonOptions(solve_method="cg"))
    with pytest.warns(RuntimeWarning, match=r"train_y - mean_constant has mean 1e\+06, .* times its standard deviation"
                                            r".*pass mean_constant=train_y.mean\(0\)"):
        FalkonGP(x, y, **kw).fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model = FalkonGP(x, y, mean_constant=float(y.mean()), **kw).fit().eval()
        FalkonGP(x, torch.sin(3 * x[:, 0]) + 5.0, **kw).fit()  # 7 standard deviations: resolved to 7e-6, quiet
    h, knm, _ = dense_nystrom(kw["kernel"], x, kw["centers"], 1e-4)
    alpha = torch.linalg.solve(h, knm.T @ (y - y.mean()))
    want = float(y.mean()) + kw["kernel"](x[:20], kw["centers"]).to_dense().detach() @ alpha
    torch.testing.assert_close(model.posterior_mean(x[:20]), want, rtol=0, atol=1e-4)
