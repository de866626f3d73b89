"""The terminal: quiet when its reader has gone, and result tables that fit 80 columns.

The terminal may go away; the job must not.

`pagedrun generate ... | head -2` closes the pipe after two lines, and the next write to it raises
BrokenPipeError (Python ignores SIGPIPE): in the middle of a progress refresh or a summary line that
would end the job, leaving the output unfinished. Inside `reader_may_leave()`, stdout and stderr
are wrapped so that the first EPIPE points that descriptor at /dev/null, and from then on every
write to it (rich, print, Python's flush at exit) succeeds into nothing. The job runs on, the
outputs file is finished as usual, and the exit code is the job's.

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


class PipeSafe:
    """A text stream that goes quiet, instead of raising, once its reader has gone."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def _silence(self) -> None:
        self.reader_gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            self._stream.flush()  # what the failed write left buffered now goes to /dev/null
        except (OSError, ValueError):  # no descriptor (a test's captured stream): writes are dropped
            self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self._stream, name)


@contextmanager
def reader_may_leave() -> Iterator[None]:
    """Within: a closed stdout or stderr pipe silences that stream instead of ending the job."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if s is None else PipeSafe(s) for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


WIDTH = 80  # the narrowest terminal the tables are designed for (tests/test_tables.py renders at it)


def results_console(console: Console) -> Console:
    """Where results go: stdout when `console` is the CLI's stderr console; otherwise `console`
    itself (a caller that captures the output, such as a test, gets everything in one place)."""
    return Console(highlight=False) if console.stderr else console
