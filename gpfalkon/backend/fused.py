"""Fused CPU kernels for ``K^T (K U + V)``: a single-read product for a stored ``K_nM``
(:func:`fused_kmn_k`), and the on-the-fly pass in cache-sized tiles (:func:`fused_fly_kmn_k`); with them,
the preconditioner's triangular solve on torch's threads (:func:`upper_solve`) and the fit's content digest
in one pass (:func:`word_digest`).

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
accumulators are summed at the end. A float32 store with float64 vectors (:class:`gpfalkon.settings.wide_products`)
runs the same loops with each stored value widened to float64 in registers and every sum in float64
(docs/math.md §3.2b). Cost: ``4 n M k`` flops, one read of ``K`` from memory,
``O(threads k M)`` extra memory. Measured against the torch path in
``benchmarks/results/engine-fused.md`` / ``engine-fused-off.md``.

The on-the-fly pass (``K_nM`` not stored) goes through the same row loop: each thread takes whole tiles
of about :data:`FLY_TILE_BYTES` and, per tile, computes the kernel values (one single-threaded GEMM on
the augmented coordinates of the engine's fast path, then the profile in place: a Matern profile in one
vectorised pass, :func:`fused_profile_`, which the engine's other passes use too) and adds the tile's
products while it is in the core's cache; see :func:`fused_fly_kmn_k`
(``benchmarks/results/engine-fused-fly.md``: 1.13-1.95x the torch path's speed).

Why by hand: neither torch, MKL nor linear_operator has a fused ``A^T (A x)`` that reads ``A`` once;
``torch.compile`` would need the same compiler and is heavier to build. The C++ source below is
compiled on first use by :func:`torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja
are needed; the build is cached per source, torch version and install, Python and CPU, and a later
process imports the built module without calling the compiler). Where it cannot be built,
:func:`fused_available` says why and the engine keeps its batched-product path; the environment
variable ``GPFALKON_FUSED_CPU=0`` (or :func:`set_enabled`) turns both kernels off.
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

from ..settings import env_flag

__all__ = ["FLUSH_ROWS", "FLY_TILE_BYTES", "MAX_K", "MAX_SOLVE_K", "SOLVE_BLOCK", "SOLVE_MIN_M", "fly_applies",
           "fly_tile_rows", "fused_available", "fused_fly_kmn_k", "fused_kmn_k", "fused_profile_", "set_enabled",
           "upper_solve", "word_digest"]

#: rows a thread accumulates in the data dtype before adding to its float64 accumulator
FLUSH_ROWS = 256
#: right-hand sides the kernel handles (more: the engine's batched products, compute-bound anyway)
MAX_K = 16
#: bytes of one thread's kernel tile in the on-the-fly kernel (``fused_fly_kmn_k``): about a core's
#: share of the cache, so the profile pass and both products re-read the tile from it
#: (``benchmarks/results/engine-fused-fly.md`` measures 1, 2 and 4 MiB)
FLY_TILE_BYTES = 2 * 2**20
#: rows of the blocks of :func:`upper_solve` (the block size's measurement: ``benchmarks/results/triangular-solve.md``)
SOLVE_BLOCK = 128
#: right-hand sides :func:`upper_solve` takes (more: LAPACK's blocked solve, compute-bound then)
MAX_SOLVE_K = 16
#: the smallest factor :func:`upper_solve` takes, per dtype: below it LAPACK's solve is as fast or faster
#: (``benchmarks/results/triangular-solve.md``: float32 factors cross over later than float64 ones)
SOLVE_MIN_M: dict[torch.dtype, int] = {torch.float64: 1024, torch.float32: 1536}
_KINDS = {"rbf": 0, "matern12": 1, "matern32": 2, "matern52": 3}

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>

// w_q = r_q . uj for the R rows r_q = K0 + q M (R independent sums: no serial dependency on one sum)
// (S: the stored rows' type; products in T, the rows widened where S is narrower: a float32 store with float64
// products, gpfalkon.backend.engine's mixed products)
template <typename T, int R, typename S = T>
__attribute__((always_inline)) static inline void row_dots(const S* K0, int64_t M, const T* __restrict uj, T* w) {
  const S* __restrict r0 = K0;
  const S* __restrict r1 = K0 + (R > 1 ? M : 0);
  const S* __restrict r2 = K0 + (R > 2 ? 2 * M : 0);
  const S* __restrict r3 = K0 + (R > 3 ? 3 * M : 0);
  const S* __restrict r4 = K0 + (R > 4 ? 4 * M : 0);
  const S* __restrict r5 = K0 + (R > 5 ? 5 * M : 0);
  const S* __restrict r6 = K0 + (R > 6 ? 6 * M : 0);
  const S* __restrict r7 = K0 + (R > 7 ? 7 * M : 0);
  T s0 = T(0), s1 = T(0), s2 = T(0), s3 = T(0), s4 = T(0), s5 = T(0), s6 = T(0), s7 = T(0);
  if constexpr (R == 8) {
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
    for (int64_t c = 0; c < M; ++c) {
      const T x = uj[c];
      s0 += static_cast<T>(r0[c]) * x;
      s1 += static_cast<T>(r1[c]) * x;
      s2 += static_cast<T>(r2[c]) * x;
      s3 += static_cast<T>(r3[c]) * x;
      s4 += static_cast<T>(r4[c]) * x;
      s5 += static_cast<T>(r5[c]) * x;
      s6 += static_cast<T>(r6[c]) * x;
      s7 += static_cast<T>(r7[c]) * x;
    }
    w[0] = s0; w[1] = s1; w[2] = s2; w[3] = s3; w[4] = s4; w[5] = s5; w[6] = s6; w[7] = s7;
  } else if constexpr (R == 4) {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t c = 0; c < M; ++c) {
      const T x = uj[c];
      s0 += static_cast<T>(r0[c]) * x;
      s1 += static_cast<T>(r1[c]) * x;
      s2 += static_cast<T>(r2[c]) * x;
      s3 += static_cast<T>(r3[c]) * x;
    }
    w[0] = s0; w[1] = s1; w[2] = s2; w[3] = s3;
  } else {
#pragma omp simd reduction(+ : s0)
    for (int64_t c = 0; c < M; ++c) s0 += static_cast<T>(r0[c]) * uj[c];
    w[0] = s0;
  }
}

// a += sum_q w_q r_q over the R rows r_q = K0 + q M
template <typename T, int R, typename S = T>
__attribute__((always_inline)) static inline void row_axpys(const S* K0, int64_t M, const T* w, T* __restrict a) {
  const S* __restrict r0 = K0;
  const S* __restrict r1 = K0 + (R > 1 ? M : 0);
  const S* __restrict r2 = K0 + (R > 2 ? 2 * M : 0);
  const S* __restrict r3 = K0 + (R > 3 ? 3 * M : 0);
  const S* __restrict r4 = K0 + (R > 4 ? 4 * M : 0);
  const S* __restrict r5 = K0 + (R > 5 ? 5 * M : 0);
  const S* __restrict r6 = K0 + (R > 6 ? 6 * M : 0);
  const S* __restrict r7 = K0 + (R > 7 ? 7 * M : 0);
  if constexpr (R == 8) {
    const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4], w5 = w[5], w6 = w[6], w7 = w[7];
#pragma omp simd
    for (int64_t c = 0; c < M; ++c)
      a[c] += (w0 * static_cast<T>(r0[c]) + w1 * static_cast<T>(r1[c]) + w2 * static_cast<T>(r2[c]) +
               w3 * static_cast<T>(r3[c])) +
              (w4 * static_cast<T>(r4[c]) + w5 * static_cast<T>(r5[c]) + w6 * static_cast<T>(r6[c]) +
               w7 * static_cast<T>(r7[c]));
  } else if constexpr (R == 4) {
    const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma omp simd
    for (int64_t c = 0; c < M; ++c)
      a[c] += w0 * static_cast<T>(r0[c]) + w1 * static_cast<T>(r1[c]) + w2 * static_cast<T>(r2[c]) +
              w3 * static_cast<T>(r3[c]);
  } else {
    const T w0 = w[0];
#pragma omp simd
    for (int64_t c = 0; c < M; ++c) a[c] += w0 * static_cast<T>(r0[c]);
  }
}

// Rows are taken R at a time (8, then 4 and 1 for the remainder): one pass over the R rows computes their
// k dot products with u, a second pass adds the R rows, weighted, into the accumulator (now in L1/L2), so
// the accumulator is loaded and stored once per R rows rather than once per row. R = 8 read the stored K
// 5-10 % faster than R = 4 (0.84-0.86 of torch.sum's read rate against 0.77-0.81, 200,000 x 2,000 float32
// on 2 EPYC cores).
template <typename T, int R, typename S = T>
static inline void block_rows(const S* K, int64_t i, int64_t M, const T* u, const T* v, int64_t ldv,
                              int64_t k, T* acc) {
  const S* K0 = K + i * M;
  for (int64_t j = 0; j < k; ++j) {
    T w[R];
    for (int q = 0; q < R; ++q) w[q] = T(0);
    if (u != nullptr) row_dots<T, R, S>(K0, M, u + j * M, w);
    if (v != nullptr)
      for (int q = 0; q < R; ++q) w[q] += v[j * ldv + i + q];
    row_axpys<T, R, S>(K0, M, w, acc + j * M);
  }
}

// A 16-bit fixed-point store (gpfalkon.settings.store_format "int16"): row i of K is q_i s_i with integers
// |q_ic| <= 32767 and one scale s_i = max_c |K_ic| / 32767 per row (absolute error at most s_i / 2).
// quantize_row: the T values b (one row of M) into q and s (returned), and b rounded in place to q s, the values
// every pass uses (the first pass's products included). Round to nearest even (as torch.round). A row with a
// non-finite value gets s = NaN and q = 0, so its products are NaN as with the data's dtype; a zero row s = 0.
template <typename T>
static inline T quantize_row(T* __restrict b, int16_t* __restrict q, int64_t M) {
  T top = T(0), probe = T(0);
#pragma omp simd reduction(max : top) reduction(+ : probe)
  for (int64_t c = 0; c < M; ++c) {
    const T a = b[c] < T(0) ? -b[c] : b[c];
    top = a > top ? a : top;
    probe += b[c] * T(0);  // NaN where some value is NaN or infinite
  }
  if (probe != T(0)) {
    for (int64_t c = 0; c < M; ++c) {
      q[c] = 0;
      b[c] = std::numeric_limits<T>::quiet_NaN();
    }
    return std::numeric_limits<T>::quiet_NaN();
  }
  if (top == T(0)) {
    for (int64_t c = 0; c < M; ++c) q[c] = 0;
    return T(0);
  }
  const T scale = top / T(32767);
#pragma omp simd
  for (int64_t c = 0; c < M; ++c) {
    T r = std::nearbyint(b[c] / scale);
    r = r > T(32767) ? T(32767) : (r < T(-32767) ? T(-32767) : r);
    q[c] = static_cast<int16_t>(r);
    b[c] = r * scale;
  }
  return scale;
}

// q s to T values into dst (one row)
template <typename T>
static inline void dequantize_row(const int16_t* __restrict q, T scale, T* __restrict dst, int64_t M) {
#pragma omp simd
  for (int64_t c = 0; c < M; ++c) dst[c] = static_cast<T>(q[c]) * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// One AVX2 vector of T (eight float32 or four float64 lanes): loads of T values, or of int16 values widened to
// T in registers (a fixed-point store read at two bytes a value), and the arithmetic the row loops below use.
template <typename T> struct Vec;
template <> struct Vec<float> {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const int16_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float lanes(V x) {
    float l[8];
    _mm256_storeu_ps(l, x);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
};
template <> struct Vec<double> {
  using V = __m256d;
  static constexpr int64_t W = 4;
  static V zero() { return _mm256_setzero_pd(); }
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static V load(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
  static V load(const int16_t* p) {
    return _mm256_cvtepi32_pd(_mm_cvtepi16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(double* p, V x) { _mm256_storeu_pd(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static double lanes(V x) {
    double l[4];
    _mm256_storeu_pd(l, x);
    return (l[0] + l[1]) + (l[2] + l[3]);
  }
};

// Several right-hand sides (k >= 3), eight rows at a time, over a float32 / float64 store or an int16 one (rows
// of S values; sc: the int16 rows' scales, nullptr otherwise): the dot products of four rows with three vectors
// in one pass over the rows (twelve accumulators: each row value loaded, and widened, once for three vectors),
// then one pass that adds the eight weighted rows into each of the k accumulator rows, the rows held in
// registers. block_rows instead passes over the rows twice per vector; this reads the core's cache about half
// as much and was 1.3-1.6x faster at k = 10-16, 1.06-1.24x at k = 4, on a par at k = 2
// (benchmarks/results/product-rate-s37.md).
// w[q * ldw + j] = row_q . u_j for R rows and J vectors
template <typename T, typename S, int R, int J>
static inline void dots_rj(const S* __restrict K0, int64_t M, int64_t MW, const T* u, T* w, int64_t ldw) {
  using X = Vec<T>;
  typename X::V s[R][J];
  for (int q = 0; q < R; ++q)
    for (int j = 0; j < J; ++j) s[q][j] = X::zero();
  for (int64_t c = 0; c < MW; c += X::W) {
    typename X::V x[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) x[j] = X::load(u + j * M + c);
#pragma GCC unroll 8
    for (int q = 0; q < R; ++q) {
      const typename X::V r = X::load(K0 + q * M + c);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) s[q][j] = X::fma(r, x[j], s[q][j]);
    }
  }
  for (int q = 0; q < R; ++q)
    for (int j = 0; j < J; ++j) {
      T t = X::lanes(s[q][j]);
      for (int64_t c = MW; c < M; ++c) t += static_cast<T>(K0[q * M + c]) * u[j * M + c];
      w[q * ldw + j] = t;
    }
}

// acc_j += sum_q (s_q row_q . u_j + v_j[i + q]) s_q row_q for the eight rows K0 .. K0 + 8 M (s_q = sc[q], 1 without
// scales) and the k <= 64 vectors u_j (u or v may be nullptr, meaning zero)
template <typename T, typename S>
static inline void rows8_rhs(const S* __restrict K0, const T* sc, int64_t M, const T* u, const T* v, int64_t ldv,
                             int64_t i, int64_t k, T* acc) {
  using X = Vec<T>;
  const int64_t MW = M / X::W * X::W;
  T w[8 * 64];
  if (u == nullptr) std::fill(w, w + 8 * k, T(0));
  for (int h = 0; h < 8 && u != nullptr; h += 4) {
    int64_t j = 0;
    for (; j + 3 <= k; j += 3) dots_rj<T, S, 4, 3>(K0 + h * M, M, MW, u + j * M, w + h * k + j, k);
    for (; j + 2 <= k; j += 2) dots_rj<T, S, 4, 2>(K0 + h * M, M, MW, u + j * M, w + h * k + j, k);
    for (; j < k; ++j) dots_rj<T, S, 4, 1>(K0 + h * M, M, MW, u + j * M, w + h * k + j, k);
  }
  for (int q = 0; q < 8; ++q)
    for (int64_t j = 0; j < k; ++j) {
      T t = w[q * k + j];
      if (sc != nullptr) t *= sc[q];
      if (v != nullptr) t += v[j * ldv + i + q];
      w[q * k + j] = sc != nullptr ? t * sc[q] : t;  // the weight of the stored (unscaled) row
    }
  for (int64_t c = 0; c < MW; c += X::W) {
    typename X::V r[8];
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) r[q] = X::load(K0 + q * M + c);
    for (int64_t j = 0; j < k; ++j) {
      typename X::V a0 = X::mul(X::set1(w[j]), r[0]);
      typename X::V a1 = X::mul(X::set1(w[4 * k + j]), r[4]);
#pragma GCC unroll 3
      for (int q = 1; q < 4; ++q) {
        a0 = X::fma(X::set1(w[q * k + j]), r[q], a0);
        a1 = X::fma(X::set1(w[(q + 4) * k + j]), r[q + 4], a1);
      }
      X::store(acc + j * M + c, X::add(X::load(acc + j * M + c), X::add(a0, a1)));
    }
  }
  for (int64_t c = MW; c < M; ++c)
    for (int64_t j = 0; j < k; ++j) {
      T t = T(0);
      for (int q = 0; q < 8; ++q) t += w[q * k + j] * static_cast<T>(K0[q * M + c]);
      acc[j * M + c] += t;
    }
}

// Eight rows src_q = src + q M of S values (an int16 fixed-point store, or float32 rows with float64 products T),
// products in T. MW: the columns in whole vectors; the tail columns MW .. M - 1 are scalar.
// s_q += the eight rows' products with u over the first MW columns (one vector accumulator per row)
template <typename T, typename S>
static inline void dots8(const S* __restrict src, int64_t M, int64_t MW, const T* u, typename Vec<T>::V* s) {
  using X = Vec<T>;
  for (int64_t c = 0; c < MW; c += X::W) {
    const typename X::V x = X::load(u + c);
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) s[q] = X::fma(X::load(src + q * M + c), x, s[q]);
  }
}

// sum_q wq_q src_q[c ..] for the columns of the vector at c (two chains of four rows)
template <typename T, typename S>
static inline typename Vec<T>::V axpy8_at(const S* __restrict src, int64_t M, int64_t c, const T* wq) {
  using X = Vec<T>;
  typename X::V p0 = X::mul(X::set1(wq[0]), X::load(src + c));
  typename X::V p1 = X::mul(X::set1(wq[4]), X::load(src + 4 * M + c));
#pragma GCC unroll 3
  for (int q = 1; q < 4; ++q) {
    p0 = X::fma(X::set1(wq[q]), X::load(src + q * M + c), p0);
    p1 = X::fma(X::set1(wq[q + 4]), X::load(src + (q + 4) * M + c), p1);
  }
  return X::add(p0, p1);
}

// a += sum_q wq_q src_q over the M columns c from `from` on (the vectors, then the tail)
template <typename T, typename S>
static inline void axpy8(const S* __restrict src, int64_t M, int64_t MW, const T* wq, T* a, int64_t from = 0) {
  using X = Vec<T>;
  for (int64_t c = from; c < MW; c += X::W) X::store(a + c, X::add(X::load(a + c), axpy8_at<T, S>(src, M, c, wq)));
  for (int64_t c = MW; c < M; ++c) {
    T t = T(0);
    for (int q = 0; q < 8; ++q) t += wq[q] * static_cast<T>(src[q * M + c]);
    a[c] += t;
  }
}

// w_q = (the lanes of s_q summed + the tail columns' products with u) sc_q (+ v_q); sc nullptr: no scales
template <typename T, typename S>
static inline void finish8(const S* __restrict src, int64_t M, int64_t MW, const T* u,
                           const typename Vec<T>::V* s, const T* sc, const T* v, T* w) {
  for (int q = 0; q < 8; ++q) {
    T t = Vec<T>::lanes(s[q]);
    for (int64_t c = MW; c < M; ++c) t += static_cast<T>(src[q * M + c]) * u[c];
    w[q] = (sc != nullptr ? t * sc[q] : t) + (v != nullptr ? v[q] : T(0));
  }
}

// The products of one right-hand side u over the groups of eight rows g = 0 .. groups - 1 (src; int16 rows: scales sc,
// rows i0 ..), software-pipelined: one loop over the columns adds group g's weighted rows into the accumulator
// (from the cache) while it takes group g + 1's dot products (from memory) and prefetches group g + 2's cache
// lines into L2, so the read from memory overlaps both passes and crosses the rows' page boundaries, where the
// hardware's stream prefetchers stop (eight 2-byte rows of M = 2,000 are one 4 KiB page each). The prefetch goes to
// L2 (_MM_HINT_T1), not L1: a group is 8 M values, more than L1 holds past M = 1,000 float32 values, and pulling
// group g + 2 into L1 evicted the lines of groups g and g + 1 that the loop was reading (on 2 EPYC cores, 1.6 GB
// stores, k = 1: widened float32 rows 0.78-0.85 of torch.sum's rate with L1 prefetches (product-rate-s49.md),
// 0.90-0.97 with L2 ones at M = 500-5,000; int16 stores with float32 scales 1.04-1.77x faster; in one process on
// the same stores, benchmarks/results/product-rate-s50.md). Measured in
// benchmarks/results/store-int16.md: without the prefetch float32 read the store at 0.46-0.64 of torch.sum's
// rate, with it 0.76-0.85; float64 reads it 1.6-1.9x faster than dequantizing each group into the cache did
// (benchmarks/results/product-rate-s37.md). Over a float32 or float64 store it reads faster than block_rows
// while a group is small (NARROW_GROUP_BYTES), over float32 rows widened to float64 products (S float, T double,
// sc nullptr) while a group fits the core's L2 (WIDE_GROUP_BYTES).
template <typename T, typename S>
static inline void groups1(const S* __restrict src, const T* sc, int64_t i0, int64_t groups, int64_t M,
                           const T* u, const T* v, T* a) {
  using X = Vec<T>;
  constexpr int64_t LINE = 64 / sizeof(S);  // stored columns per cache line (a multiple of W)
  const int64_t MW = M / X::W * X::W;
  T w[8];
  typename X::V s[8];
  for (int q = 0; q < 8; ++q) s[q] = X::zero();
  dots8<T, S>(src, M, MW, u, s);  // group 0's dot products
  finish8<T, S>(src, M, MW, u, s, sc, v != nullptr ? v + i0 : nullptr, w);
  for (int64_t g = 0; g < groups; ++g) {
    const S* cur = src + g * 8 * M;
    const S* nxt = cur + 8 * M;
    T wq[8];
    for (int q = 0; q < 8; ++q) wq[q] = sc != nullptr ? w[q] * sc[g * 8 + q] : w[q];
    if (g + 1 == groups) {  // the last group: its second pass alone
      axpy8<T, S>(cur, M, MW, wq, a);
      break;
    }
    for (int q = 0; q < 8; ++q) s[q] = X::zero();
    for (int64_t c = 0; c < MW; c += X::W) {
      const typename X::V x = X::load(u + c);
      const typename X::V add = axpy8_at<T>(cur, M, c, wq);
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) s[q] = X::fma(X::load(nxt + q * M + c), x, s[q]);
      if (c % LINE == 0 && g + 2 < groups) {
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) _mm_prefetch(reinterpret_cast<const char*>(nxt + (8 + q) * M + c), _MM_HINT_T1);
      }
      X::store(a + c, X::add(X::load(a + c), add));
    }
    axpy8<T, S>(cur, M, MW, wq, a, MW);  // the tail columns
    finish8<T, S>(nxt, M, MW, u, s, sc != nullptr ? sc + (g + 1) * 8 : nullptr,
                  v != nullptr ? v + i0 + (g + 1) * 8 : nullptr, w);
  }
}
#endif

// acc64 += rows begin .. end - 1 of K's products, summed in T over at most `flush` rows at a time (K's rows of S
// values: T's own, or float32 rows with float64 products). rows8_rhs from KMIN right-hand sides on: 3 for T's own
// rows; 2 for widened float32 rows, where it widens each value once for both vectors (84-89 against 97-98 ms at
// k = 2, 200,000 x 2,000 on 2 EPYC cores; at k = 1 block_rows was faster, 69 against 78 ms)
// The largest group of eight widened rows (float32 rows with float64 products) that rows_into takes through groups1
// at one right-hand side: 1.08-1.23x block_rows' rate at M = 1,000-5,000 (1.6 GB float32 stores on 2 EPYC cores,
// benchmarks/results/product-rate-s49.md against -before.md; 1.11-1.42x more with the L2 prefetch at M = 500-5,000,
// product-rate-s50.md), slower past it (0.83-0.97x at M = 7,000-10,000 in runs of benchmarks/product_rate.py with
// this bound lifted, the numbers in fit-reference-s49.md's note; 0.87x at 10,000 with the L2 prefetch)
constexpr int64_t WIDE_GROUP_BYTES = 160 * 1024;
// The same for a store's own dtype (float32 or float64 rows and products): 1.06-1.6x block_rows' rate up to
// 48 KiB a group (float32 M = 500-1,500, float64 M = 500), 0.99-1.06x at 64 KiB (float32 M = 2,000, float64
// 1,000), 0.80-1.05x past it (float32 M = 3,000-10,000, float64 1,500-10,000; product-rate-s50.md's note)
constexpr int64_t NARROW_GROUP_BYTES = 48 * 1024;

template <typename T, typename S = T, int KMIN = 3>
static void rows_into(const S* K, int64_t begin, int64_t end, int64_t M, const T* u, const T* v, int64_t ldv,
                      int64_t k, int64_t flush, std::vector<T>& acc, std::vector<double>& acc64) {
  for (int64_t i0 = begin; i0 < end; i0 += flush) {
    const int64_t i1 = std::min(end, i0 + flush);
    int64_t i = i0;
#if defined(__AVX2__) && defined(__FMA__)
    // one vector: pipelined while a group is small enough (widened rows: while it fits L2)
    constexpr int64_t group_bytes = std::is_same<T, S>::value ? NARROW_GROUP_BYTES : WIDE_GROUP_BYTES;
    if (k == 1 && u != nullptr && i + 16 <= i1 && 8 * M * static_cast<int64_t>(sizeof(S)) <= group_bytes) {
      const int64_t groups = (i1 - i) / 8;
      groups1<T, S>(K + i * M, nullptr, i, groups, M, u, v, acc.data());
      i += groups * 8;
    }
    if (k >= KMIN && u != nullptr)
      for (; i + 8 <= i1; i += 8) rows8_rhs<T, S>(K + i * M, nullptr, M, u, v, ldv, i, k, acc.data());
#endif
    for (; i + 8 <= i1; i += 8) block_rows<T, 8, S>(K, i, M, u, v, ldv, k, acc.data());
    for (; i + 4 <= i1; i += 4) block_rows<T, 4, S>(K, i, M, u, v, ldv, k, acc.data());
    for (; i < i1; ++i) block_rows<T, 1, S>(K, i, M, u, v, ldv, k, acc.data());
    for (int64_t c = 0; c < k * M; ++c) {
      acc64[c] += static_cast<double>(acc[c]);
      acc[c] = T(0);
    }
  }
}

// rows_into for an int16 store (scales sc), read from memory once at 2 bytes a value: on a CPU with AVX2, eight
// rows at a time widened in registers (groups1 for one right-hand side, rows8_rhs for more); otherwise (no
// AVX2, and the last rows of fewer than eight) each group of rows is dequantized into `rowbuf` (8 M values, in
// the core's cache) and block_rows runs on it
template <typename T>
static void fixed_rows_into(const int16_t* K, const T* sc, int64_t begin, int64_t end, int64_t M, const T* u,
                            const T* v, int64_t ldv, int64_t k, int64_t flush, std::vector<T>& acc,
                            std::vector<double>& acc64, std::vector<T>& rowbuf) {
  for (int64_t i0 = begin; i0 < end; i0 += flush) {
    const int64_t i1 = std::min(end, i0 + flush);
    int64_t i = i0;
#if defined(__AVX2__) && defined(__FMA__)
    if (k == 1 && u != nullptr && i + 16 <= i1) {
      const int64_t groups = (i1 - i) / 8;
      groups1<T, int16_t>(K + i * M, sc + i, i, groups, M, u, v, acc.data());
      i += groups * 8;
    }
    for (; i + 8 <= i1; i += 8) rows8_rhs<T, int16_t>(K + i * M, sc + i, M, u, v, ldv, i, k, acc.data());
#endif
    for (; i + 8 <= i1; i += 8) {
      for (int q = 0; q < 8; ++q) dequantize_row<T>(K + (i + q) * M, sc[i + q], rowbuf.data() + q * M, M);
      block_rows<T, 8>(rowbuf.data(), 0, M, u, v != nullptr ? v + i : nullptr, ldv, k, acc.data());
    }
    for (; i < i1; ++i) {
      dequantize_row<T>(K + i * M, sc[i], rowbuf.data(), M);
      block_rows<T, 1>(rowbuf.data(), 0, M, u, v != nullptr ? v + i : nullptr, ldv, k, acc.data());
    }
    for (int64_t c = 0; c < k * M; ++c) {
      acc64[c] += static_cast<double>(acc[c]);
      acc[c] = T(0);
    }
  }
}

template <typename T, typename S = T, int KMIN = 3>
static void fused_rows(const S* K, int64_t rows, int64_t M, const T* u, const T* v, int64_t ldv,
                       int64_t k, int64_t flush, double* out) {
  std::mutex lock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(k * M, T(0));
    std::vector<double> acc64(k * M, 0.0);
    rows_into<T, S, KMIN>(K, begin, end, M, u, v, ldv, k, flush, acc, acc64);
    std::lock_guard<std::mutex> guard(lock);
    for (int64_t c = 0; c < k * M; ++c) out[c] += acc64[c];
  });
}

template <typename T>
static void fused_fixed_rows(const int16_t* K, const T* sc, int64_t rows, int64_t M, const T* u, const T* v,
                             int64_t ldv, int64_t k, int64_t flush, double* out) {
  std::mutex lock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(k * M, T(0));
    std::vector<double> acc64(k * M, 0.0);
    std::vector<T> rowbuf(8 * M);
    fixed_rows_into<T>(K, sc, begin, end, M, u, v, ldv, k, flush, acc, acc64, rowbuf);
    std::lock_guard<std::mutex> guard(lock);
    for (int64_t c = 0; c < k * M; ++c) out[c] += acc64[c];
  });
}

// acc (k, M) with 1 <= k <= 64; u (k, M) contiguous or empty; v (k, rows) with unit column stride or empty
static void check_operands(const torch::Tensor& acc, const torch::Tensor& u, const torch::Tensor& v, int64_t rows,
                           int64_t M) {
  const int64_t k = acc.size(0);
  TORCH_CHECK(acc.size(1) == M && k >= 1 && k <= 64, "acc must be (k, M) with 1 <= k <= 64");
  TORCH_CHECK(u.numel() > 0 || v.numel() > 0, "u or v must be given");
  if (u.numel() > 0) TORCH_CHECK(u.is_contiguous() && u.size(0) == k && u.size(1) == M, "u must be contiguous (k, M)");
  if (v.numel() > 0) TORCH_CHECK(v.dim() == 2 && v.size(0) == k && v.size(1) == rows && v.stride(1) == 1,
                                 "v must be (k, rows) with unit column stride");
}

// acc (k, M) float64 += U^T K^T K + V^T K, for K (rows, M) row-major, u (k, M), v (k, rows) rows
// with unit stride (leading dimension ldv); u or v may be empty (0 elements) meaning absent.
// K int16: the rows q_i of a fixed-point store, K_i = q_i scale_i (scale (rows,) in u's dtype; else empty).
void fused_kmn_k(torch::Tensor acc, torch::Tensor K, torch::Tensor u, torch::Tensor v, torch::Tensor scale,
                 int64_t flush) {
  TORCH_CHECK(K.dim() == 2 && K.is_contiguous(), "K must be a contiguous 2-D tensor");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat64 && acc.is_contiguous(), "acc must be contiguous float64");
  const int64_t rows = K.size(0), M = K.size(1), k = acc.size(0);
  const bool has_u = u.numel() > 0, has_v = v.numel() > 0;
  check_operands(acc, u, v, rows, M);
  if (K.scalar_type() == torch::kInt16) {  // an int16 store: row scales and products in the scales' dtype
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == rows && scale.is_contiguous(), "scale must be (rows,)");
    AT_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "fused_kmn_k_fixed", [&] {
      TORCH_CHECK(!has_u || u.scalar_type() == scale.scalar_type(), "u must have scale's dtype");
      TORCH_CHECK(!has_v || v.scalar_type() == scale.scalar_type(), "v must have scale's dtype");
      fused_fixed_rows<scalar_t>(K.data_ptr<int16_t>(), scale.data_ptr<scalar_t>(), rows, M,
                                 has_u ? u.data_ptr<scalar_t>() : nullptr, has_v ? v.data_ptr<scalar_t>() : nullptr,
                                 has_v ? v.stride(0) : 0, k, flush, acc.data_ptr<double>());
    });
    return;
  }
  const bool wide = (has_u ? u : v).scalar_type() == torch::kFloat64 && K.scalar_type() == torch::kFloat32;
  if (wide) {  // a float32 K with float64 products (the rows widened in registers)
    TORCH_CHECK(!has_u || u.scalar_type() == torch::kFloat64, "u must be float64 with v");
    TORCH_CHECK(!has_v || v.scalar_type() == torch::kFloat64, "v must be float64 with u");
    fused_rows<double, float, 2>(K.data_ptr<float>(), rows, M, has_u ? u.data_ptr<double>() : nullptr,
                                 has_v ? v.data_ptr<double>() : nullptr, has_v ? v.stride(0) : 0, k, flush,
                                 acc.data_ptr<double>());
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(K.scalar_type(), "fused_kmn_k", [&] {
    TORCH_CHECK(!has_u || u.scalar_type() == K.scalar_type(), "u must have K's dtype");
    TORCH_CHECK(!has_v || v.scalar_type() == K.scalar_type(), "v must have K's dtype");
    fused_rows<scalar_t>(K.data_ptr<scalar_t>(), rows, M, has_u ? u.data_ptr<scalar_t>() : nullptr,
                         has_v ? v.data_ptr<scalar_t>() : nullptr, has_v ? v.stride(0) : 0, k, flush,
                         acc.data_ptr<double>());
  });
}

// The Matern profiles phi (gpfalkon.backend.engine._apply_profile_) in one vectorised pass over contiguous
// values: with z' = sqrt(t) (t at or below zero_below taken as 0), kind 1 Matern-1/2 2^-z', 2 Matern-3/2
// (1 + z' ln 2) 2^-z', 3 Matern-5/2 ((z' ln 2 + 1.5)^2 + 0.75) 2^-z'. 2^x for x <= 0 by
// exp2_nonpos: x = n + f with n the nearest integer (the 1.5 * 2^p rounding trick) and |f| <= 1/2, 2^f by its
// Taylor polynomial in f ln 2 (degree 7 in float32, 12 in float64: truncation below a quarter of an ulp),
// 2^n written into the exponent bits; below the normal range (2^-126 / 2^-1022) as 2^(x + 64) 2^-64
// (float64: 128), so subnormal results round once, as torch.exp2's do, and underflow to 0 past them (a
// clamped argument there only ever gives 0). Plain C++ that the
// compiler vectorises (-O3 -march=native -fno-math-errno): ATen's vectorised exp2 is not reachable from
// an extension, and its in-place operations take one pass over the tile per operation (eight for
// Matern-5/2). NaN stays NaN.
// The constants of exp2_nonpos per dtype: the rounding constant 1.5 * 2^p and its bit pattern, the exponent bias
// and shift, the smallest normal exponent, the lift applied below it (2^lift, and 2^-lift exactly), and
// the degree of the Taylor polynomial.
template <typename T> struct Exp2Traits;
template <> struct Exp2Traits<float> {
  using Int = int32_t;
  static constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  static constexpr Int kRoundBits = 0x4B400000;
  static constexpr Int kBias = 127;
  static constexpr int kShift = 23;
  static constexpr float kMinNormal = -126.0f;
  static constexpr float kLift = 64.0f;
  static constexpr float kDrop = 5.42101086242752217e-20f;  // 2^-64
  static constexpr int kDegree = 7;
};
template <> struct Exp2Traits<double> {
  using Int = int64_t;
  static constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr Int kRoundBits = 0x4338000000000000LL;
  static constexpr Int kBias = 1023;
  static constexpr int kShift = 52;
  static constexpr double kMinNormal = -1022.0;
  static constexpr double kLift = 128.0;
  static constexpr double kDrop = 2.93873587705571877e-39;  // 2^-128
  static constexpr int kDegree = 12;
};

// 1 / k! for k = 0 .. D, computed by the compiler
template <int D> struct InverseFactorials {
  double c[D + 1];
  constexpr InverseFactorials() : c() {
    c[0] = 1.0;
    for (int k = 1; k <= D; ++k) c[k] = c[k - 1] / k;
  }
};

template <typename T>
static inline T exp2_nonpos(T x) {
  using Tr = Exp2Traits<T>;
  using Int = typename Tr::Int;
  const bool low = x < Tr::kMinNormal;  // below the normal range: 2^(x + lift) 2^-lift, rounded once
  const T xs = low ? x + Tr::kLift : x;
  const T xc = xs < Tr::kMinNormal ? Tr::kMinNormal : xs;
  const T t = xc + Tr::kRound;  // rounds xc to the nearest integer n (in t's low bits)
  const T nf = t - Tr::kRound;
  Int ti;
  std::memcpy(&ti, &t, sizeof(T));
  const T f = (xc - nf) * T(0.69314718055994530942);  // |f| <= ln 2 / 2
  static constexpr InverseFactorials<Tr::kDegree> kTaylor{};
  T p = T(kTaylor.c[Tr::kDegree]);
#pragma GCC unroll 16
  for (int k = Tr::kDegree - 1; k >= 0; --k) p = p * f + T(kTaylor.c[k]);
  const Int e = (ti - Tr::kRoundBits + Tr::kBias) << Tr::kShift;
  T scale;
  std::memcpy(&scale, &e, sizeof(T));
  return low ? (p * scale) * Tr::kDrop : p * scale;
}

// kind 1-3 (the Matern profiles; RBF's two ATen passes are as fast: benchmarks/results/profile-fused.md)
template <typename T>
static void profile_values(int64_t kind, T* __restrict b, int64_t count, T zero_below) {
  const T ln2 = T(0.69314718055994530942);
  if (kind == 1) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) b[i] = exp2_nonpos<T>(-std::sqrt(b[i] <= zero_below ? T(0) : b[i]));
  } else if (kind == 2) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      const T z = std::sqrt(b[i] <= zero_below ? T(0) : b[i]);
      b[i] = (z * ln2 + T(1)) * exp2_nonpos<T>(-z);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      const T z = std::sqrt(b[i] <= zero_below ? T(0) : b[i]);
      const T q = z * ln2 + T(1.5);
      b[i] = (q * q + T(0.75)) * exp2_nonpos<T>(-z);
    }
  }
}

// b (contiguous, float32 / float64) <- phi(b) in place for a Matern kind (1-3), on torch's threads
void profile_(torch::Tensor b, int64_t kind, double zero_below) {
  TORCH_CHECK(b.is_contiguous(), "b must be contiguous");
  TORCH_CHECK(kind >= 1 && kind <= 3, "bad kind");
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "profile_", [&] {
    scalar_t* p = b.data_ptr<scalar_t>();
    at::parallel_for(0, b.numel(), 32768, [&](int64_t begin, int64_t end) {
      profile_values<scalar_t>(kind, p + begin, end - begin, static_cast<scalar_t>(zero_below));
    });
  });
}

// Matern-1/2 near pairs, in place on the r x M distances b = xa ca (a = d + 2 augmented columns: xa's rows
// [-2 f z, f |z|^2, 1], ca's columns [c, 1, f |c|^2], f = log2(e)^2): where b[i, j] <= near (f |z_i|^2 + f |c_j|^2),
// the norm expansion's rounding (a few eps f (|z_i|^2 + |c_j|^2)) is not small against the distance, and the
// profile's square root would turn it into an error of sqrt(eps) and more; there b[i, j] is recomputed as
// f sum_k (z_ik - c_jk)^2 = sum_k (xa_ik - (-2 f) c_jk)^2 / (4 f) from the coordinates, exact to rounding.
// O(r M) compares and O(d) per recomputed pair (the near ones: duplicates and close neighbours).
// (no fused multiply-add here: the product m2f c must round as torch's -2 f z did, for duplicates to give 0; clang
// takes its pragma only as the first statement of the body)
#if defined(__clang__)
#define GPFALKON_NO_CONTRACT
#elif defined(__GNUC__)
#define GPFALKON_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define GPFALKON_NO_CONTRACT
#endif
template <typename T>
GPFALKON_NO_CONTRACT static void refine_near(T* __restrict b, const T* __restrict xa, const T* __restrict ca,
                                             int64_t r, int64_t M, int64_t a, T near) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int64_t d = a - 2;
  const T m2f = T(-2.0 * 2.0813689810056077);  // xa's first d columns are m2f z, rounded as m2f c is: a duplicate
  const T quarter = T(0.25 / 2.0813689810056077);  // point gives exactly 0
  const T* csq = ca + (a - 1) * M;     // f |c_j|^2
  for (int64_t i = 0; i < r; ++i) {
    T* row = b + i * M;
    const T* x = xa + i * a;
    const T xs = x[d];  // f |z_i|^2
    int hit = 0;  // a vectorised scan first: most rows hold no near pair
#pragma omp simd reduction(| : hit)
    for (int64_t j = 0; j < M; ++j) hit |= static_cast<int>(row[j] <= near * (xs + csq[j]));
    if (!hit) continue;
    for (int64_t j = 0; j < M; ++j) {
      if (row[j] <= near * (xs + csq[j])) {
        T t = T(0);
        for (int64_t k = 0; k < d; ++k) {
          const T diff = x[k] - m2f * ca[k * M + j];  // -2 f (z_ik - c_jk)
          t += diff * diff;
        }
        row[j] = quarter * t;
      }
    }
  }
}

// The on-the-fly pass in row tiles: each thread takes whole tiles of `tile` rows; per tile it computes
// the distances into its own buffer (one single-threaded GEMM: the tile's rows of the augmented x times
// the augmented centers), applies the kernel profile in place (RBF: clamp and exp2 by ATen; Matern:
// profile_values), and adds the tile's
// (U^T K^T + V^T) K with the single-read products above while the tile is still in its core's cache.
// near: for Matern-1/2, the distances at or below near * (f |z_i|^2 + f |c_j|^2) are recomputed from the coordinates
// (refine_near).
void fly_kmn_k(torch::Tensor acc, torch::Tensor xa, torch::Tensor ca, torch::Tensor u,
               torch::Tensor v, torch::Tensor store, torch::Tensor store_scale, int64_t kind, double near,
               int64_t tile, int64_t flush) {
  TORCH_CHECK(xa.dim() == 2 && ca.dim() == 2 && xa.size(1) == ca.size(0), "xa (rows, a) and ca (a, M) needed");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat64 && acc.is_contiguous(), "acc must be contiguous float64");
  TORCH_CHECK(kind >= 0 && kind <= 3 && tile >= 1 && flush >= 1, "bad kind / tile / flush");
  const int64_t rows = xa.size(0), M = ca.size(1), k = acc.size(0);
  const bool has_u = u.numel() > 0, has_v = v.numel() > 0;
  check_operands(acc, u, v, rows, M);
  TORCH_CHECK(ca.is_contiguous() && xa.is_contiguous() && ca.size(0) >= 2, "xa and ca must be contiguous, a >= 2");
  // store: the tiles are computed into its rows (kept) instead of a thread's buffer
  // (an int16 store: each tile computed in the thread's buffer, then quantized row by row into the store and
  // store_scale, and its products taken with the quantized values, which later passes read back)
  const bool has_store = store.numel() > 0;
  const bool fixed_store = has_store && store.scalar_type() == torch::kInt16;
  if (has_store) TORCH_CHECK(store.is_contiguous() && store.size(0) == rows && store.size(1) == M &&
                             (fixed_store || store.scalar_type() == xa.scalar_type()),
                             "store must be contiguous (rows, M), xa's dtype or int16");
  if (fixed_store)
    TORCH_CHECK(store_scale.dim() == 1 && store_scale.size(0) == rows && store_scale.is_contiguous() &&
                store_scale.scalar_type() == xa.scalar_type(), "store_scale must be (rows,), xa's dtype");
  const int64_t ntiles = (rows + tile - 1) / tile;
  std::mutex lock;
  double* out = acc.data_ptr<double>();
  // float32 tiles with float64 vectors (u, v): the products in float64, each tile value widened in registers, as
  // fused_kmn_k's over a float32 store (gpfalkon.settings.wide_products; the engine's first pass fills its store so)
  const bool wide = (has_u ? u : v).scalar_type() == torch::kFloat64 && xa.scalar_type() == torch::kFloat32;
  AT_DISPATCH_FLOATING_TYPES(xa.scalar_type(), "fly_kmn_k", [&] {
    TORCH_CHECK(ca.scalar_type() == xa.scalar_type(), "ca must have xa's dtype");
    TORCH_CHECK(wide || !has_u || u.scalar_type() == xa.scalar_type(), "u must have xa's dtype (or float64)");
    TORCH_CHECK(wide || !has_v || v.scalar_type() == xa.scalar_type(), "v must have xa's dtype (or float64)");
    TORCH_CHECK(!wide || !has_u || u.scalar_type() == torch::kFloat64, "u must be float64 with v");
    TORCH_CHECK(!wide || !has_v || v.scalar_type() == torch::kFloat64, "v must be float64 with u");
    TORCH_CHECK(!wide || !fixed_store, "float64 vectors take no int16 store");
    const scalar_t* up = has_u && !wide ? u.data_ptr<scalar_t>() : nullptr;
    const scalar_t* vp = has_v && !wide ? v.data_ptr<scalar_t>() : nullptr;
    const double* up64 = has_u && wide ? u.data_ptr<double>() : nullptr;
    const double* vp64 = has_v && wide ? v.data_ptr<double>() : nullptr;
    const int64_t ldv = has_v ? v.stride(0) : 0;
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
      at::Tensor buf = at::empty({has_store && !fixed_store ? 0 : std::min(tile, rows), M}, xa.options());
      std::vector<scalar_t> part(wide ? 0 : k * M, scalar_t(0));
      std::vector<double> wide_part(wide ? k * M : 0, 0.0);
      std::vector<double> part64(k * M, 0.0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t s = t * tile, r = std::min(rows, s + tile) - s;
        at::Tensor b = has_store && !fixed_store ? store.narrow(0, s, r) : buf.narrow(0, 0, r);
        at::mm_out(b, xa.narrow(0, s, r), ca);
        if (kind == 1)
          refine_near<scalar_t>(b.data_ptr<scalar_t>(), xa.data_ptr<scalar_t>() + s * xa.size(1),
                                ca.data_ptr<scalar_t>(), r, M, xa.size(1), static_cast<scalar_t>(near));
        if (kind == 0) {
          b.clamp_max_(0.0).exp2_();
        } else {
          profile_values<scalar_t>(kind, b.data_ptr<scalar_t>(), r * M, scalar_t(0));
        }
        if (fixed_store) {
          scalar_t* bp = b.data_ptr<scalar_t>();
          int16_t* qp = store.data_ptr<int16_t>() + s * M;
          scalar_t* sp = store_scale.data_ptr<scalar_t>() + s;
          for (int64_t row = 0; row < r; ++row) sp[row] = quantize_row<scalar_t>(bp + row * M, qp + row * M, M);
        }
        const scalar_t* K = b.data_ptr<scalar_t>();
        if (wide) {  // (scalar_t is float here; the double instance is never called)
          rows_into<double, scalar_t, 2>(K, 0, r, M, up64, vp64 != nullptr ? vp64 + s : nullptr, ldv, k, flush,
                                         wide_part, part64);
        } else {
          rows_into<scalar_t>(K, 0, r, M, up, vp != nullptr ? vp + s : nullptr, ldv, k, flush, part, part64);
        }
      }
      std::lock_guard<std::mutex> guard(lock);
      for (int64_t c = 0; c < k * M; ++c) out[c] += part64[c];
    });
  });
}
// The triangular solves of the FALKON preconditioner, in place on X (k, M) contiguous: row c of X becomes
// U^{-1} X_c (transpose false) or U^{-T} X_c (transpose true), for U (M, M) row-major upper triangular (its
// strictly lower part is never read). Blocks of bs rows: U^{-1} backwards by block rows (the rows' products
// with the solved part, x_I -= U[I, I1:] x[I1:], split between the threads by rows, then the diagonal block
// in one thread); U^{-T} forwards (the diagonal block in one thread, then x[I1:] -= U[I, I1:]^T x_I split
// between the threads by columns, four rows at a time). Each value of the triangle is read once, by
// contiguous row segments.
template <typename T>
static void upper_solve_rows(const T* U, int64_t M, T* X, int64_t k, bool transpose, int64_t bs) {
  const int64_t nb = (M + bs - 1) / bs;
  if (!transpose) {
    for (int64_t b = nb - 1; b >= 0; --b) {
      const int64_t i0 = b * bs, i1 = std::min(M, i0 + bs);
      if (i1 < M) {
        at::parallel_for(i0, i1, 8, [&](int64_t r0, int64_t r1) {
          for (int64_t i = r0; i < r1; ++i) {
            const T* row = U + i * M;
            for (int64_t c = 0; c < k; ++c) {
              const T* x = X + c * M;
              T s = T(0);
#pragma omp simd reduction(+ : s)
              for (int64_t j = i1; j < M; ++j) s += row[j] * x[j];
              X[c * M + i] -= s;
            }
          }
        });
      }
      for (int64_t i = i1 - 1; i >= i0; --i) {
        const T* row = U + i * M;
        for (int64_t c = 0; c < k; ++c) {
          T* x = X + c * M;
          T s = T(0);
#pragma omp simd reduction(+ : s)
          for (int64_t j = i + 1; j < i1; ++j) s += row[j] * x[j];
          x[i] = (x[i] - s) / row[i];
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * bs, i1 = std::min(M, i0 + bs);
    for (int64_t i = i0; i < i1; ++i) {
      const T* row = U + i * M;
      for (int64_t c = 0; c < k; ++c) {
        T* x = X + c * M;
        const T xi = x[i] / row[i];
        x[i] = xi;
#pragma omp simd
        for (int64_t j = i + 1; j < i1; ++j) x[j] -= row[j] * xi;
      }
    }
    if (i1 < M) {
      at::parallel_for(i1, M, 512, [&](int64_t c0, int64_t c1) {
        int64_t i = i0;
        for (; i + 4 <= i1; i += 4) {
          const T* r0 = U + i * M;
          const T* r1 = r0 + M;
          const T* r2 = r1 + M;
          const T* r3 = r2 + M;
          for (int64_t c = 0; c < k; ++c) {
            T* x = X + c * M;
            const T x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
#pragma omp simd
            for (int64_t j = c0; j < c1; ++j) x[j] -= (r0[j] * x0 + r1[j] * x1) + (r2[j] * x2 + r3[j] * x3);
          }
        }
        for (; i < i1; ++i) {
          const T* r0 = U + i * M;
          for (int64_t c = 0; c < k; ++c) {
            T* x = X + c * M;
            const T x0 = x[i];
#pragma omp simd
            for (int64_t j = c0; j < c1; ++j) x[j] -= r0[j] * x0;
          }
        }
      });
    }
  }
}

void upper_solve_(torch::Tensor U, torch::Tensor X, bool transpose, int64_t bs) {
  TORCH_CHECK(U.dim() == 2 && U.size(0) == U.size(1) && U.is_contiguous(), "U must be a contiguous square matrix");
  TORCH_CHECK(X.dim() == 2 && X.size(1) == U.size(0) && X.is_contiguous(), "X must be contiguous (k, M)");
  TORCH_CHECK(X.scalar_type() == U.scalar_type(), "X must have U's dtype");
  TORCH_CHECK(bs >= 1, "bs must be positive");
  AT_DISPATCH_FLOATING_TYPES(U.scalar_type(), "upper_solve_", [&] {
    upper_solve_rows<scalar_t>(U.data_ptr<scalar_t>(), U.size(0), X.data_ptr<scalar_t>(), X.size(0), transpose, bs);
  });
}
// sum_i w_i (g^(offset + i) mod p) mod q for p = 2^31 - 1, q = 2^61 - 1, the words w_i of `words` (int32, int16 or
// uint8, read as unsigned) and two roots g (gpfalkon.models.fit_state's content digest); exact integer arithmetic,
// so the result does not depend on the threads. The weights advance by g^8 in eight lanes (independent chains
// that the compiler vectorises: every product is of two values below 2^32); each lane's sum is folded modulo q
// after every product (a sum below 2^61 + 8 plus a product below 2^63 stays below 2^64).
static inline uint64_t mod_p31(uint64_t x) {  // x < 2^62
  const uint64_t p = 0x7FFFFFFFull;
  x = (x & p) + (x >> 31);
  x = (x & p) + (x >> 31);
  return x >= p ? x - p : x;
}

static uint64_t pow_p31(uint64_t g, uint64_t e) {
  uint64_t r = 1, b = mod_p31(g);
  e %= 0x7FFFFFFEull;  // g^(p - 1) = 1
  while (e) {
    if (e & 1) r = mod_p31(r * b);
    b = mod_p31(b * b);
    e >>= 1;
  }
  return r;
}

template <typename W>
static void digest_range(const W* w, int64_t begin, int64_t end, uint64_t offset, const uint64_t* g,
                         uint64_t* acc) {
  constexpr int L = 8;
  const uint64_t q = (1ull << 61) - 1;
  for (int r = 0; r < 2; ++r) {
    const uint64_t step = pow_p31(g[r], L);
    uint64_t m[L], s[L];
    for (int l = 0; l < L; ++l) {
      m[l] = pow_p31(g[r], offset + static_cast<uint64_t>(begin + l));
      s[l] = 0;
    }
    int64_t i = begin;
    for (; i + L <= end; i += L) {
#pragma omp simd
      for (int l = 0; l < L; ++l) {
        const uint64_t t = s[l] + static_cast<uint64_t>(w[i + l]) * m[l];  // < 2^61 + 8 + 2^63
        s[l] = (t & q) + (t >> 61);
        m[l] = mod_p31(m[l] * step);
      }
    }
    uint64_t total = 0;
    for (int l = 0; i < end; ++i, ++l) {
      const uint64_t t = s[l] + static_cast<uint64_t>(w[i]) * m[l];
      s[l] = (t & q) + (t >> 61);
    }
    for (int l = 0; l < L; ++l) total = (total + s[l] % q) % q;
    acc[r] = (acc[r] + total) % q;
  }
}

// returns [h_1, h_2] (int64)
torch::Tensor digest_words(torch::Tensor words, int64_t offset, int64_t g1, int64_t g2) {
  TORCH_CHECK(words.dim() == 1 && words.is_contiguous(), "words must be a contiguous 1-D tensor");
  TORCH_CHECK(offset >= 0 && g1 > 0 && g2 > 0, "offset must be >= 0 and the roots > 0");
  const uint64_t g[2] = {static_cast<uint64_t>(g1), static_cast<uint64_t>(g2)};
  const uint64_t q = (1ull << 61) - 1;
  std::mutex lock;
  uint64_t total[2] = {0, 0};
  const int64_t n = words.numel();
  auto run = [&](auto* w) {
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      uint64_t acc[2] = {0, 0};
      digest_range(w, begin, end, static_cast<uint64_t>(offset), g, acc);
      std::lock_guard<std::mutex> guard(lock);
      for (int r = 0; r < 2; ++r) total[r] = (total[r] + acc[r]) % q;
    });
  };
  if (words.scalar_type() == torch::kInt32) run(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()));
  else if (words.scalar_type() == torch::kInt16) run(reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>()));
  else if (words.scalar_type() == torch::kUInt8) run(words.data_ptr<uint8_t>());
  else TORCH_CHECK(false, "words must be int32, int16 or uint8");
  auto out = torch::empty({2}, torch::kInt64);
  out[0] = static_cast<int64_t>(total[0]);
  out[1] = static_cast<int64_t>(total[1]);
  return out;
}
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
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
    except OSError:  # no /proc (macOS, Windows): the processor's name stands in for its instruction sets
        flags = platform.processor()
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
    return env_flag("GPFALKON_FUSED_CPU", True)


def _build_directory(name: str) -> str:
    """``<torch extensions root>/gpfalkon/<name>``, the root being
    ``torch.utils.cpp_extension.get_default_build_root()``, computed as that function computes it (the
    realpath of ``torch._appdirs.user_cache_dir("torch_extensions")``) without importing
    ``torch.utils.cpp_extension``, which imports setuptools: 0.2 s of every process's first fit (of a few
    seconds' ``auto_fit`` budget) to find an extension that is already built. The import is paid only
    where torch lacks ``_appdirs`` and where the extension is built. (``TORCH_EXTENSIONS_DIR`` is read by
    torch only for builds without a ``build_directory``; this kernel always gives one, so it never applied.)"""
    try:
        from torch._appdirs import user_cache_dir

        root = os.path.realpath(user_cache_dir(appname="torch_extensions"))
    except (ImportError, AttributeError, TypeError):
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return os.path.join(root, "gpfalkon", name)


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
                    functions=["fused_kmn_k", "fly_kmn_k", "profile_", "upper_solve_", "digest_words"],
                    extra_cflags=list(_FLAGS),
                    extra_ldflags=["-fopenmp"],
                    build_directory=directory,
                    verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        except BaseException:  # interrupted (KeyboardInterrupt): not a verdict on the build; a later call retries
            _state["tried"] = False
            raise
        return _state["module"]


def fused_available() -> tuple[bool, str]:
    """Whether the fused kernel can run here (building it on the first call), and why not."""
    if not _enabled():
        return False, "turned off (GPFALKON_FUSED_CPU=0 or set_enabled(False))"
    if _load() is None:
        return False, f"the C++ kernel could not be built ({_state['error']})"
    return True, ""


def fused_kmn_k(acc: Tensor, k_nm: Tensor, u_t: Tensor | None, v_t: Tensor | None,
                scale: Tensor | None = None) -> bool:
    """``acc += (u_t K + v_t) K`` in place, i.e. ``acc^T += K^T (K u + v)``, reading ``K`` once.

    Args:
        acc: ``(k, M)`` float64, contiguous, on the CPU.
        k_nm: ``(rows, M)`` contiguous, float32 or float64; or int16, a fixed-point store
            (:class:`gpfalkon.settings.store_format`) whose row ``i`` is ``k_nm[i] * scale[i]``: on a CPU with AVX2
            eight rows at a time widened in registers (the scale folded into the rows' weights), else each
            group of eight rows dequantized in the core's cache; ``K`` is read at two bytes a value.
        u_t: ``(k, M)`` in ``k_nm``'s dtype (an int16 ``k_nm``: ``scale``'s), or ``None``; float64 with a float32
            ``k_nm`` (and ``v_t`` float64 too): the products in float64, each stored value widened in registers
            (:class:`gpfalkon.settings.wide_products`).
        v_t: ``(k, rows)`` in ``u_t``'s dtype with unit column stride, or ``None``.
        scale: ``(rows,)`` contiguous, float32 or float64: the row scales of an int16 ``k_nm`` (else ``None``).

    Returns:
        ``True`` if the fused kernel ran; ``False`` (``acc`` untouched) where it does not apply
        (not CPU, another dtype, more than :data:`MAX_K` right-hand sides, a non-contiguous
        ``K``, or the kernel unavailable): the caller then uses its own path.
    """
    if (k_nm.device.type != "cpu" or k_nm.dtype not in (torch.float32, torch.float64, torch.int16)
            or not k_nm.is_contiguous() or acc.shape[0] > MAX_K or acc.dtype != torch.float64
            or not acc.is_contiguous() or k_nm.requires_grad):
        return False
    like = k_nm
    if k_nm.dtype == torch.int16:  # products in the scales' dtype
        if (scale is None or scale.dtype not in (torch.float32, torch.float64) or not scale.is_contiguous()
                or scale.shape != (k_nm.shape[0],)):
            return False
        like = scale
    args = _operands("fused_kmn_k", like, u_t, v_t)
    if args is None:
        return False
    _state["module"].fused_kmn_k(acc, k_nm, *args, like.new_empty(0) if scale is None else scale, FLUSH_ROWS)
    return True


def _operands(name: str, like: Tensor, u_t: Tensor | None, v_t: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """``(u, v)`` as the C++ kernels take them (an empty tensor for an absent one; ``v`` with unit column
    stride), or ``None`` where the kernels cannot be built here."""
    if u_t is None and v_t is None:
        raise ValueError(f"{name} needs u_t or v_t")
    if not fused_available()[0]:
        return None
    empty = like.new_empty(0)
    return (empty if u_t is None else u_t.contiguous()), (empty if v_t is None else _unit_columns(v_t))


def _unit_columns(v: Tensor) -> Tensor:
    """``v`` with unit stride between its columns (a copy only where needed). ``contiguous()`` is not
    enough: torch calls a ``(k, 1)`` tensor with strides ``(1, k)`` contiguous already."""
    return v if v.stride(-1) == 1 else torch.empty(v.shape, dtype=v.dtype).copy_(v)


def fused_profile_(buf: Tensor, kind: str, zero_below: float = 0.0) -> bool:
    """``buf <- phi(buf)`` in place for a Matern profile of ``engine._apply_profile_`` (``kind``
    ``"matern12"``, ``"matern32"`` or ``"matern52"``; values at or below ``zero_below`` taken as 0 before
    the square root) in one vectorised pass on torch's threads.

    ``2^x`` (``x <= 0``) is computed in the C++ source as ``2^n 2^f`` (``n`` the nearest integer, ``2^f`` by
    its Taylor polynomial in ``f ln 2``, degree 7 in float32 and 12 in float64) and is within a few ulp of
    ``torch.exp2``, subnormal results included. ATen takes one pass over the buffer per in-place operation
    (eight for Matern-5/2); this is 1.9-3.8x faster on one thread and a cache-resident buffer, 2.7-5.8x on a
    64 MiB one, and makes the engine's ``K_nM u`` pass (the posterior mean) 1.35-2.3x faster
    (``benchmarks/results/profile-fused.md``; inside :func:`fused_fly_kmn_k`'s tiles the whole pass did not
    measurably change). RBF is declined: its two ATen passes (clamp, exp2) are as fast
    (``profile-fused-rbf.md``: 0.92-1.58x, and 0.78-0.95x on that pass). Cost ``O(buf.numel())``, no extra
    memory.

    Returns:
        ``True`` if it ran; ``False`` (``buf`` untouched) where it does not apply: RBF or an unknown
        profile, not on the CPU, not float32 / float64, not contiguous, requiring grad, or the kernels
        unavailable.
    """
    if (kind not in _KINDS or kind == "rbf" or buf.device.type != "cpu"
            or buf.dtype not in (torch.float32, torch.float64) or not buf.is_contiguous()
            or (buf.requires_grad and torch.is_grad_enabled()) or not fused_available()[0]):
        return False
    _state["module"].profile_(buf, _KINDS[kind], float(zero_below))
    return True


def fly_tile_rows(m: int, itemsize: int, cap: int | None = None) -> int:
    """Rows of one tile of the on-the-fly kernel: ``FLY_TILE_BYTES / (M itemsize)`` rounded down to a
    multiple of 4 (the products take four rows at a time), at least 4, at most ``cap``."""
    rows = max(4, (FLY_TILE_BYTES // max(1, m * itemsize)) // 4 * 4)
    return max(1, min(rows, cap)) if cap is not None else rows


def fly_applies(acc: Tensor, xa: Tensor, ca_t: Tensor, kind: str) -> bool:
    """Whether :func:`fused_fly_kmn_k` runs on these operands (CPU, float32 or float64 alike, at most
    :data:`MAX_K` right-hand sides into a contiguous float64 ``acc``, a known profile, no autograd, some rows,
    the kernel available here), checked before the caller allocates anything for it: the engine takes a
    store for the kernel to fill only where it will be filled."""
    return not (xa.device.type != "cpu" or xa.dtype not in (torch.float32, torch.float64) or ca_t.dtype != xa.dtype
                or acc.shape[0] > MAX_K or acc.dtype != torch.float64 or not acc.is_contiguous()
                or kind not in _KINDS or xa.requires_grad or xa.shape[0] == 0) and fused_available()[0]


def fused_fly_kmn_k(acc: Tensor, xa: Tensor, ca_t: Tensor, u_t: Tensor | None, v_t: Tensor | None,
                    kind: str, near: float, tile: int, store: Tensor | None = None,
                    store_scale: Tensor | None = None) -> bool:
    """``acc += (u_t K + v_t) K`` for ``K = phi(xa @ ca_t)`` computed tile by tile and never stored.

    The on-the-fly pass of :class:`~gpfalkon.backend.engine.KernelEngine`'s stationary fast path in one
    call: each thread takes whole tiles of ``tile`` rows and, per tile, computes the distances into its own
    buffer (one single-threaded GEMM), applies the kernel profile in place (RBF by ATen's clamp and exp2,
    Matern by :func:`fused_profile_`'s vectorised pass) and adds the tile's products with the single-read
    loop above while the tile is in its core's cache. Against the engine's torch path (multi-threaded GEMM,
    profile and batched products over ~16 MiB blocks, each pass streaming the block through the shared
    cache) it saves two of the block's three re-reads from the last-level cache and the threads' synchronisation between
    operations (``benchmarks/results/engine-fused-fly.md``). Cost: ``2 n M a + 4 n M k`` flops and ``n M``
    profile evaluations (``a`` = the augmented width ``d + 2``), ``threads x tile x M`` values of
    buffers.

    Args:
        acc: ``(k, M)`` float64, contiguous, on the CPU.
        xa: ``(rows, a)`` augmented rows; ``ca_t``: ``(a, M)`` augmented centers (same dtype).
        u_t: ``(k, M)`` or ``None``; v_t: ``(k, rows)`` with unit column stride, or ``None``.
        kind: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
        near: Matern-1/2 distances at or below ``near (f |z_i|^2 + f |c_j|^2)`` (the augmented columns' norms)
            are recomputed from the coordinates (:func:`~gpfalkon.backend.engine.refine_near_`).
        tile: rows per tile.
        store: ``(rows, M)`` contiguous in ``xa``'s dtype or int16, or ``None``: where given, the tiles are
            computed into its rows, which then hold ``K`` (the engine's first pass fills its stored ``K_nM``
            so); an int16 store receives each row in fixed point (``K_i ~ store[i] * store_scale[i]``,
            ``store_scale[i] = max |K_i| / 32767``, rounded to nearest even), and the tile's products are
            taken with those values (the values every later pass reads).
        store_scale: ``(rows,)`` contiguous in ``xa``'s dtype: the row scales an int16 store receives.

    Returns:
        ``True`` if the kernel ran; ``False`` (``acc`` untouched) where it does not apply (not CPU,
        another dtype, more than :data:`MAX_K` right-hand sides, an unknown profile, or the kernel
        unavailable).
    """
    if not fly_applies(acc, xa, ca_t, kind) or (
            store is not None and (store.dtype not in (xa.dtype, torch.int16) or not store.is_contiguous()
                                   or store.shape != (xa.shape[0], ca_t.shape[1]))):
        return False
    fixed = store is not None and store.dtype == torch.int16
    if fixed and (store_scale is None or store_scale.dtype != xa.dtype or not store_scale.is_contiguous()
                  or store_scale.shape != (xa.shape[0],)):
        return False
    args = _operands("fused_fly_kmn_k", xa, u_t, v_t)
    if args is None:
        return False
    _state["module"].fly_kmn_k(acc, xa.contiguous(), ca_t.contiguous(), *args,
                               xa.new_empty(0) if store is None else store, store_scale if fixed else xa.new_empty(0),
                               _KINDS[kind], float(near), int(tile), FLUSH_ROWS)
    return True


def upper_solve(u: Tensor, rhs: Tensor, transpose: bool = False) -> Tensor | None:
    """``U^{-1} rhs`` (or ``U^{-T} rhs`` with ``transpose``) for an upper-triangular ``U``, reading only its
    upper triangle, once, on torch's threads.

    Each CG iteration of FALKON applies four triangular solves with the preconditioner's ``M x M``
    factors to one vector: a memory-bound pass over a triangle (``M^2 / 2`` values) each. LAPACK's solve
    (``torch.linalg.solve_triangular``; MKL on the CPU) runs it on one thread; this kernel splits each block
    of rows between the threads: backwards by block rows for ``U^{-1}`` (the rows' products with the part
    already solved, by rows, then the diagonal block on one thread), forwards for ``U^{-T}`` (the diagonal
    block, then the update of the rows below it, by columns). Same floating-point operations in another
    order (backward stable, as LAPACK's). Cost ``M^2 k`` flops, ``M^2 / 2`` values read;
    ``benchmarks/results/triangular-solve.md`` measures it against LAPACK's.

    Args:
        u: ``(M, M)`` contiguous, float32 or float64, on the CPU, ``M >=`` :data:`SOLVE_MIN_M` of its dtype; its
            strictly lower part is not read.
        rhs: ``(M, k)`` in ``u``'s dtype, ``1 <= k <=`` :data:`MAX_SOLVE_K`; not modified.
        transpose: solve with ``U^T`` instead of ``U``.

    Returns:
        The ``(M, k)`` solution (a new tensor), or ``None`` where the kernel does not apply (not CPU, another
        dtype, a smaller factor, more right-hand sides, a non-contiguous ``u``, a tensor requiring grad, or the
        kernels unavailable): the caller then uses LAPACK's.
    """
    if (u.device.type != "cpu" or u.dtype not in (torch.float32, torch.float64) or rhs.dtype != u.dtype
            or rhs.device != u.device or u.dim() != 2 or u.shape[0] != u.shape[1] or rhs.dim() != 2
            or rhs.shape[0] != u.shape[0] or not 1 <= rhs.shape[1] <= MAX_SOLVE_K or not u.is_contiguous()
            or u.shape[0] < SOLVE_MIN_M[u.dtype]
            or u.requires_grad or rhs.requires_grad or not fused_available()[0]):
        return None
    x = rhs.mT.clone(memory_format=torch.contiguous_format)
    _state["module"].upper_solve_(u, x, bool(transpose), SOLVE_BLOCK)
    return x.mT


def word_digest(words: Tensor, offset: int, roots: tuple[int, int]) -> tuple[int, int] | None:
    """``sum_i w_i (g^(offset + i) mod (2^31 - 1)) mod (2^61 - 1)`` for both ``g`` in ``roots``, ``w_i`` the
    words of ``words`` read as unsigned integers: the content digest of
    :func:`gpfalkon.models.fit_state.content_digest`, in one pass on torch's threads.

    The torch definition takes about a dozen elementwise int64 passes over each block of words (the
    weights, two reductions modulo the primes, the tree of sums); here each word is read once and its
    weight advanced by one modular product (eight interleaved chains per root, vectorised), the sums folded
    modulo ``2^61 - 1`` as they go. Equal, integer for integer, to the torch definition (exact arithmetic: no
    dependence on the threads). Cost ``O(len(words))``, no extra memory.

    Args:
        words: contiguous 1-D ``int32``, ``int16`` or ``uint8`` tensor on the CPU.
        offset: the position of the first word (``>= 0``).
        roots: the two multipliers ``g`` (primitive roots of ``2^31 - 1``).

    Returns:
        ``(h_1, h_2)``, or ``None`` where it does not apply (another device or dtype, or the kernels
        unavailable): the caller then computes the torch definition.
    """
    if (words.device.type != "cpu" or words.dim() != 1 or not words.is_contiguous()
            or words.dtype not in (torch.int32, torch.int16, torch.uint8) or offset < 0 or not fused_available()[0]):
        return None
    out = _state["module"].digest_words(words, int(offset), int(roots[0]), int(roots[1])).tolist()
    return int(out[0]), int(out[1])
