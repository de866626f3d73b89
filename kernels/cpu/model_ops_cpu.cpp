// The model's own CPU ops, float32 (issue 8): a GEMM for the model's linear layers, and the
// elementwise chains torch runs as several passes (RMSNorm with the residual add, RoPE, SiLU * up,
// GELU-tanh * up).
//
// Built and loaded like paged_attention_cpu.cpp (pagedrun/build/cpu.py: g++ -O3 -fopenmp -shared,
// -mavx2 -mfma and -mavx512* when the machine has them; ctypes, raw pointers, no torch headers).
// Every function returns 0, or a negative status before writing anything when an argument is out of range; the
// Python side (pagedrun/models/ops.py) then falls back to torch.
//
// Why a GEMM of our own: torch's CPU linear (MKL sgemm) is at the machine's peak for the thousands of
// rows of a prefill step, but a decode step brings 1-64 and there it ran at a fraction of that
// (docs/log/2026-11-21-decode-gemm-fused-elementwise.md; a per-call cost such as packing the weights
// is the likely cause).
// Our weights never change, so they are packed once after loading, in panels of two vectors of
// columns (32 with AVX-512, 16 otherwise; BLIS's microkernel shape, f32_gemm.h), and linear_packed_f32
// runs every product of the model on them, decode and prefill alike. It is deterministic and independent of the thread count.
//
// Numerics follow transformers' op order (built with -ffp-contract=off and no -ffast-math, so a*b+c
// rounds twice, as torch's elementwise kernels do): RMSNorm multiplies x by 1/sqrt(mean(x^2) + eps)
// and then by the weight; RoPE is x1*cos - x2*sin, x2*cos + x1*sin (bit-identical to torch's);
// SiLU is x / (1 + exp(-x)). Only reduction orders (and exp, within 2 ulp) differ from torch's.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Each header includes what it uses (tests/build/test_kernel_headers.py compiles each alone); they are
// listed in dependency order, which is the order their definitions had in this file but for
// elementwise.h's (silu_and_mul, which the bf16 GEMMs call, used to follow them).
#include "simd.h"
#include "f32_gemm.h"     // the fp32 GEMM: packed panels (kPanel) and their tiles
#include "elementwise.h"  // RMSNorm, RoPE, SiLU * up
#include "bf16_gemm.h"    // the bf16 GEMM on vectors
#include "amx_bf16.h"     // the bf16 GEMM on AMX tiles (PR_HAVE_AMX; empty without AMX)

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

// Columns per panel of the packed layout (pagedrun.models.ops packs with it).
PR_EXPORT int packed_panel_width() { return kPanel; }

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) . w^T (+ bias [N] unless null), with w
// packed: [ceil(N / kPanel), K, kPanel]. Threads split the panels (each output column is one
// thread's); rows go in chunks that fit in L2 (all of a decode step's rows, a slice of a prefill's).
PR_EXPORT int linear_packed_f32(const float* x, const float* packed, const float* bias, float* out, int64_t M,
                                int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || N <= 0 || K <= 0 || ldx < K || ldo < N) return -1;
  if (num_threads < 1) num_threads = 1;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t row_chunk = row_chunk_for(M, K, sizeof(float), kTileM);
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = m0 + row_chunk < M ? m0 + row_chunk : M;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t q = 0; q < num_panels; ++q)
      packed_panel(x, ldx, m0, m1, packed, q, num_panels, N, K, bias, out + m0 * ldo + q * kPanel, ldo);
  }
  return 0;
}

#ifdef PR_HAVE_AMX
bool g_use_amx = true;
#endif

// Whether linear_packed_bf16 runs on AMX tiles (at >= kAmxMinRows rows): `on` = 1 or 0 sets it (the
// tests switch it off to compare the vector paths bit for bit), -1 only asks. 0 where the library
// was built without AMX or the kernel refuses the process its tile state.
PR_EXPORT int packed_gemm_amx(int on) {
#ifdef PR_HAVE_AMX
  return amx_switch(g_use_amx, on);
#else
  return (void)on, 0;
#endif
}

// Whether bf16 GEMMs off the AMX tiles run on vdpbf16ps: `on` = 1 or 0 sets it (the tests compare
// the two paths), -1 only asks (measuring the first time). 0 where the build has no vdpbf16ps.
PR_EXPORT int packed_gemm_bf16_dot(int on) {
  if (on >= 0) g_bf16_dot_set = on != 0;
  return use_bf16_dot() ? 1 : 0;
}

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) . w^T (+ bias), all bf16 (uint16 bits),
// w packed in k pairs: [ceil(N / kPanel), K / 2, kPanel] int32 words. K must be even.
PR_EXPORT int linear_packed_bf16(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                                 int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || N <= 0 || K <= 0 || K % 2 || ldx < K || ldo < N) return -1;
  if (num_threads < 1) num_threads = 1;
#ifdef PR_HAVE_AMX
  if (g_use_amx && linear_packed_bf16_amx(x, packed, bias, out, M, N, K, ldx, ldo, num_threads)) return 0;
#endif
  return linear_packed_bf16_vector(x, packed, bias, out, M, N, K, ldx, ldo, num_threads, false);
}

// The MLP's gate/up projection and its activation in one call: out [M, I] = silu(gate) * up with
// [gate | up] = x . w^T (+ bias), w [2I, K] packed (pack_weight) after its rows were interleaved
// panel by panel (pagedrun.models.ops.pack_gate_up): packed panel 2j holds gate's columns
// [j * kPanel, (j + 1) * kPanel), panel 2j + 1 up's same columns; bias interleaved alike. I must be
// a multiple of kPanel. On AMX tiles the activation is the GEMM's epilogue (each thread computes
// both halves of its output columns, so nothing [M, 2I] is written or read back, nor crosses cores:
// the plain layout's gate was one core's and its up the other's); off the tiles each thread takes
// pairs of panels through a small scratch (linear_packed_bf16_vec in bf16). The bits of GEMM then
// silu_and_mul either way.
inline int linear_packed_silu(const float* x, const float* packed, const float* bias, float* out, int64_t M,
                              int64_t I, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || I <= 0 || I % kPanel || K <= 0 || ldx < K || ldo < I) return -1;
  if (num_threads < 1) num_threads = 1;
  // Per pair of panels, gate's and up's sums for a chunk of rows into a small scratch (the thread's
  // own, in cache), then SiLU * up from there: linear_packed_f32's loops, a pair at a time.
  const int64_t N = 2 * I, num_panels = N / kPanel;
  const int64_t row_chunk = row_chunk_for(M, K, sizeof(float), kTileM);
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = m0 + row_chunk < M ? m0 + row_chunk : M;
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> pair(size_t((m1 - m0) * 2 * kPanel));
#pragma omp for schedule(static)
      for (int64_t j = 0; j < num_panels / 2; ++j) {
        packed_panel(x, ldx, m0, m1, packed, 2 * j, num_panels, N, K, bias, pair.data(), 2 * kPanel);
        packed_panel(x, ldx, m0, m1, packed, 2 * j + 1, num_panels, N, K, bias, pair.data() + kPanel, 2 * kPanel);
        silu_and_mul<float>(pair.data(), out + m0 * ldo + j * kPanel, m1 - m0, kPanel, 2 * kPanel, ldo, kPanel, 1);
      }
    }
  }
  return 0;
}

inline int linear_packed_silu(const uint16_t* x, const int32_t* packed, const uint16_t* bias, uint16_t* out,
                              int64_t M, int64_t I, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || I <= 0 || I % kPanel || K <= 0 || K % 2 || ldx < K || ldo < I) return -1;
  if (M == 0) return 0;
  if (num_threads < 1) num_threads = 1;
#ifdef PR_HAVE_AMX
  if (g_use_amx && linear_packed_bf16_amx(x, packed, bias, out, M, 2 * I, K, ldx, ldo, num_threads, true)) return 0;
#endif
  return linear_packed_bf16_vector(x, packed, bias, out, M, 2 * I, K, ldx, ldo, num_threads, true);
}

// Gemma's gate/up projection and GeGLU in one call, linear_packed_silu's arguments and packing:
// out [M, I] = gelu_tanh(gate) * up. The GEMM writes [M, 2I] (gate and up interleaved a panel at a
// time) into a scratch of the calling thread's, and act_and_mul reads it in that layout: the bits of
// the two calls pagedrun.models.ops makes without this one, and one entry for the layer runner.
template <typename T, typename W>
int linear_packed_gelu(const T* x, const W* packed, const T* bias, T* out, int64_t M, int64_t I, int64_t K,
                       int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || I <= 0 || I % kPanel || K <= 0 || ldx < K || ldo < I) return -1;
  if (M == 0) return 0;
  static thread_local std::vector<T> gate_up;
  gate_up.resize(size_t(M * 2 * I));
  int rc;
  if constexpr (std::is_same<T, float>::value)
    rc = linear_packed_f32(x, packed, bias, gate_up.data(), M, 2 * I, K, ldx, 2 * I, num_threads);
  else
    rc = linear_packed_bf16(x, packed, bias, gate_up.data(), M, 2 * I, K, ldx, 2 * I, num_threads);
  if (rc) return rc;
  return act_and_mul<T, Act::kGeluTanh>(gate_up.data(), out, M, I, 2 * I, ldo, kPanel, num_threads);
}

#define PR_ELEMENTWISE(SUFFIX, T, W)                                                                            \
  PR_EXPORT int rms_norm_##SUFFIX(const T* x, T* residual, const T* weight, T* out, int64_t M, int64_t H,       \
                                  int64_t ldx, int64_t ldr, int64_t ldo, float eps, int num_threads) {          \
    return rms_norm<T>(x, residual, weight, out, M, H, ldx, ldr, ldo, eps, num_threads);                        \
  }                                                                                                             \
  PR_EXPORT int head_rms_norm_##SUFFIX(const T* x, const T* weight, T* out, int64_t ntok, int64_t heads,        \
                                       int64_t head_size, int64_t ldx, int64_t ldo, float eps,                  \
                                       int num_threads) {                                                       \
    return head_rms_norm<T>(x, weight, out, ntok, heads, head_size, ldx, ldo, eps, num_threads);                \
  }                                                                                                             \
  PR_EXPORT int rope_##SUFFIX(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t ntok, \
                              int64_t num_heads, int64_t head_size, int64_t ldx, int64_t max_pos,               \
                              int num_threads) {                                                                \
    return rope<T>(x, positions, cos, sin, ntok, num_heads, head_size, ldx, max_pos, num_threads);              \
  }                                                                                                             \
  PR_EXPORT int rope_partial_##SUFFIX(T* x, const int64_t* positions, const float* cos, const float* sin,       \
                                      int64_t ntok, int64_t num_heads, int64_t head_size, int64_t ldx,          \
                                      int64_t max_pos, int num_threads, int64_t rotary_dim) {                   \
    return rope<T>(x, positions, cos, sin, ntok, num_heads, head_size, ldx, max_pos, num_threads, rotary_dim);  \
  }                                                                                                             \
  PR_EXPORT int silu_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo, \
                                      int64_t block, int num_threads) {                                         \
    return silu_and_mul<T>(gate_up, out, M, I, ldg, ldo, block, num_threads);                                   \
  }                                                                                                             \
  PR_EXPORT int gelu_tanh_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg,         \
                                           int64_t ldo, int64_t block, int num_threads) {                       \
    return act_and_mul<T, Act::kGeluTanh>(gate_up, out, M, I, ldg, ldo, block, num_threads);                   \
  }                                                                                                             \
  PR_EXPORT int linear_packed_gelu_##SUFFIX(const T* x, const W* packed, const T* bias, T* out, int64_t M,      \
                                            int64_t I, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {  \
    return linear_packed_gelu<T, W>(x, packed, bias, out, M, I, K, ldx, ldo, num_threads);                      \
  }                                                                                                             \
  PR_EXPORT int linear_packed_silu_##SUFFIX(const T* x, const W* packed, const T* bias, T* out, int64_t M,      \
                                            int64_t I, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {  \
    return linear_packed_silu(x, packed, bias, out, M, I, K, ldx, ldo, num_threads);                            \
  }
PR_ELEMENTWISE(f32, float, float)
PR_ELEMENTWISE(bf16, uint16_t, int32_t)

// Gemma's norms on bf16 rows: the weight (1 + w) in float32, the product rounded once (rms_norm_row).
PR_EXPORT int rms_norm_bf16_w32(const uint16_t* x, uint16_t* residual, const float* weight, uint16_t* out,
                                int64_t M, int64_t H, int64_t ldx, int64_t ldr, int64_t ldo, float eps,
                                int num_threads) {
  return rms_norm<uint16_t, float>(x, residual, weight, out, M, H, ldx, ldr, ldo, eps, num_threads);
}
PR_EXPORT int head_rms_norm_bf16_w32(const uint16_t* x, const float* weight, uint16_t* out, int64_t ntok,
                                     int64_t heads, int64_t head_size, int64_t ldx, int64_t ldo, float eps,
                                     int num_threads) {
  return head_rms_norm<uint16_t, float>(x, weight, out, ntok, heads, head_size, ldx, ldo, eps, num_threads);
}

// ---- Mixture of experts: every active expert's two GEMMs and the weighted sum, one call a layer ----
//
// out [T, H] (row stride ldo) = for each token t, the sum over its k slots, in the order given
// (ascending expert: HF's), of w[t, j] * expert_ids[t, j](x[t]), where expert e(x) =
// w2[e] . silu(gate) * up and [gate | up] = w13[e] . x (+ biases). Each weight is packed as a dense
// layer's (w13[e] by pack_gate_up, w2[e] by pack_weight), expert e's at w13 + e * s13 and
// w2 + e * s2 (elements of W). Dispatch is a counting sort of the T * k slots by expert (stable, so
// rows keep token order within an expert): expert e's rows are contiguous and gathered once, and an
// active expert's weights are read once per step whatever its row count; an expert no token chose
// is not read at all.
//
// The work is one parallel region: the (expert, panel pair) items of every active expert's w13 (its
// SiLU fused, as linear_packed_silu's), a barrier, the (expert, panel) items of w2, then the sum.
// A call per expert (two fork/joins each, 16 per layer at batch 1 with top-8) cost more than the
// weights' bytes on a busy 2-core machine, where each fork waited for a descheduled thread
// (docs/log/2026-11-28-moe-core.md). Every output element is the packed GEMM's sum over k in order
// (the same bits as the dense kernels on those rows). With AMX tiles the per-expert calls stay
// (linear_packed_bf16 picks the tiles by row count). The weighted sum rounds as torch's ops do: in
// fp32 for float, and for bf16 each product rounded (w first rounded to bf16 unless weights_f32,
// Mixtral) and each add rounded, so a token's result does not depend on the rest of the batch.
struct MoEDispatch {
  std::vector<int64_t> start;    // expert e's rows: [start[e], start[e + 1])
  std::vector<int64_t> row_of;   // slot t * k + j's row in the sorted order
  std::vector<int64_t> slot_of;  // row_of's inverse
  std::vector<int32_t> active;   // the experts with rows, ascending

  MoEDispatch(const int64_t* expert_ids, int64_t R, int64_t E)
      : start(size_t(E + 1), 0), row_of(size_t(R)), slot_of(size_t(R)) {
    for (int64_t r = 0; r < R; ++r) ++start[size_t(expert_ids[r] + 1)];
    for (int64_t e = 0; e < E; ++e) start[size_t(e + 1)] += start[size_t(e)];
    std::vector<int64_t> fill = start;  // the next free row of each expert's group
    for (int64_t r = 0; r < R; ++r) row_of[size_t(r)] = fill[size_t(expert_ids[r])]++;
    for (int64_t r = 0; r < R; ++r) slot_of[size_t(row_of[size_t(r)])] = r;
    for (int64_t e = 0; e < E; ++e)
      if (start[size_t(e + 1)] > start[size_t(e)]) active.push_back(int32_t(e));
  }
};

// Token t's k expert outputs (rows of ys) weighted and added into out's row t, in slot order.
template <typename T>
inline void moe_combine_row(const T* ys, const int64_t* rows_of, const float* weights, int64_t t, int64_t k,
                            int64_t H, int weights_f32, T* o) {
  for (int64_t j = 0; j < k; ++j) {
    const T* y = ys + rows_of[t * k + j] * H;
    if constexpr (std::is_same<T, float>::value) {
      const float w = weights[t * k + j];
      if (j == 0)
        for (int64_t c = 0; c < H; ++c) o[c] = y[c] * w;
      else
        for (int64_t c = 0; c < H; ++c) o[c] = o[c] + y[c] * w;
    } else {
      const float w = weights_f32 ? weights[t * k + j] : bf16_to_f32(f32_to_bf16(weights[t * k + j]));
      for (int64_t c = 0; c < H; ++c) {
        const float p = bf16_to_f32(f32_to_bf16(bf16_to_f32(y[c]) * w));
        o[c] = j == 0 ? f32_to_bf16(p) : f32_to_bf16(bf16_to_f32(o[c]) + p);
      }
    }
  }
}

// Rows [0, rows) of a bf16 matrix (row stride ld, K columns) as the widening GEMM path reads them
// (linear_packed_bf16_vec's loop: each pair swapped, widened to two floats) into dst (row stride K).
inline void widen_bf16_rows(const uint16_t* src, int64_t ld, int64_t K, int64_t m, float* dst) {
  uint64_t* row = reinterpret_cast<uint64_t*>(dst + m * K);
  for (int64_t p = 0; p < K / 2; ++p) {
    uint32_t pair_bits;
    std::memcpy(&pair_bits, src + m * ld + 2 * p, 4);
    row[p] = uint64_t(pair_bits & 0xffff0000u) | (uint64_t(pair_bits & 0xffffu) << 48);
  }
}

// The (expert, panel) work items of the active experts: item i is expert item_e[i]'s panel (or pair)
// item_q[i].
struct MoEItems {
  std::vector<int32_t> e, q;
  MoEItems(const MoEDispatch& d, int64_t E, int64_t per_expert) {
    for (int64_t x = 0; x < E; ++x)
      if (d.start[size_t(x + 1)] > d.start[size_t(x)])
        for (int64_t j = 0; j < per_expert; ++j) e.push_back(int32_t(x)), q.push_back(int32_t(j));
  }
};

template <typename T, typename W, bool Dot>
int moe_experts_region(const T* x, int64_t ldx, int64_t num_tokens, int64_t H, const float* weights, int64_t k,
                       int64_t E, const W* w13, const T* b13, int64_t s13, const W* w2, const T* b2, int64_t s2,
                       int64_t I, int weights_f32, T* out, int64_t ldo, int num_threads, const MoEDispatch& d) {
  constexpr bool kF32 = std::is_same<T, float>::value;
  using XRow = std::conditional_t<kF32, float, Bf16XRow<Dot>>;
  constexpr bool kWiden = !kF32 && !Dot;  // bf16 rows read as widened floats
  const int64_t R = num_tokens * k;
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) max_rows = std::max(max_rows, d.start[size_t(e + 1)] - d.start[size_t(e)]);
  const int64_t np13 = 2 * I / kPanel, np2 = (H + kPanel - 1) / kPanel;
  const MoEItems items13(d, E, np13 / 2), items2(d, E, np2);
  static thread_local std::vector<T> xs_buf, act_buf, ys_buf;
  static thread_local std::vector<float> xw_buf, aw_buf;
  xs_buf.resize(size_t(R * H));
  act_buf.resize(size_t(R * I));
  ys_buf.resize(size_t(R * H));
  if (kWiden) xw_buf.resize(size_t(R * H)), aw_buf.resize(size_t(R * I));
  // Plain pointers: a thread_local named inside the region would be each worker's own (empty) one.
  T* const xs = xs_buf.data();
  T* const act = act_buf.data();
  T* const ys = ys_buf.data();
  const XRow* const xr = kWiden ? reinterpret_cast<const XRow*>(xw_buf.data()) : reinterpret_cast<const XRow*>(xs);
  const XRow* const ar = kWiden ? reinterpret_cast<const XRow*>(aw_buf.data()) : reinterpret_cast<const XRow*>(act);
  float* const xw = xw_buf.data();
  float* const aw = aw_buf.data();
  const int64_t* const rows_of = d.row_of.data();
  const int64_t* const start = d.start.data();
  const int64_t n13 = int64_t(items13.e.size()), n2 = int64_t(items2.e.size());
  const int32_t *e13 = items13.e.data(), *q13 = items13.q.data(), *e2 = items2.e.data(), *q2 = items2.q.data();
  const int64_t* const slot_of = d.slot_of.data();
  const int64_t num_active = int64_t(d.active.size());
  // Whole experts per thread where there are enough of them: each thread then gathers, multiplies
  // and writes its experts' rows alone, and the region has one barrier (before the sum) instead of
  // one per phase; each barrier cost a time slice whenever the machine had descheduled a thread.
  // A split by panels is kept for fewer experts than 2 per thread (one expert would be one
  // thread's).
  const bool by_expert = num_active >= 2 * int64_t(num_threads);
  // Expert a's share of the work: its weights' bytes (one unit) and its rows' arithmetic.
  std::vector<double> cost_to(size_t(num_active + 1), 0.0);
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t e = d.active[size_t(a)];
    cost_to[size_t(a + 1)] = cost_to[size_t(a)] + 1.0 + double(start[e + 1] - start[e]) / 64.0;
  }
  const int32_t* const active = d.active.data();
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<T> pair(size_t(max_rows * 2 * kPanel));  // a pair of panels' gate and up sums
    if (by_expert) {
      const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
      // This thread's experts: those whose cost midpoint falls in its equal share.
      const double total = cost_to[size_t(num_active)];
      for (int64_t a = 0; a < num_active; ++a) {
        const double mid = 0.5 * (cost_to[size_t(a)] + cost_to[size_t(a + 1)]);
        if (std::min(int(mid * nt / total), nt - 1) != tid) continue;
        const int64_t e = active[a], m0 = start[e], m1 = start[e + 1], rows = m1 - m0;
        for (int64_t m = m0; m < m1; ++m) {
          std::memcpy(xs + m * H, x + (slot_of[m] / k) * ldx, size_t(H) * sizeof(T));
          if constexpr (kWiden) widen_bf16_rows(xs, H, H, m, xw);
        }
        const W* w = w13 + e * s13;
        const T* b = b13 ? b13 + e * 2 * I : nullptr;
        for (int64_t j = 0; j < np13 / 2; ++j) {
          if constexpr (kF32) {
            packed_panel(xs, H, m0, m1, w, 2 * j, np13, 2 * I, H, b, pair.data(), 2 * kPanel);
            packed_panel(xs, H, m0, m1, w, 2 * j + 1, np13, 2 * I, H, b, pair.data() + kPanel, 2 * kPanel);
          } else {
            bf16_panel_rows<Dot>(xr + m0 * H, H, rows, w, 2 * j, H / 2, 2 * I, b, pair.data(), 2 * kPanel);
            bf16_panel_rows<Dot>(xr + m0 * H, H, rows, w, 2 * j + 1, H / 2, 2 * I, b, pair.data() + kPanel,
                                 2 * kPanel);
          }
          silu_and_mul<T>(pair.data(), act + m0 * I + j * kPanel, rows, kPanel, 2 * kPanel, I, kPanel, 1);
        }
        if constexpr (kWiden)
          for (int64_t m = m0; m < m1; ++m) widen_bf16_rows(act, I, I, m, aw);
        const W* v = w2 + e * s2;
        const T* c = b2 ? b2 + e * H : nullptr;
        for (int64_t q = 0; q < np2; ++q) {
          if constexpr (kF32)
            packed_panel(act, I, m0, m1, v, q, np2, H, I, c, ys + m0 * H + q * kPanel, H);
          else
            bf16_panel_rows<Dot>(ar + m0 * I, I, rows, v, q, I / 2, H, c, ys + m0 * H + q * kPanel, H);
        }
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < num_tokens; ++t)
        moe_combine_row(ys, rows_of, weights, t, k, H, weights_f32, out + t * ldo);
    } else {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(xs + rows_of[r] * H, x + (r / k) * ldx, size_t(H) * sizeof(T));
        if constexpr (kWiden) widen_bf16_rows(xs, H, H, rows_of[r], xw);
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n13; ++i) {
        const int64_t e = e13[i], j = q13[i], m0 = start[e], rows = start[e + 1] - m0;
        const W* w = w13 + e * s13;
        const T* b = b13 ? b13 + e * 2 * I : nullptr;
        if constexpr (kF32) {
          packed_panel(xs, H, m0, m0 + rows, w, 2 * j, np13, 2 * I, H, b, pair.data(), 2 * kPanel);
          packed_panel(xs, H, m0, m0 + rows, w, 2 * j + 1, np13, 2 * I, H, b, pair.data() + kPanel, 2 * kPanel);
        } else {
          bf16_panel_rows<Dot>(xr + m0 * H, H, rows, w, 2 * j, H / 2, 2 * I, b, pair.data(), 2 * kPanel);
          bf16_panel_rows<Dot>(xr + m0 * H, H, rows, w, 2 * j + 1, H / 2, 2 * I, b, pair.data() + kPanel, 2 * kPanel);
        }
        silu_and_mul<T>(pair.data(), act + m0 * I + j * kPanel, rows, kPanel, 2 * kPanel, I, kPanel, 1);
      }
      if constexpr (kWiden) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) widen_bf16_rows(act, I, I, r, aw);
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n2; ++i) {
        const int64_t e = e2[i], q = q2[i], m0 = start[e], rows = start[e + 1] - m0;
        const W* w = w2 + e * s2;
        const T* b = b2 ? b2 + e * H : nullptr;
        if constexpr (kF32)
          packed_panel(act, I, m0, m0 + rows, w, q, np2, H, I, b, ys + m0 * H + q * kPanel, H);
        else
          bf16_panel_rows<Dot>(ar + m0 * I, I, rows, w, q, I / 2, H, b, ys + m0 * H + q * kPanel, H);
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < num_tokens; ++t) moe_combine_row(ys, rows_of, weights, t, k, H, weights_f32, out + t * ldo);
    }
  }
  return 0;
}

#ifdef PR_HAVE_AMX
// With AMX tiles: a linear_packed_silu and a w2 GEMM call per active expert (each picks the tiles
// or the vectors by its row count), then the sum.
template <typename W>
int moe_experts_per_expert(const uint16_t* x, int64_t ldx, int64_t num_tokens, int64_t H, const float* weights,
                           int64_t k, int64_t E, const W* w13, const uint16_t* b13, int64_t s13, const W* w2,
                           const uint16_t* b2, int64_t s2, int64_t I, int weights_f32, uint16_t* out, int64_t ldo,
                           int num_threads, const MoEDispatch& d) {
  const int64_t R = num_tokens * k;
  static thread_local std::vector<uint16_t> xs_buf, act_buf, ys_buf;
  xs_buf.resize(size_t(R * H));
  act_buf.resize(size_t(R * I));
  ys_buf.resize(size_t(R * H));
  uint16_t *const xs = xs_buf.data(), *const act = act_buf.data(), *const ys = ys_buf.data();
  const int64_t* const rows_of = d.row_of.data();
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < R; ++r) std::memcpy(xs + rows_of[r] * H, x + (r / k) * ldx, size_t(H) * 2);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m0 = d.start[size_t(e)], rows = d.start[size_t(e + 1)] - m0;
    if (rows == 0) continue;
    int rc = linear_packed_silu(xs + m0 * H, w13 + e * s13, b13 ? b13 + e * 2 * I : nullptr, act + m0 * I, rows, I,
                                H, H, I, num_threads);
    if (!rc) rc = linear_packed_bf16(act + m0 * I, w2 + e * s2, b2 ? b2 + e * H : nullptr, ys + m0 * H, rows, H, I,
                                     I, H, num_threads);
    if (rc) return rc;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < num_tokens; ++t) moe_combine_row(ys, rows_of, weights, t, k, H, weights_f32, out + t * ldo);
  return 0;
}
#endif

template <typename T, typename W>
int moe_experts(const T* x, int64_t ldx, int64_t num_tokens, int64_t H, const int64_t* expert_ids,
                const float* weights, int64_t k, int64_t E, const W* w13, const T* b13, int64_t s13, const W* w2,
                const T* b2, int64_t s2, int64_t I, int weights_f32, T* out, int64_t ldo, int num_threads) {
  constexpr bool kF32 = std::is_same<T, float>::value;
  if (num_tokens < 0 || H <= 0 || I <= 0 || I % kPanel || k <= 0 || E <= 0 || ldx < H || ldo < H) return -1;
  if (!kF32 && (H % 2 || I % 2)) return -1;
  const int64_t R = num_tokens * k;
  for (int64_t r = 0; r < R; ++r)
    if (expert_ids[r] < 0 || expert_ids[r] >= E) return -2;
  if (num_threads < 1) num_threads = 1;
  if (R == 0) return 0;
  const MoEDispatch d(expert_ids, R, E);
  if constexpr (kF32) {
    return moe_experts_region<float, float, false>(x, ldx, num_tokens, H, weights, k, E, w13, b13, s13, w2, b2, s2, I,
                                                   weights_f32, out, ldo, num_threads, d);
  } else {
#ifdef PR_HAVE_AMX
    if (g_use_amx)
      return moe_experts_per_expert(x, ldx, num_tokens, H, weights, k, E, w13, b13, s13, w2, b2, s2, I, weights_f32,
                                    out, ldo, num_threads, d);
#endif
    if constexpr (kHaveBf16Dot) {  // the vdpbf16ps path exists only where the build has it
      if (use_bf16_dot())
        return moe_experts_region<T, W, true>(x, ldx, num_tokens, H, weights, k, E, w13, b13, s13, w2, b2, s2, I,
                                              weights_f32, out, ldo, num_threads, d);
    }
    return moe_experts_region<T, W, false>(x, ldx, num_tokens, H, weights, k, E, w13, b13, s13, w2, b2, s2, I,
                                           weights_f32, out, ldo, num_threads, d);
  }
}

PR_EXPORT int moe_experts_f32(const float* x, int64_t ldx, int64_t num_tokens, int64_t H, const int64_t* expert_ids,
                              const float* weights, int64_t k, int64_t E, const float* w13, const float* b13,
                              int64_t s13, const float* w2, const float* b2, int64_t s2, int64_t I, int weights_f32,
                              float* out, int64_t ldo, int num_threads) {
  return moe_experts<float, float>(x, ldx, num_tokens, H, expert_ids, weights, k, E, w13, b13, s13, w2, b2, s2, I,
                                   weights_f32, out, ldo, num_threads);
}

PR_EXPORT int moe_experts_bf16(const uint16_t* x, int64_t ldx, int64_t num_tokens, int64_t H,
                               const int64_t* expert_ids, const float* weights, int64_t k, int64_t E,
                               const int32_t* w13, const uint16_t* b13, int64_t s13, const int32_t* w2,
                               const uint16_t* b2, int64_t s2, int64_t I, int weights_f32, uint16_t* out,
                               int64_t ldo, int num_threads) {
  return moe_experts<uint16_t, int32_t>(x, ldx, num_tokens, H, expert_ids, weights, k, E, w13, b13, s13, w2, b2,
                                        s2, I, weights_f32, out, ldo, num_threads);
}
