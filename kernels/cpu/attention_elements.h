// The element types of kernels/cpu/paged_attention_cpu.cpp's queries, outputs and caches: fp32, bf16
// and (where the compiler has _Float16) fp16, widened to fp32 and rounded back. Shared with the cache
// readers (attention_kv_readers.h), the decode helpers and the AMX path.
#pragma once

#include <cstdint>

#include "vec8.h"  // bits_to_float, float_to_bits

namespace {

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

}  // namespace
