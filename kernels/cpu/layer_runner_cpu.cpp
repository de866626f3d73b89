// The decoder-layer loop of pagedrun/models/llama.py and gemma.py, in one call per step.
//
// On 2 cores a decode step of the default model spent a noticeable share of its time in the Python
// between its kernels (argument checks, ctypes conversions, tensor views, empty outputs, in every
// layer: docs/log/2026-11-26-layer-runner-huge-pages.md,
// docs/log/2026-11-27-figures-from-code-comments.md). This file runs the same kernels in the
// same order with the same arguments, from C: it computes nothing of its own, so its results are
// the Python loop's bit for bit (tests/models/test_layer_runner.py). The kernels come as function
// pointers from the two libraries that export them (model_ops_cpu.cpp, paged_attention_cpu.cpp),
// picked for the dtype by pagedrun/models/layer_runner.py, which also decides when this path applies.
//
// Per layer, for T tokens (buffers [T, width], rows contiguous):
//
//   x, residual = rms_norm(h, residual)          (layer 0: residual = h, x = rms_norm(h))
//   qkv = x . Wqkv^T (+ b)                        [T, (heads + 2 kv_heads) * head_dim]
//   q, k = head_rms_norm(q), head_rms_norm(k)     Qwen3, Gemma 3 only, in place, in qkv
//   rope(q), rope(k)                              in place, in qkv; the layer's tables (Gemma 3's
//                                                 sliding layers have their own), else the model's
//   cache[slot[t]] = k[t], v[t]                    the paged KV cache
//   attn = paged attention(q, cache)              decode kernel, or varlen with prefill tokens; the
//                                                 layer's window, softcap and sinks, its group's
//                                                 block tables
//   h = attn . Wo^T (+ b)
//   h = rms_norm(h)                               Gemma only (post_attention_layernorm), in place
//   x, residual = rms_norm(h, residual)
//   mid = act(x . Wgate^T) * (x . Wup^T)          one call: SiLU (Llama) or GELU-tanh (Gemma)
//   h = mid . Wdown^T (+ b)
//   h = rms_norm(h)                               Gemma only (post_feedforward_layernorm), in place
//
// Gemma's norms are model_ops' kernels with a float32 weight holding 1 + w (the w32 variants in
// bf16), as the Python loop calls them; the runner's rms_norm and head_norm pointers are those.
// The caller adds the last h to residual in its final norm, as the Python loop's caller does.
//
// Block tables and slot mapping: the step's, for every layer; or, with the hybrid KV manager (layers
// in KV cache groups, pagedrun/attention/metadata.py: one AttentionMetadata per group), layer l's come
// from groups[layer_group[l]] (PrStep). Everything else in the step is the same for every layer.
#include <cstdint>

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using RmsNormFn = int (*)(const void* x, void* residual, const void* weight, void* out, int64_t m, int64_t h,
                          int64_t ldx, int64_t ldr, int64_t ldo, float eps, int threads);
using LinearFn = int (*)(const void* x, const void* packed, const void* bias, void* out, int64_t m, int64_t n,
                         int64_t k, int64_t ldx, int64_t ldo, int threads);
using HeadNormFn = int (*)(const void* x, const void* weight, void* out, int64_t ntok, int64_t heads,
                          int64_t head_size, int64_t ldx, int64_t ldo, float eps, int threads);
using RopeFn = int (*)(void* x, const int64_t* positions, const float* cos, const float* sin, int64_t ntok,
                       int64_t heads, int64_t head_size, int64_t ldx, int64_t max_pos, int threads);
using CacheFn = int (*)(const void* key, const void* value, void* key_cache, void* value_cache,
                        const int64_t* slot_mapping, int64_t num_tokens, int64_t row_elems, int64_t k_stride,
                        int64_t v_stride, int64_t num_slots, int64_t elem_size);
using DecodeFn = int (*)(void* out, const void* query, const void* key_cache, const void* value_cache,
                         const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs, int64_t heads,
                         int64_t kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
                         int64_t table_stride, int64_t q_stride, int64_t o_stride, float scale, int32_t window,
                         float softcap, int dtype, int threads, int kv_kind, const float* k_aux, const float* v_aux,
                         const float* sinks);
using VarlenFn = int (*)(void* out, const void* query, const void* key_cache, const void* value_cache,
                         const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
                         const int32_t* context_lens, int64_t num_seqs, int64_t num_tokens, int64_t heads,
                         int64_t kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
                         int64_t table_stride, int64_t q_stride, int64_t o_stride, float scale, int32_t window,
                         float softcap, int dtype, int threads, int kv_kind, const float* k_aux, const float* v_aux,
                         const float* sinks);

}  // namespace

// Field order is the ctypes Structures' in layer_runner.py.
struct PrKernels {
  RmsNormFn rms_norm;
  LinearFn linear;
  LinearFn linear_silu;
  RopeFn rope;
  CacheFn reshape_and_cache;
  DecodeFn decode;
  VarlenFn varlen;
  HeadNormFn head_norm;
};

struct PrModel {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t block_size, num_blocks, max_pos, elem_size;
  float eps, scale;
  int32_t dtype_code;  // the attention kernel's: 0 float32, 1 bfloat16
  const float* cos;
  const float* sin;
};

struct PrLayer {
  const void* input_norm;
  const void* post_norm;
  const void *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
  void* key_cache;
  void* value_cache;
  const void* q_norm;  // Qwen3's per-head norms; null in the other families
  const void* k_norm;
  int32_t window;  // the layer's sliding window (0: full attention)
  float softcap;   // its logit soft-cap (0: none)
  const float* sinks;  // GPT-OSS's attention sinks, float32 [num_heads] (null: none)
  // Gemma's sandwich norms on the attention's and the MLP's outputs (null in the Llama family),
  // and the layer's RoPE tables (null: the model's).
  const void* attn_out_norm;
  const void* mlp_out_norm;
  const float* cos;
  const float* sin;
};

// One KV cache group's block tables [num_seqs, table_stride] and slot mapping [num_tokens].
struct PrTables {
  const int32_t* block_tables;
  const int64_t* slot_mapping;
  int64_t table_stride;
};

struct PrStep {
  int64_t num_tokens, num_seqs, table_stride;
  int32_t decode_only, threads;
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int32_t *block_tables, *query_start_loc, *seq_lens, *context_lens;
  const PrTables* groups;      // null: every layer reads block_tables / slot_mapping / table_stride above;
  const int32_t* layer_group;  // else layer l reads groups[layer_group[l]]
};

struct PrBuffers {
  void *residual, *h, *x, *qkv, *attn, *mid;  // residual holds the embeddings on entry
};

// 0, or where a kernel refused its arguments: 16 * layer + stage (stage 1-14: the calls below in
// order), with the kernel's status in *status; the layers after it are not run. The caller checks
// what the kernels would refuse first, so a refusal here is a bug, reported, never retried.
#define PR_CALL(call)                                  \
  do {                                                 \
    ++stage;                                           \
    if (const int rc_ = (call)) {                      \
      *status = rc_;                                   \
      return static_cast<int>(16 * l + stage);         \
    }                                                  \
  } while (0)

PR_EXPORT int run_decoder_layers(const PrKernels* k, const PrModel* m, const PrLayer* layers, const PrStep* s,
                                 const PrBuffers* b, int* status) {
  const int64_t T = s->num_tokens, H = m->hidden, I = m->intermediate, hd = m->head_dim;
  const int64_t q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd, qkv_n = q_size + 2 * kv_size;
  const int threads = s->threads;
  // q, k and v are column ranges of one [T, qkv_n] buffer, as the Python loop's split views are.
  char* q = static_cast<char*>(b->qkv);
  char* key = q + q_size * m->elem_size;
  char* value = key + kv_size * m->elem_size;
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const PrLayer& L = layers[l];
    const PrTables own{s->block_tables, s->slot_mapping, s->table_stride};
    const PrTables& g = s->groups ? s->groups[s->layer_group[l]] : own;
    int stage = 0;
    if (l == 0)
      PR_CALL(k->rms_norm(b->residual, nullptr, L.input_norm, b->x, T, H, H, 0, H, m->eps, threads));
    else
      PR_CALL(k->rms_norm(b->h, b->residual, L.input_norm, b->x, T, H, H, H, H, m->eps, threads));
    PR_CALL(k->linear(b->x, L.qkv_w, L.qkv_b, q, T, qkv_n, H, H, qkv_n, threads));
    if (L.q_norm) {
      PR_CALL(k->head_norm(q, L.q_norm, q, T, m->num_heads, hd, qkv_n, qkv_n, m->eps, threads));
      PR_CALL(k->head_norm(key, L.k_norm, key, T, m->num_kv_heads, hd, qkv_n, qkv_n, m->eps, threads));
    }
    const float* cos = L.cos ? L.cos : m->cos;
    const float* sin = L.sin ? L.sin : m->sin;
    PR_CALL(k->rope(q, s->positions, cos, sin, T, m->num_heads, hd, qkv_n, m->max_pos, threads));
    PR_CALL(k->rope(key, s->positions, cos, sin, T, m->num_kv_heads, hd, qkv_n, m->max_pos, threads));
    PR_CALL(k->reshape_and_cache(key, value, L.key_cache, L.value_cache, g.slot_mapping, T, kv_size, qkv_n, qkv_n,
                                 m->num_blocks * m->block_size, m->elem_size));
    if (s->decode_only)
      PR_CALL(k->decode(b->attn, q, L.key_cache, L.value_cache, g.block_tables, s->seq_lens, s->num_seqs,
                        m->num_heads, m->num_kv_heads, hd, m->block_size, m->num_blocks, g.table_stride, qkv_n,
                        q_size, m->scale, L.window, L.softcap, m->dtype_code, threads, 0, nullptr, nullptr, L.sinks));
    else
      PR_CALL(k->varlen(b->attn, q, L.key_cache, L.value_cache, g.block_tables, s->query_start_loc, s->seq_lens,
                        s->context_lens, s->num_seqs, T, m->num_heads, m->num_kv_heads, hd, m->block_size,
                        m->num_blocks, g.table_stride, qkv_n, q_size, m->scale, L.window, L.softcap, m->dtype_code,
                        threads, 0, nullptr, nullptr, L.sinks));
    PR_CALL(k->linear(b->attn, L.o_w, L.o_b, b->h, T, H, q_size, q_size, H, threads));
    if (L.attn_out_norm) PR_CALL(k->rms_norm(b->h, nullptr, L.attn_out_norm, b->h, T, H, H, 0, H, m->eps, threads));
    PR_CALL(k->rms_norm(b->h, b->residual, L.post_norm, b->x, T, H, H, H, H, m->eps, threads));
    PR_CALL(k->linear_silu(b->x, L.gate_up_w, L.gate_up_b, b->mid, T, I, H, H, I, threads));
    PR_CALL(k->linear(b->mid, L.down_w, L.down_b, b->h, T, H, I, I, H, threads));
    if (L.mlp_out_norm) PR_CALL(k->rms_norm(b->h, nullptr, L.mlp_out_norm, b->h, T, H, H, 0, H, m->eps, threads));
  }
  *status = 0;
  return 0;
}

#undef PR_CALL
