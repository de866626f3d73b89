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

from pagedrun.cli.job import job_exit_code, open_output, print_summary
from pagedrun.cli.ray.cluster import actor_resources, connect, import_ray, quiet_ray_logs
from pagedrun.cli.ray.merge import ReplicaRecord, merged_report
from pagedrun.cli.ray.replica import EngineReplica, error_output
from pagedrun.cli.ray.replica_table import print_replicas
from pagedrun.errors import PagedrunError

# Retries of a batch whose replica died: enough for a node or two going away, few enough that a
# request that kills its process every time costs minutes, not forever.
MAX_TASK_RETRIES = 3


def request_checker(recipe):
    """The tokenizer and limits read_requests needs, without loading weights (the driver may have
    no GPU; the engines live in the actors)."""
    from pagedrun.models.config import resolve_max_model_len
    from pagedrun.models.loader import load_tokenizer, read_config, resolve_model_dir

    model_dir = resolve_model_dir(recipe.model.path)
    cfg = read_config(model_dir, recipe.model.max_model_len)
    return load_tokenizer(model_dir), cfg, resolve_max_model_len(recipe.model.max_model_len, cfg)


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
    pending, order = open_output(writer, requests, invalid, output=output, quiet=quiet, console=console)
    if not pending:  # a finished job: no cluster is started or joined
        writer.finalize(order)
        if not quiet:
            console.print(f"nothing to do: all {len(order)} requests are in {output}", highlight=False,
                          soft_wrap=True, markup=False)
        return job_exit_code(writer, order, output, console)
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


def _run(ray, pending, order, invalid, writer, *, recipe, actor_recipe, replicas: int, resources: dict,
         driver_s: float, output: Path, quiet: bool, console: Console, stop) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pagedrun.io.jsonl import output_record
    from pagedrun.io.writer import request_key

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
                    o = error_output(r, "no replica returned it: its batch failed on every attempt, twice "
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
        from pagedrun.report.report import write_report

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
    return job_exit_code(writer, order, output, console)


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
