"""The operand checks of the attention and cache launches (pagedrun.attention.cuda.kernels: the decode
and cache launches; prefill_kernels: the varlen prefill): shapes, strides, dtypes and the variant's
launch arguments, each failure a ValueError ("paged kernels: ...") before any kernel runs.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from pagedrun.attention.cuda.variants import KernelVariant


def check_launch(variant: KernelVariant, out, query, key_cache, value_cache, block_tables, k_scales, v_scales) -> None:
    """What the decode and the prefill kernels both require of their operands."""
    num_heads, head_size = int(query.shape[1]), int(query.shape[2])
    num_kv_heads, cache_head_size = int(key_cache.shape[2]), int(key_cache.shape[3])
    check_cache(variant, key_cache, value_cache, k_scales, v_scales)
    check(head_size == cache_head_size, lambda: f"query head_size {head_size} != cache {cache_head_size}")
    check(num_heads % num_kv_heads == 0,
          lambda: f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    check(rows_contiguous(query), "query heads must be contiguous")
    check(same_dtype(query.dtype, variant.np_dtype) and same_dtype(out.dtype, variant.np_dtype),
          lambda: f"query/out dtype != the model dtype {variant.dtype}")
    check(c_contiguous_ignoring_size1(out) and tuple(out.shape) == tuple(query.shape),
          "out must be contiguous like query")
    check(block_tables.dtype == np.int32 and c_contiguous_ignoring_size1(block_tables) and block_tables.ndim == 2,
          "block_tables must be contiguous int32 [num_seqs, max_blocks]")


def check_cache(variant: KernelVariant, key_cache, value_cache, k_scales, v_scales) -> None:
    """The caches (and a quantized cache's scales) the variant reads: shape, layout, dtype."""
    v = variant
    check(key_cache.ndim == 4 and tuple(key_cache.shape) == tuple(value_cache.shape),
          "key/value caches must be [num_blocks, block_size, num_kv_heads, head_size]")
    check(c_contiguous_ignoring_size1(key_cache) and c_contiguous_ignoring_size1(value_cache),
          "caches must be contiguous")
    check(same_dtype(key_cache.dtype, v.cache_np_dtype) and same_dtype(value_cache.dtype, v.cache_np_dtype),
          lambda: f"cache dtype {key_cache.dtype} != {np.dtype(v.cache_np_dtype)} (kv_cache_dtype {v.kv_dtype})")
    if not v.quantized:
        check(k_scales is None and v_scales is None, "an unquantized cache takes no scales")
        return
    want = tuple(int(n) for n in key_cache.shape[:3]) if v.kv_dtype == "int8" else (1,)
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        check(t is not None, lambda: f"kv_cache_dtype {v.kv_dtype} needs {name}")
        check(t.dtype == np.float32 and int(np.prod(t.shape)) == int(np.prod(want))
              and (t.ndim <= 1 or tuple(int(n) for n in t.shape) == want) and c_contiguous_ignoring_size1(t),
              lambda: f"{name} must be contiguous float32 {list(want)}, got {t.dtype} {list(t.shape)}")


def variant_args(window, softcap, sinks, num_heads: int) -> tuple[int, float]:
    """The attention variant's launch arguments checked (both kernels take the same): window as an
    int, softcap as a float, sinks None or contiguous float32 [num_heads]."""
    window, softcap = int(window), float(softcap)
    check(window >= 0, lambda: f"window {window}: >= 0 (0: full causal attention)")
    check(softcap >= 0 and math.isfinite(softcap), lambda: f"softcap {softcap}: finite, >= 0 (0: off)")
    check(sinks is None or (sinks.dtype == np.float32 and tuple(int(n) for n in sinks.shape) == (num_heads,)
                            and c_contiguous_ignoring_size1(sinks)),
          lambda: f"sinks must be contiguous float32 [{num_heads}], got {sinks.dtype} {list(sinks.shape)}")
    return window, softcap


def check(ok: bool, message: str | Callable[[], str]) -> None:
    """A formatted message comes as a lambda: built only when the check fails (these run for
    every layer of every step, and formatting dtypes cost more than the checks)."""
    if not ok:
        raise ValueError(f"paged kernels: {message() if callable(message) else message}")


def same_dtype(have, want) -> bool:
    """Array dtype check; bf16 travels as uint16 (numpy views) or int16 (the CuPy DLPack view)."""
    have, want = np.dtype(have), np.dtype(want)
    return have == want or (want == np.uint16 and have == np.int16)


def rows_contiguous(a) -> bool:
    """[rows, heads, head_size] with each row's heads packed: head_size elements of stride 1, heads
    head_size apart. Dimensions of size 1 are not checked: torch 1.13 to about 2.9 export stride 1
    for them through DLPack (so MQA's single KV head would look non-contiguous) and no
    kernel ever steps along them."""
    if a.ndim != 3:
        return False
    expect = (None, int(a.shape[2]) * a.itemsize, a.itemsize)
    return all(int(a.shape[d]) <= 1 or a.strides[d] == expect[d] for d in (1, 2))


def c_contiguous_ignoring_size1(a) -> bool:
    """C-contiguous, with the strides of size-1 dimensions ignored (DLPack's normalisation)."""
    expect = a.itemsize
    for d in range(a.ndim - 1, -1, -1):
        if int(a.shape[d]) > 1 and a.strides[d] != expect:
            return False
        expect *= int(a.shape[d])
    return True
