"""The memory-utilisation report, derived only from what the engine recorded.

Inputs: the engine's StepRecords (one per step, counted by the scheduler and the KV manager after
the step ran), its MemoryPlan (the KV cache it allocated) and the finished RequestOutputs (their
timestamps). Every number in the report is labelled in `provenance`:

  measured  counted or timed by the engine during the run (or read from what it allocated)
  derived   computed here from measured numbers; the formula is given

Averages over the run are step-weighted sums (sum of numerator over steps / sum of denominator over
steps), the way a time series of the cache would be summarised.
"""
from __future__ import annotations

import json
from pathlib import Path

from pagedrun.errors import PagedrunError
from pagedrun.io.file_safety import check_derived, is_report, replace_file, report_path
from pagedrun.report.latency import LatencySamples, exact_percentiles
from pagedrun.report.metrics import RunTally, StepLog

M, D = "measured", "derived"


def percentiles(xs, ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """p50/p90/p99 of a list of seconds (linear interpolation, numpy's default) or of LatencySamples
    (the same while exact, else from its histogram); None where there are none."""
    if isinstance(xs, LatencySamples):
        return xs.percentiles(ps)
    return exact_percentiles(xs, ps)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def build_report(engine, results, *, wall_s: float, load_s: float, interrupted: bool = False) -> dict:
    steps = engine.steps
    if not isinstance(steps, StepLog):  # a list of StepRecords
        steps = StepLog(steps)
    # Sums, maxima and the values at the peak step, kept by the StepLog as the steps came (bounded
    # memory at any length): sum(a - b) is sum(a) - sum(b), a step's derived value at the peak is
    # derived from its fields there.
    total, peak, at_peak = steps.total, steps.peak, steps.at_peak
    m = engine.memory
    bs = m.block_size
    bb = m.block_bytes
    bytes_per_token = bb // bs
    # A contiguous cache stores every layer of a token; with KV cache groups a block holds fewer.
    full_bytes_per_token = (m.full_block_bytes or bb) // bs
    n = len(steps)
    peak_blocks = peak("blocks_in_use")
    peak_step = steps.peak_step
    sum_blocks = total("blocks_in_use")
    sum_slots = sum_blocks * bs
    sum_stored = total("tokens_stored")
    sum_assigned = total("tokens_assigned")
    sum_waste = sum_slots - sum_assigned  # slots - tokens assigned, per step
    sum_pending = sum_assigned - sum_stored  # assigned - stored, per step
    slots_at_peak = peak_blocks * bs if peak_step is not None else None
    waste_at_peak = slots_at_peak - at_peak("tokens_assigned") if peak_step is not None else None
    mml = engine.max_model_len  # a contiguous cache of max_model_len per running sequence
    reserved = (peak("reserved_contiguous_tokens"), total("reserved_contiguous_tokens"))
    reserved_mml = (peak("num_running") * mml, total("num_running") * mml)
    sum_logical = total("tokens_logical")

    q = total("prefix_query_tokens")
    hit = total("prefix_hit_tokens")
    sin = total("swap_in_blocks")
    sout = total("swap_out_blocks")

    tally = RunTally.of(results)  # a list of RequestOutputs, or their tally
    out_tokens = tally.output_tokens
    prompt_tokens = tally.prompt_tokens
    prefill_computed = total("num_prefill_tokens")
    ttft, itl, e2e = tally.ttft_s, tally.itl_s, tally.e2e_s

    report = {
        "interrupted": interrupted,
        "cpu_kernels": cpu_kernels_status(engine),
        "num_steps": n,
        "num_requests": tally.num_ok + tally.num_errors,
        "num_errors": tally.num_errors,
        "memory_plan": m.to_dict(),
        "kv_capacity": {"blocks": m.num_gpu_blocks, "block_size": bs, "tokens": m.token_capacity,
                        "bytes": m.num_gpu_blocks * bb, "bytes_per_token": bytes_per_token,
                        "kv_cache_dtype": m.kv_cache_dtype},
        "kv_pages_committed": _pages_committed(engine, bb),
        "blocks_in_use": {"peak": peak_blocks, "mean": sum_blocks / n if n else 0.0,
                          "peak_fraction_of_capacity": _ratio(peak_blocks, m.num_gpu_blocks),
                          "cached_free_peak": peak("blocks_cached_free")},
        "utilisation": {
            "tokens_stored_over_slots_allocated": _ratio(sum_stored, sum_slots),
            "at_peak": _ratio(at_peak("tokens_stored"), slots_at_peak) if peak_step is not None else None,
            "tokens_stored_peak": peak("tokens_stored"),
        },
        "fragmentation": {
            "last_block_waste_tokens_mean": sum_waste / n if n else 0.0,
            "last_block_waste_tokens_at_peak": waste_at_peak,
            "last_block_waste_percent": 100 * sum_waste / sum_slots if sum_slots else None,
            "reserved_uncomputed_tokens_mean": sum_pending / n if n else 0.0,
        },
        "contiguous": {
            "request_max": _contiguous(*reserved, sum_logical, n, full_bytes_per_token, m, peak_blocks),
            "max_model_len": _contiguous(*reserved_mml, sum_logical, n, full_bytes_per_token, m, peak_blocks),
            "max_model_len_tokens": engine.max_model_len,
        },
        "prefix_cache": {"query_tokens": q, "hit_tokens": hit, "hit_rate": _ratio(hit, q),
                         "cow_copies": total("cow_copies")},
        "preemptions": {"recompute": total("preempted_recompute"),
                        "swap": total("preempted_swap"),
                        "swap_fallbacks": total("swap_fallbacks")},
        "swap": {"in_blocks": sin, "out_blocks": sout, "in_bytes": sin * bb, "out_bytes": sout * bb},
        "throughput": {
            "wall_s": wall_s, "load_s": load_s, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "prefill_tokens_computed": prefill_computed,
            "output_tokens_per_s": _ratio(out_tokens, wall_s), "prompt_tokens_per_s": _ratio(prompt_tokens, wall_s),
            "total_tokens_per_s": _ratio(out_tokens + prompt_tokens, wall_s),
        },
        "latency": {"ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
                    "exact": all(getattr(xs, "is_exact", True) for xs in (ttft, itl, e2e))},
    }
    if m.kv_groups:
        report["hybrid_kv"] = {
            "groups": list(m.kv_groups),
            "blocks_freed_by_window": engine.kv.stats.window_freed_blocks,
            "tokens_freed_by_window": engine.kv.stats.window_freed_blocks * bs,
            "peak_blocks_in_use": peak_blocks,
            "peak_blocks_per_group": steps.peak_blocks_per_group if n else [],
            "peak_blocks_every_block_kept": steps.peak_blocks_every_block_kept,
            "max_concurrency": m.max_concurrency,
            "max_concurrency_every_block_kept": m.max_concurrency_without_hybrid,
        }
    report["provenance"] = _provenance(report)
    return report


def cpu_kernels_status(engine) -> str | None:
    """'on' or 'off (<why>)' for the C++ CPU kernels of a CPU engine, None on a GPU. Loads them
    (once per process), so that start-up can say it before the first step builds them."""
    device = getattr(engine.worker, "device", None)  # absent on a Ray replica's rebuilt view (cli/ray/merge.py)
    if device is None or device.type != "cpu":
        return None
    from pagedrun.build import cpu as cpu_build
    from pagedrun.models import ops

    ops.load()
    load_attention = getattr(engine.worker.backend, "load_cpu_kernel", None)
    if load_attention is not None:
        try:
            load_attention()
        except RuntimeError:  # forced on (use_cpu_kernel=True) but unavailable: status() says why
            pass
    return cpu_build.status()


def _contiguous(peak: int, sum_reserved: int, sum_logical: int, n: int, bytes_per_token: int, m,
                peak_blocks: int) -> dict:
    """The peak and sum over the n steps of the tokens a contiguous cache reserves, and the sum of
    the tokens computed; bytes_per_token: every layer's K/V of one token (what a contiguous cache
    stores per token)."""
    return {
        "peak_tokens": peak,
        "peak_bytes": peak * bytes_per_token,
        "mean_tokens": sum_reserved / n if n else 0.0,
        "utilisation": _ratio(sum_logical, sum_reserved),
        "peak_over_paged_peak": _ratio(peak * bytes_per_token, peak_blocks * m.block_bytes),
        "peak_over_capacity": _ratio(peak * bytes_per_token, m.kv_cache_bytes),
    }


# Dotted path prefix -> (kind, how). The longest matching prefix wins.
_PROVENANCE: dict[str, tuple[str, str]] = {
    "run": (M, "what ran: the model (its id or folder), pagedrun's version, the device, the recipe as "
               "resolved (every default filled in), and the UTC times the run started and ended"),
    "run.recipe": (M, "the recipe as resolved: every key, defaults filled in"),
    "run.parameters": (D, "the model's parameters, from config.json's sizes (tied embeddings once; every expert)"),
    "run.active_parameters": (D, "the parameters one token computes with: an MoE block's top-k experts only "
                                 "(equal to parameters for a dense model)"),
    "interrupted": (M, "the run was stopped by a signal"),
    "cpu_kernels": (M, "whether the C++ CPU kernels (pagedrun/build/cpu.py) loaded: on, or off and why; "
                       "null on a GPU"),
    "num_steps": (M, "engine steps recorded"),
    "num_requests": (M, "records written by this run (cli/job.py): requests finished, and lines that could not run"),
    "num_errors": (M, "error records among them: lines that could not run and requests that failed"),
    "memory_plan": (M, "the KV cache plan the engine allocated (pagedrun.worker.memory.MemoryPlan)"),
    "hybrid_kv.groups": (M, "the KV cache groups: layers grouped by attention window (kv/groups.py)"),
    "hybrid_kv.blocks_freed_by_window": (M, "blocks sliding-window groups gave back as the window moved on"),
    "hybrid_kv.tokens_freed_by_window": (D, "blocks_freed_by_window x block_size"),
    "hybrid_kv.peak_blocks_in_use": (M, "= blocks_in_use.peak"),
    "hybrid_kv.peak_blocks_per_group": (M, "max over steps of the device blocks each KV cache group held, "
                                           "in the order of hybrid_kv.groups"),
    "hybrid_kv.peak_blocks_every_block_kept": (D, "max over steps of blocks in use + table entries the window "
                                                  "gave back (what keeping every block would have held)"),
    "hybrid_kv.max_concurrency": (D, "the memory plan's, at max_model_len, with the window's frees"),
    "hybrid_kv.max_concurrency_every_block_kept": (D, "the same KV bytes / a max_model_len sequence of every layer"),
    "kv_capacity.blocks": (M, "GPU/device KV blocks allocated"),
    "kv_capacity.block_size": (M, "tokens per block"),
    "kv_capacity.tokens": (D, "blocks x block_size"),
    "kv_capacity.bytes": (D, "blocks x block_bytes"),
    "kv_capacity.bytes_per_token": (D, "block_bytes / block_size"),
    "kv_capacity.kv_cache_dtype": (D, "cache.kv_cache_dtype resolved: auto = the model's dtype, fp8 = fp8_e4m3"),
    "kv_pages_committed.blocks": (M, "blocks whose memory the kernel committed ahead of first use "
                                     "(worker/populate.py); 0 where that is off (a GPU, an old kernel)"),
    "kv_pages_committed.bytes": (D, "blocks x block_bytes"),
    "kv_pages_committed.seconds": (M, "wall time committing them, inside the run (vLLM zeroes its cache "
                                      "at load)"),
    "blocks_in_use.peak": (M, "max over steps of blocks with ref_cnt > 0 after the step"),
    "blocks_in_use.mean": (D, "mean over steps of blocks in use"),
    "blocks_in_use.peak_fraction_of_capacity": (D, "peak / kv_capacity.blocks"),
    "blocks_in_use.cached_free_peak": (M, "max over steps of free blocks still holding a prefix-cache hash"),
    "utilisation.tokens_stored_over_slots_allocated":
        (D, "sum over steps of tokens stored / sum over steps of blocks in use x block_size"),
    "utilisation.at_peak": (D, "tokens stored / slots allocated at the step with peak blocks in use"),
    "utilisation.tokens_stored_peak": (M, "max over steps of slots holding computed KV (distinct blocks)"),
    "fragmentation.last_block_waste_tokens_mean":
        (D, "mean over steps of blocks in use x block_size - tokens assigned to slots"),
    "fragmentation.last_block_waste_tokens_at_peak": (D, "the same at the step with peak blocks in use"),
    "fragmentation.last_block_waste_percent": (D, "100 x sum of waste / sum of slots allocated, over steps"),
    "fragmentation.reserved_uncomputed_tokens_mean":
        (D, "mean over steps of slots assigned to prompt tokens not yet computed (chunked prefill)"),
    "contiguous.max_model_len_tokens": (M, "the engine's max_model_len"),
    "contiguous.request_max":
        (D, "what-if: every running sequence reserves min(prompt + max_tokens, max_model_len) contiguous slots"),
    "contiguous.max_model_len": (D, "what-if: every running sequence reserves max_model_len slots"),
    "prefix_cache.query_tokens": (M, "tokens looked up in the prefix cache at admission (a request re-admitted after a recompute "
                                         "preemption looks up again, its generated tokens included)"),
    "prefix_cache.hit_tokens": (M, "of those, tokens found cached (KV reused, not computed)"),
    "prefix_cache.hit_rate": (D, "hit_tokens / query_tokens"),
    "prefix_cache.cow_copies": (M, "copy-on-write block copies"),
    "preemptions": (M, "preemptions counted by the scheduler, by mode"),
    "swap.in_blocks": (M, "blocks swapped CPU -> device"),
    "swap.out_blocks": (M, "blocks swapped device -> CPU"),
    "swap.in_bytes": (D, "in_blocks x block_bytes"),
    "swap.out_bytes": (D, "out_blocks x block_bytes"),
    "throughput.wall_s": (M, "seconds the run took (model load excluded)"),
    "throughput.load_s": (M, "seconds to load the model and allocate the cache"),
    "throughput.output_tokens": (M, "tokens generated by finished requests"),
    "throughput.prompt_tokens": (M, "prompt tokens of finished requests"),
    "throughput.prefill_tokens_computed": (M, "tokens run through the model other than one-token decodes: prompt "
                                                   "chunks and recomputation after preemption"),
    "throughput.output_tokens_per_s": (D, "output_tokens / wall_s"),
    "throughput.prompt_tokens_per_s": (D, "prompt_tokens / wall_s"),
    "throughput.total_tokens_per_s": (D, "(prompt_tokens + output_tokens) / wall_s"),
    "latency.exact": (D, "true: every percentile below interpolates the samples themselves; false: one set had "
                         "more than 65,536 samples and its percentiles come from 1%-wide log buckets (within 0.5%)"),
    "latency": (D, "percentiles (linear interpolation) of per-request times measured by the engine: "
                   "ttft = first token - arrival, itl = gaps between a request's decode steps, e2e = finish - arrival"),
}


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _leaves(v, path + ".")
        else:
            yield path


def _pages_committed(engine, block_bytes: int) -> dict:
    pop = engine.worker.populator  # worker/populate.py's CachePopulator, or what a Ray replica reported of it
    return {"blocks": pop.blocks_committed, "bytes": pop.blocks_committed * block_bytes, "seconds": pop.seconds}


def _provenance(report: dict) -> dict[str, str]:
    """One entry per described part of the report (the longest prefix of _PROVENANCE that covers
    each number), not one per number: the map says the same in a fraction of the bytes."""
    out = {}
    for path in _leaves(report):
        if path.startswith("provenance"):
            continue
        prefix = provenance_prefix(path)
        if prefix is None:
            raise KeyError(f"report field {path} has no provenance")  # caught by the tests
        out[prefix] = f"{_PROVENANCE[prefix][0]}: {_PROVENANCE[prefix][1]}"
    return out


def provenance_prefix(path: str) -> str | None:
    """The _PROVENANCE key that describes a dotted report path (the longest prefix), or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in _PROVENANCE:
            return ".".join(parts[:i])
    return None


def add_run_metadata(report: dict, run: dict) -> dict:
    """The run's identity (report["run"]: model, version, device, recipe, timestamps), added once the
    job knows it, with the provenance map brought up to date."""
    report["run"] = run
    if report.get("mode") == "ray":  # cli/ray/merge.py's report: its provenance map is its own
        report["provenance"]["run"] = "measured: " + _PROVENANCE["run"][1] + " (the driver's machine; each "\
                                      "replica's device is in its entry)"
    else:
        report["provenance"] = _provenance(report)
    return report


def write_report(report: dict, output: Path) -> Path:
    """OUT.report.json (file_safety.report_path), through a temporary file and a rename; refused (one line) if a
    file pagedrun did not write has appeared there since the run started (io/file_safety.py)."""
    path = report_path(output)
    check_derived(path, "report", output, (), is_report)
    try:
        replace_file(path, json.dumps(report, indent=1).encode())
    except OSError as e:
        raise PagedrunError(f"{path}: cannot write: {e.strerror or e}") from None
    return path


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "-"


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _ms(d: dict) -> str:
    if d.get("p50") is None:
        return "-"
    return " / ".join(f"{d[k] * 1e3:.1f}" for k in ("p50", "p90", "p99")) + " ms"


def summary_rows(report: dict) -> list[tuple[str, str]]:
    """The report as (label, value) rows for the terminal summary."""
    cap, b, u, f = report["kv_capacity"], report["blocks_in_use"], report["utilisation"], report["fragmentation"]
    c, cm = report["contiguous"]["request_max"], report["contiguous"]["max_model_len"]
    pc, pre, sw, th, lat = (report["prefix_cache"], report["preemptions"], report["swap"], report["throughput"],
                            report["latency"])
    kvp = report.get("kv_pages_committed") or {}
    rows = [
        *([("cpu kernels", report["cpu_kernels"])] if report.get("cpu_kernels") else []),
        ("KV capacity", f"{cap['blocks']:,} blocks x {cap['block_size']} = {cap['tokens']:,} tokens ({_mib(cap['bytes'])})"),
        *([("KV dtype", f"{cap['kv_cache_dtype']}, {cap['bytes_per_token']:,} B per token")]
          if cap.get("kv_cache_dtype") else []),
        *([("KV pages committed", f"{kvp['blocks']:,} blocks ({_mib(kvp['bytes'])}) in {kvp['seconds']:.2f} s")]
          if kvp.get("blocks") else []),
        ("KV blocks in use", f"peak {b['peak']:,} ({_pct(b['peak_fraction_of_capacity'])} of capacity), "
                             f"mean {b['mean']:,.1f}"),
        ("KV utilisation", f"{_pct(u['tokens_stored_over_slots_allocated'])} of allocated slots hold KV "
                           f"({_pct(u['at_peak'])} at peak)"),
        ("fragmentation", f"last-block waste {f['last_block_waste_tokens_mean']:,.1f} tokens mean "
                          f"({f['last_block_waste_percent']:.1f}%)" if f["last_block_waste_percent"] is not None
                          else "-"),
        ("contiguous would reserve",
         f"peak {c['peak_tokens']:,} tokens ({_mib(c['peak_bytes'])}, utilisation {_pct(c['utilisation'])}) "
         f"at prompt+max_tokens; {cm['peak_tokens']:,} tokens ({_mib(cm['peak_bytes'])}, "
         f"{_pct(cm['utilisation'])}) at max_model_len={report['contiguous']['max_model_len_tokens']}; "
         # In bytes as well: with KV cache groups a paged block holds fewer layers than a token of
         # the contiguous cache, so tokens alone would not compare.
         f"paged peak {b['peak'] * cap['block_size']:,} "
         f"{'block slots' if report.get('hybrid_kv') else 'tokens'} "
         f"({_mib(b['peak'] * cap['bytes'] / cap['blocks'] if cap['blocks'] else 0)})"),
        *([("hybrid KV", f"{len(report['hybrid_kv']['groups'])} groups; the window freed "
                         f"{report['hybrid_kv']['tokens_freed_by_window']:,} tokens' blocks; peak "
                         f"{report['hybrid_kv']['peak_blocks_in_use']:,} blocks (by group "
                         f"{', '.join(map(str, report['hybrid_kv']['peak_blocks_per_group']))}), "
                         f"{report['hybrid_kv']['peak_blocks_every_block_kept']:,} with every block kept; "
                         f"max concurrency {report['hybrid_kv']['max_concurrency']:.2f}x "
                         f"({report['hybrid_kv']['max_concurrency_every_block_kept']:.2f}x)")]
          if report.get("hybrid_kv") else []),
        ("prefix cache", f"{pc['hit_tokens']:,} of {pc['query_tokens']:,} prompt tokens hit "
                         f"({_pct(pc['hit_rate'])}); {pc['cow_copies']} copy-on-write copies"),
        ("preemptions", f"{pre['recompute']} recompute, {pre['swap']} swap"
                        + (f" ({pre['swap_fallbacks']} swap fell back to recompute)" if pre["swap_fallbacks"] else "")),
        ("swap traffic", f"{sw['out_blocks']} blocks out ({_mib(sw['out_bytes'])}), "
                         f"{sw['in_blocks']} in ({_mib(sw['in_bytes'])})"),
        ("prompt / output tok/s", f"{th['prompt_tokens_per_s'] or 0:,.1f} / {th['output_tokens_per_s'] or 0:,.1f}"),
        ("TTFT p50/p90/p99", _ms(lat["ttft_s"])),
        ("ITL p50/p90/p99", _ms(lat["itl_s"])),
    ]
    return rows
