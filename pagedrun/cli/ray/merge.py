"""What the driver gathers from the replicas' batches, and their reports merged into one."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pagedrun.report.metrics import RunTally, StepLog


@dataclass
class ReplicaRecord:
    """What the driver gathered from one replica's batches."""
    replica: str
    node: str
    pid: int
    device: str
    memory: Any = None
    max_model_len: int = 0
    load_s: float = 0.0
    busy_s: float = 0.0
    batches: int = 0
    steps: StepLog = field(default_factory=StepLog)
    results: RunTally = field(default_factory=RunTally)  # of the outputs it returned
    pages_committed: tuple = (0, 0.0)  # the replica's KV blocks committed ahead of use, and seconds

    def add(self, stats: dict) -> None:
        self.memory = stats["memory"]
        self.max_model_len = stats["max_model_len"]
        self.load_s = stats["load_s"]
        self.busy_s += stats["busy_s"]
        self.batches += 1
        self.steps += stats["steps"]
        self.pages_committed = stats.get("pages_committed", self.pages_committed)


@dataclass
class _EngineView:
    """What report.build_report reads of an engine, rebuilt on the driver from a replica's batches."""
    steps: list
    memory: Any
    max_model_len: int
    worker: Any  # .populator.blocks_committed, .seconds: what the replica's populators reported


_SUMMED = (("num_requests",), ("num_errors",), ("num_steps",), ("throughput", "output_tokens"),
           ("throughput", "prompt_tokens"), ("throughput", "prefill_tokens_computed"),
           ("prefix_cache", "query_tokens"), ("prefix_cache", "hit_tokens"), ("prefix_cache", "cow_copies"),
           ("preemptions", "recompute"), ("preemptions", "swap"), ("preemptions", "swap_fallbacks"),
           ("swap", "in_blocks"), ("swap", "out_blocks"), ("kv_capacity", "blocks"), ("kv_capacity", "tokens"),
           ("kv_capacity", "bytes"), ("blocks_in_use", "peak"), ("kv_pages_committed", "blocks"),
           ("kv_pages_committed", "bytes"), ("kv_pages_committed", "seconds"))


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        d = d[k]
    return d


def merged_report(records: list[ReplicaRecord], results: RunTally, *, wall_s: float, driver_s: float,
                  interrupted: bool) -> dict:
    """Each replica's report (report.build_report on what it measured) and their total.

    A replica's wall_s is the time it spent inside batches; the total's is the driver's, from the
    first request sent to the last output received, so its tokens/s is the job's throughput.
    """
    from pagedrun.report.report import build_report, percentiles

    replicas = []
    for rec in records:
        view = _EngineView(rec.steps, rec.memory, rec.max_model_len,
                           SimpleNamespace(populator=SimpleNamespace(blocks_committed=rec.pages_committed[0],
                                                                     seconds=rec.pages_committed[1])))
        rep = build_report(view, rec.results, wall_s=rec.busy_s, load_s=rec.load_s,
                           interrupted=interrupted)
        replicas.append({"replica": rec.replica, "node": rec.node, "pid": rec.pid, "device": rec.device,
                         "batches": rec.batches, "report": rep})
    total: dict[str, Any] = {}
    for path in _SUMMED:
        value = sum(_get(r["report"], path) for r in replicas)
        d = total
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value
    # Records the driver wrote itself (a request given up on after its replica kept dying) are in no
    # replica's report; they count in the total.
    extra = results.num_ok + results.num_errors - total["num_requests"]
    total["num_requests"] += extra
    total["num_errors"] += extra
    th = total["throughput"]
    th.update(wall_s=wall_s, driver_setup_s=driver_s,
              load_s_max=max((r["report"]["throughput"]["load_s"] for r in replicas), default=0.0),
              output_tokens_per_s=th["output_tokens"] / wall_s if wall_s else None,
              total_tokens_per_s=(th["output_tokens"] + th["prompt_tokens"]) / wall_s if wall_s else None)
    pc = total["prefix_cache"]
    pc["hit_rate"] = pc["hit_tokens"] / pc["query_tokens"] if pc["query_tokens"] else None
    total["latency"] = {"ttft_s": percentiles(results.ttft_s), "itl_s": percentiles(results.itl_s),
                        "e2e_s": percentiles(results.e2e_s),
                        "exact": all(xs.is_exact for xs in (results.ttft_s, results.itl_s, results.e2e_s))}
    return {
        "mode": "ray",
        "interrupted": interrupted,
        "num_replicas": len(replicas),
        "total": total,
        "replicas": replicas,
        "provenance": {
            "total": "derived: counters summed over replicas; blocks_in_use.peak and kv_capacity are sums of "
                     "each replica's own peak and capacity (the peaks need not coincide in time); "
                     "throughput.wall_s is the driver's, from the first request sent to the last output received "
                     "(it includes the replicas' start-up: process, imports, model load) and tokens/s divide by it; "
                     "driver_setup_s is reading the requests and joining the cluster; latency percentiles are over every request of every replica",
            "replicas": "one report per engine instance, as a local run writes (see its own provenance); "
                        "a replica restarted by Ray after a crash is a new engine and a new entry; "
                        "throughput.wall_s there is the time the replica spent running batches",
        },
    }
