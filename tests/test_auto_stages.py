"""auto_fit's stage objects on their own: the selection fits (gpfalkon.auto.selection), the final model in raw units
(gpfalkon.auto.final), the level stage 2 chooses (gpfalkon.auto.sizes), the variance calibration
(gpfalkon.auto.calibration) and the final check (gpfalkon.auto.final_check), each against an independent reference
(a fit made directly, a closed-form mapping or choice, GPyTorch's predictive variances)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from gpfalkon import FalkonGP
from gpfalkon.auto.final import _FinalModels
from gpfalkon.auto.kernels import KERNEL_FAMILIES, _scale_lengthscales
from gpfalkon.auto.report import AutoFitReport, _Clock
from gpfalkon.auto.selection import _Selection, score_key
from gpfalkon.backend.blocks import resolve_store_dtype
from gpfalkon.options import FalkonOptions

N, D, M_POOL = 400, 3, 60


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N + 200, D, generator=g, dtype=torch.float64) * torch.tensor([40.0, 0.2, 3.0]) + 7.0
    z = (x - x[:N].mean(0)) / x[:N].std(0)
    y = 500.0 + 20.0 * (torch.sin(2 * z[:, 0]) + 0.5 * z[:, 1] * z[:, 2]) \
        + 2.0 * torch.randn(N + 200, generator=g, dtype=torch.float64)
    return x[:N], y[:N], x[N:N + 100], y[N:N + 100], x[N + 100:], y[N + 100:]


def _kernel():
    k = KERNEL_FAMILIES["rbf"](D).to(torch.float64)
    with torch.no_grad():
        k.base_kernel.lengthscale = torch.tensor([[0.8, 1.4, 1.1]], dtype=torch.float64)
        k.outputscale = torch.tensor(1.3, dtype=torch.float64)
    return k


def _selection(xt, yt, xv, yv, kernel, *, score_iter: int = 200, tol: float = 1e-12) -> tuple[_Selection, dict]:
    x_mu, x_sd, y_mu, y_sd = xt.mean(0), xt.std(0), yt.mean(), yt.std()
    zt, ut = (xt - x_mu) / x_sd, (yt - y_mu) / y_sd
    zv, uv = (xv - x_mu) / x_sd, (yv - y_mu) / y_sd
    report = AutoFitReport(budget=60.0, n_train=N, n_val=xv.shape[0], val_source="given", kernel="rbf")
    fits = _Selection(
        xt_z=zt, yt_z=ut, s_order=torch.arange(N), n_s=N, m_first=M_POOL // 2, grow_rows=False, n_back=0, n_final=N,
        xs=zt, ys=ut, c_pool=zt[:M_POOL], base_kernel=kernel, score_iter=score_iter, max_iter=score_iter, tol=tol,
        options=FalkonOptions(), xv_z=zv, yv_z=uv, xv_cal=zv[:50], yv_cal=uv[:50], keep_cal=True, search_tol=0.01,
        report=report, clock=_Clock(60.0, False), budget_at=lambda m: 1 << 30,
        store_dtype=resolve_store_dtype(torch.float64),
    )
    return fits, dict(x_mu=x_mu, x_sd=x_sd, y_mu=y_mu, y_sd=y_sd, zt=zt, ut=ut, zv=zv, uv=uv)


def _direct_fit(z, u, kernel, centers, noise, mult):
    k = copy.deepcopy(kernel)
    _scale_lengthscales(k, mult)
    model = FalkonGP(z, u, kernel=k, centers=centers, penalty=noise / z.shape[0], max_iter=200, tol=1e-12)
    model.fit()
    return model


def test_selection_score_is_the_validation_mse_of_the_fit_and_is_cached():
    xt, yt, xv, yv, _, _ = _problem()
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    err = fits.score(M_POOL // 2, 0.05, 1.2)
    ref = _direct_fit(s["zt"], s["ut"], fits.base_kernel, s["zt"][:M_POOL // 2], 0.05, 1.2)
    with torch.no_grad():
        expected = float((ref.posterior_mean(s["zv"]) - s["uv"]).square().mean())
    assert err == pytest.approx(expected, rel=1e-8)
    key = score_key(M_POOL // 2, 0.05, 1.2, "uniform")
    # the residuals on the calibration rows and the coefficients are the fit's
    with torch.no_grad():
        torch.testing.assert_close(fits.cal_residuals[key], s["uv"][:50] - ref.posterior_mean(s["zv"][:50]))
    torch.testing.assert_close(fits.alpha[key], ref.alpha.detach().reshape(-1))
    assert len(fits.report.search) == 1 and fits.report.search[0]["M"] == M_POOL // 2
    # a second call is the cached value: no second fit
    assert fits.score(M_POOL // 2, 0.05, 1.2) == err
    assert len(fits.report.search) == 1
    assert fits.last_fit_seconds(M_POOL // 2) == fits.report.search[0]["seconds"]


def test_selection_path_scores_equal_single_fits():
    xt, yt, xv, yv, _, _ = _problem(1)
    noises = [0.01, 0.04, 0.16]
    path_fits, _ = _selection(xt, yt, xv, yv, _kernel())
    single_fits, _ = _selection(xt, yt, xv, yv, _kernel())
    from_path = path_fits.score_path(40, noises, 1.0)
    singles = [single_fits.score(40, v, 1.0) for v in noises]
    assert from_path == pytest.approx(singles, rel=1e-6)
    assert [r.get("path") for r in path_fits.report.search] == [3, 3, 3]
    # cached: asking again (in another order) fits nothing more
    assert path_fits.score_path(40, noises[::-1], 1.0) == from_path[::-1]
    assert len(path_fits.report.search) == 3


def test_selection_rows_grow_with_the_centers_and_the_line_search_moves_downhill():
    xt, yt, xv, yv, _, _ = _problem(2)
    fits, _ = _selection(xt, yt, xv, yv, _kernel())
    fits.grow_rows, fits.n_s, fits.m_first = True, 100, 20
    fits.level_rows = {100: (fits.xt_z[:100], fits.yt_z[:100])}
    assert [fits.rows_at(m) for m in (10, 20, 40, 80, 400)] == [100, 100, 200, 400, 400]
    x40, _ = fits.rows_of(40)
    torch.testing.assert_close(x40, fits.xt_z[:200])
    fits.grow_rows, fits.n_s = False, N
    point = dict(noise=1.0, multiplier=1.0)
    point["error"] = fits.score(30, 1.0, 1.0)
    start = point["error"]
    fits.line_search(30, point, "noise", 4.0, 1e-6, 1e2, math.inf)
    # the data's noise is about 0.01 of the targets' variance: a noise of 1 is too large, the search goes down and
    # keeps the best point it scored
    assert point["noise"] < 1.0 and point["error"] < start
    scored = {r["noise"]: r["error"] for r in fits.report.search}
    assert point["error"] == min(scored.values()) == scored[point["noise"]]


def test_final_model_maps_the_standardised_fit_back_to_raw_units():
    xt, yt, xv, yv, xq, _ = _problem(3)
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    final = _FinalModels(fits=fits, x_fin=xt, y_fin=yt, n_tr=N, n_back=0, s_order=torch.arange(N),
                         base_kernel=fits.base_kernel, raw_lengthscales=True, x_mu=s["x_mu"], x_sd=s["x_sd"],
                         y_mu=s["y_mu"], y_sd=s["y_sd"], max_iter=200, tol=1e-12)
    level = dict(M=35, noise=0.03, multiplier=0.9, centers="uniform")
    assert final.start_for(level, 35) is None  # no selection fit kept at this level
    model, converged = final.fit(level)
    assert converged
    ref = _direct_fit(s["zt"], s["ut"], fits.base_kernel, s["zt"][:35], 0.03, 0.9)
    with torch.no_grad():
        raw = model.posterior_mean(xq)
        expected = s["y_mu"] + s["y_sd"] * ref.posterior_mean((xq - s["x_mu"]) / s["x_sd"])
    torch.testing.assert_close(raw, expected, rtol=1e-7, atol=1e-7 * float(s["y_sd"]))
    # the raw model's hyperparameters: lengthscales x sd x multiplier, outputscale x y_sd^2, noise x y_sd^2
    ls = model.kernel.base_kernel.lengthscale.detach().reshape(-1)
    torch.testing.assert_close(ls, torch.tensor([0.8, 1.4, 1.1], dtype=torch.float64) * 0.9 * s["x_sd"])
    assert float(model.kernel.outputscale.detach()) == pytest.approx(1.3 * float(s["y_sd"]) ** 2, rel=1e-12)
    assert float(model.noise.detach()) == pytest.approx(0.03 * float(s["y_sd"]) ** 2, rel=1e-9)


def test_final_model_starts_from_the_levels_selection_fit_padded_for_added_centers():
    xt, yt, xv, yv, _, _ = _problem(4)
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    fits.score(30, 0.05, 1.0)
    final = _FinalModels(fits=fits, x_fin=xt, y_fin=yt, n_tr=N, n_back=0, s_order=torch.arange(N),
                         base_kernel=fits.base_kernel, raw_lengthscales=True, x_mu=s["x_mu"], x_sd=s["x_sd"],
                         y_mu=s["y_mu"], y_sd=s["y_sd"], max_iter=200, tol=1e-12)
    alpha = fits.alpha[score_key(30, 0.05, 1.0, "uniform")]
    grown = dict(M=45, noise=0.05, multiplier=1.0, centers="uniform", grown_from=30)
    start = final.start_for(grown, 45)
    assert start is not None
    torch.testing.assert_close(start, torch.cat([alpha, torch.zeros(15, dtype=torch.float64)]))
    assert final.start_for(grown, 20) is None  # fewer centers than the level's fit
    model, initial = final.model(grown)
    assert initial is not None
    # raw units: f = y_mu + y_sd f_z with the kernel scaled by y_sd^2, so the coefficients are alpha_z / y_sd
    torch.testing.assert_close(initial.reshape(-1), start / float(s["y_sd"]))
    assert model.centers.shape[0] == 45


def _final_models(fits, xt, yt, s) -> _FinalModels:
    return _FinalModels(fits=fits, x_fin=xt, y_fin=yt, n_tr=N, n_back=0, s_order=torch.arange(N),
                        base_kernel=fits.base_kernel, raw_lengthscales=True, x_mu=s["x_mu"], x_sd=s["x_sd"],
                        y_mu=s["y_mu"], y_sd=s["y_sd"], max_iter=200, tol=1e-12)


def test_sizes_choose_the_lowest_error_among_the_levels_whose_final_fit_fits():
    """A level counts where its predicted final fit is within the time left plus 5 % of the budget (the first
    level always); the lowest validation error among those is chosen, and a better level skipped for time is
    noted. The costs and the clock are stand-ins: a closed-form choice."""
    import types

    from gpfalkon.auto.sizes import _Sizes

    costs = {100: 50.0, 200: 9.0, 400: 10.4, 800: 30.0}  # seconds of each level's final fit
    fits = types.SimpleNamespace(final_cost=lambda m, rows=None, base=None: costs[m], fewest_final_rows=lambda m: m)
    clock = types.SimpleNamespace(left=lambda: 10.0)
    report = AutoFitReport(budget=10.0, n_train=N, n_val=100, val_source="given", kernel="rbf")
    sizes = _Sizes(fits=fits, growth=None, pool=None, report=report, clock=clock, budget=10.0,  # type: ignore[arg-type]
                   max_centers=10_000, min_gain=0.005, noise_paths=True, final_growth=True, final_growth_factor=4.0,
                   growth_first=True, level_done=lambda level: None)
    levels = [dict(M=100, error=0.30), dict(M=200, error=0.20), dict(M=400, error=0.15), dict(M=800, error=0.10)]
    # the grace: 10 s left + 0.5 s; 400 (10.4 s) counts, 800 (30 s) does not; the first level counts at 50 s
    assert sizes.choose(levels) is levels[2]
    assert report.notes == ["level M=800 (validation error 0.1) skipped: its final fit is predicted at 30 s, 10 s "
                            "were left"]
    costs[400] = 10.6  # past the grace: the best affordable level is 200
    assert sizes.choose(levels) is levels[1]
    levels[0]["error"] = 0.05  # the first level, affordable or not, is the best
    assert sizes.choose(levels) is levels[0]


def test_calibration_scale_is_the_mean_squared_residual_over_the_variance():
    """``c = mean(r^2 / v)`` on the calibration rows, against GPyTorch's predictive variances of the model: for a
    model whose centers are its training rows FALKON's preconditioner approximates nothing (``K_nM = K_MM``), so the
    variances from its factors are exact up to the jitter. Where the final fit saw the calibration rows, the kept
    selection residuals (times y_sd) stand for its own; a level whose residuals were not kept raises LookupError."""
    from gpfalkon.auto.calibration import _Calibration

    xt, yt, xv, yv, _, _ = _problem(5)
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    level = dict(M=30, noise=0.05, multiplier=1.0, centers="uniform")
    fits.score(30, 0.05, 1.0)
    grown, _ = _final_models(fits, xt, yt, s).fit(level)  # the raw-units kernel and noise of the level
    model = FalkonGP(xt[:40], yt[:40], kernel=copy.deepcopy(grown.kernel), centers=xt[:40],
                     penalty=float(grown.noise.detach()) / 40, max_iter=200, tol=1e-12)
    model.fit()
    cal = _Calibration(fits=fits, cal_idx=torch.arange(50), xv=xv, yv=yv, y_sd=s["y_sd"], dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        pred = model.likelihood(model(xv[:50]))
        r = yv[:50] - pred.mean
        expected = float((r.square() / pred.variance).mean())
    assert cal.scale(model, None, None) == pytest.approx(expected, rel=1e-4)
    key = score_key(30, 0.05, 1.0, "uniform")
    r_sel = fits.cal_residuals[key] * float(s["y_sd"])
    assert cal.scale(model, None, key) == pytest.approx(float((r_sel.square() / pred.variance).mean()), rel=1e-4)
    with pytest.raises(LookupError, match="selection residuals were not kept"):
        cal.scale(model, None, score_key(60, 0.05, 1.0, "uniform"))


@pytest.mark.parametrize("broken", [False, True])
def test_final_check_keeps_a_sound_model_and_refits_a_broken_one(broken):
    """The check's errors are the returned model's mean squared standardised residual on the check rows and the
    selection fit's; a sound final model passes unchanged and silently. A final model whose coefficients are
    off (scaled by 3, as a CG that did not solve its system might leave them) of a grown level fires the check:
    the chosen level is refitted on its rows, returned (the dense Nystrom solution of that level), and a warning
    names both errors."""
    import warnings

    from gpfalkon.auto.final import _Returned
    from gpfalkon.auto.final_check import FINAL_CHECK_RATIO, _FinalCheck

    xt, yt, xv, yv, _, _ = _problem(6)
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    best = dict(M=30, noise=0.05, multiplier=1.0, centers="uniform")
    fits.score(30, 0.05, 1.0)
    final_models = _final_models(fits, xt, yt, s)
    level = dict(best, M=45, grown_from=30) if broken else best
    model, converged = final_models.fit(level)
    if broken:
        with torch.no_grad():
            model.alpha.mul_(3.0)
    returned = _Returned(model, converged, N, level, 1.0)
    check = _FinalCheck(fits=fits, final_models=final_models, report=fits.report, cal_idx=torch.arange(50), xv=xv,
                        yv_cal=s["uv"][:50].to(torch.float64), y_mu=s["y_mu"], y_sd=s["y_sd"], dtype=torch.float64,
                        n_final=N, n_back=0)
    key = score_key(30, 0.05, 1.0, "uniform")
    with torch.no_grad():
        e_bad = float(((yv[:50] - model.posterior_mean(xv[:50])) / s["y_sd"]).square().mean())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e_f, e_s = check.run(returned, best, key, None)
    assert e_s == pytest.approx(float(fits.cal_residuals[key].square().mean()), rel=1e-12)
    msgs = [str(w.message) for w in caught if "the final fit's error" in str(w.message)]
    if not broken:
        assert returned.model is model and returned.level is best and not msgs
        assert e_f == pytest.approx(e_bad, rel=1e-9) and e_f <= FINAL_CHECK_RATIO * e_s
        return
    assert e_bad > FINAL_CHECK_RATIO * e_s and len(msgs) == 1 and f"{e_bad:.3g}" in msgs[0]
    assert "(M=30) refitted on 400 rows" in msgs[0] and msgs[0].removeprefix("auto_fit: ") in fits.report.notes
    assert returned.model is not model and returned.level is best and returned.rows == N
    ref = _direct_fit(s["zt"], s["ut"], fits.base_kernel, s["zt"][:30], 0.05, 1.0)
    with torch.no_grad():
        expected = s["y_mu"] + s["y_sd"] * ref.posterior_mean(s["zv"][:50])
        torch.testing.assert_close(returned.model.posterior_mean(xv[:50]), expected, rtol=1e-7,
                                   atol=1e-7 * float(s["y_sd"]))
        e_ref = float(((yv[:50] - expected) / s["y_sd"]).square().mean())
    assert e_f == pytest.approx(e_ref, rel=1e-6)


def test_loo_stage_refits_the_winner_as_exact_kernel_ridge_regression_on_every_row():
    """On small data the stage ranks the validation choice and the candidates by exact leave-one-out error on every
    final row and refits the winner with every distinct row a center: the returned model is then exact kernel ridge
    regression on all rows at the winner's kernel, multiplier and noise (a dense solve in standardised units),
    its level has M = the rows, and the report records the refit."""
    from gpfalkon.auto.final import _Returned
    from gpfalkon.auto.loo_stage import _LooStage

    xt, yt, xv, yv, _, _ = _problem(7)
    fits, s = _selection(xt, yt, xv, yv, _kernel())
    final_models = _final_models(fits, xt, yt, s)
    level = dict(M=30, noise=0.05, multiplier=1.0, centers="uniform")
    model, converged = final_models.fit(level)
    returned = _Returned(model, converged, N, level, 1.0)
    state = dict(kernel=fits.base_kernel, objective="gcv", racer="gcv", lr=0.1, step=5, error=0.1, rows=N, family=None)
    other = _kernel()
    with torch.no_grad():
        other.base_kernel.lengthscale = torch.tensor([[0.4, 2.0, 2.0]], dtype=torch.float64)
    points = [dict(kernel=other, noise=0.01, multiplier=1.0, objective="sgpr", racer="sgpr", lr=0.1, step=3,
                   error=0.2, rows=N, family=None)]
    stage = _LooStage(final_models=final_models, report=fits.report, clock=_Clock(60.0, False), budget=60.0,
                      points=points, x_fin=xt, y_fin=yt, x_mu=s["x_mu"], x_sd=s["x_sd"], y_mu=s["y_mu"],
                      y_sd=s["y_sd"], dtype=torch.float64, calibrate_variance=True)
    outcome = stage.run(returned, level, state, 0.1, None)
    assert fits.report.loo.get("refit") is True and "loo" in fits.report.stages
    assert returned.model is not model and returned.level["M"] == N == returned.rows
    assert outcome.variance_scale is not None and outcome.variance_scale > 0
    k = copy.deepcopy(outcome.best_state["kernel"])
    _scale_lengthscales(k, outcome.best_level["multiplier"])
    noise = returned.level["noise"]
    with torch.no_grad():
        gram = k(s["zt"], s["zt"]).to_dense()
        alpha = torch.linalg.solve(gram + noise * torch.eye(N, dtype=torch.float64), s["ut"])
        expected = s["y_mu"] + s["y_sd"] * k(s["zv"], s["zt"]).to_dense() @ alpha
        torch.testing.assert_close(returned.model.posterior_mean(xv), expected, rtol=1e-6,
                                   atol=1e-6 * float(s["y_sd"]))
