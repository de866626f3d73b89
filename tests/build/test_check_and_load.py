"""Check and load are the same file (issue 40, item 6): the cache path is resolved once, and a library
is loaded from the descriptor whose owner, mode and sha256 were checked, so nothing swapped in at the
path, in the entry or in PAGEDRUN_CACHE between the check and the dlopen is ever run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from pagedrun.build import cache as build_cache
from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import CacheError, load_library

SOURCE = 'extern "C" __attribute__((visibility("default"))) int answer() { return %d; }\n'
pytestmark = pytest.mark.skipif(shutil.which(cpu_build.compiler()) is None, reason="no C++ compiler")


def compile_lib(tmp_path, value: int) -> bytes:
    src = tmp_path / f"lib{value}" / "answer.cpp"
    src.parent.mkdir(exist_ok=True)
    src.write_text(SOURCE % value)
    subprocess.run([cpu_build.compiler(), "-shared", "-fPIC", str(src), "-o", str(src.with_suffix(".so"))],
                   check=True, capture_output=True)
    return src.with_suffix(".so").read_bytes()


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A library answering `value`, built into a fresh cache: (its path, a factory of other bytes)."""
    monkeypatch.setenv("PAGEDRUN_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src" / "answer.cpp"
    src.parent.mkdir()
    value = 1000  # a new file per test: the loader never reuses one this process loaded
    src.write_text(SOURCE % value)
    return cpu_build.build(src), value


def record(entry, name, data: bytes) -> None:
    """Rewrite the entry's manifest so that it records `data` for `name` (what a same-user plant could do)."""
    m = json.loads((entry / build_cache.MANIFEST).read_text())
    import hashlib

    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "mtime_ns": 0}
    (entry / build_cache.MANIFEST).write_text(json.dumps(m))


def test_the_verified_library_loads(built):
    so, value = built
    assert load_library(so).answer() == value


@pytest.mark.parametrize("swap", ["renamed-over", "rewritten-in-place", "symlink", "made-writable",
                                  "dir-symlink", "manifest-symlink", "removed"])
def test_a_library_changed_after_its_build_is_refused_at_load(built, tmp_path, swap):
    so, _ = built
    evil = compile_lib(tmp_path, 666)
    entry = so.parent
    if swap == "renamed-over":
        (entry / "x").write_bytes(evil)
        os.replace(entry / "x", so)
    elif swap == "rewritten-in-place":
        so.write_bytes(evil)
    elif swap == "symlink":  # a link to a file whose bytes the manifest records
        (tmp_path / "evil.so").write_bytes(evil)
        so.unlink()
        so.symlink_to(tmp_path / "evil.so")
        record(entry, so.name, evil)
    elif swap == "made-writable":
        so.chmod(0o666)
    elif swap == "dir-symlink":  # the entry swapped for a link to a copy that records the evil bytes
        copy = tmp_path / "copy"
        shutil.copytree(entry, copy)
        (copy / so.name).write_bytes(evil)
        record(copy, so.name, evil)
        shutil.rmtree(entry)
        entry.symlink_to(copy)
    elif swap == "manifest-symlink":
        (tmp_path / "m.json").write_text((entry / build_cache.MANIFEST).read_text())
        (entry / build_cache.MANIFEST).unlink()
        (entry / build_cache.MANIFEST).symlink_to(tmp_path / "m.json")
    else:
        so.unlink()
    with pytest.raises(CacheError):
        load_library(so)


def test_a_file_swapped_between_the_check_and_the_load_is_not_the_one_loaded(built, tmp_path, monkeypatch):
    so, value = built
    evil = compile_lib(tmp_path, 667)
    real = build_cache._sha256_fd

    def hash_then_swap(fd):  # the race, at its worst moment: the check passed, the load comes next
        digest = real(fd)
        (so.parent / "x").write_bytes(evil)
        os.replace(so.parent / "x", so)
        return digest

    monkeypatch.setattr(build_cache, "_sha256_fd", hash_then_swap)
    assert load_library(so).answer() == value  # the checked file, not what the path names now


def test_a_flipped_cache_link_is_followed_once(tmp_path, monkeypatch):
    """PAGEDRUN_CACHE a link: what was built and checked through it is loaded, wherever it points later."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    link.symlink_to(mine)
    monkeypatch.setenv("PAGEDRUN_CACHE", str(link))
    src = tmp_path / "src" / "answer.cpp"
    src.parent.mkdir()
    src.write_text(SOURCE % 4242)
    so = cpu_build.build(src)
    assert mine in so.parents and link not in so.parents  # resolved once
    # The same entry planted under the other directory, recording evil bytes, and the link flipped.
    shutil.copytree(mine / "cpu_kernels", other / "cpu_kernels")
    planted = other / so.relative_to(mine)
    evil = compile_lib(tmp_path, 668)
    planted.write_bytes(evil)
    record(planted.parent, planted.name, evil)
    link.unlink()
    link.symlink_to(other)
    assert load_library(so).answer() == 4242
    assert build_cache.private_dir("cpu_kernels") == other / "cpu_kernels"  # a new lookup resolves anew


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="no procfs")
def test_the_loader_is_handed_the_descriptor_not_the_path(built):
    so, value = built
    lib = load_library(so)
    fd = build_cache._loaded[-1]
    assert lib._name == f"/proc/self/fd/{fd}" and os.readlink(lib._name) == str(so)
    assert lib.answer() == value
