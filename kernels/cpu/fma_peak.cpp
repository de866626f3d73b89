// The machine's arithmetic roof, measured: `pagedrun bench` divides useful FLOP/s by it.
//
// A register-only loop of independent multiply-add chains at the widest vector the build has
// (pagedrun/build/cpu.py: AVX-512 where the CPU has it, else AVX2 + FMA, else plain SSE through GCC
// vector extensions). No memory traffic, so it is the FMA ports alone: the best any kernel built the
// same way could do. 12 chains cover an FMA latency of 4-6 cycles on two ports (a chain must not wait
// for its previous result). The bf16 roof uses vdpbf16ps (2 products per fp32 lane per instruction)
// where the build has avx512_bf16, else it is the fp32 roof: that is the arithmetic a bf16 model's
// matmuls then run on. Where the build has AMX (and the kernel grants the tile state), the bf16 GEMM
// runs on tiles (kernels/cpu/amx_bf16.h), so the bf16 roof is TDPBF16PS instead: 4 independent
// accumulator tiles from 4 operand tiles held in the tile registers, no memory traffic either.

#include <cstdint>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"

#define PR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
constexpr int kChains = 12;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef __m512 vec;
inline vec splat(float x) { return _mm512_set1_ps(x); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__FMA__)
constexpr int kLanes = 8;
typedef __m256 vec;
inline vec splat(float x) { return _mm256_set1_ps(x); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lanes_sum(vec v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
constexpr int kLanes = 4;
typedef float vec __attribute__((vector_size(16)));
inline vec splat(float x) { return vec{x, x, x, x}; }
inline vec fma(vec a, vec b, vec c) { return a * b + c; }  // two instructions: counted as one FMA each
inline float lanes_sum(vec v) { return v[0] + v[1] + v[2] + v[3]; }
#endif

// kChains independent chains of `step` (one instruction each), from distinct starting values; the
// result depends on every chain, so the compiler keeps them all.
template <typename Step>
inline float run_chains(int64_t iters, float seed, Step step) {
  vec acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = splat(seed + j);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kChains; ++j) acc[j] = step(acc[j]);
  }
  float s = 0;
  for (int j = 0; j < kChains; ++j) s += lanes_sum(acc[j]);
  return s;
}

// acc = acc * m + a converges (|m| < 1), so no chain overflows however long it runs.
float fp32_chains(int64_t iters, float seed) {
  const vec m = splat(0.999f), a = splat(1e-3f);
  return run_chains(iters, seed, [=](vec acc) { return fma(acc, m, a); });
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
// acc += a0*b0 + a1*b1 per lane, 1e-6 a round: far from overflow for any run this times.
float bf16_chains(int64_t iters, float seed) {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  return run_chains(iters, seed, [=](vec acc) { return _mm512_dpbf16_ps(acc, a, a); });
}
#else
constexpr bool kHasBf16Dot = false;
float bf16_chains(int64_t iters, float seed) { return fp32_chains(iters, seed); }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// iters rounds of 4 TDPBF16PS (16 x 16 x 32 products each) into tiles 0-3 from tiles 4-7.
float amx_chains(int64_t iters) {
  amx_configure();
  alignas(64) uint16_t ops[16 * 32];
  for (auto& x : ops) x = 0x3a83;  // bf16 1e-3: each round adds 32e-6 to every accumulator
  _tile_loadd(4, ops, 64);
  _tile_loadd(5, ops, 64);
  _tile_loadd(6, ops, 64);
  _tile_loadd(7, ops, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}
bool has_amx() { return amx_permitted(); }
constexpr double kAmxFlopsPerRound = 4.0 * 16 * 16 * 32 * 2;
#else
bool has_amx() { return false; }
float amx_chains(int64_t) { return 0; }
constexpr double kAmxFlopsPerRound = 0;
#endif
}  // namespace

// 1 when the bf16 roof is AMX tiles (the build has AMX and the kernel granted the tile state).
PR_EXPORT int fma_peak_has_amx() { return has_amx() ? 1 : 0; }

// fp32 lanes per vector of this build (16: AVX-512, 8: AVX2 + FMA, 4: neither).
PR_EXPORT int fma_peak_lanes() { return kLanes; }
// 1 when bf16 dot products (vdpbf16ps) are what the bf16 roof measures.
PR_EXPORT int fma_peak_has_bf16_dot() { return kHasBf16Dot ? 1 : 0; }

// Runs `iters` rounds of the chains on each of `num_threads` threads; returns the floating-point
// operations done (the caller times the call), or -1 for a bad argument. `sink` receives a value
// that depends on every chain, so the compiler cannot drop the work.
PR_EXPORT double fma_peak_run(int64_t iters, int num_threads, int bf16, float* sink) {
  if (iters <= 0 || num_threads < 1) return -1;
  const bool amx = bf16 && has_amx();
  float total = 0;
#pragma omp parallel for num_threads(num_threads) reduction(+ : total) schedule(static, 1)
  for (int t = 0; t < num_threads; ++t)
    total += amx ? amx_chains(iters) : bf16 ? bf16_chains(iters, float(t)) : fp32_chains(iters, float(t));
  if (sink) *sink = total;
  if (amx) return kAmxFlopsPerRound * double(iters) * num_threads;
  const double per_round = double(kChains) * kLanes * 2 * (bf16 && kHasBf16Dot ? 2 : 1);
  return per_round * double(iters) * num_threads;
}
