"""The driver of `pagedrun generate --ray` (the CLI process): the requests, the Ray Data passes over
the actor pool, and the output written as a local run writes it."""
from __future__ import annotations

import inspect
import json
import math
import pickle
import time
import warnings
from pathlib import Path

from rich.console import Console

from pagedrun.cli.ray.cluster import actor_resources, connect, import_ray, quiet_ray_logs
from pagedrun.cli.ray.merge import ReplicaRecord, merged_report
from pagedrun.cli.ray.replica import EngineReplica, error_output
from pagedrun.cli.ray.replica_table import print_replicas
from pagedrun.errors import PagedrunError
from pagedrun.report.metrics import RunTally

# Retries of a batch whose replica died: enough for a node or two going away, few enough that a
# request that kills its process every time costs minutes, not forever.
MAX_TASK_RETRIES = 3


def pick_batch_size(num_requests: int, replicas: int, max_num_seqs: int) -> int:
    # Several batches per replica so work spreads evenly and outputs stream back; at most a few
    # engine-fulls per batch, because an engine drains (runs below max_num_seqs) at a batch's end.
    return max(1, min(4 * max_num_seqs, math.ceil(num_requests / (4 * replicas))))


class RayRun:
    """The Ray executor of a job (cli/job.py): the checked requests go to a pool of engine actors
    through Ray Data; their outputs come back to be written here, as a local run writes them."""
    skips_empty_runs = True  # a job with nothing left to run starts or joins no cluster
    plots = False

    def __init__(self, recipe, *, address: str | None, replicas: int | None) -> None:
        self.ray = import_ray()  # before anything slow: without Ray, one line and exit
        self.recipe = recipe
        self.address = address if address is not None else recipe.distributed.address
        self.replicas = replicas if replicas is not None else recipe.distributed.replicas
        if self.replicas is not None and self.replicas < 1:
            raise PagedrunError(f"--replicas {self.replicas}: must be an integer >= 1")
        self.t_created = time.perf_counter()
        self.started = False
        self.records: dict[str, ReplicaRecord] = {}
        # Counted, not kept, as a local run's (memory does not grow with the outputs): the job's tally,
        # each replica's in its record, and the ids that came back.
        self.results = RunTally()
        self.returned: set[str] = set()

    def start(self, console: Console, quiet: bool, *, num_requests: int, plot: Path | None) -> None:
        self.started = connect(self.address, quiet)
        self.n, self.resources, self.actor_recipe = actor_resources(self.recipe, self.replicas,
                                                                    self.ray.cluster_resources())
        if plot is not None and not quiet:
            console.print("--plot: not drawn with --ray (one plot per replica's cache would be needed); "
                          "the report has each replica's numbers", style="yellow", highlight=False, markup=False)
        if not quiet:
            console.print(f"[bold]ray[/] {num_requests} requests over {self.n} replica(s), "
                          f"{'1 GPU' if 'num_gpus' in self.resources else str(self.resources['num_cpus']) + ' CPU'}"
                          " each", highlight=False)
        self.driver_s = time.perf_counter() - self.t_created

    def run(self, requests, on_output, on_tokens, stop) -> None:
        # Ray Data takes its rows as a list: the driver tokenizes every pending request up front
        # (an actor pool that outlives one pass would be needed to stream them).
        pending = list(requests)
        if not pending:
            return

        def consume(batch: dict) -> None:
            for rid, stats in zip(batch["replica"], batch["stats"]):
                if stats:
                    s = pickle.loads(stats)
                    if "fatal" in s:  # the replica could not build its engine: the words of a local run
                        raise PagedrunError(s["fatal"])
                    if rid not in self.records:
                        self.records[rid] = ReplicaRecord(rid, s["node"], s["pid"], s["device"])
                    self.records[rid].add(s)
            for rid, blob in zip(batch["replica"], batch["output"]):
                o = pickle.loads(blob)
                if on_output(o):
                    self._count(o, self.records[rid])
                    on_tokens(sum(len(c.token_ids) for c in o.outputs))

        _pass(self.ray, pending, self.actor_recipe, self.n, self.resources,
              pick_batch_size(len(pending), self.n, self.recipe.scheduler.max_num_seqs), consume, stop)
        lost = [r for r in pending if r.id not in self.returned]
        if lost and not stop():
            # Batches that killed their replica on every retry: again one request per task, so that
            # only a request that kills a replica on its own is given up on.
            _pass(self.ray, lost, self.actor_recipe, self.n, self.resources, 1, consume, stop)
            for r in lost:
                if r.id not in self.returned and not stop():
                    o = error_output(r, "no replica returned it: its batch failed on every attempt, twice "
                                        "(a replica process that keeps dying, e.g. out of memory; see the Ray logs)")
                    if on_output(o):
                        self._count(o, None)

    def _count(self, o, record: ReplicaRecord | None) -> None:
        self.returned.add(o.request_id)
        self.results.add(o)
        if record is not None:
            record.results.add(o)

    def report(self, wall_s: float, interrupted: bool) -> dict:
        return merged_report(list(self.records.values()), self.results, wall_s=wall_s, driver_s=self.driver_s,
                             interrupted=interrupted)

    def machine(self) -> dict:
        """The driver's machine; each replica's device is in its own entry of the report."""
        from pagedrun.report.machine import machine_info

        return {**machine_info("ray driver", 0), "replicas": self.n}

    def summary(self, console: Console, report: dict | None) -> None:
        if report is not None:
            print_replicas(console, report)
        return None

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


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
