"""CPU attention A/B (issue 8): the same bench workload through TorchAttentionBackend's C++ kernel
and through its pure-torch path, alternating in one process, each on a fresh engine.

With --threads 1 the times are the engine thread's CPU time (time.thread_time), which other
processes' load on a shared box inflates much less than wall time; with more threads, wall time.
Attention is split into decode-only steps and steps with prefill tokens. Also checks that both
paths produce the same greedy tokens.

    OMP_NUM_THREADS=1 python benchmarks/cpu_attention_ab.py [--num-requests 32] [--rounds 2]
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
ap = argparse.ArgumentParser()
ap.add_argument("--num-requests", type=int, default=32)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--rounds", type=int, default=1)
ap.add_argument("--dtype", default="float32")
args = ap.parse_args()
torch.set_num_threads(args.threads)
from pagedrun.bench.run import resolve_bench_model
from pagedrun.bench.workloads import make_workload
from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

model_dir = resolve_bench_model("tiny-llama")
clock = time.thread_time if args.threads == 1 else time.perf_counter

def one(use_kernel):
    recipe = load_recipe(None, [f"model.path={model_dir}", f"model.dtype={args.dtype}", f"model.threads={args.threads}"])
    llm = LLM(recipe)
    eng = llm.engine
    reqs = make_workload("standard", eng.model_config.vocab_size, quick=False)[: args.num_requests]
    backend = eng.backend
    backend.use_cpu_kernel = use_kernel
    timers = defaultdict(float)
    orig = type(backend).forward
    def fwd(self, q, k, v, kc, vc, meta, scale):
        t = clock()
        try:
            return orig(self, q, k, v, kc, vc, meta, scale)
        finally:
            kind = "attn decode-only steps" if meta.is_decode_only else "attn steps with prefill"
            timers[kind] += clock() - t
    backend.forward = fwd.__get__(backend)
    requests = []
    for r in reqs:
        requests += llm.make_requests([{"prompt_token_ids": r.prompt_token_ids}], SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    for i, r in enumerate(requests):
        r.id = str(i)
    w0, c0 = time.perf_counter(), clock()
    outs = llm.run(requests)
    timers["total (clock)"] = clock() - c0
    timers["wall"] = time.perf_counter() - w0
    assert backend.last_path == ("cpu_kernel" if use_kernel else "torch"), backend.last_path
    toks = [tuple(o.outputs[0].token_ids) for o in outs]
    return timers, toks

results = defaultdict(list)
for rnd in range(args.rounds):
    for use_kernel in (True, False):
        tm, toks = one(use_kernel)
        results[use_kernel].append((tm, toks))
        print(f"round {rnd} {'kernel' if use_kernel else 'torch '}: " + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(tm.items())), flush=True)
same = sum(a == b for a, b in zip(results[True][0][1], results[False][0][1]))
print(f"identical greedy outputs: {same}/{len(results[True][0][1])}; load {open('/proc/loadavg').read().strip()}")
