"""GPT-OSS (`GptOssForCausalLM`) on llama.py's layers and models/moe.py's experts.

Against the Llama block, GPT-OSS changes:

- attention: biases on q, k, v and o; a learned logit per head, `self_attn.sinks`, that joins each
  softmax's denominator with a zero value vector (the attention backends take it as `sinks`);
  sliding-window (128) and full layers alternating, sliding first (`layer_types`); YaRN RoPE
  (models/rope.py);
- the MLP is a mixture of experts: a router with a bias, top-k on its logits then a softmax over
  the k, experts with biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 * gate)
  (models/moe.py's "swigluoai");
- the norms keep float32 weights (transformers' _keep_in_fp32_modules): the product is taken in
  float32 and rounded once, as ops.rms_norm does for a float32 weight on bf16 rows.

On disk the experts are stacked and transposed: `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up *interleaved* along the last dimension (gate = [..., ::2], up = [..., 1::2]) and its bias
[E, 2I] interleaved the same way; `mlp.experts.down_proj` [E, I, H] and its bias [E, H]. OpenAI's
checkpoints ship them in MXFP4 (`*_blocks`, `*_scales`), dequantized at load (models/mxfp4.py).
The router is `mlp.router` (weight [E, H], bias [E]).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedrun.errors import PagedrunError
from pagedrun.models import mxfp4
from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import LlamaAttention, RMSNorm
from pagedrun.models.moe import FusedMoE
from pagedrun.models.moe_models import MoEForCausalLM

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases on q, k, v and o from the config) with a sink logit per head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__(config, dtype, layer_idx)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads, dtype=torch.float32), requires_grad=False)


class GptOssForCausalLM(MoEForCausalLM):
    """MoEForCausalLM's forward and head; GPT-OSS's attention, float32 norms and expert layout."""

    attention_class = GptOssAttention

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, dtype, device)
        eps, h = config.rms_norm_eps, config.hidden_size
        with torch.device(device):  # (norms are a few KB: replaced, not threaded through the layer)
            for layer in self.model.layers:
                layer.input_layernorm = RMSNorm(h, eps, torch.float32)
                layer.post_attention_layernorm = RMSNorm(h, eps, torch.float32)
            self.model.norm = RMSNorm(h, eps, torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """MoEForCausalLM's, with GPT-OSS's names and layouts turned into its per-expert ones first;
        the experts' biases go straight into each block, every one checked present once."""
        blocks = dict(self.moe_blocks())
        biases: set[tuple[int, str]] = set()

        def block_of(name: str, layer: int) -> FusedMoE:
            block = blocks.get(layer)
            if block is None:
                raise PagedrunError(f"{name}: unexpected tensor (not part of {self.config.architecture})")
            return block

        def converted():
            for name, tensor in mxfp4.pair_and_dequantize(weights, self.dtype):
                m = _EXPERTS.match(name)
                if m is None:
                    yield name.replace(".mlp.router.", ".mlp.gate."), tensor
                    continue
                layer, what = int(m.group(1)), m.group(2)
                block = block_of(name, layer)
                e, h, i = block.num_experts, block.hidden_size, block.intermediate_size
                want = {"gate_up_proj": (e, h, 2 * i), "gate_up_proj_bias": (e, 2 * i), "down_proj": (e, i, h),
                        "down_proj_bias": (e, h)}[what]
                if tuple(tensor.shape) != want:
                    raise PagedrunError(f"{name}: shape mismatch: model expects {list(want)}, checkpoint has "
                                        f"{list(tensor.shape)}")
                prefix = f"model.layers.{layer}.mlp.experts"
                if what == "gate_up_proj":  # [E, H, 2I], gate and up interleaved: per expert [I, H] each
                    for x in range(e):
                        yield f"{prefix}.{x}.gate_proj.weight", tensor[x, :, 0::2].t()
                        yield f"{prefix}.{x}.up_proj.weight", tensor[x, :, 1::2].t()
                elif what == "down_proj":  # [E, I, H]: per expert [H, I]
                    for x in range(e):
                        yield f"{prefix}.{x}.down_proj.weight", tensor[x].t()
                else:
                    if (layer, what) in biases:
                        raise PagedrunError(f"{name}: appears twice in the checkpoint")
                    for x in range(e):
                        if what == "gate_up_proj_bias":
                            block.load_expert(x, "gate_bias", tensor[x, 0::2])
                            block.load_expert(x, "up_bias", tensor[x, 1::2])
                        else:
                            block.load_expert(x, "down_bias", tensor[x])
                    biases.add((layer, what))

        super().load_weights(converted())
        for layer in blocks:
            for what in ("gate_up_proj_bias", "down_proj_bias"):
                if (layer, what) not in biases:
                    raise PagedrunError(f"missing tensors: model.layers.{layer}.mlp.experts.{what}")

    def named_weights(self) -> dict[str, torch.Tensor]:
        """MoEForCausalLM's, less the experts' biases (load_weights puts them in place itself)."""
        return {n: p for n, p in super().named_weights().items() if ".mlp.w13_bias" not in n and ".mlp.w2_bias" not in n}

