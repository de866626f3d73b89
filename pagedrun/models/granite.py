"""Granite 3.x dense (GraniteForCausalLM): the Llama block and four scalars from config.json.

- embedding_multiplier scales the embeddings (HF: inputs_embeds * m);
- attention_multiplier is the softmax scale, in place of head_dim ** -0.5;
- residual_multiplier scales the attention's and the MLP's outputs before each residual add
  (HF: residual + h * m). llama.py fuses the add into the next norm (norm(h, residual)), so h * m
  is what the norm adds: the same two float ops, the same bits;
- the logits are divided by logits_scaling, after the head, as HF does.

Applied explicitly, in HF's op order, so that greedy tokens equal HF's; folding the multipliers into
o_proj / down_proj / the embedding at load would not be bit-identical, and the embedding cannot be
scaled where it is also the (tied) LM head. The CPU layer runner has no op for the residual
multiplier: models with one other than 1 run the Python loop (layer_runner.py declines them).
GraniteMoE (GraniteMoeForCausalLM, Granite 3.x 1B-A400M and 3B-A800M) is the same with a mixture of
experts for MLP (models/moe.py): top-k on the router's logits, softmax over the k; on disk the
experts are stacked, `block_sparse_moe.input_linear.weight` [E, 2I, H] (gate rows, then up rows)
and `output_linear.weight` [E, H, I], the router `block_sparse_moe.router.layer.weight` [E, H].
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from pagedrun.models.moe import FusedMoE
from pagedrun.models.moe_models import MoEForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int, **blocks) -> None:
        super().__init__(config, dtype, layer_idx, **blocks)
        self.self_attn.scale = config.attention_multiplier  # read by the backend and the layer runner
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions, h, residual, rotary, kv_cache, meta, backend):
        """LlamaDecoderLayer's, each branch's output times residual_multiplier before its residual add."""
        m = self.residual_multiplier
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, x, rotary, kv_cache, meta, backend)
        if m != 1.0:  # x * 1.0 is x: skipped, and the layer runner can take such a model
            h = h * m
        x, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(x)
        return (h * m if m != 1.0 else h), residual


class GraniteForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's loading, packing and head, Granite's layers and scalars."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, dtype, device, make_layer=lambda i: GraniteDecoderLayer(config, dtype, i))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling


class GraniteMoeForCausalLM(MoEForCausalLM):
    """MoEForCausalLM's experts and loading, Granite's layers and scalars."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        # LlamaForCausalLM's, not MoEForCausalLM's (that builds Llama layers); the runner declines MoE
        LlamaForCausalLM.__init__(self, config, dtype, device, make_layer=lambda i: GraniteDecoderLayer(
            config, dtype, i, mlp=FusedMoE(config, dtype)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """MoEForCausalLM's, GraniteMoE's names first mapped onto its stacked ones (same layouts)."""

        def renamed():
            for name, tensor in weights:
                for old, new in _GRANITE_MOE_NAMES:
                    name = name.replace(old, new)
                yield name, tensor

        super().load_weights(renamed())


_GRANITE_MOE_NAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."),
                      (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                      (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"))
