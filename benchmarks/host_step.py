"""The host's own work per decode step: wall time of a step of a model whose forward is almost free.

    python3 benchmarks/host_step.py [--seqs 64] [--tokens 128] [--profile]

A 1-layer random Llama of hidden size 64 (tests/tiny_models.py) makes the forward a small part of
a step, so a decode step's wall time is what the engine around the model costs: the scheduler,
the KV manager, the metadata, the sampler and the per-sequence bookkeeping. After CUDA graphs this
is what bounds a small model's step on a GPU (issue 36's target: 0.6 ms at 64 sequences).

Over the decode-only steps with every sequence resident it prints (median, 10th-90th percentile):
- wall per step: from one step's start to the next one's, the whole loop (LLM.run, the step, its
  StepRecord and occupancy);
- model: the forward and the logits, timed around the model's call (a hook on the top module,
  which leaves the C++ layer runner on) and compute_logits;
- host work: wall minus model, step by step: what CUDA graphs cannot take off the host.
--profile runs it again under cProfile and prints the top functions.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def run(model: Path, seqs: int, tokens: int):
    from pagedrun.config.recipe import load_recipe
    from pagedrun.io.requests import Request
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    llm = LLM(load_recipe(None, [f"model.path={model}", "model.device=cpu", "model.threads=1",
                                 f"scheduler.max_num_seqs={seqs}", "cache.num_blocks=4096",
                                 "model.max_model_len=512"]))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    reqs = [Request(id=f"r{i}", line=i + 1, prompt_token_ids=[rng.randrange(3, 600) for _ in range(32)],
                    sampling=sp) for i in range(seqs)]
    engine, net = llm.engine, llm.engine.worker.model
    model_ms: dict[int, float] = {}  # step -> ms in the model's forward and logits

    def clock(t0: float) -> None:
        model_ms[engine.num_steps] = model_ms.get(engine.num_steps, 0.0) + 1e3 * (time.perf_counter() - t0)

    starts: list[float] = []
    net.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    net.register_forward_hook(lambda *_: clock(starts.pop()))
    logits = net.compute_logits

    def timed_logits(hidden):
        t0 = time.perf_counter()
        out = logits(hidden)
        clock(t0)
        return out

    net.compute_logits = timed_logits
    llm.run(reqs)
    st = list(engine.steps)
    rows = []  # (wall, model) per decode step followed by another with every sequence resident
    for a, b in zip(st, st[1:]):
        if a.num_prefill_tokens == 0 and a.num_seqs == seqs == b.num_seqs:
            rows.append((1e3 * (b.t_start - a.t_start), model_ms.get(a.step, 0.0)))
    return rows, llm, reqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    import torch

    from tiny_models import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model("llama", Path(tmp) / "m", num_hidden_layers=1, hidden_size=64,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        run(model, a.seqs, 8)  # warm-up: kernels built, caches committed
        rows, llm, reqs = run(model, a.seqs, a.tokens)
        print(f"decode steps with {a.seqs} sequences resident: {len(rows)}")
        for name, values in (("wall per step", [w for w, _ in rows]), ("model", [m for _, m in rows]),
                             ("host work", [w - m for w, m in rows])):
            q = statistics.quantiles(values, n=10)
            print(f"  {name:14s} median {statistics.median(values):.3f} ms (p10 {q[0]:.3f}, p90 {q[-1]:.3f})")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            run(model, a.seqs, a.tokens)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
