"""config.json checked against the checkpoint's tensor shapes before the model is allocated.

The model is sized by config.json, and a config can claim anything (10^7 layers allocate for minutes
before the first weight is compared). The safetensors headers say what the weights really are, in
microseconds: every size the allocation depends on must be witnessed by a tensor of that shape
(vocabulary and hidden size by the embedding, head and MLP sizes by layer 0, an MoE model's expert
count and size by its first MoE layer's router and expert 0, the layer count by the number of
layers with a q_proj, or Phi-3's qkv_proj), so a wrong config fails here, in one line, with nothing
allocated. load_weights still checks every tensor as it copies it.
"""
from __future__ import annotations

import re
from pathlib import Path

from pagedrun.errors import PagedrunError
from pagedrun.models import mxfp4
from pagedrun.models.config import ModelConfig

_LAYER_Q = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|qkv_proj)\.weight$")
# The tensors whose shapes fix every size the model allocates: they must be in the checkpoint.
_WITNESSES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight")
# Phi-3 stores q/k/v and gate/up fused: o_proj [hidden, q] fixes the heads' width, qkv_proj then the
# kv heads', gate_up_proj the MLP's.
_FUSED_WITNESSES = ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight")
_FUSED = ("Phi3ForCausalLM",)


def _witnesses(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The tensors that must be in the checkpoint, each as its alternative names (one suffices)."""
    if cfg.architecture in _FUSED:
        return [(n,) for n in _FUSED_WITNESSES]
    out = [(n,) for n in _WITNESSES]
    moe = cfg.moe
    if moe is None or not moe.sparse_layers[0]:
        out.append(("model.layers.0.mlp.gate_proj.weight",))
    if cfg.architecture == "GptOssForCausalLM":  # its own names and layout (models/gpt_oss.py)
        prefix = _moe_prefix(cfg, 0)
        out.append((f"{prefix}.router.weight",))
        out.append((f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.gate_up_proj_blocks"))
    elif moe is not None and any(moe.sparse_layers):
        prefix = _moe_prefix(cfg, moe.sparse_layers.index(True))
        gate = "w1" if cfg.architecture == "MixtralForCausalLM" else "gate_proj"
        out.append((f"{prefix}.gate.weight",))
        out.append((f"{prefix}.experts.0.{gate}.weight", f"{prefix}.experts.gate_up_proj"))
    return out


def _moe_prefix(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for the embedding, the head and layer 0 (every layer is the same)."""
    h, v, inter, hd = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    if cfg.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    if cfg.o_proj_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if cfg.mlp_bias:
        layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)})
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: over the whole projected q and k
        layer.update({"self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,)})
    if cfg.is_gemma:
        layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if cfg.architecture in _FUSED:
        for part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            del layer[part]
        layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * inter, h)})
    moe = cfg.moe
    if moe is not None and moe.sparse_layers[0]:
        for k in ("gate_proj", "up_proj", "down_proj"):
            layer.pop(f"mlp.{k}.weight")
    if cfg.attention_sinks:
        layer["self_attn.sinks"] = (cfg.num_attention_heads,)
    out.update({f"model.layers.0.{k}": s for k, s in layer.items()})
    if cfg.architecture == "GptOssForCausalLM":
        prefix, e, i = _moe_prefix(cfg, 0), moe.num_experts, moe.intermediate_size
        g_in, g_out = -(-h // mxfp4.BLOCK), -(-i // mxfp4.BLOCK)  # MXFP4 groups of 32 along the input
        out.update({f"{prefix}.router.weight": (e, h), f"{prefix}.router.bias": (e,),
                    f"{prefix}.experts.gate_up_proj": (e, h, 2 * i), f"{prefix}.experts.gate_up_proj_bias": (e, 2 * i),
                    f"{prefix}.experts.down_proj": (e, i, h), f"{prefix}.experts.down_proj_bias": (e, h),
                    f"{prefix}.experts.gate_up_proj_blocks": (e, 2 * i, g_in, mxfp4.BLOCK // 2),
                    f"{prefix}.experts.gate_up_proj_scales": (e, 2 * i, g_in),
                    f"{prefix}.experts.down_proj_blocks": (e, h, g_out, mxfp4.BLOCK // 2),
                    f"{prefix}.experts.down_proj_scales": (e, h, g_out)})
    elif moe is not None and any(moe.sparse_layers):
        prefix, e, i = _moe_prefix(cfg, moe.sparse_layers.index(True)), moe.num_experts, moe.intermediate_size
        names = ("w1", "w3", "w2") if cfg.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
        out.update({f"{prefix}.gate.weight": (e, h), f"{prefix}.experts.0.{names[0]}.weight": (i, h),
                    f"{prefix}.experts.0.{names[1]}.weight": (i, h), f"{prefix}.experts.0.{names[2]}.weight": (h, i),
                    f"{prefix}.experts.gate_up_proj": (e, 2 * i, h), f"{prefix}.experts.down_proj": (e, h, i)})
        s = moe.shared_expert_intermediate_size
        if s:
            out.update({f"{prefix}.shared_expert.gate_proj.weight": (s, h), f"{prefix}.shared_expert.up_proj.weight": (s, h),
                        f"{prefix}.shared_expert.down_proj.weight": (h, s)})
        if moe.shared_expert_gate:
            out[f"{prefix}.shared_expert_gate.weight"] = (1, h)
    return out


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
            raise PagedrunError(f"{path}: cannot read safetensors: {' '.join(str(e).split())}") from None
    return shapes


def check_config_matches_weights(cfg: ModelConfig, files: list[Path], model_dir: Path) -> None:
    """Raise a one-line PagedrunError if config.json's sizes are not those of the weights."""
    shapes = {}  # by the text model's own names (ModelConfig.text_tensor_name)
    for name, shape in checkpoint_shapes(files).items():
        text_name = cfg.text_tensor_name(name)
        if text_name is not None:
            shapes[text_name] = shape
    missing = [names[0] for names in _witnesses(cfg) if not any(n in shapes for n in names)]
    if missing:
        raise PagedrunError(f"{model_dir}: missing tensors: {', '.join(missing)}")
    for name, want in expected_shapes(cfg).items():
        have = shapes.get(name)
        if have is not None and have != want:
            raise PagedrunError(f"{model_dir}: {name}: shape mismatch: model expects {list(want)} (from "
                                f"config.json), checkpoint has {list(have)}")
    # More layers than the weights hold is what allocates without bound; fewer, or a gap, is reported
    # by load_weights (unexpected or missing tensors) with the model already sized by real numbers.
    layers = sum(1 for n in shapes if _LAYER_Q.match(n))
    if cfg.num_hidden_layers > layers:
        raise PagedrunError(f"{model_dir}: config.json: num_hidden_layers is {cfg.num_hidden_layers}, "
                            f"the checkpoint has {layers} layers")
