"""What a quantized KV cache costs in output quality (issue 18, docs/design/memory.md): the default model,
64 chat prompts, greedy, each quantized KV dtype against the model's own dtype in the cache.

Per dtype: the share of tokens generated before the first divergence from the full-precision run,
how many requests never diverge, the first-divergence positions (quartiles), and the mean absolute
difference of the chosen tokens' logprobs over the positions before the first divergence (the same
token chosen, its probability under the quantized cache vs the full-precision one).

    python benchmarks/kv_quant_quality.py [--max-tokens 64] [--dtype float32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

TOPICS = ["photosynthesis", "the French Revolution", "black holes", "compound interest", "the immune system",
          "plate tectonics", "machine learning", "the water cycle", "ancient Rome", "climate change",
          "the printing press", "vaccines", "electric cars", "the Moon landing", "DNA", "inflation"]
TASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "List three facts about {}.",
         "What would a child ask about {}? Answer it."]


def prompts() -> list[dict]:
    return [{"messages": [{"role": "user", "content": task.format(topic)}]} for topic in TOPICS for task in TASKS]


def run(kv_dtype: str, dtype: str, max_tokens: int):
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    llm = LLM(load_recipe(None, [f"model.dtype={dtype}", f"cache.kv_cache_dtype={kv_dtype}"]))
    t = time.perf_counter()
    outs = llm.generate(prompts(), SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    wall = time.perf_counter() - t
    return [(o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs], wall


def compare(ref, got) -> dict:
    firsts, diffs, same = [], [], 0
    for (rt, rl), (gt, gl) in zip(ref, got):
        first = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        firsts.append(first)
        same += first == len(rt)
        diffs += [abs(a - b) for a, b in zip(rl[:first], gl[:first])]
    q = statistics.quantiles(firsts, n=4)
    return {"tokens_before_first_divergence": sum(firsts) / sum(len(t) for t, _ in ref),
            "requests_identical": same, "requests": len(ref),
            "first_divergence_quartiles": [round(x, 1) for x in q], "first_divergence_min": min(firsts),
            "mean_abs_logprob_diff": statistics.fmean(diffs) if diffs else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ref, wall = run("auto", args.dtype, args.max_tokens)
    results = {"auto": {"wall_s": round(wall, 2)}}
    print(f"{args.dtype} KV (reference): {wall:.1f} s")
    for kv in ("fp8_e4m3", "fp8_e5m2", "int8"):
        got, wall = run(kv, args.dtype, args.max_tokens)
        r = compare(ref, got)
        r["wall_s"] = round(wall, 2)
        results[kv] = r
        print(f"{kv:9s} tokens before 1st divergence {r['tokens_before_first_divergence']:.1%}, identical "
              f"{r['requests_identical']}/{r['requests']}, 1st divergence quartiles {r['first_divergence_quartiles']} "
              f"(min {r['first_divergence_min']}), mean |dlogprob| {r['mean_abs_logprob_diff']:.4f}, {wall:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
