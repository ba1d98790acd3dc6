"""Data-driven starting points for hyperparameters."""
from __future__ import annotations

import torch
from torch import Tensor

from ._validation import check_inputs

__all__ = ["median_lengthscale"]


def median_lengthscale(x: Tensor, max_points: int = 2000, generator: torch.Generator | None = None) -> Tensor:
    """The median heuristic: median pairwise Euclidean distance between rows of ``x``.

    Uses a random subset of at most ``max_points`` rows (``O(max_points^2 d)``
    time and ``O(max_points^2)`` memory). Returns a positive scalar tensor.
    """
    check_inputs("x", x)
    n = x.shape[0]
    if n > max_points:
        if generator is None:
            generator = torch.Generator(device=x.device).manual_seed(0)
        idx = torch.randperm(n, generator=generator, device=generator.device)[:max_points].to(x.device)
        x = x[idx]
    d = torch.cdist(x.double(), x.double())
    iu = torch.triu_indices(x.shape[0], x.shape[0], offset=1, device=x.device)
    vals = d[iu[0], iu[1]]
    one = torch.tensor(1.0, dtype=torch.float64, device=x.device)
    med = vals.median() if vals.numel() else one
    if not bool(med > 0):
        med = one
    return med.to(x.dtype)
