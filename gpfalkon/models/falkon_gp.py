"""FalkonGP: a GPyTorch model whose posterior is Nyström KRR solved by FALKON."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import gpytorch
import torch
from gpytorch.constraints import Positive
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.kernels import Kernel, MaternKernel, ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood, Likelihood, MultitaskGaussianLikelihood
from linear_operator.operators import DiagLinearOperator, KroneckerProductLinearOperator, ZeroLinearOperator
from torch import Tensor

from .._validation import (
    check_center_weights,
    check_dtype,
    check_inputs,
    check_num_centers,
    check_penalty,
    check_targets,
)
from ..centers import leverage_centers, uniform_centers
from ..errors import NotFittedError
from ..linalg import jittered_cholesky
from ..operators import NystromKRROperator
from ..solvers import CGInfo
from .posterior import NystromPosteriorCovariance

__all__ = ["FalkonGP", "NystromPosteriorFactors"]

# keyword options FalkonGP(center_selection="leverage") passes to leverage_centers
_LEVERAGE_OPTIONS = frozenset(
    {"weighting", "oversampling", "lambda_step", "max_dictionary_size", "min_dictionary_size", "block_rows"}
)


class NystromPosteriorFactors:
    r"""Cholesky factors of the SGPR/DTC posterior, formed once in ``O(n M^2)``.

    ``L L^T = K_MM`` and ``L_B L_B^T = I + A A^T / v`` with ``A = L^{-1} K_Mn`` and
    ``v = n lambda`` (docs/math.md §4-5). ``A A^T`` is accumulated over row blocks of
    ``K_nM`` (about ``3 n M^2`` float64 flops: a triangular solve and a rank update
    per block, plus one kernel pass), so memory is ``O(M^2 + block x M)``. Then for test inputs with
    ``a = L^{-1} K_M*`` and ``c = L_B^{-1} a``:

        cov(X*) = K_** - a^T a + c^T c
                = K_** - K_*M K_MM^{-1} K_M* + n lambda K_*M H^{-1} K_M*.

    ``B = I + A A^T / v`` has eigenvalues >= 1, so this form stays accurate where
    the Woodbury form of GPyTorch's SGPR (entries ~ n / sigma^2) does not.
    """

    def __init__(self, L: Tensor, LB: Tensor) -> None:
        self.L = L
        self.LB = LB

    @classmethod
    def compute(cls, op: NystromKRROperator) -> "NystromPosteriorFactors":
        v = op.n * float(op.penalty.detach())
        L, _ = jittered_cholesky(op.kmm, upper=False, name="K_MM")
        m = op.m
        aat = torch.zeros(m, m, dtype=torch.float64, device=L.device)
        eng = op.engine
        with torch.no_grad():
            for _, _, blk in eng.iter_blocks(rows=eng.block_rows):
                kb = blk.t().to(torch.float64)
                if eng.scale != 1.0:
                    kb = kb * eng.scale
                ab = torch.linalg.solve_triangular(L, kb, upper=False)
                aat.addmm_(ab, ab.t())
        bmat = aat.div_(v)
        bmat.diagonal().add_(1.0)
        LB, _ = jittered_cholesky(bmat, upper=False, name="I + A A^T / (n lambda)", jitter=0.0)
        return cls(L, LB)


def _default_kernel(d: int) -> Kernel:
    return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))


class FalkonGP(gpytorch.models.GP):
    r"""Sparse GP / Nyström kernel ridge regression fitted by FALKON.

    Posterior (docs/math.md §4), with ``sigma^2 = n lambda`` and ``H = K_Mn K_nM + n lambda K_MM``:

        mean(X*) = K_*M alpha,              H alpha = K_Mn y   (FALKON: PCG, O(n M t) per iteration)
        cov(X*)  = K_** - K_*M K_MM^{-1} K_M* + n lambda K_*M H^{-1} K_M*

    which is exactly GPyTorch's SGPR (Titsias/DTC) posterior with inducing points
    ``centers`` and Gaussian noise ``n lambda``. ``likelihood(model(x))`` adds the
    noise. Multi-output targets ``(n, t)`` are solved jointly as ``t`` right-hand
    sides and predicted as a :class:`~gpytorch.distributions.MultitaskMultivariateNormal`.

    Base class: :class:`gpytorch.models.GP`, not ``ExactGP`` (whose eval path is
    hard-wired to the ``n x n`` solve) nor ``ApproximateGP`` (variational
    parameters we do not have). ``fit()`` solves for ``alpha``; calling the model
    in eval mode returns the posterior, in train mode the prior ``N(0, K(x, x))``.
    With BoTorch's ``GPyTorchModel`` mix-in it gets ``posterior()``.

    Costs. ``fit()``: ``(iterations + 1)`` passes over the data, each ``O(n M (d + t))``,
    plus ``O(M^3)`` for the preconditioner; memory ``O(n d + M^2)`` plus ``K_nM``
    when it fits :class:`gpfalkon.settings.memory_budget`. Mean at ``q`` points:
    ``O(q M d)``. Variance: exact, from :class:`NystromPosteriorFactors` formed once
    (lazily at the first variance request, or in ``fit(compute_variance=True)``)
    in ``O(n M^2)`` time and ``O(M^2)`` memory, then ``O(q M^2)`` per batch. The
    float32 path computes K_nM products in float32 but CG vectors, Cholesky
    factors and predictions in float64.

    Args:
        train_x: ``(n, d)`` inputs (float32 or float64).
        train_y: ``(n,)`` or ``(n, t)`` targets (same dtype). Not centred: the
            prior mean is zero, so standardise ``y`` (or use BoTorch's ``Standardize``).
        kernel: any GPyTorch kernel (default ``ScaleKernel(MaternKernel(2.5, ARD))``).
        num_centers: number of centers (default ``min(n, 1000)``): sampled
            uniformly without replacement, or — with ``center_selection="leverage"`` —
            the number of with-replacement draws (fewer distinct centers result), or
        centers: user-supplied centers ``(M, d)``.
        center_selection: ``"uniform"`` (default) or ``"leverage"``: centers drawn with
            probabilities proportional to approximate ridge leverage scores
            (:func:`~gpfalkon.centers.leverage_centers`, BLESS scores, ``O(n M_J^2)``,
            ``M_J ~ 5 d_eff``) with the preconditioner weights ``D`` of FALKON's
            appendix A (by default their unbiased form ``sqrt(M count_j / (n R p_j))``;
            ``leverage_options={"weighting": "paper"}`` gives ``1 / sqrt(n p_j count_j)``). The scores depend on ``lambda`` and on the kernel: they are
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
        generator: ``torch.Generator`` for center sampling (default seeded with ``seed``).
        max_iter, tol: CG stopping rule (see :class:`~gpfalkon.NystromKRROperator`;
            default: relative residual 1e-6 or 100 iterations, with a
            :class:`~gpfalkon.CGNotConvergedWarning` if the cap comes first). FALKON's
            own practice, a fixed 10-50 iterations, is ``max_iter=20, tol=0``: the
            test error is the same (``benchmarks/fit.py``) at a fraction of the passes.
        memory_budget, block_rows, store_kernel: kernel-engine options.
        verbose: tqdm progress bar during ``fit()``.
        predict_chunk_size: test points per chunk when predicting (bounds the
            ``chunk x M`` kernel blocks held at once).
        mean_constant: constant prior mean ``c`` (a float, or one value per output
            column; default 0), GPyTorch's ``ConstantMean`` held fixed: the fit solves
            ``H alpha = K_Mn (y - c)``, the posterior mean is ``c + K_*M alpha`` and the
            objectives see ``y - c``. Stored as the buffer ``mean_constant``.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        kernel: Optional[Kernel] = None,
        *,
        num_centers: Optional[int] = None,
        centers: Optional[Tensor] = None,
        penalty: Optional[float | Tensor] = None,
        likelihood: Optional[Likelihood] = None,
        learn_centers: bool = False,
        center_selection: str = "uniform",
        center_weights: Optional[Tensor] = None,
        leverage_options: Optional[Dict[str, Any]] = None,
        generator: Optional[torch.Generator] = None,
        seed: int = 0,
        max_iter: Optional[int] = None,
        tol: Optional[float] = None,
        memory_budget: Optional[int] = None,
        block_rows: Optional[int] = None,
        store_kernel: Optional[bool] = None,
        verbose: bool = False,
        predict_chunk_size: int = 4096,
        mean_constant: float | Tensor = 0.0,
    ) -> None:
        super().__init__()
        check_inputs("train_x", train_x)
        n, d = train_x.shape
        check_targets("train_y", train_y, n)
        if train_y.dtype != train_x.dtype:
            raise TypeError(f"train_y has dtype {train_y.dtype} but train_x has {train_x.dtype}")
        if kernel is None:
            kernel = _default_kernel(d).to(dtype=train_x.dtype, device=train_x.device)
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
        for name, p in kernel.named_parameters():
            if p.device != train_x.device:
                raise ValueError(f"kernel parameter {name} is on {p.device} but train_x is on {train_x.device}")
        self.kernel = kernel
        self.train_inputs: Tuple[Tensor, ...] = (train_x,)
        self.train_targets: Tensor = train_y
        self._num_outputs = 1 if train_y.dim() == 1 else int(train_y.shape[1])

        # --- centers
        if not isinstance(center_selection, str) or center_selection not in ("uniform", "leverage"):
            raise ValueError(f"center_selection must be 'uniform' or 'leverage', got {center_selection!r}")
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
                f"center_selection={center_selection!r} samples the centers: do not also pass centers= "
                "(pass center_weights= with your own centers instead)"
            )
        if center_weights is not None and centers is None:
            raise ValueError("center_weights= needs centers= (the weights belong to given centers)")
        weights: Optional[Tensor] = None
        leverage_m: Optional[int] = None
        if centers is not None:
            check_dtype("centers", centers)
            if centers.dtype != train_x.dtype:
                raise TypeError(f"centers has dtype {centers.dtype} but train_x has {train_x.dtype}")
            if centers.device != train_x.device:
                raise ValueError(f"centers is on {centers.device} but train_x is on {train_x.device}")
            check_inputs("centers", centers, d=d)
            c = centers.detach().clone()
            if center_weights is not None:
                check_center_weights("center_weights", center_weights, c.shape[0], train_x.device)
                weights = center_weights.detach().to(torch.float64).clone()
        else:
            m = min(n, 1000) if num_centers is None else num_centers
            m = check_num_centers(m, n)
            if generator is None:
                generator = torch.Generator()
                generator.manual_seed(int(seed))
            if center_selection == "leverage":
                leverage_m = m  # drawn below, once the penalty is known
                c = None
            else:
                c = uniform_centers(train_x, m, generator).centers
        if c is not None:
            self._register_centers(c, learn_centers)
            if weights is not None and weights.shape != (c.shape[0],):
                raise ValueError(f"center_weights must have shape ({c.shape[0]},), got {tuple(weights.shape)}")

        # --- likelihood and penalty (noise = n * penalty is the single source of truth)
        if likelihood is None:
            constraint = Positive(transform=torch.exp, inv_transform=torch.log)
            if self._num_outputs == 1:
                likelihood = GaussianLikelihood(noise_constraint=constraint)
            else:
                likelihood = MultitaskGaussianLikelihood(
                    num_tasks=self._num_outputs, rank=0, has_task_noise=False, noise_constraint=constraint
                )
            likelihood = likelihood.to(dtype=train_x.dtype, device=train_x.device)
            if penalty is None:
                penalty = 1e-6
        else:
            if not isinstance(likelihood, (GaussianLikelihood, MultitaskGaussianLikelihood)):
                raise TypeError(
                    "likelihood must be a GaussianLikelihood or MultitaskGaussianLikelihood, got "
                    f"{type(likelihood).__name__}"
                )
            if self._num_outputs == 1 and not isinstance(likelihood, GaussianLikelihood):
                raise TypeError("likelihood: single-output targets need a GaussianLikelihood")
            if self._num_outputs > 1:
                if not isinstance(likelihood, MultitaskGaussianLikelihood):
                    raise TypeError(
                        f"likelihood: targets with {self._num_outputs} outputs need a MultitaskGaussianLikelihood"
                    )
                if likelihood.num_tasks != self._num_outputs:
                    raise ValueError(
                        f"likelihood has num_tasks={likelihood.num_tasks} but train_y has {self._num_outputs} outputs"
                    )
                if getattr(likelihood, "has_task_noise", False) or not getattr(likelihood, "has_global_noise", True):
                    raise ValueError("likelihood: FALKON needs one shared noise (has_global_noise=True, has_task_noise=False)")
            if likelihood.noise.numel() != 1:
                raise ValueError(f"likelihood must have one (scalar) noise, got shape {tuple(likelihood.noise.shape)}")
        self.likelihood = likelihood
        if penalty is not None:
            self.penalty = penalty  # type: ignore[assignment]
        if leverage_m is not None:
            # leverage scores at the initial lambda and kernel hyperparameters (computed once)
            sel = leverage_centers(
                train_x, leverage_m, kernel, self.penalty.detach(), generator=generator, **(leverage_options or {})
            )
            c, weights = sel.centers, sel.weights
            self._register_centers(c, learn_centers)
        self.register_buffer("center_weights", None if weights is None else weights.to(torch.float64))

        self.max_iter = max_iter
        self.tol = tol
        self.memory_budget = memory_budget
        self.block_rows = block_rows
        self.store_kernel = store_kernel
        self.verbose = verbose
        self.predict_chunk_size = int(predict_chunk_size)
        if self.predict_chunk_size < 1:
            raise ValueError(f"predict_chunk_size must be >= 1, got {predict_chunk_size}")

        try:
            mc = torch.as_tensor(mean_constant, dtype=torch.float64).detach().clone().to(train_x.device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"mean_constant must be a number or a tensor, got {type(mean_constant).__name__}") from exc
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
        self.register_buffer("mean_constant", mc)

        shape = (c.shape[0],) if self._num_outputs == 1 else (c.shape[0], self._num_outputs)
        self.register_buffer("alpha", torch.full(shape, float("nan"), dtype=torch.float64, device=train_x.device))
        self.register_buffer("fitted", torch.tensor(False, device=train_x.device))
        # value fingerprint of the training data alpha was fitted on (persists in state_dict)
        self.register_buffer("data_fingerprint", torch.zeros(6, dtype=torch.float64, device=train_x.device))
        self.fit_info: Optional[CGInfo] = None
        self._snapshot: Optional[List[Tensor]] = None
        self._fitted_data_key: Optional[tuple] = None
        self._factors: Optional[NystromPosteriorFactors] = None
        self.register_load_state_dict_post_hook(FalkonGP._after_load)

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
    def n(self) -> int:
        return self.train_inputs[0].shape[0]

    @property
    def noise(self) -> Tensor:
        """The likelihood's noise ``sigma^2 = n lambda`` (a scalar tensor)."""
        return self.likelihood.noise.reshape(-1)[0]

    @property
    def penalty(self) -> Tensor:
        """``lambda = sigma^2 / n`` (positive scalar tensor, differentiable)."""
        return self.noise / self.n

    @penalty.setter
    def penalty(self, value: float | Tensor) -> None:
        check_penalty(value)
        noise = torch.as_tensor(value, dtype=torch.float64).reshape(()) * self.n
        try:
            self.likelihood.noise = noise.to(self.likelihood.raw_noise.dtype)
        except RuntimeError as exc:  # the likelihood's constraint cannot hold it
            raise ValueError(f"penalty={float(value):g} (noise {float(noise):g}) violates the likelihood's noise constraint: {exc}") from exc

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
    def nystrom_operator(self, **overrides) -> NystromKRROperator:
        """The :class:`~gpfalkon.NystromKRROperator` at the current hyperparameters."""
        kw = dict(
            kernel=self.kernel,
            weights=self.center_weights,
            memory_budget=self.memory_budget,
            block_rows=self.block_rows,
            store_kernel=self.store_kernel,
            max_iter=self.max_iter,
            tol=self.tol,
            verbose=self.verbose,
        )
        kw.update(overrides)
        return NystromKRROperator(self.train_inputs[0], self.centers, self.penalty, **kw)

    def fit(
        self,
        *,
        warm_start: bool = False,
        compute_variance: bool = False,
        callback: Optional[Callable[[int, Tensor, Tensor], None]] = None,
        tol: Optional[float] = None,
        max_iter: Optional[int] = None,
        verbose: Optional[bool] = None,
    ) -> "FalkonGP":
        """Solve ``H alpha = K_Mn y`` by FALKON and store ``alpha``; returns ``self``.

        ``warm_start`` starts CG from the previous ``alpha`` (one more data pass,
        usually far fewer iterations after a small hyperparameter change).
        ``compute_variance`` also forms the posterior factors now, sharing a stored
        ``K_nM``. Convergence information lands in ``self.fit_info``.
        """
        y2 = self.centered_targets()
        with torch.no_grad():
            op = self.nystrom_operator()
            rhs = op.kmn_y(y2)
            x0 = None
            if warm_start and bool(self.fitted):
                x0 = self.alpha.reshape(op.m, -1).to(torch.float64)
            alpha, info = op.falkon_solve(rhs, x0, tol=tol, max_iter=max_iter, callback=callback, verbose=verbose)
            self.alpha = alpha.reshape(self.alpha.shape).to(torch.float64)
            self.fit_info = info
            self._mark_fitted()
            self._factors = NystromPosteriorFactors.compute(op) if compute_variance else None
            op.engine.release()
        return self

    # ------------------------------------------------ is the fit still valid?
    def _hyper_snapshot(self) -> List[Tensor]:
        """Values of everything alpha depends on except the data (kernel, centers, noise)."""
        tensors = [p.detach().clone() for p in self.kernel.parameters()]
        tensors += [b.detach().clone() for b in self.kernel.buffers()]
        tensors.append(self.centers.detach().clone())
        tensors.append(self.likelihood.raw_noise.detach().clone())
        tensors.append(self.mean_constant.detach().clone())
        return tensors

    def _data_key(self) -> tuple:
        """Cheap identity of the training tensors: storage, in-place version, shape."""
        return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in (self.train_inputs[0], self.train_targets))

    def _data_fingerprint(self) -> Tensor:
        """Value fingerprint of the training data, ``O(n d)``: sizes, sums and norms in float64."""
        x, y = self.train_inputs[0].detach(), self.train_targets.detach()
        vals = [
            float(x.shape[0]),
            float(x.shape[1]),
            float(x.sum(dtype=torch.float64)),
            float(torch.linalg.vector_norm(x, dtype=torch.float64)),
            float(y.sum(dtype=torch.float64)),
            float(torch.linalg.vector_norm(y, dtype=torch.float64)),
        ]
        return torch.tensor(vals, dtype=torch.float64, device=self.data_fingerprint.device)

    def _mark_fitted(self) -> None:
        self.fitted.fill_(True)
        self.data_fingerprint = self._data_fingerprint()
        self._snapshot = self._hyper_snapshot()
        self._fitted_data_key = self._data_key()

    def _data_changed(self) -> bool:
        if getattr(self, "_fitted_data_key", None) == self._data_key():
            return False
        # new tensors (a copy, pickle, .to()) or modified in place: compare values
        same = torch.allclose(self._data_fingerprint(), self.data_fingerprint.to(torch.float64), rtol=1e-12, atol=0.0)
        if same:
            self._fitted_data_key = self._data_key()
        return not same

    def _hyper_changed(self) -> bool:
        if self._snapshot is None:
            return True
        now = self._hyper_snapshot()
        if len(now) != len(self._snapshot) or any(
            a.shape != b.shape or not torch.equal(a, b.to(device=a.device, dtype=a.dtype))
            for a, b in zip(now, self._snapshot)
        ):
            return True
        return self._data_changed()

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # .to(device / dtype), .double(), .cuda() ... move the training data too (as
        # ExactGP does); a fit that was valid stays valid; alpha and the fingerprint
        # stay float64 (predictions are computed in float64).
        was_valid = bool(self.fitted) and not self._hyper_changed()
        weights = self.center_weights  # kept in float64: a float32 round trip would round them
        mean_c = self.mean_constant  # likewise
        super()._apply(fn, *args, **kwargs)
        self.train_inputs = tuple(fn(t) for t in self.train_inputs)
        self.train_targets = fn(self.train_targets)
        self.alpha = self.alpha.to(torch.float64)
        self.mean_constant = mean_c.to(device=self.alpha.device, dtype=torch.float64)
        self.data_fingerprint = self.data_fingerprint.to(torch.float64)
        if weights is not None:
            self.center_weights = weights.to(device=self.centers.device, dtype=torch.float64)
        self._factors = None
        if was_valid:
            self._mark_fitted()
        else:
            self._snapshot = None
        return self

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
        m_key = prefix + "mean_constant"
        # a full model state dict (it has alpha) without the constant predates it: zero mean; a partial
        # dict (strict=False, e.g. only kernel hyperparameters) leaves the current constant alone
        had_mean = m_key in state_dict or a_key not in state_dict
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not had_mean:  # state dicts saved before the constant mean existed: zero mean
            self.mean_constant.zero_()
            if m_key in missing_keys:
                missing_keys.remove(m_key)

    @staticmethod
    def _after_load(module: "FalkonGP", incompatible_keys) -> None:
        module._factors = None
        module._snapshot = None
        module._fitted_data_key = None
        if not bool(module.fitted):
            return
        module._snapshot = module._hyper_snapshot()
        if module._data_changed():
            module.fitted.fill_(False)
            module._snapshot = None
            warnings.warn(
                "FalkonGP.load_state_dict: the loaded alpha was fitted on different training data than this "
                "model holds; the model is marked unfitted (call fit())",
                RuntimeWarning,
                stacklevel=2,
            )

    def set_train_data(self, inputs: Tensor, targets: Tensor) -> None:
        """Replace the training data (centers unchanged); the model must be re-fitted.

        Preconditioner weights ``D`` (leverage centers) are rescaled by
        ``sqrt(n_old / n_new)``: ``D^2`` holds the factor ``1 / n`` of the importance
        weights ``count_j / (n p_j)``, the probabilities ``p_j`` being kept as they were.
        """
        check_inputs("inputs", inputs, d=self.train_inputs[0].shape[1])
        check_targets("targets", targets, inputs.shape[0])
        if inputs.dtype != self.train_inputs[0].dtype or targets.dtype != inputs.dtype:
            raise TypeError(
                f"inputs ({inputs.dtype}) and targets ({targets.dtype}) must have the model's dtype "
                f"{self.train_inputs[0].dtype}"
            )
        if inputs.device != self.centers.device or targets.device != inputs.device:
            raise ValueError(f"inputs and targets must be on {self.centers.device}")
        if targets.dim() != self.train_targets.dim() or (targets.dim() == 2 and targets.shape[1] != self._num_outputs):
            raise ValueError(f"targets must keep the shape convention of train_y ({tuple(self.train_targets.shape[1:])})")
        pen = self.penalty.detach().clone()
        if self.center_weights is not None:
            self.center_weights = self.center_weights * math.sqrt(self.n / inputs.shape[0])
        self.train_inputs = (inputs,)
        self.train_targets = targets
        self.penalty = pen  # keep lambda: the noise n * lambda follows n
        self.fitted.fill_(False)
        self._snapshot = None
        self._factors = None

    # ------------------------------------------------------------- prediction
    def _check_fitted(self) -> None:
        if not bool(self.fitted):
            raise NotFittedError("FalkonGP: call fit() before predicting")
        if self._hyper_changed():
            raise NotFittedError(
                "FalkonGP: the kernel hyperparameters, centers, penalty or training data changed since "
                "fit(); call fit() again"
            )

    def posterior_factors(self) -> NystromPosteriorFactors:
        """The variance factors (formed on first use, ``O(n M^2)``)."""
        self._check_fitted()
        if self._factors is None:
            op = self.nystrom_operator(store_kernel=False)  # one pass: storing K_nM would not pay
            self._factors = NystromPosteriorFactors.compute(op)
            op.engine.release()
        return self._factors

    def _check_test_inputs(self, x: Tensor) -> None:
        check_dtype("x", x)
        d = self.train_inputs[0].shape[1]
        if x.dim() < 2 or x.shape[-1] != d:
            raise ValueError(f"x must have shape (..., q, {d}), got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf values")

    def __call__(self, x: Tensor, **kwargs) -> MultivariateNormal:  # type: ignore[override]
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        self._check_test_inputs(x)
        if self.training:
            return self._prior(x)
        return self._posterior(x)

    def forward(self, x: Tensor) -> MultivariateNormal:
        return self(x)

    def _prior(self, x: Tensor) -> MultivariateNormal:
        covar = self.kernel(x)
        mc = self.mean_constant.to(dtype=x.dtype, device=x.device)
        if self._num_outputs == 1:
            return MultivariateNormal(mc.expand(x.shape[:-1]).clone(), covar)
        t = self._num_outputs
        eye_t = DiagLinearOperator(torch.ones(*x.shape[:-2], t, dtype=x.dtype, device=x.device))
        mean = mc.expand(*x.shape[:-1], t).clone()
        return MultitaskMultivariateNormal(mean, KroneckerProductLinearOperator(covar, eye_t), interleaved=True)

    def _posterior(self, x: Tensor) -> MultivariateNormal:
        self._check_fitted()
        out_dtype = x.dtype
        c64 = self.centers.detach().to(torch.float64)
        alpha = self.alpha.to(torch.float64)
        a2 = alpha.unsqueeze(-1) if alpha.dim() == 1 else alpha
        q = x.shape[-2]
        # mean = K_*M alpha in chunks of test points: never a (q x M) block beyond a chunk
        chunks = []
        for s in range(0, q, self.predict_chunk_size):
            xs = x[..., s : s + self.predict_chunk_size, :].to(torch.float64)
            chunks.append(self.kernel(xs, c64).to_dense() @ a2)
        mean = (torch.cat(chunks, -2) + self.mean_constant.to(torch.float64).reshape(-1)).to(out_dtype)  # (..., q, t)
        if gpytorch.settings.skip_posterior_variances.on():
            covar = ZeroLinearOperator(*x.shape[:-1], q, dtype=out_dtype, device=x.device)
        else:
            f = self.posterior_factors()
            covar = NystromPosteriorCovariance(
                x, self.centers.detach(), f.L, f.LB, kernel=self.kernel, chunk_size=self.predict_chunk_size
            )
        if self._num_outputs == 1:
            return MultivariateNormal(mean.squeeze(-1), covar)
        # t outputs share one covariance: cov = C (x) I_t in the interleaved (point, task)
        # order, so the variances cost one C.diagonal() whatever t is
        t = self._num_outputs
        eye_t = DiagLinearOperator(torch.ones(*x.shape[:-2], t, dtype=out_dtype, device=x.device))
        return MultitaskMultivariateNormal(mean, KroneckerProductLinearOperator(covar, eye_t), interleaved=True)
