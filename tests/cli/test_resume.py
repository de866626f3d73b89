"""Interrupted `pagedrun generate` runs lose nothing: SIGKILL at random points, SIGINT (once and
twice), then the same command again completes the job with outputs identical to an uninterrupted
greedy run, one per request, in input order."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import make_tiny_model, write_token_prompts
from typer.testing import CliRunner

from pagedrun.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and a second one spinning on a busy CI machine costs
    seconds per run; the subprocesses get OMP_NUM_THREADS=1 too, so all runs compute alike."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def job(tmp_path_factory, one_thread):
    """A tiny model, a prompts file and the token ids of an uninterrupted greedy run (in-process)."""
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    root = tmp_path_factory.mktemp("resume")
    model = make_tiny_model("llama", root / "model")
    prompts = write_token_prompts(root / "prompts.jsonl", NUM_REQUESTS, id_prefix="q", max_tokens=MAX_TOKENS, seed=0)
    sets = [f"model.path={model}", "cache.num_blocks=64", "model.max_model_len=64",
            "scheduler.max_num_batched_tokens=64",
            "scheduler.max_num_seqs=2"]  # few at a time: many steps, so signals land mid-run
    llm = LLM(load_recipe(None, sets))
    requests, invalid = llm.read_requests(prompts)
    assert not invalid
    reference = {o.request_id: o.outputs[0].token_ids for o in llm.run(requests)}
    assert all(len(t) == MAX_TOKENS for t in reference.values())
    return {"root": root, "prompts": prompts, "sets": sets, "reference": reference,
            "ids": [f"q{i}" for i in range(NUM_REQUESTS)]}


def command(job, out: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "pagedrun", "generate", str(job["prompts"]), "-o", str(out), "-q", *extra]
    for s in job["sets"]:
        cmd += ["--set", s]
    return cmd


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def start(job, out: Path) -> subprocess.Popen:
    return subprocess.Popen(command(job, out), cwd=job["root"], env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def complete_records(out: Path) -> list[dict]:
    """Every complete line of `out` (a torn last line, which only SIGKILL may leave, is ignored)."""
    if not out.exists():
        return []
    data = out.read_bytes()
    return [json.loads(x) for x in data[: data.rfind(b"\n") + 1].splitlines()]


def wait_for_records(proc: subprocess.Popen, out: Path, more_than: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(complete_records(out)) <= more_than and proc.poll() is None:
        assert time.monotonic() < deadline, "no output line appeared"
        time.sleep(0.01)


def assert_complete(job, out: Path) -> None:
    records = complete_records(out)
    assert out.read_bytes().endswith(b"\n")
    assert [r["id"] for r in records] == job["ids"]  # one each, none lost, none repeated, input order
    assert {r["id"]: r["token_ids"] for r in records} == job["reference"]
    assert not list(out.parent.glob("*.tmp"))


def finish(job, out: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command(job, out), cwd=job["root"], env=env(), text=True, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


@pytest.mark.slow


def test_sigkill_at_random_points_then_resume(job):
    out = job["root"] / "killed" / "out.jsonl"
    rng = random.Random(7)
    killed_mid_run = 0
    for trial in range(3):
        before = len(complete_records(out))
        proc = start(job, out)
        if trial == 0:
            time.sleep(rng.uniform(0.0, 2.0))  # anywhere: imports, model load, opening the output...
        else:
            wait_for_records(proc, out, before + rng.randint(0, 2))  # ...or while lines are appended
            time.sleep(rng.uniform(0.0, 0.03))
        proc.kill()
        proc.communicate(timeout=60)
        records = complete_records(out)
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), "a request was written twice"
        for r in records:
            assert r["token_ids"] == job["reference"][r["id"]]
        killed_mid_run += proc.returncode == -signal.SIGKILL and 0 < len(records) < NUM_REQUESTS
    assert killed_mid_run >= 1, "the job finished before any kill; make it longer"
    finish(job, out)
    assert_complete(job, out)


@pytest.mark.slow


def test_sigint_stops_cleanly_and_resumes_and_second_sigint_exits_at_once(job):
    out = job["root"] / "sigint" / "out.jsonl"
    report = out.with_name("out.jsonl.report.json")

    # One SIGINT: the step in progress ends, finished outputs and a partial report are kept.
    proc = start(job, out)
    wait_for_records(proc, out, 0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "stopped by SIGINT" in err and "run the same command again" in err
    first = complete_records(out)
    assert out.read_bytes().endswith(b"\n")
    assert 0 < len(first) < NUM_REQUESTS
    assert len({r["id"] for r in first}) == len(first)
    assert json.loads(report.read_text())["interrupted"] is True

    # Resumed, then a second SIGINT while the first is being honoured: out at once, file intact.
    proc = start(job, out)
    wait_for_records(proc, out, len(first))
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:
        if "stopping after this step" in line:
            proc.send_signal(signal.SIGINT)
            break
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, err
    assert "second SIGINT" in err and "Traceback" not in err
    second = complete_records(out)
    assert out.read_bytes().endswith(b"\n")  # no torn line
    assert len(second) > len(first)
    assert len({r["id"] for r in second}) == len(second)

    finish(job, out)
    assert_complete(job, out)
    assert json.loads(report.read_text())["interrupted"] is False


def invoke(job, prompts: Path, out: Path, *extra: str):
    """The CLI in-process (no interpreter start-up): for what does not need a real signal."""
    args = ["generate", str(prompts), "-o", str(out), "-q", *extra]
    for s in job["sets"]:
        args += ["--set", s]
    return CliRunner().invoke(app, args)


def test_resume_of_a_finished_job_changes_nothing_and_overwrite_starts_afresh(job):
    out = job["root"] / "again" / "out.jsonl"
    assert invoke(job, job["prompts"], out).exit_code == 0
    assert_complete(job, out)
    before = out.read_bytes()
    again = invoke(job, job["prompts"], out)
    assert again.exit_code == 0 and out.read_bytes() == before
    # A changed recipe is refused (before any model loading) and changes nothing...
    changed = invoke(job, job["prompts"], out, "--set", "sampling.seed=5")
    assert changed.exit_code == 2 and "Traceback" not in changed.output
    assert changed.stderr.count("\n") == 1
    assert changed.stderr.startswith(f"error: {out}: holds outputs of a run with a different recipe")
    assert "--overwrite" in changed.stderr
    assert out.read_bytes() == before
    # ...and so is a changed prompts file...
    edited = job["root"] / "edited.jsonl"
    edited.write_bytes(job["prompts"].read_bytes() + b"\n")  # a blank line more: same requests, other file
    changed = invoke(job, edited, out)
    assert changed.exit_code == 2 and "different prompts file" in changed.stderr
    # ...unless --overwrite: then it starts afresh.
    fresh = invoke(job, job["prompts"], out, "--set", "sampling.seed=5", "--overwrite")
    assert fresh.exit_code == 0, fresh.output
    assert out.read_bytes() != before  # new timings in the metrics
    assert_complete(job, out)  # greedy: the seed changes no token


def test_skip_invalid_keeps_duplicate_id_error_records_apart(job, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([
        '{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 3}',
        '{"id": "a", "prompt_token_ids": [8, 9], "max_tokens": 3}',  # duplicate id
        '{"id": "t", "prompt_token_ids": [5], "temperature": -1}',
        '{"id": "b", "prompt_token_ids": [9, 10, 11], "max_tokens": 3}',
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(job, prompts, out, "--skip-invalid")
    assert result.exit_code == 3, result.output  # some requests failed
    records = complete_records(out)
    assert [(r["id"], r.get("line")) for r in records] == [("a", None), ("a", 2), ("t", 3), ("b", None)]
    assert records[0]["token_ids"] and records[3]["token_ids"]
    assert records[1]["error"] == "p.jsonl:2: id: duplicate id 'a' (first used on line 1)"
    assert records[2]["error"].startswith("p.jsonl:3: temperature: ")
    before = out.read_bytes()
    again = invoke(job, prompts, out, "--skip-invalid")  # resume: all four are done, none merged or redone
    assert again.exit_code == 3, again.output  # the file's error records still count
    assert out.read_bytes() == before


def test_stop_flag_first_signal_stops_second_exits_at_once(capfd):
    from pagedrun.cli import app as cli

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    exits = []
    flag = cli.StopFlag(exit_now=exits.append)  # the CLI's is os._exit
    flag.install()
    try:
        assert not flag()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the Python-level handler runs at the next bytecode boundary
        assert flag() and flag.signal_name == "SIGTERM" and flag.exit_code == 143 and not exits
        flag.restore()  # stopping: the handlers stay, so a second signal still exits at once
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert exits == [130]
        assert "second SIGINT: exiting now" in capfd.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    unstopped = cli.StopFlag(exit_now=exits.append)
    unstopped.install()
    unstopped.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
