"""prompt_logprobs (issue 39, item 2): every prompt position's log-softmax equals HF's on the same
prompt (fp32, atol 1e-4 on log-probabilities), over several prefill chunks, for a prompt whose
prefix is in the prefix cache (such requests take no hit: every position is computed), and next to
requests that do not ask for them."""
from __future__ import annotations

import pytest
import torch
from hf_oracle import random_prompts

from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

ATOL = 1e-4  # fp32 both sides; the two differ by summation order only


def _hf_logprobs(model_dir, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)


def _check(o, prompt, want, top_n):
    got = o.prompt_logprob_entries
    assert len(got) == len(prompt) and got[0] is None
    # vLLM's shape, as a vLLM scoring script reads it: {token_id: Logprob} per position.
    vllm = o.prompt_logprobs
    assert len(vllm) == len(prompt) and vllm[0] is None
    for j in range(1, len(prompt)):
        d = vllm[j]
        assert d[prompt[j]].logprob == got[j]["logprob"] and d[prompt[j]].rank == got[j]["rank"]
        assert {t for t, _ in got[j]["top"]} <= set(d) and len(d) in (top_n, top_n + 1)
        assert isinstance(d[prompt[j]].decoded_token, (str, type(None)))
    for j in range(1, len(prompt)):
        e, row = got[j], want[j - 1]
        assert e["token_id"] == prompt[j]
        assert abs(e["logprob"] - float(row[prompt[j]])) < ATOL, j
        assert e["rank"] == int((row > row[prompt[j]]).sum()) + 1 or abs(
            float(row.sort(descending=True).values[e["rank"] - 1]) - e["logprob"]) < ATOL  # ties within ATOL
        vals, ids = row.topk(top_n)
        assert [t for t, _ in e["top"]] == ids.tolist() or \
            torch.allclose(torch.tensor([v for _, v in e["top"]]), vals, atol=ATOL)
        assert torch.allclose(torch.tensor([v for _, v in e["top"]]), vals, atol=ATOL)


@pytest.mark.slow
def test_prompt_logprobs_equal_hf(tiny_model):
    d = tiny_model("llama")
    # A chunk of 16 tokens: the 50-token prompt is prefilled over 4 steps.
    llm = LLM(model=str(d), device="cpu", max_model_len=128, num_gpu_blocks_override=64, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    long, short = random_prompts(640, [50, 9], seed=3)
    shared = long[:40] + [7, 8, 9]  # 5 blocks of 8 in common with `long`
    want = {k: _hf_logprobs(d, p) for k, p in (("long", long), ("short", short), ("shared", shared))}

    (o,) = llm.generate([long], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    _check(o, long, want["long"], 3)
    assert len(o.outputs[0].token_ids) == 2
    # `long` is in the prefix cache now: a request without prompt_logprobs hits it, one with them does not.
    plain, scored = llm.generate([shared, shared], [SamplingParams(max_tokens=1),
                                                    SamplingParams(max_tokens=1, prompt_logprobs=0)], use_tqdm=False)
    assert plain.num_cached_prompt_tokens == 40 and plain.prompt_logprobs is None
    assert plain.prompt_logprob_entries is None
    assert scored.num_cached_prompt_tokens == 0
    _check(scored, shared, want["shared"], 0)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    # Batched with others, and with n > 1.
    a, b = llm.generate([short, long], [SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, temperature=1.0,
                                                       seed=1), SamplingParams(max_tokens=3)], use_tqdm=False)
    _check(a, short, want["short"], 2)
    assert b.prompt_logprobs is None and len(a.outputs) == 2
