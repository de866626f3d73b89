"""Every header of kernels/cpu/ is self-contained (issue 35): it compiles on its own, so it includes
what it uses and depends on nothing a .cpp defines before including it.

Each header is compiled alone (g++ -fsyntax-only -x c++ header.h) with the flags pagedrun/build/cpu.py
builds the kernels with (BASE_FLAGS, -I kernels/cpu), once for each ISA flag set machine_flags() can
pick (from the CPU flags that tell them apart), and once more as the tests' 8-wide GEMM build
(-DPR_GEMM_VEC8) on the widest. A header that needs something only an including .cpp provided fails
here under its name. The .cpp files and headers also keep their #includes at the top, ahead of any
code, so no header is included after names it might come to depend on.

Syntax only and in parallel: a few seconds. Skipped without the compiler pagedrun/build/cpu.py uses.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedrun.build import cpu as cpu_build

HEADERS = sorted(cpu_build.KERNEL_DIR.glob("*.h"))
SOURCES = sorted(cpu_build.KERNEL_DIR.glob("*.cpp")) + HEADERS

# /proc/cpuinfo flags of the CPUs machine_flags() tells apart, one ISA flag set each.
_AVX2 = "avx2 fma f16c"
_AVX512 = _AVX2 + " avx512f avx512bw avx512vl avx512dq"
CPUS = {
    "sse": "",
    "f16c": "f16c",  # AVX and F16C without AVX2 (Ivy Bridge): -mf16c alone
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 + " avx512_bf16",
    "amx": _AVX512 + " avx512_bf16 amx_tile amx_bf16",
}
# The tests' extra builds (-D flags they pass to cpu_build.build), on the ISA that has the most
# paths for them to switch off.
BUILDS = [(isa, ()) for isa in CPUS] + [("amx", ("-DPR_GEMM_VEC8",))]

needs_cxx = pytest.mark.skipif(shutil.which(cpu_build.compiler()) is None,
                               reason=f"no C++ compiler ({cpu_build.compiler()})")


def isa_flags(isa: str, monkeypatch) -> list[str]:
    """What cpu_build.machine_flags() passes on a CPU of this kind (PAGEDRUN_KERNEL_ISA lifted)."""
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "native")
    return cpu_build.machine_flags(f"flags\t\t: fpu sse sse2 {CPUS[isa]}\n")


def test_isa_flag_sets_are_distinct(monkeypatch):
    sets = [tuple(isa_flags(isa, monkeypatch)) for isa in CPUS]
    assert len(set(sets)) == len(sets), sets
    assert isa_flags("amx", monkeypatch)[-2:] == ["-mamx-tile", "-mamx-bf16"]


def syntax_check(path, flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [cpu_build.compiler(), *cpu_build.BASE_FLAGS, *flags, f"-I{cpu_build.KERNEL_DIR}", "-fsyntax-only",
           "-x", "c++", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True)


@needs_cxx
@pytest.mark.parametrize("isa,defines", BUILDS, ids=[isa + "".join(d) for isa, d in BUILDS])
def test_each_header_compiles_alone(isa, defines, monkeypatch):
    flags = isa_flags(isa, monkeypatch) + list(defines)
    probe = syntax_check(os.devnull, flags)
    if probe.returncode != 0:  # the compiler itself does not know these flags: it cannot build for this ISA
        pytest.skip(f"{cpu_build.compiler()} rejects {' '.join(flags)}: {probe.stderr.strip()[-300:]}")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda h: (h, syntax_check(h, flags)), HEADERS))
    failed = []
    for header, res in results:
        if res.returncode != 0:
            errors = [line for line in res.stderr.splitlines() if "error" in line][:8]
            failed.append(f"{header.name} does not compile alone ({isa}{''.join(defines)}: "
                          f"{' '.join(flags) or 'no -m flags'}):\n  " + "\n  ".join(errors))
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_includes_come_before_any_code(path):
    """#include lines only in the leading block of comments and preprocessor lines (an #if / #define
    among them is fine), never after a declaration."""
    code_seen = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text.startswith("#include") and code_seen:
            included = text.split(None, 1)[1].split("//")[0].strip()
            pytest.fail(f"{path.name}:{n} includes {included} after code (line {code_seen})")
        if text and not text.startswith(("//", "#")) and code_seen is None:
            code_seen = n
