"""The fused Triton on-the-fly pass (gpfalkon.backend.triton_fly) against a float64 dense reference.

Without a GPU the kernels run through Triton's CPU interpreter (conftest sets ``TRITON_INTERPRET=1``
where no CUDA device is present, before Triton is imported); with one they are compiled and run on it,
and the interpreter tests skip (the interpreter patches ``triton.language`` process-wide)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import gpfalkon
from gpfalkon.backend import KernelEngine
from gpfalkon.backend import engine as engine_mod
from gpfalkon.backend.triton_fly import MAX_K, _worth_it, triton_fly_available, triton_fly_kmn_k

from conftest import dense_kernel, make_data, make_kernel, matern12_near_pairs_case

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _devices() -> list:
    out = []
    if HAS_TRITON and not HAS_CUDA:
        out.append(pytest.param("interpret", id="interpreter"))
    out.append(pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not (HAS_TRITON and HAS_CUDA), reason="needs a CUDA device and triton")))
    return out


@pytest.fixture(params=_devices())
def where(request):
    """``(device, setting)``: CUDA with the compiled kernels, or the CPU through the interpreter."""
    if request.param == "interpret":
        import numpy as np
        import triton

        if _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
            pytest.skip("Triton's interpreter before 3.7 fails under numpy >= 2.4 (int() of a 1-element array)")
        with gpfalkon.settings.triton_fly("interpret"):
            ok, why = triton_fly_available(torch.device("cpu"))
        if not ok:
            pytest.skip(why)
        return torch.device("cpu"), "interpret"
    return torch.device("cuda"), "auto"


@pytest.fixture
def spy(monkeypatch):
    """Counts the engine's calls of the Triton pass that ran (returned True)."""
    calls = []

    def counted(*args, **kwargs):
        ran = triton_fly_kmn_k(*args, **kwargs)
        calls.append(ran)
        return ran

    monkeypatch.setattr(engine_mod, "triton_fly_kmn_k", counted)
    return calls


def _reference(kname: str, x, c, u, v):
    knm = dense_kernel(make_kernel(kname, x.shape[1]), x, c).detach()
    ref = torch.zeros(c.shape[0], (u if u is not None else v).shape[1], dtype=torch.float64)
    w = torch.zeros(x.shape[0], ref.shape[1], dtype=torch.float64)
    if u is not None:
        w += knm @ u
    if v is not None:
        w += v
    return ref + knm.T @ w


@pytest.mark.parametrize("kname", ["rbf", "matern12", "matern32", "scale_matern52", "scale_rbf"])
@pytest.mark.parametrize("k", [1, 3, 17])
def test_fused_pass_matches_the_dense_product(where, spy, kname, k):
    """``K^T (K u + v)`` in float32 (n and M not multiples of any tile; ARD lengthscales, outputscales;
    one, a few and more than 16 right-hand sides) within float32 rounding of the float64 product."""
    device, mode = where
    x, _ = make_data(333, d=5)
    c = x[::4][:70].clone() * 1.01  # not exactly the data: no zero distance by construction
    g = torch.Generator().manual_seed(k)
    u = torch.randn(70, k, generator=g, dtype=torch.float64)
    v = torch.randn(333, k, generator=g, dtype=torch.float64)
    ref = _reference(kname, x, c, u, v)
    eng = KernelEngine(make_kernel(kname, 5, torch.float32).to(device), x.float().to(device),
                       c.float().to(device), store=False)
    with gpfalkon.settings.triton_fly(mode):
        got = eng.kmn_k(u.float().to(device), v.float().to(device)).cpu()
        got_u = eng.kmn_k(u.float().to(device)).cpu()
        got_v = eng.kmn_k(None, v.float().to(device)).cpu()
    assert spy == [True, True, True]
    scale = float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(got_u, _reference(kname, x, c, u, None), rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(got_v, _reference(kname, x, c, None, v), rtol=0, atol=2e-5 * scale)


def test_matern12_near_pairs_are_exact(where, spy):
    """Matern-1/2 with duplicate and near centers and ARD lengthscales four decades apart: the tiles holding a near
    pair recompute its distance from the coordinates (as the CPU paths do: test_engine), so ``K^T v`` is within
    float32 rounding of the exact product (a rounding floor per row zeroed distances up to ~0.2 here)."""
    device, mode = where
    k, x, c, exact = matern12_near_pairs_case(700, 40, 30)
    v = torch.randn(700, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eng = KernelEngine(k.to(device), x.to(device), c.to(device), store=False)
    with gpfalkon.settings.triton_fly(mode):
        got = eng.kmn_k(None, v.float().to(device)).cpu()
    assert spy == [True]
    ref = exact.T @ v
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-4


@pytest.mark.parametrize("k", [1, 2])
def test_wide_inputs_take_several_width_chunks(where, spy, k):
    """d = 40 (augmented width 42: two ``tl.dot`` chunks of 32 over the width; ``"auto"`` would decline it in
    IEEE float32, ``"on"`` / the interpreter run it)."""
    device, mode = where
    x, _ = make_data(200, d=40)
    c = x[::5].clone() * 1.01
    u = torch.randn(40, k, dtype=torch.float64)
    v = torch.randn(200, k, dtype=torch.float64)
    ref = _reference("scale_matern52", x, c, u, v)
    eng = KernelEngine(make_kernel("scale_matern52", 40, torch.float32).to(device), x.float().to(device),
                       c.float().to(device), store=False)
    with gpfalkon.settings.triton_fly("on" if mode == "auto" else mode):
        got = eng.kmn_k(u.float().to(device), v.float().to(device)).cpu()
    assert spy == [True]
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * float(ref.abs().max()))


def test_a_kernel_that_cannot_run_falls_back_once_with_a_warning(monkeypatch):
    """Compiled kernels that raise (a Triton / driver combination that cannot build them): a warning, ``acc``
    untouched, ``False``, and the pass declined from then on in the process."""
    from types import SimpleNamespace

    from gpfalkon.backend import triton_fly

    class Broken:  # a kernel whose launch (kernel[grid](...)) raises
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no such instruction")
            return launch

    fake = SimpleNamespace(interpreting=lambda: False, launch_options=dict, fly_rows=Broken(), fly_cols=Broken())
    monkeypatch.setattr(triton_fly, "_kernels", lambda: fake)
    monkeypatch.setattr(triton_fly, "_failed", [])
    monkeypatch.setattr(triton_fly, "_splits", lambda device, n, m: 1)
    acc = torch.zeros(1, 8, dtype=torch.float64)
    xa, ca_t = torch.randn(10, 3), torch.randn(3, 8)
    with gpfalkon.settings.triton_fly("on"):
        monkeypatch.setattr(triton_fly, "triton_fly_available", lambda device: (not triton_fly._failed, ""))
        with pytest.warns(RuntimeWarning, match="no such instruction"):
            assert not triton_fly_kmn_k(acc, xa, ca_t, torch.ones(1, 8), None, "rbf", 0.0)
        assert acc.abs().sum() == 0
        assert not triton_fly_kmn_k(acc, xa, ca_t, torch.ones(1, 8), None, "rbf", 0.0)
    assert len(triton_fly._failed) == 1


def test_float64_chunk_totals(where, spy, monkeypatch):
    """One row tile per float32 chunk (each split's total then a float64 sum of several chunks): the same
    product."""
    from gpfalkon.backend import triton_fly

    device, mode = where
    monkeypatch.setattr(triton_fly, "_chunk_tiles", lambda: 1)
    x, _ = make_data(1000, d=3)
    c = x[:40].clone() + 0.01
    u = torch.randn(40, 1, dtype=torch.float64)
    v = torch.randn(1000, 1, dtype=torch.float64)
    ref = _reference("matern32", x, c, u, v)
    eng = KernelEngine(make_kernel("matern32", 3, torch.float32).to(device), x.float().to(device),
                       c.float().to(device), store=False)
    with gpfalkon.settings.triton_fly(mode):
        got = eng.kmn_k(u.float().to(device), v.float().to(device)).cpu()
    assert spy == [True]
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * float(ref.abs().max()))


def test_fused_pass_takes_the_rows_not_stored(where, spy, monkeypatch):
    """With part of ``K_nM`` stored, later passes give the rows past the store to the fused kernel, read the
    stored rows as they are (no block computed: the CPU's fused stored-rows kernel is off here, as it does
    not exist on a GPU) and the sum is the same product."""
    from gpfalkon.backend import fused

    device, mode = where
    x, _ = make_data(400, d=3)
    c = x[:64].clone() + 0.01
    u = torch.randn(64, 2, dtype=torch.float64)
    v = torch.randn(400, 2, dtype=torch.float64)
    ref = _reference("rbf", x, c, u, v)
    budget = 160 * 64 * 4 + 2 * 32 * 64 * 4  # 160 stored rows beside two 32-row buffers
    eng = KernelEngine(make_kernel("rbf", 3, torch.float32).to(device), x.float().to(device), c.float().to(device),
                       memory_budget=budget, block_rows=32)
    assert 0 < eng.stored_rows < 400
    computed = []
    real = KernelEngine._compute_block
    monkeypatch.setattr(KernelEngine, "_compute_block",
                        lambda self, *a, **kw: computed.append(a[:2]) or real(self, *a, **kw))
    fused.set_enabled(False)
    try:
        with gpfalkon.settings.triton_fly(mode):
            first = eng.kmn_k(u.float().to(device), v.float().to(device)).cpu()
            assert computed  # the first pass computes the stored rows into the store
            computed.clear()
            second = eng.kmn_k(u.float().to(device), v.float().to(device)).cpu()
    finally:
        fused.set_enabled(None)
    assert spy[-1] is True  # the second pass: rows stored_rows .. n by the fused kernel
    assert computed == []
    for got in (first, second):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * float(ref.abs().max()))


def test_fused_pass_declines_what_it_does_not_handle(where):
    """float64, more than MAX_K right-hand sides, the setting off: nothing done, the torch path runs."""
    device, mode = where
    x, _ = make_data(100, d=3)
    eng = KernelEngine(make_kernel("rbf", 3, torch.float32).to(device), x.float().to(device),
                       x[:20].float().to(device), store=False)
    acc = torch.zeros(MAX_K + 1, 20, dtype=torch.float64, device=device)
    args = (eng._xa, eng._ca_t)
    with gpfalkon.settings.triton_fly(mode):
        assert not triton_fly_kmn_k(acc, *args, torch.ones(MAX_K + 1, 20, device=device), None, "rbf", 0.0)
        acc1 = torch.zeros(1, 20, dtype=torch.float64, device=device)
        assert not triton_fly_kmn_k(acc1, eng._xa.double(), eng._ca_t.double(), None,
                                    torch.ones(1, 100, dtype=torch.float64, device=device), "rbf", 0.0)
        assert not triton_fly_kmn_k(acc1, *args, None, torch.ones(1, 100, device=device), "periodic", 0.0)
        assert triton_fly_kmn_k(acc1, *args, None, torch.ones(1, 100, device=device), "rbf", 0.0)
    assert acc.abs().sum() == 0
    with gpfalkon.settings.triton_fly("off"):
        ok, why = triton_fly_available(device)
    assert not ok and "off" in why


def test_fused_fit_equals_the_torch_path(where, spy):
    """A whole FALKON fit through the fused pass gives the coefficients of the same fit through torch's
    blockwise path (float32, same CG iterations)."""
    device, mode = where
    x, y = make_data(500, d=4)
    xs, ys = x.float().to(device), y.float().to(device)
    alphas = []
    for setting in (mode, "off"):
        with gpfalkon.settings.triton_fly(setting):
            kern = make_kernel("matern32", 4, torch.float32).to(device)
            model = gpfalkon.FalkonGP(xs, ys, kern, penalty=1e-4, centers=xs[:60].clone(),
                                      options=gpfalkon.FalkonOptions(store_kernel=False, max_iter=8, tol=0.0,
                                                                      solve_method="cg"))
            model.fit()
            alphas.append(model.alpha.detach().double().cpu())
            ran = sum(spy)
            spy.clear()
            assert (ran >= 9) == (setting != "off"), ran  # the right-hand side and each CG iteration
    rel = float((alphas[0] - alphas[1]).norm() / alphas[1].norm())
    assert rel < 1e-3, rel


@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs a CUDA device and triton")
def test_tf32_distances_on_cuda():
    """TF32 distances in the fused kernel are visibly less accurate than its IEEE float32 ones."""
    x, _ = make_data(2048, d=8)
    x = x + 2.0
    c = x[::16].clone() * 1.001
    u = torch.randn(c.shape[0], 1, dtype=torch.float64)
    ref = _reference("rbf", x, c, u, None)
    kern = make_kernel("rbf", 8, torch.float32).cuda()
    eng = KernelEngine(kern, x.float().cuda(), c.float().cuda(), store=False)
    err = {}
    for tf in (False, True):
        with gpfalkon.settings.tf32(tf):
            got = eng.kmn_k(u.float().cuda()).cpu()
        err[tf] = float((got - ref).norm() / ref.norm())
    assert err[False] < 1e-5, err
    assert err[True] > 3 * err[False], err


def test_auto_takes_the_fused_pass_where_it_was_measured_faster():
    """``"auto"``: augmented widths up to 32 (d <= 30) in IEEE float32, any width with TF32; ``"on"``: any."""
    with gpfalkon.settings.triton_fly("auto"):
        assert _worth_it(26) and _worth_it(32)
        assert not _worth_it(33) and not _worth_it(130)
        with gpfalkon.settings.tf32(True):
            assert _worth_it(130)
    with gpfalkon.settings.triton_fly("on"):
        assert _worth_it(130)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="triton_fly"):
        gpfalkon.settings.triton_fly("yes")
    with gpfalkon.settings.triton_fly("auto"):
        ok, why = triton_fly_available(torch.device("cpu"))
    assert not ok and "CUDA" in why
