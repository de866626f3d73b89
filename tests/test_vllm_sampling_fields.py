"""vLLM's SamplingParams fields (issue 39, item 2): what each does to a run, the legacy guided_* names,
and that a recipe which sets none of them keeps the fingerprint a resume compares."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from tiny_models import add_word_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.sampling_params import LATER_FIELDS, SamplingParams

WORDS = ["hello", "there", "how", "are", "you", "fine"]
ARGS = dict(device="cpu", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fields") / "m"
    shutil.copytree(tiny_model("llama"), d)
    return LLM(model=str(add_word_tokenizer(d, WORDS)), **ARGS)


def _old_fingerprint(recipe) -> str:
    """Recipe.fingerprint as computed before the fields of LATER_FIELDS and model.chat_template existed."""
    d = recipe.to_dict()
    del d["output"], d["distributed"], d["cache"]["hybrid_kv"], d["model"]["chat_template"]
    del d["model"]["generation_config"], d["structured_outputs"]  # (later keys still: at their defaults here)
    # keys added later, which change no token
    del d["scheduler"]["admission_burst"], d["scheduler"]["async_scheduling"], d["model"]["cuda_graphs"]
    for name in LATER_FIELDS:
        del d["sampling"][name]
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()).hexdigest()


def test_a_recipe_without_the_new_fields_keeps_its_fingerprint():
    # The default recipe (fp32) as pagedrun before these fields (commit f08f568) fingerprinted it: a
    # job started then resumes now. A key added to the recipe later must keep this too.
    assert load_recipe(None, ["model.dtype=float32"]).fingerprint() == \
        "380034a4f41f72b7ab4318e9280c6a1fe73234987d1836f3fb8e3ec374eb528a"
    for overrides in ([], ["sampling.temperature=0.7", "sampling.stop=[x]"], ["cache.block_size=8"]):
        r = load_recipe(None, overrides)
        assert r.fingerprint() == _old_fingerprint(r), overrides
    # Setting one is another job; so is each value of it.
    base = load_recipe(None, []).fingerprint()
    prints = {load_recipe(None, [o]).fingerprint() for o in
              ("sampling.prompt_logprobs=1", "sampling.prompt_logprobs=2", "sampling.skip_special_tokens=false",
               "sampling.bad_words=[a]", "sampling.truncate_prompt_tokens=5")}
    assert base not in prints and len(prints) == 5


def test_legacy_guided_fields_are_structured_outputs():
    assert SamplingParams.from_dict({"guided_regex": "a+"}, "f:1").structured_outputs == {"regex": "a+"}
    assert SamplingParams.from_dict({"guided_choice": ["a", "b"]}, "f:1").structured_outputs == {"choice": ["a", "b"]}
    assert SamplingParams.from_dict({"guided_decoding": {"json_object": True}}, "f:1").structured_outputs == \
        {"json_object": True}
    with pytest.warns(UserWarning, match="guided_decoding is deprecated"):
        assert SamplingParams(guided_decoding={"regex": "x"}).structured_outputs == {"regex": "x"}
    with pytest.raises(PagedrunError, match="f:1: guided_json, structured_outputs: give one"):
        SamplingParams.from_dict({"guided_json": {}, "structured_outputs": {"regex": "a"}}, "f:1")


@pytest.mark.parametrize("d, msg", [
    ({"prompt_logprobs": 21}, "prompt_logprobs: must be an integer in 0..20 or null, got 21"),
    ({"bad_words": [""]}, "bad_words: must be a list of non-empty strings"),
    ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list"),
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens: must be an integer >= 1 \(or -1: as many as "
                                    r"max_model_len allows\) or null"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens: must be true or false"),
])
def test_bad_values_are_one_line_errors(d, msg):
    with pytest.raises(PagedrunError, match=f"^f:3: {msg}"):
        SamplingParams.from_dict(d, "f:3")


def test_include_stop_str_in_output(llm):
    sp = dict(max_tokens=8, ignore_eos=True)
    (free,) = llm.generate([5, 6, 7], SamplingParams(**sp), use_tqdm=False)
    words = free.outputs[0].text.split()
    stop = words[2]
    (cut,) = llm.generate([5, 6, 7], SamplingParams(stop=[stop], **sp), use_tqdm=False)
    (kept,) = llm.generate([5, 6, 7], SamplingParams(stop=[stop], include_stop_str_in_output=True, **sp),
                           use_tqdm=False)
    i = free.outputs[0].text.index(stop)
    assert cut.outputs[0].text == free.outputs[0].text[:i]
    assert kept.outputs[0].text == free.outputs[0].text[: i + len(stop)]
    assert kept.outputs[0].stop_reason == cut.outputs[0].stop_reason == stop


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    (o,) = llm.generate([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False)
    assert o.prompt_token_ids == [8, 9, 10]
    (t,) = llm.generate("hello there how are you", SamplingParams(max_tokens=2, truncate_prompt_tokens=2),
                        use_tqdm=False)
    tok = llm.get_tokenizer()
    assert t.prompt_token_ids == tok.encode("hello there how are you")[-2:]
    # -1: as many as max_model_len (64) allows, leaving one token to generate.
    (m,) = llm.generate([list(range(5, 105))], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                        use_tqdm=False)
    assert m.prompt_token_ids == list(range(42, 105)) and len(m.outputs[0].token_ids) == 1


def test_allowed_token_ids_and_skip_special_tokens(llm):
    allowed = [2, 9, 11]  # 2 is </s>
    (o,) = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
                        use_tqdm=False)
    assert set(o.outputs[0].token_ids) <= set(allowed)
    (s,) = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=[2],
                                                  skip_special_tokens=False), use_tqdm=False)
    assert s.outputs[0].token_ids == [2, 2, 2] and s.outputs[0].text.count("</s>") == 3
    (h,) = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=[2]),
                        use_tqdm=False)
    assert h.outputs[0].text == ""
    with pytest.raises(PagedrunError, match=r"allowed_token_ids: token id 999 at index 0 is outside \[0, 640\)"):
        llm.generate([5], SamplingParams(allowed_token_ids=[999]))


def test_bad_words_are_never_generated(llm):
    sp = dict(max_tokens=10, ignore_eos=True)
    (free,) = llm.generate([5, 6, 7], SamplingParams(**sp), use_tqdm=False)
    toks = free.outputs[0].token_ids
    word = llm.get_tokenizer().decode([toks[1]])
    (o,) = llm.generate([5, 6, 7], SamplingParams(bad_words=[word], **sp), use_tqdm=False)
    assert toks[1] not in o.outputs[0].token_ids and o.outputs[0].token_ids[0] == toks[0]
    # Two words: only the second token after the first is banned (vLLM's rule for sequences).
    pair = llm.get_tokenizer().decode(toks[:2])
    (p,) = llm.generate([5, 6, 7], SamplingParams(bad_words=[pair], **sp), use_tqdm=False)
    assert p.outputs[0].token_ids[0] == toks[0] and p.outputs[0].token_ids[1] != toks[1]


def test_bad_words_token_ids_follow_vllm():

    from pagedrun.sampling_params import bad_words_token_ids
    class Tok:  # "word" and " word" are different tokens, as in a GPT-2 vocabulary
        def encode(self, text, add_special_tokens=False):
            return {"cat": [10], " cat": [11], "big cat": [12, 11], " big cat": [13, 11]}[text]

    assert bad_words_token_ids(["cat", " big cat"], Tok()) == ((10,), (11,), (12, 11), (13, 11))


def test_a_vllm_scoring_script_runs_as_written(llm):
    # vLLM's idiom for a prompt's log-likelihood (perplexity, likelihood evals), unchanged.
    outputs = llm.generate(["hello there how are you", "fine"], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    for out in outputs:
        total = sum(lps[tok].logprob for tok, lps in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
        assert total == pytest.approx(sum(e["logprob"] for e in out.prompt_logprob_entries[1:]))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert all(lps[tok].decoded_token == llm.get_tokenizer().decode([tok])
                   for tok, lps in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))


def test_a_stop_tokens_text_is_left_out_unless_asked(llm):
    # vLLM's detokenizer: the token that stopped a request (EOS, a stop_token_ids entry) is not text,
    # unless include_stop_str_in_output.
    sp = dict(max_tokens=8, ignore_eos=True)
    (free,) = llm.generate([5, 6, 7], SamplingParams(**sp), use_tqdm=False)
    stop = free.outputs[0].token_ids[2]
    first = free.outputs[0].token_ids.index(stop)
    (cut,) = llm.generate([5, 6, 7], SamplingParams(stop_token_ids=[stop], **sp), use_tqdm=False)
    (kept,) = llm.generate([5, 6, 7], SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=True, **sp),
                           use_tqdm=False)
    tok = llm.get_tokenizer()
    assert cut.outputs[0].token_ids == kept.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == tok.decode(free.outputs[0].token_ids[:first], skip_special_tokens=True)
    assert kept.outputs[0].text == tok.decode(free.outputs[0].token_ids[: first + 1], skip_special_tokens=True)
