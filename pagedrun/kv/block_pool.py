"""Physical KV blocks, the free block queue and the BlockPool (vLLM v1 vocabulary, no tensors).

A block is in exactly one of two states:
  * referenced: ref_cnt > 0, held by that many block tables, not in the free queue;
  * free: ref_cnt == 0, in the free queue. A free block may still be *hashed* (its KV is a valid
    prefix-cache entry): a later prompt with the same prefix can take it back with touch(); if
    nobody does, it is evicted when get_new_blocks() pops it.

The free queue doubles as the eviction order. free_blocks() puts hashed blocks at the back (they
are evicted last: least recently used first) and unhashed ones at the front (nothing is lost by
reusing them, so they go first). Callers free a table tail first, so a prompt's first blocks, the
ones most likely to be shared, are the last to be evicted.

Collision safety: a hash hit alone is never trusted. Each hashed block stores its own token ids
and the `cache_id` of its parent block at the time it was cached (cache ids are unique for the
life of the pool, a fresh one per caching event). get_cached_block() checks both, so a chain of
hits proves that the whole prefix is token-for-token equal to the one whose KV the block holds,
whatever the hash function does. A collision costs a miss, never wrong KV.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Optional

BlockHash = Hashable  # whatever the hash function returns (hashing.py: 32-byte sha256 digests)


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for the operation; raised before any state was changed."""


class InvariantError(RuntimeError):
    """A KV-cache bookkeeping invariant does not hold; the message names it."""


class KVCacheBlock:
    """One physical block of `block_size` token slots (the tensors live in CacheEngine)."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "token_ids",
        "cache_id",
        "parent_cache_id",
        "prev_free_block",
        "next_free_block",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix-cache identity; all four are None unless the block is hashed.
        self.block_hash: Optional[BlockHash] = None
        self.token_ids: Optional[tuple[int, ...]] = None
        self.cache_id: Optional[int] = None
        self.parent_cache_id: Optional[int] = None
        # Free-queue links; both None exactly when the block is not in the queue.
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.cache_id = None
        self.parent_cache_id = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Sentinel head/tail nodes keep every operation branch-free and O(1); a python list would make
    touch() (removal from the middle, the prefix-hit path) O(n).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise NoFreeBlocksError("free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise InvariantError(f"free queue: block {block.block_id} removed but not in the queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise InvariantError(f"free queue: block {block.block_id} inserted twice")
        nxt = anchor.next_free_block
        assert nxt is not None
        block.prev_free_block = anchor
        block.next_free_block = nxt
        anchor.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        prev = self._tail.prev_free_block
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front (next to be allocated / evicted) to back. For debugging and invariant checks."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)

    def check(self) -> None:
        """Walk the links both ways; raise InvariantError if they disagree with the count."""
        forward = []
        block = self._head
        while True:
            nxt = block.next_free_block
            if nxt is None:
                raise InvariantError("free queue: broken forward link")
            if nxt.prev_free_block is not block:
                raise InvariantError(f"free queue: back link of block {nxt.block_id} is wrong")
            if nxt is self._tail:
                break
            forward.append(nxt)
            if len(forward) > self.num_free_blocks:
                raise InvariantError("free queue: longer than num_free_blocks (or a cycle)")
            block = nxt
        if len(forward) != self.num_free_blocks:
            raise InvariantError(
                f"free queue: num_free_blocks={self.num_free_blocks} but the queue holds {len(forward)}"
            )


class BlockPool:
    """All physical blocks of one device, their ref counts, the free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Ids 0..n-1 in order: allocation order is a pure function of the operation sequence.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block_hash -> the one block registered for it (a block is hashed iff it is in this map).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self._next_cache_id = 0
        self._num_cached_free = 0  # hashed blocks in the free queue (kept as a count: read every step)
        # 1 + the highest block id ever handed out. Never-used blocks leave the queue in id order,
        # so the blocks ever used are exactly [0, num_blocks_touched) (worker/populate.py relies on it).
        self.num_blocks_touched = 0

    # ------------------------------------------------------------------ allocation
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix-cache entry (a hit can revive them)."""
        return self._num_cached_free

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the front of the free queue, each with ref_cnt 1.

        A popped block that is still hashed is evicted: its map entry goes, its KV is now garbage.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if out:
            self.num_blocks_touched = max(self.num_blocks_touched, max(b.block_id for b in out) + 1)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop the cache entry of a block that just left the free queue."""
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.reset_hash()
        self._num_cached_free -= 1
        self.num_evictions += 1

    def evict_free_block(self, block: KVCacheBlock) -> None:
        """Drop the cache entry of a free block now (it is stale or lost a collision) and move the
        block to the front of the queue, since its KV is no longer worth keeping."""
        if block.ref_cnt != 0 or block.block_hash is None:
            raise InvariantError(f"evict: block {block.block_id} is not a free cached block")
        self.free_block_queue.remove(block)
        self._evict(block)
        self.free_block_queue.appendleft(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue.

        Pass blocks in the order they should be evicted (a table's tail first).
        """
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise InvariantError(f"ref_cnt: block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                    self._num_cached_free += 1
                else:
                    self.free_block_queue.appendleft(block)

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: Optional[KVCacheBlock] = None,
    ) -> Optional[KVCacheBlock]:
        """The block cached for `block_hash`, or None.

        `parent` is the block that holds the previous block of the prompt (None for the first
        block). A hit requires the stored token ids to equal `token_ids` and the stored parent
        to be `parent` in the very caching state it had when this block was registered; any
        other match is a hash collision and reads as a miss. Does not change any state.
        """
        if not self.enable_caching:
            return None
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None:
            return None
        if block.token_ids != tuple(token_ids):
            return None
        expected_parent = parent.cache_id if parent is not None else None
        if parent is not None and expected_parent is None:
            return None  # the parent is not a cache entry: nothing can chain from it
        if block.parent_cache_id != expected_parent:
            return None
        return block

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: Optional[KVCacheBlock] = None,
    ) -> bool:
        """Register a full, computed block under `block_hash`; returns whether it was registered.

        If the hash already maps to another block (a duplicate computed concurrently, or a
        collision) this block stays uncached: one entry per hash keeps eviction simple.
        `parent` must be the cached block holding the previous block (None for the first).
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        if parent is not None and parent.cache_id is None:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.cache_id = self._next_cache_id
        block.parent_cache_id = parent.cache_id if parent is not None else None
        self._next_cache_id += 1
        self.cached_block_hash_to_block[block_hash] = block
        if block.ref_cnt == 0:
            self._num_cached_free += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cache entry held by a free block (e.g. between benchmark runs).

        Blocks still referenced keep theirs. Returns the number of entries dropped.
        """
        dropped = 0
        for block in list(self.free_block_queue):
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                block.reset_hash()
                dropped += 1
        self._num_cached_free -= dropped
        return dropped

    # ------------------------------------------------------------------ checks
    def check_invariants(self, expected_ref_cnt: Optional[dict[int, int]] = None) -> None:
        """Raise InvariantError naming the first violated invariant.

        expected_ref_cnt: block_id -> number of holders (block tables); blocks not listed must be free.
        """
        self.free_block_queue.check()
        in_queue = set()
        for block in self.free_block_queue:
            if block.block_id in in_queue:
                raise InvariantError(f"free queue: block {block.block_id} appears twice")
            in_queue.add(block.block_id)
        for block in self.blocks:
            free = block.block_id in in_queue
            if free and block.ref_cnt != 0:
                raise InvariantError(
                    f"free xor referenced: block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}"
                )
            if not free and block.ref_cnt <= 0:
                raise InvariantError(
                    f"free xor referenced: block {block.block_id} has ref_cnt {block.ref_cnt} but is not free (leak)"
                )
            if expected_ref_cnt is not None and block.ref_cnt != expected_ref_cnt.get(block.block_id, 0):
                raise InvariantError(
                    f"ref_cnt == holders: block {block.block_id} ref_cnt {block.ref_cnt}, "
                    f"held by {expected_ref_cnt.get(block.block_id, 0)} block tables"
                )
            hashed = block.block_hash is not None
            if hashed != (block.token_ids is not None) or hashed != (block.cache_id is not None):
                raise InvariantError(f"hash fields: block {block.block_id} is half hashed")
            if hashed and self.cached_block_hash_to_block.get(block.block_hash) is not block:
                raise InvariantError(f"hash map: hashed block {block.block_id} is not the map's entry for its hash")
            if hashed and not self.enable_caching:
                raise InvariantError(f"hash map: block {block.block_id} hashed with caching disabled")
        cached_free = sum(1 for b in self.free_block_queue if b.block_hash is not None)
        if cached_free != self._num_cached_free:
            raise InvariantError(
                f"free queue: {cached_free} cached free blocks but num_cached_free_blocks={self._num_cached_free}"
            )
        for key, block in self.cached_block_hash_to_block.items():
            if block.block_hash != key:
                raise InvariantError(
                    f"hash map: key {key!r} points at block {block.block_id} whose hash is {block.block_hash!r}"
                )
