"""Logit bias and penalties, applied to the rows of a batch that ask for them, before sampling.

In vLLM v1's order (logits processors, then penalties), on the float32 logits of the step:

| field                | what it does to logit l_t of token t                   | history it counts |
|----------------------|--------------------------------------------------------|-------------------|
| `allowed_token_ids`  | l_t = -inf for every t not in the list                 | -                 |
| `bad_words`          | l_t = -inf where t ends a banned sequence (vLLM's rule) | output only       |
| `logit_bias`         | l_t += bias_t                                          | -                 |
| `repetition_penalty` | l_t /= r if l_t > 0 else l_t *= r  (HF, vLLM; CTRL)    | prompt + output   |
| `frequency_penalty`  | l_t -= f * count_t                                     | output only       |
| `presence_penalty`   | l_t -= p * (count_t > 0)                               | output only       |

(OpenAI's formula for the last two; "output" are the tokens this sequence generated so far.)
Greedy rows take the argmax of the result, random rows go on to temperature and the top-k/p masks.
Logprobs stay those of the model's raw distribution (vLLM's default), so they are computed from
the logits as they were before this module.

The whole batch's counts are built with one scatter-add: rows without penalties pay nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedrun.sample.transfer import host_to_device, to_device
from pagedrun.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], int]],
                    bad_words_ids: Sequence[Sequence[Sequence[int]]] | None = None) -> torch.Tensor:
    """`logits` [rows, vocab] float32 with bias and penalties applied (a new tensor if any applied).

    `histories[i]` is (token ids, prompt length) of row i's sequence: prompt followed by output;
    `bad_words_ids[i]` the token sequences row i's bad_words stand for (bad_words_token_ids).
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    device = logits.device
    idx = to_device(rows, torch.long, device)
    sub = logits[idx]

    for j, i in enumerate(rows):
        allowed = params[i].allowed_token_ids
        if allowed is not None:
            keep = to_device([t for t in allowed if t < vocab], torch.long, device)
            masked = torch.full_like(sub[j], float("-inf"))
            masked[keep] = sub[j, keep]
            sub[j] = masked
        if bad_words_ids is not None and bad_words_ids[i]:
            tokens, prompt_len = histories[i]
            output = list(tokens[prompt_len:])
            for word in bad_words_ids[i]:
                # vLLM's rule: ban the word's last token where the output ends with the rest of it.
                prefix = list(word[:-1])
                if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix) \
                        and word[-1] < vocab:
                    sub[j, word[-1]] = float("-inf")

    bias_rows, bias_toks, bias_vals = [], [], []
    for j, i in enumerate(rows):
        for tok, b in params[i].logit_bias.items():
            bias_rows.append(j)
            bias_toks.append(tok)
            bias_vals.append(b)
    if bias_rows:
        sub.index_put_((to_device(bias_rows, torch.long, device), to_device(bias_toks, torch.long, device)),
                       to_device(bias_vals, torch.float32, device), accumulate=True)

    rep = [j for j, i in enumerate(rows) if params[i].repetition_penalty != 1.0]
    if rep:
        seen = _scatter_counts([histories[rows[j]][0] for j in rep], vocab, device) > 0
        r = to_device([params[rows[j]].repetition_penalty for j in rep], torch.float32, device).unsqueeze(1)
        rep_idx = to_device(rep, torch.long, device)
        x = sub[rep_idx]
        sub[rep_idx] = torch.where(seen, torch.where(x > 0, x / r, x * r), x)

    additive = [j for j, i in enumerate(rows) if params[i].frequency_penalty or params[i].presence_penalty]
    if additive:
        counts = _scatter_counts([histories[rows[j]][0][histories[rows[j]][1]:] for j in additive], vocab, device)
        f = to_device([params[rows[j]].frequency_penalty for j in additive], torch.float32, device).unsqueeze(1)
        p = to_device([params[rows[j]].presence_penalty for j in additive], torch.float32, device).unsqueeze(1)
        sub[to_device(additive, torch.long, device)] -= f * counts + p * (counts > 0).float()

    logits[idx] = sub
    return logits


def _scatter_counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts
    # One flat array of every list (numpy, not a Python list of the tokens), one copy to the device.
    flat = host_to_device(torch.from_numpy(np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])),
                          device)
    row = torch.repeat_interleave(torch.arange(len(token_lists), device=device), to_device(lengths, torch.long, device))
    counts.index_put_((row, flat), torch.ones(len(flat), device=device), accumulate=True)
    return counts
