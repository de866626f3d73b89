// cudaemu: fiber context switch (one fiber per emulated CUDA thread).
//
// x86-64: a hand-written register swap. Only the callee-saved registers of the SysV ABI
// (rbx, rbp, r12-r15) and rsp need saving because the switch is an ordinary function call
// for the compiler; glibc's swapcontext also saves the signal mask with two syscalls per
// switch, which made it several times slower (docs/log/2026-11-27-figures-from-code-comments.md).
// Other architectures fall back to ucontext (slow but correct).
#ifndef CUDAEMU_FIBER_H
#define CUDAEMU_FIBER_H
#include <cstddef>
#include <cstdint>

namespace cudaemu {

#if defined(__x86_64__) && !defined(CUDAEMU_UCONTEXT)  // -DCUDAEMU_UCONTEXT tests the fallback

extern "C" __attribute__((visibility("hidden"))) void cudaemu_fiber_switch(void** save_sp, void* new_sp);
extern "C" __attribute__((visibility("hidden"))) void cudaemu_fiber_start();

asm(R"(
    .text
    .globl cudaemu_fiber_switch
    .hidden cudaemu_fiber_switch
    .type cudaemu_fiber_switch,@function
    .p2align 4
cudaemu_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudaemu_fiber_switch, .-cudaemu_fiber_switch

    .globl cudaemu_fiber_start
    .hidden cudaemu_fiber_start
    .type cudaemu_fiber_start,@function
    .p2align 4
cudaemu_fiber_start:
    movq %r13, %rdi
    callq *%r12
    ud2
    .size cudaemu_fiber_start, .-cudaemu_fiber_start
)");

struct FiberCtx {
  void* sp = nullptr;
};

// Prepare a fresh context on [stack_lo, stack_hi) that calls fn(arg) on first switch.
inline void fiber_init(FiberCtx* c, char* stack_lo, char* stack_hi, void (*fn)(void*), void* arg) {
  (void)stack_lo;
  uintptr_t top = reinterpret_cast<uintptr_t>(stack_hi) & ~uintptr_t(15);
  // 6 saved registers + return address; after `ret` pops the address rsp is 16-aligned,
  // so the `call` in cudaemu_fiber_start enters fn with the ABI's rsp % 16 == 8.
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  sp[0] = 0;                                   // r15
  sp[1] = 0;                                   // r14
  sp[2] = reinterpret_cast<uint64_t>(arg);     // r13
  sp[3] = reinterpret_cast<uint64_t>(fn);      // r12
  sp[4] = 0;                                   // rbx
  sp[5] = 0;                                   // rbp
  sp[6] = reinterpret_cast<uint64_t>(&cudaemu_fiber_start);
  c->sp = sp;
}

inline void fiber_switch(FiberCtx* from, FiberCtx* to) { cudaemu_fiber_switch(&from->sp, to->sp); }

#else  // portable fallback

}  // namespace cudaemu
#include <ucontext.h>
namespace cudaemu {

struct FiberCtx {
  ucontext_t uc;
};

inline void fiber_init(FiberCtx* c, char* stack_lo, char* stack_hi, void (*fn)(void*), void* arg) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack_lo;
  c->uc.uc_stack.ss_size = static_cast<size_t>(stack_hi - stack_lo);
  c->uc.uc_link = nullptr;
  // makecontext passes int arguments only: split the pointer.
  uintptr_t p = reinterpret_cast<uintptr_t>(arg);
  uintptr_t f = reinterpret_cast<uintptr_t>(fn);
  makecontext(&c->uc, reinterpret_cast<void (*)()>(+[](unsigned flo, unsigned fhi, unsigned lo, unsigned hi) {
                reinterpret_cast<void (*)(void*)>((uintptr_t(fhi) << 32) | flo)(
                    reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo));
              }),
              4, unsigned(f), unsigned(f >> 32), unsigned(p), unsigned(p >> 32));
}

inline void fiber_switch(FiberCtx* from, FiberCtx* to) { swapcontext(&from->uc, &to->uc); }

#endif

}  // namespace cudaemu

#endif  // CUDAEMU_FIBER_H
