"""The Nyström kernel ridge regression system as a linear operator."""
from __future__ import annotations

import contextlib
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
from gpytorch.kernels import Kernel
from linear_operator import settings as lo_settings
from linear_operator.operators import DenseLinearOperator, LinearOperator
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import settings
from .._validation import check_dtype, check_inputs, check_penalty
from .._warn import warn_caller
from ..backend.autograd import backward_params, blockwise_kernel_grad, kernel_params, kernel_product, scatter_grads
from ..backend.blocks import resolve_store_dtype
from ..backend.engine import KernelEngine, kernel_block
from ..backend.passes import is_sharded, needs_graph, total_rows
from ..backend.sources import rows_as
from ..errors import FalkonConvergenceError, JitterWarning
from ..options import FalkonOptions, option_property
from ..solvers import CGInfo, Preconditioner, PreconditionerBuilder, Solver, choose_method, falkon_solve
from ..solvers.direct import direct_solve_whitened, whitened_factor
from .penalty_path import PenaltyPathPreconditioner
from .preconditioner import FalkonPreconditioner, engine_memory_budget

__all__ = ["FIXED_POINT_EPS", "FLOAT32_QUIET", "FLOAT32_TOL", "HGrads", "NystromKRROperator"]

#: the default CG tolerance for data in a dtype narrower than float64, when no tolerance is given
#: (per call, in the options, or by a setting): what float32 kernel products reach on common data
#: (``benchmarks/results/float32-tol.md``), and where test error has stopped changing
#: (``benchmarks/results/auto-notes.md``); a given tolerance is always used as is
FLOAT32_TOL = 1e-4
#: a float32 default-tolerance solve that stalls, or reaches max_iter, at a relative residual up to
#: this ends without a warning (``fit_info.extra["stagnated"]``): on protein the test RMSE matched
#: float64's to 4 digits at floors up to 2.9e-3, within 1 % at 1.2e-2 and to 0.04 % at 3.3e-2, and was 2.8 % worse
#: at 3.7e-2 (``benchmarks/results/float32-tol.md``); on other sets less was enough to lose 2 % (cadata 2.1 % at
#: 1.8e-2, keggdirected 6.3 % at 2.2e-2, both at lambda 1e-8), so the floor sits below those
FLOAT32_QUIET = 1.5e-2
#: the resolution of a ``K_nM`` stored in 16-bit fixed point, relative to its row's largest value (the ``eps`` of
#: the preconditioner's jitter where such a store is in use)
FIXED_POINT_EPS = 2.0**-15


class HGrads(NamedTuple):
    """Gradients returned by :meth:`NystromKRROperator.surrogate_grads` (``None``: not requested)."""

    x: Tensor | None
    centers: Tensor | None
    penalty: Tensor | None
    params: list[Tensor | None]


def _as_columns(rhs: Tensor, m: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """Reshape ``(M,)`` or ``(..., M, k)`` to ``(M, K)`` and return the inverse map."""
    if rhs.dim() == 1:
        return rhs.unsqueeze(-1), lambda out: out.squeeze(-1)
    if rhs.dim() == 2:
        return rhs, lambda out: out
    batch = rhs.shape[:-2]
    k = rhs.shape[-1]
    cols = rhs.movedim(-2, 0).reshape(m, -1)

    def back(out: Tensor) -> Tensor:
        return out.reshape(m, *batch, k).movedim(0, -2)

    return cols, back


class NystromKRROperator(LinearOperator):
    r"""``H = K_Mn K_nM + n lambda K_MM`` (M x M), the Nyström KRR normal-equations matrix.

    ``H alpha = K_Mn y`` gives the Nyström KRR coefficients (docs/math.md §2); with
    ``sigma^2 = n lambda`` it is the SGPR/DTC posterior mean's system (docs/math.md §4).

    * ``H @ u`` (``_matmul``): one pass of the :class:`~gpfalkon.kernels.KernelEngine`
      (``2 n M d + 4 n M k`` flops, or ``4 n M k`` when ``K_nM`` is stored), plus
      ``O(M^2 k)`` for the penalty term; differentiable w.r.t. ``u``, the inputs,
      the centers, the penalty and the kernel's parameters (one more pass; with
      autograd on, ``K_MM`` is re-evaluated through GPyTorch, ``O(M^2 d)``, per call).
    * ``solve`` (``torch.linalg.solve(H, b)``): FALKON — CG on ``B^T H B`` with the
      :class:`FalkonPreconditioner` ``B`` — never a dense factorisation of ``H``,
      whatever ``linear_operator.settings.max_cholesky_size`` says. Its backward is
      implicit differentiation: one more FALKON solve and one blockwise pass.
    * :meth:`falkon_solve` returns the solution with a :class:`~gpfalkon.solvers.CGInfo`
      (iterations, residual history) and accepts a warm start and a callback.
    * Injectable parts: ``solver`` (a :class:`~gpfalkon.solvers.Solver`, default
      :func:`~gpfalkon.solvers.falkon_solve`) and ``preconditioner`` (a
      :class:`~gpfalkon.solvers.PreconditionerBuilder`, default
      :meth:`FalkonPreconditioner.from_kernel_matrix`), rebuilt like ``K_MM`` when the
      hyperparameters change.

    The operator's tensors are ``(x, centers, penalty)``; ``kernel`` is a keyword.
    The engine (with a stored ``K_nM``), ``K_MM`` and the preconditioner are built on
    first use and cached; they are rebuilt automatically when x, the centers, the
    penalty or a kernel parameter changes (storage or in-place version counter).
    Note that ``.to(dtype)`` on the operator, as in linear_operator, also converts
    the (shared) kernel module.

    Options: ``options`` (a :class:`~gpfalkon.FalkonOptions`) or the equivalent keyword
    arguments (``memory_budget``, ``block_rows``, ``store_kernel``, ``max_iter``, ``tol``,
    ``verbose``, ``precond_dtype``, ``solver``, ``preconditioner``, ``backend``), which build it.
    Stopping rule: ``tol`` (relative residual of the preconditioned system) and
    ``max_iter`` given here win; otherwise ``linear_operator.settings.cg_tolerance``
    when set below its default of 1 and ``linear_operator.settings.max_cg_iterations``
    when set below its default of 1000; otherwise :mod:`gpfalkon.settings`
    (:meth:`FalkonOptions.resolved`).
    """

    def __init__(
        self,
        x: Tensor,
        centers: Tensor,
        penalty: Tensor,
        *,
        kernel: Kernel,
        weights: Tensor | None = None,
        memory_budget: int | None = None,
        block_rows: int | None = None,
        store_kernel: bool | None = None,
        max_iter: int | None = None,
        tol: float | None = None,
        verbose: bool = False,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        precond_dtype: torch.dtype | None = torch.float64,
        solver: Solver | None = None,
        preconditioner: PreconditionerBuilder | None = None,
        backend: Callable[..., KernelEngine] | None = None,
        options: FalkonOptions | None = None,
    ) -> None:
        sharded = is_sharded(backend if backend is not None else getattr(options, "backend", None))
        check_inputs("x", x, allow_empty=sharded)
        check_dtype("centers", centers)
        if centers.dim() != 2 or centers.shape[0] == 0:
            raise ValueError(f"centers must have shape (M, d) with M >= 1, got {tuple(centers.shape)}")
        check_inputs("centers", centers, d=x.shape[1])
        if centers.dtype != x.dtype or centers.device != x.device:
            raise TypeError(
                f"centers ({centers.dtype}, {centers.device}) must have the dtype and device of x "
                f"({x.dtype}, {x.device})"
            )
        if not isinstance(penalty, Tensor):
            penalty = torch.tensor(float(penalty), dtype=x.dtype, device=x.device)
        check_penalty(penalty.detach())  # detached: no 'float() of a tensor requiring grad' warning
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
        options = FalkonOptions.merged(
            options,
            memory_budget=memory_budget,
            block_rows=block_rows,
            store_kernel=store_kernel,
            max_iter=max_iter,
            tol=tol,
            verbose=verbose,
            precond_dtype=precond_dtype,
            solver=solver,
            preconditioner=preconditioner,
            backend=backend,
        )
        super().__init__(x, centers, penalty, kernel=kernel, weights=weights, options=options, callback=callback)
        self.x = x
        self.centers = centers
        self.penalty = penalty
        self.kernel = kernel
        self.weights = weights
        self.options = options
        self.callback = callback
        self.solver: Solver = falkon_solve if options.solver is None else options.solver
        self.preconditioner_builder: PreconditionerBuilder = (
            FalkonPreconditioner.from_kernel_matrix if options.preconditioner is None else options.preconditioner
        )
        # the global n (a collective for a sharded backend: every rank builds the operator)
        self._n_total = total_rows(options.backend, x)
        if self._n_total == 0:
            raise ValueError("x is empty (0 rows) on every rank")
        self._engine: KernelEngine | None = None
        self._kmm: Tensor | None = None
        self._precond: Preconditioner | None = None
        self._split_w: bool | None = None  # whether _precond's w_matmul stands for H (checked once per build)
        # multiplier of the preconditioner's jitter, raised after a CG breakdown (kept)
        self._jitter_boost = 1.0
        self._cache_key: tuple | None = None
        self.last_info: CGInfo | None = None

    # ------------------------------------------------------------ components
    memory_budget = option_property("memory_budget")
    block_rows = option_property("block_rows")
    store_kernel = option_property("store_kernel")
    max_iter = option_property("max_iter")
    tol = option_property("tol")
    verbose = option_property("verbose")
    precond_dtype = option_property("precond_dtype")
    solve_method = option_property("solve_method")

    @property
    def n(self) -> int:
        """The number of rows ``n`` of ``n lambda`` (all shards' rows for a sharded backend)."""
        return self._n_total

    @property
    def m(self) -> int:
        return self.centers.shape[0]

    def _state_key(self) -> tuple:
        # x by identity (storage + in-place version: O(1)); the small tensors by value,
        # because GPyTorch's setters write through .data, which bumps no version
        small = [self.centers, self.penalty, *self.kernel.parameters(), *self.kernel.buffers()]
        return ((self.x.data_ptr(), self.x._version), tuple(t.detach().clone() for t in small))

    def _key_matches(self, key: tuple) -> bool:
        old = self._cache_key
        if old is None or old[0] != key[0] or len(old[1]) != len(key[1]):
            return False
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(old[1], key[1], strict=False))

    def _refresh(self) -> None:
        """Drop the engine, ``K_MM`` and the preconditioner if x, the centers, the
        penalty or any kernel parameter changed since they were built, so a reused
        operator never solves a stale system (cost: comparing the small tensors)."""
        key = self._state_key()
        if not self._key_matches(key):
            if self._engine is not None:
                self._engine.release()
            self._engine = self._kmm = self._precond = self._split_w = None
            self._direct_gram: tuple[Tensor, Tensor] | None = None  # (L, A A^T) of the last direct solve
            self._cache_key = key

    @property
    def engine(self) -> KernelEngine:
        """The kernel-product engine (built on first use; may store ``K_nM``, in the dtype
        :class:`gpfalkon.settings.store_dtype` gives when it is built: an engine whose store has another
        dtype than the setting in force now is rebuilt)."""
        self._refresh()
        if self._engine is not None and getattr(self._engine, "store_dtype", None) not in (
                None, resolve_store_dtype(self.x.dtype)):
            self._engine.release()
            self._engine = None
        if self._engine is None:
            build = KernelEngine if self.options.backend is None else self.options.backend
            # the automatic budget leaves the preconditioner's M x M matrices free on the same device (at
            # M = 50,000 they are 56 GiB: beside a 16 GiB store they would not fit an 80 GB GPU); not where
            # the whole K_nM is asked to be stored (store_kernel=True), which the budget then must hold
            budget = engine_memory_budget(self.m, self.centers.device, self.memory_budget,
                                          store_kernel=self.store_kernel)
            self._engine = build(
                self.kernel,
                self.x,
                self.centers,
                memory_budget=budget,
                block_rows=self.block_rows,
                store=self.store_kernel,
            )
        return self._engine

    def float64_engine(self) -> KernelEngine:
        """An engine whose kernel values are float64, for passes that need more than the data's precision: the
        posterior factors' ``L^{-1} K_Mn`` (docs/math.md §4) multiplies the rounding of float32 kernel values by
        up to ``||L^{-1}||``, which for a numerically singular ``K_MM`` makes a float32 model's variances tens of
        percent off (``tests/test_model.py``). :attr:`engine` itself for float64 data; otherwise a new engine,
        built as :attr:`engine` is (same backend: a sharded one still sums over the ranks), over the rows read
        in float64 block by block (:func:`~gpfalkon.backend.sources.rows_as`: no float64 copy of ``x``) with
        nothing stored: each pass recomputes its blocks in float64 (``2 n M d`` float64 flops and ``n M``
        exponentials, beside the ``2 n M^2`` of a gram pass). The caller releases it."""
        if self.x.dtype == torch.float64:
            return self.engine
        build = KernelEngine if self.options.backend is None else self.options.backend
        budget = engine_memory_budget(self.m, self.centers.device, self.memory_budget, store_kernel=False)
        rows = cast(Tensor, rows_as(self.x, torch.float64))  # a row source stands in for a tensor, as self.x does
        return build(self.kernel, rows, self.centers.to(torch.float64),
                     memory_budget=budget, block_rows=self.block_rows, store=False)

    @contextlib.contextmanager
    def _float64_passes(self) -> Iterator[KernelEngine]:
        """:meth:`float64_engine` for the passes inside the ``with`` block, released after them (where it is not
        :attr:`engine` itself)."""
        engine = self.float64_engine()
        try:
            yield engine
        finally:
            if engine is not self.engine:
                engine.release()

    @property
    def kmm(self) -> Tensor:
        """``K_MM`` in float64 (no gradient)."""
        self._refresh()
        if self._kmm is None:
            self._kmm = self.engine.kmm(torch.float64)
        return self._kmm

    @property
    def preconditioner(self) -> Preconditioner:
        """The preconditioner at the current hyperparameters (cached; by default a
        :class:`FalkonPreconditioner`, else what the ``preconditioner`` builder returns)."""
        self._refresh()
        if self._precond is None:
            precond = self.preconditioner_builder(
                self.kmm, self.penalty.detach(), self.n, weights=self.weights, dtype=self.precond_dtype,
                jitter=self._precond_jitter(),
            )
            if not isinstance(precond, Preconditioner):
                raise TypeError(
                    f"the preconditioner builder returned {type(precond).__name__}, which lacks "
                    "apply_b / apply_bt / apply_b_inv (gpfalkon.solvers.Preconditioner)"
                )
            self._precond = precond
            self._split_w = None
        return self._precond

    def _split_w_ok(self, precond: Preconditioner) -> bool:
        """Whether CG may apply ``W = B^T H B`` by ``precond.w_matmul`` (``K_MM`` through the
        preconditioner's factor; :meth:`FalkonPreconditioner.w_matmul`): only for a preconditioner
        whose float64 factor reproduces this operator's ``K_MM``
        (:meth:`FalkonPreconditioner.reproduces`, once per build), and while
        ``gpfalkon.settings.kmm_through_factor`` is on."""
        if not settings.kmm_through_factor.value():
            return False
        if self._split_w is None:
            check = getattr(precond, "reproduces", None)
            self._split_w = bool(callable(check) and callable(getattr(precond, "w_matmul", None))
                                 and check(self.kmm))
        return self._split_w

    def _precond_jitter(self, direct: bool = False) -> float | None:
        """FALKON's ``eps M`` jitter with ``eps`` the machine epsilon of the *data* dtype.

        When ``K_nM`` products are computed in float32, ``H`` is only known to about
        ``eps_32 ||K||`` per entry; a preconditioner that resolves eigenvalues of
        ``K_MM`` below that level amplifies the rounding noise until CG breaks down
        (seen on abalone: ``p^T W p < 0``). Jittering ``T`` at ``eps_32 M mean(diag K_MM)``
        (the paper's choice, ``eps`` of the working precision) keeps ``B^T H B`` well
        conditioned; the solution is that of ``H`` itself (``K_MM`` enters ``H`` exactly).
        float64 data keeps the float64 jitter of :func:`~gpfalkon.linalg.jittered_cholesky`. A ``K_nM`` stored in
        16-bit fixed point (:class:`gpfalkon.settings.store_format` ``"int16"``) resolves ``2^-15`` of a row's
        largest value, whatever the data dtype: CG's preconditioner jitters at least ``2^-15 mean(diag K_MM)`` then
        (with float64's jitter, float64 data with an int16 store made CG return a model no better than predicting
        zero). ``direct``: the
        jitter of the direct solve, where it is part of the system solved (docs/math.md §3.2a), so the data
        dtype's (an int16 store's ``eps`` there regularised a float64 fit's mean to 2.4x its error).
        """
        dtype = self.x.dtype
        fixed = not direct and self._fixed_store()
        if dtype == torch.float64 and self._jitter_boost == 1.0 and not fixed:
            return None
        kmm = self.kmm
        scale = float(kmm.diagonal().abs().mean())
        if not scale > 0:
            scale = 1.0
        # (the store's floor is not multiplied by M: 2^-15 M mean(diag) weakened the preconditioner of the
        # reference problem until 20 iterations left its test error 10 % above the float store's)
        relative = max(float(torch.finfo(dtype).eps) * kmm.shape[-1], FIXED_POINT_EPS if fixed else 0.0)
        return relative * scale * self._jitter_boost

    def _fixed_store(self) -> bool:
        """Do the products read a ``K_nM`` stored in 16-bit fixed point (on any rank: with a sharded backend every
        rank must take the same preconditioner, so a rank storing no rows, e.g. an empty shard, follows the
        others; one all_reduce of one number)?"""
        eng = self.engine
        return self._on_some_rank(bool(getattr(eng, "fixed", False)) and int(getattr(eng, "stored_rows", 0)) > 0)

    def _on_some_rank(self, local: bool) -> bool:
        """``local`` on this process, or on any rank for a sharded backend (one all_reduce of one number, so that
        every rank takes the same decision)."""
        reduce = getattr(self.engine, "reduce_nograd", None)
        if is_sharded(self.options.backend) and callable(reduce):
            flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float64, device=self.centers.device)
            return float(reduce(flag)[0]) > 0.0
        return local

    def _stopping_rule(self, tol: float | None, max_iter: int | None) -> tuple[float, int]:
        """Per-call ``tol`` / ``max_iter`` win over the options, resolved against the settings now."""
        opts = self.options
        if tol is not None or max_iter is not None:
            opts = opts.replace(
                **({} if tol is None else {"tol": tol}), **({} if max_iter is None else {"max_iter": max_iter})
            )
        r = opts.resolved()
        return r.tol, r.max_iter

    def h_matmul_nograd(self, u: Tensor) -> Tensor:
        """``H u`` in float64 for float64 ``u`` ``(M, k)``: one engine pass, no autograd."""
        lam = float(self.penalty.detach())
        out = self.engine.kmn_k(u)
        return out.add_(self.kmm @ u.to(torch.float64), alpha=self.n * lam)

    def kmn_y(self, y: Tensor) -> Tensor:
        """``K_Mn y`` (float64, ``(M, t)``) for targets ``y`` ``(n, t)`` or ``(n,)`` (then ``t = 1``): one pass.

        Differentiable w.r.t. ``y``, the inputs, the centers and the kernel's parameters where grad mode is on and
        one of them requires a gradient (:func:`~gpfalkon.backend.autograd.kernel_product`, whose backward is one
        more pass), so ``torch.linalg.solve(H, H.kmn_y(y))`` differentiates both sides of ``H alpha = K_Mn y``."""
        if not isinstance(y, Tensor) or y.dim() not in (1, 2) or y.shape[0] != self.x.shape[0]:
            raise ValueError(f"y must have shape ({self.x.shape[0]},) or ({self.x.shape[0]}, t), got "
                             f"{tuple(getattr(y, 'shape', ()))}")
        cols = y.unsqueeze(-1) if y.dim() == 1 else y
        if needs_graph(self.kernel, cols, self.centers, *([self.x] if isinstance(self.x, Tensor) else [])):
            # (a sharded engine sums the ranks' products by a differentiable collective)
            return kernel_product(self.engine, None, cols.to(self.x.dtype), self.x, self.centers).to(torch.float64)
        return self.engine.kmn_k(None, cols)

    def falkon_solve(
        self,
        rhs: Tensor,
        x0: Tensor | None = None,
        *,
        tol: float | None = None,
        max_iter: int | None = None,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        verbose: bool | None = None,
        warn: bool = True,
        time_limit: float | None = None,
    ) -> tuple[Tensor, CGInfo]:
        """FALKON solve of ``H alpha = rhs`` (``rhs`` ``(M, k)``), no autograd.

        Returns ``(alpha, info)`` with ``alpha`` in float64. See
        :func:`gpfalkon.solvers.falkon_solve` for the algorithm and costs. ``time_limit`` (seconds of
        CG) needs the built-in solver and rows on one process (ranks stopping at different
        iterations would leave the others waiting in a collective). ``info.extra["preconditioner_seconds"]``
        records the seconds spent building the preconditioner (0 when it was cached), beside the
        built-in solver's ``"cg_seconds"`` and ``"precond_apply_seconds"``.
        """
        if rhs.dim() != 2 or rhs.shape[0] != self.m:
            raise ValueError(f"rhs must have shape ({self.m}, k), got {tuple(rhs.shape)}")
        if x0 is not None and x0.shape != rhs.shape:
            raise ValueError(f"x0 must have the shape of rhs {tuple(rhs.shape)}, got {tuple(x0.shape)}")
        self.check_time_limit(time_limit)
        # the limit counts from here: the preconditioner's factorisations and any restart after a jitter
        # boost share it
        t_end = None if time_limit is None else time.perf_counter() + float(time_limit)
        tol_, max_iter_, extra = self._cg_rule(tol, max_iter)
        precond_seconds = 0.0  # building the preconditioner (0 when cached), restarts included
        with torch.no_grad():
            while True:
                try:
                    t_pre = time.perf_counter()
                    precond = self.preconditioner
                    if self.centers.device.type == "cuda":
                        torch.cuda.synchronize(self.centers.device)
                    precond_seconds += time.perf_counter() - t_pre
                    if t_end is not None:
                        extra["time_limit"] = max(t_end - time.perf_counter(), 1e-9)
                    if self.solver is falkon_solve and self._split_w_ok(precond):
                        extra.update(data_matmul=lambda v: self.engine.kmn_k(v),
                                     kmm_weight=self.n * float(self.penalty.detach()))
                    else:
                        extra.pop("data_matmul", None)
                        extra.pop("kmm_weight", None)
                    def run(announce: Callable[[Tensor], None] | None, precond: Preconditioner = precond,
                            extra: dict[str, Any] = extra) -> tuple[Tensor, CGInfo]:
                        h_matmul, kw = self.h_matmul_nograd, dict(extra)
                        if announce is not None:  # rank 0 of a sharded solve: each data product's input goes out
                            def h_matmul(u: Tensor) -> Tensor:
                                announce(u)
                                return self.h_matmul_nograd(u)

                            if "data_matmul" in kw:
                                def data_matmul(v: Tensor) -> Tensor:
                                    announce(v)
                                    return self.engine.kmn_k(v)

                                kw["data_matmul"] = data_matmul
                        return self.solver(
                            h_matmul,
                            precond,
                            rhs.detach(),
                            None if x0 is None else x0.detach(),
                            tol=tol_,
                            max_iter=max_iter_,
                            callback=callback if callback is not None else self.callback,
                            verbose=self.verbose if verbose is None else verbose,
                            warn=warn,
                            **kw,
                        )

                    if is_sharded(self.options.backend) and hasattr(self.options.backend, "lead_solve"):
                        # the iteration on rank 0 alone, the data products on every rank: ranks whose M-sized
                        # arithmetic rounds differently cannot drift apart or stop at different iterations
                        sol, info = self.options.backend.lead_solve(
                            run, lambda v: self.engine.kmn_k(v), rhs.detach().to(torch.float64))
                    else:
                        sol, info = run(None)
                    break
                except FalkonConvergenceError as exc:
                    if "positive definiteness" not in str(exc) or not self._boost_jitter(str(exc)):
                        raise
        info.extra["preconditioner_seconds"] = precond_seconds
        self.last_info = info
        return sol, info

    def _cg_rule(self, tol: float | None, max_iter: int | None) -> tuple[float, int, dict[str, Any]]:
        """``(tol, max_iter, extra)`` of a CG solve: the stopping rule (:meth:`_stopping_rule`) and the built-in
        solver's extra arguments (the data dtype for its advice; ``verify`` where products or preconditioner are in
        less than float64), with float32 data's default tolerance."""
        tol_, max_iter_ = self._stopping_rule(tol, max_iter)
        default_tol = tol is None and self.options.tol is None and not settings.cg_tolerance.overridden() \
            and float(lo_settings.cg_tolerance.value()) >= 1
        # the dtype reaches the built-in solver for its advice; a user's solver keeps the Solver signature
        extra: dict[str, Any] = {"data_dtype": self.x.dtype} if self.solver is falkon_solve else {}
        if self.solver is falkon_solve and (self.precond_dtype == torch.float32 or self._fixed_store()):
            # products or preconditioner in less than float64: a claimed convergence is checked (conjugate_gradient)
            extra["verify"] = True
        if default_tol and self.x.dtype.itemsize < 8 and 0 < tol_ < FLOAT32_TOL:
            # the default tolerance (no tol given here, in the options or by a setting) for float32 data: aim
            # at FLOAT32_TOL, and where float32 kernel products stall above it (smooth kernels, small
            # penalties: benchmarks/results/float32-tol.md) stop there after 25 iterations without
            # progress, quietly up to FLOAT32_QUIET (test error unchanged there), with a warning above
            tol_ = FLOAT32_TOL
            if self.solver is falkon_solve:
                extra.update(stagnation_window=25, quiet_below=FLOAT32_QUIET)
        return tol_, max_iter_, extra

    def solve_path(
        self,
        rhs: Tensor,
        penalties: Tensor | Sequence[float],
        x0: Tensor | None = None,
        *,
        tol: float | None = None,
        max_iter: int | None = None,
        warn: bool = True,
        time_limit: float | None = None,
        y: Tensor | None = None,
    ) -> tuple[Tensor, CGInfo, PenaltyPathPreconditioner | None]:
        r"""Solves of ``H_j alpha_j = rhs`` at every penalty ``lambda_j`` of ``penalties`` at once,
        ``H_j = K_Mn K_nM + n lambda_j K_MM`` (the operator's own penalty is not used), no autograd.

        Where :meth:`chosen_method` picks the direct solve (for ``p`` right-hand sides), one pass forms the whitened
        Gram matrix and each penalty costs one ``M^3 / 3`` Cholesky (:meth:`direct_solve`'s system at each
        ``lambda_j``; ``x0`` is not used, the preconditioner returned is ``None``). Else one CG over the ``(M, p)``
        block whose column ``j`` is the system at ``lambda_j``, preconditioned column by
        column (:class:`~gpfalkon.operators.penalty_path.PenaltyPathPreconditioner`: one factorisation of ``K_MM``,
        one ``M^3 / 3`` Cholesky per penalty): each iteration is one data pass for all penalties, so where the pass
        dominates (a stored ``K_nM``, read once whatever the block's width) ``p`` penalties cost about one solve.
        ``rhs``: ``(M, 1)`` (one output); ``x0``: ``(M, p)`` starting coefficients. Returns ``(alpha, info,
        preconditioner)``, ``alpha`` ``(M, p)`` float64; CG runs until every column meets ``tol`` (or
        ``max_iter``, ``time_limit`` seconds counted from this call). ``y``: the targets with ``rhs = K_Mn y``, which
        the direct solve of float32 data uses (:meth:`_direct_parts`). Needs the built-in solver, FALKON's own
        preconditioner (the options' builder is not used: it builds one penalty's) and rows on one process.
        *(Tested against dense solves at every penalty.)*"""
        if rhs.dim() != 2 or rhs.shape != (self.m, 1):
            raise ValueError(f"rhs must have shape ({self.m}, 1) (one output), got {tuple(rhs.shape)}")
        lams = torch.as_tensor(penalties, dtype=torch.float64).reshape(-1)
        if lams.numel() < 1:
            raise ValueError("penalties must hold at least one penalty")
        if x0 is not None and x0.shape != (self.m, lams.numel()):
            raise ValueError(f"x0 must have shape ({self.m}, {lams.numel()}), got {tuple(x0.shape)}")
        if self.solver is not falkon_solve:
            raise ValueError("solve_path needs the built-in FALKON solver (options.solver is a custom one)")
        if is_sharded(self.options.backend):
            raise ValueError("solve_path needs rows on one process")
        self.check_time_limit(time_limit)
        t_end = None if time_limit is None else time.perf_counter() + float(time_limit)
        p = lams.numel()
        if self.chosen_method(tol=tol, max_iter=max_iter, outputs=p) == "direct":
            with torch.no_grad():
                t_pre = time.perf_counter()
                gram, factor, rhs_used = self._direct_parts(rhs, y)
                solved = [direct_solve_whitened(gram, factor, rhs_used, self.n * float(lam)) for lam in lams]
            alpha = torch.cat([a for a, _ in solved], dim=1)
            info = CGInfo(iterations=0, converged=True, residuals=torch.cat([i.residuals for _, i in solved], dim=1),
                          tol=0.0, max_iter=0,
                          extra={"method": "direct", "m": self.m, "preconditioner_seconds": 0.0,
                                 "direct_seconds": time.perf_counter() - t_pre})
            return alpha, info, None
        tol_, max_iter_, extra = self._cg_rule(tol, max_iter)
        block = rhs.detach().to(torch.float64).expand(self.m, p).contiguous()
        with torch.no_grad():
            while True:
                try:
                    t_pre = time.perf_counter()
                    precond = PenaltyPathPreconditioner.from_kernel_matrix(
                        self.kmm, lams, self.n, weights=self.weights, dtype=self.precond_dtype,
                        jitter=self._precond_jitter())
                    precond_seconds = time.perf_counter() - t_pre
                    weight = (self.n * lams).to(self.kmm.device)
                    if t_end is not None:
                        extra["time_limit"] = max(t_end - time.perf_counter(), 1e-9)
                    if settings.kmm_through_factor.value() and precond.reproduces(self.kmm):
                        extra.update(data_matmul=lambda v: self.engine.kmn_k(v), kmm_weight=weight)

                    def h_matmul(u: Tensor, c: Tensor = weight) -> Tensor:
                        return self.engine.kmn_k(u).add_((self.kmm.to(torch.float64) @ u) * c)

                    sol, info = falkon_solve(h_matmul, precond, block, None if x0 is None else x0.detach(),
                                             tol=tol_, max_iter=max_iter_, warn=warn, **extra)
                    break
                except FalkonConvergenceError as exc:
                    if "positive definiteness" not in str(exc) or not self._boost_jitter(str(exc)):
                        raise
        info.extra["preconditioner_seconds"] = precond_seconds
        return sol, info, precond

    def check_time_limit(self, time_limit: float | None) -> None:
        """Raise unless ``time_limit`` is ``None`` or usable here: a number of seconds > 0, the built-in
        solver (a custom one has no clock) and rows on one process (ranks stopping CG at different
        iterations would leave the others waiting in a collective)."""
        if time_limit is None:
            return
        if isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real) or not time_limit > 0:
            raise ValueError(f"time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
        if self.solver is not falkon_solve:
            raise ValueError("time_limit needs the built-in FALKON solver (options.solver is a custom one)")
        if is_sharded(self.options.backend):
            raise ValueError("time_limit is not available with rows sharded over processes: the ranks' "
                             "clocks could stop CG at different iterations")

    def chosen_method(self, *, tol: float | None = None, max_iter: int | None = None, iterative: bool = False,
                      outputs: int = 1) -> str:
        """``"cg"`` or ``"direct"``: :attr:`FalkonOptions.solve_method`, with ``"auto"`` resolved by
        :func:`~gpfalkon.solvers.choose_method` for ``outputs`` right-hand sides (CPU, built-in solver,
        ``iterative=False`` only: a per-iteration callback or a warm start asks for CG)."""
        method = self.options.solve_method
        if method != "auto":
            return method
        if iterative or self.solver is not falkon_solve or self.x.device.type != "cpu":
            return "cg"
        tol_, max_iter_ = self._stopping_rule(tol, max_iter)
        # every rank must take the same method (each runs its passes' collectives): a pass counts as stored only
        # where every shard stores its K_nM
        stored = not self._on_some_rank(not bool(getattr(self.engine, "stored", False)))
        return choose_method(
            self.n, self.m, self.x.shape[1], itemsize=self.x.dtype.itemsize, stored=stored, tol=tol_,
            max_iter=max_iter_, outputs=outputs,
        )

    def direct_solve(self, rhs: Tensor, y: Tensor | None = None) -> tuple[Tensor, CGInfo]:
        """The direct Nyström solve of ``H alpha = rhs`` (``rhs`` ``(M, k)``), no autograd:
        one data pass forming ``L^{-1} K_Mn K_nM L^{-T}`` (``L L^T = K_MM + j I``), then a
        Cholesky solve (:mod:`gpfalkon.solvers.direct`; ``O(n M^2 + M^3)`` float64 flops,
        ``O(M^2)`` memory). Returns ``(alpha, info)`` with ``info.extra["method"] == "direct"``.
        ``y``: the targets ``(n, k)`` or ``(n,)`` with ``rhs = K_Mn y``, for data below float64 (see
        :meth:`_direct_parts`: then the solve is float64's, not the jittered one the rounded ``rhs`` allows).
        """
        if rhs.dim() != 2 or rhs.shape[0] != self.m:
            raise ValueError(f"rhs must have shape ({self.m}, k), got {tuple(rhs.shape)}")
        with torch.no_grad():
            gram, factor, rhs_used = self._direct_parts(rhs, y)
            alpha, info = direct_solve_whitened(gram, factor, rhs_used, self.n * float(self.penalty.detach()))
        self.last_info = info
        return alpha, info

    def _direct_parts(self, rhs: Tensor, y: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(B, L, rhs)`` of the direct solve: ``L L^T = K_MM + j I``, ``B = L^{-1} K_Mn K_nM L^{-T}``.

        The jitter ``j`` is part of the system solved (a ridge ``n lambda j ||alpha||^2``). With kernel values in the
        data's dtype, ``j`` must be that dtype's ``eps M mean(diag K_MM)``: ``L^{-1}`` multiplies their rounding by up
        to ``j^{-1/2}``. For float32 data that ridge moved the mean by 0.9-2.3 % of the predictions' range where CG's
        moved it 0.05-0.14 % (n = 300, M = 80, RBF lengthscales 1-4 on [-1, 1]^3; ``tests/test_direct.py``). So
        where the data is below float64 and the targets ``y`` are given, ``B`` and ``rhs = K_Mn y`` are formed from
        float64 kernel values of the same rows (:meth:`float64_engine`: two recomputed passes, ``2 n M (d + M)``
        float64 flops and ``2 n M`` exponentials) with float64's jitter: the exact Nyström solution of the data as
        stored (float32 rows are exact in float64), which :class:`~gpfalkon.solvers.SolveCosts` charges the direct
        solve. Else the passes of :attr:`engine` with the data dtype's jitter, and ``rhs`` as given."""
        if y is None or self.x.dtype == torch.float64:
            jitter = self._precond_jitter(direct=True)
            factor, _ = whitened_factor(self.kmm, jitter=jitter)
            gram = self.engine.whitened_gram(factor)
            if jitter is None and self.x.dtype == torch.float64:  # float64 values and jitter: the posterior's pass
                self._direct_gram = (factor, gram)
            return gram, factor, rhs.detach()
        cols = y.detach().to(torch.float64)
        cols = cols.unsqueeze(-1) if cols.dim() == 1 else cols
        if cols.shape != (self.x.shape[0], rhs.shape[1]):
            raise ValueError(f"y must have shape ({self.x.shape[0]}, {rhs.shape[1]}) (rhs = K_Mn y), got "
                             f"{tuple(y.shape)}")
        with self._float64_passes() as engine:
            rhs64 = engine.kmn_k(None, cols)
            factor, _ = whitened_factor(self.kmm)
            gram = engine.whitened_gram(factor)
        self._direct_gram = (factor, gram)
        return gram, factor, rhs64

    def posterior_gram(self, L: Tensor) -> Tensor:
        """``A A^T`` with ``A = L^{-1} K_Mn`` from float64 kernel values, for the posterior factors (docs/math.md §4;
        ``L`` lower triangular, ``L L^T = K_MM`` with float64's jitter): the Gram matrix of the direct solve just
        run where it was formed with this ``L`` from float64 values (no pass: ``fit(compute_variance=True)`` after a
        direct solve reads the data once less), else one pass of :meth:`float64_engine` (``2 n M^2`` float64
        flops). The held matrix is handed out once."""
        self._refresh()
        held, self._direct_gram = getattr(self, "_direct_gram", None), None
        if held is not None and held[0].shape == L.shape and torch.equal(held[0], L):
            return held[1]
        with self._float64_passes() as engine:  # float32 values' rounding, times ||L^{-1}||, would swamp A A^T
            return engine.whitened_gram(L)

    def solve_system(
        self,
        rhs: Tensor,
        x0: Tensor | None = None,
        *,
        tol: float | None = None,
        max_iter: int | None = None,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        verbose: bool | None = None,
        warn: bool = True,
        time_limit: float | None = None,
        x0_forces_cg: bool = True,
        y: Tensor | None = None,
    ) -> tuple[Tensor, CGInfo]:
        """``H alpha = rhs`` by the method :meth:`chosen_method` picks: :meth:`direct_solve` or
        :meth:`falkon_solve` (same arguments and return value). ``time_limit`` bounds CG; the direct
        solve, picked only where the cost model finds it cheaper than CG, is one pass and is not
        interrupted. A warm start ``x0`` asks for CG unless ``x0_forces_cg`` is ``False`` (then it is a
        starting point CG uses where the cost model picks CG anyway; the direct solve ignores it).
        ``y``: the targets with ``rhs = K_Mn y``, which the direct solve of float32 data uses
        (:meth:`direct_solve`)."""
        iterative = (x0 is not None and x0_forces_cg) or callback is not None or self.callback is not None
        outputs = int(rhs.shape[-1]) if rhs.dim() == 2 else 1
        if self.chosen_method(tol=tol, max_iter=max_iter, iterative=iterative, outputs=outputs) == "direct":
            return self.direct_solve(rhs, y)
        if warn and self.m > self.n:
            # K_Mn K_nM has rank <= n: beyond the rows' span only n lambda K_MM fixes alpha, and CG's residual does
            # not bound the error there (float32, 60 centers off the data, 30 rows, lambda 1e-7: "converged", the
            # test points' mean 41 % off the exact solve's, which the direct solve gives)
            warn_caller(f"{self.m} centers for {self.n} training rows: alpha is fixed beyond the rows' span by the "
                          "penalty alone, where CG's residual does not bound its error; the direct solve "
                          "(solve_method='direct') is exact here, or use at most n centers", RuntimeWarning)
        return self.falkon_solve(rhs, x0, tol=tol, max_iter=max_iter, callback=callback, verbose=verbose, warn=warn,
                                 time_limit=time_limit)

    def _boost_jitter(self, reason: str) -> bool:
        """After a CG breakdown: rebuild the preconditioner with 100x its jitter.

        ``p^T W p <= 0`` on a PSD kernel means the preconditioner resolves eigenvalues of
        ``K_MM`` below the rounding noise of ``H`` (numerically singular ``K_MM``: M close
        to n, near-duplicate centers, a long lengthscale, a tiny penalty). A larger jitter
        in ``T`` only weakens the preconditioner; the system solved is still ``H``.
        Returns ``False`` once the jitter would exceed the kernel's mean diagonal
        (the breakdown is then real: a non-PSD kernel).
        """
        self._jitter_boost *= 100.0
        jitter = self._precond_jitter()
        scale = float(self.kmm.diagonal().abs().mean()) or 1.0
        if jitter is None or jitter > scale:
            return False
        warn_caller(
            f"FALKON CG broke down ({reason.split(':')[0]}); rebuilt the preconditioner with jitter "
            f"{jitter:.3g} ({jitter / scale:.1e} x mean diagonal of K_MM) and restarted",
            JitterWarning,
        )
        self._precond = self._split_w = None
        return True

    # ------------------------------------------------------- LinearOperator API
    def _size(self) -> torch.Size:
        return torch.Size((self.m, self.m))

    def _transpose_nonbatch(self) -> NystromKRROperator:
        return self

    def _differentiable_kmm(self) -> Tensor:
        return kernel_block(self.kernel, self.centers, self.centers).to(self.x.dtype)

    def _h_matmul_autograd(self, cols: Tensor) -> Tensor:
        k_part = kernel_product(self.engine, cols, None, self.x, self.centers)
        return k_part + (self.n * self.penalty) * (self._differentiable_kmm() @ cols.to(self.x.dtype))

    def _needs_grad(self, *extra: Tensor) -> bool:
        """Does a differentiable path apply (grad mode on and an input requiring a gradient)?

        With a sharded backend, the differentiable products and solves of this operator are not
        available yet (the objectives' sharded path is ``DistributedBackend.joint_objective``):
        raise rather than return gradients of this rank's rows only.
        """
        if not torch.is_grad_enabled():
            return False
        if not is_sharded(self.options.backend):
            return True
        live = [self.x, self.centers, self.penalty, *extra, *kernel_params(self.kernel)]
        if any(t.requires_grad for t in live):
            raise NotImplementedError(
                "NystromKRROperator: gradients through H's products, diagonal or solve with a sharded "
                "(distributed) backend are not available yet; the exact objectives are (call them as modules)"
            )
        return False

    def _matmul(self, rhs: Tensor) -> Tensor:
        cols, back = _as_columns(rhs, self.m)
        if self._needs_grad(rhs):
            out = self._h_matmul_autograd(cols)
        else:
            out = self.h_matmul_nograd(cols.to(torch.float64))
        return back(out.to(rhs.dtype))

    def matmul(self, other):
        # Route tensors through our own autograd so kernel-parameter gradients
        # survive (linear_operator's Matmul only differentiates the representation).
        if isinstance(other, Tensor) and other.shape[-2 if other.dim() > 1 else -1] == self.m:
            return self._matmul(other)
        return super().matmul(other)

    def _get_indices(self, row_index: Tensor, col_index: Tensor, *batch_indices: Tensor) -> Tensor:
        """Entries ``H[row_index, col_index]`` (broadcast tensor indices), differentiable.

        The generic implementation expands the operator to the indices' batch shape,
        which this non-batch operator cannot do. Here: one :meth:`_matmul` against the
        unit vectors of the distinct requested columns (one data pass with ``k`` =
        number of distinct columns), then a gather.
        """
        if batch_indices:
            raise NotImplementedError(f"{type(self).__name__} has no batch dimensions to index")
        shape = torch.broadcast_shapes(row_index.shape, col_index.shape)
        cols, inverse = torch.unique(col_index.reshape(-1), return_inverse=True)
        unit = torch.zeros(self.m, cols.numel(), dtype=self.dtype, device=self.device)
        unit[cols, torch.arange(cols.numel(), device=self.device)] = 1.0
        h_cols = self._matmul(unit)  # (M, distinct columns)
        return h_cols[row_index.expand(shape), inverse.reshape(col_index.shape).expand(shape)]

    def _getitem(self, row_index: Any, col_index: Any, *batch_indices: Any) -> LinearOperator:
        """``H[row_index, col_index]`` for slices or tensor indices (linear_operator's contract: the two dimensions
        stay) as a dense operator, by :meth:`_get_indices` on the index grid: one data pass with ``k`` = number of
        distinct columns (the generic interpolation route breaks on an empty selection)."""
        if batch_indices:
            raise NotImplementedError(f"{type(self).__name__} has no batch dimensions to index")
        if isinstance(row_index, slice) and isinstance(col_index, slice) and row_index == col_index == slice(None):
            return self

        def positions(index: Any) -> Tensor:
            if isinstance(index, slice):
                return torch.arange(self.m, device=self.device)[index]
            return torch.as_tensor(index, device=self.device).reshape(-1)

        rows, cols = positions(row_index), positions(col_index)
        if rows.numel() == 0 or cols.numel() == 0:
            return DenseLinearOperator(torch.zeros(rows.numel(), cols.numel(), dtype=self.dtype, device=self.device))
        return DenseLinearOperator(self._get_indices(rows.unsqueeze(-1), cols.unsqueeze(0)))

    def _unsqueeze_batch(self, dim: int) -> LinearOperator:
        raise NotImplementedError(
            f"{type(self).__name__} is a single M x M system (one data set, one set of centers): "
            "it has no batch mode, so it cannot be unsqueezed, expanded or broadcast to batch dimensions"
        )

    def _expand_batch(self, batch_shape: torch.Size | list[int]) -> LinearOperator:
        if len(batch_shape) == 0:
            return self
        return self._unsqueeze_batch(0)

    def diagonal_nograd(self) -> Tensor:
        """``diag(H) = sum_i K_iM^2 + n lambda diag(K_MM)`` (float64): one engine pass."""
        diag = self.engine.column_sq_norms()
        diag += self.n * float(self.penalty.detach()) * self.kmm.diagonal()
        return diag

    def _diagonal(self) -> Tensor:
        if self._needs_grad():
            params = kernel_params(self.kernel)
            return _HDiagonal.apply(self, self.x, self.centers, self.penalty, *params)
        return self.diagonal_nograd().to(self.x.dtype)

    def solve(self, right_tensor: Tensor, left_tensor: Tensor | None = None) -> Tensor:
        """``H^{-1} right`` (or ``left H^{-1} right``) by FALKON, differentiable."""
        cols, back = _as_columns(right_tensor, self.m)
        params = kernel_params(self.kernel)
        if not self._needs_grad(right_tensor):
            with torch.no_grad():
                sol = self.falkon_solve(cols.to(torch.float64))[0].to(cols.dtype)
            out = back(sol)
            return out if left_tensor is None else left_tensor @ out
        sol = _FalkonSolve.apply(self, cols, self.x, self.centers, self.penalty, *params)
        out = back(sol)
        if left_tensor is not None:
            return left_tensor @ out
        return out

    def inv_quad(self, inv_quad_rhs: Tensor, reduce_inv_quad: bool = True) -> Tensor:
        """``rhs^T H^{-1} rhs`` (per column, summed if ``reduce_inv_quad``) by the FALKON
        solve: differentiable w.r.t. ``rhs``, x, centers, penalty and kernel parameters."""
        rhs = inv_quad_rhs.unsqueeze(-1) if inv_quad_rhs.dim() == 1 else inv_quad_rhs
        out = (rhs * self.solve(rhs)).sum(-2)
        return out.sum(-1) if reduce_inv_quad else out

    def inv_quad_logdet(
        self, inv_quad_rhs: Tensor | None = None, logdet: bool = False, reduce_inv_quad: bool = True
    ) -> tuple[Tensor, Tensor]:
        """``rhs^T H^{-1} rhs`` by FALKON (differentiable w.r.t. everything, kernel
        parameters included) and, if asked, ``log det H`` by linear_operator's
        stochastic Lanczos estimator on ``H @ u``.

        The log-determinant's gradient reaches only the operator's tensors (x,
        centers, penalty), not the kernel's parameters: a :class:`UserWarning` says
        so when a kernel parameter requires a gradient.
        """
        inv_quad = torch.zeros((), dtype=self.dtype, device=self.device)
        if inv_quad_rhs is not None:
            inv_quad = self.inv_quad(inv_quad_rhs, reduce_inv_quad)
        logdet_value = torch.zeros((), dtype=self.dtype, device=self.device)
        if logdet:
            if torch.is_grad_enabled() and kernel_params(self.kernel):
                warn_caller(
                    "NystromKRROperator.logdet: gradients w.r.t. the kernel's parameters are not propagated "
                    "through linear_operator's stochastic log-determinant (only x, centers and penalty are)",
                    UserWarning,
                )
            _, logdet_value = super().inv_quad_logdet(None, logdet=True)
        return inv_quad, logdet_value

    # ------------------------------------------------------- gradient helpers
    def surrogate_grads(
        self,
        surrogate: Callable[[int, int, Tensor], Tensor],
        penalty_form: Callable[[Tensor], Tensor],
        params: list[Tensor],
        *,
        need_x: bool,
        need_c: bool,
        need_pen: bool,
    ) -> HGrads:
        """Gradients of ``sum_b surrogate(start, stop, K_b(theta)) + n lambda(theta) penalty_form(K_MM(theta))``.

        The one gradient path of every hand-derived backward (the FALKON solve, ``diag H``,
        the stochastic objective's quadratic forms): ``surrogate`` is a scalar built from the
        differentiable block ``K_b = k(x[start:stop], C)`` and constants, ``penalty_form`` a
        scalar of the differentiable ``K_MM``. One blockwise pass
        (:func:`~gpfalkon.backend.blockwise_kernel_grad`, in blocks within the operator's
        ``memory_budget``) plus an ``O(M^2 d)`` term. Returns :class:`HGrads` with ``None``
        where not requested.
        """
        gx, gc, gp = self.blockwise_grad(surrogate, params, need_x, need_c)
        # fresh leaves for the centers and the penalty: differentiating w.r.t. the forward's tensors
        # could walk back into their (already freed) history
        c_leaf = self.centers.detach().requires_grad_(need_c)
        pen_leaf = self.penalty.detach().requires_grad_(need_pen)
        inputs: list[Tensor] = list(params) + ([c_leaf] if need_c else []) + ([pen_leaf] if need_pen else [])
        g_pen: Tensor | None = None
        if inputs:
            with torch.enable_grad():
                kmm = kernel_block(self.kernel, c_leaf, c_leaf).to(self.x.dtype)
                s = self.n * pen_leaf.to(self.x.dtype) * penalty_form(kmm)
                grads = torch.autograd.grad(s, inputs, allow_unused=True) if s.requires_grad else [None] * len(inputs)
            for i in range(len(params)):
                if grads[i] is not None:
                    gp[i] = grads[i] if gp[i] is None else gp[i] + grads[i]
            j = len(params)
            if need_c:
                if grads[j] is not None:
                    gc = grads[j] if gc is None else gc + grads[j]
                j += 1
            if need_pen:
                g_pen = grads[j]
        return HGrads(x=gx, centers=gc, penalty=g_pen, params=gp)

    def blockwise_grad(self, surrogate, params: list[Tensor], need_x: bool, need_c: bool):
        """:func:`~gpfalkon.backend.blockwise_kernel_grad` on this operator's data (the kernel
        part of :meth:`surrogate_grads`, without the penalty term), in blocks within its options;
        an injected backend (``options.backend``) may replace it by its own ``blockwise_kernel_grad``."""
        backend = self.options.backend
        grad_pass = getattr(backend, "blockwise_kernel_grad", None) if backend is not None else None
        return (grad_pass if callable(grad_pass) else blockwise_kernel_grad)(
            self.kernel, self.x, self.centers, surrogate, params, need_x, need_c, self.memory_budget, self.block_rows
        )

    def bilinear_grads(
        self, left: Tensor, right: Tensor, need_x: bool, need_c: bool, need_pen: bool, params: list[Tensor]
    ) -> HGrads:
        """Gradients of ``left^T H(theta) right`` (columns summed) w.r.t. x, centers,
        penalty and ``params``: one blockwise pass plus an ``O(M^2 d)`` term."""
        dtype = self.x.dtype
        lf = left.detach().to(dtype)
        rt = right.detach().to(dtype)

        def surrogate(start: int, stop: int, kb: Tensor) -> Tensor:
            kd = kb.detach()
            return ((kb @ rt) * (kd @ lf)).sum() + ((kb @ lf) * (kd @ rt)).sum()

        return self.surrogate_grads(
            surrogate, lambda kmm: (lf * (kmm @ rt)).sum(), params, need_x=need_x, need_c=need_c, need_pen=need_pen
        )

    def _bilinear_derivative(self, left_vecs: Tensor, right_vecs: Tensor) -> tuple[Tensor | None, ...]:
        lf, _ = _as_columns(left_vecs, self.m)
        rt, _ = _as_columns(right_vecs, self.m)
        g = self.bilinear_grads(
            lf, rt, self.x.requires_grad, self.centers.requires_grad, self.penalty.requires_grad, []
        )
        return g.x, g.centers, g.penalty


class _FalkonSolve(torch.autograd.Function):
    """``alpha = H(theta)^{-1} b`` by FALKON with implicit-differentiation backward:
    ``dL/db = H^{-1} g`` (one more FALKON solve) and
    ``dL/dtheta = -d/dtheta [ (H^{-1} g)^T H(theta) alpha ]`` (one blockwise pass).

    The context keeps ``op`` (and so a stored ``K_nM``) alive until the graph is freed."""

    @staticmethod
    def forward(
        ctx, op: NystromKRROperator, rhs: Tensor, x: Tensor, centers: Tensor, penalty: Tensor, *params: Tensor
    ) -> Tensor:
        sol, _ = op.falkon_solve(rhs.to(torch.float64))
        ctx.op = op
        ctx.params = params
        ctx.save_for_backward(sol)
        return sol.to(rhs.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        op: NystromKRROperator = ctx.op
        sol = ctx.saved_tensors[0].detach()
        lam, _ = op.falkon_solve(grad.detach().to(torch.float64))
        grad_rhs = lam.to(grad.dtype) if ctx.needs_input_grad[1] else None
        need_x, need_c, need_pen = ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        need_p = list(ctx.needs_input_grad[5:])
        gx = gc = gpen = None
        gp: list[Tensor | None] = [None] * len(need_p)
        if need_x or need_c or need_pen or any(need_p):
            active = [p for p, need in zip(backward_params(op.kernel, ctx.params), need_p, strict=False) if need]
            g = op.bilinear_grads(lam, sol, need_x, need_c, need_pen, active)
            gp = scatter_grads(need_p, g.params, sign=-1.0)
            gx = None if g.x is None else -g.x
            gc = None if g.centers is None else -g.centers
            gpen = None if g.penalty is None else -g.penalty
        return (None, grad_rhs, gx, gc, gpen, *gp)


class _HDiagonal(torch.autograd.Function):
    """``diag(H)``, differentiable w.r.t. x, centers, penalty and kernel parameters.

    Backward (g = dL/d diag, length M): ``d/dtheta [ sum_b <K_b(theta)^2, 1 g^T>
    + n lambda(theta) g^T diag(K_MM(theta)) ]``, one blockwise pass."""

    @staticmethod
    def forward(ctx, op: NystromKRROperator, x: Tensor, centers: Tensor, penalty: Tensor, *params: Tensor) -> Tensor:
        ctx.op = op
        ctx.params = params
        return op.diagonal_nograd().to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        op: NystromKRROperator = ctx.op
        g = grad.detach().to(op.x.dtype)
        need_x, need_c, need_pen = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_p = list(ctx.needs_input_grad[4:])
        active = [p for p, need in zip(backward_params(op.kernel, ctx.params), need_p, strict=False) if need]

        def surrogate(start: int, stop: int, kb: Tensor) -> Tensor:
            return (kb.square() * g).sum()

        h = op.surrogate_grads(
            surrogate, lambda kmm: (g * kmm.diagonal()).sum(), active, need_x=need_x, need_c=need_c, need_pen=need_pen
        )
        return (None, h.x, h.centers, h.penalty, *scatter_grads(need_p, h.params))
