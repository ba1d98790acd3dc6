"""Batched fantasies of FalkonModel (gpfalkon.integrations.fantasy) against independent references:
the dense SGPR/DTC posterior of the n + q rows, and FalkonModels refitted on each fantasy set.

Uses BoTorch's own test utilities (``BotorchTestCase``: device, warning filters, ``assertAllClose``;
``get_random_data``; BoTorch's samplers and acquisition functions).
"""
from __future__ import annotations

import copy

import torch
from botorch.acquisition import PosteriorMean, qKnowledgeGradient
from botorch.models.transforms.input import Normalize
from botorch.optim import optimize_acqf
from botorch.sampling import SobolQMCNormalSampler
from botorch.utils.testing import BotorchTestCase, get_random_data

from gpfalkon.botorch import FalkonModel
from gpfalkon.integrations.fantasy import FalkonFantasyModel

F64 = {"dtype": torch.float64}


def dense_dtc(model: FalkonModel, X: torch.Tensor, y: torch.Tensor, noise: torch.Tensor, xt: torch.Tensor):
    """The SGPR/DTC posterior mean and covariance at ``xt`` of the rows ``X`` (``(n, d)``), centered-free
    targets ``y`` (``(n,)``) with per-row noise ``noise`` (``(n,)``), by dense float64 solves."""
    k = model.kernel
    c = model.centers.detach()
    with torch.no_grad():
        kmm = k(c).to_dense()
        kmn = k(c, X).to_dense()
        kxm = k(xt, c).to_dense()
        kxx = k(xt).to_dense()
    mu = float(model.mean_constant.reshape(-1)[0])
    sigma = torch.linalg.inv(kmm + (kmn / noise) @ kmn.mT)
    mean = mu + kxm @ sigma @ (kmn @ ((y - mu) / noise))
    cov = kxx - kxm @ torch.linalg.solve(kmm, kxm.mT) + kxm @ sigma @ kxm.mT
    return mean, cov


class TestFalkonFantasies(BotorchTestCase):
    def _model(self, m: int = 1, n: int = 160, **kw) -> FalkonModel:
        X, Y = get_random_data(torch.Size(), m=m, d=2, n=n, **F64)
        X[:, 1] = torch.rand(n, generator=torch.Generator().manual_seed(1), **F64)  # off the diagonal
        kw.setdefault("outcome_transform", None)
        return FalkonModel(X, Y, num_centers=25, penalty=1e-3, tol=1e-12, max_iter=2000, **kw)

    def test_batched_conditioning_equals_the_dense_dtc_posterior(self) -> None:
        model = self._model()
        g = torch.Generator().manual_seed(3)
        Xf = torch.rand(3, 2, 4, 2, generator=g, **F64)  # batch (3, 2), q = 4
        Yf = torch.randn(5, 3, 2, 4, 1, generator=g, **F64)  # batch (5, 3, 2): broadcasts over X's batch
        fm = model.condition_on_observations(Xf, Yf)
        self.assertIsInstance(fm, FalkonFantasyModel)
        self.assertEqual(fm.batch_shape, torch.Size([5, 3, 2]))
        xt = torch.rand(6, 2, generator=g, **F64)
        post = fm.posterior(xt)  # (6, d) broadcasts over the model's batch
        self.assertEqual(post.mean.shape, torch.Size([5, 3, 2, 6, 1]))
        X0, y0 = model.train_inputs[0], model.train_targets
        v = model.noise.detach()
        for i, j, k in [(0, 0, 0), (4, 2, 1), (2, 1, 0)]:
            Xall = torch.cat([X0, Xf[j, k]])
            yall = torch.cat([y0, Yf[i, j, k, :, 0]])
            mean, cov = dense_dtc(model, Xall, yall, v.expand(Xall.shape[0]), xt)
            self.assertAllClose(post.mean[i, j, k, :, 0], mean, rtol=1e-7, atol=1e-8)
            self.assertAllClose(post.distribution.covariance_matrix[i, j, k], cov, rtol=1e-7, atol=1e-9)
        # observation noise adds sigma^2 to the diagonal
        noisy = fm.posterior(xt, observation_noise=True)
        self.assertAllClose(noisy.variance - post.variance, v.expand_as(post.variance), rtol=1e-10, atol=1e-12)

    def test_per_observation_noise_and_two_outputs(self) -> None:
        model = self._model(m=2)
        g = torch.Generator().manual_seed(4)
        Xf = torch.rand(2, 3, 2, generator=g, **F64)
        Yf = torch.randn(2, 3, 2, generator=g, **F64)
        noise = torch.rand(2, 3, 2, generator=g, **F64) * 0.1 + 0.01  # per point and output
        fm = model.condition_on_observations(Xf, Yf, noise=noise)
        xt = torch.rand(2, 5, 2, generator=g, **F64)
        post = fm.posterior(xt)
        self.assertEqual(post.mean.shape, torch.Size([2, 5, 2]))
        X0, y0 = model.train_inputs[0], model.train_targets
        v = model.noise.detach()
        cov_all = post.distribution.covariance_matrix
        # the rows of output t: interleaved (point, output) order, or output blocks
        rows = (lambda t: slice(t, None, 2)) if post.distribution._interleaved else (lambda t: slice(5 * t, 5 * t + 5))
        for b in range(2):
            for t in range(2):
                Xall = torch.cat([X0, Xf[b]])
                yall = torch.cat([y0[:, t], Yf[b, :, t]])
                nall = torch.cat([v.expand(X0.shape[0]), noise[b, :, t]])
                mean, cov = dense_dtc(model, Xall, yall, nall, xt[b])
                self.assertAllClose(post.mean[b, :, t], mean, rtol=1e-7, atol=1e-8)
                self.assertAllClose(cov_all[b][rows(t), rows(t)], cov, rtol=1e-7, atol=1e-9)
        # outputs are independent given the shared centers
        self.assertAllClose(cov_all[0][rows(0), rows(1)], torch.zeros(5, 5, **F64), atol=1e-12, rtol=0)
        sub = fm.posterior(xt, output_indices=[1])
        self.assertAllClose(sub.mean[..., 0], post.mean[..., 1], rtol=1e-12, atol=1e-12)

    def test_fantasize_with_transforms_equals_refitted_models(self) -> None:
        X, Y = get_random_data(torch.Size(), m=1, d=2, n=200, **F64)
        X[:, 1] = torch.rand(200, generator=torch.Generator().manual_seed(2), **F64)
        X = X * 4 - 1  # outside the unit cube: Normalize maps it in
        model = FalkonModel(X, Y * 3 + 2, num_centers=30, penalty=1e-3, tol=1e-13, max_iter=3000,
                            input_transform=Normalize(d=2), outcome_transform="standardize")
        Xf = torch.rand(3, 2, 2, generator=torch.Generator().manual_seed(5), **F64) * 4 - 1
        sampler = SobolQMCNormalSampler(torch.Size([2]), seed=0)
        fm = model.fantasize(Xf, sampler)
        self.assertEqual(fm.batch_shape, torch.Size([2, 3]))
        # the fantasized observations in the original scale: the base posterior's samples at Xf
        y_f = sampler(model.posterior(Xf, observation_noise=True))
        xt = torch.rand(4, 2, generator=torch.Generator().manual_seed(6), **F64) * 4 - 1
        post = fm.posterior(xt)
        for s, b in [(0, 0), (1, 2)]:
            refit = model.condition_on_observations(Xf[b], y_f[s, b])  # FALKON on the n + q rows
            self.assertIsInstance(refit, FalkonModel)
            ref = refit.posterior(xt)
            self.assertAllClose(post.mean[s, b], ref.mean, rtol=1e-6, atol=1e-7)
            self.assertAllClose(post.variance[s, b], ref.variance, rtol=1e-6, atol=1e-8)

    def test_standardize_with_noise_in_the_transformed_space_and_output_indices(self) -> None:
        """Two outputs through Standardize: ``noise`` is taken in the transformed space (BoTorch's
        convention), the result equals the dense DTC posterior of the standardised rows mapped back;
        without ``noise`` the outputs share sigma^2; ``output_indices`` in any order."""
        X, Y = get_random_data(torch.Size(), m=2, d=2, n=150, **F64)
        X[:, 1] = torch.rand(150, generator=torch.Generator().manual_seed(12), **F64)
        Y = Y * torch.tensor([3.0, 0.5], **F64) + torch.tensor([1.0, -2.0], **F64)
        model = FalkonModel(X, Y, num_centers=25, penalty=1e-3, tol=1e-13, max_iter=3000)
        tf = model.outcome_transform
        mu, sd = tf.means.reshape(-1), tf.stdvs.reshape(-1)
        g = torch.Generator().manual_seed(13)
        Xf = torch.rand(3, 2, 2, generator=g, **F64)
        Yf = torch.randn(3, 2, 2, generator=g, **F64) * 2
        noise_t = torch.rand(3, 2, 2, generator=g, **F64) * 0.05 + 0.01  # transformed space
        xt = torch.rand(4, 2, generator=g, **F64)
        X0, y0 = model.train_inputs[0], model.train_targets  # standardised targets
        v = model.noise.detach()
        for noise in (noise_t, None):
            post = model.condition_on_observations(Xf, Yf, noise=noise).posterior(xt)
            for b in (0, 2):
                for t in range(2):
                    Xall = torch.cat([X0, Xf[b]])
                    yall = torch.cat([y0[:, t], (Yf[b, :, t] - mu[t]) / sd[t]])
                    nf = v.expand(2) if noise is None else noise[b, :, t]
                    mean, cov = dense_dtc(model, Xall, yall, torch.cat([v.expand(X0.shape[0]), nf]), xt)
                    self.assertAllClose(post.mean[b, :, t], mean * sd[t] + mu[t], rtol=1e-7, atol=1e-7)
                    self.assertAllClose(post.variance[b, :, t], cov.diagonal() * sd[t] ** 2, rtol=1e-7, atol=1e-9)
            for idx in ([1, 0], [1], [0, 0]):
                sub = model.condition_on_observations(Xf, Yf, noise=noise).posterior(xt, output_indices=idx)
                self.assertAllClose(sub.mean, post.mean[..., idx], rtol=1e-12, atol=1e-12)
                self.assertAllClose(sub.variance, post.variance[..., idx], rtol=1e-12, atol=1e-12)
            for idx in ([1], [1, 0]):  # the fantasy model's subset_output: those outputs' fantasy model
                sub_model = model.condition_on_observations(Xf, Yf, noise=noise).subset_output(idx)
                self.assertIsInstance(sub_model, FalkonFantasyModel)
                self.assertEqual(sub_model.num_outputs, len(idx))
                sub = sub_model.posterior(xt)
                self.assertAllClose(sub.mean, post.mean[..., idx], rtol=1e-9, atol=1e-9)
                self.assertAllClose(sub.variance, post.variance[..., idx], rtol=1e-9, atol=1e-11)

    def test_nested_fantasize_and_model_list(self) -> None:
        """A fantasy model fantasizes again (multi-step look-ahead), and a ModelListGP of FalkonModels
        fantasizes into a list of fantasy models whose posteriors are the members'."""
        from botorch.models import ModelListGP

        model = self._model()
        g = torch.Generator().manual_seed(14)
        X1, X2 = torch.rand(2, 1, 2, generator=g, **F64), torch.rand(2, 1, 2, generator=g, **F64)
        fm = model.fantasize(X1, SobolQMCNormalSampler(torch.Size([3]), seed=0))
        fm2 = fm.fantasize(X2, SobolQMCNormalSampler(torch.Size([4]), seed=1))
        self.assertEqual(fm2.batch_shape, torch.Size([4, 3, 2]))
        xt = torch.rand(5, 2, generator=g, **F64)
        # the same as conditioning the base model on both fantasy rows at once
        once = model.condition_on_observations(torch.cat([X1.expand(4, 3, 2, 1, 2), X2.expand(4, 3, 2, 1, 2)], -2),
                                               torch.cat([fm._Y.expand(4, 3, 2, 1, 1), fm2._Y[..., -1:, :]], -2))
        self.assertAllClose(fm2.posterior(xt).mean, once.posterior(xt).mean, rtol=1e-10, atol=1e-12)
        other = self._model(m=1, n=120)
        mlist = ModelListGP(model, other)
        flist = mlist.fantasize(X1, SobolQMCNormalSampler(torch.Size([3]), seed=2))
        p = flist.posterior(xt)
        self.assertEqual(p.mean.shape, torch.Size([3, 2, 5, 2]))
        alone = model.fantasize(X1, SobolQMCNormalSampler(torch.Size([3]), seed=2)).posterior(xt)
        self.assertAllClose(p.variance[..., 0], alone.variance[..., 0], rtol=1e-10, atol=1e-12)

    def test_conditioning_a_fresh_model_keeps_its_input_transform(self) -> None:
        X, Y = get_random_data(torch.Size(), m=1, d=2, n=100, **F64)
        model = FalkonModel(X * 5, Y, num_centers=20, input_transform=Normalize(d=2))
        bounds = model.input_transform.bounds.clone()
        model.condition_on_observations(torch.rand(2, 3, 2, **F64) * 50, torch.rand(2, 3, 1, **F64))
        self.assertAllClose(model.input_transform.bounds, bounds, rtol=0, atol=0)

    def test_conditioning_a_fantasy_model_again_appends_rows(self) -> None:
        model = self._model()
        g = torch.Generator().manual_seed(7)
        X1, Y1 = torch.rand(2, 3, 2, generator=g, **F64), torch.randn(2, 3, 1, generator=g, **F64)
        X2, Y2 = torch.rand(2, 2, 2, generator=g, **F64), torch.randn(2, 2, 1, generator=g, **F64)
        twice = model.condition_on_observations(X1, Y1).condition_on_observations(X2, Y2)
        once = model.condition_on_observations(torch.cat([X1, X2], -2), torch.cat([Y1, Y2], -2))
        xt = torch.rand(5, 2, generator=g, **F64)
        self.assertAllClose(twice.posterior(xt).mean, once.posterior(xt).mean, rtol=1e-10, atol=1e-12)
        self.assertAllClose(twice.posterior(xt).variance, once.posterior(xt).variance, rtol=1e-10, atol=1e-12)
        # no fantasy rows: the model's own posterior
        empty = model.condition_on_observations(torch.rand(2, 0, 2, **F64), torch.rand(2, 0, 1, **F64))
        self.assertAllClose(empty.posterior(xt).mean[0], model.posterior(xt).mean, rtol=1e-8, atol=1e-9)
        self.assertAllClose(empty.posterior(xt).variance[1], model.posterior(xt).variance, rtol=1e-8, atol=1e-10)

    def test_gradients_match_finite_differences(self) -> None:
        model = self._model(n=80)
        g = torch.Generator().manual_seed(8)
        Xf = torch.rand(2, 2, 2, generator=g, **F64).requires_grad_(True)
        Yf = torch.randn(2, 2, 1, generator=g, **F64).requires_grad_(True)
        xt = torch.rand(2, 3, 2, generator=g, **F64).requires_grad_(True)

        def f(xf: torch.Tensor, yf: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            p = model.condition_on_observations(xf, yf).posterior(z)
            return torch.cat([p.mean.reshape(-1), p.variance.reshape(-1)])

        self.assertTrue(torch.autograd.gradcheck(f, (Xf, Yf, xt)))

    def test_knowledge_gradient_equals_refitted_fantasies(self) -> None:
        X, Y = get_random_data(torch.Size(), m=1, d=2, n=150, **F64)
        X[:, 1] = torch.rand(150, generator=torch.Generator().manual_seed(9), **F64)
        model = FalkonModel(X, Y, num_centers=25, penalty=1e-3, tol=1e-13, max_iter=3000)
        acqf = qKnowledgeGradient(model, num_fantasies=4, sampler=SobolQMCNormalSampler(torch.Size([4]), seed=1),
                                  current_value=torch.tensor(0.0, **F64))
        g = torch.Generator().manual_seed(10)
        x_actual = torch.rand(1, 1, 2, generator=g, **F64)
        x_fant = torch.rand(4, 1, 1, 2, generator=g, **F64)
        value = acqf(torch.cat([x_actual, x_fant.reshape(1, 4, 2)], -2))
        # reference: each fantasy's model refitted by FALKON, its posterior mean at its own point
        y_f = SobolQMCNormalSampler(torch.Size([4]), seed=1)(model.posterior(x_actual, observation_noise=True))
        ref = torch.stack([
            PosteriorMean(model.condition_on_observations(x_actual[0], y_f[i, 0]))(x_fant[i, 0]) for i in range(4)
        ]).mean()
        self.assertAllClose(value.reshape(()), ref.reshape(()), rtol=1e-6, atol=1e-7)
        # the one-shot optimisation runs end to end (gradients through the fantasies)
        bounds = torch.tensor([[0.0, 0.0], [1.0, 1.0]], **F64)
        cand, val = optimize_acqf(acqf, bounds=bounds, q=1, num_restarts=2, raw_samples=16,
                                  options={"maxiter": 20})
        self.assertEqual(cand.shape, torch.Size([1, 2]))
        self.assertTrue(bool(((cand >= 0) & (cand <= 1)).all()))
        self.assertTrue(bool(torch.isfinite(val).all()))

    def test_bad_fantasies_raise_clearly(self) -> None:
        model = self._model()
        with self.assertRaisesRegex(ValueError, "X must have shape"):
            model.condition_on_observations(torch.rand(2, 3, 5, **F64), torch.rand(2, 3, 1, **F64))
        with self.assertRaisesRegex(ValueError, "Y must have shape"):
            model.condition_on_observations(torch.rand(2, 3, 2, **F64), torch.rand(2, 4, 1, **F64))
        with self.assertRaisesRegex(ValueError, "NaN"):
            model.condition_on_observations(torch.rand(2, 3, 2, **F64), torch.full((2, 3, 1), float("nan"), **F64))
        with self.assertRaisesRegex(ValueError, "noise .* positive"):
            model.condition_on_observations(torch.rand(2, 3, 2, **F64), torch.rand(2, 3, 1, **F64),
                                            noise=torch.zeros(2, 3, 1, **F64))
        with self.assertRaisesRegex(ValueError, "X and Y must be tensors"):
            model.condition_on_observations(torch.rand(3, **F64), torch.rand(3, 1, **F64))

    def test_fantasies_of_a_changed_or_refitted_base_are_stale(self) -> None:
        """The fantasy model holds the base fit's factors: a hyperparameter change of the base, or a new fit of it,
        makes its posterior (and further conditioning) raise NotFittedError instead of mixing two fits."""
        from gpfalkon import NotFittedError

        model = self._model()
        g = torch.Generator().manual_seed(3)
        Xf, Yf = torch.rand(2, 3, 2, generator=g, **F64), torch.randn(2, 3, 1, generator=g, **F64)
        xt = torch.rand(4, 2, generator=g, **F64)
        fm = model.condition_on_observations(Xf, Yf)
        fm.posterior(xt)
        with torch.no_grad():
            model.kernel.raw_lengthscale.add_(0.5)
        with self.assertRaises(NotFittedError):
            fm.posterior(xt)
        model.fit()
        with self.assertRaisesRegex(NotFittedError, "fitted again"):
            fm.posterior(xt)
        with self.assertRaisesRegex(NotFittedError, "fitted again"):
            fm.condition_on_observations(Xf, Yf)
        fresh = model.condition_on_observations(Xf, Yf)  # conditioning the new fit works
        fresh.posterior(xt)
        # a state loaded into the base (alpha copied in place: the same tensor) or a rescaled prior: stale too
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.kernel.raw_lengthscale.add_(0.3)
        other.fit()
        model.load_state_dict(other.state_dict())
        with self.assertRaisesRegex(NotFittedError, "fitted again"):
            fresh.posterior(xt)
        from gpytorch.kernels import RBFKernel, ScaleKernel

        scaled = self._model(kernel=ScaleKernel(RBFKernel()).double())
        fresh = scaled.condition_on_observations(Xf, Yf)
        scaled.scale_prior(2.0)
        with self.assertRaisesRegex(NotFittedError, "fitted again"):
            fresh.posterior(xt)
        unfitted = self._model(fit=False)
        with self.assertRaises(NotFittedError):
            unfitted.condition_on_observations(Xf, Yf)
