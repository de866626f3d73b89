"""Iteration-level continuous batching under a token budget, with preemption (recompute or swap).

Each step the scheduler decides, without touching a tensor, which sequences compute how many tokens,
and which blocks the cache engine must swap in, swap out and copy before the model runs.

Policy (vLLM's, first come first served):
  1. Running groups, oldest first, each get their next tokens (1 for a decode, up to the remaining
     budget for a prefill chunk). If the KV manager cannot give a sequence its slots, the most
     recently admitted running group is preempted (by recompute, or by swap), until it fits.
  2. If nothing was preempted, swapped-out groups come back (swap in), oldest first.
  3. If nothing was preempted and nothing is swapped out, waiting groups are admitted while the
     token budget, max_num_seqs and the KV manager's watermark allow; while sequences run, only
     once admission_burst slots are free (or as many as there are waiting groups), so that
     admissions come in bursts and most steps are pure decode.
Steps 2 and 3 never run in a step that preempted, so a block freed by a swap-out is never the
target of a swap-in in the same step; that makes the fixed execution order
(swap in, swap out, copy, model) safe.

Invariants (checked by `check_invariants`): every unfinished sequence is in exactly one queue that
matches its status; running sequences have a block table covering their computed tokens; waiting
sequences hold no blocks; swapped sequences hold only CPU blocks.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from pagedrun.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedrun.kv.hybrid import HybridKVCacheManager
from pagedrun.kv.manager import KVCacheManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"  # or "swap"
    admission_burst: int = 1  # free slots needed to admit while sequences run (recipe.py says why)


@dataclass
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """After this step every token has KV (known or pending), so the step produces the next one."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == len(seq.token_ids) + seq.num_pending

    @property
    def is_decode(self) -> bool:
        """One new token that was itself generated: the steady state of a running sequence."""
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens >= self.seq.prompt_len


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swap_fallbacks: int = 0  # swap was asked for but the swap space was full: recomputed instead
    aborted: list[tuple[SequenceGroup, str]] = field(default_factory=list)  # can never fit the cache

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class GroupQueue:
    """A FIFO of sequence groups that also knows how many unfinished sequences it holds.

    A queued group runs nothing, so its count cannot change while it waits: the total is kept as
    groups enter and leave, and the per-step record reads it without scanning a queue that, in a big
    offline job, holds every pending request."""

    def __init__(self) -> None:
        self._groups: deque[SequenceGroup] = deque()
        self.num_seqs = 0

    def append(self, group: SequenceGroup) -> None:
        self._groups.append(group)
        self.num_seqs += len(group.unfinished_seqs())

    def appendleft(self, group: SequenceGroup) -> None:
        self._groups.appendleft(group)
        self.num_seqs += len(group.unfinished_seqs())

    def popleft(self) -> SequenceGroup:
        group = self._groups.popleft()
        self.num_seqs -= len(group.unfinished_seqs())
        return group

    def __getitem__(self, i: int) -> SequenceGroup:
        return self._groups[i]

    def __iter__(self):
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | HybridKVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = GroupQueue()
        self.running: list[SequenceGroup] = []  # admission order: index 0 is the oldest
        self._freed = False  # free_seq ran since the last remove_finished: a group may have finished
        self.swapped = GroupQueue()

    # ---- queue management -------------------------------------------------------------------
    def add_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    # ---- the decision -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        preempted = out.preempted_recompute + out.preempted_swap > 0
        if not preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        victims: set[int] = set()  # id() of the groups preempted in this loop to make room
        num_tokens, try_append = self.kv.get_num_tokens, self.kv.try_append_slots
        for group in list(self.running):
            if victims and id(group) in victims:  # preempted earlier in this loop as a victim
                continue
            scheduled_before = len(out.scheduled)
            copies_before = len(out.blocks_to_copy)
            preempted_self = False
            for seq in group.unfinished_seqs():
                computed = seq.num_computed_tokens
                num_new = min(len(seq.token_ids) + seq.num_pending - computed, budget)
                if num_new == 0:
                    continue
                need = computed + num_new - num_tokens(seq.seq_id)
                while need > 0:
                    pairs = try_append(seq.seq_id, need)
                    if pairs is not None:
                        if pairs:
                            out.blocks_to_copy.extend(pairs)
                        break
                    victim = self.running[-1]
                    if victim is group:
                        budget += sum(s.num_new_tokens for s in out.scheduled[scheduled_before:])
                        # Copies already planned for this group must not run after a swap-out of
                        # their destination, so a group that preempts itself after planning a copy
                        # is recomputed.
                        del out.scheduled[scheduled_before:]
                        planned_copies = len(out.blocks_to_copy) > copies_before
                        del out.blocks_to_copy[copies_before:]
                        self._preempt(group, out, allow_swap=not planned_copies)
                        preempted_self = True
                        break
                    self._preempt(victim, out, allow_swap=True)
                    victims.add(id(victim))
                if preempted_self:
                    break
                self._schedule_seq(out, group, seq, num_new)
                budget -= num_new
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            if self.num_running_seqs + len(seqs) > self.config.max_num_seqs:
                break
            ids = [s.seq_id for s in seqs]
            if not self.kv.can_swap_in(ids):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(ids))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget = self._schedule_admitted(group, out, budget)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        burst = self.config.admission_burst
        if burst > 1 and self.running and self.waiting:
            free = self.config.max_num_seqs - self.num_running_seqs
            if free < min(burst, len(self.waiting)):
                return
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self.num_running_seqs + group.max_num_seqs > self.config.max_num_seqs:
                break
            seqs = group.unfinished_seqs()
            if not self._fits_empty_cache(group):
                self.waiting.popleft()
                blocks = self._blocks_needed_alone(group)
                out.aborted.append(
                    (group, f"needs {blocks} KV blocks but the cache has {self.kv.num_gpu_blocks}; "
                     "raise the KV budget or cache.num_blocks, or lower max_model_len")
                )
                continue
            if not self._allocate_group(group):
                break
            self.waiting.popleft()
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget = self._schedule_admitted(group, out, budget)

    def _allocate_group(self, group: SequenceGroup) -> bool:
        """Allocate every sequence of the group or none (a re-admitted n > 1 group has several)."""
        done: list[Sequence] = []
        # prompt_logprobs need every prompt position computed: such a request takes no prefix-cache hit.
        scope = self.kv.no_prefix_hits() if group.sampling.prompt_logprobs is not None else contextlib.nullcontext()
        with scope:
            for seq in group.unfinished_seqs():
                if not self.kv.can_allocate(seq.token_ids):
                    for d in done:
                        self.kv.free(d.seq_id)
                        d.num_computed_tokens = 0
                    return False
                seq.num_computed_tokens = self.kv.allocate(seq.seq_id, seq.token_ids)
                done.append(seq)
        if group.first_scheduled_time is None:
            group.num_cached_prompt_tokens = done[0].num_computed_tokens
        return True

    def _schedule_admitted(self, group: SequenceGroup, out: SchedulerOutput, budget: int) -> int:
        """Give a just-admitted (or swapped-in) group its tokens; never preempts."""
        for seq in group.unfinished_seqs():
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            need = seq.num_computed_tokens + num_new - self.kv.get_num_tokens(seq.seq_id)
            if need > 0:
                pairs = self.kv.try_append_slots(seq.seq_id, need)
                if pairs is None:
                    continue  # stays running; gets its slots in a later step
                out.blocks_to_copy.extend(pairs)
            self._schedule_seq(out, group, seq, num_new)
            budget -= num_new
        return budget

    def _schedule_seq(self, out: SchedulerOutput, group: SequenceGroup, seq: Sequence, num_new: int) -> None:
        out.scheduled.append(ScheduledSeq(group, seq, num_new))
        # Full blocks computed by this step enter the prefix cache now, so a request admitted later in
        # this same step can hit them: every layer writes the whole batch's K/V before any query
        # attends (the backend contract), so their KV exists by the time it is read.
        self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new)

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, allow_swap: bool) -> None:
        self.running.remove(group)
        group.num_preemptions += 1
        seqs = group.unfinished_seqs()
        ids = [s.seq_id for s in seqs]
        if self.config.preemption_mode == "swap" and allow_swap:
            if self.kv.can_swap_out(ids):
                out.blocks_to_swap_out.extend(self.kv.swap_out(ids))
                for seq in seqs:
                    seq.status = SequenceStatus.SWAPPED
                self.swapped.append(group)
                out.preempted_swap += 1
                return
            out.swap_fallbacks += 1
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
        out.preempted_recompute += 1

    # ---- after the step -----------------------------------------------------------------------
    def fork(self, group: SequenceGroup, new_seqs: list[Sequence]) -> None:
        """n > 1: the children share every block of the prompt sequence (copy-on-write later)."""
        parent = group.seqs[0]
        for child in new_seqs:
            self.kv.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
        group.seqs.extend(new_seqs)
        group.forked = True

    def free_seq(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self._freed = True

    def remove_finished(self) -> list[SequenceGroup]:
        """The running groups whose every sequence finished (each through free_seq), taken out."""
        if not self._freed:  # no sequence ended this step (most steps): nothing to look for
            return []
        self._freed = False
        done, running = [], []
        for g in self.running:  # one pass: this runs after every step
            (done if g.is_finished else running).append(g)
        self.running = running
        return done

    def abort_all(self) -> list[SequenceGroup]:
        """Drop every unfinished group (used on interrupt); frees their blocks."""
        groups = list(self.running) + list(self.swapped) + list(self.waiting)
        for g in groups:
            for seq in g.unfinished_seqs():
                if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                    self.kv.free(seq.seq_id)
                seq.finish("abort")
        self.running, self.swapped, self.waiting = [], GroupQueue(), GroupQueue()
        return groups

    # ---- helpers --------------------------------------------------------------------------------
    def _blocks_needed_alone(self, group: SequenceGroup) -> int:
        """Blocks the group needs to finish with the cache to itself: its n sequences share the prompt's
        full blocks and each needs its own for the rest."""
        longest = min(self.max_model_len, group.prompt_len + group.sampling.max_tokens)
        return self.kv.blocks_to_finish(group.prompt_len, longest, group.max_num_seqs)

    def _fits_empty_cache(self, group: SequenceGroup) -> bool:
        # A group that cannot finish alone would preempt itself forever: refuse it up front.
        return self._blocks_needed_alone(group) <= self.kv.num_gpu_blocks

    def check_invariants(self) -> None:
        for name, queue in (("waiting", self.waiting), ("swapped", self.swapped)):
            actual = sum(len(g.unfinished_seqs()) for g in queue)
            if queue.num_seqs != actual:
                raise AssertionError(f"{name} queue counts {queue.num_seqs} sequences, holds {actual}")
        seen: set[int] = set()
        for queue, status in ((self.running, SequenceStatus.RUNNING), (self.swapped, SequenceStatus.SWAPPED),
                              (self.waiting, SequenceStatus.WAITING)):
            for g in queue:
                for s in g.unfinished_seqs():
                    if s.seq_id in seen:
                        raise AssertionError(f"sequence {s.seq_id} is in two queues")
                    seen.add(s.seq_id)
                    if s.status is not status:
                        raise AssertionError(f"sequence {s.seq_id} has status {s.status} in the {status.value} queue")
                    if status is SequenceStatus.RUNNING and self.kv.get_num_tokens(s.seq_id) < s.num_computed_tokens:
                        raise AssertionError(f"sequence {s.seq_id}: table shorter than its computed tokens")
