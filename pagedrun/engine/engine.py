"""LLMEngine.step(): one iteration of continuous batching, in four phases.

    schedule  scheduler.schedule()        -> SchedulerOutput (which tokens run, in which blocks)
    launch    worker.prepare + launch     -> swap / copy blocks, run the model, sample token ids
              (queued on the device); advance progress
    read back LaunchedStep.result()       -> the sampled ids on the host
    update    fork, check stops, free blocks, hand back finished requests, record a StepRecord
              (the run's report)

With async scheduling (engine/inflight.py) a step is read back after the next one is launched:
the host's work overlaps the device's.

The engine holds no tensor and imports no torch: everything on a device is the Worker's
(worker/worker.py), reached through plain lists of ids, positions and block tables (and held
only as the worker's opaque handles: a sequence's generator, a launched step).
"""
from __future__ import annotations

import time

from pagedrun.config.recipe import Recipe
from pagedrun.engine.inflight import PENDING, InFlight, async_setting, may_schedule_ahead
from pagedrun.engine.occupancy import occupancy
from pagedrun.engine.output_processor import check_stop
from pagedrun.engine.parallel_sampling import CHILD_SEED_STRIDE, ParentRequest, child_sampling
from pagedrun.engine.request_output import OutputBuilder
from pagedrun.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedrun.engine.sequence import Sequence, SequenceGroup
from pagedrun.errors import PagedrunError
from pagedrun.kv.hybrid import make_kv_manager
from pagedrun.outputs import RequestOutput
from pagedrun.report.metrics import StepLog, StepRecord
from pagedrun.sampling_params import SamplingParams, bad_words_token_ids
from pagedrun.structured.grammar import StructuredOutputManager


class LLMEngine:
    def __init__(self, recipe: Recipe):
        from pagedrun.worker.worker import Worker  # torch is slow to import: only when an engine is built

        self.recipe = recipe
        self.worker = Worker(recipe)
        # What the engine reads of the worker is data, not tensors: the plan the KV budget came
        # from, the model's config, the tokenizer (stop strings, structured outputs).
        self.memory = self.worker.memory
        self.model_config = cfg = self.worker.model_config
        self.tokenizer = self.worker.tokenizer
        self.max_model_len = self.worker.max_model_len
        sched = recipe.scheduler
        self.kv = make_kv_manager(self.worker.kv_groups, self.memory.num_gpu_blocks, recipe.cache.block_size,
                                  self.worker.num_cpu_blocks, enable_prefix_caching=recipe.cache.enable_prefix_caching,
                                  watermark=recipe.cache.watermark, max_chunk=sched.max_num_batched_tokens)
        # Sliding-window groups give back what their window left after every step (kv/manager.py).
        self._windowed = any(g.window for g in self.worker.kv_groups.groups)
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, sched.preemption_mode,
                            sched.admission_burst),
            self.kv, self.max_model_len,
        )
        eos = set(cfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self.generators: dict[int, object] = {}  # seq_id -> the worker's seeded stream
        self.structured: StructuredOutputManager | None = None  # built by the first constrained request
        # The steps' sums, maxima, last few and a thinned timeline: bounded at any length. Its own
        # counter numbers the steps (a Ray replica takes the log away after each batch).
        self.steps = StepLog()
        self.num_steps = 0
        self.t0 = time.perf_counter()
        self._next_seq_id = 0
        self._bad_words_cache: dict[tuple, tuple] = {}
        self.outputs = OutputBuilder(self.tokenizer)
        self._failed_early: list[RequestOutput] = []  # requests refused when added, answered at the next step
        self._last_stats = self._stats_snapshot()
        # Async scheduling (engine/inflight.py): the step launched and not read back yet, and the
        # row of its samples each sequence waiting for its token reads on the device.
        self.async_scheduling, self.async_line = async_setting(recipe.scheduler.async_scheduling,
                                                               self.worker.device.type)
        self._inflight: InFlight | None = None
        self._pending_row: dict[int, int] = {}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, index: int, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        if sampling.n > self.scheduler.config.max_num_seqs:
            # A group is admitted whole: n sequences at once could never be. Fan out instead.
            parent = ParentRequest(sampling.n)
            for k in range(sampling.n):
                self._add_group(request_id, index, prompt_token_ids, child_sampling(sampling, k), parent, k)
            return
        self._add_group(request_id, index, prompt_token_ids, sampling)

    def _add_group(self, request_id: str, index: int, prompt_token_ids: list[int], sampling: SamplingParams,
                   parent: ParentRequest | None = None, child_index: int = 0) -> None:
        seq = Sequence(self._new_seq_id(), len(prompt_token_ids), list(prompt_token_ids))
        group = SequenceGroup(request_id, index, sampling, [seq], parent=parent, child_index=child_index)
        if sampling.seed is not None:
            self.generators[seq.seq_id] = self.worker.make_generator(sampling.seed)
        if sampling.structured_outputs is not None:
            why = self._add_grammar(seq.seq_id, sampling.structured_outputs)
            if why is not None:  # this request's error record, at the next step; the others run
                o = self._error_output(group, why)
                if o is not None:
                    self._failed_early.append(o)
                return
        self.scheduler.add_group(group)

    def _add_grammar(self, seq_id: int, spec: dict) -> str | None:
        """Give the sequence its grammar; None, or why the grammar engine cannot (a limit, a tokenizer
        it cannot read): that request fails, not the run."""
        try:
            if self.structured is None:
                self.structured = StructuredOutputManager(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                    strict=self.recipe.structured_outputs.disable_additional_properties)
            self.structured.add(seq_id, spec)
        except PagedrunError as e:
            return str(e)
        except Exception as e:  # the engine's own errors (llguidance raises ValueError / RuntimeError)
            return f"structured_outputs: the grammar engine failed: {' '.join(str(e).split())[:300]}"
        return None

    def _bad_words_ids(self, sampling: SamplingParams) -> tuple:
        """The token sequences of the request's bad_words, tokenized once per distinct list."""
        if not sampling.bad_words or self.tokenizer is None:
            return ()
        key = tuple(sampling.bad_words)
        got = self._bad_words_cache.get(key)
        if got is None:
            if len(self._bad_words_cache) > 4096:  # a list per request would otherwise grow with the job
                self._bad_words_cache.clear()
            got = self._bad_words_cache[key] = bad_words_token_ids(sampling.bad_words, self.tokenizer)
        return got

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed_early) or self._inflight is not None

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    # ---- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then read back a step's samples: this one's, or with async
        scheduling the one launched before it (this one runs on while the host reads, updates and
        schedules the next: engine/inflight.py)."""
        finished, self._failed_early = self._failed_early, []
        if self._inflight is not None and not may_schedule_ahead(self.scheduler, self.kv):
            finished += self._resolve()  # its tokens first: this step may have to preempt
        t_start = time.perf_counter()
        in_flight = self._inflight is not None  # this step is scheduled ahead of its read back
        out = self.scheduler.schedule()
        finished += [o for g, reason in out.aborted if (o := self._error_output(g, reason)) is not None]
        if out.is_empty:
            return finished + (self._resolve() if in_flight else self._unblock())
        if in_flight and (out.preempted_recompute or out.preempted_swap):
            raise RuntimeError("async scheduling: a step scheduled ahead preempted a sequence (a bug)")
        launched = self._launch(out, t_start)
        if in_flight:
            finished += self._resolve()
        self._inflight = launched
        if not launched.ahead:
            finished += self._resolve()
        return finished

    def drain(self) -> list[RequestOutput]:
        """Read back the step still in flight, if any (before an interrupt drops the rest)."""
        return self._resolve() if self._inflight is not None else []

    def abort_all(self) -> None:
        """Drop every unfinished request, and the step in flight unread (after an error)."""
        self._inflight = None
        self.scheduler.abort_all()

    def _launch(self, out: SchedulerOutput, t_start: float) -> InFlight:
        """The worker runs the scheduled tokens and samples one row per sampling sequence (n rows for
        a prompt that is about to fork into n), queued; then every scheduled sequence is advanced,
        and a sampling one counts the token it waits for (Sequence.num_pending)."""
        self.worker.prepare(out, self.kv.num_gpu_blocks_touched)
        tables = self.kv.get_block_tables
        inputs, samples, feed = [], [], []
        ahead = self.async_scheduling  # whether the next step may be scheduled before this one is read
        for i, s in enumerate(out.scheduled):
            seq, c = s.seq, s.seq.num_computed_tokens
            known = seq.token_ids[c : c + s.num_new_tokens]
            if len(known) < s.num_new_tokens:  # its last token is being sampled by the step in flight
                known.append(PENDING)
                feed.append((i, self._pending_row[seq.seq_id]))
            samples.append(c + s.num_new_tokens == len(seq.token_ids) + seq.num_pending)  # s.samples
            targets = _prompt_targets(s)
            ahead = ahead and targets is None
            inputs.append((known, c, tables(seq.seq_id), samples[-1], targets))
        row_of, rows, row_owner = [], [], []
        r = 0
        for s, sample in zip(out.scheduled, samples):
            if not sample:
                continue
            group, seq = s.group, s.seq
            params = group.sampling
            fan = params.n if (params.n > 1 and not group.forked) else 1
            gens = self._generators(seq, group, fan)
            grammar = self.structured.row_grammar(seq) if self.structured is not None else None
            bad_words = self._bad_words_ids(params)
            # A row whose next input is this row's sample, unknown to the host until read back
            # (penalties, grammar, logprobs, a fork), is read back before the next step is scheduled.
            if ahead:
                ahead = fan == 1 and grammar is None and not params.has_penalties and params.logprobs is None
            position = len(seq.token_ids) + seq.num_pending
            for k in range(fan):
                row_of.append(r)
                rows.append((params, gens[k], (seq.token_ids, seq.prompt_len), grammar, bad_words, position))
            row_owner.append([s, fan, gens, False])
            r += 1
        launched = self.worker.launch(inputs, row_of, rows, feed)
        step = InFlight(out, launched, row_owner, t_start, ahead, out.num_decode_tokens)
        windowed = self._windowed
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if s.group.first_scheduled_time is None:
                s.group.first_scheduled_time = t_start
            if windowed:
                self.kv.remove_skipped_blocks(seq.seq_id, seq.num_computed_tokens)
        if ahead:
            self._pending_row = step.count_pending(self.max_model_len)
        return step

    def _resolve(self) -> list[RequestOutput]:
        """Read back the step in flight: append its tokens, check stops, free what finished."""
        step, self._inflight = self._inflight, None
        result = step.launched.result()
        step.settle()
        finished = self._update(step.out, result, step.row_owner)
        self._record(step.out, step.t_start, step.num_decode_tokens, len(finished),
                     len(result.token_ids) if result is not None else 0)
        return finished

    def _update(self, out: SchedulerOutput, result, row_owner) -> list[RequestOutput]:
        """Append a read-back step's sampled tokens (forking where a prompt asked for n), check
        stops, free what finished; the finished requests' outputs. A row of a sequence that
        stopped in the step before (read back after this one was launched) is dropped."""
        now = time.perf_counter()
        if result is not None and result.prompt_logprobs:
            for i, entries in result.prompt_logprobs.items():
                s = out.scheduled[i]
                if s.group.prompt_logprobs is None:  # position 0 has none: nothing precedes it
                    s.group.prompt_logprobs = [None] * s.group.prompt_len
                # entries[k] is of prompt token start + k (num_computed_tokens was advanced at launch)
                start = s.seq.num_computed_tokens - s.num_new_tokens + 1
                s.group.prompt_logprobs[start : start + len(entries)] = entries  # a recompute: the same again
        j = 0
        touched_groups: set[int] = set()  # id() of the groups that produced tokens this step
        ids, all_lps, errors = (result.token_ids, result.logprobs, result.errors) if result is not None else ((), (), {})
        eos, max_len, tokenizer, structured = self.eos_token_ids, self.max_model_len, self.tokenizer, self.structured
        for s, fan, gens, _ in row_owner:
            tokens = ids[j : j + fan]
            lps = all_lps[j : j + fan]
            why = next((errors[k] for k in range(j, j + fan) if k in errors), None) if errors else None
            j += fan
            group = s.group
            if group.error is not None:  # failed by an earlier row of this step: its sequences are freed
                continue
            if s.seq.is_finished:  # stopped by the step before, read back after this one was launched
                continue
            if why is not None:  # nothing to sample from (NaN logits): this request alone fails, with no token
                self._fail_group(group, f"{why}, at output token {s.seq.num_output_tokens + 1}")
                continue
            seqs = [s.seq]
            if fan > 1:
                seqs += self._fork(group, gens[1:])
            for seq, tok, lp in zip(seqs, tokens, lps):
                seq.token_ids.append(tok)
                if lp is not None:
                    seq.logprobs.append(lp)
                check_stop(seq, group.sampling, eos, max_len, tokenizer)
                if structured is not None:
                    structured.after_token(seq)
                    why = structured.error_of(seq.seq_id)
                    if why is not None:  # the grammar engine gave up on this request: it alone fails
                        self._fail_group(group, why)
                        break
                if seq.is_finished:
                    self.scheduler.free_seq(seq)
            if group.first_token_time is None:
                group.first_token_time = now
            if id(group) not in touched_groups:
                touched_groups.add(id(group))
                group.token_times.append(now)
        finished = []
        for g in self.scheduler.remove_finished():
            g.finished_time = now
            o = self._request_output(g)
            if o is not None:
                finished.append(o)
        return finished

    def _fail_group(self, group: SequenceGroup, why: str) -> None:
        """End every sequence of the group now; its output will be an error record saying why."""
        group.error = why
        for seq in group.unfinished_seqs():
            seq.finish("abort")
            self.scheduler.free_seq(seq)

    def _generators(self, seq: Sequence, group: SequenceGroup, fan: int) -> list[object | None]:
        """The sequence's own generator; for a prompt about to fork, one new stream per child."""
        if group.sampling.seed is None:
            return [None] * fan
        return [self.generators[seq.seq_id]] + [
            self.worker.make_generator(group.sampling.seed + k * CHILD_SEED_STRIDE) for k in range(1, fan)
        ]

    def _fork(self, group: SequenceGroup, gens: list[object | None]) -> list[Sequence]:
        parent = group.seqs[0]
        children = []
        for g in gens:
            child = Sequence(self._new_seq_id(), parent.prompt_len, list(parent.token_ids),
                             num_computed_tokens=parent.num_computed_tokens)
            if g is not None:
                self.generators[child.seq_id] = g
            if self.structured is not None:  # before the parent accepts its token: each child its own
                self.structured.fork(parent.seq_id, child.seq_id)
            children.append(child)
        self.scheduler.fork(group, children)
        return children

    def _unblock(self) -> list[RequestOutput]:
        """Nothing could be scheduled: if nothing runs either, the head of the queue can never fit."""
        sch = self.scheduler
        if sch.running or not sch.waiting:
            return []
        group = sch.waiting.popleft()
        for seq in group.unfinished_seqs():
            seq.finish("abort")
        o = self._error_output(group, f"cannot be admitted: {self.kv.num_free_gpu_blocks} KV blocks free of "
                                      f"{self.kv.num_gpu_blocks}; raise the KV budget")
        return [o] if o is not None else []

    # ---- outputs --------------------------------------------------------------------------------
    def _request_output(self, g: SequenceGroup) -> RequestOutput | None:
        """The finished request's output; None for a fanned-out child whose siblings still run."""
        if g.error is not None:
            return self._error_output(g, g.error)
        self._release(g)
        groups = [g]
        if g.parent is not None:
            groups = g.parent.child_done(g)
            if groups is None:
                return None
            if g.parent.error is not None:
                return self._error(g, g.parent.error)
        return self.outputs.build(groups)

    def _error_output(self, g: SequenceGroup, reason: str) -> RequestOutput | None:
        """An error record for a request that cannot run (None while a fanned-out one has children left)."""
        self._release(g)
        if g.parent is not None and g.parent.child_done(g, reason) is None:
            return None
        return self._error(g, g.parent.error if g.parent is not None else reason)

    def _release(self, g: SequenceGroup) -> None:
        for s in g.seqs:
            self.generators.pop(s.seq_id, None)
            if self.structured is not None:
                self.structured.free(s.seq_id)

    @staticmethod
    def _error(g: SequenceGroup, reason: str) -> RequestOutput:
        return RequestOutput(g.request_id, g.index, g.seqs[0].token_ids[: g.prompt_len], [], error=reason)

    # ---- metrics --------------------------------------------------------------------------------
    def _stats_snapshot(self) -> dict:
        st = self.kv.stats
        return {k: getattr(st, k) for k in ("prefix_query_tokens", "prefix_hit_tokens", "cow_copies")}

    def _record(self, out: SchedulerOutput, t_start: float, decode: int, num_finished: int, num_sampled: int) -> None:
        stats = self._stats_snapshot()
        delta = {k: stats[k] - self._last_stats[k] for k in stats}
        self._last_stats = stats
        sch = self.scheduler
        self.num_steps += 1
        self.steps.append(StepRecord(
            step=self.num_steps - 1,
            t_start=t_start - self.t0,
            t_end=time.perf_counter() - self.t0,
            num_prefill_tokens=out.num_batched_tokens - decode,
            num_decode_tokens=decode,
            num_seqs=len(out.scheduled),
            num_sampled_tokens=num_sampled,
            blocks_in_use=self.kv.num_used_gpu_blocks,
            blocks_cached_free=self.kv.num_cached_free_blocks,
            num_running=sch.num_running_seqs,
            num_waiting=sch.waiting.num_seqs,
            num_swapped=sch.swapped.num_seqs,
            preempted_recompute=out.preempted_recompute,
            preempted_swap=out.preempted_swap,
            swap_fallbacks=out.swap_fallbacks,
            prefix_query_tokens=delta["prefix_query_tokens"],
            prefix_hit_tokens=delta["prefix_hit_tokens"],
            cow_copies=delta["cow_copies"],
            swap_in_blocks=len(out.blocks_to_swap_in),
            swap_out_blocks=len(out.blocks_to_swap_out),
            num_finished=num_finished,
            blocks_per_group=list(getattr(self.kv, "held", ())),
            **self._occupancy(),
        ))

    def _occupancy(self) -> dict:
        return occupancy(self.scheduler.running, self.kv, self.max_model_len)


def _prompt_targets(s) -> tuple[int, list[int]] | None:
    """For a request with prompt_logprobs whose chunk holds positions that precede a prompt token:
    (top-N, those next prompt tokens), the worker's input; else None. Position p's logits score
    prompt token p + 1, so a chunk [a, b) scores prompt tokens a + 1 .. min(b, prompt_len - 1)."""
    top_n = s.group.sampling.prompt_logprobs
    if top_n is None or s.group.forked:
        return None
    a = s.seq.num_computed_tokens
    end = min(a + s.num_new_tokens, s.seq.prompt_len - 1)
    if end <= a:
        return None
    return top_n, s.seq.token_ids[a + 1 : end + 1]

