"""The prefix cache over the device BlockPool, as vLLM v1: find a prompt's leading cached blocks
(find_longest_cache_hit), and register a sequence's full blocks under chained hashes once their KV
has been computed (cache_blocks). No tensors here; the manager decides when to call either.

A new prompt takes matching blocks by reference, including blocks that are free but still hashed.
A prompt that is entirely cached still recomputes its last token, because the step has to produce
logits for it: hits are capped at len(prompt) - 1 tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from pagedrun.kv.block_pool import BlockPool, KVCacheBlock
from pagedrun.kv.block_table import BlockTable
from pagedrun.kv.hashing import HashFn


@dataclass
class CacheProgress:
    """How far cache_blocks() got along one table: blocks [0, num_cached_blocks) are done."""

    num_cached_blocks: int = 0
    parent_hash: Any = None  # chained hash of block num_cached_blocks - 1
    # The cache entry holding that block (ours, or an identical one computed by someone else) and
    # its cache_id when we chained to it: if the entry is evicted meanwhile the chain is broken.
    parent_block: Optional[KVCacheBlock] = None
    parent_cache_id: Optional[int] = None
    broken: bool = False  # a collision or a lost parent: nothing further can be registered

    def copy(self) -> "CacheProgress":
        return replace(self)


def find_longest_cache_hit(pool: BlockPool, hash_fn: HashFn, block_size: int,
                           token_ids: Sequence[int]) -> tuple[list[KVCacheBlock], list[Any]]:
    """Leading prefix-cache hits (blocks and their chained hashes); changes nothing."""
    bs = block_size
    # Cap: the last prompt token is always computed, so hits cover at most len-1 tokens.
    max_blocks = (len(token_ids) - 1) // bs
    hits: list[KVCacheBlock] = []
    hashes: list[Any] = []
    parent_hash = None
    parent: Optional[KVCacheBlock] = None
    for i in range(max_blocks):
        blk = tuple(token_ids[i * bs : (i + 1) * bs])
        h = hash_fn(parent_hash, blk, None)
        block = pool.get_cached_block(h, blk, parent)
        if block is None:
            break
        hits.append(block)
        hashes.append(h)
        parent_hash, parent = h, block
    return hits, hashes


def find_window_hit(pool: BlockPool, hash_fn: HashFn, block_size: int, token_ids: Sequence[int], window: int,
                    max_blocks: int) -> tuple[list[Optional[KVCacheBlock]], list[Any]]:
    """A sliding-window group's longest hit of at most max_blocks blocks, searched right to left
    (vLLM's SlidingWindowManager): a hit of h blocks needs only the blocks the query at position
    h x block_size still sees, so it survives the eviction of the blocks below the window, which
    the left-to-right search cannot cross. Returns (blocks, hashes) for blocks 0..h-1, None where a
    block is below the window. Changes nothing.

    The window's blocks chain to each other through their parents; the first of them is matched by
    its chained hash and token ids alone (its parent may be gone), so this search is only sound with
    a collision-resistant hash (the SHA-256 chain: hashing.py), as vLLM's is."""
    bs = block_size
    max_blocks = min(max_blocks, (len(token_ids) - 1) // bs)
    hashes: list[Any] = []
    parent_hash = None
    for i in range(max_blocks):
        parent_hash = hash_fn(parent_hash, tuple(token_ids[i * bs : (i + 1) * bs]), None)
        hashes.append(parent_hash)
    h = max_blocks
    while h > 0:
        first = max(0, h * bs - window + 1) // bs  # the window of the query at position h x bs
        found: list[KVCacheBlock] = []
        for k in range(first, h):
            blk = tuple(token_ids[k * bs : (k + 1) * bs])
            parent = found[-1] if found else None
            block = (pool.get_cached_block(hashes[k], blk, parent) if parent is not None or k == 0
                     else _match_unchained(pool, hashes[k], blk))
            if block is None:
                break
            found.append(block)
        if len(found) == h - first:
            return [None] * first + found, hashes[:h]
        h = first + len(found)  # block first + len(found) missed: no hit reaches past it
    return [], []


def _match_unchained(pool: BlockPool, block_hash: Any, token_ids: tuple[int, ...]) -> Optional[KVCacheBlock]:
    """The cached block for a hash whose parent is no longer known: hash and token ids must match."""
    if not pool.enable_caching:
        return None
    block = pool.cached_block_hash_to_block.get(block_hash)
    return block if block is not None and block.token_ids == token_ids else None


def cache_blocks(pool: BlockPool, hash_fn: HashFn, table: BlockTable, prog: CacheProgress,
                 token_ids: Sequence[int], num_computed_tokens: int) -> None:
    """Register the table's full blocks within the first num_computed_tokens; advances prog."""
    if prog.broken:
        return
    bs = table.block_size
    num_full = min(num_computed_tokens, len(token_ids), table.num_tokens) // bs
    for i in range(prog.num_cached_blocks, num_full):
        parent = prog.parent_block
        if parent is not None and parent.cache_id != prog.parent_cache_id:
            prog.broken = True  # the entry we chained to was evicted: the chain cannot grow
            return
        blk = tuple(token_ids[i * bs : (i + 1) * bs])
        h = hash_fn(prog.parent_hash, blk, None)
        block = pool.blocks[table.block_ids[i]]
        parent_id = parent.cache_id if parent is not None else None
        if block.block_hash is not None:
            # A prefix hit, or a fork sibling sharing this block registered it first.
            if block.block_hash != h or block.token_ids != blk or block.parent_cache_id != parent_id:
                prog.broken = True
                return
            entry = block
        else:
            entry = pool.get_cached_block(h, blk, parent)
            if entry is None:
                _drop_stale_free_entry(pool, h)
                if not pool.cache_full_block(block, h, blk, parent):
                    prog.broken = True  # the hash belongs to a different prefix still in use
                    return
                entry = block
            # else: an identical block computed concurrently already holds the entry; ours
            # stays unhashed (freed to the front) and the chain continues through that entry.
        prog.num_cached_blocks = i + 1
        prog.parent_hash = h
        prog.parent_block = entry
        prog.parent_cache_id = entry.cache_id


def _drop_stale_free_entry(pool: BlockPool, block_hash: Any) -> None:
    """An entry for this hash that did not match is a collision or an orphan (its parent was
    evicted). If nobody holds it, our fresh block is the more useful entry: drop the old one."""
    old = pool.cached_block_hash_to_block.get(block_hash)
    if old is None or old.ref_cnt != 0:
        return
    pool.evict_free_block(old)
