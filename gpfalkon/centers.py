"""Choice of the Nyström centers (inducing points).

``UniformCenters`` draws ``M`` training rows uniformly *without* replacement
(FALKON, Alg. 1). Leverage-score sampling (FALKON appendix A) will live here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ._validation import check_inputs, check_num_centers

__all__ = ["CenterSelection", "uniform_centers", "UniformCenters"]


@dataclass
class CenterSelection:
    """Selected centers ``(M, d)``, the training-row indices they came from and
    optional diagonal weights ``D`` of the preconditioner (``None`` = identity)."""

    centers: Tensor
    indices: Optional[Tensor] = None
    weights: Optional[Tensor] = None


def uniform_centers(x: Tensor, num_centers: int, generator: Optional[torch.Generator] = None) -> CenterSelection:
    """Sample ``num_centers`` rows of ``x`` uniformly without replacement.

    Cost O(n) time and memory for the permutation; deterministic given ``generator``.
    """
    check_inputs("train_x", x)
    num_centers = check_num_centers(num_centers, x.shape[0])
    device = generator.device if generator is not None else torch.device("cpu")
    idx = torch.randperm(x.shape[0], generator=generator, device=device)[:num_centers]
    idx = idx.sort().values.to(x.device)
    return CenterSelection(centers=x[idx].clone(), indices=idx)


class UniformCenters:
    """Callable center selector: ``UniformCenters(seed)(x, M) -> CenterSelection``."""

    def __init__(self, seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> None:
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(0 if seed is None else int(seed))
        self.generator = generator

    def __call__(self, x: Tensor, num_centers: int) -> CenterSelection:
        return uniform_centers(x, num_centers, self.generator)
