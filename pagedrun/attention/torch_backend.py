"""Paged attention in plain torch: the CPU backend and the reference the CuPy kernels are checked against.

Two steps per layer, as in vLLM: reshape_and_cache (scatter this step's K/V into their slots) and
then attention over each sequence's blocks, found through its block table.

- Decode tokens (query length 1, the bulk of the work in a batch job) are done together: one gather
  of every sequence's blocks (padded to the longest), a length mask, one batched SDPA call with
  GQA (K/V are never repeated per query head). No Python loop over sequences.
- Prefill tokens (query length > 1) go one sequence at a time through torch SDPA; with a cached
  prefix (context_lens > 0) the causal mask is shifted by the context length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedrun.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        num_tokens = query.shape[0]
        qlens = meta.query_lens_list
        if meta.is_decode_only and sum(qlens) == num_tokens:
            return self._decode(query, key_cache, value_cache, meta, range(meta.num_seqs), scale)

        out = query.new_zeros(query.shape)  # rows of padding tokens stay zero
        starts = meta.query_start_loc.tolist()
        decode_seqs = [i for i, n in enumerate(qlens) if n == 1]
        if decode_seqs:
            tok = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
            out[tok] = self._decode(query[tok], key_cache, value_cache, meta, decode_seqs, scale)
        context_lens = meta.context_lens.tolist()
        for i, n in enumerate(qlens):
            if n <= 1:
                continue
            s = starts[i]
            ctx, seq_len = context_lens[i], meta.seq_lens_list[i]
            if ctx == 0:
                # Nothing cached before this step: this step's K/V are the whole sequence.
                k, v = key[s : s + n], value[s : s + n]
            else:
                k, v = _gather_one(key_cache, value_cache, meta.block_tables[i], seq_len, meta.block_size)
            out[s : s + n] = _prefill_attention(query[s : s + n], k, v, ctx, scale)
        return out

    def _decode(self, query, key_cache, value_cache, meta, seqs, scale) -> torch.Tensor:
        """query [S, heads, hd], one token per sequence in `seqs` -> [S, heads, hd]."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        all_seqs = isinstance(seqs, range) and len(seqs) == meta.num_seqs
        seq_lens_list = meta.seq_lens_list if all_seqs else [meta.seq_lens_list[i] for i in seqs]
        seq_lens = meta.seq_lens if all_seqs else meta.seq_lens[list(seqs)]
        max_len = max(seq_lens_list)
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables if all_seqs else meta.block_tables[list(seqs)]
        ids = tables[:, :num_blocks].reshape(-1)
        length = num_blocks * block_size
        # One gather for all sequences: [S, L, kv_heads, hd], viewed as [S, kv_heads, L, hd].
        k = key_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
        valid = torch.arange(length, device=query.device)[None, :] < seq_lens.to(query.device)[:, None]
        # Slots past the end may hold anything (another sequence's stale data, or memory never
        # written, possibly NaN): zero them, since a masked NaN score or 0 * NaN value still
        # poisons the output. k and v are copies. (Cheaper than gathering token by token.)
        invalid = ~valid[:, None, :, None]
        k.masked_fill_(invalid, 0.0)
        v.masked_fill_(invalid, 0.0)
        # SDPA with GQA on the un-repeated K/V was about 2x faster on CPU than matmul+softmax.
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2).to(k.dtype),  # [S, heads, 1, hd]
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.view(num_seqs, num_heads, head_dim).to(query.dtype)

    def copy_blocks(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]
    ) -> None:
        """Copy-on-write: block src -> dst in every layer (one indexed copy per cache tensor)."""
        if not pairs:
            return
        device = kv_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for key_cache, value_cache in kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter [T, kv_heads, hd] K/V into slot_mapping's slots; negative slots are skipped."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(value_cache.dtype))


def _gather_one(key_cache, value_cache, block_table, seq_len: int, block_size: int):
    """One sequence's first seq_len cached K/V, [seq_len, kv_heads, hd] each."""
    ids = block_table[: -(-seq_len // block_size)].long()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    k = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    v = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    return k, v


def _prefill_attention(q, k, v, context_len: int, scale: float) -> torch.Tensor:
    """q [n, heads, hd] at positions context_len.., k/v [context_len+n, kv_heads, hd]."""
    n, seq_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    if context_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position context_len + j and sees keys 0..context_len + j.
        q_pos = torch.arange(context_len, context_len + n, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
