"""A fused, single-read product ``K^T (K U + V)`` for a stored ``K_nM`` on CPU.

One CG iteration of FALKON with a stored ``K_nM`` computes ``w = K_nM^T (K_nM u)``: a memory-bound
pass whose floor is one read of ``K_nM`` (``n M`` values). Two BLAS calls (``K u``, then
``K^T (.)``) read it twice; torch's batched products over cache-sized sub-blocks
(:meth:`gpfalkon.backend.engine.KernelEngine._thin_block_`) read it once from memory and once from
cache, but MKL's matrix-vector products stream memory at about half the rate one core can read
(``benchmarks/results/engine.md``). The kernel here walks the rows once, four rows ``i..i+3`` at a
time:

    s_qj = K_q . u_j + V_qj                 (q = i..i+3, j < k; four independent sums)
    acc_j += sum_q s_qj K_q                 (the four rows still in L1/L2)

so each row comes from memory once and the accumulator is loaded and stored once per four rows.
Each thread (``at::parallel_for``, OpenMP) takes its own range of rows with its own accumulator (in
the data dtype over at most ``FLUSH_ROWS`` rows, then added to a float64 one); the threads' float64
accumulators are summed at the end. Cost: ``4 n M k`` flops, one read of ``K`` from memory,
``O(threads k M)`` extra memory. Measured against the torch path in
``benchmarks/results/engine-fused.md`` / ``engine-fused-off.md``.

Why by hand: neither torch, MKL nor linear_operator has a fused ``A^T (A x)`` that reads ``A`` once;
``torch.compile`` would need the same compiler and is heavier to build. The C++ source below is
compiled on first use by :func:`torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja
are needed; the build is cached per source, torch version and install, Python and CPU, and a later
process imports the built module without calling the compiler). Where it cannot be built,
:func:`fused_available` says why and the engine keeps its batched-product path; the environment
variable ``GPFALKON_FUSED_CPU=0`` (or :func:`set_enabled`) turns the kernel off.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["FLUSH_ROWS", "MAX_K", "fused_available", "fused_kmn_k", "set_enabled"]

#: rows a thread accumulates in the data dtype before adding to its float64 accumulator
FLUSH_ROWS = 256
#: right-hand sides the kernel handles (more: the engine's batched products, compute-bound anyway)
MAX_K = 16

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <mutex>
#include <vector>

// Rows are taken R at a time: one pass over the R rows computes their k dot products with u
// (R independent accumulators: no serial dependency on one sum), a second pass adds the R rows,
// weighted, into the accumulator (now in L1/L2), so the accumulator is loaded and stored once per R
// rows rather than once per row.
template <typename T, int R>
static inline void block_rows(const T* K, int64_t i, int64_t M, const T* u, const T* v, int64_t ldv,
                              int64_t k, T* acc) {
  const T* r[R];
  for (int q = 0; q < R; ++q) r[q] = K + (i + q) * M;
  for (int64_t j = 0; j < k; ++j) {
    T w[R];
    for (int q = 0; q < R; ++q) w[q] = T(0);
    if (u != nullptr) {
      const T* uj = u + j * M;
      T s0 = T(0), s1 = T(0), s2 = T(0), s3 = T(0);
      if constexpr (R == 4) {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t c = 0; c < M; ++c) {
          const T x = uj[c];
          s0 += r[0][c] * x;
          s1 += r[1][c] * x;
          s2 += r[2][c] * x;
          s3 += r[3][c] * x;
        }
        w[0] = s0; w[1] = s1; w[2] = s2; w[3] = s3;
      } else {
#pragma omp simd reduction(+ : s0)
        for (int64_t c = 0; c < M; ++c) s0 += r[0][c] * uj[c];
        w[0] = s0;
      }
    }
    if (v != nullptr)
      for (int q = 0; q < R; ++q) w[q] += v[j * ldv + i + q];
    T* a = acc + j * M;
    if constexpr (R == 4) {
      const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma omp simd
      for (int64_t c = 0; c < M; ++c) a[c] += w0 * r[0][c] + w1 * r[1][c] + w2 * r[2][c] + w3 * r[3][c];
    } else {
      const T w0 = w[0];
#pragma omp simd
      for (int64_t c = 0; c < M; ++c) a[c] += w0 * r[0][c];
    }
  }
}

template <typename T>
static void fused_rows(const T* K, int64_t rows, int64_t M, const T* u, const T* v, int64_t ldv,
                       int64_t k, int64_t flush, double* out) {
  std::mutex lock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(k * M, T(0));
    std::vector<double> acc64(k * M, 0.0);
    for (int64_t i0 = begin; i0 < end; i0 += flush) {
      const int64_t i1 = std::min(end, i0 + flush);
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4) block_rows<T, 4>(K, i, M, u, v, ldv, k, acc.data());
      for (; i < i1; ++i) block_rows<T, 1>(K, i, M, u, v, ldv, k, acc.data());
      for (int64_t c = 0; c < k * M; ++c) {
        acc64[c] += static_cast<double>(acc[c]);
        acc[c] = T(0);
      }
    }
    std::lock_guard<std::mutex> guard(lock);
    for (int64_t c = 0; c < k * M; ++c) out[c] += acc64[c];
  });
}

// acc (k, M) float64 += U^T K^T K + V^T K, for K (rows, M) row-major, u (k, M), v (k, rows) rows
// with unit stride (leading dimension ldv); u or v may be empty (0 elements) meaning absent.
void fused_kmn_k(torch::Tensor acc, torch::Tensor K, torch::Tensor u, torch::Tensor v, int64_t flush) {
  TORCH_CHECK(K.dim() == 2 && K.is_contiguous(), "K must be a contiguous 2-D tensor");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat64 && acc.is_contiguous(), "acc must be contiguous float64");
  const int64_t rows = K.size(0), M = K.size(1), k = acc.size(0);
  TORCH_CHECK(acc.size(1) == M && k >= 1 && k <= 64, "acc must be (k, M) with 1 <= k <= 64");
  const bool has_u = u.numel() > 0, has_v = v.numel() > 0;
  TORCH_CHECK(has_u || has_v, "u or v must be given");
  if (has_u) TORCH_CHECK(u.is_contiguous() && u.size(0) == k && u.size(1) == M, "u must be contiguous (k, M)");
  if (has_v) TORCH_CHECK(v.dim() == 2 && v.size(0) == k && v.size(1) == rows && v.stride(1) == 1,
                         "v must be (k, rows) with unit column stride");
  AT_DISPATCH_FLOATING_TYPES(K.scalar_type(), "fused_kmn_k", [&] {
    TORCH_CHECK(!has_u || u.scalar_type() == K.scalar_type(), "u must have K's dtype");
    TORCH_CHECK(!has_v || v.scalar_type() == K.scalar_type(), "v must have K's dtype");
    fused_rows<scalar_t>(K.data_ptr<scalar_t>(), rows, M, has_u ? u.data_ptr<scalar_t>() : nullptr,
                         has_v ? v.data_ptr<scalar_t>() : nullptr, has_v ? v.stride(0) : 0, k, flush,
                         acc.data_ptr<double>());
  });
}
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp")
#: seconds after which a build lock left in the build directory is taken for a dead build's
_STALE_LOCK_SECONDS = 600.0

_state: dict[str, Any] = {"module": None, "error": None, "tried": False, "enabled": None}
_build_lock = threading.Lock()


def _cpu_tag() -> str:
    """A tag of the build: the source, the torch version and install (its headers; a build against
    another environment's torch is not reused), Python, and the CPU's instruction sets (the build
    uses ``-march=native``, so a cache shared by different CPUs must not hand one CPU's binary to
    another)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    text = "|".join([_SOURCE, torch.__version__, os.path.dirname(os.path.realpath(torch.__file__)),
                     platform.python_version(), platform.machine(), flags, *_FLAGS])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def set_enabled(enabled: bool | None) -> None:
    """Turn the fused kernel on or off for this process (``None``: back to ``GPFALKON_FUSED_CPU``,
    default on)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _state["enabled"] = enabled


def _enabled() -> bool:
    if _state["enabled"] is not None:
        return bool(_state["enabled"])
    return os.environ.get("GPFALKON_FUSED_CPU", "1").strip().lower() not in ("0", "false", "no", "off")


def _build_directory(name: str) -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.path.join(get_default_build_root(), "gpfalkon", name)


def _import_built(name: str, path: str) -> Any:
    """Import the built extension module at ``path`` (no compiler, no build lock)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load() -> Any:
    """The kernel's module: imported from the build directory where it was built before (every later
    process: no compiler call, no lock), else built there by ``load_inline``. A build lock left by
    another process is not waited on (that process may be building it, or have died while building):
    this process keeps the torch path; a lock older than ``_STALE_LOCK_SECONDS`` is removed."""
    with _build_lock:
        if _state["tried"]:
            return _state["module"]
        _state["tried"] = True
        name = f"gpfalkon_fused_{_cpu_tag()}"
        try:
            directory = _build_directory(name)
            built = os.path.join(directory, name + (".pyd" if sys.platform == "win32" else ".so"))
            lock = os.path.join(directory, "lock")
            if os.path.exists(built) and not os.path.exists(lock):
                _state["module"] = _import_built(name, built)
                return _state["module"]
            if os.path.exists(lock):
                if time.time() - os.path.getmtime(lock) < _STALE_LOCK_SECONDS:
                    raise RuntimeError(f"another process is building it (lock file {lock})")
                os.remove(lock)
            os.makedirs(directory, exist_ok=True)
            from torch.utils.cpp_extension import load_inline

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _state["module"] = load_inline(
                    name=name,
                    cpp_sources=[_SOURCE],
                    functions=["fused_kmn_k"],
                    extra_cflags=list(_FLAGS),
                    extra_ldflags=["-fopenmp"],
                    build_directory=directory,
                    verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return _state["module"]


def fused_available() -> tuple[bool, str]:
    """Whether the fused kernel can run here (building it on the first call), and why not."""
    if not _enabled():
        return False, "turned off (GPFALKON_FUSED_CPU=0 or set_enabled(False))"
    if _load() is None:
        return False, f"the C++ kernel could not be built ({_state['error']})"
    return True, ""


def fused_kmn_k(acc: Tensor, k_nm: Tensor, u_t: Tensor | None, v_t: Tensor | None) -> bool:
    """``acc += (u_t K + v_t) K`` in place, i.e. ``acc^T += K^T (K u + v)``, reading ``K`` once.

    Args:
        acc: ``(k, M)`` float64, contiguous, on the CPU.
        k_nm: ``(rows, M)`` contiguous, float32 or float64.
        u_t: ``(k, M)`` in ``k_nm``'s dtype, or ``None``.
        v_t: ``(k, rows)`` in ``k_nm``'s dtype with unit column stride, or ``None``.

    Returns:
        ``True`` if the fused kernel ran; ``False`` (``acc`` untouched) where it does not apply
        (not CPU, another dtype, more than :data:`MAX_K` right-hand sides, a non-contiguous
        ``K``, or the kernel unavailable): the caller then uses its own path.
    """
    if (k_nm.device.type != "cpu" or k_nm.dtype not in (torch.float32, torch.float64) or not k_nm.is_contiguous()
            or acc.shape[0] > MAX_K or acc.dtype != torch.float64 or not acc.is_contiguous()
            or k_nm.requires_grad):
        return False
    if u_t is None and v_t is None:
        raise ValueError("fused_kmn_k needs u_t or v_t")
    if not fused_available()[0]:
        return False
    empty = k_nm.new_empty(0)
    u_arg = empty if u_t is None else u_t.contiguous()
    v_arg = empty
    if v_t is not None:
        v_arg = v_t if v_t.stride(-1) == 1 else v_t.contiguous()
    _state["module"].fused_kmn_k(acc, k_nm, u_arg, v_arg, FLUSH_ROWS)
    return True
