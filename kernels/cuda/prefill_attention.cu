// Varlen paged prefill attention: one launch per layer for every prefilling sequence of a step, each
// query tile reading its sequence's keys and values in place from the paged cache (prefix hits need no
// gather). See docs/design/cuda-kernels.md ("Prefill") for the mapping drawn out.
//
//   out          [num_tokens, num_heads, HEAD_SIZE]      (contiguous; only the tiles' rows are written)
//   q            [num_tokens, num_heads, HEAD_SIZE]      (row stride q_stride, each row's heads packed)
//   key_cache    [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]   (the model dtype: no quantized cache)
//   value_cache  [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
//   block_tables [num_seqs, max_num_blocks_per_seq] int32 (the step's rows, one per sequence)
//   tiles        [num_tiles, 4] int32: {block-table row, first token, queries (1..TILE_Q), the first
//                query's absolute position}; the host builds it once per step (paged_step.prefill_tiles)
//   window / softcap / sinks as paged_attention.cu defines them: the query at position p sees the keys
//                (p - window, p] (window 0: all of [0, p]), each logit capped, head h's sink one more
//                logit of its softmax with a zero value vector.
//
// Grid (num_heads / GROUP, num_tiles); NUM_THREADS (128) threads = 4 warps. This step's K/V are in the
// cache already (reshape_and_cache runs first), so query j of a tile, at position pos0 + j, attends to
// cache positions [first_key(pos0 + j), pos0 + j] through the block table: causality and the prefix
// come from the positions alone, as for the decode kernels' pseudo-sequences, but a tile of TILE_Q
// queries x GROUP query heads (ROWS rows) shares every key and value row it loads.
// Rules that keep it emulatable: as paged_attention.cu's (docs/design/emulator.md).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kv_cache_dtype.cuh"
#include "attention_common.cuh"

namespace pagedrun {

// Keys per step of the key loop: one per lane of a warp, so one warp holds a row's logits of a chunk
// in registers (one logit per lane). A chunk is 32 / BLOCK_SIZE whole cache blocks.
constexpr int PREFILL_CHUNK = PR_WARP_SIZE;

// Dynamic shared memory, in floats (the host's kernels.prefill_shared_mem is the same sum):
//   q      [ROWS][HEAD_SIZE]              the tile's queries, fp32
//   k      [CHUNK][HEAD_SIZE + 1]         padded: lane t reads row t, conflict-free across the warp
//   v      [CHUNK][HEAD_SIZE]
//   p      [ROWS][CHUNK]                  a chunk's softmax weights (unnormalised)
//   m, l, alpha [ROWS] each               running max, running sum, this chunk's rescale factor
template <int HEAD_SIZE, int ROWS>
struct PrefillSmem {
  static constexpr int K_STRIDE = HEAD_SIZE + 1;
  static constexpr int Q = 0;
  static constexpr int K = Q + ROWS * HEAD_SIZE;
  static constexpr int V = K + PREFILL_CHUNK * K_STRIDE;
  static constexpr int P = V + PREFILL_CHUNK * HEAD_SIZE;
  static constexpr int M = P + ROWS * PREFILL_CHUNK;
  static constexpr int L = M + ROWS;
  static constexpr int ALPHA = L + ROWS;
  static constexpr int TOTAL = ALPHA + ROWS;
};

}  // namespace pagedrun

// Flash-attention style online softmax with fp32 accumulators. Per chunk of 32 keys (three barriers):
//  1. the chunk's K/V rows -> shared memory (fp32); rows outside [the tile's first key, its last query's
//     position] are zeros, never loaded: below lie placeholders (sliding window) or keys no query of the
//     tile sees, above lie unwritten slots (any bits, NaN included; 0 * NaN would poison the sums).
//  2. warp w takes rows w, w + 4, ...: lane t computes the logits of key t for all of them (one read of
//     the key row, q broadcast from shared memory), then row by row caps each, masks it (causal, window)
//     by select, and the warp folds max and sum by shuffles: m' = max(m, chunk max),
//     p_t = exp(l_t - m'), alpha = exp(m - m'), l = l * alpha + sum p.
//  3. thread i owns output elements i, i + 128, ... of the tile's [ROWS][HEAD_SIZE]: acc = acc * alpha +
//     sum_t p_t * v_t.
// At the end out = acc / l; with a sink, M = max(m, sink), out = acc e^(m - M) / (l e^(m - M) + e^(sink - M)),
// as the decode kernels fold it in. Row r is query r / GROUP of the tile and head head0 + r % GROUP, so a
// query's GROUP heads are adjacent in q and in out.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int TILE_Q, int GROUP>
__global__ void PR_LAUNCH_BOUNDS(NUM_THREADS) paged_prefill_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
    const scalar_t* __restrict__ v_cache, const int num_kv_heads, const float scale,
    const int* __restrict__ block_tables, const int* __restrict__ tiles, const int max_num_blocks_per_seq,
    const int q_stride, const int window, const float softcap, const float* __restrict__ sinks) {
  using namespace pagedrun;
  constexpr int NUM_WARPS = NUM_THREADS / PR_WARP_SIZE;
  constexpr int ROWS = TILE_Q * GROUP;
  constexpr int CHUNK = PREFILL_CHUNK;
  using S = PrefillSmem<HEAD_SIZE, ROWS>;
  static_assert(NUM_THREADS % PR_WARP_SIZE == 0, "whole warps only");
  static_assert(BLOCK_SIZE <= CHUNK && CHUNK % BLOCK_SIZE == 0, "a chunk holds whole cache blocks");
  static_assert(TILE_Q >= 1 && GROUP >= 1, "at least one query and one head per block");
  constexpr int VEC = 16 / sizeof(scalar_t);
  static_assert(HEAD_SIZE % VEC == 0, "head_size * sizeof(dtype) must be a multiple of 16");
  constexpr int VECS_PER_ROW = HEAD_SIZE / VEC;
  constexpr int ELEMS = PR_DIV_UP(ROWS * HEAD_SIZE, NUM_THREADS);  // output elements per thread
  constexpr int ROWS_PER_WARP = PR_DIV_UP(ROWS, NUM_WARPS);
  constexpr bool ONE_COLUMN = NUM_THREADS % HEAD_SIZE == 0;  // a thread's output elements share a column

  const int head0 = blockIdx.x * GROUP;
  const int num_heads = gridDim.x * GROUP;
  const int* tile = tiles + 4 * (long long)blockIdx.y;
  const int* block_table = block_tables + (long long)tile[0] * max_num_blocks_per_seq;
  const int token0 = tile[1];
  const int num_q = tile[2];
  const int pos0 = tile[3];
  const int last_pos = pos0 + num_q - 1;
  const int first_key = window_first_key(pos0 + 1, window);  // the tile's first query sees the lowest keys
  const int thread_idx = threadIdx.x;
  const int warp_idx = thread_idx / PR_WARP_SIZE;
  const int lane = thread_idx % PR_WARP_SIZE;
  const int kv_head_idx = head0 / (num_heads / num_kv_heads);  // GROUP divides heads per KV head (host)
  const long long kv_token_stride = (long long)num_kv_heads * HEAD_SIZE;
  const long long kv_block_stride = kv_token_stride * BLOCK_SIZE;

  extern __shared__ float shared_mem[];
  float* q_smem = shared_mem + S::Q;
  float* k_smem = shared_mem + S::K;
  float* v_smem = shared_mem + S::V;
  float* p_smem = shared_mem + S::P;
  float* m_smem = shared_mem + S::M;
  float* l_smem = shared_mem + S::L;
  float* alpha_smem = shared_mem + S::ALPHA;

  // ---- the tile's queries -> shared memory (fp32); rows past the tile's queries are zeros ----
  for (int i = thread_idx; i < ROWS * VECS_PER_ROW; i += NUM_THREADS) {
    const int r = i / VECS_PER_ROW, c = i - r * VECS_PER_ROW;
    const int qi = r / GROUP;
    float* dst = q_smem + r * HEAD_SIZE + c * VEC;
    if (qi < num_q) {
      const Packed<scalar_t, VEC> qv = *reinterpret_cast<const Packed<scalar_t, VEC>*>(
          q + (long long)(token0 + qi) * q_stride + (long long)(head0 + r - qi * GROUP) * HEAD_SIZE + c * VEC);
      PR_UNROLL
      for (int e = 0; e < VEC; e++) dst[e] = to_float(qv.v[e]);
    } else {
      PR_UNROLL
      for (int e = 0; e < VEC; e++) dst[e] = 0.f;
    }
  }
  for (int r = thread_idx; r < ROWS; r += NUM_THREADS) {
    m_smem[r] = -PR_FLT_MAX;
    l_smem[r] = 0.f;
  }
  float acc[ELEMS];
  PR_UNROLL
  for (int k = 0; k < ELEMS; k++) acc[k] = 0.f;

  const int first_chunk = first_key / CHUNK;
  const int end_chunk = last_pos / CHUNK + 1;
  for (int chunk = first_chunk; chunk < end_chunk; chunk++) {
    const int key0 = chunk * CHUNK;
    // 1. K/V rows of the chunk (the barrier also orders the previous chunk's PV reads before these writes)
    __syncthreads();
    for (int i = thread_idx; i < CHUNK * VECS_PER_ROW; i += NUM_THREADS) {
      const int t = i / VECS_PER_ROW, c = i - t * VECS_PER_ROW;
      const int key = key0 + t;
      float kf[VEC], vf[VEC];
      if ((unsigned)(key - first_key) <= (unsigned)(last_pos - first_key)) {
        const long long base = block_table[key / BLOCK_SIZE] * kv_block_stride + (key % BLOCK_SIZE) * kv_token_stride +
                               kv_head_idx * HEAD_SIZE + c * VEC;
        const Packed<scalar_t, VEC> kv = *reinterpret_cast<const Packed<scalar_t, VEC>*>(k_cache + base);
        const Packed<scalar_t, VEC> vv = *reinterpret_cast<const Packed<scalar_t, VEC>*>(v_cache + base);
        PR_UNROLL
        for (int e = 0; e < VEC; e++) {
          kf[e] = to_float(kv.v[e]);
          vf[e] = to_float(vv.v[e]);
        }
      } else {
        PR_UNROLL
        for (int e = 0; e < VEC; e++) kf[e] = vf[e] = 0.f;
      }
      PR_UNROLL
      for (int e = 0; e < VEC; e++) {
        k_smem[t * S::K_STRIDE + c * VEC + e] = kf[e];
        v_smem[t * HEAD_SIZE + c * VEC + e] = vf[e];
      }
    }
    __syncthreads();

    // 2. logits and the online softmax: warp w takes rows w, w + NUM_WARPS, ..., a key per lane. Each
    //    lane reads its key row once per element for all the warp's rows (q is a broadcast read).
    float dots[ROWS_PER_WARP];
    PR_UNROLL
    for (int j = 0; j < ROWS_PER_WARP; j++) dots[j] = 0.f;
    for (int d = 0; d < HEAD_SIZE; d++) {
      const float kd = k_smem[lane * S::K_STRIDE + d];
      PR_UNROLL
      for (int j = 0; j < ROWS_PER_WARP; j++) {
        const int r = warp_idx + j * NUM_WARPS;
        if (ROWS % NUM_WARPS == 0 || r < ROWS) dots[j] += q_smem[r * HEAD_SIZE + d] * kd;
      }
    }
    PR_UNROLL
    for (int j = 0; j < ROWS_PER_WARP; j++) {
      const int r = warp_idx + j * NUM_WARPS;
      if (ROWS % NUM_WARPS != 0 && r >= ROWS) break;  // uniform across the warp: its shuffles stay whole
      const int qi = r / GROUP;
      const int pos = pos0 + qi;
      const int key = key0 + lane;
      const int row_first = window_first_key(pos + 1, window);
      // Causal and window in one unsigned range check (a key below row_first wraps around); rows past
      // the tile's queries see nothing.
      const bool valid = qi < num_q && (unsigned)(key - row_first) <= (unsigned)(pos - row_first);
      const float logit = valid ? soft_cap(dots[j] * scale, softcap) : -PR_FLT_MAX;
      const float m_old = m_smem[r];
      float chunk_max = logit;
      PR_UNROLL
      for (int mask = PR_WARP_SIZE / 2; mask >= 1; mask /= 2) {
        chunk_max = fmaxf(chunk_max, __shfl_xor_sync(PR_FULL_MASK, chunk_max, mask));
      }
      const float m_new = fmaxf(m_old, chunk_max);
      // Masked keys weigh exactly 0 by select; a row with nothing valid yet keeps m = -FLT_MAX, l = 0.
      const float p = valid ? fast_exp(logit - m_new) : 0.f;
      float sum = p;
      PR_UNROLL
      for (int mask = PR_WARP_SIZE / 2; mask >= 1; mask /= 2) sum += __shfl_xor_sync(PR_FULL_MASK, sum, mask);
      p_smem[r * CHUNK + lane] = p;
      __syncwarp();  // every lane has read m_smem[r] (m_old) before lane 0 rewrites it
      if (lane == 0) {
        const float alpha = fast_exp(m_old - m_new);  // 0 when m_old is -FLT_MAX and m_new a logit
        alpha_smem[r] = alpha;
        m_smem[r] = m_new;
        l_smem[r] = l_smem[r] * alpha + sum;
      }
    }
    __syncthreads();

    // 3. PV: thread i owns elements i, i + NUM_THREADS, ... of [ROWS][HEAD_SIZE]. Where NUM_THREADS is a
    //    multiple of HEAD_SIZE they all lie in one column, so each value element is read once for all.
    PR_UNROLL
    for (int k = 0; k < ELEMS; k++) {
      const int e = thread_idx + k * NUM_THREADS;
      if (ROWS * HEAD_SIZE % NUM_THREADS == 0 || e < ROWS * HEAD_SIZE) acc[k] *= alpha_smem[e / HEAD_SIZE];
    }
    for (int t = 0; t < CHUNK; t++) {
      const float vt = ONE_COLUMN ? v_smem[t * HEAD_SIZE + thread_idx % HEAD_SIZE] : 0.f;
      PR_UNROLL
      for (int k = 0; k < ELEMS; k++) {
        const int e = thread_idx + k * NUM_THREADS;
        if (ROWS * HEAD_SIZE % NUM_THREADS == 0 || e < ROWS * HEAD_SIZE) {
          const int r = e / HEAD_SIZE;
          acc[k] += p_smem[r * CHUNK + t] * (ONE_COLUMN ? vt : v_smem[t * HEAD_SIZE + e - r * HEAD_SIZE]);
        }
      }
    }
  }
  // m and l were last written before the loop's last barrier: every thread sees them.
  PR_UNROLL
  for (int k = 0; k < ELEMS; k++) {
    const int e = thread_idx + k * NUM_THREADS;
    if (ROWS * HEAD_SIZE % NUM_THREADS == 0 || e < ROWS * HEAD_SIZE) {
      const int r = e / HEAD_SIZE, d = e - r * HEAD_SIZE;
      const int qi = r / GROUP;
      if (qi < num_q) {
        const int h = head0 + r - qi * GROUP;
        const float m = m_smem[r];
        float l = l_smem[r], a = acc[k];
        if (sinks != nullptr) {  // uniform across the launch
          const float top = fmaxf(m, sinks[h]);
          const float c = fast_exp(m - top);
          a *= c;
          l = l * c + fast_exp(sinks[h] - top);
        }
        // l >= 1: the row's maximal logit (or its sink) contributes exp(0); each query sees its own key.
        out[((long long)(token0 + qi) * num_heads + h) * HEAD_SIZE + d] = from_float<scalar_t>(a / l);
      }
    }
  }
}
