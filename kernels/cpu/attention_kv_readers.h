// How paged_attention_cpu.cpp reads cache rows: as the query's type, or quantized codes widened to
// fp32 (issue 18).
#pragma once

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

#include "attention_elements.h"  // BF16, to_f32

namespace {

// A reader widens one row of hd elements (cache slot `slot`, kv head `h`) into fp32. Plain readers
// of fp32 caches are never called: the kernel reads those rows in place.
enum KvKind : int { kKvPlain = 0, kKvFp8 = 1, kKvInt8 = 2 };

template <typename T>
struct PlainKv {
  using E = T;
  // fp32 and bf16 rows are read in place (bf16 widened in registers by Vec::load); fp16 through widen().
  static constexpr bool kInPlace = std::is_same<T, float>::value || std::is_same<T, BF16>::value;
  void widen(const E* src, float* dst, int64_t hd, int64_t, int64_t) const {
    for (int64_t d = 0; d < hd; ++d) dst[d] = to_f32(src[d]);
  }
};

// fp8 (e4m3fn or e5m2). aux: 256 floats (each code's value times the layer's scale), then the
// multiplier and the format (0 e4m3fn, 1 e5m2) for the F16C path: an e5m2 code is the top byte of
// an fp16, and e4m3fn's seven magnitude bits placed at an fp16's bit 7 are an fp16 of its value
// x 2^-8, subnormals included (its NaN code, S.1111.111, is made an fp16 NaN); vcvtph2ps then
// widens 8 at a time.
struct Fp8Kv {
  using E = uint8_t;
  static constexpr bool kInPlace = false;
  const float* aux;
  void widen(const E* src, float* dst, int64_t hd, int64_t, int64_t) const {
#if defined(__F16C__)
    const __m256 mult = _mm256_set1_ps(aux[256]);
    const bool e5m2 = aux[257] != 0.0f;
    for (int64_t d = 0; d < hd; d += 8) {
      const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
      __m128i h;
      if (e5m2) {
        h = _mm_slli_epi16(b, 8);
      } else {
        const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
        const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7C00));
        h = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(mag, 7)), nan);  // the NaN code stays NaN
      }
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), mult));
    }
#else
    for (int64_t d = 0; d < hd; ++d) dst[d] = aux[src[d]];
#endif
  }
};

// int8: code x the row's scale; scales [num_blocks * block_size, num_kv_heads] beside the cache.
struct Int8Kv {
  using E = int8_t;
  static constexpr bool kInPlace = false;
  const float* scales;
  int64_t num_kv_heads;
  void widen(const E* src, float* dst, int64_t hd, int64_t slot, int64_t h) const {
    const float s = scales[slot * num_kv_heads + h];
    for (int64_t d = 0; d < hd; ++d) dst[d] = float(src[d]) * s;
  }
};

}  // namespace
