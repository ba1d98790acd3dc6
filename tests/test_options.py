"""FalkonOptions and the injectable parts: solver, preconditioner, data backend."""
from __future__ import annotations

from typing import ClassVar

import linear_operator
import pytest
import torch

import gpfalkon
from gpfalkon import FalkonGP, FalkonOptions, NystromKRROperator, falkon_solve
from gpfalkon.backend import KernelEngine
from gpfalkon.solvers import Preconditioner

from conftest import dense_kernel, make_data, make_kernel


def _dense_alpha(k, x, c, lam, y):
    knm = dense_kernel(k, x, c)
    h = knm.T @ knm + x.shape[0] * lam * dense_kernel(k, c, c)
    return torch.linalg.solve(h, knm.T @ y)


# ------------------------------------------------------------------ the options object
def test_options_validate_and_name_the_argument():
    with pytest.raises(ValueError, match="tol"):
        FalkonOptions(tol=-1.0)
    with pytest.raises(TypeError, match="tol"):
        FalkonOptions(tol="1e-6")
    with pytest.raises(ValueError, match="max_iter"):
        FalkonOptions(max_iter=-1)
    with pytest.raises(TypeError, match="memory_budget"):
        FalkonOptions(memory_budget=1.5)
    with pytest.raises(ValueError, match="block_rows"):
        FalkonOptions(block_rows=0)
    with pytest.raises(TypeError, match="store_kernel"):
        FalkonOptions(store_kernel="yes")
    with pytest.raises(ValueError, match="precond_dtype"):
        FalkonOptions(precond_dtype=torch.float16)
    with pytest.raises(TypeError, match="solver"):
        FalkonOptions(solver=3)
    with pytest.raises(TypeError, match="no option"):
        FalkonOptions().replace(tolerance=1e-3)
    with pytest.raises(TypeError, match="backend"):
        FalkonOptions(backend="gpu")
    with pytest.raises(TypeError, match="verbose"):
        FalkonOptions(verbose="loud")
    # what the keyword arguments accepted before FalkonOptions still works, converted
    o = FalkonOptions(memory_budget=2e9, block_rows=64.0, max_iter=torch.tensor(5), tol=torch.tensor(1e-6),
                      verbose=1, store_kernel=0)
    assert (o.memory_budget, o.block_rows, o.max_iter, o.verbose, o.store_kernel) == (2_000_000_000, 64, 5, True, False)
    assert isinstance(o.tol, float) and o.tol == pytest.approx(1e-6)
    assert type(o.memory_budget) is int and type(o.max_iter) is int


def test_options_merge_keywords_and_refuse_conflicts():
    base = FalkonOptions(tol=1e-4, block_rows=64)
    assert FalkonOptions.merged(base, max_iter=7) == FalkonOptions(tol=1e-4, block_rows=64, max_iter=7)
    assert FalkonOptions.merged(base, tol=1e-4) == base  # the same value twice is fine
    with pytest.raises(ValueError, match="tol is given both"):
        FalkonOptions.merged(base, tol=1e-5)
    with pytest.raises(TypeError, match="options must be"):
        FalkonOptions.merged({"tol": 1e-4})


def test_options_resolve_against_the_settings_at_call_time():
    opts = FalkonOptions()
    assert opts.resolved().tol == gpfalkon.settings.cg_tolerance.value()
    with gpfalkon.settings.cg_tolerance(1e-9), gpfalkon.settings.max_cg_iterations(17):
        r = opts.resolved()
        assert (r.tol, r.max_iter) == (1e-9, 17)
        # linear_operator's settings win when set below their defaults
        with linear_operator.settings.cg_tolerance(1e-3), linear_operator.settings.max_cg_iterations(5):
            r = opts.resolved()
            assert (r.tol, r.max_iter) == (1e-3, 5)
    # explicit values win over everything
    with linear_operator.settings.cg_tolerance(1e-3):
        assert FalkonOptions(tol=1e-7).resolved().tol == 1e-7
    with gpfalkon.settings.memory_budget(12345):
        assert opts.resolved().memory_budget == 12345


def test_falkon_gp_keywords_build_the_options():
    x, y = make_data(80)
    m = FalkonGP(x, y, num_centers=10, tol=1e-9, max_iter=77, store_kernel=False)
    assert m.options == FalkonOptions(tol=1e-9, max_iter=77, store_kernel=False)
    m.tol = 1e-5  # attribute assignment still works and replaces the options
    assert m.options.tol == 1e-5
    op = m.nystrom_operator(block_rows=9)
    assert op.options.block_rows == 9 and op.options.tol == 1e-5 and op.block_rows == 9
    with pytest.raises(ValueError, match="max_iter"):
        FalkonGP(x, y, num_centers=10, max_iter=5, options=FalkonOptions(max_iter=6))


# ----------------------------------------------------------------------- injected parts
def test_injected_solver_is_used_and_gives_the_same_solution():
    x, y = make_data(200)
    k = make_kernel("scale_matern52", x.shape[1])
    calls = []

    def counting_solver(*args, **kwargs):
        calls.append(kwargs["tol"])
        return falkon_solve(*args, **kwargs)

    opts = FalkonOptions(solver=counting_solver, tol=1e-12, max_iter=300)
    m = FalkonGP(x, y, kernel=k, num_centers=30, penalty=1e-4, options=opts).fit()
    assert calls == [1e-12]
    ref = _dense_alpha(k, x, m.centers, 1e-4, y)
    torch.testing.assert_close(m.alpha, ref, rtol=1e-7, atol=1e-9)


class _ScaledIdentity:
    """B = s I: no preconditioning at all (CG on a rescaled H)."""

    def __init__(self, s: float) -> None:
        self.s = s

    def apply_b(self, rhs):
        return rhs * self.s

    def apply_bt(self, rhs):
        return rhs * self.s

    def apply_b_inv(self, rhs):
        return rhs / self.s


def test_injected_preconditioner_builder_solves_the_same_system():
    x, y = make_data(150)
    k = make_kernel("scale_rbf", x.shape[1])
    c = x[:20].clone()
    lam = torch.tensor(1e-2, dtype=torch.float64)
    built = []

    def builder(kmm, penalty, n, weights=None, dtype=torch.float64, jitter=None):
        built.append(kmm.shape)
        return _ScaledIdentity(1.0 / float(kmm.diagonal().mean() * n) ** 0.5)

    assert isinstance(_ScaledIdentity(1.0), Preconditioner)
    op = NystromKRROperator(x, c, lam, kernel=k, preconditioner=builder, tol=1e-12, max_iter=2000)
    sol = op.solve(op.kmn_y(y.unsqueeze(-1)))
    assert built == [torch.Size([20, 20])]
    torch.testing.assert_close(sol.squeeze(-1), _dense_alpha(k, x, c, lam, y), rtol=1e-6, atol=1e-8)
    # the FALKON preconditioner needs far fewer iterations on the same system
    falkon_op = NystromKRROperator(x, c, lam, kernel=k, tol=1e-12, max_iter=2000)
    falkon_op.solve(falkon_op.kmn_y(y.unsqueeze(-1)))
    assert falkon_op.last_info.iterations < op.last_info.iterations


def test_preconditioner_builder_must_return_a_preconditioner():
    x, _y = make_data(50)
    k = make_kernel("rbf", x.shape[1])
    op = NystromKRROperator(x, x[:5].clone(), 1e-2, kernel=k, preconditioner=lambda *a, **kw: object())
    with pytest.raises(TypeError, match="apply_b"):
        op.solve(torch.ones(5, 1, dtype=torch.float64))


class _CountingEngine(KernelEngine):
    passes = 0

    def iter_blocks(self, rows=None):
        type(self).passes += 1
        return super().iter_blocks(rows)


def test_injected_backend_serves_fit_variance_and_stochastic_objective():
    x, y = make_data(120)
    k = make_kernel("scale_matern52", x.shape[1])
    _CountingEngine.passes = 0
    m = FalkonGP(x, y, kernel=k, num_centers=15, penalty=1e-3, tol=1e-12, max_iter=300,
                 options=FalkonOptions(backend=_CountingEngine)).fit(compute_variance=True)
    fit_passes = _CountingEngine.passes
    if m.fit_info.extra.get("method") == "direct":  # rhs, the Gram matrix (which the posterior factors reuse)
        assert fit_passes == 2
    else:
        assert fit_passes >= 3  # rhs, CG iterations, posterior factors
    ref = FalkonGP(x, y, kernel=k, centers=m.centers, penalty=1e-3, tol=1e-12, max_iter=300).fit()
    torch.testing.assert_close(m.alpha, ref.alpha, rtol=1e-9, atol=1e-11)
    m.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x[:5]).variance, ref(x[:5]).variance)
    # the stochastic objective's solves go through the same backend
    obj = gpfalkon.objectives.StochasticNystromCompReg(m, num_trace_vectors=4)
    m.train()
    obj().backward()
    assert _CountingEngine.passes > fit_passes


# --------------------------------------------------------------------- center selectors
def test_center_selectors_share_one_signature_and_plug_into_falkon_gp():
    from gpfalkon.centers import CenterSelector, FixedCenters, LeverageCenters, UniformCenters

    x, y = make_data(150)
    k = make_kernel("scale_rbf", x.shape[1])
    for sel in (UniformCenters(seed=3), LeverageCenters(seed=3), FixedCenters(x[:12])):
        assert isinstance(sel, CenterSelector)
        out = sel(x, 12, kernel=k, penalty=1e-3)
        # leverage sampling draws 12 times with replacement: at most 12 distinct centers
        assert out.centers.shape[1] == x.shape[1] and 1 <= out.centers.shape[0] <= 12
        assert out.centers.shape[0] == 12 or isinstance(sel, LeverageCenters)
    # given centers through FalkonGP, with num_centers left to the selector
    c = x[:12].clone()
    m = FalkonGP(x, y, kernel=k, penalty=1e-3, center_selection=FixedCenters(c))
    assert torch.equal(m.centers, c)
    assert FalkonGP(x, y, kernel=k, center_selection=UniformCenters(seed=0)).centers.shape[0] == 150
    # a selector instance gives the same model as the equivalent string (same generator state)
    a = FalkonGP(x, y, kernel=k, num_centers=20, penalty=1e-3, center_selection="leverage",
                 generator=torch.Generator().manual_seed(5))
    b = FalkonGP(x, y, kernel=k, num_centers=20, penalty=1e-3,
                 center_selection=LeverageCenters(generator=torch.Generator().manual_seed(5)))
    assert torch.equal(a.centers, b.centers) and torch.equal(a.center_weights, b.center_weights)
    # the penalty reaches the selector at the model's value (leverage scores depend on it)
    seen = []

    def spy(x_, m, kernel=None, penalty=None):
        seen.append((m, float(penalty)))
        return UniformCenters(seed=0)(x_, m)

    FalkonGP(x, y, kernel=k, num_centers=7, penalty=2e-3, center_selection=spy)
    assert seen == [(7, pytest.approx(2e-3))]


def test_a_selector_returning_bad_centers_is_refused():
    from gpfalkon.centers import CenterSelection

    x, y = make_data(40)
    with pytest.raises(ValueError, match="center_selection returned"):
        FalkonGP(
            x, y, num_centers=5, center_selection=lambda x_, m, kernel=None, penalty=None: CenterSelection(x_[:5, :2])
        )
    with pytest.raises(ValueError, match="center_selection"):
        FalkonGP(x, y, num_centers=5, center_selection=42)
    with pytest.raises(ValueError, match="num_centers"):
        from gpfalkon.centers import FixedCenters

        FixedCenters(x[:4])(x, 5)


def test_models_pickled_before_falkon_options_still_load():
    """A pickle from before FalkonOptions / FitTracker (options as attributes, an inline
    fit snapshot) loads into a working model that still knows when it is stale."""
    import copy

    x, y = make_data(80)
    m = FalkonGP(x, y, num_centers=10, penalty=1e-3, tol=1e-9, max_iter=200).fit()
    state = copy.copy(m.__dict__)
    state.pop("options")
    tracker = state.pop("_fit_tracker")
    state.update(max_iter=200, tol=1e-9, memory_budget=None, block_rows=None, store_kernel=None, verbose=False,
                 _snapshot=tracker.snapshot, _fitted_data_key=tracker.data_key)
    old = FalkonGP.__new__(FalkonGP)
    old.__setstate__(state)
    assert old.options == FalkonOptions(tol=1e-9, max_iter=200)
    old.eval()
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(old(x[:4]).mean, m(x[:4]).mean)
    with torch.no_grad():
        old.kernel.base_kernel.raw_lengthscale.add_(0.1)
    with pytest.raises(gpfalkon.NotFittedError):
        old(x[:4])


class _PassCountingEngine(KernelEngine):
    """A backend overriding every GPyTorch-block pass (delegating to the in-memory ones)."""

    calls: ClassVar[dict] = {}

    @staticmethod
    def _count(name):
        from gpfalkon.backend import autograd, passes

        module = autograd if name == "blockwise_kernel_grad" else passes

        def fn(*args, **kwargs):
            _PassCountingEngine.calls[name] = _PassCountingEngine.calls.get(name, 0) + 1
            return getattr(module, name)(*args, **kwargs)

        return staticmethod(fn)


for _name in ("whitened_aggregates", "map_whitened_blocks", "kernel_matmul", "kernel_diagonal", "whitened_sq_norms",
              "blockwise_kernel_grad"):
    setattr(_PassCountingEngine, _name, _PassCountingEngine._count(_name))


def test_every_pass_goes_through_an_injected_backend():
    from gpfalkon.objectives import LOOCV, HoldOut, NystromCompReg, StochasticNystromCompReg

    x, y = make_data(120)
    k = make_kernel("scale_rbf", x.shape[1])
    _PassCountingEngine.calls = {}
    kw = dict(kernel=k, num_centers=15, penalty=1e-3, center_selection="leverage")
    opts = FalkonOptions(tol=1e-10, max_iter=300)
    m = FalkonGP(
        x, y, options=opts.replace(backend=_PassCountingEngine), generator=torch.Generator().manual_seed(0), **kw
    )
    ref = FalkonGP(x, y, options=opts, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(m.centers, ref.centers)  # the leverage scores went through the backend, same values
    assert (
        _PassCountingEngine.calls.get("kernel_diagonal", 0) >= 1
        and _PassCountingEngine.calls.get("whitened_sq_norms", 0) >= 1
    )
    for obj in (NystromCompReg, LOOCV, HoldOut):
        torch.testing.assert_close(obj(m)(), obj(ref)())
    sto = StochasticNystromCompReg(m, num_trace_vectors=3)
    sto_ref = StochasticNystromCompReg(ref, num_trace_vectors=3)
    v, v_ref = sto(), sto_ref()
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-8)
    # its hand-derived gradient runs the blockwise gradient pass of the backend
    g = torch.autograd.grad(v, m.likelihood.raw_noise)[0]
    g_ref = torch.autograd.grad(v_ref, ref.likelihood.raw_noise)[0]
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-8)
    m.fit()
    ref.fit()
    m.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x[:5]).mean, ref(x[:5]).mean)
    for name in ("whitened_aggregates", "map_whitened_blocks", "kernel_matmul", "kernel_diagonal", "whitened_sq_norms",
                 "blockwise_kernel_grad"):
        assert _PassCountingEngine.calls.get(name, 0) >= 1, name


def test_the_setting_and_the_options_take_the_same_byte_counts():
    """An integer-valued float (2.0**30) and an integer beyond float precision (10**30) are budgets to both the
    setting and FalkonOptions; fractions, negatives, strings and booleans are refused by both."""
    from gpfalkon import settings

    for good in (2.0**30, 10**30, 12345):
        with settings.memory_budget(good):
            assert settings.memory_budget.value() == int(good)
        assert FalkonOptions(memory_budget=good).memory_budget == int(good)
    for bad in (1.5, -1, 0, "1000", True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="memory_budget"):
            settings.memory_budget(bad)
        with pytest.raises((TypeError, ValueError), match="memory_budget"):
            FalkonOptions(memory_budget=bad)
