"""Gradients of blockwise kernel products, one pass over the data, no n x n or n x M graph.

Every derivative gpfalkon needs w.r.t. the kernel hyperparameters, the centers or
the inputs has the form ``d/dtheta sum_b <K_b(theta), W_b>`` where ``W_b`` is a
low-rank ``rows x M`` weight built from constants (vectors already computed).
:func:`blockwise_kernel_grad` evaluates it block by block: each block's kernel is
recomputed with autograd enabled through GPyTorch (so *any* kernel differentiates
correctly), a scalar surrogate is formed and differentiated, and the graph is
dropped before the next block. Peak memory: one block's autograd graph.

:class:`KernelProduct` is the differentiable ``K_nM^T (K_nM U + V)``: forward by
the fast :class:`~gpfalkon.backend.KernelEngine`, backward by one such pass.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from gpytorch.kernels import Kernel
from torch import Tensor
from torch.autograd.function import once_differentiable

from .blocks import GRADIENT, block_rows_for, row_blocks
from .engine import KernelEngine
from .prefetch import row_slices
from .stationary_grad import grad_kernel_block

__all__ = [
    "KernelProduct",
    "backward_params",
    "blockwise_kernel_grad",
    "kernel_params",
    "kernel_product",
    "scatter_grads",
]


def kernel_params(kernel: Kernel) -> list[Tensor]:
    """The kernel's parameters that require a gradient (the raw, unconstrained ones)."""
    return [p for p in kernel.parameters() if p.requires_grad]


def backward_params(kernel: Kernel, saved: Sequence[Tensor]) -> list[Tensor]:
    """The tensors a hand-written backward differentiates the kernel w.r.t.: the kernel's
    parameters as they are when the backward runs, matching ``saved`` (those given to the
    forward) position by position.

    They are the same objects unless the forward ran under ``torch.func.functional_call``
    (the sharded objectives do: :mod:`gpfalkon.backend.distributed`), whose substitutes are
    gone by the time of the backward: the kernel blocks recomputed then use the module's own
    parameters, and the gradients w.r.t. those are the gradients w.r.t. the substitutes.
    """
    now = kernel_params(kernel)
    if len(now) != len(saved) or any(a.shape != b.shape for a, b in zip(now, saved, strict=False)):
        raise RuntimeError("the kernel's parameters changed between the forward and the backward pass")
    return now


def scatter_grads(needs: Sequence[bool], grads: Sequence[Tensor | None], sign: float = 1.0) -> list[Tensor | None]:
    """Spread the gradients of the needed inputs (in order) back over all inputs."""
    it = iter(grads)
    out: list[Tensor | None] = []
    for need in needs:
        g = next(it) if need else None
        out.append(None if g is None else (g if sign == 1.0 else sign * g))
    return out


SurrogateFn = Callable[[int, int, Tensor], Tensor]


def blockwise_kernel_grad(
    kernel: Kernel,
    x: Tensor,
    centers: Tensor,
    surrogate: SurrogateFn,
    params: Sequence[Tensor],
    need_x: bool,
    need_centers: bool,
    memory_budget: int | None = None,
    block_rows: int | None = None,
) -> tuple[Tensor | None, Tensor | None, list[Tensor | None]]:
    """Gradients of ``sum_b surrogate(start, stop, K_b)`` with ``K_b = k(x[start:stop], centers)``.

    ``surrogate`` receives the block with its autograd graph and returns a scalar;
    it may also accumulate side results computed from ``K_b.detach()``.

    Returns ``(grad_x, grad_centers, grad_params)`` (``None`` where not requested
    or unused). Cost: one pass over the data evaluating the kernel with autograd,
    in blocks sized from ``memory_budget`` / ``block_rows`` (default: the settings).
    """
    n = x.shape[0]
    rows = block_rows_for(
        n,
        centers.shape[0],
        torch.finfo(x.dtype).bits // 8,
        GRADIENT,
        memory_budget=memory_budget,
        block_rows=block_rows,
        device=x.device,
        d=x.shape[1],
    )
    grad_x = torch.zeros_like(x) if need_x else None
    grad_c = torch.zeros_like(centers) if need_centers else None
    grad_p: list[Tensor | None] = [None] * len(params)
    with torch.enable_grad():
        c = centers.detach().requires_grad_(True) if need_centers else centers.detach()
        for start, stop, xb in row_slices(x, list(row_blocks(n, rows))):
            xb = xb.detach()
            if need_x:
                xb.requires_grad_(True)
            kb = grad_kernel_block(kernel, xb, c)
            s = surrogate(start, stop, kb)
            inputs: list[Tensor] = list(params)
            if need_x:
                inputs.append(xb)
            if need_centers:
                inputs.append(c)
            if not inputs or not s.requires_grad:
                continue
            grads = torch.autograd.grad(s, inputs, allow_unused=True)
            for i in range(len(params)):
                g = grads[i]
                if g is not None:
                    prev = grad_p[i]
                    grad_p[i] = g if prev is None else prev + g
            if grad_x is not None and grads[len(params)] is not None:  # grad_x is not None iff need_x
                grad_x[start:stop] = grads[len(params)]
            if grad_c is not None and grads[-1] is not None:  # grad_c is not None iff need_centers
                grad_c += grads[-1]
    return grad_x, grad_c, grad_p


class KernelProduct(torch.autograd.Function):
    """``out = K_nM^T (K_nM U + V)``, differentiable w.r.t. U, V, X, C and kernel parameters.

    Backward (G = dL/dout, M x k), in one pass with ``R_b = K_b U + V_b`` and
    ``Q_b = K_b G`` held constant:
    ``dL/dU = K^T K G``, ``dL/dV = K G``, and for theta in (X, C, kernel params)
    ``dL/dtheta = d/dtheta sum_b [ <K_b(theta) G, R_b> + <K_b(theta) U, Q_b> ]``.
    """

    @staticmethod
    def forward(ctx, engine: KernelEngine, u: Tensor, v: Tensor, x: Tensor, centers: Tensor, *params: Tensor) -> Tensor:
        # the 1-D empty tensor stands for "absent" (a 2-D v with 0 rows is an empty shard's rows)
        uu = None if u.dim() == 1 and u.numel() == 0 else u
        vv = None if v.dim() == 1 and v.numel() == 0 else v
        # this process's rows only (a sharded engine's sum over ranks is kernel_product's business)
        out = _local_kmn_k(engine)(uu, vv).to(x.dtype)
        ctx.engine = engine
        ctx.has_u, ctx.has_v = uu is not None, vv is not None
        ctx.u_dtype, ctx.v_dtype = u.dtype, v.dtype
        # a row source (data larger than memory) is read again in the backward pass, not saved
        ctx.source = None if isinstance(x, Tensor) else x
        ctx.save_for_backward(u, v, x if ctx.source is None else centers.new_empty(0), centers, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        u, v, x, centers, *params = ctx.saved_tensors
        if ctx.source is not None:
            x = ctx.source
        u, v = u.to(x.dtype), v.to(x.dtype)
        engine: KernelEngine = ctx.engine
        need_u = ctx.has_u and ctx.needs_input_grad[1]
        need_v = ctx.has_v and ctx.needs_input_grad[2]
        need_x, need_c = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        need_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        grad_u = grad_v = grad_x = grad_c = None
        grad_p: list[Tensor | None] = [None] * len(params)
        g = grad.to(x.dtype)
        if not (need_x or need_c or any(need_p)):
            # only U / V: two fast products, no autograd
            q = engine.k_matmul(g)
            if need_u:
                grad_u = _local_kmn_k(engine)(g).to(ctx.u_dtype)
            if need_v:
                grad_v = q.to(ctx.v_dtype)
            return (None, grad_u, grad_v, grad_x, grad_c, *grad_p)
        acc_u = torch.zeros(centers.shape[0], g.shape[-1], dtype=torch.float64, device=x.device) if need_u else None
        grad_v = torch.zeros_like(v) if need_v else None
        uu = u if ctx.has_u else None
        vv = v if ctx.has_v else None

        def surrogate(start: int, stop: int, kb: Tensor) -> Tensor:
            kd = kb.detach()
            q = kd @ g
            r = kd @ uu if uu is not None else None
            if vv is not None:
                r = vv[start:stop] if r is None else r + vv[start:stop]
            if acc_u is not None:
                acc_u.add_((kd.t() @ q).to(torch.float64))
            if grad_v is not None:
                grad_v[start:stop] = q
            assert r is not None  # u or v is present (the forward product needs one)
            s = ((kb @ g) * r).sum()
            if uu is not None:
                s = s + ((kb @ uu) * q).sum()
            return s

        active = [p for p, need in zip(backward_params(engine.kernel, params), need_p, strict=False) if need]
        # an engine class may override the gradient pass (a backend's ``blockwise_kernel_grad``)
        grad_pass = getattr(type(engine), "blockwise_kernel_grad", blockwise_kernel_grad)
        gx, gc, gp = grad_pass(
            engine.kernel,
            x,
            centers,
            surrogate,
            active,
            need_x,
            need_c,
            engine.memory_budget,
            engine.block_rows_setting,
        )
        grad_p = scatter_grads(need_p, gp)
        if acc_u is not None:
            grad_u = acc_u.to(ctx.u_dtype)
        if grad_v is not None:
            grad_v = grad_v.to(ctx.v_dtype)
        return (None, grad_u, grad_v, gx, gc, *grad_p)


def _local_kmn_k(engine: KernelEngine) -> Callable[..., Tensor]:
    """The engine's product on this process's rows (``local_kmn_k`` of a sharded engine)."""
    local = getattr(engine, "local_kmn_k", None)
    return local if callable(local) else engine.kmn_k


def kernel_product(engine: KernelEngine, u: Tensor | None, v: Tensor | None, x: Tensor, centers: Tensor) -> Tensor:
    """Differentiable ``K_nM^T (K_nM u + v)`` (see :class:`KernelProduct`).

    With a sharded engine (:class:`~gpfalkon.backend.distributed.ShardedEngine`) the product of
    this process's rows is summed over ranks by the differentiable ``all_reduce_sum``, whose
    backward first sums the incoming gradients, as the joint-graph rule of
    :meth:`~gpfalkon.backend.distributed.DistributedBackend.joint_objective` requires.
    """
    empty = torch.empty(0, dtype=x.dtype, device=x.device)  # x may be a row source, not a tensor
    params = kernel_params(engine.kernel)
    out = KernelProduct.apply(engine, empty if u is None else u, empty if v is None else v, x, centers, *params)
    reduce = getattr(engine, "reduce_product", None)
    if callable(reduce):
        live = [t for t in (u, v, centers, *params) if t is not None and t.requires_grad]
        anchor = sum(t.sum() for t in live) * 0.0 if live and torch.is_grad_enabled() else None
        out = reduce(out, anchor)
    return out
