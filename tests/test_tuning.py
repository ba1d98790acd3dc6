"""Outer-loop search: spaces, random / grid / BoTorch search, resume, FALKON objectives."""
from __future__ import annotations

import math

import pytest
import torch

from gpfalkon.tuning import (
    BoTorchSearch,
    Categorical,
    Evaluation,
    Float,
    GridSearch,
    Integer,
    LogFloat,
    RandomSearch,
    SearchSpace,
    falkon_validation_error,
    gradient_tuned_error,
)

from conftest import make_data

SPACE = {"num_centers": Integer(10, 1000, log=True), "kernel": Categorical(["rbf", "matern12", "matern32"]),
         "penalty": LogFloat(1e-9, 1e-2)}


def synthetic(config):
    """Known optimum: matern32, penalty 1e-5, num_centers 300 (value 0)."""
    return ((math.log10(config["penalty"]) + 5) ** 2 / 4 + math.log(config["num_centers"] / 300) ** 2
            + (0.0 if config["kernel"] == "matern32" else 1.0))


def test_bad_spaces_raise():
    with pytest.raises(ValueError, match="choices is empty"):
        Categorical([])
    with pytest.raises(ValueError, match="duplicates"):
        Categorical(["a", "a"])
    with pytest.raises(ValueError, match="low=5 > high=3"):
        Integer(5, 3)
    with pytest.raises(ValueError, match="log=True"):
        Integer(0, 3, log=True)
    with pytest.raises(TypeError, match="ints"):
        Integer(1.5, 3)
    with pytest.raises(ValueError, match="LogFloat"):
        LogFloat(0.0, 1.0)
    with pytest.raises(ValueError, match="LogFloat"):
        LogFloat(1e-2, 1e-3)
    with pytest.raises(ValueError, match="non-empty"):
        SearchSpace({})
    with pytest.raises(TypeError, match="entry 'x'"):
        SearchSpace({"x": (1, 2)})
    with pytest.raises(ValueError, match="budget"):
        RandomSearch(SPACE, synthetic, budget=0)


def test_encode_decode_round_trip_and_grid():
    space = SearchSpace(SPACE)
    cfg = {"num_centers": 123, "kernel": "matern12", "penalty": 3e-7}
    back = space.decode(space.encode(cfg))
    assert back["num_centers"] == 123 and back["kernel"] == "matern12"
    assert math.isclose(back["penalty"], 3e-7, rel_tol=1e-12)
    grid = space.grid(30)
    assert 0 < len(grid) <= 30 and {g["kernel"] for g in grid} == {"rbf", "matern12", "matern32"}
    # "every categorical value": a budget below their number is refused, not cut to the first ones
    assert {g["kernel"] for g in space.grid(3)} == {"rbf", "matern12", "matern32"}
    with pytest.raises(ValueError, match=r"budget=2 cannot hold every combination of the categorical values \(3\)"):
        space.grid(2)
    samples = space.sample(200, torch.Generator().manual_seed(0))
    assert all(10 <= s["num_centers"] <= 1000 and 1e-9 <= s["penalty"] <= 1e-2 for s in samples)


def test_searches_find_the_known_optimum():
    bo = BoTorchSearch(SPACE, lambda c: synthetic(c), budget=25, seed=0, log_objective=False).run()
    rnd = RandomSearch(SPACE, lambda c: synthetic(c), budget=25, seed=0).run()
    grid = GridSearch(SPACE, lambda c: synthetic(c), budget=25).run()
    assert bo.best_config["kernel"] == "matern32"
    assert bo.best_value < 0.2, bo.best_value
    assert bo.best_value <= rnd.best_value and bo.best_value <= grid.best_value
    assert len(bo.history) == 25 and all(t.seconds >= 0 for t in bo.history)
    assert bo.best_so_far() == sorted(bo.best_so_far(), reverse=True)


def test_resume_from_saved_history(tmp_path):
    path = tmp_path / "history.json"
    calls = []

    def f(c):
        calls.append(c)
        return synthetic(c)

    first = RandomSearch(SPACE, f, budget=4, seed=1, history_path=path).run()
    assert path.exists() and len(first.history) == 4
    second = RandomSearch(SPACE, f, budget=7, seed=1, history_path=path).run()
    assert len(second.history) == 7 and len(calls) == 7  # only 3 new evaluations
    assert second.history[:4] == first.history


def test_falkon_objectives_run():
    x, y = make_data(400, 2)
    xv, yv = make_data(100, 2, seed=3)
    space = {"num_centers": Integer(10, 100, log=True), "kernel": Categorical(["rbf", "matern32"]),
             "penalty": LogFloat(1e-8, 1e-3)}
    res = RandomSearch(space, falkon_validation_error(max_iter=15), budget=3, seed=0).run(x, y, xv, yv)
    assert 0 < res.best_value < float(yv.std()) and len(res.history) == 3
    val = gradient_tuned_error("GCV", steps=3)({"num_centers": 20, "kernel": "rbf", "penalty": 1e-4}, x, y, xv, yv)
    assert math.isfinite(val)
    with pytest.raises(ValueError, match="center_selection"):
        falkon_validation_error()({"center_selection": "kmeans"}, x, y, xv, yv)
    with pytest.raises(ValueError, match=r"keys \['num_centres'\] this objective does not read"):
        falkon_validation_error()({"num_centres": 20}, x, y, xv, yv)
    # leverage-score centers are a valid choice (issue 6) and default settings fit
    val = falkon_validation_error()({"center_selection": "leverage", "num_centers": 50, "penalty": 1e-5}, x, y, xv, yv)
    assert 0 < val < float(yv.std())
    val = falkon_validation_error()({}, x, y, xv, yv)  # M = n, lambda = 1e-6: K_MM numerically singular
    assert 0 < val < float(yv.std())


def test_search_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    BoTorchSearch(SPACE, synthetic, budget=9, seed=0, n_initial=7, raw_samples=16, num_restarts=1).run()
    torch.testing.assert_close(torch.rand(3), expected)


def test_a_foreign_or_corrupt_history_path_is_refused_by_name(tmp_path):
    """Issue 15 (part): a history_path that is not a saved search raises ValueError naming it (was a
    bare JSONDecodeError / KeyError), and the file is left untouched."""
    for name, text in [("corrupt.json", "{not json"), ("foreign.json", '{"rows": [1, 2]}'),
                       ("bad-trial.json", '{"history": [{"config": 3, "value": 1.0, "seconds": 0.1}]}')]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=r"history_path .*" + name + r".* is not a search history"):
            RandomSearch(SPACE, synthetic, budget=2, seed=0, history_path=path)
        assert path.read_text() == text


# ---------------------------------------------------------------- issue 16: a correct search
FAST = dict(num_restarts=2, raw_samples=32)


def _chi2_p(counts: list[int], probs: list[float]) -> float:
    from scipy.stats import chisquare

    n = sum(counts)
    return float(chisquare(counts, [p * n for p in probs]).pvalue)


def test_random_draws_are_unbiased_for_every_dimension_type():
    """Reproducer: Categorical(["a", "b", "c"]) gave the end values half the probability (30,000 draws:
    b 14,904, a 7,560, c 7,536). Chi-square tests against the documented distributions."""
    gen = torch.Generator().manual_seed(0)
    n = 30_000
    cat = Categorical(["a", "b", "c"]).draw(n, gen)
    counts = [cat.count(v) for v in "abc"]
    assert _chi2_p(counts, [1 / 3] * 3) > 1e-3, counts
    ints = Integer(2, 6).draw(n, gen)
    assert _chi2_p([ints.count(v) for v in range(2, 7)], [0.2] * 5) > 1e-3
    logi = Integer(1, 8, log=True).draw(n, gen)
    probs = [math.log((v + 1) / v) / math.log(9) for v in range(1, 9)]
    assert _chi2_p([logi.count(v) for v in range(1, 9)], probs) > 1e-3
    # continuous: deciles of the (log-)scale are equally likely
    fl = torch.tensor(Float(-1.0, 3.0).draw(n, gen))
    lf = torch.tensor(LogFloat(1e-6, 1e-2).draw(n, gen)).log10()
    for z, lo, hi in ((fl, -1.0, 3.0), (lf, -6.0, -2.0)):
        bins = torch.histc(z, bins=10, min=lo, max=hi).long().tolist()
        assert sum(bins) == n and _chi2_p(bins, [0.1] * 10) > 1e-3, bins
    # through the space, each dimension independently
    space = SearchSpace({"k": Categorical(["x", "y"]), "m": Integer(0, 1)})
    pairs = [(c["k"], c["m"]) for c in space.sample(8000, gen)]
    assert _chi2_p([pairs.count(p) for p in [("x", 0), ("x", 1), ("y", 0), ("y", 1)]], [0.25] * 4) > 1e-3


def test_resume_continues_the_random_stream(tmp_path):
    """Reproducer: RandomSearch budget 3 then 6 on the same file replayed trials 1-3 as 4-6. Now the
    resumed search equals an uninterrupted one."""
    path = tmp_path / "h.json"
    RandomSearch(SPACE, synthetic, budget=3, seed=1, history_path=path).run()
    resumed = RandomSearch(SPACE, synthetic, budget=6, seed=1, history_path=path).run()
    straight = RandomSearch(SPACE, synthetic, budget=6, seed=1).run()
    configs = [t.config for t in resumed.history]
    assert configs == [t.config for t in straight.history]
    assert len({SearchSpace(SPACE).key(c) for c in configs}) == 6


def test_botorch_resume_repeats_nothing_and_labels_sources(tmp_path):
    """Reproducer: a resumed BoTorchSearch re-evaluated its first random configurations, and every trial
    was labelled "botorch" (the old test could not fail: source was a class constant)."""
    path = tmp_path / "bo.json"
    seen: list[dict] = []

    def f(c):
        seen.append(dict(c))
        return synthetic(c)

    BoTorchSearch(SPACE, f, budget=5, seed=0, n_initial=4, history_path=path, **FAST).run()
    res = BoTorchSearch(SPACE, f, budget=8, seed=0, n_initial=4, history_path=path, **FAST).run()
    space = SearchSpace(SPACE)
    assert len(seen) == 8 and len({space.key(c) for c in seen}) == 8
    assert [t.source for t in res.history[:4]] == ["random"] * 4
    assert all(t.source == "botorch" or t.source.startswith("random (") for t in res.history[4:])
    assert sum(t.source == "botorch" for t in res.history[4:]) >= 3


def test_a_history_without_generator_state_resumes_without_repeats(tmp_path):
    import json

    path = tmp_path / "old.json"
    first = RandomSearch(SPACE, synthetic, budget=3, seed=2).run()
    path.write_text(json.dumps({"history": [{"config": t.config, "value": t.value, "seconds": t.seconds,
                                             "source": "random"} for t in first.history]}))
    res = RandomSearch(SPACE, synthetic, budget=6, seed=2, history_path=path).run()
    assert len({SearchSpace(SPACE).key(t.config) for t in res.history}) == 6


def test_num_centers_above_n_is_recorded_as_run():
    """Reproducer: num_centers above n was capped silently while best_config reported the uncapped value."""
    x, y = make_data(60, 2)
    xv, yv = make_data(50, 2, seed=3)
    space = {"num_centers": Integer(100, 400), "penalty": LogFloat(1e-6, 1e-3)}
    res = RandomSearch(space, falkon_validation_error(max_iter=10), budget=3, seed=0).run(x, y, xv, yv)
    for t in res.history:
        assert t.config["num_centers"] == 60
        assert t.requested is not None and 100 <= t.requested["num_centers"] <= 400
    assert res.best_config["num_centers"] == 60
    # a configuration within n is recorded as asked
    val = falkon_validation_error(max_iter=10)({"num_centers": 30, "penalty": 1e-4}, x, y, xv, yv)
    assert isinstance(val, float)


def test_ask_tell_batches_are_distinct_and_pending_survives_a_restart(tmp_path):
    path = tmp_path / "ask.json"
    search = BoTorchSearch(SPACE, seed=0, n_initial=5, history_path=path, **FAST)
    first = search.suggest(5)
    assert len(first) == 5 and len(search.pending) == 5
    for c in first:
        search.observe(c, synthetic(c), cost=1.0)
    batch = search.suggest(3)
    space = SearchSpace(SPACE)
    keys = {space.key(c) for c in batch} | {space.key(c) for c in first}
    assert len(batch) == 3 and len(keys) == 8
    assert all(s == "botorch" for _, s in search.pending)
    # a restart (another process) sees the pending suggestions and does not suggest them again
    again = BoTorchSearch(SPACE, synthetic, budget=9, seed=0, n_initial=5, history_path=path, **FAST)
    assert [space.key(c) for c, _ in again.pending] == [space.key(c) for c in batch]
    res = again.run()  # evaluates the 3 pending ones first, then one new
    assert [space.key(t.config) for t in res.history[5:8]] == [space.key(c) for c in batch]
    assert len({space.key(t.config) for t in res.history}) == 9 and not again.pending
    assert all(t.source == "botorch" for t in res.history[5:8])
    # a configuration observed without a suggestion is the user's
    t = again.observe({"num_centers": 300, "kernel": "matern32", "penalty": 1e-5}, 0.0, cost=2.0)
    assert t.source == "user" and again.result().best_value == 0.0


def test_observe_names_bad_arguments():
    search = RandomSearch(SPACE, seed=0)
    good = {"num_centers": 30, "kernel": "rbf", "penalty": 1e-4}
    with pytest.raises(ValueError, match=r"config\['num_centers'\]=5000 is outside"):
        search.observe(dict(good, num_centers=5000), 1.0)
    with pytest.raises(ValueError, match=r"config\['kernel'\]='cubic' is outside"):
        search.observe(dict(good, kernel="cubic"), 1.0)
    with pytest.raises(ValueError, match=r"missing \['penalty'\]"):
        search.observe({"num_centers": 30, "kernel": "rbf"}, 1.0)
    with pytest.raises(ValueError, match=r"unknown \['lr'\]"):
        search.observe(dict(good, lr=0.1), 1.0)
    with pytest.raises(ValueError, match="cost must be"):
        search.observe(good, 1.0, cost=-1.0)
    with pytest.raises(TypeError, match="value must be a real number"):
        search.observe(good, "0.3")
    with pytest.raises(ValueError, match="q must be a positive int"):
        search.suggest(0)
    with pytest.raises(ValueError, match="run\\(\\) needs the objective"):
        search.run()
    with pytest.raises(ValueError, match="no configuration has been observed"):
        search.result()
    assert search.observe(good, float("nan")).value == math.inf
    # an Evaluation may name what ran, outside the bounds but in the space's types
    t = search.observe(dict(good, num_centers=31), Evaluation(0.5, dict(good, num_centers=5000)))
    assert t.config["num_centers"] == 5000 and t.requested == dict(good, num_centers=31)


def test_a_finite_space_is_exhausted_without_repeats(tmp_path):
    space = {"k": Categorical(["a", "b"]), "m": Integer(1, 2)}
    with pytest.warns(RuntimeWarning, match="every one of the space's 4 configurations"):
        res = RandomSearch(space, lambda c: 1.0, budget=6, seed=0).run()
    assert len(res.history) == 4 and len({(t.config["k"], t.config["m"]) for t in res.history}) == 4
    grid = GridSearch(space, lambda c: 1.0, budget=4, history_path=tmp_path / "g.json")
    grid.run()
    resumed = GridSearch(space, lambda c: 1.0, budget=4, history_path=tmp_path / "g.json")
    assert resumed.suggest(1) == []


def test_cost_aware_search_prefers_cheap_configurations():
    """The objective is flat in x; the cost (known, given to observe: no sleeping) grows 50-fold along x.
    Per-cost improvement steers the model-based suggestions to cheap x; plain LogEI does not."""
    space = {"x": Float(0.0, 1.0), "y": Float(0.0, 1.0)}

    def value(c):
        return (c["y"] - 0.3) ** 2

    def cost(c):
        return math.exp(4.0 * c["x"])

    picks = {}
    for aware in (True, False):
        s = BoTorchSearch(space, seed=0, n_initial=6, cost_aware=aware, log_objective=False, **FAST)
        for _ in range(14):
            (c,) = s.suggest(1)
            s.observe(c, value(c), cost=cost(c))
        picks[aware] = [t.config["x"] for t in s.history[6:] if t.source == "botorch"]
    assert len(picks[True]) >= 6
    mean = {k: sum(v) / len(v) for k, v in picks.items()}
    assert mean[True] < 0.25 and mean[True] < mean[False] - 0.1, mean



def test_values_records_and_saved_state_survive_real_world_types(tmp_path):
    """Review findings: tensor values are accepted; a bad Evaluation.config leaves the suggestion pending;
    numpy scalars in choices and configs round-trip through the saved JSON; a leverage-score fit with
    num_centers <= n is recorded as asked."""
    import numpy as np

    space = {"m": Integer(1, 50), "k": Categorical(np.array([3, 5, 7])), "p": LogFloat(1e-3, 1.0)}
    path = tmp_path / "s.json"
    search = RandomSearch(space, seed=0, history_path=path)
    (c,) = search.suggest(1)
    search.observe(c, torch.tensor(0.25))
    assert search.history[-1].value == 0.25
    (c,) = search.suggest(1)
    with pytest.raises(ValueError, match=r"Evaluation\.config"):
        search.observe(c, Evaluation(0.1, dict(c, k=4)))
    assert [cfg for cfg, _ in search.pending] == [c]  # still pending, not lost
    search.observe(dict(c, m=np.int64(c["m"])), np.float64(0.5))
    resumed = RandomSearch(space, seed=0, history_path=path)
    assert [t.config for t in resumed.history] == [t.config for t in search.history]
    assert all(type(t.config["k"]) is int for t in resumed.history)

    x, y = make_data(80, 2)
    xv, yv = make_data(30, 2, seed=3)
    val = falkon_validation_error(max_iter=10)({"num_centers": 70, "center_selection": "leverage",
                                                "penalty": 1e-3}, x, y, xv, yv)
    assert type(val) is float


def test_validation_error_of_column_targets_is_the_rmse():
    """(n, 1) targets (BoTorch's convention) give the same validation RMSE as (n,) targets, equal to an
    independent evaluation of the fitted model; a val_y of another shape is refused, naming val_y."""
    from gpfalkon import FalkonGP
    from gpfalkon.heuristics import median_lengthscale

    x, y = make_data(200, 2)
    xv, yv = make_data(80, 2, seed=3)
    cfg = {"num_centers": 40, "kernel": "rbf", "penalty": 1e-4}
    flat = falkon_validation_error(max_iter=15)(cfg, x, y, xv, yv)
    col = falkon_validation_error(max_iter=15)(cfg, x, y.unsqueeze(-1), xv, yv.unsqueeze(-1))
    assert col == pytest.approx(flat, rel=1e-10)
    from gpytorch.kernels import RBFKernel

    k = RBFKernel().to(x)
    k.lengthscale = float(median_lengthscale(x))
    model = FalkonGP(x, y, kernel=k, num_centers=40, penalty=1e-4, max_iter=15, tol=0.0, seed=0)
    model.fit()
    ref = float((model.posterior_mean(xv) - yv).square().mean().sqrt())
    assert flat == pytest.approx(ref, rel=1e-5)  # the same fit up to the kernel's construction
    with pytest.raises(ValueError, match=r"val_y has shape \(80, 2\)"):
        falkon_validation_error(max_iter=15)(cfg, x, y, xv, torch.stack([yv, yv], -1))
    tuned = gradient_tuned_error(steps=2)
    assert tuned(cfg, x, y.unsqueeze(-1), xv, yv.unsqueeze(-1)) == pytest.approx(tuned(cfg, x, y, xv, yv), rel=1e-6)


@pytest.mark.parametrize("fixed", [Integer(3, 3), Categorical(["rbf"])])
def test_botorch_search_keeps_one_valued_dimensions_fixed(fixed):
    """A dimension with one value (accepted by its constructor) is held fixed, not modelled: BoTorch's proposals
    carry that value, and the search moves the free dimension toward the known optimum (a zero-range column would
    make Normalize divide by zero, a one-choice categorical break the mixed optimiser)."""
    space = {"fixed": fixed, "x": Float(0.0, 1.0)}
    value = fixed.low if isinstance(fixed, Integer) else "rbf"
    res = BoTorchSearch(space, lambda c: (c["x"] - 0.3) ** 2 + 0.01, budget=9, seed=0, n_initial=3, **FAST).run()
    bo = [t for t in res.history if t.source == "botorch"]
    assert len(res.history) == 9 and bo
    assert all(t.config["fixed"] == value and list(t.config) == ["fixed", "x"] for t in res.history)
    assert abs(res.best_config["x"] - 0.3) < abs(min(res.history[:3], key=lambda t: t.value).config["x"] - 0.3) + 1e-9
