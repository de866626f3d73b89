"""Faults injected into Ray replicas by tests/cli/test_ray.py: replica subclasses the driver is pointed at
(monkeypatching pagedrun.cli.ray.driver.EngineReplica), so pagedrun itself carries no test hook.

This module must be importable by the Ray workers (the cluster fixture puts tests/ on PYTHONPATH):
Ray pickles these classes by reference and a worker imports them from here.
"""
from __future__ import annotations

import os
from pathlib import Path

from pagedrun.cli.ray.replica import EngineReplica

# A file holding an integer N; the first CrashingReplica to start its (N+1)-th batch while the file
# exists removes it and kills its own process mid-batch (os._exit), as an OOM kill would. An
# environment variable, because Ray workers inherit the driver's environment at ray.init.
CRASH_FILE_ENV = "PAGEDRUN_TEST_RAY_CRASH_FILE"


class CrashingReplica(EngineReplica):
    def __call__(self, batch: dict) -> dict:
        if self.init_error is None:
            _maybe_crash(self.batches + 1)  # the batch number EngineReplica.__call__ is about to count
        return super().__call__(batch)


class PoisonedReplica(EngineReplica):
    """A replica in which the run of one request id raises, every time."""

    poison_id: str | None = None

    def _run(self, requests: list) -> list:
        if any(r.id == self.poison_id for r in requests):
            raise RuntimeError(f"injected failure for request {self.poison_id}")
        return super()._run(requests)


def _maybe_crash(batch_number: int) -> None:
    path = os.environ.get(CRASH_FILE_ENV)
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
