"""KVCacheManager: which physical blocks each sequence's KV lives in. No tensors here.

The scheduler asks it questions (can_allocate, can_append_slots, can_swap_in/out) and then
orders the change; the changes return the block moves that CacheEngine must perform (copy-on-write
pairs, swap mappings). Every operation checks before it touches anything, so an operation that
cannot complete raises NoFreeBlocksError with every structure unchanged (seed 001's rule).

Prefix caching follows vLLM v1 (kv/prefix_cache.py): full blocks are registered under chained
hashes once their KV has been computed; a new prompt takes matching blocks by reference. The
invariants and the state snapshot live in kv/invariants.py, the counters in kv/stats.py.

Swap follows vLLM v0 (the seeds): a request's sequences move to a second BlockPool (CPU, no
caching) together, and a block shared by several of them moves once and stays shared.

One manager keeps the tables of one KV cache group (kv/groups.py; vLLM's single-type manager).
With `window` it is a sliding-window group: remove_skipped_blocks gives back the blocks the window
has left (NULL_BLOCK in their place), admission reserves only the prefix-cache hit (the scheduler
appends each chunk), and a sequence needs about window / block_size blocks however long it gets.
Several groups over one pool are coordinated by kv/hybrid.py.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

from pagedrun.kv import invariants
from pagedrun.kv.block_pool import BlockPool, InvariantError, KVCacheBlock, NoFreeBlocksError
from pagedrun.kv.block_table import NULL_BLOCK, BlockTable
from pagedrun.kv.groups import group_blocks
from pagedrun.kv.hashing import HashFn, hash_block_tokens
from pagedrun.kv.prefix_cache import CacheProgress, cache_blocks, find_longest_cache_hit, find_window_hit
from pagedrun.kv.stats import KVStats

__all__ = ["KVCacheManager", "KVStats", "NoFreeBlocksError", "InvariantError"]


class PoolCounts:
    """What the scheduler and the report read of the pools (gpu_pool, cpu_pool, num_gpu_blocks):
    shared by one group's manager and the coordinator of several (kv/hybrid.py)."""

    gpu_pool: BlockPool
    cpu_pool: BlockPool
    num_gpu_blocks: int

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.num_free_blocks

    @property
    def num_gpu_blocks_touched(self) -> int:
        """Blocks [0, n) have been handed out at least once (their memory has been written)."""
        return self.gpu_pool.num_blocks_touched

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self.gpu_pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.gpu_pool.num_cached_free_blocks


class KVCacheManager(PoolCounts):
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_fn: Optional[HashFn] = None,
        *,
        window: int = 0,
        max_chunk: Optional[int] = None,
        gpu_pool: Optional[BlockPool] = None,
        cpu_pool: Optional[BlockPool] = None,
        group_id: int = 0,
    ):
        """window: 0 (full attention) or the group's sliding window in tokens; max_chunk: the most
        tokens a sequence computes in one step (the scheduler's token budget), which bounds what a
        sliding group holds; gpu_pool / cpu_pool: pools shared with the other groups (kv/hybrid.py),
        group_id: this group's index (its prefix-cache entries are keyed by it)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hits_disabled = False  # set by no_prefix_hits(): admission without prefix-cache hits
        self.watermark = watermark
        # Admission keeps this many blocks free so running sequences can still grow (vLLM v0).
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.window = window
        self.max_chunk = max_chunk
        base_hash: HashFn = hash_fn if hash_fn is not None else hash_block_tokens
        # A sliding group's right-to-left search matches its window's first block by hash alone:
        # only with the SHA-256 chain (an injected weak hash keeps the left-to-right search).
        self._strong_hash = base_hash is hash_block_tokens
        # Groups share one pool and one hash map: another group's entry for the same tokens holds
        # other layers' K/V, so each group > 0 salts its hashes with its index.
        self.hash_fn: HashFn = base_hash if group_id == 0 else _salted(base_hash, ("kv_group", group_id))
        self.gpu_pool = gpu_pool if gpu_pool is not None else BlockPool(num_gpu_blocks, enable_prefix_caching)
        self.cpu_pool = cpu_pool if cpu_pool is not None else BlockPool(num_cpu_blocks, enable_caching=False)
        self.stats = KVStats()
        self._tables: dict[int, BlockTable] = {}
        self._swapped: set[int] = set()  # seq_ids whose table points into cpu_pool
        self._progress: dict[int, CacheProgress] = {}

    # ------------------------------------------------------------------ queries
    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def get_block_table(self, seq_id: int) -> list[int]:
        """The table as the kernels read it: block 0 stands in for each NULL_BLOCK entry (below the
        window of every query to come, never read)."""
        table = self._table(seq_id)
        if table.num_null:
            return [0] * table.num_null + table.block_ids[table.num_null :]
        return list(table.block_ids)

    def num_left_window(self, seq_id: int) -> int:
        """Entries of the sequence's table given back because the window left them."""
        return self._table(seq_id).num_null

    def get_block_tables(self, seq_id: int) -> list[list[int]]:
        """One table per KV cache group (here, this manager's one group)."""
        return [self.get_block_table(seq_id)]

    def get_num_tokens(self, seq_id: int) -> int:
        return self._table(seq_id).num_tokens

    def shared_prefix_blocks(self, seq_id: int) -> list[int]:
        """The leading device blocks of a sequence that other block tables hold too (ref_cnt > 1).
        Blocks are only ever shared as a prefix: prefix-cache hits are leading blocks of the hitting
        sequence and, by the chained hashes, of the one it hits; a fork shares all the parent's
        blocks and copy-on-write gives each sequence its own copy of the one it writes next. So
        these are all of the sequence's shared blocks, found without walking its whole table."""
        return self._shared_run(self._gpu_table(seq_id))

    def _shared_run(self, table: BlockTable) -> list[int]:
        """The leading live blocks of `table` whose ref_cnt is above 1."""
        blocks = self.gpu_pool.blocks
        out = []
        for b in table.live_block_ids:
            if blocks[b].ref_cnt <= 1:
                break
            out.append(b)
        return out

    def held_slots(self, seqs: list[tuple[int, int]]) -> tuple[int, int, int]:
        """Over the sequences given as (seq_id, tokens computed): (slots holding computed KV, slots
        assigned, table entries given back to the window), a block several of them hold counted once,
        at its fullest holder's fill. Only a leading run of each table can be shared
        (shared_prefix_blocks), so the cost is one look per sequence plus its shared blocks: the
        report reads this after every step (engine/occupancy.py)."""
        bs, tables, blocks = self.block_size, self._tables, self.gpu_pool.blocks
        stored = assigned = left = 0
        shared: dict[int, list[tuple[int, int]]] = {}  # block -> (assigned, stored) of each holder
        for seq_id, computed in seqs:
            table = tables[seq_id]
            slots, gone, ids = table.num_tokens, table.num_null, table.block_ids
            first = gone * bs  # the first position whose block the table still holds
            left += gone
            stored += max(0, computed - first)
            assigned += max(0, slots - first)
            if len(ids) > gone and blocks[ids[gone]].ref_cnt > 1:  # most tables share nothing: one look
                for i, b in enumerate(self._shared_run(table), gone):
                    shared.setdefault(b, []).append((min(bs, max(0, slots - i * bs)),
                                                     min(bs, max(0, computed - i * bs))))
        for fills in shared.values():  # counted once per holder above; keep the fullest holder's
            a = [f[0] for f in fills]
            c = [f[1] for f in fills]
            assigned -= sum(a) - max(a)
            stored -= sum(c) - max(c)
        return stored, assigned, left

    def get_slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slots of positions start .. end-1 of a sequence on the GPU (its slot_mapping)."""
        return self._gpu_table(seq_id).slots(start, end)

    def is_swapped(self, seq_id: int) -> bool:
        self._table(seq_id)
        return seq_id in self._swapped

    def get_num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _find_cached_blocks(self, token_ids: Sequence[int], max_blocks: Optional[int] = None
                            ) -> tuple[list[Any], list[Any]]:
        if not self.enable_prefix_caching:
            return [], []
        if self.window and self._strong_hash:
            limit = len(token_ids) if max_blocks is None else max_blocks
            return find_window_hit(self.gpu_pool, self.hash_fn, self.block_size, token_ids, self.window, limit)
        hits, hashes = find_longest_cache_hit(self.gpu_pool, self.hash_fn, self.block_size, token_ids)
        if max_blocks is not None:
            hits, hashes = hits[:max_blocks], hashes[:max_blocks]
        return hits, hashes

    def get_num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        hits, _ = self._find_cached_blocks(token_ids)
        return len(hits) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the full blocks within the first num_computed_tokens whose KV now exists."""
        if not self.enable_prefix_caching:
            return
        table = self._table(seq_id)
        if seq_id in self._swapped:
            return
        prog = self._progress[seq_id]
        if prog.num_cached_blocks < table.num_null:
            prog.broken = True  # the window let a block go before it was registered: the chain ends
        if prog.broken or min(num_computed_tokens, len(token_ids), table.num_tokens) // self.block_size \
                <= prog.num_cached_blocks:
            return  # no block became full (most decode steps): nothing to register
        cache_blocks(self.gpu_pool, self.hash_fn, table, prog, token_ids, num_computed_tokens)
        self._sync_evictions()  # a stale entry may have been dropped for ours

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry held by a free block; returns how many were dropped."""
        return self.gpu_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ admission
    def find_hits(self, token_ids: Sequence[int], max_blocks: Optional[int] = None) -> tuple[list[Any], list[Any]]:
        """The leading prefix-cache hits of a prompt in this group, at most max_blocks (blocks,
        hashes; a sliding group's blocks below the window are None); changes nothing."""
        if len(token_ids) == 0:
            raise ValueError("cannot allocate a sequence with no tokens")
        if self.hits_disabled:
            return [], []
        return self._find_cached_blocks(token_ids, max_blocks)

    @contextlib.contextmanager
    def no_prefix_hits(self):
        """Admit without prefix-cache hits inside this block (a request whose every prompt position
        must be computed: prompt_logprobs, as vLLM). Its full blocks still enter the cache."""
        self.hits_disabled = True
        try:
            yield
        finally:
            self.hits_disabled = False

    def plan_allocate(self, token_ids: Sequence[int], hits: list[KVCacheBlock]) -> tuple[int, int, int]:
        """(blocks taken out of the free queue by allocate with these hits, new blocks among them,
        hits skipped as below the window). A full group reserves the whole prompt; a sliding group
        reserves the hits it keeps, and counts the blocks of the first chunk the scheduler appends
        next, so that admission does not promise what the first step cannot get."""
        num_cached = len(hits) * self.block_size
        skip = self._num_skipped(num_cached) if self.window else 0
        if self.window:
            first = len(token_ids) if self.max_chunk is None else min(len(token_ids), num_cached + self.max_chunk)
            num_new = self.get_num_required_blocks(first) - len(hits)
        else:
            num_new = self.get_num_required_blocks(len(token_ids)) - len(hits)
        # Touching a hit that sits in the free queue takes it out of the free count too.
        num_free_hits = sum(1 for b in hits[skip:] if b.ref_cnt == 0)
        return num_free_hits + num_new, num_new, skip

    def _plan_allocate(self, token_ids: Sequence[int]) -> tuple[list[KVCacheBlock], list[Any], int, int]:
        """(hits, their hashes, new blocks needed, free blocks left after allocate)."""
        hits, hashes = self.find_hits(token_ids)
        taken, num_new, _ = self.plan_allocate(token_ids, hits)
        return hits, hashes, num_new, self.gpu_pool.num_free_blocks - taken

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        *_, free_after = self._plan_allocate(token_ids)
        return free_after >= 0 and free_after >= self.watermark_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Give seq_id a table covering len(token_ids) slots (a sliding group: its prefix-cache hits);
        returns the number of cached tokens."""
        if seq_id in self._tables:
            raise ValueError(f"seq_id {seq_id} already has a block table")
        hits, hashes, num_new, free_after = self._plan_allocate(token_ids)
        if free_after < 0:
            raise NoFreeBlocksError(
                f"allocate seq {seq_id}: needs {num_new} new blocks (+{len(hits)} cached), "
                f"{self.gpu_pool.num_free_blocks} free"
            )
        return self.allocate_with_hits(seq_id, token_ids, hits, hashes)

    def touch_hits(self, token_ids: Sequence[int], hits: list[KVCacheBlock]) -> None:
        """Take the hits this group keeps out of the free queue (before any group takes new blocks,
        which could evict them)."""
        self.gpu_pool.touch(hits[self.plan_allocate(token_ids, hits)[2]:])

    def allocate_with_hits(self, seq_id: int, token_ids: Sequence[int], hits: list[KVCacheBlock],
                           hashes: list[Any], touched: bool = False) -> int:
        """allocate() with the hits already chosen (the coordinator truncates every group's to the
        shortest, and touches them all first: touched=True); the caller has checked that the
        blocks are there."""
        if seq_id in self._tables:
            raise ValueError(f"seq_id {seq_id} already has a block table")
        _, num_new, skip = self.plan_allocate(token_ids, hits)
        if not touched:  # the hits must leave the free queue before get_new_blocks could evict them
            self.gpu_pool.touch(hits[skip:])
        if self.window:  # the first chunk's blocks come from append_slots, as every later chunk's
            table = BlockTable(self.block_size, [NULL_BLOCK] * skip + [b.block_id for b in hits[skip:]],
                               len(hits) * self.block_size, skip)
        else:
            new_blocks = self._get_new_gpu_blocks(num_new)
            table = BlockTable(self.block_size, [b.block_id for b in hits + new_blocks], len(token_ids))
        self._tables[seq_id] = table
        prog = CacheProgress()
        if hits:
            prog = CacheProgress(len(hits), hashes[-1], hits[-1], hits[-1].cache_id)
        self._progress[seq_id] = prog
        num_cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
        self.stats.allocations += 1
        return num_cached

    # ------------------------------------------------------------------ growth
    def _plan_append(self, table: BlockTable, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks for growth, whether the block receiving the first new token is copied)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return 0, False
        pos = table.num_tokens
        idx = pos // self.block_size
        cow = idx < len(table.block_ids) and self.gpu_pool.blocks[table.block_ids[idx]].ref_cnt > 1
        grow = table.num_blocks_for(pos + num_new_tokens) - len(table.block_ids)
        return grow, cow

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool:
        grow, cow = self._plan_append(self._gpu_table(seq_id), num_new_tokens)
        return grow + int(cow) <= self.gpu_pool.num_free_blocks

    def append_slots(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve num_new_tokens more slots; returns copy-on-write pairs [(src, dst)] (0 or 1)."""
        pairs = self.try_append_slots(seq_id, num_new_tokens)
        if pairs is None:
            grow, cow = self._plan_append(self._gpu_table(seq_id), num_new_tokens)
            raise NoFreeBlocksError(
                f"append_slots seq {seq_id}: needs {grow + int(cow)} blocks, {self.gpu_pool.num_free_blocks} free"
            )
        return pairs

    def try_append_slots(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """append_slots when the blocks are there, else None and nothing changed: one plan where
        can_append_slots + append_slots would make two (the scheduler's per-sequence step)."""
        table = self._tables.get(seq_id)
        if table is not None and num_new_tokens > 0 and seq_id not in self._swapped:
            # Most decode steps: the new slots fit the last block, which no other table holds.
            pos, ids, bs = table.num_tokens, table.block_ids, self.block_size
            if pos + num_new_tokens <= len(ids) * bs and self.gpu_pool.blocks[ids[pos // bs]].ref_cnt <= 1:
                table.num_tokens = pos + num_new_tokens
                return []
        table = self._gpu_table(seq_id)
        grow, cow = self._plan_append(table, num_new_tokens)
        if grow + int(cow) > self.gpu_pool.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        if cow:
            # A fork sibling still reads this partly filled block: write into a private copy.
            idx = table.num_tokens // self.block_size
            old = self.gpu_pool.blocks[table.block_ids[idx]]
            (new,) = self._get_new_gpu_blocks(1)
            table.block_ids[idx] = new.block_id
            self.gpu_pool.free_blocks([old])
            pairs.append((old.block_id, new.block_id))
            self.stats.cow_copies += 1
        if grow:  # most decode steps fill the last block without a new one
            table.block_ids.extend(b.block_id for b in self._get_new_gpu_blocks(grow))
        table.num_tokens += num_new_tokens
        return pairs

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (copy-on-write later, in append_slots)."""
        if child_seq_id in self._tables:
            raise ValueError(f"seq_id {child_seq_id} already has a block table")
        parent = self._table(parent_seq_id)
        pool = self.cpu_pool if parent_seq_id in self._swapped else self.gpu_pool
        pool.touch(pool.blocks[b] for b in parent.live_block_ids)
        self._tables[child_seq_id] = parent.copy()
        self._progress[child_seq_id] = self._progress[parent_seq_id].copy()
        if parent_seq_id in self._swapped:
            self._swapped.add(child_seq_id)
        self.stats.forks += 1

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, tail first, and drop its table. Unknown ids are ignored
        (a sequence may finish before it was ever allocated)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        pool = self.cpu_pool if seq_id in self._swapped else self.gpu_pool
        pool.free_blocks(pool.blocks[b] for b in reversed(table.live_block_ids))
        self._swapped.discard(seq_id)
        del self._progress[seq_id]
        self.stats.frees += 1

    # ------------------------------------------------------------------ swap
    def _unique_blocks(self, seq_ids: list[int], swapped: bool) -> list[int]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate seq_ids in {seq_ids}")
        seen: dict[int, None] = {}
        for sid in seq_ids:
            table = self._table(sid)
            if (sid in self._swapped) != swapped:
                raise ValueError(f"seq {sid} is {'not ' if swapped else ''}swapped out")
            for b in table.live_block_ids:
                seen.setdefault(b, None)
        return list(seen)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(self._unique_blocks(seq_ids, swapped=False)) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to CPU; returns [(gpu_block, cpu_block)], one per distinct block."""
        unique = self._unique_blocks(seq_ids, swapped=False)
        if len(unique) > self.cpu_pool.num_free_blocks:
            raise NoFreeBlocksError(f"swap_out: needs {len(unique)} CPU blocks, {self.cpu_pool.num_free_blocks} free")
        mapping = self._move(seq_ids, unique, self.gpu_pool, self.cpu_pool.get_new_blocks(len(unique)), self.cpu_pool)
        self._swapped.update(seq_ids)
        self.stats.swap_out_blocks += len(unique)
        return mapping

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        free_after = self.gpu_pool.num_free_blocks - len(self._unique_blocks(seq_ids, swapped=True))
        return free_after >= 0 and free_after >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks back to the GPU; returns [(cpu_block, gpu_block)]."""
        unique = self._unique_blocks(seq_ids, swapped=True)
        if len(unique) > self.gpu_pool.num_free_blocks:
            raise NoFreeBlocksError(f"swap_in: needs {len(unique)} GPU blocks, {self.gpu_pool.num_free_blocks} free")
        mapping = self._move(seq_ids, unique, self.cpu_pool, self._get_new_gpu_blocks(len(unique)), self.gpu_pool)
        for sid in seq_ids:
            self._swapped.discard(sid)
            # The GPU copies are fresh, unhashed blocks: let cache_blocks register them again.
            self._progress[sid] = CacheProgress()
        self.stats.swap_in_blocks += len(unique)
        return mapping

    def _move(
        self, seq_ids: list[int], unique: list[int], src_pool: BlockPool, dst_blocks: list[KVCacheBlock],
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        mapping = {src: dst.block_id for src, dst in zip(unique, dst_blocks)}
        # get_new_blocks gave each destination one reference; a block held by k of these tables needs k.
        holders = Counter(b for sid in seq_ids for b in self._tables[sid].live_block_ids)
        for src, dst in zip(unique, dst_blocks):
            for _ in range(holders[src] - 1):
                dst_pool.touch([dst])
        for sid in seq_ids:
            table = self._tables[sid]
            src_pool.free_blocks(src_pool.blocks[b] for b in reversed(table.live_block_ids))
            table.block_ids = [NULL_BLOCK] * table.num_null + [mapping[b] for b in table.live_block_ids]
        return list(mapping.items())

    # ------------------------------------------------------------------ the window
    def _num_skipped(self, num_computed_tokens: int) -> int:
        """Leading blocks wholly below the window of the next query (at position num_computed_tokens):
        it sees positions num_computed_tokens - window + 1 onwards."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> int:
        """A sliding group gives back the blocks no later query of the sequence reads (vLLM's
        SlidingWindowManager does it before counting blocks for a step; the engine calls it after
        each step, which is as early as it can be known). Returns how many blocks were freed."""
        if not self.window or seq_id in self._swapped:
            return 0
        table = self._table(seq_id)
        skip = min(self._num_skipped(num_computed_tokens), len(table.block_ids))
        if skip <= table.num_null:
            return 0
        gone = table.block_ids[table.num_null : skip]
        self.gpu_pool.free_blocks(self.gpu_pool.blocks[b] for b in reversed(gone))
        table.block_ids[table.num_null : skip] = [NULL_BLOCK] * len(gone)
        table.num_null = skip
        self.stats.window_freed_blocks += len(gone)
        return len(gone)

    def blocks_to_finish(self, prompt_len: int, num_tokens: int, n: int) -> int:
        """Blocks a request of n sequences needs at its longest (num_tokens each) with the cache to
        itself: the n share the prompt's full blocks in a full group; in a sliding group each holds
        its window (the prompt's blocks are gone by then)."""
        if self.window:
            return n * group_blocks(self.window, num_tokens, self.block_size, self.max_chunk or num_tokens)
        per_seq = self.get_num_required_blocks(num_tokens)
        return per_seq + (n - 1) * (per_seq - prompt_len // self.block_size)

    # ------------------------------------------------------------------ internals
    def _table(self, seq_id: int) -> BlockTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq_id {seq_id}") from None

    def _gpu_table(self, seq_id: int) -> BlockTable:
        table = self._table(seq_id)
        if seq_id in self._swapped:
            raise ValueError(f"seq {seq_id} is swapped out")
        return table

    def _get_new_gpu_blocks(self, n: int) -> list[KVCacheBlock]:
        blocks = self.gpu_pool.get_new_blocks(n)
        self.stats.allocated_blocks += n
        self._sync_evictions()
        self.stats.peak_used_gpu_blocks = max(self.stats.peak_used_gpu_blocks, self.num_used_gpu_blocks)
        return blocks

    def _sync_evictions(self) -> None:
        self.stats.evictions = self.gpu_pool.num_evictions

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise InvariantError naming the first violated invariant (see docs/design/architecture.md)."""
        invariants.check_invariants(self._tables, self._swapped, self._progress, self.gpu_pool, self.cpu_pool,
                                    self.block_size, self.window)

    def snapshot(self) -> tuple:
        """Every piece of state, as plain comparable values (tests assert failed ops change nothing)."""
        return invariants.snapshot(self._tables, self._swapped, self._progress, self.gpu_pool, self.cpu_pool,
                                   self.stats)


def _salted(hash_fn: HashFn, salt: tuple) -> HashFn:
    def salted(parent_hash, token_ids, extra_keys=None):
        return hash_fn(parent_hash, token_ids, (salt,) + tuple(extra_keys or ()))
    return salted
