"""The blockwise kernel-product engine against dense products."""
from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpfalkon import KernelEngine, settings
from gpfalkon.kernels import kernel_product, stationary_spec

from conftest import dense_kernel, make_data, make_kernel, matern12_near_pairs_case

KERNELS = ["rbf", "matern12", "matern32", "matern52", "scale_rbf", "scale_matern52", "periodic", "rbf+linear"]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("store", [True, False])
def test_product_matches_dense(name, store):
    x, _ = make_data(257, 4)
    c = x[:13] + 0.01
    k = make_kernel(name, 4)
    knm = dense_kernel(k, x, c)
    u = torch.randn(13, 3, dtype=torch.float64)
    v = torch.randn(257, 3, dtype=torch.float64)
    for rows in [1, 7, 64, 256, 257, 1000]:
        e = KernelEngine(k, x, c, block_rows=rows, store=store)
        torch.testing.assert_close(e.kmn_k(u, v), knm.T @ (knm @ u + v), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(e.kmn_k(u), knm.T @ (knm @ u), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(e.kmn_k(None, v), knm.T @ v, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(e.k_matmul(u), knm @ u, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(e.materialize(), knm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e.kmm(), dense_kernel(k, c, c), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_batched_thin_products_match_dense(dtype, store, k, monkeypatch):
    """Blocks that split into ``stored_batch`` (or thread-count) sub-blocks take the batched
    products; the others (tails, odd heights) the 2-D ones: all must equal the dense product.
    (The fused kernel is off here: with it, a stored K_nM never reaches these products.)"""
    from gpfalkon.backend import fused

    monkeypatch.setitem(fused._state, "enabled", False)
    x, _ = make_data(531, 5)
    c = x[:37] + 0.01
    kern = make_kernel("scale_matern52", 5)
    knm = dense_kernel(kern, x, c)
    u = torch.randn(37, k, dtype=torch.float64)
    v = torch.randn(531, k, dtype=torch.float64)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for rows in [8, 16, 24, 40, 64, 80, 531, None]:
        e = KernelEngine(kern, x.to(dtype), c.to(dtype), block_rows=rows, store=store)
        if rows is not None and store:
            assert e.stored_block_rows <= rows
        for batch in (e.stored_batch, 1, 3):
            e.stored_batch = batch
            for got, want in (
                (e.kmn_k(u, v), knm.T @ (knm @ u + v)),
                (e.kmn_k(u), knm.T @ (knm @ u)),
                (e.kmn_k(None, v), knm.T @ v),
            ):
                assert got.dtype == torch.float64 and got.shape == (37, k)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_fast_path_is_taken_only_for_supported_kernels():
    assert stationary_spec(make_kernel("rbf", 3)).kind == "rbf"
    assert stationary_spec(make_kernel("scale_matern52", 3)).kind == "matern52"
    assert stationary_spec(make_kernel("periodic", 3)) is None
    assert stationary_spec(gpytorch.kernels.RBFKernel(active_dims=[0])) is None
    assert stationary_spec(gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2]))) is None


@pytest.mark.parametrize("n,m", [(1, 1), (1, 5), (9, 1), (33, 33)])
def test_edge_sizes(n, m):
    x, _ = make_data(n, 2)
    c = make_data(m, 2, seed=3)[0]
    k = make_kernel("matern32", 2)
    knm = dense_kernel(k, x, c)
    u = torch.randn(m, 2, dtype=torch.float64)
    for rows in [1, 2, 5, 100]:
        e = KernelEngine(k, x, c, block_rows=rows, store=False)
        torch.testing.assert_close(e.kmn_k(u), knm.T @ (knm @ u), rtol=1e-10, atol=1e-12)


def test_memory_budget_decides_storage_and_block_size():
    x, _ = make_data(1000, 3)
    c = x[:50]
    k = make_kernel("rbf", 3)
    assert KernelEngine(k, x, c).stored
    e = KernelEngine(k, x, c, memory_budget=1000 * 50 * 8 - 1)
    assert not e.stored
    assert e.block_rows * 50 * 8 * 2 <= 1000 * 50 * 8
    with settings.memory_budget(10_000):
        e = KernelEngine(k, x, c)
        assert not e.stored and e.block_rows * 50 * 8 * 2 <= 10_000
    with pytest.raises(ValueError, match="store_kernel"):
        KernelEngine(k, x, c, memory_budget=100, store=True)
    with pytest.raises(ValueError, match="block_rows"):
        KernelEngine(k, x, c, block_rows=0)


def test_a_budget_below_one_row_warns_and_still_computes_the_products():
    """A budget smaller than one row of a pass (two live blocks of M + d float64 values) cannot be kept: the
    engine runs one-row blocks and says so (MemoryBudgetWarning), with the same products; a budget of a few
    rows does not warn."""
    from gpfalkon import MemoryBudgetWarning

    x, _ = make_data(200, 3)
    c = x[:50]
    k = make_kernel("rbf", 3)
    u = torch.randn(50, 1, dtype=torch.float64)
    knm = dense_kernel(k, x, c)
    with pytest.warns(MemoryBudgetWarning, match="below one row"):
        e = KernelEngine(k, x, c, memory_budget=2 * (50 + 3) * 8 - 1)
    assert e.block_rows == 1 and not e.stored
    torch.testing.assert_close(e.kmn_k(u), knm.T @ (knm @ u), rtol=1e-10, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        assert KernelEngine(k, x, c, memory_budget=2 * (50 + 3) * 8 * 4).block_rows == 4


@pytest.mark.parametrize("name", ["rbf", "scale_matern52", "periodic"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fused_on", [True, False])
def test_partial_store_matches_dense(name, dtype, fused_on, monkeypatch):
    """Over the memory budget, ``store=None`` keeps the rows that fit beside the two on-the-fly
    buffers and recomputes the others: every product (first pass filling the store, later passes
    reading it, with and without the fused kernel) equals the dense one, within the budget."""
    from gpfalkon.backend import fused, stored_rows_for

    monkeypatch.setitem(fused._state, "enabled", fused_on)
    n, m, d = 611, 23, 4
    x, _ = make_data(n, d)
    c = x[:m] + 0.01
    k = make_kernel(name, d)
    knm = dense_kernel(k, x, c)
    u = torch.randn(m, 3, dtype=torch.float64)
    v = torch.randn(n, 3, dtype=torch.float64)
    item = torch.finfo(dtype).bits // 8
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    budget = (n // 2) * m * item  # half of K_nM
    for rows in (16, 37, 64):  # explicit heights: default ~2 MiB buffers would take all of this small budget
        e = KernelEngine(k, x.to(dtype), c.to(dtype), memory_budget=budget, block_rows=rows)
        assert not e.stored and 0 < e.stored_rows < n
        assert e.stored_rows == stored_rows_for(n, m, item, budget, e.block_rows, d=d)
        # (the buffers' rows hold the data's d columns beside M)
        assert e.stored_rows * m * item + 2 * e.block_rows * (m + d) * item <= budget
        for _ in range(2):  # the first call fills the store, the second reads it
            torch.testing.assert_close(e.kmn_k(u, v), knm.T @ (knm @ u + v), **tol)
            torch.testing.assert_close(e.kmn_k(u[:, :1]), knm.T @ (knm @ u[:, :1]), **tol)
            torch.testing.assert_close(e.kmn_k(None, v), knm.T @ v, **tol)
        assert e._k is not None and e._k.shape == (e.stored_rows, m)
        torch.testing.assert_close(e.k_matmul(u).double(), knm @ u, **tol)
        torch.testing.assert_close(e.column_sq_norms(), knm.square().sum(0), **tol)
        torch.testing.assert_close(e.materialize().double(), knm, **tol)
        L = torch.linalg.cholesky(knm.T @ knm + torch.eye(m, dtype=torch.float64))
        a = torch.linalg.solve_triangular(L, knm.T, upper=False)
        torch.testing.assert_close(e.whitened_gram(L), a @ a.T, **tol)
    # store=False keeps nothing; a budget below one block beside the buffers stores nothing either
    assert KernelEngine(k, x, c, memory_budget=budget, store=False).stored_rows == 0
    tiny = KernelEngine(k, x, c, memory_budget=2 * 8 * (m + d) * 8 + 8 * m * 8, block_rows=8)
    assert tiny.stored_rows == 8 and not tiny.stored
    assert KernelEngine(k, x, c, memory_budget=2 * 8 * (m + d) * 8 + 8, block_rows=8).stored_rows == 0
    assert stored_rows_for(n, m, 8, n * m * 8) == n


def test_float32_far_from_origin_stays_accurate():
    """Centring on the centers' mean keeps the float32 norm expansion accurate."""
    x64, _ = make_data(500, 20)
    x64 = x64 * 3 + 1000.0  # every coordinate shifted far from the origin
    c64 = x64[:40]
    k64 = gpytorch.kernels.RBFKernel().double()
    k64.lengthscale = 20**0.5
    ref = dense_kernel(k64, x64 - 1000.0, c64 - 1000.0)  # exact, shift-invariant
    k32 = gpytorch.kernels.RBFKernel()
    k32.lengthscale = 20**0.5
    e = KernelEngine(k32, x64.float(), c64.float(), store=False)
    err = (e.materialize().double() - ref).abs().max()
    assert err < 1e-5, err
    kmm = KernelEngine(k32, x64.float(), c64.float()).kmm()
    assert torch.linalg.eigvalsh(kmm).min() > -1e-10


@pytest.mark.parametrize("name", ["rbf", "matern32", "periodic"])
def test_kernel_product_gradients_match_dense_autograd(name):
    x, _ = make_data(40, 2)
    c0 = x[:6].clone() + 0.05
    k = make_kernel(name, 2)
    params = [p for p in k.parameters()]
    u0 = torch.randn(6, 2, dtype=torch.float64)
    v0 = torch.randn(40, 2, dtype=torch.float64)
    g = torch.randn(6, 2, dtype=torch.float64)

    def run(fn):
        xx = x.clone().requires_grad_(True)
        cc = c0.clone().requires_grad_(True)
        uu = u0.clone().requires_grad_(True)
        vv = v0.clone().requires_grad_(True)
        for p in params:
            p.grad = None
        out = fn(xx, cc, uu, vv)
        (out * g).sum().backward()
        return [xx.grad, cc.grad, uu.grad, vv.grad] + [p.grad.clone() for p in params]

    def ours(xx, cc, uu, vv):
        e = KernelEngine(k, xx, cc, block_rows=7)
        return kernel_product(e, uu, vv, xx, cc)

    def dense(xx, cc, uu, vv):
        knm = dense_kernel(k, xx, cc)
        return knm.T @ (knm @ uu + vv)

    for a, b in zip(run(ours), run(dense), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_kernel_product_gradcheck():
    x, _ = make_data(12, 2)
    c = x[:4].clone().requires_grad_(True)
    k = make_kernel("matern52", 2)
    u = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)

    def f(cc, uu):
        return kernel_product(KernelEngine(k, x, cc, block_rows=5), uu, None, x, cc)

    assert torch.autograd.gradcheck(f, (c, u))


@pytest.mark.parametrize("name", ["rbf", "matern12", "matern32", "matern52", "scale_rbf", "scale_matern52",
                                  "periodic"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_matmul_without_graph_matches_the_dense_product(name, dtype, monkeypatch):
    """kernel_matmul under no_grad (the kernel engine's fast path for RBF / Matern) = dense k(x, C) @ alpha
    (closed form); with a gradient recorded it takes GPyTorch's path, whose gradient matches autograd of
    the dense product; batched x keeps GPyTorch's path."""
    import gpfalkon.backend.passes as passes

    d = 4
    x, _ = make_data(157, d, seed=3)
    c = x[:23].clone()
    k = make_kernel(name, d)
    alpha = torch.randn(23, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = dense_kernel(k, x, c).detach() @ alpha
    engine_calls = []
    real = passes.KernelEngine

    def counting(*args, **kw):
        engine_calls.append(kw.get("block_rows"))
        return real(*args, **kw)

    monkeypatch.setattr(passes, "KernelEngine", counting)
    with torch.no_grad():  # as the posterior mean calls it: float64 points, the kernel in the model's dtype
        out = passes.kernel_matmul(k.to(dtype), x, c, alpha, 40)
    k.double()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert out.dtype == torch.float64 and out.shape == (157, 2)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert engine_calls == ([] if name == "periodic" else [40])
    # with a gradient: GPyTorch's path, differentiable w.r.t. x (centers apart from x: Matern-1/2 is not
    # differentiable at zero distance)
    engine_calls.clear()
    c2 = make_data(23, d, seed=5)[0]
    xg = x.clone().requires_grad_(True)
    passes.kernel_matmul(k, xg, c2, alpha, 40).sum().backward()
    xr = x.clone().requires_grad_(True)
    (dense_kernel(k, xr, c2) @ alpha).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-8, atol=1e-10)
    assert engine_calls == []
    generic = passes.kernel_matmul(k, x.clone().requires_grad_(True), c, alpha, 40).detach()
    with torch.no_grad():  # batch dimensions: GPyTorch's path
        batched = passes.kernel_matmul(k, x.unsqueeze(0).expand(2, -1, -1), c, alpha, 40)
    torch.testing.assert_close(batched, generic.expand(2, -1, -1), rtol=1e-12, atol=1e-12)
    assert engine_calls == []


def test_release_frees_a_large_store_in_the_background_and_the_next_store_waits(monkeypatch):
    """A released store at least BACKGROUND_FREE_BYTES large is dropped on a worker thread (the engine
    keeps no reference); the next engine that stores K_nM waits for it; products stay exact."""
    import weakref

    import gpfalkon.backend.engine as eng_mod

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)  # every store counts as large
    eng_mod.await_frees()  # nothing pending from earlier tests
    x, _ = make_data(300, 3)
    centers = x[:20].clone()
    kernel = make_kernel("rbf", 3)
    eng = KernelEngine(kernel, x, centers, store=True)
    u = torch.randn(20, 2, dtype=torch.float64)
    first = eng.kmn_k(u)
    stored = weakref.ref(eng._k)
    eng.release()
    assert eng._k is None and len(eng_mod._pending_frees) == 1
    again = KernelEngine(kernel, x, centers, store=True)
    torch.testing.assert_close(again.kmn_k(u), first)  # its store was allocated after waiting
    assert eng_mod._pending_frees == [] and stored() is None
    knm = dense_kernel(kernel, x, centers)
    torch.testing.assert_close(first, knm.T @ (knm @ u))
    # below the size, release drops the store at once (no thread)
    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 2**62)
    again.release()
    assert eng_mod._pending_frees == []


def test_release_leaves_the_worker_the_last_reference(monkeypatch):
    """The free happens on the worker: when its target has run, the store is gone, before release() returns
    (a reference kept by release itself would free the store on the caller's thread when it returns)."""
    import weakref

    import gpfalkon.backend.engine as eng_mod

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)
    eng_mod.await_frees()
    seen: list[bool] = []

    class Synchronous:  # a worker whose target runs inside start(), while release() is still on the stack
        def __init__(self, target, name, daemon):
            self.target = target

        def start(self):
            self.target()
            seen.append(stored() is None)

        def join(self):
            pass

    monkeypatch.setattr(eng_mod.threading, "Thread", Synchronous)
    x, _ = make_data(300, 3)
    eng = KernelEngine(make_kernel("rbf", 3), x, x[:20].clone(), store=True)
    eng.kmn_k(torch.randn(20, 1, dtype=torch.float64))
    stored = weakref.ref(eng._k)
    eng.release()
    assert seen[-1] is True
    eng_mod.await_frees()


@pytest.mark.parametrize("fused_on", [True, False], ids=["fused-kernel", "torch-path"])
def test_reuse_stores_hands_a_released_store_to_the_next_engine_of_its_size(monkeypatch, fused_on):
    """Inside reuse_stores() a released store is kept and the next engine whose K_nM has exactly its size and
    dtype computes into it: same memory, products exact against the dense kernel of the new engine's own
    kernel. A store of another size first frees the kept one; a store that another tensor still views is never
    kept (the view's values stay); the engine's buffers are never kept; the kept bytes count as available
    memory; the block's exit frees them. Both with the fused CPU kernel filling the store and with it off
    (torch's blockwise path fills it; the fused path must not take the kept store and drop it)."""
    import io

    import gpfalkon.backend.blocks as blocks_mod
    import gpfalkon.backend.engine as eng_mod
    import gpfalkon.backend.fused as fused_mod

    if fused_on and not fused_mod.fused_available()[0]:
        pytest.skip(f"fused kernel unavailable: {fused_mod.fused_available()[1]}")
    monkeypatch.setitem(fused_mod._state, "enabled", fused_on)  # what set_enabled(fused_on) sets; restored after

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)  # every store counts as large
    monkeypatch.setattr(blocks_mod, "open", lambda *a, **k: io.StringIO("MemTotal: 9 kB\nMemAvailable: 1000 kB\n"),
                        raising=False)
    eng_mod.await_frees()
    x, _ = make_data(300, 3)
    centers = x[:20].clone()
    u = torch.randn(20, 2, dtype=torch.float64)
    k1, k2 = make_kernel("rbf", 3), make_kernel("scale_matern52", 3)
    k2.base_kernel.lengthscale = 0.7

    def exact(kernel, xs, cs, v):
        knm = dense_kernel(kernel, xs, cs)
        return knm.T @ (knm @ v)

    assert blocks_mod.available_memory("cpu") == 1000 * 1024
    with eng_mod.reuse_stores():
        e1 = KernelEngine(k1, x, centers, store=True)
        e1.kmn_k(u)
        ptr = e1._k.data_ptr()
        e1.release()
        assert len(eng_mod.kept_stores()) == 1
        assert blocks_mod.available_memory("cpu") == 1000 * 1024 + 300 * 20 * 8  # the kept store counts
        e2 = KernelEngine(k2, x, centers, store=True)  # same size, another kernel
        torch.testing.assert_close(e2.kmn_k(u), exact(k2, x, centers, u))
        assert e2._k.data_ptr() == ptr and eng_mod.kept_stores() == []
        e2.release()
        e3 = KernelEngine(k1, x[:250], centers, store=True)  # another size: a fresh store, the kept one freed
        torch.testing.assert_close(e3.kmn_k(u), exact(k1, x[:250], centers, u))
        assert eng_mod.kept_stores() == []
        e3.release()
        assert len(eng_mod.kept_stores()) == 1 and eng_mod.kept_stores()[0].shape == (250, 20)
        # a store still viewed elsewhere is not kept
        e4 = KernelEngine(k2, x, centers, store=True)
        e4.kmn_k(u)
        view = e4._k[:5]
        before = view.clone()
        e4.release()
        assert eng_mod.kept_stores() == []  # e3's kept store was freed for e4 (other size), e4's is still viewed
        e5 = KernelEngine(k1, x, centers, store=True)
        torch.testing.assert_close(e5.kmn_k(u), exact(k1, x, centers, u))
        assert torch.equal(view, before)
        e5.release()
        assert len(eng_mod.kept_stores()) == 1
    assert eng_mod.kept_stores() == [] and eng_mod.reuse_depth() == 0
    assert blocks_mod.available_memory("cpu") == 1000 * 1024
    # outside the block nothing is kept
    e6 = KernelEngine(k1, x, centers, store=True)
    e6.kmn_k(u)
    e6.release()
    assert eng_mod.kept_stores() == []
    eng_mod.await_frees()


def test_reuse_stores_is_per_thread(monkeypatch):
    """A block open in one thread keeps only that thread's released stores: another thread's release frees
    its store as outside any block."""
    import threading

    import gpfalkon.backend.engine as eng_mod

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)
    x, _ = make_data(200, 3)
    kernel = make_kernel("rbf", 3)
    u = torch.randn(10, 1, dtype=torch.float64)
    seen = []

    def other() -> None:
        e = KernelEngine(kernel, x, x[:10].clone(), store=True)
        e.kmn_k(u)
        e.release()
        seen.append((eng_mod.reuse_depth(), len(eng_mod.kept_stores())))

    with eng_mod.reuse_stores():
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen == [(0, 0)] and eng_mod.kept_stores() == []
        e = KernelEngine(kernel, x, x[:10].clone(), store=True)
        e.kmn_k(u)
        e.release()
        assert len(eng_mod.kept_stores()) == 1
    assert eng_mod.kept_stores() == []
    eng_mod.await_frees()


def test_a_process_that_ends_right_after_a_fit_exits_cleanly():
    """A script that ends while its fit's store is still being freed on the background thread exits with
    status 0: the thread is joined at shutdown (as a daemon it aborted the process, status 134,
    "terminate called without an active exception", in 10 of 12 runs). Three fresh interpreters, each
    fitting with an 80 MB store (above BACKGROUND_FREE_BYTES) and ending at once."""
    import subprocess
    import sys

    import gpfalkon.backend.engine as eng_mod

    code = (
        "import torch, gpytorch\n"
        "from gpfalkon import FalkonGP\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(20_000, 5, generator=g); y = x[:, 0].sin()\n"
        "k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())\n"
        "m = FalkonGP(x, y, kernel=k, centers=x[:1000].clone(), penalty=1e-4, max_iter=2, tol=0.0).fit()\n"
        "del m\n"
    )
    assert 20_000 * 1000 * 4 >= eng_mod.BACKGROUND_FREE_BYTES
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


@pytest.mark.parametrize("m", [40, 300, 700])
def test_whitened_gram_by_lower_rank_updates_matches_dense_and_is_symmetric(m):
    """``A A^T`` (``A = L^{-1} K_Mn``) built from lower-triangle rank updates (blocks of 256 centers above
    256) equals the dense product and is exactly symmetric."""
    import gpfalkon.backend.engine as eng_mod

    x, _ = make_data(900, 3)
    centers = x[:m].clone()
    kernel = make_kernel("scale_matern52", 3)
    knm = dense_kernel(kernel, x, centers)
    L = torch.linalg.cholesky(dense_kernel(kernel, centers, centers) + 1e-6 * torch.eye(m, dtype=torch.float64))
    a = torch.linalg.solve_triangular(L, knm.T, upper=False)
    eng = KernelEngine(kernel, x, centers, store=False, block_rows=128)
    got = eng.whitened_gram(L)
    torch.testing.assert_close(got, a @ a.T, rtol=1e-10, atol=1e-9)
    assert torch.equal(got, got.T)
    g = torch.full((m, m), 7.0, dtype=torch.float64)
    r = torch.randn(m, 5, dtype=torch.float64)
    eng_mod._lower_rank_update_(g, r)
    torch.testing.assert_close(g.tril(), (7.0 + r @ r.T).tril(), rtol=1e-12, atol=1e-12)


def test_release_frees_inline_when_no_thread_can_start(monkeypatch):
    """A thread that cannot start (thread limit, interpreter shutdown) leaves nothing pending: the store is
    dropped at once and later stores allocate as usual."""
    import threading
    import weakref

    import gpfalkon.backend.engine as eng_mod

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(eng_mod, "BACKGROUND_FREE_BYTES", 1)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    eng_mod.await_frees()
    x, _ = make_data(200, 3)
    kernel = make_kernel("rbf", 3)
    eng = KernelEngine(kernel, x, x[:10].clone(), store=True)
    u = torch.randn(10, 1, dtype=torch.float64)
    first = eng.kmn_k(u)
    stored = weakref.ref(eng._k)
    eng.release()
    assert stored() is None and eng_mod._pending_frees == []
    torch.testing.assert_close(KernelEngine(kernel, x, x[:10].clone(), store=True).kmn_k(u), first)


@pytest.mark.parametrize("fused_on", [True, False])
@pytest.mark.parametrize("store", [True, False])
def test_float32_matern12_near_pairs_are_exact(monkeypatch, fused_on, store):
    """Matern-1/2 is not differentiable at distance 0, so the norm expansion's rounding near it becomes an error of
    sqrt(eps) or more: near pairs get their distance from the coordinates (engine.refine_near_). The float32 kernel
    values are within 1e-3 of the exact ones (a rounding floor over the whole block zeroed distances up to 0.2 here:
    18 % errors), duplicates give k(x, x) exactly, and the C++ tile kernel and the torch path agree."""
    from gpfalkon.backend import fused as fused_mod

    monkeypatch.setitem(fused_mod._state, "enabled", fused_on)
    k, x, c, exact = matern12_near_pairs_case()
    eng = KernelEngine(k, x, c, store=store)
    u = torch.randn(150, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = eng.kmn_k(u.float()).double()
    eng.kmn_k(u.float())  # a second pass reads the store where there is one
    kmat = eng.materialize().double()
    assert float((kmat - exact).abs().max()) < 3e-3 * 3.0
    assert float((kmat - exact).norm() / exact.norm()) < 1e-3
    dup = kmat[torch.arange(100), torch.arange(100)]
    torch.testing.assert_close(dup, torch.full((100,), 3.0, dtype=torch.float64), rtol=1e-6, atol=0)
    ref = exact.T @ (exact @ u)
    assert float((got - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_are_refused(dtype):
    """float16 / bfloat16 squared norms lose the distances (K_nM 4e-3 to 3e-2 off): refused by name, as FalkonGP
    refuses them."""
    x = torch.randn(20, 2).to(dtype)
    with pytest.raises(TypeError, match=r"x has dtype torch\.(float16|bfloat16)"):
        KernelEngine(gpytorch.kernels.RBFKernel(), x, x[:5])


def test_refine_near_on_empty_blocks_and_many_near_pairs():
    """No centers (or no rows): nothing to refine. A block whose pairs are nearly all near (one repeated point)
    is refined in groups, every value exact."""
    from gpfalkon.backend.engine import refine_near_

    x = torch.randn(10, 3)
    eng = KernelEngine(gpytorch.kernels.MaternKernel(nu=0.5), x, x[:4].clone(), store=False)
    assert refine_near_(torch.empty(10, 0), eng._xa, eng._ca_t[:, :0], 1e-3).shape == (10, 0)
    assert refine_near_(torch.empty(0, 4), eng._xa[:0], eng._ca_t, 1e-3).shape == (0, 4)
    same = torch.randn(1, 3).expand(600, 3).contiguous()
    eng = KernelEngine(gpytorch.kernels.MaternKernel(nu=0.5), same, same[:300].clone(), store=False)
    assert bool((eng.materialize() == 1.0).all())


@pytest.mark.parametrize("rows", [100, 256 * 7, 256 * 7 + 100])
def test_flushed_product_sums_chunks_in_float64_across_spans(rows, monkeypatch):
    """``_flushed_product``: ``w @ blk`` with the sum over rows taken in the data dtype within chunks of
    ``FLUSH_ROWS`` and in float64 across them, the chunks taken ``FLUSH_BATCH`` at a time (3 here: spans of 768
    rows, a partial span and a remainder below one chunk). Reference: each chunk's product, in float64 on the
    float32 values (the chunks' own float32 rounding is 2^-24 relative a term), and the float64 product."""
    from gpfalkon.backend import engine as engine_mod

    monkeypatch.setattr(engine_mod, "FLUSH_BATCH", 3)
    c = engine_mod.FLUSH_ROWS
    g = torch.Generator().manual_seed(1)
    blk = torch.rand(rows, 40, generator=g)
    w = torch.rand(2, rows, generator=g) + 1.0
    out = engine_mod._flushed_product(w, blk, torch.float64)
    exact = w.double() @ blk.double()
    chunked = sum(((w[:, s:s + c] @ blk[s:s + c]).double() for s in range(0, rows, c)),
                  torch.zeros(2, 40, dtype=torch.float64))
    assert out.dtype == torch.float64 and out.shape == (2, 40)
    # one float32 sum over all rows differs from the chunked sums by 1.5-1.7e-6 here (measured): 3e-7 tells them apart
    torch.testing.assert_close(out, chunked, rtol=3e-7, atol=0)
    torch.testing.assert_close(out, exact, rtol=2e-6, atol=0)


def test_far_centers_leave_the_bulks_kernel_values_exact():
    """Two centers at 1e9 among 160 in [0, 1]^2 (a missing-value code): the norm expansion's origin stays in the bulk
    (engine.expansion_origin: the mean clamped to the central rows' range), so K_MM and K_nM among the bulk rows are
    the closed form's on explicit differences to 1e-7 and K_MM is positive semi-definite (with the mean
    as origin, 1.25e7 out, the bulk's distances were off by 3e-4 and K_MM's smallest eigenvalue was -0.009)."""
    from gpfalkon.backend.engine import expansion_origin

    g = torch.Generator().manual_seed(0)
    c = torch.rand(160, 2, generator=g, dtype=torch.float64)
    c[:2, 0] = 1e9
    k = gpytorch.kernels.MaternKernel(nu=2.5).double()
    k.lengthscale = 0.05
    mu = expansion_origin(c)
    assert float(mu[0, 0]) < 1.0 and 0.0 < float(mu[0, 1]) < 1.0
    torch.testing.assert_close(expansion_origin(c[2:]), c[2:].mean(0, keepdim=True), rtol=0, atol=0)
    eng = KernelEngine(k, c[2:], c, store=False)
    kmm = eng.kmm()
    r = (c[:, None, :] - c[None, :, :]).norm(dim=-1) / 0.05
    exact = (1 + 5**0.5 * r + 5 * r**2 / 3) * torch.exp(-(5**0.5) * r)
    torch.testing.assert_close(kmm[2:, 2:], exact[2:, 2:], rtol=0, atol=1e-7)  # the profile's exp2: ~1e-8
    assert float(torch.linalg.eigvalsh(kmm)[0]) > -1e-12
    torch.testing.assert_close(eng.materialize()[:, 2:], exact[2:, 2:], rtol=0, atol=1e-7)
