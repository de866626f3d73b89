"""OpenAI Batch API files: an input line -> the fields of a pagedrun request (the output lines are
io/batch_output.py's).

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

import hashlib
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
