"""`pagedrun bench`: the same greedy requests through pagedrun, HF `generate` with static batching
(a batch-size sweep, left padding) and HF continuous batching (paged), on one model, dtype, device
and thread count, in one run.

Each engine configuration runs in its own Python process (one after another) so that its peak
resident memory is its own; the process reports its wall time (generation only, model load excluded),
its outputs and what it knows about its KV cache. The parent checks that every engine produced the
same tokens as pagedrun for every request, measures the machine's matmul FLOP/s for the dtype, and
prints and writes the comparison.

Fairness rules: the same thread count (torch.set_num_threads) everywhere; the two paged engines get
the same KV capacity (by default sized to hold every request at once, so neither preempts) and the
same per-step token budget; HF static batching generates each batch to its longest max_tokens and
only each request's own max_tokens count as useful output.
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from pagedrun.errors import PagedrunError
from pagedrun.workloads import BenchRequest

ENGINES = ("pagedrun", "hf-static", "hf-continuous")
_DTYPES = ("float32", "bfloat16", "float16")


# ---- entry point ------------------------------------------------------------------------------------
def run_bench(*, workload: str, model: str, quick: bool, json_path: Path | None, dtype: str, engines: list[str],
              overrides: list[str], console: Console, isolate: bool = True, threads: int | None = None,
              static_batch_sizes: list[int] | str | None = None, continuous_max_requests: list[int] | None = None) -> int:
    import torch

    from pagedrun.recipe import load_recipe

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if isinstance(static_batch_sizes, str):
        static_batch_sizes = parse_sizes(static_batch_sizes)
    engines = [e.strip() for e in engines if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise PagedrunError(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    if dtype not in _DTYPES:
        raise PagedrunError(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    model_dir = resolve_bench_model(model)
    recipe = load_recipe(None, [f"model.path={model_dir}", f"model.dtype={dtype}", *overrides])
    device = "cuda" if recipe.model.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    threads = threads or recipe.model.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    cfg = json.loads((model_dir / "config.json").read_text())
    requests = load_workload(workload, model_dir, cfg, quick, recipe)
    params = count_params(model_dir)

    bs = recipe.cache.block_size
    base_overrides = [f"model.path={model_dir}", f"model.dtype={dtype}", f"model.threads={threads}",
                      f"model.device={device}"]
    if not any(o.split("=")[0].strip() in ("cache.num_blocks", "cache.kv_cache_memory") for o in overrides):
        # Room for every request at once: the comparison is about batching, not about preemption.
        base_overrides.append(f"cache.num_blocks={sum(-(-(r_len(r)) // bs) for r in requests) + 1}")
    specs: list[dict] = []
    if "pagedrun" in engines:
        specs.append({"engine": "pagedrun", "config": "continuous, paged", "overrides": base_overrides + overrides})
    if "hf-static" in engines:
        sizes = static_batch_sizes or ([4, len(requests)] if quick else [8, 16, 64])
        for b in sorted({min(b, len(requests)) for b in sizes}):
            specs.append({"engine": "hf-static", "config": f"batch {b}", "batch_size": b})
    if "hf-continuous" in engines:
        sizes = continuous_max_requests or ([recipe.scheduler.max_num_seqs] if quick
                                            else [16, recipe.scheduler.max_num_seqs])
        for m in sorted(set(sizes)):
            specs.append({"engine": "hf-continuous", "config": f"max {m} requests/batch", "max_requests": m,
                          "page_size": bs, "max_batch_tokens": recipe.scheduler.max_num_batched_tokens})

    console.print(f"[bold]bench[/] {len(requests)} requests ({workload}), model {model} "
                  f"({params['total'] / 1e6:.1f}M params, {dtype}, {device}, {threads} threads)", highlight=False)
    flops = matmul_flops_per_s(dtype, device, quick)
    console.print(f"matmul roofline: {flops / 1e9:,.1f} GFLOP/s ({dtype}, {threads} threads)", highlight=False)

    common = {"model_dir": str(model_dir), "dtype": dtype, "device": device, "threads": threads,
              "requests": [r.__dict__ for r in requests]}
    rows: list[dict] = []
    for spec in specs:
        if spec["engine"] == "hf-continuous":
            cap = next((r["kv_capacity_tokens"] for r in rows if r["engine"] == "pagedrun"), None)
            spec["num_blocks"] = -(-(cap or sum(r_len(r) + bs for r in requests)) // bs)
        with console.status(f"running {spec['engine']} ({spec['config']})…", spinner="dots"):
            row = run_isolated({**common, **spec}) if isolate else run_engine({**common, **spec})
        row.update(engine=spec["engine"], config=spec["config"])
        finish_row(row, requests, params, flops)
        rows.append(row)
        console.print(f"  {spec['engine']:<14} {spec['config']:<22} {row['wall_s']:8.2f} s "
                      f"{row['output_tokens_per_s']:9.1f} out tok/s", highlight=False)

    mismatches = compare_outputs(rows, requests)
    result = summarise(rows, mismatches, requests, workload, model, model_dir, params, dtype, device, threads,
                       flops, quick, isolate)
    result["machine"]["load_average_start"] = load_start
    console.print(render_table(result))
    if mismatches:
        console.print(f"[bold red]{len(mismatches)} output mismatches[/] (first: {mismatches[0]})", highlight=False)
    else:
        console.print(f"greedy outputs identical across {len(rows)} engine runs for all {len(requests)} requests")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=1))
        console.print(f"results: {json_path}", highlight=False)
    return 1 if mismatches else 0


def parse_sizes(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise PagedrunError(f"--batch-sizes: {text!r} is not a comma-separated list of positive integers")
    return sizes


def r_len(r: BenchRequest) -> int:
    return len(r.prompt_token_ids) + r.max_tokens


def resolve_bench_model(model: str) -> Path:
    if model == "tiny-llama":
        from pagedrun.workloads import tiny_llama_dir

        return tiny_llama_dir()
    if model == "default":
        from pagedrun.models.default_model import default_model_dir

        return default_model_dir()
    p = Path(model)
    if not (p / "config.json").is_file():
        raise PagedrunError(f"--model: {model!r} is not tiny-llama, default or a directory with a config.json")
    return p.resolve()


def load_workload(workload: str, model_dir: Path, cfg: dict, quick: bool, recipe) -> list[BenchRequest]:
    from pagedrun.workloads import from_requests, make_workload

    if workload in ("standard", "shared-prefix"):
        return make_workload(workload, cfg["vocab_size"], quick, seed=recipe.seed)
    path = Path(workload)
    if not path.is_file():
        raise PagedrunError(f"--workload: {workload!r} is not standard, shared-prefix or an existing .jsonl file")
    from pagedrun.io.requests import read_requests
    from pagedrun.models.loader import load_tokenizer

    mml = recipe.model.max_model_len or min(cfg.get("max_position_embeddings", 8192), 8192)
    reqs, _ = read_requests(path, load_tokenizer(model_dir), recipe.sampling, vocab_size=cfg["vocab_size"],
                            max_model_len=mml)
    return from_requests(reqs)


def count_params(model_dir: Path) -> dict:
    """Parameters from the safetensors headers. `matmul` excludes the input embedding (a lookup, no
    FLOPs) but counts the LM head (the embedding again when tied): FLOPs per token ~ 2 x matmul."""
    from safetensors import safe_open

    total = embed = 0
    has_head = False
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = math.prod(st.get_slice(k).get_shape())
                total += n
                if k.endswith("embed_tokens.weight"):
                    embed = n
                if k.endswith("lm_head.weight"):
                    has_head = True
    return {"total": total, "embedding": embed, "matmul": total - embed if has_head else total}


def matmul_flops_per_s(dtype: str, device: str, quick: bool) -> float:
    """Best of a few timed torch.matmul calls on square matrices: the compute roof for this dtype."""
    import torch

    n = 1024 if quick else 2048
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        torch.matmul(a, b)
    sync()
    best = float("inf")
    deadline = time.perf_counter() + (0.5 if quick else 2.0)
    while True:
        t = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


# ---- one engine configuration ------------------------------------------------------------------------
def run_isolated(spec: dict) -> dict:
    """Run `spec` in a fresh interpreter: its peak RSS then belongs to this engine alone."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]),
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with tempfile.TemporaryDirectory(prefix="pagedrun-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-c", "from pagedrun.bench import _worker_main; _worker_main()",
                               str(spec_path), str(out_path)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise PagedrunError(f"bench: {spec['engine']} ({spec.get('config', '')}) failed: " + " | ".join(tail))
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
    from pagedrun.engine.llm import LLM
    from pagedrun.io.requests import Request
    from pagedrun.report import build_report
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
        "executed_tokens": sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps),
        "kv_capacity_tokens": m.token_capacity,
        "kv_bytes": m.num_gpu_blocks * m.block_bytes,
        "kv_bytes_kind": "measured: blocks allocated x block bytes",
        "kv_peak_bytes": report["blocks_in_use"]["peak"] * m.block_bytes,
        "kv_peak_bytes_kind": "measured: peak blocks in use x block bytes",
        "kv_utilisation": report["utilisation"]["tokens_stored_over_slots_allocated"],
        "kv_utilisation_kind": "measured per step: tokens stored / blocks in use x block_size, summed over steps",
        "report": report,
    }


def _kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def _load_hf(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]))
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
    cb = ContinuousBatchingConfig(page_size=ps, num_blocks=spec["num_blocks"],
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
            "kv_bytes": spec["num_blocks"] * ps * bpt, "kv_bytes_kind": "derived: num_blocks x page_size x bytes/token",
            "kv_peak_bytes": None, "kv_peak_bytes_kind": "not observed (transformers' scheduler is not instrumented)",
            "kv_utilisation": live / slots if slots else None,
            "kv_utilisation_kind": "derived from lengths: last-page waste only, each request's steps equally weighted"}


# ---- comparison -------------------------------------------------------------------------------------
def finish_row(row: dict, requests: list[BenchRequest], params: dict, flops: float) -> None:
    out = sum(len(o) for o in row["outputs"])
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    wall = row["wall_s"]
    row.update(output_tokens=out, prompt_tokens=prompt, output_tokens_per_s=out / wall,
               total_tokens_per_s=(out + prompt) / wall)
    row["useful_flops_per_s"] = 2 * params["matmul"] * (out + prompt) / wall
    row["roofline_fraction"] = row["useful_flops_per_s"] / flops
    row["executed_roofline_fraction"] = 2 * params["matmul"] * row["executed_tokens"] / wall / flops


def compare_outputs(rows: list[dict], requests: list[BenchRequest]) -> list[dict]:
    """Every run against the first pagedrun run (or the first run): one entry per differing request."""
    ref = next((r for r in rows if r["engine"] == "pagedrun"), rows[0] if rows else None)
    out = []
    for row in rows:
        if row is ref:
            continue
        for req, a, b in zip(requests, ref["outputs"], row["outputs"]):
            if a != b:
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out.append({"request": req.id, "engine": row["engine"], "config": row["config"],
                            "first_difference_at": first, "reference_tokens": len(a), "tokens": len(b)})
        row["mismatches"] = sum(1 for m in out if m["engine"] == row["engine"] and m["config"] == row["config"])
    if ref is not None:
        ref["mismatches"] = 0
    return out


_RATIO_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "wall_s", "peak_rss_bytes", "kv_utilisation",
               "roofline_fraction")


def summarise(rows, mismatches, requests, workload, model, model_dir, params, dtype, device, threads, flops,
              quick, isolate) -> dict:
    import torch
    import transformers

    ref = next((r for r in rows if r["engine"] == "pagedrun"), None)
    best: dict[str, dict] = {}
    for r in rows:
        if r["engine"] not in best or r["output_tokens_per_s"] > best[r["engine"]]["output_tokens_per_s"]:
            best[r["engine"]] = r
    for r in rows:
        r["ratio_to_pagedrun"] = {k: (r[k] / ref[k] if ref and r.get(k) and ref.get(k) else None)
                                  for k in _RATIO_KEYS}
    engines = []
    for r in rows:
        e = {k: v for k, v in r.items() if k not in ("outputs", "report")}
        engines.append(e)
    return {
        "machine": machine_info(device, threads),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {"name": model, "path": str(model_dir), "dtype": dtype, "device": device, "parameters": params},
        "workload": {"name": workload, "quick": quick, "requests": len(requests),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "max_output_tokens": sum(r.max_tokens for r in requests)},
        "matmul_flops_per_s": flops,
        "roofline_note": "fraction = 2 x matmul parameters x (prompt + output tokens) / wall_s / matmul FLOP/s; "
                         "executed_* counts padding and recomputation too; attention FLOPs are not counted",
        "memory_isolated": isolate,
        "engines": engines,
        "best": {k: {"config": v["config"], "output_tokens_per_s": v["output_tokens_per_s"],
                     "ratio_to_pagedrun": v["ratio_to_pagedrun"]} for k, v in best.items()},
        "outputs_match": not mismatches,
        "mismatches": mismatches,
        "pagedrun_report": ref["report"] if ref else None,
    }


def machine_info(device: str, threads: int) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "device": device,
            "load_average_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


def render_table(result: dict):
    from rich.table import Table

    t = Table(title=f"pagedrun bench: {result['workload']['name']}, {result['model']['name']} "
                    f"({result['model']['dtype']}, {result['machine']['threads']} threads)")
    for col in ("engine", "config", "out tok/s", "total tok/s", "wall s", "peak RSS", "KV util", "x pagedrun",
                "roofline", "mismatches"):
        t.add_column(col, justify="left" if col in ("engine", "config") else "right")
    for r in result["engines"]:
        ratio = r["ratio_to_pagedrun"]["output_tokens_per_s"]
        u = r.get("kv_utilisation")
        t.add_row(r["engine"], r["config"], f"{r['output_tokens_per_s']:,.1f}", f"{r['total_tokens_per_s']:,.1f}",
                  f"{r['wall_s']:.2f}", f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB", f"{u:.1%}" if u is not None else "-",
                  f"{ratio:.2f}" if ratio is not None else "-", f"{r['roofline_fraction']:.1%}", str(r["mismatches"]))
    return t
