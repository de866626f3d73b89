"""Decode speed of a Gemma-3-270m-shaped model against a Llama of the same sizes, both random.

Both: 18 layers, hidden 640, 4 heads of 256, 1 KV head, MLP 2048, vocabulary 262144, tied
embeddings. The Gemma model adds its sandwich norms, q/k norms, GeGLU, and sliding windows of 512
on five layers in six (with --window 0: every layer full). Each model is written once as a random
bf16 checkpoint under $PAGEDRUN_CACHE/bench/, then run through LLM.generate: --batch sequences of
--prompt random tokens, --tokens greedy tokens each. Decode tok/s = tokens sampled by decode-only
steps / those steps' wall time (the engine's step records).

    python benchmarks/gemma_decode.py [--dtype bfloat16] [--threads 2] [--batch 8] [--prompt 600]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SIZES = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
             num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
             tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def build(kind: str, root: Path, window: int) -> Path:
    """A random bf16 checkpoint of `kind` ("gemma3" or "llama"), built once."""
    import transformers

    path = root / f"{kind}-270m-shape-w{window}"
    if (path / "config.json").is_file():
        return path
    if kind == "gemma3":
        layer_types = [("sliding_attention" if (i + 1) % 6 else "full_attention") if window else "full_attention"
                       for i in range(SIZES["num_hidden_layers"])]
        config = transformers.Gemma3TextConfig(**SIZES, query_pre_attn_scalar=256, sliding_window=window or 512,
                                               layer_types=layer_types,
                                               rope_parameters={"full_attention": {"rope_type": "default",
                                                                                   "rope_theta": 1e6},
                                                                "sliding_attention": {"rope_type": "default",
                                                                                      "rope_theta": 1e4}})
        config.architectures = ["Gemma3ForCausalLM"]
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**{**SIZES}, rope_theta=1e6)
        config.architectures = ["LlamaForCausalLM"]
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def decode_rate(model_dir: Path, dtype: str, threads: int, batch: int, prompt: int, tokens: int) -> dict:
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    llm = LLM(None, [f"model.path={model_dir}", f"model.dtype={dtype}", f"model.threads={threads}",
                     "model.max_model_len=2048", "cache.block_size=16", f"cache.num_blocks={batch * 48 + 16}"])
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 262144) for _ in range(prompt)]} for _ in range(batch)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    steps = [s for s in llm.engine.steps if s.num_prefill_tokens == 0]
    decode_s = sum(s.t_end - s.t_start for s in steps)
    sampled = sum(s.num_sampled_tokens for s in steps)
    model = llm.engine.worker.model
    return {"model": model_dir.name, "dtype": dtype, "threads": threads, "batch": batch, "prompt": prompt,
            "decode_tok_s": round(sampled / decode_s, 1), "decode_steps": len(steps), "wall_s": round(wall, 1),
            "layer_runner": model.layer_runner is not None, "attention": llm.engine.worker.backend.last_path}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--models", default="llama,gemma3")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedrun.build.cache import private_dir

    root = private_dir("bench")
    for kind in args.models.split(","):
        path = build(kind, root, args.window if kind == "gemma3" else 0)
        print(json.dumps(decode_rate(path, args.dtype, args.threads, args.batch, args.prompt, args.tokens)),
              flush=True)


if __name__ == "__main__":
    main()
