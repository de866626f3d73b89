"""config.json checked against the checkpoint's tensor shapes before the model is allocated.

The model is sized by config.json, and a config can claim anything (10^7 layers allocate for minutes
before the first weight is compared). The safetensors headers say what the weights really are, in
microseconds: every size the allocation depends on must be witnessed by a tensor of that shape
(vocabulary and hidden size by the embedding, head and MLP sizes by layer 0, the layer count by the
number of layers with a q_proj, or Phi-3's qkv_proj), so a wrong config fails here, in one line,
with nothing allocated. load_weights still checks every tensor as it copies it.
"""
from __future__ import annotations

import re
from pathlib import Path

from pagedrun.errors import PagedrunError
from pagedrun.models.config import ModelConfig

_LAYER_Q = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|qkv_proj)\.weight$")
# The tensors whose shapes fix every size the model allocates: they must be in the checkpoint.
_WITNESSES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight")
# Phi-3 stores q/k/v and gate/up fused: o_proj [hidden, q] fixes the heads' width, qkv_proj then the
# kv heads', gate_up_proj the MLP's.
_FUSED_WITNESSES = ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight")
_FUSED = ("Phi3ForCausalLM",)


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
    if cfg.is_gemma:
        layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if cfg.architecture in _FUSED:
        for part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            del layer[part]
        layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * inter, h)})
    out.update({f"model.layers.0.{k}": s for k, s in layer.items()})
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
    missing = [n for n in (_FUSED_WITNESSES if cfg.architecture in _FUSED else _WITNESSES) if n not in shapes]
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
