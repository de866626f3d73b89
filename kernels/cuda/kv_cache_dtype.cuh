// Element types of the KV cache and their conversions, shared by paged_attention.cu (dequantize on
// read) and cache_ops.cu (quantize on write). Issue 18: the cache may be stored quantized.
//
//   KvCacheDtype  cache element (cache_t)  scales (float32, per layer, for K and for V)
//   kAuto         scalar_t (model dtype)   none
//   kFp8E4M3      uint8: e4m3fn bits       one per layer (a 1-element array)
//   kFp8E5M2      uint8: e5m2 bits         one per layer
//   kInt8         int8                     one per (slot, kv head): [num_blocks, block_size, num_kv_heads]
//
// fp8:  q = fp8(x / scale), round to nearest even, saturated to the finite range (e4m3 +-448,
//       e5m2 +-57344), as vLLM's scaled_convert does; x' = float(q) * scale.
// int8: scale = max|x| over the head / 127; q = rint(x / scale) in [-127, 127], 0 when scale == 0;
//       x' = q * scale.
// Attention math stays float32: the kernels multiply a row's scale into its logit (K) and its softmax
// weight (V) once, instead of into every element.
// Included by both .cu files; for NVRTC and the emulator (one source string each)
// pagedrun.attention.kernels.load_source inlines it once per translation unit.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace pagedrun {

enum class KvCacheDtype : int { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2, kInt8 = 3 };

template <typename scalar_t, KvCacheDtype KV> struct KvCacheStorage { using type = unsigned char; };
template <typename scalar_t> struct KvCacheStorage<scalar_t, KvCacheDtype::kAuto> { using type = scalar_t; };
template <typename scalar_t> struct KvCacheStorage<scalar_t, KvCacheDtype::kInt8> { using type = signed char; };
template <typename scalar_t, KvCacheDtype KV>
using kv_cache_t = typename KvCacheStorage<scalar_t, KV>::type;

__host__ __device__ constexpr __nv_fp8_interpretation_t fp8_interpretation(KvCacheDtype kv) {
  return kv == KvCacheDtype::kFp8E5M2 ? __NV_E5M2 : __NV_E4M3;
}

// ---- scalar conversions (fp32 accumulation everywhere) ----
__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(__half x) { return __half2float(x); }
__host__ __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ inline float to_float(signed char x) { return (float)x; }  // int8 cache elements

template <typename T> __host__ __device__ inline T from_float(float x);
template <> __host__ __device__ inline float from_float<float>(float x) { return x; }
template <> __host__ __device__ inline __half from_float<__half>(float x) { return __float2half(x); }
template <> __host__ __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// The scale of cache row `slot` (a token position), kv head `kv_head`; 1 for an unquantized cache
// (a constant the compiler folds away, so kAuto kernels multiply by nothing).
template <KvCacheDtype KV>
__device__ inline float kv_row_scale(const float* scales, long long slot, int num_kv_heads, int kv_head) {
  if constexpr (KV == KvCacheDtype::kAuto) {
    return 1.f;
  } else if constexpr (KV == KvCacheDtype::kInt8) {
    return scales[slot * num_kv_heads + kv_head];
  } else {
    return scales[0];
  }
}

// N cache elements -> N floats, without the scale. fp8 goes through the paired conversion (one
// cvt instruction per two elements on sm_89+; exact: every fp8 value is a half).
template <KvCacheDtype KV, typename cache_t, int N>
__device__ inline void kv_to_float(float (&out)[N], const cache_t (&in)[N]) {
  if constexpr (KV == KvCacheDtype::kAuto || KV == KvCacheDtype::kInt8) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#pragma unroll
#endif
    for (int e = 0; e < N; e++) out[e] = to_float(in[e]);
  } else {
    static_assert(N % 2 == 0, "fp8 elements are converted in pairs");
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#pragma unroll
#endif
    for (int e = 0; e < N; e += 2) {
      const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(in[e] | (in[e + 1] << 8));
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, fp8_interpretation(KV));
      out[e] = __half2float(__ushort_as_half(h.x));
      out[e + 1] = __half2float(__ushort_as_half(h.y));
    }
  }
}

// One element of an fp8 cache row.
template <KvCacheDtype KV>
__device__ inline unsigned char quantize_fp8(float x, float scale) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, fp8_interpretation(KV));
}

// One element of an int8 cache row, given the row's scale (max|x| / 127).
__device__ inline signed char quantize_int8(float x, float scale) {
  if (scale == 0.f) return 0;
  const int q = __float2int_rn(x / scale);  // round half to even
  return (signed char)(q > 127 ? 127 : (q < -127 ? -127 : q));
}

}  // namespace pagedrun
