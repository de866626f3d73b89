"""EmuModule / EmuKernel: the cupy.RawModule / RawKernel look-alikes that run kernels on the CPU."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Sequence

import numpy as np

from pagedrun.build.cache import load_library
from pagedrun.build.cudaemu.build import BuiltModule, build
from pagedrun.build.cudaemu.errors import EmuDeadlockError, EmuError, EmuLaunchError
from pagedrun.build.cudaemu.launch_cfg import LaunchCfg

SCHEDULES = {"round_robin": 0, "greedy": 1}
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024  # CUDA's limit without the opt-in attribute
MAX_OPT_IN_SHARED = 227 * 1024  # sm_90's opt-in maximum (232448 bytes)
_ERR_LEN = 16384
# The runtime's globals (thread/block indices, scheduler) are per library, not per OS thread,
# and fault handlers are process-wide: one launch at a time.
_LAUNCH_LOCK = threading.Lock()


_KIND_NAMES = {"p": "pointer", "f": "float", "i": "int", "u": "uint", "b": "bool", "o": "struct"}


def _describe(kind: str, size: int) -> str:
    if kind in "fiu":
        return f"{_KIND_NAMES[kind]}{size * 8}"
    if kind == "p":
        return "a pointer (pass a numpy array)"
    return f"{_KIND_NAMES.get(kind, kind)} of {size} bytes"


def _dims(v: Any, what: str) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    t = tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise EmuLaunchError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    return (t + (1, 1))[:3]  # type: ignore[return-value]


class EmuKernel:
    """One kernel of an EmuModule; call it like cupy.RawKernel: kern(grid, block, args, shared_mem=0)."""

    def __init__(self, module: "EmuModule", name: str, index: str) -> None:
        self.module = module
        self.name = name
        lib = module._lib
        self._launch = getattr(lib, f"cudaemu_launch_{index}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(LaunchCfg), ctypes.c_void_p]
        sig_fn = getattr(lib, f"cudaemu_sig_{index}")
        sig_fn.restype = ctypes.c_char_p
        sig = sig_fn().decode()
        self._params: list[tuple[str, int]] = [(s[0], int(s[1:])) for s in sig.split(",")] if sig else []
        self.max_dynamic_shared_size_bytes = DEFAULT_MAX_DYNAMIC_SHARED
        self.timeout_s = float(os.environ.get("PAGEDRUN_EMU_TIMEOUT", "300"))
        self._name_bytes = name.encode()

    # CuPy exposes these as read-only function attributes.
    max_threads_per_block = 1024

    @property
    def shared_size_bytes(self) -> int:
        return self.module.static_shared_bytes

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dyn

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        value = int(value)
        if not 0 <= value <= MAX_OPT_IN_SHARED:
            raise EmuLaunchError(
                f"max_dynamic_shared_size_bytes={value} is out of range [0, {MAX_OPT_IN_SHARED}] (sm_90 opt-in limit)"
            )
        self._max_dyn = value

    def _pack(self, args: Sequence[Any]) -> tuple[Any, Any]:
        params = self._params
        if len(args) != len(params):
            raise EmuLaunchError(f"kernel '{self.name}' takes {len(params)} arguments, got {len(args)}")
        offsets = []
        off = 0
        for kind, size in params:
            offsets.append(off)
            off += (max(size, 8) + 15) // 16 * 16
        buf = ctypes.create_string_buffer(max(off, 16))
        base = ctypes.addressof(buf)
        ptrs = (ctypes.c_void_p * max(len(params), 1))()
        for i, (a, (kind, size)) in enumerate(zip(args, params)):
            data = self._arg_bytes(i, a, kind, size)
            ctypes.memmove(base + offsets[i], data, len(data))
            ptrs[i] = base + offsets[i]
        return buf, ptrs

    def _arg_bytes(self, i: int, a: Any, kind: str, size: int) -> bytes:
        where = f"kernel '{self.name}' argument {i}"
        if isinstance(a, np.ndarray) and a.ndim == 0 and kind != "p":
            a = a[()]
        if a is None or isinstance(a, np.ndarray) or hasattr(a, "data_ptr"):
            if kind != "p":
                raise EmuLaunchError(f"{where}: the kernel expects {_describe(kind, size)}, got an array")
            ptr = 0 if a is None else (a.ctypes.data if isinstance(a, np.ndarray) else int(a.data_ptr()))
            return int(ptr).to_bytes(8, "little")
        if isinstance(a, (bool, int, float, complex)) and not isinstance(a, np.generic):
            raise EmuLaunchError(
                f"{where}: got a Python {type(a).__name__} ({a!r}); pass a numpy scalar of the parameter's exact type "
                f"(the kernel expects {_describe(kind, size)}, e.g. np.int32(...) or np.float32(...)): CuPy would pack "
                f"a Python {type(a).__name__} as {'a double' if isinstance(a, float) else 'int64'} silently"
            )
        if not isinstance(a, np.generic):
            raise EmuLaunchError(f"{where}: unsupported argument type {type(a).__name__}")
        if kind == "p":
            raise EmuLaunchError(f"{where}: the kernel expects a pointer (numpy array), got numpy.{type(a).__name__}")
        if a.dtype.itemsize != size:
            raise EmuLaunchError(
                f"{where}: the kernel expects {_describe(kind, size)}, got numpy.{type(a).__name__} "
                f"({a.dtype.itemsize} bytes)"
            )
        ok = (
            kind == "o"
            or (kind == "f" and isinstance(a, np.floating))
            or (kind in "iub" and isinstance(a, (np.integer, np.bool_)))
        )
        if not ok:
            raise EmuLaunchError(f"{where}: the kernel expects {_describe(kind, size)}, got numpy.{type(a).__name__}")
        return a.tobytes()

    def __call__(
        self,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        shared_mem: int = 0,
        stream: Any = None,
        **_ignored: Any,
    ) -> None:
        g, b = _dims(grid, "grid"), _dims(block, "block")
        if min(g) < 1 or min(b) < 1:
            raise EmuLaunchError(f"invalid configuration argument: grid {g}, block {b} (every dimension must be >= 1)")
        if b[0] > 1024 or b[1] > 1024 or b[2] > 64 or b[0] * b[1] * b[2] > 1024:
            raise EmuLaunchError(f"invalid configuration argument: block {b} (at most 1024 threads, z <= 64)")
        if g[0] > 2**31 - 1 or g[1] > 65535 or g[2] > 65535:
            raise EmuLaunchError(f"invalid configuration argument: grid {g} (x < 2^31, y and z <= 65535)")
        shared_mem = int(shared_mem)
        if shared_mem < 0 or shared_mem > self._max_dyn:
            raise EmuLaunchError(
                f"kernel '{self.name}': {shared_mem} bytes of dynamic shared memory exceed "
                f"max_dynamic_shared_size_bytes={self._max_dyn} (set kernel.max_dynamic_shared_size_bytes first, "
                f"as CUDA requires above 48 KiB)"
            )
        keep, ptrs = self._pack(args)
        cfg = LaunchCfg()
        cfg.grid[:] = g
        cfg.block[:] = b
        cfg.shared_mem = shared_mem
        cfg.schedule = SCHEDULES[self.module.schedule]
        cfg.poison_shared = 1 if self.module.poison_shared else 0
        cfg.stack_bytes = int(os.environ.get("PAGEDRUN_EMU_STACK_KB", "256" if self.module.sanitize else "128")) * 1024
        cfg.timeout_s = self.timeout_s
        cfg.kernel_name = self._name_bytes
        err = ctypes.create_string_buffer(_ERR_LEN)
        cfg.err = ctypes.addressof(err)
        cfg.err_len = _ERR_LEN
        if self.module._runner is not None:
            code, msg = self.module._runner.launch(self, cfg, args, keep, ptrs)
        else:
            with _LAUNCH_LOCK:
                code = self._launch(ctypes.byref(cfg), ptrs)
            msg = err.value.decode(errors="replace")
        del keep
        if code == 0:
            return
        if code == 1:
            raise EmuDeadlockError(msg)
        raise EmuLaunchError(msg or f"kernel '{self.name}' failed (code {code})")


class EmuModule:
    """cupy.RawModule look-alike: compiles `code` for the CPU emulator (cached) and hands out kernels."""

    def __init__(
        self,
        code: str,
        name_expressions: Sequence[str] = (),
        options: Sequence[str] = (),
        schedule: str = "round_robin",
        poison_shared: bool = True,
        sanitize: str | None = None,
        filename: str = "kernel.cu",
    ) -> None:
        if schedule not in SCHEDULES:
            raise EmuError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if isinstance(name_expressions, str) or isinstance(options, str):
            raise EmuError("name_expressions and options must be sequences of strings, not a string")
        self.code = code
        self.name_expressions = tuple(name_expressions)
        self.options = tuple(options)
        self.schedule = schedule
        self.poison_shared = poison_shared
        self.sanitize = sanitize
        self.built: BuiltModule = build(code, self.name_expressions, self.options, sanitize, filename)
        self._runner = None
        self._lib: Any
        if sanitize is not None and not _asan_loaded():
            from pagedrun.build.cudaemu.asan import AsanRunner

            self._runner = AsanRunner(self.built)
            # Signatures and shared sizes come from the plain build (same kernels, same table).
            plain = build(code, self.name_expressions, self.options, None, filename)
            self._lib = load_library(plain.so_path, os.RTLD_LOCAL)
        else:
            self._lib = load_library(self.built.so_path, os.RTLD_LOCAL)  # the very file the cache checked
        self._kernels: dict[str, EmuKernel] = {}

    @property
    def static_shared_bytes(self) -> int:
        fn = self._lib.cudaemu_static_shared_bytes
        fn.restype = ctypes.c_ulonglong
        return int(fn())

    @property
    def kernel_names(self) -> list[str]:
        return list(self.built.kernels)

    def compile(self) -> None:  # cupy.RawModule.compile(): compiled already
        return None

    def get_function(self, name: str) -> EmuKernel:
        k = self._kernels.get(name)
        if k is None:
            index = self.built.kernels.get(name)
            if index is None:
                raise EmuError(
                    f"no kernel named {name!r} in the module (found: {', '.join(self.built.kernels) or 'none'}; "
                    f"templated kernels need name_expressions)"
                )
            k = self._kernels[name] = EmuKernel(self, name, index)
        return k


def _asan_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False
