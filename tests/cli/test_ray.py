"""`pagedrun generate --ray`: data-parallel over a Ray cluster gives what a local run gives.

One local Ray cluster (2 CPUs) is shared by the module; every Ray run starts 2 CPU replicas of a
tiny random Llama. Greedy outputs must equal an in-process local run's, in input order, ids
preserved; the report's totals must be the sums of its replicas'; a replica killed mid-run (an
injected os._exit, as an OOM kill would) must still leave every request answered exactly once; a
resumed job sends only what is missing. Tests that need no cluster (no Ray installed, driver-side
validation, the replica's per-request isolation, the merge) run without one.
"""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from ray_faults import CRASH_FILE_ENV, CrashingReplica, PoisonedReplica
from tiny_models import make_tiny_model, write_token_prompts
from typer.testing import CliRunner

from pagedrun.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
N = 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny model, a prompts file and the token ids of a local greedy run (in-process)."""
    import torch

    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    root = tmp_path_factory.mktemp("ray")
    model = make_tiny_model("llama", root / "model")
    prompts = write_token_prompts(root / "prompts.jsonl", N, id_prefix="r", max_tokens=MAX_TOKENS, seed=1)
    sets = [f"model.path={model}", "cache.num_blocks=64", "model.max_model_len=64", "model.threads=1"]
    before = torch.get_num_threads()
    llm = LLM(load_recipe(None, sets))
    requests, invalid = llm.read_requests(prompts)
    torch.set_num_threads(before)
    assert not invalid
    reference = {o.request_id: o.outputs[0].token_ids for o in llm.run(requests)}
    return {"root": root, "prompts": prompts, "sets": sets, "reference": reference,
            "ids": [f"r{i}" for i in range(N)], "recipe": llm.recipe}


@pytest.fixture(scope="module")
def cluster(job):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    # Workers inherit the driver's environment: they must find pagedrun and tests/ray_faults.py,
    # keep torch on one thread, and see the crash file's path (armed only by the test that wants a
    # crash, which also points the driver at CrashingReplica).
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS", CRASH_FILE_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), saved["PYTHONPATH"]) if p)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[CRASH_FILE_ENV] = str(job["root"] / "crash-after-batches")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def generate(job, out: Path, *extra: str):
    args = ["generate", str(job["prompts"]), "-o", str(out), "-q", *extra]
    for s in job["sets"]:
        args += ["--set", s]
    return CliRunner().invoke(app, args)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def populate_works() -> bool:
    """Whether this kernel commits pages on request (worker/populate.py), probed on a small cache."""
    import torch

    from pagedrun.worker.populate import CachePopulator

    pop = CachePopulator([torch.zeros(1, 2, 4, 1024)], chunk_blocks=4)
    pop.ensure(1)
    return pop.active


def check_totals(report: dict) -> None:
    reps = [r["report"] for r in report["replicas"]]
    tot = report["total"]
    for path in (("num_requests",), ("num_errors",), ("throughput", "prompt_tokens"),
                 ("throughput", "output_tokens"), ("preemptions", "recompute"), ("prefix_cache", "hit_tokens"),
                 ("blocks_in_use", "peak"), ("kv_pages_committed", "blocks")):
        got = tot
        for k in path:
            got = got[k]
        want = 0
        for r in reps:
            v = r
            for k in path:
                v = v[k]
            want += v
        assert got == want, path


# ---------------------------------------------------------------- on a Ray cluster

@pytest.fixture(scope="module")
def ray_run(job, cluster, tmp_path_factory):
    """One uninterrupted --ray run (Ray runs cost seconds each: the tests share it)."""
    out = tmp_path_factory.mktemp("ray_run") / "out.jsonl"
    res = generate(job, out, "--ray", "--replicas", "2")
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.slow
def test_ray_run_equals_local_run(job, ray_run):
    out = ray_run
    recs = records(out)
    assert [r["id"] for r in recs] == job["ids"]  # input order, ids preserved
    assert {r["id"]: r["token_ids"] for r in recs} == job["reference"]
    report = json.loads(out.with_name("out.jsonl.report.json").read_text())
    assert report["mode"] == "ray" and report["num_replicas"] == len(report["replicas"]) >= 1
    check_totals(report)
    assert report["total"]["num_requests"] == N
    assert report["total"]["throughput"]["output_tokens"] == N * MAX_TOKENS
    assert report["total"]["throughput"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in recs)
    for rep in report["replicas"]:
        r = rep["report"]
        # each replica's report is a local run's report of what that engine did
        assert r["num_steps"] > 0 and r["kv_capacity"]["blocks"] == 64
        assert r["blocks_in_use"]["peak"] > 0 and rep["device"] == "cpu"
        # The engine committed its KV pages a chunk of blocks ahead (all 64 here; none on a kernel
        # without MADV_POPULATE_WRITE): carried from the replica's batches, not lost with it.
        assert r["kv_pages_committed"]["blocks"] == (64 if populate_works() else 0)
    # The replica tables a run without -q prints, from this report, at 80 columns (tests/test_tables.py).
    from rich.console import Console

    from pagedrun.cli.ray.replica_table import print_replicas

    console = Console(file=io.StringIO(), width=80, color_system=None)
    print_replicas(console, report)
    words = console.file.getvalue().split()
    assert "…" not in console.file.getvalue()
    assert all(words.count(rep["replica"]) == 2 for rep in report["replicas"]) and words.count("total") == 2
    assert f"{report['total']['throughput']['prompt_tokens']:,}" in words
    # A second run of the same command: everything is done, nothing is sent to the cluster.
    res = generate(job, out, "--ray", "--replicas", "2")
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in records(out)] == job["ids"]


@pytest.mark.slow
def test_replica_killed_mid_run_and_resume(job, ray_run, tmp_path, monkeypatch):
    """Resume from a partial output, and one replica dies (os._exit) in its second batch: Ray
    restarts it and retries the batch; every request ends up answered exactly once."""
    from pagedrun.io.writer import meta_path

    full = ray_run
    # An interrupted job: the first 5 requests are in the output.
    out = tmp_path / "out.jsonl"
    lines = full.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]))
    meta_path(out).write_text(meta_path(full).read_text())

    fault = job["root"] / "crash-after-batches"
    fault.write_text("1")
    monkeypatch.setattr("pagedrun.cli.ray.driver.EngineReplica", CrashingReplica)
    try:
        res = generate(job, out, "--ray", "--replicas", "2")
        assert res.exit_code == 0, res.output
        assert not fault.exists(), "no replica reached a second batch: the crash was not exercised"
    finally:
        fault.unlink(missing_ok=True)
    recs = records(out)
    assert [r["id"] for r in recs] == job["ids"]  # exactly once each, in input order
    assert {r["id"]: r["token_ids"] for r in recs} == job["reference"]
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    check_totals(report)
    assert report["total"]["num_requests"] == N - 5  # only the missing ones went to the cluster


@pytest.mark.slow
def test_ray_runs_an_openai_batch_file_as_a_local_run_does(job, cluster, tmp_path):
    """The same job module (cli/job.py) runs local and Ray jobs: an OpenAI batch file goes through
    --ray and its output file is byte for byte the local run's (ids, created, choices, usage)."""
    batch = tmp_path / "batch.jsonl"
    with open(batch, "w") as f:
        for line in job["prompts"].read_text().splitlines():
            r = json.loads(line)
            f.write(json.dumps({"custom_id": r["id"], "method": "POST", "url": "/v1/completions",
                                "body": {"model": "tiny", "prompt": r["prompt_token_ids"],
                                         "max_tokens": MAX_TOKENS, "temperature": 0}}) + "\n")
    outs = {}
    for mode in ("local", "ray"):
        out = tmp_path / f"{mode}.jsonl"
        args = ["generate", str(batch), "-o", str(out), "-q"] + (["--ray", "--replicas", "2"] if mode == "ray" else [])
        for s in job["sets"]:
            args += ["--set", s]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        outs[mode] = out.read_text()
    lines = [json.loads(x) for x in outs["ray"].splitlines()]
    assert [x["custom_id"] for x in lines] == job["ids"] and all(x["response"]["status_code"] == 200 for x in lines)
    assert outs["ray"] == outs["local"]


# ---------------------------------------------------------------- without a cluster

def test_without_ray_one_line_error(job, tmp_path, monkeypatch):
    for name in ("ray", "ray.data"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    res = generate(job, tmp_path / "out.jsonl", "--ray")
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'pagedrun[ray]'" in lines[0], res.output


def test_invalid_requests_same_error_as_local(job, tmp_path):
    pytest.importorskip("ray.data")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6]}) + "\n"
                   + json.dumps({"id": "b", "prompt_token_ids": [5, 6], "temperature": -1}) + "\n")
    errors = []
    for extra in ((), ("--ray",)):
        res = CliRunner().invoke(app, ["generate", str(bad), "-o", str(tmp_path / f"o{len(extra)}.jsonl"), "-q",
                                       *sum((["--set", s] for s in job["sets"]), []), *extra])
        assert res.exit_code == 2
        errors.append(res.output.strip())
    assert errors[0] == errors[1] and "bad.jsonl:2: temperature" in errors[0]


def _batch(requests):
    import numpy as np

    return {"index": np.arange(len(requests)), "id": np.array([r.id for r in requests], dtype=object),
            "prompt_token_ids": np.array([np.array(r.prompt_token_ids) for r in requests] + [None],
                                         dtype=object)[:-1],
            "sampling": np.array([json.dumps(r.sampling.to_dict()) for r in requests], dtype=object)}


@pytest.mark.slow


def test_replica_isolates_a_failing_request(job):
    """A request whose run raises (every time) becomes an error record; the rest of its batch is
    answered as usual, and the replica's counters are kept."""
    import pickle

    import torch

    from pagedrun.llm import LLM

    llm = LLM(job["recipe"])
    requests, _ = llm.read_requests(job["prompts"])
    batch = requests[:4]
    before = torch.get_num_threads()
    try:
        replica = PoisonedReplica(job["recipe"])
        replica.poison_id = batch[2].id
        out = replica(_batch(batch))
    finally:
        torch.set_num_threads(before)
    outs = [pickle.loads(b) for b in out["output"]]
    assert [o.request_id for o in outs] == [r.id for r in batch]
    assert "injected failure" in outs[2].error and outs[2].outputs == []
    for o in outs[:2] + outs[3:]:
        assert o.error is None and o.outputs[0].token_ids == job["reference"][o.request_id]
    stats = [pickle.loads(s) for s in out["stats"] if s]
    assert len(stats) == 1 and stats[0]["steps"] and stats[0]["replica"] == out["replica"][0]


@pytest.mark.slow


def test_replica_that_cannot_build_its_engine_stops_the_job_with_the_local_error(tmp_path):
    """An engine that cannot be built (here: a KV budget too small for max_model_len) is reported by
    the replica's batches, not raised (Ray Data would count it as one failed batch and go on); the
    driver raises it as the one-line error a local run gives."""
    import pickle

    import torch

    from pagedrun.cli.ray.replica import EngineReplica
    from pagedrun.config.recipe import load_recipe
    from pagedrun.errors import PagedrunError
    from pagedrun.llm import LLM
    from pagedrun.sampling_params import SamplingParams

    model = make_tiny_model("llama", tmp_path / "model", num_hidden_layers=12, max_position_embeddings=4096)
    recipe = load_recipe(None, [f"model.path={model}", "model.max_model_len=4096", "cache.kv_cache_memory=1MiB",
                                "model.threads=1"])
    before = torch.get_num_threads()
    try:
        with pytest.raises(PagedrunError) as local:
            LLM(recipe)
        replica = EngineReplica(recipe)
        req = type("R", (), {"id": "a", "prompt_token_ids": [5, 6, 7], "sampling": SamplingParams(max_tokens=2)})
        out = replica(_batch([req]))
    finally:
        torch.set_num_threads(before)
    assert out["output"][0] == b""
    assert pickle.loads(out["stats"][0]) == {"fatal": str(local.value)}
