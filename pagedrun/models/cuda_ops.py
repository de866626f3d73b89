"""The model's elementwise ops on a GPU as fused kernels (kernels/cuda/fused_ops.cu), one launch each.

ops.py hands CUDA tensors here when CuPy is importable: rms_norm (with the residual add, in place),
RoPE on q and k, SiLU x up and GELU-tanh x up each replace a chain of torch launches (issue 36: a
decode step was host-bound at ~35 launches a layer). rope_and_cache also writes k and v into the
paged cache (reshape_and_cache's layout) in the same launch; nothing calls it yet (the attention
backends take k before the cache write: docs/design/cuda-kernels.md, "Fused model ops").

FusedOps holds one compiled module (every dtype's kernels) and launches on it; the same launch code
runs on a GPU (cupy.RawModule through NVRTC, torch's current stream) and on the CPU under the CUDA
emulator (EmuModule, CPU tensors), which is how the tests check it without a GPU. Launches are
capture-safe: outputs come from torch's allocator, arguments are addresses and numpy scalars, and
nothing waits on the device. Each op returns None (False for the in-place rope) before launching
anything when it cannot take its inputs; ops.py then runs the torch path.

PAGEDRUN_CUDA_FUSED_OPS=0 turns them off (ops.torch_only() does too), for A/B runs on a GPU.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable

import numpy as np
import torch

from pagedrun.attention.cuda import kernels as K

SOURCE = "fused_ops.cu"
# torch dtype -> the kernels' scalar_t
CUDA_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
MAX_GRID_X = 2**31 - 1  # rows (tokens) sit on gridDim.x


@functools.cache  # called per launch: the string built once
def rms_norm_name(dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
    return f"rms_norm_kernel<{CUDA_TYPES[dtype]}, {CUDA_TYPES[weight_dtype]}>"


@functools.cache  # called per launch: the string built once
def rope_name(dtype: torch.dtype, write_cache: bool) -> str:
    return f"rope_kernel<{CUDA_TYPES[dtype]}, {'true' if write_cache else 'false'}>"


@functools.cache  # called per launch: the string built once
def act_name(dtype: torch.dtype, act: str) -> str:
    return f"act_and_mul_kernel<{CUDA_TYPES[dtype]}, {ACTIVATIONS[act]}>"


def kernel_names() -> list[str]:
    """Every variant: 3 dtypes x (the norm, Gemma's float32-weight norm on half / bf16, rope with and
    without the cache write, two activations): 17 kernels in one module."""
    names = []
    for dtype in CUDA_TYPES:
        names.append(rms_norm_name(dtype, dtype))
        if dtype is not torch.float32:
            names.append(rms_norm_name(dtype, torch.float32))
        names += [rope_name(dtype, False), rope_name(dtype, True)]
        names += [act_name(dtype, a) for a in ACTIVATIONS]
    return names


def source() -> str:
    return K.load_source(SOURCE)


def _threads(work: int, most: int) -> int:
    """Whole warps covering `work` elements, at least one, at most `most`."""
    return max(32, min(most, -(-work // 32) * 32))


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0 and x.shape[0] < MAX_GRID_X


def _heads_ok(x: torch.Tensor) -> bool:
    """[T, heads, hd] with each token's heads packed (any token stride)."""
    return (x.dim() == 3 and x.shape[2] > 0 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])
            and x.shape[0] < MAX_GRID_X)


class FusedOps:
    """The fused kernels of one module. `pointer(t)` turns a tensor into the kernel's pointer
    argument; `launch_kwargs()` gives the launch's extra keywords (the stream on a GPU)."""

    def __init__(self, module: Any, pointer: Callable[[torch.Tensor], Any],
                 launch_kwargs: Callable[[], dict] = dict, device_scope: Callable[[], Any] | None = None):
        self.module = module
        self._pointer = pointer
        self._launch_kwargs = launch_kwargs
        self._device_scope = device_scope
        self._functions: dict[str, Any] = {}
        self.launches = 0  # kernels launched (tests count them)

    def _launch(self, name: str, grid: int, threads: int, args: tuple) -> None:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.module.get_function(name)
        if self._device_scope is None:
            fn((grid, 1, 1), (threads, 1, 1), args, **self._launch_kwargs())
        else:
            with self._device_scope():
                fn((grid, 1, 1), (threads, 1, 1), args, **self._launch_kwargs())
        self.launches += 1

    def _ptr(self, t: torch.Tensor | None) -> Any:
        return None if t is None else self._pointer(t)

    # ------------------------------------------------------------ RMSNorm

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """ops.rms_norm's contract: norm(x), or with a residual (norm(x + residual), residual) with
        x + residual written into residual. x: [rows, hidden] with contiguous rows, or (no residual)
        [T, heads, hd] with packed heads, normalised per head. None: not taken (nothing written)."""
        dtype = x.dtype
        if dtype not in CUDA_TYPES or weight.device != x.device or not weight.is_contiguous() or weight.dim() != 1:
            return None
        if weight.dtype is not dtype and not (weight.dtype is torch.float32 and dtype is not torch.float32):
            return None
        if residual is None and x.dim() == 3:
            if not _heads_ok(x):
                return None
            tokens, heads, hidden = x.shape
        elif x.dim() == 2 and _rows_ok(x):
            tokens, heads, hidden = x.shape[0], 1, x.shape[1]
            if residual is not None and not (_rows_ok(residual) and residual.dtype is dtype
                                             and residual.shape == x.shape and residual.device == x.device):
                return None
        else:
            return None
        if weight.shape[0] != hidden or tokens * heads >= MAX_GRID_X:
            return None
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if tokens:
            ptr = self._pointer
            self._launch(rms_norm_name(dtype, weight.dtype), tokens * heads, _threads(hidden, 1024), (
                ptr(out), ptr(x), None if residual is None else ptr(residual), ptr(weight), np.int32(hidden),
                np.int32(heads), np.int64(x.stride(0)), np.int64(0 if residual is None else residual.stride(0)),
                np.float32(eps),
            ))
        return out if residual is None else (out, residual)

    # ------------------------------------------------------------ RoPE

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> bool:
        """Rotate q [T, heads, hd] and k [T, kv_heads, hd] in place (ops.rope's contract, one launch).
        False: not taken (nothing written)."""
        return self._rope(positions, q, k, cos, sin)

    def rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> bool:
        """rope, and the rotated k and v written into the caches [num_blocks, block_size, kv_heads, hd]
        at slot_mapping (int64 [T], < 0: skipped), as reshape_and_cache does for an unquantized
        cache. False: not taken (nothing written)."""
        t = q.shape[0] if q.dim() == 3 else -1
        if not (_heads_ok(v) and v.shape == k.shape and v.dtype is q.dtype and v.device == q.device):
            return False
        for c in (key_cache, value_cache):
            if not (c.dim() == 4 and c.is_contiguous() and c.dtype is q.dtype and c.device == q.device
                    and tuple(c.shape[2:]) == tuple(k.shape[1:])):
                return False
        if key_cache.shape != value_cache.shape:
            return False
        if not (slot_mapping.dtype is torch.long and slot_mapping.is_contiguous() and slot_mapping.dim() == 1
                and slot_mapping.shape[0] == t and slot_mapping.device == q.device):
            return False
        return self._rope(positions, q, k, cos, sin, (v, key_cache, value_cache, slot_mapping))

    def _rope(self, positions, q, k, cos, sin, cache: tuple | None = None) -> bool:
        dtype = q.dtype
        if dtype not in CUDA_TYPES or k.dtype is not dtype or not (_heads_ok(q) and _heads_ok(k)):
            return False
        t, heads, hd = q.shape
        if k.shape[0] != t or k.shape[2] != hd or k.device != q.device:
            return False
        if not (positions.dtype is torch.long and positions.is_contiguous() and positions.dim() == 1
                and positions.shape[0] == t and positions.device == q.device):
            return False
        if not all(c.dtype is torch.float32 and c.is_contiguous() and c.dim() == 2 and c.device == q.device
                   for c in (cos, sin)) or cos.shape != sin.shape:
            return False
        max_pos, rot_half = cos.shape
        if not 0 < 2 * rot_half <= hd or max_pos >= 2**31:
            return False
        if t == 0:
            return True
        kv_heads = k.shape[1]
        v, key_cache, value_cache, slots = cache if cache is not None else (None, None, None, None)
        self._launch(rope_name(dtype, cache is not None), t, _threads((heads + kv_heads) * rot_half, 512), (
            self._ptr(q), self._ptr(k), self._ptr(v), self._ptr(key_cache), self._ptr(value_cache),
            self._ptr(positions), self._ptr(slots), self._ptr(cos), self._ptr(sin),
            np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(0 if v is None else v.stride(0)),
            np.int32(heads), np.int32(kv_heads), np.int32(hd), np.int32(rot_half), np.int32(max_pos),
        ))
        return True

    # ------------------------------------------------------------ gated activations

    def act_and_mul(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor | None:
        """[M, 2I] holding gate then up -> act(gate) * up [M, I] (act: silu | gelu_tanh). None: not taken."""
        dtype = gate_up.dtype
        if dtype not in CUDA_TYPES or not _rows_ok(gate_up) or gate_up.shape[1] % 2:
            return None
        m, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((m, inter), dtype=dtype, device=gate_up.device)
        if m:
            ptr = self._pointer
            self._launch(act_name(dtype, act), m, _threads(inter, 1024), (
                ptr(out), ptr(gate_up), np.int32(inter), np.int64(gate_up.stride(0)), np.int64(inter),
            ))
        return out


# ---------------------------------------------------------------- modules


def enabled() -> bool:
    return os.environ.get("PAGEDRUN_CUDA_FUSED_OPS", "1") != "0"


def emulated(schedule: str = "round_robin") -> FusedOps:
    """The kernels under the CUDA emulator, on CPU tensors (tests). One build per process and
    schedule (cached on disk across processes)."""
    return FusedOps(_emulated_module(schedule), pointer=lambda t: t)  # EmuKernel takes a tensor's data_ptr()


@functools.lru_cache(maxsize=None)
def _emulated_module(schedule: str) -> Any:
    return K.emulator_module_factory(schedule)(source(), kernel_names())


_failed: dict[int, str] = {}


def for_device(device: torch.device) -> FusedOps | None:
    """The fused ops of a CUDA device, compiled on first use; None where CuPy is missing or the
    compile failed (warned once): ops.py then runs torch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ops = _CUPY.get(index)
    if ops is not None or index in _failed:
        return ops
    if not enabled():
        _failed[index] = "PAGEDRUN_CUDA_FUSED_OPS=0"
        return None
    try:
        ops = _CUPY[index] = cupy_ops(index)
    except Exception as e:  # no CuPy, or NVRTC refused: the torch path stays right, only slower
        _failed[index] = f"{type(e).__name__}: {e}"
        if not isinstance(e, ImportError):
            warnings.warn(f"fused CUDA ops unavailable on cuda:{index} ({_failed[index]}); torch ops instead",
                          RuntimeWarning, stacklevel=2)
        return None
    return ops


_CUPY: dict[int, FusedOps] = {}


def cupy_ops(index: int) -> FusedOps:
    """The module compiled by NVRTC through cupy.RawModule for device `index`. Each launch goes on
    torch's current stream (cached as a CuPy ExternalStream per stream handle) under the device."""
    import cupy

    with cupy.cuda.Device(index):
        module = K.cupy_module_factory(source(), kernel_names())
        # Every function loaded now, not at its first launch (which may be inside a graph capture).
        functions = {name: module.get_function(name) for name in kernel_names()}
        for fn in functions.values():
            fn.max_threads_per_block  # noqa: B018  (reading an attribute loads the function on this device)
    streams: dict[int, Any] = {}
    device = torch.device("cuda", index)

    def launch_kwargs() -> dict:
        handle = torch.cuda.current_stream(device).cuda_stream
        stream = streams.get(handle)
        if stream is None:
            stream = streams[handle] = cupy.cuda.ExternalStream(handle)  # as cupy_backend: older CuPys take no device
        return {"stream": stream}

    # The kernel's address as an 8-byte scalar: a pointer parameter is just its bytes, and this
    # skips building a CuPy array per tensor per call (the host cost issue 36 is about).
    ops = FusedOps(module, pointer=lambda t: np.uint64(t.data_ptr()), launch_kwargs=launch_kwargs,
                   device_scope=lambda: cupy.cuda.Device(index))
    ops._functions.update(functions)
    return ops
