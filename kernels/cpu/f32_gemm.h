// The fp32 packed GEMM, for kernels/cpu/model_ops_cpu.cpp (linear_packed_f32, linear_packed_silu),
// whose tile the bf16 GEMM's widening path also runs (bf16_gemm.h).
#pragma once

#include <cstdint>

#include "simd.h"

namespace {

// ---- GEMM: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w packed ----
//
// The model's Linear weights are repacked once after loading (pagedrun.models.ops.pack_weight) into
// panels of kPanel = 2 vectors of output columns: packed[q][k][j] = w[q * kPanel + j][k], zero-padded
// past N. A panel's row k holds column block q's weights for input k, so a tile of MR rows of x times
// the panel is an outer product per k: two vector loads of weights, MR broadcasts of x, 2 * MR FMAs
// into 2 * MR accumulators. Panels stream contiguously from memory, so the hardware prefetcher
// follows them, and each panel slice (kKc rows of k, 16 KiB; 24 in some cases, below) stays in L1
// beside a tile of x while every row tile of x passes over it. Each output element is one sum over
// k in increasing order (continued across k-slices through the output itself), so results do not
// depend on the thread count, the blocking or the vector width.

constexpr int kPanel = 2 * kVec;
constexpr int64_t kKc = 16384 / (kPanel * 4);  // k rows of a panel slice: 16 KiB
// With AVX-512 and more than 16 rows, slices of 24 KiB: fewer passes of each tile's accumulators
// in and out, a few percent from 32 rows on a Zen 4 (which then holds the slice in L1 only in part);
// at 16 rows and fewer (bound by the weights' bytes) and with AVX2's panels the 16 KiB slices were
// as fast or faster (docs/log/2026-11-27-gemm-panel-slices.md).
constexpr int64_t kKcWide = kVec == 16 ? 24576 / (kPanel * 4) : kKc;
inline int64_t slice_rows_for(int64_t rows) { return rows > 16 ? kKcWide : kKc; }
constexpr int64_t kXBytesInL2 = 256 * 1024;    // rows of x kept hot in L2 while all panels pass by
// Up to this many rows (a decode step's) go in one chunk whatever K: a second chunk streams every
// weight from memory again, which costs more than x's rows spilling from L2 to L3 (fp32, 30 layers
// of the default model's 576 x 1536 down projection, cold: docs/log/2026-11-26-python-between-kernels.md).
constexpr int64_t kOneChunkRows = 64;

// One row of a packed panel (kPanel floats, or kPanel bf16 pairs: kPanel * 4 bytes) asked for ahead
// of the GEMMs' loads, into L2 (prefetcht1), not L1: faster with cold weights at a decode step's
// few rows, level from 32 rows (docs/log/2026-11-26-qwen3-runner-fp32-gemm-ceiling.md). Likely
// why, not measured: an L1 prefetch holds one of the core's few line-fill buffers until its line
// arrives.
inline void prefetch_panel_row_l2(const void* row) {
  for (int line = 0; line < kPanel * 4; line += 64) __builtin_prefetch(static_cast<const char*>(row) + line, 0, 2);
}

// Rows of x per chunk: kXBytesInL2 of them (whole tiles), or all of them up to kOneChunkRows.
inline int64_t row_chunk_for(int64_t M, int64_t K, int64_t elem_bytes, int64_t tile) {
  int64_t chunk = kXBytesInL2 / (K * elem_bytes);
  chunk = chunk < tile ? tile : chunk / tile * tile;
  return M <= kOneChunkRows && M > chunk ? M : chunk;
}

// MR rows of x (row stride ldx) times panel rows [k0, k1) into c (row stride ldc): started from
// zero when `first`, else continued from c; bias added when given (the last slice). `prefetch`:
// this tile's share of the next slice to pull in from memory while it computes, one panel row
// (kPanel floats) every `pf_every` k (the slice's tiles each take a share, so the requests are
// spread over all of its arithmetic: asked for by the first tile alone they came faster than the
// core's line-fill buffers drain, and its FMAs waited behind them).
template <int MR>
inline void packed_tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k0,
                        int64_t k1, float* __restrict c, int64_t ldc, bool first, const float* bias,
                        const float* prefetch, int pf_every) {
  vgf acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? vgf{} : load_v(c + i * ldc);
    acc[i][1] = first ? vgf{} : load_v(c + i * ldc + kVec);
  }
  int pf_count = 1;
#pragma GCC unroll 4
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch && --pf_count == 0) {
      pf_count = pf_every;
      prefetch_panel_row_l2(prefetch);
      prefetch += kPanel;
    }
    const vgf w0 = load_v(panel + k * kPanel), w1 = load_v(panel + k * kPanel + kVec);
    for (int i = 0; i < MR; ++i) {
      const vgf xv = broadcast_v(x[i * ldx + k]);
      acc[i][0] = fma_v(xv, w0, acc[i][0]);
      acc[i][1] = fma_v(xv, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (bias) {
      acc[i][0] += load_v(bias);
      acc[i][1] += load_v(bias + kVec);
    }
    store_v(c + i * ldc, acc[i][0]);
    store_v(c + i * ldc + kVec, acc[i][1]);
  }
}

template <int MR>
inline void packed_tile_rows(int mr, const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                             float* c, int64_t ldc, bool first, const float* bias, const float* prefetch,
                             int pf_every) {
  if constexpr (MR > 1) {
    if (mr < MR)
      return packed_tile_rows<MR - 1>(mr, x, ldx, panel, k0, k1, c, ldc, first, bias, prefetch, pf_every);
  }
  packed_tile<MR>(x, ldx, panel, k0, k1, c, ldc, first, bias, prefetch, pf_every);
}

// All row tiles of rows [m0, m1) against panel q over the whole K, slice by slice, into out (row
// m0's first column of this panel; rows ldo apart). The last panel may be partial (N not a multiple
// of kPanel): its tiles go through a full-width scratch tile.
inline void packed_panel(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* packed, int64_t q,
                         int64_t num_panels, int64_t N, int64_t K, const float* bias, float* out, int64_t ldo) {
  const float* panel = packed + q * K * kPanel;
  const int64_t n0 = q * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
  float scratch[kTileM * kPanel];
  const int64_t kc = slice_rows_for(m1 - m0);
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t k1 = k0 + kc < K ? k0 + kc : K;
    const bool first = k0 == 0, last = k1 == K;
    // Next in this thread's stream: the panel's next slice, else the next panel's first (rows
    // [k1, k1 + kc) of the packed weight either way: panels are contiguous), shared by the tiles.
    const float* next = k1 < K || q + 1 < num_panels ? panel + k1 * kPanel : nullptr;
    const int tiles = int((m1 - m0 + kTileM - 1) / kTileM);
    const int64_t share = (kc + tiles - 1) / tiles;  // next-slice rows per tile
    for (int64_t m = m0, t = 0; m < m1; m += kTileM, ++t) {
      const int mr = m1 - m < kTileM ? int(m1 - m) : kTileM;
      float* c = out + (m - m0) * ldo;
      const float* prefetch = next ? next + t * share * kPanel : nullptr;
      const int pf_every = int((k1 - k0 + share - 1) / share);
      if (cols == kPanel) {
        packed_tile_rows<kTileM>(mr, x + m * ldx, ldx, panel, k0, k1, c, ldo, first,
                                 last && bias ? bias + n0 : nullptr, prefetch, pf_every);
        continue;
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < kPanel; ++j) scratch[i * kPanel + j] = !first && j < cols ? c[i * ldo + j] : 0.0f;
      packed_tile_rows<kTileM>(mr, x + m * ldx, ldx, panel, k0, k1, scratch, kPanel, first, nullptr, prefetch,
                               pf_every);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < cols; ++j)
          c[i * ldo + j] = scratch[i * kPanel + j] + (last && bias ? bias[n0 + j] : 0.0f);
    }
  }
}
}  // namespace
