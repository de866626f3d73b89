"""The kernels through CuPy on a real GPU: the same cases as tests/attention/cuda/test_kernels.py, each output checked
against the float64 reference AND against the CPU emulator's output for the same inputs.

Skipped without a GPU (cupy.is_available() false). Backend-level checks need a CUDA build of torch
(torch.cuda.is_available()) since CupyAttentionBackend shares torch's CUDA tensors through DLPack.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention" / "cuda"))  # the emulator tests' cases
import test_kernels as T  # noqa: E402

from pagedrun.attention.cuda import kernels as K  # noqa: E402


def _gpu() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="no CUDA GPU (cupy.is_available() is false)")]


def _emulator() -> bool:
    try:
        import pagedrun.build.cudaemu  # noqa: F401

        return True
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def gpu_kernels(dtype: str) -> dict[K.KernelVariant, K.PagedKernels]:
    import cupy

    variants = list(dict.fromkeys(T.head_sweep(dtype) + T.block_sweep(dtype) + T.v2_variants(dtype)))
    return K.build_kernels(K.cupy_module_factory, variants, cupy)


def run_gpu(case: T.Case, version: str | None, max_seq_len: int | None = None, window: int = 0,
            softcap: float = 0.0, sinks: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    import cupy

    ker = gpu_kernels(case.variant.dtype)[case.variant]
    d = {n: cupy.asarray(getattr(case, n)) for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens_arr")}
    out = cupy.empty(case.query.shape, dtype=case.query.dtype)
    used = ker.paged_attention(
        out, d["query"], d["key_cache"], d["value_cache"], d["block_tables"], d["seq_lens_arr"],
        max_seq_len or case.max_seq_len, case.scale, version=version, window=window, softcap=softcap,
        sinks=None if sinks is None else cupy.asarray(sinks),
    )
    cupy.cuda.get_current_stream().synchronize()
    return T.to_f64(cupy.asnumpy(out), case.variant.dtype), used


def check(case: T.Case, version: str, window: int = 0, softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    ref = case.reference(window, softcap, sinks)
    gpu, used = run_gpu(case, version, window=window, softcap=softcap, sinks=sinks)
    assert used == version
    T.assert_close(gpu, ref, case.variant.dtype, f"gpu {case.variant} {version} window {window} softcap {softcap}")
    if _emulator():
        emu, _ = T.run_case(T.emu_kernels(case.variant.dtype)[case.variant], case, version, window, softcap, sinks)
        # __expf and FMA contraction differ from the emulator's expf: compare at the dtype's tolerance
        T.assert_close(gpu, emu, case.variant.dtype, f"gpu vs emulator {case.variant} {version}")


@pytest.mark.parametrize("dtype,i", T.HEAD_CASES, ids=[f"{d}-h{K.HEAD_SIZES[i]}" for d, i in T.HEAD_CASES])
def test_gpu_v1_every_head_size(dtype, i):
    variant = T.head_sweep(dtype)[i]
    bs = variant.block_size
    heads, kv = T.heads_for(T.GQA_RATIOS[i % 3])
    check(T.make_case(variant, [1, bs, 2 * bs + 3, 3 * bs - 1], heads, kv, seed=i), "v1")


@pytest.mark.parametrize("dtype,block_size,ratio", T.BLOCK_CASES, ids=[f"{d}-bs{b}-gqa{r}" for d, b, r in T.BLOCK_CASES])
def test_gpu_v1_block_sizes_and_gqa(dtype, block_size, ratio):
    heads, kv = T.heads_for(ratio)
    seq_lens = [37, 1, 2 * block_size, 5 * block_size - 2, 70]
    check(T.make_case(K.KernelVariant(dtype, 64, block_size), seq_lens, heads, kv, seed=block_size + ratio), "v1")


@pytest.mark.parametrize("dtype,i", T.V2_CASES)
def test_gpu_v2_several_partitions(dtype, i):
    case = T.make_case(T.v2_variants(dtype)[i], T.V2_SEQ_LENS, 4, 2, seed=100 + i)
    check(case, "v2")
    check(case, "v1")


@pytest.mark.parametrize("dtype", T.DTYPES)
@pytest.mark.parametrize("window,softcap", [(20, 0.0), (48, 2.5), (600, 0.0), (1024, 30.0)])
def test_gpu_window_and_softcap(dtype, window, softcap):
    """The emulator's window / softcap cases (tests/attention/cuda/test_kernels.py) on the GPU, NaN
    placeholders below every window: v1 and v2, short windows and ones whose v2 grid skips partitions."""
    for i, variant in enumerate(T.v2_variants(dtype)):
        lens = T.window_lens(window, variant.block_size) + ([1537, 2048] if window >= 600 else [])
        case = T.poison_below_window(T.make_case(variant, lens, 4, 2, seed=window + i), window)
        check(case, "v1", window, softcap)
        check(case, "v2", window, softcap)


@pytest.mark.parametrize("dtype", T.DTYPES)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (128, 0.0), (600, 30.0)])
def test_gpu_sinks(dtype, window, softcap):
    """GPT-OSS's attention sinks (tests/attention/cuda/test_kernels_sinks.py) on the GPU: v1, and v2 whose
    reduce adds each sink once (rows of one partition and of several), a dominant and a -40 sink."""
    for i, variant in enumerate(T.v2_variants(dtype)):
        lens = [1, 17, 128, 129, 512, 513, 1100, 1537]
        case = T.make_case(variant, lens, 4, 2, seed=window + i)
        if window:
            T.poison_below_window(case, window)
        sinks = np.array([1.5, 100.0, -40.0, -0.5], np.float32)
        check(case, "v1", window, softcap, sinks)
        check(case, "v2", window, softcap, sinks)


def test_gpu_v1_above_48k_shared_memory():
    """v1 forced on 16k tokens needs 64 KiB of logits: the launcher must opt in to it."""
    variant = K.KernelVariant("float16", 64, 16)
    case = T.make_case(variant, [16384, 5], 2, 1, seed=3)
    assert K.v1_shared_mem(16384, 64, 16) > K.DEFAULT_SMEM_LIMIT
    gpu, _ = run_gpu(case, "v1")
    T.assert_close(gpu, case.reference(), "float16", "v1 64 KiB smem")


@pytest.mark.parametrize("dtype", T.DTYPES)
def test_gpu_cache_ops(dtype):
    import cupy

    rng = np.random.default_rng(3)
    variant = T.v2_variants(dtype)[0]
    ker = gpu_kernels(dtype)[variant]
    bs, D, kvh, nb, n = variant.block_size, variant.head_size, 3, 6, 9
    key = T.to_device_dtype(rng.standard_normal((n, kvh, D)), dtype)
    value = T.to_device_dtype(rng.standard_normal((n, kvh, D)), dtype)
    kc = T.to_device_dtype(rng.standard_normal((nb, bs, kvh, D)), dtype)
    vc = T.to_device_dtype(rng.standard_normal((nb, bs, kvh, D)), dtype)
    slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int64)
    slots[[1, 4]] = -1
    gk, gv = cupy.asarray(kc), cupy.asarray(vc)
    ker.reshape_and_cache(cupy.asarray(key), cupy.asarray(value), gk, gv, cupy.asarray(slots))
    for t, s in enumerate(slots):
        if s >= 0:
            kc[s // bs, s % bs], vc[s // bs, s % bs] = key[t], value[t]
    assert np.array_equal(cupy.asnumpy(gk), kc) and np.array_equal(cupy.asnumpy(gv), vc)



def _torch_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA (CPU wheel): CupyAttentionBackend works on torch CUDA tensors")
    return torch


@pytest.mark.parametrize("prefill", ["varlen", "sdpa", "kernel"])  # varlen kernel (default), SDPA, pseudo-sequences
@pytest.mark.parametrize("case", T.BACKEND_CASES, ids=[f"{c[0]}-h{c[1]}-bs{c[2]}" for c in T.BACKEND_CASES])
def test_gpu_backend_mixed_step(case, prefill):
    torch = _torch_cuda()
    from pagedrun.attention.cuda.cupy_backend import CupyAttentionBackend

    dtype_name, D, bs, H, KVH, spec = case
    dtype = getattr(torch, dtype_name)
    query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, dtype, D, bs, H, KVH, seed=D + bs)
    ref = T.causal_reference(query, meta, fk, fv, D**-0.5, H, KVH)
    cuda = lambda t: t.cuda()  # noqa: E731
    meta.slot_mapping, meta.block_tables = cuda(meta.slot_mapping), cuda(meta.block_tables)
    out = CupyAttentionBackend(prefill=prefill).forward(cuda(query), cuda(key), cuda(value), cuda(kc), cuda(vc),
                                                        meta, D**-0.5)
    torch.cuda.synchronize()
    T.assert_close(out.double().cpu().numpy(), ref.numpy(), dtype_name, "gpu backend")


@pytest.mark.parametrize("case", __import__("test_kernels_grouped").CASES, ids=lambda c: f"{c[0]}-h{c[1]}-b{c[2]}-{c[3]}q{c[4]}kv")
def test_gpu_grouped_kernels(case):
    """GQA-grouped v1 / v2 on the GPU against the float64 reference and the one-head kernels."""
    import cupy
    import test_kernels_grouped as G

    dtype, head, block, heads, kv = case
    v = G.variant(*case)
    ker = K.build_kernels(K.cupy_module_factory, [v], cupy)[v]  # holds the one-head kernels too
    c = T.make_case(v, G.SEQ_LENS, heads, kv, seed=head + block + heads)
    d = {n: cupy.asarray(getattr(c, n)) for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens_arr")}
    for version in ("v1", "v2"):
        outs = []
        for group in (v.group, 1):
            out = cupy.empty(c.query.shape, dtype=c.query.dtype)
            ker.paged_attention(out, d["query"], d["key_cache"], d["value_cache"], d["block_tables"],
                                d["seq_lens_arr"], c.max_seq_len, c.scale, version=version, group=group)
            outs.append(T.to_f64(cupy.asnumpy(out), dtype))
        T.assert_close(outs[0], c.reference(), dtype, f"gpu grouped {v} {version}")
        T.assert_close(outs[0], outs[1], dtype, f"gpu grouped vs one-head {v} {version}")
