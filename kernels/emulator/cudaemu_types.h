// cudaemu: CUDA built-in types, fp16/bf16, math and atomics for kernels compiled as C++.
#ifndef CUDAEMU_TYPES_H
#define CUDAEMU_TYPES_H
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ---------------------------------------------------------------- vector types
// Alignments follow CUDA's vector_types.h: code that reinterprets a pointer as float4/int4/uint4
// must see the same 16-byte alignment requirement it has on the GPU.
#define CUDAEMU_VEC1(T, N, A) struct __attribute__((aligned(A))) N##1 { T x; };
#define CUDAEMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; };
#define CUDAEMU_VEC3(T, N, A) struct __attribute__((aligned(A))) N##3 { T x, y, z; };
#define CUDAEMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };
#define CUDAEMU_VECS(T, N, A1, A2, A3, A4) \
  CUDAEMU_VEC1(T, N, A1) CUDAEMU_VEC2(T, N, A2) CUDAEMU_VEC3(T, N, A3) CUDAEMU_VEC4(T, N, A4) \
  static inline N##1 make_##N##1(T x) { return N##1{x}; } \
  static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; } \
  static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; } \
  static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }

CUDAEMU_VECS(signed char, char, 1, 2, 1, 4)
CUDAEMU_VECS(unsigned char, uchar, 1, 2, 1, 4)
CUDAEMU_VECS(short, short, 2, 4, 2, 8)
CUDAEMU_VECS(unsigned short, ushort, 2, 4, 2, 8)
CUDAEMU_VECS(int, int, 4, 8, 4, 16)
CUDAEMU_VECS(unsigned int, uint, 4, 8, 4, 16)
CUDAEMU_VECS(long, long, 8, 16, 8, 16)
CUDAEMU_VECS(unsigned long, ulong, 8, 16, 8, 16)
CUDAEMU_VECS(long long, longlong, 8, 16, 8, 16)
CUDAEMU_VECS(unsigned long long, ulonglong, 8, 16, 8, 16)
CUDAEMU_VECS(float, float, 4, 8, 4, 16)
CUDAEMU_VECS(double, double, 8, 16, 8, 16)

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---------------------------------------------------------------- fp16
// __half is GCC's _Float16: conversions from float round to nearest even like __float2half.
typedef _Float16 __half;
typedef __half half;
struct __half_raw { unsigned short x; };
struct __attribute__((aligned(4))) __half2 {
  __half x, y;
  __half2() = default;
  constexpr __half2(__half a, __half b) : x(a), y(b) {}
};
typedef __half2 half2;
struct __half2_raw { unsigned short x, y; };

namespace cudaemu {
template <class To, class From>
static inline To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size mismatch");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}
static inline float u32_as_float(uint32_t u) { return bit_cast<float>(u); }
static inline uint32_t float_as_u32(float f) { return bit_cast<uint32_t>(f); }

// One ulp step of a finite/inf half toward +inf (dir > 0) or -inf (dir < 0).
static inline __half half_step(__half h, int dir) {
  uint16_t b = bit_cast<uint16_t>(h);
  bool neg = b & 0x8000;
  if ((b & 0x7fff) == 0) return bit_cast<__half>(uint16_t(dir > 0 ? 0x0001 : 0x8001));
  if ((dir > 0) != neg) ++b; else --b;
  return bit_cast<__half>(b);
}
// mode: 0 nearest-even, 1 toward zero, 2 down, 3 up
static inline __half float2half_mode(float f, int mode) {
  __half h = static_cast<__half>(f);
  if (mode == 0 || std::isnan(f)) return h;
  float back = static_cast<float>(h);
  if (mode == 1 && std::fabs(back) > std::fabs(f)) return half_step(h, f > 0 ? -1 : 1);
  if (mode == 2 && back > f) return half_step(h, -1);
  if (mode == 3 && back < f) return half_step(h, 1);
  return h;
}
}  // namespace cudaemu

static inline __half __float2half(float f) { return static_cast<__half>(f); }
static inline __half __float2half_rn(float f) { return static_cast<__half>(f); }
static inline __half __float2half_rz(float f) { return cudaemu::float2half_mode(f, 1); }
static inline __half __float2half_rd(float f) { return cudaemu::float2half_mode(f, 2); }
static inline __half __float2half_ru(float f) { return cudaemu::float2half_mode(f, 3); }
static inline __half __double2half(double d) { return static_cast<__half>(d); }
static inline float __half2float(__half h) { return static_cast<float>(h); }
static inline __half __int2half_rn(int i) { return static_cast<__half>(static_cast<float>(i)); }
static inline int __half2int_rz(__half h) { return static_cast<int>(static_cast<float>(h)); }
static inline int __half2int_rn(__half h) { return static_cast<int>(std::nearbyint(static_cast<float>(h))); }
static inline unsigned short __half_as_ushort(__half h) { return cudaemu::bit_cast<unsigned short>(h); }
static inline short __half_as_short(__half h) { return cudaemu::bit_cast<short>(h); }
static inline __half __ushort_as_half(unsigned short u) { return cudaemu::bit_cast<__half>(u); }
static inline __half __short_as_half(short u) { return cudaemu::bit_cast<__half>(u); }
static inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
static inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
static inline __half2 __half2half2(__half a) { return __half2(a, a); }
static inline __half2 __float2half2_rn(float f) { return __half2(__float2half(f), __float2half(f)); }
static inline __half2 __floats2half2_rn(float a, float b) { return __half2(__float2half(a), __float2half(b)); }
static inline __half2 __float22half2_rn(float2 v) { return __half2(__float2half(v.x), __float2half(v.y)); }
static inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline float __low2float(__half2 h) { return __half2float(h.x); }
static inline float __high2float(__half2 h) { return __half2float(h.y); }
static inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
static inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
static inline __half2 __low2half2(__half2 a) { return __half2(a.x, a.x); }
static inline __half2 __high2half2(__half2 a) { return __half2(a.y, a.y); }
// Half arithmetic rounds to half after each operation, as the hardware instructions do.
static inline __half __hadd(__half a, __half b) { return __float2half(float(a) + float(b)); }
static inline __half __hsub(__half a, __half b) { return __float2half(float(a) - float(b)); }
static inline __half __hmul(__half a, __half b) { return __float2half(float(a) * float(b)); }
static inline __half __hdiv(__half a, __half b) { return __float2half(float(a) / float(b)); }
static inline __half __hfma(__half a, __half b, __half c) { return __float2half(std::fma(float(a), float(b), float(c))); }
static inline __half __hneg(__half a) { return -a; }
static inline __half __habs(__half a) { return __ushort_as_half(__half_as_ushort(a) & 0x7fff); }
static inline __half __hmax(__half a, __half b) { return __float2half(std::fmax(float(a), float(b))); }
static inline __half __hmin(__half a, __half b) { return __float2half(std::fmin(float(a), float(b))); }
static inline bool __heq(__half a, __half b) { return float(a) == float(b); }
static inline bool __hne(__half a, __half b) { return float(a) != float(b); }
static inline bool __hlt(__half a, __half b) { return float(a) < float(b); }
static inline bool __hle(__half a, __half b) { return float(a) <= float(b); }
static inline bool __hgt(__half a, __half b) { return float(a) > float(b); }
static inline bool __hge(__half a, __half b) { return float(a) >= float(b); }
static inline bool __hisnan(__half a) { return std::isnan(float(a)); }
static inline int __hisinf(__half a) { float f = float(a); return std::isinf(f) ? (f > 0 ? 1 : -1) : 0; }
static inline __half hexp(__half a) { return __float2half(std::exp(float(a))); }
static inline __half hsqrt(__half a) { return __float2half(std::sqrt(float(a))); }
static inline __half hrsqrt(__half a) { return __float2half(1.0f / std::sqrt(float(a))); }
#define CUDAEMU_H2OP(name, op) \
  static inline __half2 name(__half2 a, __half2 b) { return __half2(op(a.x, b.x), op(a.y, b.y)); }
CUDAEMU_H2OP(__hadd2, __hadd)
CUDAEMU_H2OP(__hsub2, __hsub)
CUDAEMU_H2OP(__hmul2, __hmul)
CUDAEMU_H2OP(__h2div, __hdiv)
CUDAEMU_H2OP(__hmax2, __hmax)
CUDAEMU_H2OP(__hmin2, __hmin)
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
static inline __half2 __hneg2(__half2 a) { return __half2(-a.x, -a.y); }
static inline __half2 operator+(__half2 a, __half2 b) { return __hadd2(a, b); }
static inline __half2 operator-(__half2 a, __half2 b) { return __hsub2(a, b); }
static inline __half2 operator*(__half2 a, __half2 b) { return __hmul2(a, b); }
static inline __half2 operator/(__half2 a, __half2 b) { return __h2div(a, b); }
static inline __half2& operator+=(__half2& a, __half2 b) { return a = a + b; }
static inline __half2& operator*=(__half2& a, __half2 b) { return a = a * b; }

// ---------------------------------------------------------------- bf16
struct __nv_bfloat16_raw { unsigned short x; };
struct __attribute__((aligned(2))) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  static unsigned short from_float(float f) {
    uint32_t u = cudaemu::float_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN -> canonical NaN, as CUDA does
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest, ties to even
    return static_cast<unsigned short>(u >> 16);
  }
  __nv_bfloat16(float f) : __x(from_float(f)) {}
  __nv_bfloat16(double d) : __x(from_float(static_cast<float>(d))) {}
  __nv_bfloat16(int i) : __x(from_float(static_cast<float>(i))) {}
  __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
  operator float() const { return cudaemu::u32_as_float(uint32_t(__x) << 16); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};
typedef __nv_bfloat16 nv_bfloat16;
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
typedef __nv_bfloat162 nv_bfloat162;

static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  __nv_bfloat16 r;
  r.__x = std::isnan(f) ? 0x7fff : static_cast<unsigned short>(cudaemu::float_as_u32(f) >> 16);
  return r;
}
static inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
static inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(static_cast<float>(d)); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
static inline short __bfloat16_as_short(__nv_bfloat16 b) { return static_cast<short>(b.__x); }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 r; r.__x = u; return r; }
static inline __nv_bfloat16 __short_as_bfloat16(short u) { __nv_bfloat16 r; r.__x = static_cast<unsigned short>(u); return r; }
static inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
static inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
static inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
static inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __nv_bfloat162(__nv_bfloat16(f), __nv_bfloat16(f)); }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(b)); }
static inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __nv_bfloat162(__nv_bfloat16(v.x), __nv_bfloat16(v.y)); }
static inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{float(h.x), float(h.y)}; }
static inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
static inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
static inline float __low2float(__nv_bfloat162 h) { return float(h.x); }
static inline float __high2float(__nv_bfloat162 h) { return float(h.y); }
static inline __nv_bfloat162 __lows2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.x, b.x); }
static inline __nv_bfloat162 __highs2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.y, b.y); }
static inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) + float(b)); }
static inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) - float(b)); }
static inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) * float(b)); }
static inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) / float(b)); }
static inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) { return __nv_bfloat16(std::fma(float(a), float(b), float(c))); }
static inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __ushort_as_bfloat16(a.__x ^ 0x8000); }
static inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __ushort_as_bfloat16(a.__x & 0x7fff); }
static inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(std::fmax(float(a), float(b))); }
static inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(std::fmin(float(a), float(b))); }
static inline bool __hisnan(__nv_bfloat16 a) { return std::isnan(float(a)); }
#define CUDAEMU_B2OP(name, op) \
  static inline __nv_bfloat162 name(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(op(a.x, b.x), op(a.y, b.y)); }
CUDAEMU_B2OP(__hadd2, __hadd)
CUDAEMU_B2OP(__hsub2, __hsub)
CUDAEMU_B2OP(__hmul2, __hmul)
CUDAEMU_B2OP(__h2div, __hdiv)
CUDAEMU_B2OP(__hmax2, __hmax)
CUDAEMU_B2OP(__hmin2, __hmin)
static inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) { return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
static inline __nv_bfloat16 operator+(__nv_bfloat16 a, __nv_bfloat16 b) { return __hadd(a, b); }
static inline __nv_bfloat16 operator-(__nv_bfloat16 a, __nv_bfloat16 b) { return __hsub(a, b); }
static inline __nv_bfloat16 operator*(__nv_bfloat16 a, __nv_bfloat16 b) { return __hmul(a, b); }
static inline __nv_bfloat16 operator/(__nv_bfloat16 a, __nv_bfloat16 b) { return __hdiv(a, b); }
static inline __nv_bfloat16 operator-(__nv_bfloat16 a) { return __hneg(a); }
static inline __nv_bfloat16& operator+=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a + b; }
static inline __nv_bfloat16& operator-=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a - b; }
static inline __nv_bfloat16& operator*=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a * b; }
static inline __nv_bfloat16& operator/=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a / b; }
static inline bool operator==(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) == float(b); }
static inline bool operator!=(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) != float(b); }
static inline bool operator<(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) < float(b); }
static inline bool operator<=(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) <= float(b); }
static inline bool operator>(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) > float(b); }
static inline bool operator>=(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) >= float(b); }
static inline __nv_bfloat162 operator+(__nv_bfloat162 a, __nv_bfloat162 b) { return __hadd2(a, b); }
static inline __nv_bfloat162 operator-(__nv_bfloat162 a, __nv_bfloat162 b) { return __hsub2(a, b); }
static inline __nv_bfloat162 operator*(__nv_bfloat162 a, __nv_bfloat162 b) { return __hmul2(a, b); }
static inline __nv_bfloat162& operator+=(__nv_bfloat162& a, __nv_bfloat162 b) { return a = a + b; }

// ---------------------------------------------------------------- math
// min/max: CUDA provides global overloads; integer mixes follow the usual arithmetic conversions.
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
template <class A, class B, class = std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>>>
static inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B, class = std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>>>
static inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
// glibc declares its own __expf, __logf, ... (same functions under internal names): alias them.
#define __expf expf
#define __exp10f exp10f
#define __logf logf
#define __log2f log2f
#define __log10f log10f
#define __sinf sinf
#define __cosf cosf
#define __tanf tanf
#define __sincosf sincosf
#define __powf powf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frsqrt_rn(float a) { return 1.0f / sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
static inline int __float2int_rz(float x) { return static_cast<int>(x); }
static inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
static inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
static inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
static inline unsigned __float2uint_rz(float x) { return static_cast<unsigned>(x); }
static inline long long __float2ll_rn(float x) { return static_cast<long long>(nearbyintf(x)); }
static inline long long __float2ll_rz(float x) { return static_cast<long long>(x); }
static inline float __int2float_rn(int x) { return static_cast<float>(x); }
static inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
static inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
static inline int __float_as_int(float f) { return cudaemu::bit_cast<int>(f); }
static inline unsigned __float_as_uint(float f) { return cudaemu::bit_cast<unsigned>(f); }
static inline float __int_as_float(int i) { return cudaemu::bit_cast<float>(i); }
static inline float __uint_as_float(unsigned i) { return cudaemu::bit_cast<float>(i); }
static inline long long __double_as_longlong(double d) { return cudaemu::bit_cast<long long>(d); }
static inline double __longlong_as_double(long long i) { return cudaemu::bit_cast<double>(i); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
static inline int __mul24(int a, int b) { return a * b; }
static inline unsigned __umul24(unsigned a, unsigned b) { return a * b; }
static inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------- atomics
// Blocks run one after another and fibers switch only at barriers, so plain read-modify-write
// sequences are atomic here. Only the overloads CUDA has are provided, so a kernel that uses a
// missing one (e.g. atomicMax on float) fails here as it would under nvcc.
#define CUDAEMU_ATOMIC(name, T, expr) \
  static inline T name(T* addr, T val) { T old = *addr; *addr = (expr); return old; }
CUDAEMU_ATOMIC(atomicAdd, int, old + val)
CUDAEMU_ATOMIC(atomicAdd, unsigned int, old + val)
CUDAEMU_ATOMIC(atomicAdd, unsigned long long, old + val)
CUDAEMU_ATOMIC(atomicAdd, float, old + val)
CUDAEMU_ATOMIC(atomicAdd, double, old + val)
CUDAEMU_ATOMIC(atomicAdd, __half, __hadd(old, val))
CUDAEMU_ATOMIC(atomicAdd, __half2, __hadd2(old, val))
CUDAEMU_ATOMIC(atomicAdd, __nv_bfloat16, __hadd(old, val))
CUDAEMU_ATOMIC(atomicAdd, __nv_bfloat162, __hadd2(old, val))
CUDAEMU_ATOMIC(atomicSub, int, old - val)
CUDAEMU_ATOMIC(atomicSub, unsigned int, old - val)
CUDAEMU_ATOMIC(atomicExch, int, val)
CUDAEMU_ATOMIC(atomicExch, unsigned int, val)
CUDAEMU_ATOMIC(atomicExch, unsigned long long, val)
CUDAEMU_ATOMIC(atomicExch, float, val)
CUDAEMU_ATOMIC(atomicMax, int, old < val ? val : old)
CUDAEMU_ATOMIC(atomicMax, unsigned int, old < val ? val : old)
CUDAEMU_ATOMIC(atomicMax, long long, old < val ? val : old)
CUDAEMU_ATOMIC(atomicMax, unsigned long long, old < val ? val : old)
CUDAEMU_ATOMIC(atomicMin, int, val < old ? val : old)
CUDAEMU_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
CUDAEMU_ATOMIC(atomicMin, long long, val < old ? val : old)
CUDAEMU_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
CUDAEMU_ATOMIC(atomicAnd, int, old & val)
CUDAEMU_ATOMIC(atomicAnd, unsigned int, old & val)
CUDAEMU_ATOMIC(atomicAnd, unsigned long long, old & val)
CUDAEMU_ATOMIC(atomicOr, int, old | val)
CUDAEMU_ATOMIC(atomicOr, unsigned int, old | val)
CUDAEMU_ATOMIC(atomicOr, unsigned long long, old | val)
CUDAEMU_ATOMIC(atomicXor, int, old ^ val)
CUDAEMU_ATOMIC(atomicXor, unsigned int, old ^ val)
CUDAEMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
CUDAEMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
CUDAEMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#define CUDAEMU_CAS(T) \
  static inline T atomicCAS(T* addr, T cmp, T val) { T old = *addr; if (old == cmp) *addr = val; return old; }
CUDAEMU_CAS(int)
CUDAEMU_CAS(unsigned int)
CUDAEMU_CAS(unsigned long long)
CUDAEMU_CAS(unsigned short)

#endif  // CUDAEMU_TYPES_H
