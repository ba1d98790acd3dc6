"""FalkonGP as a BoTorch ``Model`` (posterior for acquisition functions)."""
from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from botorch.models.gpytorch import GPyTorchModel
from botorch.models.model import FantasizeMixin
from botorch.models.transforms.input import InputTransform
from botorch.models.transforms.outcome import OutcomeTransform
from botorch.models.utils.assorted import fantasize as fantasize_flag
from botorch.models.utils.assorted import gpt_posterior_settings, validate_input_scaling
from botorch.models.utils.gpytorch_modules import (
    MIN_INFERRED_NOISE_LEVEL,
    get_covar_module_with_dim_scaled_prior,
    get_gaussian_likelihood_with_lognormal_prior,
)
from botorch.posteriors.gpytorch import GPyTorchPosterior
from gpytorch.constraints import GreaterThan
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import Likelihood, MultitaskGaussianLikelihood
from gpytorch.priors import LogNormalPrior
from linear_operator.operators import DiagLinearOperator, KroneckerProductLinearOperator
from torch import Tensor

from .._validation import is_row_source
from .._warn import warn_caller
from ..models import FalkonGP
from ..models.defaults import default_likelihood
from ..models.falkon_gp import _same_to_rounding
from ..models.posterior import (
    NystromMultitaskMultivariateNormal,
    NystromMultivariateNormal,
    shared_covariance_distribution,
)
from .fantasy import FalkonFantasyModel

__all__ = ["FalkonModel", "default_botorch_likelihood"]


def _same(new: Tensor, old: Tensor) -> bool:
    """``new`` is ``old``, or equal to it in shape, dtype, device and values."""
    return new is old or (new.shape == old.shape and new.dtype == old.dtype and new.device == old.device
                          and bool(torch.equal(new, old)))


def default_botorch_likelihood(
    num_outputs: int = 1, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> Likelihood:
    """SingleTaskGP's default noise model for FalkonModel: a ``LogNormal(-4, 1)`` prior on
    ``sigma^2``, the bound ``sigma^2 >= 1e-4`` (BoTorch's ``MIN_INFERRED_NOISE_LEVEL``) and the
    prior's mode as initial value; one shared noise for ``num_outputs > 1`` (FALKON's single
    penalty ``lambda = sigma^2 / n``). Without the bound, learning the noise on noiseless data
    drives it towards 0 and the objective's conditioning with it."""
    if num_outputs == 1:
        lik: Likelihood = get_gaussian_likelihood_with_lognormal_prior()
    else:
        prior = LogNormalPrior(loc=-4.0, scale=1.0)
        lik = MultitaskGaussianLikelihood(
            num_tasks=num_outputs, rank=0, has_task_noise=False,
            noise_constraint=GreaterThan(MIN_INFERRED_NOISE_LEVEL, transform=None, initial_value=prior.mode),
        )
        # the prior registered here with module-level closures: GPyTorch's noise_prior= registers a lambda, which
        # makes the likelihood (and the model) impossible to pickle or torch.save
        lik.register_prior("raw_noise_prior", prior, _likelihood_noise, _set_likelihood_noise)
    return lik.to(dtype=dtype, device=device)


def _likelihood_noise(likelihood: Any) -> Tensor:
    """The prior's closure: the likelihood's noise ``sigma^2``."""
    return likelihood.noise


def _set_likelihood_noise(likelihood: Any, value: Tensor) -> None:
    """The prior's setting closure (prior sampling): ``sigma^2 = value``."""
    likelihood._set_noise(value)


#: buffers of BoTorch input transforms that cache what the last transformed points needed
#: (``InputPerturbation._perturbations``: the perturbations expanded to the last ``X``'s batch shape)
TRANSFORM_CACHES = frozenset({"_perturbations"})


class FalkonModel(FalkonGP, GPyTorchModel, FantasizeMixin):
    r"""A BoTorch model whose posterior is the FALKON / SGPR-DTC posterior of :class:`FalkonGP`.

    For surrogates with 10^4 - 10^6 observations, where ``SingleTaskGP``'s ``n x n``
    solve is out of reach:

    .. code-block:: python

        model = FalkonModel(train_X, train_Y, num_centers=1000)   # fits with FALKON
        acqf = qLogNoisyExpectedImprovement(model, X_baseline=train_X)
        candidates, _ = optimize_acqf(acqf, bounds=bounds, q=4, num_restarts=10, raw_samples=256)

    ``train_X`` is ``n x d``, ``train_Y`` is ``n x m`` (``m`` outputs share the kernel,
    centers and noise, and are solved jointly). ``posterior(X)`` returns the joint
    posterior over the ``q`` points of every batch of ``X`` (``batch x q x d``),
    differentiable w.r.t. ``X``; after the fit it costs ``O(q M (M + d))`` per batch
    (``benchmarks/``). Input transforms (e.g. ``Normalize``) are applied to the
    training inputs once and to ``X`` in ``posterior``; outcome transforms (e.g.
    ``Standardize``, the default as in ``SingleTaskGP``) to ``train_Y`` once and
    undone on the posterior. ``observation_noise=True`` adds ``sigma^2 = n lambda``.
    Without ``kernel=``, the kernel is SingleTaskGP's (BoTorch's
    ``get_covar_module_with_dim_scaled_prior``: ARD RBF, ``LogNormal(sqrt 2 + log(d)/2, sqrt 3)``
    lengthscale prior, lengthscales ``>= 0.025``, no outputscale on standardised ``Y``).
    Without ``penalty=`` or ``likelihood=``, the noise model is SingleTaskGP's
    (:func:`default_botorch_likelihood`: ``LogNormal(-4, 1)`` prior, ``sigma^2 >= 1e-4``,
    starting at the prior's mode ``e^{-5}``); with ``penalty=`` alone, ``sigma^2 = n lambda``
    with FalkonGP's unbounded log-scale noise. Learn the hyperparameters with
    ``fit_gpytorch_mll(NystromMarginalLogLikelihood(model.likelihood, model))``.

    ``condition_on_observations`` with non-batched ``X``, ``Y`` appends the new rows and
    refits by FALKON warm-started from the current solution, keeping the noise
    ``sigma^2`` (so ``lambda = sigma^2 / n`` follows ``n``), the kernel and the centers.
    ``fantasize`` (BoTorch's, e.g. for ``qKnowledgeGradient``) and batched conditioning give a
    :class:`~gpfalkon.integrations.fantasy.FalkonFantasyModel`: the same posterior conditioned
    on every fantasy set exactly, in closed form (``O(q M^2)`` per set, no refit).
    ``train_Yvar`` raises ``NotImplementedError``; ``subset_output`` gives the model of some outputs; BoTorch's
    ``load_state_dict`` (with or without transforms) and input-scaling warnings work as for
    ``SingleTaskGP``.

    ``num_centers`` is at most ``M``: with fewer observations (a BO loop's first iterations) every training point is
    a center (:class:`FalkonGP` itself refuses ``num_centers > n``).

    Other keyword arguments go to :class:`FalkonGP` (``kernel``, ``penalty``,
    ``centers``, ``max_iter``, ``tol``, ...).
    """

    _original_train_X: Tensor | None

    def __init__(
        self,
        train_X: Tensor,
        train_Y: Tensor,
        kernel: Kernel | None = None,
        *,
        num_centers: int | None = None,
        input_transform: InputTransform | None = None,
        outcome_transform: OutcomeTransform | None | str = "standardize",
        fit: bool = True,
        train_Yvar: Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        if train_Yvar is not None:
            raise NotImplementedError(
                "FalkonModel: train_Yvar (a fixed noise per observation) is not supported: FALKON's penalty is one "
                "homoskedastic noise sigma^2 = n lambda, learned or given as penalty="
            )
        if is_row_source(train_X):  # BoTorch's transforms and acquisition functions take tensors in memory
            raise TypeError(f"train_X must be an (n, d) tensor in memory, got a row source ({type(train_X).__name__}): "
                            "FalkonModel holds BoTorch's data in memory (its transforms and acquisition functions "
                            "read every row); fit a FalkonGP on the source, or pass train_X.materialize()")
        if not isinstance(train_X, Tensor) or train_X.dim() != 2:
            raise ValueError(f"train_X must be an (n, d) tensor, got {getattr(train_X, 'shape', type(train_X))}")
        if not isinstance(train_Y, Tensor) or train_Y.dim() != 2 or train_Y.shape[0] != train_X.shape[0]:
            raise ValueError(
                f"train_Y must be an (n, m) tensor with n = {train_X.shape[0]}, got {getattr(train_Y, 'shape', None)}"
            )
        for name, t in (("train_X", train_X), ("train_Y", train_Y)):
            if t.dtype not in (torch.float32, torch.float64):  # before the transforms, which fail on integers
                raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
        allowed = "outcome_transform must be 'standardize', an OutcomeTransform or None"
        if isinstance(outcome_transform, str) and outcome_transform != "standardize":
            raise ValueError(f"{allowed}, got {outcome_transform!r}")
        if outcome_transform is not None and not isinstance(outcome_transform, (str, OutcomeTransform)):
            raise TypeError(f"{allowed}, got {type(outcome_transform).__name__}")
        if outcome_transform == "standardize":
            from botorch.models.transforms.outcome import Standardize

            outcome_transform = Standardize(m=train_Y.shape[-1])
        # the string default is resolved above
        out_tf = cast("OutcomeTransform | None", outcome_transform)
        if input_transform is not None:
            learnable = [name for name, p in input_transform.named_parameters() if p.requires_grad]
            if learnable:
                raise NotImplementedError(
                    f"FalkonModel: input_transform has learnable parameters {learnable}: the model transforms the "
                    "training inputs once and its objectives do not differentiate through the transform (an MLL "
                    "would move them by their priors alone); fix them (input_transform.requires_grad_(False)) or "
                    "learn them with another model")
        with torch.no_grad():
            x = train_X
            if input_transform is not None:
                input_transform.train()
                x = input_transform(train_X)
            y = train_Y
            if out_tf is not None:
                out_tf.train()
                y, _ = out_tf(train_Y, X=x)
        # BoTorch's input checks, as SingleTaskGP makes them: NaNs raise; X outside the unit cube or
        # Y not standardised (after the transforms) give an InputDataWarning
        validate_input_scaling(train_X=x, train_Y=y)
        y_model = y.squeeze(-1) if y.shape[-1] == 1 else y
        if kernel is None:  # SingleTaskGP's: RBF with the dimension-scaled LogNormal lengthscale prior
            kernel = get_covar_module_with_dim_scaled_prior(ard_num_dims=x.shape[-1]).to(dtype=x.dtype, device=x.device)
        if kwargs.get("likelihood") is None and kwargs.get("penalty") is None:
            kwargs["likelihood"] = default_botorch_likelihood(train_Y.shape[-1], dtype=x.dtype, device=x.device)
        if (isinstance(num_centers, int) and not isinstance(num_centers, bool) and kwargs.get("centers") is None
                and num_centers > x.shape[0] > 0):
            num_centers = int(x.shape[0])  # at most M: a BO loop's first iterations have fewer observations
        super().__init__(x, y_model, kernel, num_centers=num_centers, **kwargs)
        # the untransformed training inputs and targets, to re-apply a loaded input or outcome transform exactly as
        # at construction (load_state_dict); not saved
        self.register_buffer("_original_train_X", train_X.detach() if input_transform is not None else None,
                             persistent=False)
        self.register_buffer("_original_train_Y", train_Y.detach() if out_tf is not None else None, persistent=False)
        self._load_deferred = False
        if input_transform is not None:
            self.input_transform = input_transform
        self._mark_inputs_transformed()
        if out_tf is not None:
            self.outcome_transform = out_tf
            out_tf.eval()
        if fit:
            self.fit()

    # FALKON fits on the transformed inputs once; BoTorch's train/eval swapping of
    # original and transformed training inputs (for models refitted by an MLL) does
    # not apply: the stored inputs are always the transformed ones.
    def _set_transformed_inputs(self) -> None:
        return None

    def _revert_to_original_inputs(self) -> None:
        return None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pickled before the untransformed inputs were kept: they are not known (load_state_dict then warns)
        buffers = state.get("_buffers")
        for key in ("_original_train_X", "_original_train_Y"):
            if isinstance(buffers, dict) and key not in buffers:
                buffers[key] = None
                state.setdefault("_non_persistent_buffers_set", set()).add(key)
        state.setdefault("_load_deferred", False)
        super().__setstate__(state)

    def _output_indices(self, idcs: Sequence[int], name: str) -> list[int]:
        """``idcs`` as a list of Python ints in ``[0, num_outputs)`` (negative ones counted from the end; numpy
        integers accepted, as BoTorch's ``ModelListGP`` passes them); ``ValueError`` naming ``name`` otherwise."""
        t = self.num_outputs
        if not isinstance(idcs, (list, tuple)) or not idcs or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) or not -t <= int(i) < t for i in idcs
        ):
            raise ValueError(f"{name} must be a non-empty list of output indices in [0, {t}), got {idcs!r}")
        return [int(i) % t for i in idcs]

    def posterior(  # type: ignore[override]
        self,
        X: Tensor,
        output_indices: list[int] | None = None,
        observation_noise: bool | Tensor = False,
        posterior_transform: Any | None = None,
        **kwargs: Any,
    ) -> Any:
        """BoTorch's posterior at ``X`` (``(batch..., q, d)``), of the outputs ``output_indices`` (default all), with
        ``observation_noise``: ``True`` adds ``sigma^2``, a tensor (``(batch..., q, m)`` or ``(batch..., q)``, in the
        outcome-transformed space, BoTorch's convention) adds those variances, output by output. Every output shares
        one ``q x q`` covariance (one kernel, centers and noise), so selecting outputs costs nothing beyond the
        all-output posterior; per-output observation noise gives each output its own covariance."""
        t = self.num_outputs
        idcs = list(range(t)) if output_indices is None else self._output_indices(output_indices, "output_indices")
        noise_tensor = isinstance(observation_noise, Tensor)
        if idcs == list(range(t)) and (t == 1 or not noise_tensor):  # GPyTorchModel's posterior is right there
            return GPyTorchModel.posterior(self, X, observation_noise=observation_noise,
                                           posterior_transform=posterior_transform, **kwargs)
        self.eval()
        Xt = self.transform_inputs(X)
        with gpt_posterior_settings():
            mvn = self(Xt)
        covar = mvn.lazy_covariance_matrix
        if not isinstance(covar, KroneckerProductLinearOperator):  # FalkonGP's multi-output posterior is covar (x) I_t
            raise RuntimeError(f"FalkonModel.posterior: expected a shared covariance, got {type(covar).__name__}")
        covar = covar.linear_ops[0]  # (..., q, q)
        mean = mvn.mean[..., idcs]  # (..., q, k)
        q = mean.shape[-2]
        if noise_tensor:
            noise = cast(Tensor, observation_noise).to(mean)
            if not (noise.dim() >= 2 and noise.shape[-2] == q and noise.shape[-1] in (1, t)) and noise.shape[-1] == q:
                noise = noise.unsqueeze(-1)  # (..., q): the same noise for every output
            if noise.dim() < 2 or noise.shape[-2] != q or noise.shape[-1] not in (1, t):
                raise ValueError(f"observation_noise must have shape (..., {q}, {t}) or (..., {q}), got "
                                 f"{tuple(noise.shape)}")
            noise = noise.expand(*noise.shape[:-1], t)[..., idcs]
            mvns = [NystromMultivariateNormal(mean[..., j], covar + DiagLinearOperator(noise[..., j]))
                    for j in range(len(idcs))]
            dist: MultivariateNormal = (mvns[0] if len(mvns) == 1
                                        else NystromMultitaskMultivariateNormal.from_independent_mvns(mvns))
        else:
            if observation_noise is True:
                sigma2 = self.noise.detach().to(mean).reshape(())
                covar = covar + DiagLinearOperator(sigma2.expand(*covar.shape[:-1]))
            dist = shared_covariance_distribution(mean, covar)
        posterior: Any = GPyTorchPosterior(distribution=dist)
        if hasattr(self, "outcome_transform"):
            tf = self.outcome_transform if idcs == list(range(t)) else self.outcome_transform.subset_output(idcs)
            posterior = tf.untransform_posterior(posterior, X=Xt)
        if posterior_transform is not None:
            return posterior_transform(posterior=posterior, X=Xt)
        return posterior

    @property
    def _supports_cache_root(self) -> bool:
        """Whether BoTorch's ``cache_root`` (the cached baseline Cholesky of qLogNEI, qLogNEHVI) may be used: it
        reads a several-output posterior's covariance as a ``BlockDiagLinearOperator``, the layout of
        ``BatchedMultiOutputGPyTorchModel``; this model's is ``covar (x) I_t`` (:func:`shared_covariance_distribution`),
        so only with one output (with several the acquisition functions warn and use ``cache_root=False``)."""
        return self.num_outputs == 1

    def _extract_targets_and_noise(self) -> tuple[Tensor, Tensor | None]:
        """The targets as ``n x m`` for BoTorch's ``load_state_dict`` (no per-row noise): this model holds several
        outputs as ``(n, m)``, not BoTorch's batched ``(m, n)``."""
        if self.num_outputs > 1:
            return self.train_targets, None
        return super()._extract_targets_and_noise()

    def _restore_targets_and_noise(self, Y: Tensor, Yvar: Tensor | None, strict: bool) -> None:
        """The inverse of :meth:`_extract_targets_and_noise`."""
        if self.num_outputs > 1:
            self.set_train_data(targets=Y, strict=strict)
            return
        super()._restore_targets_and_noise(Y, Yvar, strict)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, keep_transforms: bool = True, assign: bool = False
    ) -> None:
        """BoTorch's ``load_state_dict`` (the outcome transform re-applied to the targets with ``keep_transforms``),
        and, with an input transform, the training inputs rebuilt from the untransformed ones by the loaded
        transform, as ``SingleTaskGP``'s are (its bounds, e.g. ``Normalize``'s, come from the model that was saved).
        The targets are the loaded outcome transform applied to the untransformed ones the model keeps, as at
        construction (BoTorch's untransform-then-transform of the current targets leaves them a few ulps off those
        of the saved fit); the saved fit is checked against the data once both are in place (``FalkonGP``'s load
        check: by value, what differs named).
        Where they change, the model must be re-fitted (``fit()``), as ``FalkonGP.set_train_data`` decides."""
        y_before = self.train_targets
        self._load_deferred = True  # FalkonGP's load check and set_train_data's refit logic wait for the final data
        try:
            GPyTorchModel.load_state_dict(self, state_dict, strict=strict, keep_transforms=keep_transforms,
                                          assign=assign)
            if keep_transforms:
                self._retransform_after_load()
                if self._original_train_Y is None and _same_to_rounding(self.train_targets, y_before):
                    # untransformed targets unknown: BoTorch's untransform-then-transform by an equal transform
                    # left the same targets to a few ulps; they are kept exactly (as set_train_data would judge)
                    self.set_train_data(targets=y_before)
        except BaseException:
            self._load_deferred = False
            self._set_fitted(False)  # a load that failed midway (strict keys...): some tensors are copied already
            self._fit_tracker.forget()
            self._forget_factors()
            raise
        self._load_deferred = False
        FalkonGP._after_load(self, None)

    def _retransform_after_load(self) -> None:
        """The training targets and inputs from the untransformed ones by the loaded transforms (in their eval
        semantics for the targets, the training semantics with kept bounds for the inputs, as at construction)."""
        out_tf = getattr(self, "outcome_transform", None)
        raw_y = self._original_train_Y
        if out_tf is not None and raw_y is not None and raw_y.shape[0] == self.train_inputs[0].shape[0]:
            with torch.no_grad():
                y, _ = out_tf(raw_y.to(self.train_targets), X=self.train_inputs[0])
            self.set_train_data(targets=y.squeeze(-1) if self.num_outputs == 1 else y)
        tf = getattr(self, "input_transform", None)
        if tf is None:
            return
        raw = self._original_train_X
        if raw is None or raw.shape[0] != self.train_inputs[0].shape[0]:
            warn_caller("FalkonModel.load_state_dict: the untransformed training inputs are not known (the "
                          "training data were replaced by set_train_data), so the loaded input transform is not "
                          "re-applied to them", RuntimeWarning)
            return
        with torch.no_grad():  # the training inputs' transform, as at construction (train semantics, bounds kept)
            x = tf.preprocess_transform(raw.to(self.train_inputs[0]))
        tf.eval()
        self.set_train_data(inputs=x)
        self._original_train_X = raw
        self._mark_inputs_transformed()

    # ------------------------------------------------- the input transform the training inputs went through
    def _transform_tensors(self) -> list[Tensor]:
        """The input transform's parameters and buffers, but for the caches it fills from the points it transforms
        (:data:`TRANSFORM_CACHES`: they change with every ``X`` a posterior is asked at, not with the transform)."""
        tf = getattr(self, "input_transform", None)
        if tf is None:
            return []
        buffers = [b for name, b in tf.named_buffers() if name.rsplit(".", 1)[-1] not in TRANSFORM_CACHES]
        return [*tf.parameters(), *buffers]

    def _mark_inputs_transformed(self) -> None:
        """Record the input transform's parameters and buffers as those the training inputs went through."""
        self._transform_state = [t.detach().clone() for t in self._transform_tensors()]

    def _transform_changed(self) -> bool:
        """Whether the input transform's parameters or buffers differ from those the training inputs went through
        (``False`` for a model pickled before they were recorded)."""
        old = getattr(self, "_transform_state", None)
        if old is None:
            return False
        now = self._transform_tensors()
        return len(now) != len(old) or any(
            a.shape != b.shape or not torch.equal(a.detach(), b.to(device=a.device, dtype=a.dtype))
            for a, b in zip(now, old, strict=False))

    def _fit_dependencies(self) -> list[Tensor]:
        """FalkonGP's, and the input transform's parameters and buffers: the training inputs and every test point
        go through it, so a change of it (e.g. ``Normalize``'s bounds edited) makes the fit stale."""
        return [*super()._fit_dependencies(), *self._transform_tensors()]

    def fit(self, **kwargs: Any) -> FalkonModel:
        """:meth:`FalkonGP.fit`, after re-applying the input transform to the untransformed training inputs where
        its parameters or buffers changed since the training inputs went through it (test points see the transform
        as it is now; a fit on inputs transformed by an older one would silently disagree with them)."""
        if getattr(self, "input_transform", None) is not None and self._transform_changed():
            raw = self._original_train_X
            if raw is None or raw.shape[0] != self.train_inputs[0].shape[0]:
                raise ValueError("FalkonModel.fit: the input transform changed since the training inputs went "
                                 "through it, and the untransformed inputs are not known (set_train_data replaced "
                                 "them): build the model again, or restore the transform")
            with torch.no_grad():
                x = self.input_transform.preprocess_transform(raw.to(self.train_inputs[0]))
            self.set_train_data(inputs=x)
            self._original_train_X = raw
            self._mark_inputs_transformed()
        return cast("FalkonModel", super().fit(**kwargs))

    def set_train_data(self, inputs: Tensor | None = None, targets: Tensor | None = None,
                       strict: bool = False) -> None:
        """``FalkonGP.set_train_data`` (``inputs`` and ``targets`` in the transformed spaces, as the model holds
        them); new inputs or targets from a caller make the untransformed ones unknown (see :meth:`load_state_dict`;
        while it loads, the targets it re-transforms keep them)."""
        old, old_y = self.train_inputs[0], self.train_targets
        super().set_train_data(inputs=inputs, targets=targets, strict=strict)
        if not _same(self.train_inputs[0], old):
            self._original_train_X = None
        if not self._load_deferred and not _same(self.train_targets, old_y):
            self._original_train_Y = None

    def get_fantasy_model(self, inputs: Tensor, targets: Tensor, noise: Tensor | None = None,
                          **kwargs: Any) -> FalkonModel | FalkonFantasyModel:
        """GPyTorch's ``get_fantasy_model`` contract (BoTorch's ``ModelListGP.condition_on_observations`` calls it):
        ``inputs`` (``(..., n', d)``) and ``targets`` (``(..., n')`` for one output, else ``(..., n', m)``) in the
        model's transformed spaces. Batched observations, a per-observation ``noise`` or BoTorch's fantasize
        context give the closed-form :class:`FalkonFantasyModel`; plain ``(n', d)`` rows a refitted FalkonModel
        (as :meth:`condition_on_observations`)."""
        if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor) or inputs.dim() < 2:
            raise ValueError(f"inputs and targets must be tensors of shapes (..., n', d) and (..., n'[, m]), got "
                             f"{getattr(inputs, 'shape', type(inputs))} and {getattr(targets, 'shape', type(targets))}")
        n_new = inputs.shape[-2]
        one = self.num_outputs == 1
        # one output: (..., n') as GPyTorch passes targets (BoTorch's ModelListGP: (1, n'), a batch of one set)
        y = targets.unsqueeze(-1) if one and not (targets.dim() >= 2 and targets.shape[-2:] == (n_new, 1)) else targets
        if y.dim() < 2 or y.shape[-2] != n_new:
            raise ValueError(f"targets must have shape (..., {n_new}) or (..., {n_new}, {self.num_outputs}) for "
                             f"inputs of shape {tuple(inputs.shape)}, got {tuple(targets.shape)}")
        if noise is not None and self.num_outputs == 1 and noise.dim() == y.dim() - 1:
            noise = noise.unsqueeze(-1)
        self.eval()
        if inputs.dim() > 2 or y.dim() > 2 or fantasize_flag.on() or noise is not None:
            self._check_fitted()
            return FalkonFantasyModel(self, inputs, y, noise)
        with torch.no_grad():
            return self._refit_with(inputs, y, raw_inputs=None)

    def subset_output(self, idcs: list[int]) -> FalkonModel:
        """The model of the outputs ``idcs`` only: the same kernel, centers and noise, the columns
        ``idcs`` of the targets, of ``alpha`` and of the outcome transform. No refit: every output's
        ``alpha`` solves its own right-hand side of the same system."""
        idcs = self._output_indices(idcs, "idcs")
        if idcs == list(range(self.num_outputs)):
            return copy.deepcopy(self)
        was_fitted = bool(self.fitted) and not self._hyper_changed()
        new = copy.deepcopy(self)
        y2 = new.train_targets.unsqueeze(-1) if new.train_targets.dim() == 1 else new.train_targets
        a2 = new.alpha.unsqueeze(-1) if new.alpha.dim() == 1 else new.alpha
        mc = new.mean_constant.reshape(-1).expand(self.num_outputs)
        k = len(idcs)
        noise = new.noise.detach().clone()
        new._num_outputs = k
        new.train_targets = y2[:, idcs].squeeze(-1) if k == 1 else y2[:, idcs]
        new.alpha = a2[:, idcs].squeeze(-1) if k == 1 else a2[:, idcs].clone()
        if new._original_train_Y is not None:
            new._original_train_Y = new._original_train_Y[:, idcs].clone()
        new.mean_constant = mc[idcs].reshape(()) if k == 1 else mc[idcs].clone()
        dev, dt = new.train_inputs[0].device, new.train_inputs[0].dtype
        had_priors = any(True for _ in self.likelihood.named_priors())  # SingleTaskGP's noise model
        build = default_botorch_likelihood if had_priors else default_likelihood
        new.likelihood = build(k, dtype=dt, device=dev)
        new.likelihood.noise = noise.to(new.likelihood.raw_noise.dtype)
        if hasattr(new, "outcome_transform"):
            new.outcome_transform = new.outcome_transform.subset_output(idcs)
        new._forget_factors()
        new._set_fitted(False)
        new._fit_tracker.forget()
        if was_fitted:
            new._mark_fitted()
        return new

    def condition_on_observations(
        self, X: Tensor, Y: Tensor, noise: Tensor | None = None, **kwargs: Any
    ) -> FalkonModel | FalkonFantasyModel:
        """The model conditioned on ``(X, Y)`` (raw inputs and outcomes, as BoTorch passes them).

        Batched ``X`` (``batch x q x d``) or ``Y`` (``batch' x q x m``, e.g. from :meth:`fantasize`),
        or any call inside BoTorch's fantasize context, give a :class:`FalkonFantasyModel`: the exact
        closed-form conditioning of the fitted posterior on every batch of observations at once
        (noise ``sigma^2``, or ``noise`` per observation, in the outcome-transformed space as BoTorch
        passes it). Non-batched ``(n', d)`` / ``(n', m)``
        observations give a new FalkonModel with the rows appended and refitted by FALKON (warm
        start; the same posterior as the closed form, and a full model to keep using)."""
        if not isinstance(X, Tensor) or not isinstance(Y, Tensor) or X.dim() < 2 or Y.dim() < 2:
            raise ValueError(f"X and Y must be tensors of shapes (..., q, d) and (..., q, m), got "
                             f"{getattr(X, 'shape', type(X))} and {getattr(Y, 'shape', type(Y))}")
        # eval mode first: in train mode an input transform such as Normalize would re-learn its
        # bounds from X (BoTorch reaches conditioning through posterior(), which sets eval mode)
        self.eval()
        if X.dim() > 2 or Y.dim() > 2 or fantasize_flag.on():
            self._check_fitted()
            Xt = self.transform_inputs(X)  # differentiable: one-shot knowledge gradient needs d/dX
            Yt = Y
            if hasattr(self, "outcome_transform"):  # noise is in the transformed space already (BoTorch's convention)
                Yt, _ = self.outcome_transform(Y, X=Xt)  # eval mode: the fitted statistics
            return FalkonFantasyModel(self, Xt, Yt, noise)
        if noise is not None:
            raise NotImplementedError(
                "FalkonModel refits with one homoskedastic noise sigma^2: per-observation noise is supported for "
                "batched (fantasy) conditioning only; pass a batched X / Y or drop noise="
            )
        # the raw inputs' width: the training inputs' (no input transform) or the untransformed ones' where known
        raw = self._original_train_X
        d = self.train_inputs[0].shape[-1] if getattr(self, "input_transform", None) is None else (
            None if raw is None else raw.shape[-1])
        if (d is not None and X.shape[-1] != d) or Y.shape[-1] != self.num_outputs or X.shape[0] != Y.shape[0]:
            raise ValueError(f"X and Y must have shapes (q, {'d' if d is None else d}) and (q, {self.num_outputs}) "
                             f"with the same q, got {tuple(X.shape)} and {tuple(Y.shape)}")
        with torch.no_grad():
            Xt = self.transform_inputs(X)
            Yt = Y
            if hasattr(self, "outcome_transform"):
                Yt, _ = self.outcome_transform(Y, X=Xt)  # eval mode: uses the fitted statistics
            return self._refit_with(Xt, Yt, raw_inputs=X, raw_targets=Y)

    def _refit_with(self, Xt: Tensor, Yt: Tensor, raw_inputs: Tensor | None,
                    raw_targets: Tensor | None = None) -> FalkonModel:
        """A copy with the rows ``(Xt, Yt)`` (transformed spaces, ``Yt`` of shape ``(n', m)``) appended, refitted by
        FALKON warm-started from this model's solution, keeping ``sigma^2``; ``raw_inputs`` / ``raw_targets``: the
        untransformed ``Xt`` / ``Yt``, appended to the untransformed training inputs / targets where those are
        known."""
        new = copy.deepcopy(self)
        Yt = Yt.squeeze(-1) if Yt.shape[-1] == 1 else Yt
        noise_now = new.noise.detach().clone()
        x_all = torch.cat([new.train_inputs[0], Xt.to(new.train_inputs[0])])
        y_all = torch.cat([new.train_targets, Yt.to(new.train_targets)])
        new.set_train_data(x_all, y_all)
        raw = self._original_train_X
        if raw is not None and raw_inputs is not None:
            new._original_train_X = torch.cat([raw, raw_inputs.detach().to(raw)])
        raw_y = self._original_train_Y
        if raw_y is not None and raw_targets is not None:
            new._original_train_Y = torch.cat([raw_y, raw_targets.detach().to(raw_y)])
        new.likelihood.noise = noise_now  # the GP view: sigma^2 stays, lambda = sigma^2 / n
        new.fit(warm_start=True)  # from this model's alpha where it has one (CG from zero where not)
        return new
