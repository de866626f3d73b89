"""The C++ paged-attention kernel for the CPU (kernels/cpu/paged_attention_cpu.cpp), through ctypes.

Built on first use by pagedrun.build.cpu (per machine, cached under $PAGEDRUN_CACHE/cpu_kernels/).
When the compiler is missing or the build fails, `load()` returns None and `load_error()` says why;
the torch backend then falls back to plain torch.

PAGEDRUN_CPU_ATTENTION=0 turns the kernel off (benchmarks compare both paths with it).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedrun.attention import kv_cache_spec as kv_quant
from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import load_library

SOURCE = cpu_build.KERNEL_DIR / "paged_attention_cpu.cpp"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
KV_PLAIN, KV_FP8, KV_INT8 = 0, 1, 2  # how the kernel widens cache rows (kernels/cpu: KvKind)


@dataclass
class KVReader:
    """How the kernel reads the cache: as the query's dtype, through a 256-entry table per K / V
    (fp8 codes -> code value x the layer's scale), or int8 x the row's scale ([blocks, block, heads])."""
    kind: int = KV_PLAIN
    k_aux: torch.Tensor | None = None
    v_aux: torch.Tensor | None = None

    def pointers(self) -> tuple[int, int, int]:
        return (self.kind, 0 if self.k_aux is None else self.k_aux.data_ptr(),
                0 if self.v_aux is None else self.v_aux.data_ptr())


@functools.lru_cache(maxsize=256)
def _fp8_lut(fmt: str, scale: float) -> torch.Tensor:
    """The kernel's fp8 reader: 256 code values x scale, then the F16C path's multiplier and format."""
    e5m2 = fmt == "fp8_e5m2"
    tail = torch.tensor([scale if e5m2 else scale * 256.0, 1.0 if e5m2 else 0.0])
    return torch.cat([kv_quant.fp8_table(fmt) * scale, tail]).contiguous()


def kv_reader(kv_cache_dtype: str, k_scale, v_scale) -> KVReader:
    if kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        return KVReader(KV_FP8, _fp8_lut(kv_cache_dtype, float(k_scale)), _fp8_lut(kv_cache_dtype, float(v_scale)))
    if kv_cache_dtype == "int8":
        return KVReader(KV_INT8, k_scale.contiguous(), v_scale.contiguous())
    return KVReader()


class CpuAttentionKernels:
    """The loaded library. Methods return the kernel's status (0 = done, < 0 = arguments refused,
    nothing written)."""

    def __init__(self, so_path: Path) -> None:
        self.so_path = so_path
        lib = load_library(so_path)  # the very file the cache checked (build/cache.py)
        lib.paged_attention_varlen.restype = _int
        # ... scale, window, softcap, dtype, threads, kv kind, k_aux, v_aux, sinks
        tail = [_f32, _i32, _f32, _int, _int, _int, _ptr, _ptr, _ptr]
        lib.paged_attention_varlen.argtypes = [_ptr] * 8 + [_i64] * 10 + tail
        lib.paged_attention_decode.restype = _int
        lib.paged_attention_decode.argtypes = [_ptr] * 6 + [_i64] * 9 + tail
        lib.paged_reshape_and_cache.restype = _int
        lib.paged_reshape_and_cache.argtypes = [_ptr] * 5 + [_i64] * 6
        lib.paged_attention_dtypes.restype = _int
        mask = lib.paged_attention_dtypes()
        self.dtypes = {dt for dt, code in DTYPE_CODES.items() if mask >> code & 1}
        lib.paged_attention_amx.restype = _int
        lib.paged_attention_amx.argtypes = [_int]
        self._lib = lib

    def functions(self) -> dict[str, ctypes._CFuncPtr]:
        """The exported C functions, for a caller that calls them from C (models/layer_runner.py)."""
        return {"reshape_and_cache": self._lib.paged_reshape_and_cache, "decode": self._lib.paged_attention_decode,
                "varlen": self._lib.paged_attention_varlen}

    def amx(self, on: int = -1) -> bool:
        """Whether bf16 prefill attention runs its products on AMX tiles (kernels/cpu/attention_amx.h);
        on = 1 / 0 switches it (the tests compare both paths)."""
        return bool(self._lib.paged_attention_amx(on))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> int:
        """key/value [tokens, kv_heads, hd] with contiguous rows, caches contiguous and of the same
        dtype, slot_mapping int64 contiguous."""
        return self._lib.paged_reshape_and_cache(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
            slot_mapping.shape[0], key_cache.shape[2] * key_cache.shape[3], key.stride(0), value.stride(0),
            key_cache.shape[0] * key_cache.shape[1], key_cache.element_size(),
        )

    def varlen(self, out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
               context_lens, scale: float, num_threads: int, kv: KVReader | None = None, *, window: int = 0,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> int:
        """All int tensors int32 and contiguous; query/out [tokens, heads, hd] with contiguous rows;
        key/value caches contiguous, every tensor of the same dtype. window / softcap / sinks: the
        layer's (pagedrun/attention/backend.py; 0 / None = off)."""
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        sinks = sink_arg(sinks, query.shape[1])
        return self._lib.paged_attention_varlen(
            out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(), context_lens.data_ptr(),
            seq_lens.shape[0], query.shape[0], query.shape[1], num_kv_heads, head_size, block_size, num_blocks,
            block_tables.shape[1], query.stride(0), out.stride(0),
            scale, window, softcap, DTYPE_CODES[query.dtype], num_threads, *(kv or KVReader()).pointers(),
            _address(sinks),
        )

    def decode(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale: float,
               num_threads: int, kv: KVReader | None = None, *, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> int:
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
        sinks = sink_arg(sinks, query.shape[1])
        return self._lib.paged_attention_decode(
            out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], query.shape[1], num_kv_heads, head_size, block_size, num_blocks,
            block_tables.shape[1], query.stride(0), out.stride(0),
            scale, window, softcap, DTYPE_CODES[query.dtype], num_threads, *(kv or KVReader()).pointers(),
            _address(sinks),
        )


def sink_arg(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """sinks as the kernels read them: float32 [num_heads], on the CPU, contiguous (itself when it
    already is, as a model's float32 parameter is)."""
    if sinks is None:
        return None
    if sinks.numel() != num_heads:
        raise ValueError(f"sinks has {sinks.numel()} entries for {num_heads} query heads")
    sinks = sinks.detach()
    return sinks if sinks.dtype == torch.float32 and sinks.device.type == "cpu" and sinks.is_contiguous() else (
        sinks.to("cpu", torch.float32).contiguous())


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def int_arg(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as the kernels take their integer arrays: `dtype`, on the CPU, contiguous (t itself when it
    already is, as the metadata's tensors are on the CPU)."""
    return t if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() else (
        t.to("cpu", dtype).contiguous())


_load_error: str | None = None


def load_error() -> str | None:
    """Why `load()` returned None (None when it has not failed)."""
    return _load_error


@functools.lru_cache(maxsize=1)
def load() -> CpuAttentionKernels | None:
    """Build (once per machine and source) and load the kernel; None if that is impossible."""
    global _load_error
    lib, _load_error = cpu_build.load("PAGEDRUN_CPU_ATTENTION", SOURCE, CpuAttentionKernels)
    return lib


def build(source: Path = SOURCE) -> Path:
    return cpu_build.build(source)
