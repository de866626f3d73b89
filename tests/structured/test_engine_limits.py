"""One request never kills the job (issue 40, item 1): a constraint that compiles but meets the grammar
engine's limits while it runs becomes that request's error record, the others run, and a resume goes
past it. The real limits (a{1000000}, a grammar with no finite derivation) and failures injected at
every place the engine touches a matcher (added, masked, fed, rolled back, forked), n > 1 and fan-out."""
from __future__ import annotations

import ctypes
import importlib.util
import json

import pytest
from tiny_models import make_tiny_model
from tiny_tokenizer import write_tiny_tokenizer
from typer.testing import CliRunner

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.structured import grammar as grammar_mod
from pagedrun.structured.grammar import Grammar, StructuredOutputManager

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                reason='the optional extra: pip install -e ".[structured]"')
GOOD = {"regex": "[0-9]{3}"}
MARKED = {"regex": "[0-9]{4}"}  # the requests whose matcher the injected failure hits
LIMITS = {
    "huge-repetition": {"regex": "a{1000000}"},  # the lexer builds too many states
    "no-finite-derivation": {"grammar": 'start: x\nx: "a" x'},  # the parser's item limit
}
GAVE_UP = "structured_outputs: the grammar engine gave up on this request after "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama", seed=3)
    return write_tiny_tokenizer(d)


def make_llm(model_dir, *sets) -> LLM:
    return LLM(load_recipe(None, [f"model.path={model_dir}", "sampling.max_tokens=12", "cache.block_size=8",
                                  *sets]))


def assert_good(o, digits: int = 3) -> None:
    assert o.error is None, o.error
    for c in o.outputs:
        assert c.finish_reason == "stop" and len(c.text) == digits and c.text.isdigit(), (c.finish_reason, c.text)


@pytest.mark.parametrize("limit", list(LIMITS))
def test_a_limit_met_mid_run_is_that_requests_error_record(tiny, limit):
    llm = make_llm(tiny)
    reqs = [{"prompt": f"r{i}", "structured_outputs": LIMITS[limit] if i in (1, 4) else GOOD} for i in range(6)]
    outs = llm.generate(reqs, use_tqdm=False)
    for i, o in enumerate(outs):
        if i in (1, 4):
            assert o.error.startswith(GAVE_UP) and "\n" not in o.error and o.outputs == [], o.error
        else:
            assert_good(o)
    assert llm.engine.kv.num_free_gpu_blocks == llm.engine.kv.num_gpu_blocks  # nothing leaked
    assert not llm.engine.structured.grammars


@pytest.mark.parametrize("n", [2000, 10_000])
def test_every_choice_list_the_validator_allows_runs(tiny, n):
    labels = [f"label {i}" for i in range(n)]
    outs = make_llm(tiny).generate([{"prompt": "x", "structured_outputs": {"choice": labels}}], use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].text in labels


def test_a_schema_that_never_closes_ends_by_length_or_error_never_the_run(tiny):
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
    spec = {"json": {"$defs": {"n": node}, "$ref": "#/$defs/n"}}
    outs = make_llm(tiny).generate([{"prompt": "x", "structured_outputs": spec}, {"prompt": "y",
                                    "structured_outputs": GOOD}], use_tqdm=False)
    assert outs[0].error is not None or outs[0].outputs[0].finish_reason == "length"
    assert_good(outs[1])


class Flaky:
    """A matcher whose `method` fails from its (after + 1)-th call on: `how` is "raise", "refuse"
    (consume_token returns False), "empty" (a mask with no token) or "error" (is_error turns True)."""

    def __init__(self, inner, method: str, after: int, how: str, calls: list | None = None) -> None:
        self._inner, self._method, self._after, self._how = inner, method, after, how
        self._calls = calls if calls is not None else [0]  # shared with forks

    def __getattr__(self, name):
        real = getattr(self._inner, name)
        if name == "deep_copy" and self._method != "deep_copy":
            return lambda: Flaky(real(), self._method, self._after, self._how, self._calls)
        if name != self._method:
            return real

        def call(*args):
            self._calls[0] += 1
            if self._calls[0] <= self._after:
                return real(*args)
            if self._how == "raise":
                raise RuntimeError("injected: limit exceeded\n<state>\nnoise")
            if self._how == "refuse":
                return False
            if self._how == "empty":
                real(*args)
                ctypes.memset(args[0], 0, args[1])
                return None
            return True  # is_error

        return call


INJECTED = [("add", 0, "raise"), ("unsafe_compute_mask_ptr", 0, "raise"), ("unsafe_compute_mask_ptr", 2, "raise"),
            ("unsafe_compute_mask_ptr", 1, "empty"), ("is_error", 0, "error"), ("consume_token", 0, "refuse"),
            ("consume_token", 2, "raise"), ("deep_copy", 0, "raise")]


@pytest.mark.parametrize("n", [1, 2, 5])  # 5 > max_num_seqs: a request fanned out into child groups
@pytest.mark.parametrize("where", INJECTED, ids=lambda w: f"{w[0]}-{w[1]}-{w[2]}")
def test_an_engine_failure_anywhere_fails_that_request_only(tiny, monkeypatch, where, n):
    method, after, how = where
    real_add = StructuredOutputManager.add

    def add(self, seq_id, spec):
        if spec == MARKED and method == "add":
            raise RuntimeError("injected: cannot build the matcher")
        real_add(self, seq_id, spec)
        if spec == MARKED:
            g = self.grammars[seq_id]
            self.grammars[seq_id] = Grammar(Flaky(g.matcher, method, after, how))

    monkeypatch.setattr(StructuredOutputManager, "add", add)
    monkeypatch.setattr(grammar_mod, "_compiled", {})
    llm = make_llm(tiny, "scheduler.max_num_seqs=4")
    reqs = [{"prompt": f"request {i}", "n": n, "seed": i, "structured_outputs": MARKED if i % 3 == 1 else GOOD}
            for i in range(7)]
    outs = llm.generate(reqs, use_tqdm=False)
    assert len(outs) == 7
    for i, o in enumerate(outs):
        if i % 3 != 1:
            assert_good(o)
            assert len(o.outputs) == n
        elif method == "deep_copy" and n != 2:  # a matcher is copied only to fork a prompt into n rows
            assert_good(o, digits=4)
        elif how == "error" or method in ("add", "deep_copy") or after == 0 or o.error is not None:
            # (a late failure may come after a short output finished: then it never fires)
            assert o.error is not None and o.error.startswith("structured_outputs: ") and "\n" not in o.error
            assert "<state>" not in o.error and o.outputs == []
    assert llm.engine.kv.num_free_gpu_blocks == llm.engine.kv.num_gpu_blocks
    assert llm.engine.structured is None or not llm.engine.structured.grammars
    assert not llm.engine.has_unfinished()


def test_sync_after_a_failed_rollback_records_and_feeds_nothing(tiny):
    llm = make_llm(tiny)
    llm.generate([{"prompt": "x", "structured_outputs": GOOD}], use_tqdm=False)  # builds the manager
    mgr = llm.engine.structured
    mgr.add(99, GOOD)
    g = mgr.grammars[99]
    g.matcher = Flaky(g.matcher, "rollback", 0, "raise")
    ok_tokens = [t for t in range(300) if llm.tokenizer.decode([t]) == "1"][:1] * 2
    g.sync(ok_tokens)
    assert g.num_accepted == 2 and g.error is None
    g.sync(ok_tokens[:1])  # a preemption rolled the sequence back: the engine refuses to roll
    assert g.error.startswith(GAVE_UP + "2 output tokens: injected: limit exceeded")
    g.sync(ok_tokens)
    assert g.num_accepted == 2 and not g.accept(ok_tokens[0])
    mgr.free(99)


def test_a_job_with_a_request_past_the_limits_finishes_and_its_resume_goes_past(tiny, tmp_path):
    from pagedrun.cli.app import app

    prompts = tmp_path / "p.jsonl"
    lines = [{"id": f"r{i}", "prompt": f"r{i}", "structured_outputs": GOOD} for i in range(5)]
    lines[1]["structured_outputs"] = LIMITS["huge-repetition"]
    lines[3]["structured_outputs"] = LIMITS["no-finite-derivation"]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(prompts), "-o", str(out), "--set", f"model.path={tiny}", "--set",
            "sampling.max_tokens=12", "--set", "cache.num_blocks=64"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 3 and "Traceback" not in res.output, res.output
    assert "2 of 5 requests failed" in res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(5)]
    assert [bool(r.get("error")) for r in recs] == [False, True, False, True, False]
    res = CliRunner().invoke(app, args)  # the resume: nothing left, the failures are records
    assert res.exit_code == 3 and "nothing to do: all 5 requests are in" in res.output, res.output


@pytest.mark.parametrize("depth", [300, 450])
@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_too_deep_to_check_is_that_lines_error(tiny, tmp_path, depth, as_text):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    spec = {"json": json.dumps(schema) if as_text else schema}
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "x", "structured_outputs": spec}) + "\n"
                 + json.dumps({"prompt": "y", "structured_outputs": GOOD}) + "\n")
    llm = make_llm(tiny)
    requests, invalid = llm.read_requests(p, skip_invalid=True)
    assert [r.line for r in requests] == [2] and [b.line for b in invalid] == [1]
    assert invalid[0].error.startswith("prompts.jsonl:1: ") and "\n" not in invalid[0].error
