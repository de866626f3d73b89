// Prefill attention on fp32 FMAs for paged_attention_cpu.cpp (every CPU; bf16 on AMX takes
// attention_amx.h instead), on the decode helpers it reuses (attention_decode.h: Vec,
// weighted_sumR, softmax_chunk).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_decode.h"  // kKeysPerChunk, kMaxGroupRows, Prefetcher, weighted_sumR, softmax_chunk,
                               // softcap_scores
#include "simd.h"

namespace {

// ---- prefill: many tokens against the same keys ----
//
// The tokens of a prefill item that see a chunk take it together: the chunk's K transposed once
// into fp32 kt [hd][kKeysPerChunk] (V widened once into fp32 rows), so a row's scores are up to
// kKeysPerChunk / kVec vectors of FMAs over d, broadcasting q: up to kQkAcc rows share each kt load
// and no lane has to be folded and summed across (per key and row, that horizontal sum cost as much
// as the dot product itself). A token near the diagonal sees only the chunk's first keys: its other
// scores become -inf. Then softmax per row and V in passes of kMaxGroupRows rows, any rows.
constexpr int kQkAcc = kVec == 16 ? 24 : 12;  // accumulator registers: of AVX-512's 32, of AVX2's 16;
                                              // also the most rows of a pass (one vector of keys)

// Scores s[r][0:NV * kVec] = q[r] . kt[:, c] for RB rows (q rows hd apart, s rows kKeysPerChunk
// apart); kt's columns past the chunk's keys are zero.
template <int RB, int NV, int HD>
inline void qk_tile(const float* __restrict q, int64_t hd_rt, const float* __restrict kt, float* __restrict s) {
  // HD: the head size when it is a common one, known when compiling so that the RB query rows are
  // one pointer and constant offsets (24 row pointers spilled); 0: hd_rt. (Unrolled by hand-set
  // pragmas: left to itself g++ kept 24 accumulators on the stack.)
  const int64_t hd = HD ? HD : hd_rt;
  vgf acc[RB][NV];
#pragma GCC unroll 32
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vgf{};
  for (int64_t d = 0; d < hd; ++d) {
    vgf kv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) kv[v] = load_v(kt + d * kKeysPerChunk + v * kVec);
#pragma GCC unroll 32
    for (int r = 0; r < RB; ++r) {
      const vgf qb = broadcast_v(q[r * hd + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = fma_v(qb, kv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store_v(s + r * kKeysPerChunk + v * kVec, acc[r][v]);
}

template <int RB, int NV>
inline void qk_tile_rows(int rb, const float* q, int64_t hd, const float* kt, float* s) {
  if constexpr (RB > 1) {
    if (rb < RB) return qk_tile_rows<RB - 1, NV>(rb, q, hd, kt, s);
  }
  switch (hd) {
    case 64: return qk_tile<RB, NV, 64>(q, hd, kt, s);
    case 128: return qk_tile<RB, NV, 128>(q, hd, kt, s);
    default: qk_tile<RB, NV, 0>(q, hd, kt, s);
  }
}

// Scores of rows [r, r1) for NV vectors of keys, kQkAcc / NV rows per pass; returns rows done.
template <int NV>
inline int qk_pass(int64_t r, int64_t r1, const float* qf, int64_t hd, const float* kt, float* s) {
  constexpr int RB = kQkAcc / NV;
  const int rb = int(std::min<int64_t>(RB, r1 - r));
  qk_tile_rows<RB, NV>(rb, qf + r * hd, hd, kt, s + r * kKeysPerChunk);
  return rb;
}

// The R-row weighted sum (R = 1..kMaxGroupRows) for rows of fp32 V.
inline void weighted_rows(int rows, float* acc, int64_t hd, const float* p, const float* v, int64_t n,
                          Prefetcher* pf) {
  switch (rows) {
    case 4: return weighted_sumR<4>(acc, hd, p, kKeysPerChunk, v, hd, n, hd, pf);
    case 3: return weighted_sumR<3>(acc, hd, p, kKeysPerChunk, v, hd, n, hd, pf);
    case 2: return weighted_sumR<2>(acc, hd, p, kKeysPerChunk, v, hd, n, hd, pf);
    default: weighted_sum(acc, p, v, hd, n, hd, pf);
  }
}

// Vectors of keys a pass scores for a chunk of n: 1, 2, or all of them (no 3-vector pass: with
// 8-wide vectors 17-24 keys take the 4-vector one).
inline int qk_vectors(int64_t n) {
  const int nv = int((n + kVec - 1) / kVec);
  return nv <= 2 ? nv : kKeysPerChunk / kVec;
}

// Rows [r0, r1) of an item against a chunk's n keys: kt (transposed K), vf (V rows, fp32). Row r
// belongs to token t = t0 + (r - r0) / group, which sees the chunk's keys [lo, hi) (at least one),
// hi = min(n, vis + t), and lo = max(0, vis + t - window) under a window (else 0): the scores of the
// other keys become -inf, so they weigh 0 in its softmax and in V (those keys are real, finite rows:
// the chunk never reaches below the item's first key). softcap > 0: scores capped first. Variant:
// whether either is set (false: the full-attention rows, without even a test for them).
// nv: vectors of keys to score (qk_vectors(n)); kt holds zeros in its columns [n, nv * kVec).
template <bool Variant>
inline void attend_rows_tiled(int64_t r0, int64_t r1, int64_t t0, int64_t group, int64_t vis, int64_t window,
                              float softcap, const float* qf, float* s, float* acc, float* m, float* l, float* p,
                              const float* kt, const float* vf, int64_t n, int nv, int64_t hd, Prefetcher* pf) {
  for (int64_t r = r0; r < r1;) {
    const int rb = nv == 1   ? qk_pass<1>(r, r1, qf, hd, kt, s)
                   : nv == 2 ? qk_pass<2>(r, r1, qf, hd, kt, s)
                             : qk_pass<kKeysPerChunk / kVec>(r, r1, qf, hd, kt, s);
    for (int j = 0; j < rb; ++j) {
      float* sr = s + (r + j) * kKeysPerChunk;
      const int64_t seen = vis + t0 + (r + j - r0) / group;  // keys of the chunk up to the token's own
      if constexpr (Variant) {
        if (softcap > 0.0f) softcap_scores(sr, n, softcap);
        for (int64_t c = 0, lo = window > 0 ? seen - window : 0; c < lo; ++c) sr[c] = -__builtin_inff();
      }
      for (int64_t c = std::min<int64_t>(n, seen); c < n; ++c) sr[c] = -__builtin_inff();
      softmax_chunk(sr, n, hd, m[r + j], l[r + j], acc + (r + j) * hd, p + j * kKeysPerChunk);
    }
    for (int j = 0; j < rb; j += kMaxGroupRows)
      weighted_rows(std::min(kMaxGroupRows, rb - j), acc + (r + j) * hd, hd, p + j * kKeysPerChunk, vf, n, pf);
    r += rb;
  }
}

}  // namespace
