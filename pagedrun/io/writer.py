"""Ordered, resumable output writing: nothing computed is lost, a re-run picks up where it stopped.

While the run goes, each finished request is appended as one complete JSON line: one unbuffered
write with SIGINT/SIGTERM blocked, so neither a signal nor the CLI's "exit now" on a second Ctrl-C
can leave half a line; the line is in the kernel as soon as `write` returns (it survives the process
being killed) and is fsynced every `fsync_interval_s` (it survives the machine going down). At the
end the file is rewritten in input order through a temporary file and an atomic rename.

A companion `OUT.meta.json` holds the fingerprint of the recipe and of the prompts file, so that a
re-run with other inputs is refused instead of silently mixing two jobs' outputs. A run holds an
exclusive lock on `OUT.lock` from the start, so two runs never write the same output; which paths
a run may write at all is decided in pagedrun/io/file_safety.py.

On a re-run every complete line that parses is kept and its request skipped. What a crash can leave
behind (a torn last line without its newline, a line that does not parse, a second line for the
same request) is dropped, the file is rewritten without it, and those requests are redone.

The writer holds no records, only where each one is in the file and which input line it answers
(input line, offset, length) and which failed: the final rewrite copies lines in the input's order
from there (ordered by input line, never by reading the inputs again), so a run of any size needs
memory for its keys, not its outputs. The previous run's file is read line by line. The index is an
IdTable (io/id_table.py): a record's key is 16 bytes, its place three 8-byte values, no Python
object per record (about 50 bytes a record; docs/log/2026-11-28-memory-bounded-index.md).

Records are keyed, not just by id: a request that ran is keyed by its id (unique among the requests
that run; io/id_table.py's request_key), an error record for an input line that could not run by its line number, which it
carries as "line". With --skip-invalid a duplicate-id line becomes an error record with the same
id as the request it duplicates; keyed by line, the two are neither merged nor lost.
"""
from __future__ import annotations

import json
import os
import signal
import time
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedrun.errors import PagedrunError
from pagedrun.io.batch_output import is_failed_line
from pagedrun.io.file_safety import (
    OutputLock,
    check_derived,
    check_output,
    is_lock,
    is_meta,
    is_report,
    lock_path,
    meta_path,
    remove_stale_temps,
    replace_file,
    report_path,
    temp_path,
)
from pagedrun.io.id_table import DEAD, IdTable, MarkedKeys, invalid_key, request_key

META_VERSION = 1

# A record's 16-byte key (io/id_table.py): request_key(id) or invalid_key(line); the two never
# collide. The index holds one key per finished request, so its size is the run's memory per request
# (docs/log/2026-11-28-memory-per-request.md).
Key = bytes
_SIGNALS = {signal.SIGINT, signal.SIGTERM}
__all__ = ["Key", "OutputWriter", "invalid_key", "record_key", "request_key"]

# The index's columns and marks.
_LINE, _OFFSET, _LENGTH = 0, 1, 2
FAILED = 1  # an error record
_COPIED = 2  # copied by the rewrite under way


def record_key(rec: object) -> Key | None:
    """The key of one output line, or None if it is not an output record. An OpenAI batch file's
    output line is keyed by its id, which is derived from the line (io/openai_batch.py)."""
    if not isinstance(rec, dict) or "id" not in rec:
        return None
    if "error" in rec and "line" in rec:
        return invalid_key(rec["line"])
    return request_key(rec["id"])


def _encode(record: dict) -> bytes:
    # ensure_ascii=False keeps text readable; json escapes "\n" inside strings, so one record is
    # exactly one line.
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


class OutputWriter:
    """`OutputWriter(path, fingerprint)` checks every path the run will write, takes the output's
    lock and reads a previous run's output without changing anything (so a refusal costs nothing);
    `open()` starts writing, `close()` lets the lock go. `inputs`: the run's input files, which no
    derived file may be; `report`: the run will write `OUT.report.json`."""

    def __init__(self, path: Path, fingerprint: dict, *, overwrite: bool = False, fsync_interval_s: float = 5.0,
                 inputs: tuple[Path | None, ...] = (), report: bool = False):
        self.path = Path(path)
        self.fingerprint = dict(fingerprint)
        self.overwrite = overwrite
        self.fsync_interval_s = fsync_interval_s
        # From a previous run and this one, in file order: (input line, offset, length) per key.
        self.done = IdTable(columns=3)
        self.failed = MarkedKeys(self.done, FAILED)  # error records among them
        self.resumed = 0  # records kept from a previous run
        # Records this run wrote, and the error records among them (lines that could not run, at either pass,
        # and requests that failed): what the summary and the report count, from the one place they all reach.
        self.written = 0
        self.written_errors = 0
        # A batch output's `created`, fixed by the run that started OUT and kept in its meta file, so that one
        # file never holds two values (the prompts file's mtime may change between a run and its resume).
        self.created: int | None = None
        self.discarded = 0  # lines of a previous run dropped (torn, unparseable or repeated)
        self._needs_rewrite = False
        self._fd: int | None = None
        self._size = 0  # of the file being appended to: the next record's offset
        self._last_fsync = time.monotonic()
        inputs = tuple(Path(p) for p in inputs if p is not None)
        check_output(self.path, inputs)
        derived = [(meta_path(self.path), "meta file", is_meta), (lock_path(self.path), "lock file", is_lock)]
        if report:
            derived.append((report_path(self.path), "report", is_report))
        for p, what, recognise in derived:
            check_derived(p, what, self.path, inputs, recognise)
        self._lock = OutputLock(self.path)
        try:
            if not overwrite:
                self._load_previous()
                self.resumed = len(self.done)
        except BaseException:
            self._lock.release()
            raise

    def __contains__(self, key: Key) -> bool:
        return key in self.done

    # ---- resume -------------------------------------------------------------------------------
    def _load_previous(self) -> None:
        if not self.path.exists():
            return
        meta = meta_path(self.path)
        if not meta.exists():
            if self.path.stat().st_size == 0:
                return
            raise PagedrunError(
                f"{self.path}: exists and was not written by pagedrun generate (no {meta.name}); "
                "pass --overwrite to replace it, or choose another -o"
            )
        try:
            previous = json.loads(meta.read_text(encoding="utf-8"))
            old = previous["fingerprint"]
            if not isinstance(old, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise PagedrunError(f"{meta}: unreadable; pass --overwrite to start afresh, or choose another -o") from None
        created = previous.get("created")
        self.created = created if isinstance(created, int) and not isinstance(created, bool) else None
        changed = [k for k, v in self.fingerprint.items() if old.get(k) != v]
        if changed:
            what = " and ".join("recipe" if k == "recipe" else "prompts file" if k == "prompts" else k
                                for k in changed)
            raise PagedrunError(
                f"{self.path}: holds outputs of a run with a different {what} (fingerprint in {meta.name}); "
                "pass --overwrite to start afresh, or choose another -o"
            )
        try:
            f = self._read_locked()
        except OSError as e:
            raise PagedrunError(f"{self.path}: cannot read: {e.strerror}") from None
        with f:
            offset = 0
            for raw in f:
                start, offset = offset, offset + len(raw)
                if not raw.endswith(b"\n"):  # a torn last line: the writer died in it
                    self._needs_rewrite = True
                    if raw.strip():
                        self.discarded += 1
                    break
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:  # includes bad UTF-8
                    rec = None
                key = record_key(rec)
                if key is None or key in self.done:
                    self.discarded += 1
                    continue
                self._remember(key, rec, start, len(raw))
                if self.created is None:  # a meta file from before `created` was kept there: the records'
                    self.created = _created_of(rec)
        self._needs_rewrite = self._needs_rewrite or self.discarded > 0

    def _read_locked(self):
        """The locked output for reading (the file checked, not whatever the path names by now)."""
        if self._lock.fd is None:  # no flock on this platform
            return self.path.open("rb")
        f = os.fdopen(os.dup(self._lock.fd), "rb")
        f.seek(0)
        return f

    def _remember(self, key: Key, record: dict, offset: int, length: int, line: int = 0) -> None:
        t = self.done
        e = t.add(key)
        t.values[_LINE][e], t.values[_OFFSET][e], t.values[_LENGTH][e] = line, offset, length
        if is_error_record(record):
            t.marks[e] |= FAILED

    # ---- writing --------------------------------------------------------------------------------
    def open(self) -> None:
        """Write the metadata, drop what a previous run left half-done, and open for appending."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for p in (self.path, meta_path(self.path), report_path(self.path)):
                remove_stale_temps(p)  # left by a run killed mid-rename (we hold the lock: no live run's)
            self._lock.check_current()
            if self.overwrite and self._lock.fd is not None:
                os.ftruncate(self._lock.fd, 0)  # the locked file itself: removing it would drop the lock
            elif self.overwrite:
                self.path.unlink(missing_ok=True)
            elif self._needs_rewrite:
                self._rewrite(self.done.entries())
            self._write_meta()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                               0o644)
            self._lock.kept_open()
            self._lock.check_current()  # the append fd is the locked file, not one put there meanwhile
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            raise PagedrunError(f"{self.path}: cannot write: {e.strerror or e}") from None
        self._last_fsync = time.monotonic()

    def _write_meta(self) -> None:
        meta = {"version": META_VERSION, "fingerprint": self.fingerprint}
        if self.created is not None:
            meta["created"] = self.created
        replace_file(meta_path(self.path), (json.dumps(meta, indent=1) + "\n").encode("utf-8"), fsync=True)

    def write(self, record: dict, key: Key | None = None, input_line: int = 0) -> None:
        """Append one record (key defaults to record_key(record)); `input_line`: the input line it answers
        (0: unknown; such records go after the others at finalize)."""
        global _writes_in_progress
        if self._fd is None:
            raise RuntimeError("OutputWriter.write before open()")
        key = key or record_key(record)
        line = _encode(record)
        # Blocked, a signal sent to this thread waits until the whole line is in the file. One sent to
        # another thread (torch's workers) still runs its Python handler here, between two bytecodes:
        # _writes_in_progress lets the handler defer its exit until the line is complete.
        old = _block(_SIGNALS)
        _writes_in_progress += 1
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self._remember(key, record, self._size, len(line), input_line)
            self._size += len(line)
            self.written += 1
            self.written_errors += is_error_record(record)
            now = time.monotonic()
            if now - self._last_fsync >= self.fsync_interval_s:
                os.fsync(self._fd)
                self._last_fsync = now
                self._lock.check_current()  # OUT deleted or replaced by hand: stop, write over nothing
        except OSError as e:
            raise PagedrunError(f"{self.path}: cannot write: {e.strerror or e}") from None
        finally:
            _writes_in_progress -= 1
            _unblock(old)
            if _pending_exit is not None and not _writes_in_progress:
                code, exit_now = _pending_exit
                exit_now(code)

    def close(self) -> None:
        """Close the file and let the lock go (a later run may resume)."""
        try:
            self._close_file()
        finally:
            self._lock.release()

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def locate(self, key: Key, input_line: int) -> None:
        """Record which input line a record of a previous run answers (the resume's pass over the inputs)."""
        e = self.done.find(key)
        if e >= 0:
            self.done.values[_LINE][e] = input_line

    def input_order(self) -> list[Key]:
        """The keys whose input line is known, in input order."""
        return [self.done.key_at(e) for e in self._input_order()]

    def _input_order(self) -> Iterable[int]:
        """The entries whose input line is known, in input order (ties in file order), as an array of
        entry numbers: 8 bytes a record, where sorting a list of keys would make an object of each."""
        lines = self.done.values[_LINE]
        entries = [e for e in self.done.entries() if lines[e]] if len(lines) < 4096 else None
        if entries is not None:  # small: sorted() is simplest
            return sorted(entries, key=lines.__getitem__)
        top = max(lines, default=0)
        by_line = array("q", [-1]) * (top + 1)  # each line answered once: a counting sort by line
        for e in self.done.entries():
            line = lines[e]
            if line:
                if by_line[line] >= 0:  # two records for one line: keep sorted()'s order for ties
                    return sorted((e for e in self.done.entries() if lines[e]), key=lines.__getitem__)
                by_line[line] = e
        return array("q", (e for e in by_line if e >= 0))

    def finalize(self, order: Iterable[Key] | None = None) -> None:
        """Rewrite in input order (input_order() unless `order` is given); the other keys go last, in
        file order. `order` may be a generator (it is read once). The lock stays held (the report is
        written next); close() lets it go."""
        entries = self._input_order() if order is None else (self.done.find(k) for k in order)
        self._close_file()
        try:
            self._rewrite(entries, rest=True)
        except OSError as e:
            raise PagedrunError(f"{self.path}: cannot write: {e.strerror or e}") from None

    def _rewrite(self, entries: Iterable[int], rest: bool = False) -> None:
        """Copy the records of `entries` (index entry numbers; -1 is skipped) (then, with rest=True,
        every other one in file order) to a new file; the index then points into it (records of
        neither are dropped)."""
        # Write aside, fsync, rename over: a crash at any point leaves either the old or the new file.
        tmp = temp_path(self.path)
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        t = self.done
        offsets, lengths, marks = t.values[_OFFSET], t.values[_LENGTH], t.marks
        try:
            with os.fdopen(fd, "wb") as out, self._read_locked() as src:
                at = 0

                def copy(e: int) -> None:
                    nonlocal at
                    src.seek(offsets[e])
                    line = src.read(lengths[e])
                    out.write(line)
                    # Updated in place (no second index): a copied entry's place is its new one,
                    # marked copied until the end.
                    offsets[e], lengths[e] = at, len(line)
                    marks[e] |= _COPIED
                    at += len(line)

                for e in entries:
                    if e >= 0 and not marks[e] & (_COPIED | DEAD):
                        copy(e)
                if rest:
                    for e in t.entries():  # no entry is added or removed meanwhile
                        if not marks[e] & _COPIED:
                            copy(e)
                out.flush()
                os.fsync(out.fileno())
                self._lock.replace(tmp, out.fileno())  # the lock moves to the new file with the name
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.path.parent)
        for e in t.entries():
            if marks[e] & _COPIED:
                marks[e] &= ~_COPIED
            else:  # not copied: gone from the file
                t.discard(t.key_at(e))
        t.compact()


def is_error_record(record: dict) -> bool:
    """An error record: pagedrun's (`error` set) or a batch output's failed line (a non-200 response)."""
    return is_failed_line(record)


def _created_of(record: object) -> int | None:
    """A batch output line's response.body.created, or None."""
    try:
        created = record["response"]["body"]["created"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return created if isinstance(created, int) and not isinstance(created, bool) else None


_writes_in_progress = 0
_pending_exit: tuple[int, Callable[[int], object]] | None = None


def exit_when_line_complete(code: int, exit_now: Callable[[int], object] = os._exit) -> None:
    """Exit at once, or, if a signal handler interrupted a line being written, right after it."""
    global _pending_exit
    if _writes_in_progress:
        _pending_exit = (code, exit_now)
    else:
        exit_now(code)


def _block(signals: set) -> object:
    if hasattr(signal, "pthread_sigmask"):  # POSIX; elsewhere a line may be cut by Ctrl-C+Ctrl-C
        return signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    return None


def _unblock(previous: object) -> None:
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
