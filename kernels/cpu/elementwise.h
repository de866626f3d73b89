// The model's elementwise ops for kernels/cpu/model_ops_cpu.cpp, whose exports wrap them (RMSNorm with
// the residual add, RoPE, SiLU * up, GELU-tanh * up); silu_and_mul (and silu_v) also end the GEMMs'
// fused gate/up projection (bf16_gemm.h, amx_bf16.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

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
// A float32 weight W on bf16 rows is Gemma's norm: transformers computes (1 + w) * normed h in
// float32 and rounds once, so the normed h is not rounded to bf16 before the product (the weight
// holds 1 + w, folded at load time).
template <typename T, typename W = T>
inline void rms_norm_row(const T* x, T* r, const W* weight, T* o, int64_t H, float eps) {
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
  if constexpr (std::is_same<T, W>::value)
    for (i = 0; i < H; ++i) st(o, i, ld(weight, i) * rnd<T>(ld(h, i) * inv));
  else
    for (i = 0; i < H; ++i) st(o, i, ld(weight, i) * (ld(h, i) * inv));
}

// RMSNorm of M rows of H: out = weight * (h * 1/sqrt(mean(h^2) + eps)), where h = x, or, with a
// residual, h = x + residual, written back to residual first (the pre-norm block's "h = h + f(h)"
// fused into the next norm, as vLLM does). Rows have strides ldx / ldr / ldo.
template <typename T, typename W = T>
int rms_norm(const T* x, T* residual, const W* weight, T* out, int64_t M, int64_t H, int64_t ldx, int64_t ldr,
             int64_t ldo, float eps, int num_threads) {
  if (M < 0 || H <= 0 || ldx < H || ldo < H || (residual && ldr < H)) return -1;
  if (num_threads < 1) num_threads = 1;
  // Split from 8K elements (15 rows of 576): a decode step's rows arrive from a GEMM whose threads
  // each wrote half of every row, so one thread alone read half its input from the other core
  // (docs/log/2026-11-25-vllm-cpu-xeon-session-later.md).
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H >= 8192)
  for (int64_t m = 0; m < M; ++m)
    rms_norm_row(x + m * ldx, residual ? residual + m * ldr : nullptr, weight, out + m * ldo, H, eps);
  return 0;
}

// Qwen3's q_norm / k_norm: RMSNorm over each head of hd elements, for T tokens of `heads` heads
// (token rows ldx / ldo apart, a token's heads contiguous, as q and k sit in the qkv projection's
// output). out may be x: the layer runner normalises q and k where they are.
template <typename T, typename W = T>
int head_rms_norm(const T* x, const W* weight, T* out, int64_t T_, int64_t heads, int64_t hd, int64_t ldx,
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
// (float32 tables [max_pos, rotary_dim / 2], rounded to T as transformers casts them): x1, x2 = halves of
// the first rotary_dim dims; x1' = x1*c - x2*s, x2' = x2*c + x1*s. x [T, num_heads, head_size], token
// stride ldx, head stride head_size.
template <typename T>
int rope(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t ntok, int64_t num_heads,
         int64_t head_size, int64_t ldx, int64_t max_pos, int num_threads, int64_t rotary_dim = -1) {
  // Partial rotary (Phi-4-mini, partial_rotary_factor < 1): only the first rotary_dim dims of each
  // head rotate, as HF's apply_rotary_pos_emb on q[..., :rotary_dim]; the rest are left as they are.
  if (rotary_dim < 0) rotary_dim = head_size;
  if (ntok < 0 || num_heads <= 0 || head_size <= 0 || rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_size ||
      ldx < num_heads * head_size)
    return -1;
  for (int64_t t = 0; t < ntok; ++t)
    if (positions[t] < 0 || positions[t] >= max_pos) return -2;
  if (num_threads < 1) num_threads = 1;
  const int64_t half = rotary_dim / 2;  // the tables' row length
  constexpr int64_t kSplit = 16384;  // elements from which both threads take part (measured)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (ntok * num_heads * head_size >= kSplit)
  for (int64_t t = 0; t < ntok; ++t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    if ((std::is_same<T, float>::value || kOneInstructionBf16) && half % kVec == 0 && half <= 256) {
      // A vector at a time, cos and sin rounded once per token, not per head: faster with bf16_v's
      // one-instruction rounding, slower than g++'s own loop without it
      // (docs/log/2026-11-26-prefill-attention-amx-tiles.md,
      // docs/log/2026-11-27-figures-from-code-comments.md).
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

// SiLU, x / (1 + exp(-x)), a vector at a time (silu_and_mul, and the AMX GEMM's fused epilogue).
inline vgf silu_v(vgf x) { return x / (1.0f + exp_v(-x)); }

// GELU with the tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP), a vector at a
// time: 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), computed as x / (1 + exp(-2u)),
// the same function: one exp, and no cancellation in 1 + tanh(u) near u = 0.
inline vgf gelu_tanh_v(vgf x) {
  const vgf u = broadcast_v(0.7978845608028654f) * (x + broadcast_v(0.044715f) * (x * x * x));
  return x / (1.0f + exp_v(-2.0f * u));
}
inline float gelu_tanh_f32(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  return x / (1.0f + exp_f32(-2.0f * u));
}

enum class Act { kSilu, kGeluTanh };  // the gated MLP's activation: Llama's SwiGLU, Gemma's GeGLU

template <Act A> inline vgf act_v(vgf x) {
  if constexpr (A == Act::kSilu) return silu_v(x);
  else return gelu_tanh_v(x);
}
template <Act A> inline float act_f32(float x) {
  if constexpr (A == Act::kSilu) return x / (1.0f + exp_f32(-x));
  else return gelu_tanh_f32(x);
}

// out [M, I] = act(gate) * up, where each row of gate_up [M, 2I] (row stride ldg) holds gate and up
// in blocks of `block` columns: gate's block b at columns [2b * block, (2b + 1) * block), up's
// beside it. block = I is the plain layout (all of gate, then all of up); block = kPanel is what
// the GEMM writes with a gate/up weight packed for linear_packed_silu (panels interleaved).
template <typename T, Act A = Act::kSilu>
int act_and_mul(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo, int64_t block,
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
      for (; i < bv; i += kVec) st_v(o + i, rnd_v<T>(act_v<A>(ld_v(g + i))) * ld_v(u + i));
      for (; i < block; ++i) st(o, i, rnd<T>(act_f32<A>(ld(g, i))) * ld(u, i));
    }
  }
  return 0;
}

template <typename T>
int silu_and_mul(const T* gate_up, T* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo, int64_t block,
                 int num_threads) {
  return act_and_mul<T, Act::kSilu>(gate_up, out, M, I, ldg, ldo, block, num_threads);
}
