"""KVCacheManager: prefix hits, LRU, collisions, CoW, watermark, atomic failures, swap, determinism."""
import hashlib

import pytest

from pagedrun.kv.hashing import hash_block_tokens, hash_prompt_blocks
from pagedrun.kv.manager import InvariantError, KVCacheManager, NoFreeBlocksError

BS = 4


def mgr(num_gpu=16, num_cpu=8, watermark=0.0, **kw):
    return KVCacheManager(num_gpu, BS, num_cpu_blocks=num_cpu, watermark=watermark, **kw)


def run_prompt(m, seq_id, tokens):
    """allocate + 'compute' the prompt + register its full blocks, as the engine does."""
    cached = m.allocate(seq_id, tokens)
    m.cache_blocks(seq_id, tokens, len(tokens))
    return cached


def free_all(m):
    for sid in list(m._tables):
        m.free(sid)
    m.check_invariants()
    assert m.num_free_gpu_blocks == m.num_gpu_blocks and m.num_free_cpu_blocks == m.num_cpu_blocks


# ---------------------------------------------------------------- hashing
def test_hash_is_chained_and_stable():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4)) and isinstance(a, bytes) and len(a) == 32
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2], ("salt",)) != hash_block_tokens(None, [1, 2])
    # The encoding is fixed (root tag, LE length, int64 LE tokens): stable across processes.
    expect = hashlib.sha256(b"pagedrun-root" + (2).to_bytes(4, "little") + (7).to_bytes(8, "little")
                            + (300).to_bytes(8, "little")).digest()
    assert hash_block_tokens(None, [7, 300]) == expect
    hs = hash_prompt_blocks(list(range(10)), 4)
    assert len(hs) == 2 and hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])


# ---------------------------------------------------------------- allocation and prefix hits
def test_allocate_covers_all_tokens_and_counts():
    m = mgr()
    assert m.allocate(1, list(range(9))) == 0
    assert m.get_block_table(1) == [0, 1, 2] and m.get_num_tokens(1) == 9
    assert m.num_used_gpu_blocks == 3
    assert m.stats.prefix_query_tokens == 9 and m.stats.prefix_hit_tokens == 0
    with pytest.raises(ValueError):
        m.allocate(1, [1])
    m.check_invariants()


def test_prefix_hit_shares_blocks_by_reference():
    m = mgr()
    prompt = list(range(10))
    run_prompt(m, 1, prompt)
    assert m.get_num_cached_tokens(prompt + [99]) == 8
    assert m.allocate(2, prompt + [99]) == 8
    t1, t2 = m.get_block_table(1), m.get_block_table(2)
    assert t2[:2] == t1[:2] and t2[2] != t1[2]
    assert [m.gpu_pool.blocks[b].ref_cnt for b in t1[:2]] == [2, 2]
    assert m.stats.prefix_hit_tokens == 8 and m.stats.prefix_query_tokens == 21
    m.check_invariants()
    free_all(m)


def test_fully_cached_prompt_still_computes_last_token():
    m = mgr()
    prompt = list(range(8))  # exactly two full blocks
    run_prompt(m, 1, prompt)
    # Both blocks are cached, but the hit is capped to len - 1 tokens -> one whole block.
    assert m.get_num_cached_tokens(prompt) == 4
    assert m.allocate(2, prompt) == 4
    t1, t2 = m.get_block_table(1), m.get_block_table(2)
    assert t2[0] == t1[0] and t2[1] != t1[1]  # the last block is private: it will be written
    assert m.get_num_cached_tokens([5]) == 0
    free_all(m)


def test_query_is_pure():
    m = mgr()
    run_prompt(m, 1, list(range(8)))
    m.free(1)
    before = m.snapshot()
    assert m.get_num_cached_tokens(list(range(9))) == 8
    assert m.can_allocate(list(range(9)))
    assert m.snapshot() == before


def test_hit_on_free_cached_block_revives_it():
    m = mgr(num_gpu=4)
    prompt = list(range(8))
    run_prompt(m, 1, prompt)
    m.free(1)
    assert m.num_free_gpu_blocks == 4 and m.num_cached_free_blocks == 2
    assert m.allocate(2, prompt + [1]) == 8
    assert m.num_free_gpu_blocks == 1 and m.stats.evictions == 0
    m.check_invariants()


def test_lru_eviction_prefers_least_recently_freed_and_tail_blocks():
    m = mgr(num_gpu=6)
    a, b = [1] * 8, [2] * 8
    run_prompt(m, 1, a + [0])  # blocks 0, 1 hashed, 2 partial
    run_prompt(m, 2, b + [0])  # blocks 3, 4 hashed, 5 partial
    m.free(1)
    m.free(2)
    # Queue: unhashed partials first, then a's blocks (tail first), then b's.
    assert [blk.block_id for blk in m.gpu_pool.free_block_queue] == [5, 2, 1, 0, 4, 3]
    m.allocate(3, list(range(100, 112)))  # 3 blocks: the two partials, then evict a's tail block
    assert m.get_block_table(3) == [5, 2, 1] and m.stats.evictions == 1
    assert m.get_num_cached_tokens(a + [0]) == 4  # a's first block survived
    assert m.get_num_cached_tokens(b + [0]) == 8  # b untouched
    m.check_invariants()


def test_duplicate_concurrent_prompt_stays_uncached_and_is_reused_first():
    m = mgr(num_gpu=8)
    p = list(range(9))
    m.allocate(1, p)
    m.allocate(2, p)  # same prompt, admitted before seq 1's blocks were cached
    m.cache_blocks(1, p, 9)
    m.cache_blocks(2, p, 9)  # duplicates: left unhashed
    dup = m.get_block_table(2)
    assert all(m.gpu_pool.blocks[b].block_hash is None for b in dup)
    m.free(2)
    assert [b.block_id for b in m.gpu_pool.free_block_queue][:3] == dup  # unhashed: reused first
    # A decode step of seq 1 that fills block 2 can still extend the cache chain.
    m.append_slots(1, 3)
    m.cache_blocks(1, p + [9, 10, 11], 12)
    assert m.get_num_cached_tokens(p + [9, 10, 11, 12]) == 12
    m.check_invariants()


def test_orphaned_entry_is_replaced_when_its_parent_was_evicted():
    m = mgr(num_gpu=8)
    p = list(range(9))
    m.allocate(1, p)  # X: blocks 0, 1, 2
    m.allocate(2, p)  # Y: blocks 3, 4, 5 (same prompt, same step)
    m.cache_blocks(1, p, 4)  # X registers only its first block (a chunked prefill)
    m.cache_blocks(2, p, 9)  # Y's block 0 duplicates X's; Y's block 1 chains to X's block 0
    assert m.gpu_pool.blocks[4].block_hash is not None and m.gpu_pool.blocks[3].block_hash is None
    m.free(1)
    m.free(2)
    m.allocate(3, list(range(100, 128)))  # 7 blocks: evicts X's block 0 and nothing else cached
    assert m.stats.evictions == 1 and m.gpu_pool.blocks[4].block_hash is not None
    m.free(3)
    assert m.get_num_cached_tokens(p) == 0  # the orphan (block 4) is unreachable...
    run_prompt(m, 4, p)
    # ...and is replaced by the new chain instead of blocking it.
    assert m.gpu_pool.blocks[4].block_hash is None and m.stats.evictions == 2
    assert m.get_num_cached_tokens(p + [9]) == 8
    m.check_invariants()


def test_decode_tokens_become_cached():
    m = mgr()
    toks = list(range(6))
    run_prompt(m, 1, toks)
    for t in range(6, 13):
        m.append_slots(1, 1)
        toks.append(t)
        m.cache_blocks(1, toks, len(toks))
    assert m.get_num_cached_tokens(list(range(13)) + [0]) == 12
    m.check_invariants()


def test_caching_off():
    m = mgr(enable_prefix_caching=False)
    p = list(range(9))
    run_prompt(m, 1, p)
    assert m.get_num_cached_tokens(p) == 0
    assert m.allocate(2, p) == 0
    assert m.stats.prefix_query_tokens == 0
    assert not m.gpu_pool.cached_block_hash_to_block
    free_all(m)


# ---------------------------------------------------------------- collisions
def constant_hash(parent, tokens, extra):
    return 0


def block_only_hash(parent, tokens, extra):
    return hash(tuple(tokens))  # ignores the parent: block i of one prompt aliases block j of another


@pytest.mark.parametrize("fn", [constant_hash, block_only_hash])
def test_forced_collisions_never_return_wrong_kv(fn):
    m = mgr(num_gpu=32, hash_fn=fn)
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    run_prompt(m, 1, a)
    # Same blocks at other positions / after another prefix: a collision for both hash functions.
    assert m.get_num_cached_tokens([2, 2, 2, 2, 0]) == 0
    assert m.get_num_cached_tokens([1, 1, 1, 1, 1, 1, 1, 1, 0]) == 4
    assert m.allocate(2, [9, 9, 9, 9, 2, 2, 2, 2, 0]) == 0
    m.cache_blocks(2, [9, 9, 9, 9, 2, 2, 2, 2, 0], 9)
    # The genuine prefix still hits where the hash allows it.
    expect = 8 if fn is block_only_hash else 4
    assert m.get_num_cached_tokens(a) == expect
    m.check_invariants()


def test_constant_hash_repeated_block_does_not_chain_to_itself():
    m = mgr(hash_fn=constant_hash)
    p = [5] * 12 + [1]
    run_prompt(m, 1, p)
    # Only one entry exists for the single hash; the second block must not hit the first.
    assert m.get_num_cached_tokens(p) == 4
    assert m.allocate(2, p) == 4
    t = m.get_block_table(2)
    assert len(set(t)) == len(t)
    m.check_invariants()


# ---------------------------------------------------------------- fork and copy-on-write
def test_fork_then_append_copies_on_write():
    m = mgr()
    m.allocate(1, list(range(6)))  # blocks [0, 1], block 1 half full
    m.fork(1, 2)
    assert m.get_block_table(2) == [0, 1]
    assert [m.gpu_pool.blocks[b].ref_cnt for b in (0, 1)] == [2, 2]
    assert m.can_append_slots(2, 1)
    pairs = m.append_slots(2, 1)
    assert pairs == [(1, 2)]
    assert m.get_block_table(2) == [0, 2] and m.get_block_table(1) == [0, 1]
    assert m.gpu_pool.blocks[1].ref_cnt == 1 and m.stats.cow_copies == 1
    # The parent is now the only holder: no copy.
    assert m.append_slots(1, 1) == []
    # Block-aligned growth of a forked table needs no copy either.
    m.append_slots(1, 1)
    m.append_slots(2, 1)
    m.fork(1, 3)
    assert m.append_slots(3, 1) == []
    assert m.get_block_table(3)[:2] == m.get_block_table(1)[:2]
    m.check_invariants()
    free_all(m)


def test_append_multiple_tokens_counts_blocks():
    m = mgr(num_gpu=4)
    m.allocate(1, [1, 2, 3])
    assert m.can_append_slots(1, 1 + 4 * 3)
    assert not m.can_append_slots(1, 2 + 4 * 3)
    assert m.append_slots(1, 0) == []
    m.append_slots(1, 5)
    assert m.get_num_tokens(1) == 8 and len(m.get_block_table(1)) == 2
    assert m.get_slots(1, 6, 8) == [m.get_block_table(1)[1] * 4 + 2, m.get_block_table(1)[1] * 4 + 3]


def test_cow_counts_toward_can_append():
    m = mgr(num_gpu=2)
    m.allocate(1, [1, 2])
    m.fork(1, 2)
    m.allocate(3, [1])  # the last free block
    assert not m.can_append_slots(2, 1)
    before = m.snapshot()
    with pytest.raises(NoFreeBlocksError):
        m.append_slots(2, 1)
    assert m.snapshot() == before


# ---------------------------------------------------------------- watermark and failures
def test_watermark_admission():
    m = KVCacheManager(100, BS, watermark=0.05)
    assert m.watermark_blocks == 5
    assert m.can_allocate([0] * (95 * BS))
    assert not m.can_allocate([0] * (95 * BS + 1))
    m.allocate(1, [0] * (96 * BS))  # allocate itself ignores the watermark
    assert m.num_free_gpu_blocks == 4


def test_watermark_counts_touched_free_hits():
    m = mgr(num_gpu=10, watermark=0.2)  # keep 2 blocks free
    p = list(range(17))
    run_prompt(m, 1, p)  # 5 blocks, the first 4 hashed
    m.free(1)
    m.allocate(2, list(range(100, 120)))  # 5 blocks: the partial one, then 4 never-used blocks
    assert m.num_free_gpu_blocks == 5 and m.num_cached_free_blocks == 4
    # 2 free hits + 1 new: 5 - 3 = 2 left (a count ignoring the hits would say 4).
    assert m.can_allocate(p[:9])
    # 3 free hits + 1 new: 1 left < 2, although only one *new* block is needed.
    assert not m.can_allocate(p[:13])
    assert m.allocate(3, p[:13]) == 12  # allocate ignores the watermark
    assert m.num_free_gpu_blocks == 1
    m.check_invariants()


def test_failed_allocate_changes_nothing():
    m = mgr(num_gpu=4)
    run_prompt(m, 1, list(range(9)))
    m.free(1)
    before = m.snapshot()
    with pytest.raises(NoFreeBlocksError):
        m.allocate(2, list(range(8)) + list(range(50, 60)))  # 2 hits + 3 new > 4 - 2
    assert m.snapshot() == before
    assert not m.has_seq(2)
    m.check_invariants()


def test_unknown_and_invalid_ids():
    m = mgr()
    with pytest.raises(KeyError):
        m.get_block_table(5)
    with pytest.raises(KeyError):
        m.append_slots(5, 1)
    m.free(5)  # ignored
    with pytest.raises(ValueError):
        m.allocate(1, [])
    m.allocate(1, [1])
    with pytest.raises(ValueError):
        m.fork(1, 1)


# ---------------------------------------------------------------- swap
def test_swap_round_trip_with_shared_blocks():
    m = mgr(num_gpu=8, num_cpu=8)
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    m.append_slots(2, 3)  # CoW of block 1, then a third block
    t1, t2 = m.get_block_table(1), m.get_block_table(2)
    shared = set(t1) & set(t2)
    assert shared == {t1[0]}
    assert m.can_swap_out([1, 2])
    out = m.swap_out([1, 2])
    gpu_blocks = [g for g, _ in out]
    assert sorted(gpu_blocks) == sorted(set(t1) | set(t2))  # the shared block moves once
    assert m.is_swapped(1) and m.is_swapped(2)
    assert m.num_free_gpu_blocks == 8
    c1, c2 = m.get_block_table(1), m.get_block_table(2)
    assert c1[0] == c2[0] and m.cpu_pool.blocks[c1[0]].ref_cnt == 2
    assert m.stats.swap_out_blocks == len(out)
    m.check_invariants()
    with pytest.raises(ValueError):
        m.append_slots(1, 1)
    assert m.can_swap_in([1, 2])
    back = m.swap_in([1, 2])
    assert [c for c, _ in back] == [c for _, c in out]
    g1, g2 = m.get_block_table(1), m.get_block_table(2)
    assert g1[0] == g2[0] and m.gpu_pool.blocks[g1[0]].ref_cnt == 2
    assert not m.is_swapped(1) and m.num_free_cpu_blocks == 8
    assert m.get_num_tokens(2) == 9
    m.check_invariants()
    free_all(m)


def test_swap_out_keeps_blocks_shared_with_other_requests():
    m = mgr(num_gpu=8, num_cpu=8)
    p = list(range(9))
    run_prompt(m, 1, p)
    m.allocate(2, p)  # shares 2 blocks with seq 1
    m.swap_out([2])
    # Seq 1 still holds the shared blocks: they stay referenced on the GPU.
    assert all(m.gpu_pool.blocks[b].ref_cnt == 1 for b in m.get_block_table(1))
    m.check_invariants()
    m.swap_in([2])
    m.check_invariants()
    free_all(m)


def test_swap_failures_change_nothing_and_watermark():
    m = KVCacheManager(10, BS, num_cpu_blocks=2, watermark=0.2)
    m.allocate(1, list(range(12)))  # 3 blocks
    before = m.snapshot()
    assert not m.can_swap_out([1])
    with pytest.raises(NoFreeBlocksError):
        m.swap_out([1])
    assert m.snapshot() == before
    m.free(1)
    m.allocate(1, list(range(8)))
    m.swap_out([1])
    m.allocate(2, [0] * (7 * BS))  # 7 of 10 used, 3 free; swap-in needs 2 -> 1 free < watermark 2
    assert not m.can_swap_in([1])
    m.swap_in([1])  # possible, just below the watermark
    m.check_invariants()
    m.free(2)
    m.swap_out([1])
    m.allocate(3, [0] * (9 * BS))
    before = m.snapshot()
    with pytest.raises(NoFreeBlocksError):
        m.swap_in([1])
    assert m.snapshot() == before


def test_fork_and_free_while_swapped():
    m = mgr()
    m.allocate(1, list(range(5)))
    m.swap_out([1])
    m.fork(1, 2)
    assert m.is_swapped(2) and m.get_block_table(2) == m.get_block_table(1)
    m.check_invariants()
    m.free(1)
    m.free(2)
    free_all(m)


# ---------------------------------------------------------------- determinism and invariants
def _script(m):
    out = []
    p = list(range(10))
    out.append(m.allocate(1, p))
    m.cache_blocks(1, p, 10)
    out.append(m.allocate(2, p + [3]))
    m.fork(2, 3)
    out.append(m.append_slots(3, 2))
    out.append(m.swap_out([2, 3]))
    m.free(1)
    out.append(m.allocate(4, list(range(50, 70))))
    out.append(m.swap_in([2, 3]))
    out.append([m.get_block_table(s) for s in (2, 3, 4)])
    return out


def test_allocation_is_deterministic():
    a, b = mgr(), mgr()
    assert _script(a) == _script(b)
    assert a.snapshot()[:3] == b.snapshot()[:3]


def test_check_invariants_catches_corruption():
    m = mgr()
    m.allocate(1, list(range(9)))
    m.check_invariants()
    m._tables[1].num_tokens = 20
    with pytest.raises(InvariantError, match="table shape"):
        m.check_invariants()
    m._tables[1].num_tokens = 9
    m.gpu_pool.blocks[0].ref_cnt += 1
    with pytest.raises(InvariantError, match="ref_cnt == holders"):
        m.check_invariants()
    m.gpu_pool.blocks[0].ref_cnt -= 1
    m.gpu_pool.free_block_queue.num_free_blocks -= 1
    with pytest.raises(InvariantError, match="free queue"):
        m.check_invariants()
