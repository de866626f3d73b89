"""`pagedrun bench`'s comparison as terminal tables that fit 80 columns (pagedrun/console.py): two
stacked tables, throughput then start-up and memory, each row one engine run. Every number is also in the
--json file, unrounded (benchmarks/bench_table.py turns that into Markdown)."""
from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table


def _table(title: str | None, numbers: list[str]) -> Table:
    # Columns two spaces apart (a right pad and the box's blank divider), no edges: 80 columns hold
    # two text columns and five numbers.
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("engine", no_wrap=True)
    # The one column that may wrap, at its spaces: "max 256" over "requests/batch".
    t.add_column("config", min_width=len("requests/batch"))
    for header in numbers:
        t.add_column(header, justify="right", no_wrap=True)
    return t


def bench_tables(result: dict) -> Group:
    m, w = result["model"], result["workload"]
    title = f"pagedrun bench: {w['name']}, {m['name']} ({m['dtype']}, {result['machine']['threads']} threads)"
    speed = _table(title, ["out\ntok/s", "total\ntok/s", "wall\ns", "x\npagedrun", "roof-\nline"])
    # Start-up beside memory: load time (vLLM's includes torch.compile) and load + generate.
    memory = _table(None, ["load\ns", "end to\nend s", "peak\nRSS", "KV\nutil", "mis-\nmatches"])
    for r in result["engines"]:
        ratio = r["ratio_to_pagedrun"]["output_tokens_per_s"]
        u = r.get("kv_utilisation")
        speed.add_row(r["engine"], r["config"], _rate(r["output_tokens_per_s"]), _rate(r["total_tokens_per_s"]),
                      _seconds(r["wall_s"]), f"{ratio:.2f}" if ratio is not None else "-",
                      f"{r['roofline_fraction']:.1%}")
        load = r.get("load_s")
        memory.add_row(r["engine"], r["config"], _seconds(load) if load is not None else "-",
                       _seconds(r["e2e_s"]) if "e2e_s" in r else "-", f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB",
                       f"{u:.1%}" if u is not None else "-", str(r["mismatches"]))
    return Group(speed, "", memory)


def _rate(x: float) -> str:
    """At most 9 characters below 10^9: one decimal while it is informative, none from 10,000 up."""
    return f"{x:,.1f}" if x < 10_000 else f"{x:,.0f}"


def _seconds(x: float) -> str:
    return f"{x:,.2f}" if x < 1000 else f"{x:,.0f}"
