"""The .cu kernels as Python callables: sources, variants, v1/v2 choice and launch helpers.

Everything here works on "device arrays" of one array module `xp`: cupy arrays on a GPU, numpy arrays
under the CUDA-on-CPU emulator (pagedrun.build.cudaemu), which takes numpy arrays where CUDA takes device
pointers. The two attention backends differ only in how they build a module and wrap tensors, so
grid shapes, shared-memory sizes and argument packing (numpy scalars of the exact parameter types:
a Python float would be packed as a double) are written once, here.

Which variants exist and their template names: pagedrun.attention.cuda.variants (re-exported); the
varlen prefill launch: prefill_kernels.py (PagedKernels' base); the operand checks: launch_checks.py.
A quantized KV cache (issue 18) adds two float32 scale arrays to reshape_and_cache and attention:
fp8 one element per layer (k_scale, v_scale), int8 one per (slot, kv head) beside the blocks.
Sliding-window attention and logit soft-capping (issue 37) are two launch arguments of every attention
kernel (window, softcap; 0 = off); a window shrinks what the v1/v2 choice, v2's grid and v1's shared
memory are sized by to the keys a query can see (key_span). Attention sinks (GPT-OSS) are a float32
[num_heads] device array (None: off) given to v1 and to the v2 reduce, never to v2's partitions: the
sink joins the softmax once.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pagedrun.attention.cuda.launch_checks import (
    c_contiguous_ignoring_size1,
    check,
    check_cache,
    check_launch,
    rows_contiguous,
    same_dtype,
    variant_args,
)
from pagedrun.attention.cuda.prefill_kernels import PrefillLaunch
from pagedrun.attention.cuda.variants import (  # noqa: F401  (re-exported)
    BLOCK_SIZES,
    DTYPES,
    HEAD_SIZES,
    KV_DTYPES,
    MAX_GROUP,
    MAX_QUANTIZED_GROUP,
    NUM_THREADS,
    PARTITION_SIZE,
    PREFILL_CHUNK,
    QUANTIZED_KV_DTYPES,
    WARP_SIZE,
    KernelVariant,
    all_variants,
    dtype_name,
    group_for,
    kv_dtype_name,
    prefill_tile_q,
)

# NVRTC has no default include path: where cuda_fp16.h / cuda_bf16.h are (defined with the ctypes NVRTC)
from pagedrun.build.nvrtc import cuda_include_dirs  # noqa: F401  (re-exported)

KERNEL_DIR = Path(__file__).resolve().parents[3] / "kernels" / "cuda"
ATTENTION_SOURCE = "paged_attention.cu"
CACHE_OPS_SOURCE = "cache_ops.cu"
PREFILL_SOURCE = "prefill_attention.cu"

# v1 only for sequences of one partition (<= PARTITION_SIZE tokens). vLLM keeps v1 up to 8,192
# tokens when (sequences x heads) > 512; on an H200 v2 was faster at every length of two partitions
# and more, 1-byte caches alike (docs/log/2026-11-26-h200-first-session.md), since v1 leaves one
# (head, sequence) block to walk the whole sequence.

DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (max_dynamic_shared_size_bytes)
# gridDim.y and .z are at most 65,535: the attention grid puts (pseudo-)sequences on y, so longer
# launches are split into chunks of rows.
MAX_GRID_Y = 65535


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def load_source(name: str, seen: set[str] | None = None) -> str:
    """A kernel file with its local #include "x.cuh" inlined (NVRTC and the emulator compile one
    string, with no include path to kernels/), each header once per `seen` set and without its
    `#pragma once` (which only nvcc's real includes need). #line keeps file:line in messages true."""
    seen = set() if seen is None else seen
    text = (KERNEL_DIR / name).read_text()

    def inline(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 2  # the line after the #include
        back = f'#line {line} "kernels/{name}"'
        if m.group(1) in seen:
            return back
        seen.add(m.group(1))
        header = re.sub(r"^#pragma once[ \t]*$", "", load_source(m.group(1), seen), flags=re.M)
        return f'#line 1 "kernels/{m.group(1)}"\n{header}\n{back}'

    return _LOCAL_INCLUDE.sub(inline, text)


def full_source() -> str:
    """The .cu files as one translation unit (they include only NVRTC-provided headers)."""
    seen: set[str] = set()
    return "\n".join(load_source(f, seen) for f in (ATTENTION_SOURCE, CACHE_OPS_SOURCE, PREFILL_SOURCE))


# ---------------------------------------------------------------- v1 / v2 choice and shared memory


def key_span(max_seq_len: int, window: int = 0) -> int:
    """The most keys a query of a sequence of <= max_seq_len tokens attends to."""
    return min(max_seq_len, window) if window > 0 else max_seq_len


def spanned_units(max_seq_len: int, window: int, unit: int) -> int:
    """The most aligned `unit`-token chunks (cache blocks, v2 partitions) holding some key of one
    query's range: every chunk of the sequence without a window; with one, the window's keys
    [seq_len - window, seq_len) touch at most 1 + ceil((window - 1) / unit) of them."""
    units = max(1, -(-max_seq_len // unit))
    return min(units, 1 + -(-(window - 1) // unit)) if window > 0 else units


def num_partitions(max_seq_len: int, window: int = 0) -> int:
    """v2's grid depth: partitions are absolute (512 tokens), counted from the one holding the
    window's first key, so a window needs only the partitions it touches."""
    return spanned_units(max_seq_len, window, PARTITION_SIZE)


def use_v1(max_seq_len: int, window: int = 0) -> bool:
    """v1 when every query's keys fit in one partition; v2 (split, then reduced) otherwise."""
    return key_span(max_seq_len, window) <= PARTITION_SIZE


# A grouped launch has num_heads / group times fewer blocks. On an H200 (132 SMs) a launch of fewer
# grouped blocks than SMs was slower than the one-head kernel's, while every launch of 1,024 grouped
# blocks or more beat it clearly (docs/log/2026-11-26-h200-second-session-grouped-decode.md): under
# two blocks per SM the group is dropped.
MIN_BLOCKS_PER_SM = 2


def pick_group(variant: KernelVariant, num_heads: int, num_kv_heads: int, blocks_per_head: int, num_sms: int) -> int:
    """Query heads per block for one launch: the variant's group where it divides the heads per KV
    head and the grid keeps >= MIN_BLOCKS_PER_SM blocks per SM; else one head per block.
    blocks_per_head: sequences x partitions."""
    group = variant.launch_group(num_heads, num_kv_heads)
    if group > 1 and (num_heads // group) * blocks_per_head < MIN_BLOCKS_PER_SM * num_sms:
        return 1
    return group


def v1_shared_mem(max_seq_len: int, head_size: int, block_size: int, group: int = 1, window: int = 0) -> int:
    """Bytes: fp32 logits of the longest sequence (whole blocks; with a window, the blocks it
    touches) per query head of the block, reused for the output reduction."""
    padded = spanned_units(max(max_seq_len, 1), window, block_size) * block_size
    return 4 * group * max(padded, (NUM_THREADS // WARP_SIZE) * head_size)


def v2_shared_mem(head_size: int, group: int = 1) -> int:
    return 4 * group * max(PARTITION_SIZE, (NUM_THREADS // WARP_SIZE) * head_size)


def reduce_shared_mem(max_num_partitions: int) -> int:
    return 4 * 2 * max_num_partitions


# ---------------------------------------------------------------- modules


ModuleFactory = Callable[[str, list[str]], Any]


def cupy_module_factory(code: str, names: list[str]) -> Any:
    import cupy

    options = ("-std=c++17",) + tuple(f"-I{d}" for d in cuda_include_dirs())
    return cupy.RawModule(code=code, options=options, name_expressions=names)


def emulator_module_factory(schedule: str = "round_robin", poison_shared: bool = True) -> ModuleFactory:
    def make(code: str, names: list[str]) -> Any:
        from pagedrun.build.cudaemu import EmuModule

        return EmuModule(code, name_expressions=names, schedule=schedule, poison_shared=poison_shared)

    return make


Alloc = Callable[[tuple, Any], Any]  # (shape, numpy dtype) -> an uninitialised device array


class PagedKernels(PrefillLaunch):
    """The five kernels of one variant, with launchers (prefill_attention: PrefillLaunch). `xp`
    allocates v2 scratch buffers unless a launch is given `alloc` (the CuPy backend allocates
    through torch, so its caching allocator and the memory profile see the scratch)."""

    def __init__(self, variant: KernelVariant, module: Any, xp: Any, smem_optin: int | None = None):
        self.variant = variant
        self.xp = xp
        self.module = module  # a cupy.RawModule or EmuModule holding (at least) this variant's kernels
        # The device's sharedMemPerBlockOptin (static + dynamic); None: let the launch report it.
        self.smem_optin = smem_optin
        self.max_grid_y = MAX_GRID_Y  # tests lower it to exercise the chunking
        self.num_sms = 1  # the device's multiprocessors (pick_group); the emulator counts as one
        self._functions: dict[str, Any] = {}

    def function(self, name: str, shared_mem: int = 0) -> Any:
        """The kernel, opted in to `shared_mem` bytes of dynamic shared memory when its current
        limit is lower. The limit is read from the function, never assumed to be 48 KiB: the default
        may be 48 KiB minus the kernel's static shared memory (GPU-REVIEW Q1)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.module.get_function(name)
        limit = getattr(fn, "max_dynamic_shared_size_bytes", None)
        if limit is not None and shared_mem > limit:
            static = int(getattr(fn, "shared_size_bytes", 0) or 0)
            check(self.smem_optin is None or static + shared_mem <= self.smem_optin,
                  lambda: f"{name} needs {shared_mem} B dynamic + {static} B static shared memory, over the "
                  f"device's {self.smem_optin} B per block (sharedMemPerBlockOptin)")
            fn.max_dynamic_shared_size_bytes = shared_mem
        return fn

    # ------------------------------------------------------------ cache ops

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping,
                          k_scales=None, v_scales=None) -> None:
        """key/value [num_tokens, num_kv_heads, head_size] -> their slots; slot < 0 is skipped.
        A quantized cache takes float32 k/v_scales: fp8 [1] (read), int8 [num_blocks, block_size,
        num_kv_heads] (written beside the rows)."""
        num_tokens = int(slot_mapping.shape[0])
        if num_tokens == 0:
            return
        _, block_size, num_kv_heads, head_size = key_cache.shape
        check_cache(self.variant, key_cache, value_cache, k_scales, v_scales)
        for name, t in (("key", key), ("value", value)):
            check(t.ndim == 3 and tuple(t.shape[1:]) == (num_kv_heads, head_size), lambda: f"{name} shape {t.shape}")
            check(rows_contiguous(t), lambda: f"{name} rows must be contiguous")
            check(same_dtype(t.dtype, self.variant.np_dtype),
                  lambda: f"{name} dtype {t.dtype} != the model dtype {self.variant.dtype}")
        check(slot_mapping.dtype == np.int64, "slot_mapping must be int64")
        row = num_kv_heads * head_size
        # int8: one warp per kv head (the head's max |x| is a warp reduction), at most 16 warps
        threads = 32 * min(num_kv_heads, 16) if self.variant.kv_dtype == "int8" else min(row, 512)
        fn = self.function(self.variant.reshape_and_cache_name)
        fn(
            (num_tokens, 1, 1),
            (threads, 1, 1),
            (
                key, value, key_cache, value_cache, slot_mapping,
                np.int32(key.strides[0] // key.itemsize), np.int32(value.strides[0] // value.itemsize),
                np.int32(num_kv_heads), np.int32(head_size), k_scales, v_scales,
            ),
        )

    # ------------------------------------------------------------ attention

    def paged_attention(
        self, out, query, key_cache, value_cache, block_tables, seq_lens, max_seq_len: int,
        scale: float, version: str | None = None, alloc: Alloc | None = None, k_scales=None, v_scales=None,
        group: int | None = None, *, window: int = 0, softcap: float = 0.0, sinks=None,
    ) -> str:
        """out/query [num_seqs, num_heads, head_size]; seq i attends to its first seq_lens[i] cached tokens.
        k/v_scales: a quantized cache's float32 scales (see reshape_and_cache).
        window > 0: seq i's query (position seq_lens[i] - 1) sees only the last `window` of them, and
        the kernels read no block wholly below that (a placeholder's contents never matter);
        softcap > 0: each logit becomes softcap * tanh(logit / softcap) before the softmax;
        sinks (float32 [num_heads] device array, None: off): head h's sink logit joins its softmax.

        max_seq_len must be >= every seq_lens entry: it sizes v1's shared memory and v2's grid.
        Returns the version launched ("v1" or "v2"); `version` forces one (tests, benchmarks), and
        `group` the query heads per block (1 or the variant's; default: pick_group).
        More than max_grid_y sequences are launched in chunks of rows (sequences sit on gridDim.y).
        """
        num_seqs, num_heads, head_size = (int(s) for s in query.shape)
        if num_seqs == 0:
            return "none"
        _, block_size, num_kv_heads, _ = key_cache.shape
        check_launch(self.variant, out, query, key_cache, value_cache, block_tables, k_scales, v_scales)
        check(seq_lens.dtype == np.int32 and int(seq_lens.shape[0]) == num_seqs and c_contiguous_ignoring_size1(seq_lens),
              "seq_lens must be contiguous int32 [num_seqs]")
        check(int(block_tables.shape[0]) == num_seqs, "block_tables rows != num_seqs")
        max_seq_len = max(int(max_seq_len), 1)
        if self.xp is np and num_seqs:  # cheap on the host; on a GPU it would cost a sync
            check(int(seq_lens.max()) <= max_seq_len,
                  lambda: f"seq_lens max {int(seq_lens.max())} > max_seq_len {max_seq_len}")
        check(int(block_tables.shape[1]) * block_size >= max_seq_len,
              lambda: f"block_tables has {block_tables.shape[1]} columns, too few for max_seq_len {max_seq_len}")
        window, softcap = variant_args(window, softcap, sinks, num_heads)
        if window >= max_seq_len:  # no query has more keys than the window: full attention (and an int32)
            window = 0
        if version is None:
            version = "v1" if use_v1(max_seq_len, window) else "v2"
        if version not in ("v1", "v2"):
            raise ValueError(f"paged attention version {version!r}: v1 or v2")
        per_head = num_seqs * (num_partitions(max_seq_len, window) if version == "v2" else 1)
        if group is None:
            group = pick_group(self.variant, num_heads, num_kv_heads, per_head, self.num_sms)
        grouped = self.variant.launch_group(num_heads, num_kv_heads)
        check(group in (1, grouped), lambda: f"group {group}: this variant launches 1 or {grouped}")
        # A single row may carry a normalised stride (DLPack's size-1 rule); it is never stepped over.
        q_stride = np.int32(query.strides[0] // query.itemsize if num_seqs > 1 else num_heads * head_size)
        empty = alloc or (lambda shape, dtype: self.xp.empty(shape, dtype=dtype))
        for lo in range(0, num_seqs, self.max_grid_y):
            hi = min(num_seqs, lo + self.max_grid_y)
            rows = (out[lo:hi], query[lo:hi], block_tables[lo:hi], seq_lens[lo:hi])
            self._attention_launch(version, *rows, key_cache, value_cache, k_scales, v_scales, num_kv_heads,
                                   q_stride, max_seq_len, scale, empty, group, window, softcap, sinks)
        return version

    def _attention_launch(self, version, out, query, block_tables, seq_lens, key_cache, value_cache,
                          k_scales, v_scales, num_kv_heads, q_stride, max_seq_len, scale, empty, group,
                          window, softcap, sinks=None) -> None:
        v = self.variant
        num_seqs, num_heads, head_size = (int(s) for s in query.shape)
        common = (
            query, key_cache, value_cache, k_scales, v_scales, np.int32(num_kv_heads), np.float32(scale),
            block_tables, seq_lens, np.int32(block_tables.shape[1]), q_stride, np.int32(window), np.float32(softcap),
        )
        block = (NUM_THREADS, 1, 1)
        name = v.attention_name(version, group)
        if version == "v1":
            smem = v1_shared_mem(max_seq_len, head_size, v.block_size, group, window)
            self.function(name, smem)((num_heads // group, num_seqs, 1), block, (out,) + common + (sinks,),
                                      shared_mem=smem)
            return
        parts = num_partitions(max_seq_len, window)
        exp_sums = empty((num_seqs, num_heads, parts), np.float32)
        max_logits = empty((num_seqs, num_heads, parts), np.float32)
        tmp_out = empty((num_seqs, num_heads, parts, head_size), np.float32)
        smem = v2_shared_mem(head_size, group)
        self.function(name, smem)(
            (num_heads // group, num_seqs, parts), block, (exp_sums, max_logits, tmp_out) + common, shared_mem=smem
        )
        rsmem = reduce_shared_mem(parts)
        self.function(v.reduce_name, rsmem)(
            (num_heads, num_seqs, 1), block,
            (out, exp_sums, max_logits, tmp_out, seq_lens, np.int32(parts), np.int32(window), sinks),
            shared_mem=rsmem,
        )


def build_kernels(
    factory: ModuleFactory, variants: list[KernelVariant], xp: Any,
    parts: tuple[str, ...] = ("v1", "v2", "cache", "prefill"), code: str | None = None,
) -> dict[KernelVariant, PagedKernels]:
    """One module holding several variants (one compile, which is what costs under the emulator)."""
    names = list(dict.fromkeys(n for v in variants for n in v.name_expressions(parts)))
    module = factory(code if code is not None else full_source(), names)
    return {v: PagedKernels(v, module, xp) for v in variants}


@functools.lru_cache(maxsize=None)
def emulated_kernels(variant: KernelVariant, schedule: str = "round_robin") -> PagedKernels:
    """Compiled once per process per (variant, schedule): emulator compiles are the slow part."""
    from pagedrun.build.cudaemu.module import MAX_OPT_IN_SHARED

    ker = build_kernels(emulator_module_factory(schedule), [variant], np)[variant]
    ker.smem_optin = MAX_OPT_IN_SHARED
    return ker


@functools.lru_cache(maxsize=None)
def cupy_kernels(variant: KernelVariant, device: int = 0) -> PagedKernels:
    import cupy

    ker = build_kernels(cupy_module_factory, [variant], cupy)[variant]
    props = cupy.cuda.runtime.getDeviceProperties(device)
    ker.smem_optin = int(props["sharedMemPerBlockOptin"])
    ker.num_sms = int(props["multiProcessorCount"])
    return ker
