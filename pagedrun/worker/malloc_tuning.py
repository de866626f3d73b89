"""glibc malloc settings for a process that runs model steps on the CPU.

Torch allocates every activation of a step with malloc and frees it a moment later. glibc serves a
request above its mmap threshold (128 KiB at start, raised on the fly towards 32 MiB as mmapped
blocks are freed) with a fresh mmap, and gives free memory at the top of the heap back to the
kernel once it exceeds the trim threshold. Either way the next step's activations land on pages the
kernel must fault in and zero again: on the 29M bench model, 130,000-540,000 page faults and
0.5-1.9 s of system time in a 8-9 s run, depending on how glibc's threshold happened to move
(docs/design/cpu-kernels.md). Fixing the two thresholds keeps a step's freed activations in the heap for
the next step: 76,000-91,000 faults (mostly the KV cache's first touch) and 0.25-0.35 s.

What it costs: freed activations stay in the heap instead of going back to the kernel, and the heap
fragments a little, so peak RSS grows: 688-764 MiB against 640-678 MiB with glibc's defaults on the
29M bench run (+50-90 MiB, about a tenth). Against that, the run no longer lands in glibc's bad
mode (about half of the default runs: 520,000 faults, 8.1-8.7 s instead of 7.5-8.0 s). Blocks above
MMAP_THRESHOLD (the KV cache) are still mmapped, so still committed only as they are written.
Only pagedrun's engine sets them: applied to HF transformers' process, they made HF `generate`
(static batch 64) about 6% slower (25.1-25.3 s -> 26.5-27.2 s), so `pagedrun bench` runs HF with
glibc's defaults.

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
