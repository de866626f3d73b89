"""Reading a prompts file into Requests, checked line by line before any work starts.

Two formats, decided by the file's first JSON object (one format per file; a line of the other one
is an error naming it). pagedrun's own: one JSON object per line (blank lines skipped), exactly one of
    {"id"?: str|int, "prompt": str}
    {"id"?: str|int, "messages": [{"role": str, "content": str}, ...]}   (the model's chat template)
    {"id"?: str|int, "prompt_token_ids": [int, ...]}
plus any SamplingParams field (vLLM names) at the top level, overriding the recipe's `sampling:`.
Or an OpenAI Batch API file, {"custom_id", "method", "url", "body"} per line (io/openai_batch.py).

Errors are one line, `prompts.jsonl:7: temperature: must be ..., got -1`. With skip_invalid=True a
bad line becomes an InvalidRequest (an error record in the outputs) and the rest still runs. A prompt
too long for max_model_len is always an InvalidRequest: one long document must not stop a batch.

A line is checked in two stages: LineChecker.check (JSON, fields, values, unique ids: cheap, no
tokenizer work) and tokenize (io/tokenize.py: bounded by max_model_len). read_requests does both
for every line up front; io/stream.py checks the whole file first and tokenizes in a window
ahead of the engine. Nesting deeper than Python's recursion limit is an "invalid JSON" error; values
quoted in errors are cut (pagedrun/errors.py).
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedrun.errors import PagedrunError, clip, echo, echo_json
from pagedrun.io import openai_batch
from pagedrun.io.id_table import IdTable, request_key
from pagedrun.io.input_files import read_input
from pagedrun.io.openai_batch import BatchJob, BatchLine, BatchLineError
from pagedrun.io.tokenize import (
    CHAT_OPTIONS,
    LineError,
    TooLong,
    check_chat_options,
    check_vocab,
    need_tokenizer,
    token_ids,
)
from pagedrun.sampling_params import FIELD_NAMES, GUIDED_ALIASES, SamplingParams, is_int, merged
from pagedrun.structured.grammar import compile_spec, llguidance_module

_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_KNOWN_KEYS = ("id", *_PROMPT_KEYS, *FIELD_NAMES, *GUIDED_ALIASES, *CHAT_OPTIONS)
_SAMPLING_KEYS = frozenset((*FIELD_NAMES, *GUIDED_ALIASES))
JSONL, OPENAI = "jsonl", "openai"
_MERGED_CACHE = 1024  # distinct sets of sampling overrides remembered per file
_SCALARS = (int, float, str, bool, type(None))


@dataclass
class Request:
    id: str
    line: int  # 1-based line in the file
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    batch: BatchLine | None = None  # a batch-file line's OpenAI side (its output line's shape)
    chat: dict | None = None  # the chat-template arguments of a messages line


@dataclass
class InvalidRequest:
    """A line that cannot run; becomes an error record in the outputs."""
    id: str
    line: int
    error: str
    code: str = "invalid_request"  # OpenAI's error code (a batch file's output line)
    custom_id: str | None = None  # a batch file's line, when it has a readable custom_id


@dataclass
class LineSpec:
    """A checked line before tokenization: the prompt in one of the three kinds, its sampling."""
    id: str
    line: int
    kind: str  # prompt | messages | prompt_token_ids
    value: Any
    sampling: SamplingParams
    batch: BatchLine | None = None
    model: str | None = None  # a batch line's body.model
    chat: dict | None = None  # a messages line's chat-template arguments (io/tokenize.py check_chat_options)


class Unrunnable(LineError):
    """This request's own problem found after the file was checked (a constraint the grammar engine
    refuses): an error record even without skip_invalid, as a prompt over max_model_len."""


class FormatRefused(PagedrunError):
    """The whole file is in a format this reader cannot answer (an OpenAI batch file without a BatchJob):
    one error for the file, never an error record per line."""


class LineFailure(Exception):
    """A line that cannot run: `message` is the whole one-line error (file:line: field: why)."""

    def __init__(self, bad: InvalidRequest, too_long: bool = False) -> None:
        super().__init__(bad.error)
        self.bad, self.too_long = bad, too_long


def read_requests(path: Path, tokenizer: Any, defaults: SamplingParams, *, vocab_size: int,
                  max_model_len: int, skip_invalid: bool = False, batch_job: BatchJob | None = None,
                  ) -> tuple[list[Request], list[InvalidRequest]]:
    """Parse, check and tokenize every line; returns the requests and the lines that cannot run, in
    file order. `tokenizer` is a Hugging Face tokenizer, or None for models without one (then only
    prompt_token_ids lines are valid). Without `batch_job` an OpenAI batch file is refused."""
    path = Path(path)
    data = read_input(path, "prompts")
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM some editors write
        data = data[3:]
    checker = LineChecker(path.name, defaults, vocab_size=vocab_size, tokenizer=tokenizer, batch_job=batch_job)
    requests: list[Request] = []
    invalid: list[InvalidRequest] = []
    seen_any = False
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        seen_any = True
        try:
            requests.append(checker.tokenize(checker.check(raw, lineno), max_model_len))
        except LineFailure as e:
            if not (skip_invalid or e.too_long):
                raise PagedrunError(str(e)) from None
            invalid.append(e.bad)
    if not seen_any:
        raise PagedrunError(f"{path.name}: no requests")
    return requests, invalid


class LineChecker:
    """Checks the lines of one file in order: the file's format, each line's fields, unique ids."""

    def __init__(self, name: str, defaults: SamplingParams, *, vocab_size: int, tokenizer: Any,
                 batch_job: BatchJob | None = None, unique_ids: bool = True) -> None:
        """unique_ids=False: no id table (a later pass over lines whose ids were checked already)."""
        self.name, self.defaults, self.vocab_size, self.tokenizer = name, defaults, vocab_size, tokenizer
        self.batch_job, self.unique_ids = batch_job, unique_ids
        self.format: str | None = None
        self.format_line = 0
        # Each id seen -> the line that first used it: 16 bytes and a number per line, no object
        # (io/id_table.py; a dict of the ids took ~150 bytes a line).
        self.first_line_of_id = IdTable(columns=1)
        self.other_models: dict[str, int] = {}  # a batch body's model other than the recipe's -> first line
        self.deprecated: dict[str, int] = {}  # a legacy field used (guided_json, ...) -> its first line
        self._merged: dict[Any, SamplingParams] = {}  # overrides (a tuple or JSON) -> their checked params
        if defaults.structured_outputs is not None:  # the recipe's constraint: every line's problem
            problem = compile_spec(defaults.structured_outputs)[1]
            if problem is not None:
                raise PagedrunError(f"sampling.structured_outputs: {problem}")

    def check(self, raw: bytes, lineno: int) -> LineSpec:
        """The checked line; raises LineFailure."""
        rid, custom_id = str(lineno), None  # until the line's own id is known
        try:
            obj = _parse_line(raw)
            fmt = OPENAI if openai_batch.is_batch_line(obj) else JSONL
            if self.format is None:
                self.format, self.format_line = fmt, lineno
                if fmt == OPENAI and self.batch_job is None:
                    raise FormatRefused(f"{self.name}:{lineno}: an OpenAI batch file: `pagedrun generate` (without "
                                        "--ray) and `pagedrun profile-memory --prompts` read these")
            if fmt != self.format:
                raise LineError(None, f"{_LINE_NAMES[fmt]} in {_FILE_NAMES[self.format]} (line "
                                      f"{self.format_line} decided the format; one format per file)")
            if fmt == OPENAI:
                custom_id = openai_batch.custom_id_of(obj)
                spec = self._check_batch(obj, lineno)
            else:
                rid = _request_id(obj, lineno)
                spec = self._check_jsonl(obj, rid, lineno)
            id_field = "custom_id" if fmt == OPENAI else "id"
            shown = custom_id if fmt == OPENAI else rid
            if not self.unique_ids:
                return spec
            ids = self.first_line_of_id
            e = ids.find(request_key(spec.id))
            if e >= 0:
                raise LineError(id_field, f"duplicate {id_field} {echo(shown)} "
                                          f"(first used on line {ids.values[0][e]})")
            ids.values[0][ids.add(request_key(spec.id))] = lineno
            return spec
        except FormatRefused:
            raise
        except (LineError, BatchLineError) as e:
            field = f" {e.field}:" if e.field else ""
            message = f"{self.name}:{lineno}:{field} {e.message}"
        except PagedrunError as e:  # from SamplingParams: already "prompts.jsonl:7: field: ..."
            message = str(e)
        except RecursionError:  # a value nested deeper than any check can walk: this line's problem alone
            message = f"{self.name}:{lineno}: nested too deeply to check (a schema or value hundreds of levels deep)"
        if self.format == JSONL and self.unique_ids:
            e = self.first_line_of_id.add(request_key(rid))  # a later line may not reuse an error record's id
            if not self.first_line_of_id.values[0][e]:
                self.first_line_of_id.values[0][e] = lineno
        elif self.format == OPENAI:  # e.g. a pagedrun line in a batch file: its own kind of id
            rid = self.batch_job.error_line_id(lineno)
        raise LineFailure(InvalidRequest(id=rid, line=lineno, error=message, custom_id=custom_id))

    def tokenize(self, spec: LineSpec, max_model_len: int) -> Request:
        """The line's Request; raises LineFailure (too_long=True for a prompt over max_model_len)."""
        try:
            if spec.sampling.structured_outputs is not None:
                # Compiled now (once per distinct constraint): a schema the engine refuses is this
                # line's error record, not a failure mid-run.
                problem = compile_spec(spec.sampling.structured_outputs)[1]
                if problem is not None:
                    raise Unrunnable(_structured_field(spec.batch is not None), problem)
            keep = spec.sampling.truncate_prompt_tokens  # vLLM's: the prompt's last k tokens
            if keep == -1:  # vLLM's "as many as the model takes": leave room for one generated token
                keep = max_model_len - 1
            if spec.kind == "prompt_token_ids":
                ids = spec.value
            else:
                # Truncated prompts are tokenized whole (the cut is at the start), as vLLM does.
                ids = token_ids(spec.kind, spec.value, self.tokenizer, max_model_len if keep is None else 1 << 40,
                                chat=spec.chat)
                if not ids:
                    raise LineError(spec.kind, "empty prompt (no tokens after tokenization)")
                check_vocab(ids, self.vocab_size, spec.kind)
            if keep is not None:
                ids = ids[-keep:]
            if len(ids) > max_model_len - 1:  # leave room for at least one generated token
                raise TooLong(spec.kind, f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}"
                                         f" (a prompt may have at most {max_model_len - 1})")
        except LineError as e:
            field = e.field if isinstance(e, Unrunnable) else _batch_field(spec.kind) if spec.batch else spec.kind
            bad = InvalidRequest(id=spec.id, line=spec.line, error=f"{self.name}:{spec.line}: {field}: {e.message}",
                                 code="context_length_exceeded" if isinstance(e, TooLong) else "invalid_request",
                                 custom_id=spec.batch.custom_id if spec.batch is not None else None)
            raise LineFailure(bad, too_long=isinstance(e, (TooLong, Unrunnable))) from None
        return Request(id=spec.id, line=spec.line, prompt_token_ids=list(ids), sampling=spec.sampling,
                       prompt=spec.value if spec.kind == "prompt" else None, chat=spec.chat,
                       messages=spec.value if spec.kind == "messages" else None, batch=spec.batch)

    def _check_jsonl(self, obj: dict[str, Any], rid: str, lineno: int) -> LineSpec:
        for key in obj:
            if key not in _KNOWN_KEYS:
                close = difflib.get_close_matches(key, _KNOWN_KEYS, n=1) if len(key) <= 64 else []
                raise LineError(clip(key), "unknown field" + (f" (did you mean {close[0]}?)" if close else ""))
        given = [k for k in _PROMPT_KEYS if k in obj]
        if not given:
            raise LineError("prompt", 'missing: each line needs one of "prompt", "messages", "prompt_token_ids"')
        if len(given) > 1:
            raise LineError(", ".join(given), 'give only one of "prompt", "messages", "prompt_token_ids"')
        kind = given[0]
        overrides = {k: v for k, v in obj.items() if k in _SAMPLING_KEYS}
        sampling = self._sampling(overrides, lineno, "structured_outputs")
        chat = check_chat_options(obj)
        if chat and kind != "messages":
            raise LineError(next(k for k in CHAT_OPTIONS if k in chat), 'only with "messages" (a chat template '
                                                                          "argument)")
        value = obj[kind]
        if kind == "prompt_token_ids":
            value = _check_token_ids(value, self.vocab_size)
        elif kind == "prompt":
            if not isinstance(value, str):
                raise LineError(kind, f"must be a string, got {_json_type(value)}")
            if not value:
                raise LineError(kind, "empty prompt")
        else:
            value = _check_messages(value)
        self._check_tokenizer(kind, chat)
        return LineSpec(rid, lineno, kind, value, sampling, chat=chat or None)

    def _check_batch(self, obj: dict[str, Any], lineno: int) -> LineSpec:
        req = openai_batch.parse_batch_line(obj)
        sampling = self._sampling(req.overrides, lineno, "body.response_format")
        value = req.value
        if req.kind == "prompt_token_ids":
            try:
                value = _check_token_ids(value, self.vocab_size)
            except LineError as e:
                raise LineError("body.prompt", e.message) from None
        elif not value:
            raise LineError(_batch_field(req.kind), "empty prompt")
        try:
            self._check_tokenizer(req.kind, req.chat)
        except LineError as e:
            raise LineError(_batch_field(req.kind), e.message) from None
        if req.model is not None and req.model != self.batch_job.model:
            self.other_models.setdefault(req.model, lineno)
        if req.deprecated is not None:
            self.deprecated.setdefault(req.deprecated, lineno)
        return LineSpec(self.batch_job.line_id(req.batch.custom_id), lineno, req.kind, value, sampling,
                        batch=req.batch, model=req.model, chat=req.chat)

    def _sampling(self, overrides: dict[str, Any], lineno: int, structured_field: str) -> SamplingParams:
        # Building SamplingParams is most of a line's check
        # (docs/log/2026-11-27-figures-from-code-comments.md): lines of a large file mostly repeat a
        # few sets of overrides, which share one (nothing mutates a request's params).
        key: Any = None
        if all(type(v) in _SCALARS for v in overrides.values()):  # the type too: True is not 1 here
            key = tuple(sorted((k, type(v), v) for k, v in overrides.items()))
        else:
            try:
                key = json.dumps(overrides, sort_keys=True)
            except (TypeError, ValueError):  # not JSON (a Python caller's values): checked, not shared
                pass
        for name in GUIDED_ALIASES:
            if name in overrides:
                self.deprecated.setdefault(name, lineno)
        sampling = self._merged.get(key) if key is not None else None
        if sampling is None:
            sampling = merged(self.defaults, overrides, where=f"{self.name}:{lineno}")
            if key is not None:
                if len(self._merged) >= _MERGED_CACHE:
                    self._merged.clear()
                self._merged[key] = sampling
        for i, t in enumerate(sampling.stop_token_ids):
            if t >= self.vocab_size:
                raise LineError("stop_token_ids", f"token id {t} at index {i} is outside [0, {self.vocab_size})")
        for t in sampling.logit_bias:
            if t >= self.vocab_size:
                raise LineError("logit_bias", f"token id {t} is outside [0, {self.vocab_size})")
        for i, t in enumerate(sampling.allowed_token_ids or ()):
            if t >= self.vocab_size:
                raise LineError("allowed_token_ids", f"token id {t} at index {i} is outside [0, {self.vocab_size})")
        if sampling.bad_words and self.tokenizer is None:
            raise LineError("bad_words", "needs the model's tokenizer (words are tokenized); this model has none")
        if sampling.structured_outputs is not None:  # the file's problems, before the model loads
            if self.tokenizer is None:
                raise LineError(structured_field, "needs the model's tokenizer (grammars are matched on "
                                                  "text); this model has none")
            try:
                llguidance_module()
            except PagedrunError as e:  # the command that installs the grammar engine
                raise LineError(structured_field, str(e)) from None
        return sampling

    def _check_tokenizer(self, kind: str, chat: dict | None = None) -> None:
        if kind == "prompt_token_ids":
            return
        need_tokenizer(self.tokenizer, kind)
        if kind == "messages" and not (chat or {}).get("chat_template") \
                and not getattr(self.tokenizer, "chat_template", None):
            raise LineError("messages", "the model's tokenizer has no chat template; use prompt")


_LINE_NAMES = {JSONL: "a pagedrun JSONL line", OPENAI: "an OpenAI batch line"}
_FILE_NAMES = {JSONL: "a pagedrun JSONL file", OPENAI: "an OpenAI batch file"}


def _structured_field(batch: bool) -> str:
    return "body.response_format" if batch else "structured_outputs"


def _batch_field(kind: str) -> str:
    return "body.messages" if kind == "messages" else "body.prompt"


def _parse_line(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(None, f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise LineError(None, "invalid JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise LineError(None, f"invalid JSON: {' '.join(str(e).split()[:12])}") from None
    if not isinstance(obj, dict):
        raise LineError(None, f"must be a JSON object, got {_json_type(obj)}")
    return obj


def _request_id(obj: dict[str, Any], lineno: int) -> str:
    if "id" not in obj:
        return str(lineno)
    rid = obj["id"]
    if isinstance(rid, str) and rid.strip():
        return rid
    if is_int(rid):
        return str(rid)
    raise LineError("id", f"must be a non-empty string or an integer, got {echo_json(rid)}")


def _check_token_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list):
        raise LineError("prompt_token_ids", f"must be a list of integers, got {_json_type(ids)}")
    if not ids:
        raise LineError("prompt_token_ids", "empty prompt")
    for i, t in enumerate(ids):
        if not is_int(t):
            raise LineError("prompt_token_ids", f"must be a list of integers; index {i} is {echo_json(t)}")
        if not 0 <= t < vocab_size:
            raise LineError("prompt_token_ids", f"token id {t} at index {i} is outside [0, {vocab_size})")
    return list(ids)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise LineError("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LineError("messages", f"item {i} must be an object, got {_json_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str) or (key == "role" and not m[key]):
                raise LineError("messages", f'item {i} needs a string "{key}"')
    return messages


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"
