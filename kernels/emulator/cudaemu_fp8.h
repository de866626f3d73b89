// cudaemu: the fp8 part of <cuda_fp8.h> (storage types, __nv_cvt_* conversions, __nv_fp8_e4m3 /
// __nv_fp8_e5m2) with CUDA's semantics, so kernels that quantize the KV cache run unchanged:
//   - to fp8: round to nearest even; __NV_SATFINITE clamps finite overflow and +-inf to the largest
//     finite value (e4m3 +-448, e5m2 +-57344); __NV_NOSAT gives NaN (e4m3, no inf) or inf (e5m2);
//     NaN from a float becomes the canonical 0x7f (CUDA converts float NaN to 0x7fffffff first);
//   - from fp8 to half: exact; every NaN code becomes the canonical half NaN 0x7fff.
// Written from the formats' definitions (OCP FP8: e4m3 bias 7 with only S.1111.111 as NaN, e5m2
// bias 15 IEEE-like) and checked code by code against torch and, where nvcc exists, against the
// CUDA header itself (tests/build/test_cudaemu_fp8.py).
#ifndef CUDAEMU_FP8_H
#define CUDAEMU_FP8_H
#include <cmath>
#include <cstdint>
#include <cstring>

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;
typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;

namespace cudaemu {
struct Fp8Format {
  int man_bits, bias;
  double max_finite;
  unsigned char max_code, overflow_nosat;  // largest finite code; what NOSAT overflow gives
};
static inline Fp8Format fp8_format(__nv_fp8_interpretation_t f) {
  return f == __NV_E4M3 ? Fp8Format{3, 7, 448.0, 0x7e, 0x7f} : Fp8Format{2, 15, 57344.0, 0x7b, 0x7c};
}
// Round half to even without depending on the FP environment's rounding mode.
static inline double rne(double n) {
  double f = std::floor(n), d = n - f;
  return (d > 0.5 || (d == 0.5 && std::fmod(f, 2.0) != 0.0)) ? f + 1.0 : f;
}
// |x| (finite, not NaN) -> fp8 code without the sign, 0xff meaning "overflow".
static inline unsigned fp8_magnitude(double a, const Fp8Format& f) {
  const double min_normal = std::ldexp(1.0, 1 - f.bias);
  if (a < min_normal) {  // subnormal range: multiples of 2^(1 - bias - man_bits); may round up to min normal
    return unsigned(rne(a / std::ldexp(1.0, 1 - f.bias - f.man_bits)));
  }
  int e2;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1;      // a in [2^e, 2^(e+1))
  double r = rne(a / std::ldexp(1.0, e - f.man_bits));  // in [2^man, 2^(man+1)]
  if (r == std::ldexp(1.0, f.man_bits + 1)) {
    r /= 2;
    e += 1;
  }
  if (r * std::ldexp(1.0, e - f.man_bits) > f.max_finite) return 0xff;
  return unsigned(((e + f.bias) << f.man_bits) | (unsigned(r) - (1u << f.man_bits)));
}
static inline __nv_fp8_storage_t to_fp8(double x, __nv_saturation_t sat, __nv_fp8_interpretation_t interp) {
  const Fp8Format f = fp8_format(interp);
  const unsigned sign = std::signbit(x) ? 0x80u : 0u;
  unsigned m = std::isinf(x) ? 0xffu : fp8_magnitude(std::fabs(x), f);
  if (m == 0xff) m = sat == __NV_SATFINITE ? f.max_code : f.overflow_nosat;
  return __nv_fp8_storage_t(m | sign);
}
// fp8 code -> its exact value as a double (NaN for NaN codes, +-inf for e5m2's inf codes).
static inline double fp8_value(__nv_fp8_storage_t x, __nv_fp8_interpretation_t interp) {
  const Fp8Format f = fp8_format(interp);
  const unsigned mag = x & 0x7fu;
  const double s = (x & 0x80u) ? -1.0 : 1.0;
  if (interp == __NV_E4M3 && mag == 0x7f) return NAN;
  if (interp == __NV_E5M2 && mag >= 0x7c) return mag == 0x7c ? s * INFINITY : NAN;
  const unsigned e = mag >> f.man_bits, man = mag & ((1u << f.man_bits) - 1u);
  if (e == 0) return s * std::ldexp(double(man), 1 - f.bias - f.man_bits);
  return s * std::ldexp(double(man + (1u << f.man_bits)), int(e) - f.bias - f.man_bits);
}
}  // namespace cudaemu

static inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t sat,
                                                        __nv_fp8_interpretation_t interp) {
  if (std::isnan(x)) {  // CUDA keeps a double NaN's sign (and e5m2 its top mantissa bits)
    uint64_t b;
    std::memcpy(&b, &x, 8);
    const unsigned sign = unsigned(b >> 56) & 0x80u;
    return __nv_fp8_storage_t(sign | (interp == __NV_E4M3 ? 0x7fu : 0x7eu | (unsigned(b >> 50) & 0x3u)));
  }
  return cudaemu::to_fp8(x, sat, interp);
}
static inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat,
                                                       __nv_fp8_interpretation_t interp) {
  if (std::isnan(x)) return 0x7f;  // float NaN -> canonical NaN (positive, all mantissa bits set)
  return cudaemu::to_fp8(double(x), sat, interp);
}
static inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat,
                                                            __nv_fp8_interpretation_t interp) {
  return __nv_fp8x2_storage_t(__nv_cvt_float_to_fp8(x.x, sat, interp) |
                              (unsigned(__nv_cvt_float_to_fp8(x.y, sat, interp)) << 8));
}
static inline __nv_fp8x2_storage_t __nv_cvt_double2_to_fp8x2(double2 x, __nv_saturation_t sat,
                                                             __nv_fp8_interpretation_t interp) {
  return __nv_fp8x2_storage_t(__nv_cvt_double_to_fp8(x.x, sat, interp) |
                              (unsigned(__nv_cvt_double_to_fp8(x.y, sat, interp)) << 8));
}
static inline __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw x, __nv_saturation_t sat,
                                                         __nv_fp8_interpretation_t interp) {
  return __nv_cvt_float_to_fp8(__half2float(__ushort_as_half(x.x)), sat, interp);
}
static inline __nv_fp8x2_storage_t __nv_cvt_halfraw2_to_fp8x2(__half2_raw x, __nv_saturation_t sat,
                                                              __nv_fp8_interpretation_t interp) {
  return __nv_fp8x2_storage_t(__nv_cvt_halfraw_to_fp8(__half_raw{x.x}, sat, interp) |
                              (unsigned(__nv_cvt_halfraw_to_fp8(__half_raw{x.y}, sat, interp)) << 8));
}
static inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw x, __nv_saturation_t sat,
                                                             __nv_fp8_interpretation_t interp) {
  return __nv_cvt_float_to_fp8(cudaemu::u32_as_float(uint32_t(x.x) << 16), sat, interp);
}
static inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t interp) {
  const double v = cudaemu::fp8_value(x, interp);
  if (std::isnan(v)) return __half_raw{0x7fff};
  return __half_raw{__half_as_ushort(static_cast<__half>(v))};  // every fp8 value is a half: exact
}
static inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t interp) {
  return __half2_raw{__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x & 0xffu), interp).x,
                     __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x >> 8), interp).x};
}

// The scalar classes: construction rounds like __NV_SATFINITE (CUDA's constructors do), reading back
// is exact.
#define CUDAEMU_FP8_CLASS(NAME, INTERP)                                                              \
  struct NAME {                                                                                      \
    __nv_fp8_storage_t __x;                                                                          \
    NAME() = default;                                                                                \
    explicit NAME(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, INTERP)) {}                \
    explicit NAME(double d) : __x(__nv_cvt_double_to_fp8(d, __NV_SATFINITE, INTERP)) {}              \
    explicit NAME(__half h) : __x(__nv_cvt_float_to_fp8(__half2float(h), __NV_SATFINITE, INTERP)) {} \
    explicit NAME(__nv_bfloat16 b) : __x(__nv_cvt_float_to_fp8(float(b), __NV_SATFINITE, INTERP)) {} \
    explicit NAME(int i) : NAME(float(i)) {}                                                         \
    explicit operator float() const { return float(cudaemu::fp8_value(__x, INTERP)); }               \
    explicit operator double() const { return cudaemu::fp8_value(__x, INTERP); }                     \
    explicit operator __half() const { return __ushort_as_half(__nv_cvt_fp8_to_halfraw(__x, INTERP).x); } \
    explicit operator __nv_bfloat16() const { return __nv_bfloat16(float(*this)); }                  \
  };
CUDAEMU_FP8_CLASS(__nv_fp8_e4m3, __NV_E4M3)
CUDAEMU_FP8_CLASS(__nv_fp8_e5m2, __NV_E5M2)
#undef CUDAEMU_FP8_CLASS

#endif  // CUDAEMU_FP8_H
