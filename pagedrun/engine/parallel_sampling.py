"""n above scheduler.max_num_seqs: the request runs as n requests of one sequence each.

A request with n <= max_num_seqs is one SequenceGroup that forks after its prompt (children share
every block). A group is admitted whole, so one whose n exceeds max_num_seqs could never be: it
would wait forever. pass@k evaluations ask n = 100-200 routinely, so such a request is fanned out
instead, as vLLM v1 does for every n > 1 (its ParentRequest): n child groups of n = 1, admitted as
room allows over as many steps as it takes, sharing the prompt's full blocks through the prefix
cache, and merged back into one output when the last child finishes.

Child k draws from the generator the fork would have given completion k (the request's seed plus
k times a stride; k = 0 is the seed itself), so a seeded or greedy request gives the same
completions whichever way it ran.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedrun.engine.sequence import SequenceGroup
from pagedrun.sampling_params import SamplingParams

CHILD_SEED_STRIDE = 0x9E3779B97F4A7C15  # children of one seeded request draw from distinct streams
_SEED_MASK = 2**64 - 1  # torch seeds are 64-bit; make_generator masks the same way


def child_seed(seed: int, k: int) -> int:
    """The seed of completion k of a request seeded with `seed` (k = 0: the seed itself)."""
    return (seed + k * CHILD_SEED_STRIDE) & _SEED_MASK


def child_sampling(sampling: SamplingParams, k: int) -> SamplingParams:
    seed = None if sampling.seed is None else child_seed(sampling.seed, k)
    return dataclasses.replace(sampling, n=1, seed=seed)


@dataclass(eq=False)
class ParentRequest:
    """The n child groups of one fanned-out request, collected as they finish."""

    n: int
    finished: dict[int, SequenceGroup] = field(default_factory=dict)  # child index -> its group
    error: str | None = None

    def child_done(self, group: SequenceGroup, error: str | None = None) -> list[SequenceGroup] | None:
        """Record a finished (or refused) child; the n groups in child order once all are in."""
        self.finished[group.child_index] = group
        if error is not None and self.error is None:
            self.error = error
        if len(self.finished) < self.n:
            return None
        return [self.finished[k] for k in range(self.n)]
