// Paged decode attention (vLLM's paged_attention_v1 / v2 + reduce), rewritten for pagedrun's cache
// layout and for three consumers: nvcc (compile gates), NVRTC through cupy.RawModule (GPU), and the
// CUDA-on-CPU emulator (tests). See docs/design/cuda-kernels.md for the thread mapping drawn out.
//
//   query        [num_seqs, num_heads, head_size]          (row stride q_stride)
//   key_cache    [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]   (cache_t: see kv_cache_dtype.cuh)
//   value_cache  [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
//   k_scales / v_scales  fp8: [1]; int8: [num_blocks, BLOCK_SIZE, num_kv_heads]; unquantized: unused
//   block_tables [num_seqs, max_num_blocks_per_seq] int32, seq_lens [num_seqs] int32
//   out          [num_seqs, num_heads, head_size]
//   window       sliding window (0: off): the query (position seq_len - 1) sees keys [seq_len - window, seq_len)
//   softcap      logit soft-capping (0: off): logit = softcap * tanh(scale * q.k / softcap)
//   sinks        attention sinks (GPT-OSS; nullptr: off): float32 [num_heads], head h's sink one more
//                logit in its softmax, with a zero value vector
//
// Grid (num_heads, num_seqs[, max_num_partitions]); NUM_THREADS (128) threads = 4 warps.
// Rules that keep this file emulatable (docs/design/cuda-kernels.md, docs/design/emulator.md): dynamic shared memory only
// as `extern __shared__`, nothing read from shared memory before it is written, every *_sync
// collective called by all 32 lanes from one site with the full mask, __syncthreads only in
// block-uniform control flow, no inline PTX, only NVRTC-provided headers.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kv_cache_dtype.cuh"
#include "attention_common.cuh"

namespace pagedrun {

// One thread block computes one (GROUP query heads, sequence, partition). PARTITION_SIZE == 0: the
// whole sequence (v1). GROUP > 1 (GQA): the block's query heads share one KV head, so every K/V row
// it loads serves GROUP heads (one block per query head read each KV head GROUP times); GROUP == 1
// is vLLM's one block per query head.
//
// QK phase: warp w takes blocks w, w + NUM_WARPS, ...; inside a warp, a thread group of
// THREAD_GROUP_SIZE = max(32 / BLOCK_SIZE, 1) lanes takes one token of the block, each lane holding
// every THREAD_GROUP_SIZE-th vector of the key row so a group reads 16 contiguous bytes per step.
// Softmax: fp32 logits in dynamic shared memory, a row of `logits_stride` per query head,
// block-wide max/sum by warp shuffles.
// PV phase: the key row is contiguous in this layout, so a lane owns V_VEC_SIZE head elements
// (one 16-byte load) of one token; a warp covers TOKENS_PER_ITER tokens of a block at once, lanes
// with the same head slice are folded by xor-shuffles, warps by shared memory.
// A quantized cache (KV_DTYPE != kAuto) has 1-byte elements, so the same 16-byte loads carry twice
// (fp16/bf16) or four times (fp32) the elements; rows are dequantized to float in registers.
//
// Sliding window: the key loop starts at the block holding the window's first key, so blocks wholly
// below the window are never read (the hybrid KV manager leaves placeholders there, any contents);
// keys of that first block below the window are masked like keys past the end. v2's grid partitions
// are absolute 512-token partitions counted from the one holding the window's first key (z index 0),
// so a launch covers only the window (paged_attention_v2_reduce_kernel counts them the same way).
//
// Attention sinks: the sink joins the softmax of the whole window once. v1 raises the block's max to
// the sink and adds exp(sink - max) to the exp-sum before normalising; v2's partitions know nothing
// of it (each would add it again) and the reduce adds it to the global max and exp-sum instead.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE,
          KvCacheDtype KV_DTYPE, int GROUP>
__device__ inline void paged_attention_body(
    float* __restrict__ exp_sums,        // [num_seqs, num_heads, max_num_partitions] (v2 only)
    float* __restrict__ max_logits,      // [num_seqs, num_heads, max_num_partitions] (v2 only)
    scalar_t* __restrict__ out,          // v1: [num_seqs, num_heads, HEAD_SIZE]
    float* __restrict__ tmp_out,         // v2: [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    const scalar_t* __restrict__ q, const kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ k_cache,
    const kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ v_cache, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, const int num_kv_heads, const float scale,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int max_num_blocks_per_seq, const int q_stride, const int window, const float softcap,
    const float* __restrict__ sinks) {
  using cache_t = kv_cache_t<scalar_t, KV_DTYPE>;
  constexpr bool USE_PARTITIONING = PARTITION_SIZE > 0;
  constexpr int NUM_WARPS = NUM_THREADS / PR_WARP_SIZE;
  static_assert(NUM_THREADS % PR_WARP_SIZE == 0, "whole warps only");
  static_assert(BLOCK_SIZE <= PR_WARP_SIZE && PR_WARP_SIZE % BLOCK_SIZE == 0,
                "one warp covers whole cache blocks");
  static_assert(!USE_PARTITIONING || PARTITION_SIZE % BLOCK_SIZE == 0, "partitions hold whole blocks");
  static_assert(GROUP >= 1, "at least one query head per block");

  const int head0 = blockIdx.x * GROUP;  // the block's first query head
  const int num_heads = gridDim.x * GROUP;
  const int seq_idx = blockIdx.y;
  const int partition_idx = blockIdx.z;
  const int max_num_partitions = gridDim.z;
  const int seq_len = seq_lens[seq_idx];
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / PR_WARP_SIZE;
  const int lane = thread_idx % PR_WARP_SIZE;

  // Block-uniform early exits (before any barrier).
  const int first_key = window_first_key(seq_len, window);
  const int num_seq_blocks = PR_DIV_UP(seq_len, BLOCK_SIZE);
  const int first_block = first_key / BLOCK_SIZE;
  constexpr int BLOCKS_PER_PARTITION = USE_PARTITIONING ? PARTITION_SIZE / BLOCK_SIZE : 1;
  // v2: grid partition z is absolute partition first_key / PARTITION_SIZE + z (v1: the whole window;
  // its PARTITION_SIZE is 0, hence pr_max: the untaken division must still compile without a warning).
  const int partition_block0 =
      USE_PARTITIONING ? (first_key / pr_max(PARTITION_SIZE, 1) + partition_idx) * BLOCKS_PER_PARTITION : first_block;
  if (USE_PARTITIONING && partition_block0 >= num_seq_blocks) return;  // past the end: nothing to do
  if (seq_len <= 0) {  // empty sequence (padding row): a defined zero output instead of 0/0
    for (int i = thread_idx; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {
      out[((long long)seq_idx * num_heads + head0) * HEAD_SIZE + i] = from_float<scalar_t>(0.f);
    }
    return;
  }

  // The first partition may begin below the window: start at the window's first block.
  const int start_block_idx = pr_max(partition_block0, first_block);
  const int end_block_idx = USE_PARTITIONING ? pr_min(partition_block0 + BLOCKS_PER_PARTITION, num_seq_blocks)
                                             : num_seq_blocks;
  const int start_token_idx = start_block_idx * BLOCK_SIZE;
  const int end_token_idx = pr_min(end_block_idx * BLOCK_SIZE, seq_len);
  const int num_tokens = end_token_idx - start_token_idx;
  // Logits of the first block's keys below the window are never read: the softmax starts past them.
  const int first_logit = pr_max(first_key - start_token_idx, 0);
  // One query head's logits row: a partition, or (v1) the window's blocks (the host sizes both).
  const int logits_stride = USE_PARTITIONING ? PARTITION_SIZE : (num_seq_blocks - first_block) * BLOCK_SIZE;

  const int num_queries_per_kv = num_heads / num_kv_heads;
  const int kv_head_idx = head0 / num_queries_per_kv;  // GROUP divides num_queries_per_kv (host)
  const long long kv_token_stride = (long long)num_kv_heads * HEAD_SIZE;
  const long long kv_block_stride = kv_token_stride * BLOCK_SIZE;

  // ---- q (GROUP heads, contiguous in the row) -> shared memory (fp32), read by every thread group ----
  constexpr int Q_VEC_SIZE = 16 / sizeof(scalar_t);
  static_assert(HEAD_SIZE % Q_VEC_SIZE == 0, "head_size * sizeof(dtype) must be a multiple of 16");
  constexpr int NUM_Q_VECS = GROUP * HEAD_SIZE / Q_VEC_SIZE;
  __shared__ float q_smem[GROUP * HEAD_SIZE];
  __shared__ float red_smem[2 * NUM_WARPS * GROUP];
  const scalar_t* q_ptr = q + (long long)seq_idx * q_stride + head0 * HEAD_SIZE;
  for (int i = thread_idx; i < NUM_Q_VECS; i += NUM_THREADS) {
    const Packed<scalar_t, Q_VEC_SIZE> qv = *reinterpret_cast<const Packed<scalar_t, Q_VEC_SIZE>*>(
        q_ptr + i * Q_VEC_SIZE);
    PR_UNROLL
    for (int e = 0; e < Q_VEC_SIZE; e++) q_smem[i * Q_VEC_SIZE + e] = to_float(qv.v[e]);
  }
  __syncthreads();

  // fp32 logits [GROUP][logits_stride]; reused below for the cross-warp output reduction.
  extern __shared__ float shared_mem[];
  float* logits = shared_mem;

  // ---- QK: one token per thread group, GROUP dot products per key row loaded ----
  constexpr int THREAD_GROUP_SIZE = pr_max(PR_WARP_SIZE / BLOCK_SIZE, 1);
  constexpr int VEC_SIZE = pr_max(16 / (THREAD_GROUP_SIZE * (int)sizeof(cache_t)), 1);
  static_assert(HEAD_SIZE % (THREAD_GROUP_SIZE * VEC_SIZE) == 0, "head_size must split over a group");
  constexpr int NUM_VECS_PER_THREAD = HEAD_SIZE / (THREAD_GROUP_SIZE * VEC_SIZE);
  // At most 64 key elements per chunk (32 from a quantized cache, whose conversion needs registers of
  // its own: sm_80 converts fp8 in software): a 1-byte cache packs 16 per load, and 8 such loads
  // converted at once held 160+ registers (block 32). Unquantized variants never reach the cap.
  // A grouped block reads GROUP query values per key element: at most 64 / GROUP key elements per
  // chunk, so that the chunks loop (unroll 1) and their query reads stay inside it; with whole rows
  // in one chunk, nvcc hoisted every query value out of the block loop (block 32, head 64, group 4:
  // 255 registers and 200+ bytes of spill on sm_80).
  constexpr int K_CHUNK_ELEMS = (KV_DTYPE == KvCacheDtype::kAuto ? PR_K_CHUNK_ELEMS : PR_K_CHUNK_ELEMS / 2) / GROUP;
  constexpr int K_CHUNK_MAX = pr_min(8, pr_max(K_CHUNK_ELEMS / VEC_SIZE, 1));
  constexpr int K_CHUNK = NUM_VECS_PER_THREAD % 8 == 0 && K_CHUNK_MAX >= 8 ? 8
                          : NUM_VECS_PER_THREAD % 4 == 0 && K_CHUNK_MAX >= 4 ? 4
                          : NUM_VECS_PER_THREAD % 2 == 0 ? 2 : 1;
  const int group_in_warp = lane / THREAD_GROUP_SIZE;  // == token offset inside the cache block
  const int thread_group_offset = lane % THREAD_GROUP_SIZE;
  const int* block_table = block_tables + (long long)seq_idx * max_num_blocks_per_seq;

  float qk_max[GROUP];
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) qk_max[g] = -PR_FLT_MAX;
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const long long physical_block_number = block_table[block_idx];
    const int physical_block_offset = group_in_warp;
    const int token_idx = block_idx * BLOCK_SIZE + physical_block_offset;
    const cache_t* k_ptr = k_cache + physical_block_number * kv_block_stride +
                            physical_block_offset * kv_token_stride + kv_head_idx * HEAD_SIZE;
    float qk[GROUP];
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) qk[g] = 0.f;
    // Chunks of K_CHUNK loads in flight: fully unrolled, a 256-wide row held by one lane (block 32)
    // would keep 64+ registers of key live and spill.
    PR_NO_UNROLL
    for (int j0 = 0; j0 < NUM_VECS_PER_THREAD; j0 += K_CHUNK) {
      PR_UNROLL
      for (int j = j0; j < j0 + K_CHUNK; j++) {
        const int elem = (thread_group_offset + j * THREAD_GROUP_SIZE) * VEC_SIZE;
        const Packed<cache_t, VEC_SIZE> kv = *reinterpret_cast<const Packed<cache_t, VEC_SIZE>*>(k_ptr + elem);
        float k[VEC_SIZE];
        kv_to_float<KV_DTYPE>(k, kv.v);
        PR_UNROLL
        for (int g = 0; g < GROUP; g++) {
          PR_UNROLL
          for (int e = 0; e < VEC_SIZE; e++) qk[g] += q_smem[g * HEAD_SIZE + elem + e] * k[e];
        }
      }
    }
    // The key row's dequantization scale rides on the softmax scale (one multiply per token).
    const float qk_scale = scale * kv_row_scale<KV_DTYPE>(k_scales, physical_block_number * BLOCK_SIZE +
                                                          physical_block_offset, num_kv_heads, kv_head_idx);
    // Past the end or below the window, as one unsigned range check (a key below wraps around).
    const bool masked = (unsigned)(token_idx - first_key) >= (unsigned)(seq_len - first_key);
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) {
      // Fold the group's partial dots; all 32 lanes take part, every lane ends with its group's dot.
      PR_UNROLL
      for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2) {
        qk[g] += __shfl_xor_sync(PR_FULL_MASK, qk[g], mask);
      }
      const float logit = qk[g] * qk_scale;  // soft-capped in the softmax below
      if (thread_group_offset == 0) {
        // Masked keys may hold anything (even NaN): the select drops them, logit := 0.
        logits[g * logits_stride + token_idx - start_token_idx] = masked ? 0.f : logit;
        qk_max[g] = masked ? qk_max[g] : fmaxf(qk_max[g], logit);
      }
    }
  }
  // Lanes with thread_group_offset == 0 hold the maxima; xor masks >= THREAD_GROUP_SIZE combine them.
  block_max_n<NUM_WARPS, THREAD_GROUP_SIZE, GROUP>(qk_max, red_smem, warp_idx, lane);
  // Soft-capping is monotonic, so the capped maximum is the cap of the raw one: capping here rather
  // than in the QK loop keeps tanhf out of its registers (the grouped kernels spilled) and gives the
  // maximal logit exactly exp(0) as before.
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) qk_max[g] = soft_cap(qk_max[g], softcap);
  // v1's sink: the max over the keys and the sink (a uniform branch: one argument for the launch).
  // v2 passes nullptr: its reduce adds the sink once for all the partitions.
  if (!USE_PARTITIONING && sinks != nullptr) {
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) qk_max[g] = fmaxf(qk_max[g], sinks[head0 + g]);
  }

  float exp_sum[GROUP];
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) {
    exp_sum[g] = 0.f;
    for (int i = first_logit + thread_idx; i < num_tokens; i += NUM_THREADS) {
      const float val = fast_exp(soft_cap(logits[g * logits_stride + i], softcap) - qk_max[g]);
      logits[g * logits_stride + i] = val;
      exp_sum[g] += val;
    }
  }
  block_sum_n<NUM_WARPS, GROUP>(exp_sum, red_smem + NUM_WARPS * GROUP, warp_idx, lane);
  if (!USE_PARTITIONING && sinks != nullptr) {  // every thread holds the block's sums: each adds it
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) exp_sum[g] += fast_exp(sinks[head0 + g] - qk_max[g]);
  }
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) {
    // exp_sum >= 1: the maximal logit (or v1's sink) contributes exp(0) (each launched partition holds
    // a window key).
    const float inv_sum = 1.f / exp_sum[g];
    for (int i = first_logit + thread_idx; i < num_tokens; i += NUM_THREADS) {
      logits[g * logits_stride + i] *= inv_sum;
    }
  }
  __syncthreads();

  if (USE_PARTITIONING && thread_idx < GROUP) {
    const long long idx = ((long long)seq_idx * num_heads + head0 + thread_idx) * max_num_partitions + partition_idx;
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) {  // registers are indexed by constants only: select, do not index
      if (g == thread_idx) {
        max_logits[idx] = qk_max[g];
        exp_sums[idx] = exp_sum[g];
      }
    }
  }

  // ---- PV: a lane owns V_VEC_SIZE head elements of one token, for each of the GROUP heads ----
  constexpr int V_VEC_SIZE = 16 / sizeof(cache_t);
  constexpr int NUM_V_VECS = HEAD_SIZE / V_VEC_SIZE;
  constexpr int V_LANES_PER_TOKEN = pr_min(next_pow2(NUM_V_VECS), PR_WARP_SIZE);
  constexpr int TOKENS_PER_ITER = PR_WARP_SIZE / V_LANES_PER_TOKEN;
  constexpr int V_VECS_PER_LANE = PR_DIV_UP(NUM_V_VECS, V_LANES_PER_TOKEN);
  const int v_lane = lane % V_LANES_PER_TOKEN;
  const int token_sub = lane / V_LANES_PER_TOKEN;

  float accs[GROUP][V_VECS_PER_LANE][V_VEC_SIZE];
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) {
    PR_UNROLL
    for (int r = 0; r < V_VECS_PER_LANE; r++) {
      PR_UNROLL
      for (int e = 0; e < V_VEC_SIZE; e++) accs[g][r][e] = 0.f;
    }
  }

  // A lane's rows of one cache block are loaded V_BATCH at a time before any is used, so that many
  // loads are in flight; with a branch around each row (skipping rows past seq_len) nvcc issued them
  // one at a time, a full memory latency per row. Rows past seq_len are read (they lie inside the
  // sequence's last block, so inside the cache) and zeroed by a select: 0 * NaN garbage would not be.
  constexpr int V_ITERS = pr_max(BLOCK_SIZE / TOKENS_PER_ITER, 1);
  constexpr int V_BATCH = pr_min(V_ITERS, PR_V_BATCH);
  static_assert(V_ITERS % V_BATCH == 0, "whole batches of rows");
  for (int block_idx = start_block_idx + warp_idx; block_idx < end_block_idx; block_idx += NUM_WARPS) {
    const long long physical_block_number = block_table[block_idx];
    const cache_t* v_block = v_cache + physical_block_number * kv_block_stride + kv_head_idx * HEAD_SIZE;
    PR_NO_UNROLL
    for (int i0 = 0; i0 < V_ITERS; i0 += V_BATCH) {
      Packed<cache_t, V_VEC_SIZE> vv[V_BATCH][V_VECS_PER_LANE];
      PR_UNROLL
      for (int b = 0; b < V_BATCH; b++) {
        const int t = token_sub + (i0 + b) * TOKENS_PER_ITER;
        PR_UNROLL
        for (int r = 0; r < V_VECS_PER_LANE; r++) {
          const int vec = v_lane + r * V_LANES_PER_TOKEN;
          if (t < BLOCK_SIZE && vec < NUM_V_VECS) {
            vv[b][r] = *reinterpret_cast<const Packed<cache_t, V_VEC_SIZE>*>(v_block + t * kv_token_stride +
                                                                               vec * V_VEC_SIZE);
          }
        }
      }
      PR_UNROLL
      for (int b = 0; b < V_BATCH; b++) {
        const int t = token_sub + (i0 + b) * TOKENS_PER_ITER;
        const int token_idx = block_idx * BLOCK_SIZE + t;
        const bool valid = t < BLOCK_SIZE && (unsigned)(token_idx - first_key) < (unsigned)(seq_len - first_key);
        // The value row's scale rides on its softmax weight.
        const float v_scale = valid ? kv_row_scale<KV_DTYPE>(v_scales, physical_block_number * BLOCK_SIZE + t,
                                                             num_kv_heads, kv_head_idx) : 0.f;
        float p[GROUP];
        PR_UNROLL
        for (int g = 0; g < GROUP; g++) {
          p[g] = valid ? logits[g * logits_stride + token_idx - start_token_idx] * v_scale : 0.f;
        }
        PR_UNROLL
        for (int r = 0; r < V_VECS_PER_LANE; r++) {
          const int vec = v_lane + r * V_LANES_PER_TOKEN;
          if (vec < NUM_V_VECS) {
            float v[V_VEC_SIZE];
            kv_to_float<KV_DTYPE>(v, vv[b][r].v);
            PR_UNROLL
            for (int e = 0; e < V_VEC_SIZE; e++) v[e] = valid ? v[e] : 0.f;
            PR_UNROLL
            for (int g = 0; g < GROUP; g++) {
              PR_UNROLL
              for (int e = 0; e < V_VEC_SIZE; e++) accs[g][r][e] += p[g] * v[e];
            }
          }
        }
      }
    }
  }

  // Lanes that share v_lane differ by multiples of V_LANES_PER_TOKEN: fold them by xor-shuffles.
  PR_UNROLL
  for (int g = 0; g < GROUP; g++) {
    PR_UNROLL
    for (int r = 0; r < V_VECS_PER_LANE; r++) {
      PR_UNROLL
      for (int e = 0; e < V_VEC_SIZE; e++) {
        float acc = accs[g][r][e];
        PR_UNROLL
        for (int mask = PR_WARP_SIZE / 2; mask >= V_LANES_PER_TOKEN; mask /= 2) {
          acc += __shfl_xor_sync(PR_FULL_MASK, acc, mask);
        }
        accs[g][r][e] = acc;
      }
    }
  }

  // Cross-warp reduction through shared memory: the logits are dead once every warp is past PV.
  __syncthreads();
  float* out_smem = shared_mem;  // [NUM_WARPS][GROUP][HEAD_SIZE]
  if (token_sub == 0) {
    PR_UNROLL
    for (int g = 0; g < GROUP; g++) {
      PR_UNROLL
      for (int r = 0; r < V_VECS_PER_LANE; r++) {
        const int vec = v_lane + r * V_LANES_PER_TOKEN;
        if (vec < NUM_V_VECS) {
          PR_UNROLL
          for (int e = 0; e < V_VEC_SIZE; e++) {
            out_smem[(warp_idx * GROUP + g) * HEAD_SIZE + vec * V_VEC_SIZE + e] = accs[g][r][e];
          }
        }
      }
    }
  }
  __syncthreads();
  for (int i = thread_idx; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {  // i = g * HEAD_SIZE + element
    float acc = 0.f;
    PR_UNROLL
    for (int w = 0; w < NUM_WARPS; w++) acc += out_smem[w * GROUP * HEAD_SIZE + i];
    if (USE_PARTITIONING) {
      const int g = i / HEAD_SIZE;
      tmp_out[(((long long)seq_idx * num_heads + head0 + g) * max_num_partitions + partition_idx) *
                  HEAD_SIZE + i - g * HEAD_SIZE] = acc;
    } else {
      out[((long long)seq_idx * num_heads + head0) * HEAD_SIZE + i] = from_float<scalar_t>(acc);
    }
  }
}

}  // namespace pagedrun

// Dynamic shared memory (bytes): 4 * GROUP * max(padded tokens of one block/partition,
// NUM_WARPS * HEAD_SIZE). Grid (num_heads / GROUP, num_seqs, 1). KV_DTYPE and GROUP last and
// defaulted (vLLM's order), so the unquantized one-head-per-block kernels keep their names.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS,
          pagedrun::KvCacheDtype KV_DTYPE = pagedrun::KvCacheDtype::kAuto, int GROUP = 1>
__global__ void PR_LAUNCH_BOUNDS(NUM_THREADS) paged_attention_v1_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q,
    const pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ k_cache,
    const pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ v_cache, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, const int num_kv_heads, const float scale,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int max_num_blocks_per_seq, const int q_stride, const int window, const float softcap,
    const float* __restrict__ sinks) {
  pagedrun::paged_attention_body<scalar_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0, KV_DTYPE, GROUP>(
      nullptr, nullptr, out, nullptr, q, k_cache, v_cache, k_scales, v_scales, num_kv_heads, scale,
      block_tables, seq_lens, max_num_blocks_per_seq, q_stride, window, softcap, sinks);
}

// Grid (num_heads / GROUP, num_seqs, max_num_partitions); partial results are kept in fp32. With a window,
// max_num_partitions covers the longest window (z = partitions counted from the window's first key's).
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE,
          pagedrun::KvCacheDtype KV_DTYPE = pagedrun::KvCacheDtype::kAuto, int GROUP = 1>
__global__ void PR_LAUNCH_BOUNDS(NUM_THREADS) paged_attention_v2_kernel(
    float* __restrict__ exp_sums, float* __restrict__ max_logits, float* __restrict__ tmp_out,
    const scalar_t* __restrict__ q, const pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ k_cache,
    const pagedrun::kv_cache_t<scalar_t, KV_DTYPE>* __restrict__ v_cache, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, const int num_kv_heads, const float scale,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int max_num_blocks_per_seq, const int q_stride, const int window, const float softcap) {
  pagedrun::paged_attention_body<scalar_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE, KV_DTYPE, GROUP>(
      exp_sums, max_logits, nullptr, tmp_out, q, k_cache, v_cache, k_scales, v_scales, num_kv_heads, scale,
      block_tables, seq_lens, max_num_blocks_per_seq, q_stride, window, softcap, nullptr);
}

// Combine the partitions of one (head, sequence): partition i's output was normalised by its own
// exp-sum s_i at its own max m_i; with M = max_i m_i its weight is s_i * exp(m_i - M) / sum_j(...).
// Grid (num_heads, num_seqs); dynamic shared memory 2 * max_num_partitions floats. `window` as given to
// the v2 kernel: it says which partitions that kernel wrote (each of them holds a key of the window).
// sinks (nullptr: off): head h's sink joins here, once: M = max(M, sink), sum += exp(sink - M).
template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void PR_LAUNCH_BOUNDS(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out, const float* __restrict__ exp_sums,
    const float* __restrict__ max_logits, const float* __restrict__ tmp_out,
    const int* __restrict__ seq_lens, const int max_num_partitions, const int window,
    const float* __restrict__ sinks) {
  constexpr int NUM_WARPS = NUM_THREADS / PR_WARP_SIZE;
  const int num_heads = gridDim.x;
  const int head_idx = blockIdx.x;
  const int seq_idx = blockIdx.y;
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / PR_WARP_SIZE;
  const int lane = thread_idx % PR_WARP_SIZE;
  const int seq_len = seq_lens[seq_idx];
  const long long row = (long long)seq_idx * num_heads + head_idx;
  scalar_t* out_ptr = out + row * HEAD_SIZE;
  const float* tmp_ptr = tmp_out + row * max_num_partitions * HEAD_SIZE;

  if (seq_len <= 0) {
    for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) out_ptr[i] = pagedrun::from_float<scalar_t>(0.f);
    return;
  }
  const int num_partitions = PR_DIV_UP(seq_len, PARTITION_SIZE) -
                             pagedrun::window_first_key(seq_len, window) / PARTITION_SIZE;
  if (num_partitions == 1 && sinks == nullptr) {  // nothing to rescale (a sink always rescales)
    for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) {
      out_ptr[i] = pagedrun::from_float<scalar_t>(tmp_ptr[i]);
    }
    return;
  }

  __shared__ float red_smem[2 * NUM_WARPS];
  extern __shared__ float reduce_smem[];
  float* shared_max_logits = reduce_smem;                      // [max_num_partitions]
  float* shared_weights = reduce_smem + max_num_partitions;    // [max_num_partitions]
  const float* max_logits_ptr = max_logits + row * max_num_partitions;
  const float* exp_sums_ptr = exp_sums + row * max_num_partitions;

  float max_logit = -PR_FLT_MAX;
  for (int i = thread_idx; i < num_partitions; i += NUM_THREADS) {
    const float l = max_logits_ptr[i];
    shared_max_logits[i] = l;
    max_logit = fmaxf(max_logit, l);
  }
  max_logit = pagedrun::block_max<NUM_WARPS, 1>(max_logit, red_smem, warp_idx, lane);
  if (sinks != nullptr) max_logit = fmaxf(max_logit, sinks[head_idx]);  // block-uniform: after the max

  float global_exp_sum = 0.f;
  for (int i = thread_idx; i < num_partitions; i += NUM_THREADS) {
    const float w = exp_sums_ptr[i] * pagedrun::fast_exp(shared_max_logits[i] - max_logit);
    shared_weights[i] = w;
    global_exp_sum += w;
  }
  global_exp_sum = pagedrun::block_sum<NUM_WARPS>(global_exp_sum, red_smem + NUM_WARPS, warp_idx, lane);
  if (sinks != nullptr) global_exp_sum += pagedrun::fast_exp(sinks[head_idx] - max_logit);
  const float inv_global_exp_sum = 1.f / global_exp_sum;

  for (int i = thread_idx; i < HEAD_SIZE; i += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; p++) acc += tmp_ptr[p * HEAD_SIZE + i] * shared_weights[p];
    out_ptr[i] = pagedrun::from_float<scalar_t>(acc * inv_global_exp_sum);
  }
}
