// Buggy kernels: the emulator must report each bug as an exception, never hang or crash.
#include <cassert>

#define FULL_MASK 0xffffffffu

extern "C" __global__ void divergent_shuffle(float* x) {
  float v = x[threadIdx.x];
  if (threadIdx.x % 32 < 16) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);  // SITE_A
  } else {
    v += __shfl_xor_sync(FULL_MASK, v, 2);  // SITE_B
  }
  x[threadIdx.x] = v;
}

extern "C" __global__ void divergent_syncthreads(float* x) {
  if (threadIdx.x < 40) {
    x[threadIdx.x] = 1.0f;
    __syncthreads();  // SITE_SYNC
  }
}

extern "C" __global__ void early_exit_shuffle(float* x) {
  if (threadIdx.x == 31) return;
  x[threadIdx.x] = __shfl_down_sync(FULL_MASK, x[threadIdx.x], 1);  // SITE_EXIT
}

extern "C" __global__ void lane_not_in_mask(float* x) {
  x[threadIdx.x] = __shfl_sync(0x0000ffffu, x[threadIdx.x], 0);
}

extern "C" __global__ void bad_pointer(float* x, long long offset) {
  x[threadIdx.x] = *(x + offset);
}

extern "C" __global__ void misaligned_vector(const float* x, float* y, int offset) {
  const float4 v = reinterpret_cast<const float4*>(x + offset)[threadIdx.x];
  reinterpret_cast<float4*>(y)[threadIdx.x] = v;
}

extern "C" __global__ void failing_assert(const int* x) {
  assert(x[threadIdx.x] >= 0);
}

// Waits for a flag another thread sets: fine on a GPU, a livelock for cooperative fibers.
extern "C" __global__ void spin_wait(volatile int* flag) {
  if (threadIdx.x == 0) {
    while (flag[0] == 0) {
    }
  } else {
    flag[0] = 1;
  }
}

extern "C" __global__ void dyn_overflow(const float* x, float* y, int n) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = x[threadIdx.x];  // threadIdx.x may reach past the n floats the launch allocated
  __syncthreads();
  y[threadIdx.x] = buf[(threadIdx.x + 1) % n];
}

// A per-thread array far larger than a fiber stack.
extern "C" __global__ void huge_local_array(float* x, int n) {
  volatile float big[1 << 20];
  for (int i = 0; i < n; ++i) big[i] = x[0];
  x[threadIdx.x] = big[n - 1];
}
