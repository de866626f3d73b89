"""Never a token from non-finite probabilities (issue 40, item 9): repetition_penalty is bounded where a
float32 row stays finite, and a row that still has nothing to sample (NaN, +inf, every token masked)
fails its request alone, with an error record; the others run as they would have."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.sample import sampler as sampler_mod
from pagedrun.sample.sampler import UNSAMPLEABLE, Sampler, SamplingRow, make_generator
from pagedrun.sampling_params import SamplingParams


@pytest.mark.parametrize("value", [1e-300, 1e-3, 0.0099, 0, -1, 100.5, 1e300, float("nan"), float("inf")])
def test_repetition_penalty_outside_its_range_is_refused(value):
    with pytest.raises(PagedrunError) as e:
        SamplingParams(repetition_penalty=value)
    assert "repetition_penalty: must be a number in [0.01, 100]" in str(e.value)


@pytest.mark.parametrize("value", [0.01, 0.5, 1.0, 2.0, 100])
def test_repetition_penalty_at_its_bounds_gives_finite_rows(value):
    logits = torch.tensor([[1e30, -1e30, 1.0, -1.0]])  # far past any model logit, every token seen
    params = SamplingParams(repetition_penalty=value)
    out = sampler_mod.apply_penalties(logits, [params], [([0, 1, 2, 3], 0)])
    assert bool(torch.isfinite(out).all())


BAD = {"nan": float("nan"), "posinf": float("inf")}


def poisoned(vocab: int, how: str) -> torch.Tensor:
    row = torch.randn(vocab)
    if how == "masked":
        return torch.full((vocab,), float("-inf"))
    row[vocab // 2] = BAD[how]
    return row


@pytest.mark.parametrize("how", ["nan", "posinf", "masked"])
@pytest.mark.parametrize("kind", ["greedy", "greedy_penalised", "random", "seeded", "mixed"])
def test_the_sampler_flags_exactly_the_rows_it_cannot_sample(how, kind):
    vocab, n = 50, 6
    logits = torch.randn(n, vocab)
    bad = {1, 4}
    for i in bad:
        logits[i] = poisoned(vocab, how)
    greedy = SamplingParams(temperature=0)
    params = {"greedy": [greedy] * n, "greedy_penalised": [SamplingParams(temperature=0, presence_penalty=0.5)] * n,
              "random": [SamplingParams(temperature=1.0, top_p=0.9)] * n,
              "seeded": [SamplingParams(temperature=0.7, seed=i) for i in range(n)],
              "mixed": [greedy, SamplingParams(temperature=1.0), greedy, SamplingParams(temperature=0.5, top_k=5),
                        SamplingParams(temperature=1.0, logprobs=3), greedy]}[kind]
    rows = [SamplingRow(p, make_generator(p.seed) if p.seed is not None else None, ([1, 2, 3], 2)) for p in params]
    result = Sampler(0)(logits, rows)
    assert result.errors == dict.fromkeys(bad, UNSAMPLEABLE)
    assert all(0 <= t < vocab for t in result.token_ids)
    for i in set(range(n)) - bad:  # the others: a token they could have drawn
        assert torch.isfinite(logits[i, result.token_ids[i]])


def test_the_fast_greedy_path_flags_bad_rows_too():
    logits = torch.randn(3, 20, dtype=torch.bfloat16)
    logits[2, 5] = float("nan")
    result = Sampler(0)(logits, [SamplingRow(SamplingParams(temperature=0), None)] * 3)
    assert list(result.errors) == [2]


# ---------------------------------------------------------------- in the engine

MARK = 0.5  # the repetition_penalty that marks a request to poison (a legal value)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("nan") / "m", seed=6)


@pytest.fixture
def poison(monkeypatch):
    """Rows of marked requests get NaN logits from the penalties step, from their `at`-th output token."""
    real = sampler_mod.apply_penalties

    def apply(logits, params, histories):
        out = real(logits, params, histories).clone()
        for i, (p, (ids, plen)) in enumerate(zip(params, histories)):
            if p.repetition_penalty == MARK and len(ids) - plen >= poison.at:
                out[i, 7] = float("nan")
        return out

    poison.at = 0
    monkeypatch.setattr(sampler_mod, "apply_penalties", apply)
    return poison


@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("bad_params", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                        dict(temperature=1.0, seed=3, n=3), dict(temperature=0, logprobs=2)])
def test_a_request_with_nothing_to_sample_fails_alone(model, poison, at, bad_params):
    poison.at = at
    llm = LLM(load_recipe(None, [f"model.path={model}", "cache.num_blocks=64", "model.threads=1"]))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    good = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0),
            SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11)]
    bad = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=MARK, **bad_params)
    outs = llm.generate(prompts, [good[0], bad, good[1]], use_tqdm=False)
    alone = llm.generate([prompts[0], prompts[2]], good, use_tqdm=False)
    assert outs[1].error is not None and outs[1].error.startswith(UNSAMPLEABLE)
    assert f"at output token {at + 1}" in outs[1].error
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]
    assert all(o.error is None for o in (outs[0], outs[2]))
    engine = llm.engine
    assert engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks  # the failed request's blocks came back
