"""Every bad input gets a clear exception naming the argument, and changes nothing."""
from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from gpfalkon import FalkonConvergenceError, FalkonGP, NotFittedError, NotPSDError

from conftest import make_data, make_kernel


@pytest.fixture
def data():
    return make_data(50, 2)


def _k():
    return make_kernel("rbf", 2)


def test_shape_mismatches(data):
    x, y = data
    with pytest.raises(ValueError, match="train_y has 49 rows but train_x has 50"):
        FalkonGP(x, y[:49], kernel=_k(), num_centers=5)
    with pytest.raises(ValueError, match="train_x must be 2-dimensional"):
        FalkonGP(x[:, 0], y, kernel=_k(), num_centers=5)
    with pytest.raises(ValueError, match=r"train_y must have shape \(n,\) or \(n, t\)"):
        FalkonGP(x, y.reshape(50, 1, 1), kernel=_k(), num_centers=5)
    with pytest.raises(ValueError, match="centers has 3 features"):
        FalkonGP(x, y, kernel=_k(), centers=torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="either centers or num_centers"):
        FalkonGP(x, y, kernel=_k(), centers=x[:3], num_centers=3)


def test_a_batched_kernel_is_refused_at_construction_and_at_fit(data):
    """One kernel serves every output (one K_nM): a kernel with a batch_shape, or with a batched part, is refused
    with the cause, at construction and (replaced after construction) at fit(), leaving the fit untouched."""
    x, y = data
    y2 = torch.stack([y, -y], 1)
    batched = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).double()
    with pytest.raises(ValueError, match=r"kernel has batch_shape=\(2,\).*one kernel for every output"):
        FalkonGP(x, y2, kernel=batched, num_centers=5)
    with pytest.raises(ValueError, match=r"kernel.base_kernel has batch_shape=\(2,\)"):
        FalkonGP(x, y2, kernel=gpytorch.kernels.ScaleKernel(batched), num_centers=5)
    model = FalkonGP(x, y2, kernel=_k(), num_centers=5).fit()
    alpha = model.alpha.clone()
    model.kernel = batched
    with pytest.raises(ValueError, match="batch_shape"):
        model.fit()
    assert torch.equal(model.alpha, alpha)


def test_a_multitask_kernel_is_refused_naming_its_outputs_per_input(data):
    """A kernel giving several outputs per input (MultitaskKernel, LCMKernel, also inside a sum) makes a
    (n t) x (M t) matrix, not FalkonGP's n x M one: refused at construction with the cause, not a shape error
    deep in fit()."""
    x, y = data
    y2 = torch.stack([y, -y], 1)
    multi = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=2).double()
    with pytest.raises(ValueError, match=r"MultitaskKernel\) gives 2 outputs per input"):
        FalkonGP(x, y2, kernel=multi, num_centers=5)
    lcm = gpytorch.kernels.LCMKernel([gpytorch.kernels.RBFKernel()] * 2, num_tasks=3).double()
    with pytest.raises(ValueError, match="gives 3 outputs per input"):
        FalkonGP(x, y2, kernel=lcm, num_centers=5)
    with pytest.raises(ValueError, match=r"kernel.kernels.1 \(MultitaskKernel\)"):
        FalkonGP(x, y2, kernel=_k() + multi, num_centers=5)


def test_active_dims_beyond_the_datas_columns_are_refused_naming_them(data):
    x, y = data
    with pytest.raises(ValueError, match=r"has active_dims=\[0, 2\] but train_x has 2 features"):
        FalkonGP(x, y, kernel=gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(active_dims=[0, 2])).double(),
                 num_centers=5)
    FalkonGP(x, y, kernel=gpytorch.kernels.RBFKernel(active_dims=[1]).double(), num_centers=5)


def test_a_dynamic_grid_interpolation_kernel_is_refused_and_a_bounded_one_fits(data):
    """GridInterpolationKernel without grid_bounds moves its grid whenever it is evaluated outside it (the fit's
    row blocks and checks would each see another grid; predictions then always found the fit stale): refused,
    naming grid_bounds. With bounds it fits, and predicts like a dense Nystrom solve of the same kernel."""
    x, y = data
    dynamic = gpytorch.kernels.GridInterpolationKernel(gpytorch.kernels.RBFKernel(), grid_size=30,
                                                       num_dims=x.shape[1]).double()
    with pytest.raises(ValueError, match="GridInterpolationKernel without grid_bounds"):
        FalkonGP(x, y, kernel=dynamic, num_centers=5)
    lo, hi = float(x.min()) - 1.0, float(x.max()) + 1.0
    fixed = gpytorch.kernels.GridInterpolationKernel(gpytorch.kernels.RBFKernel(), grid_size=30,
                                                     num_dims=x.shape[1], grid_bounds=[(lo, hi)] * x.shape[1])
    fixed = fixed.double()
    model = FalkonGP(x, y, kernel=fixed, num_centers=10, penalty=1e-2, tol=1e-12, max_iter=500).fit()
    model.eval()
    with torch.no_grad():
        c = model.centers
        knm, kmm = fixed(x, c).to_dense(), fixed(c, c).to_dense()
        n = x.shape[0]
        h = knm.T @ knm + n * 1e-2 * kmm
        yc = y - model.mean_constant
        alpha = torch.linalg.lstsq(h, knm.T @ yc).solution
        ref = fixed(x[:7], c).to_dense() @ alpha + model.mean_constant
        torch.testing.assert_close(model.posterior_mean(x[:7]), ref, rtol=1e-5, atol=1e-6)


def test_empty_data(data):
    x, y = data
    with pytest.raises(ValueError, match="train_x is empty"):
        FalkonGP(x[:0], y[:0], kernel=_k(), num_centers=1)
    with pytest.raises(ValueError, match="train_x has 0 features"):
        FalkonGP(x[:, :0], y, kernel=_k(), num_centers=1)
    with pytest.raises(ValueError, match="centers is empty"):
        FalkonGP(x, y, kernel=_k(), centers=x[:0])
    with pytest.raises(ValueError, match="train_y has 0 output columns"):
        FalkonGP(x, y[:, None][:, :0], kernel=_k(), num_centers=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite(data, bad):
    x, y = data
    xb, yb = x.clone(), y.clone()
    xb[3, 1] = bad
    yb[7] = bad
    with pytest.raises(ValueError, match="train_x contains 1 NaN or Inf"):
        FalkonGP(xb, y, kernel=_k(), num_centers=5)
    with pytest.raises(ValueError, match="train_y contains 1 NaN or Inf"):
        FalkonGP(x, yb, kernel=_k(), num_centers=5)
    with pytest.raises(ValueError, match="centers contains"):
        FalkonGP(x, y, kernel=_k(), centers=xb[:5])


def test_num_centers(data):
    x, y = data
    with pytest.raises(ValueError, match="num_centers=51 exceeds the number of training points n=50"):
        FalkonGP(x, y, kernel=_k(), num_centers=51)
    with pytest.raises(ValueError, match="num_centers must be >= 1"):
        FalkonGP(x, y, kernel=_k(), num_centers=0)
    with pytest.raises(TypeError, match="num_centers must be an int"):
        FalkonGP(x, y, kernel=_k(), num_centers=2.5)
    FalkonGP(x, y, kernel=_k(), num_centers=50)  # M = n is allowed


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), float("inf")])
def test_penalty(data, bad):
    x, y = data
    with pytest.raises(ValueError, match="penalty"):
        FalkonGP(x, y, kernel=_k(), num_centers=5, penalty=bad)
    model = FalkonGP(x, y, kernel=_k(), num_centers=5, penalty=1e-3)
    with pytest.raises(ValueError, match="penalty"):
        model.penalty = bad
    torch.testing.assert_close(model.penalty, torch.tensor(1e-3, dtype=torch.float64))  # nothing lost


def test_dtypes(data):
    x, y = data
    with pytest.raises(TypeError, match=r"train_x has dtype torch.int64"):
        FalkonGP(x.long(), y, kernel=_k(), num_centers=5)
    with pytest.raises(TypeError, match=r"train_x has dtype torch.float16"):
        FalkonGP(x.half(), y.half(), kernel=_k(), num_centers=5)
    with pytest.raises(TypeError, match=r"train_y has dtype torch.float32 but train_x has torch.float64"):
        FalkonGP(x, y.float(), kernel=_k(), num_centers=5)
    with pytest.raises(TypeError, match=r"centers has dtype torch.float32"):
        FalkonGP(x, y, kernel=_k(), centers=x[:4].float())
    with pytest.raises(TypeError, match=r"train_x must be a torch.Tensor"):
        FalkonGP(x.numpy(), y, kernel=_k(), num_centers=5)
    with pytest.raises(TypeError, match=r"kernel must be a gpytorch.kernels.Kernel"):
        FalkonGP(x, y, kernel="rbf", num_centers=5)
    with pytest.raises(TypeError, match="likelihood must be"):
        FalkonGP(x, y, kernel=_k(), num_centers=5, likelihood=gpytorch.likelihoods.BernoulliLikelihood())


def test_predict_before_fit(data):
    x, y = data
    model = FalkonGP(x, y, kernel=_k(), num_centers=5).eval()
    with pytest.raises(NotFittedError, match="call fit"):
        model(x)
    with pytest.raises(NotFittedError):
        model.posterior_factors()


def test_non_psd_kernel_is_reported(data):
    x, y = data

    class NegKernel(gpytorch.kernels.Kernel):
        """Not positive semi-definite: -RBF."""

        def forward(self, x1, x2, diag=False, **kw):
            return -gpytorch.kernels.RBFKernel().to(x1.dtype).forward(x1, x2, diag=diag)

    model = FalkonGP(x, y, kernel=NegKernel(), num_centers=5)
    alpha_before = model.alpha.clone()
    with pytest.raises(NotPSDError, match="K_MM is not positive semi-definite"):
        model.fit()
    assert not bool(model.fitted) and torch.equal(model.alpha.isnan(), alpha_before.isnan())


def test_non_finite_kernel_values_stop_cg(data):
    x, y = data

    class NaNKernel(gpytorch.kernels.Kernel):
        """Finite on the centers, NaN against data rows beyond the 10th."""

        def forward(self, x1, x2, diag=False, **kw):
            k = gpytorch.kernels.RBFKernel().to(x1.dtype).forward(x1, x2, diag=diag)
            if x1.shape[0] > 10:
                k = k.clone()
                k[-1] = float("nan")
            return k

    model = FalkonGP(x, y, kernel=NaNKernel(), centers=x[:5])
    with pytest.raises(FalkonConvergenceError, match=r"NaN or Inf|non-finite|not finite"):
        model.fit()
    assert not bool(model.fitted)


# ---------------------------------------------------------------- issue 15 (part): inputs a careful user tries
@pytest.mark.parametrize("t", [1, 2])
def test_empty_test_batch_gives_an_empty_distribution(data, t):
    x, y = data
    yy = y if t == 1 else torch.stack([y, 2 * y], -1)
    model = FalkonGP(x, yy, kernel=_k(), num_centers=8, penalty=1e-3).fit().eval()
    for shape in ((0, x.shape[1]), (3, 0, x.shape[1])):
        pred = model(torch.empty(*shape, dtype=x.dtype))
        want = (*shape[:-1], t) if t > 1 else shape[:-1]
        assert pred.mean.shape == want and pred.variance.shape == want
    # an empty batch of q > 0 points: one output gives an empty distribution; several are refused by name
    # (GPyTorch's MultitaskMultivariateNormal cannot reshape an empty batch's mean)
    empty_batch = torch.empty(0, 5, x.shape[1], dtype=x.dtype)
    if t == 1:
        assert model(empty_batch).mean.shape == (0, 5)
    else:
        with pytest.raises(ValueError, match=r"x has an empty batch shape \(0,\) with q = 5"):
            model(empty_batch)
    # a non-empty batch next to it is unaffected
    torch.testing.assert_close(model(x[:4]).mean, model(x[:6]).mean[:4])


def test_numpy_test_inputs_are_refused_by_name(data):
    x, y = data
    model = FalkonGP(x, y, kernel=_k(), num_centers=8, penalty=1e-3).fit().eval()
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor .* got ndarray"):
        model(x.numpy())


def test_one_d_and_row_source_test_inputs_are_refused_with_their_remedy(data, tmp_path):
    """A 1-D x for a model of several features (one point meant) names its shape and the reshape, not the (q, 1)
    it was read as; a row source names the blockwise prediction; a 1-D x of a one-feature model is q points."""
    import numpy as np

    from gpfalkon.backend.sources import NpyRows

    x, y = data
    d = x.shape[1]
    model = FalkonGP(x, y, kernel=_k(), num_centers=8, penalty=1e-3).fit().eval()
    with pytest.raises(ValueError, match=rf"got a 1-D tensor of shape \({d},\) .* x.reshape\(1, {d}\)"):
        model(x[0])
    np.save(tmp_path / "x.npy", x.numpy())
    src = NpyRows([tmp_path / "x.npy"])
    with pytest.raises(TypeError, match=r"got a row source \(NpyRows\): predict its rows block by block"):
        model.posterior_mean(src)
    torch.testing.assert_close(torch.cat([model.posterior_mean(b) for _, _, b in src.blocks(7)]),
                               model.posterior_mean(x))
    one = FalkonGP(x[:, :1], y, kernel=make_kernel("rbf", 1), num_centers=8, penalty=1e-3).fit().eval()
    torch.testing.assert_close(one.posterior_mean(x[:5, 0]), one.posterior_mean(x[:5, :1]))


def test_penalty_checks_python_numbers_in_float64(data):
    x, y = data
    with pytest.raises(ValueError, match=r"penalty must be > 0, got -0\.001$"):
        FalkonGP(x, y, kernel=_k(), num_centers=8, penalty=-1e-3)
    tiny = FalkonGP(x, y, kernel=_k(), num_centers=8, penalty=1e-300)  # valid, not rounded to 0
    assert float(tiny.penalty.detach()) == pytest.approx(1e-300, rel=1e-12)


def test_arguments_of_the_wrong_type_are_named_before_any_work(data):
    from gpfalkon import objectives, tuning
    from gpfalkon.botorch import FalkonModel

    x, y = data
    model = FalkonGP(x, y, kernel=_k(), num_centers=8, penalty=1e-3)
    with pytest.raises(TypeError, match="callback must be callable"):
        model.fit(callback=42)
    assert not bool(model.fitted)  # nothing half-done
    with pytest.raises(TypeError, match="seed must be an integer, got 'abc'"):
        FalkonGP(x, y, kernel=_k(), num_centers=8, seed="abc")
    with pytest.raises(ValueError, match=r"outcome_transform must be 'standardize'.*'bogus'"):
        FalkonModel(x, y.unsqueeze(-1), num_centers=8, outcome_transform="bogus")
    with pytest.raises(TypeError, match=r"outcome_transform must be 'standardize'.*int"):
        FalkonModel(x, y.unsqueeze(-1), num_centers=8, outcome_transform=3)
    with pytest.raises(TypeError, match="model must be a FalkonGP"):
        objectives.NystromCompReg("x")
    with pytest.raises(TypeError, match="Float: low must be a real number"):
        tuning.Float("a", "b")
    with pytest.raises(TypeError, match="LogFloat: high must be a real number"):
        tuning.LogFloat(1e-3, None)
    with pytest.raises(TypeError, match="Categorical: choices must be hashable"):
        tuning.Categorical([[1], [2]])
    # valid values still work
    assert tuning.Float(0, 1.5).decode(2.0) == 1.5 and tuning.Categorical(["a", "b"]).decode(0.2) == "a"


# ------------------------------------------------------------------ issue 15 reproducers
def test_targets_edited_in_place_to_nan_are_named_at_fit(data):
    x, y = data
    m = FalkonGP(x, y.clone(), kernel=_k(), num_centers=10, penalty=1e-3)
    m.train_targets[3] = float("nan")
    with pytest.raises(ValueError, match="train_y contains NaN"):
        m.fit()
    assert not bool(m.fitted)


def test_float32_overflow_of_the_kernel_is_named(data):
    x, y = data
    xs, ys = (x * 1e30).float(), y.float()
    m = FalkonGP(xs, ys, kernel=make_kernel("rbf", 2, dtype=torch.float32), num_centers=10, penalty=1e-3)
    with pytest.raises(FalkonConvergenceError, match=r"overflows in torch\.float32"):
        m.fit()


def test_objectives_name_non_finite_state(data):
    from gpfalkon.objectives import GCV, LOOCV, SGPRBound

    x, y = data
    m = FalkonGP(x, y.clone(), kernel=_k(), num_centers=10, penalty=1e-3)
    m.train_targets[0] = float("nan")
    with pytest.raises(ValueError, match="train_y contains NaN"):
        LOOCV(m)()
    m = FalkonGP(x, y, kernel=_k(), num_centers=10, penalty=1e-3)
    with torch.no_grad():
        m.likelihood.raw_noise.fill_(float("nan"))
    with pytest.raises(ValueError, match="penalty is"):
        GCV(m)()
    m = FalkonGP(x, y, kernel=_k(), num_centers=10, penalty=1e-3)
    with torch.no_grad():
        m.kernel.raw_lengthscale.fill_(float("inf"))
    with pytest.raises(ValueError, match=r"kernel parameter raw_lengthscale"):
        SGPRBound(m)()


def test_minimize_with_a_huge_learning_rate_is_named_and_restores_the_parameters(data):
    from gpfalkon.objectives import GCV

    x, y = data
    m = FalkonGP(x, y, kernel=_k(), num_centers=10, penalty=1e-3)
    obj = GCV(m)
    with pytest.raises(ValueError, match="lr"):
        obj.minimize(2, lr=float("nan"))
    # a finite but absurd step: either a named error with the parameters restored, or finite values
    try:
        vals = obj.minimize(5, lr=1e6)
    except ValueError as exc:
        assert "lr=1000000.0" in str(exc), str(exc)
    else:
        assert all(map(math.isfinite, vals))
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    obj()  # still usable


def test_searches_warn_when_evaluations_fail():
    from gpfalkon.tuning import BoTorchSearch, LogFloat, RandomSearch

    space = {"penalty": LogFloat(1e-6, 1e-1)}
    with pytest.warns(RuntimeWarning, match="none succeeded"):
        res = RandomSearch(space, lambda c: float("nan"), budget=3).run()
    assert res.best_value == math.inf
    calls = {"n": 0}

    def half_nan(config):
        calls["n"] += 1
        return float("nan") if calls["n"] % 2 else math.log(config["penalty"]) ** 2

    with pytest.warns(RuntimeWarning, match="3 of 6 evaluations"):
        res = BoTorchSearch(space, half_nan, budget=6, n_initial=2, num_restarts=2, raw_samples=16).run()
    assert math.isfinite(res.best_value)


def test_ard_kernel_of_another_dimension_is_named(data):
    x, y = data
    with pytest.raises(ValueError, match=r"kernel has ard_num_dims=5 but train_x has 2 features"):
        FalkonGP(x, y, kernel=gpytorch.kernels.RBFKernel(ard_num_dims=5).double(), num_centers=5)
    with pytest.raises(ValueError, match=r"kernel\.base_kernel has ard_num_dims=3"):
        FalkonGP(x, y, kernel=gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).double(),
                 num_centers=5)


def test_cross_validation_objectives_need_two_rows():
    from gpfalkon.objectives import GCV, LOOCV

    x = torch.tensor([[0.5]], dtype=torch.float64)
    m = FalkonGP(x, torch.tensor([0.2], dtype=torch.float64), kernel=make_kernel("rbf", 1), num_centers=1,
                 penalty=1.0)
    for cls in (GCV, LOOCV):
        with pytest.raises(ValueError, match=f"{cls.__name__} needs at least 2 training rows"):
            cls(m)()


@pytest.mark.parametrize("seed,err", [("a", TypeError), (2.7, TypeError), (True, TypeError), (2**70, ValueError)])
def test_seed_is_checked_by_name(data, seed, err):
    from gpfalkon import auto_fit

    x, y = data
    with pytest.raises(err, match="seed must be"):
        FalkonGP(x, y, _k(), num_centers=5, seed=seed)
    with pytest.raises(err, match="seed must be"):
        auto_fit(x, y, budget=1.0, seed=seed)


@pytest.mark.parametrize("chunk,err", [("a", TypeError), (2.5, TypeError), (True, TypeError), (0, ValueError)])
def test_predict_chunk_size_is_checked_by_name(data, chunk, err):
    x, y = data
    with pytest.raises(err, match="predict_chunk_size must be"):
        FalkonGP(x, y, _k(), num_centers=5, predict_chunk_size=chunk)


@pytest.mark.parametrize("penalty", [1e-50, 1e38])
def test_a_penalty_outside_the_float32_noise_range_is_refused_at_once(penalty):
    """The penalty is checked in float64, but a float32 model stores the noise n * penalty in float32: a value
    that rounds to 0 or Inf there is refused when set, not at fit() with a message about another quantity."""
    x, y = make_data(50, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"outside its range"):
        FalkonGP(x, y, make_kernel("rbf", 2, torch.float32), num_centers=5, penalty=penalty)
    model = FalkonGP(x, y, make_kernel("rbf", 2, torch.float32), num_centers=5, penalty=1e-3)
    with pytest.raises(ValueError, match=r"outside its range"):
        model.penalty = penalty
    assert float(model.penalty) == pytest.approx(1e-3)  # nothing changed
    FalkonGP(x.double(), y.double(), make_kernel("rbf", 2), num_centers=5, penalty=1e-50)  # float64 holds it


def test_auto_fit_names_a_row_source(tmp_path):
    import numpy as np

    from gpfalkon import NpyRows, auto_fit

    x, y = make_data(50, 2)
    np.save(tmp_path / "x.npy", x.numpy())
    with pytest.raises(TypeError, match="train_x: auto_fit needs an in-memory"):
        auto_fit(NpyRows(tmp_path / "x.npy"), y, budget=1.0)
