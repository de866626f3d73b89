"""StepLog in bounded memory (report/metrics.py): its sums, maxima and values at the peak step
against the whole list of steps, merging, the thinned timeline, and the report of a real run from
a log that kept almost nothing equal to the one from a log that kept every step."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from pagedrun.report.metrics import _INTS, StepLog, StepRecord


def random_steps(n: int, seed: int = 0, groups: int = 2) -> list[StepRecord]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.random()
        ints = {name: rng.randrange(0, 6) for name in _INTS if name != "step"}
        ints["preempted_recompute"] = int(rng.random() < 0.1)  # rare, as preemptions are
        out.append(StepRecord(step=i, t_start=t - 0.5, t_end=t, **ints,
                              blocks_per_group=[rng.randrange(0, 9) for _ in range(groups)]))
    return out


def check_aggregates(log: StepLog, steps: list[StepRecord]) -> None:
    assert len(log) == len(steps)
    for name in _INTS:
        values = [getattr(s, name) for s in steps]
        assert log.total(name) == sum(values), name
        assert log.peak(name) == max(values), name
    blocks = [s.blocks_in_use for s in steps]
    peak = blocks.index(max(blocks))  # the first step of the peak
    assert log.peak_step == peak
    for name in _INTS + ("t_end",):
        assert log.at_peak(name) == getattr(steps[peak], name)
    assert log.peak_blocks_per_group == [max(g) for g in zip(*(s.blocks_per_group for s in steps))]
    assert log.peak_blocks_every_block_kept == max(s.blocks_in_use + s.blocks_left_window for s in steps)


def check_timeline(log: StepLog, steps: list[StepRecord]) -> None:
    pts = log.timeline()
    assert len(pts) <= log.timeline_points + 1  # + the last step when it is not a point
    assert pts[0].t_end == steps[0].t_end and pts[-1].t_end == steps[-1].t_end
    assert all(a.t_end < b.t_end for a, b in zip(pts, pts[1:]))
    by_t = {s.t_end: s for s in steps}
    assert all(by_t[p.t_end].blocks_in_use == p.blocks_in_use for p in pts)  # real steps, not averages
    # No preemption is lost from the plot, and each is drawn at or after its step.
    assert sum(p.preempted_recompute for p in pts) == sum(s.preempted_recompute for s in steps)
    first_preempted = next(s.t_end for s in steps if s.preempted_recompute)
    assert next(p.t_end for p in pts if p.preempted_recompute) >= first_preempted


@pytest.mark.parametrize("n, recent, points", [(1, 1, 2), (7, 3, 3), (500, 4, 9), (3000, 16, 64)])
def test_bounded_log_matches_the_whole_list(n, recent, points):
    steps = random_steps(n, seed=n)
    log = StepLog(steps, recent=recent, timeline_points=points)
    check_aggregates(log, steps)
    if n > 1:
        check_timeline(log, steps)
    kept = min(n, recent)
    assert log[-kept:] == steps[-kept:] and log[-1] == steps[-1] and log[n - 1] == steps[n - 1]


def test_dropped_steps_are_refused_not_made_up():
    steps = random_steps(100)
    log = StepLog(steps, recent=10)
    assert log.first_kept >= 80 and log[log.first_kept:] == steps[log.first_kept:]
    with pytest.raises(IndexError):
        log[0]
    with pytest.raises(IndexError):
        log[5:]
    with pytest.raises(IndexError):
        list(log)  # a sum over it would be wrong: total() is the sum
    short = StepLog(steps[:5], recent=10)
    assert list(short) == steps[:5] and short[1:3] == steps[1:3]
    with pytest.raises(IndexError):
        short[5]


@pytest.mark.parametrize("split", [1, 37, 250, 499])
def test_merged_logs_equal_one_log(split):
    """A Ray replica sends a log per batch; the driver merges them."""
    steps = random_steps(500, seed=split)
    a = StepLog(steps[:split], recent=8, timeline_points=17)
    b = StepLog(steps[split:], recent=8, timeline_points=17)
    a += b
    check_aggregates(a, steps)
    check_timeline(a, steps)
    assert a[-8:] == steps[-8:]
    assert len(b.timeline()) == len(StepLog(steps[split:], recent=8, timeline_points=17).timeline())  # b unchanged


def test_an_empty_log_reads_as_no_steps():
    log = StepLog()
    assert not log and len(log) == 0 and log.peak_step is None and log.at_peak("tokens_stored") is None
    assert log.total("num_prefill_tokens") == 0 and log.peak("blocks_in_use") == 0 and log.timeline() == []
    log += StepLog()
    assert len(log) == 0


def test_memory_does_not_grow_with_the_steps():
    steps = random_steps(2000)
    tracemalloc.start()
    try:
        log = StepLog(recent=64, timeline_points=65)
        base = tracemalloc.get_traced_memory()[0]
        sizes = []
        for rounds in range(10):
            for s in steps:
                log.append(s)
            sizes.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(log) == 20_000
    # Every 2,000 steps cost ~480 KB as a list of columns; here the 10th round adds nothing (the
    # grown ints of the sums aside).
    assert sizes[-1] - sizes[1] < 4096, sizes


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", seed=3)


def test_report_of_a_run_equals_the_one_from_every_step(model_dir):
    """A preempting run whose log keeps 2 steps and 3 timeline points reports what a log of every
    step does: each step-derived number is a sum, a maximum or a value at the peak step."""
    from pagedrun.llm import LLM
    from pagedrun.report.report import build_report
    from pagedrun.sampling_params import SamplingParams

    class Both(StepLog):
        def __init__(self):
            super().__init__(recent=2, timeline_points=3)
            self.every = StepLog(recent=10**9)

        def append(self, rec):
            super().append(rec)
            self.every.append(rec)

    llm = LLM(None, [f"model.path={model_dir}", "model.device=cpu", "model.max_model_len=64",
                     "cache.block_size=8", "cache.num_blocks=5"])
    llm.engine.steps = log = Both()
    prompts = [list(range(10 + 9 * i, 19 + 9 * i)) for i in range(3)]
    results = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    bounded = build_report(llm.engine, results, wall_s=1.0, load_s=0.1)
    llm.engine.steps = log.every
    whole = build_report(llm.engine, results, wall_s=1.0, load_s=0.1)
    assert len(log) > 10 and log.first_kept > 0 and bounded["preemptions"]["recompute"] >= 1
    for section in ("num_steps", "blocks_in_use", "utilisation", "fragmentation", "contiguous", "prefix_cache",
                    "preemptions", "swap", "throughput"):
        assert bounded[section] == whole[section], section
    # And the report against the list of every step, summed here as the report used to.
    every = list(log.every)
    assert whole["blocks_in_use"]["mean"] == sum(s.blocks_in_use for s in every) / len(every)
    waste = [8 * s.blocks_in_use - s.tokens_assigned for s in every]
    assert whole["fragmentation"]["last_block_waste_tokens_mean"] == sum(waste) / len(every)
    peak = max(range(len(every)), key=lambda i: (every[i].blocks_in_use, -i))
    assert whole["fragmentation"]["last_block_waste_tokens_at_peak"] == waste[peak]
