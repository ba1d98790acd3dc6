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
@pytest.mark.parametrize("m", [1, 2, 7, 300])
def test_upper_gram_matches_the_dense_product(dtype, m, monkeypatch):
    """upper_gram(U) = U U^T (LAPACK lauum on the CPU) against float64 matmul; U is left untouched."""
    import gpfalkon.linalg.gram as gram
    from gpfalkon.linalg import upper_gram

    monkeypatch.setattr(gram, "LAUUM_MIN_SIZE", 1)  # the lauum path at these small sizes too

    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, m, generator=g, dtype=torch.float64)
    u = torch.linalg.cholesky(a @ a.T / m + torch.eye(m, dtype=torch.float64), upper=True).to(dtype)
    before = u.clone()
    threadpoolctl = pytest.importorskip("threadpoolctl")
    pytest.importorskip("scipy.linalg.lapack")  # loaded before the thread counts are read
    blas_threads = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    out = upper_gram(u)
    # lauum runs on one BLAS thread; the process's BLAS thread counts are restored afterwards
    assert [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"] == blas_threads
    ref = u.double() @ u.double().T
    assert out.dtype == dtype and out.shape == (m, m)
    torch.testing.assert_close(out.double(), ref, rtol=1e-12 if dtype == torch.float64 else 2e-6,
                               atol=1e-12 if dtype == torch.float64 else 2e-6)
    assert torch.equal(out, out.T)  # exactly symmetric
    assert torch.equal(u, before)
    # a non-contiguous view gives the same
    torch.testing.assert_close(upper_gram(u.T.contiguous().T), out)
    with pytest.raises(ValueError, match="square"):
        upper_gram(u[:, :0] if m > 1 else torch.zeros(2, 3, dtype=dtype))
