"""What :func:`~gpfalkon.auto_fit` tried and chose, and the clock its budget is spent against.

:class:`AutoFitReport` is attached to the returned model as ``model.auto_report``; ``_Clock`` reads the wall clock
(``time.perf_counter``) against the budget and mirrors it on an optional tqdm bar. Cost: O(1) per read.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AutoFitReport:
    """What :func:`auto_fit` tried and chose (attached to the model as ``model.auto_report``).

    Errors are validation mean squared errors on standardised targets (``val_rmse`` in the
    targets' units). ``stages`` holds the seconds spent per stage; ``learn`` the starting point's
    record, then one per racer and subsample (its ``objective``, ``racer``, ``lr``, rows and
    validation-error trajectory); ``search`` every selection fit
    ``(M, noise, multiplier, error, seconds)``, one record per noise of a penalty path too (``path``: the noises solved
    together; ``seconds``: the whole path's, on each of its records); ``chosen`` the final choices (with
    ``final_check_error``, the returned model's error on the calibration rows, and ``final_check_selection_error``, its
    level's selection fit's there:
    above :data:`FINAL_CHECK_RATIO` times it ``auto_fit`` refits the level on its selection rows, returns the better
    of the two there and warns; ``None`` where a growth check scored the model instead, in ``growth``, or where no
    selection residuals were kept: ``check_growth=False`` with ``calibrate_variance=False`` or no held-out rows put
    back); ``growth`` the check of a grown
    final fit (``check_growth``: the grown size ``M``, ``grown_from``, its validation ``error`` against the
    level's ``level_error`` on its ``check_rows``, ``z`` the paired difference in standard errors, the grown fit's
    ``rows`` and ``seconds``, whether it was ``kept``); ``leverage`` the
    leverage-score check of the chosen level (``leverage_check=True``: its validation ``error``
    against the uniform centers', the distinct centers drawn, its seconds); ``sampling`` the choice of
    the center pool at the first size (``center_sampling``: the scores' ``uniformity``, ``uniform_error``,
    ``leverage_error``, the estimated ``d_eff``, the ``distinct`` leverage draws, ``seconds``, the pool ``chosen``;
    where the scores were nearly uniform, no errors: the try stopped there); ``loo`` the leave-one-out choice on every
    row (``loo_rows``: the candidate ``points``, the ``scored`` ones ``(racer, step, noise, error)``, the
    ``chosen_error`` of the validation rows' choice, the ``winner``, its refined ``noise``, ``error`` and
    ``variance_scale``, whether it was ``refit``, ``seconds``).
    """

    budget: float
    n_train: int
    n_val: int
    val_source: str
    kernel: str
    learn: list[dict[str, Any]] = field(default_factory=list)
    search: list[dict[str, Any]] = field(default_factory=list)
    chosen: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    leverage: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    growth: dict[str, Any] = field(default_factory=dict)
    loo: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return float(sum(self.stages.values()))

    def summary(self) -> str:
        c = self.chosen
        lines = [
            f"auto_fit: {self.seconds:.1f} s of a {self.budget:g} s budget; n_train {self.n_train:,}, "
            f"validation {self.n_val:,} rows ({self.val_source})",
            f"  objective {c.get('objective')} ("
            + (f"lr {c['lr']:g}, " if c.get("lr") is not None else "")
            + f"step {c.get('step')}), kernel {self.kernel}, "
            f"M {c.get('num_centers')} ({c.get('centers')} centers), "
            f"noise {c.get('noise', float('nan')):.4g} (standardised), "
            f"lengthscale multiplier {c.get('multiplier', float('nan')):.3g}, "
            f"variance scale {c.get('variance_scale', float('nan')):.3g}",
            f"  validation RMSE {c.get('val_rmse', float('nan')):.5g}; stages "
            + ", ".join(f"{k} {v:.1f} s" for k, v in self.stages.items()),
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class _Clock:
    """Wall clock against a budget, mirrored on an optional tqdm bar (one unit = one second)."""

    def __init__(self, budget: float, verbose: bool) -> None:
        self.t0 = time.perf_counter()
        self.budget = float(budget)
        self.bar = None
        if verbose:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(self.budget, 1), unit="s", desc="auto_fit", leave=True)
        self._shown = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def tick(self, stage: str, **postfix: Any) -> None:
        if self.bar is None:
            return
        # the position is set, not accumulated: summed rounded increments drift past the total (tqdm then
        # warns "clamping frac to range [0, 1]")
        now = min(round(self.elapsed(), 1), self.bar.total)
        self.bar.n = now
        self._shown = now
        self.bar.set_description(f"auto_fit [{stage}]")
        if postfix:
            self.bar.set_postfix(**postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.tick("done")
            self.bar.close()
