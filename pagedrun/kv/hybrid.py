"""HybridKVCacheManager: several KV cache groups over one BlockPool (vLLM v1's hybrid allocator).

kv/groups.py says which layers form a group; each group keeps its own tables in a KVCacheManager
(full attention, or a sliding window that gives back what its window has left), all drawing on
the same device and swap pools. This class presents the one-manager interface the scheduler and
the engine use, and makes each operation all-or-nothing across the groups: it plans every group's
share, checks the sum against the shared pool, and only then lets each group act.

    sequence ─┬─ group 0 (full)        [ 7 | 3 | 12 | 9 | 4 ]        every block kept
              └─ group 1 (sliding 32)  [ - | - | 15 | 2 | 8 ]        '-' left the window: freed
                                 one BlockPool: 0 1 2 ... num_blocks-1

Prefix caching: each group registers its own full blocks (salted hashes, one pool); a prompt's hit
is the shortest of the groups' leading hits, and a sliding group keeps only the hit blocks inside
the window of the first query to compute. Reserved slots per sequence are the smallest over the
groups (a sliding group reserves each chunk when it is scheduled), and the scheduler's request for
more slots brings every group up to the same count.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Optional

from pagedrun.kv import invariants
from pagedrun.kv.block_pool import BlockPool, NoFreeBlocksError
from pagedrun.kv.groups import KVCacheGroups
from pagedrun.kv.hashing import HashFn
from pagedrun.kv.manager import KVCacheManager, PoolCounts
from pagedrun.kv.stats import KVStats

# Counters that count sequences or prompt tokens, the same in every group: read from the first.
_PER_SEQUENCE = ("prefix_query_tokens", "prefix_hit_tokens", "allocations", "forks", "frees")


class HybridKVCacheManager(PoolCounts):
    def __init__(self, groups: KVCacheGroups, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01, hash_fn: Optional[HashFn] = None,
                 max_chunk: Optional[int] = None):
        self.groups = groups
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu_pool = BlockPool(num_gpu_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.managers = [
            KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching, watermark, hash_fn,
                           window=g.window, max_chunk=max_chunk, gpu_pool=self.gpu_pool, cpu_pool=self.cpu_pool,
                           group_id=i)
            for i, g in enumerate(groups.groups)
        ]
        self.watermark_blocks = self.managers[0].watermark_blocks
        self.has_window = any(g.window for g in groups.groups)
        # Device blocks each group holds now. A block belongs to one group at a time and every
        # operation below is one group's, so the change of the pool's free count across a group's
        # operation is the change of what that group holds (the report's per-group figure).
        self.held = [0] * len(self.managers)

    @contextlib.contextmanager
    def no_prefix_hits(self):
        """KVCacheManager.no_prefix_hits, in every group."""
        for m in self.managers:
            m.hits_disabled = True
        try:
            yield
        finally:
            for m in self.managers:
                m.hits_disabled = False

    def _on(self, g: int, fn, *args):
        before = self.gpu_pool.num_free_blocks
        result = fn(*args)
        self.held[g] += before - self.gpu_pool.num_free_blocks
        return result

    # ------------------------------------------------------------------ queries
    @property
    def stats(self) -> KVStats:
        """The groups' counters combined: blocks summed, per-sequence counts from the first group."""
        out = KVStats()
        first = self.managers[0].stats
        for name in vars(out):
            if name in _PER_SEQUENCE:
                setattr(out, name, getattr(first, name))
            elif name in ("evictions", "peak_used_gpu_blocks"):  # pool-wide already in every group
                setattr(out, name, max(getattr(m.stats, name) for m in self.managers))
            else:
                setattr(out, name, sum(getattr(m.stats, name) for m in self.managers))
        return out

    def num_used_blocks_per_group(self) -> list[int]:
        """Distinct device blocks each group's tables hold, counted by walking them (what `held`
        keeps as it goes; check_invariants compares the two)."""
        return [len({b for sid, t in m._tables.items() if sid not in m._swapped for b in t.live_block_ids})
                for m in self.managers]

    def has_seq(self, seq_id: int) -> bool:
        return self.managers[0].has_seq(seq_id)

    def get_block_tables(self, seq_id: int) -> list[list[int]]:
        return [m.get_block_table(seq_id) for m in self.managers]

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.managers[0].get_block_table(seq_id)

    def get_num_tokens(self, seq_id: int) -> int:
        """Slots every group has reserved (a sliding group reserves chunk by chunk)."""
        return min(m.get_num_tokens(seq_id) for m in self.managers)

    def shared_prefix_blocks(self, seq_id: int) -> list[int]:
        return self.managers[0].shared_prefix_blocks(seq_id)

    def is_swapped(self, seq_id: int) -> bool:
        return self.managers[0].is_swapped(seq_id)

    def get_num_required_blocks(self, num_tokens: int) -> int:
        return self.managers[0].get_num_required_blocks(num_tokens)

    # ------------------------------------------------------------------ prefix cache
    def _hits(self, token_ids: Sequence[int]):
        """Every group's hit, of one length: the longest all of them have. A sliding group's hit of
        h blocks is not a prefix of its hit of h + 1 (each needs its own window's blocks), so a
        shorter hit elsewhere means searching it again, up to that length, until all agree."""
        found = [m.find_hits(token_ids) for m in self.managers]
        n = min(len(blocks) for blocks, _ in found)
        while any(len(blocks) != n for blocks, _ in found):
            found = [m.find_hits(token_ids, n) for m in self.managers]
            n = min(len(blocks) for blocks, _ in found)
        return found

    def get_num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return len(self._hits(token_ids)[0][0]) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(seq_id, token_ids, num_computed_tokens)

    def reset_prefix_cache(self) -> int:
        return self.gpu_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ admission
    def _free_after_allocate(self, token_ids: Sequence[int]):
        hits = self._hits(token_ids)
        taken = sum(m.plan_allocate(token_ids, blocks)[0] for m, (blocks, _) in zip(self.managers, hits))
        return hits, self.gpu_pool.num_free_blocks - taken

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        _, free_after = self._free_after_allocate(token_ids)
        return free_after >= 0 and free_after >= self.watermark_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> int:
        if self.managers[0].has_seq(seq_id):
            raise ValueError(f"seq_id {seq_id} already has a block table")
        hits, free_after = self._free_after_allocate(token_ids)
        if free_after < 0:
            raise NoFreeBlocksError(f"allocate seq {seq_id}: needs {-free_after} more blocks than are free")
        # Every group touches its hits before any takes new blocks, which could evict them.
        for g, (m, (blocks, _)) in enumerate(zip(self.managers, hits)):
            self._on(g, m.touch_hits, token_ids, blocks)
        cached = [self._on(g, m.allocate_with_hits, seq_id, token_ids, blocks, hashes, True)
                  for g, (m, (blocks, hashes)) in enumerate(zip(self.managers, hits))]
        return min(cached)

    # ------------------------------------------------------------------ growth
    def _plan_append(self, seq_id: int, num_new_tokens: int) -> tuple[list[int], int]:
        target = self.get_num_tokens(seq_id) + num_new_tokens
        counts = [max(0, target - m.get_num_tokens(seq_id)) for m in self.managers]
        need = 0
        for m, n in zip(self.managers, counts):
            grow, cow = m._plan_append(m._gpu_table(seq_id), n)
            need += grow + int(cow)
        return counts, need

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._plan_append(seq_id, num_new_tokens)[1] <= self.gpu_pool.num_free_blocks

    def append_slots(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]]:
        pairs = self.try_append_slots(seq_id, num_new_tokens)
        if pairs is None:
            _, need = self._plan_append(seq_id, num_new_tokens)
            raise NoFreeBlocksError(f"append_slots seq {seq_id}: needs {need} blocks, "
                                    f"{self.gpu_pool.num_free_blocks} free")
        return pairs

    def try_append_slots(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]] | None:
        counts, need = self._plan_append(seq_id, num_new_tokens)
        if need > self.gpu_pool.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        for g, (m, n) in enumerate(zip(self.managers, counts)):
            pairs.extend(self._on(g, m.try_append_slots, seq_id, n) or ())
        return pairs

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> int:
        return sum(self._on(g, m.remove_skipped_blocks, seq_id, num_computed_tokens)
                   for g, m in enumerate(self.managers))

    def blocks_to_finish(self, prompt_len: int, num_tokens: int, n: int) -> int:
        return sum(m.blocks_to_finish(prompt_len, num_tokens, n) for m in self.managers)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        for g, m in enumerate(self.managers):
            self._on(g, m.fork, parent_seq_id, child_seq_id)

    def free(self, seq_id: int) -> None:
        for g, m in enumerate(self.managers):
            self._on(g, m.free, seq_id)

    # ------------------------------------------------------------------ swap
    def _num_unique(self, seq_ids: list[int], swapped: bool) -> int:
        return sum(len(m._unique_blocks(seq_ids, swapped)) for m in self.managers)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self._num_unique(seq_ids, swapped=False) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        need = self._num_unique(seq_ids, swapped=False)
        if need > self.cpu_pool.num_free_blocks:
            raise NoFreeBlocksError(f"swap_out: needs {need} CPU blocks, {self.cpu_pool.num_free_blocks} free")
        return [pair for g, m in enumerate(self.managers) for pair in self._on(g, m.swap_out, seq_ids)]

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        free_after = self.gpu_pool.num_free_blocks - self._num_unique(seq_ids, swapped=True)
        return free_after >= 0 and free_after >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        need = self._num_unique(seq_ids, swapped=True)
        if need > self.gpu_pool.num_free_blocks:
            raise NoFreeBlocksError(f"swap_in: needs {need} GPU blocks, {self.gpu_pool.num_free_blocks} free")
        return [pair for g, m in enumerate(self.managers) for pair in self._on(g, m.swap_in, seq_ids)]

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        invariants.check_groups([(m._tables, m._swapped, m._progress, m.window) for m in self.managers],
                                self.gpu_pool, self.cpu_pool, self.block_size)
        tokens = {sid: t.num_tokens for sid, t in self.managers[0]._tables.items()}
        for i, m in enumerate(self.managers[1:], 1):
            if set(m._tables) != set(tokens):
                raise invariants.InvariantError(f"groups: group {i} holds other sequences than group 0")
        if self.held != self.num_used_blocks_per_group():
            raise invariants.InvariantError(f"groups: held counts {self.held} are not the tables' "
                                            f"{self.num_used_blocks_per_group()}")

    def snapshot(self) -> tuple:
        return tuple(m.snapshot() for m in self.managers)


def make_kv_manager(groups: KVCacheGroups, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                    enable_prefix_caching: bool = True, watermark: float = 0.01,
                    max_chunk: Optional[int] = None) -> KVCacheManager | HybridKVCacheManager:
    """One group: a KVCacheManager (with its window, if any); several: the coordinator."""
    if len(groups.groups) == 1:
        return KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching, watermark,
                              window=groups.groups[0].window, max_chunk=max_chunk)
    return HybridKVCacheManager(groups, num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching,
                                watermark, max_chunk=max_chunk)
