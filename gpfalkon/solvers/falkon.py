"""FALKON: the Nyström system solved by preconditioned conjugate gradient.

Generic in the preconditioner (any :class:`~gpfalkon.solvers.Preconditioner`); it imports
nothing from ``operators/``, so the operators can depend on the solvers and not the reverse.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from .._warn import warn_caller
from ..errors import CGNotConvergedWarning
from .cg import Callback, CGInfo, conjugate_gradient
from .protocols import Preconditioner

__all__ = ["falkon_solve"]


def falkon_solve(
    h_matmul: Callable[[Tensor], Tensor],
    precond: Preconditioner,
    rhs: Tensor,
    x0: Tensor | None = None,
    *,
    tol: float,
    max_iter: int,
    callback: Callback | None = None,
    verbose: bool = False,
    warn: bool = True,
    stagnation_window: int | None = 50,
    data_dtype: torch.dtype | None = None,
    quiet_below: float = 0.0,
    time_limit: float | None = None,
    data_matmul: Callable[[Tensor], Tensor] | None = None,
    kmm_weight: float | Tensor | None = None,
    verify: bool | None = None,
) -> tuple[Tensor, CGInfo]:
    """Solve ``H alpha = rhs`` by CG on ``W beta = B^T rhs``, ``W = B^T H B``, ``alpha = B beta``.

    ``h_matmul`` applies ``H`` to float64 ``(M, k)`` blocks (one data pass). The
    CG vectors live in float64 whatever the data dtype (``O(M k)`` memory), so a
    float32 kernel loses precision only in the kernel products themselves.
    ``x0`` warm-starts from a previous ``alpha`` (one extra data pass).

    With ``data_matmul`` (``v -> K_Mn K_nM v``) and ``kmm_weight`` (``c`` in ``H = K_Mn K_nM + c K_MM``),
    ``W`` is applied by the preconditioner's own ``w_matmul(u, data_matmul, kmm_weight)`` (``kmm_weight`` a tensor
    of one weight per column where the preconditioner holds one system per column:
    :class:`~gpfalkon.operators.penalty_path.PenaltyPathPreconditioner`)
    (:meth:`~gpfalkon.FalkonPreconditioner.w_matmul`: ``K_MM`` through its factor, no ``M x M``
    product) instead of through ``h_matmul``; the caller vouches that this gives the same ``W``.
    Cost: one data pass per iteration (one more with a warm start, and one per check of a claimed convergence:
    ``verify``, :func:`~gpfalkon.solvers.conjugate_gradient`) plus ``O(M^2 k)`` per iteration for the triangular
    solves; forming ``rhs = K_Mn y`` is one more pass.

    Emits :class:`CGNotConvergedWarning` when ``tol > 0`` was not reached in
    ``max_iter`` iterations (``tol=0`` asks for exactly ``max_iter`` iterations) or before
    ``time_limit`` seconds of CG (see :func:`~gpfalkon.solvers.conjugate_gradient`).

    ``info.extra`` records the wall seconds of the CG (``"cg_seconds"``) and the part of them spent
    applying ``B`` and ``B^T`` (``"precond_apply_seconds"``: the ``O(M^2 k)`` triangular solves, against
    the ``O(n M k)`` data passes of ``h_matmul``); on CUDA the queued kernels are waited for at
    each boundary (CG reads a residual norm every iteration, so it waits there anyway).
    """
    sync = torch.cuda.synchronize if rhs.device.type == "cuda" else None
    # seconds inside the preconditioner's methods; of them, inside the data passes they call (w_matmul)
    clock = [0.0, 0.0]

    def timed(slot: int, fn: Callable[[Tensor], Tensor], u: Tensor) -> Tensor:
        if sync is not None:
            sync(rhs.device)
        t = time.perf_counter()
        out = fn(u)
        if sync is not None:
            sync(rhs.device)
        clock[slot] += time.perf_counter() - t
        return out

    def timed_apply(fn: Callable[[Tensor], Tensor], u: Tensor) -> Tensor:
        # float64 out: CG's vectors and h_matmul's input are float64 whatever dtype a preconditioner stores its
        # factors in (FalkonOptions.precond_dtype=float32 applies them in float32)
        return timed(0, fn, u).to(torch.float64)

    # (precond.w_matmul, data_matmul, kmm_weight) where W is applied by the preconditioner
    split: tuple[Callable[..., Tensor], Callable[[Tensor], Tensor], float | Tensor] | None = None
    if data_matmul is not None:
        w_fn = getattr(precond, "w_matmul", None)
        if w_fn is None or kmm_weight is None:
            raise ValueError("data_matmul needs kmm_weight and a preconditioner with a w_matmul method")
        # (a tensor: one weight per column, for a preconditioner per column such as a penalty path's)
        split = (w_fn, data_matmul, kmm_weight if isinstance(kmm_weight, Tensor) else float(kmm_weight))
    t_start = time.perf_counter()
    b = timed_apply(precond.apply_bt, rhs.to(torch.float64))

    def w_matmul(u: Tensor) -> Tensor:
        if split is None:
            return timed_apply(precond.apply_bt, h_matmul(timed_apply(precond.apply_b, u)))
        w_fn, data_fn, c = split
        # the triangular solves' seconds: the whole product less its data pass (clock[1])
        return timed_apply(lambda x: w_fn(x, lambda v: timed(1, data_fn, v), c), u)

    beta0 = precond.apply_b_inv(x0.to(torch.float64)) if x0 is not None else None
    beta, info = conjugate_gradient(
        w_matmul,
        b,
        beta0,
        tol=tol,
        max_iter=max_iter,
        callback=None if callback is None else (lambda i, bt, rel: callback(i, precond.apply_b(bt).to(torch.float64),
                                                                             rel)),
        verbose=verbose,
        stagnation_window=stagnation_window,
        data_dtype=data_dtype,
        quiet_below=quiet_below,
        time_limit=time_limit,
        verify=verify,
    )
    if warn and tol > 0 and not info.converged and info.extra.get("time_limit"):
        warn_caller(
            f"FALKON CG stopped at its time limit after {info.iterations} iterations "
            f"({time.perf_counter() - t_start:.3g} s of CG) with relative "
            f"residual {float(info.final_residual.max()):.3g} > tol={tol:g}",
            CGNotConvergedWarning,
        )
    elif (warn and tol > 0 and not info.converged and info.iterations >= max_iter and not info.extra.get("stagnated")
            and not info.extra.get("drifted") and float(info.final_residual.max()) > quiet_below):
        # only when the cap stopped it (a stagnated solve has warned with its own cause)
        warn_caller(
            f"FALKON CG reached max_iter={max_iter} with relative residual "
            f"{float(info.final_residual.max()):.3g} > tol={tol:g}; raise max_iter or loosen tol "
            "(tol=0 runs exactly max_iter iterations without this warning)",
            CGNotConvergedWarning,
        )
    alpha = timed_apply(precond.apply_b, beta)
    info.extra.update(cg_seconds=time.perf_counter() - t_start, precond_apply_seconds=clock[0] - clock[1])
    return alpha, info
