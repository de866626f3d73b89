// Paged attention on the CPU, read in place through the block tables (issue 8).
//
// Built on first use by pagedrun/attention/cpu_kernels.py (g++ -O3 -fopenmp -shared -fPIC, plus
// -mavx2 -mfma -mf16c when the build machine has them) and called through ctypes with raw data
// pointers, so no torch headers: it compiles in about a second.
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
// Return value: 0 on success, negative when an argument is out of range (the caller falls back to
// torch or raises); nothing is written in that case.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kKeysPerChunk = 32;  // keys scored before one softmax update (scores stay in L1)
constexpr int kRowsPerTile = 64;   // query rows (tokens x group heads) per prefill work item

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- element types: widen to fp32 on load, round to nearest even on store ----
struct BF16 {
  uint16_t bits;
};
#ifdef __FLT16_MAX__
using F16 = _Float16;
#define PR_HAVE_F16 1
#else
#define PR_HAVE_F16 0
#endif

inline float to_f32(float x) { return x; }
inline float to_f32(BF16 x) { return bits_to_float(uint32_t(x.bits) << 16); }
#if PR_HAVE_F16
inline float to_f32(F16 x) { return float(x); }
#endif

template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline BF16 from_f32<BF16>(float x) {
  uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return BF16{uint16_t(u >> 16)};
}
#if PR_HAVE_F16
template <> inline F16 from_f32<F16>(float x) { return F16(x); }
#endif

// exp(x) for the x <= 0 of an online softmax (score minus running max), Cephes' expf polynomial
// (about 1 ulp), written so g++ vectorises loops over it without -ffast-math. x below -87 (and
// -inf, the initial running max) gives exactly 0.
inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float z = xc * 1.44269504088896341f;
  const float n = (z + 12582912.0f) - 12582912.0f;  // round to nearest (|z| < 2^22)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (int32_t(n) + 127) << 23;
  const float scaled = y * bits_to_float(uint32_t(e));
  return x < -87.0f ? 0.0f : scaled;
}

// Dot product with 8 independent partial sums: vectorises to one FMA per 8 elements without
// reassociating (head_size is a multiple of 8), and sums in a fixed order (deterministic).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < n; d += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[d + l] * b[d + l];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride;
  int64_t q_stride, o_stride;  // elements between consecutive tokens of query / out
  float scale;
};

// One unit of work: tokens [tok0, tok0 + ntok) of a sequence whose first of them sits at
// absolute position pos0 (= context_len + j0), for one kv head.
struct Item {
  int64_t seq, tok0, ntok, pos0, kv_head;
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, acc, m, l, s, p, k, v;
  void reserve(int64_t rows, int64_t hd) {
    q.resize(rows * hd);
    acc.resize(rows * hd);
    m.resize(rows);
    l.resize(rows);
    s.resize(rows * kKeysPerChunk);
    p.resize(kKeysPerChunk);
    k.resize(kKeysPerChunk * hd);
    v.resize(kKeysPerChunk * hd);
  }
};

template <typename T>
void attend_item(const Item& it, T* out, const T* query, const T* key_cache, const T* value_cache,
                 const int32_t* block_tables, const Shape& sh, Scratch& sc) {
  const int64_t hd = sh.head_size, group = sh.num_heads / sh.num_kv_heads;
  const int64_t rows = it.ntok * group;
  const int64_t tok_stride = sh.num_kv_heads * hd;  // between consecutive cache slots
  const int32_t* table = block_tables + it.seq * sh.table_stride;
  float* __restrict qf = sc.q.data();
  float* __restrict acc = sc.acc.data();
  float* __restrict m = sc.m.data();
  float* __restrict l = sc.l.data();
  float* __restrict s = sc.s.data();
  float* __restrict p = sc.p.data();

  // Row r = t * group + g: token tok0 + t, query head kv_head * group + g; scale folded into q.
  for (int64_t t = 0; t < it.ntok; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = query + (it.tok0 + t) * sh.q_stride + (it.kv_head * group + g) * hd;
      float* dst = qf + (t * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = to_f32(src[d]) * sh.scale;
    }
  std::fill(acc, acc + rows * hd, 0.0f);
  std::fill(m, m + rows, -__builtin_inff());
  std::fill(l, l + rows, 0.0f);

  const int64_t end = it.pos0 + it.ntok;  // keys [0, end) are visible to the tile's last token
  for (int64_t p0 = 0; p0 < end;) {
    const int64_t blk = p0 / sh.block_size, off = p0 % sh.block_size;
    const int64_t n = std::min<int64_t>({kKeysPerChunk, sh.block_size - off, end - p0});
    const int64_t base = ((int64_t)table[blk] * sh.block_size + off) * tok_stride + it.kv_head * hd;
    const float *kp, *vp;
    int64_t kstride;
    if constexpr (std::is_same<T, float>::value) {
      kp = key_cache + base;
      vp = value_cache + base;
      kstride = tok_stride;
    } else {
      float* kb = sc.k.data();
      float* vb = sc.v.data();
      for (int64_t c = 0; c < n; ++c)
        for (int64_t d = 0; d < hd; ++d) {
          kb[c * hd + d] = to_f32(key_cache[base + c * tok_stride + d]);
          vb[c * hd + d] = to_f32(value_cache[base + c * tok_stride + d]);
        }
      kp = kb;
      vp = vb;
      kstride = hd;
    }
    // Scores: each K row is loaded once for all rows of the tile that may see it.
    for (int64_t c = 0; c < n; ++c) {
      const float* krow = kp + c * kstride;
      const int64_t pos = p0 + c;
      // token t sees pos iff pos < pos0 + t + 1, i.e. t >= pos - pos0
      const int64_t t_first = pos < it.pos0 ? 0 : pos - it.pos0;
      for (int64_t r = t_first * group; r < rows; ++r) s[r * kKeysPerChunk + c] = dot(qf + r * hd, krow, hd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / group;
      const int64_t nr = std::min<int64_t>(n, it.pos0 + t + 1 - p0);  // keys of this chunk row r sees
      if (nr <= 0) continue;
      const float* sr = s + r * kKeysPerChunk;
      float cmax = sr[0];
      for (int64_t c = 1; c < nr; ++c) cmax = sr[c] > cmax ? sr[c] : cmax;
      float* ar = acc + r * hd;
      if (cmax > m[r]) {
        const float f = exp_nonpos(m[r] - cmax);  // 0 on the first chunk (m = -inf)
        l[r] *= f;
        for (int64_t d = 0; d < hd; ++d) ar[d] *= f;
        m[r] = cmax;
      }
      const float mr = m[r];
      float sum = 0.0f;
      for (int64_t c = 0; c < nr; ++c) p[c] = exp_nonpos(sr[c] - mr);
      for (int64_t c = 0; c < nr; ++c) sum += p[c];
      l[r] += sum;
      for (int64_t c = 0; c < nr; ++c) {
        const float w = p[c];
        const float* vrow = vp + c * kstride;
        for (int64_t d = 0; d < hd; ++d) ar[d] += w * vrow[d];
      }
    }
    p0 += n;
  }

  for (int64_t t = 0; t < it.ntok; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      T* dst = out + (it.tok0 + t) * sh.o_stride + (it.kv_head * group + g) * hd;
      const float* ar = acc + r * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = from_f32<T>(ar[d] * inv);
    }
}

template <typename T>
void run_items(std::vector<Item>& items, T* out, const T* query, const T* key_cache, const T* value_cache,
               const int32_t* block_tables, const Shape& sh, int64_t max_rows, int num_threads) {
  // Longest first, so the last items handed out (dynamic schedule) are the short ones.
  if (num_threads > 1)
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t count = (int64_t)items.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && count > 1)
  {
    Scratch sc;
    sc.reserve(max_rows, sh.head_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i)
      attend_item<T>(items[i], out, query, key_cache, value_cache, block_tables, sh, sc);
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
  return 0;
}

// Every block a sequence of `len` tokens reads must be a real block of the cache.
bool table_ok(const int32_t* table, int64_t len, const Shape& sh) {
  const int64_t nblk = (len + sh.block_size - 1) / sh.block_size;
  if (nblk > sh.table_stride) return false;
  for (int64_t b = 0; b < nblk; ++b)
    if (table[b] < 0 || table[b] >= sh.num_blocks) return false;
  return true;
}

template <typename T>
int varlen(void* out_, const void* query_, const void* key_cache_, const void* value_cache_,
           const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
           const int32_t* context_lens, int64_t num_seqs, int64_t num_tokens, const Shape& sh, int num_threads) {
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
    if (!table_ok(block_tables + i * sh.table_stride, ctx + qlen, sh)) return -7;
    for (int64_t j = 0; j < qlen; j += tile) {
      const int64_t nt = std::min(tile, qlen - j);
      max_rows = std::max(max_rows, nt * group);
      for (int64_t h = 0; h < sh.num_kv_heads; ++h)
        items.push_back(Item{i, q0 + j, nt, ctx + j, h, nt * (ctx + j + nt)});
    }
  }
  run_items<T>(items, out, query, static_cast<const T*>(key_cache_), static_cast<const T*>(value_cache_),
               block_tables, sh, max_rows, num_threads);
  zero_rows<T>(out, query_start_loc[num_seqs], num_tokens, sh);
  return 0;
}

template <typename T>
int decode(void* out_, const void* query_, const void* key_cache_, const void* value_cache_,
           const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs, const Shape& sh,
           int num_threads) {
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  std::vector<Item> items;
  items.reserve(num_seqs * sh.num_kv_heads);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t len = seq_lens[i];
    if (len <= 0) return -6;
    if (!table_ok(block_tables + i * sh.table_stride, len, sh)) return -7;
    for (int64_t h = 0; h < sh.num_kv_heads; ++h) items.push_back(Item{i, i, 1, len - 1, h, len});
  }
  run_items<T>(items, static_cast<T*>(out_), static_cast<const T*>(query_), static_cast<const T*>(key_cache_),
               static_cast<const T*>(value_cache_), block_tables, sh, group, num_threads);
  return 0;
}

}  // namespace

// Every query of sequence i (tokens query_start_loc[i]..query_start_loc[i+1], at positions
// context_lens[i] + j) attends causally to cache positions 0..context_lens[i] + j; rows of tokens
// past query_start_loc[num_seqs] are zeroed. seq_lens[i] must equal context_lens[i] + query length.
PR_EXPORT int paged_attention_varlen(void* out, const void* query, const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, const int32_t* query_start_loc,
                                     const int32_t* seq_lens, const int32_t* context_lens, int64_t num_seqs,
                                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_size, int64_t block_size, int64_t num_blocks,
                                     int64_t table_stride, int64_t q_stride, int64_t o_stride, float scale,
                                     int dtype, int num_threads) {
  const Shape sh{num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride, q_stride, o_stride, scale};
  if (int rc = check_shape(sh)) return rc;
  if (num_seqs < 0 || num_tokens < 0) return -6;
  num_threads = std::max(1, num_threads);
  switch (dtype) {
    case kFloat32:
      return varlen<float>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                           context_lens, num_seqs, num_tokens, sh, num_threads);
    case kBFloat16:
      return varlen<BF16>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                          context_lens, num_seqs, num_tokens, sh, num_threads);
#if PR_HAVE_F16
    case kFloat16:
      return varlen<F16>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                         context_lens, num_seqs, num_tokens, sh, num_threads);
#endif
    default:
      return -8;
  }
}

// One query per sequence (query and out [num_seqs, num_heads, head_size]) over its seq_lens[i]
// cached tokens.
PR_EXPORT int paged_attention_decode(void* out, const void* query, const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                     int64_t block_size, int64_t num_blocks, int64_t table_stride,
                                     int64_t q_stride, int64_t o_stride, float scale, int dtype, int num_threads) {
  const Shape sh{num_heads, num_kv_heads, head_size, block_size, num_blocks, table_stride, q_stride, o_stride, scale};
  if (int rc = check_shape(sh)) return rc;
  if (num_seqs < 0) return -6;
  num_threads = std::max(1, num_threads);
  switch (dtype) {
    case kFloat32:
      return decode<float>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs, sh, num_threads);
    case kBFloat16:
      return decode<BF16>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs, sh, num_threads);
#if PR_HAVE_F16
    case kFloat16:
      return decode<F16>(out, query, key_cache, value_cache, block_tables, seq_lens, num_seqs, sh, num_threads);
#endif
    default:
      return -8;
  }
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

// dtype codes this build supports, as a bit mask (1 << code).
PR_EXPORT int paged_attention_dtypes() { return (1 << kFloat32) | (1 << kBFloat16) | (PR_HAVE_F16 << kFloat16); }
