"""Benchmark workloads and the benchmark's own model, both deterministic from a seed.

    standard       64 requests, prompts of U[16, 256] random token ids, max_tokens U[16, 128], ignore_eos
    shared-prefix  32 requests: one 256-token prefix + U[16, 64] distinct tokens, max_tokens 64, ignore_eos
    PROMPTS.jsonl  any requests file `pagedrun generate` reads (run greedy, n = 1)

The "tiny-llama" model is a random-initialised Llama (vocab 4000, hidden 512, 8 layers, 8 heads,
4 KV heads, head_dim 64, intermediate 1536: 29.4M parameters), written once with transformers'
own save_pretrained under $PAGEDRUN_CACHE/bench/ so every engine loads the same files.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from pagedrun.errors import PagedrunError

TINY_LLAMA = dict(vocab_size=4000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
TINY_LLAMA_SEED = 0
# Token ids drawn for prompts stay clear of the specials (0 pad, 1 bos, 2 eos) of the tiny model.
_FIRST_ID = 3


@dataclass
class BenchRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True


def standard(vocab_size: int, seed: int = 0, num_requests: int = 64, prompt_len: tuple[int, int] = (16, 256),
             max_tokens: tuple[int, int] = (16, 128)) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        n = rng.randint(*prompt_len)
        ids = [rng.randrange(_FIRST_ID, vocab_size) for _ in range(n)]
        out.append(BenchRequest(f"std-{i}", ids, rng.randint(*max_tokens)))
    return out


def shared_prefix(vocab_size: int, seed: int = 0, num_requests: int = 32, prefix_len: int = 256,
                  suffix_len: tuple[int, int] = (16, 64), max_tokens: int = 64) -> list[BenchRequest]:
    rng = random.Random(seed + 1)
    prefix = [rng.randrange(_FIRST_ID, vocab_size) for _ in range(prefix_len)]
    out = []
    for i in range(num_requests):
        suffix = [rng.randrange(_FIRST_ID, vocab_size) for _ in range(rng.randint(*suffix_len))]
        out.append(BenchRequest(f"pfx-{i}", prefix + suffix, max_tokens))
    return out


def make_workload(name: str, vocab_size: int, quick: bool, seed: int = 0) -> list[BenchRequest]:
    """quick: the same shapes, scaled down so three engines (one of them HF static batching) run in
    well under a minute each on two cores."""
    if name == "standard":
        if quick:
            return standard(vocab_size, seed, num_requests=12, prompt_len=(16, 96), max_tokens=(8, 32))
        return standard(vocab_size, seed)
    if name == "shared-prefix":
        if quick:
            return shared_prefix(vocab_size, seed, num_requests=8, prefix_len=64, suffix_len=(8, 24), max_tokens=16)
        return shared_prefix(vocab_size, seed)
    raise PagedrunError(f"--workload: {name!r} is not standard, shared-prefix or an existing .jsonl file")


def from_requests(requests) -> list[BenchRequest]:
    """Requests parsed by pagedrun's reader (pagedrun.io.requests.Request) -> greedy bench requests."""
    out = []
    for r in requests:
        s = r.sampling
        if s.n != 1 or s.stop:
            raise PagedrunError(f"prompts:{r.line}: bench runs n = 1 without stop strings (found n={s.n}, "
                                f"stop={s.stop!r})")
        out.append(BenchRequest(r.id, list(r.prompt_token_ids), s.max_tokens, bool(s.ignore_eos)))
    return out


def tiny_llama_dir(cache_root: Path | None = None) -> Path:
    """The bench's 29M random Llama, built on first use (a few seconds) and reused after."""
    if cache_root is None:
        from pagedrun.models.default_model import cache_root as default_root

        cache_root = default_root()
    target = Path(cache_root) / "bench" / "tiny-llama-29m"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    import transformers

    config = transformers.LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(TINY_LLAMA_SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        model.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a half-written directory is never mistaken for the model
    except OSError as e:
        if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
            return target  # a concurrent bench published it first
        raise PagedrunError(f"bench: cannot write the tiny model under {target.parent} ({e.strerror or e}); "
                            "set PAGEDRUN_CACHE to a writable directory") from None
    return target
