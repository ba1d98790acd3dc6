"""auto_fit (gpfalkon.auto) and FalkonGP's constant prior mean."""
from __future__ import annotations

import itertools
import math
import time
import warnings

import gpytorch
import pytest
import torch
from gpytorch.utils.warnings import GPInputWarning

from gpfalkon import FalkonGP, auto_fit
from gpfalkon.auto import calibration as auto_calibration
from gpfalkon.auto import costs as auto_costs
from gpfalkon.auto import final as auto_final
from gpfalkon.auto import final_check as auto_final_check
from gpfalkon.auto import fit as auto_fitting
from gpfalkon.auto import growth as auto_growth
from gpfalkon.auto import kernels as auto_kernels
from gpfalkon.auto import learn as auto_learn
from gpfalkon.auto import leverage as auto_leverage
from gpfalkon.auto import loo as auto_loo
from gpfalkon.auto import loo_stage as auto_loo_stage
from gpfalkon.auto import race as auto_race
from gpfalkon.auto import report as auto_reporting
from gpfalkon.auto import sampling as auto_sampling
from gpfalkon.auto import scoring as auto_scoring
from gpfalkon.auto import selection as auto_selection
from gpfalkon.auto import sizes as auto_sizes
from gpfalkon.auto import standardise as auto_standardise
from gpfalkon.objectives import GCV, SGPRBound

from conftest import DEVICES, dense_kernel, make_data

#: auto_fit's modules; each binds the names it reads (its own imports), so a test's stand-in goes into every one
AUTO_MODULES = (auto_calibration, auto_costs, auto_final, auto_final_check, auto_fitting, auto_growth, auto_kernels,
                auto_learn, auto_leverage, auto_loo, auto_loo_stage, auto_race, auto_reporting, auto_sampling,
                auto_scoring, auto_selection, auto_sizes, auto_standardise)


def patch_auto(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    """``monkeypatch.setattr`` of ``name`` in every :mod:`gpfalkon.auto` module that binds it (at least one)."""
    modules = [m for m in AUTO_MODULES if name in vars(m)]
    assert modules, f"no gpfalkon.auto module binds {name!r}"
    for module in modules:
        monkeypatch.setattr(module, name, value)


def _data(n: int = 500, seed: int = 0, noise: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, 3, generator=g, dtype=torch.float64) * 2 - 1
    f = torch.sin(3 * z[:, 0]) + 0.5 * torch.cos(2 * z[:, 1]) + 0.1 * z[:, 2]
    y = f + noise * torch.randn(n, generator=g, dtype=torch.float64)
    # raw units: features on very different scales and offsets, targets far from zero mean / unit scale
    x = z * torch.tensor([100.0, 0.01, 3.0], dtype=torch.float64) + torch.tensor([5e3, -2.0, 0.0], dtype=torch.float64)
    return x, 1000.0 + 50.0 * y, 1000.0 + 50.0 * f


# deterministic settings: every stop is by a count, never by the clock
SMALL = dict(budget=1e4, hyper_rows=300, hyper_centers=40, select_rows=400, min_centers=60, max_centers=120,
             max_steps=20, eval_every=5, dtype=torch.float64, seed=0, loo_rows=0)


# ------------------------------------------------------------------ constant mean
def _dense_alpha(model: FalkonGP, y_centered: torch.Tensor) -> torch.Tensor:
    x, c = model.train_inputs[0], model.centers
    knm = dense_kernel(model.kernel, x, c)
    kmm = dense_kernel(model.kernel, c, c)
    h = knm.T @ knm + model.n * model.penalty.detach() * kmm
    return torch.linalg.solve(h, knm.T @ y_centered)


def test_mean_constant_matches_dense_solve_and_shifts_prediction():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200, 3, generator=g, dtype=torch.float64) * 2 - 1
    y = 1000.0 + 50.0 * torch.sin(3 * x[:, 0]) + torch.randn(200, generator=g, dtype=torch.float64)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.base_kernel.lengthscale = 0.7
    k.outputscale = 2500.0
    m = FalkonGP(x, y, kernel=k, num_centers=40, penalty=1e-3, mean_constant=1000.0, tol=1e-12, max_iter=500).fit()
    alpha = _dense_alpha(m, y - 1000.0)
    torch.testing.assert_close(m.alpha, alpha, rtol=1e-6, atol=1e-8)
    m.eval()
    xs = x[:7] + 0.01
    with torch.no_grad():
        mean = m(xs).mean
    ref = 1000.0 + dense_kernel(k, xs, m.centers) @ alpha
    torch.testing.assert_close(mean, ref, rtol=1e-8, atol=1e-6)
    # the prior mean is the constant too
    m.train()
    with pytest.warns(GPInputWarning, match="train mode"):
        prior = m(xs)
    torch.testing.assert_close(prior.mean, torch.full((7,), 1000.0, dtype=torch.float64))


def test_mean_constant_objectives_see_centered_targets():
    x, y, _ = _data(150)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.base_kernel.lengthscale = 50.0
    a = FalkonGP(x, y, kernel=k, num_centers=30, penalty=1e-3, mean_constant=float(y.mean()))
    b = FalkonGP(x, y - y.mean(), kernel=k, centers=a.centers, penalty=1e-3)
    for obj in (SGPRBound, GCV):
        torch.testing.assert_close(obj(a)(), obj(b)(), rtol=1e-10, atol=1e-10)


def test_mean_constant_validation_state_dict_and_staleness():
    x, y, _ = _data(100)
    with pytest.raises(ValueError, match="mean_constant"):
        FalkonGP(x, y, num_centers=10, mean_constant=float("nan"))
    with pytest.raises(ValueError, match="mean_constant"):
        FalkonGP(x, torch.stack([y, y], -1), num_centers=10, mean_constant=torch.ones(3))
    m = FalkonGP(x, y, num_centers=10, penalty=1e-3, mean_constant=3.0).fit()
    sd = m.state_dict()
    fresh = FalkonGP(x, y, num_centers=10, penalty=1e-3)
    fresh.load_state_dict(sd)
    assert float(fresh.mean_constant) == 3.0
    fresh.eval()
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x[:5]).mean, m(x[:5]).mean)
    # a state dict from before the constant mean existed loads as zero mean
    old = {k: v for k, v in sd.items() if k != "mean_constant"}
    legacy = FalkonGP(x, y, num_centers=10, penalty=1e-3, mean_constant=7.0)
    legacy.load_state_dict(old)
    assert float(legacy.mean_constant) == 0.0
    # changing the constant after fit() makes the fit stale
    m.mean_constant.fill_(4.0)
    from gpfalkon import NotFittedError

    with pytest.raises(NotFittedError):
        m(x[:2])


def test_mean_constant_survives_dtype_moves_and_partial_loads():
    x, y, _ = _data(100)
    m = FalkonGP(x, y, num_centers=10, penalty=1e-3, mean_constant=1000.0 + 1e-5).fit()
    m.float()
    assert m.mean_constant.dtype == torch.float64 and float(m.mean_constant) == 1000.0 + 1e-5
    # strict=False with only kernel hyperparameters keeps the constant
    other = FalkonGP(x, y, num_centers=10, penalty=1e-3, mean_constant=5.0)
    kernel_only = {k: v for k, v in m.state_dict().items() if k.startswith("kernel.")}
    other.load_state_dict(kernel_only, strict=False)
    assert float(other.mean_constant) == 5.0


def test_mean_constant_multi_output():
    x, y, _ = _data(120)
    y2 = torch.stack([y, 2 * y], -1)
    c = torch.tensor([1000.0, 2000.0], dtype=torch.float64)
    m = FalkonGP(x, y2, num_centers=20, penalty=1e-3, mean_constant=c, tol=1e-12, max_iter=500).fit()
    ref = FalkonGP(x, y2 - c, kernel=m.kernel, centers=m.centers, penalty=1e-3, tol=1e-12, max_iter=500).fit()
    m.eval()
    ref.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        torch.testing.assert_close(m(x[:4]).mean, ref(x[:4]).mean + c, rtol=1e-8, atol=1e-6)


# ------------------------------------------------------------------------ auto_fit
@pytest.fixture(scope="module")
def fitted():
    x, y, _f = _data(500)
    xt, yt, ft = _data(300, seed=1)
    model = auto_fit(x, y, **SMALL)
    return model, (x, y), (xt, yt, ft)


def test_auto_fit_predicts_in_raw_units(fitted):
    model, _, (xt, _yt, ft) = fitted
    model.eval()
    with torch.no_grad():
        pred = model(xt)
    rmse_f = float((pred.mean - ft).square().mean().sqrt())
    # the signal has std ~ 50 * 0.7 and the noise std is 50 * 0.05 = 2.5
    assert rmse_f < 0.1 * float(ft.std()), rmse_f
    assert bool((pred.variance > 0).all())
    rep = model.auto_report
    assert rep.chosen["objective"] in ("initial", "sgpr", "gcv", "nystrom-compreg")
    assert rep.chosen["num_centers"] == model.centers.shape[0]
    assert rep.chosen["final_rows"] == 500  # held-out rows put back
    assert model.train_inputs[0].shape[0] == 500
    assert "auto_fit" in rep.summary()


def test_auto_fit_final_model_is_the_dense_nystrom_solution(fitted):
    """The returned model, with its reported hyperparameters, equals a dense direct Nystrom KRR solve."""
    model, _, (xt, _, _) = fitted
    y = model.train_targets
    alpha = _dense_alpha(model, y - model.mean_constant)
    pred_ref = model.mean_constant + dense_kernel(model.kernel, xt, model.centers) @ alpha
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt).mean
    scale = float(pred_ref.std())
    assert float((pred - pred_ref).abs().max()) < 1e-3 * scale
    # the noise is chosen for validation error (with few centers it may sit well below the data's), reported in
    # standardised units and carried to raw units by the targets' variance
    ch = model.auto_report.chosen
    assert math.isclose(float(model.noise.detach()), ch["noise"] * ch["y_scale"] ** 2 * ch["variance_scale"],
                        rel_tol=1e-6)
    assert math.isclose(float(model.penalty.detach()) * model.n, ch["noise_raw"], rel_tol=1e-6)
    # the validation RMSE (raw units) is near the data's noise std 50 * 0.05 = 2.5, never below half of it
    assert 1.25 < ch["val_rmse"] < 2.5 * 2, ch["val_rmse"]


def test_auto_fit_choices_are_the_validation_minimum(fitted):
    model, _, _ = fitted
    rep = model.auto_report
    best_learn = min(rep.learn, key=lambda r: r["best_error"])
    assert rep.chosen["objective"] == best_learn["objective"]
    assert (rep.chosen["racer"], rep.chosen["lr"]) == (best_learn["racer"], best_learn["lr"])
    assert math.isclose(rep.chosen["learn_error"], best_learn["best_error"])
    at_level = [r["error"] for r in rep.search if r["M"] == rep.chosen["num_centers"]]
    assert math.isclose(rep.chosen["val_error"], min(at_level))
    # the best level is the chosen one
    assert rep.chosen["val_error"] == min(lv["error"] for lv in rep.chosen["levels"])
    for rec in rep.learn[1:]:
        steps = [s for s, _, _ in rec["curve"]]
        assert steps == sorted(steps) and rec["steps"] <= SMALL["max_steps"]


@pytest.mark.parametrize("given_val, dtype", [(False, torch.float64), (True, torch.float64), (False, torch.float32)])
def test_auto_fit_calibrates_its_predictive_variances(given_val, dtype):
    """The noise chosen for the mean's validation error makes raw variances far too small here (the data's noise
    std is 2.5); the calibrated ones explain independent test residuals: mean(r^2 / v) near 1 (closed form of the
    best scale, docs/math.md §8), while the mean is that of the uncalibrated model."""
    x, y, _ = _data(500)
    xt, yt, _ = _data(400, seed=1)
    kw = dict(SMALL, dtype=dtype)
    if given_val:
        xv, yv, _ = _data(200, seed=2)
        kw.update(val_x=xv, val_y=yv)
    on = auto_fit(x, y, **kw)
    off = auto_fit(x, y, calibrate_variance=False, **kw)
    c = on.auto_report.chosen["variance_scale"]
    assert off.auto_report.chosen["variance_scale"] == 1.0
    assert "calibration" in on.auto_report.stages and "calibration" not in off.auto_report.stages
    assert not any("calibration" in note for note in on.auto_report.notes)
    on.eval()
    off.eval()
    with torch.no_grad():
        p_on, p_off = on.likelihood(on(xt)), off.likelihood(off(xt))
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(p_on.mean, p_off.mean, rtol=tol, atol=tol * float(p_off.mean.abs().max()))
    torch.testing.assert_close(p_on.variance, c * p_off.variance, rtol=10 * tol, atol=0.0)
    ratio_on = float(((yt - p_on.mean) ** 2 / p_on.variance).mean())
    ratio_off = float(((yt - p_off.mean) ** 2 / p_off.variance).mean())
    assert 0.5 < ratio_on < 2.0, (ratio_on, ratio_off, c)
    # calibration moves the ratio towards 1 unless the raw variances already explain the residuals (the chosen
    # noise depends on the host's rounding and speed: on one host the raw ratio was 1.009 and the calibrated 0.987)
    assert abs(math.log(ratio_on)) < max(abs(math.log(ratio_off)), math.log(1.1)), (ratio_on, ratio_off, c)
    # the returned model holds no builder (nor the factors it kept)
    assert on.options.preconditioner is None
    ch = on.auto_report.chosen
    assert math.isclose(ch["noise_raw"], float(on.noise.detach()), rel_tol=1e-12)
    assert "variance scale" in on.auto_report.summary()


def test_auto_fit_calibration_reads_the_final_fits_preconditioner_or_builds_it(monkeypatch):
    """CG keeps the final fit's preconditioner for the calibration; a direct solve builds none, and the
    calibration then builds the one CG would have used: the same scale either way (the residuals are the
    selection fit's, the variances the same model's through the same factors)."""
    from gpfalkon import FalkonOptions

    x, y, _ = _data(500)
    scales, kept = {}, {}
    real_call = auto_scoring._KeptPreconditioner.__call__
    for method in ("cg", "direct"):
        calls = []

        def spy(self, *args, _calls=calls, **kwargs):
            _calls.append(1)
            return real_call(self, *args, **kwargs)

        monkeypatch.setattr(auto_scoring._KeptPreconditioner, "__call__", spy)
        patch_auto(monkeypatch, "FalkonOptions",
                   lambda _m=method, **kw: FalkonOptions(solve_method=_m, **kw) if "preconditioner" in kw
                   and isinstance(kw["preconditioner"], auto_scoring._KeptPreconditioner)
                   else FalkonOptions(**kw))
        model = auto_fit(x, y, **SMALL)
        scales[method] = model.auto_report.chosen["variance_scale"]
        kept[method] = len(calls)
        assert model.fit_info.extra.get("method", "cg") == method
    assert kept["cg"] >= 1  # the final fit built it through the keeper
    assert scales["cg"] != 1.0 and math.isclose(scales["cg"], scales["direct"], rel_tol=1e-6), scales


def test_auto_fit_invariant_to_affine_rescaling():
    """Standardisation inside: an affine change of units of x (per feature) and y changes nothing
    but the units of the prediction (every stop is by count here, so the runs are deterministic)."""
    x, y, _ = _data(400, seed=3)
    xt, _, _ = _data(50, seed=4)
    a = torch.tensor([2.0, 1e3, 0.5], dtype=torch.float64)
    b = torch.tensor([-7.0, 3.0, 1e4], dtype=torch.float64)
    m1 = auto_fit(x, y, **SMALL)
    m2 = auto_fit(x * a + b, 0.01 * y - 4.0, **SMALL)
    for m in (m1, m2):
        m.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        p1 = m1(xt).mean
        p2 = m2(xt * a + b).mean
    torch.testing.assert_close(0.01 * p1 - 4.0, p2, rtol=1e-5, atol=1e-5 * float(p2.abs().max()))
    # variances scale by the square of the target scale (outputscale and noise both by r^2)
    with torch.no_grad():
        v1, v2 = m1(xt).variance, m2(xt * a + b).variance
    torch.testing.assert_close(1e-4 * v1, v2, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(1e-4 * m1.noise.detach(), m2.noise.detach(), rtol=1e-6, atol=0.0)
    assert m1.auto_report.chosen["objective"] == m2.auto_report.chosen["objective"]


def test_auto_fit_learning_grows_rows_and_centers_within_the_memory_budget():
    """Stage 1's progressive subsampling: each continuation doubles the rows and grows the centers as
    hyper_centers * sqrt(rows / hyper_rows) (never shrinking, never past hyper_entries // rows); stalled
    where doubling would exceed hyper_entries, the leader stops instead of running on."""
    x, y, _ = _data(1200, noise=0.5)
    # softplus lengthscales and Adam's own steps pinned: on this problem the leader then stalls on every
    # subsample up to the hyper_entries bound (with the defaults its last subsample ends by the "no gain over
    # fewer rows" rule instead, test_auto_fit_level_share_moves_the_leader_to_more_rows' subject; and
    # rescore_continuations, off here, ends it at the first continuation whose steps gain nothing on its rows)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=2000, objectives=("gcv", "sgpr"), race_rounds=2,
              hyper_entries=24_000, hyper_centers_growth=0.5, lengthscale_transform="softplus",
              lengthscale_step="adam", rescore_continuations=False)
    rep = auto_fit(x, y, **kw).auto_report
    leader = [r for r in rep.learn[1:] if r["objective"] == rep.learn[-1]["objective"]]  # the last record: the leader's
    assert len(leader) >= 3, [(r["rows"], r.get("stopped")) for r in rep.learn]
    for prev, cur in itertools.pairwise(leader):
        assert prev["stopped"].startswith(f"stalled; continued on {cur['rows']:,} rows")
        assert cur["rows"] == min(2 * prev["rows"], rep.n_train)
        want = min(max(prev["centers"], round(20 * math.sqrt(cur["rows"] / 100))), 24_000 // cur["rows"])
        assert cur["centers"] == want and cur["rows"] * cur["centers"] <= 24_000
    last = leader[-1]
    assert last["stopped"] == f"stalled on {last['rows']:,} rows, the most it may use"
    assert min(2 * last["rows"], rep.n_train) * last["centers"] > 24_000 or last["rows"] == rep.n_train


def test_auto_fit_level_share_moves_the_leader_to_more_rows():
    """With a tiny level_share every round after the race is past the leader's share of the time on its
    subsample: it goes on from its best point on twice the rows each round, up to all training rows, and
    is never pushed off the last subsample by the share (only a stall, patience or max_steps end it)."""
    x, y, _ = _data(1200, noise=0.5)
    # (rescore_continuations off: its stop, tested on its own below, would end the climb at the first continuation)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=200, objectives=("gcv", "sgpr"), race_rounds=2,
              level_share=1e-9, rescore_continuations=False)
    rep = auto_fit(x, y, **kw).auto_report
    leader = [r for r in rep.learn[1:] if r["objective"] == rep.learn[-1]["objective"]]  # the last record: the leader's
    rows = [r["rows"] for r in leader]
    want = [100]
    while want[-1] < rep.n_train:
        want.append(min(2 * want[-1], rep.n_train))
    # all the way up, unless a continuation found nothing better than the rows before it (that ends stage 1)
    assert rows == want[: len(rows)] and len(rows) >= 2, [(r["rows"], r["stopped"]) for r in rep.learn]
    if len(rows) < len(want):
        assert leader[-1]["stopped"].endswith("with no gain over fewer rows"), leader[-1]["stopped"]
    for prev, cur in itertools.pairwise(leader):
        assert prev["stopped"].endswith(f"continued on {cur['rows']:,} rows, {cur['centers']:,} centers")
        assert prev["stopped"].startswith(("stalled;", "level share (1e-09) used;")), prev["stopped"]
    assert leader[0]["stopped"].startswith("level share (1e-09) used;") or leader[0]["stopped"].startswith("stalled;")
    assert "continued" not in leader[-1]["stopped"] and "level share" not in leader[-1]["stopped"]
    # the continuations before the last ran one round each (eval_every steps) past the race
    assert all(r["steps"] == kw["eval_every"] for r in leader[1:-1] if r["stopped"].startswith("level share"))


def test_auto_fit_grid_extends_past_its_edge():
    """No learning (max_steps=0): noise starts at 0.1 (standardised) on nearly noise-free data, so the
    best noise lies several grid steps below: the 1-D grid must keep extending downwards."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(400, 2, generator=g, dtype=torch.float64)
    y = torch.sin(4 * x[:, 0]) + x[:, 1] ** 2  # no noise
    m = auto_fit(x, y, **dict(SMALL, max_steps=0, objectives=("sgpr",)))
    rep = m.auto_report
    first_m = rep.search[0]["M"]
    tried = sorted({r["noise"] for r in rep.search if r["M"] == first_m})
    below = [v for v in tried if v < 0.1 * (1 - 1e-9)]
    assert len(below) >= 3, tried  # 0.025, 0.00625, 0.0016, ...: the search kept extending past its edge
    assert rep.chosen["noise"] < 0.1 / 16


def test_auto_fit_given_validation_and_learned_centers():
    x, y, f = _data(400)
    xv, yv, _ = _data(100, seed=2)
    m = auto_fit(x, y, val_x=xv, val_y=yv, learn_centers=True, objectives=("sgpr",), **SMALL)
    rep = m.auto_report
    assert rep.chosen["final_rows"] == 400 and rep.n_val == 100 and rep.val_source == "given val_x / val_y"
    m.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        err = float((m(x).mean - f).square().mean().sqrt())
    assert err < 0.1 * float(f.std())


def test_auto_fit_user_kernel_and_float32_and_verbose():
    x, y, f = _data(300)
    k = gpytorch.kernels.RBFKernel(ard_num_dims=3)
    k.lengthscale = torch.tensor([[50.0, 0.005, 1.5]])
    m = auto_fit(x.float(), y.float(), kernel=k, verbose=True, **dict(SMALL, dtype=torch.float32, max_steps=10))
    assert m.train_inputs[0].dtype == torch.float32
    assert isinstance(m.kernel, gpytorch.kernels.ScaleKernel)  # wrapped to carry the target scale
    # GPyTorch's default Positive on a user's kernel is learned in log space by default (exp(0) = 1; other
    # constraints are kept: test_auto_fit_log_keeps_a_users_own_lengthscale_constraint)
    assert float(m.kernel.base_kernel.raw_lengthscale_constraint.transform(torch.zeros(()))) == pytest.approx(1.0)
    m.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        err = float((m(x.float()).mean.double() - f).square().mean().sqrt())
    assert err < 0.2 * float(f.std())


def test_log_lengthscales_keep_values_and_make_steps_relative():
    from gpfalkon.auto.kernels import KERNEL_FAMILIES, _log_lengthscales

    k = KERNEL_FAMILIES["matern32"](3).double()
    ls = torch.tensor([[0.3, 4.0, 50.0]], dtype=torch.float64)
    k.base_kernel.lengthscale = ls
    _log_lengthscales(k)
    torch.testing.assert_close(k.base_kernel.lengthscale.detach(), ls)
    # d log(l) / d raw = 1: one SGD step of size h on the raw parameter scales every lengthscale by exp(-h)
    opt = torch.optim.SGD([k.base_kernel.raw_lengthscale], lr=0.1)
    k.base_kernel.lengthscale.log().sum().backward()
    opt.step()
    torch.testing.assert_close(k.base_kernel.lengthscale.detach(), ls * math.exp(-0.1))


@pytest.mark.parametrize("transform", ["softplus", "log"])
@pytest.mark.parametrize("family", [True, False])
def test_auto_fit_lengthscale_transform_sets_the_constraint(transform, family):
    x, y, f = _data(300)
    kernel = "matern52"
    if not family:  # a user's kernel on the raw inputs: "softplus" keeps its own (GPyTorch's default) constraint
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).double()
        kernel.base_kernel.lengthscale = torch.tensor([[50.0, 0.005, 1.5]], dtype=torch.float64)
    m = auto_fit(x, y, kernel=kernel, lengthscale_transform=transform, **dict(SMALL, max_steps=5))
    c = m.kernel.base_kernel.raw_lengthscale_constraint
    # exp(0) = 1; GPyTorch's default softplus(0) = log 2
    expected = 1.0 if transform == "log" else math.log(2.0)
    assert float(c.transform(torch.zeros((), dtype=torch.float64))) == pytest.approx(expected)
    m.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        err = float((m(x).mean - f).square().mean().sqrt())
    assert err < 0.2 * float(f.std())


def test_auto_fit_log_keeps_a_users_own_lengthscale_constraint():
    """lengthscale_transform="log" replaces only GPyTorch's default Positive constraint: bounds a user chose
    (an Interval here) are kept, and the report says so."""
    x, y, _ = _data(300)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(
        ard_num_dims=3, lengthscale_constraint=gpytorch.constraints.Interval(0.05, 20.0))).double()
    kernel.base_kernel.lengthscale = torch.tensor([[3.0, 0.5, 1.5]], dtype=torch.float64)
    m = auto_fit(x, y, kernel=kernel, lengthscale_transform="log", **dict(SMALL, max_steps=5))
    c = m.kernel.base_kernel.raw_lengthscale_constraint
    assert isinstance(c, gpytorch.constraints.Interval)
    assert (c.lower_bound.item(), c.upper_bound.item()) == pytest.approx((0.05, 20.0))
    ls = m.kernel.base_kernel.lengthscale.detach()
    assert bool(((ls >= 0.05) & (ls <= 20.0)).all())
    assert any("kept the kernel's own lengthscale constraint on base_kernel" in n for n in m.auto_report.notes)


@pytest.mark.parametrize("step", ["shared", "adam"])
def test_auto_fit_lengthscale_step_names_the_shared_tensors(monkeypatch, step):
    """lengthscale_step="shared" (the default) hands each runner's lengthscale vector to Adam as shared (one
    denominator: tests/test_optim.py checks the update), "adam" hands none; nothing else is shared."""

    seen: list[tuple[int, int, bool]] = []
    real = auto_race.Adam

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, params, lr, shared=()):
            params, shared = list(params), list(shared)
            super().__init__(params, lr=lr, shared=shared)
            seen.append((len(params), len(shared), all(tuple(p.shape) == (1, 3) for p in shared)))

    patch_auto(monkeypatch, "Adam", Spy)
    x, y, _ = _data(300)
    kw = {} if step == "shared" else dict(lengthscale_step=step)
    auto_fit(x, y, **kw, **dict(SMALL, max_steps=5))
    assert seen, "no learning-stage optimiser was built"
    for n_params, n_shared, ard_shape in seen:
        assert n_params >= 3  # lengthscales, outputscale, noise (and the constant mean)
        assert n_shared == (1 if step == "shared" else 0) and ard_shape


def test_auto_fit_respects_a_small_budget():
    x, y, _ = _data(3000)
    t = time.perf_counter()
    m = auto_fit(x, y, budget=3.0, hyper_rows=500, hyper_centers=50, min_centers=100)
    took = time.perf_counter() - t
    assert bool(m.fitted)
    # the learning stage stops at its share (learn_share=0.5 of the budget, plus at most one round of
    # steps and the validation fit that ends it); only the final fit may overrun (its time is extrapolated)
    assert m.auto_report.stages["learn"] <= 0.5 * 3.0 + 1.5, m.auto_report.stages
    assert took < 3.0 + 5.0, took


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=0), "budget"),
        (dict(budget=float("inf")), "budget"),
        (dict(kernel="cosine"), "kernel"),
        (dict(kernel=3), "kernel"),
        (dict(objectives=("sgpr", "nope")), "objectives"),
        (dict(objectives=()), "objectives"),
        (dict(objectives="sgpr"), "objectives"),
        (dict(objectives=("sgpr", ("gcv", 0.0))), "objectives"),
        (dict(objectives=(("gcv", float("nan")),)), "objectives"),
        (dict(objectives=(("gcv", True),)), "objectives"),
        (dict(objectives=(("gcv", "fast"),)), "objectives"),
        (dict(objectives=(("nope", 0.2),)), "objectives"),
        (dict(objectives=(("gcv", 0.2, 1),)), "objectives"),
        (dict(objectives=(("gcv", 0.2, "cosine"),)), "kernel family"),
        (dict(objectives=(("gcv", 0.2, "rbf"), ("gcv", 0.2, "rbf"))), "named twice"),
        (dict(objectives=(("gcv", 0.2), ("gcv", 0.2, "matern52"))), "named twice"),
        (dict(objectives=(("gcv", 0.2, "rbf"), ("gcv", 0.2, "rbf", 1))), "objectives"),
        (dict(kernel=gpytorch.kernels.RBFKernel(), objectives=(("gcv", 0.2, "rbf"),)), "family name"),
        (dict(objectives=("gcv", ("gcv", 0.1))), "named twice"),
        (dict(objectives=(("gcv", 10**400),)), "objectives"),
        (dict(objectives=(("gcv", 0.2), ["gcv", 0.2])), "named twice"),
        (dict(lr=True), "lr"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=float("inf"), objectives=(("gcv", 0.2),)), "lr"),
        (dict(val_fraction=1.5), "val_fraction"),
        (dict(hyper_rows=1), "hyper_rows"),
        (dict(max_steps=-1), "max_steps"),
        (dict(lr=0.0), "lr"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(min_gain=-1.0), "min_gain"),
        (dict(search_tol=1.0), "search_tol"),
        (dict(search_tol=-0.1), "search_tol"),
        (dict(search_tol=True), "search_tol"),
        (dict(noise_paths=1), "noise_paths"),
        (dict(level_share=0.0), "level_share"),
        (dict(level_share=1.5), "level_share"),
        (dict(hyper_entries=0), "hyper_entries"),
        (dict(max_hyper_rows=1), "max_hyper_rows"),
        (dict(hyper_centers_growth=1.5), "hyper_centers_growth"),
        (dict(lengthscale_transform="exp"), "lengthscale_transform"),
        (dict(lengthscale_step="rms"), "lengthscale_step"),
        (dict(lengthscale_step=None), "lengthscale_step"),
        (dict(final_growth="yes"), "final_growth"),
        (dict(check_growth=1), "check_growth"),
        (dict(rescore_continuations="yes"), "rescore_continuations"),
        (dict(grow_select_rows=1), "grow_select_rows"),
        (dict(growth_noises=None), "growth_noises must be True or False"),
        (dict(growth_first=0), "growth_first must be True or False"),
        (dict(leverage_check="no"), "leverage_check must be True or False"),
        (dict(final_growth_factor=1.0), "final_growth_factor"),
        (dict(final_growth_factor=float("inf")), "final_growth_factor"),
        (dict(final_growth_factor=True), "final_growth_factor"),
        (dict(score_max_iter=0), "score_max_iter"),
        (dict(race_margin=0.0), "race_margin"),
        (dict(race_margin=float("nan")), "race_margin"),
        (dict(race_margin=True), "race_margin"),
        (dict(calibrate_variance=1), "calibrate_variance"),
        (dict(loo_rows=-1), "loo_rows"),
        (dict(loo_rows=2.5), "loo_rows"),
    ],
)
def test_auto_fit_bad_arguments(kwargs, match):
    x, y, _ = _data(50)
    with pytest.raises((ValueError, TypeError), match=match):
        auto_fit(x, y, **kwargs)


def test_auto_fit_bad_data():
    x, y, _ = _data(50)
    with pytest.raises(ValueError, match="one output"):
        auto_fit(x, torch.stack([y, y], -1))
    with pytest.raises(ValueError, match="val_x and val_y"):
        auto_fit(x, y, val_x=x)
    with pytest.raises(ValueError, match="features"):
        auto_fit(x, y, val_x=x[:, :2], val_y=y)
    with pytest.raises(ValueError, match="rows"):
        auto_fit(x, y[:-1])
    with pytest.raises(ValueError, match="val_x has 50"):
        auto_fit(x, y, val_x=x, val_y=y[:-1])
    with pytest.raises(ValueError, match="val_fraction"):
        auto_fit(x[:10], y[:10], val_fraction=0.95)
    with pytest.raises(ValueError, match="at least 10 rows"):
        auto_fit(x[:5], y[:5])
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="train_x"):
        auto_fit(bad, y)


def test_auto_fit_caps_the_scoring_fits_not_the_final_one():
    """``score_max_iter`` caps CG in the selection fits (recorded in ``report.search``); the final fit runs to
    ``max_iter``. By default the cap is ``max(10, max_iter // 2)``; tol 1e-12 makes every CG fit reach it. (A fixed
    memory budget: with little memory available the automatic one stores no ``K_nM``, and the solve-method choice
    then takes the direct solve, which has no iterations to cap.)"""
    from gpfalkon import settings

    x, y, _ = _data(1500)
    for cap, expect in ((4, 4), (None, 15)):
        with settings.memory_budget(2**30):
            # (M >= 200 on these 1,200 rows: the cost model takes CG for every selection fit, not only for those
            # at a size the time budget may not reach on a loaded machine)
            m = auto_fit(x, y, budget=8.0, hyper_rows=300, hyper_centers=40, min_centers=200, max_centers=400,
                         max_iter=30, tol=1e-12, score_max_iter=cap, dtype=torch.float64, refit_on_all=False)
        rep = m.auto_report
        iters = [r["iterations"] for r in rep.search if r["iterations"] is not None]
        assert iters and max(iters) == expect, iters
        assert m.max_iter == 30  # the final model's rule (its fit here may be the direct solve)


def test_auto_fit_leaves_time_for_a_final_fit_that_recomputes_its_kernel():
    """With K_nM over the memory budget the final fit recomputes it at every CG iteration; its
    predicted time (max_iter + 2 measured on-the-fly passes, huge here) cuts the learning share."""
    from gpfalkon import settings

    x, y, _ = _data(1500)
    with settings.memory_budget(2**12):
        m = auto_fit(x, y, budget=20.0, max_iter=10**6, tol=1e-3, hyper_rows=300, hyper_centers=40,
                     min_centers=100, max_centers=200, dtype=torch.float64)
    rep = m.auto_report
    assert any(n.startswith("learning share cut to") for n in rep.notes), rep.notes
    assert rep.stages["learn"] < 5.0, rep.stages  # the cut is to "now": one round at most
    assert bool(m.fitted)


def test_auto_fit_scores_stage_one_with_score_centers():
    """Stage 1's validation fits use the objective's centers plus subsample rows up to score_centers
    (default max(hyper_centers, min_centers)); score_centers=hyper_centers scores with the objective's own.
    The initial score equals a FALKON fit with those centers (checked through the recorded record)."""
    x, y, _ = _data(500)
    rep = auto_fit(x, y, **SMALL).auto_report
    runs = [r for r in rep.learn if r["objective"] != "initial"]
    assert runs and all(r["score_centers"] == 60 for r in runs)  # max(40, 60), within the 300 rows
    own = auto_fit(x, y, score_centers=40, **SMALL).auto_report
    assert all(r["score_centers"] == r["centers"] == 40 for r in own.learn if r["objective"] != "initial")
    with pytest.raises(ValueError, match="score_centers must be an int >= 1"):
        auto_fit(x, y, score_centers=0, **SMALL)


def test_auto_fit_learning_stops_when_a_continuation_does_not_beat_its_start_on_its_rows(monkeypatch):
    """rescore_continuations: with Adam's steps held at zero (nothing moves) every score of a continuation equals
    its start scored on its own rows, which is lower than the start's score on fewer rows (the scoring fit sees
    more data). Without the rescore that counts as a gain and stage 1 doubles the rows up to all of them; with
    it, the first continuation ends stage 1 and its start score is what its scores measured, bit for bit."""

    class Frozen(auto_race.Adam):
        def step(self) -> None:  # gradients are computed, nothing moves
            return None

    patch_auto(monkeypatch, "Adam", Frozen)
    x, y, _ = _data(1600, noise=0.05)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=2000, objectives=("gcv",), race_rounds=1,
              level_share=1e-9)
    on = auto_fit(x, y, **kw).auto_report.learn[1:]
    first, cont = on[0], on[1]
    assert len(on) == 2 and cont["rows"] == 200, [(r["rows"], r["stopped"]) for r in on]
    assert cont["stopped"] == (f"stalled on 200 rows with no gain over its start on these rows "
                               f"({cont['start_score']:.4g})")
    assert {e for _, _, e in cont["curve"][1:]} == {cont["start_score"]}  # every score: the start's, on 200 rows
    assert cont["best_error"] == cont["start_score"] < first["best_error"]
    assert "start_score" not in first
    off = auto_fit(x, y, **dict(kw, rescore_continuations=False)).auto_report.learn[1:]
    assert [r["rows"] for r in off][:2] == [100, 200] and len(off) > 2, [(r["rows"], r["stopped"]) for r in off]
    assert all("start_score" not in r and "its start" not in r["stopped"] for r in off)


def test_auto_fit_level_callback_builds_each_levels_final_model():
    """level_callback gets every selection level once, with its elapsed time, and a builder of the model
    the call would return had it stopped there; for the chosen level that is the returned model."""
    x, y, _ = _data(500)
    xt, _, _ = _data(50, seed=1)
    seen: list[tuple[dict, torch.Tensor]] = []

    def on_level(level, build):
        m = build()
        m.eval()
        seen.append((level, m.posterior_mean(xt)))

    model = auto_fit(x, y, level_callback=on_level, **SMALL)
    levels = model.auto_report.chosen["levels"]
    assert [lv["M"] for lv, _ in seen] == [lv["M"] for lv in levels]
    elapsed = [lv["elapsed"] for lv, _ in seen]
    assert elapsed == sorted(elapsed) and all(e > 0 for e in elapsed)
    best = min(range(len(levels)), key=lambda i: (levels[i]["error"], levels[i]["M"]))
    model.eval()
    torch.testing.assert_close(seen[best][1], model.posterior_mean(xt), rtol=1e-9, atol=1e-9)


def test_auto_fit_learning_stops_when_more_rows_gain_nothing():
    """A continuation on twice the rows that never beats the best point found on fewer rows ends stage 1
    (no further doubling); every continuation that was followed by another had beaten that point. On
    targets that are pure noise, the hyperparameters stop moving with the rows at once, so the rule fires."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1600, 3, generator=g, dtype=torch.float64)
    y = torch.randn(1600, generator=g, dtype=torch.float64)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=2000, objectives=("gcv",), race_rounds=1)
    rep = auto_fit(x, y, **kw).auto_report
    runs = rep.learn[1:]
    assert runs[-1]["stopped"] == f"stalled on {runs[-1]['rows']:,} rows with no gain over fewer rows", \
        [(r["rows"], r["best_step"], r["stopped"]) for r in runs]
    assert runs[-1]["rows"] > 100 and runs[-1]["best_step"] == 0
    assert runs[-1]["best_error"] == runs[-2]["best_error"]  # its start: the best of the rows before
    for prev, cur in itertools.pairwise(runs):
        assert prev["stopped"].startswith(f"stalled; continued on {cur['rows']:,} rows")
        if prev["rows"] > 100:  # a continuation that was continued had gained
            assert prev["best_step"] > 0
    assert 2 * runs[-1]["rows"] <= rep.n_train  # it stopped with rows to spare: the rule, not the cap


def _assert_dense_nystrom(model: FalkonGP) -> None:
    """``model``'s posterior mean at 200 fresh points is the dense Nystrom KRR solution with its centers and rows
    (to 1e-3 of the reference's spread)."""
    xt, _, _ = _data(200, seed=3)
    alpha = _dense_alpha(model, model.train_targets - model.mean_constant)
    ref = model.mean_constant + dense_kernel(model.kernel, xt, model.centers).detach() @ alpha.detach()
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt).mean
    assert float((pred - ref).abs().max()) < 1e-3 * float(ref.std())


def _script_val_mse(monkeypatch, fn) -> None:
    """Script ``auto_fit``'s validation errors: ``fn(model, xv, yv)`` for each fit, and for each noise of a
    penalty path with the model made that noise's fit (:meth:`FalkonGP.select_penalty`)."""

    def path_mse(model, path, xv, yv):
        out = []
        for j in range(path.penalties.numel()):
            model.select_penalty(path, j)
            out.append(fn(model, xv, yv))
        return out

    patch_auto(monkeypatch, "_val_mse", fn)
    patch_auto(monkeypatch, "_path_val_mse", path_mse)


def _fake_clock_auto_fit(monkeypatch, budget: float, memory_budget: int, **extra) -> tuple[FalkonGP, float]:
    """auto_fit on a fake clock that only data passes advance: ``1e-6 s x rows x M`` per pass, a
    twentieth of that where ``K_nM`` is stored (a memory read instead of kernel evaluations). Returns
    the model and the fake seconds the call took."""
    import types

    import gpfalkon.models.falkon_gp as model_module
    import gpfalkon.operators.nystrom as operator_module
    import gpfalkon.solvers.cg as cg_module
    import gpfalkon.solvers.falkon as falkon_module
    from gpfalkon import settings
    from gpfalkon.backend import KernelEngine

    now = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: now[0])
    patch_auto(monkeypatch, "time", fake)
    for module in (model_module, operator_module, cg_module, falkon_module):  # every clock its fits read
        monkeypatch.setattr(module, "time", fake)
    real = KernelEngine.kmn_k

    def kmn_k(self, u=None, v=None):
        now[0] += 1e-6 * self.n * self.m * (0.05 if self.stored else 1.0)
        return real(self, u, v)

    monkeypatch.setattr(KernelEngine, "kmn_k", kmn_k)
    real_fit = FalkonGP.fit
    limits: list = []

    def fit(self, **kw):
        limits.append((kw.get("time_limit"), now[0]))
        return real_fit(self, **kw)

    real_path = FalkonGP.fit_penalty_path

    def fit_penalty_path(self, penalties, **kw):  # a growth check's path is bounded as a final fit too
        limits.append((kw.get("time_limit"), now[0]))
        return real_path(self, penalties, **kw)

    monkeypatch.setattr(FalkonGP, "fit", fit)
    monkeypatch.setattr(FalkonGP, "fit_penalty_path", fit_penalty_path)
    x, y, _ = _data(2000)
    # the fake budgets below are sized to the fake seconds of a three-objective learning stage (the whole
    # race: race_margin=None, race_share=None; early ends are covered by test_auto_fit_race_margin_drops_...
    # and test_auto_fit_race_share_ends_...) and to the
    # selection fits of searches that extend while the error falls at all (search_tol=0; the tolerance is
    # covered by test_auto_fit_search_tol_ends_a_flat_search)
    # grow_select_rows off: the selection rows (400) are below the 1,600 training rows, and the tests of this
    # harness size their budgets to every decision keeping time for a final fit on all rows (the option is
    # covered by test_auto_fit_grows_the_selection_rows_with_the_centers)
    # the learning stage's parametrisation pinned (softplus lengthscales, Adam's own steps): the scenarios
    # below size their budgets to the number of selection fits that the hyperparameters learned so lead to
    # (with the defaults this easy problem's M = 120 gains < min_gain over M = 60: nothing left to grow)
    # the growth check off: the budgets below are sized to a grown final fit on all rows (the check is covered by
    # test_auto_fit_checks_a_grown_final_fit_on_held_out_rows)
    # the noise searches one fit per step: the budgets below are sized to those fits (a penalty path's columns cost
    # this clock nothing: one data pass an iteration for all; the paths are covered by
    # test_auto_fit_search_tol_ends_a_flat_search and test_auto_fit_noise_paths_score_each_noise_as_its_own_fit)
    kw = dict(SMALL, budget=budget, select_rows=400, min_centers=60, max_centers=120, search_tol=0.0,
              objectives=("sgpr", "gcv", "nystrom-compreg"), race_margin=None, race_share=None,
              grow_select_rows=False, lengthscale_transform="softplus", lengthscale_step="adam",
              check_growth=False, noise_paths=False)
    kw.update(extra)
    with settings.memory_budget(memory_budget):
        model = auto_fit(x, y, **kw)
    # only the final fit is bounded: by what the budget has left when it starts and a 5 % grace, or 1.2 x its
    # predicted time if that is longer; a grown final fit (sized to the time left) by the time left, or
    # GROWTH_MARGIN x its prediction
    growth = model.auto_report.growth
    checked = 1 if growth else 0  # a growth check's fit: bounded as a final fit
    assert all(lim is None for lim, _ in limits[:-1 - checked])
    pred = model.auto_report.chosen["final_predicted_seconds"]
    grace = 0.05 * budget
    if growth and not growth["kept"]:  # the level's final fit after a rejected check stops at the clock (its CG
        floor = 1e-3                   # starts from the level's selection fit)
    elif model.auto_report.chosen["grown_from"] is not None:
        floor, grace = auto_costs.GROWTH_MARGIN * pred, 0.0
    else:
        floor = 1.2 * pred
    assert limits[-1][0] == pytest.approx(max(budget - limits[-1][1] + grace, floor, 1e-3))
    return model, now[0]


def test_auto_fit_does_not_grow_centers_past_a_final_fit_it_cannot_afford(monkeypatch):
    """Where the final rows' K_nM crosses the memory budget between two sizes (here at M = 80 of the 2000
    final rows, float64), the final fit becomes ~20x dearer per pass than the selection fits predict by
    scaling; the growth measures the candidate's on-the-fly pass and stops below the boundary when the
    budget cannot pay for it, and the whole call keeps its budget. With time to spare it does cross."""
    boundary = 2000 * 80 * 8
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=5.0, memory_budget=boundary)
    rep = model.auto_report
    assert 60 < rep.chosen["num_centers"] <= 80, rep.chosen["levels"]
    assert spent <= 5.0, (spent, rep.stages, rep.notes)
    assert rep.chosen["final_predicted_seconds"] > 0
    assert any("would not fit the remaining budget" in n for n in rep.notes), rep.notes
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=1e4, memory_budget=boundary)
    assert model.auto_report.chosen["num_centers"] > 80, model.auto_report.chosen["levels"]
    # a budget spent before the first growth: the first level is returned (no growth step on negative time)
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=0.05, memory_budget=boundary)
    assert model.auto_report.chosen["num_centers"] == 60 and model.fitted


def test_auto_fit_growth_first_grows_instead_of_a_doubling_that_ends_smaller(monkeypatch):
    """``growth_first``: on the fake clock a budget of 0.1 s admits the doubling to M = 120 (taken with the option
    off), but the final fit grown from M = 60 with the time left is predicted larger than M = 120 grown after its
    four selection fits (and below its cap, 4 x 60): stage 2 stops at M = 60, says so with both sizes, and the final
    fit grows from it to the size named (its centers the doubling's pool prefix); no selection fit past M = 60 runs.
    The budget is kept."""
    import re

    budget = 0.1
    on, spent = _fake_clock_auto_fit(monkeypatch, budget=budget, memory_budget=2**40, max_centers=400)
    rep = on.auto_report
    note = [n for n in rep.notes if n.startswith("centers stopped at M=60: a final fit grown from it reaches")]
    assert len(note) == 1, rep.notes
    now, m2, later = (int(v) for v in re.findall(r"M=(\d+)", note[0])[1:])
    assert m2 == 120 and 4 * 60 > now > later >= 120
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60] and not any(r["M"] > 60 for r in rep.search)
    assert rep.chosen["grown_from"] == 60 and rep.chosen["num_centers"] == now
    assert spent <= budget * 1.05, (spent, rep.stages)
    off, _ = _fake_clock_auto_fit(monkeypatch, budget=budget, memory_budget=2**40, max_centers=400, growth_first=False)
    assert 120 in [lv["M"] for lv in off.auto_report.chosen["levels"]]
    torch.testing.assert_close(on.centers[:120], off.centers[:120])
    with pytest.raises(TypeError, match="growth_first"):
        auto_fit(*_data(200)[:2], growth_first=1, **SMALL)


def test_auto_fit_growth_first_takes_a_doubling_where_the_grown_fit_is_held_at_its_cap(monkeypatch):
    """``growth_first``: where the final fit grown from M = 60 is held at its cap (``final_growth_factor`` x 60 = 240:
    the time left would pay for more) and the doubling's own grown fit is predicted within a step of 1.15 below it,
    the doubling is taken (on the fake clock, a budget of 0.14 s): its level at M = 120 is searched and the final fit
    grows from there past the first size's cap. With ``final_growth_factor=8`` the same budget's fit from M = 60 is
    not capped, and stage 2 stops at M = 60 as before."""
    import re

    kw = dict(budget=0.14, memory_budget=2**40, max_centers=400)
    on, spent = _fake_clock_auto_fit(monkeypatch, **kw)
    rep = on.auto_report
    head = "centers doubled to M=120: a final fit grown from M=60 stops at its cap"
    note = [n for n in rep.notes if n.startswith(head)]
    assert len(note) == 1, rep.notes
    _, _, cap, _, later = (int(v) for v in re.findall(r"M=(\d+)", note[0]))
    assert cap == 240 and cap / 1.15 <= later < cap
    assert 120 in [lv["M"] for lv in rep.chosen["levels"]] and rep.chosen["num_centers"] > cap, rep.notes
    assert spent <= 0.14 * 1.05, (spent, rep.stages)
    wide, _ = _fake_clock_auto_fit(monkeypatch, final_growth_factor=8.0, **kw)
    assert [lv["M"] for lv in wide.auto_report.chosen["levels"]] == [60], wide.auto_report.notes
    assert wide.auto_report.chosen["num_centers"] > cap, wide.auto_report.notes


def _record_cg_starts(monkeypatch) -> dict[int, torch.Tensor]:
    """``{id(model): initial_alpha}`` of every ``FalkonGP.fit`` given a CG start from here on."""
    starts: dict[int, torch.Tensor] = {}
    real_fit = FalkonGP.fit

    def spy(self, *args, **kwargs):
        if kwargs.get("initial_alpha") is not None:
            starts[id(self)] = kwargs["initial_alpha"].detach().clone()
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(FalkonGP, "fit", spy)
    return starts


def test_auto_fit_final_growth_spends_the_time_a_next_size_could_not(monkeypatch):
    """On the fake clock, a budget of 0.04 s pays for the first size (M = 60) but not for the selection
    fits of M = 120: the final fit then takes more nested centers (at most 2 x, at least 1.25 x) at the
    level's noise and multiplier, within the budget, and equals the dense Nystrom solve with those centers;
    off, it keeps the level's 60 centers (a prefix of the grown ones). A stage 2 that stopped for lack of
    gain (budget 0.15) does not grow. The grown fit's CG starts from the level's selection fit, zero for the
    added centers (the same function)."""
    starts = _record_cg_starts(monkeypatch)
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=0.04, memory_budget=2**40, max_centers=400)
    rep = model.auto_report
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60], rep.notes
    assert rep.chosen["grown_from"] == 60
    m_fin = rep.chosen["num_centers"]
    assert 75 <= m_fin <= 120 and model.centers.shape[0] == m_fin
    assert any(n.startswith(f"final fit's centers grown from M=60 to M={m_fin}") for n in rep.notes), rep.notes
    assert spent <= 0.04 * 1.05, (spent, rep.stages)
    # the same call without growth: the same choices, the level's centers are the grown model's first 60
    off, _ = _fake_clock_auto_fit(monkeypatch, budget=0.04, memory_budget=2**40, max_centers=400,
                                  final_growth=False)
    assert off.auto_report.chosen["num_centers"] == 60 and off.auto_report.chosen["grown_from"] is None
    torch.testing.assert_close(model.centers[:60], off.centers)
    grown_start, off_start = starts[id(model)], starts[id(off)]
    assert grown_start.shape == model.alpha.shape and off_start.shape == off.alpha.shape
    assert bool((grown_start[60:] == 0).all()) and float(grown_start[:60].abs().sum()) > 0
    torch.testing.assert_close(grown_start[:60], off_start)  # both the level's selection fit
    # in raw units: the start's function is close to the grown model's (the calibration after the fit scaled the
    # kernel by c and alpha by 1 / c); here the cost model may pick the direct solve, which does not use it
    with torch.no_grad():
        k_x = dense_kernel(model.kernel, model.train_inputs[0], model.centers)
        f_start = k_x @ grown_start.reshape(-1) / model.auto_report.chosen["variance_scale"]
        f_final = k_x @ model.alpha.reshape(-1)
    assert float((f_start - f_final).norm() / f_final.norm()) < 0.2
    # the same selected noise (each model's then carries its own variance calibration)
    assert model.auto_report.chosen["noise"] == off.auto_report.chosen["noise"]
    assert float(model.noise.detach()) / model.auto_report.chosen["variance_scale"] == pytest.approx(
        float(off.noise.detach()) / off.auto_report.chosen["variance_scale"], rel=1e-9)
    # the grown model is the dense Nystrom KRR solution with its centers
    _assert_dense_nystrom(model)
    # stopped for lack of gain (a doubling taken: growth_first off, see test_auto_fit_growth_first_...): no growth
    model, _ = _fake_clock_auto_fit(monkeypatch, budget=0.15, memory_budget=2**40, max_centers=400,
                                    growth_first=False)
    rep = model.auto_report
    assert rep.chosen["grown_from"] is None
    assert "final growth skipped: stage 2 did not stop for time" in rep.notes, rep.notes
    assert any(n.startswith("centers stopped at M=") and "gained less than" in n for n in rep.notes), rep.notes
    assert rep.chosen["num_centers"] == min(rep.chosen["levels"], key=lambda r: (r["error"], r["M"]))["M"]
    # a cap below 1.25 M (max_centers 70 here): no growth, and the note names the cap
    model, _ = _fake_clock_auto_fit(monkeypatch, budget=0.04, memory_budget=2**40, max_centers=70)
    rep = model.auto_report
    assert rep.chosen["grown_from"] is None and rep.chosen["num_centers"] == 60
    assert "final growth skipped: max_centers allow no M >= 75" in rep.notes, rep.notes
    # less time left (budget 0.03): no final fit of 75 or more centers is affordable
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=0.03, memory_budget=2**40, max_centers=400)
    rep = model.auto_report
    assert rep.chosen["grown_from"] is None and rep.chosen["num_centers"] == 60
    assert any(n.startswith("final growth skipped:") and n.endswith("s left pay for no final fit with M >= 75")
               for n in rep.notes), rep.notes
    assert spent <= 0.03 * 1.05


def test_paired_z_is_the_paired_t_statistic_of_the_squared_errors():
    """``_paired_z`` is the paired t statistic of the two fits' squared residuals (scipy's ``ttest_rel``), 0 for
    identical fits and ``inf`` for a non-finite residual."""
    from scipy.stats import ttest_rel

    from gpfalkon.auto.scoring import _paired_z

    g = torch.Generator().manual_seed(0)
    old = torch.randn(300, generator=g, dtype=torch.float64)
    new = old * 0.9 + 0.3 * torch.randn(300, generator=g, dtype=torch.float64)
    ref = ttest_rel(new.square().numpy(), old.square().numpy()).statistic
    assert _paired_z(new, old) == pytest.approx(float(ref), rel=1e-10)
    assert _paired_z(new * 3, old) > 2.0 > _paired_z(new, old * 3)
    assert _paired_z(old, old) == 0.0
    assert _paired_z(torch.cat([new[:-1], new.new_tensor([float("nan")])]), old) == math.inf


@pytest.mark.parametrize("verdict", [0.5, 4.0])
def test_auto_fit_checks_a_grown_final_fit_on_held_out_rows(monkeypatch, verdict):
    """``check_growth``: the grown size is fitted once on the final rows less the check rows (the calibration's 150
    held-out rows here) at the level's noise and multiplier, and compared on the check rows with the level's
    selection fit (``_paired_z`` of their squared residuals). The grown fit's squared residuals are scaled here by
    ``verdict``: at 0.5 the growth is kept and that fit is the returned model (the dense Nystrom solution on the
    other 1,850 rows); at 4 it is rejected and the returned model is the level's own final fit (60 centers, on all
    2,000 rows, CG started from its selection fit). The check takes no time from the growth: the grown size is at
    least the unchecked one's, and the call keeps its budget (a rejected growth's fallback fit, which no time was
    kept for, stops its CG at the clock)."""

    patch_auto(monkeypatch, "CALIBRATION_ROWS", 150)
    checks: list[tuple[FalkonGP, torch.Tensor, torch.Tensor, float, torch.Tensor]] = []
    real_res, real_z = auto_scoring._std_residuals, auto_scoring._paired_z
    compared: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def std_residuals(mod, xv, yv, y_sd):
        res = real_res(mod, xv, yv, y_sd)
        checks.append((mod, xv, yv, y_sd, res))
        return res * verdict**0.5

    def paired_z(res_new, res_old):
        z = real_z(res_new, res_old)
        compared.append((res_new, res_old, z))
        return z

    patch_auto(monkeypatch, "_std_residuals", std_residuals)
    patch_auto(monkeypatch, "_paired_z", paired_z)
    starts = _record_cg_starts(monkeypatch)
    kw = dict(memory_budget=2**40, max_centers=400)
    # the level's noise alone (the grown fit's noises are covered by test_auto_fit_grown_fit_chooses_its_noise_...)
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=0.04, check_growth=True, growth_noises=False, **kw)
    rep = model.auto_report
    assert spent <= 0.04 * 1.05, (spent, rep.stages)
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60], rep.notes
    assert len(checks) == 1 and len(compared) == 1, rep.notes
    check, xv, yv, y_sd, res = checks[0]
    res_new, res_old, z = compared[0]
    g = rep.growth
    m_g = g["M"]
    level = rep.chosen["levels"][0]
    assert g["grown_from"] == 60 and g["check_rows"] == 150 and g["rows"] == 1850 and g["z"] == z
    assert g["error"] == pytest.approx(float(res.square().mean()) * verdict, rel=1e-12)
    torch.testing.assert_close(res_new, res * verdict**0.5)
    # the level's residuals on the check rows: its selection fit's (on the 400 selection rows, validated on all 400
    # held-out rows), there about its validation error
    assert g["level_error"] == pytest.approx(float(res_old.square().mean()), rel=1e-12)
    assert 0.5 * level["error"] < g["level_error"] < 2 * level["error"]
    assert g["kept"] == (z < auto_growth.GROWTH_CHECK_Z) and g["kept"] == (verdict < 1)
    # the check's fit: the grown centers on the 1,850 other rows at the level's noise; its residuals are the check
    # rows' (standardised units)
    x_all, _, _ = _data(2000)
    assert check.centers.shape[0] == m_g and check.train_inputs[0].shape[0] == 1850 and xv.shape[0] == 150
    seen = {tuple(r.tolist()) for r in torch.cat([check.train_inputs[0], xv])}
    assert seen == {tuple(r.tolist()) for r in x_all}
    assert float(check.penalty.detach()) * 1850 / y_sd**2 == pytest.approx(
        level["noise"] * rep.chosen["variance_scale"] if verdict < 1 else level["noise"], rel=1e-6)
    with torch.no_grad():
        ref = (yv - check.posterior_mean(xv)) / y_sd
    torch.testing.assert_close(res, ref, rtol=1e-9, atol=1e-12)
    unchecked, _ = _fake_clock_auto_fit(monkeypatch, budget=0.04, **kw)
    m_u = unchecked.auto_report.chosen["num_centers"]
    assert m_g >= m_u >= 75 and unchecked.auto_report.growth == {}
    torch.testing.assert_close(unchecked.centers[:m_u], check.centers[:m_u])  # nested: the same pool
    # the returned model's variances are calibrated (after a rejection, with the fallback fit's own factors)
    assert not any(n.startswith("variance calibration skipped") for n in rep.notes), rep.notes
    assert rep.chosen["variance_scale"] != 1.0
    if verdict < 1:
        assert model is check
        assert rep.chosen["grown_from"] == 60 and rep.chosen["num_centers"] == m_g and rep.chosen["final_rows"] == 1850
        assert rep.chosen["val_error"] == g["error"]
        assert any(n.startswith(f"growth to M={m_g} kept") for n in rep.notes), rep.notes
        _assert_dense_nystrom(model)
    else:
        assert model is not check
        assert rep.chosen["grown_from"] is None and rep.chosen["num_centers"] == 60 and model.n == 2000
        assert rep.chosen["val_error"] == level["error"]
        assert any(n.startswith(f"final growth from M=60 to M={m_g} rejected") for n in rep.notes), rep.notes
        # the fallback's CG starts from the level's selection fit (60 coefficients), and it is the dense solution
        assert starts[id(model)].shape == model.alpha.shape and float(starts[id(model)].abs().sum()) > 0
        _assert_dense_nystrom(model)


@pytest.mark.parametrize("verdict", [0.5, 4.0])
def test_auto_fit_grown_fit_chooses_its_noise_on_the_check_rows(monkeypatch, verdict):
    """``growth_noises``: the grown fit is one penalty path over ``_growth_noises`` of the level (its noise among
    them) on the final rows less the 150 check rows; each noise's error on the check rows is its dense Nystrom
    solution's there, the lowest one is chosen, and the growth check compares that fit with the level (the level's
    residuals scaled here by ``1 / verdict``: kept at 0.5, rejected at 4). Kept, the returned model is the path's
    fit at the chosen noise (the dense solution, calibrated with that noise's preconditioner); rejected, the
    level's own fit. The call keeps its budget."""

    patch_auto(monkeypatch, "CALIBRATION_ROWS", 150)
    paths: list = []
    real_path, real_z = auto_scoring._path_quiet, auto_scoring._paired_z

    def spy(model, penalties, limit, initial):
        out = real_path(model, penalties, limit, initial)
        paths.append((model, list(penalties), out[0], initial))
        return out

    patch_auto(monkeypatch, "_path_quiet", spy)
    patch_auto(monkeypatch, "_paired_z", lambda new, old: real_z(new, old / verdict**0.5))
    model, spent = _fake_clock_auto_fit(monkeypatch, budget=0.04, check_growth=True, memory_budget=2**40,
                                        max_centers=400)
    rep = model.auto_report
    assert spent <= 0.04 * 1.05, (spent, rep.stages)
    level = rep.chosen["levels"][0]
    g = rep.growth
    assert g["noises"] == auto_costs._growth_noises(level["noise"], level["error"])
    assert g["level_noise"] == level["noise"]
    assert level["noise"] in g["noises"] and len(g["noises"]) >= 2
    assert len(paths) == 1, rep.notes
    grown, penalties, _, initial = paths[0]
    n_fit = grown.train_inputs[0].shape[0]
    assert n_fit == 1850 and g["rows"] == 1850 and grown.centers.shape[0] == g["M"] > 60
    # the penalties are the noises in raw units over the fit's rows, in one ratio (y_sd^2 / rows)
    ratios = [p / v for p, v in zip(penalties, g["noises"], strict=True)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    # CG started every penalty from the level's selection fit (its 60 coefficients, zero for the added centers)
    assert initial is not None and float(initial.reshape(-1)[60:].abs().max()) == 0.0
    # each noise's error on the check rows: the dense solution at its penalty (one ratio to the raw squared error)
    x_all, y_all, _ = _data(2000)
    fit_rows = {tuple(r.tolist()) for r in grown.train_inputs[0]}
    check = torch.tensor([tuple(r.tolist()) not in fit_rows for r in x_all])
    assert int(check.sum()) == 150
    x_c, y_c = x_all[check], y_all[check]
    xf, yf, c = grown.train_inputs[0], grown.train_targets, grown.centers.detach()
    knm, kmm = dense_kernel(grown.kernel, xf, c).detach(), dense_kernel(grown.kernel, c, c).detach()
    kcm = dense_kernel(grown.kernel, x_c, c).detach()
    mu = float(grown.mean_constant)
    raw = []
    for lam in penalties:
        a = torch.linalg.solve(knm.T @ knm + n_fit * lam * kmm, knm.T @ (yf - mu).unsqueeze(-1))
        raw.append(float((y_c - mu - (kcm @ a).reshape(-1)).square().mean()))
    scale = [e / r for e, r in zip(g["errors"], raw, strict=True)]
    # (to 2e-3: the solve at M close to the rows regularises K_MM by its jitter, the dense reference does not)
    assert max(scale) == pytest.approx(min(scale), rel=2e-3), (g["errors"], raw)
    chosen = min(range(len(raw)), key=lambda j: raw[j])
    assert g["noise"] == g["noises"][chosen] and g["error"] == g["errors"][chosen]
    assert g["kept"] == (verdict < 1)
    if verdict < 1:
        assert model is grown and rep.chosen["noise"] == g["noise"]
        assert float(model.penalty.detach()) * rep.chosen["variance_scale"] ** -1 == pytest.approx(penalties[chosen],
                                                                                                    rel=1e-9)
        assert any(n.startswith(f"growth to M={g['M']} kept: at noise") for n in rep.notes), rep.notes
        _assert_dense_nystrom(model)
    else:
        assert model is not grown and rep.chosen["num_centers"] == 60 and rep.chosen["noise"] == level["noise"]
        _assert_dense_nystrom(model)
    assert not any(n.startswith("variance calibration skipped") for n in rep.notes), rep.notes


def test_growth_noises_and_the_path_cost_model():
    """``_growth_noises``: the level's noise and a quarter of it, and the geometric mean of the noise and the
    validation error where that error is more than 16x the noise; ``_scaled_fit_seconds`` with ``columns``: the
    factorisations ``(1 + p) / 2`` times, the triangular solves ``p`` times, the rest once."""
    from gpfalkon.auto.costs import _growth_noises, _scaled_fit_seconds

    assert _growth_noises(0.01, 0.02) == pytest.approx([0.0025, 0.01])
    assert _growth_noises(0.01, 0.1) == pytest.approx([0.0025, 0.01])
    assert _growth_noises(0.001, 0.1) == pytest.approx([0.00025, 0.001, 0.01])
    assert _growth_noises(5.0, 0.5) == pytest.approx([1.25, 5.0])
    assert _growth_noises(1e-8, 1e3) == pytest.approx([1e-8, math.sqrt(1e-8 * 1e3)])  # 1e-8 / 4 clamped to 1e-8
    assert _growth_noises(1.0, 1e6) == pytest.approx([0.25, 1.0, 1e2])  # sqrt(1e6) clamped to 1e2
    assert _growth_noises(0.01, math.inf) == pytest.approx([0.0025, 0.01])
    rec = [dict(seconds=2.0, precond_seconds=0.5, apply_seconds=0.5), dict(seconds=1.0, precond_seconds=0.2)]
    one = _scaled_fit_seconds(rec, 2.0, 1.5)
    assert one == pytest.approx(0.5 * 8 + 0.5 * 4 + 1.0 * 2 * 1.5)
    assert _scaled_fit_seconds(rec, 2.0, 1.5, columns=3) == pytest.approx(0.5 * 8 * 2 + 0.5 * 4 * 3 + 1.0 * 2 * 1.5)


def test_auto_fit_grows_the_final_fit_instead_of_a_partial_step(monkeypatch):
    """On the fake clock a budget of 0.07 s pays for the searches at M = 60 and for a partial step (its four
    selection fits and its final fit) short of doubling, not for M = 120's: with final_growth the partial
    step's searches are not run and that time goes to a final fit grown from M = 60 at its noise and
    multiplier (here past 2 x: ``final_growth_factor`` 4 allows up to 4 x), within the budget; without it the
    partial step is a level of its own. With ``final_growth_factor=2`` the same level grows to at most 2 x,
    nested in the 4 x model's centers."""
    kw = dict(memory_budget=2**40, max_centers=400)
    on, spent = _fake_clock_auto_fit(monkeypatch, budget=0.07, **kw)
    rep = on.auto_report
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60], rep.notes
    assert ("centers stopped at M=60: M=120 would not fit the remaining budget; the final fit grows from M=60 "
            "instead of a smaller step") in rep.notes, rep.notes
    assert rep.chosen["grown_from"] == 60 and 120 < rep.chosen["num_centers"] <= 240, rep.notes
    assert not any(r["M"] > 60 for r in rep.search)  # no selection fit past the first size
    assert spent <= 0.07 * 1.05, (spent, rep.stages)
    two, spent = _fake_clock_auto_fit(monkeypatch, budget=0.07, final_growth_factor=2.0, **kw)
    assert two.auto_report.chosen["grown_from"] == 60 and 75 <= two.auto_report.chosen["num_centers"] <= 120
    assert spent <= 0.07 * 1.05
    torch.testing.assert_close(on.centers[: two.centers.shape[0]], two.centers)
    off, _ = _fake_clock_auto_fit(monkeypatch, budget=0.07, final_growth=False, **kw)
    ms = [lv["M"] for lv in off.auto_report.chosen["levels"]]
    assert len(ms) == 2 and ms[0] == 60 and 60 < ms[1] < 120, off.auto_report.notes


def test_auto_fit_grows_the_selection_rows_with_the_centers(monkeypatch):
    """``grow_select_rows`` (1,600 training rows, ``select_rows`` 400): M = 120 is scored on 800 nested rows (the
    first size's 400 rows per 60 centers). The memory budget stores ``K_nM`` at M = 120 for up to 1,500 rows:
    on all 2,000 final rows every CG iteration would recompute a quarter of it (20x dearer passes on the fake
    clock), so the final fit takes the 1,500 rows that fit the budget (at least the level's 800 plus the 400
    held-out ones), within the call's budget, and is the dense Nystrom solution on exactly those rows at
    lambda = noise / rows. Off, every decision keeps time for a final fit on all rows: the same budget stops at
    M = 60, scores every size on 400 rows, and still runs over it."""
    budget = 0.1
    memory = 1500 * 120 * 8  # float64 K_nM of 1,500 rows x 120 centers
    on, spent = _fake_clock_auto_fit(monkeypatch, budget=budget, memory_budget=memory, grow_select_rows=True)
    rep = on.auto_report
    assert {r["M"] for r in rep.search} == {60, 120}, rep.notes
    for r in rep.search:
        assert r["rows"] == min(1600, round(400 * r["M"] / 60)), r
    rows = rep.chosen["final_rows"]
    assert rep.chosen["num_centers"] == 120 and 1450 <= rows <= 1500, (rep.chosen, rep.notes)
    assert on.train_inputs[0].shape[0] == rows
    assert any(n.startswith(f"final fit on {rows:,} of the 2,000 rows") for n in rep.notes), rep.notes
    assert float(on.penalty.detach()) * rows == pytest.approx(rep.chosen["noise_raw"], rel=1e-9)
    assert spent <= budget * 1.05, (spent, rep.stages)
    # the final rows are distinct rows of the data
    x, _, _ = _data(2000)
    xs = {tuple(v) for v in x.double().tolist()}
    fin = [tuple(v) for v in on.train_inputs[0].double().tolist()]
    assert len(set(fin)) == rows and all(v in xs for v in fin)
    # the dense Nystrom KRR solution on those rows
    _assert_dense_nystrom(on)
    # off: the same budget, every size on the 400 selection rows, the final fit on all rows
    off, spent_off = _fake_clock_auto_fit(monkeypatch, budget=budget, memory_budget=memory)
    rep = off.auto_report
    assert all(r["rows"] == 400 for r in rep.search)
    assert rep.chosen["final_rows"] == 2000 and off.train_inputs[0].shape[0] == 2000
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60], rep.notes
    assert spent_off > budget * 1.05 > spent


@pytest.mark.parametrize("seconds, expected", [(0.5, 100), (1.0, 100), (3.0, 2_000), (10.0, 9_000), (1e9, 10_000)])
def test_rows_within_is_the_largest_affordable_row_count(seconds, expected):
    """``_rows_within`` on ``cost(r) = 1 + r / 1000`` over ``[100, 10,000]``: the largest ``r`` with
    ``cost(r) <= seconds`` to within 0.1 % (never above it), the low end when even it does not fit, the high
    end when it does."""
    from gpfalkon.auto.costs import _rows_within

    calls: list[int] = []

    def cost(r: int) -> float:
        calls.append(r)
        return 1.0 + r / 1000

    got = _rows_within(cost, 100, 10_000, seconds)
    assert cost(got) <= seconds or got == 100
    assert expected * 0.999 <= got <= expected
    assert len(calls) <= 3 + math.ceil(math.log2(10_000)) + 1
    assert _rows_within(cost, 500, 500, 0.0) == 500  # an empty interval: its one point


@pytest.mark.parametrize(
    ("m", "factor", "n_final", "limit", "expected"),
    [
        (1000, 4.0, 40_000, 50_000, 4000),  # 4 M, far below half the rows
        (1000, 4.0, 6_000, 50_000, 3000),  # past 2 M only up to n / 2
        (2000, 4.0, 6_000, 50_000, 4000),  # n / 2 below 2 M: 2 M (the bound applies past 2 M only)
        (2000, 4.0, 8_611, 50_000, 4305),
        (1000, 2.0, 1_000, 50_000, 2000),  # factor 2: the bound does not apply
        (1000, 3.0, 40_000, 2_500, 2500),  # the limit (pool, max_centers, final rows) caps all
        (61, 1.25, 10_000, 1_000, 77),  # at least ceil(1.25 M)
        (1000, 1.5, 40_000, 50_000, 1500),
    ],
)
def test_growth_cap_closed_form(m, factor, n_final, limit, expected):
    from gpfalkon.auto.costs import _growth_cap

    assert _growth_cap(m, factor, n_final, limit) == expected


def test_growth_size_takes_the_largest_size_the_time_pays_for_within_a_step():
    """``_growth_size``: down from the cap by steps of 1.15 to the first size whose predicted final fit (times
    ``GROWTH_MARGIN``) fits the time, then 1.10 or 1.05 of it where that fits too; the time is read after each
    prediction; nothing of at least ``1.25 m`` fits: below it; ``inf`` costs are passed over."""
    from gpfalkon.auto.costs import GROWTH_MARGIN, _growth_size

    def cost(m: int) -> float:
        return m / 1000.0

    def budget(s: float):
        return lambda: s * GROWTH_MARGIN

    # grid 4000, 3478, 3024, 2629 (the first that fits 3.0 s), then int(2629 * 1.10) = 2891 fits too
    assert _growth_size(cost, 1000, 4000, budget(3.0), lambda m: True) == 2891
    assert _growth_size(cost, 1000, 4000, budget(2.8), lambda m: True) == 2760  # 2891 not, int(2629 * 1.05)
    assert _growth_size(cost, 1000, 4000, budget(2.7), lambda m: True) == 2629  # neither refinement
    assert _growth_size(cost, 1000, 4000, budget(3.0), lambda m: m < 2800) == 2760  # 2891 not refinable
    assert _growth_size(cost, 1000, 4000, budget(5.0), lambda m: True) == 4000  # the cap fits: no refinement
    assert _growth_size(cost, 1000, 4000, budget(1.0), lambda m: True) < 1250  # nothing of 1,250 or more
    # a size passed over (inf) is skipped, the next step down is taken
    passed_over = lambda m: math.inf if m > 3100 else cost(m)
    assert _growth_size(passed_over, 1000, 4000, budget(10.0), lambda m: True) == 3024  # 3326, 3175 passed over
    # the time is read after each prediction: at a constant 3.4 s, 3024 then 3326 fit; a clock that falls keeps 3024
    assert _growth_size(cost, 1000, 4000, budget(3.4), lambda m: True) == 3326
    left = iter([3.9, 3.4, 3.1, 3.3, 3.0])
    calls: list[int] = []

    def timed(m: int) -> float:
        calls.append(m)
        return cost(m)

    assert _growth_size(timed, 1000, 4000, lambda: next(left) * GROWTH_MARGIN, lambda m: True) == 3024
    assert calls == [4000, 3478, 3024, 3326, 3175]


def test_auto_fit_first_size_searches_keep_time_for_a_grown_final_fit(monkeypatch):
    """With final_growth, the first size's noise and multiplier searches stop where the time left still pays
    for a grown final fit (up to final_growth_factor M, 1.2 x its prediction, at most RESERVE_SHARE of the time left
    when they start);
    without it they run on into the final fit's own reserve and the final fit keeps M. On the fake clock with
    every training row a selection row (selection fits as dear as the final fit), a budget of 0.06 s cuts the
    searches at M = 60 either way (a budget of 0.2 s lets them finish)."""
    kw = dict(memory_budget=2**40, max_centers=400, select_rows=2000)
    on, spent = _fake_clock_auto_fit(monkeypatch, budget=0.06, **kw)
    off, _ = _fake_clock_auto_fit(monkeypatch, budget=0.06, final_growth=False, **kw)
    full, _ = _fake_clock_auto_fit(monkeypatch, budget=0.2, final_growth=False, **kw)
    fits = [sum(1 for r in m.auto_report.search if r["M"] == 60) for m in (on, off, full)]
    assert fits[0] < fits[1] < fits[2], fits
    rep = on.auto_report
    assert [lv["M"] for lv in rep.chosen["levels"]] == [60], rep.notes
    assert rep.chosen["grown_from"] == 60 and 75 <= rep.chosen["num_centers"] <= 4 * 60, rep.notes
    import re

    reserve = [n for n in rep.notes if n.startswith("the searches at M=60 keep time for a final fit grown up to M=")]
    assert len(reserve) == 1 and 75 <= int(re.findall(r"M=(\d+)", reserve[0])[1]) <= 4 * 60, rep.notes
    assert not any(n.startswith("the searches at M=") for n in off.auto_report.notes)
    # the searches ended where the grown final fit's reserve begins (the grown size: GROWTH_MARGIN x its prediction
    # within the time left); the whole call kept its budget
    from gpfalkon.auto.costs import GROWTH_MARGIN

    assert rep.chosen["levels"][0]["elapsed"] + GROWTH_MARGIN * rep.chosen["final_predicted_seconds"] <= 0.06 + 1e-9
    assert spent <= 0.06 * 1.05, (spent, rep.stages)
    assert off.auto_report.chosen["num_centers"] == 60 and off.auto_report.chosen["grown_from"] is None
    # the same level's choices: the grown model's first 60 centers are the level's
    torch.testing.assert_close(on.centers[:60], off.centers)


@pytest.mark.parametrize("winner", ["leverage", "uniform", "scored"])
def test_auto_fit_leverage_check_keeps_the_better_centers_on_validation(monkeypatch, winner):
    """leverage_check=True scores the chosen level once more with leverage-score centers; the final
    model carries those centers (and their preconditioner weights) exactly when their validation error
    was lower, and is the Nystrom KRR fit with its centers (checked against a dense solve). The validation
    score is forced to favour either side ("scored": the real scores decide)."""

    real = auto_scoring._val_mse
    forced = {"leverage": 0.0, "uniform": math.inf}

    def val_mse(model, x, y):
        if winner in forced and model.center_weights is not None:  # only the leverage fit carries weights
            return forced[winner]
        return real(model, x, y)

    _script_val_mse(monkeypatch, val_mse)
    x, y, _ = _data(800)
    model = auto_fit(x, y, leverage_check=True, center_sampling="uniform", **SMALL)
    rep = model.auto_report
    lev = rep.leverage
    assert rep.sampling == {}  # the pool stayed uniform without a try
    assert lev["M"] in [lv["M"] for lv in rep.chosen["levels"]]
    assert 1 <= lev["distinct"] <= lev["M"] and lev["seconds"] > 0
    chose = "leverage" if lev["error"] < lev["uniform_error"] else "uniform"
    assert winner == "scored" or chose == winner
    assert rep.chosen["centers"] == ("leverage (check)" if chose == "leverage" else "uniform")
    if chose == "leverage":
        assert model.center_weights is not None and model.centers.shape[0] == lev["distinct"]
        # the centers are selection rows (raw units): each is a row of train_x
        dist = torch.cdist(model.centers.to(torch.float64), x)
        assert float(dist.min(dim=1).values.max()) < 1e-6 * float(x.abs().max())
    else:
        assert model.center_weights is None and model.centers.shape[0] == lev["M"]
    # the returned fit is the Nystrom KRR solution for its centers, whatever they are
    # (fitted values: CG stops at tol 1e-4, so compare K_nM alpha, not the ill-conditioned alpha)
    with torch.no_grad():
        knm = dense_kernel(model.kernel, model.train_inputs[0], model.centers)
        alpha_ref = _dense_alpha(model, model.train_targets - model.mean_constant)
        fitted, fitted_ref = knm @ model.alpha.reshape(-1), knm @ alpha_ref.reshape(-1)
    assert float((fitted - fitted_ref).norm() / fitted_ref.norm()) < 1e-3
    with pytest.raises(TypeError, match="leverage_check"):
        auto_fit(x, y, leverage_check="yes", **SMALL)


@pytest.mark.parametrize("case", ["level", "leverage-check", "user-kernel"])
def test_auto_fit_final_cg_starts_from_the_chosen_selection_fit(monkeypatch, case):
    """The final fit's CG starts from the coefficients of the chosen level's selection fit (or of the leverage
    check's fit whose centers it takes), carried to raw units: CG's initial residual is below a cold start's 1,
    the start's function is close to the final model's on new points (a wrong unit conversion, e.g. missing
    the 1 / y_sd, puts it 35x off: the targets here have std 35 and mean 1000), and the returned model is
    still the dense Nystrom solution. CG is forced (the cost model would pick the direct solve here). With a
    user's kernel (not a ScaleKernel; the inputs are not standardised, the final fit wraps it in one) likewise."""
    import gpfalkon.operators.nystrom as nystrom_module

    monkeypatch.setattr(nystrom_module, "choose_method", lambda *a, **k: "cg")
    if case == "leverage-check":
        real = auto_scoring._val_mse
        _script_val_mse(monkeypatch, lambda model, x, y: 0.0 if model.center_weights is not None else real(model, x, y))
    starts: list[tuple[FalkonGP, torch.Tensor]] = []
    real_fit = FalkonGP.fit

    def spy(self, *args, **kwargs):
        if kwargs.get("initial_alpha") is not None:
            starts.append((self, kwargs["initial_alpha"].detach().clone()))
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(FalkonGP, "fit", spy)
    x, y, _ = _data(800)
    extra = {}
    if case == "user-kernel":
        kern = gpytorch.kernels.RBFKernel(ard_num_dims=3).double()
        kern.lengthscale = x.std(0)
        extra["kernel"] = kern
    model = auto_fit(x, y, **SMALL, leverage_check=case == "leverage-check", center_sampling="uniform", **extra)
    assert model.auto_report.chosen["centers"] == ("leverage (check)" if case == "leverage-check" else "uniform")
    if case == "user-kernel":
        assert isinstance(model.kernel, gpytorch.kernels.ScaleKernel)
        assert isinstance(model.kernel.base_kernel, gpytorch.kernels.RBFKernel)
    assert starts and starts[-1][0] is model
    start = starts[-1][1]
    assert start.shape == model.alpha.shape
    assert float(model.fit_info.residuals[0].max()) < 0.5
    xt, _, _ = _data(300, seed=1)
    k_t = dense_kernel(model.kernel, xt, model.centers)
    # the variance calibration after the fit scaled the kernel by c and alpha by 1 / c (the same mean)
    f_start = k_t @ start.reshape(-1) / model.auto_report.chosen["variance_scale"]
    f_final = k_t @ model.alpha.reshape(-1)
    assert float((f_start - f_final).norm() / f_final.norm()) < 0.2
    with torch.no_grad():
        knm = dense_kernel(model.kernel, model.train_inputs[0], model.centers)
        alpha_ref = _dense_alpha(model, model.train_targets - model.mean_constant)
        fitted, fitted_ref = knm @ model.alpha.reshape(-1), knm @ alpha_ref.reshape(-1)
    assert float((fitted - fitted_ref).norm() / fitted_ref.norm()) < 1e-3


@pytest.mark.parametrize("mode", ["auto-leverage", "auto-uniform", "auto-scored", "leverage"])
def test_auto_fit_center_sampling_pool_chosen_on_validation(monkeypatch, mode):
    """center_sampling: at the first size the leverage-score pool is scored against the uniform one;
    every later size and the final fit draw from the pool with the lower validation error ("auto",
    forced either way or scored for real) or from the leverage pool ("leverage"). The final model's
    centers are the first M draws of that pool, the preconditioner weights come with leverage centers,
    and its fit is the dense Nystrom KRR solution for those centers."""

    real = auto_scoring._val_mse
    forced = {"auto-leverage": 0.0, "auto-uniform": math.inf}

    def val_mse(model, x, y):
        if mode in forced and model.center_weights is not None:  # only leverage pools carry weights
            return forced[mode]
        return real(model, x, y)

    _script_val_mse(monkeypatch, val_mse)
    pools = []
    real_nested = auto_leverage.nested_leverage_centers

    def nested(*args, **kwargs):
        pools.append(real_nested(*args, **kwargs))
        return pools[-1]

    patch_auto(monkeypatch, "nested_leverage_centers", nested)
    x, y, _ = _data(800)
    sampling = "leverage" if mode == "leverage" else "auto"
    model = auto_fit(x, y, center_sampling=sampling, **SMALL)
    rep = model.auto_report
    smp = rep.sampling
    levels = rep.chosen["levels"]
    assert smp["M"] == levels[0]["M"] and smp["seconds"] > 0 and smp["distinct"] >= smp["M"]
    assert 0 < smp["d_eff"] < rep.n_train
    want = "leverage" if mode in ("auto-leverage", "leverage") else "uniform"
    if mode == "auto-scored":
        want = "leverage" if smp["leverage_error"] < smp["uniform_error"] else "uniform"
    assert smp["chosen"] == want and rep.chosen["centers"] == want
    assert all(lv["centers"] == want for lv in levels)
    # the first size was fitted with both pools; every later size only with the chosen one
    kinds = {(r["M"], r["centers"]) for r in rep.search}
    assert (levels[0]["M"], "uniform") in kinds and (levels[0]["M"], "leverage") in kinds
    assert all(k == want for m, k in kinds if m != levels[0]["M"])
    assert len(levels) >= 2  # the growth ran on the chosen pool
    m_fin = rep.chosen["num_centers"]
    assert len(pools) == 1  # one stream of draws, drawn once
    if want == "leverage":
        assert model.center_weights is not None and model.centers.shape[0] == m_fin
        dist = torch.cdist(model.centers.to(torch.float64), x)
        assert float(dist.min(dim=1).values.max()) < 1e-6 * float(x.abs().max())
        # the final fit carries the weights D of the pool's first m_fin draws (the selection rows' D, unchanged)
        n_s = int(pools[0].probabilities.numel())
        sel = pools[0].select(torch.zeros(n_s, 1, dtype=torch.float64), m_fin)
        assert torch.equal(model.center_weights.to(sel.weights.dtype), sel.weights)
    else:
        assert model.center_weights is None
    with torch.no_grad():
        knm = dense_kernel(model.kernel, model.train_inputs[0], model.centers)
        alpha_ref = _dense_alpha(model, model.train_targets - model.mean_constant)
        fitted, fitted_ref = knm @ model.alpha.reshape(-1), knm @ alpha_ref.reshape(-1)
    assert float((fitted - fitted_ref).norm() / fitted_ref.norm()) < 1e-3


def test_auto_fit_center_sampling_validation_and_skips():
    x, y, _ = _data(400)
    with pytest.raises(ValueError, match="center_sampling"):
        auto_fit(x, y, center_sampling="kmeans", **SMALL)
    # learned centers lead the uniform pool: no leverage try, said in the notes
    model = auto_fit(x, y, learn_centers=True, **SMALL)
    assert model.auto_report.sampling == {} and model.auto_report.chosen["centers"] == "uniform"
    assert any("leverage-score centers not tried" in n for n in model.auto_report.notes)


@pytest.mark.parametrize("branch", ["scores-fail", "few-draws", "no-room", "fit-fails"])
def test_auto_fit_leverage_pool_skips_and_failures(monkeypatch, branch):
    """The leverage try's edge paths: a failed score pass, too few distinct draws for M, draws that leave no
    room to grow, or a leverage fit that fails (non-finite validation error, also under "leverage") keep
    the uniform pool, say why in the notes, and still return a fitted model with no weights D."""
    from gpfalkon.centers import NestedLeverageCenters

    real_nested, real_val = auto_leverage.nested_leverage_centers, auto_scoring._val_mse
    if branch == "scores-fail":
        def broken(*args, **kwargs):
            raise RuntimeError("no scores today")
        patch_auto(monkeypatch, "dictionary_leverage_scores", broken)
    elif branch in ("few-draws", "no-room"):
        def truncated(scores, max_centers, **kwargs):
            full = real_nested(scores, max_centers, **kwargs)
            keep = 30 if branch == "few-draws" else 70  # first size M = 60, room needs 120
            stream = full.stream[: int(full.first_draw[keep - 1]) + 1]
            return NestedLeverageCenters(full.indices[:keep], full.first_draw[:keep], stream, full.probabilities)
        patch_auto(monkeypatch, "nested_leverage_centers", truncated)
        # and a leverage fit that would win on validation if it were allowed
        _script_val_mse(monkeypatch, lambda m, xv, yv: 0.0 if m.center_weights is not None else real_val(m, xv, yv))
    else:
        _script_val_mse(monkeypatch,
                        lambda m, xv, yv: math.inf if m.center_weights is not None else real_val(m, xv, yv))
    x, y, _ = _data(600)
    sampling = "leverage" if branch == "fit-fails" else "auto"
    model = auto_fit(x, y, center_sampling=sampling, **SMALL)
    rep = model.auto_report
    want = {"scores-fail": "leverage-score centers failed: RuntimeError: no scores today",
            "few-draws": "the draws gave 30 distinct rows, fewer than M=60",
            "no-room": "leave no room to double M=60",
            "fit-fails": "their fit at M=60 failed"}[branch]
    assert any(want in note for note in rep.notes), rep.notes
    assert rep.chosen["centers"] == "uniform" and model.center_weights is None
    assert all(lv["centers"] == "uniform" for lv in rep.chosen["levels"])
    assert model.fitted and torch.isfinite(model.alpha).all()


def test_score_uniformity_closed_form():
    """``_score_uniformity``: ``(sum s)^2 / (k sum s^2)``, i.e. ``1 / (1 + cv^2)`` with the scores' population
    coefficient of variation; 1 for equal scores, ``1 / k`` for one non-zero score, 0 for none."""
    from gpfalkon.auto.sampling import _score_uniformity

    assert _score_uniformity(torch.full((7,), 0.3, dtype=torch.float64)) == pytest.approx(1.0)
    assert _score_uniformity(torch.tensor([0.0, 0.0, 2.0, 0.0])) == pytest.approx(0.25)
    assert _score_uniformity(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(36 / 42)
    assert _score_uniformity(torch.zeros(5)) == 0.0
    s = torch.rand(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cv = float(s.std(unbiased=False) / s.mean())
    assert _score_uniformity(s) == pytest.approx(1 / (1 + cv**2), rel=1e-12)


@pytest.mark.parametrize("sampling", ["auto", "leverage"])
def test_auto_fit_leverage_try_stops_at_nearly_uniform_scores(monkeypatch, sampling):
    """With ``center_sampling="auto"``, scores of the first quarter whose uniformity is at least
    ``LEVERAGE_UNIFORM`` end the leverage try there (a note, ``report.sampling`` with the uniformity and the
    uniform pool, no leverage selection fit, no second scoring pass); scores just below it (a spread of
    ``cv = 0.6``, uniformity 0.735) are scored in full and the leverage pool fitted. ``"leverage"`` never stops
    there: the user asked for leverage-score centers."""

    calls: list = []
    spread = [0.0]

    def scores(*args, rows=None, **kwargs):
        calls.append(rows)
        n = int(rows.numel())
        # alternating 1 - a, 1 + a (times 0.5): coefficient of variation a, uniformity 1 / (1 + a^2)
        sign = torch.ones(n, dtype=torch.float64)
        sign[1::2] = -1.0
        return 0.5 * (1.0 + spread[0] * sign)

    patch_auto(monkeypatch, "dictionary_leverage_scores", scores)
    x, y, _ = _data(600)
    n_s = SMALL["select_rows"]
    for a in (0.3, 0.6):
        spread[0] = a
        calls.clear()
        model = auto_fit(x, y, center_sampling=sampling, **SMALL)
        rep = model.auto_report
        u = 1 / (1 + a * a)
        assert rep.sampling["uniformity"] == pytest.approx(u, rel=1e-9), rep.notes
        kinds = {r["centers"] for r in rep.search}
        if sampling == "auto" and u >= auto_sampling.LEVERAGE_UNIFORM:
            assert len(calls) == 1 and torch.equal(calls[0], torch.arange(n_s // 4))
            assert any(n.startswith(f"leverage-score centers not tried: the scores of {n_s // 4:,} of the {n_s:,} "
                                    "selection rows are nearly uniform") for n in rep.notes), rep.notes
            assert rep.sampling["chosen"] == "uniform" and "leverage_error" not in rep.sampling
            assert kinds == {"uniform"} and model.center_weights is None
        else:
            assert len(calls) == 2, rep.notes
            assert "leverage" in kinds and math.isfinite(rep.sampling["leverage_error"])
            assert not any("nearly uniform" in n for n in rep.notes)
        assert model.fitted and torch.isfinite(model.alpha).all()


@pytest.mark.parametrize("slow", [False, True])
def test_auto_fit_leverage_scores_a_timed_quarter_first(monkeypatch, slow):
    """The leverage scores are computed on the first quarter of the selection rows, timed, and on the rest only
    where the rest (predicted linearly in the rows) and a fit at M end before the deadline. A clock that jumps
    3,000 s during the first quarter (of a 10,000 s budget) predicts 9,000 s more: the pass stops there, with a
    note, and the uniform pool stays; without the jump both parts are scored, in row order."""
    import types


    offset = [0.0]
    patch_auto(monkeypatch, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter()
                                                                   + offset[0]))
    real = auto_leverage.dictionary_leverage_scores
    calls = []

    def scores(*args, rows=None, **kwargs):
        calls.append(rows)
        out = real(*args, rows=rows, **kwargs)
        if slow:
            offset[0] += 3000.0
        return out

    patch_auto(monkeypatch, "dictionary_leverage_scores", scores)
    x, y, _ = _data(600)
    model = auto_fit(x, y, center_sampling="auto", **SMALL)
    rep = model.auto_report
    n_s = SMALL["select_rows"]  # 480 training rows, 400 selection rows
    if slow:
        assert len(calls) == 1 and torch.equal(calls[0], torch.arange(n_s // 4))
        assert any(n.startswith(f"leverage-score centers not tried: the scores of {n_s // 4:,} of the {n_s:,} "
                                "selection rows took") for n in rep.notes), rep.notes
        assert rep.sampling == {} and rep.chosen["centers"] == "uniform" and model.center_weights is None
    else:
        assert [(int(c[0]), int(c[-1])) for c in calls] == [(0, n_s // 4 - 1), (n_s // 4, n_s - 1)]
        assert rep.sampling["M"] == rep.chosen["levels"][0]["M"]
        assert not any("leverage-score centers not tried" in n for n in rep.notes)
    assert model.fitted and torch.isfinite(model.alpha).all()


@pytest.mark.parametrize("fails", [False, True])
def test_auto_fit_reuses_stores_only_within_the_call(monkeypatch, fails):
    """auto_fit runs inside reuse_stores(): its fits hand K_nM stores on; when it returns (or raises, here from
    the level callback) nothing is kept and no block is left open."""
    import gpfalkon.backend.engine as eng_mod

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)  # the small test stores count as large
    taken = []
    real = eng_mod._take_pooled

    def take(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(eng_mod, "_take_pooled", take)

    def callback(level, build):
        raise RuntimeError("callback failed")

    x, y, _ = _data(600)
    if fails:
        with pytest.raises(RuntimeError, match="callback failed"):
            auto_fit(x, y, level_callback=callback, **SMALL)
    else:
        model = auto_fit(x, y, **SMALL)
        assert model.fitted and any(taken)  # the selection fits of one size reused a store
    assert eng_mod.kept_stores() == [] and eng_mod.reuse_depth() == 0


def test_auto_fit_leverage_with_learned_centers_is_an_error():
    x, y, _ = _data(300)
    with pytest.raises(ValueError, match="center_sampling='leverage' needs learn_centers=False"):
        auto_fit(x, y, center_sampling="leverage", learn_centers=True, **SMALL)


@pytest.mark.parametrize("gain,grows", [(0.08, True), (0.03, False)])
def test_auto_fit_min_gain_is_per_doubling(monkeypatch, gain, grows):
    """A budget- or cap-limited step by f = 1.5 needs min_gain * log2(1.5) = 5.85 % (min_gain 10 %):
    an 8 % gain keeps the level (the growth then ends at max_centers), a 3 % gain stops it with a note
    that states the scaled threshold. Validation errors are scripted per number of centers."""

    errors = {60: 1.0, 90: 1.0 - gain}
    _script_val_mse(monkeypatch, lambda model, xv, yv: errors.get(int(model.centers.shape[0]), 2.0))
    x, y, _ = _data(500)
    kwargs = dict(SMALL, max_centers=90, min_gain=0.1, center_sampling="uniform")
    model = auto_fit(x, y, **kwargs)
    rep = model.auto_report
    ms = [lv["M"] for lv in rep.chosen["levels"]]
    assert ms == [60, 90]
    stop = [n for n in rep.notes if n.startswith("centers stopped")]
    if grows:
        assert stop == ["centers stopped at M=90: max_centers"] and rep.chosen["num_centers"] == 90
    else:
        assert len(stop) == 1 and "gained less than 5.8% over M=60 (min_gain 10% per doubling)" in stop[0]


@pytest.mark.parametrize("paths", [False, True])
@pytest.mark.parametrize("tol", [0.0, 2e-3])
def test_auto_fit_search_tol_ends_a_flat_search(monkeypatch, tol, paths):
    """Validation errors scripted by the noise alone: every halving of it lowers the error by
    1e-4 * log(2) relative (flat) and the multiplier changes nothing. With ``search_tol=0`` the noise
    search at the first size keeps stepping down (it extends while the error falls at all); with
    ``search_tol=2e-3`` each noise search ends after its first steps and keeps their lower error. One fit per
    step (``noise_paths=False``): the first size tries exactly the start, start / 4 (first search) and start / 8
    (the finer one). By penalty paths: start / 16 ... 16 start in one path of four, then start / 32 and start / 8
    in one of two (both sides at once), and keeps start / 32."""

    def scripted(model, xv, yv):
        noise = float(model.penalty.detach()) * model.n
        return 1.0 + 1e-4 * math.log(noise)

    _script_val_mse(monkeypatch, scripted)
    x, y, _ = _data(500)
    model = auto_fit(x, y, **dict(SMALL, max_steps=0, objectives=("sgpr",), center_sampling="uniform",
                                  max_centers=60, search_tol=tol, noise_paths=paths))
    rep = model.auto_report
    first = [r for r in rep.search if r["M"] == 60]
    start = first[0]["noise"]
    ratios = sorted({round(start / r["noise"], 6) for r in first})
    if tol == 0.0:
        assert max(ratios) > 1e3, ratios  # many steps down (to the deadline or the lower bound 1e-8)
    elif not paths:
        assert ratios == [1.0, 4.0, 8.0], ratios
        assert len(first) == 5  # start, one step down, multiplier down and up (no gain), one finer step down
        assert rep.chosen["noise"] == pytest.approx(start / 8, rel=1e-9)  # the lower error is kept
    else:
        assert ratios == [0.0625, 0.25, 1.0, 4.0, 8.0, 16.0, 32.0], ratios
        assert [r.get("path") for r in first] == [None, 4, 4, 4, 4, None, None, 2, 2]
        assert rep.chosen["noise"] == pytest.approx(start / 32, rel=1e-9)
    assert all(r.get("path") is None for r in first) or paths


def test_path_steps_scores_both_sides_then_extends_the_best_edge():
    """The noise search's steps (:func:`gpfalkon.auto.scoring._path_steps`) on scripted errors: both sides first, then
    ``width`` more steps beyond a best outermost step while it gains more than ``tol`` over its neighbour; only the
    allowed steps; a batch that does not fit loses its outermost steps (both sides' in the first batch), and
    ``None`` where not even the nearest steps of the first batch fit."""
    from gpfalkon.auto.scoring import _path_steps

    def run(err, width=2, allowed=lambda j: True, fits=lambda k: True, tol=0.0):
        batches: list[list[int]] = []

        def score(steps):
            batches.append(list(steps))
            return [err(j) for j in steps]

        return _path_steps(score, err(0), width, allowed, fits, tol), batches

    (best, errors), batches = run(lambda j: (j - 3) ** 2 + 1.0)
    assert best == 3 and batches == [[-2, -1, 1, 2], [3, 4]] and sorted(errors) == [-2, -1, 0, 1, 2, 3, 4]
    (best, _), batches = run(lambda j: (j + 5) ** 2 + 1.0)  # downwards, two extensions
    assert best == -5 and batches == [[-2, -1, 1, 2], [-3, -4], [-5, -6]]
    (best, _), batches = run(lambda j: 1.0 - 1e-4 * j, tol=2e-3)  # the edge is best by less than tol: it ends
    assert best == 2 and batches == [[-2, -1, 1, 2]]
    (best, _), batches = run(lambda j: 1.0 - 1e-4 * j, tol=0.0, allowed=lambda j: -1 <= j <= 5)
    assert best == 5 and batches == [[-1, 1, 2], [3, 4], [5]]
    (best, _), batches = run(lambda j: 1.0 + 0.1 * abs(j))  # the start is best: no extension
    assert best == 0 and batches == [[-2, -1, 1, 2]]
    (best, _), batches = run(lambda j: 1.0, width=1)  # ties go to the step nearest the start
    assert best == 0 and batches == [[-1, 1]]
    # the deadline: the first batch loses both sides' outermost steps, an extension its outermost
    (best, _), batches = run(lambda j: (j - 3) ** 2 + 1.0, fits=lambda k: k <= 2)
    assert best == 3 and batches == [[-1, 1], [2, 3], [4, 5]]
    assert run(lambda j: float(j), fits=lambda k: k <= 1)[0] is None
    calls = iter([False, True])  # the first batch fits at its nearest steps, then no extension fits at all
    (best, _), batches = run(lambda j: (j - 3) ** 2 + 1.0, fits=lambda k: next(calls, False))
    assert batches == [[-1, 1]] and best == 1


@pytest.mark.parametrize("method", ["auto", "cg"])
def test_auto_fit_noise_paths_score_each_noise_as_its_own_fit(monkeypatch, method):
    """A noise scored in a penalty path has the validation error a fit of its own at that noise has: the same
    deterministic call (a budget that no stage reaches) with and without ``noise_paths`` scores its start and its
    first step down both ways; the errors agree to CG's tolerance. At this size the cost model solves directly;
    with CG forced (``"cg"``: one block CG, a preconditioner per column) the same holds once CG converges (an
    iteration cap past its 30-70 iterations): capped short of convergence, a block CG's columns and one CG each
    differ by rounding that small penalties amplify, 2e-4 relative at 25 iterations with torch's kernel products
    on the CPU (seen on the GPU machine's CPU and here with ``GPFALKON_FUSED_CPU=0``)."""
    import gpfalkon.operators.nystrom as nystrom_module

    if method == "cg":
        monkeypatch.setattr(nystrom_module, "choose_method", lambda *a, **k: "cg")
    x, y, _ = _data(500)
    kw = dict(SMALL, max_steps=5, objectives=("gcv",), center_sampling="uniform", max_centers=60, tol=1e-10,
              score_max_iter=300)
    reps = [auto_fit(x, y, noise_paths=paths, **kw).auto_report for paths in (False, True)]
    assert all(r["iterations"] < 300 for rep in reps for r in rep.search if not r["direct"]), "CG did not converge"
    errors = [{(round(math.log(r["noise"]), 6), round(math.log(r["multiplier"]), 6)): r for r in rep.search
               if r["M"] == 60} for rep in reps]
    common = set(errors[0]) & set(errors[1])
    by_path = [k for k in common if errors[1][k].get("path")]
    assert by_path, (sorted(errors[0]), sorted(errors[1]))
    assert all(errors[1][k]["direct"] == (method == "auto") for k in by_path)
    rel = 1e-6
    for k in common:
        assert errors[1][k]["error"] == pytest.approx(errors[0][k]["error"], rel=rel), k
    # the tolerance tells the noises apart: the errors of one path's noises differ by far more
    path_errors = sorted(r["error"] for r in errors[1].values() if r.get("path") == 4)
    assert len(path_errors) == 4 and all(b > a * (1 + 100 * rel) for a, b in itertools.pairwise(path_errors)), \
        path_errors


@pytest.mark.parametrize("how", ["path fails", "no path fits"])
def test_auto_fit_noise_search_falls_back_to_single_fits(monkeypatch, how):
    """A penalty path that raises leaves its noises to the line search's single fits (a note names the failure);
    where not even one step each way fits a path (``_path_steps`` gives ``None``), the same. Either way the
    search scores noises one fit at a time and the call returns a model."""

    if how == "path fails":
        real = auto_scoring._path_quiet

        def failing(model, penalties, time_limit, initial_alpha):
            if time_limit is None:  # the selection's paths (a growth check's path has a time limit)
                raise RuntimeError("scripted breakdown")
            return real(model, penalties, time_limit, initial_alpha)

        patch_auto(monkeypatch, "_path_quiet", failing)
    else:
        patch_auto(monkeypatch, "_path_steps", lambda *a, **k: None)
    x, y, _ = _data(500)
    model = auto_fit(x, y, **dict(SMALL, max_steps=5, objectives=("gcv",), center_sampling="uniform",
                                  max_centers=60))
    rep = model.auto_report
    first = [r for r in rep.search if r["M"] == 60]
    assert not any(r.get("path") for r in first)
    assert len({round(math.log(r["noise"]), 6) for r in first}) >= 2  # the start and at least one single step
    failed = [n for n in rep.notes if n.startswith("selection path M=60")]
    if how == "path fails":
        assert failed and "failed (RuntimeError: scripted breakdown); single fits instead" in failed[0], rep.notes
    else:
        assert not failed
    assert bool(torch.isfinite(model.alpha).all())


def test_scaled_fit_seconds_scales_each_part_by_its_own_power():
    """The selection-fit prediction: factorisations x f^3 (the fresh build's, a cached factor costs
    less), triangular solves x f^2, the rest x f rho (the slowest record's own parts); a direct solve
    whole x f^2 rho; nothing recorded, 0. Checked against the closed form by hand."""
    from gpfalkon.auto.costs import _scaled_fit_seconds

    fresh = dict(seconds=2.0, precond_seconds=0.5, apply_seconds=0.3, direct=False)
    cached = dict(seconds=2.4, precond_seconds=0.1, apply_seconds=0.4, direct=False)  # the slowest
    f, rho = 2.0, 1.5
    expected = 0.5 * f**3 + 0.4 * f**2 + (2.4 - 0.1 - 0.4) * f * rho
    assert _scaled_fit_seconds([fresh, cached], f, rho) == pytest.approx(expected)
    assert _scaled_fit_seconds([fresh], 1.0) == pytest.approx(2.0)  # no growth: the measured fit
    # a record without the parts (all rest): linear in f and rho
    assert _scaled_fit_seconds([dict(seconds=1.0)], 3.0, 2.0) == pytest.approx(6.0)
    assert _scaled_fit_seconds([dict(seconds=1.0, direct=True)], 3.0, 2.0) == pytest.approx(18.0)
    assert _scaled_fit_seconds([], 2.0) == 0.0
    # the parts never make the rest negative (a clock read around a fit can trail its parts)
    assert _scaled_fit_seconds([dict(seconds=1.0, precond_seconds=0.8, apply_seconds=0.4)], 2.0) == pytest.approx(
        0.8 * 8 + 0.4 * 4)


def test_scaled_fit_seconds_takes_the_median_fresh_build_and_the_measured_factor_growth():
    """The factorisations' part: the median of the records whose factorisations took at least half the largest
    (fresh builds; a cached factor's fit pays about a third, a single slow build is an outlier), scaled by
    f^log2(g) for a measured growth g = t(2M) / t(M) (f^3 at g = 8). Closed forms by hand."""
    from gpfalkon.auto.costs import _factor_scale, _scaled_fit_seconds

    assert _factor_scale(2.0, 6.4) == pytest.approx(6.4)
    assert _factor_scale(4.0, 6.4) == pytest.approx(6.4**2)
    assert _factor_scale(3.0) == pytest.approx(27.0)
    assert _factor_scale(1.0, 5.0) == pytest.approx(1.0)
    pres = [0.030, 0.010, 0.033, 0.046, 0.011]  # three fresh builds (>= 0.023), two cached
    recs = [dict(seconds=0.1 + p, precond_seconds=p, apply_seconds=0.02) for p in pres]
    slow = max(recs, key=lambda r: r["seconds"])
    rest = slow["seconds"] - slow["precond_seconds"] - 0.02
    for g in (8.0, 6.4, 4.0):
        expected = 0.033 * 2.5 ** math.log2(g) * (1 + 2) / 2 + 0.02 * 2.5**2 * 2 + rest * 2.5 * 1.2
        assert _scaled_fit_seconds(recs, 2.5, 1.2, columns=2, factor_growth=g) == pytest.approx(expected)


def test_factor_growth_measures_the_cholesky_ratio_on_its_clock(monkeypatch):
    """_factor_growth times a Cholesky at m and 2m (the fastest of its repeats, after an untimed one each) and
    returns their ratio within [4, 8]: on a fake clock where a factorisation of size s takes (s / 1000)^p seconds
    it returns 2^p, clamped; past FACTOR_PROBE_MAX or below 64 it returns 8 without factorising; on the real clock
    it lies in [4, 8]."""
    import types


    assert 4.0 <= auto_costs._factor_growth(200, torch.device("cpu")) <= 8.0
    clock = [0.0]
    sizes: list[int] = []
    power = [2.5]

    def fake_cholesky(a: torch.Tensor) -> torch.Tensor:
        sizes.append(a.shape[-1])
        clock[0] += (a.shape[-1] / 1000) ** power[0]
        return a

    monkeypatch.setattr(torch.linalg, "cholesky", fake_cholesky)
    patch_auto(monkeypatch, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert auto_costs._factor_growth(500, torch.device("cpu"), repeats=3) == pytest.approx(2**2.5)
    assert sorted(set(sizes)) == [500, 1000] and len(sizes) == 2 * (1 + 3)
    for p, expected in ((3.4, 8.0), (1.5, 4.0), (3.0, 8.0), (2.0, 4.0)):
        power[0] = p
        assert auto_costs._factor_growth(300, torch.device("cpu")) == pytest.approx(expected)
    sizes.clear()
    assert auto_costs._factor_growth(auto_costs.FACTOR_PROBE_MAX + 1, torch.device("cpu")) == 8.0
    assert auto_costs._factor_growth(63, torch.device("cpu")) == 8.0
    assert sizes == []


def test_auto_fit_measures_the_factor_growth_once_per_size(monkeypatch):
    """auto_fit's predictions take the factorisations' growth from _factor_growth, measured once per base size of a
    call (on the fit's device) however many predictions read it."""

    calls: list[tuple[int, str]] = []

    def recorder(m: int, device: torch.device, repeats: int = 2) -> float:
        calls.append((m, device.type))
        return 8.0

    patch_auto(monkeypatch, "_factor_growth", recorder)
    x, y, _ = _data(800)
    rep = auto_fit(x, y, **SMALL).auto_report
    sizes = sorted({r["M"] for r in rep.search})
    assert calls and all(dev == "cpu" for _, dev in calls)
    assert len(calls) == len({m for m, _ in calls}) and {m for m, _ in calls} <= set(sizes)
    assert rep.chosen["final_predicted_seconds"] > 0


def _race(**race: object) -> tuple[int, dict, dict]:
    """A two-objective race on a small subsample (eval_every 2, 5 rounds, the leader moving on at once):
    ``(eval_every, the dropped objective's record, the other's)``."""
    x, y, _ = _data(1200, noise=0.3)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=60, eval_every=2, race_rounds=5,
              objectives=("gcv", "sgpr"), level_share=1e-9, **race)
    racers = auto_fit(x, y, **kw).auto_report.learn[1:3]
    assert {r["objective"] for r in racers} == {"gcv", "sgpr"}
    dropped = [r for r in racers if r["stopped"].startswith("dropped")]
    assert len(dropped) == 1, [(r["objective"], r["steps"], r["stopped"]) for r in racers]
    return kw["eval_every"], dropped[0], next(r for r in racers if r is not dropped[0])


@pytest.mark.parametrize("share", [None, 1e-9])
def test_auto_fit_race_share_ends_the_race_after_its_share_of_the_learning_time(share, monkeypatch):
    """With race_share, the race ends after the first round that ends past that share of the learning stage's
    time (here: the first round) and the leader goes on alone, moving to more rows as after a full race; with
    None (and no race_margin) the race runs its race_rounds. (Every racer races here: the cut of racers whose first
    round does not fit the share, ``_racers_within``, is its own test below.)"""

    patch_auto(monkeypatch, "_racers_within", lambda first_round, racers, seconds: racers)
    every, loser, winner = _race(race_margin=None, race_share=share)
    assert loser["best_error"] >= winner["best_error"]
    if share is None:
        assert loser["stopped"] == f"dropped after 5 rounds (leader: {winner['objective']})"
        assert loser["steps"] == 5 * every
    else:
        assert loser["stopped"] == (f"dropped after 1 rounds: the race used race_share (1e-09) of the learning "
                                    f"stage (leader: {winner['objective']})")
        assert loser["steps"] == every
        assert winner["steps"] < 5 * every and "continued on 200 rows" in winner["stopped"]


def test_racers_within_counts_the_rounds_that_fit():
    """As many racers as rounds of the first one's time fit the race's seconds: at least one, at most all."""
    from gpfalkon.auto.race import _racers_within

    assert _racers_within(0.5, 4, 2.1) == 4
    assert _racers_within(0.6, 4, 2.1) == 3
    assert _racers_within(0.6, 4, 1.19) == 1
    assert _racers_within(0.6, 4, 0.1) == 1 and _racers_within(0.6, 4, -1.0) == 1
    assert _racers_within(0.0, 3, 1.0) == 3 and _racers_within(0.5, 3, math.inf) == 3


def test_auto_fit_races_only_the_racers_whose_first_round_fits_the_race_share():
    """Where one round of every racer does not fit ``race_share`` of the learning stage (a share of 1e-9: none
    does), only the first racer races: the others take no step, are recorded as not raced, and the first goes on
    alone as a leader (on twice the rows at once: ``level_share``). Without a race (one objective) nothing is cut;
    with ``race_share=None`` nothing is cut."""
    x, y, _ = _data(1200, noise=0.3)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=60, eval_every=2, race_rounds=5,
              objectives=("gcv", "sgpr"), level_share=1e-9, race_margin=None)
    learn = auto_fit(x, y, race_share=1e-9, **kw).auto_report.learn
    first, second = learn[1], learn[2]
    assert (first["objective"], second["objective"]) == ("gcv", "sgpr")
    assert second["steps"] == 0 and second["stopped"].startswith("not raced: a round of the first racer took")
    assert "1 of the 2 racers' first round fits in race_share (1e-09)" in second["stopped"]
    assert first["steps"] == 2 and "continued on 200 rows" in first["stopped"]
    learn = auto_fit(x, y, race_share=None, **kw).auto_report.learn
    assert all(r["steps"] > 0 and not r["stopped"].startswith("not raced") for r in learn[1:3])


@pytest.mark.parametrize("share", [0.0, 1.5, True, "half"])
def test_auto_fit_rejects_a_bad_race_share(share):
    x, y, _ = _data(200)
    with pytest.raises(ValueError, match="race_share"):
        auto_fit(x, y, race_share=share, **SMALL)


@pytest.mark.parametrize("margin", [None, 1e-9])
def test_auto_fit_race_margin_drops_a_worse_objective_early(margin):
    """With race_margin, the objective whose best validation error after two rounds exceeds the leader's by
    more than the margin stops then (2 x eval_every steps) and the leader goes on alone, moving to more
    rows as after a full race; with None the race runs its race_rounds."""
    every, loser, winner = _race(race_margin=margin)
    if margin is None:
        assert loser["stopped"] == f"dropped after 5 rounds (leader: {winner['objective']})"
        assert loser["steps"] == 5 * every
    else:
        assert loser["stopped"].startswith("dropped after 2 rounds") and "race_margin" in loser["stopped"]
        assert loser["steps"] == 2 * every
        # the leader, alone, moves on to twice the rows right away (level_share ~ 0), before round 5
        assert winner["steps"] < 5 * every and "continued on 200 rows" in winner["stopped"]


def test_clock_bar_never_passes_its_total(monkeypatch):
    """The verbose bar's position is the elapsed time (rounded, at most the budget), set each tick: summed
    rounded increments drifted past the total and tqdm warned ("clamping frac to range [0, 1]")."""
    import types
    import warnings


    now = [0.0]
    patch_auto(monkeypatch, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = auto_reporting._Clock(2.0, verbose=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(1, 40):
            now[0] = 0.07 * k + 1e-12 * k  # steps that do not add up exactly in binary
            clock.tick("stage", step=k)
            assert clock.bar.n <= clock.bar.total
        clock.close()
    assert clock.bar.n == clock.bar.total == 2.0


def test_auto_fit_a_racer_with_its_own_lr_is_the_objective_at_that_lr():
    """An ``(name, lr)`` racer is the objective run by Adam at that learning rate: alone, it learns exactly
    what the plain name does with ``lr=`` set to it (same curve, same choice), and its records name it."""
    x, y, _ = _data(600, noise=0.3)
    kw = dict(SMALL, hyper_rows=150, hyper_centers=20, max_steps=20, eval_every=5)
    pair = auto_fit(x, y, objectives=(("gcv", 0.3),), **kw).auto_report
    plain = auto_fit(x, y, objectives=("gcv",), lr=0.3, **kw).auto_report
    assert [r["racer"] for r in pair.learn[1:]] == ["gcv@0.3"] * (len(pair.learn) - 1)
    assert [r["racer"] for r in plain.learn[1:]] == ["gcv"] * (len(plain.learn) - 1)
    assert all(r["lr"] == 0.3 for r in pair.learn[1:] + plain.learn[1:])
    strip = [[(s, e) for s, _t, e in r["curve"]] for r in pair.learn[1:]]
    assert strip == [[(s, e) for s, _t, e in r["curve"]] for r in plain.learn[1:]] and strip
    assert pair.chosen["lr"] == plain.chosen["lr"] == 0.3
    assert pair.chosen["step"] == plain.chosen["step"] and pair.chosen["learn_error"] == plain.chosen["learn_error"]
    assert "lr 0.3" in pair.summary()


def test_auto_fit_races_learning_rates_and_the_winner_keeps_its_rate():
    """Two racers of one objective at two learning rates: after the race the one with the lower best
    validation error goes on alone, on every larger subsample at its own rate (its records and Adam), and
    the chosen point's rate is reported."""
    from gpfalkon.auto.race import _ObjectiveRun

    x, y, _ = _data(1200, noise=0.3)
    kw = dict(SMALL, hyper_rows=100, hyper_centers=20, max_steps=60, eval_every=2, race_rounds=2,
              race_margin=None, race_share=None, level_share=1e-9)
    seen: list[tuple[str, float]] = []
    init = _ObjectiveRun.__init__

    def spy(self, *a, **k):  # the Adam each racer (and each continuation) really steps with
        init(self, *a, **k)
        seen.append((self.label, self.opt.lr))

    _ObjectiveRun.__init__ = spy
    try:
        # lr (the rate of racers named without one) is neither racer's: a continuation that fell back to it shows
        rep = auto_fit(x, y, objectives=(("gcv", 0.1), ("gcv", 0.5)), lr=0.05, **kw).auto_report
    finally:
        _ObjectiveRun.__init__ = init
    first = rep.learn[1:3]
    assert [(r["racer"], r["lr"]) for r in first] == [("gcv@0.1", 0.1), ("gcv@0.5", 0.5)]
    winner = min(first, key=lambda r: r["best_error"])
    loser = next(r for r in first if r is not winner)
    assert loser["stopped"] == f"dropped after 2 rounds (leader: {winner['racer']})" and loser["steps"] == 4
    after = rep.learn[3:]
    assert after and all((r["racer"], r["lr"]) == (winner["racer"], winner["lr"]) for r in after)
    assert seen == [("gcv@0.1", 0.1), ("gcv@0.5", 0.5)] + [(winner["racer"], winner["lr"])] * len(after)
    best = min((r for r in rep.learn[1:] if r["best_step"] > 0), key=lambda r: r["best_error"])
    assert rep.chosen["learn_error"] == best["best_error"] and rep.chosen["lr"] == best["lr"]


def test_auto_fit_default_racers_follow_lr():
    """The default racers are GCV at ``2 lr`` (``lr=0.2``: 0.4, no clash with a fixed 0.2), GCV at ``2 lr`` in
    :data:`RACE_FAMILY` where that is another family than ``kernel``'s (none for a given ``Kernel``), GCV at ``lr``
    and the SGPR bound in ``kernel``'s family, in that order (a cut race keeps the first); a list works as a pair;
    a triple names its family (its label too, where it is not ``kernel``'s); two rates that print alike get distinct
    labels; the starting point's record names itself."""
    from gpfalkon.auto.race import RACE_FAMILY, _racers

    m52 = "matern52"
    assert RACE_FAMILY == "rbf"
    assert _racers(None, 0.1, m52) == [("gcv", 0.2, "gcv@0.2", m52), ("gcv", 0.2, "gcv@0.2/rbf", "rbf"),
                                       ("gcv", 0.1, "gcv", m52), ("sgpr", 0.1, "sgpr", m52)]
    assert _racers(None, 0.2, "rbf") == [("gcv", 0.4, "gcv@0.4", "rbf"), ("gcv", 0.2, "gcv", "rbf"),
                                         ("sgpr", 0.2, "sgpr", "rbf")]
    assert _racers(None, 0.1, None) == [("gcv", 0.2, "gcv@0.2", None), ("gcv", 0.1, "gcv", None),
                                        ("sgpr", 0.1, "sgpr", None)]
    assert _racers([["gcv", 0.3]], 0.1, m52) == [("gcv", 0.3, "gcv@0.3", m52)]
    assert _racers([("gcv", 0.3, m52), ("gcv", 0.3, "matern32")], 0.1, m52) == [
        ("gcv", 0.3, "gcv@0.3", m52), ("gcv", 0.3, "gcv@0.3/matern32", "matern32")]
    for pair in ((("gcv", 0.2), ("gcv", 0.2000001)), (("gcv", 0.2000001), ("gcv", 0.2))):  # both orders
        labels = [r[2] for r in _racers(pair, 0.1, m52)]
        assert labels[0] == "gcv@0.2" and labels[1] != labels[0] and labels[1].startswith("gcv@0.2")
    x, y, _ = _data(400)
    rep = auto_fit(x, y, lr=0.2, **dict(SMALL, max_steps=4, eval_every=2, race_rounds=1)).auto_report
    assert [(r["racer"], r["lr"], r["kernel"]) for r in rep.learn[:5]] == [
        ("initial", None, m52), ("gcv@0.4", 0.4, m52), ("gcv@0.4/rbf", 0.4, "rbf"), ("gcv", 0.2, m52),
        ("sgpr", 0.2, m52)]


def test_auto_fit_races_kernel_families_and_the_winner_s_family_is_the_model_s():
    """Racers in two kernel families: the race is won on validation error as between objectives, and the family of
    the racer whose point is chosen is the returned model's kernel (its base kernel's class and ``nu``), the
    report's ``kernel`` and ``chosen["kernel"]``. Both orders of one pair of families (which is ``kernel=``'s): the
    racers do not see each other, so the same family wins in both, and in one of them it is not ``kernel=``'s."""
    from gpfalkon.auto.kernels import KERNEL_FAMILIES

    x, y, _ = _data(900, noise=0.1)
    winners = []
    for families in (("matern52", "rbf"), ("rbf", "matern52")):
        kw = dict(SMALL, hyper_rows=150, hyper_centers=20, max_steps=30, eval_every=5, race_rounds=2,
                  race_margin=None, race_share=None, kernel=families[0])
        m = auto_fit(x, y, objectives=(("gcv", 0.2, families[0]), ("gcv", 0.2, families[1])), **kw)
        rep = m.auto_report
        first = rep.learn[1:3]
        assert [r["kernel"] for r in first] == list(families)
        assert [r["racer"] for r in first] == ["gcv@0.2", f"gcv@0.2/{families[1]}"]
        # one objective, one rate, one start (the median heuristic) and one subsample: only the family tells the
        # two racers apart, so their scores after the first steps differ only where each ran its own family's kernel
        assert first[0]["curve"][1][2] != first[1]["curve"][1][2]
        best = min(rep.learn[1:], key=lambda r: r["best_error"])
        assert rep.chosen["racer"] == best["racer"] and rep.chosen["learn_error"] == best["best_error"]
        assert rep.kernel == rep.chosen["kernel"] == best["kernel"]
        want = KERNEL_FAMILIES[rep.kernel](3).base_kernel
        got = m.kernel.base_kernel
        assert type(got) is type(want) and getattr(got, "nu", None) == getattr(want, "nu", None)
        winners.append(rep.kernel)
    assert winners[0] == winners[1]


def test_auto_fit_refuses_a_target_scale_its_dtype_cannot_hold_and_warns_of_a_large_offset():
    """float32: an outputscale ~ std(y)^2 of 1e40 or a noise of 1e-40 is refused before any work, naming train_y;
    a target whose |mean| / std is beyond float32's resolution is warned about (the model stores raw targets)."""
    import time as _time

    x, y = make_data(200, 2)
    for scale in (1e20, 1e-20):
        t0 = _time.perf_counter()
        with pytest.raises(ValueError, match=r"train_y: its standard deviation .* squared is outside"):
            auto_fit(x, y * scale, budget=30.0)
        assert _time.perf_counter() - t0 < 5.0  # at once, not after the budget
    with pytest.warns(RuntimeWarning, match=r"train_y: \|mean\| / std is") as rec:
        auto_fit(x, y + 1e6, budget=1.0)
    assert all(w.filename == __file__ for w in rec if "|mean| / std" in str(w.message)), rec.list
    import warnings as _warnings

    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        auto_fit(x, y + 1e6, budget=1.0, dtype=torch.float64)
    assert not [w for w in caught if "train_y" in str(w.message)]


def test_a_users_outputscale_bound_is_scaled_with_the_targets():
    """auto_fit learns on standardised targets, so a ScaleKernel's outputscale bound holds there; the returned
    model (raw units) carries the bound scaled by std(y)^2 instead of failing at the final fit."""
    import gpytorch

    x, y = make_data(300, 2)
    for constraint, scale in ((gpytorch.constraints.GreaterThan(0.5), 1e-2),
                              (gpytorch.constraints.Interval(0.5, 2.0), 1e2)):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(), outputscale_constraint=constraint)
        m = auto_fit(x, y * scale, budget=2.0, kernel=k, dtype=torch.float64)
        c = m.kernel.raw_outputscale_constraint
        s2 = float(m.auto_report.chosen["y_scale"]) ** 2 * float(m.auto_report.chosen["variance_scale"])
        assert type(c) is type(constraint)
        torch.testing.assert_close(c.lower_bound,
                                   constraint.lower_bound.double() * float(m.auto_report.chosen["y_scale"]) ** 2)
        assert float(m.kernel.outputscale) >= float(c.lower_bound) * (1 - 1e-9)
        assert s2 > 0
        rmse = float((m.posterior_mean(x) - y * scale).square().mean().sqrt()) / (float(y.std()) * scale)
        assert rmse < 0.5


def test_a_float64_outputscale_at_its_bound_is_rescaled_with_exact_bounds():
    """GPyTorch rounds a new constraint's bounds to the default dtype (float32); the rescaled bounds of a float64
    kernel are kept exact, so an outputscale learned at the user's bound still lies within the scaled one."""
    import gpytorch

    from gpfalkon.auto.kernels import _rescale_outputscale

    cases = [(gpytorch.constraints.Interval(0.05, 2.0), 40.0, torch.float64),
             (gpytorch.constraints.LessThan(2.0), 40.0, torch.float64),
             (gpytorch.constraints.GreaterThan(0.5), -40.0, torch.float64),
             (gpytorch.constraints.Interval(0.05, 2.0), 40.0, torch.float32),
             (gpytorch.constraints.GreaterThan(0.5), -40.0, torch.float32)]
    for constraint, raw, dtype in cases:
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(), outputscale_constraint=constraint).to(dtype)
        with torch.no_grad():
            k.raw_outputscale.fill_(raw)  # saturated: the outputscale is the bound to rounding
        before = k.outputscale.detach().double()
        old = k.raw_outputscale_constraint
        lo, hi = old.lower_bound.detach().clone(), old.upper_bound.detach().clone()
        _rescale_outputscale(k, 1.3)
        c = k.raw_outputscale_constraint
        assert type(c) is type(constraint) and c.upper_bound.dtype == dtype
        torch.testing.assert_close(c.upper_bound, hi * 1.3, rtol=0.0, atol=0.0)
        torch.testing.assert_close(c.lower_bound, lo * 1.3, rtol=0.0, atol=0.0)
        assert bool(torch.isfinite(k.raw_outputscale).all())  # still learnable: a finite raw value
        torch.testing.assert_close(k.outputscale.detach().double(), before * 1.3,
                                   rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0.0)


def test_auto_fit_draws_do_not_depend_on_free_memory(monkeypatch):
    """The on-the-fly timing probe (which runs only where the final K_nM does not fit in memory) draws from its
    own generator, so a run with little memory selects what a run with plenty selects."""
    from gpfalkon import settings

    g = torch.Generator().manual_seed(41)
    x = torch.rand(3000, 3, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2 + 0.1 * torch.randn(3000, generator=g, dtype=torch.float64)
    kw = dict(budget=20.0, max_steps=0, min_centers=200, max_centers=200, final_growth=False,
              center_sampling="uniform", dtype=torch.float64, calibrate_variance=False, loo_rows=0)

    probes = []
    real = auto_costs._onthefly_pass_seconds

    def counted(*args, **kwargs):
        probes.append(1)
        return real(*args, **kwargs)

    a = auto_fit(x, y, **kw)
    patch_auto(monkeypatch, "_onthefly_pass_seconds", counted)
    with settings.memory_budget(2 * 2**20):
        b = auto_fit(x, y, **kw)
    assert probes  # the probe ran in the low-memory run
    assert torch.equal(a.centers, b.centers)
    assert a.auto_report.chosen["noise"] == b.auto_report.chosen["noise"]


@pytest.mark.parametrize("device", DEVICES)
def test_the_on_the_fly_probe_does_not_time_a_gpus_compilation(device, monkeypatch):
    """``_onthefly_pass_seconds`` on CUDA times a pass after an untimed one: the first on-the-fly pass of a process
    compiles the Triton kernels (3.5 s against 1 ms a pass on an H200), which no CG iteration of the final fit pays.
    On the CPU it times its one pass (nothing compiles there). Here the engine's first product sleeps 0.5 s."""
    import time as time_module


    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    calls = []

    class SlowFirstPass(auto_costs.KernelEngine):
        def kmn_k(self, *args, **kwargs):
            if not calls:
                time_module.sleep(0.5)
            calls.append(1)
            return super().kmn_k(*args, **kwargs)

    patch_auto(monkeypatch, "KernelEngine", SlowFirstPass)
    x = torch.rand(2000, 3, dtype=torch.float64, device=device)
    seconds = auto_costs._onthefly_pass_seconds(gpytorch.kernels.RBFKernel().double().to(device), x, x[:100])
    if torch.device(device).type == "cuda":
        assert len(calls) == 2 and 0 < seconds < 0.25, (calls, seconds)
    else:
        assert len(calls) == 1 and seconds >= 0.5, (calls, seconds)


@pytest.mark.parametrize("leverage_wins", [True, False])
def test_the_report_gives_the_validation_error_of_the_centers_returned(monkeypatch, leverage_wins):
    """Where the leverage check replaces the uniform centers, chosen['val_error'] is the leverage centers'
    (the returned model's), not the uniform level's it dropped; where it loses, the level's. The leverage check's
    validation error is scripted (its real one scaled by 1/2 or 2: whether it wins on real data depends on the
    budget's clock), a budget no stage reaches makes the call deterministic, and the returned model's centers are
    checked against the report."""

    real_mse = auto_scoring._val_mse

    def val_mse(model, x, y):
        err = real_mse(model, x, y)
        if model.center_weights is not None:  # the leverage check's fit
            return err * (0.5 if leverage_wins else 2.0)
        return err

    _script_val_mse(monkeypatch, val_mse)
    x, y, _ = _data(800)
    model = auto_fit(x, y, leverage_check=True, center_sampling="uniform", **SMALL)
    r = model.auto_report
    assert math.isfinite(r.leverage["error"]) and math.isfinite(r.leverage["uniform_error"])
    if leverage_wins:
        assert r.chosen["centers"] == "leverage (check)" and model.center_weights is not None
        assert r.chosen["val_error"] == r.leverage["error"] < r.leverage["uniform_error"]
    else:
        assert r.chosen["centers"] != "leverage (check)" and model.center_weights is None
        assert r.chosen["val_error"] == r.leverage["uniform_error"] < r.leverage["error"]


def test_auto_fit_calibrates_with_the_residuals_of_the_centers_it_returns(monkeypatch):
    """Where the leverage check's centers replace the level's, the variance calibration's residuals are the
    leverage check's fit's on the calibration rows (the returned model's centers), not the replaced level's:
    every residual it uses is one of that fit's validation residuals (raw units), and they are not the level's."""
    import gpfalkon.models.calibration as calibration_module

    real_mse = auto_scoring._val_mse
    scored: dict[str, list[torch.Tensor]] = {"leverage": [], "uniform": []}

    def val_mse(model, x, y):
        with torch.no_grad():
            r = (y.to(torch.float64) - model.posterior_mean(x).to(torch.float64)).reshape(-1)
        if model.center_weights is not None:  # the leverage check's fit: forced to win
            scored["leverage"].append(r)
            return 0.0
        scored["uniform"].append(r)
        return real_mse(model, x, y)

    used: list[torch.Tensor] = []
    real_scale = auto_calibration.variance_scale

    def spy(r, v):
        used.append(r.detach().clone())
        return real_scale(r, v)

    _script_val_mse(monkeypatch, val_mse)
    patch_auto(monkeypatch, "variance_scale", spy)
    assert calibration_module.variance_scale is real_scale
    x, y, _ = _data(800)
    model = auto_fit(x, y, leverage_check=True, center_sampling="uniform", **SMALL)
    rep = model.auto_report
    assert rep.chosen["centers"] == "leverage (check)" and len(used) == 1 and rep.chosen["variance_scale"] != 1.0
    r = used[0] / rep.chosen["y_scale"]  # back to the standardised units the fits were scored in

    def all_among(found: torch.Tensor, pool: torch.Tensor) -> bool:
        return bool(((found[:, None] - pool[None, :]).abs().min(dim=1).values < 1e-9).all())

    assert len(scored["leverage"]) == 1
    assert all_among(r, scored["leverage"][0])
    assert not any(all_among(r, res) for res in scored["uniform"])


def test_a_float32_fit_on_nearly_noiseless_data_suggests_float64():
    """On a nearly noiseless function float32 kernel values limit the fit: the chosen validation error below
    FLOAT32_LIMITED_ERROR of the targets' variance gives a warning (and a note) naming dtype=torch.float64; noisy
    data, or float64, give none."""
    from gpfalkon.auto.fit import FLOAT32_LIMITED_ERROR

    kw = dict(SMALL, dtype=torch.float32)
    x, y, _ = _data(600, noise=1e-5)
    with pytest.warns(RuntimeWarning, match="dtype=torch.float64"):
        m = auto_fit(x, y, **kw)
    assert m.auto_report.chosen["val_error"] < FLOAT32_LIMITED_ERROR
    assert any("float32 kernel values limit the fit" in n for n in m.auto_report.notes)
    for data, dtype in ((_data(600, noise=0.05), torch.float32), (_data(600, noise=1e-5), torch.float64)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*float32 kernel values limit", category=RuntimeWarning)
            auto_fit(data[0], data[1], **dict(SMALL, dtype=dtype))


def _break_final_fit(monkeypatch, rows: int, failure: str = "scaled", leave_factors: bool = False) -> list:
    """Make auto_fit's fits on ``rows`` training rows (its final fit) broken, as a CG that did not solve its system
    might leave them: coefficients scaled by 3 (``"scaled"``) or one of them NaN (``"nan"``); ``leave_factors``:
    the fit also leaves factors built for its ``rows`` in the calibration's keeper, as a CG fit does. Returns the
    list the broken fits are appended to."""

    real = auto_scoring._fit_quiet
    broken: list = []

    def fit_quiet(model, time_limit=None, initial_alpha=None):
        model, converged = real(model, time_limit=time_limit, initial_alpha=initial_alpha)
        if model.train_inputs[0].shape[0] == rows:
            with torch.no_grad():
                if failure == "nan":
                    model.alpha[0] = float("nan")
                else:
                    model.alpha.mul_(3.0)
            keeper = model.options.preconditioner
            if leave_factors and isinstance(keeper, auto_scoring._KeptPreconditioner):
                c = model.centers.detach()
                keeper(model.kernel(c, c).to_dense().detach(), model.penalty.detach(), rows)
            broken.append(model)
        return model, converged

    patch_auto(monkeypatch, "_fit_quiet", fit_quiet)
    return broken


def _final_check_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "the final fit's error" in str(w.message)]


def test_the_final_check_consults_its_paired_z(monkeypatch):
    """With ``FINAL_CHECK_Z`` out of reach, the final fit of the broken case below (coefficients scaled by 3: its
    error far above the ratio) is returned as it is, without a refit or a warning: the ratio alone does not fire."""
    import warnings


    x, y, _ = _data(2000)
    _break_final_fit(monkeypatch, 1600)
    patch_auto(monkeypatch, "FINAL_CHECK_Z", math.inf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = auto_fit(x[:1600], y[:1600], val_x=x[1600:], val_y=y[1600:], **dict(SMALL, final_growth=False))
    c = model.auto_report.chosen
    assert not _final_check_warnings(caught)
    assert model.train_inputs[0].shape[0] == 1600 and "final check refit" not in model.auto_report.stages
    assert c["final_check_error"] > auto_final_check.FINAL_CHECK_RATIO * c["final_check_selection_error"]


@pytest.mark.parametrize("broken", [False, True])
def test_auto_fit_checks_its_final_model_against_the_selection_fit(monkeypatch, broken):
    """The final model is scored on the calibration rows against its level's selection fit there. A final fit
    whose CG did not solve its system (here its coefficients scaled by 3 after the fit, as a stalled CG's might be
    off) is worse than the fit it was chosen by: auto_fit refits the level (M = 120) on its 800 selection rows
    (grow_select_rows: 400 per 60 centers; validation data given: no rows put back), returns that fit (it scores
    lower there) and warns, naming both errors; the notes keep the warning. A sound final fit (more rows) is
    within FINAL_CHECK_RATIO of it, is returned, and does not warn. With 400 given validation rows the
    calibration rows are all of them (a permutation: the mean is the same), so the report's errors are
    recomputed here: the returned model's standardised MSE there, and the level's validation error; the refit is
    the dense Nystrom solution on its own rows."""
    import warnings


    x, y, _ = _data(2000)
    xt, yt, xv, yv = x[:1600], y[:1600], x[1600:], y[1600:]
    # the final fit (the selection fits: 400 rows)
    broken_fits = _break_final_fit(monkeypatch, 1600) if broken else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = auto_fit(xt, yt, val_x=xv, val_y=yv, **dict(SMALL, final_growth=False))
    msgs = _final_check_warnings(caught)
    # the warning names the line that called auto_fit (past auto_fit's own frames and its decorator's)
    assert all(w.filename == __file__ for w in caught if "the final fit's error" in str(w.message)), caught
    c = model.auto_report.chosen
    fin, sel = c["final_check_error"], c["final_check_selection_error"]
    with torch.no_grad():
        mse = float(((yv - model.posterior_mean(xv).double()) / yt.std()).square().mean())
    assert fin == pytest.approx(mse, rel=1e-9) and sel == pytest.approx(c["val_error"], rel=1e-9), (fin, mse, sel)
    assert fin <= auto_final_check.FINAL_CHECK_RATIO * sel, (fin, sel)  # the returned model passes, refitted or not
    assert bool(msgs) == broken, msgs
    rows = model.train_inputs[0].shape[0]
    if broken:
        assert len(broken_fits) == 1 and model is not broken_fits[0]
        with torch.no_grad():
            bad = float(((yv - broken_fits[0].posterior_mean(xv).double()) / yt.std()).square().mean())
        assert bad > auto_final_check.FINAL_CHECK_RATIO * sel and f"{bad:.3g}" in msgs[0] and f"{sel:.3g}" in msgs[0]
        assert "(M=120) refitted on 800 rows, its selection rows (error" in msgs[0], msgs
        assert f"(error {fin:.3g} there)" in msgs[0], msgs
        assert msgs[0].removeprefix("auto_fit: ") in model.auto_report.notes
        assert rows == 800 == c["final_rows"] and c["num_centers"] == 120
        assert float(model.penalty.detach()) * rows == pytest.approx(c["noise_raw"], rel=1e-9)
        _assert_dense_nystrom(model)
    else:
        assert rows == 1600 == c["final_rows"]
        assert fin <= sel * 1.2, (fin, sel)  # more rows, the same validation rows: no worse than the selection fit


@pytest.mark.parametrize("failure", ["scaled", "nan"])
def test_auto_fit_final_check_refit_keeps_its_own_calibration(monkeypatch, failure):
    """The final check's refit where the held-out rows are put back (no validation data given: 400 of the 2,000
    rows) and the variances are calibrated. The final fit on all 2,000 rows is broken (coefficients scaled by 3, or
    a NaN among them) and leaves factors in the calibration's keeper, as a CG fit does (built here for its 2,000
    rows). The returned model is the refit on the level's 800 selection rows (M = 120) plus the 400 held-out rows;
    the calibration ran on factors of the returned fit (built for 1,200 rows), not the discarded fit's; its
    variances are positive."""
    import warnings


    x, y, _ = _data(2000)
    broken_fits = _break_final_fit(monkeypatch, 2000, failure, leave_factors=True)  # the final fit on every row
    seen = []
    real_var = auto_calibration.preconditioned_variances

    def variances(kernel, x_c, centers, precond, noise):
        seen.append((precond.n, centers.shape[0]))
        return real_var(kernel, x_c, centers, precond, noise)

    patch_auto(monkeypatch, "preconditioned_variances", variances)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = auto_fit(x, y, **dict(SMALL, final_growth=False))
    rep = model.auto_report
    msgs = _final_check_warnings(caught)
    assert len(broken_fits) == 1 and model is not broken_fits[0]
    assert len(msgs) == 1 and "(M=120) refitted on 1,200 rows, its selection rows and the held-out ones" in msgs[0]
    assert model.train_inputs[0].shape[0] == 1200 == rep.chosen["final_rows"]
    assert seen == [(1200, 120)], seen
    assert "final check refit" in rep.stages
    assert not any("calibration skipped" in n for n in rep.notes), rep.notes
    fin, sel = rep.chosen["final_check_error"], rep.chosen["final_check_selection_error"]
    assert math.isfinite(fin) and fin <= auto_final_check.FINAL_CHECK_RATIO * sel
    model.eval()
    with torch.no_grad():
        var = model(x[:50]).variance
    assert bool(torch.isfinite(model.alpha).all()) and bool((var > 0).all())


def test_the_final_checks_paired_z_ignores_a_few_noisy_rows():
    """The statistic ``FINAL_CHECK_Z`` bounds (``_paired_z`` of the final and selection residuals): a mean squared
    error more than doubled by one outlying row of 10 is one standard error of the paired differences, under the
    bound (such a final fit passes the check), while residuals uniformly 3x off on 1,000 rows are tens of them."""

    g = torch.Generator().manual_seed(0)
    r_sel = torch.randn(10, generator=g, dtype=torch.float64)
    r_fin = r_sel.clone()
    r_fin[0] = 4.0 * r_sel.abs().max()  # one row: the mean squared error more than doubles
    assert float(r_fin.square().mean()) > auto_final_check.FINAL_CHECK_RATIO * float(r_sel.square().mean())
    assert auto_scoring._paired_z(r_fin, r_sel) < auto_final_check.FINAL_CHECK_Z
    r_sel = torch.randn(1000, generator=g, dtype=torch.float64)
    assert auto_scoring._paired_z(3.0 * r_sel, r_sel) > 10 * auto_final_check.FINAL_CHECK_Z


# ------------------------------------------------------------------ the leave-one-out choice (loo_rows)
def _dense_loo(kernel, noise, x, y):
    """Explicit leave-one-out refits of exact kernel ridge regression: ``n`` dense solves (the reference)."""
    n = x.shape[0]
    with torch.no_grad():
        k = dense_kernel(kernel, x, x)
        out = torch.empty(n, dtype=torch.float64)
        for i in range(n):
            keep = torch.arange(n) != i
            kk = k[keep][:, keep] + noise * torch.eye(n - 1, dtype=torch.float64)
            out[i] = y[i] - k[i, keep] @ torch.linalg.solve(kk, y[keep])
    return out


def test_loo_score_is_exact_krr_leave_one_out():
    from gpfalkon.auto.loo import _loo_score
    from gpfalkon.objectives import LOOCV

    x, y, _ = _data(80)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
    k.base_kernel.lengthscale = torch.tensor([[0.7, 1.5, 3.0]], dtype=torch.float64)
    err, r, s_ii = _loo_score(k, 0.5, 0.03, x, y)
    k_half = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
    k_half.base_kernel.lengthscale = k.base_kernel.lengthscale * 0.5  # the multiplier
    ref = _dense_loo(k_half, 0.03, x, y)
    torch.testing.assert_close(r, ref, rtol=1e-7, atol=1e-9)
    assert math.isclose(err, float(ref.square().mean()), rel_tol=1e-9)
    # the Nystrom route with every row a center gives the same residuals and smoother diagonal
    model = FalkonGP(x, y, kernel=k_half, centers=x, penalty=0.03 / (x.shape[0] - 1))
    r2, s2 = LOOCV(model).residuals()
    torch.testing.assert_close(r2.reshape(-1), r, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(s2, s_ii, rtol=1e-6, atol=1e-8)
    # the kernel passed in is not changed
    torch.testing.assert_close(k.base_kernel.lengthscale, torch.tensor([[0.7, 1.5, 3.0]], dtype=torch.float64))


@pytest.fixture(scope="module")
def loo_fitted():
    x, y, _ = _data(300)
    kw = dict(SMALL, loo_rows=4_000)
    return auto_fit(x, y, **kw), (x, y)


def test_auto_fit_loo_choice_is_the_leave_one_out_minimum_refit_on_every_row(loo_fitted):
    """The returned model: the scored point of least leave-one-out error, its noise refined, fitted with every row a
    center (the dense exact KRR); its reported error is the explicit leave-one-out refits' at the returned
    kernel and noise; its variances calibrated by those residuals."""
    model, (x, y) = loo_fitted
    rep = model.auto_report
    loo = rep.loo
    assert loo["refit"] is True and loo["points"] >= len(loo["scored"]) > 1
    assert loo["error"] <= min(e for *_, e in loo["scored"]) + 1e-15
    assert loo["error"] <= loo["chosen_error"]
    # every row a center; the hyperparameters are the winner's
    assert model.centers.shape[0] == 300 and rep.chosen["num_centers"] == 300
    assert (rep.chosen["racer"], rep.chosen["step"]) == tuple(loo["winner"])
    c = rep.chosen["variance_scale"]
    assert math.isclose(c, loo["variance_scale"]) and rep.chosen["noise"] == loo["noise"]
    y_sd = rep.chosen["y_scale"]
    noise_z = float(model.noise.detach()) / (c * y_sd ** 2)
    assert math.isclose(noise_z, loo["noise"], rel_tol=1e-6)
    # the mean: exact KRR, K (K + sigma^2 I)^{-1} (y - mu) + mu, at the returned kernel and (uncalibrated) noise
    xt, _, _ = _data(50, seed=3)
    with torch.no_grad():
        kxx = dense_kernel(model.kernel, x, x) / c  # the outputscale carries c too
        ref = model.mean_constant + dense_kernel(model.kernel, xt, x) / c @ torch.linalg.solve(
            kxx + noise_z * y_sd ** 2 * torch.eye(300, dtype=torch.float64), y - model.mean_constant)
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt).mean
    assert float((pred - ref).abs().max()) < 1e-3 * float(ref.std())
    # the reported error: explicit leave-one-out refits in standardised units
    r = _dense_loo(model.kernel, float(model.noise.detach()), x, y - model.mean_constant) / y_sd
    assert math.isclose(loo["error"], float(r.square().mean()), rel_tol=1e-5)
    # c = mean(r_i^2 / v_i), v_i the leave-one-out predictive variance (sigma^2 + the latent variance) at c = 1
    with torch.no_grad():
        k1 = dense_kernel(model.kernel, x, x) / (c * y_sd ** 2)
        a_inv = torch.linalg.inv(k1 + noise_z * torch.eye(300, dtype=torch.float64))
    assert math.isclose(c, float((r.square() * a_inv.diagonal()).mean()), rel_tol=1e-5)
    assert "leave-one-out choice" in " ".join(rep.notes)


def test_auto_fit_loo_refit_is_the_exact_solve_with_float32_data():
    """With float32 data passes (the default dtype) the stage's refit still runs its passes in float64
    (LOO_REFIT_DTYPE) and starts at the exact coefficients: on near-noiseless data, where FALKON's system at M = n
    squares K's condition number, the returned mean is exact float64 KRR at the returned kernel and noise."""
    g = torch.Generator().manual_seed(7)
    z = torch.rand(260, 2, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * z[:, 0]) * torch.cos(2 * z[:, 1]) + 1e-4 * torch.randn(260, generator=g, dtype=torch.float64)
    x, y = z.float(), y.float()
    model = auto_fit(x, y, budget=1e4, hyper_rows=200, hyper_centers=30, select_rows=200, min_centers=40,
                     max_centers=80, max_steps=20, eval_every=5, seed=0)
    rep = model.auto_report
    assert rep.loo["refit"] is True and model.centers.shape[0] == 260
    assert model.centers.dtype == torch.float64 and model.kernel.outputscale.dtype == torch.float64
    assert model.fit_info.iterations == 0  # its CG starts at the exact coefficients (1e-14 relative residual)
    xt = torch.rand(40, 2, generator=g, dtype=torch.float64) * 2 - 1
    x64, y64 = x.double(), y.double()
    with torch.no_grad():
        a = dense_kernel(model.kernel, x64, x64) + float(model.noise) * torch.eye(260, dtype=torch.float64)
        alpha = torch.linalg.solve(a, y64 - model.mean_constant)
        ref = model.mean_constant + dense_kernel(model.kernel, xt, x64) @ alpha
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt.float()).mean.double()
    assert float((pred - ref).abs().max()) < 1e-6 * float(ref.std())


def test_auto_fit_loo_choice_is_skipped_where_it_does_not_apply():
    x, y, _ = _data(300)
    xv, yv, _ = _data(60, seed=2)
    for kw in (dict(loo_rows=0), dict(loo_rows=299), dict(loo_rows=4_000, val_x=xv, val_y=yv),
               dict(loo_rows=4_000, refit_on_all=False)):
        model = auto_fit(x, y, **dict(SMALL, **kw))
        assert model.auto_report.loo == {} and "loo" not in model.auto_report.stages
        assert model.centers.shape[0] <= SMALL["max_centers"]


def test_auto_fit_loo_stage_starts_only_where_three_scores_are_predicted_to_fit(monkeypatch):
    """Where three leave-one-out scores are not predicted to fit the stage's share of the budget, the stage scores
    nothing: the returned model is the one without the stage (loo_rows=0), and the report says why."""

    x, y, _ = _data(300)
    xt, _, _ = _data(40, seed=3)
    kw = dict(SMALL, loo_rows=4_000)
    share = auto_loo.LOO_SHARE * kw["budget"]
    patch_auto(monkeypatch, "_loo_score_seconds", lambda n, device: share / 2.9)
    skipped = auto_fit(x, y, **kw)
    monkeypatch.undo()
    plain = auto_fit(x, y, **dict(kw, loo_rows=0))
    loo = skipped.auto_report.loo
    assert loo["skipped"] is True and "scored" not in loo and loo["points"] > 1
    assert math.isclose(loo["predicted_score_seconds"], share / 2.9) and loo["seconds_left"] <= share
    assert "leave-one-out stage skipped" in " ".join(skipped.auto_report.notes)
    assert skipped.centers.shape[0] == plain.centers.shape[0] < 300
    for m in (skipped, plain):
        m.eval()
    with torch.no_grad():
        a, b = skipped(xt), plain(xt)
    torch.testing.assert_close(a.mean, b.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a.variance, b.variance, rtol=1e-10, atol=1e-10)
    # at a third of the share per score the stage runs
    patch_auto(monkeypatch, "_loo_score_seconds", lambda n, device: share / 3.1)
    ran = auto_fit(x, y, **kw).auto_report.loo
    assert "skipped" not in ran and len(ran["scored"]) > 1


def test_loo_score_seconds_scales_a_timed_factorisation_by_the_cube_of_the_order(monkeypatch):
    """The prediction is the faster of two timed factorisations and inverses of order s = min(n, probe), times
    (n / s)^3: with a clock that advances one second per read, (n / s)^3."""

    reads = iter(range(100))
    monkeypatch.setattr(auto_fitting.time, "perf_counter", lambda: float(next(reads)))
    assert auto_loo._loo_score_seconds(2048, torch.device("cpu"), probe=64) == 32.0 ** 3
    reads = iter(range(100))
    assert auto_loo._loo_score_seconds(50, torch.device("cpu"), probe=64) == 1.0


def test_loo_choice_scores_while_the_clock_leaves_time():
    """With no time left only the validation choice is scored (no noise steps); with time, every point, the best
    first by its validation error, and the noise is then moved while that lowers the error."""
    from gpfalkon.auto.loo import _loo_choice, _loo_score

    x, y, _ = _data(120)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()

    def point(ls, noise, err, name):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
        k.base_kernel.lengthscale = torch.full((1, 3), ls, dtype=torch.float64)
        return dict(kernel=k, multiplier=1.0, noise=noise, objective=name, racer=name, lr=0.1, step=0, error=err,
                    rows=120, family="matern52")

    chosen = point(3.0, 0.3, 0.2, "chosen")
    points = [point(5.0, 0.5, 0.3, "far"), point(0.8, 0.3, 0.1, "near")]

    none = _loo_choice(chosen, points, x, y, lambda: 0.0)
    assert [s[0] for s in none.record["scored"]] == ["chosen"] and none.winner is chosen
    assert none.noise == chosen["noise"]
    full = _loo_choice(chosen, points, x, y, lambda: 1e9, descent=False)
    assert [s[0] for s in full.record["scored"]] == ["chosen", "near", "far"]
    errors = {s[0]: s[3] for s in full.record["scored"]}
    assert full.winner["racer"] == min(errors, key=errors.get)
    # the noise refinement only lowers the error, by factors of 2
    assert full.error <= errors[full.winner["racer"]]
    factor = full.noise / full.winner["noise"]
    assert math.isclose(math.log2(factor), round(math.log2(factor)))
    assert "descent" not in full.record
    # the descent then goes on from that point: a lower error, its reported residuals those of the returned kernel
    down = _loo_choice(chosen, points, x, y, lambda: 1e9)
    assert down.record["descent"]["evaluations"] > 1 and down.error < full.error
    assert down.winner["racer"] == full.winner["racer"] and down.winner["multiplier"] == 1.0
    err, _, _ = _loo_score(down.winner["kernel"], 1.0, down.noise, x, y)
    assert math.isclose(down.error, err, rel_tol=1e-9)
    assert down.record["descent"]["kept"] is True
    assert down.record["descent"]["overshoot"] <= down.record["descent"]["overshoot_start"] + 0.5
    # a descent that overshoots (any, at a margin of -1) is dropped: the result is the start's

    margin = auto_loo.LOO_OVERSHOOT_MARGIN
    try:
        auto_loo.LOO_OVERSHOOT_MARGIN = -1.0
        dropped = _loo_choice(chosen, points, x, y, lambda: 1e9)
    finally:
        auto_loo.LOO_OVERSHOOT_MARGIN = margin
    assert dropped.record["descent"]["kept"] is False
    assert dropped.winner is full.winner and dropped.noise == full.noise and dropped.error == full.error
    # no descent without time for LOO_DESCENT_EVALS evaluations in half the stage, nor for a kernel of no family
    assert "descent" not in _loo_choice(chosen, points, x, y, lambda: 0.0).record
    plain = [dict(p, family=None) for p in (chosen, *points)]
    assert "descent" not in _loo_choice(plain[0], plain[1:], x, y, lambda: 1e9).record


@pytest.mark.parametrize("criterion", ["mse", "pseudo-likelihood"])
def test_loo_criterion_gradient_is_autograd_of_its_formula(criterion):
    """G = dE/dA of the hand-written gradient against autograd through a dense inverse of A = K + v I, for
    E = mean(r^2) and E = log mean(r^2 c) - mean(log c) (c = diag A^{-1}, r = A^{-1} y / c); dE/dv = tr G."""
    from gpfalkon.auto.loo import _loo_value_and_gram_grad

    x, y, _ = _data(90)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
    k.base_kernel.lengthscale = torch.tensor([[0.6, 1.2, 2.5]], dtype=torch.float64)
    with torch.no_grad():
        gram = dense_kernel(k, x, x)
    v = torch.tensor(0.04, dtype=torch.float64, requires_grad=True)
    a = gram.clone().requires_grad_(True)
    inv = torch.linalg.inv(a + v * torch.eye(90, dtype=torch.float64))
    c = inv.diagonal()
    r = inv @ y / c
    ref = r.square().mean() if criterion == "mse" else torch.log((r.square() * c).mean()) - c.log().mean()
    ref.backward()
    value, grad, r2, s = _loo_value_and_gram_grad(gram, 0.04, y, criterion)
    assert math.isclose(value, float(ref.detach()), rel_tol=1e-10)
    torch.testing.assert_close(grad, 0.5 * (a.grad + a.grad.T), rtol=1e-8, atol=1e-12 * float(a.grad.abs().max()))
    assert math.isclose(float(grad.diagonal().sum()), float(v.grad), rel_tol=1e-8)
    torch.testing.assert_close(r2, r.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, 1 - 0.04 * c.detach(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="criterion"):
        _loo_value_and_gram_grad(gram, 0.04, y, "likelihood")


def test_midpoint_overshoot_is_the_dense_predictions_distance_outside_the_targets_range():
    from gpfalkon.auto.loo import _midpoint_overshoot

    g = torch.Generator().manual_seed(5)
    x = torch.rand(60, 2, generator=g, dtype=torch.float64)
    y = torch.randn(60, generator=g, dtype=torch.float64)
    pairs = torch.randint(60, (300, 2), generator=g)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
    k.base_kernel.lengthscale = torch.tensor([[0.2, 0.4]], dtype=torch.float64)
    for noise in (1e-6, 1e-2, 10.0):
        with torch.no_grad():
            k2 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
            k2.base_kernel.lengthscale = torch.tensor([[0.1, 0.2]], dtype=torch.float64)
            kk = dense_kernel(k2, x, x)
            q = 0.5 * (x[pairs[:, 0]] + x[pairs[:, 1]])
            f = dense_kernel(k2, q, x) @ torch.linalg.solve(kk + noise * torch.eye(60, dtype=torch.float64), y)
        ref = max(0.0, float(f.max() - y.max()), float(y.min() - f.min()))
        got = _midpoint_overshoot(k, 0.5, noise, x, y, pairs)
        assert math.isclose(got, ref, rel_tol=1e-7, abs_tol=1e-10)
    assert _midpoint_overshoot(k, 0.5, 10.0, x, y, pairs) == 0.0  # a heavily smoothed fit stays inside
    assert _midpoint_overshoot(k, 0.5, 1e-6, x, y, pairs) > 0.0  # an interpolant of noise overshoots between rows


def test_loo_descent_reaches_the_grid_minimum_of_a_one_dimensional_problem():
    """On one feature the criterion is a function of (lengthscale, noise): the descent reaches the minimum of a 60 x 60
    log grid of exact leave-one-out scores over its box (LOO_DESCENT_BOX around the start), or lower between the
    grid's points; its error is the closed form's at the kernel and noise it returns, both inside the box; the
    kernel passed in is not changed; with no time it evaluates once and returns the start."""
    from gpfalkon.auto.loo import LOO_DESCENT_BOX, _loo_descent, _loo_score

    g = torch.Generator().manual_seed(4)
    x = torch.rand(150, 1, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(2.5 * x[:, 0]) + 0.1 * torch.randn(150, generator=g, dtype=torch.float64)
    y = (y - y.mean()) / y.std()

    def kernel(ls):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=1)).double()
        k.base_kernel.lengthscale = torch.tensor([[ls]], dtype=torch.float64)
        return k

    ls0, v0, (bl, bv) = 2.0, 0.2, LOO_DESCENT_BOX
    lss = torch.logspace(math.log10(ls0 / bl), math.log10(ls0 * bl), 60).tolist()
    vs = torch.logspace(math.log10(v0 / bv), math.log10(v0 * bv), 60).tolist()
    grid = min(_loo_score(kernel(ls), 1.0, v, x, y)[0] for ls in lss for v in vs)
    start = kernel(ls0 / 2)  # the multiplier 2 gives ls0
    kern, noise, err, _, _, rec = _loo_descent(start, 2.0, v0, x, y, lambda: 1e9, 0.01)
    assert rec["after"] < rec["before"] and err <= grid * (1 + 1e-3)
    assert math.isclose(err, _loo_score(kern, 1.0, noise, x, y)[0], rel_tol=1e-9)
    assert ls0 / bl <= float(kern.base_kernel.lengthscale.detach()) <= ls0 * bl
    assert v0 / bv <= noise <= v0 * bv * (1 + 1e-9)
    assert float(start.base_kernel.lengthscale.detach()) == ls0 / 2
    kern0, noise0, err0, *_, rec0 = _loo_descent(start, 2.0, v0, x, y, lambda: 0.0, 0.01)
    assert rec0["evaluations"] == 1 and rec0["stop"] == "time" and math.isclose(noise0, v0, rel_tol=1e-12)
    assert math.isclose(float(kern0.base_kernel.lengthscale.detach()), ls0, rel_tol=1e-12)
    assert math.isclose(err0, _loo_score(kernel(ls0), 1.0, v0, x, y)[0], rel_tol=1e-9)


def test_auto_fit_on_repeated_rows_never_takes_a_center_twice(monkeypatch):
    """Data whose rows repeat (each input three times, fresh noise): every model auto_fit builds (learning,
    continuations on more rows with more centers, scoring, selection, final fit, the leave-one-out refit) has
    distinct centers, and the final fit's are as many as the report says."""

    x, _, f = _data(200)
    g = torch.Generator().manual_seed(5)
    x3 = x.repeat(3, 1)
    y3 = f.repeat(3) + 2.5 * torch.randn(600, generator=g, dtype=torch.float64)
    built: list[torch.Tensor] = []
    real = auto_fitting.FalkonGP

    def spy(*args, **kwargs):
        if kwargs.get("centers") is not None:
            built.append(kwargs["centers"].detach().clone())
        return real(*args, **kwargs)

    patch_auto(monkeypatch, "FalkonGP", spy)
    # level_share 1e-9: the leader goes on to twice the rows at every round (with hyper_centers_growth, new centers)
    model = auto_fit(x3, y3, **{**SMALL, "hyper_rows": 100, "hyper_centers": 20, "hyper_centers_growth": 0.5,
                                "max_steps": 200, "objectives": ("gcv", "sgpr"), "race_rounds": 2,
                                "level_share": 1e-9, "rescore_continuations": False, "loo_rows": 600})
    rep = model.auto_report
    grown = [r for r in rep.learn[1:] if r["rows"] > 100]
    assert grown and max(r["centers"] for r in grown) > 20  # a continuation on more rows drew new centers
    assert rep.loo is not None and not rep.loo.get("skipped")  # the leave-one-out stage ran
    assert len(built) >= 5
    for c in built:
        assert torch.unique(c, dim=0).shape[0] == c.shape[0], f"{c.shape[0]} centers, some repeated"
    m = model.auto_report.chosen["num_centers"]
    assert model.centers.shape[0] == m and torch.unique(model.centers, dim=0).shape[0] == m


def test_input_location_scale_caps_a_scale_set_by_far_rows():
    """The standardisation: mean and standard deviation, except where far rows inflate the standard deviation past
    OUTLIER_SCALE_RATIO robust scales (the median and that many IQR / 1.349 there); numpy's (linearly interpolated)
    quantiles as reference, on an even number of rows (where order-statistic quantiles are not equivariant)."""
    import numpy as np


    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 4, generator=g, dtype=torch.float64)
    x[:, 1] = torch.rand(1000, generator=g, dtype=torch.float64)
    x[:3, 1] = -9999.0  # a missing-value code: the standard deviation ~ 300 quartile spreads
    x[:, 2] = (x[:, 2] > 1.5).double()  # mostly zeros: IQR 0, the standard deviation kept
    x[:, 3] = 5.0  # constant: scale 1
    mu, sd = auto_standardise._input_location_scale(x)
    a = x.numpy()
    q = {k: np.percentile(a, 100 * k, axis=0) for k in (0.25, 0.5, 0.75)}
    cap = auto_standardise.OUTLIER_SCALE_RATIO * (q[0.75] - q[0.25]) / 1.349
    assert float(x[:, 1].std()) > cap[1] and float(x[:, 0].std()) < cap[0]
    want_mu = [a[:, 0].mean(), q[0.5][1], a[:, 2].mean(), 5.0]
    want_sd = [a[:, 0].std(ddof=1), cap[1], a[:, 2].std(ddof=1), 1.0]
    torch.testing.assert_close(mu, torch.tensor(want_mu, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sd, torch.tensor(want_sd, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # equivariant: a per-feature affine change of units (negative factors included) moves them alike
    s, b = torch.tensor([3.0, -0.5, 2.0, 7.0], dtype=torch.float64), torch.tensor([1.0, 4.0, -2.0, 0.5])
    mu2, sd2 = auto_standardise._input_location_scale(x * s + b.double())
    torch.testing.assert_close(sd2[:3], sd[:3] * s[:3].abs(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mu2, mu * s + b.double(), rtol=1e-12, atol=1e-9)


def test_auto_fit_with_a_missing_value_code_in_a_feature_still_learns_it(monkeypatch):
    """A few rows hold a code far outside a feature's range (-9999): with the scale capped, the bulk of that feature
    keeps its spread and the fit its accuracy on clean test rows; with the plain standard deviation (no cap) the
    feature looks constant at the start and the fit is much worse (the comparison shows this test can fail)."""

    g = torch.Generator().manual_seed(3)
    x = torch.rand(600, 2, generator=g, dtype=torch.float64)
    f = torch.sin(6 * x[:, 0]) + 0.3 * x[:, 1]
    y = f + 0.05 * torch.randn(600, generator=g, dtype=torch.float64)
    xt = torch.rand(300, 2, generator=g, dtype=torch.float64)
    ft = torch.sin(6 * xt[:, 0]) + 0.3 * xt[:, 1]
    xo = x.clone()
    xo[:4, 0] = -9999.0

    def err(xtrain):
        m = auto_fit(xtrain, y, **SMALL)
        m.eval()
        with torch.no_grad():
            return float((m.posterior_mean(xt).double() - ft).square().mean().sqrt() / ft.std())

    clean, coded = err(x), err(xo)
    patch_auto(monkeypatch, "OUTLIER_SCALE_RATIO", math.inf)
    uncapped = err(xo)
    assert coded < 2 * clean + 0.02, (clean, coded)
    assert uncapped > 3 * coded, (coded, uncapped)


def test_auto_fit_warns_of_far_rows_in_float32_only():
    """float32 with rows 1e9 scale units out (their self-distance rounds to far more than a lengthscale): a warning
    naming train_x and float64; none in float64 or for rows a few hundred units out."""
    import warnings as _warnings

    x, y = make_data(200, 2)
    far = x.clone()
    far[:2, 0] = 1e9
    with pytest.warns(RuntimeWarning, match=r"train_x: some rows lie .* scale units .* dtype=torch.float64") as rec:
        auto_fit(far, y, budget=1.0)
    # each names the line that called auto_fit (past auto_fit's own frames and its decorator's)
    assert all(w.filename == __file__ for w in rec if "scale units" in str(w.message)), rec.list
    near = x.clone()
    near[:2, 0] = 30.0
    for xs, kw in ((far, dict(dtype=torch.float64)), (near, {})):
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            auto_fit(xs, y, budget=1.0, **kw)
        assert not [w for w in caught if "scale units" in str(w.message)]


def test_auto_fit_warns_where_a_few_far_targets_set_their_scale():
    """A few targets at a missing-value code (-9999) set the targets' standard deviation (past OUTLIER_SCALE_RATIO
    robust scales): auto_fit warns, naming train_y and the number of far rows; heavy-tailed but genuine targets
    (Student t, 3 degrees of freedom), mostly-one-value targets (IQR 0) and clean ones do not warn."""
    import warnings as _warnings


    g = torch.Generator().manual_seed(5)
    y = torch.randn(1000, generator=g, dtype=torch.float64)
    coded = y.clone()
    coded[:5] = -9999.0
    with pytest.warns(RuntimeWarning, match=r"train_y: 5 row\(s\) lie more than 100 robust scales"):
        auto_standardise._warn_far_targets(coded)
    chi2 = torch.randn(1000, 3, generator=g, dtype=torch.float64).square().sum(1)
    student = torch.randn(1000, generator=g, dtype=torch.float64) / (chi2 / 3).sqrt()
    sparse = (torch.rand(1000, generator=g, dtype=torch.float64) > 0.9).double() * 1e4
    for ys in (y, student, sparse, coded[:3]):
        with _warnings.catch_warnings():
            _warnings.simplefilter("error")
            auto_standardise._warn_far_targets(ys)
    x, yd = make_data(300, 2)
    yd = yd.clone()
    yd[:3] = -9999.0
    with pytest.warns(RuntimeWarning, match=r"train_y: 3 row\(s\) lie more than") as rec:
        auto_fit(x, yd, budget=1.0)
    assert all(w.filename == __file__ for w in rec if "robust scales" in str(w.message)), rec.list
