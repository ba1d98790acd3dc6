"""The differentiable and the leverage-score passes over the rows (in-memory backend).

These complement :class:`~gpfalkon.backend.KernelEngine` (the no-grad products of the
FALKON solve) with the passes whose kernel blocks go through GPyTorch: the objectives'
aggregates (differentiable, checkpointed block by block), the per-row maps over whitened
blocks (``S_ii``), the kernel diagonal (``tr K_nn``) and the whitened squared norms of the
BLESS leverage-score estimator. Each loops over :func:`~gpfalkon.backend.row_blocks`; an
injected backend can replace any of them (:func:`backend_pass`);
every ``M``-sized result is a sum over blocks (the place where row shards' results are
summed).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, TypeGuard

import torch
import torch.utils.checkpoint as _checkpoint
from gpytorch.kernels import Kernel
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .. import settings
from .blocks import AGGREGATE, GRAPH_SHARE, keeps_graph, memory_budget_for, row_blocks
from .engine import KernelEngine, kernel_block, stationary_spec
from .prefetch import row_slices
from .sources import RowSource
from .stationary_grad import grad_kernel_block

#: torch's selective activation checkpointing (torch >= 2.4); ``None``: every product is recomputed
selective_contexts: Callable[..., Any] | None = getattr(_checkpoint, "create_selective_checkpoint_contexts", None)

__all__ = [
    "WhitenedAggregates",
    "backend_pass",
    "is_sharded",
    "kernel_diagonal",
    "kernel_matmul",
    "map_whitened_blocks",
    "reduce_rows",
    "total_rows",
    "uses_gram_route",
    "whitened_aggregates",
    "whitened_sq_norms",
]


def is_sharded(backend: Any | None) -> TypeGuard[Any]:
    """Does ``backend`` hold one shard of the rows (it then reports the global row count)?"""
    return callable(getattr(backend, "global_rows", None))


def total_rows(backend: Any | None, x: Tensor) -> int:
    """The global ``n``: ``x.shape[0]``, or the sum over shards for a sharded backend (a
    collective: every rank must call it)."""
    return int(backend.global_rows(x)) if is_sharded(backend) else int(x.shape[0])


def reduce_rows(backend: Any | None, *tensors: Tensor, anchor: Tensor | None = None) -> list[Tensor]:
    """Sums over rows computed on this process's rows, completed over all shards (identity
    for the in-memory backend; a differentiable collective for a sharded one)."""
    if is_sharded(backend):
        return list(backend.reduce(*tensors, anchor=anchor))
    return list(tensors)


PASSES = ("whitened_aggregates", "map_whitened_blocks", "kernel_matmul", "kernel_diagonal", "whitened_sq_norms")


def backend_pass(backend: Any | None, name: str) -> Callable[..., Any]:
    """The pass ``name`` of an injected backend (``FalkonOptions.backend``), else this module's.

    A backend overrides a pass by defining it as an attribute with this module's signature
    (e.g. a :class:`~gpfalkon.backend.KernelEngine` subclass with a ``staticmethod``); a
    backend without it, or ``None``, gets the in-memory pass.
    """
    if name not in PASSES:
        raise ValueError(f"unknown backend pass {name!r}; known: {PASSES}")
    fn = getattr(backend, name, None) if backend is not None else None
    return fn if callable(fn) else globals()[name]


class WhitenedAggregates(NamedTuple):
    """Sums over the rows with ``A = L^{-1} K_Mn`` (docs/math.md §5.1)."""

    AAt: Tensor  # (M, M)
    AY: Tensor  # (M, t)
    tr_ktilde: Tensor  # ()  ||A||_F^2
    tr_knn: Tensor  # ()  sum_i k(x_i, x_i)


def whitened_aggregates(
    kernel: Kernel, x: Tensor, y: Tensor, centers: Tensor, L: Tensor, rows: int
) -> WhitenedAggregates:
    """``A A^T``, ``A y``, ``||A||_F^2`` and ``tr K_nn`` for ``A = L^{-1} K_Mn`` (``L`` lower).

    Differentiable w.r.t. ``x``, ``centers``, ``L`` and the kernel's parameters. Each block is
    checkpointed, so the graph holds ``O(M^2 + M t)`` per block, not the ``rows x M`` blocks, except
    where the whole graph is small (one block, or within a share of the memory budget:
    :func:`_keep_graph`). Two routes to the same sums (docs/math.md §5.1):

    * **Gram route** (CPU, data in float32 or narrower; :func:`uses_gram_route`):
      ``G = sum_b K_Mb K_bM`` and ``g = sum_b K_Mb y_b`` accumulated in float64, then
      ``A A^T = L^{-1} G L^{-T}``, ``A y = L^{-1} g``, ``||A||_F^2 = tr(A A^T)``. Per block one
      float64 GEMM forward and one backward (``_GramProjection``; the block's small products are
      kept, not recomputed, by a selective-checkpoint policy), ``O(n M (M + d + t))`` at GEMM
      speed, plus ``O(M^3)`` once for the whitening.
    * **Solve route** (otherwise): ``A_b = L^{-1} K_Mb`` by a triangular solve per block and
      ``A_b A_b^T`` in the data dtype, ``O(n M (M + d + t))`` at triangular-solve speed, about
      four such products per block forward and backward.

    Why two: the Gram route's rounding of ``G`` is amplified by ``1 / lambda_min(L L^T)``,
    and ``L L^T`` carries a jitter of about ``eps_data M`` times its diagonal
    (:meth:`~gpfalkon.objectives.base.NystromObjective.cholesky_kmm`). Accumulated in float64
    for float32 data that amplified error is ``eps_64 / (eps_32 M)`` (below 1e-9): as accurate
    as the solve route or more (``tests/test_objectives.py``); for float64 data it would be
    ``1 / M``, so float64 data take the solve route. On CUDA the solve route is kept: float64
    GEMMs run at 1/32-1/64 of the float32 rate on most non-datacentre GPUs.
    """
    if uses_gram_route(L):
        return _gram_aggregates(kernel, x, y, centers, L, rows)
    return _solve_aggregates(kernel, x, y, centers, L, rows)


def uses_gram_route(L: Tensor) -> bool:
    """Does :func:`whitened_aggregates` take the Gram route for this factor? With
    :class:`gpfalkon.settings.aggregate_route` ``"auto"``: on the CPU for float32 (or narrower) data."""
    route = settings.aggregate_route.value()
    if route != "auto":
        return bool(route == "gram")
    return L.device.type == "cpu" and torch.finfo(L.dtype).eps > 1e-10


class _GramProjection(torch.autograd.Function):
    """``(G, g) = (K^T K, K^T y)`` with the backward ``dK = K (dG + dG^T) + y dg^T``, ``dy = K dg``:
    one GEMM for ``dG`` where autograd's ``mm`` backward takes two (a gradient for each of the two
    operands, which here are one tensor), and for one target column the rank-one ``y dg^T`` added by a
    broadcast product into ``dK`` instead of autograd's ``(rows, 1) x (1, M)`` GEMM, which MKL runs far
    below its GEMM rate (``benchmarks/results/gram-projection.md``); the same gradients bit for bit.
    Written by hand because torch has no symmetric-rank-k product with autograd."""

    @staticmethod
    def forward(ctx: Any, kb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(kb, yb)
        return kb.mT @ kb, kb.mT @ yb

    @staticmethod
    def backward(ctx: Any, d_gram: Tensor | None, d_proj: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        kb, yb = ctx.saved_tensors
        dk = dy = None
        if ctx.needs_input_grad[0]:
            dk = kb @ (d_gram + d_gram.mT) if d_gram is not None else torch.zeros_like(kb)
            if d_proj is not None:
                if yb.shape[-1] == 1:
                    dk.addcmul_(yb, d_proj.mT)
                else:
                    dk.addmm_(yb, d_proj.mT)
        if ctx.needs_input_grad[1] and d_proj is not None:
            dy = kb @ d_proj
        return dk, dy


def _keep_center_products(m: int, rows: int) -> Callable[..., Any]:
    """Selective-checkpoint policy: keep the outputs of the block's ``K_Mb @ (.)`` products
    (first operand ``m x rows``: ``M x M`` and ``M x t``, small) so that the backward pass's
    recomputation of the block skips their GEMMs; recompute everything else (the kernel block)."""

    policies = _checkpoint.CheckpointPolicy  # torch >= 2.4 (checked by the caller)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op is torch.ops.aten.mm.default and tuple(args[0].shape) == (m, rows):
            return policies.MUST_SAVE
        return policies.PREFER_RECOMPUTE

    return policy


class _Reread:
    """A row source's block as an argument of a checkpointed block function: the rows read for the forward pass
    the first time, read again from the source when the backward pass recomputes the block.
    ``torch.utils.checkpoint`` keeps a block's tensor inputs until the backward pass; for an in-memory ``x`` they
    are views, for a source freshly read rows, which would keep all ``n x d`` of data larger than memory alive."""

    def __init__(self, source: Any, start: int, stop: int, rows: Tensor) -> None:
        self.source, self.start, self.stop = source, start, stop
        self.rows: Tensor | None = rows

    def get(self) -> Tensor:
        rows, self.rows = self.rows, None
        return rows if rows is not None else self.source.read(self.start, self.stop)


def _rows_arg(x: Any, start: int, stop: int, xb: Tensor) -> Tensor | _Reread:
    """``xb`` for an in-memory ``x``, a :class:`_Reread` for a row source."""
    return _Reread(x, start, stop, xb) if isinstance(x, RowSource) else xb


def _rows_of(xb: Tensor | _Reread) -> Tensor:
    return xb.get() if isinstance(xb, _Reread) else xb


def _checkpointed(block: Callable[..., Any], keep: bool, *args: Any,
                  context_fn: Callable[..., Any] | None = None) -> Any:
    """``block(*args)``: called directly where ``keep`` (the pass keeps its graph), else checkpointed (the
    graph keeps the block's inputs, the backward pass recomputes the block; ``context_fn``: a
    selective-checkpoint policy)."""
    if keep:
        return block(*args)
    if context_fn is None:
        return checkpoint(block, *args, use_reentrant=False)
    return checkpoint(block, *args, use_reentrant=False, context_fn=context_fn)


def _keep_graph(x: Tensor, centers: Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether a differentiable pass over these blocks keeps its graph: where it has one block (its
    backward pass would hold the recomputed block anyway: checkpointing it bounds no memory), or where the
    whole graph fits :data:`~gpfalkon.backend.blocks.AGGREGATE`'s share of the memory budget
    (:func:`~gpfalkon.backend.blocks.keeps_graph`; measured in ``benchmarks/results/objective-step-whole.md``).
    The budget is the setting (:class:`gpfalkon.settings.memory_budget`, else the automatic one of ``x``'s
    device); the objectives set it to their model's own ``memory_budget`` while their passes run. The
    Exact objectives run two such passes per step (aggregates and a per-block map): up to a quarter of the
    budget together."""
    return len(ranges) == 1 or keeps_graph(x.shape[0], centers.shape[0], AGGREGATE, device=x.device)


def _gram_aggregates(
    kernel: Kernel, x: Tensor, y: Tensor, centers: Tensor, L: Tensor, rows: int
) -> WhitenedAggregates:
    """The Gram route of :func:`whitened_aggregates`."""

    def block(xb_: Tensor | _Reread, yb: Tensor, c_: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xb = _rows_of(xb_)
        kb = grad_kernel_block(kernel, xb, c_).to(torch.float64)  # (rows, M)
        gram, proj = _GramProjection.apply(kb, yb.to(torch.float64))
        return gram, proj, kernel(xb, diag=True).sum()

    m = centers.shape[0]
    acc: list[Tensor] | None = None
    ranges = list(row_blocks(x.shape[0], rows))
    keep = _keep_graph(x, centers, ranges)
    # the selective policy keeps every block's M x M Gram until the backward pass (its GEMM is not recomputed):
    # len(ranges) M (M + t) float64 values, taken only where they fit the graph's share of the memory budget
    # (as _keep_graph's whole graph); else the backward pass recomputes them and one block is held at a time
    saved = len(ranges) * m * (m + (y.shape[-1] if y.dim() > 1 else 1)) * 8
    contexts = selective_contexts if saved <= memory_budget_for(None, device=x.device) // GRAPH_SHARE else None
    for s, e, xb in row_slices(x, ranges):
        policy = None if contexts is None else partial(contexts, _keep_center_products(m, e - s))
        out = _checkpointed(block, keep, _rows_arg(x, s, e, xb), y[s:e], centers, context_fn=policy)
        acc = list(out) if acc is None else [a + o for a, o in zip(acc, out, strict=True)]
    assert acc is not None  # x has at least one row (validated by the callers)
    gram, ky, tr_knn = acc
    L64 = L.to(torch.float64)
    half = torch.linalg.solve_triangular(L64, gram, upper=False)  # L^{-1} G
    aat = torch.linalg.solve_triangular(L64, half.mT, upper=False)  # L^{-1} G L^{-T} (G symmetric)
    aat = (aat + aat.mT) / 2
    ay = torch.linalg.solve_triangular(L64, ky, upper=False)
    dt = L.dtype
    return WhitenedAggregates(aat.to(dt), ay.to(dt), aat.diagonal().sum().to(dt), tr_knn)


def _solve_aggregates(
    kernel: Kernel, x: Tensor, y: Tensor, centers: Tensor, L: Tensor, rows: int
) -> WhitenedAggregates:
    """The solve route of :func:`whitened_aggregates`."""

    def block(xb_: Tensor | _Reread, yb: Tensor, L_: Tensor, c_: Tensor):
        xb = _rows_of(xb_)
        kb = grad_kernel_block(kernel, xb, c_)
        ab = torch.linalg.solve_triangular(L_, kb.mT, upper=False)  # (M, rows)
        return ab @ ab.mT, ab @ yb, ab.square().sum(), kernel(xb, diag=True).sum()

    acc: list[Tensor] | None = None
    ranges = list(row_blocks(x.shape[0], rows))
    keep = _keep_graph(x, centers, ranges)
    for s, e, xb in row_slices(x, ranges):
        out = _checkpointed(block, keep, _rows_arg(x, s, e, xb), y[s:e], L, centers)
        acc = list(out) if acc is None else [a + o for a, o in zip(acc, out, strict=False)]
    assert acc is not None  # x has at least one row (validated by the callers)
    return WhitenedAggregates(*acc)


def map_whitened_blocks(
    kernel: Kernel, x: Tensor, centers: Tensor, L: Tensor, fn: Callable[[Tensor, int, int], Tensor], rows: int
) -> list[Tensor]:
    """``[fn(A_b, start, stop) for each block]`` with ``A_b = L^{-1} K_Mb`` (checkpointed, differentiable)."""
    outs = []
    ranges = list(row_blocks(x.shape[0], rows))
    keep = _keep_graph(x, centers, ranges)
    for s, e, x_b in row_slices(x, ranges):

        def block(xb: Tensor | _Reread, L_: Tensor, c_: Tensor, s: int = s, e: int = e) -> Tensor:
            ab = torch.linalg.solve_triangular(L_, grad_kernel_block(kernel, _rows_of(xb), c_).mT, upper=False)
            return fn(ab, s, e)

        outs.append(_checkpointed(block, keep, _rows_arg(x, s, e, x_b), L, centers))
    return outs


def needs_graph(kernel: Kernel, *tensors: Tensor) -> bool:
    """Would autograd record a product of these tensors and ``kernel``'s parameters now?"""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in kernel.parameters())


def kernel_matmul(kernel: Kernel, x: Tensor, centers: Tensor, alpha: Tensor, rows: int) -> Tensor:
    """``k(x, centers) @ alpha`` (``(..., q, t)``) in blocks of ``rows`` points of ``x`` (batch
    dimensions allowed): never a ``q x M`` block beyond ``rows x M``, with a graph too: beyond the graph's share of
    the memory budget each block is checkpointed. Differentiable w.r.t. everything; cost ``O(q M (d + t))``.

    Where no gradient is recorded (``torch.no_grad()``, or nothing requires grad), ``x`` is 2-D and
    ``kernel`` is one the kernel engine's fast path knows (RBF / Matern, ARD, optionally scaled:
    :func:`~gpfalkon.backend.stationary_spec`), the product goes through
    :meth:`KernelEngine.k_matmul <gpfalkon.backend.KernelEngine.k_matmul>` instead: one augmented
    matmul and an ``exp2`` pass per block, in ``x``'s dtype, blocks of at most ``rows`` points
    (``benchmarks/results/predict.md`` measures both)."""
    if (x.dim() == 2 and centers.dim() == 2 and alpha.dim() == 2 and stationary_spec(kernel) is not None
            and not needs_graph(kernel, x, centers, alpha)):
        eng = KernelEngine(kernel, x, centers.to(x.dtype), store=False, block_rows=rows)
        return eng.k_matmul(alpha).to(torch.promote_types(x.dtype, alpha.dtype))
    c = centers.expand(*x.shape[:-2], *centers.shape)  # the same number of dims as x (GPyTorch's kernels need it)
    ranges = list(row_blocks(x.shape[-2], rows))
    # the graph of every block's kernel values (several q x M tensors in all) is kept only where it fits the graph's
    # share of the memory budget; else each block is checkpointed (the backward pass recomputes it)
    keep = len(ranges) == 1 or keeps_graph(x.shape[:-1].numel(), centers.shape[-2], AGGREGATE, device=x.device)

    def block(xb: Tensor, c_: Tensor, a_: Tensor) -> Tensor:
        return grad_kernel_block(kernel, xb, c_) @ a_

    return torch.cat([_checkpointed(block, keep, x[..., s:e, :], c, alpha) for s, e in ranges], -2)


def kernel_diagonal(kernel: Kernel, x: Tensor, rows: int, *, dtype: torch.dtype | None = None) -> Tensor:
    """``k(x_i, x_i)`` for every row (``O(n d)``), in ``dtype`` (default the kernel's output),
    differentiable. Raises ``ValueError`` for kernels whose diagonal is not one value per row."""
    parts = []
    for s, e, xb in row_slices(x, list(row_blocks(x.shape[0], rows))):
        xb = xb if dtype is None else xb.to(dtype)
        d = kernel(xb, xb, diag=True)
        d = d if isinstance(d, Tensor) else d.to_dense()
        if d.shape != (e - s,):
            raise ValueError(
                f"kernel must be a single-output kernel without batch dimensions: its diagonal on "
                f"{e - s} points has shape {tuple(d.shape)}"
            )
        parts.append(d)
    return torch.cat(parts)


def whitened_sq_norms(kernel: Kernel, x: Tensor, basis: Tensor, chol: Tensor, rows: int,
                      indices: Tensor | None = None) -> Tensor:
    """``||chol^{-1} k(basis, x_i)||^2`` for the rows ``i`` of ``x`` (or ``x[indices]``), float64, no grad.

    ``chol`` is lower triangular (``J x J``). Cost ``O(r J (J + d))`` for ``r`` rows, memory
    ``O(rows J + J^2)``. BLESS's estimator (docs/math.md §3.4) is ``(K_ii - this) / (n lambda)``.
    """
    count = x.shape[0] if indices is None else indices.numel()
    out = torch.empty(count, dtype=torch.float64, device=x.device)
    b64 = basis.to(torch.float64)
    with torch.no_grad():
        for s, e in row_blocks(count, rows):
            xb = x[s:e] if indices is None else x[indices[s:e]]
            kb = kernel_block(kernel, xb.to(torch.float64), b64).to(torch.float64)  # (b, J)
            z = torch.linalg.solve_triangular(chol, kb.mT, upper=False)  # (J, b)
            out[s:e] = z.square().sum(0)
    return out
