"""Exact hyperparameter objectives (docs/math.md §5), ``O(n M^2)`` time, ``O(M^2 + block x M)`` memory.

Notation: ``S = K~ (K~ + v I)^{-1}`` the Nyström smoother, ``K~ = K_nM K_MM^{-1} K_Mn``,
``v = n lambda`` unless stated. Multi-output targets: the per-column objective is
summed over columns (HoldOut: mean squared error over all entries). Values are
exactly the formulas of docs/math.md §5.2, the ones of the paper's reference implementation.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from ..backend.passes import is_sharded
from .base import NystromObjective

__all__ = ["GCV", "LOOCV", "CompReg", "HoldOut", "NystromCompReg", "SGPRBound"]


def _leave_one_out_noise(objective: NystromObjective) -> Tensor:
    """``v = (n - 1) lambda`` of GCV and LOOCV (the noise of a fit without one row); ``ValueError`` naming the
    objective where ``n < 2`` (``v`` vanishes: the criterion is undefined)."""
    n = objective.model.n
    if n < 2:
        raise ValueError(f"{type(objective).__name__} needs at least 2 training rows (train_x has {n}): its noise "
                         "is (n - 1) * penalty")
    return (n - 1) * objective.model.penalty


class CompReg(NystromObjective):
    """C-Reg: ``tr(S) + y^T (I - S) y`` (summed over output columns). Cost ``O(n M^2)``."""

    def objective(self) -> Tensor:
        x, y = self._data()
        v = self.model.n * self.model.penalty
        agg = self.aggregates(x, y, self.cholesky_kmm())
        t = self.smoother_terms(agg, self.cholesky_b(agg, v), v)
        return (t["tr_s"] + agg.yy - t["ysy"]).sum()


class NystromCompReg(NystromObjective):
    """The paper's proposed bound (eq. 9), per column and summed:

        tr(S) + y^T (I - S) y + [ (tr(K_nn) - tr(K~)) / (n lambda) ] [ y^T (I - S) y / n ]

    (effective dimension + data fit + Nyström-approximation penalty; assumes
    standardised targets). Cost ``O(n M^2)``.
    """

    def objective(self) -> Tensor:
        x, y = self._data()
        n = self.model.n
        v = n * self.model.penalty
        agg = self.aggregates(x, y, self.cholesky_kmm())
        t = self.smoother_terms(agg, self.cholesky_b(agg, v), v)
        fit = agg.yy - t["ysy"]
        nys = (agg.tr_knn - agg.tr_ktilde) / v
        return (t["tr_s"] + fit + nys * fit / n).sum()


class GCV(NystromObjective):
    """Generalised cross-validation, with ``v = (n - 1) lambda``:

        (1/n) ||(I - S) y||^2 / (1 - tr(S) / n)^2       (summed over columns)

    ``||(I - S) y||^2 = ||y||^2 - 2 y^T S y + ||S y||^2`` needs no per-point pass,
    so the value does not depend on any prediction batch size. Cost ``O(n M^2)``.
    """

    def objective(self) -> Tensor:
        x, y = self._data()
        n = self.model.n
        v = _leave_one_out_noise(self)
        agg = self.aggregates(x, y, self.cholesky_kmm())
        t = self.smoother_terms(agg, self.cholesky_b(agg, v), v)
        res = agg.yy - 2 * t["ysy"] + t["sy_sq"]
        return ((res / n) / (1 - t["tr_s"] / n) ** 2).sum()

    def observation_total(self, value: Tensor) -> Tensor:
        """A mean over the rows (summed over outputs): times ``n``."""
        return value * self.model.n


class LOOCV(NystromObjective):
    """Leave-one-out cross-validation (closed form), with ``v = (n - 1) lambda``:

        (1/n) sum_i ( ((I - S) y)_i / (1 - S_ii) )^2      (summed over columns)

    with ``S_ii = ||L_B^{-1} a_i||^2 / v``. Two blockwise passes, ``O(n M^2)``.
    """

    def objective(self) -> Tensor:
        x, y, L, LB, w, v = self._factors()

        def block(ab: Tensor, s: int, e: int) -> Tensor:
            r, _ = self._block_residuals(ab, y[s:e], LB, w, v)
            return r.square().sum(0)

        local = self.for_each_block(x, L, block)
        total = cast(Tensor, sum(local)) if local else torch.zeros(y.shape[-1], dtype=L.dtype, device=L.device)
        # an empty shard ties its zero to everything the blocks would have used, so that its
        # backward pass reaches the same collectives as the other ranks'
        (total,) = self.reduce(total, anchor=None if local else (L.sum() + LB.sum() + w.sum()) * 0.0)
        return (total / self.model.n).sum()

    def observation_total(self, value: Tensor) -> Tensor:
        """A mean over the rows (summed over outputs): times ``n``."""
        return value * self.model.n

    def residuals(self) -> tuple[Tensor, Tensor]:
        """The terms :meth:`objective` averages, without a graph: the leave-one-out residuals
        ``r_i = ((I - S) y)_i / (1 - S_ii)`` (``(rows, t)``) and the smoother's diagonal ``S_ii`` (``(rows,)``) of
        this process's rows, in their order. With every training row a center (``M = n``) they are those of exact
        kernel ridge regression at noise ``v = (n - 1) lambda``, where a GP's leave-one-out predictive variance of
        ``y_i`` is ``v / (1 - S_ii)`` (``S = I - v (K + v I)^{-1}``). Cost as :meth:`objective`."""
        with torch.no_grad():
            x, y, L, LB, w, v = self._factors()

            def block(ab: Tensor, s: int, e: int) -> Tensor:
                r, s_ii = self._block_residuals(ab, y[s:e], LB, w, v)
                return torch.cat([r, s_ii.unsqueeze(-1)], -1)

            local = self.for_each_block(x, L, block)
            if not local:
                return y.new_zeros(0, y.shape[-1]), y.new_zeros(0)
            out = torch.cat(local, 0)
            return out[:, :-1], out[:, -1]

    def _factors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(x, y, L, L_B, W, v)``: the data, the factors of ``K_MM`` and ``B`` at ``v = (n - 1) lambda``, and
        ``W`` with ``S y = A^T W``."""
        x, y = self._data()
        v = _leave_one_out_noise(self)
        L = self.cholesky_kmm()
        agg = self.aggregates(x, y, L)
        LB = self.cholesky_b(agg, v)
        return x, y, L, LB, self.smoother_terms(agg, LB, v)["w"], v

    @staticmethod
    def _block_residuals(ab: Tensor, y_b: Tensor, LB: Tensor, w: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """A block's leave-one-out residuals ``((I - S) y)_i / (1 - S_ii)`` and ``S_ii = ||L_B^{-1} a_i||^2 / v``."""
        s_ii = torch.linalg.solve_triangular(LB, ab, upper=False).square().sum(0) / v  # (rows,)
        return (y_b - ab.mT @ w) / (1 - s_ii).unsqueeze(-1), s_ii


class HoldOut(NystromObjective):
    """Hold-out validation error: fit alpha on a training part with ``v = n_train lambda``
    and return the mean squared error on the validation part.

    ``alpha = L^{-T} (A A^T + v I)^{-1} A y`` (training part only), then
    ``mean((K_vM alpha - y_v)^2)``. The split is drawn once from ``generator``
    (reproducible), or redrawn at every call with ``redraw=True``.

    Args:
        val_fraction: share of the rows held out (default 0.5; must leave both parts non-empty).
        generator: ``torch.Generator`` for the split (default seeded with 0).
        redraw: draw a new split at every evaluation.
    """

    def __init__(
        self,
        model,
        *,
        val_fraction: float = 0.5,
        generator: torch.Generator | None = None,
        redraw: bool = False,
        block_rows: int | None = None,
    ) -> None:
        super().__init__(model, block_rows=block_rows)
        if not (0.0 < float(val_fraction) < 1.0):
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = float(val_fraction)
        self.n_val = self._n_val(model.n)
        dev = model.train_inputs[0].device
        self.generator = generator if generator is not None else torch.Generator(device=dev).manual_seed(0)
        self.redraw = bool(redraw)
        self._perm: Tensor | None = None

    def _n_val(self, n: int) -> int:
        n_val = round(n * self.val_fraction)
        if n_val < 1 or n_val > n - 1:
            raise ValueError(f"val_fraction={self.val_fraction} leaves an empty part with n={n}")
        return n_val

    def split(self) -> tuple[Tensor, Tensor]:
        """``(train_idx, val_idx)``: the current split (drawn again where the model's rows changed in number,
        ``model.set_train_data``)."""
        n = self.model.n
        if self._perm is None or self.redraw or self._perm.numel() != n:
            self.n_val = self._n_val(n)
            self._perm = torch.randperm(n, generator=self.generator, device=self.generator.device)
        perm = self._perm.to(self.model.train_inputs[0].device)
        return perm[self.n_val :], perm[: self.n_val]

    def _local(self, idx: Tensor) -> Tensor:
        """The rows of this process among the global row indices ``idx`` (all of them in one
        process; with a sharded backend, those in this rank's range, as local indices)."""
        if not is_sharded(self.backend):
            return idx
        off, stop, _ = self.backend.row_range(self.model.train_inputs[0])
        return idx[(idx >= off) & (idx < stop)] - off

    def objective(self) -> Tensor:
        x, y = self._data()
        tr, va = self.split()
        n_train = tr.numel()  # global: the split is drawn over all rows
        tr, va = self._local(tr), self._local(va)
        xt, yt = x[tr], y[tr]
        v = n_train * self.model.penalty
        L = self.cholesky_kmm()
        agg = self.aggregates(xt, yt, L)
        m = L.shape[-1]
        eye = torch.eye(m, dtype=L.dtype, device=L.device)
        beta = torch.linalg.solve(agg.AAt + v * eye, agg.AY)
        alpha = torch.linalg.solve_triangular(L.mT, beta, upper=True)  # (M, t)
        xv, yv = x[va], y[va]
        kernel, c = self.model.kernel, self.model.centers
        rows = self._rows(xv.shape[0])
        if xv.shape[0] > 0:
            with self._pass_budget():  # the model's own budget decides whether the pass keeps its graph
                sq = (self.backend_pass("kernel_matmul")(kernel, xv, c, alpha, rows) - yv).square().sum()
            (sq,) = self.reduce(sq)
        else:  # an empty part of this shard: zero, still part of the collective
            (sq,) = self.reduce(torch.zeros((), dtype=alpha.dtype, device=alpha.device), anchor=alpha.sum() * 0.0)
        return sq / (self.n_val * y.shape[-1])

    def observation_total(self, value: Tensor) -> Tensor:
        """A mean over the validation entries: times ``n t``."""
        return value * (self.model.n * self.model.num_outputs)


class SGPRBound(NystromObjective):
    """The Titsias (SGPR) negative ELBO with noise ``v = n lambda`` (summed over columns):

        (1/2) [ log det(K~ + v I) + y^T (K~ + v I)^{-1} y + (tr(K_nn) - tr(K~)) / v ] + (n/2) log 2 pi,

    ``log det(K~ + v I) = n log v + 2 sum log diag(L_B)`` and
    ``y^T (K~ + v I)^{-1} y = (||y||^2 - ||L_B^{-1} A y||^2 / v) / v``.
    GPyTorch's SGPR loss (``-ExactMarginalLogLikelihood``) is this divided by ``n``.
    Cost ``O(n M^2)``.
    """

    def objective(self) -> Tensor:
        x, y = self._data()
        n = self.model.n
        v = n * self.model.penalty
        agg = self.aggregates(x, y, self.cholesky_kmm())
        LB = self.cholesky_b(agg, v)
        t = self.smoother_terms(agg, LB, v)
        logdet = n * torch.log(v) + 2 * torch.log(LB.diagonal()).sum()
        quad = (agg.yy - t["ysy"]) / v
        trace = (agg.tr_knn - agg.tr_ktilde) / v
        per_col = 0.5 * (logdet + quad + trace) + 0.5 * n * self.log2pi()
        return per_col.sum()
