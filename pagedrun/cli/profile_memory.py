"""`pagedrun profile-memory`: where every byte goes, and how the budget becomes KV blocks.

It starts the engine exactly as `pagedrun generate` would (load, profile pass, plan, allocate the
cache), then prints the plan as a table on stdout, each number marked measured or derived, and
optionally writes the same numbers as JSON (field names documented in docs/design/memory.md, schema below).
With --prompts it also sizes the cache against that file's real requests.
"""
from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from pagedrun.attention.scratch import DECODE_GATHER_TOKENS
from pagedrun.config.recipe import load_recipe
from pagedrun.console import results_console
from pagedrun.errors import PagedrunError
from pagedrun.report.kv_dtype_table import kv_dtype_rows, kv_dtype_table
from pagedrun.worker.memory import KVBudgetError, MemoryPlan, fmt_bytes, request_blocks, requests_fit
from pagedrun.worker.profiler import rss_bytes

SCHEMA = "pagedrun.profile-memory/1"


def run_profile_memory(*, recipe_path: Path | None, overrides: list[str], prompts: Path | None,
                       json_path: Path | None, console: Console) -> int:
    from pagedrun.llm import LLM
    from pagedrun.models.model_defaults import apply_model_defaults

    # resolved here (LLM would do it too) so that the report shows what ran: dtype, CUDA's scheduler
    recipe = apply_model_defaults(load_recipe(recipe_path, overrides))
    if prompts is not None and not Path(prompts).is_file():
        raise PagedrunError(f"{prompts}: prompts file not found")
    try:
        with console.status("loading the model and profiling one step…", spinner="dots"):
            llm = LLM(recipe)
    except KVBudgetError as e:
        # Show every number that led to the refusal, then let the CLI print the one-line error.
        data = plan_json(e.plan, recipe, None, error=str(e))
        results_console(console).print(plan_table(data))
        _write_json(json_path, data)
        raise
    engine = llm.engine
    fit = None
    if prompts is not None:
        requests, invalid = llm.read_requests(Path(prompts), skip_invalid=True, batch_job=_batch_job(prompts, recipe))
        if engine.memory.kv_groups:  # sliding groups hold their window: the manager's own count
            blocks = [engine.kv.blocks_to_finish(len(r.prompt_token_ids), min(len(r.prompt_token_ids) +
                      r.sampling.max_tokens, engine.max_model_len), r.sampling.n) for r in requests]
        else:
            blocks = [request_blocks(len(r.prompt_token_ids), r.sampling.max_tokens, r.sampling.n,
                                     engine.memory.block_size, engine.max_model_len) for r in requests]
        fit = {"path": str(prompts), "num_invalid": len(invalid), **requests_fit(blocks, engine.memory.num_gpu_blocks).__dict__}
    model = {"path": str(engine.worker.model_dir), "architecture": engine.model_config.architecture,
             "dtype": llm.recipe.model.dtype, "num_layers": engine.model_config.num_hidden_layers,
             "num_kv_heads": engine.model_config.num_key_value_heads, "head_dim": engine.model_config.head_dim,
             # All experts stay resident (weights_bytes counts them); a token computes with the active ones.
             "num_parameters": engine.model_config.num_parameters(),
             "active_parameters": engine.model_config.active_parameters()}
    data = plan_json(engine.memory, recipe, fit, model=model)
    data["derived"]["kv_cache_dtype"] = engine.worker.kv_spec.name
    data["kv_dtypes"] = kv_dtype_rows(engine.memory, engine.model_config, engine.worker.dtype, engine.worker.kv_spec.name)
    if engine.worker.device.type == "cpu":
        data["measured"]["rss_after_start_bytes"] = rss_bytes()
    out = results_console(console)
    out.print(plan_table(data))
    out.print(kv_dtype_table(data["kv_dtypes"], engine.memory.kv_budget_bytes, engine.max_model_len, fmt_bytes))
    _write_json(json_path, data)
    return 0


def _batch_job(prompts: Path, recipe):
    """What an OpenAI batch file's lines are checked with, as `pagedrun generate` would (the ids are not shown)."""
    import hashlib

    from pagedrun.cli.job import model_name
    from pagedrun.io.input_files import read_input
    from pagedrun.io.openai_batch import BatchJob

    sha = hashlib.sha256(read_input(Path(prompts), "prompts")).hexdigest()  # of the text (a .gz decompressed)
    return BatchJob(input_sha256=sha, model=model_name(recipe), created=0)


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def plan_json(plan: MemoryPlan, recipe, requests: dict | None, *, model: dict | None = None,
              error: str | None = None) -> dict:
    """The report's stable JSON form (docs/design/memory.md lists every field). Bytes are integers."""
    p = plan.profile
    c, s = recipe.cache, recipe.scheduler
    measured = None
    if p is not None:
        measured = {
            "method": p.method,
            "device_total_bytes": p.total_bytes,
            "device_free_before_bytes": p.free_before_bytes,
            "device_free_after_bytes": p.free_after_bytes,
            "activation_peak_bytes": p.activation_peak_bytes,
            "non_torch_bytes": p.non_torch_bytes,
            "torch_other_bytes": p.torch_other_bytes,
            "cupy_pool_bytes": p.cupy_pool_bytes,
            "host_available_bytes": plan.host_available_bytes,
            "profile_tokens": p.profile_tokens,
            "profile_seqs": p.profile_seqs,
            "profile_seconds": round(p.profile_s, 3),
        }
    derived = {
        "weights_bytes": p.weights_bytes if p else None,
        "peak_in_use_bytes": p.peak_in_use_bytes if p else None,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "budget_source": plan.budget_source,
        "block_bytes": plan.block_bytes,
        "kv_bytes_per_token": plan.block_bytes // plan.block_size,
        "num_blocks_from_budget": plan.blocks_from_budget,
        "num_blocks": plan.num_gpu_blocks,
        "overridden": plan.overridden,
        "capped_to_blocks": plan.capped_to_blocks,
        "kv_cache_bytes": plan.kv_cache_bytes,
        "decode_gather_bytes": plan.decode_gather_bytes,
        "token_capacity": plan.token_capacity,
        "blocks_per_max_len_seq": plan.blocks_per_seq,
        "max_concurrency_at_max_model_len": round(plan.max_concurrency, 4),
        "num_swap_blocks": plan.num_cpu_blocks,
        "swap_bytes": plan.swap_bytes,
        "swap_used": s.preemption_mode == "swap",
    }
    if plan.kv_groups:
        derived.update(kv_groups=list(plan.kv_groups), layers_per_block=plan.kv_slots,
                       decode_blocks_per_seq=plan.decode_seq_blocks, chunk_blocks=plan.chunk_blocks,
                       max_concurrency_every_block_kept=round(plan.max_concurrency_without_hybrid, 4))
    return {
        "schema": SCHEMA,
        "device": plan.device,
        "model": model,
        "recipe": {"block_size": c.block_size, "max_model_len": plan.max_model_len, "max_num_seqs": s.max_num_seqs,
                   "max_num_batched_tokens": s.max_num_batched_tokens, "kv_cache_memory": c.kv_cache_memory,
                   "gpu_memory_utilization": c.gpu_memory_utilization, "num_blocks": c.num_blocks,
                   "swap_space_gib": c.swap_space, "preemption_mode": s.preemption_mode},
        "measured": measured,
        "derived": derived,
        "requests": requests,
        "warnings": list(plan.warnings),
        "error": error,
    }


def plan_table(d: dict) -> Table:
    m, x, r = d["measured"] or {}, d["derived"], d["recipe"]
    cuda = d["device"].startswith("cuda")
    title = "pagedrun profile-memory" + (f" — {d['model']['architecture']}, {d['model']['dtype']}" if d["model"] else "")
    # No side borders, columns two spaces apart: at 80 columns "how" keeps ~30 of them, and folds
    # (a path) rather than cut. Numbers never wrap: a number cut in two reads as two numbers.
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("quantity")
    t.add_column("value", justify="right", no_wrap=True)
    t.add_column("source", style="dim", no_wrap=True)  # measured | derived
    t.add_column("how", style="dim", overflow="fold")
    M, D = "measured", "derived"
    b = fmt_bytes
    dev = "GPU" if cuda else "RAM"
    if m:
        t.add_row(f"device total ({dev})", b(m["device_total_bytes"]), M, "cudaMemGetInfo" if cuda else "MemTotal")
        t.add_row("free before profile", b(m["device_free_before_bytes"]), M,
                  "cudaMemGetInfo, weights loaded" if cuda else "MemAvailable, weights loaded")
        t.add_row("free after profile", b(m["device_free_after_bytes"]), M,
                  "after empty_cache" if cuda else "MemAvailable")
        md0 = d["model"] or {}
        params = ""
        if md0.get("num_parameters"):
            params = f"; {md0['num_parameters'] / 1e6:,.1f}M parameters"
            if md0["active_parameters"] != md0["num_parameters"]:
                params += f", {md0['active_parameters'] / 1e6:,.1f}M active per token (all experts resident)"
        t.add_row("weights", b(x["weights_bytes"]), D, "parameters + buffers" + params)
        t.add_row("activation peak", b(m["activation_peak_bytes"]), M,
                  f"{m['profile_tokens']} tokens in {m['profile_seqs']} seqs + sampler, {m['profile_seconds']:.2f}s; "
                  f"{m['method']}")
        t.add_row("outside torch", b(m["non_torch_bytes"]), M,
                  (f"in use per driver - torch reserved; CuPy pool {b(m['cupy_pool_bytes'])}" if cuda
                   else "RSS - weights: interpreter, libraries, tokenizer"))
        if cuda:
            t.add_row("other torch", b(m["torch_other_bytes"]), M, "torch allocated - weights before the pass")
        t.add_row("peak in use", b(x["peak_in_use_bytes"]), D, "sum of the four above" if cuda else "sum of the three above")
    t.add_row("KV budget", b(x["kv_budget_bytes"]), D, x["budget_source"])
    md = d["model"]
    per_head = x["kv_bytes_per_token"] / (2 * (x.get("layers_per_block") or md["num_layers"]) * md["num_kv_heads"]) \
        if md else 0
    layers = x.get("layers_per_block") or (md["num_layers"] if md else 0)
    formula = (f"2 x {layers} layers x {md['num_kv_heads']} kv heads x {per_head:g} B ("
               f"{x.get('kv_cache_dtype', md['dtype'])}, head {md['head_dim']}) x {r['block_size']} tokens"
               if md else f"{x['kv_bytes_per_token']:,} B/token x {r['block_size']}")
    t.add_row("block bytes", f"{x['block_bytes']:,} B", D, formula)
    how = f"floor(budget / block bytes) = {x['num_blocks_from_budget']:,}"
    if x["overridden"]:
        how = f"cache.num_blocks OVERRIDE (the budget allows {x['num_blocks_from_budget']:,})"
    elif x["capped_to_blocks"] is not None:
        how += f", capped at 2 x max_num_seqs x {x['blocks_per_max_len_seq']} blocks/seq"
    t.add_row("KV blocks", f"{x['num_blocks']:,}", D, how)
    t.add_row("KV cache", b(x["kv_cache_bytes"]), D, "blocks x block bytes")
    if x["decode_gather_bytes"]:
        t.add_row("decode gather (est.)", b(x["decode_gather_bytes"]), D,
                  f"torch backend: one decode call's K/V gather (at most {DECODE_GATHER_TOKENS:,} rows) + SDPA's work")
    t.add_row("token capacity", f"{x['token_capacity']:,}", D, "blocks x block_size")
    if x.get("kv_groups"):
        t.add_row("KV cache groups", f"{len(x['kv_groups'])}", D,
                  f"a block holds {x['layers_per_block']} layers of one group; " + "; ".join(x["kv_groups"]))
        t.add_row(f"max concurrency @ {r['max_model_len']}", f"{x['max_concurrency_at_max_model_len']:.2f}x", D,
                  f"(blocks - {x['chunk_blocks']:,} for a step's chunk) / {x['decode_blocks_per_seq']} blocks per "
                  "decoding max_model_len sequence (sliding groups hold their window)")
        t.add_row("  every block kept", f"{x['max_concurrency_every_block_kept']:.2f}x", D,
                  "the same bytes / a max_model_len sequence of every layer (cache.hybrid_kv: false)")
    else:
        t.add_row(f"max concurrency @ {r['max_model_len']}", f"{x['max_concurrency_at_max_model_len']:.2f}x", D,
                  f"blocks / {x['blocks_per_max_len_seq']} blocks per max_model_len sequence")
    q = d["requests"]
    if q:
        t.add_row("max concurrency @ prompts", f"{q['max_concurrency']:.2f}x", D,
                  f"{q['num_requests']} requests of {q['path']}: mean {q['mean_blocks']:.1f}, max {q['max_blocks']} "
                  f"blocks (prompt + max_tokens); scheduler cap {r['max_num_seqs']} seqs"
                  + (f"; {q['never_fit']} never fit" if q["never_fit"] else ""))
    t.add_row("swap blocks", f"{x['num_swap_blocks']:,}", D,
              f"swap_space {r['swap_space_gib']:g} GiB / block bytes, at most the KV blocks; "
              + ("used (preemption_mode swap)" if x["swap_used"] else "not allocated (preemption_mode recompute)"))
    if "rss_after_start_bytes" in m:
        t.add_row("resident now", b(m["rss_after_start_bytes"]), M,
                  "VmRSS after start-up: KV pages are committed as blocks are first written")
    for w in d["warnings"]:
        t.add_row("[yellow]warning[/]", "", "", w)
    if d["error"]:
        t.add_row("[red]error[/]", "", "", d["error"])
    return t
