"""Transparent huge pages for large host tensors (Linux).

A fresh host tensor of ``B`` bytes is mapped lazily: its first write takes one page fault per 4 KiB page
(``B / 4096`` faults, each zeroing its page), and freeing it unmaps as many pages. Advised with
``madvise(MADV_HUGEPAGE)`` before that first write, the kernel maps 2 MiB pages instead where transparent
huge pages are in ``madvise`` (or ``always``) mode: 512 times fewer faults. For a stored ``K_nM`` of
1.6 GB on a 2-core KVM host the first write fell from 0.31 s to 0.09-0.19 s and the release from 0.09 s to
0.004 s (``benchmarks/results/hugepages.md``).

Why by hand: torch applies this advice only under ``THP_MEM_ALLOC_ENABLE=1``, read once when the process
first allocates (before any library can set it), and to every allocation; this advises the one tensor that
matters, through libc's ``madvise`` (``ctypes``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

from torch import Tensor

__all__ = ["HUGE_PAGE_BYTES", "HUGE_PAGE_MIN_BYTES", "advise_huge_pages"]

#: the huge page size advised for (x86-64 and arm64 with 4 KiB base pages)
HUGE_PAGE_BYTES = 2 * 2**20
#: smaller tensors are left alone (their faults cost little, and malloc may serve them from its heap)
HUGE_PAGE_MIN_BYTES = 64 * 2**20
_MADV_HUGEPAGE = 14  # linux/mman.h

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise_huge_pages(t: Tensor) -> bool:
    """Advise the kernel to back ``t``'s memory with transparent huge pages (the 2 MiB-aligned pages
    inside it). Call it on a freshly allocated, not yet written, contiguous host tensor of at least
    ``HUGE_PAGE_MIN_BYTES``. Returns whether the advice was given; ``False`` (nothing done) for a
    device tensor, a small or non-contiguous one, off Linux, or where ``madvise`` refuses (THP not
    built into the kernel). Never changes ``t``'s values or layout. Cost: one system call."""
    if _madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return False
    nbytes = t.numel() * t.element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES:
        return False
    addr = t.data_ptr()
    start = -(-addr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    stop = (addr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if stop <= start:
        return False
    return _madvise(start, stop - start, _MADV_HUGEPAGE) == 0
