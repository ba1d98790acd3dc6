"""advise_huge_pages: transparent huge pages for the engine's stored K_nM (host, Linux)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from gpfalkon.backend import KernelEngine, hugepages
from gpfalkon.backend import engine as engine_module
from gpfalkon.backend.hugepages import HUGE_PAGE_MIN_BYTES, advise_huge_pages

from conftest import make_data, make_kernel


def test_advice_is_given_for_a_large_fresh_host_tensor_and_leaves_its_values_alone():
    n = HUGE_PAGE_MIN_BYTES // 4 + 12345  # float32: just past the threshold, not 2 MiB-aligned in size
    t = torch.empty(n, dtype=torch.float32)
    given = advise_huge_pages(t)
    if sys.platform.startswith("linux") and hugepages._madvise is not None \
            and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert given  # a kernel with transparent huge pages accepts the advice (whatever its mode)
    elif not sys.platform.startswith("linux"):
        assert not given
    t.copy_(torch.arange(n, dtype=torch.float32))  # the first write after the advice: values as written
    assert torch.equal(t[:5], torch.arange(5, dtype=torch.float32)) and float(t[-1]) == float(n - 1)


def test_no_advice_for_small_non_contiguous_or_empty_tensors():
    assert not advise_huge_pages(torch.empty(1000))
    big = torch.empty(2, HUGE_PAGE_MIN_BYTES // 4, dtype=torch.float32)
    assert not advise_huge_pages(big[:, ::2])  # not contiguous
    assert not advise_huge_pages(torch.empty(0))


def test_engine_stores_are_advised(monkeypatch):
    """Every store the engine allocates for K_nM (whole, and the fused fill's) goes through the advice, and
    the stored values are those of the unadvised engine."""
    seen = []

    def record(t):
        seen.append(t)
        return advise_huge_pages(t)

    monkeypatch.setattr(engine_module, "advise_huge_pages", record)
    x, _ = make_data(300, 3, seed=2)
    kern = make_kernel("rbf", 3)
    e = KernelEngine(kern, x, x[:40].clone(), store=True)
    u = torch.randn(40, 2, dtype=torch.float64)
    out = e.kmn_k(u)
    assert len(seen) == 1 and seen[0].shape == (300, 40) and e._k is not None
    assert seen[0].data_ptr() == e._k.data_ptr()
    ref = KernelEngine(kern, x, x[:40].clone(), store=False).kmn_k(u)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_advice_for_a_device_tensor():
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_MIN_BYTES // 4 + 1, device="cuda"))
