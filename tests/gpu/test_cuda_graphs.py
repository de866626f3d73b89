"""CUDA graphs of decode steps on a real GPU (issue 36 item 2; pagedrun/worker/cuda_graphs.py).
Skipped without CUDA and CuPy; the same paths' host logic runs on the CPU in
tests/worker/test_decode_graphs.py.

- graph tokens == eager static-buffer tokens, bit for bit (bf16, batches that pad, v1 and v2);
- a replayed step's logits == the same step's eager static logits, bit for bit;
- no host synchronisation while a decode step is filled and replayed (sync debug mode "error");
- the capture is counted: measured after capture, in the plan, start-up line.
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
    return make_tiny_model("llama", tmp_path_factory.mktemp("graphs") / "m", seed=7, hidden_size=256,
                           num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
                           max_position_embeddings=2048)


def _llm(model, graphs: str, max_model_len: int = 2048, max_num_seqs: int = 16):
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    return LLM(load_recipe(None, [f"model.path={model}", "model.device=cuda", "model.attention_backend=cupy",
                                  "model.dtype=bfloat16", f"model.cuda_graphs={graphs}",
                                  f"model.max_model_len={max_model_len}", f"scheduler.max_num_seqs={max_num_seqs}",
                                  # a fixed cache: gpu_check runs tests/gpu in parallel processes, whose
                                  # memory a profiled budget would count as "outside torch"
                                  "cache.num_blocks=1024", "sampling.max_tokens=40",
                                  "sampling.ignore_eos=true"]))


def _prompts(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 640) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


@pytest.mark.parametrize("max_model_len", [512, 2048])  # v1, then v2 for every decode
def test_graph_tokens_equal_eager_static_tokens(model, max_model_len):
    prompts = _prompts(11)  # 11 sequences at most 16 at once: buckets 16, 8, 4, ... with padding rows
    eager = _llm(model, "false", max_model_len)
    assert eager.engine.worker.runner.buffers is not None and eager.engine.worker.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts)]
    del eager
    llm = _llm(model, "true", max_model_len)
    runner = llm.engine.worker.runner
    replays: list[int] = []
    real = runner.graphs.replay
    runner.graphs.replay = lambda b: (replays.append(b), real(b))[1]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts)]
    assert got == want
    assert replays and set(replays) <= set(runner.buckets)
    assert llm.engine.worker.backend.last_version == ("v1" if max_model_len <= 512 else "v2")


def test_replayed_logits_equal_eager_static_logits(model):
    from pagedrun.worker.model_runner import ModelInput

    llm = _llm(model, "true")
    runner = llm.engine.worker.runner
    rng = random.Random(1)
    inputs = [ModelInput([rng.randrange(640)], 30 + 7 * i, [[2 * i + 1, 2 * i + 2, 2 * i + 3]], True)
              for i in range(5)]
    with torch.inference_mode():
        graphed = runner.execute(inputs).clone()
        runner.buffers.fill([i.token_ids[0] for i in inputs], [i.start_pos for i in inputs],
                            [[i.block_tables[0] for i in inputs]])
        eager = runner.forward_static(8)[:5]
    assert torch.equal(graphed, eager)


def test_no_host_sync_while_a_decode_step_replays(model):
    from pagedrun.worker.model_runner import ModelInput

    llm = _llm(model, "true")
    runner = llm.engine.worker.runner
    inputs = [ModelInput([5 + i], 20 + i, [[i + 1, i + 2]], True) for i in range(3)]
    runner.execute(inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.execute(inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert logits.shape[0] == 3


def test_capture_is_measured_and_counted(model):
    llm = _llm(model, "auto", max_num_seqs=32)
    w = llm.engine.worker
    assert w.cuda_graphs_line.startswith("cuda graphs: 7 buckets up to 32, ")  # 1 2 4 8 16 24 32
    assert w.memory.cuda_graph_bytes > 0  # the estimate, kept out of the KV budget
    assert w.memory.cuda_graph_measured_bytes > 0
    print(w.cuda_graphs_line)  # measured against the estimate: the record for the next estimate
    assert sorted(w.runner.graphs.graphs) == w.runner.buckets
