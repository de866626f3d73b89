"""What the engine records about every step: the raw material of the memory report.

Everything here is measured (counted by the engine or the KV manager, or timed); the report in
report/report.py only derives numbers from these records.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields

from pagedrun.report.latency import LatencySamples


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
    # Sliding-window groups (kv/hybrid.py): table entries of the running sequences whose blocks the
    # window gave back; with every block kept they would be blocks in use too.
    blocks_left_window: int = 0
    blocks_per_group: list[int] = field(default_factory=list)  # device blocks each KV cache group holds

    def to_dict(self) -> dict:
        return asdict(self)


class StepLog:
    """The run's StepRecords, stored a column per field: 8 bytes a field a step (about 230 bytes a
    step, where a list of StepRecord objects takes about 690), so that a long job's report data stay
    small. Reads like a list of StepRecords (len, index, slice, iteration: each record rebuilt on
    the way out); `column(name)` gives one field over all steps without building any."""

    _FIELDS = tuple(f.name for f in fields(StepRecord) if f.name != "blocks_per_group")
    _FLOATS = ("t_start", "t_end")

    def __init__(self, records: Iterable[StepRecord] = ()) -> None:
        self._cols = {name: array("d" if name in self._FLOATS else "q") for name in self._FIELDS}
        self._groups = array("q")  # blocks_per_group, flattened: the same number of groups every step
        self._num_groups: int | None = None
        self.extend(records)

    def append(self, rec: StepRecord) -> None:
        groups = rec.blocks_per_group
        if self._num_groups is None:
            self._num_groups = len(groups)
        if len(groups) != self._num_groups:
            raise ValueError(f"a step with {len(groups)} KV cache groups in a log of {self._num_groups}")
        for name, col in self._cols.items():
            col.append(getattr(rec, name))
        self._groups.extend(groups)

    def extend(self, records: Iterable[StepRecord]) -> None:
        for rec in records:
            self.append(rec)

    def __iadd__(self, records: Iterable[StepRecord]) -> StepLog:
        self.extend(records)
        return self

    def __len__(self) -> int:
        return len(self._cols["step"])

    def __bool__(self) -> bool:
        return len(self) > 0

    def column(self, name: str):
        """One field over all steps (an array; blocks_per_group: a list of lists)."""
        if name == "blocks_per_group":
            return [list(self._groups_of(i)) for i in range(len(self))]
        return self._cols[name]

    def _groups_of(self, i: int):
        g = self._num_groups or 0
        return self._groups[i * g:(i + 1) * g]

    def _record(self, i: int) -> StepRecord:
        values = {name: col[i] for name, col in self._cols.items()}
        return StepRecord(**values, blocks_per_group=list(self._groups_of(i)))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._record(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("step index out of range")
        return self._record(i % n)

    def __iter__(self) -> Iterator[StepRecord]:
        for i in range(len(self)):
            yield self._record(i)


@dataclass
class RequestTiming:
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    token_times: list[float] = field(default_factory=list)


@dataclass
class RunTally:
    """What the summary and the report read of a run's finished requests, added up as they finish, so
    that a run of any size need not keep its RequestOutputs (latencies in bounded memory: latency.py)."""
    num_ok: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0  # of the requests that ran
    error_prompt_tokens: int = 0  # of those that failed in the engine
    output_tokens: int = 0
    ttft_s: LatencySamples = field(default_factory=LatencySamples)
    itl_s: LatencySamples = field(default_factory=LatencySamples)
    e2e_s: LatencySamples = field(default_factory=LatencySamples)

    def add(self, o) -> None:
        """Count one RequestOutput (engine/engine.py)."""
        if o.error is not None:
            self.num_errors += 1
            self.error_prompt_tokens += len(o.prompt_token_ids)
            return
        self.num_ok += 1
        self.prompt_tokens += len(o.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in o.outputs)
        m = o.metrics
        if m.get("ttft_s") is not None:
            self.ttft_s.append(m["ttft_s"])
        self.itl_s.extend(m.get("itl_s", []))
        if m.get("e2e_s") is not None:
            self.e2e_s.append(m["e2e_s"])

    @classmethod
    def of(cls, results) -> RunTally:
        """A RunTally as is, or the tally of a list of RequestOutputs."""
        if isinstance(results, cls):
            return results
        tally = cls()
        for o in results:
            tally.add(o)
        return tally
