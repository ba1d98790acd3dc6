"""Plots of what a fit, a training loop, a prediction and a comparison produced (matplotlib, optional).

Every function draws on ``ax`` (a new figure's axes when ``None``) and returns the axes, so plots
compose with the caller's figures; matplotlib is imported on the first call, and its absence is a
clear ``ImportError`` (``pip install matplotlib``), never a failure at ``import gpfalkon``.

- :func:`plot_cg_convergence`: CG's relative residual per iteration from ``model.fit_info``
  (:class:`~gpfalkon.solvers.CGInfo`), one line per right-hand side, and the tolerance.
- :func:`plot_trajectories`: objective values and hyperparameters per step of a training loop
  (what :class:`TrajectoryRecorder` records, or any ``name -> list of numbers``).
- :func:`plot_predictions`: predicted against observed with ``+- z`` standard-deviation bars.
- :func:`plot_comparison`: test error against wall time per method (the time-to-error curves of
  ``benchmarks/compare.py``: a line per method's curve, a marker at its final model).

Written here because neither GPyTorch nor BoTorch ships plotting helpers for these records.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TrajectoryRecorder", "plot_cg_convergence", "plot_comparison", "plot_predictions", "plot_trajectories"]


def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("gpfalkon.plot needs matplotlib: pip install matplotlib") from exc
    return plt.subplots(figsize=(6, 4))[1]


def _numbers(name: str, values: Any) -> list[float]:
    if isinstance(values, (str, bytes)):  # iterable, but character by character
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    if isinstance(values, Tensor):
        values = values.detach().reshape(-1).tolist()
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}") from exc
    return out


def plot_cg_convergence(info: Any, ax: Any = None, label: str | None = None) -> Any:
    """CG's relative residual ``||r_i|| / ||b||`` against the iteration ``i`` (log scale), one line
    per column of the right-hand side, and the tolerance as a dashed line.

    Args:
        info: a :class:`~gpfalkon.solvers.CGInfo` (``model.fit_info`` after ``fit()``), or a model
            with one.
    """
    if hasattr(info, "fit_info"):
        if info.fit_info is None:
            raise ValueError("the model has no fit_info: call fit() first")
        info = info.fit_info
    res = getattr(info, "residuals", None)
    if not isinstance(res, Tensor):
        raise TypeError(f"info must be a CGInfo (model.fit_info) or a fitted model, got {type(info).__name__}")
    if getattr(info, "extra", {}).get("method") == "direct":
        raise ValueError("this fit used the direct solve (solve_method='auto' chose it): there is no CG history; "
                         "fit with FalkonOptions(solve_method='cg') to plot one")
    res = res.detach().to(torch.float64).cpu()
    res = res.reshape(res.shape[0], -1)
    ax = _axes(ax)
    it = list(range(res.shape[0]))
    for j in range(res.shape[1]):
        name = label if res.shape[1] == 1 else f"{label or 'column'} {j}"
        ax.semilogy(it, res[:, j].clamp_min(1e-300).tolist(), marker=".", label=name)
    tol = float(getattr(info, "tol", 0.0) or 0.0)
    if tol > 0:
        ax.axhline(tol, color="gray", linestyle="--", linewidth=1, label=f"tol {tol:g}")
    ax.set_xlabel("CG iteration")
    ax.set_ylabel("relative residual")
    ax.set_title(f"CG: {info.iterations} iterations, " + ("converged" if info.converged else "not converged"))
    ax.legend(fontsize="small")
    return ax


class TrajectoryRecorder:
    """Records, per step of a training loop, the objective value and every (constrained) scalar or
    vector hyperparameter of a module: ``recorder.record(loss)`` after each step; ``values`` is
    ``name -> list`` (vectors as one entry per element, ``name[i]``), ready for
    :func:`plot_trajectories`.

    .. code-block:: python

        rec = TrajectoryRecorder(model)            # a FalkonGP, or any gpytorch Module
        for _ in range(50):
            opt.zero_grad(); loss = objective(); loss.backward(); opt.step()
            rec.record(loss)
        gpfalkon.plot.plot_trajectories(rec.values)

    Hyperparameters are read through GPyTorch's ``named_hyperparameters`` and their constraints
    (``lengthscale``, ``outputscale``, ``noise`` as the model uses them, not the raw values);
    parameters with more than ``max_elements`` entries (e.g. centers) are left out.
    """

    def __init__(self, module: torch.nn.Module, max_elements: int = 16) -> None:
        self.module = module
        self.max_elements = int(max_elements)
        self.values: dict[str, list[float]] = {"objective": []}

    def _constrained(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        named = getattr(self.module, "named_parameters_and_constraints", None)
        if named is None:
            return {n: p.detach() for n, p in self.module.named_parameters()}
        for name, p, constraint in named():
            value = p.detach() if constraint is None else constraint.transform(p.detach())
            out[name.replace("raw_", "")] = value
        return out

    def record(self, objective: float | Tensor) -> None:
        self.values["objective"].append(float(objective.detach() if isinstance(objective, Tensor) else objective))
        step = len(self.values["objective"]) - 1
        for name, v in self._constrained().items():
            flat = v.reshape(-1)
            if flat.numel() > self.max_elements:
                continue
            keys = [name] if flat.numel() == 1 else [f"{name}[{i}]" for i in range(flat.numel())]
            for k, x in zip(keys, flat.tolist(), strict=True):
                seq = self.values.setdefault(k, [math.nan] * step)
                seq.append(float(x))


def plot_trajectories(values: Mapping[str, Sequence[float]], ax: Any = None, log: bool = True,
                      names: Iterable[str] | None = None) -> Any:
    """One panel line per recorded quantity against the training step: the objective on ``ax``
    (linear scale), every other quantity on a second axis (log scale when ``log`` and positive).

    Args:
        values: ``name -> per-step values`` (:attr:`TrajectoryRecorder.values`, or your own).
        names: the quantities to draw besides ``"objective"`` (default: all).
    """
    if not isinstance(values, Mapping) or not values:
        raise ValueError("values must be a non-empty mapping name -> list of numbers")
    ax = _axes(ax)
    series = {k: _numbers(f"values[{k!r}]", v) for k, v in values.items()}
    keep = [k for k in series if k != "objective"] if names is None else list(names)
    unknown = [k for k in keep if k not in series]
    if unknown:
        raise ValueError(f"names: {unknown} were not recorded (recorded: {sorted(series)})")
    if "objective" in series:
        ax.plot(range(len(series["objective"])), series["objective"], color="black", label="objective")
        ax.set_ylabel("objective")
    ax.set_xlabel("step")
    if keep:
        ax2 = ax.twinx() if "objective" in series else ax
        for k in keep:
            ax2.plot(range(len(series[k])), series[k], label=k, linewidth=1)
        positive = all(v > 0 for k in keep for v in series[k] if not math.isnan(v))
        if log and positive:
            ax2.set_yscale("log")
        ax2.set_ylabel("hyperparameters")
        ax2.legend(fontsize="x-small", loc="upper right")
    ax.legend(fontsize="small", loc="upper left")
    return ax


def plot_predictions(observed: Any, mean: Any, variance: Any = None, ax: Any = None, z: float = 2.0,
                     max_points: int = 2000, seed: int = 0) -> Any:
    """Predicted mean against observed targets, with ``mean +- z sqrt(variance)`` bars (``z = 2``: about
    95 % under a Gaussian predictive), the line ``y = x``, and the RMSE and the bars' empirical
    coverage in the title. At most ``max_points`` points are drawn (a seeded random subset; the
    title's figures use all)."""
    if not (isinstance(z, numbers.Real) and not isinstance(z, bool) and math.isfinite(z) and z > 0):
        raise ValueError(f"z must be a finite number > 0 (the bars' half-width in standard deviations), got {z!r}")
    y = torch.as_tensor(_numbers("observed", observed), dtype=torch.float64)
    mu = torch.as_tensor(_numbers("mean", mean), dtype=torch.float64)
    if y.shape != mu.shape:
        raise ValueError(f"observed has {y.numel()} values but mean has {mu.numel()}")
    if y.numel() == 0:
        raise ValueError("observed and mean are empty: nothing to plot")
    for name, t in (("observed", y), ("mean", mu)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf")
    sd = None
    if variance is not None:
        var = torch.as_tensor(_numbers("variance", variance), dtype=torch.float64)
        if var.shape != y.shape:
            raise ValueError(f"variance has {var.numel()} values but observed has {y.numel()}")
        if not bool(torch.isfinite(var).all()):
            raise ValueError("variance contains NaN or Inf")
        if bool((var < 0).any()):
            raise ValueError("variance has negative entries")
        sd = var.sqrt()
    ax = _axes(ax)
    idx = torch.arange(y.numel())
    if y.numel() > max_points:
        idx = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))[:max_points]
    if sd is not None:
        ax.errorbar(y[idx].tolist(), mu[idx].tolist(), yerr=(z * sd[idx]).tolist(), fmt=".", markersize=3,
                    elinewidth=0.5, alpha=0.6, label=f"mean +- {z:g} sd")
    else:
        ax.plot(y[idx].tolist(), mu[idx].tolist(), ".", markersize=3, alpha=0.6, label="mean")
    lo, hi = float(torch.minimum(y.min(), mu.min())), float(torch.maximum(y.max(), mu.max()))
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1, label="y = x")
    title = f"RMSE {float((mu - y).square().mean().sqrt()):.4g}"
    if sd is not None:
        title += f", coverage of +-{z:g} sd: {float(((y - mu).abs() <= z * sd).double().mean()):.1%}"
    ax.set_title(title)
    ax.set_xlabel("observed")
    ax.set_ylabel("predicted")
    ax.legend(fontsize="small")
    return ax


def plot_comparison(results: Sequence[Mapping[str, Any]], ax: Any = None, log_time: bool = True) -> Any:
    """Test error against wall time, one colour per method: its ``curve`` (``[(seconds, error), ...]``,
    measured during training) as a line, its final model (``fit_s``, ``error``) as a marker. Who
    reaches an error first is read off along a horizontal line.

    Args:
        results: records with ``method``, ``fit_s`` and ``error`` and optionally ``curve`` (the rows
            of ``benchmarks/compare.py``'s ``.jsonl`` for one dataset).
    """
    if isinstance(results, Mapping) or isinstance(results, (str, bytes)):
        raise TypeError(f"results must be a sequence of records (dicts), got {type(results).__name__}")
    rows = list(results)
    if not rows:
        raise ValueError("results is empty")
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping):
            raise TypeError(f"results[{i}] must be a record (a dict), got {type(r).__name__}")
        missing = [k for k in ("method", "fit_s", "error") if k not in r or r[k] is None]
        if missing:
            raise ValueError(f"results[{i}] lacks {missing} (or has None there: a run that gave no error figure)")
        curve = r.get("curve") or []
        if isinstance(curve, (str, bytes)) or not all(
                isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) == 2 for p in curve):
            raise ValueError(f"results[{i}]['curve'] must be a list of (seconds, error) pairs")
    ax = _axes(ax)
    for r in rows:
        curve = r.get("curve") or []
        line = None
        if curve:
            ts = [float(p[0]) for p in curve]
            es = [float(p[1]) for p in curve]
            (line,) = ax.plot(ts, es, linewidth=1, alpha=0.8)
        kw = {"color": line.get_color()} if line is not None else {}
        ax.plot([float(r["fit_s"])], [float(r["error"])], marker="o", linestyle="none", label=str(r["method"]), **kw)
    if log_time:
        ax.set_xscale("log")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test error")
    ax.legend(fontsize="small")
    return ax
