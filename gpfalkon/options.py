"""One options object for the Nyström solve and its passes over the data.

:class:`FalkonOptions` replaces the keyword arguments that used to repeat across
:class:`~gpfalkon.FalkonGP`, :meth:`~gpfalkon.FalkonGP.nystrom_operator`,
:class:`~gpfalkon.NystromKRROperator` and the kernel engine (the idea of falkon's
``FalkonOptions``). Fields left ``None`` follow :mod:`gpfalkon.settings` (and, for the
stopping rule, :mod:`linear_operator.settings`) *at the time of the call*:
:meth:`FalkonOptions.resolved` reads them once per operation, so
``with gpfalkon.settings.cg_tolerance(1e-8): model.fit()`` keeps working.

The old keyword arguments still work: they build the options
(:meth:`FalkonOptions.merged`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from linear_operator import settings as lo_settings

from . import settings
from .backend.blocks import memory_budget_for, resolve_block_rows

__all__ = ["FalkonOptions", "ResolvedOptions", "option_property"]

_DTYPES = (torch.float32, torch.float64)
#: the values of :attr:`FalkonOptions.solve_method`
SOLVE_METHODS = ("auto", "cg", "direct")


@dataclass(frozen=True)
class FalkonOptions:
    """How a Nyström KRR system is solved and how the data are passed over.

    Attributes:
        memory_budget: bytes the data passes may hold for kernel values (``None``:
            :class:`gpfalkon.settings.memory_budget`). ``K_nM`` is stored when it fits, else
            the rows of it that fit (the others recomputed at each pass).
        block_rows: rows per kernel block (``None``: the automatic rule of
            :mod:`gpfalkon.backend.blocks`, about 16 MiB blocks for products).
        store_kernel: ``True`` requires storing ``K_nM`` (error if over budget),
            ``False`` always recomputes it, ``None`` stores it if it fits, else the rows that fit.
        max_iter, tol: CG stopping rule. ``None``: ``linear_operator.settings.max_cg_iterations``
            / ``cg_tolerance`` when set below their defaults (1000 / 1), else
            :class:`gpfalkon.settings.max_cg_iterations` / ``cg_tolerance``.
            ``tol=0`` runs exactly ``max_iter`` iterations.
        verbose: tqdm progress bar for CG.
        precond_dtype: storage dtype of the preconditioner's factors (float64 default;
            ``None`` means float64; float32 halves their memory at large ``M``, but its triangular
            solves' rounding, amplified by the factors' condition, bounds what CG reaches: at the small
            penalties auto_fit chooses on bike CG stalled at relative residuals of 0.07-0.14 where float64
            factors reached 0.001-0.0015 in 45 iterations (test NRMSE 0.16-0.34 against 0.04), on kin40k at
            0.008-0.01 against 0.005, and the whole path was no faster,
            ``benchmarks/results/precond-float32-path.md``).
        solver: a :class:`~gpfalkon.solvers.Solver` (default
            :func:`~gpfalkon.solvers.falkon_solve`).
        preconditioner: a :class:`~gpfalkon.solvers.PreconditionerBuilder` (default
            :meth:`~gpfalkon.FalkonPreconditioner.from_kernel_matrix`).
        backend: builds the data backend, called as ``backend(kernel, x, centers,
            memory_budget=..., block_rows=..., store=...)`` (default
            :class:`~gpfalkon.backend.KernelEngine`, the in-memory one); the result must
            offer :class:`~gpfalkon.backend.KernelEngine`'s passes.
        solve_method: how :meth:`~gpfalkon.FalkonGP.fit` solves ``H alpha = K_Mn y``:
            ``"cg"`` (FALKON's preconditioned CG), ``"direct"`` (one pass forming the whitened
            ``M x M`` system, then a Cholesky solve: :mod:`gpfalkon.solvers.direct`) or
            ``"auto"`` (default): the direct solve where its modelled cost
            (:func:`~gpfalkon.solvers.choose_method`) is lower, on CPU, with the built-in
            solver and no per-iteration callback or warm start; CG otherwise.
    """

    memory_budget: int | None = None
    block_rows: int | None = None
    store_kernel: bool | None = None
    max_iter: int | None = None
    tol: float | None = None
    verbose: bool = False
    precond_dtype: torch.dtype | None = torch.float64
    solver: Callable[..., Any] | None = None
    preconditioner: Callable[..., Any] | None = None
    backend: Callable[..., Any] | None = None
    solve_method: str = "auto"

    def __post_init__(self) -> None:
        for name, minimum in (("memory_budget", 1), ("block_rows", 1), ("max_iter", 0)):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), minimum=minimum))
        if self.store_kernel is not None:
            object.__setattr__(self, "store_kernel", _check_bool("store_kernel", self.store_kernel))
        if self.tol is not None:
            object.__setattr__(self, "tol", _check_real("tol", self.tol))
            if not math.isfinite(self.tol) or self.tol < 0:
                raise ValueError(f"tol must be finite and >= 0, got {self.tol}")
        object.__setattr__(self, "verbose", _check_bool("verbose", self.verbose))
        if self.precond_dtype is not None and self.precond_dtype not in _DTYPES:
            raise ValueError(f"precond_dtype must be torch.float32, torch.float64 or None, got {self.precond_dtype}")
        if self.solve_method not in SOLVE_METHODS:
            raise ValueError(f"solve_method must be one of {SOLVE_METHODS}, got {self.solve_method!r}")
        for name in ("solver", "preconditioner", "backend"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")

    # ----------------------------------------------------------------- building
    def replace(self, **changes: Any) -> FalkonOptions:
        """A copy with ``changes`` applied (validated); unknown names raise ``TypeError``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"FalkonOptions has no option(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def merged(cls, options: FalkonOptions | None = None, **keywords: Any) -> FalkonOptions:
        """``options`` (or the defaults) with the keyword arguments that were given.

        A keyword counts as given when it differs from the dataclass default
        (``None`` for most, ``False`` for ``verbose``, float64 for ``precond_dtype``);
        giving one both ways with different values raises ``ValueError``, naming it.
        """
        if options is not None and not isinstance(options, FalkonOptions):
            raise TypeError(f"options must be a gpfalkon.FalkonOptions, got {type(options).__name__}")
        base = cls() if options is None else options
        defaults = cls()
        given = {}
        for name, value in keywords.items():
            if not hasattr(defaults, name):
                raise TypeError(f"FalkonOptions has no option {name!r}")
            if _same(value, getattr(defaults, name)):
                continue
            if options is not None and not _same(getattr(options, name), getattr(defaults, name)) and not _same(
                getattr(options, name), value
            ):
                raise ValueError(
                    f"{name} is given both as {name}={value!r} and in options ({getattr(options, name)!r}); "
                    "give it once"
                )
            given[name] = value
        return base.replace(**given) if given else base

    # ---------------------------------------------------------------- resolving
    def resolved(self) -> ResolvedOptions:
        """The options with every ``None`` replaced by the setting in force now."""
        budget = memory_budget_for(self.memory_budget)
        rows = resolve_block_rows(self.block_rows)
        tol = self.tol
        if tol is None:
            lo_tol = float(lo_settings.cg_tolerance.value())
            tol = lo_tol if lo_tol < 1 else float(settings.cg_tolerance.value())
        max_iter = self.max_iter
        if max_iter is None:
            lo_max = int(lo_settings.max_cg_iterations.value())
            max_iter = lo_max if lo_max < 1000 else int(settings.max_cg_iterations.value())
        return ResolvedOptions(
            memory_budget=budget,
            block_rows=rows,
            store_kernel=self.store_kernel,
            max_iter=int(max_iter),
            tol=float(tol),
            verbose=self.verbose,
            precond_dtype=self.precond_dtype,
        )


@dataclass(frozen=True)
class ResolvedOptions:
    """:class:`FalkonOptions` with the settings read: concrete numbers only
    (``block_rows=None`` still means the automatic block rule)."""

    memory_budget: int
    block_rows: int | None
    store_kernel: bool | None
    max_iter: int
    tol: float
    verbose: bool
    precond_dtype: torch.dtype | None


def option_property(name: str, *, settable: bool = False) -> property:
    """A property exposing the field ``name`` of the owner's ``options`` (a :class:`FalkonOptions`);
    with ``settable=True`` assigning it replaces ``options`` by a validated copy."""
    if name not in {f.name for f in dataclasses.fields(FalkonOptions)}:
        raise ValueError(f"FalkonOptions has no field {name!r}")

    def get(self: Any) -> Any:
        return getattr(self.options, name)

    def set_(self: Any, value: Any) -> None:
        self.options = self.options.replace(**{name: value})

    return property(get, set_ if settable else None, doc=f"``options.{name}`` (:class:`FalkonOptions`).")


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _check_int(name: str, value: Any, *, minimum: int) -> int | None:
    """An integer (``int``, NumPy / 0-d tensor integers, integer-valued floats such as ``2e9``)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer or None, got {type(value).__name__}")
    if not isinstance(value, numbers.Integral) and (not math.isfinite(float(value)) or float(value) != int(value)):
        raise TypeError(f"{name} must be an integer or None, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(value).__name__}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    """``True`` / ``False`` or a 0 / 1 number (as ``verbose=1``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")
