"""pagedrun/worker/malloc_tuning.py: the glibc settings the CPU engine applies, and what they do.

Each case runs in a fresh interpreter: mallopt changes the whole process. What is asserted is
glibc's documented behaviour for one allocation the script makes itself with malloc, read back
with mallinfo2 (mmapped bytes, heap bytes) and getrusage (page faults of the script's own memset):
counts of the script's own pages, the same on any machine and under any load. How many faults a
real run saves depends on torch's allocation history and the kernel (transparent huge pages), so it
is measured in docs/design/memory.md, not asserted here.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc-only settings")

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SIZE = 16 * MIB  # an activation-sized block: above glibc's default mmap threshold, below ours

# First 160 blocks of 100 KiB (below every mmap threshold: always heap), written and freed top-down;
# then one 16 MiB malloc, written, freed, malloc'd and written again. No torch: nothing else in the
# process allocates between the readings (the list of pointers is made beforehand).
SCRIPT = """
import ctypes, ctypes.util, json, mmap, resource
from pagedrun.worker.malloc_tuning import tune_glibc_malloc
settings = tune_glibc_malloc()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Mallinfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
SIZE, SMALL, N_SMALL = %d, 100 << 10, 160
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ptrs = [0] * N_SMALL
m0 = libc.mallinfo2()
for i in range(N_SMALL):
    ptrs[i] = libc.malloc(SMALL)
    ctypes.memset(ptrs[i], 1, SMALL)
m1 = libc.mallinfo2()
for q in reversed(ptrs):
    libc.free(q)
m2 = libc.mallinfo2()
p = libc.malloc(SIZE)
ctypes.memset(p, 1, SIZE)
m3 = libc.mallinfo2()
libc.free(p)
f0 = faults()
p = libc.malloc(SIZE)
ctypes.memset(p, 1, SIZE)
f1 = faults()
libc.free(p)
print(json.dumps({"settings": settings, "small_heap_growth": m1.arena - m0.arena,
                  "small_heap_returned": m1.arena - m2.arena, "mmapped": m3.hblkhd - m2.hblkhd,
                  "heap_used": m3.uordblks - m2.uordblks, "refaults": f1 - f0, "pages": SIZE // mmap.PAGESIZE}))
""" % SIZE


def _run(tuning: str) -> dict:
    env = dict(os.environ, PAGEDRUN_MALLOC_TUNING=tuning,
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_settings_applied_and_freed_activations_stay_in_the_heap():
    tuned, default = _run("1"), _run("0")
    assert tuned["settings"] == {"mmap_threshold_bytes": 32 << 20, "trim_threshold_bytes": 512 << 20}
    assert default["settings"] is None  # PAGEDRUN_MALLOC_TUNING=0: glibc's defaults

    # M_TRIM_THRESHOLD=512 MiB: 16 MiB freed at the top of the heap stays there for the next step.
    # (The heap grows by the 16 MiB of small blocks less what free space it already had: a few
    # hundred KiB after start-up, so at least half.)
    assert tuned["small_heap_growth"] >= 8 * MIB and tuned["small_heap_returned"] == 0, tuned
    # M_MMAP_THRESHOLD=32 MiB: a 16 MiB block comes from the heap, not from a fresh mmap...
    assert tuned["mmapped"] == 0 and tuned["heap_used"] >= SIZE, tuned
    # ...so writing it again after free touches pages already mapped: no fault per page. The bound
    # (an eighth of its 4,096 pages) leaves room for the interpreter's own few faults between the
    # two readings; a block that comes back fresh faults in every page (or, with transparent huge
    # pages, every 2 MiB: 8 faults, which is why the default run's count is not asserted).
    assert tuned["refaults"] < tuned["pages"] // 8, tuned

    # glibc's defaults, for contrast (the assertions above can fail): the freed top of the heap is
    # above the default 128 KiB trim threshold, so free() gives most of it back; 16 MiB is above
    # the default 128 KiB mmap threshold, which rises only when an mmapped block that large is
    # freed (the script frees none before).
    assert default["small_heap_returned"] >= default["small_heap_growth"] // 2 > 0, default
    assert default["mmapped"] >= SIZE and default["heap_used"] < SIZE, default


def test_the_cpu_engine_applies_them(tmp_path):
    from tiny_models import make_tiny_model

    from pagedrun.llm import LLM
    from pagedrun.worker.malloc_tuning import tune_glibc_malloc

    model_dir = make_tiny_model("llama", tmp_path / "m")
    llm = LLM(None, [f"model.path={model_dir}", "model.device=cpu", "cache.num_blocks=16"])
    assert llm.engine.worker.malloc_tuning == tune_glibc_malloc() is not None
