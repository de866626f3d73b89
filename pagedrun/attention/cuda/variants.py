"""Which compiled kernels exist: one KernelVariant per (model dtype, KV-cache dtype, head size, block
size), and the template names (name expressions) NVRTC / the emulator instantiate for it.

The KV-cache dtype (issue 18) is the last template argument of the attention and cache kernels,
defaulted to kAuto in kernels/cuda/*.cu, so an unquantized variant keeps the names it always had.
bfloat16 has no numpy dtype: bf16 tensors travel as int16/uint16 views and the variant's `dtype`
says how the kernel reads them; fp8 caches travel as uint8 bit patterns, int8 caches as int8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

NUM_THREADS = 128
WARP_SIZE = 32
PARTITION_SIZE = 512

# Query heads per thread block (GQA): a block serving the query heads of one KV head loads each K/V
# row once for all of them. Up to 8 (Llama 3 70B's 64/8; Qwen2's 7): register use grows with it.
MAX_GROUP = 8
# A quantized cache's grouped kernels: 16 one-byte elements per value load times the group's heads
# are fp32 accumulators (nvcc 13, sm_90: 120-128 registers at 4, 211-255 at 8).
MAX_QUANTIZED_GROUP = 4

# The varlen prefill kernel (kernels/cuda/prefill_attention.cu): a thread block serves up to
# PREFILL_ROWS (query, head) rows of one KV head, TILE_Q = PREFILL_ROWS // group queries of one sequence
# times the group's heads, and loads each key / value row once for all of them. 16 rows past head 128:
# a tile's q, one 32-key chunk of K and V and the weights in fp32 shared memory stay under 85 KB, and
# the 128 threads' accumulators at 32 floats each (ROWS * HEAD_SIZE / 128).
PREFILL_ROWS = 32
PREFILL_ROWS_LARGE_HEAD = 16
PREFILL_CHUNK = 32  # keys per step of its key loop (a warp's lanes)

HEAD_SIZES = (32, 64, 80, 96, 112, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
# dtype name -> (C type in the kernel, numpy dtype of the arrays handed to it)
DTYPES: dict[str, tuple[str, Any]] = {
    "float16": ("__half", np.float16),
    "bfloat16": ("__nv_bfloat16", np.uint16),
    "float32": ("float", np.float32),
}
# KV-cache dtype -> (KvCacheDtype enumerator, C element type, numpy dtype of the cache arrays);
# "auto" stores the model dtype (element type and numpy dtype: DTYPES[dtype]).
KV_DTYPES: dict[str, tuple[str, str | None, Any]] = {
    "auto": ("pagedrun::KvCacheDtype::kAuto", None, None),
    "fp8_e4m3": ("pagedrun::KvCacheDtype::kFp8E4M3", "unsigned char", np.uint8),
    "fp8_e5m2": ("pagedrun::KvCacheDtype::kFp8E5M2", "unsigned char", np.uint8),
    "int8": ("pagedrun::KvCacheDtype::kInt8", "signed char", np.int8),
}
QUANTIZED_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
# the recipe's spellings that name one of the above
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class KernelVariant:
    dtype: str  # model dtype: float16 | bfloat16 | float32 (query, output, new K/V)
    head_size: int
    block_size: int
    kv_dtype: str = "auto"  # how the cache stores K/V: auto (= dtype) | fp8_e4m3 | fp8_e5m2 | int8
    group: int = 1  # query heads per attention block compiled beside the one-head kernels (group_for)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"kernel dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.head_size not in HEAD_SIZES:
            raise ValueError(f"head_size {self.head_size}: compiled head sizes are {HEAD_SIZES}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size {self.block_size}: compiled block sizes are {BLOCK_SIZES}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {self.kv_dtype!r}: the CUDA kernels support {', '.join(KV_DTYPES)}")
        if not 1 <= self.group <= (MAX_QUANTIZED_GROUP if self.quantized else MAX_GROUP):
            raise ValueError(f"group {self.group}: 1..{MAX_GROUP} query heads per block, "
                             f"1..{MAX_QUANTIZED_GROUP} for a quantized cache")

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def np_dtype(self) -> Any:
        return DTYPES[self.dtype][1]

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    @property
    def cache_ctype(self) -> str:
        return KV_DTYPES[self.kv_dtype][1] or self.ctype

    @property
    def cache_np_dtype(self) -> Any:
        return KV_DTYPES[self.kv_dtype][2] or self.np_dtype

    @property
    def _kv_arg(self) -> str:
        """', <enumerator>' for a quantized cache; nothing for auto (the template's default)."""
        return f", {KV_DTYPES[self.kv_dtype][0]}" if self.quantized else ""

    def attention_name(self, version: str, group: int = 1) -> str:
        """v1 / v2 serving `group` query heads per block; group 1 keeps the template's defaults."""
        tail = f", {KV_DTYPES[self.kv_dtype][0]}, {group}" if group > 1 else self._kv_arg
        parts = f", {PARTITION_SIZE}" if version == "v2" else ""
        return (f"paged_attention_{version}_kernel<{self.ctype}, {self.head_size}, {self.block_size}, "
                f"{NUM_THREADS}{parts}{tail}>")

    @property
    def v1_name(self) -> str:
        return self.attention_name("v1")

    @property
    def v2_name(self) -> str:
        return self.attention_name("v2")

    def launch_group(self, num_heads: int, num_kv_heads: int) -> int:
        """The grouped kernel's group where it divides the query heads per KV head, else 1."""
        return self.group if self.group > 1 and (num_heads // num_kv_heads) % self.group == 0 else 1

    def prefill_tile_q(self, group: int = 1) -> int:
        """Queries per tile of the varlen prefill kernel serving `group` query heads per block."""
        return prefill_tile_q(self.head_size, group)

    def prefill_name(self, group: int = 1) -> str:
        """The varlen prefill kernel (unquantized caches only: a quantized one prefills as "kernel")."""
        return (f"paged_prefill_kernel<{self.ctype}, {self.head_size}, {self.block_size}, {NUM_THREADS}, "
                f"{self.prefill_tile_q(group)}, {group}>")

    @property
    def reduce_name(self) -> str:  # reads only fp32 partials: one per model dtype, whatever the cache
        return f"paged_attention_v2_reduce_kernel<{self.ctype}, {self.head_size}, {NUM_THREADS}, {PARTITION_SIZE}>"

    @property
    def reshape_and_cache_name(self) -> str:
        return f"reshape_and_cache_kernel<{self.ctype}{self._kv_arg}>"

    def name_expressions(self, parts: tuple[str, ...] = ("v1", "v2", "cache", "prefill")) -> list[str]:
        """Kernel names to instantiate; parts: "v1", "v2" (v2 + reduce), "cache" (cache ops), "prefill"
        (the varlen prefill kernel, unquantized variants only)."""
        names = []
        groups = (1, self.group) if self.group > 1 else (1,)
        if "v1" in parts:
            names += [self.attention_name("v1", g) for g in groups]
        if "v2" in parts:
            names += [self.attention_name("v2", g) for g in groups] + [self.reduce_name]
        if "cache" in parts:
            names.append(self.reshape_and_cache_name)
        if "prefill" in parts and not self.quantized:
            names += [self.prefill_name(g) for g in groups]
        return names


def prefill_tile_q(head_size: int, group: int = 1) -> int:
    rows = PREFILL_ROWS if head_size <= 128 else PREFILL_ROWS_LARGE_HEAD
    return max(1, rows // group)


def group_for(num_heads: int, num_kv_heads: int, kv_dtype: str = "auto") -> int:
    """Query heads per block for a model: the largest divisor of num_heads / num_kv_heads up to
    MAX_GROUP (a ratio of 16 takes two blocks of 8 per KV head), MAX_QUANTIZED_GROUP for a 1-byte
    cache (more registers per head: 120-168 at 4); 1 for MHA. On an H200 the grouped kernels of a
    1-byte cache read faster than one head per block
    (docs/log/2026-11-26-h200-fourth-session-quantized-grouped.md)."""
    limit = MAX_GROUP if kv_dtype == "auto" else MAX_QUANTIZED_GROUP
    ratio = num_heads // num_kv_heads if num_kv_heads > 0 and num_heads % num_kv_heads == 0 else 1
    return max(d for d in range(1, limit + 1) if ratio % d == 0)


def all_variants(kv_dtypes: tuple[str, ...] = ("auto",)) -> list[KernelVariant]:
    return [KernelVariant(d, h, b, kv) for kv in kv_dtypes for d in DTYPES for h in HEAD_SIZES for b in BLOCK_SIZES]


def dtype_name(dtype: Any) -> str:
    """torch or numpy dtype -> 'float16' | 'bfloat16' | 'float32'."""
    name = str(dtype).replace("torch.", "")
    if name in DTYPES:
        return name
    raise ValueError(f"KV cache dtype {dtype}: the kernels support {', '.join(DTYPES)}")


def kv_dtype_name(kv_cache_dtype: str | None) -> str:
    """The recipe's cache.kv_cache_dtype -> a KV_DTYPES key; a full-precision dtype equal to the
    model's is "auto" (callers check that it is the model's)."""
    name = KV_DTYPE_ALIASES.get(kv_cache_dtype or "auto", kv_cache_dtype or "auto")
    if name in DTYPES:
        return "auto"
    if name not in KV_DTYPES:
        raise ValueError(f"cache.kv_cache_dtype {kv_cache_dtype!r}: the CUDA kernels support "
                         f"auto, {', '.join(DTYPES)}, fp8, {', '.join(QUANTIZED_KV_DTYPES)}")
    return name
