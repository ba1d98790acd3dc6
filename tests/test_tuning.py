"""Outer-loop search: spaces, random / grid / BoTorch search, resume, FALKON objectives."""
from __future__ import annotations

import math

import pytest
import torch

from gpfalkon.tuning import (
    BoTorchSearch,
    Categorical,
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
    # leverage-score centers are a valid choice (issue 6) and default settings fit
    val = falkon_validation_error()({"center_selection": "leverage", "num_centers": 50, "penalty": 1e-5}, x, y, xv, yv)
    assert 0 < val < float(yv.std())
    val = falkon_validation_error()({}, x, y, xv, yv)  # M = n, lambda = 1e-6: K_MM numerically singular
    assert 0 < val < float(yv.std())


def test_cost_aware_search_prefers_cheap_configurations():
    """Cost grows with num_centers; the optimum is flat in num_centers, so per-second
    improvement should steer the search to cheap configurations."""
    import time

    def f(c):
        time.sleep(c["num_centers"] / 20000.0)  # 0.5 ms - 50 ms
        return (math.log10(c["penalty"]) + 5) ** 2 / 4 + 0.1

    space = {"num_centers": Integer(10, 1000, log=True), "penalty": LogFloat(1e-9, 1e-2)}
    res = BoTorchSearch(space, f, budget=14, seed=0, cost_aware=True, n_initial=6).run()
    bo_part = [t for t in res.history[6:]]
    assert len(bo_part) == 8 and all(t.source == "botorch" for t in res.history)
    median_m = sorted(t.config["num_centers"] for t in bo_part)[len(bo_part) // 2]
    assert median_m < 300, [t.config["num_centers"] for t in bo_part]
    assert res.best_value < 0.6


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
