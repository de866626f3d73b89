"""Attention sinks (GPT-OSS) in the CUDA kernels, run on the CPU through the emulator: v1 (the sink in
the block's max and exp-sum), v2 (the sink in the reduce only, once for all the partitions, the
one-partition shortcut included), grouped (bit for bit the one-head kernel), quantized caches, and
the emulated backend's forward (kernel prefill as pseudo-sequences, SDPA prefill), each against a
float64 reference with the sink as one more logit with a zero value vector. Windows and soft-capping
ride along, with NaN placeholder blocks below each window. The planted bugs (a sink dropped, added
per partition, skipped by the reduce's shortcut) are in test_kernel_mutations.py.

One emulator module holds every variant these tests launch (one g++ run, cached on disk).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import test_kernels as T  # noqa: E402
import torch
from test_kernels_quantized import dequantize, make_qcase

from pagedrun.attention.cuda import kernels as K  # noqa: E402

ONE_HEAD = [K.KernelVariant("float16", 64, 16), K.KernelVariant("bfloat16", 128, 32),
            K.KernelVariant("float32", 64, 8)]
GROUPED = [K.KernelVariant("float16", 64, 16, "auto", 2), K.KernelVariant("bfloat16", 128, 32, "auto", 4)]
QUANTIZED = [K.KernelVariant("float16", 64, 16, "fp8_e4m3"), K.KernelVariant("bfloat16", 128, 32, "int8")]
VARIANTS = ONE_HEAD + GROUPED + QUANTIZED


@functools.lru_cache(maxsize=None)
def emu_kernels() -> dict[K.KernelVariant, K.PagedKernels]:
    from pagedrun.build.cudaemu import EmuModule
    from pagedrun.build.cudaemu.module import MAX_OPT_IN_SHARED

    names = list(dict.fromkeys(n for v in VARIANTS for n in v.name_expressions(("v1", "v2", "cache"))))
    module = EmuModule(K.full_source(), name_expressions=names, filename="kernels/cuda/paged_attention.cu")
    kers = {v: K.PagedKernels(v, module, np) for v in VARIANTS}
    for ker in kers.values():
        ker.smem_optin = MAX_OPT_IN_SHARED
    return kers


@pytest.fixture(scope="module")
def emu():
    T.emulator_or_skip()
    return emu_kernels()


def make_sinks(heads: int, seed: int, dominant: float = 100.0) -> np.ndarray:
    """float32 [heads]: sinks about the logits' size, one that dominates them all (100 overflows a float32
    exp(sink - max logit) taken naively), one far below them (-40) where there are heads enough."""
    rng = np.random.default_rng(seed)
    sinks = (rng.standard_normal(heads) * 1.5 + 1.0).astype(np.float32)
    if heads > 2:
        sinks[seed % heads] = dominant
        sinks[(seed + 1) % heads] = -40.0
    return sinks


# Lengths: 1 key; one partition (v2's reduce takes its shortcut without sinks); a block boundary;
# partition boundaries (512, 513); several partitions.
SEQ_LENS = [1, 17, 48, 512, 513, 1100, 1537]
# (window, softcap): full attention; a window inside one partition; one over two partitions, capped.
VARIANT_CASES = [(0, 0.0), (20, 0.0), (600, 5.0), (0, 2.5)]


@pytest.mark.parametrize("i", range(len(ONE_HEAD)), ids=[str(v) for v in ONE_HEAD])
@pytest.mark.parametrize("window,softcap", VARIANT_CASES, ids=[f"w{w}-cap{c:g}" for w, c in VARIANT_CASES])
def test_sinks_v1_v2(emu, i, window, softcap):
    variant = ONE_HEAD[i]
    case = T.make_case(variant, SEQ_LENS, 4, 2, seed=i + window)
    if window:
        T.poison_below_window(case, window)
    sinks = make_sinks(4, i + window)
    ref = case.reference(window, softcap, sinks)
    for version in ("v1", "v2"):
        out, used = T.run_case(emu[variant], case, version, window, softcap, sinks)
        assert used == version
        T.assert_close(out, ref, variant.dtype, f"{variant} {version} window {window} softcap {softcap}")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_sinks_bite(emu, version):
    """Sinks of the logits' size move every head: the output is the reference's with them, far from the
    one without them and from the one with each sink counted twice (a partition's or the reduce's
    double count)."""
    variant = ONE_HEAD[2]
    case = T.make_case(variant, [1, 40, 513, 1100, 1537], 4, 2, seed=3)
    sinks = np.array([1.0, 2.5, -0.5, 3.0], np.float32)
    out, _ = T.run_case(emu[variant], case, version, sinks=sinks)
    T.assert_close(out, case.reference(sinks=sinks), "float32", version)
    assert T.rel_err(out, case.reference()) > 1e-2
    assert T.rel_err(out, case.reference(sinks=np.log(2 * np.exp(sinks.astype(np.float64))))) > 1e-2
    # the reduce's one-partition rows as well (the 40-token sequence)
    assert np.abs(out[1] - case.reference()[1]).max() > 1e-2


def test_minus_inf_sinks_are_no_sinks(emu):
    variant = ONE_HEAD[2]
    case = T.make_case(variant, [1, 40, 1100], 4, 2, seed=4)
    for version in ("v1", "v2"):
        plain, _ = T.run_case(emu[variant], case, version)
        off, _ = T.run_case(emu[variant], case, version, sinks=np.full(4, -np.inf, np.float32))
        np.testing.assert_allclose(off, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("i", range(len(GROUPED)), ids=[str(v) for v in GROUPED])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_grouped_sinks_equal_reference_and_the_one_head_kernel(emu, i, version):
    """A grouped block's GROUP heads each take their own sink: the reference, and bit for bit the
    one-head kernel (the same sums in the same order)."""
    v = GROUPED[i]
    heads, kv = 2 * v.group, 2
    for window in (0, 600):
        case = T.make_case(v, [1, 17, 700, 1100], heads, kv, seed=window + i)
        if window:
            T.poison_below_window(case, window)
        sinks = make_sinks(heads, window + i)
        grouped, used = T.run_case(emu[v], case, version, window, 0.0, sinks)
        assert used == version
        T.assert_close(grouped, case.reference(window, 0.0, sinks), v.dtype, f"{v} {version} window {window}")
        out = case.empty_out()  # the variant's one-head kernel: group 1 forced
        emu[v].paged_attention(out, case.query, case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens_arr, case.max_seq_len, case.scale, version=version, group=1,
                               window=window, sinks=sinks)
        np.testing.assert_array_equal(grouped, T.to_f64(out, v.dtype))


@pytest.mark.parametrize("i", range(len(QUANTIZED)), ids=[str(v) for v in QUANTIZED])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_quantized_sinks(emu, i, version):
    """A 1-byte cache's kernels take the sinks like the others: against the float64 attention over the
    dequantized cache, with a window and NaN codes / scales below it."""
    v = QUANTIZED[i]
    window = 600 if i == 0 else 0
    qc = make_qcase(v, [1, 17, 513, 1100], 4, 2, seed=50 + i, window=window, softcap=3.0 * i)
    sinks = make_sinks(4, i)
    c = qc.case
    out = c.empty_out()
    used = emu[v].paged_attention(out, c.query, qc.k, qc.v, c.block_tables, c.seq_lens_arr, c.max_seq_len, c.scale,
                                  version=version, k_scales=qc.k_scales, v_scales=qc.v_scales, window=qc.window,
                                  softcap=qc.softcap, sinks=sinks)
    assert used == version
    f32 = dataclasses.replace(c.variant, dtype="float32", kv_dtype="auto")
    ref = dataclasses.replace(c, variant=f32, query=T.to_f64(c.query, c.variant.dtype),
                              key_cache=dequantize(qc.k, qc.kv, qc.k_scales),
                              value_cache=dequantize(qc.v, qc.kv, qc.v_scales)).reference(qc.window, qc.softcap, sinks)
    T.assert_close(T.to_f64(out, v.dtype), ref, v.dtype, f"{v} {version}")


def test_sinks_argument_checks(emu):
    variant = ONE_HEAD[2]
    case = T.make_case(variant, [5, 9], 4, 2, seed=1)
    for bad in (np.zeros(3, np.float32), np.zeros(4, np.float64), np.zeros((4, 1), np.float32)):
        with pytest.raises(ValueError, match="sinks must be contiguous float32"):
            T.run_case(emu[variant], case, "v1", sinks=bad)


# ------------------------------------------------------------------ the emulated backend


BACKEND_CASES = [
    # (dtype, head_size, block_size, heads, kv_heads, spec, window, softcap)
    ("float16", 64, 16, 4, 2, T.StepSpec([0, 40, 70, 0], [50, 3, 1, 1]), 0, 0.0),
    ("float16", 64, 16, 4, 2, T.StepSpec([16, 0, 33, 90], [4, 6, 1, 1]), 20, 5.0),
    ("bfloat16", 128, 32, 8, 2, T.StepSpec([700, 5, 64], [2, 1, 1]), 600, 0.0),  # v2 pseudo-sequences
]


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
@pytest.mark.parametrize("case", BACKEND_CASES, ids=[f"{c[0]}-w{c[6]}-cap{c[7]:g}" for c in BACKEND_CASES])
def test_emulated_backend_sinks(emu, case, prefill):
    """forward(sinks=) on mixed steps: prefill tokens as pseudo-sequences through the kernels or through
    attend_prefills (the GPU path's SDPA, explicit scores with the sink), decodes through the kernels."""
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    dtype_name, D, bs, H, KVH, spec, window, softcap = case
    dtype = getattr(torch, dtype_name)
    backend = EmulatedAttentionBackend(kernels=lambda v: emu[v], prefill=prefill)
    query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, dtype, D, bs, H, KVH, seed=window + H)
    if window:
        assert T.placeholders_below_window(meta, kc, vc, window) > 0
    sinks = torch.from_numpy(make_sinks(H, window + 1))
    scale = D**-0.5
    out = backend.forward(query, key, value, kc, vc, meta, scale, window=window, softcap=softcap, sinks=sinks)
    ref = T.causal_reference(query, meta, fk, fv, scale, H, KVH, window, softcap, sinks)
    T.assert_close(out.double().numpy(), ref.numpy(), dtype_name, f"backend {prefill}")
    assert (out[sum(spec.query_lens):] == 0).all(), "padding rows must stay zero"
    without = T.causal_reference(query, meta, fk, fv, scale, H, KVH, window, softcap)
    assert T.rel_err(out.double().numpy(), without.numpy()) > 1e-2
