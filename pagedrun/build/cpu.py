"""Build the C++ CPU kernels (kernels/cpu/*.cpp) into shared libraries loaded through ctypes.

Each source is compiled on first use with the system C++ compiler into
$PAGEDRUN_CACHE (default ~/.cache/pagedrun)/cpu_kernels/<sha256 of source, flags, compiler>/, built
in a temporary directory and published with an atomic rename, so concurrent processes never load a
half-written library; a cached library is loaded only if this user built it and it is unchanged
(pagedrun/build/cache.py). The .so is built per machine (-mavx2 -mfma -mf16c, then -mavx512f/bw/vl/dq and
-mavx512bf16, -mamx-tile -mamx-bf16, each only when this CPU has them).

No torch extension machinery: the libraries take raw data pointers and int64 sizes, so each builds in
about a second and needs nothing but g++ (or $PAGEDRUN_CXX).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from pagedrun.build.cache import CacheError, build_once, private_dir

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
# -fno-trapping-math lets g++ if-convert selects (no result changes, only FP-exception assumptions);
# no -ffast-math: reductions keep a fixed order. g++ contracts a*b+c into FMAs in C++ by default (the
# attention kernel's dot products rely on it); a source that must round like torch passes
# -ffp-contract=off through build()'s extra_flags.
BASE_FLAGS = ["-O3", "-std=c++17", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-fvisibility=hidden",
              "-Wno-psabi"]


def compiler() -> str:
    return os.environ.get("PAGEDRUN_CXX", "g++")


# PAGEDRUN_KERNEL_ISA caps what the kernels are built for, to run an older CPU's code paths on a newer
# one (benchmarks: bf16 on an AVX2-only core, say): each level also takes away everything above it.
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ISA_LEVELS = {"sse": frozenset(), "avx2": _AVX2, "avx512": _AVX512, "avx512_bf16": _AVX512 | {"avx512_bf16"}}


def isa_cap() -> frozenset[str] | None:
    """The flags PAGEDRUN_KERNEL_ISA allows (None: unset or "native", everything the CPU has)."""
    level = os.environ.get("PAGEDRUN_KERNEL_ISA", "native").strip().lower()
    if level in ("", "native"):
        return None
    if level not in ISA_LEVELS:
        raise CacheError(f"PAGEDRUN_KERNEL_ISA={level!r}: expected native or one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[level]


def machine_flags(cpuinfo: str | None = None) -> list[str]:
    """x86 SIMD flags this CPU supports (the .so never leaves the machine that built it), capped by
    PAGEDRUN_KERNEL_ISA."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    found = set(re.findall(r"\b(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512dq|avx512_bf16|amx_tile|amx_bf16)\b", cpuinfo))
    cap = isa_cap()
    if cap is not None:
        found &= cap
    flags = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= found else []
    if "f16c" in found:
        flags.append("-mf16c")
    # AVX-512 doubles the vector width the kernels are written for (kernels/cpu/simd.h picks it);
    # bf16 dot products (vdpbf16ps) where the CPU has them.
    if flags and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= found:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if "avx512_bf16" in found:
            flags.append("-mavx512bf16")
        # AMX tiles for the bf16 GEMM (kernels/cpu/amx_bf16.h), Sapphire Rapids and later.
        if {"amx_tile", "amx_bf16"} <= found:
            flags += ["-mamx-tile", "-mamx-bf16"]
    return flags


def disabled(env_var: str) -> bool:
    """True when env_var says 0/false/no/off (benchmarks compare both paths with it)."""
    return os.environ.get(env_var, "1").strip().lower() in ("0", "false", "no", "off")


def load(env_var: str, source: Path, wrap, extra_flags: tuple[str, ...] = ()):
    """(wrap(library), None), or (None, why) when env_var turns the kernels off or building or
    loading them fails (no compiler, compile error, a cache that cannot be written or trusted,
    unloadable .so): the caller falls back to torch. status() says it at start-up."""
    lib, why = None, f"disabled by {env_var}"
    if not disabled(env_var):
        try:
            lib, why = wrap(build(source, extra_flags)), None
        except CacheError as e:
            why = str(e)
        except Exception as e:
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
    _outcomes[source.stem] = why
    return lib, why


_outcomes: dict[str, str | None] = {}  # library (source stem) -> None when loaded, else why not


def status() -> str | None:
    """'on', 'off (<why>)' or 'partly off (<library>: <why>)' for the libraries load() was asked for,
    None if it was asked for none (a GPU run)."""
    if not _outcomes:
        return None
    off = {name: why for name, why in _outcomes.items() if why is not None}
    if not off:
        return "on"
    off = {name: why if len(why) <= 300 else why[:297] + "..." for name, why in off.items()}
    if len(off) == len(_outcomes) and len(set(off.values())) == 1:
        return f"off ({next(iter(off.values()))})"
    word = "off" if len(off) == len(_outcomes) else "partly off"
    return f"{word} ({'; '.join(f'{name}: {why}' for name, why in sorted(off.items()))})"


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the compiled library (<source stem>.so), compiling it if this (source, flags,
    compiler) is new."""
    code = source.read_bytes()
    # The kernels' shared headers (kernels/cpu/*.h) are part of what is compiled, so of the key.
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    lib_name = source.stem + ".so"
    flags = BASE_FLAGS + list(extra_flags) + machine_flags()
    cxx = compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    key = hashlib.sha256(b"\0".join([code, *headers, " ".join(flags).encode(), cxx.encode(),
                                      version.encode()])).hexdigest()

    def compile_into(work: Path) -> None:
        src = work / source.name
        src.write_bytes(code)
        res = subprocess.run([cxx, *flags, f"-I{source.parent}", str(src), "-o", str(work / lib_name)],
                             capture_output=True, text=True, cwd=work)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {res.stderr.strip()[-2000:]}")

    # Only a library this user built, unchanged since (build_cache.verify), is ever loaded.
    return build_once(private_dir("cpu_kernels"), key[:32], compile_into) / lib_name
