"""GPT-OSS against transformers: sinks, alternating windows, YaRN, biased clamped-SwiGLU experts.

The tiny model (tests/tiny_models.py "gpt_oss") has window 8 on every other layer and prompts up to
30 tokens, so windows slide; its sinks are large enough to move the attention and its SwiGLU limit
small enough to clamp. Greedy tokens must equal HF's in float32 through the engine (block 16 with
room, block 8 with preemption, n = 2); the expert weights load alike from the bf16 layout and from
MXFP4 blocks (quantized here from the same weights, then compared with HF loading those values).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_oracle import hf_greedy_cached, random_prompts

from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.models.loader import load_model, read_config
from pagedrun.sampling_params import SamplingParams

LENGTHS = [17, 4, 1, 30]
MAX_NEW = 8


@pytest.fixture(scope="module")
def gpt_oss_dir(tiny_model):
    return tiny_model("gpt_oss", seed=3)


def _generate(model_dir, prompts, *sets, n=1):
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=float32", *sets])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=n, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.engine


def test_config(gpt_oss_dir):
    cfg = read_config(gpt_oss_dir)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.layer_windows == (8, 0, 8, 0)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    moe = cfg.moe
    assert (moe.scoring, moe.router_bias, moe.expert_bias, moe.activation) == ("topk_softmax", True, True, "swigluoai")
    assert moe.swiglu_limit == 0.3 and moe.swiglu_alpha == 1.702
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("cache", ["roomy", "preempting"])
def test_engine_greedy_matches_hf(gpt_oss_dir, cache):
    prompts = random_prompts(640, LENGTHS, seed=11)
    if cache == "roomy":
        sets = ["cache.block_size=16", "cache.num_blocks=64"]
    else:
        sets = ["cache.block_size=8", f"cache.num_blocks={-(-(max(LENGTHS) + MAX_NEW) // 8) + 3}",
                "cache.enable_prefix_caching=false", "cache.hybrid_kv=false"]
    got, engine = _generate(gpt_oss_dir, prompts, *sets, n=2)
    want = hf_greedy_cached(gpt_oss_dir, prompts, MAX_NEW)[0]
    assert got == [[w, w] for w in want]
    if cache == "preempting":
        assert sum(s.preempted_recompute + s.preempted_swap for s in engine.steps) > 0


def test_sinks_matter(gpt_oss_dir, tmp_path):
    """Zero sinks change the tokens: the test above would catch a path that ignores them."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "nosinks"
    shutil.copytree(gpt_oss_dir, other)
    tensors = load_file(other / "model.safetensors")
    for name in tensors:
        if name.endswith(".sinks"):
            tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(640, LENGTHS, seed=11)
    with_sinks, _ = _generate(gpt_oss_dir, prompts, "cache.num_blocks=64")
    without, _ = _generate(other, prompts, "cache.num_blocks=64")
    assert with_sinks != without


def _mxfp4_checkpoint(src, dst):
    """The tiny checkpoint with its experts quantized to MXFP4 (the values HF and pagedrun then both
    load are the dequantized ones), and the bf16-layout folder holding exactly those values."""
    from safetensors.torch import load_file, save_file

    from pagedrun.models import mxfp4

    tensors = load_file(src / "model.safetensors")
    packed, exact = {}, {}
    lut = torch.tensor(mxfp4.E2M1_VALUES)
    for name, t in tensors.items():
        if not (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")):
            packed[name] = exact[name] = t
            continue
        rows = t.transpose(1, 2).contiguous()  # [E, out, in]
        e, out, inp = rows.shape
        groups = rows.view(e, out, inp // 32, 32)
        scale = torch.clamp(torch.ceil(torch.log2(groups.abs().amax(-1) / 6.0 + 1e-30)), -20, 20)
        nib = (groups / torch.exp2(scale)[..., None])[..., None].sub(lut).abs().argmin(-1).to(torch.uint8)
        packed[name + "_blocks"] = (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()
        packed[name + "_scales"] = (scale + 127).to(torch.uint8)
        exact[name] = mxfp4.dequantize(packed[name + "_blocks"], packed[name + "_scales"], torch.float32)
    for d, ts in ((dst / "mxfp4", packed), (dst / "exact", exact)):
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
        save_file(ts, d / "model.safetensors", metadata={"format": "pt"})
    return dst / "mxfp4", dst / "exact"


def test_mxfp4_checkpoint_loads_as_its_values(gpt_oss_dir, tmp_path):
    packed, exact = _mxfp4_checkpoint(gpt_oss_dir, tmp_path)
    prompts = random_prompts(640, LENGTHS, seed=12)
    got, _ = _generate(packed, prompts, "cache.num_blocks=64")
    assert got == [[w] for w in hf_greedy_cached(exact, prompts, MAX_NEW)[0]]
    a, _ = load_model(packed, torch.float32)
    b, _ = load_model(exact, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_loader_errors(gpt_oss_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(gpt_oss_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PagedrunError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.down_proj_bias"):
        load_model(bad, torch.float32)
    cfg = json.loads((gpt_oss_dir / "config.json").read_text())
    cfg["swiglu_limit"] = -1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedrunError, match=r"config\.json: swiglu_limit: expected a positive number"):
        read_config(bad)


def test_report_gives_active_and_total_parameters(gpt_oss_dir, tmp_path):
    from typer.testing import CliRunner

    from pagedrun.cli.app import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}) + "\n")
    res = CliRunner().invoke(app, ["generate", str(prompts), "-o", str(tmp_path / "o.jsonl"), "--model",
                                   str(gpt_oss_dir), "--dtype", "float32", "--set", "cache.num_blocks=16"])
    assert res.exit_code == 0, res.output
    run = json.loads((tmp_path / "o.jsonl.report.json").read_text())["run"]
    cfg = read_config(gpt_oss_dir)
    assert run["parameters"] == cfg.num_parameters() and run["architecture"] == "GptOssForCausalLM"
    # 2 of 8 experts a token: 6 experts' worth of each layer's w13/w2 and biases are not computed.
    moe = cfg.moe
    idle = cfg.num_hidden_layers * 6 * (3 * cfg.hidden_size * moe.intermediate_size + 2 * moe.intermediate_size
                                        + cfg.hidden_size)
    assert run["active_parameters"] == run["parameters"] - idle
    assert "active" in res.output  # the start-up line says so too


def test_prefix_cache_hits_past_the_window_match_hf(gpt_oss_dir):
    """Requests sharing a 26-token prefix (three windows of 8 and more) run after one another, so the
    later ones hit the prefix cache, in the sliding groups too; tokens still equal HF's."""
    prefix = random_prompts(640, [26], seed=21)[0]
    prompts = [prefix + tail for tail in random_prompts(640, [3, 5, 1], seed=22)]
    llm = LLM(None, [f"model.path={gpt_oss_dir}", "model.dtype=float32", "cache.block_size=8",
                     "cache.num_blocks=64"])
    got = []
    for p in prompts:  # one at a time: each finds the previous one's blocks cached
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                           use_tqdm=False)
        got.append(out[0].outputs[0].token_ids)
    assert sum(s.prefix_hit_tokens for s in llm.engine.steps) >= 2 * 24
    assert got == hf_greedy_cached(gpt_oss_dir, prompts, MAX_NEW)[0]
