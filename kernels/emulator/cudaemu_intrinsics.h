// cudaemu: the CUDA-facing barrier and warp intrinsics (__syncthreads, __shfl_*_sync, votes, ...).
// Default arguments capture the call site, so deadlock reports can name file:line.
#ifndef CUDAEMU_INTRINSICS_H
#define CUDAEMU_INTRINSICS_H
#include "cudaemu_runtime.h"

#define CUDAEMU_SITE_PARAMS std::source_location cudaemu_loc = std::source_location::current()
#define CUDAEMU_SITE ::cudaemu::Site{cudaemu_loc.file_name(), int(cudaemu_loc.line()), int(cudaemu_loc.column())}

static inline void __syncthreads(CUDAEMU_SITE_PARAMS) {
  ::cudaemu::syncthreads_impl(::cudaemu::K_SYNCTHREADS, 1, CUDAEMU_SITE);
}
static inline int __syncthreads_count(int pred, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::syncthreads_impl(::cudaemu::K_SYNCTHREADS_COUNT, pred, CUDAEMU_SITE));
}
static inline int __syncthreads_and(int pred, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::syncthreads_impl(::cudaemu::K_SYNCTHREADS_AND, pred, CUDAEMU_SITE));
}
static inline int __syncthreads_or(int pred, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::syncthreads_impl(::cudaemu::K_SYNCTHREADS_OR, pred, CUDAEMU_SITE));
}
static inline void __syncwarp(unsigned mask = 0xffffffffu, CUDAEMU_SITE_PARAMS) {
  ::cudaemu::collective(::cudaemu::K_SYNCWARP, mask, 0, 0, 32, CUDAEMU_SITE);
}

namespace cudaemu {
template <class T>
inline T shfl(uint8_t kind, unsigned mask, T var, int param, int width, Site site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffled values must be trivially copyable, <= 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &var, sizeof(T));
  uint64_t r = collective(kind, mask, bits, param, width, site);
  T out;
  memcpy(&out, &r, sizeof(T));
  return out;
}
}  // namespace cudaemu

template <class T>
static inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, CUDAEMU_SITE_PARAMS) {
  return ::cudaemu::shfl(::cudaemu::K_SHFL, mask, var, srcLane, width, CUDAEMU_SITE);
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, CUDAEMU_SITE_PARAMS) {
  return ::cudaemu::shfl(::cudaemu::K_SHFL_UP, mask, var, int(delta), width, CUDAEMU_SITE);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, CUDAEMU_SITE_PARAMS) {
  return ::cudaemu::shfl(::cudaemu::K_SHFL_DOWN, mask, var, int(delta), width, CUDAEMU_SITE);
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, CUDAEMU_SITE_PARAMS) {
  return ::cudaemu::shfl(::cudaemu::K_SHFL_XOR, mask, var, laneMask, width, CUDAEMU_SITE);
}
static inline unsigned __ballot_sync(unsigned mask, int pred, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_BALLOT, mask, pred != 0, 0, 32, CUDAEMU_SITE));
}
static inline int __all_sync(unsigned mask, int pred, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::collective(::cudaemu::K_ALL, mask, pred != 0, 0, 32, CUDAEMU_SITE));
}
static inline int __any_sync(unsigned mask, int pred, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::collective(::cudaemu::K_ANY, mask, pred != 0, 0, 32, CUDAEMU_SITE));
}
template <class T>
static inline unsigned __match_any_sync(unsigned mask, T value, CUDAEMU_SITE_PARAMS) {
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  return unsigned(::cudaemu::collective(::cudaemu::K_MATCH_ANY, mask, bits, 0, 32, CUDAEMU_SITE));
}
template <class T>
static inline unsigned __match_all_sync(unsigned mask, T value, int* pred, CUDAEMU_SITE_PARAMS) {
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  unsigned r = unsigned(::cudaemu::collective(::cudaemu::K_MATCH_ALL, mask, bits, 0, 32, CUDAEMU_SITE));
  *pred = r != 0;
  return r;
}
static inline unsigned __reduce_add_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_ADD, mask, v, 0, 32, CUDAEMU_SITE));
}
static inline int __reduce_add_sync(unsigned mask, int v, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::collective(::cudaemu::K_REDUCE_ADD, mask, uint32_t(v), 0, 32, CUDAEMU_SITE));
}
static inline unsigned __reduce_min_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_MIN_U, mask, v, 0, 32, CUDAEMU_SITE));
}
static inline int __reduce_min_sync(unsigned mask, int v, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::collective(::cudaemu::K_REDUCE_MIN_I, mask, uint32_t(v), 0, 32, CUDAEMU_SITE));
}
static inline unsigned __reduce_max_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_MAX_U, mask, v, 0, 32, CUDAEMU_SITE));
}
static inline int __reduce_max_sync(unsigned mask, int v, CUDAEMU_SITE_PARAMS) {
  return int(::cudaemu::collective(::cudaemu::K_REDUCE_MAX_I, mask, uint32_t(v), 0, 32, CUDAEMU_SITE));
}
static inline unsigned __reduce_and_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_AND, mask, v, 0, 32, CUDAEMU_SITE));
}
static inline unsigned __reduce_or_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_OR, mask, v, 0, 32, CUDAEMU_SITE));
}
static inline unsigned __reduce_xor_sync(unsigned mask, unsigned v, CUDAEMU_SITE_PARAMS) {
  return unsigned(::cudaemu::collective(::cudaemu::K_REDUCE_XOR, mask, v, 0, 32, CUDAEMU_SITE));
}
// Lanes of this warp that exist and have not exited (the emulator keeps warps converged between barriers).
static inline unsigned __activemask() {
  ::cudaemu::Runtime& r = ::cudaemu::g_rt;
  int w = r.cur >> 5;
  unsigned m = r.warp_exist[w];
  for (unsigned b = m; b; b &= b - 1)
    if (r.th[(w << 5) + __builtin_ctz(b)].state == ::cudaemu::ST_EXIT) m &= ~(1u << __builtin_ctz(b));
  return m;
}
static inline unsigned __lanemask_lt() { return (1u << (::cudaemu::g_rt.cur & 31)) - 1u; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __nanosleep(unsigned) {}
static inline long long clock64() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}
[[noreturn]] static inline void __trap() { ::cudaemu::fail(::cudaemu::ERR_FAULT, "__trap() called"); }
[[noreturn]] static inline void __brkpt() { ::cudaemu::fail(::cudaemu::ERR_FAULT, "__brkpt() called"); }

// assert() in a kernel: glibc's macro calls __assert_fail; this definition (bound inside the
// module by -Wl,-Bsymbolic) turns a failed assertion into a launch error instead of abort().
extern "C" [[noreturn]] inline void __assert_fail(const char* expr, const char* file, unsigned int line,
                                                   const char* func) noexcept {
  if (!::cudaemu::g_rt.in_fiber) abort();
  ::cudaemu::fail(::cudaemu::ERR_FAULT, "assertion `%s` failed at %s:%u in %s", expr, file, line, func);
}

#endif  // CUDAEMU_INTRINSICS_H
