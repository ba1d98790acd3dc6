"""Stage 3 of :func:`~gpfalkon.auto_fit`: a selection level's model on the final rows, in raw units.

A level (``M`` centers of a pool, noise ``sigma^2``, lengthscale multiplier ``c``, all in standardised units
``z = (x - mu) / s``, ``u = (y - m) / r``) maps back exactly: the kernel's lengthscales times ``c s_j``, its
outputscale times ``r^2`` (a kernel without one is wrapped in a ``ScaleKernel`` of outputscale ``r^2``), the centers
``mu + s z``, the noise ``r^2 sigma^2`` and the constant prior mean ``m``; the coefficients of a fit are then
``alpha_z / r``, which is where the final CG starts (the level's selection fit's, zero for added centers). Cost: the
final fit, ``O(n M t + M^3)``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from gpytorch.kernels import Kernel, ScaleKernel
from torch import Tensor

from ..models import FalkonGP
from ..options import FalkonOptions
from .kernels import _rescale_outputscale, _scale_lengthscales
from .scoring import _fit_quiet, _KeptPreconditioner
from .selection import _Selection, score_key


@dataclass(eq=False)
class _FinalModels:
    """Final models of the levels of ``fits``: on ``x_fin, y_fin`` (raw units, the model's dtype), the ``n_tr``
    training rows followed by the ``n_back`` held-out rows put back. ``base_kernel`` is the learned kernel on
    standardised inputs; ``raw_lengthscales``: its lengthscales are mapped back by ``x_sd`` (a kernel family's;
    a given ``Kernel`` sees raw inputs, ``x_mu = 0``, ``x_sd = 1``)."""

    fits: _Selection
    x_fin: Tensor
    y_fin: Tensor
    n_tr: int
    n_back: int
    s_order: Tensor
    base_kernel: Kernel
    raw_lengthscales: bool
    x_mu: Tensor
    x_sd: Tensor
    y_mu: Tensor
    y_sd: Tensor
    max_iter: int
    tol: float

    def start_for(self, level: dict[str, Any], m: int) -> Tensor | None:
        """CG's starting coefficients (standardised units) for a final fit of ``level`` at its pool's first
        ``m`` centers: the level's selection fit's (its centers are the pool's first ones: both pools are
        nested), zero for the centers a grown level adds after them; ``None`` where that fit was not kept or
        ``m`` is below its size."""
        m_sel = int(level.get("grown_from") or level["M"])
        a = self.fits.alpha.get(score_key(m_sel, level["noise"], level["multiplier"], level["centers"]))
        if a is None or a.numel() != m_sel or m < m_sel:
            return None
        return torch.cat([a, a.new_zeros(m - m_sel)])

    def fit(self, level: dict[str, Any], time_limit: float | None = None,
            centers: Tensor | None = None, weights: Tensor | None = None,
            rows: int | None = None, keeper: _KeptPreconditioner | None = None,
            start: Tensor | None = None, leave_out: Tensor | None = None,
            kernel_z: Kernel | None = None, data_dtype: torch.dtype | None = None) -> tuple[FalkonGP, bool]:
        """The model of a selection level on the final rows, in raw units (:meth:`model`), fitted;
        (model, converged). ``time_limit`` bounds the fit's wall time (CG stops at the clock, see
        ``FalkonGP.fit``)."""
        model, initial = self.model(level, centers=centers, weights=weights, rows=rows, keeper=keeper,
                                    start=start, leave_out=leave_out, kernel_z=kernel_z, data_dtype=data_dtype)
        return _fit_quiet(model, time_limit=time_limit, initial_alpha=initial)

    def model(self, level: dict[str, Any], centers: Tensor | None = None, weights: Tensor | None = None,
              rows: int | None = None, keeper: _KeptPreconditioner | None = None,
              start: Tensor | None = None, leave_out: Tensor | None = None,
              kernel_z: Kernel | None = None,
              data_dtype: torch.dtype | None = None) -> tuple[FalkonGP, Tensor | None]:
        """The model of a selection level on the final rows, in raw units, not fitted, and the coefficients
        its CG starts from (raw units, or ``None``). ``centers`` (standardised units) and their preconditioner
        ``weights`` replace the level's, ``start`` (standardised units) their coefficients CG starts from;
        without ``centers``, CG starts from the level's selection fit (:meth:`start_for`): in raw units
        ``f = y_mu + y_sd f_z`` with the kernel scaled by ``y_sd^2``, so the coefficients are ``alpha_z / y_sd``.
        ``rows`` (default: all final rows) takes the first ``rows - n_back`` selection-order training rows (every
        size's selection rows come first) and the held-out rows put back; ``leave_out`` (indices of held-out rows,
        with ``rows`` all final rows) keeps those held-out rows out of the fit; ``keeper`` builds the fit's
        preconditioner and keeps it; ``kernel_z`` (standardised units) replaces the chosen kernel;
        ``data_dtype`` replaces the model's dtype as its data, kernel and centers dtype."""
        x_fin, y_fin, n_tr, n_back = self.x_fin, self.y_fin, self.n_tr, self.n_back
        dtype, dev = x_fin.dtype, x_fin.device
        y_sd = float(self.y_sd)
        x_use, y_use = x_fin, y_fin
        if leave_out is not None and n_back > 0:
            back = torch.ones(n_back, dtype=torch.bool, device=dev)
            back[leave_out] = False
            idx = torch.cat([torch.arange(n_tr, device=dev), n_tr + back.nonzero().reshape(-1)])
            x_use, y_use = x_fin[idx], y_fin[idx]
        elif rows is not None and rows < x_fin.shape[0]:
            idx = torch.cat([self.s_order[: rows - n_back], torch.arange(n_tr, n_tr + n_back, device=dev)])
            x_use, y_use = x_fin[idx], y_fin[idx]
        m_fin = min(level["M"], x_use.shape[0])
        fin_kernel = copy.deepcopy(self.base_kernel if kernel_z is None else kernel_z)
        _scale_lengthscales(fin_kernel, level["multiplier"])
        # back to raw units: x = mu + sd * z, so an ARD lengthscale l on z is l * sd on x; y = y_mu + y_sd * z
        if self.raw_lengthscales:
            with torch.no_grad():
                fin_kernel.base_kernel.lengthscale = fin_kernel.base_kernel.lengthscale * self.x_sd.to(dtype)
        if isinstance(fin_kernel, ScaleKernel):
            _rescale_outputscale(fin_kernel, y_sd ** 2)
        else:
            wrapped = ScaleKernel(fin_kernel).to(dtype=dtype, device=dev)
            with torch.no_grad():
                wrapped.outputscale = torch.tensor(y_sd ** 2, dtype=dtype, device=dev)
            fin_kernel = wrapped
        if centers is None:
            centers, weights = self.fits.centers_at(m_fin, level.get("centers"))
            start = self.start_for(level, int(centers.shape[0]))
        centers_raw = (centers.to(torch.float64) * self.x_sd + self.x_mu).to(dtype)
        noise_raw = level["noise"] * y_sd ** 2
        if data_dtype is not None and data_dtype != dtype:
            x_use, y_use = x_use.to(data_dtype), y_use.to(data_dtype)
            fin_kernel, centers_raw = fin_kernel.to(dtype=data_dtype), centers_raw.to(data_dtype)
        model = FalkonGP(x_use, y_use, kernel=fin_kernel, centers=centers_raw,
                         penalty=noise_raw / x_use.shape[0], mean_constant=float(self.y_mu), max_iter=self.max_iter,
                         tol=self.tol, center_weights=weights,
                         options=None if keeper is None else FalkonOptions(preconditioner=keeper))
        initial = None
        if start is not None and start.numel() == model.alpha.numel():
            initial = (start.to(torch.float64) / y_sd).reshape(model.alpha.shape)
        return model, initial


@dataclass
class _Returned:
    """The model :func:`~gpfalkon.auto_fit` returns, as stage 3 leaves it: whether its CG converged, its rows, the
    level it is a fit of and its predicted seconds."""

    model: FalkonGP
    converged: bool
    rows: int
    level: dict[str, Any]
    predicted: float
