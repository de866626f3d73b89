"""The mixture-of-experts families on llama.py's layers: Qwen3-MoE (per-head q/k norm), Qwen2-MoE
(q/k/v bias, a shared expert), Mixtral (Llama attention), OLMoE (q/k norm over the whole projected
vector, clip_qkv). Each decoder layer is LlamaDecoderLayer with a FusedMoE (models/moe.py) as its MLP
where config.moe.sparse_layers says so, else Llama's dense MLP (Qwen's mlp_only_layers and
decoder_sparse_step); OLMoE's attention is OlmoeAttention below.

Experts arrive per expert, as the Hub and transformers 5.24's save_pretrained name them
(`mlp.experts.{e}.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.{e}.{w1,w3,w2}`), or
already stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]:
transformers' module layout); load_weights stacks them into FusedMoE's w13 / w2, each expert's
each projection exactly once.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from pagedrun.errors import PagedrunError
from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)
from pagedrun.models.moe import FusedMoE

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class OlmoeAttention(LlamaAttention):
    """Llama's attention with OLMoE's q_norm / k_norm over the whole projected q and k (weights
    [heads * hd] and [kv_heads * hd], not per head) and, with clip_qkv, q, k and v clamped to
    [-clip, clip] after the norms (HF OlmoeAttention's order)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__(config, dtype, layer_idx)
        self.qk_norm = False  # not per head: forward applies the whole-vector norms
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps, dtype)
        self.clip = config.clip_qkv

    def forward(self, positions, x, rotary, kv_cache, meta, backend):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        key_cache, value_cache, *kv_scales = kv_cache
        out = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale, *kv_scales, window=self.window,
                              softcap=self.softcap)
        return self.o_proj(out.reshape(t, self.q_size))


class MoEForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's forward, head and loading of everything but the experts; the MoE layers'
    experts are stacked here."""

    attention_class = LlamaAttention  # a family's own (GPT-OSS's, with sinks) in a subclass

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        moe = config.moe
        assert moe is not None
        attention = OlmoeAttention if config.qk_norm_whole else self.attention_class

        def make_layer(i: int) -> LlamaDecoderLayer:
            mlp = FusedMoE(config, dtype) if moe.sparse_layers[i] else None
            return LlamaDecoderLayer(config, dtype, i, mlp=mlp, self_attn=attention(config, dtype, i))

        super().__init__(config, dtype, device, make_layer)  # LayerRunner.for_model declines MoE layers

    def moe_blocks(self) -> list[tuple[int, FusedMoE]]:
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, FusedMoE)]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """All but the experts' stacked weights, which load_weights fills itself."""
        return {n: p for n, p in self.named_parameters() if ".mlp.w13" not in n and ".mlp.w2" not in n}

    def process_weights_after_loading(self) -> None:
        for _, block in self.moe_blocks():
            block.process_weights_after_loading()
        super().process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LlamaForCausalLM's for every tensor but the experts', which are stacked into each MoE
        layer's w13 ([gate; up] per expert) and w2, each (layer, expert, projection) exactly once."""
        blocks = dict(self.moe_blocks())
        loaded: set[tuple[int, int, str]] = set()

        def target(hf_name: str, layer: int, expert: int | None) -> FusedMoE:
            block = blocks.get(layer)
            if block is None or (expert is not None and expert >= block.num_experts):
                raise PagedrunError(f"{hf_name}: unexpected tensor (not part of {self.config.architecture})")
            return block

        def put(hf_name: str, block: FusedMoE, layer: int, e: int, part: str, tensor: torch.Tensor) -> None:
            if (layer, e, part) in loaded:
                raise PagedrunError(f"{hf_name}: appears twice in the checkpoint")
            try:
                block.load_expert(e, part, tensor)
            except PagedrunError as err:
                raise PagedrunError(f"{hf_name}: {err}") from None
            loaded.add((layer, e, part))

        def rest():
            for hf_name, tensor in weights:
                if hf_name.startswith("model.layers.") and ".block_sparse_moe." in hf_name:  # Mixtral
                    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
                m = _PER_EXPERT.match(hf_name)
                if m:
                    layer, e = int(m.group(1)), int(m.group(2))
                    put(hf_name, target(hf_name, layer, e), layer, e, _PART[m.group(3)], tensor)
                    continue
                m = _STACKED_EXPERTS.match(hf_name)
                if m:
                    layer = int(m.group(1))
                    block = target(hf_name, layer, None)
                    e_, i, h = block.num_experts, block.intermediate_size, block.hidden_size
                    want = (e_, 2 * i, h) if m.group(2) == "gate_up_proj" else (e_, h, i)
                    if tuple(tensor.shape) != want:
                        raise PagedrunError(f"{hf_name}: shape mismatch: model expects {list(want)}, "
                                            f"checkpoint has {list(tensor.shape)}")
                    for e in range(e_):
                        if m.group(2) == "gate_up_proj":
                            put(hf_name, block, layer, e, "gate", tensor[e, :i])
                            put(hf_name, block, layer, e, "up", tensor[e, i:])
                        else:
                            put(hf_name, block, layer, e, "down", tensor[e])
                    continue
                yield hf_name, tensor

        super().load_weights(rest())
        for layer, block in blocks.items():
            for e in range(block.num_experts):
                for part in ("gate", "up", "down"):
                    if (layer, e, part) not in loaded:
                        raise PagedrunError(f"missing tensors: model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight "
                                            f"(every expert of every MoE layer must be in the checkpoint)")

    def _shard(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """Llama's, with the shared expert's gate/up halves of its own intermediate size."""
        if shard is not None and ".shared_expert." in name:
            size = self.config.moe.shared_expert_intermediate_size
            return param.data.narrow(0, shard * size, size)
        return super()._shard(param, name, shard)
