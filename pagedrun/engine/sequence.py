"""Sequence and SequenceGroup: the scheduler's view of a request (token ids and progress; no tensors).

A request with `n` completions is one SequenceGroup. It starts with a single Sequence holding the
prompt; when the prompt has been computed and the first tokens are sampled, the engine forks it into
n sequences that share the prompt's KV blocks (copy-on-write in the KV manager).

Progress is one number per sequence, `num_computed_tokens`: how many of its tokens have KV in the
cache. Everything the scheduler does reduces to "compute tokens num_computed..num_tokens", which
covers a fresh prefill, a chunked prefill, a prefill after a prefix-cache hit, a decode step and
a recompute after preemption with the same code path (vLLM v1's formulation).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedrun.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


# eq=False: a sequence (or group) is an identity, not a value; the scheduler's `in` and `remove`
# on its queues must not compare token lists field by field (a visible share of decode time:
# docs/log/2026-11-21-hf-idle-cpu-attention-kernel.md).
@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    num_computed_tokens: int = 0
    # Tokens a launched step is sampling that are not in token_ids yet (async scheduling,
    # engine/engine.py): the scheduler counts them, the next step reads them on the device.
    num_pending: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict] = field(default_factory=list)
    # The output's text so far, kept only while stop strings must be checked, decoded incrementally
    # (engine/output_processor.py): output tokens [detok_prefix, detok_read) are the context the
    # next decode starts from; tokens from detok_read on are not in `text` yet.
    text: str = ""
    detok_prefix: int = 0
    detok_read: int = 0
    stop_text_cut: int | None = None  # length of the text to keep when a stop string matched
    # Cut by max_tokens (or max_model_len) under a structured_outputs constraint before the grammar
    # was complete: the output is not the structure asked for (structured/grammar.py).
    structured_incomplete: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sampling parameters, its sequences, and its timeline."""

    request_id: str
    index: int  # position in the input, for ordered outputs
    sampling: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each decode step of the group produced tokens
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    forked: bool = False  # n > 1: the prompt sequence has been forked into n children
    # n > max_num_seqs: this group is completion `child_index` of a fanned-out request
    # (engine/parallel_sampling.py), merged into one output with its siblings.
    parent: object | None = None
    child_index: int = 0
    error: str | None = None  # why this request failed while it ran (its grammar): an error record
    # prompt_logprobs: one entry per prompt token (None for the first), filled in as chunks compute
    prompt_logprobs: list[dict | None] | None = None

    @property
    def prompt_len(self) -> int:
        return self.seqs[0].prompt_len

    @property
    def status(self) -> SequenceStatus:
        live = [s.status for s in self.seqs if not s.is_finished]
        return live[0] if live else SequenceStatus.FINISHED

    # The status read directly, not through Sequence.is_finished: both run for every group at
    # every step (scheduler, engine, report).
    def unfinished_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # most groups (n = 1): no comprehension, ~200 calls a step at 64 sequences
            s = seqs[0]
            return [s] if s.status is not SequenceStatus.FINISHED else []
        return [s for s in seqs if s.status is not SequenceStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True

    @property
    def max_num_seqs(self) -> int:
        """Sequences this group will run at once: n after the fork."""
        return self.sampling.n if not self.forked else len(self.unfinished_seqs())
