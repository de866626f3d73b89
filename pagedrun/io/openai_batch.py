"""OpenAI Batch API files: an input line -> the fields of a pagedrun request; a finished request ->
the line the Batch API writes to its output file.

Input line:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
              "body": {...the request, OpenAI's field names...}}
Output line: {"id": "batch_req_...", "custom_id", "response": {"status_code": 200, "request_id",
              "body": <chat.completion | text_completion>}, "error": null}
             {"id", "custom_id", "response": {"status_code": 400 | 500, "request_id", "body": {"error":
              {"message", "type", "param", "code"}}}, "error": null}  (a failed request, as the Batch API
              writes one that the endpoint refused: the body is the endpoint's error object)

Choices, documented in README.md ("Running an OpenAI batch file"):
  * ids are derived from the job, not random: sha256 of the input file's content hash and the line's
    custom_id (or, for a line that cannot run, its line number), so a resumed or repeated run writes
    the same ids, and the output's `id` doubles as the resume key (io/writer.py);
  * `created` is the input file's modification time when the output was started: one value for every
    line of an output file, kept in its meta file, so a resume writes the same even if the input was
    touched meanwhile;
  * a body `model` other than the recipe's model runs anyway on the recipe's model (one warning for
    the file): batch files name hosted models, and the output's `model` says which one ran;
  * a field missing from the body takes the recipe's `sampling:` value (pagedrun's defaults:
    greedy, 256 tokens), not OpenAI's (temperature 1, 16 tokens for /v1/completions).
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pagedrun.errors import PagedrunError, clip, echo_json
from pagedrun.io.tokenize import CHAT_OPTIONS, LineError, check_chat_options
from pagedrun.sampling_params import FIELD_NAMES, GUIDED_ALIASES, InvalidValue, check_field, resolve_aliases

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")
ROLES = ("system", "user", "assistant", "developer")

# Body fields -> SamplingParams fields (OpenAI's and vLLM's names agree); vLLM's extra sampling fields
# are accepted as vLLM's server accepts them.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed", "stop": "stop",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias", "top_k": "top_k",
             "min_p": "min_p", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids", "prompt_logprobs": "prompt_logprobs",
             "include_stop_str_in_output": "include_stop_str_in_output", "skip_special_tokens": "skip_special_tokens",
             "spaces_between_special_tokens": "spaces_between_special_tokens",
             "truncate_prompt_tokens": "truncate_prompt_tokens", "allowed_token_ids": "allowed_token_ids",
             "bad_words": "bad_words"}
_IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options"})
# Fields that change what a response means; refused (per line) unless absent, null or one of their no-op
# values: what a client sends when it means "none of that" (no tools: tool_choice "none" or "auto",
# parallel_tool_calls either way; text out: modalities ["text"]).
_UNSUPPORTED: dict[str, tuple] = {
    "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "modalities": (["text"],), "prediction": (), "parallel_tool_calls": (True, False),
    "web_search_options": (), "reasoning_effort": (), "verbosity": (), "stream": (False,),
    "suffix": (), "best_of": (1,)}
# Keys of a message besides role and content: accepted when null or empty (an assistant message copied
# back from a response carries "refusal": null, "annotations": [], ...), refused otherwise.
_MESSAGE_NO_OP_KEYS = frozenset({"refusal", "tool_calls", "function_call", "audio", "annotations"})


def _is_no_op(value: Any, no_ops: tuple) -> bool:
    """None, or one of `no_ops` of the same type (True is not 1, False is not 0)."""
    return value is None or any(type(value) is type(x) and value == x for x in no_ops)
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "functions", "function_call", "audio", "modalities", "prediction",
                        "parallel_tool_calls", "web_search_options", "reasoning_effort", "verbosity"})
_CHAT_ONLY |= frozenset(CHAT_OPTIONS)  # the chat template's arguments (vLLM's chat endpoint takes them)
_COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})
_KNOWN = frozenset({*_SAMPLING, *_IGNORED, *_UNSUPPORTED, *CHAT_OPTIONS, *GUIDED_ALIASES, "messages", "prompt",
                    "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                    "structured_outputs", "echo"})
_CHAT_FIELDS = _KNOWN - _COMPLETIONS_ONLY
_COMPLETIONS_FIELDS = _KNOWN - _CHAT_ONLY


class BatchLineError(Exception):
    """A line that cannot run: `field` (a dotted path such as body.temperature) and the reason."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field, self.message = field, message


@dataclass
class BatchJob:
    """What every line of one batch file shares: the ids' seed, the model name, `created`."""
    input_sha256: str
    model: str
    created: int
    system_fingerprint: str | None = None

    def _hash(self, kind: str, value: str) -> str:
        return hashlib.sha256(f"{self.input_sha256}\0{kind}\0{value}".encode()).hexdigest()[:32]

    def line_id(self, custom_id: str) -> str:
        """`batch_req_...` of the line with this custom_id: the output's id and the resume key."""
        return "batch_req_" + self._hash("custom_id", custom_id)

    def error_line_id(self, line: int) -> str:
        """Of a line that cannot run (its custom_id may be missing or a duplicate's): by line number."""
        return "batch_req_" + self._hash("line", str(line))


@dataclass
class BatchLine:
    """The OpenAI side of one request, kept until its output line is written."""
    custom_id: str
    url: str
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False  # /v1/completions: the prompt's text before the completion's
    prompt_text: str | None = None  # with echo, the body's prompt when it was text


@dataclass
class BatchRequest:
    """A checked line in pagedrun's terms: the prompt (one of prompt / messages / prompt_token_ids) and
    SamplingParams overrides, before tokenization."""
    kind: str
    value: Any
    overrides: dict[str, Any]
    batch: BatchLine
    model: str | None  # the body's model, to warn once when it is not the recipe's
    chat: dict | None = None  # the chat template's arguments (io/tokenize.py check_chat_options)
    deprecated: str | None = None  # a legacy guided_* field the body used (one note per file)


def is_batch_line(obj: dict) -> bool:
    return any(k in obj for k in LINE_KEYS)


def custom_id_of(obj: dict) -> str | None:
    cid = obj.get("custom_id")
    return cid if isinstance(cid, str) and cid else None


def parse_batch_line(obj: dict) -> BatchRequest:
    """Check one line's envelope and body; raises BatchLineError naming the field."""
    for key in obj:
        if key not in LINE_KEYS:
            raise BatchLineError(clip(str(key)),
                                 'unknown field (a batch line has "custom_id", "method", "url", "body")')
    if custom_id_of(obj) is None:
        raise BatchLineError("custom_id", f"must be a non-empty string, got {echo_json(obj.get('custom_id'))}")
    if obj.get("method") != "POST":
        raise BatchLineError("method", f'must be "POST", got {echo_json(obj.get("method"))}')
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BatchLineError("url", f'must be "{CHAT_URL}" or "{COMPLETIONS_URL}", got {echo_json(url)}')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("body", f"must be an object, got {echo_json(body)}")
    chat = url == CHAT_URL
    allowed = _CHAT_FIELDS if chat else _COMPLETIONS_FIELDS
    if not body.keys() <= allowed:  # set operations first: most lines need no loop over their fields
        key = next(k for k in body if k not in allowed)  # the first in the line: the same error every run
        raise BatchLineError(f"body.{clip(str(key))}", f"not a field of {url}" if key in _KNOWN else "unknown field")
    if not body.keys().isdisjoint(_UNSUPPORTED):
        for key in body:
            if key in _UNSUPPORTED and not _is_no_op(body[key], _UNSUPPORTED[key]):
                raise BatchLineError(f"body.{key}", "not supported by pagedrun")
    overrides = _sampling_overrides(body, chat)
    batch = BatchLine(custom_id=obj["custom_id"], url=url)
    options = None
    if chat:
        _chat_logprobs(body, batch, overrides)
        _response_format(body.get("response_format"), overrides)
        if "messages" not in body:
            raise BatchLineError("body.messages", "missing")
        kind, value = "messages", _messages(body["messages"])
        try:
            options = check_chat_options(body, "body.") or None
        except LineError as e:
            raise BatchLineError(e.field, e.message) from None
    else:
        lp = body.get("logprobs")
        if lp is not None:
            overrides["logprobs"] = _checked("body.logprobs", "logprobs", lp)
            batch.logprobs, batch.top_logprobs = True, lp
        echo = body.get("echo")
        if echo is not None:
            if not isinstance(echo, bool):
                raise BatchLineError("body.echo", f"must be true or false, got {echo_json(echo)}")
            if echo and lp is not None:
                raise BatchLineError("body.echo", "with logprobs is not supported by pagedrun (ask prompt_logprobs "
                                                  "for the prompt's)")
            batch.echo = echo
        if "prompt" not in body:
            raise BatchLineError("body.prompt", "missing")
        kind, value = _prompt(body["prompt"])
        if batch.echo and kind == "prompt":
            batch.prompt_text = value
    deprecated = _structured_fields(body, overrides)
    model = body.get("model")
    return BatchRequest(kind, value, overrides, batch, model if isinstance(model, str) else None, options, deprecated)


def _structured_fields(body: dict, overrides: dict) -> str | None:
    """vLLM's body fields structured_outputs and (legacy) guided_*: one constraint per request, with
    response_format; returns the legacy name used, if any."""
    given = {k: body[k] for k in ("structured_outputs", *GUIDED_ALIASES) if body.get(k) is not None}
    if not given:
        return None
    if "structured_outputs" in overrides or len(given) > 1:
        names = [*given] + (["response_format"] if "structured_outputs" in overrides else [])
        raise BatchLineError(f"body.{names[0]}", f"give one of {', '.join(names)} (one constraint per request)")
    try:
        (name, value), = resolve_aliases(given, "").items()
    except PagedrunError as e:  # cannot happen with one key; kept for the message's shape
        raise BatchLineError("body.structured_outputs", str(e)) from None
    key = next(iter(given))
    overrides["structured_outputs"] = _checked(f"body.{key}", "structured_outputs", value)
    return key if key in GUIDED_ALIASES else None


def _checked(where: str, name: str, value: Any) -> Any:
    if name not in FIELD_NAMES:
        raise BatchLineError(where, f"needs {name} in the sampler, not supported yet")
    try:
        return check_field(name, value)
    except InvalidValue as e:
        raise BatchLineError(where, f"{e}, got {echo_json(value)}") from None


def _sampling_overrides(body: dict, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in _SAMPLING.items():
        if key in body and body[key] is not None:
            out[name] = _checked(f"body.{key}", name, body[key])
    # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; both are read.
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if body.get(key) is not None:
            out["max_tokens"] = _checked(f"body.{key}", "max_tokens", body[key])
            break
    return out


def _chat_logprobs(body: dict, batch: BatchLine, overrides: dict) -> None:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise BatchLineError("body.logprobs", f"must be true or false, got {echo_json(lp)}")
    if top is not None:
        if not lp:
            raise BatchLineError("body.top_logprobs", "needs logprobs: true")
        top = _checked("body.top_logprobs", "logprobs", top)
    if lp:
        batch.logprobs, batch.top_logprobs = True, top or 0
        overrides["logprobs"] = batch.top_logprobs


def response_format_fields(fmt: Any) -> dict | None:
    """OpenAI's response_format -> SamplingParams.structured_outputs (vLLM's shape); None for text."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BatchLineError("body.response_format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise BatchLineError("body.response_format", 'json_schema needs {"json_schema": {"name", "schema": {...}}}')
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BatchLineError("body.response_format", f"json_schema.strict must be true or false, got {strict!r}")
    if strict is False:  # OpenAI's own switch: the schema's rules only, extra properties where it allows them
        return {"json": spec["schema"], "disable_additional_properties": False}
    return {"json": spec["schema"]}


def _response_format(fmt: Any, overrides: dict) -> None:
    if fmt is None:
        return
    structured = response_format_fields(fmt)
    if structured is None:
        return
    overrides["structured_outputs"] = _checked("body.response_format", "structured_outputs", structured)


def _messages(messages: Any) -> list[dict]:
    """OpenAI messages -> {"role", "content": str} for the chat template (text parts joined by newlines,
    as vLLM does; a developer message is the system message of models that predate the role)."""
    if not isinstance(messages, list) or not messages:
        raise BatchLineError("body.messages", 'must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise BatchLineError(where, f"must be an object, got {echo_json(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise BatchLineError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {echo_json(role)}")
        for key in m:
            if key not in ("role", "content", "name") and not (key in _MESSAGE_NO_OP_KEYS and m[key] in (None, [])):
                raise BatchLineError(f"{where}.{clip(str(key))}", "not supported by pagedrun")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BatchLineError(f"{where}.content[{j}]", 'only {"type": "text", "text": str} parts are supported')
            texts.append(part["text"])
        return "\n".join(texts)
    raise BatchLineError(f"{where}.content", f"must be a string or a list of text parts, got {echo_json(content)}")


def _prompt(prompt: Any) -> tuple[str, Any]:
    if isinstance(prompt, str):
        return "prompt", prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "prompt_token_ids", prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt(prompt[0])
    raise BatchLineError("body.prompt", "must be a string or a list of token ids (one prompt per line), "
                                        f"got {echo_json(prompt)}")


# ---- output lines ----------------------------------------------------------------------------
# A finished request -> the Batch API's output line (chat.completion or text_completion body).
#
# The shapes are the `openai` package's (tests validate every body with openai.types.chat.ChatCompletion
# and openai.types.Completion). Token strings are the tokenizer's decoding of the one token; `bytes`
# are the token's own bytes (_TokenText), so that joining them rebuilds the text even where a token holds
# part of a character. Logprobs cover the text's tokens: not the stop token that ended the completion
# (EOS, a stop_token_ids entry), which the text leaves out too. A completion's text_offset counts
# characters from the start of its generated text (pagedrun never echoes the prompt).

# OpenAI's finish reasons are stop | length (| content_filter, tool_calls): pagedrun's own stop
# reasons (a stop string, a stop token id, EOS) are all "stop".
_FINISH = {"length": "length"}


def output_line(o, batch: BatchLine, job: BatchJob, tokenizer: Any) -> dict:
    """The output line of a finished RequestOutput `o` (outputs.py) of line `batch`."""
    line_id = job.line_id(batch.custom_id)
    if o.error is not None:
        return error_line(line_id, batch.custom_id, "request_failed", o.error)
    chat = batch.url == CHAT_URL
    tokens = _TokenText(tokenizer)
    prompt_logprobs = _prompt_logprobs(o.prompt_logprob_entries, tokens) if o.prompt_logprob_entries is not None \
        else None
    echo = ""
    if batch.echo:  # vLLM's: the prompt as given (text), else its tokens decoded
        echo = batch.prompt_text if batch.prompt_text is not None else \
            (tokenizer.decode(o.prompt_token_ids) if tokenizer is not None else "")
    choices = []
    for c in o.outputs:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": _FINISH.get(c.finish_reason, "stop"),
                                  "logprobs": None, "stop_reason": c.stop_reason}
        if getattr(c, "structured_output_incomplete", False):  # cut by max_tokens inside its structure
            choice["structured_output_incomplete"] = True
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text, "refusal": None}
            if batch.logprobs:
                choice["logprobs"] = {"content": [_chat_logprob(e, tokens) for e in _text_entries(c)],
                                      "refusal": None}
        else:
            choice["text"] = echo + c.text
            if batch.logprobs:
                choice["logprobs"] = _completion_logprobs(_text_entries(c), tokens)
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in o.outputs)
    prompt_tokens = len(o.prompt_token_ids)
    suffix = line_id.removeprefix("batch_req_")
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + suffix,
        "object": "chat.completion" if chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": o.num_cached_prompt_tokens}},
        "system_fingerprint": job.system_fingerprint,
    }
    if chat and prompt_logprobs is not None:  # vLLM's chat response holds them at its top level
        body["prompt_logprobs"] = prompt_logprobs
    return {"id": line_id, "custom_id": batch.custom_id,
            "response": {"status_code": 200, "request_id": "req_" + suffix, "body": body}, "error": None}


# "file:line: body.field: why" -> the field, OpenAI's `param` (messages, body.messages[0].role -> messages)
_PARAM = re.compile(r"^[^:]*:\d+: body\.([A-Za-z_]+)")


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> dict:
    """A request that failed, in the Batch API's shape for one its endpoint refused: status 400 and an
    invalid_request_error for a line that cannot run (code context_length_exceeded for a prompt too long,
    else null), 500 and a server_error for one that failed while it ran (code request_failed).
    `custom_id` is null only when the input line has no readable one."""
    failed_running = code == "request_failed"
    param = _PARAM.match(message)
    error = {"message": message, "type": "server_error" if failed_running else "invalid_request_error",
             "param": param.group(1) if param else None, "code": code if code != "invalid_request" else None}
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 500 if failed_running else 400,
                         "request_id": "req_" + line_id.removeprefix("batch_req_"), "body": {"error": error}},
            "error": None}


def is_failed_line(record: dict) -> bool:
    """An output line of a request that failed: its response's status is not 200 (or, from pagedrun before
    failed lines took the Batch API's shape, its `error` is set)."""
    response = record.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    return record.get("error") is not None or (status is not None and status != 200)


def _text_entries(c) -> list[dict]:
    """A completion's logprob entries less the stop token that ended it (EOS: stop_reason None; a stop
    token id: an int), which its text does not hold (the chat template's end-of-turn, for one)."""
    entries = c.logprobs or []
    ended_on_token = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
    if ended_on_token and entries and c.token_ids and entries[-1]["token_id"] == c.token_ids[-1]:
        return entries[:-1]
    return entries


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level vocabulary writes -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class _TokenText:
    """Token id -> its text and its bytes, once per id (a completion repeats tokens; top-N lists more so).

    The text is the tokenizer's decoding of the one token: a token holding part of a character (an emoji's
    first bytes) decodes to U+FFFD. Its bytes come from its vocabulary entry instead: a byte-level
    vocabulary's characters map back to bytes, a byte-fallback piece <0xE2> is that byte; other tokens
    (whole characters) are their text's UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        self.byte_of = _byte_decoder() if self.byte_level else {}

    def __call__(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        got = self.cache.get(token_id)
        if got is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id])
            got = self.cache[token_id] = (text, self._bytes(token_id, text))
        return got

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self.tokenizer is None or "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level and all(ch in self.byte_of for ch in piece):
                return [self.byte_of[ch] for ch in piece]
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))


def _chat_logprob(entry: dict, tokens: _TokenText) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text, raw = tokens.entry(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {**one(entry["token_id"], entry["logprob"]), "top_logprobs": [one(t, lp) for t, lp in entry["top"]]}


def _prompt_logprobs(entries: list, tokens: _TokenText) -> list:
    """vLLM's server shape: per prompt token None (the first) or {token id (a string): {"logprob",
    "rank", "decoded_token"}} for the prompt's token and the top-N."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": tokens(t)} for r, (t, lp) in enumerate(e["top"])}
        d[str(e["token_id"])] = {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": tokens(e["token_id"])}
        out.append(d)
    return out


def _completion_logprobs(entries: list[dict], tokens: _TokenText) -> dict:
    texts = [tokens(e["token_id"]) for e in entries]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokens(t): lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}
