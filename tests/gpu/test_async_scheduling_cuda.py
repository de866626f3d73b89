"""Async scheduling on a real GPU (issue 36 item 8; pagedrun/engine/inflight.py). Skipped without
CUDA and CuPy; the same control flow runs on the CPU in tests/engine/test_async_scheduling.py.

- async tokens == synchronous tokens, with CUDA graphs and without (bf16; greedy and seeded rows,
  the counter RNG; stops a step late);
- launching a decode step ahead (fill, feed, replay, sampler) synchronises nothing (sync debug mode
  "error"): the only wait is the read back of the step before;
- the host really runs ahead: a step's samples are read back after the next step was launched.
"""
from __future__ import annotations

import random

import pytest
import torch
from cuda_required import GPU_ONLY
from tiny_models import make_tiny_model

pytestmark = GPU_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("async") / "m", seed=9, hidden_size=256,
                           num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
                           max_position_embeddings=1024)


def _llm(model, async_: bool, graphs: str = "auto"):
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    return LLM(load_recipe(None, [f"model.path={model}", "model.device=cuda", "model.attention_backend=cupy",
                                  "model.dtype=bfloat16", f"model.cuda_graphs={graphs}", "model.max_model_len=1024",
                                  "scheduler.max_num_seqs=16", f"scheduler.async_scheduling={str(async_).lower()}",
                                  "cache.num_blocks=1024"]))


def _requests(n: int = 24, seed: int = 0):
    from pagedrun.io.requests import Request
    from pagedrun.sampling_params import SamplingParams

    rng = random.Random(seed)
    out = []
    for i in range(n):
        sp = SamplingParams(max_tokens=rng.choice([1, 3, 17, 40]), ignore_eos=i % 2 == 0,
                            temperature=0.0 if i % 3 else 0.8, seed=i if i % 3 == 0 else None)
        out.append(Request(id=f"r{i}", line=i + 1, prompt_token_ids=[rng.randrange(3, 640) for _ in range(rng.randrange(1, 70))],
                           sampling=sp))
    return out


@pytest.mark.parametrize("graphs", ["true", "false"])
def test_async_tokens_equal_synchronous_tokens(model, graphs):
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in _llm(model, False, graphs).run(_requests())]
    llm = _llm(model, True, graphs)
    assert llm.engine.async_line == "async scheduling: on (step n+1 is scheduled while step n runs)"
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.run(_requests())]
    assert got == want


def test_a_step_is_read_back_after_the_next_is_launched_and_launching_syncs_nothing(model):
    llm = _llm(model, True, "true")
    engine, worker = llm.engine, llm.engine.worker
    events: list[str] = []
    launch, resolve = worker.launch, engine._resolve

    def strict_launch(inputs, row_of, rows, feed=()):
        events.append("launch")
        decode = bool(feed) and all(len(i[0]) == 1 and not i[4] for i in inputs)
        if decode:  # a step scheduled ahead: buffers, feed, replay, sampler, the copy back queued
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(inputs, row_of, rows, feed)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    worker.launch = strict_launch
    engine._resolve = lambda: (events.append("read"), resolve())[1]
    llm.run(_requests(8))
    # Steady state: launch n+1, read n, launch n+2, read n+1...
    assert "launch launch read launch read" in " ".join(events)
