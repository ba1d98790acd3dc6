"""Stage 1 of :func:`~gpfalkon.auto_fit`: objectives raced by Adam, judged on validation error.

Each racer (objective, learning rate, kernel family) is an ``_ObjectiveRun``: Adam on its objective
(:data:`OBJECTIVES`: SGPR bound, GCV, C-Reg, Nyström C-Reg, LOOCV, stochastic Nyström C-Reg; Meanti et al. 2022)
over a subsample, scored every ``eval_every`` steps by the validation error of a FALKON fit at the current
hyperparameters. Cost: per step the objective's (``O(n_h M_h^2)`` for the Nyström objectives on ``n_h`` rows and
``M_h`` centers), per evaluation one FALKON fit.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._optim import Adam
from ..models import FalkonGP
from ..objectives import GCV, LOOCV, CompReg, NystromCompReg, SGPRBound, StochasticNystromCompReg
from .kernels import KERNEL_FAMILIES, _lengthscale_modules
from .scoring import _scoring_fit, _val_mse

#: objective name -> class (the names ``objectives=`` accepts)
OBJECTIVES: dict[str, type] = {
    "sgpr": SGPRBound,
    "gcv": GCV,
    "compreg": CompReg,
    "nystrom-compreg": NystromCompReg,
    "loocv": LOOCV,
    "stochastic-nystrom-compreg": StochasticNystromCompReg,
}


def _positive_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number > 0 (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        rate = float(value)
    except OverflowError:
        return None
    return rate if math.isfinite(rate) and rate > 0 else None


#: the kernel family of the extra racer in :func:`auto_fit`'s default race (GCV at twice the learning rate in it)
RACE_FAMILY = "rbf"


def _racers(objectives: Any, lr: float, family: str | None) -> list[tuple[str, float, str, str | None]]:
    """``objectives=`` as ``(name, lr, label, family)`` racers: a name runs at ``lr`` (label: the name), a
    ``(name, lr)`` pair (any two-item sequence) at its own learning rate (label ``"name@lr"``), both in ``family``
    (``kernel=``'s family; ``None``: a given ``Kernel``); a ``(name, lr, family)`` triple in that kernel family of
    :data:`KERNEL_FAMILIES` (label ``"name@lr/family"`` where it is not ``kernel=``'s). ``None``: the default, GCV at
    ``2 lr`` in ``family``, GCV at ``2 lr`` in :data:`RACE_FAMILY` where ``family`` is another family, then GCV at
    ``lr`` and the SGPR bound in ``family``: the order they won in, which is the order a cut race keeps them in
    (:func:`_racers_within`)."""
    if objectives is None:
        # in the order they won the race (the first to go when the race is cut: _racers_within)
        objectives = [("gcv", 2.0 * lr)]
        if family is not None and family != RACE_FAMILY:
            objectives.append(("gcv", 2.0 * lr, RACE_FAMILY))
        objectives += ["gcv", "sgpr"]
    if isinstance(objectives, str) or not isinstance(objectives, Sequence) or not objectives:
        raise ValueError("objectives must be a non-empty sequence of names from "
                         f"{sorted(OBJECTIVES)}, (name, lr) pairs or (name, lr, family) triples, got {objectives!r}")
    out: list[tuple[str, float, str, str | None]] = []
    for spec in objectives:
        fam = family
        if isinstance(spec, str):
            name, rate, label = spec, lr, spec
        elif isinstance(spec, Sequence) and len(spec) in (2, 3) and isinstance(spec[0], str):  # (str: branch above)
            name, given = spec[0], spec[1]
            rate = _positive_number(given)  # type: ignore[assignment]
            if rate is None:
                raise ValueError(f"objectives: the learning rate of {spec!r} must be a finite number > 0")
            label = f"{name}@{rate:g}"
            if len(spec) == 3:
                fam = spec[2]
                if not isinstance(fam, str) or fam not in KERNEL_FAMILIES:
                    raise ValueError(f"objectives: the kernel family of {spec!r} must be one of "
                                     f"{sorted(KERNEL_FAMILIES)}")
                if family is None:
                    raise ValueError(f"objectives: {spec!r} names a kernel family, which needs kernel= to be a family "
                                     "name (a given Kernel sees the raw inputs, a family the standardised ones)")
                if fam != family:
                    label = f"{label}/{fam}"
        else:
            raise ValueError(f"objectives: each entry must be a name, a (name, lr) pair or a (name, lr, family) "
                             f"triple, got {spec!r}")
        if name not in OBJECTIVES:
            raise ValueError(f"objectives: unknown {name!r}; known: {sorted(OBJECTIVES)}")
        if any(o[0] == name and o[1] == rate and o[3] == fam for o in out):
            raise ValueError(f"objectives: {name!r} at learning rate {rate:g}"
                             + ("" if fam is None else f" in the {fam!r} family") + " is named twice")
        if any(o[2] == label for o in out):
            label = f"{name}@{rate!r}" + ("" if fam == family else f"/{fam}")  # two rates that print alike
        base, k = label, 2
        while any(o[2] == label for o in out):  # (the exact rate printed alike too: the racers' labels stay distinct)
            label, k = f"{base}#{k}", k + 1
        out.append((name, rate, label, fam))
    return out


def _racers_within(first_round: float, racers: int, seconds: float) -> int:
    """How many of ``racers`` objectives race in stage 1, where the first racer's first round (its steps and its
    validation score) took ``first_round`` seconds and the race may take ``seconds`` (its ``race_share`` of the
    learning stage, less what went before it): as many rounds as fit, at least one and at most ``racers``.
    A race whose first round takes the whole learning share chooses among points none of which had time to
    learn: at a 5-second budget four racers of 7-10 steps each left bike's test error 2.2 times and pol's 1.1 times
    that of the first racer alone with the share (``benchmarks/results/race-cut-ab-s59.md``)."""
    if first_round <= 0 or not math.isfinite(seconds):
        return racers
    return max(1, min(racers, int(seconds / first_round)))


class _ObjectiveRun:
    """One objective of stage 1: its model (on the subsample), optimiser and validation record."""

    def __init__(self, name: str, model: FalkonGP, lr: float, eval_every: int,
                 start_error: float, score_pool: Tensor | None = None, lengthscale_step: str = "shared",
                 label: str | None = None, start_score: float | None = None, family: str | None = None) -> None:
        rows = model.n
        self.name = name
        self.family = family  # the kernel family (None: a given Kernel)
        self.lr = float(lr)
        self.label = name if label is None else label  # the racer's name: the objective, and its lr if given
        self.model = model
        self.score_pool = score_pool
        self.obj = OBJECTIVES[name](model)
        params = [p for p in model.parameters() if p.requires_grad]
        # "shared": each lengthscale vector's second moments floored at their mean (small gradients, small steps)
        shared = ([m.raw_lengthscale for m in _lengthscale_modules(model.kernel) if m.raw_lengthscale.requires_grad]
                  if lengthscale_step == "shared" else [])
        # torch.optim.Adam's update without its first-use import (_optim)
        self.opt = Adam(params, lr=lr, shared=shared)
        self.eval_every = eval_every
        self.t0 = time.perf_counter()
        self.step = 0  # Adam steps
        self.since_best = 0
        self.active = True
        self.failed: str | None = None
        self.best: dict[str, Any] | None = None
        self.rec: dict[str, Any] = dict(objective=name, racer=self.label, lr=self.lr, kernel=family, rows=rows,
                                        centers=int(model.centers.shape[0]),
                                        score_centers=int(model.centers.shape[0])
                                        + (0 if score_pool is None else int(score_pool.shape[0])), steps=0,
                                        best_step=0, best_error=start_error,
                                        curve=[(0, 0.0, start_error)], stopped="")
        if start_score is not None:  # a continuation's start scored on its own rows (start_error: on fewer rows)
            self.rec["start_score"] = start_score
        self.points: list[dict[str, Any]] | None = None  # where given, every scored point is appended (loo_rows)

    def stalled(self, evals: int = 5, rel: float = 0.01) -> bool:
        """No new best in the last 3 evaluations, or less than ``rel`` relative gain over the last ``evals``."""
        if self.since_best >= 3:
            return True
        c = self.rec["curve"]
        if len(c) <= evals:
            return False
        old = c[-1 - evals][2]
        return old - self.rec["best_error"] < rel * old

    def stop(self, why: str) -> None:
        self.active = False
        self.rec["stopped"] = why
        self.rec["seconds"] = time.perf_counter() - self.t0

    def _closure(self) -> Tensor:
        self.opt.zero_grad()
        loss = self.obj()
        if not bool(torch.isfinite(loss)):
            raise FloatingPointError("non-finite objective value")
        loss.backward()
        self.step += 1
        return loss

    def advance(self, max_steps: int, deadline: float) -> None:
        """``eval_every`` steps (fewer at ``max_steps`` or the deadline)."""
        t = time.perf_counter()
        before = self.step
        try:
            for _ in range(min(self.eval_every, max_steps - self.step)):
                if time.perf_counter() >= deadline:
                    break
                self._closure()
                self.opt.step()
        except Exception as exc:
            self.failed = f"step {self.step}: {type(exc).__name__}: {exc}"
            self.stop(self.failed)
            return
        if self.step == before:
            self.stop("no step taken (deadline)")
        self.rec.setdefault("step_seconds", 0.0)
        self.rec["step_seconds"] += time.perf_counter() - t

    def evaluate(self, xv: Tensor, yv: Tensor, patience: int, max_steps: int) -> None:
        """Validation error of a FALKON fit at the current hyperparameters (with the objective's centers
        plus ``score_pool``'s rows as extra centers, see :func:`_scoring_fit`); early stopping."""
        try:
            err = _val_mse(_scoring_fit(self.model, self.score_pool), xv, yv)
        except Exception as exc:
            self.failed = f"fit at step {self.step}: {type(exc).__name__}: {exc}"
            self.stop(self.failed)
            return
        if not math.isfinite(err):
            self.failed = f"non-finite validation error at step {self.step}"
            self.stop(self.failed)
            return
        self.rec["curve"].append((self.step, time.perf_counter() - self.t0, err))
        if self.points is not None:
            self.points.append(dict(kernel=copy.deepcopy(self.model.kernel), noise=float(self.model.noise.detach()),
                                    multiplier=1.0, objective=self.name, racer=self.label, lr=self.lr,
                                    step=self.step, error=err, rows=self.rec["rows"], family=self.family))
        if err < self.rec["best_error"]:
            self.rec["best_error"], self.rec["best_step"] = err, self.step
            self.since_best = 0
            m = self.model
            self.best = dict(kernel=copy.deepcopy(m.kernel), noise=float(m.noise.detach()),
                             centers=m.centers.detach().clone(), objective=self.name, racer=self.label,
                             lr=self.lr, step=self.step, error=err, rows=self.rec["rows"], family=self.family)
        else:
            self.since_best += 1
        if self.since_best >= patience:
            self.stop(f"no better validation error in {patience} evaluations")
        elif self.step >= max_steps:
            self.stop("max_steps")
