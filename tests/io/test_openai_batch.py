"""OpenAI Batch API files in, the Batch API's output lines out: every body checked with the `openai`
package's own types, every line with a strict model of the documented shape; per-line errors;
resume; the example under examples/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Completion  # the dev extra's: a real client's types, not our reading of the docs
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict
from tiny_models import add_word_tokenizer, make_tiny_model
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.errors import PagedrunError
from pagedrun.io.openai_batch import BatchJob
from pagedrun.io.requests import read_requests
from pagedrun.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "capital", "of", "France", "is", "Paris", "be", "brief", "hello"]
SETS = ["cache.num_blocks=128", "model.max_model_len=128", "scheduler.max_num_seqs=4"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LineError(_Strict):
    code: str
    message: str


class LineResponse(_Strict):
    status_code: int
    request_id: str
    body: dict


class OutputLine(_Strict):
    """One line of a Batch API output file, as OpenAI documents it."""
    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None


def check_line(raw: dict) -> OutputLine:
    """A line as the Batch API writes it: a response (200 and the endpoint's body, or 400/500 and its error
    object, checked with the SDK's ErrorObject) and a null `error` (kept for batch-level failures)."""
    line = OutputLine.model_validate(raw)
    assert line.id.startswith("batch_req_")
    assert line.response is not None and line.error is None
    assert line.response.request_id == "req_" + line.id.removeprefix("batch_req_")
    body = line.response.body
    if line.response.status_code != 200:
        assert line.response.status_code in (400, 500) and set(body) == {"error"}
        err = ErrorObject.model_validate(body["error"])
        assert not err.model_extra and "\n" not in err.message
        assert err.type == ("server_error" if line.response.status_code == 500 else "invalid_request_error")
        return line
    cls = ChatCompletion if body["object"] == "chat.completion" else Completion
    parsed = cls.model_validate(body)
    # Nothing unknown but vLLM's own additions: a choice's stop_reason, prompt_logprobs (a completion's
    # choice, a chat response's top level), as vLLM's server writes them; and pagedrun's one flag on a
    # constrained choice cut by max_tokens (structured_output_incomplete).
    assert set(parsed.model_extra) <= {"prompt_logprobs"}
    assert all(set(c.model_extra) <= {"stop_reason", "prompt_logprobs", "structured_output_incomplete"}
               and "stop_reason" in c.model_extra
               for c in parsed.choices)
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    return line


def batch_line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id: str, text: str = "the capital of France is", **body) -> dict:
    return batch_line(custom_id, messages=[{"role": "user", "content": text}], **body)


def completion(custom_id: str, prompt="the capital of France is", **body) -> dict:
    return batch_line(custom_id, "/v1/completions", prompt=prompt, **body)


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("batch") / "model")
    return add_word_tokenizer(path, WORDS)


def invoke(model: Path, prompts: Path, out: Path, *extra: str):
    args = ["generate", str(prompts), "-o", str(out), "-q", "--set", f"model.path={model}", *extra]
    for s in SETS:
        args += ["--set", s]
    return CliRunner().invoke(app, args)


# ---------------------------------------------------------------- per-line checks (no model)

def read(path: Path, **kw):
    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    tok = kw.pop("tokenizer", None)
    return read_requests(path, tok, SamplingParams(), vocab_size=640, max_model_len=128, batch_job=job, **kw)


@pytest.mark.parametrize("line, message", [
    (batch_line("a", "/v1/embeddings", input="x"),
     'url: must be "/v1/chat/completions" or "/v1/completions", got "/v1/embeddings"'),
    (chat("a", tools="x"), "body.tools: must be a list of tool objects"),
    (chat("a", chat_template_kwargs=[1]), "body.chat_template_kwargs: must be an object of template variables"),
    (chat("a", add_generation_prompt=True, continue_final_message=True),
     "body.continue_final_message: excludes add_generation_prompt: true (give one)"),
    (chat("a", guided_regex="a+", guided_choice=["b"]),
     "body.guided_regex: give one of guided_regex, guided_choice (one constraint per request)"),
    (chat("a", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "body.structured_outputs: give one of structured_outputs, response_format (one constraint per request)"),
    (chat("a", guided_json=5), "body.guided_json: json must be a JSON Schema object, got {\"json\": 5}"),
    (completion("a", echo=1), "body.echo: must be true or false, got 1"),
    (completion("a", echo=True, logprobs=1), "body.echo: with logprobs is not supported by pagedrun (ask "
                                             "prompt_logprobs for the prompt's)"),
    (completion("a", prompt_logprobs=50), "body.prompt_logprobs: must be an integer in 0..20 or null, got 50"),
    (completion("a", bad_words=[1]), "body.bad_words: must be a list of non-empty strings, got [1]"),
    (completion("a", chat_template="x"), "body.chat_template: not a field of /v1/completions"),
    (chat("a", stream=True), "body.stream: not supported by pagedrun"),
    (chat("a", frobnicate=1), "body.frobnicate: unknown field"),
    (chat("a", temperature=-1), "body.temperature: must be a number >= 0 (0 = greedy), got -1"),
    (chat("a", max_completion_tokens=0), "body.max_completion_tokens: must be an integer >= 1, got 0"),
    (chat("a", top_logprobs=3), "body.top_logprobs: needs logprobs: true"),
    (completion("a", messages=[]), "body.messages: not a field of /v1/completions"),
    (completion("a", prompt=["x", "y"]), "body.prompt: must be a string or a list of token ids (one prompt "
                                         'per line), got ["x", "y"]'),
    ({**chat("a"), "method": "GET"}, 'method: must be "POST", got "GET"'),
    ({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}},
     'custom_id: must be a non-empty string, got ""'),
    (batch_line("a", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     'body.messages[0].content[0]: only {"type": "text", "text": str} parts are supported'),
    (batch_line("a", messages=[{"role": "tool", "content": "x"}]),
     "body.messages[0].role: must be one of system, user, assistant, developer, got \"tool\""),
    (chat("a", response_format={"type": "json_object"}),
     "body.response_format: needs the model's tokenizer (grammars are matched on text); this model has none"),
])
def test_a_bad_line_is_one_error_naming_file_line_and_field(tmp_path, line, message):
    p = write(tmp_path / "batch.jsonl", [completion("ok", prompt=[5, 6]), line])
    with pytest.raises(PagedrunError) as e:
        read(p)
    assert str(e.value) == f"batch.jsonl:2: {message}"
    requests, invalid = read(p, skip_invalid=True)  # the other lines still run
    assert [r.batch.custom_id for r in requests] == ["ok"] and [b.line for b in invalid] == [2]
    assert invalid[0].custom_id == (line["custom_id"] or None) and invalid[0].code == "invalid_request"


def test_duplicate_custom_id_and_mixed_formats_are_per_line_errors(tmp_path):
    p = write(tmp_path / "batch.jsonl", [completion("a", prompt=[5]), completion("a", prompt=[6]),
                                         {"prompt_token_ids": [7]}, completion("b", prompt=[8])])
    requests, invalid = read(p, skip_invalid=True)
    assert [r.batch.custom_id for r in requests] == ["a", "b"]
    assert [b.error for b in invalid] == [
        "batch.jsonl:2: custom_id: duplicate custom_id 'a' (first used on line 1)",
        "batch.jsonl:3: a pagedrun JSONL line in an OpenAI batch file (line 1 decided the format; one format "
        "per file)"]
    assert len({b.id for b in invalid} | {r.id for r in requests}) == 4  # every line its own output id
    # A pagedrun file is decided by its first line just the same.
    q = write(tmp_path / "p.jsonl", [{"prompt_token_ids": [5]}, completion("a", prompt=[6])])
    _, invalid = read(q, skip_invalid=True)
    assert invalid[0].error == ("p.jsonl:2: an OpenAI batch line in a pagedrun JSONL file (line 1 decided the "
                                "format; one format per file)")


def test_body_fields_map_onto_sampling_params(tmp_path):
    p = write(tmp_path / "batch.jsonl", [
        chat("c", max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, seed=3, stop="x",
             logprobs=True, top_logprobs=2, user="u", metadata={"k": "v"}, store=False, model="gpt-4o-mini"),
        completion("d", prompt=[5, 6], max_tokens=4, logprobs=3, stop=["a", "b"], presence_penalty=0.5,
                   frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"7": -100, "9": 2.5}),
    ])
    (c, d), invalid = read(p, tokenizer=_tokenizer(tmp_path))
    assert not invalid
    s = c.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.seed, s.stop, s.logprobs) == (7, 0.5, 0.9, 2, 3, ["x"], 2)
    assert c.batch.logprobs and c.batch.top_logprobs == 2 and c.messages == [{"role": "user",
                                                                              "content": "the capital of France is"}]
    assert d.prompt_token_ids == [5, 6] and (d.sampling.max_tokens, d.sampling.logprobs) == (4, 3)
    assert (d.sampling.presence_penalty, d.sampling.frequency_penalty, d.sampling.repetition_penalty,
            d.sampling.logit_bias) == (0.5, -1.0, 1.2, {7: -100.0, 9: 2.5})


def _tokenizer(tmp_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(add_word_tokenizer(tmp_path / "tok", WORDS)))


# ---------------------------------------------------------------- whole runs

def test_batch_run_writes_the_batch_apis_lines_in_input_order(model, tmp_path):
    lines = [
        chat("chat-greedy", max_completion_tokens=6, logprobs=True, top_logprobs=2, model="gpt-4o-mini"),
        completion("completion-n2", max_tokens=5, logprobs=2, n=2, temperature=0.8, seed=7),
        batch_line("bad-url", "/v1/embeddings", input="x"),
        chat("chat-greedy", max_completion_tokens=3),  # duplicate custom_id
        chat("tools", tools="x"),
        completion("tokens", prompt=[5, 6, 7], max_tokens=4),
        completion("too-long", prompt=" ".join(["the"] * 200), max_tokens=4),  # found when tokenized
        "{not json",
    ]
    prompts = write(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = invoke(model, prompts, out, "--skip-invalid")
    assert result.exit_code == 3, result.output  # some lines failed
    got = records(out)
    parsed = [check_line(r) for r in got]
    assert [r["custom_id"] for r in got] == ["chat-greedy", "completion-n2", "bad-url", "chat-greedy", "tools",
                                             "tokens", "too-long", None]
    assert [p.response.status_code for p in parsed] == [200, 200, 400, 400, 400, 200, 400, 400]
    assert len({p.id for p in parsed}) == len(lines)
    errors = {i: got[i]["response"]["body"]["error"] for i in (2, 3, 4, 6, 7)}
    assert errors[4]["message"] == "batch.jsonl:5: body.tools: must be a list of tool objects"
    assert (errors[4]["param"], errors[4]["code"]) == ("tools", None)
    assert (errors[6]["param"], errors[6]["code"]) == ("prompt", "context_length_exceeded")
    assert errors[6]["message"].startswith("batch.jsonl:7: body.prompt: prompt has 201 tokens")
    assert errors[7]["message"].startswith("batch.jsonl:8: invalid JSON") and errors[7]["param"] is None

    chat_body = ChatCompletion.model_validate(got[0]["response"]["body"])
    assert chat_body.object == "chat.completion" and chat_body.id.startswith("chatcmpl-")
    assert chat_body.model == "model"  # the recipe's model ran, whatever the body asked for
    content = chat_body.choices[0].logprobs.content
    assert len(content) == chat_body.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    assert content[0].logprob == max(x.logprob for x in content[0].top_logprobs)  # greedy: the top token

    comp = Completion.model_validate(got[1]["response"]["body"])
    assert comp.object == "text_completion" and [c.index for c in comp.choices] == [0, 1]
    for c in comp.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    # The same prompt as a pagedrun line gives the same greedy tokens: one engine, two formats.
    plain = write(tmp_path / "plain.jsonl", [{"id": "x", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}])
    assert invoke(model, plain, tmp_path / "plain.out.jsonl").exit_code == 0
    assert records(tmp_path / "plain.out.jsonl")[0]["text"] == got[5]["response"]["body"]["choices"][0]["text"]

    # Ids and `created` derive from the job: a fresh run writes the same bytes.
    before = out.read_bytes()
    again = invoke(model, prompts, out, "--skip-invalid", "--overwrite")
    assert again.exit_code == 3 and out.read_bytes() == before


def test_penalties_and_logit_bias_of_a_batch_line_reach_the_sampler(model, tmp_path):
    from transformers import AutoTokenizer

    paris = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("Paris")
    prompts = write(tmp_path / "batch.jsonl", [
        chat("biased", max_completion_tokens=3, logit_bias={str(paris): 100}),
        completion("penalised", max_tokens=6, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
        completion("plain", max_tokens=6),
        chat("bad", logit_bias={"5": 101}),
    ])
    out = tmp_path / "out.jsonl"
    assert invoke(model, prompts, out, "--skip-invalid").exit_code == 3
    got = records(out)
    for r in got:
        check_line(r)
    assert got[0]["response"]["body"]["choices"][0]["message"]["content"] == "Paris Paris Paris"
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in got[1:3])
    assert got[3]["response"]["body"]["error"]["message"] == (
        "batch.jsonl:4: body.logit_bias: must map token ids to biases in "
        "[-100, 100]; 5 -> 101, got {\"5\": 101}")


def test_without_skip_invalid_a_bad_line_stops_before_the_model_loads(model, tmp_path, monkeypatch):
    from pagedrun import llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(llm.LLM, "__init__", no_load)
    prompts = write(tmp_path / "batch.jsonl", [chat("a"), chat("b", stream=True)])
    out = tmp_path / "out.jsonl"
    result = invoke(model, prompts, out)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert "batch.jsonl:2: body.stream: not supported by pagedrun" in result.stderr
    assert not out.exists()


@pytest.mark.slow


def test_an_interrupted_batch_run_resumes_to_the_same_bytes(model, tmp_path):
    prompts = write(tmp_path / "batch.jsonl", [completion(f"r{i}", prompt=[5 + i, 6, 7], max_tokens=3)
                                               if i % 2 else chat(f"r{i}", max_completion_tokens=3)
                                               for i in range(10)] + [batch_line("bad", "/v1/x")])
    full = tmp_path / "full.jsonl"
    assert invoke(model, prompts, full, "--skip-invalid").exit_code == 3
    expected = full.read_bytes()
    # As a killed run leaves it: some lines out of order, then a torn one.
    out = tmp_path / "out.jsonl"
    assert invoke(model, prompts, out, "--skip-invalid").exit_code == 3
    kept = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join([kept[7], kept[2], kept[10]]) + kept[4][:40])
    result = invoke(model, prompts, out, "--skip-invalid")
    assert result.exit_code == 3, result.output
    assert out.read_bytes() == expected


@pytest.mark.slow


def test_the_example_batch_file_runs(tmp_path):
    example = ROOT / "examples" / "openai_batch.jsonl"
    out = tmp_path / "out.jsonl"
    args = ["generate", str(example), "-o", str(out), "-q", "--set", "cache.num_blocks=256"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = [check_line(r) for r in records(out)]
    inputs = [json.loads(x) for x in example.read_text().splitlines() if x.strip()]
    assert [g.custom_id for g in got] == [x["custom_id"] for x in inputs]
    assert all(g.error is None and g.response.status_code == 200 and g.response.body["choices"] for g in got)


@pytest.mark.parametrize("how", ["touched", "meta_without_created"])
@pytest.mark.parametrize("keep", [1, 5])
def test_created_is_one_value_per_output_file(model, tmp_path, how, keep):
    """Issue 40, item 9: `created` changed within one output file when the input's mtime moved between a
    run and its resume. It is fixed by the run that started OUT (kept in OUT.meta.json)."""
    import os

    prompts = write(tmp_path / "batch.jsonl", [completion(f"r{i}", prompt=[5 + i, 6], max_tokens=2) for i in range(6)]
                    + [batch_line("bad", "/v1/x")])
    os.utime(prompts, (1_700_000_000, 1_700_000_000))
    out = tmp_path / "out.jsonl"
    assert invoke(model, prompts, out, "--skip-invalid").exit_code == 3
    kept = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(kept[:keep]))  # as an interrupted run leaves it
    meta = out.with_name("out.jsonl.meta.json")
    assert json.loads(meta.read_text())["created"] == 1_700_000_000
    if how == "meta_without_created":  # written by an earlier pagedrun: the kept records say it
        m = json.loads(meta.read_text())
        del m["created"]
        meta.write_text(json.dumps(m))
    os.utime(prompts, (1_800_000_000, 1_800_000_000))  # touched (copied, synced) before the resume
    assert invoke(model, prompts, out, "--skip-invalid").exit_code == 3
    got = records(out)
    assert len(got) == 7
    assert {r["response"]["body"]["created"] for r in got if r["response"]["status_code"] == 200} == {1_700_000_000}
    assert json.loads(meta.read_text())["created"] == 1_700_000_000
    # --overwrite starts a new file: the input's mtime now.
    assert invoke(model, prompts, out, "--skip-invalid", "--overwrite").exit_code == 3
    created = {r["response"]["body"]["created"] for r in records(out) if r["response"]["status_code"] == 200}
    assert created == {1_800_000_000}


@pytest.mark.parametrize("code, message, status, param", [
    ("invalid_request", "batch.jsonl:3: body.tools: not supported by pagedrun", 400, "tools"),
    ("invalid_request", "batch.jsonl:3: body.messages[0].role: must be one of ...", 400, "messages"),
    ("invalid_request", "batch.jsonl:12: invalid JSON: Expecting value", 400, None),
    ("invalid_request", "batch.jsonl:4: url: must be ...", 400, None),
    ("context_length_exceeded", "batch.jsonl:9: body.prompt: prompt has 201 tokens", 400, "prompt"),
    ("request_failed", "structured_outputs: the grammar engine gave up on this request after 3 output tokens", 500,
     None),
])
def test_failed_lines_take_the_batch_apis_shape(code, message, status, param):
    from pagedrun.io.batch_output import error_line, is_failed_line
    from pagedrun.io.writer import is_error_record

    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    for custom_id in ("a", None):
        line = error_line(job.error_line_id(3), custom_id, code, message)
        checked = check_line(line)
        assert checked.response.status_code == status and checked.custom_id == custom_id
        err = line["response"]["body"]["error"]
        assert err["param"] == param and err["message"] == message
        assert err["code"] == (None if code == "invalid_request" else code)
        assert is_failed_line(line) and is_error_record(line)
    old_shape = {"id": "batch_req_x", "custom_id": "a", "response": None, "error": {"code": "c", "message": "m"}}
    assert is_error_record(old_shape)  # an output started by an earlier pagedrun resumes with its errors counted


def one_chat_line(tmp_path, line: dict, **kw):
    return read(write(tmp_path / "batch.jsonl", [line]), skip_invalid=True, **kw)


NO_OPS = [dict(tool_choice="none"), dict(tool_choice="auto"), dict(tool_choice=None), dict(parallel_tool_calls=False),
          dict(parallel_tool_calls=True), dict(tools=[]), dict(functions=[]), dict(function_call="none"),
          dict(modalities=["text"]), dict(stream=False), dict(audio=None),
          dict(tool_choice="none", parallel_tool_calls=False, tools=[])]
MEANINGFUL = [dict(tool_choice="required"), dict(tool_choice={"type": "function", "function": {"name": "f"}}),
              dict(parallel_tool_calls=0), dict(parallel_tool_calls="false"),
              dict(modalities=["text", "audio"]), dict(stream=True), dict(stream=0), dict(function_call="f")]


@pytest.mark.parametrize("body", NO_OPS, ids=lambda b: json.dumps(b))
def test_no_op_values_of_unsupported_fields_are_accepted(tmp_path, body):
    requests, invalid = one_chat_line(tmp_path, chat("a", **body), tokenizer=_template_tokenizer())
    assert not invalid and len(requests) == 1


@pytest.mark.parametrize("body", MEANINGFUL, ids=lambda b: json.dumps(b))
def test_meaningful_values_of_unsupported_fields_are_refused(tmp_path, body):
    requests, invalid = one_chat_line(tmp_path, chat("a", **body), tokenizer=_template_tokenizer())
    (bad,) = invalid
    assert bad.error == f"batch.jsonl:1: body.{next(iter(body))}: not supported by pagedrun"


@pytest.mark.parametrize("extra, ok", [({"refusal": None}, True), ({"refusal": None, "annotations": []}, True),
                                       ({"tool_calls": []}, True), ({"tool_calls": None, "audio": None}, True),
                                       ({"refusal": "I can't"}, False), ({"tool_calls": [{"id": "x"}]}, False),
                                       ({"refusal": False}, False), ({"annotations": [{"type": "url"}]}, False)])
def test_null_message_fields_are_accepted(tmp_path, extra, ok):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the", **extra},
                {"role": "user", "content": "be brief"}]
    requests, invalid = one_chat_line(tmp_path, batch_line("a", messages=messages), tokenizer=_template_tokenizer())
    assert (len(requests), len(invalid)) == ((1, 0) if ok else (0, 1))
    if not ok:
        assert invalid[0].error == f"batch.jsonl:1: body.messages[1].{next(iter(extra))}: not supported by pagedrun"


_TOKENIZER = []


def _template_tokenizer():
    """The word tokenizer with a chat template (tests/tiny_models.py), built once."""
    if not _TOKENIZER:
        import tempfile

        from transformers import AutoTokenizer

        d = Path(tempfile.mkdtemp())
        add_word_tokenizer(d, WORDS)
        _TOKENIZER.append(AutoTokenizer.from_pretrained(str(d)))
    return _TOKENIZER[0]


# ---------------------------------------------------------------- logprobs: bytes and the stop token

TEXTS = ["😀", "héllo 😀 wörld", "日本語のテキスト", "a😀b🎉c", "naïve café ✓"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A byte-level BPE tokenizer trained on ASCII only: every non-ASCII character is split into byte tokens."""
    from tiny_tokenizer import write_tiny_tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(write_tiny_tokenizer(tmp_path_factory.mktemp("bl"))))


def finished(token_ids, finish_reason="length", stop_reason=None, top=2):
    from pagedrun.outputs import CompletionOutput, RequestOutput

    entries = [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5], [3, -2.0]][:top]} for t in token_ids]
    return RequestOutput("r", 0, [5, 6], [CompletionOutput(0, "", list(token_ids), finish_reason, stop_reason,
                                                           entries)])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("ending", ["length", "eos", "stop_token", "stop_string"])
def test_chat_logprob_bytes_rebuild_the_text_and_skip_the_stop_token(byte_level, text, ending):
    from pagedrun.io.batch_output import output_line
    from pagedrun.io.openai_batch import BatchLine

    ids = byte_level.encode(text, add_special_tokens=False)
    assert any("\ufffd" in byte_level.decode([t]) for t in ids) or text.isascii()  # split characters
    eos = byte_level.convert_tokens_to_ids("</s>")
    tail, reason, stop = {"length": ([], "length", None), "eos": ([eos], "stop", None),
                          "stop_token": ([7], "stop", 7), "stop_string": ([], "stop", "x")}[ending]
    o = finished(ids + tail, reason, stop)
    o.outputs[0].text = text
    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    line = output_line(o, BatchLine(custom_id="a", url="/v1/chat/completions", logprobs=True, top_logprobs=2),
                       job, byte_level)
    check_line(line)
    content = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)  # no entry for the end-of-turn / stop token
    assert bytes(b for e in content for b in e["bytes"]) == text.encode()
    for e in content:  # top_logprobs' bytes are their tokens' own too (the first is the sampled token)
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]


def test_completion_logprobs_skip_the_stop_token(byte_level):
    from pagedrun.io.batch_output import output_line
    from pagedrun.io.openai_batch import BatchLine

    ids = byte_level.encode("hello world", add_special_tokens=False)
    eos = byte_level.convert_tokens_to_ids("</s>")
    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    line = output_line(finished(ids + [eos], "stop", None), BatchLine(custom_id="a", url="/v1/completions",
                                                                        logprobs=True, top_logprobs=2), job, byte_level)
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "</s>" not in lp["tokens"]


# ---------------------------------------------------------------- vLLM's body fields (issue 39)

def test_vllm_body_fields_echo_prompt_logprobs_stop_reason_cached_tokens(model, tmp_path):
    ids = list(range(10, 30))  # 20 tokens: one full block of 16 shared by the two lines after it
    lines = [
        completion("echo", echo=True, max_tokens=3),
        completion("plp", prompt=[5, 6, 7, 8], prompt_logprobs=2, max_tokens=2),
        completion("first", prompt=ids, max_tokens=2),
        completion("again", prompt=ids[:18], max_tokens=2, skip_special_tokens=False, bad_words=["Paris"]),
        chat("plp-chat", max_completion_tokens=2, prompt_logprobs=1, chat_template_kwargs={"x": 1}),
    ]
    out = tmp_path / "out.jsonl"
    result = invoke(model, write(tmp_path / "batch.jsonl", lines), out)
    assert result.exit_code == 0, result.output
    got = {r["custom_id"]: r["response"]["body"] for r in records(out)}
    for r in records(out):
        check_line(r)
    echo = got["echo"]["choices"][0]
    assert echo["text"].startswith("the capital of France is") and echo["stop_reason"] is None
    plp = got["plp"]["choices"][0]["prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None
    for j in (1, 2, 3):
        own = plp[j][str([5, 6, 7, 8][j])]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert 2 <= len(plp[j]) <= 3  # the top 2, and the prompt's token when it is not among them
    assert got["again"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert got["echo"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chat_plp = got["plp-chat"]["prompt_logprobs"]
    assert chat_plp[0] is None and len(chat_plp) == got["plp-chat"]["usage"]["prompt_tokens"]


def test_structured_outputs_and_legacy_guided_fields_in_a_body(tmp_path):
    from pagedrun.io.requests import LineChecker

    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    checker = LineChecker("batch.jsonl", SamplingParams(), vocab_size=640, tokenizer=None, batch_job=job)
    line = completion("a", prompt=[5], structured_outputs={"regex": "a+"})
    with pytest.raises(Exception, match="needs the model's tokenizer"):  # a constraint is read, then needs text
        checker.check(json.dumps(line).encode(), 1)
    from pagedrun.io.openai_batch import parse_batch_line

    assert parse_batch_line(completion("a", guided_regex="a+")).overrides["structured_outputs"] == {"regex": "a+"}
    req = parse_batch_line(chat("b", guided_json={"type": "object"}))
    assert req.overrides["structured_outputs"] == {"json": {"type": "object"}} and req.deprecated == "guided_json"
    assert parse_batch_line(chat("c", structured_outputs={"choice": ["x"]})).deprecated is None
    req = parse_batch_line(chat("d", chat_template_kwargs={"enable_thinking": False}, tools=[{"type": "function"}],
                                continue_final_message=True))
    assert req.chat == {"chat_template_kwargs": {"enable_thinking": False}, "tools": [{"type": "function"}],
                        "continue_final_message": True, "add_generation_prompt": False}


@pytest.mark.parametrize("incomplete", [False, True])
def test_a_cut_structured_output_says_so_in_the_batch_line(byte_level, incomplete):
    from pagedrun.io.batch_output import output_line
    from pagedrun.io.openai_batch import BatchLine

    o = finished([5, 6, 7], "length")
    o.outputs[0].structured_output_incomplete = incomplete
    job = BatchJob(input_sha256="0" * 64, model="m", created=1)
    line = output_line(o, BatchLine(custom_id="a", url="/v1/chat/completions"), job, byte_level)
    check_line(line)
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice.get("structured_output_incomplete", False) is incomplete
