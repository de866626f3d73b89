"""Greedy sampling's argmax: each row's index of its first maximum, torch.argmax's answer (the
first NaN where a row holds one), computed by the C++ kernel of kernels/cpu/argmax_cpu.cpp for
float32 and bfloat16 logits on the CPU and by torch.argmax everywhere else.

Why a kernel: torch.argmax over a decode step's [64, 49152] logits is several times slower than
the kernel, a visible part of the step (docs/log/2026-11-25-fused-silu-amx-epilogue.md,
docs/log/2026-11-27-figures-from-code-comments.md). PAGEDRUN_CPU_ARGMAX=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import load_library

SOURCE = cpu_build.KERNEL_DIR / "argmax_cpu.cpp"


class CpuArgmax:
    def __init__(self, so_path) -> None:
        lib = load_library(so_path)  # the very file the cache checked (build/cache.py)
        lib.argmax_rows_f32.restype = ctypes.c_int
        lib.argmax_rows_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
        lib.argmax_rows_bf16.restype = ctypes.c_int
        lib.argmax_rows_bf16.argtypes = lib.argmax_rows_f32.argtypes
        self.lib = lib
        self.by_dtype = {torch.float32: lib.argmax_rows_f32, torch.bfloat16: lib.argmax_rows_bf16}


_load_error: str | None = None


def load_error() -> str | None:
    """Why `load()` returned None (None when it has not failed)."""
    return _load_error


@functools.lru_cache(maxsize=1)
def load() -> CpuArgmax | None:
    """Build (once per machine and source) and load the kernel; None where that is impossible."""
    global _load_error
    lib, _load_error = cpu_build.load("PAGEDRUN_CPU_ARGMAX", SOURCE, CpuArgmax)
    return lib


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64 on logits' device: the index of each row's first maximum."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
            and (logits.dtype is torch.float32 or logits.dtype is torch.bfloat16)):
        kern = load()
        if kern is not None:
            out = torch.empty(logits.shape[0], dtype=torch.long)
            if kern.by_dtype[logits.dtype](logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                           out.data_ptr(), torch.get_num_threads()) == 0:
                return out
    return logits.argmax(dim=-1)
