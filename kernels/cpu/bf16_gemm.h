// The bf16 GEMM on vectors, for kernels/cpu/model_ops_cpu.cpp (on the fp32 GEMM of f32_gemm.h,
// whose tile the widening path runs): vdpbf16ps where the build has avx512_bf16, FMAs on widened
// bf16 everywhere; the same bits either way. AMX tiles, where the CPU has them, are amx_bf16.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "elementwise.h"  // silu_and_mul: the fused gate/up projection's epilogue
#include "f32_gemm.h"     // kPanel, packed_tile_rows, prefetch_panel_row_l2, row_chunk_for
#include "simd.h"

// ---- GEMM in bf16: out = bf16(sum_k x[m, k] * w[n, k] + bias[n]), x, w, bias, out all bf16 ----
//
// Weights are packed like the fp32 ones, in k pairs: word packed[q][p][j] holds w[q * kPanel + j][2p]
// (low half) and [2p + 1] (high half), two bf16 in 32 bits, K even. With avx512_bf16 one vdpbf16ps
// per vector adds a pair's two products into fp32 accumulators (odd element first, each add rounded);
// elsewhere (and where that is faster: use_bf16_dot) the pair is widened to two fp32 vectors (exact:
// a bf16 is the top half of an fp32) and added with two FMAs in that same order, so every CPU and
// path computes the same sums in fp32 and rounds once to bf16 at the end, as torch's bf16 linear
// does. That is also why a CPU without bf16 arithmetic runs a bf16 model at fp32 speed, half the
// weight bytes, instead of through emulated bf16 matmuls.
// A tile's accumulators cover the whole K (a panel, K/2 x 128 bytes, stays in L2 across row tiles),
// so no partial sums are ever stored in bf16.
#if defined(__AVX512BF16__) && !defined(PR_GEMM_VEC8)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif
// Registers: 2 * MR accumulators + 2 weight vectors (4 widened) + broadcasts.
// 8-wide: 10 accumulators + 4 widened weight vectors + broadcasts fill the 16 AVX registers (6 rows
// measured no better than 5; 4, before x was widened up front, slower:
// docs/log/2026-11-27-figures-from-code-comments.md).
constexpr int kTileMBf16 = kVec == 16 ? 12 : 5;
// The x rows a bf16 tile reads: bf16 for vdpbf16ps (Dot), fp32 (widened once per call) otherwise.
template <bool Dot>
using Bf16XRow = std::conditional_t<Dot, uint16_t, float>;

// One output row of a panel, from its fp32 sums (a0: columns 0..kVec-1, a1: the rest): + bias (the
// panel's slice of it, or null), rounded to bf16, its first `cols` columns stored (fewer than kPanel
// in the last panel when N is not a multiple). The vector and the AMX bf16 GEMMs both end with it.
inline void store_bf16_panel_row(uint16_t* o, vgf a0, vgf a1, const uint16_t* bias, int64_t cols) {
  if (bias) {
    if (cols == kPanel) {
      a0 += load_bf16_v(bias);
      a1 += load_bf16_v(bias + kVec);
    } else {
      for (int64_t j = 0; j < cols; ++j) (j < kVec ? a0[j] : a1[j - kVec]) += bf16_to_f32(bias[j]);
    }
  }
  if (cols == kPanel) {
    store_bf16_v(o, a0);
    store_bf16_v(o + kVec, a1);
    return;
  }
  for (int64_t j = 0; j < cols; ++j) o[j] = f32_to_bf16(j < kVec ? a0[j] : a1[j - kVec]);
}

// How far ahead of its loads a bf16 tile asks for the panel's pair rows (64 of 128 bytes: 8 KiB),
// into L2. It had no software prefetch: its few rows leave the FMAs idle while the weights stream,
// and the hardware's prefetcher alone did not keep up: with it, cold-weight GEMMs of a few rows
// take clearly less time on both the vdpbf16ps and the widening path
// (docs/log/2026-11-26-qwen3-runner-fp32-gemm-ceiling.md).
constexpr int64_t kBf16TilePrefetchPairs = 64;

// x: bf16 rows (the vdpbf16ps path broadcasts a pair's 32 bits), or, on the widening path, the
// same rows already widened to fp32 (XRow = float: one broadcast from memory per element, where a
// bf16 element took a scalar load, shift and move first; with those, bf16 ran well behind fp32 on
// AVX2 despite half the weight bytes: docs/log/2026-11-25-amx-gemm-prefetch.md,
// docs/log/2026-11-27-figures-from-code-comments.md).
template <int MR, typename XRow>
inline void bf16_tile(const XRow* __restrict x, int64_t ldx, const int32_t* __restrict panel, int64_t K2,
                      const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  static_assert(kHaveBf16Dot || !std::is_same_v<XRow, uint16_t>, "bf16 rows of x go to vdpbf16ps");
  vgf acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = vgf{};
  for (int64_t p = 0; p < K2; ++p) {
    prefetch_panel_row_l2(panel + (p + kBf16TilePrefetchPairs) * kPanel);
    const vgi w0 = load_vi(panel + p * kPanel), w1 = load_vi(panel + p * kPanel + kVec);
    if constexpr (std::is_same_v<XRow, uint16_t>) {
#if defined(__AVX512BF16__) && !defined(PR_GEMM_VEC8)
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * ldx + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = (vgf)_mm512_dpbf16_ps((__m512)acc[i][0], xb, (__m512bh)w0);
        acc[i][1] = (vgf)_mm512_dpbf16_ps((__m512)acc[i][1], xb, (__m512bh)w1);
      }
#endif
    } else {
      const vgf we0 = bf16_even(w0), wo0 = bf16_odd(w0), we1 = bf16_even(w1), wo1 = bf16_odd(w1);
      for (int i = 0; i < MR; ++i) {
        // x widened with each pair swapped (linear_packed_bf16): the odd element first, the order
        // the pair's products are added in
        const vgf xo = broadcast_v(x[i * ldx + 2 * p]);
        const vgf xe = broadcast_v(x[i * ldx + 2 * p + 1]);
        acc[i][0] = fma_v(xe, we0, fma_v(xo, wo0, acc[i][0]));
        acc[i][1] = fma_v(xe, we1, fma_v(xo, wo1, acc[i][1]));
      }
    }
  }
  for (int i = 0; i < MR; ++i) store_bf16_panel_row(out + i * ldo, acc[i][0], acc[i][1], bias, cols);
}

template <int MR, typename XRow>
inline void bf16_tile_rows(int mr, const XRow* x, int64_t ldx, const int32_t* panel, int64_t K2,
                           const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  if constexpr (MR > 1) {
    if (mr < MR) return bf16_tile_rows<MR - 1>(mr, x, ldx, panel, K2, bias, out, ldo, cols);
  }
  bf16_tile<MR>(x, ldx, panel, K2, bias, out, ldo, cols);
}

// From this many rows the widening path widens each panel once, into fp32 rows ordered as the
// products are added (odd element of a pair, then even), and runs the fp32 tile over them: the
// same FMAs in the same order, so the same bits, without widening every weight pair again for
// each tile of rows. The per-tile widening took a fifth of the FMA ports, which left bf16 behind
// fp32 on AVX2, where its GEMM is bound by arithmetic (docs/log/2026-11-25-fused-silu-amx-epilogue.md);
// decode steps of a few rows are bound by the weights' bytes, where the per-tile widening costs nothing.
constexpr int64_t kWidenPanelRows = 2 * kTileM;

// Rows [0, rows) of xs (fp32, each pair swapped as the widening path's x) times one packed bf16
// panel (K2 pairs), rounded to bf16 with bias into out. As packed_panel does for fp32: the panel a
// slice of kKc k rows at a time (widened into 16 KiB that stay in L1 while every row tile passes),
// partial sums continued through an fp32 scratch (exact), rounded once at the end.
inline void bf16_panel_widened(const float* xs, int64_t ldx, int64_t rows, const int32_t* panel, int64_t K2,
                               const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  static_assert(kKc % 2 == 0, "slices of whole pairs");
  static thread_local std::vector<float> sums;
  if (sums.size() < size_t(rows * kPanel)) sums.resize(size_t(rows * kPanel));
  float* c = sums.data();
  alignas(64) float w[kKc * kPanel];
  const int64_t K = 2 * K2;
  const int tiles = int((rows + kTileM - 1) / kTileM);
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t k1 = k0 + kKc < K ? k0 + kKc : K;
    // The next slice's pairs (past the last, the next panel's first: panels are contiguous; a
    // prefetch past the weight's end is dropped), pulled in a share per tile while this slice's
    // tiles compute, as packed_panel does for fp32: a pair row is a float row's 4 * kPanel bytes.
    const float* next = reinterpret_cast<const float*>(panel + (k1 / 2) * kPanel);
    const int64_t share = (kKc / 2 + tiles - 1) / tiles;
    const int pf_every = int((k1 - k0 + share - 1) / share);
    for (int64_t p = k0 / 2; p < k1 / 2; ++p) {
      const vgi w0 = load_vi(panel + p * kPanel), w1 = load_vi(panel + p * kPanel + kVec);
      float* r = w + (2 * p - k0) * kPanel;
      store_v(r, bf16_odd(w0));
      store_v(r + kVec, bf16_odd(w1));
      store_v(r + kPanel, bf16_even(w0));
      store_v(r + kPanel + kVec, bf16_even(w1));
    }
    // Equal tiles: AVX2's 6-row tiles over 64 rows left a 4-row one, over 110 a 2-row one (4
    // accumulator chains: half the FMA rate). Chunks of whole tiles (linear_packed_bf16) and equal
    // tiles took less time (docs/log/2026-11-26-bf16-off-the-tiles.md,
    // docs/log/2026-11-27-figures-from-code-comments.md).
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m = rows * t / tiles;
      const int mr = int(rows * (t + 1) / tiles - m);
      packed_tile_rows<kTileM>(mr, xs + m * ldx, ldx, w - k0 * kPanel, k0, k1, c + m * kPanel, kPanel, k0 == 0,
                               nullptr, next + t * share * kPanel, pf_every);
    }
  }
  for (int64_t m = 0; m < rows; ++m)
    store_bf16_panel_row(out + m * ldo, load_v(c + m * kPanel), load_v(c + m * kPanel + kVec), bias, cols);
}

// Panel q's columns (fewer than kPanel in a partial last panel) of rows [0, rows) of a chunk of x,
// as the vector path reads it (bf16, or fp32 widened), into out (row 0's first column of the panel).
template <bool Dot>
inline void bf16_panel_rows(const Bf16XRow<Dot>* xr, int64_t ldxr, int64_t rows, const int32_t* packed, int64_t q,
                            int64_t K2, int64_t N, const uint16_t* bias, uint16_t* out, int64_t ldo) {
  const int64_t n0 = q * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
  const int32_t* panel = packed + q * K2 * kPanel;
  if (!Dot && rows >= kWidenPanelRows) {
    bf16_panel_widened(reinterpret_cast<const float*>(xr), ldxr, rows, panel, K2, bias ? bias + n0 : nullptr, out,
                       ldo, cols);
    return;
  }
  // Rows split into equal tiles of at most kTileMBf16 (64 rows: 6 x 10-11, not 5 x 12 + 4).
  const int64_t tiles = (rows + kTileMBf16 - 1) / kTileMBf16;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = rows * t / tiles;
    const int mr = int(rows * (t + 1) / tiles - m);
    bf16_tile_rows<kTileMBf16>(mr, xr + m * ldxr, ldxr, panel, K2, bias ? bias + n0 : nullptr, out + m * ldo, ldo,
                               cols);
  }
}

// linear_packed_bf16 on vectors (vdpbf16ps, or FMAs on widened bf16). With `silu`, out [M, N / 2]
// gets silu(gate) * up instead (linear_packed_silu's interleaved panels): each thread takes pairs
// of panels through a small scratch of its own, as the fp32 one does; the same bits as the [M, N]
// GEMM followed by silu_and_mul, without writing [M, N] and reading it back from both cores.
template <bool Dot>
inline int linear_packed_bf16_vec(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                                  int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads,
                                  bool silu) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
  // Chunks of whole tiles of the path that runs them: the widening path's are fp32 tiles.
  const int64_t row_chunk = row_chunk_for(M, K, sizeof(Bf16XRow<Dot>), Dot ? kTileMBf16 : kTileM);
  const int64_t chunk_rows = M < row_chunk ? M : row_chunk;
#pragma omp parallel num_threads(num_threads)
  {
    // The widening path's fp32 copy of a chunk of rows: each thread its own, kept between calls.
    // Widened by one thread for all, it left the other waiting and fetching the copy from its
    // neighbour's L2.
    static thread_local std::vector<float> xw;
    if constexpr (!Dot) xw.resize(size_t(chunk_rows * K));
    static thread_local std::vector<uint16_t> pair;  // silu: a pair of panels' bf16 outputs
    if (silu) pair.resize(size_t(chunk_rows * 2 * kPanel));
    for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
      const int64_t m1 = m0 + row_chunk < M ? m0 + row_chunk : M, rows = m1 - m0;
      const Bf16XRow<Dot>* xr;
      int64_t ldxr;
      if constexpr (Dot) {
        xr = x + m0 * ldx;
        ldxr = ldx;
      } else {
        // Widened with each pair swapped (see bf16_tile), a 32-bit pair at a time into 64 bits:
        // the high bf16 (odd k) widened into the low float, the low one into the high float. A
        // loop the compiler vectorises; element by element it was a visible share of a GEMM
        // (docs/log/2026-11-26-python-between-kernels.md).
        for (int64_t m = m0; m < m1; ++m) {
          uint64_t* row = reinterpret_cast<uint64_t*>(xw.data() + (m - m0) * K);
          for (int64_t p = 0; p < K / 2; ++p) {
            uint32_t pair_bits;
            std::memcpy(&pair_bits, x + m * ldx + 2 * p, 4);
            row[p] = uint64_t(pair_bits & 0xffff0000u) | (uint64_t(pair_bits & 0xffffu) << 48);
          }
        }
        xr = xw.data();
        ldxr = K;
      }
      if (silu) {
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < num_panels / 2; ++j) {
          bf16_panel_rows<Dot>(xr, ldxr, rows, packed, 2 * j, K2, N, bias, pair.data(), 2 * kPanel);
          bf16_panel_rows<Dot>(xr, ldxr, rows, packed, 2 * j + 1, K2, N, bias, pair.data() + kPanel, 2 * kPanel);
          silu_and_mul<uint16_t>(pair.data(), out + m0 * ldo + j * kPanel, rows, kPanel, 2 * kPanel, ldo, kPanel, 1);
        }
      } else {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < num_panels; ++q)
          bf16_panel_rows<Dot>(xr, ldxr, rows, packed, q, K2, N, bias, out + m0 * ldo + q * kPanel, ldo);
      }
    }
  }
  return 0;
}

// Which vector path bf16 GEMMs take where the build has vdpbf16ps. Both add each pair's products
// in the same order, so the same bits (tests/models/test_model_ops.py), and the choice is speed alone,
// which depends on the core: on a Sapphire Rapids-class Xeon with its tiles off widening was the
// faster (docs/log/2026-11-26-bf16-off-the-tiles.md), on a Zen 4 EPYC vdpbf16ps, by more
// (docs/log/2026-11-26-epyc-fourteenth-round.md). So it is timed, once per process, on a small GEMM
// bound by arithmetic; vdpbf16ps stays unless widening is clearly faster.
inline bool bf16_dot_measured_faster() {
  if constexpr (!kHaveBf16Dot) {
    return false;
  } else {
    constexpr int64_t M = 48, N = 4 * kPanel, K = 512;  // 48 KiB of x, 128 KiB of weights
    std::vector<uint16_t> x(M * K), out(M * N);
    std::vector<int32_t> w(N * K / 2);
    for (size_t i = 0; i < x.size(); ++i) x[i] = uint16_t(0x3f00 + i * 7 % 255);  // [0.5, 1)
    for (size_t i = 0; i < w.size(); ++i) w[i] = int32_t(0x3c003c00u + (i * 13 % 251) * 0x10001u);
    double best[2] = {1e30, 1e30};
    for (int round = 0; round < 8; ++round) {
      for (int dot = 0; dot < 2; ++dot) {
        const auto t0 = std::chrono::steady_clock::now();
        if (dot) linear_packed_bf16_vec<true>(x.data(), w.data(), nullptr, out.data(), M, N, K, K, N, 1, false);
        else linear_packed_bf16_vec<false>(x.data(), w.data(), nullptr, out.data(), M, N, K, K, N, 1, false);
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (t < best[dot]) best[dot] = t;
      }
    }
    return best[1] <= 1.05 * best[0];
  }
}

inline int g_bf16_dot_set = -1;  // packed_gemm_bf16_dot's setting; -1: the measured choice

inline bool use_bf16_dot() {
  if constexpr (!kHaveBf16Dot) return false;
  if (g_bf16_dot_set >= 0) return g_bf16_dot_set == 1;
  static const bool measured = bf16_dot_measured_faster();
  return measured;
}

// The vector path chosen above, for linear_packed_bf16 and linear_packed_silu off the tiles.
inline int linear_packed_bf16_vector(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                                     int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads,
                                     bool silu) {
  if constexpr (kHaveBf16Dot) {
    if (use_bf16_dot())
      return linear_packed_bf16_vec<true>(x, packed, bias, out, M, N, K, ldx, ldo, num_threads, silu);
  }
  return linear_packed_bf16_vec<false>(x, packed, bias, out, M, N, K, ldx, ldo, num_threads, silu);
}

