"""The machine's measured arithmetic roof for `pagedrun bench`: kernels/cpu/fma_peak.cpp, built like
the CPU kernels (pagedrun.cpu_build, the same ISA flags), runs independent FMA chains in registers
on every thread; the best of a few timed runs is the peak FLOP/s no kernel built the same way can beat.

fp32 uses the widest FMA the build has (AVX-512, AVX2 + FMA, or plain SSE). bf16 is vdpbf16ps where
the CPU has avx512_bf16 (two products per fp32 lane), otherwise the fp32 roof, since a bf16 model's
matmuls then run on fp32 arithmetic. Where the CPU has AMX (amx_tile + amx_bf16), the bf16 GEMM runs
on tiles, and the bf16 roof is TDPBF16PS on tiles held in registers.
"""
from __future__ import annotations

import ctypes
import time

from pagedrun import cpu_build

SOURCE = cpu_build.KERNEL_DIR / "fma_peak.cpp"


def measure(dtype: str, threads: int, seconds: float = 0.5) -> dict:
    """{"flops_per_s", "isa", "lanes", "bf16_dot", "amx", "threads"} for dtype float32 / bfloat16 / float16
    (float16 has no CPU FMA of its own here: the fp32 roof). Raises RuntimeError without a compiler."""
    lib = ctypes.CDLL(str(cpu_build.build(SOURCE)))
    lib.fma_peak_run.restype = ctypes.c_double
    lib.fma_peak_run.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lanes, bf16_dot, amx = lib.fma_peak_lanes(), bool(lib.fma_peak_has_bf16_dot()), bool(lib.fma_peak_has_amx())
    bf16 = int(dtype == "bfloat16")
    sink = ctypes.c_float()
    iters = 100_000
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        flops = lib.fma_peak_run(iters, threads, bf16, ctypes.byref(sink))
        dt = time.perf_counter() - t
        if flops < 0:
            raise RuntimeError("fma_peak_run refused its arguments")
        best = max(best, flops / dt)
        if dt < 0.02:  # too short to time well: lengthen the run
            iters *= 4
        if time.perf_counter() > deadline:
            break
    isa = {16: "AVX-512", 8: "AVX2+FMA", 4: "SSE"}.get(lanes, f"{lanes} lanes")
    if bf16 and amx:
        isa = "AMX bf16 tiles (tdpbf16ps)"
    elif bf16 and bf16_dot:
        isa += " bf16 dot (vdpbf16ps)"
    return {"flops_per_s": best, "isa": isa, "lanes": lanes, "bf16_dot": bool(bf16) and bf16_dot,
            "amx": bool(bf16) and amx, "threads": threads, "dtype": dtype}
