"""The fused single-read stored-K product (gpfalkon.backend.fused) against dense products."""
from __future__ import annotations

import pytest
import torch

from gpfalkon import KernelEngine
from gpfalkon.backend import fused

from conftest import dense_kernel, make_data, make_kernel


def _need_kernel() -> None:
    ok, why = fused.fused_available()
    if not ok:
        pytest.skip(f"fused kernel unavailable: {why}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "wide"])
@pytest.mark.parametrize("k", [1, 3, 5, fused.MAX_K])
@pytest.mark.parametrize("rows", [1, 7, fused.FLUSH_ROWS + 3, 3 * fused.FLUSH_ROWS + 17])
def test_fused_matches_dense(dtype, k, rows):
    """``acc += (u^T K^T + v^T) K`` for every mix of u / v, row counts across the flush boundary, a v
    that is a column slice (leading dimension larger than its rows), and an accumulator that already
    holds a value (the kernel adds). ``"wide"``: a float32 ``K`` with float64 vectors, whose products are the
    float64 products of ``K``'s float32 values (settings.wide_products)."""
    _need_kernel()
    g = torch.Generator().manual_seed(rows * 31 + k)
    m = 29
    knm = torch.rand(rows, m, generator=g, dtype=torch.float64)
    if dtype == "wide":
        knm = knm.float().double()  # the values a float32 store holds
    u = torch.randn(k, m, generator=g, dtype=torch.float64)
    v_full = torch.randn(k, rows + 11, generator=g, dtype=torch.float64)
    v = v_full[:, 5 : 5 + rows]  # stride (rows + 11, 1)
    start = torch.randn(k, m, generator=g, dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    k_dtype, vec_dtype = (torch.float32, torch.float64) if dtype == "wide" else (dtype, dtype)
    for uu, vv in ((u, v), (u, None), (None, v)):
        want = start + (0 if uu is None else (uu @ knm.T) @ knm) + (0 if vv is None else vv @ knm)
        acc = start.clone()
        ran = fused.fused_kmn_k(acc, knm.to(k_dtype), None if uu is None else uu.to(vec_dtype),
                                None if vv is None else vv.to(vec_dtype))
        assert ran
        torch.testing.assert_close(acc, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_fused_declines_what_it_does_not_handle():
    """Cases outside the kernel leave acc untouched and return False (the engine's own path runs)."""
    _need_kernel()
    knm = torch.rand(10, 4, dtype=torch.float64)
    u = torch.randn(1, 4, dtype=torch.float64)
    acc = torch.zeros(1, 4, dtype=torch.float64)
    assert not fused.fused_kmn_k(acc, knm.t().contiguous().t(), u, None)  # not row-major
    assert not fused.fused_kmn_k(acc, knm.to(torch.float16), u.half(), None)
    big = torch.zeros(fused.MAX_K + 1, 4, dtype=torch.float64)
    assert not fused.fused_kmn_k(big, knm, torch.randn(fused.MAX_K + 1, 4, dtype=torch.float64), None)
    assert not fused.fused_kmn_k(acc.float(), knm, u, None)  # the accumulator must be float64
    assert torch.equal(acc, torch.zeros(1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs u_t or v_t"):
        fused.fused_kmn_k(acc, knm, None, None)
    with pytest.raises(RuntimeError, match="u must have K's dtype"):
        fused.fused_kmn_k(acc, knm, u.float(), None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_engine_stored_products_with_and_without_the_kernel(dtype, monkeypatch):
    """A stored K_nM's products (CG's K^T (K u), the right-hand side K^T y) equal the dense ones with
    the fused kernel, and equal the engine's batched path without it."""
    _need_kernel()
    x, _ = make_data(1500, 6)
    c = x[:70] + 0.01
    kern = make_kernel("scale_rbf", 6)
    knm = dense_kernel(kern, x, c)
    u = torch.randn(70, 2, dtype=torch.float64)
    v = torch.randn(1500, 2, dtype=torch.float64)
    e = KernelEngine(kern, x.to(dtype), c.to(dtype), store=True)
    e.kmn_k(u)  # the first pass computes and stores K_nM
    assert e._k is not None
    calls = []
    real = fused.fused_kmn_k

    def counting(*args):
        calls.append(1)
        return real(*args)

    import gpfalkon.backend.engine as engine_module

    monkeypatch.setattr(engine_module, "fused_kmn_k", counting)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    got = {}
    for enabled in (True, False):
        fused.set_enabled(enabled)
        try:
            got[enabled] = [e.kmn_k(u, v), e.kmn_k(u[:, :1]), e.kmn_k(None, v)]
        finally:
            fused.set_enabled(None)
    assert len(calls) == 6  # every product of the stored matrix went through the fused entry point
    for out, want in zip(got[True], [knm.T @ (knm @ u + v), knm.T @ (knm @ u[:, :1]), knm.T @ v], strict=False):
        torch.testing.assert_close(out, want, rtol=tol, atol=tol * float(want.abs().max()))
    for a, b in zip(got[True], got[False], strict=False):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv("GPFALKON_FUSED_CPU", "0")
    ok, why = fused.fused_available()
    assert not ok and "turned off" in why
    acc = torch.zeros(1, 3, dtype=torch.float64)
    assert not fused.fused_kmn_k(acc, torch.ones(4, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                                 None)
    with pytest.raises(TypeError, match="enabled"):
        fused.set_enabled("yes")  # type: ignore[arg-type]


def _fresh_state(monkeypatch) -> None:
    monkeypatch.setattr(fused, "_state", {"module": None, "error": None, "tried": False, "enabled": True})


def test_a_built_kernel_is_imported_without_the_compiler(monkeypatch):
    """Once built, a new process imports the module from the build directory: load_inline (ninja,
    the compiler, torch's build lock) is not called again."""
    _need_kernel()
    import torch.utils.cpp_extension as ext

    def no_build(*a, **k):
        raise AssertionError("load_inline called for a built kernel")

    _fresh_state(monkeypatch)
    monkeypatch.setattr(ext, "load_inline", no_build)
    assert fused.fused_available() == (True, "")
    acc = torch.zeros(1, 3, dtype=torch.float64)
    knm = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    u = torch.ones(1, 3, dtype=torch.float64)
    assert fused.fused_kmn_k(acc, knm, u, None)
    torch.testing.assert_close(acc, (u @ knm.T) @ knm)


def test_a_build_lock_is_not_waited_on(monkeypatch, tmp_path):
    """A lock left in the build directory (another process building, or one that died building) makes
    this process keep the torch path at once, never wait; a lock older than the stale limit is removed
    and the build goes ahead."""
    import os
    import time

    import torch.utils.cpp_extension as ext

    calls = []
    monkeypatch.setattr(ext, "load_inline", lambda **kw: calls.append(kw) or "module")
    monkeypatch.setattr(fused, "_build_directory", lambda name: str(tmp_path / name))
    name = f"gpfalkon_fused_{fused._cpu_tag()}"
    (tmp_path / name).mkdir()
    lock = tmp_path / name / "lock"
    lock.touch()
    _fresh_state(monkeypatch)
    t0 = time.perf_counter()
    ok, why = fused.fused_available()
    assert not ok and "another process is building it" in why and time.perf_counter() - t0 < 5
    assert calls == []
    old = time.time() - fused._STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    _fresh_state(monkeypatch)
    assert fused.fused_available() == (True, "")
    assert not lock.exists() and len(calls) == 1 and calls[0]["build_directory"] == str(tmp_path / name)


def test_build_directory_is_torchs_extension_root_without_importing_cpp_extension():
    """The build directory is ``get_default_build_root()/gpfalkon/<name>`` as torch computes it, and a process
    that finds the kernel built loads it without importing ``torch.utils.cpp_extension`` (0.2 s of a first
    fit, with the setuptools it imports)."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    assert fused._build_directory("abc") == os.path.join(get_default_build_root(), "gpfalkon", "abc")
    _need_kernel()  # built (or loaded) in this process: a fresh one now finds it built
    code = ("import sys; from gpfalkon.backend import fused; ok, why = fused.fused_available(); "
            "print(ok, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["rbf", "matern12", "matern32", "scale_matern52"])
@pytest.mark.parametrize("store", [False, None, True])
def test_engine_on_the_fly_products_with_and_without_the_kernel(dtype, kind, store, monkeypatch):
    """The rows not stored go through the fused on-the-fly kernel (tiles of a few rows here, so that
    the threads share many), and the first pass computes a store (whole or part of K_nM) with it:
    equal to the dense products and kernel values, and to the engine's torch path; wider
    right-hand sides than MAX_K take the torch path; grad mode is left as it was."""
    _need_kernel()
    n, m = 1203, 37
    x, _ = make_data(n, 5)
    c = x[:m] + 0.01
    kern = make_kernel(kind, 5)
    knm = dense_kernel(kern, x, c)
    u = torch.randn(m, 3, dtype=torch.float64)
    v = torch.randn(n, 3, dtype=torch.float64)
    wide = torch.randn(m, fused.MAX_K + 1, dtype=torch.float64)
    itemsize = torch.finfo(dtype).bits // 8
    budget = None if store is not None else 500 * m * itemsize + 2 * 64 * m * itemsize  # ~500 rows stored
    e = KernelEngine(kern, x.to(dtype), c.to(dtype), store=store, block_rows=64, memory_budget=budget)
    if store is None:
        assert 0 < e.stored_rows < n
    import gpfalkon.backend.engine as engine_module

    calls = []
    real = fused.fused_fly_kmn_k

    def counting(acc, xa, *args, **kwargs):  # the calls in which the kernel ran, by their rows
        ran = real(acc, xa, *args, **kwargs)
        if ran:
            calls.append(xa.shape[0])
        return ran

    monkeypatch.setattr(engine_module, "fused_fly_kmn_k", counting)
    monkeypatch.setattr(fused, "FLY_TILE_BYTES", 9 * m * itemsize)  # 8-row tiles: ~120 of them
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    first = e.kmn_k(u)  # a store (whole or part) is filled by this pass, with the kernel too
    head = e.stored_rows
    assert calls == ([n] if store is False else [head] if store else [head, n - head])
    if head:
        torch.testing.assert_close(e.materialize()[:head].double(), knm[:head], rtol=tol, atol=tol)
    got = {}
    for enabled in (True, False):
        fused.set_enabled(enabled)
        try:
            got[enabled] = [e.kmn_k(u, v), e.kmn_k(u[:, :1]), e.kmn_k(None, v), e.kmn_k(wide)]
        finally:
            fused.set_enabled(None)
    assert torch.is_grad_enabled()
    # later passes: the rows not stored through the kernel (3 products within MAX_K columns, kernel on)
    assert calls[len([n] if store is False else [head] if store else [head, n - head]):] == (
        [] if store else [n - head] * 3)
    wants = [knm.T @ (knm @ u + v), knm.T @ (knm @ u[:, :1]), knm.T @ v, knm.T @ (knm @ wide)]
    torch.testing.assert_close(first, wants[0] - knm.T @ v, rtol=tol, atol=tol * float(wants[0].abs().max()))
    for out, want in zip(got[True], wants, strict=True):
        torch.testing.assert_close(out, want, rtol=tol, atol=tol * float(want.abs().max()))
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


@pytest.mark.parametrize("kind", ["rbf", "matern32"])
def test_first_pass_of_a_wide_store_takes_float64_products_of_its_values(kind):
    """With float32 data and a stored K_nM (settings.wide_products on), the first pass fills the store and its
    products (``K_Mn y``, the first CG product) are the float64 products of the stored float32 values, as every
    later pass's are: the same to float64 round-off, not float32's."""
    _need_kernel()
    n, m = 1203, 37
    x, _ = make_data(n, 5)
    c = x[:m] + 0.01
    kern = make_kernel(kind, 5)
    u = torch.randn(m, 2, dtype=torch.float64)
    v = torch.randn(n, 2, dtype=torch.float64)
    e = KernelEngine(kern, x.float(), c.float(), store=True)
    assert e.wide
    first = e.kmn_k(u, v)
    ks = e.materialize().double()  # the float32 values the store holds
    want = ks.T @ (ks @ u + v)
    torch.testing.assert_close(first, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    torch.testing.assert_close(e.kmn_k(u, v), want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def test_fused_fly_declines_what_it_does_not_handle():
    acc = torch.zeros(1, 4, dtype=torch.float64)
    xa, ca = torch.randn(5, 3), torch.randn(3, 4)
    u = torch.randn(1, 4)
    assert not fused.fused_fly_kmn_k(acc, xa, ca.double(), u, None, "rbf", 0.0, 4)  # mixed dtypes
    assert not fused.fused_fly_kmn_k(acc, xa, ca, u, None, "periodic", 0.0, 4)  # no profile
    assert not fused.fused_fly_kmn_k(torch.zeros(fused.MAX_K + 1, 4, dtype=torch.float64), xa, ca,
                                     torch.randn(fused.MAX_K + 1, 4), None, "rbf", 0.0, 4)
    assert not fused.fused_fly_kmn_k(acc, xa.to(torch.float16), ca.to(torch.float16), u.half(), None, "rbf",
                                     0.0, 4)
    with pytest.raises(ValueError, match="u_t or v_t"):
        _need_kernel()
        fused.fused_fly_kmn_k(acc, xa, ca, None, None, "rbf", 0.0, 4)
    assert torch.equal(acc, torch.zeros(1, 4, dtype=torch.float64))
    assert fused.fly_tile_rows(2000, 4) == 2 * 2**20 // 8000 // 4 * 4
    assert fused.fly_tile_rows(10**9, 8) == 4 and fused.fly_tile_rows(2000, 4, cap=3) == 3


def _profile_closed_form(kind: str, t: torch.Tensor, zero_below: float) -> torch.Tensor:
    """phi(t) in float64 from the definitions (math.exp2 / math.sqrt per value, no shared code)."""
    import math

    out = []
    for v in t.tolist():
        z = math.sqrt(0.0 if v <= zero_below else v)  # z' = z log2 e
        e = math.pow(2.0, -z)
        zz = z * math.log(2.0)
        out.append({"matern12": e, "matern32": (1 + zz) * e, "matern52": ((zz + 1.5) ** 2 + 0.75) * e}[kind])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["matern12", "matern32", "matern52"])
def test_fused_profile_matches_the_closed_form_and_aten(dtype, kind):
    """fused_profile_ against phi computed value by value in float64 (a few ulp of the dtype: its own exp2
    polynomial), and against engine._apply_profile_'s ATen operations (the fused kernels off): zero and
    the values at or below the Matern floor give phi(0) exactly (1, or 3 for Matern-5/2), values far out
    underflow to 0 (at most the dtype's smallest normal away from the closed form), NaN stays NaN, and a
    buffer it does not handle (non-contiguous, requiring grad, the RBF profile) is left alone with False."""
    from gpfalkon.backend.engine import _apply_profile_

    _need_kernel()
    g = torch.Generator().manual_seed(7)
    t = torch.cat([torch.rand(5000, generator=g, dtype=torch.float64) * 40,
                   torch.rand(500, generator=g, dtype=torch.float64) * 1e-6,
                   torch.tensor([0.0, 1e-9, 1e3, 1e5, 5e6, 1e30]),
                   torch.rand(600, generator=g, dtype=torch.float64) * 2e6])
    t = t.to(dtype)
    zero_below = 1e-7
    want = _profile_closed_form(kind, t.double(), zero_below)
    got = t.clone()
    assert fused.fused_profile_(got, kind, zero_below)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    # a few ulp, plus what the rounding of z' = sqrt(t) in the dtype moves 2^-z' by (ln 2 z' eps / 2)
    z = t.double().clamp_min(0).sqrt()
    rel = (8 + z) * eps
    err = (got.double() - want).abs()
    assert bool((err <= rel * want + tiny).all()), float((err / want.clamp_min(tiny)).max())
    phi0 = 3.0 if kind == "matern52" else 1.0
    assert got[5000 + 500] == phi0  # t = 0 exactly
    assert bool((got[5000:5500][t[5000:5500] <= zero_below] == phi0).all())  # at or below the floor: phi(0)
    assert bool(torch.isfinite(got).all())
    fused.set_enabled(False)
    try:
        aten = _apply_profile_(kind, t.clone(), torch.empty_like(t), zero_below)
    finally:
        fused.set_enabled(None)
    assert bool(((got.double() - aten.double()).abs() <= 2 * rel * want + tiny).all())
    # NaN propagates
    nan = torch.tensor([float("nan"), 1.0], dtype=dtype)
    assert fused.fused_profile_(nan, kind, zero_below) and bool(torch.isnan(nan[0]))
    # declined: left alone
    strided = t[::2]
    before = strided.clone()
    assert not fused.fused_profile_(strided, kind, zero_below) and torch.equal(strided, before)
    leaf = t.clone().requires_grad_(True)
    assert not fused.fused_profile_(leaf, kind, zero_below)
    assert not fused.fused_profile_(t.clone(), "periodic", zero_below)
    rbf = -t.abs()
    assert not fused.fused_profile_(rbf, "rbf") and torch.equal(rbf, -t.abs())


# ----------------------------------------------------------------------------- triangular solve
def _upper_factor(m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A well-conditioned upper-triangular factor: the Cholesky factor of an RBF Gram matrix plus I."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 3, generator=g, dtype=torch.float64)
    gram = torch.exp(-0.5 * torch.cdist(x, x).square()) + torch.eye(m, dtype=torch.float64)
    return torch.linalg.cholesky(gram, upper=True).to(dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 3, fused.MAX_SOLVE_K])
@pytest.mark.parametrize("m", [1, 7, fused.SOLVE_BLOCK, fused.SOLVE_BLOCK + 1, 3 * fused.SOLVE_BLOCK + 45, 1100])
def test_upper_solve_matches_lapack(dtype, k, m, monkeypatch):
    """``U^{-1} B`` and ``U^{-T} B`` against ``torch.linalg.solve_triangular`` across the block boundaries,
    with the strictly lower triangle full of NaN (the kernel must not read it) and ``B`` a non-contiguous
    view left unchanged (small factors admitted: ``SOLVE_MIN_M`` lowered; at M = 1,100 both parallel updates are
    split between threads)."""
    _need_kernel()
    monkeypatch.setattr(fused, "SOLVE_MIN_M", {torch.float64: 1, torch.float32: 1})
    u = _upper_factor(m, dtype, m * 7 + k)
    poisoned = u.clone()
    poisoned[torch.ones(m, m, dtype=torch.bool).tril(-1)] = float("nan")
    b_full = torch.randn(k, m + 5, dtype=dtype, generator=torch.Generator().manual_seed(k)).mT  # (m + 5, k)
    b = b_full[2 : 2 + m]
    before = b.clone()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for transpose in (False, True):
        want = torch.linalg.solve_triangular(u.mT if transpose else u, b, upper=not transpose)
        got = fused.upper_solve(poisoned, b, transpose)
        assert got is not None and got.shape == (m, k)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
        assert torch.equal(b, before)


def test_upper_solve_declines_what_it_does_not_handle(monkeypatch):
    """Cases outside the kernel return None (the preconditioner then calls LAPACK)."""
    _need_kernel()
    u = _upper_factor(9, torch.float64, 0)
    b = torch.randn(9, 1, dtype=torch.float64)
    assert fused.upper_solve(u, b) is None  # below SOLVE_MIN_M
    monkeypatch.setattr(fused, "SOLVE_MIN_M", {torch.float64: 9, torch.float32: 10})
    assert fused.upper_solve(u.float(), b.float()) is None  # float32's threshold is 10
    assert fused.upper_solve(u, b) is not None
    assert fused.upper_solve(u, torch.randn(9, fused.MAX_SOLVE_K + 1, dtype=torch.float64)) is None  # k too large
    assert fused.upper_solve(u, b.float()) is None  # dtypes differ
    assert fused.upper_solve(u.half(), b.half()) is None  # float16
    assert fused.upper_solve(u.mT.contiguous().mT, b) is None  # not row-major
    assert fused.upper_solve(u, b.squeeze(1)) is None  # not (M, k)
    assert fused.upper_solve(u, torch.randn(9, 1, dtype=torch.float64, requires_grad=True)) is None
    assert fused.upper_solve(u.requires_grad_(), b) is None
    fused.set_enabled(False)
    try:
        assert fused.upper_solve(u.detach(), b) is None
    finally:
        fused.set_enabled(None)


def test_preconditioner_same_with_and_without_the_solve_kernel(monkeypatch):
    """B, B^T and the CG operator W of a FALKON preconditioner through the kernel equal LAPACK's."""
    _need_kernel()
    import gpfalkon.operators.preconditioner as precond_module
    from gpfalkon import FalkonPreconditioner

    m = fused.SOLVE_MIN_M[torch.float64] + fused.SOLVE_BLOCK // 2 + 9
    x = torch.randn(m, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    kmm = torch.exp(-0.5 * torch.cdist(x, x).square() / 4.0)
    pre = FalkonPreconditioner.from_kernel_matrix(kmm, 1e-4, 1000)
    v = torch.randn(m, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    data = torch.randn(m, m, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    gram = data @ data.mT

    def outputs():
        return (pre.apply_b(v), pre.apply_bt(v), pre.w_matmul(v, lambda w: gram @ w, 1000 * 1e-4))

    ran: list[bool] = []

    def spy(*args, **kwargs):
        out = fused.upper_solve(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(precond_module, "upper_solve", spy)
    fast = outputs()
    assert ran and all(ran)  # every solve went through the kernel
    monkeypatch.setattr(precond_module, "upper_solve", lambda *a, **k: None)
    slow = outputs()
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * float(b.abs().max()))
