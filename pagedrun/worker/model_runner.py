"""ModelRunner: turn one scheduler decision into tensors, run the model, return the logits to sample.

Input: for each scheduled sequence, the token ids to compute, their first position and the
sequence's block table. Output: logits for the sequences whose step ends at their last token; for an input that asks for
prompt logprobs, also the hidden states of its first `prompt_positions` tokens (`last_prompt_hidden`,
turned into logits by the worker a slice at a time).
This is the only place where the scheduler's lists become tensors (AttentionMetadata), so the
scheduler stays tensor-free and the model stays request-free.

With `decode` (a DecodeShape) and a backend that supports it (static_decode: the CuPy kernels, or
the same run by the emulator), a decode-only step of at most max_num_seqs rows runs on static
buffers padded to a bucket (worker/decode_buffers.py), replayed from a CUDA graph where one was
captured for that bucket (worker/cuda_graphs.py). Prefill and mixed steps, and larger batches,
take the path above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedrun.attention.metadata import AttentionMetadata, StepMetadata, vector
from pagedrun.sample.transfer import to_device
from pagedrun.worker.decode_buffers import DecodeBuffers, DecodeShape, bucket_for, decode_buckets


@dataclass
class ModelInput:
    token_ids: list[int]  # the new tokens of this sequence, in order
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_tables: list[list[int]]  # one per KV cache group (kv/groups.py)
    sample: bool  # produce logits for the last token
    prompt_positions: int = 0  # keep the hidden states of this many leading tokens (prompt logprobs)


@dataclass
class Feed:
    """Input tokens sampled by the step before and not read back yet (async scheduling): flat token
    index dst[k] of this step takes samples[src[k]], copied on the device (stream-ordered after
    the sampler that wrote them; no host synchronisation)."""
    dst: list[int]
    src: list[int]
    samples: torch.Tensor  # [rows] int64 on the device: the step before's sampled ids

    def apply(self, input_ids: torch.Tensor) -> None:
        device = input_ids.device
        dst, src = to_device(self.dst, torch.long, device), to_device(self.src, torch.long, device)
        input_ids.index_copy_(0, dst, self.samples.index_select(0, src))


class ModelRunner:
    def __init__(self, model, kv_caches, backend, block_size: int, device: torch.device,
                 layer_groups: list[int] | None = None, decode: DecodeShape | None = None):
        """layer_groups: the KV cache group of every layer (None: one group). decode: the static
        decode buffers' shape (None, or a backend without static_decode: today's path only)."""
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1 if layer_groups else 1
        self.last_prompt_hidden: dict[int, torch.Tensor] = {}
        self.buffers: DecodeBuffers | None = None
        self.graphs = None  # a worker/cuda_graphs.DecodeGraphs once captured
        if decode is not None and getattr(backend, "static_decode", False):
            self.buffers = DecodeBuffers(decode, device, mirrors=2 if device.type == "cuda" else 1)
            self.buckets = decode_buckets(decode.max_rows)
            self._static_metas: dict[int, StepMetadata] = {}

    def build_metadata(self, inputs: list[ModelInput]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        query_lens, starts = [len(inp.token_ids) for inp in inputs], [inp.start_pos for inp in inputs]
        if all(q == 1 for q in query_lens):  # a decode step: one token per sequence, at its start
            input_ids, positions = [inp.token_ids[0] for inp in inputs], starts
        else:
            input_ids, positions = [], []
            for inp in inputs:
                input_ids.extend(inp.token_ids)
                positions.extend(range(inp.start_pos, inp.start_pos + len(inp.token_ids)))
        # One metadata per group: the same sequences and positions, each group's own blocks.
        metas = AttentionMetadata.build_groups(query_lens, starts, [[inp.block_tables[g] for inp in inputs]
                                                                    for g in range(self.num_groups)],
                                               self.block_size, device=self.device)
        meta: StepMetadata = metas[0] if self.num_groups == 1 else [metas[g] for g in self.layer_groups]
        ids, pos_t = vector([input_ids, positions], np.int64, self.device)  # one array, one copy
        return ids, pos_t, meta

    @torch.inference_mode()
    def execute(self, inputs: list[ModelInput], feed: Feed | None = None) -> torch.Tensor:
        """Logits [num_sampling_seqs, vocab] (float32), rows in the order of the sampling inputs.
        feed: input tokens the host does not know yet (async scheduling), taken on the device from
        the step before's samples."""
        if self.static_decode_step(inputs):
            self.last_prompt_hidden = {}
            return self.execute_static(inputs, feed)
        ids, positions, meta = self.build_metadata(inputs)
        if feed is not None:
            feed.apply(ids)
        hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
        self.last_prompt_hidden: dict[int, torch.Tensor] = {}  # input index -> [prompt_positions, hidden]
        if any(inp.prompt_positions for inp in inputs):
            start = 0
            for i, inp in enumerate(inputs):
                if inp.prompt_positions:
                    self.last_prompt_hidden[i] = hidden[start : start + inp.prompt_positions]
                start += len(inp.token_ids)
        if all(inp.sample and len(inp.token_ids) == 1 for inp in inputs):
            # A decode-only step: every row of hidden is a last token, in order. No gather (on a
            # GPU, no index list copied to the device mid-step).
            return self.model.compute_logits(hidden)
        last = []
        end = 0
        for inp in inputs:
            end += len(inp.token_ids)
            if inp.sample:
                last.append(end - 1)
        if not last:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])

    # ---- decode-only steps on static buffers ---------------------------------------------------

    def static_decode_step(self, inputs: list[ModelInput]) -> bool:
        """Whether this step runs on the static buffers: every input one sampled token, at most
        max_num_seqs of them."""
        return (self.buffers is not None and 0 < len(inputs) <= self.buffers.shape.max_rows
                and all(len(inp.token_ids) == 1 and inp.sample and not inp.prompt_positions for inp in inputs))

    def execute_static(self, inputs: list[ModelInput], feed: Feed | None = None) -> torch.Tensor:
        n = len(inputs)
        bucket = bucket_for(n, self.buckets)
        groups = range(self.num_groups)
        self.buffers.fill([inp.token_ids[0] for inp in inputs], [inp.start_pos for inp in inputs],
                          [[inp.block_tables[g] for inp in inputs] for g in groups])
        if feed is not None:  # after the copies, before the replay: the graph reads input_ids
            feed.apply(self.buffers.input_ids)
        if self.graphs is not None and self.graphs.has(bucket):
            return self.graphs.replay(bucket)[:n]
        return self.forward_static(bucket)[:n]

    def forward_static(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, vocab] of the rows the buffers hold: the region a CUDA graph captures
        (embedding, layers, final norm, LM head), the same launches eager or replayed."""
        b = self.buffers
        hidden = self.model(b.input_ids[:bucket], b.positions[:bucket], self.kv_caches, self.static_metadata(bucket),
                            self.backend)
        return self.model.compute_logits(hidden)

    def static_metadata(self, bucket: int) -> StepMetadata:
        meta = self._static_metas.get(bucket)
        if meta is None:
            cache_device = self.kv_caches[0][0].device  # the backends key their PagedStep by the cache's
            meta = self._static_metas[bucket] = self.buffers.metadata(
                bucket, self.layer_groups if self.num_groups > 1 else None, self.backend.wrap, self.backend.name,
                cache_device)
        return meta
