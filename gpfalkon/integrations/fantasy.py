r"""The Nyström posterior conditioned on batches of fantasy observations (docs/math.md §4.1).

BoTorch's look-ahead acquisition functions (``qKnowledgeGradient``, ``qMultiFidelityKnowledgeGradient``,
``qMultiStepLookahead``...) condition the model on ``batch`` sets of ``q`` sampled observations
(``batch`` = fantasies x restarts, often thousands) and query the conditioned models' posteriors.
Refitting FALKON once per set would cost ``batch`` fits; here the conditioning is exact and closed
form: with the centers, kernel and noise of the fitted model kept, the fantasy rows enter the
SGPR/DTC normal matrix as a rank-``q`` update, and the Woodbury identity on a ``q x q`` system
gives the conditioned posterior in ``O(q M^2 + q^2 M)`` per set, without touching the ``n``
training rows again. GPyTorch's ``get_fantasy_model`` updates an exact GP's ``n x n`` caches,
which a Nyström model does not have, hence this module.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from botorch.models.model import FantasizeMixin, Model
from botorch.posteriors.gpytorch import GPyTorchPosterior
from linear_operator.operators import DenseLinearOperator
from torch import Tensor

from ..errors import NotFittedError
from ..models.posterior import (
    NystromMultitaskMultivariateNormal,
    NystromMultivariateNormal,
    posterior_roots,
    shared_covariance_distribution,
)

if TYPE_CHECKING:
    from .botorch_model import FalkonModel

__all__ = ["FalkonFantasyModel"]


class FalkonFantasyModel(Model, FantasizeMixin):
    r"""A fitted :class:`~gpfalkon.botorch.FalkonModel` conditioned on fantasy observations.

    With ``L L^T = K_MM``, ``L_B L_B^T = B = I + A A^T / v`` (``A = L^{-1} K_Mn``, ``v = sigma^2``)
    from the fitted model and, per fantasy set, inputs ``X_f`` (``q x d``), targets ``y_f``
    (centered, transformed) and noise ``D = diag(d_1..d_q)`` (default ``v I``):

        U = L_B^{-1} L^{-1} K_Mf,   W = U D^{-1/2},   S = I_q + W^T W,
        g = L_B^T L^T alpha,        g_f = g + W D^{-1/2} y_f,

    and for test points with ``a = L^{-1} K_M*``, ``c = L_B^{-1} a``:

        mean(X*) = mu + c^T g_f - (W^T c)^T S^{-1} (W^T g_f)
        cov(X*)  = K_** - a^T a + c^T c - (W^T c)^T S^{-1} (W^T c),

    which is exactly the SGPR/DTC posterior of the ``n + q`` rows with the same centers
    (``B_f = L_B (I + W W^T) L_B^T``; docs/math.md §4.1). Building the model costs
    ``O(batch q M (M + d) + batch q^2 M)``; a posterior over ``p`` points
    ``O(batch p (M^2 + q M + p d))`` and holds the ``p x p`` covariance densely (look-ahead
    acquisition functions query a few points per fantasy set). Differentiable w.r.t. the
    fantasy inputs and targets and the test inputs (what one-shot knowledge gradient needs).

    The model's ``batch_shape`` is the broadcast of the batch shapes of ``X_f`` and ``y_f``.
    It shares the fitted model's kernel, transforms and factors: changing the base model's
    hyperparameters afterwards, or fitting it again, makes it stale (it is a short-lived object, as in BoTorch):
    its ``posterior`` and ``condition_on_observations`` then raise ``NotFittedError``.
    Conditioning it again appends the new observations to the fantasy sets (the same
    closed form with ``q + q'`` rows).
    """

    def __init__(self, base: FalkonModel, X: Tensor, Y: Tensor, noise: Tensor | None = None) -> None:
        """``X``: transformed fantasy inputs ``(batch_x..., q, d)``; ``Y``: transformed targets
        ``(batch_y..., q, m)``; ``noise``: their noise variances (transformed), broadcastable to ``Y``,
        or ``None`` for the model's ``sigma^2``."""
        super().__init__()
        d, m = base.train_inputs[0].shape[-1], base.num_outputs
        if X.dim() < 2 or X.shape[-1] != d:
            raise ValueError(f"X must have shape (..., q, {d}), got {tuple(X.shape)}")
        if Y.dim() < 2 or Y.shape[-1] != m or Y.shape[-2] != X.shape[-2]:
            raise ValueError(
                f"Y must have shape (..., {X.shape[-2]}, {m}) to match X {tuple(X.shape)}, got {tuple(Y.shape)}"
            )
        if not bool(torch.isfinite(X).all()) or not bool(torch.isfinite(Y).all()):
            raise ValueError("the fantasy observations X, Y contain NaN or Inf values")
        if noise is not None:
            ok = noise.dim() >= 2
            try:
                ok = ok and torch.broadcast_shapes(noise.shape, Y.shape) == Y.shape
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"noise must broadcast to Y's shape {tuple(Y.shape)}, got {tuple(noise.shape)}")
            # its own batch dims only: W and S need not be repeated over, e.g., the fantasy samples
            noise = noise.expand(*noise.shape[:-2], *Y.shape[-2:])
            if not bool((noise > 0).all()):
                raise ValueError("noise (the fantasy observations' variances) must be positive")
        base._check_fitted()
        self._base = [base]  # not a submodule: the fantasy model holds no parameters of its own
        self._generation = base._factors_generation  # the fit the factors below belong to (a refit, a load, new
        # data, a move or a rescaled prior changes it)
        self._X, self._Y, self._noise = X, Y, noise
        self._num_outputs = m
        self._batch_shape = torch.broadcast_shapes(X.shape[:-2], Y.shape[:-2])
        f = base.posterior_factors()
        self._L, self._LB = f.L, f.LB
        self._centers = base.centers.detach()
        alpha = base.alpha.to(torch.float64)
        alpha = alpha.unsqueeze(-1) if alpha.dim() == 1 else alpha  # (M, t)
        g = f.LB.mT @ (f.L.mT @ alpha)  # (M, t)
        self._mu = base.mean_constant.to(torch.float64).reshape(-1).expand(m)
        self._v = base.noise.detach().to(torch.float64)
        q = X.shape[-2]
        _, U = posterior_roots(base.kernel, X, self._centers, f.L, f.LB)  # (batch_x..., M, q)
        y_c = Y.to(torch.float64) - self._mu  # (batch_y..., q, t)
        if noise is None:  # D = v I for every output: W = U / sqrt(v), one S per fantasy set
            s = self._v.rsqrt()
            self._W = U.unsqueeze(-3) * s  # (batch_x..., 1, M, q)
        else:
            s = noise.to(torch.float64).rsqrt().mT  # (..., t, q)
            self._W = U.unsqueeze(-3) * s.unsqueeze(-2)  # (..., t, M, q)
        eye = torch.eye(q, dtype=torch.float64, device=X.device)
        self._LS = torch.linalg.cholesky(eye + self._W.mT @ self._W)  # S = I + W^T W >= I
        ys = (y_c.mT * s).unsqueeze(-1)  # (..., t, q, 1): D^{-1/2} y_f per output
        self._gf = g.mT.unsqueeze(-1) + self._W @ ys  # (..., t, M, 1)
        self._h = torch.cholesky_solve(self._W.mT @ self._gf, self._LS)  # S^{-1} W^T g_f, (..., t, q, 1)

    # ---------------------------------------------------------------- Model API
    @property
    def num_outputs(self) -> int:
        return self._num_outputs

    @property
    def batch_shape(self) -> torch.Size:
        return self._batch_shape

    @property
    def likelihood(self) -> Any:
        """The base model's likelihood (noise ``sigma^2``): BoTorch's ``fantasize`` and
        ``ModelListGP`` read it."""
        return self.base_model.likelihood

    @property
    def base_model(self) -> FalkonModel:
        """The fitted model the fantasies condition."""
        return self._base[0]

    def subset_output(self, idcs: list[int]) -> FalkonFantasyModel:
        """The fantasy model of outputs ``idcs``: the base model's :meth:`~FalkonModel.subset_output` conditioned on
        the same fantasy sets' columns ``idcs`` (the outputs share the kernel, centers and noise, so this is the
        same posterior restricted to them)."""
        full = self._checked_base()
        base = full.subset_output(idcs)
        cols = full._output_indices(idcs, "idcs")
        noise = None if self._noise is None else self._noise[..., cols]
        return FalkonFantasyModel(base, self._X, self._Y[..., cols], noise)

    # BoTorch's Model.posterior signature; FantasizeMixin declares an inconsistent one (*args)
    def posterior(  # type: ignore[override]
        self,
        X: Tensor,
        output_indices: list[int] | None = None,
        observation_noise: bool | Tensor = False,
        posterior_transform: Any | None = None,
        **kwargs: Any,
    ) -> Any:
        """The conditioned posterior at ``X`` (``(batch..., p, d)``, broadcast with the model's
        ``batch_shape``), untransformed by the base model's outcome transform."""
        base = self._checked_base()
        if X.dim() < 2 or X.shape[-1] != self._X.shape[-1]:
            raise ValueError(f"X must have shape (..., p, {self._X.shape[-1]}), got {tuple(X.shape)}")
        Xt = base.transform_inputs(X)
        mean, covar = self._mean_covar(Xt)  # (..., t, p), (..., T, p, p)
        batch = torch.broadcast_shapes(mean.shape[:-2], covar.shape[:-3])  # the covariance does not depend on Y
        mean = mean.expand(*batch, *mean.shape[-2:])
        covar = covar.expand(*batch, *covar.shape[-3:])
        if observation_noise is True:
            covar = covar + self._v * torch.eye(covar.shape[-1], dtype=covar.dtype, device=covar.device)
        elif isinstance(observation_noise, Tensor):  # (..., p, t), transformed space
            covar = covar + torch.diag_embed(observation_noise.to(torch.float64).mT)
        t = self._num_outputs
        if output_indices is not None:
            idx = list(output_indices)
            mean = mean[..., idx, :]
            covar = covar if covar.shape[-3] == 1 else covar[..., idx, :, :]
            t = len(idx)
        dtype = X.dtype
        if t == 1 or covar.shape[-3] == 1:  # one covariance (per output, or shared by all outputs)
            mvn = shared_covariance_distribution(mean.mT.to(dtype), DenseLinearOperator(covar[..., 0, :, :].to(dtype)))
        else:
            mvn = NystromMultitaskMultivariateNormal.from_independent_mvns(
                [
                    NystromMultivariateNormal(mean[..., i, :].to(dtype),
                                              DenseLinearOperator(covar[..., i, :, :].to(dtype)))
                    for i in range(t)
                ]
            )
        posterior: Any = GPyTorchPosterior(mvn)
        if hasattr(base, "outcome_transform"):
            tf = base.outcome_transform
            if output_indices is not None and list(output_indices) != list(range(self._num_outputs)):
                tf = tf.subset_output(list(output_indices))
            posterior = tf.untransform_posterior(posterior)
        if posterior_transform is not None:
            posterior = posterior_transform(posterior)
        return posterior

    def condition_on_observations(
        self, X: Tensor, Y: Tensor, noise: Tensor | None = None, **kwargs: Any
    ) -> FalkonFantasyModel:
        """The base model conditioned on these fantasies and ``(X, Y)`` (raw inputs and targets,
        as BoTorch passes them): the fantasy sets grow by ``X.shape[-2]`` rows."""
        base = self._checked_base()
        base.eval()  # an input transform in train mode would re-learn its bounds from X
        Xt = base.transform_inputs(X)
        Yt = Y
        if hasattr(base, "outcome_transform"):  # noise is in the transformed space already (BoTorch's convention)
            Yt, _ = base.outcome_transform(Y, X=Xt)
        if noise is not None:
            noise = noise.expand(*noise.shape[:-2], *Yt.shape[-2:]) if noise.dim() >= 2 else noise.expand_as(Yt)
        old: Tensor | None
        if (noise is None) != (self._noise is None):  # one of the two uses sigma^2: make it explicit
            v = self._v.to(Y.dtype)
            noise = v.expand(*Yt.shape[-2:]) if noise is None else noise
            old = v.expand(*self._Y.shape[-2:]) if self._noise is None else self._noise
        else:
            old = self._noise

        def cat(a: Tensor, b: Tensor) -> Tensor:  # rows appended; batch dims broadcast, no more
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            return torch.cat([a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])], -2)

        # old is a tensor whenever noise is (both made explicit above, or both given)
        return FalkonFantasyModel(
            base, cat(self._X, Xt), cat(self._Y, Yt), None if noise is None else cat(cast(Tensor, old), noise)
        )

    # ------------------------------------------------------------------ pieces
    def _checked_base(self) -> FalkonModel:
        """The base model, if these fantasies still belong to its fit; ``NotFittedError`` where its hyperparameters
        or data changed, or it was fitted again, since they were built."""
        base = self.base_model
        base._check_fitted()
        if base._factors_generation != self._generation:
            raise NotFittedError("FalkonFantasyModel: the base model was fitted again (or loaded a state, or changed "
                                 "its data or prior scale) after these fantasies were built; condition it again "
                                 "(fantasize / condition_on_observations)")
        return base

    def _mean_covar(self, Xt: Tensor) -> tuple:
        """Mean ``(..., t, p)`` and covariance ``(..., T, p, p)`` in the transformed space (float64)."""
        base = self.base_model
        x64 = Xt.to(torch.float64)
        a, c = posterior_roots(base.kernel, x64, self._centers, self._L, self._LB)  # (bx..., M, p)
        c3 = c.unsqueeze(-3)  # (bx..., 1, M, p)
        wtc = self._W.mT @ c3  # (..., T, q, p)
        mean = (c3.mT @ self._gf).squeeze(-1) - (wtc.mT @ self._h).squeeze(-1)  # (..., t, p)
        mean = mean + self._mu.unsqueeze(-1)
        kxx = base.kernel(x64).to_dense().unsqueeze(-3)  # (bx..., 1, p, p)
        e = torch.linalg.solve_triangular(self._LS, wtc, upper=False)
        covar = kxx - (a.mT @ a - c.mT @ c).unsqueeze(-3) - e.mT @ e
        return mean, covar
