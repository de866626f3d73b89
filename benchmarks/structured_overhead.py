"""The cost of structured outputs: the same 64 requests on the default model, unconstrained and
constrained, in one process (one model load), each run once after a warm-up.

    python benchmarks/structured_overhead.py [--threads 2] [--max-tokens 64]
                                             [--workloads extraction,long] [--constrained-first]

Workloads (64 requests = the 32 prompts of examples/extraction twice, batch 64):
  extraction   their own constraints (the recipe's JSON Schema, per-line choice / JSON): the
               greedy outputs are the unconstrained ones token for token (tests/
               test_structured_default_model.py), so the difference is the grammar's cost alone;
  long         the same prompts under {"regex": "[A-Za-z0-9 ,.'-]{400,}"} with ignore_eos (and
               unconstrained with ignore_eos): every sequence decodes max_tokens tokens at batch
               64, as the grammar cannot end before 400 characters; most tokens are allowed, the
               densest masks, the costliest to apply.
Reported per run: wall and CPU seconds, output tokens per second, the mean time of the steps that
decoded 64 sequences and nothing else, and the grammar's own work timed where it happens (masks
filled and applied in the sampler, matchers advanced by the engine): on a shared machine the
wall-clock difference between two runs is mostly the load's drift, the timed work is not.
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "extraction"


def run(llm, requests, label: str, timers: dict) -> dict:
    engine = llm.engine
    engine.steps.clear()
    for k in timers:
        timers[k] = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    full = [s.t_end - s.t_start for s in engine.steps if s.num_seqs == 64 and s.num_prefill_tokens == 0]
    grammar_s = timers["masks"] + timers["matchers"]
    row = {"run": label, "wall_s": wall, "cpu_s": cpu, "output_tokens": tokens, "tok_per_s": tokens / wall,
           "model_s": timers["model"],
           "decode64_steps": len(full), "decode64_step_ms": 1e3 * sum(full) / max(1, len(full)),
           "grammar_s": grammar_s}
    print(f"{label:26s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  {tokens:5d} tokens  {row['tok_per_s']:6.1f} tok/s  "
          f"{len(full):3d} batch-64 decode steps of {row['decode64_step_ms']:6.1f} ms  "
          f"model {timers['model']:6.2f} s  rest {wall - timers['model'] - grammar_s:5.2f} s  "
          f"grammar work {grammar_s:.2f} s ({100 * grammar_s / wall:.1f}% of wall; masks {timers['masks']:.2f} s)",
          flush=True)
    return row


def timed(timers: dict, key: str, fn):
    def wrapper(*a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            timers[key] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workloads", default="extraction,long")
    ap.add_argument("--constrained-first", action="store_true", help="run each pair in the other order")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import pagedrun.sample.sampler as sampler_mod
    from pagedrun.llm import LLM
    from pagedrun.structured.grammar import StructuredOutputManager as Manager

    # The grammar's whole cost on the engine's side: masks (fill + apply) in the sampler, and the
    # matchers' bookkeeping (resync before the step, accepting the sampled token after it).
    # The model's forward passes are timed too: they do the same work in both runs, so a change in
    # their time is the machine's load, not the grammar.
    timers = {"masks": 0.0, "matchers": 0.0, "model": 0.0}
    sampler_mod.apply_grammar_bitmasks = timed(timers, "masks", sampler_mod.apply_grammar_bitmasks)
    Manager.row_grammar = timed(timers, "matchers", Manager.row_grammar)
    Manager.after_token = timed(timers, "matchers", Manager.after_token)
    llm = LLM(EXAMPLE / "recipe.yaml", [f"model.threads={args.threads}", f"sampling.max_tokens={args.max_tokens}",
                                        "cache.enable_prefix_caching=false"])
    llm.engine.worker.runner.execute = timed(timers, "model", llm.engine.worker.runner.execute)
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
    # Warm-up: the first full batch of a process is slower (allocator growth, kernel caches), and
    # the grammar engine builds its tokenizer view on the first constrained request.
    run(llm, free[:16], "warm-up unconstrained", timers)
    run(llm, reqs[:16], "warm-up constrained", timers)
    # One run each, back to back (on a shared machine the wall-clock difference between two runs is
    # mostly the load's drift; the grammar work is timed inside the constrained run itself).
    pairs = {k: v for k, v in {"extraction": (free, reqs), "long": (free_long, regex)}.items()
             if k in args.workloads.split(",")}
    rows: dict[tuple[str, str], list[dict]] = {}
    for name, (a, b) in pairs.items():
        order = [("unconstrained", a), ("constrained", b)]
        for kind, rs in (order[::-1] if args.constrained_first else order):
            rows.setdefault((name, kind), []).append(run(llm, rs, f"{name} {kind}", timers))
    for name in pairs:
        a = min(r["wall_s"] for r in rows[(name, "unconstrained")])
        b = min(r["wall_s"] for r in rows[(name, "constrained")])
        g = min(r["grammar_s"] for r in rows[(name, "constrained")])
        ma = rows[(name, "unconstrained")][0]["model_s"]
        mb = rows[(name, "constrained")][0]["model_s"]
        print(f"{name}: wall unconstrained {a:.2f} s, constrained {b:.2f} s ({100 * (b / a - 1):+.1f}%); "
              f"model {ma:.2f} s vs {mb:.2f} s ({100 * (mb / ma - 1):+.1f}%, the load's drift); "
              f"grammar work {g:.2f} s = {100 * g / a:.1f}% of the unconstrained wall")

if __name__ == "__main__":
    main()
