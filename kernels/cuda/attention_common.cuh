// What the attention kernels share (kernels/cuda/paged_attention.cu): loop pragmas that the emulator
// ignores, warp constants, aligned vector loads, and block-wide max / sum of N values at once.
// Inlined by pagedrun.attention.kernels.load_source for NVRTC and the emulator; nvcc includes it.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define PR_UNROLL _Pragma("unroll")
#define PR_NO_UNROLL _Pragma("unroll 1")
#else
#define PR_UNROLL
#define PR_NO_UNROLL
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define PR_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#else
#define PR_LAUNCH_BOUNDS(n)
#endif

#define PR_WARP_SIZE 32
#define PR_FULL_MASK 0xffffffffu
// No <cfloat> under NVRTC: spell FLT_MAX out.
#define PR_FLT_MAX 3.402823466e+38f
#define PR_DIV_UP(a, b) (((a) + (b) - 1) / (b))

// Loads in flight per lane (docs/design/cuda-kernels.md): value rows loaded before any is used (PV phase), and
// the key elements one chunk of the QK phase reads (divided among a grouped block's query heads).
// Defined here so that a benchmark can compile other values (-D) and time them side by side.
#ifndef PR_V_BATCH
#define PR_V_BATCH 8
#endif
#ifndef PR_K_CHUNK_ELEMS
#define PR_K_CHUNK_ELEMS 128
#endif

namespace pagedrun {

__host__ __device__ constexpr int pr_max(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int pr_min(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// N contiguous elements loaded as one aligned access: alignas(N * sizeof(T)) lets nvcc emit a single
// 16-byte (or 8/4/2-byte) load; under the emulator it is a plain struct copy.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

// Sliding window: the first key position a query at position seq_len - 1 sees (window 0: all of them).
__host__ __device__ inline int window_first_key(int seq_len, int window) {
  return window > 0 && seq_len > window ? seq_len - window : 0;
}

// Gemma 2's logit soft-capping, cap * tanh(logit / cap); cap 0 is off. The branch is uniform across
// the launch (one argument), so an uncapped kernel pays one predicted compare per logit.
__device__ inline float soft_cap(float logit, float cap) {
  return cap > 0.f ? cap * tanhf(logit / cap) : logit;
}

__device__ inline float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return expf(x);
#endif
}

// Max over the whole thread block of N values at once (a GQA block's N query heads): lane 0 of each
// warp publishes through red_smem (N * NUM_WARPS floats), one barrier for all N, then every warp
// folds the NUM_WARPS values itself. Each call site gets its own red_smem slice, so no trailing
// barrier is needed before the slice could be reused.
template <int NUM_WARPS, int FIRST_MASK, int N>
__device__ inline void block_max_n(float (&v)[N], float* red_smem, int warp_idx, int lane) {
  PR_UNROLL
  for (int n = 0; n < N; n++) {
    PR_UNROLL
    for (int mask = PR_WARP_SIZE / 2; mask >= FIRST_MASK; mask /= 2) {
      v[n] = fmaxf(v[n], __shfl_xor_sync(PR_FULL_MASK, v[n], mask));
    }
    if (lane == 0) red_smem[n * NUM_WARPS + warp_idx] = v[n];
  }
  __syncthreads();
  PR_UNROLL
  for (int n = 0; n < N; n++) {
    float m = lane < NUM_WARPS ? red_smem[n * NUM_WARPS + lane] : -PR_FLT_MAX;
    PR_UNROLL
    for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
      m = fmaxf(m, __shfl_xor_sync(PR_FULL_MASK, m, mask));
    }
    v[n] = __shfl_sync(PR_FULL_MASK, m, 0);
  }
}

template <int NUM_WARPS, int N>
__device__ inline void block_sum_n(float (&v)[N], float* red_smem, int warp_idx, int lane) {
  PR_UNROLL
  for (int n = 0; n < N; n++) {
    PR_UNROLL
    for (int mask = PR_WARP_SIZE / 2; mask >= 1; mask /= 2) {
      v[n] += __shfl_xor_sync(PR_FULL_MASK, v[n], mask);
    }
    if (lane == 0) red_smem[n * NUM_WARPS + warp_idx] = v[n];
  }
  __syncthreads();
  PR_UNROLL
  for (int n = 0; n < N; n++) {
    float t = lane < NUM_WARPS ? red_smem[n * NUM_WARPS + lane] : 0.f;
    PR_UNROLL
    for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
      t += __shfl_xor_sync(PR_FULL_MASK, t, mask);
    }
    v[n] = __shfl_sync(PR_FULL_MASK, t, 0);
  }
}

template <int NUM_WARPS, int FIRST_MASK>
__device__ inline float block_max(float v, float* red_smem, int warp_idx, int lane) {
  float a[1] = {v};
  block_max_n<NUM_WARPS, FIRST_MASK, 1>(a, red_smem, warp_idx, lane);
  return a[0];
}

template <int NUM_WARPS>
__device__ inline float block_sum(float v, float* red_smem, int warp_idx, int lane) {
  float a[1] = {v};
  block_sum_n<NUM_WARPS, 1>(a, red_smem, warp_idx, lane);
  return a[0];
}

}  // namespace pagedrun
