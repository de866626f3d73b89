// The decode helpers of kernels/cpu/paged_attention_cpu.cpp: one chunk of keys for up to
// kMaxGroupRows query rows that see the same keys (scores, online softmax, weighted sum of V),
// read in place (fp32, bf16) or from widened rows. Decode runs on them, and so does a prefill
// token that sees a chunk alone; the tiled prefill (attention_prefill.h) reuses their weighted
// sums and softmax step.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_elements.h"  // BF16
#include "simd.h"                // vgf: kVec floats (16 with AVX-512, else 8), on top of vec8.h

namespace {

constexpr int kKeysPerChunk = 32;  // keys scored before one softmax update (scores stay in L1)
constexpr int kMaxGroupRows = 4;   // query rows that share each K/V row loaded (one call of the R-row helpers)

typedef float v4f __attribute__((vector_size(16)));
typedef float v4fu __attribute__((vector_size(16), aligned(4), may_alias));
inline void store4(float* p, v4f x) { *reinterpret_cast<v4fu*>(p) = x; }

// Lane i of the result = sum of the 8 lanes of a[i] (a fixed order: results are deterministic).
inline v8f horizontal_sums8(const v8f* a) {
  return pair_sums(pair_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3])),
                   pair_sums(pair_sums(a[4], a[5]), pair_sums(a[6], a[7])));
}

// The dot products and weighted sums below are written once for a vector of W floats: W = 8 (one
// AVX register) always works; W = kVec (16 under AVX-512, kernels/cpu/simd.h) is used when a head is
// a whole number of such vectors.
template <int W> struct Vec;
template <> struct Vec<8> {
  using T = v8f;
  static T load(const float* p) { return load8(p); }
  static T load(const BF16* p) {  // 8 bf16 widened in registers (exact: the top half of an fp32)
    typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2), may_alias));
    return (v8f)(__builtin_convertvector(*reinterpret_cast<const v8u16*>(p), v8i) << 16);
  }
  static void store(float* p, T x) { store8(p, x); }
  static T splat(float x) { return broadcast8(x); }
  static v8f fold8(T a) { return a; }
};
#if defined(__AVX512F__) && !defined(PR_GEMM_VEC8)
template <> struct Vec<16> {
  using T = vgf;
  static T load(const float* p) { return load_v(p); }
  static T load(const BF16* p) { return load_bf16_v(reinterpret_cast<const uint16_t*>(p)); }
  static void store(float* p, T x) { store_v(p, x); }
  static T splat(float x) { return broadcast_v(x); }
  // Its two halves added: lane i then sums the dimensions i mod 8, in another association than an
  // 8-wide build (equal within rounding, and fixed, so results stay deterministic).
  static v8f fold8(T a) {
    return (v8f)_mm256_add_ps(_mm512_castps512_ps256((__m512)a), _mm512_extractf32x8_ps((__m512)a, 1));
  }
};
#endif

// Whether a head of hd floats is a whole number of kVec vectors (the wide instantiations need it).
inline bool wide(int64_t hd) { return kVec > 8 && hd % kVec == 0; }

// The next chunk's K and V rows, asked for one cache line of each at a time from inside the loops
// below, so the requests stay spread over the chunk's arithmetic: issued in bursts (a head's share
// of the chunk at once, as before) they filled the core's line-fill buffers, and the arithmetic
// waited behind them: memory and arithmetic did not overlap at all
// (docs/log/2026-11-25-amx-gemm-prefetch.md).
// Into L2 (prefetcht1), not L1: a chunk's K and V (24-48 KiB) and the next one's do not fit a 32 KiB
// L1 together. The last chunk of an item asks for the first chunk of the thread's next item. Both
// shortened cold decode on a Zen 4 (docs/log/2026-11-27-decode-prefetch-prefill-chunks.md).
struct Prefetcher {
  const char *k = nullptr, *v = nullptr;  // the current row's slice, in K and in V
  int64_t stride = 0, bytes = 0, rows = 0, off = 0;
  int per_step = 1;  // lines of K (and of V) per step: the chunk's lines over the steps its loops take
  inline void line() {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(v + off, 0, 2);
    if ((off += 64) >= bytes) {
      off = 0;
      k += stride;
      v += stride;
      --rows;
    }
  }
  inline void step() {
    for (int i = 0; i < per_step && rows > 0; ++i) line();
  }
  void drain() {  // what the loops did not ask for
    while (rows > 0) line();
  }
};
inline void pf_step(Prefetcher* pf) {
  if (pf) pf->step();
}

// s[c] = q . k_c for the keys of whole groups of 8, from c; returns where it stopped. Eight
// independent FMA chains instead of one latency-bound chain per dot.
template <int W, typename E>
inline int64_t score_keys_by8(const float* __restrict q, const E* __restrict k, int64_t kstride, int64_t c,
                              int64_t n, int64_t hd, float* __restrict s, Prefetcher* pf = nullptr) {
  using V = Vec<W>;
  for (; c + 8 <= n; c += 8) {
    pf_step(pf);
    pf_step(pf);
    typename V::T a[8] = {};
    const E* kc = k + c * kstride;
    for (int64_t d = 0; d < hd; d += W) {
      const typename V::T qv = V::load(q + d);
      for (int j = 0; j < 8; ++j) a[j] += qv * V::load(kc + j * kstride + d);
    }
    v8f f[8];
    for (int j = 0; j < 8; ++j) f[j] = V::fold8(a[j]);
    store8(s + c, horizontal_sums8(f));
  }
  return c;
}

// s[c] = q . k_c for keys c < n (rows kstride elements apart), head_size hd (a multiple of 8).
// E: float, or BF16 read in place and widened in registers.
template <typename E>
inline void score_keys(const float* __restrict q, const E* __restrict k, int64_t kstride, int64_t n,
                       int64_t hd, float* __restrict s, Prefetcher* pf = nullptr) {
  int64_t c = wide(hd) ? score_keys_by8<kVec>(q, k, kstride, 0, n, hd, s, pf)
                        : score_keys_by8<8>(q, k, kstride, 0, n, hd, s, pf);
  for (; c < n; ++c) {
    v8f a0 = {}, a1 = {};
    const E* kc = k + c * kstride;
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) {
      a0 += load8(q + d) * Vec<8>::load(kc + d);
      a1 += load8(q + d + 8) * Vec<8>::load(kc + d + 8);
    }
    if (d < hd) a0 += load8(q + d) * Vec<8>::load(kc + d);
    s[c] = horizontal_sum(a0 + a1);
  }
}

// acc[0:W*NV] += sum_c p[c] * v_c[0:W*NV], the accumulators held in registers across the keys. Each
// lane sums over the keys in order, so every W gives the same results.
template <int W, int NV, typename E>
inline void weighted_sum_block(float* __restrict acc, const float* __restrict p, const E* __restrict v,
                               int64_t vstride, int64_t n, Prefetcher* pf) {
  using V = Vec<W>;
  typename V::T a[NV];
  for (int i = 0; i < NV; ++i) a[i] = V::load(acc + W * i);
  for (int64_t c = 0; c < n; ++c) {
    pf_step(pf);
    const typename V::T w = V::splat(p[c]);
    const E* vc = v + c * vstride;
    for (int i = 0; i < NV; ++i) a[i] += w * V::load(vc + W * i);
  }
  for (int i = 0; i < NV; ++i) V::store(acc + W * i, a[i]);
}

// R rows (heads of one GQA group, acc and p rows astride / pstride floats apart) against the same V
// rows: each V row loaded (and widened) once for all R.
template <int W, int NV, int R, typename E>
inline void weighted_sumR_block(float* __restrict acc, int64_t astride, const float* __restrict p, int64_t pstride,
                                const E* __restrict v, int64_t vstride, int64_t n, Prefetcher* pf) {
  using V = Vec<W>;
  typename V::T a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = V::load(acc + r * astride + W * i);
  for (int64_t c = 0; c < n; ++c) {
    pf_step(pf);
    typename V::T w[R];
    for (int r = 0; r < R; ++r) w[r] = V::splat(p[r * pstride + c]);
    const E* vc = v + c * vstride;
    for (int i = 0; i < NV; ++i) {
      const typename V::T vv = V::load(vc + W * i);
      for (int r = 0; r < R; ++r) a[r][i] += w[r] * vv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) V::store(acc + r * astride + W * i, a[r][i]);
}

// hd in passes of at most MaxNV vectors of W floats, so a pass's accumulators stay in registers.
template <int W, int MaxNV, typename F>
inline void by_vectors(int64_t hd, F&& pass) {
  int64_t d = 0;
  for (; d + MaxNV * W <= hd; d += MaxNV * W) pass(d, std::integral_constant<int, MaxNV>{});
  switch ((hd - d) / W) {
    case 7: if constexpr (MaxNV > 7) pass(d, std::integral_constant<int, 7>{}); break;
    case 6: if constexpr (MaxNV > 6) pass(d, std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (MaxNV > 5) pass(d, std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (MaxNV > 4) pass(d, std::integral_constant<int, 4>{}); break;
    case 3: pass(d, std::integral_constant<int, 3>{}); break;
    case 2: pass(d, std::integral_constant<int, 2>{}); break;
    case 1: pass(d, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <int W, typename E>
inline void weighted_sum_w(float* acc, const float* p, const E* v, int64_t vstride, int64_t n, int64_t hd,
                           Prefetcher* pf) {
  by_vectors<W, 8>(hd, [&](int64_t d, auto nv) {
    weighted_sum_block<W, decltype(nv)::value>(acc + d, p, v + d, vstride, n, pf);
  });
}

template <typename E>
inline void weighted_sum(float* acc, const float* p, const E* v, int64_t vstride, int64_t n, int64_t hd,
                         Prefetcher* pf = nullptr) {
  if (wide(hd)) return weighted_sum_w<kVec>(acc, p, v, vstride, n, hd, pf);
  weighted_sum_w<8>(acc, p, v, vstride, n, hd, pf);
}

// R query rows (heads of one GQA group, q and s rows qstride / sstride floats apart) against the
// same keys, whole groups of 4 keys from c: each K row loaded (and widened) serves all R, four keys
// x R rows = 4R FMA chains. Each (row, key) sum is what score_keys_by8 computes for it: the lanes
// of one vector folded and summed in horizontal_sums8's fixed order, whichever vectors sit beside
// it. Returns where it stopped.
template <int W, int R, typename E>
inline int64_t score_keysR_by4(const float* __restrict q, int64_t qstride, const E* __restrict k, int64_t kstride,
                               int64_t c, int64_t n, int64_t hd, float* __restrict s, int64_t sstride,
                               Prefetcher* pf) {
  using V = Vec<W>;
  constexpr int kSums = (4 * R + 7) / 8 * 8;  // a whole number of horizontal_sums8 calls
  for (; c + 4 <= n; c += 4) {
    pf_step(pf);
    typename V::T a[kSums] = {};
    const E* kc = k + c * kstride;
    for (int64_t d = 0; d < hd; d += W) {
      typename V::T qv[R];
      for (int r = 0; r < R; ++r) qv[r] = V::load(q + r * qstride + d);
      for (int j = 0; j < 4; ++j) {
        const typename V::T kv = V::load(kc + j * kstride + d);
        for (int r = 0; r < R; ++r) a[4 * r + j] += qv[r] * kv;
      }
    }
    for (int g = 0; g < kSums; g += 8) {
      v8f f[8];
      for (int j = 0; j < 8; ++j) f[j] = V::fold8(a[g + j]);
      const v8f sums = horizontal_sums8(f);
      // Lanes 0-3 are row g / 4's four keys, lanes 4-7 the next row's: two 4-float stores (a store
      // per lane took an extract each, as many shuffles as the sums themselves).
      store4(s + (g / 4) * sstride + c, __builtin_shufflevector(sums, sums, 0, 1, 2, 3));
      if (g + 4 < 4 * R) store4(s + (g / 4 + 1) * sstride + c, __builtin_shufflevector(sums, sums, 4, 5, 6, 7));
    }
  }
  return c;
}

template <int R, typename E>
inline void score_keysR(const float* __restrict q, int64_t qstride, const E* __restrict k, int64_t kstride,
                        int64_t n, int64_t hd, float* __restrict s, int64_t sstride, Prefetcher* pf) {
  const int64_t c = wide(hd) ? score_keysR_by4<kVec, R>(q, qstride, k, kstride, 0, n, hd, s, sstride, pf)
                             : score_keysR_by4<8, R>(q, qstride, k, kstride, 0, n, hd, s, sstride, pf);
  if (c < n)
    for (int r = 0; r < R; ++r) score_keys(q + r * qstride, k + c * kstride, kstride, n - c, hd, s + r * sstride + c);
}

// The R rows' accumulators += their weights times the same V rows, in passes that keep R x NV
// accumulators in registers: 16 of AVX-512's 32, 8 of AVX2's 16.
template <int R, typename E>
inline void weighted_sumR(float* acc, int64_t astride, const float* p, int64_t pstride, const E* v, int64_t vstride,
                          int64_t n, int64_t hd, Prefetcher* pf) {
  if (wide(hd)) {
    by_vectors<kVec, 16 / R>(hd, [&](int64_t d, auto nv) {
      weighted_sumR_block<kVec, decltype(nv)::value, R>(acc + d, astride, p, pstride, v + d, vstride, n, pf);
    });
    return;
  }
  by_vectors<8, 8 / R>(hd, [&](int64_t d, auto nv) {
    weighted_sumR_block<8, decltype(nv)::value, R>(acc + d, astride, p, pstride, v + d, vstride, n, pf);
  });
}

// Online-softmax step for one row over its scores s[0:n] of a chunk: raise the running max m (and
// rescale the row's sum l and accumulator by exp(old - new)), then p = exp(s - m), l += sum(p).
// The max and the sum go 8 lanes at a time (then the lanes in a fixed order): as one scalar chain
// each, their add/compare latency cost more than the chunk's dot products.
inline void softmax_chunk(const float* __restrict s, int64_t n, int64_t hd, float& m, float& l,
                          float* __restrict acc, float* __restrict p) {
  float cmax = s[0];
  int64_t c = 1;
  if (n >= 8) {
    v8f mv = load8(s);
    for (c = 8; c + 8 <= n; c += 8) {
      const v8f x = load8(s + c);
      mv = x > mv ? x : mv;
    }
    cmax = mv[0];
    for (int j = 1; j < 8; ++j) cmax = mv[j] > cmax ? mv[j] : cmax;
  }
  for (; c < n; ++c) cmax = s[c] > cmax ? s[c] : cmax;
  if (cmax > m) {
    const float f = exp_f32(m - cmax);  // 0 on the first chunk (m = -inf)
    l *= f;
    for (int64_t d = 0; d < hd; ++d) acc[d] *= f;
    m = cmax;
  }
  const float mr = m;
  for (c = 0; c + kVec <= n; c += kVec) store_v(p + c, exp_v(load_v(s + c) - mr));
  for (; c < n; ++c) p[c] = exp_f32(s[c] - mr);
  v8f sum8 = {};
  for (c = 0; c + 8 <= n; c += 8) sum8 += load8(p + c);
  float sum = horizontal_sum(sum8);
  for (; c < n; ++c) sum += p[c];
  l += sum;
}

// Logit soft-capping (Gemma 2) of a row's n scores: s = cap * tanh(s / cap), as cap - 2 cap / (exp(2 s / cap)
// + 1): exp's inf above 88.7 gives cap, its 0 below -87.3 gives -cap, so no score escapes the cap.
inline void softcap_scores(float* __restrict s, int64_t n, float cap) {
  const float k = 2.0f / cap, two_cap = 2.0f * cap;
  int64_t c = 0;
  for (; c + kVec <= n; c += kVec) store_v(s + c, cap - two_cap / (exp_v(load_v(s + c) * k) + 1.0f));
  for (; c < n; ++c) s[c] = cap - two_cap / (exp_f32(s[c] * k) + 1.0f);
}

// One chunk of nr keys for `rows` query rows that see the same keys (heads of one GQA group, one
// token; rows <= kMaxGroupRows), row j's query, scores, accumulator and running max / sum at
// q + j * hd, s + j * kKeysPerChunk, acc + j * hd, m[j], l[j]: scores, online-softmax update, and
// the weighted sum of V, each K and V row loaded once for all the rows. Cap: the scores capped when
// softcap > 0 (false: no test for it).
template <int R, bool Cap, typename E>
inline void attend_rows_r(const float* q, float* s, float* acc, float* m, float* l, float* p, const E* kp,
                          const E* vp, int64_t kstride, int64_t nr, int64_t hd, float softcap, Prefetcher* pf) {
  score_keysR<R>(q, hd, kp, kstride, nr, hd, s, kKeysPerChunk, pf);
  if constexpr (Cap)
    if (softcap > 0.0f)
      for (int j = 0; j < R; ++j) softcap_scores(s + j * kKeysPerChunk, nr, softcap);
  for (int j = 0; j < R; ++j)
    softmax_chunk(s + j * kKeysPerChunk, nr, hd, m[j], l[j], acc + j * hd, p + j * kKeysPerChunk);
  weighted_sumR<R>(acc, hd, p, kKeysPerChunk, vp, kstride, nr, hd, pf);
}

// Not inlined: a call per chunk costs nothing beside the chunk, and the function stays one block of code
// whatever its callers around it (inlined, g++ laid the f32 decode loop out measurably slower). Aligned
// to a cache line: its loops then sit where they sit whatever code precedes them in the file (the sinks'
// few lines elsewhere moved bf16's copy to 16 mod 64 and decode ran 2-3% slower:
// docs/log/2026-11-28-attention-sinks.md).
template <bool Cap, typename E>
__attribute__((noinline, aligned(64))) void attend_rows(int rows, const float* q, float* s, float* acc, float* m,
                                                        float* l, float* p, const E* kp, const E* vp,
                                                        int64_t kstride, int64_t nr, int64_t hd, float softcap,
                                                        Prefetcher* pf) {
  switch (rows) {
    case 4: return attend_rows_r<4, Cap>(q, s, acc, m, l, p, kp, vp, kstride, nr, hd, softcap, pf);
    case 3: return attend_rows_r<3, Cap>(q, s, acc, m, l, p, kp, vp, kstride, nr, hd, softcap, pf);
    case 2: return attend_rows_r<2, Cap>(q, s, acc, m, l, p, kp, vp, kstride, nr, hd, softcap, pf);
    default:  // a lone row: score_keys' groups of 8 keys keep more FMA chains than 4 x 1
      score_keys(q, kp, kstride, nr, hd, s, pf);
      if constexpr (Cap)
        if (softcap > 0.0f) softcap_scores(s, nr, softcap);
      softmax_chunk(s, nr, hd, m[0], l[0], acc, p);
      weighted_sum(acc, p, vp, kstride, nr, hd, pf);
  }
}

}  // namespace
