"""NVRTC without CuPy and without a GPU: libnvrtc driven through ctypes, the calls cupy.RawModule makes.

CuPy compiles kernels/cuda/*.cu at run time with NVRTC: createProgram, one addNameExpression per
templated kernel, compileProgram with the options, getLoweredName for each name, getCUBIN. The
same calls here let CI (no GPU, no CuPy) prove that every variant compiles for sm_80 and sm_90
exactly as it will on a GPU. libnvrtc comes from the `nvidia-cuda-nvrtc` wheel (CUDA 13:
nvidia/cu13/lib; the cu12 wheel: nvidia/cuda_nvrtc/lib) or a CUDA toolkit; the headers NVRTC
needs (cuda_fp16.h, cuda_bf16.h) from `nvidia-cuda-runtime` or the toolkit (kernels.cuda_include_dirs).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

_SUCCESS = 0


class NvrtcError(RuntimeError):
    pass


def library_candidates() -> list[str]:
    out: list[str] = []
    try:
        import nvidia  # type: ignore  # namespace package of the NVIDIA wheels

        for base in nvidia.__path__:
            out += sorted(glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so.*")), reverse=True)
            out += sorted(glob.glob(os.path.join(base, "cuda_nvrtc", "lib", "libnvrtc.so.*")), reverse=True)
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            out += sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libnvrtc.so*")))
    out += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    # "alt" builds are the static-libstdc++ variants of the same compiler; the builtins are a helper
    return [p for p in dict.fromkeys(out) if ".alt." not in p and "builtins" not in p]


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The first libnvrtc that loads; NvrtcError naming what was tried otherwise."""
    tried = []
    for path in library_candidates():
        try:
            _preload_builtins(path)
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        _declare(lib)
        return lib
    hint = "; ".join(tried) if tried else "none found"
    raise NvrtcError(f"libnvrtc not available ({hint}): pip install nvidia-cuda-nvrtc nvidia-cuda-runtime")


def _preload_builtins(path: str) -> None:
    """libnvrtc dlopens its helper libnvrtc-builtins by soname at the first compile; the 13.0 wheel's
    libnvrtc has no RUNPATH, so that lookup misses the wheel's own folder (NVRTC_ERROR_BUILTIN_
    OPERATION_FAILURE). Loaded first, globally, from beside it, the soname is already resolved."""
    for helper in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")), reverse=True):
        if ".alt." in helper:
            continue
        try:
            ctypes.CDLL(helper, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue  # a toolkit's own layout finds it by itself; the compile says so if not
        return


def _declare(lib: ctypes.CDLL) -> None:
    p, c, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    sz = ctypes.c_size_t
    sigs = {
        "nvrtcVersion": [ctypes.POINTER(i), ctypes.POINTER(i)],
        "nvrtcCreateProgram": [ctypes.POINTER(p), c, c, i, ctypes.POINTER(c), ctypes.POINTER(c)],
        "nvrtcAddNameExpression": [p, c],
        "nvrtcCompileProgram": [p, i, ctypes.POINTER(c)],
        "nvrtcGetLoweredName": [p, c, ctypes.POINTER(c)],
        "nvrtcGetProgramLogSize": [p, ctypes.POINTER(sz)],
        "nvrtcGetProgramLog": [p, c],
        "nvrtcGetCUBINSize": [p, ctypes.POINTER(sz)],
        "nvrtcGetCUBIN": [p, c],
        "nvrtcDestroyProgram": [ctypes.POINTER(p)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [i], c


def version() -> tuple[int, int]:
    lib = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _call(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _call(lib: ctypes.CDLL, rc: int, what: str, log: str = "") -> None:
    if rc != _SUCCESS:
        msg = lib.nvrtcGetErrorString(rc).decode(errors="replace")
        raise NvrtcError(f"{what}: {msg}" + (f"\n{log}" if log else ""))


@dataclass
class Compiled:
    cubin: bytes
    lowered: dict[str, str]  # name expression -> mangled symbol, as cupy.RawModule.get_function uses
    log: str


def compile_program(code: str, names: list[str], arch: str, include_dirs: list[str],
                    filename: str = "paged_attention.cu") -> Compiled:
    """createProgram + addNameExpression + compileProgram(--gpu-architecture=arch, -std=c++17, -I...)."""
    lib = load()
    prog = ctypes.c_void_p()
    _call(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), filename.encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        for n in names:
            _call(lib, lib.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *[f"-I{d}" for d in include_dirs]]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        log = _log(lib, prog)
        _call(lib, rc, f"nvrtcCompileProgram({arch})", log)
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            _call(lib, lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"nvrtcGetLoweredName({n})")
            lowered[n] = out.value.decode()
        size = ctypes.c_size_t()
        _call(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        _call(lib, lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return Compiled(buf.raw, lowered, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != _SUCCESS or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace").strip()


def library_path() -> str:
    """Which libnvrtc was loaded (for test logs)."""
    return str(Path(load()._name))


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_bf16.h for NVRTC (it has no default include path)."""
    candidates: list[Path] = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    candidates += [Path("/usr/local/cuda/include")]
    try:  # pip wheels (nvidia-cuda-runtime-cu12 ships the headers)
        import nvidia  # type: ignore

        for base in nvidia.__path__:
            candidates += sorted(Path(base).glob("cuda_runtime/include"))
            candidates += sorted(Path(base).glob("cu*/include"))
    except ImportError:
        pass
    seen: list[str] = []
    for c in candidates:
        if (c / "cuda_fp16.h").is_file() and str(c) not in seen:
            seen.append(str(c))
    return seen
