"""sanitize="address": run launches of an AddressSanitizer build in a child process.

An ASan-instrumented library can only be loaded into a process whose first library is the ASan
runtime, which a normal `python3` is not. So each launch is shipped to a fresh
`python3 -m pagedrun.build.cudaemu.asan` started with LD_PRELOAD=libasan: the arrays go over in an .npz,
the kernel runs there, the arrays come back and are copied into the caller's arrays in place.
Arrays that are views of one another are copied separately (their aliasing is not preserved).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pagedrun.build.cache import load_library
from pagedrun.build.cudaemu.build import CXX, BuiltModule
from pagedrun.build.cudaemu.errors import EmuError, EmuLaunchError
from pagedrun.build.cudaemu.launch_cfg import LaunchCfg

_ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:halt_on_error=1:allocator_may_return_null=1:detect_stack_use_after_return=0"


@functools.lru_cache(maxsize=1)
def libasan_path() -> str:
    try:
        out = subprocess.run([CXX, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmuError(f"sanitize='address' needs {CXX} with libasan: {e}") from e
    if not os.path.isabs(out) or not os.path.exists(out):
        raise EmuError("sanitize='address' needs libasan (install the compiler's libasan package)")
    return os.path.realpath(out)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = libasan_path()
    env["ASAN_OPTIONS"] = _ASAN_OPTIONS
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _asan_summary(stderr: str) -> str:
    """The ASan report without runtime/emulator frames, plus what the region is when we know."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if "ERROR: AddressSanitizer" in line), None)
    if start is None:
        return "\n".join(lines[-20:])
    noise = ("/usr/include/c++", "kernels/emulator/", "libffi", "[stack]", "<cudaemu launchers>", "libasan",
             "asan_malloc", "cudaemu_fiber_start", "python")
    keep = [lines[start]]
    dyn_smem = False
    for line in lines[start + 1 :]:
        if line.startswith("SUMMARY") or line.startswith("Shadow bytes"):
            break
        if "cudaemu::run_grid" in line:
            dyn_smem = True
        if line.strip().startswith("#") and any(n in line for n in noise):
            continue
        if line.strip():
            keep.append(line)
    if dyn_smem:
        keep.append("(that region is the launch's dynamic shared memory, `extern __shared__`, sized by shared_mem)")
    return "\n".join(keep[:30])


class AsanRunner:
    """Runs launches of an ASan build in a child process (see the module docstring)."""

    def __init__(self, built: BuiltModule) -> None:
        self.built = built
        libasan_path()  # fail early when the compiler has no ASan runtime

    def launch(self, kernel: Any, cfg: Any, args: Sequence[Any], keep: Any, ptrs: Any) -> tuple[int, str]:
        index = self.built.kernels[kernel.name]
        with tempfile.TemporaryDirectory(prefix="cudaemu-asan-") as tmp:
            arrays = {}
            for i, a in enumerate(args):
                if kernel._params[i][0] == "p" and a is not None:
                    if not isinstance(a, np.ndarray):
                        raise EmuLaunchError(f"sanitize='address' launches take numpy arrays only (argument {i})")
                    arrays[f"a{i}"] = a
            np.savez(os.path.join(tmp, "in.npz"), **arrays)
            raw = [bytes(ctypes.string_at(ptrs[i], max(kernel._params[i][1], 8))) for i in range(len(args))]
            job = {
                "so": str(self.built.so_path),
                "index": index,
                "name": kernel.name,
                "grid": list(cfg.grid),
                "block": list(cfg.block),
                "shared_mem": cfg.shared_mem,
                "schedule": cfg.schedule,
                "poison_shared": cfg.poison_shared,
                "stack_bytes": cfg.stack_bytes,
                "timeout_s": cfg.timeout_s,
                "arrays": {i: f"a{i}" for i in range(len(args)) if f"a{i}" in arrays},
                "nulls": [i for i, a in enumerate(args) if a is None],
                "raw": [r.hex() for r in raw],
                "dir": tmp,
            }
            with open(os.path.join(tmp, "job.json"), "w") as f:
                json.dump(job, f)
            res = subprocess.run(
                [sys.executable, "-m", "pagedrun.build.cudaemu.asan", "run", tmp], capture_output=True, text=True, env=_child_env()
            )
            result_path = os.path.join(tmp, "result.json")
            if res.returncode != 0 or not os.path.exists(result_path):
                return 3, f"AddressSanitizer: kernel '{kernel.name}' made an invalid access:\n{_asan_summary(res.stderr)}"
            with open(result_path) as f:
                result = json.load(f)
            with np.load(os.path.join(tmp, "out.npz")) as out:
                for i, key in job["arrays"].items():
                    np.copyto(args[int(i)], out[key])
            return int(result["code"]), result["msg"]


def _child_main(argv: list[str]) -> int:
    tmp = argv[1]
    with open(os.path.join(tmp, "job.json")) as f:
        job = json.load(f)
    lib = load_library(Path(job["so"]), os.RTLD_LOCAL)  # the very file the cache checked
    launch = getattr(lib, f"cudaemu_launch_{job['index']}")
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(LaunchCfg), ctypes.c_void_p]
    with np.load(os.path.join(tmp, "in.npz")) as npz:
        arrays = {k: np.ascontiguousarray(npz[k]).copy() for k in npz.files}
    n = len(job["raw"])
    bufs = []
    ptrs = (ctypes.c_void_p * max(n, 1))()
    for i in range(n):
        key = job["arrays"].get(str(i))
        if key is not None:
            data = int(arrays[key].ctypes.data).to_bytes(8, "little")
        else:
            data = bytes.fromhex(job["raw"][i])
        b = ctypes.create_string_buffer(data, max(len(data), 16))
        bufs.append(b)
        ptrs[i] = ctypes.addressof(b)
    cfg = LaunchCfg()
    cfg.grid[:] = job["grid"]
    cfg.block[:] = job["block"]
    cfg.shared_mem = job["shared_mem"]
    cfg.schedule = job["schedule"]
    cfg.poison_shared = job["poison_shared"]
    cfg.stack_bytes = job["stack_bytes"]
    cfg.timeout_s = job["timeout_s"]
    name = job["name"].encode()
    cfg.kernel_name = name
    err = ctypes.create_string_buffer(16384)
    cfg.err = ctypes.addressof(err)
    cfg.err_len = 16384
    code = launch(ctypes.byref(cfg), ptrs)
    np.savez(os.path.join(tmp, "out.npz"), **arrays)
    with open(os.path.join(tmp, "result.json"), "w") as f:
        json.dump({"code": code, "msg": err.value.decode(errors="replace")}, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
