"""`-o -`: outputs on stdout as they finish, messages on stderr, nothing written beside (issue 39)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5, 6, i], "max_tokens": 2,
                                        "ignore_eos": True}) + "\n" for i in range(n)))
    return path


def _generate(tiny_model, tmp_path, out: str, *extra: str, stdout=subprocess.PIPE):
    cmd = [sys.executable, "-m", "pagedrun", "generate", str(_prompts(tmp_path / "p.jsonl", 5)), "-o", out,
           "--model", str(tiny_model("llama")), "--set", "model.device=cpu", "--set", "cache.num_blocks=32",
           "--max-model-len", "64", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.PIPE, timeout=300)


def test_outputs_go_to_stdout_and_match_a_file_run(tiny_model, tmp_path):
    res = _generate(tiny_model, tmp_path, "-")
    assert res.returncode == 0, res.stderr.decode()
    streamed = [json.loads(line) for line in res.stdout.decode().splitlines()]
    assert sorted(r["id"] for r in streamed) == [f"r{i}" for i in range(5)]
    assert not (tmp_path / "-").exists() and not list(tmp_path.glob("-*"))  # no file named "-", no report
    assert b"done" in res.stderr or b"requests" in res.stderr  # the summary is on stderr
    filed = _generate(tiny_model, tmp_path, "out.jsonl", "-q")
    assert filed.returncode == 0, filed.stderr.decode()
    by_id = {r["id"]: r["token_ids"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert {r["id"]: r["token_ids"] for r in streamed} == by_id


def test_a_closed_pipe_stops_the_job_with_one_line(tiny_model, tmp_path):
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        res = _generate(tiny_model, tmp_path, "-", "-q", stdout=w)
    finally:
        os.close(w)
    assert res.returncode == 5, res.stderr.decode()
    err = res.stderr.decode().strip().splitlines()
    assert "Traceback" not in res.stderr.decode()
    assert any("-o -: cannot write to stdout" in line and "0 of 5 requests were written to stdout" in line
               for line in err), err


def test_overwrite_with_stdout_is_refused(tiny_model, tmp_path):
    res = _generate(tiny_model, tmp_path, "-", "--overwrite")
    assert res.returncode == 2 and "--overwrite has no meaning for stdout" in res.stderr.decode()
