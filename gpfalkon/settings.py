"""Global settings for gpfalkon, in the style of ``gpytorch.settings``.

Each setting is a context manager (``with gpfalkon.settings.memory_budget(2**30): ...``)
whose class method ``value()`` returns the value in force.
"""
from __future__ import annotations

from linear_operator.settings import _value_context

__all__ = ["block_rows", "cg_tolerance", "max_cg_iterations", "memory_budget"]


class memory_budget(_value_context):
    """Bytes the kernel-product engine may hold for kernel blocks (default 4 GiB).

    When the whole ``n x M`` matrix ``K_nM`` fits in the budget it is computed once
    and kept for the lifetime of the engine; otherwise it is recomputed block by
    block on every product, each block at most ``block_rows x M``.
    """

    _global_value: int = 4 * 2**30


class block_rows(_value_context):
    """Rows of X per kernel block when ``K_nM`` is computed on the fly.

    Default ``None``: blocks of about 2 MiB (``2 MiB / (M * itemsize)`` rows, at
    least 32), which keep the in-place kernel passes and the two thin products in
    cache (``benchmarks/engine.py`` sweeps it). The engine lowers any value whose
    blocks would not fit in the memory budget.
    """

    _global_value: int | None = None


class cg_tolerance(_value_context):
    """Default relative residual ``||r_k|| / ||b||`` at which FALKON's CG stops.

    Used when neither the solver call nor ``linear_operator.settings.cg_tolerance``
    (when set below its default of 1) gives one. Default ``1e-6``: test error stops
    changing long before (``benchmarks/fit.py``); gradients want tighter.
    """

    _global_value: float = 1e-6


class max_cg_iterations(_value_context):
    """Default cap on FALKON CG iterations (each is one pass over the data). Default 100."""

    _global_value: int = 100
