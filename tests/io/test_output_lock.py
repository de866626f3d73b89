"""The output lock cannot be lost (issue 40, item 4): the flock is on OUT itself and moves with it, so
no file a user deletes, moves or forges lets a second writer in; the refusal says who holds it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedrun.errors import PagedrunError
from pagedrun.io.file_safety import lock_path
from pagedrun.io.writer import OutputWriter, request_key

pytest.importorskip("fcntl")
ROOT = Path(__file__).resolve().parents[2]
FP = {"recipe": "r", "prompts": "p"}


def rec(i: int) -> dict:
    return {"id": f"r{i}", "token_ids": [i], "text": str(i)}


def opened(out: Path, **kw) -> OutputWriter:
    w = OutputWriter(out, FP, **kw)
    w.open()
    return w


def refused(out: Path, **kw) -> str:
    with pytest.raises(PagedrunError, match="in use by another pagedrun run") as e:
        OutputWriter(out, FP, **kw)
    return str(e.value)


@pytest.fixture
def holder(tmp_path):
    """Another process writing tmp_path/o.jsonl, holding its lock until killed."""
    out = tmp_path / "o.jsonl"
    code = ("import time; from pathlib import Path; from pagedrun.io.writer import OutputWriter; "
            f"w = OutputWriter(Path({str(out)!r}), {FP!r}); w.open(); w.write({rec(0)!r}); "
            "print('ready', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert p.stdout.readline().strip() == "ready"
        yield out, p
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("action", ["none", "delete-note", "empty-note", "forged-note", "stale-old-note"])
def test_no_action_on_the_lock_note_lets_a_second_writer_in(holder, action):
    out, first = holder
    note = lock_path(out)
    if action == "delete-note":  # the case: a "stale" OUT.lock removed by hand
        note.unlink()
    elif action == "empty-note":
        note.write_text("")
    elif action == "forged-note":  # another pid's note: the kernel's lock table says who holds it
        note.write_text("pagedrun pid 1 host elsewhere started 2000-01-01T00:00:00Z\n")
    elif action == "stale-old-note":
        note.unlink()
        note.write_text("pagedrun pid 1\n")
    err = refused(out)
    if Path("/proc/locks").exists() or action == "none":
        assert f"(pid {first.pid}" in err, err
    if action == "none":
        assert f"on {socket.gethostname()}, started 20" in err, err
    assert out.read_text().count("\n") == 1  # untouched by the refused run


def test_the_lock_moves_with_every_rewrite_of_out(tmp_path):
    out = tmp_path / "o.jsonl"
    w = opened(out)
    w.write(rec(1))
    w.write(rec(0))
    before = os.stat(out).st_ino
    w.finalize([request_key("r0"), request_key("r1")])  # renamed over OUT: a new inode at the path
    assert os.stat(out).st_ino != before
    refused(out)
    lock_path(out).unlink()
    refused(out)
    w.close()
    OutputWriter(out, FP).close()  # released: the next run gets it


def test_a_resume_that_rewrites_a_torn_file_keeps_the_lock(tmp_path):
    out = tmp_path / "o.jsonl"
    w = opened(out)
    w.write(rec(0))
    w.close()
    with open(out, "ab") as f:
        f.write(b'{"id": "r1", "tok')  # torn: the resume rewrites OUT at open()
    w = OutputWriter(out, FP)
    w.open()
    assert w.discarded == 1
    refused(out)
    w.write(rec(2))
    w.finalize([request_key("r2"), request_key("r0")])  # a second rewrite reads the first's file
    assert [x[8:10] for x in out.read_text().splitlines()] == ["r2", "r0"]
    refused(out)
    w.close()


def test_overwrite_keeps_the_lock_on_the_same_file(tmp_path):
    out = tmp_path / "o.jsonl"
    opened(out).close()
    w = opened(out, overwrite=True)
    refused(out)
    refused(out, overwrite=True)
    w.close()


@pytest.mark.parametrize("how", ["deleted", "moved", "replaced"])
def test_a_run_whose_out_is_taken_away_stops_and_writes_over_nothing(tmp_path, how):
    out = tmp_path / "o.jsonl"
    w = opened(out, fsync_interval_s=0.0)
    w.write(rec(0))
    if how == "deleted":
        out.unlink()
    elif how == "moved":
        out.rename(tmp_path / "elsewhere.jsonl")
    else:
        out.write_bytes(b"")  # same inode: not taken away, still locked
        refused(out)
        w.close()
        return
    second = OutputWriter(out, FP)  # the path is free: a new run may start on it
    second.open()
    second.write(rec(7))
    with pytest.raises(PagedrunError, match="was deleted or replaced during the run"):
        w.write(rec(1))
    with pytest.raises(PagedrunError, match="was deleted or replaced during the run"):
        w.finalize([request_key("r0"), request_key("r1")])
    w.close()
    assert out.read_text().count("\n") == 1 and '"r7"' in out.read_text()  # the second run's, untouched
    second.close()


def test_a_refused_run_leaves_no_empty_output_and_no_lock(tmp_path):
    out = tmp_path / "new" / "o.jsonl"
    w = OutputWriter(out, FP)  # a new path is created to be locked...
    assert out.exists()
    w.close()  # ...and removed again when the run never opened it
    assert not out.exists() and not lock_path(out).exists()
    opened(out).close()  # opened, it stays (even empty)
    assert out.exists() and not lock_path(out).exists()


def test_the_cli_refuses_a_second_run_after_the_note_is_deleted(holder, tmp_path):
    from typer.testing import CliRunner

    from pagedrun.cli.app import app

    out, first = holder
    lock_path(out).unlink()  # "stale", by hand
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6]}\n')
    res = CliRunner().invoke(app, ["generate", str(prompts), "-o", str(out), "--set", "cache.num_blocks=16"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.startswith(f"error: {out}: in use by another pagedrun run (pid ") and res.stderr.count("\n") == 1
    if Path("/proc/locks").exists():
        assert f"(pid {first.pid}" in res.stderr
    assert out.read_text().count("\n") == 1  # the holder's line, nothing of the refused run
    assert json.loads((tmp_path / "o.jsonl.meta.json").read_text())["fingerprint"] == FP
