"""Transparent huge pages for torch's large CPU allocations (weights, KV cache, activations).

torch's CPU allocator aligns allocations of 2 MiB or more to 2 MiB and madvise()s them
MADV_HUGEPAGE when THP_MEM_ALLOC_ENABLE=1 (c10/core/alloc_cpu.cpp). A paged KV cache is where that
pays: every block a decode step reads sits somewhere else in a cache of hundreds of MiB, and with
4 KiB pages nearly every block costs a TLB miss; weights stream 100+ MiB per step the same way.
Measured on the project's 2-vCPU machine: a decode step of the bench's 29M model at batch 64
(GEMMs + attention over shuffled blocks) took 44-48 ms against 51-55 ms without (median of 15,
three alternating pairs; docs/cpu-model-ops.md).

The first allocation of 2 MiB or more fixes torch's reading of the variable for the life of the
process, so this runs before the engine (or a bench engine) allocates anything large. A value the
user exported (THP_MEM_ALLOC_ENABLE=0 turns it off) is left alone. Where the kernel's THP mode is
"never" the madvise is a no-op. Memory is still committed lazily, in 2 MiB steps instead of 4 KiB.
"""
from __future__ import annotations

import os

ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> bool:
    """Turn torch's THP allocation on unless the user chose; True when it is on."""
    os.environ.setdefault(ENV, "1")
    return os.environ[ENV].strip() not in ("", "0")


def kernel_thp_mode() -> str | None:
    """The kernel's THP setting (always / madvise / never), None where it cannot be read."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
