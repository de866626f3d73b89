"""Incremental detokenization for stop strings (engine/output_processor.py): after every token the
text is a prefix of the full decode of the output, and equal to it once no UTF-8 sequence is left
unfinished; random token ids, multi-byte text, whitespace runs and code, on the default model's
tokenizer."""
from __future__ import annotations

import random

import pytest

from pagedrun.engine.output_processor import detokenize_incrementally
from pagedrun.engine.sequence import Sequence

TEXTS = ["Hello world, ça va? 日本語のテキスト 🙂🙃 naïve café\n\n  spaces  and\ttabs",
         "def f(x):\n    return x**2  # é", " leading space, then   three"]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from pagedrun.models.loader import load_tokenizer

    return load_tokenizer(default_model)


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_is_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    if seed % 2:
        ids = tokenizer.encode(rng.choice(TEXTS) * 2, add_special_tokens=False)
    else:  # anything, special tokens and stray UTF-8 fragments included
        ids = [rng.randrange(len(tokenizer)) for _ in range(50)]
    seq = Sequence(0, 1, [0])
    for t in ids:
        seq.token_ids.append(t)
        seq.text = detokenize_incrementally(seq, tokenizer)
        full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        assert full.startswith(seq.text)
        if not full.endswith("\ufffd"):
            assert seq.text == full
    # The decode is incremental: the context never reaches back to the first token of a long output.
    assert seq.detok_prefix > 0
