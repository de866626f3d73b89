"""After sampling: append the token, decide whether the sequence is finished, and why.

Stop conditions, in vLLM's order of precedence: EOS (unless ignore_eos) and stop_token_ids, which
count only once min_tokens are out; stop strings, matched on the detokenised text and excluded from
it; then max_tokens and max_model_len (finish_reason "length").
"""
from __future__ import annotations

from pagedrun.engine.sequence import Sequence
from pagedrun.sampling_params import SamplingParams


def check_stop(seq: Sequence, params: SamplingParams, eos_token_ids: set[int], max_model_len: int, tokenizer) -> None:
    token = seq.token_ids[-1]
    num_out = seq.num_output_tokens
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.finish("stop", None)
            return
        if token in params.stop_token_ids:
            seq.finish("stop", token)
            return
        if params.stop and tokenizer is not None and _matches_stop_string(seq, params, tokenizer):
            return
    if num_out >= params.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish("length")


def _matches_stop_string(seq: Sequence, params: SamplingParams, tokenizer) -> bool:
    previous = len(seq.text)
    seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    longest = max(len(s) for s in params.stop)
    # A stop string can straddle the previous and the new token: search from just before the new text.
    window_start = max(0, previous - longest + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop:
        i = seq.text.find(stop, window_start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return False
    seq.stop_text_cut = best[0]
    seq.finish("stop", best[1])
    return True


def final_text(seq: Sequence, tokenizer) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    return text
