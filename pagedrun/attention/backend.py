"""The attention backend interface: write this step's K/V into the paged cache, then attend.

Cache layout (shared by every backend and by kernels/cuda/*.cu), one pair of tensors per layer:

    key_cache   [num_blocks, block_size, num_kv_heads, head_size]
    value_cache [num_blocks, block_size, num_kv_heads, head_size]

A slot s lives at block s // block_size, offset s % block_size. This is the layout vLLM's newer
backends use; keeping one layout everywhere lets copy-on-write and swap move whole blocks with
one index on dimension 0.

Per-layer attention variants, passed by the model as keywords (0 means "off"):

    window   sliding-window attention: a query at absolute position p sees exactly the keys at
             positions j with p - window < j <= p (HF's and vLLM's convention: window keys,
             itself included). With the hybrid KV manager a sliding layer's block table holds a
             placeholder (block 0) for every block wholly below the window of the sequence's
             first query in the step: a backend must never let those blocks' contents (anything,
             NaN included) reach the output.
    softcap  logit soft-capping (Gemma 2): score = softcap * tanh(scale * q.k / softcap), before
             the softmax.
    sinks    learned attention sinks (GPT-OSS): float32 [num_heads] on the query's device (None: off),
             whatever the model's dtype. Head h's sink is one more logit in each of its softmaxes, with
             a zero value vector: out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)),
             m = max(max_j s_j, sinks[h]), the s_j after the softcap and within the window (HF's
             eager_attention_forward). It only shrinks the weights: a large sink drives the output to 0.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pagedrun.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]  (this step's new tokens)
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write key/value through meta.slot_mapping, then compute causal attention of each query
        over its sequence's cached tokens (read through meta.block_tables), within `window` keys
        when it is > 0, with logits soft-capped at `softcap` when it is > 0, and each head's sink
        logit in its softmax denominator when `sinks` is given.

        Contract: every new token's K/V is written before any query attends. The scheduler relies on
        it: a request may hit prefix-cache blocks that another request computes in the same step."""
        ...

