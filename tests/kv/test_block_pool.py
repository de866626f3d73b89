"""BlockPool / FreeKVCacheBlockQueue: ref counts, LRU eviction order, hash map, collision checks."""
import pytest

from pagedrun.kv.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    InvariantError,
    KVCacheBlock,
    NoFreeBlocksError,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(pool):
    return ids(pool.free_block_queue)


# ---------------------------------------------------------------- free queue
def test_queue_operations_are_linked_and_counted():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 1, 3, 4, 0]
    q.check()
    for _ in range(5):
        q.popleft()
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(NoFreeBlocksError):
        q.popleft()


def test_queue_rejects_double_insert_and_foreign_remove():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(InvariantError):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(InvariantError):
        q.remove(blocks[0])


def test_queue_check_detects_corrupted_count():
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])
    q.num_free_blocks = 2
    with pytest.raises(InvariantError, match="free queue"):
        q.check()


# ---------------------------------------------------------------- allocation / free
def test_allocation_order_is_deterministic_from_the_front():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.num_free_blocks == 1
    pool.check_invariants({i: 1 for i in range(5)})


def test_get_new_blocks_too_many_raises_without_change():
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    before = (queue_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    assert (queue_ids(pool), [b.ref_cnt for b in pool.blocks]) == before


def test_free_puts_unhashed_front_and_hashed_back():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # free queue now [4, 5]
    pool.cache_full_block(blocks[0], "h0", (1, 2))
    pool.cache_full_block(blocks[1], "h1", (3, 4), parent=blocks[0])
    # Free a "table" [0, 1, 2, 3] tail first, as the manager does.
    pool.free_blocks(reversed(blocks))
    # Unhashed 3 then 2 go to the front (2 ends up first); hashed 1 then 0 go to the back,
    # so the prompt's first block (0) is the very last to be evicted.
    assert queue_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert pool.num_cached_free_blocks == 2
    pool.check_invariants()


def test_lru_eviction_order_and_eviction_removes_hash():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, f"h{i}", (i,))
    # Free in order 1, 0, 2: LRU order is the free order.
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    assert queue_ids(pool) == [1, 0, 2]
    (victim,) = pool.get_new_blocks(1)
    assert victim.block_id == 1
    assert victim.block_hash is None and victim.token_ids is None
    assert "h1" not in pool.cached_block_hash_to_block
    assert pool.get_cached_block("h1", (1,)) is None
    assert pool.num_evictions == 1
    assert pool.get_cached_block("h0", (0,)) is blocks[0]
    pool.check_invariants({1: 1})


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, "h", (7, 7))
    pool.free_blocks([b])
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 1
    hit = pool.get_cached_block("h", (7, 7))
    assert hit is b
    pool.touch([hit])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3 and b.block_id not in queue_ids(pool)
    pool.touch([hit])  # a second holder does not touch the queue
    assert b.ref_cnt == 2 and pool.num_free_blocks == 3
    # The revived block is not evicted by later allocations.
    others = pool.get_new_blocks(3)
    assert b not in others and pool.num_evictions == 0
    pool.check_invariants({0: 2, 1: 1, 2: 1, 3: 1})


def test_double_free_is_an_invariant_error():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(InvariantError, match="ref_cnt"):
        pool.free_blocks([b])


# ---------------------------------------------------------------- hash map
def test_collision_on_token_ids_is_a_miss():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, 42, (1, 2, 3))
    assert pool.get_cached_block(42, (1, 2, 3)) is b
    assert pool.get_cached_block(42, (1, 2, 4)) is None  # same hash, other tokens


def test_collision_on_parent_is_a_miss():
    pool = BlockPool(4, enable_caching=True)
    p1, p2, child = pool.get_new_blocks(3)
    pool.cache_full_block(p1, "p1", (1,))
    pool.cache_full_block(p2, "p2", (2,))
    pool.cache_full_block(child, "c", (9,), parent=p1)
    assert pool.get_cached_block("c", (9,), parent=p1) is child
    assert pool.get_cached_block("c", (9,), parent=p2) is None
    assert pool.get_cached_block("c", (9,)) is None  # as a first block: different prefix


def test_parent_that_was_evicted_and_recached_no_longer_chains():
    pool = BlockPool(3, enable_caching=True)
    parent, child = pool.get_new_blocks(2)
    pool.cache_full_block(parent, "p", (1,))
    pool.cache_full_block(child, "c", (2,), parent=parent)
    pool.free_blocks([child])
    pool.free_blocks([parent])
    # Evict the parent (queue: [2, child, parent] -> pop 2, child, parent).
    got = pool.get_new_blocks(3)
    assert got[-1] is parent and parent.block_hash is None
    # The same physical block is cached again with the same content: a new entry, a new cache_id.
    pool.cache_full_block(parent, "p", (1,))
    assert pool.get_cached_block("c", (2,), parent=parent) is None


def test_cache_full_block_keeps_first_entry_for_a_hash():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, "h", (1,))
    assert not pool.cache_full_block(b, "h", (1,))
    assert b.block_hash is None and pool.cached_block_hash_to_block["h"] is a
    pool.free_blocks([b, a])
    assert queue_ids(pool) == [1, 2, 0]  # b unhashed -> front, a hashed -> back
    pool.check_invariants()


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(b, "h", (1,))
    assert pool.get_cached_block("h", (1,)) is None
    pool.free_blocks([b])
    assert queue_ids(pool) == [0, 1]


def test_reset_prefix_cache_drops_only_free_entries():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, "a", (1,))
    pool.cache_full_block(b, "b", (2,))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 1
    assert a.block_hash is None and b.block_hash == "b"
    pool.check_invariants({1: 1})


def test_evict_free_block_moves_it_to_the_front():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, "a", (1,))
    with pytest.raises(InvariantError):
        pool.evict_free_block(a)  # still referenced
    pool.free_blocks([b, a])
    assert queue_ids(pool) == [1, 2, 0] and pool.num_cached_free_blocks == 1
    pool.evict_free_block(a)
    assert queue_ids(pool) == [0, 1, 2] and pool.num_cached_free_blocks == 0
    assert "a" not in pool.cached_block_hash_to_block and pool.num_evictions == 1
    pool.check_invariants()


def test_invariant_check_names_the_violation():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(InvariantError, match="ref_cnt == holders"):
        pool.check_invariants({0: 2})
    a.ref_cnt = 0  # referenced-but-zero: a leak
    with pytest.raises(InvariantError, match="free xor referenced"):
        pool.check_invariants()
    a.ref_cnt = 1
    pool.cache_full_block(a, "x", (1,))
    pool.cached_block_hash_to_block["y"] = a
    with pytest.raises(InvariantError, match="hash map"):
        pool.check_invariants({0: 1})
