"""Adam without ``torch.optim``'s first-use import, for :func:`gpfalkon.auto_fit`'s timed learning stage.

The update is Adam's (Kingma and Ba 2015), written as ``torch.optim.Adam`` writes it (no weight decay, no
AMSGrad), for parameters ``p`` with gradients ``g`` at step ``t``:

    m <- beta1 m + (1 - beta1) g,    v <- beta2 v + (1 - beta2) g^2,
    p <- p - (lr / (1 - beta1^t)) m / (sqrt(v / (1 - beta2^t)) + eps).

For a tensor named in ``shared`` each entry's second moment is floored at the mean of its tensor's
(``max(v_i, mean_j v_j)`` in place of ``v_i``): the entries whose gradients are at least the tensor's RMS
gradient step by about ``lr``, as in Adam, and the others in proportion to their gradients, as in gradient
descent, where Adam's own per-entry denominator moves every entry by about ``lr`` from the first steps on,
whatever the size of its gradient (docs/math.md §8, "Lengthscale steps").

Cost ``O(P)`` time and ``2 P`` extra memory for ``P`` parameter values.

Why by hand: ``torch.optim``'s optimizers import ``torch._dynamo`` the first time one is built (every
``add_param_group`` and ``step`` goes through ``torch._disable_dynamo``): about 1 s in a fresh process on the
development host (``benchmarks/results/auto-optim-import.md``). :func:`gpfalkon.auto_fit` runs against a
wall-clock budget, often of a few seconds, and would pay that second out of it; the update itself is the few
lines below. Everywhere else the library uses ``torch.optim`` (``NystromObjective.minimize``, GPyTorch and
BoTorch loops).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["Adam"]


class Adam:
    """``torch.optim.Adam(params, lr, betas, eps)``'s update (module docstring) with its ``zero_grad`` and
    ``step`` (``step`` takes no closure). Parameters without a gradient are skipped, as torch's are.

    Args:
        params: the tensors to update (leaf tensors with ``requires_grad``).
        lr: step size (finite, > 0).
        betas: the moments' decay rates, each in ``[0, 1)``.
        eps: added to the denominator (>= 0).
        shared: tensors of ``params`` whose entries' second moments are floored at their tensor's mean
            (module docstring); empty (the default): Adam's update for every tensor.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, shared: Iterable[Tensor] = ()) -> None:
        self.params = list(params)
        if not all(isinstance(p, Tensor) for p in self.params):
            raise TypeError("params must be tensors")
        shared_ids = {id(q) for q in shared}
        if not shared_ids <= {id(p) for p in self.params}:
            raise ValueError("shared must name tensors of params")
        self.shared = [id(p) in shared_ids for p in self.params]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not (isinstance(eps, (int, float)) and eps >= 0):
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self.steps = [0] * len(self.params)
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``set_to_none``, torch's default)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        beta1, beta2 = self.betas
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients")
            self.steps[i] += 1
            t = self.steps[i]
            m, v = self.exp_avg[i], self.exp_avg_sq[i]
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size = self.lr / (1 - beta1**t)
            v_hat = torch.maximum(v, v.mean()) if self.shared[i] and v.numel() > 0 else v
            denom = (v_hat.sqrt() / math.sqrt(1 - beta2**t)).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)
