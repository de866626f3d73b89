"""Joining a Ray cluster and sizing the pool of engine actors on it."""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from pagedrun.errors import PagedrunError

INSTALL_HINT = "pip install 'pagedrun[ray]'"


def import_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (the [data] extra: pandas, pyarrow)
    except ImportError:
        raise PagedrunError(f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


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
