"""Kernel-product engine: blockwise products with ``K_nM = k(X, C)``.

The one primitive FALKON needs is

    out = K_nM^T (K_nM U + V)            (M x k),

a sum over row blocks ``X_b`` of ``K_b^T (K_b U + V_b)``. Cost per call:
``2 n M d`` flops for the distances of a stationary kernel (one matmul per block),
``n M`` kernel evaluations and ``4 n M k`` flops for the two thin products. The
engine never holds more than ``memory_budget`` bytes of kernel values: when the
whole ``K_nM`` fits it is computed once and reused by every later call (the
products then cost only the ``4 n M k`` flops, bound by memory bandwidth);
otherwise the first ``n_s`` rows that fit the budget (beside the two on-the-fly
buffers) are stored and each call recomputes only the other ``n - n_s`` rows, in
``block_rows x M`` blocks into two reused buffers (with the stationary fast path and ``x`` in
memory, that recomputation is instead one call of a fused kernel, from the second pass on where rows
are stored: on the CPU the tile kernel of :mod:`gpfalkon.backend.fused`, on CUDA in float32 the Triton
kernels of :mod:`gpfalkon.backend.triton_fly`, which write no kernel block to memory). A pass then costs
``(n - n_s) / n`` of a full recomputation plus a read of ``n_s M`` values, so the
time per CG iteration grows smoothly with ``M`` past the budget instead of jumping
from a memory read to a full kernel evaluation.

Kernels
-------
Any GPyTorch kernel works (``kernel(x_b, C).to_dense()`` per block). For the
stationary kernels FALKON users use most — ``RBFKernel``, ``MaternKernel`` with
``nu`` in {0.5, 1.5, 2.5}, either wrapped in a ``ScaleKernel``, with scalar or ARD
lengthscales — the engine has a fast path: X and C are centred on the mean of the
centers and divided by the lengthscales once, into augmented coordinates whose
one matmul per block gives the (scaled) squared distances in a reused ~16 MiB
buffer; the kernel profile is then applied in place (1 pass for RBF, 4-6 for
Matern). Centring keeps the float32 norm expansion accurate however far the data
sit from the origin. The outputscale ``s`` (times a profile constant) is not
applied to the block: ``K^T (K U + V) = s K0^T (s K0 U + V)``.

The engine reads the kernel's hyperparameters when it is built (the fast path
copies them; a stored ``K_nM`` freezes them): build a new one after they change
(:class:`~gpfalkon.NystromKRROperator` does this by itself). It runs under ``torch.no_grad``: gradients go through
:mod:`gpfalkon.backend.autograd`.
"""
from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, overload

import torch
from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel
from torch import Tensor

from .. import settings
from .._warn import warn_caller
from . import blocks as _blocks
from .blocks import (
    PRODUCT,
    STORED,
    block_rows_for,
    kept_stores,
    memory_budget_for,
    resolve_block_rows,
    resolve_store_dtype,
    reuse_depth,
    row_blocks,
    store_row_bytes,
    stored_batch,
)
from .fused import FLUSH_ROWS, fly_applies, fly_tile_rows, fused_fly_kmn_k, fused_kmn_k, fused_profile_
from .precision import matmul_precision
from .prefetch import source_blocks
from .sources import RowSource
from .triton_fly import triton_fly_kmn_k

__all__ = ["KernelEngine", "StationarySpec", "kernel_block", "reuse_stores", "stationary_spec", "stored_rows_for"]


@dataclass
class StationarySpec:
    """A kernel the fast path understands: ``s * phi(||(x - c) / ell||)``."""

    kind: str  # "rbf", "matern12", "matern32", "matern52"
    lengthscale: Tensor  # (1, d) or (1, 1)
    outputscale: Tensor | None  # scalar or None


_COLUMN_FORM_MAX_K = 1  # right-hand sides up to which the column form is used (measured)
_MATERN_KIND = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}


def stationary_parts(kernel: Kernel) -> tuple[str, Tensor, Tensor | None] | None:
    """``(kind, lengthscale, outputscale)`` of a kernel ``s * phi(||(x - c) / ell||)`` the fast paths know (RBF,
    Matern 1/2, 3/2, 5/2, optionally in a ``ScaleKernel``; no ``active_dims`` or batch shape), the parameters as
    the kernel computes them (differentiable: ``lengthscale`` ``(1, d)`` or ``(1, 1)``, ``outputscale`` a scalar
    or ``None``); ``None`` for any other kernel."""
    outputscale = None
    base = kernel
    if type(kernel) is ScaleKernel:
        if kernel.active_dims is not None or kernel.outputscale.numel() != 1:
            return None
        outputscale = kernel.outputscale.reshape(())
        base = kernel.base_kernel
    if base.active_dims is not None or len(base.batch_shape) != 0:
        return None
    if type(base) is RBFKernel:
        kind = "rbf"
    elif type(base) is MaternKernel and float(base.nu) in _MATERN_KIND:
        kind = _MATERN_KIND[float(base.nu)]
    else:
        return None
    ls = base.lengthscale
    if ls.dim() != 2 or ls.shape[0] != 1:
        return None
    return kind, ls, outputscale


def stationary_spec(kernel: Kernel) -> StationarySpec | None:
    """Return the fast-path description of ``kernel`` (its parameters detached), or ``None`` for the generic
    path."""
    parts = stationary_parts(kernel)
    if parts is None:
        return None
    kind, ls, outputscale = parts
    return StationarySpec(kind=kind, lengthscale=ls.detach(),
                          outputscale=None if outputscale is None else outputscale.detach())


# Profile phi(t) of each fast kernel, k = s * CONST * phi(FACTOR * ||x - c||^2 / ell^2):
# FACTOR is folded into the augmented coordinates and CONST into the output scale,
# so neither costs an elementwise pass over the block. FACTOR also carries the change
# of base exp(t) = 2^(t log2 e) (log2(e)^2 under the square root of the Matern
# profiles): torch's exp2 ran 3-4x faster than its exp on CPU (benchmarks/engine.py).
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_FACTOR = {"rbf": -0.5 * _LOG2E, "matern12": _LOG2E**2, "matern32": 3.0 * _LOG2E**2, "matern52": 5.0 * _LOG2E**2}
_CONST = {"rbf": 1.0, "matern12": 1.0, "matern32": 1.0, "matern52": 1.0 / 3.0}


#: Matern-1/2 distances at or below ``_NEAR eps (f |z|^2 + f |c|^2)`` are recomputed from the coordinates
#: (:func:`refine_near_`): above it the norm expansion's rounding moves the profile's ``z' = sqrt(t)`` by at most
#: ``~ sqrt(d eps f (|z|^2 + |c|^2)) / 32`` (a few thousandths of a float32 kernel's near-pair values' spread).
_NEAR = 256.0
#: the near pairs :func:`refine_near_` takes at a time (their indices and coordinates: ~(16 + 12 d) bytes each)
_NEAR_PAIRS = 16384


def expansion_origin(c: Tensor) -> Tensor:
    """The origin of the norm expansion's coordinates for the rows ``c`` (``(1, d)``): per feature the mean, clamped
    to the range of the central rows (the ``ceil(0.1 (n - 1))``-th to ``ceil(0.9 (n - 1))``-th smallest, 0-based).
    The expansion ``|z|^2 + |c|^2 - 2 z.c`` rounds by about ``eps (|z|^2 + |c|^2)``, so the origin must sit in the
    bulk of the points: two centers at 1e9 among 160 in ``[0, 1]`` moved the mean 1.25e7 out, and a float64 ``K_MM``
    of the bulk, off by 3e-4 a distance, came out indefinite (eigenvalue -0.009). Where fewer than a tenth of the
    rows lie out, the clamp brings the origin back among the others; elsewhere the mean is kept (it minimises the
    sum of ``|z|^2``). ``O(n d)``: two ``kthvalue`` selections."""
    n = c.shape[0]
    if n == 0:
        return c.new_zeros(1, c.shape[1])
    mean = c.mean(0, keepdim=True)
    if n < 3:
        return mean
    lo = torch.kthvalue(c, math.ceil(0.1 * (n - 1)) + 1, dim=0, keepdim=True).values
    hi = torch.kthvalue(c, math.ceil(0.9 * (n - 1)) + 1, dim=0, keepdim=True).values
    return torch.minimum(torch.maximum(mean, lo), hi)


def refine_near_(buf: Tensor, xa: Tensor, ca_t: Tensor, near: float) -> Tensor:
    """In place on the Matern-1/2 distances ``buf = xa @ ca_t`` (``f ||z_i - c_j||^2`` by the norm expansion, from
    the augmented rows ``[-2 f z, f |z|^2, 1]`` and columns ``[c, 1, f |c|^2]``, ``f = log2(e)^2``): the entries at
    or below ``near (f |z_i|^2 + f |c_j|^2)`` recomputed as ``f sum_k (z_ik - c_jk)^2``. There the expansion's
    rounding (a few ``eps f (|z_i|^2 + |c_j|^2)``) is not small against the distance, and the profile's square
    root (not differentiable at 0) turns it into an error of ``sqrt(eps)`` or more in the kernel's value (duplicate
    points: ``k(x, x)`` off by ``~3e-4`` in float32). The C++ tile kernel does the same per tile
    (:func:`~gpfalkon.backend.fused.fused_fly_kmn_k`). Cost: one read of ``buf`` (its rows' minima against the
    loosest threshold), ``O(M)`` per row that can hold a near pair and ``O(d)`` per recomputed pair; memory
    ``O(_NEAR_PAIRS d)`` beyond ``buf``, whatever the number of near pairs."""
    if buf.numel() == 0:
        return buf
    a = xa.shape[-1]
    d, f = a - 2, _FACTOR["matern12"]
    c_sq = ca_t[a - 1]  # f |c_j|^2
    # the rows that can hold a near pair (their smallest distance below the loosest threshold): one read of buf
    rows = torch.nonzero(buf.amin(1) <= (xa[:, d] + c_sq.max()) * near).squeeze(1)
    # those rows in groups of at most _NEAR_PAIRS pairs (repeated or discrete inputs can make most pairs near)
    step = max(1, _NEAR_PAIRS // buf.shape[1])
    for g in range(0, rows.numel(), step):
        rg = rows[g : g + step]
        thr = torch.add(xa[rg, d : d + 1], c_sq.unsqueeze(0)).mul_(near)
        i, j = torch.nonzero(buf[rg] <= thr, as_tuple=True)
        if i.numel():
            i = rg[i]
            # -2 f (z - c), with -2 f c rounded as the augmented rows' -2 f z were: a duplicate point gives exactly 0
            diff = xa[i, :d] - (-2.0 * f) * ca_t[:d, j].t()
            buf[i, j] = diff.square_().sum(-1).mul_(0.25 / f)
    return buf


def _apply_profile_(kind: str, buf: Tensor, tmp: Tensor | None, zero_below: float = 0.0) -> Tensor:
    """In place: ``buf`` holds ``FACTOR[kind] * ||x - c||^2 / ell^2``; returns ``phi(buf)``.

    rbf: ``2^t = exp(t ln 2)`` (t <= 0); Matern with ``z' = sqrt(t) = z log2 e``: 1/2 ``2^-z'
    = exp(-z)``, 3/2 ``(1 + z) exp(-z)``, 5/2 ``((z + 1.5)^2 + 0.75) exp(-z)``
    (``= 3 (1 + z + z^2/3) exp(-z)``, the 1/3 being in ``_CONST``). Values at or below
    ``zero_below`` (default 0: the negative ones the norm expansion's rounding can leave) become exactly 0
    before the square root (the engine gives Matern-1/2 near pairs exact distances first: :func:`refine_near_`).
    On the CPU, a Matern profile of a contiguous ``buf``
    goes through :func:`~gpfalkon.backend.fused.fused_profile_` (one vectorised pass instead of these
    ATen operations, where the fused kernels are on and built).
    """
    if fused_profile_(buf, kind, zero_below):
        return buf
    if kind == "rbf":
        return buf.clamp_(max=0.0).exp2_()
    torch.threshold_(buf, zero_below, 0.0)  # the same builtin as torch.nn.functional.threshold_
    buf.sqrt_()
    if kind == "matern12":
        return buf.neg_().exp2_()
    assert tmp is not None  # the Matern-3/2 and 5/2 profiles are always given a buffer
    torch.neg(buf, out=tmp).exp2_()
    buf.mul_(_LN2)  # z' -> z
    if kind == "matern32":
        return buf.add_(1.0).mul_(tmp)
    return buf.add_(1.5).square_().add_(0.75).mul_(tmp)


def stored_rows_for(n: int, m: int, itemsize: int, memory_budget: int, block_rows: int | None = None,
                    device: torch.device | str | None = None, store_dtype: torch.dtype | None = None,
                    d: int = 0) -> int:
    """Rows of ``K_nM`` a :class:`KernelEngine` built with ``store=None`` holds in memory: ``n`` when
    the whole ``K_nM`` (in ``store_dtype``, default the data's dtype of ``itemsize`` bytes:
    :func:`~gpfalkon.backend.blocks.store_row_bytes`) fits ``memory_budget`` bytes, else the rows that fit
    beside the on-the-fly pass's two ``block_rows x M`` buffers of data values (``block_rows`` by
    :func:`block_rows_for` when ``None``), or ``0`` where not one block does. Cost models (``auto_fit``'s)
    use it to predict a pass: ``(n - rows) / n`` of it recomputes kernel values. ``d``: the data's columns, which
    those buffers' rows hold too (:func:`block_rows_for`'s ``M + d``)."""
    row_bytes = (max(int(m), 1) + max(int(d), 0)) * itemsize
    kept_row_bytes = store_row_bytes(m, itemsize, store_dtype)
    if n * kept_row_bytes <= memory_budget:
        return int(n)
    if block_rows is None:
        block_rows = block_rows_for(n, m, itemsize, PRODUCT, memory_budget=memory_budget, device=device, d=d)
    head = (memory_budget - PRODUCT.live_blocks * block_rows * row_bytes) // kept_row_bytes
    return int(min(head, n)) if head >= block_rows else 0


#: a released host store at least this large is freed on a background thread (:func:`_release_store`)
BACKGROUND_FREE_BYTES = 64 * 2**20
_pending_frees: list[threading.Thread] = []
_pending_lock = threading.Lock()


def _sole_owner(t: Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage (no view of it survives elsewhere): a store is reused
    only then. ``False`` where torch offers no use count (then nothing is reused)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = t.untyped_storage()
    # references: t's own and the `storage` handle taken here
    return bool(use_count(storage._cdata) <= 2)


@contextlib.contextmanager
def reuse_stores() -> Iterator[None]:
    """Within the block (or the function it decorates), the largest host store of at least
    :data:`BACKGROUND_FREE_BYTES` that an engine releases is kept, not freed, and the next engine whose stored
    ``K_nM`` has exactly its size, dtype and device writes its rows into it: a run of fits of one size
    (``auto_fit``'s selection fits: the noise and lengthscale searches at one number of centers) then pays the
    page faults of a fresh store once, not once per fit (such fits 1.14-1.23x faster at 36k-44k rows and
    ``M`` 1,000-2,000 on the development host, the same coefficients, ``benchmarks/results/store-reuse.md``).
    At most one store is kept: a release keeps its largest store and frees the one kept before, and an engine
    whose store does not match frees the kept one before allocating its own. A store that another tensor still
    views is never kept. The kept bytes count as available to the engines' automatic memory budgets
    (:func:`~gpfalkon.backend.blocks.available_memory`), so a budget is the one it would be had the store been
    freed. The kept store is freed when the outermost block exits. Per thread: the block covers the stores its
    own thread releases and allocates. Written by hand: torch's CPU allocator keeps no freed blocks (large
    ones are unmapped at once) and has no caching allocator to ask."""
    _blocks._reuse.depth = reuse_depth() + 1
    try:
        yield
    finally:
        _blocks._reuse.depth = reuse_depth() - 1
        if reuse_depth() == 0:
            kept = kept_stores()
            drop = list(kept)
            kept.clear()
            _release_store(drop)


def _take_pooled(rows: int, m: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The kept store (:func:`reuse_stores`) viewed as ``(rows, m)`` where it has exactly that size, dtype and
    device; else ``None``, after freeing any kept store (so that the fresh allocation does not coexist
    with it)."""
    kept = kept_stores()
    store = kept.pop() if kept else None
    if store is None:
        return None
    fits = store.untyped_storage().nbytes() == rows * m * store.element_size() and rows * m > 0
    if fits and store.dtype == dtype and store.device == torch.device(device):
        return torch.empty(0, dtype=dtype, device=store.device).set_(store.untyped_storage(), 0, (rows, m), (m, 1))
    drop = [store]
    del store  # the list holds the only reference: the store is freed where _release_store drops it
    _release_store(drop, keep=False)
    return None


def _release_store(store: list[Tensor], keep: bool = True) -> None:
    """Drop the references in ``store`` (emptied): a large host tensor on a background thread, so that the
    caller does not wait while its pages go back to the operating system (``munmap`` of a 1.6 GB ``K_nM``
    took 0.11 s of a 2.2 s fit on a 2-core KVM host, ``benchmarks/results/fit-reference.md``); anything
    else at once (and at once where no thread can be started). The next store an engine allocates first
    waits for pending frees (:func:`await_frees`), so within one thread of engines two stores never
    coexist beyond the memory budget (engines used from several threads at once can overlap one free with
    another thread's new store). The destructor holds the GIL: the caller gains where it runs torch
    operations that release it (the fit's remaining work), not pure-Python code. The thread is not a daemon:
    the interpreter joins it before it shuts down (a daemon thread still freeing a tensor when the process
    exited aborted it: ``terminate called without an active exception``, exit status 134, in 10 of 12 runs of a
    script that ended right after a fit). Inside :func:`reuse_stores` the largest one is kept for the next
    store instead (``keep=False``: freed in any case). Written by hand: torch's CPU allocator returns large
    blocks to the OS synchronously and has no deferred free."""
    big = [t for t in store if t.device.type == "cpu" and t.untyped_storage().nbytes() >= BACKGROUND_FREE_BYTES]
    store.clear()
    if keep and big and reuse_depth() > 0:  # inside reuse_stores(): keep the largest sole-owned one
        big.sort(key=lambda t: t.untyped_storage().nbytes())
        if _sole_owner(big[-1]):
            largest = big.pop()
            kept = kept_stores()
            big += kept  # the store kept before is freed
            kept[:] = [largest]
    if not big:
        return
    worker = threading.Thread(target=big.clear, name="gpfalkon-free", daemon=False)
    try:
        worker.start()
    except RuntimeError:  # no thread to be had (a thread limit, interpreter shutdown): free here
        big.clear()
        return
    with _pending_lock:
        _pending_frees.append(worker)


def await_frees() -> None:
    """Wait until the stores handed to :func:`_release_store` are freed (an engine does before it allocates a
    store; a benchmark does before it times something else, so that no free runs beside it)."""
    with _pending_lock:
        pending = list(_pending_frees)
        _pending_frees.clear()
    for worker in pending:
        worker.join()


#: row block of :func:`_lower_rank_update_`
RANK_UPDATE_BLOCK = 256


def _lower_rank_update_(g: Tensor, a: Tensor) -> None:
    """``g += a a^T`` on the lower triangle and diagonal blocks of ``g`` (``M x M``; ``a`` is ``M x k``): block
    row ``I`` gets ``a[I] a[:I_end]^T``, so the strictly upper blocks are not computed (and left stale).
    About ``(1/2 + 1/(2B)) 2 M^2 k`` flops for ``B`` blocks instead of ``2 M^2 k``; the variance factors'
    pass is 1.23-1.35x faster at M = 1,000-2,000 (``benchmarks/results/variance-factors.md``). Written by
    hand: torch exposes no symmetric rank-k update (BLAS ``syrk``)."""
    m = g.shape[0]
    if m <= RANK_UPDATE_BLOCK:
        g.addmm_(a, a.mT)
        return
    for i0, i1 in row_blocks(m, RANK_UPDATE_BLOCK):  # blocks of g's rows (centers, not data rows)
        g[i0:i1, :i1].addmm_(a[i0:i1], a[:i1].mT)


#: the largest integer of a fixed-point store (int16, symmetric)
FIXED_MAX = 32767
#: bytes of the data-dtype buffer into which a fixed-point store's rows are converted per product on a GPU
#: (the CPU's fused kernel converts them in its cache; its torch path uses the stored sub-blocks' size)
FIXED_CHUNK_BYTES = 64 * 2**20
#: chunks of FLUSH_ROWS rows summed by one batched product in :func:`_flushed_product` (bounds its
#: ``(chunks, k, M)`` partial sums where a block is the whole store: a GPU)
FLUSH_BATCH = 512


def _quantize_rows_(blk: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """Rows of ``blk`` in 16-bit fixed point: ``scale_i = max |blk_i| / 32767``, ``q_i = round(blk_i /
    scale_i)`` (nearest even; a zero row: ``scale_i = 0``, ``q_i = 0``; a row with a non-finite value:
    ``scale_i = NaN``, ``q_i = 0``), written into ``q`` (int16) and ``scale``; ``blk`` becomes ``q_i scale_i``
    in place and is returned. The same operations as the fused kernel's ``quantize_row`` (so both paths
    store the same values). Cost: four passes over the block."""
    top = blk.abs().amax(1)
    s = top / FIXED_MAX
    bad = ~torch.isfinite(blk).all(1)
    r = torch.where(top[:, None] > 0, blk / s[:, None], torch.zeros((), dtype=blk.dtype, device=blk.device))
    r = r.round_().clamp_(-FIXED_MAX, FIXED_MAX).masked_fill_(bad[:, None], 0.0)
    s = s.masked_fill_(bad, float("nan"))
    q.copy_(r)
    scale.copy_(s)
    return blk.copy_(r.mul_(s[:, None]))


def kernel_block(kernel: Kernel, x1: Tensor, x2: Tensor, *, diag: bool = False) -> Tensor:
    """Dense ``k(x1, x2)`` (or its diagonal, ``diag=True``) through GPyTorch (differentiable; generic path), in
    ``x1``'s dtype.

    A kernel that refuses points of another dtype than its parameters' (GPyTorch's ``PolynomialKernel`` adds
    its offset by ``addmm``: a float32 kernel fails on the float64 points of ``K_MM`` and of the posterior) is
    evaluated on points of its parameters' dtype and the block cast to ``x1``'s: its values are what that
    kernel can compute (:func:`kernel_block_in` also says which dtype that was)."""
    return kernel_block_in(kernel, x1, x2, diag=diag)[0]


#: (kernel class, dtype) pairs :func:`kernel_block_in` has warned of: a kernel that cannot compute float64 values
_NARROW_KERNELS_WARNED: set[tuple[type, torch.dtype]] = set()


def kernel_block_in(kernel: Kernel, x1: Tensor, x2: Tensor, *, diag: bool = False) -> tuple[Tensor, torch.dtype]:
    """:func:`kernel_block` and the dtype of the points the kernel was evaluated on (``x1``'s, or its
    parameters' where it refused ``x1``'s). The block comes back in ``x1``'s floating dtype: GPyTorch promotes
    float32 points against float64 parameters to a float64 block, which the callers' float32 operands (targets,
    solves) would refuse to multiply."""
    try:
        out = _dense(kernel(x1, x2, diag=diag))
        if x1.dtype.is_floating_point and out.dtype != x1.dtype:
            out = out.to(x1.dtype)
        return out, x1.dtype
    except RuntimeError:
        own = next((p.dtype for p in kernel.parameters() if p.is_floating_point()), None)
        if own is None or own == x1.dtype:
            raise
        if own.itemsize < x1.dtype.itemsize and (type(kernel), own) not in _NARROW_KERNELS_WARNED:
            _NARROW_KERNELS_WARNED.add((type(kernel), own))
            warn_caller(
                f"{type(kernel).__name__} refuses {x1.dtype} points (its parameters are {own}): the passes that need "
                "float64 kernel values (K_MM, the posterior factors, the direct solve of float32 data) get "
                f"{own} ones, and K_MM's jitter and the variances that precision (a float32 PolynomialKernel's "
                "variances were 160-370 % off); a float64 kernel (kernel.double()) computes them in float64, with "
                "float32 data too",
                RuntimeWarning)
        return _dense(kernel(x1.to(own), x2.to(own), diag=diag)).to(x1.dtype), own


def _dense(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out.to_dense()


def _flushed_product(w: Tensor, blk: Tensor, acc_dtype: torch.dtype) -> Tensor:
    """``w @ blk`` (``(k, rows) @ (rows, M)``) in ``acc_dtype``, its sum over rows taken in the data dtype over at
    most :data:`~gpfalkon.backend.fused.FLUSH_ROWS` rows at a time (one batched product over the chunks) and in
    ``acc_dtype`` across them: the rounding of the fused kernel's sums, not that of a whole block's."""
    rows, m = blk.shape
    c = FLUSH_ROWS
    full = rows - rows % c
    out = torch.zeros(w.shape[0], m, dtype=acc_dtype, device=blk.device)
    span = c * FLUSH_BATCH  # partial sums of at most FLUSH_BATCH chunks at a time: (FLUSH_BATCH, k, M)
    for s0, s1 in row_blocks(full, span):
        out += torch.bmm(w[:, s0:s1].reshape(w.shape[0], (s1 - s0) // c, c).transpose(0, 1),
                         blk[s0:s1].reshape((s1 - s0) // c, c, m)).to(acc_dtype).sum(0)
    if full < rows:
        out += (w[:, full:] @ blk[full:]).to(acc_dtype)
    return out


class KernelEngine:
    """Blockwise products with ``K_nM = k(x, centers)`` under a memory budget.

    Args:
        kernel: any GPyTorch kernel.
        x: training inputs ``(n, d)``.
        centers: Nyström centers ``(M, d)``.
        memory_budget: bytes allowed for kernel values (default
            :class:`gpfalkon.settings.memory_budget`).
        block_rows: rows per on-the-fly block (default :class:`gpfalkon.settings.block_rows`).
        store: ``True`` to require storing the whole ``K_nM`` (error if over budget), ``False``
            to always recompute, ``None`` (default) to store it whole if it fits, else the first
            rows that fit (:attr:`stored_rows`; the rest recomputed at each pass).

    The stored rows are kept in :attr:`store_dtype`: the data's dtype, or int16 where
    :class:`gpfalkon.settings.store_format` is ``"int16"`` when the engine is built (fixed point: row ``i``
    is ``q_i s_i``, ``s_i = max |K_i| / 32767``, the scales in the data's dtype), rounded once by the first
    pass; every pass (the first one's products included) reads those values, converted to the data's dtype
    in the core's cache (the fused CPU kernel) or block by block. A float32 store on the CPU is multiplied with
    float64 vectors and sums (:attr:`wide`, :class:`gpfalkon.settings.wide_products` when the engine is built:
    the fused kernels widen each value in registers, the first pass's tile kernel too, from the tile it has just
    written into the store; docs/math.md §3.2b).

    Attributes:
        stored: whether the whole ``K_nM`` is stored.
        store_dtype: the dtype of the stored rows (the data's, or int16).
        wide: whether the products over a stored float32 ``K_nM`` take float64 vectors and sums (CPU).
        stored_rows: rows of ``K_nM`` held in memory once the first pass has run (``n`` when
            ``stored``; ``0`` with ``store=False`` or where not one block fits beside the buffers).

    Memory: ``n M`` elements when stored whole, else at most ``memory_budget`` bytes (the stored
    rows and ``2 block_rows M`` buffers); plus ``n d`` for the rescaled inputs of the fast path.
    Products accumulate in float64.
    """

    def __init__(
        self,
        kernel: Kernel,
        x: Tensor,
        centers: Tensor,
        *,
        memory_budget: int | None = None,
        block_rows: int | None = None,
        store: bool | None = None,
    ) -> None:
        if x.dtype not in (torch.float32, torch.float64):  # float16 / bfloat16 norms lose the distances
            raise TypeError(f"x has dtype {x.dtype}; the kernel engine supports torch.float32 and torch.float64")
        self.kernel = kernel
        self.x = x.detach()  # a tensor, or a RowSource read block by block (never held whole)
        self.streamed = isinstance(x, RowSource)
        self.centers = centers.detach().to(dtype=x.dtype, device=x.device)
        self.n, self.d = x.shape
        self.m = centers.shape[0]
        self.dtype = x.dtype
        self.device = x.device
        self.acc_dtype = torch.float64
        budget = memory_budget_for(memory_budget, device=self.device)
        itemsize = torch.finfo(self.dtype).bits // 8
        self.store_dtype = resolve_store_dtype(self.dtype)
        self.fixed = self.store_dtype != self.dtype  # a fixed-point (int16) store with row scales
        # products over a stored float32 K_nM on the CPU with float64 vectors and sums (settings.wide_products, read
        # now): the fused kernel widens each stored value in registers
        self.wide = (self.dtype == torch.float32 and not self.fixed and self.device.type == "cpu"
                     and settings.wide_products.value())
        row_bytes = store_row_bytes(self.m, itemsize, self.store_dtype)
        full_bytes = self.n * row_bytes
        partial = store is None
        if store is None:
            store = full_bytes <= budget
        elif store and full_bytes > budget:
            raise ValueError(
                f"store=True (store_kernel) needs {full_bytes:,} bytes for K_nM ({self.n} x {self.m}) but "
                f"memory_budget is {budget:,} bytes"
            )
        self.stored = bool(store)
        # resolved now (the setting in force when the engine is built also sizes its gradient passes)
        self.block_rows_setting = resolve_block_rows(block_rows)
        self.block_rows = block_rows_for(
            self.n, self.m, itemsize, PRODUCT, memory_budget=budget, block_rows=self.block_rows_setting,
            device=self.device, d=self.d,
        )
        self.stored_rows = self.n if self.stored else 0
        if partial and not self.stored:  # the rows that fit beside the on-the-fly buffers
            self.stored_rows = stored_rows_for(self.n, self.m, itemsize, budget, self.block_rows,
                                               store_dtype=self.store_dtype, d=self.d)
        # Thin products read a stored K_nM in chunks of `stored_batch` sub-blocks of about
        # 512 KiB, one batched product per chunk: each thread reads its sub-block twice,
        # the second time from its own cache (benchmarks/engine.py measures it). On a GPU
        # the whole matrix is one chunk (bandwidth is ample; launches are not).
        if self.device.type == "cuda":
            self.stored_batch = 1
            self.stored_block_rows = max(self.n, 1)
            if self.fixed:  # converted chunk by chunk into a buffer of the data's dtype: bounded chunks
                self.stored_block_rows = max(1, min(self.n, FIXED_CHUNK_BYTES // (self.m * itemsize)))
        else:
            self.stored_batch = stored_batch()
            assert STORED.target_bytes is not None  # the STORED profile sizes by bytes
            sub_rows = block_rows_for(
                self.n, self.m, itemsize, STORED, memory_budget=budget,
                block_rows=max(STORED.min_rows, STORED.target_bytes // row_bytes),
            )
            chunk = self.stored_batch * sub_rows
            if self.block_rows_setting is not None:  # an explicit block height caps the chunks too
                chunk = min(chunk, self.block_rows_setting)
            self.stored_block_rows = max(1, min(max(self.stored_rows, 1), chunk))
        self.memory_budget = budget

        self.spec = stationary_spec(kernel)
        with torch.no_grad():
            if self.spec is not None:
                # the centers' median, not their mean: a few far centers (a missing-value code) move the mean far
                # from the bulk, and the norm expansion's rounding, eps (|z|^2 + |c|^2), with it (see kmm)
                self._mu = expansion_origin(self.centers)
                self._ls = self.spec.lengthscale.to(dtype=self.dtype, device=self.device)
                cs = (self.centers - self._mu).div_(self._ls)
                # Augmented coordinates: one matmul [-2 f x, f |x|^2, 1] . [c, 1, f |c|^2]
                # gives f ||x - c||^2 for the whole block, no extra elementwise pass.
                f = _FACTOR[self.spec.kind]
                c_sq = cs.square().sum(-1, keepdim=True)
                self._ca_t = torch.cat([cs, torch.ones_like(c_sq), f * c_sq], -1).t().contiguous()
                self._near = _NEAR * float(torch.finfo(self.dtype).eps)
                if not self.streamed:  # in memory: once for all rows (n (d + 2) values)
                    self._xa = self._augment(self.x)
                s = self.spec.outputscale
                self.scale = (1.0 if s is None else float(s)) * _CONST[self.spec.kind]
            else:
                self.scale = 1.0
        self._k: Tensor | None = None
        self._buf: Tensor | None = None
        self._tmp: Tensor | None = None
        self._scale: Tensor | None = None  # the row scales of a fixed-point store (stored_rows,)
        self._wide: Tensor | None = None  # stored rows of a fixed-point store converted to the data's dtype

    def _augment(self, xb: Tensor) -> Tensor:
        """``[-2 f z, f |z|^2, 1]`` for ``z = (x_b - mu) / ell`` (see ``__init__``)."""
        z = (xb - self._mu).div_(self._ls)
        f = _FACTOR[self.spec.kind]  # type: ignore[union-attr]
        z_sq = z.square().sum(-1, keepdim=True)
        return torch.cat([(-2.0 * f) * z, f * z_sq, torch.ones_like(z_sq)], -1)

    # ------------------------------------------------------------------ blocks
    def _blocks(self, rows: int | None = None) -> Iterator[tuple[int, int]]:
        return row_blocks(self.n, self.block_rows if rows is None else rows)

    def _compute_block(self, start: int, stop: int, out: Tensor | None = None, xb: Tensor | None = None) -> Tensor:
        """Base kernel values ``K0[start:stop]`` (without the outputscale of the fast path);
        ``xb``: the rows ``x[start:stop]`` where the caller has them (a streamed pass prefetches them)."""
        if xb is None and (self.spec is None or self.streamed):
            xb = self.x[start:stop]
        if self.spec is None:
            assert xb is not None
            with matmul_precision(self.device):
                blk = kernel_block(self.kernel, xb, self.centers)
            if out is None:
                return blk.to(self.dtype)
            return out.copy_(blk)
        rows = stop - start
        if out is None:
            out = torch.empty(rows, self.m, dtype=self.dtype, device=self.device)
        if self.streamed:  # the block's rows from the source, augmented here
            assert xb is not None
            xa = self._augment(xb)
        else:
            xa = self._xa[start:stop]
        with matmul_precision(self.device):
            torch.matmul(xa, self._ca_t, out=out)
        if self.spec.kind == "matern12":
            refine_near_(out, xa, self._ca_t, self._near)
        tmp = None
        if self.spec.kind in ("matern32", "matern52"):
            if self._tmp is None or self._tmp.shape[0] < rows:
                self._tmp = torch.empty(self.block_rows, self.m, dtype=self.dtype, device=self.device)
            tmp = self._tmp[:rows]
        return _apply_profile_(self.spec.kind, out, tmp)

    def _new_store(self, rows: int) -> tuple[Tensor, Tensor | None]:
        """An empty ``(rows, M)`` tensor (:attr:`store_dtype`) for stored rows of ``K_nM`` and, for a fixed-point
        store, its ``(rows,)`` row scales (else ``None``), once any released store is freed
        (:func:`await_frees`). Plain pages: transparent huge pages (``madvise``) were measured and left out
        (``benchmarks/results/hugepages.md``: a process's first advised store paid 1.8-2.1 s of memory
        compaction against 0.35-0.4 s of page faults). Inside :func:`reuse_stores`, a kept store of exactly
        this size, dtype and device is reused instead."""
        scale = torch.empty(rows, dtype=self.dtype, device=self.device) if self.fixed else None
        if reuse_depth() > 0:
            kept = _take_pooled(rows, self.m, self.store_dtype, self.device)
            if kept is not None:
                return kept, scale
        await_frees()
        return torch.empty(rows, self.m, dtype=self.store_dtype, device=self.device), scale

    def _fill_block(self, k: Tensor, scale: Tensor | None, start: int, stop: int, xb: Tensor | None) -> Tensor:
        """Rows ``start:stop`` of the store ``k`` computed (``K0``), returned in the data's dtype: a view
        of the store, or (a fixed-point store, ``scale`` its row scales) the block as stored
        (:func:`_quantize_rows_`), in a reused buffer."""
        if scale is None:
            return self._compute_block(start, stop, out=k[start:stop], xb=xb)
        blk = self._compute_block(start, stop, out=self._buffer(stop - start), xb=xb)
        return _quantize_rows_(blk, k[start:stop], scale[start:stop])

    def _buffer(self, rows: int) -> Tensor:
        """The first ``rows`` rows of the reused on-the-fly buffer (``block_rows x M``, the data's dtype)."""
        if self._buf is None:
            self._buf = torch.empty(self.block_rows, self.m, dtype=self.dtype, device=self.device)
        return self._buf[:rows]

    def _stored(self, start: int, stop: int) -> Tensor:
        """Stored rows ``start:stop`` in the data's dtype: a view of the store, or (a fixed-point store)
        ``q_i s_i`` in a reused buffer (valid until the next call)."""
        assert self._k is not None
        if self._scale is None:
            return self._k[start:stop]
        rows = stop - start
        if self._wide is None or self._wide.shape[0] < rows:
            self._wide = torch.empty(rows, self.m, dtype=self.dtype, device=self.device)
        return self._wide[:rows].copy_(self._k[start:stop]).mul_(self._scale[start:stop, None])

    def _ensure_stored(self) -> Tensor:
        """The stored rows ``K0[:stored_rows]`` (in :attr:`store_dtype`), computed on first use."""
        if self._k is None:
            k, scale = self._new_store(self.stored_rows)
            with torch.no_grad():
                for start, stop, xb in self._rows(row_blocks(self.stored_rows, self.block_rows)):
                    self._fill_block(k, scale, start, stop, xb)
            self._k, self._scale = k, scale
        return self._k

    def iter_blocks(self, rows: int | None = None) -> Generator[tuple[int, int, Tensor], None, None]:
        """Yield ``(start, stop, K0_b)``: the base block, ``K_nM[start:stop] = scale * K0_b``.

        The yielded tensor is a reused buffer (or a view of the stored matrix):
        do not keep it past the next iteration.
        ``rows`` overrides the block height of a stored ``K_nM`` (default
        ``stored_block_rows``, sized for thin products; consumers doing ``O(M^2)``
        work per row want taller blocks). On-the-fly blocks are always ``block_rows``.
        """
        yield from self._iter_blocks(rows, 0)

    def _iter_blocks(self, rows: int | None, first: int) -> Generator[tuple[int, int, Tensor], None, None]:
        """:meth:`iter_blocks` over rows ``[first, n)``: stored rows as views (computed into the store
        on the first pass, which costs no extra kernel pass), the others recomputed into a buffer.
        ``first > 0`` only once the store is filled."""
        head = self.stored_rows
        with torch.no_grad():
            if head > first:
                if self._k is None:
                    assert first == 0, "a pass that skips rows needs the store filled"
                    k, scale = self._new_store(head)
                    for start, stop, xb in self._rows(row_blocks(head, self.block_rows)):
                        yield start, stop, self._fill_block(k, scale, start, stop, xb)
                    self._k, self._scale = k, scale
                else:
                    for start, stop in row_blocks(head, self.stored_block_rows if rows is None else rows, first):
                        yield start, stop, self._stored(start, stop)
            for start, stop, xb in self._rows(row_blocks(self.n, self.block_rows, max(head, first))):
                if self.spec is None:
                    yield start, stop, self._compute_block(start, stop, xb=xb)
                    continue
                yield start, stop, self._compute_block(start, stop, out=self._buffer(stop - start), xb=xb)

    def _rows(self, ranges: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int, Tensor | None]]:
        """``(start, stop, x_b)`` for the ranges of a pass: a streamed source's blocks through
        :func:`~gpfalkon.backend.prefetch.source_blocks` (on a GPU, read and copied ahead of the
        compute), ``None`` for in-memory ``x`` (its rows are already augmented)."""
        if isinstance(self.x, RowSource):
            with contextlib.closing(source_blocks(self.x, list(ranges))) as blocks:
                yield from blocks
        else:
            for start, stop in ranges:
                yield start, stop, None

    def materialize(self) -> Tensor:
        """Return the dense ``K_nM`` (n x M, includes the outputscale). O(n M) memory."""
        if self.stored:
            k = self._ensure_stored()
            if self._scale is not None:  # fixed point: q_i s_i
                k = k.to(self.dtype).mul_(self._scale[:, None])
                return k.mul_(self.scale) if self.scale != 1.0 else k
            return k * self.scale if self.scale != 1.0 else k.clone()
        out = torch.empty(self.n, self.m, dtype=self.dtype, device=self.device)
        for start, stop, blk in self.iter_blocks():
            out[start:stop] = blk
        return out.mul_(self.scale) if self.scale != 1.0 else out

    def release(self) -> None:
        """Free the stored matrix (a large host one on a background thread: :func:`_release_store`) and
        the buffers. Only the stored matrix may be kept for the next engine (:func:`reuse_stores`); the
        buffers never are."""
        # the lists hold the only references, so the tensors are freed where _release_store drops them (a local
        # name here would keep the store alive until this method returns, freeing it on the caller's thread)
        stores = [self._k] if self._k is not None else []
        buffers = [t for t in (self._buf, self._tmp, self._wide, self._scale) if t is not None]
        self._k = self._buf = self._tmp = self._wide = self._scale = None
        _release_store(buffers, keep=False)
        _release_store(stores)

    # ---------------------------------------------------------------- products
    @overload
    def _cast(self, t: Tensor) -> Tensor: ...

    @overload
    def _cast(self, t: None) -> None: ...

    def _cast(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        return t.to(dtype=self.dtype, device=self.device)

    def kmn_k(self, u: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        """``K_nM^T (K_nM u + v)`` for ``u`` ``(M, k)`` and ``v`` ``(n, k)`` (either may be
        ``None``, meaning zero). Returns float64 ``(M, k)``: a sum over row blocks, so the
        results of several row shards of the same data (same centers) are combined by summing.

        Thin products use the "row form" (``(u^T K_b^T) K_b``): on CPU, torch's
        ``K_b^T @ w`` with a tall row-major ``K_b`` and 2-15 columns is up to 10x
        slower (see ``benchmarks/engine.py``).
        """
        if u is None and v is None:
            raise ValueError("kmn_k needs u or v")
        ref = u if u is not None else v
        assert ref is not None  # checked just above
        k = ref.shape[-1]
        s = self.scale
        u_t = None
        if u is not None:
            u_t = self._cast(u).t().contiguous()
            if s != 1.0:
                u_t = u_t * s
        v_t = self._cast(v).t().contiguous() if v is not None else None  # (k, n)
        acc = torch.zeros(k, self.m, dtype=self.acc_dtype, device=self.device)
        with torch.no_grad():
            # the stored rows on CPU: one call of the fused single-read kernel over all of them, where it
            # runs; the rows not stored (and the stored ones where it does not run) block by block
            head = self.stored_rows
            v_head = None if v_t is None else v_t[:, :head]
            u_w = v_w = None
            if self.wide and head > 0:  # float64 vectors over the float32 store (settings.wide_products)
                u_w = None if u is None else u.to(dtype=torch.float64, device=self.device).t().contiguous()
                if u_w is not None and s != 1.0:
                    u_w = u_w * s
                v_w = None if v is None else v[:head].to(dtype=torch.float64, device=self.device).t()
                if self._k is None:  # the first pass: the tile kernel fills the store, each tile's products
                    stored_done = self._fly_fused(acc, u_w, v_w, fill=True)  # taken in float64 from the cache
                else:
                    stored_done = fused_kmn_k(acc, self._k, u_w, v_w, None)
            elif self._k is not None:
                stored_done = fused_kmn_k(acc, self._k, u_t, v_head, self._scale)
            else:  # the first pass: the stored rows computed into the store by the fused tile kernel
                stored_done = head > 0 and self._fly_fused(acc, u_t, v_head, fill=True)
            # the rows not stored on CPU: one call of the fused on-the-fly kernel, once any store is filled
            fly_done = (head < self.n and (self._k is not None or head == 0)
                        and self._fly_fused(acc, u_t, None if v_t is None else v_t[:, head:]))
            if fly_done and not stored_done and self._k is not None:
                # the rows past the store done by a fused kernel (not CPU: the stored rows' fused kernel did not
                # run): the stored rows alone, as views (iter_blocks would compute the next block before the
                # loop could stop; no subclass wraps them where the fused kernels ran)
                for start, stop in row_blocks(head, self.stored_block_rows):
                    self._thin_block_(acc, self._stored(start, stop), u_t, None if v_t is None else v_t[:, start:stop])
            elif not ((stored_done or head == 0) and fly_done):
                # (all rows: through iter_blocks, which a backend subclass may wrap)
                blocks = self._iter_blocks(None, head) if stored_done else self.iter_blocks()
                # closed here, inside this no_grad block: a generator left suspended inside its own no_grad
                # block would restore its grad mode (off) whenever it is collected, after this call returns
                with contextlib.closing(blocks):
                    for start, stop, blk in blocks:
                        if fly_done and start >= head:
                            break
                        if self.wide and start < head:
                            # the stored rows where no fused kernel ran (a row source, the fused kernels off): as wide
                            # as the fused kernels take them, so that every pass (the first one's K_Mn y included)
                            # sees the same products; float32 sums here left the first pass's right-hand side off
                            # the later passes' system by far more than the store's rounding
                            self._thin_block_(acc, blk.to(torch.float64), u_w,
                                              None if v_w is None else v_w[:, start:stop])
                            continue
                        self._thin_block_(acc, blk, u_t, None if v_t is None else v_t[:, start:stop])
        if s != 1.0:
            acc.mul_(s)
        return acc.t()

    def _fly_fused(self, acc: Tensor, u_t: Tensor | None, v_t: Tensor | None, fill: bool = False) -> bool:
        """``acc += (u^T K_f^T + v_f^T) K_f`` by a fused kernel over the rows not stored
        (``f = stored_rows .. n``): on CUDA in float32 the Triton kernels of
        :mod:`~gpfalkon.backend.triton_fly`, on the CPU the C++ tile kernel
        (:func:`~gpfalkon.backend.fused.fused_fly_kmn_k`), which also runs with ``fill`` over the stored rows
        ``0 .. stored_rows``, computed into a new store that becomes ``self._k``. Either applies to the
        stationary fast path with ``x`` in memory and :meth:`iter_blocks` not overridden (a subclass that
        wraps it keeps seeing every pass). ``False`` (nothing done) elsewhere. ``v_t`` holds the columns of
        those rows."""
        if self.spec is None or self.streamed:
            return False
        if type(self).iter_blocks is not KernelEngine.iter_blocks:  # a subclass that wraps the blocks sees them
            return False
        head = self.stored_rows
        rows = slice(0, head) if fill else slice(head, self.n)
        if not fill and triton_fly_kmn_k(acc, self._xa[rows], self._ca_t, u_t, v_t, self.spec.kind, self._near):
            return True  # CUDA float32 (or Triton's interpreter): gpfalkon.backend.triton_fly
        if self.device.type != "cpu" or not fly_applies(acc, self._xa[rows], self._ca_t, self.spec.kind):
            return False  # checked first: a store taken here (a kept one, reuse_stores) must be filled
        store, scale = self._new_store(head) if fill else (None, None)
        tile = fly_tile_rows(self.m, torch.finfo(self.dtype).bits // 8, cap=self.block_rows)
        done = fused_fly_kmn_k(acc, self._xa[rows], self._ca_t, u_t, v_t, self.spec.kind, self._near, tile,
                               store=store, store_scale=scale)
        if done and fill:
            self._k, self._scale = store, scale
        return done

    def _thin_block_(self, acc: Tensor, blk: Tensor, u_t: Tensor | None, v_t: Tensor | None) -> None:
        """``acc += (u^T K_b^T + v_b^T) K_b`` for one block (``u_t``: ``(k, M)``, ``v_t``: ``(k, rows)``).

        A block whose rows split evenly into ``T`` sub-blocks (``T`` = ``stored_batch``, or the
        thread count) is viewed as ``(T, rows / T, M)`` and handled by two batched products
        (``bmm``): each thread then owns whole sub-blocks in both products and reads its
        sub-block the second time from its own cache, instead of the two products of a 2-D
        block splitting it along different axes. One right-hand side uses the column form
        ``K_b u`` of the first product, several the row form ``u^T K_b^T`` (both measured in
        ``benchmarks/engine.py``). Partial sums of the ``T`` sub-blocks are added in the
        data dtype, then accumulated in float64.
        """
        with matmul_precision(blk.device):
            self._thin_products_(acc, blk, u_t, v_t)

    def _thin_products_(self, acc: Tensor, blk: Tensor, u_t: Tensor | None, v_t: Tensor | None) -> None:
        rows = blk.shape[0]
        t = 1
        # (float64 with several right-hand sides too: with 16 MiB blocks the batched form and the 2-D
        # products are about even, 0.92-1.40x, benchmarks/results/engine-blocks-batched.md); on a GPU
        # the 2-D products (one launch each; sub-blocks buy nothing there)
        if blk.is_contiguous() and blk.device.type == "cpu":
            for cand in (self.stored_batch, torch.get_num_threads()):
                if cand > 1 and rows % cand == 0:
                    t = cand
                    break
        # a float32 (or narrower) block: its row sums flushed to float64 every FLUSH_ROWS rows, as the fused CPU
        # kernel does; summed over a whole block (thousands of rows on the CPU: row sources, kernels the fused kernel
        # does not know; on a GPU the whole store, millions of rows) in float32 they drift beyond the in-memory
        # fit's rounding (on a GPU: benchmarks/results/gpu-notes.md, session 52)
        flush = blk.dtype != self.acc_dtype and rows > FLUSH_ROWS
        if t == 1 or flush:
            if u_t is not None:
                w = u_t @ blk.t()  # (k, rows)
                if v_t is not None:
                    w.add_(v_t)
            else:
                assert v_t is not None  # kmn_k checks that u or v is given
                w = v_t
            acc += _flushed_product(w, blk, self.acc_dtype) if flush else (w @ blk).to(self.acc_dtype)
            return
        k = acc.shape[0]
        b3 = blk.view(t, rows // t, self.m)
        if u_t is not None:
            if k <= _COLUMN_FORM_MAX_K:
                # an explicit column (stride M between its columns): with the stride 1 that
                # torch gives a (1, M) row by default, MKL's batched product ran 4x slower
                col = u_t.as_strided((t, self.m, k), (0, 1, self.m))
                w3 = torch.bmm(b3, col).transpose(1, 2)  # (t, k, r)
            else:
                w3 = torch.bmm(u_t.expand(t, k, self.m), b3.transpose(1, 2))  # (t, k, r)
            if v_t is not None:
                w3 = w3 + v_t.reshape(k, t, rows // t).transpose(0, 1)
        else:
            assert v_t is not None
            w3 = v_t.reshape(k, t, rows // t).transpose(0, 1)
        acc += torch.bmm(w3, b3).sum(0).to(self.acc_dtype)

    def k_matmul(self, u: Tensor) -> Tensor:
        """``K_nM u`` for ``u`` ``(M, k)``; returns ``(n, k)`` in the data dtype."""
        u_t = self._cast(u).t().contiguous()
        if self.scale != 1.0:
            u_t = u_t * self.scale
        out = torch.empty(u_t.shape[0], self.n, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for start, stop, blk in self.iter_blocks():
                with matmul_precision(self.device):
                    torch.matmul(u_t, blk.t(), out=out[:, start:stop])
        return out.t()

    def kmm(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """``K_MM = k(C, C)`` in ``dtype`` (float64 by default, for the preconditioner).

        Computed from the centers cast to ``dtype``, so a float32 model still gets a
        float64-accurate ``K_MM``; the diagonal distances are exactly zero.
        """
        with torch.no_grad():
            c = self.centers.to(dtype)
            if self.spec is not None:
                ls = self.spec.lengthscale.to(dtype=dtype, device=self.device)
                cs = (c - expansion_origin(c)) / ls
                sq = cs.square().sum(-1)
                with matmul_precision(self.device):
                    d2 = torch.addmm(sq.unsqueeze(0) + sq.unsqueeze(1), cs, cs.t(), alpha=-2.0)
                d2.fill_diagonal_(0.0)
                d2.mul_(_FACTOR[self.spec.kind])
                kmm = _apply_profile_(self.spec.kind, d2, torch.empty_like(d2))
                return kmm.mul_(self.scale) if self.scale != 1.0 else kmm
            return kernel_block(self.kernel, c, c).to(dtype)

    # ------------------------------------------------ M-sized aggregates (shard-summable)
    # Each method below returns a sum over the rows' blocks of an M-sized (M, M x k or M x M)
    # term: results of row shards of the same data are combined by summing them.
    def whitened_gram(self, L: Tensor) -> Tensor:
        """``A A^T`` with ``A = L^{-1} K_Mn`` for a lower-triangular float64 ``L`` (``M x M``).

        One pass: ``O(n M (M + d))`` flops (a triangular solve and a rank-``rows`` update of the lower
        triangle per block: :func:`_lower_rank_update_`), float64 ``M x M`` result, memory
        ``O(M^2 + rows M)``. The posterior factors (docs/math.md §4) use it with ``L L^T = K_MM``.
        """
        aat = torch.zeros(self.m, self.m, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for _, _, blk in self.iter_blocks(rows=self.block_rows):
                kb = blk.t().to(torch.float64)
                if self.scale != 1.0:
                    kb = kb * self.scale
                ab = torch.linalg.solve_triangular(L, kb, upper=False)
                _lower_rank_update_(aat, ab)
            aat.tril_()
            aat.add_(aat.tril(-1).mT)  # the upper triangle from the lower one: exactly symmetric
        return aat

    def column_sq_norms(self) -> Tensor:
        """``sum_i K_iM^2`` (float64, length ``M``): the diagonal of ``K_Mn K_nM``, one pass."""
        out = torch.zeros(self.m, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for _, _, blk in self.iter_blocks():
                out += blk.square().sum(0).to(torch.float64)
        return out.mul_(self.scale**2)
