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


_FIELDS = tuple(f.name for f in fields(StepRecord) if f.name != "blocks_per_group")
_FLOATS = ("t_start", "t_end")
_INTS = tuple(name for name in _FIELDS if name not in _FLOATS)


@dataclass
class TimelinePoint:
    """A point of the `--plot` timeline: a step, and the preemptions since the point before it."""
    t_end: float
    blocks_in_use: int
    blocks_cached_free: int
    preempted_recompute: int
    preempted_swap: int


class StepLog:
    """The run's steps in memory that does not grow with them (issue 40): what the report and the
    plot read, summed up as the steps come.

    - every int field's sum and maximum over all steps, and every field at the first step of peak
      blocks in use: the report's sums, means, peaks and "at peak" numbers, exact at any length;
    - the last `recent` steps whole, a column per field (8 bytes a field: ~240 bytes a step): index
      and slice them (`steps[-1]`, `steps[n:]`), or iterate while no step has been dropped;
    - a timeline of at most `timeline_points` points for `--plot`: every step at first, then every
      2nd, 4th, ... (each time it fills, every other point goes and the stride doubles); a point
      carries the preemptions of the steps it stands for, so none is lost from the plot.

    len() counts every step appended. `merge` adds a later log's steps (a Ray replica's batches)."""

    _FIELDS, _FLOATS, _INTS = _FIELDS, _FLOATS, _INTS

    def __init__(self, records: Iterable[StepRecord] = (), *, recent: int = 4096, timeline_points: int = 4096) -> None:
        if recent < 1 or timeline_points < 2:
            raise ValueError("a step log keeps at least one recent step and two timeline points")
        # Odd: when the timeline fills, its last point is one of those kept.
        self.recent, self.timeline_points = recent, timeline_points | 1
        self.clear()
        self.extend(records)

    def clear(self) -> None:
        self._n = 0
        self._cols = {name: array("d" if name in self._FLOATS else "q") for name in self._FIELDS}
        self._groups = array("q")  # blocks_per_group of the recent steps, flattened
        self._num_groups: int | None = None
        self._total = dict.fromkeys(self._INTS, 0)
        self._max = dict.fromkeys(self._INTS, 0)
        self._at_peak: StepRecord | None = None  # the first step of peak blocks in use
        self._peak_step: int | None = None
        self._peak_groups: list[int] = []  # max over steps of each group's blocks
        self._peak_kept = 0  # max over steps of blocks_in_use + blocks_left_window
        self._points: list[TimelinePoint] = []
        self._stride = 1  # a point every `_stride` steps
        self._since = [0, 0]  # preemptions (recompute, swap) since the last point
        self._last: StepRecord | None = None
        self._last_is_point = False  # the last step is the timeline's last point (thinning keeps that one)

    # ---- adding ---------------------------------------------------------------------------------
    def append(self, rec: StepRecord) -> None:
        groups = rec.blocks_per_group
        if self._num_groups is None:
            self._num_groups = len(groups)
            self._peak_groups = [0] * len(groups)
        if len(groups) != self._num_groups:
            raise ValueError(f"a step with {len(groups)} KV cache groups in a log of {self._num_groups}")
        total, top, values = self._total, self._max, vars(rec)
        for name in self._INTS:
            v = values[name]
            total[name] += v
            if v > top[name]:
                top[name] = v
        if self._at_peak is None or rec.blocks_in_use > self._at_peak.blocks_in_use:
            self._at_peak, self._peak_step = rec, self._n
        self._peak_groups = [max(a, b) for a, b in zip(self._peak_groups, groups)]
        self._peak_kept = max(self._peak_kept, rec.blocks_in_use + rec.blocks_left_window)
        self._since[0] += rec.preempted_recompute
        self._since[1] += rec.preempted_swap
        self._last_is_point = self._n % self._stride == 0
        if self._last_is_point:
            self._add_point(TimelinePoint(rec.t_end, rec.blocks_in_use, rec.blocks_cached_free, *self._since))
            self._since = [0, 0]
        for name, col in self._cols.items():
            col.append(values[name])
        self._groups.extend(groups)
        if len(self._cols["step"]) >= 2 * self.recent:  # drop the older half at once: amortised O(1)
            self._drop_old()
        self._last = rec
        self._n += 1

    def _add_point(self, point: TimelinePoint) -> None:
        self._points.append(point)
        if len(self._points) >= self.timeline_points:
            # Keep every other point (the first and, the count being odd, the last); a dropped
            # point's preemptions go to the point after it.
            pts = self._points
            for i in range(1, len(pts), 2):
                pts[i + 1].preempted_recompute += pts[i].preempted_recompute
                pts[i + 1].preempted_swap += pts[i].preempted_swap
            self._points = pts[::2]
            self._stride *= 2

    def _drop_old(self) -> None:
        keep = self.recent
        for name, col in self._cols.items():
            del col[:len(col) - keep]
        g = self._num_groups or 0
        del self._groups[:len(self._groups) - keep * g]

    def extend(self, records: Iterable[StepRecord]) -> None:
        if isinstance(records, StepLog):
            self.merge(records)
            return
        for rec in records:
            self.append(rec)

    def __iadd__(self, records: Iterable[StepRecord]) -> StepLog:
        self.extend(records)
        return self

    def merge(self, later: StepLog) -> None:
        """Add `later`'s steps, taken after this log's (their step numbers stay theirs)."""
        if later._n == 0:
            return
        if self._num_groups is None:
            self._num_groups, self._peak_groups = later._num_groups, [0] * (later._num_groups or 0)
        if later._num_groups != self._num_groups:
            raise ValueError(f"a log of {later._num_groups} KV cache groups merged into one of {self._num_groups}")
        for name in self._INTS:
            self._total[name] += later._total[name]
            self._max[name] = max(self._max[name], later._max[name])
        if self._at_peak is None or later._at_peak.blocks_in_use > self._at_peak.blocks_in_use:
            self._at_peak, self._peak_step = later._at_peak, self._n + later._peak_step
        self._peak_groups = [max(a, b) for a, b in zip(self._peak_groups, later._peak_groups)]
        self._peak_kept = max(self._peak_kept, later._peak_kept)
        for name, col in self._cols.items():
            col.extend(later._cols[name])
        self._groups.extend(later._groups)
        if len(self._cols["step"]) > self.recent:
            self._drop_old()
        points = [TimelinePoint(**asdict(p)) for p in later._points]
        # This log's last steps had no point of their own: their preemptions go to later's first.
        points[0].preempted_recompute += self._since[0]
        points[0].preempted_swap += self._since[1]
        for point in points:
            self._add_point(point)
        self._since = list(later._since)
        self._stride = max(self._stride, later._stride)
        self._last, self._last_is_point = later._last, later._last_is_point
        self._n += later._n

    # ---- reading --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def total(self, name: str) -> int:
        """An int field summed over every step."""
        return self._total[name]

    def peak(self, name: str) -> int:
        """An int field's maximum over every step (0 without steps)."""
        return self._max[name]

    @property
    def peak_step(self) -> int | None:
        """The first step of peak blocks in use (None without steps)."""
        return self._peak_step

    def at_peak(self, name: str):
        """A field at the first step of peak blocks in use (None without steps)."""
        return getattr(self._at_peak, name) if self._at_peak is not None else None

    @property
    def peak_blocks_per_group(self) -> list[int]:
        return list(self._peak_groups)

    @property
    def peak_blocks_every_block_kept(self) -> int:
        """max over steps of blocks in use + the table entries a sliding window gave back."""
        return self._peak_kept

    def timeline(self) -> list[TimelinePoint]:
        """The thinned timeline, ending at the last step."""
        pts = list(self._points)
        last = self._last
        if last is not None and not self._last_is_point:
            pts.append(TimelinePoint(last.t_end, last.blocks_in_use, last.blocks_cached_free, *self._since))
        return pts

    @property
    def first_kept(self) -> int:
        """The number of the oldest step kept whole."""
        return self._n - len(self._cols["step"])

    def _record(self, i: int) -> StepRecord:
        j = i - self.first_kept
        values = {name: col[j] for name, col in self._cols.items()}
        g = self._num_groups or 0
        return StepRecord(**values, blocks_per_group=list(self._groups[j * g:(j + 1) * g]))

    def __getitem__(self, i):
        """A recent step by its number (negative: from the end), or a slice of recent steps."""
        n, first = self._n, self.first_kept
        if isinstance(i, slice):
            start, stop, stride = i.indices(n)
            picked = range(start, stop, stride)
            if picked and min(picked[0], picked[-1]) < first:
                raise IndexError(f"steps before {first} are no longer kept whole (the last {self.recent} are)")
            return [self._record(j) for j in picked]
        if not -n <= i < n:
            raise IndexError("step index out of range")
        i %= n
        if i < first:
            raise IndexError(f"step {i} is no longer kept whole (the last {self.recent} are): read total(), "
                             "peak() or timeline()")
        return self._record(i)

    def __iter__(self) -> Iterator[StepRecord]:
        """Every step, while all are kept (a short run's); a long one's sums are total()."""
        if self.first_kept:
            raise IndexError(f"the first {self.first_kept} steps are no longer kept whole (the last "
                             f"{self.recent} are): read total(), peak() or timeline()")
        for i in range(self._n):
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
