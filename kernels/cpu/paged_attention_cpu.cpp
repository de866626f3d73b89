// Paged attention on the CPU, read in place through the block tables (issue 8).
//
// Built on first use by pagedrun/attention/cpu_kernels.py (g++ -O3 -fopenmp -shared -fPIC, plus
// -mavx2 -mfma -mf16c and -mavx512* when the build machine has them; the dot products and weighted
// sums then run 16 floats wide when the head size is a multiple of 16) and called through ctypes
// with raw data pointers, so no torch headers: it compiles in about a second.
//
//   query / out   [num_tokens, num_heads, head_size]      (token stride q_stride / o_stride)
//   key_cache     [num_blocks, block_size, num_kv_heads, head_size]   (contiguous)
//   value_cache   [num_blocks, block_size, num_kv_heads, head_size]
//   block_tables  [num_seqs, table_stride] int32; query_start_loc [num_seqs + 1], seq_lens,
//   context_lens  [num_seqs] int32 (pagedrun/attention/metadata.py)
//
// One pass per work item with an online softmax (running max and sum, fp32 accumulation). A work
// item is (a tile of one sequence's query tokens) x (one kv head): every query head of the kv
// head's GQA group and every token of the tile share each K/V row loaded, and K/V are never copied
// (bf16/fp16 rows are widened to fp32 one chunk at a time). Row r of a tile (query j of its
// sequence) only ever touches cache positions < context_len + j + 1, so a slot that was never
// written (NaN in the tests, stale data in the engine) is never read, and padding tokens
// (past query_start_loc[num_seqs]) get zero rows.
//
// Sliding window (window > 0): a query at position p sees the keys (p - window, p]. An item starts
// its chunks at its first token's first key, max(0, pos0 - window + 1), so no table entry below
// it is read (the hybrid KV manager leaves placeholders there: anything, NaN included); a token whose
// window starts inside a chunk takes the chunk from there (read alone: its rows start at that key;
// tiled: the scores before it become -inf, over real rows), and one whose window has left the chunk
// skips it. No per-key test anywhere; and a call without window and softcap runs a copy of the item
// loop (Variant = false) in which both are the constant 0, the full-attention code. Soft-capping
// (softcap > 0): every score becomes softcap * tanh(score / softcap) before the online softmax
// (softcap_scores, or softmax_row32 on AMX).
//
// Attention sinks (GPT-OSS; sinks non-null, float32 [num_heads]): head h's sink is one more logit with
// a zero value vector. It joins the denominator once, before a row's output is normalised: with the
// row's final running max m and sum l, l += e^(sink - m) (add_sinks), so out = acc / (l + e^(sink - m)),
// the softmax over the keys and the sink together (HF's eager attention concatenates the sink to the
// scores). Nothing in the chunk loops changes, so every path (decode, read alone, tiled, AMX) takes
// it from the same few lines; a call with sinks runs the Variant copy of the item loop (below), so the
// one without window, softcap and sinks is the code without them.
//
// Return value: 0 on success, negative when an argument is out of range (the caller falls back to
// torch or raises); nothing is written in that case.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// Each header includes what it uses (tests/build/test_kernel_headers.py compiles each alone); they are
// listed in the order their definitions had when they were all in this file: in another order g++
// lays out stack slots and pooled constants differently (the same instructions at other offsets).
#include "amx_tiles.h"             // amx_configure, amx_switch (empty without AMX)
#include "simd.h"                  // vgf: kVec floats (16 with AVX-512, else 8), on top of vec8.h
#include "attention_elements.h"    // BF16, F16 (PR_HAVE_F16), to_f32, from_f32
#include "attention_kv_readers.h"  // PlainKv, Fp8Kv, Int8Kv: how cache rows are widened
#include "attention_decode.h"      // attend_rows: a chunk of keys for a few rows, on FMAs
#include "attention_prefill.h"     // attend_rows_tiled: many tokens against the same keys, on FMAs
#include "attention_amx.h"         // PR_ATTENTION_AMX: the tiled prefill on AMX tiles (bf16)

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kRowsPerTile = 192;  // query rows (tokens x group heads) per prefill work item

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct Shape {
  int64_t num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride;
  int64_t q_stride, o_stride;  // elements between consecutive tokens of query / out
  float scale;
  int64_t window;  // keys a query sees, itself included (0: all before it)
  float softcap;   // scores capped at softcap * tanh(score / softcap) (0: not capped)
  const float* sinks;  // [num_heads] attention sink logits (nullptr: none)
};

// The first key position a query at `pos` sees.
inline int64_t first_key(int64_t pos, int64_t window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

// One unit of work: tokens [tok0, tok0 + ntok) of a sequence whose first of them sits at
// absolute position pos0 (= context_len + j0), for kv heads [kv0, kv1). A decode item takes every kv
// head of its sequence, so each chunk of keys is read as whole cache rows, one contiguous run of
// memory per block, instead of one head's 256-byte slices 1 KB apart (the hardware prefetcher
// follows the former: docs/log/2026-11-21-decode-attention-by-sequence-huge-pages.md,
// docs/log/2026-11-27-figures-from-code-comments.md); prefill items take one head each,
// which bounds their rows (tokens x group) and spreads long prompts over the threads.
struct Item {
  int64_t seq, tok0, ntok, pos0, kv0, kv1;
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, acc, m, l, s, p, k, v, kt;
#ifdef PR_ATTENTION_AMX
  std::vector<uint16_t> qb;           // q rows in bf16, unscaled, + 16 zero rows (a tile reads 16)
  std::unique_ptr<AmxChunk> chunk;
#endif
  void reserve(int64_t rows, int64_t hd) {
    q.resize(rows * hd);
    acc.resize(rows * hd);
    m.resize(rows);
    l.resize(rows);
    s.resize((rows + 16) * kKeysPerChunk);
    p.resize(std::max(kMaxGroupRows, kQkAcc) * kKeysPerChunk);
    k.resize(kKeysPerChunk * hd);
    v.resize(kKeysPerChunk * hd);
    kt.resize(kKeysPerChunk * hd);
  }
};

// Attention sinks: each of the item's rows (as attend_item numbers them) adds its head's sink to its
// final softmax sum, l += exp(sink - m): the sink's term against the row's running max. A sink more
// than 88.7 above it saturates exp_f32 (no inf: l stays finite and the row's output all but 0, as it
// is in exact arithmetic); -inf adds exp(-87.3), about 1e-38. Rows with no key (l = 0) stay 0. Called
// from the Variant copy of the item loop only, and out of line: the full-attention copy is the code
// without sinks (with a test for them, bf16 decode ran 2% slower: docs/log/2026-11-28-attention-sinks.md).
__attribute__((noinline)) void add_sinks(const Item& it, const Shape& sh, const float* m, float* l) {
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  for (int64_t h = it.kv0; h < it.kv1; ++h)
    for (int64_t t = 0; t < it.ntok; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = ((h - it.kv0) * it.ntok + t) * group + g;
        if (l[r] > 0.0f) l[r] += exp_f32(sh.sinks[h * group + g] - m[r]);
      }
}

// Rows of an item: r = ((h - kv0) * ntok + t) * group + g is token tok0 + t, query head h * group + g.
// tiles: this thread's AMX tiles are configured (run_items), and a prefill item runs on them.
// Variant: the layer has a window, a softcap or sinks (sh.window, sh.softcap, sh.sinks); false ignores
// them. Inlined into run_items' loop, as g++ did by itself before there were two copies (out of line, f32 decode was slower).
template <typename T, typename KV, bool Variant>
__attribute__((always_inline)) inline void attend_item(
    const Item& it, T* out, const T* query, const typename KV::E* key_cache, const typename KV::E* value_cache,
    const int32_t* block_tables, const Shape& sh, Scratch& sc, const KV& kr, const KV& vr, bool tiles,
    const Item* next_item) {
  using E = typename KV::E;
  const int64_t hd = sh.head_size, group = sh.num_heads / sh.num_kv_heads;
  const int64_t head_rows = it.ntok * group;  // rows per kv head
  const int64_t rows = (it.kv1 - it.kv0) * head_rows;
  const int64_t tok_stride = sh.num_kv_heads * hd;  // between consecutive cache slots
  const int32_t* table = block_tables + it.seq * sh.table_stride;
  float* __restrict qf = sc.q.data();
  float* __restrict acc = sc.acc.data();
  float* __restrict m = sc.m.data();
  float* __restrict l = sc.l.data();
  float* __restrict s = sc.s.data();
  float* __restrict p = sc.p.data();

  // The item's q rows: bf16 as they are for the tiles (which scale the scores), else fp32 with the
  // scale folded in.
  const bool amx = tiles && it.ntok >= 2;
  if (amx) {
#ifdef PR_ATTENTION_AMX
    if (!sc.chunk) sc.chunk.reset(new AmxChunk);
    sc.qb.assign((rows + 16) * hd, 0);
    for (int64_t h = it.kv0; h < it.kv1; ++h)
      for (int64_t t = 0; t < it.ntok; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = query + (it.tok0 + t) * sh.q_stride + (h * group + g) * hd;
          std::memcpy(sc.qb.data() + (((h - it.kv0) * it.ntok + t) * group + g) * hd, src, hd * 2);
        }
#endif
  } else {
    for (int64_t h = it.kv0; h < it.kv1; ++h)
      for (int64_t t = 0; t < it.ntok; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = query + (it.tok0 + t) * sh.q_stride + (h * group + g) * hd;
          float* dst = qf + (((h - it.kv0) * it.ntok + t) * group + g) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = to_f32(src[d]) * sh.scale;
        }
  }
  std::fill(acc, acc + rows * hd, 0.0f);
  std::fill(m, m + rows, -__builtin_inff());
  std::fill(l, l + rows, 0.0f);

  const int64_t end = it.pos0 + it.ntok;  // keys [start, end) are visible to some token of the tile
  // Without the variant (Variant false) window and softcap are the constant 0: every bound below folds
  // to the full-attention one when compiling, and that instantiation is the code without them.
  const int64_t window = Variant ? sh.window : 0;
  const float softcap = Variant ? sh.softcap : 0.0f;
  const int64_t start = first_key(it.pos0, window);
  if (amx) {
#ifdef PR_ATTENTION_AMX
    attend_chunks_amx(it, start, window, softcap, key_cache, value_cache, table, tok_stride, sh.block_size, group,
                      hd, sh.scale, sc.qb.data(), s, acc, m, l, *sc.chunk);
#endif
  } else {
    for (int64_t p0 = start; p0 < end;) {
      const int64_t blk = p0 / sh.block_size, off = p0 % sh.block_size;
      // Tokens [t_vis, t_end) see at least one key of the chunk (token t: keys [max(0, vis + t - window),
      // min(n, vis + t)), from 0 without a window; the later ones' windows have left it): together
      // (attend_rows_tiled) when there are two or more, else one at a time. Tiled rows read
      // the chunk through fp32 copies (kt, vf), so their chunks may span blocks: at block size 16,
      // 32 keys halve the softmax updates per key, which shortens long prompts' prefill
      // (docs/log/2026-11-27-decode-prefetch-prefill-chunks.md); rows read in place keep to one block.
      const int64_t vis = it.pos0 + 1 - p0, t_vis = std::max<int64_t>(0, -vis + 1);
      const int64_t n_tiled = std::min<int64_t>(kKeysPerChunk, end - p0);
      auto t_end = [&](int64_t nk) { return window > 0 ? std::min<int64_t>(it.ntok, nk + window - vis) : it.ntok; };
      const bool tiled = t_end(n_tiled) - t_vis >= 2;
      const int64_t n = tiled ? n_tiled : std::min<int64_t>(n_tiled, sh.block_size - off);
      const int64_t row0 = ((int64_t)table[blk] * sh.block_size + off) * tok_stride;
      // The next chunk's rows sit in another block (somewhere else in memory): ask for them while
      // this one computes, a line at a time from inside its loops (Prefetcher above); what they did
      // not reach is asked for at the chunk's end. After the item's last chunk comes the first of the
      // thread's next item (its heads' slice of the rows; the cost above for the steps is this one's).
      Prefetcher pf;
      const bool last_chunk = p0 + n >= end;
      const Item* pit = last_chunk ? next_item : &it;
      if (pit) {
        const int64_t q0 = last_chunk ? first_key(pit->pos0, window) : p0 + n;
        const int64_t nb = q0 / sh.block_size, noff = q0 % sh.block_size;
        const int32_t* ptable = block_tables + pit->seq * sh.table_stride;
        const int64_t nrow0 = ((int64_t)ptable[nb] * sh.block_size + noff) * tok_stride + pit->kv0 * hd;
        pf.k = reinterpret_cast<const char*>(key_cache + nrow0);
        pf.v = reinterpret_cast<const char*>(value_cache + nrow0);
        pf.stride = tok_stride * (int64_t)sizeof(E);
        pf.bytes = (pit->kv1 - pit->kv0) * hd * (int64_t)sizeof(E);
        pf.rows = std::min<int64_t>({kKeysPerChunk, sh.block_size - noff, pit->pos0 + pit->ntok - q0});
        // Steps the loops below will take for this chunk: per kv head and pass of up to kMaxGroupRows
        // rows, one per 4 keys scored and one per key summed (a little less for a lone row).
        const int64_t passes = (it.kv1 - it.kv0) * it.ntok * ((group + kMaxGroupRows - 1) / kMaxGroupRows);
        const int64_t steps = passes * (n / 4 + n), lines = pf.rows * ((pf.bytes + 63) / 64);
        pf.per_step = int(steps > 0 ? (lines + steps - 1) / steps : 1);
      }
      for (int64_t h = it.kv0; h < it.kv1; ++h) {
        if (tiled) {
          // kt = K^T and vf = V in fp32, a row at a time from wherever its block is
          float* kt = sc.kt.data();
          float* vf = sc.v.data();
          const int nv = qk_vectors(n);
          int64_t slots[kKeysPerChunk];
          for (int64_t c = 0; c < n; ++c) {
            const int64_t q = p0 + c;
            slots[c] = (int64_t)table[q / sh.block_size] * sh.block_size + q % sh.block_size;
          }
          if constexpr (KV::kInPlace) {
            for (int64_t c = 0; c < n; ++c) {
              const E* krow = key_cache + slots[c] * tok_stride + h * hd;
              for (int64_t d = 0; d < hd; ++d) kt[d * kKeysPerChunk + c] = to_f32(krow[d]);
            }
            for (int64_t c = 0; c < n; ++c) {
              const E* vrow = value_cache + slots[c] * tok_stride + h * hd;
              for (int64_t d = 0; d < hd; ++d) vf[c * hd + d] = to_f32(vrow[d]);
            }
          } else {
            float* kw = sc.k.data();  // one widened K row at a time, then into kt
            for (int64_t c = 0; c < n; ++c) {
              kr.widen(key_cache + slots[c] * tok_stride + h * hd, kw, hd, slots[c], h);
              for (int64_t d = 0; d < hd; ++d) kt[d * kKeysPerChunk + c] = kw[d];
              vr.widen(value_cache + slots[c] * tok_stride + h * hd, vf + c * hd, hd, slots[c], h);
            }
          }
          for (int64_t d = 0; d < hd; ++d)
            for (int64_t c = n; c < nv * kVec; ++c) kt[d * kKeysPerChunk + c] = 0.0f;
          const int64_t r0 = (h - it.kv0) * head_rows;
          attend_rows_tiled<Variant>(r0 + t_vis * group, r0 + t_end(n) * group, t_vis, group, vis, window, softcap, qf,
                                     s, acc, m, l, p, kt, vf, n, nv, hd, &pf);
          continue;
        }
        // One token at a time over the chunk's K and V rows, kstride elements apart: in place (float
        // or bf16), or widened into scratch. Token t takes the chunk's keys [c0, nr).
        const int64_t base = row0 + h * hd;
        auto attend_alone = [&](const auto* kp, const auto* vp, int64_t kstride) {
          for (int64_t t = 0; t < it.ntok; ++t) {
            const int64_t nr = std::min<int64_t>(n, vis + t);
            const int64_t c0 = window > 0 ? std::max<int64_t>(0, vis + t - window) : 0;
            if (nr <= c0) continue;
            int64_t r = (h - it.kv0) * head_rows + t * group;
            // The group's rows up to kMaxGroupRows at a time (GQA 3:1 in one pass, 8:1 in two).
            for (const int64_t r_end = r + group; r < r_end;) {
              const int rows = int(std::min<int64_t>(kMaxGroupRows, r_end - r));
              attend_rows<Variant>(rows, qf + r * hd, s + r * kKeysPerChunk, acc + r * hd, m + r, l + r, p,
                                   kp + c0 * kstride, vp + c0 * kstride, kstride, nr - c0, hd, softcap, &pf);
              r += rows;
            }
          }
        };
        if constexpr (KV::kInPlace) {
          attend_alone(key_cache + base, value_cache + base, tok_stride);
        } else {
          float* kb = sc.k.data();
          float* vb = sc.v.data();
          const int64_t slot0 = (int64_t)table[blk] * sh.block_size + off;
          for (int64_t c = 0; c < n; ++c) {
            kr.widen(key_cache + base + c * tok_stride, kb + c * hd, hd, slot0 + c, h);
            vr.widen(value_cache + base + c * tok_stride, vb + c * hd, hd, slot0 + c, h);
          }
          attend_alone(static_cast<const float*>(kb), static_cast<const float*>(vb), hd);
        }
      }
      pf.drain();
      p0 += n;
    }
  }

  if constexpr (Variant)
    if (sh.sinks) add_sinks(it, sh, m, l);
  for (int64_t h = it.kv0; h < it.kv1; ++h)
    for (int64_t t = 0; t < it.ntok; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = ((h - it.kv0) * it.ntok + t) * group + g;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        T* dst = out + (it.tok0 + t) * sh.o_stride + (h * group + g) * hd;
        const float* ar = acc + r * hd;
        for (int64_t d = 0; d < hd; ++d) dst[d] = from_f32<T>(ar[d] * inv);
      }
}

// Variant: as attend_item's; one instantiation per call, so that the item loop inlines one of them.
template <typename T, typename KV, bool Variant>
void run_items(std::vector<Item>& items, T* out, const T* query, const typename KV::E* key_cache,
               const typename KV::E* value_cache, const int32_t* block_tables, const Shape& sh, int64_t max_rows,
               int num_threads, const KV& kr, const KV& vr) {
  // Longest first, so the last items handed out (dynamic schedule) are the short ones.
  if (num_threads > 1)
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t count = (int64_t)items.size();
  // AMX for this call's prefill items (tiles: configured per thread below), where they can take it.
  bool tiles = false;
#ifdef PR_ATTENTION_AMX
  tiles = attention_amx_usable<T, KV>(sh.head_size) &&
          std::any_of(items.begin(), items.end(), [](const Item& it) { return it.ntok >= 2; });
#endif
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && count > 1)
  {
    Scratch sc;
    sc.reserve(max_rows, sh.head_size);
#ifdef PR_ATTENTION_AMX
    if (tiles) amx_configure();  // per thread
#endif
    // Items handed out one at a time (a dynamic schedule), each thread claiming its next item before it
    // starts the current one, so the current one's last chunk can prefetch the next one's first.
    for (int64_t i = next.fetch_add(1); i < count;) {
      const int64_t j = next.fetch_add(1);
      attend_item<T, KV, Variant>(items[i], out, query, key_cache, value_cache, block_tables, sh, sc, kr, vr, tiles,
                                  j < count ? &items[j] : nullptr);
      i = j;
    }
#ifdef PR_ATTENTION_AMX
    if (tiles) _tile_release();
#endif
  }
}

template <typename T>
void zero_rows(T* out, int64_t from, int64_t to, const Shape& sh) {
  for (int64_t t = from; t < to; ++t) {
    T* dst = out + t * sh.o_stride;
    for (int64_t e = 0; e < sh.num_heads * sh.head_size; ++e) dst[e] = from_f32<T>(0.0f);
  }
}

int check_shape(const Shape& sh) {
  if (sh.num_heads <= 0 || sh.num_kv_heads <= 0 || sh.num_heads % sh.num_kv_heads) return -1;
  if (sh.head_size <= 0 || sh.head_size % 8 || sh.head_size > 1024) return -2;
  if (sh.block_size <= 0 || sh.num_blocks <= 0 || sh.table_stride < 0) return -3;
  if (sh.q_stride < sh.num_heads * sh.head_size || sh.o_stride < sh.num_heads * sh.head_size) return -4;
  if (sh.window < 0 || !(sh.softcap >= 0.0f) || sh.softcap > 3.0e38f) return -10;  // NaN and inf refused too
  if (sh.sinks)  // -inf is a sink that never weighs; NaN and +inf would make every weight NaN
    for (int64_t h = 0; h < sh.num_heads; ++h)
      if (!(sh.sinks[h] < __builtin_inff())) return -11;
  return 0;
}

// Every block a sequence reads (positions [from, len)) must be a real block of the cache; the entries
// below `from` (placeholders under a sliding window) are not even looked at.
bool table_ok(const int32_t* table, int64_t from, int64_t len, const Shape& sh) {
  const int64_t nblk = (len + sh.block_size - 1) / sh.block_size;
  if (nblk > sh.table_stride) return false;
  for (int64_t b = from / sh.block_size; b < nblk; ++b)
    if (table[b] < 0 || table[b] >= sh.num_blocks) return false;
  return true;
}

template <typename T, typename KV>
int varlen(void* out_, const void* query_, const void* key_cache_, const void* value_cache_,
           const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
           const int32_t* context_lens, int64_t num_seqs, int64_t num_tokens, const Shape& sh, int num_threads,
           const KV& kr, const KV& vr) {
  T* out = static_cast<T*>(out_);
  const T* query = static_cast<const T*>(query_);
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kRowsPerTile / group);
  std::vector<Item> items;
  int64_t max_rows = group;
  if (query_start_loc[0] != 0) return -5;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q0 = query_start_loc[i], q1 = query_start_loc[i + 1];
    const int64_t qlen = q1 - q0, ctx = context_lens[i];
    if (qlen < 0 || q1 > num_tokens || ctx < 0 || seq_lens[i] != ctx + qlen) return -6;
    if (!table_ok(block_tables + i * sh.table_stride, first_key(ctx, sh.window), ctx + qlen, sh)) return -7;
    for (int64_t j = 0; j < qlen; j += tile) {
      const int64_t nt = std::min(tile, qlen - j), keys = ctx + j + nt - first_key(ctx + j, sh.window);
      max_rows = std::max(max_rows, nt * group);
      for (int64_t h = 0; h < sh.num_kv_heads; ++h)
        items.push_back(Item{i, q0 + j, nt, ctx + j, h, h + 1, nt * keys});
    }
  }
  using E = typename KV::E;
  const auto* kc = static_cast<const E*>(key_cache_);
  const auto* vc = static_cast<const E*>(value_cache_);
  if (sh.window > 0 || sh.softcap > 0.0f || sh.sinks)
    run_items<T, KV, true>(items, out, query, kc, vc, block_tables, sh, max_rows, num_threads, kr, vr);
  else
    run_items<T, KV, false>(items, out, query, kc, vc, block_tables, sh, max_rows, num_threads, kr, vr);
  zero_rows<T>(out, query_start_loc[num_seqs], num_tokens, sh);
  return 0;
}

template <typename T, typename KV>
int decode(void* out_, const void* query_, const void* key_cache_, const void* value_cache_,
           const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs, const Shape& sh,
           int num_threads, const KV& kr, const KV& vr) {
  std::vector<Item> items;
  items.reserve(num_seqs * sh.num_kv_heads);
  // Whole-row items unless there are too few sequences to keep every thread busy.
  const int64_t heads_per_item = num_seqs >= 4 * (int64_t)num_threads ? sh.num_kv_heads : 1;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t len = seq_lens[i];
    if (len <= 0) return -6;
    const int64_t from = first_key(len - 1, sh.window);  // decode reads keys [from, len) only
    if (!table_ok(block_tables + i * sh.table_stride, from, len, sh)) return -7;
    for (int64_t h = 0; h < sh.num_kv_heads; h += heads_per_item)
      items.push_back(Item{i, i, 1, len - 1, h, h + heads_per_item, (len - from) * heads_per_item});
  }
  using E = typename KV::E;
  T* out = static_cast<T*>(out_);
  const T* query = static_cast<const T*>(query_);
  const auto* kc = static_cast<const E*>(key_cache_);
  const auto* vc = static_cast<const E*>(value_cache_);
  const int64_t max_rows = heads_per_item * (sh.num_heads / sh.num_kv_heads);
  if (sh.window > 0 || sh.softcap > 0.0f || sh.sinks)
    run_items<T, KV, true>(items, out, query, kc, vc, block_tables, sh, max_rows, num_threads, kr, vr);
  else
    run_items<T, KV, false>(items, out, query, kc, vc, block_tables, sh, max_rows, num_threads, kr, vr);
  return 0;
}

// Calls f(tag, key reader, value reader) for the query dtype (tag: a null T*) and the cache's
// reader: plain (the query's type), fp8 through its tables, or int8 with its row scales.
template <typename T, typename F>
int with_reader(int kv_kind, const float* k_aux, const float* v_aux, int64_t num_kv_heads, F&& f) {
  T* tag = nullptr;
  switch (kv_kind) {
    case kKvPlain:
      return f(tag, PlainKv<T>{}, PlainKv<T>{});
    case kKvFp8:
      return k_aux && v_aux ? f(tag, Fp8Kv{k_aux}, Fp8Kv{v_aux}) : -9;
    case kKvInt8:
      return k_aux && v_aux ? f(tag, Int8Kv{k_aux, num_kv_heads}, Int8Kv{v_aux, num_kv_heads}) : -9;
    default:
      return -9;
  }
}

template <typename F>
int dispatch(int dtype, int kv_kind, const float* k_aux, const float* v_aux, int64_t num_kv_heads, F&& f) {
  switch (dtype) {
    case kFloat32:
      return with_reader<float>(kv_kind, k_aux, v_aux, num_kv_heads, f);
    case kBFloat16:
      return with_reader<BF16>(kv_kind, k_aux, v_aux, num_kv_heads, f);
#if PR_HAVE_F16
    case kFloat16:
      return with_reader<F16>(kv_kind, k_aux, v_aux, num_kv_heads, f);
#endif
    default:
      return -8;
  }
}

}  // namespace

// Every query of sequence i (tokens query_start_loc[i]..query_start_loc[i+1], at positions
// p = context_lens[i] + j) attends causally to cache positions 0..p (window > 0: the window keys
// max(0, p - window + 1)..p; softcap > 0: scores capped); rows of tokens past query_start_loc[num_seqs]
// are zeroed. seq_lens[i] must equal context_lens[i] + query length. Window, softcap and sinks (nullptr
// or float32 [num_heads]): the layer's (pagedrun/attention/backend.py); table entries below a
// sequence's first query's window are not read.
PR_EXPORT int paged_attention_varlen(void* out, const void* query, const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, const int32_t* query_start_loc,
                                     const int32_t* seq_lens, const int32_t* context_lens, int64_t num_seqs,
                                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_size, int64_t block_size, int64_t num_blocks,
                                     int64_t table_stride, int64_t q_stride, int64_t o_stride, float scale,
                                     int32_t window, float softcap, int dtype, int num_threads, int kv_kind,
                                     const float* k_aux, const float* v_aux, const float* sinks) {
  const Shape sh{num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride, q_stride, o_stride, scale,
                 window, softcap, sinks};
  if (int rc = check_shape(sh)) return rc;
  if (num_seqs < 0 || num_tokens < 0) return -6;
  num_threads = std::max(1, num_threads);
  return dispatch(dtype, kv_kind, k_aux, v_aux, num_kv_heads, [&](auto* tag, const auto& kr, const auto& vr) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return varlen<T>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, context_lens,
                     num_seqs, num_tokens, sh, num_threads, kr, vr);
  });
}

// One query per sequence (query and out [num_seqs, num_heads, head_size]) over its seq_lens[i]
// cached tokens: the last `window` of them when window > 0 (the table entries before those are not read);
// sinks as paged_attention_varlen's.
PR_EXPORT int paged_attention_decode(void* out, const void* query, const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                     int64_t block_size, int64_t num_blocks, int64_t table_stride,
                                     int64_t q_stride, int64_t o_stride, float scale, int32_t window, float softcap,
                                     int dtype, int num_threads, int kv_kind, const float* k_aux,
                                     const float* v_aux, const float* sinks) {
  const Shape sh{num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride, q_stride, o_stride, scale,
                 window, softcap, sinks};
  if (int rc = check_shape(sh)) return rc;
  if (num_seqs < 0) return -6;
  num_threads = std::max(1, num_threads);
  return dispatch(dtype, kv_kind, k_aux, v_aux, num_kv_heads, [&](auto* tag, const auto& kr, const auto& vr) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return decode<T>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs, sh, num_threads, kr, vr);
  });
}

// Scatter this step's K/V rows ([num_tokens, num_kv_heads, head_size], token strides k_stride /
// v_stride elements, rows contiguous) into their cache slots; negative slots (padding) are skipped.
// Every slot is checked against num_slots before anything is written. Any dtype (elem_size bytes).
PR_EXPORT int paged_reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                                const int64_t* slot_mapping, int64_t num_tokens, int64_t row_elems,
                                int64_t k_stride, int64_t v_stride, int64_t num_slots, int64_t elem_size) {
  if (num_tokens < 0 || row_elems <= 0 || elem_size <= 0) return -1;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots) return -2;
  const int64_t row_bytes = row_elems * elem_size;
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  char* kc = static_cast<char*>(key_cache);
  char* vc = static_cast<char*>(value_cache);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * row_bytes, k + t * k_stride * elem_size, row_bytes);
    std::memcpy(vc + slot * row_bytes, v + t * v_stride * elem_size, row_bytes);
  }
  return 0;
}

// Whether bf16 prefill attention runs its products on AMX tiles (attention_amx.h): `on` = 1 or 0 sets
// it, -1 only asks. 0 where the build has no AMX or the kernel refuses the process its tile state.
PR_EXPORT int paged_attention_amx(int on) {
#ifdef PR_ATTENTION_AMX
  return amx_switch(g_attention_amx, on);
#else
  return (void)on, 0;
#endif
}

// dtype codes this build supports, as a bit mask (1 << code).
PR_EXPORT int paged_attention_dtypes() { return (1 << kFloat32) | (1 << kBFloat16) | (PR_HAVE_F16 << kFloat16); }
