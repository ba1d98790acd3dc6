"""Is a fitted ``alpha`` still valid? A small tracker of what the fit depended on.

``alpha`` depends on the kernel's parameters and buffers, the centers, the noise, the
constant mean and the training data. :class:`FitTracker` records, at fit time,

* a snapshot of the small tensors (kernel, centers, noise, mean), compared by value
  (GPyTorch's setters write through ``.data``, which bumps no version counter);
* the identity of the training tensors (storage pointer, in-place version, shape):
  ``O(1)`` to check;
* a value fingerprint of the training data (sizes, sums and norms in float64, ``O(n d)``),
  which persists in the model's ``state_dict`` and is compared only when the identity
  changed (a copy, a pickle, ``.to()``, an in-place edit).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._validation import is_row_source

__all__ = ["FitTracker", "data_fingerprint"]

Reduce = Callable[[Tensor], Tensor]


def data_fingerprint(
    x: Tensor, y: Tensor, device: torch.device | None = None, reduce: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """``[n, d, sum x, ||x||, sum y, ||y||]`` in float64: ``O(n d)``.

    ``reduce`` completes the row sums ``[n, sum x, ||x||^2, sum y, ||y||^2]`` over the shards of
    a distributed data set (a collective), so a sharded model's fingerprint is that of all rows.
    """
    x, y = x.detach(), y.detach()
    if is_row_source(x):  # one streamed pass
        sx = torch.zeros((), dtype=torch.float64, device=x.device)
        sxx = torch.zeros((), dtype=torch.float64, device=x.device)
        for _, _, blk in x.blocks(65536):
            sx += blk.sum(dtype=torch.float64)
            sxx += blk.to(torch.float64).square().sum()
    else:
        sx, sxx = x.sum(dtype=torch.float64), x.to(torch.float64).square().sum()
    sums = torch.stack([
        torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device),
        sx,
        sxx,
        y.sum(dtype=torch.float64),
        y.to(torch.float64).square().sum(),
    ])
    if reduce is not None:
        sums = reduce(sums)
    vals = [sums[0], torch.tensor(float(x.shape[1]), dtype=torch.float64, device=x.device), sums[1], sums[2].sqrt(),
            sums[3], sums[4].sqrt()]
    return torch.stack(vals).to(x.device if device is None else device)


def _identity(tensors: Sequence[Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)


class FitTracker:
    """Tracks the validity of a fit. It holds only tensors (it pickles and deep-copies with
    its model); every call receives the current ``hyper`` tensors (compared by value) and
    ``data = (x, y)``."""

    def __init__(self) -> None:
        self.snapshot: list[Tensor] | None = None
        self.data_key: tuple | None = None

    def mark(self, hyper: Sequence[Tensor], data: tuple[Tensor, Tensor], reduce: Reduce | None = None) -> Tensor:
        """Record the current state as fitted; returns the data fingerprint to store
        (``reduce``: see :func:`data_fingerprint`)."""
        self.snapshot = [t.detach().clone() for t in hyper]
        self.data_key = _identity(data)
        return data_fingerprint(*data, reduce=reduce)

    def forget(self) -> None:
        """Nothing is known to be fitted."""
        self.snapshot = None
        self.data_key = None

    def adopt(self, hyper: Sequence[Tensor]) -> None:
        """Take ``hyper`` as the fitted hyperparameters (after loading a fitted state); the
        data are then checked by value against the stored fingerprint."""
        self.snapshot = [t.detach().clone() for t in hyper]
        self.data_key = None

    def data_changed(
        self, data: tuple[Tensor, Tensor], stored_fingerprint: Tensor, reduce: Reduce | None = None
    ) -> bool:
        """Have the training data changed since the fit that stored ``stored_fingerprint``?"""
        if self.data_key is not None and self.data_key == _identity(data):
            return False
        now = data_fingerprint(*data, device=stored_fingerprint.device, reduce=reduce)
        same = torch.allclose(now, stored_fingerprint.to(torch.float64), rtol=1e-12, atol=0.0)
        if same:
            self.data_key = _identity(data)
        return not same

    def stale(self, hyper: Sequence[Tensor], data: tuple[Tensor, Tensor], stored_fingerprint: Tensor,
              reduce: Reduce | None = None) -> bool:
        """Has anything the fit depends on changed (or was nothing recorded)?"""
        if self.snapshot is None:
            return True
        if len(hyper) != len(self.snapshot) or any(
            a.shape != b.shape or not torch.equal(a.detach(), b.to(device=a.device, dtype=a.dtype))
            for a, b in zip(hyper, self.snapshot, strict=False)
        ):
            return True
        return self.data_changed(data, stored_fingerprint, reduce=reduce)
