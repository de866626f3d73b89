"""Strict JSON Schemas by default, as xgrammar (structured/strict.py): no property a schema does not
name unless it allows them, no item past prefixItems; the recipe's and a request's
disable_additional_properties turn it off; an output cut by max_tokens says it is incomplete."""
from __future__ import annotations

import importlib.util
import json

import pytest
from tiny_models import make_tiny_model
from tiny_tokenizer import write_tiny_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.io.jsonl import output_record
from pagedrun.llm import LLM
from pagedrun.structured import grammar as grammar_mod
from pagedrun.structured.params import check_structured_outputs
from pagedrun.structured.strict import strict_schema

needs_engine = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                  reason='the optional extra: pip install -e ".[structured]"')
OPEN = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 4}}}


def test_strict_schema_closes_what_the_schema_leaves_open():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                          "c": {"type": "array", "prefixItems": [{"type": "string"}]},
                                          "d": {"type": "array", "items": [{"type": "string"}]}},
         "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
         "anyOf": [{"properties": {"a": {}}}]}
    out = strict_schema(s)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"] is False
    assert out["properties"]["d"]["additionalItems"] is False
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s and "items" not in s["properties"]["c"]  # the input is untouched


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"type": "object"},  # names no property: any object
    {"type": "array"},  # neither items nor prefixItems: any array
    {"type": "array", "prefixItems": [{}], "items": {"type": "integer"}},
    {"allOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}}}]},
])
def test_what_a_schema_says_it_allows_stays_allowed(schema):
    assert strict_schema(schema) == schema


def test_a_request_may_set_it_for_itself():
    spec = check_structured_outputs({"json": OPEN, "disable_additional_properties": False})
    assert spec["disable_additional_properties"] is False
    with pytest.raises(ValueError, match="disable_additional_properties must be true or false"):
        check_structured_outputs({"json": OPEN, "disable_additional_properties": "no"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama", seed=3)
    return write_tiny_tokenizer(d)


def accepts(manager, spec: dict, text: str) -> bool:
    manager.add(1, spec)
    g = manager.get(1)
    ids = manager.ll_tokenizer.tokenize_str(text)
    ok = all(g.accept(t) for t in ids) and g.matcher.is_accepting()
    manager.free(1)
    return ok


@needs_engine
def test_extra_keys_are_refused_when_strict_and_allowed_when_not(tiny):
    tok = LLM(load_recipe(None, [f"model.path={tiny}"])).tokenizer
    doc = '{"name":"ab","extra":1}'
    strict = grammar_mod.StructuredOutputManager(tok, 640, {2})
    assert not accepts(strict, {"json": OPEN}, doc)
    assert accepts(strict, {"json": OPEN}, '{"name":"ab"}')
    assert accepts(strict, {"json": OPEN, "disable_additional_properties": False}, doc)  # the request's own
    lenient = grammar_mod.StructuredOutputManager(tok, 640, {2}, strict=False)  # the recipe's false
    assert accepts(lenient, {"json": OPEN}, doc)
    assert not accepts(lenient, {"json": OPEN, "disable_additional_properties": True}, doc)
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]}
    assert accepts(strict, {"json": pair}, "[1,2]") and not accepts(strict, {"json": pair}, "[1,2,3]")
    assert accepts(lenient, {"json": pair}, "[1,2,3]")


@needs_engine
def test_the_recipe_key_reaches_the_engine_and_a_cut_output_says_it_is_incomplete(tiny):
    llm = LLM(load_recipe(None, [f"model.path={tiny}", "cache.block_size=8",
                                 "structured_outputs.disable_additional_properties=false"]))
    spec = {"json": OPEN, "disable_any_whitespace": True}
    outs = llm.generate([{"prompt": "cut", "structured_outputs": spec, "max_tokens": 3},
                         {"prompt": "whole", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 50},
                         {"prompt": "free", "max_tokens": 2, "ignore_eos": True}], use_tqdm=False)
    assert llm.engine.structured.strict is False
    cut, whole, free = (o.outputs[0] for o in outs)
    assert cut.finish_reason == "length" and cut.structured_output_incomplete
    assert output_record(outs[0])["structured_output_incomplete"] is True
    assert whole.finish_reason == "stop" and not whole.structured_output_incomplete
    assert free.finish_reason == "length" and not free.structured_output_incomplete  # no constraint
    assert "structured_output_incomplete" not in output_record(outs[1])
    assert "structured_output_incomplete" not in output_record(outs[2])
    json.dumps(output_record(outs[0]))


@needs_engine
def test_an_output_complete_exactly_at_max_tokens_is_not_incomplete(tiny):
    llm = LLM(load_recipe(None, [f"model.path={tiny}", "cache.block_size=8"]))
    ref = llm.generate([{"prompt": "p", "structured_outputs": {"choice": ["yes", "no"]}}], use_tqdm=False)
    n = len(ref[0].outputs[0].token_ids) - 1  # without the stop token: the choice is whole, the stop not sampled
    c = llm.generate([{"prompt": "p", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": n}],
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and c.text in ("yes", "no") and not c.structured_output_incomplete


def test_openai_json_schema_strict_false_is_the_lenient_mode():
    from pagedrun.io.openai_batch import BatchLineError, response_format_fields

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert response_format_fields(spec) == {"json": schema}  # the recipe's default: strict
    spec["json_schema"]["strict"] = True
    assert response_format_fields(spec) == {"json": schema}
    spec["json_schema"]["strict"] = False
    assert response_format_fields(spec) == {"json": schema, "disable_additional_properties": False}
    spec["json_schema"]["strict"] = "no"
    with pytest.raises(BatchLineError, match="json_schema.strict must be true or false"):
        response_format_fields(spec)
