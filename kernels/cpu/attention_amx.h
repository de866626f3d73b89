// Prefill attention's two products on AMX tiles (bf16 models on CPUs with amx_tile + amx_bf16), for
// kernels/cpu/paged_attention_cpu.cpp: the tokens of a prefill item against one chunk of keys, as
// attend_rows_tiled does with fp32 FMAs, but
//
//   scores  S [16 rows x 32 keys]  = Q [16 x hd] . K^T       (2 C tiles, Q unscaled bf16, fp32 sums)
//   output  O [16 rows x hd]      += P [16 x 32 keys] . V     (P rounded to bf16, as torch's CPU flash
//                                                             attention does before its P.V GEMM)
//
// with the online softmax between them in fp32 (scores x scale, exps, sums; softmax_row32). The
// chunk's K and V are repacked once per (chunk, kv head) into the tiles' pair layout and serve every
// row of the item: K^T as words [hd / 2][32 keys] (a word = K[c][2p], K[c][2p + 1], one row of K read
// as 32-bit words and transposed), V as [16 key pairs][hd][2]. Keys past the chunk are zero in both,
// so their columns score 0 (then -inf, masked) and their P is 0.
//
// Sums run in the tile unit's order, not the FMA path's: results differ from it within rounding
// (tests hold both to the same float64 bound). Included by paged_attention_cpu.cpp; empty where the
// build has no AMX.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(PR_GEMM_VEC8)
#define PR_ATTENTION_AMX 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx_tiles.h"           // amx_permitted
#include "attention_decode.h"    // kKeysPerChunk: the chunk of keys every path scores at a time
#include "attention_elements.h"  // BF16
#include "simd.h"

namespace {

bool g_attention_amx = true;  // tests switch it off to compare with the FMA path

constexpr int kAmxMaxHead = 256;  // head sizes up to this, multiples of 32

// Whether a prefill item of this model takes the tiles: bf16 query and cache read in place.
template <typename T, typename KV>
inline bool attention_amx_usable(int64_t hd) {
  return std::is_same<T, BF16>::value && std::is_same<typename KV::E, BF16>::value && KV::kInPlace &&
         hd % 32 == 0 && hd <= kAmxMaxHead && g_attention_amx && amx_permitted();
}

struct AmxChunk {
  alignas(64) uint32_t kt[kAmxMaxHead / 2 * kKeysPerChunk];  // K^T words [hd / 2][32]
  alignas(64) uint16_t v[kKeysPerChunk * kAmxMaxHead];       // V pairs [16][hd][2]
  alignas(64) uint16_t p[16 * kKeysPerChunk];                // P of 16 rows, bf16
  alignas(64) float o[16 * 64];                              // P.V of 16 rows x 64 dims

  // n keys (key c's K and V rows at kr[c], vr[c]) in tile layout, zeros past n.
  void pack(const uint16_t* const* kr, const uint16_t* const* vr, int64_t n, int64_t hd) {
    const int64_t words = hd / 2;
    static const uint16_t zeros[kAmxMaxHead] = {};
    for (int64_t c = 0; c < kKeysPerChunk; ++c) {
      const uint32_t* k = reinterpret_cast<const uint32_t*>(c < n ? kr[c] : zeros);
      for (int64_t w = 0; w < words; ++w) kt[w * kKeysPerChunk + c] = k[w];
    }
    for (int64_t pr = 0; pr < kKeysPerChunk / 2; ++pr) {
      const int64_t c0 = 2 * pr, c1 = 2 * pr + 1;
      const uint16_t* v0 = c0 < n ? vr[c0] : zeros;
      const uint16_t* v1 = c1 < n ? vr[c1] : zeros;
      uint16_t* dst = v + pr * hd * 2;
      for (int64_t d = 0; d < hd; ++d) {
        dst[2 * d] = v0[d];
        dst[2 * d + 1] = v1[d];
      }
    }
  }
};

// Scores of 16 rows (bf16 q rows hd apart, from qb) against the chunk: s rows kKeysPerChunk apart.
inline void amx_scores16(const uint16_t* qb, int64_t hd, const AmxChunk& ck, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < hd; k += 32) {
    _tile_loadd(4, qb + k, hd * 2);
    _tile_loadd(6, ck.kt + (k / 2) * kKeysPerChunk, kKeysPerChunk * 4);
    _tile_loadd(7, ck.kt + (k / 2) * kKeysPerChunk + 16, kKeysPerChunk * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, s, kKeysPerChunk * 4);
  _tile_stored(1, s + 16, kKeysPerChunk * 4);
}

// One row's online-softmax step over the chunk's 32 scores (sr, Q.K^T unscaled; only keys [lo, seen)
// weigh: lo > 0 under a sliding window, and every key past the chunk's is past `seen`): scaled, capped
// (softcap > 0), running max m and sum l updated, P rounded to bf16 into pb; returns the factor
// exp(old m - new m) the row's accumulator is to be scaled by. Two vectors and two reductions a row,
// where softmax_chunk (shared with the 8-wide builds) goes 8 lanes at a time and reduces in scalars.
inline float softmax_row32(const float* sr, int64_t lo, int64_t seen, float scale, float softcap, float& m, float& l,
                           uint16_t* pb) {
  static_assert(kKeysPerChunk == 32 && kVec == 16, "two AVX-512 vectors of scores");
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i iota16 = _mm512_add_epi32(iota, _mm512_set1_epi32(16));
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff()), sc = _mm512_set1_ps(scale);
  const __m512i lim = _mm512_set1_epi32(int(seen)), first = _mm512_set1_epi32(int(lo));
  __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(sr), sc), x1 = _mm512_mul_ps(_mm512_loadu_ps(sr + 16), sc);
  if (softcap > 0.0f) {  // cap * tanh(x / cap), as softcap_scores computes it
    const vgf k = broadcast_v(2.0f / softcap), cap = broadcast_v(softcap), two_cap = broadcast_v(2.0f * softcap);
    x0 = (__m512)(cap - two_cap / (exp_v((vgf)x0 * k) + 1.0f));
    x1 = (__m512)(cap - two_cap / (exp_v((vgf)x1 * k) + 1.0f));
  }
  x0 = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(iota, lim) | _mm512_cmplt_epi32_mask(iota, first), x0, ninf);
  x1 = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(iota16, lim) | _mm512_cmplt_epi32_mask(iota16, first), x1, ninf);
  const float cmax = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));  // finite: seen >= 1
  float f = 1.0f;
  if (cmax > m) {
    f = exp_f32(m - cmax);  // 0 on the first chunk (m = -inf)
    l *= f;
    m = cmax;
  }
  const vgf mv = broadcast_v(m);
  const vgf p0 = exp_v((vgf)x0 - mv), p1 = exp_v((vgf)x1 - mv);
  l += _mm512_reduce_add_ps((__m512)(p0 + p1));
  store_bf16_v(pb, p0);
  store_bf16_v(pb + 16, p1);
  return f;
}

// acc rows (hd apart) = acc x f[r] + P (ck.p, 16 rows) . V, for `rows` <= 16 of them, 64 dims a pass.
inline void amx_weighted16(int rows, float* acc, const float* f, int64_t hd, AmxChunk& ck) {
  _tile_loadd(4, ck.p, kKeysPerChunk * 2);
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    // C tiles 0..3: dims d0 + 16t .. +16 (tile numbers are immediates: hence the unrolled cases);
    // B tiles 5 / 6 in turn: the 16 key pairs' words for those dims.
    const int tiles = int(std::min<int64_t>(4, (hd - d0) / 16));
    const uint16_t* vb = ck.v + d0 * 2;
    _tile_zero(0);
    _tile_loadd(5, vb, hd * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_stored(0, ck.o, 64 * 4);
    if (tiles > 1) {
      _tile_zero(1);
      _tile_loadd(6, vb + 32, hd * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_stored(1, ck.o + 16, 64 * 4);
    }
    if (tiles > 2) {
      _tile_zero(2);
      _tile_loadd(5, vb + 64, hd * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_stored(2, ck.o + 32, 64 * 4);
    }
    if (tiles > 3) {
      _tile_zero(3);
      _tile_loadd(6, vb + 96, hd * 4);
      _tile_dpbf16ps(3, 4, 6);
      _tile_stored(3, ck.o + 48, 64 * 4);
    }
    for (int r = 0; r < rows; ++r) {
      float* a = acc + r * hd + d0;
      const float* o = ck.o + r * 64;
      const vgf fr = broadcast_v(f[r]);
      for (int64_t d = 0; d < 16 * tiles; d += kVec) store_v(a + d, load_v(a + d) * fr + load_v(o + d));
    }
  }
}

// attend_rows_tiled on tiles: rows [r0, r1) of an item (q rows in qb, bf16, unscaled; row r is
// token t0 + (r - r0) / group, which sees the chunk's keys [max(0, vis + t - window), min(n, vis + t)),
// from 0 without a window).
inline void attend_rows_amx(int64_t r0, int64_t r1, int64_t t0, int64_t group, int64_t vis, int64_t window,
                            float softcap, const uint16_t* qb, float scale, float* s, float* acc, float* m, float* l,
                            AmxChunk& ck, int64_t n, int64_t hd) {
  for (int64_t r = r0; r < r1; r += 16) {
    const int rows = int(std::min<int64_t>(16, r1 - r));
    amx_scores16(qb + r * hd, hd, ck, s + r * kKeysPerChunk);
    float f[16];
    for (int j = 0; j < rows; ++j) {
      const int64_t own = vis + t0 + (r + j - r0) / group, lo = window > 0 ? std::max<int64_t>(0, own - window) : 0;
      f[j] = softmax_row32(s + (r + j) * kKeysPerChunk, lo, std::min<int64_t>(n, own), scale, softcap, m[r + j],
                           l[r + j], ck.p + j * kKeysPerChunk);
    }
    for (int j = rows; j < 16; ++j) std::memset(ck.p + j * kKeysPerChunk, 0, kKeysPerChunk * 2);
    amx_weighted16(rows, acc + r * hd, f, hd, ck);
  }
}

// An item's keys [start, pos0 + ntok) in chunks of 32 across blocks (the FMA path's chunks stop at a
// block's end: 16 keys with 16-token blocks, half a tile), every kv head of the item, each chunk
// packed once for all of the head's rows. start: its first token's first key (0 without a window:
// nothing below it is read). Rows: as attend_item's (q rows in qb).
template <typename E, typename It>
void attend_chunks_amx(const It& it, int64_t start, int64_t window, float softcap, const E* key_cache,
                       const E* value_cache, const int32_t* table, int64_t tok_stride, int64_t block_size,
                       int64_t group, int64_t hd, float scale, const uint16_t* qb, float* s, float* acc, float* m,
                       float* l, AmxChunk& ck) {
  const int64_t end = it.pos0 + it.ntok, head_rows = it.ntok * group;
  const uint16_t* kr[kKeysPerChunk];
  const uint16_t* vr[kKeysPerChunk];
  for (int64_t p0 = start; p0 < end; p0 += kKeysPerChunk) {
    const int64_t n = std::min<int64_t>(kKeysPerChunk, end - p0);
    // Rows [t_vis, t_end) of each head see at least one of the chunk's keys (token t: from
    // max(0, vis + t - window) to min(n, vis + t)); later tokens' windows have left the chunk.
    const int64_t vis = it.pos0 + 1 - p0, t_vis = std::max<int64_t>(0, 1 - vis);
    const int64_t t_end = window > 0 ? std::min<int64_t>(it.ntok, n + window - vis) : it.ntok;
    for (int64_t h = it.kv0; h < it.kv1; ++h) {
      for (int64_t c = 0; c < n; ++c) {
        const int64_t pos = p0 + c, slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
        kr[c] = reinterpret_cast<const uint16_t*>(key_cache + slot * tok_stride + h * hd);
        vr[c] = reinterpret_cast<const uint16_t*>(value_cache + slot * tok_stride + h * hd);
      }
      ck.pack(kr, vr, n, hd);
      const int64_t r0 = (h - it.kv0) * head_rows;
      attend_rows_amx(r0 + t_vis * group, r0 + t_end * group, t_vis, group, vis, window, softcap, qb, scale, s, acc,
                      m, l, ck, n, hd);
    }
  }
}

}  // namespace
#endif
