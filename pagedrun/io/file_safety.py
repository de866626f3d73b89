"""The files a run writes beside its output, and the rules that keep them from clobbering others.

For `-o OUT` a run writes OUT, `OUT.meta.json` (the job's fingerprint), `OUT.report.json`
and, while it runs, `OUT.lock` (the holder's pid, host and start time: a note, for the message a
second run gives; the exclusive flock that refuses that run is on OUT itself, see OutputLock) and
hidden temporary files `.<name>.<pid>.tmp` that are renamed over the real names. pagedrun writes
regular files only:

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
import socket
import stat
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pagedrun.errors import PagedrunError

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked against each other
    fcntl = None

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
# The holder's note; older runs wrote only the pid.
_LOCK_TEXT = re.compile(rb"\A(pagedrun pid (?P<pid>\d+)"
                        rb"(?: host (?P<host>\S{1,100}) started (?P<started>\S{1,40}))?\n)?\Z")


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def report_path(out: Path) -> Path:
    """outputs.jsonl -> outputs.jsonl.report.json, beside it: by OUT's whole name, as the meta and lock
    files, so that two outputs never share one (by the stem, res.json and res.jsonl both wrote res.report.json)."""
    return out.with_name(out.name + ".report.json")


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


def check_plot(plot: Path, out: Path, inputs: Iterable[Path]) -> None:
    """Refuse a --plot path before the run, by the rules of -o's derived files: a regular file or a new
    path (never a link, directory, device), never an input of the run, OUT or a file beside it that
    the run writes, an existing file only if it is a PNG (one pagedrun drew), in a directory that
    exists or can be made. Checked again when it is written (write_plot), through temp + rename."""
    ours = [meta_path(out), report_path(out), lock_path(out), out]
    inputs = tuple(inputs)
    for p in ours:
        if _spelled_same(plot, p):
            raise PagedrunError(f"{plot}: --plot is the {_derived_name(out, p)} of -o {out}; choose another --plot")
    for p in inputs:  # by name too: "sub/../req.png" names req.png once sub/ is made
        if _spelled_same(plot, p):
            raise PagedrunError(f"{plot}: --plot would replace {p}, a file of this run; choose another --plot")
    st = _lstat(plot)
    if st is None:
        _check_parent(plot)
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise PagedrunError(f"{plot}: --plot exists and is not a regular file (a link, directory or device); "
                            "choose another --plot")
    for p in (*inputs, *ours):
        if _same(st, p):
            raise PagedrunError(f"{plot}: --plot would replace {p}, a file of this run; choose another --plot")
    if not is_png(plot):
        raise PagedrunError(f"{plot}: --plot exists and is not a PNG; move it away or choose another --plot")


def is_png(path: Path) -> bool:
    try:
        with open(path, "rb", opener=_nofollow) as f:
            head = f.read(8)
    except OSError:
        return False
    return head in (b"", b"\x89PNG\r\n\x1a\n")  # empty: a draw that died before its first byte


def _nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _spelled_same(a: Path, b: Path) -> bool:
    """The same path once the directories are resolved (the files need not exist)."""
    try:
        return a.parent.resolve() / a.name == b.parent.resolve() / b.name
    except OSError:
        return False


def _derived_name(out: Path, p: Path) -> str:
    return {meta_path(out): "meta file", report_path(out): "report", lock_path(out): "lock file"}.get(p, "output")


def _check_parent(path: Path) -> None:
    """The nearest existing directory above `path` must be one, and writable (the rest is made)."""
    parent = path.parent
    while _lstat(parent) is None and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PagedrunError(f"{path}: cannot be written: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PagedrunError(f"{path}: cannot be written: no permission to write in {parent}")


def is_meta(path: Path) -> bool:
    data = _small_json(path, 1 << 20)
    return isinstance(data, dict) and "version" in data and isinstance(data.get("fingerprint"), dict)


def is_report(path: Path) -> bool:
    data = _small_json(path, 64 << 20)  # a local report (num_steps) or a Ray run's (replicas)
    return isinstance(data, dict) and "provenance" in data and ("num_steps" in data or "replicas" in data)


def is_lock(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(_LOCK_TEXT.match(f.read(256)))
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


@dataclass(frozen=True)
class LockHolder:
    """Who holds an output: what OUT.lock says (for the message only; the lock is on OUT itself)."""
    pid: str = "unknown"
    host: str = "unknown host"
    started: str = "unknown time"

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


class OutputLock:
    """An exclusive flock on OUT itself, held for the whole run, and moved with it when OUT is renamed
    over (replace()): whichever inode the path names is locked while a run lives, so no file a user
    can delete (OUT.lock is only the holder's note: pid, host, start time) lets a second run in.

    A run whose OUT is deleted or replaced under it notices (is_current()) and stops instead of
    writing over the new file. A missing OUT is created empty to be locked; a run refused before it
    opens for writing removes it again (kept_open() says it is the run's output from then on)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = lock_path(out)  # the note
        self.fd: int | None = None
        self._created = False
        self._note = b""
        if fcntl is None:
            return
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                fd, created = _open_output(out)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = read_holder(self.path, os.fstat(fd))
                    os.close(fd)
                    raise PagedrunError(f"{out}: in use by another pagedrun run ({holder}; see {self.path.name}); "
                                        "wait for it to finish or choose another -o") from None
                except BaseException:
                    os.close(fd)
                    raise
                # The path may have moved on while we waited for the lock (a run renamed its final
                # file over it, or removed the empty file it had created): lock the one there now.
                if _same_fd(out, fd):
                    break
                os.close(fd)
            else:
                raise PagedrunError(f"{out}: cannot take the lock on it (it keeps being replaced)")
            self.fd, self._created = fd, created
            self._close = weakref.finalize(self, os.close, fd)  # released with the writer, if never explicitly
            self._note = (f"pagedrun pid {os.getpid()} host {socket.gethostname() or 'unknown'} started "
                          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n").encode()
            replace_file(self.path, self._note)
        except OSError as e:
            self.release()
            raise PagedrunError(f"{out}: cannot write: {e.strerror or e}") from None
        except BaseException:
            self.release()
            raise

    def kept_open(self) -> None:
        """The run writes OUT from now on: it stays, even empty."""
        self._created = False

    def is_current(self) -> bool:
        """Whether OUT still names the locked file (False: deleted or replaced during the run)."""
        return self.fd is None or _same_fd(self.out, self.fd)

    def check_current(self) -> None:
        if not self.is_current():
            raise PagedrunError(f"{self.out}: was deleted or replaced during the run; stopping so as not to "
                                "write over another file (this run's outputs went with the one it replaced)")

    def replace(self, tmp: Path, tmp_fd: int) -> None:
        """os.replace(tmp, OUT), the lock moving with it: the new file is locked before it takes the
        name, the old one let go after, so no moment leaves the name unlocked."""
        if self.fd is None:
            os.replace(tmp, self.out)
            return
        new = os.dup(tmp_fd)
        try:
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours alone: created O_EXCL
            self.check_current()
            os.replace(tmp, self.out)
        except BaseException:
            os.close(new)
            raise
        old, self.fd = self.fd, new
        self._close.detach()
        self._close = weakref.finalize(self, os.close, new)
        os.close(old)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if is_own_note(self.path, self._note):
                self.path.unlink()  # before unlocking: the next holder writes its own
            if self._created and os.fstat(self.fd).st_size == 0 and self.is_current():
                self.out.unlink()  # a refused run leaves no empty OUT (a run that opens it re-checks the inode)
        except OSError:
            pass
        self.fd = None
        if hasattr(self, "_close"):
            self._close()


def _open_output(out: Path) -> tuple[int, bool]:
    """OUT opened read-write, never through a link, created if missing: (fd, created)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(10):
        try:
            fd, created = os.open(out, flags), False
        except FileNotFoundError:
            try:
                fd, created = os.open(out, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                continue
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for a FIFO or device since check_output
            os.close(fd)
            raise PagedrunError(f"{out}: is not a regular file; -o must name a regular file or a new path")
        return fd, created
    raise PagedrunError(f"{out}: cannot open it (it keeps being created and removed)")


def _same_fd(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def read_holder(note: Path, locked: os.stat_result) -> LockHolder:
    """Who holds the lock on `locked`: the kernel's lock table names the pid (Linux); the OUT.lock note
    adds host and start time when it is that pid's (a note deleted or left by another run is not)."""
    try:
        with open(note, "rb") as f:
            m = _LOCK_TEXT.match(f.read(256))
    except OSError:
        m = None
    pid = _flock_pid(locked)
    if m and m.group(2) and pid in ("unknown", m["pid"].decode()):
        return LockHolder(m["pid"].decode(), (m["host"] or b"unknown host").decode(errors="replace"),
                          (m["started"] or b"unknown time").decode(errors="replace"))
    return LockHolder(pid=pid)


def _flock_pid(st: os.stat_result) -> str:
    """The pid /proc/locks gives for a flock on the file `st` (Linux), else "unknown"."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == want:
                    return parts[4]
    except OSError:
        pass
    return "unknown"


def is_own_note(path: Path, note: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(note) + 1) == note
    except OSError:
        return False


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
