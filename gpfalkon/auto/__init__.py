"""Automatic fit: hyperparameters, number of centers and penalty chosen under a wall-clock budget.

:func:`auto_fit` turns ``(x, y, budget)`` into a fitted :class:`~gpfalkon.FalkonGP`, in three stages
(every choice lands in ``model.auto_report``):

1. **Learn** ARD lengthscales (in log space, small gradients taking small steps), outputscale and the
   penalty (optionally the centers) on a subsample
   of ``hyper_rows`` rows with ``hyper_centers`` centers, by Adam on each objective in
   ``objectives`` (SGPR bound, GCV, C-Reg, Nyström C-Reg, ...: Meanti et al. 2022 find each best
   on some datasets; an objective may race at several learning rates). Every ``eval_every`` steps the
   current hyperparameters are scored by the validation error of a FALKON fit on the subsample; after
   ``race_rounds`` such rounds only the leading objective goes on (sooner where the others' best errors
   exceed ``1 + race_margin`` times the leader's from the second round on, or once the race has used
   ``race_share`` of the learning time; at small budgets only the first racers whose first round fits that share
   race), and whenever it stalls, or has used ``level_share`` of the learning
   time left when it started on its rows, it continues from its best point on twice
   the rows (nested subsamples; optionally more centers, ``hyper_centers_growth``), within the
   memory budget ``hyper_entries``; stalled on all the rows it may use, or stalled on more rows
   without beating its best point on fewer or its start point scored on those rows, it stops. The best
   (racer, rows, step) over the whole race wins, so the objective *and* the stopping point
   are chosen on validation data.
2. **Select** on at most ``select_rows`` training rows: a coordinate search over the noise
   ``sigma^2 = n lambda`` and a common lengthscale multiplier, each a log-spaced 1-D grid around
   the learned value that keeps extending while the best point is at its edge (by more than
   ``search_tol``); then the number
   of centers is doubled (nested centers) while the validation error improves by more than
   ``min_gain`` per doubling and the predicted cost of the next size (from the measured fit times) fits the
   remaining budget (or grown by the largest factor >= 1.25 that fits), re-tuning the noise and
   the multiplier (both move as the Nyström approximation improves) at each size. The nested
   centers are uniform rows or ridge-leverage-score draws, whichever validates better at the
   first size (``center_sampling``).
3. **Refit** on all rows (training rows plus the held-out rows, unless ``val_x`` was given) with
   the chosen kernel, noise and number of centers; where stage 2 stopped growing the centers for
   time (another size with its selection fits would not fit the budget), the refit takes as many
   more nested centers as the time left pays for (``final_growth``, up to ``final_growth_factor`` = 4 times as
   many, past twice as many within half the final rows).

Inputs and targets are standardised internally, ``z = (x - mu) / s`` per feature (the mean and
standard deviation, or the median and ``OUTLIER_SCALE_RATIO`` robust scales where a few far rows inflate the
standard deviation beyond that) and ``u = (y - m) / r``, and mapped back exactly: for a stationary ARD kernel
``k(z, z') = sigma_f^2 rho(|z_j - z'_j| / l_j)``, ``k`` on raw ``x`` has lengthscales ``l_j s_j``;
the model on raw ``y`` has outputscale ``r^2 sigma_f^2``, noise ``r^2 sigma_n^2`` (so the same
``alpha`` up to the factor ``r``) and the constant prior mean ``m`` (``FalkonGP(mean_constant=m)``).
The returned model takes and predicts raw data. Cost: stage 1
``O(steps hyper_rows hyper_centers^2)`` per racer; stages 2-3
FALKON fits, ``O(n M t + M^3)`` each; ``budget`` bounds the sum (measured, not predicted, except
for the final fit whose time is extrapolated from the measured selection fits).

Written here because no ecosystem package has it: BoTorch's ``fit_gpytorch_mll`` optimises one
marginal likelihood on all rows (``O(n M^2)`` per step for SGPR) and knows neither FALKON's cheap
refits nor budget-driven choice of ``M``.

The package, one responsibility per module (each imports only the ones above it in this list):

- :mod:`~gpfalkon.auto.report`: :class:`AutoFitReport` (what was tried and chosen) and the budget clock;
- :mod:`~gpfalkon.auto.kernels`: the kernel families and the lengthscale / outputscale rescalings;
- :mod:`~gpfalkon.auto.standardise`: the robust per-feature location and scale of the inputs;
- :mod:`~gpfalkon.auto.sampling`: how the nested centers are drawn (uniform or ridge-leverage scores);
- :mod:`~gpfalkon.auto.scoring`: validation errors of a fit or a penalty path, the paired test between two fits;
- :mod:`~gpfalkon.auto.costs`: the measured cost model (factorisation growth, fit-time extrapolation, growth sizes);
- :mod:`~gpfalkon.auto.loo`: the exact leave-one-out choice among the learned candidates on a row subsample;
- :mod:`~gpfalkon.auto.race`: stage 1's racers, an objective each, stepped by Adam and scored on validation error;
- :mod:`~gpfalkon.auto.learn`: stage 1, the race and the leader's progressive subsampling;
- :mod:`~gpfalkon.auto.selection`: stage 2's selection fits (cached scores, noise and multiplier searches) and the
  cost model measured on them;
- :mod:`~gpfalkon.auto.final`: stage 3's model of a level on the final rows, mapped back to raw units;
- :mod:`~gpfalkon.auto.growth`: the final fit's growth past the last level (its size, its time reserve, its check);
- :mod:`~gpfalkon.auto.leverage`: leverage-score centers, the pool tried at the first size and the last-step check;
- :mod:`~gpfalkon.auto.sizes`: stage 2's sizes, the searches at the first one, the doubling and the level chosen;
- :mod:`~gpfalkon.auto.calibration`: the variance calibration's scale on the held-out rows;
- :mod:`~gpfalkon.auto.final_check`: the returned model against the selection fit it was chosen by, and its refit;
- :mod:`~gpfalkon.auto.loo_stage`: on small data, the leave-one-out choice on every row and its exact refit;
- :mod:`~gpfalkon.auto.fit`: :func:`auto_fit`, the three stages under one budget.
"""
from .fit import auto_fit
from .kernels import KERNEL_FAMILIES, LENGTHSCALE_TRANSFORMS
from .race import OBJECTIVES
from .report import AutoFitReport
from .sampling import CENTER_SAMPLING

__all__ = ["CENTER_SAMPLING", "KERNEL_FAMILIES", "LENGTHSCALE_TRANSFORMS", "OBJECTIVES", "AutoFitReport", "auto_fit"]
