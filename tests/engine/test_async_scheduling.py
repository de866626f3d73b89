"""Async scheduling (engine/inflight.py): step n+1 scheduled and launched before step n is read back,
its pending input ids fed on the device, gives the synchronous loop's tokens, on every path a step
can take: greedy and seeded rows (both random streams), stops found a step late (stop tokens,
max_tokens, max_model_len, stop strings), rows that force a read back first (penalties, logprobs,
prompt logprobs, n > 1), preemption under a tight cache, sliding-window KV cache groups, prefix
hits, the static decode buffers with the emulated CUDA kernels, and an interrupt."""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from tiny_models import add_word_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.io.requests import Request
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams
from pagedrun.worker.decode_buffers import DecodeBuffers, DecodeShape


def _llm(model, async_: bool, *sets: str, rng: str | None = None) -> LLM:
    llm = LLM(load_recipe(None, [f"model.path={model}", "model.device=cpu", "cache.block_size=8",
                                 f"scheduler.async_scheduling={str(async_).lower()}", *sets]))
    if rng is not None:
        llm.engine.worker.sampler.rng = rng
    feeds = llm.feeds = []  # per launch: how many inputs took their token from the step before's samples
    launch = llm.engine.worker.launch

    def spy(inputs, row_of, rows, feed=()):
        feeds.append(len(feed))
        return launch(inputs, row_of, rows, feed)

    llm.engine.worker.launch = spy
    return llm


def _requests(params: list[SamplingParams], vocab: int = 640, seed: int = 0, shared_prefix: bool = True):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(16)]
    out = []
    for i, sp in enumerate(params):
        n = [1, 7, 8, 9, 17, 30, 45][i % 7]
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        if shared_prefix and i % 4 == 3:
            ids = prefix + ids  # prefix-cache hits
        out.append(Request(id=f"r{i}", line=i + 1, prompt_token_ids=ids, sampling=sp))
    return out


def _both(model, params, *sets, rng=None, **kw):
    """(sync outputs, async outputs, the async LLM; its .sync: the synchronous one)."""
    first = _llm(model, False, *sets, rng=rng)
    sync = first.run(_requests(params, **kw))
    llm = _llm(model, True, *sets, rng=rng)
    llm.sync = first
    return sync, llm.run(_requests(params, **kw)), llm


def _same(a, b):
    assert [o.request_id for o in a] == [o.request_id for o in b]
    for x, y in zip(a, b):
        assert x.error == y.error, x.request_id
        assert [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in x.outputs] == \
            [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in y.outputs], x.request_id


def _mixed(rng: random.Random, stop_ids: list[int] = ()) -> list[SamplingParams]:
    """Greedy and seeded random rows, max_tokens from 1 up, some with stop tokens; a request of
    n = 3 whose children stop apart (one finished while its siblings run on)."""
    out = [SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=77, stop_token_ids=list(stop_ids))]
    for i in range(1, 28):
        stops = i % 3 == 0
        kw = dict(max_tokens=max(rng.choice([1, 2, 5, 13, 24]), 6 if stops else 1), ignore_eos=True,
                  stop_token_ids=list(stop_ids) if stops else [])
        if i % 2:
            kw.update(temperature=0.9, top_p=0.95, top_k=50 if i % 4 == 1 else 0, seed=1000 + i)
        else:
            kw.update(temperature=0.0)
        out.append(SamplingParams(**kw))
    return out


@pytest.mark.parametrize("rng", ["generator", "counter"])
def test_greedy_and_seeded_tokens_equal_the_synchronous_loop(tiny_model, rng):
    model = tiny_model("llama")
    # Stop tokens the model does produce: taken from a first greedy run, so that stops fire mid-run.
    first = _llm(model, False).run(_requests([SamplingParams(max_tokens=6, ignore_eos=True)] * 8))
    stop_ids = sorted({t for o in first for t in o.outputs[0].token_ids[1:4]})
    params = _mixed(random.Random(1), stop_ids)
    sync, asy, llm = _both(model, params, "scheduler.max_num_seqs=8", "model.max_model_len=64", rng=rng)
    _same(sync, asy)
    reasons = [c.finish_reason for c in sync[0].outputs]
    assert "stop" in reasons and "length" in reasons  # the fork's children end apart
    assert sum(c.finish_reason == "stop" for o in sync for c in o.outputs) >= 3  # the late stops were exercised
    assert any(len(o.outputs[0].token_ids) + len(o.prompt_token_ids) == 64 for o in sync)  # max_model_len
    assert sum(llm.feeds) > 100  # steps really were scheduled ahead, their tokens fed on the device
    assert llm.engine.kv.num_free_gpu_blocks == llm.engine.kv.num_gpu_blocks  # nothing leaked
    # A stop read back a step late costs at most one decode row; an end by length costs none (the
    # sequence counts no pending token and is not scheduled again).
    stops = sum(c.finish_reason == "stop" for o in sync for c in o.outputs)
    decode = [sum(s.num_decode_tokens for s in x.engine.steps) for x in (llm.sync, llm)]
    assert decode[0] <= decode[1] <= decode[0] + stops


def test_rows_that_need_their_token_on_the_host_are_read_back_first(tiny_model, tmp_path):
    """Penalties, bad words, logprobs, prompt logprobs and n > 1 (a fork) beside plain rows; and stop
    strings, found on the text a step late."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama", seed=3), model)
    add_word_tokenizer(model, ["hello", "there", "how", "are", "you", "fine"])
    plain = dict(max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**plain),
        SamplingParams(**plain, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(**plain, logprobs=2),
        SamplingParams(**plain, prompt_logprobs=1),
        SamplingParams(**plain, n=3, temperature=0.8, seed=7),
        SamplingParams(**plain, bad_words=["there"]),
        SamplingParams(**plain, stop=["w1", "w2", "w3 w4"], include_stop_str_in_output=True),
        SamplingParams(**plain, temperature=0.7, seed=5, stop=["w5"]),
    ] * 2
    sync, asy, _ = _both(model, params, "scheduler.max_num_seqs=6")
    _same(sync, asy)
    for x, y in zip(sync, asy):
        assert [c.logprobs for c in x.outputs] == [c.logprobs for c in y.outputs]
        assert x.prompt_logprobs == y.prompt_logprobs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tight_cache_reads_back_before_it_preempts(tiny_model, mode):
    model = tiny_model("llama")
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)] * 10
    sets = ["cache.num_blocks=24", "scheduler.max_num_seqs=8", f"scheduler.preemption_mode={mode}",
            "cache.swap_space=0.01"]
    sync, asy, llm = _both(model, params, *sets, shared_prefix=False)
    _same(sync, asy)
    steps = list(llm.engine.steps)
    assert sum(s.preempted_recompute + s.preempted_swap for s in steps) > 0
    assert sum(llm.feeds) > 0  # ahead where the cache had room, read back first where it had not


@pytest.mark.parametrize("family", ["gemma3", "mistral_swa"])
def test_sliding_window_groups(tiny_model, family):
    """Gemma 3's two KV cache groups (a sliding one giving back blocks as it goes) and Mistral's
    window, with prompts longer than the window."""
    model = tiny_model(family, seed=2)
    params = _mixed(random.Random(2))
    sync, asy, llm = _both(model, params, "scheduler.max_num_seqs=8", "model.max_model_len=128")
    _same(sync, asy)
    assert sum(llm.feeds) > 0


def test_static_decode_buffers_with_emulated_kernels(tmp_path):
    """The CuPy backend's decode path (static buffers, the feed written into their input ids) run by
    the emulator: tokens equal the synchronous loop's."""
    if shutil.which("g++") is None:
        pytest.skip("the CUDA-on-CPU harness needs g++")
    from tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "m", seed=11, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=2)  # head_dim 32: compiled for
    params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=t, seed=s)
              for k, t, s in ((6, 0.0, None), (9, 0.8, 3), (1, 0.0, None), (7, 0.0, None), (8, 0.9, 4))]
    sets = ["model.attention_backend=emulated", "scheduler.max_num_seqs=4", "cache.num_blocks=64"]
    sync, asy, llm = _both(model, params, *sets, rng="counter")
    _same(sync, asy)
    runner = llm.engine.worker.runner
    assert runner.buffers is not None
    assert sum(llm.feeds) > 0


def test_an_interrupt_keeps_what_the_step_in_flight_finished(tiny_model):
    model = tiny_model("llama")
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in (1, 2, 3, 20, 20, 20)]
    full = {o.request_id: o.outputs[0].token_ids for o in _llm(model, False).run(_requests(params))}
    llm = _llm(model, True)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 4

    got = llm.run(_requests(params), should_stop=stop)
    assert {o.request_id for o in got} >= {"r0", "r1", "r2"}  # finished by the step read back on the way out
    for o in got:
        assert o.outputs[0].token_ids == full[o.request_id]
    assert llm.engine.kv.num_free_gpu_blocks == llm.engine.kv.num_gpu_blocks
    assert not llm.engine.has_unfinished()


def test_the_setting_and_its_start_up_line(tiny_model):
    model = tiny_model("llama")
    auto = LLM(load_recipe(None, [f"model.path={model}", "model.device=cpu"]))
    assert not auto.engine.async_scheduling
    assert auto.engine.async_line.startswith("async scheduling: off (the model runs on cpu")
    with pytest.raises(PagedrunError, match="async_scheduling.*auto, true or false"):
        load_recipe(None, ["scheduler.async_scheduling=maybe"])
    a = load_recipe(None, ["scheduler.async_scheduling=true"])
    b = load_recipe(None, ["scheduler.async_scheduling=false"])
    assert a.fingerprint() == b.fingerprint() == load_recipe(None, []).fingerprint()


def test_two_host_mirrors_are_used_in_turn():
    """On CUDA the decode buffers alternate two sets of pinned mirrors (step n+1 is filled while
    step n's copies may still be queued); each set rewrites the rows that changed since it was
    last filled, two steps before."""
    buf = DecodeBuffers(DecodeShape(4, 64, 8), torch.device("cpu"), mirrors=2)
    tables = [[[1, 2], [3, 4], [5, 6], [7, 8]]]
    buf.fill([1, 2, 3, 4], [9, 9, 9, 9], tables)
    first = buf.htab
    buf.fill([1, 2, 3, 4], [10, 10, 10, 10], tables)
    second = buf.htab
    assert not np.shares_memory(first, second)
    grown = [[[1, 2], [3, 4, 99], [5, 6], [7, 8]]]
    buf.fill([1, 2, 3, 4], [11, 16, 11, 11], grown)
    assert buf.htab is first
    assert buf.block_tables[0, 1, :3].tolist() == [3, 4, 99]
    assert buf.input_ids.tolist() == [1, 2, 3, 4] and buf.positions.tolist() == [11, 16, 11, 11]
    buf.fill([5], [12], [[[1, 2]]])  # the other set again: one row, the rest padding
    assert buf.htab is second and buf.slot_mapping[0].tolist() == [2 * 8 + 4, -1, -1, -1]
