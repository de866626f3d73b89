"""The mixture-of-experts block (pagedrun/models/moe.py) and the MoE families against transformers.

- greedy tokens equal HF generate's in float32, token for token, through the engine (block 16 with
  room; block 8 with so few blocks that requests are preempted), n = 2 greedy children;
- the block alone against HF's block on random rows: routing (ids and weights) equal on the same
  logits, near-ties included, and outputs within float32 rounding, kernel and torch paths;
- batch invariance: a request alone and inside a batch of 32 gives the same tokens;
- the C++ grouped kernel against the torch path on random shapes, experts with no rows included;
- config parsing, parameter counts (total = HF's, active), loader errors, worst-case routing.
No timing assertions: these run on any x86 CPU and under load.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from hf_oracle import hf_greedy_cached, random_prompts
from tiny_models import MOE_FAMILIES

from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.models import moe, ops, packed_gemm
from pagedrun.models.loader import load_model
from pagedrun.models.moe import FusedMoE, route
from pagedrun.models.moe_config import MoEConfig
from pagedrun.sampling_params import SamplingParams

LENGTHS = [17, 4, 1, 30]
MAX_NEW = 8


@pytest.fixture(scope="module")
def moe_dirs(tiny_model):
    return {f: tiny_model(f, seed=20 + i) for i, f in enumerate(MOE_FAMILIES)}


def _generate(model_dir, prompts, *sets, n=1):
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=float32", *sets])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=n, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.engine


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("cache", ["roomy", "preempting"])
def test_engine_greedy_matches_hf(moe_dirs, family, cache):
    """Through LLM.generate (scheduler, paged cache, sampler), two greedy children per request."""
    model_dir = moe_dirs[family]
    prompts = random_prompts(640, LENGTHS, seed=len(family))
    if cache == "roomy":
        sets = ["cache.block_size=16", "cache.num_blocks=64"]
    else:  # the longest request alone fits; the batch does not
        sets = ["cache.block_size=8", f"cache.num_blocks={-(-(max(LENGTHS) + MAX_NEW) // 8) + 3}",
                "cache.enable_prefix_caching=false"]
    got, engine = _generate(model_dir, prompts, *sets, n=2)
    want = hf_greedy_cached(model_dir, prompts, MAX_NEW)[0]
    assert got == [[w, w] for w in want]
    if cache == "preempting":
        assert sum(s.preempted_recompute + s.preempted_swap for s in engine.steps) > 0


def _block_pair(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, config = load_model(model_dir, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    layer = config.moe.sparse_layers.index(True)
    ours = model.model.layers[layer].mlp
    hf_block = hf.model.layers[layer].mlp if hasattr(hf.model.layers[layer], "mlp") else None
    if hf_block is None:
        hf_block = hf.model.layers[layer].block_sparse_moe
    assert isinstance(ours, FusedMoE)
    return ours, hf_block, config


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_block_matches_hf_block(moe_dirs, family):
    """The block alone on random rows: routing equal to HF's router on the same logits, outputs
    within float32 rounding (C++ kernel and torch paths), and bf16 within bf16's."""
    ours, hf_block, config = _block_pair(moe_dirs[family])
    torch.manual_seed(0)
    x = torch.randn(37, config.hidden_size)
    router = hf_block.router if family == "granite_moe" else hf_block.gate
    logits = torch.nn.functional.linear(x, router.weight)
    _, hf_weights, hf_ids = router(x)
    weights, ids = route(logits, config.moe)
    order = hf_ids.sort(dim=1)
    assert torch.equal(ids, order.values)
    assert torch.equal(weights, hf_weights.gather(1, order.indices))
    with torch.no_grad():
        want = hf_block(x[None])[0]
        got = ours(x)
        with ops.torch_only():
            got_torch = ours(x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_torch, want, atol=2e-5, rtol=1e-4)
    ours16, hf16, _ = _block_pair(moe_dirs[family], dtype=torch.bfloat16)
    x16 = x.bfloat16()
    with torch.no_grad():
        want16, got16 = hf16(x16[None])[0].float(), ours16(x16).float()
    assert (got16 - want16).abs().max() <= 0.02 * want16.abs().max() + 1e-3


@pytest.mark.parametrize("norm", [False, True])
def test_routing_near_ties(norm):
    """Exact and near ties in the logits: the same experts and weights as HF's router ops (softmax
    in float32, torch.topk, renormalised or not) on the same logits; each token's slots ascending."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    e, k, h = 8, 3, 16
    cfg = MoEConfig(num_experts=e, top_k=k, intermediate_size=32, sparse_layers=(True,), norm_topk_prob=norm)

    class C:
        num_experts_per_tok, num_experts, norm_topk_prob, hidden_size = k, e, norm, h

    router = Qwen3MoeTopKRouter(C())
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_()
        router.weight[3] = router.weight[5]  # experts 3 and 5 tie on every row
        router.weight[6] = router.weight[2] * (1 + 1e-7)  # 2 and 6 nearly tie
    x = torch.randn(64, h)
    logits = torch.nn.functional.linear(x, router.weight)
    _, hf_w, hf_ids = router(x)
    w, ids = route(logits, cfg)
    order = hf_ids.sort(dim=1)
    assert torch.equal(ids, order.values) and torch.equal(w, hf_w.gather(1, order.indices))
    assert bool((ids[:, 1:] > ids[:, :-1]).all())


def test_topk_softmax_scoring():
    """GraniteMoE / GPT-OSS scoring: top-k of the logits, softmax over the k."""
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=32, sparse_layers=(True,), scoring="topk_softmax")
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 0.5]])
    w, ids = route(logits, cfg)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.5]]), -1))


def _random_block(dtype, e=8, h=64, i=32, top_k=3):
    from pagedrun.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": h, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64,
         "num_experts": e, "num_experts_per_tok": top_k, "moe_intermediate_size": i}, "test")
    block = FusedMoE(cfg, dtype)
    torch.manual_seed(3)
    with torch.no_grad():
        block.w13.normal_(0, 0.1)
        block.w2.normal_(0, 0.1)
        block.gate.weight.normal_()
    return block, cfg


@pytest.mark.parametrize("dtype,dot", [(torch.float32, -1), (torch.bfloat16, 1), (torch.bfloat16, 0)])
def test_grouped_kernel_matches_torch(dtype, dot):
    """packed_gemm.moe_experts against FusedMoE.torch_experts on the same packed weights, with experts
    that get no rows, one row, and most rows; bf16 on vdpbf16ps (dot 1, where the CPU has it) and
    on widened FMAs (dot 0), which give the same bits."""
    kern = ops.load()
    if kern is None:
        pytest.skip(f"no CPU kernels: {ops.load_error()}")
    before_dot, before_amx = kern.lib.packed_gemm_bf16_dot(-1), kern.lib.packed_gemm_amx(-1)
    try:
        if dot >= 0:
            kern.lib.packed_gemm_amx(0)
            if kern.lib.packed_gemm_bf16_dot(dot) != dot:
                pytest.skip("this CPU has no vdpbf16ps")
        _check_grouped_kernel(dtype)
    finally:
        kern.lib.packed_gemm_bf16_dot(before_dot)
        kern.lib.packed_gemm_amx(before_amx)


def _check_grouped_kernel(dtype):
    block, cfg = _random_block(dtype)
    block.process_weights_after_loading()
    assert block.packed
    torch.manual_seed(4)
    before = torch.get_num_threads()
    # 1 token on 2 threads: 3 experts split by panels; the rest: whole experts per thread.
    for t, threads in ((1, 1), (1, 2), (5, 2), (40, 2), (100, 1)):
        torch.set_num_threads(threads)
        x = torch.randn(t, cfg.hidden_size).to(dtype)
        ids = torch.stack([torch.randperm(6)[:3] for _ in range(t)]).sort(dim=1).values  # experts 6, 7: no rows
        ids[0] = torch.tensor([0, 4, 5])
        w = torch.rand(t, 3).to(dtype)
        try:
            got = packed_gemm.moe_experts(x, ids, w, block.w13, None, block.w2, None, cfg.moe.intermediate_size)
        finally:
            torch.set_num_threads(before)
        assert got is not None
        with ops.torch_only():
            want = block.torch_experts(x, w, ids)
        if dtype is torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max() + 1e-2


def test_worst_case_routing_uses_every_expert():
    block, cfg = _random_block(torch.float32)
    x = torch.randn(5, cfg.hidden_size)
    with moe.worst_case_routing():
        _, ids = route(block.gate(x), cfg.moe)
    assert set(ids.flatten().tolist()) == set(range(cfg.moe.num_experts))
    assert all(len(set(row)) == cfg.moe.top_k for row in ids.tolist())


def test_batch_invariance(moe_dirs):
    """A request alone and inside a batch of 32 decodes the same tokens (fp32, the kernels' path)."""
    model_dir = moe_dirs["qwen3_moe"]
    prompts = random_prompts(640, [3 + i % 11 for i in range(32)], seed=5)
    alone, _ = _generate(model_dir, prompts[7:8], "cache.num_blocks=256")
    batch, _ = _generate(model_dir, prompts, "cache.num_blocks=256")
    assert batch[7] == alone[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_and_parameter_counts(moe_dirs, family):
    from transformers import AutoModelForCausalLM

    model, config = load_model(moe_dirs[family], torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[family], dtype=torch.float32)
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())
    m = config.moe
    assert config.active_parameters() < config.num_parameters()
    per_layer = (m.num_experts - m.top_k) * 3 * config.hidden_size * m.intermediate_size
    assert config.num_parameters() - config.active_parameters() == m.num_sparse_layers * per_layer
    if family == "qwen3_moe_norm":
        assert m.sparse_layers == (True, False, True) and m.norm_topk_prob and m.top_k == 2
        assert not isinstance(model.model.layers[1].mlp, FusedMoE)
    if family == "qwen2_moe":
        assert m.sparse_layers == (False, True, False, True) and m.shared_expert_intermediate_size == 48
        assert config.attention_bias and not config.o_proj_bias
    if family == "olmoe":
        assert config.qk_norm_whole and config.clip_qkv == 0.5
    if family == "mixtral":
        assert m.norm_topk_prob and m.weights_in_float32
    assert model.layer_runner is None  # declined: MoE layers run in the Python loop


def test_loader_errors(moe_dirs, tmp_path):
    """A missing or duplicated expert is one line naming it; config.json's expert count must match."""
    from safetensors.torch import load_file, save_file

    src = moe_dirs["qwen3_moe"]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    gone = tensors.pop("model.layers.1.mlp.experts.5.up_proj.weight")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(PagedrunError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.5\.up_proj"):
        load_model(d, torch.float32)
    tensors["model.layers.1.mlp.experts.5.up_proj.weight"] = gone
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 64)  # the stacked layout too
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(PagedrunError, match="appears twice"):
        load_model(d, torch.float32)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts")) * 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedrunError, match=r"mlp\.gate\.weight: shape mismatch"):
        load_model(d, torch.float32)


def test_stacked_expert_layout_loads(moe_dirs, tmp_path):
    """transformers' module layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    loads to the same weights as the per-expert names."""
    from safetensors.torch import load_file, save_file

    src = moe_dirs["qwen3_moe"]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{p}.{e}.gate_proj.weight") for e in range(8)]
        up = [tensors.pop(f"{p}.{e}.up_proj.weight") for e in range(8)]
        down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{p}.down_proj"] = torch.stack(down)
    save_file(tensors, str(d / "model.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        with ops.torch_only():
            a, _ = load_model(src, dtype)
            b, _ = load_model(d, dtype)
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p, q), n
        if ops.load() is None:
            continue
        packed, _ = load_model(d, dtype)  # the experts packed as they load: pack_gate_up's layout
        for (_, plain), (_, block) in zip(a.moe_blocks(), packed.moe_blocks()):
            assert block.packed
            for e in range(block.num_experts):
                assert torch.equal(block.w13[e], packed_gemm.pack_gate_up(plain.w13[e], None)[0])
                assert torch.equal(block.w2[e], packed_gemm.pack_weight(plain.w2[e]))
                assert all(u is v or torch.equal(u, v) for u, v in zip(block.expert_weights(e), plain.expert_weights(e)))


def test_profile_pass_routes_to_every_expert(moe_dirs, monkeypatch):
    """The start-up profile pass runs worst-case routing (every expert active), and its floor counts
    an MoE block's top_k rows per token."""
    from pagedrun.worker.profiler import profile_floor_bytes

    seen = []
    real = FusedMoE.experts

    def spy(self, x, weights, ids):
        seen.append(set(ids.flatten().tolist()))
        return real(self, x, weights, ids)

    monkeypatch.setattr(FusedMoE, "experts", spy)
    llm = LLM(None, [f"model.path={moe_dirs['qwen3_moe']}", "model.dtype=float32"])
    assert seen and all(s == set(range(8)) for s in seen)
    cfg = llm.engine.model_config
    dense = profile_floor_bytes(dataclasses.replace(cfg, moe=None), [64], 16, torch.float32, 1)
    assert profile_floor_bytes(cfg, [64], 16, torch.float32, 1) > dense
    assert cfg.active_parameters() < cfg.num_parameters()


def _pack(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """packed_gemm.pack_weight's layout for another panel width (N a multiple of it)."""
    n, k = weight.shape
    if weight.dtype is torch.bfloat16:
        return weight.view(n // panel, panel, k // 2, 2).transpose(1, 2).contiguous()
    return weight.view(n // panel, panel, k).transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_is_the_dense_kernels_bits(dtype):
    """The grouped kernel gives, bit for bit, the dense kernels run expert by expert on each
    expert's rows and torch's weighted sum, on every vector path of this build and on the 8-wide
    build (PR_GEMM_VEC8: AVX2's panels of 16), 1 and 2 threads."""
    from cpu_libraries import load_or_skip

    from pagedrun.build import cpu as cpu_build

    kern = load_or_skip(ops.load, ops.load_error, "CPU model ops")
    block, cfg = _random_block(dtype)
    block.process_weights_after_loading()
    h, i = cfg.hidden_size, cfg.moe.intermediate_size
    g = torch.Generator().manual_seed(9)
    t = 9
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(t)]).sort(dim=1).values
    w = torch.rand(t, 3, generator=g).to(dtype)
    ys = torch.empty(t, 3, h, dtype=dtype)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        act = packed_gemm.gate_up_silu(x[tok], block.w13[e], None, i)
        ys[tok, slot] = packed_gemm.linear_packed(act, block.w2[e], None, h)
    prod = (ys * w[:, :, None]).to(dtype)
    want = prod[:, 0]
    for j in (1, 2):
        want = want + prod[:, j]
    before_dot, before_amx, threads = kern.lib.packed_gemm_bf16_dot(-1), kern.lib.packed_gemm_amx(-1), \
        torch.get_num_threads()
    try:
        kern.lib.packed_gemm_amx(0)
        for dot in (0, 1) if dtype is torch.bfloat16 else (0,):
            if kern.lib.packed_gemm_bf16_dot(dot) != dot:
                continue
            for n in (1, 2):
                torch.set_num_threads(n)
                got = packed_gemm.moe_experts(x, ids, w, block.w13, None, block.w2, None, i)
                assert torch.equal(got, want), (dot, n, (got.float() - want.float()).abs().max())
    finally:
        kern.lib.packed_gemm_bf16_dot(before_dot)
        kern.lib.packed_gemm_amx(before_amx)
        torch.set_num_threads(threads)
    narrow = ops.CpuModelOps(cpu_build.build(ops.SOURCE, ("-ffp-contract=off", "-DPR_GEMM_VEC8")))
    p = narrow.panel
    w13 = torch.stack([_pack(ops._interleave(block.expert_weights(e)[0], p), p) for e in range(8)])
    w2 = torch.stack([_pack(block.expert_weights(e)[2], p) for e in range(8)])
    words = 2 if dtype is torch.bfloat16 else 1
    wf = w.float().contiguous()
    out = torch.empty(t, h, dtype=dtype)
    assert narrow.op("moe_experts", dtype)(
        x.data_ptr(), h, t, h, ids.contiguous().data_ptr(), wf.data_ptr(), 3, 8, w13.data_ptr(), 0,
        w13.stride(0) // words, w2.data_ptr(), 0, w2.stride(0) // words, i, 0, out.data_ptr(), h, 2) == 0
    assert torch.equal(out, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_model_first_tokens_match_hf(moe_dirs, family):
    """bfloat16 through the engine (the kernels' bf16 path): each prompt's first greedy token is
    HF's bf16 argmax wherever HF's top two logits are not within bf16 rounding of each other."""
    from transformers import AutoModelForCausalLM

    model_dir = moe_dirs[family]
    prompts = random_prompts(640, [6, 3, 11, 1], seed=2)
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=bfloat16"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    checked = 0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0, -1].float()
        top2 = logits.topk(2).values
        if float(top2[0] - top2[1]) > 0.05 * float(top2[0].abs()) + 0.02:
            assert o.outputs[0].token_ids[0] == int(logits.argmax())
            checked += 1
    assert checked >= 2


@pytest.mark.slow
def test_smollm2_upcycled_into_mixtral_matches_hf(default_model, tmp_path):
    """A real-scale MoE: SmolLM2's weights upcycled into a 4-expert top-2 Mixtral (each expert the
    MLP times 1 + 0.05 N(0, 1), a 0.1 N(0, 1) router: /work/shared's MODEL-FAMILIES recipe, seed 0).
    Greedy tokens through the engine equal HF's in float32."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "mixtral-from-smollm2"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (default_model / name).is_file():
            shutil.copy(default_model / name, dst / name)
    cfg = json.loads((default_model / "config.json").read_text())
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
               num_experts_per_tok=2, sliding_window=None)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(default_model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, v in tensors.items():
        part = next((p for p in ("gate_proj", "up_proj", "down_proj") if f".mlp.{p}." in name), None)
        if part is None:
            out[name] = v
            continue
        w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[part]
        prefix = name.split(".mlp.")[0]
        for e in range(4):
            out[f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight"] = (
                v * (1 + 0.05 * torch.randn(v.shape, generator=g))).contiguous()
    for i in range(cfg["num_hidden_layers"]):
        out[f"model.layers.{i}.block_sparse_moe.gate.weight"] = 0.1 * torch.randn(4, cfg["hidden_size"], generator=g)
    save_file(out, dst / "model.safetensors")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 30, 2114, 253, 1142, 3209, 563]]
    got, _ = _generate(dst, prompts, "cache.num_blocks=64", "model.max_model_len=64")
    want = hf_greedy_cached(dst, prompts, MAX_NEW)[0]
    assert [g[0] for g in got] == want
    assert want != hf_greedy_cached(default_model, prompts, MAX_NEW)[0]  # the experts and router matter


def test_prefix_cache_hits_match_hf(moe_dirs):
    """Requests sharing a prefix run after one another (prefix-cache hits): tokens equal HF's."""
    model_dir = moe_dirs["qwen2_moe"]
    prefix = random_prompts(640, [21], seed=31)[0]
    prompts = [prefix + tail for tail in random_prompts(640, [4, 2], seed=32)]
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=float32", "cache.block_size=8", "cache.num_blocks=64"])
    got = [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert sum(s.prefix_hit_tokens for s in llm.engine.steps) >= 16
    assert got == hf_greedy_cached(model_dir, prompts, MAX_NEW)[0]
