import pytest

from pagedrun.errors import PagedrunError
from pagedrun.sampling_params import SamplingParams, merged

WHERE = "prompts.jsonl:7"


def test_defaults_are_pagedruns_not_vllms():
    p = SamplingParams()
    assert p.max_tokens == 256  # vLLM's 16 cuts answers mid-sentence
    assert p.temperature == 0.0 and p.is_greedy
    assert (p.n, p.min_tokens, p.top_p, p.top_k, p.min_p) == (1, 0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None and p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize("temperature,greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy_treats_tiny_temperatures_as_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_from_dict_normalises():
    p = SamplingParams.from_dict({"stop": "END", "top_k": -1, "temperature": 1, "seed": 3}, WHERE)
    assert p.stop == ["END"]
    assert p.top_k == 0  # one spelling of "off"
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.seed == 3 and p.max_tokens == 256


@pytest.mark.parametrize("field,value,must", [
    ("temperature", -0.1, "must be a number >= 0"),
    ("temperature", "hot", "must be a number >= 0"),
    ("temperature", float("nan"), "must be a number >= 0"),
    ("top_p", 0, "must be a number in (0, 1]"),
    ("top_p", 1.5, "must be a number in (0, 1]"),
    ("top_k", -2, "must be an integer >= 0"),
    ("top_k", 2.5, "must be an integer >= 0"),
    ("min_p", 1.1, "must be a number in [0, 1]"),
    ("max_tokens", 0, "must be an integer >= 1"),
    ("max_tokens", 10.0, "must be an integer >= 1"),
    ("n", 0, "must be an integer >= 1"),
    ("n", True, "must be an integer >= 1"),  # bool is an int in Python, not here
    ("min_tokens", -1, "must be an integer >= 0"),
    ("logprobs", 21, "must be an integer in 0..20 or null"),
    ("logprobs", -1, "must be an integer in 0..20 or null"),
    ("logprobs", True, "must be an integer in 0..20 or null"),
    ("stop", 5, "must be a non-empty string or a list of non-empty strings"),
    ("stop", ["ok", 3], "must be a non-empty string or a list of non-empty strings"),
    ("stop", [""], "must be a non-empty string or a list of non-empty strings"),
    ("stop_token_ids", 5, "must be a list of non-negative integer token ids"),
    ("stop_token_ids", [1, -1], "must be a list of non-negative integer token ids"),
    ("stop_token_ids", [False], "must be a list of non-negative integer token ids"),
    ("seed", "42", "must be an integer in 0..2**64-1 or null"),
    ("seed", -1, "must be an integer in 0..2**64-1 or null"),
    ("seed", 2**64, "must be an integer in 0..2**64-1 or null"),
    ("ignore_eos", 1, "must be true or false"),
])
def test_bad_values_name_where_field_and_value(field, value, must):
    with pytest.raises(PagedrunError) as e:
        SamplingParams.from_dict({field: value}, WHERE)
    assert str(e.value).startswith(f"{WHERE}: {field}: {must}")
    assert str(e.value).endswith(f"got {value!r}")
    assert "\n" not in str(e.value)


def test_unknown_field_is_named_with_a_suggestion():
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: tempreature: unknown field \(did you mean temperature\?\)$"):
        SamplingParams.from_dict({"tempreature": 0.5}, WHERE)


def test_unsupported_vllm_field_says_so():
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: best_of: unknown field: a vLLM"):
        SamplingParams.from_dict({"best_of": 2}, WHERE)


def test_min_tokens_above_max_tokens():
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: min_tokens: must be <= max_tokens \(10\), got 11$"):
        SamplingParams.from_dict({"min_tokens": 11, "max_tokens": 10}, WHERE)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(PagedrunError, match="recipe.yaml: sampling: must be a mapping"):
        SamplingParams.from_dict(["temperature"], "recipe.yaml: sampling")


def test_constructor_checks_too():
    with pytest.raises(PagedrunError, match=r"^SamplingParams: top_p: must be a number in \(0, 1\], got 2$"):
        SamplingParams(top_p=2)


def test_merged_overrides_only_given_fields():
    defaults = SamplingParams(max_tokens=64, temperature=0.5, stop=["\n"])
    p = merged(defaults, {"temperature": 0.0, "seed": 9}, WHERE)
    assert (p.max_tokens, p.temperature, p.seed, p.stop) == (64, 0.0, 9, ["\n"])
    assert defaults.temperature == 0.5 and defaults.seed is None  # defaults untouched
    assert merged(defaults, {}, WHERE) == defaults


def test_merged_errors_name_the_request_line():
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: max_tokens: must be an integer >= 1, got 0$"):
        merged(SamplingParams(), {"max_tokens": 0}, WHERE)
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: max_token: unknown field \(did you mean max_tokens\?\)$"):
        merged(SamplingParams(), {"max_token": 5}, WHERE)
    # min_tokens from the defaults, max_tokens from the request: still caught
    with pytest.raises(PagedrunError, match=r"^prompts\.jsonl:7: min_tokens: must be <= max_tokens \(4\)"):
        merged(SamplingParams(min_tokens=8), {"max_tokens": 4}, WHERE)


def test_to_dict_round_trips():
    p = SamplingParams(n=2, temperature=0.8, seed=1, stop=["a"], stop_token_ids=[2], logprobs=5)
    assert SamplingParams.from_dict(p.to_dict(), WHERE) == p
