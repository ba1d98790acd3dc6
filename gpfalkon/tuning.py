"""Outer-loop search over discrete and continuous FALKON hyperparameters.

``BoTorchSearch`` (Bayesian optimisation with BoTorch), ``RandomSearch`` and
``GridSearch`` share one interface: a search space, an objective to *minimise*, a
budget of evaluations and a seed; ``run(*data)`` returns the best configuration and
the full history (values and wall times), saved as JSON after every evaluation when
``history_path`` is given and resumed from it.

Encoding (how BoTorch sees the space): ``Integer`` is a discrete dimension whose
allowed values are the integers (their logs when ``log=True``); ``Float`` and
``LogFloat`` are continuous (``LogFloat`` in log10 space); ``Categorical`` is a
categorical dimension (index of the choice). The surrogate is BoTorch's
``MixedSingleTaskGP`` (a Hamming-distance kernel on the categorical dimensions),
with ``Normalize`` on the other dimensions only, and the acquisition
(``LogExpectedImprovement``, optionally divided by the predicted cost) is optimised by
``optimize_acqf_mixed_alternating``: local search over the discrete and categorical
dimensions alternating with L-BFGS on the continuous ones, so no candidate is
produced by rounding a relaxed one.
"""
from __future__ import annotations

import abc
import itertools
import json
import math
import numbers
import pathlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

__all__ = [
    "BoTorchSearch",
    "Categorical",
    "Float",
    "GridSearch",
    "Integer",
    "LogFloat",
    "RandomSearch",
    "SearchResult",
    "SearchSpace",
    "Trial",
    "falkon_validation_error",
    "gradient_tuned_error",
    "make_kernel",
]


# ---------------------------------------------------------------- dimensions
@dataclass(frozen=True)
class Integer:
    """Integers in ``[low, high]``; ``log=True`` searches (and samples) on the log scale."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)):
            raise TypeError(f"Integer bounds must be ints, got low={self.low!r}, high={self.high!r}")
        if self.low > self.high:
            raise ValueError(f"Integer: low={self.low} > high={self.high}")
        if self.log and self.low < 1:
            raise ValueError(f"Integer(log=True) needs low >= 1, got {self.low}")

    def encode(self, value: float) -> float:
        return math.log(value) if self.log else float(value)

    def decode(self, z: float) -> int:
        v = round(math.exp(z)) if self.log else round(z)
        return min(max(v, self.low), self.high)

    def encoded_values(self) -> list[float]:
        return [self.encode(v) for v in range(self.low, self.high + 1)]


@dataclass(frozen=True)
class Float:
    """Real numbers in ``[low, high]`` (uniform scale)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _check_real("Float", self.low, self.high)
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or not self.low < self.high:
            raise ValueError(f"Float: need finite low < high, got low={self.low}, high={self.high}")

    def encode(self, value: float) -> float:
        return float(value)

    def decode(self, z: float) -> float:
        return float(min(max(z, self.low), self.high))


def _check_real(kind: str, low: Any, high: Any) -> None:
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{kind}: {name} must be a real number, got {v!r}")


@dataclass(frozen=True)
class LogFloat:
    """Positive reals in ``[low, high]``, searched in log10 space."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _check_real("LogFloat", self.low, self.high)
        if not (self.low > 0 and math.isfinite(self.high)) or not self.low < self.high:
            raise ValueError(f"LogFloat: need 0 < low < high < inf, got low={self.low}, high={self.high}")

    def encode(self, value: float) -> float:
        return math.log10(value)

    def decode(self, z: float) -> float:
        return float(min(max(10.0**z, self.low), self.high))


@dataclass(frozen=True)
class Categorical:
    """One of ``choices`` (no order assumed)."""

    choices: tuple

    def __init__(self, choices: Sequence[Any]) -> None:
        choices = tuple(choices)
        if len(choices) == 0:
            raise ValueError("Categorical: choices is empty")
        try:
            distinct = len(set(choices))
        except TypeError as exc:  # e.g. lists: the search maps choices to indices through a dict
            raise TypeError(
                f"Categorical: choices must be hashable (str, int, float, tuple...), got {choices!r}"
            ) from exc
        if distinct != len(choices):
            raise ValueError(f"Categorical: choices has duplicates: {choices}")
        object.__setattr__(self, "choices", choices)

    def encode(self, value: Any) -> float:
        return float(self.choices.index(value))

    def decode(self, z: float) -> Any:
        return self.choices[min(max(round(z), 0), len(self.choices) - 1)]


Dimension = Integer | Float | LogFloat | Categorical


# -------------------------------------------------------------------- space
class SearchSpace:
    """An ordered mapping name -> dimension, with the encoding BoTorch works in."""

    def __init__(self, dims: Mapping[str, Dimension]) -> None:
        if not isinstance(dims, Mapping) or len(dims) == 0:
            raise ValueError("the search space must be a non-empty dict of name -> dimension")
        for name, dim in dims.items():
            if not isinstance(name, str):
                raise TypeError(f"search space names must be strings, got {name!r}")
            if not isinstance(dim, (Integer, Float, LogFloat, Categorical)):
                raise TypeError(f"search space entry {name!r} must be Integer, Float, LogFloat or Categorical")
        self.dims: dict[str, Dimension] = dict(dims)
        self.names = list(self.dims)

    def __len__(self) -> int:
        return len(self.names)

    def encode(self, config: Mapping[str, Any]) -> Tensor:
        return torch.tensor([self.dims[k].encode(config[k]) for k in self.names], dtype=torch.float64)

    def decode(self, z: Tensor) -> dict[str, Any]:
        return {k: self.dims[k].decode(float(z[i])) for i, k in enumerate(self.names)}

    def bounds(self) -> Tensor:
        lo, hi = [], []
        for d in self.dims.values():
            if isinstance(d, Categorical):
                lo.append(0.0)
                hi.append(float(len(d.choices) - 1))
            else:
                lo.append(d.encode(d.low))
                hi.append(d.encode(d.high))
        return torch.tensor([lo, hi], dtype=torch.float64)

    def cat_dims(self) -> dict[int, list[float]]:
        return {i: [float(j) for j in range(len(d.choices))]
                for i, d in enumerate(self.dims.values()) if isinstance(d, Categorical)}

    def discrete_dims(self) -> dict[int, list[float]]:
        return {i: d.encoded_values() for i, d in enumerate(self.dims.values()) if isinstance(d, Integer)}

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        """``n`` configurations uniform in the encoded space (log-uniform for log scales)."""
        b = self.bounds()
        u = torch.rand(n, len(self), generator=generator, dtype=torch.float64)
        z = b[0] + u * (b[1] - b[0])
        return [self.decode(row) for row in z]

    def grid(self, budget: int) -> list[dict[str, Any]]:
        """A full-factorial grid with at most ``budget`` points: every categorical value,
        and as many evenly spaced levels per other dimension as the budget allows."""
        cats = [len(d.choices) for d in self.dims.values() if isinstance(d, Categorical)]
        n_cat = math.prod(cats) if cats else 1
        others = [n for n in self.names if not isinstance(self.dims[n], Categorical)]
        # levels per non-categorical dimension, raised round-robin while the grid fits
        levels = {n: 1 for n in others}
        grown = True
        while grown:
            grown = False
            for n in others:
                trial = dict(levels, **{n: levels[n] + 1})
                if n_cat * math.prod(trial.values()) <= budget:
                    levels, grown = trial, True
        axes = []
        for name in self.names:
            d = self.dims[name]
            if isinstance(d, Categorical):
                axes.append(list(d.choices))
                continue
            lv = levels[name]
            lo, hi = d.encode(d.low), d.encode(d.high)
            zs = [lo + (hi - lo) * (i + 0.5) / lv for i in range(lv)] if lv > 1 else [(lo + hi) / 2]
            vals = []
            for z in zs:
                v = d.decode(z)
                if v not in vals:
                    vals.append(v)
            axes.append(vals)
        return [dict(zip(self.names, combo, strict=False)) for combo in itertools.product(*axes)][:budget]


# ------------------------------------------------------------------ results
@dataclass
class Trial:
    config: dict[str, Any]
    value: float
    seconds: float
    source: str = ""


def _load_history(path: pathlib.Path) -> list[Trial]:
    """The trials saved at ``path``; a file that is not a saved search history raises ``ValueError``
    naming ``history_path`` (it is never overwritten silently)."""
    try:
        data = json.loads(path.read_text())
        trials = [Trial(**t) for t in data["history"]]
        for t in trials:
            if not isinstance(t.config, dict):
                raise TypeError("a trial's config is not a mapping")
            t.value, t.seconds = float(t.value), float(t.seconds)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"history_path {str(path)!r} is not a search history saved by gpfalkon.tuning "
            f"({type(exc).__name__}: {exc}); move it away or pass another history_path"
        ) from exc
    return trials


@dataclass
class SearchResult:
    best_config: dict[str, Any]
    best_value: float
    history: list[Trial] = field(default_factory=list)

    def best_so_far(self) -> list[float]:
        """Best value after each evaluation."""
        out, best = [], math.inf
        for t in self.history:
            best = min(best, t.value)
            out.append(best)
        return out


Objective = Callable[..., float]


class _Search(abc.ABC):
    """Common loop: propose, evaluate (timed), record, save; resume from ``history_path``."""

    source = "search"

    def __init__(
        self,
        space: SearchSpace | Mapping[str, Dimension],
        objective: Objective,
        budget: int,
        seed: int = 0,
        *,
        history_path: str | pathlib.Path | None = None,
        verbose: bool = False,
    ) -> None:
        self.space = space if isinstance(space, SearchSpace) else SearchSpace(space)
        if not callable(objective):
            raise TypeError("objective must be callable: objective(config, *data) -> float")
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        self.objective = objective
        self.budget = budget
        self.generator = torch.Generator().manual_seed(int(seed))
        self.history_path = None if history_path is None else pathlib.Path(history_path)
        self.verbose = verbose
        self.history: list[Trial] = []
        if self.history_path is not None and self.history_path.exists():
            self.history = _load_history(self.history_path)

    @abc.abstractmethod
    def _propose(self) -> dict[str, Any]:
        """The next configuration to evaluate."""

    def _save(self) -> None:
        if self.history_path is not None:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            self.history_path.write_text(json.dumps({"history": [asdict(t) for t in self.history]}, default=str))

    def run(self, *data: Any) -> SearchResult:
        """Evaluate until ``budget`` evaluations (counting resumed ones) are done."""
        todo = self.budget - len(self.history)
        bar = None
        if self.verbose and todo > 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=todo, desc=type(self).__name__)
        try:
            for _ in range(max(todo, 0)):
                config = self._propose()
                t0 = time.perf_counter()
                value = float(self.objective(config, *data))
                secs = time.perf_counter() - t0
                if not math.isfinite(value):
                    value = math.inf
                self.history.append(Trial(config=config, value=value, seconds=secs, source=self.source))
                self._save()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(best=f"{min(t.value for t in self.history):.4g}")
        finally:
            if bar is not None:
                bar.close()
        bad = sum(not math.isfinite(t.value) for t in self.history)
        if bad:
            warnings.warn(
                f"{type(self).__name__}: {bad} of {len(self.history)} evaluations returned a non-finite value "
                "(recorded as inf)" + ("; none succeeded, so best_config is not a result: check the objective"
                                       if bad == len(self.history) else ""),
                RuntimeWarning,
                stacklevel=2,
            )
        best = min(self.history, key=lambda t: t.value)
        return SearchResult(best_config=best.config, best_value=best.value, history=list(self.history))


class RandomSearch(_Search):
    """Configurations drawn uniformly in the encoded space (log-uniform on log scales)."""

    source = "random"

    def _propose(self) -> dict[str, Any]:
        return self.space.sample(1, self.generator)[0]


class GridSearch(_Search):
    """A full-factorial grid of at most ``budget`` points, evaluated in order."""

    source = "grid"

    def __init__(self, space, objective, budget, seed: int = 0, **kwargs) -> None:
        super().__init__(space, objective, budget, seed, **kwargs)
        self._grid = self.space.grid(budget)
        self.budget = min(budget, len(self._grid))

    def _propose(self) -> dict[str, Any]:
        return self._grid[len(self.history)]


class BoTorchSearch(_Search):
    """Bayesian optimisation of the objective over a mixed space with BoTorch.

    ``n_initial`` random configurations (default ``max(5, 2 * dims)``), then one
    candidate per evaluation maximising ``LogExpectedImprovement`` of a
    ``MixedSingleTaskGP`` fitted to ``-objective`` (optionally ``log``-transformed,
    ``log_objective=True`` for positive errors) by ``optimize_acqf_mixed_alternating``.
    ``cost_aware=True`` fits a second GP to ``log(seconds)`` and maximises
    ``LogEI - log(predicted seconds)`` (improvement per second, as evaluations get
    slower with ``num_centers``). A candidate equal to an evaluated configuration is
    replaced by a random one.
    """

    source = "botorch"

    def __init__(
        self,
        space,
        objective,
        budget,
        seed: int = 0,
        *,
        n_initial: int | None = None,
        cost_aware: bool = False,
        log_objective: bool = True,
        num_restarts: int = 4,
        raw_samples: int = 128,
        **kwargs,
    ) -> None:
        super().__init__(space, objective, budget, seed, **kwargs)
        self.n_initial = max(5, 2 * len(self.space)) if n_initial is None else int(n_initial)
        if self.n_initial < 2:
            raise ValueError(f"n_initial must be >= 2, got {n_initial}")
        self.cost_aware = bool(cost_aware)
        self.log_objective = bool(log_objective)
        self.num_restarts = int(num_restarts)
        self.raw_samples = int(raw_samples)

    def _fit_gp(self, X: Tensor, Y: Tensor):
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import MixedSingleTaskGP, SingleTaskGP
        from botorch.models.transforms.input import Normalize
        from gpytorch.mlls import ExactMarginalLogLikelihood

        cat = sorted(self.space.cat_dims())
        num = [i for i in range(X.shape[-1]) if i not in cat]
        bounds = self.space.bounds()
        tf = Normalize(d=X.shape[-1], indices=num, bounds=bounds[:, num]) if num else None
        if cat:
            model = MixedSingleTaskGP(X, Y, cat_dims=cat, input_transform=tf)
        else:
            model = SingleTaskGP(X, Y, input_transform=tf)
        fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
        return model

    def _propose(self) -> dict[str, Any]:
        if len(self.history) < self.n_initial:
            return self.space.sample(1, self.generator)[0]
        from botorch.acquisition import LogExpectedImprovement
        from botorch.acquisition.acquisition import AcquisitionFunction
        from botorch.optim.optimize_mixed import optimize_acqf_mixed_alternating

        ok = [t for t in self.history if math.isfinite(t.value)]
        if len(ok) < 2:  # nothing (or one point) to fit a GP to: non-finite values were recorded as inf
            return self.space.sample(1, self.generator)[0]
        X = torch.stack([self.space.encode(t.config) for t in ok])
        vals = torch.tensor([t.value for t in ok], dtype=torch.float64)
        if self.log_objective and bool((vals > 0).all()):
            vals = vals.log()
        Y = (-vals).unsqueeze(-1)
        model = self._fit_gp(X, Y)
        acqf: AcquisitionFunction = LogExpectedImprovement(model, best_f=Y.max())
        if self.cost_aware:
            cost_model = self._fit_gp(X, torch.tensor([[math.log(max(t.seconds, 1e-6))] for t in ok],
                                                      dtype=torch.float64))
            # duck-typed: the optimiser only calls it on X and reads .model
            acqf = cast(AcquisitionFunction, _LogEIPerCost(acqf, cost_model))
        # BoTorch's optimiser draws its raw samples from the global RNG: seed it from
        # this search's generator inside fork_rng, leaving the caller's RNG untouched
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            cand, _ = optimize_acqf_mixed_alternating(
                acqf,
                bounds=self.space.bounds(),
                discrete_dims=self.space.discrete_dims() or None,
                cat_dims=self.space.cat_dims() or None,
                num_restarts=self.num_restarts,
                raw_samples=self.raw_samples,
            )
        config = self.space.decode(cand.reshape(-1))
        if any(config == t.config for t in self.history):
            config = self.space.sample(1, self.generator)[0]
        return config


class _LogEIPerCost(torch.nn.Module):
    """``log EI(x) - E[log seconds](x)``: expected improvement per unit of evaluation time."""

    def __init__(self, log_ei, cost_model) -> None:
        super().__init__()
        self.log_ei = log_ei
        self.cost_model = cost_model
        self.model = log_ei.model  # for BoTorch utilities that inspect acqf.model

    def forward(self, X: Tensor) -> Tensor:
        cost = self.cost_model.posterior(X).mean.squeeze(-1).squeeze(-1)
        return self.log_ei(X) - cost


# ------------------------------------------------------------- objectives
KERNELS = ("rbf", "matern12", "matern32", "matern52", "laplacian")


def make_kernel(name: str, lengthscale: float):
    """A GPyTorch kernel by name (``laplacian`` = Matern 1/2 = exp(-||x - y|| / ell))."""
    import gpytorch

    if name == "rbf":
        k = gpytorch.kernels.RBFKernel()
    elif name in ("matern12", "laplacian"):
        k = gpytorch.kernels.MaternKernel(nu=0.5)
    elif name == "matern32":
        k = gpytorch.kernels.MaternKernel(nu=1.5)
    elif name == "matern52":
        k = gpytorch.kernels.MaternKernel(nu=2.5)
    else:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    k.lengthscale = lengthscale
    return k


def _config_model(config: Mapping[str, Any], train_x: Tensor, train_y: Tensor, max_iter: int, seed: int, **kw):
    from .heuristics import median_lengthscale
    from .models import FalkonGP

    selection = config.get("center_selection", "uniform")
    if selection not in ("uniform", "leverage"):
        raise ValueError(f"center_selection={selection!r}: must be 'uniform' or 'leverage'")
    ls = float(median_lengthscale(train_x)) * float(config.get("lengthscale_factor", 1.0))
    kernel = make_kernel(config.get("kernel", "rbf"), ls).to(train_x)
    m = min(int(config.get("num_centers", 1000)), train_x.shape[0])
    return FalkonGP(train_x, train_y, kernel=kernel, num_centers=m, penalty=float(config.get("penalty", 1e-6)),
                    max_iter=max_iter, tol=0.0, seed=seed, center_selection=selection, **kw)


def _rmse(model: Any, val_x: Tensor, val_y: Tensor) -> float:
    model.eval()
    pred = model.posterior_mean(val_x)  # no process-wide GPyTorch flag toggled
    return float(((pred - val_y) ** 2).mean().sqrt())


def falkon_validation_error(max_iter: int = 20, seed: int = 0) -> Objective:
    """Objective ``(config, train_x, train_y, val_x, val_y) -> validation RMSE`` of a
    FalkonGP fitted with the configuration's ``num_centers``, ``kernel``, ``penalty``,
    ``center_selection`` and ``lengthscale_factor`` (x the median heuristic)."""

    def objective(config, train_x, train_y, val_x, val_y) -> float:
        model = _config_model(config, train_x, train_y, max_iter, seed)
        model.fit()
        return _rmse(model, val_x, val_y)

    return objective


def gradient_tuned_error(objective: str = "NystromCompReg", steps: int = 30, lr: float = 0.05,
                         max_iter: int = 20, seed: int = 0) -> Objective:
    """Inner gradient loop, outer discrete search: the configuration fixes the discrete
    choices and the initial values; ``steps`` Adam steps on ``gpfalkon.objectives.<objective>``
    learn the kernel parameters, lambda and the centers; returns the validation RMSE."""
    from . import objectives as O

    cls = getattr(O, objective)

    def run(config, train_x, train_y, val_x, val_y) -> float:
        model = _config_model(config, train_x, train_y, max_iter, seed, learn_centers=True)
        cls(model).minimize(steps, lr=lr)
        model.fit()
        return _rmse(model, val_x, val_y)

    return run
