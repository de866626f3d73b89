"""`-o -`: outputs streamed to stdout as requests finish, for a pipeline (`pagedrun generate p.jsonl
-o - | jq ...`). Messages stay on stderr.

A pipe cannot be rewritten or read back, so what a file output gives is given up, and the docs say
so: lines come in the order requests finish (each carries its id; a Batch API line its custom_id),
there is no resume, no lock and no report file (the summary still goes to stderr). Each line is one
write of a whole record, so a reader never sees half of one. If the reader goes away (`| head -3`)
the job stops at once with an error: there is nowhere left to put what it would compute.

StdoutWriter has the OutputWriter methods the job calls (io/writer.py); it keeps only the keys
written (16 bytes each in an IdTable, io/id_table.py), to answer "already written?" and to count.
"""
from __future__ import annotations

import os
from pathlib import Path

from pagedrun.errors import PagedrunError
from pagedrun.io.id_table import IdTable, MarkedKeys
from pagedrun.io.writer import FAILED, Key, _encode, is_error_record, record_key

STDOUT = Path("-")


def is_stdout(path: Path) -> bool:
    return str(path) == "-"


class StdoutWriter:
    resumed = 0  # never: a pipe holds no earlier run
    discarded = 0
    created: int | None = None

    def __init__(self, fd: int = 1) -> None:
        self.path = STDOUT
        self.fd = fd
        self.done = IdTable()
        self.failed = MarkedKeys(self.done, FAILED)
        self.written = 0
        self.written_errors = 0

    def __contains__(self, key: Key) -> bool:
        return key in self.done

    def open(self) -> None:
        pass

    def write(self, record: dict, key: Key | None = None, input_line: int = 0) -> None:
        key = key or record_key(record)
        view = memoryview(_encode(record))
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            raise PagedrunError(f"-o -: cannot write to stdout ({e.strerror or e}): the reader has gone; "
                                f"{self.written} outputs were written") from None
        e = self.done.add(key)
        self.written += 1
        if is_error_record(record):
            self.done.marks[e] |= FAILED
            self.written_errors += 1

    def locate(self, key: Key, input_line: int) -> None:
        pass

    def finalize(self, order=None) -> None:
        pass  # already written, in the order they finished

    def close(self) -> None:
        pass
