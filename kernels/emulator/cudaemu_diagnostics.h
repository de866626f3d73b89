// cudaemu: what a failed block reports: the deadlock report, and faults (signals) turned into
// launch errors. Included by cudaemu_runtime.h.
#ifndef CUDAEMU_DIAGNOSTICS_H
#define CUDAEMU_DIAGNOSTICS_H
#include <csignal>
#include <csetjmp>
#include <ctime>
#include <ucontext.h>

namespace cudaemu {

// ---------------------------------------------------------------- deadlock report
// "0-15,17" for the ids i (thread ids, or lanes when lanes) with group[i] == g.
inline void add_ranges(Text& s, const int* group, int n, int g, bool lanes, int warp) {
  bool first = true;
  for (int i = 0; i < n;) {
    if (group[i] != g) { ++i; continue; }
    int j = i;
    while (j + 1 < n && group[j + 1] == g) ++j;
    int a = lanes ? i - warp * 32 : i, b = lanes ? j - warp * 32 : j;
    if (a == b) s.add("%s%d", first ? "" : ",", a); else s.add("%s%d-%d", first ? "" : ",", a, b);
    first = false;
    i = j + 1;
  }
}

inline void deadlock_report(Text& s) {
  Runtime& r = g_rt;
  s.add("deadlock in kernel '%s' block (%u,%u,%u) (%d threads): no thread can proceed\n", r.kname, blockIdx.x,
        blockIdx.y, blockIdx.z, r.n);
  // Group waiting threads by (state, kind, site, mask, warp); group -1 = exited.
  static int group[1024];
  static int rep[1024];  // a representative thread per group
  int ngroups = 0;
  bool any_exited = false;
  for (int i = 0; i < r.n; ++i) {
    const FThread& t = r.th[i];
    if (t.state == ST_EXIT) { group[i] = -1; any_exited = true; continue; }
    int g = 0;
    for (; g < ngroups; ++g) {
      const FThread& o = r.th[rep[g]];
      if (o.state == t.state && o.kind == t.kind && same_site(o.site, t.site) &&
          (t.state != ST_WARP || (o.mask == t.mask && (rep[g] >> 5) == (i >> 5)))) break;
    }
    if (g == ngroups) rep[ngroups++] = i;
    group[i] = g;
  }
  bool divergent_warp = false, exited_waited = false;
  int sync_groups = 0;
  for (int g = 0; g < ngroups; ++g) {
    const FThread& t = r.th[rep[g]];
    if (t.state == ST_SYNC) {
      ++sync_groups;
      s.add("  threads ");
      add_ranges(s, group, r.n, g, false, 0);
      s.add(" wait at %s() at %s:%d\n", kKindNames[t.kind], t.site.file, t.site.line);
    } else {
      int warp = rep[g] >> 5;
      s.add("  warp %d lanes ", warp);
      add_ranges(s, group, r.n, g, true, warp);
      s.add(" wait at %s(mask 0x%08x) at %s:%d\n", kKindNames[t.kind], t.mask, t.site.file, t.site.line);
      uint32_t m = t.mask & r.warp_exist[warp];
      for (uint32_t b = m; b; b &= b - 1) {
        const FThread& o = r.th[(warp << 5) + __builtin_ctz(b)];
        if (o.state == ST_EXIT) exited_waited = true;
        else if (o.state == ST_SYNC) divergent_warp = true;
        else if (o.state == ST_WARP && !(o.kind == t.kind && o.mask == t.mask && same_site(o.site, t.site))) divergent_warp = true;
      }
    }
  }
  if (any_exited) {
    s.add("  threads ");
    add_ranges(s, group, r.n, -1, false, 0);
    s.add(" have exited\n");
  }
  if (divergent_warp)
    s.add("  -> divergent warp collective: lanes of one mask wait at different call sites (every lane named in the "
          "mask must call the same *_sync intrinsic at the same place)\n");
  if (exited_waited) s.add("  -> lanes named in a collective's mask exited before reaching it\n");
  if (sync_groups > 1) s.add("  -> __syncthreads in divergent code: threads wait at different __syncthreads call sites\n");
  if (sync_groups > 0 && (ngroups > sync_groups || any_exited))
    s.add("  -> __syncthreads reached by only some threads of the block (barrier in divergent code, or an early return)\n");
  if (s.len && s.buf[s.len - 1] == '\n') s.buf[--s.len] = 0;
}

// ---------------------------------------------------------------- faults
inline struct sigaction g_old_segv, g_old_bus, g_old_fpe, g_old_ill, g_old_alrm;
inline stack_t g_old_altstack;
inline char* g_altstack = nullptr;

inline void fault_handler(int sig, siginfo_t* info, void* uctx) {
  Runtime& r = g_rt;
  if (!r.in_fiber) {  // not ours: restore the previous handler and let the signal happen again
    if (sig != SIGSEGV && sig != SIGBUS && sig != SIGFPE && sig != SIGILL) return;
    struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : sig == SIGFPE ? &g_old_fpe : &g_old_ill;
    sigaction(sig, old, nullptr);
    return;
  }
  char msg[600];
  char where[300];
  snprintf(where, sizeof where, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): ", r.kname, blockIdx.x, blockIdx.y,
           blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  uintptr_t lo = reinterpret_cast<uintptr_t>(r.stacks);
  uintptr_t my_lo = lo + size_t(r.cur) * r.stride + 4096;
#if defined(__x86_64__)
  uintptr_t sp = uintptr_t(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RSP]);
#else
  uintptr_t sp = my_lo;
#endif
  bool in_guard = r.stacks && a >= lo && a < lo + size_t(r.n) * r.stride && (a - lo) % r.stride < 4096;
  if (sig == SIGSEGV && (in_guard || sp < my_lo)) {
    snprintf(msg, sizeof msg, "%sstack overflow (fiber stacks are %zu KiB; set PAGEDRUN_EMU_STACK_KB)", where, r.stack_bytes >> 10);
  } else if (sig == SIGSEGV && a == 0 && info->si_code == SI_KERNEL) {
    snprintf(msg, sizeof msg, "%sgeneral protection fault: misaligned vector access (a 16-byte load/store from an address "
             "that is not 16-byte aligned) or a non-canonical address", where);
  } else if (sig == SIGSEGV) {
    snprintf(msg, sizeof msg, "%sinvalid memory access at address %p (out of bounds or misaligned pointer)", where, info->si_addr);
  } else if (sig == SIGBUS) {
    snprintf(msg, sizeof msg, "%sbus error at address %p (misaligned access?)", where, info->si_addr);
  } else if (sig == SIGFPE) {
    snprintf(msg, sizeof msg, "%sarithmetic exception (integer division by zero?)", where);
  } else if (sig == SIGILL) {
    snprintf(msg, sizeof msg, "%sillegal instruction (reached __builtin_unreachable / __trap?)", where);
  } else {
    snprintf(msg, sizeof msg, "%skernel ran longer than the emulator's timeout (infinite loop, or a spin-wait on another "
             "thread, which cooperative fibers cannot run; set PAGEDRUN_EMU_TIMEOUT)", where);
  }
  r.in_fiber = 0;
  set_error(ERR_FAULT, msg);
  siglongjmp(r.jb, 1);
}

struct SignalGuard {
  timer_t timer{};
  bool has_timer = false;
  int tsig;
  explicit SignalGuard(double timeout_s) {
    tsig = SIGRTMIN + 2;
    if (!g_altstack) g_altstack = static_cast<char*>(malloc(1 << 16));
    stack_t ss{};
    ss.ss_sp = g_altstack;
    ss.ss_size = 1 << 16;
    sigaltstack(&ss, &g_old_altstack);
    struct sigaction sa{};
    sa.sa_sigaction = fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGFPE, &sa, &g_old_fpe);
    sigaction(SIGILL, &sa, &g_old_ill);
    if (timeout_s > 0) {
      sigaction(tsig, &sa, &g_old_alrm);
      struct sigevent sev{};
      sev.sigev_notify = SIGEV_THREAD_ID;
      sev.sigev_signo = tsig;
      sev._sigev_un._tid = static_cast<int>(gettid());
      if (timer_create(CLOCK_MONOTONIC, &sev, &timer) == 0) {
        has_timer = true;
        struct itimerspec its{};
        its.it_value.tv_sec = static_cast<time_t>(timeout_s);
        its.it_value.tv_nsec = static_cast<long>((timeout_s - double(its.it_value.tv_sec)) * 1e9);
        timer_settime(timer, 0, &its, nullptr);
      }
    }
  }
  ~SignalGuard() {
    if (has_timer) {
      timer_delete(timer);
      sigaction(tsig, &g_old_alrm, nullptr);
    }
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
    sigaction(SIGFPE, &g_old_fpe, nullptr);
    sigaction(SIGILL, &g_old_ill, nullptr);
    sigaltstack(&g_old_altstack, nullptr);
  }
};

}  // namespace cudaemu
#endif  // CUDAEMU_DIAGNOSTICS_H
