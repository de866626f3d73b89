"""Runs inside vLLM's own interpreter (benchmarks/vllm_cpu_venv.sh builds it): one vLLM configuration
of `pagedrun bench` on the parent's requests. Standard library and vllm only: pagedrun is not
installed there. Invoked by path: python bench/vllm_worker.py SPEC.json RESULT.json.

Times the load (engine start-up, torch.compile included) and the generation apart, and samples the
resident memory of this process and every process it started (vLLM runs a front end, an engine
core and a worker) every 50 ms: the peak of the sum is "measured, sampled".
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


def _tree_rss(root_pid: int) -> int:
    import psutil

    try:
        procs = [psutil.Process(root_pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class _PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _tree_rss(os.getpid()))
            self.stop.wait(0.05)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    sampler = _PeakSampler()
    sampler.start()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"], kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
              enable_prefix_caching=spec["enable_prefix_caching"], seed=spec["seed"], skip_tokenizer_init=True,
              trust_remote_code=False)
    load_s = time.perf_counter() - t
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                             detokenize=False) for r in spec["requests"]]
    t = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    import vllm

    cached = [getattr(r, "num_cached_tokens", None) for r in results]  # prompt tokens its prefix cache served
    out = {"wall_s": wall, "load_s": load_s, "outputs": [list(r.outputs[0].token_ids) for r in results],
           "num_cached_tokens": None if None in cached else cached,
           "peak_rss_bytes": sampler.peak, "peak_rss_kind": "measured: sum over vLLM's processes, sampled every 50 ms",
           "vllm_version": vllm.__version__}
    open(sys.argv[2], "w").write(json.dumps(out))
    _stop_children()
    os._exit(0)  # the result is out; vLLM's threads need no orderly shutdown


def _stop_children() -> None:
    """vLLM's engine-core and worker processes outlive an abrupt exit and keep the parent's pipes open:
    end them first."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for c in children:
        try:
            c.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=5)
    for c in alive:
        try:
            c.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    main()
