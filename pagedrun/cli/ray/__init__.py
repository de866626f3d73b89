"""`pagedrun generate --ray`: data-parallel batch inference on a Ray cluster, with Ray Data.

pagedrun does not schedule work across machines itself. The driver (the CLI process) runs the same
job as a local run (cli/job.py): check the recipe, open the output (resume), check every line of the
prompts file, JSONL or an OpenAI batch file, with the same request stream (so errors are word for
word those of a local run; only the tokenizer and config.json are loaded here, no weights). The validated requests not yet in the output
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

Modules: driver.py (RayRun, the executor of a job (cli/job.py): the Ray Data passes), cluster.py (joining
Ray, sizing the actor pool), replica.py (EngineReplica, the actor), merge.py (the merged report),
replica_table.py (the replicas' numbers on the terminal, within 80 columns).
"""
from pagedrun.cli.ray.driver import RayRun

__all__ = ["RayRun"]
