"""Row blocks of a host-resident source on a GPU, with reads and copies overlapped with compute.

A pass over a :class:`~gpfalkon.backend.sources.RowSource` whose ``device`` is a CUDA device
needs each block ``x[start:stop]`` on the GPU before its kernel block is computed. Read and copied
one after another, the GPU waits for the file read (or host ``memcpy``) and for the host-to-device
copy of every block. :func:`source_blocks` pipelines them over ``depth`` slots:

* a worker thread reads block ``i + depth`` from the source into page-locked (pinned) host buffer
  ``(i + depth) mod depth`` as soon as the copy out of that buffer (block ``i``) has finished,
  then enqueues its host-to-device copy on a side CUDA stream (``non_blocking=True``: a DMA copy
  from pinned memory, concurrent with kernels on the compute stream) and records an event;
* the consumer's stream waits on that event (on the device: the host is not blocked) before the
  block is used, and the block's memory is tied to the consumer's stream
  (:meth:`torch.Tensor.record_stream`), so the caching allocator does not hand it out again while
  kernels that read it are queued.

So while the GPU computes on block ``i``, block ``i + 1`` is copied and block ``i + depth`` read:
with a source that reads faster than the GPU computes, a pass costs its compute alone.

Cost: ``depth`` pinned host buffers of ``rows x d`` values, one device block per block in flight,
one worker thread per pass. On a CPU device (or a source already on the GPU) blocks are read in
order with no thread: there is nothing to overlap with.

Written here because torch's :class:`torch.utils.data.DataLoader` prefetches samples of a
``Dataset`` into pinned memory, but neither it nor any other torch API copies row ranges of an
arbitrary source to the device on a side stream; this is the small amount of stream and event
bookkeeping that needs.
"""
from __future__ import annotations

import collections
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from .sources import RowSource

__all__ = ["DEPTH", "overlapped", "row_slices", "source_blocks"]

Blocks = Generator[tuple[int, int, Tensor], None, None]

#: blocks in flight (pinned buffers): one being copied while the previous is computed on
DEPTH = 2


def overlapped(source: RowSource) -> bool:
    """Whether :func:`source_blocks` pipelines this source: its blocks go to a CUDA device from
    host memory or files."""
    return source.device.type == "cuda" and source.host_resident and torch.cuda.is_available()


def source_blocks(
    source: RowSource, ranges: Sequence[tuple[int, int]], depth: int = DEPTH
) -> Blocks:
    """Yield ``(start, stop, x[start:stop])`` on ``source.device`` for each range, in order.

    On a CUDA device with a host-resident source, reads and host-to-device copies run ``depth``
    blocks ahead of the consumer (module docstring); elsewhere each block is read when asked for.
    A yielded block is safe to use on the current stream until the consumer asks for the next one
    and for as long as kernels queued on that stream need it.
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    ranges = [(int(s), int(e)) for s, e in ranges]
    if not ranges:
        return
    if not overlapped(source):
        for s, e in ranges:
            yield s, e, source.read(s, e)
        return
    yield from _pipelined(source, ranges, depth)


def _pipelined(source: RowSource, ranges: list[tuple[int, int]], depth: int) -> Blocks:
    dev = source.device
    d = source.shape[1]
    depth = min(depth, len(ranges))
    rows = max(e - s for s, e in ranges)
    pinned = [torch.empty(rows, d, dtype=source.dtype, pin_memory=True) for _ in range(depth)]
    copied: list[torch.cuda.Event | None] = [None] * depth  # the copy out of each buffer
    copy_stream = torch.cuda.Stream(dev)

    def load(i: int) -> tuple[Tensor, torch.cuda.Event]:
        # runs on the worker thread, one block at a time in order
        s, e = ranges[i]
        slot = i % depth
        done = copied[slot]
        if done is not None:
            done.synchronize()  # the copy of block i - depth out of this buffer has finished
        host = pinned[slot][: e - s]
        host.copy_(source.read_host(s, e))
        with torch.cuda.device(dev), torch.cuda.stream(copy_stream):
            out = torch.empty(e - s, d, dtype=source.dtype, device=dev)
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(copy_stream)
        copied[slot] = event
        return out, event

    pending: collections.deque[Future] = collections.deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpfalkon-prefetch") as pool:
        try:
            for i in range(depth):
                pending.append(pool.submit(load, i))
            for i, (s, e) in enumerate(ranges):
                out, event = pending.popleft().result()
                stream = torch.cuda.current_stream(dev)
                stream.wait_event(event)
                out.record_stream(stream)
                if i + depth < len(ranges):
                    pending.append(pool.submit(load, i + depth))
                yield s, e, out
        finally:  # a consumer that stops early: let the reads in flight finish, drop their blocks
            for f in pending:
                f.cancel()


XLike = Tensor | RowSource


def row_slices(x: XLike, ranges: Sequence[tuple[int, int]]) -> Blocks:
    """``(start, stop, x[start:stop])`` for an in-memory tensor (views) or a row source
    (:func:`source_blocks`): the one way a pass over the rows gets its inputs."""
    if isinstance(x, RowSource):
        yield from source_blocks(x, ranges)
    else:
        for s, e in ranges:
            yield s, e, x[s:e]
