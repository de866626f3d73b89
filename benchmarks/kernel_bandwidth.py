"""Achieved memory bandwidth of the paged decode kernel (kernels/paged_attention.cu) on a GPU.

    python3 benchmarks/kernel_bandwidth.py [--iters 50] [--dtype float16] [--quick]

Decode attention reads every cached K and V row of every sequence once per kv head group, so its
roofline is memory bandwidth: bandwidth = bytes of K/V read / kernel time. Bytes count each (token,
kv head) row of K and V once, as HBM traffic; GQA query heads of one kv head re-read the same rows,
mostly from L2. Prints a table per (batch, context) with the version the launcher picks (v1/v2
by vLLM's rule) and both versions forced. Exits 0 with "no GPU" when cupy sees none.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedrun.attention import kernels as K  # noqa: E402


def gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


def peak_bandwidth_gbs() -> float | None:
    import cupy

    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    except Exception:
        return None


def setup(variant: K.KernelVariant, num_seqs: int, context: int, num_heads: int, num_kv_heads: int, seed: int = 0):
    import cupy

    rng = np.random.default_rng(seed)
    bs, D = variant.block_size, variant.head_size
    blocks_per_seq = -(-context // bs)
    num_blocks = num_seqs * blocks_per_seq
    dt = variant.np_dtype
    cache_shape = (num_blocks, bs, num_kv_heads, D)
    if variant.dtype == "bfloat16":  # random bf16 bits with a sane exponent range
        make = lambda shape: cupy.asarray(  # noqa: E731
            (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
    else:
        make = lambda shape: cupy.random.standard_normal(shape, dtype=np.float32).astype(dt)  # noqa: E731
    key_cache, value_cache = make(cache_shape), make(cache_shape)
    query = make((num_seqs, num_heads, D))
    block_tables = cupy.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq))
    seq_lens = cupy.full((num_seqs,), context, dtype=np.int32)
    out = cupy.empty_like(query)
    kv_bytes = 2 * num_seqs * context * num_kv_heads * D * np.dtype(dt).itemsize
    return (out, query, key_cache, value_cache, block_tables, seq_lens), kv_bytes


def time_kernel(ker: K.PagedKernels, args, context: int, scale: float, version: str | None, iters: int) -> tuple[float, str]:
    import cupy

    used = ker.paged_attention(*args, context, scale, version=version)  # warm-up (and module load)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        ker.paged_attention(*args, context, scale, version=version)
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / iters * 1e-3, used


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float16", choices=list(K.DTYPES))
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="two configurations only")
    a = p.parse_args(argv)
    if not gpu_available():
        print("no GPU: cupy.is_available() is false; kernel bandwidth benchmark skipped")
        return 0
    import cupy

    variant = K.KernelVariant(a.dtype, a.head_size, a.block_size)
    ker = K.cupy_kernels(variant)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    peak = peak_bandwidth_gbs()
    print(f"device: {name}; peak DRAM bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown'}")
    print(f"variant: {variant}, heads {a.num_heads} / kv heads {a.num_kv_heads}, {a.iters} iterations each")
    configs = [(8, 1024), (64, 2048)] if a.quick else [
        (1, 4096), (8, 1024), (8, 8192), (32, 512), (64, 2048), (128, 1024), (256, 512), (16, 16384),
    ]
    header = f"{'seqs':>5} {'context':>8} {'KV MiB':>8} {'pick':>4} | {'auto us':>9} {'GB/s':>7} | {'v1 GB/s':>8} {'v2 GB/s':>8}"
    if peak:
        header += f" | {'% peak':>6}"
    print(header)
    print("-" * len(header))
    scale = a.head_size**-0.5
    for num_seqs, context in configs:
        args, kv_bytes = setup(variant, num_seqs, context, a.num_heads, a.num_kv_heads)
        t_auto, picked = time_kernel(ker, args, context, scale, None, a.iters)
        gbs = {v: kv_bytes / time_kernel(ker, args, context, scale, v, a.iters)[0] / 1e9 for v in ("v1", "v2")}
        bw = kv_bytes / t_auto / 1e9
        row = (f"{num_seqs:>5} {context:>8} {kv_bytes / 2**20:>8.1f} {picked:>4} | {t_auto * 1e6:>9.1f} {bw:>7.0f} |"
               f" {gbs['v1']:>8.0f} {gbs['v2']:>8.0f}")
        if peak:
            row += f" | {100 * bw / peak:>5.0f}%"
        print(row)
        del args
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
