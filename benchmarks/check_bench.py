"""CI check of a `pagedrun bench --json` file: outputs match and the report is complete (never a speed).

    pagedrun bench --quick --json bench.json && python benchmarks/check_bench.py bench.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ENGINE_KEYS = ("engine", "config", "wall_s", "output_tokens", "prompt_tokens", "output_tokens_per_s",
               "total_tokens_per_s", "peak_rss_bytes", "kv_bytes", "kv_utilisation", "roofline_fraction",
               "executed_roofline_fraction", "ratio_to_pagedrun", "mismatches")
REPORT_SECTIONS = ("kv_capacity", "blocks_in_use", "utilisation", "fragmentation", "contiguous", "prefix_cache",
                   "preemptions", "swap", "throughput", "latency", "provenance")


def check(res: dict) -> list[str]:
    problems = []
    if not res.get("outputs_match") or res.get("mismatches"):
        problems.append(f"outputs differ: {res.get('mismatches')}")
    if not res.get("matmul_flops_per_s", 0) > 0:
        problems.append("no matmul FLOP/s")
    engines = res.get("engines") or []
    if {e.get("engine") for e in engines} != {"pagedrun", "hf-static", "hf-continuous"}:
        problems.append(f"engines run: {[e.get('engine') for e in engines]}")
    for e in engines:
        missing = [k for k in ENGINE_KEYS if e.get(k) is None]
        if missing:
            problems.append(f"{e.get('engine')} ({e.get('config')}): missing {missing}")
        elif not (e["output_tokens"] > 0 and e["output_tokens_per_s"] > 0 and e["roofline_fraction"] > 0):
            problems.append(f"{e['engine']} ({e['config']}): zero throughput")
    rep = res.get("pagedrun_report") or {}
    missing = [s for s in REPORT_SECTIONS if s not in rep]
    if missing:
        problems.append(f"pagedrun report: missing {missing}")
    elif rep["blocks_in_use"]["peak"] <= 0 or rep["utilisation"]["tokens_stored_over_slots_allocated"] is None:
        problems.append("pagedrun report: no blocks recorded")
    return problems


def main(path: str) -> int:
    problems = check(json.loads(Path(path).read_text()))
    for p in problems:
        print(f"bench check: {p}", file=sys.stderr)
    if not problems:
        print(f"bench check: {path} complete, outputs identical")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
