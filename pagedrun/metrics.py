"""What the engine records about every step: the raw material of the memory report.

Everything here is measured (counted by the engine or the KV manager, or timed); the report in
report.py only derives numbers from these records.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    step: int
    t_start: float  # seconds since the run started
    t_end: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int  # sequences in the batch
    num_sampled_tokens: int  # output tokens produced by this step
    blocks_in_use: int  # GPU blocks with ref_cnt > 0 after the step
    blocks_cached_free: int  # free blocks still holding a prefix-cache hash
    tokens_stored: int  # slots holding computed KV, over distinct blocks in use
    num_running: int
    num_waiting: int
    num_swapped: int
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swap_fallbacks: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    num_finished: int = 0
    # Slots assigned to a token (computed, or scheduled but not yet computed during chunked prefill),
    # over distinct blocks in use: blocks_in_use x block_size - tokens_assigned is last-block waste.
    tokens_assigned: int = 0
    tokens_logical: int = 0  # computed tokens summed per running sequence (a shared block counts per sequence)
    # What a contiguous cache would hold reserved for the running sequences: min(prompt + max_tokens,
    # max_model_len) each (an HF static / pre-vLLM cache reserves num_running x max_model_len).
    reserved_contiguous_tokens: int = 0
    num_running_requests: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestTiming:
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    token_times: list[float] = field(default_factory=list)
