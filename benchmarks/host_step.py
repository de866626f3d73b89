"""The host's own work per decode step: wall time of a step of a model whose forward is almost free.

    python3 benchmarks/host_step.py [--seqs 64] [--tokens 128] [--profile]

A 1-layer random Llama of hidden size 64 (tests/tiny_models.py) makes the forward a small part of
a step, so a decode step's wall time is what the engine around the model costs: the scheduler,
the KV manager, the metadata, the sampler and the per-sequence bookkeeping. After CUDA graphs this
is what bounds a small model's step on a GPU (issue 36's target: 0.6 ms at 64 sequences). Prints
the median and the 10th-90th percentiles of decode-only steps with every sequence resident, from
the engine's own StepRecords; --profile runs it again under cProfile and prints the top functions.
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
    llm.run(reqs)
    steps = [s for s in llm.engine.steps if s.num_prefill_tokens == 0 and s.num_seqs == seqs]
    return [1e3 * (s.t_end - s.t_start) for s in steps], llm, reqs


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
        ms, llm, reqs = run(model, a.seqs, a.tokens)
        q = statistics.quantiles(ms, n=10)
        print(f"decode steps with {a.seqs} sequences resident: {len(ms)}; wall per step median "
              f"{statistics.median(ms):.3f} ms (p10 {q[0]:.3f}, p90 {q[-1]:.3f})")
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
