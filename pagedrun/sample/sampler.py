"""The Sampler: logits of the sequences that produce a token this step -> one token id each.

Logit bias and penalties come first (sample/penalties.py), for the rows that ask for them. Greedy rows
take the argmax. Random rows are processed together: temperature, then top-k, top-p
and min-p masks, then one draw by the "exponential race" (argmax of p_i / E_i with E_i ~ Exp(1)),
which samples exactly from p. On the CPU each seeded sequence draws its E_i from its own
torch.Generator, one vocabulary-sized draw per token; on a GPU (or with rng="counter") they are a
hash of the seed, the token's position and the vocabulary index, computed on the device for all
rows at once (sample/counter_rng.py). Either way a sequence's tokens depend only on its seed and
its own history, never on which other requests share the batch or in which order they arrived.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrun.sample import counter_rng
from pagedrun.sample.argmax import argmax_rows
from pagedrun.sample.penalties import apply_penalties
from pagedrun.sample.transfer import to_device
from pagedrun.sampling_params import SamplingParams
from pagedrun.structured.bitmask import apply_grammar_bitmasks


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the engine-wide generator (unseeded requests)
    # The sequence's token ids (prompt then output) and prompt length, read by the penalties only.
    history: tuple[list[int], int] = ((), 0)
    grammar: Any = None  # structured/grammar.Grammar of a constrained sequence: masks its logits
    bad_words_ids: tuple = ()  # the token sequences of params.bad_words (bad_words_token_ids)
    # Position of the token drawn (the counter RNG's key); None: len(history[0]). With async
    # scheduling the history lacks the token still being sampled by the step before.
    position: int | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row, when that row asked for logprobs: {"logprob": lp of the sampled token,
    # "top": [[token_id, logprob], ...]} from the model's raw distribution (vLLM's default).
    logprobs: list[dict | None]
    # Rows that had nothing to sample from (NaN or infinite logits after penalties and masks), and why: their
    # token is a placeholder the engine never appends; the request fails alone (engine.py).
    errors: dict[int, str] = field(default_factory=dict)
    # Scheduled input index -> one entry per position of its chunk that precedes a prompt token
    # (prompt_logprobs; filled in by the worker): {"token_id", "logprob", "rank", "top"}.
    prompt_logprobs: dict[int, list[dict]] = field(default_factory=dict)


class PendingSample:
    """A step's samples, launched: `ids` stays on the device (async scheduling feeds it to the next
    step as input ids), the host copy is on its way; `result()` waits for it alone (a CUDA event),
    not for whatever was queued after it."""

    def __init__(self, sampler: "Sampler", ids: torch.Tensor, bad: torch.Tensor, rows: list[SamplingRow],
                 raw: torch.Tensor | None):
        self.ids, self._sampler, self._rows, self._raw = ids, sampler, rows, raw
        packed = torch.where(bad, torch.full_like(ids, -1), ids)
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        """The step's one read back: each row's id, -1 where the row had nothing to sample."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._sampler._finish(self._host.tolist(), self._rows, self._raw)
            self._raw = None
        return self._result


UNSAMPLEABLE = ("sampling: no finite distribution to sample from (NaN or infinite logits after logit_bias, "
                "penalties and temperature)")


def _bad_argmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[rows] bool: rows with nothing to sample, read at their argmax (no second pass over the
    vocabulary): argmax lands on a NaN where a row holds one, on +inf where one is, and a row that
    is -inf everywhere has -inf there; a finite value means the row is fine."""
    return ~torch.isfinite(logits.gather(1, ids.to(logits.device).view(-1, 1)).view(-1))


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class Sampler:
    def __init__(self, seed: int = 0, rng: str = "auto"):
        """rng: "generator" (a torch.Generator per seeded sequence, drawn on the CPU), "counter"
        (counter-based draws on the logits' device), or "auto": counter on CUDA, else generator."""
        if rng not in ("auto", "generator", "counter"):
            raise ValueError(f"rng must be auto, generator or counter, got {rng!r}")
        self.global_generator = make_generator(seed)
        self.seed = seed
        self.rng = rng
        self.num_calls = 0  # the unseeded rows' counter on the counter path

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """One token id per row, read back."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        """One token id per row, queued. On a GPU the only host synchronisation is the read of the ids
        (every row's id and whether it had anything to sample, in one tensor) in PendingSample.result:
        parameters go to the device through pinned memory (sample/transfer.py), nothing is read back
        mid-way."""
        params = {id(r.params): r.params for r in rows}.values()  # rows of one request share theirs: look once
        if all(r.grammar is None for r in rows) and all(p.is_greedy and p.logprobs is None and not p.has_penalties
                                                        for p in params):
            # The usual case: the argmax of the model's logits (widening bf16 is exact: the same
            # answer as on float32), no float32 copy, no row gather.
            ids = argmax_rows(logits)
            return PendingSample(self, ids, _bad_argmax(logits, ids), rows, None)
        raw = logits.float()
        device = raw.device
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:  # before everything else, as vLLM; unconstrained rows pay nothing
            apply_grammar_bitmasks(raw, constrained, [rows[i].grammar for i in constrained])
        bad_words = [r.bad_words_ids for r in rows]
        if any(bad_words):
            logits = apply_penalties(raw, [r.params for r in rows], [r.history for r in rows], bad_words)
        else:
            logits = apply_penalties(raw, [r.params for r in rows], [r.history for r in rows])
        num_rows, vocab = logits.shape

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        self.num_calls += 1
        if not random:  # no copy of the rows
            ids = argmax_rows(logits)
            return PendingSample(self, ids, _bad_argmax(logits, ids), rows, raw)
        token_ids = torch.zeros(num_rows, dtype=torch.long, device=device)
        bad = torch.zeros(num_rows, dtype=torch.bool, device=device)
        if greedy:
            idx = to_device(greedy, torch.long, device)
            sub = logits[idx]
            g_ids = argmax_rows(sub)
            token_ids[idx] = g_ids.to(device)
            bad[idx] = _bad_argmax(sub, g_ids)
        idx = to_device(random, torch.long, device)
        sub = logits[idx]
        probs = self._processed_probs(sub, [rows[i].params for i in random])
        top = probs.amax(dim=-1)
        # Nothing to sample: NaN or infinite logits (after bias and penalties), or probabilities that
        # are not finite or all 0 (e.g. a temperature that overflowed). Such a row draws from a
        # placeholder; its id is never appended and its request fails alone.
        r_bad = ~torch.isfinite(sub.amax(dim=-1)) | ~torch.isfinite(top) | (top <= 0)
        probs = torch.where(r_bad[:, None], torch.ones((), device=device), probs)
        if self.rng == "counter" or (self.rng == "auto" and device.type == "cuda"):
            exp = counter_rng.exponentials(self._keys(rows, random), vocab, device)
        else:
            exp = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(random) if rows[i].generator is None]
            if unseeded:
                exp[unseeded] = torch.empty(len(unseeded), vocab).exponential_(generator=self.global_generator).to(
                    exp.device
                )
            for j, i in enumerate(random):
                g = rows[i].generator
                if g is not None:
                    exp[j] = torch.empty(vocab).exponential_(generator=g).to(exp.device)
        token_ids[idx] = (probs / exp).argmax(dim=-1)
        bad[idx] = r_bad
        return PendingSample(self, token_ids, bad, rows, raw)

    def _finish(self, got: list[int], rows: list[SamplingRow], raw: torch.Tensor | None) -> SampleResult:
        """The result of the ids read back (-1: nothing to sample): errors, logprobs."""
        errors = {i: UNSAMPLEABLE for i, t in enumerate(got) if t < 0}
        if errors:
            got = [max(t, 0) for t in got]  # a placeholder the engine never appends
        if raw is None:
            return SampleResult(got, [None] * len(rows), errors)
        return SampleResult(got, self._logprobs(raw, rows, got), errors)

    def _keys(self, rows: list[SamplingRow], random: list[int]) -> list[int]:
        """The counter path's key per random row: (seed, position of the token drawn); unseeded rows
        take the run's seed, this call's number and the row's place (no reproducibility promised)."""
        keys = []
        for j, i in enumerate(random):
            g, history = rows[i].generator, rows[i].history
            if g is not None:
                pos = rows[i].position
                keys.append(counter_rng.row_key(g.initial_seed(), len(history[0]) if pos is None else pos))
            else:
                keys.append(counter_rng.row_key(self.seed ^ (self.num_calls << 20), (1 << 31) + j))
        return keys

    @staticmethod
    def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temp = to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1)
        logits = logits / temp
        top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[1], device=device).unsqueeze(0)
            mask = ranks >= to_device(top_k, torch.long, device).unsqueeze(1)
            sorted_probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p; the top one stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            mask |= mass_before >= to_device(top_p, torch.float32, device).unsqueeze(1)
            mask[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(p > 0.0 for p in min_p):
            threshold = to_device(min_p, torch.float32, device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], ids: list[int]) -> list[dict | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[dict | None] = [None] * len(rows)
        if not wanted:
            return result
        lp = logits[wanted].log_softmax(dim=-1)
        max_n = max(rows[i].params.logprobs or 0 for i in wanted)
        top_vals, top_ids = (lp.topk(max_n, dim=-1) if max_n > 0 else (None, None))
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs or 0
            top = []
            if n > 0:
                top = [[int(t), float(v)] for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())]
            result[i] = {"token_id": ids[i], "logprob": float(lp[j, ids[i]]), "top": top}
        return result
