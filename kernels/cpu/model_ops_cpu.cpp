// The model's own CPU ops, float32 (issue 8): a GEMM for the model's linear layers, and the
// elementwise chains torch runs as several passes (RMSNorm with the residual add, RoPE, SiLU * up).
//
// Built and loaded like paged_attention_cpu.cpp (pagedrun/cpu_build.py: g++ -O3 -fopenmp -shared,
// -mavx2 -mfma and -mavx512* when the machine has them; ctypes, raw pointers, no torch headers).
// Every function returns 0, or a negative status before writing anything when an argument is out of range; the
// Python side (pagedrun/models/ops.py) then falls back to torch.
//
// Why a GEMM of our own: torch's CPU linear (MKL sgemm) is at the machine's peak for the thousands of
// rows of a prefill step, but a decode step brings 1-64 and there it measured 25-85 GFLOP/s against
// ~150 (docs/cpu-model-ops.md; a per-call cost such as packing the weights is the likely cause).
// Our weights never change, so they are packed once after loading, in panels of two vectors of
// columns (32 with AVX-512, 16 otherwise; BLIS's microkernel shape, f32_gemm.h), and linear_packed_f32
// runs every product of the model on them, decode and prefill alike. It is deterministic and independent of the thread count.
//
// Numerics follow transformers' op order (built with -ffp-contract=off and no -ffast-math, so a*b+c
// rounds twice, as torch's elementwise kernels do): RMSNorm multiplies x by 1/sqrt(mean(x^2) + eps)
// and then by the weight; RoPE is x1*cos - x2*sin, x2*cos + x1*sin (bit-identical to torch's);
// SiLU is x / (1 + exp(-x)). Only reduction orders (and exp, within 2 ulp) differ from torch's.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "f32_gemm.h"  // the fp32 GEMM: packed panels (kPanel) and their tiles
#include "simd.h"

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

#include "bf16_gemm.h"

// SiLU, x / (1 + exp(-x)), a vector at a time (silu_and_mul, and the AMX GEMM's fused epilogue).
inline vgf silu_v(vgf x) { return x / (1.0f + exp_v(-x)); }

#include "amx_bf16.h"

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

// ---- elementwise ops, float32 and bf16 (uint16 bits) from one template each ----
//
// bf16 follows transformers' bf16 op order: each torch op computes in fp32 and rounds its result to
// bf16, so the kernels round (rnd) exactly where a torch op would end, and nowhere else. For float32
// rnd is the identity and the code is what it was, op for op.
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
template <typename T> inline float rnd(float v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return bf16_to_f32(f32_to_bf16(v));
}
inline vgf ld_v(const float* p) { return load_v(p); }
inline vgf ld_v(const uint16_t* p) { return load_bf16_v(p); }
inline void st_v(float* p, vgf v) { store_v(p, v); }
inline void st_v(uint16_t* p, vgf v) { store_bf16_v(p, v); }
template <typename T> inline vgf rnd_v(vgf v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return round_bf16_v(v);
}

// 8 elements widened to fp32 (bf16: the top half of an fp32, exact).
inline v8f load8_any(const float* p) { return load8(p); }
inline v8f load8_any(const uint16_t* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2), may_alias));
  const v8i wide = __builtin_convertvector(*reinterpret_cast<const v8u16*>(p), v8i);
  return (v8f)(wide << 16);
}

// One row of RMSNorm: o = weight * (h * 1/sqrt(mean(h^2) + eps)), h = x, or with a residual row r,
// h = x + r written back to r first. o may be x (each element is read before it is written).
template <typename T>
inline void rms_norm_row(const T* x, T* r, const T* weight, T* o, int64_t H, float eps) {
  const T* h = x;
  if (r) {
    for (int64_t i = 0; i < H; ++i) st(r, i, ld(x, i) + ld(r, i));
    h = r;
  }
  v8f acc = {};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const v8f v = load8_any(h + i);
    acc += v * v;
  }
  float ss = horizontal_sum(acc);
  for (; i < H; ++i) ss += ld(h, i) * ld(h, i);
  const float inv = 1.0f / std::sqrt(ss / float(H) + eps);
  for (i = 0; i < H; ++i) st(o, i, ld(weight, i) * rnd<T>(ld(h, i) * inv));
}

// RMSNorm of M rows of H: out = weight * (h * 1/sqrt(mean(h^2) + eps)), where h = x, or, with a
// residual, h = x + residual, written back to residual first (the pre-norm block's "h = h + f(h)"
// fused into the next norm, as vLLM does). Rows have strides ldx / ldr / ldo.
template <typename T>
int rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t M, int64_t H, int64_t ldx, int64_t ldr,
             int64_t ldo, float eps, int num_threads) {
  if (M < 0 || H <= 0 || ldx < H || ldo < H || (residual && ldr < H)) return -1;
  if (num_threads < 1) num_threads = 1;
  // Split from 8K elements (15 rows of 576): a decode step's rows arrive from a GEMM whose threads
  // each wrote half of every row, so one thread alone read half its input from the other core
  // (bf16, 49-64 rows: 3.4-3.8 -> 2.8-3.0 ms per step of 61 calls).
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H >= 8192)
  for (int64_t m = 0; m < M; ++m)
    rms_norm_row(x + m * ldx, residual ? residual + m * ldr : nullptr, weight, out + m * ldo, H, eps);
  return 0;
}

// Qwen3's q_norm / k_norm: RMSNorm over each head of hd elements, for T tokens of `heads` heads
// (token rows ldx / ldo apart, a token's heads contiguous, as q and k sit in the qkv projection's
// output). out may be x: the layer runner normalises q and k where they are.
template <typename T>
int head_rms_norm(const T* x, const T* weight, T* out, int64_t T_, int64_t heads, int64_t hd, int64_t ldx,
                  int64_t ldo, float eps, int num_threads) {
  if (T_ < 0 || heads <= 0 || hd <= 0 || ldx < heads * hd || ldo < heads * hd) return -1;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T_ * heads * hd >= 8192)
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rms_norm_row(x + t * ldx + h * hd, static_cast<T*>(nullptr), weight, out + t * ldo + h * hd, hd, eps);
  return 0;
}

// RoPE in place, "rotate half" layout: for each token t and head, with c = cos[pos[t]], s = sin[pos[t]]
// (float32 tables [max_pos, head_size / 2], rounded to T as transformers casts them): x1, x2 = halves;
// x1' = x1*c - x2*s, x2' = x2*c + x1*s. x [T, num_heads, head_size], token stride ldx, head stride
// head_size.
template <typename T>
int rope(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t ntok, int64_t num_heads,
         int64_t head_size, int64_t ldx, int64_t max_pos, int num_threads) {
  if (ntok < 0 || num_heads <= 0 || head_size <= 0 || head_size % 2 || ldx < num_heads * head_size) return -1;
  for (int64_t t = 0; t < ntok; ++t)
    if (positions[t] < 0 || positions[t] >= max_pos) return -2;
  if (num_threads < 1) num_threads = 1;
  const int64_t half = head_size / 2;
  constexpr int64_t kSplit = 16384;  // elements from which both threads take part (measured)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (ntok * num_heads * head_size >= kSplit)
  for (int64_t t = 0; t < ntok; ++t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    if ((std::is_same<T, float>::value || kOneInstructionBf16) && half % kVec == 0 && half <= 256) {
      // A vector at a time, cos and sin rounded once per token, not per head: bf16 at 64 tokens
      // 35 -> 30 us (with bf16_v's one-instruction rounding; slower than g++'s own loop without it).
      alignas(64) float cr[256], sr[256];
      for (int64_t i = 0; i < half; i += kVec) {
        store_v(cr + i, rnd_v<T>(load_v(c + i)));
        store_v(sr + i, rnd_v<T>(load_v(s + i)));
      }
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        T* x1 = x + t * ldx + hd * head_size;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; i += kVec) {
          const vgf a = ld_v(x1 + i), b = ld_v(x2 + i), ci = load_v(cr + i), si = load_v(sr + i);
          st_v(x1 + i, rnd_v<T>(a * ci) - rnd_v<T>(b * si));
          st_v(x2 + i, rnd_v<T>(b * ci) + rnd_v<T>(a * si));
        }
      }
      continue;
    }
    for (int64_t hd = 0; hd < num_heads; ++hd) {
      T* x1 = x + t * ldx + hd * head_size;
      T* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = ld(x1, i), b = ld(x2, i), ci = rnd<T>(c[i]), si = rnd<T>(s[i]);
        st(x1, i, rnd<T>(a * ci) - rnd<T>(b * si));
        st(x2, i, rnd<T>(b * ci) + rnd<T>(a * si));
      }
    }
  }
  return 0;
}

// out [M, I] = silu(gate) * up, where each row of gate_up [M, 2I] (row stride ldg) holds gate and up
// in blocks of `block` columns: gate's block b at columns [2b * block, (2b + 1) * block), up's
// beside it. block = I is the plain layout (all of gate, then all of up); block = kPanel is what
// the GEMM writes with a gate/up weight packed for linear_packed_silu (panels interleaved).
template <typename T>
int silu_and_mul(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo, int64_t block,
                 int num_threads) {
  if (M < 0 || I <= 0 || ldg < 2 * I || ldo < I || block <= 0 || I % block) return -1;
  if (num_threads < 1) num_threads = 1;
  const int64_t bv = block / kVec * kVec;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I >= 65536)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < I / block; ++b) {
      const T* g = gate_up + m * ldg + 2 * b * block;
      const T* u = g + block;
      T* o = out + m * ldo + b * block;
      int64_t i = 0;
      for (; i < bv; i += kVec) st_v(o + i, rnd_v<T>(silu_v(ld_v(g + i))) * ld_v(u + i));
      for (; i < block; ++i) {
        const float gi = ld(g, i);
        st(o, i, rnd<T>(gi / (1.0f + exp_f32(-gi))) * ld(u, i));
      }
    }
  }
  return 0;
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
  PR_EXPORT int silu_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo, \
                                      int64_t block, int num_threads) {                                         \
    return silu_and_mul<T>(gate_up, out, M, I, ldg, ldo, block, num_threads);                                   \
  }                                                                                                             \
  PR_EXPORT int linear_packed_silu_##SUFFIX(const T* x, const W* packed, const T* bias, T* out, int64_t M,      \
                                            int64_t I, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {  \
    return linear_packed_silu(x, packed, bias, out, M, I, K, ldx, ldo, num_threads);                            \
  }
PR_ELEMENTWISE(f32, float, float)
PR_ELEMENTWISE(bf16, uint16_t, int32_t)
