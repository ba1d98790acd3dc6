"""A penalty path: FALKON at several penalties in one CG (``PenaltyPathPreconditioner``,
``NystromKRROperator.solve_path``, ``FalkonGP.fit_penalty_path`` / ``path_means`` / ``select_penalty``),
checked against dense solves and single-penalty fits."""
from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpfalkon import FalkonGP, FalkonOptions, FalkonPreconditioner, PenaltyPath, PenaltyPathPreconditioner
from gpfalkon import settings as gp_settings


def _problem(n: int = 400, m: int = 40, d: int = 3, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, d, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    y = (torch.sin(3 * x[:, 0].double()) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64) + 5.0).to(dtype)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    k.base_kernel.lengthscale = 0.5
    k.outputscale = 2.0
    return x, y, k, x[:m].clone()


def _dense(k, x, c):
    with torch.no_grad():
        return k(x, c).to_dense().double()


def _dense_alpha(model, lam):
    """The dense Nystrom solution of ``model``'s system at penalty ``lam`` (its centered targets)."""
    x, c, k = model.train_inputs[0], model.centers.detach(), model.kernel
    knm, kmm = _dense(k, x, c), _dense(k, c, c)
    yc = model.centered_targets().double()
    return torch.linalg.solve(knm.T @ knm + x.shape[0] * lam * kmm, knm.T @ yc)


# ------------------------------------------------------------------ the preconditioner
def test_path_preconditioner_applies_each_penalty_s_falkon_preconditioner_to_its_column():
    _, _, k, c = _problem()
    kmm = _dense(k, c, c)
    lams = [1e-6, 1e-4, 1e-2]
    path = PenaltyPathPreconditioner.from_kernel_matrix(kmm, lams, n=400)
    u = torch.randn(40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for j, lam in enumerate(lams):
        ref = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n=400)
        col = u[:, j:j + 1]
        torch.testing.assert_close(path.apply_b(u)[:, j:j + 1], ref.apply_b(col), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(path.apply_bt(u)[:, j:j + 1], ref.apply_bt(col), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(path.apply_b_inv(u)[:, j:j + 1], ref.apply_b_inv(col), rtol=1e-10, atol=1e-12)
    assert path.size == 3 and path.reproduces(kmm)


def test_path_w_matmul_is_b_transpose_h_b_column_by_column_with_one_data_pass():
    """``w_matmul`` against the dense ``B_j^T (K_Mn K_nM + n lambda_j K_MM) B_j u_j``, and the data product is called
    once for the whole block."""
    x, _, k, c = _problem()
    knm, kmm = _dense(k, x, c), _dense(k, c, c)
    lams = torch.tensor([1e-5, 1e-3], dtype=torch.float64)
    path = PenaltyPathPreconditioner.from_kernel_matrix(kmm, lams, n=400)
    u = torch.randn(40, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    calls = []

    def data(v):
        calls.append(v.shape)
        return knm.T @ (knm @ v)

    out = path.w_matmul(u, data, 400 * lams)
    assert calls == [(40, 2)]
    for j in range(2):
        part = path.parts[j]
        b = part.apply_b(torch.eye(40, dtype=torch.float64))
        w = b.T @ (knm.T @ knm + 400 * float(lams[j]) * kmm) @ b
        torch.testing.assert_close(out[:, j:j + 1], w @ u[:, j:j + 1], rtol=1e-8, atol=1e-10)


def test_path_preconditioner_rejects_parts_that_do_not_share_a_factor_and_bad_blocks():
    _, _, k, c = _problem()
    kmm = _dense(k, c, c)
    a = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-4, n=400, jitter=1e-9)
    b = FalkonPreconditioner.from_kernel_matrix(kmm * 2, 1e-4, n=400, jitter=1e-9)
    with pytest.raises(ValueError, match="share"):
        PenaltyPathPreconditioner([a, b])
    with pytest.raises(ValueError, match="n, jitter or size"):
        PenaltyPathPreconditioner([a, FalkonPreconditioner.from_kernel_matrix(kmm, 1e-4, n=401, jitter=1e-9)])
    with pytest.raises(ValueError, match="at least one"):
        PenaltyPathPreconditioner([])
    with pytest.raises(TypeError, match="FalkonPreconditioner"):
        PenaltyPathPreconditioner([a, "b"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="penalty"):
        PenaltyPathPreconditioner.from_kernel_matrix(kmm, [1e-4, -1.0], n=400)
    path = PenaltyPathPreconditioner.from_kernel_matrix(kmm, [1e-4, 1e-3], n=400)
    with pytest.raises(ValueError, match=r"shape \(M, 2\)"):
        path.apply_b(torch.zeros(40, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="kmm_weight must hold 2"):
        path.w_matmul(torch.zeros(40, 2, dtype=torch.float64), lambda v: v, [1.0])


# ------------------------------------------------------------------ the operator's solve
@pytest.mark.parametrize("method,through_factor", [("cg", True), ("cg", False), ("direct", True)])
def test_operator_path_solve_matches_a_dense_solve_at_every_penalty(method, through_factor):
    """``solve_path`` by CG with ``K_MM`` through the factor (``w_matmul``) and with ``H`` applied whole, and by
    the direct solve: every column is the dense solution of its own penalty's system."""
    x, y, k, c = _problem()
    lams = [1e-7, 1e-5, 1e-3, 1e-1]
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4, options=FalkonOptions(solve_method=method))
    op = model.nystrom_operator()
    rhs = op.kmn_y(model.centered_targets()).detach()
    with gp_settings.kmm_through_factor(through_factor):
        alpha, info, precond = op.solve_path(rhs, lams, tol=1e-11, max_iter=400)
    assert alpha.shape == (40, 4) and alpha.dtype == torch.float64
    assert (precond is None) == (method == "direct") and info.extra.get("method", "cg") == method
    if precond is not None:
        assert precond.size == 4
    for j, lam in enumerate(lams):
        ref = torch.linalg.solve(_h(k, x, c, lam), rhs)
        torch.testing.assert_close(alpha[:, j:j + 1], ref, rtol=1e-7, atol=1e-9 * float(ref.abs().max()))
    assert info.converged and info.extra["preconditioner_seconds"] >= 0


def test_operator_path_solve_with_float32_factors_matches_a_dense_solve():
    """``precond_dtype=float32`` (the factors stored in float32: their blocks come back in float32) gives every
    column the fitted values of its own penalty's dense solution (to the float32 factors' accuracy: the
    coefficients themselves carry its rounding times the system's condition), in float64 as documented."""
    x, y, k, c = _problem()
    lams = [1e-6, 1e-4, 1e-2]
    opts = FalkonOptions(precond_dtype=torch.float32, solve_method="cg")
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4, options=opts)
    op = model.nystrom_operator()
    rhs = op.kmn_y(model.centered_targets()).detach()
    alpha, _info, precond = op.solve_path(rhs, lams, tol=1e-9, max_iter=400)
    assert precond.parts[0].chol_a.dtype == torch.float32 and alpha.dtype == torch.float64
    knm = _dense(k, x, c)
    for j, lam in enumerate(lams):
        ref = knm @ torch.linalg.solve(_h(k, x, c, lam), rhs)  # the fitted values: float32 factors' accuracy
        torch.testing.assert_close(knm @ alpha[:, j:j + 1], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    single, _ = op.falkon_solve(rhs, tol=1e-9, max_iter=400)  # one penalty's solve returns float64 as well
    assert single.dtype == torch.float64


def _h(k, x, c, lam):
    knm, kmm = _dense(k, x, c), _dense(k, c, c)
    return knm.T @ knm + x.shape[0] * lam * kmm


def test_operator_path_solve_checks_its_arguments():
    x, y, k, c = _problem()
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4)
    op = model.nystrom_operator()
    rhs = op.kmn_y(model.centered_targets()).detach()
    with pytest.raises(ValueError, match=r"rhs must have shape \(40, 1\)"):
        op.solve_path(torch.cat([rhs, rhs], 1), [1e-4])
    with pytest.raises(ValueError, match="at least one penalty"):
        op.solve_path(rhs, [])
    with pytest.raises(ValueError, match=r"x0 must have shape \(40, 2\)"):
        op.solve_path(rhs, [1e-4, 1e-3], torch.zeros(40, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="time_limit"):
        op.solve_path(rhs, [1e-4], time_limit=-1.0)


# ------------------------------------------------------------------ the model
@pytest.mark.parametrize("method", ["cg", "direct"])
def test_model_path_equals_single_fits_and_select_penalty_makes_one_the_fit(method):
    """Every penalty of ``fit_penalty_path`` gives the coefficients and predictions of ``fit()`` at that penalty
    (float64, tight tolerance); ``select_penalty`` sets the penalty and ``alpha``, and the model then predicts as
    that fit; the model is not changed by the path itself."""
    x, y, k, c = _problem()
    xt, _, _, _ = _problem(n=100, seed=5)
    lams = [1e-6, 1e-4, 1e-2]
    opts = FalkonOptions(solve_method=method)
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=3e-3, tol=1e-11, max_iter=400, options=opts)
    path = model.fit_penalty_path(lams)
    assert path.info.extra.get("method", "cg") == method
    assert isinstance(path, PenaltyPath) and path.alphas.shape == (3, 40)
    assert not bool(model.fitted)  # the path left the model as it was
    means = model.path_means(path, xt)
    assert means.shape == (3, 100) and means.dtype == torch.float64
    for j, lam in enumerate(lams):
        single = FalkonGP(x, y, kernel=k, centers=c, penalty=lam, tol=1e-11, max_iter=400, options=opts).fit()
        torch.testing.assert_close(path.alphas[j], single.alpha, rtol=1e-7, atol=1e-9 * float(single.alpha.abs().max()))
        ref = _dense_alpha(model, lam).reshape(-1)
        torch.testing.assert_close(path.alphas[j], ref, rtol=1e-6, atol=1e-8 * float(ref.abs().max()))
        torch.testing.assert_close(means[j], single.posterior_mean(xt).double(), rtol=1e-8, atol=1e-8)
        model.select_penalty(path, j)
        assert float(model.penalty.detach()) == pytest.approx(lam, rel=1e-12)
        torch.testing.assert_close(model.posterior_mean(xt).double(), means[j], rtol=1e-10, atol=1e-10)
        assert model.fit_info is path.info
    model.eval()
    with torch.no_grad():
        var = model(xt).variance  # the variance factors follow the selected penalty
    single = FalkonGP(x, y, kernel=k, centers=c, penalty=lams[-1], tol=1e-11, max_iter=400).fit()
    single.eval()
    with torch.no_grad():
        torch.testing.assert_close(var, single(xt).variance, rtol=1e-6, atol=1e-9)


def test_model_path_starts_from_given_coefficients_and_stops_at_its_limits():
    """``initial_alpha`` (one start per penalty): started at the solutions, CG has nothing left to do; ``max_iter``
    bounds the iterations of the whole block."""
    x, y, k, c = _problem()
    lams = [1e-5, 1e-3]
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4, tol=1e-10, max_iter=400,
                     options=FalkonOptions(solve_method="cg"))
    exact = torch.stack([_dense_alpha(model, lam).reshape(-1) for lam in lams])
    path = model.fit_penalty_path(lams, initial_alpha=exact)
    assert path.info.iterations <= 1
    torch.testing.assert_close(path.alphas, exact, rtol=1e-8, atol=1e-10)
    short = model.fit_penalty_path(lams, max_iter=2, tol=1e-14)
    assert short.info.iterations == 2 and not short.info.converged


def test_model_path_refuses_a_changed_model_and_bad_arguments():
    x, y, k, c = _problem()
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4, max_iter=100)
    path = model.fit_penalty_path([1e-4, 1e-3])
    with pytest.raises(ValueError, match="index into the path's 2 penalties"):
        model.select_penalty(path, 2)
    with pytest.raises(ValueError, match="index"):
        model.select_penalty(path, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PenaltyPath"):
        model.select_penalty("path", 0)  # type: ignore[arg-type]
    model.penalty = 1e-2  # the noise alone does not change the path's coefficients
    model.select_penalty(path, 1)
    with torch.no_grad():
        model.kernel.base_kernel.lengthscale = 0.3
    with pytest.raises(ValueError, match="changed since fit_penalty_path"):
        model.select_penalty(path, 0)
    with pytest.raises(ValueError, match="changed since fit_penalty_path"):
        model.path_means(path, x[:5])
    fresh = model.fit_penalty_path([1e-4])
    model.set_train_data(x[:300], y[:300], strict=False)
    with pytest.raises(ValueError, match="changed since fit_penalty_path"):
        model.select_penalty(fresh, 0)
    with pytest.raises(ValueError, match="at least one penalty"):
        model.fit_penalty_path([])
    with pytest.raises(ValueError, match="penalty"):
        model.fit_penalty_path([1e-4, 0.0])
    with pytest.raises(ValueError, match="initial_alpha"):
        model.fit_penalty_path([1e-4, 1e-3], initial_alpha=torch.zeros(40, dtype=torch.float64))
    two = FalkonGP(x, torch.stack([y, 2 * y], -1), kernel=k, centers=c, penalty=1e-4)
    with pytest.raises(ValueError, match="one output"):
        two.fit_penalty_path([1e-4])


@settings(max_examples=8, deadline=None)
@given(st.lists(st.floats(min_value=-8.0, max_value=0.0), min_size=1, max_size=4),
       st.integers(min_value=0, max_value=3), st.sampled_from(["cg", "direct"]))
def test_path_columns_are_independent_of_the_other_penalties(log_lams, seed, method):
    """Property: a penalty's solution does not depend on which other penalties share its CG (each column equals
    the dense solution of its own system), whatever the set of penalties."""
    x, y, k, c = _problem(n=200, m=25, seed=seed)
    lams = [10.0**v for v in log_lams]
    model = FalkonGP(x, y, kernel=k, centers=c, penalty=1e-4, tol=1e-11, max_iter=500,
                     options=FalkonOptions(solve_method=method))
    path = model.fit_penalty_path(lams)
    for j, lam in enumerate(lams):
        ref = _dense_alpha(model, lam).reshape(-1)
        scale = float(ref.abs().max())
        assert float((path.alphas[j] - ref).abs().max()) <= 1e-5 * scale + 1e-9, (lam, lams)
    assert math.isfinite(float(path.alphas.abs().max()))
