"""Outer-loop search over discrete and continuous FALKON hyperparameters.

``BoTorchSearch`` (Bayesian optimisation with BoTorch), ``RandomSearch`` and
``GridSearch`` share one interface: a search space and a seed, then either

- **ask / tell**: ``suggest(q)`` returns ``q`` configurations to evaluate anywhere (another
  process, a cluster), ``observe(config, value, cost)`` records each result; or
- **a loop**: ``run(*data)`` calls ``objective(config, *data)`` (to *minimise*) until ``budget``
  evaluations are done, timing each.

Either way the state (history, pending suggestions, the random generator) is saved as JSON at
``history_path`` and resumed from it: a resumed search continues its random stream and never
repeats a configuration. Random draws are unbiased for every dimension type (integers and choices
are drawn directly, never by rounding a continuous draw). An objective may return an
:class:`Evaluation` naming the configuration it actually ran (``falkon_validation_error`` caps
``num_centers`` at the number of rows and says so); the history records what ran.

Encoding (how BoTorch sees the space): ``Integer`` is a discrete dimension whose
allowed values are the integers (their logs when ``log=True``); ``Float`` and
``LogFloat`` are continuous (``LogFloat`` in log10 space); ``Categorical`` is a
categorical dimension (index of the choice). The surrogate is BoTorch's
``MixedSingleTaskGP`` (a Hamming-distance kernel on the categorical dimensions),
with ``Normalize`` on the other dimensions only, and the acquisition
(``LogExpectedImprovement``, or ``qLogExpectedImprovement`` for batches and pending points,
optionally per unit of predicted cost) is optimised by
``optimize_acqf_mixed_alternating``: local search over the discrete and categorical
dimensions alternating with L-BFGS on the continuous ones, so no candidate is
produced by rounding a relaxed one.

Written here because BoTorch has the pieces (models, acquisitions, the mixed optimiser) but no
search loop with a persisted ask/tell state over a typed space; Ax has one, but is not a
dependency of this project.
"""
from __future__ import annotations

import abc
import base64
import itertools
import json
import math
import numbers
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from ._warn import warn_caller

__all__ = [
    "BoTorchSearch",
    "Categorical",
    "Evaluation",
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
    """Integers in ``[low, high]``; ``log=True`` searches (and samples) on the log scale.

    Random draws: uniform over the integers; with ``log=True``, ``v = floor(exp(u))`` for
    ``u ~ U[log low, log(high + 1))``, so ``P(v) = log((v + 1) / v) / log((high + 1) / low)``
    (every integer gets the log-width of ``[v, v + 1)``; the ends are not halved)."""

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

    def draw(self, n: int, generator: torch.Generator) -> list[int]:
        if not self.log:
            return [int(v) for v in torch.randint(self.low, self.high + 1, (n,), generator=generator)]
        lo, hi = math.log(self.low), math.log(self.high + 1)
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return [min(max(math.floor(math.exp(lo + float(t) * (hi - lo))), self.low), self.high) for t in u]

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return False
        return self.low <= int(value) <= self.high

    def size(self) -> int:
        return self.high - self.low + 1


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

    def draw(self, n: int, generator: torch.Generator) -> list[float]:
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return [self.decode(self.low + float(t) * (self.high - self.low)) for t in u]

    def contains(self, value: Any) -> bool:
        return _is_real(value) and self.low <= value <= self.high

    def size(self) -> float:
        return math.inf


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _as_value(value: Any) -> float:
    """An objective's value as a float: real numbers, 0-d tensors and arrays, one-element sequences
    of them are accepted; anything else is a ``TypeError`` naming ``value``."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"value must be a real number (the objective to minimise), got {value!r}")
    try:
        if isinstance(value, Tensor):
            return float(value.detach().reshape(()))
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"value must be a real number (the objective to minimise), got {value!r}") from exc


def _plain(v: Any) -> Any:
    """numpy / torch scalars as the Python scalars JSON round-trips (``np.int64(3)`` -> ``3``)."""
    if isinstance(v, (bool, str, bytes, tuple)) or v is None:
        return v
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", 0) == 0:
        return item()
    return v


def _check_real(kind: str, low: Any, high: Any) -> None:
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{kind}: {name} must be a real number, got {v!r}")


@dataclass(frozen=True)
class LogFloat:
    """Positive reals in ``[low, high]``, searched (and drawn uniformly) in log10 space."""

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

    def draw(self, n: int, generator: torch.Generator) -> list[float]:
        lo, hi = math.log10(self.low), math.log10(self.high)
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return [self.decode(lo + float(t) * (hi - lo)) for t in u]

    def contains(self, value: Any) -> bool:
        return _is_real(value) and self.low <= value <= self.high

    def size(self) -> float:
        return math.inf


@dataclass(frozen=True)
class Categorical:
    """One of ``choices`` (no order assumed; random draws are uniform over the choices)."""

    choices: tuple

    def __init__(self, choices: Sequence[Any]) -> None:
        choices = tuple(_plain(c) for c in choices)  # numpy scalars as Python ones: saved histories are JSON
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

    def draw(self, n: int, generator: torch.Generator) -> list[Any]:
        return [self.choices[int(i)] for i in torch.randint(0, len(self.choices), (n,), generator=generator)]

    def contains(self, value: Any) -> bool:
        try:
            return value in self.choices
        except TypeError:  # unhashable comparisons never raise for tuples, but be safe
            return False

    def size(self) -> int:
        return len(self.choices)


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

    def size(self) -> float:
        """The number of distinct configurations (``inf`` with a ``Float`` / ``LogFloat`` dimension)."""
        return math.prod(d.size() for d in self.dims.values())

    def encode(self, config: Mapping[str, Any]) -> Tensor:
        return torch.tensor([self.dims[k].encode(config[k]) for k in self.names], dtype=torch.float64)

    def decode(self, z: Tensor) -> dict[str, Any]:
        return {k: self.dims[k].decode(float(z[i])) for i, k in enumerate(self.names)}

    def normalize(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with JSON's changes undone: lists back to the tuple choices they were, integral
        floats of ``Integer`` dimensions back to ints."""
        out = {k: _plain(v) for k, v in config.items()}
        for k, d in self.dims.items():
            v = out.get(k)
            if isinstance(d, Categorical) and isinstance(v, list) and tuple(v) in d.choices:
                out[k] = tuple(v)
            elif isinstance(d, Integer) and isinstance(v, float) and v.is_integer():
                out[k] = int(v)
        return out

    def key(self, config: Mapping[str, Any]) -> tuple:
        """A hashable identity of a configuration (its values in the space's order)."""
        c = self.normalize(config)
        return tuple(c.get(k) for k in self.names)

    def check(self, config: Any, arg: str = "config", *, in_bounds: bool = True) -> dict[str, Any]:
        """``config`` normalised, or ``ValueError`` naming ``arg`` and what is wrong: keys other than the
        space's names, or a value outside its dimension (numeric values may leave the bounds when
        ``in_bounds=False``: a configuration *run* may differ from the one asked, e.g. capped)."""
        if not isinstance(config, Mapping):
            raise TypeError(f"{arg} must be a mapping name -> value, got {type(config).__name__}")
        c = self.normalize(config)
        missing = [k for k in self.names if k not in c]
        extra = [k for k in c if k not in self.dims]
        if missing or extra:
            raise ValueError(f"{arg}: keys must be the search space's {self.names}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        for k, d in self.dims.items():
            v = c[k]
            ok = d.contains(v)
            if not ok and not in_bounds and not isinstance(d, Categorical) and _is_real(v):
                # outside the bounds, but a value the dimension can encode
                log_scale = isinstance(d, LogFloat) or (isinstance(d, Integer) and d.log)
                ok = (not isinstance(d, Integer) or float(v).is_integer()) and (not log_scale or v > 0)
            if not ok:
                raise ValueError(f"{arg}[{k!r}]={v!r} is outside the search space's {d}")
        return c

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
        """``n`` random configurations, each dimension drawn independently and without bias: uniform
        over integers and choices, log-uniform on log scales (see each dimension's ``draw``)."""
        cols = {k: d.draw(n, generator) for k, d in self.dims.items()}
        return [{k: cols[k][i] for k in self.names} for i in range(n)]

    def grid(self, budget: int) -> list[dict[str, Any]]:
        """A full-factorial grid with at most ``budget`` points: every categorical value,
        and as many evenly spaced levels per other dimension as the budget allows."""
        cats = [len(d.choices) for d in self.dims.values() if isinstance(d, Categorical)]
        n_cat = math.prod(cats) if cats else 1
        if n_cat > budget:
            raise ValueError(f"budget={budget} cannot hold every combination of the categorical values ({n_cat}): "
                             f"give a budget of at least {n_cat}, or search with RandomSearch / BoTorchSearch")
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
    """One evaluation: ``config`` is what ran (``requested`` the suggestion when the objective ran
    something else, e.g. capped ``num_centers``); ``seconds`` its cost (measured wall time in
    :meth:`_Search.run`, what :meth:`_Search.observe` was given otherwise; NaN if unknown);
    ``source`` who proposed it: ``"random"``, ``"grid"``, ``"botorch"``, ``"user"`` (observed without a
    suggestion) or ``"random (...)"`` for a random fallback, with the reason."""

    config: dict[str, Any]
    value: float
    seconds: float
    source: str = ""
    requested: dict[str, Any] | None = None


class Evaluation(float):
    """What an objective may return instead of a plain float: the value (it *is* that float, so direct
    callers can compare and format it) and ``config``, the configuration actually run (recorded in the
    history, so ``best_config`` is what produced ``best_value``)."""

    config: dict[str, Any] | None

    def __new__(cls, value: float, config: Mapping[str, Any] | None = None) -> Evaluation:
        obj = super().__new__(cls, value)
        obj.config = None if config is None else dict(config)
        return obj

    def __repr__(self) -> str:
        return f"Evaluation({float(self)!r}, config={self.config!r})"


_FORMAT = "gpfalkon.tuning/2"
_ENUMERATE = 100_000  # finite spaces up to this size are enumerated when random draws keep repeating


def _load_state(path: pathlib.Path) -> dict[str, Any]:
    """The search state saved at ``path``; a file that is not a saved search raises ``ValueError``
    naming ``history_path`` (it is never overwritten silently). Files from before ``_FORMAT`` hold
    only ``history``."""
    try:
        data = json.loads(path.read_text())
        trials = [Trial(**t) for t in data["history"]]
        for t in trials:
            if not isinstance(t.config, dict):
                raise TypeError("a trial's config is not a mapping")
            t.value, t.seconds = float(t.value), float(t.seconds)
        pending = [(dict(p["config"]), str(p["source"])) for p in data.get("pending", [])]
        rng = data.get("rng_state")
        if rng is not None and not isinstance(rng, str):
            raise TypeError("rng_state is not a string")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"history_path {str(path)!r} is not a search history saved by gpfalkon.tuning "
            f"({type(exc).__name__}: {exc}); move it away or pass another history_path"
        ) from exc
    return dict(history=trials, pending=pending, rng_state=rng)


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

    def best_at_time(self) -> list[tuple[float, float]]:
        """``(cumulative seconds, best value)`` after each evaluation (NaN costs count as 0)."""
        t, out = 0.0, []
        for s, b in zip(self.history, self.best_so_far(), strict=True):
            t += s.seconds if math.isfinite(s.seconds) else 0.0
            out.append((t, b))
        return out


Objective = Callable[..., "float | Evaluation"]


class _Search(abc.ABC):
    """Propose (``suggest``), evaluate anywhere, record (``observe``); ``run`` does all three in a loop.

    State (history, pending suggestions, the random generator's state) is saved as JSON at
    ``history_path`` after every ``suggest`` and ``observe`` and resumed from it, so a resumed search
    continues its random stream and never repeats a configuration it has evaluated or suggested.
    """

    source = "search"

    def __init__(
        self,
        space: SearchSpace | Mapping[str, Dimension],
        objective: Objective | None = None,
        budget: int | None = None,
        seed: int = 0,
        *,
        history_path: str | pathlib.Path | None = None,
        verbose: bool = False,
    ) -> None:
        self.space = space if isinstance(space, SearchSpace) else SearchSpace(space)
        if objective is not None and not callable(objective):
            raise TypeError("objective must be callable: objective(config, *data) -> float (or None for "
                            "suggest / observe only)")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {seed!r}")
        seed = int(seed)
        self.objective: Objective | None = objective
        self.budget: int | None = budget
        self.seed: int = seed
        self.generator: torch.Generator = torch.Generator().manual_seed(seed)
        self.history_path: pathlib.Path | None = None if history_path is None else pathlib.Path(history_path)
        self.verbose: bool = bool(verbose)
        self.history: list[Trial] = []
        self.pending: list[tuple[dict[str, Any], str]] = []  # suggested, not yet observed
        if self.history_path is not None and self.history_path.exists():
            state = _load_state(self.history_path)
            try:
                for t in state["history"]:
                    t.config = self.space.check(t.config, "a saved trial's config", in_bounds=False)
                    if t.requested is not None:
                        t.requested = self.space.check(t.requested, "a saved trial's requested config")
                pending = [(self.space.check(c, "a saved pending config"), s) for c, s in state["pending"]]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"history_path {str(self.history_path)!r} holds a search over another space: "
                                 f"{exc}") from exc
            self.history, self.pending = state["history"], pending
            if state["rng_state"] is not None:
                raw = base64.b64decode(state["rng_state"])
                self.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            else:  # a file from before the generator was saved: another stream (repeats are refused anyway)
                self.generator.manual_seed(seed * 1_000_003 + len(self.history) + 1)

    # ------------------------------------------------------------ bookkeeping
    def _taken(self) -> set[tuple]:
        keys = {self.space.key(t.config) for t in self.history}
        keys |= {self.space.key(t.requested) for t in self.history if t.requested is not None}
        keys |= {self.space.key(c) for c, _ in self.pending}
        return keys

    def _random_unseen(self, taken: set[tuple], tries: int = 1000) -> dict[str, Any] | None:
        """A random configuration not in ``taken`` (``None`` when the space is exhausted): rejection
        sampling from :meth:`SearchSpace.sample`; a finite space of at most ``_ENUMERATE`` configurations
        where that fails is enumerated and an unseen one drawn uniformly."""
        for _ in range(tries):
            c = self.space.sample(1, self.generator)[0]
            if self.space.key(c) not in taken:
                return c
        if self.space.size() > _ENUMERATE:
            return None
        axes: list[Sequence[Any]] = []
        for d in self.space.dims.values():
            if isinstance(d, Categorical):
                axes.append(d.choices)
            elif isinstance(d, Integer):
                axes.append(range(d.low, d.high + 1))
            else:  # a continuous dimension: the space is infinite, not enumerated (checked above)
                return None
        unseen = [combo for combo in itertools.product(*axes) if tuple(combo) not in taken]
        if not unseen:
            return None
        pick = int(torch.randint(len(unseen), (1,), generator=self.generator))
        return dict(zip(self.space.names, unseen[pick], strict=True))

    def _random_batch(self, n: int, taken: set[tuple], source: str) -> list[tuple[dict[str, Any], str]]:
        """Up to ``n`` random unseen configurations labelled ``source`` (fewer when the space runs out);
        each is added to ``taken``."""
        out: list[tuple[dict[str, Any], str]] = []
        for _ in range(n):
            c = self._random_unseen(taken)
            if c is None:
                break
            taken.add(self.space.key(c))
            out.append((c, source))
        return out

    def _save(self) -> None:
        if self.history_path is None:
            return
        state = {
            "format": _FORMAT,
            "search": type(self).__name__,
            "history": [asdict(t) for t in self.history],
            "pending": [{"config": c, "source": s} for c, s in self.pending],
            "rng_state": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii"),
        }
        self.history_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.history_path.with_name(self.history_path.name + ".tmp")
        tmp.write_text(json.dumps(state, default=str))
        tmp.replace(self.history_path)  # atomic: a crash mid-write never leaves a truncated history

    @abc.abstractmethod
    def _propose(self, q: int, taken: set[tuple]) -> list[tuple[dict[str, Any], str]]:
        """Up to ``q`` new ``(config, source)`` pairs, none in ``taken``."""

    # ------------------------------------------------------------ ask / tell
    def suggest(self, q: int = 1) -> list[dict[str, Any]]:
        """``q`` configurations to evaluate next (fewer when the space is exhausted), none evaluated or
        pending before. They stay pending (and are saved) until :meth:`observe` is called with them."""
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"q must be a positive int, got {q!r}")
        new = self._propose(q, self._taken())
        self.pending.extend(new)
        self._save()
        return [dict(c) for c, _ in new]

    def observe(self, config: Mapping[str, Any], value: float | Evaluation, cost: float | None = None) -> Trial:
        """Record that ``config`` (a suggestion, or any configuration of the space: source ``"user"``)
        gave ``value`` at ``cost`` seconds (or any positive cost unit; ``None``: unknown). ``value`` may be
        an :class:`Evaluation` naming the configuration actually run. Non-finite values are recorded as
        ``inf`` (a failed evaluation)."""
        cfg = self.space.check(config, "config")
        ran = value.config if isinstance(value, Evaluation) else None
        value = _as_value(value)
        if cost is not None and (not _is_real(cost) or cost < 0):
            raise ValueError(f"cost must be a finite number >= 0 (seconds) or None, got {cost!r}")
        run_cfg = cfg if ran is None else self.space.check(ran, "the objective's Evaluation.config", in_bounds=False)
        key = self.space.key(cfg)
        idx = next((i for i, (c, _) in enumerate(self.pending) if self.space.key(c) == key), None)
        source = self.pending.pop(idx)[1] if idx is not None else "user"
        trial = Trial(config=run_cfg, value=value if math.isfinite(value) else math.inf,
                      seconds=math.nan if cost is None else float(cost), source=source,
                      requested=cfg if self.space.key(run_cfg) != key else None)
        self.history.append(trial)
        self._save()
        return trial

    def result(self) -> SearchResult:
        """The best trial so far and the history (``ValueError`` before any observation)."""
        if not self.history:
            raise ValueError("no configuration has been observed yet")
        best = min(self.history, key=lambda t: t.value)
        return SearchResult(best_config=dict(best.config), best_value=best.value, history=list(self.history))

    # ------------------------------------------------------------ the loop
    def run(self, *data: Any, time_budget: float | None = None) -> SearchResult:
        """Evaluate ``objective(config, *data)`` until ``budget`` evaluations (counting resumed ones) are
        done, or no new evaluation starts after ``time_budget`` seconds of this call (suggestion time
        included): first the pending suggestions of a resumed search, then new ones, one at a time."""
        if self.objective is None or self.budget is None:
            raise ValueError("run() needs the objective and budget arguments; without them use suggest() / "
                             "observe()")
        if time_budget is not None and (not _is_real(time_budget) or time_budget <= 0):
            raise ValueError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
        t_start = time.perf_counter()
        todo = self.budget - len(self.history)
        bar = None
        if self.verbose and todo > 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=todo, desc=type(self).__name__)
        try:
            while len(self.history) < self.budget:
                if time_budget is not None and time.perf_counter() - t_start >= time_budget:
                    break
                if self.pending:
                    config = dict(self.pending[0][0])
                else:
                    batch = self.suggest(1)
                    if not batch:
                        size = self.space.size()
                        what = (f"every one of the space's {size:g} configurations has been evaluated"
                                if math.isfinite(size) and size <= _ENUMERATE and not isinstance(self, GridSearch)
                                else "no configuration left to propose (the grid is done, or 1000 random draws all "
                                     "repeated evaluated ones)")
                        warn_caller(f"{type(self).__name__}: {what}; stopping at {len(self.history)}",
                                      RuntimeWarning)
                        break
                    config = batch[0]
                t0 = time.perf_counter()
                value = self.objective(config, *data)
                secs = time.perf_counter() - t0
                self.observe(config, value, cost=secs)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(best=f"{min(t.value for t in self.history):.4g}")
        finally:
            if bar is not None:
                bar.close()
        bad = sum(not math.isfinite(t.value) for t in self.history)
        if bad:
            warn_caller(
                f"{type(self).__name__}: {bad} of {len(self.history)} evaluations returned a non-finite value "
                "(recorded as inf)" + ("; none succeeded, so best_config is not a result: check the objective"
                                       if bad == len(self.history) else ""),
                RuntimeWarning,
            )
        return self.result()


class RandomSearch(_Search):
    """Configurations drawn at random (see :meth:`SearchSpace.sample`), never one already evaluated or
    pending."""

    source = "random"

    def _propose(self, q: int, taken: set[tuple]) -> list[tuple[dict[str, Any], str]]:
        return self._random_batch(q, taken, "random")


class GridSearch(_Search):
    """A full-factorial grid of at most ``budget`` points (:meth:`SearchSpace.grid`), in order, skipping
    points already evaluated or pending."""

    source = "grid"

    def __init__(self, space, objective=None, budget: int | None = None, seed: int = 0, **kwargs) -> None:
        if budget is None:
            raise ValueError("GridSearch needs budget: the grid has at most budget points")
        super().__init__(space, objective, budget, seed, **kwargs)
        self._grid = self.space.grid(budget)
        self.budget = min(budget, len(self._grid))

    def _propose(self, q: int, taken: set[tuple]) -> list[tuple[dict[str, Any], str]]:
        out: list[tuple[dict[str, Any], str]] = []
        for c in self._grid:
            if len(out) == q:
                break
            if self.space.key(c) not in taken:
                taken.add(self.space.key(c))
                out.append((dict(c), "grid"))
        return out


class BoTorchSearch(_Search):
    """Bayesian optimisation of the objective over a mixed space with BoTorch.

    ``n_initial`` random configurations (default ``max(5, 2 * dims)``), then candidates maximising
    ``LogExpectedImprovement`` of a ``MixedSingleTaskGP`` fitted to ``-objective`` (optionally
    ``log``-transformed, ``log_objective=True`` for positive errors) by
    ``optimize_acqf_mixed_alternating``. ``suggest(q)`` with ``q > 1``, or with suggestions still
    pending, uses ``qLogExpectedImprovement`` with the pending points as ``X_pending`` (BoTorch's
    sequential greedy batch), so parallel workers get distinct, jointly useful points.
    ``cost_aware=True`` fits a second GP to ``log(cost)`` and maximises ``log EI - log(predicted
    batch cost)`` (improvement per second). A candidate equal to an evaluated or pending
    configuration is replaced by a random unseen one (source ``"random (repeated candidate)"``).
    ``timings`` accumulates the seconds spent fitting the surrogate(s) and optimising the acquisition;
    ``warm_start`` (default) starts each surrogate fit from the previous one's hyperparameters.
    """

    source = "botorch"

    def __init__(
        self,
        space,
        objective=None,
        budget: int | None = None,
        seed: int = 0,
        *,
        n_initial: int | None = None,
        cost_aware: bool = False,
        log_objective: bool = True,
        num_restarts: int = 4,
        raw_samples: int = 128,
        acqf_options: Mapping[str, Any] | None = None,
        warm_start: bool = True,
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
        self.acqf_options = dict(acqf_options or {})
        self.warm_start = bool(warm_start)
        self._gp_states: dict[str, dict[str, Tensor]] = {}
        self.timings: dict[str, float] = {"fit_gp": 0.0, "optimize_acqf": 0.0}

    def _free(self) -> tuple[SearchSpace, dict[str, Any]]:
        """The dimensions with more than one value (the space BoTorch models and searches) and the values of the
        others (an ``Integer(3, 3)``, a one-choice ``Categorical``: constant columns, which ``Normalize`` would
        divide by a zero range and the mixed optimiser cannot draw from)."""
        free = {k: d for k, d in self.space.dims.items() if d.size() > 1}
        fixed = {k: d.choices[0] if isinstance(d, Categorical) else d.low
                 for k, d in self.space.dims.items() if k not in free}
        return SearchSpace(free), fixed

    def _fit_gp(self, X: Tensor, Y: Tensor, role: str = "value", space: SearchSpace | None = None):
        """A (mixed) GP on ``(X, Y)``, its hyperparameters fitted by ``fit_gpytorch_mll`` from the last fit's
        for the same ``role`` when ``warm_start`` (one new point moves the optimum a little: far fewer
        L-BFGS iterations than from the defaults). The outcome / input transforms are the new data's."""
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import MixedSingleTaskGP, SingleTaskGP
        from botorch.models.transforms.input import Normalize
        from gpytorch.mlls import ExactMarginalLogLikelihood

        space = self.space if space is None else space
        cat = sorted(space.cat_dims())
        num = [i for i in range(X.shape[-1]) if i not in cat]
        bounds = space.bounds()
        tf = Normalize(d=X.shape[-1], indices=num, bounds=bounds[:, num]) if num else None
        if cat:
            model = MixedSingleTaskGP(X, Y, cat_dims=cat, input_transform=tf)
        else:
            model = SingleTaskGP(X, Y, input_transform=tf)
        prev = self._gp_states.get(role) if self.warm_start else None
        if prev is not None:  # same space, same model structure: the parameters load as they are
            model.load_state_dict(prev, strict=False)
        fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
        self._gp_states[role] = {k: v.detach().clone() for k, v in model.state_dict().items()
                                 if not k.startswith(("outcome_transform", "input_transform"))}
        return model

    def _propose(self, q: int, taken: set[tuple]) -> list[tuple[dict[str, Any], str]]:
        n_random = min(q, max(0, self.n_initial - len(self.history) - len(self.pending)))
        out = self._random_batch(n_random, taken, "random")
        rest = q - n_random
        if rest == 0 or len(out) < n_random:  # done, or the space ran out
            return out
        ok = [t for t in self.history if math.isfinite(t.value)]
        if len(ok) < 2:  # nothing (or one point) to fit a GP to: non-finite values were recorded as inf
            return out + self._random_batch(rest, taken, "random (fewer than 2 finite values to fit a GP)")
        pending = [c for c, _ in self.pending] + [c for c, _ in out]
        for c in self._candidates(ok, pending, rest):
            source = "botorch"
            if self.space.key(c) in taken:
                c2 = self._random_unseen(taken)
                if c2 is None:
                    continue
                c, source = c2, "random (repeated candidate)"
            taken.add(self.space.key(c))
            out.append((c, source))
        return out

    def _candidates(self, ok: list[Trial], pending: list[dict[str, Any]], q: int) -> list[dict[str, Any]]:
        from botorch.acquisition import LogExpectedImprovement, qLogExpectedImprovement
        from botorch.acquisition.acquisition import AcquisitionFunction
        from botorch.optim.optimize_mixed import optimize_acqf_mixed_alternating

        if all(d.size() <= 1 for d in self.space.dims.values()):
            return []  # one configuration in all: nothing to model (the random draws cover it)
        space, fixed = self._free()
        t0 = time.perf_counter()
        X = torch.stack([space.encode(t.config) for t in ok])
        vals = torch.tensor([t.value for t in ok], dtype=torch.float64)
        if self.log_objective and bool((vals > 0).all()):
            vals = vals.log()
        Y = (-vals).unsqueeze(-1)
        # BoTorch's fitting restarts and its optimiser's raw samples draw from the global RNG: seed
        # it from this search's generator inside fork_rng, leaving the caller's RNG untouched
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = self._fit_gp(X, Y, space=space)
            X_pending = torch.stack([space.encode(c) for c in pending]) if pending else None
            acqf: AcquisitionFunction
            if X_pending is None and q == 1:
                acqf = LogExpectedImprovement(model, best_f=Y.max())
            else:
                acqf = qLogExpectedImprovement(model, best_f=Y.max(), X_pending=X_pending)
            if self.cost_aware:
                costed = [t for t in ok if math.isfinite(t.seconds)]
                if len(costed) >= 2:
                    cost_model = self._fit_gp(
                        torch.stack([space.encode(t.config) for t in costed]),
                        torch.tensor([[math.log(max(t.seconds, 1e-6))] for t in costed], dtype=torch.float64),
                        role="cost", space=space,
                    )
                    # duck-typed: the optimiser only calls it on X and reads .model / .X_pending
                    acqf = cast(AcquisitionFunction, _LogEIPerCost(acqf, cost_model))
            self.timings["fit_gp"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            cand, _ = optimize_acqf_mixed_alternating(
                acqf,
                bounds=space.bounds(),
                discrete_dims=space.discrete_dims() or None,
                cat_dims=space.cat_dims() or None,
                q=q,
                num_restarts=self.num_restarts,
                raw_samples=self.raw_samples,
                options=dict(self.acqf_options) or None,  # BoTorch fills in defaults in place
            )
            self.timings["optimize_acqf"] += time.perf_counter() - t1
        names = self.space.names
        return [{k: {**fixed, **space.decode(row)}[k] for k in names} for row in cand.reshape(-1, len(space))]


class _LogEIPerCost(torch.nn.Module):
    """``log EI(X) - log(sum_j exp(E[log cost](x_j)))``: expected improvement per unit of the batch's
    predicted total cost (one point: per second of that point). Duck-typed for BoTorch's optimiser,
    which calls it on ``X`` and reads ``model`` and ``X_pending`` / ``set_X_pending`` (delegated to the
    wrapped acquisition, so the sequential batch conditions on the points already chosen)."""

    def __init__(self, log_ei: Any, cost_model: Any) -> None:
        super().__init__()
        self.log_ei = log_ei
        self.cost_model = cost_model
        self.model = log_ei.model  # for BoTorch utilities that inspect acqf.model

    @property
    def X_pending(self) -> Tensor | None:
        return getattr(self.log_ei, "X_pending", None)

    def set_X_pending(self, X_pending: Tensor | None = None) -> None:
        self.log_ei.set_X_pending(X_pending)

    def forward(self, X: Tensor) -> Tensor:
        log_cost = self.cost_model.posterior(X).mean.squeeze(-1)  # (b, q)
        return self.log_ei(X) - torch.logsumexp(log_cost, dim=-1)


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


#: the configuration keys :func:`falkon_validation_error` and :func:`gradient_tuned_error` read
CONFIG_KEYS = ("num_centers", "kernel", "penalty", "center_selection", "lengthscale_factor")


def _config_model(config: Mapping[str, Any], train_x: Tensor, train_y: Tensor, max_iter: int, seed: int, **kw):
    from .heuristics import median_lengthscale
    from .models import FalkonGP

    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:  # a misspelt key would run the default and make its dimension of the search one with no effect
        raise ValueError(f"the configuration has keys {unknown} this objective does not read; it reads "
                         f"{list(CONFIG_KEYS)}")

    selection = config.get("center_selection", "uniform")
    if selection not in ("uniform", "leverage"):
        raise ValueError(f"center_selection={selection!r}: must be 'uniform' or 'leverage'")
    ls = float(median_lengthscale(train_x)) * float(config.get("lengthscale_factor", 1.0))
    kernel = make_kernel(config.get("kernel", "rbf"), ls).to(train_x)
    m = min(int(config.get("num_centers", 1000)), train_x.shape[0])  # the caller records the cap
    return FalkonGP(train_x, train_y, kernel=kernel, num_centers=m, penalty=float(config.get("penalty", 1e-6)),
                    max_iter=max_iter, tol=0.0, seed=seed, center_selection=selection, **kw)


def _result(config: Mapping[str, Any], n: int, value: float) -> float | Evaluation:
    """``value``, or an :class:`Evaluation` with ``num_centers`` capped at the ``n`` training rows when
    ``config`` asked for more (what ran; leverage-score selection may keep fewer *distinct* centers
    than it draws, but asking again for the same number draws the same way)."""
    if "num_centers" in config and int(config["num_centers"]) > n:
        return Evaluation(value, dict(config, num_centers=n))
    return value


def _rmse(model: Any, val_x: Tensor, val_y: Tensor) -> float:
    """Validation RMSE of ``model`` at ``(val_x, val_y)``; ``val_y`` of shape ``(q, 1)`` is taken as the
    ``(q,)`` of a one-output model. Raises ``ValueError`` where ``val_y``'s shape is not the prediction's
    (a ``(q,)`` against ``(q, 1)`` difference would otherwise broadcast to ``q x q``)."""
    model.eval()
    pred = model.posterior_mean(val_x)  # no process-wide GPyTorch flag toggled
    if val_y.shape != pred.shape:
        if val_y.dim() == 2 and val_y.shape[-1] == 1 and pred.dim() == 1 and val_y.shape[0] == pred.shape[0]:
            val_y = val_y.squeeze(-1)
        else:
            raise ValueError(f"val_y has shape {tuple(val_y.shape)}, but the model predicts shape {tuple(pred.shape)} "
                             f"at val_x ({val_x.shape[0]} rows, the outputs of train_y)")
    return float(((pred - val_y) ** 2).mean().sqrt())


def falkon_validation_error(max_iter: int = 20, seed: int = 0) -> Objective:
    """Objective ``(config, train_x, train_y, val_x, val_y) -> validation RMSE`` of a
    FalkonGP fitted with the configuration's ``num_centers``, ``kernel``, ``penalty``,
    ``center_selection`` and ``lengthscale_factor`` (x the median heuristic). ``num_centers``
    above the number of rows runs with all rows as centers and returns an :class:`Evaluation`
    saying so (the search records the configuration that ran)."""

    def objective(config, train_x, train_y, val_x, val_y) -> float | Evaluation:
        model = _config_model(config, train_x, train_y, max_iter, seed)
        model.fit()
        return _result(config, train_x.shape[0], _rmse(model, val_x, val_y))

    return objective


def gradient_tuned_error(objective: str = "NystromCompReg", steps: int = 30, lr: float = 0.05,
                         max_iter: int = 20, seed: int = 0) -> Objective:
    """Inner gradient loop, outer discrete search: the configuration fixes the discrete
    choices and the initial values; ``steps`` Adam steps on ``gpfalkon.objectives.<objective>``
    learn the kernel parameters, lambda and the centers; returns the validation RMSE."""
    from . import objectives as O

    cls = getattr(O, objective)

    def run(config, train_x, train_y, val_x, val_y) -> float | Evaluation:
        model = _config_model(config, train_x, train_y, max_iter, seed, learn_centers=True)
        cls(model).minimize(steps, lr=lr)
        model.fit()
        return _result(config, train_x.shape[0], _rmse(model, val_x, val_y))

    return run
