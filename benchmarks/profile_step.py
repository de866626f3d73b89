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
    from pagedrun.bench.run import resolve_bench_model
    from pagedrun.bench.workloads import make_workload
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

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
    # The stages are timed in the Python layer loop; the layer runner (models/layer_runner.py) makes
    # the same kernel calls from C, where no wrapper sees them, so it is off here. Without it the
    # loop's own Python shows up as the model step's unattributed part.
    eng.worker.model.layer_runner = None
    eng.scheduler.schedule = timed("scheduler", eng.scheduler.schedule)
    eng.worker.runner.build_metadata = timed("metadata", eng.worker.runner.build_metadata)
    eng.worker.sampler.__class__.__call__ = timed("sampler", eng.worker.sampler.__class__.__call__)
    eng._record = timed("metrics record", eng._record)
    # The kernel committing KV-cache pages ahead of first use (worker/populate.py): 0.14-1.1 s of the
    # default model's standard run on a KVM guest, depending on whether the host still backs them.
    eng.worker.populator.ensure = timed("kv pages committed", eng.worker.populator.ensure)
    torch_backend.reshape_and_cache = timed("cache writes", torch_backend.reshape_and_cache)
    backend_cls = type(eng.worker.backend)
    orig_forward = backend_cls.forward
    backend_cls.forward = timed("attention (incl. cache writes)", orig_forward)

    def attention_split(self, query, key, value, key_cache, value_cache, meta, *a, **k):
        # decode-only steps read the cache; steps with a prefill also do causal attention over prompts
        name = "  of which decode-only steps" if meta.is_decode_only else "  of which steps with prefill"
        t = time.perf_counter()
        try:
            return orig_forward(self, query, key, value, key_cache, value_cache, meta, *a, **k)
        finally:
            timers[name] += time.perf_counter() - t
    backend_cls.forward = timed("attention (incl. cache writes)", attention_split)

    def timed_linear(fn):
        def wrapper(x, *a, **k):
            rows = x.reshape(-1, x.shape[-1]).shape[0]
            bucket = "1-2" if rows <= 2 else "3-16" if rows <= 16 else "17-64" if rows <= 64 else "65+"
            t = time.perf_counter()
            try:
                return fn(x, *a, **k)
            finally:
                dt = time.perf_counter() - t
                timers["linear layers (matmul)"] += dt
                timers[f"  of which {bucket} rows"] += dt
        return wrapper
    for mod in eng.worker.model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = timed_linear(mod.forward)
    eng.worker.model.compute_logits = timed("lm head", eng.worker.model.compute_logits)
    from pagedrun.models import ops, packed_gemm
    for name in ("rms_norm", "rope", "silu_and_mul"):  # llama.py calls them as ops.<name>
        setattr(ops, name, timed(f"elementwise: {name}", getattr(ops, name)))
    # The MLP's gate/up GEMM with SiLU * up fused in (also counted under linear layers).
    packed_gemm.gate_up_silu = timed("  of which gate/up + silu (fused)", packed_gemm.gate_up_silu)
    eng.worker.runner.execute = timed("model step (total)", eng.worker.runner.execute)
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
    parts = sorted((k for k in timers if not k.startswith("  ")), key=lambda k: -timers[k])
    for k in parts:
        print(f"  {k:32s} {timers[k]:8.3f}s  {100 * timers[k] / total:5.1f}% of step time")
        prefix = {"attention (incl. cache writes)": ("  of which decode", "  of which steps"),
                  "linear layers (matmul)": ("  of which 1", "  of which 3", "  of which 17", "  of which 65",
                                             "  of which gate")}
        for sub in sorted(s for s in timers if s.startswith(prefix.get(k, ("\0",)))):
            print(f"  {sub:32s} {timers[sub]:8.3f}s  {100 * timers[sub] / total:5.1f}% of step time")


if __name__ == "__main__":
    main()
