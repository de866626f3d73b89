"""The oracle on the real default model, through the whole engine (paged cache, batching, chat
template): greedy tokens equal HF transformers' generate on the materialised SmolLM2 directory."""
from __future__ import annotations

import pytest
import torch

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM

MAX_TOKENS = 16


@pytest.mark.slow
def test_default_model_engine_greedy_equals_hf():
    from transformers import AutoModelForCausalLM

    from pagedrun.models.default_model import default_model_dir

    recipe = load_recipe(None, [f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true",
                                "cache.num_blocks=64", "cache.block_size=16",
                                "scheduler.max_num_batched_tokens=256"])  # keeps the start-up profile short
    llm = LLM(recipe)
    prompts = [
        "The capital of France is",
        {"messages": [{"role": "user", "content": "Name three primary colours."}]},
        "Once upon a time, in a small village by the sea,",
        {"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "What is 12 times 12?"}]},
        "def fibonacci(n):",
    ]
    requests = llm.make_requests(prompts)
    outs = llm.run(requests)

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    for req, out in zip(requests, outs):
        ids = torch.tensor([req.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist(), req.prompt or req.messages
    assert "Paris" in outs[0].outputs[0].text
