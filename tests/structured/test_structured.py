"""Structured outputs on random tiny models: every constrained output parses and validates, through
batching with mixed constraints, n > 1, seeds, stop strings, max_tokens, prefix hits and both kinds
of preemption. Random logits wander in free whitespace, so these use disable_any_whitespace."""
from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest
import torch
from tiny_models import make_tiny_model
from tiny_tokenizer import write_tiny_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.sample.sampler import Sampler, SamplingRow
from pagedrun.sampling_params import SamplingParams
from pagedrun.structured import grammar as grammar_mod

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
LABEL = {"type": "object", "required": ["label"], "additionalProperties": False,
         "properties": {"label": {"enum": ["pos", "neg", "neutral"]}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["yes", "no", "maybe"]
# The optional extra; only the shape checks and the missing-extra error run without it.
needs_engine = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                  reason='the optional extra: pip install -e ".[structured]"')
SPECIAL_IDS = {0, 1}  # <unk>, <s>; </s> (2) is the stop token, allowed only at the end


def constraint(i: int) -> tuple[dict, str]:
    kind = ("json", "json2", "regex", "choice")[i % 4]
    if kind == "json":
        return {"json": PERSON, "disable_any_whitespace": True}, kind
    if kind == "json2":
        return {"json": json.dumps(LABEL), "disable_any_whitespace": True}, kind  # schema as text
    if kind == "regex":
        return {"regex": DATE}, kind
    return {"choice": CHOICES}, kind


def check_output(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json2":
        jsonschema.validate(json.loads(text), LABEL)
    elif kind == "regex":
        assert re.fullmatch(DATE, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama", seed=3)
    return write_tiny_tokenizer(d)


def make_llm(model_dir, *sets) -> LLM:
    return LLM(load_recipe(None, [f"model.path={model_dir}", "sampling.max_tokens=120", "cache.block_size=8",
                                  *sets]))


def requests_for(n_requests: int, *, prefix: str = "", **extra) -> list[dict]:
    reqs = []
    for i in range(n_requests):
        spec, _ = constraint(i)
        reqs.append({"prompt": f"{prefix}request {i}: the quick brown fox {'jumps ' * (i % 5)}",
                     "structured_outputs": spec, **extra})
    return reqs


def assert_all_valid(outs, n_requests: int, allow_length: bool = False) -> None:
    assert len(outs) == n_requests
    for i, o in enumerate(outs):
        assert o.error is None, o.error
        _, kind = constraint(i)
        for c in o.outputs:
            assert not SPECIAL_IDS & set(c.token_ids), c.token_ids
            assert 2 not in c.token_ids[:-1], "the stop token only ends an output"
            if allow_length and c.finish_reason == "length":
                continue
            assert c.finish_reason == "stop" and c.token_ids[-1] == 2, (c.finish_reason, c.text)
            check_output(kind, c.text)


@needs_engine
def test_mixed_batch_parses_and_validates_with_n_and_seeds(tiny):
    llm = make_llm(tiny)
    reqs = requests_for(12) + [dict(r, n=3, temperature=1.0, seed=100 + i) for i, r in enumerate(requests_for(4))]
    reqs += [{"prompt": "unconstrained", "max_tokens": 8, "ignore_eos": True}]
    outs = llm.generate(reqs)
    assert_all_valid(outs[:12], 12)
    assert_all_valid(outs[12:16], 4)
    assert all(len(o.outputs) == 3 for o in outs[12:16])
    assert len(outs[16].outputs[0].token_ids) == 8  # the unconstrained row ran as before
    # Each child follows its own matcher: seeded children differ somewhere among the 12.
    assert len({tuple(c.token_ids) for o in outs[12:16] for c in o.outputs}) > 4
    assert not llm.engine.structured.grammars, "every sequence's grammar is freed when it finishes"
    # A seeded constrained request reproduces alone, whatever else shared its batch.
    alone = make_llm(tiny).generate([reqs[13]])
    assert [c.token_ids for c in alone[0].outputs] == [c.token_ids for c in outs[13].outputs]


@needs_engine
def test_fan_out_beyond_max_num_seqs(tiny):
    llm = make_llm(tiny, "scheduler.max_num_seqs=4")
    outs = llm.generate([dict(requests_for(1)[0], n=6, temperature=1.0, seed=5)])
    assert_all_valid(outs, 1)
    assert len(outs[0].outputs) == 6


@needs_engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_hits_keep_outputs_valid_and_equal(tiny, mode):
    reqs = requests_for(16, prefix="shared system prompt " * 6)
    ref = make_llm(tiny, "cache.num_blocks=512").generate(reqs)
    assert_all_valid(ref, 16)
    llm = make_llm(tiny, "cache.num_blocks=36", f"scheduler.preemption_mode={mode}")
    outs = llm.generate(reqs)
    steps = llm.engine.steps
    assert sum(getattr(s, f"preempted_{mode}") for s in steps) > 0, "the small cache should preempt"
    assert sum(s.prefix_hit_tokens for s in steps) > 0, "the shared prefix should hit the cache"
    assert_all_valid(outs, 16)
    # Greedy and masked by the same grammar state: preemption changes nothing, and no token was
    # accepted twice (a matcher that had would have refused the next one or masked differently).
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


@needs_engine
def test_stop_strings_and_max_tokens_cut_documents(tiny):
    llm = make_llm(tiny)
    spec = {"json": PERSON, "disable_any_whitespace": True}
    outs = llm.generate([{"prompt": "cut short", "structured_outputs": spec, "max_tokens": 3},
                         {"prompt": "stop at comma", "structured_outputs": spec, "stop": [","]}])
    short = outs[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert '{"name":"'.startswith(short.text) or short.text.startswith('{"name":"')
    cut = outs[1].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == ","
    assert cut.text.startswith('{"name":"') and "," not in cut.text


@needs_engine
def test_constrained_request_ends_at_grammar_end_even_with_ignore_eos(tiny):
    outs = make_llm(tiny).generate([{"prompt": "x", "structured_outputs": {"choice": CHOICES},
                                     "ignore_eos": True, "max_tokens": 50},
                                    {"prompt": "y", "structured_outputs": {"regex": "[a-z]{1,200}"},
                                     "ignore_eos": True, "min_tokens": 150, "max_tokens": 300}])
    c = outs[0].outputs[0]
    assert c.text in CHOICES and c.finish_reason == "stop" and c.token_ids[-1] == 2
    c = outs[1].outputs[0]  # the stop token is allowed once a letter is out, and then ends it
    assert re.fullmatch("[a-z]{1,200}", c.text) and c.finish_reason == "stop" and c.token_ids[-1] == 2


@needs_engine
def test_sampler_masks_only_constrained_rows(tiny):
    llm = make_llm(tiny)
    llm.engine.structured = None
    manager = grammar_mod.StructuredOutputManager(llm.tokenizer, 640, {2})
    manager.add(0, {"choice": ["yes"]})
    g = manager.get(0)
    logits = torch.randn(3, 640, generator=torch.Generator().manual_seed(0))
    ref = logits.clone()
    greedy = SamplingParams()
    out = Sampler()(logits, [SamplingRow(greedy, None), SamplingRow(greedy, None, grammar=g), SamplingRow(greedy, None)])
    assert torch.equal(logits[0], ref[0]) and torch.equal(logits[2], ref[2])
    assert out.token_ids[0] == int(ref[0].argmax()) and out.token_ids[2] == int(ref[2].argmax())
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert out.token_ids[1] in allowed and len(allowed) < 640
    assert not set(allowed) & SPECIAL_IDS


@needs_engine
def test_grammar_sync_rolls_back_and_feeds(tiny):
    tok = make_llm(tiny).tokenizer
    manager = grammar_mod.StructuredOutputManager(tok, 640, {2})
    manager.add(7, {"regex": "[a-z]+"})
    g = manager.get(7)
    ids = tok.encode("quick")
    g.sync(ids)
    assert g.num_accepted == len(ids)
    g.sync(ids[:1])  # as if the sequence had lost tokens: rolled back, not accepted again
    assert g.num_accepted == 1
    g.sync(ids)
    assert g.num_accepted == len(ids)
    twin = g.fork()
    twin.accept(tok.encode("x")[0])
    assert twin.num_accepted == g.num_accepted + 1


# ---- validation: the field's shape, per-line errors, the missing extra ---------------------------

@pytest.mark.parametrize("value, words", [
    ({"json": {}, "regex": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"jsn": {}}, 'unknown key "jsn"'),
    ({"choice": []}, "non-empty list"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json_object": False}, "must be true"),
    ("json", "must be an object"),
])
def test_bad_shape_is_a_field_error(value, words):
    with pytest.raises(PagedrunError, match=re.escape(words)) as e:
        SamplingParams.from_dict({"structured_outputs": value}, "prompts.jsonl:4")
    assert str(e.value).startswith("prompts.jsonl:4: structured_outputs: ")
    assert "\n" not in str(e.value)


@needs_engine
def test_uncompilable_schema_is_that_lines_error_record(tiny, tmp_path):
    llm = make_llm(tiny)
    p = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "a", "structured_outputs": {"json": {"type": "string", "not": {"const": "x"}}}},
             {"prompt": "b", "structured_outputs": {"regex": "(unclosed"}},
             {"prompt": "c", "structured_outputs": {"choice": ["x"]}}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    requests, invalid = llm.read_requests(p)  # without skip_invalid: records, not a failed run
    assert [r.id for r in requests] == ["3"]
    assert [i.line for i in invalid] == [1, 2]
    assert invalid[0].error.startswith("prompts.jsonl:1: structured_outputs: the grammar engine cannot compile")
    assert "not" in invalid[0].error and "\n" not in invalid[0].error
    p.write_text(json.dumps({"prompt": "a", "structured_outputs": {"json": {}, "choice": ["x"]}}) + "\n")
    with pytest.raises(PagedrunError, match=r"^prompts.jsonl:1: structured_outputs: must have exactly one"):
        llm.read_requests(p)


@needs_engine
def test_recipe_default_applies_to_every_line(tiny, tmp_path):
    llm = make_llm(tiny, 'sampling.structured_outputs={"choice": ["yes", "no"]}')
    outs = llm.generate(["a", "b", {"prompt": "c", "structured_outputs": None}])
    assert all(o.outputs[0].text in ("yes", "no") for o in outs[:2])


def test_without_the_extra_a_one_line_error_with_the_install_command(tiny, tmp_path, monkeypatch):
    llm = make_llm(tiny)
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "a", "structured_outputs": {"regex": "[0-9]{3}"}}) + "\n")
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # import llguidance fails
    monkeypatch.setattr(grammar_mod, "_compiled", {})
    with pytest.raises(PagedrunError) as e:
        llm.read_requests(p)
    assert str(e.value) == ("prompts.jsonl:1: structured_outputs: structured outputs need the grammar engine "
                            f"llguidance: {grammar_mod.INSTALL_HINT}")


@needs_engine
def test_penalties_and_logit_bias_keep_outputs_valid(tiny):
    # The mask comes first: a bias or penalty can reorder the allowed tokens, never unmask one.
    reqs = [dict(r, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={"5": 100.0, "300": 50.0})
            for r in requests_for(8)]
    assert_all_valid(make_llm(tiny).generate(reqs), 8)


def test_a_model_without_tokenizer_refuses_constraints(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m", seed=1)
    llm = make_llm(d)
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [5, 6], "structured_outputs": {"choice": ["a"]}}) + "\n")
    with pytest.raises(PagedrunError, match=r"^prompts.jsonl:1: structured_outputs: needs the model's tokenizer"):
        llm.read_requests(p)


@needs_engine
def test_openai_batch_response_format_becomes_a_constraint(tiny, tmp_path):
    from pagedrun.io.openai_batch import BatchJob
    from pagedrun.io.requests import read_requests

    def line(cid, fmt):
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lines = [line("s", {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
             line("o", {"type": "json_object"}), line("t", {"type": "text"}),
             line("bad", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})]
    p = tmp_path / "batch.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    tok = make_llm(tiny).tokenizer
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    requests, invalid = read_requests(p, tok, SamplingParams(), vocab_size=640, max_model_len=128, batch_job=job)
    assert [r.sampling.structured_outputs for r in requests] == [{"json": schema}, {"json_object": True}, None]
    assert [b.custom_id for b in invalid] == ["bad"]
    assert invalid[0].error.startswith("batch.jsonl:4: body.response_format: the grammar engine cannot compile")
