"""Phi-3 / Phi-4 (Phi3ForCausalLM) and Granite (GraniteForCausalLM) against transformers.

Tiny random models (tests/tiny_models.py DENSE_FAMILIES): Phi-3 with fused q/k/v and gate/up on
disk, LongRoPE, partial rotary 0.75 and a window of 8 on every layer; Granite with every multiplier
away from 1. Greedy tokens equal HF generate's in float32, token for token, through the model's
paged cache (block 16 and 8) and through the engine with a cache small enough to preempt, with
n = 2. LongRoPE both ways: a run of max_model_len 32 (= original_max_position_embeddings: the short
factors, as HF's for every sequence of at most 32 tokens) and a run of 512 (the long factors), whose
prompts are all longer than 32 tokens, so that HF, which switches per sequence length, uses the long
factors for every forward too.

Real weights: SmolLM2 (the default model) repackaged as Phi-3 (fused tensors) and as Granite
(identity multipliers, attention_multiplier = head_dim ** -0.5) gives SmolLM2's own greedy tokens
(docs/shared MODEL-FAMILIES §1.5); skipped where the default model is not installed.
"""
from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from hf_oracle import hf_greedy_cached, random_prompts
from test_models import paged_greedy
from tiny_models import DENSE_FAMILIES

from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.models import ops
from pagedrun.models.granite import GraniteForCausalLM
from pagedrun.models.loader import load_model
from pagedrun.models.phi3 import Phi3ForCausalLM
from pagedrun.sampling_params import SamplingParams

MAX_NEW = 8
# (family, max_model_len, prompt lengths): Phi-3's short-factor run stays within 32 tokens, its
# long-factor run has every prompt past 32; Granite's prompts cross block edges.
CASES = {
    "phi3_short": ("phi3", 32, [11, 5, 1, 17, 23]),
    "phi3_long": ("phi3", None, [40, 33, 57]),
    "granite": ("granite", None, [11, 5, 1, 17, 29]),
}


@pytest.fixture(scope="module")
def dense_dirs(tiny_model):
    return {f: tiny_model(f, seed=30 + i) for i, f in enumerate(DENSE_FAMILIES)}


def _prompts(case):
    return random_prompts(640, CASES[case][2], seed=len(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size,model_ops", [(16, "cpu-kernels"), (8, "cpu-kernels"), (8, "torch")])
def test_greedy_matches_hf(dense_dirs, case, block_size, model_ops):
    family, max_model_len, _ = CASES[case]
    model_dir = dense_dirs[family]
    prompts = _prompts(case)
    with contextlib.nullcontext() if model_ops == "cpu-kernels" else ops.torch_only():
        model, config = load_model(model_dir, torch.float32, max_model_len=max_model_len)
        if family == "phi3":
            assert config.rope_scaling["long"] is (max_model_len is None)
            assert config.rotary_dim == 12 and config.layer_windows == (8, 8, 8)
        got, got_logits = paged_greedy(model, config, prompts, MAX_NEW, block_size, shuffle=True)
    want, want_logits = hf_greedy_cached(model_dir, prompts, MAX_NEW)
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size,num_blocks", [(16, 64), (8, 12)])
def test_engine_greedy_matches_hf_with_preemption_and_n2(dense_dirs, case, block_size, num_blocks):
    """Through LLM.generate with n = 2 (both samples greedy); 12 blocks of 8 cannot hold every
    sequence at once: the scheduler preempts, and the tokens stay HF's."""
    family, max_model_len, _ = CASES[case]
    prompts = _prompts(case)
    sets = [f"model.path={dense_dirs[family]}", "model.dtype=float32", f"cache.block_size={block_size}",
            f"cache.num_blocks={num_blocks}", "cache.hybrid_kv=false", "cache.enable_prefix_caching=false"]
    if max_model_len:
        sets.append(f"model.max_model_len={max_model_len}")
    llm = LLM(None, sets)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=2, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    want = hf_greedy_cached(dense_dirs[family], prompts, MAX_NEW)[0]
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
    preempted = sum(s.preempted_recompute + s.preempted_swap for s in llm.engine.steps)
    assert (preempted > 0) == (num_blocks == 12), preempted


def test_models_and_their_fields(dense_dirs):
    phi, cfg = load_model(dense_dirs["phi3"], torch.float32, max_model_len=64)
    assert isinstance(phi, Phi3ForCausalLM) and cfg.architecture == "Phi3ForCausalLM"
    assert cfg.rotary_dim == 12 and cfg.head_dim == 16 and cfg.layer_windows == (8, 8, 8)
    assert not cfg.attention_bias and phi.rotary_emb.cos.shape == (512, 6)
    assert phi.layer_runner is None  # partial rotary: the Python loop runs
    assert cfg.rope_scaling["long"] and cfg.rope_scaling["attention_factor"] == pytest.approx(
        (1 + torch.log(torch.tensor(16.0)).item() / torch.log(torch.tensor(32.0)).item()) ** 0.5)
    granite, g = load_model(dense_dirs["granite"], torch.float32)
    assert isinstance(granite, GraniteForCausalLM)
    assert (g.embedding_multiplier, g.attention_multiplier, g.residual_multiplier, g.logits_scaling) == (
        6.0, 0.15, 0.3, 2.5)
    assert granite.model.layers[0].self_attn.scale == 0.15
    assert granite.layer_runner is None  # residual multiplier: the Python loop runs
    for d in dense_dirs.values():
        from safetensors.torch import load_file

        config = load_model(d, torch.float32)[1]
        assert config.num_parameters() == sum(t.numel() for t in load_file(d / "model.safetensors").values())


def test_bf16_stays_close_to_hf(dense_dirs):
    """bf16 (partial rotary through the bf16 kernel, Granite's multipliers on bf16 tensors): the
    first greedy token of each prompt agrees with HF's in bf16, the logits within its rounding."""
    from transformers import AutoModelForCausalLM

    for family in DENSE_FAMILIES:
        model, config = load_model(dense_dirs[family], torch.bfloat16, max_model_len=32)
        prompts = random_prompts(config.vocab_size, [9, 3], seed=2)
        _, got = paged_greedy(model, config, prompts, 1, 16, shuffle=False)
        hf = AutoModelForCausalLM.from_pretrained(dense_dirs[family], dtype=torch.bfloat16)
        for p, g in zip(prompts, got, strict=True):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert g[0].dtype == torch.bfloat16 and int(g[0].argmax()) == int(want.argmax())
            torch.testing.assert_close(g[0].float(), want.float(), atol=0.1, rtol=0.05)


def test_fused_shapes_are_checked_before_allocation(dense_dirs, tmp_path):
    d = tmp_path / "phi3"
    shutil.copytree(dense_dirs["phi3"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # qkv_proj then has 16 * (4 + 8) rows; the checkpoint has 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedrunError, match=r"model.layers.0.self_attn.qkv_proj.weight: shape mismatch: model "
                                            r"expects \[192, 64\].*checkpoint has \[128, 64\]"):
        load_model(d, torch.float32)


@pytest.mark.parametrize("over,field", [
    ({"embedding_multiplier": "6"}, "embedding_multiplier: expected a number"),
    ({"logits_scaling": 0}, "logits_scaling: expected a finite number other than 0"),
    ({"residual_multiplier": None}, "residual_multiplier: expected a number"),
])
def test_granite_config_errors(dense_dirs, over, field):
    from pagedrun.models.config import ModelConfig

    cfg = {**json.loads((dense_dirs["granite"] / "config.json").read_text()), **over}
    with pytest.raises(PagedrunError) as e:
        ModelConfig.from_hf_dict(cfg, "config.json")
    assert str(e.value).startswith("config.json: " + field) and "\n" not in str(e.value), str(e.value)


def test_unsupported_architecture_is_one_line(dense_dirs):
    from pagedrun.models.config import ModelConfig

    cfg = {**json.loads((dense_dirs["phi3"] / "config.json").read_text()), "architectures": ["PhiMoEForCausalLM"]}
    with pytest.raises(PagedrunError, match="^config.json: architectures: 'PhiMoEForCausalLM' is not supported"):
        ModelConfig.from_hf_dict(cfg, "config.json")


# ---------------------------------------------------------------- SmolLM2's weights under other names


def _derive(src, dst, arch: str, model_type: str, extra: dict, fuse: bool):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=[arch], model_type=model_type, **extra)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    if fuse:
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [tensors.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [tensors.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.slow
def test_smollm2_as_phi3_and_granite_gives_smollm2_tokens(default_model, tmp_path):
    cfg = json.loads((default_model / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    derived = {
        "phi3": _derive(default_model, tmp_path / "phi3", "Phi3ForCausalLM", "phi3",
                        dict(original_max_position_embeddings=cfg["max_position_embeddings"], sliding_window=None,
                             partial_rotary_factor=1.0), fuse=True),
        "granite": _derive(default_model, tmp_path / "granite", "GraniteForCausalLM", "granite",
                           dict(embedding_multiplier=1.0, attention_multiplier=hd**-0.5, residual_multiplier=1.0,
                                logits_scaling=1.0), fuse=False),
    }
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 30, 2114, 253, 1142, 3209, 563]]

    def greedy(d):
        model, config = load_model(d, torch.float32, max_model_len=64)
        return paged_greedy(model, config, prompts, 16, 16, shuffle=False)[0], model

    want, _ = greedy(default_model)
    for name, d in derived.items():
        got, model = greedy(d)
        assert got == want, name
        assert model.layer_runner is not None  # identity multipliers, full rotary: the one-call runner


# ---------------------------------------------------------------- the CPU layer runner


@pytest.mark.parametrize("family,overrides", [
    # full rotary and LongRoPE's attention factor in the tables; Granite's scale and embedding and
    # logit multipliers with a residual multiplier of 1
    ("phi3", dict(partial_rotary_factor=1.0, rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8,
                                                               long_factor=[1.0 + i for i in range(8)]))),
    ("granite", dict(residual_multiplier=1.0)),
])
def test_layer_runner_gives_the_loops_logits(tmp_path, family, overrides):
    from test_layer_runner import BLOCK, STEPS, _Counting
    from tiny_models import make_tiny_model

    from pagedrun.models import layer_runner
    from pagedrun.worker.model_runner import ModelInput

    if layer_runner.load() is None or ops.load() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    path = make_tiny_model(family, tmp_path / family, seed=3, **overrides)
    eng = LLM(None, [f"model.path={path}", "model.dtype=float32", "model.threads=2", f"cache.block_size={BLOCK}",
                     "cache.num_blocks=32"]).engine
    runner = eng.worker.model.layer_runner
    assert runner is not None
    counter = _Counting(runner.lib)
    runner.lib = type("Lib", (), {"run": staticmethod(counter)})()
    for n, step in enumerate(STEPS, 1):
        inputs = [ModelInput(ids, start, [table], sample=True) for ids, start, table in step]
        fast = eng.worker.runner.execute(inputs)
        assert counter.calls == n
        eng.worker.model.layer_runner = None
        try:
            slow = eng.worker.runner.execute(inputs)
        finally:
            eng.worker.model.layer_runner = runner
        assert torch.equal(fast, slow)


def test_real_configs_parse():
    """The fields of real configs (their sizes, synthetic factor values): Phi-4-mini (partial 0.75,
    LongRoPE with a top-level original length, a window longer than any run), Phi-3-mini-4k (plain
    RoPE, window 2047), Granite 3.x 2B (its multipliers)."""
    import math

    from pagedrun.models.config import ModelConfig

    base = dict(hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    phi4_mini = dict(base, architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                     max_position_embeddings=131072, original_max_position_embeddings=4096, num_attention_heads=24,
                     num_hidden_layers=32, num_key_value_heads=8, partial_rotary_factor=0.75,
                     sliding_window=262144, tie_word_embeddings=True, vocab_size=200064,
                     rope_scaling={"type": "longrope", "long_factor": [1.0 + i / 4 for i in range(48)],
                                   "short_factor": [1.0] * 48})
    c = ModelConfig.from_hf_dict(phi4_mini, "config.json")  # the default run: max_model_len 8192
    assert (c.head_dim, c.rotary_dim, c.layer_windows, c.tie_word_embeddings) == (128, 96, (), True)
    assert c.rope_scaling["long"] and c.rope_scaling["ext_factors"][1] == 1.25
    assert c.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(32) / math.log(4096))
    assert not ModelConfig.from_hf_dict(phi4_mini, "config.json", max_model_len=4096).rope_scaling["long"]
    phi3_4k = dict(base, architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                   max_position_embeddings=4096, original_max_position_embeddings=4096, num_attention_heads=32,
                   num_hidden_layers=32, num_key_value_heads=32, sliding_window=2047, rope_scaling=None,
                   vocab_size=32064, tie_word_embeddings=False)
    c = ModelConfig.from_hf_dict(phi3_4k, "config.json")
    assert (c.head_dim, c.rotary_dim, c.rope_scaling, c.layer_windows) == (96, 96, None, (2047,) * 32)
    granite = dict(base, architectures=["GraniteForCausalLM"], hidden_size=2048, intermediate_size=8192,
                   max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8,
                   vocab_size=49155, tie_word_embeddings=True, embedding_multiplier=12.0,
                   attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)
    c = ModelConfig.from_hf_dict(granite, "config.json")
    assert (c.embedding_multiplier, c.attention_multiplier, c.residual_multiplier, c.logits_scaling) == (
        12.0, 0.015625, 0.22, 8.0)
    assert c.layer_windows == () and c.rotary_dim == 64
