// The model's own CPU ops, float32 (issue 8): a GEMM for the model's linear layers, and the
// elementwise chains torch runs as several passes (RMSNorm with the residual add, RoPE, SiLU * up).
//
// Built and loaded like paged_attention_cpu.cpp (pagedrun/cpu_build.py: g++ -O3 -fopenmp -shared,
// -mavx2 -mfma and -mavx512* when the machine has them; ctypes, raw pointers, no torch headers).
// Every function returns 0, or a negative status before writing anything when an argument is out of range; the
// Python side (pagedrun/models/ops.py) then falls back to torch.
//
// Why a GEMM of our own: torch's CPU linear (MKL sgemm) is at the machine's peak for the thousands of
// rows of a prefill step, but a decode step brings 1-64 and there it measured 25-85 GFLOP/s against
// ~150 (docs/cpu-model-ops.md; a per-call cost such as packing the weights is the likely cause).
// Our weights never change, so they are packed once after loading, in panels of two vectors of
// columns (32 with AVX-512, 16 otherwise; BLIS's microkernel shape, below), and linear_packed_f32
// runs every product of the model on them, decode and prefill alike. It is deterministic and independent of the thread count.
//
// Numerics follow transformers' op order (built with -ffp-contract=off and no -ffast-math, so a*b+c
// rounds twice, as torch's elementwise kernels do): RMSNorm multiplies x by 1/sqrt(mean(x^2) + eps)
// and then by the weight; RoPE is x1*cos - x2*sin, x2*cos + x1*sin (bit-identical to torch's);
// SiLU is x / (1 + exp(-x)). Only reduction orders (and exp, within 2 ulp) differ from torch's.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec8.h"

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---- the GEMM's vector: 16 floats with AVX-512, else 8 (PR_GEMM_VEC8 forces 8 for the tests) ----
//
// One width-generic kernel below; only the register file differs. MR rows of x times a panel of
// two vectors is 2 * MR accumulators + 2 weight vectors + 1 broadcast: MR = 6 fills the 16 AVX
// registers (the BLIS microkernel's shape), MR = 12 fits the 32 AVX-512 registers with 5 to spare.
// Each lane accumulates one output column over k in order, so the result is bit-identical whatever
// the width (tests/test_model_ops.py builds both and compares them).
#if defined(__AVX512F__) && !defined(PR_GEMM_VEC8)
constexpr int kVec = 16;
constexpr int kTileM = 12;
typedef float vgf __attribute__((vector_size(64)));
typedef float vgfu __attribute__((vector_size(64), aligned(4), may_alias));
inline vgf fma_v(vgf a, vgf b, vgf c) { return (vgf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vgf broadcast_v(float x) { return (vgf)_mm512_set1_ps(x); }
#else
constexpr int kVec = 8;
constexpr int kTileM = 6;
typedef v8f vgf;
typedef v8fu vgfu;
// c + a * b with one rounding where the CPU has FMA, two otherwise.
inline vgf fma_v(vgf a, vgf b, vgf c) {
#if defined(__FMA__)
  return (vgf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return c + a * b;
#endif
}
inline vgf broadcast_v(float x) { return broadcast8(x); }
#endif
inline vgf load_v(const float* p) { return *reinterpret_cast<const vgfu*>(p); }
inline void store_v(float* p, vgf x) { *reinterpret_cast<vgfu*>(p) = x; }

// ---- GEMM: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w packed ----
//
// The model's Linear weights are repacked once after loading (pagedrun.models.ops.pack_weight) into
// panels of kPanel = 2 vectors of output columns: packed[q][k][j] = w[q * kPanel + j][k], zero-padded
// past N. A panel's row k holds column block q's weights for input k, so a tile of MR rows of x times
// the panel is an outer product per k: two vector loads of weights, MR broadcasts of x, 2 * MR FMAs
// into 2 * MR accumulators. Panels stream contiguously from memory, so the hardware prefetcher
// follows them, and each panel slice (kKc rows of k, 16 KiB) stays in L1 beside a tile of x while
// every row tile of x passes over it. Each output element is one sum over k in increasing order
// (continued across k-slices through the output itself), so results do not depend on the thread
// count, the blocking or the vector width.

constexpr int kPanel = 2 * kVec;
constexpr int64_t kKc = 16384 / (kPanel * 4);  // k rows of a panel slice: 16 KiB
constexpr int64_t kXBytesInL2 = 256 * 1024;    // rows of x kept hot in L2 while all panels pass by

// MR rows of x (row stride ldx) times panel rows [k0, k1) into c (row stride ldc): started from
// zero when `first`, else continued from c; bias added when given (the last slice). `prefetch`:
// the next slice to pull in from memory while this one computes (the first tile of a slice only).
template <int MR>
inline void packed_tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k0,
                        int64_t k1, float* __restrict c, int64_t ldc, bool first, const float* bias,
                        const float* prefetch) {
  vgf acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? vgf{} : load_v(c + i * ldc);
    acc[i][1] = first ? vgf{} : load_v(c + i * ldc + kVec);
  }
#pragma GCC unroll 4
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch) {
      for (int line = 0; line < kPanel * 4; line += 64) __builtin_prefetch(prefetch + (k - k0) * kPanel + line / 4);
    }
    const vgf w0 = load_v(panel + k * kPanel), w1 = load_v(panel + k * kPanel + kVec);
    for (int i = 0; i < MR; ++i) {
      const vgf xv = broadcast_v(x[i * ldx + k]);
      acc[i][0] = fma_v(xv, w0, acc[i][0]);
      acc[i][1] = fma_v(xv, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (bias) {
      acc[i][0] += load_v(bias);
      acc[i][1] += load_v(bias + kVec);
    }
    store_v(c + i * ldc, acc[i][0]);
    store_v(c + i * ldc + kVec, acc[i][1]);
  }
}

template <int MR>
inline void packed_tile_rows(int mr, const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                             float* c, int64_t ldc, bool first, const float* bias, const float* prefetch) {
  if constexpr (MR > 1) {
    if (mr < MR) return packed_tile_rows<MR - 1>(mr, x, ldx, panel, k0, k1, c, ldc, first, bias, prefetch);
  }
  packed_tile<MR>(x, ldx, panel, k0, k1, c, ldc, first, bias, prefetch);
}

// All row tiles of rows [m0, m1) against panel q over the whole K, slice by slice. The last panel
// may be partial (N not a multiple of kPanel): its tiles go through a full-width scratch tile.
inline void packed_panel(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* packed, int64_t q,
                         int64_t num_panels, int64_t N, int64_t K, const float* bias, float* out, int64_t ldo) {
  const float* panel = packed + q * K * kPanel;
  const int64_t n0 = q * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
  float scratch[kTileM * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t k1 = k0 + kKc < K ? k0 + kKc : K;
    const bool first = k0 == 0, last = k1 == K;
    // Next in this thread's stream: the panel's next slice, else the next panel's first.
    const float* prefetch = k1 < K ? panel + k1 * kPanel : (q + 1 < num_panels ? panel + K * kPanel : nullptr);
    for (int64_t m = m0; m < m1; m += kTileM, prefetch = nullptr) {
      const int mr = m1 - m < kTileM ? int(m1 - m) : kTileM;
      float* c = out + m * ldo + n0;
      if (cols == kPanel) {
        packed_tile_rows<kTileM>(mr, x + m * ldx, ldx, panel, k0, k1, c, ldo, first,
                                 last && bias ? bias + n0 : nullptr, prefetch);
        continue;
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < kPanel; ++j) scratch[i * kPanel + j] = !first && j < cols ? c[i * ldo + j] : 0.0f;
      packed_tile_rows<kTileM>(mr, x + m * ldx, ldx, panel, k0, k1, scratch, kPanel, first, nullptr, prefetch);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < cols; ++j)
          c[i * ldo + j] = scratch[i * kPanel + j] + (last && bias ? bias[n0 + j] : 0.0f);
    }
  }
}
}  // namespace

// Columns per panel of the packed layout (pagedrun.models.ops packs with it).
PR_EXPORT int packed_panel_width() { return kPanel; }

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) . w^T (+ bias [N] unless null), with w
// packed: [ceil(N / kPanel), K, kPanel]. Threads split the panels (each output column is one
// thread's); rows go in chunks that fit in L2 (all of a decode step's rows, a slice of a prefill's).
PR_EXPORT int linear_packed_f32(const float* x, const float* packed, const float* bias, float* out, int64_t M,
                                int64_t N, int64_t K, int64_t ldx, int64_t ldo, int num_threads) {
  if (M < 0 || N <= 0 || K <= 0 || ldx < K || ldo < N) return -1;
  if (num_threads < 1) num_threads = 1;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  int64_t row_chunk = kXBytesInL2 / (K * int64_t(sizeof(float)));
  row_chunk = row_chunk < kTileM ? kTileM : row_chunk / kTileM * kTileM;
  for (int64_t m0 = 0; m0 < M; m0 += row_chunk) {
    const int64_t m1 = m0 + row_chunk < M ? m0 + row_chunk : M;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t q = 0; q < num_panels; ++q) packed_panel(x, ldx, m0, m1, packed, q, num_panels, N, K, bias, out, ldo);
  }
  return 0;
}

// RMSNorm of M rows of H: out = weight * (h * 1/sqrt(mean(h^2) + eps)), where h = x, or, with a
// residual, h = x + residual, written back to residual first (the pre-norm block's "h = h + f(h)"
// fused into the next norm, as vLLM does). Rows have strides ldx / ldr / ldo.
PR_EXPORT int rms_norm_f32(const float* x, float* residual, const float* weight, float* out, int64_t M, int64_t H,
                           int64_t ldx, int64_t ldr, int64_t ldo, float eps, int num_threads) {
  if (M < 0 || H <= 0 || ldx < H || ldo < H || (residual && ldr < H)) return -1;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H >= 65536)
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float* o = out + m * ldo;
    const float* h = xr;
    if (residual) {
      float* r = residual + m * ldr;
      for (int64_t i = 0; i < H; ++i) r[i] = xr[i] + r[i];
      h = r;
    }
    v8f acc = {};
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
      const v8f v = load8(h + i);
      acc += v * v;
    }
    float ss = horizontal_sum(acc);
    for (; i < H; ++i) ss += h[i] * h[i];
    const float inv = 1.0f / std::sqrt(ss / float(H) + eps);
    for (i = 0; i < H; ++i) o[i] = weight[i] * (h[i] * inv);
  }
  return 0;
}

// RoPE in place, "rotate half" layout: for each token t and head, with c = cos[pos[t]], s = sin[pos[t]]
// (tables [max_pos, head_size / 2]): x1, x2 = halves; x1' = x1*c - x2*s, x2' = x2*c + x1*s.
// x [T, num_heads, head_size] with token stride ldx and head stride head_size.
PR_EXPORT int rope_f32(float* x, const int64_t* positions, const float* cos, const float* sin, int64_t T,
                       int64_t num_heads, int64_t head_size, int64_t ldx, int64_t max_pos, int num_threads) {
  if (T < 0 || num_heads <= 0 || head_size <= 0 || head_size % 2 || ldx < num_heads * head_size) return -1;
  for (int64_t t = 0; t < T; ++t)
    if (positions[t] < 0 || positions[t] >= max_pos) return -2;
  if (num_threads < 1) num_threads = 1;
  const int64_t half = head_size / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * num_heads * head_size >= 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t hd = 0; hd < num_heads; ++hd) {
      float* x1 = x + t * ldx + hd * head_size;
      float* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
  return 0;
}

// out [M, I] = silu(gate) * up, where gate_up [M, 2I] (row stride ldg) holds gate then up.
PR_EXPORT int silu_and_mul_f32(const float* gate_up, float* out, int64_t M, int64_t I, int64_t ldg, int64_t ldo,
                               int num_threads) {
  if (M < 0 || I <= 0 || ldg < 2 * I || ldo < I) return -1;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I >= 65536)
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * ldg;
    const float* u = g + I;
    float* o = out + m * ldo;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
  }
  return 0;
}
