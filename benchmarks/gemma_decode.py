"""Decode speed of a Gemma-3-270m-shaped model against a Llama of the same sizes, both random.

Both: 18 layers, hidden 640, 4 heads of 256, 1 KV head, MLP 2048, vocabulary 262144, tied
embeddings. The Gemma model adds its sandwich norms, q/k norms, GeGLU, and sliding windows of 512
on five layers in six (with --window 0: every layer full). Each model is written once as a random
bf16 checkpoint under $PAGEDRUN_CACHE/bench/, then run through LLM.generate: --batch sequences of
--prompt random tokens, --tokens greedy tokens each. Decode tok/s = batch / the median wall time of
the decode-only steps (the engine's step records: the median, as other processes share the cores).
--no-runner runs every model's Python layer loop (the C++ layer runner off).

    python benchmarks/gemma_decode.py [--dtype bfloat16] [--threads 2] [--batch 8] [--prompt 600]
        [--window 512] [--models llama,gemma3,gemma3:0] [--repeat 2] [--no-runner]
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


def make_llm(model_dir: Path, dtype: str, threads: int, batch: int, runner: bool, tokens_per_seq: int):
    from pagedrun.llm import LLM

    blocks = batch * -(-tokens_per_seq // 16) + 16
    llm = LLM(None, [f"model.path={model_dir}", f"model.dtype={dtype}", f"model.threads={threads}",
                     "model.max_model_len=4096", "cache.block_size=16", f"cache.num_blocks={blocks}"])
    if not runner:
        llm.engine.worker.model.layer_runner = None
    return llm


def decode_rate(llm, batch: int, prompt: int, tokens: int) -> dict:
    from pagedrun.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 262144) for _ in range(prompt)]} for _ in range(batch)]
    first = len(llm.engine.steps)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    steps = sorted(s.t_end - s.t_start for s in llm.engine.steps[first:] if s.num_prefill_tokens == 0)
    median = steps[len(steps) // 2]
    model = llm.engine.worker.model
    return {"model": llm.engine.worker.model_dir.name, "batch": batch, "prompt": prompt,
            "decode_step_ms": round(1e3 * median, 1), "decode_tok_s": round(batch / median, 1),
            "wall_s": round(wall, 1), "layer_runner": model.layer_runner is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--models", default="llama,gemma3", help="llama, gemma3, gemma3:<window>")
    ap.add_argument("--repeat", type=int, default=2, help="rounds, the models alternating within each")
    ap.add_argument("--no-runner", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedrun.build.cache import private_dir

    root = private_dir("bench")
    llms = []
    for spec in args.models.split(","):  # "gemma3", or "gemma3:0" for another window
        kind, _, window = spec.partition(":")
        window = int(window) if window else args.window if kind == "gemma3" else 0
        llms.append(make_llm(build(kind, root, window), args.dtype, args.threads, args.batch, not args.no_runner,
                             args.prompt + args.tokens))
    print(json.dumps({"dtype": args.dtype, "threads": args.threads}), flush=True)
    for _ in range(args.repeat):
        for llm in llms:
            print(json.dumps(decode_rate(llm, args.batch, args.prompt, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
