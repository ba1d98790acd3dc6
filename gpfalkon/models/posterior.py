"""The SGPR/DTC posterior (docs/math.md §4): its factors, its chunked mean and its lazy covariance."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.utils.warnings import NumericalWarning
from linear_operator.operators import DiagLinearOperator, KroneckerProductLinearOperator, LinearOperator
from linear_operator.utils.memoize import cached
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .._warn import warn_caller
from ..backend.blocks import AGGREGATE, keeps_graph, row_blocks
from ..backend.engine import kernel_block
from ..backend.passes import backend_pass
from ..linalg import jittered_cholesky, upper_gram

if TYPE_CHECKING:
    from ..operators import NystromKRROperator

__all__ = ["NystromMultitaskMultivariateNormal", "NystromMultivariateNormal", "NystromPosteriorCovariance",
           "NystromPosteriorFactors", "nystrom_posterior_mean", "posterior_roots", "shared_covariance_distribution"]


class _UnflooredVariance:
    """``variance`` without GPyTorch's floor (``gpytorch.settings.min_variance``: 1e-6 in float32, 1e-10 in
    float64), which is absolute: a posterior in the data's units (``auto_fit`` maps back to them) whose variances
    are below it, e.g. targets with a standard deviation of 1e-2 in float32, would get variances 100x too large.
    The Nystrom posterior's diagonal is formed stably (docs/math.md §4), so only a negative rounding is cut, at 0.
    GPyTorch's ``variance`` (the diagonal, then the multitask layout) without its floor, rather than GPyTorch's under
    ``min_variance(0)``: that setting is one class attribute for the whole process, so entering and leaving it from
    several predicting threads left it at 0 for every later distribution."""

    @property
    def variance(self) -> Tensor:
        mvn: Any = self
        if mvn.islazy:
            diag = mvn.lazy_covariance_matrix.diagonal(dim1=-1, dim2=-2)
            diag = diag.view(diag.shape[:-1] + mvn._event_shape)
            var = diag.expand(mvn._batch_shape + mvn._event_shape)
        else:
            var = torch.distributions.MultivariateNormal.variance.fget(mvn)  # type: ignore[attr-defined]
        if bool(var.lt(0).any()):
            warn_caller("Negative variance values detected (rounding); cut at 0", NumericalWarning)
            var = var.clamp_min(0.0)
        if isinstance(mvn, MultitaskMultivariateNormal):  # GPyTorch's multitask layout of the diagonal
            if not mvn._interleaved:
                shape = mvn._output_shape[:-2] + mvn._output_shape[:-3:-1]
                return var.view(shape).transpose(-1, -2).contiguous()
            return var.view(mvn._output_shape)
        return var


class NystromMultivariateNormal(_UnflooredVariance, MultivariateNormal):
    """FalkonGP's one-output posterior: a ``MultivariateNormal`` whose ``variance`` has no absolute floor."""


class NystromMultitaskMultivariateNormal(_UnflooredVariance, MultitaskMultivariateNormal):
    """FalkonGP's multi-output posterior: a ``MultitaskMultivariateNormal`` whose ``variance`` has no absolute
    floor."""


class NystromPosteriorFactors:
    r"""Cholesky factors of the SGPR/DTC posterior, formed once in ``O(n M^2)``.

    ``L L^T = K_MM`` and ``L_B L_B^T = I + A A^T / v`` with ``A = L^{-1} K_Mn`` and
    ``v = n lambda`` (docs/math.md §4). ``A A^T`` is one backend pass
    (:meth:`~gpfalkon.backend.KernelEngine.whitened_gram`: about ``2 n M^2`` float64 flops,
    memory ``O(M^2 + block x M)``). Then for test inputs with
    ``a = L^{-1} K_M*`` and ``c = L_B^{-1} a``:

        cov(X*) = K_** - a^T a + c^T c
                = K_** - K_*M K_MM^{-1} K_M* + n lambda K_*M H^{-1} K_M*.

    ``B = I + A A^T / v`` has eigenvalues >= 1, so this form stays accurate where
    the Woodbury form of GPyTorch's SGPR (entries ~ n / sigma^2) does not. :meth:`approximate_from` forms
    ``L_B`` from FALKON's approximation of ``K_Mn K_nM`` instead, in ``O(M^3)`` with no data pass.
    """

    def __init__(self, L: Tensor, LB: Tensor, *, approximate: bool = False) -> None:
        self.L = L
        self.LB = LB
        #: whether ``L_B`` is FALKON's approximation (:meth:`approximate_from`) rather than the exact factor
        self.approximate = bool(approximate)

    def scaled(self, c: float) -> NystromPosteriorFactors:
        """The factors of the prior scaled by ``c`` (kernel and noise times ``c``): ``L`` times ``c^{1/2}``, ``L_B``
        unchanged (docs/math.md §4, "Scaling the prior")."""
        return NystromPosteriorFactors(self.L * math.sqrt(c), self.LB, approximate=self.approximate)

    @classmethod
    def compute(cls, op: NystromKRROperator) -> NystromPosteriorFactors:
        v = op.n * float(op.penalty.detach())
        L, _ = jittered_cholesky(op.kmm, upper=False, name="K_MM")
        bmat = op.posterior_gram(L) / v  # float64 kernel values (a direct solve's, where it just formed them)
        bmat.diagonal().add_(1.0)
        LB, _ = jittered_cholesky(bmat, upper=False, name="I + A A^T / (n lambda)", jitter=0.0)
        return cls(L, LB)

    @classmethod
    def approximate_from(cls, kmm: Tensor, n: int, penalty: float, weights: Tensor | None = None
                         ) -> NystromPosteriorFactors:
        r"""The factors with ``K_Mn K_nM`` replaced by FALKON's Nyström approximation
        ``(n/M) K_MM D^2 K_MM`` (the one its preconditioner makes; ``D`` the centers' ``weights``, ``I`` for
        uniform centers; docs/math.md §4.2), from the float64 ``kmm`` (``K_MM``), the number of training rows
        ``n`` (all shards') and the ``penalty`` lambda:

            L L^T = K_MM,     L_B L_B^T = I + (n/M) L^T D^2 L / (n lambda).

        No pass over the data (and so no collective between row shards): two Cholesky factorisations and one
        ``M x M`` triangular product, ``O(M^3)`` flops against the exact factors' ``2 n M^2``. In
        ``S(X_*) = K_** - a^T a + c^T c`` the first two terms stay exact; ``c^T c = n lambda K_*M H^{-1} K_M*``
        uses the approximate ``H``, is still between 0 and ``a^T a`` (both ``H``'s are ``>= n lambda K_MM``),
        and is the exact one where the centers are the training rows (``M = n``). Meant where ``n >> M`` and
        the centers are drawn from the training rows (uniformly, or by leverage scores with their weights), as
        FALKON's preconditioner assumes."""
        v = n * float(penalty)
        L, _ = jittered_cholesky(kmm, upper=False, name="K_MM")
        m = L.shape[-1]
        u = (L if weights is None else weights.to(L).unsqueeze(-1) * L).mT  # (D L)^T, upper triangular
        bmat = (upper_gram(u) if u.dim() == 2 else u @ u.mT).mul_(n / (m * v))  # L^T D^2 L
        bmat.diagonal(dim1=-2, dim2=-1).add_(1.0)
        LB, _ = jittered_cholesky(bmat, upper=False, name="I + (n/M) L^T D^2 L / (n lambda)", jitter=0.0)
        return cls(L, LB, approximate=True)


class NystromPosteriorCovariance(LinearOperator):
    r"""``cov(X*) = K_** - a^T a + c^T c`` with ``a = L^{-1} K_M*``, ``c = L_B^{-1} a``.

    ``L L^T = K_MM`` and ``L_B L_B^T = I + A A^T / (n lambda)`` come from
    :class:`~gpfalkon.models.NystromPosteriorFactors`; this equals
    ``K_** - K_*M K_MM^{-1} K_M* + n lambda K_*M H^{-1} K_M*`` (docs/math.md §4).

    Nothing of size ``q x M`` or ``q x q`` is held, only ``chunk x M`` and
    ``chunk x chunk`` tiles (with an autograd graph too, beyond the graph's share of the memory budget: the chunks
    are checkpointed): the diagonal (the predictive variances) costs
    ``O(q M (M + d))`` time in chunks of ``chunk_size`` test points; a product with
    a ``(q, k)`` right-hand side costs two chunked passes,
    ``O(q M (M + d + k) + q^2 (d + k))``. Batch dimensions are those of ``x``. Internals run in float64; results are in
    the dtype of ``x``. Differentiable w.r.t. ``x``, and w.r.t. the kernel's parameters through ``K_*M`` and ``K_**``
    only: ``L`` and ``L_B`` are constants here (:func:`nystrom_posterior_mean`).
    """

    def __init__(
        self, x: Tensor, centers: Tensor, L: Tensor | None = None, LB: Tensor | None = None, *, kernel: Kernel,
        chunk_size: int = 4096, factors: Callable[[], tuple[Tensor, Tensor]] | None = None,
        check: Callable[[], None] | None = None, grad_enabled: bool | None = None,
    ) -> None:
        if (L is None) != (LB is None) or (L is None) == (factors is None):
            raise ValueError("NystromPosteriorCovariance needs L and LB, or factors= (a callable returning them)")
        if grad_enabled is None:
            grad_enabled = torch.is_grad_enabled()
        extra: dict[str, Any] = {"check": check, "grad_enabled": bool(grad_enabled)}
        if L is not None and LB is not None:
            super().__init__(x, centers, L, LB, kernel=kernel, chunk_size=chunk_size, **extra)
        else:
            super().__init__(x, centers, kernel=kernel, chunk_size=chunk_size, factors=factors, **extra)
        self.x = x
        self.centers = centers
        self._L, self._LB = L, LB
        # ``factors``: called on the first use of L / L_B (the O(n M^2) variance factors), so that a posterior whose
        # mean alone is read (``model(x).mean``) never forms them
        self._factors = factors
        self.kernel = kernel
        self.chunk_size = int(chunk_size)
        # ``check``: called before each evaluation (raises where the kernel's values are no longer those the factors
        # belong to: the kernel is read live, L / L_B are the fit's); ``grad_enabled``: the grad mode the operator
        # was formed in, in force for its evaluations (one formed under no_grad never builds a graph later)
        self._check = check
        self.grad_enabled = bool(grad_enabled)

    def _resolved(self) -> tuple[Tensor, Tensor]:
        if self._L is None or self._LB is None:
            assert self._factors is not None
            L, LB = self._factors()  # (on the model's device now: moved there since, if it moved)
            self._L, self._LB = L.to(self.x.device), LB.to(self.x.device)
        return self._L, self._LB

    @property
    def L(self) -> Tensor:
        """``L L^T = K_MM`` (float64), formed through ``factors=`` on first use."""
        return self._resolved()[0]

    @property
    def LB(self) -> Tensor:
        """``L_B L_B^T = I + A A^T / (n lambda)`` (float64), formed through ``factors=`` on first use."""
        return self._resolved()[1]

    def __getstate__(self) -> dict[str, Any]:
        # pickled (torch.save of a posterior) with its factors formed: the callable that forms them is a closure over
        # the model, which is not pickled along
        L, LB = self._resolved()
        state = self.__dict__.copy()
        state["_factors"] = None
        state["_check"] = None  # a closure over the model too; a pickled posterior holds its own factors
        # linear_operator's own record of the arguments (what representation_tree rebuilds the operator from)
        state["_args_memo"] = (self.x, self.centers, L, LB)
        for key in ("_differentiable_kwargs", "_nondifferentiable_kwargs"):
            if key in state:
                state[key] = type(state[key])((k, v) for k, v in state[key].items() if k not in ("factors", "check"))
        return state

    def _like(self, x: Tensor) -> NystromPosteriorCovariance:
        """The same covariance at other (reshaped) test inputs, its factors shared (or still to be formed)."""
        extra: dict[str, Any] = {"check": self._check, "grad_enabled": self.grad_enabled}
        if self._L is None:
            return self.__class__(x, self.centers, kernel=self.kernel, chunk_size=self.chunk_size,
                                  factors=self._factors, **extra)
        return self.__class__(x, self.centers, self._L, self._LB, kernel=self.kernel, chunk_size=self.chunk_size,
                              **extra)

    def _evaluating(self) -> contextlib.AbstractContextManager[Any]:
        """Entered by each evaluation: runs ``check`` (where given), then the grad mode the operator was formed in
        (off where it was formed under ``no_grad``, else the caller's)."""
        if self._check is not None:
            self._check()
        return torch.set_grad_enabled(self.grad_enabled and torch.is_grad_enabled())

    # ------------------------------------------------------------------ pieces
    def _chunks(self) -> Iterator[tuple[int, int]]:
        return row_blocks(self.x.shape[-2], self.chunk_size)

    def _roots(self, xs: Tensor) -> tuple[Tensor, Tensor]:
        return posterior_roots(self.kernel, xs, self.centers, self.L, self.LB)

    # ------------------------------------------------------- LinearOperator API
    def _size(self) -> torch.Size:
        q = self.x.shape[-2]
        return torch.Size((*self.x.shape[:-2], q, q))

    def _transpose_nonbatch(self) -> NystromPosteriorCovariance:
        return self

    def _diagonal(self) -> Tensor:
        with self._evaluating():
            return self._diagonal_now()

    def _diagonal_now(self) -> Tensor:
        chunks = list(self._chunks())
        # with a graph (the kernel's parameters require grad, or x does) each chunk's roots would stay in it until
        # the backward pass: several q x M tensors in all; beyond the graph's share of the memory budget each chunk
        # is checkpointed (recomputed by the backward pass, if one comes)
        keep = (len(chunks) == 1 or not torch.is_grad_enabled()
                or keeps_graph(self.x.shape[:-1].numel(), self.centers.shape[-2], AGGREGATE, device=self.x.device))

        def chunk(xs: Tensor) -> Tensor:
            x64 = xs.to(torch.float64)
            kdiag = kernel_block(self.kernel, x64, x64, diag=True)
            a, c = self._roots(xs)
            return kdiag - a.square().sum(-2) + c.square().sum(-2)

        out = [chunk(self.x[..., s:e, :]) if keep else checkpoint(chunk, self.x[..., s:e, :], use_reentrant=False)
               for s, e in chunks]
        return torch.cat(out, -1).to(self.x.dtype)

    @cached
    def to_dense(self) -> Tensor:
        """The dense ``q x q`` covariance, ``K_** - a^T a + c^T c`` in one pass when ``q`` fits in one
        chunk (``O(q M (M + d) + q^2 d)``; autograd differentiates it directly), else chunked
        products with the identity."""
        with self._evaluating():
            if self.x.shape[-2] > self.chunk_size:
                return super().to_dense()
            a, c = self._roots(self.x)
            x64 = self.x.to(torch.float64)
            kxx = kernel_block(self.kernel, x64, x64)
            return (kxx - a.mT @ a + c.mT @ c).to(self.x.dtype)

    def _matmul(self, rhs: Tensor) -> Tensor:
        with self._evaluating():
            return self._matmul_now(rhs)

    def _matmul_now(self, rhs: Tensor) -> Tensor:
        vec = rhs.dim() == 1
        r = (rhs.unsqueeze(-1) if vec else rhs).to(torch.float64)
        x64 = self.x.to(torch.float64)
        # pass 1: A r and C r, (M, k), accumulated over chunks of test points
        ar = cr = None
        for s, e in self._chunks():
            a, c = self._roots(self.x[..., s:e, :])
            rs = r[..., s:e, :]
            ar = a @ rs if ar is None else ar + a @ rs
            cr = c @ rs if cr is None else cr + c @ rs
        # pass 2: rows of K_** r - a^T (A r) + c^T (C r); K_** in chunk x chunk tiles
        rows = []
        for s, e in self._chunks():
            xs = self.x[..., s:e, :].to(torch.float64)
            a, c = self._roots(self.x[..., s:e, :])
            assert ar is not None and cr is not None  # pass 1 ran over the same (non-empty) chunks
            row = c.mT @ cr - a.mT @ ar
            for s2, e2 in self._chunks():
                row = row + kernel_block(self.kernel, xs, x64[..., s2:e2, :]) @ r[..., s2:e2, :]
            rows.append(row)
        out = torch.cat(rows, -2).to(rhs.dtype if rhs.is_floating_point() else self.x.dtype)
        return out.squeeze(-1) if vec else out

    def _set_requires_grad(self, val: bool) -> None:
        # linear_operator flags every tensor argument (KroneckerProductLinearOperator does so for a batched
        # multi-output posterior); L and L_B are the model's cached factors and the centers a detached view of its
        # own: flagging them would make every later posterior carry a graph into the cache and accumulate .grad on
        # it. Only the test inputs can ask for a gradient, and only a leaf's flag can change.
        if self.x.is_leaf and self.x.is_floating_point():
            self.x.requires_grad_(val)

    def _expand_batch(self, batch_shape: torch.Size) -> NystromPosteriorCovariance:
        x = self.x.expand(*batch_shape, *self.x.shape[-2:])
        return self._like(x)

    def _unsqueeze_batch(self, dim: int) -> NystromPosteriorCovariance:
        x = self.x.unsqueeze(dim)
        return self._like(x)

    # The batch dimensions are those of x alone (centers and factors are shared): linear_operator's
    # generic batch operations would apply to every tensor argument.
    def _permute_batch(self, *dims: int) -> NystromPosteriorCovariance:
        x = self.x.permute(*dims, self.x.dim() - 2, self.x.dim() - 1)
        return self._like(x)

    def _getitem(self, row_index: Any, col_index: Any, *batch_indices: Any) -> LinearOperator:
        if batch_indices and all(isinstance(i, slice) and i == slice(None) for i in (row_index, col_index)):
            x = self.x[(*batch_indices, slice(None), slice(None))]
            return self._like(x)
        return super()._getitem(row_index, col_index, *batch_indices)


def posterior_roots(kernel: Kernel, xs: Tensor, centers: Tensor, L: Tensor, LB: Tensor) -> tuple[Tensor, Tensor]:
    r"""``a = L^{-1} K_M*`` and ``c = L_B^{-1} a`` (float64, ``(..., M, q)``) for test inputs ``xs``
    (``(..., q, d)``), with the factors of :class:`NystromPosteriorFactors`: ``O(q M (M + d))``.
    Differentiable w.r.t. ``xs``, and w.r.t. the kernel's parameters through ``K_*M`` (``L``, ``L_B`` constant)."""
    cen = centers.to(torch.float64)
    cen = cen.expand(*xs.shape[:-2], *cen.shape)  # GPyTorch kernels want both inputs with the same dims
    kxm = kernel_block(kernel, xs.to(torch.float64), cen)  # (..., q, M)
    # all batches as the columns of one (M, batch * q) right-hand side: a batched
    # solve would broadcast (copy) the M x M factors once per batch
    m, q = kxm.shape[-1], kxm.shape[-2]
    cols = kxm.reshape(-1, m).mT
    a = torch.linalg.solve_triangular(L, cols, upper=False)
    c = torch.linalg.solve_triangular(LB, a, upper=False)
    batch = kxm.shape[:-2]

    def back(t: Tensor) -> Tensor:  # (M, batch * q) -> (..., M, q)
        return t.mT.reshape(*batch, q, m).mT

    return back(a), back(c)


def shared_covariance_distribution(mean: Tensor, covar: LinearOperator) -> MultivariateNormal:
    """``N(mean, covar)`` for ``t`` outputs that share one ``q x q`` covariance: a
    ``MultivariateNormal`` for ``t = 1`` (``mean`` is ``(..., q, 1)``), else a
    ``MultitaskMultivariateNormal`` with ``covar (x) I_t`` in the interleaved (point, output) order,
    so the variances cost one ``covar.diagonal()`` whatever ``t`` is."""
    t = mean.shape[-1]
    if t == 1:
        return NystromMultivariateNormal(mean.squeeze(-1), covar)
    eye_t = DiagLinearOperator(torch.ones(*mean.shape[:-2], t, dtype=mean.dtype, device=mean.device))
    return NystromMultitaskMultivariateNormal(mean, KroneckerProductLinearOperator(covar, eye_t), interleaved=True)


def nystrom_posterior_mean(
    kernel: Kernel, x: Tensor, centers: Tensor, alpha: Tensor, chunk_size: int, backend: Any | None = None
) -> Tensor:
    """``K_*M alpha`` (docs/math.md §4; the constant mean not added), float64 ``(..., q, t)``.

    Computed in chunks of ``chunk_size`` test points, so no ``q x M`` block beyond a chunk
    is held: ``O(q M (d + t))`` time, ``O(chunk M)`` memory. ``alpha`` is ``(M,)`` or ``(M, t)``.
    Differentiable w.r.t. ``x``, and w.r.t. the kernel's parameters through ``K_*M`` only: ``alpha`` is a
    constant (it is not differentiated through the solve that produced it, whatever
    ``gpytorch.settings.detach_test_caches`` says; BoTorch turns that off for d/dX in e.g. knowledge
    gradient), so a prediction's gradient w.r.t. the hyperparameters is partial. To learn
    hyperparameters from a validation error, use :class:`gpfalkon.objectives.HoldOut`, which differentiates its
    own solve. ``backend``: an injected backend
    (:func:`~gpfalkon.backend.passes.backend_pass`), ``None`` for the in-memory pass.
    """
    a2 = alpha.to(torch.float64)
    a2 = a2.unsqueeze(-1) if a2.dim() == 1 else a2
    kernel_matmul = backend_pass(backend, "kernel_matmul")
    return kernel_matmul(kernel, x.to(torch.float64), centers.detach().to(torch.float64), a2, chunk_size)
