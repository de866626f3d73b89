"""A byte-level BPE tokenizer small enough for the tiny random models (vocab 640), written beside one.

The tiny models ship no tokenizer; structured outputs need one (the grammar engine maps grammar
bytes to token ids). Trained with `tokenizers` on a small JSON-flavoured corpus, so that JSON
punctuation, digits and a few words are multi-byte tokens, as in a real vocabulary. Special tokens
<unk>, <s>, </s> are ids 0, 1, 2: the tiny models' bos_token_id 1 and eos_token_id 2.
"""
from __future__ import annotations

import json
from pathlib import Path

_CORPUS = [
    '{"name": "Alice", "age": 31, "tags": ["a", "b"]}',
    '{"label": "positive"} {"label": "negative"} {"label": "neutral"}',
    '[1, 2, 3] {"ok": true, "value": null, "x": -4.5e3} 2024-01-31 ABC-1234',
    "the quick brown fox jumps over the lazy dog 0123456789",
    '{"city": "Paris", "country": "France", "population": 2148000}',
] * 20


def write_tiny_tokenizer(model_dir: Path, vocab_size: int = 600) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    model_dir = Path(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512,
    }))
    return model_dir
