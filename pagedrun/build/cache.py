"""The caches of things pagedrun builds for itself, and the one rule for trusting what is in them.

Three caches live under $PAGEDRUN_CACHE (default ~/.cache/pagedrun): `cpu_kernels/` (C++ libraries
loaded with ctypes), `build/cudaemu/` (emulated CUDA modules, loaded likewise) and `models/` (the converted
default model: safetensors, config, tokenizer, chat template). A library in there runs as the user
who loads it, and a tokenizer or chat template shapes every prompt, so an entry is used only if

  * its directory and each of its files are owned by the current user and writable by nobody else,
    and so is every directory above it up to the cache directory (0700, created by us);
  * the directories above the cache directory cannot be renamed by another user (owned by us or
    root, and not group/world-writable unless sticky, as /tmp), so nothing can be swapped in
    between the check and the load;
  * it holds exactly the files its build recorded in `manifest.json`, and each file's sha256 is the
    recorded one (files over REHASH_LIMIT, i.e. the default model's weights, which are data and
    never code, are checked by size and mtime instead of being read again on every run).

The cache directory's path is resolved once (private_dir), so a symbolic link in it (a
PAGEDRUN_CACHE in /tmp, say) is followed at the check and never again. A library is loaded by
load_library, which checks and loads one open file: the entry directory and the file are opened
without following links, the file's owner, mode, size and sha256 are checked on that descriptor,
and the dynamic loader is handed the descriptor itself (/proc/self/fd/N), never the path again, so
nothing swapped in between the check and the load is ever run.

An entry that fails is rebuilt; a cache directory another user owns is replaced by a private
`<kind>-uid<uid>` beside it; if neither is possible (a read-only cache, a foreign one) a CacheError
says why, and the caller turns the kernels off or stops with that line.

Builds happen in a `<key>.tmp.<random>` work directory (private, from mkdtemp) and are published by
renaming it into place, so a half-written entry is never visible; a killed build leaves only a work
directory, removed later by remove_stale_builds.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagedrun.errors import PagedrunError

MANIFEST = "manifest.json"
REHASH_LIMIT = 64 << 20
FIX_HINT = "set PAGEDRUN_CACHE to a directory only you can write"


class CacheError(PagedrunError):
    """A cache entry or directory pagedrun cannot trust or cannot write; str() is the reason."""


def current_uid() -> int:
    return os.getuid()  # a function, so the tests can play another user


def cache_base() -> Path:
    return Path(os.environ.get("PAGEDRUN_CACHE") or Path.home() / ".cache" / "pagedrun")


def private_dir(kind: str, base: Path | None = None) -> Path:
    """The directory of one cache (`cpu_kernels`, `cudaemu`, `models`): created 0700 if missing;
    `<kind>-uid<uid>` if another user owns `<kind>`. Raises CacheError when no private one can be had."""
    base = Path(base) if base is not None else cache_base()
    try:
        if not base.exists():
            base.parent.mkdir(parents=True, exist_ok=True)
            base.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot create the cache directory {base}: {e.strerror or e}") from None
    # Once: what is checked below and every path built on it name the same directories, however a
    # link on the way (PAGEDRUN_CACHE itself, say) is flipped later.
    base = base.resolve()
    st = os.stat(base)
    if "PAGEDRUN_CACHE" not in os.environ and st.st_uid == current_uid() and st.st_mode & 0o022:
        _tighten(base)  # ~/.cache/pagedrun made under umask 002
    why = _ancestors_unsafe(base)
    if why:
        raise CacheError(f"{why}; {FIX_HINT}")
    first = None
    for name in (kind, f"{kind}-uid{current_uid()}"):
        d = base / name
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise CacheError(f"cannot create {d}: {e.strerror or e}") from None
        why = _unsafe_dir(d)
        if why and why.endswith("writable by other users") and os.lstat(d).st_uid == current_uid():
            _tighten(d)  # ours: close it; what others may have put in is checked entry by entry
            why = _unsafe_dir(d)
        if why is None:
            return d
        first = first or why
    raise CacheError(f"{first}; {FIX_HINT}")


def build_once(root: Path, key: str, build: Callable[[Path], None],
               accept: Callable[[Path], bool] | None = None) -> Path:
    """root/key, verified; or built now by build(work_dir), recorded and published. `accept` may turn
    down a verified entry for reasons of its own (a changed dependency, an old format)."""
    final = root / key
    if os.path.lexists(final):
        why = verify(final)
        if why is None and (accept is None or accept(final)):
            return final
        try:
            _remove(final)
        except OSError as e:
            raise CacheError(f"{why or final}, and it cannot be removed: {e.strerror or e}; {FIX_HINT}") from None
    remove_stale_builds(root)
    try:
        work = Path(tempfile.mkdtemp(prefix=f"{key}.tmp.", dir=root))
    except OSError as e:
        raise CacheError(f"cannot write the cache {root}: {e.strerror or e}") from None
    try:
        build(work)
        write_manifest(work)
        try:
            os.rename(work, final)  # atomic publish; a concurrent build of the same key may have won
        except OSError:
            why = verify(final) if os.path.lexists(final) else f"{final}: could not be published"
            if why:
                raise CacheError(why) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def write_manifest(work: Path) -> None:
    """Record every file of a finished build (name -> sha256, size, mtime), written atomically."""
    files = {}
    for p in sorted(work.iterdir()):
        if p.name == MANIFEST or p.name.startswith(MANIFEST + "."):
            continue
        if p.is_symlink() or not p.is_file():
            raise CacheError(f"{p}: a build may only leave regular files")
        st = p.stat()
        if st.st_mode & 0o022:  # umask 002 and the like: nobody else may change what we will load
            os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o022)
        files[p.name] = {"sha256": _sha256(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = work / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    os.replace(tmp, work / MANIFEST)


def verify(entry: Path) -> str | None:
    """None if `entry` may be used (the rule in the module docstring), else why not, in one line."""
    why = _unsafe_dir(entry)
    if why:
        return why
    manifest = entry / MANIFEST
    why = _unsafe_file(manifest)
    if why:
        return why
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{manifest}: unreadable"
    present = {p.name for p in entry.iterdir()} - {MANIFEST}
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        return f"{entry}: " + (f"holds files its build did not write: {', '.join(extra)}" if extra
                               else f"lacks {', '.join(missing)}")
    for name, rec in files.items():
        p = entry / name
        why = _unsafe_file(p)
        if why:
            return why
        st = p.stat()
        try:
            if st.st_size != rec["size"]:
                return f"{p}: changed since it was built (size)"
            if st.st_size > REHASH_LIMIT:
                if st.st_mtime_ns != rec["mtime_ns"]:
                    return f"{p}: changed since it was built (mtime)"
            elif _sha256(p) != rec["sha256"]:
                return f"{p}: sha256 differs from the one its build recorded"
        except (KeyError, TypeError):
            return f"{manifest}: unreadable"
    return None


_loaded: list[int] = []  # descriptors of loaded libraries, open for the process's life (see load_library)


def load_library(path: Path, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    """ctypes.CDLL of the library `path` (in a cache entry build_once returned), loaded from the very
    file whose owner, mode and recorded sha256 were checked: see open_verified."""
    fd = open_verified(path)
    name = f"/proc/self/fd/{fd}"
    if not os.path.exists(name):  # no procfs: the path, checked just now (the entry is ours alone)
        name = str(path)
    try:
        lib = ctypes.CDLL(name, mode=mode)
    except BaseException:
        os.close(fd)
        raise
    # Never closed: the loader knows the library by this name, and a reused descriptor number
    # would make a later load of another library return this one.
    _loaded.append(fd)
    return lib


def open_verified(path: Path) -> int:
    """A descriptor of `path`, a file of a cache entry, once it is shown to be what the entry's build
    recorded: directory and file opened without following links, owned by us and writable by nobody
    else (checked on the descriptors), size and sha256 those of the manifest (read from the same
    directory descriptor). CacheError says why not."""
    entry = path.parent
    try:
        dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f"{entry}: {e.strerror or e}") from None
    try:
        why = _foreign(entry, os.fstat(dfd))
        if why:
            raise CacheError(why)
        files = _manifest_at(dfd, entry)
        rec = files.get(path.name)
        if not isinstance(rec, dict):
            raise CacheError(f"{path}: not recorded in {entry / MANIFEST}")
        fd = _open_own_file(dfd, path)
    finally:
        os.close(dfd)
    try:
        if os.fstat(fd).st_size != rec.get("size") or _sha256_fd(fd) != rec.get("sha256"):
            raise CacheError(f"{path}: changed since it was built (size or sha256)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_own_file(dfd: int, path: Path) -> int:
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as e:
        raise CacheError(f"{path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    why = f"{path}: is not a regular file" if not stat.S_ISREG(st.st_mode) else _foreign(path, st)
    if why:
        os.close(fd)
        raise CacheError(why)
    return fd


def _manifest_at(dfd: int, entry: Path) -> dict:
    fd = _open_own_file(dfd, entry / MANIFEST)
    try:
        with os.fdopen(fd, "rb") as f:
            files = json.loads(f.read(16 << 20))["files"]
        if not isinstance(files, dict):
            raise TypeError
        return files
    except (OSError, ValueError, KeyError, TypeError):
        raise CacheError(f"{entry / MANIFEST}: unreadable") from None


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 22, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def remove_stale_builds(root: Path, max_age_s: float = 3600.0) -> None:
    """Delete work directories of killed builds (older than max_age_s, so never a live build's)."""
    now = time.time()
    for p in root.glob("*.tmp.*"):
        try:
            if now - p.lstat().st_mtime > max_age_s and p.lstat().st_uid == current_uid():
                _remove(p)
        except OSError:
            pass


def _unsafe_dir(d: Path) -> str | None:
    try:
        st = os.lstat(d)
    except OSError as e:
        return f"{d}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{d}: is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d}: is not a directory"
    return _foreign(d, st)


def _unsafe_file(p: Path) -> str | None:
    try:
        st = os.lstat(p)
    except OSError as e:
        return f"{p}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{p}: is not a regular file"
    return _foreign(p, st)


def _foreign(p: Path, st: os.stat_result) -> str | None:
    if st.st_uid != current_uid():
        return f"{p}: owned by uid {st.st_uid}, not by you (uid {current_uid()})"
    if st.st_mode & 0o022:
        return f"{p}: writable by other users"
    return None


def _ancestors_unsafe(base: Path) -> str | None:
    """Why another user could rename something between `base` and /, or None."""
    for d in [base.resolve(), *base.resolve().parents]:
        try:
            st = os.stat(d)
        except OSError as e:
            return f"{d}: {e.strerror or e}"
        if st.st_uid not in (current_uid(), 0):
            return f"{d}: owned by uid {st.st_uid}, who could replace the cache"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{d}: writable by other users (and not sticky), who could replace the cache"
    return None


def _tighten(d: Path) -> None:
    try:
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) & ~0o022)
    except OSError:  # a read-only file system: the check that follows says why not
        pass


def _remove(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        p.unlink()
    else:
        shutil.rmtree(p)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
