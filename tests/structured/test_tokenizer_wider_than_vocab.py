"""A tokenizer larger than the model's vocabulary (added tokens past config.vocab_size) runs constrained
requests: the grammar engine gets the tokenizer's vocabulary, masks are that wide, and the sampler uses
the bits of the model's tokens only (issue 40, item 8)."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from tiny_models import make_tiny_model
from tiny_tokenizer import write_tiny_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams
from pagedrun.structured.bitmask import _any_below

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                reason='the optional extra: pip install -e ".[structured]"')
VOCAB = 640  # the tiny models' config.vocab_size


def widen(model_dir, size: int):
    """Add tokens to the tokenizer until it has `size` entries."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens([f"<extra{i}>" for i in range(size - tok.get_vocab_size())])
    tok.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.fixture(scope="module", params=[VOCAB + 1, VOCAB + 31, VOCAB + 33, 2 * VOCAB], ids=lambda n: f"tok{n}")
def model(tmp_path_factory, request):
    d = make_tiny_model("llama", tmp_path_factory.mktemp("wide") / "m", seed=4)
    return widen(write_tiny_tokenizer(d), request.param)


SPECS = [({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
         ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
         ({"json": {"type": "object", "required": ["a"], "additionalProperties": False,
                    "properties": {"a": {"type": "integer"}}}, "disable_any_whitespace": True},
          lambda t: isinstance(json.loads(t)["a"], int))]


def test_constrained_requests_run(model):
    llm = LLM(load_recipe(None, [f"model.path={model}", "cache.num_blocks=128", "cache.block_size=8"]))
    assert len(llm.tokenizer) > llm.engine.model_config.vocab_size == VOCAB
    params = [SamplingParams(max_tokens=40, seed=i, temperature=1.0, structured_outputs=spec)
              for i, (spec, _) in enumerate(SPECS)]
    outs = llm.generate(["a b c"] * len(SPECS), params, use_tqdm=False)
    for o, (_, ok) in zip(outs, SPECS):
        assert o.error is None, o.error
        assert all(t < VOCAB for t in o.outputs[0].token_ids)
        assert ok(o.outputs[0].text), o.outputs[0].text


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 640, 645])
def test_any_below_reads_only_the_model_tokens(vocab):
    words = (max(vocab, 700) + 31) // 32
    for allowed in (0, vocab - 1, vocab, vocab + 1, 699):
        row = torch.zeros(words, dtype=torch.int32)
        word, bit = divmod(allowed, 32)
        row[word] = torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        assert _any_below(row, vocab) == (allowed < vocab), (vocab, allowed)
