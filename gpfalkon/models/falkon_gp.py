"""FalkonGP: a GPyTorch model whose posterior is Nyström KRR solved by FALKON."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.kernels import GridInterpolationKernel, Kernel, ScaleKernel
from gpytorch.likelihoods import Likelihood
from gpytorch.utils.warnings import GPInputWarning
from linear_operator.operators import (
    DenseLinearOperator,
    DiagLinearOperator,
    KroneckerProductLinearOperator,
    ZeroLinearOperator,
)
from torch import Tensor

from .. import settings
from .._validation import (
    all_finite,
    check_center_weights,
    check_dtype,
    check_inputs,
    check_num_centers,
    check_penalty,
    check_seed,
    check_targets,
    is_row_source,
)
from .._warn import warn_caller
from ..backend.blocks import AUTO_BUDGET_FLOOR, given_memory_budget, memory_budget_for
from ..backend.engine import KernelEngine, kernel_block_in
from ..backend.passes import is_sharded, reduce_rows, total_rows
from ..backend.precision import matmul_precision
from ..centers import (
    CenterSelection,
    CenterSelector,
    FixedCenters,
    LeverageCenters,
    UniformCenters,
    default_num_centers,
)
from ..errors import FalkonConvergenceError, NotFittedError
from ..operators import NystromKRROperator
from ..options import FalkonOptions, option_property
from ..solvers import CGInfo
from .calibration import variance_scale
from .defaults import check_likelihood, default_kernel, default_likelihood
from .fit_state import (
    FIT_GROUPS,
    FitTracker,
    _identity,
    dtype_code,
    hyper_digest,
    kernel_identity,
    module_structure,
)
from .penalty_path import PenaltyPath
from .posterior import (
    NystromPosteriorCovariance,
    NystromPosteriorFactors,
    nystrom_posterior_mean,
    shared_covariance_distribution,
)

__all__ = ["FalkonGP", "NystromPosteriorFactors"]

#: float64 ``chunk x M`` blocks a prediction chunk holds at once (the kernel block, the roots ``a`` and ``c``, and
#: temporaries): the chunk is capped so that they fit the memory budget
PREDICT_LIVE_BLOCKS = 6

# keyword options FalkonGP(center_selection="leverage") passes to leverage_centers
_LEVERAGE_OPTIONS = frozenset(
    {"weighting", "distinct", "oversampling", "lambda_step", "max_dictionary_size", "min_dictionary_size",
     "block_rows"}
)


def _same_to_rounding(new: Tensor, old: Tensor) -> bool:
    """Same shape and dtype, values within 8 ulps of the dtype (relative to the largest magnitude)."""
    if is_row_source(new) or is_row_source(old) or new.shape != old.shape or new.dtype != old.dtype:
        return False
    if new is old or new.numel() == 0:
        return True
    eps = 8 * float(torch.finfo(new.dtype).eps)
    scale = float(old.detach().abs().max())
    return bool(torch.allclose(new.detach(), old.detach(), rtol=eps, atol=eps * scale))


def _center_selector(
    train_x: Tensor,
    num_centers: int | None,
    centers: Tensor | None,
    center_selection: str | CenterSelector,
    center_weights: Tensor | None,
    leverage_options: dict[str, Any] | None,
    generator: torch.Generator | None,
    seed: int,
    backend: Any | None = None,
    n_total: int | None = None,
) -> tuple[CenterSelector, int | None]:
    """FalkonGP's center arguments as one :class:`~gpfalkon.centers.CenterSelector` and ``M``."""
    is_selector = not isinstance(center_selection, str)
    if is_selector and not callable(center_selection):
        raise ValueError(
            "center_selection must be 'uniform', 'leverage' or a CenterSelector (callable "
            f"(x, num_centers, kernel=, penalty=) -> CenterSelection), got {center_selection!r}"
        )
    if not is_selector and center_selection not in ("uniform", "leverage"):
        raise ValueError(
            f"center_selection must be 'uniform', 'leverage' or a CenterSelector, got {center_selection!r}"
        )
    if leverage_options is not None:
        if not isinstance(leverage_options, dict):
            raise TypeError(f"leverage_options must be a dict, got {type(leverage_options).__name__}")
        if center_selection != "leverage":
            raise ValueError("leverage_options only applies with center_selection='leverage'")
        unknown = set(leverage_options) - _LEVERAGE_OPTIONS
        if unknown:
            raise ValueError(
                f"leverage_options: unknown option(s) {sorted(unknown)}; allowed: {sorted(_LEVERAGE_OPTIONS)}"
            )
    if centers is not None and num_centers is not None:
        raise ValueError("give either centers or num_centers, not both")
    if centers is not None and center_selection != "uniform":
        raise ValueError(
            f"center_selection={center_selection!r} chooses the centers: do not also pass centers= "
            "(pass center_weights= with your own centers instead)"
        )
    if center_weights is not None and centers is None:
        raise ValueError("center_weights= needs centers= (the weights belong to given centers)")
    if centers is not None:
        check_dtype("centers", centers)
        if centers.dtype != train_x.dtype:
            raise TypeError(f"centers has dtype {centers.dtype} but train_x has {train_x.dtype}")
        if centers.device != train_x.device:
            raise ValueError(f"centers is on {centers.device} but train_x is on {train_x.device}")
        check_inputs("centers", centers, d=train_x.shape[1])
        if center_weights is not None:
            check_center_weights("center_weights", center_weights, centers.shape[0], train_x.device)
        return FixedCenters(centers, center_weights), None
    if is_selector:
        return center_selection, num_centers  # type: ignore[return-value]  # None: the selector's default
    n = total_rows(backend, train_x) if n_total is None else int(n_total)  # the model passes its global n
    m = check_num_centers(default_num_centers(train_x, n=n) if num_centers is None else num_centers, n)
    if generator is None:  # on the data's device: the draws happen there
        check_seed(seed)
        generator = torch.Generator(device=train_x.device)
        generator.manual_seed(int(seed))
    if center_selection == "leverage":
        lev = dict(leverage_options or {})
        if backend is not None:
            lev.setdefault("backend", backend)
        return LeverageCenters(generator=generator, **lev), m
    return UniformCenters(generator=generator, backend=backend), m


_EXACT_MLL_MESSAGE = (
    "FalkonGP's train-mode output is the GP prior over the n training points: its exact log-likelihood "
    "(what gpytorch.mlls.ExactMarginalLogLikelihood evaluates) costs O(n^3) and would train an exact GP, not "
    "the Nystrom model. Use gpfalkon.NystromMarginalLogLikelihood(model.likelihood, model, objective='sgpr') "
    "(or another objective name) with fit_gpytorch_mll or a GPyTorch loop; for a ModelListGP of FalkonModels, "
    "SumMarginalLogLikelihood(model.likelihood, model, mll_cls=gpfalkon.NystromMarginalLogLikelihood)"
)


class _PriorMixin:
    """A train-mode prior that refuses the exact ``log_prob`` (see ``_EXACT_MLL_MESSAGE``)."""

    def log_prob(self, value: Tensor) -> Tensor:
        raise RuntimeError(_EXACT_MLL_MESSAGE)


class FalkonPrior(_PriorMixin, MultivariateNormal):
    """FalkonGP's train-mode output ``N(c, K(x, x))`` (lazy): everything of a
    ``MultivariateNormal`` except the exact ``log_prob``."""


class FalkonMultitaskPrior(_PriorMixin, MultitaskMultivariateNormal):
    """The multi-output train-mode prior (see :class:`FalkonPrior`)."""


def _moved_source(source: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``source`` whose blocks are read as ``fn`` (``.to(...)``, ``.double()``...) would move a tensor of its dtype on
    its device: a shallow copy with the new dtype and device (the files are shared), or ``source`` itself."""
    probe = fn(torch.empty(0, dtype=source.dtype, device=source.device))
    if probe.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"a row source of train_x reads float32 or float64 rows, not {probe.dtype}")
    return source.to(dtype=probe.dtype, device=probe.device)


class FalkonSourcePrior:
    """The train-mode output at the model's own training row source: the prior ``N(c, K(X, X))`` over rows read
    block by block, which no ``n x n`` operator stands for. Only the mean ``c`` is formed (a view, ``O(1)``);
    :class:`~gpfalkon.objectives.NystromMarginalLogLikelihood` takes it (its objective is computed from the
    model), which is how ``fit_gpytorch_mll`` and GPyTorch's training loop pass it. Anything else raises."""

    def __init__(self, mean: Tensor) -> None:
        self.mean = mean

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the train-mode prior at a row source has only its mean, not {name!r}: the n x n prior "
                             "covariance over rows on disk is never formed (pass it to "
                             "NystromMarginalLogLikelihood, or predict in eval mode)")


#: fit() warns where CG's relative tolerance times the targets' offset from the prior mean (in standard deviations)
#: exceeds this: the fitted variation is then resolved only to about that fraction of its standard deviation
OFFSET_RESOLUTION = 1e-2


def _warn_offset(moments: Tensor, tol: float) -> None:
    """Warn where ``y - c`` (``c = mean_constant``) sits far from zero in units of its standard deviation: CG's
    tolerance is relative to ``||K_Mn (y - c)||``, which the offset dominates, so the variation around it is resolved
    only to about ``tol * |mean| / sd`` of its standard deviation (``y = 1e6 + sin``, float64, ``mean_constant=0``:
    CG reported convergence with the mean 2.1 off on a unit signal; centred, 1e-6). ``moments``: per output column
    the sums of ``y - c`` and of its squares, then the number of rows (over all shards)."""
    t = (moments.numel() - 1) // 2
    n = float(moments[-1])
    if not tol > 0 or n < 2 or not bool(torch.isfinite(moments).all()):
        return
    mean = moments[:t] / n
    var = (moments[t:2 * t] / n - mean.square()).clamp_min(0.0)
    ratio = torch.where(var > 0, mean.abs() / var.sqrt(), torch.zeros_like(mean))
    worst = int(ratio.argmax())
    if float(ratio[worst]) * tol > OFFSET_RESOLUTION:
        warn_caller(
            f"fit(): train_y - mean_constant has mean {float(mean[worst]):.4g}, {float(ratio[worst]):.3g} times its "
            f"standard deviation: CG's tolerance ({tol:g}) is relative to K_Mn (y - c), which that offset dominates, "
            f"so the fit resolves the targets' variation only to about {float(ratio[worst]) * tol:.2g} of their "
            "standard deviation; pass mean_constant=train_y.mean(0) (or centre train_y)",
            RuntimeWarning,
        )


def _raise_on_every_rank(backend: Any, problem: BaseException | None, anchor: object) -> None:
    """With rows sharded over ranks: raise ``problem`` on its rank and a ``ValueError`` saying so on the others
    (one collective every rank reaches), instead of one rank raising while the others wait in their next collective
    until the process group times out. ``anchor``: the rank's ``train_x``, whose device the flag goes to."""
    device = getattr(anchor, "device", None)
    flag = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float64,
                        device=device if isinstance(device, torch.device) else "cpu")
    if float(backend.reduce_nograd(flag)[0]) == 0.0:
        return
    if problem is not None:
        raise problem
    raise ValueError("another rank's train_x / train_y failed the input checks (NaN or Inf, shapes or dtypes): "
                     "see that rank's error")


def _own_budget(budget: int | None) -> contextlib.AbstractContextManager[Any]:
    """A model's own ``memory_budget`` as :class:`gpfalkon.settings.memory_budget` (nothing where it has none): the
    passes that take their block heights from the setting (a row source's scans, center selection) follow it."""
    return settings.memory_budget(budget) if budget is not None else contextlib.nullcontext()


def _check_kernel(kernel: object, d: int, device: torch.device) -> None:
    """Reject a kernel FalkonGP cannot use, naming the cause: not a GPyTorch kernel, parameters on another
    device than the data, ``ard_num_dims`` other than the data's width, or a ``batch_shape`` (one set of
    hyperparameters per output or batch: the model solves all outputs with one kernel, ``K_nM`` is one
    ``n x M`` matrix; a ``ModelListGP`` of one model per output takes a kernel each), a multitask kernel (several
    outputs per input), or a ``GridInterpolationKernel`` whose grid moves as it is evaluated."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    for name, p in kernel.named_parameters():
        if p.device != device:
            raise ValueError(f"kernel parameter {name} is on {p.device} but train_x is on {device}")
    point = torch.zeros(1, d, device=device)  # what a multitask kernel is asked its outputs per input at
    for name, mod in kernel.named_modules():
        where = f"kernel{'.' + name if name else ''}"
        ard = getattr(mod, "ard_num_dims", None)
        active = getattr(mod, "active_dims", None)
        if ard is not None and ard > 1 and active is None and ard != d:
            raise ValueError(f"{where} has ard_num_dims={ard} but train_x has {d} features")
        if isinstance(active, Tensor) and active.numel() > 0 and (int(active.max()) >= d or int(active.min()) < 0):
            raise ValueError(f"{where} has active_dims={active.tolist()} but train_x has {d} features (columns "
                             f"0..{d - 1})")
        # each module's own batch shape (the ``batch_shape`` property broadcasts its sub-kernels' again)
        batch = getattr(mod, "_batch_shape", None) if isinstance(mod, Kernel) else None
        if batch is not None and len(batch) > 0:
            raise ValueError(f"{where} has batch_shape={tuple(batch)}: FalkonGP uses one kernel for every output "
                             "(one n x M kernel matrix); build it without batch_shape, or fit one model per output "
                             "(e.g. a ModelListGP of FalkonModels)")
        if isinstance(mod, Kernel):
            try:
                outputs = int(mod.num_outputs_per_input(point, point))
            except Exception:  # a kernel that cannot say: it is evaluated as it is
                outputs = 1
            if outputs != 1:
                raise ValueError(f"{where} ({type(mod).__name__}) gives {outputs} outputs per input (a multitask "
                                 "kernel: a (n t) x (M t) matrix): FalkonGP's kernel gives one value per pair of "
                                 "points and solves several outputs as right-hand sides of one n x M system; pass "
                                 "its data kernel (e.g. MultitaskKernel's data_covar_module) and (n, t) targets, or "
                                 "put the task as an input column with an IndexKernel on it")
        if isinstance(mod, GridInterpolationKernel) and mod.grid_is_dynamic:
            raise ValueError(f"{where} is a GridInterpolationKernel without grid_bounds: its grid moves whenever it "
                             "is evaluated outside it, so K_nM's row blocks (and the fit's own checks) would each "
                             "see another grid; pass grid_bounds covering train_x and the test points")


class FalkonGP(gpytorch.models.GP):
    r"""Sparse GP / Nyström kernel ridge regression fitted by FALKON.

    Posterior (docs/math.md §4), with ``sigma^2 = n lambda`` and ``H = K_Mn K_nM + n lambda K_MM``:

        mean(X*) = K_*M alpha,              H alpha = K_Mn y   (FALKON: PCG, O(n M t) per iteration)
        cov(X*)  = K_** - K_*M K_MM^{-1} K_M* + n lambda K_*M H^{-1} K_M*

    which is exactly the SGPR (Titsias/DTC) posterior with inducing points ``centers`` and Gaussian noise
    ``n lambda`` (GPyTorch's ``SGPR`` model gives this mean under ``gpytorch.settings.sgpr_diagonal_correction(False)``;
    by default it predicts with a FITC-like diagonal correction). ``likelihood(model(x))`` adds the
    noise. Multi-output targets ``(n, t)`` are solved jointly as ``t`` right-hand
    sides and predicted as a :class:`~gpytorch.distributions.MultitaskMultivariateNormal`.

    Base class: :class:`gpytorch.models.GP`, not ``ExactGP`` (whose eval path is
    hard-wired to the ``n x n`` solve) nor ``ApproximateGP`` (variational
    parameters we do not have). ``fit()`` solves for ``alpha``; calling the model
    in eval mode returns the posterior, in train mode (or under ``gpytorch.settings.prior_mode``) the prior
    ``N(c, K(x, x))`` (``c`` the constant mean, ``mean_constant``).
    With BoTorch's ``GPyTorchModel`` mix-in it gets ``posterior()``.

    Costs. ``fit()``: ``(iterations + 1)`` passes over the data (one more where a float32 solve's claimed
    convergence is checked: ``fit_info.extra["residual_checks"]``), each ``O(n M (d + t))``,
    plus ``O(M^3)`` for the preconditioner; memory ``O(n d + M^2)`` plus ``K_nM``
    when it fits :class:`gpfalkon.settings.memory_budget`. Mean at ``q`` points:
    ``O(q M d)``. Variance: exact, from :class:`NystromPosteriorFactors` formed once
    (lazily at the first variance request, or in ``fit(compute_variance=True)``)
    in ``O(n M^2)`` time and ``O(M^2)`` memory, then ``O(q M^2)`` per batch; under
    ``gpfalkon.settings.variance_factors("approximate")`` from FALKON's approximation of ``K_Mn K_nM``
    instead, in ``O(M^3)`` with no data pass (the mean and the Nyström part of the variance exact;
    docs/math.md §4.2). The float32 path computes K_nM products in float32 but CG vectors, Cholesky
    factors and predictions in float64.

    Args:
        train_x: ``(n, d)`` inputs (float32 or float64).
        train_y: ``(n,)`` or ``(n, t)`` targets (same dtype). Not centred: the
            prior mean is zero, so standardise ``y`` (or use BoTorch's ``Standardize``).
        kernel: any GPyTorch kernel (default ``ScaleKernel(MaternKernel(2.5, ARD))``).
        num_centers: number of centers (default ``min(n, 1000)``): sampled
            uniformly without replacement, rows equal to one drawn before skipped
            (:func:`~gpfalkon.centers.uniform_centers`; ``UniformCenters(distinct=False)`` keeps them),
            or — with ``center_selection="leverage"`` — the number of with-replacement draws (fewer distinct
            centers result), or
        centers: user-supplied centers ``(M, d)``.
        center_selection: ``"uniform"`` (default), ``"leverage"``, or any
            :class:`~gpfalkon.centers.CenterSelector` (called once as
            ``selector(train_x, num_centers, kernel=kernel, penalty=lambda)``, e.g.
            :class:`~gpfalkon.centers.LeverageCenters` with its own options). ``"leverage"``: centers drawn with
            probabilities proportional to approximate ridge leverage scores
            (:func:`~gpfalkon.centers.leverage_centers`, BLESS scores, ``O(n M_J^2)``,
            ``M_J ~ 5 d_eff``) with the preconditioner weights ``D`` of FALKON's
            appendix A (by default their unbiased form ``sqrt(M count_j / (n R p_j))``;
            ``leverage_options={"weighting": "paper"}`` gives ``1 / sqrt(n p_j count_j)``).
            The scores depend on ``lambda`` and on the kernel: they are
            computed *once, here*, at the initial penalty and kernel hyperparameters;
            the centers and weights are not re-drawn when those change later (call
            :func:`~gpfalkon.centers.leverage_centers` again and build a new model).
            Leverage sampling needs fewer centers than uniform sampling when the data
            are clustered or have outliers (``M ~ d_eff log d_eff``, see
            :func:`~gpfalkon.centers.effective_dimension`).
        leverage_options: with ``center_selection="leverage"``, keyword options of
            :func:`~gpfalkon.centers.leverage_centers`: ``weighting`` and the BLESS
            options of :func:`~gpfalkon.centers.approximate_leverage_scores`
            (``oversampling``, ``lambda_step``, ``max_dictionary_size``,
            ``min_dictionary_size``, ``block_rows``).
        center_weights: ``(M,)`` positive preconditioner weights ``D`` for user-given
            ``centers`` (e.g. ``CenterSelection.weights``); default ``None`` = ``D = I``.
            Stored as the buffer ``center_weights`` (float64; ``None`` for uniform or
            unweighted centers), saved in ``state_dict`` and kept by copies and ``.to()``.
            The weights change only FALKON's preconditioner, never the solution
            ``H alpha = K_Mn y``. With ``learn_centers=True`` they are kept as they are
            while the centers move (still a valid preconditioner, possibly a less
            effective one).
        penalty: ``lambda > 0`` (default ``1e-6`` unless ``likelihood`` is given,
            in which case ``lambda = noise / n``).
        likelihood: a ``GaussianLikelihood`` (single output) or
            ``MultitaskGaussianLikelihood`` with one shared noise; its noise *is*
            the penalty (``noise = n lambda``). Default: one with a ``Positive``
            constraint through ``exp``/``log``, so that learning it is learning
            ``log lambda``.
        learn_centers: register ``centers`` as a ``torch.nn.Parameter``.
        generator: ``torch.Generator`` for center sampling (default: one on ``train_x``'s device seeded with
            ``seed``). The draws happen on the generator's device, and torch's CPU and CUDA generators give
            different streams: the same ``seed`` picks different centers on different devices. Pass ``centers``
            (or a CPU ``generator``) for the same centers everywhere.
        max_iter, tol: CG stopping rule (see :class:`~gpfalkon.NystromKRROperator`;
            default: relative residual 1e-6 or 100 iterations, with a
            :class:`~gpfalkon.CGNotConvergedWarning` if the cap comes first). FALKON's
            own practice, a fixed 10-50 iterations, is ``max_iter=20, tol=0``: the
            test error is the same (``benchmarks/fit.py``) at a fraction of the passes.
        memory_budget, block_rows, store_kernel: kernel-engine options.
        verbose: tqdm progress bar during ``fit()``.
        options: a :class:`~gpfalkon.FalkonOptions` instead of (or with, if they do not
            conflict) the keyword options above; stored as ``model.options``.
        predict_chunk_size: test points per chunk when predicting (bounds the
            ``chunk x M`` kernel blocks held at once); fewer where the memory budget cannot hold
            ``PREDICT_LIVE_BLOCKS`` such float64 blocks (a variance chunk holds about that many).
        mean_constant: constant prior mean ``c`` (a float, or one value per output
            column; default 0), GPyTorch's ``ConstantMean`` held fixed: the fit solves
            ``H alpha = K_Mn (y - c)``, the posterior mean is ``c + K_*M alpha`` and the
            objectives see ``y - c``. Stored as the buffer ``mean_constant``.
    """

    # buffers (register_buffer)
    center_weights: Tensor | None
    mean_constant: Tensor
    kernel_probe: Tensor
    alpha: Tensor
    fitted: Tensor
    data_fingerprint: Tensor

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        kernel: Kernel | None = None,
        *,
        num_centers: int | None = None,
        centers: Tensor | None = None,
        penalty: float | Tensor | None = None,
        likelihood: Likelihood | None = None,
        learn_centers: bool = False,
        center_selection: str | CenterSelector = "uniform",
        center_weights: Tensor | None = None,
        leverage_options: dict[str, Any] | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
        max_iter: int | None = None,
        tol: float | None = None,
        memory_budget: int | None = None,
        block_rows: int | None = None,
        store_kernel: bool | None = None,
        verbose: bool = False,
        predict_chunk_size: int = 4096,
        mean_constant: float | Tensor = 0.0,
        options: FalkonOptions | None = None,
    ) -> None:
        super().__init__()
        own = memory_budget if memory_budget is not None else getattr(options, "memory_budget", None)
        with _own_budget(own):  # the passes that read the setting (a row source's scans) follow the model's budget
            sharded = options is not None and is_sharded(getattr(options, "backend", None))
            try:
                check_inputs("train_x", train_x, allow_empty=sharded)
                n, d = train_x.shape
                check_targets("train_y", train_y, n)
                if train_y.dtype != train_x.dtype:
                    raise TypeError(f"train_y has dtype {train_y.dtype} but train_x has {train_x.dtype}")
            except (TypeError, ValueError) as exc:
                if not sharded:
                    raise
                _raise_on_every_rank(cast(FalkonOptions, options).backend, exc, train_x)
            if sharded:
                _raise_on_every_rank(cast(FalkonOptions, options).backend, None, train_x)
            if kernel is None:
                kernel = default_kernel(d, dtype=train_x.dtype, device=train_x.device)
            _check_kernel(kernel, d, train_x.device)
            self.kernel = kernel
            self.train_inputs: tuple[Tensor, ...] = (train_x,)
            self.train_targets: Tensor = train_y
            self._num_outputs = 1 if train_y.dim() == 1 else int(train_y.shape[1])

            # options first: a bad one is reported before any expensive center selection
            self.options = FalkonOptions.merged(
                options,
                max_iter=max_iter,
                tol=tol,
                memory_budget=memory_budget,
                block_rows=block_rows,
                store_kernel=store_kernel,
                verbose=verbose,
            )

            # the global n of n lambda (a sharded backend sums the ranks' rows: a collective)
            self._n_total = total_rows(self.options.backend, train_x)
            self._n_local = int(train_x.shape[0])
            if self._n_total == 0:
                raise ValueError("train_x is empty (0 rows) on every rank")
            # --- centers: one selector, called once the penalty is known
            selector, m = _center_selector(
                train_x, num_centers, centers, center_selection, center_weights, leverage_options, generator, seed,
                self.options.backend, self._n_total,
            )
            if is_sharded(self.options.backend):
                # before any collective whose size or number depends on them: d, outputs, dtype, the number of centers
                # and the solver's iteration rules must agree (a mismatch would abort or stall a collective)
                opts = self.options
                rules = [-1.0 if opts.max_iter is None else float(opts.max_iter),
                         -1.0 if opts.tol is None else float(opts.tol), float(bool(learn_centers))]
                self.options.backend.check_consistent(
                    data_shape=torch.tensor([d, self._num_outputs, torch.finfo(train_x.dtype).bits],
                                            device=train_x.device),
                    num_centers=torch.tensor([-1 if m is None else int(m)], device=train_x.device),
                    solver_settings=torch.tensor(rules, dtype=torch.float64, device=train_x.device),
                )

            # --- likelihood and penalty (noise = n * penalty is the single source of truth)
            if likelihood is None:
                likelihood = default_likelihood(self._num_outputs, dtype=train_x.dtype, device=train_x.device)
                if penalty is None:
                    penalty = 1e-6
            else:
                check_likelihood(likelihood, self._num_outputs)
                if penalty is not None:
                    check_penalty(penalty)
                    given = float(likelihood.noise.reshape(-1)[0].detach())
                    implied = float(torch.as_tensor(penalty).detach()) * self._n_total
                    if not math.isclose(given, implied, rel_tol=1e-6):
                        raise ValueError(
                            f"penalty={float(torch.as_tensor(penalty)):g} means a noise n * penalty = {implied:g}, "
                            f"but the likelihood's noise is {given:g}: give one of them (noise = n * penalty is one "
                            "quantity)"
                        )
            self.likelihood = likelihood
            if penalty is not None:
                self.penalty = penalty
            sel = selector(train_x, m, kernel=kernel, penalty=self.penalty.detach())
            if not isinstance(sel, CenterSelection):
                raise TypeError("center_selection must return a gpfalkon.CenterSelection (centers, indices, "
                                f"weights), got {type(sel).__name__}")
            c, weights = sel.centers, sel.weights
            if (
                not isinstance(c, Tensor)
                or c.dim() != 2
                or c.shape[0] < 1
                or c.shape[1] != d
                or c.dtype != train_x.dtype
                or c.device != train_x.device
            ):
                got = f"{tuple(c.shape)} ({c.dtype}, {c.device})" if isinstance(c, Tensor) else type(c).__name__
                raise ValueError(
                    f"center_selection returned centers {got}; expected (M, {d}) with M >= 1 in {train_x.dtype} "
                    f"on {train_x.device}"
                )
            if not bool(torch.isfinite(c).all()):
                raise ValueError("center_selection returned centers with NaN or Inf values")
            if weights is not None:
                check_center_weights("center_weights", weights, c.shape[0], train_x.device)
            if is_sharded(self.options.backend):
                # every rank must hold the same model: the passes' sums assume it (one all_gather)
                self.options.backend.check_consistent(
                    centers=c.detach(),
                    penalty=self.penalty.detach(),
                    **kernel_identity(kernel, c.device),
                )
            self._register_centers(c.detach().clone(), learn_centers)
            self.register_buffer("center_weights", None if weights is None else weights.to(torch.float64))

            chunk: object = predict_chunk_size  # checked as an object: numbers.Integral is not int to mypy
            if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral):
                raise TypeError(f"predict_chunk_size must be an integer, got {predict_chunk_size!r}")
            self.predict_chunk_size = int(chunk)
            if self.predict_chunk_size < 1:
                raise ValueError(f"predict_chunk_size must be >= 1, got {predict_chunk_size}")

            try:
                mc = torch.as_tensor(mean_constant, dtype=torch.float64).detach().clone().to(train_x.device)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(
                    f"mean_constant must be a number or a tensor, got {type(mean_constant).__name__}") from exc
            mshape = () if self._num_outputs == 1 else (self._num_outputs,)
            if mc.numel() == 1:
                mc = mc.reshape(()).expand(mshape).clone()
            if tuple(mc.shape) != mshape:
                raise ValueError(
                    f"mean_constant must be a scalar or have shape {mshape} (one value per output), "
                    f"got shape {tuple(mc.shape)}"
                )
            if not bool(torch.isfinite(mc).all()):
                raise ValueError(f"mean_constant must be finite, got {mc.tolist()}")
            if is_sharded(self.options.backend):
                self.options.backend.check_consistent(mean_constant=mc)
            self.register_buffer("mean_constant", mc)

            shape = (c.shape[0],) if self._num_outputs == 1 else (c.shape[0], self._num_outputs)
            self.register_buffer("alpha", torch.full(shape, float("nan"), dtype=torch.float64, device=train_x.device))
            self.register_buffer("fitted", torch.tensor(False, device=train_x.device))
            # what alpha was fitted on (persists in state_dict): sums / norms of the training data, and content
            # digests of train_x, train_y and the hyperparameter groups (fit_state.FIT_GROUPS) + train_x's dtype code
            self.register_buffer("data_fingerprint", torch.zeros(6, dtype=torch.float64, device=train_x.device))
            self.register_buffer("fit_digest", torch.zeros(2 * len(FIT_GROUPS) + 1, dtype=torch.int64,
                                                            device=train_x.device))
            # the kernel's values at a few points when alpha was fitted (see _kernel_probe; empty: not recorded)
            self.register_buffer("kernel_probe", torch.zeros(0, dtype=torch.float64, device=train_x.device))
            # the noise sigma^2 when alpha was fitted (NaN: not recorded); the raw parameter alone does not settle it
            # (the likelihood's constraint transform maps it)
            self.register_buffer("fit_noise", torch.tensor(float("nan"), dtype=torch.float64, device=train_x.device))
            self._legacy_state = False  # set while loading a state saved before fit_digest existed
            self.fit_info: CGInfo | None = None
            self._fit_tracker = FitTracker()
            self._factors: NystromPosteriorFactors | None = None  # exact
            # FALKON's approximation (settings.variance_factors)
            self._fast_factors: NystromPosteriorFactors | None = None
            # counts the changes that invalidate the variance factors (_forget_factors, scale_prior): factors formed
            # across one are not kept, and what was built from them (a FalkonFantasyModel) knows it is stale
            self._factors_generation = 0
            # counts the changes of the fit itself (all of the above but a move to another dtype or device, which keeps
            # the fit): a posterior forms its covariance's factors lazily only within one fit
            self._fit_generation = 0
            self.register_load_state_dict_post_hook(FalkonGP._after_load)


    def __setstate__(self, state: dict[str, Any]) -> None:
        # models pickled before FalkonOptions / FitTracker existed kept the options as
        # attributes and the fit snapshot inline: rebuild both (the fit revalidates by value)
        if "options" not in state:
            keys = ("max_iter", "tol", "memory_budget", "block_rows", "store_kernel", "verbose")
            state["options"] = FalkonOptions.merged(None, **{k: state.pop(k) for k in keys if k in state})
        if "_fit_tracker" not in state:
            tracker = FitTracker()
            # the old snapshot lists the same tensors in the same order as _fit_dependencies()
            tracker.snapshot = state.pop("_snapshot", None)
            state.pop("_fitted_data_key", None)  # the data are re-checked by value
            state["_fit_tracker"] = tracker
        buffers = state.get("_buffers")
        if isinstance(buffers, dict) and "fit_digest" not in buffers:
            # pickled before content digests: the fit revalidates by the data's sums and norms until the next
            # fit or save (which record the digests)
            anchor = buffers.get("data_fingerprint", buffers.get("alpha"))
            dev = anchor.device if isinstance(anchor, Tensor) else None
            buffers["fit_digest"] = torch.zeros(2 * len(FIT_GROUPS) + 1, dtype=torch.int64, device=dev)
            if "data_fingerprint" not in buffers:
                buffers["data_fingerprint"] = torch.zeros(6, dtype=torch.float64, device=dev)
                buffers["fitted"] = torch.zeros((), dtype=torch.bool, device=dev)  # nothing to check it by
            state["_legacy_state"] = True
        state.setdefault("_legacy_state", False)
        state.setdefault("_factors_generation", 0)
        state.setdefault("_fit_generation", 0)
        if isinstance(buffers, dict) and "kernel_probe" not in buffers:  # pickled before the probe: none recorded
            anchor = buffers.get("alpha")
            buffers["kernel_probe"] = torch.zeros(0, dtype=torch.float64,
                                                  device=anchor.device if isinstance(anchor, Tensor) else None)
        noise_untracked = isinstance(buffers, dict) and "fit_noise" not in buffers
        if isinstance(buffers, dict) and noise_untracked:  # pickled before the noise value was tracked: not recorded
            anchor = buffers.get("alpha")
            buffers["fit_noise"] = torch.tensor(float("nan"), dtype=torch.float64,
                                                device=anchor.device if isinstance(anchor, Tensor) else None)
        super().__setstate__(state)
        tracker = self._fit_tracker
        if noise_untracked and tracker.snapshot is not None:
            # its snapshot lacks the noise value (_fit_dependencies): the one its likelihood computes now, from the
            # raw noise the snapshot holds
            tracker.snapshot.insert(self._noise_dependency_index(), self.noise.detach().clone())
            self.fit_noise = self._noise_record()  # recorded with it: a state saved from now on carries it

    def _register_centers(self, c: Tensor, learn_centers: bool) -> None:
        if learn_centers:
            self.centers = torch.nn.Parameter(c)
        else:
            self.register_buffer("centers", c)

    # ------------------------------------------------------------ properties
    @property
    def num_outputs(self) -> int:
        return self._num_outputs

    @property
    def covar_module(self) -> Kernel:
        """:attr:`kernel` under the name GPyTorch's and BoTorch's models give theirs (``SingleTaskGP.covar_module``),
        for code written against them: reading it, assigning it (``model.covar_module = k`` sets :attr:`kernel`) and
        ``initialize(**{"covar_module.<...>": value})`` reach the one kernel module (its ``state_dict`` keys stay
        ``kernel.*``)."""
        return self.kernel

    def __setattr__(self, name: str, value: Any) -> None:
        # a Module assigned to the covar_module alias would otherwise be registered as a second submodule
        super().__setattr__("kernel" if name == "covar_module" else name, value)

    def initialize(self, **kwargs: Any) -> FalkonGP:
        """GPyTorch's ``initialize``, with ``covar_module.<...>`` names read as ``kernel.<...>``
        (:attr:`covar_module`)."""
        renamed = {("kernel" + k[len("covar_module"):] if k.startswith("covar_module.") else k): v
                   for k, v in kwargs.items()}
        return cast("FalkonGP", super().initialize(**renamed))

    @property
    def n(self) -> int:
        """The number of training rows (all ranks' rows when the backend is sharded).

        In one process it is read off ``train_inputs`` (assigned directly, as GPyTorch code does with
        ``ExactGP``, or through :meth:`set_train_data`); a sharded model keeps the global count, which only a
        collective can form, so ``train_inputs`` assigned there with another number of rows raises."""
        x = self.train_inputs[0]
        n_total = self.__dict__.get("_n_total")  # absent from models pickled before sharding existed
        if n_total is None or not is_sharded(self.options.backend):
            return int(x.shape[0])
        n_local = self.__dict__.get("_n_local")
        if n_local is not None and int(x.shape[0]) != n_local:
            raise RuntimeError(
                f"FalkonGP: train_inputs has {int(x.shape[0])} rows on this rank, {n_local} when the global row "
                "count was formed: a sharded model's data must be replaced with set_train_data (a collective on "
                "every rank), not assigned")
        return int(n_total)

    @property
    def noise(self) -> Tensor:
        """The likelihood's noise ``sigma^2 = n lambda`` (a scalar tensor). The likelihood is checked on every
        read (it can be replaced by assignment): one shared Gaussian noise, as at construction."""
        check_likelihood(self.likelihood, self._num_outputs)
        return self.likelihood.noise.reshape(-1)[0]

    @property
    def penalty(self) -> Tensor:
        """``lambda = sigma^2 / n`` (positive scalar tensor, differentiable)."""
        return self.noise / self.n

    @penalty.setter
    def penalty(self, value: float | Tensor) -> None:
        check_penalty(value)
        noise = torch.as_tensor(value, dtype=torch.float64).reshape(()) * self.n
        ndt = self.likelihood.raw_noise.dtype
        stored = float(noise.to(ndt))
        if not (math.isfinite(stored) and stored > 0):  # the check above is in float64
            raise ValueError(f"penalty={float(value):g} gives the noise n * penalty = {float(noise):g}, which is "
                             f"{stored:g} in the likelihood's {ndt}: outside its range (use float64 data, or a "
                             "penalty within it)")
        try:
            self.likelihood.noise = noise.to(self.likelihood.raw_noise.dtype)
        except RuntimeError as exc:  # the likelihood's constraint cannot hold it
            raise ValueError(
                f"penalty={float(value):g} (noise {float(noise):g}) violates the likelihood's noise constraint: {exc}"
            ) from exc

    def scale_prior(self, factor: float) -> FalkonGP:
        r"""Multiply the kernel's ``outputscale`` and the noise by ``factor`` (``c > 0``), keeping the fit.

        ``K -> c K`` with ``sigma^2 = n lambda -> c sigma^2`` turns ``H = K_Mn K_nM + n lambda K_MM`` into
        ``c^2 H`` and ``K_Mn y`` into ``c K_Mn y``: ``alpha / c`` solves the new system and the posterior
        mean ``mu + K_*M alpha`` is unchanged, while every term of the posterior covariance and of the
        predictive variance (docs/math.md §4) is multiplied by ``c``. So a fitted model stays fitted with
        no data pass: ``alpha`` is rescaled, and the variance factors with it (``L -> c^{1/2} L``; ``L_B``
        does not change). ``c`` is applied as the ratio of the stored outputscale after and before (the
        parameter's rounding), so the mean is kept to that rounding. :func:`~gpfalkon.auto_fit` uses this to
        calibrate its predictive variances (docs/math.md §8, "Variance calibration").

        The kernel must be a ``ScaleKernel``; ``ValueError`` (nothing changed) where ``factor`` is not a
        finite number > 0 or an enforced constraint (the outputscale's, the likelihood's noise: one with a
        transform) cannot hold the new value. A bound without a transform, as BoTorch's default noise
        constraint, is GPyTorch's to keep through the optimiser's bounds, not checked on a value set directly
        (as for ``SingleTaskGP``). A model that is not fitted, or whose fit is stale, only has the two values changed.
        Returns ``self``.
        """
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not (
                math.isfinite(float(factor)) and float(factor) > 0):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        if not isinstance(self.kernel, ScaleKernel):
            raise ValueError(f"scale_prior needs a ScaleKernel (its outputscale carries the factor), got "
                             f"{type(self.kernel).__name__}")
        was_valid = bool(self.fitted) and not self._hyper_changed()
        old_scale = self.kernel.outputscale.detach().clone()
        old_noise = self.noise.detach().to(torch.float64).clone()
        # the raw parameters, restored bit for bit on failure (a constraint's inverse transform need not
        # give back the same raw value, and the fit's validity is checked on the raw values)
        raw = [self.kernel.raw_outputscale.detach().clone(), self.likelihood.raw_noise.detach().clone()]
        try:
            with torch.no_grad():
                self.kernel.outputscale = old_scale * float(factor)
            ratio = float(self.kernel.outputscale.detach().to(torch.float64).sum() / old_scale.to(torch.float64).sum())
            self.penalty = old_noise * ratio / self.n
        except (RuntimeError, ValueError) as exc:
            with torch.no_grad():
                self.kernel.raw_outputscale.copy_(raw[0])
                self.likelihood.raw_noise.copy_(raw[1])
            raise ValueError(f"scale_prior(factor={float(factor):g}): {exc}") from exc
        if was_valid:
            self.alpha = self.alpha / ratio
            # factors being formed elsewhere (another thread) belong to the old scale, as do fantasies built on these
            self._factors_generation += 1
            self._fit_generation += 1
            if self._factors is not None:
                self._factors = self._factors.scaled(ratio)
            if self._fast_factors is not None:
                self._fast_factors = self._fast_factors.scaled(ratio)
            if self._legacy_state:
                self._mark_fitted()
            else:  # the data are those of the fit (checked above): only the hyperparameters' record changes
                self._mark_hyper_fitted()
        else:
            self._forget_factors()
        return self

    def calibrate_variance(self, val_x: Tensor, val_y: Tensor) -> float:
        r"""Scale the prior so that the predictive variances best explain held-out residuals; returns the
        factor ``c``.

        ``c = mean(r^2 / v)`` over the rows of ``(val_x, val_y)`` (``r = y - mean``, ``v`` this model's
        predictive variances with the noise, all outputs pooled), the maximiser of the Gaussian likelihood of
        the residuals under variances ``c v``; then :meth:`scale_prior` ``(c)``: the mean is unchanged and
        the variances become ``c v``. For a penalty chosen by validation error (a grid, a
        :mod:`gpfalkon.tuning` search, cross-validation), where nothing ties the noise ``n lambda`` to the
        data's and the variances can be off by orders of magnitude (docs/math.md §8 "Variance
        calibration"). The rows must not be training rows. Cost: the variance factors if not formed yet
        (``O(n M^2)``, kept) and ``O(q M (M + d))``.
        """
        x = self._test_inputs(val_x)
        if not isinstance(val_y, Tensor):
            raise TypeError(f"val_y must be a torch.Tensor, got {type(val_y).__name__}")
        expected = (*x.shape[:-1],) if self._num_outputs == 1 else (*x.shape[:-1], self._num_outputs)
        if tuple(val_y.shape) != expected:
            raise ValueError(f"val_y must have shape {expected} for val_x of shape {tuple(x.shape)}, got "
                             f"{tuple(val_y.shape)}")
        if not bool(torch.isfinite(val_y).all()):
            raise ValueError("val_y contains NaN or Inf values")
        if self._is_training_input(x):
            raise ValueError("val_x is the training inputs: calibrate on held-out rows (training residuals are "
                             "smaller than test residuals, so the variances would come out too small)")
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                pred = self.likelihood(self(x))
                r = val_y.to(torch.float64) - pred.mean.to(torch.float64)
                v = pred.variance.to(torch.float64)
        finally:
            self.train(was_training)
        c = variance_scale(r, v)
        self.scale_prior(c)
        return c

    # the FalkonOptions fields, readable and assignable as attributes (as before FalkonOptions)
    max_iter = option_property("max_iter", settable=True)
    tol = option_property("tol", settable=True)
    memory_budget = option_property("memory_budget", settable=True)
    block_rows = option_property("block_rows", settable=True)
    store_kernel = option_property("store_kernel", settable=True)
    verbose = option_property("verbose", settable=True)

    def centered_targets(self) -> Tensor:
        """``y - c`` as ``(n, t)`` (``c = mean_constant``): what the fit and the objectives use."""
        y = self.train_targets
        y2 = y.unsqueeze(-1) if y.dim() == 1 else y
        c = getattr(self, "mean_constant", None)
        if c is None or not bool(c.ne(0).any()):
            return y2
        # subtract in float64 (the constant is not rounded to the data dtype first)
        return (y2.to(torch.float64) - c.reshape(1, -1).to(torch.float64)).to(y2.dtype)

    # ---------------------------------------------------------------- fitting
    def nystrom_operator(self, **overrides: Any) -> NystromKRROperator:
        """The :class:`~gpfalkon.NystromKRROperator` at the current hyperparameters.

        ``overrides``: :class:`~gpfalkon.FalkonOptions` fields (``store_kernel=False``, ...)
        replace the model's options for this operator; others (``callback``) go to it as is.
        """
        fields = {f.name for f in dataclasses.fields(FalkonOptions)}
        base = overrides.pop("options", None) or self.options
        if not isinstance(base, FalkonOptions):
            raise TypeError(f"options must be a gpfalkon.FalkonOptions, got {type(base).__name__}")
        opts = base.replace(**{k: v for k, v in overrides.items() if k in fields})
        rest = {k: v for k, v in overrides.items() if k not in fields}
        kw = dict(kernel=self.kernel, weights=self.center_weights, options=opts)
        kw.update(rest)
        return NystromKRROperator(self.train_inputs[0], self.centers, self.penalty, **kw)

    def fit(
        self,
        *,
        warm_start: bool = False,
        compute_variance: bool = False,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        tol: float | None = None,
        max_iter: int | None = None,
        verbose: bool | None = None,
        time_limit: float | None = None,
        initial_alpha: Tensor | None = None,
    ) -> FalkonGP:
        """Solve ``H alpha = K_Mn y`` by FALKON and store ``alpha``; returns ``self``.

        ``warm_start`` starts CG from the previous ``alpha`` (one more data pass,
        usually far fewer iterations after a small hyperparameter or data change: ``set_train_data`` keeps it;
        from zero where no fit has produced one).
        ``initial_alpha`` (the shape of :attr:`alpha`: one coefficient per center and output) starts CG from
        those coefficients instead, e.g. a fit of the same centers and hyperparameters on a subsample
        (``f(x) = c + k(x, Z) alpha`` is the same function on any rows, so its ``alpha`` is close to the full
        data's). Unlike ``warm_start`` it does not ask for CG: where the cost model picks the direct solve
        it is not used. Either start costs one data pass and is dropped (CG starts from zero) where its
        residual is not below the right-hand side's. With rows sharded over processes every rank must pass the
        same ``initial_alpha`` and ``warm_start`` (checked: a ``ValueError`` naming ``cg_start`` on every rank);
        CG's iteration then runs on rank 0, which calls ``callback`` (the other ranks serve its data products and
        receive its ``alpha``: :meth:`~gpfalkon.backend.DistributedBackend.lead_solve`).
        ``compute_variance`` also forms the posterior factors now (float64 data: sharing a stored
        ``K_nM``; float32 data: a pass of float64 kernel values,
        :meth:`~gpfalkon.operators.NystromKRROperator.float64_engine`).
        ``time_limit`` (seconds, counted from this call) stops CG at the first iteration
        that ends past it, with a :class:`~gpfalkon.errors.CGNotConvergedWarning` when ``tol`` was not
        reached (``fit_info.extra["time_limit"]`` records it; rows on one process only; a direct solve,
        chosen where the cost model finds it cheaper than CG, is one pass and is not interrupted).
        Convergence information lands in ``self.fit_info``, with where the time went:
        ``extra["fit_seconds"]`` (this call up to ``alpha``) and, for FALKON's CG,
        ``"preconditioner_seconds"`` (the ``O(M^3)`` factorisations), ``"cg_seconds"`` and its part
        ``"precond_apply_seconds"`` (the ``O(M^2)`` triangular solves of every iteration).
        """
        with self._scan_budget():  # the model's own memory budget for the passes that read the setting
            t_start = time.perf_counter()
            _check_kernel(self.kernel, self.centers.shape[-1], self.centers.device)  # it may have been replaced
            y2 = self.centered_targets()
            with torch.no_grad():
                # bad arguments are found before the O(n M) passes, and (like a bad shard) reported on every rank: a
                # rank that raised alone would leave the others waiting in the next collective
                problem = self._fit_argument_problem(callback, initial_alpha, warm_start)
                # the data may have been edited in place since construction: O(n d), before any pass
                x_tr = self.train_inputs[0]
                changed = None
                if is_row_source(x_tr):  # its files rewritten since it was opened: stat calls, no rows read
                    try:
                        x_tr.check_unchanged()
                    except (ValueError, OSError) as exc:
                        changed = exc
                bad = torch.tensor([float(not all_finite(self.train_targets)),
                                    float(not is_row_source(x_tr) and not all_finite(x_tr)),
                                    float(problem is not None), float(changed is not None)],
                                   dtype=torch.float64, device=self.centers.device)
                yc = y2.detach().to(device=bad.device, dtype=torch.float64)
                # the targets' first two moments ride on the same collective (for _warn_offset)
                moments = torch.cat([yc.sum(0), yc.square().sum(0), yc.new_tensor([float(yc.shape[0])])])
                both = self._row_sum(torch.cat([bad, moments]))  # every rank learns of a bad shard (no rank waits
                bad, moments = both[:4], both[4:]  # in a collective alone)
                if changed is not None:
                    raise changed
                if float(bad[3]) > 0:
                    raise ValueError("another rank's train_x / train_y failed the input checks (a row source's files "
                                     "changed since it was opened): see that rank's error")
                if problem is not None:
                    raise problem[0](problem[1])
                if float(bad[2]) > 0:
                    raise ValueError("fit(): another rank passed an invalid callback or initial_alpha (every rank must "
                                     "pass the same, valid ones)")
                if is_sharded(self.options.backend):
                    # every rank runs CG's collectives from one starting point: the same warm_start, the same
                    # initial_alpha (NaN marks none), else ranks would stop at different iterations
                    marker = torch.full((1,), float("nan"), dtype=torch.float64, device=self.centers.device)
                    given = marker if initial_alpha is None else initial_alpha.detach().reshape(-1).to(marker)
                    # and one stored K_nM format (gpfalkon.settings.store_format): else the ranks' rows would form
                    # a system of partly rounded rows
                    self.options.backend.check_consistent(
                        cg_start=torch.cat([marker.new_tensor([float(bool(warm_start))]), given]),
                        store_format=marker.new_tensor([float(settings.store_format.value() == "int16")]))
                for flag, name in zip(bad.tolist()[:2], ("train_y", "train_x"), strict=True):
                    if flag:
                        raise ValueError(f"{name} contains NaN or Inf (was it edited in place after the model was "
                                         "built?)")
                op = self.nystrom_operator()
                op.check_time_limit(time_limit)  # before the O(n M) pass
                _warn_offset(moments, op._stopping_rule(tol, max_iter)[0])
                if is_sharded(self.options.backend):
                    # the model and the solver's rules as they are now (hyperparameters, settings and options may have
                    # changed on one rank since construction): ranks that disagree would solve different systems, stop
                    # CG at different iterations (a collective left waiting) or take different methods (an abort)
                    tol_now, iters_now = op._stopping_rule(tol, max_iter)
                    rules = [tol_now, float(iters_now), float(zlib.crc32(str(self.options.solve_method).encode())),
                             float(zlib.crc32(str(self.options.precond_dtype).encode()))]
                    self.options.backend.check_consistent(
                        fit_rules=torch.tensor(rules, dtype=torch.float64, device=self.centers.device),
                        centers=self.centers.detach(), penalty=self.penalty.detach(), mean_constant=self.mean_constant,
                        **kernel_identity(self.kernel, self.centers.device))
                rhs = op.kmn_y(y2)
                if not bool(torch.isfinite(rhs).all()):
                    raise FalkonConvergenceError(
                        f"K_Mn y is not finite: the kernel overflows in {x_tr.dtype} for these inputs and "
                        "hyperparameters (huge or tiny lengthscales, or inputs scaled far from 1, e.g. |x| ~ 1e30); "
                        "standardise train_x, check the kernel's lengthscale and outputscale"
                        + (", or use float64" if x_tr.dtype.itemsize < 8 else "")
                    )
                x0 = None
                if warm_start and bool(torch.isfinite(self.alpha).all()):  # a previous solution, valid or not
                    x0 = self.alpha.reshape(op.m, -1).to(torch.float64)
                elif initial_alpha is not None:
                    x0 = initial_alpha.detach().reshape(op.m, -1).to(device=rhs.device, dtype=torch.float64)
                # the CG's share of the limit: what the K_Mn y pass (and the preconditioner) left of it
                cg_limit = None if time_limit is None else max(1e-9, time_limit - (time.perf_counter() - t_start))
                alpha, info = op.solve_system(rhs, x0, tol=tol, max_iter=max_iter, callback=callback, verbose=verbose,
                                              time_limit=cg_limit, x0_forces_cg=initial_alpha is None, y=y2)
                self.alpha = alpha.reshape(self.alpha.shape).to(torch.float64)
                info.extra["fit_seconds"] = time.perf_counter() - t_start
                self.fit_info = info
                self._mark_fitted()
                self._forget_factors()
                if compute_variance:
                    self._factors = NystromPosteriorFactors.compute(op)
                op.engine.release()
            return self

    def _path_state(self) -> tuple[list[Tensor], tuple, tuple]:
        """What a :class:`PenaltyPath`'s coefficients depend on besides the noise: the fit's dependencies without
        the noise's two entries (cloned), the training data's identity, the kernel's structure."""
        deps = self._fit_dependencies()
        i = self._noise_dependency_index() - 1  # the raw noise, then the noise value
        kept = [t.detach().clone() for t in deps[:i] + deps[i + 2:]]
        return kept, _identity(self._fit_data()), self._kernel_structure()

    def fit_penalty_path(
        self,
        penalties: Tensor | Sequence[float],
        *,
        tol: float | None = None,
        max_iter: int | None = None,
        time_limit: float | None = None,
        initial_alpha: Tensor | None = None,
    ) -> PenaltyPath:
        """The Nystrom solutions at every penalty of ``penalties`` at once
        (:meth:`~gpfalkon.operators.NystromKRROperator.solve_path`): ``alphas[j]`` solves
        ``(K_Mn K_nM + n lambda_j K_MM) alpha = K_Mn (y - c)``. By FALKON's CG, each iteration one data pass for all
        of them, so where that pass dominates (a stored ``K_nM``) ``p`` penalties cost about one :meth:`fit` plus
        ``p`` Cholesky factorisations of ``M x M``; or, where the cost model picks it (``options.solve_method``), by
        the direct solve: one pass and a Cholesky per penalty. The model is not changed: :meth:`path_means` predicts
        at every penalty, :meth:`select_penalty` makes one of them the model's fit. One output, rows on one
        process, the built-in solver and FALKON's own preconditioner. ``initial_alpha`` (``(p, M)``: one start per
        penalty) starts CG there (not used by a direct solve); ``time_limit`` as in :meth:`fit`."""
        if self._num_outputs != 1:
            raise ValueError(f"fit_penalty_path handles one output; this model has {self._num_outputs}")
        lams = torch.as_tensor(penalties, dtype=torch.float64).detach().reshape(-1).cpu()
        if lams.numel() < 1:
            raise ValueError("penalties must hold at least one penalty")
        for lam in lams.tolist():
            check_penalty(lam)
        p, m = lams.numel(), int(self.centers.shape[0])
        if initial_alpha is not None and (not isinstance(initial_alpha, Tensor) or initial_alpha.numel() != p * m
                                          or not bool(torch.isfinite(initial_alpha).all())):
            raise ValueError(f"initial_alpha must be a finite tensor of {p} x {m} coefficients (one start per "
                             "penalty)")
        with self._scan_budget():
            t_start = time.perf_counter()
            _check_kernel(self.kernel, self.centers.shape[-1], self.centers.device)
            with torch.no_grad():
                op = self.nystrom_operator()
                op.check_time_limit(time_limit)
                y2 = self.centered_targets()
                rhs = op.kmn_y(y2)
                if not bool(torch.isfinite(rhs).all()):
                    raise FalkonConvergenceError("K_Mn y is not finite: the kernel overflows for these inputs and "
                                                 "hyperparameters")
                x0 = None if initial_alpha is None else \
                    initial_alpha.detach().reshape(p, m).mT.to(device=rhs.device, dtype=torch.float64)
                limit = None if time_limit is None else max(1e-9, time_limit - (time.perf_counter() - t_start))
                alpha, info, precond = op.solve_path(rhs, lams, x0, tol=tol, max_iter=max_iter, time_limit=limit,
                                                     y=y2)
                op.engine.release()
            info.extra["fit_seconds"] = time.perf_counter() - t_start
        alphas = alpha.mT.reshape(p, *self.alpha.shape).to(torch.float64)
        return PenaltyPath(penalties=lams, alphas=alphas, info=info, preconditioners=precond, state=self._path_state())

    def _check_path(self, path: PenaltyPath) -> None:
        if not isinstance(path, PenaltyPath):
            raise TypeError(f"path must be a PenaltyPath (from fit_penalty_path), got {type(path).__name__}")
        kept, key, structure = path.state
        now, key_now, structure_now = self._path_state()
        same = key == key_now and structure == structure_now and len(kept) == len(now) and all(
            a.shape == b.shape and torch.equal(a, b.to(device=a.device, dtype=a.dtype))
            for a, b in zip(kept, now, strict=True))
        if not same:
            raise ValueError("path: the model's data, kernel, centers or mean changed since fit_penalty_path computed "
                             "this path; compute it again")

    def path_means(self, path: PenaltyPath, x: Tensor) -> Tensor:
        """``c + K_xM alphas[j]`` for every penalty of ``path``: ``(p, q)`` (float64), one kernel pass over ``x``
        for all of them (``O(q M d + q M p)``)."""
        self._check_path(path)
        x = self._test_inputs(x)
        if x.dim() != 2:
            raise ValueError(f"x must have shape (q, d), got {tuple(x.shape)}")
        cols = path.alphas.reshape(path.alphas.shape[0], -1).mT.contiguous()
        with torch.no_grad():
            kxa = nystrom_posterior_mean(self.kernel, x, self.centers, cols, self._predict_chunk(x),
                                         backend=self.options.backend)
        return (kxa.to(torch.float64) + self.mean_constant.to(torch.float64).reshape(())).mT

    def select_penalty(self, path: PenaltyPath, j: int) -> FalkonGP:
        """Make the path's ``j``-th solution this model's fit: ``penalty = path.penalties[j]`` (the noise
        ``n lambda_j``), ``alpha = path.alphas[j]``, ``fit_info = path.info``; returns ``self``. Refuses a path
        computed before the model's data, kernel, centers or mean changed."""
        self._check_path(path)
        p = path.penalties.numel()
        if isinstance(j, bool) or not isinstance(j, numbers.Integral) or not -p <= int(j) < p:
            raise ValueError(f"j must be an index into the path's {p} penalties, got {j!r}")
        self.penalty = float(path.penalties[int(j)])
        self.alpha = path.alphas[int(j)].clone().to(self.alpha)
        self.fit_info = path.info
        self._mark_fitted()
        self._forget_factors()
        return self

    def _fit_argument_problem(self, callback: Any, initial_alpha: Any, warm_start: bool
                              ) -> tuple[type[Exception], str] | None:
        """``(exception type, message)`` for the first bad argument of :meth:`fit`, or ``None``: a callback that is
        not callable; an ``initial_alpha`` that is not a finite floating-point tensor of :attr:`alpha`'s shape, or
        given together with ``warm_start``."""
        if callback is not None and not callable(callback):
            return TypeError, f"callback must be callable (iteration, x, residual), got {type(callback).__name__}"
        if initial_alpha is None:
            return None
        if warm_start:
            return ValueError, "initial_alpha and warm_start=True both give CG a starting point: pass one of them"
        if not isinstance(initial_alpha, Tensor):
            return TypeError, f"initial_alpha must be a tensor, got {type(initial_alpha).__name__}"
        if tuple(initial_alpha.shape) != tuple(self.alpha.shape):
            return ValueError, (f"initial_alpha must have alpha's shape {tuple(self.alpha.shape)} (one coefficient "
                                f"per center and output), got {tuple(initial_alpha.shape)}")
        if not initial_alpha.dtype.is_floating_point or not bool(torch.isfinite(initial_alpha).all()):
            return ValueError, "initial_alpha must be floating point and finite (no NaN or Inf)"
        return None

    # ------------------------------------------------ is the fit still valid?
    def _kernel_probe(self) -> Tensor:
        """``k(P, P)`` (flattened, float64) at ``P`` = the first (at most 3) centers and the first center shifted by
        one in every coordinate: what the kernel computes, which its raw parameters alone do not settle (a
        constraint's transform, a Matern ``nu``, any setting that is not a parameter or a buffer). ``O(d)``, no
        gradient; empty where the kernel cannot be evaluated there.

        Evaluated on float64 points, so a float32 model's probe carries no float32 (or, on a GPU, TF32) rounding
        and one device reproduces another's to float64 rounding; a kernel that refuses float64 points is
        evaluated in its own dtype with TF32 off."""
        return self._kernel_probe_in()[0]

    def _kernel_probe_in(self) -> tuple[Tensor, torch.dtype]:
        """:meth:`_kernel_probe` and the dtype of the points it was computed on."""
        c = self.centers.detach()
        # the shifted point leaves the inputs' domain where some column is an index (an IndexKernel's task): the
        # centers alone then
        for p in (torch.cat([c[:3], c[:1] + 1.0]), c[:3]):
            try:
                with torch.no_grad(), settings.tf32(False), matmul_precision(p.device):
                    k, dtype = kernel_block_in(self.kernel, p.to(torch.float64), p.to(torch.float64))
                    return k.reshape(-1), dtype
            except Exception:
                continue
        # a kernel for other inputs altogether: no probe, its parameters still tracked
        return torch.zeros(0, dtype=torch.float64, device=c.device), torch.float64

    def _fit_dependencies(self) -> list[Tensor]:
        """Everything alpha depends on except the data: kernel, centers, noise (its raw parameter and the value
        ``sigma^2`` the likelihood's constraint makes of it: a likelihood or constraint replaced changes the value,
        not the parameter), constant mean. Compared at every prediction, so the kernel's values
        (:meth:`_kernel_probe`, +25 % on a one-point posterior) are not: they are recorded by ``fit()`` and compared
        when a state is loaded. The kernel's classes and settings are compared too (:meth:`_kernel_structure`); what
        neither sees (a transform's own code changed in place, a setting that is not a plain public attribute) needs
        ``fit()`` again."""
        return [
            *self.kernel.parameters(),
            *self.kernel.buffers(),
            self.centers,
            self.likelihood.raw_noise,
            self.noise.detach(),
            self.mean_constant,
        ]

    def _noise_dependency_index(self) -> int:
        """Where the noise value stands in :meth:`_fit_dependencies`."""
        return len(list(self.kernel.parameters())) + len(list(self.kernel.buffers())) + 2

    def _kernel_structure(self) -> tuple:
        """The kernel's classes and settings (:func:`~gpfalkon.models.fit_state.module_structure`), compared at
        every prediction beside its parameters: a kernel (or a part of one) replaced by one of another class, or
        a ``nu`` changed in place, after ``fit()`` makes the fit stale."""
        return module_structure(self.kernel)

    def _fit_groups(self) -> list[list[Tensor]]:
        """The hyperparameter groups of ``fit_digest`` (FIT_GROUPS after train_x / train_y)."""
        return [
            [*self.kernel.parameters(), *self.kernel.buffers()],
            [self.centers],
            [self.likelihood.raw_noise],
            [self.mean_constant],
        ]

    def _fit_data(self) -> tuple[Tensor, Tensor]:
        return self.train_inputs[0], self.train_targets

    def _digest_now(self, data_digest: Tensor) -> Tensor:
        hyper = hyper_digest(self._fit_groups())
        code = dtype_code(self.train_inputs[0].dtype)
        return torch.cat([data_digest.to(torch.int64).cpu(), torch.tensor([*hyper, code], dtype=torch.int64)]).to(
            self.fit_digest.device)

    def _mark_fitted(self) -> None:
        if not bool(torch.isfinite(self.alpha).all()):
            self._set_fitted(False)
            self._fit_tracker.forget()
            raise FalkonConvergenceError(
                "fit: the solution alpha contains NaN or Inf (the kernel, penalty or data overflow in this "
                f"dtype, {self.train_inputs[0].dtype}); check the data's scale and the penalty, or use float64"
            )
        try:  # the data's digests first (a pass over the rows, which can fail: a row source's read)
            with self._scan_budget():
                summary, digest = self._fit_tracker.mark(self._fit_dependencies(), self._fit_data(),
                                                         reduce=self._row_sum, row_offset=self._row_offset,
                                                         structure=self._kernel_structure())
        except BaseException:
            self._set_fitted(False)  # alpha is the new one already: cleanly unfitted, not the old fit's records
            self._fit_tracker.forget()
            raise
        self._set_fitted(True)
        self._legacy_state = False
        self.data_fingerprint = summary.to(self.data_fingerprint.device)
        self.fit_digest = self._digest_now(digest)
        self.kernel_probe = self._kernel_probe().to(self.kernel_probe.device)
        self.fit_noise = self._noise_record()

    def _noise_record(self) -> Tensor:
        """The current noise as the ``fit_noise`` buffer (float64, on the buffer's device)."""
        return self.noise.detach().to(device=self.fit_noise.device, dtype=torch.float64).reshape(())

    def _set_fitted(self, flag: bool) -> None:
        """Set the ``fitted`` flag by a new tensor, never in place: a state dict taken earlier (which holds the
        flag tensor itself) or another model that loaded it with ``assign=True`` keeps its own flag."""
        self.fitted = torch.tensor(flag, device=self.fitted.device)

    def _mark_hyper_fitted(self) -> None:
        """Record the current hyperparameters as fitted, keeping the data's digests (no data pass): for a
        change that keeps ``alpha`` valid on the same data (:meth:`scale_prior`)."""
        self._fit_tracker.adopt(self._fit_dependencies(), self._fit_data(), structure=self._kernel_structure())
        self.fit_digest = self._digest_now(self.fit_digest[:4])
        self.fit_noise = self._noise_record()
        self.kernel_probe = self._kernel_probe().to(self.kernel_probe.device)

    def _row_sum(self, t: Tensor) -> Tensor:
        """Sums over this process's rows completed over all shards (identity in one process)."""
        return reduce_rows(self.options.backend, t)[0]

    def _row_offset(self) -> int:
        """This process's first global row (0 in one process; a collective when sharded)."""
        backend = self.options.backend
        return int(backend.row_range(self.train_inputs[0])[0]) if is_sharded(backend) else 0

    def _stored_fingerprint(self) -> tuple[Tensor, Tensor | None]:
        return self.data_fingerprint, (None if self._legacy_state else self.fit_digest[:4])

    def _hyper_changed(self) -> bool:
        with self._scan_budget():
            return self._fit_tracker.stale(
                self._fit_dependencies(), self._fit_data(), self._stored_fingerprint(), reduce=self._row_sum,
                row_offset=self._row_offset, structure=self._kernel_structure(),
            )

    def _scan_budget(self) -> contextlib.AbstractContextManager[Any]:
        """The model's own ``memory_budget``, where it has one, as :class:`gpfalkon.settings.memory_budget` while a
        pass over the data alone runs (a row source's finiteness check and digests take their block height from
        the setting: :func:`~gpfalkon.backend.blocks.scan_rows`)."""
        return _own_budget(self.options.memory_budget)

    def _apply(self, fn, *args, **kwargs):
        # .to(device / dtype), .double(), .cuda() ... move the training data too (as
        # ExactGP does); a fit that was valid stays valid; alpha and the fingerprint
        # stay float64 (predictions are computed in float64).
        was_valid = bool(self.fitted) and not self._hyper_changed()
        weights = self.center_weights  # kept in float64: a float32 round trip would round them
        mean_c = self.mean_constant  # likewise
        super()._apply(fn, *args, **kwargs)
        # a row source (rows on disk) stays where it is; a copy of it reads its blocks in the new dtype onto the new
        # device (a row source stands in for a tensor in train_inputs)
        self.train_inputs = tuple(cast(Tensor, _moved_source(t, fn)) if is_row_source(t) else fn(t)
                                  for t in self.train_inputs)
        self.train_targets = fn(self.train_targets)
        self.alpha = self.alpha.to(torch.float64)
        self.mean_constant = mean_c.to(device=self.alpha.device, dtype=torch.float64)
        self.data_fingerprint = self.data_fingerprint.to(torch.float64)
        self.fit_digest = self.fit_digest.to(torch.int64)
        self.kernel_probe = self.kernel_probe.to(torch.float64)
        self.fit_noise = self.fit_noise.to(torch.float64)
        if weights is not None:
            self.center_weights = weights.to(device=self.centers.device, dtype=torch.float64)
        self._forget_factors(refit=False)
        if was_valid and self.train_inputs[0].dtype in (torch.float32, torch.float64):
            self._mark_fitted()
        else:  # a move through float16 / bfloat16 rounded the data and hyperparameters: fit again
            if was_valid:
                self._set_fitted(False)
            self._fit_tracker.forget()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        # ``fitted`` in a saved state means "alpha solves the saved hyperparameters": a fit made stale
        # by later hyperparameter changes is saved as unfitted (no stale alpha after loading)
        if self._legacy_state and bool(self.fitted) and not self._hyper_changed():
            # unpickled from before content digests and still valid by sums and norms: record them now
            self._legacy_state = False
            with self._scan_budget():
                _, digest = self._fit_tracker.mark(self._fit_dependencies(), self._fit_data(), reduce=self._row_sum,
                                                   row_offset=self._row_offset, structure=self._kernel_structure())
            self.fit_digest = self._digest_now(digest)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "fitted"
        if key in destination and bool(self.fitted) and self._hyper_changed():
            destination[key] = torch.zeros_like(self.fitted)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # The state dict is the source of truth for the centers, their number (leverage
        # sampling draws a data-dependent number of distinct centers) and their weights
        # (``center_weights`` is ``None``, hence absent from the state dict, for
        # unweighted centers): adopt its shapes before the copy.
        c_key, w_key, a_key = prefix + "centers", prefix + "center_weights", prefix + "alpha"
        if c_key in state_dict and isinstance(state_dict[c_key], Tensor):
            new_c = state_dict[c_key]
            if new_c.dim() == 2 and new_c.shape[-1] == self.centers.shape[-1] and new_c.shape != self.centers.shape:
                empty = torch.empty(new_c.shape, dtype=self.centers.dtype, device=self.centers.device)
                if isinstance(self.centers, torch.nn.Parameter):
                    self.centers = torch.nn.Parameter(empty, requires_grad=self.centers.requires_grad)
                else:
                    self.centers = empty
            if w_key not in state_dict:
                self.center_weights = None  # the loaded centers carry no weights
        new_a = state_dict.get(a_key)
        if (
            isinstance(new_a, Tensor)
            and new_a.dim() == self.alpha.dim()
            and new_a.shape[1:] == self.alpha.shape[1:]  # same number of outputs
            and new_a.shape != self.alpha.shape
        ):
            self.alpha = torch.empty(new_a.shape, dtype=torch.float64, device=self.alpha.device)
        if w_key in state_dict and isinstance(state_dict[w_key], Tensor):
            w = state_dict[w_key]
            if self.center_weights is None or self.center_weights.shape != w.shape:
                self.center_weights = torch.empty(w.shape, dtype=torch.float64, device=self.centers.device)
        p_key = prefix + "kernel_probe"
        if isinstance(state_dict.get(p_key), Tensor) and state_dict[p_key].shape != self.kernel_probe.shape:
            self.kernel_probe = torch.empty(state_dict[p_key].shape, dtype=torch.float64,
                                            device=self.kernel_probe.device)
        had_probe = p_key in state_dict
        n_key = prefix + "fit_noise"
        had_noise = n_key in state_dict
        m_key = prefix + "mean_constant"
        # a full model state dict (it has alpha) without the constant predates it: zero mean; a partial
        # dict (strict=False, e.g. only kernel hyperparameters) leaves the current constant alone
        had_mean = m_key in state_dict or a_key not in state_dict
        d_key = prefix + "fit_digest"
        # a full state saved before fit_digest existed: its data are checked by sums and norms, its
        # hyperparameters are taken as those of the fit (as they were then)
        legacy = a_key in state_dict and d_key not in state_dict
        alpha_before = self.alpha.detach().clone()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self.alpha.shape != alpha_before.shape or not torch.equal(self.alpha, alpha_before.to(self.alpha.device)):
            self.fit_info = None  # another fit's alpha: its CG record is not in the state
        if not had_mean:  # state dicts saved before the constant mean existed: zero mean
            self.mean_constant.zero_()
            if m_key in missing_keys:
                missing_keys.remove(m_key)
        if legacy and d_key in missing_keys:
            missing_keys.remove(d_key)
        if not had_probe:  # saved before the probe existed (or a partial dict): nothing recorded to compare
            self.kernel_probe = torch.zeros(0, dtype=torch.float64, device=self.kernel_probe.device)
            if p_key in missing_keys:
                missing_keys.remove(p_key)
        if not had_noise:  # saved before the noise value was recorded (or a partial dict): nothing to compare
            self.fit_noise = torch.tensor(float("nan"), dtype=torch.float64, device=self.fit_noise.device)
            if n_key in missing_keys:
                missing_keys.remove(n_key)
        self._legacy_state = legacy

    @staticmethod
    def _after_load(module: FalkonGP, incompatible_keys) -> None:
        if getattr(module, "_load_deferred", False):
            return  # a subclass re-derives the training data first, then calls this (FalkonModel.load_state_dict)
        module._forget_factors()
        module._fit_tracker.forget()
        legacy, module._legacy_state = module._legacy_state, False
        if not bool(module.fitted):
            return
        differs: list[str] = []
        if not bool(torch.isfinite(module.alpha).all()):
            differs.append("alpha contains NaN or Inf")
        elif legacy:
            # one data pass: the sums and norms are checked against the saved ones, and the digests recorded
            with module._scan_budget():
                summary, digest = module._fit_tracker.mark(module._fit_dependencies(), module._fit_data(),
                                                           reduce=module._row_sum, row_offset=module._row_offset,
                                                           legacy_sums=True, structure=module._kernel_structure())
            saved = module.data_fingerprint.to(torch.float64)
            if torch.allclose(summary.to(saved.device), saved, rtol=1e-12, atol=0.0):
                module.fit_digest = module._digest_now(digest)
            else:
                differs.append("train_x or train_y (sums and norms)")
        else:
            saved = module.fit_digest.to(torch.int64).cpu()
            x_dtype = module.train_inputs[0].dtype
            if int(saved[-1]) != dtype_code(x_dtype):
                differs.append(f"the training data's dtype (this model holds {x_dtype}; the fit was on another: "
                               "load into a model of the fit's dtype, then .to() keeps the fit)")
            else:
                with module._scan_budget():
                    differs += module._fit_tracker.data_changed(module._fit_data(),
                                                                (module.data_fingerprint, saved[:4]),
                                                                reduce=module._row_sum, row_offset=module._row_offset)
                now = hyper_digest(module._fit_groups())
                differs += [name for i, name in enumerate(FIT_GROUPS[2:])
                            if now[2 * i : 2 * i + 2] != saved[4 + 2 * i : 6 + 2 * i].tolist()]
                fit_noise = float(module.fit_noise)
                if not differs and math.isfinite(fit_noise):
                    # the same raw noise through another constraint transform (likelihood) is another noise;
                    # across devices the transform agrees to a few ulps of the model's dtype
                    rtol = 1e-5 if module.train_inputs[0].dtype == torch.float32 else 1e-12
                    if not math.isclose(float(module.noise.detach()), fit_noise, rel_tol=rtol):
                        differs.append(f"the noise sigma^2 (the fit's {fit_noise:.6g}, this model's likelihood "
                                       f"makes {float(module.noise.detach()):.6g} of the same raw value: another noise "
                                       "constraint)")
                if not differs and module.kernel_probe.numel() > 0:
                    probe, probe_dtype = module._kernel_probe_in()
                    saved_probe = module.kernel_probe
                    # relative to the kernel's scale: on float64 points another device's summation order stays
                    # within 1e-9 in a float64 model and 1e-6 in a float32 one (its parameters are float32; a
                    # probe saved by a float32 evaluation differs by ~1e-7); on float32 points (a kernel that
                    # refuses float64 ones) within 1e-4
                    if probe_dtype != torch.float64:
                        tol = 1e-4
                    else:
                        tol = 1e-6 if module.train_inputs[0].dtype == torch.float32 else 1e-9
                    scale = float(saved_probe.abs().max()) if saved_probe.numel() else 0.0
                    if probe.shape != saved_probe.shape or not torch.allclose(
                        probe.to(saved_probe.device), saved_probe, rtol=tol, atol=tol * scale
                    ):
                        differs.append("the kernel's values at the same parameters (another kernel class, "
                                       "constraint transform or setting such as nu)")
            if not differs:
                module._fit_tracker.adopt(module._fit_dependencies(), module._fit_data(),
                                          structure=module._kernel_structure())
                if not math.isfinite(float(module.fit_noise)):  # a state saved before the noise was recorded
                    module.fit_noise = module._noise_record()
        if differs:
            module._set_fitted(False)
            module._fit_tracker.forget()
            warn_caller(
                "FalkonGP.load_state_dict: the loaded alpha does not fit this model (it differs in: "
                + "; ".join(differs) + "); the model is marked unfitted (call fit())",
                RuntimeWarning,
            )

    def set_train_data(self, inputs: Tensor | None = None, targets: Tensor | None = None,
                       strict: bool = False) -> None:
        """Replace the training data (centers unchanged), as ``ExactGP.set_train_data``:
        ``None`` keeps the current inputs / targets; ``strict=True`` requires the new ones to have
        the current shapes (BoTorch's ``load_state_dict`` calls ``set_train_data(targets=...,
        strict=...)``; the default stays ``False``, as before, since a FALKON model is often given
        more rows). The likelihood's noise ``sigma^2`` stays, as in ``ExactGP``, so ``lambda = sigma^2 / n``
        follows the number of rows; every check runs before anything is replaced (a refused call changes
        nothing). The fit stays valid if the data are the same by value (the stored
        digest) or equal to rounding (within 8 ulps: a re-applied outcome or input transform,
        as BoTorch's ``load_state_dict`` does), else the model must be re-fitted.

        Preconditioner weights ``D`` (leverage centers) are kept: the probabilities ``p_j`` they
        were drawn with are over the rows they were drawn from, and for new rows that are (or
        extend) a uniform sample of the same distribution the preconditioner's sketch
        ``(n_new / M) K_MM D^2 K_MM`` matches ``K_Mn K_nM`` with the same ``D`` (docs/math.md §8,
        "Leverage check"). ``D`` changes CG's speed, never the solution.
        """
        if isinstance(inputs, (tuple, list)):
            if len(inputs) != 1:
                raise ValueError(f"inputs: FalkonGP has one input tensor, got {len(inputs)}")
            inputs = inputs[0]
        if inputs is None:
            inputs = self.train_inputs[0]
        if targets is None:
            targets = self.train_targets
        if strict:
            for name, new, old in (("inputs", inputs, self.train_inputs[0]), ("targets", targets, self.train_targets)):
                if tuple(new.shape) != tuple(old.shape):
                    raise RuntimeError(
                        f"set_train_data(strict=True): {name} has shape {tuple(new.shape)}, the model's has "
                        f"{tuple(old.shape)} (pass strict=False to change the shape)"
                    )
        deferred = getattr(self, "_load_deferred", False)  # a load in progress checks the fit at its end
        was_valid = not deferred and bool(self.fitted) and not self._hyper_changed()
        with self._scan_budget():
            check_inputs("inputs", inputs, d=self.train_inputs[0].shape[1],
                         allow_empty=is_sharded(self.options.backend))
        check_targets("targets", targets, inputs.shape[0])
        if inputs.dtype != self.train_inputs[0].dtype or targets.dtype != inputs.dtype:
            raise TypeError(
                f"inputs ({inputs.dtype}) and targets ({targets.dtype}) must have the model's dtype "
                f"{self.train_inputs[0].dtype}"
            )
        if inputs.device != self.centers.device or targets.device != inputs.device:
            raise ValueError(f"inputs and targets must be on {self.centers.device}")
        if targets.dim() != self.train_targets.dim() or (targets.dim() == 2 and targets.shape[1] != self._num_outputs):
            raise ValueError(
                f"targets must keep the shape convention of train_y ({tuple(self.train_targets.shape[1:])})"
            )
        n_new = total_rows(self.options.backend, inputs)
        if n_new == 0:
            raise ValueError("inputs is empty (0 rows) on every rank")
        old_x, old_y = self.train_inputs[0], self.train_targets
        # the GP view, as ExactGP: the likelihood's noise sigma^2 stays, so lambda = sigma^2 / n follows n (nothing
        # is assigned that could fail: every check above ran before the data are replaced)
        self._n_total = n_new
        self._n_local = int(inputs.shape[0])
        self.train_inputs = (inputs,)
        self.train_targets = targets
        self._forget_factors()
        if deferred:
            return
        if was_valid:
            with self._scan_budget():
                same = not self._fit_tracker.data_changed(self._fit_data(), self._stored_fingerprint(),
                                                          reduce=self._row_sum, row_offset=self._row_offset)
            if same:
                return  # the same data by value: alpha still solves the system
        if was_valid and _same_to_rounding(inputs, old_x) and _same_to_rounding(targets, old_y):
            # equal up to a few ulps (a re-applied outcome or input transform, as BoTorch's load_state_dict
            # does): alpha solves the system to rounding; the new data's digests are recorded
            self._mark_fitted()
            return
        self._set_fitted(False)
        self._fit_tracker.forget()

    # ------------------------------------------------------------- prediction
    def _check_fitted(self) -> None:
        if not bool(self.fitted):
            raise NotFittedError("FalkonGP: call fit() before predicting")
        if self._hyper_changed():
            raise NotFittedError(
                "FalkonGP: the kernel hyperparameters, centers, penalty or training data changed since "
                "fit(); call fit() again (after a training loop on a NystromMarginalLogLikelihood, mll.eval() "
                "refits)"
            )

    def posterior_factors(self, approximate: bool | None = None) -> NystromPosteriorFactors:
        """The variance factors, formed on first use and kept until the fit changes: exact
        (:meth:`NystromPosteriorFactors.compute`, one data pass, ``O(n M^2)``), or with ``approximate``
        (``None``: whether :class:`gpfalkon.settings.variance_factors` is ``"approximate"``) FALKON's
        approximation of ``K_Mn K_nM`` (:meth:`NystromPosteriorFactors.approximate_from`, ``O(M^3)``, no data
        pass: the posterior mean and the Nyström part of the variances stay exact, the posterior variance of
        the coefficients is approximated; docs/math.md §4.2)."""
        self._check_fitted()
        if approximate is None:
            approximate = settings.variance_factors.value() == "approximate"
        # the factors are kept only if no fit (or data change) happened while they were formed: another thread's
        # fit() forgets the factors, and a pass started before it must not store the old fit's afterwards
        generation = self._factors_generation
        if approximate:
            fast = self._fast_factors
            if fast is None:  # K_MM alone: no operator over the rows (no collective when sharded)
                c = self.centers.detach()
                kmm = KernelEngine(self.kernel, c, c, store=False).kmm(torch.float64)
                fast = NystromPosteriorFactors.approximate_from(kmm, self.n, float(self.penalty.detach()),
                                                                self.center_weights)
                if generation == self._factors_generation:
                    self._fast_factors = fast
            return fast
        factors = self._factors
        if factors is None:
            op = self.nystrom_operator(store_kernel=False)  # one pass: storing K_nM would not pay
            factors = NystromPosteriorFactors.compute(op)
            op.engine.release()
            if generation == self._factors_generation:
                self._factors = factors
        return factors

    def _forget_factors(self, refit: bool = True) -> None:
        """Drop both kinds of variance factors (the fit they belong to changed; ``refit=False``: only moved to
        another dtype or device)."""
        self._factors = None
        self._fast_factors = None
        self._factors_generation = getattr(self, "_factors_generation", 0) + 1
        if refit:
            self._fit_generation = getattr(self, "_fit_generation", 0) + 1

    def _check_test_inputs(self, x: Tensor) -> None:
        check_dtype("x", x)
        d = self.train_inputs[0].shape[1]
        if x.dim() < 2 or x.shape[-1] != d:
            raise ValueError(f"x must have shape (..., q, {d}), got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf values")

    def _test_inputs(self, x: Tensor) -> Tensor:
        """``x`` checked (a tensor, ``d`` features, finite) and given a feature axis when 1-D."""
        if is_row_source(x):
            raise TypeError(f"x must be a torch.Tensor of shape (..., q, d), got a row source ({type(x).__name__}): "
                            "predict its rows block by block, e.g. torch.cat([model.posterior_mean(b) for _, _, b "
                            "in x.blocks(100_000)])")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor of shape (..., q, d), got {type(x).__name__} "
                            "(convert with torch.as_tensor(x, dtype=...))")
        d = self.train_inputs[0].shape[1]
        if x.dim() == 1:
            if d != 1:  # a 1-D x is q points of one feature: one point of d features must say so
                raise ValueError(f"x must have shape (..., q, {d}), got a 1-D tensor of shape {tuple(x.shape)} (a "
                                 f"1-D x is read as points of one feature; one point of {d} features is "
                                 f"x.reshape(1, {d}))")
            x = x.unsqueeze(-1)
        self._check_test_inputs(x)
        return x

    def __call__(self, x: Tensor, **kwargs) -> MultivariateNormal:
        train = self.train_inputs[0]
        if self.training and is_row_source(x) and x is train:  # the MLL's model(*model.train_inputs)
            mc = self.mean_constant.to(dtype=train.dtype, device=self.centers.device)
            shape = (len(train),) if self._num_outputs == 1 else (len(train), self._num_outputs)
            return cast(MultivariateNormal, FalkonSourcePrior(mc.expand(shape)))
        x = self._test_inputs(x)
        if self.training:
            if gpytorch.settings.debug.on() and bool(self.fitted) and not self._is_training_input(x):
                # ExactGP raises here ("You must train on the training inputs!"); the prior at other
                # points is legitimate, so warn: a fitted model queried in train mode is usually a mistake
                warn_caller(
                    "FalkonGP is in train mode: model(x) is the prior N(c, K(x, x)) at these (non-training) "
                    "inputs, not the fitted posterior; call model.eval() to predict",
                    GPInputWarning,
                )
            return self._prior(x)
        if gpytorch.settings.prior_mode.on():  # as ExactGP: the prior in eval mode too, no fit needed
            return self._prior(x)
        return self._posterior(x)

    def forward(self, x: Tensor) -> MultivariateNormal:
        return self(x)

    def _is_training_input(self, x: Tensor) -> bool:
        train = self.train_inputs[0]
        if is_row_source(train):
            return x.shape == train.shape  # not read back from disk to compare values
        return x.shape == train.shape and (x is train or torch.equal(x, train))

    def _prior(self, x: Tensor) -> MultivariateNormal:
        covar = self.kernel(x)
        mc = self.mean_constant.to(dtype=x.dtype, device=x.device)
        if self._num_outputs == 1:
            return FalkonPrior(mc.expand(x.shape[:-1]).clone(), covar)
        t = self._num_outputs
        eye_t = DiagLinearOperator(torch.ones(*x.shape[:-2], t, dtype=x.dtype, device=x.device))
        mean = mc.expand(*x.shape[:-1], t).clone()
        return FalkonMultitaskPrior(mean, KroneckerProductLinearOperator(covar, eye_t), interleaved=True)

    def posterior_mean(self, x: Tensor) -> Tensor:
        """The posterior mean ``c + K_xM alpha`` alone, shaped as ``self(x).mean`` in eval mode
        (``(..., q)`` for one output, ``(..., q, t)`` for ``t``): no variance factors, and no
        process-wide GPyTorch flag (``skip_posterior_variances``) toggled to get it, so it is safe
        next to other threads' predictions. Cost ``O(q M d)``."""
        x = self._test_inputs(x)
        self._check_fitted()
        with torch.no_grad():
            mean = self._mean_at(x)
        return mean.squeeze(-1) if self._num_outputs == 1 else mean

    def _predict_chunk(self, x: Tensor) -> int:
        """Test points per prediction chunk for ``x``: ``predict_chunk_size``, or fewer where ``PREDICT_LIVE_BLOCKS``
        float64 ``chunk x M`` blocks would not fit the memory budget (the model's, else the setting's, else the
        automatic one, read only where ``x``'s points could exceed its floor)."""
        per_point = PREDICT_LIVE_BLOCKS * 8 * max(self.centers.shape[0], 1)
        automatic = given_memory_budget(self.options.memory_budget) is None
        if automatic and x.shape[:-1].numel() * per_point <= AUTO_BUDGET_FLOOR:
            return self.predict_chunk_size  # the automatic budget is at least its floor
        budget = memory_budget_for(self.options.memory_budget, device=x.device)
        return max(1, min(self.predict_chunk_size, budget // per_point))

    def _mean_at(self, x: Tensor, chunk: int | None = None) -> Tensor:
        """``c + K_xM alpha`` in ``x``'s dtype, ``(..., q, t)``, in chunks of ``chunk`` points (default
        :meth:`_predict_chunk`)."""
        if x.shape[-2] == 0:
            return torch.zeros(*x.shape[:-1], self._num_outputs, dtype=x.dtype, device=x.device)
        kxa = nystrom_posterior_mean(
            self.kernel, x, self.centers, self.alpha, chunk or self._predict_chunk(x), backend=self.options.backend
        )
        return (kxa + self.mean_constant.to(torch.float64).reshape(-1)).to(x.dtype)

    def _posterior(self, x: Tensor) -> MultivariateNormal:
        self._check_fitted()
        out_dtype = x.dtype
        q = x.shape[-2]
        if self._num_outputs > 1 and x.shape[:-2].numel() == 0 and q > 0:
            raise ValueError(f"x has an empty batch shape {tuple(x.shape[:-2])} with q = {q} points: GPyTorch's "
                             "MultitaskMultivariateNormal cannot hold it (its (batch, q * t) mean reshape is "
                             "ambiguous for 0 elements); drop the empty batch, or ask for q = 0 points")
        if q == 0:  # an empty batch of test points is valid: an empty distribution
            empty = DenseLinearOperator(torch.zeros(*x.shape[:-2], 0, 0, dtype=out_dtype, device=x.device))
            mean0 = torch.zeros(*x.shape[:-2], 0, self._num_outputs, dtype=out_dtype, device=x.device)
            return shared_covariance_distribution(mean0, empty)
        chunk = self._predict_chunk(x)
        mean = self._mean_at(x, chunk)  # (..., q, t)
        if gpytorch.settings.skip_posterior_variances.on():
            covar = ZeroLinearOperator(*x.shape[:-1], q, dtype=out_dtype, device=x.device)
        else:
            covar = NystromPosteriorCovariance(
                x, self.centers.detach(), kernel=self.kernel, chunk_size=chunk, factors=self._factors_for_posterior(),
                check=self._posterior_check(),
            )
        return shared_covariance_distribution(mean, covar)

    def _posterior_check(self) -> Callable[[], None]:
        """For a posterior's lazy covariance, which reads the kernel live (``K_*M``, ``K_**``) beside this fit's
        factors: a check, run before each of its evaluations, that raises :class:`NotFittedError` where the model
        was refitted, rescaled (:meth:`scale_prior`) or had its data changed (the fit's generation), or where the
        kernel's parameters, buffers or structure differ from those it was formed with; its values would then mix
        two models. ``O(number of kernel parameters)`` a check (no data pass)."""
        generation = self._fit_generation
        kernel = self.kernel
        state = [t.detach().clone() for t in (*kernel.parameters(), *kernel.buffers())]
        structure = self._kernel_structure()

        def check() -> None:
            now = [*kernel.parameters(), *kernel.buffers()]
            same = (self._fit_generation == generation and self.kernel is kernel and len(now) == len(state)
                    and all(a.shape == b.shape and torch.equal(a, b.detach().to(a))
                            for a, b in zip(state, now, strict=True))
                    and self._kernel_structure() == structure)
            if not same:
                raise NotFittedError("FalkonGP: the model changed (a refit, scale_prior, new hyperparameters or data) "
                                     "after this posterior was formed; form it again (model(x)) to read its "
                                     "covariance")

        return check

    def _factors_for_posterior(self) -> Callable[[], tuple[Tensor, Tensor]]:
        """The variance factors of this fit, formed when a posterior's covariance is first used (``model(x).mean``
        alone never forms them), of the kind the settings ask for now; a refit or a data change in between makes
        that use raise rather than mix this fit's mean with another fit's covariance."""
        generation = self._fit_generation
        approximate = settings.variance_factors.value() == "approximate"

        def factors() -> tuple[Tensor, Tensor]:
            if self._fit_generation != generation:
                raise NotFittedError("FalkonGP: the model was refitted (or its data changed) after this posterior "
                                     "was formed; form it again (model(x)) to read its covariance")
            with torch.no_grad():  # constants of the fit, whatever grad mode the covariance is read in
                f = self.posterior_factors(approximate=approximate)
            return f.L, f.LB

        return factors
