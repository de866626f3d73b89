// The packed GEMMs' vector (kernels/cpu/model_ops_cpu.cpp): 16 floats with AVX-512, else 8
// (PR_GEMM_VEC8 forces 8, for the tests), with the FMA and bf16 helpers the GEMMs need. Part of every
// CPU kernel's cache key (pagedrun/build/cpu.py hashes kernels/cpu/*.h).
#pragma once

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "vec8.h"

namespace {

// The GEMMs are written once, width-generic; only the register file differs. MR rows of x times a panel of
// two vectors is 2 * MR accumulators + 2 weight vectors + 1 broadcast: MR = 6 fills the 16 AVX
// registers (the BLIS microkernel's shape), MR = 12 fits the 32 AVX-512 registers with 5 to spare.
// Each lane accumulates one output column over k in order, so the result is bit-identical whatever
// the width (tests/models/test_model_ops.py builds both and compares them).
#if defined(__AVX512F__) && !defined(PR_GEMM_VEC8)
constexpr int kVec = 16;
constexpr int kTileM = 12;
typedef float vgf __attribute__((vector_size(64)));
typedef float vgfu __attribute__((vector_size(64), aligned(4), may_alias));
inline vgf fma_v(vgf a, vgf b, vgf c) { return (vgf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vgf broadcast_v(float x) { return (vgf)_mm512_set1_ps(x); }
#else
constexpr int kVec = 8;
constexpr int kTileM = 6;
typedef v8f vgf;
typedef v8fu vgfu;
// c + a * b with one rounding where the CPU has FMA, two otherwise.
inline vgf fma_v(vgf a, vgf b, vgf c) {
#if defined(__FMA__)
  return (vgf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return c + a * b;
#endif
}
inline vgf broadcast_v(float x) { return broadcast8(x); }
#endif
inline vgf load_v(const float* p) { return *reinterpret_cast<const vgfu*>(p); }
inline void store_v(float* p, vgf x) { *reinterpret_cast<vgfu*>(p) = x; }

typedef int32_t vgi __attribute__((vector_size(4 * kVec)));
typedef int32_t vgiu __attribute__((vector_size(4 * kVec), aligned(4), may_alias));
inline vgi load_vi(const void* p) { return *reinterpret_cast<const vgiu*>(p); }

// kVec bf16 pairs (lane j holds elements 2j, 2j+1 of a row, as two bf16 in one int32) widened to
// fp32: the even elements and the odd ones. Exact: bf16 is the top half of an fp32.
inline vgf bf16_even(vgi pairs) { return (vgf)(pairs << 16); }
inline vgf bf16_odd(vgi pairs) { return (vgf)(pairs & int32_t(0xffff0000u)); }

inline float bf16_to_f32(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

typedef uint32_t vgu __attribute__((vector_size(4 * kVec)));
typedef uint16_t vgh __attribute__((vector_size(2 * kVec)));
typedef uint16_t vghu __attribute__((vector_size(2 * kVec), aligned(2), may_alias));
// kVec bf16 widened to fp32 (exact: a bf16 is the top half of an fp32), and fp32 rounded to bf16 as
// f32_to_bf16 below (nearest even, NaN kept quiet), a vector at a time.
inline vgf widen_bf16_v(vgh h) { return (vgf)(__builtin_convertvector(h, vgu) << 16); }
inline vgf load_bf16_v(const uint16_t* p) { return widen_bf16_v(*reinterpret_cast<const vghu*>(p)); }
#if defined(__AVX512BF16__) && !defined(PR_GEMM_VEC8)
constexpr bool kOneInstructionBf16 = true;  // bf16_v below is one instruction (most vectors)
#else
constexpr bool kOneInstructionBf16 = false;
#endif
inline vgh bf16_v(vgf x) {
#if defined(__AVX512BF16__) && !defined(PR_GEMM_VEC8)
  // vcvtneps2bf16 rounds the same way (nearest even, NaN made quiet the same way) in one instruction
  // instead of eight, but reads fp32 denormals as zero: those vectors (never seen in activations)
  // take the integer route. It shortens the fused SiLU epilogue of a prefill gate/up GEMM
  // (docs/log/2026-11-26-prefill-attention-amx-tiles.md).
  if (!_mm512_fpclass_ps_mask((__m512)x, 0x20)) return (vgh)_mm512_cvtneps_pbh((__m512)x);
#endif
  const vgu u = (vgu)x;
  const vgu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vgu quiet_nan = (u >> 16) | 0x40u;
  return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded, vgh);
}
inline void store_bf16_v(uint16_t* p, vgf x) { *reinterpret_cast<vghu*>(p) = bf16_v(x); }
// x rounded to bf16 and widened back: what a torch bf16 op's result holds, in fp32.
inline vgf round_bf16_v(vgf x) { return widen_bf16_v(bf16_v(x)); }

// exp(x) a vector at a time: exp_f32's method (vec8.h: Cephes' polynomial, 0 below -87.3, inf above
// 88.7, NaN kept) with its multiply-adds fused and, with AVX-512, 2^n applied by vscalefps: half
// the instructions (exp was most of SiLU * up's time: docs/log/2026-11-27-figures-from-code-comments.md).
// Within an ulp of exp_f32, not bit-equal to it.
inline vgf exp_v(vgf x) {
  const vgf lo = broadcast_v(-87.3f), hi = broadcast_v(88.7f), shift = broadcast_v(12582912.0f);
  const vgf xc = x < lo ? lo : (x > hi ? hi : x);
  const vgf n = fma_v(xc, broadcast_v(1.44269504088896341f), shift) - shift;  // round(x / ln 2)
  vgf r = fma_v(n, broadcast_v(-0.693359375f), xc);
  r = fma_v(n, broadcast_v(2.12194440e-4f), r);
  vgf p = broadcast_v(1.9875691500e-4f);
  p = fma_v(p, r, broadcast_v(1.3981999507e-3f));
  p = fma_v(p, r, broadcast_v(8.3334519073e-3f));
  p = fma_v(p, r, broadcast_v(4.1665795894e-2f));
  p = fma_v(p, r, broadcast_v(1.6666665459e-1f));
  p = fma_v(p, r, broadcast_v(5.0000001201e-1f));
  const vgf y = fma_v(p, r * r, r) + 1.0f;
#if defined(__AVX512F__) && !defined(PR_GEMM_VEC8)
  const vgf scaled = (vgf)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
  // 2^n as two exact factors, so n = 128 (x near 88.7) does not overflow the exponent field.
  const vgi ni = __builtin_convertvector(n, vgi), n1 = ni >> 1, n2 = ni - n1;
  const vgf scaled = y * (vgf)((n1 + 127) << 23) * (vgf)((n2 + 127) << 23);
#endif
  return x < lo ? vgf{} : (x > hi ? broadcast_v(__builtin_inff()) : scaled);
}

// Round to nearest even, NaN kept quiet: what torch does when it narrows fp32 to bf16.
inline uint16_t f32_to_bf16(float x) {
  uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace
