// The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later: amx_tile + amx_bf16), for
// kernels/cpu/model_ops_cpu.cpp's linear_packed_bf16. Compiled only where pagedrun/cpu_build.py
// passes -mamx-tile -mamx-bf16 (the CPU has both); used only once the kernel has granted the process
// the AMX register state (Linux asks for it: arch_prctl ARCH_REQ_XCOMP_PERM).
//
// Why: a vdpbf16ps core does 32 bf16 products per instruction; one TDPBF16PS does 16 x 16 x 32.
// At a decode step's 8-64 rows the vector GEMM stops near 200 GFLOP/s on a 2-core Sapphire Rapids,
// the tiles reach several times that (docs/benchmarks.md).
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
// tests/test_model_ops.py holds both to the same float64 bound.
#pragma once

// (Not in the 8-wide test build, PR_GEMM_VEC8, whose panels are 16 columns.)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(PR_GEMM_VEC8)
#define PR_HAVE_AMX 1
#include <vector>

#include "amx_tiles.h"

namespace {

static_assert(kPanel == 32, "AMX B tiles are 16 columns, two per 32-column panel");

// Rows of x below which the vector kernel wins (measured: tiles ahead from 3 rows, behind at 1-2;
// a tile pass costs the same at 1 row as at 16).
constexpr int64_t kAmxMinRows = 3;

// Weights are prefetched this far ahead of the tile loads (a thread's panels are contiguous, so
// this runs on into its next panel): tile loads of cold memory stall the tile unit, which does not
// overlap them with its math on its own. Cold-weight decode steps of the default model's 30 layers,
// 2 threads, same process: 11.5 -> 10.1 ms at 32 rows, 13.0 -> 12.3 at 48, 14.7 -> 13.9 at 64
// (2048 and 8192 bytes no better; next-panel prefetch and _MM_HINT_T1 worse).
constexpr int64_t kAmxPrefetchAhead = 4096;

// Rows [m, m + 16 * blocks) of x (blocks = 1 or 2) times panel (its kPanel columns, K2 pairs), the
// fp32 sums stored into acc [32][kPanel].
template <int Blocks>
inline void amx_block(const uint16_t* x, int64_t ldx, const int32_t* panel, int64_t K2, float* acc,
                      const char* prefetch) {
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
  }
  _tile_stored(0, acc, kPanel * 4);
  _tile_stored(1, acc + 16, kPanel * 4);
  if constexpr (Blocks == 2) {
    _tile_stored(2, acc + 16 * kPanel, kPanel * 4);
    _tile_stored(3, acc + 16 * kPanel + 16, kPanel * 4);
  }
}

// silu(gate) * up for rows [m, m + rows) of output columns [j * kPanel, (j + 1) * kPanel), from the
// fp32 sums of the gate and up panels of pair j (linear_packed_silu's interleaved layout): each
// rounded to bf16 with its bias, as the GEMM would store it, then silu_and_mul's operations.
inline void silu_epilogue(const float* gate, const float* up, const uint16_t* bias, int64_t j, int64_t rows,
                          uint16_t* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i)
    for (int h = 0; h < kPanel; h += kVec) {
      vgf g = load_v(gate + i * kPanel + h), u = load_v(up + i * kPanel + h);
      if (bias) {
        g += load_bf16_v(bias + 2 * j * kPanel + h);
        u += load_bf16_v(bias + (2 * j + 1) * kPanel + h);
      }
      g = round_bf16_v(g);
      store_bf16_v(out + i * ldo + j * kPanel + h, round_bf16_v(silu_v(g)) * round_bf16_v(u));
    }
}

// linear_packed_bf16 on tiles; false (nothing written) where they cannot take it: fewer rows than
// kAmxMinRows, K not a multiple of 32, or no AMX permission. With `silu`, out [M, N / 2] gets
// silu(gate) * up instead (linear_packed_silu: panels 2j, 2j + 1 are gate and up of the same columns).
inline bool linear_packed_bf16_amx(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                                   int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads,
                                   bool silu = false) {
  if (M < kAmxMinRows || K % 32 || !amx_permitted()) return false;
  // A tiles read 16 whole rows: a row count that is not a multiple of 16 goes through a zero-padded copy.
  const int64_t Mpad = (M + 15) / 16 * 16;
  std::vector<uint16_t> padded;
  if (Mpad != M) {
    padded.assign(Mpad * K, 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * K, x + m * ldx, K * 2);
    x = padded.data();
    ldx = K;
  }
  const int64_t num_panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
  // Rows in chunks that stay in L2 while every panel passes over them, 1 MiB of them: each chunk
  // streams all the weights again, and the tiles compute fast enough that this shows (default-model
  // shapes, 30 layers, 2 threads: 256 KiB as the vector kernels -> 1 MiB, 39.7 -> 35.6 ms at 256
  // rows, 79.7 -> 73.6 at 430, 150.7 -> 137.9 at 1024). Machines with AMX have 2 MiB of L2 per core.
  constexpr int64_t kAmxXBytesInL2 = 1024 * 1024;
  int64_t row_chunk = kAmxXBytesInL2 / (K * 2) / 32 * 32;
  if (row_chunk < 32) row_chunk = 32;
#pragma omp parallel num_threads(num_threads)
  {
    amx_configure();
    alignas(64) float acc[32 * kPanel], acc_up[32 * kPanel];
    for (int64_t m0 = 0; m0 < Mpad; m0 += row_chunk) {
      const int64_t m1 = m0 + row_chunk < Mpad ? m0 + row_chunk : Mpad;
      if (silu) {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < num_panels / 2; ++j) {
          const int32_t* gate = packed + 2 * j * K2 * kPanel;
          const int32_t* up = gate + K2 * kPanel;
          for (int64_t m = m0; m < m1; m += 32) {
            const bool two = m + 32 <= m1;
            const char* pf_gate = m == m0 ? reinterpret_cast<const char*>(gate) + kAmxPrefetchAhead : nullptr;
            const char* pf_up = m == m0 ? reinterpret_cast<const char*>(up) + kAmxPrefetchAhead : nullptr;
            if (two) {
              amx_block<2>(x + m * ldx, ldx, gate, K2, acc, pf_gate);
              amx_block<2>(x + m * ldx, ldx, up, K2, acc_up, pf_up);
            } else {
              amx_block<1>(x + m * ldx, ldx, gate, K2, acc, pf_gate);
              amx_block<1>(x + m * ldx, ldx, up, K2, acc_up, pf_up);
            }
            const int64_t rows = (two ? 32 : 16) < M - m ? (two ? 32 : 16) : M - m;
            silu_epilogue(acc, acc_up, bias, j, rows, out + m * ldo, ldo);
          }
        }
        continue;
      }
#pragma omp for schedule(static)
      for (int64_t q = 0; q < num_panels; ++q) {
        const int32_t* panel = packed + q * K2 * kPanel;
        const int64_t n0 = q * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
        for (int64_t m = m0; m < m1; m += 32) {
          const bool two = m + 32 <= m1;
          // only the first row block reads the panel from memory; the next ones find it in cache
          const char* pf = m == m0 ? reinterpret_cast<const char*>(panel) + kAmxPrefetchAhead : nullptr;
          if (two) amx_block<2>(x + m * ldx, ldx, panel, K2, acc, pf);
          else amx_block<1>(x + m * ldx, ldx, panel, K2, acc, pf);
          const int64_t rows = (two ? 32 : 16) < M - m ? (two ? 32 : 16) : M - m;
          for (int64_t i = 0; i < rows; ++i)
            store_bf16_panel_row(out + (m + i) * ldo + n0, load_v(acc + i * kPanel), load_v(acc + i * kPanel + kVec),
                                 bias ? bias + n0 : nullptr, cols);
        }
      }
    }
    _tile_release();
  }
  return true;
}

}  // namespace
#endif
