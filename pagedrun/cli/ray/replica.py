"""The replica: one pagedrun engine per Ray actor, and what keeps a failing request from taking its
batch down with it (see pagedrun/cli/ray/__init__.py for the failure model)."""
from __future__ import annotations

import json
import os
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pagedrun.errors import PagedrunError
from pagedrun.report.metrics import StepLog


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
        self.pending_steps = StepLog()  # of engines rebuilt since the last batch, not yet sent
        self.pages_before = (0, 0.0)  # KV blocks committed and seconds taken by this replica's earlier engines
        self.llm = None
        t0 = time.perf_counter()
        try:
            self._new_engine()
        except PagedrunError as e:
            # Raised later, from a batch: an actor that fails in __init__ is recreated again and again.
            self.init_error = str(e)
        self.load_s = time.perf_counter() - t0

    def _new_engine(self) -> None:
        from pagedrun.llm import LLM

        if self.llm is not None:  # keep what the old engine measured
            self.pending_steps.merge(self.llm.engine.steps)
            self.pages_before = self._pages_committed()
        self.llm = LLM(self.recipe)

    def _pages_committed(self) -> tuple[int, float]:
        """KV blocks committed ahead of use and the seconds it took, over all of this replica's engines."""
        pop = self.llm.engine.worker.populator
        return self.pages_before[0] + pop.blocks_committed, self.pages_before[1] + pop.seconds

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
                    outs.append(error_output(r, f"failed in replica {self.replica_id}: {type(e).__name__}: "
                                                 + " ".join(str(e).split())))
                    self._recover()
        busy_s = time.perf_counter() - t0
        engine = self.llm.engine
        # The steps since the last batch, summed up (report/metrics.py: bounded, whatever their
        # number); the engine starts a new log for the next batch.
        steps, self.pending_steps = self.pending_steps, StepLog()
        steps.merge(engine.steps)
        engine.steps = StepLog()
        stats = {"replica": self.replica_id, "node": _node(), "pid": os.getpid(), "device": str(engine.worker.device),
                 "memory": engine.memory, "max_model_len": engine.max_model_len, "load_s": self.load_s,
                 "busy_s": busy_s, "steps": steps, "pages_committed": self._pages_committed()}
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
            engine.abort_all()
            clean = engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks
        except Exception:
            clean = False
        if not clean:
            self._new_engine()

    def _run(self, requests: list[_Req]) -> list:
        return self.llm.run(requests)


@dataclass
class _Req:
    """The fields of io.requests.Request that LLM.run reads."""
    id: str
    prompt_token_ids: list[int]
    sampling: Any


def error_output(r: _Req, message: str):
    """The record of a request that got no answer: failed in a replica, or (driver) never returned."""
    from pagedrun.outputs import RequestOutput

    return RequestOutput(r.id, 0, list(r.prompt_token_ids), [], error=message)


def _node() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:
        return os.uname().nodename
