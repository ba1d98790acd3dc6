"""The on-the-fly pass ``K^T (K u + v)`` on a CUDA GPU in two fused Triton kernels.

For ``K = phi(X_a C_a^T)`` (the stationary fast path of :class:`~gpfalkon.backend.engine.KernelEngine`:
augmented rows ``X_a`` ``(n, a)`` and centers ``C_a`` ``(M, a)`` whose product is the scaled squared
distance, ``phi`` the kernel profile) the engine's torch path writes each ``rows x M`` block of
distances to GPU memory, reads and writes it for the profile and reads it twice for the two thin
products: about 20 bytes of memory traffic per kernel value, which bounds it by memory bandwidth at a
few percent of the GPU's float32 rate (``benchmarks/results/gpu.md``). Here no kernel value leaves the
chip:

1. ``fly_rows`` (in :mod:`gpfalkon.backend._triton_kernels`; one program per ``BLOCK_N`` rows): for each
   tile of ``BLOCK_M`` centers, the distance tile in registers (``tl.dot`` over the augmented width),
   the profile, and ``w += K_tile u_tile``; then ``w += v`` and ``w`` ``(n, k)`` is written (``n k``
   values, the only thing stored).
2. ``fly_cols`` (one program per ``BLOCK_M`` centers and row split): the same distance tiles
   recomputed, ``out_tile += K_tile^T w_tile`` over its share of the rows, in float32 over chunks of
   ``64 BLOCK_N`` rows and in float64 across chunks; the float64 partial sums per split ``(splits, M, k)``
   are added by torch.

Cost: twice the distance products, ``4 n M a'`` flops (``a'``: ``a`` rounded up to the ``tl.dot`` chunk of
32), ``2 n M`` profile evaluations and ``4 n M k'`` flops for the thin products (``k' = 1`` for one
right-hand side, else ``k`` padded to at least 16 for ``tl.dot``). No ``n x M`` array is written: the
tiles re-read ``C_a`` (rows kernel) and ``X_a``, ``w`` (columns kernel) from the caches, about
``n M (a + k) (1 / BLOCK_N + 1 / BLOCK_M)`` values of cache traffic, against the unfused pass's
~20 bytes of memory traffic per kernel value. The
distances are recomputed rather than kept because a ``BLOCK_N x M`` row of them does not fit on chip for
the ``M`` FALKON uses. Distances in IEEE float32 (``tl.dot(..., input_precision="ieee")``: the CUDA
cores' FMA rate), or in TF32 on the tensor cores where :class:`gpfalkon.settings.tf32` is on. Thin
products are always IEEE float32. Memory: ``n k`` float32 values for ``w`` and ``splits x M x k'`` float64
values for the partial sums (where they do not fit, the engine takes torch's path). Tile shapes are
autotuned on the first call for each width, profile, precision and right-hand-side count, on its
first 2^18 rows. That first call compiles five tile shapes of each kernel: a process's first fit pays it
once (a one-iteration fit at n = 1e7, M = 10,000 took 20 s on an H200 with Triton's cache empty,
``benchmarks/results/gpu-h200-s32-scale.md``; the next 20-iteration fit 12.0 s); Triton keeps the compiled
kernels in its on-disk cache for later processes. ``GPFALKON_TRITON_AUTOTUNE=0`` compiles the first shape
only.

Written by hand because neither torch nor GPyTorch has a fused kernel-matrix-vector product (KeOps
does, but it is not a dependency and its reductions are single products, not ``K^T (K u)``). Float32
only; the engine keeps its torch path for float64, CPU tensors (which have the C++ kernel of
:mod:`gpfalkon.backend.fused`), generic kernels and streamed rows. ``gpfalkon.settings.triton_fly``
switches it off, or (``"interpret"``) runs it on CPU tensors through Triton's interpreter, which is how
the CPU test suite checks these kernels against the torch path.
"""
from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
from torch import Tensor

from .. import settings
from .._warn import warn_caller

__all__ = ["MAX_K", "triton_fly_available", "triton_fly_kmn_k"]

MAX_K = 64  # right-hand sides handled (partial sums splits x M x next_pow2(k)); more go through the torch path
_KINDS = {"rbf": 0, "matern12": 1, "matern32": 2, "matern52": 3}
_SPLIT_TARGET = 4  # programs of the column pass per streaming multiprocessor (row splits fill the GPU)
_MIN_SPLIT_ROWS = 512
_CHUNK_TILES = 64  # row tiles per float32 partial sum of the columns kernel (then added in float64)
_AUTO_MAX_WIDTH = 32  # augmented widths (d + 2) up to which "auto" uses the fused pass in IEEE float32
_failed: list[str] = []  # why the compiled kernels could not run, once that happened
_TUNE_ROWS = 2**18  # rows the autotuner times its tile shapes on (first call per key)
_tuned: set[tuple] = set()  # keys whose tile shape the autotuner has chosen


def _kernels() -> ModuleType | None:
    """:mod:`gpfalkon.backend._triton_kernels`, imported on first use; ``None`` where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    from . import _triton_kernels

    return _triton_kernels


def triton_fly_available(device: torch.device) -> tuple[bool, str]:
    """Whether :func:`triton_fly_kmn_k` runs on ``device`` under the current settings, and why not."""
    mode = settings.triton_fly.value()
    if mode == "off":
        return False, "gpfalkon.settings.triton_fly is 'off'"
    if mode in ("auto", "on") and device.type != "cuda":
        return False, "not a CUDA device"
    kernels = _kernels()
    if kernels is None:
        return False, "triton is not installed"
    if mode == "interpret":
        if not kernels.interpreting():
            return False, "'interpret' needs TRITON_INTERPRET=1 in the environment before triton is imported"
        return (True, "") if device.type == "cpu" else (False, "'interpret' runs on CPU tensors only")
    if kernels.interpreting():
        return False, "triton is in interpreter mode (TRITON_INTERPRET=1)"
    if _failed:
        return False, f"the kernels failed once in this process: {_failed[0][:300]}"
    return True, ""


def _precision() -> str:
    """``tl.dot``'s input precision for the distances: TF32 where :class:`gpfalkon.settings.tf32` is on."""
    return "tf32" if settings.tf32.value() else "ieee"


def _worth_it(width: int) -> bool:
    """Whether ``"auto"`` takes the fused pass for an augmented width ``width`` (input dimension + 2): where
    it was measured faster than torch's blockwise pass (on an H200, ``benchmarks/results/gpu-fused.md``:
    1.87x at d = 24, 0.89x at d = 64, 0.71x at d = 128 in IEEE float32, where computing the distances twice
    on the CUDA cores outweighs not writing them; with TF32 1.4-2.7x at every d)."""
    return settings.triton_fly.value() != "auto" or width <= _AUTO_MAX_WIDTH or settings.tf32.value()


def _splits(device: torch.device, n: int, m: int) -> int:
    """Row splits of the column pass: enough programs (``_SPLIT_TARGET`` per multiprocessor for the
    widest tile of centers) to fill the GPU, each of at least ``_MIN_SPLIT_ROWS`` rows."""
    if device.type != "cuda":  # the interpreter: two where there are rows enough, to exercise the split sums
        return max(1, min(2, n // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = _cdiv(_SPLIT_TARGET * sms, _cdiv(m, 128))
    return max(1, min(want, n // _MIN_SPLIT_ROWS))


def triton_fly_kmn_k(acc: Tensor, xa: Tensor, ca_t: Tensor, u_t: Tensor | None, v_t: Tensor | None, kind: str,
                     near: float) -> bool:
    """``acc += (u_t K^T + v_t) K`` for ``K = phi(xa @ ca_t)``, no kernel value stored (module docstring).

    Args:
        acc: ``(k, M)`` float64 on ``xa``'s device.
        xa: ``(rows, a)`` float32 augmented rows; ``ca_t``: ``(a, M)`` float32 augmented centers.
        u_t: ``(k, M)`` or ``None``; ``v_t``: ``(k, rows)`` or ``None``.
        kind: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
        near: Matern-1/2 distances at or below ``near (f |z_i|^2 + f |c_j|^2)`` are recomputed from the
            coordinates (the engine's :func:`~gpfalkon.backend.engine.refine_near_`).

    Returns:
        ``True`` if the kernels ran; ``False`` (``acc`` untouched) where they do not apply: Triton absent
        or switched off, not CUDA (or not CPU under ``"interpret"``), not float32, more than
        :data:`MAX_K` right-hand sides, an unknown profile, no rows, or (``"auto"``) a width where they
        were measured slower than torch's path.
    """
    ok, _ = triton_fly_available(xa.device)
    k = acc.shape[0]
    if (not ok or xa.dtype != torch.float32 or ca_t.dtype != torch.float32 or kind not in _KINDS
            or k > MAX_K or xa.shape[0] == 0 or acc.dtype != torch.float64 or not _worth_it(xa.shape[1])):
        return False
    kernels = _kernels()
    assert kernels is not None  # triton_fly_available found it
    xa, ca_t = xa.contiguous(), ca_t.contiguous()
    u = None if u_t is None else u_t.to(torch.float32).contiguous()
    v = None if v_t is None else v_t.to(torch.float32)
    if v is not None and v.stride(1) != 1:
        v = v.contiguous()
    opts = dict(KIND=_KINDS[kind], PREC=_precision(), BLOCK_A=max(16, min(32, _next_pow2(xa.shape[1]))),
                BLOCK_K=1 if k == 1 else max(16, _next_pow2(k)), **kernels.launch_options())
    key = (xa.device, *sorted(opts.items()), u is None, v is None)
    try:
        if key not in _tuned and not kernels.interpreting() and xa.shape[0] > _TUNE_ROWS:
            # the autotuner times each tile shape several times on the call it sees first: on the first
            # _TUNE_ROWS rows rather than all (its choice is keyed on width, profile, precision, k, not n)
            _launch(kernels, opts, xa[:_TUNE_ROWS], ca_t, u, None if v is None else v[:, :_TUNE_ROWS], k, near)
        part = _launch(kernels, opts, xa, ca_t, u, v, k, near)
        _tuned.add(key)
    except torch.cuda.OutOfMemoryError:  # w and the partial sums did not fit beside the data: torch's path
        return False
    except Exception as exc:  # a Triton / driver combination that cannot build or launch them: torch's path
        if kernels.interpreting():  # a bug in the kernels themselves: the tests must see it
            raise
        _failed.append(f"{type(exc).__name__}: {exc}")
        warn_caller(f"gpfalkon: the fused Triton pass could not run ({_failed[-1][:300]}); the kernel engine "
                      "uses torch's blockwise path from now on in this process", RuntimeWarning)
        return False
    acc += part.sum(0)[:, :k].t()
    return True


def _launch(kernels: ModuleType, opts: dict, xa: Tensor, ca_t: Tensor, u: Tensor | None, v: Tensor | None, k: int,
            near: float) -> Tensor:
    """Both kernels over the rows of ``xa``; returns the float64 partial sums ``(splits, M, BLOCK_K)``."""
    n, a = xa.shape
    m = ca_t.shape[1]
    dummy = xa.new_empty(1)
    w = torch.empty(n, k, dtype=torch.float32, device=xa.device)
    rows_per_split = _cdiv(n, _splits(xa.device, n, m))
    splits = _cdiv(n, rows_per_split)
    part = torch.empty(splits, m, opts["BLOCK_K"], dtype=torch.float64, device=xa.device)
    kernels.fly_rows[lambda meta: (_cdiv(n, meta["BLOCK_N"]),)](
        xa, ca_t, dummy if u is None else u, dummy if v is None else v, w, n, m, a, k,
        0 if v is None else v.stride(0), float(near), HAS_U=u is not None,
        HAS_V=v is not None, **opts)
    kernels.fly_cols[lambda meta: (_cdiv(m, meta["BLOCK_M"]), splits)](
        xa, ca_t, w, part, n, m, a, k, rows_per_split, float(near),
        CHUNK=_chunk_tiles(), **opts)
    return part


def _chunk_tiles() -> int:
    """Row tiles summed in float32 before each float64 addition in the columns kernel (a function so that
    tests can make it small enough to exercise several chunks with few rows)."""
    return _CHUNK_TILES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(a: int) -> int:
    return 1 << max(0, a - 1).bit_length()
