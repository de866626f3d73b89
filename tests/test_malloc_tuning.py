"""pagedrun/malloc_tuning.py: the glibc settings the CPU engine applies, and what they are for.

Each case runs in a fresh interpreter: mallopt changes the whole process, and the page-fault counts
must not depend on what earlier tests left in this one's heap.
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

ROOT = Path(__file__).resolve().parents[1]

# A step-like pattern: activations of varied sizes (1-25 MiB) allocated, written and freed in an
# overlapping order, twenty times. Prints the settings applied and the page faults of the 20 steps.
SCRIPT = """
import json, resource, torch
from pagedrun.malloc_tuning import tune_glibc_malloc
settings = tune_glibc_malloc()
def step(sizes):
    held = []
    for i, mb in enumerate(sizes):
        t = torch.empty(int(mb * 2**20) // 4)
        t.fill_(1.0)
        held.append(t)
        if i % 2:
            held.pop(0)
step([1, 3, 6, 25, 8, 12, 25, 4])
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(20):
    step([1 + k % 3, 3, 6, 25, 8, 12, 25, 4, 2 + k % 5, 20])
print(json.dumps({"settings": settings,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _run(tuning: str) -> dict:
    env = dict(os.environ, PAGEDRUN_MALLOC_TUNING=tuning,
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_settings_applied_and_steps_stop_faulting_in_fresh_pages():
    tuned, default = _run("1"), _run("0")
    assert tuned["settings"] == {"mmap_threshold_bytes": 32 << 20, "trim_threshold_bytes": 512 << 20}
    assert default["settings"] is None  # PAGEDRUN_MALLOC_TUNING=0: glibc's defaults
    # The 20 steps allocate ~2.3 GB in all; with glibc's moving thresholds much of it arrives on fresh
    # pages (24,577 faults when written), with the fixed ones the heap's pages are reused (6,400).
    assert tuned["faults"] * 2 < default["faults"], (tuned, default)


def test_the_cpu_engine_applies_them(tmp_path):
    from pagedrun.engine.llm import LLM
    from pagedrun.malloc_tuning import tune_glibc_malloc
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "m")
    llm = LLM(None, [f"model.path={model_dir}", "model.device=cpu", "cache.num_blocks=16"])
    assert llm.engine.malloc_tuning == tune_glibc_malloc() is not None
