"""Structured outputs on the real default model: the README's extraction example (32 extraction and
classification prompts, examples/extraction/) gives 100% valid outputs, and constrained greedy
decoding changes nothing while the unconstrained output is on the grammar's path."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from pagedrun.llm import LLM
from pagedrun.structured.grammar import StructuredOutputManager

LLMatcher = pytest.importorskip("llguidance", reason='the optional extra: pip install -e ".[structured]"').LLMatcher
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "extraction"


@pytest.mark.slow
def test_extraction_example_is_valid_and_follows_the_unconstrained_path():
    llm = LLM(EXAMPLE / "recipe.yaml", ["cache.block_size=16"])
    requests, invalid = llm.read_requests(EXAMPLE / "prompts.jsonl")
    assert len(requests) == 32 and not invalid
    free = copy.deepcopy(requests)
    for r in free:
        r.sampling.structured_outputs = None
    outs = llm.run(requests)
    ref = llm.run(free)  # same engine, same batch: the same logits wherever the tokens agree

    specials = set(llm.tokenizer.all_special_ids) - llm.engine.eos_token_ids
    check = StructuredOutputManager(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    on_path = 0
    for req, o, r in zip(requests, outs, ref):
        spec = req.sampling.structured_outputs
        c, u = o.outputs[0], r.outputs[0].token_ids
        assert c.finish_reason == "stop" and c.token_ids[-1] in llm.engine.eos_token_ids, (req.id, c.text)
        assert not specials & set(c.token_ids), (req.id, c.token_ids)
        if "json" in spec:
            jsonschema.validate(json.loads(c.text), spec["json"])
        else:
            assert c.text in spec["choice"]
        # The longest prefix of the unconstrained tokens the grammar accepts: greedy constrained
        # decoding must have produced exactly those tokens there (masking keeps an allowed argmax).
        check.add(0, spec)
        matcher = check.get(0).matcher
        k = matcher.try_consume_tokens(u)
        if k == len(u) - 1 and u[-1] in llm.engine.eos_token_ids and matcher.is_accepting():
            k = len(u)  # try_consume_tokens stops before the stop token; the grammar allows it here
        assert c.token_ids[:k] == u[:k], req.id
        assert k > 0, (req.id, "the one-shot prompt should start the unconstrained answer on the path")
        on_path += k == len(u)  # the whole unconstrained output is valid: nothing changed at all
    assert on_path >= 16


def test_schema_keywords_the_engine_cannot_enforce_are_refused():
    grammar = LLMatcher.grammar_from_json_schema({"type": "array", "uniqueItems": True})
    assert "uniqueItems" in LLMatcher.validate_grammar(grammar)


@pytest.mark.slow
def test_twelve_schemas_without_additional_properties_give_valid_json(default_model):
    """benchmarks/structured_strict.py's 12 extraction schemas, none saying additionalProperties: read
    strictly (the default) every output ends and validates, with no key its schema does not name; read
    by JSON Schema's rules 4 of them ran to max_tokens adding keys
    (docs/log/2026-11-28-strict-structured-outputs.md)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_strict.py"
    spec = importlib.util.spec_from_file_location("structured_strict", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(strict=True, max_tokens=256)
    assert len(rows) == 12
    for r in rows:
        assert r["valid"] and r["finish"] == "stop" and r["extra"] == 0 and not r["incomplete"], r
