"""Logit bias and penalties: against HF's logits processors on the same logits, against OpenAI's
formula in float64, and end to end against HF generate with the same settings."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.sample.penalties import apply_penalties
from pagedrun.sample.sampler import Sampler, SamplingRow
from pagedrun.sampling_params import SamplingParams

VOCAB = 300


def _batch(seed: int, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 4
    rng = random.Random(seed)
    histories = []
    for _ in range(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        out = [rng.randrange(40) for _ in range(rng.randint(0, 30))]  # few distinct: real repeats
        histories.append((prompt + out, len(prompt)))
    return logits, histories


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hf_processor(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits, histories = _batch(1)
    params = [SamplingParams(repetition_penalty=penalty)] * len(histories)
    got = apply_penalties(logits, params, histories)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (ids, _) in enumerate(histories):
        ref = hf(torch.tensor([ids]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], ref, rtol=0, atol=0)


def test_presence_frequency_and_bias_equal_openai_formula_in_float64():
    logits, histories = _batch(2)
    rng = random.Random(2)
    params = []
    for _ in histories:
        bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 5))}
        params.append(SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                                     logit_bias=bias))
    got = apply_penalties(logits, params, histories)
    for i, ((ids, plen), p) in enumerate(zip(histories, params)):
        ref = logits[i].double().clone()
        for tok, b in p.logit_bias.items():
            ref[tok] += b
        for tok in set(ids[plen:]):
            c = ids[plen:].count(tok)
            ref[tok] -= c * p.frequency_penalty + p.presence_penalty
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-4)


def test_rows_without_penalties_are_untouched_and_input_not_modified():
    logits, histories = _batch(3)
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(),
              SamplingParams(repetition_penalty=1.5), SamplingParams(logit_bias={5: 3.0}), SamplingParams()]
    got = apply_penalties(logits, params, histories)
    assert torch.equal(logits, before)
    for i in (0, 2, 5):
        assert torch.equal(got[i], logits[i])
    for i in (1, 3, 4):
        assert not torch.equal(got[i], logits[i])
    assert apply_penalties(logits, [SamplingParams()] * 6, histories) is logits  # nothing to do, no copy


def test_logit_bias_steers_greedy_and_logprobs_stay_raw():
    logits, histories = _batch(4, rows=2)
    forced = int(logits[0].argmin())
    rows = [SamplingRow(SamplingParams(logit_bias={forced: 100.0}, logprobs=0), None, histories[0]),
            SamplingRow(SamplingParams(logit_bias={int(logits[1].argmax()): -100.0}), None, histories[1])]
    res = Sampler()(logits, rows)
    assert res.token_ids[0] == forced
    assert res.token_ids[1] != int(logits[1].argmax())
    raw = logits[0].log_softmax(-1)[forced].item()
    assert res.logprobs[0]["logprob"] == pytest.approx(raw, abs=1e-5)  # vLLM's raw logprobs


def test_field_checks():
    assert SamplingParams(logit_bias={"50": -100}).logit_bias == {50: -100.0}
    for bad in [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(logit_bias={"x": 1}), dict(logit_bias={1: 101}), dict(logit_bias=[1, 2]),
                dict(logit_bias={-1: 1.0}), dict(logit_bias={1: True})]:
        with pytest.raises(PagedrunError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_logit_bias_outside_vocab_is_a_line_error(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6], "logit_bias": {"7": 1}}\n'
                       '{"prompt_token_ids": [5, 6], "logit_bias": {"100000": 1}}\n')
    llm = LLM(load_recipe(None, [f"model.path={d}"]))
    ok, bad = llm.read_requests(prompts, skip_invalid=True)
    assert len(ok) == 1 and len(bad) == 1
    assert "logit_bias" in bad[0].error and "100000" in bad[0].error


class _OpenAIPenalties:
    """HF has no presence/frequency processor: OpenAI's formula as a HF LogitsProcessor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.slow
def test_greedy_with_penalties_equals_hf_generate(tiny_model, family):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    d = tiny_model(family)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 640) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    settings = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.7),
                dict(repetition_penalty=0.7, frequency_penalty=2.0)]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    llm = LLM(load_recipe(None, [f"model.path={d}", "sampling.ignore_eos=true", "cache.block_size=8"]))
    differs = 0
    for s in settings:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **s))]
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
        for p, g, q in zip(prompts, got, plain):
            procs = LogitsProcessorList()
            if "presence_penalty" in s or "frequency_penalty" in s:
                procs.append(_OpenAIPenalties(len(p), s.get("presence_penalty", 0.0), s.get("frequency_penalty", 0.0)))
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                              repetition_penalty=s.get("repetition_penalty", 1.0), logits_processor=procs)
            assert g == ref[0, len(p):].tolist()
            differs += g != q
    assert differs > 0  # the penalties changed what greedy picks (the test can fail)
