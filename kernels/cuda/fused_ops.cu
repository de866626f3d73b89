// The model's elementwise ops fused into one launch each (issue 36: a decode step was ~35 launches a
// layer, most of them torch's elementwise kernels). Launched by pagedrun/models/cuda_ops.py.
//
//   rms_norm_kernel<scalar_t, weight_t>        [rows, hidden] (or [T, heads, hd]: one row per head)
//       h = x (+ residual, written back into residual); out = weight * normalise(h)
//   rope_kernel<scalar_t, WRITE_CACHE>         q [T, heads, hd], k [T, kv_heads, hd], rotated in place;
//       WRITE_CACHE: k (rotated) and v also into the paged cache at slot_mapping (slot < 0: skipped)
//   act_and_mul_kernel<scalar_t, ACT>          [rows, 2I] holding gate then up -> act(gate) * up [rows, I]
//
// Rounding follows the torch path of pagedrun/models/ops.py, op by op, so that the outputs are the
// same bits where the torch ops are elementwise (RoPE, the residual add, the products):
// every product and sum is rounded to scalar_t where the torch op producing it would round, and
// float32 arithmetic uses __fmul_rn / __fadd_rn so that nvcc cannot contract it into an FMA that
// torch's separate kernels never form. The RMS reduction's order is a block reduction here and
// torch's own elsewhere: the variance may differ in its last bit (docs/design/cuda-kernels.md).
//
// Same emulation rules as paged_attention.cu: blockDim a multiple of 32, every shuffle by all 32
// lanes, __syncthreads only in block-uniform code, shared memory written before it is read.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kv_cache_dtype.cuh"

#define PR_FUSED_WARP 32

namespace pagedrun {
namespace fused {

// The value rounded to T and back: what a torch op in dtype T stores between two ops.
template <typename T>
__device__ inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// red: 33 floats of shared memory (32 warp partials, then the total).
__device__ inline float block_sum(float v, float* red) {
  const int lane = threadIdx.x % PR_FUSED_WARP, warp = threadIdx.x / PR_FUSED_WARP;
  const int num_warps = blockDim.x / PR_FUSED_WARP;
  for (int mask = PR_FUSED_WARP / 2; mask >= 1; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < num_warps ? red[lane] : 0.f;
    for (int mask = PR_FUSED_WARP / 2; mask >= 1; mask /= 2) w += __shfl_xor_sync(0xffffffffu, w, mask);
    if (lane == 0) red[PR_FUSED_WARP] = w;
  }
  __syncthreads();
  return red[PR_FUSED_WARP];
}

}  // namespace fused
}  // namespace pagedrun

// One block per row. Row r is x[(r / heads) * token_stride + (r % heads) * hidden ...]: heads == 1 for
// a [rows, hidden] matrix with row stride token_stride, heads > 1 for Qwen3's per-head q/k norms on a
// [T, heads, hd] view whose heads are packed. out is contiguous [rows, hidden].
// residual (nullptr: none; only with heads == 1): h = x + residual rounded to scalar_t (torch's add),
// stored into residual, normalised. weight_t == scalar_t: Llama's norm, the normalised row rounded to
// scalar_t before the weight product (HF: weight * x.to(dtype)); weight_t float on half / bf16 rows:
// Gemma's, the product in float32 and rounded once.
template <typename scalar_t, typename weight_t>
__global__ void rms_norm_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ x,
                                scalar_t* __restrict__ residual, const weight_t* __restrict__ weight,
                                const int hidden, const int heads, const long long token_stride,
                                const long long residual_stride, const float eps) {
  using pagedrun::from_float;
  using pagedrun::to_float;
  __shared__ float red[PR_FUSED_WARP + 1];
  const long long row = blockIdx.x;
  const scalar_t* x_row = x + (row / heads) * token_stride + (row % heads) * hidden;
  scalar_t* out_row = out + row * hidden;
  float sum_sq = 0.f;
  if (residual != nullptr) {
    scalar_t* r_row = residual + row * residual_stride;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const scalar_t h = from_float<scalar_t>(to_float(x_row[i]) + to_float(r_row[i]));
      r_row[i] = h;  // read back below by this same thread only
      const float hf = to_float(h);
      sum_sq += hf * hf;
    }
    x_row = r_row;
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float hf = to_float(x_row[i]);
      sum_sq += hf * hf;
    }
  }
  // torch's mean multiplies the sum by 1 / n (MeanOps); rsqrtf as torch.rsqrt on CUDA.
  const float inv = rsqrtf(pagedrun::fused::block_sum(sum_sq, red) * (1.f / (float)hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float normed = __fmul_rn(to_float(x_row[i]), inv);
    if constexpr (sizeof(weight_t) == sizeof(scalar_t)) {
      out_row[i] = from_float<scalar_t>(__fmul_rn(to_float(weight[i]), pagedrun::fused::round_to<scalar_t>(normed)));
    } else {
      out_row[i] = from_float<scalar_t>(__fmul_rn(normed, (float)weight[i]));
    }
  }
}

// One block per token; thread j of the loop rotates the pair (d, d + rot_half) of one head, d < rot_half,
// over q's heads then k's. cos / sin: float32 tables [max_pos, rot_half]; dims from 2 * rot_half on
// pass through (partial rotary). As ops._rotate computes it in scalar_t: c, s rounded to scalar_t,
// out_lo = x_lo * c - x_hi * s, out_hi = x_hi * c + x_lo * s, each product and the sum rounded.
// A position outside [0, max_pos) leaves the token's q and k unrotated (torch's index would raise;
// a kernel cannot without a host sync): the model runner never hands one over.
// WRITE_CACHE: the token's k row (rotated) and v row into key/value_cache [num_blocks, block_size,
// kv_heads, hd] at slot_mapping[token] (reshape_and_cache's layout, unquantized cache), slot < 0 skipped.
template <typename scalar_t, bool WRITE_CACHE>
__global__ void rope_kernel(scalar_t* __restrict__ q, scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                            scalar_t* __restrict__ key_cache, scalar_t* __restrict__ value_cache,
                            const long long* __restrict__ positions, const long long* __restrict__ slot_mapping,
                            const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                            const long long q_stride, const long long k_stride, const long long v_stride,
                            const int num_heads, const int num_kv_heads, const int head_size, const int rot_half,
                            const int max_pos) {
  using pagedrun::from_float;
  using pagedrun::to_float;
  using pagedrun::fused::round_to;
  const long long token = blockIdx.x;
  const long long pos = positions[token];
  const bool rotate = pos >= 0 && pos < max_pos;
  const long long slot = WRITE_CACHE ? slot_mapping[token] : -1;
  const long long row_size = (long long)num_kv_heads * head_size;
  scalar_t* k_dst = WRITE_CACHE && slot >= 0 ? key_cache + slot * row_size : nullptr;
  if (rotate) {
    const float* cos_row = cos_table + pos * rot_half;
    const float* sin_row = sin_table + pos * rot_half;
    const int pairs = (num_heads + num_kv_heads) * rot_half;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
      const int head = j / rot_half, d = j % rot_half;
      const bool is_q = head < num_heads;
      const int h = is_q ? head : head - num_heads;
      scalar_t* row = is_q ? q + token * q_stride + h * head_size : k + token * k_stride + h * head_size;
      const float c = round_to<scalar_t>(cos_row[d]), s = round_to<scalar_t>(sin_row[d]);
      const float lo = to_float(row[d]), hi = to_float(row[d + rot_half]);
      const scalar_t out_lo = from_float<scalar_t>(
          __fadd_rn(round_to<scalar_t>(__fmul_rn(lo, c)), -round_to<scalar_t>(__fmul_rn(hi, s))));
      const scalar_t out_hi = from_float<scalar_t>(
          __fadd_rn(round_to<scalar_t>(__fmul_rn(hi, c)), round_to<scalar_t>(__fmul_rn(lo, s))));
      row[d] = out_lo;
      row[d + rot_half] = out_hi;
      if (WRITE_CACHE && !is_q && k_dst != nullptr) {
        k_dst[h * head_size + d] = out_lo;
        k_dst[h * head_size + d + rot_half] = out_hi;
      }
    }
  }
  if constexpr (WRITE_CACHE) {
    if (slot < 0) return;
    // v whole, and k's elements the loop above did not write (pass-through dims; all when unrotated)
    const int rot = rotate ? 2 * rot_half : 0;
    const scalar_t* v_row = v + token * v_stride;
    const scalar_t* k_row = k + token * k_stride;
    scalar_t* v_dst = value_cache + slot * row_size;
    for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
      v_dst[i] = v_row[i];
      if (i % head_size >= rot) k_dst[i] = k_row[i];
    }
  }
}

// One block per row: out[r, i] = act(gate[r, i]) * up[r, i], act rounded to scalar_t first (torch:
// F.silu(gate) * up, two ops). ACT 0: silu, x / (1 + exp(-x)); ACT 1: gelu with the tanh
// approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float32 as torch computes both.
template <typename scalar_t, int ACT>
__global__ void act_and_mul_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ gate_up,
                                   const int inter, const long long in_stride, const long long out_stride) {
  using pagedrun::from_float;
  using pagedrun::to_float;
  const long long row = blockIdx.x;
  const scalar_t* gate = gate_up + row * in_stride;
  const scalar_t* up = gate + inter;
  scalar_t* out_row = out + row * out_stride;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = to_float(gate[i]);
    float a;
    if constexpr (ACT == 0) {
      a = g / (1.f + expf(-g));
    } else {
      const float beta = 0.7978845608028654f;  // sqrt(2 / pi)
      const float inner = beta * (g + 0.044715f * (g * g * g));
      a = 0.5f * g * (1.f + tanhf(inner));
    }
    out_row[i] = from_float<scalar_t>(__fmul_rn(pagedrun::fused::round_to<scalar_t>(a), to_float(up[i])));
  }
}
