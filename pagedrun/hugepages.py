"""Transparent huge pages for the CPU KV cache.

A decode step reads every running sequence's blocks, and a sequence's blocks sit anywhere in a cache
of hundreds of MiB: with 4 KiB pages nearly every 16 KiB block read costs TLB misses. Asking the
kernel for 2 MiB pages on the cache's memory (madvise MADV_HUGEPAGE, before anything touches it)
removes most of them. Only the cache: torch's allocator can put every large tensor on huge pages
(THP_MEM_ALLOC_ENABLE=1), and that made MKL's prefill matmuls 20-25% slower here (power-of-two
row strides on physically contiguous memory collide in the L2 cache; docs/cpu-model-ops.md).

Nothing changes where the kernel's THP mode is "never" (or the platform has no madvise); memory is
still committed lazily, on first touch, 2 MiB at a time instead of 4 KiB.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import torch

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14


def kernel_thp_mode() -> str | None:
    """The kernel's THP setting (always / madvise / never), None where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def advise_huge_pages(t: torch.Tensor) -> int:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of a CPU tensor's memory; the bytes
    advised (0 when nothing was: too small, not on the CPU, THP off, no madvise)."""
    if t.device.type != "cpu" or kernel_thp_mode() in (None, "never"):
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        rc = libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(_MADV_HUGEPAGE))
    except (OSError, AttributeError):
        return 0
    return hi - lo if rc == 0 else 0
