"""Async scheduling: the host schedules step n+1 while the device runs step n (vLLM's
async_scheduling, SGLang's overlap scheduler).

Without it a step is schedule -> launch -> read back -> update, and the GPU idles while the host
schedules, fills buffers and checks stops (GPU-ROOFLINE.md: after CUDA graphs this is what bounds
a small model's step). With it LLMEngine.step is

    schedule n+1 -> launch n+1 -> read back n -> update n

so that everything the host does between two read-backs overlaps the device's work on the step
queued behind. What makes step n+1 schedulable before n's tokens are known:

- A sequence that samples in step n counts one pending token (Sequence.num_pending): the
  scheduler gives it its slot and position as for any decode token, and the worker writes the
  input id on the device from step n's samples (worker/model_runner.py: Feed), stream-ordered
  after the sampler that produced it. A sequence whose next token ends it by length
  (max_tokens, max_model_len) counts none: it is not scheduled again.
- A stop found when n is read back (EOS, a stop token or string) is one step late: the
  sequence's row in n+1 ran and its token is dropped. The tokens are those of the synchronous
  loop; greedy and seeded rows are equal token for token (the counter RNG is keyed by the
  token's position, given with the row), unseeded random rows are not reproducible either way.
- Preempting a sequence whose token is still pending would lose that token, so a step is
  scheduled ahead only when no running sequence can lack a block (may_schedule_ahead);
  otherwise step n is read back first, as without async scheduling.
- A step whose next inputs need the sampled token on the host (penalties and bad words read the
  history, a grammar its state, logprobs and prompt logprobs are read back, a prompt forks into
  n) is read back at once (`ahead` false).

Freeing is safe while a step is in flight because every launch is ordered on one stream: a block
given back when n is read back and handed to another sequence in n+2 is written after n+1 ran.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedrun.engine.scheduler import Scheduler, SchedulerOutput

PENDING = 0  # the input id written for a pending token; the device overwrites it before any use


def async_setting(setting: str, device_type: str) -> tuple[bool, str]:
    """Whether steps are scheduled ahead, and the start-up line that says so."""
    if setting == "false":
        return False, "async scheduling: off (scheduler.async_scheduling is false)"
    if setting == "auto" and device_type != "cuda":
        return False, (f"async scheduling: off (the model runs on {device_type}: the host computes the "
                       "step itself, there is nothing to overlap)")
    if device_type != "cuda":
        return True, f"async scheduling: on (on {device_type} it overlaps nothing; the tokens are the same)"
    return True, "async scheduling: on (step n+1 is scheduled while step n runs)"


def may_schedule_ahead(scheduler: Scheduler, kv) -> bool:
    """Whether the next step can be scheduled before the one in flight is read back: when every
    running sequence surely gets the blocks its next tokens need, so that none is preempted. u more
    tokens need at most ceil(u / block_size) new blocks, and one more where a forked sibling shares
    the block written next (copy on write); in every KV cache group."""
    bs = kv.block_size
    need = 0
    for g in scheduler.running:
        cow = len(g.seqs) > 1
        for seq in g.unfinished_seqs():
            u = len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens
            if u:
                need += -(-u // bs) + cow
    return kv.num_free_gpu_blocks >= need * len(getattr(kv, "managers", (kv,)))


@dataclass
class InFlight:
    """A launched step: what was scheduled, the worker's handle on its samples, and per sampling
    sequence [scheduled seq, fan, generators, counted a pending token]."""
    out: SchedulerOutput
    launched: object  # worker.LaunchedStep
    row_owner: list[list]
    t_start: float
    # async scheduling is on and nothing in the step needs its tokens on the host before the next
    # step is scheduled
    ahead: bool
    num_decode_tokens: int  # counted at launch: the record reads it after the sequences advanced

    def count_pending(self, max_model_len: int) -> dict[int, int]:
        """Each sampling sequence that will run again counts its token as pending; the row of the
        samples it will read it from, by seq_id. Called for a step launched `ahead` only."""
        rows: dict[int, int] = {}
        j = 0
        for entry in self.row_owner:
            s, fan = entry[0], entry[1]
            seq = s.seq
            total = len(seq.token_ids) + seq.num_pending + 1  # its tokens once this one is sampled
            if fan == 1 and total - seq.prompt_len < s.group.sampling.max_tokens and total < max_model_len:
                seq.num_pending += 1
                entry[3] = True
                rows[seq.seq_id] = j
            j += fan
        return rows

    def settle(self) -> None:
        """Its samples were read back: the pending tokens become tokens (the engine appends them)."""
        if not self.ahead:  # count_pending did not run
            return
        for entry in self.row_owner:
            if entry[3]:
                entry[0].seq.num_pending -= 1
