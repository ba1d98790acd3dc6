"""The direct Nyström solve and the automatic choice between it and FALKON's CG."""
from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpfalkon import FalkonGP, FalkonOptions, settings
from gpfalkon.solvers import SolveCosts, choose_method, direct_solve_whitened
from gpfalkon.solvers.direct import whitened_factor

from conftest import dense_nystrom, make_data, make_kernel, require_fused_cpu


@pytest.mark.parametrize("kernel_name", ["rbf", "scale_matern52", "rbf+linear"])
@pytest.mark.parametrize("store", [True, False])
def test_direct_solve_matches_dense_solve(kernel_name, store):
    x, y = make_data(300, 3, t=2)
    centers = x[:25] + 0.01
    kern = make_kernel(kernel_name, 3)
    lam = 1e-5
    h, knm, _kmm = dense_nystrom(kern, x, centers, lam)
    want = torch.linalg.solve(h, knm.T @ y)
    model = FalkonGP(x, y, kernel=kern, centers=centers, penalty=lam, store_kernel=store,
                     options=FalkonOptions(solve_method="direct")).fit()
    assert model.fit_info.iterations == 0 and model.fit_info.extra["method"] == "direct"
    assert float(model.fit_info.final_residual.max()) < 1e-10
    # the jitter j of L L^T = K_MM + j I is at the float64 rounding level of K_MM
    torch.testing.assert_close(h @ model.alpha, knm.T @ y, rtol=1e-7, atol=1e-7 * float((knm.T @ y).abs().max()))
    torch.testing.assert_close(model.alpha, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_direct_and_cg_give_the_same_model_in_float32():
    x, y = make_data(400, 4, dtype=torch.float32)
    kw = dict(kernel=make_kernel("rbf", 4, dtype=torch.float32), num_centers=30, penalty=1e-4, seed=0)
    cg = FalkonGP(x, y, options=FalkonOptions(solve_method="cg", tol=1e-10, max_iter=500), **kw).fit()
    direct = FalkonGP(x, y, options=FalkonOptions(solve_method="direct"), **kw).fit()
    assert cg.fit_info.iterations > 0 and direct.fit_info.iterations == 0
    xt = make_data(50, 4, dtype=torch.float32, seed=7)[0]
    cg.eval()
    direct.eval()
    torch.testing.assert_close(direct.posterior_mean(xt), cg.posterior_mean(xt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengthscale", [3.0, 10.0, 30.0])
def test_float32_direct_solve_is_as_close_to_float64_as_cg(lengthscale):
    """Float32 data at a long lengthscale (K_MM numerically singular in float32, penalty 1e-6): the direct solve
    forms its system from float64 kernel values of the float32 rows (exact in float64) with float64's jitter, so its
    mean is the float64 model's to ~1e-7 (whitened with float32 kernel values and float32's eps M jitter it was
    2.4 %, 3.7 % and 0.16 % off at lengthscales 3, 10 and 30, CG with float32 products 5.2 %, 2.8 % and 0.78 %; float32
    values with float64's jitter, 18 %); CG with float64
    products (``settings.wide_products``) stays within 2 %."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(300, 3, generator=g, dtype=torch.float64) * 4 - 2).float().double()
    y = (torch.sin(x).sum(1) + 0.1 * torch.randn(300, generator=g, dtype=torch.float64)).float().double()
    xt = (torch.rand(200, 3, generator=g, dtype=torch.float64) * 4 - 2).float().double()
    centers = x[torch.randperm(300, generator=g)[:50]]

    def mean(dtype, method):
        k = gpytorch.kernels.RBFKernel().to(dtype)
        k.lengthscale = torch.tensor(lengthscale, dtype=dtype)
        m = FalkonGP(x.to(dtype), y.to(dtype), kernel=k, centers=centers.to(dtype), penalty=1e-6,
                     options=FalkonOptions(solve_method=method)).fit().eval()
        assert m.fit_info.extra.get("method", "cg") == method
        return m.posterior_mean(xt.to(dtype)).double()

    ref = mean(torch.float64, "direct")
    scale = float(ref.abs().max())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CG's float32 advice at this penalty
        with settings.wide_products(False):  # CG with float32 products, the yardstick of the direct solve
            cg_err = float((mean(torch.float32, "cg") - ref).abs().max()) / scale
        wide_err = float((mean(torch.float32, "cg") - ref).abs().max()) / scale
    direct_err = float((mean(torch.float32, "direct") - ref).abs().max()) / scale
    assert direct_err < 1e-5 and direct_err < cg_err / 10, (direct_err, cg_err)
    # the torch path's float32 kernel values (squared distances by the expansion |x|^2 + |c|^2 - 2 x.c) differ
    # from the fused kernel's at these long lengthscales by more than the 2 % below (an H200 without it: 3-21 %)
    require_fused_cpu("wide products over the fused kernel's float32 values")
    # CG with the stored float32 K_nM's products in float64 (the default): within 2 % (measured 0.09 %, 1.25 % and
    # 0.85 % at lengthscales 3, 10 and 30; at 30 it solves the system of the float32 kernel values further than
    # float32 products do, 0.54 %)
    assert wide_err < 0.02, (wide_err, cg_err, direct_err)


def test_float32_direct_penalty_path_is_the_float64_one():
    """``fit_penalty_path`` on float32 data by the direct solve: every penalty's coefficients are the float64
    model's (the system from float64 kernel values of the float32 rows), also with two outputs."""
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(400, 2, generator=g, dtype=torch.float64) * 4 - 2).float()
    y = torch.stack([torch.sin(2 * x[:, 0].double()), torch.cos(x.double().sum(1))], 1).float()
    centers = x[torch.randperm(400, generator=g)[:60]]
    lams = [1e-7, 1e-5, 1e-3]

    def path(dtype):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
        k.base_kernel.lengthscale = 2.0
        m = FalkonGP(x.to(dtype), y[:, 0].to(dtype), kernel=k, centers=centers.to(dtype), penalty=1e-5,
                     options=FalkonOptions(solve_method="direct"))
        return m, m.fit_penalty_path(lams)

    (_, p32), (m64, p64) = path(torch.float32), path(torch.float64)
    assert p32.info.extra["method"] == "direct"
    for a32, a64 in zip(p32.alphas, p64.alphas, strict=True):
        kt = m64.kernel(x[:50].double(), centers.double()).to_dense()
        f32, f64 = kt @ a32.reshape(-1), kt @ a64.reshape(-1)
        assert float((f32 - f64).abs().max()) < 1e-5 * float(f64.abs().max()), float((f32 - f64).abs().max())
    # two outputs through fit(): each column the float64 model's
    fits = []
    for dt in (torch.float32, torch.float64):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dt)  # one kernel per model
        k.base_kernel.lengthscale = 2.0
        fits.append(FalkonGP(x.to(dt), y.to(dt), kernel=k, centers=centers.to(dt), penalty=1e-6,
                             options=FalkonOptions(solve_method="direct")).fit().eval())
    assert fits[0].fit_info.extra["method"] == "direct" and fits[0].centers.dtype == torch.float32
    xt = x[:40]
    got, want = (f.posterior_mean(xt.to(f.centers.dtype)).double() for f in fits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_variance_factors_reuse_the_direct_solves_gram(dtype, monkeypatch):
    """``fit(compute_variance=True)`` by the direct solve forms the posterior factors from the Gram matrix the solve
    just formed (one whitened-Gram pass, not two), and the variances are those formed lazily by their own pass."""
    from gpfalkon.backend import KernelEngine

    x, y = make_data(500, 3, dtype=dtype)
    kw = dict(kernel=make_kernel("rbf", 3, dtype=dtype), centers=x[:40].clone(), penalty=1e-5,
              options=FalkonOptions(solve_method="direct"))
    calls = []
    original = KernelEngine.whitened_gram

    def counted(self, L):
        calls.append(L.shape[0])
        return original(self, L)

    monkeypatch.setattr(KernelEngine, "whitened_gram", counted)
    eager = FalkonGP(x, y, **kw).fit(compute_variance=True).eval()
    assert len(calls) == 1 and eager.fit_info.extra["method"] == "direct"
    lazy = FalkonGP(x, y, **kw).fit().eval()
    xt = make_data(30, 3, dtype=dtype, seed=5)[0]
    with torch.no_grad():
        want = lazy(xt).variance
    assert len(calls) == 3  # the lazy model: its solve's pass, then the factors' own
    with torch.no_grad():
        got = eager(xt).variance
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(calls) == 3


def test_direct_solve_whitened_is_the_whitened_system():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 8, generator=g, dtype=torch.float64)
    kmm = a @ a.T + 8 * torch.eye(8, dtype=torch.float64)
    knm = torch.randn(50, 8, generator=g, dtype=torch.float64)
    rhs = torch.randn(8, 3, generator=g, dtype=torch.float64)
    factor, jitter = whitened_factor(kmm)
    gram = torch.linalg.solve_triangular(factor, knm.T, upper=False)
    gram = gram @ gram.T
    alpha, info = direct_solve_whitened(gram, factor, rhs, 50 * 0.1)
    h = knm.T @ knm + 5.0 * (kmm + jitter * torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(alpha, torch.linalg.solve(h, rhs), rtol=1e-10, atol=1e-10)
    assert info.residuals.shape == (1, 3) and info.converged
    with pytest.raises(ValueError, match="n_lambda"):
        direct_solve_whitened(gram, factor, rhs, 0.0)


def test_choose_method_follows_the_cost_model():
    # a stored K_nM makes a CG iteration a memory read: CG at any realistic M
    for m in (200, 1000, 5000):
        assert choose_method(200_000, m, 20, itemsize=4, stored=True, tol=1e-6, max_iter=100) == "cg"
    # recomputed kernel values: the direct solve below a threshold in M, CG above it
    picks = [choose_method(1_000_000, m, 20, itemsize=4, stored=False, tol=1e-6, max_iter=100)
             for m in (50, 200, 2000, 20_000)]
    assert picks[0] == "direct" and picks[-1] == "cg"
    assert picks == sorted(picks, key=lambda p: p == "cg")  # one switch, direct -> cg
    # few iterations asked for: CG; the margin and the rates are honoured
    assert choose_method(1_000_000, 50, 20, itemsize=4, stored=False, tol=0.0, max_iter=1) == "cg"
    costs = SolveCosts()
    n, m, d = 1_000_000, 300, 20
    cg = costs.cg(n, m, d, 4, False, costs.iteration_guess)
    direct = costs.direct(n, m, d, 4, False)
    want = "direct" if direct * costs.margin < cg else "cg"
    assert choose_method(n, m, d, itemsize=4, stored=False, tol=1e-6, max_iter=100, costs=costs) == want


def test_choose_method_counts_the_outputs():
    """Every CG pass makes ``4 n M t`` flops of products, the direct solve only its right-hand side's: many outputs
    tip a stored-K_nM fit to the direct solve (n = 20,000, M = 500, 128 outputs: 7-10x faster, measured)."""
    assert choose_method(20_000, 500, 3, itemsize=4, stored=True, tol=1e-4, max_iter=100) == "cg"
    assert choose_method(20_000, 500, 3, itemsize=4, stored=True, tol=1e-4, max_iter=100, outputs=128) == "direct"
    c = SolveCosts()
    for stored in (True, False):  # one output costs what it cost before outputs were counted
        assert c.kernel_pass(10_000, 300, 5, 4, stored, 1) == c.kernel_pass(10_000, 300, 5, 4, stored)
        assert c.kernel_pass(10_000, 300, 5, 4, stored, 64) > c.kernel_pass(10_000, 300, 5, 4, stored, 8)
    x, _ = make_data(20_000, 3, dtype=torch.float32)
    y = torch.sin(3 * x[:, :1] + torch.arange(32, dtype=torch.float32) / 8)
    model = FalkonGP(x, y, kernel=make_kernel("rbf", 3, dtype=torch.float32), num_centers=300, penalty=1e-5, seed=0)
    op = model.nystrom_operator()
    assert op.chosen_method() == "cg" and op.chosen_method(outputs=32) == "direct"
    assert model.fit().fit_info.extra.get("method") == "direct"


def test_auto_picks_by_the_model_and_keeps_cg_for_iterative_requests():
    x, y = make_data(2000, 3)
    kern = make_kernel("rbf", 3)
    small = FalkonGP(x, y, kernel=kern, num_centers=20, penalty=1e-5, store_kernel=False, seed=0)
    op = small.nystrom_operator()
    assert op.chosen_method() == "direct"
    assert op.chosen_method(iterative=True) == "cg"
    assert small.fit().fit_info.extra.get("method") == "direct"
    seen = []
    small.fit(callback=lambda i, a, r: seen.append(i))
    assert seen and small.fit_info.iterations > 0  # a per-iteration callback gets CG
    direct_alpha = small.fit().alpha.clone()
    small.fit(initial_alpha=torch.zeros_like(direct_alpha))
    assert small.fit_info.extra.get("method") == "direct"  # a starting point alone does not ask for CG
    torch.testing.assert_close(small.alpha, direct_alpha)
    small.fit(warm_start=True)
    assert "method" not in small.fit_info.extra  # a warm start is CG's
    assert small.nystrom_operator(solve_method="cg").chosen_method() == "cg"

    def my_solver(h_matmul, precond, rhs, x0=None, **kw):
        from gpfalkon.solvers import falkon_solve
        return falkon_solve(h_matmul, precond, rhs, x0, **kw)

    assert small.nystrom_operator(solver=my_solver).chosen_method() == "cg"  # a user's solver is used
    big = FalkonGP(x, y, kernel=kern, num_centers=1000, penalty=1e-5, store_kernel=True, seed=0)
    assert big.nystrom_operator().chosen_method() == "cg"


def test_solve_method_is_validated():
    with pytest.raises(ValueError, match="solve_method"):
        FalkonOptions(solve_method="cholesky")


def test_cg_with_more_centers_than_rows_warns_and_the_direct_solve_is_exact():
    """60 centers off the data for 30 rows, lambda 1e-7: beyond the rows' span only the penalty fixes alpha, where
    CG's residual bounds nothing (float32: "converged", test means 41 % off): CG warns and names the direct solve,
    which is the dense solve's to rounding in both dtypes."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(30, 2, generator=g, dtype=torch.float64) * 2 - 1).float().double()
    c = (torch.rand(60, 2, generator=g, dtype=torch.float64) * 2 - 1).float().double()
    xt = torch.rand(20, 2, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * x[:, 0])
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = 0.5
    h, knm, _ = dense_nystrom(k, x, c, 1e-7)
    want = k(xt, c).to_dense().detach() @ torch.linalg.solve(h, knm.T @ y)
    with pytest.warns(RuntimeWarning, match=r"60 centers for 30 training rows: .*solve_method='direct'"):
        FalkonGP(x.float(), y.float(), kernel=gpytorch.kernels.RBFKernel(), centers=c.float(), penalty=1e-7,
                 options=FalkonOptions(solve_method="cg")).fit()
    for dtype in (torch.float32, torch.float64):
        kd = gpytorch.kernels.RBFKernel().to(dtype)
        kd.lengthscale = 0.5
        m = FalkonGP(x.to(dtype), y.to(dtype), kernel=kd, centers=c.to(dtype), penalty=1e-7,
                     options=FalkonOptions(solve_method="direct")).fit().eval()
        got = m.posterior_mean(xt.to(dtype)).double()
        err = float((got - want).abs().max())
        assert err < 1e-4 * float(want.abs().max()), (dtype, err)
