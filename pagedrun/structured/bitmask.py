"""One step's grammar masks: filled for every constrained row in one call, applied as one batch.

The sampler calls `apply_grammar_bitmasks` with the rows that carry a grammar; unconstrained rows
are not touched (a step without constrained rows never gets here). Per step:

1. each distinct matcher fills one bitmask row, 32 tokens per int32 word, in one pass (a prompt
   about to fork into n rows shares one matcher: one fill);
2. the rows are unpacked to one byte per token (numpy.unpackbits, little-endian bit order, which
   is llguidance's layout: token t is bit t % 32 of word t // 32);
3. the constrained rows of the logits get -inf where a token is not allowed, in one masked_fill.

Everything after this (temperature, top-k/p, seeded draws, logprobs) sees the masked logits, as in
vLLM, where the bitmask is applied to the logits before the sampler.
"""
from __future__ import annotations

import numpy as np
import torch


def fill_bitmasks(grammars: list, vocab_size: int, mask_vocab: int | None = None) -> torch.Tensor:
    """(len(grammars), ceil(mask_vocab / 32)) int32 bitmasks, one row per grammar, in one pass.

    mask_vocab: the grammar engine's vocabulary (the tokenizer's, when larger than the model's
    vocab_size); a grammar that allows only tokens at or past vocab_size fails, as the model cannot
    produce them. In the calling thread: 64 rows are quick (docs/log/2026-11-23-structured-outputs.md),
    and a thread pool (llguidance's LLExecutor) would compete for the cores torch's threads use."""
    words = (max(vocab_size, mask_vocab or 0) + 31) // 32
    bitmask = torch.empty((len(grammars), words), dtype=torch.int32)
    for i, g in enumerate(grammars):
        if g.error is None:
            try:
                g.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            except Exception as e:  # a limit of the grammar engine, met by this request alone
                g.fail(e)
            else:
                if g.matcher.is_error():
                    g.fail(g.matcher.get_error())
                elif not _any_below(bitmask[i], vocab_size) and not g.matcher.is_stopped():
                    g.fail("no token of the model's vocabulary can continue the grammar")
        if g.error is not None:
            # Any token: the row's draw stays finite, and the engine drops it with its request.
            bitmask[i].fill_(-1)
    return bitmask


def _any_below(row: torch.Tensor, vocab_size: int) -> bool:
    """Whether the bitmask row allows a token id below vocab_size."""
    full, rest = divmod(vocab_size, 32)
    if bool(row[:full].any()):
        return True
    return bool(rest) and bool(int(row[full]) & ((1 << rest) - 1))


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmasks as (rows, vocab_size) booleans: True where the token is NOT allowed (the words
    are inverted before unpacking: a pass over vocab/8 bytes instead of over vocab booleans)."""
    bits = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


def apply_grammar_bitmasks(logits: torch.Tensor, rows: list[int], grammars: list) -> None:
    """Set logits[rows[j], t] = -inf for every token t that grammars[j] does not allow, in place."""
    vocab = logits.shape[1]
    distinct: dict[int, int] = {}  # id(grammar) -> its bitmask row
    unique = []
    for g in grammars:
        if id(g) not in distinct:
            distinct[id(g)] = len(unique)
            unique.append(g)
    mask_vocab = max(g.mask_vocab for g in unique)
    masked = disallowed_tokens(fill_bitmasks(unique, vocab, mask_vocab), vocab)
    if len(unique) != len(grammars):
        masked = masked[torch.tensor([distinct[id(g)] for g in grammars])]
    if logits.device.type == "cuda":  # pinned: a non-blocking copy that does not wait for the forward
        masked = masked.pin_memory().to(logits.device, non_blocking=True)
    with torch.inference_mode():  # the model's logits are inference tensors: in place only in here
        if len(rows) == logits.shape[0]:  # every row constrained, in order
            logits.masked_fill_(masked, float("-inf"))
            return
        idx = torch.tensor(rows)
        if logits.device.type == "cuda":
            idx = idx.pin_memory().to(logits.device, non_blocking=True)
        logits[idx] = logits[idx].masked_fill_(masked, float("-inf"))
