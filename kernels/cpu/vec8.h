// Shared by the C++ CPU kernels (paged_attention_cpu.cpp, model_ops_cpu.cpp): 8-float SIMD through
// GCC vector extensions (one AVX register, or two SSE registers in a build without -mavx2; no
// intrinsics, so it builds anywhere g++ does), fixed-order lane sums, and a vectorisable expf.
// pagedrun/build/cpu.py compiles every kernel with this directory on the include path and keys its
// cache on the headers here too.
#pragma once

#include <cstdint>
#include <cstring>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));  // unaligned access
typedef int32_t v8i __attribute__((vector_size(32)));

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

inline v8f load8(const float* p) { return *reinterpret_cast<const v8fu*>(p); }
inline void store8(float* p, v8f x) { *reinterpret_cast<v8fu*>(p) = x; }

// All 8 lanes = x: one vbroadcastss (`v8f{} + x` would be a real 0 + x add without -ffast-math).
inline v8f broadcast8(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, b2+b3, b4+b5, b6+b7]
inline v8f pair_sums(v8f a, v8f b) {
  const v8i even = {0, 2, 4, 6, 8, 10, 12, 14}, odd = {1, 3, 5, 7, 9, 11, 13, 15};
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// The 8 lanes of a added in a fixed order: results are deterministic.
inline float horizontal_sum(v8f a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// exp(x) for any float: Cephes' expf polynomial (about 1 ulp), 0 below -87.3 (-inf included: the
// initial running max of an online softmax), inf above 88.7, written branch-free so g++ vectorises
// loops over it without -ffast-math.
inline float exp_f32(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
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
  // 2^n as two exact factors, so n = 128 (x near 88.7) does not overflow the exponent field.
  const int32_t n1 = int32_t(n) >> 1, n2 = int32_t(n) - n1;
  const float scaled = y * bits_to_float(uint32_t(n1 + 127) << 23) * bits_to_float(uint32_t(n2 + 127) << 23);
  return x < -87.3f ? 0.0f : (x > 88.7f ? __builtin_inff() : scaled);
}
