"""KV cache groups and the hybrid manager (kv/groups.py, kv/hybrid.py, the window in kv/manager.py).

The driver at the bottom runs random admissions, chunked prefills, decodes, forks, swaps and frees
the way the scheduler and engine call the manager, over a fake physical cache per group in which a
step writes, at each slot, the whole prefix up to that position. After every step every running
sequence must read its own prefix, through its group's table, at every position its window still
sees; that is what proves that prefix hits, the window's frees, copy-on-write and swap never hand
a sliding layer wrong KV. The invariants are checked after every operation.
"""
from __future__ import annotations

import random

import pytest

from pagedrun.kv.block_pool import InvariantError
from pagedrun.kv.block_table import NULL_BLOCK
from pagedrun.kv.groups import KVCacheGroup, group_blocks, plan_groups
from pagedrun.kv.hybrid import HybridKVCacheManager, make_kv_manager
from pagedrun.kv.manager import KVCacheManager

# ---------------------------------------------------------------- grouping

def test_gemma3_270m_pattern_groups_three_layers_a_slot():
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = plan_groups(windows)
    assert groups.num_slots == 3
    assert groups.groups[0] == KVCacheGroup((5, 11, 17), 0)
    assert [g.window for g in groups.groups] == [0] + [512] * 5
    assert sorted(layer for g in groups.groups for layer in g.layers) == list(range(18))
    slots, owner = groups.slot_of(18), groups.group_of(18)
    assert slots[5] == 0 and slots[11] == 1 and slots[17] == 2 and owner[17] == 0
    # No two layers of one group share a slot; every group uses slots 0.. in order.
    for g in groups.groups:
        assert [slots[i] for i in g.layers] == list(range(len(g.layers)))
    assert groups.hybrid


def test_uneven_counts_leave_a_short_group_and_switch_off_keeps_one_group():
    windows = [0 if i % 6 == 5 else 128 for i in range(26)]  # 4 full, 22 sliding
    groups = plan_groups(windows)
    assert groups.num_slots == 4
    assert [len(g.layers) for g in groups.groups] == [4, 4, 4, 4, 4, 4, 2]
    off = plan_groups(windows, hybrid=False)
    assert len(off.groups) == 1 and off.groups[0].window == 0 and off.num_slots == 26 and not off.hybrid
    assert not plan_groups([0] * 4).hybrid
    every = plan_groups([64] * 4)  # Mistral v0.1: one sliding group over every layer
    assert len(every.groups) == 1 and every.groups[0].window == 64 and every.hybrid


def test_blocks_per_seq_bound_and_4x_concurrency_for_gemma3_270m_at_8k():
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = plan_groups(windows)
    assert group_blocks(512, 8192, 16, 1) == 33 and group_blocks(0, 8192, 16, 1) == 512
    assert group_blocks(512, 100, 16, 2048) == 7  # never more than the sequence itself
    # Decoding, each sequence holds 512 full blocks and 33 in each of 5 sliding groups; the step's
    # chunk (2,048 tokens for the whole batch) needs 128 more blocks in each sliding group once.
    assert groups.blocks_per_seq(8192, 16, 1) == 512 + 5 * 33
    assert groups.chunk_blocks(2048, 16) == 5 * 128
    # Same bytes: a hybrid block covers 3 layers, a full-allocation block all 18.
    budget_layer_blocks = 64 * 512 * 18  # what holds 64 sequences with every block kept
    with_hybrid = (budget_layer_blocks // 3 - groups.chunk_blocks(2048, 16)) / groups.blocks_per_seq(8192, 16, 1)
    assert with_hybrid / 64 >= 4


# ---------------------------------------------------------------- one sliding group

@pytest.mark.parametrize("window", [7, 8, 9, 16, 17])
def test_remove_skipped_frees_exactly_the_blocks_below_the_window(window):
    bs = 4
    kv = KVCacheManager(64, bs, window=window, enable_prefix_caching=False)
    kv.allocate(0, list(range(40)))
    assert kv.get_num_tokens(0) == 0  # a sliding group reserves each chunk when it is scheduled
    for computed in range(1, 41):
        kv.append_slots(0, 1)
        kv.remove_skipped_blocks(0, computed)
        kv.check_invariants()
        table = kv._tables[0]
        first_seen = max(0, computed - window + 1)  # the next query (position `computed`) sees this on
        live = [i for i, b in enumerate(table.block_ids) if b != NULL_BLOCK]
        assert live and live[0] == first_seen // bs, (computed, table.block_ids)
    assert kv.stats.window_freed_blocks == (40 - window + 1) // bs
    assert kv.get_block_table(0)[: table.num_null] == [0] * table.num_null  # placeholders for the kernels
    kv.free(0)
    assert kv.num_free_gpu_blocks == 64
    kv.check_invariants()


def test_a_null_entry_inside_the_window_breaks_an_invariant():
    kv = KVCacheManager(16, 4, window=8, enable_prefix_caching=False)
    kv.allocate(0, list(range(12)))
    kv.append_slots(0, 12)
    table = kv._tables[0]
    # A planted off-by-one: block 1 holds positions 4-7, and the query at 11 still sees 4 (11 - 8 + 1).
    kv.gpu_pool.free_blocks([kv.gpu_pool.blocks[b] for b in table.block_ids[1::-1]])
    table.block_ids[0:2] = [NULL_BLOCK, NULL_BLOCK]
    table.num_null = 2
    with pytest.raises(InvariantError, match="window"):
        kv.check_invariants()


def test_sliding_admission_counts_the_first_chunk_and_finishing_counts_the_window():
    kv = KVCacheManager(10, 4, window=8, max_chunk=16, enable_prefix_caching=False, watermark=0)
    assert kv.can_allocate(list(range(100)))  # first chunk: 16 tokens = 4 blocks
    assert kv.blocks_to_finish(100, 200, 1) == group_blocks(8, 200, 4, 16) == 7
    assert kv.blocks_to_finish(100, 200, 3) == 21
    small = KVCacheManager(3, 4, window=8, max_chunk=16, enable_prefix_caching=False, watermark=0)
    assert not small.can_allocate(list(range(100)))


# ---------------------------------------------------------------- the hybrid coordinator

def _hybrid(num_blocks=64, bs=4, window=8, caching=True, cpu=0, max_chunk=8, hash_fn=None):
    groups = plan_groups([0, window, window, 0])
    return HybridKVCacheManager(groups, num_blocks, bs, cpu, caching, watermark=0, hash_fn=hash_fn,
                                max_chunk=max_chunk)


def test_make_kv_manager_picks_by_groups():
    assert isinstance(make_kv_manager(plan_groups([0, 0]), 8, 4), KVCacheManager)
    sliding = make_kv_manager(plan_groups([32, 32]), 8, 4)
    assert isinstance(sliding, KVCacheManager) and sliding.window == 32
    assert isinstance(make_kv_manager(plan_groups([0, 32]), 8, 4), HybridKVCacheManager)


def test_failed_append_changes_nothing_in_any_group():
    kv = _hybrid(num_blocks=5, window=8, caching=False)  # groups: full, sliding
    kv.allocate(0, list(range(8)))  # full group: 2 blocks; sliding: none yet
    assert kv.num_free_gpu_blocks == 3
    before = kv.snapshot()
    assert not kv.can_append_slots(0, 9)  # sliding needs 3 blocks for 0-8, full 1 more: 4 > 3
    assert kv.try_append_slots(0, 9) is None
    assert kv.snapshot() == before
    kv.check_invariants()
    assert kv.try_append_slots(0, 8) == []  # sliding 2 blocks, full none: fits
    kv.check_invariants()


def test_prefix_hit_is_the_shortest_over_groups_and_groups_do_not_collide():
    kv = _hybrid(num_blocks=64, window=8)
    prompt = list(range(20))
    kv.allocate(0, prompt)
    kv.try_append_slots(0, 20)  # the sliding group's chunk(s): the coordinator brings it to 20
    kv.cache_blocks(0, prompt, 20)
    kv.remove_skipped_blocks(0, 20)
    kv.check_invariants()
    # Same prompt again: the full group hits 5 blocks; the sliding group's blocks 0-2 left its window
    # but stay cached (free, hashed), so it hits 5 too; the new sequence keeps only the window's.
    assert kv.get_num_cached_tokens(prompt + [99]) == 20
    cached = kv.allocate(1, prompt + [99])
    assert cached == 20
    sliding = kv.managers[1]._tables[1]
    assert sliding.num_null == (20 - 8 + 1) // 4 and sliding.num_tokens == 20
    kv.check_invariants()
    # Group 0 and group 1 registered the same tokens under different keys.
    keys = list(kv.gpu_pool.cached_block_hash_to_block)
    assert len(keys) == len(set(keys)) == 5 * 2


def test_swap_moves_only_the_blocks_in_the_window():
    kv = _hybrid(num_blocks=64, window=8, caching=False, cpu=64)
    kv.allocate(0, list(range(32)))
    kv.try_append_slots(0, 32)
    kv.remove_skipped_blocks(0, 32)
    held = sum(kv.num_used_blocks_per_group())
    mapping = kv.swap_out([0])
    assert len(mapping) == held == 8 + 2  # full: 8 blocks; sliding: the query at 32 sees 25-32: blocks 6, 7
    kv.check_invariants()
    kv.swap_in([0])
    kv.check_invariants()
    assert kv.get_num_tokens(0) == 32


# ---------------------------------------------------------------- the random driver

class Driver:
    """The scheduler's calls on a manager, and a fake cache per group holding prefixes at slots."""

    def __init__(self, kv, windows_of_groups, bs, rng):
        self.kv, self.windows, self.bs, self.rng = kv, windows_of_groups, bs, rng
        self.cache = [dict() for _ in windows_of_groups]  # group -> slot -> prefix tuple
        self.cpu = [dict() for _ in windows_of_groups]
        self.seqs: dict[int, dict] = {}  # seq id -> tokens, computed, swapped
        self.seen: list[tuple[int, ...]] = []  # prompts admitted so far
        self.next_id = 0

    def tables(self, sid):
        return self.kv.get_block_tables(sid)

    def admit(self):
        prompt = [self.rng.randrange(3) for _ in range(self.rng.randrange(1, 30))]
        if self.seen and self.rng.random() < 0.5:  # an earlier prompt again, or longer: prefix hits
            prompt = list(self.rng.choice(self.seen)) + prompt[: self.rng.randrange(3)]
        self.seen.append(tuple(prompt))
        if not self.kv.can_allocate(prompt):
            return
        sid, self.next_id = self.next_id, self.next_id + 1
        computed = self.kv.allocate(sid, prompt)
        self.seqs[sid] = {"tokens": prompt, "computed": computed, "swapped": False}

    def step(self, sid, max_chunk):
        s = self.seqs[sid]
        num_new = min(len(s["tokens"]) - s["computed"], max_chunk)
        if num_new == 0:
            s["tokens"].append(self.rng.randrange(3))  # "sample" a token
            num_new = 1
        need = s["computed"] + num_new - self.kv.get_num_tokens(sid)
        if need > 0:
            pairs = self.kv.try_append_slots(sid, need)
            if pairs is None:
                return False
            self.copy(pairs)
        self.kv.cache_blocks(sid, s["tokens"], s["computed"] + num_new)
        for g, table in enumerate(self.tables(sid)):
            for p in range(s["computed"], s["computed"] + num_new):
                self.cache[g][table[p // self.bs] * self.bs + p % self.bs] = tuple(s["tokens"][: p + 1])
        s["computed"] += num_new
        self.kv.remove_skipped_blocks(sid, s["computed"])
        return True

    def copy(self, pairs):
        for g in range(len(self.cache)):
            for src, dst in pairs:
                for o in range(self.bs):
                    if src * self.bs + o in self.cache[g]:
                        self.cache[g][dst * self.bs + o] = self.cache[g][src * self.bs + o]

    def move(self, mapping, src_caches, dst_caches):
        for g in range(len(self.cache)):
            for src, dst in mapping:
                for o in range(self.bs):
                    dst_caches[g][dst * self.bs + o] = src_caches[g].get(src * self.bs + o)

    def check(self):
        self.kv.check_invariants()
        for sid, s in self.seqs.items():
            if s["swapped"]:
                continue
            for g, (table, window) in enumerate(zip(self.tables(sid), self.windows)):
                first = max(0, s["computed"] - window + 1) if window else 0
                for p in range(first, s["computed"]):
                    got = self.cache[g].get(table[p // self.bs] * self.bs + p % self.bs)
                    assert got == tuple(s["tokens"][: p + 1]), (sid, g, p)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", ["hybrid", "sliding_only"])
def test_random_operations_keep_every_window_readable(seed, layout):
    rng = random.Random(seed)
    bs, window, max_chunk = 2, rng.choice([3, 4, 5, 8]), rng.choice([3, 8])
    caching = rng.random() < 0.7
    windows = [0, window, window] if layout == "hybrid" else [window, window]
    groups = plan_groups(windows)
    kv = make_kv_manager(groups, rng.choice([24, 40]), bs, 40, caching, watermark=0, max_chunk=max_chunk)
    d = Driver(kv, [g.window for g in groups.groups], bs, rng)
    for _ in range(300):
        op = rng.random()
        live = [sid for sid, s in d.seqs.items() if not s["swapped"]]
        if op < 0.25 or not d.seqs:
            d.admit()
        elif op < 0.75 and live:
            sid = rng.choice(live)
            before = kv.snapshot()
            if not d.step(sid, max_chunk):
                assert kv.snapshot() == before
        elif op < 0.82 and live:
            parent = rng.choice(live)
            if d.seqs[parent]["computed"] == len(d.seqs[parent]["tokens"]):
                child, d.next_id = d.next_id, d.next_id + 1
                kv.fork(parent, child)
                d.seqs[child] = {"tokens": list(d.seqs[parent]["tokens"]), "computed": d.seqs[parent]["computed"],
                                 "swapped": False}
        elif op < 0.88 and live:
            sid = rng.choice(live)
            if kv.can_swap_out([sid]):
                d.move(kv.swap_out([sid]), d.cache, d.cpu)
                d.seqs[sid]["swapped"] = True
        elif op < 0.93:
            out = [sid for sid, s in d.seqs.items() if s["swapped"]]
            if out:
                sid = rng.choice(out)
                if kv.can_swap_in([sid]):
                    d.move(kv.swap_in([sid]), d.cpu, d.cache)
                    d.seqs[sid]["swapped"] = False
        elif d.seqs:
            sid = rng.choice(list(d.seqs))
            kv.free(sid)
            del d.seqs[sid]
        d.check()
    for sid in list(d.seqs):
        kv.free(sid)
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def test_a_sliding_hit_survives_the_eviction_of_the_blocks_below_its_window():
    """Right to left (vLLM's sliding-window search): after the blocks below the window are evicted,
    the same prompt still hits its whole length in the sliding group, holding only the window's
    blocks; left to right (a weak injected hash) it cannot cross the gap."""
    for hash_fn, want in ((None, 20), (lambda parent, toks, extra: hash((parent, tuple(toks), extra)), 0)):
        kv = KVCacheManager(16, 4, window=8, max_chunk=64, watermark=0, hash_fn=hash_fn)
        prompt = list(range(100, 121))  # 21 tokens: a hit covers at most 20
        kv.allocate(0, prompt)
        kv.append_slots(0, 21)
        kv.cache_blocks(0, prompt, 21)
        kv.remove_skipped_blocks(0, 21)  # blocks 0-2 (positions 0-11) leave the window: freed, hashed
        kv.free(0)
        # The free queue: block 5 (never filled), the 10 never used, then 2, 1, 0 (freed by the
        # window), then 4, 3 (freed at the end). 14 new blocks evict 2, 1, 0 and keep 4 and 3.
        kv.allocate(1, [7] * 56)
        kv.append_slots(1, 56)
        assert kv.stats.evictions == 3
        assert kv.get_num_cached_tokens(prompt) == want
        kv.check_invariants()
        kv.free(1)
        if want:
            assert kv.allocate(2, prompt) == 20
            table = kv._tables[2]
            assert table.num_null == (20 - 8 + 1) // 4 and table.num_tokens == 20
            kv.check_invariants()
