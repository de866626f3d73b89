"""Reading a user's input file (recipe, prompts), whole or line by line, with one-line errors that name it;
InputSnapshot: a prompts file as it was when the run started.

A prompts file may be gzip-compressed (recognised by its first bytes, whatever its name): it is
decompressed as it is read, and everything after that (the lines, the job's fingerprint, a Batch
file's ids) is about the decompressed text, so `p.jsonl` and `p.jsonl.gz` holding the same lines are
the same job.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pagedrun.errors import PagedrunError


def open_input(path: Path, kind: str) -> BinaryIO:
    """`path`, a `kind` ("recipe", "prompts") file, opened for reading bytes; one-line errors."""
    name = path.name
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise PagedrunError(f"{name}: {kind} file not found ({path})") from None
    except IsADirectoryError:
        raise PagedrunError(f"{name}: is a directory, not a {kind} file ({path})") from None
    except OSError as e:
        raise PagedrunError(f"{name}: cannot read {kind} file: {e.strerror}") from None


GZIP_MAGIC = b"\x1f\x8b"


def read_input(path: Path, kind: str, limit: int | None = None) -> bytes:
    """The bytes of `path`, a `kind` ("recipe", "prompts") file; at most limit + 1 bytes are read
    when a limit is given, so the caller can refuse a larger file without holding it. A gzip prompts
    file is decompressed."""
    with open_input(path, kind) as f:
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:  # e.g. EIO, or a directory that open() accepted
            raise PagedrunError(f"{path.name}: cannot read {kind} file: {e.strerror}") from None
    if kind == "prompts" and data.startswith(GZIP_MAGIC):
        gunzip = _Gunzip(path.name)
        data = gunzip.feed(data) + gunzip.finish()
    return data


class _Gunzip:
    """Streaming gzip decompression (several concatenated members too, as `cat a.gz b.gz` makes), with
    one-line errors naming the file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._d = zlib.decompressobj(wbits=31)
        self._open = False  # bytes of a member fed, its end not seen yet

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            self._open = True
            try:
                out.append(self._d.decompress(data))
            except zlib.error as e:
                raise PagedrunError(f"{self.name}: not a valid gzip file: {e}") from None
            if not self._d.eof:
                break
            data = self._d.unused_data  # a member ended: what follows starts another one
            self._d = zlib.decompressobj(wbits=31)
            self._open = False
        return b"".join(out)

    def finish(self) -> bytes:
        if self._open:
            raise PagedrunError(f"{self.name}: not a valid gzip file: it ends inside a member (cut short?)")
        return b""


@dataclass
class InputSnapshot:
    """A prompts file as it was when the run started: its bytes then (size and sha256 recorded), copied
    once into a private unnamed file that every pass reads, so nothing done to the file during the
    run (lines appended, an editor's save, `cp` or `>` over it, removal) changes what runs or breaks
    the final rewrite. change() says in one line whether the file moved on meanwhile, for the user to
    know the outputs answer the snapshot (a later run sees another fingerprint: another job)."""

    path: Path
    fd: int  # the private copy
    size: int
    mtime_ns: int
    identity: tuple[int, int]  # (st_dev, st_ino) of the file at the start
    sha256: str  # of the bytes that run (a gzip file's decompressed text)
    file_size: int = -1  # of the file itself at the start (size: of the copy, decompressed)

    @classmethod
    def open(cls, path: Path, spool_dir: Path | None = None, kind: str = "prompts") -> InputSnapshot:
        """Copy `path` (the bytes it holds now, no more) to an unnamed file in `spool_dir` (beside the
        outputs: the disk that holds them holds a copy of the inputs; else the system's temp dir)."""
        name = Path(path).name
        with open_input(path, kind) as src:
            st = os.fstat(src.fileno())
            copy = _spool(spool_dir, name)
            h = hashlib.sha256()
            left = st.st_size
            gunzip = None
            first = True
            try:
                while left > 0:
                    chunk = src.read(min(1 << 20, left))
                    if not chunk:  # cut short while we read: the snapshot is what was there
                        break
                    left -= len(chunk)
                    if first and chunk.startswith(GZIP_MAGIC):
                        gunzip = _Gunzip(name)
                    first = False
                    if gunzip is not None:
                        chunk = gunzip.feed(chunk)
                    h.update(chunk)
                    copy.write(chunk)
                if gunzip is not None:
                    gunzip.finish()
                copy.flush()
                written = copy.tell()
            except OSError as e:
                copy.close()
                raise PagedrunError(f"{name}: cannot take a copy of the {kind} file: {e.strerror or e}") from None
            except PagedrunError:
                copy.close()
                raise
        fd = os.dup(copy.fileno())
        copy.close()
        snap = cls(Path(path), fd, written, st.st_mtime_ns, (st.st_dev, st.st_ino), h.hexdigest(),
                   st.st_size - left)
        snap._weak_close = weakref.finalize(snap, os.close, fd)
        return snap

    @property
    def mtime(self) -> int:
        """Its modification time at the start, in whole seconds (a batch output's `created`)."""
        return self.mtime_ns // 1_000_000_000

    def _chunks(self, size: int = 1 << 20) -> Iterator[bytes]:
        offset = 0
        while offset < self.size:
            try:
                chunk = os.pread(self.fd, min(size, self.size - offset), offset)
            except OSError as e:
                raise PagedrunError(f"{self.path.name}: cannot read the copy of the prompts file: "
                                    f"{e.strerror}") from None
            if not chunk:
                return
            offset += len(chunk)
            yield chunk

    def lines(self) -> Iterator[bytes]:
        """The snapshot's lines, each with its "\\n" (the last may lack it)."""
        parts: list[bytes] = []
        for chunk in self._chunks():
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                parts.append(chunk[start:end + 1])
                yield b"".join(parts)
                parts.clear()
                start = end + 1
            if start < len(chunk):
                parts.append(chunk[start:])
        if parts:
            yield b"".join(parts)

    def change(self) -> str | None:
        """One line if the file is no longer the one the snapshot was taken of, else None."""
        name = self.path.name
        try:
            st = os.stat(self.path)
        except OSError:
            now = "removed"
        else:
            if (st.st_dev, st.st_ino) != self.identity:
                now = "replaced by another file"
            elif st.st_size != self.file_size:
                now = f"now {st.st_size} bytes"
            elif st.st_mtime_ns != self.mtime_ns:
                now = "modified"
            else:
                return None
        return (f"{name}: changed during the run ({now}); the run used the {self.file_size} bytes it held at "
                "the start, and a new run on the changed file is another job")

    def close(self) -> None:
        self._weak_close()


def _spool(spool_dir: Path | None, name: str):
    """An unnamed temporary file (gone with the process, however it ends) in spool_dir or the temp dir."""
    for d in (spool_dir, None):
        try:
            return tempfile.TemporaryFile(dir=d)
        except OSError as e:
            err = e
    raise PagedrunError(f"{name}: cannot take a copy of the prompts file: {err.strerror or err}")
