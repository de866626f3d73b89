"""Hugging Face transformers as the oracle: greedy tokens (and logits) of HF generate, and random
prompts, shared by the model tests and the engine tests."""
from __future__ import annotations

import random

import torch


def hf_greedy(model_dir, prompts, max_new):
    """(tokens, logits) of HF greedy generate for each prompt, the full max_new tokens (no EOS)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    hf.generation_config.pad_token_id = 0
    tokens, logits = [], []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=max_new, do_sample=False, min_new_tokens=0,
            output_logits=True, return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append([step[0].float() for step in out.logits])
    return tokens, logits


_CACHE: dict = {}


def hf_greedy_cached(model_dir, prompts, max_new):
    """hf_greedy, computed once per (model, prompts, max_new) in the test session."""
    key = (str(model_dir), tuple(map(tuple, prompts)), max_new)
    if key not in _CACHE:
        _CACHE[key] = hf_greedy(model_dir, prompts, max_new)
    return _CACHE[key]


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
