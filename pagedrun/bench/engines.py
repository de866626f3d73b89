"""One engine configuration of `pagedrun bench`: pagedrun, HF `generate` with static batching, or HF
continuous batching, run on the same requests and timed (generation only, model load excluded).

run_isolated runs it in a fresh interpreter (_worker_main is that interpreter's entry point) so its
peak resident memory is its own; run_engine runs it in this process. Either returns one row: wall
time, the outputs, and what the engine knows of its KV cache, each figure labelled measured or derived.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedrun.bench.workloads import BenchRequest
from pagedrun.errors import PagedrunError


def run_isolated(spec: dict) -> dict:
    """Run `spec` in a fresh interpreter: its peak RSS then belongs to this engine alone."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]),
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with tempfile.TemporaryDirectory(prefix="pagedrun-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-c", "from pagedrun.bench.engines import _worker_main; _worker_main()",
                               str(spec_path), str(out_path)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            # pagedrun's own one-line errors (a recipe the engine refuses) as that line, not a traceback
            ours = re.match(r"^pagedrun\.[\w.]*Error: (.+)$", tail[-1]) if tail else None
            detail = ours.group(1) if ours else " | ".join(tail)
            raise PagedrunError(f"bench: {spec['engine']} ({spec.get('config', '')}) failed: {detail}")
        row = json.loads(out_path.read_text())
    row["memory_isolated"] = True
    return row


def _worker_main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_engine(spec)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_engine(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    baseline = _rss_bytes()
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    requests = [BenchRequest(**r) for r in spec["requests"]]
    fn = {"pagedrun": _run_pagedrun, "hf-static": _run_hf_static, "hf-continuous": _run_hf_continuous}
    row = fn[spec["engine"]](spec, requests)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row["rss_after_imports_bytes"] = baseline
    row["peak_device_bytes"] = torch.cuda.max_memory_allocated() if spec["device"] == "cuda" else None
    row["memory_isolated"] = False
    return row


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _run_pagedrun(spec: dict, requests: list[BenchRequest]) -> dict:
    from pagedrun.io.requests import Request
    from pagedrun.llm import LLM
    from pagedrun.report.report import build_report
    from pagedrun.sampling_params import SamplingParams

    t = time.perf_counter()
    llm = LLM(None, spec["overrides"])
    load_s = time.perf_counter() - t
    reqs = [Request(r.id, i + 1, list(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens,
                                                                          ignore_eos=r.ignore_eos))
            for i, r in enumerate(requests)]
    t = time.perf_counter()
    results = llm.run(reqs)
    _sync(spec["device"])
    wall = time.perf_counter() - t
    errors = [o.error for o in results if o.error]
    if errors:
        raise PagedrunError(f"bench: pagedrun failed a request: {errors[0]}")
    report = build_report(llm.engine, results, wall_s=wall, load_s=load_s)
    m = llm.engine.memory
    steps = llm.engine.steps
    return {
        "wall_s": wall, "load_s": load_s,
        "outputs": [o.outputs[0].token_ids for o in results],
        "executed_tokens": steps.total("num_prefill_tokens") + steps.total("num_decode_tokens"),
        "prefix_hit_tokens": report["prefix_cache"]["hit_tokens"],
        "prefix_hit_tokens_kind": "measured: prompt tokens served from the prefix cache",
        "kv_capacity_tokens": m.token_capacity,
        "kv_bytes": m.num_gpu_blocks * m.block_bytes,
        "kv_bytes_kind": "measured: blocks allocated x block bytes",
        "kv_peak_bytes": report["blocks_in_use"]["peak"] * m.block_bytes,
        "kv_peak_bytes_kind": "measured: peak blocks in use x block bytes",
        "kv_utilisation": report["utilisation"]["tokens_stored_over_slots_allocated"],
        "kv_utilisation_kind": "measured per step: tokens stored / blocks in use x block_size, summed over steps",
        "report": report,
        "kv_populate_s": llm.engine.worker.populator.seconds,
        "kv_populate_s_kind": "measured: wall time committing KV-cache pages inside the run (worker/populate.py); "
                              "vLLM zeroes its whole cache at load",
        # What pagedrun's engine set for itself (pagedrun/worker/malloc_tuning.py); HF runs with glibc's
        # defaults, which measured faster for it.
        "malloc_tuning": llm.engine.worker.malloc_tuning,
    }


def _kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def _load_hf(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]),
                                                 trust_remote_code=False)
    model = model.to(spec["device"]).eval()
    # EOS is handled per request after the fact: generating past an EOS never changes earlier tokens.
    model.generation_config.eos_token_id = None
    return model, time.perf_counter() - t


def _cut(tokens: list[int], r: BenchRequest, eos: set[int]) -> list[int]:
    tokens = tokens[: r.max_tokens]
    if not r.ignore_eos:
        for i, tok in enumerate(tokens):
            if tok in eos:
                return tokens[: i + 1]
    return tokens


def _eos_ids(model_dir: str) -> set[int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    e = cfg.get("eos_token_id")
    return set(e if isinstance(e, list) else [e] if e is not None else [])


def _run_hf_static(spec: dict, requests: list[BenchRequest]) -> dict:
    """HF generate over fixed batches in input order, left-padded, each run to its longest max_tokens."""
    import torch
    from transformers import GenerationConfig

    model, load_s = _load_hf(spec)
    eos = _eos_ids(spec["model_dir"])
    bpt = _kv_bytes_per_token(model)
    b = spec["batch_size"]
    outputs: list[list[int]] = []
    live = slots = executed = peak_kv = 0
    t = time.perf_counter()
    for i in range(0, len(requests), b):
        batch = requests[i : i + b]
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        stop = sorted(eos) if eos and not any(r.ignore_eos for r in batch) else None
        gc = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=stop)
        with torch.no_grad():
            out = model.generate(ids.to(spec["device"]), attention_mask=mask.to(spec["device"]), generation_config=gc)
        gen = out[:, width:].tolist()
        outputs += [_cut(g, r, eos) for g, r in zip(gen, batch)]
        steps = len(gen[0])
        # A dynamic cache holds width + k positions per row after forward pass k (k = 0 .. steps - 1);
        # a row needs its prompt and, of its own outputs, all but the last.
        for k in range(steps):
            slots += len(batch) * (width + k)
            live += sum(len(r.prompt_token_ids) + min(k, len(o) - 1) for r, o in zip(batch, outputs[-len(batch):]))
        executed += len(batch) * (width + steps - 1)
        peak_kv = max(peak_kv, len(batch) * (width + steps - 1) * bpt)
    _sync(spec["device"])
    wall = time.perf_counter() - t
    return {"wall_s": wall, "load_s": load_s, "outputs": outputs, "executed_tokens": executed,
            "prefix_hit_tokens": 0, "prefix_hit_tokens_kind": "none: a static batch recomputes every prompt",
            "kv_bytes": peak_kv, "kv_bytes_kind": "derived: largest batch x (padded prompt + new tokens) x bytes/token",
            "kv_peak_bytes": peak_kv, "kv_peak_bytes_kind": "derived: the dynamic cache grows to its allocation",
            "kv_utilisation": live / slots if slots else None,
            "kv_utilisation_kind": "derived from lengths per forward pass: tokens a row needs / batch x cache length"}


def _run_hf_continuous(spec: dict, requests: list[BenchRequest]) -> dict:
    """transformers' continuous batching (the engine behind generate_batch) with per-request max_new_tokens."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, load_s = _load_hf(spec)
    eos = _eos_ids(spec["model_dir"])
    ps = spec["page_size"]
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1,
                          pad_token_id=0)
    # transformers 5.17 called the page size block_size (the H200 image has 5.17); later releases page_size.
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = {"page_size": ps} if "page_size" in fields else {"block_size": ps}
    cb = ContinuousBatchingConfig(**page, num_blocks=spec["num_blocks"],
                                  max_batch_tokens=spec["max_batch_tokens"],
                                  max_requests_per_batch=spec["max_requests"], allow_block_sharing=True)
    results: dict[str, object] = {}
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=30,
                                                                    continuous_batching_config=cb) as mgr:
        t = time.perf_counter()
        for r in requests:
            mgr.add_request(list(r.prompt_token_ids), request_id=r.id, max_new_tokens=r.max_tokens,
                            eos_token_id=-1 if r.ignore_eos or not eos else sorted(eos))
        while len(results) < len(requests):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                if res.error is not None:
                    raise PagedrunError(f"bench: hf-continuous failed request {res.request_id}: {res.error}")
                results[res.request_id] = res
            elif res is None and not mgr.is_running():
                raise PagedrunError("bench: hf-continuous stopped before finishing every request")
        _sync(spec["device"])
        wall = time.perf_counter() - t
    outputs = [_cut(list(results[r.id].generated_tokens), r, eos) for r in requests]
    live = slots = 0
    for r, o in zip(requests, outputs):
        for k in range(len(o)):
            n = len(r.prompt_token_ids) + k
            live += n
            slots += -(-n // ps) * ps
    bpt = _kv_bytes_per_token(model)
    return {"wall_s": wall, "load_s": load_s, "outputs": outputs,
            "executed_tokens": sum(len(r.prompt_token_ids) + len(o) - 1 for r, o in zip(requests, outputs)),
            "prefix_hit_tokens": None,
            "prefix_hit_tokens_kind": "not observed (transformers' scheduler is not instrumented): counted as 0; "
                                      "with allow_block_sharing it may reuse prefix blocks, so its roof fraction "
                                      "is an upper bound where prompts share prefixes",
            "kv_bytes": spec["num_blocks"] * ps * bpt, "kv_bytes_kind": "derived: num_blocks x page_size x bytes/token",
            "kv_peak_bytes": None, "kv_peak_bytes_kind": "not observed (transformers' scheduler is not instrumented)",
            "kv_utilisation": live / slots if slots else None,
            "kv_utilisation_kind": "derived from lengths: last-page waste only, each request's steps equally weighted"}
