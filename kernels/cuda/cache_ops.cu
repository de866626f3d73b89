// KV-cache kernels (vLLM's cache_kernels.cu, for pagedrun's layout):
//
//   key/value         [num_tokens, num_kv_heads, head_size]           (token stride key_stride / value_stride)
//   key/value_cache   [num_blocks, block_size, num_kv_heads, head_size]   (cache_t: see kv_cache_dtype.cuh)
//   k/v_scales        fp8: [1] (read); int8: [num_blocks, block_size, num_kv_heads] (written); else unused
//
// In this layout a token's row (num_kv_heads * head_size elements) is contiguous in the cache too, so
// slot s starts at element s * row_size: block s / block_size, offset s % block_size.
// Same emulation rules as paged_attention.cu (no shared memory at all here).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kv_cache_dtype.cuh"

#define PR_CACHE_WARP_SIZE 32

namespace pagedrun {
// One (token, kv head) row into an int8 cache, by one warp: the row's max |x| is a warp reduction
// (every lane calls the shuffles, loop bounds are warp-uniform), lane 0 stores the scale.
template <typename scalar_t>
__device__ inline void quantize_int8_row(const scalar_t* __restrict__ src, signed char* __restrict__ dst,
                                         float* __restrict__ scale_out, const int head_size, const int lane) {
  float amax = 0.f;
  for (int i = lane; i < head_size; i += PR_CACHE_WARP_SIZE) amax = fmaxf(amax, fabsf(to_float(src[i])));
  for (int mask = PR_CACHE_WARP_SIZE / 2; mask >= 1; mask /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
  }
  const float row_scale = amax / 127.f;
  for (int i = lane; i < head_size; i += PR_CACHE_WARP_SIZE) dst[i] = quantize_int8(to_float(src[i]), row_scale);
  if (lane == 0) *scale_out = row_scale;
}
}  // namespace pagedrun

// One thread block per token; a negative slot (padding) writes nothing. kInt8 needs whole warps
// (the launcher gives it 32 x min(num_kv_heads, 16) threads): warp w quantizes heads w, w + warps, ...
template <typename scalar_t, pagedrun::KvCacheDtype KV_DTYPE = pagedrun::KvCacheDtype::kAuto>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ key_cache,
    pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, const int key_stride, const int value_stride,
    const int num_kv_heads, const int head_size, float* __restrict__ k_scales, float* __restrict__ v_scales) {
  using pagedrun::KvCacheDtype;
  using cache_t = pagedrun::kv_cache_t<scalar_t, KV_DTYPE>;
  const long long token_idx = blockIdx.x;
  const long long slot_idx = slot_mapping[token_idx];
  if (slot_idx < 0) return;
  const int row_size = num_kv_heads * head_size;
  const scalar_t* key_row = key + token_idx * key_stride;
  const scalar_t* value_row = value + token_idx * value_stride;
  cache_t* key_dst = key_cache + slot_idx * row_size;
  cache_t* value_dst = value_cache + slot_idx * row_size;
  if constexpr (KV_DTYPE == KvCacheDtype::kAuto) {
    for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
      key_dst[i] = key_row[i];
      value_dst[i] = value_row[i];
    }
  } else if constexpr (KV_DTYPE == KvCacheDtype::kInt8) {
    const int lane = threadIdx.x % PR_CACHE_WARP_SIZE;
    const int num_warps = blockDim.x / PR_CACHE_WARP_SIZE;
    for (int h = threadIdx.x / PR_CACHE_WARP_SIZE; h < num_kv_heads; h += num_warps) {
      const long long row = slot_idx * num_kv_heads + h;
      pagedrun::quantize_int8_row(key_row + h * head_size, key_dst + h * head_size, k_scales + row, head_size, lane);
      pagedrun::quantize_int8_row(value_row + h * head_size, value_dst + h * head_size, v_scales + row, head_size,
                                  lane);
    }
  } else {
    const float k_scale = k_scales[0], v_scale = v_scales[0];
    for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
      key_dst[i] = pagedrun::quantize_fp8<KV_DTYPE>(pagedrun::to_float(key_row[i]), k_scale);
      value_dst[i] = pagedrun::quantize_fp8<KV_DTYPE>(pagedrun::to_float(value_row[i]), v_scale);
    }
  }
}
