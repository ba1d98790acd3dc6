"""FALKON's solution of the Nyström system against a dense direct solve."""
from __future__ import annotations

import warnings

import linear_operator
import pytest
import torch

from gpfalkon import CGNotConvergedWarning, NystromKRROperator, settings

from conftest import dense_nystrom, make_data, make_kernel

KERNELS = ["rbf", "matern12", "matern32", "matern52", "scale_matern52", "periodic"]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("t", [None, 3])
def test_alpha_matches_dense_float64(name, t):
    x, y = make_data(400, 3, t=t)
    y2 = y.unsqueeze(-1) if t is None else y
    c = x[:40]
    k = make_kernel(name, 3)
    # shorter lengthscales keep cond(H) ~ 1e4: the dense reference itself is then
    # accurate to ~1e-12, so a 1e-8 comparison measures FALKON, not the reference
    base = getattr(k, "base_kernel", k)
    base.lengthscale = base.lengthscale * 0.5
    lam = 1e-5
    op = NystromKRROperator(x, c, torch.tensor(lam, dtype=torch.float64), kernel=k, block_rows=97)
    alpha, info = op.falkon_solve(op.kmn_y(y2), tol=1e-13, max_iter=500, warn=False)
    with torch.no_grad():
        H, knm, _ = dense_nystrom(k, x, c, lam)
        ref = torch.linalg.solve(H, knm.T @ y2)
    rel = (alpha - ref).norm() / ref.norm()
    assert rel < 1e-8, (rel, info.iterations)
    # the residual history is recorded, and starts at 1
    assert info.residuals.shape[1] == y2.shape[1]
    torch.testing.assert_close(info.residuals[0], torch.ones(y2.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("name", ["rbf", "matern52"])
def test_ill_conditioned_predictions_match_dense(name):
    """cond(H) ~ 1e7-1e10: alpha is poorly determined, but K_nM alpha is well determined.

    The reference is the augmented least-squares form of the same problem,
    min_a ||K_nM a - y||^2 + n lambda a^T K_MM a = ||[K_nM; sqrt(n lambda) R] a - [y; 0]||^2
    with R^T R = K_MM, whose condition number is sqrt(cond(H)). Solving the normal
    equations H a = K_nM^T y directly instead is only good to ~1e-8 here (cond(H) ~ 7e9
    for the RBF kernel), which depends on the machine's BLAS and would blur the comparison.
    """
    x, y = make_data(400, 3)
    c = x[:40]
    k = make_kernel(name, 3)
    lam = 1e-6
    n = x.shape[0]
    op = NystromKRROperator(x, c, torch.tensor(lam, dtype=torch.float64), kernel=k)
    alpha, _ = op.falkon_solve(op.kmn_y(y.unsqueeze(-1)), tol=1e-12, max_iter=1000, warn=False)
    with torch.no_grad():
        H, knm, kmm = dense_nystrom(k, x, c, lam)
        assert torch.linalg.cond(H) > 1e7  # the regime this test is about
        evals, evecs = torch.linalg.eigh(kmm)
        r = (evecs * evals.clamp_min(0).sqrt()).T  # r^T r = K_MM
        a_aug = torch.cat([knm, (n * lam) ** 0.5 * r])
        b_aug = torch.cat([y.unsqueeze(-1), torch.zeros(c.shape[0], 1, dtype=y.dtype)])
        ref = torch.linalg.lstsq(a_aug, b_aug, driver="gelsd").solution
    assert ((knm @ (alpha - ref)).norm() / (knm @ ref).norm()) < 1e-9


@pytest.mark.parametrize("name", ["rbf", "matern52"])
@pytest.mark.parametrize("store", [True, False])
def test_alpha_matches_dense_float32(name, store):
    x, y = make_data(500, 3)
    c = x[:30]
    lam = 1e-4
    k64 = make_kernel(name, 3)
    k32 = make_kernel(name, 3, dtype=torch.float32)
    for k in (k64, k32):  # cond(H) ~ 1e4, see test_alpha_matches_dense_float64
        k.lengthscale = k.lengthscale * 0.5
    with torch.no_grad():
        H, knm, _ = dense_nystrom(k64, x, c, lam)
        ref = torch.linalg.solve(H, knm.T @ y.unsqueeze(-1))
    op = NystromKRROperator(x.float(), c.float(), torch.tensor(lam), kernel=k32, store_kernel=store)
    alpha, _info = op.falkon_solve(op.kmn_y(y.float().unsqueeze(-1)), tol=1e-7, max_iter=200, warn=False)
    assert alpha.dtype == torch.float64
    rel = (alpha - ref).norm() / ref.norm()
    assert rel < 1e-4, rel


def test_linear_operator_solve_and_settings():
    x, _y = make_data(300, 2)
    c = x[:20]
    k = make_kernel("rbf", 2)
    k.lengthscale = k.lengthscale * 0.5  # cond(H) ~ 1e4: an accurate dense reference
    lam = 1e-4
    with torch.no_grad():
        H, _knm, _ = dense_nystrom(k, x, c, lam)
    op = NystromKRROperator(x, c, torch.tensor(lam, dtype=torch.float64), kernel=k)
    b = torch.randn(20, 2, dtype=torch.float64)
    with torch.no_grad(), settings.cg_tolerance(1e-12):
        torch.testing.assert_close(torch.linalg.solve(op, b), torch.linalg.solve(H, b), rtol=1e-6, atol=1e-8)
        assert op.last_info.tol == 1e-12
        # vector right-hand side and left factor
        lhs = torch.randn(3, 20, dtype=torch.float64)
    with torch.no_grad(), settings.cg_tolerance(1e-12):
        torch.testing.assert_close(
            linear_operator.solve(op, b[:, 0], lhs), lhs @ torch.linalg.solve(H, b[:, 0]), rtol=1e-6, atol=1e-8
        )
    with torch.no_grad():
        # linear_operator's settings are honoured
        with linear_operator.settings.max_cg_iterations(3), warnings.catch_warnings():
            warnings.simplefilter("ignore", CGNotConvergedWarning)
            op.solve(b)
        assert op.last_info.iterations == 3
        with linear_operator.settings.cg_tolerance(1e-2):
            op.solve(b)
        assert op.last_info.tol == 1e-2 and op.last_info.converged
        with settings.max_cg_iterations(2), pytest.warns(CGNotConvergedWarning, match="reached max_iter=2"):
            op.solve(b)
        # matmul and diagonal
        torch.testing.assert_close(op @ b, H @ b)
        torch.testing.assert_close(op.diagonal(), H.diagonal())
        torch.testing.assert_close(op.to_dense(), H)


def test_warm_start_and_callback():
    x, y = make_data(300, 2)
    c = x[:25]
    k = make_kernel("matern32", 2)
    op = NystromKRROperator(x, c, torch.tensor(1e-6, dtype=torch.float64), kernel=k)
    rhs = op.kmn_y(y.unsqueeze(-1))
    seen = []
    alpha, info = op.falkon_solve(rhs, tol=1e-10, max_iter=300, callback=lambda i, a, r: seen.append((i, a.shape)))
    assert len(seen) == info.iterations and seen[0] == (1, (25, 1))
    _, info2 = op.falkon_solve(rhs, x0=alpha, tol=1e-8, max_iter=300)
    assert info2.iterations < info.iterations / 2


def _fresh_leaves(k, *tensors):
    """Copies of ``tensors`` requiring grad, ``lambda = 1e-2`` as a leaf, and the kernel's parameters with their
    gradients cleared: the inputs of one side of a gradient comparison."""
    for p in k.parameters():
        p.grad = None
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    return (*leaves, torch.tensor(1e-2, dtype=torch.float64, requires_grad=True), list(k.parameters()))


def _solve_loss(x, c, lam, k, b, g, dense: bool):
    if dense:
        H, _, _ = dense_nystrom(k, x, c, lam)
        sol = torch.linalg.solve(H, b)
    else:
        op = NystromKRROperator(x, c, lam, kernel=k, tol=1e-13, max_iter=1000, block_rows=33)
        sol = torch.linalg.solve(op, b)
    return (sol * g).sum()


@pytest.mark.parametrize("name", ["rbf", "scale_matern52"])
def test_solve_gradients_match_dense_autograd(name):
    """Implicit differentiation of the FALKON solve w.r.t. rhs, x, centers, penalty and kernel parameters."""
    x0, _ = make_data(80, 2)
    c0 = x0[:10].clone() + 0.03
    k = make_kernel(name, 2)
    b0 = torch.randn(10, 2, dtype=torch.float64)
    g = torch.randn(10, 2, dtype=torch.float64)
    grads = []
    for dense in (False, True):
        x, c, b, lam, ps = _fresh_leaves(k, x0, c0, b0)
        _solve_loss(x, c, lam, k, b, g, dense).backward()
        grads.append([x.grad, c.grad, lam.grad, b.grad] + [p.grad.clone() for p in ps])
    for a, r in zip(*grads, strict=False):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["rbf", "scale_matern52"])
def test_readme_solve_of_kmn_y_differentiates_both_sides(name):
    """``torch.linalg.solve(H, H.kmn_y(y))`` (the README's operator snippet): gradients w.r.t. y, x, centers, the
    penalty and the kernel's parameters through both H and K_Mn y, against dense autograd of the same formula."""
    x0, y0 = make_data(90, 2)
    c0 = x0[:12].clone() + 0.03
    k = make_kernel(name, 2)
    xs = x0[:7] + 0.1
    grads = []
    for dense in (False, True):
        x, c, y, lam, ps = _fresh_leaves(k, x0, c0, y0)
        if dense:
            h, knm, _ = dense_nystrom(k, x, c, lam)
            alpha = torch.linalg.solve(h, knm.T @ y.unsqueeze(-1))
        else:
            op = NystromKRROperator(x, c, lam, kernel=k, block_rows=31, tol=1e-13, max_iter=500)
            alpha = torch.linalg.solve(op, op.kmn_y(y))
        (k(xs, c).to_dense() @ alpha).sum().backward()
        grads.append([x.grad, c.grad, y.grad, lam.grad] + [p.grad.clone() for p in ps])
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-9)
    with torch.no_grad():  # no graph: the engine's float64 pass, the same value
        op = NystromKRROperator(x0, c0, torch.tensor(1e-2, dtype=torch.float64), kernel=k)
        torch.testing.assert_close(op.kmn_y(y0), dense_nystrom(k, x0, c0, 1e-2)[1].T @ y0.unsqueeze(-1))


def test_operator_rejects_bad_input():
    x, _ = make_data(30, 2)
    k = make_kernel("rbf", 2)
    lam = torch.tensor(1e-3, dtype=torch.float64)
    with pytest.raises(ValueError, match="penalty"):
        NystromKRROperator(x, x[:3], torch.tensor(-1.0, dtype=torch.float64), kernel=k)
    with pytest.raises(ValueError, match="centers has 3 features"):
        NystromKRROperator(x, torch.zeros(3, 3, dtype=torch.float64), lam, kernel=k)
    with pytest.raises(TypeError, match="kernel"):
        NystromKRROperator(x, x[:3], lam, kernel="rbf")
    op = NystromKRROperator(x, x[:3], lam, kernel=k)
    with pytest.raises(ValueError, match="rhs"):
        op.falkon_solve(torch.zeros(4, 1, dtype=torch.float64))


def test_diagonal_gradients_match_dense_autograd():
    x0, _ = make_data(50, 2)
    c0 = x0[:6].clone() + 0.02
    k = make_kernel("scale_matern52", 2)
    g = torch.randn(6, dtype=torch.float64)
    grads = []
    for dense in (False, True):
        x, c, lam, ps = _fresh_leaves(k, x0, c0)
        if dense:
            diag = dense_nystrom(k, x, c, lam)[0].diagonal()
        else:
            diag = NystromKRROperator(x, c, lam, kernel=k, block_rows=7).diagonal()
        (diag * g).sum().backward()
        grads.append([x.grad, c.grad, lam.grad] + [p.grad.clone() for p in ps])
    for a, r in zip(*grads, strict=False):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10)


def test_reused_operator_follows_hyperparameter_changes():
    x, _y = make_data(200, 2)
    c = x[:15]
    k = make_kernel("rbf", 2)
    lam = torch.tensor(1e-3, dtype=torch.float64)
    op = NystromKRROperator(x, c, lam, kernel=k, tol=1e-12, max_iter=500)
    b = torch.randn(15, 1, dtype=torch.float64)
    with torch.no_grad():
        first = op.solve(b)
        k.lengthscale = k.lengthscale * 0.5
        second = op.solve(b)
        H, _, _ = dense_nystrom(k, x, c, 1e-3)
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, torch.linalg.solve(H, b), rtol=1e-6, atol=1e-8)


def test_inv_quad_gradients_reach_kernel_parameters():
    x, _ = make_data(60, 2)
    c = x[:6] + 0.01
    k = make_kernel("rbf", 2)
    b = torch.randn(6, 2, dtype=torch.float64)
    grads = []
    for dense in (False, True):
        k.raw_lengthscale.grad = None
        lam = torch.tensor(1e-2, dtype=torch.float64)
        if dense:
            H = dense_nystrom(k, x, c, lam)[0]
            val = (b * torch.linalg.solve(H, b)).sum()
        else:
            op = NystromKRROperator(x, c, lam, kernel=k, tol=1e-13, max_iter=500)
            val = op.inv_quad(b)
        val.backward()
        grads.append((val.detach(), k.raw_lengthscale.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-10)


def test_warm_start_shape_and_float32_operator_with_float64_vectors():
    x, _ = make_data(50, 2)
    op = NystromKRROperator(x, x[:5], torch.tensor(1e-2, dtype=torch.float64), kernel=make_kernel("rbf", 2))
    with pytest.raises(ValueError, match="x0 must have the shape"):
        op.falkon_solve(torch.ones(5, 1, dtype=torch.float64), x0=torch.ones(5, dtype=torch.float64))
    k32 = make_kernel("rbf", 2, dtype=torch.float32)
    op32 = NystromKRROperator(x.float(), x[:5].float(), torch.tensor(1e-2), kernel=k32)
    u = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    op32.matmul(u).sum().backward()  # float64 right-hand side on a float32 operator
    assert u.grad is not None and u.grad.dtype == torch.float64
    with pytest.raises(TypeError, match="centers"):
        NystromKRROperator(x.float(), x[:5], torch.tensor(1e-2), kernel=k32)


def test_solve_records_where_its_time_went(monkeypatch):
    """``info.extra`` splits the solve's time: on a fake clock that advances 1 s per reading, every
    application of ``B`` / ``B^T`` adds exactly 1 s to ``precond_apply_seconds`` (``B^T rhs``, two per CG
    iteration, ``B beta``); the preconditioner's build is timed once and a cached one costs its lookup
    only; ``fit_seconds`` covers the whole fit."""
    import types

    import gpfalkon.solvers.falkon as falkon_module
    from gpfalkon import FalkonGP, FalkonOptions

    x, y = make_data(300, 2)
    k = make_kernel("matern32", 2)
    op = NystromKRROperator(x, x[:25], torch.tensor(1e-6, dtype=torch.float64), kernel=k)
    rhs = op.kmn_y(y.unsqueeze(-1))
    now = [0.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(falkon_module, "time", types.SimpleNamespace(perf_counter=tick))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CGNotConvergedWarning)
        _, info = op.falkon_solve(rhs, tol=0.0, max_iter=7)
    assert info.iterations == 7
    assert info.extra["precond_apply_seconds"] == pytest.approx(2 * 7 + 2)
    assert info.extra["cg_seconds"] > info.extra["precond_apply_seconds"]
    monkeypatch.undo()
    # real clock: the first solve built the preconditioner; the second finds it cached
    op2 = NystromKRROperator(x, x[:25], torch.tensor(1e-6, dtype=torch.float64), kernel=k)
    _, first = op2.falkon_solve(rhs, tol=1e-8, max_iter=100)
    _, again = op2.falkon_solve(rhs, tol=1e-8, max_iter=100)
    assert first.extra["preconditioner_seconds"] > 0
    assert again.extra["preconditioner_seconds"] < first.extra["preconditioner_seconds"]
    model = FalkonGP(x, y, kernel=k, centers=x[:25], penalty=1e-6, options=FalkonOptions(solve_method="cg")).fit()
    extra = model.fit_info.extra
    assert 0 <= extra["precond_apply_seconds"] <= extra["cg_seconds"] <= extra["fit_seconds"]
    assert extra["preconditioner_seconds"] + extra["cg_seconds"] <= extra["fit_seconds"]
    # the direct solve (chosen by "auto" at this size) records the fit's seconds too
    direct = FalkonGP(x, y, kernel=k, centers=x[:25], penalty=1e-6, options=FalkonOptions(solve_method="direct")).fit()
    assert direct.fit_info.extra["method"] == "direct" and direct.fit_info.extra["fit_seconds"] > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kmm_through_the_factor_solves_the_same_system(dtype, monkeypatch):
    """CG applies W with K_MM through the preconditioner's factor (FalkonPreconditioner.w_matmul, counted)
    where the factor reproduces the operator's K_MM: the solution matches the dense solve and the dense
    K_MM product's (settings.kmm_through_factor(False)); a builder whose preconditioner comes from another
    K_MM (a longer lengthscale) is not trusted for it: CG then applies H whole and still solves H itself."""
    from gpfalkon import FalkonPreconditioner

    x, y = make_data(400, 3)
    c = x[:40]
    k = make_kernel("matern52", 3, dtype=dtype)
    k.lengthscale = k.lengthscale * 0.5
    lam = 1e-5
    kd = make_kernel("matern52", 3)
    kd.lengthscale = kd.lengthscale * 0.5
    with torch.no_grad():
        H, knm, _ = dense_nystrom(kd, x, c, lam)
        ref = torch.linalg.solve(H, knm.T @ y.unsqueeze(-1))
    calls = [0]
    real = FalkonPreconditioner.w_matmul

    def counting(self, *a, **kw):
        calls[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(FalkonPreconditioner, "w_matmul", counting)
    tol, bound = (1e-12, 1e-8) if dtype == torch.float64 else (1e-7, 1e-4)

    def solve(**kw):
        op = NystromKRROperator(x.to(dtype), c.to(dtype), torch.tensor(lam, dtype=dtype), kernel=k, **kw)
        alpha, info = op.falkon_solve(op.kmn_y(y.to(dtype).unsqueeze(-1)), tol=tol, max_iter=500, warn=False)
        return alpha, info

    alpha, info = solve()
    assert calls[0] == info.iterations + info.extra["residual_checks"] > 0  # (the check of a claimed convergence)
    assert (alpha - ref).norm() / ref.norm() < bound
    with settings.kmm_through_factor(False):
        dense_kmm, _ = solve()
    assert calls[0] == info.iterations + info.extra["residual_checks"]  # not used
    assert (dense_kmm - ref).norm() / ref.norm() < bound
    if dtype == torch.float64:
        assert (alpha - dense_kmm).norm() / ref.norm() < 1e-9

    other = make_kernel("matern52", 3, dtype=dtype)  # a preconditioner of another K_MM: longer lengthscale
    other.lengthscale = k.lengthscale * 1.5

    def stale_builder(kmm, penalty, n, **kw):
        with torch.no_grad():
            k_other = other(c.to(dtype)).to_dense().to(torch.float64)
        return FalkonPreconditioner.from_kernel_matrix(k_other, penalty, n, **kw)

    from gpfalkon import FalkonOptions

    before = calls[0]
    stale, _ = solve(options=FalkonOptions(preconditioner=stale_builder))
    assert calls[0] == before
    assert (stale - ref).norm() / ref.norm() < bound
