"""Where the host's time goes when pagedrun generates on a GPU: the bench's standard workload
through the engine under cProfile, the functions with the most time of their own printed.

    python3 benchmarks/gpu_host_profile.py MODEL_DIR [--dtype bfloat16] [--top 35]

A GPU step launches kernels asynchronously, so a small model's steps are bound by the Python
that launches them; this says which Python. Steps and wall time are printed first (one run
unprofiled, then the profiled one: cProfile's own overhead inflates the second).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=35)
    a = p.parse_args(argv)
    import torch

    from pagedrun.bench.workloads import make_workload
    from pagedrun.io.requests import Request
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(None, [f"model.path={a.model}", f"model.dtype={a.dtype}", f"model.device={device}"])
    work = make_workload("standard", json.loads((Path(a.model) / "config.json").read_text())["vocab_size"], quick=False)

    def requests():
        return [Request(r.id, i + 1, list(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens,
                                                                              ignore_eos=r.ignore_eos))
                for i, r in enumerate(work)]

    def run() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.run(requests())
        if device == "cuda":
            torch.cuda.synchronize()
        assert not [o.error for o in out if o.error]
        return time.perf_counter() - t

    run()  # warm-up: kernels compiled and loaded
    n0 = len(llm.engine.steps)
    wall = run()
    steps = len(llm.engine.steps) - n0
    print(f"{device}, {a.dtype}: {len(work)} requests in {wall:.2f} s, {steps} steps, {1e3 * wall / steps:.2f} ms/step")
    prof = cProfile.Profile()
    prof.enable()
    wall_p = run()
    prof.disable()
    print(f"profiled: {wall_p:.2f} s")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
