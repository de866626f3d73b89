"""`pagedrun generate --ray`: data-parallel batch inference on a Ray cluster, with Ray Data.

pagedrun does not schedule work across machines itself. The driver (the CLI process) does what a
local run does up to the model: check the recipe, open the output (resume), parse and check every
request with the same read_requests (so errors are word for word those of a local run; only the
tokenizer and config.json are loaded here, no weights). The validated requests not yet in the output
become the rows of a Ray Dataset, and `map_batches` runs them over a fixed pool of actors, each
holding one pagedrun engine (one GPU each when the cluster has GPUs, `model.threads` CPUs otherwise).
Finished requests stream back to the driver, which writes them with the same OutputWriter (so an
interrupted job resumes as a local one does), rewrites the file in input order at the end, and
merges the replicas' measurements into one report.

Failures:
  - a replica process that dies (OOM, node lost, killed) is restarted by Ray (max_restarts=-1) and
    the batch it held is retried on a live replica (max_task_retries); a batch that never returned
    wrote nothing, and the driver writes at most one record per request, so each request is
    answered exactly once;
  - a request whose run raises (a bug, an input the engine cannot handle) is isolated inside the
    replica: the batch is re-run one request at a time on a fresh engine and the one that fails
    again becomes an error record; the job goes on;
  - a batch that still kills its replica after every retry is dropped by Ray Data
    (max_errored_blocks) and its requests are re-run one per task; one that kills a replica again
    becomes an error record.

Per-replica measurements: every batch returns the StepRecords its engine recorded since the last
batch and the replica's MemoryPlan; the driver rebuilds each replica's report with report.build_report
(the same function as a local run) and sums the counters into a total.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import pickle
import time
import uuid
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from pagedrun.errors import PagedrunError

INSTALL_HINT = "pip install 'pagedrun[ray]'"
# Retries of a batch whose replica died: enough for a node or two going away, few enough that a
# request that kills its process every time costs minutes, not forever.
MAX_TASK_RETRIES = 3
# Test hook: a file holding an integer N; the first replica to start its (N+1)-th batch while the
# file exists removes it and kills its own process mid-batch (os._exit), as an OOM kill would.
FAULT_FILE_ENV = "PAGEDRUN_RAY_CRASH_FILE"
# Test hook: a request id whose run raises inside the replica, every time.
POISON_ID_ENV = "PAGEDRUN_RAY_POISON_ID"


def import_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (the [data] extra: pandas, pyarrow)
    except ImportError:
        raise PagedrunError(f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


# ---------------------------------------------------------------- the replica (one per actor)

class EngineReplica:
    """A Ray Data map_batches callable class: one pagedrun engine per actor, reused across batches.

    Input batch columns: index, id, prompt_token_ids, sampling (JSON). Output columns: index, replica,
    output (a pickled RequestOutput) and stats (pickled measurements, in the batch's first row only).
    """

    def __init__(self, recipe) -> None:
        self.replica_id = uuid.uuid4().hex[:8]  # a restarted actor is a new replica: a fresh engine
        self.recipe = recipe
        self.batches = 0
        self.init_error: str | None = None
        self.pending_steps: list = []  # StepRecords not yet sent to the driver
        self.llm = None
        t0 = time.perf_counter()
        try:
            self._new_engine()
        except PagedrunError as e:
            # Raised later, from a batch: an actor that fails in __init__ is recreated again and again.
            self.init_error = str(e)
        self.load_s = time.perf_counter() - t0

    def _new_engine(self) -> None:
        from pagedrun.engine.llm import LLM

        if self.llm is not None:  # keep what the old engine measured
            self.pending_steps += self.llm.engine.steps[self._sent:]
        self.llm = LLM(self.recipe)
        self._sent = 0

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from pagedrun.sampling_params import SamplingParams

        index = [int(i) for i in batch["index"]]
        if self.init_error is not None:
            # Returned, not raised: Ray Data would count a raised error as a failed batch and go on.
            fatal = pickle.dumps({"fatal": self.init_error})
            return {"index": np.array(index, dtype=np.int64),
                    "replica": np.array([self.replica_id] * len(index), dtype=object),
                    "output": np.array([b""] * len(index), dtype=object),
                    "stats": np.array([fatal] + [b""] * (len(index) - 1), dtype=object)}
        self.batches += 1
        t0 = time.perf_counter()
        requests = [
            _Req(str(rid), [int(t) for t in ids], SamplingParams(**json.loads(s)))
            for rid, ids, s in zip(batch["id"], batch["prompt_token_ids"], batch["sampling"])
        ]
        _maybe_crash(self.batches)
        try:
            outs = self._run(requests)
        except Exception:
            # Which request failed is unknown and the engine's state is suspect: rebuild it (once)
            # and run the batch one request at a time, so only a request that fails on its own
            # becomes an error record.
            self._new_engine()
            outs = []
            for r in requests:
                try:
                    outs += self._run([r])
                except Exception as e:
                    outs.append(_error_output(r, f"failed in replica {self.replica_id}: {type(e).__name__}: "
                                                 + " ".join(str(e).split())))
                    self._recover()
        busy_s = time.perf_counter() - t0
        engine = self.llm.engine
        steps = self.pending_steps + engine.steps[self._sent:]
        self.pending_steps, self._sent = [], len(engine.steps)
        stats = {"replica": self.replica_id, "node": _node(), "pid": os.getpid(), "device": str(engine.device),
                 "memory": engine.memory, "max_model_len": engine.max_model_len, "load_s": self.load_s,
                 "busy_s": busy_s, "steps": steps}
        by_id = {o.request_id: o for o in outs}
        return {
            "index": np.array(index, dtype=np.int64),
            "replica": np.array([self.replica_id] * len(requests), dtype=object),
            "output": np.array([pickle.dumps(by_id[r.id]) for r in requests], dtype=object),
            "stats": np.array([pickle.dumps(stats)] + [b""] * (len(requests) - 1), dtype=object),
        }

    def _recover(self) -> None:
        """After a request failed alone: drop it; rebuild the engine only if blocks leaked."""
        engine = self.llm.engine
        try:
            engine.scheduler.abort_all()
            clean = engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks
        except Exception:
            clean = False
        if not clean:
            self._new_engine()

    def _run(self, requests: list[_Req]) -> list:
        poison = os.environ.get(POISON_ID_ENV)
        if poison is not None and any(r.id == poison for r in requests):
            raise RuntimeError(f"injected failure for request {poison} ({POISON_ID_ENV})")
        return self.llm.run(requests)


@dataclass
class _Req:
    """The fields of io.requests.Request that LLM.run reads."""
    id: str
    prompt_token_ids: list[int]
    sampling: Any


def _error_output(r: _Req, message: str):
    from pagedrun.engine.engine import RequestOutput

    return RequestOutput(r.id, 0, list(r.prompt_token_ids), [], error=message)


def _maybe_crash(batch_number: int) -> None:
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    try:
        after = int(Path(path).read_text().strip() or 0)
        if batch_number <= after:
            return
        os.unlink(path)  # only one replica wins the unlink
    except (OSError, ValueError):
        return
    os._exit(17)


def _node() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:
        return os.uname().nodename


# ---------------------------------------------------------------- the driver

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
    steps: list = field(default_factory=list)
    results: list = field(default_factory=list)

    def add(self, stats: dict) -> None:
        self.memory = stats["memory"]
        self.max_model_len = stats["max_model_len"]
        self.load_s = stats["load_s"]
        self.busy_s += stats["busy_s"]
        self.batches += 1
        self.steps += stats["steps"]


@dataclass
class _EngineView:
    """What report.build_report reads of an engine, rebuilt on the driver from a replica's batches."""
    steps: list
    memory: Any
    max_model_len: int


def connect(address: str | None, quiet: bool) -> bool:
    """Join (or, with no address and no cluster, start) a Ray cluster; True if we started Ray here."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    quiet_ray_logs()
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=not quiet,
                 configure_logging=True, include_dashboard=False)
    except ConnectionError as e:
        where = address or os.environ.get("RAY_ADDRESS") or "auto"
        raise PagedrunError(f"--ray-address {where}: cannot connect to a Ray cluster: "
                            + " ".join(str(e).split())) from None
    return True


class _DropNotices(logging.Filter):
    """Ray's notices that do not apply here: we disable Ray Data's progress bars on purpose (ours is
    on screen), and a cluster we start ourselves is local to this process."""

    NOTICES = ("Progress bars disabled", "Token authentication is enabled for this Ray cluster")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in str(record.msg) for n in self.NOTICES)


def quiet_ray_logs() -> None:
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not its INFO lines per dataset
    for name in ("ray.data._internal.progress", "ray._private.authentication.authentication_token_setup"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in log.filters):
            log.addFilter(_DropNotices())


def actor_resources(recipe, replicas: int | None, cluster: dict) -> tuple[int, dict, Any]:
    """(replicas, per-actor resources, the recipe each actor loads)."""
    gpus = int(cluster.get("GPU", 0))
    cpus = int(cluster.get("CPU", 0))
    if recipe.model.device == "cuda" and gpus == 0:
        raise PagedrunError("model.device: cuda was asked for but the Ray cluster has no GPU; use auto or cpu")
    if gpus and recipe.model.device != "cpu":
        # One engine per GPU: pagedrun has no tensor parallelism, and two engines on one GPU would
        # each size their KV cache from the same free memory.
        need, per = replicas or gpus, {"num_gpus": 1}
        if need > gpus:
            raise PagedrunError(f"--replicas {need}: the Ray cluster has {gpus} GPU(s); one replica needs one GPU")
        return need, per, recipe
    threads = recipe.model.threads or 1
    need = replicas or max(1, cpus // threads)
    if need * threads > cpus:
        raise PagedrunError(f"--replicas {need}: the Ray cluster has {cpus} CPU(s); {need} replicas x "
                            f"model.threads={threads} need {need * threads}")
    # A CPU replica gets exactly the threads Ray reserved for it: torch's default (every core of the
    # node) in each of several actors would oversubscribe the machine.
    return need, {"num_cpus": threads}, replace(recipe, model=replace(recipe.model, threads=threads))


def request_checker(recipe):
    """The tokenizer and limits read_requests needs, without loading weights (the driver may have
    no GPU; the engines live in the actors)."""
    from pagedrun.engine.engine import resolve_model_dir
    from pagedrun.models.loader import load_tokenizer, read_config

    model_dir = resolve_model_dir(recipe.model.path)
    cfg = read_config(model_dir, recipe.model.max_model_len)
    max_model_len = recipe.model.max_model_len or min(cfg.max_position_embeddings, 8192)
    if max_model_len > cfg.max_position_embeddings:  # the same check (and words) as LLMEngine
        raise PagedrunError(
            f"model.max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    return load_tokenizer(model_dir), cfg, max_model_len


def pick_batch_size(num_requests: int, replicas: int, max_num_seqs: int) -> int:
    # Several batches per replica so work spreads evenly and outputs stream back; at most a few
    # engine-fulls per batch, because an engine drains (runs below max_num_seqs) at a batch's end.
    return max(1, min(4 * max_num_seqs, math.ceil(num_requests / (4 * replicas))))


def run_distributed(*, recipe, prompts: Path, writer, output: Path, skip_invalid: bool, plot: Path | None,
                    quiet: bool, console: Console, stop, address: str | None, replicas: int | None) -> int:
    from pagedrun.io.requests import read_requests

    ray = import_ray()  # before anything slow: without Ray, one line and exit
    address = address if address is not None else recipe.distributed.address
    replicas = replicas if replicas is not None else recipe.distributed.replicas
    if replicas is not None and replicas < 1:
        raise PagedrunError(f"--replicas {replicas}: must be an integer >= 1")
    t_load = time.perf_counter()
    with console.status("reading requests…", spinner="dots"):
        tokenizer, cfg, max_model_len = request_checker(recipe)
        requests, invalid = read_requests(prompts, tokenizer, recipe.sampling, vocab_size=cfg.vocab_size,
                                          max_model_len=max_model_len, skip_invalid=skip_invalid)
    pending, order = _open(writer, requests, invalid, output=output, quiet=quiet, console=console)
    if not pending:  # a finished job: no cluster is started or joined
        writer.finalize(order)
        if not quiet:
            console.print(f"nothing to do: all {len(order)} requests are in {output}", highlight=False,
                          soft_wrap=True, markup=False)
        return 0
    started = connect(address, quiet)
    try:
        n, resources, actor_recipe = actor_resources(recipe, replicas, ray.cluster_resources())
        if plot is not None and not quiet:
            console.print("--plot: not drawn with --ray (one plot per replica's cache would be needed); "
                          "the report has each replica's numbers", style="yellow", highlight=False, markup=False)
        return _run(ray, pending, order, invalid, writer, recipe=recipe, actor_recipe=actor_recipe, replicas=n,
                    resources=resources, driver_s=time.perf_counter() - t_load, output=output, quiet=quiet,
                    console=console, stop=stop)
    finally:
        if started:
            ray.shutdown()


def _open(writer, requests, invalid, *, output: Path, quiet: bool, console: Console):
    """The same bookkeeping as a local run (generate._run_and_write): error records keyed by line,
    requests by id; what the output already holds is not sent to the cluster again.
    Returns (requests to run, every key in input order)."""
    from pagedrun.engine.llm import invalid_record
    from pagedrun.io.outputs import invalid_key, request_key

    writer.open()
    if writer.discarded and not quiet:
        console.print(f"{output}: dropped {writer.discarded} incomplete line(s) left by an interrupted run; "
                      "their requests will be redone", highlight=False, soft_wrap=True, markup=False)
    for bad in invalid:
        if invalid_key(bad.line) not in writer:
            rec = invalid_record(bad)
            writer.write({"id": rec["id"], "line": bad.line, **rec}, invalid_key(bad.line))
    pending = [r for r in requests if request_key(r.id) not in writer]
    order = [k for _, k in sorted([(r.line, request_key(r.id)) for r in requests]
                                  + [(b.line, invalid_key(b.line)) for b in invalid])]
    if writer.resumed and not quiet:
        console.print(f"resuming {output}: {writer.resumed} requests already done, {len(pending)} to go",
                      highlight=False, soft_wrap=True, markup=False)
    return pending, order


def _run(ray, pending, order, invalid, writer, *, recipe, actor_recipe, replicas: int, resources: dict,
         driver_s: float, output: Path, quiet: bool, console: Console, stop) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from pagedrun.engine.llm import output_record
    from pagedrun.generate import print_summary
    from pagedrun.io.outputs import request_key

    if not quiet:
        console.print(f"[bold]ray[/] {len(pending)} requests over {replicas} replica(s), "
                      f"{'1 GPU' if 'num_gpus' in resources else str(resources['num_cpus']) + ' CPU'} each",
                      highlight=False)

    index_of = {r.id: i for i, r in enumerate(pending)}
    replica_records: dict[str, ReplicaRecord] = {}
    results = []
    total = sum(r.sampling.n for r in pending)
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=quiet, transient=False,
    )
    counters = {"out_tokens": 0}
    t0 = time.perf_counter()

    def consume(batch: dict) -> None:
        for rid, stats in zip(batch["replica"], batch["stats"]):
            if stats:
                s = pickle.loads(stats)
                if "fatal" in s:  # the replica could not build its engine: the words of a local run
                    raise PagedrunError(s["fatal"])
                if rid not in replica_records:
                    replica_records[rid] = ReplicaRecord(rid, s["node"], s["pid"], s["device"])
                replica_records[rid].add(s)
        for rid, blob in zip(batch["replica"], batch["output"]):
            o = pickle.loads(blob)
            if request_key(o.request_id) in writer:
                continue  # a retried batch whose first attempt did return: answered once only
            o.index = index_of[o.request_id]
            writer.write(output_record(o))
            results.append(o)
            replica_records[rid].results.append(o)
            counters["out_tokens"] += sum(len(c.token_ids) for c in o.outputs)
            progress.update(task, advance=max(1, len(o.outputs)),
                            tps=counters["out_tokens"] / max(time.perf_counter() - t0, 1e-9))

    with progress:
        task = progress.add_task("generate", total=total, tps=0.0)
        _pass(ray, pending, actor_recipe, replicas, resources,
              pick_batch_size(len(pending), replicas, recipe.scheduler.max_num_seqs), consume, stop)
        lost = [r for r in pending if request_key(r.id) not in writer]
        if lost and not stop():
            # Batches that killed their replica on every retry: again one request per task, so that
            # only a request that kills a replica on its own is given up on.
            _pass(ray, lost, actor_recipe, replicas, resources, 1, consume, stop)
            for r in lost:
                if request_key(r.id) not in writer and not stop():
                    o = _error_output(r, "no replica returned it: its batch failed on every attempt, twice "
                                         "(a replica process that keeps dying, e.g. out of memory; see the Ray logs)")
                    o.index = index_of[r.id]
                    writer.write(output_record(o))
                    results.append(o)
    wall = time.perf_counter() - t0
    results.sort(key=lambda o: o.index)
    interrupted = stop.stop and any(k not in writer for k in order)
    if interrupted:
        writer.close()
    else:
        writer.finalize(order)

    report = None
    if recipe.output.report:
        from pagedrun.report import write_report

        report = merged_report(list(replica_records.values()), results, wall_s=wall, driver_s=driver_s,
                               interrupted=interrupted)
        report_file = write_report(report, output)
    if not quiet:
        print_summary(console, results, wall, output, None, invalid)
        if report is not None:
            print_replicas(console, report)
            console.print(f"report: {report_file}", highlight=False)
    if interrupted:
        console.print(f"stopped by {stop.signal_name}: {len(writer.done)} of {len(order)} requests are in {output}; "
                      "run the same command again (without --overwrite) to resume", style="yellow",
                      highlight=False, soft_wrap=True, markup=False)
        return stop.exit_code
    return 0


def _pass(ray, requests, actor_recipe, replicas: int, resources: dict, batch_size: int, consume, stop) -> None:
    """One Ray Data pass of `requests` over a pool of `replicas` engine actors."""
    from ray.data import ActorPoolStrategy, DataContext

    rows = [{"index": i, "id": r.id, "prompt_token_ids": list(r.prompt_token_ids),
             "sampling": json.dumps(r.sampling.to_dict())} for i, r in enumerate(requests)]
    quiet_ray_logs()  # Ray Data configures its loggers when first imported: after connect()
    ctx = DataContext.get_current()
    names = ("enable_progress_bars", "max_errored_blocks", "print_on_execution_start", "wait_for_min_actors_s")
    saved = {k: getattr(ctx, k) for k in names}
    # One batch in flight per replica (above): a replica takes the next batch when it is done with
    # one, so a slower replica does not sit on a queue of batches while the others idle at the end.
    # Ours is the progress bar; a batch that exhausted its retries is dropped, not fatal (see _run);
    # no batch is handed out before every replica has loaded its model, or the first one up would
    # queue the first batches of all (a generous limit: a large model loads from network storage).
    for k, v in zip(names, (False, -1, False, 3600)):
        setattr(ctx, k, v)
    try:
        ds = ray.data.from_items(rows, override_num_blocks=max(1, math.ceil(len(rows) / batch_size)))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            ds = ds.map_batches(
                EngineReplica, fn_constructor_kwargs={"recipe": actor_recipe}, batch_size=batch_size,
                batch_format="numpy", compute=ActorPoolStrategy(size=min(replicas, len(rows)), max_tasks_in_flight_per_actor=1),
                **resources, **_retry_args(ds.map_batches),
            )
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
            consume(batch)
            if stop():
                break
    finally:
        for k, v in saved.items():
            setattr(ctx, k, v)


def _retry_args(map_batches) -> dict:
    """Bound the retries of a batch whose replica died (Ray Data's default is to retry forever,
    which a request that kills its process every time turns into a hang). Actor restarts stay
    unbounded (Ray Data's default): a replica lost with its node must come back. Passed as a Ray
    remote argument, which Ray Data deprecates; where it is gone, its default applies."""
    params = inspect.signature(map_batches).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {}
    return {"max_restarts": -1, "max_task_retries": MAX_TASK_RETRIES}


# ---------------------------------------------------------------- the merged report

_SUMMED = (("num_requests",), ("num_errors",), ("num_steps",), ("throughput", "output_tokens"),
           ("throughput", "prompt_tokens"), ("throughput", "prefill_tokens_computed"),
           ("prefix_cache", "query_tokens"), ("prefix_cache", "hit_tokens"), ("prefix_cache", "cow_copies"),
           ("preemptions", "recompute"), ("preemptions", "swap"), ("preemptions", "swap_fallbacks"),
           ("swap", "in_blocks"), ("swap", "out_blocks"), ("kv_capacity", "blocks"), ("kv_capacity", "tokens"),
           ("kv_capacity", "bytes"), ("blocks_in_use", "peak"))


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        d = d[k]
    return d


def merged_report(records: list[ReplicaRecord], results: list, *, wall_s: float, driver_s: float,
                  interrupted: bool) -> dict:
    """Each replica's report (report.build_report on what it measured) and their total.

    A replica's wall_s is the time it spent inside batches; the total's is the driver's, from the
    first request sent to the last output received, so its tokens/s is the job's throughput.
    """
    from pagedrun.report import build_report, percentiles

    replicas = []
    for rec in records:
        view = _EngineView(rec.steps, rec.memory, rec.max_model_len)
        rep = build_report(view, sorted(rec.results, key=lambda o: o.index), wall_s=rec.busy_s, load_s=rec.load_s,
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
    extra = len(results) - total["num_requests"]
    total["num_requests"] += extra
    total["num_errors"] += extra
    th = total["throughput"]
    th.update(wall_s=wall_s, driver_setup_s=driver_s,
              load_s_max=max((r["report"]["throughput"]["load_s"] for r in replicas), default=0.0),
              output_tokens_per_s=th["output_tokens"] / wall_s if wall_s else None,
              total_tokens_per_s=(th["output_tokens"] + th["prompt_tokens"]) / wall_s if wall_s else None)
    pc = total["prefix_cache"]
    pc["hit_rate"] = pc["hit_tokens"] / pc["query_tokens"] if pc["query_tokens"] else None
    ok = [r for r in results if r.error is None]
    total["latency"] = {
        "ttft_s": percentiles([r.metrics["ttft_s"] for r in ok if r.metrics.get("ttft_s") is not None]),
        "itl_s": percentiles([x for r in ok for x in r.metrics.get("itl_s", [])]),
        "e2e_s": percentiles([r.metrics["e2e_s"] for r in ok if r.metrics.get("e2e_s") is not None]),
    }
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


def print_replicas(console: Console, report: dict) -> None:
    from rich.table import Table

    devices = sorted({r["device"] for r in report["replicas"]})
    t = Table(title=f"{report['num_replicas']} replica(s) on {', '.join(devices) or '-'}", box=None, pad_edge=False)
    # Narrow enough for 80 columns; the report has every number in full.
    for col in ("replica", "node", "batch", "reqs", "prompt", "output", "wall s", "peak blk", "pre", "hit%"):
        t.add_column(col, justify="right" if col not in ("replica", "node") else "left", no_wrap=True)

    def row(name, node, batches, r):
        th, pc = r["throughput"], r["prefix_cache"]
        peak = r["blocks_in_use"]["peak"]
        cap = r["kv_capacity"]["blocks"]
        return (name, node, str(batches), str(r["num_requests"]), f"{th['prompt_tokens']:,}",
                f"{th['output_tokens']:,}", f"{th['wall_s']:.2f}", f"{peak:,}/{cap:,}",
                str(r["preemptions"]["recompute"] + r["preemptions"]["swap"]),
                f"{pc['hit_rate']:.0%}" if pc["hit_rate"] is not None else "-")

    for rep in report["replicas"]:
        t.add_row(*row(rep["replica"], rep["node"][:8], rep["batches"], rep["report"]))
    tot = report["total"]
    t.add_row(*row("total", "", sum(r["batches"] for r in report["replicas"]), tot))
    console.print(t)
