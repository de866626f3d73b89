"""KVStats: the KV cache manager's cumulative counters; the report reads them (vLLM: PrefixCacheStats)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVStats:
    """Cumulative counters (never reset by the manager); the report reads them."""

    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache by allocate()
    prefix_hit_tokens: int = 0  # of those, tokens whose KV was reused
    cow_copies: int = 0  # blocks copied on write
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    evictions: int = 0  # cached blocks whose entry was dropped to reuse the block
    allocations: int = 0  # sequences admitted by allocate()
    allocated_blocks: int = 0  # fresh GPU blocks taken from the free queue (any reason)
    forks: int = 0
    frees: int = 0
    peak_used_gpu_blocks: int = 0
    window_freed_blocks: int = 0  # blocks sliding-window groups gave back as the window moved on

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
