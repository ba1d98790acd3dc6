"""Argument checks shared by the public entry points.

Every check raises with the offending argument's name in the message, so a user
sees *which* input is wrong, and none of them mutates anything.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float64)


def check_dtype(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; gpfalkon supports torch.float32 and torch.float64")


def check_finite(name: str, t: Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} contains {bad} NaN or Inf value(s)")


def check_inputs(name: str, x: Tensor, d: Optional[int] = None) -> None:
    """``x`` must be a finite float ``(rows, d)`` matrix with at least one row."""
    check_dtype(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-dimensional (rows x features), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
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
    value = torch.as_tensor(penalty)
    if value.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite, got {float(value)}")
    if float(value) <= 0:
        raise ValueError(f"{name} must be > 0, got {float(value)}")


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
