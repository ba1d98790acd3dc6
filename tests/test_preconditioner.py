"""FalkonPreconditioner: the identities of docs/math.md §3, robust Cholesky."""
from __future__ import annotations

import pytest
import torch

from gpfalkon import FalkonPreconditioner, JitterWarning, NotPSDError
from gpfalkon.linalg import jittered_cholesky

from conftest import dense_kernel, make_data, make_kernel


def _setup(m=15, d=3, weights=False):
    x, _ = make_data(m, d, seed=4)
    k = make_kernel("rbf", d)
    kmm = dense_kernel(k, x, x).detach()
    w = torch.rand(m, dtype=torch.float64) + 0.5 if weights else None
    return kmm, w


@pytest.mark.parametrize("weights", [False, True])
def test_bbt_is_the_nystrom_inverse(weights):
    """B B^T = ((n/M) K' D^2 K' + n lam K')^{-1} with K' the jittered K_MM (exact identity)."""
    kmm, w = _setup(weights=weights)
    m, n, lam = kmm.shape[0], 1000, 1e-3
    P = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=w)
    d = torch.ones(m, dtype=torch.float64) if w is None else w
    D = torch.diag(d)
    # T^T T = D K D + j I exactly, so K' = K + j D^{-2}
    TtT = P.chol_t.T @ P.chol_t
    j = float((TtT - D @ kmm @ D).diagonal().mean())
    kp = kmm + j * torch.diag(d**-2)
    expected = torch.linalg.inv((n / m) * kp @ D @ D @ kp + n * lam * kp)
    B = P.to_dense()
    torch.testing.assert_close(B @ B.T, expected, rtol=1e-6, atol=1e-8)
    eye = torch.eye(m, dtype=torch.float64)
    torch.testing.assert_close(P.apply_bbt(eye), expected, rtol=1e-6, atol=1e-8)
    # B^{-1} B = I, B^T matches the transpose, the diagonal matches
    torch.testing.assert_close(P.apply_b_inv(P.apply_b(eye)), eye, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(P.mT.to_dense(), B.T)
    torch.testing.assert_close(P.diagonal(), B.diagonal())
    # dense definition B = n^{-1/2} D T^{-1} A^{-1}
    ref = D @ torch.linalg.inv(P.chol_t) @ torch.linalg.inv(P.chol_a) / n**0.5
    torch.testing.assert_close(B, ref, rtol=1e-8, atol=1e-10)


def test_bbt_matches_math_md_without_jitter():
    """As eps -> 0: B B^T = ((n/M) K D^2 K + n lam K)^{-1} (well-conditioned K)."""
    m, n, lam = 6, 50, 1e-2
    a = torch.randn(m, m, dtype=torch.float64)
    kmm = a @ a.T + m * torch.eye(m, dtype=torch.float64)
    w = torch.rand(m, dtype=torch.float64) + 0.5
    P = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=w, jitter=0.0)
    D2 = torch.diag(w**2)
    expected = torch.linalg.inv((n / m) * kmm @ D2 @ kmm + n * lam * kmm)
    B = P.to_dense()
    torch.testing.assert_close(B @ B.T, expected, rtol=1e-8, atol=1e-10)


def test_duplicate_centers_warn_and_escalate():
    x, _ = make_data(10, 2)
    c = torch.cat([x, x[:3]])  # exact duplicates: K_MM is singular
    kmm = dense_kernel(make_kernel("rbf", 2), c, c)
    kmm = kmm - 1e-9 * torch.eye(13, dtype=torch.float64)  # push it just below PSD
    with pytest.warns(JitterWarning, match="numerically singular"):
        P = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 100)
    assert torch.isfinite(P.to_dense()).all()


def test_not_psd_raises():
    kmm = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
    with pytest.raises(NotPSDError, match="K_MM is not positive semi-definite"):
        FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 100)
    with pytest.raises(ValueError, match="NaN"):
        jittered_cholesky(torch.full((2, 2), float("nan")))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_cholesky_names_a_non_finite_entry_and_accepts_a_sum_that_overflows(bad):
    from gpfalkon._validation import all_finite

    a = torch.eye(3, dtype=torch.float64)
    a[2, 0] = a[0, 2] = bad
    with pytest.raises(ValueError, match="K_MM contains NaN or Inf"):
        jittered_cholesky(a)
    big = torch.full((3, 3), 1e308, dtype=torch.float64)  # finite entries whose sum overflows to inf
    assert torch.isinf(big.sum()) and all_finite(big)
    assert not all_finite(torch.tensor([1.0, bad, -bad], dtype=torch.float64))
    L, _ = jittered_cholesky(1e300 * torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(L, 1e150 * torch.eye(3, dtype=torch.float64))


def test_cholesky_float32_input_is_factored_in_float64():
    kmm, _ = _setup()
    L, _j = jittered_cholesky(kmm.float(), upper=False)
    assert L.dtype == torch.float64
    P = FalkonPreconditioner.from_kernel_matrix(kmm.float(), 1e-3, 10, dtype=torch.float32)
    assert P.chol_t.dtype == torch.float32


def test_bad_arguments():
    kmm, _ = _setup(m=4)
    with pytest.raises(ValueError, match="penalty"):
        FalkonPreconditioner.from_kernel_matrix(kmm, 0.0, 10)
    with pytest.raises(ValueError, match="weights"):
        FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 10, weights=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="weights"):
        FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 10, weights=-torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 7, 300, 601])
def test_upper_gram_matches_the_dense_product(dtype, m, monkeypatch):
    """upper_gram(U) = U U^T (blocked, skipping U's zero triangle) against float64 matmul, exactly symmetric;
    U is left untouched. 601 rows with 128-row blocks: a ragged last block and off-diagonal blocks."""
    import gpfalkon.linalg.gram as gram
    from gpfalkon.linalg import upper_gram

    monkeypatch.setattr(gram, "GRAM_MIN_BLOCK", 128)  # several blocks at these sizes
    assert gram.gram_block(m) == max(128, -(-m // 16))

    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, m, generator=g, dtype=torch.float64)
    u = torch.linalg.cholesky(a @ a.T / m + torch.eye(m, dtype=torch.float64), upper=True).to(dtype)
    before = u.clone()
    out = upper_gram(u)
    ref = u.double() @ u.double().T
    assert out.dtype == dtype and out.shape == (m, m)
    torch.testing.assert_close(out.double(), ref, rtol=1e-12 if dtype == torch.float64 else 2e-6,
                               atol=1e-12 if dtype == torch.float64 else 2e-6)
    assert torch.equal(out, out.T)  # exactly symmetric
    assert torch.equal(u, before)
    # a non-contiguous view gives the same
    torch.testing.assert_close(upper_gram(u.T.contiguous().T), out)
    # with U requiring grad: U @ U^T, differentiable (gradient of sum(G) = 2 * 1 1^T U)
    ug = u.double().clone().requires_grad_(True)
    upper_gram(ug).sum().backward()
    torch.testing.assert_close(ug.grad, 2.0 * torch.ones(m, m, dtype=torch.float64) @ u.double())
    with pytest.raises(ValueError, match="square"):
        upper_gram(u[:, :0] if m > 1 else torch.zeros(2, 3, dtype=dtype))


@pytest.mark.parametrize("m", [1, 7, 300, 601])
@pytest.mark.parametrize("transpose", [False, True])
def test_upper_matmul_reads_only_the_upper_triangle(m, transpose, monkeypatch):
    """upper_matmul(U, x) = triu(U) x (or triu(U)^T x) against the dense product, for a U whose strict lower
    triangle holds garbage (never read), with 128-row blocks (ragged last block); U and x left untouched."""
    import gpfalkon.linalg.gram as gram
    from gpfalkon.linalg import upper_matmul

    monkeypatch.setattr(gram, "GRAM_MIN_BLOCK", 128)
    g = torch.Generator().manual_seed(m + 3)
    u = torch.randn(m, m, generator=g, dtype=torch.float64)
    x = torch.randn(m, 3, generator=g, dtype=torch.float64)
    before_u, before_x = u.clone(), x.clone()
    ref = (u.triu().T if transpose else u.triu()) @ x
    torch.testing.assert_close(upper_matmul(u, x, transpose=transpose), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(u, before_u) and torch.equal(x, before_x)
    with pytest.raises(ValueError, match="u must be"):
        upper_matmul(u, x[:-1] if m > 1 else torch.zeros(2, 1, dtype=torch.float64))


@pytest.mark.parametrize("weights", [False, True])
def test_factor_cache_reuses_the_penalty_free_factor_bit_for_bit(weights, monkeypatch):
    """FactorCache: a penalty sweep at one K_MM factors K_MM once (counted by wrapping the Cholesky of
    K_MM), and every preconditioner equals a fresh from_kernel_matrix build exactly; another K_MM, other
    weights or another jitter is a miss; a non-positive penalty is refused before any work."""
    import gpfalkon.operators.preconditioner as pm
    from gpfalkon import FactorCache

    kmm, w = _setup(m=40, weights=weights)
    n = 500
    calls: list[str] = []
    real = pm.jittered_cholesky

    def counting(a, **kw):
        calls.append(kw.get("name", "K_MM"))
        return real(a, **kw)

    monkeypatch.setattr(pm, "jittered_cholesky", counting)
    cache = FactorCache()
    for lam in (1e-2, 1e-4, 3e-7):
        got = cache(kmm, lam, n, weights=w)
        ref = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=w)
        for a, b in ((got.chol_t, ref.chol_t), (got.chol_a, ref.chol_a), (got.weights, ref.weights)):
            assert torch.equal(a, b)
        eye = torch.eye(40, dtype=torch.float64)
        assert torch.equal(got.apply_b(eye), ref.apply_b(eye))
    # 3 cached builds + 3 fresh ones: K_MM factored 1 + 3 times, T T^T / M + lam I 3 + 3 times
    assert calls.count("K_MM") == 4 and calls.count("T T^T / M + lambda I") == 6
    assert (cache.hits, cache.misses) == (2, 1)
    # a different K_MM (one entry changed, symmetric), other weights, another jitter: misses
    other = kmm.clone()
    other[3, 5] = other[5, 3] = other[3, 5] * 0.999
    cache(other, 1e-3, n, weights=w)
    cache(other, 1e-3, n, weights=torch.full((40,), 0.7, dtype=torch.float64))
    cache(other, 1e-3, n, weights=torch.full((40,), 0.7, dtype=torch.float64), jitter=1e-6)
    assert (cache.hits, cache.misses) == (2, 4)
    # the factor of `other` with the jitter: equal to a fresh one
    ref = FalkonPreconditioner.from_kernel_matrix(other, 1e-3, n, weights=torch.full((40,), 0.7, dtype=torch.float64),
                                                  jitter=1e-6)
    got = cache(other, 1e-3, n, weights=torch.full((40,), 0.7, dtype=torch.float64), jitter=1e-6)
    assert torch.equal(got.chol_t, ref.chol_t) and torch.equal(got.chol_a, ref.chol_a)
    assert cache.hits == 3
    before = len(calls)
    with pytest.raises(ValueError, match="penalty"):
        cache(other, 0.0, n)
    assert len(calls) == before
    cache.clear()
    cache(other, 1e-3, n, weights=torch.full((40,), 0.7, dtype=torch.float64), jitter=1e-6)
    assert cache.misses == 5


def test_factor_cache_as_the_builder_of_a_penalty_sweep():
    """FalkonGP fits through FalkonOptions(preconditioner=FactorCache()) at several penalties: each alpha equals
    the default builder's (the preconditioner is the same, bit for bit) and matches the dense solve."""
    from gpfalkon import FactorCache, FalkonGP, FalkonOptions

    x, y = make_data(300, 3, seed=2)
    k = make_kernel("rbf", 3)
    c = x[:30].clone()
    cache = FactorCache()
    knm = dense_kernel(k, x, c).detach()
    kmm = dense_kernel(k, c, c).detach()
    for lam in (1e-2, 1e-3, 1e-4):
        a = FalkonGP(x, y, kernel=k, centers=c, penalty=lam, tol=1e-10, max_iter=500,
                     options=FalkonOptions(preconditioner=cache, solve_method="cg")).fit()
        b = FalkonGP(x, y, kernel=k, centers=c, penalty=lam, tol=1e-10, max_iter=500,
                     options=FalkonOptions(solve_method="cg")).fit()
        assert torch.equal(a.alpha, b.alpha)
        yc = a.centered_targets().detach().reshape(300, 1)
        dense = torch.linalg.solve(knm.T @ knm + 300 * lam * kmm, knm.T @ yc)
        torch.testing.assert_close(a.alpha.reshape(dense.shape), dense, rtol=1e-6, atol=1e-8)
    assert cache.hits == 2 and cache.misses == 1


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("jitter", [None, 1e-4])
def test_w_matmul_is_bt_h_b_without_kmm(weights, jitter):
    """w_matmul(u) = B^T (G + c K_MM) B u against the dense product (G any PSD stand-in for K_Mn K_nM),
    with K_MM never passed: it comes from T^T T - j I; the recorded jitter is the one T was built with."""
    kmm, w = _setup(m=30, weights=weights)
    m, n, lam = 30, 700, 1e-3
    P = FalkonPreconditioner.from_kernel_matrix(kmm, lam, n, weights=w, jitter=jitter)
    d = torch.ones(m, dtype=torch.float64) if w is None else w
    assert P.jitter == pytest.approx(float((P.chol_t.T @ P.chol_t - torch.diag(d) @ kmm @ torch.diag(d))
                                           .diagonal().mean()), rel=1e-6, abs=1e-14)
    if jitter is not None:
        assert P.jitter == jitter
    g = torch.Generator().manual_seed(1)
    knm = torch.rand(120, m, generator=g, dtype=torch.float64)
    gram = knm.T @ knm
    c = n * lam
    B = P.to_dense()
    u = torch.randn(m, 3, generator=g, dtype=torch.float64)
    expected = B.T @ (gram + c * kmm) @ B @ u
    got = P.w_matmul(u, lambda v: gram @ v, c)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert P.reproduces(kmm)
    # the transpose keeps the jitter, but W is defined for B
    assert P.mT.jitter == P.jitter
    with pytest.raises(ValueError, match="transpose"):
        P.mT.w_matmul(u, lambda v: gram @ v, c)


def test_reproduces_refuses_other_matrices_and_low_precision():
    """reproduces: False for a K_MM the factor was not built from (one entry changed by 1e-6 relative, or
    another lengthscale), for float32 factors and for an unknown jitter; a negative or NaN jitter is refused."""
    kmm, w = _setup(m=25, weights=True)
    P = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 100, weights=w)
    assert P.reproduces(kmm)
    other = kmm.clone()
    other[2, 7] = other[7, 2] = other[2, 7] * (1 + 1e-6)
    assert not P.reproduces(other)
    x, _ = make_data(25, 3, seed=4)
    k2 = make_kernel("rbf", 3)
    k2.lengthscale = k2.lengthscale * 1.01
    assert not P.reproduces(dense_kernel(k2, x, x).detach())
    assert not P.reproduces(kmm[:24, :24])
    P32 = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 100, weights=w, dtype=torch.float32)
    assert not P32.reproduces(kmm)
    unknown = FalkonPreconditioner(P.chol_t, P.chol_a, P.weights, n=100)
    assert unknown.jitter is None and not unknown.reproduces(kmm)
    with pytest.raises(ValueError, match="jitter"):
        unknown.w_matmul(torch.ones(25, 1, dtype=torch.float64), lambda v: v, 1.0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="jitter"):
            FalkonPreconditioner(P.chol_t, P.chol_a, P.weights, n=100, jitter=bad)


def test_falkon_solve_split_arguments_are_checked():
    """falkon_solve: data_matmul without kmm_weight, or with a preconditioner that has no w_matmul, is refused."""
    from gpfalkon import falkon_solve

    kmm, _ = _setup(m=10)
    P = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-2, 50)
    rhs = torch.ones(10, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="kmm_weight"):
        falkon_solve(lambda v: kmm @ v, P, rhs, tol=1e-8, max_iter=5, data_matmul=lambda v: v)

    class Plain:
        apply_b = P.apply_b
        apply_bt = P.apply_bt
        apply_b_inv = P.apply_b_inv

    with pytest.raises(ValueError, match="w_matmul"):
        falkon_solve(lambda v: kmm @ v, Plain(), rhs, tol=1e-8, max_iter=5, data_matmul=lambda v: v, kmm_weight=1.0)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_cholesky_with_shift_matches_the_dense_factor_of_the_shifted_matrix(upper, layout):
    """``shift`` factors ``a + (shift + j) I`` without touching ``a``; the factor is triangular with
    exact zeros and equals torch's dense Cholesky of the shifted matrix, whatever ``a``'s layout."""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(40, 40, generator=g, dtype=torch.float64)
    a = b @ b.mT / 40
    a = a if layout == "row-major" else a.mT.contiguous().mT  # same values, column-major strides
    keep = a.clone()
    factor, j = jittered_cholesky(a, upper=upper, shift=0.25, jitter=1e-9)
    assert j == 1e-9 and torch.equal(a, keep)
    dense = torch.linalg.cholesky(keep + (0.25 + 1e-9) * torch.eye(40, dtype=torch.float64), upper=upper)
    torch.testing.assert_close(factor, dense, rtol=1e-12, atol=1e-13)
    other = factor.tril(-1) if upper else factor.triu(1)
    assert torch.count_nonzero(other) == 0
    # the jitter's scale includes the shift: a zero matrix shifted by 1 factors at once, jitter eps * M
    eye_factor, j0 = jittered_cholesky(torch.zeros(5, 5, dtype=torch.float64), shift=1.0)
    assert j0 == pytest.approx(torch.finfo(torch.float64).eps * 5)
    torch.testing.assert_close(eye_factor, (1.0 + j0) ** 0.5 * torch.eye(5, dtype=torch.float64))


def test_cholesky_in_place_with_refill_equals_the_copy_and_refills_before_each_retry():
    """``refill=`` factors ``a`` itself (the returned factor is ``a``'s memory, no work matrix) and, where
    the first jitter fails, writes ``a`` back through ``refill`` before each retry: the same factor, jitter
    and warning as the copying path; a matrix it cannot factor in place is refused by name."""
    g = torch.Generator().manual_seed(5)
    b = torch.randn(30, 4, generator=g, dtype=torch.float64)
    singular = b @ b.mT - 1e-11 * torch.eye(30, dtype=torch.float64)  # 26 eigenvalues at -1e-11: the first
    # jitter (eps M x mean diagonal, ~3e-14) fails, escalation follows
    with pytest.warns(JitterWarning):
        ref, j_ref = jittered_cholesky(singular, upper=True)
    calls = []

    def refill(buf):
        calls.append(1)
        buf.copy_(singular)

    a = singular.clone()
    with pytest.warns(JitterWarning):
        got, j = jittered_cholesky(a, upper=True, refill=refill)
    assert j == j_ref and got.data_ptr() == a.data_ptr() and len(calls) >= 1
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # a matrix that factors at once: no refill, the factor in place
    pd = b @ b.mT + torch.eye(30, dtype=torch.float64)
    a, calls = pd.clone(), []
    got, _ = jittered_cholesky(a, upper=False, refill=refill)
    assert not calls and got.data_ptr() == a.data_ptr()
    torch.testing.assert_close(got @ got.mT, pd, rtol=1e-12, atol=1e-12)
    for bad in (pd.float(), pd.mT):  # float32 (a copy would be factored), column-major strides
        with pytest.raises(ValueError, match="refill= factors in place"):
            jittered_cholesky(bad, refill=refill)


@pytest.mark.parametrize("weights", [False, True])
def test_from_kernel_matrix_factors_a_in_the_grams_memory_and_matches_the_reusable_path(weights):
    """from_kernel_matrix builds ``A`` in the factor's ``T T^T / M`` (one ``M x M`` less at its peak) and
    gives exactly the preconditioner of ``from_factor`` on a kept factor, which is left untouched."""
    kmm, w = _setup(m=40, weights=weights)
    factor = FalkonPreconditioner.factor_kernel_matrix(kmm, w)
    keep = factor.gram.clone()
    kept = FalkonPreconditioner.from_factor(factor, 1e-3, 500)
    assert torch.equal(factor.gram, keep)
    once = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-3, 500, weights=w)
    torch.testing.assert_close(once.chol_a, kept.chol_a, rtol=0, atol=0)
    torch.testing.assert_close(once.chol_t, kept.chol_t, rtol=0, atol=0)
    consumed = FalkonPreconditioner.from_factor(factor, 1e-3, 500, overwrite_factor=True)
    assert consumed.chol_a.data_ptr() == factor.gram.data_ptr()
    torch.testing.assert_close(consumed.chol_a, kept.chol_a, rtol=0, atol=0)


def test_upper_gram_writes_into_out_and_checks_it():
    from gpfalkon.linalg import upper_gram

    u = torch.randn(300, 300, dtype=torch.float64).triu()
    out = torch.full((300, 300), float("nan"), dtype=torch.float64)
    assert upper_gram(u, out=out) is out
    torch.testing.assert_close(out, u @ u.mT, rtol=1e-12, atol=1e-10)
    with pytest.raises(ValueError, match="out must be a 300 x 300"):
        upper_gram(u, out=out.float())
    with pytest.raises(ValueError, match="out must not share memory with u"):
        upper_gram(u, out=u)
