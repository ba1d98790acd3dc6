"""Leverage-score centers: BLESS scores against dense exact ones, the sampling and its
weights D, weighted FALKON against the dense Nyström solution, the preconditioner
identity of docs/math.md §3 with D, condition numbers on clustered data, FalkonGP."""
from __future__ import annotations

import copy
import math
import statistics

import gpytorch
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gpfalkon import FalkonGP, FalkonPreconditioner, NystromKRROperator
from gpfalkon.centers import (
    CenterSelection,
    LeverageCenters,
    UniformCenters,
    approximate_leverage_scores,
    dictionary_leverage_scores,
    distinct_groups,
    effective_dimension,
    first_distinct,
    leverage_centers,
    merge_repeated_scores,
    nested_leverage_centers,
    uniform_centers,
)

from conftest import dense_kernel, dense_nystrom, make_data, make_kernel


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _exact_scores(kernel, x, lam):
    """Dense reference: diag(K (K + n lam I)^{-1}), float64, O(n^3)."""
    n = x.shape[0]
    with torch.no_grad():
        K = dense_kernel(kernel, x, x).to(torch.float64)
        return torch.linalg.solve(K + n * lam * torch.eye(n, dtype=torch.float64), K).diagonal()


def _rbf(ls: float, dtype=torch.float64):
    k = gpytorch.kernels.RBFKernel().to(dtype)
    k.lengthscale = ls
    return k


# ----------------------------------------------------------------- scores
@pytest.mark.parametrize("lam", [1e-3, 1e-5])
def test_scores_within_constant_factor_of_exact(lam):
    x, _ = make_data(1000, 3)
    k = _rbf(0.5)
    exact = _exact_scores(k, x, lam)
    approx = approximate_leverage_scores(x, k, lam, generator=_gen(0))
    assert approx.dtype == torch.float64 and approx.shape == (1000,)
    ratio = approx / exact
    # BLESS: a multiplicative approximation; measured: >= 98.5 % in [1/3, 3] over 20 seeds
    assert float(((ratio > 1 / 3) & (ratio < 3)).double().mean()) >= 0.95, torch.quantile(ratio, 0.05)
    assert float(((ratio > 1 / 2) & (ratio < 2)).double().mean()) >= 0.90
    # effective dimension: measured overestimate 1-22 %
    d_exact = float(exact.sum())
    d_approx = effective_dimension(x, k, lam, generator=_gen(0))
    assert abs(d_approx / d_exact - 1) < 0.3, (d_approx, d_exact)
    assert d_approx == pytest.approx(float(approx.sum()), rel=1e-12)  # same generator state -> same scores
    # every estimate lies in the interval that holds every exact score
    diag = torch.ones(1000, dtype=torch.float64)
    n = 1000
    assert bool((approx <= diag / (diag + n * lam) + 1e-15).all())
    assert bool((approx >= diag / (diag.sum() + n * lam) - 1e-15).all())
    assert bool((exact <= diag / (diag + n * lam) + 1e-12).all())


def test_scores_are_deterministic_and_float64_for_float32_inputs():
    x, _ = make_data(300, 2)
    x32 = x.float()
    k32 = _rbf(0.4, torch.float32)
    a = approximate_leverage_scores(x32, k32, 1e-4, generator=_gen(3))
    b = approximate_leverage_scores(x32, k32, 1e-4, generator=_gen(3))
    assert a.dtype == torch.float64 and torch.equal(a, b)
    # float32 data are scored in float64: identical to the float64 computation on the same values
    k64 = copy.deepcopy(k32).double()
    c = approximate_leverage_scores(x32.double(), k64, 1e-4, generator=_gen(3))
    torch.testing.assert_close(a, c, rtol=1e-12, atol=0.0)
    assert k32.lengthscale.dtype == torch.float32  # the user's kernel is untouched
    d = approximate_leverage_scores(x32, k32, 1e-4, generator=_gen(4))
    assert not torch.equal(a, d)


def test_scores_blockwise_and_generic_kernel():
    """Row blocks of any height give the same scores; a kernel without the fast path works."""
    x, _ = make_data(400, 3)
    k = make_kernel("rbf+linear", 3)
    lam = 1e-3
    a = approximate_leverage_scores(x, k, lam, generator=_gen(1), block_rows=37)
    b = approximate_leverage_scores(x, k, lam, generator=_gen(1))
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    ratio = a / _exact_scores(k, x, lam)
    assert float(((ratio > 1 / 3) & (ratio < 3)).double().mean()) >= 0.95


def test_dictionary_cap_warns():
    x, _ = make_data(400, 3)
    with pytest.warns(RuntimeWarning, match="max_dictionary_size"):
        s = approximate_leverage_scores(x, _rbf(0.3), 1e-6, generator=_gen(0), max_dictionary_size=20)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())


# --------------------------------------------------------------- sampling
def test_sampling_counts_probabilities_and_weights():
    n, r = 2000, 500
    x, _ = make_data(n, 2)
    g = _gen(7)
    scores = torch.rand(n, generator=g, dtype=torch.float64) ** 4  # very non-uniform
    scores[:100] = 0.0  # never drawn
    sel = leverage_centers(x, r, None, None, generator=_gen(1), scores=scores)
    idx, counts = sel.indices, sel.counts
    m = idx.numel()
    assert isinstance(sel, CenterSelection)
    assert int(counts.sum()) == r and bool((counts >= 1).all())
    assert bool((idx[1:] > idx[:-1]).all())  # unique and sorted
    assert bool((idx >= 100).all())
    assert m < r  # duplicates were merged
    assert torch.equal(sel.centers, x[idx])
    p = scores / scores.sum()
    torch.testing.assert_close(sel.probabilities, p[idx], rtol=1e-12, atol=0.0)
    # D_jj = sqrt(M count_j / (n R p_j)): (n / M) D^2 = count / (R p), the importance weights
    expected = torch.sqrt(m * counts.double() / (n * r * p[idx]))
    torch.testing.assert_close(sel.weights, expected, rtol=1e-12, atol=0.0)
    # deterministic given the generator
    again = leverage_centers(x, r, None, None, generator=_gen(1), scores=scores)
    assert torch.equal(again.indices, idx) and torch.equal(again.weights, sel.weights)


def test_sampling_frequencies_follow_probabilities():
    n = 4000
    x, _ = make_data(n, 2)
    scores = torch.ones(n, dtype=torch.float64)
    scores[n // 2 :] = 3.0  # the second half holds 3/4 of the mass
    sel = leverage_centers(x, n, None, None, generator=_gen(0), scores=scores)
    frac = float(sel.counts[sel.indices >= n // 2].sum()) / n
    assert abs(frac - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)


def test_uniform_probabilities_give_unit_weights():
    n, r = 10000, 20
    x, _ = make_data(n, 2)
    sel = leverage_centers(x, r, None, None, generator=_gen(0), scores=torch.full((n,), 0.3, dtype=torch.float64))
    assert bool((sel.counts == 1).all())  # no duplicate for this seed
    torch.testing.assert_close(sel.weights, torch.ones(r, dtype=torch.float64), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(sel.probabilities, torch.full((r,), 1 / n, dtype=torch.float64))


def test_weights_make_an_unbiased_nystrom_sketch():
    """(n/M) sum_j D_j^2 f(x_j) = sum_j count_j f(x_j) / (R p_j) has mean sum_i f(x_i): the
    sketch (n/M) K_MM D^2 K_MM of K_Mn K_nM is unbiased. The paper's D = 1/sqrt(n p count)
    is not (it divides by count_j)."""
    n, r, reps = 200, 150, 400
    x, _ = make_data(n, 2)
    scores = torch.linspace(0.05, 1.0, n, dtype=torch.float64) ** 2
    f = torch.rand(n, generator=_gen(2), dtype=torch.float64) + 0.5
    ours, paper = [], []
    g = _gen(5)
    for _ in range(reps):
        sel = leverage_centers(x, r, None, None, generator=g, scores=scores)
        m = sel.indices.numel()
        ours.append(float((n / m) * (sel.weights**2 * f[sel.indices]).sum()))
        d_paper = 1 / torch.sqrt(n * sel.probabilities * sel.counts)
        paper.append(float((n / m) * (d_paper**2 * f[sel.indices]).sum()))
    target = float(f.sum())
    se = statistics.stdev(ours) / math.sqrt(reps)
    assert abs(statistics.mean(ours) - target) < 4 * se
    assert abs(statistics.mean(paper) - target) > 0.1 * target  # biased: what we avoid


def test_leverage_centers_selector_and_validation():
    x, _ = make_data(300, 2)
    k = _rbf(0.5)
    a = LeverageCenters(1e-3, seed=4)(x, 40, k)
    b = LeverageCenters(1e-3, seed=4)(x, 40, k)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.weights, b.weights)
    assert int(a.counts.sum()) == 40
    c = leverage_centers(x, 40, k, 1e-3, generator=_gen(4))
    assert torch.equal(a.indices, c.indices)
    with pytest.raises(ValueError, match="penalty"):
        leverage_centers(x, 40, k, 0.0)
    with pytest.raises(ValueError, match="penalty"):
        approximate_leverage_scores(x, k, -1e-3)
    with pytest.raises(ValueError, match="penalty"):
        LeverageCenters(float("nan"))
    with pytest.raises(ValueError, match="num_centers"):
        leverage_centers(x, 301, k, 1e-3)
    with pytest.raises(ValueError, match="num_centers"):
        leverage_centers(x, 0, k, 1e-3)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="x contains"):
        leverage_centers(bad, 10, k, 1e-3)
    with pytest.raises(TypeError, match="kernel"):
        approximate_leverage_scores(x, "rbf", 1e-3)
    with pytest.raises(ValueError, match="scores"):
        leverage_centers(x, 10, k, 1e-3, scores=torch.ones(299, dtype=torch.float64))
    with pytest.raises(ValueError, match="scores"):
        leverage_centers(x, 10, k, 1e-3, scores=-torch.ones(300, dtype=torch.float64))
    with pytest.raises(ValueError, match="scores"):
        leverage_centers(x, 10, k, 1e-3, scores=torch.zeros(300, dtype=torch.float64))
    with pytest.raises(ValueError, match="oversampling"):
        approximate_leverage_scores(x, k, 1e-3, oversampling=0.5)
    with pytest.raises(ValueError, match="lambda_step"):
        approximate_leverage_scores(x, k, 1e-3, lambda_step=1.0)
    with pytest.raises(ValueError, match="max_dictionary_size"):
        approximate_leverage_scores(x, k, 1e-3, max_dictionary_size=0)


# ------------------------------------------------- weighted FALKON and B
def _weighted_problem():
    x, y = make_data(500, 3)
    k = make_kernel("matern52", 3)
    k.lengthscale = k.lengthscale * 0.5  # cond(H) ~ 1e4: the dense reference is accurate
    lam = 1e-4
    sel = leverage_centers(x, 80, k, lam, generator=_gen(0))
    return x, y, k, lam, sel


def test_weighted_falkon_equals_dense_nystrom_solution():
    x, y, k, lam, sel = _weighted_problem()
    w = sel.weights
    assert float(w.max() / w.min()) > 1.5 and int(sel.counts.max()) > 1  # a non-trivial D
    op = NystromKRROperator(x, sel.centers, torch.tensor(lam, dtype=torch.float64), kernel=k, weights=w)
    alpha, info = op.falkon_solve(op.kmn_y(y.unsqueeze(-1)), tol=1e-13, max_iter=500, warn=False)
    with torch.no_grad():
        H, knm, _ = dense_nystrom(k, x, sel.centers, lam)
        ref = torch.linalg.solve(H, knm.T @ y.unsqueeze(-1))
    assert float((alpha - ref).norm() / ref.norm()) < 1e-8, info.iterations
    # the weights change the preconditioner only: unweighted FALKON reaches the same alpha
    op1 = NystromKRROperator(x, sel.centers, torch.tensor(lam, dtype=torch.float64), kernel=k)
    alpha1, _ = op1.falkon_solve(op1.kmn_y(y.unsqueeze(-1)), tol=1e-13, max_iter=500, warn=False)
    assert float((alpha1 - ref).norm() / ref.norm()) < 1e-8


def test_weighted_preconditioner_identity_math_md():
    """B B^T = ((n/M) K_MM D^2 K_MM + n lam K_MM)^{-1} with M = number of *distinct*
    centers (the size of K_MM, what FalkonPreconditioner uses), here < R draws."""
    x, _, k, lam, sel = _weighted_problem()
    n, m, r = x.shape[0], sel.indices.numel(), int(sel.counts.sum())
    assert m < r
    with torch.no_grad():
        kmm = dense_kernel(k, sel.centers, sel.centers)
    P = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=sel.weights, jitter=0.0)
    D2 = torch.diag(sel.weights**2)
    target = (n / m) * kmm @ D2 @ kmm + n * lam * kmm
    bbt = P.apply_bbt(torch.eye(m, dtype=torch.float64))
    err = (target @ bbt - torch.eye(m, dtype=torch.float64)).abs().max()
    assert float(err) < 1e-6
    # with R (draws) in place of M the identity does not hold: the code's M is the distinct count
    wrong = (n / r) * kmm @ D2 @ kmm + n * lam * kmm
    assert float((wrong @ bbt - torch.eye(m, dtype=torch.float64)).abs().max()) > 1e-2


def _assert_weighted_identity(P, kmm, weights, n, lam):
    m = kmm.shape[0]
    target = (n / m) * kmm @ torch.diag(weights**2) @ kmm + n * lam * kmm
    err = (target @ P.apply_bbt(torch.eye(m, dtype=torch.float64)) - torch.eye(m, dtype=torch.float64)).abs().max()
    assert float(err) < 1e-4, float(err)


def test_solver_preconditioner_uses_the_weights():
    """D changes only the preconditioner, so the dense-solution tests cannot see it: check
    that the preconditioner the CG solve uses (the operator's, also via FalkonGP) is the
    weighted one of docs/math.md §3, and not the D = I one."""
    x, y, k, lam, sel = _weighted_problem()
    n = x.shape[0]
    with torch.no_grad():
        kmm = dense_kernel(k, sel.centers, sel.centers)
    op = NystromKRROperator(x, sel.centers, torch.tensor(lam, dtype=torch.float64), kernel=k, weights=sel.weights)
    _assert_weighted_identity(op.preconditioner, kmm, sel.weights, n, lam)
    with pytest.raises(AssertionError):  # the identity does tell D from I here
        _assert_weighted_identity(op.preconditioner, kmm, torch.ones_like(sel.weights), n, lam)
    model = FalkonGP(x, y, kernel=k, centers=sel.centers, center_weights=sel.weights, penalty=lam)
    _assert_weighted_identity(model.nystrom_operator().preconditioner, kmm, sel.weights, n, lam)
    # and a different D gives a different CG path on the same system
    _, info_d = op.falkon_solve(op.kmn_y(y.unsqueeze(-1)), tol=1e-10, max_iter=500, warn=False)
    op_i = NystromKRROperator(x, sel.centers, torch.tensor(lam, dtype=torch.float64), kernel=k)
    _, info_i = op_i.falkon_solve(op_i.kmn_y(y.unsqueeze(-1)), tol=1e-10, max_iter=500, warn=False)
    assert not torch.allclose(info_d.residuals[1], info_i.residuals[1])


def test_falkon_gp_leverage_options():
    x, y = make_data(400, 3)
    k = make_kernel("scale_matern52", 3)
    kw = dict(kernel=k, num_centers=60, penalty=1e-4, center_selection="leverage", seed=4)
    model = FalkonGP(x, y, leverage_options={"weighting": "paper", "oversampling": 3.0}, **kw)
    sel = leverage_centers(x, 60, k, model.penalty.detach(), generator=_gen(4), weighting="paper", oversampling=3.0)
    assert torch.equal(model.centers, sel.centers)
    torch.testing.assert_close(model.center_weights, 1 / torch.sqrt(400 * sel.probabilities * sel.counts))
    with pytest.raises(ValueError, match=r"leverage_options.*bogus"):
        FalkonGP(x, y, leverage_options={"bogus": 1}, **kw)
    with pytest.raises(TypeError, match="leverage_options"):
        FalkonGP(x, y, leverage_options=[("weighting", "paper")], **kw)
    with pytest.raises(ValueError, match="leverage_options"):
        FalkonGP(x, y, kernel=k, num_centers=60, leverage_options={"weighting": "paper"})
    with pytest.raises(ValueError, match="weighting"):
        FalkonGP(x, y, leverage_options={"weighting": "other"}, **kw)


def test_center_functions_reject_bad_penalty_and_generator():
    x, _ = make_data(50, 2)
    k = make_kernel("rbf", 2)
    for bad in (None, "1e-3", True, [1e-3, 1e-4]):
        with pytest.raises((TypeError, ValueError), match="penalty"):
            approximate_leverage_scores(x, k, bad)
        with pytest.raises((TypeError, ValueError), match="penalty"):
            leverage_centers(x, 10, k, bad)
    with pytest.raises(TypeError, match="generator"):
        approximate_leverage_scores(x, k, 1e-3, generator=0)
    with pytest.raises(TypeError, match="generator"):
        leverage_centers(x, 10, k, 1e-3, generator="seed")
    with pytest.raises(TypeError, match="generator"):
        uniform_centers(x, 10, generator=1)


# ------------------------------------------------------ condition numbers
def _clustered_data(seed: int = 0):
    """2-d: one dense cluster with 99 % of the points (std 0.3 lengthscales), two small tight
    clusters and 12 isolated points, all far apart (>= 20 lengthscales)."""
    g = _gen(seed)
    big = 0.3 * torch.randn(1960, 2, generator=g, dtype=torch.float64)
    small = [torch.tensor([20.0, 0.0]) + 0.1 * torch.randn(20, 2, generator=g, dtype=torch.float64),
             torch.tensor([0.0, 20.0]) + 0.1 * torch.randn(8, 2, generator=g, dtype=torch.float64)]
    ang = torch.arange(12, dtype=torch.float64) * (2 * math.pi / 12)
    lone = 60.0 * torch.stack([ang.cos(), ang.sin()], -1)
    return torch.cat([big, *small, lone])


def _cond_bhb(x, kernel, centers, lam, weights=None) -> float:
    """cond(B^T H B), dense, with B the code's FalkonPreconditioner."""
    n, m = x.shape[0], centers.shape[0]
    with torch.no_grad():
        H, _, kmm = dense_nystrom(kernel, x, centers, lam)
        B = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=weights).apply_b(
            torch.eye(m, dtype=torch.float64)
        )
        W = B.T @ H @ B
        ev = torch.linalg.eigvalsh((W + W.T) / 2)
    assert float(ev[0]) > 0
    return float(ev[-1] / ev[0])


def test_leverage_centers_condition_clustered_data():
    """Uniform centers over-weight any isolated point they happen to hit by n/M (it stands
    for one point, not n/M); leverage centers weight it by count/(R p) ~ 1.

    Matern 5/2 rather than RBF: with RBF, uniform sampling puts ~M centers in the dense
    cluster and K_MM is numerically singular (eigenvalues ~1e-16), so the dense
    cond(B^T H B) would measure rounding, not sampling. Both methods get the same number
    of distinct centers M (R = 300 leverage draws give ~200). Measured (seeds 0-9):
    leverage median 4.3 (3.6-6.4), uniform median 28 (5.7-40; the low values when no
    isolated point is drawn), leverage with the paper's D = 1/sqrt(n p count) 12.
    """
    x = _clustered_data()
    k = make_kernel("matern52", 2)
    k.lengthscale = torch.ones(1, 2, dtype=torch.float64)
    lam, r = 1e-4, 300
    scores = approximate_leverage_scores(x, k, lam, generator=_gen(11))
    uni, lev, lev_paper = [], [], []
    for seed in range(5):
        sel = leverage_centers(x, r, k, lam, generator=_gen(100 + seed), scores=scores)
        lev.append(_cond_bhb(x, k, sel.centers, lam, sel.weights))
        paper_d = 1 / torch.sqrt(x.shape[0] * sel.probabilities * sel.counts)
        lev_paper.append(_cond_bhb(x, k, sel.centers, lam, paper_d))
        cu = uniform_centers(x, sel.indices.numel(), _gen(seed))
        uni.append(_cond_bhb(x, k, cu.centers, lam))
    med = statistics.median
    report = f"uniform {uni}, leverage {lev}, paper D {lev_paper}"
    assert med(lev) < 6, report
    assert med(uni) > 4 * med(lev), report
    assert med(lev_paper) > 1.8 * med(lev), report


# ---------------------------------------------------------------- FalkonGP
def _leverage_model(**kw):
    x, y = make_data(400, 3)
    k = make_kernel("scale_matern52", 3)
    model = FalkonGP(x, y, kernel=k, num_centers=60, penalty=1e-4, center_selection="leverage",
                     tol=1e-12, max_iter=500, **kw)
    return model, x, y, k


def test_falkon_gp_leverage_fits_the_dense_nystrom_solution():
    model, x, y, k = _leverage_model()
    w = model.center_weights
    assert w is not None and w.dtype == torch.float64 and w.shape == (model.centers.shape[0],)
    sel = leverage_centers(x, 60, k, model.penalty.detach(), generator=_gen(0))
    assert torch.equal(model.centers, sel.centers) and torch.equal(w, sel.weights)
    assert model.nystrom_operator().weights is w
    model.fit()
    model.eval()
    with torch.no_grad():
        H, knm, _ = dense_nystrom(k, x, model.centers, 1e-4)
        ref = torch.linalg.solve(H, knm.T @ y.unsqueeze(-1)).squeeze(-1)
        xt = make_data(20, 3, seed=3)[0]
        pred = model(xt)
        mean_ref = dense_kernel(k, xt, model.centers) @ ref
    assert float((model.alpha - ref).norm() / ref.norm()) < 1e-8
    torch.testing.assert_close(pred.mean, mean_ref, rtol=1e-7, atol=1e-9)
    assert bool((pred.variance > 0).all())


def test_falkon_gp_leverage_weights_survive_copies_and_state_dict():
    model, x, y, _k = _leverage_model()
    model.fit()
    model.eval()
    xt = make_data(15, 3, seed=3)[0]
    with torch.no_grad():
        p = model(xt)
    sd = model.state_dict()
    assert "center_weights" in sd
    # a fresh model with another number of centers (another seed) adopts centers and weights
    fresh = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=30, seed=9, penalty=1e-4)
    assert fresh.center_weights is None and "center_weights" not in fresh.state_dict()
    fresh.load_state_dict(sd)
    fresh.eval()
    assert torch.equal(fresh.center_weights, model.center_weights)
    with torch.no_grad():
        q = fresh(xt)
    assert torch.equal(p.mean, q.mean) and torch.equal(p.variance, q.variance)
    # loading unweighted centers drops the weights
    fresh.load_state_dict(FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3), num_centers=30).state_dict())
    assert fresh.center_weights is None
    # deepcopy and dtype conversions keep them (float64)
    assert torch.equal(copy.deepcopy(model).center_weights, model.center_weights)
    m32 = copy.deepcopy(model).float()
    assert m32.center_weights.dtype == torch.float64 and torch.equal(m32.center_weights, model.center_weights)
    # learn_centers keeps the weights as a buffer next to the Parameter centers
    learn, *_ = _leverage_model(learn_centers=True)
    assert isinstance(learn.centers, torch.nn.Parameter) and learn.center_weights is not None


def test_falkon_gp_user_center_weights_and_errors():
    x, y = make_data(300, 3)
    k = make_kernel("rbf", 3)
    sel = leverage_centers(x, 40, k, 1e-3, generator=_gen(2))
    model = FalkonGP(x, y, kernel=k, centers=sel.centers, center_weights=sel.weights, penalty=1e-3)
    assert torch.equal(model.center_weights, sel.weights)
    assert torch.equal(model.nystrom_operator().weights, sel.weights)
    n0 = x.shape[0]
    model.set_train_data(x[:200], y[:200])  # D is tied to the draws' probabilities, not to n: kept
    assert model.n == 200 and n0 == 300 and torch.equal(model.center_weights, sel.weights)
    model.fit()  # and the fit with the kept D is the dense Nystrom solution on the new rows
    with torch.no_grad():  # (the noise sigma^2 = 300 * 1e-3 stays: lambda = sigma^2 / 200)
        H, knm, _ = dense_nystrom(k, x[:200], sel.centers, 1e-3 * 300 / 200)
        ref = torch.linalg.solve(H, knm.T @ y[:200].unsqueeze(-1)).squeeze(-1)
    assert float((model.alpha.reshape(-1) - ref).norm() / ref.norm()) < 1e-6
    assert FalkonGP(x, y, kernel=k, num_centers=20).center_weights is None
    with pytest.raises(ValueError, match="center_selection"):
        FalkonGP(x, y, kernel=k, num_centers=20, center_selection="kmeans")
    with pytest.raises(ValueError, match="center_selection"):
        FalkonGP(x, y, kernel=k, centers=sel.centers, center_selection="leverage")
    with pytest.raises(ValueError, match="center_weights"):
        FalkonGP(x, y, kernel=k, num_centers=20, center_weights=sel.weights)
    with pytest.raises(ValueError, match="center_weights"):
        FalkonGP(x, y, kernel=k, centers=sel.centers, center_weights=sel.weights[:-1])
    with pytest.raises(ValueError, match="center_weights"):
        FalkonGP(x, y, kernel=k, centers=sel.centers, center_weights=-sel.weights)


def test_validation_objective_accepts_leverage():
    from gpfalkon.tuning import falkon_validation_error

    x, y = make_data(300, 2)
    xv, yv = make_data(100, 2, seed=3)
    f = falkon_validation_error(max_iter=15)
    val = f({"num_centers": 40, "penalty": 1e-4, "center_selection": "leverage"}, x, y, xv, yv)
    assert 0 < val < float(yv.std())
    with pytest.raises(ValueError, match="center_selection"):
        f({"center_selection": "kmeans"}, x, y, xv, yv)


def test_paper_weighting_option():
    import gpytorch

    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 2, generator=g, dtype=torch.float64)
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = 0.3
    scores = torch.rand(300, generator=g, dtype=torch.float64) + 0.1
    a = leverage_centers(x, 200, k, 1e-3, generator=torch.Generator().manual_seed(1), scores=scores)
    b = leverage_centers(x, 200, k, 1e-3, generator=torch.Generator().manual_seed(1), scores=scores, weighting="paper")
    assert torch.equal(a.indices, b.indices) and bool((a.counts > 1).any())
    torch.testing.assert_close(b.weights, 1 / torch.sqrt(300 * b.probabilities * b.counts.double()))
    m = a.indices.numel()
    torch.testing.assert_close(a.weights, torch.sqrt(m * a.counts.double() / (300 * 200 * a.probabilities)))
    with pytest.raises(ValueError, match="weighting"):
        leverage_centers(x, 20, k, 1e-3, scores=scores, weighting="other")


# ----------------------------------------------------------------- scores from a given dictionary
def test_dictionary_scores_exact_with_all_rows_and_dense_formula_with_a_subset():
    x, _ = make_data(300, 3)
    k = _rbf(0.6)
    lam = 1e-3
    exact = _exact_scores(k, x, lam)
    full = dictionary_leverage_scores(x, k, lam, torch.arange(300), 1.0)
    assert full.dtype == torch.float64 and torch.allclose(full, exact, rtol=1e-6, atol=1e-9)
    # a uniform subset J with a_j = |J| / n: the dense estimator (K_ii - K_iJ (K_JJ + n lam A)^-1 K_Ji) / (n lam),
    # clipped to [K_ii / (tr K + n lam), K_ii / (K_ii + n lam)]
    j = torch.randperm(300, generator=_gen(1))[:80]
    est = dictionary_leverage_scores(x.to(torch.float32), k.to(torch.float32), lam, j, 80 / 300)
    with torch.no_grad():
        K = dense_kernel(k.to(torch.float64), x, x).to(torch.float64)
    nl = 300 * lam
    kij = K[:, j]
    ref = (K.diagonal() - (kij * torch.linalg.solve(K[j][:, j] + nl * 80 / 300 * torch.eye(80, dtype=torch.float64),
                                                      kij.T).T).sum(1)) / nl
    ref = torch.minimum(torch.maximum(ref, K.diagonal() / (K.trace() + nl)), K.diagonal() / (K.diagonal() + nl))
    assert torch.allclose(est, ref, rtol=1e-4, atol=1e-7)
    # and it is a constant-factor estimate of the exact scores here (80 rows >> d_eff)
    ratio = est / exact
    assert float(((ratio > 1 / 3) & (ratio < 3)).double().mean()) >= 0.95
    # per-point inclusion probabilities: a tensor
    per_point = dictionary_leverage_scores(x, k, lam, j, torch.full((80,), 80 / 300, dtype=torch.float64))
    assert torch.allclose(per_point, dictionary_leverage_scores(x, k, lam, j, 80 / 300))
    # rows=: the dense reference's entries at those rows (n, lambda and tr K still of all 300 rows, so the
    # clipping bounds are the full problem's), whatever their order, and pieces that add up to the whole
    rows = torch.randperm(300, generator=_gen(2))[:70]
    part = dictionary_leverage_scores(x.to(torch.float32), k.to(torch.float32), lam, j, 80 / 300, rows=rows)
    assert part.shape == (70,) and torch.allclose(part, ref[rows], rtol=1e-4, atol=1e-7)
    pieces = [dictionary_leverage_scores(x, k, lam, j, 80 / 300, rows=torch.arange(a, b))
              for a, b in ((0, 75), (75, 300))]
    torch.testing.assert_close(torch.cat(pieces), dictionary_leverage_scores(x, k, lam, j, 80 / 300))
    assert dictionary_leverage_scores(x, k, lam, j, 80 / 300, rows=torch.arange(0)).shape == (0,)


def test_dictionary_scores_validation():
    x, _ = make_data(50, 2)
    k = _rbf(0.5)
    with pytest.raises(TypeError, match="dictionary"):
        dictionary_leverage_scores(x, k, 1e-3, [0, 1], 0.5)
    with pytest.raises(ValueError, match="dictionary: row indices must lie in"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([0, 50]), 0.5)
    with pytest.raises(ValueError, match="distinct"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 3]), 0.5)
    with pytest.raises(ValueError, match="inclusion"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 4]), 1.5)
    with pytest.raises(ValueError, match="inclusion"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 4]), torch.ones(3))
    with pytest.raises(ValueError, match="penalty"):
        dictionary_leverage_scores(x, k, -1.0, torch.tensor([3, 4]), 0.5)
    with pytest.raises(TypeError, match="rows"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 4]), 0.5, rows=[0, 1])
    with pytest.raises(TypeError, match="rows"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 4]), 0.5, rows=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"rows: row indices must lie in \[0, 50\)"):
        dictionary_leverage_scores(x, k, 1e-3, torch.tensor([3, 4]), 0.5, rows=torch.tensor([0, 50]))


# ----------------------------------------------------------------- nested leverage-score centers
def test_nested_leverage_centers_prefixes_are_leverage_samples():
    """Each size m is the leverage_centers sample of its r_m draws (same generator state: same draws),
    with the same weights D; sizes are nested prefixes in order of first draw."""
    x, _ = make_data(400, 3)
    k = _rbf(0.5)
    scores = _exact_scores(k, x, 1e-3)
    nested = nested_leverage_centers(scores, 150, generator=_gen(7))
    assert nested.size == 150 and bool((nested.first_draw[1:] > nested.first_draw[:-1]).all())
    assert int(torch.unique(nested.indices).numel()) == 150
    assert torch.allclose(nested.probabilities.sum(), torch.tensor(1.0, dtype=torch.float64))
    prev = None
    for m in (1, 9, 40, 150):
        sel = nested.select(x, m)
        r = int(nested.first_draw[m - 1]) + 1
        ref = leverage_centers(x, r, k, 1e-3, scores=scores, generator=_gen(7))
        order = torch.argsort(sel.indices)
        assert torch.equal(sel.indices[order], ref.indices)
        assert torch.equal(sel.counts[order], ref.counts) and int(sel.counts.sum()) == r
        assert torch.allclose(sel.weights[order], ref.weights)
        assert torch.equal(sel.centers, x[sel.indices])
        if prev is not None:
            assert torch.equal(sel.indices[: prev.numel()], prev)
        prev = sel.indices


def test_nested_leverage_centers_concentrated_mass_and_validation():
    x, _ = make_data(100, 2)
    scores = torch.zeros(100, dtype=torch.float64)
    scores[[3, 50, 97]] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    nested = nested_leverage_centers(scores, 10, generator=_gen(0))
    assert nested.size == 3 and set(nested.indices.tolist()) == {3, 50, 97}
    with pytest.raises(ValueError, match="m must be an int in \\[1, 3\\]"):
        nested.select(x, 4)
    with pytest.raises(ValueError, match="x has 99 rows"):
        nested.select(x[:99], 2)
    with pytest.raises(ValueError, match="scores"):
        nested_leverage_centers(-scores, 2)
    with pytest.raises(ValueError, match="max_draws"):
        nested_leverage_centers(scores, 10, max_draws=5)
    # uniform scores: D_jj = sqrt(m count_j / r_m), 1 where no row was drawn twice
    sel = nested_leverage_centers(torch.ones(100, dtype=torch.float64), 5, generator=_gen(1)).select(x, 5)
    r = int(sel.counts.sum())
    assert torch.allclose(sel.weights, torch.sqrt(5 * sel.counts.double() / r))


@pytest.mark.parametrize("opts,named", [({"min_dictionary_size": None}, "min_dictionary_size"),
                                        ({"max_dictionary_size": None}, "max_dictionary_size"),
                                        ({"max_dictionary_size": float("inf")}, "max_dictionary_size"),
                                        ({"block_rows": "a"}, "block_rows")])
def test_leverage_options_are_checked_by_name(opts, named):
    from gpfalkon import FalkonGP

    x, y = make_data(100, 2)
    with pytest.raises(ValueError, match=f"{named} must be an integer"):
        FalkonGP(x, y, make_kernel("rbf", 2), num_centers=10, center_selection="leverage", leverage_options=opts)


def test_a_custom_selector_must_return_a_center_selection():
    from gpfalkon import FalkonGP

    x, y = make_data(100, 2)
    with pytest.raises(TypeError, match=r"center_selection must return a gpfalkon\.CenterSelection"):
        FalkonGP(x, y, make_kernel("rbf", 2), num_centers=10,
                 center_selection=lambda x, m, kernel=None, penalty=None: x[:m])


# ----------------------------------------------------------------- distinct uniform centers
def _first_distinct_reference(rows: torch.Tensor) -> list[bool]:
    seen: set[tuple[float, ...]] = set()
    out = []
    for r in rows.tolist():
        key = tuple(r)
        out.append(key not in seen)
        seen.add(key)
    return out


@hsettings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(0, 60), d=st.integers(1, 4), levels=st.integers(1, 4),
       dtype=st.sampled_from(["float32", "float64"]))
def test_first_distinct_marks_the_first_row_of_each_value(n, d, levels, dtype):
    g = torch.Generator().manual_seed(n * 31 + d * 7 + levels)
    rows = torch.randint(0, levels, (n, d), generator=g).to(getattr(torch, dtype)) / 3
    mask = first_distinct(rows)
    assert mask.dtype == torch.bool and mask.shape == (n,)
    assert mask.tolist() == _first_distinct_reference(rows)


def _repeated_rows(n_distinct: int = 40, copies: int = 5, d: int = 2, seed: int = 0):
    """``n_distinct`` distinct rows, each ``copies`` times, shuffled."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n_distinct, d, generator=g, dtype=torch.float64)
    x = base.repeat(copies, 1)
    return x[torch.randperm(x.shape[0], generator=g)]


def test_uniform_centers_without_repeats_are_the_plain_draw():
    x, _ = make_data(300, 3)
    a = uniform_centers(x, 50, _gen(4))
    b = uniform_centers(x, 50, _gen(4), distinct=False)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.centers, b.centers)
    # the plain draw: the first 50 rows of the generator's permutation, sorted
    assert torch.equal(b.indices, torch.randperm(300, generator=_gen(4))[:50].sort().values)


def test_uniform_centers_skip_repeated_rows_in_permutation_order():
    x = _repeated_rows()
    plain = uniform_centers(x, 30, _gen(1), distinct=False)
    assert torch.unique(plain.centers, dim=0).shape[0] < 30  # the plain draw repeats rows here
    sel = uniform_centers(x, 30, _gen(1))
    assert sel.centers.shape == (30, 2) and torch.unique(sel.centers, dim=0).shape[0] == 30
    assert torch.equal(sel.centers, x[sel.indices]) and bool((sel.indices[1:] > sel.indices[:-1]).all())
    # reference: walk the same permutation, keep a row whose values were not kept before, stop at 30
    perm = torch.randperm(x.shape[0], generator=_gen(1))
    keep = [i for i, new in zip(perm.tolist(), _first_distinct_reference(x[perm]), strict=True) if new][:30]
    assert sel.indices.tolist() == sorted(keep)
    # nested in the number of centers, as the plain draw is
    small = uniform_centers(x, 12, _gen(1))
    assert set(small.indices.tolist()) <= set(sel.indices.tolist())


def test_uniform_centers_with_fewer_distinct_rows_than_asked_return_them():
    import warnings

    # every row read (16 M > n): the 7 values are all there are, no warning
    x = _repeated_rows(n_distinct=7, copies=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sel = uniform_centers(x, 20, _gen(0))
    assert sel.centers.shape[0] == 7 and torch.unique(sel.centers, dim=0).shape[0] == 7
    # the read stopped at 16 M = 320 of 2,100 rows: warned, with the rows found
    big = _repeated_rows(n_distinct=7, copies=300)
    with pytest.warns(UserWarning, match=r"num_centers=20: only 7 distinct rows among the 320 of x"):
        sel = uniform_centers(big, 20, _gen(0))
    assert sel.centers.shape[0] == 7 and torch.unique(sel.centers, dim=0).shape[0] == 7
    with pytest.raises(TypeError, match="distinct must be a bool"):
        uniform_centers(x, 5, _gen(0), distinct=1)
    with pytest.raises(TypeError, match="distinct must be a bool"):
        UniformCenters(seed=0, distinct="yes")
    assert UniformCenters(seed=0, distinct=False)(x, 20).centers.shape[0] == 20


def test_falkon_gp_on_repeated_rows_has_distinct_centers_and_fits_the_dense_solution():
    x = _repeated_rows(n_distinct=60, copies=4, d=2, seed=3)
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(x.shape[0], generator=_gen(2), dtype=torch.float64)
    k = _rbf(0.4)
    m = FalkonGP(x, y, kernel=k, num_centers=40, penalty=1e-3, seed=0, tol=1e-12, max_iter=500).fit()
    assert torch.unique(m.centers, dim=0).shape[0] == 40
    h, knm, _ = dense_nystrom(k, x, m.centers, 1e-3)
    # the fitted values (alpha itself is ill-determined at a smooth kernel)
    torch.testing.assert_close(knm @ m.alpha, knm @ torch.linalg.solve(h, knm.T @ y), rtol=1e-6, atol=1e-6)


def test_distinct_groups_sum_equal_rows():
    x = _repeated_rows(n_distinct=9, copies=4, d=3, seed=6)
    keep, to = distinct_groups(x)
    assert torch.equal(keep, first_distinct(x)) and torch.equal(x[keep][to], x)
    v = torch.rand(36, generator=_gen(1), dtype=torch.float64)
    sums = torch.zeros(9, dtype=torch.float64).index_add_(0, to, v)
    for j, row in enumerate(x[keep]):
        same = [i for i in range(36) if torch.equal(x[i], row)]
        assert math.isclose(float(sums[j]), float(v[same].sum()), rel_tol=1e-12)
    empty_keep, empty_to = distinct_groups(torch.zeros(0, 3))
    assert empty_keep.shape == empty_to.shape == (0,)


def test_merge_repeated_scores_moves_each_values_mass_to_its_first_row():
    x = _repeated_rows(n_distinct=9, copies=4, d=3, seed=6)
    scores = torch.rand(36, generator=_gen(3), dtype=torch.float64)
    merged = merge_repeated_scores(x, scores)
    first = _first_distinct_reference(x)
    for i in range(36):
        same = [j for j in range(36) if torch.equal(x[j], x[i])]
        want = float(scores[same].sum()) if first[i] else 0.0
        assert math.isclose(float(merged[i]), want, rel_tol=1e-12, abs_tol=1e-15)
    # drawn from, a nested stream never takes one value twice
    nested = nested_leverage_centers(merged, 9, generator=_gen(0))
    assert torch.unique(x[nested.indices], dim=0).shape[0] == nested.size == 9
    with pytest.raises(ValueError, match="scores must have shape"):
        merge_repeated_scores(x, scores[:5])


def test_leverage_centers_merge_equal_rows_and_keep_the_sketch():
    """Draws that fall on rows equal in value become one center: its count is the sum and its p the one with
    count / p = sum count_j / p_j, so the weighted sketch sum_j (n / M) D_j^2 k(., c_j) k(., c_j)^T is the same as
    the unmerged draws' (equal rows, equal columns); distinct=False keeps them apart (the same draws)."""
    x = _repeated_rows(n_distinct=30, copies=5, d=2, seed=8)
    scores = torch.rand(150, generator=_gen(4), dtype=torch.float64) + 0.05
    k = _rbf(0.5)
    merged = leverage_centers(x, 60, k, 1e-3, scores=scores, generator=_gen(0))
    apart = leverage_centers(x, 60, k, 1e-3, scores=scores, generator=_gen(0), distinct=False)
    assert torch.unique(apart.centers, dim=0).shape[0] < apart.centers.shape[0]  # the draws repeat values here
    m = merged.centers.shape[0]
    assert torch.unique(merged.centers, dim=0).shape[0] == m < apart.centers.shape[0]
    assert int(merged.counts.sum()) == int(apart.counts.sum()) == 60
    assert set(merged.indices.tolist()) <= set(apart.indices.tolist())
    torch.testing.assert_close(merged.centers, x[merged.indices])

    def sketch(sel):
        kz = dense_kernel(k, x, sel.centers)
        return kz @ torch.diag(150 / sel.centers.shape[0] * sel.weights**2) @ kz.T

    torch.testing.assert_close(sketch(merged), sketch(apart), rtol=1e-10, atol=1e-10)
    # each merged center's count / p is the sum over the rows merged into it
    for j, i in enumerate(merged.indices.tolist()):
        same = [r for r in range(apart.indices.numel()) if torch.equal(apart.centers[r], x[i])]
        want = float((apart.counts[same].double() / apart.probabilities[same]).sum())
        assert math.isclose(float(merged.counts[j]) / float(merged.probabilities[j]), want, rel_tol=1e-12)
    with pytest.raises(TypeError, match="distinct must be a bool"):
        leverage_centers(x, 10, k, 1e-3, scores=scores, distinct=None)
    y = torch.sin(3 * x[:, 0])
    kw = dict(kernel=k, num_centers=60, penalty=1e-3, center_selection="leverage", seed=2)
    apart_gp = FalkonGP(x, y, leverage_options={"distinct": False}, **kw)
    assert torch.unique(apart_gp.centers, dim=0).shape[0] < apart_gp.centers.shape[0]
    gp = FalkonGP(x, y, **kw)
    assert torch.unique(gp.centers, dim=0).shape[0] == gp.centers.shape[0]
