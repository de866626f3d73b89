"""TorchAttentionBackend against a float64 reference that never looks at the paged cache.

Each case draws every sequence's full K/V, writes the already-cached part into randomly chosen
blocks, fills every other slot with NaN (so reading a slot that was never written poisons the
result), and hands the backend only this step's new tokens. The reference attends over the
original per-sequence K/V with explicit loops.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention import torch_backend as TB
from pagedrun.attention.torch_backend import TorchAttentionBackend, reshape_and_cache

from attention_reference import assert_matches_reference


class Case:
    """A batch of sequences (context_len, query_len) laid out in a paged cache."""

    def __init__(self, seqs, block_size, heads, kv_heads, head_dim=16, shuffle=True, seed=0,
                 dtype=torch.float32, num_pad_tokens=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.block_size, self.dtype = block_size, dtype
        need = sum(-(-(c + n) // block_size) for c, n in seqs)
        num_blocks = need + 3
        ids = list(range(num_blocks))
        if shuffle:
            rng.shuffle(ids)
        self.key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
        self.value_cache = torch.full_like(self.key_cache, float("nan"))

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.queries, self.keys, self.values, tables = [], [], [], []
        slots, new_k, new_v, q_all = [], [], [], []
        for ctx, n in seqs:
            seq_len = ctx + n
            table = [ids.pop() for _ in range(-(-seq_len // block_size))]
            tables.append(table)
            k, v = randn(seq_len, kv_heads, head_dim), randn(seq_len, kv_heads, head_dim)
            q = randn(n, heads, head_dim)
            self.keys.append(k), self.values.append(v), self.queries.append(q)
            for pos in range(seq_len):
                slot = table[pos // block_size] * block_size + pos % block_size
                if pos < ctx:  # cached before this step
                    self.key_cache.view(-1, kv_heads, head_dim)[slot] = k[pos]
                    self.value_cache.view(-1, kv_heads, head_dim)[slot] = v[pos]
                else:
                    slots.append(slot)
            new_k.append(k[ctx:]), new_v.append(v[ctx:]), q_all.append(q)
        for _ in range(num_pad_tokens):  # padding: garbage that must be neither written nor read
            slots.append(-1)
            new_k.append(randn(1, kv_heads, head_dim)), new_v.append(randn(1, kv_heads, head_dim))
            q_all.append(randn(1, heads, head_dim))
        self.query, self.key, self.value = torch.cat(q_all), torch.cat(new_k), torch.cat(new_v)
        self.meta = AttentionMetadata.build([n for _, n in seqs], [c for c, _ in seqs], tables, block_size,
                                            num_pad_tokens=num_pad_tokens)
        assert self.meta.slot_mapping.tolist() == slots  # the cache writes above used the same slots
        self.context_lens = [c for c, _ in seqs]
        self.scale = head_dim**-0.5

    def run(self, backend=None):
        return (backend or TorchAttentionBackend()).forward(
            self.query, self.key, self.value, self.key_cache, self.value_cache, self.meta, self.scale
        )

    def check(self, atol=1e-5):
        out = self.run()
        assert out.shape == self.query.shape and out.dtype == self.query.dtype
        assert_matches_reference(out, self.queries, self.keys, self.values, self.context_lens, self.scale, atol)
        return out


GQA = [(4, 4), (4, 2), (8, 1)]  # ratios 1, 2, 8


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_only_ragged(block_size, heads, kv_heads):
    # seq_lens: 1, exact multiples of the block size, one past, one short, a long one.
    lens = [1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1, 5, 77]
    Case([(n - 1, 1) for n in lens], block_size, heads, kv_heads, seed=block_size + heads).check()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_only(block_size, heads, kv_heads):
    Case([(0, 7), (0, block_size), (0, 1), (0, 2 * block_size + 3)], block_size, heads, kv_heads,
         seed=3).check()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_mixed_prefill_cached_prefix_decode(block_size, heads, kv_heads):
    seqs = [
        (0, 9),  # fresh prefill
        (block_size, 5),  # prefix hit of exactly one block, then 5 new tokens
        (13, 1),  # decode
        (2 * block_size + 3, block_size),  # chunked prefill continuing mid-block
        (0, 1),  # one-token prompt
        (40, 1),  # decode
    ]
    Case(seqs, block_size, heads, kv_heads, seed=block_size * heads).check()


@pytest.mark.parametrize("shuffle", [False, True])
def test_block_table_order_does_not_matter(shuffle):
    seqs = [(20, 1), (0, 12), (9, 4)]
    out = Case(seqs, 8, 4, 2, shuffle=shuffle, seed=11).check()
    other = Case(seqs, 8, 4, 2, shuffle=not shuffle, seed=11).run()
    torch.testing.assert_close(out, other, atol=1e-5, rtol=0)


def test_writes_new_tokens_and_skips_negative_slots():
    case = Case([(5, 3), (0, 4), (10, 1)], 8, 4, 2, seed=5, num_pad_tokens=2)
    before_k = case.key_cache.clone()
    out = case.check()
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "padding rows must stay zero"
    written = ~torch.isnan(case.key_cache) & torch.isnan(before_k)
    assert int(written.any(-1).any(-1).sum()) == 3 + 4 + 1  # exactly the real new tokens
    flat_k = case.key_cache.view(-1, 2, 16)
    for slot, k in zip(case.meta.slot_mapping.tolist(), case.key):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision(dtype, atol):
    Case([(0, 6), (17, 1), (8, 3), (31, 1)], 16, 8, 2, seed=9, dtype=dtype).check(atol=atol)


def test_decode_batch_matches_one_at_a_time():
    # The batched decode path must give each sequence what it would get alone.
    lens = [3, 17, 32, 33, 64]
    batch = Case([(n - 1, 1) for n in lens], 16, 8, 2, seed=21)
    out = batch.check()
    m = batch.meta
    for i, n in enumerate(lens):
        alone = AttentionMetadata(
            slot_mapping=torch.tensor([-1]),  # already written by the batch
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=m.seq_lens[i : i + 1],
            context_lens=m.context_lens[i : i + 1],
            block_tables=m.block_tables[i : i + 1, : -(-n // 16)],
            max_query_len=1,
            max_seq_len=n,
            block_size=16,
            query_lens_list=[1],
            seq_lens_list=[n],
        )
        single = TorchAttentionBackend().forward(
            batch.query[i : i + 1], batch.key[i : i + 1], batch.value[i : i + 1],
            batch.key_cache, batch.value_cache, alone, batch.scale,
        )
        torch.testing.assert_close(out[i : i + 1], single, atol=1e-6, rtol=0)


def test_decode_chunks():
    # padded to 16: 16 48 32 16 48 64 16 128; a chunk's rows = count x its longest <= 100.
    chunks = TB.decode_chunks([5, 40, 17, 1, 33, 64, 9, 120], 16, 100)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8)]
    assert TB.decode_chunks([3, 3, 3], 16, TB.DECODE_GATHER_TOKENS) == [range(0, 3)]
    assert TB.decode_chunks([500], 16, 100) == [range(0, 1)]  # longer than the limit: alone


@pytest.mark.parametrize("limit", [48, 100, 1 << 20])
@pytest.mark.parametrize("mixed", [False, True])
def test_decode_in_chunks(monkeypatch, limit, mixed):
    """Past DECODE_GATHER_TOKENS gathered rows the torch path decodes in chunks (the bound the
    memory plan budgets): each chunk within the limit, every row still the reference's."""
    lens = [5, 40, 17, 1, 33, 64, 9, 120]
    seqs = [(n - 1, 1) for n in lens] + ([(0, 9), (16, 5)] if mixed else [])
    case = Case(seqs, 16, 8, 2, seed=limit + mixed)
    whole = case.run(TorchAttentionBackend(use_cpu_kernel=False))
    rows, gather = [], TB._gather_decode

    def spy(query, key_cache, value_cache, tables, seq_lens, max_len, scale, **variant):
        rows.append(query.shape[0] * -(-max_len // 16) * 16)
        return gather(query, key_cache, value_cache, tables, seq_lens, max_len, scale, **variant)

    monkeypatch.setattr(TB, "DECODE_GATHER_TOKENS", limit)
    monkeypatch.setattr(TB, "_gather_decode", spy)
    out = case.run(TorchAttentionBackend(use_cpu_kernel=False))
    assert len(rows) == (1 if limit > 1000 else len(TB.decode_chunks(lens, 16, limit))) and sum(rows) > 0
    assert all(r <= max(limit, 128) for r in rows)
    assert_matches_reference(out, case.queries, case.keys, case.values, case.context_lens, case.scale, 1e-5)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=0)


def test_reshape_and_cache_layout():
    key_cache = torch.zeros(4, 8, 2, 4)
    value_cache = torch.zeros(4, 8, 2, 4)
    key = torch.randn(3, 2, 4)
    value = torch.randn(3, 2, 4)
    reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([2 * 8 + 5, -1, 3 * 8 + 7]))
    assert torch.equal(key_cache[2, 5], key[0]) and torch.equal(value_cache[3, 7], value[2])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2


