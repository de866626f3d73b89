"""The hybrid KV manager through the engine (issue 37): sliding-window models with prompts several
windows long give Hugging Face's greedy tokens with cache.hybrid_kv on and off, under block sizes
8/16/32, chunked prefill chunks that straddle the window edge, prefix caching, swap and recompute
preemption, and n > 1; after every step the invariants hold, every sliding group holds exactly the
blocks its window still reads, and nothing leaks.
"""
from __future__ import annotations

import pytest
from hf_oracle import hf_greedy_cached, random_prompts
from test_engine import occupancy_by_walking_every_block

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

WINDOW = 8
LENGTHS = [29, 5, 1, 43, 17]
MAX_NEW = 10
FAMILIES = ["gemma3", "gemma2", "mistral_swa"]


@pytest.fixture(scope="module")
def dirs(tiny_model):
    return {f: tiny_model(f, seed=20 + i) for i, f in enumerate(FAMILIES)}


def reference(model_dir, prompts):
    return hf_greedy_cached(model_dir, prompts, MAX_NEW)[0]


def check_windows(engine) -> None:
    """Every running sequence's sliding tables hold exactly the blocks from the one its next query's
    window starts in (no block below the window after a step, none missing inside it)."""
    managers = getattr(engine.kv, "managers", [engine.kv])
    for g in engine.scheduler.running:
        for seq in g.unfinished_seqs():
            for m in managers:
                if not m.window or m.is_swapped(seq.seq_id):
                    continue
                table = m._tables[seq.seq_id]
                skip = min(len(table.block_ids), max(0, seq.num_computed_tokens - m.window + 1) // m.block_size)
                assert table.num_null == skip, (seq.seq_id, seq.num_computed_tokens, table.block_ids)


def run(model_dir, prompts, *sets, sampling=None):
    recipe = load_recipe(None, [f"model.path={model_dir}", "model.dtype=float32", *sets])
    llm = LLM(recipe)
    engine_step = llm.engine.step

    def checked_step():
        finished = engine_step()
        llm.engine.scheduler.check_invariants()
        llm.engine.kv.check_invariants()
        check_windows(llm.engine)
        assert llm.engine._occupancy() == occupancy_by_walking_every_block(llm.engine)
        return finished

    llm.engine.step = checked_step
    sampling = sampling or SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks, "blocks leaked after every request finished"
    return [[c.token_ids for c in o.outputs] for o in outs], llm.engine


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_hybrid_on_and_off_equal_hf_past_the_window(dirs, family, block_size):
    d = dirs[family]
    prompts = random_prompts(640, LENGTHS, seed=3)
    want = reference(d, prompts)
    # 13-token chunks: prefills straddle the window edge and blocks leave the window mid-prefill.
    sets = (f"cache.block_size={block_size}", "cache.num_blocks=96", "scheduler.max_num_batched_tokens=13")
    on, engine = run(d, prompts, *sets)
    off, engine_off = run(d, prompts, *sets, "cache.hybrid_kv=false")
    assert [o[0] for o in on] == want
    assert off == on
    assert engine.kv.stats.window_freed_blocks > 0 or block_size == 32  # 32-token blocks: few leave
    assert engine_off.kv.stats.window_freed_blocks == 0
    assert engine.memory.kv_groups and not engine_off.memory.kv_groups


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_the_window(dirs, mode):
    d = dirs["gemma3"]
    prompts = random_prompts(640, LENGTHS * 2, seed=4)
    want = reference(d, prompts)
    got, engine = run(d, prompts, "cache.block_size=8", "cache.num_blocks=24", f"scheduler.preemption_mode={mode}",
                      "cache.enable_prefix_caching=false", "scheduler.max_num_batched_tokens=16")
    assert [g[0] for g in got] == want
    assert sum(getattr(s, f"preempted_{mode}") for s in engine.steps) > 0, "the small cache should preempt"


@pytest.mark.slow
def test_prefix_caching_with_the_window(dirs):
    d = dirs["gemma3"]
    base = random_prompts(640, [40], seed=5)[0]
    prompts = [base + [7, 8, 9], base + [1], base[:33], base + [3] * 9]
    want = reference(d, prompts)
    got, engine = run(d, prompts, "cache.block_size=8", "cache.num_blocks=96", "scheduler.max_num_seqs=1")
    assert [g[0] for g in got] == want
    assert sum(s.prefix_hit_tokens for s in engine.steps) >= 3 * 32


@pytest.mark.slow
def test_n_samples_fork_with_the_window(dirs):
    d = dirs["gemma2"]
    prompts = random_prompts(640, [30, 19], seed=6)
    sampling = SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True)
    on, engine = run(d, prompts, "cache.block_size=8", "cache.num_blocks=96", sampling=sampling)
    off, _ = run(d, prompts, "cache.block_size=8", "cache.num_blocks=96", "cache.hybrid_kv=false", sampling=sampling)
    assert on == off
    assert engine.kv.stats.forks > 0 and engine.kv.stats.window_freed_blocks > 0
