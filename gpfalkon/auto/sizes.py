"""Stage 2's sizes in :func:`~gpfalkon.auto_fit`: the searches at the first number of centers, the doubling of the
centers while it pays and fits the budget, and the level the final fit takes.

At the first size ``M_0`` a coordinate search (noise by a factor 4, the lengthscale multiplier by 1.5, the noise again
by 2) runs within the time the final fit's reserve leaves (:meth:`~gpfalkon.auto.growth._Growth.search_deadline`),
then the leverage-score pool is tried (:class:`~gpfalkon.auto.leverage._LeveragePool`). Each further level,
``M_{k+1} = 2 M_k`` (capped by the pool and ``max_centers``; without ``final_growth`` the largest factor >= 1.25
that fits), is taken where four selection fits and 1.2 x its final fit are predicted to fit the time left
(:meth:`~gpfalkon.auto.selection._Selection.select_cost`, ``final_cost``), searches its noise and multiplier, and must
gain ``min_gain log2(M_{k+1} / M_k)`` in validation error to let the doubling go on. With ``growth_first`` a doubling
is also refused where a final fit grown from ``M_k`` would reach more centers than one grown from ``M_{k+1}`` after
its searches (docs/math.md §8 "Noise and multiplier searches", "Budget", "Growth first"). The final level is the
lowest validation error among the levels whose final fit is predicted to fit the time left and 5 % of the budget (the
first level always). Cost: the selection fits, ``O(n_s M t + M^3)`` each, at most the budget.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .costs import GROWTH_STEP
from .growth import _Growth
from .leverage import _LeveragePool
from .report import AutoFitReport, _Clock
from .selection import _Selection

#: the share of the budget a level's final fit may run past the time left (its choice here, its CG's time limit in
#: stage 3): a prediction a little low still returns the level's model
GRACE = 0.05


@dataclass(eq=False)
class _Sizes:
    """The levels of stage 2 over the selection fits ``fits`` (the arguments of :func:`~gpfalkon.auto_fit` of the
    same names), within ``budget`` seconds of ``clock``. ``pool`` tries the leverage-score pool at the first size
    (``None``: ``center_sampling="uniform"``); ``level_done`` is called with each level as it ends."""

    fits: _Selection
    growth: _Growth
    pool: _LeveragePool | None
    report: AutoFitReport
    clock: _Clock
    budget: float
    max_centers: int
    min_gain: float
    noise_paths: bool
    final_growth: bool
    final_growth_factor: float
    growth_first: bool
    level_done: Callable[[dict[str, Any]], None]

    def first(self, m: int, noise: float) -> dict[str, Any]:
        """The first level: ``m`` centers from ``noise`` (stage 1's) and multiplier 1, searched by noise, multiplier
        and noise again within the time the final fit's reserve leaves; then the leverage-score pool's try."""
        fits, growth = self.fits, self.growth
        point = dict(noise=noise, multiplier=1.0)
        point["error"] = fits.score(m, point["noise"], point["multiplier"])
        # coordinate search at the first size: noise, multiplier, noise again (finer)
        stage_deadline = self.clock.t0 + self.budget  # refined below once a fit has been timed
        m_reserve = growth.reserve_size(m)
        if m_reserve > m:
            self.report.notes.append(f"the searches at M={m} keep time for a final fit grown up to M={m_reserve}")
        for which, factor, width, lo, hi in (("noise", 4.0, 2, 1e-8, 1e2), ("multiplier", 1.5, 1, 1e-3, 1e3),
                                             ("noise", 2.0, 1, 1e-8, 1e2)):
            stage_deadline = growth.search_deadline(m, m_reserve)
            if which == "noise" and self.noise_paths:
                fits.noise_search(m, point, factor, width, lo, hi, stage_deadline)
            else:
                fits.line_search(m, point, which, factor, lo, hi, stage_deadline)
        level: dict[str, Any] = dict(M=m, centers="uniform", **point)
        if self.pool is not None:
            self.pool.try_at(m, level, stage_deadline)
        self.level_done(level)
        return level

    def double(self, levels: list[dict[str, Any]]) -> bool:
        """Append levels of more centers to ``levels`` (which holds the first) while they fit the budget and gain;
        ``True`` where the doubling stopped for time (the final fit may then grow: ``_Growth.grown``)."""
        fits, growth, report, clock = self.fits, self.growth, self.report, self.clock
        m = int(levels[-1]["M"])
        while True:
            m_next = min(2 * m, fits.pool_limit(), self.max_centers)
            if m_next <= m:
                why = ("max_centers" if m >= self.max_centers
                       else f"all {fits.pool_limit()} distinct selection rows" if fits.pool["kind"] == "uniform"
                       else f"the {fits.pool_limit()} distinct leverage-score draws")
                report.notes.append(f"centers stopped at M={m}: {why}")
                return False
            # the next size needs about four selection fits (the noise and multiplier searches) and then the
            # final fit, each predicted from the fits measured at m by _scaled_fit_seconds (the M^3
            # factorisations, the M^2 triangular solves and the rest, each scaled by its own power of the
            # growth factor): 4 selection fits and 1.2 x its final fit must fit the time left, the stored-K_nM
            # closed form checked first. Where the final rows' K_nM crosses the memory budget between m and
            # the candidate, the final fit changes regime (the rows of K_nM past the budget recomputed at
            # each CG iteration) and the scaling from m says nothing about it: the candidate's on-the-fly
            # pass is measured (one pass over the selection rows). With final_growth only doubling is tried:
            # where it does not fit, the time a smaller step's searches would take goes to a final fit grown
            # from m (up to 2 m: _Growth.grown; `benchmarks/results/auto-ab-partial-s*.md`). Without it, the
            # largest factor >= 1.25 that fits is taken: first the largest the stored-K_nM prediction allows
            # (a bisection on that closed form), then smaller candidates down to 1.25 m on their own prediction.
            left = clock.left()

            def step_fits(m_new: int, m_from: int = m) -> bool:
                return (4 * fits.select_cost(m_new, m_from)
                        + 1.2 * fits.final_cost(m_new, base=m_from, rows=fits.fewest_final_rows(m_new)) <= clock.left())

            if self.final_growth:
                m_try = m_next if growth.stored_need(m, m_next) <= left and step_fits(m_next) else m
                if m_try > m and self.growth_first:
                    # a final fit grown from m now against one grown from m_try after its four selection fits
                    columns = len(growth.noises(levels[-1]))
                    # (stored K_nM only: no on-the-fly pass is measured for the comparison; on the steps of 1.15)
                    now = growth.reach(m, columns, stored_only=True, refine=False)
                    later = max(m_try, growth.reach(m_try, columns, spend=4 * fits.select_cost(m_try, m), base=m,
                                                    stored_only=True, refine=False))
                    # a grown fit held at its cap (final_growth_factor m) leaves time unused: the doubling then
                    # stops only where it falls a whole step (GROWTH_STEP) short, the steps' own resolution
                    capped = now >= growth.cap(m, self.final_growth_factor)
                    if now > (GROWTH_STEP * later if capped else later):
                        report.notes.append(
                            f"centers stopped at M={m}: a final fit grown from it reaches M={now}, one from M={m_try} "
                            f"after its searches M={later} (growth_first)")
                        return True
                    if now > later:
                        report.notes.append(
                            f"centers doubled to M={m_try}: a final fit grown from M={m} stops at its cap M={now} "
                            f"(final_growth_factor), one from M={m_try} after its searches reaches M={later}, within a "
                            f"step of {GROWTH_STEP:g} (growth_first)")
            else:
                m_try = m_next
                if growth.stored_need(m, m_next) > left:
                    lo_m, hi_m = m, m_next  # the need at hi_m exceeds what is left; at lo_m it does not
                    while hi_m - lo_m > max(1, m // 100):
                        mid = (lo_m + hi_m) // 2
                        lo_m, hi_m = (mid, hi_m) if growth.stored_need(m, mid) <= left else (lo_m, mid)
                    m_try = lo_m if lo_m >= min(math.ceil(1.25 * m), m_next) else m
                while m_try > m and not step_fits(m_try):
                    smallest = math.ceil(1.25 * m)
                    m_try = max(int(m_try / 1.25), smallest) if m_try > smallest else m
            if m_try <= m:
                grows = f"; the final fit grows from M={m} instead of a smaller step" if self.final_growth else ""
                report.notes.append(f"centers stopped at M={m}: M={m_next} would not fit the remaining budget{grows}")
                return True
            m = m_try
            point = dict(noise=levels[-1]["noise"], multiplier=levels[-1]["multiplier"])
            point["error"] = fits.score(m, point["noise"], point["multiplier"])
            # the best noise falls and the best lengthscales shorten as the Nystrom approximation improves
            if self.noise_paths:
                fits.noise_search(m, point, 2.0, 1, 1e-8, 1e2, self._search_deadline(m))
            else:
                fits.line_search(m, point, "noise", 2.0, 1e-8, 1e2, self._search_deadline(m))
            fits.line_search(m, point, "multiplier", 1.25, 1e-3, 1e3, self._search_deadline(m))
            levels.append(dict(M=m, centers=fits.pool["kind"], **point))
            self.level_done(levels[-1])
            if not math.isfinite(point["error"]):
                report.notes.append(f"centers stopped at M={m}: the fits failed")
                return False
            # min_gain is per doubling: a step by a factor f (smaller where the budget allows no doubling)
            # must gain min_gain * log2(f), so a short step is not held to a doubling's gain
            need = self.min_gain * math.log2(m / levels[-2]["M"])
            if point["error"] > levels[-2]["error"] * (1.0 - need):
                report.notes.append(
                    f"centers stopped at M={m}: validation error gained less than {100 * need:.2g}% over "
                    f"M={levels[-2]['M']} (min_gain {100 * self.min_gain:g}% per doubling)"
                )
                return False

    def _search_deadline(self, m: int) -> float:
        """When a search at a doubled size ``m`` stops: the budget's end less 1.2 x its final fit, predicted from the
        fits measured so far at ``m`` (read again before each search: each one measures more)."""
        return self.clock.t0 + self.budget - 1.2 * self.fits.final_cost(m)

    def choose(self, levels: list[dict[str, Any]]) -> dict[str, Any]:
        """The final fit's level: of the levels whose final fit (on its fewest rows,
        :meth:`_Selection.fewest_final_rows`) is predicted to fit the time left with a grace of 5 % of the budget
        (the first level always counts: a model is returned whatever the budget), the lowest validation error; a
        better level skipped for time goes to the notes."""
        fits, clock = self.fits, self.clock
        grace = GRACE * self.budget
        affordable = [levels[0]] + [r for r in levels[1:]
                                    if fits.final_cost(r["M"], rows=fits.fewest_final_rows(r["M"]))
                                    <= clock.left() + grace]
        best_level = min(affordable, key=lambda r: (r["error"], r["M"]))
        better = min(levels, key=lambda r: (r["error"], r["M"]))
        if better is not best_level:
            t_better = fits.final_cost(better["M"], rows=fits.fewest_final_rows(better["M"]))
            self.report.notes.append(f"level M={better['M']} (validation error {better['error']:.4g}) skipped: its "
                                     f"final fit is predicted at {t_better:.0f} s, {clock.left():.0f} s were left")
        return best_level
