"""What a finished request gives back: vLLM's RequestOutput and CompletionOutput.

The engine builds them; the LLM facade returns them to Python users; io/jsonl.py and
io/openai_batch.py turn them into output lines.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-probability at a position, its rank there (1 = the most
    likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict] | None = None
    # The sum of the sampled tokens' logprobs, when the request asked for logprobs (vLLM's field).
    cumulative_logprob: float | None = None
    # finish_reason "length" under a structured_outputs constraint whose structure was not complete
    # (cut-off JSON): the text is a prefix of a valid output, not one (pagedrun's field; vLLM has none).
    structured_output_incomplete: bool = False


@dataclass
class RequestOutput:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    prompt: str | None = None  # the prompt's text when it was given as text (LLM.generate / chat)
    # With SamplingParams.prompt_logprobs, vLLM's: per prompt token None (the first: nothing precedes
    # it), then {token_id: Logprob} holding the prompt's token and the top N there.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The same in the output files' shape: None, then {"token_id", "logprob", "rank", "top": [[id, lp]]}.
    prompt_logprob_entries: list[dict | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason not in (None, "abort") for o in self.outputs) and self.error is None
