"""A closed, full, read-only or broken terminal never stops a job: it goes quiet, the job finishes,
the exit code is the job's (pagedrun/console.py)."""
from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedrun.console import QuietOnFailure, terminal_may_fail

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}
TOO_LONG = {"prompt_token_ids": [5] * 40}  # an error record: longer than max_model_len


class Failing(io.StringIO):
    """A stream whose writes fail with `err` once `after` writes went through."""

    def __init__(self, err: int, after: int = 0) -> None:
        super().__init__()
        self.err, self.left = err, after

    def write(self, text: str) -> int:
        if self.left == 0:
            raise OSError(self.err, os.strerror(self.err))
        self.left -= 1
        return super().write(text)


@pytest.mark.parametrize("err", [errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT])
@pytest.mark.parametrize("after", [0, 2])
def test_a_failed_write_silences_the_stream(err, after):
    real = Failing(err, after)
    stream = QuietOnFailure(real)
    for i in range(5):
        assert stream.write(f"line {i}\n") == len(f"line {i}\n")
    stream.flush()
    assert stream.gone
    assert real.getvalue() == "".join(f"line {i}\n" for i in range(after))  # the rest went nowhere


def test_a_closed_stream_is_silenced_too():
    closed = io.StringIO()
    closed.close()
    stream = QuietOnFailure(closed)
    stream.write("x")
    stream.flush()
    assert stream.gone


def test_none_streams_become_quiet_streams(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)
    with terminal_may_fail():
        print("into nothing", file=sys.stderr)  # not onto stdout, as print(file=None) would
        assert sys.stderr is not None
    assert sys.stderr is None


def run_cli(tmp_path: Path, model: Path, lines: list[dict], redirect: str, *extra: str):
    """The CLI in a fresh interpreter (exec'd: no wrapper shell or shim between the redirection and
    Python), with `redirect` applied by bash; its own stdout/stderr are reported through a side file."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, **x}) + "\n" for i, x in enumerate(lines)))
    args = " ".join([sys.executable, "-m", "pagedrun", "generate", "p.jsonl", "-o", "out.jsonl",
                     f"--set model.path={model}", "--set cache.num_blocks=64", "--set model.max_model_len=32",
                     "--set model.threads=1", *extra])
    return subprocess.run(["bash", "-c", f"exec {args} {redirect}"], check=False, cwd=tmp_path, timeout=300,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode


REDIRECTS = [
    "2>&-",  # stderr closed by the script: the next file opened would otherwise be descriptor 2
    "2</dev/null",  # stderr open but not for writing (what a wrapper shell's own script descriptor gives): EBADF
    "2>/dev/full",  # a log on a full disk: ENOSPC on every write
    ">&- 2>&-",  # both closed
    ">/dev/full 2>/dev/full",
    "</dev/null >&- 2>/dev/full",
]


@pytest.mark.slow
@pytest.mark.parametrize("redirect", REDIRECTS)
def test_the_job_finishes_with_its_own_exit_code(tiny_model, tmp_path, redirect):
    model = tiny_model("llama")
    lines = [GOOD] * 6 + [TOO_LONG] + [GOOD] * 3
    assert run_cli(tmp_path, model, lines, redirect) == 3  # one request failed: the job's code
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [str(i) for i in range(10)]
    assert sum("error" in r for r in records) == 1
    assert json.loads((tmp_path / "out.jsonl.report.json").read_text())
    # Resumed, with the same terminal: nothing to do, same code.
    assert run_cli(tmp_path, model, lines, redirect) == 3
    # And a user error is still exit code 2, said into nothing.
    assert run_cli(tmp_path, model, lines, redirect, "--set model.threads=100000") == 2


@pytest.mark.slow
def test_closed_stderr_never_lands_in_the_job_files(tiny_model, tmp_path):
    """With descriptor 2 closed, whatever the job writes to "stderr" (progress, warnings, the summary)
    goes nowhere: not into the lock, the snapshot or the output that would take its number."""
    model = tiny_model("llama")
    assert run_cli(tmp_path, model, [GOOD] * 4, "2>&-") == 0
    for f in tmp_path.iterdir():
        if f.is_file() and f.name != "p.jsonl":
            text = f.read_bytes()
            assert b"pagedrun generate" not in text and b"generating" not in text and b"\x1b[" not in text, f
