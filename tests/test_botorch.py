"""FalkonModel inside BoTorch: posterior, transforms, acquisition optimisation, gradients."""
from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch
from botorch.acquisition.logei import qLogNoisyExpectedImprovement
from botorch.models.transforms.input import Normalize
from botorch.models.transforms.outcome import Standardize
from botorch.optim import optimize_acqf
from botorch.posteriors import GPyTorchPosterior

from gpfalkon import FalkonGP, NotFittedError
from gpfalkon.botorch import FalkonModel

from conftest import dense_kernel, make_kernel

#: BoTorch's hypervolume acquisitions JIT-compile an optional C++ kernel (``-O3 -march=native``) the first time one
#: is built on a machine, about 45 s on 2 cores, and fall back to their pure-Python path where that fails. These
#: tests check FalkonModel's posterior inside them, not BoTorch's kernel, so they take that fallback: the suite's
#: time and result do not depend on a compiler or on a warm ``~/.cache/torch_extensions``.
_NO_LOGEI_BUILD = ("import botorch.acquisition.multi_objective.logei as _m; _m._load_attempted = True; "
                   "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture(autouse=True)
def _botorch_logei_without_its_build(monkeypatch):
    """In-process form of :data:`_NO_LOGEI_BUILD`: BoTorch's loader is told it already tried."""
    from botorch.acquisition.multi_objective import logei

    monkeypatch.setattr(logei, "_load_attempted", True)


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
    ref = FalkonGP(
        X, Y.squeeze(-1), kernel=k, centers=model.centers, penalty=1e-4, tol=1e-12, max_iter=1000
    ).fit().eval()
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
        cov = (
            dense_kernel(k, Xt[1], Xt[1])
            - ktm @ torch.linalg.solve(kmm, ktm.T)
            + n * lam * ktm @ torch.linalg.solve(H, ktm.T)
        )
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
    model = FalkonModel(
        X[:250], Y[:250], num_centers=30, penalty=1e-4, outcome_transform=None, tol=1e-12, max_iter=1000
    )
    noise = model.noise.detach().clone()
    new = model.condition_on_observations(X[250:], Y[250:])
    torch.testing.assert_close(new.noise, noise)
    assert new.train_inputs[0].shape[0] == 300
    ref = FalkonGP(X, Y.squeeze(-1), kernel=model.kernel, centers=model.centers, penalty=float(noise) / 300,
                   tol=1e-12, max_iter=1000).fit().eval()
    Xt = torch.rand(6, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(new.posterior(Xt).mean.squeeze(-1), ref(Xt).mean, rtol=1e-8, atol=1e-8)
    with pytest.raises(NotImplementedError, match="per-observation noise"):
        model.condition_on_observations(X[250:], Y[250:], noise=torch.full_like(Y[250:], 0.01))
    # shapes are checked before the rows are appended, with the caller's sizes
    for bad_x, bad_y in ((torch.rand(2, 3, dtype=torch.float64), Y[:2]), (X[:2], torch.rand(2, 2, dtype=torch.float64)),
                         (X[:2], Y[:3])):
        with pytest.raises(ValueError, match=r"X and Y must have shapes \(q, 2\) and \(q, 1\) with the same q, got "
                                             rf"\({bad_x.shape[0]}, {bad_x.shape[1]}\) and \({bad_y.shape[0]}, "):
            model.condition_on_observations(bad_x, bad_y)


def test_num_centers_above_n_takes_every_point_and_training_loops_are_told_mll_eval():
    """A BO loop's first iterations have fewer observations than ``num_centers`` (the README's snippet): every
    point is a center, the posterior that of the model with ``centers=train_X``; after a hand-written training loop
    the NotFittedError names ``mll.eval()``, which refits."""
    from gpfalkon.errors import NotFittedError
    from gpfalkon.objectives import NystromMarginalLogLikelihood

    X, Y = _data(n=40)
    model = FalkonModel(X, Y, num_centers=1000)
    assert model.centers.shape == (40, 2)
    ref = FalkonModel(X, Y, centers=X.clone())
    xt = torch.rand(5, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.posterior(xt).mean, ref.posterior(xt).mean, rtol=1e-9, atol=1e-10)
    mll = NystromMarginalLogLikelihood(model.likelihood, model)
    mll.train()
    opt = torch.optim.Adam(model.kernel.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        (-mll(model(*model.train_inputs), model.train_targets)).backward()
        opt.step()
    with pytest.raises(NotFittedError, match=r"mll.eval\(\) refits"):
        model.posterior(xt)
    mll.eval()
    assert model.posterior(xt).mean.shape == (5, 1)
    # BoTorch's noise bound has no transform (fit_gpytorch_mll's bounded optimiser keeps it): a torch step past it
    # is named as such
    mll.train()
    with torch.no_grad():
        model.likelihood.noise_covar.raw_noise.fill_(-0.01)
    with pytest.raises(ValueError, match=r"noise constraint \(GreaterThan\) applies no transform"):
        mll(model(*model.train_inputs), model.train_targets)


def test_bad_training_shapes():
    X, Y = _data(n=50)
    with pytest.raises(ValueError, match="train_Y"):
        FalkonModel(X, Y.squeeze(-1), num_centers=5)
    with pytest.raises(ValueError, match="train_X"):
        FalkonModel(X[0], Y, num_centers=5)
    with pytest.raises(TypeError, match=r"train_X must be float32 or float64, got torch\.int64"):
        FalkonModel((X * 10).long(), Y, num_centers=5)
    with pytest.raises(TypeError, match=r"train_Y must be float32 or float64, got torch\.int32"):
        FalkonModel(X, (Y * 10).int(), num_centers=5)
    from gpfalkon.backend.sources import TensorRows

    with pytest.raises(TypeError, match=r"got a row source \(TensorRows\).*train_X\.materialize\(\)"):
        FalkonModel(TensorRows(X), Y, num_centers=5)


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


# ------------------------------------------------------------------ issue 14 regressions (items 1, 3, 5)
@pytest.mark.parametrize("m_out", [1, 2])
@pytest.mark.parametrize("transform", ["standardize", None])
def test_load_state_dict_on_botorchs_path(transform, m_out):
    """BoTorch's load_state_dict calls set_train_data(targets=..., strict=...): the loaded model
    predicts as the saved one (item 1); with two outputs too (the model holds them as (n, m), not BoTorch's
    batched (m, n): its own _extract_targets_and_noise)."""
    X, Y = _data(n=200, m=m_out)
    m = FalkonModel(X, Y, num_centers=40, outcome_transform=transform, tol=1e-10, max_iter=500)
    fresh = FalkonModel(X, Y, num_centers=40, outcome_transform=transform, fit=False)
    fresh.load_state_dict(m.state_dict())
    Xt = torch.rand(7, 2, dtype=torch.float64)
    want, got = m.posterior(Xt), fresh.posterior(Xt)
    torch.testing.assert_close(got.mean, want.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.variance, want.variance, rtol=1e-10, atol=1e-10)
    # a model holding other data: the loaded alpha does not solve its system, so it is unfitted
    other = FalkonModel(X, Y * 3 + 1 + 0.1 * X[:, :1], num_centers=40, outcome_transform=transform, fit=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        other.load_state_dict(m.state_dict())
    with pytest.raises(NotFittedError, match="call fit"):
        other.posterior(Xt)


def test_two_output_model_in_cache_root_acquisition_functions():
    """qLogNEHVI and qLogNEI with an objective default to cache_root=True, which reads a several-output posterior as
    block-diagonal; a two-output FalkonModel opts out (its covariance is covar (x) I_t) and the values equal those
    computed with cache_root=False, same base samples."""
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.acquisition.objective import GenericMCObjective
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = _data(n=60, m=2)
    model = FalkonModel(X, Y, num_centers=30)
    assert model._supports_cache_root is False and FalkonModel(X, Y[:, :1], num_centers=30)._supports_cache_root
    Xc = torch.rand(4, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    builders = {
        "nehvi": lambda **kw: qLogNoisyExpectedHypervolumeImprovement(
            model, ref_point=[-3.0, -6.0], X_baseline=X[:10], prune_baseline=False, **kw),
        "nei": lambda **kw: qLogNoisyExpectedImprovement(
            model, X_baseline=X[:10], prune_baseline=False, objective=GenericMCObjective(lambda s, X=None: s.sum(-1)),
            **kw),
    }
    for build in builders.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # BoTorch's "cache_root is not supported" notice
            default = build(sampler=SobolQMCNormalSampler(torch.Size([64]), seed=0))
        explicit = build(sampler=SobolQMCNormalSampler(torch.Size([64]), seed=0), cache_root=False)
        torch.testing.assert_close(default(Xc), explicit(Xc))


def test_input_transform_parameters_learnable_refused_changed_refit_consistently():
    """The training inputs go through the input transform once: a transform with learnable parameters is refused
    (an MLL would move them by their priors alone, with the stored inputs left behind: silently wrong); a fixed one
    changed after the fit makes the fit stale, and fit() re-applies it to the untransformed inputs, giving the model
    a fresh construction with that transform gives."""
    from botorch.models.transforms.input import Warp

    X, Y = _data(n=80)
    with pytest.raises(NotImplementedError, match=r"input_transform has learnable parameters \['concentration"):
        FalkonModel(X, Y, centers=X[:40].clone(), input_transform=Warp(d=2, indices=[0, 1]))
    warp = Warp(d=2, indices=[0, 1]).double().requires_grad_(False)
    model = FalkonModel(X, Y, centers=X[:40].clone(), input_transform=warp, tol=1e-12, max_iter=500)
    Xt = torch.rand(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model.posterior(Xt)
    with torch.no_grad():
        model.input_transform.concentration0.fill_(2.0)
    with pytest.raises(NotFittedError, match="call fit"):
        model.posterior(Xt)
    model.fit()
    fresh_tf = Warp(d=2, indices=[0, 1]).double().requires_grad_(False)
    with torch.no_grad():
        fresh_tf.concentration0.fill_(2.0)
    fresh = FalkonModel(X, Y, centers=X[:40].clone(), input_transform=fresh_tf, tol=1e-12, max_iter=500)
    torch.testing.assert_close(model.train_inputs[0], fresh.train_inputs[0])
    want, got = fresh.posterior(Xt), model.posterior(Xt)
    torch.testing.assert_close(got.mean, want.mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.variance, want.variance, rtol=1e-9, atol=1e-9)
    # Normalize's bounds (buffers) edited: the same
    norm = FalkonModel(X, Y, centers=X[:40].clone(), input_transform=Normalize(d=2), tol=1e-12, max_iter=500)
    with torch.no_grad():
        norm.input_transform.offset.sub_(0.5)
    with pytest.raises(NotFittedError):
        norm.posterior(Xt)
    norm.fit()
    torch.testing.assert_close(norm.train_inputs[0], norm.input_transform(X))
    # the untransformed inputs unknown (replaced by set_train_data): refused, not fitted on stale inputs
    norm.set_train_data(inputs=norm.train_inputs[0][:, [1, 0]])
    with torch.no_grad():
        norm.input_transform.offset.add_(0.1)
    with pytest.raises(ValueError, match="the untransformed inputs are not known"):
        norm.fit()


def test_input_perturbation_caches_do_not_make_the_fit_stale():
    """InputPerturbation fills a cache buffer (``_perturbations``) from every X it transforms: posteriors at X of
    different shapes, alone or chained after Normalize, and fantasize, keep the fit valid (the transform itself did
    not change), and the posterior equals a fresh model's."""
    from botorch.models.transforms.input import ChainedInputTransform, InputPerturbation
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = _data(n=60)
    perturb = torch.tensor([[0.0, 0.0], [0.01, -0.01], [-0.02, 0.01]], dtype=torch.float64)
    for tf in (InputPerturbation(perturbation_set=perturb),
               ChainedInputTransform(norm=Normalize(d=2), perturb=InputPerturbation(perturbation_set=perturb))):
        model = FalkonModel(X, Y, centers=X[:20].clone(), input_transform=tf)
        for q in (1, 4, 7):
            assert model.posterior(X[:q]).mean.shape == (3 * q, 1)
        model.fantasize(X[:2], SobolQMCNormalSampler(torch.Size([2]), seed=0))
        assert bool(model.fitted) and not model._hyper_changed()


def test_covar_module_is_the_kernel_under_singletaskgps_name():
    """Code written for SingleTaskGP reads and initialises ``covar_module``; here it is the model's one kernel."""
    X, Y = _data(n=60)
    model = FalkonModel(X, Y, num_centers=20)
    assert model.covar_module is model.kernel
    model.initialize(**{"covar_module.lengthscale": torch.tensor(0.3, dtype=torch.float64)})
    torch.testing.assert_close(model.kernel.lengthscale, torch.full_like(model.kernel.lengthscale, 0.3))
    with pytest.raises(NotFittedError):
        model.posterior(X[:2])
    model.covar_module = gpytorch.kernels.MaternKernel(nu=1.5).double()
    assert isinstance(model.kernel, gpytorch.kernels.MaternKernel) and "covar_module" not in model._modules
    assert not any(k.startswith("covar_module") for k in model.state_dict())
    model.fit()
    ref = FalkonModel(X, Y, kernel=gpytorch.kernels.MaternKernel(nu=1.5).double(), centers=model.centers.clone())
    torch.testing.assert_close(model.posterior(X[:3]).mean, ref.posterior(X[:3]).mean)


def test_model_list_fits_with_sum_mll_of_the_nystrom_adapter():
    """BoTorch's multi-output line, fit_gpytorch_mll(SumMarginalLogLikelihood(...)), on a ModelListGP of FalkonModels:
    with mll_cls=NystromMarginalLogLikelihood every model is fitted as its own adapter fits it (same hyperparameters,
    fitted, in eval mode); GPyTorch's default exact MLL is refused with this route named."""
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import ModelListGP
    from gpytorch.mlls import SumMarginalLogLikelihood

    from gpfalkon import NystromMarginalLogLikelihood

    X, Y = _data(n=80, m=2)
    models = [FalkonModel(X, Y[:, i:i + 1], centers=X[:30].clone()) for i in range(2)]
    lone = [FalkonModel(X, Y[:, i:i + 1], centers=X[:30].clone()) for i in range(2)]
    ml = ModelListGP(*models)
    fit_gpytorch_mll(SumMarginalLogLikelihood(ml.likelihood, ml, mll_cls=NystromMarginalLogLikelihood))
    for m in lone:
        fit_gpytorch_mll(NystromMarginalLogLikelihood(m.likelihood, m))
    for got, want in zip(ml.models, lone, strict=True):
        assert bool(got.fitted) and not got.training
        torch.testing.assert_close(got.kernel.lengthscale, want.kernel.lengthscale, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.posterior(X[:4]).mean, want.posterior(X[:4]).mean, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"mll_cls=gpfalkon\.NystromMarginalLogLikelihood"):
        fit_gpytorch_mll(SumMarginalLogLikelihood(ml.likelihood, ml))


def test_set_train_data_follows_exactgp():
    X, Y = _data(n=120)
    model = FalkonGP(X, Y.squeeze(-1), num_centers=20, penalty=1e-4).fit()
    model.set_train_data(targets=Y.squeeze(-1).clone(), strict=True)  # the same values: still fitted
    assert bool(model.fitted)
    model.eval()
    model(X[:3])
    with pytest.raises(RuntimeError, match="strict=True"):
        model.set_train_data(targets=Y[:50].squeeze(-1), strict=True)
    model.set_train_data(targets=Y.squeeze(-1) + 1.0)  # other values: must be refitted
    assert not bool(model.fitted)
    model.set_train_data(inputs=(X[:60],), targets=Y[:60].squeeze(-1), strict=False)
    assert model.n == 60


def test_train_yvar_raises_clearly_and_subset_output_works():
    X, Y = _data(n=150, m=2)
    m = FalkonModel(X, Y, num_centers=30, tol=1e-10, max_iter=500)
    with pytest.raises(NotImplementedError, match="train_Yvar"):
        FalkonModel(X, Y, num_centers=30, train_Yvar=torch.full_like(Y, 0.01))
    Xt = torch.rand(5, 2, dtype=torch.float64)
    full = m.posterior(Xt)
    for idcs in ([1], [0], [1, 0]):
        sub = m.subset_output(idcs)
        assert sub.num_outputs == len(idcs)
        p = sub.posterior(Xt)
        torch.testing.assert_close(p.mean, full.mean[..., idcs], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(p.variance, full.variance[..., idcs], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="idcs"):
        m.subset_output([2])


def test_input_scaling_warns_as_singletaskgp():
    from botorch.exceptions import InputDataWarning

    X, Y = _data(n=100)
    with pytest.warns(InputDataWarning, match="not contained to the unit cube"):
        FalkonModel(X * 10, Y, num_centers=20)
    with pytest.warns(InputDataWarning, match="not standardized"):
        FalkonModel(X, Y * 10 + 5, num_centers=20, outcome_transform=None)


def test_penalty_and_likelihood_must_agree():
    X, Y = _data(n=100)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(torch.float64)
    lik.noise = torch.tensor(0.01, dtype=torch.float64)
    with pytest.raises(ValueError, match="give one of them"):
        FalkonGP(X, Y.squeeze(-1), num_centers=10, likelihood=lik, penalty=1e-3)
    ok = FalkonGP(X, Y.squeeze(-1), num_centers=10, likelihood=lik, penalty=0.01 / 100)
    torch.testing.assert_close(ok.noise.detach(), torch.tensor(0.01, dtype=torch.float64))


def test_kmn_y_takes_a_vector():
    X, Y = _data(n=80)
    model = FalkonGP(X, Y.squeeze(-1), num_centers=10, penalty=1e-3)
    H = model.nystrom_operator()
    torch.testing.assert_close(H.kmn_y(Y.squeeze(-1)), H.kmn_y(Y))
    with pytest.raises(ValueError, match="y must have shape"):
        H.kmn_y(Y[:5])


def test_model_list_batched_posterior_and_rsample():
    """ModelListGP of FalkonModels with q x batch inputs (qLogNEHVI's shapes): item 2."""
    from botorch.models import ModelListGP
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = _data(n=200, d=3)
    m1 = FalkonModel(X, Y, num_centers=30, tol=1e-10, max_iter=500)
    m2 = FalkonModel(X, -2 * Y, num_centers=30, tol=1e-10, max_iter=500)
    Xt = torch.rand(2, 3, 3, dtype=torch.float64)
    post = ModelListGP(m1, m2).posterior(Xt)
    p1, p2 = m1.posterior(Xt), m2.posterior(Xt)
    torch.testing.assert_close(post.mean, torch.cat([p1.mean, p2.mean], -1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(post.variance, torch.cat([p1.variance, p2.variance], -1), rtol=1e-10, atol=1e-10)
    cov = post.distribution.covariance_matrix  # (2, 6, 6), outputs interleaved or blocked
    assert cov.shape == (2, 6, 6) and bool(torch.isfinite(cov).all())
    torch.testing.assert_close(
        cov.diagonal(dim1=-2, dim2=-1).sum(-1), post.variance.sum((-1, -2)), rtol=1e-10, atol=1e-10
    )
    samples = SobolQMCNormalSampler(torch.Size([64]), seed=0)(post)
    assert samples.shape == (64, 2, 3, 2)
    torch.testing.assert_close(samples.mean(0), post.mean, rtol=0, atol=0.5)
    # batch indexing / permuting the covariance operator acts on the test points only
    lazy = p1.distribution.lazy_covariance_matrix
    torch.testing.assert_close(lazy[1].to_dense(), lazy.to_dense()[1], rtol=1e-12, atol=1e-12)
    perm = lazy.unsqueeze(0).expand(2, 2, 3, 3).permute(1, 0, 2, 3)
    torch.testing.assert_close(perm.to_dense()[:, 0], lazy.to_dense(), rtol=1e-12, atol=1e-12)


def _run_example(script: str, *args: str) -> str:
    """Run ``examples/<script>`` with ``args`` in a subprocess; its stdout (fails on a non-zero exit)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _NO_LOGEI_BUILD, os.path.join(root, "examples", script), *args],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_botorch_loop_example_runs():
    """examples/botorch_loop.py (fit_gpytorch_mll + qLogNEI, FalkonModel next to SingleTaskGP), small sizes."""
    import re

    out = _run_example("botorch_loop.py", "--iterations", "2", "--init", "8", "--restarts", "2", "--raw-samples", "16")
    regrets = {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+): final regret ([0-9.]+)", out)}
    assert set(regrets) == {"SingleTaskGP", "FalkonModel"}, out
    assert all(0.0 <= r <= 3.33 for r in regrets.values()), out


def test_multiobjective_example_runs():
    """examples/multiobjective.py (ModelListGP of FalkonModels, qLogNEHVI), small sizes."""
    import re

    out = _run_example(
        "multiobjective.py", "--iterations", "2", "--init", "8", "--restarts", "2", "--raw-samples", "16"
    )
    hv = [float(v) for v in re.findall(r"hypervolume ([0-9.]+)", out)]
    assert len(hv) == 3 and hv == sorted(hv), out  # initial + 2 iterations, never decreasing


def test_sgpr_vs_falkon_example_runs_on_a_user_csv(tmp_path):
    """examples/sgpr_vs_falkon.py on a user's .csv (header line, last column = target), small budgets."""
    import re

    import numpy as np

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(400, 3))
    y = np.sin(3 * X[:, 0]) + X[:, 1] * X[:, 2] + 0.05 * rng.standard_normal(400)
    path = tmp_path / "data.csv"
    np.savetxt(path, np.column_stack([X, y]), delimiter=",", header="a,b,c,target", comments="")
    out = _run_example("sgpr_vs_falkon.py", str(path), "--budget", "4", "--steps", "10", "--epochs", "1")
    nrmse = dict(re.findall(r"^(GPyTorch SGPR|GPyTorch SVGP|gpfalkon auto_fit).*?\s([0-9.]+)\s+[0-9.]+$", out, re.M))
    assert set(nrmse) == {"GPyTorch SGPR", "GPyTorch SVGP", "gpfalkon auto_fit"}, out
    assert float(nrmse["gpfalkon auto_fit"]) < 0.5, out  # far below predicting the mean (1.0)


def test_sgpr_vs_falkon_reads_a_csv_or_names_the_bad_line(tmp_path):
    """The example's CSV reader: a header line is skipped (not a data row), ';' works, and a missing, NaN or
    non-numeric value, a ragged row or a file with only the target stops naming the line and column."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "sgpr_vs_falkon", pathlib.Path(__file__).resolve().parents[1] / "examples" / "sgpr_vs_falkon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    good = tmp_path / "good.csv"
    good.write_text("a,b,target\n1,2,3\n4,5,6\n7,8,9\n")
    x, y = mod.load_csv(good)
    assert x.tolist() == [[1, 2], [4, 5], [7, 8]] and y.tolist() == [3, 6, 9]
    semi = tmp_path / "semi.csv"
    semi.write_text("1;2;3\n4;5;6\n")
    x, y = mod.load_csv(semi)
    assert x.tolist() == [[1, 2], [4, 5]] and y.tolist() == [3, 6]
    bad = {"missing_first.csv": ("1,,3\n4,5,6\n", r"line 1, column 2: '' is missing"),
           "header_missing.csv": ("a,b,t\n1,2,3\n4,,6\n", r"line 3, column 2"),
           "nan.csv": ("1,2,3\n4,nan,6\n", r"line 2, column 2: 'nan'"),
           "text.csv": ("1,2,3\n4,x,6\n", r"line 2, column 2: 'x'"),
           "ragged.csv": ("1,2,3\n4,5\n", r"line 2: 2 fields, the first line has 3"),
           "target_only.csv": ("1\n2\n3\n", r"need at least one feature column")}
    for name, (text, message) in bad.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(SystemExit, match=message):
            mod.load_csv(path)


def test_default_noise_model_is_singletaskgps_and_survives_noiseless_data():
    """Without penalty= / likelihood=, FalkonModel's noise has SingleTaskGP's LogNormal(-4, 1) prior and
    bound 1e-4; fit_gpytorch_mll on noiseless data then stops at the bound instead of collapsing."""
    from botorch.fit import fit_gpytorch_mll
    from botorch.models.utils.gpytorch_modules import MIN_INFERRED_NOISE_LEVEL
    from gpytorch.priors import LogNormalPrior

    from gpfalkon import NystromMarginalLogLikelihood

    X = torch.rand(200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    Y = X.sin().sum(-1, keepdim=True)  # noiseless
    for m in (1, 2):
        model = FalkonModel(X, Y.expand(-1, m), num_centers=40, fit=False)
        (prior,) = [p for _, _, p, _, _ in model.likelihood.named_priors()]
        assert isinstance(prior, LogNormalPrior) and float(prior.loc) == -4.0 and float(prior.scale) == 1.0
        torch.testing.assert_close(float(model.noise), math.exp(-5.0), rtol=1e-6, atol=0)
    model = FalkonModel(X, Y, num_centers=40, fit=False, tol=1e-10, max_iter=500)
    fit_gpytorch_mll(NystromMarginalLogLikelihood(model.likelihood, model))
    assert float(model.noise) >= MIN_INFERRED_NOISE_LEVEL * (1 - 1e-6)  # the bound is stored in float32
    assert bool(model.fitted) and torch.isfinite(model.posterior(X[:4]).mean).all()
    # an explicit penalty keeps FalkonGP's unbounded noise: sigma^2 = n lambda exactly
    torch.testing.assert_close(float(FalkonModel(X, Y, num_centers=40, penalty=1e-9, fit=False).noise), 200e-9)


def test_mll_adds_the_log_priors_as_gpytorchs_mlls():
    """FalkonModel's defaults carry SingleTaskGP's priors (LogNormal on the noise and on the RBF
    lengthscales): mll = (-SGPRBound + sum of log-priors) / n, and its gradients are autograd's on
    that formula."""
    from gpytorch.priors import LogNormalPrior

    from gpfalkon import NystromMarginalLogLikelihood
    from gpfalkon.objectives import SGPRBound

    X, Y = _data(n=120)
    model = FalkonModel(X, Y, num_centers=20, fit=False, outcome_transform=None)
    kernel = model.kernel
    assert isinstance(kernel, gpytorch.kernels.RBFKernel) and isinstance(kernel.lengthscale_prior, LogNormalPrior)
    mll = NystromMarginalLogLikelihood(model.likelihood, model)
    model.train()
    value = mll(model(model.train_inputs[0]), model.train_targets)
    noise_prior = model.likelihood.noise_covar.noise_prior
    expected = (-SGPRBound(model)() + noise_prior.log_prob(model.likelihood.noise).sum()
                + kernel.lengthscale_prior.log_prob(kernel.lengthscale).sum()) / 120
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
    g1 = torch.autograd.grad(value, kernel.raw_lengthscale)[0]
    g2 = torch.autograd.grad(expected, kernel.raw_lengthscale)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    without = (-SGPRBound(model)() / 120).detach()
    assert abs(float(value.detach() - without)) > 1e-3  # the priors do contribute
    # other objectives are errors / risks: no priors unless asked
    from gpfalkon.objectives import GCV

    gcv = NystromMarginalLogLikelihood(model.likelihood, model, objective="gcv")
    # GCV is a mean over the rows already: per observation it is itself (not divided by n again)
    torch.testing.assert_close(gcv(None, model.train_targets), -GCV(model)(), rtol=1e-12, atol=1e-14)
    with_priors = NystromMarginalLogLikelihood(model.likelihood, model, objective="gcv", add_priors=True)
    torch.testing.assert_close(with_priors(None, model.train_targets) - gcv(None, model.train_targets),
                               (expected + SGPRBound(model)() / 120).detach(), rtol=1e-10, atol=1e-12)



def _two_outputs(n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64)
    Y = torch.stack([torch.sin(4 * X).sum(-1), 3 * X[:, 0] + 2], -1)
    return X, Y + 0.01 * torch.randn(n, 2, generator=g, dtype=torch.float64)


def test_posterior_output_indices_and_per_output_observation_noise():
    """``output_indices`` selects outputs (BoTorch's ModelListGP relies on it) and a tensor
    ``observation_noise`` adds each output's own variances (transformed space), against the one-output
    models of the same fit (``subset_output``) and the noiseless posterior plus the noise by hand."""
    from botorch.models import ModelListGP

    X, Y = _two_outputs()
    m = FalkonModel(X, Y, num_centers=30, tol=1e-12, max_iter=500)
    Xs = torch.rand(3, 4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    full = m.posterior(Xs)
    for idx in ([1], [-1], [1, 0]):
        sub = m.posterior(Xs, output_indices=idx)
        assert sub.mean.shape == (3, 4, len(idx))
        torch.testing.assert_close(sub.mean, full.mean[..., [i % 2 for i in idx]])
        torch.testing.assert_close(sub.variance, full.variance[..., [i % 2 for i in idx]])
    one = m.subset_output([1]).posterior(Xs)
    torch.testing.assert_close(m.posterior(Xs, output_indices=[1]).distribution.covariance_matrix,
                               one.distribution.covariance_matrix)
    noisy = m.posterior(Xs, output_indices=[1], observation_noise=True)
    sigma2 = float(m.noise) * float(m.outcome_transform.stdvs[0, 1]) ** 2
    torch.testing.assert_close(noisy.variance, one.variance + sigma2)
    noise = torch.tensor([0.1, 0.3], dtype=torch.float64).expand(3, 4, 2)
    got = m.posterior(Xs, observation_noise=noise)
    torch.testing.assert_close(got.variance - full.variance, (noise * m.outcome_transform.stdvs**2).expand(3, 4, 2))
    torch.testing.assert_close(got.mean, full.mean)
    got1 = m.posterior(Xs, output_indices=[0], observation_noise=noise)
    torch.testing.assert_close(got1.variance, full.variance[..., :1] + 0.1 * m.outcome_transform.stdvs[0, 0] ** 2)
    with pytest.raises(ValueError, match="output_indices must be"):
        m.posterior(Xs, output_indices=[2])
    with pytest.raises(ValueError, match="observation_noise must have shape"):
        m.posterior(Xs, observation_noise=torch.ones(3, 5, 2, dtype=torch.float64))
    # BoTorch's model list: outputs selected across its models, and subset_output with numpy indices
    m1 = FalkonModel(X, Y[:, :1], num_centers=30)
    lst = ModelListGP(m, m1)
    p = lst.posterior(Xs, output_indices=[1])
    assert p.mean.shape == (3, 4, 1)
    torch.testing.assert_close(p.mean, full.mean[..., 1:])
    sub = lst.subset_output([1])
    torch.testing.assert_close(sub.posterior(Xs).mean, full.mean[..., 1:])


def test_model_list_condition_on_observations_matches_each_models_own():
    """ModelListGP.condition_on_observations reaches each model's GPyTorch ``get_fantasy_model``: the result
    is each model conditioned on its rows (outcome-transformed by BoTorch), as the model's own conditioning."""
    from botorch.models import ModelListGP

    X, Y = _two_outputs()
    ma = FalkonModel(X, Y[:, :1], num_centers=30, tol=1e-12, max_iter=500)
    mb = FalkonModel(X, Y[:, 1:], num_centers=30, tol=1e-12, max_iter=500)
    Xn = torch.rand(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    Yn = torch.stack([torch.sin(4 * Xn).sum(-1), 3 * Xn[:, 0] + 2], -1)
    cond = ModelListGP(ma, mb).condition_on_observations([Xn, Xn], Yn)
    Xs = torch.rand(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    for j, (model, got) in enumerate(zip((ma, mb), cond.models, strict=True)):
        ref = model.condition_on_observations(Xn, Yn[:, j : j + 1])  # a refit on the 153 rows
        # BoTorch hands each one-output model its targets as (1, n'): a batch of one set, as SingleTaskGP's
        post = got.posterior(Xs)
        assert post.mean.shape == (1, 5, 1)
        torch.testing.assert_close(post.mean[0], ref.posterior(Xs).mean, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(post.variance[0], ref.posterior(Xs).variance, rtol=1e-6, atol=1e-10)
    # GPyTorch's plain call, (n', d) and (n',) in the transformed spaces: a refitted FalkonModel
    yt = ma.outcome_transform(Yn[:, :1])[0].squeeze(-1)
    plain = ma.get_fantasy_model(Xn, yt)
    assert isinstance(plain, FalkonModel) and plain.train_inputs[0].shape[0] == 153
    torch.testing.assert_close(plain.posterior(Xs).mean, ma.condition_on_observations(Xn, Yn[:, :1]).posterior(Xs).mean)
    with pytest.raises(ValueError, match="inputs and targets must be tensors"):
        ma.get_fantasy_model(Xn[0], Yn[:, 0])
    with pytest.raises(ValueError, match="targets must have shape"):
        ma.get_fantasy_model(Xn, Yn[:2, 0])


def test_load_state_dict_re_applies_the_loaded_input_transform():
    """BoTorch's warm start: a model on more data loads the hyperparameters and the Normalize bounds of a model
    fitted on fewer; its training inputs are rebuilt from the untransformed ones by the loaded bounds (as
    SingleTaskGP's), so after fit() it predicts as a model built in that space from scratch."""
    g = torch.Generator().manual_seed(0)

    def f(x):
        return torch.sin(x).sum(-1, keepdim=True)

    X = torch.rand(100, 2, dtype=torch.float64, generator=g) * 3
    X2 = torch.cat([X, torch.rand(50, 2, dtype=torch.float64, generator=g) * 3 + 3])
    m = FalkonModel(X, f(X), num_centers=30, input_transform=Normalize(d=2), penalty=1e-5, tol=1e-12, max_iter=500)
    warm = FalkonModel(X2, f(X2), num_centers=30, input_transform=Normalize(d=2), penalty=1e-5, fit=False,
                       tol=1e-12, max_iter=500)
    warm.load_state_dict(m.state_dict())
    torch.testing.assert_close(warm.train_inputs[0], (X2 - X.min(0).values) / (X.max(0).values - X.min(0).values))
    warm.fit()
    # the reference: FalkonGP on the inputs scaled by the first model's bounds, its centers and kernel
    lo, span = m.input_transform.offset, m.input_transform.coefficient
    ref = FalkonGP((X2 - lo) / span, warm.train_targets, kernel=m.kernel, centers=m.centers.detach(),
                   penalty=float(warm.penalty), tol=1e-12, max_iter=500).fit().eval()
    Xs = torch.rand(20, 2, dtype=torch.float64, generator=g) * 6
    want = warm.outcome_transform.untransform(ref.posterior_mean((Xs - lo) / span).unsqueeze(-1))[0]
    torch.testing.assert_close(warm.posterior(Xs).mean, want, rtol=1e-8, atol=1e-10)


def test_reload_with_an_eval_only_input_transform_old_pickles_tuple_inputs_and_batched_noise():
    """Review fixes: an input transform that acts only in eval mode (InputPerturbation) is not applied to the
    training inputs on reload (construction did not); a FalkonModel pickled before the untransformed inputs were
    kept still conditions; set_train_data takes GPyTorch's 1-tuple; a (q, m) noise broadcasts over X's batch."""
    from botorch.models.transforms.input import InputPerturbation

    X, Y = _data(n=200)
    tf = lambda: InputPerturbation(perturbation_set=torch.zeros(2, 2, dtype=torch.float64))
    m = FalkonModel(X, Y, num_centers=20, input_transform=tf())
    m2 = FalkonModel(X, Y, num_centers=20, input_transform=tf(), fit=False)
    m2.load_state_dict(m.state_dict())
    assert m2.train_inputs[0].shape == (200, 2) and bool(m2.fitted)
    plain = FalkonModel(X, Y, num_centers=20, input_transform=Normalize(d=2))
    old = dict(plain.__dict__)
    old["_buffers"] = {k: v for k, v in plain._buffers.items() if k != "_original_train_X"}
    old["_non_persistent_buffers_set"] = set()
    restored = FalkonModel.__new__(FalkonModel)
    restored.__setstate__(old)
    assert restored._original_train_X is None
    Xn = torch.rand(3, 2, dtype=torch.float64)
    restored.condition_on_observations(Xn, torch.zeros(3, 1, dtype=torch.float64))
    plain.set_train_data(inputs=(plain.train_inputs[0][:150],), targets=plain.train_targets[:150])
    assert plain._original_train_X is None and plain.train_inputs[0].shape[0] == 150
    X2, Y2 = _two_outputs()
    mm = FalkonModel(X2, Y2, num_centers=20)
    Xb = torch.rand(4, 2, 2, dtype=torch.float64)  # q = m = 2
    noise = torch.tensor([[0.1, 0.3], [0.2, 0.4]], dtype=torch.float64)
    got = mm.posterior(Xb, observation_noise=noise).variance - mm.posterior(Xb).variance
    torch.testing.assert_close(got, (noise * mm.outcome_transform.stdvs**2).expand(4, 2, 2))


def test_a_multi_output_model_pickles_with_its_noise_prior():
    """The default two-output likelihood (SingleTaskGP's LogNormal noise prior, one shared noise) pickles and
    torch.saves, as its subset_output does; its prior's log density equals GPyTorch's ``noise_prior=`` one (which
    registers a lambda, so a likelihood built with it cannot be pickled)."""
    import io
    import pickle

    from gpytorch.likelihoods import MultitaskGaussianLikelihood
    from gpytorch.priors import LogNormalPrior

    X, Y = _data(m=2)
    model = FalkonModel(X, Y, num_centers=20)
    Xt = X[:4] + 0.01
    for copy_ in (pickle.loads(pickle.dumps(model)), pickle.loads(pickle.dumps(model.subset_output([1])))):
        want = model.posterior(Xt).mean[..., -1:] if copy_.num_outputs == 1 else model.posterior(Xt).mean
        torch.testing.assert_close(copy_.posterior(Xt).mean, want)
    torch.save(model, io.BytesIO())
    ref = MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_task_noise=False,
                                      noise_prior=LogNormalPrior(-4.0, 1.0)).double()
    ref._set_noise(model.likelihood.noise.detach())
    (_, _, p_ref, c_ref, _), = ref.named_priors()
    (name, mod, p, c, _), = model.likelihood.named_priors()
    assert name == "raw_noise_prior"
    torch.testing.assert_close(p.log_prob(c(mod)), p_ref.log_prob(c_ref(ref)))


def test_condition_on_observations_of_an_unfitted_model_fits_from_zero():
    """``fit=False`` then ``condition_on_observations``: the conditioned model is the fit on all rows (CG from zero:
    there is no solution to start from), as a model built on all rows is."""
    X, Y = _data(n=200)
    Xn, Yn = X[:5] + 0.01, Y[:5]
    kw = dict(tol=1e-12, max_iter=500, outcome_transform=None)
    model = FalkonModel(X, Y, fit=False, num_centers=30, seed=0, **kw)
    cond = model.condition_on_observations(Xn, Yn)
    ref = FalkonModel(torch.cat([X, Xn]), torch.cat([Y, Yn]), centers=cond.centers.clone(), **kw)
    torch.testing.assert_close(cond.posterior(X[:4]).mean, ref.posterior(X[:4]).mean, rtol=1e-8, atol=1e-8)


def test_load_state_dict_of_a_conditioned_or_subset_model_into_a_fresh_one_on_the_same_rows():
    """BoTorch's ``load_state_dict`` re-applies the loaded outcome transform to the targets; FalkonModel re-derives
    them from the untransformed targets exactly as the saved model made them, and checks the saved fit once the
    data are in place: a conditioned model's state (its transform from the first rows) and a ``subset_output``
    model's state load fitted into fresh models on the same raw rows and predict identically; a fresh model on
    other rows loads unfitted, naming ``train_y``."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(300, 3, generator=g, dtype=torch.float64) * 5
    Y = torch.stack([torch.sin(X).sum(-1) * 3 + 10, torch.cos(X).sum(-1) - 4], -1)
    Xn = torch.rand(5, 3, generator=g, dtype=torch.float64) * 5
    Yn = torch.stack([torch.sin(Xn).sum(-1) * 3 + 10, torch.cos(Xn).sum(-1) - 4], -1)
    Xs = torch.rand(10, 3, generator=g, dtype=torch.float64) * 5
    kw = dict(num_centers=40, tol=1e-12, max_iter=500)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # input scaling
        m = FalkonModel(X, Y[:, :1], input_transform=Normalize(d=3), **kw)
        c = m.condition_on_observations(Xn, Yn[:, :1])
        fresh = FalkonModel(torch.cat([X, Xn]), torch.cat([Y, Yn])[:, :1], input_transform=Normalize(d=3), fit=False,
                            **kw)
        m2 = FalkonModel(X, Y, **kw)
        sub = m2.subset_output([1])
        fresh_sub = FalkonModel(X, Y[:, 1:], fit=False, **kw)
        other = FalkonModel(X, Y[:, 1:] + 1.0, fit=False, **kw)
    for src, dst in ((c, fresh), (sub, fresh_sub)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            dst.load_state_dict(src.state_dict())
        assert bool(dst.fitted)
        torch.testing.assert_close(dst.posterior(Xs).mean, src.posterior(Xs).mean, rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match="train_y"):
        other.load_state_dict(sub.state_dict())
    assert not bool(other.fitted)


def test_a_model_with_replaced_targets_loads_its_own_state_fitted():
    """Targets replaced by ``set_train_data`` (the untransformed ones unknown) and fitted: BoTorch's
    untransform-then-transform of them by the same transform is a few ulps off; loading the model's own state keeps
    it fitted (the targets are kept as they were), and a state that fails to load midway leaves it cleanly
    unfitted."""
    X, Y = _data(n=150)
    m = FalkonModel(X, Y, num_centers=20, tol=1e-12, max_iter=500)
    m.set_train_data(targets=m.train_targets + 0.1)
    m.fit()
    assert m._original_train_Y is None
    Xt = X[:4] + 0.01
    want = m.posterior(Xt).mean
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        m.load_state_dict(m.state_dict())
    assert bool(m.fitted)
    torch.testing.assert_close(m.posterior(Xt).mean, want, rtol=0, atol=0)
    bad = dict(m.state_dict(), unexpected_key=torch.zeros(1))
    with pytest.raises(RuntimeError, match="unexpected_key"):
        m.load_state_dict(bad)
    assert not bool(m.fitted)
    with pytest.raises(NotFittedError):
        m.posterior(Xt)


def test_batched_multi_output_posterior_leaves_the_cached_factors_constant():
    """A (b, q, d) posterior of a 2-output model with X requiring grad (linear_operator's Kronecker product flags
    its factors' tensors): the model's cached factors stay constants, accumulate no .grad, and later posteriors
    under no_grad carry no graph; the gradient w.r.t. X is the same on every call."""
    g = torch.Generator().manual_seed(3)
    X = torch.rand(40, 3, dtype=torch.float64, generator=g)
    Y = torch.stack([torch.sin(3 * X.sum(-1)), X[:, 0] ** 2], -1)
    model = FalkonModel(X, Y, num_centers=25)
    f = model.posterior_factors()
    grads = []
    for _ in range(2):
        xq = torch.rand(4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
        model.posterior(xq).variance.sum().backward()
        grads.append(xq.grad)
    assert not f.L.requires_grad and not f.LB.requires_grad and f.L.grad is None and f.LB.grad is None
    torch.testing.assert_close(grads[0], grads[1])
    with torch.no_grad():
        assert not model.posterior(X[:3]).rsample(torch.Size([2])).requires_grad
