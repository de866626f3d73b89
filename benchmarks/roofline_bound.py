"""How close to the FMA peak can a run get on this machine? The bench reports an engine's useful
FLOP/s as a fraction of the measured FMA peak (pagedrun/bench/roof.py); this script bounds that
fraction from above for the same run, step by step, from what the machine measures:

  peak       the FMA peak (pagedrun/bench/fma_peak.py: register-only chains, the kernels' ISA)
  bandwidth  the read bandwidth of main memory (a 1 GiB float32 sum, best of 5)
  gemm       the best matmul this machine's BLAS reaches (torch.matmul, 2048 x 2048, as the bench
             measures it where no compiler is found)

Each step of a pagedrun run (the bench's workload, settings and request order) must compute its
useful FLOPs (2 x params x tokens through the layers, the LM head for the sampled rows: the bench's
count) and read its bytes at least once (the layers' weights, the LM head's where a row is sampled,
the KV cache it attends over: tokens stored x KV bytes per token). Its time is then at least
max(FLOPs / peak, bytes / bandwidth), and with the compute at the BLAS's rate instead of the FMA
peak, max(FLOPs / gemm, bytes / bandwidth). Attention's arithmetic, the elementwise ops and the
host are counted as free, so both bounds are optimistic: no engine on this machine can exceed them.

    python benchmarks/roofline_bound.py [--model default|tiny-llama] [--dtype float32|bfloat16]
                                        [--threads 2] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a float32 sum over 1 GiB (far past the caches), best of 5."""
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="recipe override, as the bench takes them")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pagedrun.bench import fma_peak
    from pagedrun.bench.roof import matmul_flops_per_s
    from pagedrun.bench.run import count_params, kv_bytes_per_token, load_workload, resolve_bench_model, room_for_all
    from pagedrun.config.recipe import load_recipe
    from pagedrun.io.requests import Request
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    model_dir = resolve_bench_model(args.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    base = [f"model.path={model_dir}", f"model.dtype={args.dtype}", f"model.threads={args.threads}",
            "model.device=cpu"]
    recipe = load_recipe(None, base + args.set)
    requests = load_workload("standard", model_dir, cfg, False, recipe)
    bs = recipe.cache.block_size
    if not any(o.split("=")[0].strip() in ("cache.num_blocks", "cache.kv_cache_memory") for o in args.set):
        base.append(room_for_all(requests, bs))  # as the bench
    params = count_params(model_dir)
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    body = params["matmul"] - params["head"]
    kv_token = kv_bytes_per_token(cfg, args.dtype)

    llm = LLM(None, base + args.set)
    reqs = [Request(r.id, i + 1, list(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens,
                                                                          ignore_eos=r.ignore_eos))
            for i, r in enumerate(requests)]
    t = time.perf_counter()
    results = llm.run(reqs)
    wall = time.perf_counter() - t
    steps = llm.engine.steps
    out_tokens = sum(len(o.outputs[0].token_ids) for o in results)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)

    peak = fma_peak.measure(args.dtype, args.threads, 1.0)
    bw = read_bandwidth(args.threads)
    gemm = matmul_flops_per_s(args.dtype, "cpu", False)

    total_flops = 0.0
    kinds: dict[str, dict[str, float]] = {}
    for s in steps:
        tokens = s.num_prefill_tokens + s.num_decode_tokens
        flops = 2.0 * (body * tokens + params["head"] * s.num_sampled_tokens)
        nbytes = elem * (body + (params["head"] if s.num_sampled_tokens else 0)) + kv_token * s.tokens_stored
        kind = "with prefill" if s.num_prefill_tokens else "decode only"
        k = kinds.setdefault(kind, {"steps": 0, "measured": 0.0, "flops": 0.0, "peak": 0.0, "gemm": 0.0,
                                    "mem_bound": 0})
        k["steps"] += 1
        k["measured"] += s.t_end - s.t_start
        k["flops"] += flops
        k["peak"] += max(flops / peak["flops_per_s"], nbytes / bw)
        k["gemm"] += max(flops / gemm, nbytes / bw)
        k["mem_bound"] += nbytes / bw > flops / peak["flops_per_s"]
        total_flops += flops
    # The bench's own count (pagedrun/bench/run.py finish_row), for the fraction it reports.
    bench_flops = 2.0 * (body * (out_tokens + prompt_tokens) + params["head"] * out_tokens)

    print(f"{len(requests)} requests, {prompt_tokens} prompt + {out_tokens} output tokens, {args.model} "
          f"{args.dtype}, {args.threads} threads: {wall:.2f} s ({out_tokens / wall:.1f} output tok/s), "
          f"{len(steps)} steps")
    print(f"measured: FMA peak {peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['isa']}), read bandwidth "
          f"{bw / 1e9:.1f} GB/s, torch.matmul 2048^2 {gemm / 1e9:.1f} GFLOP/s "
          f"({gemm / peak['flops_per_s']:.1%} of the peak)")
    print(f"{'steps':14} {'n':>4} {'mem-bound':>9} {'measured s':>10} {'bound s':>8} {'BLAS-bound s':>12}")
    for kind, k in sorted(kinds.items()):
        print(f"{kind:14} {k['steps']:4d} {k['mem_bound']:9d} {k['measured']:10.2f} {k['peak']:8.2f} "
              f"{k['gemm']:12.2f}")
    t_peak = sum(k["peak"] for k in kinds.values())
    t_gemm = sum(k["gemm"] for k in kinds.values())
    pk = peak["flops_per_s"]
    print(f"useful FLOPs: {total_flops / 1e12:.3f} T over the steps ({bench_flops / 1e12:.3f} T by the bench's "
          f"count)")
    print(f"fraction of the FMA peak: this run {bench_flops / wall / pk:.1%} (bench's count); "
          f"roofline bound {total_flops / t_peak / pk:.1%}; with compute at torch.matmul's rate "
          f"{total_flops / t_gemm / pk:.1%}")


if __name__ == "__main__":
    main()
