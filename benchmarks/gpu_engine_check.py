"""The engine end to end on CUDA (benchmarks/gpu_check.sh runs it): attention_backend cupy vs torch
give the same greedy tokens, and what the process holds on the device stays within
gpu_memory_utilization x total; the same with an fp8 KV cache. Random tiny Llamas (tests/tiny_models.py), no downloads.

    python3 benchmarks/gpu_engine_check.py [--utilization 0.5]

Prints one line per run and "engine: ok" at the end, or exits non-zero naming what differed.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


RUNS = [("torch", "float32", "auto"), ("cupy", "float32", "auto"), ("cupy", "bfloat16", "auto"),
        ("torch", "float32", "fp8_e4m3"), ("cupy", "float32", "fp8_e4m3")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--utilization", type=float, default=0.5)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("engine: skipped (torch sees no CUDA device)")
        return 2
    import cupy
    from tiny_models import make_tiny_model

    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    tmp = Path(tempfile.mkdtemp())
    models = {
        "gqa 8/2 head 64": make_tiny_model("llama", tmp / "gqa", seed=11, hidden_size=512, num_attention_heads=8,
                                           num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=2048),
        "mqa 4/1 head 128": make_tiny_model("llama", tmp / "mqa", seed=12, hidden_size=512, num_attention_heads=4,
                                            num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=2048),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 7, 16, 23, 40, 700, 1200)]
    prompts.append(prompts[3][:16] + [5, 6, 7])  # a prefix-cache hit: SDPA over a gathered prefix
    u = a.utilization
    failures = []
    for label, d in models.items():
        base = [f"model.path={d}", "model.device=cuda", "cache.block_size=16", f"cache.gpu_memory_utilization={u}",
                "sampling.max_tokens=64", "sampling.ignore_eos=true", "scheduler.max_num_batched_tokens=1024"]
        tokens = {}
        # fp8: the grouped 1-byte kernels (cupy) and the torch path's dequantized copies, in the plan
        for backend, dtype, kv in RUNS:
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            llm = LLM(load_recipe(None, base + [f"model.attention_backend={backend}", f"model.dtype={dtype}",
                                                f"cache.kv_cache_dtype={kv}"]))
            out = llm.generate(prompts)
            wall = time.perf_counter() - t0
            tokens[(backend, dtype, kv)] = [o.outputs[0].token_ids for o in out]
            shown = dtype if kv == "auto" else f"{dtype}, {kv} cache"
            free, total = torch.cuda.mem_get_info()
            in_use, limit = total - free, u * total
            print(f"engine {label} {backend}/{shown}: {wall:.1f}s incl. load; in use {in_use / 2**30:.2f} GiB "
                  f"(limit {limit / 2**30:.2f}); torch max reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB; "
                  f"cupy pool {cupy.get_default_memory_pool().total_bytes() / 2**20:.1f} MiB; "
                  f"kernel {getattr(llm.engine.worker.backend, 'last_version', None)}; "
                  f"plan: {llm.engine.memory.summary()[-1]}")
            prof = llm.engine.memory.profile
            print(f"  profile: non-torch {prof.non_torch_bytes / 2**20:.0f} MiB, weights {prof.weights_bytes / 2**20:.0f} MiB, "
                  f"activations {prof.activation_peak_bytes / 2**20:.0f} MiB, reserved slack "
                  f"{getattr(prof, 'reserved_slack_bytes', 0) / 2**20:.0f} MiB; after the run: non-torch "
                  f"{(in_use - torch.cuda.memory_reserved()) / 2**20:.0f} MiB, torch reserved "
                  f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB, KV {llm.engine.memory.kv_cache_bytes / 2**20:.0f} MiB")
            if in_use > limit:
                failures.append(f"{label} {backend}/{shown}: {in_use / 2**30:.2f} GiB in use > {limit / 2**30:.2f}")
            del llm, out
            gc.collect()
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
        for kv in ("auto", "fp8_e4m3"):
            a_, b_ = tokens[("torch", "float32", kv)], tokens[("cupy", "float32", kv)]
            same = sum(x == y for x, y in zip(a_, b_))
            what = "float32" + ("" if kv == "auto" else f", {kv} cache")
            print(f"engine {label}: greedy tokens torch vs cupy ({what}) {same}/{len(prompts)} requests identical")
            if same != len(prompts):
                failures.append(f"{label} ({what}): greedy tokens differ in {len(prompts) - same} requests")
    if failures:
        print("engine: FAILED: " + "; ".join(failures))
        return 1
    print("engine: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
