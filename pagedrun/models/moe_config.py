"""MoEConfig: the mixture-of-experts part of an HF config.json (ModelConfig.moe), parsed once.

Each family names the same few numbers differently (num_experts / num_local_experts,
moe_intermediate_size / intermediate_size) and routes a little differently (transformers 5.24's
modeling files, checked op by op; docs/design/moe.md):

- Qwen3-MoE, Qwen2-MoE, OLMoE: softmax (float32) -> top-k -> renormalise if norm_topk_prob -> the
  weights rounded to the router logits' dtype (the model's) before they scale the experts' outputs;
- Mixtral: the same, always renormalised, and the weights stay float32 (the product is rounded);
- GPT-OSS: top-k on the logits (the router has a bias), then softmax over the k; experts with
  biases and the clamped SwiGLU ("swigluoai"); GraniteMoE (not parsed yet) routes the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedrun.errors import echo

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                     "GptOssForCausalLM")
SCORING = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "swigluoai")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Whether each decoder layer has the MoE block (else a dense MLP of ModelConfig.intermediate_size).
    sparse_layers: tuple[bool, ...]
    scoring: str = "softmax_topk"  # or "topk_softmax" (top-k on the logits, softmax over the k)
    norm_topk_prob: bool = False  # softmax_topk: renormalise the k weights to sum to 1
    weights_in_float32: bool = False  # Mixtral: the routing weights are not rounded to the model's dtype
    router_bias: bool = False  # GPT-OSS
    expert_bias: bool = False  # GPT-OSS: biases on w13 and w2
    activation: str = "silu"  # or "swigluoai" (GPT-OSS)
    swiglu_alpha: float = 1.702  # swigluoai: (up + 1) * gate * sigmoid(alpha * gate) ...
    swiglu_limit: float = 7.0  # ... with gate clamped to at most limit, up to [-limit, limit]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    shared_expert_gate: bool = False  # its output scaled by sigmoid(shared_expert_gate(x))

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def layer_parameters(self, hidden: int, active: bool = False) -> int:
        """Parameters of one MoE block: router, experts (all, or the top_k one token uses) and the
        shared expert with its gate."""
        e = self.top_k if active else self.num_experts
        i, s = self.intermediate_size, self.shared_expert_intermediate_size
        n = self.num_experts * hidden + e * 3 * hidden * i
        if self.router_bias:
            n += self.num_experts
        if self.expert_bias:
            n += e * (2 * i + hidden)
        if s:
            n += 3 * hidden * s
        if self.shared_expert_gate:
            n += hidden
        return n

    def activation_elems_per_token(self, hidden: int) -> int:
        """Elements of the model's dtype one token holds inside the block at its peak: its top_k rows
        gathered ([k, H]), their activations ([k, I]) and the experts' outputs ([k, H]), plus the
        shared expert's activation; the router's float32 scores count as two elements each."""
        k = self.top_k
        return k * (2 * hidden + self.intermediate_size) + self.shared_expert_intermediate_size + 2 * self.num_experts


def parse_moe(d: dict[str, Any], arch: str, num_layers: int, intermediate_size: int, err) -> MoEConfig:
    """The MoE fields of config.json `d` for architecture `arch`; `err(key, msg)` makes the error."""

    def count(key: str, default: int | None = None, low: int = 1) -> int:
        value = d.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise err(key, f"expected an integer >= {low}, got {echo(value)}")
        return value

    experts_key = "num_local_experts" if arch == "MixtralForCausalLM" or "num_experts" not in d else "num_experts"
    num_experts = count(experts_key)
    top_k = count("num_experts_per_tok")
    if top_k > num_experts:
        raise err("num_experts_per_tok", f"{top_k} exceeds the {num_experts} experts")
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        inter = count("moe_intermediate_size")
        step = count("decoder_sparse_step", 1)
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise err("mlp_only_layers", f"expected a list of layer indices, got {echo(dense)}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    else:  # Mixtral, OLMoE: every layer, experts of intermediate_size
        inter, sparse = intermediate_size, (True,) * num_layers
    if arch == "GptOssForCausalLM":
        alpha, limit = (d.get(k, default) for k, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)))
        for key, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise err(key, f"expected a positive number, got {echo(value)}")
        return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate_size,
                         sparse_layers=(True,) * num_layers, scoring="topk_softmax", router_bias=True,
                         expert_bias=True, activation="swigluoai", swiglu_alpha=float(alpha),
                         swiglu_limit=float(limit))
    norm = d.get("norm_topk_prob", arch == "MixtralForCausalLM")
    if arch == "MixtralForCausalLM":
        norm = True  # HF's MixtralTopKRouter always renormalises
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = count("shared_expert_intermediate_size")
    if d.get("hidden_act", "silu") != "silu":
        raise err("hidden_act", f"{echo(d.get('hidden_act'))} is not supported (only 'silu')")
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, sparse_layers=sparse,
                     norm_topk_prob=bool(norm), weights_in_float32=arch == "MixtralForCausalLM",
                     shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
