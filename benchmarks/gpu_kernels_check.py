"""Kernel checks that need a GPU (benchmarks/gpu_check.sh runs them; GPU-REVIEW's appendix, extended).

    python3 benchmarks/gpu_kernels_check.py small   # every kernel once per dtype (the compute-sanitizer target)
    python3 benchmarks/gpu_kernels_check.py big     # caches past 2^31 elements: 64-bit offsets (~9 GiB)
    python3 benchmarks/gpu_kernels_check.py stream  # the CuPy backend on a non-default torch stream, MQA too
    python3 benchmarks/gpu_kernels_check.py smem    # v1 at exactly 48 KiB dynamic + static smem (GPU-REVIEW Q1)
    python3 benchmarks/gpu_kernels_check.py quantized  # fp8 / int8 KV caches: the emulator-checked cases on the GPU
    python3 benchmarks/gpu_kernels_check.py prefill    # the varlen prefill kernel (a compute-sanitizer target too)

Each prints "<name>: ok ..." or raises. Run from the repository root.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "attention" / "cuda")]

import numpy as np  # noqa: E402
import test_kernels as T  # noqa: E402

from pagedrun.attention.cuda import kernels as K  # noqa: E402

NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens_arr")


def run(ker, case, version, kc=None, vc=None, bt=None, group=None):
    import cupy

    q, k, v, b, s = (cupy.asarray(getattr(case, n)) for n in NAMES)
    out = cupy.empty(case.query.shape, dtype=case.query.dtype)
    used = ker.paged_attention(out, q, k if kc is None else kc, v if vc is None else vc,
                               b if bt is None else bt, s, case.max_seq_len, case.scale, version=version, group=group)
    cupy.cuda.runtime.deviceSynchronize()
    return T.to_f64(cupy.asnumpy(out), case.variant.dtype), used


def small():
    """v1, v2 + reduce and reshape_and_cache, once per dtype: short enough for racecheck."""
    import cupy

    for dt in T.DTYPES:
        v = T.v2_variants(dt)[0]
        ker = K.cupy_kernels(dataclasses.replace(v, group=K.group_for(4, 2)))  # and 2 query heads per block
        case = T.make_case(v, [1, 37, 513, 1100], 4, 2, seed=1)
        for ver in ("v1", "v2"):
            for g in (1, 2):  # forced: so few blocks would launch one head per block (pick_group)
                T.assert_close(run(ker, case, ver, group=g)[0], case.reference(), dt, f"{v} {ver} group {g}")
        bs, D = v.block_size, v.head_size
        rng = np.random.default_rng(0)
        key = cupy.asarray(T.to_device_dtype(rng.standard_normal((5, 2, D)), dt))
        kc = cupy.asarray(T.to_device_dtype(rng.standard_normal((4, bs, 2, D)), dt))
        vc = kc.copy()
        ker.reshape_and_cache(key, key, kc, vc, cupy.asarray(np.array([0, -1, 3, bs, 2 * bs + 1], np.int64)))
        cupy.cuda.runtime.deviceSynchronize()
        assert bool((kc.reshape(-1, 2, D)[bs] == key[3]).all())
    print("small: ok (v1, v2 one-head and grouped, reduce, reshape_and_cache x 3 dtypes)")


def big():
    import cupy

    v = K.KernelVariant("float16", 128, 16)
    ker = K.cupy_kernels(dataclasses.replace(v, group=4))  # and MQA 4/1's one block for all four heads
    case = T.make_case(v, [700, 37], 4, 1, seed=5)  # 2 partitions; kv heads 1 -> 2048 elements per block
    nsmall = case.key_cache.shape[0]
    nb = 2**31 // (16 * 1 * 128) + 4096  # > 2^31 elements per cache (4.3 GB each)
    kc = cupy.full((nb, 16, 1, 128), np.nan, dtype=np.float16)
    vc = cupy.full_like(kc, np.nan)
    top = np.arange(nb - nsmall, nb)  # the highest block ids: element offsets > 2^31
    kc[cupy.asarray(top)] = cupy.asarray(case.key_cache)
    vc[cupy.asarray(top)] = cupy.asarray(case.value_cache)
    bt = cupy.asarray(top[case.block_tables].astype(np.int32))
    for ver in ("v1", "v2"):
        for g in (1, 4):  # forced: two sequences would launch one head per block (pick_group)
            T.assert_close(run(ker, case, ver, kc, vc, bt, group=g)[0], case.reference(), "float16",
                           f"big {ver} group {g}")
    rng = np.random.default_rng(1)
    key = cupy.asarray(rng.standard_normal((2, 1, 128)).astype(np.float16))
    slots = np.array([(nb - 1) * 16 + 5, 7], np.int64)
    ker.reshape_and_cache(key, key, kc, vc, cupy.asarray(slots))
    cupy.cuda.runtime.deviceSynchronize()
    assert bool((kc[nb - 1, 5, 0] == key[0, 0]).all())
    print("big: ok (offsets past 2^31 elements)")


def stream():
    """Every prefill mode, GQA and MQA (one KV head: torch <= 2.9 exports its strides as 1), on a
    side stream whose query lands only after tens of ms of queued work."""
    import torch

    from pagedrun.attention.cuda.cupy_backend import CupyAttentionBackend

    for spec, heads, kv_heads in ((T.StepSpec([16, 0, 33], [4, 6, 1]), 9, 3), (T.StepSpec([40, 0, 7], [3, 5, 1]), 4, 1)):
        for prefill in ("varlen", "sdpa", "kernel"):
            q, k, v, kc, vc, meta, fk, fv = T.build_step(spec, torch.float16, 64, 16, heads, kv_heads, seed=3)
            ref = T.causal_reference(q, meta, fk, fv, 0.125, heads, kv_heads)
            for name in ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc"):
                setattr(meta, name, getattr(meta, name).cuda())
            kc, vc, k, v = kc.cuda(), vc.cuda(), k.cuda(), v.cuda()
            qc = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
            q_pinned = q.pin_memory()
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                x = torch.randn(8192, 8192, device="cuda")
                for _ in range(20):  # tens of ms queued on s before the query lands
                    x = x @ x / 8192
                qc.copy_(q_pinned, non_blocking=True)  # a launch on another stream would still see NaN
                out = CupyAttentionBackend(prefill=prefill).forward(qc, k, v, kc, vc, meta, 0.125)
            torch.cuda.synchronize()
            n = sum(spec.query_lens)
            T.assert_close(out[:n].double().cpu().numpy(), ref[:n].numpy(), "float16",
                           f"side stream, {prefill} prefill, kv heads {kv_heads}")
    print("stream: ok (side stream; varlen, sdpa and kernel prefill; GQA 9/3 and MQA 4/1)")


def smem():
    v = K.KernelVariant("float16", 128, 16)
    ker = K.cupy_kernels(v)
    fn = ker.module.get_function(v.v1_name)
    print(f"smem: static {fn.shared_size_bytes} B, default max dynamic {fn.max_dynamic_shared_size_bytes} B, "
          f"opt-in limit {ker.smem_optin} B")
    case = T.make_case(v, [12288, 5], 2, 1, seed=2)  # v1 dynamic smem = 49152 bytes exactly
    out, _ = run(ker, case, "v1")
    T.assert_close(out, case.reference(), "float16", "v1 at 48 KiB")
    print("smem: ok (v1 launched with 48 KiB dynamic + static shared memory)")


def quantized():
    """Issue 18's kernels on the GPU, the cases tests/attention/cuda/test_kernels_quantized.py runs on the emulator:
    v1 and v2 against the dequantized (exact up to fp32) and unquantized (bounded) float64 references,
    reshape_and_cache bit-equal to the float32 reference quantizer (so to the emulator, which is too:
    this is where sm_89+'s hardware fp8 conversion meets the software one)."""
    import cupy
    import test_kernels_quantized as Q

    worst = {}
    for kv in K.QUANTIZED_KV_DTYPES:
        for v in Q.v2_variants(kv):
            ker = K.cupy_kernels(v)
            qc = Q.make_qcase(v, [1, 37, 600, 1100], 4, 2, seed=2)
            c = qc.case
            dev = {n: cupy.asarray(a) for n, a in (("q", c.query), ("k", qc.k), ("v", qc.v), ("ks", qc.k_scales),
                                                    ("vs", qc.v_scales), ("bt", c.block_tables), ("sl", c.seq_lens_arr))}
            for ver in ("v1", "v2"):
                out = cupy.empty(c.query.shape, dtype=c.query.dtype)
                ker.paged_attention(out, dev["q"], dev["k"], dev["v"], dev["bt"], dev["sl"], c.max_seq_len, c.scale,
                                    version=ver, k_scales=dev["ks"], v_scales=dev["vs"])
                got = T.to_f64(cupy.asnumpy(out), v.dtype)
                worst[kv] = max(worst.get(kv, 0.0), Q.check(qc, got, f"{v} {ver}"))
            rng = np.random.default_rng(3)
            x = rng.standard_normal((2, 9, 2, v.head_size)) * 30
            key, value = (cupy.asarray(T.to_device_dtype(a, v.dtype)) for a in x)
            shape = (4, v.block_size, 2, v.head_size)
            kc, vc = cupy.zeros(shape, v.cache_np_dtype), cupy.zeros(shape, v.cache_np_dtype)
            if kv == "int8":
                ks, vs = cupy.zeros(shape[:3], np.float32), cupy.zeros(shape[:3], np.float32)
            else:
                ks, vs = (cupy.full((1,), s, np.float32) for s in Q.FP8_SCALE)
            slots = np.arange(9, dtype=np.int64) * 3
            ker.reshape_and_cache(key, value, kc, vc, cupy.asarray(slots), ks, vs)
            for cache, scales, src, fp8_scale in ((kc, ks, x[0], Q.FP8_SCALE[0]), (vc, vs, x[1], Q.FP8_SCALE[1])):
                want, want_s = Q.quantize(T.to_f64(T.to_device_dtype(src, v.dtype), v.dtype), kv, fp8_scale)
                rows = cupy.asnumpy(cache).reshape(-1, 2, v.head_size)[slots]
                assert np.array_equal(rows, want), f"{v}: reshape_and_cache bits differ from the reference quantizer"
                if kv == "int8":
                    assert np.array_equal(cupy.asnumpy(scales).reshape(-1, 2)[slots], want_s)
        # The grouped kernels of a quantized cache (K.group_for's pick): within the references, and
        # level with one head per block.
        for j, (d, h, b, heads, kv_heads, g) in enumerate(Q.GROUPED):
            v = K.KernelVariant(d, h, b, kv, g)
            ker = K.cupy_kernels(v)
            qc = Q.make_qcase(v, [1, 37, 600, 1100], heads, kv_heads, seed=20 + j)
            c = qc.case
            dev = [cupy.asarray(a) for a in (c.query, qc.k, qc.v, c.block_tables, c.seq_lens_arr, qc.k_scales,
                                             qc.v_scales)]
            for ver in ("v1", "v2"):
                got = {}
                for group in (g, 1):
                    out = cupy.empty(c.query.shape, dtype=c.query.dtype)
                    ker.paged_attention(out, *dev[:5], c.max_seq_len, c.scale, version=ver, k_scales=dev[5],
                                        v_scales=dev[6], group=group)
                    got[group] = T.to_f64(cupy.asnumpy(out), v.dtype)
                worst[kv] = max(worst[kv], Q.check(qc, got[g], f"{v} {ver} group {g}"))
                T.assert_close(got[g], got[1], v.dtype, f"{v} {ver}: group {g} vs one head")
    print("quantized: ok (one-head and grouped); worst error vs unquantized float64: "
          + ", ".join(f"{kv} {e:.3g}" for kv, e in worst.items()))


def prefill():
    """The varlen prefill kernel once per dtype, grouped and one head per block, a sliding window over
    NaN placeholders on the last: the emulator's cases (test_prefill_kernel.py), short enough for racecheck."""
    import cupy
    import test_prefill_kernel as P
    import torch

    from pagedrun.attention.cuda import paged_step
    from pagedrun.attention.cuda.emulated_backend import as_numpy

    for i, shape in enumerate(P.SHAPES[:3]):
        v, heads, kv_heads, window = P.variant_of(*shape), shape[3], shape[4], 20 if i == 2 else 0
        spec = T.StepSpec([13, 0, 40], [30, 45, 21])
        query, kc, vc, meta, seqs, ref, rows = P.prefill_case(v, spec, heads, kv_heads, seed=6, window=window)
        ker = K.cupy_kernels(v)
        q, k_cache, v_cache = (cupy.asarray(as_numpy(t)) for t in (query, kc, vc))
        tables = cupy.asarray(as_numpy(meta.block_tables.to(torch.int32).contiguous()))
        for group in dict.fromkeys((v.launch_group(heads, kv_heads), 1)):
            out = cupy.zeros(q.shape, dtype=q.dtype)
            tiles = cupy.asarray(paged_step.prefill_tiles(seqs, v.prefill_tile_q(group)))
            ker.prefill_attention(out, q, k_cache, v_cache, tables, tiles, int((seqs[:, 2] + seqs[:, 3]).max()),
                                  v.head_size**-0.5, group, window=window)
            cupy.cuda.runtime.deviceSynchronize()
            got = T.to_f64(cupy.asnumpy(out), v.dtype)
            T.assert_close(got[rows], ref[rows], v.dtype, f"prefill {v} group {group} window {window}")
    print("prefill: ok (varlen prefill kernel, grouped and one head per block, x 3 dtypes, a window)")


if __name__ == "__main__":
    for what in sys.argv[1:] or ["small"]:
        globals()[what]()
