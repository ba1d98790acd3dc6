"""Stage 2 of :func:`~gpfalkon.auto_fit`: the selection fits, their searches and the cost model measured on them.

A selection fit at ``M`` nested centers (the pool's first ``M``), noise ``sigma^2`` and lengthscale multiplier
``c`` is FALKON on the selection rows of ``M`` (penalty ``lambda = sigma^2 / n``, the kernel's lengthscales times
``c``), scored by its validation mean squared error in standardised units; errors are cached by
``(M, log sigma^2, log c, pool)``. A noise search solves several noises at once by a penalty path (one CG, one
factorisation per further noise); a 1-D line search steps by a factor while the error falls by more than
``search_tol``. The cost model predicts a fit at another size, on other rows, at several noises from the measured
single fits (:func:`~gpfalkon.auto.costs._scaled_fit_seconds`), with the on-the-fly passes of a ``K_nM`` past the
memory budget measured once per size. Cost: one FALKON fit, ``O(n M t + M^3)``, per uncached point.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..backend import stored_rows_for
from ..centers import NestedLeverageCenters
from ..models import FalkonGP
from ..options import FalkonOptions
from .costs import _factor_growth, _onthefly_pass_seconds, _scaled_fit_seconds
from .kernels import _scale_lengthscales
from .report import AutoFitReport, _Clock
from .scoring import _fit_quiet, _path_means, _path_quiet, _path_steps, _path_val_mse, _PathFailed, _val_mse

#: a selection fit's key: (M, log noise, log multiplier, pool kind), the logs rounded to 6 digits
ScoreKey = tuple[int, float, float, str]


def score_key(m: int, noise: float, mult: float, kind: str) -> ScoreKey:
    """The key of a selection fit (its cached error, its calibration residuals and its coefficients)."""
    return (int(m), round(math.log(noise), 6), round(math.log(mult), 6), kind)


@dataclass(eq=False)
class _Selection:
    """The selection fits of one :func:`~gpfalkon.auto_fit` call and what they measured.

    Rows: the selection rows of every size are prefixes of the permutation ``s_order`` of the standardised training
    rows ``xt_z, yt_z``: ``n_s`` at the first size ``m_first``, with ``grow_rows`` as many more as the centers grew.
    Centers: ``pool["kind"]`` names the pool every size draws from, ``"uniform"`` (prefixes of ``c_pool``) or a
    leverage pool (``pool["nested"]``, a :class:`~gpfalkon.centers.NestedLeverageCenters` over ``xs``).
    ``keep_cal``: each fit's residuals on the calibration rows ``xv_cal, yv_cal`` are kept (``cal_residuals``);
    every fit's coefficients are (``alpha``). The cost model's final fit is on ``n_final`` rows at ``max_iter``
    iterations, its ``K_nM`` stored within ``budget_at(M)`` bytes.
    """

    xt_z: Tensor
    yt_z: Tensor
    s_order: Tensor
    n_s: int
    m_first: int
    grow_rows: bool
    n_back: int
    n_final: int
    xs: Tensor
    ys: Tensor
    c_pool: Tensor
    base_kernel: Kernel
    score_iter: int
    max_iter: int
    tol: float
    options: FalkonOptions
    xv_z: Tensor
    yv_z: Tensor
    xv_cal: Tensor
    yv_cal: Tensor
    keep_cal: bool
    search_tol: float
    report: AutoFitReport
    clock: _Clock
    budget_at: Callable[[int], int]
    store_dtype: torch.dtype
    pool: dict[str, Any] = field(default_factory=lambda: dict(kind="uniform", nested=None))
    #: validation error of every selection fit made
    cache: dict[ScoreKey, float] = field(default_factory=dict)
    #: residuals on the calibration rows of every fit with a finite error (``keep_cal``)
    cal_residuals: dict[ScoreKey, Tensor] = field(default_factory=dict)
    #: coefficients (standardised units) of every fit with a finite error
    alpha: dict[ScoreKey, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.n_tr = int(self.xt_z.shape[0])
        self.n_pool = int(self.c_pool.shape[0])  # the uniform pool's size
        self.level_rows: dict[int, tuple[Tensor, Tensor]] = {self.n_s: (self.xs, self.ys)}
        self.pass_cache: dict[int, float] = {}
        self.growth_cache: dict[int, float] = {}
        self.itemsize = torch.finfo(self.xt_z.dtype).bits // 8

    # ------------------------------------------------------------------ rows and centers
    def rows_at(self, m: int) -> int:
        """Selection rows of the fits at ``m`` centers: ``n_s`` at the first size; with ``grow_rows``, as many
        more nested rows as the centers grew (the first size's rows per center), at most the training rows."""
        if not self.grow_rows or m <= self.m_first:
            return self.n_s
        return min(self.n_tr, round(self.n_s * m / self.m_first))

    def rows_of(self, m: int) -> tuple[Tensor, Tensor]:
        """The standardised selection rows (inputs, targets) of the fits at ``m`` centers (the first size's
        and the latest other size's are kept; an earlier one is gathered again)."""
        r = self.rows_at(m)
        if r not in self.level_rows:
            for old in [k for k in self.level_rows if k != self.n_s]:
                del self.level_rows[old]
            self.level_rows[r] = (self.xt_z[self.s_order[:r]], self.yt_z[self.s_order[:r]])
        return self.level_rows[r]

    def fewest_final_rows(self, m: int) -> int:
        """The fewest rows a final fit at ``m`` centers takes: every final row, or with ``grow_rows`` the
        size's selection rows plus the held-out rows put back (what its validation error was measured on,
        and the validation rows)."""
        return min(self.n_final, self.rows_at(m) + self.n_back) if self.grow_rows else self.n_final

    def centers_at(self, m: int, kind: str | None = None) -> tuple[Tensor, Tensor | None]:
        """The ``m`` nested centers of the pool ``kind`` (default: the current one) and their weights."""
        kind = self.pool["kind"] if kind is None else kind
        if kind == "uniform":
            return self.c_pool[:m], None
        nested: NestedLeverageCenters = self.pool["nested"]
        sel = nested.select(self.xs, m)
        return sel.centers, sel.weights

    def pool_limit(self) -> int:
        """The most centers the current pool holds."""
        return self.n_pool if self.pool["kind"] == "uniform" else min(self.n_s, self.pool["nested"].size)

    # ------------------------------------------------------------------ fits and their scores
    def selection_model(self, m: int, noise: float, mult: float, kind: str) -> FalkonGP:
        """The (unfitted) selection model at ``m`` centers of the pool ``kind``, at ``noise`` and ``mult``, on the
        selection rows of ``m``."""
        k = copy.deepcopy(self.base_kernel)
        _scale_lengthscales(k, mult)
        c_m, w_m = self.centers_at(m, kind)
        x_m, y_m = self.rows_of(m)
        return FalkonGP(x_m, y_m, kernel=k, centers=c_m, center_weights=w_m, penalty=noise / x_m.shape[0],
                        max_iter=self.score_iter, tol=self.tol, options=self.options)

    def record(self, m: int, noises: Sequence[float], mult: float, kind: str, errors: Sequence[float],
               seconds: float, converged: bool, info: Any | None, **extra: Any) -> None:
        """Cache the validation errors of the selection fits at ``noises`` and record them in ``report.search``
        (the CG's iterations, method and times from ``info``, the fit's or path's :class:`CGInfo`)."""
        parts = info.extra if info is not None else {}
        for v, err in zip(noises, errors, strict=True):
            self.cache[score_key(m, v, mult, kind)] = err
            self.report.search.append(dict(M=m, rows=self.rows_at(m), noise=v, multiplier=mult, error=err,
                                           seconds=seconds, converged=converged,
                                           iterations=info.iterations if info is not None else None, centers=kind,
                                           precond_seconds=float(parts.get("preconditioner_seconds", 0.0)),
                                           apply_seconds=float(parts.get("precond_apply_seconds", 0.0)),
                                           direct=parts.get("method") == "direct", **extra))
        best = min(errors)
        self.clock.tick(f"select M={m}", val_rmse=f"{math.sqrt(best):.4f}" if math.isfinite(best) else "inf")

    def score(self, m: int, noise: float, mult: float, kind: str | None = None) -> float:
        """The validation error of a selection fit at ``m`` centers of the pool ``kind``, at ``noise`` and
        ``mult``, on the selection rows of ``m``."""
        kind = self.pool["kind"] if kind is None else kind
        key = score_key(m, noise, mult, kind)
        if key in self.cache:
            return self.cache[key]
        t = time.perf_counter()
        info = None
        try:
            mod, conv = _fit_quiet(self.selection_model(m, noise, mult, kind))
            err = _val_mse(mod, self.xv_z, self.yv_z)
            if self.keep_cal and math.isfinite(err):
                self.cal_residuals[key] = self.yv_cal - mod.posterior_mean(self.xv_cal).to(torch.float64)
            if math.isfinite(err):
                self.alpha[key] = mod.alpha.detach().reshape(-1).clone()
            info = mod.fit_info
            del mod
            if not math.isfinite(err):  # NaN / inf predictions: an infeasible point
                err = math.inf
        except Exception as exc:
            err, conv = math.inf, False
            self.report.notes.append(f"selection fit M={m} noise={noise:.3g} mult={mult:.3g} failed: {exc}")
        self.record(m, [noise], mult, kind, [err], time.perf_counter() - t, conv, info)
        return err

    def score_path(self, m: int, noises: Sequence[float], mult: float, kind: str | None = None) -> list[float]:
        """The validation errors of selection fits at ``m`` centers of the pool ``kind`` at each of ``noises`` and
        ``mult``, as :meth:`score` gives one: those not scored yet from one penalty path, one CG for all of them
        (:meth:`FalkonGP.fit_penalty_path <gpfalkon.FalkonGP.fit_penalty_path>`, each column the fit at its noise,
        about one fit plus a factorisation and a preconditioner's solves per further noise) and scored by one
        kernel pass over the validation rows for all (:func:`_path_val_mse`), recorded as :meth:`score` records a
        fit, with ``path`` (the noises solved together) and the path's ``seconds``; one noise left:
        :meth:`score`. A path that raises caches nothing and raises :class:`_PathFailed` (noted in the report)."""
        kind = self.pool["kind"] if kind is None else kind
        todo = [v for v in dict.fromkeys(noises) if score_key(m, v, mult, kind) not in self.cache]
        if len(todo) == 1:
            self.score(m, todo[0], mult, kind)
        elif todo:
            t = time.perf_counter()
            try:
                mod = self.selection_model(m, todo[0], mult, kind)
                path, conv = _path_quiet(mod, [v / mod.n for v in todo], None, None)
                errs = [e if math.isfinite(e) else math.inf for e in _path_val_mse(mod, path, self.xv_z, self.yv_z)]
                cal = self.yv_cal.unsqueeze(0) - _path_means(mod, path, self.xv_cal) if self.keep_cal else None
                alphas = [path.alphas[j].detach().reshape(-1).clone() for j in range(len(todo))]
                info = path.info
                del mod, path
            except Exception as exc:
                # nothing is cached: the search's single fits score these noises (a path fails whole where one
                # of its penalties breaks CG down; one fit at a time loses only that one)
                self.report.notes.append(f"selection path M={m} noises={', '.join(f'{v:.3g}' for v in todo)} "
                                         f"mult={mult:.3g} failed ({type(exc).__name__}: {exc}); single fits instead")
                raise _PathFailed(str(exc)) from exc
            for j, v in enumerate(todo):
                if math.isfinite(errs[j]):
                    key = score_key(m, v, mult, kind)
                    if cal is not None:
                        self.cal_residuals[key] = cal[j]
                    self.alpha[key] = alphas[j]
            self.record(m, todo, mult, kind, errs, time.perf_counter() - t, conv, info, path=len(todo))
        return [self.cache[score_key(m, v, mult, kind)] for v in noises]

    # ------------------------------------------------------------------ searches
    def line_search(self, m: int, point: dict[str, float], which: str, factor: float, lo: float, hi: float,
                    deadline: float) -> None:
        """Log-spaced 1-D search around ``v = point[which]``: steps of ``factor`` downwards while the error
        falls by more than ``search_tol`` (relative); if the first step down did not improve, steps upwards
        likewise (so the grid keeps extending past its edge as long as the best point is at that edge by a
        margin), within ``[lo, hi]`` and the deadline. A lower error is always kept, even when its gain
        ends the search. A start outside ``[lo, hi]`` is first moved to the nearest bound."""
        if not lo <= point[which] <= hi:
            clamped = min(max(point[which], lo), hi)
            trial = dict(point, **{which: clamped})
            point.update(trial, error=self.score(m, trial["noise"], trial["multiplier"]))
        best = point["error"]
        for direction in (1.0 / factor, factor):
            v = point[which]
            moved = False
            # a fit is started only when the slowest one at this size so far would end by the deadline
            while time.perf_counter() + self.last_fit_seconds(m) < deadline:
                cand = v * direction
                if not lo <= cand <= hi:
                    break
                trial = dict(point, **{which: cand})
                e = self.score(m, trial["noise"], trial["multiplier"])
                if e < best:
                    flat = e > best * (1.0 - self.search_tol)
                    best, v, moved = e, cand, True
                    point.update(trial, error=e)
                    if flat:
                        break
                else:
                    break
            if moved:
                return  # went down: the first step up is not tried (one descent direction per search)

    def noise_search(self, m: int, point: dict[str, float], factor: float, width: int, lo: float, hi: float,
                     deadline: float) -> None:
        """Log-spaced search of the noise around ``v = point["noise"]`` by penalty paths (:func:`_path_steps` on
        the steps ``v factor^j``, each path scored by :meth:`score_path`), within ``[lo, hi]`` and the deadline: a
        path is started only when its prediction (:meth:`predicted_fit_seconds` at its number of noises; one
        noise: the slowest single fit at ``m``) ends by then. A start outside ``[lo, hi]``, a deadline that
        leaves no room for a path of the nearest step on each side, or a path that fails (from the best point the
        paths before it found): :meth:`line_search`'s single fits."""
        if not lo <= point["noise"] <= hi:
            self.line_search(m, point, "noise", factor, lo, hi, deadline)
            return
        v0, mult = point["noise"], point["multiplier"]

        def at(j: int) -> float:
            return v0 * factor**j

        def fits(columns: int) -> bool:
            cost = (self.predicted_fit_seconds(m, m, 1.0, columns=columns) if columns > 1
                    else self.last_fit_seconds(m))
            return time.perf_counter() + cost < deadline

        scored: dict[int, float] = {}

        def scores(steps: list[int]) -> list[float]:
            errs = self.score_path(m, [at(j) for j in steps], mult)
            scored.update(zip(steps, errs, strict=True))
            return errs

        try:
            found = _path_steps(scores, point["error"], width, lambda j: lo <= at(j) <= hi, fits, self.search_tol)
        except _PathFailed:
            found = None
            if scored:  # the best of the paths that ran, then the single fits from there
                best = min(scored, key=lambda j: (scored[j], abs(j)))
                if scored[best] < point["error"]:
                    point.update(noise=at(best), error=scored[best])
        if found is None:
            self.line_search(m, point, "noise", factor, lo, hi, deadline)
        elif found[0] != 0:
            point.update(noise=at(found[0]), error=found[1][found[0]])

    # ------------------------------------------------------------------ the cost model
    def single_fits(self, m: int) -> list[dict[str, Any]]:
        """The selection fits at ``m`` made one at a time (a path's records are not one fit's time)."""
        return [r for r in self.report.search if r["M"] == m and not r.get("path")]

    def last_fit_seconds(self, m: int) -> float:
        """The slowest single selection fit at ``m`` (0 before the first)."""
        times = [r["seconds"] for r in self.single_fits(m)]
        return max(times) if times else 0.0

    def onthefly_pass_seconds(self, m: int) -> float:
        """One ``K_Mn (K_nM u)`` pass over the selection rows with ``K_nM`` recomputed block by block
        (measured once per ``m``)."""
        if m not in self.pass_cache:
            self.pass_cache[m] = _onthefly_pass_seconds(self.base_kernel, self.xs, self.centers_at(m)[0])
        return self.pass_cache[m]

    def factor_growth_at(self, m: int) -> float:
        """The factorisations' measured ``t(2 m) / t(m)`` (:func:`_factor_growth`, once per size and call)."""
        if m not in self.growth_cache:
            self.growth_cache[m] = _factor_growth(m, self.xs.device)
        return self.growth_cache[m]

    def predicted_fit_seconds(self, m: int, m_new: int, rows_ratio: float | None = None, columns: int = 1) -> float:
        """A fit at ``m_new`` centers on ``rows_ratio`` times the rows of the selection fits measured at
        ``m`` (default: on the selection rows of ``m_new``), at ``columns`` penalties at once, predicted from
        those fits by :func:`_scaled_fit_seconds`."""
        ratio = self.rows_at(m_new) / self.rows_at(m) if rows_ratio is None else rows_ratio
        return _scaled_fit_seconds(self.single_fits(m), m_new / m, ratio, columns, self.factor_growth_at(m))

    def stored(self, rows: int, m: int) -> bool:
        """Whether a fit's ``K_nM`` on ``rows`` rows at ``m`` centers is stored whole within ``budget_at(m)``."""
        return self.stored_rows(rows, m) >= rows

    def stored_rows(self, rows: int, m: int) -> int:
        """The rows of a fit's ``K_nM`` (``rows`` rows, ``m`` centers) the engine stores within ``budget_at(m)``."""
        return stored_rows_for(rows, m, self.itemsize, self.budget_at(m), device=self.xs.device,
                               store_dtype=self.store_dtype, d=int(self.xs.shape[1]))

    def fit_cost(self, m: int, base: int, rows: int, iterations: int, columns: int = 1) -> float:
        """A fit at ``m`` centers on ``rows`` rows with at most ``iterations`` CG iterations, predicted
        from the selection fits at ``base``: scaled to the rows (FALKON's passes are linear in the rows,
        its factorisations and triangular solves independent of them) while its ``K_nM`` fits the memory
        budget (stored, as it was in the selection fits); beyond it the engine stores the rows that fit
        and every CG iteration recomputes the others: ``iterations + 2`` measured on-the-fly passes over
        those rows on top. ``columns``: penalties solved at once (:func:`_scaled_fit_seconds`)."""
        cost = self.predicted_fit_seconds(base, m, max(1.0, rows / self.rows_at(base)), columns)
        head = self.stored_rows(rows, m)
        if head < rows:
            recompute = (iterations + 2) * self.onthefly_pass_seconds(m) * (rows - head) / self.n_s
            # plus a fit on the first size's n_s rows: the parts that do not grow with the rows
            cost = max(cost, cost * head / rows + recompute
                       + self.predicted_fit_seconds(base, m, self.n_s / self.rows_at(base), columns))
        return cost

    def final_cost(self, m: int, base: int | None = None, rows: int | None = None, columns: int = 1) -> float:
        """The final fit at ``m`` on ``rows`` final rows (default: all of them) at ``columns`` penalties at
        once, predicted from the selection fits at ``base`` (default ``m`` itself) by :meth:`fit_cost`."""
        return self.fit_cost(m, m if base is None else base, self.n_final if rows is None else rows, self.max_iter,
                             columns)

    def select_cost(self, m_new: int, m: int) -> float:
        """One selection fit at ``m_new`` centers (on its selection rows), predicted from those at ``m``: with
        ``grow_rows`` by :meth:`fit_cost` (its rows may cross the memory budget), else the stored-``K_nM``
        closed form (the ``n_s`` rows stay as they were)."""
        if self.grow_rows:
            return self.fit_cost(m_new, m, self.rows_at(m_new), self.score_iter)
        return self.predicted_fit_seconds(m, m_new)
