"""The KV cache manager's invariants and a comparable snapshot of its whole state (for tests that
assert a failed operation changed nothing). Read-only: nothing here changes the state it checks.

The invariants (docs/design/architecture.md): every block is free xor referenced; ref_cnt == number of
tables holding it; tables cover exactly their tokens; the hash map points only at full blocks with
that hash; the CPU pool never caches.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from pagedrun.kv.block_pool import BlockPool, InvariantError
from pagedrun.kv.block_table import NULL_BLOCK, BlockTable
from pagedrun.kv.prefix_cache import CacheProgress
from pagedrun.kv.stats import KVStats


def check_invariants(tables: dict[int, BlockTable], swapped: set[int], progress: dict[int, CacheProgress],
                     gpu_pool: BlockPool, cpu_pool: BlockPool, block_size: int, window: int = 0) -> None:
    """Raise InvariantError naming the first violated invariant."""
    check_groups([(tables, swapped, progress, window)], gpu_pool, cpu_pool, block_size)


def check_groups(groups: list[tuple[dict[int, BlockTable], set[int], dict[int, CacheProgress], int]],
                 gpu_pool: BlockPool, cpu_pool: BlockPool, block_size: int) -> None:
    """The invariants of several KV cache groups over shared pools (kv/hybrid.py): every table of
    every group, then each pool against the holders counted over all groups (a block is held by one
    group's tables only, since every group takes its own blocks)."""
    gpu_holders: Counter[int] = Counter()
    cpu_holders: Counter[int] = Counter()
    for tables, swapped, progress, window in groups:
        for sid, table in tables.items():
            _check_table(sid, table, sid in swapped, gpu_pool, cpu_pool, block_size, window)
            (cpu_holders if sid in swapped else gpu_holders).update(table.live_block_ids)
            if sid not in progress:
                raise InvariantError(f"bookkeeping: seq {sid} has no cache progress")
        if not swapped <= set(tables):
            raise InvariantError(f"bookkeeping: swapped seqs without tables {swapped - set(tables)}")
        if set(progress) != set(tables):
            raise InvariantError("bookkeeping: cache progress and tables disagree")
    gpu_pool.check_invariants(dict(gpu_holders))
    cpu_pool.check_invariants(dict(cpu_holders))
    for block in gpu_pool.blocks:
        if block.token_ids is not None and len(block.token_ids) != block_size:
            raise InvariantError(f"hash map: hashed block {block.block_id} is not full")
    if cpu_pool.cached_block_hash_to_block:
        raise InvariantError("hash map: the CPU pool must not cache")


def _check_table(sid: int, table: BlockTable, is_swapped: bool, gpu_pool: BlockPool, cpu_pool: BlockPool,
                 block_size: int, window: int) -> None:
    if table.block_size != block_size:
        raise InvariantError(f"table shape: seq {sid} has block_size {table.block_size}")
    if len(table.block_ids) != table.num_blocks_for(table.num_tokens):
        raise InvariantError(
            f"table shape: seq {sid} holds {len(table.block_ids)} blocks for {table.num_tokens} tokens"
        )
    live = table.live_block_ids
    if len(set(live)) != len(live):
        raise InvariantError(f"table shape: seq {sid} holds a block twice: {table.block_ids}")
    # The window: freed entries are a leading run, only in sliding groups, and never reach a block
    # the next query to compute reads; it sits at most at position num_tokens, so positions from
    # num_tokens - window + 1 on must be held.
    nulls = table.block_ids[: table.num_null]
    if any(b != NULL_BLOCK for b in nulls) or NULL_BLOCK in live:
        raise InvariantError(f"window: seq {sid}'s freed entries are not its leading {table.num_null}")
    if table.num_null and (not window or table.num_null * block_size > max(0, table.num_tokens - window + 1)):
        raise InvariantError(f"window: seq {sid} freed a block its window still reads ({table.num_null} freed, "
                             f"{table.num_tokens} tokens, window {window})")
    limit = cpu_pool.num_blocks if is_swapped else gpu_pool.num_blocks
    for b in live:
        if not 0 <= b < limit:
            raise InvariantError(f"table shape: seq {sid} block {b} outside its pool")


def pool_state(pool: BlockPool) -> tuple:
    return (
        tuple((b.block_id, b.ref_cnt, b.block_hash, b.token_ids, b.cache_id, b.parent_cache_id) for b in pool.blocks),
        tuple(b.block_id for b in pool.free_block_queue),
        tuple(sorted((repr(k), b.block_id) for k, b in pool.cached_block_hash_to_block.items())),
        pool.num_free_blocks,
        pool.num_cached_free_blocks,
        pool.num_evictions,
    )


def snapshot(tables: dict[int, BlockTable], swapped: set[int], progress: dict[int, CacheProgress],
             gpu_pool: BlockPool, cpu_pool: BlockPool, stats: KVStats) -> tuple:
    """Every piece of state, as plain comparable values."""
    table_state = tuple(
        sorted(
            (sid, tuple(t.block_ids), t.num_tokens, t.num_null, sid in swapped, repr(progress[sid]))
            for sid, t in tables.items()
        )
    )
    return pool_state(gpu_pool), pool_state(cpu_pool), table_state, tuple(asdict(stats).items())
