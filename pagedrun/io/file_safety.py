"""The files a run writes beside its output, and the rules that keep them from clobbering others.

For `-o OUT` a run writes OUT, `OUT.meta.json` (the job's fingerprint), `<OUT's stem>.report.json`
and, while it runs, `OUT.lock` (its pid, under an exclusive flock: a second run on the same OUT is
refused naming that pid) and hidden temporary files `.<name>.<pid>.tmp` that are renamed over the
real names. pagedrun writes regular files only:

  * OUT must be a new path or a regular file: a directory, device (/dev/null), FIFO or socket is
    refused, and so is a symbolic link (the final rename would replace the link, not its target,
    as `-o /dev/stdout` once replaced /dev/stdout);
  * a derived file that exists must be a regular file that pagedrun wrote (a meta with a
    fingerprint, a report with provenance, a lock holding a pid), and never an input of the run
    (the prompts file, the recipe) or OUT itself; --overwrite does not change this.

Every derived file is written to a new temporary file beside it (created exclusively, so never
through a link someone left there) and renamed into place.
"""
from __future__ import annotations

import json
import os
import re
import stat
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedrun.errors import PagedrunError

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked against each other
    fcntl = None

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_LOCK_TEXT = re.compile(rb"\A(pagedrun pid (\d+)\n)?\Z")


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def report_path(out: Path) -> Path:
    """outputs.jsonl -> outputs.report.json, beside it."""
    return out.with_name(out.stem + ".report.json")


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


def check_output(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse an -o that is not (or cannot become) a regular file of this run's own."""
    st = _lstat(out)
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise PagedrunError(f"{out}: is a symbolic link; -o must name a regular file or a new path (pagedrun "
                            "renames its final file over -o, which would replace the link, not its target)")
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise PagedrunError(f"{out}: is {kind}; -o must name a regular file or a new path")
    for p in inputs:
        if _same(st, p):
            raise PagedrunError(f"{out}: -o is {p}, an input of this run; choose another output path")


def check_derived(path: Path, what: str, out: Path, inputs: Iterable[Path],
                  recognise: Callable[[Path], bool] | None) -> None:
    """Refuse to run when `path` (the `what` of -o `out`) exists and is not pagedrun's to replace."""
    st = _lstat(path)
    if st is None:
        return
    tail = "move it away or choose another -o"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise PagedrunError(f"{path}: the {what} of -o {out} exists and is not a regular file; {tail}")
    for p in (*inputs, out):
        if _same(st, p):
            raise PagedrunError(f"{path}: the {what} of -o {out} would replace {p}; choose another -o")
    if recognise is not None and not recognise(path):
        raise PagedrunError(f"{path}: the {what} of -o {out} exists and was not written by pagedrun; {tail}")


def is_meta(path: Path) -> bool:
    data = _small_json(path, 1 << 20)
    return isinstance(data, dict) and "version" in data and isinstance(data.get("fingerprint"), dict)


def is_report(path: Path) -> bool:
    data = _small_json(path, 64 << 20)  # a local report (num_steps) or a Ray run's (replicas)
    return isinstance(data, dict) and "provenance" in data and ("num_steps" in data or "replicas" in data)


def is_lock(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(_LOCK_TEXT.match(f.read(64)))
    except OSError:
        return False


def replace_file(path: Path, data: bytes, fsync: bool = False) -> None:
    """Write `path` through a new temporary file beside it and an atomic rename."""
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)  # our own leftover (same pid); never followed, O_EXCL below
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_stale_temps(path: Path) -> None:
    """Temporary files of `path` left by killed runs (call it holding the lock: no live run's)."""
    pattern = re.compile(rf"\A\.{re.escape(path.name)}\.\d+\.tmp\Z")
    for p in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        st = _lstat(p)
        if pattern.match(p.name) and st is not None and stat.S_ISREG(st.st_mode):
            p.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


class OutputLock:
    """An exclusive flock on OUT.lock, held for the whole run; the file says the holder's pid."""

    def __init__(self, out: Path) -> None:
        self.path = lock_path(out)
        self._fd: int | None = None
        if fcntl is None:
            return
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    m = _LOCK_TEXT.match(os.pread(fd, 64, 0))
                    os.close(fd)
                    pid = m.group(2).decode() if m and m.group(2) else "unknown"
                    raise PagedrunError(f"{out}: in use by another pagedrun run (pid {pid}, lock {self.path}); "
                                        "wait for it to finish or choose another -o") from None
                except BaseException:
                    os.close(fd)
                    raise
                # A run that finishes unlinks its lock file: make sure ours is still the one at the path.
                try:
                    if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                        break
                except FileNotFoundError:
                    pass
                os.close(fd)
            else:
                raise PagedrunError(f"{out}: cannot take the lock {self.path}")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pagedrun pid {os.getpid()}\n".encode(), 0)
        except OSError as e:
            raise PagedrunError(f"{out}: cannot write: {e.strerror or e}") from None
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)  # released with the writer, if never explicitly

    def release(self) -> None:
        if self._fd is None:
            return
        self._fd = None
        try:
            self.path.unlink()  # before unlocking: a run that opened it re-checks the inode
        except OSError:
            pass
        self._close()


def _lstat(p: Path) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except OSError:  # missing, or its directory is not one: writing it will say so
        return None


def _same(st: os.stat_result, p: Path) -> bool:
    try:
        other = os.stat(p)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _small_json(path: Path, limit: int) -> object:
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            return None
        return json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
