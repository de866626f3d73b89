"""OpenAI Batch API output lines: a finished request -> the line the Batch API writes to its output
file, and the line of a request that failed (io/openai_batch.py reads the input lines; its docstring
describes both formats).

Logprobs come as OpenAI writes them: per token its text, its UTF-8 bytes (a byte-level BPE token
or a SentencePiece byte fallback gives the byte it stands for, so the bytes of a completion rebuild
its text even where a character is split across tokens) and its top alternatives.
"""
from __future__ import annotations

import functools
import re
from typing import Any

from pagedrun.io.openai_batch import CHAT_URL, BatchJob, BatchLine

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
