"""RoPE types (pagedrun/models/rope.py) against transformers' own rotary embeddings.

For each type the cos/sin tables (the attention factor folded in) must equal what the HF model's
rotary embedding returns for the same config.json, in float32; partial rotary rotates the first
rotary_dim dims of each head as HF's Phi-3 apply_rotary_pos_emb does, with the C++ kernel and in
torch; every bad field is a one-line error naming config.json and the field. Greedy parity of whole
tiny models with yarn, dynamic and LongRoPE is in test_phi3_granite.py and below.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hf_oracle import hf_greedy_cached, random_prompts
from test_models import paged_greedy

from pagedrun.errors import PagedrunError
from pagedrun.models import ops
from pagedrun.models.config import ModelConfig
from pagedrun.models.loader import load_model
from pagedrun.models.rope import rope_tables

HEAD_DIM = 32
_BASE = dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=512, rms_norm_eps=1e-5)


def _hf_cos_sin(arch: str, cfg: dict, positions: list[int]):
    import transformers

    if arch == "Phi3ForCausalLM":
        config = transformers.Phi3Config(**cfg)
        rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    else:
        config = transformers.LlamaConfig(**cfg)
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 4, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0], sin[0], config


def _ours(arch: str, hf_config, max_model_len: int | None = None):
    d = hf_config.to_dict()
    d["architectures"] = [arch]
    return ModelConfig.from_hf_dict(d, "config.json", max_model_len=max_model_len)


CASES = {
    "default": ("LlamaForCausalLM", dict(rope_theta=10000.0)),
    "linear": ("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "dynamic": ("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="dynamic", factor=3.0))),
    "llama3": ("LlamaForCausalLM", dict(rope_theta=5e5, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "yarn": ("LlamaForCausalLM", dict(rope_theta=1e6, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=128))),
    "yarn_no_truncate_beta": ("LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=64, truncate=False, beta_fast=16,
        beta_slow=2))),
    "yarn_mscale": ("LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707))),
    "yarn_attention_factor": ("LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=256, attention_factor=1.3))),
    "yarn_no_factor": ("LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="yarn", factor=None, original_max_position_embeddings=128))),
    # Phi-3 keeps original_max_position_embeddings at the top level (it wins in HF).
    "longrope": ("Phi3ForCausalLM", dict(original_max_position_embeddings=64, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        long_factor=[2.0 + 0.3 * i for i in range(HEAD_DIM // 2)]))),
    "longrope_attention_factor": ("Phi3ForCausalLM", dict(original_max_position_embeddings=64, rope_scaling=dict(
        rope_type="longrope", attention_factor=1.25, short_factor=[1.0] * (HEAD_DIM // 2),
        long_factor=[4.0] * (HEAD_DIM // 2)))),
    "longrope_partial": ("Phi3ForCausalLM", dict(original_max_position_embeddings=64, partial_rotary_factor=0.75,
                                                 rope_scaling=dict(rope_type="longrope",
                                                                   short_factor=[1.5] * 12,
                                                                   long_factor=[3.0 + i for i in range(12)]))),
    "phi3_partial_default": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_equal_hfs(case):
    arch, extra = CASES[case]
    short = list(range(0, 64))  # within every original length above: LongRoPE's short factors in HF
    cos, sin, hf_config = _hf_cos_sin(arch, {**_BASE, **extra}, short)
    config = _ours(arch, hf_config, max_model_len=64)
    ours_cos, ours_sin = rope_tables(config)
    rot = config.rotary_dim
    assert ours_cos.shape == (512, rot // 2) and cos.shape[-1] == rot
    # The same float32 ops in the same order: equal bits (measured), so compared exactly.
    torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1)[short], cos, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1)[short], sin, atol=0, rtol=0)
    if config.rope_scaling and config.rope_scaling["rope_type"] == "longrope":
        # A run longer than the original length: the long factors, as HF's past that length.
        long = list(range(0, 300))
        cos, sin, _ = _hf_cos_sin(arch, {**_BASE, **extra}, long)
        ours_cos, ours_sin = rope_tables(_ours(arch, hf_config, max_model_len=300))
        torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1)[long], cos, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1)[long], sin, atol=0, rtol=0)


def test_attention_factors_and_choices():
    _, extra = CASES["yarn"]
    c = _ours("LlamaForCausalLM", _hf_cos_sin("LlamaForCausalLM", {**_BASE, **extra}, [0])[2])
    assert c.rope_scaling["attention_factor"] == pytest.approx(0.1 * __import__("math").log(4.0) + 1.0)
    _, extra = CASES["longrope"]
    hf = _hf_cos_sin("Phi3ForCausalLM", {**_BASE, **extra}, [0])[2]
    assert _ours("Phi3ForCausalLM", hf, 64).rope_scaling["long"] is False
    assert _ours("Phi3ForCausalLM", hf, 65).rope_scaling["long"] is True
    assert _ours("Phi3ForCausalLM", hf).rope_scaling["long"] is True  # default run: min(512, 8192) > 64
    # vLLM's per-set mscale where the config has them (HF ignores them)
    d = {**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    d["rope_parameters"] = {**d["rope_parameters"], "short_mscale": 1.1, "long_mscale": 1.7}
    assert ModelConfig.from_hf_dict(d, "config.json", 64).rope_scaling["attention_factor"] == 1.1
    assert ModelConfig.from_hf_dict(d, "config.json", 512).rope_scaling["attention_factor"] == 1.7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False])
def test_partial_rotary_matches_hf_apply(dtype, kernels):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    arch, extra = CASES["longrope_partial"]
    positions = [3, 0, 63, 17, 5]
    cos, sin, hf_config = _hf_cos_sin(arch, {**_BASE, **extra}, positions)
    config = _ours(arch, hf_config, 64)
    assert config.rotary_dim == 24 and config.head_dim == HEAD_DIM
    tab_cos, tab_sin = rope_tables(config)
    torch.manual_seed(0)
    qkv = torch.randn(len(positions), (4 + 2 * 2) * HEAD_DIM).to(dtype)
    q = qkv[:, :4 * HEAD_DIM].view(-1, 4, HEAD_DIM)
    k = qkv[:, 4 * HEAD_DIM:6 * HEAD_DIM].view(-1, 2, HEAD_DIM)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None].to(dtype),
                                          sin[None].to(dtype))
    with contextlib.nullcontext() if kernels else ops.torch_only():
        got_q, got_k = ops.rope(torch.tensor(positions), q.clone(), k.clone(), tab_cos, tab_sin)
    # float32: the same float ops; bf16: HF rounds each product, the kernel too
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=atol, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=atol, rtol=0)
    assert torch.equal(got_q[..., 24:], q[..., 24:])  # the rest passes through
    if kernels and ops.load() is not None:  # the kernel rounds as torch does: the torch path's bits
        with ops.torch_only():
            torch_q, torch_k = ops.rope(torch.tensor(positions), q.clone(), k.clone(), tab_cos, tab_sin)
        assert torch.equal(got_q, torch_q) and torch.equal(got_k, torch_k)


def _cfg(**over):
    d = {"architectures": ["LlamaForCausalLM"], **_BASE, **over}
    return d


@pytest.mark.parametrize("over,field", [
    (dict(rope_scaling={"rope_type": "ntk"}), "rope_scaling: rope type 'ntk' is not supported"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling: linear: factor: missing"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": "2"}), "rope_scaling: dynamic: factor: expected a number"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": -2.0}), "rope_scaling: dynamic: factor: expected a positive"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "rope_scaling: llama3: high_freq_factor: missing"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "x"}),
     "rope_scaling: yarn: original_max_position_embeddings: expected a positive integer"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=0),
     "original_max_position_embeddings: expected a positive integer"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": "no"}),
     "rope_scaling: yarn: truncate: expected true or false"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": [1]}),
     "rope_scaling: yarn: beta_fast: expected a number"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}),
     "rope_scaling: yarn: attention_factor: expected a positive"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": "1"}),
     "rope_scaling: yarn: mscale: expected a number"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16}),
     "rope_scaling: longrope: long_factor: expected a list of 16"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 15, "long_factor": [1.0] * 16}),
     "rope_scaling: longrope: short_factor: expected a list of 16"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [0.0] * 16}),
     "rope_scaling: longrope: long_factor: expected a list of 16"),
    (dict(partial_rotary_factor=1.5), "config.json: partial_rotary_factor: expected a number in (0, 1]"),
    (dict(partial_rotary_factor=0.3), "partial_rotary_factor: expected a number in (0, 1] that leaves an even"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": "x"}),
     "config.json: rope_parameters: partial_rotary_factor: expected a number"),
    (dict(rope_theta=-1.0), "config.json: rope_theta: expected a positive number"),
])
def test_bad_rope_fields_are_one_line_errors(over, field):
    with pytest.raises(PagedrunError) as e:
        ModelConfig.from_hf_dict(_cfg(**over), "config.json")
    msg = str(e.value)
    assert field in msg and "\n" not in msg and msg.startswith("config.json: "), msg


def test_rotary_dim_defaults_and_reads():
    assert ModelConfig.from_hf_dict(_cfg(), "config.json").rotary_dim == HEAD_DIM
    assert ModelConfig.from_hf_dict(_cfg(partial_rotary_factor=0.5), "config.json").rotary_dim == 16
    # the RoPE parameters' own factor wins, as in transformers' standardize_rope_params
    c = ModelConfig.from_hf_dict(_cfg(partial_rotary_factor=0.5, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}), "config.json")
    assert c.rotary_dim == 8


# ---------------------------------------------------------------- whole tiny models against HF

# Llama-family tiny models with the sequence-length-dependent types: yarn (attention factor 1.14,
# a ramp inside head_dim 16), dynamic NTK (plain base at every length pagedrun runs, as HF).
ROPE_FAMILIES = {
    "llama_yarn": dict(rope_theta=1e4, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=32)),
    "llama_yarn_mscale": dict(rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=32,
                                                mscale=0.9, mscale_all_dim=0.6, truncate=False)),
    "llama_dynamic": dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(ROPE_FAMILIES))
@pytest.mark.parametrize("block_size,model_ops", [(16, "cpu-kernels"), (8, "torch")])
def test_tiny_llama_rope_types_greedy_matches_hf(tiny_model, family, block_size, model_ops):
    model_dir = tiny_model("llama", seed=3, **ROPE_FAMILIES[family])
    with contextlib.nullcontext() if model_ops == "cpu-kernels" else ops.torch_only():
        model, config = load_model(model_dir, torch.float32)
        assert config.rope_scaling["rope_type"] in ("yarn", "dynamic")
        prompts = random_prompts(config.vocab_size, [40, 5, 1, 23], seed=7)
        got, got_logits = paged_greedy(model, config, prompts, 8, block_size, shuffle=True)
    want, want_logits = hf_greedy_cached(model_dir, prompts, 8)
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
