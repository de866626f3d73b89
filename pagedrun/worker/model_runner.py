"""ModelRunner: turn one scheduler decision into tensors, run the model, return the logits to sample.

Input: for each scheduled sequence, the token ids to compute, their first position and the
sequence's block table. Output: logits for the sequences whose step ends at their last token; for an input that asks for
prompt logprobs, also the hidden states of its first `prompt_positions` tokens (`last_prompt_hidden`,
turned into logits by the worker a slice at a time).
This is the only place where the scheduler's lists become tensors (AttentionMetadata), so the
scheduler stays tensor-free and the model stays request-free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrun.attention.metadata import AttentionMetadata, StepMetadata


@dataclass
class ModelInput:
    token_ids: list[int]  # the new tokens of this sequence, in order
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_tables: list[list[int]]  # one per KV cache group (kv/groups.py)
    sample: bool  # produce logits for the last token
    prompt_positions: int = 0  # keep the hidden states of this many leading tokens (prompt logprobs)


class ModelRunner:
    def __init__(self, model, kv_caches, backend, block_size: int, device: torch.device,
                 layer_groups: list[int] | None = None):
        """layer_groups: the KV cache group of every layer (None: one group)."""
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1 if layer_groups else 1

    def build_metadata(self, inputs: list[ModelInput]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        for inp in inputs:
            input_ids.extend(inp.token_ids)
            positions.extend(range(inp.start_pos, inp.start_pos + len(inp.token_ids)))
        query_lens, starts = [len(inp.token_ids) for inp in inputs], [inp.start_pos for inp in inputs]
        # One metadata per group: the same sequences and positions, each group's own blocks.
        metas = AttentionMetadata.build_groups(query_lens, starts, [[inp.block_tables[g] for inp in inputs]
                                                                    for g in range(self.num_groups)],
                                               self.block_size, device=self.device)
        meta: StepMetadata = metas[0] if self.num_groups == 1 else [metas[g] for g in self.layer_groups]
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta

    @torch.inference_mode()
    def execute(self, inputs: list[ModelInput]) -> torch.Tensor:
        """Logits [num_sampling_seqs, vocab] (float32), rows in the order of the sampling inputs."""
        ids, positions, meta = self.build_metadata(inputs)
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
