"""Turn `pagedrun bench --json` files into the Markdown tables of docs/results.md.

    python benchmarks/bench_table.py results/standard.json results/shared-prefix.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "?"


def _mib(b) -> str:
    return _rate(b / 2**20) if b is not None else "-"


def _rate(x: float) -> str:
    """One decimal while it is informative, none from 10,000 up (keeps the columns narrow)."""
    return f"{x:,.1f}" if x < 10_000 else f"{x:,.0f}"


def _run(e: dict) -> str:
    return f"{e['engine']} ({e['config']})"


def _samples(res: dict) -> str:
    samples = res.get("matmul_flops_per_s_samples")
    if not samples or len(samples) < 2:
        return ""
    return " (the higher of " + " and ".join(f"{x / 1e9:,.1f}" for x in samples) + ", before and after the engines)"


def table(res: dict) -> str:
    m, w, mach = res["model"], res["workload"], res["machine"]
    lines = [
        f"### {w['name']}{' (quick)' if w['quick'] else ''}: {m['name']}, {m['dtype']}, {mach['threads']} thread(s)",
        "",
        f"{w['requests']} requests, {w['prompt_tokens']:,} prompt tokens, {w['max_output_tokens']:,} output tokens; "
        f"{m['parameters']['total'] / 1e6:.1f}M parameters ({m['parameters']['matmul'] / 1e6:.1f}M in matmuls); "
        f"matmul roof {res['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s{_samples(res)}; "
        f"load average (1/5/15 min) at the start {_load(mach.get('load_average_start'))}, "
        f"at the end {_load(mach.get('load_average_end'))}.",
        "",
        # Two tables, not one of twelve columns, and engine and config in one cell that may wrap:
        # each table is readable at 80 columns, raw or rendered (tests/test_tables.py renders them
        # with rich at that width).
        "| engine (config) | out tok/s | total tok/s | wall s | vs pagedrun | roofline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in res["engines"]:
        r = e["ratio_to_pagedrun"]["output_tokens_per_s"]
        lines.append(
            f"| {_run(e)} | {_rate(e['output_tokens_per_s'])} | {_rate(e['total_tokens_per_s'])} "
            f"| {_rate(e['wall_s'])} | {f'{r:.2f}x' if r is not None else '-'} | {e['roofline_fraction']:.2%} |")
    lines += [
        "",
        "| engine (config) | peak RSS MiB | KV MiB | KV peak MiB | KV util | mismatches |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in res["engines"]:
        u = e.get("kv_utilisation")
        lines.append(
            f"| {_run(e)} | {e['peak_rss_bytes'] / 2**20:,.0f} | {_rate(e['kv_bytes'] / 2**20)} "
            f"| {_mib(e.get('kv_peak_bytes'))} | {f'{u:.1%}' if u is not None else '-'} | {e['mismatches']} |")
    lines += ["", "KV MiB: the KV cache allocated; KV peak MiB: the most of it in use at once."]
    rep = res.get("pagedrun_report")
    if rep:
        c = rep["contiguous"]
        lines += [
            "",
            f"pagedrun's KV report: peak {rep['blocks_in_use']['peak']:,} blocks of {rep['kv_capacity']['blocks']:,}; "
            f"utilisation {rep['utilisation']['tokens_stored_over_slots_allocated']:.1%}; last-block waste "
            f"{rep['fragmentation']['last_block_waste_percent']:.1f}%; prefix-cache hit rate "
            f"{(rep['prefix_cache']['hit_rate'] or 0):.1%}; contiguous reservation at prompt+max_tokens would peak at "
            f"{c['request_max']['peak_tokens']:,} tokens (utilisation {c['request_max']['utilisation']:.1%}), at "
            f"max_model_len at {c['max_model_len']['peak_tokens']:,} tokens "
            f"(utilisation {c['max_model_len']['utilisation']:.1%}).",
        ]
    lines.append("")
    lines.append("Outputs identical across engines." if res["outputs_match"]
                 else f"{len(res['mismatches'])} mismatching requests.")
    return "\n".join(lines) + "\n"


def main(paths: list[str]) -> None:
    for p in paths:
        print(table(json.loads(Path(p).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
