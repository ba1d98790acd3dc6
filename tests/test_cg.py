"""The conjugate-gradient solver on explicit SPD matrices."""
from __future__ import annotations

import pytest
import torch

from gpfalkon import CGNotConvergedWarning, FalkonConvergenceError, conjugate_gradient
from gpfalkon.solvers.cg import MAX_REPLACEMENTS


def spd(m=30, cond=1e3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), m, dtype=torch.float64)
    return (q * ev) @ q.T


def test_solves_multiple_rhs_to_tolerance():
    A = spd()
    b = torch.randn(30, 4, dtype=torch.float64) * torch.tensor([1.0, 1e-6, 1e6, 3.0], dtype=torch.float64)
    x, info = conjugate_gradient(lambda u: A @ u, b, tol=1e-12, max_iter=500)
    ref = torch.linalg.solve(A, b)
    torch.testing.assert_close(x, ref, rtol=1e-9, atol=0)
    assert info.converged and info.iterations <= 500
    assert info.residuals.shape == (info.iterations + 1, 4)
    assert (info.final_residual <= 1e-12).all()


def test_zero_rhs_column_and_warm_start():
    A = spd()
    b = torch.randn(30, 2, dtype=torch.float64)
    b[:, 1] = 0
    x, _info = conjugate_gradient(lambda u: A @ u, b, tol=1e-12, max_iter=500)
    assert torch.equal(x[:, 1], torch.zeros(30, dtype=torch.float64))
    ref = torch.linalg.solve(A, b)
    x2, info2 = conjugate_gradient(lambda u: A @ u, b, x0=ref, tol=1e-8, max_iter=50)
    assert info2.iterations <= 1
    torch.testing.assert_close(x2, ref)


def test_callback_and_iteration_cap():
    A = spd(cond=1e8)
    b = torch.randn(30, 1, dtype=torch.float64)
    seen = []
    _x, info = conjugate_gradient(lambda u: A @ u, b, tol=0.0, max_iter=5, callback=lambda i, xx, r: seen.append(i))
    assert seen == [1, 2, 3, 4, 5] and info.iterations == 5 and not info.converged


def test_verbose_progress_bar(capsys):
    A = spd()
    conjugate_gradient(lambda u: A @ u, torch.randn(30, 1, dtype=torch.float64), tol=1e-8, max_iter=100, verbose=True)
    assert "FALKON CG" in capsys.readouterr().err


def test_indefinite_operator_raises():
    A = spd()
    A[0, 0] = -50.0
    with pytest.raises(FalkonConvergenceError, match="positive definiteness"):
        conjugate_gradient(lambda u: A @ u, torch.ones(30, 1, dtype=torch.float64), tol=1e-12, max_iter=100)


def test_non_finite_raises():
    with pytest.raises(FalkonConvergenceError, match="non-finite"):
        conjugate_gradient(lambda u: u * float("nan"), torch.ones(5, 1, dtype=torch.float64), max_iter=3)
    with pytest.raises(FalkonConvergenceError, match="NaN"):
        conjugate_gradient(lambda u: u, torch.full((5, 1), float("inf"), dtype=torch.float64))


def test_stagnation_returns_the_best_iterate_with_advice_for_the_dtype():
    # condition number 1e16 in float64: CG's residual stops decreasing for good
    A = spd(50, cond=1e16)
    b = A @ torch.ones(50, 1, dtype=torch.float64)  # CG gets to ~1e-10 before round-off stops it
    with pytest.warns(CGNotConvergedWarning, match="stagnated") as rec:
        x, info = conjugate_gradient(lambda u: A @ u, b, tol=1e-14, max_iter=3000)
    msg = str(rec[0].message)
    assert "float64 data" not in msg and "increase the penalty" in msg  # float64 data: no "use float64"
    assert info.extra["stagnated"] and not info.converged and info.iterations < 3000
    # the returned iterate is the best one seen
    rel = float((b - A @ x).norm() / b.norm())
    assert rel <= float(info.residuals.min()) * 1.01 + 1e-12
    # the advice names float64 only for narrower data
    with pytest.warns(CGNotConvergedWarning, match="float32 kernel products"):
        conjugate_gradient(lambda u: A @ u, b, tol=1e-14, max_iter=3000, data_dtype=torch.float32)
    # the same system with stagnation detection off runs to the cap instead
    _, info = conjugate_gradient(lambda u: A @ u, b, tol=1e-14, max_iter=200, stagnation_window=None)
    assert info.iterations == 200 and not info.converged


def test_stagnation_without_a_usable_iterate_raises():
    # the same system with b = ones: the residual never gets below 0.5 before it stalls
    A = spd(50, cond=1e16)
    with pytest.raises(FalkonConvergenceError, match="stagnated"):
        conjugate_gradient(lambda u: A @ u, torch.ones(50, 1, dtype=torch.float64), tol=1e-14, max_iter=3000)


def test_bad_arguments():
    with pytest.raises(ValueError, match="b must"):
        conjugate_gradient(lambda u: u, torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_iter"):
        conjugate_gradient(lambda u: u, torch.ones(5, 1, dtype=torch.float64), max_iter=-1)
    with pytest.raises(ValueError, match="tol"):
        conjugate_gradient(lambda u: u, torch.ones(5, 1, dtype=torch.float64), tol=float("nan"))


def test_zero_rhs_with_warm_start_returns_zero():
    A = spd()
    b = torch.zeros(30, 1, dtype=torch.float64)
    x, info = conjugate_gradient(lambda u: A @ u, b, x0=torch.ones(30, 1, dtype=torch.float64), tol=1e-10)
    assert torch.equal(x, torch.zeros_like(x)) and info.converged
    with pytest.raises(ValueError, match="x0 must have the shape"):
        conjugate_gradient(lambda u: A @ u, b, x0=torch.ones(30, dtype=torch.float64))


def test_warm_start_worse_than_zero_is_dropped():
    A = spd()
    b = torch.randn(30, 2, dtype=torch.float64)
    cold, _info_cold = conjugate_gradient(lambda u: A @ u, b, tol=0.0, max_iter=5)
    bad = 1e6 * torch.randn(30, 2, dtype=torch.float64)
    warm, info_warm = conjugate_gradient(lambda u: A @ u, b, x0=bad, tol=0.0, max_iter=5)
    torch.testing.assert_close(warm, cold)
    torch.testing.assert_close(info_warm.residuals[0], torch.ones(2, dtype=torch.float64))


def test_time_limit_stops_at_the_clock_and_returns_the_current_iterate(monkeypatch):
    """A fake clock advanced 1 s per operator call: a 3.5 s limit lets 4 iterations run (the check is
    after each); the iterate is the one 4 capped iterations give, and extra records the cause."""
    import types

    import gpfalkon.solvers.cg as cg_module

    now = [0.0]
    monkeypatch.setattr(cg_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    A = spd(cond=1e8)
    b = torch.randn(30, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def slow(u):
        now[0] += 1.0
        return A @ u

    x, info = conjugate_gradient(slow, b, tol=1e-12, max_iter=100, time_limit=3.5)
    assert info.iterations == 4 and info.extra["time_limit"] and not info.converged
    ref, ref_info = conjugate_gradient(lambda u: A @ u, b, tol=0.0, max_iter=4)
    torch.testing.assert_close(x, ref, rtol=0, atol=0)
    assert not ref_info.extra["time_limit"]
    # a limit the solve does not reach changes nothing
    A2 = spd()

    def slow2(u):
        now[0] += 1.0
        return A2 @ u

    x2, info2 = conjugate_gradient(slow2, b, tol=1e-12, max_iter=500, time_limit=1e6)
    ref2, _ = conjugate_gradient(lambda u: A2 @ u, b, tol=1e-12, max_iter=500)
    torch.testing.assert_close(x2, ref2, rtol=0, atol=0)
    assert not info2.extra["time_limit"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_time_limit_must_be_positive(bad):
    with pytest.raises(ValueError, match="time_limit"):
        conjugate_gradient(lambda u: u, torch.ones(3, 1, dtype=torch.float64), time_limit=bad)


@pytest.mark.parametrize("scale", [1e-170, 1e-100, 1e120, 1e170, 1.7e308])
def test_right_hand_sides_of_any_scale(scale):
    """CG's squared norms would underflow (overflow) for right-hand sides far from 1 (float64: below ~1e-150 the
    columns were taken for zero): the solution is the scaled solution, to the tolerance; a power-of-two scale
    gives it bit for bit, with the same iterations; the callback sees the iterates in the caller's scale."""
    W = spd(20)
    b = torch.randn(20, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b = b / b.abs().max()  # entries up to 1: b * 1.7e308 stays finite
    x_ref, info_ref = conjugate_gradient(lambda v: W @ v, b, tol=1e-12, max_iter=200)
    seen = []
    x, info = conjugate_gradient(lambda v: W @ v, b * scale, tol=1e-12, max_iter=200,
                                 callback=lambda it, xi, rel: seen.append(float(xi.abs().max())))
    assert info.converged
    torch.testing.assert_close(x / scale, x_ref, rtol=1e-9, atol=0)
    assert seen[-1] == pytest.approx(float(x.abs().max()), rel=1e-12)
    two = 2.0 ** -600
    x2, info2 = conjugate_gradient(lambda v: W @ v, b * two, tol=1e-12, max_iter=200)
    assert torch.equal(x2 / two, x_ref) and info2.iterations == info_ref.iterations


def test_claimed_convergence_is_checked_against_the_true_residual():
    """An operator whose products carry rounding-like noise: CG's recursive residual keeps falling while
    ``b - W x`` stalls. The claim is checked with one more product; in float64 (a tight tol) CG restarts from the
    true residual while that halves it, then returns the checked iterate with the smallest true residual, not
    converged, with a warning. With float32 products (``data_dtype``) it does not restart (their noise floor is
    where the true residual is already); an exact operator's claim passes its one check, and a float64 solve at
    an ordinary tol is not checked at all."""
    A = spd(40, cond=1e4, seed=3)
    b = torch.randn(40, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)

    def noisy(u):
        w = A @ u
        return w + 1e-7 * w.norm(dim=0) * torch.randn(w.shape, dtype=w.dtype, generator=g)

    def true_rel(x):
        return (b - A @ x).norm(dim=0) / b.norm(dim=0)

    with pytest.warns(CGNotConvergedWarning, match="true relative residual"):
        x, info = conjugate_gradient(noisy, b, tol=1e-12, max_iter=2000, stagnation_window=None)
    assert not info.converged and float(true_rel(x).max()) > 1e-12
    assert 1 <= info.extra["residual_replacements"] <= MAX_REPLACEMENTS and info.extra["drifted"]
    assert info.extra["residual_checks"] == info.extra["residual_replacements"] + 1
    # the reported residual is a true one (the noise of that one product aside)
    torch.testing.assert_close(info.final_residual, true_rel(x), rtol=0.5, atol=0)
    assert info.residuals.shape == (info.iterations + 1, 2)

    with pytest.warns(CGNotConvergedWarning, match="true relative residual"):
        x, info = conjugate_gradient(noisy, b, tol=1e-12, max_iter=2000, stagnation_window=None,
                                     data_dtype=torch.float32)
    assert info.extra["residual_checks"] == 1 and info.extra["residual_replacements"] == 0
    torch.testing.assert_close(info.final_residual, true_rel(x), rtol=0.5, atol=0)

    x, info = conjugate_gradient(lambda u: A @ u, b, tol=1e-8, max_iter=2000, verify=True)
    assert info.converged and info.extra["residual_checks"] == 1 and info.extra["residual_replacements"] == 0
    assert float(true_rel(x).max()) <= 1e-8
    _, info = conjugate_gradient(lambda u: A @ u, b, tol=1e-8, max_iter=2000)
    assert info.converged and info.extra["residual_checks"] == 0


def test_columns_frozen_at_a_breakdown_are_not_checked_nor_restarted():
    """A singular consistent system (rank 4) at an unreachable tol: the column freezes at a rounding-level breakdown
    above tol; that is no claimed convergence, so no check, no restart, and the best iterate is returned."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    w = q[:, :4] @ torch.diag(torch.tensor([1.0, 0.5, 0.2, 0.1], dtype=torch.float64)) @ q[:, :4].T
    b = w @ torch.randn(30, 1, generator=g, dtype=torch.float64)
    with pytest.warns(CGNotConvergedWarning):
        x, info = conjugate_gradient(lambda u: w @ u, b, tol=1e-17, max_iter=100)
    assert info.extra["frozen_at_breakdown"] == 1 and info.extra["residual_checks"] == 0
    assert float((b - w @ x).norm() / b.norm()) < 1e-15
