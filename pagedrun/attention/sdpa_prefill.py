"""Prefill attention through torch's scaled_dot_product_attention: one call per prefilling sequence.

On a GPU this is the tensor-core path (flash / memory-efficient SDPA), which the paged kernels are
not: they re-read the prefix once per query token with scalar FMAs (docs/design/cuda-kernels.md, "Prefill").
So every backend sends prefill here and keeps its paged kernels (or gather + SDPA) for decode.

A sequence with nothing cached before this step attends over this step's own K/V (causal); one with
a cached prefix (prefix-cache hit, chunked prefill, recompute) gathers its cached tokens through its
block table, which this step's reshape_and_cache has already filled, and shifts the causal mask by
the prefix length.

Sliding window (window > 0, pagedrun/attention/backend.py): query j sees only the `window` keys up to
its own position. The gather starts at the first key the step's first query sees, so the blocks wholly
below it (placeholders with the hybrid KV manager: anything, NaN included) are never read. Soft-capped
logits (softcap > 0) and attention sinks (GPT-OSS: a learned per-head logit with a zero value vector
in each softmax) have no SDPA kernel: `attention` then computes the scores explicitly in float32, a
prefill in chunks of query rows (SCORE_ELEMS).
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


def first_key(position: int, window: int) -> int:
    """The first key position a query at `position` sees (0 without a window)."""
    return max(0, position - window + 1) if window > 0 else 0


def gather_one(key_cache, value_cache, block_table, seq_len: int, block_size: int, start: int = 0):
    """One sequence's cached K/V at positions start..seq_len-1, [seq_len - start, kv_heads, hd] each;
    the table's entries for blocks below `start` are not read."""
    first = start // block_size
    ids = block_table[first : -(-seq_len // block_size)].long()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    lo, hi = start - first * block_size, seq_len - first * block_size
    k = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[lo:hi]
    v = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[lo:hi]
    return k, v


def attention(qh, kh, vh, mask, scale: float, softcap: float = 0.0, is_causal: bool = False, *,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., heads, n, hd] queries and [..., kv_heads, L, hd] keys/values (GQA: heads a
    multiple of kv_heads); mask: bool, broadcastable to [..., heads, n, L], True = attend. With
    softcap > 0 or sinks (float32 [heads]) the scores are computed explicitly (float32), capped,
    masked and softmaxed, each head's sink a last column of its scores that is dropped after the
    softmax (HF's GPT-OSS eager attention): it only adds exp(sink - max) to the denominator."""
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=qh.shape[-3] != kh.shape[-3])
    heads, kv_heads, n, hd = qh.shape[-3], kh.shape[-3], qh.shape[-2], qh.shape[-1]
    group = heads // kv_heads
    # Each kv head's group of query heads as one matrix: no repeated K/V.
    q = qh.float().reshape(*qh.shape[:-3], kv_heads, group * n, hd)
    scores = (q @ kh.float().transpose(-1, -2)) * scale  # [..., kv_heads, group * n, L]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(*qh.shape[:-3], heads, n, -1)
    if is_causal:
        mask = torch.ones(n, scores.shape[-1], dtype=torch.bool, device=qh.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.device, torch.float32).view(heads, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = probs.reshape(*qh.shape[:-3], kv_heads, group * n, -1)
    out = probs @ vh.float()
    return out.view(qh.shape).to(qh.dtype)


# Explicit scores (softcap > 0) are computed for this many (head, query, key) triples at a time at most:
# a long prompt's full [heads, n, seq_len] float32 scores would not fit the memory SDPA's kernels avoid.
SCORE_ELEMS = 1 << 24


def prefill_attention(q, k, v, context_len: int, scale: float, *, key_start: int = 0, window: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, heads, hd] at positions context_len.., k/v [context_len + n - key_start, kv_heads, hd]:
    the keys at positions key_start..context_len + n - 1."""
    n, num_keys = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    if softcap <= 0 and sinks is None:
        if context_len == 0 and key_start == 0 and window <= 0:
            return attention(qh, kh, vh, None, scale, is_causal=True).transpose(0, 1)
        mask = _mask(context_len, n, key_start, num_keys, window, q.device)
        return attention(qh, kh, vh, mask, scale).transpose(0, 1)
    # In chunks of query rows, each against the keys its rows see (under a window, at most rows + window).
    rows = max(1, SCORE_ELEMS // (qh.shape[0] * num_keys))
    outs = []
    for i in range(0, n, rows):
        r, pos = min(rows, n - i), context_len + i
        lo, hi = max(first_key(pos, window), key_start) - key_start, pos + r - key_start
        mask = _mask(pos, r, key_start + lo, hi - lo, window, q.device)
        outs.append(attention(qh[:, i : i + r], kh[:, lo:hi], vh[:, lo:hi], mask, scale, softcap, sinks=sinks))
    return torch.cat(outs, dim=1).transpose(0, 1)


def _mask(q_start: int, n: int, k_start: int, num_keys: int, window: int, device) -> torch.Tensor:
    """[n, num_keys] bool: query j (position q_start + j) sees key i (position k_start + i): keys up to
    its own (is_causal aligns the mask top-left, which is only right without a prefix), within the window."""
    q_pos = torch.arange(q_start, q_start + n, device=device)[:, None]
    k_pos = torch.arange(k_start, k_start + num_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask


def attend_prefills(out, query, key, value, key_cache, value_cache, block_tables, seqs: list[PrefillSeq],
                    block_size: int, scale: float, *, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> None:
    """out[tokens of each seq] = its causal attention (within `window` keys, logits capped at `softcap`
    when they are > 0, each head's sink logit in its softmax when sinks is given); the cache must
    already hold this step's K/V."""
    for p in seqs:
        s, n = p.start, p.num_tokens
        start = first_key(p.context_len, window)  # the first key any of the sequence's queries sees
        if p.context_len == 0:  # nothing cached before: this step's K/V are the whole sequence
            k, v = key[s : s + n], value[s : s + n]
        else:
            k, v = gather_one(key_cache, value_cache, block_tables[p.index], p.seq_len, block_size, start)
        out[s : s + n] = prefill_attention(query[s : s + n], k, v, p.context_len, scale, key_start=start,
                                           window=window, softcap=softcap, sinks=sinks)
