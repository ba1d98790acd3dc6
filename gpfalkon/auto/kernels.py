"""The kernel families :func:`~gpfalkon.auto_fit` builds and the maps between standardised and raw units.

A family is ``ScaleKernel(base(d ARD lengthscales))`` (RBF or Matérn 1/2, 3/2, 5/2). For a stationary ARD kernel
``k(z, z') = sigma_f^2 rho(|z_j - z'_j| / l_j)`` on standardised inputs ``z = (x - mu) / s``, the same kernel on raw
``x`` has lengthscales ``l_j s_j`` (``_scale_lengthscales``) and, on raw targets ``y = m + r u``, outputscale
``r^2 sigma_f^2`` (``_rescale_outputscale``, which moves the constraint's bounds too). ``_log_lengthscales`` puts the
lengthscales behind ``exp`` / ``log`` so that Adam takes relative steps. Cost: O(d) per call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.constraints import GreaterThan, Interval, LessThan, Positive
from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel
from torch import Tensor

from ..models.defaults import log_positive

#: kernel family name -> ``(d) -> ScaleKernel(base kernel with d ARD lengthscales)``
KERNEL_FAMILIES: dict[str, Callable[[int], Kernel]] = {
    "rbf": lambda d: ScaleKernel(RBFKernel(ard_num_dims=d)),
    "matern12": lambda d: ScaleKernel(MaternKernel(nu=0.5, ard_num_dims=d)),
    "matern32": lambda d: ScaleKernel(MaternKernel(nu=1.5, ard_num_dims=d)),
    "matern52": lambda d: ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d)),
}


def _named_lengthscale_modules(kernel: Kernel) -> list[tuple[str, Kernel]]:
    return [(name, m) for name, m in kernel.named_modules()
            if isinstance(m, Kernel) and getattr(m, "has_lengthscale", False)]


def _lengthscale_modules(kernel: Kernel) -> list[Kernel]:
    return [m for _, m in _named_lengthscale_modules(kernel)]


def _scale_lengthscales(kernel: Kernel, factor: Tensor | float) -> None:
    with torch.no_grad():
        for m in _lengthscale_modules(kernel):
            m.lengthscale = m.lengthscale * factor


#: how :func:`auto_fit` parametrises a family kernel's lengthscales (``lengthscale_transform=``)
LENGTHSCALE_TRANSFORMS: tuple[str, ...] = ("softplus", "log")
#: how stage 1's Adam scales the steps of a lengthscale vector (``lengthscale_step=``)
LENGTHSCALE_STEPS: tuple[str, ...] = ("shared", "adam")


def _log_lengthscales(kernel: Kernel) -> list[str]:
    """Put ``kernel``'s lengthscales behind GPyTorch's ``Positive`` constraint through ``exp``/``log`` (the
    values kept): an optimiser step ``h`` on the raw parameter then scales a lengthscale by ``exp(h)``
    at every scale. Under GPyTorch's default ``softplus`` (the identity for values >> 1) the same
    step moves a lengthscale ``l >> 1`` by about ``h``, that is ``h / l`` relative.

    Only that default constraint (``Positive`` through softplus) is replaced; a module whose lengthscale
    has another one (bounds chosen by the user: ``Interval``, ``GreaterThan(a > 0)``, ...) keeps it.
    Returns the names of the modules kept so."""
    kept = []
    for name, mod in _named_lengthscale_modules(kernel):
        c = mod.raw_lengthscale_constraint
        t = getattr(c, "_transform", None)
        if type(c) is not Positive or not (isinstance(t, torch.nn.Softplus) or t is torch.nn.functional.softplus
                                           or t is torch.exp):
            kept.append(name or type(mod).__name__)
            continue
        value = mod.lengthscale.detach().clone()
        mod.register_constraint("raw_lengthscale", log_positive())
        mod.lengthscale = value
    return kept


def _rescale_outputscale(kernel: ScaleKernel, factor: float) -> None:
    """``kernel.outputscale *= factor`` (standardised to raw units), and the bounds of its constraint with it: a
    user's ``Interval`` / ``GreaterThan`` / ``LessThan`` bound was set on the standardised targets ``auto_fit``
    learns on, and holds in their units after the mapping (the same transform, scaled bounds). Another
    constraint class is kept; ``ValueError`` names it where the new value violates it."""
    c = kernel.raw_outputscale_constraint
    value = kernel.outputscale.detach() * factor
    lo, hi = c.lower_bound.detach() * factor, c.upper_bound.detach() * factor
    kw = dict(transform=c._transform, inv_transform=c._inv_transform)
    new: Interval | None = None
    if type(c) is Interval:
        new = Interval(lo, hi, **kw)
    elif type(c) is GreaterThan:
        new = GreaterThan(lo, **kw)
    elif type(c) is LessThan:
        new = LessThan(hi, **kw)
    if new is not None and c.enforced:
        new = new.to(value)
        raw = kernel.raw_outputscale.detach()
        tiny = torch.finfo(raw.dtype).tiny
        with torch.no_grad():  # GPyTorch rounds a constraint's bounds to the default dtype: keep them exact
            new.lower_bound.copy_(lo.to(new.lower_bound))
            new.upper_bound.copy_(hi.to(new.upper_bound))
            # the raw value from the gap to the bound, not from the value (at the bound ``value - bound`` rounds
            # to 0 and the raw value to -inf): Interval's lo + (hi - lo) t(raw) scales with its bounds as it is
            if type(c) is Interval:
                new_raw = raw.clone()
            elif type(c) is GreaterThan:
                new_raw = c._inv_transform((factor * c._transform(raw)).clamp_min(tiny))
            else:
                new_raw = -c._inv_transform((factor * c._transform(-raw)).clamp_min(tiny))
        if bool(torch.isfinite(new_raw).all()):
            kernel.register_constraint("raw_outputscale", new)
            with torch.no_grad():
                kernel.raw_outputscale.copy_(new_raw)
            return
    try:
        with torch.no_grad():
            if new is not None:
                kernel.register_constraint("raw_outputscale", new.to(value))
            kernel.outputscale = value
    except RuntimeError as exc:
        raise ValueError(f"kernel: its outputscale constraint {c} cannot hold the outputscale in the targets' units "
                         f"({value.tolist()}; auto_fit learns on standardised targets): use an Interval, GreaterThan "
                         "or LessThan bound (scaled with the targets) or none") from exc
