"""glibc malloc settings for a process that runs model steps on the CPU.

Torch allocates every activation of a step with malloc and frees it a moment later. glibc serves a
request above its mmap threshold (128 KiB at start, raised on the fly towards 32 MiB as mmapped
blocks are freed) with a fresh mmap, and gives free memory at the top of the heap back to the
kernel once it exceeds the trim threshold. Either way the next step's activations land on pages the
kernel must fault in and zero again: on the 29M bench model, hundreds of thousands of page faults
and a large share of the run in system time, depending on how glibc's threshold happened to move.
Fixing the two thresholds keeps a step's freed activations in the heap for the next step, leaving
mostly the KV cache's first touch (docs/log/2026-11-21-packed-weights-malloc-thresholds.md).

What it costs: freed activations stay in the heap instead of going back to the kernel, and the heap
fragments a little, so peak RSS grows (about a tenth on the 29M bench run). Against that, the run
no longer lands in glibc's bad mode (about half of the default runs, each slower). Blocks above
MMAP_THRESHOLD (the KV cache) are still mmapped, so still committed only as they are written.
Only pagedrun's engine sets them: applied to HF transformers' process, they made HF `generate`
(static batch 64) slower, so `pagedrun bench` runs HF with glibc's defaults
(docs/log/2026-11-21-packed-weights-malloc-thresholds.md).

PAGEDRUN_MALLOC_TUNING=0 leaves glibc's defaults alone. Not glibc (musl, macOS): nothing to do.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from pagedrun.build import cpu as cpu_build

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit: every activation up to 32 MiB
TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


@functools.lru_cache(maxsize=1)
def tune_glibc_malloc() -> dict[str, int] | None:
    """Apply the settings (once per process); what was set, or None when nothing was."""
    if cpu_build.disabled("PAGEDRUN_MALLOC_TUNING"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 when glibc rejects the value.
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return {"mmap_threshold_bytes": MMAP_THRESHOLD, "trim_threshold_bytes": TRIM_THRESHOLD}
