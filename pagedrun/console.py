"""The terminal: quiet when it fails or its reader has gone, and result tables that fit 80 columns.

The terminal may go away or fill up; the job must not.

`pagedrun generate ... | head -2` closes the pipe after two lines, and the next write to it raises
BrokenPipeError (Python ignores SIGPIPE); `2>/dev/full` (a log on a full disk) raises ENOSPC on every
write, a stderr closed by the shell (`2>&-`) EBADF. Any of them, in the middle of a progress refresh or
a summary line, would end the job and leave the output unfinished. Inside `terminal_may_fail()`:
- stdin, stdout and stderr descriptors the shell closed are opened onto /dev/null first, so that no
  file the job opens (its lock, its output) is given number 1 or 2 and receives terminal writes;
- stdout and stderr are wrapped so that the first failed write (any OSError) points that descriptor at
  /dev/null, and from then on every write to it (rich, print, Python's flush at exit) succeeds into
  nothing. The job runs on, the outputs file is finished as usual, and the exit code is the job's.

Results (the bench comparison, the memory profile) go to stdout, so they can be piped and saved;
progress, spinners and errors stay on stderr. Every table fits 80 columns without cutting a cell:
numbers never wrap (a cut number reads as another number), headers are short or on two lines, and
a table that would need more columns is stacked into two (docs/design/architecture.md, house rules).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console

# Why a terminal write fails: OSError (EPIPE, ENOSPC, EBADF, EIO, ...); ValueError if the stream was closed.
TERMINAL_FAILURES = (OSError, ValueError)


class QuietOnFailure:
    """A text stream that goes quiet, instead of raising, once a write to it fails."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except TERMINAL_FAILURES:
            self._silence()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except TERMINAL_FAILURES:
            self._silence()

    def _silence(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            self._stream.flush()  # what the failed write left buffered now goes to /dev/null
        except TERMINAL_FAILURES:  # no descriptor (a test's captured stream), or a closed one: writes are dropped
            self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self._stream, name)


def open_closed_std_fds() -> None:
    """Open /dev/null on each of descriptors 0, 1 and 2 that is closed (`2>&-`): the lowest free number
    is what the next open() returns, so otherwise the job's lock or output file would become "stderr"."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if got != fd:  # (only if a lower one was closed meanwhile by another thread)
                os.dup2(got, fd)
                os.close(got)


def _quiet(stream: TextIO | None) -> QuietOnFailure:
    # Python leaves sys.stderr None when started with descriptor 2 closed; print(file=None) would then
    # write to stdout, so it gets a stream into /dev/null instead.
    return QuietOnFailure(stream if stream is not None else open(os.devnull, "w"))


@contextmanager
def terminal_may_fail() -> Iterator[None]:
    """Within: a closed, full or broken stdout or stderr silences that stream instead of ending the job."""
    open_closed_std_fds()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _quiet(saved[0]), _quiet(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def write_stderr(data: bytes) -> None:
    """os.write to descriptor 2 (from a signal handler: the stream may be mid-write), dropped if it fails."""
    try:
        os.write(2, data)
    except OSError:
        pass


WIDTH = 80  # the narrowest terminal the tables are designed for (tests/test_tables.py renders at it)


def results_console(console: Console) -> Console:
    """Where results go: stdout when `console` is the CLI's stderr console; otherwise `console`
    itself (a caller that captures the output, such as a test, gets everything in one place)."""
    return Console(highlight=False) if console.stderr else console
