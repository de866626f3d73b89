"""`pagedrun bench`: the same greedy requests through pagedrun, HF `generate` with static batching
(a batch-size sweep, left padding) and HF continuous batching (paged), on one model, dtype, device
and thread count, in one run.

Each engine configuration (pagedrun/bench/engines.py) runs in its own Python process, one after
another, so that its peak resident memory is its own; the process reports its wall time (generation
only, model load excluded), its outputs and what it knows about its KV cache. The parent checks that
every engine produced the same tokens as pagedrun for every request, measures the machine's matmul
FLOP/s for the dtype, and prints and writes the comparison.

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
from pathlib import Path

from rich.console import Console

from pagedrun.bench.engines import run_engine, run_isolated
from pagedrun.bench.roof import Roof
from pagedrun.bench.workloads import BenchRequest
from pagedrun.errors import PagedrunError
from pagedrun.report.machine import machine_info

ENGINES = ("pagedrun", "hf-static", "hf-continuous", "vllm")
_DTYPES = ("float32", "bfloat16", "float16")


# ---- entry point ------------------------------------------------------------------------------------
def run_bench(*, workload: str, model: str, quick: bool, json_path: Path | None, dtype: str, engines: list[str],
              overrides: list[str], console: Console, isolate: bool = True, threads: int | None = None,
              static_batch_sizes: list[int] | str | None = None, continuous_max_requests: list[int] | None = None,
              vllm_python: str | None = None) -> int:
    import torch

    from pagedrun.config.recipe import load_recipe

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if isinstance(static_batch_sizes, str):
        static_batch_sizes = parse_sizes(static_batch_sizes)
    engines = [e.strip() for e in engines if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise PagedrunError(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    if dtype not in _DTYPES:
        raise PagedrunError(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    if "vllm" in engines:
        from pagedrun.bench.vllm_peer import check_python

        vllm_python = check_python(vllm_python)
        # vLLM-CPU takes block sizes that are multiples of 32 only; pagedrun's largest is 32.
        overrides = [o for o in overrides if o.split("=")[0].strip() != "cache.block_size"] + ["cache.block_size=32"]
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
        base_overrides.append(room_for_all(requests, bs, layers_per_block(model_dir, recipe)))
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
    if "vllm" in engines:
        specs.append({"engine": "vllm", "config": "vLLM-CPU, paged", "block_size": bs,
                      "max_num_seqs": recipe.scheduler.max_num_seqs,
                      "max_num_batched_tokens": recipe.scheduler.max_num_batched_tokens,
                      "max_model_len": recipe.model.max_model_len
                      or min(cfg.get("max_position_embeddings", 8192), 8192),
                      "enable_prefix_caching": recipe.cache.enable_prefix_caching, "seed": recipe.seed,
                      "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype)})

    console.print(f"[bold]bench[/] {len(requests)} requests ({workload}), {model} "
                  f"({params['total'] / 1e6:.1f}M params, {dtype}, {device}, {threads} threads)", highlight=False)
    roof = Roof(dtype, device, threads, quick)
    console.print(f"roof: {roof.describe()}", highlight=False)

    common = {"model_dir": str(model_dir), "dtype": dtype, "device": device, "threads": threads,
              "requests": [r.__dict__ for r in requests]}
    rows: list[dict] = []
    for spec in specs:
        cap = next((r["kv_capacity_tokens"] for r in rows if r["engine"] == "pagedrun"), None)
        if spec["engine"] == "hf-continuous":
            spec["num_blocks"] = -(-(cap or sum(r_len(r) + bs for r in requests)) // bs)
        if spec["engine"] == "vllm":
            # pagedrun's KV capacity in bytes (room for every request by default, as for pagedrun).
            tokens = cap or sum(r_len(r) + bs for r in requests)
            # + 1 block: vLLM v1 keeps block 0 as its null block, so the usable capacity is equal.
            spec["kv_cache_memory_bytes"] = (tokens + bs) * spec["kv_bytes_per_token"]
            # vLLM refuses to start unless one sequence of max_model_len fits in the cache; every
            # request here is shorter than the capacity, so capping it changes no admission.
            spec["max_model_len"] = min(spec["max_model_len"], tokens // bs * bs)
        with console.status(f"running {spec['engine']} ({spec['config']})…", spinner="dots"):
            if spec["engine"] == "vllm":
                from pagedrun.bench.vllm_peer import run_vllm

                row = run_vllm({**common, **spec}, vllm_python)
            else:
                row = run_isolated({**common, **spec}) if isolate else run_engine({**common, **spec})
        row.update(engine=spec["engine"], config=spec["config"])
        finish_row(row, requests, params, roof.flops)  # redone below against the final roof
        rows.append(row)
        console.print(f"  {spec['engine']} ({spec['config']}): {row['wall_s']:.2f} s, "
                      f"{row['output_tokens_per_s']:,.1f} out tok/s, load {row['load_s']:.1f} s", highlight=False)
        if row.get("kv_populate_s"):  # inside pagedrun's timed run; vLLM zeroes its cache at load
            console.print(f"    of which committing KV pages: {row['kv_populate_s']:.2f} s", highlight=False)

    # The roof is timed again after the engines and the higher of the two is used: on a shared VM the
    # same loop's speed moved between minutes, and a roof caught in a slow minute would flatter
    # every engine's fraction (docs/log/2026-11-21-decode-attention-by-sequence-huge-pages.md).
    roof.measure_again()
    flops = roof.flops
    console.print(f"roof after the engines: {roof.samples[-1] / 1e9:,.1f} GFLOP/s; using {flops / 1e9:,.1f}",
                  highlight=False)
    for row in rows:
        finish_row(row, requests, params, flops)
    mismatches = compare_outputs(rows, requests)
    result = summarise(rows, mismatches, requests, workload, model, model_dir, params, dtype, device, threads,
                       flops, quick, isolate)
    result["roof"] = roof.as_dict()
    result["machine"]["load_average_start"] = load_start
    # pagedrun's own allocator settings (pagedrun/worker/malloc_tuning.py; HF keeps glibc's defaults).
    result["machine"]["pagedrun_malloc_tuning"] = next(
        (r.get("malloc_tuning") for r in rows if r["engine"] == "pagedrun"), None)
    result["matmul_flops_per_s_samples"] = roof.samples
    from pagedrun.bench.tables import bench_tables
    from pagedrun.console import results_console

    out = results_console(console)  # the results: on stdout from the CLI, progress stays on stderr
    out.print(bench_tables(result))
    # float32 is exact (every engine equals HF token for token; a difference is a bug). In bf16/fp16
    # each engine's GEMM sums in its own order and rounds to 16 bits, so greedy paths part where two
    # logits are within a rounding of each other: reported, with where, not a failure.
    exact = dtype == "float32"
    if mismatches:
        colour = "bold red" if exact else "yellow"
        note = "" if exact else f" ({dtype}: rounding differs between engines; positions in the JSON)"
        out.print(f"[{colour}]{len(mismatches)} output mismatches[/]{note} (first: {mismatches[0]})", highlight=False)
    else:
        out.print(f"greedy outputs identical across {len(rows)} engine runs for all {len(requests)} requests")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=1))
        console.print(f"results: {json_path}", highlight=False)
    return 1 if mismatches and exact else 0


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


def room_for_all(requests: list[BenchRequest], block_size: int, layers_per_block: tuple[int, int] = (1, 1)) -> str:
    """The cache override that holds every request at once with every block kept (the bench's
    default: it compares batching, not preemption), in the engine's blocks: with KV cache groups a
    block holds fewer layers (layers_per_block = (the model's layers, a block's)), so the same bytes
    are more blocks, the bytes vLLM is given."""
    full = sum(-(-(r_len(r)) // block_size) for r in requests) + 1
    layers, per_block = layers_per_block
    return f"cache.num_blocks={full * layers // per_block}"


def layers_per_block(model_dir: Path, recipe) -> tuple[int, int]:
    """(the model's layers, the layers one block of pagedrun's cache holds: kv/groups.py)."""
    from pagedrun.kv.groups import plan_groups
    from pagedrun.models.loader import read_config

    cfg = read_config(model_dir, recipe.model.max_model_len)
    layers = cfg.num_hidden_layers
    return layers, plan_groups([cfg.window_of(i) for i in range(layers)], recipe.cache.hybrid_kv).num_slots


def r_len(r: BenchRequest) -> int:
    return len(r.prompt_token_ids) + r.max_tokens


def resolve_bench_model(model: str) -> Path:
    if model == "tiny-llama":
        from pagedrun.bench.workloads import tiny_llama_dir

        return tiny_llama_dir()
    if model == "default":
        from pagedrun.models.default_model import default_model_dir

        return default_model_dir()
    p = Path(model)
    if not (p / "config.json").is_file():
        raise PagedrunError(f"--model: {model!r} is not tiny-llama, default or a directory with a config.json")
    return p.resolve()


def load_workload(workload: str, model_dir: Path, cfg: dict, quick: bool, recipe) -> list[BenchRequest]:
    from pagedrun.bench.workloads import from_requests, make_workload

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


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    """K and V of every layer for one token, in the model's dtype (from config.json)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def count_params(model_dir: Path) -> dict:
    """Parameters from the safetensors headers. `matmul` excludes the input embedding (a lookup, no
    FLOPs) but counts the LM head (the embedding again when tied); `head` is the LM head alone, whose
    FLOPs count only where logits are computed (one position per output token)."""
    from safetensors import safe_open

    total = embed = head_n = 0
    has_head = False
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = math.prod(st.get_slice(k).get_shape())
                total += n
                if k.endswith("embed_tokens.weight"):
                    embed = n
                if k.endswith("lm_head.weight"):
                    has_head, head_n = True, n
    head = head_n if has_head else embed
    matmul = total - embed if has_head else total
    # A mixture of experts computes each token with its top-k experts only: the experts it skips do
    # no useful FLOPs (counting them put MoE engines above the roof).
    inactive = 0
    try:
        from pagedrun.models.loader import read_config

        cfg = read_config(model_dir)
        inactive = cfg.num_parameters() - cfg.active_parameters()
    except Exception:  # a folder pagedrun cannot parse: the headers' count, as before
        pass
    return {"total": total, "embedding": embed, "matmul": matmul - inactive, "head": head, "inactive_experts": inactive}


# ---- comparison -------------------------------------------------------------------------------------
def finish_row(row: dict, requests: list[BenchRequest], params: dict, flops: float) -> None:
    out = sum(len(o) for o in row["outputs"])
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    wall = row["wall_s"]
    row.update(output_tokens=out, prompt_tokens=prompt, output_tokens_per_s=out / wall,
               total_tokens_per_s=(out + prompt) / wall, e2e_s=row.get("load_s", 0.0) + wall)
    body = params["matmul"] - params["head"]
    # Every prompt token the engine's prefix cache did not serve, and every output token, goes
    # through the layers; logits only where a token is sampled: the last prompt position and each
    # output but the last, i.e. once per output token. (Counting the cached prompt tokens too put
    # engines above the peak on the shared-prefix workload: docs/log/2026-11-26-vllm-cpu-shared-prefix.md.)
    hits = row.get("prefix_hit_tokens") or 0
    row["useful_flops_per_s"] = 2 * (body * (out + prompt - hits) + params["head"] * out) / wall
    row["roofline_fraction"] = row["useful_flops_per_s"] / flops
    row["executed_roofline_fraction"] = 2 * (body * row["executed_tokens"] + params["head"] * out) / wall / flops


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
        e = {k: v for k, v in r.items() if k != "report"}  # outputs kept: agreement can be rechecked
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
        "roofline_note": "fraction = 2 x (layer matmul parameters (a mixture of experts: those of the top-k "
                         "experts a token uses) x (prompt tokens not served from the engine's "
                         "prefix cache (prefix_hit_tokens) + output tokens) + LM head parameters x output tokens) "
                         "/ wall_s / roof FLOP/s; the roof (see 'roof') is the higher of two "
                         "measurements, before and after the engines; executed_* counts padding and "
                         "recomputation too; attention FLOPs are not counted",
        "memory_isolated": isolate,
        "engines": engines,
        "best": {k: {"config": v["config"], "output_tokens_per_s": v["output_tokens_per_s"],
                     "ratio_to_pagedrun": v["ratio_to_pagedrun"]} for k, v in best.items()},
        "outputs_match": not mismatches,
        "mismatches": mismatches,
        "pagedrun_report": ref["report"] if ref else None,
    }
