"""The Ray run's per-replica numbers on the terminal: two stacked tables (the work each replica did,
then where it ran and its KV cache), each within 80 columns (pagedrun/console.py). The merged report
(merge.py) has every number in full."""
from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.table import Table


def _table(title: str | None, columns: list[str], *, folds: str | None = None) -> Table:
    # The bench tables' layout (bench/tables.py): no edges, columns two spaces apart. Numbers never
    # wrap; `folds` is the one text column that may (a node's host name), so a long name cannot
    # push a number out.
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("replica", no_wrap=True)
    for header in columns:
        if header == folds:
            t.add_column(header, overflow="fold", min_width=12)
        else:
            t.add_column(header, justify="right", no_wrap=True)
    return t


def replica_tables(report: dict) -> Group:
    """Widest values meant to fit: 10^7 requests, 10^10 prompt and 10^9 output tokens, 10^6 s."""
    devices = sorted({r["device"] for r in report["replicas"]})
    title = f"{report['num_replicas']} replica(s) on {', '.join(devices) or '-'}"
    work = _table(title, ["batches", "requests", "prompt\ntokens", "output\ntokens", "wall s"])
    cache = _table(None, ["node", "KV blocks peak\n/ capacity", "preempt-\nions", "prefix\nhits"], folds="node")

    def add(name: str, node: str, batches: int, r: dict) -> None:
        th, pc = r["throughput"], r["prefix_cache"]
        work.add_row(name, f"{batches:,}", f"{r['num_requests']:,}", f"{th['prompt_tokens']:,}",
                     f"{th['output_tokens']:,}", _seconds(th["wall_s"]))
        cache.add_row(name, node, f"{r['blocks_in_use']['peak']:,}/{r['kv_capacity']['blocks']:,}",
                      f"{r['preemptions']['recompute'] + r['preemptions']['swap']:,}",
                      f"{pc['hit_rate']:.0%}" if pc["hit_rate"] is not None else "-")

    for rep in report["replicas"]:
        add(rep["replica"], rep["node"], rep["batches"], rep["report"])
    # The total's KV blocks are sums of each replica's own peak and capacity (merge.py's provenance).
    add("total", "", sum(r["batches"] for r in report["replicas"]), report["total"])
    return Group(work, "", cache)


def print_replicas(console: Console, report: dict) -> None:
    console.print(replica_tables(report))


def _seconds(x: float) -> str:
    return f"{x:,.2f}" if x < 1000 else f"{x:,.0f}"
