"""The Triton sources of :mod:`gpfalkon.backend.triton_fly` (imported only when those kernels run, so
that ``import gpfalkon`` does not import Triton). See that module for what they compute and cost."""
from __future__ import annotations

import triton
import triton.language as tl

from ..settings import env_flag

__all__ = ["fly_cols", "fly_rows", "interpreting", "launch_options"]

# Tile shapes tried on the first launch for each augmented width / profile / precision / right-hand
# sides (Triton's autotuner times them on the device); the interpreter, and GPFALKON_TRITON_AUTOTUNE=0
# (one compilation per key instead of five, e.g. for test suites), take the first.
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_M": bm}, num_warps=w, num_stages=st)
    for bn, bm, w, st in ((64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (32, 64, 2, 2))
]
if not env_flag("GPFALKON_TRITON_AUTOTUNE", True):
    _CONFIGS = _CONFIGS[:1]
_KEY = ["a", "KIND", "PREC", "BLOCK_K"]


@triton.jit
def _profile(t, floor, KIND: tl.constexpr):
    """``phi(t)`` for ``t = FACTOR * ||x - c||^2 / ell^2`` (engine's ``_apply_profile_``)."""
    if KIND == 0:  # rbf: 2^t, t <= 0
        return tl.exp2(tl.minimum(t, 0.0))
    zp = tl.sqrt(tl.where(t <= floor, 0.0, t))  # z' = z log2(e)
    e = tl.exp2(-zp)
    if KIND == 1:
        return e
    z = zp * 0.6931471805599453
    if KIND == 2:
        return (1.0 + z) * e
    q = z + 1.5
    return (q * q + 0.75) * e


@triton.jit
def _refine_near(t, xa_ptr, ca_ptr, rn, rm, n, m, a, near, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Matern-1/2 (``KIND == 1``): the tile's distances at or below ``near (f |z_i|^2 + f |c_j|^2)`` recomputed as
    ``f sum_k (z_ik - c_jk)^2 = sum_k (xa_ik + 2 f c_jk)^2 / (4 f)`` from the coordinates (the engine's
    ``refine_near_``; ``f = log2(e)^2``, ``xa``'s first ``a - 2`` columns ``-2 f z``); a tile without such a pair is
    returned as it is."""
    if KIND == 1:
        xs = tl.load(xa_ptr + rn * a + (a - 2), mask=rn < n, other=0.0)
        cs = tl.load(ca_ptr + (a - 1) * m + rm, mask=rm < m, other=0.0)
        hit = (t <= near * (xs[:, None] + cs[None, :])) & (rn[:, None] < n) & (rm[None, :] < m)
        if tl.sum(hit.to(tl.int32)) > 0:
            ex = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k in range(0, a - 2):
                xk = tl.load(xa_ptr + rn * a + k, mask=rn < n, other=0.0)  # -2 f z
                ck = tl.load(ca_ptr + k * m + rm, mask=rm < m, other=0.0) * (-2.0 * 2.0813689810056077)
                diff = xk[:, None] - ck[None, :]
                ex += diff * diff
            t = tl.where(hit, ex * (0.25 / 2.0813689810056077), t)
    return t


@triton.jit
def _distance_tile(xa_ptr, ca_ptr, rn, rm, n, m, a, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_A: tl.constexpr, PREC: tl.constexpr):
    """``X_a[rn] C_a[:, rm]`` (``BLOCK_N x BLOCK_M``) over the augmented width in chunks of ``BLOCK_A``."""
    d = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for a0 in range(0, a, BLOCK_A):
        ra = a0 + tl.arange(0, BLOCK_A)
        xt = tl.load(xa_ptr + rn[:, None] * a + ra[None, :], mask=(rn[:, None] < n) & (ra[None, :] < a),
                     other=0.0)
        ct = tl.load(ca_ptr + ra[:, None] * m + rm[None, :], mask=(ra[:, None] < a) & (rm[None, :] < m),
                     other=0.0)
        d += tl.dot(xt, ct, input_precision=PREC)
    return d



@triton.jit
def _fly_rows(xa_ptr, ca_ptr, u_ptr, v_ptr, w_ptr, n, m, a, k, stride_v, near,
              KIND: tl.constexpr, HAS_U: tl.constexpr, HAS_V: tl.constexpr, PREC: tl.constexpr,
              BLOCK_A: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``w[rn] = K[rn] u + v[rn]`` for one tile of rows (``u``: ``(k, M)``, ``v``: ``(k, n)`` with row
    stride ``stride_v``, ``w``: ``(n, k)``; ``BLOCK_K``: ``k`` padded for ``tl.dot``, or 1)."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if HAS_U:
        if BLOCK_K == 1:  # one right-hand side: elementwise products, reduced across the tile once at the end
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for m0 in range(0, m, BLOCK_M):
                rm = m0 + tl.arange(0, BLOCK_M)
                kt = _profile(_refine_near(_distance_tile(xa_ptr, ca_ptr, rn, rm, n, m, a, BLOCK_N, BLOCK_M, BLOCK_A,
                                                          PREC), xa_ptr, ca_ptr, rn, rm, n, m, a, near, KIND,
                                           BLOCK_N, BLOCK_M), 0.0, KIND)
                # columns past M read u = 0, so the profile's value there (phi(0) = 1) adds nothing
                acc += kt * tl.load(u_ptr + rm, mask=rm < m, other=0.0)[None, :]
            w += tl.sum(acc, axis=1)[:, None]
        else:
            for m0 in range(0, m, BLOCK_M):
                rm = m0 + tl.arange(0, BLOCK_M)
                kt = _profile(_refine_near(_distance_tile(xa_ptr, ca_ptr, rn, rm, n, m, a, BLOCK_N, BLOCK_M, BLOCK_A,
                                                          PREC), xa_ptr, ca_ptr, rn, rm, n, m, a, near, KIND,
                                           BLOCK_N, BLOCK_M), 0.0, KIND)
                ut = tl.load(u_ptr + rk[None, :] * m + rm[:, None], mask=(rm[:, None] < m) & (rk[None, :] < k),
                             other=0.0)
                w += tl.dot(kt, ut, input_precision="ieee")
    if HAS_V:
        # (int64: the row stride of v is the full n, times up to k - 1)
        w += tl.load(v_ptr + rk.to(tl.int64)[None, :] * stride_v + rn[:, None],
                     mask=(rn[:, None] < n) & (rk[None, :] < k), other=0.0)
    tl.store(w_ptr + rn[:, None] * k + rk[None, :], w, mask=(rn[:, None] < n) & (rk[None, :] < k))


@triton.jit
def _fly_cols(xa_ptr, ca_ptr, w_ptr, part_ptr, n, m, a, k, rows_per_split, near,
              KIND: tl.constexpr, PREC: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_K: tl.constexpr,
              CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``part[split, rm] = sum over the split's rows of K[rows, rm]^T w[rows]`` (``w``: ``(n, k)``,
    ``part``: float64 ``(splits, M, BLOCK_K)``). Sums run in float32 over ``CHUNK`` tiles of rows at a
    time and are added into a float64 total after each: a split's millions of rows never meet in one
    float32 sum (where the products' cancellation would show its rounding)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, n)
    total = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float64)
    for c0 in range(first, last, CHUNK * BLOCK_N):
        stop = tl.minimum(c0 + CHUNK * BLOCK_N, last)
        out = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # one right-hand side: reduced once per chunk
        for n0 in range(c0, stop, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            kt = _profile(_refine_near(_distance_tile(xa_ptr, ca_ptr, rn, rm, stop, m, a, BLOCK_N, BLOCK_M, BLOCK_A,
                                                      PREC), xa_ptr, ca_ptr, rn, rm, stop, m, a, near, KIND,
                                       BLOCK_N, BLOCK_M), 0.0, KIND)
            # rows past the chunk read w = 0: they add nothing
            wt = tl.load(w_ptr + rn[:, None] * k + rk[None, :], mask=(rn[:, None] < stop) & (rk[None, :] < k),
                         other=0.0)
            if BLOCK_K == 1:
                acc += kt * wt
            else:
                out += tl.dot(tl.trans(kt), wt, input_precision="ieee")
        if BLOCK_K == 1:
            out += tl.sum(acc, axis=0)[:, None]
        total += out.to(tl.float64)
    tl.store(part_ptr + split * m * BLOCK_K + rm[:, None] * BLOCK_K + rk[None, :], total, mask=rm[:, None] < m)


def interpreting() -> bool:
    """Whether these kernels run through Triton's CPU interpreter: ``TRITON_INTERPRET=1`` in the environment
    when Triton was imported (only then are Triton's own library functions interpretable too)."""
    return type(_fly_rows).__name__ == "InterpretedFunction"


if interpreting():  # no device to time tile shapes on: the first
    fly_rows, fly_cols = _fly_rows, _fly_cols

    def launch_options() -> dict:
        """Tile shapes to pass at launch (the interpreter's; autotuned kernels choose their own)."""
        return dict(_CONFIGS[0].kwargs)
else:
    fly_rows = triton.autotune(_CONFIGS, key=[*_KEY, "HAS_U", "HAS_V"])(_fly_rows)
    fly_cols = triton.autotune(_CONFIGS, key=_KEY)(_fly_cols)

    def launch_options() -> dict:
        """Tile shapes to pass at launch (none: the autotuner chooses them)."""
        return {}
