// cudaemu: the block scheduler. Every CUDA thread of a block is a fiber; blocks run one after
// another. __syncthreads and the warp collectives are rendezvous points: a thread records what it
// is waiting for and switches to another runnable fiber; the last thread to arrive computes every
// participant's result and makes them runnable again. When no fiber can run and some have not
// exited, the block is deadlocked and the launch fails with a report of who waits where.
#ifndef CUDAEMU_RUNTIME_H
#define CUDAEMU_RUNTIME_H
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <source_location>
#include <tuple>
#include <utility>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <ucontext.h>

#include "cudaemu_fiber.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define CUDAEMU_ASAN 1
#else
#define CUDAEMU_ASAN 0
#endif

// Built-in index variables: plain globals, rewritten on every fiber switch. Launches are
// serialized (the Python driver holds a lock), so they need not be thread_local.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

namespace cudaemu {

enum : int { OK = 0, ERR_DEADLOCK = 1, ERR_LAUNCH = 2, ERR_FAULT = 3 };
enum : int { SCHED_ROUND_ROBIN = 0, SCHED_GREEDY = 1 };
enum : uint8_t { ST_RUN = 0, ST_SYNC = 1, ST_WARP = 2, ST_EXIT = 3 };
enum Kind : uint8_t {
  K_SYNCTHREADS, K_SYNCTHREADS_COUNT, K_SYNCTHREADS_AND, K_SYNCTHREADS_OR,
  K_SHFL, K_SHFL_UP, K_SHFL_DOWN, K_SHFL_XOR, K_BALLOT, K_ALL, K_ANY, K_SYNCWARP,
  K_MATCH_ANY, K_MATCH_ALL, K_REDUCE_ADD, K_REDUCE_MIN_U, K_REDUCE_MAX_U, K_REDUCE_MIN_I,
  K_REDUCE_MAX_I, K_REDUCE_AND, K_REDUCE_OR, K_REDUCE_XOR,
};
static const char* const kKindNames[] = {
  "__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or",
  "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
  "__all_sync", "__any_sync", "__syncwarp", "__match_any_sync", "__match_all_sync",
  "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_min_sync",
  "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync",
};

// Passed from Python (ctypes mirror in pagedrun/build/cudaemu/module.py: keep in sync).
struct LaunchCfg {
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shared_mem;
  int32_t schedule;
  int32_t poison_shared;
  uint64_t stack_bytes;
  double timeout_s;
  const char* kernel_name;
  char* err;
  uint64_t err_len;
};

struct Site {
  const char* file;
  int line;
  int col;
};

struct FThread {
  FiberCtx ctx;
  uint3 idx;
  uint8_t state;
  uint8_t kind;
  Site site;
  uint32_t mask;
  int32_t param;
  int32_t width;
  uint64_t val;
  uint64_t res;
};

struct Runtime {
  // stacks: one mapping, each stack preceded by a PROT_NONE guard page
  char* stacks = nullptr;
  size_t stack_bytes = 0, stride = 0;
  int stacks_cap = 0;
  FThread* th = nullptr;
  int th_cap = 0;
  // block state
  int n = 0, cur = 0, exited = 0;
  int schedule = SCHED_ROUND_ROBIN;
  uint64_t runnable[16];
  uint32_t warp_exist[32];
  uint32_t warp_waiting[32];
  int sync_waiting = 0;
  Site sync_site;
  uint8_t sync_kind = 0;
  bool sync_mismatch = false;
  FiberCtx sched;
  void (*invoke)(void*) = nullptr;
  void* invoke_ctx = nullptr;
  // launch state
  int err = OK;
  char* errbuf = nullptr;
  size_t errlen = 0;
  const char* kname = "";
  volatile sig_atomic_t in_fiber = 0;
  sigjmp_buf jb;
  char* dyn_smem = nullptr;
  size_t dyn_size = 0;
  unsigned long long block_serial = 0;  // never 0 while a block runs
  bool poison = true;
#if CUDAEMU_ASAN
  const void* main_stack_lo = nullptr;
  size_t main_stack_size = 0;
#endif
};
inline Runtime g_rt;

inline void* dyn_smem() { return g_rt.dyn_smem; }

// First thread of a block to reach a static __shared__ declaration poisons the variable.
inline void poison_once(void* p, size_t n, unsigned long long* gen) {
  if (*gen == g_rt.block_serial) return;
  *gen = g_rt.block_serial;
  if (g_rt.poison) memset(p, 0xff, n);
}

// Static __shared__ variables live in their own section so they can be poisoned per block.
extern "C" char __start_cudaemu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cudaemu_shared[] __attribute__((weak, visibility("hidden")));
inline size_t static_shared_bytes() {
  return (__start_cudaemu_shared && __stop_cudaemu_shared) ? size_t(__stop_cudaemu_shared - __start_cudaemu_shared) : 0;
}

// ---------------------------------------------------------------- error reporting
// Fixed-size text buffer (no <string>: every module compile parses this header).
struct Text {
  char buf[16384];
  size_t len = 0;
  Text() { buf[0] = 0; }
  void add(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + len, sizeof buf - len, fmt, ap);
    va_end(ap);
    if (k > 0) len = len + size_t(k) < sizeof buf ? len + size_t(k) : sizeof buf - 1;
  }
};

inline void set_error(int code, const char* msg) {
  Runtime& r = g_rt;
  if (r.err != OK) return;
  r.err = code;
  if (r.errbuf && r.errlen) {
    size_t k = strlen(msg);
    if (k > r.errlen - 1) k = r.errlen - 1;
    memcpy(r.errbuf, msg, k);
    r.errbuf[k] = 0;
  }
}

// Abandon the block from inside a fiber: record the error and return to the launcher for good.
[[noreturn]] inline void fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
[[noreturn]] inline void fail(int code, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  static Text t;
  t.len = 0;
  t.add("kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): %s", g_rt.kname, blockIdx.x, blockIdx.y, blockIdx.z,
        threadIdx.x, threadIdx.y, threadIdx.z, buf);
  set_error(code, t.buf);
  Runtime& r = g_rt;
  FiberCtx dead;
  fiber_switch(&dead, &r.sched);
  __builtin_unreachable();
}

// ---------------------------------------------------------------- scheduling
inline void set_runnable(int t) { g_rt.runnable[t >> 6] |= uint64_t(1) << (t & 63); }
inline void clear_runnable(int t) { g_rt.runnable[t >> 6] &= ~(uint64_t(1) << (t & 63)); }

inline int lowest_runnable(int from) {  // first runnable index >= from, or -1
  Runtime& r = g_rt;
  int words = (r.n + 63) >> 6;
  int w = from >> 6;
  if (w >= words) return -1;
  uint64_t bits = r.runnable[w] & (~uint64_t(0) << (from & 63));
  while (true) {
    if (bits) return (w << 6) + __builtin_ctzll(bits);
    if (++w >= words) return -1;
    bits = r.runnable[w];
  }
}

inline int pick_next() {
  Runtime& r = g_rt;
  if (r.schedule == SCHED_GREEDY) return lowest_runnable(0);
  int t = lowest_runnable(r.cur + 1);
  return t >= 0 ? t : lowest_runnable(0);
}

inline void switch_fibers(FiberCtx* from, int to_thread, bool from_dying) {
  Runtime& r = g_rt;
  FiberCtx* to;
  if (to_thread >= 0) {
    r.cur = to_thread;
    threadIdx = r.th[to_thread].idx;
    to = &r.th[to_thread].ctx;
  } else {
    to = &r.sched;
  }
#if CUDAEMU_ASAN
  void* fake = nullptr;
  if (to_thread >= 0)
    __sanitizer_start_switch_fiber(from_dying ? nullptr : &fake, r.stacks + size_t(to_thread) * r.stride + 4096, r.stack_bytes);
  else
    __sanitizer_start_switch_fiber(from_dying ? nullptr : &fake, r.main_stack_lo, r.main_stack_size);
  fiber_switch(from, to);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)from_dying;
  fiber_switch(from, to);
#endif
}

// Called after the current thread arrived at a barrier (and possibly stopped being runnable).
inline void reschedule() {
  Runtime& r = g_rt;
  int me = r.cur;
  int next = pick_next();
  if (next == me) return;
  switch_fibers(&r.th[me].ctx, next, false);  // next < 0: back to the launcher (deadlock)
}

inline void fiber_main(void*) {
#if CUDAEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  Runtime& r = g_rt;
  r.invoke(r.invoke_ctx);
  int me = r.cur;
  r.th[me].state = ST_EXIT;
  r.exited++;
  clear_runnable(me);
  FiberCtx dead;
  switch_fibers(&dead, pick_next(), true);
  __builtin_unreachable();
}

// ---------------------------------------------------------------- barriers
inline bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.col == b.col && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

inline uint64_t syncthreads_impl(uint8_t kind, int pred, Site site) {
  Runtime& r = g_rt;
  int me = r.cur;
  FThread& t = r.th[me];
  t.kind = kind;
  t.site = site;
  t.val = pred != 0;
  if (r.sync_waiting == 0) {
    r.sync_site = site;
    r.sync_kind = kind;
    r.sync_mismatch = false;
  } else if (kind != r.sync_kind || !same_site(site, r.sync_site)) {
    r.sync_mismatch = true;  // divergent __syncthreads: never released, reported as a deadlock
  }
  if (++r.sync_waiting == r.n && !r.sync_mismatch) {
    uint64_t count = 0;
    for (int i = 0; i < r.n; ++i) count += r.th[i].val;
    uint64_t res = kind == K_SYNCTHREADS_AND ? uint64_t(count == uint64_t(r.n))
                 : kind == K_SYNCTHREADS_OR  ? uint64_t(count != 0)
                                             : count;
    for (int i = 0; i < r.n; ++i) {
      r.th[i].state = ST_RUN;
      r.th[i].res = res;
    }
    for (int w = 0; w < (r.n + 63) >> 6; ++w) r.runnable[w] = ~uint64_t(0);
    if (r.n & 63) r.runnable[(r.n - 1) >> 6] = (uint64_t(1) << (r.n & 63)) - 1;
    r.sync_waiting = 0;
  } else {
    t.state = ST_SYNC;
    clear_runnable(me);
  }
  reschedule();
  return r.th[me].res;
}

inline uint64_t shfl_source(const FThread* w, int lane, uint32_t m) {
  const FThread& t = w[lane];
  int segmask = (32 - t.width) & 31;  // PTX shfl.sync: c[12:8]
  int b = t.param & 31;               // PTX: b[4:0]
  int minLane = lane & segmask;
  int maxLane = minLane | (31 & ~segmask);
  int src;
  bool ok;
  switch (t.kind) {
    case K_SHFL_UP: src = lane - b; ok = src >= minLane; break;
    case K_SHFL_DOWN: src = lane + b; ok = src <= maxLane; break;
    case K_SHFL_XOR: src = lane ^ b; ok = src <= maxLane; break;
    default: src = minLane | (b & ~segmask); ok = src <= maxLane; break;
  }
  if (!ok || src < 0 || src > 31 || !((m >> src) & 1)) src = lane;  // out of range / not in mask: own value
  return w[src].val;
}

// Last arrival of a warp collective: compute the results of every lane in m.
inline void complete_collective(FThread* w, uint32_t m, uint8_t kind) {
  uint32_t ballot = 0;
  for (uint32_t b = m; b; b &= b - 1) {
    int j = __builtin_ctz(b);
    if (w[j].val) ballot |= 1u << j;
  }
  uint64_t acc = 0;
  bool first = true;
  if (kind >= K_REDUCE_ADD) {
    for (uint32_t b = m; b; b &= b - 1) {
      uint32_t v = uint32_t(w[__builtin_ctz(b)].val);
      if (first) { acc = v; first = false; continue; }
      switch (kind) {
        case K_REDUCE_ADD: acc = uint32_t(acc + v); break;
        case K_REDUCE_MIN_U: acc = v < uint32_t(acc) ? v : acc; break;
        case K_REDUCE_MAX_U: acc = v > uint32_t(acc) ? v : acc; break;
        case K_REDUCE_MIN_I: acc = int32_t(v) < int32_t(acc) ? v : acc; break;
        case K_REDUCE_MAX_I: acc = int32_t(v) > int32_t(acc) ? v : acc; break;
        case K_REDUCE_AND: acc &= v; break;
        case K_REDUCE_OR: acc |= v; break;
        default: acc ^= v; break;
      }
    }
  }
  bool all_equal = true;
  for (uint32_t b = m; b; b &= b - 1)
    if (w[__builtin_ctz(b)].val != w[__builtin_ctz(m)].val) all_equal = false;
  for (uint32_t b = m; b; b &= b - 1) {
    int j = __builtin_ctz(b);
    FThread& t = w[j];
    switch (kind) {
      case K_SHFL: case K_SHFL_UP: case K_SHFL_DOWN: case K_SHFL_XOR: t.res = shfl_source(w, j, m); break;
      case K_BALLOT: t.res = ballot; break;
      case K_ALL: t.res = ballot == m; break;
      case K_ANY: t.res = ballot != 0; break;
      case K_MATCH_ANY: {
        uint32_t same = 0;
        for (uint32_t c = m; c; c &= c - 1)
          if (w[__builtin_ctz(c)].val == t.val) same |= 1u << __builtin_ctz(c);
        t.res = same;
        break;
      }
      case K_MATCH_ALL: t.res = all_equal ? m : 0; break;
      case K_SYNCWARP: t.res = 0; break;
      default: t.res = acc; break;
    }
  }
}

inline uint64_t collective(uint8_t kind, uint32_t mask, uint64_t val, int32_t param, int32_t width, Site site) {
  Runtime& r = g_rt;
  int me = r.cur;
  int warp = me >> 5, lane = me & 31;
  FThread* w = r.th + (warp << 5);
  uint32_t m = mask & r.warp_exist[warp];  // lanes past the end of the block do not exist
  if (!((m >> lane) & 1))
    fail(ERR_LAUNCH, "%s(mask 0x%08x) at %s:%d called by lane %d, which is not in the mask (undefined behaviour in CUDA)",
         kKindNames[kind], mask, site.file, site.line, lane);
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(ERR_LAUNCH, "%s at %s:%d: width %d is not a power of two in [1, 32]", kKindNames[kind], site.file, site.line, width);
  FThread& t = w[lane];
  t.kind = kind;
  t.mask = mask;
  t.val = val;
  t.param = param;
  t.width = width;
  t.site = site;
  uint32_t waiting = r.warp_waiting[warp] | (1u << lane);
  bool complete = (waiting & m) == m;
  if (complete) {
    for (uint32_t b = m & ~(1u << lane); b; b &= b - 1) {
      const FThread& o = w[__builtin_ctz(b)];
      if (o.kind != kind || o.mask != mask || !same_site(o.site, site)) { complete = false; break; }
    }
  }
  if (complete) {
    complete_collective(w, m, kind);
    for (uint32_t b = m & ~(1u << lane); b; b &= b - 1) {
      int j = __builtin_ctz(b);
      w[j].state = ST_RUN;
      set_runnable((warp << 5) + j);
    }
    r.warp_waiting[warp] = waiting & ~m;
  } else {
    r.warp_waiting[warp] = waiting;
    t.state = ST_WARP;
    clear_runnable(me);
  }
  reschedule();
  return w[lane].res;
}

}  // namespace cudaemu

#include "cudaemu_diagnostics.h"

namespace cudaemu {

// ---------------------------------------------------------------- launch
inline bool ensure_capacity(int n, size_t stack_bytes) {
  Runtime& r = g_rt;
  stack_bytes = (stack_bytes + 4095) & ~size_t(4095);
  if (n > r.stacks_cap || stack_bytes != r.stack_bytes) {
    if (r.stacks) munmap(r.stacks, size_t(r.stacks_cap) * r.stride);
    size_t stride = stack_bytes + 4096;
    void* p = mmap(nullptr, size_t(n) * stride, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { r.stacks = nullptr; r.stacks_cap = 0; return false; }
    r.stacks = static_cast<char*>(p);
    r.stacks_cap = n;
    r.stride = stride;
    r.stack_bytes = stack_bytes;
    for (int i = 0; i < n; ++i) mprotect(r.stacks + size_t(i) * stride, 4096, PROT_NONE);
  }
  if (n > r.th_cap) {
    free(r.th);
    r.th = static_cast<FThread*>(calloc(size_t(n), sizeof(FThread)));
    r.th_cap = r.th ? n : 0;
    if (!r.th) return false;
  }
  return true;
}

inline int run_grid(const LaunchCfg* cfg, void (*invoke)(void*), void* ctx) {
  Runtime& r = g_rt;
  r.err = OK;
  r.errbuf = cfg->err;
  r.errlen = cfg->err_len;
  r.kname = cfg->kernel_name ? cfg->kernel_name : "?";
  if (r.errbuf && r.errlen) r.errbuf[0] = 0;
  const uint32_t bx = cfg->block[0], by = cfg->block[1], bz = cfg->block[2];
  const uint64_t n64 = uint64_t(bx) * by * bz;
  if (n64 == 0 || n64 > 1024 || !cfg->grid[0] || !cfg->grid[1] || !cfg->grid[2]) {
    set_error(ERR_LAUNCH, "invalid launch configuration");
    return r.err;
  }
  const int n = int(n64);
  if (!ensure_capacity(n, cfg->stack_bytes)) {
    set_error(ERR_LAUNCH, "cannot allocate fiber stacks");
    return r.err;
  }
  r.n = n;
  r.schedule = cfg->schedule;
  r.poison = cfg->poison_shared != 0;
  r.invoke = invoke;
  r.invoke_ctx = ctx;
  blockDim = dim3(bx, by, bz);
  gridDim = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
  for (int w = 0; w < 32; ++w) {
    int lanes = n - w * 32;
    r.warp_exist[w] = lanes >= 32 ? 0xffffffffu : lanes > 0 ? (1u << lanes) - 1 : 0u;
  }
  for (int i = 0; i < n; ++i) {
    r.th[i].idx = uint3{uint32_t(i) % bx, (uint32_t(i) / bx) % by, uint32_t(i) / (bx * by)};
  }
  // Exactly-sized heap buffer: AddressSanitizer sees accesses past the dynamic shared memory.
  void* smem = nullptr;
  if (posix_memalign(&smem, 128, cfg->shared_mem ? cfg->shared_mem : 1) != 0) {
    set_error(ERR_LAUNCH, "cannot allocate dynamic shared memory");
    return r.err;
  }
  r.dyn_smem = static_cast<char*>(smem);
  r.dyn_size = cfg->shared_mem;
#if CUDAEMU_ASAN
  {
    pthread_attr_t attr;
    void* lo = nullptr;
    size_t sz = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      pthread_attr_getstack(&attr, &lo, &sz);
      pthread_attr_destroy(&attr);
    }
    r.main_stack_lo = lo;
    r.main_stack_size = sz;
  }
#endif
  {
    SignalGuard guard(cfg->timeout_s);
    if (sigsetjmp(r.jb, 1) == 0) {
      for (uint32_t z = 0; z < cfg->grid[2] && r.err == OK; ++z)
        for (uint32_t y = 0; y < cfg->grid[1] && r.err == OK; ++y)
          for (uint32_t x = 0; x < cfg->grid[0] && r.err == OK; ++x) {
            blockIdx = uint3{x, y, z};
            ++r.block_serial;
            if (cfg->poison_shared) {
              memset(r.dyn_smem, 0xff, cfg->shared_mem);
              if (size_t k = static_shared_bytes()) memset(__start_cudaemu_shared, 0xff, k);
            }
            for (int i = 0; i < n; ++i) {
              FThread& t = r.th[i];
              t.state = ST_RUN;
              char* lo = r.stacks + size_t(i) * r.stride + 4096;
              fiber_init(&t.ctx, lo, lo + r.stack_bytes, fiber_main, nullptr);
            }
            for (int w = 0; w < 16; ++w) r.runnable[w] = 0;
            for (int i = 0; i < n; ++i) set_runnable(i);
            for (int w = 0; w < 32; ++w) r.warp_waiting[w] = 0;
            r.sync_waiting = 0;
            r.exited = 0;
            r.in_fiber = 1;
            switch_fibers(&r.sched, 0, false);
            r.in_fiber = 0;
            if (r.err == OK && r.exited != n) {
              static Text report;
              report.len = 0;
              deadlock_report(report);
              set_error(ERR_DEADLOCK, report.buf);
            }
          }
    }
    r.in_fiber = 0;
  }
  free(r.dyn_smem);
  r.dyn_smem = nullptr;
  fflush(stdout);  // kernel printf output appears before Python's own
  return r.err;
}

template <class T>
inline T load_arg(void* p) {
  T v;
  memcpy(static_cast<void*>(&v), p, sizeof(T));
  return v;
}

template <class... P, size_t... I>
inline std::tuple<P...> unpack_args(void** args, std::index_sequence<I...>) {
  return std::tuple<P...>(load_arg<P>(args[I])...);
}

template <class... P>
inline int launch(void (*fn)(P...), const LaunchCfg* cfg, void** args) {
  using Tup = std::tuple<std::remove_cv_t<P>...>;
  Tup tup = unpack_args<std::remove_cv_t<P>...>(args, std::index_sequence_for<P...>{});
  struct Ctx { void (*fn)(P...); Tup* tup; } ctx{fn, &tup};
  return run_grid(cfg, [](void* c) { auto* x = static_cast<Ctx*>(c); std::apply(x->fn, *x->tup); }, &ctx);
}

// Parameter signature for the Python side's argument check: "<kind><size>" per parameter,
// kind p(ointer) f(loat) i(nt) u(nsigned) b(ool) o(ther).
template <class T>
inline void sig_one(Text& s) {
  char k = std::is_pointer_v<T> ? 'p'
         : std::is_same_v<T, bool> ? 'b'
         : std::is_floating_point_v<T> || std::is_same_v<T, _Float16> ? 'f'
         : std::is_integral_v<T> && std::is_signed_v<T> ? 'i'
         : std::is_integral_v<T> ? 'u'
         : 'o';
  s.add("%s%c%zu", s.len ? "," : "", k, sizeof(T));
}
template <class... P>
inline const char* signature(void (*)(P...)) {
  static Text s;
  if (s.len == 0) (sig_one<std::remove_cv_t<P>>(s), ...);
  return s.buf;
}

}  // namespace cudaemu

#endif  // CUDAEMU_RUNTIME_H
