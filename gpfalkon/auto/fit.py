""":func:`~gpfalkon.auto_fit`: learn (stage 1), select (stage 2) and refit (stage 3) under one wall-clock budget.

The stages are described in the package docstring (:mod:`gpfalkon.auto`); the helpers they use live in its other
modules. Cost: the budget (measured, except the final fit's, which is predicted from the selection fits).
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from .._validation import check_inputs, check_seed, check_targets
from .._warn import warn_caller
from ..backend import stored_rows_for
from ..backend.blocks import available_memory, resolve_store_dtype
from ..backend.engine import reuse_stores
from ..centers import (
    first_distinct,
)
from ..models import FalkonGP
from ..operators import FactorCache
from ..operators.preconditioner import engine_memory_budget
from ..options import FalkonOptions
from .calibration import CALIBRATION_ROWS, _Calibration
from .costs import GROWTH_MARGIN, _onthefly_pass_seconds, _rows_within
from .final import _FinalModels, _Returned
from .final_check import _FinalCheck
from .growth import _Growth
from .kernels import (
    KERNEL_FAMILIES,
    LENGTHSCALE_STEPS,
    LENGTHSCALE_TRANSFORMS,
    _log_lengthscales,
)
from .learn import _Learning
from .leverage import _LeverageCheck, _LeveragePool
from .loo_stage import _LooStage
from .race import _ObjectiveRun, _positive_number, _racers
from .report import AutoFitReport, _Clock
from .sampling import _LEVERAGE_CHECK, CENTER_SAMPLING
from .scoring import _KeptPreconditioner, _scoring_fit, _val_mse
from .selection import _Selection, score_key
from .sizes import GRACE, _Sizes
from .standardise import FLOAT32_FAR_ROWS, _input_location_scale, _warn_far_targets


def _sub_seed(seed: int, k: int) -> int:
    """The seed of ``auto_fit``'s ``k``-th own generator (within ``manual_seed``'s range whatever ``seed``)."""
    return (int(seed) + k) % 2**64


#: a float32 auto_fit whose chosen validation error (a fraction of the targets' variance) is below this warns that
#: float32 may be what limits it: on a nearly noiseless function (noise sd 1e-4 of a unit-scale target) float32
#: stopped at 2.3e-5 with a noise 1e4 times too large, and float64 was 14.6 times more accurate in test RMSE
FLOAT32_LIMITED_ERROR = 1e-4

def _check_budget(name: str, value: Any) -> float:
    seconds = _positive_number(value)
    if seconds is None:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_flags(**flags: Any) -> None:
    """``TypeError`` naming the first of ``flags`` that is not ``True`` or ``False``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


@reuse_stores()  # the selection fits of one size share one K_nM store instead of faulting in a fresh one each
def auto_fit(
    train_x: Tensor,
    train_y: Tensor,
    *,
    budget: float = 120.0,
    val_x: Tensor | None = None,
    val_y: Tensor | None = None,
    kernel: str | Kernel = "matern52",
    objectives: Sequence[str | tuple[str, float] | tuple[str, float, str]] | None = None,
    learn_centers: bool = False,
    lengthscale_transform: str = "log",
    lengthscale_step: str = "shared",
    val_fraction: float = 0.2,
    max_val_rows: int = 20_000,
    hyper_rows: int = 2_000,
    hyper_centers: int = 300,
    max_hyper_rows: int | None = None,
    hyper_entries: int = 2**25,
    hyper_centers_growth: float = 0.0,
    score_centers: int | None = None,
    select_rows: int = 50_000,
    grow_select_rows: bool = True,
    min_centers: int = 1_000,
    max_centers: int = 50_000,
    learn_share: float = 0.5,
    level_share: float = 0.5,
    lr: float = 0.1,
    max_steps: int = 2000,
    eval_every: int = 10,
    patience: int = 10,
    race_rounds: int = 5,
    race_margin: float | None = 0.2,
    race_share: float | None = 0.5,
    min_gain: float = 0.005,
    search_tol: float = 2e-3,
    noise_paths: bool = True,
    final_growth: bool = True,
    final_growth_factor: float = 4.0,
    check_growth: bool = True,
    growth_noises: bool = True,
    growth_first: bool = True,
    rescore_continuations: bool = True,
    center_sampling: str = "auto",
    leverage_check: bool = False,
    max_iter: int = 50,
    score_max_iter: int | None = None,
    tol: float = 1e-4,
    refit_on_all: bool = True,
    loo_rows: int = 4_000,
    calibrate_variance: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    verbose: bool = False,
    level_callback: Callable[[dict[str, Any], Callable[[], FalkonGP]], None] | None = None,
) -> FalkonGP:
    r"""Fit a :class:`~gpfalkon.FalkonGP` with hyperparameters, penalty and centers chosen automatically.

    .. code-block:: python

        model = gpfalkon.auto_fit(train_x, train_y, budget=120, verbose=True)
        model.eval(); pred = model(test_x)         # raw units; pred.mean, pred.variance
        print(model.auto_report.summary())

    Args:
        train_x: ``(n, d)`` inputs, train_y: ``(n,)`` or ``(n, 1)`` targets (one output), raw
            units (standardised internally).
        budget: wall-clock seconds for the whole call (learning, selection and final fit). The
            final fit's time is predicted from measured selection fits (and, where the final
            ``K_nM`` exceeds the memory budget, from a measured on-the-fly pass); a number of centers
            is grown to only when 1.2 x its prediction fits what is left, a selection fit is started
            only when it is predicted to end in time, the final model is the best level whose
            prediction fits the time left plus a grace of 5 % of the budget, and the final CG stops
            at that point or at 1.2 x its prediction, whichever is later
            (``FalkonGP.fit(time_limit=...)``; ``auto_report.notes`` says so); a grown final fit
            (``final_growth``) is sized to the time left and its CG stops there. The call can run over by
            the grace, the final fit's ``K_Mn y`` pass and its last CG iteration (after a rejected growth
            check, ``check_growth``, the level's final fit's passes, preconditioner and first iteration), the variance
            calibration after it (``calibrate_variance``: at most ``max(2e9, 512 M^2)`` flops, about
            0.05 s up to ``M`` = 2,000 and 0.1-0.2 s at ``M`` = 4,000 on 2 CPU cores), a leave-one-out score
            longer than predicted (``loo_rows``: ``n^3`` float64 flops, about 1 s at 3,300 rows here), or
            where the first number of centers alone does not fit (the first level is always returned).
        val_x, val_y: validation data for every choice; default: ``val_fraction`` of the rows
            (at most ``max_val_rows``) are held out, and put back for the final fit when
            ``refit_on_all``.
        kernel: a family in :data:`KERNEL_FAMILIES` (``ScaleKernel`` of an ARD kernel; inputs are
            standardised and the scaling folded into the lengthscales), or any GPyTorch kernel
            (used on the inputs as given, its own initial values; lengthscales found through
            ``has_lengthscale`` are what the multiplier scales; a kernel that is not a
            ``ScaleKernel`` is wrapped in one to carry the target scale). A family is the racers' family, and the
            default race adds a racer in :data:`RACE_FAMILY` (``objectives``): the family of the winning racer is
            the model's (``report.kernel``, ``report.chosen["kernel"]``).
        objectives: the racers of stage 1 (together within ``learn_share * budget``; each stops early
            after ``patience`` evaluations without a better validation error): names in
            :data:`OBJECTIVES`, each learned by Adam at ``lr``, or ``(name, lr)`` pairs, an objective at
            its own learning rate (the report's ``racer`` is then ``"name@lr"``). The race is won on
            validation error, so it chooses the learning rate as it chooses the objective, and the
            winner keeps its rate on the larger subsamples (``report.chosen["lr"]``). ``None`` (the
            default): GCV at ``2 lr`` (0.2), in :data:`RACE_FAMILY` too (below), GCV at ``lr`` and the SGPR bound, in
            that order, the order in which they won the race in rounds 50-63 and the held-out runs (GCV at ``2 lr``
            122 of 236 runs, GCV at ``lr`` 68, RBF 25, SGPR 16): where one round of every racer does not fit
            ``race_share`` of the learning stage, the last ones do not race (``race_share``). A larger step reaches a
            lengthscale that must shrink tenfold (one dominant feature) in half the steps but overshoots
            where all features are relevant, and which case holds shows in the race's validation errors
            (at small budgets the first round's: ``race_share``; ``benchmarks/results/auto-notes.md``, "A
            learning-rate racer"). ``"nystrom-compreg"``
            was in the race up to 0.2.0 and supplied the chosen hyperparameters in none of 266
            recorded runs on 12 datasets (GCV 211, SGPR 44, the initial point 11), while taking a third
            of the race's steps (round 13). Every name stays available. A ``(name, lr, family)`` triple races
            the objective at its rate in a family of :data:`KERNEL_FAMILIES` (from the median heuristic in that
            family; label ``"name@lr/family"`` where it is not ``kernel``'s; a family name in ``kernel`` only), so
            the race chooses the kernel family as it chooses the objective. Where ``kernel`` is a family other
            than :data:`RACE_FAMILY` (``"rbf"``), the default race adds GCV at ``2 lr`` in :data:`RACE_FAMILY`:
            which family predicts better is a property of the target that the validation scores of the race show
            (after the race's first rounds they ranked Matern 5/2 and RBF as the test errors did in 15 of 18 runs
            on 12 sets, the others near ties; with the RBF kernel kin40k's test error was 0.86-0.88 of Matern
            5/2's, bike's 2.1x and pol's 1.5x: ``benchmarks/results/auto-notes.md``, "Session 53"), at the price of
            one more racer's steps until it is dropped. The learning records' ``kernel`` is each racer's family
            (``None`` with a given ``Kernel``).
        learn_centers: also learn the ``hyper_centers`` centers in stage 1 (used as the first
            centers of stages 2-3).
        lengthscale_transform: how the kernel's lengthscales are parametrised for Adam
            (:data:`LENGTHSCALE_TRANSFORMS`). ``"log"`` (the default; ``Positive`` through
            ``exp``/``log``, as the noise is): a step scales a lengthscale by about ``exp(lr)`` at every
            scale. ``"softplus"``: the kernel's own constraint (GPyTorch's default softplus): from the
            median heuristic's start (about ``sqrt(2 d)`` on standardised inputs) a step moves a
            lengthscale by about ``lr`` in absolute terms, so shrinking it tenfold takes tens of steps.
            ``"log"`` replaces a given ``Kernel``'s lengthscale constraint where it is GPyTorch's default
            ``Positive`` (values kept; the returned model keeps the log parametrisation); other
            constraints (bounds the user chose) are kept, with a note in the report.
        lengthscale_step: how Adam scales the steps of a lengthscale vector (:data:`LENGTHSCALE_STEPS`).
            ``"shared"`` (the default): each entry's second moment is floored at the vector's mean
            (docs/math.md §8 "Lengthscale steps"), so the lengthscales whose gradients are at least the
            vector's RMS move by about ``lr`` per step and the others in proportion to their gradients;
            ``"adam"``: Adam's per-entry denominator, which moves every lengthscale by about ``lr`` per
            step from the first steps on. In log space that made weakly relevant features' lengthscales
            grow ~10 % per step with the irrelevant ones' until their gradients vanished (pumadyn32nm:
            1.3x the test error of ``"softplus"``); ``"shared"`` keeps the fast shrinking of the relevant
            ones without that (``benchmarks/results/auto-notes.md``, "Lengthscale steps").
        hyper_rows, hyper_centers: subsample and number of centers of stage 1.
        max_hyper_rows: when the leading objective stalls (no new best in 3 validation scores, or
            less than 1% gain over 5), it goes on from its best point on twice the rows (nested
            subsamples), up to this many (``None``: all training rows, within ``hyper_entries``
            and the learning share of the budget); a continuation that stalls without beating the
            best point found on fewer rows ends the learning stage (the rest of its share goes to
            selection). The centers grow with the rows as
            ``hyper_centers * (rows / hyper_rows) ** hyper_centers_growth`` (nested: new centers
            are drawn from the new rows); ``0.5`` is the ``M = O(sqrt(n))`` of FALKON's
            statistical bound (the objectives see a Nystrom approximation that tightens as they
            see more data, at 2x the cost per step); the default ``0`` keeps ``hyper_centers``
            (on the development sets, 0.5 was no better within the same budget:
            ``benchmarks/results/auto-notes.md``).
        rescore_continuations: when the leader goes on on twice the rows, score its start point on those rows
            too (one scoring fit) and end stage 1 where the continuation's steps find nothing better than that
            score (when it stalls or uses its ``level_share``; the rest of the learning share goes to selection).
            Its validation error on more rows is lower at the same hyperparameters (the scoring fit sees more
            rows), so without this a continuation's gain over the score on fewer rows can be the rows' alone and
            stage 1 goes on doubling while the hyperparameters no longer move. The continuation's best point is
            kept either way (a choice by the scores on the new rows was no better on the development sets:
            ``benchmarks/results/auto-notes.md``, "Continuations scored on their own rows").
        level_share: after the race, the leading objective spends at most this fraction of the
            learning time that was left when it started on a subsample (for the first subsample: when
            stage 1 started) on that subsample; then it goes on from its best point on twice the rows as
            if it had stalled (where twice the rows are allowed). A geometric split of the learning
            share over the nested subsamples, so that a slow, steady gain on few rows cannot use the
            whole share before the larger subsamples (closer to the full data) are reached;
            ``1.0``: a subsample is left only when it stalls (the behaviour before this option).
        hyper_entries: memory budget of stage 1, in entries of its ``rows x centers`` kernel
            matrix (``2**25``: 128 MiB in float32 per copy, a few copies live in autograd); the
            rows stop doubling when the current centers would exceed it, and the centers stop
            growing at ``hyper_entries // rows``.
        score_centers: centers of the FALKON fit that scores stage 1's hyperparameters on the
            validation rows: the objective's centers plus random subsample rows up to this many
            (at most ``hyper_rows``; the same number as the rows grow, so scores stay comparable; a
            FALKON fit, within FALKON's memory budget). ``None``: ``max(hyper_centers,
            min_centers)``, the size stage 2 starts from, so stage 1 picks the hyperparameters that
            are best where they are used; ``hyper_centers`` (or less) scores with the objective's own
            centers (the behaviour before this option).
        select_rows: rows of the stage-2 selection fits at the first number of centers.
        grow_select_rows: where the training rows outnumber ``select_rows``, each larger number of
            centers is scored on as many more nested training rows as its centers grew (the first size's
            rows per center, at most all training rows), and the final fit takes at least the chosen
            size's selection rows (plus the held-out rows put back) and as many more as 1.2 x its
            predicted time leaves within the budget, up to all of them (``report.chosen["final_rows"]``).
            A size is grown to when its selection fits and its final fit on those fewest rows fit the
            time left; the noise and multiplier searches still keep time for a final fit on all rows.
            When a fit on all rows does not fit the time, rows and centers are traded for each other:
            with FALKON's cost linear in ``rows x M``, more centers on fewer rows can lower the error
            where a few centers on all rows leave the error at the Nystrom approximation's
            (``benchmarks/results/auto-notes.md``, "Selection rows that grow with the centers").
            ``False``: every size is scored on ``select_rows`` rows and every decision keeps time for a
            final fit on all rows (the behaviour before this option).
        min_centers, max_centers: the first and the largest number of centers of stage 2.
        lr, max_steps, eval_every, patience: Adam learning rate (of the racers named without one), cap on
            Adam steps per racer, validation period and early-stopping patience of stage 1. (Stage 1 is Adam
            only: an L-BFGS option was removed after it diverged or reached degenerate optima on three of
            the four development sets, ``benchmarks/results/auto-notes.md`` round 5.)
        race_rounds: after this many rounds of ``eval_every`` steps of every objective, only the
            one with the best validation error so far goes on (the others' best points stay
            candidates).
        race_margin: from the second round on, an objective whose best validation error exceeds
            ``1 + race_margin`` times the leader's leaves the race at once, and a leader left alone goes
            on as after ``race_rounds`` (``None``: no early elimination). Successive elimination: a
            clearly worse objective stops taking half of the learning share.
        race_share: the race ends, and the leader goes on alone, after the first round that ends past this
            share of the learning stage's time (``None``: only ``race_rounds`` and ``race_margin`` end it). At
            small budgets ``race_rounds`` rounds of every objective would take the whole learning share on
            the first subsample. Where, after the first racer's first round, one round of every racer at that
            round's time does not fit this share of the stage, only as many racers as fit race (at least the
            first; the others are recorded as not raced): at budgets of about 5 seconds one round of four racers
            took the whole learning share, and the racer that won it had had 7-10 steps.
        min_gain: relative validation-error gain per doubling of the centers needed to keep growing
            them; a step by a factor ``f`` (less than 2 where the budget allows no doubling) needs
            ``min_gain * log2(f)``.
        search_tol: relative validation-error gain a step of stage 2's noise and multiplier searches
            needs for the search to take a further step in that direction. A lower error is always kept;
            a smaller gain ends that search there (the error is flat at the resolution of the
            validation rows, and a further fit there costs what the next number of centers could use).
            ``0``: extend while the error falls at all (the behaviour before this option).
        noise_paths: stage 2's noise searches score their steps by penalty paths, several noises in one CG
            (``noise_search``: at the first size two steps of 4x on each side of the start, then one of 2x on each
            side after the multiplier search; at each larger size one step of 2x on each side; a side whose
            outermost step is best by more than ``search_tol`` extends by as many steps in one more path). Each
            noise's fit is the one a separate fit gives (to CG's tolerance; a path may be solved directly where a
            single fit runs CG, the cost model choosing for its number of noises); four noises in one path cost
            about 1.8 separate fits, two about 1.25, at ``M`` = 1,000 here (``benchmarks/results/noise-path-s60.md``).
            ``False``: one fit per step, down first, up only where the first step down did not gain (the behaviour
            before this option).
        final_growth: when stage 2 stopped growing the centers for time (not for lack of gain, nor at
            ``max_centers`` or the pool's size; with it, a next size short of doubling is not searched, its
            time goes to the grown final fit), and the chosen level is the largest one, the final
            fit takes more nested centers than that level, as many as the
            time left pays for (at least 1.25 times the level's, at most ``final_growth_factor`` times; the
            largest size whose fit, predicted at the selection fits' CG iterations, takes at most the time
            left, :data:`GROWTH_MARGIN`, to about 5 % of the centers: :func:`_growth_size`; its CG then runs
            on to ``max_iter`` or the time left, without the grace), with
            the level's noise and multiplier (not re-searched: that is what the time left cannot pay for; at a
            fixed noise, nested centers lower the minimum of the regularised least-squares objective
            toward the full kernel model's; docs/math.md §8 "Final growth"). The first size's noise and
            multiplier searches stop early enough to pay for such a grown final fit (up to
            ``final_growth_factor`` times the first size, at most ``RESERVE_SHARE`` of the time left when they
            start), so a budget the searches would use up still buys more centers. Recorded in ``report.chosen``
            (``grown_from``) and the notes. ``False``: the final fit uses the level's centers, and the searches
            keep time for that fit only.
        final_growth_factor: the most ``final_growth`` multiplies the level's centers by; past twice the
            level's, the grown size also stays within half the final rows (toward ``M = n`` the grown fit
            nears the full kernel estimator at a noise chosen for ``M`` centers, whose projection also
            regularised: on the development sets with ``n`` below 10,000 such growth raised the test error
            in some runs, while on the larger sets four times the level's centers at its noise lowered it,
            ``benchmarks/results/auto-growth-check.md``).
        check_growth: validate a grown final fit: the grown size is fitted once, at the level's noise (or several noises
            in one solve: ``growth_noises``) and multiplier with the final fit's ``max_iter`` (a selection fit's fewer
            iterations regularise and hid the over-fit this check is for), on the final rows less the check rows (the
            variance calibration's, up to :data:`CALIBRATION_ROWS` of the held-out rows; the other held-out rows are put
            back), and compared there with the level's selection fit: where its mean squared error is lower
            (``GROWTH_CHECK_Z``), it is the returned model (without the check rows: the check's price); else the
            level's own final fit is (on all final rows, its CG started from the level's selection fit and stopped at
            the clock: no time was kept for it). The grown size is sized to the time left as without the check. Recorded
            in ``report.growth``. ``False``: the growth is not validated (the behaviour before this option; the check
            lowered the test error where growth over-fitted: ``benchmarks/results/auto-notes.md``, sessions 42 and 44).
        growth_noises: with ``check_growth``, the grown fit solves at several noises in one CG
            (:meth:`FalkonGP.fit_penalty_path <gpfalkon.FalkonGP.fit_penalty_path>`: one data pass an iteration for
            all) and keeps the one with the lowest error on the check rows, which the growth check then compares with
            the level: the level's noise ``s``, ``s /`` :data:`GROWTH_NOISE_STEP`, and where the level's validation
            error ``v`` (standardised: the residual variance, which the noise of a well-specified GP matches) exceeds
            ``GROWTH_NOISE_STEP^2 s``, ``sqrt(s v)``. The noise was
            selected for ``M`` centers, whose projection also regularises; where the validation error is flat in the
            noise there, it does not tell the noise more centers need (docs/math.md §8 "Noise of a grown fit"). The
            grown size is sized for the path's cost (its triangular solves and factorisations grow with the number
            of noises, its data passes do not). ``report.growth["noises"]`` and ``["errors"]`` record them.
            ``False``: the level's noise alone.
        growth_first: with ``final_growth``, a doubling of the centers that the time left admits is taken only
            where the final fit it leads to (``2 M`` grown with the time left after its four selection fits) has at
            least as many centers as a final fit grown from ``M`` now (where that one is held at its cap,
            ``final_growth_factor M``, and so leaves time unused: at least ``1 / 1.15`` as many, the resolution of
            the sizes' steps); else stage 2 stops at ``M`` and the final fit grows from it (its noise chosen by
            ``growth_noises``). Both sizes are predicted as the final growth
            predicts them, among sizes whose final ``K_nM`` is stored (no on-the-fly pass is measured for it).
            ``False``: every admitted doubling is taken (the behaviour before session 46; the A/B:
            ``benchmarks/results/auto-ab-gfirst-s*.md``).
        center_sampling: how the nested centers of stages 2-3 are drawn from the selection rows:
            ``"uniform"`` (a random permutation's prefixes); ``"leverage"`` (prefixes of one stream of
            ridge-leverage-score draws, :func:`~gpfalkon.nested_leverage_centers`, with the
            preconditioner weights ``D`` of each size; the scores are estimated at the first size's
            kernel and penalty from its uniform centers as dictionary,
            :func:`~gpfalkon.dictionary_leverage_scores`, one pass); ``"auto"``: both are scored at the
            first size (its noise and multiplier searched with uniform centers) and the one with the
            lower validation error is used for every larger size and the final fit (one more selection
            fit and one scoring pass; ``report.sampling``), except where the scores of the pass's first quarter
            are nearly uniform (:data:`LEVERAGE_UNIFORM`): a draw from them would be a uniform one, and the try
            stops there. Leverage scores place more centers where
            the data are sparse relative to the kernel's resolution; uniform ones follow the density.
            ``learn_centers=True`` keeps the uniform pool (``"auto"`` then means ``"uniform"``;
            ``"leverage"`` is an error). The scores' dictionary is at most the first
            ``LEVERAGE_DICTIONARY`` of the first size's uniform centers. ``"auto"`` keeps the
            leverage pool only if its draws give room to grow (at least ``min(2 M, max_centers)``
            distinct rows) and its validation error is finite and lower.
        leverage_check: at the chosen level, one more selection fit with as many centers drawn by
            approximate ridge-leverage scores (BLESS on the selection rows, with the level's kernel and
            penalty, and the preconditioner weights ``D`` of :func:`~gpfalkon.leverage_centers`); the
            final fit uses those centers when their validation error is lower (``report.chosen``'s
            ``centers`` says which). Skipped when the time left would not pay for it and the final fit.
        max_iter, tol: FALKON's CG stopping rule for every fit.
        score_max_iter: CG's iteration cap for the scoring fits alone (stage 1's validation fits and stage
            2's selection fits), which only rank hyperparameters and sizes; default ``max(10, max_iter // 2)``.
            The final fit keeps ``max_iter``.
        refit_on_all: fit the final model on training plus held-out rows.
        loo_rows: where the training rows number at most this many (and the validation rows are held out of them, with
            ``refit_on_all``), the last stage chooses again on every row. The candidates: the point the validation rows
            chose (its kernel, multiplier and noise) and every point stage 1 scored (each racer's every evaluation, and
            the starting point). Each is scored by the closed-form leave-one-out error of kernel ridge regression with
            every training row a center (:meth:`LOOCV.residuals <gpfalkon.objectives.LOOCV.residuals>`, ``M = n``,
            float64, ``O(n^3)``), the chosen point first and the others in the order of their validation errors, while
            the budget lasts (at most :data:`LOO_SHARE` of it); the noise of the best is then doubled or halved while
            that lowers the error. Where half of the stage pays for :data:`LOO_DESCENT_EVALS` evaluations, the points
            take the first half and L-BFGS then descends from the best on the same error, over the per-input
            lengthscales and the noise within :data:`LOO_DESCENT_BOX` of it (a family kernel only; its point is kept
            where it does not predict further outside the targets' range between training rows than its start,
            :data:`LOO_OVERSHOOT_MARGIN`; ``report.loo["descent"]``). The stage starts only where three scores (the
            chosen point, another, the refit) are predicted to fit that share, from a timed float64 factorisation and
            inverse of order 1,024 (``report.loo["skipped"]`` and a note otherwise). The returned model is that
            point's, with every training row a center (exact kernel ridge regression, the GP posterior; its data passes
            in float64 whatever ``dtype``, :data:`LOO_REFIT_DTYPE`), its variances calibrated by the same
            residuals (``c = mean(r_i^2 (1 - S_ii) / v)``: a GP's leave-one-out predictive variance is
            ``v / (1 - S_ii)``). On a few hundred to a few thousand rows the validation split has 70-800 rows, too
            few to rank points whose errors differ by a few percent; the leave-one-out error uses all ``n``
            (``report.loo``; ``benchmarks/results/auto-notes.md``, "Session 56", "Session 58"). ``0``: off.
        calibrate_variance: multiply the returned model's outputscale and noise by one factor
            ``c = mean(r^2 / v)`` over up to :data:`CALIBRATION_ROWS` held-out rows
            (:meth:`FalkonGP.scale_prior <gpfalkon.FalkonGP.scale_prior>`: the posterior mean is unchanged,
            the predictive variances become ``c v``; docs/math.md §8 "Variance calibration"). The noise is
            chosen for the mean's validation error, as a regulariser, and often sits far below the data's
            noise, so the uncalibrated variances can be 10-100x too small. ``v``: the final model's
            predictive variances at those rows through its preconditioner
            (:func:`~gpfalkon.models.calibration.preconditioned_variances`, ``2 rows M^2`` flops);
            ``r``: the final model's residuals there where the held-out rows are not refit (``val_x``
            given, ``refit_on_all=False`` or a kept growth check, ``check_growth``, whose check rows they
            are), else those of the selection fit that scored the chosen level (the leverage check's fit where
            its centers were taken; where an unchecked growth grew the centers, the level's fewer ones), before
            the held-out rows joined its training rows: its error, usually the larger, tends to make ``c`` err
            high, the safe side.
            ``auto_report.chosen["variance_scale"]`` is ``c`` (1 when off or skipped, with a note).
        dtype: dtype of the data passes (float32 by default: half the time; CG, Cholesky factors
            and predictions stay float64 inside FALKON).
        seed: seeds subsampling, splits and centers.
        verbose: a tqdm bar (seconds of the budget) naming the stage.
        level_callback: called after each number of centers of stage 2 with the level (``M``,
            ``noise``, ``multiplier``, validation ``error``, ``elapsed`` seconds of the call) and a
            function that builds and fits the level's model on all final rows with its own centers
            (the model the call would return if it stopped there, without ``final_growth``, without
            ``grow_select_rows``' cut of the final rows for time and before the variance calibration: the same
            means, uncalibrated variances; for time-to-error curves:
            ``benchmarks/compare.py`` scores it on test data). Its time is not counted against ``budget``.

    Returns:
        A fitted ``FalkonGP`` on ``train_x`` (plus held-out rows) in ``dtype``, with
        ``model.auto_report`` (:class:`AutoFitReport`).

    Warns:
        RuntimeWarning: where the final fit's error on the calibration rows exceeded :data:`FINAL_CHECK_RATIO`
        times its level's selection fit's there (a final CG that did not solve its system; the level refitted on
        its selection rows is returned instead where it scores lower there; ``report.chosen["final_check_error"]``);
        where float32 may limit a nearly noiseless fit (:data:`FLOAT32_LIMITED_ERROR`).

    The call runs inside :func:`gpfalkon.backend.engine.reuse_stores`: between two fits of one size it keeps the
    released ``K_nM`` store (host memory, counted as available to the fits' memory budgets) and frees it on
    return.
    """
    # ------------------------------------------------------------------ validation
    budget = _check_budget("budget", budget)
    check_seed(seed)
    if not isinstance(train_x, Tensor):  # check_inputs also admits row sources, which auto_fit does not read
        raise TypeError(f"train_x: auto_fit needs an in-memory (n, d) tensor, got {type(train_x).__name__} (a row "
                        "source: fit FalkonGP on it, with hyperparameters chosen by auto_fit on a subsample read "
                        "into memory, e.g. auto_fit(src[idx], y[idx]))")
    check_inputs("train_x", train_x)
    n_all, d = train_x.shape
    check_targets("train_y", train_y, n_all)
    if train_y.dim() == 2:
        if train_y.shape[1] != 1:
            raise ValueError(f"train_y: auto_fit handles one output, got {train_y.shape[1]} columns")
        train_y = train_y.reshape(-1)
    if (val_x is None) != (val_y is None):
        raise ValueError("give both val_x and val_y, or neither")
    if val_x is not None:
        assert val_y is not None  # given together (checked just above)
        check_inputs("val_x", val_x, d=d)
        if val_y.dim() >= 1 and val_y.shape[0] != val_x.shape[0]:
            raise ValueError(f"val_y has {val_y.shape[0]} rows but val_x has {val_x.shape[0]}")
        check_targets("val_y", val_y, val_x.shape[0])
        if val_y.dim() == 2:
            if val_y.shape[1] != 1:
                raise ValueError(f"val_y: auto_fit handles one output, got {val_y.shape[1]} columns")
            val_y = val_y.reshape(-1)
        if val_x.device != train_x.device or val_y.device != train_x.device:
            raise ValueError(f"val_x and val_y must be on train_x's device {train_x.device}")
    if train_y.device != train_x.device:
        raise ValueError(f"train_y is on {train_y.device} but train_x is on {train_x.device}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(kernel, str):
        if kernel not in KERNEL_FAMILIES:
            raise ValueError(f"kernel must be one of {sorted(KERNEL_FAMILIES)} or a gpytorch Kernel, got {kernel!r}")
    elif not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a family name or a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    if _positive_number(lr) is None:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    racers = _racers(objectives, float(lr), kernel if isinstance(kernel, str) else None)
    if not (isinstance(val_fraction, float) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be a float in (0, 1), got {val_fraction!r}")
    if not (isinstance(learn_share, (int, float)) and 0.0 <= learn_share < 1.0):
        raise ValueError(f"learn_share must be in [0, 1), got {learn_share!r}")
    if not (isinstance(level_share, (int, float)) and 0.0 < level_share <= 1.0):
        raise ValueError(f"level_share must be in (0, 1], got {level_share!r}")
    if not (isinstance(min_gain, (int, float)) and min_gain >= 0.0):
        raise ValueError(f"min_gain must be >= 0, got {min_gain!r}")
    if isinstance(search_tol, bool) or not (isinstance(search_tol, (int, float)) and 0.0 <= search_tol < 1.0):
        raise ValueError(f"search_tol must be a number in [0, 1), got {search_tol!r}")
    _check_flags(grow_select_rows=grow_select_rows, final_growth=final_growth, check_growth=check_growth,
                 growth_noises=growth_noises, noise_paths=noise_paths, growth_first=growth_first,
                 rescore_continuations=rescore_continuations)
    if isinstance(final_growth_factor, bool) or not (isinstance(final_growth_factor, (int, float))
                                                     and 1.25 <= final_growth_factor < math.inf):
        raise ValueError(f"final_growth_factor must be a finite number >= 1.25, got {final_growth_factor!r}")
    if center_sampling not in CENTER_SAMPLING:
        raise ValueError(f"center_sampling must be one of {CENTER_SAMPLING}, got {center_sampling!r}")
    if center_sampling == "leverage" and learn_centers:
        raise ValueError("center_sampling='leverage' needs learn_centers=False: learned centers lead the uniform "
                         "pool and have no leverage-score weights")
    if lengthscale_transform not in LENGTHSCALE_TRANSFORMS:
        raise ValueError(f"lengthscale_transform must be one of {LENGTHSCALE_TRANSFORMS}, "
                         f"got {lengthscale_transform!r}")
    if lengthscale_step not in LENGTHSCALE_STEPS:
        raise ValueError(f"lengthscale_step must be one of {LENGTHSCALE_STEPS}, got {lengthscale_step!r}")
    _check_flags(leverage_check=leverage_check, calibrate_variance=calibrate_variance)
    if not (isinstance(tol, (int, float)) and tol >= 0):
        raise ValueError(f"tol must be >= 0, got {tol!r}")
    max_val_rows = _check_count("max_val_rows", max_val_rows)
    hyper_rows = _check_count("hyper_rows", hyper_rows, 2)
    hyper_centers = _check_count("hyper_centers", hyper_centers)
    if max_hyper_rows is not None:
        max_hyper_rows = _check_count("max_hyper_rows", max_hyper_rows, 2)
    hyper_entries = _check_count("hyper_entries", hyper_entries, 2)
    if isinstance(hyper_centers_growth, bool) or not isinstance(hyper_centers_growth, (int, float)) \
            or not 0.0 <= hyper_centers_growth <= 1.0:
        raise ValueError(f"hyper_centers_growth must be a number in [0, 1], got {hyper_centers_growth!r}")
    select_rows = _check_count("select_rows", select_rows, 2)
    if score_centers is not None:
        score_centers = _check_count("score_centers", score_centers)
    min_centers = _check_count("min_centers", min_centers)
    max_centers = _check_count("max_centers", max_centers)
    max_steps = _check_count("max_steps", max_steps, 0)
    eval_every = _check_count("eval_every", eval_every)
    patience = _check_count("patience", patience)
    race_rounds = _check_count("race_rounds", race_rounds)
    if race_margin is not None:
        if isinstance(race_margin, bool) or not isinstance(race_margin, (int, float)) or not (
                math.isfinite(race_margin) and race_margin > 0):
            raise ValueError(f"race_margin must be a positive number or None, got {race_margin!r}")
        race_margin = float(race_margin)
    if race_share is not None:
        if isinstance(race_share, bool) or not isinstance(race_share, (int, float)) or not (0.0 < race_share <= 1.0):
            raise ValueError(f"race_share must be a number in (0, 1] or None, got {race_share!r}")
        race_share = float(race_share)
    max_iter = _check_count("max_iter", max_iter)
    loo_rows = _check_count("loo_rows", loo_rows, 0)
    score_iter = (max(10, max_iter // 2) if score_max_iter is None
                  else _check_count("score_max_iter", score_max_iter))
    if val_x is None and n_all < 10:
        raise ValueError(f"train_x: auto_fit needs at least 10 rows to hold some out for validation, got {n_all}")

    clock = _Clock(budget, verbose)
    try:
        dev = train_x.device
        gen = torch.Generator(device=dev).manual_seed(int(seed))  # draws on the data's device
        x_all = train_x.detach().to(torch.float64)
        y_all = train_y.detach().to(torch.float64)

        # ------------------------------------------------------------------ splits
        if val_x is None:
            n_val = min(max_val_rows, max(1, round(val_fraction * n_all)))
            if n_all - n_val < 2:
                raise ValueError(f"val_fraction={val_fraction} leaves {n_all - n_val} of {n_all} rows for training; "
                                 "lower it or pass val_x / val_y")
            perm = torch.randperm(n_all, generator=gen, device=dev)
            val_idx, tr_idx = perm[:n_val], perm[n_val:]
            xt, yt = x_all[tr_idx], y_all[tr_idx]
            xv, yv = x_all[val_idx], y_all[val_idx]
            val_source = f"held out {n_val:,} of {n_all:,} training rows"
        else:
            xt, yt = x_all, y_all
            assert val_y is not None  # given with val_x (checked at the top)
            xv, yv = val_x.detach().to(torch.float64), val_y.detach().to(torch.float64)
            val_source = "given val_x / val_y"
        n_tr = xt.shape[0]

        # standardisation (training-split statistics)
        family = kernel if isinstance(kernel, str) else type(kernel).__name__
        if isinstance(kernel, str):
            x_mu, x_sd = _input_location_scale(xt)
        else:
            x_mu, x_sd = torch.zeros(d, dtype=torch.float64, device=dev), torch.ones(d, dtype=torch.float64, device=dev)
        y_mu = yt.mean()
        y_sd = yt.std() if n_tr > 1 else torch.ones((), dtype=torch.float64, device=dev)
        if not bool(y_sd > 0):
            y_sd = torch.ones((), dtype=torch.float64, device=dev)

        def zx(x: Tensor) -> Tensor:
            return ((x - x_mu) / x_sd).to(dtype)

        def zy(y: Tensor) -> Tensor:
            return ((y - y_mu) / y_sd).to(dtype)

        xt_z, yt_z, xv_z, yv_z = zx(xt), zy(yt), zx(xv), zy(yv)
        finfo = torch.finfo(dtype)
        if float(y_sd) ** 2 * 1e4 > finfo.max or float(y_sd) ** 2 * 1e-8 < finfo.tiny:
            # the returned model holds the outputscale (~ y_sd^2) and the noise (~ 1e-6 .. 1 x y_sd^2) in dtype
            raise ValueError(f"train_y: its standard deviation {float(y_sd):.3g} squared is outside what {dtype} "
                             "holds for the returned model's outputscale and noise: rescale train_y (the model "
                             "maps back to its units) or pass dtype=torch.float64")
        if dtype == torch.float32 and float(y_mu.abs() / y_sd) > 1e4:
            warn_caller(
                f"train_y: |mean| / std is {float(y_mu.abs() / y_sd):.3g}; the returned model stores raw targets in "
                "float32, which resolve them only to ~1e-7 x |mean|, so its final fit sees rounded targets (its "
                "error can exceed the validation error in the report): subtract the mean from train_y or pass "
                "dtype=torch.float64",
                RuntimeWarning,
            )
        _warn_far_targets(torch.cat([yt, yv]))
        if dtype == torch.float32 and isinstance(kernel, str):
            far = float((torch.maximum((xt.amax(0) - x_mu).abs(), (xt.amin(0) - x_mu).abs()) / x_sd).max()) \
                if n_tr else 0.0
            if far > FLOAT32_FAR_ROWS:
                warn_caller(
                    f"train_x: some rows lie {far:.3g} scale units from a feature's centre (a code for a missing "
                    "value?); float32 kernel values at such rows lose their precision (the squared distance of a row "
                    "to itself rounds to about 6e-8 x its squared norm, which is then not small): such a row can "
                    "make K_MM indefinite. Pass dtype=torch.float64, or replace those values",
                    RuntimeWarning,
                )
            ratio = float((x_mu.abs() / x_sd).max())
            if ratio > 1e4:
                warn_caller(
                    f"train_x: a feature's |mean| / std is {ratio:.3g}; the returned model stores raw inputs "
                    "in float32, which resolve that feature only to ~1e-7 x |mean|: centre such features or "
                    "pass dtype=torch.float64",
                    RuntimeWarning,
                )
        report = AutoFitReport(budget=budget, n_train=n_tr, n_val=xv.shape[0], val_source=val_source, kernel=family)

        def new_kernel(fam: str | None = None) -> Kernel:
            if isinstance(kernel, str):
                k = KERNEL_FAMILIES[kernel if fam is None else fam](d)
            else:
                k = copy.deepcopy(kernel)
            return k.to(dtype=dtype, device=dev)

        # ------------------------------------------------------------ stage 1: learn
        t_stage = time.perf_counter()
        n_h = min(n_tr, hyper_rows)
        h_perm = torch.randperm(n_tr, generator=gen, device=dev)
        h_idx = h_perm[:n_h]
        xh, yh = xt_z[h_idx], yt_z[h_idx]
        c_perm = torch.randperm(n_h, generator=gen, device=dev)
        # centers equal in value to one drawn before are skipped (gpfalkon.centers.first_distinct): they add
        # nothing to the fit and leave K_MM singular
        c_perm = c_perm[first_distinct(xh[c_perm])]
        m_h = min(int(c_perm.numel()), hyper_centers)
        c_idx = c_perm[:m_h]
        centers0 = xh[c_idx].clone()
        # extra centers of the stage-1 scoring fits: subsample rows that are not stage-1 centers (every
        # nested subsample contains them; centers added on larger subsamples come from the new rows)
        score_pool = xh[c_perm[m_h:]]
        score_target = max(hyper_centers, min_centers) if score_centers is None else score_centers

        def score_extra(m_obj: int) -> Tensor | None:
            # the same number of scoring centers on every subsample (scores stay comparable as the rows
            # grow); the scoring fit is a FALKON fit, held to FALKON's memory budget, not hyper_entries
            k = min(score_target, n_h) - m_obj
            return score_pool[:k] if k > 0 else None

        def start_kernel(fam: str | None) -> Kernel:
            """A racer's starting kernel: ``fam``'s (``None``: the given ``Kernel``) at the median heuristic's
            lengthscale and unit outputscale (a family's), its lengthscales parametrised by
            ``lengthscale_transform``."""
            k = new_kernel(fam)
            if isinstance(kernel, str):
                with torch.no_grad():
                    k.base_kernel.lengthscale = torch.full((1, d), ls0, dtype=dtype, device=dev)
                    k.outputscale = torch.tensor(1.0, dtype=dtype, device=dev)
            if lengthscale_transform == "log":
                kept = _log_lengthscales(k)
                if kept:
                    report.notes.append("lengthscale_transform='log' kept the kernel's own lengthscale constraint "
                                        "on " + ", ".join(kept) + " (not GPyTorch's default Positive)")
            return k

        if isinstance(kernel, str):
            from ..heuristics import median_lengthscale

            ls0 = float(median_lengthscale(xh))
        primary = kernel if isinstance(kernel, str) else None  # kernel='s family (None: a given Kernel)
        family_k0 = {fam: start_kernel(fam) for fam in dict.fromkeys([primary, *(r[3] for r in racers)])}
        k0 = family_k0[primary]
        noise0 = 0.1
        best_state: dict[str, Any] = dict(
            kernel=copy.deepcopy(k0), noise=noise0, centers=centers0, objective="initial", racer="initial", lr=None,
            step=0, error=math.inf, rows=n_h, family=primary,
        )

        def h_model(k: Kernel, noise: float, centers: Tensor, learn: bool, rows: int | None = None) -> FalkonGP:
            r = n_h if rows is None else rows
            x_, y_ = (xh, yh) if rows is None else (xt_z[h_perm[:r]], yt_z[h_perm[:r]])
            return FalkonGP(x_, y_, kernel=k, centers=centers, penalty=noise / r, learn_centers=learn,
                            max_iter=score_iter, tol=tol)

        # the starting point's score
        try:
            m0 = _scoring_fit(h_model(copy.deepcopy(k0), noise0, centers0, False), score_extra(m_h))
            best_state["error"] = _val_mse(m0, xv_z, yv_z)
            del m0
        except Exception as exc:
            report.notes.append(f"initial hyperparameters failed to fit: {type(exc).__name__}: {exc}")
        report.learn.append(dict(objective="initial", racer="initial", lr=None, kernel=best_state["family"], rows=n_h,
                                 steps=0, best_step=0, best_error=best_state["error"],
                                 curve=[]))

        learn_deadline = clock.t0 + learn_share * budget
        n_final = n_tr + (xv.shape[0] if (val_x is None and refit_on_all) else 0)
        # on data whose K_nM exceeds the memory budget even at the first number of centers, the final fit
        # recomputes the rows of K_nM it cannot store at each CG iteration: learning ends early enough to
        # leave 1.5x its predicted time
        m_first = min(n_tr, max(min_centers, hyper_centers), max_centers)
        free_bytes = available_memory(dev)  # read once: every prediction of this call sees it
        # the leave-one-out choice on every row (loo_rows): its n x n float64 matrices (a few live at once) must fit
        loo_points: list[dict[str, Any]] | None = None
        if (val_x is None and refit_on_all and 0 < n_final <= loo_rows
                and (free_bytes is None or 64 * n_final ** 2 <= free_bytes)):
            loo_points = [dict(kernel=copy.deepcopy(family_k0[fam]), noise=noise0, multiplier=1.0,
                               objective="initial", racer="initial" if fam == primary else f"initial/{fam}", lr=None,
                               step=0, error=best_state["error"] if fam == primary else math.inf, rows=n_h,
                               family=fam)
                          for fam in family_k0]

        def budget_at(m: int) -> int:
            """The memory budget of the final fit's engine at ``m`` centers (the automatic one leaves the
            preconditioner's ``M x M`` matrices free: ``NystromKRROperator.engine``)."""
            return engine_memory_budget(m, dev, available=free_bytes)

        itemsize = torch.finfo(dtype).bits // 8
        store_dtype = resolve_store_dtype(dtype)  # gpfalkon.settings.store_format
        head_first = stored_rows_for(n_final, m_first, itemsize, budget_at(m_first), device=dev,
                                     store_dtype=store_dtype, d=d)
        if head_first < n_final:
            rows0 = min(n_tr, select_rows)
            # its own generator: whether this probe runs depends on the free memory, which must not shift the
            # draws of gen (the selection rows, the center pool...) that follow
            probe_gen = torch.Generator(device=dev).manual_seed(_sub_seed(seed, 2))
            t_pass = _onthefly_pass_seconds(k0, xt_z[:rows0],
                                            xt_z[torch.randperm(n_tr, generator=probe_gen, device=dev)[:m_first]])
            final_floor = (max_iter + 2) * t_pass * (n_final - head_first) / rows0
            if clock.t0 + budget - 1.5 * final_floor < learn_deadline:
                learn_deadline = max(time.perf_counter(), clock.t0 + budget - 1.5 * final_floor)
                report.notes.append(f"learning share cut to {learn_deadline - clock.t0:.0f} s: the final fit on "
                                    f"{n_final:,} rows is predicted at >= {final_floor:.0f} s "
                                    f"({n_final - head_first:,} rows of K_nM recomputed at every iteration)")
        runners = [
            _ObjectiveRun(name, h_model(copy.deepcopy(family_k0[fam]), noise0, centers0.clone(), learn_centers), lr_r,
                          eval_every, best_state["error"], score_extra(m_h), lengthscale_step, label, family=fam)
            for name, lr_r, label, fam in racers
        ]
        for r in runners:
            r.points = loo_points
        # the continuations' center draws: how many there are depends on the clock, which must not shift gen's
        # later draws (the selection rows, the center pool, the calibration rows)
        continue_gen = torch.Generator(device=dev).manual_seed(_sub_seed(seed, 3))
        _Learning(
            runners=runners, best_state=best_state, report=report, clock=clock, h_model=h_model,
            score_extra=score_extra, xt_z=xt_z, h_perm=h_perm, xv_z=xv_z, yv_z=yv_z, n_h=n_h,
            rows_cap=n_tr if max_hyper_rows is None else min(n_tr, max_hyper_rows), n_racers=len(racers),
            hyper_centers=hyper_centers, hyper_centers_growth=hyper_centers_growth, hyper_entries=hyper_entries,
            max_steps=max_steps, patience=patience, eval_every=eval_every, race_rounds=race_rounds,
            race_margin=race_margin, race_share=race_share, level_share=level_share, learn_deadline=learn_deadline,
            t_stage=t_stage, learn_centers=learn_centers, lengthscale_step=lengthscale_step,
            rescore_continuations=rescore_continuations, loo_points=loo_points, continue_gen=continue_gen,
        ).run()
        del runners
        report.stages["learn"] = time.perf_counter() - t_stage
        if best_state.get("family") is not None:
            report.kernel = best_state["family"]  # the race's kernel family (kernel= or a racer's)

        # ------------------------------------------------------------ stage 2: select
        t_stage = time.perf_counter()
        n_s = min(n_tr, select_rows)
        # the selection rows of every size are prefixes of one permutation of the training rows (nested)
        s_order = torch.randperm(n_tr, generator=gen, device=dev)
        s_idx = s_order[:n_s]
        xs, ys = xt_z[s_idx], yt_z[s_idx]
        learned_c = best_state["centers"]
        m_first = min(n_s, max(min_centers, int(learned_c.shape[0]) if learn_centers else m_h), max_centers)
        grow_rows = grow_select_rows and n_tr > n_s
        n_back = xv.shape[0] if (val_x is None and refit_on_all) else 0  # held-out rows the final fit puts back
        # nested centers: the learned / stage-1 centers first, then random selection rows, each distinct in value
        # from those before it (first_distinct)
        s_all = torch.randperm(n_s, generator=gen, device=dev)  # also the leverage dictionary's uniform draw
        s_perm = s_all[first_distinct(xs[s_all])]
        n_sd = int(s_perm.numel())  # the distinct selection rows
        extra = xs[s_perm]
        c_pool = torch.cat([learned_c.to(dtype), extra], 0) if learn_centers else extra
        if learn_centers:
            c_pool = c_pool[first_distinct(c_pool)]
        n_pool = int(c_pool.shape[0])  # the uniform pool's size: the distinct selection rows (and learned centers)
        m_first = min(m_first, n_pool)
        base_kernel = best_state["kernel"]
        # the selection fits' preconditioners keep their penalty-free factor (T, T T^T / M): the noise
        # searches refit the same kernel and centers at another penalty, which then costs one M^3 / 3
        # Cholesky instead of M^3 (bit for bit the same fit); freed before the final fit
        factors = FactorCache()
        select_options = FalkonOptions(preconditioner=factors)
        # the variance calibration's held-out rows (a draw of its own: the other draws stay as they were), also the
        # growth check's (check_growth); where the final fit takes them back, each selection fit's residuals there
        # are kept (CALIBRATION_ROWS float64 values a fit) for the chosen level's
        cal_idx = torch.randperm(xv.shape[0], generator=torch.Generator(device=dev).manual_seed(_sub_seed(seed, 1)),
                                 device=dev)[:CALIBRATION_ROWS]
        # the calibration rows gathered once (standardised), not at every selection fit
        xv_cal, yv_cal = xv_z[cal_idx], yv_z[cal_idx].to(torch.float64)

        # the selection fits keep their calibration residuals for the variance calibration and the growth check
        keep_cal = (calibrate_variance and n_back > 0) or check_growth
        # the pool every size draws its centers from: "uniform" (prefixes of c_pool) or "leverage"
        # (prefixes of a nested leverage-score stream over the selection rows, with their weights D); each
        # selection fit's coefficients (M float64 values a fit, standardised units) are kept: the final fit of the
        # chosen level starts CG from them (``f = k(., Z) alpha`` is the same function on any rows)
        fits = _Selection(
            xt_z=xt_z, yt_z=yt_z, s_order=s_order, n_s=n_s, m_first=m_first, grow_rows=grow_rows, n_back=n_back,
            n_final=n_final, xs=xs, ys=ys, c_pool=c_pool, base_kernel=base_kernel, score_iter=score_iter,
            max_iter=max_iter, tol=tol, options=select_options, xv_z=xv_z, yv_z=yv_z, xv_cal=xv_cal, yv_cal=yv_cal,
            keep_cal=keep_cal, search_tol=search_tol, report=report, clock=clock, budget_at=budget_at,
            store_dtype=store_dtype,
        )

        if val_x is None and refit_on_all:
            x_fin, y_fin = torch.cat([xt, xv], 0), torch.cat([yt, yv], 0)
        else:
            x_fin, y_fin = xt, yt
        x_fin_t = x_fin.to(dtype)
        y_fin_t = y_fin.to(dtype)

        final_models = _FinalModels(
            fits=fits, x_fin=x_fin_t, y_fin=y_fin_t, n_tr=n_tr, n_back=n_back, s_order=s_order,
            base_kernel=base_kernel, raw_lengthscales=isinstance(kernel, str), x_mu=x_mu, x_sd=x_sd, y_mu=y_mu,
            y_sd=y_sd, max_iter=max_iter, tol=tol,
        )

        calibration = _Calibration(fits=fits, cal_idx=cal_idx, xv=xv, yv=yv, y_sd=y_sd, dtype=dtype)

        callback_seconds = [0.0]

        def level_done(level: dict[str, Any]) -> None:
            """Record when a selection level ended; hand it to ``level_callback`` (its time is not counted)."""
            level["elapsed"] = clock.elapsed()
            if level_callback is not None and math.isfinite(level["error"]):
                t_cb = time.perf_counter()
                level_callback(dict(level), lambda: final_models.fit(level)[0])
                spent = time.perf_counter() - t_cb
                clock.t0 += spent  # the budget excludes the caller's evaluation
                callback_seconds[0] += spent

        growth = _Growth(
            fits=fits, final_models=final_models, report=report, clock=clock, budget=budget, n_final=n_final,
            max_centers=max_centers, final_growth=final_growth, final_growth_factor=final_growth_factor,
            check_growth=check_growth, growth_noises=growth_noises, n_back=n_back, cal_idx=cal_idx, xv=xv, yv=yv,
            y_sd=y_sd,
        )

        pool = None if center_sampling == "uniform" else _LeveragePool(
            fits=fits, report=report, clock=clock, base_kernel=base_kernel, xs=xs, s_all=s_all, n_s=n_s, n_sd=n_sd,
            max_centers=max_centers, center_sampling=center_sampling, learn_centers=learn_centers, gen=gen)
        sizes = _Sizes(
            fits=fits, growth=growth, pool=pool, report=report, clock=clock, budget=budget, max_centers=max_centers,
            min_gain=min_gain, noise_paths=noise_paths, final_growth=final_growth,
            final_growth_factor=final_growth_factor, growth_first=growth_first, level_done=level_done)
        levels: list[dict[str, Any]] = [sizes.first(m_first, float(best_state["noise"]))]
        stopped_by_budget = sizes.double(levels)
        best_level = sizes.choose(levels)
        grace = GRACE * budget  # the final CG's time limit past the time left (a level's final fit only)
        lev_centers: Tensor | None = None
        lev_weights: Tensor | None = None
        lev_alpha: Tensor | None = None
        centers_kind = best_level["centers"]
        if leverage_check:
            swap = _LeverageCheck(
                fits=fits, report=report, clock=clock, base_kernel=base_kernel, n_sd=n_sd, max_iter=max_iter, tol=tol,
                xv_z=xv_z, yv_z=yv_z, keep_cal=keep_cal, xv_cal=xv_cal, yv_cal=yv_cal, gen=gen,
            ).run(best_level, centers_kind)
            if swap is not None:
                lev_centers, lev_weights, lev_alpha = swap.centers, swap.weights, swap.alpha
                centers_kind = _LEVERAGE_CHECK
        # the validation error of the centers the returned model has (the leverage check's where it swapped them)
        chosen_error = float(report.leverage["error"]) if centers_kind == _LEVERAGE_CHECK else best_level["error"]
        final_level = best_level
        if final_growth:
            final_level = growth.grown(best_level, stopped_by_budget, best_level is levels[-1], lev_centers is not None)
        report.stages["select"] = time.perf_counter() - t_stage - callback_seconds[0]

        # ------------------------------------------------------------ stage 3: refit
        factors.clear()
        fits.level_rows.clear()
        t_stage = time.perf_counter()
        clock.tick("final fit", M=final_level["M"])
        keeper = _KeptPreconditioner() if calibrate_variance else None
        cal_seen = n_back > 0  # whether the returned model's fit took the calibration rows back
        checked: tuple[FalkonGP, bool] | None = None
        fallback = False
        if check_growth and "grown_from" in final_level:
            checked = growth.check(final_level, keeper)
            if checked is None:  # the level's own final fit
                final_level, fallback = best_level, True
                if keeper is not None:
                    keeper.last = None  # the rejected fit's factors: the fallback's own (or none) calibrate it
        # the final rows: all of them, or with grow_rows as many as 1.2 x the predicted fit leaves within the
        # time left, at least the level's selection rows and the held-out ones (a grown level was sized on all)
        m_final = int(final_level["M"])
        rows_final = n_final
        if checked is not None:
            final, converged = checked
            rows_final, cal_seen = int(final.train_targets.shape[0]), False
            chosen_error = float(report.growth["error"])
            final_predicted = final_level["final_predicted"]
        else:
            if "final_predicted" not in final_level:
                rows_final = _rows_within(lambda r: 1.2 * fits.final_cost(m_final, rows=r),
                                          fits.fewest_final_rows(m_final), n_final, clock.left())
                if rows_final < n_final:
                    report.notes.append(f"final fit on {rows_final:,} of the {n_final:,} rows: on all of them "
                                        f"M={m_final} is predicted at {fits.final_cost(m_final):.3g} s, "
                                        f"{clock.left():.3g} s were left")
            # the grown level carries the prediction its size was chosen by; a level's is its measured fits'
            final_predicted = (final_level["final_predicted"] if "final_predicted" in final_level
                               else fits.final_cost(m_final, rows=rows_final))
            # the budget's remainder (and the grace) bounds the final CG: a backstop for a prediction that was
            # low. Never below 1.2 x the prediction (GROWTH_MARGIN x for a grown level, sized by it): a final CG
            # cut to a few iterations returns a useless model; except after a rejected growth check, which no time
            # was kept for: that fit starts from the level's selection coefficients (validated), and its CG stops
            # at the clock
            grown = "grown_from" in final_level  # sized to the time left: no grace
            floor = 1e-3 if fallback else (GROWTH_MARGIN if grown else 1.2) * final_predicted
            final, converged = final_models.fit(final_level,
                                                time_limit=max(clock.left() + (0.0 if grown else grace), floor, 1e-3),
                                                centers=lev_centers, weights=lev_weights, rows=rows_final,
                                                keeper=keeper, start=lev_alpha)
        report.stages["final fit"] = time.perf_counter() - t_stage
        # the final model on the calibration rows against its level's selection fit there (a grown fit that the
        # growth check kept was scored so already): a final CG that did not solve its system shows as a final
        # model worse than the fit it was chosen by, even where those rows are in its fit
        returned = _Returned(final, converged, rows_final, final_level, final_predicted)
        final_check: tuple[float, float] | None = None
        if checked is None:
            final_check = _FinalCheck(
                fits=fits, final_models=final_models, report=report, cal_idx=cal_idx, xv=xv, yv_cal=yv_cal, y_mu=y_mu,
                y_sd=y_sd, dtype=dtype, n_final=n_final, n_back=n_back,
            ).run(returned, best_level, score_key(best_level["M"], best_level["noise"], best_level["multiplier"],
                                                  centers_kind),
                  keeper, centers=lev_centers, weights=lev_weights, start=lev_alpha)
        outcome = _LooStage(
            final_models=final_models, report=report, clock=clock, budget=budget, points=loo_points, x_fin=x_fin,
            y_fin=y_fin, x_mu=x_mu, x_sd=x_sd, y_mu=y_mu, y_sd=y_sd, dtype=dtype, calibrate_variance=calibrate_variance,
        ).run(returned, best_level, best_state, chosen_error, keeper)
        loo_c, best_level, best_state = outcome.variance_scale, outcome.best_level, outcome.best_state
        final, converged, rows_final = returned.model, returned.converged, returned.rows
        final_level, final_predicted = returned.level, returned.predicted
        variance_c = 1.0
        if loo_c is not None:
            try:
                final.scale_prior(loo_c)
                variance_c = loo_c
            except (ValueError, RuntimeError) as exc:  # a user's bound on the outputscale or the noise
                report.notes.append(f"variance calibration skipped: {type(exc).__name__}: {exc}")
        elif keeper is not None:
            t_cal = time.perf_counter()
            try:
                seen = (score_key(best_level["M"], best_level["noise"], best_level["multiplier"], centers_kind)
                        if cal_seen else None)
                c_cal = calibration.scale(final, keeper.last, seen)
                final.scale_prior(c_cal)
                variance_c = c_cal
            except (ValueError, LookupError, RuntimeError, TypeError) as exc:
                report.notes.append(f"variance calibration skipped: {type(exc).__name__}: {exc}")
            finally:
                keeper.last = None  # the factors are released with the builder
                final.options = final.options.replace(preconditioner=None)
            report.stages["calibration"] = time.perf_counter() - t_cal
        if final.fit_info is not None and final.fit_info.extra.get("time_limit"):
            report.notes.append(f"final CG stopped by the budget after {final.fit_info.iterations} iterations "
                                f"(relative residual {float(final.fit_info.final_residual.max()):.3g})")
        elif not converged and final.fit_info is not None and final.fit_info.extra.get("drifted"):
            report.notes.append(f"final CG: its true residual {float(final.fit_info.final_residual.max()):.3g} is "
                                f"above tol={tol:g} (the floor of the data dtype's kernel products)")
        elif not converged:
            report.notes.append(f"final CG stopped at max_iter={max_iter} before tol={tol:g}")
        m_fin = int(final.centers.shape[0])
        noise_raw = float(final.noise.detach())  # the selected noise in raw units, times the variance scale

        best_obj = next((r for r in report.learn if r["racer"] == best_state["racer"]
                         and r.get("rows") == best_state["rows"]), {})
        report.chosen = dict(
            objective=best_state["objective"],
            racer=best_state["racer"],
            lr=best_state["lr"],
            kernel=report.kernel,
            step=best_state["step"],
            learn_error=best_state["error"],
            objective_steps=best_obj.get("steps"),
            learn_rows=best_state["rows"],
            y_scale=float(y_sd),
            num_centers=m_fin,
            noise=final_level["noise"],
            variance_scale=variance_c,
            noise_raw=noise_raw,
            penalty=noise_raw / rows_final,
            multiplier=best_level["multiplier"],
            val_error=chosen_error,
            val_rmse=math.sqrt(chosen_error) * float(y_sd),
            final_check_error=None if final_check is None else final_check[0],
            final_check_selection_error=None if final_check is None else final_check[1],
            levels=[dict(r) for r in levels],
            final_rows=rows_final,
            final_iterations=final.fit_info.iterations if final.fit_info is not None else None,
            final_predicted_seconds=final_predicted,
            centers=centers_kind,
            grown_from=final_level.get("grown_from"),
        )
        if dtype == torch.float32 and chosen_error < FLOAT32_LIMITED_ERROR:
            msg = (f"the validation error is {chosen_error:.2g} of the targets' variance (RMSE "
                   f"{100 * math.sqrt(chosen_error):.2g} % of their standard deviation): on data this close to "
                   "noiseless, float32 kernel values limit the fit (below some noise level they stop resolving the "
                   "function, and the selection takes a larger noise); dtype=torch.float64 can be several times more "
                   "accurate")
            report.notes.append(msg)
            warn_caller(f"auto_fit: {msg}", RuntimeWarning)
        final.auto_report = report
        return final
    finally:
        clock.close()
