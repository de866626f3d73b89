"""Achieved memory bandwidth of the paged decode kernel (kernels/cuda/paged_attention.cu) on a GPU,
as a fraction of a measured device-to-device copy.

    python3 benchmarks/kernel_bandwidth.py [--dtype bfloat16] [--head-size 128] [--configs 64x4096,8x16384]
                                           [--kv-cache-dtype auto|fp8_e4m3|fp8_e5m2|int8] [--iters 50] [--json PATH]
                                           [--define PR_V_BATCH=4 ...]

Decode attention reads every cached K and V row of every sequence once per kv head group, so its
roofline is memory bandwidth: bandwidth = bytes of K/V read / kernel time. With GQA the kernels
take the query heads of one kv head in one block (--group, default K.group_for); the one-head-per-
block kernels, which re-read each row once per query head (mostly from L2), are timed beside them. What keeps this a
bandwidth measurement and not a measurement of Python or of L2:

- launch overhead out: `iters` launches are captured once in a CUDA graph and the graph is timed
  (a launch through pagedrun's Python launcher costs 50-100 us, more than small kernels take);
  where capture fails, the launches are queued and timed with events, and the row says "queued";
- L2 out: each configuration's K/V is replicated until the copies together exceed 4 x L2, and
  consecutive launches read different copies;
- the roof is measured: a 2 GiB cudaMemcpy device-to-device, counted as bytes read + written
  (how an H100's ~3.0 TB/s is usually quoted), not the theoretical clock x bus width.

A quantized cache (issue 18) reads 1 byte per element (+ 4-byte K and V scales per (token, kv head)
for int8): bytes counted are those, so GB/s stays comparable to the roof and the `us` column shows
what the smaller cache buys against --kv-cache-dtype auto at the same configuration.

Rows: the version kernels.use_v1 picks, then v1 and v2 forced (v1 above 48 KiB of logits opts in to
more shared memory: 32k tokens need 128 KiB), then the picked version with one head per block
("1-head"). Prints one line and exits 2 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedrun.attention.cuda import kernels as K  # noqa: E402

DEFAULT_CONFIGS = "1x4096,8x1024,32x512,64x2048,64x4096,128x1024,8x16384,4x32768"
L2_MULTIPLE = 4  # K/V copies together exceed this many L2s


def gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


def parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        seqs, _, ctx = item.strip().partition("x")
        if not (seqs.isdigit() and ctx.isdigit() and int(seqs) > 0 and int(ctx) > 0):
            raise SystemExit(f"--configs: {item!r} is not SEQSxCONTEXT (e.g. 64x4096)")
        out.append((int(seqs), int(ctx)))
    return out


def copies_for_l2(kv_bytes: int, l2_bytes: int, multiple: int = L2_MULTIPLE) -> int:
    """How many K/V copies to rotate through so that their sum exceeds multiple x L2."""
    return max(1, -(-(multiple * l2_bytes + 1) // max(kv_bytes, 1)))


def measured_copy_gbs(nbytes: int = 2**31, reps: int = 20) -> float:
    """Device-to-device cudaMemcpy bandwidth, bytes read + written per second / 1e9."""
    import cupy

    x = cupy.empty(nbytes, dtype=cupy.uint8)
    y = cupy.empty_like(x)
    y.data.copy_from_device(x.data, nbytes)  # warm-up
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        y.data.copy_from_device(x.data, nbytes)
    stop.record()
    stop.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / reps
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / seconds / 1e9


def setup(variant: K.KernelVariant, num_seqs: int, context: int, num_heads: int, num_kv_heads: int,
          copies: int, seed: int = 0):
    """`copies` independent K/V caches (same block tables), one query/out; K/V bytes of one copy."""
    import cupy

    rng = np.random.default_rng(seed)
    bs, D = variant.block_size, variant.head_size
    blocks_per_seq = -(-context // bs)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, bs, num_kv_heads, D)

    def make(shape):
        x = cupy.random.standard_normal(shape, dtype=np.float32)
        if variant.dtype == "bfloat16":  # the top 16 bits of fp32 are a bf16
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(variant.np_dtype)

    def make_cache():  # (cache, scales): random finite codes for a quantized cache
        if not variant.quantized:
            return make(cache_shape), None
        if variant.kv_dtype == "int8":
            codes = cupy.random.randint(-127, 128, cache_shape, dtype=np.int32).astype(np.int8)
            return codes, cupy.random.uniform(0.001, 0.02, cache_shape[:3], dtype=np.float32)
        top = 0x7E if variant.kv_dtype == "fp8_e4m3" else 0x7B  # largest finite magnitude code
        mag = cupy.random.randint(0, top + 1, cache_shape, dtype=np.int32)
        sign = cupy.random.randint(0, 2, cache_shape, dtype=np.int32) << 7
        return (mag | sign).astype(np.uint8), cupy.full((1,), 0.05, dtype=np.float32)

    caches = []
    for _ in range(copies):
        (kc, ks), (vc, vs) = make_cache(), make_cache()
        caches.append((kc, vc, ks, vs))
    query = make((num_seqs, num_heads, D))
    block_tables = cupy.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq))
    seq_lens = cupy.full((num_seqs,), context, dtype=np.int32)
    out = cupy.empty_like(query)
    # Everything above ran on the legacy default stream; time_kernel launches on a non-blocking stream,
    # which does not wait for it. Unsynchronised, the first launch read block tables that were not yet
    # written (the H200's illegal address at 8x16384, 2026-11-26).
    cupy.cuda.Device().synchronize()
    return out, query, caches, block_tables, seq_lens, kv_read_bytes(variant, num_seqs, context, num_kv_heads)


def kv_read_bytes(variant: K.KernelVariant, num_seqs: int, context: int, num_kv_heads: int) -> int:
    """K and V bytes one decode launch reads (int8 adds its two float scales per row)."""
    row = variant.head_size * np.dtype(variant.cache_np_dtype).itemsize + (4 if variant.kv_dtype == "int8" else 0)
    return 2 * num_seqs * context * num_kv_heads * row


class FixedScratch:
    """v2's partials allocated once, outside any graph capture, and reused by every launch: the
    n-th buffer of a shape asked for within one launch is always the same array."""

    def __init__(self) -> None:
        self.buffers: dict = {}
        self.counts: dict = {}

    def reset(self) -> None:
        self.counts.clear()

    def __call__(self, shape, dtype):
        import cupy

        key = (tuple(shape), np.dtype(dtype).str)
        n = self.counts[key] = self.counts.get(key, -1) + 1
        if (key, n) not in self.buffers:
            self.buffers[(key, n)] = cupy.empty(shape, dtype=dtype)
        return self.buffers[(key, n)]


def time_kernel(ker, out, query, caches, block_tables, seq_lens, context, scale, version, iters, group=None):
    """Seconds per launch, the version launched, and how it was timed ("graph" or "queued").
    group: forced query heads per block (None: the launcher's pick_group)."""
    import cupy

    alloc = FixedScratch()

    def launch(i):
        kc, vc, ks, vs = caches[i % len(caches)]
        alloc.reset()
        return ker.paged_attention(out, query, kc, vc, block_tables, seq_lens, context, scale,
                                   version=version, alloc=alloc, k_scales=ks, v_scales=vs, group=group)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        used = launch(0)  # warm-up: module load, opt-in, scratch allocation
        stream.synchronize()
        how = "graph"
        try:
            stream.begin_capture()
            for i in range(iters):
                launch(i)
            graph = stream.end_capture()
            graph.launch(stream)  # warm the graph once
        except Exception:  # capture unsupported here: fall back to queued launches
            how = "queued"
            try:
                stream.end_capture()
            except Exception:
                pass
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        if how == "graph":
            graph.launch(stream)
        else:
            for i in range(iters):
                launch(i)
        stop.record(stream)
        stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / iters, used, how


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=list(K.DTYPES))
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(K.KV_DTYPES))
    p.add_argument("--group", type=int, default=None,
                   help="query heads per block (default: K.group_for the heads; 1: one block per query head)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="SEQSxCONTEXT,... (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="compile the kernels with this macro (e.g. PR_V_BATCH=4, kernels/cuda/attention_common.cuh)")
    a = p.parse_args(argv)
    for d in a.define:
        if not re.fullmatch(r"PR_[A-Z0-9_]+=\d+", d):
            raise SystemExit(f"--define: {d!r} is not PR_NAME=INTEGER (e.g. PR_V_BATCH=4)")
    configs = parse_configs(a.configs)
    if not gpu_available():
        print("no GPU: cupy.is_available() is false; kernel bandwidth benchmark skipped")
        return 2  # nothing measured: a caller such as gpu_check.sh must not read this as a pass
    import cupy

    dev = cupy.cuda.Device().id
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    l2 = int(props.get("l2CacheSize", 50 * 2**20))
    group = a.group if a.group is not None else K.group_for(a.num_heads, a.num_kv_heads, a.kv_cache_dtype)
    variant = K.KernelVariant(a.dtype, a.head_size, a.block_size, a.kv_cache_dtype, group)
    if a.define:  # its own module, compiled with the macros in front of the kernels' source
        code = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in a.define) + K.full_source()
        ker = K.build_kernels(K.cupy_module_factory, [variant], cupy, code=code)[variant]
        ker.smem_optin, ker.num_sms = int(props["sharedMemPerBlockOptin"]), int(props["multiProcessorCount"])
    else:
        ker = K.cupy_kernels(variant, dev)  # its module holds the one-head-per-block kernels too
    roof = measured_copy_gbs()
    print(f"device: {name}; L2 {l2 / 2**20:.0f} MiB; measured D2D copy {roof:.0f} GB/s (read + written)")
    print(f"variant: {variant}, heads {a.num_heads} / kv heads {a.num_kv_heads}, {a.iters} launches per timing"
          + (f", compiled with {' '.join(a.define)}" if a.define else ""))
    header = (f"{'seqs':>5} {'context':>8} {'KV MiB':>8} {'copies':>6} {'pick':>4} | {'us':>8} {'GB/s':>6} {'% copy':>6}"
              f" | {'v1 GB/s':>7} {'v2 GB/s':>7} {'1-head':>7} | timed")
    print(header)
    print("-" * len(header))
    rows = []
    scale = a.head_size**-0.5
    for num_seqs, context in configs:
        probe = kv_read_bytes(variant, num_seqs, context, a.num_kv_heads)
        copies = copies_for_l2(probe, l2)
        out, q, caches, bt, sl, kv_bytes = setup(variant, num_seqs, context, a.num_heads, a.num_kv_heads, copies)
        t_auto, picked, how = time_kernel(ker, out, q, caches, bt, sl, context, scale, None, a.iters)
        forced = {}
        # 1-head: the picked version with one block per query head, for the grouped ones to be compared with
        for v, version, g in (("v1", "v1", None), ("v2", "v2", None), ("1-head", picked, 1)):
            if v == "1-head" and group == 1:
                forced[v] = float("nan")
                continue
            try:
                forced[v] = kv_bytes / time_kernel(ker, out, q, caches, bt, sl, context, scale, version, a.iters,
                                                   g)[0] / 1e9
            except Exception as e:  # e.g. v1's logits beyond the device's shared memory
                print(f"  {v} forced at {num_seqs}x{context}: {type(e).__name__}: {e}")
                forced[v] = float("nan")
        bw = kv_bytes / t_auto / 1e9
        row = dict(seqs=num_seqs, context=context, kv_mib=kv_bytes / 2**20, copies=copies, picked=picked,
                   us=t_auto * 1e6, gbs=bw, pct_copy=100 * bw / roof, v1_gbs=forced["v1"], v2_gbs=forced["v2"],
                   one_head_gbs=forced["1-head"], timed=how)
        rows.append(row)
        print(f"{num_seqs:>5} {context:>8} {row['kv_mib']:>8.0f} {copies:>6} {picked:>4} | {row['us']:>8.1f} {bw:>6.0f}"
              f" {row['pct_copy']:>5.0f}% | {forced['v1']:>7.0f} {forced['v2']:>7.0f} {forced['1-head']:>7.0f} | {how}")
        del out, q, caches, bt, sl
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(dict(device=name, l2_bytes=l2, copy_gbs=roof, variant=str(variant),
                                          num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
