"""pagedrun's own output lines (outputs.jsonl): one record per finished or refused request.

A request with one completion keeps its fields at the top level; with n > 1 they go under
"outputs", one object per completion. The request side of the format (reading a JSONL line into a
Request) is io/requests.py, shared with OpenAI batch files.
"""
from __future__ import annotations

from typing import Any

from pagedrun.io.requests import InvalidRequest
from pagedrun.outputs import RequestOutput


def output_record(o: RequestOutput) -> dict:
    """One line of outputs.jsonl."""
    rec: dict[str, Any] = {"id": o.request_id, "prompt_tokens": len(o.prompt_token_ids)}
    if o.error is not None:
        rec["error"] = o.error
        return rec
    # structured_output_incomplete only when true: a cut-off constrained output says so.
    completions = [
        {k: v for k, v in (("index", c.index), ("text", c.text), ("token_ids", c.token_ids),
                           ("finish_reason", c.finish_reason), ("stop_reason", c.stop_reason),
                           ("structured_output_incomplete", c.structured_output_incomplete or None),
                           ("logprobs", c.logprobs)) if k not in ("logprobs", "structured_output_incomplete")
                                                        or v is not None}
        for c in o.outputs
    ]
    if len(completions) == 1:
        c = completions[0]
        c.pop("index")
        rec.update(c)
    else:
        rec["outputs"] = completions
    if o.prompt_logprob_entries is not None:
        rec["prompt_logprobs"] = o.prompt_logprob_entries
    rec["cached_prompt_tokens"] = o.num_cached_prompt_tokens
    rec["num_preemptions"] = o.num_preemptions
    rec["metrics"] = o.metrics
    return rec


def invalid_record(r: InvalidRequest) -> dict:
    """The line of a request that could not be read: its id, its line number, why."""
    return {"id": r.id, "line": r.line, "error": r.error}
