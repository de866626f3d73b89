"""Gemma 2, Gemma 3 (text, and the text model of Gemma3ForConditionalGeneration) and sliding-window
Mistral / Qwen2 against transformers (the oracle), with prompts several windows long (windows of 8).

Greedy tokens must equal HF generate's token for token in float32, through the model with the
paged cache (tests/models/test_models.py's step schedule: chunked prefill, prefill beside decodes)
at block sizes 8, 16 and 32, with the C++ model ops and without, and through the engine (LLM).
Then what Gemma adds to the ops (the float32-weight norm on bf16 rows, GELU-tanh * up) against
the torch expressions HF runs, and config.json parsing: what each family's fields become, and the
one-line errors for bad ones.
"""
from __future__ import annotations

import contextlib
import json

import pytest
import test_models
import torch
import torch.nn.functional as F
from hf_oracle import hf_greedy_cached, random_prompts
from test_models import paged_greedy
from tiny_models import WINDOW_FAMILIES

from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention.torch_backend import TorchAttentionBackend
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.models import ops, packed_gemm
from pagedrun.models.config import ModelConfig
from pagedrun.models.gemma import GemmaForCausalLM
from pagedrun.models.llama import Linear
from pagedrun.models.loader import load_model
from pagedrun.sampling_params import SamplingParams

WINDOW = 8
LENGTHS = [29, 5, 1, 43]  # up to five windows; the first is prefilled in two chunks
MAX_NEW = 10


@pytest.fixture(scope="module")
def window_dirs(tiny_model):
    return {f: tiny_model(f, seed=10 + i) for i, f in enumerate(WINDOW_FAMILIES)}


def _hf(model_dir, prompts):
    return hf_greedy_cached(model_dir, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("family", WINDOW_FAMILIES)
@pytest.mark.parametrize("block_size,model_ops", [(8, "cpu-kernels"), (16, "cpu-kernels"), (32, "cpu-kernels"),
                                                  (16, "torch")])
def test_greedy_matches_hf_past_the_window(window_dirs, family, block_size, model_ops, monkeypatch):
    """model_ops: the C++ model ops and attention kernel (the default on CPU), or torch for both."""
    model_dir = window_dirs[family]
    if model_ops == "torch":
        monkeypatch.setattr(test_models, "TorchAttentionBackend", lambda: TorchAttentionBackend(use_cpu_kernel=False))
    with contextlib.nullcontext() if model_ops == "cpu-kernels" else ops.torch_only():
        model, config = load_model(model_dir, torch.float32)
        assert any(config.layer_windows) and max(config.layer_windows) == WINDOW
        packed = [m.weight.dim() == 3 for m in model.modules() if isinstance(m, Linear)]
        assert all(packed) if model_ops == "cpu-kernels" and ops.load() else not any(packed)
        prompts = random_prompts(config.vocab_size, LENGTHS, seed=len(family))
        got, got_logits = paged_greedy(model, config, prompts, MAX_NEW, block_size, shuffle=True)
    want, want_logits = _hf(model_dir, prompts)
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", WINDOW_FAMILIES)
@pytest.mark.parametrize("block_size", [8, 32])
def test_engine_greedy_matches_hf(window_dirs, family, block_size):
    """Through LLM.generate: the scheduler's batches, the worker's cache and the sampler."""
    model_dir = window_dirs[family]
    prompts = random_prompts(640, LENGTHS, seed=len(family))
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=float32", f"cache.block_size={block_size}",
                     "cache.num_blocks=64"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf(model_dir, prompts)[0]


def test_gemma_models_and_their_fields(window_dirs):
    for family, arch in (("gemma3", "Gemma3ForCausalLM"), ("gemma3_mm", "Gemma3ForConditionalGeneration"),
                         ("gemma2", "Gemma2ForCausalLM")):
        model, config = load_model(window_dirs[family], torch.float32)
        assert isinstance(model, GemmaForCausalLM) and config.architecture == arch
        assert config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 24
        assert model.model.layers[0].self_attn.scale == 24**-0.5
        # 1 + w, in float32: the norms hold what HF multiplies by
        assert all(m.weight.dtype == torch.float32 for n, m in model.named_modules() if n.endswith("norm"))
    g3 = load_model(window_dirs["gemma3"], torch.float32)[1]
    assert g3.layer_windows == (8, 8, 8, 0) and g3.qk_norm and g3.tie_word_embeddings
    assert (g3.rope_theta, g3.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 4.0})
    assert (g3.local_rope_theta, g3.local_rope_scaling) == (1e4, None)
    g2 = load_model(window_dirs["gemma2"], torch.float32)[1]
    assert g2.layer_windows == (8, 0, 8) and not g2.qk_norm  # even layers slide in HF's Gemma 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (2.0, 3.0)
    assert load_model(window_dirs["mistral_swa"], torch.float32)[1].layer_windows == (8, 8, 8)
    assert load_model(window_dirs["qwen2_swa"], torch.float32)[1].layer_windows == (0, 8, 8)


def test_bf16_gemma_stays_close_to_hf(window_dirs):
    """bf16: the norms in float32 as HF's, the rest in bf16; the first greedy token of each prompt
    agrees and the logits stay within bf16's rounding of HF's."""
    from transformers import AutoModelForCausalLM

    for family in ("gemma3", "gemma2"):
        model_dir = window_dirs[family]
        model, config = load_model(model_dir, torch.bfloat16)
        prompts = random_prompts(config.vocab_size, [6, 3], seed=1)
        _, got = paged_greedy(model, config, prompts, 1, 16, shuffle=False)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        for p, g in zip(prompts, got):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert g[0].dtype == torch.bfloat16
            assert int(g[0].argmax()) == int(want.argmax())
            torch.testing.assert_close(g[0].float(), want.float(), atol=0.1, rtol=0.05)


def test_num_parameters_counts_the_text_model(window_dirs):
    from safetensors.torch import load_file

    for family, d in window_dirs.items():
        config = load_model(d, torch.float32)[1]
        names = [n for n in load_file(d / "model.safetensors") if config.text_tensor_name(n) is not None]
        total = sum(load_file(d / "model.safetensors")[n].numel() for n in names)
        assert config.num_parameters() == total, family


# ---------------------------------------------------------------- the ops Gemma adds


def _gemma_norm_hf(x, w, eps):
    """transformers' Gemma3RMSNorm.forward."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_matches_hf(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(5, 640).to(dtype), torch.randn(5, 640).to(dtype)
    w = (0.3 * torch.randn(640)).to(dtype)
    folded = 1.0 + w.float()
    for kernels in (True, False):
        with contextlib.nullcontext() if kernels else ops.torch_only():
            torch.testing.assert_close(ops.rms_norm(x, folded, 1e-6), _gemma_norm_hf(x, w, 1e-6), atol=1e-5,
                                       rtol=0 if dtype == torch.float32 else 8e-3)
            out, h = ops.rms_norm(x, folded, 1e-6, r.clone())
            assert torch.equal(h, x + r)
            torch.testing.assert_close(out, _gemma_norm_hf(x + r, w, 1e-6), atol=1e-5,
                                       rtol=0 if dtype == torch.float32 else 8e-3)
            heads = x.view(5, 20, 32)  # Gemma 3's q_norm / k_norm: per head of 32
            torch.testing.assert_close(ops.rms_norm(heads, folded[:32], 1e-6),
                                       _gemma_norm_hf(heads, w[:32], 1e-6), atol=1e-5,
                                       rtol=0 if dtype == torch.float32 else 8e-3)


@pytest.mark.skipif(ops.load() is None, reason="no C++ compiler for the CPU kernels")
def test_gemma_norm_kernel_rounds_once_in_bf16():
    """The kernel's bf16 output is HF's float32 product rounded once: equal up to the variance's
    summation order, which moves a few elements by one bf16 step."""
    torch.manual_seed(1)
    x, w = torch.randn(64, 640).to(torch.bfloat16), (0.3 * torch.randn(640)).to(torch.bfloat16)
    got, want = ops.rms_norm(x, 1.0 + w.float(), 1e-6), _gemma_norm_hf(x, w, 1e-6)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 16])
def test_gelu_tanh_and_mul_matches_torch(dtype, block):
    torch.manual_seed(2)
    gate, up = (4 * torch.randn(7, 64)).to(dtype), torch.randn(7, 64).to(dtype)
    gate[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-4])
    want = F.gelu(gate, approximate="tanh") * up
    if block is None:
        gate_up = torch.cat([gate, up], dim=-1)
    else:  # gate and up interleaved `block` columns at a time, as the packed GEMM writes them
        gate_up = torch.stack([gate.view(7, -1, block), up.view(7, -1, block)], dim=2).reshape(7, 128)
    for kernels in (True, False):
        with contextlib.nullcontext() if kernels else ops.torch_only():
            got = ops.gelu_tanh_and_mul(gate_up, block)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- config.json


def _cfg(window_dirs, family):
    return json.loads((window_dirs[family] / "config.json").read_text())


def test_older_gemma_configs(window_dirs):
    """transformers 4.x Gemma 3 configs: sliding_window_pattern, rope_theta + rope_scaling for the
    full layers and rope_local_base_freq for the sliding ones; Gemma 2 without layer_types."""
    cfg = _cfg(window_dirs, "gemma3")
    for key in ("layer_types", "rope_parameters"):
        del cfg[key]
    cfg.update(num_hidden_layers=7, sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=2e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    c = ModelConfig.from_hf_dict(cfg, "c")
    assert c.layer_windows == (8, 8, 0, 8, 8, 0, 8)
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (5e5, {"rope_type": "linear", "factor": 8.0}, 2e4)
    del cfg["sliding_window_pattern"], cfg["rope_local_base_freq"], cfg["sliding_window"], cfg["rope_scaling"]
    c = ModelConfig.from_hf_dict(cfg, "c")  # transformers' defaults: pattern 6, window 4096, base 1e4
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert c.layer_windows == () and c.sliding_window == 4096  # 4096 >= max_position_embeddings (512)
    assert (c.local_rope_theta, c.rope_scaling) == (1e4, None)
    g2 = _cfg(window_dirs, "gemma2")
    del g2["layer_types"]
    assert ModelConfig.from_hf_dict({**g2, "num_hidden_layers": 4}, "c").layer_windows == (8, 0, 8, 0)


def test_windows_longer_than_the_run_are_full_attention(window_dirs):
    cfg = _cfg(window_dirs, "mistral_swa")
    assert ModelConfig.from_hf_dict(cfg, "c", max_model_len=8).layer_windows == ()
    assert ModelConfig.from_hf_dict(cfg, "c", max_model_len=9).layer_windows == (8, 8, 8)
    assert ModelConfig.from_hf_dict({**cfg, "sliding_window": None}, "c").layer_windows == ()
    q = _cfg(window_dirs, "qwen2_swa")
    assert ModelConfig.from_hf_dict({**q, "use_sliding_window": False}, "c").layer_windows == ()
    del q["layer_types"]  # older configs: max_window_layers decides
    assert ModelConfig.from_hf_dict({**q, "max_window_layers": 2}, "c").layer_windows == (0, 0, 8)


def test_gemma3_multimodal_reads_its_text_config(window_dirs):
    cfg = _cfg(window_dirs, "gemma3_mm")
    c = ModelConfig.from_hf_dict(cfg, "c")
    assert c.num_hidden_layers == 4 and c.layer_windows == (8, 8, 8, 0) and c.tie_word_embeddings
    assert c.text_tensor_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert c.text_tensor_name("model.language_model.norm.weight") == "model.norm.weight"
    assert c.text_tensor_name("language_model.lm_head.weight") == "lm_head.weight"
    assert c.text_tensor_name("vision_tower.vision_model.post_layernorm.weight") is None
    assert c.text_tensor_name("model.multi_modal_projector.mm_soft_emb_norm.weight") is None


def test_sparse_configs_take_transformers_defaults():
    """Google's gemma-3-4b-it config.json names six text fields; transformers fills in the rest (the
    oracle here is its config object, built from the same dict)."""
    import transformers

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
           "text_config": text, "vision_config": {"hidden_size": 1152}, "torch_dtype": "bfloat16"}
    c = ModelConfig.from_hf_dict(cfg, "c", max_model_len=4096)
    hf = transformers.Gemma3Config(**{k: v for k, v in cfg.items() if k != "architectures"}).text_config
    for field in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "query_pre_attn_scalar", "rms_norm_eps"):
        assert getattr(c, field) == getattr(hf, field), field
    assert c.layer_types == tuple(hf.layer_types) and c.eos_token_id == [1, 106]
    assert c.layer_windows == tuple(1024 if t == "sliding_attention" else 0 for t in hf.layer_types)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (c.rope_theta, c.rope_scaling) == (full["rope_theta"], {"rope_type": "linear", "factor": 8.0})
    assert (c.local_rope_theta, c.local_rope_scaling) == (local["rope_theta"], None)
    g2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 2304, "num_hidden_layers": 4}
    hf2 = transformers.Gemma2Config(hidden_size=2304, num_hidden_layers=4)
    c2 = ModelConfig.from_hf_dict(g2, "c", max_model_len=8192)
    assert (c2.attn_logit_softcapping, c2.final_logit_softcapping) == (hf2.attn_logit_softcapping,
                                                                       hf2.final_logit_softcapping)
    assert (c2.vocab_size, c2.max_position_embeddings, c2.layer_windows) == (hf2.vocab_size, 8192, (4096, 0) * 2)


@pytest.mark.parametrize(
    "family,change,field",
    [
        ("gemma3", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("gemma3", {"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
        ("gemma3", {"sliding_window": 0}, "sliding_window"),
        ("gemma3", {"sliding_window": "8"}, "sliding_window"),
        ("gemma3", {"sliding_window": None}, "sliding_window"),
        ("gemma3", {"query_pre_attn_scalar": -1}, "query_pre_attn_scalar"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "ntk-by-parts", "factor": 2.0},
                                        "sliding_attention": {}}}, "rope_parameters.full_attention"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear"}, "sliding_attention": {}}},
         "rope_parameters.full_attention"),
        ("gemma3", {"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        ("gemma2", {"final_logit_softcapping": 0}, "final_logit_softcapping"),
        ("gemma3_mm", {"text_config": None}, "text_config"),
        ("gemma3_mm", {"text_config": {"num_attention_heads": None}}, "text_config.num_attention_heads"),
        ("qwen2_swa", {"layer_types": None, "max_window_layers": -1}, "max_window_layers"),
        ("mistral_swa", {"sliding_window": 2.5}, "sliding_window"),
    ],
)
def test_config_errors(window_dirs, family, change, field):
    cfg = _cfg(window_dirs, family)
    cfg.update(change)
    with pytest.raises(PagedrunError) as e:
        ModelConfig.from_hf_dict(cfg, "m/config.json")
    assert str(e.value).startswith(f"m/config.json: {field}:"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(ops.load() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_gelu_is_the_gemm_then_the_activation(dtype):
    """linear_packed_gelu (one call, the layer runner's) gives the bits of the packed GEMM followed
    by gelu_tanh_and_mul on its interleaved output, and HF's expression within rounding."""
    torch.manual_seed(3)
    i = 4 * ops.load().panel
    x, weight = torch.randn(5, 64).to(dtype), (0.1 * torch.randn(2 * i, 64)).to(dtype)
    packed, _ = packed_gemm.pack_gate_up(weight, None)
    got = packed_gemm.gate_up_gelu(x, packed, None, i)
    two_calls = ops.gelu_tanh_and_mul(packed_gemm.linear_packed(x, packed, None, 2 * i), block=packed.shape[2])
    assert torch.equal(got, two_calls)
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.gelu(gate, approximate="tanh") * up, atol=tol, rtol=10 * tol)


# ---------------------------------------------------------------- the C++ layer runner

RUNNER_BLOCK = 16
# Three sequences with three blocks each, past the windows of 8: a prefill step (varlen kernel), a
# step mixing a prefill chunk with two decodes, a decode-only step (tests/models/test_layer_runner.py's).
RUNNER_STEPS = [
    [(list(range(3, 8)), 0, [0, 1, 2]), (list(range(10, 27)), 0, [3, 4, 5]), (list(range(40, 73)), 0, [6, 7, 8])],
    [([9], 5, [0, 1, 2]), (list(range(30, 34)), 17, [3, 4, 5]), ([11], 33, [6, 7, 8])],
    [([12], 6, [0, 1, 2]), ([13], 21, [3, 4, 5]), ([14], 34, [6, 7, 8])],
]


@pytest.mark.skipif(ops.load() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in WINDOW_FAMILIES])  # the inner loop keeps one family
def test_layer_runner_gives_the_loops_hidden_states(window_dirs, family, dtype):
    """Gemma's layers (sandwich norms, float32 norm weights, per-layer RoPE, GeGLU, windows,
    soft-caps) and the sliding-window Llama family through the runner: the Python loop's hidden
    states bit for bit on prefill, mixed and decode steps."""
    from pagedrun.models import layer_runner

    model, config = load_model(window_dirs[family], dtype)
    runner = model.layer_runner
    assert runner is not None
    calls = []
    run = runner.lib.run
    runner.lib = type("Lib", (), {"run": staticmethod(lambda *a: calls.append(1) or run(*a))})()
    shape = (9, RUNNER_BLOCK, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                 for _ in range(config.num_hidden_layers)]
    backend = TorchAttentionBackend()
    for n, step in enumerate(RUNNER_STEPS, 1):
        ids = torch.tensor([t for toks, _, _ in step for t in toks])
        positions = torch.tensor([start + j for toks, start, _ in step for j in range(len(toks))])
        meta = AttentionMetadata.build([len(toks) for toks, _, _ in step], [start for _, start, _ in step],
                                       [table for _, _, table in step], RUNNER_BLOCK)
        fast = model(ids, positions, kv_caches, meta, backend)
        assert len(calls) == n and backend.last_path == "cpu_kernel"
        model.layer_runner = None
        try:  # the loop writes the same K/V into the same slots, then attends over them
            slow = model(ids, positions, kv_caches, meta, backend)
        finally:
            model.layer_runner = runner
        assert len(calls) == n and isinstance(runner, layer_runner.LayerRunner)
        assert torch.equal(fast, slow), f"step {n}: max |diff| {(fast.float() - slow.float()).abs().max()}"
