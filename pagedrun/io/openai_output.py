"""A finished request -> the Batch API's output line (chat.completion or text_completion body).

The shapes are the `openai` package's (tests validate every body with openai.types.chat.ChatCompletion
and openai.types.Completion). Token strings are the tokenizer's decoding of the one token; `bytes`
are their UTF-8 bytes. A completion's text_offset counts characters from the start of its generated
text (pagedrun never echoes the prompt).
"""
from __future__ import annotations

from typing import Any

from pagedrun.io.openai_batch import CHAT_URL, BatchJob, BatchLine

# OpenAI's finish reasons are stop | length (| content_filter, tool_calls): pagedrun's own stop
# reasons (a stop string, a stop token id, EOS) are all "stop".
_FINISH = {"length": "length"}


def output_line(o, batch: BatchLine, job: BatchJob, tokenizer: Any) -> dict:
    """The output line of a finished RequestOutput `o` (engine/engine.py) of line `batch`."""
    line_id = job.line_id(batch.custom_id)
    if o.error is not None:
        return error_line(line_id, batch.custom_id, "request_failed", o.error)
    chat = batch.url == CHAT_URL
    tokens = _TokenText(tokenizer)
    choices = []
    for c in o.outputs:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": _FINISH.get(c.finish_reason, "stop"),
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text, "refusal": None}
            if batch.logprobs:
                choice["logprobs"] = {"content": [_chat_logprob(e, tokens) for e in c.logprobs or []],
                                      "refusal": None}
        else:
            choice["text"] = c.text
            if batch.logprobs:
                choice["logprobs"] = _completion_logprobs(c.logprobs or [], tokens)
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
                  "total_tokens": prompt_tokens + completion_tokens},
        "system_fingerprint": job.system_fingerprint,
    }
    return {"id": line_id, "custom_id": batch.custom_id,
            "response": {"status_code": 200, "request_id": "req_" + suffix, "body": body}, "error": None}


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> dict:
    """A line that failed: `custom_id` is null only when the input line has no readable one."""
    return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


class _TokenText:
    """Token id -> its text, decoded once per id (a completion repeats tokens; top-N lists more so)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def _chat_logprob(entry: dict, tokens: _TokenText) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = tokens(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**one(entry["token_id"], entry["logprob"]), "top_logprobs": [one(t, lp) for t, lp in entry["top"]]}


def _completion_logprobs(entries: list[dict], tokens: _TokenText) -> dict:
    texts = [tokens(e["token_id"]) for e in entries]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokens(t): lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}
