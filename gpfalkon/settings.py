"""Settings for gpfalkon, in the style of ``gpytorch.settings``, but per thread / context.

Each setting is a context manager (``with gpfalkon.settings.memory_budget(2**30): ...``)
whose class method ``value()`` returns the value in force *in the current context*: the values
live in :class:`contextvars.ContextVar` objects, so a ``with`` block in one thread (or asyncio
task) never changes what another sees. A new thread starts from the defaults;
``set_default(value)`` changes a default for the whole process (for configuration at start-up).

Written here rather than with ``linear_operator.settings._value_context``, whose values are
class attributes shared by every thread.
"""
from __future__ import annotations

import contextvars
import math
import numbers
import os
from typing import Any, ClassVar

__all__ = ["aggregate_route", "block_rows", "cg_tolerance", "fast_kernel_grad", "kmm_through_factor",
           "max_cg_iterations", "memory_budget", "store_format", "tf32", "triton_fly", "variance_factors",
           "wide_products"]

_UNSET = object()


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (``default`` where unset): ``1 / true / yes / on`` or
    ``0 / false / no / off`` (any case, spaces ignored); anything else raises ``ValueError`` naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: use 1 / true / yes / on or 0 / false / no / off")


class _setting:
    """A value with a process-wide default and per-context overrides."""

    _default: ClassVar[Any]
    _initial: ClassVar[Any]
    _var: ClassVar[contextvars.ContextVar]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._var = contextvars.ContextVar(f"gpfalkon.settings.{cls.__name__}")
        cls._initial = cls.__dict__.get("_default")

    def __init__(self, value: Any) -> None:
        self._value = type(self)._check(value)
        self._tokens: list[contextvars.Token] = []

    @classmethod
    def _check(cls, value: Any) -> Any:
        return value

    @classmethod
    def value(cls) -> Any:
        """The value in force in the current context."""
        return cls._var.get(cls._default)

    @classmethod
    def overridden(cls) -> bool:
        """Whether a ``with`` block in this context gave a value, or :meth:`set_default` one other than the initial
        default (setting the initial value again restores the default behaviour, e.g. float32's own CG tolerance)."""
        return cls._var.get(_UNSET) is not _UNSET or ("_default" in cls.__dict__ and cls._default != cls._initial)

    @classmethod
    def set_default(cls, value: Any) -> None:
        """Set the process-wide default (what contexts without a ``with`` block see); the initial value restores
        it (:meth:`overridden` is then false again)."""
        cls._default = cls._check(value)

    def __enter__(self) -> _setting:
        self._tokens.append(type(self)._var.set(self._value))
        return self

    def __exit__(self, *exc: Any) -> None:
        # one instance may be nested in itself; it must not be shared across threads
        type(self)._var.reset(self._tokens.pop())


def _positive_int(name: str, value: Any, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    # integers, and integer-valued floats (2.0**30, 1e9) as FalkonOptions takes them
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value) == math.floor(float(value)))
    if isinstance(value, bool) or not integral or int(value) < 1:
        kind = "an integer >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"gpfalkon.settings.{name}: must be {kind}, got {value!r}")
    return int(value)


class memory_budget(_setting):
    """Bytes the kernel-product engine may hold for kernel blocks.

    Default ``None``: half the memory available now on the data's device (``MemAvailable`` of
    ``/proc/meminfo`` for the host, ``torch.cuda.mem_get_info`` for a GPU), capped at 16 GiB and
    at least 256 MiB; 4 GiB where the available memory cannot be read
    (:func:`gpfalkon.backend.default_memory_budget`). A FALKON operator's engine first takes the
    preconditioner's peak (three float64 ``M x M`` matrices) off the available memory. When the whole
    ``n x M`` matrix ``K_nM`` fits in the budget it is computed once and kept for the lifetime of the
    engine; otherwise the rows that fit (beside two ``block_rows x M`` buffers) are kept and the others
    recomputed block by block on every product (``store_kernel=False``: all recomputed). A budget below one
    row of a pass (its live blocks of ``M + d`` values) runs that pass one row a block, over the budget, with a
    :class:`~gpfalkon.errors.MemoryBudgetWarning`.
    """

    _default: ClassVar[int | None] = None

    @classmethod
    def _check(cls, value: Any) -> int | None:
        return _positive_int("memory_budget", value, allow_none=True)


class store_format(_setting):
    """How the kernel engine keeps the stored rows of ``K_nM``.

    ``None`` (default): in the data's dtype. ``"int16"``: in 16-bit fixed point, each row ``i`` as integers
    ``|q_ic| <= 32767`` times one scale ``s_i = max_c |K_ic| / 32767`` (in the data's dtype), rounded to
    nearest when the first pass computes them: an absolute error of at most ``s_i / 2`` per value (about
    ``1.5e-5`` of the row's largest value), half the memory of float32 (a quarter of float64), so twice the
    rows of ``K_nM`` stay in memory under the same :class:`memory_budget`, and half the bytes read per CG
    iteration, which is memory-bound with a stored ``K_nM``. Every pass (the first one's products included)
    reads the rounded values, so CG solves one system: the Nyström system of the rounded ``K_nM``; ``K_MM``,
    the preconditioner, the vectors and the predictions keep their dtypes. ``benchmarks/results/store-int16.md``
    measures its speed and test error (float16, whose error grows with the value, moved the reference
    problem's test RMSE by 25 % where this format moves it by 0.2 %). Use it where a measurement on your
    data shows the test error unchanged.
    """

    _default: ClassVar[str | None] = None

    @classmethod
    def _check(cls, value: Any) -> str | None:
        if value not in (None, "int16"):
            raise ValueError(f"gpfalkon.settings.store_format: must be None (the data's dtype) or 'int16', "
                             f"got {value!r}")
        return value


class block_rows(_setting):
    """Rows of X per kernel block when ``K_nM`` is computed on the fly.

    Default ``None``: blocks of about 16 MiB (``16 MiB / (M * itemsize)`` rows rounded
    down to a multiple of 8, at least 32): large enough that a block's distance matmul
    is shared well by torch's threads, small enough for the in-place kernel passes and
    the two thin products to re-read it from the last-level cache
    (``benchmarks/results/engine-blocks.md`` measures 2, 8 and 16 MiB). The engine lowers any value whose
    blocks would not fit in the memory budget.
    """

    _default: ClassVar[int | None] = None

    @classmethod
    def _check(cls, value: Any) -> int | None:
        return _positive_int("block_rows", value, allow_none=True)


class cg_tolerance(_setting):
    """Default relative residual ``||r_k|| / ||b||`` at which FALKON's CG stops.

    Used when neither the solver call nor ``linear_operator.settings.cg_tolerance``
    (when set below its default of 1) gives one. Default ``1e-6``: test error stops
    changing long before (``benchmarks/fit.py``); gradients want tighter. For float32 data
    the default is raised to :data:`gpfalkon.operators.nystrom.FLOAT32_TOL`, the floor
    float32 kernel products reach (a tolerance given explicitly is used as is).
    """

    _default: ClassVar[float] = 1e-6

    @classmethod
    def _check(cls, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"gpfalkon.settings.cg_tolerance: must be a finite number >= 0, got {value!r}")
        return float(value)


class max_cg_iterations(_setting):
    """Default cap on FALKON CG iterations (each is one pass over the data). Default 100."""

    _default: ClassVar[int] = 100

    @classmethod
    def _check(cls, value: Any) -> int:
        out = _positive_int("max_cg_iterations", value, allow_none=False)
        assert out is not None
        return out


class aggregate_route(_setting):
    """How the exact objectives' aggregates ``A A^T``, ``A y``, ``||A||_F^2`` (``A = L^{-1} K_Mn``)
    are summed over the rows (:func:`gpfalkon.backend.passes.whitened_aggregates`).

    ``"auto"`` (default): the Gram route (``L^{-1} (sum_b K_Mb K_bM) L^{-T}``, float64 GEMMs)
    on the CPU for float32 data, the solve route (a triangular solve per block) otherwise;
    ``"gram"`` / ``"solve"`` force one. Forcing ``"gram"`` on float64 data loses accuracy where
    ``K_MM`` is ill-conditioned (the function's docstring says why).
    """

    _default: ClassVar[str] = "auto"

    @classmethod
    def _check(cls, value: Any) -> str:
        if value not in ("auto", "gram", "solve"):
            raise ValueError(f"gpfalkon.settings.aggregate_route: must be 'auto', 'gram' or 'solve', got {value!r}")
        return str(value)


class fast_kernel_grad(_setting):
    """Whether the differentiable passes (the hyperparameter objectives' blocks, the gradient pass of the kernel
    product) evaluate RBF and Matern 3/2, 5/2 kernels with the hand-written backward of
    :mod:`gpfalkon.backend.stationary_grad` instead of autograd through GPyTorch.

    Default ``True`` (the environment variable ``GPFALKON_FAST_KERNEL_GRAD=0`` makes it ``False`` for the
    process): the same values and gradients to rounding, in a fraction of the time
    (``benchmarks/results/kernel-grad.md``). ``False``: autograd through GPyTorch everywhere (for comparisons).
    """

    _default: ClassVar[bool] = env_flag("GPFALKON_FAST_KERNEL_GRAD", True)

    @classmethod
    def _check(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"gpfalkon.settings.fast_kernel_grad: must be True or False, got {value!r}")
        return value


class tf32(_setting):
    """Whether the kernel engine's float32 matmuls on a CUDA GPU may run in TF32 on the tensor cores.

    Default ``False``: IEEE float32, whatever ``torch.backends.cuda.matmul.allow_tf32`` or
    ``torch.set_float32_matmul_precision`` say elsewhere in the program (the engine sets the flag
    around its own products, :mod:`gpfalkon.backend.precision`). TF32 rounds the operands to a
    10-bit mantissa: the squared distances of the stationary fast path lose about three digits
    for nearby points, and CG's products with them limit the residual it reaches. Turn it on only
    where a measurement on your data shows the test error unchanged
    (``benchmarks/gpu.py`` measures kernel-block error and test error both ways).
    No effect on the CPU or on float64.
    """

    _default: ClassVar[bool] = False

    @classmethod
    def _check(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"gpfalkon.settings.tf32: must be True or False, got {value!r}")
        return value


class kmm_through_factor(_setting):
    """Whether FALKON's CG applies ``B^T H B`` with ``K_MM`` expressed through the preconditioner's
    Cholesky factor ``T`` (``D K_MM D = T^T T - j I``: :meth:`gpfalkon.FalkonPreconditioner.w_matmul`)
    instead of a dense ``K_MM`` product in every iteration.

    Default ``True``. It saves an ``M x M`` float64 product (``M^2`` doubles read) per iteration, as
    much memory traffic as two of the iteration's four triangular solves, which matters where ``n``
    is a few times ``M``. It is used only where the preconditioner's float64 factor reproduces the
    operator's ``K_MM`` to a factorisation's rounding (checked once per preconditioner); the system
    solved is the same ``H``. ``False`` restores the dense product (for comparisons).
    """

    _default: ClassVar[bool] = True

    @classmethod
    def _check(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"gpfalkon.settings.kmm_through_factor: must be True or False, got {value!r}")
        return value


class wide_products(_setting):
    """Whether the CPU engine's products over a stored float32 ``K_nM`` (the CG iterations of float32 data) take
    float64 vectors and sum in float64: each stored float32 value is widened in registers (the store is read at
    four bytes a value, as before), and the vector ``u`` of ``K_nM^T (K_nM u)`` is not rounded to float32.

    Default ``True``. In float32 arithmetic the dot products ``K_i . u`` lose the digits that cancel between
    ``u``'s large, preconditioned entries: at a small penalty CG stalls at a relative residual of about ``1e-2``
    (keggdirected, ``M = 3,000``: float32 test NRMSE 0.0921 against float64's 0.0891), while float64 products
    over the same float32 kernel values solve as float64 does (0.0906; docs/math.md §3.2b). The kernel values
    are still computed and stored in float32; the on-the-fly rows (past the memory budget) and the GPU keep float32
    products (their sums over rows flushed to float64 every ``FLUSH_ROWS`` rows), as does a CPU without the fused
    kernel. ``False``: float32 products (the behaviour before this setting, for
    comparisons).
    """

    _default: ClassVar[bool] = True

    @classmethod
    def _check(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"gpfalkon.settings.wide_products: must be True or False, got {value!r}")
        return value


class triton_fly(_setting):
    """Whether the engine's on-the-fly pass on a CUDA GPU runs as the fused Triton kernels of
    :mod:`gpfalkon.backend.triton_fly` (distances, profile and both thin products on chip, no kernel
    block written to GPU memory).

    ``"auto"`` (default): on CUDA, for float32 and the stationary fast path, where Triton is
    installed, and where it was measured faster than torch's blockwise path: an input dimension up
    to 30 (the kernels compute the distances twice, in IEEE float32 on the CUDA cores), or any
    dimension with :class:`tf32` on (``benchmarks/results/gpu-fused.md``). ``"on"``: wherever it
    runs, whatever the dimension. ``"off"``: torch's blockwise path everywhere (for comparisons).
    ``"interpret"``: the same kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``
    set before Triton is imported), slowly: for tests and debugging on a machine without a GPU.
    """

    _default: ClassVar[str] = "auto"

    @classmethod
    def _check(cls, value: Any) -> str:
        if value not in ("auto", "on", "off", "interpret"):
            raise ValueError(
                f"gpfalkon.settings.triton_fly: must be 'auto', 'on', 'off' or 'interpret', got {value!r}")
        return str(value)


class variance_factors(_setting):
    """How ``FalkonGP`` forms its posterior variance factors (docs/math.md §4).

    ``"exact"`` (default): the SGPR/DTC factors, one pass over the data and about ``2 n M^2`` float64
    flops (minutes for millions of rows on a CPU). ``"approximate"``: ``K_Mn K_nM`` replaced by FALKON's
    approximation ``(n/M) K_MM D^2 K_MM`` (the one its preconditioner makes), formed from ``K_MM`` alone in
    ``O(M^3)`` with no data pass (docs/math.md §4.2): the posterior mean and the Nyström part of the variance
    stay exact; the coefficients' part is close inside the data and less so near its edge (on flights, 2M rows
    and ``M = 2,000``, 0.38 s against 172 s and the same test NLPD: ``benchmarks/results/fast-variance*.md``).
    Read when the variances are first asked for after a fit; the model keeps both kinds.

    Not tied to ``gpytorch.settings.fast_pred_var``: BoTorch's ``posterior()`` turns that on for every model,
    and BoTorch models are usually small enough for the exact factors.
    """

    _default: ClassVar[str] = "exact"

    @classmethod
    def _check(cls, value: Any) -> str:
        if value not in ("exact", "approximate"):
            raise ValueError(f"gpfalkon.settings.variance_factors: must be 'exact' or 'approximate', got {value!r}")
        return str(value)
