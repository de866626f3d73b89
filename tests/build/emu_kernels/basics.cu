// Small kernels exercising the CUDA emulator (tests/build/test_cudaemu.py). Plain CUDA: no emulator APIs.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define FULL_MASK 0xffffffffu

extern "C" __global__ void vector_add(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

// Tree reduction through shared memory; `with_barrier` = 0 drops the barrier inside the loop.
extern "C" __global__ void block_sum(const float* x, float* out, int n, int with_barrier) {
  __shared__ float buf[256];
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  buf[t] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) buf[t] += buf[t + s];
    if (with_barrier) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(FULL_MASK, v, o);
  return __shfl_sync(FULL_MASK, v, 0);
}

// One warp per row of 32: out[2*row] = max, out[2*row+1] = sum.
extern "C" __global__ void warp_reduce(const float* x, float* out) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const float v = x[row * 32 + threadIdx.x % 32];
  const float m = warp_max(v);
  const float s = warp_sum(v);
  if (threadIdx.x % 32 == 0) {
    out[2 * row] = m;
    out[2 * row + 1] = s;
  }
}

// 64-bit and 16-bit values through shuffles and a ballot/all/any check.
extern "C" __global__ void warp_types(const double* d, const __half* h, const __nv_bfloat16* b, double* dout,
                                      __half* hout, __nv_bfloat16* bout, unsigned* votes) {
  const int lane = threadIdx.x;
  dout[lane] = __shfl_xor_sync(FULL_MASK, d[lane], 1);
  hout[lane] = __shfl_down_sync(FULL_MASK, h[lane], 3);
  bout[lane] = __shfl_up_sync(FULL_MASK, b[lane], 5);
  const unsigned ballot = __ballot_sync(FULL_MASK, lane % 3 == 0);
  const int all = __all_sync(FULL_MASK, lane < 32);
  const int any = __any_sync(FULL_MASK, lane == 7);
  const int none = __any_sync(FULL_MASK, lane > 40);
  if (lane == 0) {
    votes[0] = ballot;
    votes[1] = all;
    votes[2] = any;
    votes[3] = none;
  }
}

// Every shuffle flavour with a per-lane source lane and a block-wide width and delta.
// out rows: idx, up, down, xor (32 ints each).
extern "C" __global__ void shfl_rules(const int* src_lane, int* out, int delta, int width) {
  const int lane = threadIdx.x;
  const int v = 100 + lane;
  out[0 * 32 + lane] = __shfl_sync(FULL_MASK, v, src_lane[lane], width);
  out[1 * 32 + lane] = __shfl_up_sync(FULL_MASK, v, delta, width);
  out[2 * 32 + lane] = __shfl_down_sync(FULL_MASK, v, delta, width);
  out[3 * 32 + lane] = __shfl_xor_sync(FULL_MASK, v, delta, width);
}

// Only the low half-warp participates, with a mask naming exactly those lanes.
extern "C" __global__ void shfl_partial_mask(const int* src_lane, int* out) {
  const int lane = threadIdx.x;
  int r = -1;
  if (lane < 16) r = __shfl_sync(0x0000ffffu, 100 + lane, src_lane[lane]);
  out[lane] = r;
}

// Softmax-style two-phase block reduction that reuses red[] for the second phase. Without the
// barrier marked below, a warp that finishes its sum early overwrites red[] while another warp
// still reads the block max from it (a cross-warp race).
extern "C" __global__ void reuse_race(const float* x, float* out, int with_barrier) {
  __shared__ float red[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const float v = x[threadIdx.x];
  float m = warp_max(v);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = lane < nwarps ? red[lane] : -INFINITY;
  m = warp_max(m);
  if (with_barrier) __syncthreads();  // red[] is about to be reused
  float e = expf(v - m);
  for (int o = 16; o > 0; o >>= 1) e += __shfl_xor_sync(FULL_MASK, e, o);
  if (lane == 0) red[warp] = e;
  __syncthreads();
  float s = lane < nwarps ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
  out[threadIdx.x] = expf(v - m) / s;
}

// Reads shared memory nobody wrote: the emulator fills it with 0xFF bytes (NaN) first.
extern "C" __global__ void read_unwritten(float* out, int n) {
  __shared__ float stat[64];
  extern __shared__ float dyn[];
  out[threadIdx.x] = stat[threadIdx.x];
  out[n + threadIdx.x] = dyn[threadIdx.x];
}

extern "C" __global__ void convert(const float* x, unsigned short* h_rn, unsigned short* h_rz,
                                   unsigned short* h_rd, unsigned short* h_ru, unsigned short* b_rn,
                                   float* h_back, float* b_back, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half h = __float2half(x[i]);
  h_rn[i] = __half_as_ushort(h);
  h_rz[i] = __half_as_ushort(__float2half_rz(x[i]));
  h_rd[i] = __half_as_ushort(__float2half_rd(x[i]));
  h_ru[i] = __half_as_ushort(__float2half_ru(x[i]));
  const __nv_bfloat16 b = __float2bfloat16(x[i]);
  b_rn[i] = __bfloat16_as_ushort(b);
  h_back[i] = __half2float(h);
  b_back[i] = __bfloat162float(b);
}

// Writes its own indices; grid and block of any dimensionality.
extern "C" __global__ void indices(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* o = out + 6 * (block * nthreads + t);
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
}

extern "C" __global__ void pack_args(double* out, int a, float b, long long c, double d, unsigned short e,
                                     __half f) {
  out[0] = a; out[1] = b; out[2] = (double)c; out[3] = d; out[4] = e; out[5] = __half2float(f);
}

// A templated kernel with dynamic shared memory, reached through name_expressions.
template <typename T, int N>
__global__ void rotate_scale(T* x, float s) {
  extern __shared__ unsigned char smem_raw[];
  T* buf = reinterpret_cast<T*>(smem_raw);
  buf[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  x[threadIdx.x] = static_cast<T>(static_cast<float>(buf[(threadIdx.x + 1) % N]) * s);
}

// Block-wide vote helpers.
extern "C" __global__ void sync_votes(int* out) {
  const int t = threadIdx.x;
  const int c = __syncthreads_count(t % 4 == 0);
  const int a = __syncthreads_and(t >= 0);
  const int o = __syncthreads_or(t == 5);
  if (t == 0) { out[0] = c; out[1] = a; out[2] = o; }
}

// Benchmark shape: 4 warps, warp shuffles and one barrier per block.
extern "C" __global__ void bench_block(const float* x, float* out) {
  __shared__ float part[4];
  const float v = warp_sum(x[blockIdx.x * blockDim.x + threadIdx.x]);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = part[0] + part[1] + part[2] + part[3];
}

// Static shared memory inside a template instantiation is poisoned as well.
template <int N>
__global__ void template_shared(float* out) {
  __shared__ float s[N];
  out[threadIdx.x] = s[threadIdx.x];
  __syncthreads();
  s[threadIdx.x] = 1.0f;  // written after the read: the next block must see NaN again
}
