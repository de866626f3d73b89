"""Engine-level oracle tests: greedy tokens equal HF transformers' generate, token for token, through
every path the paged KV cache can take (block sizes, preemption by recompute and by swap, prefix
caching, forks), plus seeded-sampling reproducibility and KV-pool accounting."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.config.recipe import load_recipe
from pagedrun.kv.block_table import NULL_BLOCK
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

MAX_TOKENS = 16
NUM_PROMPTS = 18


@pytest.fixture(scope="module")
def model_dirs(tiny_model):
    return {f: tiny_model(f, seed=i) for i, f in
            enumerate(("llama", "llama3", "qwen2", "qwen3", "mistral", "llama_tied"))}


def prompts_for(vocab: int, n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Varied lengths: 1 token, around block boundaries (7, 8, 9, 16, 17), and long ones.
    lengths = [1, 7, 8, 9, 16, 17, 31, 33, 64] + [rng.randint(2, 90) for _ in range(n - 9)]
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths[:n]]


_HF_CACHE: dict = {}


def hf_greedy(model_dir, prompts, max_new_tokens=MAX_TOKENS) -> list[list[int]]:
    key = (str(model_dir), tuple(map(tuple, prompts)), max_new_tokens)
    if key in _HF_CACHE:
        return _HF_CACHE[key]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # ignore_eos: run every request to max_new_tokens
    out = []
    for p in prompts:
        g = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    _HF_CACHE[key] = out
    return out


def occupancy_by_walking_every_block(engine) -> dict:
    """The report's per-step occupancy the slow, obvious way: every block of every running table of
    every KV cache group, each distinct block at the fullest of its holders (the oracle for
    LLMEngine._occupancy, which only walks shared blocks); entries the window gave back hold none."""
    bs = engine.kv.block_size
    stored: dict[tuple[int, int], int] = {}
    assigned: dict[tuple[int, int], int] = {}
    logical = reserved = left = 0
    managers = getattr(engine.kv, "managers", [engine.kv])
    for g in engine.scheduler.running:
        for seq in g.unfinished_seqs():
            logical += seq.num_computed_tokens
            reserved += min(g.prompt_len + g.sampling.max_tokens, engine.max_model_len)
            for k, manager in enumerate(managers):
                table = manager._tables[seq.seq_id]
                computed, slots = seq.num_computed_tokens, table.num_tokens
                for i, b in enumerate(table.block_ids):
                    if b == NULL_BLOCK:
                        left += 1
                        continue
                    a, c = min(bs, slots - i * bs), min(bs, computed - i * bs)
                    if a > 0:
                        assigned[k, b] = max(assigned.get((k, b), 0), a)
                    if c > 0:
                        stored[k, b] = max(stored.get((k, b), 0), c)
    return {"tokens_stored": sum(stored.values()), "tokens_assigned": sum(assigned.values()),
            "tokens_logical": logical, "reserved_contiguous_tokens": reserved,
            "num_running_requests": len(engine.scheduler.running), "blocks_left_window": left}


def run(model_dir, prompts, *sets, sampling=None):
    recipe = load_recipe(None, [f"model.path={model_dir}", f"sampling.max_tokens={MAX_TOKENS}",
                                "sampling.ignore_eos=true", *sets])
    llm = LLM(recipe)
    engine_step = llm.engine.step

    def checked_step():  # the scheduler's queue invariants hold after every step
        finished = engine_step()
        llm.engine.scheduler.check_invariants()
        assert llm.engine._occupancy() == occupancy_by_walking_every_block(llm.engine)
        return finished

    llm.engine.step = checked_step
    outs = llm.generate(prompts, sampling)
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks, "blocks leaked after every request finished"
    return [[c.token_ids for c in o.outputs] for o in outs], llm.engine


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral", "llama_tied"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_equals_hf(model_dirs, family, block_size):
    d = model_dirs[family]
    prompts = prompts_for(640)
    ref = hf_greedy(d, prompts)
    got, engine = run(d, prompts, f"cache.block_size={block_size}", "cache.num_blocks=512")
    assert [g[0] for g in got] == ref
    assert sum(s.preempted_recompute + s.preempted_swap for s in engine.steps) == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_equals_hf_under_preemption(model_dirs, family, mode, block_size):
    d = model_dirs[family]
    prompts = prompts_for(640)
    ref = hf_greedy(d, prompts)
    # Just enough blocks for the longest request alone: many must be preempted and resumed.
    num_blocks = -(-(90 + MAX_TOKENS) // block_size) + 2
    got, engine = run(d, prompts, f"cache.block_size={block_size}", f"cache.num_blocks={num_blocks}",
                      f"scheduler.preemption_mode={mode}", "cache.enable_prefix_caching=false")
    assert [g[0] for g in got] == ref
    preempted = sum(getattr(s, f"preempted_{mode}") for s in engine.steps)
    assert preempted > 0, "the small cache should have forced preemption"
    if mode == "swap":
        assert sum(s.swap_out_blocks for s in engine.steps) > 0
        assert sum(s.swap_in_blocks for s in engine.steps) == sum(s.swap_out_blocks for s in engine.steps)


def test_chunked_prefill_equals_hf(model_dirs):
    d = model_dirs["llama"]
    prompts = prompts_for(640)
    ref = hf_greedy(d, prompts)
    got, engine = run(d, prompts, "scheduler.max_num_batched_tokens=20", "cache.num_blocks=512")
    assert [g[0] for g in got] == ref
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in engine.steps) <= 20


def test_max_num_seqs_respected(model_dirs):
    d = model_dirs["llama"]
    prompts = prompts_for(640)
    got, engine = run(d, prompts, "scheduler.max_num_seqs=3", "cache.num_blocks=512")
    assert [g[0] for g in got] == hf_greedy(d, prompts)
    assert max(s.num_seqs for s in engine.steps) <= 3


def shared_prefix_prompts(n=32, prefix_len=256, seed=1):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 640) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 640) for _ in range(rng.randint(4, 24))] for _ in range(n)]


def test_prefix_caching_equals_uncached_and_saves_80_percent(model_dirs, tmp_path):
    d = make_tiny_model("llama", tmp_path / "m", seed=5, max_position_embeddings=1024)
    prompts = shared_prefix_prompts()
    off, e_off = run(d, prompts, "cache.enable_prefix_caching=false", "cache.num_blocks=1200")
    on, e_on = run(d, prompts, "cache.enable_prefix_caching=true", "cache.num_blocks=1200")
    assert on == off
    prefill_off = sum(s.num_prefill_tokens for s in e_off.steps)
    prefill_on = sum(s.num_prefill_tokens for s in e_on.steps)
    assert prefill_on <= 0.2 * prefill_off, (prefill_on, prefill_off)
    hits = sum(s.prefix_hit_tokens for s in e_on.steps)
    assert hits >= 31 * 256 - 31 * 16  # every request after the first hits the prefix's full blocks


def test_fully_cached_prompt_recomputes_last_token(model_dirs):
    d = model_dirs["llama"]
    p = [list(range(3, 3 + 32))] * 3  # identical prompts of exactly 2 blocks of 16
    got, engine = run(d, p, "cache.block_size=16", "cache.num_blocks=64", "scheduler.max_num_seqs=1")
    assert got[0] == got[1] == got[2] == [hf_greedy(d, p[:1])[0]]
    # Later requests hit only the first block: the hit is capped so that one token is computed.
    assert sum(s.prefix_hit_tokens for s in engine.steps) == 2 * 16


@pytest.mark.slow


def test_seeded_sampling_ignores_batch_composition(model_dirs):
    d = model_dirs["qwen2"]
    prompts = prompts_for(640, n=10, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = [run(d, [p], "cache.num_blocks=128", sampling=params)[0][0] for p in prompts[:3]]
    together, _ = run(d, prompts, "cache.num_blocks=512", sampling=params)
    reordered, _ = run(d, prompts[::-1], "cache.num_blocks=14", "cache.block_size=8", sampling=params)
    assert together[:3] == alone
    assert reordered[::-1] == together
    different_seed, _ = run(d, prompts[:3], "cache.num_blocks=128",
                            sampling=SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert different_seed != alone


def test_parallel_sampling_n4_reproduces_and_shares_prompt_blocks(model_dirs):
    d = model_dirs["llama"]
    prompt = prompts_for(640, n=9)[8]  # 64 tokens = 8 full blocks of 8
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a, ea = run(d, [prompt], "cache.block_size=8", "cache.num_blocks=64", sampling=params)
    b, _ = run(d, [prompt, prompts_for(640)[3]], "cache.block_size=8", "cache.num_blocks=64", sampling=params)
    assert len(a[0]) == 4 and a[0] == b[0]
    assert len({tuple(x) for x in a[0]}) > 1, "four seeded children should not all be identical"
    # After the fork, 4 children share the 8 prompt blocks: peak use is 8 + 4 x 2 own blocks, not 4 x 10.
    assert max(s.blocks_in_use for s in ea.steps) <= 8 + 4 * 2


def test_parallel_sampling_copy_on_write_partial_block(model_dirs):
    d = model_dirs["llama"]
    prompt = prompts_for(640, n=9)[7]  # 33 tokens: the last block is partial and shared at the fork
    params = SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True)
    got, engine = run(d, [prompt], "cache.block_size=8", "cache.num_blocks=64", sampling=params)
    ref = hf_greedy(d, [prompt], max_new_tokens=6)[0]
    assert got[0] == [ref, ref, ref]  # greedy children all equal HF despite sharing then copying
    assert sum(s.cow_copies for s in engine.steps) == 2  # two of three children copy; the last owns it


def test_stop_conditions(model_dirs):
    d = model_dirs["llama"]
    prompts = prompts_for(640, n=4)
    ref = hf_greedy(d, prompts)
    stop_tok = ref[2][5]
    params = SamplingParams(max_tokens=16, stop_token_ids=[stop_tok], ignore_eos=True)
    recipe = load_recipe(None, [f"model.path={d}", "cache.num_blocks=128"])
    outs = LLM(recipe).generate(prompts, params)
    o = outs[2].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert o.token_ids == ref[2][: ref[2].index(stop_tok) + 1]
    assert outs[0].outputs[0].finish_reason in ("length", "stop")


def test_eos_stops_unless_ignored(model_dirs, tmp_path):
    d = model_dirs["llama"]
    prompts = prompts_for(640, n=6)
    ref = hf_greedy(d, prompts)
    eos = ref[1][3]  # pretend this token is EOS
    import json

    cfg = json.loads((d / "config.json").read_text())
    d2 = tmp_path / "eos"
    d2.mkdir()
    cfg["eos_token_id"] = eos
    (d2 / "config.json").write_text(json.dumps(cfg))
    (d2 / "model.safetensors").symlink_to(d / "model.safetensors")
    recipe = load_recipe(None, [f"model.path={d2}", "cache.num_blocks=128", "sampling.max_tokens=16"])
    outs = LLM(recipe).generate(prompts)
    o = outs[1].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == ref[1][: ref[1].index(eos) + 1]
    outs = LLM(recipe).generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert outs[1].outputs[0].token_ids == ref[1]


def test_logprobs_are_top_n_of_raw_distribution(model_dirs):
    d = model_dirs["llama"]
    recipe = load_recipe(None, [f"model.path={d}", "cache.num_blocks=64"])
    outs = LLM(recipe).generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=3, ignore_eos=True))
    lps = outs[0].outputs[0].logprobs
    assert len(lps) == 3
    for lp, tok in zip(lps, outs[0].outputs[0].token_ids):
        assert lp["token_id"] == tok and len(lp["top"]) == 3
        assert lp["top"][0][0] == tok  # greedy: the sampled token is the most likely one
        assert abs(lp["top"][0][1] - lp["logprob"]) < 1e-6
        assert lp["top"][0][1] >= lp["top"][1][1] >= lp["top"][2][1]


def test_request_that_can_never_fit_is_an_error_record(model_dirs):
    d = model_dirs["llama"]
    recipe = load_recipe(None, [f"model.path={d}", "cache.num_blocks=3", "cache.block_size=8",
                                "sampling.max_tokens=8", "sampling.ignore_eos=true", "model.max_model_len=32"])
    outs = LLM(recipe).generate([[5] * 30, [6] * 4])
    assert outs[0].error and "KV blocks" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8


@pytest.mark.parametrize("preempt", [False, True])
def test_admission_burst_same_tokens_fewer_mixed_steps(model_dirs, preempt):
    """scheduler.admission_burst: while sequences run, waiting ones are admitted only once that many
    slots are free (or as many as are waiting). The tokens are HF's either way; fewer steps mix
    prefill and decode; the tail and preemption never stall."""
    d = model_dirs["llama"]
    prompts = prompts_for(640, n=24, seed=3)
    params = [SamplingParams(max_tokens=1 + (i * 5) % MAX_TOKENS, ignore_eos=True) for i in range(len(prompts))]
    want = [h[: p.max_tokens] for h, p in zip(hf_greedy(d, prompts), params)]
    blocks = "cache.num_blocks=24" if preempt else "cache.num_blocks=512"
    mixed = {}
    for burst in (1, 4):
        llm = LLM(load_recipe(None, [f"model.path={d}", f"scheduler.admission_burst={burst}", "scheduler.max_num_seqs=8",
                                     blocks, "cache.block_size=8"]))
        sch = llm.engine.scheduler
        schedule, steps = sch.schedule, []

        def recorded(schedule=schedule, steps=steps, sch=sch):
            running = sum(len(g.unfinished_seqs()) for g in sch.running)
            waiting = len(sch.waiting)
            out = schedule()
            admitted = sum(1 for s in out.scheduled if s.seq.num_computed_tokens == 0)
            if burst > 1 and admitted and running and not out.preempted_recompute:
                # admitted while others ran: the burst's slots (or every waiting group's) were free
                assert 8 - running >= min(burst, waiting), (running, waiting)
            steps.append(bool(out.num_prefill_tokens and out.num_decode_tokens))
            return out

        sch.schedule = recorded
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, burst
        mixed[burst] = sum(steps)
    assert mixed[4] < mixed[1], mixed
