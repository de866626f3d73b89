// cudaemu: run unchanged CUDA kernel sources on the CPU. Force-included (g++ -include) before the
// .cu file, which is compiled as C++20. See pagedrun/build/cudaemu/ for the driver and docs/design/emulator.md.
//
// Rules that keep a kernel emulatable: extern "C" __global__ entry points (or name_expressions for
// templates); dynamic shared memory only as `extern __shared__ T name[]`; never rely on shared
// memory being zero; inline PTX only under #ifdef __CUDA_ARCH__ (not defined here); *_sync masks
// that name exactly the participating lanes, all calling from the same site; __syncthreads only in
// block-uniform control flow; no waiting on other blocks or spin-waiting on other threads.
#ifndef CUDAEMU_H
#define CUDAEMU_H
#define CUDAEMU_VERSION 1

// Standard headers first: several glibc/libstdc++ headers spell `__attribute__((__noinline__))`,
// which the CUDA macro below would break if they were included after it. Kept to what NVRTC
// code may include, because every module compile parses them.
#include <cassert>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <type_traits>
#include <utility>
#include <assert.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudaemu_types.h"
#include "cudaemu_fp8.h"
#include "cudaemu_runtime.h"
#include "cudaemu_intrinsics.h"

#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#define __CUDAEMU__ 1
#define __host__
#define __device__
#define __managed__
#define __constant__
#define __grid_constant__
#define __device_builtin__
#ifdef CUDAEMU_DISCOVER
#define __global__ __CUDAEMU_GLOBAL__
#else
#define __global__ __attribute__((used))
#endif
// Static __shared__ variables: one instance shared by all fibers, in a section poisoned per block.
#define __shared__ static __attribute__((section("cudaemu_shared")))
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __cudart_builtin__

#ifndef CUDART_INF_F
#define CUDART_INF_F __builtin_huge_valf()
#define CUDART_NAN_F __builtin_nanf("")
#define CUDART_INF __builtin_huge_val()
#define CUDART_NAN __builtin_nan("")
#endif

// Static __shared__ in templates: the driver appends this to the declaration (see source.py).
#define CUDAEMU_POISON_ONCE(name)                        \
  static unsigned long long cudaemu_poison_gen_##name = 0; \
  ::cudaemu::poison_once(&name, sizeof(name), &cudaemu_poison_gen_##name)

// Dynamic shared memory: the driver rewrites `extern __shared__ T name[];` to one of these.
#define CUDAEMU_EXTERN_SHARED(T, name) T* const name = reinterpret_cast<T*>(::cudaemu::dyn_smem())
namespace cudaemu {
template <class T>
struct DynShared {  // namespace-scope `extern __shared__ T name[]`
  T& operator[](size_t i) const { return static_cast<T*>(dyn_smem())[i]; }
  operator T*() const { return static_cast<T*>(dyn_smem()); }
  template <class U> explicit operator U*() const { return static_cast<U*>(dyn_smem()); }
};
}  // namespace cudaemu
#define CUDAEMU_EXTERN_SHARED_NS(T, name) static ::cudaemu::DynShared<T> name

#endif  // CUDAEMU_H
