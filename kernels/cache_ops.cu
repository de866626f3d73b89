// KV-cache kernels (vLLM's cache_kernels.cu, for pagedrun's layout):
//
//   key/value         [num_tokens, num_kv_heads, head_size]           (token stride key_stride / value_stride)
//   key/value_cache   [num_blocks, block_size, num_kv_heads, head_size]
//
// In this layout a token's row (num_kv_heads * head_size elements) is contiguous in the cache too, so
// slot s starts at element s * row_size: block s / block_size, offset s % block_size.
// Same emulation rules as paged_attention.cu (no shared memory at all here).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// One thread block per token; a negative slot (padding) writes nothing.
template <typename scalar_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    scalar_t* __restrict__ key_cache, scalar_t* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, const int key_stride, const int value_stride,
    const int num_kv_heads, const int head_size) {
  const long long token_idx = blockIdx.x;
  const long long slot_idx = slot_mapping[token_idx];
  if (slot_idx < 0) return;
  const int row_size = num_kv_heads * head_size;
  const scalar_t* key_row = key + token_idx * key_stride;
  const scalar_t* value_row = value + token_idx * value_stride;
  scalar_t* key_dst = key_cache + slot_idx * row_size;
  scalar_t* value_dst = value_cache + slot_idx * row_size;
  for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
    key_dst[i] = key_row[i];
    value_dst[i] = value_row[i];
  }
}

// Copy-on-write for every layer in one launch. Grid (num_layers, num_pairs).
// key_cache_ptrs / value_cache_ptrs: int64 base addresses of each layer's cache tensor (device
// addresses under CuPy, host addresses of the numpy buffers under the emulator).
// block_mapping: int64 [num_pairs, 2] = (src, dst). numel_per_block = block_size * num_kv_heads * head_size.
template <typename scalar_t>
__global__ void copy_blocks_kernel(const long long* __restrict__ key_cache_ptrs,
                                   const long long* __restrict__ value_cache_ptrs,
                                   const long long* __restrict__ block_mapping,
                                   const int numel_per_block) {
  const int layer_idx = blockIdx.x;
  const int pair_idx = blockIdx.y;
  scalar_t* key_cache = reinterpret_cast<scalar_t*>(key_cache_ptrs[layer_idx]);
  scalar_t* value_cache = reinterpret_cast<scalar_t*>(value_cache_ptrs[layer_idx]);
  const long long src_offset = block_mapping[2 * pair_idx] * numel_per_block;
  const long long dst_offset = block_mapping[2 * pair_idx + 1] * numel_per_block;
  for (int i = threadIdx.x; i < numel_per_block; i += blockDim.x) {
    key_cache[dst_offset + i] = key_cache[src_offset + i];
    value_cache[dst_offset + i] = value_cache[src_offset + i];
  }
}
