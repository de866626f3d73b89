"""The cost of structured outputs: the same 64 requests on the default model, unconstrained and
constrained, in one process (one model load), each run once.

    python benchmarks/structured_overhead.py [--threads 2] [--max-tokens 64]

Workloads (64 requests = the 32 prompts of examples/extraction twice, batch 64):
  extraction   their own constraints (the recipe's JSON Schema, per-line choice / JSON): the
               greedy outputs are the unconstrained ones token for token (tests/
               test_structured_default_model.py), so the difference is the grammar's cost alone;
  regex        the same prompts under {"regex": "[A-Za-z0-9 ,.'-]{400,}"} with ignore_eos, so
               every sequence decodes max_tokens tokens at batch 64 (the grammar cannot end
               before 400 characters; most tokens allowed: the
               densest masks, the costliest to fill).
Reported per run: wall seconds, output tokens per second, the mean time of the steps that decoded
64 sequences and nothing else, and the time the sampler spent in grammar masks (fill + apply).
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "extraction"


def run(llm, requests, label: str, mask_time: list[float]) -> dict:
    engine = llm.engine
    engine.steps.clear()
    mask_time[0] = 0.0
    t0 = time.perf_counter()
    outs = llm.run(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    full = [s.t_end - s.t_start for s in engine.steps if s.num_seqs == 64 and s.num_prefill_tokens == 0]
    row = {"run": label, "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
           "decode64_steps": len(full), "decode64_step_ms": 1e3 * sum(full) / max(1, len(full)),
           "mask_s": mask_time[0]}
    print(f"{label:24s} wall {wall:6.2f} s  {tokens:5d} tokens  {row['tok_per_s']:6.1f} tok/s  "
          f"{len(full):3d} batch-64 decode steps of {row['decode64_step_ms']:6.1f} ms  masks {mask_time[0]:.2f} s",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import pagedrun.sampler as sampler_mod
    from pagedrun.engine.llm import LLM

    mask_time = [0.0]
    apply = sampler_mod.apply_grammar_bitmasks

    def timed_apply(*a):
        t = time.perf_counter()
        apply(*a)
        mask_time[0] += time.perf_counter() - t

    sampler_mod.apply_grammar_bitmasks = timed_apply
    llm = LLM(EXAMPLE / "recipe.yaml", [f"model.threads={args.threads}", f"sampling.max_tokens={args.max_tokens}",
                                        "cache.enable_prefix_caching=false"])
    base, _ = llm.read_requests(EXAMPLE / "prompts.jsonl")
    reqs = copy.deepcopy(base) + copy.deepcopy(base)
    for i, r in enumerate(reqs):
        r.id = f"{r.id}-{i // 32}"
        r.sampling.max_tokens = args.max_tokens
    free = copy.deepcopy(reqs)
    for r in free:
        r.sampling.structured_outputs = None
    regex = copy.deepcopy(free)
    for r in regex:
        r.sampling.structured_outputs = {"regex": "[A-Za-z0-9 ,.'-]{400,}"}
        r.sampling.ignore_eos = True
    free_long = copy.deepcopy(free)
    for r in free_long:
        r.sampling.ignore_eos = True
    run(llm, reqs[:4], "warm-up (grammar engine)", mask_time)
    rows = [run(llm, free, "extraction unconstrained", mask_time),
            run(llm, reqs, "extraction constrained", mask_time),
            run(llm, free_long, "long unconstrained", mask_time),
            run(llm, regex, "long regex-constrained", mask_time)]
    for a, b in ((rows[0], rows[1]), (rows[2], rows[3])):
        loss = 1 - b["tok_per_s"] / a["tok_per_s"]
        step = b["decode64_step_ms"] / a["decode64_step_ms"] - 1 if a["decode64_steps"] and b["decode64_steps"] else float("nan")
        print(f"{b['run']}: throughput loss {100 * loss:.1f}%, batch-64 decode step +{100 * step:.1f}%")


if __name__ == "__main__":
    main()
