"""The machine's measured arithmetic roof for `pagedrun bench`: kernels/cpu/fma_peak.cpp, built like
the CPU kernels (pagedrun.build.cpu, the same ISA flags), runs independent FMA chains in registers
on every thread; the best of a few timed runs is the peak FLOP/s no kernel built the same way can beat.

fp32 uses the widest FMA the build has (AVX-512, AVX2 + FMA, or plain SSE). bf16 is the fp32 roof
where the CPU has no bf16 arithmetic (a bf16 model's matmuls then run on fp32 FMAs over widened
bf16). With avx512_bf16 and no AMX it is the higher of vdpbf16ps (two products per fp32 lane) and
the fp32 FMAs: the bf16 GEMM takes whichever path is faster on the machine (kernels/cpu/
bf16_gemm.h), and on a Sapphire Rapids-class core vdpbf16ps's roof is half the FMAs'. Where the
CPU has AMX (amx_tile + amx_bf16), the bf16 GEMM runs on tiles, and the bf16 roof is TDPBF16PS on
tiles held in registers.
"""
from __future__ import annotations

import ctypes
import time

from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import load_library

SOURCE = cpu_build.KERNEL_DIR / "fma_peak.cpp"


def measure(dtype: str, threads: int, seconds: float = 0.5) -> dict:
    """{"flops_per_s", "isa", "lanes", "bf16_dot", "amx", "threads"} for dtype float32 / bfloat16 / float16
    (float16 has no CPU FMA of its own here: the fp32 roof). Raises RuntimeError without a compiler."""
    lib = load_library(cpu_build.build(SOURCE))
    lib.fma_peak_run.restype = ctypes.c_double
    lib.fma_peak_run.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lanes, bf16_dot, amx = lib.fma_peak_lanes(), bool(lib.fma_peak_has_bf16_dot()), bool(lib.fma_peak_has_amx())
    bf16 = int(dtype == "bfloat16")
    best = _best_rate(lib, threads, bf16, seconds)
    isa = {16: "AVX-512", 8: "AVX2+FMA", 4: "SSE"}.get(lanes, f"{lanes} lanes")
    if bf16 and amx:
        isa = "AMX bf16 tiles (tdpbf16ps)"
    elif bf16 and bf16_dot:
        fmas = _best_rate(lib, threads, 0, seconds)
        if fmas > best:
            best, isa = fmas, isa + " FMAs (above its bf16 dot, vdpbf16ps)"
        else:
            isa += " bf16 dot (vdpbf16ps)"
    return {"flops_per_s": best, "isa": isa, "lanes": lanes, "bf16_dot": bool(bf16) and bf16_dot,
            "amx": bool(bf16) and amx, "threads": threads, "dtype": dtype}


def _best_rate(lib, threads: int, bf16: int, seconds: float) -> float:
    """The best FLOP/s of fma_peak_run's chains (bf16: its bf16 arithmetic) over `seconds`."""
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
            return best
