"""Stage 1 of :func:`~gpfalkon.auto_fit`: the race of objectives and the leader's progressive subsampling.

Each round every live racer (:class:`~gpfalkon.auto.race._ObjectiveRun`) takes ``eval_every`` Adam steps on its
``n_h``-row subsample and is scored by a FALKON fit's validation error. The race is cut after its first round where
a round of the first racer leaves time for fewer racers in ``race_share`` of the stage; from round 2 a racer
trailing the leader by more than ``race_margin`` leaves; after ``race_rounds`` (or ``race_share`` of the stage) only
the leader goes on. The leader then moves on, from the best point so far, to ``2 x`` the rows (nested) and
``hyper_centers x (rows / n_h)^hyper_centers_growth`` centers (the earlier ones first) when it stalls or uses
``level_share`` of the time left, while ``rows x centers <= hyper_entries`` and the rows stay within ``rows_cap``;
it stops where a continuation gains nothing over fewer rows. Cost: the learning share of the budget (every step
and score stops at ``learn_deadline``).
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..centers import first_distinct
from ..models import FalkonGP
from .race import _ObjectiveRun, _racers_within
from .report import AutoFitReport, _Clock
from .scoring import _scoring_fit, _val_mse


@dataclass(eq=False)
class _Learning:
    """Stage 1's state: the racers (``runners``, continuations appended), the best point so far (``best_state``,
    updated in place) and the race's settings (:func:`~gpfalkon.auto_fit`'s arguments of the same names).

    ``h_model(kernel, noise, centers, learn, rows=None)`` builds a racer's model on the first ``rows`` rows of the
    subsample order ``h_perm`` of the standardised training inputs ``xt_z`` (``None``: the ``n_h`` of the first
    level); ``score_extra(m)`` gives the extra centers of a scoring fit at ``m`` centers. ``continue_gen`` draws
    the continuations' new centers (its own generator: how many continuations there are depends on the clock).
    """

    runners: list[_ObjectiveRun]
    best_state: dict[str, Any]
    report: AutoFitReport
    clock: _Clock
    h_model: Callable[..., FalkonGP]
    score_extra: Callable[[int], Tensor | None]
    xt_z: Tensor
    h_perm: Tensor
    xv_z: Tensor
    yv_z: Tensor
    n_h: int
    rows_cap: int
    n_racers: int
    hyper_centers: int
    hyper_centers_growth: float
    hyper_entries: int
    max_steps: int
    patience: int
    eval_every: int
    race_rounds: int
    race_margin: float | None
    race_share: float | None
    level_share: float
    learn_deadline: float
    t_stage: float
    learn_centers: bool
    lengthscale_step: str
    rescore_continuations: bool
    loo_points: list[dict[str, Any]] | None
    continue_gen: torch.Generator

    def run(self) -> None:
        """Race to the learning deadline (or until every racer stopped); every racer's record goes to the
        report's ``learn`` list, its failure (if any) to its notes."""
        self.rounds = 0
        self.race_decided = False  # the race ended before race_rounds (race_margin, race_share)
        self.rows_h = self.n_h
        self.t_race = time.perf_counter()
        while any(r.active for r in self.runners):
            self._round()
            self.rounds += 1
            if time.perf_counter() >= self.learn_deadline or self.clock.left() <= 0:
                for r in self.runners:
                    if r.active:
                        r.stop("learning share of the budget used")
                break
            live = self._cut()
            start, stalled, rows_next = self._next_start(live)
            if start is not None:
                self._continue(live[0], start, stalled, rows_next)
        for r in self.runners:
            r.rec["steps"] = r.step
            if r.failed:
                self.report.notes.append(f"objective {r.label} stopped: {r.failed}")
            self.report.learn.append(r.rec)

    def _round(self) -> None:
        """Each active racer's steps and score; after the first racer's first round, the cut to as many racers
        as ``race_share`` of the stage holds (:func:`_racers_within`)."""
        active = [r for r in self.runners if r.active]
        for i, r in enumerate(active):
            if not r.active:  # cut from the race below
                continue
            self.clock.tick(f"learn {r.label}", step=r.step)
            r.advance(self.max_steps, self.learn_deadline)
            if r.active:
                r.evaluate(self.xv_z, self.yv_z, self.patience, self.max_steps)
            if r.rec["best_error"] < self.best_state["error"] and r.best is not None:
                self.best_state.update(r.best)
            if r.rec["curve"]:
                err = r.rec["curve"][-1][2]
                self.clock.tick(f"learn {r.label}", step=r.step, val_rmse=f"{math.sqrt(err):.4f}")
            if self.rounds == 0 and i == 0 and len(active) > 1 and self.race_share is not None:
                first_round = time.perf_counter() - self.t_race
                kept = _racers_within(first_round, len(active),
                                      self.t_stage + self.race_share * (self.learn_deadline - self.t_stage)
                                      - self.t_race)
                for cut in active[kept:]:
                    cut.stop(f"not raced: a round of the first racer took {first_round:.2g} s, "
                             f"and {kept} of the {len(active)} racers' first round fits in race_share "
                             f"({self.race_share:g}) of the learning stage")
                self.race_decided = self.race_decided or kept == 1

    def _cut(self) -> list[_ObjectiveRun]:
        """The race after a round: after ``race_rounds`` (or ``race_share`` of the stage) only the leader goes on;
        from round 2, whoever trails it by more than ``race_margin`` leaves at once. Returns the racers left."""
        race_share, race_margin, rounds = self.race_share, self.race_margin, self.rounds
        still = [r for r in self.runners if r.active]
        by_share = (race_share is not None and rounds < self.race_rounds
                    and time.perf_counter() - self.t_stage >= race_share * (self.learn_deadline - self.t_stage))
        final = rounds == self.race_rounds or by_share
        by_margin = race_margin is not None and 2 <= rounds < self.race_rounds
        if len(still) > 1 and (final or by_margin):
            leader = min(still, key=lambda r: r.rec["best_error"])
            best = leader.rec["best_error"]
            for r in still:
                if r is leader:
                    continue
                if by_margin and r.rec["best_error"] > (1.0 + race_margin) * best:  # type: ignore[operator]
                    r.stop(f"dropped after {rounds} rounds: best validation error {r.rec['best_error']:.4g} "
                           f"> (1 + race_margin) x the leader's ({leader.label}, {best:.4g})")
                elif by_share:
                    r.stop(f"dropped after {rounds} rounds: the race used race_share ({race_share:g}) of the "
                           f"learning stage (leader: {leader.label})")
                elif final:
                    r.stop(f"dropped after {self.race_rounds} rounds (leader: {leader.label})")
        live = [r for r in self.runners if r.active]
        # a race of several objectives is decided once one is left after round 2 (by race_margin, or the
        # others failed or stalled): the leader goes on as after race_rounds
        self.race_decided = self.race_decided or (race_margin is not None and self.n_racers > 1 and rounds >= 2
                                                  and len(live) == 1) or (by_share and len(live) == 1)
        return live

    def _next_start(self, live: list[_ObjectiveRun]) -> tuple[dict[str, Any] | None, bool, int]:
        """Where the sole leader of a decided race moves on to twice the rows: the best point so far (its own,
        or the best overall where it is the leader's), and whether it stalled (else it used ``level_share`` of
        the time left when it started on these rows), and the rows it moves on to; ``None`` where it stays, or
        stops for good."""
        rows_h, best_state = self.rows_h, self.best_state
        start = None
        rows_next = min(2 * rows_h, self.rows_cap)
        lead = live[0] if (self.rounds >= self.race_rounds or self.race_decided) and len(live) == 1 else None
        stalled = lead is not None and lead.stalled()
        # the geometric split of the learning share: past level_share of the time left when it started
        # on these rows, the leader moves on to twice the rows (where it may)
        level_over = (lead is not None and not stalled and rows_next > rows_h
                      and rows_next * lead.model.centers.shape[0] <= self.hyper_entries
                      and time.perf_counter() - lead.t0 >= self.level_share * (self.learn_deadline - lead.t0))
        if stalled or level_over:
            start = best_state if best_state["racer"] == live[0].label else (live[0].best or best_state)
            if rows_next <= rows_h or rows_next * start["centers"].shape[0] > self.hyper_entries:
                # stalled on as many rows as it may use: more steps here buy little; the rest of the
                # learning share goes to the selection stage
                live[0].stop(f"stalled on {rows_h:,} rows, the most it may use")
                start = None
            elif rows_h > self.n_h and (live[0].best is None
                                        or live[0].rec["best_error"] >= live[0].rec.get("start_score", math.inf)):
                # a continuation on twice the rows found nothing better than the best point on fewer rows, or
                # than its start scored on these rows (rescore_continuations: then what it gained over the score
                # on fewer rows was the rows'; its best point is kept, it was learned on more rows): the
                # hyperparameters have stopped moving with the rows, and a further doubling would cost twice
                # as much per step for the same; the rest of the share goes to selection
                live[0].stop(f"stalled on {rows_h:,} rows with no gain over fewer rows" if live[0].best is None
                             else f"stalled on {rows_h:,} rows with no gain over its start on these rows "
                             f"({live[0].rec['start_score']:.4g})")
                start = None
        return start, stalled, rows_next

    def _continue(self, old: _ObjectiveRun, start: dict[str, Any], stalled: bool, rows_next: int) -> None:
        """Progressive subsampling: ``old`` stops, and a fresh racer (a fresh optimiser) of its objective goes on
        from ``start`` with ``rows_next`` rows (twice as many, within ``rows_cap``) and
        ``hyper_centers x (rows / n_h)^hyper_centers_growth`` centers (both nested: ``start``'s centers, then
        distinct new rows)."""
        xt_z, dtype = self.xt_z, self.xt_z.dtype
        rows_prev, self.rows_h = self.rows_h, rows_next
        rows_h = self.rows_h
        c_start = start["centers"]
        grown = round(self.hyper_centers * (rows_h / self.n_h) ** self.hyper_centers_growth)
        m_next = min(max(c_start.shape[0], grown), self.hyper_entries // rows_h, rows_h - rows_prev + c_start.shape[0])
        new_rows = self.h_perm[rows_prev:rows_h]
        draw = torch.randperm(new_rows.shape[0], generator=self.continue_gen, device=xt_z.device)
        # new rows equal to a center (or to an earlier new row) are skipped; the first 4 k + 64 of the draw
        # are looked at first (k the centers wanted), all of them only where too few of those are distinct
        k_new = m_next - c_start.shape[0]
        for look in (min(int(draw.numel()), 4 * k_new + 64), int(draw.numel())):
            cand = xt_z[new_rows[draw[:look]]]
            new_c = cand[first_distinct(torch.cat([c_start.to(dtype), cand], 0))[c_start.shape[0]:]]
            if new_c.shape[0] >= k_new:
                break
        centers_next = torch.cat([c_start.to(dtype), new_c[:k_new]], 0)
        why = "stalled" if stalled else f"level share ({self.level_share:g}) used"
        old.stop(f"{why}; continued on {rows_h:,} rows, {centers_next.shape[0]:,} centers")
        nxt = self.h_model(copy.deepcopy(start["kernel"]), float(start["noise"]), centers_next, self.learn_centers,
                           rows=rows_h)
        extra_next = self.score_extra(centers_next.shape[0])
        start_score = math.inf  # none: the stop rule of _next_start compares with the score on fewer rows only
        if self.rescore_continuations:
            # the start's own score on the new rows: a scoring fit on twice the rows validates better at
            # the same hyperparameters, so a gain over the score on fewer rows may be the rows' alone
            try:
                start_score = _val_mse(_scoring_fit(nxt, extra_next), self.xv_z, self.yv_z)
            except Exception as exc:
                self.report.notes.append(f"the start of the continuation on {rows_h:,} rows failed to fit: "
                                         f"{type(exc).__name__}: {exc}")
        fam_next = start.get("family", old.family)
        # (the leader's own label, unless its start is another family's point: the best point so far where
        # the leader never beat it)
        label_next = old.label if fam_next == old.family else f"{old.name}@{old.lr:g}/{fam_next}"
        self.runners.append(_ObjectiveRun(old.name, nxt, old.lr, self.eval_every, self.best_state["error"],
                                          extra_next, self.lengthscale_step, label_next,
                                          start_score=start_score if math.isfinite(start_score) else None,
                                          family=fam_next))
        self.runners[-1].points = self.loo_points
