"""Where does a step's time go? Runs a bench workload through pagedrun alone and splits wall time
into scheduler, metadata building, matmuls (linear layers), attention, cache writes, sampling and
the rest (Python bookkeeping), by timing each stage with wrappers (perf_counter, no profiler
overhead on the hot path beyond one call per stage per layer).

    python benchmarks/profile_step.py [--model tiny-llama|default] [--workload standard] [--threads 2]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--workload", default="standard")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pagedrun.attention import torch_backend
    from pagedrun.bench import resolve_bench_model
    from pagedrun.engine.llm import LLM
    from pagedrun.recipe import load_recipe
    from pagedrun.sampling_params import SamplingParams
    from pagedrun.workloads import make_workload

    model_dir = resolve_bench_model(args.model)
    recipe = load_recipe(None, [f"model.path={model_dir}", f"model.dtype={args.dtype}",
                                f"model.threads={args.threads}", *args.set])
    llm = LLM(recipe)
    reqs = make_workload(args.workload, llm.engine.model_config.vocab_size, quick=False)
    if args.num_requests:
        reqs = reqs[: args.num_requests]

    timers: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    eng = llm.engine
    eng.scheduler.schedule = timed("scheduler", eng.scheduler.schedule)
    eng.runner.build_metadata = timed("metadata", eng.runner.build_metadata)
    eng.sampler.__class__.__call__ = timed("sampler", eng.sampler.__class__.__call__)
    eng._record = timed("metrics record", eng._record)
    torch_backend.reshape_and_cache = timed("cache writes", torch_backend.reshape_and_cache)
    backend_cls = type(eng.backend)
    orig_forward = backend_cls.forward
    backend_cls.forward = timed("attention (incl. cache writes)", orig_forward)
    for mod in eng.model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = timed("linear layers (matmul)", mod.forward)
    eng.model.compute_logits = timed("lm head", eng.model.compute_logits)
    eng.runner.execute = timed("model step (total)", eng.runner.execute)
    eng.step = timed("engine step (total)", eng.step)

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    requests = []
    for p, sp in zip(prompts, params):
        requests += llm.make_requests([p], sp)
    for i, r in enumerate(requests):
        r.id = str(i)
    t0 = time.perf_counter()
    outs = llm.run(requests)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(f"{len(outs)} requests, {prompt_tokens} prompt + {out_tokens} output tokens in {wall:.2f}s: "
          f"{out_tokens / wall:.1f} output tok/s, {(prompt_tokens + out_tokens) / wall:.1f} total tok/s, "
          f"{len(eng.steps)} steps, threads={args.threads}")
    total = timers["engine step (total)"]
    for k, v in sorted(timers.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {v:8.3f}s  {100 * v / total:5.1f}% of step time")


if __name__ == "__main__":
    main()
