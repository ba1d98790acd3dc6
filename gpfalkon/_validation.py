"""Argument checks shared by the public entry points.

Every check raises with the offending argument's name in the message, so a user
sees *which* input is wrong, and none of them mutates anything.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, TypeGuard

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float64)


def check_dtype(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; gpfalkon supports torch.float32 and torch.float64")


def all_finite(t: Tensor) -> bool:
    """``isfinite(t).all()`` without its ``t``-sized boolean temporary: a NaN or an Inf entry makes the sum
    non-finite, so a finite sum settles it in one read; a non-finite sum (an entry bad, or finite entries
    overflowing) is decided by the elementwise test."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_finite(name: str, t: Tensor) -> None:
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} contains {bad} NaN or Inf value(s)")


def is_row_source(x: object) -> TypeGuard[Any]:  # a backend.sources.RowSource (a layer above)
    """Is ``x`` a :class:`~gpfalkon.backend.sources.RowSource` (rows read block by block)?"""
    return (
        not isinstance(x, Tensor) and callable(getattr(x, "read", None)) and callable(getattr(x, "check_finite", None))
    )


def check_inputs(name: str, x: Tensor, d: int | None = None, allow_empty: bool = False) -> None:
    """``x`` must be a finite float ``(rows, d)`` matrix with at least one row (``allow_empty``:
    zero rows allowed, for a shard of a distributed data set). ``x`` may be a row source (one
    streamed pass checks finiteness)."""
    if is_row_source(x):
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; gpfalkon supports torch.float32 and torch.float64")
        if x.shape[0] == 0 and not allow_empty:
            raise ValueError(f"{name} is empty (0 rows)")
        if x.shape[1] == 0:
            raise ValueError(f"{name} has 0 features")
        if d is not None and x.shape[1] != d:
            raise ValueError(f"{name} has {x.shape[1]} features but the training inputs have {d}")
        x.check_finite(name)
        return
    check_dtype(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-dimensional (rows x features), got shape {tuple(x.shape)}")
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name} is empty (0 rows)")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has 0 features")
    if d is not None and x.shape[1] != d:
        raise ValueError(f"{name} has {x.shape[1]} features but the training inputs have {d}")
    check_finite(name, x)


def check_targets(name: str, y: Tensor, n: int) -> None:
    """``y`` must be a finite ``(n,)`` vector or ``(n, t)`` matrix."""
    check_dtype(name, y)
    if y.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (n,) or (n, t), got {tuple(y.shape)}")
    if y.shape[0] != n:
        raise ValueError(f"{name} has {y.shape[0]} rows but train_x has {n}")
    if y.dim() == 2 and y.shape[1] == 0:
        raise ValueError(f"{name} has 0 output columns")
    check_finite(name, y)


def check_penalty(penalty: Tensor | float, name: str = "penalty") -> None:
    if penalty is None or isinstance(penalty, (bool, str)):
        raise TypeError(f"{name} must be a positive number or a scalar tensor, got {penalty!r}")
    try:  # Python numbers in float64: a float32 cast would turn 1e-300 into 0 and -1e-3 into -0.0010000000474
        value = penalty.detach().to(torch.float64) if isinstance(penalty, Tensor) else torch.as_tensor(
            penalty, dtype=torch.float64
        )
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a positive number or a scalar tensor, got {type(penalty).__name__}") from None
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name} must be a real number, got dtype {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite, got {float(value)}")
    if float(value) <= 0:
        raise ValueError(f"{name} must be > 0, got {float(value)}")


def check_seed(seed: object, name: str = "seed") -> None:
    """A seed for ``torch.Generator.manual_seed``: an integer (not a bool) in ``[-2^63, 2^64)``."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {seed!r}")
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"{name} must be in [-2^63, 2^64) (torch.Generator.manual_seed's range), got {seed}")


def check_num_centers(num_centers: int, n: int) -> int:
    """Validate ``1 <= num_centers <= n``; accepts any integer type (``numpy.int64`` ...)."""
    if isinstance(num_centers, bool):
        raise TypeError("num_centers must be an int, got bool")
    try:
        num_centers = operator.index(num_centers)
    except TypeError:
        raise TypeError(f"num_centers must be an int, got {type(num_centers).__name__}") from None
    if num_centers < 1:
        raise ValueError(f"num_centers must be >= 1, got {num_centers}")
    if num_centers > n:
        raise ValueError(f"num_centers={num_centers} exceeds the number of training points n={n}")
    return num_centers


def check_kernel(kernel, name: str = "kernel") -> None:
    """``kernel`` must be a ``gpytorch.kernels.Kernel``."""
    from gpytorch.kernels import Kernel

    if not isinstance(kernel, Kernel):
        raise TypeError(f"{name} must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}")


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """An integer ``>= minimum`` (an integral float such as ``1e4`` accepted; a bool, ``2.5``, NaN or Inf refused,
    never truncated), named in the error; returns it as int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or int(float(value)) != value or int(float(value)) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(float(value))


def check_positive_real(
    name: str, value: float, minimum: float = 0.0, strict_minimum: bool = False
) -> float:
    """A finite real ``>= minimum`` (``> minimum`` if ``strict_minimum``); returns it as float."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got bool")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < minimum or (strict_minimum and v == minimum):
        op = ">" if strict_minimum else ">="
        raise ValueError(f"{name} must be {op} {minimum:g}, got {v:g}")
    return v


def check_scores(name: str, scores: Tensor, n: int) -> None:
    """Sampling scores: a finite, nonnegative ``(n,)`` tensor with a positive sum."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if scores.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) (one per row of x), got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {scores.dtype}")
    check_finite(name, scores)
    if bool((scores < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {int((scores < 0).sum())} negative value(s)")
    if not float(scores.detach().to(torch.float64).sum()) > 0:
        raise ValueError(f"{name} sum to 0: nothing to sample from")


def check_center_weights(name: str, weights: Tensor, m: int, device: torch.device | None = None) -> None:
    """Preconditioner weights ``D``: a finite, strictly positive float ``(m,)`` tensor."""
    check_dtype(name, weights)
    if weights.shape != (m,):
        raise ValueError(f"{name} must have shape ({m},) (one per center), got {tuple(weights.shape)}")
    if device is not None and weights.device != device:
        raise ValueError(f"{name} is on {weights.device} but train_x is on {device}")
    check_finite(name, weights)
    if bool((weights <= 0).any()):
        raise ValueError(f"{name} must be > 0, got {int((weights <= 0).sum())} value(s) <= 0")


def check_generator(generator: object, name: str = "generator") -> None:
    """``None`` or a :class:`torch.Generator`."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(generator).__name__}")
