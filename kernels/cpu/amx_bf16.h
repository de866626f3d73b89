// The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later: amx_tile + amx_bf16), for
// kernels/cpu/model_ops_cpu.cpp's linear_packed_bf16. Compiled only where pagedrun/build/cpu.py
// passes -mamx-tile -mamx-bf16 (the CPU has both); used only once the kernel has granted the process
// the AMX register state (Linux asks for it: arch_prctl ARCH_REQ_XCOMP_PERM).
//
// Why: a vdpbf16ps core does 32 bf16 products per instruction; one TDPBF16PS does 16 x 16 x 32.
// At a decode step's 8-64 rows the tiles outrun the vector GEMM, by several times at 64 rows
// (docs/log/2026-11-25-amx-gemm-prefetch.md).
//
// No new weight layout: the packed bf16 panels ([N / 32][K / 2][32] words, a word = the two bf16 of
// one column at k = 2p, 2p + 1) already are AMX's "VNNI" B layout. Rows p0..p0+15 of a panel, 16
// columns wide, are one B tile of 16 rows x 64 bytes at a row stride of 128 bytes; the panel's other
// 16 columns are the tile 64 bytes further. x supplies A tiles (16 rows x 32 bf16) at its own stride.
//
//   C tiles (fp32, 16 x 16)     tile 0 = A0 . B0   tile 1 = A0 . B1      A0 = x rows m..m+15
//                               tile 2 = A1 . B0   tile 3 = A1 . B1      A1 = x rows m+16..m+31
//   for each 32 k: load A0 A1 (tiles 4, 5), B0 B1 (tiles 6, 7), 4 x TDPBF16PS
//
// Sums are fp32 over pairs of exact bf16 products, as on the vector path, but in the tile unit's
// own order (and with bf16 denormals read as zero), so bits may differ from the vector path's;
// tests/models/test_model_ops.py holds both to the same float64 bound.
#pragma once

// (Not in the 8-wide test build, PR_GEMM_VEC8, whose panels are 16 columns.)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(PR_GEMM_VEC8)
#define PR_HAVE_AMX 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"    // amx_permitted, amx_configure
#include "bf16_gemm.h"    // store_bf16_panel_row
#include "elementwise.h"  // silu_v
#include "f32_gemm.h"     // kPanel
#include "simd.h"

namespace {

static_assert(kPanel == 32, "AMX B tiles are 16 columns, two per 32-column panel");

// Rows of x from which the tiles take the GEMM: every row count. With hot weights the vector kernel
// wins at 1-2 rows (a tile pass costs the same at 1 row as at 16), but a decode step's weights come
// from memory, and there the tiles stream them faster, at 1 and 2 rows too
// (docs/log/2026-11-26-qwen3-runner-fp32-gemm-ceiling.md). One path at every row count also makes a
// row's sums independent of the rows beside it (the two paths can differ in a sum's last bit:
// tests/models/test_model_ops.py).
constexpr int64_t kAmxMinRows = 1;

// Weights are prefetched this far ahead of the tile loads (a thread's panels are contiguous, so
// this runs on into its next panel): tile loads of cold memory stall the tile unit, which does not
// overlap them with its math on its own. 4 KiB ahead shortened cold-weight decode steps; 2048 and
// 8192 bytes were no better, next-panel prefetch and _MM_HINT_T1 worse
// (docs/log/2026-11-25-amx-gemm-prefetch.md).
constexpr int64_t kAmxPrefetchAhead = 4096;

// Two vectors of a tile's fp32 sums (a panel row) rounded to bf16 by vcvtne2ps2bf16: nearest even,
// as torch's integer route rounds, except that an fp32 denormal becomes zero, as in oneDNN's bf16
// GEMMs (torch's own on such a CPU). Every CPU with AMX has avx512_bf16.
inline __m512i amx_bf16_row(vgf a0, vgf a1) { return (__m512i)_mm512_cvtne2ps_pbh((__m512)a1, (__m512)a0); }

// The epilogue of a finished block of rows: its sums (+ bias) rounded to bf16 and stored, or with
// the gate/up pair of linear_packed_silu, silu(gate) * up. Run a few rows at a time from inside the
// next block's k loop: run after the block, it waited for the tile unit to drain and the tiles
// waited for it, a large share of a prefill GEMM's time
// (docs/log/2026-11-25-fused-silu-amx-epilogue.md).
struct PendingRows {
  const float* acc = nullptr;     // [32][kPanel] fp32 sums (gate's, with up)
  const float* up = nullptr;      // linear_packed_silu: up's sums, else null
  uint16_t* out = nullptr;        // row 0 of the block, at its first column
  int64_t ldo = 0, rows = 0, cols = 0, done = 0;
  const uint16_t* bias = nullptr;     // the panel's slice; with up: the whole interleaved bias
  const uint16_t* bias_up = nullptr;  // with up: up's slice of it
  inline void run(int64_t n) {
    const int64_t end = done + n < rows ? done + n : rows;
    for (; done < end; ++done) {
      const float* a = acc + done * kPanel;
      uint16_t* o = out + done * ldo;
      if (up) {
        const float* u = up + done * kPanel;
        for (int h = 0; h < kPanel; h += kVec) {
          vgf g = load_v(a + h), uv = load_v(u + h);
          if (bias) {
            g += load_bf16_v(bias + h);
            uv += load_bf16_v(bias_up + h);
          }
          // gate and up rounded as the GEMM stores them, then silu_and_mul's operations
          const __m512i gu = amx_bf16_row(g, uv);
          g = widen_bf16_v((vgh)_mm512_castsi512_si256(gu));
          uv = widen_bf16_v((vgh)_mm512_extracti64x4_epi64(gu, 1));
          store_bf16_v(o + h, round_bf16_v(silu_v(g)) * uv);
        }
      } else if (cols == kPanel) {
        vgf a0 = load_v(a), a1 = load_v(a + kVec);
        if (bias) {
          a0 += load_bf16_v(bias);
          a1 += load_bf16_v(bias + kVec);
        }
        _mm512_storeu_si512(o, amx_bf16_row(a0, a1));
      } else {
        store_bf16_panel_row(o, load_v(a), load_v(a + kVec), bias, cols);
      }
    }
  }
  inline void finish() { run(rows - done); }
};

// Rows [m, m + 16 * blocks) of x (blocks = 1 or 2) times panel (its kPanel columns, K2 pairs), the
// fp32 sums stored into acc [32][kPanel]; `pending` (the previous block's epilogue, on other
// buffers) is run alongside, and finished before this block's sums are stored.
template <int Blocks>
inline void amx_block(const uint16_t* x, int64_t ldx, const int32_t* panel, int64_t K2, float* acc,
                      const char* prefetch, PendingRows* pending) {
  const int64_t per_step = pending ? (pending->rows + K2 / 16 - 1) / (K2 / 16) : 0;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Blocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < K2; p += 16) {
    if (prefetch) {
      // The rows kAmxPrefetchAhead bytes past this k step's (16 x 128 bytes).
      const char* pf = prefetch + p * kPanel * 4;
      for (int line = 0; line < 16 * kPanel * 4; line += 64) _mm_prefetch(pf + line, _MM_HINT_T0);
    }
    _tile_loadd(4, x + 2 * p, ldx * 2);
    if constexpr (Blocks == 2) _tile_loadd(5, x + 16 * ldx + 2 * p, ldx * 2);
    _tile_loadd(6, panel + p * kPanel, kPanel * 4);
    _tile_loadd(7, panel + p * kPanel + 16, kPanel * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Blocks == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (pending) pending->run(per_step);
  }
  if (pending) pending->finish();
  _tile_stored(0, acc, kPanel * 4);
  _tile_stored(1, acc + 16, kPanel * 4);
  if constexpr (Blocks == 2) {
    _tile_stored(2, acc + 16 * kPanel, kPanel * 4);
    _tile_stored(3, acc + 16 * kPanel + 16, kPanel * 4);
  }
}

// linear_packed_bf16 on tiles; false (nothing written) where they cannot take it: fewer rows than
// kAmxMinRows, K not a multiple of 32, or no AMX permission. With `silu`, out [M, N / 2] gets
// silu(gate) * up instead (linear_packed_silu: panels 2j, 2j + 1 are gate and up of the same columns).
inline bool linear_packed_bf16_amx(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                                   int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads,
                                   bool silu = false) {
  if (M < kAmxMinRows || K % 32 || !amx_permitted()) return false;
  // A tiles read 16 whole rows: a row count that is not a multiple of 16 goes through a zero-padded
  // copy, 64-byte aligned like torch's tensors (tile loads of rows that straddle cache lines are
  // much slower: docs/log/2026-11-25-fused-silu-amx-epilogue.md). The calling thread's, kept
  // between calls.
  const int64_t Mpad = (M + 15) / 16 * 16;
  if (Mpad != M) {
    static thread_local std::vector<uint16_t> padded;
    const int64_t ldp = (K + 31) / 32 * 32;  // rows of whole cache lines
    if (padded.size() < size_t(Mpad * ldp + 32)) padded.resize(size_t(Mpad * ldp + 32));
    uint16_t* p = padded.data() + (32 - reinterpret_cast<uintptr_t>(padded.data()) % 64 / 2) % 32;
    for (int64_t m = 0; m < M; ++m) std::memcpy(p + m * ldp, x + m * ldx, K * 2);
    std::memset(p + M * ldp, 0, size_t((Mpad - M) * ldp * 2));
    x = p;
    ldx = ldp;
  }
  const int64_t num_panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
  // Rows in chunks that stay in L2 while every panel passes over them, 1 MiB of them: each chunk
  // streams all the weights again, and the tiles compute fast enough that this shows (1 MiB beat
  // the vector kernels' 256 KiB at 256-1024 rows: docs/log/2026-11-25-amx-gemm-prefetch.md).
  // Machines with AMX have 2 MiB of L2 per core.
  constexpr int64_t kAmxXBytesInL2 = 1024 * 1024;
  int64_t row_chunk = kAmxXBytesInL2 / (K * 2) / 32 * 32;
  if (row_chunk < 32) row_chunk = 32;
#pragma omp parallel num_threads(num_threads)
  {
    amx_configure();
    // Sums of the block being computed and of the one whose epilogue runs beside it: two sets.
    alignas(64) float bufs[2][2][32 * kPanel];
    PendingRows pending;
    int set = 0;
    for (int64_t m0 = 0; m0 < Mpad; m0 += row_chunk) {
      const int64_t m1 = m0 + row_chunk < Mpad ? m0 + row_chunk : Mpad;
#pragma omp for schedule(static) nowait
      for (int64_t q = 0; q < (silu ? num_panels / 2 : num_panels); ++q) {
        // silu: q is the pair of panels 2q (gate) and 2q + 1 (up) of output columns [q, q + 1) x kPanel
        const int32_t* panel = packed + (silu ? 2 * q : q) * K2 * kPanel;
        const int64_t n0 = q * kPanel, cols = silu || N - n0 >= kPanel ? kPanel : N - n0;
        for (int64_t m = m0; m < m1; m += 32) {
          const bool two = m + 32 <= m1;
          float* acc = bufs[set][0];
          float* acc_up = silu ? bufs[set][1] : nullptr;
          // only the first row block reads the panel from memory; the next ones find it in cache
          const char* pf = m == m0 ? reinterpret_cast<const char*>(panel) + kAmxPrefetchAhead : nullptr;
          for (int half = 0; half < (silu ? 2 : 1); ++half) {
            const int32_t* w = panel + half * K2 * kPanel;
            const char* pfw = pf ? pf + half * K2 * kPanel * 4 : nullptr;
            PendingRows* pend = half == 0 && pending.done < pending.rows ? &pending : nullptr;
            if (two) amx_block<2>(x + m * ldx, ldx, w, K2, half ? acc_up : acc, pfw, pend);
            else amx_block<1>(x + m * ldx, ldx, w, K2, half ? acc_up : acc, pfw, pend);
          }
          pending = PendingRows{};
          pending.acc = acc;
          pending.up = acc_up;
          pending.out = out + m * ldo + n0;
          pending.ldo = ldo;
          pending.rows = (two ? 32 : 16) < M - m ? (two ? 32 : 16) : M - m;
          pending.cols = cols;
          if (bias) {
            pending.bias = silu ? bias + 2 * q * kPanel : bias + n0;
            pending.bias_up = silu ? bias + (2 * q + 1) * kPanel : nullptr;
          }
          set ^= 1;
        }
      }
    }
    pending.finish();
    _tile_release();
  }
  return true;
}

}  // namespace
#endif
