"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the Llama
block with its weights already fused on disk.

A checkpoint stores `self_attn.qkv_proj.weight` [(heads + 2 kv_heads) * head_dim, hidden] (q, k, v
stacked) and `mlp.gate_up_proj.weight` [2 * intermediate, hidden] (gate first, HF's chunk(2)):
exactly the layout of llama.py's fused Linears, so load_weights splits each into the q/k/v and
gate/up slices LlamaForCausalLM.load_weights fills (views, no copy) and the rest of the model is
Llama's. What else Phi needs is configuration, read by config.py: LongRoPE (rope.py; the factors
chosen once from max_model_len), partial_rotary_factor (Phi-4-mini rotates 96 of 128 dims), one
sliding_window for every layer (Phi-3-mini-4k: 2047; transformers' Phi3 has no layer_types), no
biases.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedrun.errors import PagedrunError
from pagedrun.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LlamaForCausalLM's, with each fused tensor handed over as the HF-named parts it holds."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {".self_attn.qkv_proj.": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
                 ".mlp.gate_up_proj.": (("gate_proj", "up_proj"), (inter, inter))}

        def split():
            for name, tensor in weights:
                part = next((p for p in fused if p in name), None)
                if part is None:
                    yield name, tensor
                    continue
                names, sizes = fused[part]
                if tensor.dim() < 1 or tensor.shape[0] != sum(sizes):
                    raise PagedrunError(f"{name}: shape mismatch: model expects {sum(sizes)} rows "
                                        f"({' + '.join(map(str, sizes))}), checkpoint has {list(tensor.shape)}")
                owner = part.split(".")[1]  # self_attn / mlp
                for sub, piece in zip(names, tensor.split(list(sizes), dim=0), strict=True):
                    yield name.replace(part, f".{owner}.{sub}."), piece

        super().load_weights(split())
