"""Gemma 2 and Gemma 3 (text) in one file, built from llama.py's pieces.

Against the Llama block, Gemma changes five things:

- every RMSNorm scales by (1 + w), in float32 (HF: normed x.float() * (1.0 + w.float()), cast back);
- "sandwich" norms: the attention's and the MLP's outputs are normed too (post_attention_layernorm,
  post_feedforward_layernorm) before they join the residual stream, and the MLP's input has a norm
  of its own (pre_feedforward_layernorm);
- the MLP is GeGLU: gelu_tanh(gate) * up;
- the embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype first;
- attention: scale query_pre_attn_scalar ** -0.5; sliding-window layers (Gemma 2: every other one,
  Gemma 3: five in six) with their own RoPE base in Gemma 3 (rope_local_base_freq); Gemma 3 normalises
  q and k per head (as Qwen3 does); Gemma 2 soft-caps the attention logits and the final logits
  (cap * tanh(x / cap)).

embed * sqrt(H) -> N x (norm -> attention -> norm -> + residual -> norm -> GeGLU -> norm -> + residual)
-> norm -> tied lm_head (-> soft-cap). The residual adds are fused into the next norm as in llama.py:
post_attention_layernorm's output joins the residual in pre_feedforward_layernorm, and
post_feedforward_layernorm's in the next layer's input_layernorm.

(1 + w) is folded into the norm weights at load time and kept in float32: for a float32 model the
norm is then llama.py's, bit for bit; for bf16 activations ops.rms_norm takes a float32 weight as
Gemma's norm (the product in float32, rounded once), which is what HF computes.

On the CPU the layers run in one C call per step where every op has its kernel (layer_runner.py:
the two extra norms, each layer's RoPE tables, GeGLU's kernel, each layer's window and soft-cap),
bit for bit this file's loop.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedrun.models import ops, packed_gemm
from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import (
    DirectCall,
    GateUpLinear,
    Linear,
    LlamaAttention,
    LlamaForCausalLM,
    VocabEmbedding,
)
from pagedrun.models.rope import RotaryEmbedding


class GemmaRMSNorm(DirectCall, nn.Module):
    """RMSNorm whose weight holds 1 + w in float32 (load_weights folds it): ops.rms_norm then
    computes HF's Gemma norm in any model dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: h = x + residual, then (norm(h), h)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class GeGLULinear(GateUpLinear):
    """gate_proj and up_proj in one Linear whose forward is gelu_tanh(gate) * up (packed as
    GateUpLinear's: the GEMM writes gate and up a panel at a time, and the activation reads them
    so, with no copy between)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() >= 3:
            return packed_gemm.gate_up_gelu(x, self.weight, self.bias, self.out_features // 2)
        return ops.gelu_tanh_and_mul(F.linear(x, self.weight, self.bias))


class GemmaAttention(LlamaAttention):
    """Llama's attention (its forward) with Gemma's scale, soft-cap, q/k norms and RoPE choice."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super(LlamaAttention, self).__init__()  # nn.Module's: the fields are all set here
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.window = config.window_of(layer)  # 0: full attention
        self.softcap = config.attn_logit_softcapping  # Gemma 2's; 0: off
        self.sinks = None  # (GPT-OSS's; Gemma has none)
        # Gemma 3 picks the RoPE by the layer's type, even where its window covers the whole run.
        self.local_rope = bool(config.layer_types) and config.layer_types[layer] == "sliding_attention"
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias, dtype=dtype)
        self.qk_norm = config.qk_norm  # Gemma 3
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaMLP(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = GeGLULinear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # gelu_tanh(gate) * up: GeGLULinear


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, h, residual, rotary, kv_cache, meta, backend):
        """(h, residual) -> (h', residual'), as LlamaDecoderLayer: the block's input is h + residual
        (just h in the first layer); h' (the normed MLP output) joins residual' in the next norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, x, rotary, kv_cache, meta, backend))
        x, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3: LlamaForCausalLM's loading, packing and LM head, Gemma's layers."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM's: that builds Llama layers
        self.config = config
        self.dtype = dtype
        with torch.device(device):
            self.model = GemmaModel(config, dtype)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            )
        self.rotary_emb = RotaryEmbedding(config).to(device)  # the full-attention layers'
        self.local_rotary_emb = self.rotary_emb
        if config.local_rope_theta is not None:  # Gemma 3's sliding layers: their own RoPE parameters
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta,
                                        rope_scaling=config.local_rope_scaling)
            self.local_rotary_emb = RotaryEmbedding(local).to(device)
        # HF multiplies by sqrt(hidden) rounded to the model's dtype (a bf16 model scales by 25.25,
        # not 25.298, for hidden 640).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device),
                             persistent=False)
        self.layer_runner = None  # set once the weights are packed (LlamaForCausalLM's processing)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.normalizer

    def rotaries(self) -> tuple[RotaryEmbedding, ...]:
        return (self.rotary_emb, self.local_rotary_emb)

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        """The RoPE of a layer: Gemma 3's sliding layers have their own (the layer runner asks too)."""
        return self.local_rotary_emb if self.model.layers[layer].self_attn.local_rope else self.rotary_emb

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head's logits, soft-capped where the model says so (Gemma 2): HF's three ops,
        in the model's dtype."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LlamaForCausalLM's, with every norm weight w stored as 1 + w in float32, w first rounded
        to the model's dtype (HF loads it so, then computes 1.0 + w.float())."""
        dtype = self.dtype

        def folded():
            for name, tensor in weights:
                if name.endswith("norm.weight"):
                    tensor = 1.0 + tensor.to(dtype).float()
                yield name, tensor

        super().load_weights(folded())
