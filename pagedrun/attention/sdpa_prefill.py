"""Prefill attention through torch's scaled_dot_product_attention: one call per prefilling sequence.

On a GPU this is the tensor-core path (flash / memory-efficient SDPA), which the paged kernels are
not: they re-read the prefix once per query token with scalar FMAs (docs/design/cuda-kernels.md, "Prefill").
So every backend sends prefill here and keeps its paged kernels (or gather + SDPA) for decode.

A sequence with nothing cached before this step attends over this step's own K/V (causal); one with
a cached prefix (prefix-cache hit, chunked prefill, recompute) gathers its first seq_len cached
tokens through its block table, which this step's reshape_and_cache has already filled, and shifts
the causal mask by the prefix length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSeq:
    index: int  # sequence index in the step (its row of block_tables)
    start: int  # first token of the step's packed layout
    num_tokens: int  # query length (> 1)
    context_len: int  # tokens cached before this step
    seq_len: int  # context_len + num_tokens


def prefill_seqs(query_lens: list[int], seq_lens: list[int]) -> list[PrefillSeq]:
    """The sequences with more than one query token (decodes are the paged kernels' job)."""
    out, start = [], 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens)):
        if n > 1:
            out.append(PrefillSeq(i, start, n, s - n, s))
        start += n
    return out


def gather_one(key_cache, value_cache, block_table, seq_len: int, block_size: int):
    """One sequence's first seq_len cached K/V, [seq_len, kv_heads, hd] each."""
    ids = block_table[: -(-seq_len // block_size)].long()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    k = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    v = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    return k, v


def prefill_attention(q, k, v, context_len: int, scale: float) -> torch.Tensor:
    """q [n, heads, hd] at positions context_len.., k/v [context_len+n, kv_heads, hd]."""
    n, seq_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    if context_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position context_len + j and sees keys 0..context_len + j.
        # (is_causal aligns the mask top-left, which is only right without a prefix.)
        q_pos = torch.arange(context_len, context_len + n, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def attend_prefills(out, query, key, value, key_cache, value_cache, block_tables, seqs: list[PrefillSeq],
                    block_size: int, scale: float) -> None:
    """out[tokens of each seq] = its causal attention; the cache must already hold this step's K/V."""
    for p in seqs:
        s, n = p.start, p.num_tokens
        if p.context_len == 0:  # nothing cached before: this step's K/V are the whole sequence
            k, v = key[s : s + n], value[s : s + n]
        else:
            k, v = gather_one(key_cache, value_cache, block_tables[p.index], p.seq_len, block_size)
        out[s : s + n] = prefill_attention(query[s : s + n], k, v, p.context_len, scale)
