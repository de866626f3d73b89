"""Tiny random-initialised HF checkpoints of each supported family, written with transformers itself.

They are the oracle's input: the same directory is loaded by transformers (reference) and by
pagedrun's loader (under test). Small enough that a forward pass takes milliseconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "llama3", "llama_linear", "qwen2", "qwen3", "mistral", "llama_tied")
# Phi-3 (fused q/k/v and gate/up on disk, LongRoPE, partial rotary 0.75, a window of 8) and Granite
# (four multipliers): tests/models/test_phi3_granite.py.
DENSE_FAMILIES = ("phi3", "granite")
# Families with sliding-window layers (windows of 8, so that test prompts run several windows long)
# and their own block (Gemma): tests/models/test_gemma.py.
WINDOW_FAMILIES = ("gemma3", "gemma3_mm", "gemma2", "mistral_swa", "qwen2_swa")
# Mixture-of-experts families (tests/models/test_moe.py): 8 experts, top-2 or top-3.
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_norm", "qwen2_moe", "olmoe", "mixtral")

_BASE: dict[str, Any] = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# family -> (config class name, model class name, overrides)
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=1,  # GQA ratio 4
            rope_theta=500000.0,
            max_position_embeddings=1024,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,  # small so the smoothing band hits head_dim 16
            ),
            eos_token_id=[2, 3],
        ),
    ),
    "llama_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="linear", factor=4.0), attention_bias=True, mlp_bias=True),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, rope_theta=1000000.0),  # head_dim != hidden / heads (16)
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_key_value_heads=4, sliding_window=None),
    ),
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, num_hidden_layers=2),
    ),
    # Gemma 3: 4 layers, the 4th full (sliding_window_pattern 4 in layer_types), linear RoPE scaling
    # on the full layer and the local base on the others; query_pre_attn_scalar != head_dim.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
             tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
             layer_types=["sliding_attention"] * 3 + ["full_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    ),
    # Gemma 2: layers alternate sliding / full; small soft-caps so that both change the logits.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
             final_logit_softcapping=3.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
             eos_token_id=1, max_position_embeddings=512),
    ),
    # Phi-3: head_dim 16, rotary_dim 12 (6 LongRoPE factors), original length 32 (the long factors
    # apply in runs longer than that), one window of 8 on every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(pad_token_id=0, partial_rotary_factor=0.75, sliding_window=8, original_max_position_embeddings=32,
                  rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                    long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0]))),
    # Granite: every multiplier away from 1 (attention_multiplier is not head_dim ** -0.5).
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=6.0, attention_multiplier=0.15, residual_multiplier=0.3,
                     logits_scaling=2.5, rope_theta=1e4)),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Qwen3-MoE: head_dim != hidden / heads, softmax -> top-3 unnormalised.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                       norm_topk_prob=False, rope_theta=1e6)),
    # The same renormalised, with layer 1 dense (mlp_only_layers: intermediate_size).
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1e6)),
    # Qwen2-MoE: q/k/v bias, a shared expert with its sigmoid gate; every other layer sparse.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, num_hidden_layers=4)),
    # OLMoE: q/k norms over the whole projection, clip_qkv small enough to clamp.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64, clip_qkv=0.5,
                   eos_token_id=2, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    # GPT-OSS: sliding (window 8) and full layers alternating, YaRN, biases everywhere, sinks (made
    # large by _perturb so that they change the attention), top-2 of 8 experts with the clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_hidden_layers=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=32, sliding_window=8, swiglu_limit=0.3,
                     rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=128,
                                          rope_theta=150000.0))),
    # Qwen2: the layers from max_window_layers on slide.
    "qwen2_swa": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, rope_theta=1e6)),
}


def make_tiny_model(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny `family` model (config.json + model.safetensors, no tokenizer) to path."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    if family == "gemma3_mm":  # Gemma 3's text model inside Gemma3ForConditionalGeneration
        return _make_gemma3_multimodal(path, seed, **overrides)
    config_cls, model_cls, family_overrides = _FAMILIES[family]
    kwargs = {**_BASE, **family_overrides, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    _perturb(model, config)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _make_gemma3_multimodal(path: Path, seed: int, **overrides: Any) -> Path:
    """A tiny Gemma3ForConditionalGeneration: the gemma3 family's text model beside a 1-layer
    SigLIP vision tower (saved, as transformers saves it, under language_model.model.*)."""
    import torch
    import transformers

    _, _, text = _FAMILIES["gemma3"]
    text_config = transformers.Gemma3TextConfig(**{**_BASE, **text, **overrides})
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text_config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=600, boi_token_index=601, eoi_token_index=602)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    _perturb(model, config.text_config)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _perturb(model, config) -> None:
    import torch

    # HF's init (std 0.02, unit norms) makes nearly flat logits; perturb norms and biases so that
    # every parameter matters and greedy choices are not decided by rounding noise. Gemma's norms
    # scale by 1 + w: w near 0 is a scale near 1.
    offset = 0.0 if config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(offset + 0.2 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # GPT-OSS: logits comparable to the scores', some above them
                p.copy_(1.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    if config.tie_word_embeddings:
        model.tie_weights()


def write_token_prompts(path: Path, n: int, *, id_prefix: str, max_tokens: int, seed: int,
                        vocab_size: int = 640) -> Path:
    """A prompts.jsonl of n prompt_token_ids requests (3..11 random ids each), greedy-ready (ignore_eos)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 12))]
            f.write(json.dumps({"id": f"{id_prefix}{i}", "prompt_token_ids": ids, "max_tokens": max_tokens,
                                "ignore_eos": True}) + "\n")
    return path


WORD_TOKENIZER_SPECIALS = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORD_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def add_word_tokenizer(path: Path, words: list[str], vocab_size: int = 640) -> Path:
    """Give the model at `path` a word-level tokenizer (ids: the specials, `words`, then w<i> up to
    vocab_size) with a ChatML-like chat template: text prompts and chat messages for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [*WORD_TOKENIZER_SPECIALS, "user", "assistant", "system", *words]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(WORD_TOKENIZER_SPECIALS[1:])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.chat_template = WORD_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return Path(path)
