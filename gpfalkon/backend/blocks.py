"""Row blocks: the one block-size rule and the one row-block iterator of gpfalkon.

Every pass over the ``n`` training rows (or the ``q`` test points) walks
:func:`row_blocks` with a height from :func:`block_rows_for`; no other module slices
rows into blocks. A pass is described by a :class:`BlockProfile`: how many
``rows x M`` blocks it keeps alive at once (the memory-budget cap) and its default
height when neither the caller nor :class:`gpfalkon.settings.block_rows` gives one.

The rule (``itemsize`` bytes per kernel value, ``M`` columns)::

    rows = block_rows                                   if given (caller, else the setting)
         = max(min_rows, target_bytes / (M * itemsize))  if the profile sizes by bytes,
           rounded down to a multiple of row_multiple
         = default_rows                                  otherwise
    rows = min(rows, memory_budget / (live_blocks * M * itemsize), n),  at least 1.

A pass that reads ``d`` data columns with each row (``d=``: the rows of a row source are read, not viewed, and
the fast path keeps a rescaled copy of them) counts ``M + d`` values a row in both the byte target and the cap.

A differentiable pass checkpoints its blocks (the graph holds one block at a time) unless its whole
graph fits a share of the budget (:func:`keeps_graph`).

Profiles (their defaults are the measured ones of ``benchmarks/engine.py``):

* :data:`PRODUCT` - thin products ``K_b^T (K_b U + V)``: about 16 MiB blocks on the CPU (each
  block's distance matmul is then large enough for torch's threads to share it without their
  synchronisation dominating, which 2 MiB blocks were not; the block is re-read from the
  last-level cache), about 1 GiB on a CUDA device (a GPU has no cache to fit; a block's five or
  so kernel launches must stay small beside its memory traffic: 1 GiB takes about 0.25 ms per
  pass over it at 4 TB/s), heights a multiple of 8 (so a block splits evenly over the threads'
  batched products), two live blocks (the block and a scratch buffer).
* :data:`GRADIENT` - autograd through a GPyTorch kernel block: 2048 rows (autograd has
  per-block overhead), about eight block-sized temporaries in forward + backward.
* :data:`FACTOR` - ``O(M^2)`` work per row (triangular solves against ``K_MM``, BLESS):
  about 8 MiB of float64, three live blocks (kernel block, solved block, slack).
* :data:`AGGREGATE` - the objectives' differentiable aggregates: 2048 rows, four live
  blocks (the kernel block, its solve and their autograd copies). Where the whole pass's graph (about
  48 bytes per ``n x M`` entry, measured with the GPyTorch Matern kernel and the Gram route) fits an
  eighth of the memory budget, its blocks are not checkpointed (:func:`keeps_graph`): keeping a small
  graph is faster per objective step than recomputing it in the backward pass
  (``benchmarks/results/objective-step-whole.md``).
* :data:`STORED` - reading a stored ``K_nM`` for thin products: sub-blocks of about
  512 KiB (each read twice, the second time from the core's own cache), at least 8 rows;
  a chunk is :func:`stored_batch` sub-blocks handled by one batched product.
* :data:`SCAN` - a pass over the data alone (finiteness checks, fingerprints: ``M = 0``, ``d`` columns):
  about 16 MiB of float64 a block, three live (the rows read, a float64 copy, a temporary).
"""
from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import settings
from .._warn import warn_caller
from ..errors import MemoryBudgetWarning

__all__ = [
    "AGGREGATE",
    "FACTOR",
    "GRADIENT",
    "PRODUCT",
    "SCAN",
    "STORED",
    "BlockProfile",
    "block_rows_for",
    "keeps_graph",
    "kept_stores",
    "memory_budget_for",
    "resolve_block_rows",
    "resolve_store_dtype",
    "reuse_depth",
    "row_blocks",
    "scan_rows",
    "store_row_bytes",
    "stored_batch",
]


@dataclass(frozen=True)
class BlockProfile:
    """How a pass uses memory per block (see the module docstring)."""

    live_blocks: int
    target_bytes: int | None = None  # size the default height by bytes ...
    default_rows: int = 2048  # ... or use a fixed default height
    min_rows: int = 1
    itemsize: int | None = None  # bytes per value; None: the caller's dtype
    row_multiple: int = 1  # byte-sized heights are rounded down to a multiple of this
    cuda_target_bytes: int | None = None  # target_bytes on a CUDA device (None: the same)
    graph_bytes: int | None = None  # autograd graph bytes per n x M entry of the whole pass (None: always checkpoint)


PRODUCT = BlockProfile(live_blocks=2, target_bytes=16 * 2**20, min_rows=32, row_multiple=8,
                       cuda_target_bytes=2**30)
GRADIENT = BlockProfile(live_blocks=8, default_rows=2048)
FACTOR = BlockProfile(live_blocks=3, target_bytes=8 * 2**20, min_rows=64, itemsize=8)
AGGREGATE = BlockProfile(live_blocks=4, default_rows=2048, graph_bytes=48)
#: a differentiable pass keeps its whole graph within 1 / GRAPH_SHARE of the memory budget
GRAPH_SHARE = 8
STORED = BlockProfile(live_blocks=1, target_bytes=512 * 2**10, min_rows=8)
SCAN = BlockProfile(live_blocks=3, target_bytes=16 * 2**20, min_rows=1, itemsize=8)


def resolve_store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a stored ``K_nM`` for data of ``dtype``: ``torch.int16`` where
    :class:`gpfalkon.settings.store_format` (read now) is ``"int16"`` (fixed point with a scale per row), else
    ``dtype``."""
    return torch.int16 if settings.store_format.value() == "int16" else dtype


def store_row_bytes(m: int, itemsize: int, store_dtype: torch.dtype | None = None) -> int:
    """Bytes one stored row of ``K_nM`` takes for data of ``itemsize`` bytes: ``M`` values of ``store_dtype``
    (default: the data's dtype), plus the row's scale (a data value) where the store is fixed point."""
    m = max(int(m), 1)
    if store_dtype is None or store_dtype.is_floating_point:
        return m * (itemsize if store_dtype is None else torch.empty(0, dtype=store_dtype).element_size())
    return m * torch.empty(0, dtype=store_dtype).element_size() + itemsize


def resolve_block_rows(block_rows: int | None = None) -> int | None:
    """``block_rows``, or :class:`gpfalkon.settings.block_rows` when ``None`` (read now),
    validated; ``None`` means the automatic rule of the pass's profile."""
    if block_rows is None:
        block_rows = settings.block_rows.value()
    if block_rows is None:
        return None
    try:
        ok = not isinstance(block_rows, bool) and int(block_rows) == block_rows and int(block_rows) >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"block_rows must be an integer >= 1, got {block_rows!r}")
    return int(block_rows)


def block_rows_for(
    n: int,
    m: int,
    itemsize: int,
    profile: BlockProfile,
    *,
    memory_budget: int | None = None,
    block_rows: int | None = None,
    device: torch.device | str | None = None,
    d: int = 0,
) -> int:
    """Rows per block for a pass of ``profile`` over ``n`` rows against ``m`` columns (on ``device``,
    whose available memory sets the automatic budget; the host when ``None``), reading ``d`` data columns with
    each row (``M + d`` values a row; the module docstring).

    ``block_rows`` (else :class:`gpfalkon.settings.block_rows`) overrides the profile's
    default height; the result never exceeds ``memory_budget`` (else
    :class:`gpfalkon.settings.memory_budget`) for the profile's live blocks, nor ``n``.
    """
    block_rows = resolve_block_rows(block_rows)
    width = max(int(m), 1) + max(int(d), 0)
    if block_rows is not None:
        rows = block_rows
    elif profile.target_bytes is not None:
        size = profile.itemsize or itemsize
        target = profile.target_bytes
        if profile.cuda_target_bytes is not None and device is not None and torch.device(device).type == "cuda":
            target = profile.cuda_target_bytes
        rows = target // (width * size)
        rows = max(profile.min_rows, rows - rows % profile.row_multiple)
    else:
        rows = profile.default_rows
    budget = memory_budget_for(memory_budget, device=device)
    size = profile.itemsize or itemsize
    row_bytes = profile.live_blocks * width * size
    if budget < row_bytes and n > 0:
        warn_caller(f"the memory budget ({budget} bytes) is below one row of this pass ({row_bytes} bytes: "
                      f"{profile.live_blocks} live blocks of {width} values of {size} bytes); it runs one row a "
                      "block, over the budget and slowly: raise gpfalkon.settings.memory_budget (or the "
                      "memory_budget argument) to a few MiB at least", MemoryBudgetWarning)
    rows = min(rows, max(1, budget // row_bytes))
    return max(1, min(rows, max(int(n), 1)))


def scan_rows(n: int, d: int, *, device: torch.device | str | None = None) -> int:
    """Rows per block of a pass over ``n`` rows of ``d`` data columns alone (:data:`SCAN`): finiteness checks and
    fingerprints of a row source, within the memory budget whatever ``d`` is."""
    return block_rows_for(n, 0, 8, SCAN, d=d, device=device)


def keeps_graph(n: int, m: int, profile: BlockProfile, *, memory_budget: int | None = None,
                device: torch.device | str | None = None) -> bool:
    """Does a differentiable pass of ``profile`` over ``n`` rows against ``m`` columns keep its whole
    autograd graph (no checkpointing): ``n m graph_bytes <= memory_budget / GRAPH_SHARE`` (the budget:
    ``memory_budget``, else :class:`gpfalkon.settings.memory_budget`, else the automatic one of
    ``device``). Checkpointing bounds the graph to one block at the price of a second forward pass
    over every block in the backward pass; below this size that price buys nothing the budget needs."""
    if profile.graph_bytes is None:
        return False
    budget = memory_budget_for(memory_budget, device=device)
    return int(n) * max(int(m), 1) * profile.graph_bytes <= budget // GRAPH_SHARE


#: bounds of the automatic memory budget: half the available memory, within [floor, cap]
AUTO_BUDGET_FLOOR = 256 * 2**20
AUTO_BUDGET_CAP = 16 * 2**30
#: the automatic budget where the available memory cannot be read
AUTO_BUDGET_FALLBACK = 4 * 2**30


#: per thread: the host store kept for reuse inside :func:`gpfalkon.backend.engine.reuse_stores` blocks
#: (``kept``, at most one) and how many such blocks are open (``depth``)
_reuse = threading.local()


def reuse_depth() -> int:
    """How many :func:`~gpfalkon.backend.engine.reuse_stores` blocks this thread has open."""
    return int(getattr(_reuse, "depth", 0))


def kept_stores() -> list[torch.Tensor]:
    """This thread's store kept for reuse (a list of at most one tensor; the list itself, to update)."""
    if not hasattr(_reuse, "kept"):
        _reuse.kept = []
    return _reuse.kept


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes available now on ``device``: for a CUDA device the free GPU memory
    (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds without using it
    (``memory_reserved - memory_allocated``: freed tensors, e.g. a previous fit's, that it hands out again);
    ``MemAvailable`` of ``/proc/meminfo`` for the host, plus the bytes of the store this thread keeps for
    reuse (:func:`kept_stores`: the next store takes it or frees it); ``None`` where it cannot be read."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda":
        try:
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            return int(torch.cuda.mem_get_info(dev)[0]) + max(int(cached), 0)
        except (RuntimeError, AssertionError):
            return None
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kept = sum(t.untyped_storage().nbytes() for t in kept_stores() if t.device.type == "cpu")
                    return int(line.split()[1]) * 1024 + kept
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_memory_budget(device: torch.device | str | None = None, reserve: int = 0,
                          available: int | None = None) -> int:
    """The automatic memory budget: ``(available - reserve) / 2``, with ``available`` the bytes of
    :func:`available_memory` (read now unless given) and ``reserve`` the bytes the caller will need beside
    the kernel blocks (e.g. the preconditioner's ``M x M`` matrices), within
    ``[AUTO_BUDGET_FLOOR, AUTO_BUDGET_CAP]``; ``AUTO_BUDGET_FALLBACK`` when it cannot be read."""
    free = available_memory(device) if available is None else int(available)
    if free is None:
        return AUTO_BUDGET_FALLBACK
    return int(min(AUTO_BUDGET_CAP, max(AUTO_BUDGET_FLOOR, (free - max(int(reserve), 0)) // 2)))


def given_memory_budget(memory_budget: int | None = None) -> int | None:
    """``memory_budget``, else :class:`gpfalkon.settings.memory_budget` where set, else ``None`` (the automatic
    budget, which :func:`memory_budget_for` resolves by reading the available memory)."""
    return settings.memory_budget.value() if memory_budget is None else memory_budget


def memory_budget_for(memory_budget: int | None = None, device: torch.device | str | None = None,
                      reserve: int = 0, available: int | None = None) -> int:
    """``memory_budget`` in bytes, else :class:`gpfalkon.settings.memory_budget` when set, else
    :func:`default_memory_budget` of ``device`` (the host when ``None``) with ``reserve`` and
    ``available``."""
    budget = settings.memory_budget.value() if memory_budget is None else memory_budget
    if budget is None:
        return default_memory_budget(device, reserve=reserve, available=available)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not math.isfinite(float(budget)) \
            or float(budget) != math.floor(float(budget)) or float(budget) < 1:
        raise ValueError(f"memory_budget must be an integer >= 1 (bytes), got {budget!r}")
    return int(float(budget))


def stored_batch(threads: int | None = None, minimum: int = 8) -> int:
    """Sub-blocks per batched thin product: the smallest multiple of ``threads`` (default
    ``torch.get_num_threads()``) that is at least ``minimum``.

    A batched product ``bmm`` over ``T`` sub-blocks hands whole sub-blocks to the threads
    with the same static split in both of its calls, so each thread's second read of its
    sub-block hits its own cache; ``T >= 8`` amortises the per-call overhead
    (``benchmarks/engine.py`` measures it).
    """
    t = max(1, int(torch.get_num_threads() if threads is None else threads))
    return t * max(1, -(-int(minimum) // t))


def row_blocks(n: int, rows: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of at most ``rows`` rows covering ``[start, n)``."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    for s in range(start, n, rows):
        yield s, min(s + rows, n)
