"""A finished request's RequestOutput, from its sequence groups (one, or the n of a request fanned
out over several: engine/parallel_sampling.py): completions, the request's timeline and, where
asked, its prompt logprobs in vLLM's shape."""
from __future__ import annotations

from pagedrun.engine.output_processor import final_text
from pagedrun.engine.sequence import SequenceGroup
from pagedrun.outputs import CompletionOutput, Logprob, RequestOutput


class OutputBuilder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # a token id's text (prompt_logprobs' decoded_token)

    def build(self, groups: list[SequenceGroup]) -> RequestOutput:
        """The output of a request whose groups all finished without an error."""
        first = groups[0]
        seqs = [s for grp in groups for s in grp.seqs]
        with_logprobs = first.sampling.logprobs is not None
        completions = [
            CompletionOutput(i, final_text(s, self.tokenizer, first.sampling), s.output_token_ids, s.finish_reason,
                             s.stop_reason, s.logprobs if with_logprobs else None,
                             sum(e["logprob"] for e in s.logprobs) if with_logprobs else None,
                             structured_output_incomplete=s.structured_incomplete)
            for i, s in enumerate(seqs)
        ]
        arrival = first.arrival_time
        t = sorted({x for grp in groups for x in grp.token_times})  # steps that produced a token
        itl = [b - a for a, b in zip(t, t[1:])]
        metrics = {
            "queued_s": _round(min(grp.first_scheduled_time or arrival for grp in groups) - arrival),
            "ttft_s": _round(min(grp.first_token_time or arrival for grp in groups) - arrival),
            "e2e_s": _round(max(grp.finished_time or arrival for grp in groups) - arrival),
            "mean_itl_s": _round(sum(itl) / len(itl)) if itl else None,
            "itl_s": [_round(x) for x in itl],
        }
        return RequestOutput(first.request_id, first.index, first.seqs[0].token_ids[: first.prompt_len],
                             completions, first.num_cached_prompt_tokens,
                             sum(grp.num_preemptions for grp in groups), metrics,
                             **self._prompt_logprobs(first))

    def _prompt_logprobs(self, g: SequenceGroup) -> dict:
        """RequestOutput's prompt_logprobs (vLLM's {token_id: Logprob} per position) and the entries
        they came from (the output files' shape); nothing for a request that did not ask."""
        if g.sampling.prompt_logprobs is None:
            return {}
        entries = g.prompt_logprobs or [None] * g.prompt_len
        text = self._token_text
        vllm: list[dict[int, Logprob] | None] = []
        for e in entries:
            if e is None:
                vllm.append(None)
                continue
            d = {t: Logprob(lp, r + 1, text(t)) for r, (t, lp) in enumerate(e["top"])}
            d[e["token_id"]] = Logprob(e["logprob"], e["rank"], text(e["token_id"]))
            vllm.append(d)
        return {"prompt_logprobs": vllm, "prompt_logprob_entries": entries}

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        got = self._token_texts.get(token_id)
        if got is None:
            if len(self._token_texts) > 1 << 16:
                self._token_texts.clear()
            got = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return got


def _round(x: float) -> float:
    return round(x, 6)
