"""After sampling: append the token, decide whether the sequence is finished, and why.

Stop conditions, in vLLM's order of precedence: EOS (unless ignore_eos) and stop_token_ids, which
count only once min_tokens are out; stop strings, matched on the detokenised text and excluded from
it (kept with include_stop_str_in_output, as is the text of a stop token); then max_tokens and
max_model_len (finish_reason "length").
The text is decoded with the request's skip_special_tokens and spaces_between_special_tokens.
"""
from __future__ import annotations

from pagedrun.engine.sequence import Sequence
from pagedrun.sampling_params import SamplingParams


def check_stop(seq: Sequence, params: SamplingParams, eos_token_ids: set[int], max_model_len: int, tokenizer) -> None:
    ids = seq.token_ids
    token = ids[-1]
    num_out = len(ids) - seq.prompt_len
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.finish("stop", None)
            return
        if token in params.stop_token_ids:
            seq.finish("stop", token)
            return
        if params.stop and tokenizer is not None and _matches_stop_string(seq, params, tokenizer):
            return
    if num_out >= params.max_tokens or len(ids) >= max_model_len:
        seq.finish("length")


def _matches_stop_string(seq: Sequence, params: SamplingParams, tokenizer) -> bool:
    previous = len(seq.text)
    seq.text = detokenize_incrementally(seq, tokenizer, decode_options(params))
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
    seq.stop_text_cut = best[0] + (len(best[1]) if params.include_stop_str_in_output else 0)
    seq.finish("stop", best[1])
    return True


def decode_options(params: SamplingParams) -> dict:
    """tokenizer.decode's keyword arguments for the request's text (vLLM's two fields; the second
    only changes what slow tokenizers write, as in vLLM)."""
    if params.spaces_between_special_tokens:
        return {"skip_special_tokens": params.skip_special_tokens}
    return {"skip_special_tokens": params.skip_special_tokens, "spaces_between_special_tokens": False}


def detokenize_incrementally(seq: Sequence, tokenizer, options: dict | None = None) -> str:
    """seq.text with the newest output tokens' text added, decoding a few tokens, not all of them
    (vLLM's incremental detokenizer, on decode()): tokens [detok_prefix, detok_read) are decoded
    again as context, so that a word piece's leading space comes out as the full decode gives it,
    and the new tokens add what decoding them with that context adds. A decode that ends in an
    unfinished UTF-8 sequence adds nothing yet (its bytes come with the next token). Where the
    context's text is not a prefix of the longer decode the whole output is decoded once again.
    Re-decoding the whole output every step made stop strings quadratic in the output's length."""
    tokens = seq.output_token_ids
    options = options if options is not None else {"skip_special_tokens": True}
    context = tokenizer.decode(tokens[seq.detok_prefix : seq.detok_read], **options)
    text = tokenizer.decode(tokens[seq.detok_prefix :], **options)
    if text.endswith("\ufffd") or len(text) <= len(context):
        return seq.text
    if not text.startswith(context):
        seq.detok_prefix = seq.detok_read = len(tokens)
        return tokenizer.decode(tokens, **options)
    seq.detok_prefix, seq.detok_read = seq.detok_read, len(tokens)
    return seq.text + text[len(context) :]


def final_text(seq: Sequence, tokenizer, params: SamplingParams | None = None) -> str:
    if tokenizer is None:
        return ""
    options = decode_options(params) if params is not None else {"skip_special_tokens": True}
    tokens = seq.output_token_ids
    if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and tokens and \
            not (params is not None and params.include_stop_str_in_output):
        tokens = tokens[:-1]  # vLLM's: the EOS or stop token that ended it is not text (unless asked)
    text = tokenizer.decode(tokens, **options)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    return text
