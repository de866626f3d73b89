"""The CUDA kernels with a quantized KV cache (issue 18: fp8 e4m3 / e5m2, int8), run on the CPU
through the emulator, against float64 references (helpers from test_kernels.py).

Two references per case, on random data (never zeros) with every unused cache slot poisoned (fp8:
the NaN code; int8: a NaN row scale), so a read past the end shows up as NaN:
- the float64 attention over the *dequantized* cache: what the kernel must compute exactly up to
  float32 arithmetic and the output's rounding, so the model dtype's tolerance (TOL) applies;
- the float64 attention over the *unquantized* K/V: the quantization error itself, bounded per KV
  dtype (QUANT_TOL, set from measured errors with a 2-3x margin).
reshape_and_cache must produce exactly the reference quantizer's bits (and int8 row scales).
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import test_kernels as T  # noqa: E402
import torch

from pagedrun.attention.cuda import kernels as K  # noqa: E402

KV = K.QUANTIZED_KV_DTYPES
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
# max |out - ref| / max |ref| against the unquantized float64 attention. Measured over this file's
# 17 attention cases per KV dtype (2026-11-23): e4m3 0.026-0.053, e5m2 0.047-0.099, int8 0.0037-0.010;
# the bounds leave about 2x. (Outputs are small averages of V rows and q is scaled up so the softmax is
# peaked, so these are larger than the round-trip errors of K/V themselves.)
QUANT_TOL = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2, "int8": 0.02}
# fp8 per-layer scales: N(0, 1) data over a scale of 1/16 spans about +-70 in fp8 units.
FP8_SCALE = (0.0625, 0.078125)
V2_VARIANTS = {"float16": (64, 16), "bfloat16": (128, 32), "float32": (96, 8)}


# ------------------------------------------------------------------ reference quantizer (float32, as the kernels)


def quantize(x: np.ndarray, kv: str, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x (float64 holding model-dtype values, [..., head_size]) -> (codes, float32 scales).
    fp8: scales = [scale]; int8: one per row (max|x| / 127), NaN rows give code 0 and a NaN scale."""
    x32 = np.asarray(x, np.float32)
    if kv in FP8:
        dt, top = FP8[kv]
        t = (torch.from_numpy(x32) / torch.tensor(scale, dtype=torch.float32)).clamp(-top, top)
        return t.to(dt).view(torch.uint8).numpy(), np.array([scale], np.float32)
    amax = np.abs(x32).max(axis=-1)
    s = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.rint(x32 / s[..., None])  # numpy's rint rounds half to even, like __float2int_rn
    q = np.where(np.isfinite(q), np.clip(q, -127, 127), 0).astype(np.int8)
    return q, s


def dequantize(codes: np.ndarray, kv: str, scales: np.ndarray) -> np.ndarray:
    if kv in FP8:
        dt, _ = FP8[kv]
        return torch.from_numpy(codes).view(dt).double().numpy() * np.float64(scales[0])
    return codes.astype(np.float64) * scales.astype(np.float64)[..., None]


@dataclasses.dataclass
class QCase:
    case: T.Case  # query in the model dtype; key/value_cache: unquantized (model dtype)
    kv: str
    k: np.ndarray
    v: np.ndarray  # quantized caches
    k_scales: np.ndarray
    v_scales: np.ndarray
    window: int = 0  # the launch's sliding window and logit cap (0: off), the references' too
    softcap: float = 0.0

    def dequantized_reference(self) -> np.ndarray:
        c = self.case
        f32 = dataclasses.replace(c.variant, dtype="float32", kv_dtype="auto")
        return dataclasses.replace(
            c, variant=f32, query=T.to_f64(c.query, c.variant.dtype),
            key_cache=dequantize(self.k, self.kv, self.k_scales), value_cache=dequantize(self.v, self.kv, self.v_scales),
        ).reference(self.window, self.softcap)

    def reference(self) -> np.ndarray:
        """The float64 attention over the unquantized K/V."""
        return self.case.reference(self.window, self.softcap)

    def run(self, ker: K.PagedKernels, version: str | None, group: int | None = None) -> tuple[np.ndarray, str]:
        c = self.case
        out = c.empty_out()
        used = ker.paged_attention(out, c.query, self.k, self.v, c.block_tables, c.seq_lens_arr, c.max_seq_len,
                                   c.scale, version=version, k_scales=self.k_scales, v_scales=self.v_scales,
                                   group=group, window=self.window, softcap=self.softcap)
        return T.to_f64(out, c.variant.dtype), used


def make_qcase(variant: K.KernelVariant, seq_lens: list[int], num_heads: int, num_kv_heads: int, seed: int,
               window: int = 0, softcap: float = 0.0) -> QCase:
    """window > 0: the keys below each window are NaN before quantizing (fp8: the NaN code; int8: a NaN
    row scale) and the blocks wholly below it NaN placeholders (test_kernels.poison_below_window)."""
    base = dataclasses.replace(variant, kv_dtype="auto")
    case = T.make_case(base, seq_lens, num_heads, num_kv_heads, seed=seed)
    if window:
        T.poison_below_window(case, window)
    d = variant.dtype
    k, ks = quantize(T.to_f64(case.key_cache, d), variant.kv_dtype, FP8_SCALE[0])
    v, vs = quantize(T.to_f64(case.value_cache, d), variant.kv_dtype, FP8_SCALE[1])
    return QCase(dataclasses.replace(case, variant=variant), variant.kv_dtype, k, v, ks, vs, window, softcap)


# ------------------------------------------------------------------ one emulator module per KV dtype


def head_sweep(kv: str) -> list[K.KernelVariant]:
    """Every head size once, model dtype and block size rotating."""
    return [K.KernelVariant(T.DTYPES[i % 3], h, K.BLOCK_SIZES[(i + 1) % 3], kv) for i, h in enumerate(K.HEAD_SIZES)]


def block_sweep(kv: str) -> list[K.KernelVariant]:
    return [K.KernelVariant(T.DTYPES[(i + 1) % 3], 64, b, kv) for i, b in enumerate(K.BLOCK_SIZES)]


def v2_variants(kv: str) -> list[K.KernelVariant]:
    return [K.KernelVariant(d, h, b, kv) for d, (h, b) in V2_VARIANTS.items()]


@functools.lru_cache(maxsize=None)
def emu_kernels(kv: str, schedule: str = "round_robin") -> dict[K.KernelVariant, K.PagedKernels]:
    from pagedrun.build.cudaemu import EmuModule

    variants = list(dict.fromkeys(head_sweep(kv) + block_sweep(kv) + v2_variants(kv)))
    names = [n for v in variants for n in v.name_expressions(("v1", "cache"))]
    names += [n for v in v2_variants(kv) for n in v.name_expressions(("v2",))]
    module = EmuModule(K.full_source(), name_expressions=list(dict.fromkeys(names)), schedule=schedule,
                       filename="kernels/cuda/paged_attention.cu")
    return {v: K.PagedKernels(v, module, np) for v in variants}


@pytest.fixture(scope="module")
def emu():
    T.emulator_or_skip()
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(emu_kernels, KV))
    return emu_kernels


def check(qc: QCase, out: np.ndarray, what: str) -> float:
    """Against both references; returns the quantization error (relative to the unquantized one)."""
    d = qc.case.variant.dtype
    T.assert_close(out, qc.dequantized_reference(), d, f"{what} vs dequantized")
    err = T.rel_err(out, qc.reference())
    assert err <= QUANT_TOL[qc.kv], f"{what}: quantization error {err:.3g} > {QUANT_TOL[qc.kv]}"
    assert err > 0, f"{what}: no quantization error at all: is the cache really quantized?"
    return err


# ------------------------------------------------------------------ attention


CASES = [(kv, i) for kv in KV for i in range(len(K.HEAD_SIZES))]


@pytest.mark.parametrize("kv,i", CASES, ids=[f"{kv}-h{K.HEAD_SIZES[i]}" for kv, i in CASES])
@pytest.mark.slow
def test_v1_every_head_size(emu, kv, i):
    variant = head_sweep(kv)[i]
    bs = variant.block_size
    num_heads, num_kv = T.heads_for(T.GQA_RATIOS[i % 3])
    qc = make_qcase(variant, [1, bs, 2 * bs + 3, 3 * bs - 1], num_heads, num_kv, seed=i)
    out, used = qc.run(emu(kv)[variant], "v1")
    assert used == "v1"
    check(qc, out, str(variant))


@pytest.mark.parametrize("kv", KV)
def test_v1_block_sizes_and_gqa(emu, kv):
    for j, variant in enumerate(block_sweep(kv)):
        bs = variant.block_size
        num_heads, num_kv = T.heads_for(T.GQA_RATIOS[j])
        qc = make_qcase(variant, [37, 1, 2 * bs, 5 * bs - 2, 70], num_heads, num_kv, seed=50 + j)
        check(qc, qc.run(emu(kv)[variant], "v1")[0], str(variant))


@pytest.mark.parametrize("kv", KV)
def test_v2_several_partitions_and_schedules(emu, kv):
    greedy = emu_kernels(kv, "greedy")  # same source: a disk-cache hit
    for j, variant in enumerate(v2_variants(kv)):
        qc = make_qcase(variant, T.V2_SEQ_LENS, 4, 2, seed=100 + j)
        assert K.num_partitions(qc.case.max_seq_len) == 4
        out2, used = qc.run(emu(kv)[variant], "v2")
        assert used == "v2"
        check(qc, out2, f"v2 {variant}")
        check(qc, qc.run(emu(kv)[variant], "v1")[0], f"v1 {variant}")
        out_g, _ = qc.run(greedy[variant], "v2")
        assert np.array_equal(out2, out_g), f"{variant}: schedules disagree"


@pytest.mark.parametrize("kv", KV)
def test_window_and_softcap(emu, kv):
    """A 1-byte cache under a window (W - 1, W, W + 1 keys, first key on a block boundary, and long
    sequences whose v2 grid skips the partitions below the window), capped and not: both references,
    NaN codes / scales below every window never read."""
    for j, variant in enumerate(v2_variants(kv)):
        bs = variant.block_size
        window, softcap = (600, 0.0) if j == 0 else (2 * bs + 3, 3.0 * j)
        lens = [window - 1, window, window + 1, 2 * bs + window, 1, 1100 if j == 0 else window + 5 * bs]
        qc = make_qcase(variant, lens, 4, 2, seed=300 + j, window=window, softcap=softcap)
        for version in ("v1", "v2"):
            out, used = qc.run(emu(kv)[variant], version)
            assert used == version
            check(qc, out, f"{version} {variant} window {window} softcap {softcap}")


# (dtype, head, block, heads, kv heads, group): the grouped kernels of a quantized cache
GROUPED = [("bfloat16", 128, 16, 8, 2, 4), ("float16", 64, 32, 9, 3, 3), ("float32", 96, 8, 4, 2, 2)]


@functools.lru_cache(maxsize=None)
def grouped_kernels(kv: str) -> dict[K.KernelVariant, K.PagedKernels]:
    from pagedrun.build.cudaemu import EmuModule
    from pagedrun.build.cudaemu.module import MAX_OPT_IN_SHARED

    variants = [K.KernelVariant(d, h, b, kv, g) for d, h, b, _, _, g in GROUPED]
    names = list(dict.fromkeys(n for v in variants for n in v.name_expressions(("v1", "v2"))))
    module = EmuModule(K.full_source(), name_expressions=names, filename="kernels/cuda/paged_attention.cu")
    kers = {v: K.PagedKernels(v, module, np) for v in variants}
    for ker in kers.values():
        ker.smem_optin = MAX_OPT_IN_SHARED
    return kers


@pytest.mark.parametrize("kv", KV)
@pytest.mark.slow
def test_grouped_quantized_kernels_equal_one_head_bit_for_bit(emu, kv):
    """Blocks serving up to MAX_QUANTIZED_GROUP query heads of a quantized cache add each head's
    sums in the one-head kernel's order: the same bits, v1 and v2, every KV dtype; K.group_for picks
    them (1.8x the one-head kernel's rate on an H200: docs/guide/gpu.md)."""
    for j, (v, ker) in enumerate(grouped_kernels(kv).items()):
        heads, kv_heads = GROUPED[j][3:5]
        assert K.group_for(heads, kv_heads, kv) == v.group and v.launch_group(heads, kv_heads) == v.group > 1
        qc = make_qcase(v, T.V2_SEQ_LENS, heads, kv_heads, seed=200 + j)
        for version in ("v1", "v2"):
            grouped, used = qc.run(ker, version, v.group)
            assert used == version
            check(qc, grouped, f"{version} {v}")
            np.testing.assert_array_equal(grouped, qc.run(ker, version, 1)[0], err_msg=f"{version} {v}")
        # under a window and a cap: the same bits again, NaN below the window never read
        wq = make_qcase(v, [1, 40, 700, 1100], heads, kv_heads, seed=210 + j, window=600, softcap=20.0)
        for version in ("v1", "v2"):
            grouped, _ = wq.run(ker, version, v.group)
            check(wq, grouped, f"{version} {v} window 600")
            np.testing.assert_array_equal(grouped, wq.run(ker, version, 1)[0], err_msg=f"{version} {v} window")
    with pytest.raises(ValueError, match="group"):
        K.KernelVariant("float16", 64, 16, kv, K.MAX_QUANTIZED_GROUP + 1)


def test_scales_are_applied(emu):
    """Halving every fp8 / int8 scale halves K and V: the output must follow (catches a kernel that
    reads the codes but drops the scale)."""
    for kv in KV:
        variant = v2_variants(kv)[2]  # float32 model dtype: tight tolerance
        qc = make_qcase(variant, [40, 9], 2, 2, seed=9)
        ker = emu(kv)[variant]
        half = dataclasses.replace(qc, k_scales=qc.k_scales / 2, v_scales=qc.v_scales / 2)
        a, b = qc.run(ker, "v1")[0], half.run(ker, "v1")[0]
        T.assert_close(b, half.dequantized_reference(), "float32", kv)
        assert T.rel_err(a, b) > 0.05, kv


def test_argument_checks(emu):
    variant = v2_variants("int8")[2]
    ker = emu("int8")[variant]
    qc = make_qcase(variant, [20], 2, 2, seed=3)
    c = qc.case
    args = (c.empty_out(), c.query, qc.k, qc.v, c.block_tables, c.seq_lens_arr, 20, c.scale)
    with pytest.raises(ValueError, match="needs k_scales"):
        ker.paged_attention(*args)
    with pytest.raises(ValueError, match="k_scales must be contiguous float32"):
        ker.paged_attention(*args, k_scales=qc.k_scales[:1], v_scales=qc.v_scales)
    with pytest.raises(ValueError, match="cache dtype"):
        ker.paged_attention(c.empty_out(), c.query, qc.k.view(np.uint8), qc.v.view(np.uint8), *args[4:],
                            k_scales=qc.k_scales, v_scales=qc.v_scales)
    with pytest.raises(ValueError, match="kv cache dtype 'fp4'"):
        K.KernelVariant("float16", 64, 16, "fp4")


# ------------------------------------------------------------------ cache ops


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("dtype", T.DTYPES)
def test_reshape_and_cache_bits_equal_reference(emu, kv, dtype):
    variant = next(v for v in v2_variants(kv) if v.dtype == dtype)
    rng = np.random.default_rng(3)
    bs, D, kvh, nb, n = variant.block_size, variant.head_size, 3, 6, 11
    x = rng.standard_normal((2, n, kvh, D)) * np.array([1, 40])[:, None, None, None]  # 40: fp8 saturates
    x[0, 3, 1] = 0.0  # an all-zero row: int8 scale 0, codes 0
    x[0, 4, 0, 5] = 2.5 * FP8_SCALE[0]  # ties between codes / integers
    x[1, 0, 0, 0] = -1e4  # beyond e5m2's range too at the value scale
    key, value = T.to_device_dtype(x[0], dtype), T.to_device_dtype(x[1], dtype)
    cache_shape = (nb, bs, kvh, D)
    kc = np.full(cache_shape, 0x55, dtype=variant.cache_np_dtype)
    vc = kc.copy()
    if kv == "int8":
        ks, vs = np.full((nb, bs, kvh), 7.0, np.float32), np.full((nb, bs, kvh), 7.0, np.float32)
    else:
        ks, vs = np.array([FP8_SCALE[0]], np.float32), np.array([FP8_SCALE[1]], np.float32)
    slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int64)
    slots[[2, 7]] = -1  # padding: nothing written
    exp_k, exp_v, exp_ks, exp_vs = kc.copy(), vc.copy(), ks.copy(), vs.copy()
    qk, sk = quantize(T.to_f64(key, dtype), kv, FP8_SCALE[0])
    qv, sv = quantize(T.to_f64(value, dtype), kv, FP8_SCALE[1])
    for t, s in enumerate(slots):
        if s >= 0:
            exp_k[s // bs, s % bs], exp_v[s // bs, s % bs] = qk[t], qv[t]
            if kv == "int8":
                exp_ks[s // bs, s % bs], exp_vs[s // bs, s % bs] = sk[t], sv[t]
    emu(kv)[variant].reshape_and_cache(key, value, kc, vc, slots, ks, vs)
    assert np.array_equal(kc, exp_k) and np.array_equal(vc, exp_v)
    assert np.array_equal(ks, exp_ks) and np.array_equal(vs, exp_vs)
    if kv == "int8":
        s = slots[3]
        assert ks[s // bs, s % bs, 1] == 0 and (kc[s // bs, s % bs, 1] == 0).all()
    else:
        assert (vc & 0x7F == (0x7E if kv == "fp8_e4m3" else 0x7B)).any(), "saturation untested"


