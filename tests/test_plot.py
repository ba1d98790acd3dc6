"""gpfalkon.plot: the drawn data equal the records they come from (checked on the artists)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from gpfalkon import CGNotConvergedWarning, FalkonGP, FalkonOptions
from gpfalkon.objectives import GCV

from conftest import make_data

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gpfalkon import plot  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_cg_convergence_draws_the_residual_history():
    x, y = make_data(200, 2)
    with pytest.warns(CGNotConvergedWarning):  # 15 iterations do not reach 1e-10: the whole history is drawn
        model = FalkonGP(x, y, num_centers=30, penalty=1e-4, max_iter=15, tol=1e-10,
                         options=FalkonOptions(solve_method="cg")).fit()
    ax = plot.plot_cg_convergence(model)
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() != f"tol {1e-10:g}"]
    res = model.fit_info.residuals.reshape(-1).tolist()
    assert list(line.get_ydata()) == pytest.approx(res)
    assert list(line.get_xdata()) == list(range(len(res)))
    assert any(ln.get_label() == "tol 1e-10" for ln in ax.get_lines())
    with pytest.raises(ValueError, match="call fit"):
        plot.plot_cg_convergence(FalkonGP(x, y, num_centers=10))
    with pytest.raises(TypeError, match="CGInfo"):
        plot.plot_cg_convergence(object())
    direct = FalkonGP(x, y, num_centers=30, penalty=1e-4, options=FalkonOptions(solve_method="direct")).fit()
    with pytest.raises(ValueError, match="direct solve"):
        plot.plot_cg_convergence(direct)


def test_trajectory_recorder_follows_the_constrained_hyperparameters():
    x, y = make_data(200, 2)
    kernel = __import__("gpytorch").kernels.RBFKernel(ard_num_dims=2).double()
    model = FalkonGP(x, y, kernel=kernel, num_centers=20, penalty=1e-3)
    obj = GCV(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    rec = plot.TrajectoryRecorder(model)
    expected_ls, expected_noise = [], []
    for _ in range(4):
        opt.zero_grad()
        loss = obj()
        loss.backward()
        opt.step()
        rec.record(loss)
        expected_ls.append(model.kernel.lengthscale.detach().reshape(-1).tolist())
        expected_noise.append(float(model.noise.detach()))
    vals = rec.values
    assert len(vals["objective"]) == 4 and all(math.isfinite(v) for v in vals["objective"])
    ls_keys = sorted(k for k in vals if k.endswith("lengthscale[0]") or k.endswith("lengthscale[1]"))
    assert len(ls_keys) == 2
    for j, k in enumerate(ls_keys):
        assert vals[k] == pytest.approx([e[j] for e in expected_ls])
    noise_key = next(k for k in vals if k.endswith("noise"))
    assert vals[noise_key] == pytest.approx(expected_noise)
    assert not any("centers" in k for k in vals)  # 20 x 2 entries: above max_elements
    ax = plot.plot_trajectories(vals)
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx(vals["objective"])
    with pytest.raises(ValueError, match="were not recorded"):
        plot.plot_trajectories(vals, names=["nope"])
    with pytest.raises(TypeError, match="sequence of numbers"):
        plot.plot_trajectories({"objective": ["a"]})


def test_predictions_title_has_the_rmse_and_coverage():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(500, generator=g, dtype=torch.float64)
    mean = y + 0.5 * torch.randn(500, generator=g, dtype=torch.float64)
    var = torch.full_like(y, 0.25)
    ax = plot.plot_predictions(y, mean, var, max_points=100)
    rmse = float((mean - y).square().mean().sqrt())
    cover = float(((y - mean).abs() <= 2 * 0.5).double().mean())
    assert f"RMSE {rmse:.4g}" in ax.get_title() and f"{cover:.1%}" in ax.get_title()
    with pytest.raises(ValueError, match="variance has negative"):
        plot.plot_predictions(y, mean, -var)
    with pytest.raises(ValueError, match="observed has 500 values but mean has 3"):
        plot.plot_predictions(y, mean[:3])
    with pytest.raises(ValueError, match="observed and mean are empty"):
        plot.plot_predictions([], [])
    nan_var = var.clone()
    nan_var[7] = float("nan")
    with pytest.raises(ValueError, match="variance contains NaN or Inf"):  # a "coverage 0.0%" title otherwise
        plot.plot_predictions(y, mean, nan_var)
    with pytest.raises(ValueError, match="mean contains NaN or Inf"):
        plot.plot_predictions(y, mean * float("inf"))


def test_comparison_draws_curves_and_final_points():
    rows = [dict(method="SGPR", fit_s=10.0, error=0.3, curve=[(1.0, 0.9), (5.0, 0.4), (10.0, 0.3)]),
            dict(method="FALKON", fit_s=2.0, error=0.25)]
    ax = plot.plot_comparison(rows)
    lines = ax.get_lines()
    assert list(lines[0].get_xdata()) == [1.0, 5.0, 10.0] and list(lines[0].get_ydata()) == [0.9, 0.4, 0.3]
    markers = {ln.get_label(): (ln.get_xdata()[0], ln.get_ydata()[0]) for ln in lines[1:]}
    assert markers == {"SGPR": (10.0, 0.3), "FALKON": (2.0, 0.25)}
    with pytest.raises(ValueError, match=r"results\[0\] lacks \['error'\]"):
        plot.plot_comparison([dict(method="a", fit_s=1.0)])
    with pytest.raises(ValueError, match=r"results\[0\] lacks \['error'\] \(or has None"):
        plot.plot_comparison([dict(method="a", fit_s=1.0, error=None)])


def test_a_missing_matplotlib_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_comparison([dict(method="a", fit_s=1.0, error=0.1)])


def test_the_plotting_example_writes_its_figures(tmp_path):
    """examples/plotting.py (run by the documentation build), small sizes."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "plotting.py"
    spec = importlib.util.spec_from_file_location("_plotting_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    res = module.make_figures(tmp_path, n=300, steps=3)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["cg.png", "predictions.png", "trajectory.png"]
    assert 0 < res["rmse"] < 1.0 and 0.5 < res["coverage"] <= 1.0


def test_plot_arguments_are_checked_by_name():
    """A bad ``z`` (NaN, inf, negative), a string as a sequence of numbers, and comparison records that are not
    records or whose curve is not (seconds, error) pairs raise errors naming them (they plotted wrong figures or
    failed inside matplotlib)."""
    from gpfalkon.plot import plot_comparison, plot_predictions, plot_trajectories

    obs, mean, var = [0.0, 1.0, 2.0], [0.1, 0.9, 2.2], [0.01, 0.02, 0.03]
    for z in (float("nan"), float("inf"), -2.0, 0.0):
        with pytest.raises(ValueError, match="z must be"):
            plot_predictions(obs, mean, var, z=z)
    with pytest.raises(TypeError, match="sequence of numbers"):
        plot_trajectories({"objective": "12"})
    ok = {"method": "a", "fit_s": 1.0, "error": 0.5}
    with pytest.raises(TypeError, match="sequence of records"):
        plot_comparison(ok)
    with pytest.raises(TypeError, match=r"results\[0\] must be a record"):
        plot_comparison([1, 2])
    with pytest.raises(ValueError, match="pairs"):
        plot_comparison([dict(ok, curve=[0.1, 0.5])])
