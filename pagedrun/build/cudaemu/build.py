"""Compile a CUDA source with the emulation header into a shared library, with an on-disk cache.

Cache: $PAGEDRUN_CACHE (default ~/.cache/pagedrun)/cudaemu/<sha256>/module.so, keyed by the
source, options, name expressions, sanitizer, compiler version and the emulator headers; files the
source #includes are recorded with their hashes and checked on every load. A cached module is
loaded only if this user built it and it is unchanged (pagedrun/build/cache.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pagedrun.build.cache import CacheError, build_once, cache_base, private_dir
from pagedrun.build.cudaemu.errors import EmuError
from pagedrun.build.cudaemu.source import FoundKernel, find_kernels, rewrite

EMU_DIR = Path(os.environ.get("PAGEDRUN_EMU_DIR", Path(__file__).resolve().parents[3] / "kernels" / "emulator"))
CXX = os.environ.get("PAGEDRUN_EMU_CXX", "g++")
BASE_FLAGS = [
    "-std=c++20",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    # CUDA code type-puns through reinterpret_cast (float4 loads, half <-> ushort); nvcc tolerates it.
    "-fno-strict-aliasing",
    "-fno-threadsafe-statics",
    # Large stack frames probe every page, so a fiber overflowing its stack hits its guard page
    # instead of silently writing into the neighbouring fiber's stack.
    "-fstack-clash-protection",
    "-U_FORTIFY_SOURCE",  # longjmp out of a fiber after a fault must not trip __longjmp_chk
    "-Wl,-Bsymbolic",  # the module's __assert_fail wins over glibc's
]


@dataclass(frozen=True)
class BuiltModule:
    so_path: Path
    kernels: dict[str, str]  # get_function name -> launcher symbol suffix ("0", "1", ...)
    build_dir: Path


def cache_root() -> Path:
    """Where the modules normally go (build_cache.private_dir may pick `cudaemu-uid<uid>` instead)."""
    return cache_base() / "cudaemu"


@functools.lru_cache(maxsize=1)
def _toolchain_fingerprint() -> str:
    h = hashlib.sha256()
    try:
        h.update(subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout.encode())
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmuError(f"cannot run the C++ compiler {CXX!r} needed by the CUDA emulator: {e}") from e
    for p in sorted(EMU_DIR.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(EMU_DIR)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def translate_options(options: Sequence[str]) -> list[str]:
    """NVRTC/CuPy options -> g++ flags: keep -D/-U/-I (separate or joined), drop the rest."""
    out: list[str] = []
    it = iter(options)
    for opt in it:
        for long_, short in (("--define-macro", "-D"), ("--undefine-macro", "-U"), ("--include-path", "-I")):
            if opt.startswith(long_ + "="):
                opt = short + opt[len(long_) + 1 :]
            elif opt == long_:
                opt = short
        if opt in ("-D", "-U", "-I"):
            val = next(it, None)
            if val is None:
                raise EmuError(f"option {opt} needs a value")
            out.append(opt + val)
        elif opt[:2] in ("-D", "-U", "-I"):
            out.append(opt)
        # -std=, -arch=, --use_fast_math, -lineinfo, ...: meaningless for g++ here
    return out


@functools.lru_cache(maxsize=1)
def _machine_flags() -> list[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    # hardware float<->half conversion: same rounding as the software routine, much faster
    return ["-mf16c"] if re.search(r"\bf16c\b", cpuinfo) else []


def _sanitize_flags(sanitize: str | None) -> list[str]:
    if sanitize is None:
        # -O1 compiles faster, -O2 runs faster (docs/log/2026-11-27-figures-from-code-comments.md):
        # PAGEDRUN_EMU_OPT picks.
        return [os.environ.get("PAGEDRUN_EMU_OPT", "-O2")]
    if sanitize == "address":
        return ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address"]
    raise EmuError(f"sanitize={sanitize!r} is not supported (use None or 'address')")


def _first_errors(stderr: str, limit: int = 12) -> str:
    lines = stderr.splitlines()
    idx = [i for i, line in enumerate(lines) if "error" in line]
    if not idx:
        return "\n".join(lines[-limit:])
    start = max(0, idx[0] - 2)
    return "\n".join(lines[start : start + limit])


def _launcher_source(kernels: list[tuple[str, str]]) -> str:
    out = [
        "",
        '#line 1 "<cudaemu launchers>"',
        '#define CUDAEMU_EXPORT extern "C" __attribute__((visibility("default")))',
        "CUDAEMU_EXPORT unsigned long long cudaemu_static_shared_bytes() { return ::cudaemu::static_shared_bytes(); }",
    ]
    for i, (_, expr) in enumerate(kernels):
        out.append(
            f"CUDAEMU_EXPORT int cudaemu_launch_{i}(const ::cudaemu::LaunchCfg* c, void** a) "
            f"{{ return ::cudaemu::launch(&{expr}, c, a); }}"
        )
        out.append(f"CUDAEMU_EXPORT const char* cudaemu_sig_{i}() {{ return ::cudaemu::signature(&{expr}); }}")
    return "\n".join(out) + "\n"


def _hash_file(p: str) -> str:
    try:
        return hashlib.sha256(Path(p).read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _deps_fresh(meta: dict) -> bool:
    return all(_hash_file(p) == h for p, h in meta.get("deps", {}).items())


def build(
    code: str,
    name_expressions: Sequence[str],
    options: Sequence[str],
    sanitize: str | None,
    filename: str,
) -> BuiltModule:
    flags = translate_options(options) + _sanitize_flags(sanitize) + _machine_flags()
    key_src = json.dumps(
        [code, list(name_expressions), flags, sanitize, filename, _toolchain_fingerprint(), BASE_FLAGS]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]

    def fresh(entry: Path) -> bool:  # a compile error is cached too, as long as no included file changed
        try:
            return _deps_fresh(json.loads((entry / "meta.json").read_text()))
        except (OSError, ValueError, AttributeError):
            return False

    try:
        # Only a module this user built, unchanged since (build_cache.verify), is ever loaded.
        final = build_once(private_dir("cudaemu"), key,
                           lambda work: _compile(work, code, name_expressions, flags, filename), accept=fresh)
    except CacheError as e:
        raise EmuError(f"CUDA emulator cache: {e}") from None
    meta = json.loads((final / "meta.json").read_text())
    if "error" in meta:
        raise EmuError(meta["error"])
    return BuiltModule(final / "module.so", dict(meta["kernels"]), final)


def _user_deps(preprocessed: str, work: Path, filename: str) -> dict[str, str]:
    """Files the source #includes (from the preprocessor's line markers), with their hashes."""
    deps: dict[str, str] = {}
    for m in re.finditer(r'^# \d+ "((?:[^"\\]|\\.)*)"(.*)$', preprocessed, re.M):
        name, flags = m.group(1), m.group(2).split()
        if "3" in flags or name == filename or name.startswith("<") or name.startswith("/usr/"):
            continue
        p = os.path.abspath(os.path.join(work, name))
        if p.startswith(str(EMU_DIR)) or p.startswith(str(work)) or p in deps:
            continue
        deps[p] = _hash_file(p)
    return deps


def _compile(work: Path, code: str, name_expressions: Sequence[str], flags: list[str], filename: str) -> dict:
    src = work / "source.cu"
    src.write_text(f'#line 1 "{filename}"\n' + rewrite(code) + "\n")
    include = [f"-I{EMU_DIR / 'include'}", "-include", str(EMU_DIR / "cudaemu.h")]
    pre = subprocess.run(
        [CXX, "-x", "c++", "-std=c++20", *include, *flags, "-DCUDAEMU_DISCOVER", "-E", str(src)],
        capture_output=True,
        text=True,
        cwd=work,
    )
    if pre.returncode != 0:
        raise EmuError(f"preprocessing {filename} failed:\n{_first_errors(pre.stderr)}")
    deps = _user_deps(pre.stdout, work, filename)
    found: list[FoundKernel] = find_kernels(pre.stdout, EMU_DIR)
    kernels: list[tuple[str, str]] = [(k.name, k.qualified) for k in found]
    kernels += [(expr, expr.strip()) for expr in name_expressions]
    table = {name: str(i) for i, (name, _) in enumerate(kernels)}  # a name expression wins over a same-named kernel
    module = work / "module.cpp"
    module.write_text('#include "source.cu"\n' + _launcher_source(kernels))
    cmd = [CXX, *BASE_FLAGS, *include, *flags, f"-ffile-prefix-map={work}/=", str(module), "-o", str(work / "module.so")]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    meta: dict = {"kernels": table, "deps": deps, "filename": filename, "flags": flags}
    if res.returncode != 0:
        if "error" not in res.stderr:  # not a diagnosed compile error (killed, disk full...): do not cache
            raise EmuError(f"the C++ compiler failed on {filename}:\n{res.stderr[-3000:]}")
        meta["error"] = f"compiling {filename} for the CUDA emulator failed:\n{_first_errors(res.stderr)}"
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta
