"""Reading prompts.jsonl into Requests, checked line by line before any work starts.

One JSON object per line (blank lines skipped), exactly one of
    {"id"?: str|int, "prompt": str}
    {"id"?: str|int, "messages": [{"role": str, "content": str}, ...]}   (the model's chat template)
    {"id"?: str|int, "prompt_token_ids": [int, ...]}
plus any SamplingParams field (vLLM names) at the top level, overriding the recipe's `sampling:`.

Errors are one line, `prompts.jsonl:7: temperature: must be ..., got -1`. With skip_invalid=True a
bad line becomes an InvalidRequest (an error record in the outputs) and the rest still runs. A prompt
too long for max_model_len is always an InvalidRequest: one long document must not stop a batch.

Work per line is bounded by what the model can take, not by what the file holds: text longer than
max_model_len tokens of the longest vocabulary entry cannot fit, so at most that many characters are
tokenized; nesting deeper than Python's recursion limit is an "invalid JSON" error; values quoted in
errors are cut (pagedrun/echo.py). Every token id, given or tokenized, is checked against the
model's vocabulary: a tokenizer larger than the model is refused here, not by an IndexError mid-run.
"""
from __future__ import annotations

import difflib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedrun.echo import clip, echo, echo_json
from pagedrun.errors import PagedrunError
from pagedrun.input_files import read_input
from pagedrun.sampling_params import FIELD_NAMES, SamplingParams, is_int, merged
from pagedrun.structured.grammar import compile_spec

_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_KNOWN_KEYS = ("id", *_PROMPT_KEYS, *FIELD_NAMES)


@dataclass
class Request:
    id: str
    line: int  # 1-based line in the file
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None


@dataclass
class InvalidRequest:
    """A line that cannot run; becomes an error record in the outputs."""
    id: str
    line: int
    error: str


class _LineError(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        self.field, self.message = field, message


class _OneRequest(_LineError):
    """This request's own problem, not the file's: an error record even without skip_invalid."""


class _TooLong(_OneRequest):
    """A prompt longer than max_model_len allows."""


def read_requests(path: Path, tokenizer: Any, defaults: SamplingParams, *, vocab_size: int,
                  max_model_len: int, skip_invalid: bool = False,
                  ) -> tuple[list[Request], list[InvalidRequest]]:
    """Parse and check every line; returns the requests and the lines that cannot run, in file order.

    `tokenizer` is a Hugging Face tokenizer, or None for models without one (then only
    prompt_token_ids lines are valid).
    """
    path = Path(path)
    name = path.name
    data = read_input(path, "prompts")
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM some editors write
        data = data[3:]

    if defaults.structured_outputs is not None:  # the recipe's constraint: every line's problem
        problem = compile_spec(defaults.structured_outputs)[1]
        if problem is not None:
            raise PagedrunError(f"recipe: sampling.structured_outputs: {problem}")
    requests: list[Request] = []
    invalid: list[InvalidRequest] = []
    first_line_of_id: dict[str, int] = {}
    seen_any = False
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        seen_any = True
        rid = str(lineno)  # until the line's own id is known
        try:
            obj = _parse_line(raw)
            rid = _request_id(obj, lineno)
            if rid in first_line_of_id:
                raise _LineError("id", f"duplicate id {echo(rid)} (first used on line {first_line_of_id[rid]})")
            first_line_of_id[rid] = lineno
            request = _build_request(obj, rid, lineno, name, tokenizer, defaults, vocab_size, max_model_len)
        except _OneRequest as e:
            invalid.append(InvalidRequest(id=rid, line=lineno, error=f"{name}:{lineno}: {e.field}: {e.message}"))
            continue
        except _LineError as e:
            field = f" {e.field}:" if e.field else ""
            message = f"{name}:{lineno}:{field} {e.message}"
            if not skip_invalid:
                raise PagedrunError(message) from None
            first_line_of_id.setdefault(rid, lineno)  # a later line may not reuse an error record's id
            invalid.append(InvalidRequest(id=rid, line=lineno, error=message))
            continue
        except PagedrunError as e:  # from SamplingParams: already "prompts.jsonl:7: field: ..."
            if not skip_invalid:
                raise
            first_line_of_id.setdefault(rid, lineno)
            invalid.append(InvalidRequest(id=rid, line=lineno, error=str(e)))
            continue
        requests.append(request)
    if not seen_any:
        raise PagedrunError(f"{name}: no requests")
    return requests, invalid


def _parse_line(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _LineError(None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _LineError(None, f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise _LineError(None, "invalid JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise _LineError(None, f"invalid JSON: {' '.join(str(e).split()[:12])}") from None
    if not isinstance(obj, dict):
        raise _LineError(None, f"must be a JSON object, got {_json_type(obj)}")
    return obj


def _request_id(obj: dict[str, Any], lineno: int) -> str:
    if "id" not in obj:
        return str(lineno)
    rid = obj["id"]
    if isinstance(rid, str) and rid.strip():
        return rid
    if is_int(rid):
        return str(rid)
    raise _LineError("id", f"must be a non-empty string or an integer, got {echo_json(rid)}")


def _build_request(obj: dict[str, Any], rid: str, lineno: int, name: str, tokenizer: Any,
                   defaults: SamplingParams, vocab_size: int, max_model_len: int) -> Request:
    """The line's Request; raises _TooLong when its prompt leaves no room for one generated token."""
    for key in obj:
        if key not in _KNOWN_KEYS:
            close = difflib.get_close_matches(key, _KNOWN_KEYS, n=1) if len(key) <= 64 else []
            raise _LineError(clip(key), "unknown field" + (f" (did you mean {close[0]}?)" if close else ""))
    given = [k for k in _PROMPT_KEYS if k in obj]
    if not given:
        raise _LineError("prompt", 'missing: each line needs one of "prompt", "messages", "prompt_token_ids"')
    if len(given) > 1:
        raise _LineError(", ".join(given), 'give only one of "prompt", "messages", "prompt_token_ids"')
    kind = given[0]

    overrides = {k: v for k, v in obj.items() if k in FIELD_NAMES}
    sampling = merged(defaults, overrides, where=f"{name}:{lineno}")
    for i, t in enumerate(sampling.stop_token_ids):
        if t >= vocab_size:
            raise _LineError("stop_token_ids", f"token id {t} at index {i} is outside [0, {vocab_size})")
    for t in sampling.logit_bias:
        if t >= vocab_size:
            raise _LineError("logit_bias", f"token id {t} is outside [0, {vocab_size})")
    if sampling.structured_outputs is not None:
        _check_structured(sampling.structured_outputs, tokenizer)

    prompt: str | None = None
    messages: list[dict] | None = None
    if kind == "prompt_token_ids":
        ids = _check_token_ids(obj[kind], vocab_size)
    elif kind == "prompt":
        prompt = obj[kind]
        if not isinstance(prompt, str):
            raise _LineError(kind, f"must be a string, got {_json_type(prompt)}")
        if not prompt:
            raise _LineError(kind, "empty prompt")
        _need_tokenizer(tokenizer, kind)
        ids = _collapse_double_bos(_encode(prompt, tokenizer, max_model_len, kind, {}), tokenizer)
    else:
        messages = _check_messages(obj[kind])
        _need_tokenizer(tokenizer, kind)
        ids = _chat_token_ids(messages, tokenizer, max_model_len)
    if not ids:
        raise _LineError(kind, "empty prompt (no tokens after tokenization)")
    if kind != "prompt_token_ids":
        _check_vocab(ids, vocab_size, kind)
    if len(ids) > max_model_len - 1:  # leave room for at least one generated token
        raise _TooLong(kind, f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}"
                             f" (a prompt may have at most {max_model_len - 1})")
    return Request(id=rid, line=lineno, prompt_token_ids=ids, sampling=sampling,
                   prompt=prompt, messages=messages)


def _check_structured(spec: dict, tokenizer: Any) -> None:
    """Compiled now (cached per distinct constraint) so that a schema the grammar engine refuses is
    this line's error record, not a failure mid-run."""
    if tokenizer is None:
        raise _LineError("structured_outputs", "needs the model's tokenizer (grammars are matched on text); "
                                               "this model has none")
    try:
        problem = compile_spec(spec)[1]
    except PagedrunError as e:  # the grammar engine is not installed: the command to install it
        raise _LineError("structured_outputs", str(e)) from None
    if problem is not None:
        raise _OneRequest("structured_outputs", problem)


def _check_token_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list):
        raise _LineError("prompt_token_ids", f"must be a list of integers, got {_json_type(ids)}")
    if not ids:
        raise _LineError("prompt_token_ids", "empty prompt")
    for i, t in enumerate(ids):
        if not is_int(t):
            raise _LineError("prompt_token_ids", f"must be a list of integers; index {i} is {echo_json(t)}")
        if not 0 <= t < vocab_size:
            raise _LineError("prompt_token_ids", f"token id {t} at index {i} is outside [0, {vocab_size})")
    return list(ids)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _LineError("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _LineError("messages", f"item {i} must be an object, got {_json_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str) or (key == "role" and not m[key]):
                raise _LineError("messages", f'item {i} needs a string "{key}"')
    return messages


def _need_tokenizer(tokenizer: Any, kind: str) -> None:
    if tokenizer is None:
        raise _LineError(kind, "needs a tokenizer; use prompt_token_ids (this model has no tokenizer)")


def _chat_token_ids(messages: list[dict], tokenizer: Any, max_model_len: int) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise _LineError("messages", "the model's tokenizer has no chat template; use prompt")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a Jinja error from the model's template, e.g. "roles must alternate"
        raise _LineError("messages", f"chat template failed: {clip(' '.join(str(e).split()), 200)}") from None
    # The template writes the BOS itself; encoding with special tokens would add a second one.
    ids = _encode(text, tokenizer, max_model_len, "messages", {"add_special_tokens": False})
    return _collapse_double_bos(ids, tokenizer)


_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its longest vocabulary entry (a
    byte-level entry spells one character per byte, and a character is at least one byte)."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    try:
        _TOKEN_CHARS[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def _encode(text: str, tokenizer: Any, max_model_len: int, field: str, kwargs: dict) -> list[int]:
    """tokenizer.encode(text), tokenizing little more than the characters max_model_len tokens cover.

    Each token covers at most _max_token_chars characters, so the first (max_model_len + 1) times
    that many make more than max_model_len tokens and only that head is tokenized, to count them.
    (A tokenizer that drops characters, e.g. whitespace, may make fewer: the head doubles until it
    makes too many tokens or is the whole text, so such text is still tokenized exactly.)"""
    head = (max_model_len + 1) * _max_token_chars(tokenizer)
    while len(text) > head:
        n = len(tokenizer.encode(text[:head], **kwargs))
        if n > max_model_len:  # cutting the text changes the count by a token at most
            raise _TooLong(field, f"prompt has more than {max_model_len - 1} tokens: its first {head:,} of "
                                  f"{len(text):,} characters make {n:,}; max_model_len is {max_model_len}")
        head *= 2
    return list(tokenizer.encode(text, **kwargs))


def _check_vocab(ids: list[int], vocab_size: int, field: str) -> None:
    top = max(ids)
    if top >= vocab_size or min(ids) < 0:
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise _LineError(field, f"the tokenizer gave token id {t} (token {i}), outside the model's vocabulary "
                                f"[0, {vocab_size}): the tokenizer does not match the model")


def _collapse_double_bos(ids: list[int], tokenizer: Any) -> list[int]:
    """Drop a doubled leading BOS (e.g. a prompt that starts with "<s>" plus the tokenizer's own)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
    return ids


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
