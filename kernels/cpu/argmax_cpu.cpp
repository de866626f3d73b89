// Greedy sampling's argmax over each row of the logits (pagedrun/sample/argmax.py), float32 or bfloat16
// (read widened: exact, so the answer is the float32 logits' one without a float32 copy).
//
// Why a kernel: torch.argmax over a decode step's [64, 49152] logits is several times slower, a
// visible part of the step (docs/log/2026-11-25-fused-silu-amx-epilogue.md,
// docs/log/2026-11-27-figures-from-code-comments.md); this runs at memory speed. Same answer as
// torch.argmax: the index of the first maximum, and of the first NaN in a row that holds one (NaN
// counts as the largest value).
//
// One pass, a vector at a time: each lane keeps its running maximum and the position where it was
// first reached (a strictly larger value replaces it, an equal one does not); the row's answer is
// the smallest position among the lanes that hold the row's maximum.

#include <cstdint>
#include <limits>

#include "simd.h"

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

inline vgf load_row_v(const float* p) { return load_v(p); }
inline vgf load_row_v(const uint16_t* p) { return load_bf16_v(p); }
inline float row_at(const float* p, int64_t i) { return p[i]; }
inline float row_at(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (row_at(row, i) != row_at(row, i)) return i;
  return -1;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  vgf best = broadcast_v(-std::numeric_limits<float>::infinity());
  vgi lane, nan = {};
  for (int j = 0; j < kVec; ++j) lane[j] = j;
  // Each lane's maximum and its first position (a lane of -inf only: its first element, which is
  // one). Positions fit in 32 bits: a row of logits is one vocabulary.
  vgi at = lane;
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const vgf v = load_row_v(row + i);
    const vgi larger = v > best;
    best = larger ? v : best;
    at = larger ? lane + int32_t(i) : at;
    nan |= v != v;
  }
  float m = 0.0f;
  int64_t pos = -1;
  if (i > 0) {
    m = best[0];
    for (int j = 1; j < kVec; ++j) m = best[j] > m ? best[j] : m;
    for (int j = 0; j < kVec; ++j) {
      if (nan[j]) return first_nan(row, n);
      if (best[j] == m && (pos < 0 || at[j] < pos)) pos = at[j];
    }
  }
  for (; i < n; ++i) {
    const float x = row_at(row, i);
    if (x != x) return first_nan(row, n);
    if (pos < 0 || x > m) {
      m = x;
      pos = i;
    }
  }
  return pos;
}

template <typename T>
int argmax_rows(const T* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int num_threads) {
  if (rows < 0 || n <= 0 || n > INT32_MAX - kVec || ld < n) return -1;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 262144)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * ld, n);
  return 0;
}

}  // namespace

// out[r] = argmax of row r of x [rows, n] (row stride ld), int64. 0, or -1 (nothing written) on bad sizes.
PR_EXPORT int argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out, int num_threads) {
  return argmax_rows(x, rows, n, ld, out, num_threads);
}

// The same over bfloat16 logits (their bits, uint16).
PR_EXPORT int argmax_rows_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ld, int64_t* out,
                               int num_threads) {
  return argmax_rows(x, rows, n, ld, out, num_threads);
}
