"""Random FusedMoE blocks (pagedrun/models/moe.py) in each flavour the MoE families build, plain
(not packed), for the grouped-vs-loop checks: tests/models/test_moe_grouped.py and, on a GPU,
tests/gpu/test_moe_grouped_cuda.py."""
from __future__ import annotations

import dataclasses

import torch

# (activation, expert and router bias, float32 routing weights, shared expert size) per family.
FLAVOURS = {"qwen3_moe": ("silu", False, False, 0), "qwen2_moe": ("silu", False, False, 48),
            "mixtral": ("silu", False, True, 0), "gpt_oss": ("swigluoai", True, False, 0)}


def random_block(dtype: torch.dtype, flavour: str = "qwen3_moe", e: int = 8, h: int = 64, i: int = 32,
                 k: int = 3, seed: int = 0):
    """(FusedMoE with weights, biases and shared expert as `flavour` has, 0.2 N(0, 1), its ModelConfig),
    built under ops.torch_only() so that the experts stay in the plain [E, 2I, H] / [E, H, I] layout."""
    from pagedrun.models import ops
    from pagedrun.models.config import ModelConfig
    from pagedrun.models.moe import FusedMoE

    act, bias, f32_weights, shared = FLAVOURS[flavour]
    cfg = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": h, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
         "max_position_embeddings": 64, "num_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": i},
        "test")
    m = dataclasses.replace(cfg.moe, activation=act, expert_bias=bias, router_bias=bias,
                            weights_in_float32=f32_weights, norm_topk_prob=f32_weights,
                            shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared),
                            scoring="topk_softmax" if act == "swigluoai" else "softmax_topk")
    cfg = dataclasses.replace(cfg, moe=m)
    with ops.torch_only():
        block = FusedMoE(cfg, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    assert not block.packed
    return block, cfg
