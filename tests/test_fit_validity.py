"""Fit validity by content (issue 15, item 2): the digest of the training data and of the
hyperparameter groups, in-place edits, and state loads that say what differs."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from gpfalkon import FalkonConvergenceError, FalkonGP, FalkonOptions, NotFittedError
from gpfalkon.models.fit_state import content_digest, data_fingerprint

from conftest import make_data, make_kernel


def _model(x, y, **kw):
    kw.setdefault("kernel", make_kernel("rbf", x.shape[1], dtype=x.dtype))
    if "centers" not in kw:
        kw.setdefault("num_centers", 20)
    if "likelihood" not in kw:
        kw.setdefault("penalty", 1e-3)
    kw.setdefault("tol", 1e-10)
    kw.setdefault("max_iter", 200)
    return FalkonGP(x, y, **kw)


@pytest.fixture
def fitted():
    x, y = make_data(120, 3)
    xt = x[:5] + 0.01
    return _model(x, y).fit(), xt


# ------------------------------------------------------------------ the digest
def test_digest_sees_every_word_and_the_order():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=g, dtype=torch.float64)
    base = content_digest([x])
    assert content_digest([x.clone()]) == base  # by content, not identity
    # one ulp of one float64 entry (either 32-bit half of the word can change)
    for i, j in ((0, 0), (123, 2), (299, 3)):
        z = x.clone()
        z[i, j] = torch.nextafter(z[i, j], torch.tensor(float("inf"), dtype=torch.float64))
        assert content_digest([z]) != base, (i, j)
    # reorderings keep every sum and norm but not the digest
    assert content_digest([x.flip(0)]) != base
    swapped = x.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert content_digest([swapped]) != base
    # structured edits a position-linear weighting would miss: +d, -d, -d, +d at i, i+s, i+t, i+s+t
    y = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert content_digest([y]) != content_digest([torch.tensor([1.0, 0.0, 0.0, 1.0])])
    z = torch.zeros(64, dtype=torch.float32)
    w = z.clone()
    w[[5, 9, 20, 24]] = torch.tensor([1.0, -1.0, -1.0, 1.0])
    assert content_digest([z]) != content_digest([w])
    # shape and dtype are part of it
    assert content_digest([x.reshape(600, 2)]) != base
    assert content_digest([x.float()]) != content_digest([x.float().double()])
    # non-contiguous views hash their values
    assert content_digest([x.T.contiguous().T]) == base


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_data_digest_is_additive_over_shards(dtype):
    """The digest of a data set split in two shards (rows 0..k-1 and k..n-1), completed by a sum
    over the shards as the distributed backend's collective does, is that of all rows."""
    x, y = make_data(101, 3, dtype=dtype)
    full_summary, full_digest = data_fingerprint(x, y)
    k = 37
    held = {}

    def keep(t):
        held["b"] = t.clone()
        return t

    data_fingerprint(x[k:], y[k:], reduce=keep, row_offset=lambda: k)
    summary, digest = data_fingerprint(x[:k], y[:k], reduce=lambda t: t + held["b"], row_offset=lambda: 0)
    assert torch.equal(digest, full_digest)
    torch.testing.assert_close(summary, full_summary, rtol=1e-12, atol=1e-12)
    # a shard that claims the wrong offset does not reproduce it
    _, wrong = data_fingerprint(x[:k], y[:k], reduce=lambda t: t + held["b"], row_offset=lambda: 1)
    assert not torch.equal(wrong, full_digest)


# ------------------------------------------------------------------ in-place edits
def test_in_place_reordering_of_targets_makes_the_fit_stale(fitted):
    m, xt = fitted
    m.eval()
    with torch.no_grad():
        m(xt)
    y = m.train_targets
    y.copy_(y.flip(0))  # same sum and norm
    with pytest.raises(NotFittedError, match="changed since"):
        m(xt)


def test_swapping_two_training_rows_makes_the_fit_stale(fitted):
    m, xt = fitted
    m.eval()
    x = m.train_inputs[0]
    x[[0, 1]] = x[[1, 0]]
    with pytest.raises(NotFittedError, match="changed since"):
        m(xt)


def test_an_identical_copy_of_the_data_keeps_the_fit(fitted):
    m, xt = fitted
    m.eval()
    with torch.no_grad():
        before = m(xt).mean
    m.set_train_data(m.train_inputs[0].clone(), m.train_targets.clone())
    assert bool(m.fitted)
    with torch.no_grad():
        torch.testing.assert_close(m(xt).mean, before)


def test_set_train_data_keeps_the_fit_only_for_rounding_level_changes(fitted):
    m, _ = fitted
    y = m.train_targets
    ulp = torch.nextafter(y, torch.full_like(y, float("inf")))  # every target one ulp up
    m.set_train_data(targets=ulp)
    assert bool(m.fitted) and not m._hyper_changed()
    m.set_train_data(targets=ulp * (1 + 1e-9))  # far above rounding
    assert not bool(m.fitted)


# ------------------------------------------------------------------ state loads
def _load(model, state, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(state, **kw)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_matching_state_loads_fitted_and_predicts_the_same(fitted):
    m, xt = fitted
    x, y = m.train_inputs[0], m.train_targets
    fresh = _model(x.clone(), y.clone())
    assert _load(fresh, m.state_dict()) == []
    assert bool(fresh.fitted)
    fresh.eval()
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(xt).mean, m(xt).mean)


def test_state_fitted_on_permuted_targets_loads_unfitted_naming_train_y(fitted):
    m, _ = fitted
    x, y = m.train_inputs[0], m.train_targets
    other = _model(x.clone(), y.flip(0).clone())
    msgs = _load(other, m.state_dict())
    assert not bool(other.fitted)
    assert len(msgs) == 1 and "train_y" in msgs[0] and "train_x" not in msgs[0], msgs


def test_partial_state_without_kernel_keys_loads_unfitted_naming_the_kernel(fitted):
    m, _ = fitted
    x, y = m.train_inputs[0], m.train_targets
    other = _model(x.clone(), y.clone())
    other.kernel.lengthscale = 3.0 * m.kernel.lengthscale.detach()
    state = {k: v for k, v in m.state_dict().items() if not k.startswith("kernel.")}
    msgs = _load(other, state, strict=False)
    assert not bool(other.fitted)
    assert len(msgs) == 1 and "kernel hyperparameters" in msgs[0], msgs


def test_state_with_nan_alpha_never_loads_fitted(fitted):
    m, _ = fitted
    state = copy.deepcopy(m.state_dict())
    state["alpha"][0] = float("nan")
    other = _model(m.train_inputs[0].clone(), m.train_targets.clone())
    msgs = _load(other, state)
    assert not bool(other.fitted)
    assert len(msgs) == 1 and "NaN" in msgs[0], msgs


def test_float64_state_into_a_float32_model_names_the_dtype(fitted):
    m, _ = fitted
    x, y = m.train_inputs[0], m.train_targets
    other = _model(x.float(), y.float())
    msgs = _load(other, m.state_dict())
    assert not bool(other.fitted)
    assert len(msgs) == 1 and "dtype" in msgs[0] and "train_y" not in msgs[0], msgs
    # the route the message gives keeps the fit: load in float64, then move
    same = _model(x.clone(), y.clone())
    assert _load(same, m.state_dict()) == []
    same = same.float()
    assert bool(same.fitted) and not same._hyper_changed()


def test_state_saved_before_digests_loads_by_sums_and_norms(fitted):
    m, xt = fitted
    state = {k: v for k, v in m.state_dict().items() if k != "fit_digest"}
    other = _model(m.train_inputs[0].clone(), m.train_targets.clone())
    assert _load(other, state) == []
    assert bool(other.fitted)
    other.eval()
    with torch.no_grad():
        other(xt)  # not stale: the digests were recorded at the load
    other.train_targets.copy_(other.train_targets.flip(0))
    with pytest.raises(NotFittedError):
        other(xt)


def test_a_fit_that_produces_nan_alpha_raises_and_stays_unfitted():
    x, y = make_data(60, 2)

    def nan_solver(h_matmul, precond, rhs, x0=None, **kw):
        from gpfalkon.solvers import falkon_solve

        sol, info = falkon_solve(h_matmul, precond, rhs, x0, **kw)
        return sol * float("nan"), info

    m = _model(x, y, options=FalkonOptions(solver=nan_solver))
    with pytest.raises(FalkonConvergenceError, match="alpha contains NaN"):
        m.fit()
    assert not bool(m.fitted)


def test_a_model_pickled_before_digests_saves_a_state_that_loads_fitted(fitted):
    """An unpickled model from before ``fit_digest`` (its buffer and flag removed here) revalidates by
    sums and norms, and its state dict then carries the digests, so it loads fitted elsewhere."""
    m, xt = fitted
    state = dict(copy.deepcopy(m).__dict__)
    del state["_buffers"]["fit_digest"]
    del state["_legacy_state"]
    old = FalkonGP.__new__(FalkonGP)
    old.__setstate__(state)
    old.eval()
    with torch.no_grad():
        old(xt)  # valid by sums and norms
    sd = old.state_dict()
    assert bool((sd["fit_digest"] != 0).any())
    fresh = _model(m.train_inputs[0].clone(), m.train_targets.clone())
    assert _load(fresh, sd) == []
    assert bool(fresh.fitted)


@pytest.mark.parametrize("offset", [0, 5, 2**20 + 3, 2**40 + 7, 2**62 + 11])
def test_cpu_digest_kernel_equals_the_torch_definition(offset):
    """The C++ digest (one pass) gives the same integers as the torch definition for every word width, sizes
    around the kernel's eight lanes and torch's blocks, non-contiguous input and large word offsets."""
    from gpfalkon.backend import fused
    from gpfalkon.models.fit_state import _ROOTS, _digest_tensor, _raw_words

    ok, why = fused.fused_available()
    if not ok:
        pytest.skip(f"C++ kernels unavailable: {why}")
    g = torch.Generator().manual_seed(offset % 97)
    cases = [torch.randn(1000, 3, generator=g), torch.randn(17, dtype=torch.float64, generator=g),
             torch.randn(9, generator=g).to(torch.float16), torch.randn(4, generator=g).to(torch.bfloat16),
             torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8), torch.rand(33, generator=g) > 0.5,
             torch.randint(-2**31, 2**31 - 1, (2**20 + 11,), generator=g, dtype=torch.int32),
             torch.full((71,), -1, dtype=torch.int32), torch.empty(0), torch.randn(5, 3, generator=g).mT,
             torch.randint(-100, 100, (8,), generator=g, dtype=torch.int8)]
    for t in cases:
        assert fused.word_digest(_raw_words(t)[0], offset, _ROOTS) is not None  # the kernel path runs
        fast = _digest_tensor(t, offset)
        fused.set_enabled(False)
        try:
            slow = _digest_tensor(t, offset)
        finally:
            fused.set_enabled(None)
        assert fast == slow, (t.dtype, tuple(t.shape))


def test_fingerprint_sums_match_float64_sums():
    """The summary's sums and norms (taken chunk by chunk) equal the float64 sums of the whole tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 2**18 + 5, 4, generator=g)  # more than one chunk of 2^20 values
    y = torch.randn(3 * 2**18 + 5, generator=g)
    summary, _ = data_fingerprint(x, y)
    x64, y64 = x.double(), y.double()
    want = torch.tensor([x.shape[0], 4, x64.sum(), x64.norm(), y64.sum(), y64.norm()], dtype=torch.float64)
    torch.testing.assert_close(summary, want, rtol=1e-12, atol=1e-9)


def test_fingerprint_legacy_sums_are_the_old_expressions():
    """A state saved before content digests is compared by its summary at rtol 1e-12: with ``legacy_sums`` the
    sums are the whole-tensor expressions such states were saved with, bit for bit (standardised float64
    targets, whose sum is near zero: another summation order changes its leading digits)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2**20 + 5, 1, generator=g, dtype=torch.float64)
    y = torch.randn(2**20 + 5, generator=g, dtype=torch.float64)
    y = (y - y.mean()) / y.std()
    summary, _ = data_fingerprint(x, y, legacy_sums=True)
    assert float(summary[2]) == float(x.sum(dtype=torch.float64))
    assert float(summary[3]) == float(x.to(torch.float64).square().sum().sqrt())
    assert float(summary[4]) == float(y.sum(dtype=torch.float64))
    assert float(summary[5]) == float(y.to(torch.float64).square().sum().sqrt())


@pytest.mark.parametrize("change", ["kernel", "base_kernel", "nu", "transform"])
def test_a_kernel_replaced_or_reconfigured_after_fit_makes_the_fit_stale(change):
    """A kernel (or a part of one) of another class has the same raw parameter values as the old one (GPyTorch's
    defaults are all 0) and a Matern ``nu`` is not a parameter: the fit must still become stale, and a deep copy
    or pickle of the fitted model must not (same structure)."""
    import pickle

    from gpytorch.constraints import Positive
    from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

    x, y = make_data(150, 3)
    xt = x[:4] + 0.01
    model = _model(x, y, kernel=ScaleKernel(MaternKernel(nu=2.5)).double()).fit().eval()
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone(xt)  # still fitted
    if change == "kernel":
        model.kernel = ScaleKernel(RBFKernel()).double()
    elif change == "base_kernel":
        model.kernel.base_kernel = RBFKernel().double()
    elif change == "nu":
        model.kernel.base_kernel.nu = 0.5
    else:  # a constraint with another transform, same bounds and raw values
        model.kernel.base_kernel.register_constraint("raw_lengthscale", Positive(transform=torch.exp,
                                                                                 inv_transform=torch.log))
    with pytest.raises(NotFittedError, match="changed since"):
        model(xt)
    model.fit()
    reference = FalkonGP(x, y, kernel=model.kernel, centers=model.centers.clone(), penalty=1e-3, tol=1e-10,
                         max_iter=200).fit().eval()
    torch.testing.assert_close(model(xt).mean, reference(xt).mean, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("first_task", [0.0, 1.0])
def test_a_state_loaded_across_kernel_classes_with_an_index_column_loads_unfitted(first_task):
    """An IndexKernel's column holds task indices: the kernel probe's shifted point (first center + 1) is no task
    where the first center has the last one. The probe then uses the centers alone; a state of an RBF x Index
    kernel loaded into a Matern x Index model (same parameter names and values) is marked unfitted, whichever
    task the first center has."""
    from gpytorch.kernels import IndexKernel, MaternKernel, RBFKernel

    g = torch.Generator().manual_seed(0)
    n = 200
    x = torch.cat([torch.randn(n, 2, generator=g, dtype=torch.float64), torch.zeros(n, 1, dtype=torch.float64)], -1)
    x[1::2, 2] = 1.0
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 2]
    centers = x[:20].clone()
    centers[0, 2] = first_task

    def model(base):
        k = (base(active_dims=[0, 1]) * IndexKernel(num_tasks=2, rank=1, active_dims=[2])).double()
        return FalkonGP(x, y, kernel=k, centers=centers, penalty=1e-3, tol=1e-10, max_iter=200)

    saved = model(RBFKernel).fit()
    assert saved.kernel_probe.numel() > 0
    other = model(MaternKernel)
    with pytest.warns(RuntimeWarning, match="kernel's values"):
        other.load_state_dict(saved.state_dict())
    assert not other.fitted
    same = model(RBFKernel)
    same.load_state_dict(saved.state_dict())
    assert same.fitted
    torch.testing.assert_close(same.eval().posterior_mean(x[:5]), saved.eval().posterior_mean(x[:5]))


@pytest.mark.parametrize("change", ["constraint", "likelihood"])
def test_a_noise_constraint_or_likelihood_replaced_after_fit_makes_the_fit_stale(change):
    """The noise is the likelihood's constraint applied to its raw parameter: another constraint (or another
    likelihood with the same raw value) is another sigma^2, so alpha no longer solves the system. The fit becomes
    stale; fitting again gives the dense solve at the new noise."""
    from gpytorch.constraints import GreaterThan
    from gpytorch.likelihoods import GaussianLikelihood

    x, y = make_data(150, 3)
    xt = x[:4] + 0.01
    model = _model(x, y).fit().eval()
    raw = model.likelihood.raw_noise.detach().clone()
    if change == "constraint":
        model.likelihood.noise_covar.register_constraint("raw_noise", GreaterThan(1e-6))
    else:
        lik = GaussianLikelihood(noise_constraint=GreaterThan(1e-6)).double()
        lik.raw_noise.data.copy_(raw)
        model.likelihood = lik
    assert torch.equal(model.likelihood.raw_noise.detach(), raw)  # the raw value is the same
    with pytest.raises(NotFittedError, match="changed since"):
        model(xt)
    model.fit()
    reference = _model(x, y, centers=model.centers.clone(), penalty=float(model.penalty)).fit().eval()
    torch.testing.assert_close(model(xt).mean, reference(xt).mean, rtol=1e-8, atol=1e-8)


def test_a_state_loaded_into_a_model_with_another_noise_constraint_loads_unfitted(fitted):
    """The same raw noise read through another constraint transform is another noise: the load says so, and the
    model is unfitted. A model pickled before the noise value was recorded unpickles fitted (the value its
    likelihood computes now is taken as the fit's)."""
    import pickle

    from gpytorch.constraints import GreaterThan
    from gpytorch.likelihoods import GaussianLikelihood

    m, xt = fitted
    x, y = m.train_inputs[0], m.train_targets
    lik = GaussianLikelihood(noise_constraint=GreaterThan(1e-6)).double()
    other = _model(x.clone(), y.clone(), likelihood=lik)
    msgs = _load(other, m.state_dict())
    assert len(msgs) == 1 and "the noise sigma^2" in msgs[0], msgs
    assert not bool(other.fitted)
    same = _model(x.clone(), y.clone())
    assert _load(same, m.state_dict()) == [] and bool(same.fitted)
    state = dict(copy.deepcopy(m).__dict__)
    del state["_buffers"]["fit_noise"]
    state["_fit_tracker"].snapshot.pop(m._noise_dependency_index())
    old = FalkonGP.__new__(FalkonGP)
    old.__setstate__(state)
    old.eval()
    with torch.no_grad():
        torch.testing.assert_close(old(xt).mean, m.eval()(xt).mean)
    old2 = pickle.loads(pickle.dumps(old))
    assert bool(old2.fitted) and math.isfinite(float(old2.state_dict()["fit_noise"]))


def test_flags_are_not_shared_by_state_dicts_or_assigned_loads(fitted):
    """``fitted`` is replaced, never written in place: a state dict taken before ``set_train_data`` still says
    fitted, and a model that loaded a state with ``assign=True`` and was found unfitted leaves the source fitted."""
    m, xt = fitted
    x, y = m.train_inputs[0], m.train_targets
    sd = m.state_dict()
    other = _model(x.clone() + 1.0, y.clone())
    msgs = _load(other, m.state_dict(), assign=True)
    assert msgs and not bool(other.fitted)
    assert bool(m.fitted)
    m.eval()(xt)  # still fitted
    m.set_train_data(x + 0.5, y, strict=False)
    assert not bool(m.fitted) and bool(sd["fitted"])
    fresh = _model(x.clone(), y.clone())
    assert _load(fresh, sd) == [] and bool(fresh.fitted)


def test_fit_info_follows_the_loaded_alpha(fitted):
    m, _ = fitted
    x, y = m.train_inputs[0], m.train_targets
    other = _model(x.clone(), y.clone(), centers=m.centers.clone(), max_iter=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.fit()
    assert other.fit_info is not None and other.fit_info.iterations == 3
    other.load_state_dict(m.state_dict())
    assert other.fit_info is None  # m's alpha: its CG record is not in the state
    info = m.fit_info
    m.load_state_dict(m.state_dict())
    assert m.fit_info is info  # the same alpha: the record stays


def test_warm_start_after_set_train_data_starts_from_the_previous_alpha():
    """``set_train_data`` makes the model unfitted but keeps alpha: ``fit(warm_start=True)`` starts from it (far
    fewer CG iterations after a small change of the targets) and reaches the cold fit's solution."""
    x, y = make_data(400, 3)
    xt = x[:5] + 0.01
    opts = FalkonOptions(solve_method="cg")
    m = _model(x, y, options=opts).fit()
    y2 = y + 1e-3 * torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    m.set_train_data(x, y2)
    assert not bool(m.fitted)
    m.fit(warm_start=True)
    cold = _model(x, y2, centers=m.centers.clone(), options=opts).fit()
    assert m.fit_info.iterations < cold.fit_info.iterations, (m.fit_info.iterations, cold.fit_info.iterations)
    torch.testing.assert_close(m.eval()(xt).mean, cold.eval()(xt).mean, rtol=1e-7, atol=1e-7)


def test_a_move_through_half_precision_unfits_the_model(fitted):
    """float16 / bfloat16 round the data and hyperparameters (and the model does not predict in them): a
    ``.half()`` or ``.bfloat16()`` and back leaves it unfitted; ``.float()`` keeps a valid fit (to float32)."""
    m, xt = fitted
    for there in (lambda t: t.half(), lambda t: t.bfloat16()):
        moved = there(copy.deepcopy(m)).double()
        assert not bool(moved.fitted)
        with pytest.raises(NotFittedError):
            moved.eval()(xt)
    kept = copy.deepcopy(m).float()
    assert bool(kept.fitted)
